//! A coordination store in memory, with the faults a real one has: it can
//! be unreachable, slow, lose compare-and-swap races to another writer, or
//! apply a swap and lose the answer. Tests only (feature `test-utils`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{CoordError, CoordErrorKind, CoordFuture, Coordinator, Lease, Membership, Swap};
use crate::replica::clock::Timers;

/// Faults a [`MemoryCoordinator`] handle injects.
#[derive(Clone, Debug, Default)]
pub struct CoordFault {
    /// Every request fails (a partition from the store).
    pub unavailable: bool,
    /// Every request answers this late (on the handle's clock).
    pub delay: Duration,
    /// The next this many swaps find that another writer stored the next
    /// epoch (same members) just before.
    pub lose_races: u32,
    /// The next this many swaps are stored but answered `Unavailable`.
    pub lose_answers: u32,
}

struct Record {
    membership: Membership,
    swaps: u64,
    /// The handle holding the writer role, for hand-overs
    /// ([`MemoryCoordinator::standby`] handles).
    holder: Option<u64>,
    /// The standby that asked the holder for the role.
    asked_by: Option<String>,
    handles: u64,
}

/// How long [`Coordinator::acquire`] waits for the holder (on the handle's
/// clock) before it gives up, unless set otherwise.
const ACQUIRE_BOUND: Duration = Duration::from_secs(10);

/// One writer's handle on a record in memory. [`MemoryCoordinator::writer`]
/// makes another handle on the same record, with its own lease and faults:
/// a second writer.
pub struct MemoryCoordinator {
    id: u64,
    record: Arc<Mutex<Record>>,
    clock: Arc<dyn Timers>,
    fault: Mutex<CoordFault>,
    lease: Mutex<Lease>,
    acquire_bound: Mutex<Duration>,
}

impl MemoryCoordinator {
    /// A record holding `membership`; the handle's lease never expires
    /// until [`set_lease_until`](Self::set_lease_until) or
    /// [`set_lease`](Self::set_lease) says otherwise.
    pub fn new(clock: Arc<dyn Timers>, membership: Membership) -> Arc<Self> {
        let record = Arc::new(Mutex::new(Record {
            membership,
            swaps: 0,
            holder: Some(0),
            asked_by: None,
            handles: 0,
        }));
        Self::handle(record, clock)
    }

    fn handle(record: Arc<Mutex<Record>>, clock: Arc<dyn Timers>) -> Arc<Self> {
        let forever = clock.now() + Duration::from_secs(1 << 32);
        let id = {
            let mut r = record.lock();
            let id = r.handles;
            r.handles += 1;
            id
        };
        Arc::new(Self {
            id,
            record,
            clock,
            fault: Mutex::default(),
            acquire_bound: Mutex::new(ACQUIRE_BOUND),
            lease: Mutex::new(Lease::Held {
                until: forever,
                term: 0,
            }),
        })
    }

    /// Another writer's handle on the same record.
    pub fn writer(&self) -> Arc<Self> {
        Self::handle(Arc::clone(&self.record), Arc::clone(&self.clock))
    }

    /// A standby's handle on the same record: it holds no role until
    /// [`Coordinator::acquire`] takes it from the holder, the handle made
    /// by [`new`](Self::new) or the last to acquire.
    pub fn standby(&self) -> Arc<Self> {
        let h = self.writer();
        h.set_lease(Lease::Taken {
            holder: "the writer (in memory)".into(),
        });
        h
    }

    /// How long this handle's [`Coordinator::acquire`] waits for the
    /// holder to hand the role over.
    pub fn set_acquire_bound(&self, bound: Duration) {
        *self.acquire_bound.lock() = bound;
    }

    /// The stored record, read without faults.
    pub fn record(&self) -> Membership {
        self.record.lock().membership.clone()
    }

    /// Successful swaps so far (all handles).
    pub fn swaps(&self) -> u64 {
        self.record.lock().swaps
    }

    /// Replaces this handle's faults.
    pub fn set_fault(&self, fault: CoordFault) {
        *self.fault.lock() = fault;
    }

    /// Changes this handle's faults in place.
    pub fn update_fault(&self, f: impl FnOnce(&mut CoordFault)) {
        f(&mut self.fault.lock());
    }

    /// The lease is confirmed until `at` (the same term).
    pub fn set_lease_until(&self, at: Instant) {
        let mut l = self.lease.lock();
        let term = match *l {
            Lease::Held { term, .. } => term,
            _ => 0,
        };
        *l = Lease::Held { until: at, term };
    }

    /// The role stands as `lease` says.
    pub fn set_lease(&self, lease: Lease) {
        *self.lease.lock() = lease;
    }

    /// Waits the injected delay, then fails if the store is unreachable.
    async fn reach(&self) -> Result<(), CoordError> {
        let delay = self.fault.lock().delay;
        if !delay.is_zero() {
            self.clock.sleep(delay).await;
        }
        if self.fault.lock().unavailable {
            return Err(CoordError::new(
                CoordErrorKind::Unavailable,
                "the in-memory store is partitioned away (injected)",
            ));
        }
        Ok(())
    }

    /// What a swap finds of the role: only its holder may store.
    fn holder_check(&self) -> Result<(), CoordError> {
        match &*self.lease.lock() {
            Lease::Held { .. } => Ok(()),
            Lease::Lost => Err(CoordError::new(
                CoordErrorKind::Unavailable,
                "the writer lease is lost and not taken back yet (injected)",
            )),
            Lease::Taken { holder } => Err(CoordError::new(
                CoordErrorKind::LeaseHeld,
                format!("the volume is held by {holder} (injected)"),
            )),
        }
    }
}

impl Coordinator for MemoryCoordinator {
    fn load(&self) -> CoordFuture<'_, Membership> {
        Box::pin(async move {
            self.reach().await?;
            Ok(self.record())
        })
    }

    fn compare_and_swap(&self, expected: u64, next: Membership) -> CoordFuture<'_, Swap> {
        Box::pin(async move {
            self.reach().await?;
            self.holder_check()?;
            if let Err(why) = next.validate() {
                return Err(CoordError::new(
                    CoordErrorKind::Corrupt,
                    format!("refusing to store {next}: {why}"),
                ));
            }
            assert!(next.epoch > expected, "a swap must raise the epoch");
            let mut r = self.record.lock();
            {
                let mut f = self.fault.lock();
                if f.lose_races > 0 && r.membership.epoch == expected {
                    f.lose_races -= 1;
                    r.membership.epoch += 1;
                    r.swaps += 1;
                }
            }
            if r.membership.epoch != expected {
                return Ok(Swap::Lost(r.membership.clone()));
            }
            r.membership = next;
            r.swaps += 1;
            let mut f = self.fault.lock();
            if f.lose_answers > 0 {
                f.lose_answers -= 1;
                return Err(CoordError::new(
                    CoordErrorKind::Unavailable,
                    "the answer was lost after the swap was stored (injected)",
                ));
            }
            Ok(Swap::Done)
        })
    }

    fn lease(&self) -> Lease {
        self.lease.lock().clone()
    }

    fn acquire(&self) -> CoordFuture<'_, ()> {
        Box::pin(async move {
            self.reach().await?;
            let name = format!("standby handle {}", self.id);
            let give_up = self.clock.now() + *self.acquire_bound.lock();
            loop {
                {
                    let mut r = self.record.lock();
                    if r.holder.is_none() || r.holder == Some(self.id) {
                        r.holder = Some(self.id);
                        r.asked_by = None;
                        let mut l = self.lease.lock();
                        let term = match *l {
                            Lease::Held { term, .. } => term,
                            _ => 0,
                        };
                        *l = Lease::Held {
                            until: self.clock.now() + Duration::from_secs(1 << 32),
                            term: term + 1,
                        };
                        return Ok(());
                    }
                    r.asked_by = Some(name.clone());
                }
                if self.clock.now() >= give_up {
                    return Err(CoordError::new(
                        CoordErrorKind::LeaseHeld,
                        "the holder did not hand the role over in time (in memory)",
                    ));
                }
                self.clock.sleep(Duration::from_millis(1)).await;
                self.reach().await?;
            }
        })
    }

    fn release(&self) -> CoordFuture<'_, ()> {
        Box::pin(async move {
            self.reach().await?;
            let mut r = self.record.lock();
            if r.holder == Some(self.id) {
                r.holder = None;
            }
            let holder = r.asked_by.clone().unwrap_or_else(|| "nobody yet".into());
            *self.lease.lock() = Lease::Taken { holder };
            Ok(())
        })
    }

    fn handover_asked(&self) -> Option<String> {
        let r = self.record.lock();
        r.asked_by.clone().filter(|_| r.holder == Some(self.id))
    }
}

#[cfg(test)]
mod tests {
    use futures::executor::block_on;

    use super::*;
    use crate::replica::clock::system;
    use crate::replica::coordinator::MemberState;

    fn two() -> Membership {
        Membership::new_volume(&["a".into(), "b".into()]).unwrap()
    }

    fn without_b(epoch: u64) -> Membership {
        let mut m = two();
        m.epoch = epoch;
        m.members[1].state = MemberState::Failed;
        m
    }

    #[test]
    fn swaps_are_conditioned_on_the_epoch() {
        let c = MemoryCoordinator::new(system(), two());
        assert_eq!(
            block_on(c.compare_and_swap(1, without_b(2))).unwrap(),
            Swap::Done
        );
        let lost = block_on(c.compare_and_swap(1, without_b(2))).unwrap();
        assert_eq!(lost, Swap::Lost(without_b(2)));
        assert_eq!(c.swaps(), 1);
    }

    #[test]
    fn injected_faults_behave_as_a_real_store_would() {
        let c = MemoryCoordinator::new(system(), two());
        c.set_fault(CoordFault {
            unavailable: true,
            ..CoordFault::default()
        });
        let e = block_on(c.load()).unwrap_err();
        assert_eq!(e.kind, CoordErrorKind::Unavailable);
        c.set_fault(CoordFault {
            lose_races: 1,
            ..CoordFault::default()
        });
        match block_on(c.compare_and_swap(1, without_b(2))).unwrap() {
            Swap::Lost(now) => assert_eq!((now.epoch, now.active().count()), (2, 2)),
            Swap::Done => panic!("the race was not lost"),
        }
        c.update_fault(|f| f.lose_answers = 1);
        let e = block_on(c.compare_and_swap(2, without_b(3))).unwrap_err();
        assert_eq!(e.kind, CoordErrorKind::Unavailable);
        assert_eq!(
            c.record(),
            without_b(3),
            "stored although the answer was lost"
        );
        let second = c.writer();
        assert_eq!(block_on(second.load()).unwrap(), without_b(3));
        let past = Instant::now() - Duration::from_secs(1);
        second.set_lease_until(past);
        assert_eq!(
            second.lease(),
            Lease::Held {
                until: past,
                term: 0
            }
        );
        assert!(
            matches!(c.lease(), Lease::Held { until, .. } if until > Instant::now()),
            "each writer has its own lease"
        );
        second.set_lease(Lease::Lost);
        let e = block_on(second.compare_and_swap(3, without_b(4))).unwrap_err();
        assert_eq!(
            e.kind,
            CoordErrorKind::Unavailable,
            "a lost role stores nothing"
        );
    }
}
