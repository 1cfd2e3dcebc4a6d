//! The engine's background threads: the cleaner, which writes dirty slots
//! back ahead of the CLOCK hand so that eviction finds clean victims, the
//! read-ahead workers, which fault in the blobs a sequential reader will
//! ask for next, and the reaper, which ends revoked leases at their
//! deadline.

use std::time::{Duration, Instant};

use parking_lot::MutexGuard;
use ublk_metrics::events;

use super::shared::{Core, Guard};
use super::write_back::WriteBack;
use crate::store::eviction::SlotMeta;
use crate::store::ids::BlobKey;

/// Most write-backs per cleaner submission: enough to keep the disk queue
/// busy, few enough that slots come back clean at a steady pace.
const CLEAN_BATCH: usize = 8;

/// How long the cleaner rests after a failed write-back, so a broken disk
/// does not make it spin.
const CLEAN_RETRY: Duration = Duration::from_millis(50);

/// Threads that fault read-ahead blobs in, one extent each at a time: the
/// swap sees this many reads in flight, not one read and a hand-off gap.
pub(in crate::store) const READ_AHEAD_WORKERS: usize = 3;

/// The cleaner thread: while clean plus free slots are below the low
/// watermark, writes back the dirty unpinned slots the CLOCK hand will
/// reach next, a batch per submission and without the lock, so demand
/// eviction finds clean victims and disk writes overlap the network.
/// Stays clear of flushes, which do their own write-back.
pub(in crate::store) fn clean(core: &Core) {
    let mut g = core.state.lock();
    // Between the watermarks: keep cleaning once started.
    let mut active = false;
    while !g.background.stopping {
        let clean = g.slots.len() - g.slots.n_dirty;
        active = (active && clean < 2 * g.slots.low_water()) || g.slots.below_low_water();
        if g.transit.flush_waiting > 0 || !active {
            g.background.cleaner_kicked = false;
            core.kick.wait(&mut g);
            continue;
        }
        let st = &mut *g;
        let want = (2 * st.slots.low_water())
            .saturating_sub(st.slots.len() - st.slots.n_dirty)
            .clamp(1, CLEAN_BATCH);
        let batch = st.slots.dirty_ahead(want);
        let plan = match WriteBack::plan(st, &core.swap, &batch, false) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(event = events::CLEANER_FAILED, error = %e, "background write-back could not be planned");
                MutexGuard::unlocked(&mut g, || std::thread::sleep(CLEAN_RETRY));
                continue;
            }
        };
        if plan.is_empty() {
            // Every dirty slot is pinned or no extent is free: wait for
            // the next change rather than spin.
            g.background.cleaner_kicked = false;
            core.kick.wait(&mut g);
            continue;
        }
        if let Err(e) = core.write_back(&mut g, &plan, false, true) {
            tracing::warn!(event = events::CLEANER_FAILED, error = %e, "background write-back failed; slots stay dirty");
            MutexGuard::unlocked(&mut g, || std::thread::sleep(CLEAN_RETRY));
        }
    }
}

/// The lease reaper: ends each revoked lease not given back by its
/// deadline, at the deadline. The force-end hook revokes the holder's
/// remote access then, so a client that ignores REVOKE keeps its RDMA key
/// no longer than the deadline, whether or not it or anyone else touches
/// the lease or the slot again; requests waiting for a slot are woken.
pub(in crate::store) fn reap_leases(core: &Core) {
    let mut g = core.state.lock();
    while !g.background.stopping {
        let st = &mut *g;
        if st.leases.end_overdue(&mut st.slots, Instant::now()) > 0 {
            core.settled.notify_all();
        }
        match g.leases.next_due() {
            Some(due) => {
                let _ = core.reap.wait_until(&mut g, due);
            }
            None => core.reap.wait(&mut g),
        }
    }
}

/// A read-ahead worker: faults queued read-ahead blobs in, one at a
/// time, until the store stops. Several run, so several extents are in
/// flight while the readers consume the ones already loaded.
pub(in crate::store) fn read_ahead_worker(core: &Core) {
    let mut g = core.state.lock();
    while !g.background.stopping {
        match g.read_ahead.next() {
            Some(key) => read_ahead_one(core, &mut g, key),
            None => core.ahead.wait(&mut g),
        }
    }
}

/// Faults in one read-ahead blob into a free or clean slot only:
/// read-ahead never writes a victim back or waits. The slot starts
/// unreferenced, so an unused guess is evicted first. With no such
/// slot the queue is dropped: the readers fault their blobs in.
fn read_ahead_one(core: &Core, g: &mut Guard<'_>, key: BlobKey) {
    let st = &mut **g;
    let Some(placed) = st
        .blobs
        .get(&key)
        .filter(|b| b.slot.is_none() && b.damaged.is_none())
        .and_then(|b| b.extent)
    else {
        return;
    };
    let slot = match st.slots.free.pop() {
        Some(s) => s,
        None => match st.slots.pick(1, true).first() {
            Some(&s) => {
                st.counters.evictions += 1;
                st.evict_slot(s);
                st.slots.free.pop().unwrap_or(s)
            }
            None => {
                st.read_ahead.drop_queue();
                return;
            }
        },
    };
    if let Some(b) = st.blobs.get_mut(&key) {
        b.slot = Some(slot);
        st.volumes.get_mut(key.0).resident += 1;
    }
    st.slots.meta[slot as usize] = SlotMeta {
        owner: Some(key),
        pins: 1,
        loading: true,
        read_ahead: true,
        ..SlotMeta::default()
    };
    st.transit.slots += 1;
    let read = core.load_unlocked(g, slot, key, &placed);
    let st = &mut **g;
    let ok = matches!(read, Ok(None));
    if st.finish_load(slot, key, ok) && ok {
        st.counters.fault_ins += 1;
    }
    core.settled.notify_all();
    match read {
        Err(e) => {
            tracing::warn!(event = events::READ_AHEAD_FAILED, error = %e, "read-ahead failed; readers fault the blobs in themselves");
        }
        Ok(Some(_)) => {
            // The reader's own fault-in reports it (counted, logged).
            tracing::debug!(
                event = events::READ_AHEAD_UNVERIFIED,
                extent = placed.extent,
                "a read-ahead image failed its check; dropped"
            );
        }
        Ok(None) => {}
    }
}
