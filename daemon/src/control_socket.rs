//! The control socket: a Unix stream socket, root-only (0600) unless a
//! `socket_group` is configured (0660, that group). Each connection may send
//! several request lines; each gets one response line.

use std::ffi::CString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

use rustix::fs::Mode;
use rustix::process::umask;
use ublk_metrics::events;

use crate::config::ConfigError;
use crate::ctl::{self, ConfigChange, ErrorKind, PeerInfo, Reply, Request, Response, ResponseLine};
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

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another daemon answers on the path.
    #[error("another ublkd is already listening on {0}")]
    InUse(String),
    /// The group does not exist.
    #[error("socket_group {0:?} does not exist")]
    NoSuchGroup(String),
    /// A component of the socket's directory is not a directory.
    #[error("control socket {path}: {ancestor} is not a directory")]
    NotADirectory {
        /// The socket path.
        path: String,
        /// The first ancestor that exists and is something else.
        ancestor: String,
    },
    /// Filesystem trouble.
    #[error("control socket {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

fn gid_of(group: &str) -> Option<u32> {
    let name = CString::new(group).ok()?;
    // SAFETY: getgrnam reads a NUL-terminated string we own; the result is
    // only dereferenced when non-null, before any other getgr* call.
    let gr = unsafe { libc::getgrnam(name.as_ptr()) };
    if gr.is_null() {
        None
    } else {
        // SAFETY: non-null pointer to libc's static group record.
        Some(unsafe { (*gr).gr_gid })
    }
}

/// Whether `group` names a group of this host (`socket_group`).
pub fn group_exists(group: &str) -> bool {
    gid_of(group).is_some()
}

/// Binds the socket with the configured ownership and mode.
pub fn bind(path: &Path, group: Option<&str>) -> Result<UnixListener, SocketError> {
    let io = |source| SocketError::Io {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        // create_dir_all reports an ancestor that is a file as EEXIST,
        // which names no cause: find the ancestor and say what it is.
        if let Some(file) = dir.ancestors().find(|a| a.exists() && !a.is_dir()) {
            return Err(SocketError::NotADirectory {
                path: path.display().to_string(),
                ancestor: file.display().to_string(),
            });
        }
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(SocketError::InUse(path.display().to_string()));
        }
        // Left behind by a crashed ublkd.
        std::fs::remove_file(path).map_err(io)?;
    }
    let gid = match group {
        Some(g) => Some(gid_of(g).ok_or_else(|| SocketError::NoSuchGroup(g.to_owned()))?),
        None => None,
    };
    // Bind with a umask that leaves no window where others could connect.
    let old = umask(Mode::from_raw_mode(0o177));
    let bound = UnixListener::bind(path);
    umask(old);
    let listener = bound.map_err(io)?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(io)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(io)?;
    } else {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    }
    Ok(listener)
}

/// Runs one request.
pub fn handle(control: &Control, request: Request) -> Response {
    if let Request::Reload = request {
        return match (control.reload)() {
            Ok(done) => {
                let changes = |v: Vec<target_rdma::service::config_file::Change>| {
                    v.into_iter()
                        .map(|c| ConfigChange {
                            key: c.key,
                            old: c.old,
                            new: c.new,
                        })
                        .collect()
                };
                Response::Ok {
                    reply: Reply::Reloaded {
                        applied: changes(done.applied),
                        restart_needed: changes(done.restart_needed),
                    },
                }
            }
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

fn serve_conn(control: &Control, stream: UnixStream) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream.take(u64::MAX));
    loop {
        let mut line = String::new();
        reader.get_mut().set_limit(ctl::MAX_LINE as u64);
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let response = if !line.ends_with('\n') && line.len() >= ctl::MAX_LINE {
            Response::Error {
                kind: ErrorKind::BadRequest,
                message: format!("request longer than {} bytes", ctl::MAX_LINE),
            }
        } else {
            match ctl::parse_request(line.trim_end()) {
                Ok(req) => {
                    tracing::debug!(event = events::CTL_REQUEST, request = ?req);
                    handle(control, req)
                }
                Err(resp) => *resp,
            }
        };
        let mut out = match serde_json::to_string(&ResponseLine {
            version: ctl::VERSION,
            response,
        }) {
            Ok(s) => s,
            Err(_) => return,
        };
        out.push('\n');
        if writer.write_all(out.as_bytes()).is_err() {
            return;
        }
    }
}

/// Accepts connections forever, one thread each (a handful of operators,
/// never a hot path).
pub fn serve(listener: UnixListener, control: Arc<Control>) {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let c = Arc::clone(&control);
                if let Err(e) = std::thread::Builder::new()
                    .name("ublkd-ctl".into())
                    .spawn(move || serve_conn(&c, stream))
                {
                    tracing::error!(event = events::CTL_SPAWN_FAILED, error = %e);
                }
            }
            Err(e) => tracing::warn!(event = events::CTL_ACCEPT_FAILED, error = %e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::UblkdConfig;

    #[test]
    fn a_daemon_answers_over_its_socket_and_refuses_a_second_bind() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = UblkdConfig::defaults();
        cfg.state_dir = dir.path().join("state");
        let sock = dir.path().join("run/ublkd.sock");
        let listener = bind(&sock, None).unwrap();
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let obs = crate::observability::Observability::new(
            ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
            &cfg.metrics,
            &cfg.tracing,
        );
        let control = Arc::new(Control {
            manager: Arc::new(Manager::new(cfg, obs).unwrap()),
            reload: Box::new(|| Ok(Reloaded::default())),
        });
        std::thread::spawn(move || serve(listener, control));
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
        assert!(matches!(bind(&sock, None), Err(SocketError::InUse(_))));
        assert_eq!(
            bind(&dir.path().join("x.sock"), Some("no-such-group-here"))
                .unwrap_err()
                .to_string(),
            "socket_group \"no-such-group-here\" does not exist"
        );
    }
}
