//! The serving core against the real `arenad` process, as hostile or slow
//! peers would use it: floods of unauthenticated sockets under a thread
//! and a file limit, a tenant that does not read its answers, a cold
//! fault-in next to a resident read on one connection, range reads of
//! cold blobs in flight past the swap's bound, SIGTERM with a
//! client that reads a trickle, and a client past `max_inflight`. Each
//! asserts an ordering or a bound; the deadlines are hang guards only.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::arenad::{terminate, Arenad};
use common::*;
use futures::executor::block_on;
use target_rdma::client::ArenaClient;
use target_rdma::proto::{self, Header, Opcode, Request, Status, VERSION};

/// The uid and gid arenad runs as when the tests run as root, so that a
/// thread limit (RLIMIT_NPROC, which root ignores) binds it.
const NOBODY: u32 = 65534;

/// Sends `req` as request `id` and returns the answer, skipping REVOKEs.
fn call(s: &mut RawSession, id: u64, req: &Request<'_>) -> (Header, Vec<u8>) {
    let mut f = Vec::new();
    proto::encode_request(&mut f, id, req);
    s.send(&f).expect("send a request");
    loop {
        let (h, body) = s.recv().expect("an answer");
        if h.opcode != Opcode::Revoke {
            assert_eq!(h.request_id, id, "the answer to request {id}");
            return (h, body);
        }
    }
}

fn send(s: &mut RawSession, id: u64, req: &Request<'_>) {
    let mut f = Vec::new();
    proto::encode_request(&mut f, id, req);
    s.send(&f).expect("send a request");
}

fn alloc(s: &mut RawSession, id: u64, key: u64) -> u64 {
    let (h, body) = call(s, id, &Request::Alloc { key });
    assert_eq!(h.status, Status::Ok, "{}", proto::decode_error(&body));
    proto::decode_lease(&h, &body).unwrap().token
}

/// Fixes the socket's receive buffer at 64 KiB: no autotuning lets the
/// kernel absorb what the test means to be unread.
fn small_receive_buffer(s: &RawSession) {
    rustix::net::sockopt::set_socket_recv_buffer_size(&s.stream, 64 << 10).unwrap();
}

fn raw(a: &Arenad, volume: &str) -> RawSession {
    let key = if volume == "a" { SECRET_A } else { SECRET_B };
    RawSession::open(a.addr(), volume, &secret(key), VERSION, 0)
}

/// Threads of every process whose real uid is `uid`.
fn tasks_of(uid: u32) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        };
        if field("Uid:") == Some(u64::from(uid)) {
            n += field("Threads:").unwrap_or(0);
        }
    }
    n
}

fn chown_tree(path: &std::path::Path, uid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
    if path.is_dir() {
        for e in std::fs::read_dir(path).unwrap() {
            chown_tree(&e.unwrap().path(), uid);
        }
    }
}

/// A write, a read back and a FLUSH on a fresh session of volume a.
fn serves_a_legitimate_client(a: &Arenad) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let c = loop {
        match ArenaClient::connect(a.config("a")) {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                eprintln!("not yet served: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("a legitimate client is not served: {e}"),
        }
    };
    block_on(c.write(7, 0, b"served")).unwrap();
    let mut out = [0u8; 6];
    assert!(block_on(c.read_found(7, 0, &mut out)).unwrap());
    assert_eq!(&out, b"served");
    block_on(c.flush()).unwrap();
}

/// arenad as `NOBODY` when the tests run as root, with `limits`
/// (resource, value) set on it before it starts.
fn spawn_limited(a: &Arenad, dir: &std::path::Path, limits: &[(i32, u64)]) -> common::arenad::Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_arenad"));
    if rustix::process::geteuid().is_root() {
        chown_tree(dir, NOBODY);
        cmd.uid(NOBODY).gid(NOBODY);
    }
    let limits = limits.to_vec();
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls setrlimit, which is async-signal-safe; lowering a limit needs
    // no privilege.
    unsafe {
        cmd.pre_exec(move || {
            for &(resource, value) in &limits {
                let l = libc::rlimit {
                    rlim_cur: value,
                    rlim_max: value,
                };
                if libc::setrlimit(resource as _, &l) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    a.spawn_by(cmd)
}

#[test]
fn pre_auth_floods_under_a_thread_and_a_file_limit_leave_arenad_alive_and_serving() {
    let dir = tempfile::tempdir().unwrap();
    let a = Arenad::new(dir.path(), "4M", "64K", "16M", None);
    a.set("max_connections = 2000\nmax_unauthenticated = 1000\nhandshake_timeout_secs = 600");
    let flood = |n: usize| -> Vec<TcpStream> {
        // Sockets that never send HELLO, each within max_unauthenticated:
        // every one gets its CHALLENGE.
        (0..n)
            .map(|_| {
                let mut s = TcpStream::connect(a.addr()).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut body = Vec::new();
                let h = proto::read_frame(&mut s, &mut body)
                    .expect("a CHALLENGE")
                    .expect("a CHALLENGE, not the end of the stream");
                assert_eq!((h.opcode, h.status), (Opcode::Challenge, Status::Ok));
                s
            })
            .collect()
    };

    // Threads: as many as arenad runs once serving, plus a few. Not root,
    // the limit would count this test's own threads too, so it is only
    // tested as root (as CI runs).
    if rustix::process::geteuid().is_root() {
        let mut proc = spawn_limited(&a, dir.path(), &[]);
        serves_a_legitimate_client(&a);
        let threads = tasks_of(NOBODY);
        terminate(proc);
        let nproc = (libc::RLIMIT_NPROC as i32, threads + 4);
        proc = spawn_limited(&a, dir.path(), &[nproc]);
        serves_a_legitimate_client(&a);
        let idle = flood(300);
        serves_a_legitimate_client(&a);
        assert!(proc.alive());
        drop(idle);
        terminate(proc);
    } else {
        eprintln!("not root: the thread limit is not tested (it needs another uid)");
    }

    // Files: fewer than a flood needs. Accepts fail (EMFILE) while the
    // sockets stay; arenad lives, and serves once they go.
    let mut proc = spawn_limited(&a, dir.path(), &[(libc::RLIMIT_NOFILE as i32, 200)]);
    serves_a_legitimate_client(&a);
    let mut idle = flood(100);
    for _ in 0..300 {
        idle.push(TcpStream::connect(a.addr()).unwrap());
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(proc.alive(), "arenad survives EMFILE");
    drop(idle);
    serves_a_legitimate_client(&a);
    assert!(a.metric("arenad_accept_errors_total", &[]) > 0.0);
    assert!(proc.alive());
    terminate(proc);
}

#[test]
fn a_tenant_that_does_not_read_delays_no_other_tenant_nor_anyones_revoke() {
    let dir = tempfile::tempdir().unwrap();
    // 16 slots of 256 KiB.
    let a = Arenad::new(dir.path(), "4M", "256K", "64M", None);
    // The write deadline is above the 20 s hang guard of every read: what
    // must arrive while A does not read cannot wait for A to be cut.
    a.set("write_timeout_secs = 30");
    let proc = a.start();
    // A holds the two oldest leases; C the other 14 slots.
    let mut ta = raw(&a, "a");
    small_receive_buffer(&ta);
    let a_leases = [alloc(&mut ta, 1, 100), alloc(&mut ta, 2, 101)];
    let mut tc = raw(&a, "b");
    for i in 0..14 {
        alloc(&mut tc, i + 1, 200 + i);
    }
    // A pipelines reads of 32 MiB in all and reads none of it.
    let reads = 128;
    for i in 0..reads {
        send(
            &mut ta,
            10 + i,
            &Request::Read {
                key: 100,
                offset: 0,
                len: 256 << 10,
            },
        );
    }
    std::thread::sleep(Duration::from_millis(500));

    // B: a write finds every slot leased (BUSY, and the oldest leases are
    // asked back), its FLUSH and READ are answered.
    let mut tb = raw(&a, "b");
    let (h, _) = call(
        &mut tb,
        1,
        &Request::Write {
            key: 1,
            offset: 0,
            data: b"b",
        },
    );
    assert_eq!(h.status, Status::Busy);
    let (h, _) = call(&mut tb, 2, &Request::Flush);
    assert_eq!(h.status, Status::Ok);
    let (h, _) = call(
        &mut tb,
        3,
        &Request::Read {
            key: 999,
            offset: 0,
            len: 16,
        },
    );
    assert_eq!(h.status, Status::NotFound);
    // C gets its REVOKEs although A, asked first, is not reading.
    let (h, body) = tc.recv().expect("a REVOKE for C");
    assert_eq!(h.opcode, Opcode::Revoke);
    let (key, _) = proto::decode_revoke(&h, &body).unwrap();
    assert!((200..214).contains(&key), "{key}");

    // A was not cut for it: it now reads every answer, and its REVOKEs.
    let (mut answers, mut revoked) = (0, Vec::new());
    while answers < reads {
        let (h, body) = ta.recv().expect("A's session is still open");
        if h.opcode == Opcode::Revoke {
            revoked.push(proto::decode_revoke(&h, &body).unwrap().1);
        } else {
            assert_eq!((h.opcode, h.status), (Opcode::Read, Status::Ok));
            answers += 1;
        }
    }
    assert!(revoked.iter().all(|t| a_leases.contains(t)), "{revoked:?}");

    // Past the write deadline a client that does not read is disconnected,
    // and its leases end with it.
    for i in 0..reads {
        send(
            &mut ta,
            1000 + i,
            &Request::Read {
                key: 100,
                offset: 0,
                len: 256 << 10,
            },
        );
    }
    let guard = Instant::now() + Duration::from_secs(120);
    while a.metric("arenad_leases_held", &[]) != 14.0 {
        assert!(Instant::now() < guard, "A's leases never ended");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop((ta, tb, tc));
    terminate(proc);
}

#[test]
fn a_cold_fault_in_does_not_delay_a_resident_read_on_the_same_connection() {
    let dir = tempfile::tempdir().unwrap();
    // 4 slots of 1 MiB: of 12 blobs written, the first ones are in swap.
    let a = Arenad::new(dir.path(), "4M", "1M", "64M", None);
    let proc = a.start();
    let c = a.connect("a");
    for key in 0..12 {
        block_on(c.write(key, 0, &pattern(key, 1, 1 << 20))).unwrap();
    }
    block_on(c.flush()).unwrap();
    let cold_before = a.metric("arenad_fault_ins_total", &[]);

    let mut s = raw(&a, "a");
    s.stream.set_nodelay(true).unwrap();
    // Three whole-blob reads of cold blobs, then 4 KiB of the blob written
    // last (resident).
    for key in 0..3 {
        send(
            &mut s,
            key + 1,
            &Request::Read {
                key,
                offset: 0,
                len: 1 << 20,
            },
        );
    }
    send(
        &mut s,
        4,
        &Request::Read {
            key: 11,
            offset: 0,
            len: 4096,
        },
    );
    let order: Vec<u64> = (0..4)
        .map(|_| {
            let (h, body) = s.recv().expect("an answer");
            assert_eq!(h.status, Status::Ok);
            let key = if h.request_id == 4 {
                11
            } else {
                h.request_id - 1
            };
            assert_eq!(body, pattern(key, 1, 1 << 20)[..body.len()]);
            h.request_id
        })
        .collect();
    assert_eq!(order[0], 4, "the resident answer comes first: {order:?}");
    assert!(a.metric("arenad_fault_ins_total", &[]) >= cold_before + 3.0);
    drop((c, s));
    terminate(proc);
}

#[test]
fn range_reads_of_cold_blobs_in_flight_together_return_their_blocks() {
    let dir = tempfile::tempdir().unwrap();
    // 4 slots of 1 MiB: of 12 blobs written, the first ones are in swap;
    // at most 4 reads of them at the disk at once.
    let a = Arenad::new(dir.path(), "4M", "1M", "64M", None);
    a.set("swap_reads_in_flight = 4");
    let proc = a.start();
    let c = a.connect("a");
    for key in 0..12 {
        block_on(c.write(key, 0, &pattern(key, 1, 1 << 20))).unwrap();
    }
    block_on(c.flush()).unwrap();
    let cold_before = a.metric("arenad_fault_ins_total", &[]);

    let mut s = raw(&a, "a");
    // 64 reads of 4 KiB blocks (never a blob's first byte, which would
    // count toward read-ahead) of the 6 blobs surely in swap, all sent
    // before any answer is read.
    let at = |id: u64| (id % 6, ((id * 37) % 255 + 1) as u32 * 4096);
    for id in 0..64 {
        let (key, offset) = at(id);
        send(
            &mut s,
            id,
            &Request::Read {
                key,
                offset,
                len: 4096,
            },
        );
    }
    let mut seen = [false; 64];
    for _ in 0..64 {
        let (h, body) = s.recv().expect("an answer");
        assert_eq!(h.status, Status::Ok, "{}", proto::decode_error(&body));
        let id = h.request_id;
        assert!(
            !std::mem::replace(&mut seen[id as usize], true),
            "{id} twice"
        );
        let (key, offset) = at(id);
        let want = &pattern(key, 1, 1 << 20)[offset as usize..][..4096];
        assert!(body == want, "request {id}: key {key} at {offset}");
    }
    assert_eq!(a.metric("arenad_fault_ins_total", &[]), cold_before);
    drop((c, s));
    terminate(proc);
}

#[test]
fn sigterm_with_a_client_reading_a_trickle_exits_0_within_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let a = Arenad::new(dir.path(), "8M", "256K", "64M", None);
    a.set("write_timeout_secs = 3");
    let mut proc = a.start();
    let c = a.connect("a");
    block_on(c.write(1, 0, &[5u8; 256 << 10])).unwrap();
    let mut s = raw(&a, "a");
    small_receive_buffer(&s);
    for i in 0..128 {
        send(
            &mut s,
            i + 1,
            &Request::Read {
                key: 1,
                offset: 0,
                len: 256 << 10,
            },
        );
    }
    // 32 KiB every 200 ms: each socket write makes progress, the queue
    // would take minutes to drain.
    let mut trickle = s.stream.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 32 << 10];
        while matches!(trickle.read(&mut buf), Ok(n) if n > 0) {
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    let asked = Instant::now();
    proc.signal("TERM");
    // systemd's TimeoutStopSec=60s is the bound that matters; the guard
    // stops the test below it.
    let status = loop {
        if let Some(status) = proc.exited() {
            break status;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(55),
            "arenad did not exit within systemd's TimeoutStopSec"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "SIGTERM exits 0, got {status}");
    reader.join().unwrap();
    drop(c);
}

#[test]
fn requests_beyond_max_inflight_are_refused_with_a_protocol_error() {
    let dir = tempfile::tempdir().unwrap();
    let a = Arenad::new(dir.path(), "4M", "64K", "16M", None);
    a.set("max_inflight = 4\nwrite_timeout_secs = 60");
    let proc = a.start();
    let c = a.connect("a");
    block_on(c.write(1, 0, &[1u8; 4096])).unwrap();
    let mut s = raw(&a, "a");
    // Requests without reading a single answer, until the server stops
    // reading them.
    s.stream
        .set_write_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let mut sent = 0u64;
    while sent < 2_000_000 {
        let mut f = Vec::new();
        proto::encode_request(
            &mut f,
            sent + 1,
            &Request::Read {
                key: 1,
                offset: 0,
                len: 4096,
            },
        );
        if s.send(&f).is_err() {
            break;
        }
        sent += 1;
    }
    // Then every answer written before the refusal, the refusal, the end.
    let mut last = None;
    for _ in 0..200_000 {
        match s.recv() {
            Some((h, body)) if h.status == Status::Protocol => {
                last = Some((h, proto::decode_error(&body)));
                break;
            }
            Some((h, _)) => assert_eq!((h.opcode, h.status), (Opcode::Read, Status::Ok)),
            None => break,
        }
    }
    let (h, msg) = last.expect("a protocol error before the end of the stream");
    assert_eq!(h.opcode, Opcode::Read);
    assert!(
        msg.contains("exceeds the 4 requests in flight announced in CHALLENGE"),
        "{msg}"
    );
    assert!(s.recv().is_none(), "the session ends");
    assert!(a.metric("arenad_protocol_errors_total", &[("class", "sequence")]) >= 1.0);
    drop(c);
    terminate(proc);
}
