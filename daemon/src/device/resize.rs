//! `ublkctl resize`: growing a live device.
//!
//! Our side first, then the kernel's: the device's shared size (which every
//! queue checks requests against) and its definition grow, then the kernel
//! is told (UPDATE_SIZE). Until the kernel's answer it still sends nothing
//! past the old end, so growing our size early is safe, and undoing it when
//! the kernel refuses is too. A shrink is refused: the data past the new
//! end would be cut from under the device's users.

use std::path::Path;
use std::sync::Arc;

use libublk::ctrl::UblkCtrl;
use libublk::sys;
use target_rdma::auth::Secret;
use target_rdma::service::size::HumanSize;
use ublk_metrics::events;

use super::thread::ublk_err;
use super::{within_quota, Connector, DeviceError, Manager, State, UBLK_CONTROL};
use crate::ctl::DeviceInfo;

/// The kernel's side of a device's size: whether the ublk driver can
/// change a live device's size, and changing it. A trait so that the
/// manager's resize runs in `cargo test` against a fake kernel.
pub(super) trait KernelSize: Send + Sync {
    /// The driver has `UBLK_F_UPDATE_SIZE` (Linux 6.16 and later).
    fn supported(&self) -> bool;
    /// Sets device `id`'s capacity to `bytes` (UPDATE_SIZE).
    fn update(&self, id: u32, bytes: u64) -> Result<(), DeviceError>;
}

/// The loaded `ublk_drv`.
pub(super) struct UblkDriver;

impl KernelSize for UblkDriver {
    fn supported(&self) -> bool {
        // What `ublkctl features` reads (GET_FEATURES; none before 6.5).
        Path::new(UBLK_CONTROL).exists()
            && UblkCtrl::get_features().is_some_and(|m| m & u64::from(sys::UBLK_F_UPDATE_SIZE) != 0)
    }

    fn update(&self, id: u32, bytes: u64) -> Result<(), DeviceError> {
        UblkCtrl::new_simple(id as i32)
            .and_then(|c| c.update_size(bytes))
            .map(drop)
            .map_err(ublk_err("UPDATE_SIZE", id.into()))
    }
}

impl Manager {
    /// `resize`: grows device `id` to `size` bytes and returns its
    /// description. The same size is a no-op.
    pub fn resize(&self, id: u32, size: u64) -> Result<DeviceInfo, DeviceError> {
        let _op = self.ops.lock();
        let (spec, shared, resizable, state) = {
            let devs = self.devices.lock();
            let dev = devs.get(&id).ok_or(DeviceError::Unknown(id))?;
            let state = dev.state.lock().clone();
            (dev.spec.clone(), dev.size.clone(), dev.resizable, state)
        };
        let old = spec.size;
        let lbs = u64::from(spec.logical_block_size);
        if size == 0 || !size.is_multiple_of(lbs) {
            return Err(DeviceError::BadRequest(format!(
                "invalid --size {size}: must be a non-zero multiple of the {lbs}-byte logical block size"
            )));
        }
        if size < old {
            return Err(DeviceError::BadRequest(format!(
                "refusing to shrink device {id} from {} to {}: shrinking a block device under a \
                 filesystem loses the data past the new end; add a smaller device and copy instead",
                HumanSize(old),
                HumanSize(size)
            )));
        }
        if size == old {
            return self.info(id);
        }
        let not = |why: String| DeviceError::NotResizable { id, why };
        if spec.replicas.is_some() {
            return Err(not(
                "it serves a replicated volume, whose membership record, placement and rebuild \
                 keep the size it was added with; resizing one is not supported"
                    .into(),
            ));
        }
        if !resizable {
            return Err(not(if self.kernel.supported() {
                "it was created without UBLK_F_UPDATE_SIZE (by a ublkd or kernel without \
                 resize); `ublkctl del` and `add` it again to make it resizable"
                    .into()
            } else {
                "the kernel's ublk driver has no UPDATE_SIZE (it needs Linux 6.16 or later; \
                 `ublkctl features` lists what the driver has)"
                    .into()
            }));
        }
        if state != State::Live {
            return Err(not(format!(
                "it is {}; only a live device is resized (`ublkctl recover {id}` first)",
                state.name()
            )));
        }
        // The quota as the peer holds it now: raising it (arenad.toml and a
        // reload) is how an operator makes room for a resize.
        let secret = Secret::from_file(&spec.secret_file)?;
        let welcome =
            Connector::new(&self.cfg, Arc::clone(self.obs.tcp_links())).hello(&spec, &secret)?;
        within_quota(&spec, size, &welcome)?;

        let mut grown = spec.clone();
        grown.size = size;
        shared.set(size);
        if let Err(e) = self.store.save(&grown) {
            shared.set(old);
            return Err(e);
        }
        if let Err(e) = self.kernel.update(id, size) {
            shared.set(old);
            let rollback = match self.store.save(&spec) {
                Ok(()) => String::new(),
                Err(re) => format!(
                    "; rolling its definition back failed too ({re}): a restarted ublkd brings \
                     it back at {}",
                    HumanSize(size)
                ),
            };
            tracing::warn!(event = events::DEVICE_RESIZE_FAILED, id, old_size = old, new_size = size, error = %e);
            return Err(DeviceError::Ublk {
                what: "UPDATE_SIZE",
                id: id.into(),
                detail: format!(
                    "{}; the device stays at {} (ublkd's size rolled back){rollback}",
                    kernel_detail(&e),
                    HumanSize(old)
                ),
            });
        }
        if let Some(dev) = self.devices.lock().get_mut(&id) {
            dev.spec.size = size;
        }
        tracing::info!(
            event = events::DEVICE_RESIZED,
            id,
            old_size = old,
            new_size = size,
            "device {id} grew from {} to {}",
            HumanSize(old),
            HumanSize(size)
        );
        self.info(id)
    }
}

/// The driver's part of a failed kernel step, without the step's own
/// prefix (the caller names the step again).
fn kernel_detail(e: &DeviceError) -> String {
    match e {
        DeviceError::Ublk { detail, .. } => detail.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use parking_lot::Mutex;
    use target_rdma::block::{ArenaTarget, BlockTarget, DeviceSize, TargetError};
    use target_rdma::testing::{Peer, PeerOpts, SECRET_A};

    use super::*;
    use crate::config::UblkdConfig;
    use crate::ctl::ErrorKind;
    use crate::device::{Device, DeviceSpec};
    use crate::observability::Observability;

    /// A kernel that has UPDATE_SIZE or not, and fails it when told to.
    #[derive(Default)]
    struct FakeKernel {
        supported: bool,
        fail: AtomicBool,
        calls: Mutex<Vec<(u32, u64)>>,
    }

    impl KernelSize for FakeKernel {
        fn supported(&self) -> bool {
            self.supported
        }
        fn update(&self, id: u32, bytes: u64) -> Result<(), DeviceError> {
            self.calls.lock().push((id, bytes));
            if self.fail.load(Ordering::Relaxed) {
                return Err(DeviceError::Ublk {
                    what: "UPDATE_SIZE",
                    id: id.into(),
                    detail: "Invalid argument (os error 22)".into(),
                });
            }
            Ok(())
        }
    }

    /// A manager with one live device `0` of `size` bytes on `peer`'s
    /// volume "a", created with UPDATE_SIZE or not, over `kernel`.
    struct Fixture {
        m: Manager,
        kernel: Arc<FakeKernel>,
        size: DeviceSize,
        _dirs: (tempfile::TempDir, tempfile::TempDir),
        peer: Peer,
    }

    const MIB: u64 = 1 << 20;

    fn fixture(size: u64, resizable: bool, kernel: FakeKernel) -> Fixture {
        let state = tempfile::tempdir().unwrap();
        let peer_dir = tempfile::tempdir().unwrap();
        // 64 blobs of 64K: a 4M quota.
        let peer = Peer::start(
            peer_dir.path(),
            PeerOpts {
                quota_blobs: 64,
                ..PeerOpts::default()
            },
        );
        let mut cfg = UblkdConfig::defaults();
        cfg.state_dir = state.path().to_owned();
        let obs = Observability::new(
            ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
            &cfg.metrics,
            &cfg.tracing,
        );
        let mut m = Manager::new(cfg, obs).unwrap();
        let kernel = Arc::new(kernel);
        m.kernel = Arc::clone(&kernel) as Arc<dyn KernelSize>;
        let secret = state.path().join("a.key");
        fs::write(&secret, SECRET_A).unwrap();
        fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
        let spec = m
            .spec_for(&crate::ctl::AddArgs {
                peers: vec![peer.addr.to_string()],
                replicas: None,
                volume: "a".into(),
                secret_file: secret,
                size,
                queues: Some(1),
                depth: None,
                blob_size: Some(64 << 10),
                transport: None,
                confidential: false,
                io_buf: None,
                id: None,
                read_only: false,
                standby: false,
                activate_on_write: false,
                cpus: Vec::new(),
            })
            .unwrap();
        m.store.save(&spec).unwrap();
        let shared = DeviceSize::new(size);
        m.devices.lock().insert(
            0,
            Device {
                spec,
                stats: Arc::default(),
                state: Arc::new(parking_lot::Mutex::new(State::Live)),
                ios: Vec::new(),
                size: shared.clone(),
                resizable,
                blob_bytes: 64 << 10,
                thread: None,
                replicated: None,
            },
        );
        Fixture {
            m,
            kernel,
            size: shared,
            _dirs: (state, peer_dir),
            peer,
        }
    }

    fn resizable() -> FakeKernel {
        FakeKernel {
            supported: true,
            ..FakeKernel::default()
        }
    }

    fn persisted(m: &Manager) -> Vec<DeviceSpec> {
        m.store.load_all().unwrap()
    }

    /// A queue's target over a session to the fixture's volume, checking
    /// requests against the device's shared size.
    fn target(f: &Fixture) -> ArenaTarget<target_rdma::client::ArenaClient> {
        ArenaTarget::new(f.peer.client("a", SECRET_A), f.size.clone())
    }

    fn write_at(
        t: &ArenaTarget<target_rdma::client::ArenaClient>,
        offset: u64,
    ) -> Result<(), TargetError> {
        futures::executor::block_on(t.write(offset, &[7u8; 4096], false)).map(drop)
    }

    #[test]
    fn a_grown_device_serves_past_its_old_end_and_not_past_its_new_one() {
        let f = fixture(MIB, true, resizable());
        let t = target(&f);
        assert!(matches!(
            write_at(&t, MIB),
            Err(TargetError::OutOfRange { size, .. }) if size == MIB
        ));
        let info = f.m.resize(0, 2 * MIB).unwrap();
        assert_eq!(info.size, 2 * MIB);
        assert_eq!(f.m.info(0).unwrap().size, 2 * MIB);
        assert_eq!(*f.kernel.calls.lock(), vec![(0, 2 * MIB)]);
        // The same queue target, untouched: its checks follow the device.
        write_at(&t, MIB).unwrap();
        write_at(&t, 2 * MIB - 4096).unwrap();
        let mut back = vec![0u8; 4096];
        futures::executor::block_on(t.read(MIB, &mut back)).unwrap();
        assert_eq!(back, vec![7u8; 4096]);
        assert!(matches!(
            write_at(&t, 2 * MIB),
            Err(TargetError::OutOfRange { size, .. }) if size == 2 * MIB
        ));
        // The definition says the new size, and loads as it.
        let specs = persisted(&f.m);
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].size, 2 * MIB);
        // The same size again changes nothing, and asks the kernel nothing.
        f.m.resize(0, 2 * MIB).unwrap();
        assert_eq!(f.kernel.calls.lock().len(), 1);
    }

    #[test]
    fn shrinking_misaligned_sizes_and_sizes_above_the_quota_are_refused() {
        let f = fixture(2 * MIB, true, resizable());
        let e = f.m.resize(0, MIB).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadRequest);
        assert_eq!(
            e.to_string(),
            "refusing to shrink device 0 from 2M to 1M: shrinking a block device under a \
             filesystem loses the data past the new end; add a smaller device and copy instead"
        );
        assert_eq!(
            f.m.resize(0, 2 * MIB + 100).unwrap_err().to_string(),
            format!(
                "invalid --size {}: must be a non-zero multiple of the 512-byte logical block size",
                2 * MIB + 100
            )
        );
        let e = f.m.resize(0, 8 * MIB).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadRequest);
        assert_eq!(
            e.to_string(),
            format!(
                "--size 8M is above the quota of volume \"a\" on {}: 4M (64 blobs of 64K); \
                 raise its quota in arenad.toml (`systemctl reload arenad`) or ask for less",
                f.peer.addr
            )
        );
        assert_eq!(
            f.m.resize(9, 4 * MIB).unwrap_err().kind(),
            ErrorKind::UnknownDevice
        );
        // Nothing moved: not our size, not the definition, not the kernel.
        assert_eq!(f.size.get(), 2 * MIB);
        assert_eq!(persisted(&f.m)[0].size, 2 * MIB);
        assert!(f.kernel.calls.lock().is_empty());
    }

    #[test]
    fn a_driver_without_update_size_is_named_as_the_reason() {
        let f = fixture(MIB, false, FakeKernel::default());
        let e = f.m.resize(0, 2 * MIB).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert_eq!(
            e.to_string(),
            "device 0 cannot be resized: the kernel's ublk driver has no UPDATE_SIZE (it needs \
             Linux 6.16 or later; `ublkctl features` lists what the driver has)"
        );
        // A driver that has it, but a device made without the flag.
        let f = fixture(MIB, false, resizable());
        assert_eq!(
            f.m.resize(0, 2 * MIB).unwrap_err().to_string(),
            "device 0 cannot be resized: it was created without UBLK_F_UPDATE_SIZE (by a ublkd \
             or kernel without resize); `ublkctl del` and `add` it again to make it resizable"
        );
        assert_eq!(f.size.get(), MIB);
        assert!(f.kernel.calls.lock().is_empty());
    }

    #[test]
    fn a_kernel_refusal_rolls_our_size_and_the_definition_back() {
        let f = fixture(MIB, true, resizable());
        f.kernel.fail.store(true, Ordering::Relaxed);
        let e = f.m.resize(0, 2 * MIB).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::System);
        assert_eq!(
            e.to_string(),
            "ublk UPDATE_SIZE for device 0 failed: Invalid argument (os error 22); the device \
             stays at 1M (ublkd's size rolled back)"
        );
        assert_eq!(f.size.get(), MIB);
        assert_eq!(f.m.info(0).unwrap().size, MIB);
        assert_eq!(persisted(&f.m)[0].size, MIB);
    }

    #[test]
    fn a_replicated_or_stopped_device_is_not_resized() {
        let f = fixture(MIB, true, resizable());
        *f.m.devices.lock().get_mut(&0).unwrap().state.lock() = State::Stopped;
        assert_eq!(
            f.m.resize(0, 2 * MIB).unwrap_err().to_string(),
            "device 0 cannot be resized: it is stopped; only a live device is resized \
             (`ublkctl recover 0` first)"
        );
        f.m.devices.lock().get_mut(&0).unwrap().spec.replicas = Some(crate::device::ReplicaSpec {
            peers: vec!["h:1".into(), "h:2".into()],
            ..Default::default()
        });
        let e = f.m.resize(0, 2 * MIB).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("replicated volume"), "{e}");
        assert!(f.kernel.calls.lock().is_empty());
    }

    /// A restarted ublkd reads the grown definition: the one the running
    /// device has, with the new size.
    #[test]
    fn the_grown_size_survives_a_restart() {
        let f = fixture(MIB, true, resizable());
        f.m.resize(0, 3 * MIB).unwrap();
        let dir: &Path = &f.m.cfg.state_dir;
        let again = crate::device::SpecStore::open(dir)
            .unwrap()
            .load_all()
            .unwrap();
        let running = f.m.devices.lock()[&0].spec.clone();
        assert_eq!(running.size, 3 * MIB);
        assert_eq!(again, vec![running]);
    }

    /// Queues read the size while it grows step by step: a request inside
    /// the size the manager had reached before it was issued is always
    /// accepted, one past the final size never, and what one queue saw
    /// accepted is never refused later (growth only).
    #[test]
    fn queues_checking_while_the_device_grows_stay_consistent() {
        const STEPS: u64 = 48;
        let blk = 64 << 10;
        let f = fixture(blk, true, resizable());
        // Grown by this much at each step, within the 4M quota.
        let reached = Arc::new(AtomicU64::new(blk));
        let done = Arc::new(AtomicBool::new(false));
        let queues: Vec<_> = (0..2)
            .map(|q| {
                let (size, reached, done) =
                    (f.size.clone(), Arc::clone(&reached), Arc::clone(&done));
                let client = f.peer.client("a", SECRET_A);
                std::thread::spawn(move || {
                    let t = ArenaTarget::new(client, size);
                    let mut accepted_up_to = 0u64;
                    let mut checks = 0u64;
                    while !done.load(Ordering::Acquire) {
                        let floor = reached.load(Ordering::Acquire);
                        // Just below what the manager had reached: accepted.
                        let inside = floor - 4096;
                        futures::executor::block_on(t.write(inside, &[q; 4096], false))
                            .unwrap_or_else(|e| panic!("queue {q}: {e} below {floor}"));
                        accepted_up_to = accepted_up_to.max(inside);
                        // What was accepted before stays accepted.
                        let mut b = vec![0u8; 512];
                        futures::executor::block_on(t.read(accepted_up_to, &mut b))
                            .unwrap_or_else(|e| panic!("queue {q}: {e} after accepting it"));
                        // Past the final size: never.
                        assert!(futures::executor::block_on(t.write(
                            STEPS * blk + blk,
                            &[q; 4096],
                            false
                        ))
                        .is_err());
                        checks += 1;
                    }
                    checks
                })
            })
            .collect();
        for step in 2..=STEPS {
            let new = step * blk;
            f.m.resize(0, new).unwrap();
            reached.store(new, Ordering::Release);
        }
        done.store(true, Ordering::Release);
        for q in queues {
            assert!(q.join().unwrap() > 0, "a queue checked nothing");
        }
        assert_eq!(f.size.get(), STEPS * blk);
        assert_eq!(persisted(&f.m)[0].size, STEPS * blk);
        assert_eq!(f.kernel.calls.lock().len(), (STEPS - 1) as usize);
    }
}
