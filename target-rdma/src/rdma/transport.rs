//! `RdmaTransport`: blob payloads by one-sided RDMA into the peer's arena,
//! with the control stream ([`ArenaClient`]) for leases and the counted TCP
//! inline path as fallback.
//!
//! One transport per ublk queue: one control connection, one QP (a *rail*),
//! one registered buffer pool. A request leases the blob's slot (GET/ALLOC,
//! or a cached lease), moves its byte range with RDMA READ/WRITE at
//! `arena_base + slot_offset + offset`, then ends the lease (RELEASE/COMMIT)
//! unless it is cached. Many requests are in flight at once, bounded by the
//! send queue depth; nothing holds a lock across an await.
//!
//! Local memory: a buffer inside a region registered with
//! [`RdmaTransport::register_io_buffers`] (ublkd's I/O buffers) is used in
//! place, no copy. Other memory goes through a pool buffer (registered once,
//! one copy, counted as a bounce), or, when the pool is exhausted, is
//! registered for that one request (counted). What cannot go by RDMA goes
//! inline on TCP and is counted by [`TcpReason`].
//!
//! The transports of one block device form a [`TransportGroup`]: leases are
//! cached per connection, but a FLUSH or DISCARD on one queue concerns the
//! blobs every queue writes, so it first ends the other members' affected
//! cached leases.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use super::completion::{CompletionEngine, OpError};
use super::stats::{RdmaStats, TcpReason};
use super::{MemoryRegion, QueuePair, RdmaError, RdmaOp, RdmaProvider, WorkRequest};
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::client::{ArenaClient, ClientConfig};
use crate::proto::{Lease, Opcode, RailAccept, Status, CAP_RDMA};

/// Tuning of one RDMA transport.
#[derive(Clone, Debug)]
pub struct RdmaTransportConfig {
    /// Payloads smaller than this go inline on TCP: one control round trip
    /// costs more than the copy.
    pub min_rdma_bytes: u32,
    /// Size of one pool buffer; larger payloads go inline on TCP.
    pub buffer_bytes: u32,
    /// Pool buffers (registered once, as one region).
    pub pool_buffers: u32,
    /// Send queue depth: RDMA requests in flight at once.
    pub sq_depth: u32,
    /// Limit for one RDMA READ/WRITE, from post to completion.
    pub op_timeout: Duration,
    /// Leases kept across requests (hot blobs skip the control round trip).
    /// Each pins an arena slot, so keep it well below the arena's slots.
    pub lease_cache: usize,
    /// `transport = rdma`: fail at connect unless RDMA is negotiated.
    pub require_rdma: bool,
}

impl Default for RdmaTransportConfig {
    fn default() -> Self {
        Self {
            min_rdma_bytes: 512,
            buffer_bytes: 1 << 20,
            pool_buffers: 32,
            sq_depth: 64,
            op_timeout: Duration::from_secs(5),
            lease_cache: 64,
            require_rdma: false,
        }
    }
}

/// Why an RDMA transport could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RdmaConnectError {
    /// The control connection failed.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// `transport = rdma` and RDMA could not be negotiated.
    #[error("transport = rdma but RDMA to arena peer {peer} is unavailable: {reason}")]
    Unavailable {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
}

/// Registered memory owned by the transport, handed out one buffer at a time.
struct Pool {
    // Deregistered before the memory is freed.
    mr: MemoryRegion,
    mem: *mut [u8],
    buffer_bytes: usize,
    free: Mutex<Vec<usize>>,
}

// SAFETY: the pool memory is only reached through raw pointers of buffers
// handed out exclusively (one index to one user at a time, under `free`).
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl Pool {
    fn new(
        provider: &dyn RdmaProvider,
        buffers: u32,
        buffer_bytes: u32,
    ) -> Result<Self, RdmaError> {
        let len = buffers as usize * buffer_bytes as usize;
        let mem = Box::into_raw(vec![0u8; len].into_boxed_slice());
        // SAFETY: `mem` is a live allocation of `len` bytes, freed in Drop
        // only after the region (declared first) is deregistered.
        let mr = match unsafe { provider.register(mem.cast::<u8>(), len, false) } {
            Ok(mr) => mr,
            Err(e) => {
                // SAFETY: `mem` came from Box::into_raw above and was not shared.
                drop(unsafe { Box::from_raw(mem) });
                return Err(e);
            }
        };
        Ok(Self {
            mr,
            mem,
            buffer_bytes: buffer_bytes as usize,
            free: Mutex::new((0..buffers as usize).collect()),
        })
    }

    fn take(&self) -> Option<usize> {
        self.free.lock().pop()
    }

    fn addr(&self, i: usize) -> usize {
        self.mr.addr + i * self.buffer_bytes
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: `mem` came from Box::into_raw in `new`; every buffer user
        // borrowed the pool, so none is left.
        drop(unsafe { Box::from_raw(self.mem) });
    }
}

/// One QP brought up against the peer on one control connection.
struct Rail {
    engine: Arc<CompletionEngine>,
    remote: RailAccept,
    epoch: u64,
}

impl Drop for Rail {
    fn drop(&mut self) {
        self.engine.shutdown();
    }
}

enum RailState {
    Up(Arc<Rail>),
    /// Being (re-)established by one request; others go to TCP meanwhile.
    Connecting,
    /// Down; the next attempt is allowed from this instant.
    Down(Instant),
    /// RDMA will not be used on this transport.
    Off(TcpReason, String),
}

struct CachedLease {
    lease: Lease,
    write: bool,
    dirty: bool,
    users: u32,
    epoch: u64,
    /// Revoked by the peer: no new users; the last one to leave ends it.
    revoked: bool,
    /// A FLUSH or REMOVE waits to end it itself: no new users.
    draining: bool,
    last_use: u64,
    idle: Vec<oneshot::Sender<()>>,
}

#[derive(Default)]
struct LeaseCache {
    map: HashMap<u64, CachedLease>,
    tick: u64,
    /// Bumped when a REMOVE starts and when it ends: a lease asked for
    /// before may cover a removed blob, so it is used once, not cached.
    generation: u64,
    /// REMOVEs in progress: a lease granted meanwhile may cover a blob the
    /// REMOVE is about to drop, so none is cached.
    removing: u32,
}

/// The RDMA transports of one block device, one per queue.
///
/// Each member caches leases on its own connection, but a block FLUSH covers
/// writes completed on every queue and a DISCARD removes blobs that any
/// queue's cached lease may point at. So a member's FLUSH first COMMITs the
/// dirty cached leases of all members, and its REMOVE first ends every
/// member's cached leases in the range (after their current users). A BUSY
/// member also gives back the idle cached leases of the others.
#[derive(Default)]
pub struct TransportGroup {
    members: Mutex<Vec<Weak<RdmaTransport>>>,
}

impl TransportGroup {
    /// An empty group.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    fn others(&self, me: &RdmaTransport) -> Vec<Arc<RdmaTransport>> {
        let mut m = self.members.lock();
        m.retain(|w| w.strong_count() > 0);
        m.iter()
            .filter_map(Weak::upgrade)
            .filter(|t| !std::ptr::eq(Arc::as_ptr(t), me))
            .collect()
    }
}

/// A lease held for one request: cached (shared) or owned by it.
struct HeldLease {
    key: u64,
    lease: Lease,
    cached: bool,
    write: bool,
}

/// Local memory for one transfer.
enum Local<'a> {
    Region { lkey: u32, addr: usize },
    Pool { pool: &'a Pool, index: usize },
    PerOp(MemoryRegion),
}

impl Local<'_> {
    fn lkey_addr(&self) -> (u32, usize) {
        match self {
            Local::Region { lkey, addr } => (*lkey, *addr),
            Local::Pool { pool, index } => (pool.mr.lkey, pool.addr(*index)),
            Local::PerOp(mr) => (mr.lkey, mr.addr),
        }
    }
}

/// Returns a pool buffer when the transfer is over.
struct PoolGuard<'a> {
    pool: &'a Pool,
    index: usize,
    stats: &'a RdmaStats,
}

impl Drop for PoolGuard<'_> {
    fn drop(&mut self) {
        self.pool.free.lock().push(self.index);
        self.stats.pool_return();
    }
}

/// Fails the QP if a request is abandoned (its future dropped) mid-flight,
/// so the device stops touching the buffer the request no longer owns.
struct InFlight<'a> {
    engine: &'a CompletionEngine,
    done: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.engine.fail("a request was abandoned while in flight");
        }
    }
}

/// The RDMA data path of one queue. See the module docs.
pub struct RdmaTransport {
    client: ArenaClient,
    provider: Option<Arc<dyn RdmaProvider>>,
    cfg: RdmaTransportConfig,
    stats: Arc<RdmaStats>,
    rail: Mutex<RailState>,
    leases: Mutex<LeaseCache>,
    // Regions and pool are dropped after `rail` (its QP) is gone.
    regions: Mutex<Vec<MemoryRegion>>,
    pool: Option<Pool>,
    slots: Semaphore,
    /// Our leases at the peer: a BUSY peer (every slot pinned) may be
    /// pinned by them, so a BUSY request waits for one to end and retries.
    pinned: Mutex<OwnLeases>,
    peer: String,
    group: OnceLock<Arc<TransportGroup>>,
}

/// The leases this transport may hold at the peer: granted ones (in use or
/// cached) and ones being asked for.
#[derive(Default)]
struct OwnLeases {
    held: usize,
    /// Leases ended so far: a BUSY answer that raced with an end is retried
    /// even when nothing is held any more.
    ended: u64,
    /// BUSY requests waiting for a lease to end or go idle.
    waiters: Vec<oneshot::Sender<()>>,
}

/// Where a request stands in answering BUSY peers (see [`RdmaTransport::busy_retry`]).
struct BusyRetry {
    pinning: bool,
    ended_before: u64,
}

/// Times a write is done again because a racing REMOVE took its blob
/// between ALLOC and COMMIT; a fourth loss fails the request.
const MAX_LEASE_LOST: u32 = 3;

/// How long a failed rail setup keeps requests on TCP before the next try.
const RAIL_RETRY: Duration = Duration::from_secs(1);

impl RdmaTransport {
    /// Connects the control stream and, when both sides can, brings up the
    /// rail. `provider` is the local device, or why there is none.
    /// With `require_rdma` a missing rail is an error; otherwise the
    /// transport serves TCP and says why in [`rdma_status`](Self::rdma_status).
    pub fn connect(
        mut client_cfg: ClientConfig,
        provider: Result<Arc<dyn RdmaProvider>, String>,
        cfg: RdmaTransportConfig,
    ) -> Result<Self, RdmaConnectError> {
        let peer = client_cfg.peer.clone();
        client_cfg.offer_rdma = provider.is_ok();
        let client = ArenaClient::connect(client_cfg)?;
        let stats = Arc::new(RdmaStats::default());
        let (provider, state) = match provider {
            Ok(p) => (Some(p), RailState::Down(Instant::now())),
            Err(why) => (
                None,
                RailState::Off(
                    TcpReason::NoLocalDevice,
                    format!("no local RDMA device: {why}"),
                ),
            ),
        };
        let mut state = state;
        if provider.is_some() && client.welcome()?.caps & CAP_RDMA == 0 {
            state = RailState::Off(
                TcpReason::Declined,
                "the arena peer declined RDMA (no RDMA device there)".into(),
            );
        }
        let pool = match (&provider, &state) {
            (Some(p), RailState::Down(_)) => {
                match Pool::new(p.as_ref(), cfg.pool_buffers, cfg.buffer_bytes) {
                    Ok(pool) => {
                        stats
                            .pool_buffers
                            .store(cfg.pool_buffers.into(), Ordering::Relaxed);
                        Some(pool)
                    }
                    Err(e) => {
                        stats.inc(|s| &s.registration_failures);
                        state = RailState::Off(TcpReason::RegistrationFailed, e.to_string());
                        None
                    }
                }
            }
            _ => None,
        };
        let t = Self {
            client,
            provider,
            slots: Semaphore::new(cfg.sq_depth as usize),
            cfg,
            stats,
            rail: Mutex::new(state),
            leases: Mutex::new(LeaseCache::default()),
            regions: Mutex::new(Vec::new()),
            pool,
            pinned: Mutex::new(OwnLeases::default()),
            peer,
            group: OnceLock::new(),
        };
        if matches!(*t.rail.lock(), RailState::Down(_)) {
            if let Err(e) = futures::executor::block_on(t.establish()) {
                *t.rail.lock() = RailState::Off(TcpReason::Declined, e);
            }
        }
        match (&*t.rail.lock(), t.cfg.require_rdma) {
            (RailState::Off(_, why), true) => {
                return Err(RdmaConnectError::Unavailable {
                    peer: t.peer.clone(),
                    reason: why.clone(),
                })
            }
            (RailState::Off(_, why), false) => {
                info!(event = "rdma.unavailable", peer = %t.peer, reason = %why, "payloads go over TCP");
            }
            _ => {}
        }
        Ok(t)
    }

    /// Registers memory the caller will pass to reads and writes (ublkd's
    /// per-queue I/O buffers), so those transfers need no copy.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must stay valid until the transport is dropped,
    /// and the caller must not touch a buffer while a request using it runs.
    pub unsafe fn register_io_buffers(&self, addr: *mut u8, len: usize) -> Result<(), RdmaError> {
        let Some(p) = &self.provider else {
            return Err(RdmaError::NoDevice {
                detail: "this transport has no RDMA device".into(),
            });
        };
        // SAFETY: forwarded contract: valid until the transport (which owns
        // the region, dropped after its QP) is dropped.
        let mr = unsafe { p.register(addr, len, false) }
            .inspect_err(|_| self.stats.inc(|s| &s.registration_failures))?;
        // Sorted by address, so a transfer finds its region by binary search
        // (a queue registers one region per tag).
        let mut regions = self.regions.lock();
        let at = regions.partition_point(|r| r.addr < mr.addr);
        regions.insert(at, mr);
        Ok(())
    }

    /// Makes this transport a member of `group` (the other queues of its
    /// device). A transport joins at most one group; later calls are ignored.
    pub fn join(self: &Arc<Self>, group: &Arc<TransportGroup>) {
        if self.group.set(Arc::clone(group)).is_ok() {
            group.members.lock().push(Arc::downgrade(self));
        }
    }

    /// The other members of this transport's group.
    fn others(&self) -> Vec<Arc<RdmaTransport>> {
        self.group.get().map_or_else(Vec::new, |g| g.others(self))
    }

    /// The driver statistics (shared; cheap to read at any time).
    pub fn stats(&self) -> &Arc<RdmaStats> {
        &self.stats
    }

    /// `Ok(device)` while payloads go by RDMA, or why they go over TCP.
    pub fn rdma_status(&self) -> Result<String, String> {
        match &*self.rail.lock() {
            RailState::Off(_, why) => Err(why.clone()),
            _ => Ok(self
                .provider
                .as_ref()
                .map(|p| p.device_name())
                .unwrap_or_default()),
        }
    }

    /// Whether payloads go by RDMA (the rail is up, or down and being
    /// re-established); `false` when this transport serves TCP only. Cheap:
    /// no allocation, one short lock.
    pub fn uses_rdma(&self) -> bool {
        !matches!(*self.rail.lock(), RailState::Off(..))
    }

    /// The control-stream client (leases, inline fallback).
    pub fn client(&self) -> &ArenaClient {
        &self.client
    }

    /// Brings up a new rail on the current control connection.
    async fn establish(&self) -> Result<Arc<Rail>, String> {
        let r = self.try_establish().await;
        let mut st = self.rail.lock();
        match &r {
            Ok(rail) => {
                self.stats.inc(|s| &s.rail_connects);
                *st = RailState::Up(Arc::clone(rail));
            }
            Err(e) => {
                self.stats.inc(|s| &s.rail_connect_failures);
                warn!(event = "rdma.rail_failed", peer = %self.peer, error = %e);
                if !matches!(*st, RailState::Off(..)) {
                    *st = RailState::Down(Instant::now() + RAIL_RETRY);
                }
            }
        }
        r
    }

    async fn try_establish(&self) -> Result<Arc<Rail>, String> {
        let provider = self.provider.as_ref().ok_or("no local RDMA device")?;
        let qp: Arc<dyn QueuePair> = provider
            .create_qp(self.cfg.sq_depth)
            .map_err(|e| e.to_string())?
            .into();
        let before = self.client.connection_epoch();
        let acc = self
            .client
            .rail_connect(qp.endpoint())
            .await
            .map_err(|e| e.to_string())?;
        let epoch = self.client.connection_epoch();
        if before != epoch || epoch.is_none() {
            return Err("the control connection changed during the rail setup".into());
        }
        let blob = u64::from(self.client.session_blob_bytes());
        if acc.arena_len < blob {
            self.stats.inc(|s| &s.rdma_protocol_errors);
            return Err(format!(
                "peer's arena region of {} bytes is smaller than a blob",
                acc.arena_len
            ));
        }
        qp.connect(&acc.endpoint).map_err(|e| e.to_string())?;
        let engine = CompletionEngine::new(
            qp,
            self.cfg.sq_depth,
            self.cfg.op_timeout,
            Arc::clone(&self.stats),
        );
        engine.spawn().map_err(|e| e.to_string())?;
        info!(event = "rdma.rail_up", peer = %self.peer, device = %provider.device_name());
        Ok(Arc::new(Rail {
            engine,
            remote: acc,
            epoch: epoch.unwrap_or(0),
        }))
    }

    /// The rail to use for a payload of `len` bytes, or why to use TCP.
    async fn route(&self, len: usize) -> Result<Arc<Rail>, TcpReason> {
        if len < self.cfg.min_rdma_bytes as usize {
            return Err(TcpReason::BelowThreshold);
        }
        let epoch = self.client.connection_epoch();
        {
            let mut st = self.rail.lock();
            match &*st {
                RailState::Off(reason, _) => return Err(*reason),
                RailState::Up(rail)
                    if rail.engine.broken().is_none() && Some(rail.epoch) == epoch =>
                {
                    if len > self.cfg.buffer_bytes as usize {
                        return Err(TcpReason::TooLarge);
                    }
                    return Ok(Arc::clone(rail));
                }
                RailState::Connecting => return Err(TcpReason::QpError),
                RailState::Down(at) if Instant::now() < *at => return Err(TcpReason::QpError),
                _ => *st = RailState::Connecting,
            }
        }
        // The old rail (if any) was dropped above: its QP is torn down.
        let rail = self.establish().await.map_err(|_| TcpReason::QpError)?;
        if len > self.cfg.buffer_bytes as usize {
            return Err(TcpReason::TooLarge);
        }
        Ok(rail)
    }

    /// Gives back leases the peer revoked (now, or when their last user ends).
    async fn honour_revocations(&self) {
        let revoked = self.client.take_revocations();
        let mut end = Vec::new();
        {
            let mut c = self.leases.lock();
            for (key, token) in revoked {
                let Some(e) = c.map.get_mut(&key).filter(|e| e.lease.token == token) else {
                    continue;
                };
                self.stats.inc(|s| &s.lease_revocations);
                if e.users == 0 {
                    end.extend(c.map.remove(&key).map(|e| (key, e)));
                } else {
                    e.revoked = true;
                }
            }
        }
        for (key, e) in end {
            let _ = self.end_cached(key, e).await;
        }
    }

    async fn end_cached(&self, key: u64, e: CachedLease) -> Result<(), ArenaError> {
        if self.client.connection_epoch() != Some(e.epoch) {
            // The connection that held it is gone; the peer released it and
            // kept what was written.
            self.lease_ended();
            return Ok(());
        }
        self.end_lease(key, e.lease, e.write).await
    }

    async fn end_lease(&self, key: u64, lease: Lease, write: bool) -> Result<(), ArenaError> {
        let r = if write {
            self.client.commit(key, lease.token).await
        } else {
            self.client.release(&[lease.token]).await
        };
        // Ended either way: a failed COMMIT/RELEASE means the connection
        // (and every lease on it) is gone.
        self.lease_ended();
        if r.is_err() {
            self.stats.inc(|s| &s.lease_failures);
        }
        r
    }

    /// A lease on `key` good for reading (any) or writing (ALLOC).
    /// `Ok(None)`: a read of a blob that does not exist.
    async fn lease(&self, key: u64, write: bool) -> Result<Option<HeldLease>, ArenaError> {
        let epoch = self.client.connection_epoch().unwrap_or(0);
        // A lease asked for from here on is cached only if no REMOVE starts
        // or ends before it is granted.
        let generation = {
            let mut c = self.leases.lock();
            c.tick += 1;
            let tick = c.tick;
            if let Some(e) = c.map.get_mut(&key) {
                if e.epoch != epoch {
                    c.map.remove(&key);
                    self.lease_ended();
                } else if !e.revoked && !e.draining && (e.write || !write) {
                    e.users += 1;
                    e.last_use = tick;
                    self.stats.inc(|s| &s.lease_cache_hits);
                    return Ok(Some(HeldLease {
                        key,
                        lease: e.lease,
                        cached: true,
                        write: e.write,
                    }));
                }
            }
            c.generation
        };
        let mut busy = self.busy_start(true);
        let lease = loop {
            let r = if write {
                self.client.alloc(key).await.map(Some)
            } else {
                self.client.get(key).await
            };
            let e = match r {
                Ok(Some(l)) => break l,
                Ok(None) => {
                    self.lease_ended();
                    return Ok(None);
                }
                Err(e) if e.status() == Some(Status::Busy) => {
                    if self.busy_retry(&mut busy).await {
                        continue;
                    }
                    e
                }
                Err(e) => {
                    self.lease_ended();
                    e
                }
            };
            self.stats.inc(|s| {
                if write {
                    &s.alloc_failures
                } else {
                    &s.lease_failures
                }
            });
            return Err(e);
        };
        let cached = self
            .cache_insert(key, lease, write, epoch, generation)
            .await;
        Ok(Some(HeldLease {
            key,
            lease,
            cached,
            write,
        }))
    }

    /// Caches a fresh lease (in use once) if there is room or an idle entry
    /// to evict, and no range was forgotten since it was asked for.
    async fn cache_insert(
        &self,
        key: u64,
        lease: Lease,
        write: bool,
        epoch: u64,
        generation: u64,
    ) -> bool {
        if self.cfg.lease_cache == 0 {
            return false;
        }
        let evicted = {
            let mut c = self.leases.lock();
            if c.map.contains_key(&key) || c.generation != generation || c.removing > 0 {
                return false;
            }
            let mut evicted = None;
            if c.map.len() >= self.cfg.lease_cache {
                let victim = c
                    .map
                    .iter()
                    .filter(|(_, e)| e.users == 0)
                    .min_by_key(|(_, e)| e.last_use)
                    .map(|(k, _)| *k);
                match victim {
                    Some(k) => evicted = c.map.remove(&k).map(|e| (k, e)),
                    None => return false,
                }
            }
            let tick = c.tick;
            c.map.insert(
                key,
                CachedLease {
                    lease,
                    write,
                    dirty: false,
                    users: 1,
                    epoch,
                    revoked: false,
                    draining: false,
                    last_use: tick,
                    idle: Vec::new(),
                },
            );
            evicted
        };
        if let Some((k, e)) = evicted {
            let _ = self.end_cached(k, e).await;
        }
        true
    }

    /// Call before a request that may be answered BUSY. `pinning`: the
    /// request asks for a lease (ALLOC/GET), so until answered it may pin a
    /// slot; it counts as held from now on.
    fn busy_start(&self, pinning: bool) -> BusyRetry {
        let mut own = self.pinned.lock();
        own.held += usize::from(pinning);
        BusyRetry {
            pinning,
            ended_before: own.ended,
        }
    }

    /// After a BUSY answer: whether to send the request again. Idle cached
    /// leases of ours go back first; otherwise the request waits for a
    /// lease of ours to end or go idle. `false` when we hold none: another
    /// client pins the arena, and BUSY is the answer. A pinning request
    /// counts as held again exactly when this returns `true`.
    async fn busy_retry(&self, busy: &mut BusyRetry) -> bool {
        if busy.pinning {
            // Refused, so it pins nothing; whoever waits on it rechecks.
            self.pinned_changed(|own| own.held -= 1);
        }
        let mut ended = 0;
        for t in self.others().iter().map(|t| &**t).chain([self]) {
            ended += t.end_idle_cached().await;
        }
        if ended == 0 {
            let rx = {
                let mut own = self.pinned.lock();
                if own.ended != busy.ended_before {
                    None
                } else if own.held == 0 {
                    return false;
                } else {
                    let (tx, rx) = oneshot::channel();
                    own.waiters.push(tx);
                    Some(rx)
                }
            };
            if let Some(rx) = rx {
                let _ = rx.await;
            }
        }
        let mut own = self.pinned.lock();
        own.held += usize::from(busy.pinning);
        busy.ended_before = own.ended;
        true
    }

    /// A lease of ours ended at the peer, or a request for one got none.
    fn lease_ended(&self) {
        self.pinned_changed(|own| {
            own.held = own.held.saturating_sub(1);
            own.ended += 1;
        });
    }

    /// Applies `change` to our lease count and wakes every BUSY request
    /// waiting on it to look again.
    fn pinned_changed(&self, change: impl FnOnce(&mut OwnLeases)) {
        let waiters = {
            let mut own = self.pinned.lock();
            change(&mut own);
            std::mem::take(&mut own.waiters)
        };
        for tx in waiters {
            let _ = tx.send(());
        }
    }

    /// Ends every idle cached lease; returns how many.
    async fn end_idle_cached(&self) -> usize {
        let victims: Vec<(u64, CachedLease)> = self
            .leases
            .lock()
            .map
            .extract_if(|_, e| e.users == 0)
            .collect();
        let ended = victims.len();
        for (k, e) in victims {
            let _ = self.end_cached(k, e).await;
        }
        ended
    }

    /// Ends a request's use of its lease; `wrote` after a successful write.
    async fn unlease(&self, held: HeldLease, wrote: bool) -> Result<(), ArenaError> {
        let r = self.unlease_inner(held, wrote).await;
        // Its lease ended or went idle in the cache: a BUSY request can
        // now get a slot, or shrink the cache to free one.
        self.pinned_changed(|_| {});
        r
    }

    async fn unlease_inner(&self, held: HeldLease, wrote: bool) -> Result<(), ArenaError> {
        if !held.cached {
            return self.end_lease(held.key, held.lease, held.write).await;
        }
        let end = {
            let mut c = self.leases.lock();
            let Some(e) = c
                .map
                .get_mut(&held.key)
                .filter(|e| e.lease.token == held.lease.token)
            else {
                return Ok(());
            };
            e.users -= 1;
            if wrote {
                e.dirty = true;
                self.client.record_acknowledged_write();
            }
            if e.users == 0 {
                for tx in e.idle.drain(..) {
                    let _ = tx.send(());
                }
            }
            if e.users == 0 && e.revoked && !e.draining {
                c.map.remove(&held.key)
            } else {
                None
            }
        };
        match end {
            Some(e) => self.end_cached(held.key, e).await,
            None => Ok(()),
        }
    }

    /// Local memory for `len` bytes at `addr`, in place when registered.
    fn local(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<(Local<'_>, Option<PoolGuard<'_>>), TcpReason> {
        let found = {
            let regions = self.regions.lock();
            // The last region starting at or before `addr` is the only candidate.
            let i = regions.partition_point(|r| r.addr <= addr);
            i.checked_sub(1)
                .map(|i| &regions[i])
                .filter(|r| r.contains(addr, len))
                .map(|r| r.lkey)
        };
        if let Some(lkey) = found {
            self.stats.inc(|s| &s.registrations_pooled);
            return Ok((Local::Region { lkey, addr }, None));
        }
        if let Some((pool, index)) = self.pool.as_ref().and_then(|p| p.take().map(|i| (p, i))) {
            self.stats.pool_take();
            self.stats.inc(|s| &s.registrations_pooled);
            self.stats.inc(|s| &s.bounce_copies);
            let guard = PoolGuard {
                pool,
                index,
                stats: &self.stats,
            };
            return Ok((Local::Pool { pool, index }, Some(guard)));
        }
        let p = self.provider.as_ref().ok_or(TcpReason::NoLocalDevice)?;
        // SAFETY: the caller's buffer outlives the request, whose future
        // borrows it; an abandoned request fails the QP (InFlight) before
        // the borrow ends, and the region is dropped when the request ends.
        match unsafe { p.register(addr as *mut u8, len, false) } {
            Ok(mr) => {
                self.stats.inc(|s| &s.registrations_per_op);
                Ok((Local::PerOp(mr), None))
            }
            Err(e) => {
                self.stats.inc(|s| &s.registration_failures);
                warn!(event = "rdma.register_failed", error = %e);
                Err(TcpReason::RegistrationFailed)
            }
        }
    }

    /// One RDMA transfer of `len` bytes between `local` and the leased slot.
    async fn transfer(
        &self,
        rail: &Rail,
        op: RdmaOp,
        lease: &Lease,
        offset: u32,
        local: &Local<'_>,
        len: usize,
    ) -> Result<(), OpError> {
        let remote = lease.slot_offset + u64::from(offset);
        if remote.saturating_add(len as u64) > rail.remote.arena_len {
            self.stats.inc(|s| &s.rdma_protocol_errors);
            return Err(OpError::QpDown(format!(
                "lease slot offset {} + {offset} + {len} lies outside the peer's {}-byte arena",
                lease.slot_offset, rail.remote.arena_len
            )));
        }
        let (lkey, addr) = local.lkey_addr();
        let _permit = self
            .slots
            .acquire()
            .await
            .map_err(|_| OpError::QpDown("transport closed".into()))?;
        let wr = WorkRequest {
            wr_id: 0,
            op,
            local_addr: addr as u64,
            lkey,
            len: len as u32,
            remote_addr: rail.remote.arena_base + remote,
            rkey: rail.remote.rkey,
        };
        let rx = rail
            .engine
            .submit(wr)
            .inspect_err(|_| self.stats.inc_op(op, |s| &s.rdma_failed, |o| &o.failed))?;
        let mut guard = InFlight {
            engine: &rail.engine,
            done: false,
        };
        let r = rx
            .await
            .unwrap_or_else(|_| Err(OpError::QpDown("completion thread gone".into())));
        guard.done = true;
        match &r {
            Ok(()) => {
                self.stats
                    .inc_op(op, |s| &s.rdma_transferred, |o| &o.transferred);
                let bytes = if op == RdmaOp::Read {
                    &self.stats.bytes_read
                } else {
                    &self.stats.bytes_written
                };
                bytes.fetch_add(len as u64, Ordering::Relaxed);
            }
            Err(OpError::TimedOut(_)) => {
                self.stats
                    .inc_op(op, |s| &s.rdma_timed_out, |o| &o.timed_out)
            }
            Err(_) => self.stats.inc_op(op, |s| &s.rdma_failed, |o| &o.failed),
        }
        r
    }

    /// Moves a range by RDMA, retrying once over a re-established rail.
    /// `Err(reason)` sends the request to TCP (a failover after an attempt
    /// was made is counted as declined).
    async fn rdma_move(
        &self,
        op: RdmaOp,
        key: u64,
        offset: u32,
        addr: usize,
        len: usize,
        copy_in: Option<&[u8]>,
    ) -> Result<Option<MoveDone<'_>>, Route> {
        let mut rail = self.route(len).await.map_err(|reason| Route::Tcp {
            reason,
            failover: false,
        })?;
        let held = match self.lease(key, op == RdmaOp::Write).await {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(None),
            Err(e) if e.status() == Some(Status::Busy) => {
                return Err(Route::Tcp {
                    reason: TcpReason::ArenaBusy,
                    failover: false,
                })
            }
            Err(e) => return Err(Route::Failed(e)),
        };
        let mut attempted = false;
        let result = loop {
            let (local, guard) = match self.local(addr, len) {
                Ok(l) => l,
                Err(reason) => break Err(reason),
            };
            if let (Local::Pool { pool, index }, Some(src)) = (&local, copy_in) {
                // SAFETY: the pool buffer `index` is ours alone until `guard`
                // drops, and `src.len() == len <= buffer_bytes`.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), pool.addr(*index) as *mut u8, len)
                };
            }
            match self
                .transfer(&rail, op, &held.lease, offset, &local, len)
                .await
            {
                Ok(()) => break Ok((local, guard)),
                Err(e) => {
                    warn!(event = "rdma.attempt_failed", op = ?op, error = %e, retry = !attempted);
                    if attempted {
                        break Err(TcpReason::QpError);
                    }
                    attempted = true;
                    drop((local, guard));
                    match self.route(len).await {
                        Ok(r) if self.client.connection_epoch() == Some(rail.epoch) => rail = r,
                        _ => break Err(TcpReason::QpError),
                    }
                }
            }
        };
        match result {
            Ok((local, guard)) => Ok(Some(MoveDone {
                held,
                local_copy: match (&local, op) {
                    (Local::Pool { pool, index }, RdmaOp::Read) => Some(pool.addr(*index)),
                    _ => None,
                },
                _keep: (local_drop(local), guard),
            })),
            Err(reason) => {
                if attempted {
                    self.stats.inc_op(op, |s| &s.rdma_declined, |o| &o.declined);
                }
                // A write lease must still end; the TCP path then writes the range.
                let _ = self.unlease(held, false).await;
                Err(Route::Tcp {
                    reason,
                    failover: attempted,
                })
            }
        }
    }
}

/// Keeps a per-op registration alive until the copy-out is done.
fn local_drop(local: Local<'_>) -> Option<MemoryRegion> {
    match local {
        Local::PerOp(mr) => Some(mr),
        _ => None,
    }
}

struct MoveDone<'a> {
    held: HeldLease,
    /// Pool buffer address to copy a READ's bytes out of.
    local_copy: Option<usize>,
    _keep: (Option<MemoryRegion>, Option<PoolGuard<'a>>),
}

enum Route {
    /// Serve it inline on TCP; `failover` when an RDMA attempt failed first.
    Tcp {
        reason: TcpReason,
        failover: bool,
    },
    Failed(ArenaError),
}

/// How a payload that went inline on TCP went: a failover when an RDMA
/// attempt failed first.
fn tcp_via(failover: bool) -> Via {
    if failover {
        Via::Failover
    } else {
        Via::Tcp
    }
}

impl RdmaTransport {
    /// Refuses a range past the blob's end as the peer would (PROTOCOL), before
    /// any lease is asked for.
    fn check_range(&self, op: Opcode, offset: u32, len: usize) -> Result<(), ArenaError> {
        let blob = self.blob_bytes();
        if (offset as usize).saturating_add(len) > blob as usize {
            return Err(ArenaError::Status {
                op,
                peer: self.peer.clone(),
                status: Status::Protocol,
                message: format!(
                    "byte range at offset {offset} of length {len} exceeds the blob size {blob}"
                ),
            });
        }
        Ok(())
    }

    async fn read_via(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        self.check_range(Opcode::Read, offset, out.len())?;
        self.honour_revocations().await;
        let len = out.len();
        match self
            .rdma_move(
                RdmaOp::Read,
                key,
                offset,
                out.as_mut_ptr() as usize,
                len,
                None,
            )
            .await
        {
            Ok(None) => {
                out.fill(0);
                Ok(Via::Nothing)
            }
            Ok(Some(done)) => {
                if let Some(src) = done.local_copy {
                    // SAFETY: the pool buffer is still ours (`done` holds its
                    // guard), the READ completed, and `len` fits it.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), len)
                    };
                }
                let MoveDone { held, _keep, .. } = done;
                drop(_keep);
                self.unlease(held, false).await?;
                Ok(Via::Rdma)
            }
            Err(Route::Failed(e)) => Err(e),
            Err(Route::Tcp { reason, failover }) => {
                self.stats.tcp_payload(RdmaOp::Read, reason, len);
                let mut busy = self.busy_start(false);
                let found = loop {
                    match self.client.read(key, offset, out).await {
                        Err(e)
                            if e.status() == Some(Status::Busy)
                                && self.busy_retry(&mut busy).await => {}
                        r => break r?,
                    }
                };
                // A failover counts even when the blob went away meanwhile.
                Ok(match (found, failover) {
                    (false, false) => Via::Nothing,
                    _ => tcp_via(failover),
                })
            }
        }
    }

    async fn write_via(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        self.check_range(Opcode::Write, offset, data.len())?;
        let mut lost = 0;
        loop {
            self.honour_revocations().await;
            match self.write_once(key, offset, data).await {
                // Another connection removed the blob between our ALLOC and
                // COMMIT (a DISCARD racing this write): the write counts as
                // before the remove, so it is done again, after it.
                Err(e) if e.status() == Some(Status::LeaseLost) && lost < MAX_LEASE_LOST => {
                    lost += 1;
                    debug!(event = "rdma.lease_lost", key, attempt = lost);
                }
                r => return r,
            }
        }
    }

    async fn write_once(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        match self
            .rdma_move(
                RdmaOp::Write,
                key,
                offset,
                data.as_ptr() as usize,
                data.len(),
                Some(data),
            )
            .await
        {
            Ok(Some(done)) => {
                let MoveDone { held, _keep, .. } = done;
                drop(_keep);
                self.unlease(held, true).await.map(|()| Via::Rdma)
            }
            Ok(None) => unreachable_alloc(key),
            Err(Route::Failed(e)) => Err(e),
            Err(Route::Tcp { reason, failover }) => {
                self.stats.tcp_payload(RdmaOp::Write, reason, data.len());
                let mut busy = self.busy_start(false);
                loop {
                    match self.client.write(key, offset, data).await {
                        Err(e)
                            if e.status() == Some(Status::Busy)
                                && self.busy_retry(&mut busy).await => {}
                        r => break r?,
                    }
                }
                Ok(tcp_via(failover))
            }
        }
    }
}

impl BlobIo for RdmaTransport {
    fn transport(&self) -> Transport {
        if self.uses_rdma() {
            Transport::Rdma
        } else {
            Transport::Tcp
        }
    }

    fn blob_bytes(&self) -> u32 {
        self.client.session_blob_bytes()
    }

    fn read(
        &self,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> impl Future<Output = Result<Via, ArenaError>> {
        self.read_via(key, offset, out)
    }

    fn write(
        &self,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> impl Future<Output = Result<Via, ArenaError>> {
        self.write_via(key, offset, data)
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        self.honour_revocations().await;
        // Leases on removed blobs would outlive them, on any queue: keep
        // leases granted until the REMOVE is done out of every cache, and
        // give the cached ones back first, without committing what the
        // blobs are about to lose.
        let others = self.others();
        let members: Vec<&RdmaTransport> = others.iter().map(|t| &**t).chain([self]).collect();
        let _removing = Removing::start(&members);
        for t in &members {
            t.end_cached_where(|k, _| (start..end).contains(&k), false)
                .await?;
        }
        self.client.remove(start, end).await
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        self.honour_revocations().await;
        // Writes acknowledged through cached leases, on any queue, are
        // COMMITted first, so the peer's FLUSH covers them.
        let others = self.others();
        for t in others.iter().map(|t| &**t).chain([self]) {
            t.end_cached_where(|_, e| e.dirty, true).await?;
        }
        self.client.flush().await
    }
}

impl RdmaTransport {
    /// Ends every cached lease `pick` selects, waiting for leases in use to
    /// go idle first (they take no new users meanwhile). `commit` false
    /// releases write leases instead of committing them.
    async fn end_cached_where(
        &self,
        pick: impl Fn(u64, &CachedLease) -> bool,
        commit: bool,
    ) -> Result<(), ArenaError> {
        loop {
            let (ready, wait) = {
                let mut c = self.leases.lock();
                let keys: Vec<u64> = c
                    .map
                    .iter()
                    .filter(|(k, e)| pick(**k, e))
                    .map(|(k, _)| *k)
                    .collect();
                let mut wait = None;
                let mut ready = Vec::new();
                for k in keys {
                    let e = c.map.get_mut(&k).expect("key listed above");
                    if e.users > 0 {
                        e.draining = true;
                        let (tx, rx) = oneshot::channel();
                        e.idle.push(tx);
                        wait = Some(rx);
                        break;
                    }
                    ready.extend(c.map.remove(&k).map(|e| (k, e)));
                }
                (ready, wait)
            };
            for (k, e) in ready {
                let e = if commit {
                    e
                } else {
                    CachedLease { write: false, ..e }
                };
                self.end_cached(k, e).await?;
            }
            match wait {
                Some(rx) => {
                    let _ = rx.await;
                }
                None => return Ok(()),
            }
        }
    }
}

/// Marks a REMOVE in progress on every member of a group, until dropped.
struct Removing<'a>(&'a [&'a RdmaTransport]);

impl<'a> Removing<'a> {
    fn start(members: &'a [&'a RdmaTransport]) -> Self {
        for t in members {
            let mut c = t.leases.lock();
            c.removing += 1;
            c.generation += 1;
        }
        Self(members)
    }
}

impl Drop for Removing<'_> {
    fn drop(&mut self) {
        for t in self.0 {
            let mut c = t.leases.lock();
            c.removing -= 1;
            c.generation += 1;
        }
    }
}

/// ALLOC always yields a lease; `Ok(None)` is only possible for reads.
fn unreachable_alloc(key: u64) -> Result<Via, ArenaError> {
    Err(ArenaError::Disconnected {
        peer: String::new(),
        detail: format!("ALLOC of key {key} answered without a lease"),
    })
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        // Tear the QP down before the pool and regions it may touch.
        *self.rail.lock() = RailState::Down(Instant::now());
    }
}
