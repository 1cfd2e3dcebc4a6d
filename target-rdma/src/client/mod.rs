//! The client side of the paging protocol: what ublkd runs to reach its
//! arena peer. [`tcp`] is the control connection (`ArenaClient`, payloads
//! inline), [`rdma`] the one-sided RDMA transport built on it, and
//! [`Session`] a queue's session over either, as one `BlobIo`.
//!
//! Nothing here names the server side (`store`, `arenad`): both sides meet
//! only in the shared vocabulary (`blob`, `proto`, `auth`, the verbs layer).

pub mod rdma;
pub mod tcp;

mod driven;
mod session;

pub use rdma::{
    RdmaConnectError, RdmaDriverStats, RdmaStats, RdmaTransport, RdmaTransportConfig, TcpReason,
    TransportGroup,
};
pub use session::Session;
pub use tcp::{ArenaClient, ClientConfig, ClientStats, FlushDomain, REASON_CONFIGURED_TCP};
