//! Durability across peer restarts: which acknowledged writes a FLUSH
//! vouches for, and whether a restart of the peer lost some of them.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

/// The clients whose acknowledged writes one FLUSH vouches for.
///
/// The peer's FLUSH makes every write it acknowledged durable, whichever
/// connection carried it, and a block device's FLUSH covers writes completed
/// on any of its queues. So the queue connections of one device share a
/// domain: a FLUSH through any of them fails with
/// [`ArenaError::UnflushedDataLost`](crate::blob::ArenaError::UnflushedDataLost) if a peer restart lost a write
/// acknowledged through any of them, and succeeds once their writes are
/// flushed.
#[derive(Debug, Default)]
pub struct FlushDomain {
    state: Mutex<Durability>,
    /// Set, for good, once a restart lost writes acknowledged through the
    /// domain; readable without the lock: a replicated volume asks on every
    /// answer whether this member is stale.
    lost: AtomicBool,
}

#[derive(Debug, Default)]
struct Durability {
    /// The peer generation the domain's connections were last opened in.
    generation: Option<u64>,
    /// Writes acknowledged so far.
    acked: u64,
    /// `acked` as of the start of the last successful FLUSH.
    flushed: u64,
    /// Set when a restart lost acknowledged writes; the next FLUSH fails.
    lost: Option<(u64, u64)>,
}

/// Where a FLUSH started: the writes it covers, in which peer generation.
#[derive(Clone, Copy, Debug)]
pub(super) struct FlushMark {
    acked: u64,
    generation: Option<u64>,
}

/// A peer restart lost acknowledged writes: (old generation, new generation).
pub(super) type Lost = (u64, u64);

impl FlushDomain {
    /// Whether a peer restart ever lost writes acknowledged through the
    /// domain. It is set before the restarted peer answers any request of
    /// the domain, so a caller that checks it after an answer knows whether
    /// that answer may come from a peer that lost acknowledged writes; the
    /// FLUSH that reports the loss does not clear it (the data stays old).
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    fn set_lost(&self, d: &mut Durability, lost: Option<Lost>) {
        d.lost = lost;
        if lost.is_some() {
            self.lost.store(true, Ordering::Release);
        }
    }

    /// A connection of the domain was opened in peer `generation`. When the
    /// generation changed the peer restarted, and writes acknowledged since
    /// the last FLUSH are gone: the next FLUSH reports them. Returns the old
    /// generation on a restart.
    pub(super) fn connected(&self, generation: u64) -> Option<u64> {
        let mut d = self.state.lock();
        let old = d.generation.filter(|g| *g != generation);
        if let Some(old) = old {
            if d.acked > d.flushed && d.lost.is_none() {
                self.set_lost(&mut d, Some((old, generation)));
            }
            d.flushed = d.acked;
        }
        d.generation = Some(generation);
        old
    }

    /// A write was acknowledged through one of the domain's connections,
    /// by the peer generation that connection was opened in. If another
    /// connection of the domain has meanwhile found the peer restarted, the
    /// write died with the old peer (no FLUSH can have covered it: it was
    /// not counted yet), and the next FLUSH reports it.
    pub(super) fn acknowledged_in(&self, generation: u64) {
        let mut d = self.state.lock();
        match d.generation {
            Some(now) if now != generation => {
                if d.lost.is_none() {
                    self.set_lost(&mut d, Some((generation, now)));
                }
            }
            _ => d.acked += 1,
        }
    }

    /// A write was acknowledged through the domain's current connection.
    pub(super) fn acknowledged(&self) {
        self.state.lock().acked += 1;
    }

    /// A FLUSH is about to be sent: the writes it will vouch for, or the
    /// restart that lost some (reported once).
    pub(super) fn flush_start(&self) -> Result<FlushMark, Lost> {
        let mut d = self.state.lock();
        if let Some(lost) = d.lost {
            self.set_lost(&mut d, None);
            return Err(lost);
        }
        Ok(FlushMark {
            acked: d.acked,
            generation: d.generation,
        })
    }

    /// The peer acknowledged the FLUSH started at `mark`. A restart between
    /// the writes and the FLUSH that lost writes fails it.
    pub(super) fn flush_done(&self, mark: FlushMark) -> Result<(), Lost> {
        let mut d = self.state.lock();
        if d.generation != mark.generation {
            if let Some(lost) = d.lost {
                self.set_lost(&mut d, None);
                return Err(lost);
            }
        }
        d.flushed = d.flushed.max(mark.acked);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_after_flushed_writes_loses_nothing() {
        let d = FlushDomain::default();
        assert_eq!(d.connected(1), None);
        d.acknowledged();
        let m = d.flush_start().unwrap();
        d.flush_done(m).unwrap();
        assert_eq!(d.connected(2), Some(1), "the restart is seen");
        d.flush_done(d.flush_start().unwrap()).unwrap();
    }

    #[test]
    fn a_restart_that_lost_unflushed_writes_fails_the_next_flush_once() {
        let d = FlushDomain::default();
        d.connected(1);
        d.acknowledged();
        d.flush_done(d.flush_start().unwrap()).unwrap();
        d.acknowledged();
        assert_eq!(d.connected(2), Some(1));
        assert_eq!(d.flush_start().unwrap_err(), (1, 2));
        // Reported; writes from now on are new ones.
        d.acknowledged();
        d.flush_done(d.flush_start().unwrap()).unwrap();
        // Reconnecting in the same generation is no restart.
        assert_eq!(d.connected(2), None);
        d.flush_done(d.flush_start().unwrap()).unwrap();
    }

    #[test]
    fn a_restart_during_a_flush_that_lost_writes_fails_it() {
        let d = FlushDomain::default();
        d.connected(7);
        d.acknowledged();
        let m = d.flush_start().unwrap();
        // Another connection of the domain reconnects to a restarted peer
        // before this FLUSH's answer: the write it covers was lost.
        d.connected(8);
        assert_eq!(d.flush_done(m).unwrap_err(), (7, 8));
        d.flush_done(d.flush_start().unwrap()).unwrap();
    }

    #[test]
    fn a_write_acknowledged_by_a_peer_since_replaced_is_lost() {
        let d = FlushDomain::default();
        d.connected(1);
        d.flush_done(d.flush_start().unwrap()).unwrap();
        // Queue 1's connection finds the peer restarted before queue 0's
        // write, acknowledged by the old peer, is counted.
        d.connected(2);
        assert!(!d.lost(), "nothing counted was unflushed");
        d.acknowledged_in(1);
        assert!(d.lost(), "the write died with generation 1");
        assert_eq!(d.flush_start().unwrap_err(), (1, 2));
        assert!(d.lost(), "reported once, remembered");
        d.acknowledged_in(2);
        d.flush_done(d.flush_start().unwrap()).unwrap();
    }

    #[test]
    fn the_loss_stays_readable_after_a_flush_reports_it() {
        let d = FlushDomain::default();
        d.connected(1);
        d.acknowledged_in(1);
        assert!(!d.lost());
        d.connected(2);
        assert!(d.lost());
        // A second restart before the report keeps the first loss.
        d.acknowledged_in(2);
        d.connected(3);
        assert_eq!(d.flush_start().unwrap_err(), (1, 2));
        assert!(d.lost());
        d.flush_done(d.flush_start().unwrap()).unwrap();
        assert!(d.lost());
    }

    #[test]
    fn one_flush_vouches_for_writes_of_every_connection_of_the_domain() {
        let d = FlushDomain::default();
        d.connected(1);
        // Two queues' connections acknowledge writes; one FLUSHes.
        d.acknowledged();
        d.acknowledged();
        d.flush_done(d.flush_start().unwrap()).unwrap();
        // A later restart finds nothing unflushed.
        d.connected(2);
        d.flush_start().unwrap();
    }
}
