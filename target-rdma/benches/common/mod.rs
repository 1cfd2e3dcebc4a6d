//! What the benches share: their knobs (`BENCH_SECS`, `BENCH_ROUNDS`),
//! the median of rounds, a loopback sink, and the closed request loop the
//! arena and serving benches both drive, so their figures come from the
//! same client-side work per request.
// Each bench uses its own part of these.
#![allow(dead_code)]

use std::cell::RefCell;
use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::thread::JoinHandle;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use target_rdma::client::ArenaClient;

/// The environment variable `name` (a bench knob), else `default`.
pub fn knob<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// `BENCH_SECS`, the time per run, else `default` seconds.
pub fn secs(default: f64) -> Duration {
    Duration::from_secs_f64(knob("BENCH_SECS", default))
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A loopback listener whose first connection a thread drains in
/// `chunk`-sized reads until EOF; joining it gives the bytes read.
pub fn sink(chunk: usize) -> (SocketAddr, JoinHandle<u64>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let rx = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0; chunk];
        let mut total = 0u64;
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        total
    });
    (addr, rx)
}

#[derive(Clone, Copy)]
pub enum Dir {
    Read,
    Write,
}

/// Keeps `qd` requests of `c` in flight at the `(key, offset)` pairs
/// `next` yields while `running()` holds; the requests completed. Reads
/// borrow a buffer from `pool` (one per slot of depth) and give it back,
/// as a ublk queue reuses its buffers: allocating per request would
/// measure the allocator.
pub async fn closed_loop(
    c: &ArenaClient,
    dir: Dir,
    qd: usize,
    data: &[u8],
    pool: &RefCell<Vec<Vec<u8>>>,
    mut next: impl FnMut() -> (u64, u32),
    running: impl Fn() -> bool,
) -> u64 {
    let mut ops = 0;
    let mut inflight = FuturesUnordered::new();
    loop {
        while inflight.len() < qd && running() {
            let (key, off) = next();
            inflight.push(async move {
                match dir {
                    Dir::Write => c.write(key, off, data).await,
                    Dir::Read => {
                        let mut out = pool.borrow_mut().pop().expect("a buffer per slot");
                        let r = c.read_found(key, off, &mut out).await.map(|_| ());
                        pool.borrow_mut().push(out);
                        r
                    }
                }
            });
        }
        match inflight.next().await {
            Some(r) => {
                r.expect("bench request");
                ops += 1;
            }
            None => return ops,
        }
    }
}
