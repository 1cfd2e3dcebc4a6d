//! The real verbs backend: rdma-core through `sideway` (measured facts and
//! pitfalls: `shared/notes/SIDEWAY-RXE.md`).
//!
//! A basic CQ, not an extended one: rdma-core 44's rxe provider corrupts the
//! extended poll loop. Each QP gets its own CQ and completion channel, so one
//! connection's completions never wake another connection's thread.
//!
//! The provider has a protection domain of its own (the client's QP and
//! buffers, a shared arena); [`RdmaProvider::new_domain`] makes more (arenad
//! gives each RDMA session one with `rdma_isolation = "lease"`). A region
//! and a QP each keep their domain alive (sideway holds an `Arc` of it), so
//! a domain is deallocated after the last of them.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rdma_mummy_sys::{ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_req_notify_cq};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, GenericCompletionQueue,
    PollCompletionQueueError,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair as _, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::{
    Access, Completion, DeviceLimits, DeviceSelector, Domain, MemoryRegion, QueuePair, RdmaError,
    RdmaOp, RdmaProvider, WorkRequest,
};
use crate::proto::Endpoint;

/// Largest path MTU we ask for (IBV_MTU_1024): measured to work on rxe.
const MAX_MTU: u8 = 3;

fn verbs_err(step: &'static str, e: impl std::fmt::Display) -> RdmaError {
    RdmaError::Verbs {
        step,
        detail: e.to_string(),
    }
}

/// An opened device: context and protection domain, on the selected port/GID.
pub struct SidewayProvider {
    own: SidewayDomain,
}

/// The device and port every domain of a provider uses.
struct Port {
    ctx: Arc<DeviceContext>,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    mtu: u8,
}

/// A protection domain on a provider's port.
struct SidewayDomain {
    pd: Arc<ProtectionDomain>,
    port: Arc<Port>,
}

impl SidewayProvider {
    /// Opens the device `sel` names, or the first one with an active port.
    pub fn open(sel: &DeviceSelector) -> Result<Self, RdmaError> {
        // Without RDMA devices (or the uverbs module) libibverbs answers
        // ENOSYS here: that is "no device", not a verbs failure.
        let list = DeviceList::new().map_err(|e| RdmaError::NoDevice {
            detail: format!("listing RDMA devices failed: {e}"),
        })?;
        let mut tried = Vec::new();
        for dev in list.iter() {
            let name = dev.name();
            if sel.device.as_ref().is_some_and(|want| *want != name) {
                continue;
            }
            let ctx = match dev.open() {
                Ok(c) => c,
                Err(e) => {
                    tried.push(format!("{name}: open failed: {e}"));
                    continue;
                }
            };
            match Self::on_port(ctx, name.clone(), sel) {
                Ok(p) => return Ok(p),
                Err(e) => tried.push(e.to_string()),
            }
        }
        Err(RdmaError::NoDevice {
            detail: match (&sel.device, tried.is_empty()) {
                (Some(d), true) => format!("device {d:?} not found"),
                (None, true) => "no devices listed".into(),
                _ => tried.join("; "),
            },
        })
    }

    fn on_port(
        ctx: Arc<DeviceContext>,
        name: String,
        sel: &DeviceSelector,
    ) -> Result<Self, RdmaError> {
        let dev_err = |detail: String| RdmaError::Device {
            device: name.clone(),
            detail,
        };
        let ports = ctx
            .query_device()
            .map_err(|e| dev_err(format!("query_device: {e}")))?
            .phys_port_cnt();
        let candidates: Vec<u8> = match sel.port {
            Some(p) => vec![p],
            None => (1..=ports).collect(),
        };
        let (port, attr) = candidates
            .iter()
            .find_map(|&p| {
                let a = ctx.query_port(p).ok()?;
                (a.port_state() == PortState::Active).then_some((p, a))
            })
            .ok_or_else(|| dev_err(format!("no active port among {candidates:?}")))?;
        let gid = ctx
            .query_gid(port, sel.gid_index.into())
            .map_err(|e| dev_err(format!("port {port} GID index {}: {e}", sel.gid_index)))?;
        if gid.is_zero() {
            return Err(dev_err(format!(
                "port {port} GID index {} is empty",
                sel.gid_index
            )));
        }
        let pd = ctx.alloc_pd().map_err(|e| verbs_err("alloc_pd", e))?;
        let port = Arc::new(Port {
            mtu: (attr.active_mtu() as u8).min(MAX_MTU),
            lid: attr.lid(),
            gid: gid.raw,
            port,
            gid_index: sel.gid_index,
            name,
            ctx,
        });
        Ok(Self {
            own: SidewayDomain { pd, port },
        })
    }
}

impl RdmaProvider for SidewayProvider {
    fn device_name(&self) -> String {
        let p = &self.own.port;
        format!("{}:{}/gid{}", p.name, p.port, p.gid_index)
    }

    fn domain(&self) -> &dyn Domain {
        &self.own
    }

    fn new_domain(&self) -> Result<Arc<dyn Domain>, RdmaError> {
        let port = &self.own.port;
        let pd = port.ctx.alloc_pd().map_err(|e| verbs_err("alloc_pd", e))?;
        Ok(Arc::new(SidewayDomain {
            pd,
            port: Arc::clone(port),
        }))
    }

    fn limits(&self) -> Result<DeviceLimits, RdmaError> {
        let attr = self
            .own
            .port
            .ctx
            .query_device()
            .map_err(|e| verbs_err("query_device", e))?;
        Ok(DeviceLimits {
            max_pd: attr.max_pd().max(0) as u64,
            max_mr: attr.max_mr().max(0) as u64,
        })
    }
}

impl Domain for SidewayDomain {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, RdmaError> {
        // Local write with every remote access: the pages are pinned
        // writable, so a registration never pins a copy-on-write page that
        // a later store to the arena would replace.
        let access = match access {
            Access::Local => AccessFlags::LocalWrite,
            Access::RemoteRead => AccessFlags::LocalWrite | AccessFlags::RemoteRead,
            Access::RemoteReadWrite => {
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead
            }
        };
        // SAFETY: the caller guarantees the range stays valid for the
        // region's life (this function's contract); the MR is dropped with
        // it (`ibv_dereg_mr`, after which the device refuses its keys).
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, access) }.map_err(|e| {
            RdmaError::Register {
                addr: addr as usize,
                len,
                detail: e.to_string(),
            }
        })?;
        Ok(MemoryRegion::new(
            addr as usize,
            len,
            mr.lkey(),
            mr.rkey(),
            Box::new(mr),
        ))
    }

    fn create_qp(&self, depth: u32) -> Result<Box<dyn QueuePair>, RdmaError> {
        let port = &self.port;
        let channel =
            CompletionChannel::new(&port.ctx).map_err(|e| verbs_err("create_comp_channel", e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| verbs_err("set_nonblocking(comp_channel)", e))?;
        let cq = port
            .ctx
            .create_cq_builder()
            .setup_cqe(depth)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| verbs_err("create_cq", e))?;
        let qp = self
            .pd
            .create_qp_builder()
            .setup_send_cq(GenericCompletionQueue::from(Arc::clone(&cq)))
            .setup_recv_cq(GenericCompletionQueue::from(Arc::clone(&cq)))
            .setup_max_send_wr(depth)
            .setup_max_recv_wr(1)
            .build()
            .map_err(|e| verbs_err("create_qp", e))?;
        let psn = rand::random::<u32>() & 0xff_ffff;
        let q = SidewayQp {
            endpoint: Endpoint {
                qpn: qp.qp_number(),
                psn,
                lid: port.lid,
                mtu: port.mtu,
                gid: port.gid,
            },
            qp: Mutex::new(qp),
            cq,
            channel,
            port: port.port,
            gid_index: port.gid_index,
        };
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        q.qp.lock()
            .modify(&init)
            .map_err(|e| verbs_err("modify_qp(INIT)", e))?;
        q.arm()?;
        Ok(Box::new(q))
    }
}

struct SidewayQp {
    // Field order is drop order: the QP goes before its CQ and channel.
    qp: Mutex<BasicQueuePair>,
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    endpoint: Endpoint,
    port: u8,
    gid_index: u8,
}

impl SidewayQp {
    fn cq_ptr(&self) -> *mut ibv_cq {
        // SAFETY: the pointer is only used while `self.cq` keeps the CQ alive.
        unsafe { self.cq.cq() }.as_ptr()
    }
}

impl QueuePair for SidewayQp {
    fn endpoint(&self) -> Endpoint {
        self.endpoint
    }

    fn connect(&self, remote: &Endpoint) -> Result<(), RdmaError> {
        let mtu = self.endpoint.mtu.min(remote.mtu);
        if !(1..=5).contains(&mtu) {
            return Err(verbs_err(
                "modify_qp(RTR)",
                format!("invalid path MTU enum {mtu}"),
            ));
        }
        let mut qp = self.qp.lock();
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::from(u32::from(mtu)))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(16)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(self.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(self.gid_index)
            .setup_grh_dest_gid(&Gid { raw: remote.gid })
            .setup_grh_hop_limit(64);
        rtr.setup_address_vector(&ah);
        qp.modify(&rtr)
            .map_err(|e| verbs_err("modify_qp(RTR)", e))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.endpoint.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(16);
        qp.modify(&rts).map_err(|e| verbs_err("modify_qp(RTS)", e))
    }

    fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError> {
        let mut qp = self.qp.lock();
        let mut guard = qp.start_post_send();
        let h = guard.construct_wr(wr.wr_id, WorkRequestFlags::Signaled);
        let h = match wr.op {
            RdmaOp::Read => h.setup_read(wr.rkey, wr.remote_addr),
            RdmaOp::Write => h.setup_write(wr.rkey, wr.remote_addr),
        };
        // SAFETY: the transport only posts addresses inside a live region
        // registered under `lkey`, and keeps that memory untouched until the
        // completion (or the QP's destruction after `fail`).
        unsafe { h.setup_sge(wr.lkey, wr.local_addr, wr.len) };
        guard.post().map_err(|e| verbs_err("post_send", e))
    }

    fn wait(&self, timeout: Duration) -> Result<(), RdmaError> {
        // SAFETY: the channel (and so its fd) lives as long as `self`, which
        // outlives this borrow.
        let fd = unsafe { BorrowedFd::borrow_raw(self.channel.as_raw_fd()) };
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        let limit = Timespec::try_from(timeout.min(Duration::from_secs(60)))
            .map_err(|e| verbs_err("poll(comp_channel)", e))?;
        match poll(&mut fds, Some(&limit)) {
            Ok(n) if n > 0 => {}
            // Nothing ready, or a signal: the caller polls the CQ and comes back.
            Ok(_) | Err(rustix::io::Errno::INTR) => return Ok(()),
            Err(e) => return Err(verbs_err("poll(comp_channel)", e)),
        }
        if self.take_event()? {
            self.arm()?;
        }
        Ok(())
    }

    fn event_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }

    fn arm(&self) -> Result<(), RdmaError> {
        // SAFETY: the CQ is alive (owned by self) and was created with a
        // completion channel.
        let rc = unsafe { ibv_req_notify_cq(self.cq_ptr(), 0) };
        if rc != 0 {
            return Err(verbs_err(
                "req_notify_cq",
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    fn take_event(&self) -> Result<bool, RdmaError> {
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: the channel is alive; its fd is non-blocking (set at
        // creation), so with no event pending this returns -1 (EAGAIN)
        // instead of blocking.
        let got =
            unsafe { ibv_get_cq_event(self.channel.comp_channel().as_ptr(), &mut cq, &mut ctx) };
        if got != 0 {
            return Ok(false);
        }
        // SAFETY: `cq` is the CQ the event was for (ours); every event is
        // acknowledged, so destroying the CQ never blocks.
        unsafe { ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }

    fn poll(&self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        match self.cq.start_poll() {
            Ok(poller) => {
                out.extend(poller.map(|wc| Completion {
                    wr_id: wc.wr_id(),
                    status: wc.status(),
                }));
                Ok(())
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => Ok(()),
            Err(e) => Err(verbs_err("poll_cq", e)),
        }
    }

    fn fail(&self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        let _ = self.qp.lock().modify(&attr);
    }
}
