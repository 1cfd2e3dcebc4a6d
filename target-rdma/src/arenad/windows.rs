//! Per-lease RDMA isolation (`rdma_isolation = "lease"`): the memory
//! windows bound on one session's QP, one per lease granted while its rail
//! was up, so the keys a session holds reach only the slots it leases.
//!
//! The invariant is that a slot's window is invalidated before the store
//! can give the slot to anyone else: the holder's COMMIT and RELEASE drop
//! the window before the store ends the lease; a lease ended by force is
//! reported by the store (under its lock, before the slot is unpinned) and
//! its window dropped there; a closing session drops all of them before
//! its leases are released. Dropping a window returns once the device
//! refuses its key.

use std::collections::{HashMap, HashSet};

use crate::rdma::{RdmaError, Window};

/// One session's bound windows, by lease token.
#[derive(Default)]
pub(super) struct LeaseWindows {
    bound: HashMap<u64, Window>,
    /// Leases ended by force before their window was bound: the grant that
    /// is binding one must not. Emptied when the holder ends the lease, so
    /// it holds at most the session's force-ended leases.
    ended: HashSet<u64>,
}

impl LeaseWindows {
    /// Binds the window of a lease just granted (`bind` does it); `None`
    /// when the lease was ended by force in the meantime (nothing bound).
    pub(super) fn bind(
        &mut self,
        token: u64,
        bind: impl FnOnce() -> Result<Window, RdmaError>,
    ) -> Result<Option<u32>, RdmaError> {
        if self.ended.contains(&token) {
            return Ok(None);
        }
        let w = bind()?;
        let rkey = w.rkey;
        self.bound.insert(token, w);
        Ok(Some(rkey))
    }

    /// The holder ends the lease (COMMIT, RELEASE): invalidates its window.
    pub(super) fn end(&mut self, token: u64) {
        self.bound.remove(&token);
        self.ended.remove(&token);
    }

    /// The store ended the lease by force: invalidates its window, or
    /// remembers it so that no window is bound for it later. `true` when a
    /// window was bound.
    pub(super) fn force_ended(&mut self, token: u64) -> bool {
        if self.bound.remove(&token).is_some() {
            return true;
        }
        self.ended.insert(token);
        false
    }

    /// Invalidates every window (the QP they are bound to goes).
    pub(super) fn clear(&mut self) {
        self.bound.clear();
    }

    /// Windows bound now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.bound.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(rkey: u32) -> Result<Window, RdmaError> {
        Ok(Window::new(rkey, 0, 1, true, Box::new(())))
    }

    #[test]
    fn a_lease_force_ended_before_its_bind_gets_no_window() {
        let mut w = LeaseWindows::default();
        assert_eq!(w.bind(1, || window(10)).unwrap(), Some(10));
        assert!(w.force_ended(1));
        assert!(!w.force_ended(2));
        let mut called = false;
        assert_eq!(
            w.bind(2, || {
                called = true;
                window(11)
            })
            .unwrap(),
            None
        );
        assert!(!called, "no window may be bound for a force-ended lease");
        assert_eq!(w.len(), 0);
        // The holder's RELEASE forgets it.
        w.end(2);
        assert!(w.ended.is_empty());
    }
}
