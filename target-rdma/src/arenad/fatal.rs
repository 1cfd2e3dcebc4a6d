//! Why a connection ends early, and how each reason is counted, logged and
//! answered with an error frame before the close.

use std::io;
use std::net::SocketAddr;

use tracing::{debug, warn};

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
    /// Counts (in `obs`) and logs the error that ends a connection; returns
    /// the error frame that answers it (empty when the peer just went
    /// away). Logs name the peer's address where an operator needs it
    /// (refused handshakes); metrics never do.
    pub(super) fn report(
        self,
        obs: &ArenadObservability,
        id: HolderId,
        peer: SocketAddr,
    ) -> Vec<u8> {
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
                obs.frame_error(&e);
                warn!(event = events::PROTOCOL_ERROR, conn = id, class = e.class(), error = %e);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::Protocol,
                    &e.to_string(),
                );
            }
            Fatal::Request(op, request_id, e) => {
                obs.frame_error(&e);
                warn!(event = events::PROTOCOL_ERROR, conn = id, class = e.class(), op = op.name(), request_id, error = %e);
                proto::encode_error(&mut frame, op, request_id, Status::Protocol, &e.to_string());
            }
            Fatal::Store(op, request_id, e) => {
                warn!(event = events::PROTOCOL_ERROR, conn = id, class = "bad_lease_or_range", op = op.name(), error = %e);
                proto::encode_error(&mut frame, op, request_id, Status::Protocol, &e.to_string());
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
                warn!(event = events::HELLO_REFUSED, conn = id, peer = %peer, status = status.name(), detail = %msg);
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
