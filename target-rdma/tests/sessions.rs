//! What the real `arenad` process does to sessions an attacker or a
//! fenced-out writer controls: frames injected after the handshake,
//! writers below the volume's membership epoch (also across a restart), and
//! secret files that are not regular files.

mod common;

use std::process::Command;

use common::arenad::{terminate, Arenad};
use common::*;
use futures::executor::block_on;
use target_rdma::proto::{
    self, Opcode, Request, Status, HEADER_LEN, VERSION, VERSION_2, VERSION_3,
};

fn arenad(dir: &std::path::Path) -> Arenad {
    Arenad::new(dir, "4M", "64K", "16M", None)
}

#[test]
fn a_frame_injected_after_the_handshake_ends_that_session_only() {
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path());
    let proc = a.start();
    let bystander = a.connect("a");
    block_on(bystander.write(1, 0, b"kept")).unwrap();

    let key = secret(SECRET_A);
    let mut good = Vec::new();
    proto::encode_request(&mut good, 7, &Request::Remove { start: 0, end: 100 });
    // In a tagged session and in a sealed one (a confidential volume's):
    for version in [VERSION_2, VERSION_3] {
        // A well-formed frame of the session's version, with a tag an
        // attacker without the session key can only guess.
        let mut s = RawSession::open(a.addr(), "a", &key, version, 0);
        let mut frame = good.clone();
        frame[4] = version;
        s.send(&{
            let mut f = Vec::new();
            proto::encode_request(&mut f, 6, &Request::Get { key: 1 });
            f
        })
        .unwrap();
        let (h, _) = s.recv().expect("the GET is answered");
        assert_eq!(
            (h.opcode, h.request_id, h.status),
            (Opcode::Get, 6, Status::Ok)
        );
        frame.extend_from_slice(&[0u8; proto::TAG_LEN]);
        s.inject(&frame).unwrap();
        let (h, body) = s.recv().expect("an error frame");
        assert_eq!(h.status, Status::Protocol);
        let msg = proto::decode_error(&body);
        assert!(msg.contains("authentication tag"), "{msg}");
        assert!(s.recv().is_none(), "the session ends");

        // An unauthenticated version-1 frame is refused from its header.
        let mut s = RawSession::open(a.addr(), "a", &key, version, 0);
        s.inject(&good).unwrap();
        let (h, body) = s.recv().expect("an error frame");
        assert_eq!(h.status, Status::Protocol);
        assert!(proto::decode_error(&body).contains("version 1"));
    }

    // Version 1 itself is refused (allow_protocol_v1 is off by default).
    let e = RawSession::try_open(a.addr(), "a", &key, 1, 0)
        .err()
        .expect("a v1 HELLO refused");
    assert_eq!(e.status, Status::VersionMismatch, "{}", e.message);

    // The injected REMOVE did nothing; the bystander never noticed.
    let mut out = [0u8; 4];
    assert!(block_on(bystander.read_found(1, 0, &mut out)).unwrap());
    assert_eq!(&out, b"kept");
    let metrics = a.metrics();
    assert!(
        metrics.contains("arenad_protocol_errors_total{class=\"tag\"} 2"),
        "{metrics}"
    );
    drop(bystander);
    terminate(proc);
}

#[test]
fn a_writer_below_the_volumes_epoch_is_refused_even_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path());
    let proc = a.start();
    let mut cfg = a.config("a");
    cfg.epoch = 1;
    let old = a.connect_with(cfg.clone());
    block_on(old.write(1, 0, b"old!")).unwrap();
    // Volume b is someone else's: its epoch is its own.
    let other = a.connect("b");

    let mut newer = cfg.clone();
    newer.epoch = 2;
    let new = a.connect_with(newer);
    let stale = |r: Result<(), target_rdma::blob::ArenaError>| {
        let e = r.expect_err("a stale writer is refused");
        assert_eq!(e.status(), Some(Status::StaleEpoch), "{e}");
    };
    let epoch = old.connection_epoch();
    stale(block_on(old.write(1, 0, b"lost")));
    stale(block_on(old.flush()));
    let mut out = [0u8; 4];
    stale(block_on(old.read_found(1, 0, &mut out)).map(|_| ()));
    assert_eq!(old.connection_epoch(), epoch, "the connection stays");
    block_on(new.write(2, 0, b"new!")).unwrap();
    block_on(other.write(1, 0, b"b ok")).unwrap();
    // Only a writer that moves past the volume's epoch gets it back.
    assert_eq!(block_on(old.raise_epoch(3)).unwrap(), 3);
    stale(block_on(new.write(2, 0, b"nope")));
    block_on(old.write(3, 0, b"back")).unwrap();
    drop((old, new, other));
    terminate(proc);

    // After a restart the volume is still at 3: epochs 1 and 2 are stale.
    let proc = a.start();
    let mut two = cfg.clone();
    two.epoch = 2;
    let two = a.connect_with(two);
    stale(block_on(two.write(4, 0, b"late")));
    let mut three = cfg;
    three.epoch = 3;
    let three = a.connect_with(three);
    assert!(block_on(three.read_found(1, 0, &mut out)).unwrap());
    assert_eq!(&out, b"old!", "the stale write never landed");
    let epochs = std::fs::read_to_string(a.swap_dir.join("epochs")).unwrap();
    assert!(epochs.contains("3 a\n"), "{epochs}");
    drop((two, three));
    terminate(proc);
}

#[test]
fn a_secret_that_is_not_a_regular_file_is_refused_at_check_and_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path());
    let fifo = dir.path().join("b.key");
    std::fs::remove_file(&fifo).unwrap();
    let made = Command::new("mkfifo")
        .args(["-m", "600"])
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    // A FIFO nobody writes would block a plain read forever.
    // --check lists its findings on stdout, a start its error on stderr.
    let said = |out: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    for args in [&["--check"][..], &[][..]] {
        let out = a.run(args);
        let err = said(&out);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(
            err.contains("is a FIFO, not a regular file") && err.contains("b.key"),
            "{args:?}: {err}"
        );
    }
    std::fs::remove_file(&fifo).unwrap();
    std::fs::create_dir(&fifo).unwrap();
    let err = said(&a.run(&["--check"]));
    assert!(err.contains("is a directory, not a regular file"), "{err}");
}

#[test]
fn a_write_body_above_max_inline_is_refused_from_its_header() {
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path());
    let proc = a.start();
    let mut s = RawSession::open(a.addr(), "a", &secret(SECRET_A), VERSION, 0);
    let mut f = Vec::new();
    proto::encode_request(
        &mut f,
        9,
        &Request::Write {
            key: 1,
            offset: 0,
            data: &[],
        },
    );
    // Claim a 16 MiB body but send none of it: the answer comes anyway.
    f[4] = VERSION;
    f[20..24].copy_from_slice(&(16u32 << 20).to_le_bytes());
    s.inject(&f[..HEADER_LEN]).unwrap();
    let (h, body) = s.recv().expect("an error frame before the body");
    assert_eq!(h.status, Status::Protocol);
    let msg = proto::decode_error(&body);
    assert!(msg.contains("exceeds the limit"), "{msg}");
    terminate(proc);
}

/// Reads the first frame the server sends on a fresh socket.
fn first_frame(s: &mut std::net::TcpStream) -> (proto::Header, String) {
    s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let mut body = Vec::new();
    let h = proto::read_frame(s, &mut body).unwrap().expect("a frame");
    (h, proto::decode_error(&body))
}

fn fds(p: &common::arenad::Proc) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", p.pid()))
        .unwrap()
        .count()
}

#[test]
fn connection_limits_hold_for_sockets_that_never_send_hello() {
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path());
    a.set("max_connections = 6\nmax_unauthenticated = 3\nhandshake_timeout_secs = 600");
    let mut proc = a.start();
    let session = a.connect("a");
    // Sockets that never send HELLO take the handshake places, then are
    // refused at once, with a reason.
    let mut idle = Vec::new();
    let msg = loop {
        let mut s = std::net::TcpStream::connect(a.addr()).unwrap();
        let (h, msg) = first_frame(&mut s);
        if h.status != Status::Ok {
            assert_eq!((h.opcode, h.status), (Opcode::Challenge, Status::Busy));
            break msg;
        }
        idle.push(s);
        assert!(idle.len() <= 3, "more than max_unauthenticated admitted");
    };
    assert_eq!(idle.len(), 3);
    assert!(msg.contains("in their handshake"), "{msg}");
    block_on(session.write(1, 0, b"busy")).unwrap();
    // Authenticated sessions fill max_connections; then a bare socket is
    // refused before it could send anything.
    idle.clear();
    let mut clients = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        assert!(std::time::Instant::now() < deadline, "never refused");
        match target_rdma::client::ArenaClient::connect(a.config("b")) {
            Ok(c) => clients.push(c),
            Err(e) if e.to_string().contains("in their handshake") => {}
            Err(e) => {
                assert_eq!(e.status(), Some(Status::Busy), "{e}");
                assert!(e.to_string().contains("too many connections"), "{e}");
                break;
            }
        }
        assert!(clients.len() < 6, "more than max_connections admitted");
    }
    let mut s = std::net::TcpStream::connect(a.addr()).unwrap();
    let (h, msg) = first_frame(&mut s);
    assert_eq!(
        (h.status, msg.as_str()),
        (Status::Busy, "too many connections")
    );
    assert!(
        a.metric(
            "arenad_connections_refused_total",
            &[("reason", "max_connections")]
        ) >= 2.0
    );
    assert!(
        a.metric(
            "arenad_connections_refused_total",
            &[("reason", "max_unauthenticated")]
        ) >= 1.0
    );
    // Places come back when connections go.
    clients.clear();
    let again = loop {
        match target_rdma::client::ArenaClient::connect(a.config("b")) {
            Ok(c) => break c,
            Err(e) if std::time::Instant::now() < deadline + std::time::Duration::from_secs(30) => {
                assert_eq!(e.status(), Some(Status::Busy), "{e}");
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("places never came back: {e}"),
        }
    };
    block_on(again.write(2, 0, b"back")).unwrap();
    assert!(proc.alive());
    drop((session, again));
    terminate(proc);
}

#[test]
fn the_handshake_deadline_is_absolute_not_per_read() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path());
    a.set("handshake_timeout_secs = 1");
    let proc = a.start();
    let mut s = std::net::TcpStream::connect(a.addr()).unwrap();
    let (h, _) = first_frame(&mut s);
    assert_eq!(h.opcode, Opcode::Challenge);
    // One byte of a well-formed HELLO every 200 ms: each read is well
    // within the timeout, the whole never can be.
    let mut hello = Vec::new();
    proto::Hello {
        version: u16::from(VERSION),
        caps: proto::CAP_TCP_DATA,
        blob_bytes: 0,
        epoch: 0,
        client_nonce: [1; proto::NONCE_LEN],
        mac: [0; proto::MAC_LEN],
        volume: "a".into(),
    }
    .encode(&mut hello);
    s.set_read_timeout(Some(std::time::Duration::from_millis(200)))
        .unwrap();
    let mut sent = 0;
    let closed = loop {
        if s.write_all(&hello[sent..=sent]).is_err() {
            break true;
        }
        sent += 1;
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(0) => break true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break true,
        }
        if sent == hello.len() {
            break false;
        }
    };
    assert!(closed, "the server waited for all {sent} bytes");
    assert!(sent < HEADER_LEN, "closed only after {sent} bytes");
    terminate(proc);
}

#[test]
fn probes_are_counted_not_protocol_errors_and_cost_nothing_lasting() {
    let dir = tempfile::tempdir().unwrap();
    let a = arenad(dir.path());
    let mut proc = a.start();
    let churn = |n: usize| {
        for _ in 0..n {
            drop(std::net::TcpStream::connect(a.addr()).unwrap());
        }
    };
    churn(50);
    let wait_for = |probes: f64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        // A connection is a probe, or refused when probes come faster than
        // their threads end (max_unauthenticated).
        let seen = || {
            a.metric("arenad_probes_total", &[])
                + a.metric(
                    "arenad_connections_refused_total",
                    &[("reason", "max_unauthenticated")],
                )
        };
        while seen() < probes {
            assert!(
                std::time::Instant::now() < deadline,
                "probes not counted: {}",
                a.metrics()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    wait_for(50.0);
    let (fds_before, rss_before) = (fds(&proc), rss_kib(&proc));
    churn(500);
    wait_for(550.0);
    let (fds_after, rss_after) = (fds(&proc), rss_kib(&proc));
    assert_eq!(a.metric("arenad_protocol_errors_total", &[]), 0.0);
    assert!(
        fds_after <= fds_before + 2,
        "{fds_before} -> {fds_after} descriptors"
    );
    assert!(
        rss_after <= rss_before + 8 * 1024,
        "RSS {rss_before} -> {rss_after} KiB"
    );
    let c = a.connect("a");
    block_on(c.write(1, 0, b"still")).unwrap();
    assert!(proc.alive());
    drop(c);
    terminate(proc);
}

/// Resident memory once transient use (the stacks of connection threads
/// still ending) is gone: the fewest KiB seen over a second, so a loaded
/// machine does not count it as lasting.
fn rss_kib(p: &common::arenad::Proc) -> u64 {
    (0..10)
        .map(|i| {
            if i > 0 {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let status = std::fs::read_to_string(format!("/proc/{}/status", p.pid())).unwrap();
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .expect("VmRSS in /proc/<pid>/status")
        })
        .min()
        .unwrap()
}
