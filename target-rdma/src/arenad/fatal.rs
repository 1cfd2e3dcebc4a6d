//! Why a connection ends early, and how each reason is counted, logged and
//! answered with an error frame before the close.

use std::io;
use std::net::SocketAddr;

use tracing::{debug, warn};
use ublk_metrics::ProtocolErrorClass;

use crate::arenad::epochs::EpochError;
use crate::arenad::events;
use crate::arenad::frames::ReadError;
use crate::arenad::observability::ArenadObservability;
use crate::proto::{self, FrameError, Opcode, Status};
use crate::store::{HolderId, StoreError};

/// Why a connection ended early; each becomes an error frame before close.
pub(super) enum Fatal {
    Frame(FrameError),
    /// A protocol error in a request whose header named this opcode and id.
    Request(Opcode, u64, FrameError),
    Store(Opcode, u64, StoreError),
    Auth(&'static str),
    Hello(Status, String),
    /// A request of a version-1 session on a volume whose epoch was raised
    /// after its HELLO: version 1 has no `STALE_EPOCH`, so the request is
    /// answered `VERSION_MISMATCH` (under its own opcode and id) and the
    /// session ends.
    NeedsVersion2(Opcode, u64, String),
    /// Closed before sending a byte.
    Probe,
    Epoch(EpochError),
    /// A task serving the connection failed inside the server (a store
    /// call panicked, the blocking pool declined it): the server's fault,
    /// not the peer's.
    Internal(String),
    Io(io::Error),
}

impl From<FrameError> for Fatal {
    fn from(e: FrameError) -> Self {
        Fatal::Frame(e)
    }
}
impl From<ReadError> for Fatal {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => Fatal::Io(e),
            ReadError::Frame(e) => Fatal::Frame(e),
            ReadError::Request(op, id, e) => Fatal::Request(op, id, e),
        }
    }
}
impl From<io::Error> for Fatal {
    fn from(e: io::Error) -> Self {
        Fatal::Io(e)
    }
}

impl Fatal {
    /// The protocol-error class this is counted and logged as; `None` for
    /// an end that is no protocol error (the peer went away, a probe, a
    /// failed authentication, a fault of the server's).
    fn class(&self) -> Option<ProtocolErrorClass> {
        Some(match self {
            Fatal::Frame(FrameError::Io(_)) | Fatal::Request(_, _, FrameError::Io(_)) => {
                return None
            }
            Fatal::Frame(e) | Fatal::Request(_, _, e) => e.class(),
            // A lease the session does not hold, or a range outside the blob.
            Fatal::Store(..) => ProtocolErrorClass::Sequence,
            Fatal::Hello(Status::VersionMismatch, _) | Fatal::NeedsVersion2(..) => {
                ProtocolErrorClass::Version
            }
            Fatal::Hello(..) => ProtocolErrorClass::Other,
            Fatal::Auth(_) | Fatal::Probe | Fatal::Epoch(_) | Fatal::Internal(_) | Fatal::Io(_) => {
                return None
            }
        })
    }

    /// Counts (in `obs`) and logs the error that ends a connection; returns
    /// the error frame that answers it (empty when the peer just went
    /// away). A protocol error is counted and logged under one class.
    /// Logs name the peer's address where an operator needs it (refused
    /// handshakes); metrics never do.
    pub(super) fn report(
        self,
        obs: &ArenadObservability,
        id: HolderId,
        peer: SocketAddr,
    ) -> Vec<u8> {
        let class = self.class();
        if let Some(c) = class {
            obs.protocol_error(c);
        }
        let class = class.map_or("", ProtocolErrorClass::as_str);
        let mut frame = Vec::new();
        match self {
            Fatal::Io(e)
            | Fatal::Frame(FrameError::Io(e))
            | Fatal::Request(_, _, FrameError::Io(e)) => {
                debug!(event = ublk_metrics::events::PEER_DISCONNECTED, conn = id, error = %e);
            }
            Fatal::Probe => {
                obs.probe();
                debug!(event = events::CONNECTION_PROBE, conn = id);
            }
            Fatal::Frame(e) => {
                warn!(event = events::PROTOCOL_ERROR, conn = id, class, error = %e);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::Protocol,
                    &e.to_string(),
                );
            }
            Fatal::Request(op, request_id, e) => {
                warn!(event = events::PROTOCOL_ERROR, conn = id, class, op = op.name(), request_id, error = %e);
                proto::encode_error(&mut frame, op, request_id, Status::Protocol, &e.to_string());
            }
            Fatal::Store(op, request_id, e) => {
                warn!(event = events::PROTOCOL_ERROR, conn = id, class, op = op.name(), request_id, error = %e);
                proto::encode_error(&mut frame, op, request_id, Status::Protocol, &e.to_string());
            }
            Fatal::NeedsVersion2(op, request_id, msg) => {
                warn!(event = events::PROTOCOL_ERROR, conn = id, class, op = op.name(), request_id, error = %msg);
                proto::encode_error(&mut frame, op, request_id, Status::VersionMismatch, &msg);
            }
            Fatal::Auth(why) => {
                obs.auth_failed();
                warn!(event = events::AUTH_FAILED, conn = id, peer = %peer, reason = why);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::AuthFailed,
                    "authentication failed",
                );
            }
            Fatal::Hello(status, msg) => {
                obs.hello_refused(status);
                warn!(event = events::HELLO_REFUSED, conn = id, peer = %peer, status = status.name(), class, detail = %msg);
                proto::encode_error(&mut frame, Opcode::Hello, 0, status, &msg);
            }
            Fatal::Internal(what) => {
                tracing::error!(event = events::CONNECTION_INTERNAL_ERROR, conn = id, error = %what);
                proto::encode_error(&mut frame, Opcode::Hello, 0, Status::Internal, &what);
            }
            Fatal::Epoch(e) => {
                warn!(event = events::EPOCH_PERSIST_FAILED, conn = id, error = %e);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::Internal,
                    &e.to_string(),
                );
            }
        }
        frame
    }
}
