//! Per-I/O cost of the accounting: tracker set/clear + counters + latency
//! histogram, against a DashMap-keyed tracker with the exporter's own
//! histogram (the plain design, as the baseline), in the same run.
//!
//! Then the whole observation of a request as ublkd makes it (tracker,
//! request and attempt accounting, both latency histograms) with sampled
//! tracing off and on (the default 100 ppm, and 10,000 ppm), spans written
//! as JSON lines to a sink by a real `tracing` subscriber, in the same run;
//! then tracing's cost at the default rate resolved to a few tenths of a
//! percent (`tracing_cost`: interleaved rounds, thread CPU time, an A/A
//! control), and what formatting a retained request's spans costs with
//! `tracing_subscriber`'s JSON format and with the daemons' `JsonLine`.
//!
//! `cargo bench -p ublk-metrics` prints ns and heap allocations per I/O.

use dashmap::DashMap;
use metrics::{Counter, Histogram};
use metrics_exporter_prometheus::PrometheusBuilder;
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;
use ublk_metrics::json_line::JsonLine;
use ublk_metrics::trace::MAX_SAMPLE_RATE_PPM;
use ublk_metrics::{
    AttemptRecord, Clock, CorrelationId, Daemon, IoMetrics, IoOp, MonotonicClock,
    RequestAccounting, RequestRecord, SpanEnd, Telemetry, TraceConfig, Tracer, TrackerConfig,
    TrackerTable, Transport,
};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to the system allocator with the caller's
// arguments unchanged; the counter has no effect on the memory returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as our caller's: `layout` has non-zero size.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was returned by `System.alloc` with this `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `ptr`/`layout` come from this allocator, `new_size` is the
        // caller's, as `GlobalAlloc::realloc` requires.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const DEPTH: u16 = 128;
const IOS: u64 = 2_000_000;

/// The baseline's shape: a concurrent map keyed by (queue, tag) holding the
/// start time, the facade's counters and the exporter's histogram.
struct MapTracker {
    map: DashMap<(u16, u16), (Instant, IoOp)>,
    requests: Counter,
    bytes: Counter,
    latency: Histogram,
}

fn baseline() -> Arc<MapTracker> {
    let recorder = PrometheusBuilder::new().build_recorder();
    let (requests, bytes, latency) = metrics::with_local_recorder(&recorder, || {
        (
            metrics::counter!("requests_total", "target" => "arena", "op" => "read"),
            metrics::counter!("bytes_total", "target" => "arena", "op" => "read"),
            metrics::histogram!("latency_seconds", "target" => "arena", "op" => "read"),
        )
    });
    // Keep the recorder's storage alive for the handles.
    std::mem::forget(recorder);
    Arc::new(MapTracker {
        map: DashMap::new(),
        requests,
        bytes,
        latency,
    })
}

fn baseline_io(t: &MapTracker, queue: u16, tag: u16) {
    t.map.insert((queue, tag), (Instant::now(), IoOp::Read));
    // ... the I/O happens here ...
    if let Some((_, (start, _op))) = t.map.remove(&(queue, tag)) {
        t.requests.increment(1);
        t.bytes.increment(4096);
        t.latency.record(start.elapsed().as_secs_f64());
    }
}

struct Slots {
    table: TrackerTable,
    io: IoMetrics,
}

/// `CLOCK_MONOTONIC` through `Instant`, to separate the cost of the clock
/// from the cost of the design.
struct StdClock(Instant);

impl Clock for StdClock {
    fn now_ns(&self) -> u64 {
        self.0.elapsed().as_nanos() as u64 + 1
    }
}

/// One tracker slot per (queue, tag) of `queues` queues.
fn table(queues: u16, clock: Arc<dyn Clock>) -> TrackerTable {
    TrackerTable::new(
        TrackerConfig {
            target: "arena".into(),
            device: None,
            queues,
            depth: DEPTH,
            slow_threshold: None,
        },
        None,
        clock,
    )
    .expect("table")
}

fn ours(queues: u16, clock: Arc<dyn Clock>) -> Arc<Slots> {
    let t = Telemetry::isolated(Daemon::Ublkd, "bench");
    let table = table(queues, clock);
    let io = IoMetrics::new(&t, "arena", None).expect("io");
    std::mem::forget(t);
    Arc::new(Slots { table, io })
}

fn ours_io(s: &Slots, queue: u16, tag: u16) {
    if let Ok(g) = s.table.start(queue, tag, IoOp::Read) {
        // ... the I/O happens here ...
        black_box(g.complete(&s.io, 4096, Ok(())));
    }
}

/// A device as ublkd observes it: tracker slots, device I/O families and
/// the request accounting.
struct Device {
    table: TrackerTable,
    io: IoMetrics,
    acct: RequestAccounting,
}

fn device(queues: u16) -> Device {
    let t = Telemetry::isolated(Daemon::Ublkd, "bench");
    let table = table(queues, Arc::new(MonotonicClock::new()));
    let io = IoMetrics::new(&t, "arena", None).expect("io");
    let acct = RequestAccounting::new(&t);
    std::mem::forget(t);
    Device { table, io, acct }
}

/// ublkd's `[tracing] sample_rate_ppm` default.
const DEFAULT_PPM: u32 = 100;

fn tracer(sample_rate_ppm: u32) -> Tracer {
    Tracer::new(TraceConfig {
        sample_rate_ppm,
        slow_threshold: Some(std::time::Duration::from_secs(5)),
    })
}

/// A device and, when tracing is on, its tracer.
struct Observed {
    dev: Device,
    tracer: Option<Tracer>,
}

fn observed(queues: u16, sample_rate_ppm: Option<u32>) -> Arc<Observed> {
    Arc::new(Observed {
        dev: device(queues),
        tracer: sample_rate_ppm.map(tracer),
    })
}

/// What `daemon/src/observability/request.rs` does for one successful
/// request on one transport. Never inlined: every variant runs this one
/// body, which tests `tracer` per request as the daemon tests its device's.
#[inline(never)]
fn observed_io(s: &Device, tracer: Option<&Tracer>, queue: u16, tag: u16) {
    let op = IoOp::Read;
    let Ok(g) = s.table.start(queue, tag, op) else {
        return;
    };
    let corr = g.correlation_id();
    let span = s.acct.start_request(op, Transport::Tcp, corr);
    let dispatched_ns = g.elapsed().as_nanos() as u64;
    let attempt = span.attempt(Transport::Tcp);
    // ... the I/O happens here ...
    let latency_ns = g.complete(&s.io, 4096, Ok(())).as_nanos() as u64;
    let attempt_ns = latency_ns.saturating_sub(dispatched_ns);
    if let Some(tracer) = tracer.filter(|t| t.keeps_success(corr, latency_ns)) {
        let record = RequestRecord {
            corr,
            target: "arena",
            device: Some(0),
            op,
            transport: Transport::Tcp,
            latency_ns,
            end: SpanEnd::Success,
            errno: None,
        };
        let attempts = [AttemptRecord {
            transport: Transport::Tcp,
            latency_ns: Some(attempt_ns),
            end: SpanEnd::Success,
        }];
        if tracer.finish(&record, &attempts).is_some() {
            s.io.latency(op).exemplar(latency_ns, corr);
            s.acct
                .attempt_latency(op, Transport::Tcp)
                .exemplar(attempt_ns, corr);
        }
    }
    attempt.succeed(attempt_ns);
    span.succeed();
}

/// Rounds whose per-round ratios `tracing_cost` summarizes, after
/// [`WARMUP_ROUNDS`] it discards: the median's interval narrows as
/// 1/sqrt(rounds), to +-0.3-0.8% on this host.
const ROUNDS: usize = 400;
const WARMUP_ROUNDS: usize = 8;
/// I/Os per thread per variant per round, about 10 ms. Long enough that a
/// segment holds several head-sampled requests at the default rate (one
/// in 10,000: 4-6 of them, the hash spreads consecutive ids evenly), so the
/// median of per-round ratios carries their cost rather than whether a
/// segment happened to hold one.
const SEGMENT: u64 = 50_000;

/// Tracing off, off again (the A/A control), on with nothing head-sampled
/// (what the per-request test costs alone) and on at the default rate.
const VARIANTS: [&str; 4] = ["off", "off again (A/A)", "on, 0 ppm", "on, 100 ppm"];
const N: usize = VARIANTS.len();

/// Round `r` runs the variants in the order `ORDERS[r % 4]`, a balanced
/// Latin square: each variant runs in each position once and right after
/// each other variant once, so what a position or a predecessor costs (a
/// cold cache after the barrier) hits all alike.
const ORDERS: [[usize; N]; 4] = [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]];

/// The clocks of [`Cost`]: the measuring threads' CPU time
/// (`CLOCK_THREAD_CPUTIME_ID`), which time other processes take from them
/// does not enter as it enters wall time, and wall time.
const CLOCKS: [&str; 2] = ["thread CPU", "wall"];

/// What one variant cost in one round in ns by [`CLOCKS`], summed over the
/// threads.
type Cost = [u64; 2];

fn thread_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// [`SEGMENT`] requests of queue `queue`, continuing at `tag`.
fn segment(dev: &Device, tracer: Option<&Tracer>, queue: u16, tag: &mut u16) -> Cost {
    let wall = Instant::now();
    let cpu = thread_cpu_ns();
    for _ in 0..SEGMENT {
        observed_io(dev, black_box(tracer), queue, *tag);
        *tag = (*tag + 1) % DEPTH;
    }
    [thread_cpu_ns() - cpu, wall.elapsed().as_nanos() as u64]
}

/// Every variant's cost per round: `threads` threads (one queue each) run
/// the variants in turn on one device, each variant on every thread at
/// once (a barrier between segments), so the variants differ only in the
/// tracer handed to the observation.
fn interleaved(threads: u16) -> Vec<[Cost; N]> {
    let dev = Arc::new(device(threads));
    let on = Arc::new([tracer(0), tracer(DEFAULT_PPM)]);
    let barrier = Arc::new(Barrier::new(threads.into()));
    let handles: Vec<_> = (0..threads)
        .map(|q| {
            let (dev, on, barrier) = (Arc::clone(&dev), Arc::clone(&on), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let tracers = [None, None, Some(&on[0]), Some(&on[1])];
                let mut tag = 0u16;
                let mut rounds = Vec::with_capacity(ROUNDS);
                for r in 0..WARMUP_ROUNDS + ROUNDS {
                    let mut round = [Cost::default(); N];
                    for &v in &ORDERS[r % ORDERS.len()] {
                        barrier.wait();
                        round[v] = segment(&dev, tracers[v], q, &mut tag);
                    }
                    if r >= WARMUP_ROUNDS {
                        rounds.push(round);
                    }
                }
                rounds
            })
        })
        .collect();
    let mut total = vec![[Cost::default(); N]; ROUNDS];
    for h in handles {
        for (sum, round) in total.iter_mut().zip(h.join().expect("bench thread")) {
            for (s, c) in sum.iter_mut().zip(round) {
                s[0] += c[0];
                s[1] += c[1];
            }
        }
    }
    total
}

/// The median of `x` and its 95% confidence interval from order
/// statistics: the ranks between which the median lies with probability
/// 0.95 whatever the distribution (binomial(n, 1/2), normal
/// approximation), so no assumption about how a shared host's noise is
/// shaped.
fn median_ci(mut x: Vec<f64>) -> (f64, f64, f64) {
    x.sort_by(f64::total_cmp);
    let n = x.len() as f64;
    let half = 1.96 * n.sqrt() / 2.0;
    let lo = ((n / 2.0 - half).floor() as usize).saturating_sub(1);
    let hi = ((n / 2.0 + half).ceil() as usize).min(x.len() - 1);
    (x[x.len() / 2], x[lo], x[hi])
}

/// Tracing on at the default rate against off, per request, resolved to
/// well under 2%: the median of [`ROUNDS`] per-round ratios on/off with its
/// confidence interval, and an A/A control (off against off) whose interval
/// says what the bench resolves on this host in this run.
fn tracing_cost(threads: u16) {
    let load = || {
        let l = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    };
    let before = load();
    let rounds = interleaved(threads);
    println!(
        "tracing cost, {threads} thr: {ROUNDS} interleaved rounds of {SEGMENT} I/Os per \
         variant per thread; load average {before} -> {}",
        load()
    );
    println!(
        "{:<10} {:<20} {:>7} {:>8} {:>18}",
        "clock", "tracing", "ns/IO", "vs off", "95% CI"
    );
    let ios = (SEGMENT * u64::from(threads)) as f64;
    for (k, clock) in CLOCKS.iter().enumerate() {
        let of = |c: &Cost| c[k];
        let per_io =
            |v: usize| median_ci(rounds.iter().map(|r| of(&r[v]) as f64 / ios).collect()).0;
        // Variant `v` against off in the same round, in percent.
        let cost = |v: usize| {
            median_ci(
                rounds
                    .iter()
                    .map(|r| (of(&r[v]) as f64 / of(&r[0]) as f64 - 1.0) * 100.0)
                    .collect(),
            )
        };
        let (control, on) = (cost(1), cost(3));
        let resolves = control.1 <= 0.0 && 0.0 <= control.2 && control.1 > -2.0 && control.2 < 2.0;
        let verdict = if !resolves {
            "unresolved: the A/A interval is not within +-2%"
        } else if on.2 < 2.0 {
            "below 2%"
        } else if on.1 > 2.0 {
            "ABOVE 2%"
        } else {
            "not decided at 2%"
        };
        let row = |v: usize, (m, lo, hi): (f64, f64, f64), verdict: &str| {
            println!(
                "{clock:<10} {:<20} {:>7.1} {m:>+7.2}% [{lo:>+6.2}%, {hi:>+6.2}%] {verdict}",
                VARIANTS[v],
                per_io(v)
            );
        };
        println!("{clock:<10} {:<20} {:>7.1}", VARIANTS[0], per_io(0));
        let resolution = if resolves {
            "resolves 2%"
        } else {
            "does NOT resolve 2%"
        };
        row(1, control, resolution);
        row(2, cost(2), "");
        row(3, on, verdict);
    }
}

/// Rounds of [`span_format`], and retained requests per format per round.
const FORMAT_ROUNDS: usize = 100;
const SPANS: u32 = 2_000;

/// What a retained request's two span lines cost to format with
/// `tracing_subscriber`'s JSON format and with the daemons' [`JsonLine`]
/// (the same bytes), alternated on one thread, in thread CPU time.
fn span_format() {
    let every = tracer(MAX_SAMPLE_RATE_PPM);
    let stock = tracing::Dispatch::new(
        tracing_subscriber::fmt()
            .with_env_filter("info")
            .with_writer(std::io::sink)
            .json()
            .flatten_event(true)
            .with_target(false)
            .finish(),
    );
    let ours = tracing::Dispatch::new(
        tracing_subscriber::fmt()
            .with_env_filter("info")
            .with_writer(std::io::sink)
            .event_format(JsonLine)
            .finish(),
    );
    let spans = || {
        for _ in 0..SPANS {
            let record = RequestRecord {
                corr: CorrelationId::next(),
                target: "arena",
                device: Some(0),
                op: IoOp::Read,
                transport: Transport::Tcp,
                latency_ns: 41_000,
                end: SpanEnd::Success,
                errno: None,
            };
            let attempts = [AttemptRecord {
                transport: Transport::Tcp,
                latency_ns: Some(38_000),
                end: SpanEnd::Success,
            }];
            black_box(every.finish(&record, &attempts));
        }
    };
    let mut ns = [Vec::new(), Vec::new()];
    let mut ratios = Vec::new();
    for r in 0..FORMAT_ROUNDS {
        let mut round = [0.0; 2];
        for i in [r % 2, 1 - r % 2] {
            let cpu = thread_cpu_ns();
            tracing::dispatcher::with_default([&stock, &ours][i], spans);
            round[i] = (thread_cpu_ns() - cpu) as f64 / f64::from(SPANS);
            ns[i].push(round[i]);
        }
        ratios.push(round[1] / round[0]);
    }
    let [stock_ns, ours_ns] = ns.map(|v| median_ci(v).0);
    let (m, lo, hi) = median_ci(ratios);
    println!(
        "span lines of a retained request, {FORMAT_ROUNDS} alternated rounds of {SPANS}: \
         tracing_subscriber json {:.2} us, JsonLine {:.2} us (thread CPU); \
         JsonLine/json {m:.2} [{lo:.2}, {hi:.2}]",
        stock_ns / 1000.0,
        ours_ns / 1000.0
    );
}

/// Runs `ios` I/Os per thread on `threads` threads (one queue each) and
/// returns (ns per I/O per thread, allocations per I/O).
fn run<S: Send + Sync + 'static>(state: Arc<S>, threads: u16, f: fn(&S, u16, u16)) -> (f64, f64) {
    // Warm up: first-use allocations (thread-locals, map growth) are not
    // per-I/O costs.
    for q in 0..threads {
        for tag in 0..DEPTH {
            f(&state, q, tag);
        }
    }
    let a0 = ALLOCS.load(Ordering::Relaxed);
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|q| {
            let st = Arc::clone(&state);
            std::thread::spawn(move || {
                let mut tag = 0u16;
                for _ in 0..IOS {
                    f(&st, q, tag);
                    tag = (tag + 1) % DEPTH;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("bench thread");
    }
    let ns = start.elapsed().as_nanos() as f64 / IOS as f64;
    // Thread spawns allocate a handful of times; over millions of I/Os that
    // is below the printed precision.
    let allocs = (ALLOCS.load(Ordering::Relaxed) - a0) as f64 / (IOS * u64::from(threads)) as f64;
    (ns, allocs)
}

/// Best of three runs: the machine is shared, and the minimum is the run
/// least disturbed by other work.
fn best<S: Send + Sync + 'static>(
    make: impl Fn() -> Arc<S>,
    threads: u16,
    f: fn(&S, u16, u16),
) -> (f64, f64) {
    (0..3)
        .map(|_| run(make(), threads, f))
        .fold((f64::MAX, 0.0), |(ns, a), (n, b)| {
            (ns.min(n), f64::max(a, b))
        })
}

fn main() {
    // Retained spans go through a real subscriber, formatted, to nowhere.
    tracing::subscriber::set_global_default(ublk_metrics::events::json_subscriber(
        tracing_subscriber::EnvFilter::new("info"),
        std::io::sink,
    ))
    .expect("subscriber");
    println!("per-I/O accounting cost ({IOS} I/Os per thread, queue depth {DEPTH})");
    println!("{:<56} {:>8} {:>10}", "design", "ns/IO", "allocs/IO");
    let row = |name: String, ns: f64, allocs: f64| println!("{name:<56} {ns:>8.1} {allocs:>10.4}");
    for threads in [1u16, 2] {
        let (bn, ba) = best(baseline, threads, baseline_io);
        let (sn, sa) = best(
            || ours(threads, Arc::new(StdClock(Instant::now()))),
            threads,
            ours_io,
        );
        let (on, oa) = best(
            || ours(threads, Arc::new(MonotonicClock::new())),
            threads,
            ours_io,
        );
        row(
            format!("dashmap tracker + exporter histogram, {threads} thr"),
            bn,
            ba,
        );
        row(
            format!("slot tracker + native histogram, std clock, {threads} thr"),
            sn,
            sa,
        );
        row(
            format!("slot tracker + native histogram, MonotonicClock, {threads} thr"),
            on,
            oa,
        );
        println!(
            "speed-up, {threads} thr: {:.2}x (both on the std clock: {:.2}x)",
            bn / on,
            bn / sn
        );
    }
    println!();
    println!("per-I/O observation of a whole request (tracker, request + attempt accounting)");
    println!("{:<56} {:>8} {:>10}", "tracing", "ns/IO", "allocs/IO");
    for threads in [1u16, 2] {
        // Interleaved rounds, best of each: a busy neighbour hits all
        // variants alike.
        let mut bestv = [(f64::MAX, 0.0f64); 3];
        let rates = [None, Some(DEFAULT_PPM), Some(10_000)];
        for _ in 0..5 {
            for (i, ppm) in rates.iter().enumerate() {
                let (n, a) = run(observed(threads, *ppm), threads, |s, q, tag| {
                    observed_io(&s.dev, s.tracer.as_ref(), q, tag)
                });
                bestv[i] = (bestv[i].0.min(n), bestv[i].1.max(a));
            }
        }
        for (i, name) in ["off", "on, 100 ppm (default)", "on, 10000 ppm"]
            .iter()
            .enumerate()
        {
            row(
                format!("tracing {name}, {threads} thr"),
                bestv[i].0,
                bestv[i].1,
            );
        }
        // Best rounds resolve a +50% effect, not a 2% one: the default
        // rate's cost is measured by `tracing_cost`.
        println!(
            "10000 ppm cost, {threads} thr (best rounds): {:+.1}%",
            (bestv[2].0 / bestv[0].0 - 1.0) * 100.0
        );
    }
    println!();
    for threads in [1u16, 2] {
        tracing_cost(threads);
    }
    println!();
    // Last: a scoped dispatcher makes every later event look up the
    // thread's.
    span_format();
}
