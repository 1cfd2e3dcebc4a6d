//! Handing the writer role of a volume from one process to another, the
//! way a VM's disk follows it in a live migration: a *standby* opens the
//! volume without the role (it serves reads, acknowledges no write), asks
//! the writer for the role through the coordination store
//! ([`Coordinator::acquire`](super::Coordinator::acquire)), and the writer
//! stops acknowledging, flushes every member and gives the role up
//! ([`ReplicaSet::release`]); the standby then raises the epoch, which
//! fences the old writer at every member (RDMA leases included), and
//! serves. A writer that does not answer keeps the role until its lease
//! lapses in the store. docs/REPLICATION.md ("Hand-over") states the
//! rules and why no acknowledged write is lost.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ublk_metrics::events;

use super::clock::Timers;
use super::coordinator::{CoordErrorKind, Coordinator, Lease};
use super::member::{Lane, MemberIo, MemberSessions};
use super::set::{ReplicaConfig, ReplicaCounters, ReplicaSet};
use crate::blob::{ArenaError, ReplicaFailure};
use crate::proto::Status;

/// Hand-overs a set remembers for `ublkctl show`.
pub const HANDOVER_HISTORY: usize = 8;

/// One move of the writer role, as this process saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handover {
    /// When it completed (this process's clock).
    pub at: Instant,
    /// Taken here (`true`), or handed to another process.
    pub taken: bool,
    /// The other process, as the coordination store names it.
    pub other: String,
    /// Taken: from asking the holder to serving. Handed: from the
    /// request seen to the role given up (the flush, mostly).
    pub took: Duration,
}

impl<S: MemberIo> ReplicaSet<S> {
    /// Opens the volume as a standby: reads the record and presents its
    /// epoch to every active member (the writer's own epoch: nothing is
    /// fenced), so reads can be served; no write is acknowledged until
    /// [`activate`](Self::activate) takes the role, or, with
    /// `activate_on_write`, the first write does. `sessions` must cover
    /// every active member of the record.
    pub async fn standby(
        volume: impl Into<String>,
        coord: Arc<dyn Coordinator>,
        clock: Arc<dyn Timers>,
        config: ReplicaConfig,
        sessions: Vec<(String, MemberSessions<S>)>,
        activate_on_write: bool,
    ) -> Result<Arc<Self>, ArenaError> {
        let volume: String = volume.into();
        let record = coord.load().await.map_err(|e| ArenaError::Replica {
            volume: volume.clone(),
            failure: ReplicaFailure::Unrecorded,
            detail: format!("cannot open the volume as a standby: {e}"),
        })?;
        let set = Self::build(volume, coord, clock, config, sessions, 0, record.clone())?;
        set.standby.store(true, Ordering::Release);
        set.activate_on_write
            .store(activate_on_write, Ordering::Release);
        let view = set
            .view_of(&record)
            .map_err(|why| set.refusal(ReplicaFailure::NoMember, why))?;
        set.install(view).await;
        Ok(set)
    }

    /// Whether this process serves the volume as a standby.
    pub fn is_standby(&self) -> bool {
        self.standby.load(Ordering::Acquire)
    }

    /// Whether a standby's view fell behind the record.
    pub(super) fn is_behind(&self) -> bool {
        self.behind.load(Ordering::Acquire)
    }

    /// Whether a standby takes the role on its first write.
    pub fn activates_on_write(&self) -> bool {
        self.activate_on_write.load(Ordering::Acquire)
    }

    /// Takes the writer role (a standby): asks the holder through the
    /// coordination store and waits until it handed the role over (or its
    /// lease lapsed), then raises the epoch and serves as the writer.
    /// Nothing to do for the writer itself.
    pub async fn activate(&self) -> Result<(), ArenaError> {
        let _one = self.handover.lock().await;
        if !self.is_standby() {
            return Ok(());
        }
        let started = self.clock.now();
        let holder = match self.coord.lease() {
            Lease::Taken { holder } => holder,
            _ => "the previous writer".into(),
        };
        if let Err(e) = self.coord.acquire().await {
            let failure = match e.kind {
                CoordErrorKind::LeaseHeld => ReplicaFailure::Standby,
                CoordErrorKind::Unavailable | CoordErrorKind::Corrupt => ReplicaFailure::Unrecorded,
            };
            return Err(self.refusal(failure, format!("taking the writer role: {e}")));
        }
        let Lease::Held { term, .. } = self.coord.lease() else {
            return Err(self.refusal(
                ReplicaFailure::Unrecorded,
                "taking the writer role: the store did not confirm it".into(),
            ));
        };
        let next = self.raise_role(term, "taking the writer role").await?;
        ReplicaCounters::count(&self.stats().handovers_in);
        let took = self.clock.now().saturating_duration_since(started);
        self.remember(true, holder, took);
        tracing::info!(event = events::REPLICA_ACTIVATED, volume = %self.volume(), membership = %next,
            took_ms = took.as_millis() as u64);
        Ok(())
    }

    /// Hands the writer role over: from now on nothing is acknowledged
    /// (requests in flight fail unless they were acknowledged already),
    /// every active member flushes, so that what was acknowledged is
    /// durable before another writer starts (a member whose flush fails is
    /// recorded failed, as for a guest's FLUSH), and the role is given up
    /// in the store. This process is a standby after. On an error the
    /// role is kept and the writer serves on.
    pub async fn release(&self) -> Result<(), ArenaError> {
        let _one = self.handover.lock().await;
        if self.is_standby() {
            return Ok(());
        }
        self.not_fenced()?;
        let started = self.clock.now();
        let to = self
            .coord
            .handover_asked()
            .unwrap_or_else(|| "no standby yet".into());
        self.standby.store(true, Ordering::Release);
        let released = async {
            self.flush_members().await?;
            self.coord.release().await.map_err(|e| {
                self.refusal(
                    ReplicaFailure::Unrecorded,
                    format!("giving the writer role up: {e}"),
                )
            })
        }
        .await;
        if let Err(e) = released {
            self.standby.store(false, Ordering::Release);
            if e.kind() == crate::blob::ErrorKind::Replica(ReplicaFailure::Fenced) {
                self.fence(e.to_string());
            }
            tracing::warn!(event = events::REPLICA_RELEASE_FAILED, volume = %self.volume(), error = %e);
            return Err(e);
        }
        ReplicaCounters::count(&self.stats().handovers_out);
        let took = self.clock.now().saturating_duration_since(started);
        self.remember(false, to, took);
        tracing::info!(event = events::REPLICA_RELEASED, volume = %self.volume(),
            membership = %self.membership(), took_ms = took.as_millis() as u64);
        Ok(())
    }

    /// The last hand-overs, oldest first.
    pub fn handovers(&self) -> Vec<Handover> {
        self.history.lock().iter().cloned().collect()
    }

    fn remember(&self, taken: bool, other: String, took: Duration) {
        let mut h = self.history.lock();
        if h.len() == HANDOVER_HISTORY {
            h.pop_front();
        }
        h.push_back(Handover {
            at: self.clock.now(),
            taken,
            other,
            took,
        });
    }

    /// Whether a standby asks this writer for the role (a rebuild in
    /// progress gives way to it).
    pub fn handover_wanted(&self) -> bool {
        !self.is_standby() && self.coord.handover_asked().is_some()
    }

    /// Hands the role over if a standby asked for it (the device's
    /// supervisor calls it periodically). Returns whether it did.
    pub async fn serve_handover(&self) -> Result<bool, ArenaError> {
        if !self.handover_wanted() {
            return Ok(false);
        }
        self.release().await.map(|()| true)
    }

    /// FLUSH on every active member (background sessions); members whose
    /// flush fails are recorded failed before the role is given up.
    async fn flush_members(&self) -> Result<(), ArenaError> {
        let deadline = self.clock.now() + self.config.change_deadline;
        let view = self.view();
        let epoch = view.membership.epoch;
        let mut failed = HashSet::new();
        for (m, _) in &view.active {
            let r = async {
                m.raise(Lane::Background, epoch).await?;
                m.session(Lane::Background).flush().await
            }
            .await;
            match r {
                Ok(()) => {}
                // A newer writer took the volume: nothing to hand over.
                Err(e) if e.status() == Some(Status::StaleEpoch) => {
                    return Err(self.refusal(
                        ReplicaFailure::Fenced,
                        format!("a newer writer owns the volume: {e}"),
                    ))
                }
                Err(e) => {
                    m.suspect(format!("flush before the hand-over: {e}"));
                    failed.insert(m.id);
                }
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        self.exclude(&failed, deadline).await
    }

    /// A standby whose view fell behind the record (a peer answered
    /// `STALE_EPOCH`) reads the record and serves under it: a member the
    /// writer removed is read no more.
    pub(super) async fn follow_record(&self) -> Result<(), ArenaError> {
        if !self.behind.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let until = self.clock.now() + self.config.coord_timeout;
        let record = match self.within(until, self.coord.load()).await {
            Some(Ok(r)) => r,
            other => {
                self.behind.store(true, Ordering::Release);
                let why = match other {
                    Some(Err(e)) => e.to_string(),
                    _ => "the store did not answer".into(),
                };
                return Err(self.refusal(
                    ReplicaFailure::Unrecorded,
                    format!("a standby following the volume's record: {why}"),
                ));
            }
        };
        let view = self.view_of(&record).map_err(|why| {
            self.refusal(
                ReplicaFailure::NoMember,
                format!("a standby following the volume's record: {why}"),
            )
        })?;
        self.install(view).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    use futures::executor::block_on;

    use super::*;
    use crate::blob::{BlobIo, ErrorKind};
    use crate::replica::clock::system;
    use crate::replica::fake::{FakePeer, FakeSession};
    use crate::replica::{Membership, MemoryCoordinator, Standing};

    const BLOB: u32 = 4096;

    fn config() -> ReplicaConfig {
        ReplicaConfig {
            change_deadline: Duration::from_millis(500),
            coord_timeout: Duration::from_millis(100),
            coord_retry: Duration::from_millis(10),
            ..ReplicaConfig::default()
        }
    }

    struct Hosts {
        peers: Vec<Arc<FakePeer>>,
        coord: Arc<MemoryCoordinator>,
        writer: Arc<ReplicaSet<FakeSession>>,
    }

    /// A volume on `n` fencing peers, open by its writer.
    fn writer(n: usize) -> Hosts {
        let peers: Vec<_> = (0..n)
            .map(|i| FakePeer::new(&format!("p{i}"), BLOB, system()))
            .collect();
        for p in &peers {
            p.update_fault(|f| f.fence_epochs = true);
        }
        let names: Vec<_> = peers.iter().map(|p| p.name().to_string()).collect();
        let coord = MemoryCoordinator::new(system(), Membership::new_volume(&names).unwrap());
        let writer = block_on(ReplicaSet::open(
            "vol",
            Arc::clone(&coord) as Arc<dyn Coordinator>,
            system(),
            config(),
            sessions(&peers),
        ))
        .unwrap();
        Hosts {
            peers,
            coord,
            writer,
        }
    }

    fn sessions(peers: &[Arc<FakePeer>]) -> Vec<(String, MemberSessions<FakeSession>)> {
        peers
            .iter()
            .map(|p| (p.name().to_string(), p.sessions(1)))
            .collect()
    }

    impl Hosts {
        fn standby(&self, on_write: bool) -> Arc<ReplicaSet<FakeSession>> {
            block_on(ReplicaSet::standby(
                "vol",
                self.coord.standby() as Arc<dyn Coordinator>,
                system(),
                config(),
                sessions(&self.peers),
                on_write,
            ))
            .unwrap()
        }
    }

    /// The writer's supervisor: hands the role over when asked, until
    /// `stop`.
    fn supervise(
        set: &Arc<ReplicaSet<FakeSession>>,
        stop: &Arc<AtomicBool>,
    ) -> std::thread::JoinHandle<()> {
        let (set, stop) = (Arc::clone(set), Arc::clone(stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                if let Err(e) = block_on(set.serve_handover()) {
                    eprintln!("serve_handover: {e}");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    }

    fn blob(gen: u64) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        b[..8].copy_from_slice(&gen.to_le_bytes());
        b
    }

    fn gen_of(io: &impl BlobIo, key: u64) -> u64 {
        let mut out = vec![0u8; 64];
        block_on(io.read(key, 0, &mut out)).unwrap();
        u64::from_le_bytes(out[..8].try_into().unwrap())
    }

    #[test]
    fn a_standby_serves_reads_and_sends_no_write() {
        let h = writer(2);
        block_on(h.writer.queue(0).unwrap().write(1, 0, &blob(7))).unwrap();
        let epoch = h.coord.record().epoch;
        let standby = h.standby(false);
        assert_eq!(standby.standing(), Standing::Standby);
        let io = standby.queue(0).unwrap();
        assert_eq!(gen_of(&io, 1), 7);
        let e = block_on(io.write(1, 0, &blob(8))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Standby), "{e}");
        // Nothing acknowledged, nothing to flush: it succeeds, sending nothing.
        block_on(io.flush()).unwrap();
        for p in &h.peers {
            assert_eq!(p.blob(1).unwrap()[..8], 7u64.to_le_bytes(), "{}", p.name());
            assert_eq!(p.epoch(), epoch, "the standby fenced nobody");
        }
        assert_eq!(h.coord.record().epoch, epoch, "nor changed the record");
        // The writer serves on, and the standby reads what it writes.
        block_on(h.writer.queue(0).unwrap().write(1, 0, &blob(9))).unwrap();
        assert_eq!(gen_of(&io, 1), 9);
        assert!(
            !block_on(h.writer.serve_handover()).unwrap(),
            "nobody asked"
        );
    }

    /// Under a constant write load, the standby takes the role: every
    /// write the old writer acknowledged is there, flushed (a crash of
    /// every peer keeps it), the old writer acknowledges nothing after,
    /// and the new one writes.
    #[test]
    fn a_hand_over_under_load_loses_no_acknowledged_write_and_fences_the_old_writer() {
        let h = writer(3);
        let standby = h.standby(false);
        let stop = Arc::new(AtomicBool::new(false));
        let supervisor = supervise(&h.writer, &stop);
        let load = {
            let set = Arc::clone(&h.writer);
            std::thread::spawn(move || {
                let io = set.queue(0).unwrap();
                let mut acked = vec![0u64; 16];
                for gen in 1.. {
                    let key = gen % 16;
                    match block_on(io.write(key, 0, &blob(gen))) {
                        Ok(_) => acked[key as usize] = gen,
                        Err(e) => {
                            assert_eq!(
                                e.kind(),
                                ErrorKind::Replica(ReplicaFailure::Standby),
                                "{e}"
                            );
                            return (acked, gen);
                        }
                    }
                }
                unreachable!()
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        block_on(standby.activate()).unwrap();
        let (acked, refused) = load.join().unwrap();
        stop.store(true, Ordering::Release);
        supervisor.join().unwrap();
        assert!(refused > 16, "the load ran before the hand-over");
        assert_eq!(standby.standing(), Standing::Confirmed);
        assert_eq!(h.writer.standing(), Standing::Standby);
        assert_eq!(h.writer.stats().handovers_out.load(Ordering::Relaxed), 1);
        assert_eq!(standby.stats().handovers_in.load(Ordering::Relaxed), 1);
        let (taken, handed) = (standby.handovers(), h.writer.handovers());
        assert_eq!((taken.len(), taken[0].taken), (1, true));
        assert_eq!((handed.len(), handed[0].taken), (1, false));
        assert!(handed[0].other.starts_with("standby handle"), "{handed:?}");
        // Durable at every member: the release flushed after the last
        // acknowledgement. (The refused write may have landed after that
        // flush; it was never acknowledged.)
        let io = standby.queue(0).unwrap();
        for (key, gen) in acked.iter().enumerate() {
            for p in &h.peers {
                let durable = p
                    .durable_blob(key as u64)
                    .map_or(0, |b| u64::from_le_bytes(b[..8].try_into().unwrap()));
                assert!(
                    durable >= *gen,
                    "{} key {key}: acknowledged {gen}, durable {durable}",
                    p.name()
                );
            }
            let now = gen_of(&io, key as u64);
            assert!(now >= *gen, "key {key}: acknowledged {gen}, reads {now}");
        }
        block_on(io.write(3, 0, &blob(1 << 40))).unwrap();
        assert_eq!(gen_of(&io, 3), 1 << 40);
        let old = h.writer.queue(0).unwrap();
        let e = block_on(old.write(3, 0, &blob(5))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Standby), "{e}");
        assert_eq!(gen_of(&io, 3), 1 << 40, "the old writer wrote nothing");
        // The old writer, a standby now, reads the new writer's data at
        // the new epoch.
        assert_eq!(gen_of(&old, 3), 1 << 40);
    }

    #[test]
    fn a_standby_set_to_activate_on_write_takes_the_role_at_its_first_write() {
        let h = writer(2);
        let epoch = h.coord.record().epoch;
        let standby = h.standby(true);
        let stop = Arc::new(AtomicBool::new(false));
        let supervisor = supervise(&h.writer, &stop);
        let io = standby.queue(0).unwrap();
        assert_eq!(gen_of(&io, 2), 0, "a read takes no role");
        assert_eq!(standby.standing(), Standing::Standby);
        block_on(io.write(2, 0, &blob(3))).unwrap();
        stop.store(true, Ordering::Release);
        supervisor.join().unwrap();
        assert_eq!(standby.standing(), Standing::Confirmed);
        assert_eq!(h.writer.standing(), Standing::Standby);
        assert_eq!(h.coord.record().epoch, epoch + 1);
        for p in &h.peers {
            assert_eq!(p.epoch(), epoch + 1, "{} fences the old writer", p.name());
        }
    }

    /// A flush is not a write: a standby acknowledged none, so its flush
    /// succeeds at once and never takes the role, even set to activate on
    /// write (a stopping ublkd flushes every device, a closing QEMU its
    /// disk; neither may move the role away from the running guest).
    #[test]
    fn a_standbys_flush_takes_no_role_even_set_to_activate_on_write() {
        let h = writer(2);
        let epoch = h.coord.record().epoch;
        let standby = h.standby(true);
        block_on(standby.queue(0).unwrap().flush()).unwrap();
        assert_eq!(standby.standing(), Standing::Standby);
        assert_eq!(h.writer.standing(), Standing::Confirmed);
        assert_eq!(h.coord.record().epoch, epoch);
        block_on(h.writer.queue(0).unwrap().write(1, 0, &blob(4))).unwrap();
    }

    /// The writer removes a failed member; the standby, still at the old
    /// epoch, must not read that member's stale copy: the others refuse
    /// its epoch, so it follows the record.
    #[test]
    fn a_standby_follows_the_record_past_a_removed_member() {
        let h = writer(3);
        let standby = h.standby(false);
        let wio = h.writer.queue(0).unwrap();
        block_on(wio.write(4, 0, &blob(1))).unwrap();
        h.peers[2].update_fault(|f| f.down = true);
        block_on(wio.write(4, 0, &blob(2))).unwrap();
        assert_eq!(
            h.coord.record().state("p2"),
            Some(crate::replica::MemberState::Failed)
        );
        h.peers[2].update_fault(|f| f.down = false);
        let io = standby.queue(0).unwrap();
        for _ in 0..8 {
            assert_eq!(gen_of(&io, 4), 2);
        }
        assert_eq!(standby.membership(), h.coord.record());
    }

    /// A member syncing when the role moves (its copy ran in the old
    /// writer) is recorded failed by the new writer, which rebuilds it;
    /// it is never read in between.
    #[test]
    fn a_syncing_member_is_recorded_failed_when_the_role_moves() {
        let h = writer(3);
        let epoch = h.coord.record().epoch;
        // The writer starts a rebuild of p2: recorded syncing, presented.
        let deadline = Instant::now() + Duration::from_secs(5);
        block_on(h.writer.change("test", deadline, |view| {
            if view.membership.state("p2") == Some(crate::replica::MemberState::Syncing) {
                return Ok(None);
            }
            let mut next = view.membership.clone();
            next.epoch += 1;
            next.members[2].state = crate::replica::MemberState::Syncing;
            Ok(Some((next, 0)))
        }))
        .unwrap();
        let standby = h.standby(false);
        let stop = Arc::new(AtomicBool::new(false));
        let supervisor = supervise(&h.writer, &stop);
        block_on(standby.activate()).unwrap();
        stop.store(true, Ordering::Release);
        supervisor.join().unwrap();
        let record = h.coord.record();
        assert_eq!(record.epoch, epoch + 2, "{record}");
        assert_eq!(
            record.state("p2"),
            Some(crate::replica::MemberState::Failed),
            "{record}"
        );
        assert_eq!(standby.membership(), record);
        block_on(standby.queue(0).unwrap().write(9, 0, &blob(1))).unwrap();
        assert!(
            h.peers[2].blob(9).is_none(),
            "the failed member gets nothing"
        );
    }

    /// A writer another one fenced has no role to hand over: the release
    /// fails and it stays fenced (it never sends the flush as a writer).
    #[test]
    fn a_fenced_writer_does_not_hand_over() {
        let h = writer(2);
        let other = block_on(ReplicaSet::open(
            "vol",
            h.coord.writer() as Arc<dyn Coordinator>,
            system(),
            config(),
            sessions(&h.peers),
        ))
        .unwrap();
        block_on(other.queue(0).unwrap().write(1, 0, &blob(2))).unwrap();
        let e = block_on(h.writer.release()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Fenced), "{e}");
        assert!(matches!(h.writer.standing(), Standing::Fenced(_)));
        assert_eq!(h.writer.stats().handovers_out.load(Ordering::Relaxed), 0);
    }

    /// A holder that never answers keeps the role: the standby gives up
    /// after the store's bound and stays a standby.
    #[test]
    fn a_holder_that_does_not_hand_over_keeps_the_role() {
        let h = writer(2);
        let coord = h.coord.standby();
        coord.set_acquire_bound(Duration::from_millis(50));
        let standby = block_on(ReplicaSet::standby(
            "vol",
            coord as Arc<dyn Coordinator>,
            system(),
            config(),
            sessions(&h.peers),
            false,
        ))
        .unwrap();
        let e = block_on(standby.activate()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Standby), "{e}");
        assert_eq!(standby.standing(), Standing::Standby);
        assert_eq!(h.writer.standing(), Standing::Confirmed);
        block_on(h.writer.queue(0).unwrap().write(0, 0, &blob(1))).unwrap();
    }
}
