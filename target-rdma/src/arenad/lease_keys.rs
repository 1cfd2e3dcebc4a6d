//! Per-lease RDMA isolation (`rdma_isolation = "lease"`): one session's
//! lease keys. Each RDMA session has a protection domain of its own (its
//! rail's QP is created in it); each lease granted while the rail is up is
//! registered in it as a memory region over exactly its slot, and the
//! lease answer carries that region's rkey. The device checks a key against
//! the domain of the QP an access arrives on and against the region's
//! bounds and access, so a session's keys reach only the slots it leases,
//! only through its own QP.
//!
//! The invariant: a lease's region is deregistered before the store can
//! give its slot to anyone else. The holder's COMMIT and RELEASE drop the
//! key before the store ends the lease; a lease ended by force is reported
//! by the store (under its lock, before the slot is unpinned) and its key
//! dropped there; a rail replacement or the session's end drops them all
//! (before its leases are released). Deregistration is synchronous: once
//! it returned the device refuses the key (a remote access error).
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

use crate::rdma::{Domain, MemoryRegion, RdmaError};

/// A lease's key: a region over exactly its slot in its session's domain.
/// Dropping it deregisters the region.
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
    /// Registered: the rkey travels in the answer.
    Key(u32),
    /// The session has no rail (no domain): the lease serves inline
    /// transfers only.
    NoRail,
    /// The lease ended before it could be registered: nothing registered.
    Ended,
}

/// One session's lease keys and its domain.
#[derive(Default)]
pub(super) struct LeaseKeys {
    /// The rail's protection domain, where keys are registered; `None`
    /// before RAIL_CONNECT and after the session's end.
    domain: Option<Arc<dyn Domain>>,
    keys: HashMap<u64, LeaseKey>,
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

    /// Lease `token` ended (COMMIT, RELEASE, ended by force): its key is
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

    /// Sets the domain keys are registered in (RAIL_CONNECT: the new
    /// rail's, after [`Self::clear`]). Any key of the old one is
    /// deregistered first.
    pub(super) fn set_domain(&mut self, domain: Option<Arc<dyn Domain>>) {
        self.keys.clear();
        self.domain = domain;
    }

    /// The rail goes (replaced, or the session ends): no key is registered
    /// from now on, and every key is deregistered, each under its own
    /// short hold of `keys` (so the force-end hook, which takes it under
    /// the store lock, waits for one deregistration at most).
    pub(super) fn clear(keys: &Mutex<LeaseKeys>) {
        let domain = keys.lock().domain.take();
        Self::drop_keys(keys);
        drop(domain);
    }

    /// Every key registered now is deregistered, each under its own short
    /// hold of `keys` (see [`Self::clear`]); the rail stays, so a lease
    /// granted later is keyed as before. A raise of the volume's epoch does
    /// this to the sessions it fences out, before their leases end.
    pub(super) fn drop_keys(keys: &Mutex<LeaseKeys>) {
        let tokens: Vec<u64> = keys.lock().keys.keys().copied().collect();
        for t in tokens {
            // Dropped (deregistered) under the lock: a key out of the map
            // is a dead key.
            keys.lock().keys.remove(&t);
        }
    }

    /// Keys registered now.
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
    /// The store granted lease `token`: registers its key in the session's
    /// domain with `register`, unless the lease already ended or there is
    /// no rail.
    pub(super) fn key(
        mut self,
        token: u64,
        register: impl FnOnce(&dyn Domain) -> Result<LeaseKey, RdmaError>,
    ) -> Result<Keyed, RdmaError> {
        let mut k = self.keys.lock();
        let r = if k.ended.contains_key(&token) {
            Ok(Keyed::Ended)
        } else if let Some(domain) = k.domain.clone() {
            register(domain.as_ref()).map(|key| {
                let rkey = key.mr.rkey;
                k.keys.insert(token, key);
                Keyed::Key(rkey)
            })
        } else {
            Ok(Keyed::NoRail)
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
        keys.lock().set_domain(Some(p.new_domain().unwrap()));
        Setup {
            p,
            keys,
            mem: vec![0; 64],
        }
    }

    impl Setup {
        fn register(&self) -> impl FnOnce(&dyn Domain) -> Result<LeaseKey, RdmaError> + '_ {
            let addr = self.mem.as_ptr().cast_mut();
            move |d| {
                // SAFETY: `mem` outlives every key (the setup drops it
                // last) and nothing posts to it.
                let mr = unsafe { d.register(addr, 64, Access::RemoteReadWrite) }?;
                Ok(LeaseKey::new(mr, Arc::new(())))
            }
        }
    }

    #[test]
    fn a_key_lives_from_its_grant_to_its_lease_end() {
        let s = setup();
        let g = LeaseKeys::start(&s.keys);
        assert!(matches!(g.key(1, s.register()).unwrap(), Keyed::Key(_)));
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
        let r = g.key(2, |d| {
            called = true;
            s.register()(d)
        });
        assert_eq!(r.unwrap(), Keyed::Ended);
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
        s.keys.lock().set_domain(None);
        assert_eq!(
            LeaseKeys::start(&s.keys).key(1, s.register()).unwrap(),
            Keyed::NoRail
        );
        s.keys.lock().set_domain(Some(s.p.new_domain().unwrap()));
        for t in 2..5 {
            assert!(matches!(
                LeaseKeys::start(&s.keys).key(t, s.register()).unwrap(),
                Keyed::Key(_)
            ));
        }
        assert_eq!((s.p.live_regions(), s.p.live_domains()), (3, 2));
        LeaseKeys::clear(&s.keys);
        assert_eq!(s.p.live_regions(), 0, "the old rail's keys are gone");
        assert_eq!(s.p.live_domains(), 1, "and its domain with them");
        assert_eq!(
            LeaseKeys::start(&s.keys).key(5, s.register()).unwrap(),
            Keyed::NoRail,
            "nothing is registered once cleared"
        );
        s.keys.lock().set_domain(Some(s.p.new_domain().unwrap()));
        assert!(matches!(
            LeaseKeys::start(&s.keys).key(6, s.register()).unwrap(),
            Keyed::Key(_)
        ));
        s.keys.lock().set_domain(None);
        assert_eq!((s.p.live_regions(), s.p.live_domains()), (0, 1));
    }

    #[test]
    fn a_failed_registration_is_an_error_and_keeps_nothing() {
        let s = setup();
        s.p.refuse_registrations_of(64);
        assert!(LeaseKeys::start(&s.keys).key(1, s.register()).is_err());
        assert_eq!((s.keys.lock().len(), s.p.live_regions()), (0, 0));
        assert!(s.keys.lock().granting.is_empty());
    }
}
