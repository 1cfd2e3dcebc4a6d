//! The control socket: a Unix stream socket, root-only (0600) unless a
//! `socket_group` is configured (0660, that group). Each connection may send
//! several request lines; each gets one response line.

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::Arc;

use target_rdma::service::local_socket::{self, Limits, Line};
use ublk_metrics::events;

use crate::config::ConfigError;
use crate::ctl::{self, ErrorKind, PeerInfo, Reply, Request, Response};
use crate::device::{DeviceError, Manager};
use crate::features;
use crate::reload::Reloaded;

/// What the control socket serves: the devices, and the daemon's reload
/// (the same one SIGHUP runs), whose outcome a `reload` request answers.
pub struct Control {
    /// The devices.
    pub manager: Arc<Manager>,
    /// Re-reads the configuration file and applies it.
    pub reload: Box<dyn Fn() -> Result<Reloaded, ConfigError> + Send + Sync>,
}

pub use target_rdma::service::local_socket::{group_exists, SocketError};

/// Binds the control socket with the configured ownership and mode.
pub fn bind(path: &Path, group: Option<&str>) -> Result<UnixListener, SocketError> {
    local_socket::bind("ublkd", path, group)
}

/// Runs one request.
pub fn handle(control: &Control, request: Request) -> Response {
    if let Request::Reload = request {
        return match (control.reload)() {
            Ok(done) => Response::Ok {
                reply: Reply::Reloaded {
                    applied: done.applied,
                    restart_needed: done.restart_needed,
                },
            },
            Err(e) => Response::Error {
                kind: ErrorKind::Config,
                message: format!("{e}; the running configuration stays"),
            },
        };
    }
    let manager = &*control.manager;
    let result: Result<Reply, DeviceError> = match request {
        Request::Add(a) => manager.add(&a).map(|device| Reply::Device {
            device: Box::new(device),
        }),
        Request::Del { id, force } => manager.del(id, force).map(|()| Reply::Deleted { id }),
        Request::List => Ok(Reply::Devices {
            devices: manager.list(),
        }),
        Request::Show { id } => manager.info(id).map(|device| Reply::Device {
            device: Box::new(device),
        }),
        Request::Stats { id } => manager.stats(id).map(Reply::Stats),
        Request::Recover { id } => manager.recover(id).map(|device| Reply::Device {
            device: Box::new(device),
        }),
        Request::Activate { id } => manager.activate(id).map(|device| Reply::Device {
            device: Box::new(device),
        }),
        Request::Release { id } => manager.release(id).map(|device| Reply::Device {
            device: Box::new(device),
        }),
        Request::Resize { id, size } => manager.resize(id, size).map(|device| Reply::Device {
            device: Box::new(device),
        }),
        Request::Features => {
            features::from_driver().map(|(mask, names)| Reply::Features { mask, names })
        }
        // --- replication ---
        Request::PeerAdd { peer } => manager.coordination().and_then(|c| {
            c.add_peer(&peer)?;
            Ok(Reply::Peers {
                peers: vec![PeerInfo { peer, used: 0 }],
            })
        }),
        Request::PeerDel { id } => manager.coordination().and_then(|c| {
            c.remove_peer(&id)?;
            Ok(Reply::PeerDeleted { id })
        }),
        Request::PeerList => manager.coordination().and_then(|c| {
            let peers = c.peer_usage()?;
            Ok(Reply::Peers {
                peers: peers
                    .into_iter()
                    .map(|(peer, used)| PeerInfo { peer, used })
                    .collect(),
            })
        }),
        // --- end replication ---
        Request::Reload => unreachable!("answered above"),
    };
    match result {
        Ok(reply) => Response::Ok { reply },
        Err(e) => Response::Error {
            kind: e.kind(),
            message: e.to_string(),
        },
    }
}

fn answer(control: &Control, line: Line<'_>) -> String {
    let response = match line {
        Line::TooLong => Response::Error {
            kind: ErrorKind::BadRequest,
            message: format!("request longer than {} bytes", ctl::MAX_LINE),
        },
        Line::Request(line) => match ctl::parse_request(line) {
            Ok(req) => {
                tracing::debug!(event = events::CTL_REQUEST, request = ?req);
                handle(control, req)
            }
            Err(resp) => *resp,
        },
    };
    local_socket::answer_line(ctl::VERSION, response)
}

/// Accepts connections forever, one thread each (a handful of operators,
/// never a hot path), at most `max_connections` at once: beyond it a
/// connection is closed at accept.
pub fn serve(listener: UnixListener, control: Arc<Control>, max_connections: usize) {
    local_socket::serve(
        listener,
        "ublkd-ctl",
        Limits {
            max_line: ctl::MAX_LINE,
            max_connections,
        },
        Arc::new(move |line| answer(&control, line)),
        |what, e| match what {
            "spawn" => tracing::error!(event = events::CTL_SPAWN_FAILED, error = %e),
            _ => tracing::warn!(event = events::CTL_ACCEPT_FAILED, error = %e),
        },
    );
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::config::UblkdConfig;

    /// A control socket served from a fresh state directory, at most
    /// `max_connections` connections at once.
    fn serving(dir: &Path, max_connections: usize) -> std::path::PathBuf {
        let mut cfg = UblkdConfig::defaults();
        cfg.state_dir = dir.join("state");
        let sock = dir.join("run/ublkd.sock");
        let listener = bind(&sock, None).unwrap();
        let obs = crate::observability::Observability::new(
            ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
            &cfg.metrics,
            &cfg.tracing,
        );
        let control = Arc::new(Control {
            manager: Arc::new(Manager::new(cfg, obs).unwrap()),
            reload: Box::new(|| Ok(Reloaded::default())),
        });
        std::thread::spawn(move || serve(listener, control, max_connections));
        sock
    }

    #[test]
    fn a_daemon_answers_over_its_socket_and_refuses_a_second_bind() {
        let dir = tempfile::tempdir().unwrap();
        let sock = serving(dir.path(), 64);
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let r = ctl::call(&sock, Request::List, Duration::from_secs(5)).unwrap();
        assert_eq!(
            r,
            Response::Ok {
                reply: Reply::Devices { devices: vec![] }
            }
        );
        let r = ctl::call(&sock, Request::Show { id: 3 }, Duration::from_secs(5)).unwrap();
        assert!(matches!(
            r,
            Response::Error {
                kind: ErrorKind::UnknownDevice,
                ..
            }
        ));
        let r = ctl::call(
            &sock,
            Request::Resize {
                id: 3,
                size: 1 << 30,
            },
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(
            r,
            Response::Error {
                kind: ErrorKind::UnknownDevice,
                message: "no device 3 (see `ublkctl list`)".into()
            }
        );
        assert!(matches!(bind(&sock, None), Err(SocketError::InUse { .. })));
        assert_eq!(
            bind(&dir.path().join("x.sock"), Some("no-such-group-here"))
                .unwrap_err()
                .to_string(),
            "socket_group \"no-such-group-here\" does not exist"
        );
    }

    #[test]
    fn connections_beyond_the_configured_limit_are_closed_at_accept() {
        use std::io::{BufRead, BufReader, Write};
        use std::os::unix::net::UnixStream;

        let dir = tempfile::tempdir().unwrap();
        let sock = serving(dir.path(), 1);
        // One connection, answered, so it holds the only place.
        let mut held = UnixStream::connect(&sock).unwrap();
        writeln!(held, r#"{{"version":{},"op":"list"}}"#, ctl::VERSION).unwrap();
        let mut answer = String::new();
        BufReader::new(&held).read_line(&mut answer).unwrap();
        assert!(answer.contains("\"ok\""), "{answer}");
        let refused = ctl::call(&sock, Request::List, Duration::from_secs(5));
        assert!(
            refused.is_err(),
            "a second connection was served: {refused:?}"
        );
        // The place frees when the first ends (its thread sees EOF).
        drop(held);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match ctl::call(&sock, Request::List, Duration::from_secs(5)) {
                Ok(r) => break assert!(matches!(r, Response::Ok { .. })),
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("no place freed after the first connection ended: {e}"),
            }
        }
    }
}
