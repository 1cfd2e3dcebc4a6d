//! arenad's admin socket: what `arenactl` asks ([`crate::admin`]),
//! answered from the server's sessions, the store's per-volume usage and
//! the reload. Each answer copies what it needs out of the session table
//! and the store under their own locks, one at a time; nothing here holds
//! a lock across the socket.

use std::net::{IpAddr, SocketAddr};
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tracing::{error, warn};

use crate::admin::{
    self, DisconnectTarget, ErrorKind, Reply, Request, Response, SessionInfo, VolumeInfo,
};
use crate::arenad::events;
use crate::arenad::reload::{ReloadError, Reloaded};
use crate::arenad::server::Server;
use crate::arenad::session::Session;
use crate::service::local_socket::{self, Limits, Line};

/// Reads the configuration again and applies it (`true`) or only says what
/// applying it would do (`false`).
pub type ReloadFn = Box<dyn Fn(bool) -> Result<Reloaded, ReloadError> + Send + Sync>;

/// What the admin socket serves.
pub struct Admin {
    /// The running server.
    pub server: Arc<Server>,
    /// The reload SIGHUP also runs.
    pub reload: ReloadFn,
    /// Admin connections served at once.
    pub max_connections: usize,
}

impl Admin {
    /// Answers one request.
    pub fn handle(&self, request: Request) -> Response {
        let reply = match request {
            Request::Volumes => self.volumes(),
            Request::Sessions { volume } => {
                if let Some(v) = &volume {
                    if !self.knows_volume(v) {
                        return not_found(format!("no volume {v:?} (see `arenactl volumes`)"));
                    }
                }
                Reply::Sessions {
                    sessions: self.sessions(volume.as_deref()),
                }
            }
            Request::Disconnect { target } => match self.disconnect(&target) {
                Ok(ids) => Reply::Disconnected { sessions: ids },
                Err(message) => return not_found(message),
            },
            Request::Reload | Request::Check => {
                let apply = matches!(request, Request::Reload);
                match (self.reload)(apply) {
                    Ok(done) => reloaded(apply, done),
                    Err(e) => {
                        return Response::Error {
                            kind: ErrorKind::Config,
                            message: format!("{e}; the running configuration stays"),
                        }
                    }
                }
            }
            Request::Stats => Reply::Stats {
                stats: self.server.shared.obs.telemetry().diagnostics(),
            },
        };
        Response::Ok { reply }
    }

    fn knows_volume(&self, name: &str) -> bool {
        let store = &self.server.shared.store;
        store.volume_usage().iter().any(|v| v.name == name)
    }

    fn volumes(&self) -> Reply {
        let shared = &self.server.shared;
        let sessions = shared.sessions.all();
        let blob_bytes = u64::from(shared.store.blob_bytes());
        let served = Arc::clone(&shared.volumes.read());
        let volumes = shared
            .store
            .volume_usage()
            .into_iter()
            .map(|u| VolumeInfo {
                sessions: sessions.iter().filter(|s| s.vol.name == u.name).count() as u64,
                epoch: shared.fencing.epochs.epoch_of(&u.name),
                confidential: u.served && served.iter().any(|v| v.name == u.name && v.confidential),
                name: u.name,
                served: u.served,
                quota_bytes: u.quota_blobs * blob_bytes,
                blobs: u.blobs,
                resident: u.resident,
                on_swap: u.on_swap,
                leases: u.leases,
            })
            .collect();
        Reply::Volumes {
            volumes,
            blob_bytes,
        }
    }

    fn sessions(&self, volume: Option<&str>) -> Vec<SessionInfo> {
        let shared = &self.server.shared;
        let mut sessions: Vec<SessionInfo> = shared
            .sessions
            .all()
            .iter()
            .filter(|s| volume.is_none_or(|v| s.vol.name == v))
            .map(|s| info(s, shared.store.leases_held_by(s.id) as u64))
            .collect();
        sessions.sort_by_key(|s| s.id);
        sessions
    }

    /// Ends the sessions `target` names: each is closed now (its queued
    /// answers dropped, its leases ended as for any closed connection),
    /// logged and counted.
    fn disconnect(&self, target: &DisconnectTarget) -> Result<Vec<u64>, String> {
        let shared = &self.server.shared;
        let peer = match target {
            DisconnectTarget::Peer(p) => Some(PeerFilter::parse(p)?),
            _ => None,
        };
        if let DisconnectTarget::Volume(v) = target {
            if !self.knows_volume(v) {
                return Err(format!("no volume {v:?} (see `arenactl volumes`)"));
            }
        }
        let chosen: Vec<Arc<Session>> = shared
            .sessions
            .all()
            .into_iter()
            .filter(|s| match target {
                DisconnectTarget::Session(id) => s.id == *id,
                DisconnectTarget::Volume(v) => s.vol.name == *v,
                DisconnectTarget::Peer(_) => peer.is_some_and(|p| p.matches(s.peer)),
            })
            .collect();
        if let (DisconnectTarget::Session(id), true) = (target, chosen.is_empty()) {
            return Err(format!("no session {id} (see `arenactl sessions`)"));
        }
        let mut ids = Vec::with_capacity(chosen.len());
        for s in chosen {
            warn!(
                event = events::SESSION_DISCONNECTED,
                conn = s.id,
                peer = %s.peer,
                volume = %s.vol.name,
                "an operator ended the session (arenactl disconnect)"
            );
            s.outbox.close();
            shared.obs.session_disconnected();
            ids.push(s.id);
        }
        ids.sort_unstable();
        Ok(ids)
    }
}

/// The sessions `disconnect --peer` names: every one of a host (an IP),
/// or one connection (IP:port).
#[derive(Clone, Copy)]
enum PeerFilter {
    Host(IpAddr),
    Connection(SocketAddr),
}

impl PeerFilter {
    fn parse(p: &str) -> Result<Self, String> {
        if let Ok(addr) = p.parse() {
            return Ok(Self::Connection(addr));
        }
        p.parse()
            .map(Self::Host)
            .map_err(|_| format!("{p:?} is neither an IP address nor IP:port"))
    }

    fn matches(self, peer: SocketAddr) -> bool {
        match self {
            Self::Host(ip) => peer.ip() == ip,
            Self::Connection(addr) => peer == addr,
        }
    }
}

fn info(s: &Session, leases: u64) -> SessionInfo {
    let rails = s.rails.connected();
    SessionInfo {
        id: s.id,
        peer: s.peer.to_string(),
        volume: s.vol.name.clone(),
        transport: if rails > 0 { "rdma" } else { "tcp" }.into(),
        rails,
        protocol: s.version,
        leases,
        age_secs: s.traffic.opened.elapsed().as_secs(),
        requests: s.traffic.requests.load(Ordering::Relaxed),
        bytes_in: s.traffic.bytes_in.load(Ordering::Relaxed),
        bytes_out: s.traffic.bytes_out.load(Ordering::Relaxed),
    }
}

fn not_found(message: String) -> Response {
    Response::Error {
        kind: ErrorKind::NotFound,
        message,
    }
}

fn reloaded(applied: bool, done: Reloaded) -> Reply {
    Reply::Reloaded {
        applied,
        volumes: done.volumes.iter().map(ToString::to_string).collect(),
        changed: done.applied,
        restart_needed: done.restart_needed,
    }
}

fn answer(admin: &Admin, line: Line<'_>) -> String {
    let response = match line {
        Line::TooLong => Response::Error {
            kind: ErrorKind::BadRequest,
            message: format!("request longer than {} bytes", admin::MAX_LINE),
        },
        Line::Request(line) => match admin::parse_request(line) {
            Ok(req) => admin.handle(req),
            Err(resp) => *resp,
        },
    };
    local_socket::answer_line(admin::VERSION, response)
}

/// Answers admin connections until the listener fails (on a thread of
/// its own).
pub fn serve(listener: UnixListener, admin: Arc<Admin>) {
    let limits = Limits {
        max_line: admin::MAX_LINE,
        max_connections: admin.max_connections,
    };
    local_socket::serve(
        listener,
        "arenad-admin",
        limits,
        Arc::new(move |line| answer(&admin, line)),
        |what, e| error!(event = events::ADMIN_CONNECTION_FAILED, what, error = %e),
    );
}
