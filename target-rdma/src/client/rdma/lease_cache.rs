//! The lease cache: leases kept across requests so hot blobs skip the
//! control round trip. A plain state machine (no I/O, no await); `Leases`
//! drives it and talks to the peer.
//!
//! A cached lease belongs to one control connection (its epoch) and has
//! users: while used it is not ended; revoked or drained it takes no new
//! users and the last one out ends it. A lease asked for while a REMOVE
//! starts or ends may cover a removed blob, so it is used once, not cached.

use std::collections::HashMap;

use futures::channel::oneshot;

use crate::proto::Lease;

/// A lease held for one request: cached (shared) or owned by it.
pub(super) struct HeldLease {
    pub(super) key: u64,
    pub(super) lease: Lease,
    pub(super) cached: bool,
    pub(super) write: bool,
}

/// One cached lease.
pub(super) struct CachedLease {
    pub(super) lease: Lease,
    pub(super) write: bool,
    /// Written through since granted: a FLUSH must COMMIT it.
    pub(super) dirty: bool,
    users: u32,
    pub(super) epoch: u64,
    /// Revoked by the peer: no new users; the last one to leave ends it.
    revoked: bool,
    /// A FLUSH or REMOVE waits to end it itself: no new users.
    draining: bool,
    last_use: u64,
    idle: Vec<oneshot::Sender<()>>,
}

/// What [`LeaseCache::checkout`] found.
pub(super) enum Checkout {
    /// A cached lease serves the request (one more user).
    Hit(HeldLease),
    /// Ask the peer; pass `generation` to [`LeaseCache::insert`].
    /// `dropped_stale`: a lease of an earlier connection was forgotten (the
    /// peer ended it with that connection).
    Miss {
        generation: u64,
        dropped_stale: bool,
    },
}

/// What [`LeaseCache::revoke`] did.
#[derive(Debug, PartialEq)]
pub(super) enum Revoke {
    /// Not a lease of ours (already ended, or never cached).
    Unknown,
    /// Idle: taken out, end it now.
    EndNow,
    /// In use: its last user ends it.
    WhenIdle,
}

/// The leases a transport keeps across requests.
pub(super) struct LeaseCache {
    map: HashMap<u64, CachedLease>,
    capacity: usize,
    tick: u64,
    /// Bumped when a REMOVE starts and when it ends.
    generation: u64,
    /// REMOVEs in progress: nothing granted meanwhile is cached.
    removing: u32,
}

impl LeaseCache {
    /// A cache of at most `capacity` leases (0 caches none).
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            map: HashMap::new(),
            capacity,
            tick: 0,
            generation: 0,
            removing: 0,
        }
    }

    /// A cached lease on `key` good for reading (any) or writing (an ALLOC
    /// one), on connection `epoch`.
    pub(super) fn checkout(&mut self, key: u64, write: bool, epoch: u64) -> Checkout {
        self.tick += 1;
        let tick = self.tick;
        let mut dropped_stale = false;
        if let Some(e) = self.map.get_mut(&key) {
            if e.epoch != epoch {
                self.map.remove(&key);
                dropped_stale = true;
            } else if !e.revoked && !e.draining && (e.write || !write) {
                e.users += 1;
                e.last_use = tick;
                return Checkout::Hit(HeldLease {
                    key,
                    lease: e.lease,
                    cached: true,
                    write: e.write,
                });
            }
        }
        Checkout::Miss {
            generation: self.generation,
            dropped_stale,
        }
    }

    /// Caches a lease just granted (in use once) if there is room or an
    /// idle entry to evict, and no REMOVE started or ended since it was
    /// asked for at `generation`. Returns whether it is cached, and the
    /// evicted entry to end.
    pub(super) fn insert(
        &mut self,
        key: u64,
        lease: Lease,
        write: bool,
        epoch: u64,
        generation: u64,
    ) -> (bool, Option<(u64, CachedLease)>) {
        if self.capacity == 0
            || self.map.contains_key(&key)
            || self.generation != generation
            || self.removing > 0
        {
            return (false, None);
        }
        let mut evicted = None;
        if self.map.len() >= self.capacity {
            let victim = self
                .map
                .iter()
                .filter(|(_, e)| e.users == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k);
            match victim {
                Some(k) => evicted = self.map.remove(&k).map(|e| (k, e)),
                None => return (false, None),
            }
        }
        self.map.insert(
            key,
            CachedLease {
                lease,
                write,
                dirty: false,
                users: 1,
                epoch,
                revoked: false,
                draining: false,
                last_use: self.tick,
                idle: Vec::new(),
            },
        );
        (true, evicted)
    }

    /// A request is done with cached lease `held`; `wrote` after a
    /// successful write. Returns whether the lease was still cached, and
    /// the entry to end when it was revoked and this was its last user.
    pub(super) fn checkin(&mut self, held: &HeldLease, wrote: bool) -> (bool, Option<CachedLease>) {
        let Some(e) = self
            .map
            .get_mut(&held.key)
            .filter(|e| e.lease.token == held.lease.token)
        else {
            return (false, None);
        };
        e.users -= 1;
        if wrote {
            e.dirty = true;
        }
        if e.users == 0 {
            for tx in e.idle.drain(..) {
                let _ = tx.send(());
            }
        }
        let end = if e.users == 0 && e.revoked && !e.draining {
            self.map.remove(&held.key)
        } else {
            None
        };
        (true, end)
    }

    /// The peer revoked lease `token` on `key`.
    pub(super) fn revoke(&mut self, key: u64, token: u64) -> (Revoke, Option<CachedLease>) {
        let Some(e) = self.map.get_mut(&key).filter(|e| e.lease.token == token) else {
            return (Revoke::Unknown, None);
        };
        if e.users == 0 {
            (Revoke::EndNow, self.map.remove(&key))
        } else {
            e.revoked = true;
            (Revoke::WhenIdle, None)
        }
    }

    /// Takes every idle entry out.
    pub(super) fn take_idle(&mut self) -> Vec<(u64, CachedLease)> {
        self.map.extract_if(|_, e| e.users == 0).collect()
    }

    /// Every cached lease is of no use any more (their per-lease RDMA keys
    /// died with the rail a new one replaced): the idle ones are taken out
    /// to be ended now, the ones in use take no new users and their last
    /// user ends them.
    pub(super) fn retire_all(&mut self) -> Vec<(u64, CachedLease)> {
        for e in self.map.values_mut() {
            e.revoked = true;
        }
        self.take_idle()
    }

    /// Takes out the idle entries `pick` selects, up to the first one in
    /// use: that one takes no new users, and the receiver fires when it goes
    /// idle (call again then).
    pub(super) fn drain_where(
        &mut self,
        pick: impl Fn(u64, &CachedLease) -> bool,
    ) -> (Vec<(u64, CachedLease)>, Option<oneshot::Receiver<()>>) {
        let keys: Vec<u64> = self
            .map
            .iter()
            .filter(|(k, e)| pick(**k, e))
            .map(|(k, _)| *k)
            .collect();
        let mut ready = Vec::new();
        for k in keys {
            let e = self.map.get_mut(&k).expect("key listed above");
            if e.users > 0 {
                e.draining = true;
                let (tx, rx) = oneshot::channel();
                e.idle.push(tx);
                return (ready, Some(rx));
            }
            ready.extend(self.map.remove(&k).map(|e| (k, e)));
        }
        (ready, None)
    }

    /// A REMOVE starts: leases granted from now on are not cached.
    pub(super) fn remove_started(&mut self) {
        self.removing += 1;
        self.generation += 1;
    }

    /// A REMOVE ended: so are leases asked for while it ran.
    pub(super) fn remove_ended(&mut self) {
        self.removing -= 1;
        self.generation += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn lease(token: u64) -> Lease {
        Lease::unkeyed(token * 4096, token)
    }

    fn hit(c: Checkout) -> HeldLease {
        match c {
            Checkout::Hit(h) => h,
            Checkout::Miss { .. } => panic!("expected a cache hit"),
        }
    }

    fn miss(c: Checkout) -> (u64, bool) {
        match c {
            Checkout::Miss {
                generation,
                dropped_stale,
            } => (generation, dropped_stale),
            Checkout::Hit(_) => panic!("expected a miss"),
        }
    }

    /// Caches lease `token` on `key`, granted for `write`, and returns it
    /// checked out once.
    fn granted(c: &mut LeaseCache, key: u64, token: u64, write: bool) -> HeldLease {
        let (generation, _) = miss(c.checkout(key, write, 1));
        let (cached, evicted) = c.insert(key, lease(token), write, 1, generation);
        assert!(cached && evicted.is_none());
        HeldLease {
            key,
            lease: lease(token),
            cached: true,
            write,
        }
    }

    #[test]
    fn a_write_lease_serves_reads_and_a_read_lease_no_writes() {
        let mut c = LeaseCache::new(8);
        let w = granted(&mut c, 1, 10, true);
        let r = hit(c.checkout(1, false, 1));
        assert_eq!((r.lease.token, r.write), (10, true));
        let g = granted(&mut c, 2, 20, false);
        miss(c.checkout(2, true, 1));
        for h in [w, r, g] {
            let (found, end) = c.checkin(&h, false);
            assert!(found && end.is_none());
        }
    }

    #[test]
    fn a_lease_of_an_earlier_connection_is_forgotten_on_sight() {
        let mut c = LeaseCache::new(8);
        let h = granted(&mut c, 1, 10, true);
        c.checkin(&h, true);
        let (_, stale) = miss(c.checkout(1, true, 2));
        assert!(stale, "the peer ended it with its connection");
        let (_, stale) = miss(c.checkout(1, true, 2));
        assert!(!stale, "forgotten once");
    }

    #[test]
    fn a_revoked_lease_takes_no_new_users_and_its_last_user_ends_it() {
        let mut c = LeaseCache::new(8);
        let a = granted(&mut c, 1, 10, true);
        let b = hit(c.checkout(1, true, 1));
        assert_eq!(c.revoke(1, 99).0, Revoke::Unknown, "another token");
        assert_eq!(c.revoke(1, 10).0, Revoke::WhenIdle);
        miss(c.checkout(1, false, 1));
        assert!(c.checkin(&a, true).1.is_none(), "one user left");
        let (found, end) = c.checkin(&b, false);
        assert!(found);
        let end = end.expect("the last user ends it");
        assert!(end.dirty && end.write, "ended by COMMIT: it was written");
        assert!(c.map.is_empty());
        assert!(!c.checkin(&b, false).0, "gone");
        // Idle when revoked: out at once.
        let h = granted(&mut c, 2, 20, false);
        c.checkin(&h, false);
        let (what, e) = c.revoke(2, 20);
        assert_eq!(what, Revoke::EndNow);
        assert!(e.is_some() && c.map.is_empty());
    }

    #[test]
    fn nothing_asked_for_across_a_remove_is_cached() {
        let mut c = LeaseCache::new(8);
        let (before, _) = miss(c.checkout(1, true, 1));
        c.remove_started();
        assert!(!c.insert(1, lease(10), true, 1, before).0, "remove running");
        let (during, _) = miss(c.checkout(1, true, 1));
        assert!(!c.insert(1, lease(11), true, 1, during).0, "remove running");
        c.remove_ended();
        assert!(
            !c.insert(1, lease(12), true, 1, during).0,
            "asked for before it ended"
        );
        let (after, _) = miss(c.checkout(1, true, 1));
        assert!(c.insert(1, lease(13), true, 1, after).0);
        assert!(!c.insert(1, lease(14), true, 1, after).0, "already cached");
        assert!(
            !LeaseCache::new(0).insert(1, lease(1), true, 1, 0).0,
            "no cache"
        );
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_idle_lease() {
        let mut c = LeaseCache::new(2);
        let a = granted(&mut c, 1, 10, false);
        let b = granted(&mut c, 2, 20, false);
        c.checkin(&a, false);
        c.checkin(&b, false);
        // Key 1 used again: key 2 is the least recent.
        let a = hit(c.checkout(1, false, 1));
        c.checkin(&a, false);
        let (g, _) = miss(c.checkout(3, false, 1));
        let (cached, evicted) = c.insert(3, lease(30), false, 1, g);
        assert!(cached);
        assert_eq!(evicted.map(|(k, e)| (k, e.lease.token)), Some((2, 20)));
        // Every entry in use: nothing to evict, the new lease is used once.
        let _x = hit(c.checkout(1, false, 1));
        let (g, _) = miss(c.checkout(4, false, 1));
        assert!(!c.insert(4, lease(40), false, 1, g).0);
        assert_eq!(c.map.len(), 2);
    }

    #[test]
    fn draining_waits_for_users_and_hands_out_no_more() {
        let mut c = LeaseCache::new(8);
        let a = granted(&mut c, 1, 10, true);
        c.checkin(&a, true);
        let busy = granted(&mut c, 2, 20, true);
        let clean = granted(&mut c, 3, 30, true);
        c.checkin(&clean, false);
        let (ready, wait) = c.drain_where(|k, _| k == 2);
        assert!(ready.is_empty());
        let mut rx = wait.expect("key 2 is in use");
        miss(c.checkout(2, true, 1));
        assert!(rx.try_recv().unwrap().is_none(), "still in use");
        // The last user leaves: the drainer is told, and ends it itself
        // (a revocation meanwhile would not end it under the drainer).
        assert_eq!(c.revoke(2, 20).0, Revoke::WhenIdle);
        assert!(
            c.checkin(&busy, true).1.is_none(),
            "draining: not ended here"
        );
        assert!(rx.now_or_never().is_some());
        let (ready, wait) = c.drain_where(|_, e| e.dirty);
        assert!(wait.is_none());
        let mut keys: Vec<u64> = ready.into_iter().map(|(k, _)| k).collect();
        keys.sort_unstable();
        assert_eq!(keys, [1, 2], "the written ones");
        assert!(c.map.contains_key(&3), "clean key 3 stays cached");
    }

    #[test]
    fn retiring_all_ends_the_idle_now_and_the_rest_with_their_last_user() {
        let mut c = LeaseCache::new(8);
        let a = granted(&mut c, 1, 10, true);
        let b = granted(&mut c, 2, 20, false);
        c.checkin(&b, false);
        let idle: Vec<u64> = c.retire_all().into_iter().map(|(k, _)| k).collect();
        assert_eq!(idle, [2]);
        assert!(
            matches!(c.checkout(1, false, 1), Checkout::Miss { .. }),
            "a retired lease takes no new user"
        );
        let (found, end) = c.checkin(&a, true);
        assert!(found);
        let end = end.expect("its last user ends it");
        assert!(end.write && end.dirty, "and commits what was written");
        assert!(c.map.is_empty());
    }

    #[test]
    fn take_idle_leaves_leases_in_use() {
        let mut c = LeaseCache::new(8);
        let a = granted(&mut c, 1, 10, false);
        let b = granted(&mut c, 2, 20, false);
        c.checkin(&b, false);
        let idle: Vec<u64> = c.take_idle().into_iter().map(|(k, _)| k).collect();
        assert_eq!(idle, [2]);
        assert!(c.checkin(&a, false).0, "still cached");
    }
}
