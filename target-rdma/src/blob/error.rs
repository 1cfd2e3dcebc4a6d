//! The one error every arena session returns, whichever transport carries
//! it: the same failure is the same [`ArenaError`] (and the same
//! [`ErrorKind`]) over TCP, over RDMA and in process, so the block target and
//! the failure taxonomy classify it once.

use std::io;
use std::time::Duration;

use crate::proto::{FrameError, Opcode, Status};
use ublk_metrics::{FailureCause, IoOp};

/// What kind of failure an [`ArenaError`] is: the closed set callers match
/// on (errno, failure taxonomy, readiness, control-socket error class),
/// without reaching into the variants' fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// TCP connect failed or timed out.
    Connect,
    /// The peer rejected our MAC: wrong secret or unknown volume.
    AuthFailed,
    /// The peer could not prove it knows the secret.
    PeerNotAuthentic,
    /// The handshake was refused with this status.
    Refused(Status),
    /// A request got no answer in time.
    TimedOut,
    /// The connection broke before the answer.
    Disconnected,
    /// The peer (or the in-process store) answered with this error status.
    Status(Status),
    /// The peer sent something that breaks the protocol.
    Protocol,
    /// The peer restarted and lost acknowledged, unflushed writes.
    UnflushedDataLost,
    /// A replicated volume refused a request that no single member's
    /// failure explains.
    Replica(ReplicaFailure),
}

impl ErrorKind {
    /// The errno the block layer gets (positive; ublk wants it negated).
    /// The kernel turns these into block statuses: ENOSPC →
    /// `BLK_STS_NOSPC`, ETIMEDOUT → `BLK_STS_TIMEOUT`, ENOLINK →
    /// `BLK_STS_TRANSPORT`, the rest → `BLK_STS_IOERR`. Every kind is
    /// named, so a new one must be placed here.
    pub fn errno(self) -> i32 {
        match self {
            Self::TimedOut | Self::Replica(ReplicaFailure::Unrecorded) => libc::ETIMEDOUT,
            Self::Connect | Self::Disconnected | Self::Replica(ReplicaFailure::NoMember) => {
                libc::ENOLINK
            }
            Self::Status(s) => status_errno(s),
            Self::AuthFailed
            | Self::PeerNotAuthentic
            | Self::Refused(_)
            | Self::Protocol
            | Self::UnflushedDataLost
            | Self::Replica(ReplicaFailure::Fenced | ReplicaFailure::Standby) => libc::EIO,
        }
    }

    /// Where a request of `op` failed and why, in the failure taxonomy of
    /// docs/METRICS.md (`ublk_request_failures_total{phase,reason}`).
    pub fn blame(self, op: IoOp) -> FailureCause {
        match self {
            Self::Connect => FailureCause::ConnectUnavailable,
            Self::AuthFailed | Self::PeerNotAuthentic => FailureCause::HandshakeAuth,
            Self::Refused(_) => FailureCause::HandshakeUnavailable,
            Self::TimedOut => FailureCause::PollTimeout,
            Self::Disconnected => FailureCause::PollPeerClosed,
            Self::Protocol => FailureCause::PollProtocol,
            Self::UnflushedDataLost => FailureCause::FlushIo,
            Self::Replica(ReplicaFailure::Unrecorded) => FailureCause::CompletionTimeout,
            Self::Replica(ReplicaFailure::Fenced | ReplicaFailure::Standby) => {
                FailureCause::CompletionAuth
            }
            Self::Replica(ReplicaFailure::NoMember) => FailureCause::ConnectUnavailable,
            Self::Status(s) => status_blame(s, op),
        }
    }

    /// Whether the session to the peer is gone: the connection never came
    /// up, broke, or was refused at the handshake (a reconnect is due).
    pub fn peer_gone(self) -> bool {
        match self {
            Self::Connect | Self::Disconnected | Self::Refused(_) => true,
            Self::AuthFailed
            | Self::PeerNotAuthentic
            | Self::TimedOut
            | Self::Status(_)
            | Self::Protocol
            | Self::UnflushedDataLost
            | Self::Replica(_) => false,
        }
    }
}

/// The errno of a request the peer answered with `s`.
fn status_errno(s: Status) -> i32 {
    match s {
        Status::NoSpace | Status::QuotaExceeded => libc::ENOSPC,
        Status::Ok
        | Status::NotFound
        | Status::Busy
        | Status::Protocol
        | Status::AuthFailed
        | Status::VersionMismatch
        | Status::ShuttingDown
        | Status::Internal
        | Status::LeaseLost
        | Status::StaleEpoch
        | Status::Cold => libc::EIO,
    }
}

/// Where a request of `op` the peer answered with `s` failed.
fn status_blame(s: Status, op: IoOp) -> FailureCause {
    match s {
        Status::NoSpace | Status::QuotaExceeded | Status::Busy => FailureCause::AllocExhausted,
        Status::Protocol | Status::VersionMismatch => FailureCause::CompletionProtocol,
        Status::AuthFailed => FailureCause::CompletionAuth,
        Status::ShuttingDown => FailureCause::CompletionUnavailable,
        Status::Ok
        | Status::NotFound
        | Status::Internal
        | Status::LeaseLost
        | Status::StaleEpoch
        | Status::Cold => match op {
            IoOp::Flush => FailureCause::FlushIo,
            IoOp::Read | IoOp::Write | IoOp::Discard | IoOp::WriteZeroes => {
                FailureCause::CompletionIo
            }
        },
    }
}

/// Why a replicated volume refused a request of its own accord.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReplicaFailure {
    /// A member missed the request and its removal could not be recorded in
    /// the coordination store in time (unreachable, slow, or the record
    /// moved on in a way this writer cannot follow).
    Unrecorded,
    /// This process may no longer write the volume: its writer lease
    /// expired, or a peer has seen a newer membership epoch (another
    /// writer took over).
    Fenced,
    /// No member of the membership can serve the request.
    NoMember,
    /// This process is a standby: it holds no writer role, so it
    /// acknowledges no write (it serves reads).
    Standby,
}

impl ReplicaFailure {
    /// Stable lower-case name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Unrecorded => "unrecorded",
            Self::Fenced => "fenced",
            Self::NoMember => "no_member",
            Self::Standby => "standby",
        }
    }
}

/// A failed arena operation. Messages name the peer, the op and the cause.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    /// TCP connect failed or timed out.
    #[error("cannot connect to arena peer {peer}: {source}")]
    Connect {
        /// The peer.
        peer: String,
        /// The cause.
        source: io::Error,
    },
    /// The peer rejected our MAC: wrong secret or unknown volume.
    #[error("arena peer {peer} refused authentication for volume {volume:?} (wrong secret or unknown volume)")]
    AuthFailed {
        /// The peer.
        peer: String,
        /// The volume asked for.
        volume: String,
    },
    /// The peer's WELCOME MAC was wrong: it does not know the secret.
    #[error("arena peer {peer} could not prove it knows the secret of volume {volume:?}; refusing to use it")]
    PeerNotAuthentic {
        /// The peer.
        peer: String,
        /// The volume asked for.
        volume: String,
    },
    /// The handshake was refused for another reason.
    #[error("arena peer {peer} refused the session ({status}): {message}", status = status.name())]
    Refused {
        /// The peer.
        peer: String,
        /// Why, as a status.
        status: Status,
        /// The peer's message.
        message: String,
    },
    /// A request got no answer in time.
    #[error("{op} to arena peer {peer} timed out after {after:?}", op = op.name())]
    TimedOut {
        /// The request.
        op: Opcode,
        /// The peer.
        peer: String,
        /// The limit.
        after: Duration,
    },
    /// The connection broke before the answer.
    #[error("connection to arena peer {peer} lost: {detail}")]
    Disconnected {
        /// The peer.
        peer: String,
        /// What happened.
        detail: String,
    },
    /// The peer answered with an error status.
    #[error("arena peer {peer} answered {op} with {status}: {message}", op = op.name(), status = status.name())]
    Status {
        /// The request.
        op: Opcode,
        /// The peer.
        peer: String,
        /// The status.
        status: Status,
        /// The peer's message.
        message: String,
    },
    /// The peer sent something that breaks the protocol.
    #[error("protocol error from arena peer {peer}: {source}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        source: FrameError,
    },
    /// The peer restarted and lost writes it had acknowledged but not flushed.
    #[error("arena peer {peer} restarted (generation {old} -> {new}) and lost acknowledged writes that were not yet flushed")]
    UnflushedDataLost {
        /// The peer.
        peer: String,
        /// Generation the writes were acknowledged in.
        old: u64,
        /// Generation after the restart.
        new: u64,
    },
    /// A replicated volume refused the request.
    #[error("replicated volume {volume:?} refused the request ({failure}): {detail}", failure = failure.name())]
    Replica {
        /// The volume.
        volume: String,
        /// Why.
        failure: ReplicaFailure,
        /// What happened, naming the members involved.
        detail: String,
    },
}

impl ArenaError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Connect { .. } => ErrorKind::Connect,
            Self::AuthFailed { .. } => ErrorKind::AuthFailed,
            Self::PeerNotAuthentic { .. } => ErrorKind::PeerNotAuthentic,
            Self::Refused { status, .. } => ErrorKind::Refused(*status),
            Self::TimedOut { .. } => ErrorKind::TimedOut,
            Self::Disconnected { .. } => ErrorKind::Disconnected,
            Self::Status { status, .. } => ErrorKind::Status(*status),
            Self::Protocol { .. } => ErrorKind::Protocol,
            Self::UnflushedDataLost { .. } => ErrorKind::UnflushedDataLost,
            Self::Replica { failure, .. } => ErrorKind::Replica(*failure),
        }
    }

    /// The peer's status, when the peer answered with one.
    pub fn status(&self) -> Option<Status> {
        match self.kind() {
            ErrorKind::Status(s) | ErrorKind::Refused(s) => Some(s),
            _ => None,
        }
    }
}
