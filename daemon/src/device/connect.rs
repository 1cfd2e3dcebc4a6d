//! Opening a device's arena sessions to one peer: one per queue (with the
//! queue's tag buffers registered once for RDMA), plus, for a member of a
//! replicated volume, one background session (rebuild copies, epoch
//! changes). All sessions to one peer share one [`FlushDomain`]: a FLUSH on
//! any of them covers writes completed on all of them, and a peer restart
//! that lost writes is seen by all of them at once (what the replication
//! core's `MemberIo` requires). Sessions to different peers never share one.

use std::sync::Arc;
use std::time::Duration;

use target_rdma::auth::Secret;
use target_rdma::blob::{BlobIo, Transport as BlobTransport};
use target_rdma::client::{ArenaClient, ClientConfig, ClientStats, FlushDomain, Session};
use target_rdma::client::{
    RdmaConnectError, RdmaDriverStats, RdmaStats, RdmaTransport, RdmaTransportConfig,
    TransportGroup,
};
use target_rdma::rdma::{open_provider, RdmaMode};
use ublk_metrics::{DriverStats, TcpLinks};

use super::{DeviceError, DeviceSpec};
use crate::config::{RdmaConfig, TransportChoice, UblkdConfig};
use crate::queue_io::{register_buffers, QueueIo, TagBuffers};

/// What a device needs to open sessions, detached from the manager so a
/// device's rebuild thread can open fresh ones for a peer that came back.
#[derive(Clone)]
pub struct Connector {
    connect_timeout: Duration,
    request_timeout: Duration,
    busy_poll: Duration,
    rdma: RdmaConfig,
    tcp_links: Arc<TcpLinks>,
    /// Counts every session of the device, whichever peer it goes to.
    client_stats: Arc<ClientStats>,
    /// The device's RDMA queues (leases cached per connection; a FLUSH or
    /// DISCARD on one queue ends the other queues' affected leases).
    group: Arc<TransportGroup>,
}

/// The sessions opened to one peer.
pub struct PeerSessions {
    /// Session `q` serves queue `q`, its tag buffers registered.
    pub queues: Vec<Session>,
    /// The background session, when asked for.
    pub background: Option<Session>,
}

impl PeerSessions {
    /// Every session, queues first.
    pub fn all(&self) -> impl Iterator<Item = &Session> {
        self.queues.iter().chain(self.background.as_ref())
    }
}

impl Connector {
    /// A connector with `cfg`'s timeouts and RDMA device, counting into
    /// fresh statistics.
    pub fn new(cfg: &UblkdConfig, tcp_links: Arc<TcpLinks>) -> Self {
        Self {
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
            request_timeout: Duration::from_millis(cfg.request_timeout_ms),
            busy_poll: cfg.busy_poll(),
            rdma: cfg.rdma.clone(),
            tcp_links,
            client_stats: Arc::new(ClientStats::default()),
            group: TransportGroup::new(),
        }
    }

    /// Opens `spec`'s sessions to `peer` on its transport: one per entry of
    /// `bufs` (a queue's tag buffers), and a background one when
    /// `background`. `rdma` fails unless every session negotiated RDMA;
    /// `auto` takes RDMA where it can and TCP otherwise (TCP only for a
    /// confidential device, whose sessions are sealed). With `driven`, a
    /// TCP queue session's answers, or an RDMA queue session's completions,
    /// are reaped on its queue's ring (queue.rs) instead of by a thread of
    /// their own (an RDMA session's control stream keeps its reader
    /// thread: its rail is set up at connect, before the queue's ring
    /// runs): only for a volume on one peer, whose
    /// sessions all exist when the queues start (a replicated volume gains
    /// members' sessions later, from the rebuild thread, with no ring to
    /// drive them).
    pub fn connect(
        &self,
        spec: &DeviceSpec,
        peer: &str,
        secret: &Secret,
        bufs: &[Arc<TagBuffers>],
        background: bool,
        driven: bool,
    ) -> Result<PeerSessions, DeviceError> {
        let flush_domain = Arc::new(FlushDomain::default());
        let client_cfg = || self.client_config(spec, peer, secret, &flush_domain);
        let count = bufs.len() + usize::from(background);
        let mut sessions = Vec::with_capacity(count);
        // A confidential device never opens an RDMA provider: its `auto`
        // is TCP, its `rdma` refused (a definition edited by hand).
        spec.check_transport()?;
        let mode = match spec.effective_transport() {
            TransportChoice::Tcp => None,
            TransportChoice::Rdma => Some(RdmaMode::On),
            TransportChoice::Auto => Some(RdmaMode::Auto),
        };
        match mode {
            None => {
                for i in 0..count {
                    let cc = ClientConfig {
                        driven: driven && i < bufs.len(),
                        busy_poll: self.busy_poll,
                        ..client_cfg()
                    };
                    sessions.push(Session::Tcp(ArenaClient::connect(cc)?));
                }
            }
            Some(mode) => {
                // Each rail's device; a missing one leaves its rail off
                // (`rdma` needs one rail at least).
                let mut devices = Vec::new();
                for sel in self.rdma.selectors() {
                    devices.push(
                        open_provider(RdmaMode::Auto, &sel)
                            .map_err(|e| DeviceError::RdmaUnavailable(e.to_string()))?,
                    );
                }
                if mode == RdmaMode::On && devices.iter().all(Result::is_err) {
                    let why: Vec<String> = devices.into_iter().filter_map(Result::err).collect();
                    return Err(DeviceError::RdmaUnavailable(format!(
                        "no RDMA device: {}",
                        why.join("; ")
                    )));
                }
                let cfg = RdmaTransportConfig {
                    // Every payload ublkd moves comes from a tag buffer:
                    // larger ones cannot exist, and the bounce pool only
                    // serves the zero-fill writes of partial
                    // DISCARD/WRITE_ZEROES ranges (and rebuild copies).
                    buffer_bytes: spec.io_buf as u32,
                    pool_buffers: 4,
                    sq_depth: (spec.depth * 2).clamp(16, 256),
                    op_timeout: self.rdma.transfer_timeout(self.request_timeout),
                    stripe_bytes: self.rdma.stripe_bytes as u32,
                    require_rdma: spec.transport == TransportChoice::Rdma,
                    // A replicated writer's lanes present a new epoch one
                    // by one, and a raise ends the leases of every session
                    // still below it (the RDMA fence): cached dirty leases
                    // of the writer's own lanes would die at its own raise.
                    // Uncached, a lease lives for one request, and a raise
                    // between its ALLOC and COMMIT answers STALE_EPOCH,
                    // which the replication core sends again under the new
                    // view.
                    lease_cache: if spec.replicas.is_some() {
                        0
                    } else {
                        self.rdma.lease_cache()
                    },
                    busy_poll: self.busy_poll,
                    ..RdmaTransportConfig::default()
                };
                for i in 0..count {
                    let cfg = RdmaTransportConfig {
                        driven: driven && i < bufs.len(),
                        ..cfg.clone()
                    };
                    let t = RdmaTransport::connect(client_cfg(), devices.clone(), cfg).map_err(
                        |e| match e {
                            RdmaConnectError::Arena(e) => DeviceError::Arena(e),
                            e @ RdmaConnectError::Unavailable { .. } => {
                                DeviceError::RdmaUnavailable(e.to_string())
                            }
                        },
                    )?;
                    if let Some(b) = bufs.get(i) {
                        register_buffers(&t, b);
                    }
                    sessions.push(Session::rdma(t, &self.group));
                }
            }
        }
        let background = if background { sessions.pop() } else { None };
        Ok(PeerSessions {
            queues: sessions,
            background,
        })
    }

    fn client_config(
        &self,
        spec: &DeviceSpec,
        peer: &str,
        secret: &Secret,
        flush_domain: &Arc<FlushDomain>,
    ) -> ClientConfig {
        let mut cc = ClientConfig::new(peer.to_owned(), spec.volume.clone(), secret.clone());
        cc.flush_domain = Arc::clone(flush_domain);
        cc.stats = Arc::clone(&self.client_stats);
        cc.tcp_links = Arc::clone(&self.tcp_links);
        cc.blob_bytes = spec.blob_size as u32;
        cc.connect_timeout = self.connect_timeout;
        cc.request_timeout = self.request_timeout;
        // Every session of a confidential volume, whichever peer, queue or
        // purpose (rebuild copies, a resize's HELLO), speaks version 3.
        cc.confidential = spec.confidential;
        cc
    }

    /// The peer's answer to a fresh HELLO for `spec`'s volume (over TCP,
    /// closed at once): its quota as the peer holds it now, which the
    /// sessions' own answers, given when they connected, may predate.
    pub fn hello(
        &self,
        spec: &DeviceSpec,
        secret: &Secret,
    ) -> Result<target_rdma::proto::Welcome, DeviceError> {
        let cc = self.client_config(spec, &spec.peer, secret, &Arc::default());
        Ok(ArenaClient::connect(cc)?.welcome()?)
    }
}

/// The driver statistics of a device's queues: its RDMA transports' and
/// the device's client counters, or the client counters alone on TCP.
pub fn driver_stats(ios: &[QueueIo], connector: &Connector) -> Arc<dyn DriverStats> {
    let sessions: Vec<&Session> = ios.iter().flat_map(QueueIo::sessions).collect();
    let rdma: Vec<Arc<RdmaStats>> = sessions.iter().filter_map(|s| s.rdma_stats()).collect();
    if rdma.is_empty() {
        return Arc::clone(&connector.client_stats) as Arc<dyn DriverStats>;
    }
    let all_rdma = sessions
        .iter()
        .all(|s| s.transport() == BlobTransport::Rdma);
    Arc::new(RdmaDriverStats::new(
        if all_rdma { "rdma" } else { "tcp" },
        rdma,
        Arc::clone(&connector.client_stats),
    ))
}
