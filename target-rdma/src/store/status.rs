//! How a store failure reads on the wire. One mapping, used by the server
//! for its answers and by the in-process transport for its errors, so a
//! client sees the same failure as the same status whatever carried it.

use super::StoreError;
use crate::proto::Status;

impl StoreError {
    /// The status a client is answered with. `Protocol` means the request
    /// itself was wrong (a lease it does not hold, a range past the blob);
    /// the server then ends the connection.
    pub fn status(&self) -> Status {
        match self {
            Self::NoSpace { .. } => Status::NoSpace,
            Self::QuotaExceeded { .. } => Status::QuotaExceeded,
            Self::Busy { .. } | Self::LeaseLimit { .. } | Self::Reclaiming { .. } => Status::Busy,
            Self::LeaseLost { .. } => Status::LeaseLost,
            Self::UnknownLease { .. } | Self::LeaseMismatch { .. } | Self::OutOfRange { .. } => {
                Status::Protocol
            }
            Self::UnknownVolume { .. }
            | Self::Io { .. }
            | Self::Uring { .. }
            | Self::ArenaMap { .. }
            | Self::Corrupt { .. }
            | Self::InvalidConfig { .. }
            | Self::Locked { .. }
            | Self::Integrity { .. }
            | Self::OldFormat { .. } => Status::Internal,
        }
    }
}
