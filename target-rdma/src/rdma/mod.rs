//! The RDMA verbs layer both sides share: arenad registers its arena and
//! accepts rails with it, the client transport (`client::rdma`) moves
//! payloads with it.
//!
//! The verbs are reached through [`RdmaProvider`] / [`Domain`] /
//! [`QueuePair`] so that
//! everything above them (wr id bookkeeping, error taxonomy, fallback
//! decisions, lease caching, recovery) is tested on hosts without an RDMA
//! device against `loopback::LoopbackProvider` (test support, feature
//! `test-utils`), which moves bytes between registered regions of one
//! process and can inject every completion status.
//! [`verbs::SidewayProvider`] is the real backend (rdma-core through
//! `sideway`), proven over soft-RoCE in the VM suite.

#[cfg(any(test, feature = "test-utils"))]
pub mod loopback;
pub mod verbs;

use std::any::Any;
use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::proto::Endpoint;

/// Whether a daemon uses RDMA: a config value (`rdma = "auto"|"off"|"on"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RdmaMode {
    /// Use RDMA when a device opens; otherwise serve TCP only, and say so.
    #[default]
    Auto,
    /// Never use RDMA.
    Off,
    /// RDMA or a clear startup error.
    On,
}

/// What the keys a server hands an RDMA session reach: a config value
/// (`rdma_isolation = "lease"|"shared"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// A protection domain per session and a memory region per lease,
    /// registered in it over exactly that slot: a key reaches only the slot
    /// its lease is on, only through that session's QP, and dies with the
    /// lease.
    #[default]
    Lease,
    /// One key to the whole arena for every session (no per-lease
    /// registration): every RDMA client can read and write every volume's
    /// slots.
    Shared,
}

impl Isolation {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lease => "lease",
            Self::Shared => "shared",
        }
    }
}

/// Which device, port and GID a provider uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSelector {
    /// Device name (`rxe0`, `mlx5_0`); `None` takes the first device with an active port.
    pub device: Option<String>,
    /// Port number; `None` takes the device's first active port.
    pub port: Option<u8>,
    /// GID table index. 1 is the IPv4-mapped RoCEv2 GID on soft-RoCE; index
    /// 0 (link-local) fails at RTR with "network unreachable".
    pub gid_index: u8,
}

impl Default for DeviceSelector {
    fn default() -> Self {
        Self {
            device: None,
            port: None,
            gid_index: 1,
        }
    }
}

/// A failure of the verbs layer, naming the step and the value involved.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// No RDMA device is present (or libibverbs has no provider for it).
    #[error("no RDMA device: {detail}")]
    NoDevice {
        /// What was looked for and what happened.
        detail: String,
    },
    /// The named device has no usable port or GID.
    #[error("RDMA device {device}: {detail}")]
    Device {
        /// The device.
        device: String,
        /// What is wrong.
        detail: String,
    },
    /// A verbs call failed.
    #[error("RDMA {step} failed: {detail}")]
    Verbs {
        /// Which call (`alloc_pd`, `create_cq`, `modify_qp(RTR)`, ...).
        step: &'static str,
        /// The cause.
        detail: String,
    },
    /// Registering memory failed.
    #[error("registering {len} bytes at {addr:#x} for RDMA failed: {detail}")]
    Register {
        /// Start of the range.
        addr: usize,
        /// Its length.
        len: usize,
        /// The cause.
        detail: String,
    },
    /// The send queue is full.
    #[error("RDMA send queue full ({depth} work requests in flight)")]
    QueueFull {
        /// The queue depth.
        depth: u32,
    },
}

/// What a registration lets peers do with the memory. Remote access is
/// always only through a QP of the region's protection domain ([`Domain`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Only local access (our buffers, which a READ lands in).
    Local,
    /// Remote read (a GET lease's slot).
    RemoteRead,
    /// Remote read and write (an ALLOC lease's slot, or the whole arena
    /// with `rdma_isolation = "shared"`).
    RemoteReadWrite,
}

impl Access {
    /// Whether a one-sided `op` arriving from a peer is allowed.
    pub fn allows(self, op: RdmaOp) -> bool {
        match (self, op) {
            (Self::Local, _) => false,
            (Self::RemoteRead, RdmaOp::Read) => true,
            (Self::RemoteRead, RdmaOp::Write) => false,
            (Self::RemoteReadWrite, _) => true,
        }
    }
}

/// What a device can hold, for `arenad --check` (per-lease isolation
/// needs a protection domain per RDMA session and a region per lease).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Protection domains (`max_pd`).
    pub max_pd: u64,
    /// Memory regions (`max_mr`).
    pub max_mr: u64,
}

/// A registered memory region. Dropping it deregisters.
pub struct MemoryRegion {
    /// First byte.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Key for local access (our scatter/gather entries).
    pub lkey: u32,
    /// Key a peer names in one-sided operations.
    pub rkey: u32,
    _owner: Box<dyn Any + Send + Sync>,
}

impl MemoryRegion {
    /// Wraps a backend's registration; `owner` deregisters on drop.
    pub fn new(
        addr: usize,
        len: usize,
        lkey: u32,
        rkey: u32,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        Self {
            addr,
            len,
            lkey,
            rkey,
            _owner: owner,
        }
    }

    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr && addr.saturating_add(len) <= self.addr + self.len
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.len)
            .field("lkey", &self.lkey)
            .finish_non_exhaustive()
    }
}

/// One-sided operation direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOp {
    /// Remote → local.
    Read,
    /// Local → remote.
    Write,
}

/// One signaled RDMA READ or WRITE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Matches the completion to its waiter.
    pub wr_id: u64,
    /// Direction.
    pub op: RdmaOp,
    /// Local buffer address (inside a region with `lkey`).
    pub local_addr: u64,
    /// Local key.
    pub lkey: u32,
    /// Bytes to move.
    pub len: u32,
    /// Remote address (inside the peer's region with `rkey`).
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// The outcome of one work request, as a raw `ibv_wc_status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// `IBV_WC_*` status (0 is success).
    pub status: u32,
}

/// Raw `ibv_wc_status` values used by the taxonomy (stable ABI numbers).
pub mod wc_status {
    /// IBV_WC_SUCCESS
    pub const SUCCESS: u32 = 0;
    /// IBV_WC_LOC_LEN_ERR
    pub const LOC_LEN_ERR: u32 = 1;
    /// IBV_WC_LOC_QP_OP_ERR
    pub const LOC_QP_OP_ERR: u32 = 2;
    /// IBV_WC_LOC_PROT_ERR
    pub const LOC_PROT_ERR: u32 = 4;
    /// IBV_WC_WR_FLUSH_ERR
    pub const WR_FLUSH_ERR: u32 = 5;
    /// IBV_WC_LOC_ACCESS_ERR
    pub const LOC_ACCESS_ERR: u32 = 8;
    /// IBV_WC_REM_INV_REQ_ERR
    pub const REM_INV_REQ_ERR: u32 = 9;
    /// IBV_WC_REM_ACCESS_ERR
    pub const REM_ACCESS_ERR: u32 = 10;
    /// IBV_WC_REM_OP_ERR
    pub const REM_OP_ERR: u32 = 11;
    /// IBV_WC_RETRY_EXC_ERR
    pub const RETRY_EXC_ERR: u32 = 12;
    /// IBV_WC_RNR_RETRY_EXC_ERR
    pub const RNR_RETRY_EXC_ERR: u32 = 13;
    /// IBV_WC_FATAL_ERR
    pub const FATAL_ERR: u32 = 19;
    /// IBV_WC_GENERAL_ERR
    pub const GENERAL_ERR: u32 = 21;
}

/// Failure category of a work completion: a closed set, used as a metric
/// label (`wc_error` reason) and to pick the block request's errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcCategory {
    /// The peer did not acknowledge in time (link or peer down).
    RetryExceeded,
    /// The peer had no receive ready (never expected for one-sided ops).
    RnrRetryExceeded,
    /// The peer refused the rkey/range/access.
    RemoteAccess,
    /// Our lkey/range/access was wrong.
    LocalProtection,
    /// Flushed because the QP entered the error state.
    Flush,
    /// Anything else.
    Other,
}

impl WcCategory {
    /// Maps a raw `ibv_wc_status`; `None` for success.
    pub fn from_status(status: u32) -> Option<Self> {
        use wc_status::*;
        Some(match status {
            SUCCESS => return None,
            RETRY_EXC_ERR => Self::RetryExceeded,
            RNR_RETRY_EXC_ERR => Self::RnrRetryExceeded,
            REM_ACCESS_ERR | REM_INV_REQ_ERR => Self::RemoteAccess,
            LOC_PROT_ERR | LOC_ACCESS_ERR | LOC_LEN_ERR => Self::LocalProtection,
            WR_FLUSH_ERR => Self::Flush,
            _ => Self::Other,
        })
    }

    /// Stable lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::RetryExceeded => "retry_exceeded",
            Self::RnrRetryExceeded => "rnr_retry_exceeded",
            Self::RemoteAccess => "remote_access",
            Self::LocalProtection => "local_protection",
            Self::Flush => "flush",
            Self::Other => "other",
        }
    }

    /// The errno a block request failed by this category completes with:
    /// an unreachable peer is `EHOSTUNREACH`-like transient I/O trouble
    /// (`EIO`), a refused key is a permission problem (`EACCES`), a local
    /// protection fault is our bug (`EFAULT`), a flush is `ECANCELED`.
    pub fn errno(self) -> i32 {
        match self {
            Self::RetryExceeded | Self::RnrRetryExceeded | Self::Other => libc::EIO,
            Self::RemoteAccess => libc::EACCES,
            Self::LocalProtection => libc::EFAULT,
            Self::Flush => libc::ECANCELED,
        }
    }
}

/// A device session: a protection domain of its own (where the client
/// registers its buffers and creates its QP), and further protection
/// domains on demand.
pub trait RdmaProvider: Send + Sync {
    /// Device name, for logs.
    fn device_name(&self) -> String;

    /// The provider's own protection domain.
    fn domain(&self) -> &dyn Domain;

    /// A new protection domain: what is registered in it is reachable only
    /// through queue pairs created in it (arenad makes one per RDMA
    /// session with `rdma_isolation = "lease"`).
    fn new_domain(&self) -> Result<Arc<dyn Domain>, RdmaError>;

    /// What the device can hold.
    fn limits(&self) -> Result<DeviceLimits, RdmaError>;
}

/// A protection domain. The device checks every remote key against the
/// domain of the QP the access arrives on: a key registered in another
/// domain is refused (remote access error) even if guessed. It is freed
/// once its regions and queue pairs are gone (they keep it alive).
pub trait Domain: Send + Sync {
    /// Registers `[addr, addr + len)` for local write and `access`, in this
    /// domain. Dropping the region deregisters it: once the drop returned
    /// the device refuses its keys.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped and valid for the lifetime of the returned
    /// region, and every RDMA access through it must not race Rust
    /// references to the same bytes.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, RdmaError>;

    /// Creates an RC queue pair in this domain with `depth` send slots and
    /// its own completion queue and channel, in INIT.
    fn create_qp(&self, depth: u32) -> Result<Box<dyn QueuePair>, RdmaError>;
}

/// An RC queue pair with its completion queue.
pub trait QueuePair: Send + Sync {
    /// Our half of the endpoint exchange.
    fn endpoint(&self) -> Endpoint;
    /// Brings the QP through RTR to RTS against `remote`. `max_rd_atomic`
    /// must be at least 1 on both sides or READs never complete.
    fn connect(&self, remote: &Endpoint) -> Result<(), RdmaError>;
    /// Posts one signaled work request.
    fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError>;
    /// Sleeps until a completion event arrives or `timeout` passes (the
    /// event is acknowledged and the CQ re-armed before returning).
    fn wait(&self, timeout: Duration) -> Result<(), RdmaError>;
    /// The completion channel's descriptor, for an owner that waits on its
    /// own event loop instead of [`wait`](Self::wait): readable once a
    /// completion arrived after [`arm`](Self::arm).
    fn event_fd(&self) -> RawFd;
    /// Asks for one event on the next completion. A completion that arrived
    /// before the call may not make one: poll after arming, before waiting.
    fn arm(&self) -> Result<(), RdmaError>;
    /// Consumes (and acknowledges) a pending event without blocking; `true`
    /// if there was one. Never sleeps.
    fn take_event(&self) -> Result<bool, RdmaError>;
    /// Moves completions that are ready into `out`.
    fn poll(&self, out: &mut Vec<Completion>) -> Result<(), RdmaError>;
    /// Moves the QP to the error state, so the device stops touching the
    /// buffers of work requests still outstanding (they complete as flushed).
    fn fail(&self);
}

/// Opens the provider a config asks for: `Ok(None)` when RDMA is off, or
/// `auto` found no device (the reason is returned for logs and counters).
pub fn open_provider(
    mode: RdmaMode,
    sel: &DeviceSelector,
) -> Result<Result<Arc<dyn RdmaProvider>, String>, RdmaError> {
    match mode {
        RdmaMode::Off => Ok(Err("rdma = \"off\"".into())),
        RdmaMode::On => Ok(Ok(Arc::new(verbs::SidewayProvider::open(sel)?))),
        RdmaMode::Auto => Ok(match verbs::SidewayProvider::open(sel) {
            Ok(p) => Ok(Arc::new(p)),
            Err(e) => Err(e.to_string()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_completion_status_maps_to_a_category_and_errno() {
        use wc_status::*;
        assert_eq!(WcCategory::from_status(SUCCESS), None);
        let table = [
            (RETRY_EXC_ERR, WcCategory::RetryExceeded, libc::EIO),
            (RNR_RETRY_EXC_ERR, WcCategory::RnrRetryExceeded, libc::EIO),
            (REM_ACCESS_ERR, WcCategory::RemoteAccess, libc::EACCES),
            (REM_INV_REQ_ERR, WcCategory::RemoteAccess, libc::EACCES),
            (LOC_PROT_ERR, WcCategory::LocalProtection, libc::EFAULT),
            (LOC_ACCESS_ERR, WcCategory::LocalProtection, libc::EFAULT),
            (LOC_LEN_ERR, WcCategory::LocalProtection, libc::EFAULT),
            (WR_FLUSH_ERR, WcCategory::Flush, libc::ECANCELED),
            (LOC_QP_OP_ERR, WcCategory::Other, libc::EIO),
            (REM_OP_ERR, WcCategory::Other, libc::EIO),
            (FATAL_ERR, WcCategory::Other, libc::EIO),
            (GENERAL_ERR, WcCategory::Other, libc::EIO),
        ];
        for (status, cat, errno) in table {
            let c = WcCategory::from_status(status).unwrap();
            assert_eq!((c, c.errno()), (cat, errno), "status {status}");
        }
        // Every raw value up to the largest defined one has a category.
        for s in 1..=23 {
            assert!(WcCategory::from_status(s).is_some());
        }
    }

    #[test]
    fn region_bounds() {
        let r = MemoryRegion::new(1000, 100, 1, 2, Box::new(()));
        assert!(r.contains(1000, 100));
        assert!(r.contains(1050, 0));
        assert!(!r.contains(999, 2));
        assert!(!r.contains(1050, 51));
        assert!(!r.contains(usize::MAX, 2));
    }
}
