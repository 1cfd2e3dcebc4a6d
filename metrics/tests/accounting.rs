//! Conservation of logical requests and physical attempts.

use ublk_metrics::testing::value;
use ublk_metrics::{
    CorrelationId, Daemon, IoOp, Outcome, Phase, Reason, RequestAccounting, Telemetry, Transport,
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
        for t in Transport::ALL {
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
            0 => {
                a.fail(Phase::Completion, Reason::WcError, Some(1_000));
                req.failover(Transport::Tcp);
                req.failover(Transport::Tcp); // counted once
                if first != Transport::Tcp {
                    failovers += 1;
                }
                let b = req.attempt(Transport::Tcp);
                if rng.pick(2) == 0 {
                    b.succeed(1_000);
                    req.succeed();
                } else {
                    b.fail(Phase::Post, Reason::Timeout, Some(1_000));
                    req.fail(Phase::Post, Reason::Timeout);
                }
                true
            }
            1 => {
                drop(a); // cancelled attempt
                drop(req); // cancelled request
                true
            }
            2 => {
                a.fail(Phase::Alloc, Reason::ResourceExhausted, Some(1_000));
                req.fail(Phase::Alloc, Reason::ResourceExhausted);
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
        .flat_map(|op| Transport::ALL.map(move |t| (op, t)))
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
        for tr in Transport::ALL {
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
