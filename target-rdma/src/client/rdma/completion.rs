//! Completion bookkeeping for one QP: wr id → waiter, per-operation
//! deadlines, and who reaps the completion queue: a thread that sleeps on
//! the completion channel, or (driven, `driver.rs`) the owner's event loop.
//!
//! Many operations are in flight at once (bounded by the send queue depth);
//! each posts under a short table lock and awaits a oneshot that the reaper
//! fires, so any executor (a ublk queue's io_uring loop included) can await
//! it. The thread sleeps on the channel fd when idle: no busy polling.
//!
//! A failed completion leaves an RC QP in the error state, so the first
//! failure marks the engine broken: nothing more is posted, and the
//! remaining work requests come back flushed. A deadline that passes moves
//! the QP to the error state *before* the waiter hears about it, so the
//! device no longer touches the waiter's buffer once it has been told.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Waker;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use parking_lot::Mutex;

use super::stats::RdmaStats;
use crate::client::driven::{Engine, TICK};
use crate::rdma::{Completion, QueuePair, RdmaError, WcCategory, WorkRequest};

/// Why one work request did not succeed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// The work completion carried an error status.
    #[error("work completion error {} (status {status})", category.name())]
    Wc {
        /// Its category.
        category: WcCategory,
        /// The raw `ibv_wc_status`.
        status: u32,
    },
    /// No completion arrived before the deadline.
    #[error("no work completion within {0:?}")]
    TimedOut(Duration),
    /// The QP was already broken or shut down; nothing was posted.
    #[error("QP unusable: {0}")]
    QpDown(String),
}

struct Waiter {
    deadline: Instant,
    tx: oneshot::Sender<Result<(), OpError>>,
}

#[derive(Default)]
struct Table {
    waiting: HashMap<u64, Waiter>,
    next_wr: u64,
    broken: Option<String>,
}

/// The bookkeeping of one QP.
pub struct CompletionEngine {
    qp: Arc<dyn QueuePair>,
    table: Mutex<Table>,
    depth: u32,
    timeout: Duration,
    stats: Arc<RdmaStats>,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// A driven engine's reaper, parked while nothing was in flight: the
    /// next submit (or the shutdown) wakes it.
    parked: Mutex<Option<Waker>>,
}

impl CompletionEngine {
    /// Bookkeeping for `qp`, at most `depth` requests in flight, each with `timeout`.
    pub fn new(
        qp: Arc<dyn QueuePair>,
        depth: u32,
        timeout: Duration,
        stats: Arc<RdmaStats>,
    ) -> Arc<Self> {
        Arc::new(Self {
            qp,
            table: Mutex::new(Table {
                next_wr: 1,
                ..Table::default()
            }),
            depth,
            timeout,
            stats,
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            parked: Mutex::new(None),
        })
    }

    /// Starts the completion thread.
    pub fn spawn(self: &Arc<Self>) -> Result<(), RdmaError> {
        let me = Arc::clone(self);
        let h = thread::Builder::new()
            .name("rdma-cq".into())
            .spawn(move || me.run())
            .map_err(|e| RdmaError::Verbs {
                step: "spawn completion thread",
                detail: e.to_string(),
            })?;
        *self.thread.lock() = Some(h);
        Ok(())
    }

    fn run(&self) {
        let mut buf = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            self.pump(&mut buf);
            let idle = self.table.lock().waiting.is_empty();
            // Idle: sleep on the channel; busy: wake at least every TICK for deadlines.
            let wait = if idle {
                Duration::from_millis(500)
            } else {
                TICK
            };
            if self.qp.wait(wait).is_err() {
                self.fail("waiting for completion events failed");
            }
        }
    }

    /// Dispatches every ready completion and expires overdue requests.
    pub fn pump(&self, buf: &mut Vec<Completion>) {
        self.deliver(buf);
        self.expire(Instant::now());
    }

    /// Dispatches every ready completion; how many there were.
    pub(super) fn deliver(&self, buf: &mut Vec<Completion>) -> usize {
        buf.clear();
        if let Err(e) = self.qp.poll(buf) {
            self.fail(&e.to_string());
        }
        let n = buf.len();
        for c in buf.drain(..) {
            self.complete(c);
        }
        n
    }

    /// The QP, for a driven reaper's channel.
    pub(super) fn qp(&self) -> &dyn QueuePair {
        self.qp.as_ref()
    }

    /// A driven reaper with nothing to reap: `waker` runs at the next
    /// submit or at shutdown.
    pub(super) fn park(&self, waker: &Waker) {
        *self.parked.lock() = Some(waker.clone());
    }

    fn unpark(&self) {
        let w = self.parked.lock().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Whether a failure has put the QP out of service.
    pub fn broken(&self) -> Option<String> {
        self.table.lock().broken.clone()
    }

    /// Puts the QP out of service (error state): for failures and for
    /// requests abandoned mid-flight, whose buffers the device must stop touching.
    pub fn fail(&self, why: &str) {
        let first = {
            let mut t = self.table.lock();
            let first = t.broken.is_none();
            if first {
                t.broken = Some(why.to_owned());
            }
            first
        };
        if first {
            self.qp.fail();
        }
    }

    /// Posts `wr` under a fresh wr id; the receiver resolves on its completion.
    pub fn submit(
        &self,
        mut wr: WorkRequest,
    ) -> Result<oneshot::Receiver<Result<(), OpError>>, OpError> {
        let (tx, rx) = oneshot::channel();
        let mut t = self.table.lock();
        if let Some(why) = &t.broken {
            return Err(OpError::QpDown(why.clone()));
        }
        if t.waiting.len() >= self.depth as usize {
            return Err(OpError::QpDown(
                RdmaError::QueueFull { depth: self.depth }.to_string(),
            ));
        }
        wr.wr_id = t.next_wr;
        t.next_wr = t.next_wr.wrapping_add(1).max(1);
        t.waiting.insert(
            wr.wr_id,
            Waiter {
                deadline: Instant::now() + self.timeout,
                tx,
            },
        );
        // Posting under the table lock keeps wr ids and posts in one order
        // and lets a completion never race its own registration.
        if let Err(e) = self.qp.post(&wr) {
            t.waiting.remove(&wr.wr_id);
            let why = e.to_string();
            drop(t);
            self.fail(&why);
            return Err(OpError::QpDown(why));
        }
        drop(t);
        self.stats
            .inc_op(wr.op, |s| &s.rdma_requests, |o| &o.requests);
        self.unpark();
        Ok(rx)
    }

    fn complete(&self, c: Completion) {
        let Some(w) = self.table.lock().waiting.remove(&c.wr_id) else {
            self.stats.inc(|s| &s.unknown_completions);
            return;
        };
        let r = match WcCategory::from_status(c.status) {
            None => Ok(()),
            Some(category) => {
                self.stats.wc_error(category);
                self.fail(&format!("work completion error {}", category.name()));
                Err(OpError::Wc {
                    category,
                    status: c.status,
                })
            }
        };
        let _ = w.tx.send(r);
    }

    /// Fails every request whose deadline is at or before `now`.
    pub fn expire(&self, now: Instant) {
        let overdue: Vec<u64> = {
            let t = self.table.lock();
            t.waiting
                .iter()
                .filter(|(_, w)| w.deadline <= now)
                .map(|(id, _)| *id)
                .collect()
        };
        if overdue.is_empty() {
            return;
        }
        // Stop the device first: after this no buffer of these requests is touched.
        self.fail("a work request timed out");
        for id in overdue {
            if let Some(w) = self.table.lock().waiting.remove(&id) {
                let _ = w.tx.send(Err(OpError::TimedOut(self.timeout)));
            }
        }
    }

    /// Stops the thread, errors the QP and fails whatever is still waiting.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        self.unpark();
        self.fail("rail shut down");
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
        let rest: Vec<Waiter> = self.table.lock().waiting.drain().map(|(_, w)| w).collect();
        for w in rest {
            let _ = w.tx.send(Err(OpError::QpDown("rail shut down".into())));
        }
    }
}

impl Engine for CompletionEngine {
    /// Requests in flight.
    fn in_flight(&self) -> usize {
        self.table.lock().waiting.len()
    }

    /// Whether [`shutdown`](CompletionEngine::shutdown) ran.
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Endpoint;
    use crate::rdma::{wc_status, RdmaOp};
    use futures::executor::block_on;

    /// A QP that records posts and completes only what the test says.
    #[derive(Default)]
    struct ScriptedQp {
        posted: Mutex<Vec<WorkRequest>>,
        ready: Mutex<Vec<Completion>>,
        failed: AtomicBool,
        refuse_post: AtomicBool,
    }

    impl QueuePair for ScriptedQp {
        fn endpoint(&self) -> Endpoint {
            Endpoint {
                qpn: 1,
                psn: 1,
                lid: 0,
                mtu: 3,
                gid: [0; 16],
            }
        }
        fn connect(&self, _: &Endpoint) -> Result<(), RdmaError> {
            Ok(())
        }
        fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError> {
            if self.refuse_post.load(Ordering::Relaxed) {
                return Err(RdmaError::QueueFull { depth: 0 });
            }
            self.posted.lock().push(*wr);
            Ok(())
        }
        fn wait(&self, _: Duration) -> Result<(), RdmaError> {
            Ok(())
        }
        fn event_fd(&self) -> std::os::fd::RawFd {
            -1
        }
        fn arm(&self) -> Result<(), RdmaError> {
            Ok(())
        }
        fn take_event(&self) -> Result<bool, RdmaError> {
            Ok(false)
        }
        fn poll(&self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
            out.append(&mut self.ready.lock());
            Ok(())
        }
        fn fail(&self) {
            self.failed.store(true, Ordering::Relaxed);
        }
    }

    fn wr() -> WorkRequest {
        WorkRequest {
            wr_id: 0,
            op: RdmaOp::Write,
            local_addr: 0,
            lkey: 1,
            len: 8,
            remote_addr: 0,
            rkey: 2,
        }
    }

    fn engine(depth: u32) -> (Arc<ScriptedQp>, Arc<CompletionEngine>, Arc<RdmaStats>) {
        let qp = Arc::new(ScriptedQp::default());
        let stats = Arc::new(RdmaStats::default());
        let e = CompletionEngine::new(qp.clone(), depth, Duration::from_secs(3600), stats.clone());
        (qp, e, stats)
    }

    #[test]
    fn completions_wake_exactly_their_waiters_in_any_order() {
        let (qp, e, stats) = engine(8);
        let rxs: Vec<_> = (0..4).map(|_| e.submit(wr()).unwrap()).collect();
        let ids: Vec<u64> = qp.posted.lock().iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, [1, 2, 3, 4]);
        // Complete out of order, plus one id nobody waits for.
        for id in [3, 1, 99, 4, 2] {
            qp.ready.lock().push(Completion {
                wr_id: id,
                status: wc_status::SUCCESS,
            });
        }
        e.pump(&mut Vec::new());
        for rx in rxs {
            assert_eq!(block_on(rx).unwrap(), Ok(()));
        }
        assert_eq!(e.in_flight(), 0);
        assert_eq!(stats.unknown_completions.load(Ordering::Relaxed), 1);
        assert_eq!(stats.rdma_requests.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn depth_bounds_the_requests_in_flight() {
        let (_qp, e, _) = engine(2);
        let _a = e.submit(wr()).unwrap();
        let _b = e.submit(wr()).unwrap();
        assert!(matches!(e.submit(wr()), Err(OpError::QpDown(m)) if m.contains("queue full")));
    }

    #[test]
    fn an_error_completion_breaks_the_qp_and_flushes_follow() {
        let (qp, e, stats) = engine(8);
        let a = e.submit(wr()).unwrap();
        let b = e.submit(wr()).unwrap();
        qp.ready.lock().extend([
            Completion {
                wr_id: 1,
                status: wc_status::RETRY_EXC_ERR,
            },
            Completion {
                wr_id: 2,
                status: wc_status::WR_FLUSH_ERR,
            },
        ]);
        e.pump(&mut Vec::new());
        assert_eq!(
            block_on(a).unwrap(),
            Err(OpError::Wc {
                category: WcCategory::RetryExceeded,
                status: wc_status::RETRY_EXC_ERR
            })
        );
        assert!(matches!(
            block_on(b).unwrap(),
            Err(OpError::Wc {
                category: WcCategory::Flush,
                ..
            })
        ));
        assert!(qp.failed.load(Ordering::Relaxed));
        assert!(e.broken().is_some());
        assert!(matches!(e.submit(wr()), Err(OpError::QpDown(_))));
        assert_eq!(stats.wc_errors[0].load(Ordering::Relaxed), 1);
        assert_eq!(stats.wc_errors[4].load(Ordering::Relaxed), 1);
    }

    #[test]
    fn overdue_requests_fail_the_qp_before_their_waiters_hear() {
        let (qp, e, _) = engine(8);
        let rx = e.submit(wr()).unwrap();
        e.expire(Instant::now() + Duration::from_secs(7200));
        assert!(qp.failed.load(Ordering::Relaxed));
        assert!(matches!(block_on(rx).unwrap(), Err(OpError::TimedOut(_))));
        // A completion arriving after the timeout finds no waiter: never delivered twice.
        qp.ready.lock().push(Completion {
            wr_id: 1,
            status: wc_status::WR_FLUSH_ERR,
        });
        e.pump(&mut Vec::new());
        assert_eq!(e.in_flight(), 0);
    }

    #[test]
    fn a_refused_post_leaves_no_waiter_behind() {
        let (qp, e, stats) = engine(8);
        qp.refuse_post.store(true, Ordering::Relaxed);
        assert!(matches!(e.submit(wr()), Err(OpError::QpDown(_))));
        assert_eq!(e.in_flight(), 0);
        assert_eq!(stats.rdma_requests.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn shutdown_fails_what_is_still_waiting() {
        let (_qp, e, _) = engine(8);
        let rx = e.submit(wr()).unwrap();
        e.shutdown();
        assert!(matches!(block_on(rx).unwrap(), Err(OpError::QpDown(_))));
    }
}
