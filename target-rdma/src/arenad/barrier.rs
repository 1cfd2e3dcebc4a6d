//! What a FLUSH waits for on its own connection. The contract (PROTOCOL.md)
//! is that a FLUSH covers every write acknowledged before it was received;
//! the server also makes it cover every WRITE, ALLOC, COMMIT, RELEASE and
//! REMOVE received on the same connection before it, which may still be
//! running on the blocking pool: the FLUSH waits for them before its
//! store flush starts, so it never overtakes a write sent before it.
//! Requests answered inline finish before the next frame is read and need
//! no ticket.

use std::collections::BTreeSet;
use std::pin::pin;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// The connection's mutations running off the reactor, by ticket.
#[derive(Default)]
pub(super) struct WriteBarrier {
    state: Mutex<Tickets>,
    done: Notify,
}

#[derive(Default)]
struct Tickets {
    next: u64,
    running: BTreeSet<u64>,
}

impl WriteBarrier {
    /// A mutation starts: its ticket.
    pub(super) fn begin(&self) -> u64 {
        let mut t = self.state.lock();
        t.next += 1;
        let ticket = t.next;
        t.running.insert(ticket);
        ticket
    }

    /// The last ticket given: what a FLUSH received now must wait for.
    pub(super) fn last(&self) -> u64 {
        self.state.lock().next
    }

    /// The mutation with `ticket` is done.
    pub(super) fn end(&self, ticket: u64) {
        self.state.lock().running.remove(&ticket);
        self.done.notify_waiters();
    }

    /// Waits until every mutation with a ticket up to `upto` is done
    /// (later ones do not hold it back).
    pub(super) async fn wait_through(&self, upto: u64) {
        loop {
            let mut done = pin!(self.done.notified());
            done.as_mut().enable();
            let oldest = self.state.lock().running.first().copied();
            if oldest.is_none_or(|t| t > upto) {
                return;
            }
            done.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_flush_waits_for_earlier_mutations_only() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let b = Arc::new(WriteBarrier::default());
        let first = b.begin();
        let upto = b.last();
        let later = b.begin();
        let waiter = {
            let b = Arc::clone(&b);
            rt.spawn(async move { b.wait_through(upto).await })
        };
        rt.block_on(tokio::task::yield_now());
        assert!(!waiter.is_finished(), "the earlier write is still running");
        b.end(first);
        rt.block_on(waiter).unwrap();
        b.end(later);
    }
}
