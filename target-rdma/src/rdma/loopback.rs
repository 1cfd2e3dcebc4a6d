//! A verbs backend without hardware: one-sided operations between memory
//! regions registered in this process, checked like a device would check
//! them (key, bounds, remote access, a connected peer QP), with completion
//! statuses that tests can inject.
//!
//! It lets the transport, the server's rail setup and the conformance suite
//! run on hosts without an RDMA device; the VM suite runs the same code over
//! [`SidewayProvider`](super::verbs::SidewayProvider).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::{
    wc_status, Completion, MemoryRegion, QueuePair, RdmaError, RdmaOp, RdmaProvider, WorkRequest,
};
use crate::proto::Endpoint;

#[derive(Clone, Copy)]
struct Region {
    addr: usize,
    len: usize,
    remote: bool,
}

#[derive(Default)]
struct World {
    regions: HashMap<u32, Region>,
    /// QPs that exist, and the peer each connected one talks to.
    qps: HashMap<u32, Option<u32>>,
}

static WORLD: LazyLock<Mutex<World>> = LazyLock::new(Mutex::default);
static NEXT_KEY: AtomicU32 = AtomicU32::new(0x100);

fn next_key() -> u32 {
    NEXT_KEY.fetch_add(1, Ordering::Relaxed) & 0xff_ffff
}

struct Deregister(u32);
impl Drop for Deregister {
    fn drop(&mut self) {
        WORLD.lock().regions.remove(&self.0);
    }
}

/// Statuses the next posts complete with, shared by a provider and its QPs.
type Injected = Arc<Mutex<VecDeque<u32>>>;

/// Runs before the next post on any QP of a provider.
type Hook = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// The loopback "device".
#[derive(Default)]
pub struct LoopbackProvider {
    injected: Injected,
    before_post: Hook,
    refuse_registration: Arc<Mutex<HashSet<usize>>>,
    /// How long after its post a work request completes (zero: at once).
    completion_delay: Arc<Mutex<Duration>>,
}

impl LoopbackProvider {
    /// A fresh device.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The next post on any QP of this provider completes with `status`
    /// (an `IBV_WC_*` value) and moves no data.
    pub fn inject(&self, status: u32) {
        self.injected.lock().push_back(status);
    }

    /// Runs `f` when the next work request is posted, before it moves any
    /// data: lets a test put another client's request between a lease and
    /// its transfer.
    pub fn before_next_post(&self, f: impl FnOnce() + Send + 'static) {
        *self.before_post.lock() = Some(Box::new(f));
    }

    /// Work requests posted from now on complete `delay` after their post
    /// (their data still moves at the post), as a real device's do a
    /// moment later: the owner then waits on the completion channel.
    pub fn delay_completions(&self, delay: Duration) {
        *self.completion_delay.lock() = delay;
    }

    /// Registrations of exactly `len` bytes fail from now on.
    pub fn refuse_registrations_of(&self, len: usize) {
        self.refuse_registration.lock().insert(len);
    }
}

impl RdmaProvider for LoopbackProvider {
    fn device_name(&self) -> String {
        "loopback".into()
    }

    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        remote: bool,
    ) -> Result<MemoryRegion, RdmaError> {
        if self.refuse_registration.lock().contains(&len) {
            return Err(RdmaError::Register {
                addr: addr as usize,
                len,
                detail: "refused by the loopback device (test injection)".into(),
            });
        }
        let key = next_key();
        WORLD.lock().regions.insert(
            key,
            Region {
                addr: addr as usize,
                len,
                remote,
            },
        );
        Ok(MemoryRegion::new(
            addr as usize,
            len,
            key,
            key,
            Box::new(Deregister(key)),
        ))
    }

    fn create_qp(&self, _depth: u32) -> Result<Box<dyn QueuePair>, RdmaError> {
        let events = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )
        .map_err(|e| RdmaError::Verbs {
            step: "create_comp_channel",
            detail: e.to_string(),
        })?;
        let qpn = next_key();
        WORLD.lock().qps.insert(qpn, None);
        Ok(Box::new(LoopbackQp {
            qpn,
            injected: Arc::clone(&self.injected),
            before_post: Arc::clone(&self.before_post),
            delay: Arc::clone(&self.completion_delay),
            cq: Arc::new(Cq {
                ready: Mutex::new(VecDeque::new()),
                cv: Condvar::new(),
                events,
                armed: AtomicBool::new(false),
            }),
            failed: Mutex::new(false),
        }))
    }
}

struct LoopbackQp {
    qpn: u32,
    injected: Injected,
    before_post: Hook,
    delay: Arc<Mutex<Duration>>,
    cq: Arc<Cq>,
    failed: Mutex<bool>,
}

/// A QP's completion queue and its channel.
struct Cq {
    ready: Mutex<VecDeque<Completion>>,
    cv: Condvar,
    /// The completion channel: an eventfd written for the first completion
    /// after `arm`, as a device raises one event per arming.
    events: OwnedFd,
    armed: AtomicBool,
}

impl Cq {
    fn push(&self, c: Completion) {
        self.ready.lock().push_back(c);
        self.cv.notify_all();
        if self.armed.swap(false, Ordering::AcqRel) {
            // EAGAIN (counter saturated) still leaves the fd readable.
            let _ = rustix::io::write(&self.events, &1u64.to_ne_bytes());
        }
    }
}

impl Drop for LoopbackQp {
    fn drop(&mut self) {
        WORLD.lock().qps.remove(&self.qpn);
    }
}

impl LoopbackQp {
    /// Checks and performs `wr` like a device would; returns the status.
    fn execute(&self, wr: &WorkRequest) -> u32 {
        let w = WORLD.lock();
        let fits = |r: &Region, addr: u64| {
            (addr as usize) >= r.addr
                && (addr as usize).saturating_add(wr.len as usize) <= r.addr + r.len
        };
        match w.regions.get(&wr.lkey) {
            Some(r) if fits(r, wr.local_addr) => {}
            _ => return wc_status::LOC_PROT_ERR,
        }
        match w.qps.get(&self.qpn).copied().flatten() {
            Some(peer) if w.qps.contains_key(&peer) => {}
            _ => return wc_status::RETRY_EXC_ERR,
        }
        match w.regions.get(&wr.rkey) {
            Some(r) if r.remote && fits(r, wr.remote_addr) => {}
            _ => return wc_status::REM_ACCESS_ERR,
        }
        let (src, dst) = match wr.op {
            RdmaOp::Read => (wr.remote_addr, wr.local_addr),
            RdmaOp::Write => (wr.local_addr, wr.remote_addr),
        };
        // SAFETY: both ranges lie inside live registered regions (checked
        // above under the registry lock, which deregistration also takes), and
        // the register contract makes their owners keep them valid and free
        // of conflicting Rust references while RDMA may touch them.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, wr.len as usize) };
        wc_status::SUCCESS
    }
}

impl QueuePair for LoopbackQp {
    fn endpoint(&self) -> Endpoint {
        Endpoint {
            qpn: self.qpn,
            psn: 0,
            lid: 0,
            mtu: 3,
            gid: [0; 16],
        }
    }

    fn connect(&self, remote: &Endpoint) -> Result<(), RdmaError> {
        let mut w = WORLD.lock();
        if !w.qps.contains_key(&remote.qpn) {
            return Err(RdmaError::Verbs {
                step: "modify_qp(RTR)",
                detail: format!("no loopback QP {:#x}", remote.qpn),
            });
        }
        w.qps.insert(self.qpn, Some(remote.qpn));
        Ok(())
    }

    fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError> {
        let hook = self.before_post.lock().take();
        if let Some(f) = hook {
            f();
        }
        let status = if *self.failed.lock() {
            wc_status::WR_FLUSH_ERR
        } else if let Some(s) = self.injected.lock().pop_front() {
            s
        } else {
            self.execute(wr)
        };
        if status != wc_status::SUCCESS {
            *self.failed.lock() = true;
        }
        let c = Completion {
            wr_id: wr.wr_id,
            status,
        };
        let delay = *self.delay.lock();
        if delay.is_zero() {
            self.cq.push(c);
        } else {
            let cq = Arc::clone(&self.cq);
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                cq.push(c);
            });
        }
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> Result<(), RdmaError> {
        let mut r = self.cq.ready.lock();
        if r.is_empty() {
            self.cq.cv.wait_for(&mut r, timeout);
        }
        Ok(())
    }

    fn event_fd(&self) -> RawFd {
        self.cq.events.as_raw_fd()
    }

    fn arm(&self) -> Result<(), RdmaError> {
        self.cq.armed.store(true, Ordering::Release);
        Ok(())
    }

    fn take_event(&self) -> Result<bool, RdmaError> {
        let mut buf = [0u8; 8];
        Ok(matches!(rustix::io::read(&self.cq.events, &mut buf), Ok(8)))
    }

    fn poll(&self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        out.extend(self.cq.ready.lock().drain(..));
        Ok(())
    }

    fn fail(&self) {
        *self.failed.lock() = true;
        self.cq.cv.notify_all();
    }
}
