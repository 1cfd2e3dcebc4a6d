//! What the real `arenad` process asks of its host: the modes of the files
//! it creates (private whatever the umask it was started under) and the
//! file descriptors it holds per connection, which `LimitNOFILE=` in
//! `systemd/arenad.service` is sized from.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use futures::executor::block_on;
use target_rdma::client::ArenaClient;

mod common;
use common::arenad::{terminate, Arenad, Proc};

/// Descriptors one authenticated TCP session holds in arenad: the accepted
/// stream (its reader and writer share it).
const FDS_PER_TCP_SESSION: usize = 1;
/// An RDMA rail adds its completion channel.
const FDS_PER_RDMA_RAIL: usize = 1;
/// Everything else an idle arenad holds: stdio, listeners, swap file,
/// journal, lock, io_uring rings, signal pipe, RDMA device handles, and
/// the epoll and eventfd of each serving runtime (the accept loop's and up
/// to 16 workers').
const FDS_FIXED: usize = 96;
/// The metrics listener at its default `metrics_max_connections`, plus
/// its epoll and eventfd.
const FDS_METRICS_LISTENER: usize = ublk_metrics::http::DEFAULT_MAX_CONNECTIONS + 2;
/// The largest `max_connections` the config accepts.
const MAX_CONNECTIONS: usize = 65536;

/// An arenad in `dir` (swap files under `dir/state/swap`) with
/// `max_connections`, started under `umask 022` and serving.
fn start_under_umask_022(dir: &Path, max_connections: usize) -> (Arenad, Proc) {
    let arenad = Arenad::new(dir, "1M", "64K", "8M", Some(&dir.join("state/swap")));
    arenad.set(&format!("max_connections = {max_connections}"));
    let child = arenad.spawn_under_umask_022();
    drop(arenad.connect("a"));
    (arenad, child)
}

/// Descriptors the process holds once transient ones (a swap ring opened
/// for a moment, a connection being torn down) are gone: the fewest seen
/// over a second, so a loaded machine does not count them as per-session.
fn open_fds(child: &Proc) -> usize {
    (0..10)
        .map(|i| {
            if i > 0 {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            std::fs::read_dir(format!("/proc/{}/fd", child.pid()))
                .unwrap()
                .count()
        })
        .min()
        .unwrap()
}

#[test]
fn files_arenad_creates_are_private_under_umask_022() {
    let dir = tempfile::tempdir().unwrap();
    let (arenad, child) = start_under_umask_022(dir.path(), 16);
    let c = arenad.connect("a");
    block_on(async {
        c.write(1, 0, &[7u8; 4096]).await.unwrap();
        c.flush().await.unwrap();
    });
    drop(c);
    // The final flush on SIGTERM writes the index once more.
    terminate(child);

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
    let (arenad, child) = start_under_umask_022(dir.path(), 64);
    let first = arenad.connect("a");
    let idle = open_fds(&child);
    assert!(idle <= FDS_FIXED, "an idle arenad holds {idle} descriptors");
    // Per session is the slope between 16 and 32 more sessions: what the
    // first sessions make arenad open once (a swap ring, a pool) is fixed
    // cost, not per-session cost.
    const SESSIONS: usize = 16;
    let mut clients: Vec<ArenaClient> = (0..SESSIONS).map(|_| arenad.connect("a")).collect();
    let some = open_fds(&child);
    assert!(
        some <= FDS_FIXED + SESSIONS * FDS_PER_TCP_SESSION,
        "{some} descriptors with {SESSIONS} sessions"
    );
    clients.extend((0..SESSIONS).map(|_| arenad.connect("a")));
    let more = open_fds(&child);
    let per_session = (more - some).div_ceil(SESSIONS);
    assert!(
        per_session <= FDS_PER_TCP_SESSION,
        "{per_session} descriptors per session ({idle} idle, {some} with {SESSIONS} sessions, {more} with {})",
        2 * SESSIONS
    );
    drop(clients);
    drop(first);
    terminate(child);

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
    let need = MAX_CONNECTIONS * (FDS_PER_TCP_SESSION + FDS_PER_RDMA_RAIL)
        + FDS_FIXED
        + FDS_METRICS_LISTENER;
    assert!(limit >= need, "LimitNOFILE={limit}, need {need}");
}
