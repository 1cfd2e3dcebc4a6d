//! Per-lease RDMA isolation (`rdma_isolation = "lease"`): one session's
//! lease keys. Each rail of an RDMA session has a protection domain of its
//! own (the rail's QP is created in it); each lease granted while a rail is
//! up is registered in that rail's domain as a memory region over exactly
//! its slot, and the lease answer carries that region's rkey, one per rail.
//! The device checks a key against the domain of the QP an access arrives
//! on and against the region's bounds and access, so a session's keys
//! reach only the slots it leases, only through its own QPs.
//!
//! The invariant: a lease's regions are deregistered before the store can
//! give its slot to anyone else. The holder's COMMIT and RELEASE drop the
//! keys before the store ends the lease; a lease ended by force is reported
//! by the store (under its lock, before the slot is unpinned) and its keys
//! dropped there; a rail's replacement drops that rail's keys, the
//! session's end all of them (before its leases are released).
//! Deregistration is synchronous: once it returned the device refuses the
//! key (a remote access error).
//!
//! A lease may end before its grant registered it (ended by force, or
//! released by a client that guessed its token): the grant then must not
//! register it. Grants in flight hold a ticket; a lease that ends without a
//! key while a grant is in flight is remembered until every grant that
//! started before it has finished, and a grant whose lease is remembered
//! registers nothing.

use std::any::Any;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::proto::MAX_RAILS;
use crate::rdma::{Domain, MemoryRegion, RdmaError};

/// A lease's key on one rail: a region over exactly its slot in its
/// session's domain of that rail. Dropping it deregisters the region.
pub(super) struct LeaseKey {
    // Field order is drop order: the region is deregistered before the
    // arena's owner may go.
    mr: MemoryRegion,
    _arena: Arc<dyn Any + Send + Sync>,
}

impl LeaseKey {
    /// `mr` over memory that `arena` keeps mapped.
    pub(super) fn new(mr: MemoryRegion, arena: Arc<dyn Any + Send + Sync>) -> Self {
        Self { mr, _arena: arena }
    }
}

/// What [`Grant::key`] did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Keyed {
    /// Registered on the rails that have a domain: each rail's rkey
    /// travels in the answer (`None` on a rail without a domain, or whose
    /// registration failed).
    Keys([Option<u32>; MAX_RAILS]),
    /// The session has no rail (no domain): the lease serves inline
    /// transfers only.
    NoRail,
    /// The lease ended before it could be registered: nothing registered.
    Ended,
}

/// One lease's keys, by rail.
type RailKeys = [Option<LeaseKey>; MAX_RAILS];

/// One session's lease keys and its rails' domains.
#[derive(Default)]
pub(super) struct LeaseKeys {
    /// Each rail's protection domain, where its keys are registered;
    /// `None` before the rail's RAIL_CONNECT and after the session's end.
    domains: [Option<Arc<dyn Domain>>; MAX_RAILS],
    keys: HashMap<u64, RailKeys>,
    /// Orders grant tickets and ends.
    seq: u64,
    /// Tickets of the grants in flight.
    granting: BTreeSet<u64>,
    /// Leases that ended without a key while grants were in flight, with
    /// the sequence number of their end.
    ended: HashMap<u64, u64>,
}

impl LeaseKeys {
    /// A grant starts, before the store is asked for the lease.
    pub(super) fn start(keys: &Mutex<LeaseKeys>) -> Grant<'_> {
        let mut k = keys.lock();
        k.seq += 1;
        let ticket = k.seq;
        k.granting.insert(ticket);
        Grant {
            keys,
            ticket,
            done: false,
        }
    }

    fn finish(&mut self, ticket: u64) {
        self.granting.remove(&ticket);
        match self.granting.first() {
            // An end before the oldest grant in flight started cannot be
            // of a lease any of them got.
            Some(&oldest) => self.ended.retain(|_, at| *at > oldest),
            None => self.ended.clear(),
        }
    }

    /// Lease `token` ended (COMMIT, RELEASE, ended by force): its keys are
    /// deregistered before this returns. `true` when it had one.
    pub(super) fn end(&mut self, token: u64) -> bool {
        if self.keys.remove(&token).is_some() {
            return true;
        }
        if !self.granting.is_empty() {
            self.seq += 1;
            self.ended.insert(token, self.seq);
        }
        false
    }

    /// Sets the domain `rail`'s keys are registered in (RAIL_CONNECT: the
    /// new rail's, after [`Self::clear`]). Any key of the old one is
    /// deregistered first.
    pub(super) fn set_domain(&mut self, rail: usize, domain: Option<Arc<dyn Domain>>) {
        for k in self.keys.values_mut() {
            k[rail] = None;
        }
        self.keys.retain(|_, k| k.iter().any(Option::is_some));
        self.domains[rail] = domain;
    }

    /// `rail` goes (replaced, or the session ends): no key is registered
    /// on it from now on, and every key on it is deregistered, each under
    /// its own short hold of `keys` (so the force-end hook, which takes it
    /// under the store lock, waits for one deregistration at most).
    pub(super) fn clear(keys: &Mutex<LeaseKeys>, rail: usize) {
        let domain = keys.lock().domains[rail].take();
        Self::drop_keys_where(keys, |r| r == rail);
        drop(domain);
    }

    /// Every key registered now, on every rail, is deregistered, each
    /// under its own short hold of `keys` (see [`Self::clear`]); the rails
    /// stay, so a lease granted later is keyed as before. A raise of the
    /// volume's epoch does this to the sessions it fences out, before
    /// their leases end.
    pub(super) fn drop_keys(keys: &Mutex<LeaseKeys>) {
        Self::drop_keys_where(keys, |_| true);
    }

    fn drop_keys_where(keys: &Mutex<LeaseKeys>, on: impl Fn(usize) -> bool) {
        let tokens: Vec<u64> = keys.lock().keys.keys().copied().collect();
        for t in tokens {
            // Dropped (deregistered) under the lock: a key out of the map
            // is a dead key.
            let mut k = keys.lock();
            if let Some(held) = k.keys.get_mut(&t) {
                for (rail, key) in held.iter_mut().enumerate() {
                    if on(rail) {
                        *key = None;
                    }
                }
                if held.iter().all(Option::is_none) {
                    k.keys.remove(&t);
                }
            }
        }
    }

    /// Leases keyed now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }
}

/// A grant in flight (see [`LeaseKeys::start`]); dropped without
/// [`Grant::key`] when the store granted nothing.
pub(super) struct Grant<'a> {
    keys: &'a Mutex<LeaseKeys>,
    ticket: u64,
    done: bool,
}

impl Grant<'_> {
    /// The store granted lease `token`: registers its key in each rail's
    /// domain with `register(rail, domain)`, unless the lease already
    /// ended or there is no rail. A registration that fails is handed to
    /// `failed` and leaves that rail without a key.
    pub(super) fn key(
        mut self,
        token: u64,
        mut register: impl FnMut(usize, &dyn Domain) -> Result<LeaseKey, RdmaError>,
        mut failed: impl FnMut(usize, RdmaError),
    ) -> Keyed {
        let mut k = self.keys.lock();
        let r = if k.ended.contains_key(&token) {
            Keyed::Ended
        } else if k.domains.iter().all(Option::is_none) {
            Keyed::NoRail
        } else {
            let mut held: RailKeys = Default::default();
            let mut rkeys = [None; MAX_RAILS];
            for (rail, domain) in k.domains.iter().enumerate() {
                let Some(d) = domain else { continue };
                match register(rail, d.as_ref()) {
                    Ok(key) => {
                        rkeys[rail] = Some(key.mr.rkey);
                        held[rail] = Some(key);
                    }
                    Err(e) => failed(rail, e),
                }
            }
            if held.iter().any(Option::is_some) {
                k.keys.insert(token, held);
            }
            Keyed::Keys(rkeys)
        };
        k.finish(self.ticket);
        self.done = true;
        r
    }
}

impl Drop for Grant<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.keys.lock().finish(self.ticket);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::loopback::LoopbackProvider;
    use crate::rdma::{Access, RdmaProvider};

    struct Setup {
        p: Arc<LoopbackProvider>,
        keys: Mutex<LeaseKeys>,
        mem: Vec<u8>,
    }

    fn setup() -> Setup {
        let p = LoopbackProvider::new();
        let keys = Mutex::new(LeaseKeys::default());
        keys.lock().set_domain(0, Some(p.new_domain().unwrap()));
        Setup {
            p,
            keys,
            mem: vec![0; 64],
        }
    }

    impl Setup {
        fn register(&self) -> impl FnMut(usize, &dyn Domain) -> Result<LeaseKey, RdmaError> + '_ {
            let addr = self.mem.as_ptr().cast_mut();
            move |_, d| {
                // SAFETY: `mem` outlives every key (the setup drops it
                // last) and nothing posts to it.
                let mr = unsafe { d.register(addr, 64, Access::RemoteReadWrite) }?;
                Ok(LeaseKey::new(mr, Arc::new(())))
            }
        }

        fn key(&self, token: u64) -> Keyed {
            LeaseKeys::start(&self.keys).key(token, self.register(), |r, e| {
                panic!("registering on rail {r} failed: {e}")
            })
        }
    }

    fn keyed_on(k: &Keyed) -> [bool; MAX_RAILS] {
        match k {
            Keyed::Keys(rkeys) => rkeys.map(|k| k.is_some()),
            other => panic!("not keyed: {other:?}"),
        }
    }

    #[test]
    fn a_key_lives_from_its_grant_to_its_lease_end() {
        let s = setup();
        assert_eq!(keyed_on(&s.key(1)), [true, false]);
        assert_eq!((s.keys.lock().len(), s.p.live_regions()), (1, 1));
        assert!(s.keys.lock().end(1));
        assert_eq!((s.keys.lock().len(), s.p.live_regions()), (0, 0));
        assert!(!s.keys.lock().end(1), "ended once");
        // No grant in flight: nothing is remembered.
        assert!(s.keys.lock().ended.is_empty());
    }

    #[test]
    fn a_lease_ended_before_its_grant_registered_it_gets_no_key() {
        let s = setup();
        let early = LeaseKeys::start(&s.keys);
        let g = LeaseKeys::start(&s.keys);
        // Lease 2 (g's) ends before g registers it; lease 9 ends too.
        assert!(!s.keys.lock().end(2));
        assert!(!s.keys.lock().end(9));
        let mut called = false;
        let mut register = s.register();
        let r = g.key(
            2,
            |rail, d| {
                called = true;
                register(rail, d)
            },
            |_, _| {},
        );
        assert_eq!(r, Keyed::Ended);
        assert!(!called, "nothing may be registered for an ended lease");
        assert_eq!(s.p.live_regions(), 0);
        // The grant that started first still sees both ends.
        assert_eq!(s.keys.lock().ended.len(), 2);
        drop(early);
        assert!(
            s.keys.lock().ended.is_empty(),
            "forgotten with the last grant"
        );
    }

    #[test]
    fn ends_older_than_every_grant_in_flight_are_forgotten() {
        let s = setup();
        let first = LeaseKeys::start(&s.keys);
        s.keys.lock().end(5);
        let second = LeaseKeys::start(&s.keys);
        s.keys.lock().end(6);
        drop(first);
        let k = s.keys.lock();
        assert_eq!(k.ended.keys().copied().collect::<Vec<_>>(), vec![6]);
        drop(k);
        drop(second);
    }

    #[test]
    fn no_rail_no_key_and_a_new_rail_drops_the_old_keys() {
        let s = setup();
        s.keys.lock().set_domain(0, None);
        assert_eq!(s.key(1), Keyed::NoRail);
        s.keys.lock().set_domain(0, Some(s.p.new_domain().unwrap()));
        for t in 2..5 {
            assert_eq!(keyed_on(&s.key(t)), [true, false]);
        }
        assert_eq!((s.p.live_regions(), s.p.live_domains()), (3, 2));
        LeaseKeys::clear(&s.keys, 0);
        assert_eq!(s.p.live_regions(), 0, "the old rail's keys are gone");
        assert_eq!(s.p.live_domains(), 1, "and its domain with them");
        assert_eq!(
            s.key(5),
            Keyed::NoRail,
            "nothing is registered once cleared"
        );
        s.keys.lock().set_domain(0, Some(s.p.new_domain().unwrap()));
        assert_eq!(keyed_on(&s.key(6)), [true, false]);
        s.keys.lock().set_domain(0, None);
        assert_eq!((s.p.live_regions(), s.p.live_domains()), (0, 1));
    }

    #[test]
    fn each_rail_has_its_keys_and_losing_one_keeps_the_other() {
        let s = setup();
        let other = LoopbackProvider::new();
        s.keys
            .lock()
            .set_domain(1, Some(other.new_domain().unwrap()));
        let both = s.key(1);
        assert_eq!(keyed_on(&both), [true, true]);
        assert_eq!((s.p.live_regions(), other.live_regions()), (1, 1));
        // Rail 1 replaced: its key goes, rail 0's stays, and a lease
        // granted meanwhile is keyed on rail 0 only.
        LeaseKeys::clear(&s.keys, 1);
        assert_eq!((s.p.live_regions(), other.live_regions()), (1, 0));
        assert_eq!(keyed_on(&s.key(2)), [true, false]);
        s.keys
            .lock()
            .set_domain(1, Some(other.new_domain().unwrap()));
        assert_eq!(keyed_on(&s.key(3)), [true, true]);
        // The lease's end takes its keys on both rails; the fence every key.
        assert!(s.keys.lock().end(3));
        assert_eq!((s.p.live_regions(), other.live_regions()), (2, 0));
        LeaseKeys::drop_keys(&s.keys);
        assert_eq!((s.p.live_regions(), other.live_regions()), (0, 0));
        assert_eq!(s.keys.lock().len(), 0);
        assert_eq!(keyed_on(&s.key(4)), [true, true], "the rails stay");
    }

    #[test]
    fn a_failed_registration_leaves_that_rail_unkeyed() {
        let s = setup();
        let other = LoopbackProvider::new();
        s.keys
            .lock()
            .set_domain(1, Some(other.new_domain().unwrap()));
        s.p.refuse_registrations_of(64);
        let mut failed = Vec::new();
        let k = LeaseKeys::start(&s.keys).key(1, s.register(), |r, _| failed.push(r));
        assert_eq!((keyed_on(&k), failed), ([false, true], vec![0]));
        assert_eq!((s.p.live_regions(), other.live_regions()), (0, 1));
        other.refuse_registrations_of(64);
        let mut failed = Vec::new();
        let k = LeaseKeys::start(&s.keys).key(2, s.register(), |r, _| failed.push(r));
        assert_eq!((k, failed), (Keyed::Keys([None, None]), vec![0, 1]));
        assert_eq!(s.keys.lock().len(), 1, "lease 2 holds nothing");
        assert!(s.keys.lock().granting.is_empty());
    }
}
