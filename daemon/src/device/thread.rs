//! The kernel side of one device: its thread attaches to `ublk_drv` (ADD or
//! START_USER_RECOVERY) through libublk's `run_target`, which spawns the
//! queue threads (`queue.rs`), serves until the device stops, then deletes
//! the dead kernel device.

use std::path::Path;
use std::sync::{mpsc, Arc};

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::UblkDev;
use libublk::{sys, UblkFlags};
use parking_lot::Mutex;
use target_rdma::block::DeviceSize;
use ublk_metrics::events;
use ublk_metrics::DriverStats;

use super::spec::{params, shape, DeviceSpec};
use super::{DeviceError, State};
use crate::device_stats::DeviceStats;
use crate::observability::{DevState, Observability};
use crate::queue_io::{self, QueueIo};

/// How a device thread attaches to the kernel.
#[derive(Clone, Copy, Debug)]
pub(super) enum Mode {
    /// ADD a new device; `-1` lets the kernel pick the id.
    Add(i32),
    /// START_USER_RECOVERY of an existing, quiesced device.
    Recover(u32),
}

pub(super) enum Event {
    /// The kernel device exists: its id, and whether it has
    /// `UBLK_F_UPDATE_SIZE` (asked for at ADD, or found at recovery).
    Built(u32, bool),
    Started,
    Failed(String),
}

pub(super) fn ublk_err(what: &'static str, id: i64) -> impl Fn(libublk::UblkError) -> DeviceError {
    move |e| DeviceError::Ublk {
        what,
        id,
        detail: e.to_string(),
    }
}

/// The kernel's state for device `id`, or `None` when it has no such device.
pub(super) fn kernel_state(id: u32) -> Option<u32> {
    if !Path::new(&format!("/dev/ublkc{id}")).exists() {
        return None;
    }
    UblkCtrl::new_simple(id as i32)
        .ok()
        .map(|c| u32::from(c.dev_info().state))
}

/// What a device thread is started with.
pub(super) struct DeviceStart {
    pub(super) spec: DeviceSpec,
    /// The size the queues check requests against, grown by resize.
    pub(super) size: DeviceSize,
    /// Ask for `UBLK_F_UPDATE_SIZE` at ADD (the driver has it).
    pub(super) update_size: bool,
    pub(super) mode: Mode,
    pub(super) ios: Vec<QueueIo>,
    pub(super) stats: Arc<DeviceStats>,
    pub(super) driver: Arc<dyn DriverStats>,
    pub(super) state: Arc<Mutex<State>>,
    pub(super) obs: Arc<Observability>,
}

/// The device thread: attaches to the kernel, serves until the device
/// stops, then deletes the dead kernel device.
pub(super) fn device_thread(start: DeviceStart, tx: mpsc::Sender<Event>) {
    let DeviceStart {
        spec,
        size,
        update_size,
        mode,
        ios,
        stats,
        driver,
        state,
        obs,
    } = start;
    let fail = |tx: &mpsc::Sender<Event>, e: DeviceError| {
        let _ = tx.send(Event::Failed(e.to_string()));
    };
    let (id, dev_flags) = match mode {
        Mode::Add(id) => (id, UblkFlags::UBLK_DEV_F_ADD_DEV),
        Mode::Recover(id) => {
            let r = UblkCtrl::new_simple(id as i32)
                .and_then(|c| c.start_user_recover())
                .map_err(ublk_err("START_USER_RECOVERY", id.into()));
            if let Err(e) = r {
                return fail(&tx, e);
            }
            (id as i32, UblkFlags::UBLK_DEV_F_RECOVER_DEV)
        }
    };
    let ctrl = match UblkCtrlBuilder::default()
        .name("ublkd")
        .id(id)
        .nr_queues(spec.queues as u16)
        .depth(spec.depth as u16)
        .io_buf_bytes(spec.io_buf as u32)
        .ctrl_flags(ctrl_flags(update_size))
        .dev_flags(dev_flags)
        .build()
    {
        Ok(c) => c,
        Err(e) => return fail(&tx, ublk_err("ADD_DEV", id.into())(e)),
    };
    let dev_id = ctrl.dev_info().dev_id;
    let initial = state.lock().dev_state();
    let dobs = match obs.register(
        shape(&DeviceSpec {
            id: dev_id,
            ..spec.clone()
        }),
        initial,
        Arc::clone(&stats),
        queue_io::negotiated(&ios),
        driver,
    ) {
        Ok(d) => d,
        Err(e) => {
            let _ = ctrl.del_dev();
            return fail(&tx, DeviceError::BadRequest(e.to_string()));
        }
    };
    let resizable = ctrl.dev_info().flags & u64::from(sys::UBLK_F_UPDATE_SIZE) != 0;
    let _ = tx.send(Event::Built(dev_id, resizable));

    let queue_ios: Arc<Mutex<Vec<Option<QueueIo>>>> =
        Arc::new(Mutex::new(ios.into_iter().map(Some).collect()));
    let qobs = Arc::clone(&dobs);
    // Each queue thread's id, for pinning once the device runs.
    let tids: Arc<Mutex<Vec<Option<rustix::thread::Pid>>>> =
        Arc::new(Mutex::new(vec![None; spec.queues as usize]));
    let q_tids = Arc::clone(&tids);
    let q_size = size.clone();
    let q_fn = move |qid: u16, dev: &UblkDev| {
        if let Some(slot) = q_tids.lock().get_mut(qid as usize) {
            *slot = Some(rustix::thread::gettid());
        }
        let Some(io) = queue_ios
            .lock()
            .get_mut(qid as usize)
            .and_then(Option::take)
        else {
            tracing::error!(event = events::QUEUE_NO_CLIENT, qid);
            return;
        };
        crate::queue::run(qid, dev, io, q_size.clone(), Arc::clone(&qobs));
    };
    let ublk_params = params(&spec);
    let tgt_init = move |dev: &mut UblkDev| {
        dev.tgt.dev_size = size.get();
        dev.tgt.params = ublk_params;
        Ok(())
    };
    let started_state = Arc::clone(&state);
    let started_obs = Arc::clone(&dobs);
    let started_tx = tx.clone();
    let cpus = spec.cpus.clone();
    let on_started = move |_: &UblkCtrl| {
        // After libublk gave each queue thread the kernel's mapping (every
        // queue has FETCHed by START_DEV's return, so every id is known).
        pin_queues(dev_id, &cpus, &tids.lock());
        *started_state.lock() = State::Live;
        started_obs.set_state(DevState::Live);
        let _ = started_tx.send(Event::Started);
    };
    let result = ctrl.run_target(tgt_init, q_fn, on_started);
    // The queues are gone: the device was stopped (by `del` or from
    // outside). A stopped ublk device is dead for good, so remove it.
    let _ = ctrl.del_dev();
    match result {
        Ok(_) => {
            *state.lock() = State::Stopped;
            dobs.set_state(DevState::Stopped);
            tracing::info!(event = events::DEVICE_STOPPED, id = dev_id);
        }
        Err(e) => {
            let e = ublk_err("START_DEV", dev_id.into())(e);
            *state.lock() = State::Failed(e.to_string());
            dobs.set_state(DevState::Failed);
            fail(&tx, e);
        }
    }
}

/// The flags a device is created with: user recovery always, and
/// `UBLK_F_UPDATE_SIZE` when the driver has it (`ublkctl resize`). The
/// driver ignores the flag when it handles UPDATE_SIZE, but it is the
/// device's declared capability, so a device is resized only with it.
pub(super) fn ctrl_flags(update_size: bool) -> u64 {
    let mut flags = sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE;
    if update_size {
        flags |= sys::UBLK_F_UPDATE_SIZE;
    }
    u64::from(flags)
}

/// Pins queue q's thread to `cpus[q % len]` (`add --cpus`); nothing when
/// `cpus` is empty. A failure is logged: the device serves unpinned.
fn pin_queues(dev_id: u32, cpus: &[u32], tids: &[Option<rustix::thread::Pid>]) {
    if cpus.is_empty() {
        return;
    }
    for (qid, tid) in tids.iter().enumerate() {
        let (Some(tid), cpu) = (tid, cpus[qid % cpus.len()]) else {
            continue;
        };
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu as usize);
        match rustix::thread::sched_setaffinity(Some(*tid), &set) {
            Ok(()) => tracing::info!(
                event = events::QUEUE_PINNED,
                device = dev_id,
                qid,
                tid = tid.as_raw_nonzero().get(),
                cpu
            ),
            Err(e) => tracing::warn!(
                event = events::QUEUE_PIN_FAILED,
                device = dev_id,
                qid,
                cpu,
                error = %std::io::Error::from(e)
            ),
        }
    }
}
