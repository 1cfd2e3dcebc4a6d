//! What the server serves and with which limits: the volumes with their
//! secrets, the limits every connection is held to, and the arena's RDMA
//! registration.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::arenad::lease_keys::{LeaseKey, LeaseKeys};
use crate::auth::Secret;
use crate::proto::{Endpoint, RailAccept, MAX_RAILS};
use crate::rdma::{Access, Domain, Isolation, MemoryRegion, QueuePair, RdmaError, RdmaProvider};
use crate::store::{Store, VolumeId};

/// A volume as the server knows it: its store id and its secret.
pub struct ServedVolume {
    /// Name clients open.
    pub name: String,
    /// Secret the HELLO MAC must be made with.
    pub secret: Secret,
    /// The store's id for it.
    pub id: VolumeId,
    /// Quota in blobs, reported in WELCOME.
    pub quota_blobs: u64,
    /// Only sealed sessions (protocol version 3) may open it.
    pub confidential: bool,
}

/// Limits the server enforces.
#[derive(Clone, Debug)]
pub struct ServerLimits {
    /// Most concurrent connections.
    pub max_connections: u32,
    /// Requests one connection may have in flight (announced in CHALLENGE);
    /// one more is a protocol error.
    pub max_inflight: u32,
    /// Time a connection has to complete its HELLO.
    pub handshake_timeout: Duration,
    /// Accept version-1 sessions (no frame tags, no epochs).
    pub allow_v1: bool,
    /// Most connections that have not completed their HELLO, within
    /// `max_connections`: what a flood of unauthenticated sockets can hold.
    pub max_unauthenticated: u32,
    /// Prefix length that groups IPv4 peers into one source of
    /// handshakes: a source holding the most of `max_unauthenticated`
    /// gives its oldest place to a source holding fewer.
    pub handshake_source_prefix_v4: u8,
    /// The same for IPv6 peers.
    pub handshake_source_prefix_v6: u8,
    /// Longest a batch of queued frames may take to reach the socket (a
    /// client that does not read its answers): past it the connection
    /// ends, and its leases with it.
    pub write_timeout: Duration,
    /// Most frames in one connection's outbound queue.
    pub max_queued_frames: usize,
    /// Most bytes in one connection's outbound queue, and of request
    /// bodies it has in flight.
    pub max_queued_bytes: usize,
    /// Threads of the blocking pool.
    pub blocking_threads: usize,
    /// GET_RESIDENTs that found a blob in swap only, while it is among the
    /// last found so, after which it is faulted in in the background (0:
    /// never).
    pub promote_cold_after: u32,
    /// Longest shutdown gives connections to finish and drain.
    pub shutdown_timeout: Duration,
}

/// The arena served over an RDMA device: what RAIL_CONNECT hands out, and
/// (isolated per lease) how each lease's key is registered.
pub struct ServerRdma {
    // Field order is drop order: the shared region is deregistered before
    // the provider (and its protection domain) goes, and before the store
    // (the arena's mapping) can.
    shared: Option<MemoryRegion>,
    provider: Arc<dyn RdmaProvider>,
    store: Arc<Store>,
    /// The arena: first byte and length.
    base: usize,
    len: usize,
    qp_depth: u32,
    isolation: Isolation,
    blob_bytes: usize,
}

impl ServerRdma {
    /// Serves `store`'s arena on `provider`. `Isolation::Lease` registers
    /// nothing yet (each session gets a protection domain of its own at
    /// RAIL_CONNECT, each lease a region in it; one domain is made now, so
    /// a device that cannot is a start error naming the alternative);
    /// `Isolation::Shared` registers the whole arena for remote read and
    /// write by everyone with its key.
    pub fn register(
        provider: Arc<dyn RdmaProvider>,
        store: &Arc<Store>,
        qp_depth: u32,
        isolation: Isolation,
    ) -> Result<Self, RdmaError> {
        let (base, len) = store.arena_region();
        let shared = match isolation {
            Isolation::Lease => {
                provider.new_domain().map_err(|e| RdmaError::Device {
                    device: provider.device_name(),
                    detail: format!(
                        "{e}: rdma_isolation = \"lease\" needs a protection domain per RDMA \
                         session (rdma_isolation = \"shared\" trusts every RDMA client with \
                         every volume)"
                    ),
                })?;
                None
            }
            Isolation::Shared => {
                // SAFETY: the arena mapping lives as long as the store,
                // which this holds (declared after the region, so dropped
                // later); remote access only touches slots leased to the
                // accessing client, which the store does not touch
                // meanwhile (a write-back copies a leased slot first):
                // clients are trusted with every volume in this mode
                // (OPERATIONS.md).
                let r = unsafe {
                    provider
                        .domain()
                        .register(base, len, Access::RemoteReadWrite)?
                };
                Some(r)
            }
        };
        Ok(Self {
            shared,
            provider,
            store: Arc::clone(store),
            base: base as usize,
            len,
            qp_depth,
            isolation,
            blob_bytes: store.blob_bytes() as usize,
        })
    }

    /// What the keys handed to sessions reach.
    pub fn isolation(&self) -> Isolation {
        self.isolation
    }

    /// Registers the key of a lease on the slot at `slot_offset` in a
    /// session's `domain`: exactly the slot, remote read, and remote write
    /// if `write` (an ALLOC lease).
    pub(super) fn key_slot(
        &self,
        domain: &dyn Domain,
        slot_offset: u64,
        write: bool,
    ) -> Result<LeaseKey, RdmaError> {
        let Some(off) = usize::try_from(slot_offset).ok().filter(|o| {
            o.checked_add(self.blob_bytes)
                .is_some_and(|e| e <= self.len)
        }) else {
            return Err(RdmaError::Register {
                addr: self.base,
                len: self.len,
                detail: format!("slot offset {slot_offset} lies outside the arena"),
            });
        };
        let access = if write {
            Access::RemoteReadWrite
        } else {
            Access::RemoteRead
        };
        // SAFETY: the range is one slot inside the arena mapping (checked
        // above), which lives as long as the store; the key holds the
        // store and drops it after the region. Remote access through the
        // key reaches only this slot, which the lease pins (the store does
        // not hand it to anyone else or evict it until the key is
        // deregistered, and copies it before writing it back).
        let mr = unsafe { domain.register((self.base + off) as *mut u8, self.blob_bytes, access)? };
        Ok(LeaseKey::new(mr, Arc::clone(&self.store) as _))
    }

    /// The device the arena is served on.
    pub fn device_name(&self) -> String {
        self.provider.device_name()
    }

    /// A rail for a client at `client`: a QP connected to it (isolated per
    /// lease, in a new protection domain of its own, returned for the
    /// session's keys) and the answer that names the arena.
    pub(super) fn accept(&self, client: &Endpoint) -> Result<Accepted, RdmaError> {
        let (domain, qp) = match self.isolation {
            Isolation::Lease => {
                let d = self.provider.new_domain()?;
                let qp = d.create_qp(self.qp_depth)?;
                (Some(d), qp)
            }
            Isolation::Shared => (None, self.provider.domain().create_qp(self.qp_depth)?),
        };
        qp.connect(client)?;
        let answer = RailAccept {
            endpoint: qp.endpoint(),
            arena_base: self.base as u64,
            arena_len: self.len as u64,
            // Isolated per lease there is no key to the whole arena: each
            // lease answer carries its own.
            rkey: self.shared.as_ref().map_or(0, |r| r.rkey),
        };
        Ok(Accepted { domain, qp, answer })
    }
}

/// A rail set up by [`ServerRdma::accept`].
pub(super) struct Accepted {
    pub(super) domain: Option<Arc<dyn Domain>>,
    pub(super) qp: Box<dyn QueuePair>,
    pub(super) answer: RailAccept,
}

/// The arena served over one RDMA device per rail (`rdma_device` names one
/// or two). A rail keeps its configured index when its device did not open
/// (`rdma = "auto"`), so a client's rail on a link still meets the
/// server's rail on that link.
#[derive(Default)]
pub struct ServedRails {
    rails: Vec<Option<ServerRdma>>,
}

impl ServedRails {
    /// Rails by index; `None` where the configured device did not open.
    /// At most [`MAX_RAILS`].
    pub fn new(rails: Vec<Option<ServerRdma>>) -> Result<Self, String> {
        if rails.len() > MAX_RAILS {
            return Err(format!(
                "{} RDMA devices named: at most {MAX_RAILS} rails are served",
                rails.len()
            ));
        }
        Ok(Self { rails })
    }

    /// One rail on `rdma`.
    pub fn one(rdma: ServerRdma) -> Self {
        Self {
            rails: vec![Some(rdma)],
        }
    }

    /// Rail `index`, when it is served.
    pub fn rail(&self, index: usize) -> Option<&ServerRdma> {
        self.rails.get(index)?.as_ref()
    }

    /// The rails served, with their indexes.
    pub fn served(&self) -> impl Iterator<Item = (usize, &ServerRdma)> {
        self.rails
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((i, r.as_ref()?)))
    }

    /// Rails configured (served or not).
    pub fn configured(&self) -> usize {
        self.rails.len()
    }

    /// What the keys handed to sessions reach (one setting for every
    /// rail); `None` when no rail is served (no RDMA).
    pub fn isolation(&self) -> Option<Isolation> {
        self.served().next().map(|(_, r)| r.isolation())
    }
}

/// A connection's RDMA state: whether its HELLO was granted `CAP_RDMA`
/// (whether its keys are per lease, whether it names rails), its QP on
/// each rail (replaced when the client re-establishes that rail) and its
/// lease keys with the rails' protection domains. Each has its own lock:
/// the store's force-end hook takes `keys` (under the store lock), never
/// `qps`.
pub(super) struct SessionRails {
    pub(super) granted: bool,
    /// Isolated per lease, and the client offered `CAP_RDMA_LEASE_KEYS`:
    /// each lease granted while a rail is up gets a key of its own there.
    pub(super) lease_keys: bool,
    /// Granted `CAP_RAILS`: RAIL_CONNECT names a rail, and lease answers
    /// carry a key per rail.
    pub(super) per_rail: bool,
    pub(super) keys: Mutex<LeaseKeys>,
    pub(super) qps: Mutex<[Option<Box<dyn QueuePair>>; MAX_RAILS]>,
}

impl SessionRails {
    /// A session's rails before RAIL_CONNECT.
    pub(super) fn new(granted: bool, lease_keys: bool, per_rail: bool) -> Self {
        Self {
            granted,
            lease_keys,
            per_rail,
            keys: Mutex::default(),
            qps: Mutex::default(),
        }
    }

    /// How many of its queue pairs are connected (RAIL_CONNECT done).
    pub(super) fn connected(&self) -> u32 {
        self.qps.lock().iter().filter(|q| q.is_some()).count() as u32
    }

    /// Ends every rail: every lease key deregistered, then the QPs failed
    /// and destroyed (their domains go with the last of them). Called when
    /// the session ends, before its leases are released (a RAIL_CONNECT
    /// does the same to the one rail it replaces).
    pub(super) fn close(&self) {
        for rail in 0..MAX_RAILS {
            LeaseKeys::clear(&self.keys, rail);
        }
        for qp in self.qps.lock().iter_mut().filter_map(Option::take) {
            qp.fail();
        }
    }
}
