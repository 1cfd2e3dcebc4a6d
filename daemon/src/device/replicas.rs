//! A replicated device's volume: the replication core's
//! [`ReplicaSet`] over one [`Connector`] session per queue and member (plus
//! a background one each), coordinated by etcd or, without it, by the
//! state dir; and the device's rebuild thread, which brings a failed member
//! back once its peer answers again, or, once it has stayed failed for
//! `[replication] replace_after_ms`, replaces it by a spare from the
//! placement pool (etcd only), and backs off a peer whose rebuilds keep
//! failing. The rules the core keeps are in docs/REPLICATION.md; this file
//! only wires them to a device.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use futures::future::{select, Either};
use parking_lot::Mutex;
use target_rdma::auth::Secret;
use target_rdma::blob::BlobIo;
use target_rdma::client::Session;
use target_rdma::replica::{
    clock, CoordError as CoreError, CoordErrorKind as CoreKind, Coordinator, FileCoordinator,
    GuestLoad, MemberSessions, MemberState, Membership, RebuildConfig, RebuildStats, ReplicaSet,
    Standing, Swap, MAX_REPLICAS,
};

use super::connect::{Connector, PeerSessions};
use super::spec::SpecStore;
use super::{DeviceError, DeviceSpec, ReplicaSpec};
use crate::coordination::{CoordinationError, ReplicationConfig};
use crate::ctl::{AddArgs, HandoverInfo, RebuildInfo, ReplicaInfo, ReplicasInfo};
use crate::queue_io::{QueueIo, TagBuffers};
use ublk_metrics::events;
use ublk_metrics::{HedgeOutcome, RebuildOutcome, ReplicaStats};

/// Maps a peer as the membership record names it to the address to
/// connect to (a placement-pool id to its registered address; `host:port`
/// to itself).
pub type Resolve = Arc<dyn Fn(&str) -> Result<String, DeviceError> + Send + Sync>;

/// Finds a spare to replace member `replacing` (second argument) of
/// `volume` (first): a peer as the membership record will name it, or
/// `None` when the pool has none that fits. Only etcd's placement pool
/// has spares; without `[etcd]` a device gets none.
pub type FindSpare = Arc<dyn Fn(&str, &str) -> Result<Option<String>, DeviceError> + Send + Sync>;

/// The device's guest requests in flight now, which its rebuild gives way
/// to (`[replication] rebuild_yield_above`).
pub type GuestInFlight = Arc<dyn Fn() -> u64 + Send + Sync>;

/// A peer whose last rebuilds failed: not tried again before `retry_at`.
#[derive(Clone, Copy, Debug)]
struct Backoff {
    /// Failed rebuilds in a row.
    failures: u32,
    retry_at: Instant,
}

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
    /// Peers whose rebuilds failed, until one succeeds.
    backoff: Mutex<HashMap<String, Backoff>>,
    /// Rebuilds ended, by [`RebuildOutcome::index`].
    rebuilds: [AtomicU64; RebuildOutcome::COUNT],
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
        CoreKind::LeaseHeld => CoordinationError::Held {
            volume: volume.to_owned(),
            holder: e.message,
        },
        CoreKind::Corrupt => CoordinationError::Corrupt {
            key: format!("the membership of volume {volume:?}"),
            detail: e.message,
        },
        CoreKind::Unavailable => CoordinationError::Unavailable {
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
    /// a new epoch. As a standby (`spec.replicas.standby`) it changes
    /// nothing: every active member must answer, and the set serves under
    /// the record's epoch without the role. Returns the queues' ways to
    /// the volume.
    pub fn open(
        connector: &Connector,
        spec: &DeviceSpec,
        secret: &Secret,
        coord: Arc<dyn Coordinator>,
        resolve: &Resolve,
        cfg: &ReplicationConfig,
    ) -> Result<(Vec<QueueIo>, Arc<Self>), DeviceError> {
        let standby = spec.replicas.as_ref().filter(|r| r.standby);
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
            if m.state == MemberState::Syncing && standby.is_none() {
                // Its copy stopped with the writer that ran it: it never
                // completes, so it starts again as a failed member.
                out.push((m.peer.clone(), "its rebuild was interrupted".into()));
                continue;
            }
            let opened = resolve(&m.peer)
                .and_then(|addr| connector.connect(spec, &addr, secret, &bufs, true, false));
            match opened {
                Ok(s) => members.push((m.peer.clone(), s)),
                Err(e) if standby.is_some() => return Err(e),
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
        let set = match standby {
            Some(r) => block_on(ReplicaSet::standby(
                volume,
                coord,
                clock::system(),
                cfg.core(),
                sessions,
                r.activate_on_write,
            ))?,
            None => block_on(ReplicaSet::open(
                volume,
                coord,
                clock::system(),
                cfg.core(),
                sessions,
            ))?,
        };
        let rep = Arc::new(Self {
            set,
            rebuild: RebuildStats::default(),
            rebuilding: Mutex::new(None),
            rebuilt: AtomicU64::new(0),
            backoff: Mutex::default(),
            rebuilds: Default::default(),
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
        tracing::info!(event = events::REPLICAS_OPENED, volume, membership = %rep.set.membership());
        Ok((ios, rep))
    }

    /// Whether the writer is fenced (`recover` takes the volume over).
    pub fn fenced(&self) -> bool {
        matches!(self.set.standing(), Standing::Fenced(_))
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
        let backoff = self.backoff.lock().clone();
        let now = Instant::now();
        let failures = self.set.member_failures();
        let standing = self.set.standing();
        ReplicasInfo {
            role: standing.name().into(),
            role_reason: match standing {
                Standing::Confirmed => None,
                Standing::Unconfirmed(why) => Some(why.into()),
                Standing::Fenced(why) => Some(why),
                Standing::Standby if self.set.activates_on_write() => Some(
                    "a standby: reads are served; the first write takes the writer role".into(),
                ),
                Standing::Standby => Some(
                    "a standby: reads are served, writes refused until `ublkctl activate`".into(),
                ),
            },
            epoch: m.epoch,
            active: m.active().count(),
            healthy: count(MemberState::Healthy),
            members: m
                .members
                .iter()
                .map(|r| {
                    let b = backoff.get(&r.peer);
                    ReplicaInfo {
                        peer: r.peer.clone(),
                        state: r.state.name().into(),
                        failure: (r.state == MemberState::Failed)
                            .then(|| failures.iter().find(|(p, _)| *p == r.peer))
                            .flatten()
                            .map(|(_, why)| why.clone()),
                        rebuild_failures: b.map_or(0, |b| b.failures),
                        retry_in_ms: b.and_then(|b| {
                            let left = b.retry_at.saturating_duration_since(now);
                            (!left.is_zero()).then_some(left.as_millis() as u64)
                        }),
                    }
                })
                .collect(),
            handovers: self
                .set
                .handovers()
                .into_iter()
                .map(|h| HandoverInfo {
                    direction: if h.taken { "in" } else { "out" }.into(),
                    other: h.other,
                    took_ms: u64::try_from(h.took.as_millis()).unwrap_or(u64::MAX),
                    ago_ms: u64::try_from(now.saturating_duration_since(h.at).as_millis())
                        .unwrap_or(u64::MAX),
                })
                .collect(),
            rebuild: self.rebuilding.lock().clone().map(|peer| {
                let done = self.rebuild.bytes_copied.load(Ordering::Relaxed);
                let remaining = self.rebuild.bytes_remaining.load(Ordering::Relaxed);
                RebuildInfo {
                    peer,
                    bytes_done: done,
                    bytes_remaining: remaining,
                    bytes_total: done + remaining,
                    bytes_per_sec: self.rebuild.rate(now),
                    eta_ms: self
                        .rebuild
                        .eta(now)
                        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                }
            }),
        }
    }

    /// The device stopped: its rebuild thread ends (a rebuild in progress
    /// is abandoned; the member stays `syncing` in the record and is never
    /// read from).
    pub fn stop(&self) {
        self.running.store(false, Ordering::Release);
    }

    /// Starts the device's rebuild thread: every `cfg.rebuild_check()`,
    /// while fewer members are active than the device has replicas, it
    /// looks for a failed member whose peer accepts sessions again and
    /// rebuilds it (fresh sessions, so a loss its peer suffered does not
    /// follow it); a member failed for `cfg.replace_after()` is replaced
    /// by a spare `spares` finds instead, when its own peer does not
    /// answer. One rebuild at a time, at `cfg.rebuild_bytes_per_sec`,
    /// `cfg.rebuild_inflight` copies at once (one while `guest` reports
    /// more than `cfg.rebuild_yield_above`); a peer whose rebuild failed
    /// waits `cfg.rebuild_backoff`.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn_rebuilder(
        self: &Arc<Self>,
        connector: Connector,
        spec: DeviceSpec,
        store: SpecStore,
        resolve: Resolve,
        spares: Option<FindSpare>,
        cfg: ReplicationConfig,
        guest: GuestInFlight,
    ) -> io::Result<JoinHandle<()>> {
        let weak = Arc::downgrade(self);
        let ctx = Rebuilder {
            connector,
            spec,
            store,
            resolve,
            spares,
            cfg,
            guest,
        };
        std::thread::Builder::new()
            .name("ublk-rebuild".into())
            .spawn(move || rebuild_loop(&weak, &ctx))
    }

    fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    /// Rebuilds `peer` (in place of the failed member `replaces`, when
    /// given) if it accepts sessions and is not backed off; `None` when it
    /// was not tried.
    fn try_rebuild(
        &self,
        peer: &str,
        replaces: Option<&str>,
        ctx: &Rebuilder,
    ) -> Option<RebuildOutcome> {
        let Rebuilder {
            connector,
            spec,
            resolve,
            cfg,
            guest,
            ..
        } = ctx;
        if self.backed_off(peer) {
            return None;
        }
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
                tracing::debug!(event = events::REBUILD_PEER_UNREACHABLE, volume, peer, error = %e);
                return None;
            }
        };
        let blob = u64::from(sessions.queues[0].blob_bytes().max(1));
        let rcfg = RebuildConfig {
            keys: 0..spec.size.div_ceil(blob),
            bytes_per_sec: cfg.rebuild_bytes_per_sec,
            change_deadline: cfg.core().change_deadline,
            replaces: replaces.map(str::to_owned),
            inflight: cfg.rebuild_inflight as usize,
            guest: Some(GuestLoad {
                in_flight: Arc::clone(guest),
                above: cfg.rebuild_yield_above,
            }),
        };
        *self.rebuilding.lock() = Some(peer.to_owned());
        tracing::info!(event = events::REBUILD_STARTED, volume, peer, replaces);
        let rebuild =
            std::pin::pin!(self
                .set
                .rebuild(peer, member_sessions(sessions), &rcfg, &self.rebuild));
        // A standby asking for the role abandons the rebuild: the member
        // stays syncing, and the next writer records it failed and
        // rebuilds it (its copy would stop with this writer's role).
        let stopped = std::pin::pin!(async {
            let clock = clock::system();
            while self.is_running() && !self.set.handover_wanted() {
                clock.sleep(Duration::from_millis(20)).await;
            }
        });
        let outcome = match block_on(select(rebuild, stopped)) {
            Either::Left((Ok(()), _)) => {
                tracing::info!(event = events::REBUILD_DONE, volume, peer, replaces,
                    membership = %self.set.membership());
                self.backoff.lock().remove(peer);
                RebuildOutcome::Done
            }
            Either::Left((Err(e), _)) => {
                let mut backoff = self.backoff.lock();
                let failures = backoff.get(peer).map_or(0, |b| b.failures) + 1;
                let pause = cfg.rebuild_backoff(failures);
                backoff.insert(
                    peer.to_owned(),
                    Backoff {
                        failures,
                        retry_at: Instant::now() + pause,
                    },
                );
                tracing::warn!(event = events::REBUILD_FAILED, volume, peer, error = %e, failures,
                    retry_in_ms = pause.as_millis() as u64);
                RebuildOutcome::Failed
            }
            Either::Right(_) => {
                tracing::info!(event = events::REBUILD_ABANDONED, volume, peer);
                RebuildOutcome::Abandoned
            }
        };
        self.rebuilds[outcome.index()].fetch_add(1, Ordering::Relaxed);
        let mut rebuilding = self.rebuilding.lock();
        let copied = self.rebuild.bytes_copied.swap(0, Ordering::Relaxed);
        self.rebuilt.fetch_add(copied, Ordering::Relaxed);
        self.rebuild.bytes_remaining.store(0, Ordering::Relaxed);
        *rebuilding = None;
        Some(outcome)
    }

    /// Whether `peer`'s last rebuild failed and its pause runs still.
    fn backed_off(&self, peer: &str) -> bool {
        self.backoff
            .lock()
            .get(peer)
            .is_some_and(|b| b.retry_at > Instant::now())
    }

    /// This device's part of the replica families; `wanted` is its
    /// replica count.
    pub fn replica_stats(&self, wanted: u64) -> ReplicaStats {
        let healthy = self.info().healthy as u64;
        let standing = self.set.standing();
        let (rebuild_bytes, rebuild_remaining) = self.rebuild_bytes();
        let rebuild_rate = match *self.rebuilding.lock() {
            Some(_) => self.rebuild.rate(Instant::now()),
            None => 0,
        };
        let core = self.set.stats();
        let hedged = core.hedged_reads.load(Ordering::Relaxed);
        let won = core.hedge_wins.load(Ordering::Relaxed);
        let mut hedged_reads = [0; HedgeOutcome::COUNT];
        hedged_reads[HedgeOutcome::Won.index()] = won;
        hedged_reads[HedgeOutcome::Lost.index()] = hedged.saturating_sub(won);
        ReplicaStats {
            replicas: wanted,
            healthy,
            degraded: u64::from(healthy < wanted),
            rebuild_bytes,
            rebuild_remaining,
            rebuild_rate,
            stale_epoch_fences: core.stale_epoch_fences.load(Ordering::Relaxed),
            unconfirmed: u64::from(matches!(standing, Standing::Unconfirmed(_))),
            fenced: u64::from(matches!(standing, Standing::Fenced(_))),
            stragglers: core.stragglers.load(Ordering::Relaxed),
            roles_regained: core.roles_regained.load(Ordering::Relaxed),
            standbys: u64::from(standing == Standing::Standby),
            handovers: [
                core.handovers_in.load(Ordering::Relaxed),
                core.handovers_out.load(Ordering::Relaxed),
            ],
            last_handover_ms: self
                .set
                .handovers()
                .iter()
                .rev()
                .find(|h| h.taken)
                .map_or(0, |h| u64::try_from(h.took.as_millis()).unwrap_or(u64::MAX)),
            hedged_reads,
            rebuilds: std::array::from_fn(|i| self.rebuilds[i].load(Ordering::Relaxed)),
        }
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
            tracing::warn!(event = events::REPLICAS_MEMBER_OUT, volume, peer = %r.peer, reason = %why);
            r.state = MemberState::Failed;
        }
    }
    next.validate()
        .map_err(|why| DeviceError::BadRequest(format!("volume {volume:?}: {why}")))?;
    match block_on(coord.compare_and_swap(record.epoch, next)) {
        Ok(Swap::Done) => Ok(()),
        Ok(Swap::Lost(now)) => Err(DeviceError::Coordination(CoordinationError::Unavailable {
            what: "membership",
            detail: format!("volume {volume:?}: the record changed while opening, to {now}"),
        })),
        Err(e) => Err(core_coord_error(volume, e)),
    }
}

/// What a device's rebuild thread works with.
struct Rebuilder {
    connector: Connector,
    spec: DeviceSpec,
    /// Where the device's role is recorded as it moves (hand-overs).
    store: SpecStore,
    resolve: Resolve,
    spares: Option<FindSpare>,
    cfg: ReplicationConfig,
    guest: GuestInFlight,
}

/// Records in the device's definition whether it is a standby now, so a
/// restarted ublkd serves it in the role it has.
fn record_role(ctx: &Rebuilder, standby: bool) {
    let mut spec = ctx.spec.clone();
    if let Some(r) = &mut spec.replicas {
        r.standby = standby;
    }
    if let Err(e) = ctx.store.save(&spec) {
        tracing::warn!(event = events::DEVICE_SAVE_FAILED, id = spec.id, error = %e);
    }
    tracing::info!(event = events::DEVICE_ROLE_CHANGED, id = spec.id, volume = %spec.volume,
        role = if standby { "standby" } else { "writer" });
}

fn rebuild_loop(weak: &Weak<Replicated>, ctx: &Rebuilder) {
    let cfg = &ctx.cfg;
    let volume = ctx.spec.volume.as_str();
    let wanted = ctx.spec.replicas.as_ref().map_or(1, |r| r.peers.len());
    // Short: a hand-over request waits for this loop (its pause).
    let step = Duration::from_millis(20).min(cfg.rebuild_check());
    let mut waited = Duration::ZERO;
    let mut standby = ctx.spec.replicas.as_ref().is_some_and(|r| r.standby);
    // Since when each failed member has been seen failed (by this thread:
    // a restarted ublkd starts its grace again).
    let mut failed_since: HashMap<String, Instant> = HashMap::new();
    loop {
        std::thread::sleep(step);
        waited += step;
        let Some(rep) = weak.upgrade().filter(|r| r.is_running()) else {
            return;
        };
        // The writer hands the role over when a standby asks.
        match block_on(rep.set.serve_handover()) {
            Ok(_) => {}
            Err(e) => tracing::warn!(event = events::REPLICA_HANDOVER_FAILED, volume, error = %e),
        }
        if rep.set.is_standby() != standby {
            standby = rep.set.is_standby();
            record_role(ctx, standby);
        }
        // A standby neither checks a role nor rebuilds: it has no role.
        if standby {
            continue;
        }
        // A role taken back under a new lease is confirmed here, off the
        // request path (the requests keep serving on the epoch fence).
        if matches!(rep.set.standing(), Standing::Unconfirmed(_)) {
            if let Err(e) = block_on(rep.set.check_role()) {
                tracing::debug!(event = events::REPLICA_ROLE_CHECK_FAILED, volume, error = %e);
            }
        }
        if waited < cfg.rebuild_check() {
            continue;
        }
        waited = Duration::ZERO;
        let membership = rep.set.membership();
        let failed: Vec<String> = membership
            .members
            .iter()
            .filter(|r| r.state == MemberState::Failed)
            .map(|r| r.peer.clone())
            .collect();
        failed_since.retain(|p, _| failed.contains(p));
        let now = Instant::now();
        for p in &failed {
            failed_since.entry(p.clone()).or_insert(now);
        }
        // A full set has no room: a member failed meanwhile stays failed
        // (superseded by the spare that replaced it, or a peer rebuilt
        // since), never read and never written.
        if membership.active().count() >= wanted {
            continue;
        }
        for peer in failed {
            if rep.try_rebuild(&peer, None, ctx).is_some() || !rep.is_running() {
                break;
            }
            let grace_over = failed_since
                .get(&peer)
                .is_some_and(|t| t.elapsed() >= cfg.replace_after());
            let Some(find) = ctx.spares.as_ref().filter(|_| grace_over) else {
                continue;
            };
            match find(volume, &peer) {
                Ok(Some(spare)) => {
                    if rep.try_rebuild(&spare, Some(&peer), ctx).is_some() {
                        break;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(event = events::REBUILD_SPARE_LOOKUP_FAILED, volume, peer, error = %e);
                }
            }
        }
    }
}

impl super::Manager {
    /// Replica health summed over the replicated devices, and the totals
    /// of the devices gone, for the metrics (metrics/src/replicas.rs).
    pub fn replica_stats(&self) -> ReplicaStats {
        let mut s = *self.retired.lock();
        for d in self.devices.lock().values() {
            let (Some(spec), Some((rep, _))) = (&d.spec.replicas, &d.replicated) else {
                continue;
            };
            s.add(&rep.replica_stats(spec.peers.len() as u64));
        }
        s
    }

    /// Keeps the totals of a device's volume that goes (`del`, or a
    /// recover that opens it anew), so that the counters summed over the
    /// devices never go back.
    pub(super) fn retire(&self, spec: &DeviceSpec, rep: &Replicated) {
        let wanted = spec.replicas.as_ref().map_or(1, |r| r.peers.len() as u64);
        self.retired.lock().add(&rep.replica_stats(wanted).totals());
    }

    /// How this ublkd finds a spare: placement in etcd; none without
    /// `[etcd]`.
    pub(super) fn spare_finder(&self) -> Option<FindSpare> {
        let slot = self.coordination.clone()?;
        Some(Arc::new(move |volume: &str, replacing: &str| {
            let c = slot.get().map_err(DeviceError::Coordination)?;
            let spare = c
                .spare_for(volume, replacing)
                .map_err(DeviceError::Coordination)?;
            Ok(spare.map(|p| p.id))
        }))
    }

    /// `add` without `--peer`: placement in etcd chooses the peers (`1` when
    /// `--replicas` is not given). One placed peer is a volume on one peer,
    /// served exactly as one named with `--peer`.
    pub(super) fn place(&self, a: &AddArgs) -> Result<AddArgs, DeviceError> {
        if a.standby {
            return self.standby_peers(a);
        }
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
        tracing::info!(event = events::REPLICAS_PLACED, volume = %a.volume, peers = ?peers);
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
        let coord: Arc<dyn Coordinator> =
            match &self.coordination {
                Some(_) if r.standby => Arc::new(self.coordination()?.open_standby(volume)?),
                None if r.standby => return Err(DeviceError::BadRequest(
                    "--standby needs an [etcd] section: the writer role is handed over through \
                     etcd"
                        .into(),
                )),
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
            Err(e) => tracing::warn!(event = events::WRITER_RELEASE_FAILED, volume, error = %e),
        }
    }

    /// A standby's members: the volume's record names them (the writer's
    /// `--peer`s or placement); any `--peer` given must be among them.
    fn standby_peers(&self, a: &AddArgs) -> Result<AddArgs, DeviceError> {
        if self.coordination.is_none() {
            return Err(DeviceError::BadRequest(
                "--standby needs an [etcd] section: the writer role is handed over through etcd"
                    .into(),
            ));
        }
        let record =
            crate::coordination::etcd::Etcd::wait(self.coordination()?.membership(&a.volume))?
                .ok_or_else(|| {
                    DeviceError::BadRequest(format!(
                "volume {:?} has no record in etcd: a standby follows a volume another ublkd \
                 serves; add it there first",
                a.volume
            ))
                })?;
        let peers: Vec<String> = record
            .record
            .membership
            .active()
            .map(|m| m.peer.clone())
            .collect();
        if let Some(p) = a.peers.iter().find(|p| !peers.contains(p)) {
            return Err(DeviceError::BadRequest(format!(
                "--peer {p} is not a member of volume {:?} (its members: {})",
                a.volume,
                peers.join(", ")
            )));
        }
        Ok(AddArgs {
            peers,
            replicas: None,
            ..a.clone()
        })
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
    Ok((n > 1 || a.standby).then(|| ReplicaSpec {
        peers: a.peers.clone(),
        standby: a.standby,
        activate_on_write: a.activate_on_write,
    }))
}
