//! Durability across `kill -9` of the real `arenad` process: everything
//! acknowledged before a FLUSH survives; writes after it read back as their
//! old or their new content, never anything else.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use target_rdma::blob::ArenaError;
use target_rdma::client::{ArenaClient, ClientConfig, FlushDomain};
use target_rdma::testing::*;

const BLOB: usize = 64 << 10;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn write_config(dir: &Path, port: u16) -> std::path::PathBuf {
    let key = secret_file(dir, "a.key", SECRET_A);
    let cfg = dir.join("arenad.toml");
    // An arena of 8 blobs under 64 written keys: most data lives in swap.
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:{port}\"\narena_bytes = \"512K\"\nblob_bytes = \"64K\"\n\
             swap_dir = \"{}\"\nswap_bytes = \"64M\"\n\n[[volume]]\nname = \"a\"\nsecret_file = \"{}\"\nquota = \"32M\"\n",
            dir.join("swap").display(),
            key.display()
        ),
    )
    .unwrap();
    cfg
}

fn spawn(cfg: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_arenad"))
        .arg("--config")
        .arg(cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn connect(port: u16) -> ArenaClient {
    connect_in(port, Arc::default())
}

/// A client whose FLUSHes vouch for every client of `domain`.
fn connect_in(port: u16, domain: Arc<FlushDomain>) -> ArenaClient {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut cfg = ClientConfig::new(format!("127.0.0.1:{port}"), "a", secret(SECRET_A));
        cfg.flush_domain = Arc::clone(&domain);
        match ArenaClient::connect(cfg) {
            Ok(c) => return c,
            Err(ArenaError::Connect { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("arenad did not come up: {e}"),
        }
    }
}

#[test]
fn flushed_data_survives_kill_9_and_unflushed_is_old_or_new() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = write_config(dir.path(), port);
    let mut child = spawn(&cfg);
    let c = connect(port);
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

    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let mut child = spawn(&cfg);
    let c2 = connect(port);
    assert!(
        c2.welcome().unwrap().generation > gen0,
        "generation must move on after a restart"
    );

    block_on(async {
        let mut out = vec![0; BLOB];
        for key in 0..64u64 {
            assert!(
                c2.read(key, 0, &mut out).await.unwrap(),
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
            let present = c2.read(key, 0, &mut out).await.unwrap();
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
        c.read(1, 0, &mut out).await.unwrap();
        c.flush().await
    })
    .unwrap_err();
    assert!(matches!(e, ArenaError::UnflushedDataLost { .. }), "{e}");
    block_on(c.flush()).unwrap();

    // A graceful stop flushes: everything written reads back after it.
    block_on(c2.write(200, 0, &pattern(200, 3, BLOB))).unwrap();
    // Ask arenad to stop the way systemd does.
    Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "SIGTERM must exit 0, got {status}");
    let mut child = spawn(&cfg);
    let c3 = connect(port);
    let mut out = vec![0; BLOB];
    assert!(block_on(c3.read(200, 0, &mut out)).unwrap());
    assert!(out == pattern(200, 3, BLOB), "write before SIGTERM lost");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// The queues of one device share a flush domain: a FLUSH on one queue
/// covers writes acknowledged on another, so after a `kill -9` it must
/// report their loss (not claim durability because it wrote nothing
/// itself), and once they are flushed no queue reports a loss.
#[test]
fn a_flush_vouches_for_every_queue_of_its_device() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = write_config(dir.path(), port);
    let mut child = spawn(&cfg);
    let domain = Arc::new(FlushDomain::default());
    let (q0, q1) = (connect_in(port, domain.clone()), connect_in(port, domain));

    // Writes on queue 0, flushed by queue 1: durable, nothing to report.
    block_on(q0.write(1, 0, &pattern(1, 1, BLOB))).unwrap();
    block_on(q1.flush()).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    child = spawn(&cfg);
    let _ = connect(port);
    let mut out = vec![0; BLOB];
    assert!(block_on(q0.read(1, 0, &mut out)).unwrap());
    assert!(out == pattern(1, 1, BLOB));
    assert!(block_on(q1.read(1, 0, &mut out)).unwrap());
    block_on(q1.flush()).expect("queue 0's writes were flushed by queue 1");
    block_on(q0.flush()).expect("no queue lost anything");

    // Writes on queue 0 left unflushed, then a crash: queue 1's FLUSH fails.
    block_on(q0.write(2, 0, &pattern(2, 1, BLOB))).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    child = spawn(&cfg);
    let _ = connect(port);
    let e = block_on(async {
        q0.read(1, 0, &mut out).await.unwrap();
        q1.read(1, 0, &mut out).await.unwrap();
        q1.flush().await
    })
    .unwrap_err();
    assert!(matches!(e, ArenaError::UnflushedDataLost { .. }), "{e}");
    block_on(q0.flush()).expect("the loss is reported once");
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn bad_config_stops_startup_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), free_port());
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
