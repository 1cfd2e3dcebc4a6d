//! The control plane's device manager: creates, recovers and deletes ublk
//! devices and keeps their definitions on disk, so a restarted `ublkd`
//! (after a crash, an upgrade or a reboot) brings the same devices back.
//!
//! Every device runs on its own thread inside libublk's `run_target`
//! (`thread.rs`), which spawns the queue threads (`queue.rs`); definitions
//! and their ublk parameters are in `spec.rs`. Devices are created with
//! `UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE`: when `ublkd` dies,
//! the kernel keeps `/dev/ublkbN` and holds its I/O, and the next `ublkd`
//! re-attaches and gets the unfinished requests again.
//!
//! The manager owns the devices' arena sessions, so it also watches them: a
//! monitor re-establishes lost connections every [`PEER_CHECK_INTERVAL`]
//! (so a device idle when its peer comes back turns ready again) and tells
//! each device's observer what it found.

mod connect;
mod handover;
mod replicas;
mod resize;
mod restore;
mod spec;
mod thread;

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use libublk::ctrl::UblkCtrl;
use libublk::sys;
use parking_lot::Mutex;
use target_rdma::auth::{Secret, SecretError};
use target_rdma::blob::BlobIo;
use target_rdma::blob::{ArenaError, ErrorKind as ArenaErrorKind};
use target_rdma::block::DeviceSize;
use target_rdma::client::ClientStats;
use target_rdma::proto::Welcome;
use target_rdma::service::size::{ApproxSize, HumanSize};

use crate::busy;
use crate::config::{check_geometry, ConfigError, DeviceDefaults, UblkdConfig};
use crate::coordination::{
    Coordination, CoordinationError, CoordinationErrorKind, CoordinationSlot,
};
use crate::ctl::{AddArgs, DeviceInfo, DeviceStatsInfo, ErrorKind, StatsReply};
use crate::device_stats::DeviceStats;
use crate::observability::{DevState, DeviceObs, Observability};
use crate::queue_io::{QueueIo, TagBuffers};
use connect::driver_stats;
pub use connect::Connector;
pub use replicas::{FindSpare, Replicated, Resolve};
use resize::{KernelSize, UblkDriver};
#[cfg(test)]
use spec::params;
use spec::shape;
pub use spec::{DeviceSpec, ReplicaSpec, SpecStore};
use thread::{device_thread, kernel_state, DeviceStart, Event, Mode};
use ublk_metrics::events;

/// The ublk control node; absent when `ublk_drv` is not loaded.
pub const UBLK_CONTROL: &str = "/dev/ublk-control";
/// How long a device may take from ADD to LIVE before `add` gives up.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the peer monitor checks (and re-establishes) the arena
/// connections of live devices.
pub const PEER_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Checks a device's queue sessions, re-establishing lost connections
/// (blocks up to the connect timeout per lost one: call it from the
/// monitor, never from `/ready`), and tells the device's observer.
pub fn check_peer(dev: &DeviceObs, ios: &[QueueIo]) {
    // A replicated queue is linked while any of its members is: the
    // volume serves on the others.
    let links: Vec<bool> = ios
        .iter()
        .map(|io| {
            io.sessions()
                .iter()
                .map(|s| s.client())
                .any(|c| c.is_connected() || c.welcome().is_ok())
        })
        .collect();
    dev.peer_checked(&links);
}

/// A request the manager refused or could not carry out.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No such device.
    #[error("no device {0} (see `ublkctl list`)")]
    Unknown(u32),
    /// Mounted or open.
    #[error("device {id} (/dev/ublkb{id}) is busy: {why}; unmount it or stop its users first, or pass --force")]
    Busy {
        /// Device id.
        id: u32,
        /// What holds it.
        why: String,
    },
    /// Invalid arguments.
    #[error("{0}")]
    BadRequest(String),
    /// `transport = rdma` and RDMA cannot be used.
    #[error("RDMA transport unavailable: {0}; use --transport tcp or --transport auto")]
    RdmaUnavailable(String),
    /// The secret file could not be used (the message names the file).
    #[error("{0}")]
    Secret(#[from] SecretError),
    /// The arena refused or could not be reached.
    #[error("{0}")]
    Arena(#[from] ArenaError),
    /// The device cannot be resized (the message says why).
    #[error("device {id} cannot be resized: {why}")]
    NotResizable {
        /// Device id.
        id: u32,
        /// Why not.
        why: String,
    },
    /// `ublk_drv` is not loaded.
    #[error("the ublk driver is not loaded: {UBLK_CONTROL} is missing (run `modprobe ublk_drv`)")]
    UblkMissing,
    /// A ublk control command failed.
    #[error("ublk {what} for device {id} failed: {detail}")]
    Ublk {
        /// The step.
        what: &'static str,
        /// Device id (-1 before the kernel assigned one).
        id: i64,
        /// The driver's error.
        detail: String,
    },
    /// The coordination service (etcd).
    #[error("{0}")]
    Coordination(#[from] CoordinationError),
    /// The state directory failed.
    #[error("state dir {path}: {source}")]
    State {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

impl DeviceError {
    /// Whether the coordination store could not be reached (etcd still
    /// connecting, down, or not answering in time): a replicated device
    /// waits for it rather than failing.
    pub fn coordinator_unreachable(&self) -> bool {
        match self {
            Self::Coordination(e) => {
                matches!(
                    e.kind(),
                    CoordinationErrorKind::Unavailable | CoordinationErrorKind::Busy
                )
            }
            Self::Arena(e) => {
                e.kind() == ArenaErrorKind::Replica(target_rdma::blob::ReplicaFailure::Unrecorded)
            }
            _ => false,
        }
    }

    /// The protocol error class.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Unknown(_) => ErrorKind::UnknownDevice,
            Self::Busy { .. } => ErrorKind::Busy,
            Self::BadRequest(_) | Self::Secret(_) => ErrorKind::BadRequest,
            Self::RdmaUnavailable(_) => ErrorKind::TransportUnavailable,
            Self::Arena(e) => match e.kind() {
                ArenaErrorKind::Connect => ErrorKind::PeerUnreachable,
                ArenaErrorKind::AuthFailed | ArenaErrorKind::PeerNotAuthentic => {
                    ErrorKind::AuthFailed
                }
                ArenaErrorKind::Refused(_)
                | ArenaErrorKind::TimedOut
                | ArenaErrorKind::Disconnected
                | ArenaErrorKind::Status(_)
                | ArenaErrorKind::Protocol
                | ArenaErrorKind::UnflushedDataLost
                | ArenaErrorKind::Replica(_) => ErrorKind::Peer,
            },
            Self::UblkMissing => ErrorKind::UblkMissing,
            Self::NotResizable { .. } => ErrorKind::Unsupported,
            Self::Ublk { .. } | Self::State { .. } => ErrorKind::System,
            Self::Coordination(e) => match e.kind() {
                CoordinationErrorKind::Invalid => ErrorKind::BadRequest,
                _ => ErrorKind::Coordination,
            },
        }
    }
}

/// Where a device is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Starting,
    Recovering,
    Live,
    Stopped,
    Failed(String),
}

impl State {
    fn dev_state(&self) -> DevState {
        match self {
            Self::Starting => DevState::Starting,
            Self::Recovering => DevState::Recovering,
            Self::Live => DevState::Live,
            Self::Stopped => DevState::Stopped,
            Self::Failed(_) => DevState::Failed,
        }
    }

    fn name(&self) -> &'static str {
        self.dev_state().name()
    }
}

/// One device the manager knows.
struct Device {
    spec: DeviceSpec,
    stats: Arc<DeviceStats>,
    state: Arc<Mutex<State>>,
    /// The queues' ways to the volume (shared), for FLUSH at shutdown.
    ios: Vec<QueueIo>,
    /// The size its queues check requests against (`spec.size`, shared).
    size: DeviceSize,
    /// The kernel device has `UBLK_F_UPDATE_SIZE` (`ublkctl resize`).
    resizable: bool,
    blob_bytes: u32,
    thread: Option<JoinHandle<()>>,
    /// A replicated volume's shared state and its rebuild thread.
    replicated: Option<(Arc<Replicated>, Option<JoinHandle<()>>)>,
}

/// Whether a launch creates a device (`add`) or brings back one that was
/// accepted before (restart, recovery): only a new one is held to the
/// volume's quota, so a lowered quota never keeps a kept device down.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Admission {
    New,
    Existing,
}

/// Refuses a device larger than its volume may hold, before the kernel
/// sees it: the arena would fail its writes past the quota, long after
/// `add` said yes. The quota comes with the session (the HELLO answer).
fn fits_quota(spec: &DeviceSpec, ios: &[QueueIo]) -> Result<(), DeviceError> {
    let Some(Ok(w)) = ios.first().map(|io| io.session().client().welcome()) else {
        return Ok(());
    };
    within_quota(spec, spec.size, &w)
}

/// Refuses `size` for `spec`'s volume when it is above the quota `w` (a
/// HELLO answer) names: `add` and `resize` say it alike.
fn within_quota(spec: &DeviceSpec, size: u64, w: &Welcome) -> Result<(), DeviceError> {
    let quota = w.quota_blobs.saturating_mul(u64::from(w.blob_bytes));
    if size > quota {
        return Err(DeviceError::BadRequest(format!(
            "--size {} is above the quota of volume {:?} on {}: {} ({} blobs of {}); \
             raise its quota in arenad.toml (`systemctl reload arenad`) or ask for less",
            HumanSize(size),
            spec.volume,
            spec.peer,
            ApproxSize(quota),
            w.quota_blobs,
            HumanSize(u64::from(w.blob_bytes)),
        )));
    }
    Ok(())
}

/// `--cpus`: every CPU must exist on this host (an affinity to none would
/// fail at start, in the kernel, long after `add` said yes).
fn check_cpus(cpus: &[u32]) -> Result<Vec<u32>, DeviceError> {
    let online = std::thread::available_parallelism().map_or(1, |n| n.get());
    let set = rustix::thread::sched_getaffinity(None).ok();
    for &c in cpus {
        let usable = match &set {
            Some(s) => (c as usize) < rustix::thread::CpuSet::MAX_CPU && s.is_set(c as usize),
            None => (c as usize) < online,
        };
        if !usable {
            return Err(DeviceError::BadRequest(format!(
                "invalid --cpus: CPU {c} is not available to ublkd on this host"
            )));
        }
    }
    Ok(cpus.to_vec())
}

/// Owns every device's lifecycle.
pub struct Manager {
    cfg: UblkdConfig,
    store: SpecStore,
    devices: Mutex<BTreeMap<u32, Device>>,
    /// Serialises add/del/recover; reads (list, stats) never wait on it.
    ops: Mutex<()>,
    obs: Arc<Observability>,
    /// etcd, when `[etcd]` is configured.
    coordination: Option<Arc<CoordinationSlot>>,
    /// The kernel's side of resizing (a fake in tests).
    kernel: Arc<dyn KernelSize>,
    /// The replica totals of devices gone (deleted, or opened anew by a
    /// recover), so the counters summed over devices never go back.
    retired: Mutex<ublk_metrics::ReplicaStats>,
}

impl Manager {
    /// A manager with no devices yet; [`Manager::restore`] brings back the
    /// persisted ones.
    pub fn new(cfg: UblkdConfig, obs: Arc<Observability>) -> Result<Self, DeviceError> {
        let store = SpecStore::open(&cfg.state_dir)?;
        let coordination = match &cfg.etcd {
            Some(e) => Some(
                CoordinationSlot::start(e.clone(), cfg.state_dir.clone()).map_err(|source| {
                    DeviceError::State {
                        path: cfg.state_dir.clone(),
                        source,
                    }
                })?,
            ),
            None => None,
        };
        Ok(Self {
            cfg,
            store,
            devices: Mutex::new(BTreeMap::new()),
            ops: Mutex::new(()),
            obs,
            coordination,
            kernel: Arc::new(UblkDriver),
            retired: Mutex::default(),
        })
    }

    /// The coordination service; an error naming the missing `[etcd]`
    /// section, or why etcd is not up yet.
    pub fn coordination(&self) -> Result<Arc<Coordination>, DeviceError> {
        let slot = self.coordination.as_ref().ok_or_else(|| {
            DeviceError::BadRequest(
                "no [etcd] section in ublkd's config: the placement pool lives in etcd".into(),
            )
        })?;
        Ok(slot.get()?)
    }

    /// Lists a device that could not be brought back as `failed` (it stays
    /// configured, so readiness reports it as not running).
    fn insert_failed(&self, spec: DeviceSpec, e: &DeviceError) {
        let id = spec.id;
        let spec_size = spec.size;
        if let Err(oe) = self.obs.register(
            shape(&spec),
            DevState::Failed,
            Arc::default(),
            None,
            Arc::new(ClientStats::default()),
        ) {
            tracing::warn!(event = events::DEVICE_METRICS_FAILED, id, error = %oe);
        }
        self.devices.lock().insert(
            id,
            Device {
                spec,
                stats: Arc::default(),
                state: Arc::new(Mutex::new(State::Failed(e.to_string()))),
                ios: Vec::new(),
                size: DeviceSize::new(spec_size),
                resizable: false,
                blob_bytes: 0,
                thread: None,
                replicated: None,
            },
        );
    }

    /// Recovers a quiesced kernel device, or re-creates a missing or dead one
    /// under the same id.
    fn bring_back(&self, spec: DeviceSpec) -> Result<(), DeviceError> {
        let id = spec.id;
        let mode = match kernel_state(id) {
            Some(s) if s == sys::UBLK_S_DEV_QUIESCED || s == sys::UBLK_S_DEV_LIVE => {
                Mode::Recover(id)
            }
            Some(_) => {
                // DEAD or FAIL_IO: nothing to recover; start over, same id.
                let _ = UblkCtrl::new_simple(id as i32).and_then(|c| c.del_dev());
                Mode::Add(id as i32)
            }
            None => Mode::Add(id as i32),
        };
        tracing::info!(event = events::DEVICE_BRING_BACK, id, mode = ?mode);
        self.launch(spec, mode, Admission::Existing).map(|_| ())
    }

    /// Connects the queues' clients, starts the device thread and waits
    /// until the device is live. Returns the device id. A replicated
    /// device that does not start gives its writer key back.
    fn launch(
        &self,
        spec: DeviceSpec,
        mode: Mode,
        admission: Admission,
    ) -> Result<u32, DeviceError> {
        let volume = spec.replicas.is_some().then(|| spec.volume.clone());
        let launched = self.start_device(spec, mode, admission);
        if let (Err(_), Some(volume)) = (&launched, volume) {
            self.release_writer(&volume);
        }
        launched
    }

    fn start_device(
        &self,
        mut spec: DeviceSpec,
        mode: Mode,
        admission: Admission,
    ) -> Result<u32, DeviceError> {
        let secret = Secret::from_file(&spec.secret_file)?;
        let connector = Connector::new(&self.cfg, Arc::clone(self.obs.tcp_links()));
        let (ios, replicated) = match &spec.replicas {
            None => (self.connect_single(&connector, &spec, &secret)?, None),
            Some(r) => {
                let (ios, rep) = self.open_replicated(&connector, &spec, r, &secret)?;
                (ios, Some(rep))
            }
        };
        let driver = driver_stats(&ios, &connector);
        if admission == Admission::New {
            fits_quota(&spec, &ios)?;
        }
        let blob_bytes = ios
            .first()
            .map_or(0, |io| io.session().client().session_blob_bytes());
        if !Path::new(UBLK_CONTROL).exists() {
            return Err(DeviceError::UblkMissing);
        }
        let stats = Arc::new(DeviceStats::default());
        let size = DeviceSize::new(spec.size);
        let state = Arc::new(Mutex::new(match mode {
            Mode::Add(_) => State::Starting,
            Mode::Recover(_) => State::Recovering,
        }));
        let (tx, rx) = mpsc::channel();
        let thread = {
            let start = DeviceStart {
                spec: spec.clone(),
                size: size.clone(),
                update_size: self.kernel.supported(),
                mode,
                ios: ios.clone(),
                stats: Arc::clone(&stats),
                driver,
                state: Arc::clone(&state),
                obs: Arc::clone(&self.obs),
            };
            std::thread::Builder::new()
                .name("ublk-dev".into())
                .spawn(move || device_thread(start, tx))
                .map_err(|source| DeviceError::State {
                    path: PathBuf::from("(thread)"),
                    source,
                })?
        };
        let wanted_id = match mode {
            Mode::Add(id) => i64::from(id),
            Mode::Recover(id) => i64::from(id),
        };
        let failed = |thread: JoinHandle<()>, detail: String| {
            let _ = thread.join();
            DeviceError::Ublk {
                what: "start",
                id: wanted_id,
                detail,
            }
        };
        let (id, resizable) = match rx.recv_timeout(START_TIMEOUT) {
            Ok(Event::Built(id, resizable)) => (id, resizable),
            Ok(Event::Failed(detail)) => return Err(failed(thread, detail)),
            Ok(Event::Started) | Err(_) => {
                return Err(failed(thread, "device thread gave no answer".into()))
            }
        };
        spec.id = id;
        // Persist before the device is live: if we crash from here on, the
        // next ublkd knows the kernel device is ours.
        self.store.save(&spec)?;
        match rx.recv_timeout(START_TIMEOUT) {
            Ok(Event::Started) => {}
            Ok(Event::Failed(detail)) => {
                let _ = self.store.remove(id);
                self.obs.unregister(id);
                return Err(failed(thread, detail));
            }
            Ok(Event::Built(..)) | Err(_) => {
                tracing::error!(event = events::DEVICE_START_TIMEOUT, id);
                let _ = UblkCtrl::new_simple(id as i32).and_then(|c| c.kill_dev());
                let _ = self.store.remove(id);
                self.obs.unregister(id);
                return Err(failed(thread, "device did not become live in time".into()));
            }
        }
        let replicated = match replicated {
            Some(rep) => {
                let rebuilder = rep
                    .spawn_rebuilder(
                        connector,
                        spec.clone(),
                        self.store.clone(),
                        self.resolver(),
                        self.spare_finder(),
                        self.cfg.replication.clone(),
                        {
                            let stats = Arc::clone(&stats);
                            Arc::new(move || stats.in_flight())
                        },
                    )
                    .map_err(
                        |e| tracing::error!(event = events::REBUILD_SPAWN_FAILED, id, error = %e),
                    )
                    .ok();
                Some((rep, rebuilder))
            }
            None => None,
        };
        self.devices.lock().insert(
            id,
            Device {
                spec,
                stats,
                state,
                ios,
                size,
                resizable,
                blob_bytes,
                thread: Some(thread),
                replicated,
            },
        );
        tracing::info!(event = events::DEVICE_LIVE, id, blob_bytes);
        Ok(id)
    }

    /// A volume on one peer: one session per queue, on the spec's
    /// transport.
    fn connect_single(
        &self,
        connector: &Connector,
        spec: &DeviceSpec,
        secret: &Secret,
    ) -> Result<Vec<QueueIo>, DeviceError> {
        let bufs: Vec<Arc<TagBuffers>> = (0..spec.queues)
            .map(|_| Arc::new(TagBuffers::new(spec.depth as usize, spec.io_buf as usize)))
            .collect();
        let sessions = connector.connect(spec, &spec.peer, secret, &bufs, false, true)?;
        Ok(sessions
            .queues
            .into_iter()
            .zip(bufs)
            .map(|(s, b)| QueueIo::single(s, b))
            .collect())
    }

    /// Builds a spec from `add` arguments and the `[device]` defaults.
    fn spec_for(&self, a: &AddArgs) -> Result<DeviceSpec, DeviceError> {
        let d: &DeviceDefaults = &self.cfg.device;
        let queues = a.queues.unwrap_or(d.queues);
        let depth = a.depth.unwrap_or(d.depth);
        let io_buf = a.io_buf.unwrap_or(d.io_buf);
        let blob_size = a.blob_size.unwrap_or(d.blob_size);
        check_geometry(queues, depth, io_buf, blob_size).map_err(|e| match e {
            ConfigError::Invalid { key, value, reason } => DeviceError::BadRequest(format!(
                "invalid --{} {value}: {reason}",
                key.trim_start_matches("device.").replace('_', "-")
            )),
            other => DeviceError::BadRequest(other.to_string()),
        })?;
        let lbs = u64::from(d.logical_block_size);
        if a.size == 0 || !a.size.is_multiple_of(lbs) {
            return Err(DeviceError::BadRequest(format!(
                "invalid --size {}: must be a non-zero multiple of the {lbs}-byte logical block size",
                a.size
            )));
        }
        if a.volume.is_empty() {
            return Err(DeviceError::BadRequest("--volume must not be empty".into()));
        }
        let replicas = replicas::replica_spec(a)?;
        let Some(peer) = a.peers.first() else {
            return Err(DeviceError::BadRequest("--peer must be given".into()));
        };
        let spec = DeviceSpec {
            id: 0,
            peer: peer.clone(),
            volume: a.volume.clone(),
            secret_file: a.secret_file.clone(),
            size: a.size,
            queues,
            depth,
            io_buf,
            blob_size,
            transport: a.transport.unwrap_or(d.transport),
            confidential: a.confidential || d.confidential,
            logical_block_size: d.logical_block_size,
            physical_block_size: d.physical_block_size,
            max_io_size: d.effective_max_io(io_buf),
            discard: d.discard,
            max_discard_size: d.max_discard_size,
            write_zeroes: d.write_zeroes,
            max_write_zeroes_size: d.max_write_zeroes_size,
            write_cache: d.write_cache,
            fua: d.fua,
            read_only: a.read_only,
            cpus: check_cpus(&a.cpus)?,
            replicas,
        };
        spec.check_transport().map(|()| spec)
    }

    /// `add`: creates a device and returns its description.
    pub fn add(&self, a: &AddArgs) -> Result<DeviceInfo, DeviceError> {
        let a = &self.place(a)?;
        let spec = self.spec_for(a)?;
        if !a.secret_file.is_absolute() {
            return Err(DeviceError::BadRequest(format!(
                "--secret-file {} must be an absolute path (ublkd resolves it, not your shell)",
                a.secret_file.display()
            )));
        }
        let _op = self.ops.lock();
        // -1: the kernel picks a free id.
        let wanted = match a.id {
            Some(id) if self.devices.lock().contains_key(&id) => {
                return Err(DeviceError::BadRequest(format!(
                    "device {id} exists (see `ublkctl list`); pick another -n or leave it out"
                )))
            }
            Some(id) => i32::try_from(id).map_err(|_| {
                DeviceError::BadRequest(format!("invalid -n {id}: a ublk device id is below 2^31"))
            })?,
            None => -1,
        };
        if spec.replicas.is_some() {
            if let Some((id, _)) = self
                .devices
                .lock()
                .iter()
                .find(|(_, d)| d.spec.volume == spec.volume)
            {
                return Err(DeviceError::BadRequest(format!(
                    "volume {:?} is already served here by device {id}: a replicated volume has one writer",
                    spec.volume
                )));
            }
        }
        let id = self.launch(spec, Mode::Add(wanted), Admission::New)?;
        self.info(id)
    }

    /// `del`: stops and deletes a device and its definition.
    pub fn del(&self, id: u32, force: bool) -> Result<(), DeviceError> {
        let _op = self.ops.lock();
        if !self.devices.lock().contains_key(&id) {
            return Err(DeviceError::Unknown(id));
        }
        if !force {
            match busy::check(id) {
                Ok(Some(why)) => {
                    return Err(DeviceError::Busy {
                        id,
                        why: why.to_string(),
                    })
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(event = events::DEVICE_BUSY_CHECK_FAILED, id, error = %e),
            }
        }
        let dev = self.devices.lock().remove(&id);
        if let Some(mut dev) = dev {
            self.stop(id, &mut dev);
            if dev.spec.replicas.is_some() {
                self.release_writer(&dev.spec.volume);
            }
        }
        let _ = UblkCtrl::new_simple(id as i32).and_then(|c| c.del_dev());
        self.obs.unregister(id);
        self.store.remove(id)?;
        tracing::info!(event = events::DEVICE_DELETED, id, force);
        Ok(())
    }

    /// Stops the kernel device and waits for its thread.
    fn stop(&self, id: u32, dev: &mut Device) {
        if kernel_state(id).is_some() {
            if let Err(e) = UblkCtrl::new_simple(id as i32).and_then(|c| c.kill_dev()) {
                tracing::warn!(event = events::DEVICE_STOP_FAILED, id, error = %e);
            }
        }
        self.finish(dev);
    }

    /// Waits for a stopped device's thread, and ends its rebuild thread
    /// (its replica totals retired).
    fn finish(&self, dev: &mut Device) {
        if let Some(t) = dev.thread.take() {
            let _ = t.join();
        }
        if let Some((rep, rebuilder)) = dev.replicated.take() {
            rep.stop();
            if let Some(t) = rebuilder {
                let _ = t.join();
            }
            self.retire(&dev.spec, &rep);
        }
    }

    /// `recover`: brings a stopped or failed device back; of a live
    /// replicated device whose writer is fenced, takes the volume over
    /// again (the writer key, then a raised epoch: whoever served the
    /// volume meanwhile is fenced in turn).
    pub fn recover(&self, id: u32) -> Result<DeviceInfo, DeviceError> {
        let _op = self.ops.lock();
        let spec = {
            let devs = self.devices.lock();
            let dev = devs.get(&id).ok_or(DeviceError::Unknown(id))?;
            let state = dev.state.lock().clone();
            let fenced = dev.replicated.as_ref().filter(|(r, _)| r.fenced());
            if let (State::Live, Some((rep, _))) = (&state, fenced) {
                let rep = Arc::clone(rep);
                let volume = dev.spec.volume.clone();
                drop(devs);
                if let Some(slot) = &self.coordination {
                    slot.get()?.writer().acquire(&volume)?;
                }
                futures::executor::block_on(rep.set().take_over())?;
                tracing::warn!(event = events::DEVICE_TAKEN_OVER, id, volume = %volume);
                return self.info(id);
            }
            if state == State::Live {
                return Err(DeviceError::BadRequest(format!(
                    "device {id} is live; there is nothing to recover"
                )));
            }
            dev.spec.clone()
        };
        if let Some(mut dev) = self.devices.lock().remove(&id) {
            self.finish(&mut dev);
        }
        if let Err(e) = self.bring_back(spec.clone()) {
            self.insert_failed(spec, &e);
            return Err(e);
        }
        self.info(id)
    }

    fn describe(&self, id: u32, dev: &Device) -> DeviceInfo {
        let state = dev.state.lock().clone();
        let negotiated = self.obs.device(id).and_then(|o| o.negotiated());
        DeviceInfo {
            id,
            node: format!("/dev/ublkb{id}"),
            size: dev.spec.size,
            read_only: dev.spec.read_only,
            cpus: dev.spec.cpus.clone(),
            queues: dev.spec.queues,
            depth: dev.spec.depth,
            io_buf: dev.spec.io_buf,
            blob_size: u64::from(dev.blob_bytes),
            state: state.name().into(),
            error: match state {
                State::Failed(e) => Some(e),
                _ => None,
            },
            peer: dev.spec.peer.clone(),
            volume: dev.spec.volume.clone(),
            transport: negotiated
                .as_ref()
                .map_or("none", |(n, _)| n.as_str())
                .into(),
            transport_requested: dev.spec.transport.name().into(),
            transport_note: negotiated.and_then(|(_, why)| dev.spec.transport_note(why)),
            confidential: dev.spec.confidential,
            logical_block_size: dev.spec.logical_block_size,
            rails: self.obs.rails(id),
            replicas: dev.replicated.as_ref().map(|(r, _)| r.info()),
        }
    }

    /// `show`.
    pub fn info(&self, id: u32) -> Result<DeviceInfo, DeviceError> {
        let devs = self.devices.lock();
        let dev = devs.get(&id).ok_or(DeviceError::Unknown(id))?;
        Ok(self.describe(id, dev))
    }

    /// `list`.
    pub fn list(&self) -> Vec<DeviceInfo> {
        self.devices
            .lock()
            .iter()
            .map(|(id, d)| self.describe(*id, d))
            .collect()
    }

    /// `stats`: per-device counters (with the stalled requests from the
    /// trackers) and the driver statistics of the same devices.
    pub fn stats(&self, id: Option<u32>) -> Result<StatsReply, DeviceError> {
        let devs = self.devices.lock();
        if let Some(id) = id {
            if !devs.contains_key(&id) {
                return Err(DeviceError::Unknown(id));
            }
        }
        let threshold = self.obs.stall_threshold();
        let devices = devs
            .iter()
            .filter(|(i, _)| id.is_none_or(|want| want == **i))
            .map(|(i, d)| {
                let tracked = self.obs.device(*i).map(|o| o.table().snapshot(threshold));
                DeviceStatsInfo {
                    id: *i,
                    node: format!("/dev/ublkb{i}"),
                    stats: d.stats.snapshot(),
                    stalled: tracked.map_or(0, |t| t.stalled),
                    oldest_inflight_ms: tracked.map_or(0, |t| t.oldest.as_millis() as u64),
                }
            })
            .collect();
        drop(devs);
        Ok(StatsReply {
            devices,
            driver: self.obs.driver_reports(id),
        })
    }

    /// Checks (and re-establishes) the arena connections of live devices.
    /// The devices lock is not held while connecting.
    pub fn check_peers(&self) {
        let live: Vec<(Arc<DeviceObs>, Vec<QueueIo>)> = self
            .devices
            .lock()
            .iter()
            .filter(|(_, d)| *d.state.lock() == State::Live)
            .filter_map(|(id, d)| Some((self.obs.device(*id)?, d.ios.clone())))
            .collect();
        for (dev, ios) in live {
            check_peer(&dev, &ios);
        }
    }

    /// Runs [`Manager::check_peers`] every [`PEER_CHECK_INTERVAL`] on its
    /// own thread, for as long as the manager lives.
    pub fn spawn_peer_monitor(self: &Arc<Self>) -> io::Result<JoinHandle<()>> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("ublkd-peers".into())
            .spawn(move || loop {
                std::thread::sleep(PEER_CHECK_INTERVAL);
                match weak.upgrade() {
                    Some(m) => m.check_peers(),
                    None => return,
                }
            })
    }

    /// SIGTERM with `on_shutdown = "keep"`: FLUSH every device's arena
    /// session so everything acknowledged is durable, and leave the kernel
    /// devices for the next `ublkd` to recover. The caller then exits; the
    /// kernel quiesces the devices when our file descriptors close.
    pub fn shutdown_keep(&self) {
        let _op = self.ops.lock();
        for (id, dev) in self.devices.lock().iter() {
            for io in &dev.ios {
                if let Err(e) = futures::executor::block_on(io.volume().flush()) {
                    tracing::warn!(event = events::DEVICE_FLUSH_FAILED, id, error = %e);
                }
            }
            tracing::info!(event = events::DEVICE_KEPT, id);
        }
    }

    /// SIGTERM with `on_shutdown = "remove"`: delete every device.
    pub fn shutdown_remove(&self) {
        let ids: Vec<u32> = self.devices.lock().keys().copied().collect();
        for id in ids {
            if let Err(e) = self.del(id, true) {
                tracing::warn!(event = events::DEVICE_REMOVE_FAILED, id, error = %e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::config::TransportChoice;

    fn cfg(dir: &Path) -> UblkdConfig {
        let mut c = UblkdConfig::defaults();
        c.state_dir = dir.to_owned();
        c
    }

    fn manager(dir: &Path) -> Manager {
        let c = cfg(dir);
        let obs = Observability::new(
            ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
            &c.metrics,
            &c.tracing,
        );
        Manager::new(c, obs).unwrap()
    }

    fn args() -> AddArgs {
        AddArgs {
            peers: vec!["127.0.0.1:1".into()],
            replicas: None,
            volume: "vol".into(),
            secret_file: "/nonexistent/secret".into(),
            size: 64 << 20,
            queues: None,
            depth: None,
            blob_size: None,
            transport: None,
            confidential: false,
            io_buf: None,
            id: None,
            read_only: false,
            standby: false,
            activate_on_write: false,
            cpus: Vec::new(),
        }
    }

    #[test]
    fn specs_persist_and_reload() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path());
        let mut s = m.spec_for(&args()).unwrap();
        s.id = 7;
        m.store.save(&s).unwrap();
        fs::write(dir.path().join("devices/broken.json"), "{").unwrap();
        assert_eq!(m.store.load_all().unwrap(), vec![s.clone()]);
        m.store.remove(7).unwrap();
        m.store.remove(7).unwrap();
        assert!(m.store.load_all().unwrap().is_empty());
    }

    #[test]
    fn add_arguments_are_checked_with_clear_messages() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path());
        let msg = |f: &dyn Fn(&mut AddArgs)| {
            let mut a = args();
            f(&mut a);
            let e = m.add(&a).unwrap_err();
            (e.kind(), e.to_string())
        };
        assert_eq!(
            msg(&|a| a.size = 1000),
            (
                ErrorKind::BadRequest,
                "invalid --size 1000: must be a non-zero multiple of the 512-byte logical block size"
                    .into()
            )
        );
        assert_eq!(
            msg(&|a| a.depth = Some(0)).1,
            "invalid --depth 0: must be between 1 and 4096"
        );
        assert_eq!(
            msg(&|a| a.io_buf = Some(3000)).1,
            "invalid --io-buf 3000: must be a multiple of 4K between 4K and 1M"
        );
        assert_eq!(
            msg(&|a| a.blob_size = Some(5000)).1,
            "invalid --blob-size 5000: must be 0 (the volume's) or a power of two from 4K to 16M"
        );
        assert_eq!(
            msg(&|a| a.secret_file = "rel/secret".into()).1,
            "--secret-file rel/secret must be an absolute path (ublkd resolves it, not your shell)"
        );
        let (kind, text) = msg(&|_| {});
        assert_eq!(kind, ErrorKind::BadRequest);
        assert!(
            text.starts_with("secret file /nonexistent/secret: "),
            "{text}"
        );
    }

    /// An `add` that fails after some queues connected (here the peer
    /// refuses the third connection) leaves no arena session open: the
    /// peer's count goes back to zero.
    #[test]
    fn a_failed_add_closes_every_arena_session_it_opened() {
        use target_rdma::testing::{secret_file, Peer, PeerOpts, SECRET_A};
        let dir = tempfile::tempdir().unwrap();
        let peer = Peer::start(
            &dir.path().join("peer"),
            PeerOpts {
                max_connections: 2,
                ..PeerOpts::default()
            },
        );
        let m = manager(&dir.path().join("ublkd"));
        let mut a = args();
        a.peers = vec![peer.addr.to_string()];
        a.volume = "a".into();
        a.secret_file = secret_file(dir.path(), "a.key", SECRET_A);
        a.queues = Some(4);
        a.blob_size = Some(64 << 10);
        a.transport = Some(TransportChoice::Tcp);
        let e = m.add(&a).unwrap_err();
        assert!(e.to_string().contains("too many connections"), "{e}");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while peer.sessions() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} sessions still open after the failed add",
                peer.sessions()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // The peer's places are free again once those connections' tasks
        // end (a moment after their sessions are counted closed): a client
        // gets in.
        loop {
            match target_rdma::client::ArenaClient::connect(peer.config("a", SECRET_A)) {
                Ok(c) => break drop(c),
                Err(e) => assert!(std::time::Instant::now() < deadline, "no place freed: {e}"),
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn rdma_without_a_usable_device_is_refused_at_add_naming_the_reason() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let mut c = cfg(dir.path());
        // A device no host has: refused whether or not this host has RDMA.
        c.rdma.device = Some("nosuchdev9".into());
        let obs = Observability::new(
            ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
            &c.metrics,
            &c.tracing,
        );
        let m = Manager::new(c, obs).unwrap();
        let secret = dir.path().join("secret");
        fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
        fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
        let a = AddArgs {
            secret_file: secret,
            transport: Some(TransportChoice::Rdma),
            ..args()
        };
        let e = m.add(&a).unwrap_err();
        let text = e.to_string();
        assert_eq!(e.kind(), ErrorKind::TransportUnavailable, "{text}");
        assert!(text.starts_with("RDMA transport unavailable: "), "{text}");
        assert!(
            text.ends_with("; use --transport tcp or --transport auto"),
            "{text}"
        );
        assert!(m.list().is_empty());
        assert!(m.store.load_all().unwrap().is_empty(), "nothing persisted");
    }

    #[test]
    fn a_size_above_the_volume_quota_is_refused_before_the_kernel() {
        use std::os::unix::fs::PermissionsExt;
        use target_rdma::testing::{Peer, PeerOpts, SECRET_A};
        let dir = tempfile::tempdir().unwrap();
        // 16 blobs of 64K: a 1M quota.
        let peer_dir = tempfile::tempdir().unwrap();
        let peer = Peer::start(
            peer_dir.path(),
            PeerOpts {
                quota_blobs: 16,
                ..PeerOpts::default()
            },
        );
        let m = manager(dir.path());
        let secret = dir.path().join("secret");
        fs::write(&secret, SECRET_A).unwrap();
        fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
        let add = |size: u64| {
            m.add(&AddArgs {
                peers: vec![peer.addr.to_string()],
                volume: "a".into(),
                secret_file: secret.clone(),
                size,
                ..args()
            })
            .unwrap_err()
        };
        let e = add(2 << 20);
        assert_eq!(e.kind(), ErrorKind::BadRequest);
        assert_eq!(
            e.to_string(),
            format!(
                "--size 2M is above the quota of volume \"a\" on {}: 1M (16 blobs of 64K); \
                 raise its quota in arenad.toml (`systemctl reload arenad`) or ask for less",
                peer.addr
            )
        );
        // At the quota, add goes on to the kernel (absent here, or refused
        // for some other reason, but not for the quota).
        let e = add(1 << 20);
        assert!(!e.to_string().contains("quota"), "{e}");
        assert!(m.store.load_all().unwrap().is_empty(), "nothing persisted");
    }

    #[test]
    fn cpus_must_be_usable_here() {
        assert_eq!(check_cpus(&[0, 0]).unwrap(), vec![0, 0]);
        assert_eq!(
            check_cpus(&[0, 70000]).unwrap_err().to_string(),
            "invalid --cpus: CPU 70000 is not available to ublkd on this host"
        );
    }

    #[test]
    fn unknown_devices_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path());
        for e in [
            m.del(4, false).unwrap_err(),
            m.info(4).unwrap_err(),
            m.recover(4).unwrap_err(),
            m.stats(Some(4)).unwrap_err(),
        ] {
            assert_eq!(e.kind(), ErrorKind::UnknownDevice);
            assert_eq!(e.to_string(), "no device 4 (see `ublkctl list`)");
        }
        assert!(m.list().is_empty());
    }

    #[test]
    fn params_carry_cache_fua_and_discard_limits() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path());
        let s = m.spec_for(&args()).unwrap();
        let p = params(&s);
        assert_eq!(
            p.types,
            sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD
        );
        assert_eq!(
            p.basic.attrs,
            sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA
        );
        assert_eq!(p.basic.logical_bs_shift, 9);
        assert_eq!(p.basic.physical_bs_shift, 12);
        assert_eq!(p.basic.dev_sectors, (64 << 20) >> 9);
        assert_eq!(p.basic.max_sectors, (512 << 10) >> 9);
        assert_eq!(p.discard.max_discard_sectors, (1 << 30) >> 9);
        assert_eq!(p.discard.max_write_zeroes_sectors, (1 << 30) >> 9);
        assert_eq!(p.discard.max_discard_segments, 1);

        // add --read-only: the kernel is told, and the definition keeps it
        // (definitions written before the key existed read as writable).
        let ro = m
            .spec_for(&AddArgs {
                read_only: true,
                ..args()
            })
            .unwrap();
        assert_ne!(params(&ro).basic.attrs & sys::UBLK_ATTR_READ_ONLY, 0);
        assert_eq!(p.basic.attrs & sys::UBLK_ATTR_READ_ONLY, 0);
        let mut json = serde_json::to_value(&ro).unwrap();
        assert_eq!(json["read_only"], true);
        json.as_object_mut().unwrap().remove("read_only");
        let old: DeviceSpec = serde_json::from_value(json).unwrap();
        assert!(!old.read_only);
    }

    /// A definition exactly as ublkd before replication wrote it still
    /// loads, as a volume on one peer, and is written back byte for byte.
    #[test]
    fn definitions_from_before_replication_load_unchanged() {
        let old = r#"{
  "id": 3,
  "peer": "10.0.0.5:7070",
  "volume": "vm1",
  "secret_file": "/etc/ublk/vm1.key",
  "size": 68719476736,
  "queues": 2,
  "depth": 64,
  "io_buf": 524288,
  "blob_size": 0,
  "transport": "tcp",
  "logical_block_size": 512,
  "physical_block_size": 4096,
  "max_io_size": 524288,
  "discard": true,
  "max_discard_size": 1073741824,
  "write_zeroes": true,
  "max_write_zeroes_size": 1073741824,
  "write_cache": true,
  "fua": true,
  "read_only": false,
  "cpus": []
}"#;
        let dir = tempfile::tempdir().unwrap();
        let store = SpecStore::open(dir.path()).unwrap();
        fs::write(dir.path().join("devices/3.json"), old).unwrap();
        let loaded = store.load_all().unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].replicas, None);
        store.save(&loaded[0]).unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join("devices/3.json")).unwrap(),
            old
        );
        // `add --peer P` (one replica) makes exactly such a definition.
        let m = manager(dir.path());
        let one = m
            .spec_for(&AddArgs {
                replicas: Some(1),
                ..args()
            })
            .unwrap();
        assert_eq!(one.replicas, None);
        assert!(!serde_json::to_string(&one).unwrap().contains("replicas"));
    }

    #[test]
    fn replica_sets_are_checked_and_persisted() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path());
        let peers = |n: usize| (1..=n).map(|i| format!("10.0.0.{i}:7070")).collect();
        let msg = |a: AddArgs| m.spec_for(&a).unwrap_err().to_string();
        assert_eq!(
            msg(AddArgs {
                peers: peers(2),
                replicas: Some(3),
                ..args()
            }),
            "--replicas 3 needs 3 --peer (got 2), or no --peer to let placement choose"
        );
        assert_eq!(
            msg(AddArgs {
                peers: peers(6),
                replicas: Some(6),
                ..args()
            }),
            "invalid --replicas 6: must be between 1 and 5"
        );
        assert_eq!(
            msg(AddArgs {
                peers: vec!["h:1".into(), "h:1".into()],
                ..args()
            }),
            "--peer h:1 is given twice: replicas live on distinct peers"
        );
        // Without [etcd] there is nothing to place on.
        let e = m
            .add(&AddArgs {
                peers: Vec::new(),
                replicas: Some(2),
                ..args()
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadRequest);
        assert!(e.to_string().starts_with("--peer is required"), "{e}");

        let mut s = m
            .spec_for(&AddArgs {
                peers: peers(3),
                ..args()
            })
            .unwrap();
        assert_eq!(s.peer, "10.0.0.1:7070");
        assert_eq!(
            s.replicas,
            Some(ReplicaSpec {
                peers: peers(3),
                ..Default::default()
            })
        );
        s.id = 9;
        m.store.save(&s).unwrap();
        assert_eq!(m.store.load_all().unwrap(), vec![s]);
    }

    /// `--confidential` with `--transport rdma` (or over `[device]
    /// transport = "rdma"`) is refused with what to do; with `auto` the
    /// device is served on TCP, and `show` says why.
    #[test]
    fn confidential_devices_refuse_rdma_and_take_tcp_for_auto() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path());
        let refused = "--confidential keeps payloads on the sealed TCP stream, and RDMA moves \
                       them in the clear: use --transport tcp or auto";
        let rdma = AddArgs {
            confidential: true,
            transport: Some(TransportChoice::Rdma),
            ..args()
        };
        let e = m.spec_for(&rdma).unwrap_err();
        assert_eq!(
            (e.kind(), e.to_string()),
            (ErrorKind::BadRequest, refused.into())
        );
        // `add` refuses it before reading the secret or connecting.
        let e = m.add(&rdma).unwrap_err();
        assert_eq!(e.to_string(), refused);
        assert!(m.store.load_all().unwrap().is_empty(), "nothing persisted");

        let auto = m
            .spec_for(&AddArgs {
                confidential: true,
                ..args()
            })
            .unwrap();
        assert!(auto.confidential);
        assert_eq!(auto.transport, TransportChoice::Auto, "kept as asked");
        assert_eq!(auto.effective_transport(), TransportChoice::Tcp);
        assert_eq!(
            auto.transport_note(None).as_deref(),
            Some("confidential: payloads stay on the sealed TCP stream")
        );
        let tcp = m
            .spec_for(&AddArgs {
                confidential: true,
                transport: Some(TransportChoice::Tcp),
                ..args()
            })
            .unwrap();
        assert_eq!(tcp.effective_transport(), TransportChoice::Tcp);
        assert_eq!(tcp.transport_note(None), None, "TCP was asked for");

        // Not confidential: as before.
        let plain = m.spec_for(&args()).unwrap();
        assert!(!plain.confidential);
        assert_eq!(plain.effective_transport(), TransportChoice::Auto);
        assert_eq!(
            plain.transport_note(Some("the arena peer declined RDMA".into())),
            Some("the arena peer declined RDMA".into())
        );
        assert!(plain.check_transport().is_ok());

        // A definition edited by hand into confidential RDMA does not
        // connect either.
        let mut edited = plain.clone();
        edited.transport = TransportChoice::Rdma;
        edited.confidential = true;
        assert_eq!(edited.check_transport().unwrap_err().to_string(), refused);
    }

    /// `[device] confidential = true` makes every new device confidential
    /// (the flag cannot turn it off); the flag alone makes one.
    #[test]
    fn the_config_default_and_the_flag_make_a_device_confidential() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cfg(dir.path());
        assert!(!c.device.confidential, "off by default");
        c.device.confidential = true;
        let obs = Observability::new(
            ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
            &c.metrics,
            &c.tracing,
        );
        let m = Manager::new(c, obs).unwrap();
        assert!(m.spec_for(&args()).unwrap().confidential);
        let e = m
            .spec_for(&AddArgs {
                transport: Some(TransportChoice::Rdma),
                ..args()
            })
            .unwrap_err();
        assert!(
            e.to_string().starts_with("--confidential keeps payloads"),
            "{e}"
        );
        let m = manager(&dir.path().join("other"));
        assert!(!m.spec_for(&args()).unwrap().confidential);
        assert!(
            m.spec_for(&AddArgs {
                confidential: true,
                ..args()
            })
            .unwrap()
            .confidential
        );
    }

    /// A definition written before the key existed reads as not
    /// confidential; a confidential one keeps it across a save and load,
    /// and a plain one is written without the key.
    #[test]
    fn definitions_without_confidential_load_as_not_confidential() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path());
        let old = r#"{"id":4,"peer":"h:1","volume":"v","secret_file":"/s","size":4096,"queues":1,"depth":64,"io_buf":524288,"blob_size":0,"transport":"auto","logical_block_size":512,"physical_block_size":4096,"max_io_size":524288,"discard":true,"max_discard_size":1073741824,"write_zeroes":true,"max_write_zeroes_size":1073741824,"write_cache":true,"fua":true,"read_only":false,"cpus":[]}"#;
        let spec: DeviceSpec = serde_json::from_str(old).unwrap();
        assert!(!spec.confidential);
        assert!(!serde_json::to_string(&spec)
            .unwrap()
            .contains("confidential"));
        let mut s = m
            .spec_for(&AddArgs {
                confidential: true,
                ..args()
            })
            .unwrap();
        s.id = 5;
        assert_eq!(serde_json::to_value(&s).unwrap()["confidential"], true);
        m.store.save(&s).unwrap();
        assert_eq!(m.store.load_all().unwrap(), vec![s]);
    }

    /// `add` requests of ublkctl from before replication (`"peer": "h:p"`)
    /// still parse.
    #[test]
    fn old_add_requests_still_parse() {
        let line = r#"{"version":1,"op":"add","peer":"h:1","volume":"v","secret_file":"/s","size":4096,"queues":null,"depth":null,"blob_size":null,"transport":null,"io_buf":null}"#;
        let r: crate::ctl::RequestLine = serde_json::from_str(line).unwrap();
        let crate::ctl::Request::Add(a) = r.body else {
            panic!("{r:?}")
        };
        assert_eq!((a.peers, a.replicas), (vec!["h:1".to_string()], None));
        assert!(!a.confidential, "a request from before the key");
    }
}
