//! Loopback ports for the daemons a test starts.
//!
//! A port the kernel chose for `127.0.0.1:0` and that was closed again goes
//! back into the ephemeral pool, where any test's outgoing connection can
//! take it as its local port before the daemon binds it, and the daemon
//! then exits with "Address already in use". Ports below the ephemeral
//! range are never given to outgoing connections, so only another caller of
//! [`free_port`] could take one: within a process a counter keeps callers
//! apart, and the process id spreads processes over the range.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out; services a test machine runs (Prometheus,
/// etcd, PostgreSQL) listen below it.
const FLOOR: u32 = 10_000;

/// A loopback port that nothing listens on and that no outgoing connection
/// will take: outside the kernel's ephemeral range, where that range leaves
/// room (else one the kernel had free a moment ago).
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = ephemeral_low();
    if low < FLOOR + 1_000 {
        return kernel_port();
    }
    let span = low - FLOOR;
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(FLOOR + (start + n) % span).expect("below the ephemeral range");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FLOOR}..{low}");
}

/// The first port of `net.ipv4.ip_local_port_range` (Linux's default when
/// it cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

fn kernel_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..64).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for p in ports {
            assert!(u32::from(p) < ephemeral_low(), "{p}");
            TcpListener::bind(("127.0.0.1", p)).expect("the port is free");
        }
    }
}
