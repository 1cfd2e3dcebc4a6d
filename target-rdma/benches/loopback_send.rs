//! `cargo bench --bench loopback_send`: what sending a 1 MiB payload costs
//! over loopback TCP by each way the kernel offers, against a plain
//! `write` in the same round (ratios, the median of `BENCH_ROUNDS`):
//!
//! - io_uring SEND: the same copy into the socket, queued on a ring;
//! - io_uring SEND_ZC: the payload's pages pinned and handed to the stack
//!   instead of copied, released by a notification;
//! - SEND_ZC from a registered buffer: no pinning per send either.
//!
//! Zero-copy sends pay off where a NIC reads the pages itself. On loopback
//! (and veth) the receiving socket gets the bytes by copy anyway, so the
//! notifications are asked to report it (`IORING_SEND_ZC_REPORT_USAGE`) and
//! the bench prints the share of sends the kernel copied after all: what
//! this machine can and cannot measure of them. docs/BENCHMARKS.md records
//! the results. `BENCH_SECS` (default 2) sets the time per run.

use std::io::Write;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, types, IoUring};

mod common;
use common::{median, sink};

fn secs() -> Duration {
    common::secs(2.0)
}

const MIB: usize = 1 << 20;

/// Ask a SEND_ZC's notification to say whether the kernel copied the
/// payload after all (linux/io_uring.h; the crate keeps its bindings private).
const IORING_SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
/// Set in such a notification's result when it did.
const IORING_NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;

#[derive(Clone, Copy, PartialEq)]
enum Way {
    Write,
    Send,
    SendZc,
    SendZcFixed,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::Write => "write",
            Way::Send => "io_uring SEND",
            Way::SendZc => "io_uring SEND_ZC",
            Way::SendZcFixed => "io_uring SEND_ZC, registered buffer",
        }
    }
}

/// One run: bytes/s sent, and of the zero-copy sends' notifications, how
/// many said the kernel copied.
struct Run {
    mib_s: f64,
    notifs: u64,
    copied: u64,
}

/// Streams `chunk`-sized sends the `way` says to a receiver that drains
/// them, for `secs()`; the rate is what the receiver got.
fn stream(way: Way, chunk: usize) -> Run {
    let (addr, rx) = sink(chunk);
    let mut s = TcpStream::connect(addr).unwrap();
    let buf = vec![7u8; chunk];
    let start = Instant::now();
    let (notifs, copied) = match way {
        Way::Write => {
            while start.elapsed() < secs() {
                s.write_all(&buf).unwrap();
            }
            (0, 0)
        }
        _ => ring_sends(way, &s, &buf, start),
    };
    drop(s);
    let bytes = rx.join().unwrap();
    Run {
        mib_s: bytes as f64 / MIB as f64 / start.elapsed().as_secs_f64(),
        notifs,
        copied,
    }
}

/// One send in flight at a time on a ring of the calling thread, each
/// continuing where the last one stopped (a send may be short). A zero-copy
/// send's buffer is never written, so the next send does not wait for the
/// previous one's notification; all are reaped before the buffer is freed.
fn ring_sends(way: Way, s: &TcpStream, buf: &[u8], start: Instant) -> (u64, u64) {
    let mut ring = IoUring::new(64).unwrap();
    if way == Way::SendZcFixed {
        let iov = libc::iovec {
            iov_base: buf.as_ptr().cast_mut().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: the ring only reads the registered buffer (sends), and
        // `buf` outlives the ring, which is dropped at the end of this
        // function after every send and notification was reaped.
        unsafe { ring.submitter().register_buffers(&[iov]) }.unwrap();
    }
    let fd = types::Fd(s.as_raw_fd());
    let (mut off, mut in_flight) = (0usize, false);
    let (mut pending_notifs, mut notifs, mut copied) = (0u64, 0u64, 0u64);
    loop {
        if !in_flight && start.elapsed() < secs() {
            let rest = &buf[off..];
            let len = u32::try_from(rest.len()).unwrap();
            let sqe = match way {
                Way::Send => opcode::Send::new(fd, rest.as_ptr(), len).build(),
                _ => opcode::SendZc::new(fd, rest.as_ptr(), len)
                    .buf_index((way == Way::SendZcFixed).then_some(0))
                    .zc_flags(IORING_SEND_ZC_REPORT_USAGE)
                    .build(),
            };
            // SAFETY: `rest` borrows `buf`, which outlives the ring; the
            // kernel only reads it.
            unsafe { ring.submission().push(&sqe) }.unwrap();
            in_flight = true;
        }
        if !in_flight && pending_notifs == 0 {
            break;
        }
        ring.submit_and_wait(1).unwrap();
        for cqe in ring.completion() {
            if cqueue::notif(cqe.flags()) {
                pending_notifs -= 1;
                notifs += 1;
                copied += u64::from(cqe.result() as u32 & IORING_NOTIF_USAGE_ZC_COPIED != 0);
            } else {
                let n = usize::try_from(cqe.result()).expect("a send on loopback succeeds");
                off = (off + n) % buf.len();
                pending_notifs += u64::from(cqueue::more(cqe.flags()));
                in_flight = false;
            }
        }
    }
    (notifs, copied)
}

fn main() {
    println!("loopback send benchmark, {:?} per run", secs());
    println!(
        "\n| 1 MiB sends, loopback TCP | MiB/s | median / write | notifications saying the kernel copied |\n|---|---:|---:|---:|"
    );
    let ways = [Way::Write, Way::Send, Way::SendZc, Way::SendZcFixed];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
    let mut notes = vec![(0u64, 0u64); ways.len()];
    for _ in 0..common::knob("BENCH_ROUNDS", 3) {
        let base = stream(Way::Write, MIB).mib_s;
        for (i, &way) in ways.iter().enumerate() {
            let r = stream(way, MIB);
            rates[i].push(r.mib_s);
            ratios[i].push(r.mib_s / base);
            notes[i].0 += r.notifs;
            notes[i].1 += r.copied;
        }
    }
    for (i, way) in ways.iter().enumerate() {
        let (n, c) = notes[i];
        let copied = if n == 0 {
            "-".to_string()
        } else {
            format!("{c} of {n}")
        };
        println!(
            "| {} | {:.0} | {:.2}x | {copied} |",
            way.name(),
            median(rates[i].clone()),
            median(ratios[i].clone())
        );
    }
}
