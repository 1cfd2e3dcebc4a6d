//! Confidential devices (`ublkctl add --confidential`) end to end, no
//! kernel needed: a device's sessions opened by ublkd's own code
//! (`Connector`, `Replicated::open`, the device manager's `add`) against
//! real arena peers (target-rdma's in-process `Peer`: arenad's server and
//! store) through a relay that records every byte, as anyone on the path
//! would see them. Every session of a confidential device, on every queue
//! and every replica member (background sessions included), speaks
//! protocol version 3 and no payload crosses readable; the same device
//! not confidential shows its payloads, which is what the check would
//! catch. A peer that speaks version 2 only refuses the device at `add`.

mod common;

use std::sync::Arc;

use futures::executor::block_on;
use target_rdma::blob::{BlobIo, Transport};
use target_rdma::proto::{VERSION_2, VERSION_3};
use target_rdma::testing::relay::{leaks, Relay};
use target_rdma::testing::{pattern, secret, EchoPeer, Peer, PeerOpts, SECRET_A};
use ublkd::config::{TransportChoice, UblkdConfig};
use ublkd::ctl::{AddArgs, ErrorKind};
use ublkd::device::{Connector, DeviceSpec, Manager};
use ublkd::observability::Observability;
use ublkd::queue_io::{negotiated, QueueIo, TagBuffers};

const BLOB: usize = 64 << 10;
const KEYS: u64 = 8;

/// A device of `queues` queues on `peers` (replicated when more than
/// one): confidential on `transport = auto` (which must mean TCP), or
/// not, on `tcp` (this host may have an RDMA device).
fn spec(peers: &[String], queues: u32, confidential: bool) -> DeviceSpec {
    let mut s = common::device_spec(
        peers,
        KEYS * BLOB as u64,
        BLOB as u64,
        BLOB as u64,
        "unused: the secret is passed in".into(),
    );
    s.queues = queues;
    s.transport = if confidential {
        TransportChoice::Auto
    } else {
        TransportChoice::Tcp
    };
    s.confidential = confidential;
    s
}

/// Writes a pattern of generation `gen` to every key (each through the
/// queue `key % queues`, flushed), reads every key back and compares;
/// returns the payloads.
fn write_and_verify(ios: &[QueueIo], gen: u64) -> Vec<Vec<u8>> {
    let payloads: Vec<Vec<u8>> = (0..KEYS).map(|k| pattern(k, gen, BLOB)).collect();
    let io = |k: u64| ios[k as usize % ios.len()].volume();
    for (k, p) in (0..KEYS).zip(&payloads) {
        block_on(io(k).write(k, 0, p)).unwrap_or_else(|e| panic!("write {k}: {e}"));
    }
    for io in ios {
        block_on(io.volume().flush()).unwrap();
    }
    let mut out = vec![0u8; BLOB];
    for (k, p) in (0..KEYS).zip(&payloads) {
        block_on(io(k + 1).read(k, 0, &mut out)).unwrap_or_else(|e| panic!("read {k}: {e}"));
        assert!(&out == p, "key {k} read back differs");
    }
    payloads
}

/// A volume on one peer, opened as the device manager's `connect_single`
/// opens it (driven sessions, one per queue), through a relay.
fn single(peer: &Peer, confidential: bool) -> (Relay, DeviceSpec, Vec<QueueIo>) {
    let relay = Relay::start(peer.addr);
    let spec = spec(&[relay.addr.to_string()], 2, confidential);
    let ios = common::open_single(&spec);
    (relay, spec, ios)
}

#[test]
fn a_confidential_device_moves_its_data_on_sealed_tcp_sessions_only() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());

    let (relay, spec, ios) = single(&peer, true);
    // `auto`, confidential: TCP on every queue, and `show` says why.
    for io in &ios {
        assert_eq!(io.session().transport(), Transport::Tcp);
        assert!(io.session().rdma_stats().is_none(), "no RDMA transport");
    }
    let n = negotiated(&ios);
    assert_eq!(n, Some((Transport::Tcp, None)));
    assert_eq!(
        n.and_then(|(_, why)| spec.transport_note(why)).as_deref(),
        Some("confidential: payloads stay on the sealed TCP stream")
    );
    let payloads = write_and_verify(&ios, 1);
    let conns = relay.seen();
    assert_eq!(conns.len(), 2, "one session per queue");
    for c in &conns {
        let c = c.lock().unwrap();
        assert_eq!(c.version(), u16::from(VERSION_3), "a sealed session");
        for p in &payloads {
            assert!(!leaks(&c.to_peer, p), "a WRITE's payload crossed readable");
            assert!(!leaks(&c.to_client, p), "a READ's payload crossed readable");
        }
    }
    drop(ios);

    // The same device, not confidential: version 2, payloads readable on
    // the wire (the check above would have seen them).
    let (relay, _, ios) = single(&peer, false);
    let payloads = write_and_verify(&ios, 2);
    let conns = relay.seen();
    let wire: Vec<(Vec<u8>, Vec<u8>)> = conns
        .iter()
        .map(|c| {
            let c = c.lock().unwrap();
            assert_eq!(c.version(), u16::from(VERSION_2));
            (c.to_peer.clone(), c.to_client.clone())
        })
        .collect();
    for p in &payloads {
        assert!(
            wire.iter().any(|(up, _)| leaks(up, p)),
            "a WRITE in the clear"
        );
        assert!(
            wire.iter().any(|(_, down)| leaks(down, p)),
            "a READ in the clear"
        );
    }
}

/// A replicated confidential volume: every member's queue and background
/// sessions (rebuild copies, epoch changes) are sealed.
#[test]
fn every_session_of_a_replicated_confidential_device_is_sealed() {
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<Peer> = dirs
        .iter()
        .map(|d| Peer::start(d.path(), PeerOpts::default()))
        .collect();
    let relays: Vec<Relay> = peers.iter().map(|p| Relay::start(p.addr)).collect();
    let names: Vec<String> = relays.iter().map(|r| r.addr.to_string()).collect();
    let spec = spec(&names, 2, true);
    let (ios, rep) = common::open_replicated(&spec);
    for io in &ios {
        assert_eq!(io.sessions().len(), 2, "a session to every member");
        assert!(io
            .sessions()
            .iter()
            .all(|s| s.transport() == Transport::Tcp));
    }
    let payloads = write_and_verify(&ios, 3);
    for r in &relays {
        let conns = r.seen();
        assert_eq!(conns.len(), 3, "two queues and the background session");
        for c in &conns {
            let c = c.lock().unwrap();
            assert_eq!(c.version(), u16::from(VERSION_3));
            for p in &payloads {
                assert!(!leaks(&c.to_peer, p) && !leaks(&c.to_client, p));
            }
        }
    }
    rep.stop();
    drop(peers);
}

/// Against a peer that offers version 2 only (the real version-2
/// handshake, target-rdma's `EchoPeer`: arenad itself always offers
/// version 3), `add --confidential` fails with the version, before any
/// kernel device, and never falls back to version 2; the same volume not
/// confidential gets its sessions.
#[test]
fn add_confidential_fails_against_a_peer_without_version_3() {
    let echo = EchoPeer::start("a", secret(SECRET_A), BLOB as u32);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = UblkdConfig::defaults();
    cfg.state_dir = dir.path().join("state");
    let obs = Observability::new(
        ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
        &cfg.metrics,
        &cfg.tracing,
    );
    let m = Manager::new(cfg, obs).unwrap();
    let add = AddArgs {
        peers: vec![echo.addr.to_string()],
        replicas: None,
        volume: "a".into(),
        secret_file: common::secret_file(dir.path(), "a.key", SECRET_A),
        size: KEYS * BLOB as u64,
        queues: Some(1),
        depth: None,
        blob_size: None,
        transport: None,
        confidential: true,
        io_buf: None,
        id: None,
        read_only: false,
        standby: false,
        activate_on_write: false,
        cpus: Vec::new(),
    };
    let e = m.add(&add).unwrap_err();
    let text = e.to_string();
    assert_eq!(e.kind(), ErrorKind::Peer, "{text}");
    assert!(
        text.contains(
            "peer speaks versions 2..=2; a confidential volume needs version 3 (sealed frames)"
        ),
        "{text}"
    );
    assert!(m.list().is_empty(), "no device");

    // Not confidential, the same peer serves the volume (version 2).
    let spec = spec(&[echo.addr.to_string()], 1, false);
    let connector = Connector::new(&UblkdConfig::defaults(), Arc::default());
    let bufs = [Arc::new(TagBuffers::new(
        spec.depth as usize,
        spec.io_buf as usize,
    ))];
    let sessions = connector
        .connect(&spec, &spec.peer, &secret(SECRET_A), &bufs, false, false)
        .unwrap();
    let s = &sessions.queues[0];
    block_on(s.client().write(0, 0, &pattern(0, 1, 4096))).unwrap();
    // And confidential, the connector itself refuses it.
    let e = connector
        .connect(
            &DeviceSpec {
                confidential: true,
                ..spec.clone()
            },
            &spec.peer,
            &secret(SECRET_A),
            &bufs,
            false,
            false,
        )
        .err()
        .expect("no version-2 session for a confidential device");
    assert!(e.to_string().contains("needs version 3"), "{e}");
}
