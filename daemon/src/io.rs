//! The I/O plane's logic, kept free of io_uring and the kernel so plain
//! `cargo test` can drive it: a ublk I/O descriptor goes in, a
//! [`BlockTarget`] call happens, and a completion result (bytes or
//! `-errno`) comes out. The queue loop (`queue.rs`) only moves descriptors
//! and buffers between the kernel and [`serve`].

use libublk::sys;
use target_rdma::blob::Via;
use target_rdma::block::{BlockTarget, TargetError};
use ublk_metrics::{FailureCause, IoOp};

use crate::observability::{DeviceObs, Failure};

/// What the kernel put in the queue's descriptor array for one tag, copied
/// out so the request can be served without holding a reference into the
/// shared mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoDesc {
    /// Operation in the low 8 bits, `UBLK_IO_F_*` flags above.
    pub op_flags: u32,
    /// First 512-byte sector.
    pub start_sector: u64,
    /// Length in 512-byte sectors.
    pub nr_sectors: u32,
}

impl From<&sys::ublksrv_io_desc> for IoDesc {
    fn from(d: &sys::ublksrv_io_desc) -> Self {
        Self {
            op_flags: d.op_flags,
            start_sector: d.start_sector,
            nr_sectors: d.nr_sectors,
        }
    }
}

/// A decoded request, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoRequest {
    /// Read `len` bytes at `offset` into the tag's buffer.
    Read {
        /// Start byte.
        offset: u64,
        /// Length in bytes.
        len: usize,
    },
    /// Write `len` bytes from the tag's buffer at `offset`.
    Write {
        /// Start byte.
        offset: u64,
        /// Length in bytes.
        len: usize,
        /// Forced unit access: durable before completion.
        fua: bool,
    },
    /// Make completed writes durable.
    Flush,
    /// Drop the range.
    Discard {
        /// Start byte.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// Zero the range.
    WriteZeroes {
        /// Start byte.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
}

impl IoRequest {
    /// Bytes the request moves or affects.
    pub fn bytes(&self) -> u64 {
        match *self {
            Self::Read { len, .. } | Self::Write { len, .. } => len as u64,
            Self::Flush => 0,
            Self::Discard { len, .. } | Self::WriteZeroes { len, .. } => len,
        }
    }
}

/// Decodes a descriptor. `buf_len` is the tag's buffer size: a data
/// request larger than it would overrun the buffer, so it is refused
/// (`EIO`) instead of trusted. Unknown ops get `EOPNOTSUPP`.
pub fn decode(desc: &IoDesc, buf_len: usize) -> Result<IoRequest, i32> {
    let op = desc.op_flags & 0xff;
    // A FLUSH carries no range: the kernel leaves its sector fields as
    // garbage (observed: start_sector = u64::MAX), so they are not read.
    if op == sys::UBLK_IO_OP_FLUSH {
        return Ok(IoRequest::Flush);
    }
    let offset = desc.start_sector.checked_mul(512).ok_or(libc::EIO)?;
    let len = u64::from(desc.nr_sectors) * 512;
    let data_len = || {
        usize::try_from(len)
            .ok()
            .filter(|l| *l <= buf_len)
            .ok_or(libc::EIO)
    };
    match op {
        sys::UBLK_IO_OP_READ => Ok(IoRequest::Read {
            offset,
            len: data_len()?,
        }),
        sys::UBLK_IO_OP_WRITE => Ok(IoRequest::Write {
            offset,
            len: data_len()?,
            fua: desc.op_flags & sys::UBLK_IO_F_FUA != 0,
        }),
        sys::UBLK_IO_OP_DISCARD => Ok(IoRequest::Discard { offset, len }),
        sys::UBLK_IO_OP_WRITE_ZEROES => Ok(IoRequest::WriteZeroes { offset, len }),
        _ => Err(libc::EOPNOTSUPP),
    }
}

/// The metrics op of a ublk op code, `None` for ops ublkd does not serve.
pub fn metrics_op(op_flags: u32) -> Option<IoOp> {
    match op_flags & 0xff {
        sys::UBLK_IO_OP_READ => Some(IoOp::Read),
        sys::UBLK_IO_OP_WRITE => Some(IoOp::Write),
        sys::UBLK_IO_OP_FLUSH => Some(IoOp::Flush),
        sys::UBLK_IO_OP_DISCARD => Some(IoOp::Discard),
        sys::UBLK_IO_OP_WRITE_ZEROES => Some(IoOp::WriteZeroes),
        _ => None,
    }
}

/// How a failed request failed: its errno, where it belongs in the failure
/// taxonomy of `docs/METRICS.md`, and whether the arena connection is gone.
pub fn classify(e: &TargetError) -> Failure {
    let cause = match e {
        TargetError::OutOfRange { .. } => FailureCause::PostProtocol,
        TargetError::Arena { op, source } => source.kind().blame(*op),
    };
    let peer_gone = match e {
        TargetError::OutOfRange { .. } => false,
        TargetError::Arena { source, .. } => source.kind().peer_gone(),
    };
    Failure {
        errno: e.errno(),
        cause,
        peer_gone,
    }
}

/// Runs a decoded request against `target`.
async fn execute<T: BlockTarget>(
    target: &T,
    req: IoRequest,
    buf: &mut [u8],
) -> Result<Via, TargetError> {
    match req {
        IoRequest::Read { offset, len } => target.read(offset, &mut buf[..len]).await,
        IoRequest::Write { offset, len, fua } => target.write(offset, &buf[..len], fua).await,
        IoRequest::Flush => target.flush().await,
        IoRequest::Discard { offset, len } => target.discard(offset, len).await,
        IoRequest::WriteZeroes { offset, len } => target.write_zeroes(offset, len).await,
    }
}

/// Serves one descriptor of (`queue`, `tag`) against `target` and returns
/// what the kernel gets as the command result: bytes transferred for
/// READ/WRITE, 0 for the others, `-errno` on failure. It always returns
/// (the target's own timeouts bound the wait).
///
/// Decode, call, classify, complete: everything observed about the request
/// (tracker slot, device I/O families, request/attempt accounting,
/// `ublkctl stats`, events) is recorded by its [`RequestObs`](crate::observability::RequestObs), once.
/// Nothing here allocates or formats unless the request fails.
pub async fn serve<T: BlockTarget>(
    target: &T,
    desc: &IoDesc,
    buf: &mut [u8],
    dev: &DeviceObs,
    queue: u16,
    tag: u16,
) -> i32 {
    let Some(op) = metrics_op(desc.op_flags) else {
        dev.unsupported(desc.op_flags);
        return -libc::EOPNOTSUPP;
    };
    let obs = dev.begin(queue, tag, op, target.transport());
    let req = match decode(desc, buf.len()) {
        Ok(r) => r,
        Err(errno) => {
            obs.rejected(errno, desc.op_flags, desc.start_sector, desc.nr_sectors);
            return -errno;
        }
    };
    let obs = obs.dispatched();
    match execute(target, req, buf).await {
        Ok(via) => {
            obs.succeeded(req.bytes(), via);
            match req {
                // Bounded by the buffer size, which fits an i32 (libublk caps it).
                IoRequest::Read { len, .. } | IoRequest::Write { len, .. } => len as i32,
                _ => 0,
            }
        }
        Err(e) => {
            let failure = classify(&e);
            obs.failed(&failure, &e);
            -failure.errno
        }
    }
}

#[cfg(test)]
mod tests {
    //! A fake queue: the same descriptors and per-tag buffers the kernel
    //! would hand a queue thread, driven through [`serve`].
    use std::cell::RefCell;
    use std::sync::Arc;

    use futures::executor::LocalPool;
    use std::time::Duration;

    use target_rdma::blob::ArenaError;
    use target_rdma::block::MemTarget;
    use ublk_metrics::testing::sample;
    use ublk_metrics::Transport as MetricsTransport;
    use ublk_metrics::{Daemon, Phase, Reason, Telemetry};

    use super::*;
    use crate::config::{MetricsConfig, TransportChoice};
    use crate::observability::{DevState, DeviceShape, Observability};

    const DEPTH: usize = 4;
    const BUF: usize = 64 * 1024;

    /// Per-tag buffers and the completions posted so far.
    struct FakeQueue<T> {
        target: T,
        obs: Arc<Observability>,
        dev: Arc<DeviceObs>,
        bufs: Vec<RefCell<Vec<u8>>>,
    }

    fn desc(op: u32, flags: u32, sector: u64, sectors: u32) -> IoDesc {
        IoDesc {
            op_flags: op | flags,
            start_sector: sector,
            nr_sectors: sectors,
        }
    }

    impl<T: BlockTarget> FakeQueue<T> {
        fn new(target: T) -> Self {
            Self::with_tracing(target, &crate::config::TracingConfig::default())
        }

        /// With `tracing`, `/metrics/openmetrics` on and the default slow
        /// threshold (5 s).
        fn with_tracing(target: T, tracing: &crate::config::TracingConfig) -> Self {
            let metrics = MetricsConfig {
                openmetrics: true,
                ..MetricsConfig::default()
            };
            let obs = Observability::new(
                Telemetry::isolated(Daemon::Ublkd, "test"),
                &metrics,
                tracing,
            );
            let dev = obs
                .register(
                    DeviceShape {
                        id: 0,
                        queues: 1,
                        depth: DEPTH as u16,
                        transport: TransportChoice::Tcp,
                    },
                    DevState::Live,
                    Arc::default(),
                    None,
                    Arc::new(target_rdma::client::ClientStats::default()),
                )
                .unwrap();
            Self {
                target,
                obs,
                dev,
                bufs: (0..DEPTH).map(|_| RefCell::new(vec![0; BUF])).collect(),
            }
        }

        fn snapshot(&self) -> crate::device_stats::StatsSnapshot {
            self.dev.stats().snapshot()
        }

        fn metrics(&self) -> String {
            self.obs.telemetry().render().unwrap()
        }

        /// Issues one request on `tag` and runs it to completion.
        fn issue(&self, tag: usize, d: IoDesc) -> i32 {
            let mut buf = self.bufs[tag].borrow_mut();
            futures::executor::block_on(serve(&self.target, &d, &mut buf, &self.dev, 0, tag as u16))
        }

        /// Issues one request per tag concurrently, like a full queue.
        fn issue_all(&self, descs: &[IoDesc]) -> Vec<i32> {
            let mut pool = LocalPool::new();
            let results = RefCell::new(vec![i32::MIN; descs.len()]);
            let mut guards: Vec<_> = self.bufs.iter().map(|b| b.borrow_mut()).collect();
            let futs: Vec<_> = guards
                .iter_mut()
                .zip(descs)
                .enumerate()
                .map(|(i, (buf, d))| {
                    let results = &results;
                    let dev = &*self.dev;
                    let target = &self.target;
                    async move {
                        let r = serve(target, d, buf, dev, 0, i as u16).await;
                        results.borrow_mut()[i] = r;
                    }
                })
                .collect();
            pool.run_until(futures::future::join_all(futs));
            drop(guards);
            results.into_inner()
        }

        fn write(&self, tag: usize, sector: u64, data: &[u8], fua: bool) -> i32 {
            self.bufs[tag].borrow_mut()[..data.len()].copy_from_slice(data);
            let flags = if fua { sys::UBLK_IO_F_FUA } else { 0 };
            self.issue(
                tag,
                desc(
                    sys::UBLK_IO_OP_WRITE,
                    flags,
                    sector,
                    (data.len() / 512) as u32,
                ),
            )
        }

        fn read(&self, tag: usize, sector: u64, len: usize) -> (i32, Vec<u8>) {
            let r = self.issue(
                tag,
                desc(sys::UBLK_IO_OP_READ, 0, sector, (len / 512) as u32),
            );
            (r, self.bufs[tag].borrow()[..len].to_vec())
        }
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    #[test]
    fn write_then_read_round_trips() {
        let q = FakeQueue::new(MemTarget::new(1 << 20));
        let data = pattern(8192, 7);
        assert_eq!(q.write(0, 16, &data, false), 8192);
        let (r, got) = q.read(1, 16, 8192);
        assert_eq!(r, 8192);
        assert_eq!(got, data);
        let s = q.snapshot();
        assert_eq!((s.writes, s.reads), (1, 1));
        assert_eq!((s.bytes_written, s.bytes_read), (8192, 8192));
        assert_eq!((s.errors, s.in_flight), (0, 0));
    }

    #[test]
    fn fua_write_completes_and_is_counted() {
        let q = FakeQueue::new(MemTarget::new(1 << 20));
        assert_eq!(q.write(2, 0, &pattern(4096, 1), true), 4096);
        assert_eq!(q.read(0, 0, 4096).1, pattern(4096, 1));
        assert_eq!(q.snapshot().writes, 1);
    }

    #[test]
    fn flush_discard_and_write_zeroes() {
        let q = FakeQueue::new(MemTarget::new(1 << 20));
        q.write(0, 0, &pattern(16384, 3), false);
        assert_eq!(q.issue(0, desc(sys::UBLK_IO_OP_FLUSH, 0, 0, 0)), 0);
        // What the kernel really sends for a FLUSH: no range, garbage sector.
        assert_eq!(q.issue(0, desc(sys::UBLK_IO_OP_FLUSH, 0, u64::MAX, 0)), 0);
        assert_eq!(q.issue(1, desc(sys::UBLK_IO_OP_DISCARD, 0, 0, 8)), 0);
        assert_eq!(q.issue(2, desc(sys::UBLK_IO_OP_WRITE_ZEROES, 0, 24, 8)), 0);
        let (_, got) = q.read(3, 0, 16384);
        assert!(
            got[..4096].iter().all(|b| *b == 0),
            "discarded range reads zeros"
        );
        assert_eq!(got[4096..12288], pattern(16384, 3)[4096..12288]);
        assert!(
            got[12288..].iter().all(|b| *b == 0),
            "zeroed range reads zeros"
        );
        let s = q.snapshot();
        assert_eq!((s.flushes, s.discards, s.write_zeroes), (2, 1, 1));
        assert_eq!(s.bytes_discarded, 8192);
    }

    #[test]
    fn out_of_range_is_eio_and_counted() {
        let q = FakeQueue::new(MemTarget::new(64 * 1024));
        // Last 4 KiB straddles the end.
        let r = q.issue(0, desc(sys::UBLK_IO_OP_READ, 0, 120, 16));
        assert_eq!(r, -libc::EIO);
        let r = q.issue(0, desc(sys::UBLK_IO_OP_DISCARD, 0, 1 << 40, 8));
        assert_eq!(r, -libc::EIO);
        let s = q.snapshot();
        assert_eq!((s.errors, s.in_flight), (2, 0));
    }

    #[test]
    fn oversized_or_unknown_requests_are_refused_without_touching_the_target() {
        let q = FakeQueue::new(MemTarget::new(1 << 20));
        let too_big = (BUF / 512 + 8) as u32;
        assert_eq!(
            q.issue(0, desc(sys::UBLK_IO_OP_WRITE, 0, 0, too_big)),
            -libc::EIO
        );
        assert_eq!(
            q.issue(0, desc(sys::UBLK_IO_OP_WRITE_SAME, 0, 0, 8)),
            -libc::EOPNOTSUPP
        );
        assert_eq!(
            q.issue(0, desc(sys::UBLK_IO_OP_ZONE_APPEND, 0, 0, 8)),
            -libc::EOPNOTSUPP
        );
        assert_eq!(
            q.issue(0, desc(sys::UBLK_IO_OP_READ, 0, u64::MAX, 8)),
            -libc::EIO
        );
        assert_eq!(q.snapshot().errors, 4);
    }

    #[test]
    fn a_full_queue_of_concurrent_requests_completes() {
        let q = FakeQueue::new(MemTarget::new(1 << 20));
        for tag in 0..DEPTH {
            q.bufs[tag].borrow_mut()[..4096].copy_from_slice(&pattern(4096, tag as u8));
        }
        let writes: Vec<_> = (0..DEPTH)
            .map(|t| desc(sys::UBLK_IO_OP_WRITE, 0, t as u64 * 8, 8))
            .collect();
        assert_eq!(q.issue_all(&writes), vec![4096; DEPTH]);
        for tag in 0..DEPTH {
            assert_eq!(q.read(0, tag as u64 * 8, 4096).1, pattern(4096, tag as u8));
        }
    }

    /// An RDMA target whose every payload fails over to TCP.
    struct FailingOver(MemTarget);

    impl BlockTarget for FailingOver {
        fn transport(&self) -> MetricsTransport {
            MetricsTransport::Rdma
        }
        fn size(&self) -> u64 {
            self.0.size()
        }
        async fn read(&self, o: u64, b: &mut [u8]) -> Result<Via, TargetError> {
            self.0.read(o, b).await.map(|_| Via::Failover)
        }
        async fn write(&self, o: u64, b: &[u8], fua: bool) -> Result<Via, TargetError> {
            self.0.write(o, b, fua).await.map(|_| Via::Failover)
        }
        async fn flush(&self) -> Result<Via, TargetError> {
            self.0.flush().await
        }
        async fn discard(&self, o: u64, l: u64) -> Result<Via, TargetError> {
            self.0.discard(o, l).await
        }
        async fn write_zeroes(&self, o: u64, l: u64) -> Result<Via, TargetError> {
            self.0.write_zeroes(o, l).await
        }
    }

    #[test]
    fn a_failover_is_one_failed_rdma_attempt_one_tcp_attempt_and_one_failover() {
        let q = FakeQueue::new(FailingOver(MemTarget::new(1 << 20)));
        assert_eq!(q.write(0, 0, &pattern(4096, 1), false), 4096);
        assert_eq!(q.read(1, 0, 4096).1, pattern(4096, 1));
        let m = q.metrics();
        let s = |name, labels: &[(&str, &str)]| sample(&m, name, labels);
        let rdma = [("transport", "rdma")];
        assert_eq!(s("ublk_requests_started_total", &rdma), 2.0);
        assert_eq!(
            s(
                "ublk_request_outcomes_total",
                &[("transport", "rdma"), ("outcome", "success")]
            ),
            2.0
        );
        assert_eq!(
            s(
                "ublk_attempt_outcomes_total",
                &[("transport", "rdma"), ("outcome", "failure")]
            ),
            2.0
        );
        assert_eq!(
            s(
                "ublk_attempt_outcomes_total",
                &[("transport", "tcp"), ("outcome", "success")]
            ),
            2.0
        );
        assert_eq!(s("ublk_attempts_started_total", &[]), 4.0);
        assert_eq!(
            s(
                "ublk_failovers_total",
                &[("op", "write"), ("from", "rdma"), ("to", "tcp")]
            ),
            1.0
        );
        assert_eq!(s("ublk_failovers_total", &[]), 2.0);
    }

    /// The `span.*` records of trace `id` among `logs`.
    fn spans<'l>(logs: &'l [serde_json::Value], id: &str) -> Vec<&'l serde_json::Value> {
        logs.iter()
            .filter(|r| r["trace_id"] == id)
            .filter(|r| r["event"].as_str().is_some_and(|e| e.starts_with("span.")))
            .collect()
    }

    /// The exemplar trace id on the one bucket line of `family{labels}`
    /// that has one.
    fn exemplar_of(openmetrics: &str, family: &str, labels: &str) -> Option<String> {
        let prefix = format!("{family}_bucket{{{labels},le=");
        let mut found = openmetrics
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .filter_map(|l| l.split_once(" # {trace_id=\""))
            .map(|(_, rest)| rest[..32].to_string());
        let id = found.next();
        assert!(found.next().is_none(), "one exemplar per series here");
        id
    }

    #[test]
    fn a_failed_over_request_is_retained_with_both_attempts_and_is_the_exemplar() {
        let tracing = crate::config::TracingConfig {
            enabled: true,
            sample_rate_ppm: 0,
        };
        let q = FakeQueue::with_tracing(FailingOver(MemTarget::new(1 << 20)), &tracing);
        let ((), logs) = ublk_metrics::testing::capture_json_logs(|| {
            // Not sampled, fast, successful, no failover: not retained.
            assert_eq!(q.issue(0, desc(sys::UBLK_IO_OP_FLUSH, 0, 0, 0)), 0);
            assert_eq!(q.write(1, 0, &pattern(4096, 1), false), 4096);
        });
        let roots: Vec<_> = logs
            .iter()
            .filter(|r| r["event"] == ublk_metrics::events::SPAN_REQUEST)
            .collect();
        assert_eq!(roots.len(), 1, "only the failed-over write: {roots:#?}");
        let root = roots[0];
        assert_eq!(root["op"], "write");
        assert_eq!(root["target"], "arena", "one `target` key: the I/O target");
        assert_eq!(root["outcome"], "success");
        assert_eq!(root["retention"], "linked_child");
        let id = root["trace_id"].as_str().unwrap().to_string();
        assert_eq!(id.len(), 32);
        let corr = root["corr"].as_u64().unwrap();
        assert!(
            id.ends_with(&format!("{corr:016x}")),
            "{id} carries corr {corr}"
        );
        let spans = spans(&logs, &id);
        let attempts: Vec<(&str, &str, &str)> = spans
            .iter()
            .filter(|r| r["event"] == ublk_metrics::events::SPAN_ATTEMPT)
            .map(|r| {
                assert_eq!(r["parent_span_id"], root["span_id"]);
                (
                    r["transport"].as_str().unwrap(),
                    r["outcome"].as_str().unwrap(),
                    r["retention"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            attempts,
            [
                ("rdma", "failure", "error"),
                ("tcp", "success", "linked_child")
            ]
        );
        let om = q.obs.telemetry().render_openmetrics().unwrap();
        assert_eq!(
            exemplar_of(
                &om,
                "ublk_io_latency_seconds",
                r#"target="arena",op="write""#
            ),
            Some(id.clone())
        );
        assert_eq!(
            exemplar_of(
                &om,
                "ublk_attempt_latency_seconds",
                r#"op="write",transport="tcp""#
            ),
            Some(id),
            "the TCP attempt is timed; the failed RDMA one only the transport saw end"
        );
        assert_eq!(
            exemplar_of(
                &om,
                "ublk_io_latency_seconds",
                r#"target="arena",op="flush""#
            ),
            None
        );
    }

    #[test]
    fn failed_and_cancelled_requests_keep_their_spans_and_nothing_is_traced_when_off() {
        let on = crate::config::TracingConfig {
            enabled: true,
            sample_rate_ppm: 0,
        };
        let q = FakeQueue::with_tracing(BrokenTarget, &on);
        let (r, logs) = ublk_metrics::testing::capture_json_logs(|| {
            let r = q.issue(0, desc(sys::UBLK_IO_OP_READ, 0, 0, 8));
            // The queue goes down with a request at its target.
            let cancelled = q.dev.begin(0, 1, IoOp::Write, MetricsTransport::Tcp);
            drop(cancelled.dispatched());
            r
        });
        assert_eq!(r, -libc::ENOLINK);
        let roots: Vec<(&str, &str, &str, u64)> = logs
            .iter()
            .filter(|r| r["event"] == ublk_metrics::events::SPAN_REQUEST)
            .map(|r| {
                (
                    r["op"].as_str().unwrap(),
                    r["outcome"].as_str().unwrap(),
                    r["retention"].as_str().unwrap(),
                    r["attempts"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            roots,
            [
                ("read", "failure", "error", 1),
                ("write", "cancelled", "error", 1)
            ]
        );
        let failed = logs
            .iter()
            .find(|r| r["event"] == ublk_metrics::events::SPAN_ATTEMPT)
            .unwrap();
        assert_eq!(
            (&failed["phase"], &failed["reason"]),
            (
                &serde_json::json!("poll"),
                &serde_json::json!("peer_closed")
            )
        );

        let off = FakeQueue::new(BrokenTarget);
        let ((), logs) = ublk_metrics::testing::capture_json_logs(|| {
            off.issue(0, desc(sys::UBLK_IO_OP_READ, 0, 0, 8));
        });
        assert!(
            !logs
                .iter()
                .any(|r| r["event"].as_str().is_some_and(|e| e.starts_with("span."))),
            "tracing is off by default"
        );
    }

    /// Fails every request the way a dead arena connection does.
    struct BrokenTarget;

    fn broken(op: IoOp) -> TargetError {
        TargetError::Arena {
            op,
            source: ArenaError::Disconnected {
                peer: "10.0.0.1:7000".into(),
                detail: "reset by peer".into(),
            },
        }
    }

    impl BlockTarget for BrokenTarget {
        fn transport(&self) -> MetricsTransport {
            MetricsTransport::Tcp
        }
        fn size(&self) -> u64 {
            1 << 20
        }
        async fn read(&self, _: u64, _: &mut [u8]) -> Result<Via, TargetError> {
            Err(broken(IoOp::Read))
        }
        async fn write(&self, _: u64, _: &[u8], _: bool) -> Result<Via, TargetError> {
            Err(broken(IoOp::Write))
        }
        async fn flush(&self) -> Result<Via, TargetError> {
            Err(broken(IoOp::Flush))
        }
        async fn discard(&self, _: u64, _: u64) -> Result<Via, TargetError> {
            Err(broken(IoOp::Discard))
        }
        async fn write_zeroes(&self, _: u64, _: u64) -> Result<Via, TargetError> {
            Err(broken(IoOp::WriteZeroes))
        }
    }

    #[test]
    fn target_errors_complete_every_op_with_its_errno() {
        let q = FakeQueue::new(BrokenTarget);
        let ops = [
            sys::UBLK_IO_OP_READ,
            sys::UBLK_IO_OP_WRITE,
            sys::UBLK_IO_OP_FLUSH,
            sys::UBLK_IO_OP_DISCARD,
        ];
        let descs: Vec<_> = ops.iter().map(|op| desc(*op, 0, 0, 8)).collect();
        assert_eq!(q.issue_all(&descs), vec![-libc::ENOLINK; DEPTH]);
        assert_eq!(
            q.issue(0, desc(sys::UBLK_IO_OP_WRITE_ZEROES, 0, 0, 8)),
            -libc::ENOLINK
        );
        let s = q.snapshot();
        assert_eq!((s.errors, s.in_flight), (5, 0));
        assert_eq!(
            s.reads + s.writes + s.flushes + s.discards + s.write_zeroes,
            0
        );
    }

    #[test]
    fn every_request_is_counted_tracked_and_accounted() {
        let q = FakeQueue::new(MemTarget::new(1 << 20));
        q.write(0, 0, &pattern(8192, 1), false);
        q.read(1, 0, 4096);
        q.issue(2, desc(sys::UBLK_IO_OP_FLUSH, 0, u64::MAX, 0));
        q.issue(3, desc(sys::UBLK_IO_OP_DISCARD, 0, 0, 8));
        q.issue(0, desc(sys::UBLK_IO_OP_WRITE_ZEROES, 0, 8, 8));
        // Past the end: EIO from the target.
        q.issue(1, desc(sys::UBLK_IO_OP_READ, 0, 1 << 20, 8));
        let m = q.metrics();
        let io = |op: &str| {
            sample(
                &m,
                "ublk_io_requests_total",
                &[("target", "arena"), ("op", op)],
            )
        };
        assert_eq!(
            [
                io("read"),
                io("write"),
                io("flush"),
                io("discard"),
                io("write_zeroes")
            ],
            [2.0, 1.0, 1.0, 1.0, 1.0]
        );
        assert_eq!(
            sample(&m, "ublk_io_bytes_total", &[("op", "write")]),
            8192.0
        );
        assert_eq!(
            sample(&m, "ublk_io_bytes_total", &[("op", "read")]),
            4096.0,
            "a failed request adds no bytes"
        );
        assert_eq!(
            sample(
                &m,
                "ublk_io_errors_total",
                &[("op", "read"), ("errno", "eio")]
            ),
            1.0
        );
        assert_eq!(
            sample(&m, "ublk_io_latency_seconds_count", &[("op", "read")]),
            2.0
        );
        // started = outcomes + in flight, for requests and attempts, under
        // the transport the target names (the reference target's own).
        for (started, outcomes) in [
            ("ublk_requests_started_total", "ublk_request_outcomes_total"),
            ("ublk_attempts_started_total", "ublk_attempt_outcomes_total"),
        ] {
            let own = [("transport", "in_process")];
            assert_eq!(sample(&m, started, &own), 6.0);
            assert_eq!(sample(&m, outcomes, &own), 6.0);
            assert_eq!(sample(&m, started, &[("transport", "tcp")]), 0.0);
        }
        assert_eq!(
            sample(
                &m,
                "ublk_request_outcomes_total",
                &[
                    ("op", "read"),
                    ("transport", "in_process"),
                    ("outcome", "failure")
                ]
            ),
            1.0
        );
        let snap = q.dev.table().snapshot(Duration::from_secs(30));
        assert_eq!(snap.inflight, 0, "every slot was cleared");
        assert!(q.dev.peer_connected(), "answered requests mark the peer up");
    }

    #[test]
    fn a_lost_peer_clears_the_device_peer_flag_and_success_sets_it() {
        let q = FakeQueue::new(BrokenTarget);
        q.dev.peer_ok();
        assert!(q.dev.peer_connected());
        assert_eq!(
            q.issue(0, desc(sys::UBLK_IO_OP_READ, 0, 0, 8)),
            -libc::ENOLINK
        );
        assert!(!q.dev.peer_connected());
        let m = q.metrics();
        assert_eq!(
            sample(
                &m,
                "ublk_request_failures_total",
                &[
                    ("transport", "tcp"),
                    ("phase", "poll"),
                    ("reason", "peer_closed")
                ]
            ),
            1.0
        );
        assert_eq!(
            sample(
                &m,
                "ublk_io_errors_total",
                &[("op", "read"), ("errno", "enolink")]
            ),
            1.0
        );
        let ok = FakeQueue::new(MemTarget::new(1 << 20));
        ok.dev.peer_lost(Phase::Poll, Reason::PeerClosed);
        assert!(!ok.dev.peer_connected());
        ok.read(0, 0, 4096);
        assert!(ok.dev.peer_connected());
    }
}
