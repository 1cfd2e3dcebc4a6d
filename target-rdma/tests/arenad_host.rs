//! What the real `arenad` process asks of its host: the modes of the files
//! it creates (private whatever the umask it was started under) and the
//! file descriptors it holds per connection, which `LimitNOFILE=` in
//! `systemd/arenad.service` is sized from.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use target_rdma::blob::ArenaError;
use target_rdma::client::{ArenaClient, ClientConfig};
use target_rdma::testing::*;

/// Descriptors one authenticated TCP session holds in arenad (the accepted
/// stream and its clones for the reader, the writer and shutdown).
const FDS_PER_TCP_SESSION: usize = 4;
/// An RDMA rail adds its completion channel.
const FDS_PER_RDMA_RAIL: usize = 1;
/// Everything else an idle arenad holds: stdio, listeners, swap file,
/// journal, lock, io_uring rings, signal pipe, and RDMA device handles.
const FDS_FIXED: usize = 64;
/// The largest `max_connections` the config accepts.
const MAX_CONNECTIONS: usize = 65536;

/// Starts arenad under `umask 022` (a typical shell) on a new swap dir.
fn spawn_under_umask_022(dir: &Path, port: u16, max_connections: usize) -> Child {
    let key = secret_file(dir, "a.key", SECRET_A);
    Command::new("sh")
        .arg("-c")
        .arg("umask 022 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_arenad"))
        .args(["--config", "/dev/null", "--metrics-listen", "off"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--arena-bytes",
            "1M",
            "--blob-bytes",
            "64K",
            "--swap-bytes",
            "8M",
        ])
        .args(["--max-connections", &max_connections.to_string()])
        .arg("--swap-dir")
        .arg(dir.join("state/swap"))
        .arg("--volume")
        .arg(format!("a:{}:4M", key.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn connect(port: u16) -> ArenaClient {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let cfg = ClientConfig::new(format!("127.0.0.1:{port}"), "a", secret(SECRET_A));
        match ArenaClient::connect(cfg) {
            Ok(c) => return c,
            Err(ArenaError::Connect { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("arenad did not come up: {e}"),
        }
    }
}

fn port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn sigterm(child: &mut Child) {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "SIGTERM must exit 0, got {status}");
}

/// Descriptors the process holds once transient ones (a swap ring opened
/// for a moment, a connection being torn down) are gone: the fewest seen
/// over a second, so a loaded machine does not count them as per-session.
fn open_fds(child: &Child) -> usize {
    (0..10)
        .map(|i| {
            if i > 0 {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            std::fs::read_dir(format!("/proc/{}/fd", child.id()))
                .unwrap()
                .count()
        })
        .min()
        .unwrap()
}

#[test]
fn files_arenad_creates_are_private_under_umask_022() {
    let dir = tempfile::tempdir().unwrap();
    let port = port();
    let mut child = spawn_under_umask_022(dir.path(), port, 16);
    let c = connect(port);
    block_on(async {
        c.write(1, 0, &[7u8; 4096]).await.unwrap();
        c.flush().await.unwrap();
    });
    drop(c);
    // The final flush on SIGTERM writes the index once more.
    sigterm(&mut child);

    let swap = dir.path().join("state/swap");
    let mut seen = Vec::new();
    for d in [dir.path().join("state"), swap.clone()] {
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{} has mode {mode:o}", d.display());
    }
    for entry in std::fs::read_dir(&swap).unwrap() {
        let entry = entry.unwrap();
        let mode = entry.metadata().unwrap().permissions().mode() & 0o777;
        let name = entry.file_name().to_string_lossy().into_owned();
        assert_eq!(mode, 0o600, "{name} has mode {mode:o}");
        seen.push(name);
    }
    // The swap file, the journal, the checkpoint and the lock at least.
    assert!(seen.len() >= 4, "only {seen:?} in the swap dir");
}

#[test]
fn file_descriptors_per_connection_fit_the_units_limit() {
    let dir = tempfile::tempdir().unwrap();
    let port = port();
    let mut child = spawn_under_umask_022(dir.path(), port, 64);
    let first = connect(port);
    let idle = open_fds(&child);
    assert!(idle <= FDS_FIXED, "an idle arenad holds {idle} descriptors");
    const SESSIONS: usize = 16;
    let clients: Vec<ArenaClient> = (0..SESSIONS).map(|_| connect(port)).collect();
    let busy = open_fds(&child);
    let per_session = (busy - idle).div_ceil(SESSIONS);
    assert!(
        per_session <= FDS_PER_TCP_SESSION,
        "{per_session} descriptors per session ({idle} idle, {busy} with {SESSIONS} more sessions)"
    );
    drop(clients);
    drop(first);
    sigterm(&mut child);

    // The unit must allow max_connections RDMA sessions at the config's limit.
    let volume = format!("a:{}:4M", dir.path().join("a.key").display());
    let check = |max: usize| {
        Command::new(env!("CARGO_BIN_EXE_arenad"))
            .args(["--config", "/dev/null", "--check", "--volume", &volume])
            // --check tells the truth about the whole start: a swap_dir
            // with room, free ports.
            .args([
                "--swap-bytes",
                "8M",
                "--blob-bytes",
                "64K",
                "--arena-bytes",
                "1M",
            ])
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "off"])
            .arg("--swap-dir")
            .arg(dir.path().join("check/swap"))
            .args(["--max-connections", &max.to_string()])
            .output()
            .unwrap()
    };
    let ok = check(MAX_CONNECTIONS);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let too_many = check(MAX_CONNECTIONS + 1);
    let err = String::from_utf8_lossy(&too_many.stderr);
    assert!(
        !too_many.status.success() && err.contains("max_connections"),
        "{err}"
    );
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/arenad.service"),
    )
    .unwrap();
    let limit: usize = unit
        .lines()
        .find_map(|l| l.strip_prefix("LimitNOFILE="))
        .expect("arenad.service sets LimitNOFILE=")
        .parse()
        .unwrap();
    let need = MAX_CONNECTIONS * (FDS_PER_TCP_SESSION + FDS_PER_RDMA_RAIL) + FDS_FIXED;
    assert!(limit >= need, "LimitNOFILE={limit}, need {need}");
}
