//! Leases: the cache that lets hot blobs skip the control round trip, the
//! group of a device's transports whose caches a FLUSH or REMOVE on any
//! queue must reach, and waiting out BUSY answers caused by our own leases.
//!
//! [`LeaseCache`] and [`OwnLeases`] are plain state machines (no I/O, no
//! await); the transport's methods below drive them and talk to the peer.
//! A cached lease belongs to one control connection (its epoch) and has
//! users: while used it is not ended; revoked or drained it takes no new
//! users and the last one out ends it. A lease asked for while a REMOVE
//! starts or ends may cover a removed blob, so it is used once, not cached.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use futures::channel::oneshot;
use parking_lot::Mutex;

use super::RdmaTransport;
use crate::blob::ArenaError;
use crate::proto::{Lease, Status};

/// A lease held for one request: cached (shared) or owned by it.
pub(super) struct HeldLease {
    pub(super) key: u64,
    pub(super) lease: Lease,
    pub(super) cached: bool,
    pub(super) write: bool,
}

/// One cached lease.
pub(super) struct CachedLease {
    lease: Lease,
    write: bool,
    /// Written through since granted: a FLUSH must COMMIT it.
    dirty: bool,
    users: u32,
    epoch: u64,
    /// Revoked by the peer: no new users; the last one to leave ends it.
    revoked: bool,
    /// A FLUSH or REMOVE waits to end it itself: no new users.
    draining: bool,
    last_use: u64,
    idle: Vec<oneshot::Sender<()>>,
}

/// What [`LeaseCache::checkout`] found.
pub(super) enum Checkout {
    /// A cached lease serves the request (one more user).
    Hit(HeldLease),
    /// Ask the peer; pass `generation` to [`LeaseCache::insert`].
    /// `dropped_stale`: a lease of an earlier connection was forgotten (the
    /// peer ended it with that connection).
    Miss {
        generation: u64,
        dropped_stale: bool,
    },
}

/// What [`LeaseCache::revoke`] did.
#[derive(Debug, PartialEq)]
pub(super) enum Revoke {
    /// Not a lease of ours (already ended, or never cached).
    Unknown,
    /// Idle: taken out, end it now.
    EndNow,
    /// In use: its last user ends it.
    WhenIdle,
}

/// The leases a transport keeps across requests.
pub(super) struct LeaseCache {
    map: HashMap<u64, CachedLease>,
    capacity: usize,
    tick: u64,
    /// Bumped when a REMOVE starts and when it ends.
    generation: u64,
    /// REMOVEs in progress: nothing granted meanwhile is cached.
    removing: u32,
}

impl LeaseCache {
    /// A cache of at most `capacity` leases (0 caches none).
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            map: HashMap::new(),
            capacity,
            tick: 0,
            generation: 0,
            removing: 0,
        }
    }

    /// A cached lease on `key` good for reading (any) or writing (an ALLOC
    /// one), on connection `epoch`.
    pub(super) fn checkout(&mut self, key: u64, write: bool, epoch: u64) -> Checkout {
        self.tick += 1;
        let tick = self.tick;
        let mut dropped_stale = false;
        if let Some(e) = self.map.get_mut(&key) {
            if e.epoch != epoch {
                self.map.remove(&key);
                dropped_stale = true;
            } else if !e.revoked && !e.draining && (e.write || !write) {
                e.users += 1;
                e.last_use = tick;
                return Checkout::Hit(HeldLease {
                    key,
                    lease: e.lease,
                    cached: true,
                    write: e.write,
                });
            }
        }
        Checkout::Miss {
            generation: self.generation,
            dropped_stale,
        }
    }

    /// Caches a lease just granted (in use once) if there is room or an
    /// idle entry to evict, and no REMOVE started or ended since it was
    /// asked for at `generation`. Returns whether it is cached, and the
    /// evicted entry to end.
    pub(super) fn insert(
        &mut self,
        key: u64,
        lease: Lease,
        write: bool,
        epoch: u64,
        generation: u64,
    ) -> (bool, Option<(u64, CachedLease)>) {
        if self.capacity == 0
            || self.map.contains_key(&key)
            || self.generation != generation
            || self.removing > 0
        {
            return (false, None);
        }
        let mut evicted = None;
        if self.map.len() >= self.capacity {
            let victim = self
                .map
                .iter()
                .filter(|(_, e)| e.users == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k);
            match victim {
                Some(k) => evicted = self.map.remove(&k).map(|e| (k, e)),
                None => return (false, None),
            }
        }
        self.map.insert(
            key,
            CachedLease {
                lease,
                write,
                dirty: false,
                users: 1,
                epoch,
                revoked: false,
                draining: false,
                last_use: self.tick,
                idle: Vec::new(),
            },
        );
        (true, evicted)
    }

    /// A request is done with cached lease `held`; `wrote` after a
    /// successful write. Returns whether the lease was still cached, and
    /// the entry to end when it was revoked and this was its last user.
    pub(super) fn checkin(&mut self, held: &HeldLease, wrote: bool) -> (bool, Option<CachedLease>) {
        let Some(e) = self
            .map
            .get_mut(&held.key)
            .filter(|e| e.lease.token == held.lease.token)
        else {
            return (false, None);
        };
        e.users -= 1;
        if wrote {
            e.dirty = true;
        }
        if e.users == 0 {
            for tx in e.idle.drain(..) {
                let _ = tx.send(());
            }
        }
        let end = if e.users == 0 && e.revoked && !e.draining {
            self.map.remove(&held.key)
        } else {
            None
        };
        (true, end)
    }

    /// The peer revoked lease `token` on `key`.
    pub(super) fn revoke(&mut self, key: u64, token: u64) -> (Revoke, Option<CachedLease>) {
        let Some(e) = self.map.get_mut(&key).filter(|e| e.lease.token == token) else {
            return (Revoke::Unknown, None);
        };
        if e.users == 0 {
            (Revoke::EndNow, self.map.remove(&key))
        } else {
            e.revoked = true;
            (Revoke::WhenIdle, None)
        }
    }

    /// Takes every idle entry out.
    pub(super) fn take_idle(&mut self) -> Vec<(u64, CachedLease)> {
        self.map.extract_if(|_, e| e.users == 0).collect()
    }

    /// Every cached lease is of no use any more (their per-lease RDMA keys
    /// died with the rail a new one replaced): the idle ones are taken out
    /// to be ended now, the ones in use take no new users and their last
    /// user ends them.
    pub(super) fn retire_all(&mut self) -> Vec<(u64, CachedLease)> {
        for e in self.map.values_mut() {
            e.revoked = true;
        }
        self.take_idle()
    }

    /// Takes out the idle entries `pick` selects, up to the first one in
    /// use: that one takes no new users, and the receiver fires when it goes
    /// idle (call again then).
    pub(super) fn drain_where(
        &mut self,
        pick: impl Fn(u64, &CachedLease) -> bool,
    ) -> (Vec<(u64, CachedLease)>, Option<oneshot::Receiver<()>>) {
        let keys: Vec<u64> = self
            .map
            .iter()
            .filter(|(k, e)| pick(**k, e))
            .map(|(k, _)| *k)
            .collect();
        let mut ready = Vec::new();
        for k in keys {
            let e = self.map.get_mut(&k).expect("key listed above");
            if e.users > 0 {
                e.draining = true;
                let (tx, rx) = oneshot::channel();
                e.idle.push(tx);
                return (ready, Some(rx));
            }
            ready.extend(self.map.remove(&k).map(|e| (k, e)));
        }
        (ready, None)
    }

    /// A REMOVE starts: leases granted from now on are not cached.
    pub(super) fn remove_started(&mut self) {
        self.removing += 1;
        self.generation += 1;
    }

    /// A REMOVE ended: so are leases asked for while it ran.
    pub(super) fn remove_ended(&mut self) {
        self.removing -= 1;
        self.generation += 1;
    }
}

/// The leases a transport may hold at the peer: granted ones (in use or
/// cached) and ones being asked for. A BUSY peer (every slot pinned) may be
/// pinned by them, so a BUSY request waits for one to end and retries.
#[derive(Default)]
pub(super) struct OwnLeases {
    held: usize,
    /// Leases ended so far: a BUSY answer that raced with an end is retried
    /// even when nothing is held any more.
    ended: u64,
    /// BUSY requests waiting for a lease to end or go idle.
    waiters: Vec<oneshot::Sender<()>>,
}

/// Where a request stands in answering BUSY peers.
pub(super) struct BusyRetry {
    pinning: bool,
    ended_before: u64,
}

/// After a BUSY answer, what the request does.
pub(super) enum AfterBusy {
    /// Send it again now: a lease ended since it was sent.
    Retry,
    /// Wait for one of our leases to end or go idle, then send it again.
    Wait(oneshot::Receiver<()>),
    /// We hold none: another client pins the arena, BUSY is the answer.
    GiveUp,
}

/// BUSY requests to wake (outside the lock).
#[must_use]
pub(super) struct Wake(Vec<oneshot::Sender<()>>);

impl Wake {
    pub(super) fn wake(self) {
        for tx in self.0 {
            let _ = tx.send(());
        }
    }
}

impl OwnLeases {
    /// Before a request that may be answered BUSY. `pinning`: it asks for a
    /// lease (ALLOC/GET), so until answered it may pin a slot; it counts as
    /// held from now on.
    pub(super) fn start(&mut self, pinning: bool) -> BusyRetry {
        self.held += usize::from(pinning);
        BusyRetry {
            pinning,
            ended_before: self.ended,
        }
    }

    /// The request was answered BUSY: a pinning one pins nothing after all.
    pub(super) fn refused(&mut self, busy: &BusyRetry) -> Wake {
        if !busy.pinning {
            return Wake(Vec::new());
        }
        // Whoever waits on it rechecks.
        self.held -= 1;
        self.changed()
    }

    /// After [`refused`](Self::refused), and after ending idle cached
    /// leases if there were any: whether and when to retry.
    pub(super) fn after_busy(&mut self, busy: &BusyRetry) -> AfterBusy {
        if self.ended != busy.ended_before {
            AfterBusy::Retry
        } else if self.held == 0 {
            AfterBusy::GiveUp
        } else {
            let (tx, rx) = oneshot::channel();
            self.waiters.push(tx);
            AfterBusy::Wait(rx)
        }
    }

    /// The request is sent again: a pinning one counts as held again.
    pub(super) fn resume(&mut self, busy: &mut BusyRetry) {
        self.held += usize::from(busy.pinning);
        busy.ended_before = self.ended;
    }

    /// A lease of ours ended at the peer, or a request for one got none.
    pub(super) fn ended(&mut self) -> Wake {
        self.held = self.held.saturating_sub(1);
        self.ended += 1;
        self.changed()
    }

    /// Something a BUSY request waits on changed (a lease went idle).
    pub(super) fn changed(&mut self) -> Wake {
        Wake(std::mem::take(&mut self.waiters))
    }
}

/// The RDMA transports of one block device, one per queue.
///
/// Each member caches leases on its own connection, but a block FLUSH covers
/// writes completed on every queue and a DISCARD removes blobs that any
/// queue's cached lease may point at. So a member's FLUSH first COMMITs the
/// dirty cached leases of all members, and its REMOVE first ends every
/// member's cached leases in the range (after their current users). A BUSY
/// member also gives back the idle cached leases of the others.
#[derive(Default)]
pub struct TransportGroup {
    members: Mutex<Vec<Weak<RdmaTransport>>>,
}

impl TransportGroup {
    /// An empty group.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    fn others(&self, me: &RdmaTransport) -> Vec<Arc<RdmaTransport>> {
        let mut m = self.members.lock();
        m.retain(|w| w.strong_count() > 0);
        m.iter()
            .filter_map(Weak::upgrade)
            .filter(|t| !std::ptr::eq(Arc::as_ptr(t), me))
            .collect()
    }
}

/// Marks a REMOVE in progress on every member of a group, until dropped.
pub(super) struct Removing<'a>(&'a [&'a RdmaTransport]);

impl<'a> Removing<'a> {
    pub(super) fn start(members: &'a [&'a RdmaTransport]) -> Self {
        for t in members {
            t.leases.lock().remove_started();
        }
        Self(members)
    }
}

impl Drop for Removing<'_> {
    fn drop(&mut self) {
        for t in self.0 {
            t.leases.lock().remove_ended();
        }
    }
}

impl RdmaTransport {
    /// Makes this transport a member of `group` (the other queues of its
    /// device). A transport joins at most one group; later calls are ignored.
    pub fn join(self: &Arc<Self>, group: &Arc<TransportGroup>) {
        if self.group.set(Arc::clone(group)).is_ok() {
            group.members.lock().push(Arc::downgrade(self));
        }
    }

    /// The other members of this transport's group.
    pub(super) fn others(&self) -> Vec<Arc<RdmaTransport>> {
        self.group.get().map_or_else(Vec::new, |g| g.others(self))
    }

    /// Gives back leases the peer revoked (now, or when their last user ends).
    pub(super) async fn honour_revocations(&self) {
        let revoked = self.client.take_revocations();
        let mut end = Vec::new();
        {
            let mut c = self.leases.lock();
            for (key, token) in revoked {
                let (what, e) = c.revoke(key, token);
                if what != Revoke::Unknown {
                    self.stats.inc(|s| &s.lease_revocations);
                }
                end.extend(e.map(|e| (key, e)));
            }
        }
        for (key, e) in end {
            let _ = self.end_cached(key, e).await;
        }
    }

    pub(super) async fn end_cached(&self, key: u64, e: CachedLease) -> Result<(), ArenaError> {
        if self.client.connection_epoch() != Some(e.epoch) {
            // The connection that held it is gone; the peer released it and
            // kept what was written.
            self.lease_ended();
            return Ok(());
        }
        self.end_lease(key, e.lease, e.write).await
    }

    async fn end_lease(&self, key: u64, lease: Lease, write: bool) -> Result<(), ArenaError> {
        let r = if write {
            self.client.commit(key, lease.token).await
        } else {
            self.client.release(&[lease.token]).await
        };
        // Ended either way: a failed COMMIT/RELEASE means the connection
        // (and every lease on it) is gone.
        self.lease_ended();
        if r.is_err() {
            self.stats.inc(|s| &s.lease_failures);
        }
        r
    }

    /// A lease on `key` good for reading (any) or writing (ALLOC).
    /// `Ok(None)`: a read of a blob that does not exist.
    pub(super) async fn lease(
        &self,
        key: u64,
        write: bool,
    ) -> Result<Option<HeldLease>, ArenaError> {
        let epoch = self.client.connection_epoch().unwrap_or(0);
        let checkout = self.leases.lock().checkout(key, write, epoch);
        let generation = match checkout {
            Checkout::Hit(held) => {
                self.stats.inc(|s| &s.lease_cache_hits);
                return Ok(Some(held));
            }
            Checkout::Miss {
                generation,
                dropped_stale,
            } => {
                if dropped_stale {
                    self.lease_ended();
                }
                generation
            }
        };
        let mut busy = self.busy_start(true);
        let lease = loop {
            let r = if write {
                self.client.alloc(key).await.map(Some)
            } else {
                self.client.get(key).await
            };
            let e = match r {
                Ok(Some(l)) => break l,
                Ok(None) => {
                    self.lease_ended();
                    return Ok(None);
                }
                Err(e) if e.status() == Some(Status::Busy) => {
                    if self.busy_retry(&mut busy).await {
                        continue;
                    }
                    e
                }
                Err(e) => {
                    self.lease_ended();
                    e
                }
            };
            self.stats.inc(|s| {
                if write {
                    &s.alloc_failures
                } else {
                    &s.lease_failures
                }
            });
            return Err(e);
        };
        let (cached, evicted) = self
            .leases
            .lock()
            .insert(key, lease, write, epoch, generation);
        if let Some((k, e)) = evicted {
            let _ = self.end_cached(k, e).await;
        }
        Ok(Some(HeldLease {
            key,
            lease,
            cached,
            write,
        }))
    }

    /// Call before a request that may be answered BUSY (see
    /// [`OwnLeases::start`]).
    pub(super) fn busy_start(&self, pinning: bool) -> BusyRetry {
        self.pinned.lock().start(pinning)
    }

    /// After a BUSY answer: whether to send the request again. Idle cached
    /// leases of the group go back first; otherwise the request waits for a
    /// lease of ours to end or go idle. `false` when we hold none: another
    /// client pins the arena, and BUSY is the answer.
    pub(super) async fn busy_retry(&self, busy: &mut BusyRetry) -> bool {
        let refused = self.pinned.lock().refused(busy);
        refused.wake();
        let mut ended = 0;
        for t in self.others().iter().map(|t| &**t).chain([self]) {
            ended += t.end_idle_cached().await;
        }
        if ended == 0 {
            let next = self.pinned.lock().after_busy(busy);
            match next {
                AfterBusy::GiveUp => return false,
                AfterBusy::Retry => {}
                AfterBusy::Wait(rx) => {
                    let _ = rx.await;
                }
            }
        }
        self.pinned.lock().resume(busy);
        true
    }

    /// A lease of ours ended at the peer, or a request for one got none.
    fn lease_ended(&self) {
        let wake = self.pinned.lock().ended();
        wake.wake();
    }

    /// Ends every idle cached lease; returns how many.
    async fn end_idle_cached(&self) -> usize {
        let victims = self.leases.lock().take_idle();
        let ended = victims.len();
        for (k, e) in victims {
            let _ = self.end_cached(k, e).await;
        }
        ended
    }

    /// Gives back a lease that is of no use for RDMA (its per-lease key
    /// died with the rail it was registered for, or it has none): it takes
    /// no new users and is ended once idle, not cached again.
    pub(super) async fn give_back(&self, held: HeldLease) {
        self.leases.lock().revoke(held.key, held.lease.token);
        let _ = self.unlease(held, false).await;
    }

    /// [`Self::give_back`], then leases the key anew (its key is of the
    /// current rail); `None` when that fails.
    pub(super) async fn relet(&self, held: HeldLease, write: bool) -> Option<HeldLease> {
        let key = held.key;
        self.give_back(held).await;
        self.lease(key, write).await.ok().flatten()
    }

    /// Ends a request's use of its lease; `wrote` after a successful write.
    pub(super) async fn unlease(&self, held: HeldLease, wrote: bool) -> Result<(), ArenaError> {
        let r = self.unlease_inner(held, wrote).await;
        // Its lease ended or went idle in the cache: a BUSY request can
        // now get a slot, or shrink the cache to free one.
        let wake = self.pinned.lock().changed();
        wake.wake();
        r
    }

    async fn unlease_inner(&self, held: HeldLease, wrote: bool) -> Result<(), ArenaError> {
        if !held.cached {
            return self.end_lease(held.key, held.lease, held.write).await;
        }
        let (found, end) = self.leases.lock().checkin(&held, wrote);
        if found && wrote {
            self.client.record_acknowledged_write();
        }
        match end {
            Some(e) => self.end_cached(held.key, e).await,
            None => Ok(()),
        }
    }

    /// Ends every cached lease `pick` selects, waiting for leases in use to
    /// go idle first (they take no new users meanwhile). `commit` false
    /// releases write leases instead of committing them.
    async fn end_cached_where(
        &self,
        pick: impl Fn(u64, &CachedLease) -> bool,
        commit: bool,
    ) -> Result<(), ArenaError> {
        loop {
            let (ready, wait) = self.leases.lock().drain_where(&pick);
            for (k, e) in ready {
                let e = if commit {
                    e
                } else {
                    CachedLease { write: false, ..e }
                };
                self.end_cached(k, e).await?;
            }
            match wait {
                Some(rx) => {
                    let _ = rx.await;
                }
                None => return Ok(()),
            }
        }
    }

    /// Before a FLUSH: COMMITs the dirty cached leases (written through
    /// since granted), so the peer's FLUSH covers their writes.
    pub(super) async fn commit_dirty(&self) -> Result<(), ArenaError> {
        self.end_cached_where(|_, e| e.dirty, true).await
    }

    /// Before a REMOVE of `start..end`: ends the cached leases in the range
    /// without committing what the blobs are about to lose.
    pub(super) async fn forget_range(&self, start: u64, end: u64) -> Result<(), ArenaError> {
        self.end_cached_where(|k, _| (start..end).contains(&k), false)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use futures::FutureExt;

    fn lease(token: u64) -> Lease {
        Lease {
            slot_offset: token * 4096,
            token,
            rkey: None,
        }
    }

    fn hit(c: Checkout) -> HeldLease {
        match c {
            Checkout::Hit(h) => h,
            Checkout::Miss { .. } => panic!("expected a cache hit"),
        }
    }

    fn miss(c: Checkout) -> (u64, bool) {
        match c {
            Checkout::Miss {
                generation,
                dropped_stale,
            } => (generation, dropped_stale),
            Checkout::Hit(_) => panic!("expected a miss"),
        }
    }

    /// Caches lease `token` on `key`, granted for `write`, and returns it
    /// checked out once.
    fn granted(c: &mut LeaseCache, key: u64, token: u64, write: bool) -> HeldLease {
        let (generation, _) = miss(c.checkout(key, write, 1));
        let (cached, evicted) = c.insert(key, lease(token), write, 1, generation);
        assert!(cached && evicted.is_none());
        HeldLease {
            key,
            lease: lease(token),
            cached: true,
            write,
        }
    }

    #[test]
    fn a_write_lease_serves_reads_and_a_read_lease_no_writes() {
        let mut c = LeaseCache::new(8);
        let w = granted(&mut c, 1, 10, true);
        let r = hit(c.checkout(1, false, 1));
        assert_eq!((r.lease.token, r.write), (10, true));
        let g = granted(&mut c, 2, 20, false);
        miss(c.checkout(2, true, 1));
        for h in [w, r, g] {
            let (found, end) = c.checkin(&h, false);
            assert!(found && end.is_none());
        }
    }

    #[test]
    fn a_lease_of_an_earlier_connection_is_forgotten_on_sight() {
        let mut c = LeaseCache::new(8);
        let h = granted(&mut c, 1, 10, true);
        c.checkin(&h, true);
        let (_, stale) = miss(c.checkout(1, true, 2));
        assert!(stale, "the peer ended it with its connection");
        let (_, stale) = miss(c.checkout(1, true, 2));
        assert!(!stale, "forgotten once");
    }

    #[test]
    fn a_revoked_lease_takes_no_new_users_and_its_last_user_ends_it() {
        let mut c = LeaseCache::new(8);
        let a = granted(&mut c, 1, 10, true);
        let b = hit(c.checkout(1, true, 1));
        assert_eq!(c.revoke(1, 99).0, Revoke::Unknown, "another token");
        assert_eq!(c.revoke(1, 10).0, Revoke::WhenIdle);
        miss(c.checkout(1, false, 1));
        assert!(c.checkin(&a, true).1.is_none(), "one user left");
        let (found, end) = c.checkin(&b, false);
        assert!(found);
        let end = end.expect("the last user ends it");
        assert!(end.dirty && end.write, "ended by COMMIT: it was written");
        assert!(c.map.is_empty());
        assert!(!c.checkin(&b, false).0, "gone");
        // Idle when revoked: out at once.
        let h = granted(&mut c, 2, 20, false);
        c.checkin(&h, false);
        let (what, e) = c.revoke(2, 20);
        assert_eq!(what, Revoke::EndNow);
        assert!(e.is_some() && c.map.is_empty());
    }

    #[test]
    fn nothing_asked_for_across_a_remove_is_cached() {
        let mut c = LeaseCache::new(8);
        let (before, _) = miss(c.checkout(1, true, 1));
        c.remove_started();
        assert!(!c.insert(1, lease(10), true, 1, before).0, "remove running");
        let (during, _) = miss(c.checkout(1, true, 1));
        assert!(!c.insert(1, lease(11), true, 1, during).0, "remove running");
        c.remove_ended();
        assert!(
            !c.insert(1, lease(12), true, 1, during).0,
            "asked for before it ended"
        );
        let (after, _) = miss(c.checkout(1, true, 1));
        assert!(c.insert(1, lease(13), true, 1, after).0);
        assert!(!c.insert(1, lease(14), true, 1, after).0, "already cached");
        assert!(
            !LeaseCache::new(0).insert(1, lease(1), true, 1, 0).0,
            "no cache"
        );
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_idle_lease() {
        let mut c = LeaseCache::new(2);
        let a = granted(&mut c, 1, 10, false);
        let b = granted(&mut c, 2, 20, false);
        c.checkin(&a, false);
        c.checkin(&b, false);
        // Key 1 used again: key 2 is the least recent.
        let a = hit(c.checkout(1, false, 1));
        c.checkin(&a, false);
        let (g, _) = miss(c.checkout(3, false, 1));
        let (cached, evicted) = c.insert(3, lease(30), false, 1, g);
        assert!(cached);
        assert_eq!(evicted.map(|(k, e)| (k, e.lease.token)), Some((2, 20)));
        // Every entry in use: nothing to evict, the new lease is used once.
        let _x = hit(c.checkout(1, false, 1));
        let (g, _) = miss(c.checkout(4, false, 1));
        assert!(!c.insert(4, lease(40), false, 1, g).0);
        assert_eq!(c.map.len(), 2);
    }

    #[test]
    fn draining_waits_for_users_and_hands_out_no_more() {
        let mut c = LeaseCache::new(8);
        let a = granted(&mut c, 1, 10, true);
        c.checkin(&a, true);
        let busy = granted(&mut c, 2, 20, true);
        let clean = granted(&mut c, 3, 30, true);
        c.checkin(&clean, false);
        let (ready, wait) = c.drain_where(|k, _| k == 2);
        assert!(ready.is_empty());
        let mut rx = wait.expect("key 2 is in use");
        miss(c.checkout(2, true, 1));
        assert!(rx.try_recv().unwrap().is_none(), "still in use");
        // The last user leaves: the drainer is told, and ends it itself
        // (a revocation meanwhile would not end it under the drainer).
        assert_eq!(c.revoke(2, 20).0, Revoke::WhenIdle);
        assert!(
            c.checkin(&busy, true).1.is_none(),
            "draining: not ended here"
        );
        assert!(rx.now_or_never().is_some());
        let (ready, wait) = c.drain_where(|_, e| e.dirty);
        assert!(wait.is_none());
        let mut keys: Vec<u64> = ready.into_iter().map(|(k, _)| k).collect();
        keys.sort_unstable();
        assert_eq!(keys, [1, 2], "the written ones");
        assert!(c.map.contains_key(&3), "clean key 3 stays cached");
    }

    #[test]
    fn retiring_all_ends_the_idle_now_and_the_rest_with_their_last_user() {
        let mut c = LeaseCache::new(8);
        let a = granted(&mut c, 1, 10, true);
        let b = granted(&mut c, 2, 20, false);
        c.checkin(&b, false);
        let idle: Vec<u64> = c.retire_all().into_iter().map(|(k, _)| k).collect();
        assert_eq!(idle, [2]);
        assert!(
            matches!(c.checkout(1, false, 1), Checkout::Miss { .. }),
            "a retired lease takes no new user"
        );
        let (found, end) = c.checkin(&a, true);
        assert!(found);
        let end = end.expect("its last user ends it");
        assert!(end.write && end.dirty, "and commits what was written");
        assert!(c.map.is_empty());
    }

    #[test]
    fn take_idle_leaves_leases_in_use() {
        let mut c = LeaseCache::new(8);
        let a = granted(&mut c, 1, 10, false);
        let b = granted(&mut c, 2, 20, false);
        c.checkin(&b, false);
        let idle: Vec<u64> = c.take_idle().into_iter().map(|(k, _)| k).collect();
        assert_eq!(idle, [2]);
        assert!(c.checkin(&a, false).0, "still cached");
    }

    #[test]
    fn busy_with_nothing_of_ours_held_gives_up() {
        let mut own = OwnLeases::default();
        let busy = own.start(true);
        own.refused(&busy).wake();
        assert!(matches!(own.after_busy(&busy), AfterBusy::GiveUp));
        let plain = own.start(false);
        own.refused(&plain).wake();
        assert!(matches!(own.after_busy(&plain), AfterBusy::GiveUp));
    }

    #[test]
    fn busy_while_we_hold_a_lease_waits_for_it_to_end() {
        let mut own = OwnLeases::default();
        let _holder = own.start(true); // granted: stays held
        let mut busy = own.start(true);
        own.refused(&busy).wake();
        let AfterBusy::Wait(rx) = own.after_busy(&busy) else {
            panic!("one of ours is held: wait for it");
        };
        own.ended().wake();
        block_on(rx).unwrap();
        own.resume(&mut busy);
        assert_eq!(own.held, 1, "the retried request counts as held again");
    }

    #[test]
    fn an_end_racing_the_busy_answer_retries_at_once() {
        let mut own = OwnLeases::default();
        let _held = own.start(true);
        let busy = own.start(false);
        own.ended().wake(); // between sending and the BUSY answer
        own.refused(&busy).wake();
        assert!(matches!(own.after_busy(&busy), AfterBusy::Retry));
    }
}
