//! A replicated device's volume (issue 11): the replication core's
//! [`ReplicaSet`] over one [`Connector`] session per queue and member (plus
//! a background one each), coordinated by etcd or, without it, by the
//! state dir; and the device's rebuild thread, which brings a failed member
//! back once its peer answers again. The rules the core keeps are in
//! docs/REPLICATION.md; this file only wires them to a device.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use futures::executor::block_on;
use futures::future::{select, Either};
use parking_lot::Mutex;
use target_rdma::auth::Secret;
use target_rdma::blob::BlobIo;
use target_rdma::client::Session;
use target_rdma::replica::{
    clock, CoordError as CoreError, CoordErrorKind as CoreKind, Coordinator, FileCoordinator,
    MemberSessions, MemberState, Membership, RebuildConfig, RebuildStats, ReplicaSet, Swap,
    MAX_REPLICAS,
};

use super::connect::{Connector, PeerSessions};
use super::{DeviceError, DeviceSpec, ReplicaSpec};
use crate::coordination::{CoordError, ReplicationConfig};
use crate::ctl::{AddArgs, RebuildInfo, ReplicaInfo, ReplicasInfo};
use crate::queue_io::{QueueIo, TagBuffers};
use ublk_metrics::ReplicaStats;

/// Maps a peer as the membership record names it to the address to
/// connect to (a placement-pool id to its registered address; `host:port`
/// to itself).
pub type Resolve = Arc<dyn Fn(&str) -> Result<String, DeviceError> + Send + Sync>;

/// One replicated device's volume, shared by its queues, the manager
/// (`show`, `del`) and its rebuild thread.
pub struct Replicated {
    set: Arc<ReplicaSet<Session>>,
    rebuild: RebuildStats,
    /// The member being rebuilt, while a rebuild runs; held while a
    /// finished rebuild's bytes move into `rebuilt`.
    rebuilding: Mutex<Option<String>>,
    /// Blob bytes copied by this device's finished rebuilds.
    rebuilt: AtomicU64,
    /// Cleared when the device stops: its rebuild thread ends.
    running: AtomicBool,
    /// The queues' tag buffers, registered with every member's queue
    /// sessions: declared after `set`, and every holder of the set holds
    /// them, so they are freed only after the last session is gone.
    bufs: Vec<Arc<TagBuffers>>,
}

/// A coordination store's refusal, as a device error of the right class.
pub fn core_coord_error(volume: &str, e: CoreError) -> DeviceError {
    DeviceError::Coordination(match e.kind {
        CoreKind::LeaseHeld => CoordError::Held {
            volume: volume.to_owned(),
            holder: e.message,
        },
        CoreKind::Corrupt => CoordError::Corrupt {
            key: format!("the membership of volume {volume:?}"),
            detail: e.message,
        },
        CoreKind::Unavailable => CoordError::Unavailable {
            what: "membership",
            detail: e.message,
        },
    })
}

impl Replicated {
    /// Opens `spec`'s replicated volume as its writer: reads the membership
    /// from `coord`, connects to every active member, records the members
    /// it cannot reach as failed (before anything is acknowledged; at
    /// least one healthy member must answer), and opens the replica set at
    /// a new epoch. Returns the queues' ways to the volume.
    pub fn open(
        connector: &Connector,
        spec: &DeviceSpec,
        secret: &Secret,
        coord: Arc<dyn Coordinator>,
        resolve: &Resolve,
        cfg: &ReplicationConfig,
    ) -> Result<(Vec<QueueIo>, Arc<Self>), DeviceError> {
        let volume = spec.volume.as_str();
        let bufs: Vec<Arc<TagBuffers>> = (0..spec.queues)
            .map(|_| Arc::new(TagBuffers::new(spec.depth as usize, spec.io_buf as usize)))
            .collect();
        let record = block_on(coord.load()).map_err(|e| core_coord_error(volume, e))?;
        let mut members: Vec<(String, PeerSessions)> = Vec::new();
        // Members that cannot serve, with why; the first connect error.
        let mut out: Vec<(String, String)> = Vec::new();
        let mut first_error = None;
        for m in record.active() {
            if m.state == MemberState::Syncing {
                // Its copy stopped with the writer that ran it: it never
                // completes, so it starts again as a failed member.
                out.push((m.peer.clone(), "its rebuild was interrupted".into()));
                continue;
            }
            let opened = resolve(&m.peer)
                .and_then(|addr| connector.connect(spec, &addr, secret, &bufs, true, false));
            match opened {
                Ok(s) => members.push((m.peer.clone(), s)),
                Err(e) => {
                    out.push((m.peer.clone(), e.to_string()));
                    first_error.get_or_insert(e);
                }
            }
        }
        if !out.is_empty() {
            record_out(volume, &*coord, &record, &members, &out, first_error)?;
        }
        let queue_sessions: Vec<Vec<Session>> = (0..spec.queues as usize)
            .map(|q| members.iter().map(|(_, s)| s.queues[q].clone()).collect())
            .collect();
        let sessions = members
            .into_iter()
            .map(|(peer, s)| (peer, member_sessions(s)))
            .collect();
        let set = block_on(ReplicaSet::open(
            volume,
            coord,
            clock::system(),
            cfg.core(),
            sessions,
        ))?;
        let rep = Arc::new(Self {
            set,
            rebuild: RebuildStats::default(),
            rebuilding: Mutex::new(None),
            rebuilt: AtomicU64::new(0),
            running: AtomicBool::new(true),
            bufs,
        });
        let ios = queue_sessions
            .into_iter()
            .enumerate()
            .map(|(q, sessions)| {
                let io = rep.set.queue(q).expect("one session per queue and member");
                QueueIo::replicated(io, sessions, Arc::clone(&rep.bufs[q]))
            })
            .collect();
        tracing::info!(event = "replicas.opened", volume, membership = %rep.set.membership());
        Ok((ios, rep))
    }

    /// The replica set.
    pub fn set(&self) -> &Arc<ReplicaSet<Session>> {
        &self.set
    }

    /// The running rebuild's progress (zero when none ran).
    pub fn rebuild_stats(&self) -> &RebuildStats {
        &self.rebuild
    }

    /// Members, epoch and rebuild progress, for `show` and `list`.
    pub fn info(&self) -> ReplicasInfo {
        let m = self.set.membership();
        let count = |s: MemberState| m.members.iter().filter(|r| r.state == s).count();
        ReplicasInfo {
            epoch: m.epoch,
            active: m.active().count(),
            healthy: count(MemberState::Healthy),
            members: m
                .members
                .iter()
                .map(|r| ReplicaInfo {
                    peer: r.peer.clone(),
                    state: r.state.name().into(),
                })
                .collect(),
            rebuild: self.rebuilding.lock().clone().map(|peer| RebuildInfo {
                peer,
                bytes_done: self.rebuild.bytes_copied.load(Ordering::Relaxed),
                bytes_remaining: self.rebuild.bytes_remaining.load(Ordering::Relaxed),
            }),
        }
    }

    /// The device stopped: its rebuild thread ends (a rebuild in progress
    /// is abandoned; the member stays `syncing` in the record and is never
    /// read from).
    pub fn stop(&self) {
        self.running.store(false, Ordering::Release);
    }

    /// Starts the device's rebuild thread: every `cfg.rebuild_check()` it
    /// looks for a failed member whose peer accepts sessions again, and
    /// rebuilds it (fresh sessions, so a loss its peer suffered does not
    /// follow it), one at a time, at `cfg.rebuild_bytes_per_sec`.
    pub fn spawn_rebuilder(
        self: &Arc<Self>,
        connector: Connector,
        spec: DeviceSpec,
        resolve: Resolve,
        cfg: ReplicationConfig,
    ) -> io::Result<JoinHandle<()>> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("ublk-rebuild".into())
            .spawn(move || rebuild_loop(&weak, &connector, &spec, &resolve, &cfg))
    }

    fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    /// Rebuilds `peer` if it accepts sessions; `false` when it does not.
    fn try_rebuild(
        &self,
        peer: &str,
        connector: &Connector,
        spec: &DeviceSpec,
        resolve: &Resolve,
        cfg: &ReplicationConfig,
    ) -> bool {
        let volume = spec.volume.as_str();
        let opened = Secret::from_file(&spec.secret_file)
            .map_err(DeviceError::from)
            .and_then(|secret| {
                let addr = resolve(peer)?;
                connector.connect(spec, &addr, &secret, &self.bufs, true, false)
            });
        let sessions = match opened {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(event = "rebuild.peer_unreachable", volume, peer, error = %e);
                return false;
            }
        };
        let blob = u64::from(sessions.queues[0].blob_bytes().max(1));
        let rcfg = RebuildConfig {
            keys: 0..spec.size.div_ceil(blob),
            bytes_per_sec: cfg.rebuild_bytes_per_sec,
            change_deadline: cfg.core().change_deadline,
        };
        *self.rebuilding.lock() = Some(peer.to_owned());
        tracing::info!(event = "rebuild.started", volume, peer);
        let rebuild =
            std::pin::pin!(self
                .set
                .rebuild(peer, member_sessions(sessions), &rcfg, &self.rebuild));
        let stopped = std::pin::pin!(async {
            let clock = clock::system();
            while self.is_running() {
                clock.sleep(Duration::from_millis(100)).await;
            }
        });
        match block_on(select(rebuild, stopped)) {
            Either::Left((Ok(()), _)) => {
                tracing::info!(event = "rebuild.done", volume, peer,
                    membership = %self.set.membership());
            }
            Either::Left((Err(e), _)) => {
                tracing::warn!(event = "rebuild.failed", volume, peer, error = %e);
            }
            Either::Right(_) => tracing::info!(event = "rebuild.abandoned", volume, peer),
        }
        let mut rebuilding = self.rebuilding.lock();
        let copied = self.rebuild.bytes_copied.swap(0, Ordering::Relaxed);
        self.rebuilt.fetch_add(copied, Ordering::Relaxed);
        self.rebuild.bytes_remaining.store(0, Ordering::Relaxed);
        *rebuilding = None;
        true
    }

    /// Blob bytes copied by this device's rebuilds (finished and running),
    /// and what the running one has left.
    pub fn rebuild_bytes(&self) -> (u64, u64) {
        let _steady = self.rebuilding.lock();
        let copied = self.rebuild.bytes_copied.load(Ordering::Relaxed);
        (
            self.rebuilt.load(Ordering::Relaxed) + copied,
            self.rebuild.bytes_remaining.load(Ordering::Relaxed),
        )
    }
}

fn member_sessions(s: PeerSessions) -> MemberSessions<Session> {
    MemberSessions {
        background: s
            .background
            .expect("replica members are opened with a background session"),
        queues: s.queues,
        // The core presents the view's epoch before each session's first
        // request (EPOCH), and the client keeps it for reconnects.
        epoch: 0,
    }
}

/// Records the active members of `record` that cannot serve (`out`:
/// unreachable, or a rebuild that was interrupted) as failed, at the next
/// epoch, before the volume serves anything: the volume then opens on the
/// others, and the rebuild thread brings them back. Refused with the first
/// connect error when no healthy member answers.
fn record_out(
    volume: &str,
    coord: &dyn Coordinator,
    record: &Membership,
    reached: &[(String, PeerSessions)],
    out: &[(String, String)],
    first_error: Option<DeviceError>,
) -> Result<(), DeviceError> {
    let healthy_reached = reached
        .iter()
        .any(|(p, _)| record.state(p) == Some(MemberState::Healthy));
    if !healthy_reached {
        return Err(first_error.unwrap_or_else(|| {
            DeviceError::BadRequest(format!("volume {volume:?}: no healthy member in {record}"))
        }));
    }
    let mut next = record.clone();
    next.epoch += 1;
    for r in next.members.iter_mut() {
        if let Some((_, why)) = out.iter().find(|(p, _)| *p == r.peer) {
            tracing::warn!(event = "replicas.member_out", volume, peer = %r.peer, reason = %why);
            r.state = MemberState::Failed;
        }
    }
    next.validate()
        .map_err(|why| DeviceError::BadRequest(format!("volume {volume:?}: {why}")))?;
    match block_on(coord.compare_and_swap(record.epoch, next)) {
        Ok(Swap::Done) => Ok(()),
        Ok(Swap::Lost(now)) => Err(DeviceError::Coordination(CoordError::Unavailable {
            what: "membership",
            detail: format!("volume {volume:?}: the record changed while opening, to {now}"),
        })),
        Err(e) => Err(core_coord_error(volume, e)),
    }
}

fn rebuild_loop(
    weak: &Weak<Replicated>,
    connector: &Connector,
    spec: &DeviceSpec,
    resolve: &Resolve,
    cfg: &ReplicationConfig,
) {
    let step = Duration::from_millis(100).min(cfg.rebuild_check());
    let mut waited = Duration::ZERO;
    loop {
        std::thread::sleep(step);
        waited += step;
        let Some(rep) = weak.upgrade().filter(|r| r.is_running()) else {
            return;
        };
        if waited < cfg.rebuild_check() {
            continue;
        }
        waited = Duration::ZERO;
        let failed: Vec<String> = rep
            .set
            .membership()
            .members
            .iter()
            .filter(|r| r.state == MemberState::Failed)
            .map(|r| r.peer.clone())
            .collect();
        for peer in failed {
            if rep.try_rebuild(&peer, connector, spec, resolve, cfg) || !rep.is_running() {
                break;
            }
        }
    }
}

impl super::Manager {
    /// Replica health summed over the replicated devices, for the
    /// metrics (metrics/src/replicas.rs).
    pub fn replica_stats(&self) -> ReplicaStats {
        let mut s = ReplicaStats::default();
        for d in self.devices.lock().values() {
            let (Some(spec), Some((rep, _))) = (&d.spec.replicas, &d.replicated) else {
                continue;
            };
            let healthy = rep.info().healthy as u64;
            let wanted = spec.peers.len() as u64;
            s.replicas += wanted;
            s.healthy += healthy;
            s.degraded += u64::from(healthy < wanted);
            let (done, remaining) = rep.rebuild_bytes();
            s.rebuild_bytes += done;
            s.rebuild_remaining += remaining;
            s.stale_epoch_fences += rep.set().stats().stale_epoch_fences.load(Ordering::Relaxed);
        }
        s
    }

    /// `add` without `--peer`: placement in etcd chooses the peers (`1` when
    /// `--replicas` is not given). One placed peer is a volume on one peer,
    /// served exactly as one named with `--peer`.
    pub(super) fn place(&self, a: &AddArgs) -> Result<AddArgs, DeviceError> {
        if !a.peers.is_empty() {
            return Ok(a.clone());
        }
        if self.coordination.is_none() {
            return Err(DeviceError::BadRequest(
                "--peer is required: without an [etcd] section there is no placement pool to \
                 choose peers from"
                    .into(),
            ));
        }
        let n = usize::from(check_replicas(a.replicas)?.unwrap_or(1));
        let placed = self.coordination()?.place(a.size, n)?;
        let peers = if n == 1 {
            vec![placed[0].addr.clone()]
        } else {
            placed.into_iter().map(|p| p.id).collect()
        };
        tracing::info!(event = "replicas.placed", volume = %a.volume, peers = ?peers);
        Ok(AddArgs { peers, ..a.clone() })
    }

    /// Opens a replicated device's volume: its coordinator (etcd's writer
    /// key and membership, or the state dir's without `[etcd]`), then the
    /// replica set. A failure gives the writer key back.
    pub(super) fn open_replicated(
        &self,
        connector: &Connector,
        spec: &DeviceSpec,
        r: &ReplicaSpec,
        secret: &Secret,
    ) -> Result<(Vec<QueueIo>, Arc<Replicated>), DeviceError> {
        let volume = spec.volume.as_str();
        let coord: Arc<dyn Coordinator> = match &self.coordination {
            Some(_) => Arc::new(
                self.coordination()?
                    .open_volume(volume, &r.peers, spec.size)?,
            ),
            None => Arc::new(
                FileCoordinator::open(&self.cfg.state_dir, volume, &r.peers)
                    .map_err(|e| core_coord_error(volume, e))?,
            ),
        };
        let opened = Replicated::open(
            connector,
            spec,
            secret,
            coord,
            &self.resolver(),
            &self.cfg.replication,
        );
        if opened.is_err() {
            self.release_writer(volume);
        }
        opened
    }

    /// Gives up `volume`'s writer key in etcd (a deleted device, or one
    /// that did not start); nothing without `[etcd]` (the state dir's lock
    /// goes with the replica set).
    pub(super) fn release_writer(&self, volume: &str) {
        let Some(slot) = &self.coordination else {
            return;
        };
        match slot.get().and_then(|c| c.writer().release(volume)) {
            Ok(()) => {}
            Err(e) => tracing::warn!(event = "writer.release_failed", volume, error = %e),
        }
    }

    /// How this ublkd finds a member's address: a placement-pool id is
    /// looked up in etcd; anything else must be `host:port`.
    pub(super) fn resolver(&self) -> Resolve {
        let slot = self.coordination.clone();
        Arc::new(move |name: &str| {
            let pool = slot.as_ref().map(|s| s.get().and_then(|c| c.peers()));
            if let Some(Ok(peers)) = &pool {
                if let Some(p) = peers.iter().find(|p| p.id == name) {
                    return Ok(p.addr.clone());
                }
            }
            if name.contains(':') {
                return Ok(name.to_owned());
            }
            Err(match pool {
                Some(Err(e)) => DeviceError::Coordination(e),
                _ => DeviceError::BadRequest(format!(
                    "member {name:?} is neither a registered peer (`ublkctl peer list`) nor HOST:PORT"
                )),
            })
        })
    }
}

/// `--replicas`: 1..=5 when given.
pub(super) fn check_replicas(n: Option<u8>) -> Result<Option<u8>, DeviceError> {
    match n {
        Some(n) if !(1..=MAX_REPLICAS).contains(&usize::from(n)) => Err(DeviceError::BadRequest(
            format!("invalid --replicas {n}: must be between 1 and {MAX_REPLICAS}"),
        )),
        n => Ok(n),
    }
}

/// The replica set `add` asked for: `None` for a volume on one peer.
pub(super) fn replica_spec(a: &AddArgs) -> Result<Option<ReplicaSpec>, DeviceError> {
    let n = check_replicas(a.replicas)?.map_or(a.peers.len(), usize::from);
    if n != a.peers.len() {
        return Err(DeviceError::BadRequest(format!(
            "--replicas {n} needs {n} --peer (got {}), or no --peer to let placement choose",
            a.peers.len()
        )));
    }
    for (i, p) in a.peers.iter().enumerate() {
        if p.is_empty() {
            return Err(DeviceError::BadRequest("--peer must not be empty".into()));
        }
        if a.peers[..i].contains(p) {
            return Err(DeviceError::BadRequest(format!(
                "--peer {p} is given twice: replicas live on distinct peers"
            )));
        }
    }
    Ok((n > 1).then(|| ReplicaSpec {
        peers: a.peers.clone(),
    }))
}
