//! The control protocol between `ublkctl` and `ublkd`: one JSON object per
//! line each way over the Unix control socket, every object carrying
//! `version`. A daemon answers a request whose version it does not speak
//! with an `unsupported_version` error instead of guessing, so old and new
//! tools fail clearly. `docs/OPERATIONS.md` shows the wire format.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::TransportChoice;
use crate::coordination::PeerRecord;
use crate::device_stats::StatsSnapshot;
use target_rdma::service::config_file::Change;
use target_rdma::service::local_socket::{self, Answer, Versioned};
use target_rdma::service::size::{ApproxSize, HumanSize};
use ublk_metrics::driver::RailValue;
use ublk_metrics::DeviceDriverReport;

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// Longest request or response line accepted.
pub const MAX_LINE: usize = 1 << 20;

/// A request line.
pub type RequestLine = Versioned<Request>;

/// What a client can ask.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Create a device.
    Add(AddArgs),
    /// Delete a device.
    Del {
        /// Device id.
        id: u32,
        /// Delete even when mounted or open.
        force: bool,
    },
    /// All devices.
    List,
    /// One device.
    Show {
        /// Device id.
        id: u32,
    },
    /// I/O counters of one device or all.
    Stats {
        /// Device id; all when absent.
        id: Option<u32>,
    },
    /// Re-attach a device whose queues stopped (ublk user recovery).
    Recover {
        /// Device id.
        id: u32,
    },
    /// Take a standby device's writer role by a hand-over.
    Activate {
        /// Device id.
        id: u32,
    },
    /// Hand a device's writer role over to the standby asking for it.
    Release {
        /// Device id.
        id: u32,
    },
    /// What the running kernel's ublk driver supports.
    Features,
    /// Grow a live device (UPDATE_SIZE).
    Resize {
        /// Device id.
        id: u32,
        /// The new size in bytes.
        size: u64,
    },
    // --- replication: the placement pool in etcd ---
    /// Register an arena peer for placement.
    PeerAdd {
        /// The peer.
        peer: PeerRecord,
    },
    /// Unregister a peer (refused while a volume lists it).
    PeerDel {
        /// Peer id.
        id: String,
    },
    /// The placement pool.
    PeerList,
    // --- end replication ---
    /// Re-read the configuration file and apply what can change while
    /// running, as SIGHUP does, answering what happened.
    Reload,
}

/// Arguments of `add`; absent fields take the daemon's `[device]` defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AddArgs {
    /// `host:port` of each `arenad` holding a replica (`--peer`, repeatable;
    /// one for a volume on one peer); empty: placement in etcd chooses
    /// them. The field was once one string named `peer`, still accepted.
    #[serde(alias = "peer", deserialize_with = "one_or_many")]
    pub peers: Vec<String>,
    /// Replicas (1..=5); the number of peers when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u8>,
    /// Volume name on the peer.
    pub volume: String,
    /// File holding the volume's secret, read by the daemon.
    pub secret_file: PathBuf,
    /// Device size in bytes.
    pub size: u64,
    /// Hardware queues.
    pub queues: Option<u32>,
    /// Queue depth.
    pub depth: Option<u32>,
    /// Blob size to ask the volume for.
    pub blob_size: Option<u64>,
    /// Data path.
    pub transport: Option<TransportChoice>,
    /// Seal every frame of the device's sessions (protocol version 3, TCP
    /// only); false leaves it to `[device] confidential`.
    #[serde(default)]
    pub confidential: bool,
    /// Per-request buffer size.
    pub io_buf: Option<u64>,
    /// The device id to take (`add -n`); the kernel picks a free one when
    /// unset.
    #[serde(default)]
    pub id: Option<u32>,
    /// Expose the device read-only (the kernel refuses writes).
    #[serde(default)]
    pub read_only: bool,
    /// Serve a volume another ublkd writes, without its writer role.
    #[serde(default)]
    pub standby: bool,
    /// A standby's first write takes the writer role.
    #[serde(default)]
    pub activate_on_write: bool,
    /// CPUs to pin the queue threads to, queue q on `cpus[q % len]`; empty
    /// keeps the kernel's queue mapping.
    #[serde(default)]
    pub cpus: Vec<u32>,
}

/// A string or a list of strings (`add`'s peers, once a single string).
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

/// A response line.
pub type ResponseLine = Versioned<Response>;

/// Success with a reply, or an error of a closed kind with a message.
pub type Response = Answer<Reply, ErrorKind>;

/// Error classes a script can branch on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Malformed or invalid request.
    BadRequest,
    /// The request's protocol version is not spoken here.
    UnsupportedVersion,
    /// No such device.
    UnknownDevice,
    /// The device is mounted or open.
    Busy,
    /// The arena peer cannot be reached.
    PeerUnreachable,
    /// The arena peer refused the volume's secret.
    AuthFailed,
    /// The arena peer failed otherwise.
    Peer,
    /// `/dev/ublk-control` is missing.
    UblkMissing,
    /// `transport = rdma` and RDMA cannot be used (no device, peer declined).
    TransportUnavailable,
    /// The ublk driver or the system failed.
    System,
    /// The coordination service (etcd) failed, is not configured, or
    /// another ublkd serves the volume.
    Coordination,
    /// The device or the kernel's ublk driver cannot do it (e.g. resize
    /// without UPDATE_SIZE).
    Unsupported,
    /// The configuration file does not load or validate (a refused
    /// reload: the running configuration stays).
    Config,
}

/// A successful reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    /// `add`, `show`, `recover` and `resize`.
    Device {
        /// The device.
        device: Box<DeviceInfo>,
    },
    /// `del`.
    Deleted {
        /// The device id.
        id: u32,
    },
    /// `list`.
    Devices {
        /// Every device, by id.
        devices: Vec<DeviceInfo>,
    },
    /// `stats`.
    Stats(StatsReply),
    /// `peer add` and `peer list`.
    Peers {
        /// The peers, by id.
        peers: Vec<PeerInfo>,
    },
    /// `peer del`.
    PeerDeleted {
        /// The peer id.
        id: String,
    },
    /// `features`.
    Features {
        /// The raw `UBLK_F_*` mask.
        mask: u64,
        /// Names of the set bits this build knows.
        names: Vec<String>,
    },
    /// `reload`: the configuration was applied.
    Reloaded {
        /// Changed keys now in force.
        applied: Vec<Change>,
        /// Changed keys that take effect only at the next start.
        restart_needed: Vec<Change>,
    },
}

/// A device as `list` and `show` describe it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// ublk device id (N in `/dev/ublkbN`).
    pub id: u32,
    /// Block device node.
    pub node: String,
    /// Size in bytes.
    pub size: u64,
    /// Read-only to its users.
    #[serde(default)]
    pub read_only: bool,
    /// CPUs the queue threads are pinned to (empty: the kernel's mapping).
    #[serde(default)]
    pub cpus: Vec<u32>,
    /// Hardware queues.
    pub queues: u32,
    /// Queue depth.
    pub depth: u32,
    /// Per-request buffer in bytes.
    pub io_buf: u64,
    /// Blob size in use, 0 until the first connection.
    pub blob_size: u64,
    /// `live`, `starting`, `recovering`, `stopped` or `failed`.
    pub state: String,
    /// Why it is `failed`, when it is.
    pub error: Option<String>,
    /// `host:port` of `arenad`.
    pub peer: String,
    /// Volume name.
    pub volume: String,
    /// Data path in use (`rdma` or `tcp`; `none` for a device without
    /// queues, e.g. `failed`): what was negotiated, not what was asked.
    pub transport: String,
    /// What `add` asked for (`tcp`, `rdma` or `auto`).
    pub transport_requested: String,
    /// Why a device asked to use RDMA (`auto`) serves TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport_note: Option<String>,
    /// Every frame of its sessions is sealed (AES-256-GCM, protocol
    /// version 3); else tagged (keyed BLAKE3, version 2). Absent from a
    /// ublkd before the key: false.
    #[serde(default)]
    pub confidential: bool,
    /// Logical block size.
    pub logical_block_size: u32,
    /// RDMA rails over the device's queues (state, since when down, what
    /// each carried); absent on TCP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rails: Vec<RailValue>,
    /// A replicated volume's members, epoch and rebuild; absent for a
    /// volume on one peer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicasInfo>,
}

/// A replicated volume as `show` and `list` describe it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicasInfo {
    /// The writer's standing: `writer` (confirmed by the coordinator),
    /// `unconfirmed` (serving on the peers' epoch fence while the
    /// coordinator does not confirm the role) or `fenced` (every request
    /// fails until `recover`).
    #[serde(default = "writer_role")]
    pub role: String,
    /// Why the role is not `writer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role_reason: Option<String>,
    /// The membership epoch requests are served under.
    pub epoch: u64,
    /// Members that receive writes (healthy and syncing).
    pub active: usize,
    /// Healthy members (hold every acknowledged write).
    pub healthy: usize,
    /// Every member of the record, in record order.
    pub members: Vec<ReplicaInfo>,
    /// The rebuild in progress, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<RebuildInfo>,
    /// The device's last hand-overs of the writer role, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handovers: Vec<HandoverInfo>,
}

/// One move of a device's writer role.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoverInfo {
    /// `in` (taken here) or `out` (handed to another ublkd).
    pub direction: String,
    /// The other ublkd, as etcd names it.
    pub other: String,
    /// How long it took: asking to serving (`in`), or the request seen to
    /// the role given up (`out`).
    pub took_ms: u64,
    /// How long ago it completed.
    pub ago_ms: u64,
}

/// One member of a replicated volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaInfo {
    /// The peer as the record names it (`host:port` or a pool id).
    pub peer: String,
    /// `healthy`, `syncing`, `failed` or `removed`.
    pub state: String,
    /// Why a failed member failed, when this writer saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Rebuilds of this peer that failed in a row (0: none, or the last
    /// one succeeded).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rebuild_failures: u32,
    /// Milliseconds until the next rebuild of this peer may start: it is
    /// backed off after `rebuild_failures` failures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_in_ms: Option<u64>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn writer_role() -> String {
    "writer".into()
}

impl ReplicasInfo {
    /// `show`'s lines for the replicas: the summary, then one per member
    /// (state, peer, and its rebuild's progress or backoff).
    pub fn show_lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "  replicas   {} healthy of {} active, epoch {}",
            self.healthy, self.active, self.epoch
        )];
        out.push(match &self.role_reason {
            None => format!("  role       {}", self.role),
            Some(why) => format!("  role       {}: {why}", self.role),
        });
        for m in &self.members {
            let mut note = match &self.rebuild {
                Some(b) if b.peer == m.peer => {
                    let total = b.bytes_done + b.bytes_remaining;
                    let pct = (b.bytes_done * 100).checked_div(total).unwrap_or(100);
                    let eta = match b.eta_ms {
                        Some(ms) => format!("ETA {}", eta_text(ms)),
                        None => "ETA unknown".into(),
                    };
                    format!(
                        "  rebuild {pct}% ({} of {}) at {}/s, {eta}",
                        HumanSize(b.bytes_done),
                        HumanSize(total),
                        ApproxSize(b.bytes_per_sec),
                    )
                }
                _ => String::new(),
            };
            if m.rebuild_failures > 0 {
                note.push_str(&format!("  rebuild failed {}x", m.rebuild_failures));
                if let Some(ms) = m.retry_in_ms {
                    note.push_str(&format!(", next try in {:.1} s", ms as f64 / 1e3));
                }
            }
            if let Some(why) = &m.failure {
                note.push_str(&format!("  ({why})"));
            }
            out.push(format!("    {:<8} {}{note}", m.state, m.peer));
        }
        for h in &self.handovers {
            let (verb, prep) = match h.direction.as_str() {
                "in" => ("taken", "from"),
                _ => ("handed", "to"),
            };
            out.push(format!(
                "  hand-over  {verb} {prep} {} in {} ms, {} ago",
                h.other,
                h.took_ms,
                eta_text(h.ago_ms)
            ));
        }
        out
    }
}

/// A rebuild's time left as an operator reads it: `42.0 s`, `3m05s`,
/// `2h07m`.
fn eta_text(ms: u64) -> String {
    let secs = ms / 1000;
    match secs {
        0..60 => format!("{:.1} s", ms as f64 / 1e3),
        60..3600 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs % 3600 / 60),
    }
}

/// A rebuild's progress.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebuildInfo {
    /// The member being rebuilt.
    pub peer: String,
    /// Blob bytes copied to it so far.
    pub bytes_done: u64,
    /// Blob bytes still to copy.
    pub bytes_remaining: u64,
    /// Blob bytes the rebuild copies in all (`bytes_done` +
    /// `bytes_remaining`).
    #[serde(default)]
    pub bytes_total: u64,
    /// Bytes per second copied over the last 5 s.
    #[serde(default)]
    pub bytes_per_sec: u64,
    /// Milliseconds left at that rate; absent before a rate is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_ms: Option<u64>,
}

/// A registered peer as `peer list` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// The registration.
    #[serde(flatten)]
    pub peer: PeerRecord,
    /// Bytes of volumes placed on it.
    pub used: u64,
}

/// The answer to `stats`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatsReply {
    /// Per-device counters, by id.
    pub devices: Vec<DeviceStatsInfo>,
    /// Data-path (driver) statistics of the same devices, by id; print them
    /// with `ublk_metrics::summarize`.
    #[serde(default)]
    pub driver: Vec<DeviceDriverReport>,
}

/// One device's counters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatsInfo {
    /// Device id.
    pub id: u32,
    /// Block device node.
    pub node: String,
    /// Counters.
    pub stats: StatsSnapshot,
    /// Requests in flight for at least `metrics.stall_threshold_secs`.
    #[serde(default)]
    pub stalled: u64,
    /// Age of the oldest request in flight, in ms (0 when idle).
    #[serde(default)]
    pub oldest_inflight_ms: u64,
}

pub use target_rdma::service::local_socket::ClientError;

/// Sends one request and waits for its response.
pub fn call(socket: &Path, request: Request, timeout: Duration) -> Result<Response, ClientError> {
    local_socket::call_versioned("ublkd", socket, VERSION, request, MAX_LINE, timeout)
}

/// Parses one request line, answering protocol problems as responses.
pub fn parse_request(line: &str) -> Result<Request, Box<Response>> {
    local_socket::parse_request(
        "ublkd",
        line,
        VERSION,
        ErrorKind::BadRequest,
        ErrorKind::UnsupportedVersion,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_with_a_version_field() {
        let r = RequestLine {
            version: VERSION,
            body: Request::Del { id: 3, force: true },
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(s, r#"{"version":1,"op":"del","id":3,"force":true}"#);
        assert_eq!(parse_request(&s).unwrap(), r.body);
        assert_eq!(
            parse_request(r#"{"version":1,"op":"resize","id":0,"size":134217728}"#).unwrap(),
            Request::Resize {
                id: 0,
                size: 128 << 20
            }
        );
        let s = r#"{"version":1,"op":"add","peer":"h:1","volume":"v","secret_file":"/s","size":4096,"queues":null,"depth":2,"blob_size":null,"transport":"tcp","io_buf":null}"#;
        match parse_request(s).unwrap() {
            Request::Add(a) => {
                assert_eq!(a.depth, Some(2));
                assert_eq!(a.transport, Some(TransportChoice::Tcp));
            }
            other => panic!("{other:?}"),
        }
    }

    /// `show --json` carries `confidential`; a device described by a ublkd
    /// from before the key reads as not confidential.
    #[test]
    fn device_info_carries_confidential_and_old_answers_read_false() {
        let old = r#"{"id":0,"node":"/dev/ublkb0","size":4096,"queues":1,"depth":64,"io_buf":524288,"blob_size":65536,"state":"live","error":null,"peer":"h:1","volume":"v","transport":"tcp","transport_requested":"auto","logical_block_size":512}"#;
        let mut d: DeviceInfo = serde_json::from_str(old).unwrap();
        assert!(!d.confidential);
        assert_eq!(serde_json::to_value(&d).unwrap()["confidential"], false);
        d.confidential = true;
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(json["confidential"], true);
        assert_eq!(serde_json::from_value::<DeviceInfo>(json).unwrap(), d);
        let add = r#"{"version":1,"op":"add","peers":["h:1"],"volume":"v","secret_file":"/s","size":4096,"queues":null,"depth":null,"blob_size":null,"transport":"tcp","confidential":true,"io_buf":null}"#;
        match parse_request(add).unwrap() {
            Request::Add(a) => assert!(a.confidential),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn protocol_errors_are_answered_not_dropped() {
        let kind = |line: &str| match parse_request(line).map_err(|b| *b) {
            Err(Response::Error { kind, message }) => (kind, message),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            kind(r#"{"version":2,"op":"list"}"#),
            (
                ErrorKind::UnsupportedVersion,
                "protocol version 2 is not supported; this ublkd speaks version 1".into()
            )
        );
        assert_eq!(
            kind(r#"{"op":"list"}"#),
            (ErrorKind::BadRequest, "missing \"version\"".into())
        );
        assert!(kind("nonsense").1.starts_with("not a JSON object"));
        assert!(kind(r#"{"version":1,"op":"explode"}"#)
            .1
            .starts_with("invalid request: unknown variant `explode`"));
    }

    #[test]
    fn responses_carry_status_and_kind() {
        let r = ResponseLine {
            version: VERSION,
            body: Response::Error {
                kind: ErrorKind::UnknownDevice,
                message: "no device 9".into(),
            },
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"version":1,"status":"error","kind":"unknown_device","message":"no device 9"}"#
        );
    }

    #[test]
    fn client_errors_say_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.sock");
        let e = call(&missing, Request::List, Duration::from_secs(1)).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "ublkd is not running: its socket {} does not exist (start it with `systemctl start ublkd`)",
                missing.display()
            )
        );
        let stale = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        let e = call(&stale, Request::List, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("nothing listens on"), "{e}");
    }

    #[test]
    fn a_rebuilding_member_shows_its_progress_rate_and_eta() {
        let mut info = ReplicasInfo {
            role: "unconfirmed".into(),
            role_reason: Some("etcd is away".into()),
            epoch: 4,
            active: 2,
            healthy: 1,
            members: ["a", "b"]
                .into_iter()
                .zip(["healthy", "syncing"])
                .map(|(peer, state)| ReplicaInfo {
                    peer: peer.into(),
                    state: state.into(),
                    failure: None,
                    rebuild_failures: 0,
                    retry_in_ms: None,
                })
                .collect(),
            rebuild: Some(RebuildInfo {
                peer: "b".into(),
                bytes_done: 48 << 20,
                bytes_remaining: 144 << 20,
                bytes_total: 192 << 20,
                bytes_per_sec: 3 << 19,
                eta_ms: Some(96_000),
            }),
            handovers: vec![HandoverInfo {
                direction: "in".into(),
                other: "ublkd on host-a".into(),
                took_ms: 140,
                ago_ms: 65_000,
            }],
        };
        assert_eq!(
            info.show_lines()[4],
            "  hand-over  taken from ublkd on host-a in 140 ms, 1m05s ago"
        );
        assert_eq!(
            info.show_lines()[1],
            "  role       unconfirmed: etcd is away"
        );
        assert_eq!(
            info.show_lines()[3],
            "    syncing  b  rebuild 25% (48M of 192M) at 1.5M/s, ETA 1m36s"
        );
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["rebuild"]["bytes_per_sec"], 3 << 19);
        assert_eq!(json["rebuild"]["eta_ms"], 96_000);
        if let Some(b) = info.rebuild.as_mut() {
            b.eta_ms = None;
        }
        assert!(info.show_lines()[3].ends_with("at 1.5M/s, ETA unknown"));
        assert_eq!(
            [eta_text(4_200), eta_text(185_000), eta_text(7_620_000)],
            ["4.2 s", "3m05s", "2h07m"]
        );
    }
}
