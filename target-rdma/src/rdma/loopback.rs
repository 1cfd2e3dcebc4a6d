//! A verbs backend without hardware: one-sided operations between memory
//! regions registered in this process, checked like a device would check
//! them, with completion statuses that tests can inject.
//!
//! What is checked, as a verbs device does: the local key names a live
//! region of the requester QP's protection domain and covers the local
//! range (else a local protection error); the QP is connected to a live
//! peer that is not in the error state (else the requester's retries run
//! out: a responder in error drops requests without a NAK); the remote key
//! names a live region of the *responder* QP's protection domain that
//! grants the operation (remote read, remote write) and covers the remote
//! range (else a remote access error, which also moves the responder QP to
//! the error state, as rxe does). A region is refused once dropped
//! (deregistered); a protection domain lives while a region or QP of it
//! does.
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
    wc_status, Access, Completion, DeviceLimits, Domain, MemoryRegion, QueuePair, RdmaError,
    RdmaOp, RdmaProvider, WorkRequest,
};
use crate::proto::Endpoint;

#[derive(Clone, Copy)]
struct Region {
    addr: usize,
    len: usize,
    access: Access,
    pd: u32,
    dev: u32,
}

#[derive(Clone, Copy)]
struct QpState {
    /// The QP this one is connected to.
    peer: Option<u32>,
    pd: u32,
    /// In the error state.
    failed: bool,
}

#[derive(Default)]
struct World {
    regions: HashMap<u32, Region>,
    qps: HashMap<u32, QpState>,
    /// Live protection domains, and the device of each.
    pds: HashMap<u32, u32>,
}

static WORLD: LazyLock<Mutex<World>> = LazyLock::new(Mutex::default);
static NEXT_KEY: AtomicU32 = AtomicU32::new(0x100);

fn next_key() -> u32 {
    NEXT_KEY.fetch_add(1, Ordering::Relaxed) & 0xff_ffff
}

/// Statuses the next posts complete with, shared by a provider and its QPs.
type Injected = Arc<Mutex<VecDeque<u32>>>;

/// Runs before the next post on any QP of a provider.
type Hook = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// One loopback "device": what its domains and QPs share.
struct Dev {
    id: u32,
    injected: Injected,
    before_post: Hook,
    refuse_registration: Mutex<HashSet<usize>>,
    /// How long after its post a work request completes (zero: at once).
    completion_delay: Mutex<Duration>,
}

/// A protection domain; freed (forgotten by the world) with its last
/// holder: the provider or domain handle, a region, a QP.
struct Pd {
    id: u32,
    dev: Arc<Dev>,
}

impl Pd {
    fn new(dev: Arc<Dev>) -> Arc<Pd> {
        let id = next_key();
        WORLD.lock().pds.insert(id, dev.id);
        Arc::new(Pd { id, dev })
    }

    /// Registers in this domain (see [`Domain::register`]).
    fn register(
        self: &Arc<Self>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, RdmaError> {
        if self.dev.refuse_registration.lock().contains(&len) {
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
                access,
                pd: self.id,
                dev: self.dev.id,
            },
        );
        Ok(MemoryRegion::new(
            addr as usize,
            len,
            key,
            key,
            Box::new(Deregister {
                key,
                _pd: Arc::clone(self),
            }),
        ))
    }

    fn create_qp(self: &Arc<Self>) -> Result<Box<dyn QueuePair>, RdmaError> {
        let events = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )
        .map_err(|e| RdmaError::Verbs {
            step: "create_comp_channel",
            detail: e.to_string(),
        })?;
        let qpn = next_key();
        WORLD.lock().qps.insert(
            qpn,
            QpState {
                peer: None,
                pd: self.id,
                failed: false,
            },
        );
        Ok(Box::new(LoopbackQp {
            qpn,
            injected: Arc::clone(&self.dev.injected),
            before_post: Arc::clone(&self.dev.before_post),
            cq: Arc::new(Cq {
                ready: Mutex::new(VecDeque::new()),
                cv: Condvar::new(),
                events,
                armed: AtomicBool::new(false),
            }),
            pd: Arc::clone(self),
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        WORLD.lock().pds.remove(&self.id);
    }
}

/// A region's owner: dropping it deregisters the region (its keys are
/// refused from then on), then lets go of its domain.
struct Deregister {
    key: u32,
    _pd: Arc<Pd>,
}

impl Drop for Deregister {
    fn drop(&mut self) {
        WORLD.lock().regions.remove(&self.key);
    }
}

/// The loopback "device", with its own protection domain.
pub struct LoopbackProvider {
    own: LoopbackDomain,
}

impl Default for LoopbackProvider {
    fn default() -> Self {
        let dev = Arc::new(Dev {
            id: next_key(),
            injected: Arc::default(),
            before_post: Arc::default(),
            refuse_registration: Mutex::default(),
            completion_delay: Mutex::default(),
        });
        Self {
            own: LoopbackDomain(Pd::new(dev)),
        }
    }
}

impl LoopbackProvider {
    /// A fresh device.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn dev(&self) -> &Dev {
        &self.own.0.dev
    }

    /// The next post on any QP of this provider completes with `status`
    /// (an `IBV_WC_*` value) and moves no data.
    pub fn inject(&self, status: u32) {
        self.dev().injected.lock().push_back(status);
    }

    /// Runs `f` when the next work request is posted, before it moves any
    /// data: lets a test put another client's request between a lease and
    /// its transfer.
    pub fn before_next_post(&self, f: impl FnOnce() + Send + 'static) {
        *self.dev().before_post.lock() = Some(Box::new(f));
    }

    /// Work requests posted from now on complete `delay` after their post
    /// (their data still moves at the post), as a real device's do a
    /// moment later: the owner then waits on the completion channel.
    pub fn delay_completions(&self, delay: Duration) {
        *self.dev().completion_delay.lock() = delay;
    }

    /// Registrations of exactly `len` bytes fail from now on.
    pub fn refuse_registrations_of(&self, len: usize) {
        self.dev().refuse_registration.lock().insert(len);
    }

    /// Regions registered on this device (in any of its domains) and not
    /// yet deregistered.
    pub fn live_regions(&self) -> usize {
        let id = self.dev().id;
        WORLD
            .lock()
            .regions
            .values()
            .filter(|r| r.dev == id)
            .count()
    }

    /// Protection domains of this device still alive, its own included.
    pub fn live_domains(&self) -> usize {
        let id = self.dev().id;
        WORLD.lock().pds.values().filter(|&&d| d == id).count()
    }
}

impl RdmaProvider for LoopbackProvider {
    fn device_name(&self) -> String {
        "loopback".into()
    }

    fn domain(&self) -> &dyn Domain {
        &self.own
    }

    fn new_domain(&self) -> Result<Arc<dyn Domain>, RdmaError> {
        Ok(Arc::new(LoopbackDomain(Pd::new(Arc::clone(
            &self.own.0.dev,
        )))))
    }

    fn limits(&self) -> Result<DeviceLimits, RdmaError> {
        Ok(DeviceLimits {
            max_pd: u64::from(u32::MAX),
            max_mr: u64::from(u32::MAX),
        })
    }
}

/// A protection domain made by [`RdmaProvider::new_domain`].
struct LoopbackDomain(Arc<Pd>);

impl Domain for LoopbackDomain {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, RdmaError> {
        self.0.register(addr, len, access)
    }

    fn create_qp(&self, _depth: u32) -> Result<Box<dyn QueuePair>, RdmaError> {
        self.0.create_qp()
    }
}

struct LoopbackQp {
    qpn: u32,
    injected: Injected,
    before_post: Hook,
    cq: Arc<Cq>,
    // Dropped after the QP left the world (Drop below).
    pd: Arc<Pd>,
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
        let mut w = WORLD.lock();
        let fits = |r: &Region, addr: u64| {
            (addr as usize) >= r.addr
                && (addr as usize).saturating_add(wr.len as usize) <= r.addr + r.len
        };
        let Some(me) = w.qps.get(&self.qpn).copied() else {
            return wc_status::FATAL_ERR;
        };
        match w.regions.get(&wr.lkey) {
            Some(r) if r.pd == me.pd && fits(r, wr.local_addr) => {}
            _ => return wc_status::LOC_PROT_ERR,
        }
        let Some((peer, responder)) = me
            .peer
            .and_then(|p| w.qps.get(&p).map(|s| (p, *s)))
            .filter(|(_, s)| !s.failed)
        else {
            // No peer, or one in the error state: it drops the request
            // without answering, and the requester's retries run out.
            return wc_status::RETRY_EXC_ERR;
        };
        match w.regions.get(&wr.rkey) {
            Some(r)
                if r.pd == responder.pd && r.access.allows(wr.op) && fits(r, wr.remote_addr) => {}
            _ => {
                // A NAK for the requester; the responder goes to error.
                if let Some(s) = w.qps.get_mut(&peer) {
                    s.failed = true;
                }
                return wc_status::REM_ACCESS_ERR;
            }
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

    fn failed(&self) -> bool {
        WORLD.lock().qps.get(&self.qpn).is_none_or(|s| s.failed)
    }

    fn set_failed(&self) {
        if let Some(s) = WORLD.lock().qps.get_mut(&self.qpn) {
            s.failed = true;
        }
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
        if let Some(s) = w.qps.get_mut(&self.qpn) {
            s.peer = Some(remote.qpn);
        }
        Ok(())
    }

    fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError> {
        let hook = self.before_post.lock().take();
        if let Some(f) = hook {
            f();
        }
        let status = if self.failed() {
            wc_status::WR_FLUSH_ERR
        } else if let Some(s) = self.injected.lock().pop_front() {
            s
        } else {
            self.execute(wr)
        };
        if status != wc_status::SUCCESS {
            self.set_failed();
        }
        let c = Completion {
            wr_id: wr.wr_id,
            status,
        };
        let delay = *self.pd.dev.completion_delay.lock();
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
        self.set_failed();
        self.cq.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A QP pair: `server` in `domain`, `client` in the provider's own.
    fn pair(p: &LoopbackProvider, domain: &dyn Domain) -> (Box<dyn QueuePair>, Box<dyn QueuePair>) {
        let server = domain.create_qp(4).unwrap();
        let client = p.domain().create_qp(4).unwrap();
        server.connect(&client.endpoint()).unwrap();
        client.connect(&server.endpoint()).unwrap();
        (server, client)
    }

    fn one(
        qp: &dyn QueuePair,
        op: RdmaOp,
        local: &MemoryRegion,
        remote: usize,
        rkey: u32,
        len: u32,
    ) -> u32 {
        qp.post(&WorkRequest {
            wr_id: 1,
            op,
            local_addr: local.addr as u64,
            lkey: local.lkey,
            len,
            remote_addr: remote as u64,
            rkey,
        })
        .unwrap();
        let mut done = Vec::new();
        qp.poll(&mut done).unwrap();
        done[0].status
    }

    #[test]
    fn keys_are_checked_against_the_responder_domain_bounds_access_and_life() {
        let p = LoopbackProvider::new();
        let mut arena = vec![7u8; 4096];
        let mut buf = vec![0u8; 4096];
        let base = arena.as_mut_ptr();
        // SAFETY: `buf` and `arena` outlive every region (dropped at the
        // end of the test, after them) and are only touched by posts here.
        let local = unsafe {
            p.domain()
                .register(buf.as_mut_ptr(), buf.len(), Access::Local)
        }
        .unwrap();
        let (a, b) = (p.new_domain().unwrap(), p.new_domain().unwrap());
        assert_eq!(p.live_domains(), 3);
        // SAFETY: as above.
        let ro = unsafe { a.register(base, 1024, Access::RemoteRead) }.unwrap();
        // SAFETY: as above.
        let rw =
            unsafe { a.register(base.wrapping_add(1024), 1024, Access::RemoteReadWrite) }.unwrap();
        let (sa, ca) = pair(&p, a.as_ref());
        let at = |o: usize| base as usize + o;
        assert_eq!(
            one(&*ca, RdmaOp::Read, &local, at(0), ro.rkey, 1024),
            wc_status::SUCCESS
        );
        assert_eq!(buf[..1024], [7; 1024]);
        drop((sa, ca));
        // Writes through a read-only key, a range past the region, a QP of
        // another domain, a deregistered key: refused; each failure leaves
        // the QPs in error, so each case gets a fresh pair.
        let cases: [(&dyn Domain, RdmaOp, usize, u32, u32); 4] = [
            (a.as_ref(), RdmaOp::Write, at(0), ro.rkey, 16),
            (a.as_ref(), RdmaOp::Read, at(1024), rw.rkey, 1025),
            (b.as_ref(), RdmaOp::Read, at(1024), rw.rkey, 16),
            (a.as_ref(), RdmaOp::Read, at(0), 0xdead, 16),
        ];
        for (i, (d, op, addr, key, len)) in cases.into_iter().enumerate() {
            let (server, client) = pair(&p, d);
            assert_eq!(
                one(&*client, op, &local, addr, key, len),
                wc_status::REM_ACCESS_ERR,
                "case {i}"
            );
            assert_eq!(
                one(&*client, op, &local, addr, key, len),
                wc_status::WR_FLUSH_ERR
            );
            // The responder is in error too: it answers nobody any more.
            let again = p.domain().create_qp(4).unwrap();
            again.connect(&server.endpoint()).unwrap();
            assert_eq!(
                one(&*again, RdmaOp::Read, &local, at(0), ro.rkey, 16),
                wc_status::RETRY_EXC_ERR
            );
        }
        let (_sa, ca) = pair(&p, a.as_ref());
        let key = rw.rkey;
        drop(rw);
        assert_eq!(
            one(&*ca, RdmaOp::Write, &local, at(1024), key, 16),
            wc_status::REM_ACCESS_ERR
        );
        assert_eq!(arena[1024..1040], [7; 16], "nothing written");
        drop((ro, _sa, ca, a, b));
        assert_eq!(p.live_regions(), 1, "the local buffer");
        assert_eq!(p.live_domains(), 1, "the provider's own");
        drop(local);
    }
}
