//! The real `arenad` process under a handshake flood: sockets that never
//! send HELLO, re-opened as soon as they are closed, from one address or
//! from several, keep the handshake places (`max_unauthenticated`) full.
//! A client from another address must still get its sessions: its new
//! connection takes the oldest place of the address holding the most,
//! and the flooding address cannot take it back.

mod common;

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::arenad::{terminate, Arenad};
use common::*;
use target_rdma::proto::{
    self, Challenge, Hello, Opcode, Status, Welcome, CAP_TCP_DATA, HEADER_LEN,
};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio::runtime::Runtime;

/// The handshake places of every test here; the flood holds 80 sockets.
const PLACES: usize = 64;
const HELD: usize = 80;
/// HELLOs the legitimate client sends during a flood.
const HELLOS: usize = 25;

fn arenad(dir: &std::path::Path, keys: &str) -> Arenad {
    let a = Arenad::new(dir, "4M", "64K", "16M", None);
    a.set(&format!(
        "max_connections = 512\nmax_unauthenticated = {PLACES}\n{keys}"
    ));
    a
}

async fn connect_from(src: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.bind(SocketAddr::from((src, 0)))?;
    s.connect(to).await
}

/// A blocking socket to `to` from the loopback address `src`.
fn std_connect_from(rt: &Runtime, src: Ipv4Addr, to: SocketAddr) -> std::net::TcpStream {
    let s = rt
        .block_on(connect_from(src, to))
        .and_then(TcpStream::into_std)
        .unwrap_or_else(|e| panic!("connect from {src}: {e}"));
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// What the flood did: sockets opened, and those refused at once.
#[derive(Default)]
struct Flood {
    connects: AtomicU64,
    refused: AtomicU64,
}

/// Keeps one silent socket from `src` open at a time, opening the next
/// as soon as the server closes it; a refused one is retried after 50 ms.
async fn hold(src: Ipv4Addr, to: SocketAddr, flood: Arc<Flood>) {
    loop {
        let Ok(mut s) = connect_from(src, to).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        flood.connects.fetch_add(1, Ordering::Relaxed);
        let mut head = [0u8; HEADER_LEN];
        let admitted = s.read_exact(&mut head).await.is_ok()
            && proto::Header::decode(&head).is_ok_and(|h| h.status == Status::Ok);
        if !admitted {
            flood.refused.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        // Never answers the CHALLENGE: held until the handshake
        // deadline, or until the server takes the place back.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
    }
}

/// Starts the flood: `per_source` held sockets from each of `sources`.
fn flood(rt: &Runtime, sources: &[Ipv4Addr], per_source: usize, to: SocketAddr) -> Arc<Flood> {
    let f = Arc::new(Flood::default());
    for &src in sources {
        for _ in 0..per_source {
            rt.spawn(hold(src, to, Arc::clone(&f)));
        }
    }
    f
}

/// One HELLO of volume "a" from `src`: whether the server welcomed it,
/// else the status and message of its refusal.
fn hello_from(rt: &Runtime, src: Ipv4Addr, to: SocketAddr) -> Result<(), (Status, String)> {
    let mut s = std_connect_from(rt, src, to);
    let mut body = Vec::new();
    let refusal = |h: proto::Header, body: &[u8]| Err((h.status, proto::decode_error(body)));
    let h = proto::read_frame(&mut s, &mut body)
        .expect("a frame")
        .expect("a frame, not EOF");
    if h.status != Status::Ok {
        return refusal(h, &body);
    }
    let ch = Challenge::decode(&h, &body).expect("a CHALLENGE");
    let mut hello = Hello {
        version: ch.max_version,
        caps: CAP_TCP_DATA,
        blob_bytes: 0,
        epoch: 0,
        client_nonce: target_rdma::auth::nonce(),
        mac: [0; proto::MAC_LEN],
        volume: "a".into(),
    };
    hello.mac = secret(SECRET_A).sign_hello(&ch, &hello);
    let mut frame = Vec::new();
    hello.encode(&mut frame);
    s.write_all(&frame).expect("send HELLO");
    let h = proto::read_frame(&mut s, &mut body)
        .expect("an answer to HELLO")
        .expect("an answer to HELLO, not EOF");
    if h.status != Status::Ok {
        return refusal(h, &body);
    }
    let welcome = Welcome::decode(&h, &body, hello.version).expect("a WELCOME");
    assert!(secret(SECRET_A).verify_welcome(&ch, &hello, &welcome));
    Ok(())
}

/// Waits until the flood has been refused again (the handshake places
/// are all taken now), up to a hang guard.
fn until_full(f: &Flood, after: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let refused = f.refused.load(Ordering::Relaxed);
        if refused > after {
            return refused;
        }
        assert!(
            Instant::now() < deadline,
            "the flood never filled the handshake places"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The legitimate client's HELLOs from `src`, each sent while the flood
/// keeps the places full, 150 ms apart; the refusals.
fn hellos_under_flood(
    rt: &Runtime,
    f: &Flood,
    src: Ipv4Addr,
    to: SocketAddr,
) -> Vec<(Status, String)> {
    let mut refused = 0;
    let mut refusals = Vec::new();
    for _ in 0..HELLOS {
        refused = until_full(f, refused);
        if let Err(r) = hello_from(rt, src, to) {
            refusals.push(r);
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    refusals
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn refused(a: &Arenad, reason: &str) -> f64 {
    a.metric("arenad_connections_refused_total", &[("reason", reason)])
}

#[test]
fn one_flooding_address_cannot_keep_another_from_its_handshakes() {
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path(), "handshake_timeout_secs = 2");
    let proc = a.start();
    let rt = runtime();
    let f = flood(&rt, &[Ipv4Addr::new(127, 0, 0, 1)], HELD, a.addr());
    let refusals = hellos_under_flood(&rt, &f, Ipv4Addr::new(127, 0, 0, 2), a.addr());
    let connects = f.connects.load(Ordering::Relaxed);
    drop(rt);
    assert!(
        refusals.len() <= 1,
        "{} of {HELLOS} HELLOs refused during a flood of {connects} connections: {refusals:?}",
        refusals.len()
    );
    // The flood was refused once it held its places, and lost places to
    // the client.
    assert!(refused(&a, "max_unauthenticated") >= HELLOS as f64);
    assert!(refused(&a, "displaced") >= 1.0, "{}", a.metrics());
    terminate(proc);
}

#[test]
fn four_flooding_addresses_cannot_keep_a_fifth_from_its_handshakes() {
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path(), "handshake_timeout_secs = 2");
    let proc = a.start();
    let rt = runtime();
    let attackers: Vec<Ipv4Addr> = (2..=5).map(|i| Ipv4Addr::new(127, 0, 0, i)).collect();
    let f = flood(&rt, &attackers, HELD / attackers.len(), a.addr());
    let refusals = hellos_under_flood(&rt, &f, Ipv4Addr::new(127, 0, 0, 6), a.addr());
    let connects = f.connects.load(Ordering::Relaxed);
    drop(rt);
    assert!(
        refusals.len() * 10 <= HELLOS,
        "{} of {HELLOS} HELLOs refused during a flood of {connects} connections: {refusals:?}",
        refusals.len()
    );
    assert!(refused(&a, "displaced") >= 1.0, "{}", a.metrics());
    terminate(proc);
}

/// The first frame on `s`: its header and its error message (if any).
fn first_frame(s: &mut std::net::TcpStream) -> (proto::Header, String) {
    let mut body = Vec::new();
    let h = proto::read_frame(s, &mut body).unwrap().expect("a frame");
    (h, proto::decode_error(&body))
}

#[test]
fn a_new_address_takes_the_oldest_place_of_the_address_holding_the_most() {
    let dir = tempfile::tempdir().unwrap();
    let a = Arenad::new(dir.path(), "4M", "64K", "16M", None);
    a.set("max_connections = 16\nmax_unauthenticated = 3\nhandshake_timeout_secs = 600");
    let proc = a.start();
    let rt = runtime();
    let from = |last: u8| {
        let mut s = std_connect_from(&rt, Ipv4Addr::new(127, 0, 0, last), a.addr());
        let (h, msg) = first_frame(&mut s);
        (s, h.status, msg)
    };
    // 127.0.0.1 takes every place.
    let mut idle: Vec<std::net::TcpStream> = (0..3)
        .map(|_| {
            let (s, status, _) = from(1);
            assert_eq!(status, Status::Ok, "a CHALLENGE");
            s
        })
        .collect();
    // One more from it is refused: it holds the most.
    let (_, status, msg) = from(1);
    assert_eq!(
        (status, msg.as_str()),
        (Status::Busy, "too many connections in their handshake")
    );
    // 127.0.0.2 holds none: it gets a CHALLENGE, and 127.0.0.1's oldest
    // socket gets BUSY and is closed.
    let (_second, status, _) = from(2);
    assert_eq!(status, Status::Ok);
    let (h, msg) = first_frame(&mut idle[0]);
    assert_eq!(
        (h.opcode, h.status, msg.as_str()),
        (
            Opcode::Challenge,
            Status::Busy,
            "too many connections in their handshake"
        )
    );
    let mut b = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut idle[0], &mut b).unwrap(), 0);
    idle.remove(0);
    // 127.0.0.1 (2 places) and 127.0.0.2 (1) are within one place of each
    // other: neither takes from the other.
    for last in [1, 2] {
        let (_, status, _) = from(last);
        assert_eq!(status, Status::Busy, "from 127.0.0.{last}");
    }
    // 127.0.0.3 holds none: it takes 127.0.0.1's oldest place left.
    let (_third, status, _) = from(3);
    assert_eq!(status, Status::Ok);
    let (h, _) = first_frame(&mut idle[0]);
    assert_eq!(h.status, Status::Busy);
    assert_eq!(refused(&a, "displaced"), 2.0);
    assert_eq!(refused(&a, "max_unauthenticated"), 3.0);
    terminate(proc);
}

#[test]
fn addresses_within_one_prefix_are_one_source() {
    let dir = tempfile::tempdir().unwrap();
    let a = Arenad::new(dir.path(), "4M", "64K", "16M", None);
    a.set(
        "max_connections = 16\nmax_unauthenticated = 2\nhandshake_timeout_secs = 600\n\
         handshake_source_prefix_v4 = 24",
    );
    let proc = a.start();
    let rt = runtime();
    let _idle: Vec<std::net::TcpStream> = (0..2)
        .map(|_| {
            let mut s = std_connect_from(&rt, Ipv4Addr::new(127, 0, 0, 1), a.addr());
            assert_eq!(first_frame(&mut s).0.status, Status::Ok);
            s
        })
        .collect();
    // 127.0.0.2 is in 127.0.0.0/24, the source holding every place.
    let mut s = std_connect_from(&rt, Ipv4Addr::new(127, 0, 0, 2), a.addr());
    assert_eq!(first_frame(&mut s).0.status, Status::Busy);
    // 127.0.1.1 is not.
    let mut s = std_connect_from(&rt, Ipv4Addr::new(127, 0, 1, 1), a.addr());
    assert_eq!(first_frame(&mut s).0.status, Status::Ok);
    assert_eq!(refused(&a, "displaced"), 1.0);
    terminate(proc);
}
