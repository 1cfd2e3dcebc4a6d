//! A real etcd (Debian's `etcd-server`) on loopback for one test: random
//! ports, a temporary data dir, killed (`kill -9`) when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use target_rdma::testing::free_port;
use ublkd::coordination::EtcdConfig;

/// A running single-member etcd.
pub struct EtcdServer {
    child: Option<Child>,
    pub client_port: u16,
    _dir: tempfile::TempDir,
    pub log: PathBuf,
}

impl EtcdServer {
    /// Starts etcd and waits until it answers as itself: a member named
    /// for this instance, so a port lost to another test's etcd is seen
    /// and retried on new ports, not shared.
    pub fn start() -> Self {
        static INSTANCE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        for _ in 0..5 {
            let n = INSTANCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = format!("test-{}-{n}", std::process::id());
            if let Some(s) = Self::try_start(&name) {
                return s;
            }
        }
        panic!("etcd did not come up on 5 pairs of ports");
    }

    fn try_start(name: &str) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let (client_port, peer_port) = (free_port(), free_port());
        let log = dir.path().join("etcd.log");
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let child = Command::new("etcd")
            .args(["--name", name, "--data-dir"])
            .arg(dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("{name}={peer}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("etcd (Debian package etcd-server) must be installed");
        let mut s = Self {
            child: Some(child),
            client_port,
            _dir: dir,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (ok, members) = s.etcdctl(&["member", "list"]);
            if ok && members.contains(name) {
                return Some(s);
            }
            // Exited: a port was taken (the log says which). Dropping `s`
            // reaps it.
            if s.child.as_mut().unwrap().try_wait().unwrap().is_some() {
                eprintln!(
                    "etcd {name} exited at start, retrying on new ports: {}",
                    std::fs::read_to_string(&s.log)
                        .unwrap_or_default()
                        .lines()
                        .last()
                        .unwrap_or("")
                );
                return None;
            }
            assert!(Instant::now() < deadline, "etcd did not come up");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The client endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// An `[etcd]` config for this server with a short lease (2 s, etcd's
    /// smallest), so expiry tests are quick.
    pub fn config(&self) -> EtcdConfig {
        let mut c = EtcdConfig::new(vec![self.endpoint()]);
        c.lease_ttl_secs = 2;
        c.lease_margin_ms = 500;
        c.request_timeout_ms = 1000;
        c.dial_timeout_ms = 1000;
        c
    }

    /// Runs `etcdctl` against this server: (success, stdout).
    pub fn etcdctl(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoint(), "--dial-timeout", "1s"])
            .args(args)
            .output()
            .expect("etcdctl (Debian package etcd-client) must be installed");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// Sends `sig` (`STOP`, `CONT`) to etcd.
    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        assert!(Command::new("kill")
            .args([&format!("-{sig}"), &pid])
            .status()
            .unwrap()
            .success());
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Polls `cond` every 50 ms; panics with `what` after `limit` (a hang
/// guard, not a timing assertion).
pub fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
