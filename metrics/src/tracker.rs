//! In-flight request trackers: one fixed slot per (queue, tag).
//!
//! ublk hands each queue a fixed set of tags and never reuses a tag before
//! its request completes, so a slot per (queue, tag) is enough to know every
//! request in flight. Setting and clearing a slot is a few atomic stores on
//! memory owned by the queue thread: no map, no hashing, no lock, no
//! allocation. The scanner reads the slots every few seconds.

use crate::clock::Clock;
use crate::correlation::CorrelationId;
use crate::device_io::IoMetrics;
use crate::events;
use crate::labels::{validate_target, IoOp, LabelError};
use std::ops::Deref;
use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Most slots one table may hold (ublk allows 4096 queues x 4096 tags, far
/// more than any device uses); bounds the table's memory to 32 MiB.
pub const MAX_SLOTS: usize = 1 << 20;

/// Errors of creating a table or starting a request.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TrackerError {
    /// Queue or tag outside the table's geometry.
    #[error(
        "slot (queue {queue}, tag {tag}) is outside the table of {queues} queues x {depth} tags"
    )]
    OutOfRange {
        /// Requested queue.
        queue: u16,
        /// Requested tag.
        tag: u16,
        /// Queues in the table.
        queues: u16,
        /// Tags per queue.
        depth: u16,
    },
    /// A request started on a slot whose previous request never finished:
    /// a tag was reused before completion, which ublk does not do.
    #[error("slot (queue {queue}, tag {tag}) is already tracking a request")]
    SlotBusy {
        /// Queue.
        queue: u16,
        /// Tag.
        tag: u16,
    },
    /// Zero queues or tags, or more than [`MAX_SLOTS`] slots.
    #[error("tracker geometry {queues} queues x {depth} tags is empty or above {MAX_SLOTS} slots")]
    Geometry {
        /// Queues requested.
        queues: u16,
        /// Tags per queue requested.
        depth: u16,
    },
    /// The target label is invalid.
    #[error(transparent)]
    Label(#[from] LabelError),
}

#[derive(Debug, Default)]
pub(crate) struct Slot {
    // Monotonic ns of the start; 0 = idle. Written last on start (Release)
    // so a reader that sees it also sees op and corr.
    pub(crate) start_ns: AtomicU64,
    pub(crate) corr: AtomicU64,
    pub(crate) op: AtomicU8,
    // Correlation id whose stall was already logged; ids are unique, so it
    // needs no reset when the slot is reused.
    pub(crate) stuck_logged: AtomicU64,
}

/// Configuration of one tracker table.
#[derive(Debug, Clone)]
pub struct TrackerConfig {
    /// Target label (`arena`, `mem`, ...).
    pub target: String,
    /// Device label, when per-device labels are enabled (as for
    /// [`IoMetrics::new`]); also logged in `request.slow` / `request.stuck`.
    pub device: Option<u32>,
    /// Number of hardware queues.
    pub queues: u16,
    /// Tags per queue (queue depth).
    pub depth: u16,
    /// Completions at or above this latency log `request.slow`; `None`
    /// disables the check.
    pub slow_threshold: Option<Duration>,
}

fn threshold_ns(threshold: Option<Duration>) -> u64 {
    threshold.map_or(0, |d| {
        u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
    })
}

/// The in-flight slots of one device's target.
pub struct TrackerTable {
    target: Box<str>,
    device: Option<u32>,
    log_device: Option<u32>,
    queues: u16,
    depth: u16,
    /// 0: off. Changed at run time by [`TrackerTable::set_slow_threshold`].
    slow_threshold_ns: AtomicU64,
    slots: Box<[Slot]>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for TrackerTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackerTable")
            .field("target", &self.target)
            .field("device", &self.device)
            .field("queues", &self.queues)
            .field("depth", &self.depth)
            .finish_non_exhaustive()
    }
}

impl TrackerTable {
    /// Allocates the slots. `log_device` is the device id used in log events
    /// even when it is not a metric label.
    pub fn new(
        config: TrackerConfig,
        log_device: Option<u32>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, TrackerError> {
        validate_target(&config.target)?;
        let n = usize::from(config.queues) * usize::from(config.depth);
        if n == 0 || n > MAX_SLOTS {
            return Err(TrackerError::Geometry {
                queues: config.queues,
                depth: config.depth,
            });
        }
        let slots: Box<[Slot]> = (0..n).map(|_| Slot::default()).collect();
        Ok(TrackerTable {
            target: config.target.into_boxed_str(),
            device: config.device,
            log_device: log_device.or(config.device),
            queues: config.queues,
            depth: config.depth,
            slow_threshold_ns: AtomicU64::new(threshold_ns(config.slow_threshold)),
            slots,
            clock,
        })
    }

    /// Changes the `request.slow` threshold (`None`: off) for requests
    /// completing from now on.
    pub fn set_slow_threshold(&self, threshold: Option<Duration>) {
        self.slow_threshold_ns
            .store(threshold_ns(threshold), Ordering::Relaxed);
    }

    /// Target label.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// Device label (only with per-device labels).
    pub fn device(&self) -> Option<u32> {
        self.device
    }

    pub(crate) fn log_device(&self) -> Option<u32> {
        self.log_device
    }

    pub(crate) fn slots(&self) -> &[Slot] {
        &self.slots
    }

    pub(crate) fn clock(&self) -> &dyn Clock {
        &*self.clock
    }

    /// Counts this table's requests in flight now, those pending at least
    /// `stall_threshold`, and the oldest one's age. O(slots): for
    /// `ublkctl stats` and `/diagnostics`, never for the I/O path or
    /// `/ready`.
    pub fn snapshot(&self, stall_threshold: Duration) -> TableSnapshot {
        let threshold_ns = u64::try_from(stall_threshold.as_nanos()).unwrap_or(u64::MAX);
        let now = self.clock.now_ns();
        let mut snap = TableSnapshot::default();
        for slot in self.slots.iter() {
            let Some(s) = slot.sample() else { continue };
            let age = now.saturating_sub(s.start_ns);
            snap.inflight += 1;
            if age >= threshold_ns {
                snap.stalled += 1;
            }
            snap.oldest = snap.oldest.max(Duration::from_nanos(age));
        }
        snap
    }

    /// Marks (queue, tag) in flight and returns the guard that clears it.
    #[inline]
    pub fn start(
        &self,
        queue: u16,
        tag: u16,
        op: IoOp,
    ) -> Result<TrackerGuard<&TrackerTable>, TrackerError> {
        let (index, start_ns, corr) = self.claim(queue, tag, op)?;
        Ok(TrackerGuard {
            table: self,
            index,
            start_ns,
            op,
            corr,
        })
    }

    /// Like [`Self::start`], with a guard that owns a reference to the table,
    /// for futures that must be `'static`.
    #[inline]
    pub fn start_shared(
        self: &Arc<Self>,
        queue: u16,
        tag: u16,
        op: IoOp,
    ) -> Result<TrackerGuard<Arc<TrackerTable>>, TrackerError> {
        let (index, start_ns, corr) = self.claim(queue, tag, op)?;
        Ok(TrackerGuard {
            table: Arc::clone(self),
            index,
            start_ns,
            op,
            corr,
        })
    }

    #[inline]
    fn claim(
        &self,
        queue: u16,
        tag: u16,
        op: IoOp,
    ) -> Result<(u32, u64, CorrelationId), TrackerError> {
        if queue >= self.queues || tag >= self.depth {
            return Err(TrackerError::OutOfRange {
                queue,
                tag,
                queues: self.queues,
                depth: self.depth,
            });
        }
        let index = usize::from(queue) * usize::from(self.depth) + usize::from(tag);
        let slot = &self.slots[index];
        // The slot belongs to the queue thread that owns the tag, so a load
        // and a store suffice; no read-modify-write needed.
        if slot.start_ns.load(Ordering::Relaxed) != 0 {
            return Err(TrackerError::SlotBusy { queue, tag });
        }
        let corr = CorrelationId::next();
        let now = self.clock.now_ns().max(1);
        slot.op.store(op.index() as u8, Ordering::Relaxed);
        slot.corr.store(corr.get(), Ordering::Relaxed);
        slot.start_ns.store(now, Ordering::Release);
        // MAX_SLOTS < 2^32, checked in new().
        Ok((index as u32, now, corr))
    }
}

/// One table's in-flight requests at an instant ([`TrackerTable::snapshot`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableSnapshot {
    /// Requests in flight.
    pub inflight: u64,
    /// Requests pending at least the stall threshold.
    pub stalled: u64,
    /// Age of the oldest request in flight (zero when none).
    pub oldest: Duration,
}

/// Clears its slot when dropped: on completion through
/// [`TrackerGuard::complete`], or on cancellation when the future holding it
/// is dropped.
#[must_use = "dropping the guard immediately untracks the request"]
pub struct TrackerGuard<T: Deref<Target = TrackerTable>> {
    table: T,
    index: u32,
    start_ns: u64,
    op: IoOp,
    corr: CorrelationId,
}

impl<T: Deref<Target = TrackerTable>> std::fmt::Debug for TrackerGuard<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackerGuard")
            .field("index", &self.index)
            .field("op", &self.op)
            .field("corr", &self.corr)
            .finish()
    }
}

impl<T: Deref<Target = TrackerTable>> TrackerGuard<T> {
    /// The request's correlation id, for the daemon's own log events.
    pub fn correlation_id(&self) -> CorrelationId {
        self.corr
    }

    /// The tracked op.
    pub fn op(&self) -> IoOp {
        self.op
    }

    /// Time since start, by the table's clock.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.table.clock.now_ns().saturating_sub(self.start_ns))
    }

    /// Completes the request: accounts it in `io` (count, bytes or errno
    /// class, latency), logs `request.slow` past the slow threshold, and
    /// clears the slot. Returns the latency.
    #[inline]
    pub fn complete(self, io: &IoMetrics, bytes: u64, result: Result<(), i32>) -> Duration {
        let table = &*self.table;
        let ns = table.clock.now_ns().saturating_sub(self.start_ns);
        io.record_ns(self.op, bytes, result, ns);
        let latency = Duration::from_nanos(ns);
        let slow = table.slow_threshold_ns.load(Ordering::Relaxed);
        if slow != 0 && ns >= slow {
            events::request_slow(self.corr, &table.target, table.log_device, self.op, latency);
        }
        latency
        // Drop clears the slot.
    }
}

impl<T: Deref<Target = TrackerTable>> Drop for TrackerGuard<T> {
    #[inline]
    fn drop(&mut self) {
        self.table.slots[self.index as usize]
            .start_ns
            .store(0, Ordering::Release);
    }
}

/// What a scan reads from one busy slot.
pub(crate) struct SlotSample {
    pub(crate) start_ns: u64,
    pub(crate) op: IoOp,
    pub(crate) corr: u64,
}

impl Slot {
    /// Reads the slot; `None` when idle or when it changed while being read
    /// (the request completed and maybe another started: the next scan sees
    /// the new one).
    pub(crate) fn sample(&self) -> Option<SlotSample> {
        let start_ns = self.start_ns.load(Ordering::Acquire);
        if start_ns == 0 {
            return None;
        }
        let op = IoOp::from_index(self.op.load(Ordering::Relaxed));
        let corr = self.corr.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if self.start_ns.load(Ordering::Relaxed) != start_ns {
            return None;
        }
        Some(SlotSample { start_ns, op, corr })
    }
}
