//! [`ClientConfig`]: where and how an [`ArenaClient`](super::ArenaClient)
//! connects.

use std::sync::Arc;
use std::time::Duration;

use ublk_metrics::TcpLinks;

use super::durability::FlushDomain;
use super::stats::ClientStats;
use crate::auth::Secret;
use crate::proto;

/// Where and how to connect.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// `host:port` of `arenad`.
    pub peer: String,
    /// Volume to open.
    pub volume: String,
    /// The volume's secret.
    pub secret: Secret,
    /// Blob size the caller was built for; 0 accepts the volume's.
    pub blob_bytes: u32,
    /// Limit for TCP connect plus handshake.
    pub connect_timeout: Duration,
    /// Limit for each request, from send to answer.
    pub request_timeout: Duration,
    /// What the connection did; shared by a device's connections. `new`
    /// gives each config counters of its own.
    pub stats: Arc<ClientStats>,
    /// Offer `CAP_RDMA` in HELLO (the RDMA transport sets it).
    pub offer_rdma: bool,
    /// The writes a FLUSH through this client vouches for; see
    /// [`FlushDomain`]. `new` gives each config a domain of its own.
    pub flush_domain: Arc<FlushDomain>,
    /// Where the connections' TCP_INFO goes (ublkd: the process's, which
    /// it exports); `new` gives each config one of its own.
    pub tcp_links: Arc<TcpLinks>,
    /// The writer's membership epoch for the volume, presented in HELLO
    /// (protocol version 2): a peer refuses the data operations of a
    /// session whose epoch is below the volume's with `STALE_EPOCH`.
    /// [`ArenaClient::raise_epoch`] raises it for later connections too.
    pub epoch: u64,
    /// The protocol versions this client accepts for a session that is not
    /// confidential; it takes the newest the peer offers, up to version 2.
    /// Version 1 has no frame tags and no epochs: only for talking to an
    /// arenad that predates version 2 (or measuring what the tags cost),
    /// never as a default (a peer, or anyone on the path, could otherwise
    /// talk a client down to it).
    pub versions: std::ops::RangeInclusive<u8>,
    /// The volume's payloads must not cross the network readable: the
    /// session speaks version 3 (every frame body sealed with AES-256-GCM)
    /// or fails, and asks for no RDMA (which moves payloads in the clear).
    pub confidential: bool,
    /// Answers are read by the owner's loop, which must run the client's
    /// [`ArenaClient::driver`], instead of a reader thread per connection.
    pub driven: bool,
    /// Driven: how long the driver keeps reading the socket for the answer
    /// to a request in flight before it waits for the socket on the ring
    /// (zero: waits at once).
    pub busy_poll: Duration,
}

impl ClientConfig {
    /// A config with 5 s connect and 30 s request timeouts.
    pub fn new(peer: impl Into<String>, volume: impl Into<String>, secret: Secret) -> Self {
        Self {
            peer: peer.into(),
            volume: volume.into(),
            secret,
            blob_bytes: 0,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            stats: Arc::default(),
            offer_rdma: false,
            flush_domain: Arc::default(),
            tcp_links: Arc::default(),
            epoch: 0,
            versions: proto::VERSION_2..=proto::VERSION_2,
            confidential: false,
            driven: false,
            busy_poll: Duration::ZERO,
        }
    }
}
