//! The replication model test: a replicated volume on N fake members and
//! the in-memory coordination store, all on virtual time, with crashes
//! (losing what FLUSH did not cover), partitions, delays, dropped requests
//! and answers on any member, and an unreachable, slow or racing store.
//! Each seed replays one interleaving.
//!
//! What it checks, after every request and at the end:
//! - a read returns the last acknowledged write to its range, or a write
//!   that was not acknowledged (failed, or still in flight): never
//!   anything older than the last acknowledged one;
//! - at the end, with every fault healed, every key reads back its last
//!   acknowledged write through the volume and from every healthy member
//!   of the recorded membership;
//! - the run never stalls (a request waiting on nothing).
//!
//! `REPLICA_MODEL_SEEDS=n` runs n seeds (default 24, a few seconds);
//! docs/REPLICATION.md says how to soak.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use target_rdma::blob::BlobIo;
use target_rdma::replica::clock::Timers;
use target_rdma::replica::fake::{FakeFault, FakePeer, FakeSession};
use target_rdma::replica::{
    CoordFault, Coordinator, Lease, MemberState, Membership, MemoryCoordinator, RebuildConfig,
    RebuildStats, ReplicaConfig, ReplicaSet, ReplicatedIo,
};
use ublk_metrics::ManualClock;

const BLOB: u32 = 64;
const KEYS: u64 = 12;
const QUEUES: usize = 2;

/// What a key may read as: its last acknowledged write, or any write to it
/// since that was not acknowledged. 0 is "never written" (zeros).
#[derive(Clone, Default)]
struct KeyModel {
    floor: u64,
    maybe: Vec<u64>,
}

impl KeyModel {
    fn allowed(&self) -> Vec<u64> {
        let mut a = self.maybe.clone();
        a.push(self.floor);
        a
    }
}

/// The payload of write `seq` to `key`: both in it, so a mix-up shows.
fn payload(key: u64, seq: u64) -> Vec<u8> {
    let mut d = vec![0u8; BLOB as usize];
    d[..8].copy_from_slice(&seq.to_le_bytes());
    d[8..16].copy_from_slice(&key.to_le_bytes());
    d
}

/// The write a blob's bytes carry, checking they are one whole write.
fn decode(key: u64, b: &[u8]) -> u64 {
    let seq = u64::from_le_bytes(b[..8].try_into().unwrap());
    if seq == 0 {
        assert!(b.iter().all(|x| *x == 0), "key {key}: torn zero blob");
    } else {
        assert_eq!(b, payload(key, seq), "key {key}: torn or misplaced blob");
    }
    seq
}

/// Runs the pool until every task is done, moving virtual time to the next
/// timer whenever every task waits.
fn run(pool: &mut LocalPool, clock: &ManualClock, done: impl Fn() -> bool) {
    let start = clock.elapsed();
    loop {
        pool.run_until_stalled();
        if done() {
            return;
        }
        assert!(
            clock.elapsed() - start < Duration::from_secs(60),
            "requests still pending after a virtual minute: a livelock"
        );
        let next = clock
            .next_deadline()
            .expect("every request waits and no timer is pending: the run stalled");
        clock.advance_to(next);
    }
}

/// Runs `f` as a task of `pool` to its end, on virtual time.
fn drive(
    pool: &mut LocalPool,
    clock: &ManualClock,
    f: impl std::future::Future<Output = ()> + 'static,
) {
    let done = Rc::new(Cell::new(false));
    let d = Rc::clone(&done);
    pool.spawner()
        .spawn_local(async move {
            f.await;
            d.set(true);
        })
        .unwrap();
    run(pool, clock, || done.get());
}

struct Run {
    rng: StdRng,
    clock: Arc<ManualClock>,
    peers: Vec<Arc<FakePeer>>,
    coord: Arc<MemoryCoordinator>,
    set: Arc<ReplicaSet<FakeSession>>,
    queues: Vec<Rc<ReplicatedIo<FakeSession>>>,
    model: Vec<KeyModel>,
    seq: u64,
    acked: u64,
    rebuilds: u64,
    rebuilt: Rc<Cell<u64>>,
}

impl Run {
    fn new(seed: u64, pool: &mut LocalPool) -> Run {
        let rng = StdRng::seed_from_u64(seed);
        let clock = Arc::new(ManualClock::new());
        let dyn_clock: Arc<dyn Timers> = Arc::clone(&clock) as Arc<dyn Timers>;
        // n members and a spare.
        let n = 1 + (seed % 3) as usize;
        let peers: Vec<_> = (0..=n)
            .map(|i| FakePeer::new(&format!("p{i}"), BLOB, Arc::clone(&dyn_clock)))
            .collect();
        let names: Vec<_> = peers[..n].iter().map(|p| p.name().to_string()).collect();
        let coord = MemoryCoordinator::new(
            Arc::clone(&dyn_clock),
            Membership::new_volume(&names).unwrap(),
        );
        let sessions = peers[..n]
            .iter()
            .map(|p| (p.name().to_string(), p.sessions(QUEUES)))
            .collect();
        let config = ReplicaConfig {
            hedge_after: Duration::from_millis(1),
            change_deadline: Duration::from_millis(200),
            coord_timeout: Duration::from_millis(40),
            coord_retry: Duration::from_millis(5),
            ..ReplicaConfig::default()
        };
        let opened = Rc::new(RefCell::new(None));
        let o = Rc::clone(&opened);
        let c = Arc::clone(&coord) as Arc<dyn Coordinator>;
        pool.spawner()
            .spawn_local(async move {
                let set = ReplicaSet::open("vol", c, dyn_clock, config, sessions).await;
                *o.borrow_mut() = Some(set.expect("open the volume"));
            })
            .unwrap();
        run(pool, &clock, || opened.borrow().is_some());
        let set = opened.borrow_mut().take().unwrap();
        let queues = (0..QUEUES)
            .map(|q| Rc::new(set.queue(q).unwrap()))
            .collect();
        Run {
            rng,
            clock,
            peers,
            coord,
            set,
            queues,
            model: vec![KeyModel::default(); KEYS as usize],
            seq: 0,
            acked: 0,
            rebuilds: 0,
            rebuilt: Rc::default(),
        }
    }

    /// Healthy members of the record that still hold every acknowledged
    /// write (not crashed with a loss).
    fn sound_members(&self) -> Vec<usize> {
        let record = self.coord.record();
        (0..self.peers.len())
            .filter(|i| record.state(self.peers[*i].name()) == Some(MemberState::Healthy))
            .filter(|i| !self.peers[*i].lost())
            .collect()
    }

    /// Breaks or heals something.
    fn fault(&mut self) {
        let p = self.rng.gen_range(0..self.peers.len());
        match self.rng.gen_range(0..10) {
            // A crash may lose unflushed writes: only where another sound
            // copy remains (N copies survive N-1 crashes, not N).
            0 => {
                let sound = self.sound_members();
                if sound.len() >= 2 || !sound.contains(&p) {
                    self.peers[p].crash();
                }
            }
            1 => self.peers[p].update_fault(|f| f.down = !f.down),
            2 => {
                let ms = self.rng.gen_range(0..4);
                self.peers[p].update_fault(|f| f.delay = Duration::from_millis(ms));
            }
            3 => self.peers[p].update_fault(|f| f.drop_requests += 1),
            4 => self.peers[p].update_fault(|f| f.drop_answers += 1),
            5 => self.coord.update_fault(|f| f.unavailable = !f.unavailable),
            6 => {
                let ms = self.rng.gen_range(0..60);
                self.coord
                    .update_fault(|f| f.delay = Duration::from_millis(ms));
            }
            7 => self.coord.update_fault(|f| f.lose_races += 1),
            8 => self.coord.update_fault(|f| f.lose_answers += 1),
            _ => {
                self.peers[p].set_fault(FakeFault::default());
                self.coord.set_fault(CoordFault::default());
            }
        }
    }

    /// Starts rebuilding a peer outside the membership (a spare, or one
    /// taken out), concurrently with the round's requests.
    fn rebuild(&mut self, pool: &mut LocalPool, pending: &Rc<RefCell<usize>>) {
        let record = self.coord.record();
        let out: Vec<_> = self
            .peers
            .iter()
            .filter(|p| !record.state(p.name()).is_some_and(|s| s.is_active()))
            .collect();
        if out.is_empty() {
            return;
        }
        let peer = Arc::clone(out[self.rng.gen_range(0..out.len())]);
        let set = Arc::clone(&self.set);
        let rate = [0, u64::from(BLOB) * KEYS * 20][self.rng.gen_range(0..2)];
        let inflight = [1, 3, 8][self.rng.gen_range(0..3)];
        let pending = Rc::clone(pending);
        let rebuilt = Rc::clone(&self.rebuilt);
        *pending.borrow_mut() += 1;
        self.rebuilds += 1;
        pool.spawner()
            .spawn_local(async move {
                let cfg = RebuildConfig {
                    keys: 0..KEYS,
                    bytes_per_sec: rate,
                    change_deadline: Duration::from_millis(200),
                    // The model rebuilds members in their own place; a
                    // spare's replacement is replica::tests'.
                    replaces: None,
                    inflight,
                    guest: None,
                };
                let stats = RebuildStats::default();
                let sessions = peer.sessions(QUEUES);
                if set
                    .rebuild(peer.name(), sessions, &cfg, &stats)
                    .await
                    .is_ok()
                {
                    rebuilt.set(rebuilt.get() + 1);
                }
                *pending.borrow_mut() -= 1;
            })
            .unwrap();
    }

    /// One round of concurrent requests: at most one write per key, reads
    /// of any key, sometimes a flush, sometimes a rebuild.
    fn round(&mut self, pool: &mut LocalPool) {
        let pending = Rc::new(RefCell::new(0usize));
        let results = Rc::new(RefCell::new(Vec::new()));
        if self.rng.gen_bool(0.15) {
            self.rebuild(pool, &pending);
        }
        let mut written = Vec::new();
        for _ in 0..self.rng.gen_range(1..8) {
            let key = self.rng.gen_range(0..KEYS);
            let io = Rc::clone(&self.queues[self.rng.gen_range(0..QUEUES)]);
            let (pending, results) = (Rc::clone(&pending), Rc::clone(&results));
            *pending.borrow_mut() += 1;
            let op = self.rng.gen_range(0..10);
            if op < 5 && !written.contains(&key) {
                written.push(key);
                self.seq += 1;
                let seq = self.seq;
                self.model[key as usize].maybe.push(seq);
                pool.spawner()
                    .spawn_local(async move {
                        let r = io.write(key, 0, &payload(key, seq)).await;
                        results.borrow_mut().push(Done::Write(key, seq, r.is_ok()));
                        *pending.borrow_mut() -= 1;
                    })
                    .unwrap();
            } else if op < 9 {
                let allowed = self.model[key as usize].allowed();
                pool.spawner()
                    .spawn_local(async move {
                        let mut out = vec![0u8; BLOB as usize];
                        if io.read(key, 0, &mut out).await.is_ok() {
                            let seq = decode(key, &out);
                            results.borrow_mut().push(Done::Read(key, seq, allowed));
                        }
                        *pending.borrow_mut() -= 1;
                    })
                    .unwrap();
            } else {
                pool.spawner()
                    .spawn_local(async move {
                        let _ = io.flush().await;
                        *pending.borrow_mut() -= 1;
                    })
                    .unwrap();
            }
        }
        run(pool, &self.clock, || *pending.borrow() == 0);
        let mut results = results.borrow_mut();
        // A read may also see any write of its round (they were concurrent).
        for d in results.iter() {
            if let Done::Read(key, seq, allowed) = d {
                let concurrent = results
                    .iter()
                    .any(|w| matches!(w, Done::Write(k, s, _) if k == key && s == seq));
                assert!(
                    allowed.contains(seq) || concurrent,
                    "key {key} read write {seq}, allowed {allowed:?}"
                );
            }
        }
        for d in results.drain(..) {
            if let Done::Write(key, seq, true) = d {
                let m = &mut self.model[key as usize];
                self.acked += 1;
                m.floor = seq;
                m.maybe.clear();
            }
        }
    }

    /// Heals everything and checks every key, through the volume and on
    /// every healthy member of the record.
    fn check(&mut self, pool: &mut LocalPool) {
        for p in &self.peers {
            p.set_fault(FakeFault::default());
        }
        self.coord.set_fault(CoordFault::default());
        // A write through the volume lets it drop members found stale.
        for key in 0..KEYS {
            let (io, m) = (Rc::clone(&self.queues[0]), self.model[key as usize].clone());
            drive(pool, &self.clock, async move {
                let mut out = vec![0u8; BLOB as usize];
                io.read(key, 0, &mut out)
                    .await
                    .expect("a healed volume reads");
                let seq = decode(key, &out);
                assert!(m.allowed().contains(&seq), "key {key}: read {seq}");
                // Make it definite, then every copy must hold it.
                io.write(key, 0, &out)
                    .await
                    .expect("a healed volume writes");
            });
        }
        let record = self.coord.record();
        assert_eq!(
            self.set.membership(),
            record,
            "the writer follows the record"
        );
        let healthy = record
            .members
            .iter()
            .filter(|r| r.state == MemberState::Healthy);
        for r in healthy {
            let peer = self.peers.iter().find(|p| p.name() == r.peer).unwrap();
            assert!(!peer.lost(), "{record}: {} is stale", r.peer);
            for key in 0..KEYS {
                let m = &self.model[key as usize];
                let seq = peer.blob(key).map_or(0, |b| decode(key, &b));
                assert!(
                    m.allowed().contains(&seq),
                    "{}: key {key} holds {seq}",
                    r.peer
                );
            }
        }
    }
}

enum Done {
    /// Write `seq` to `key`, and whether it was acknowledged.
    Write(u64, u64, bool),
    /// A read of `key` saw write `seq`; what the model allowed when it
    /// started.
    Read(u64, u64, Vec<u64>),
}

fn seeds() -> u64 {
    std::env::var("REPLICA_MODEL_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24)
}

#[test]
fn acknowledged_writes_survive_every_injected_fault() {
    let (mut acked, mut removals, mut unrecorded, mut hedges, mut rebuilds, mut rebuilt) =
        (0, 0, 0, 0, 0, 0);
    for seed in 0..seeds() {
        let mut pool = LocalPool::new();
        let mut run = Run::new(seed, &mut pool);
        for _ in 0..60 {
            if run.rng.gen_bool(0.4) {
                run.fault();
            }
            run.round(&mut pool);
        }
        run.check(&mut pool);
        let stats = run.set.stats();
        acked += run.acked;
        removals += stats.removals.load(Ordering::Relaxed);
        unrecorded += stats.unrecorded.load(Ordering::Relaxed);
        hedges += stats.hedged_reads.load(Ordering::Relaxed);
        rebuilds += run.rebuilds;
        rebuilt += run.rebuilt.get();
    }
    eprintln!(
        "{} seeds: {acked} writes acknowledged, {removals} members removed, \
         {unrecorded} requests refused unrecorded, {hedges} reads hedged, \
         {rebuilds} rebuilds started, {rebuilt} completed",
        seeds()
    );
    // The faults did happen: a model test that injects nothing proves nothing.
    assert!(acked > seeds() * 20, "the runs acknowledged writes");
    assert!(removals > 0 && unrecorded > 0 && hedges > 0 && rebuilt > 0);
}

/// One writer of the takeover model: its store handle, its set, its queues.
struct Writer {
    coord: Arc<MemoryCoordinator>,
    set: Arc<ReplicaSet<FakeSession>>,
    queues: Vec<Rc<ReplicatedIo<FakeSession>>>,
}

fn takeover_config() -> ReplicaConfig {
    ReplicaConfig {
        hedge_after: Duration::from_millis(1),
        change_deadline: Duration::from_millis(200),
        coord_timeout: Duration::from_millis(40),
        coord_retry: Duration::from_millis(5),
        ..ReplicaConfig::default()
    }
}

/// Opens `coord`'s writer on fresh sessions of every peer, as a task of
/// `pool` (so it may run concurrently with the other writer's requests).
fn open_writer(
    pool: &mut LocalPool,
    clock: &Arc<ManualClock>,
    peers: &[Arc<FakePeer>],
    coord: Arc<MemoryCoordinator>,
) -> Rc<RefCell<Option<Writer>>> {
    let sessions = peers
        .iter()
        .map(|p| (p.name().to_string(), p.sessions(QUEUES)))
        .collect();
    let slot = Rc::new(RefCell::new(None));
    let s = Rc::clone(&slot);
    let dyn_clock: Arc<dyn Timers> = Arc::clone(clock) as Arc<dyn Timers>;
    pool.spawner()
        .spawn_local(async move {
            let c = Arc::clone(&coord) as Arc<dyn Coordinator>;
            let set = ReplicaSet::open("vol", c, dyn_clock, takeover_config(), sessions)
                .await
                .expect("open the volume");
            let queues = (0..QUEUES)
                .map(|q| Rc::new(set.queue(q).unwrap()))
                .collect();
            *s.borrow_mut() = Some(Writer { coord, set, queues });
        })
        .unwrap();
    slot
}

/// The coordinator-outage rule (docs/REPLICATION.md, "Through a
/// coordinator outage"): a writer cut off from the store keeps
/// acknowledging writes while every member fences by epoch; a successor
/// takes the volume (concurrently with the old writer's requests, and
/// sometimes partitioned from one member, which it then removes); requests
/// of both writers interleave. No read of either writer returns data older
/// than the last write either of them acknowledged, and at the end every
/// acknowledged write reads back through the successor.
#[test]
fn a_writer_cut_off_from_its_store_is_fenced_by_its_successor_and_loses_nothing() {
    let (mut unconfirmed_acks, mut fenced_old) = (0u64, 0u64);
    for seed in 0..seeds() {
        let mut pool = LocalPool::new();
        let mut rng = StdRng::seed_from_u64(seed);
        let clock = Arc::new(ManualClock::new());
        let dyn_clock: Arc<dyn Timers> = Arc::clone(&clock) as Arc<dyn Timers>;
        let n = 2 + (seed % 2) as usize;
        let peers: Vec<_> = (0..n)
            .map(|i| FakePeer::new(&format!("p{i}"), BLOB, Arc::clone(&dyn_clock)))
            .collect();
        for p in &peers {
            p.update_fault(|f| f.fence_epochs = true);
        }
        let names: Vec<_> = peers.iter().map(|p| p.name().to_string()).collect();
        let coord = MemoryCoordinator::new(dyn_clock, Membership::new_volume(&names).unwrap());
        let first = open_writer(&mut pool, &clock, &peers, Arc::clone(&coord));
        run(&mut pool, &clock, || first.borrow().is_some());
        let old = first.borrow_mut().take().unwrap();
        let mut model = vec![KeyModel::default(); KEYS as usize];
        let mut seq = 0u64;
        let mut new: Option<Writer> = None;
        let mut opening = None;
        let mut cut = Vec::new();
        for round in 0..40 {
            // The old writer loses the store: the lease lapses, or the
            // store dropped it.
            if round == 5 {
                old.coord.update_fault(|f| f.unavailable = true);
                if rng.gen_bool(0.5) {
                    old.coord.set_lease(Lease::Lost);
                } else {
                    old.coord.set_lease_until(clock.now());
                }
            }
            // A successor opens during this round, sometimes cut off from
            // every member but one (its sessions are each peer's second).
            if round == 12 {
                if rng.gen_bool(0.5) {
                    let kept = rng.gen_range(0..n);
                    cut = (0..n).filter(|i| *i != kept).collect();
                    for c in &cut {
                        peers[*c].cut_sessions(1, true);
                    }
                }
                opening = Some(open_writer(&mut pool, &clock, &peers, coord.writer()));
            }
            // The members the successor cannot reach answer the old writer
            // fastest: a read one of them served alone would be stale.
            for (i, p) in peers.iter().enumerate() {
                let ms = if cut.contains(&i) {
                    0
                } else {
                    rng.gen_range(1..3)
                };
                p.update_fault(|f| f.delay = Duration::from_millis(ms));
            }
            let pending = Rc::new(RefCell::new(0usize));
            let results = Rc::new(RefCell::new(Vec::new()));
            let mut written = Vec::new();
            for _ in 0..rng.gen_range(1..8) {
                let key = rng.gen_range(0..KEYS);
                let w = match &new {
                    Some(nw) if rng.gen_bool(0.6) => nw,
                    _ => &old,
                };
                let from_old = std::ptr::eq(w, &old);
                let io = Rc::clone(&w.queues[rng.gen_range(0..QUEUES)]);
                let (pending, results) = (Rc::clone(&pending), Rc::clone(&results));
                *pending.borrow_mut() += 1;
                // Once succeeded, the old writer only reads: its writes
                // would show it the fence at once.
                let op = if from_old && round >= 12 && rng.gen_bool(0.95) {
                    5
                } else {
                    rng.gen_range(0..10)
                };
                if op < 5 && !written.contains(&key) {
                    written.push(key);
                    seq += 1;
                    let s = seq;
                    model[key as usize].maybe.push(s);
                    pool.spawner()
                        .spawn_local(async move {
                            let r = io.write(key, 0, &payload(key, s)).await;
                            results
                                .borrow_mut()
                                .push((from_old, Done::Write(key, s, r.is_ok())));
                            *pending.borrow_mut() -= 1;
                        })
                        .unwrap();
                } else if op < 9 {
                    let allowed = model[key as usize].allowed();
                    pool.spawner()
                        .spawn_local(async move {
                            let mut out = vec![0u8; BLOB as usize];
                            if io.read(key, 0, &mut out).await.is_ok() {
                                let s = decode(key, &out);
                                results
                                    .borrow_mut()
                                    .push((from_old, Done::Read(key, s, allowed)));
                            }
                            *pending.borrow_mut() -= 1;
                        })
                        .unwrap();
                } else {
                    pool.spawner()
                        .spawn_local(async move {
                            let _ = io.flush().await;
                            *pending.borrow_mut() -= 1;
                        })
                        .unwrap();
                }
            }
            let o = opening.clone();
            run(&mut pool, &clock, || {
                *pending.borrow() == 0 && o.as_ref().is_none_or(|s| s.borrow().is_some())
            });
            if let Some(s) = opening.take() {
                new = s.borrow_mut().take();
            }
            let mut results = results.borrow_mut();
            for (_, d) in results.iter() {
                if let Done::Read(key, s, allowed) = d {
                    let concurrent = results
                        .iter()
                        .any(|(_, w)| matches!(w, Done::Write(k, x, _) if k == key && x == s));
                    assert!(
                        allowed.contains(s) || concurrent,
                        "seed {seed}: key {key} read write {s}, allowed {allowed:?}"
                    );
                }
            }
            for (from_old, d) in results.drain(..) {
                if let Done::Write(key, s, true) = d {
                    if from_old && round >= 5 {
                        unconfirmed_acks += 1;
                    }
                    let m = &mut model[key as usize];
                    m.floor = s;
                    m.maybe.clear();
                }
            }
        }
        // Every acknowledged write reads back through the successor.
        let new = new.expect("the successor opened");
        for p in &peers {
            p.cut_sessions(1, false);
            p.update_fault(|f| f.delay = Duration::ZERO);
        }
        for key in 0..KEYS {
            let (io, m) = (Rc::clone(&new.queues[0]), model[key as usize].clone());
            drive(&mut pool, &clock, async move {
                let mut out = vec![0u8; BLOB as usize];
                io.read(key, 0, &mut out)
                    .await
                    .expect("the successor reads");
                let s = decode(key, &out);
                assert!(m.allowed().contains(&s), "seed {seed}: key {key}: read {s}");
            });
        }
        if old.set.standing().name() == "fenced" {
            fenced_old += 1;
        }
        assert_ne!(new.set.standing().name(), "fenced", "seed {seed}");
    }
    eprintln!(
        "{} seeds: {unconfirmed_acks} writes acknowledged by a writer cut off from its store, \
         {fenced_old} old writers fenced by their successor",
        seeds()
    );
    assert!(
        unconfirmed_acks > seeds(),
        "the cut-off writer acknowledged writes"
    );
    assert!(
        fenced_old > seeds() / 2,
        "successors fenced the old writers"
    );
}
