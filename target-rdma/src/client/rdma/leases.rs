//! [`Leases`]: a transport's leases at the peer. It asks for them
//! (GET/ALLOC) and ends them (COMMIT/RELEASE) on the control connection,
//! keeps them across requests in the [`LeaseCache`], gives back what the
//! peer revokes, and waits out BUSY answers that our own leases may cause
//! ([`OwnLeases`]), giving back the idle cached leases of the transport's
//! whole group first.
//!
//! The group is reached through [`Member`]: what a transport is to the
//! lease mechanism of itself and of the other transports of its device.

use std::sync::Arc;

use parking_lot::Mutex;

use super::busy::{AfterBusy, BusyRetry, OwnLeases};
use super::lease_cache::{CachedLease, Checkout, HeldLease, LeaseCache, Revoke};
use super::stats::RdmaStats;
use crate::blob::ArenaError;
use crate::client::tcp::ArenaClient;
use crate::proto::{Lease, Status};

/// A transport as the leases of its group see it: a BUSY answer gives
/// back the idle cached leases of every member, a FLUSH commits their
/// dirty ones and a REMOVE ends theirs in its range.
pub(super) trait Member: Send + Sync {
    /// Its control connection.
    fn client(&self) -> &ArenaClient;
    /// Its leases.
    fn leases(&self) -> &Leases;
    /// The other members of its group.
    fn others(&self) -> Vec<Arc<dyn Member>>;
}

/// What a lease is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Want {
    /// Writing (ALLOC).
    Write,
    /// Reading (GET): a blob in swap is faulted in first.
    Read,
    /// Reading part of the blob, if it is in the peer's RAM
    /// (GET_RESIDENT): a blob in swap only answers [`Status::Cold`].
    ReadIfResident,
}

/// The leases of one transport.
pub(super) struct Leases {
    cache: Mutex<LeaseCache>,
    /// Our leases at the peer: a BUSY peer (every slot pinned) may be
    /// pinned by them, so a BUSY request waits for one to end and retries.
    pinned: Mutex<OwnLeases>,
    stats: Arc<RdmaStats>,
}

impl Leases {
    /// Leases of a transport that caches at most `capacity` of them.
    pub(super) fn new(capacity: usize, stats: Arc<RdmaStats>) -> Self {
        Self {
            cache: Mutex::new(LeaseCache::new(capacity)),
            pinned: Mutex::new(OwnLeases::default()),
            stats,
        }
    }

    /// Gives back leases the peer revoked (now, or when their last user ends).
    pub(super) async fn honour_revocations(&self, client: &ArenaClient) {
        let revoked = client.take_revocations();
        let mut end = Vec::new();
        {
            let mut c = self.cache.lock();
            for (key, token) in revoked {
                let (what, e) = c.revoke(key, token);
                if what != Revoke::Unknown {
                    self.stats.inc(|s| &s.lease_revocations);
                }
                end.extend(e.map(|e| (key, e)));
            }
        }
        for (key, e) in end {
            let _ = self.end_cached(client, key, e).await;
        }
    }

    pub(super) async fn end_cached(
        &self,
        client: &ArenaClient,
        key: u64,
        e: CachedLease,
    ) -> Result<(), ArenaError> {
        if client.connection_epoch() != Some(e.epoch) {
            // The connection that held it is gone; the peer released it and
            // kept what was written.
            self.lease_ended();
            return Ok(());
        }
        self.end_lease(client, key, e.lease, e.write).await
    }

    async fn end_lease(
        &self,
        client: &ArenaClient,
        key: u64,
        lease: Lease,
        write: bool,
    ) -> Result<(), ArenaError> {
        let r = if write {
            client.commit(key, lease.token).await
        } else {
            client.release(&[lease.token]).await
        };
        // Ended either way: a failed COMMIT/RELEASE means the connection
        // (and every lease on it) is gone.
        self.lease_ended();
        if r.is_err() {
            self.stats.inc(|s| &s.lease_failures);
        }
        r
    }

    /// A lease on `key` as `want` says, for `me`, the transport that holds
    /// these leases (a cached one for reading serves any read).
    /// `Ok(None)`: a read of a blob that does not exist; a
    /// [`Status::Cold`] error: [`Want::ReadIfResident`] of a blob in swap
    /// only, which the peer leases no slot for (its range is read inline).
    pub(super) async fn lease(
        &self,
        me: &dyn Member,
        key: u64,
        want: Want,
    ) -> Result<Option<HeldLease>, ArenaError> {
        let write = want == Want::Write;
        let client = me.client();
        let epoch = client.connection_epoch().unwrap_or(0);
        let checkout = self.cache.lock().checkout(key, write, epoch);
        let generation = match checkout {
            Checkout::Hit(held) => {
                self.stats.inc(|s| &s.lease_cache_hits);
                return Ok(Some(held));
            }
            Checkout::Miss {
                generation,
                dropped_stale,
            } => {
                if dropped_stale {
                    self.lease_ended();
                }
                generation
            }
        };
        let mut busy = self.busy_start(true);
        let lease = loop {
            let r = match want {
                Want::Write => client.alloc(key).await.map(Some),
                Want::Read => client.get(key).await,
                Want::ReadIfResident => client.get_resident(key).await,
            };
            let e = match r {
                Ok(Some(l)) => break l,
                Ok(None) => {
                    self.lease_ended();
                    return Ok(None);
                }
                // In swap only: the caller reads its range inline.
                Err(e) if e.status() == Some(Status::Cold) => {
                    self.lease_ended();
                    return Err(e);
                }
                Err(e) if e.status() == Some(Status::Busy) => {
                    if self.busy_retry(me, &mut busy).await {
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
        let (cached, evicted) = self
            .cache
            .lock()
            .insert(key, lease, write, epoch, generation);
        if let Some((k, e)) = evicted {
            let _ = self.end_cached(client, k, e).await;
        }
        Ok(Some(HeldLease {
            key,
            lease,
            cached,
            write,
        }))
    }

    /// Sends a payload inline on TCP (`send`, on `me`'s control
    /// connection), and again after each BUSY answer for as long as
    /// [`busy_retry`](Self::busy_retry) says to (our own leases may be what
    /// pins the peer's slots).
    pub(super) async fn until_not_busy<T>(
        &self,
        me: &dyn Member,
        mut send: impl AsyncFnMut() -> Result<T, ArenaError>,
    ) -> Result<T, ArenaError> {
        let mut busy = self.busy_start(false);
        loop {
            match send().await {
                Err(e)
                    if e.status() == Some(Status::Busy) && self.busy_retry(me, &mut busy).await => {
                }
                r => return r,
            }
        }
    }

    /// Call before a request that may be answered BUSY (see
    /// [`OwnLeases::start`]).
    fn busy_start(&self, pinning: bool) -> BusyRetry {
        self.pinned.lock().start(pinning)
    }

    /// After a BUSY answer: whether to send the request again. Idle cached
    /// leases of `me`'s group go back first; otherwise the request waits
    /// for a lease of ours to end or go idle. `false` when we hold none:
    /// another client pins the arena, and BUSY is the answer.
    async fn busy_retry(&self, me: &dyn Member, busy: &mut BusyRetry) -> bool {
        let refused = self.pinned.lock().refused(busy);
        refused.wake();
        let mut ended = 0;
        for t in me.others().iter().map(|t| &**t).chain([me]) {
            ended += t.leases().end_idle_cached(t.client()).await;
        }
        if ended == 0 {
            let next = self.pinned.lock().after_busy(busy);
            match next {
                AfterBusy::GiveUp => return false,
                AfterBusy::Retry => {}
                AfterBusy::Wait(rx) => {
                    let _ = rx.await;
                }
            }
        }
        self.pinned.lock().resume(busy);
        true
    }

    /// A lease of ours ended at the peer, or a request for one got none.
    fn lease_ended(&self) {
        let wake = self.pinned.lock().ended();
        wake.wake();
    }

    /// Ends every idle cached lease; returns how many.
    async fn end_idle_cached(&self, client: &ArenaClient) -> usize {
        let victims = self.cache.lock().take_idle();
        let ended = victims.len();
        for (k, e) in victims {
            let _ = self.end_cached(client, k, e).await;
        }
        ended
    }

    /// Gives back a lease that is of no use for RDMA (its per-lease key
    /// died with the rail it was registered for, or it has none): it takes
    /// no new users and is ended once idle, not cached again.
    pub(super) async fn give_back(&self, client: &ArenaClient, held: HeldLease) {
        self.cache.lock().revoke(held.key, held.lease.token);
        let _ = self.unlease(client, held, false).await;
    }

    /// [`Self::give_back`], then leases the key anew (its key is of the
    /// current rail); `None` when that fails.
    pub(super) async fn relet(
        &self,
        me: &dyn Member,
        held: HeldLease,
        write: bool,
    ) -> Option<HeldLease> {
        let key = held.key;
        self.give_back(me.client(), held).await;
        let want = if write { Want::Write } else { Want::Read };
        self.lease(me, key, want).await.ok().flatten()
    }

    /// Ends a request's use of its lease; `wrote` after a successful write.
    pub(super) async fn unlease(
        &self,
        client: &ArenaClient,
        held: HeldLease,
        wrote: bool,
    ) -> Result<(), ArenaError> {
        let r = self.unlease_inner(client, held, wrote).await;
        // Its lease ended or went idle in the cache: a BUSY request can
        // now get a slot, or shrink the cache to free one.
        let wake = self.pinned.lock().changed();
        wake.wake();
        r
    }

    async fn unlease_inner(
        &self,
        client: &ArenaClient,
        held: HeldLease,
        wrote: bool,
    ) -> Result<(), ArenaError> {
        if !held.cached {
            return self
                .end_lease(client, held.key, held.lease, held.write)
                .await;
        }
        let (found, end) = self.cache.lock().checkin(&held, wrote);
        if found && wrote {
            client.record_acknowledged_write();
        }
        match end {
            Some(e) => self.end_cached(client, held.key, e).await,
            None => Ok(()),
        }
    }

    /// Ends every cached lease `pick` selects, waiting for leases in use to
    /// go idle first (they take no new users meanwhile). `commit` false
    /// releases write leases instead of committing them.
    async fn end_cached_where(
        &self,
        client: &ArenaClient,
        pick: impl Fn(u64, &CachedLease) -> bool,
        commit: bool,
    ) -> Result<(), ArenaError> {
        loop {
            let (ready, wait) = self.cache.lock().drain_where(&pick);
            for (k, e) in ready {
                let mut e = e;
                if !commit {
                    e.write = false;
                }
                self.end_cached(client, k, e).await?;
            }
            match wait {
                Some(rx) => {
                    let _ = rx.await;
                }
                None => return Ok(()),
            }
        }
    }

    /// Before a FLUSH: COMMITs the dirty cached leases (written through
    /// since granted), so the peer's FLUSH covers their writes.
    pub(super) async fn commit_dirty(&self, client: &ArenaClient) -> Result<(), ArenaError> {
        self.end_cached_where(client, |_, e| e.dirty, true).await
    }

    /// Before a REMOVE of `start..end`: ends the cached leases in the range
    /// without committing what the blobs are about to lose.
    pub(super) async fn forget_range(
        &self,
        client: &ArenaClient,
        start: u64,
        end: u64,
    ) -> Result<(), ArenaError> {
        self.end_cached_where(client, |k, _| (start..end).contains(&k), false)
            .await
    }

    /// A new rail isolated per lease replaced the old one: every cached
    /// lease is retired (see [`LeaseCache::retire_all`]); the idle ones,
    /// to be ended now, are returned.
    pub(super) fn retire_all(&self) -> Vec<(u64, CachedLease)> {
        self.cache.lock().retire_all()
    }

    /// A REMOVE starts: leases granted from now on are not cached.
    pub(super) fn remove_started(&self) {
        self.cache.lock().remove_started();
    }

    /// A REMOVE ended: so are leases asked for while it ran.
    pub(super) fn remove_ended(&self) {
        self.cache.lock().remove_ended();
    }
}
