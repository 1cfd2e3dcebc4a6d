//! Conservation of logical requests and physical attempts.

use ublk_metrics::testing::value;
use ublk_metrics::{
    CorrelationId, Daemon, FailureCause, IoOp, Outcome, RequestAccounting, Telemetry, Transport,
};

/// Small deterministic generator; the seed is printed on failure.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn pick(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn check_equalities(text: &str, started: &str, outcomes: &str, inflight: &str) -> u64 {
    let mut total = 0;
    for op in IoOp::ALL {
        for t in Transport::SERVED {
            let l = [("op", op.as_str()), ("transport", t.as_str())];
            let s = value(text, started, &l);
            let mut sum = 0.0;
            for o in Outcome::ALL {
                sum += value(text, outcomes, &[l[0], l[1], ("outcome", o.as_str())]);
            }
            let inf = value(text, inflight, &l);
            assert_eq!(
                s,
                sum + inf,
                "{started} != sum({outcomes}) + {inflight} for {l:?}"
            );
            total += s as u64;
        }
    }
    total
}

#[test]
fn randomized_mix_keeps_started_equal_to_outcomes_plus_inflight() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let acct = RequestAccounting::new(&t);
    let seed = 0x5eed_u64;
    let mut rng = Lcg(seed);
    let mut failovers = 0u64;
    let mut held = Vec::new();
    for _ in 0..5000 {
        let op = IoOp::ALL[rng.pick(IoOp::COUNT as u64) as usize];
        let first = if rng.pick(4) == 0 {
            Transport::Tcp
        } else {
            Transport::Rdma
        };
        let mut req = acct.start_request(op, first, CorrelationId::next());
        let a = req.attempt(first);
        let request_done = match rng.pick(6) {
            0 if first == Transport::Rdma => {
                let mut b = req.fail_over(a, Some(1_000), Transport::Tcp);
                if rng.pick(2) == 0 {
                    // Back on RDMA and over to TCP again: still one failover.
                    drop(b);
                    let again = req.attempt(Transport::Rdma);
                    b = req.fail_over(again, None, Transport::Tcp);
                }
                failovers += 1;
                if rng.pick(2) == 0 {
                    b.succeed(1_000);
                    req.succeed();
                } else {
                    b.fail(FailureCause::PollTimeout, Some(1_000));
                    req.fail(FailureCause::PollTimeout);
                }
                true
            }
            1 => {
                drop(a); // cancelled attempt
                drop(req); // cancelled request
                true
            }
            2 => {
                a.fail(FailureCause::AllocExhausted, Some(1_000));
                req.fail(FailureCause::AllocExhausted);
                true
            }
            3 => {
                // Left in flight for now.
                held.push((req, a));
                false
            }
            _ => {
                a.succeed(1_000);
                req.succeed();
                true
            }
        };
        let _ = request_done;
        if held.len() > 50 {
            let (r, a) = held.remove(rng.pick(held.len() as u64) as usize);
            a.succeed(1_000);
            r.succeed();
        }
    }
    let m = t.render().expect("render");
    let requests = check_equalities(
        &m,
        "ublk_requests_started_total",
        "ublk_request_outcomes_total",
        "ublk_requests_inflight",
    );
    assert_eq!(requests, 5000, "seed {seed}");
    let in_flight: f64 = IoOp::ALL
        .iter()
        .flat_map(|op| Transport::SERVED.map(move |t| (op, t)))
        .map(|(op, t)| {
            value(
                &m,
                "ublk_requests_inflight",
                &[("op", op.as_str()), ("transport", t.as_str())],
            )
        })
        .sum();
    assert_eq!(in_flight as usize, held.len());
    check_equalities(
        &m,
        "ublk_attempts_started_total",
        "ublk_attempt_outcomes_total",
        "ublk_attempts_inflight",
    );
    let counted: f64 = IoOp::ALL
        .iter()
        .map(|op| {
            value(
                &m,
                "ublk_failovers_total",
                &[("op", op.as_str()), ("from", "rdma"), ("to", "tcp")],
            )
        })
        .sum();
    assert_eq!(
        counted as u64, failovers,
        "one failover per request, seed {seed}"
    );

    // Draining the held requests empties the in-flight gauges.
    for (r, a) in held.drain(..) {
        drop(a);
        r.succeed();
    }
    let m = t.render().expect("render");
    check_equalities(
        &m,
        "ublk_requests_started_total",
        "ublk_request_outcomes_total",
        "ublk_requests_inflight",
    );
    for op in IoOp::ALL {
        for tr in Transport::SERVED {
            let l = [("op", op.as_str()), ("transport", tr.as_str())];
            assert_eq!(value(&m, "ublk_requests_inflight", &l), 0.0);
            assert_eq!(value(&m, "ublk_attempts_inflight", &l), 0.0);
        }
    }
    assert!(
        value(
            &m,
            "ublk_attempt_failures_total",
            &[
                ("transport", "rdma"),
                ("phase", "completion"),
                ("reason", "wc_error")
            ]
        ) > 0.0
    );
}

/// The samples of `family` in `text`.
fn samples<'t>(text: &'t str, family: &str) -> Vec<&'t str> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .collect()
}

fn failure_labels(t: Transport, c: FailureCause) -> [(&'static str, &'static str); 3] {
    [
        ("transport", t.as_str()),
        ("phase", c.phase().as_str()),
        ("reason", c.reason().as_str()),
    ]
}

/// What a ublkd's accounting exports before and after traffic: every
/// failure cause at zero from the first scrape, for the transports it
/// serves and no other, and nothing of the in-process transport.
#[test]
fn a_daemon_exports_failures_at_zero_and_nothing_in_process() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let acct = RequestAccounting::new(&t);
    let idle = t.render().expect("render");
    for tr in Transport::SERVED {
        for c in FailureCause::ALL {
            let l = failure_labels(tr, c);
            assert_eq!(value(&idle, "ublk_request_failures_total", &l), 0.0);
            assert_eq!(value(&idle, "ublk_attempt_failures_total", &l), 0.0);
        }
    }
    let wc_error = [
        ("transport", "rdma"),
        ("phase", "completion"),
        ("reason", "wc_error"),
    ];
    assert_eq!(value(&idle, "ublk_attempt_failures_total", &wc_error), 0.0);
    for op in IoOp::ALL {
        let l = [("op", op.as_str()), ("from", "rdma"), ("to", "tcp")];
        assert_eq!(value(&idle, "ublk_failovers_total", &l), 0.0);
    }
    // Only those: no cause outside the table, no failover nothing makes.
    let served = Transport::SERVED.len() * FailureCause::COUNT;
    assert_eq!(samples(&idle, "ublk_request_failures_total").len(), served);
    assert_eq!(
        samples(&idle, "ublk_attempt_failures_total").len(),
        served + 1
    );
    assert_eq!(samples(&idle, "ublk_failovers_total").len(), IoOp::COUNT);

    let mut req = acct.start_request(IoOp::Write, Transport::Rdma, CorrelationId::next());
    let rdma = req.attempt(Transport::Rdma);
    let tcp = req.fail_over(rdma, None, Transport::Tcp);
    tcp.fail(FailureCause::PollPeerClosed, Some(5_000));
    req.fail(FailureCause::PollPeerClosed);
    let busy = acct.start_request(IoOp::Read, Transport::Tcp, CorrelationId::next());
    busy.attempt(Transport::Tcp)
        .fail(FailureCause::AllocExhausted, Some(1_000));
    busy.fail(FailureCause::AllocExhausted);
    let m = t.render().expect("render");
    assert!(
        !m.contains("in_process"),
        "in-process series in a daemon's exposition:\n{m}"
    );
    let closed = FailureCause::PollPeerClosed;
    let exhausted = FailureCause::AllocExhausted;
    for (family, labels, want) in [
        (
            "ublk_request_failures_total",
            failure_labels(Transport::Rdma, closed),
            1.0,
        ),
        (
            "ublk_attempt_failures_total",
            failure_labels(Transport::Tcp, closed),
            1.0,
        ),
        (
            "ublk_attempt_failures_total",
            failure_labels(Transport::Rdma, closed),
            0.0,
        ),
        ("ublk_attempt_failures_total", wc_error, 1.0),
        (
            "ublk_request_failures_total",
            failure_labels(Transport::Tcp, exhausted),
            1.0,
        ),
        (
            "ublk_attempt_failures_total",
            failure_labels(Transport::Tcp, exhausted),
            1.0,
        ),
    ] {
        assert_eq!(value(&m, family, &labels), want, "{family}{labels:?}");
    }
    assert_eq!(
        value(
            &m,
            "ublk_failovers_total",
            &[("op", "write"), ("from", "rdma"), ("to", "tcp")]
        ),
        1.0
    );
    assert_eq!(samples(&m, "ublk_request_failures_total").len(), served);
}

/// The in-process transport of tests and benchmarks gets its series on
/// its first request, failures at zero included, and they keep the
/// equality of the other transports.
#[test]
fn in_process_series_register_on_first_use() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let acct = RequestAccounting::new(&t);
    let req = acct.start_request(IoOp::Read, Transport::InProcess, CorrelationId::next());
    let attempt = req.attempt(Transport::InProcess);
    let m = t.render().expect("render");
    let l = [("op", "read"), ("transport", "in_process")];
    assert_eq!(value(&m, "ublk_requests_inflight", &l), 1.0);
    for c in FailureCause::ALL {
        let l = failure_labels(Transport::InProcess, c);
        assert_eq!(value(&m, "ublk_request_failures_total", &l), 0.0);
    }
    attempt.fail(FailureCause::CompletionIo, Some(1_000));
    req.fail(FailureCause::CompletionIo);
    let m = t.render().expect("render");
    let io = failure_labels(Transport::InProcess, FailureCause::CompletionIo);
    assert_eq!(value(&m, "ublk_request_failures_total", &io), 1.0);
    assert_eq!(value(&m, "ublk_attempt_failures_total", &io), 1.0);
    assert_eq!(value(&m, "ublk_requests_started_total", &l), 1.0);
    assert_eq!(value(&m, "ublk_requests_inflight", &l), 0.0);
    assert_eq!(
        value(
            &m,
            "ublk_request_outcomes_total",
            &[l[0], l[1], ("outcome", "failure")]
        ),
        1.0
    );
}
