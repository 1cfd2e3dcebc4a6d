//! Durability across `kill -9` of the real `arenad` process: everything
//! acknowledged before a FLUSH survives; writes after it read back as their
//! old or their new content, never anything else.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::arenad::{kill9, terminate, Arenad};
use common::*;
use futures::executor::block_on;
use target_rdma::blob::ArenaError;
use target_rdma::client::FlushDomain;

const BLOB: usize = 64 << 10;

/// An arena of 8 blobs under 64 written keys: most data lives in swap.
fn arenad(dir: &std::path::Path) -> Arenad {
    Arenad::new(dir, "512K", "64K", "64M", None)
}

#[test]
fn flushed_data_survives_kill_9_and_unflushed_is_old_or_new() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    let child = p.spawn();
    let c = p.connect("a");
    let gen0 = c.welcome().unwrap().generation;

    block_on(async {
        for key in 0..64u64 {
            c.write(key, 0, &pattern(key, 1, BLOB)).await.unwrap();
        }
        c.flush().await.unwrap();
        // After the FLUSH: overwrite half the keys and add new ones, unflushed.
        for key in (0..64u64).step_by(2) {
            c.write(key, 0, &pattern(key, 2, BLOB)).await.unwrap();
        }
        for key in 100..110u64 {
            c.write(key, 0, &pattern(key, 2, BLOB)).await.unwrap();
        }
    });

    kill9(child);
    let child = p.spawn();
    let c2 = p.connect("a");
    assert!(
        c2.welcome().unwrap().generation > gen0,
        "generation must move on after a restart"
    );

    block_on(async {
        let mut out = vec![0; BLOB];
        for key in 0..64u64 {
            assert!(
                c2.read_found(key, 0, &mut out).await.unwrap(),
                "flushed key {key} lost"
            );
            let old = pattern(key, 1, BLOB);
            if key % 2 == 1 {
                assert!(out == old, "flushed key {key} corrupted");
            } else {
                assert!(
                    out == old || out == pattern(key, 2, BLOB),
                    "key {key} is neither old nor new"
                );
            }
        }
        for key in 100..110u64 {
            let present = c2.read_found(key, 0, &mut out).await.unwrap();
            assert!(
                !present || out == pattern(key, 2, BLOB),
                "unflushed new key {key} is garbage"
            );
        }
    });

    // The first client sees the restart: its unflushed writes may be gone,
    // so its next FLUSH must not claim success.
    let e = block_on(async {
        let mut out = vec![0; 4096];
        c.read_found(1, 0, &mut out).await.unwrap();
        c.flush().await
    })
    .unwrap_err();
    assert!(matches!(e, ArenaError::UnflushedDataLost { .. }), "{e}");
    block_on(c.flush()).unwrap();

    // A graceful stop flushes: everything written reads back after it.
    block_on(c2.write(200, 0, &pattern(200, 3, BLOB))).unwrap();
    // Ask arenad to stop the way systemd does.
    terminate(child);
    let child = p.spawn();
    let c3 = p.connect("a");
    let mut out = vec![0; BLOB];
    assert!(block_on(c3.read_found(200, 0, &mut out)).unwrap());
    assert!(out == pattern(200, 3, BLOB), "write before SIGTERM lost");
    kill9(child);
}

/// The queues of one device share a flush domain: a FLUSH on one queue
/// covers writes acknowledged on another, so after a `kill -9` it must
/// report their loss (not claim durability because it wrote nothing
/// itself), and once they are flushed no queue reports a loss.
#[test]
fn a_flush_vouches_for_every_queue_of_its_device() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    let mut child = p.spawn();
    let domain = Arc::new(FlushDomain::default());
    let (q0, q1) = (p.connect_in("a", domain.clone()), p.connect_in("a", domain));

    // Writes on queue 0, flushed by queue 1: durable, nothing to report.
    block_on(q0.write(1, 0, &pattern(1, 1, BLOB))).unwrap();
    block_on(q1.flush()).unwrap();
    kill9(child);
    child = p.spawn();
    let _ = p.connect("a");
    let mut out = vec![0; BLOB];
    assert!(block_on(q0.read_found(1, 0, &mut out)).unwrap());
    assert!(out == pattern(1, 1, BLOB));
    assert!(block_on(q1.read_found(1, 0, &mut out)).unwrap());
    block_on(q1.flush()).expect("queue 0's writes were flushed by queue 1");
    block_on(q0.flush()).expect("no queue lost anything");

    // Writes on queue 0 left unflushed, then a crash: queue 1's FLUSH fails.
    block_on(q0.write(2, 0, &pattern(2, 1, BLOB))).unwrap();
    kill9(child);
    child = p.spawn();
    let _ = p.connect("a");
    let e = block_on(async {
        q0.read_found(1, 0, &mut out).await.unwrap();
        q1.read_found(1, 0, &mut out).await.unwrap();
        q1.flush().await
    })
    .unwrap_err();
    assert!(matches!(e, ArenaError::UnflushedDataLost { .. }), "{e}");
    block_on(q0.flush()).expect("the loss is reported once");
    kill9(child);
}

#[test]
fn bad_config_stops_startup_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = arenad(dir.path()).cfg;
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"64K\"", "\"3000\"");
    std::fs::write(&cfg, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_arenad"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("invalid config: blob_bytes = 3000: ") && err.contains("power of two"),
        "{err}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_arenad"))
        .arg("--config")
        .arg(dir.path().join("nope.toml"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope.toml"));
}
