//! `ublkd --check-config`: every check a start makes, without starting.
//! A start refuses an invalid config (checked before this runs), a
//! `state_dir` it cannot create or write, a control socket it cannot bind
//! (its directory, a missing `socket_group`, another ublkd on it) and an
//! unreadable devices directory; it tolerates a metrics port it cannot
//! bind, a missing ublk driver, an unusable RDMA device and a device
//! definition it cannot read, which are warnings here.

use std::os::unix::net::UnixStream;
use std::path::Path;

use target_rdma::rdma::{open_provider, RdmaMode};
use target_rdma::service::preflight::{bindable, dir_usable, Findings};

use crate::config::{TransportChoice, UblkdConfig};
use crate::control_socket::group_exists;
use crate::device::{SpecStore, UBLK_CONTROL};

/// Runs the checks of a start of `cfg`.
pub fn run(cfg: &UblkdConfig) -> Findings {
    let mut f = Findings::default();
    f.check(dir_usable("state_dir", &cfg.state_dir));
    let devices = cfg.state_dir.join("devices");
    if devices.is_dir() {
        match SpecStore::read_only(&cfg.state_dir).and_then(|s| s.check_all()) {
            Ok((good, bad)) => {
                f.ok(format!(
                    "{} device definition(s) in {}",
                    good,
                    devices.display()
                ));
                for (path, why) in bad {
                    f.warn(format!(
                        "device definition {} cannot be read ({why}): a start skips it",
                        path.display()
                    ));
                }
            }
            Err(e) => f.problem(e.to_string()),
        }
    }
    socket(cfg, &mut f);
    match cfg.metrics.listen_addr() {
        Some(addr) => {
            if let Err(e) = bindable("metrics.listen", addr) {
                f.warn(format!(
                    "{e}: ublkd would serve without its metrics listener"
                ));
            } else {
                f.ok(format!("metrics.listen {addr} can be bound"));
            }
        }
        None => f.ok("metrics listener disabled (metrics.listen = \"off\")"),
    }
    if Path::new(UBLK_CONTROL).exists() {
        f.ok(format!("ublk driver loaded ({UBLK_CONTROL})"));
    } else {
        f.warn(format!(
            "the ublk driver is not loaded ({UBLK_CONTROL} is missing; run `modprobe ublk_drv`): \
             /ready answers 503 ublk_driver_missing and no device can be added"
        ));
    }
    let wants_rdma = cfg.device.transport != TransportChoice::Tcp
        || cfg.rdma.device.is_some()
        || !cfg.rdma.rails.is_empty();
    if wants_rdma {
        let selectors = cfg.rdma.selectors();
        for (i, sel) in selectors.iter().enumerate() {
            let rail = if selectors.len() > 1 {
                format!("rail {i}: ")
            } else {
                String::new()
            };
            match open_provider(RdmaMode::On, sel) {
                Ok(Ok(p)) => f.ok(format!("{rail}RDMA device {} usable", p.device_name())),
                Ok(Err(why)) => f.warn(format!("{rail}{why}")),
                Err(why) if selectors.len() > 1 => f.warn(format!(
                    "{rail}no usable RDMA device ({why}): this rail stays off, devices use the other"
                )),
                Err(why) => f.warn(format!(
                    "no usable RDMA device ({why}): devices with transport = \"rdma\" cannot be added, \
                     \"auto\" ones serve TCP"
                )),
            }
        }
    }
    f
}

/// The control socket: its group, its directory, and nobody on it.
fn socket(cfg: &UblkdConfig, f: &mut Findings) {
    if let Some(g) = &cfg.socket_group {
        if group_exists(g) {
            f.ok(format!("socket_group {g:?} exists"));
        } else {
            f.problem(format!("socket_group {g:?} does not exist"));
        }
    }
    if let Some(dir) = cfg.socket.parent() {
        f.check(dir_usable("socket directory", dir));
    }
    if cfg.socket.exists() && UnixStream::connect(&cfg.socket).is_ok() {
        f.problem(format!(
            "another ublkd is already listening on {} (stop it first; `systemctl reload ublkd` \
             applies a changed config to a running one)",
            cfg.socket.display()
        ));
    } else {
        f.ok(format!("control socket {} is free", cfg.socket.display()));
    }
}
