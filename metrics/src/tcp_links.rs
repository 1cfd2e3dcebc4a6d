//! TCP health of the arena connections, from the kernel's TCP_INFO.
//!
//! A retry in this stack can be three different things, and the contract
//! keeps them apart: a request the client sent again
//! (`ublk_driver_request_retries_total`), an RDMA work completion that ran
//! out of its hardware retries (`ublk_driver_wc_errors_total`), and a TCP
//! segment the kernel retransmitted. Only the last says the network loses
//! packets; it is here (`ublk_tcp_retransmissions_total`), with the
//! smoothed RTT and congestion window, aggregated over connections: a
//! connection is no label.
//!
//! Each connection owns a [`TcpLink`] and hands it samples (the client takes
//! one at open, every few hundred answers and at close); the counter adds
//! each sample's retransmissions since the previous one, the gauges show
//! the open connections' last samples.

use crate::telemetry::{Collector, Telemetry};
use metrics::{Counter, Gauge};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What one TCP_INFO read says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TcpInfoSample {
    /// Segments retransmitted over the connection's life
    /// (`tcpi_total_retrans`).
    pub total_retrans: u32,
    /// Smoothed round-trip time in microseconds (`tcpi_rtt`).
    pub rtt_us: u32,
    /// Congestion window in segments (`tcpi_snd_cwnd`).
    pub cwnd: u32,
}

struct Handles {
    connections: Gauge,
    retransmissions: Counter,
    rtt_max: Gauge,
    rtt_mean: Gauge,
    cwnd_min: Gauge,
    cwnd_mean: Gauge,
}

/// The open connections' last samples and the retransmissions of all of
/// them, open or closed. Create one per process with [`TcpLinks::new`]
/// (its families render on every scrape) and give it to every arena
/// client; `TcpLinks::default()` aggregates without exporting (tests,
/// tools).
#[derive(Default)]
pub struct TcpLinks {
    retransmissions: AtomicU64,
    /// One cell per open connection (`None`: free, or not sampled yet);
    /// freed cells are reused, so it is as long as the most connections
    /// ever open at once.
    live: Mutex<Vec<Cell>>,
    handles: Option<Handles>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cell {
    Free,
    Open(Option<TcpInfoSample>),
}

impl std::fmt::Debug for TcpLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLinks")
            .field("retransmissions", &self.retransmissions())
            .finish_non_exhaustive()
    }
}

/// The aggregate the gauges show.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TcpLinksSummary {
    /// Open connections.
    pub connections: u64,
    /// Retransmitted segments, all connections ever.
    pub retransmissions: u64,
    /// Largest smoothed RTT of the sampled open connections (s).
    pub rtt_max: f64,
    /// Mean smoothed RTT (s).
    pub rtt_mean: f64,
    /// Smallest congestion window of the sampled open connections.
    pub cwnd_min: f64,
    /// Mean congestion window.
    pub cwnd_mean: f64,
}

impl TcpLinks {
    /// Registers the `ublk_tcp_*` families on `telemetry`, refreshed at
    /// each scrape.
    pub fn new(telemetry: &Arc<Telemetry>) -> Arc<TcpLinks> {
        let g = |name: &'static str| telemetry.gauge(name, &[]);
        let links = Arc::new(TcpLinks {
            handles: Some(Handles {
                connections: g("ublk_tcp_connections"),
                retransmissions: telemetry.counter("ublk_tcp_retransmissions_total", &[]),
                rtt_max: g("ublk_tcp_rtt_max_seconds"),
                rtt_mean: g("ublk_tcp_rtt_mean_seconds"),
                cwnd_min: g("ublk_tcp_cwnd_min_segments"),
                cwnd_mean: g("ublk_tcp_cwnd_mean_segments"),
            }),
            ..TcpLinks::default()
        });
        if let Some(h) = &links.handles {
            h.retransmissions.absolute(0);
        }
        telemetry.register_collector(&links);
        links
    }

    /// A newly opened connection's link.
    pub fn open(self: &Arc<Self>) -> TcpLink {
        let mut live = self.live.lock();
        let index = match live.iter().position(|c| *c == Cell::Free) {
            Some(i) => {
                live[i] = Cell::Open(None);
                i
            }
            None => {
                live.push(Cell::Open(None));
                live.len() - 1
            }
        };
        TcpLink {
            links: Arc::clone(self),
            index,
            last_retrans: 0,
        }
    }

    /// Retransmitted segments over every connection so far.
    pub fn retransmissions(&self) -> u64 {
        self.retransmissions.load(Ordering::Relaxed)
    }

    /// The aggregate over the open connections.
    pub fn summary(&self) -> TcpLinksSummary {
        let live = self.live.lock();
        let mut s = TcpLinksSummary {
            retransmissions: self.retransmissions(),
            ..TcpLinksSummary::default()
        };
        let (mut sampled, mut rtt_sum, mut cwnd_sum) = (0u64, 0u64, 0u64);
        let (mut rtt_max, mut cwnd_min) = (0u32, u32::MAX);
        for cell in live.iter() {
            let Cell::Open(sample) = cell else { continue };
            s.connections += 1;
            let Some(x) = sample else { continue };
            rtt_max = rtt_max.max(x.rtt_us);
            cwnd_min = cwnd_min.min(x.cwnd);
            rtt_sum += u64::from(x.rtt_us);
            cwnd_sum += u64::from(x.cwnd);
            sampled += 1;
        }
        if sampled > 0 {
            s.rtt_max = f64::from(rtt_max) / 1e6;
            s.rtt_mean = rtt_sum as f64 / sampled as f64 / 1e6;
            s.cwnd_min = f64::from(cwnd_min);
            s.cwnd_mean = cwnd_sum as f64 / sampled as f64;
        }
        s
    }
}

impl Collector for TcpLinks {
    fn collect(&self) {
        let Some(h) = &self.handles else { return };
        let s = self.summary();
        h.connections.set(s.connections as f64);
        h.retransmissions.absolute(s.retransmissions);
        h.rtt_max.set(s.rtt_max);
        h.rtt_mean.set(s.rtt_mean);
        h.cwnd_min.set(s.cwnd_min);
        h.cwnd_mean.set(s.cwnd_mean);
    }
}

/// One open connection's place in [`TcpLinks`]; dropping it (the
/// connection closed) removes the connection from the gauges and keeps its
/// retransmissions in the counter.
pub struct TcpLink {
    links: Arc<TcpLinks>,
    index: usize,
    last_retrans: u32,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl TcpLink {
    /// Takes a sample: its retransmissions since the last one count, its
    /// RTT and window become the connection's.
    pub fn sample(&mut self, s: TcpInfoSample) {
        // The kernel's count only grows over one connection.
        let delta = s.total_retrans.saturating_sub(self.last_retrans);
        self.last_retrans = self.last_retrans.max(s.total_retrans);
        if delta > 0 {
            self.links
                .retransmissions
                .fetch_add(u64::from(delta), Ordering::Relaxed);
        }
        self.links.live.lock()[self.index] = Cell::Open(Some(s));
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.links.live.lock()[self.index] = Cell::Free;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::Daemon;
    use crate::testing::sample;

    #[test]
    fn retransmissions_add_up_over_connections_and_gauges_follow_the_open_ones() {
        let tel = Telemetry::isolated(Daemon::Ublkd, "test");
        let links = TcpLinks::new(&tel);
        let mut a = links.open();
        let mut b = links.open();
        a.sample(TcpInfoSample {
            total_retrans: 2,
            rtt_us: 100,
            cwnd: 10,
        });
        a.sample(TcpInfoSample {
            total_retrans: 5,
            rtt_us: 300,
            cwnd: 20,
        });
        b.sample(TcpInfoSample {
            total_retrans: 1,
            rtt_us: 500,
            cwnd: 4,
        });
        let m = tel.render().unwrap();
        assert_eq!(sample(&m, "ublk_tcp_connections", &[]), 2.0);
        assert_eq!(sample(&m, "ublk_tcp_retransmissions_total", &[]), 6.0);
        assert_eq!(sample(&m, "ublk_tcp_rtt_max_seconds", &[]), 0.0005);
        assert_eq!(sample(&m, "ublk_tcp_rtt_mean_seconds", &[]), 0.0004);
        assert_eq!(sample(&m, "ublk_tcp_cwnd_min_segments", &[]), 4.0);
        assert_eq!(sample(&m, "ublk_tcp_cwnd_mean_segments", &[]), 12.0);
        drop(b);
        let c = links.open();
        assert_eq!(c.index, 1, "a closed connection's cell is reused");
        drop(a);
        let m = tel.render().unwrap();
        assert_eq!(sample(&m, "ublk_tcp_connections", &[]), 1.0);
        assert_eq!(
            sample(&m, "ublk_tcp_retransmissions_total", &[]),
            6.0,
            "closed connections' retransmissions stay counted"
        );
        assert_eq!(
            sample(&m, "ublk_tcp_rtt_max_seconds", &[]),
            0.0,
            "an unsampled connection shows no RTT"
        );
    }
}
