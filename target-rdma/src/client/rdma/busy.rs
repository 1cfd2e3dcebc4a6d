//! Waiting out BUSY answers caused by our own leases: [`OwnLeases`] counts
//! the leases a transport may hold at the peer, and tells a request the
//! peer answered BUSY whether to send it again now, after one of ours
//! ends, or not at all. A plain state machine; `Leases` drives it.

use futures::channel::oneshot;

/// The leases a transport may hold at the peer: granted ones (in use or
/// cached) and ones being asked for. A BUSY peer (every slot pinned) may be
/// pinned by them, so a BUSY request waits for one to end and retries.
#[derive(Default)]
pub(super) struct OwnLeases {
    held: usize,
    /// Leases ended so far: a BUSY answer that raced with an end is retried
    /// even when nothing is held any more.
    ended: u64,
    /// BUSY requests waiting for a lease to end or go idle.
    waiters: Vec<oneshot::Sender<()>>,
}

/// Where a request stands in answering BUSY peers.
pub(super) struct BusyRetry {
    pinning: bool,
    ended_before: u64,
}

/// After a BUSY answer, what the request does.
pub(super) enum AfterBusy {
    /// Send it again now: a lease ended since it was sent.
    Retry,
    /// Wait for one of our leases to end or go idle, then send it again.
    Wait(oneshot::Receiver<()>),
    /// We hold none: another client pins the arena, BUSY is the answer.
    GiveUp,
}

/// BUSY requests to wake (outside the lock).
#[must_use]
pub(super) struct Wake(Vec<oneshot::Sender<()>>);

impl Wake {
    pub(super) fn wake(self) {
        for tx in self.0 {
            let _ = tx.send(());
        }
    }
}

impl OwnLeases {
    /// Before a request that may be answered BUSY. `pinning`: it asks for a
    /// lease (ALLOC/GET), so until answered it may pin a slot; it counts as
    /// held from now on.
    pub(super) fn start(&mut self, pinning: bool) -> BusyRetry {
        self.held += usize::from(pinning);
        BusyRetry {
            pinning,
            ended_before: self.ended,
        }
    }

    /// The request was answered BUSY: a pinning one pins nothing after all.
    pub(super) fn refused(&mut self, busy: &BusyRetry) -> Wake {
        if !busy.pinning {
            return Wake(Vec::new());
        }
        // Whoever waits on it rechecks.
        self.held -= 1;
        self.changed()
    }

    /// After [`refused`](Self::refused), and after ending idle cached
    /// leases if there were any: whether and when to retry.
    pub(super) fn after_busy(&mut self, busy: &BusyRetry) -> AfterBusy {
        if self.ended != busy.ended_before {
            AfterBusy::Retry
        } else if self.held == 0 {
            AfterBusy::GiveUp
        } else {
            let (tx, rx) = oneshot::channel();
            self.waiters.push(tx);
            AfterBusy::Wait(rx)
        }
    }

    /// The request is sent again: a pinning one counts as held again.
    pub(super) fn resume(&mut self, busy: &mut BusyRetry) {
        self.held += usize::from(busy.pinning);
        busy.ended_before = self.ended;
    }

    /// A lease of ours ended at the peer, or a request for one got none.
    pub(super) fn ended(&mut self) -> Wake {
        self.held = self.held.saturating_sub(1);
        self.ended += 1;
        self.changed()
    }

    /// Something a BUSY request waits on changed (a lease went idle).
    pub(super) fn changed(&mut self) -> Wake {
        Wake(std::mem::take(&mut self.waiters))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;

    #[test]
    fn busy_with_nothing_of_ours_held_gives_up() {
        let mut own = OwnLeases::default();
        let busy = own.start(true);
        own.refused(&busy).wake();
        assert!(matches!(own.after_busy(&busy), AfterBusy::GiveUp));
        let plain = own.start(false);
        own.refused(&plain).wake();
        assert!(matches!(own.after_busy(&plain), AfterBusy::GiveUp));
    }

    #[test]
    fn busy_while_we_hold_a_lease_waits_for_it_to_end() {
        let mut own = OwnLeases::default();
        let _holder = own.start(true); // granted: stays held
        let mut busy = own.start(true);
        own.refused(&busy).wake();
        let AfterBusy::Wait(rx) = own.after_busy(&busy) else {
            panic!("one of ours is held: wait for it");
        };
        own.ended().wake();
        block_on(rx).unwrap();
        own.resume(&mut busy);
        assert_eq!(own.held, 1, "the retried request counts as held again");
    }

    #[test]
    fn an_end_racing_the_busy_answer_retries_at_once() {
        let mut own = OwnLeases::default();
        let _held = own.start(true);
        let busy = own.start(false);
        own.ended().wake(); // between sending and the BUSY answer
        own.refused(&busy).wake();
        assert!(matches!(own.after_busy(&busy), AfterBusy::Retry));
    }
}
