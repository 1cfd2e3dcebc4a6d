//! The admin protocol between `arenactl` and `arenad`: one JSON object per
//! line each way over arenad's local admin socket
//! ([`crate::service::local_socket`]), each carrying `version`; a request
//! of a version the daemon does not speak is answered with an error, so old
//! and new tools fail clearly. docs/OPERATIONS.md shows the wire format.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::service::config_file::Change;
use crate::service::local_socket::{self, call_versioned, Answer, ClientError, Versioned};

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// Longest request or answer line accepted.
pub const MAX_LINE: usize = 4 << 20;
/// Where arenad listens unless `admin_socket` says otherwise.
pub const DEFAULT_SOCKET: &str = "/run/arenad/admin.sock";

/// A request line.
pub type RequestLine = Versioned<Request>;

/// What an operator can ask.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Every volume the store knows, with its usage.
    Volumes,
    /// The authenticated sessions, all or one volume's.
    Sessions {
        /// Only this volume's.
        #[serde(default)]
        volume: Option<String>,
    },
    /// Ends sessions: one, a volume's, or a peer's.
    Disconnect {
        /// Which.
        target: DisconnectTarget,
    },
    /// Reads the configuration again and applies it, answering the outcome.
    Reload,
    /// Reads the configuration again and says what a reload would do,
    /// changing nothing.
    Check,
    /// The store's and the server's counters.
    Stats,
}

/// Which sessions a `disconnect` ends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisconnectTarget {
    /// One session, by id.
    Session(u64),
    /// Every session of a volume.
    Volume(String),
    /// Every session from an address: an IP, or IP:port for one connection.
    Peer(String),
}

/// An answer line.
pub type ResponseLine = Versioned<Response>;

/// The answer to one request.
pub type Response = Answer<Reply, ErrorKind>;

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Not a request this daemon understands.
    BadRequest,
    /// A version this daemon does not speak.
    UnsupportedVersion,
    /// The configuration (or a secret file) does not load or apply.
    Config,
    /// No such volume or session.
    NotFound,
}

/// What a request answered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reply {
    /// `volumes`.
    Volumes {
        /// By name.
        volumes: Vec<VolumeInfo>,
        /// Every blob's size.
        blob_bytes: u64,
    },
    /// `sessions`.
    Sessions {
        /// Oldest first.
        sessions: Vec<SessionInfo>,
    },
    /// `disconnect`: the sessions told to end.
    Disconnected {
        /// Their ids.
        sessions: Vec<u64>,
    },
    /// `reload` (applied) or `check` (would apply).
    Reloaded {
        /// Whether it was applied (`reload`) or only checked (`check`).
        applied: bool,
        /// Per volume: added, removed, quota, secret or confidentiality.
        volumes: Vec<String>,
        /// Other keys in force (or that would be).
        changed: Vec<Change>,
        /// Keys that take effect only after a restart.
        restart_needed: Vec<Change>,
    },
    /// `stats`: what `/diagnostics` shows.
    Stats {
        /// The counters, as JSON.
        stats: serde_json::Value,
    },
}

/// One volume as `arenactl volumes` shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeInfo {
    /// The name clients ask for.
    pub name: String,
    /// Served to new sessions; `false` for a volume removed from the
    /// configuration (its blobs stay).
    pub served: bool,
    /// Its quota, in bytes.
    pub quota_bytes: u64,
    /// Blobs it holds.
    pub blobs: u64,
    /// Of those, blobs in the arena.
    pub resident: u64,
    /// Of those, blobs with an image on swap.
    pub on_swap: u64,
    /// Leases pinning one of its blobs.
    pub leases: u64,
    /// Its authenticated sessions.
    pub sessions: u64,
    /// Its writer epoch.
    pub epoch: u64,
    /// Served to sealed sessions only (protocol version 3, `[[volume]]
    /// confidential = true`); `false` for a volume no longer served.
    /// Absent in the answers of an older arenad: `false`.
    #[serde(default)]
    pub confidential: bool,
}

/// One session as `arenactl sessions` shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// Its id (the holder id in logs, `conn=`).
    pub id: u64,
    /// The client's address.
    pub peer: String,
    /// The volume it authenticated to.
    pub volume: String,
    /// `rdma` once its rail is connected, else `tcp`.
    pub transport: String,
    /// RDMA rails connected.
    pub rails: u32,
    /// Protocol version.
    pub protocol: u8,
    /// Leases it holds.
    pub leases: u64,
    /// Seconds since its handshake.
    pub age_secs: u64,
    /// Requests answered.
    pub requests: u64,
    /// Control-stream bytes received (requests and inline payloads;
    /// RDMA payloads move one-sided and are not seen here).
    pub bytes_in: u64,
    /// Control-stream bytes sent.
    pub bytes_out: u64,
}

/// Parses one request line; a problem is answered as a response.
pub fn parse_request(line: &str) -> Result<Request, Box<Response>> {
    local_socket::parse_request(
        "arenad",
        line,
        VERSION,
        ErrorKind::BadRequest,
        ErrorKind::UnsupportedVersion,
    )
}

/// Sends one request to the arenad on `socket` and waits for its answer.
pub fn call(socket: &Path, request: Request, timeout: Duration) -> Result<Response, ClientError> {
    call_versioned("arenad", socket, VERSION, request, MAX_LINE, timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_lines_are_answered() {
        for request in [
            Request::Volumes,
            Request::Sessions {
                volume: Some("vm1".into()),
            },
            Request::Disconnect {
                target: DisconnectTarget::Peer("10.0.0.7".into()),
            },
            Request::Reload,
        ] {
            let line = serde_json::to_string(&RequestLine {
                version: VERSION,
                body: request.clone(),
            })
            .unwrap();
            assert_eq!(parse_request(&line).unwrap(), request);
        }
        let kind = |line: &str| match *parse_request(line).unwrap_err() {
            Response::Error { kind, .. } => kind,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            kind(r#"{"version":9,"op":"volumes"}"#),
            ErrorKind::UnsupportedVersion
        );
        assert_eq!(kind(r#"{"op":"volumes"}"#), ErrorKind::BadRequest);
        assert_eq!(
            kind(r#"{"version":1,"op":"format"}"#),
            ErrorKind::BadRequest
        );
        assert_eq!(kind("volumes"), ErrorKind::BadRequest);
    }

    #[test]
    fn a_volume_listed_by_an_older_arenad_is_not_confidential() {
        let older = r#"{"name":"vm1","served":true,"quota_bytes":1048576,"blobs":2,
            "resident":1,"on_swap":1,"leases":0,"sessions":1,"epoch":4}"#;
        let v: VolumeInfo = serde_json::from_str(older).unwrap();
        assert_eq!(
            (v.name.as_str(), v.epoch, v.confidential),
            ("vm1", 4, false)
        );
        let now = VolumeInfo {
            confidential: true,
            ..v
        };
        let json = serde_json::to_value(&now).unwrap();
        assert_eq!(json["confidential"], true);
        assert_eq!(serde_json::from_value::<VolumeInfo>(json).unwrap(), now);
    }
}
