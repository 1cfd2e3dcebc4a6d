//! The real `arenad` binary as a child process, for tests about what it
//! does with its files across restarts: its exit status, its messages, its
//! metrics.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::blob::ArenaError;
use crate::client::{ArenaClient, ClientConfig, FlushDomain};

use super::{free_port, secret, secret_file, SECRET_A, SECRET_B};

/// The arenad binary: cargo names it to target-rdma's own tests; other
/// packages' tests (ublkd's) find it beside their own executable, in the
/// target dir `cargo test --workspace` built it into.
pub fn arenad_bin() -> PathBuf {
    if let Some(p) = option_env!("CARGO_BIN_EXE_arenad") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let p = dir.join("arenad");
    assert!(
        p.exists(),
        "{} is missing: build it first (cargo build -p target-rdma --bin arenad)",
        p.display()
    );
    p
}

/// A running arenad, killed (`kill -9`) when dropped, so a failing test
/// leaves no process behind.
pub struct Proc(Option<Child>);

impl Proc {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.0.as_ref().expect("a running arenad").id()
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        self.0
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    fn take(mut self) -> Child {
        self.0.take().expect("a running arenad")
    }

    /// Sends `signal` (`HUP`, `TERM`) as `kill` or `systemctl` would.
    pub fn signal(&self, signal: &str) {
        let pid = self.0.as_ref().expect("a running arenad").id();
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{signal} {pid}");
    }

    /// The exit status, if it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.0.as_mut().and_then(|c| c.try_wait().unwrap())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// An arenad configuration in a directory: volumes "a" and "b", its swap
/// directory, its ports.
pub struct Arenad {
    pub cfg: PathBuf,
    pub swap_dir: PathBuf,
    pub port: u16,
    pub metrics_port: u16,
    /// Its admin socket (`arenactl --socket`).
    pub admin: PathBuf,
}

impl Arenad {
    /// Writes `dir/arenad.toml` with these sizes and `swap_dir` (default
    /// `dir/swap`).
    pub fn new(dir: &Path, arena: &str, blob: &str, swap: &str, swap_dir: Option<&Path>) -> Arenad {
        let a = secret_file(dir, "a.key", SECRET_A);
        let b = secret_file(dir, "b.key", SECRET_B);
        let swap_dir = swap_dir.map_or_else(|| dir.join("swap"), Path::to_path_buf);
        let (port, metrics_port) = (free_port(), free_port());
        let cfg = dir.join("arenad.toml");
        let admin = dir.join("admin.sock");
        std::fs::write(
            &cfg,
            format!(
                "listen = \"127.0.0.1:{port}\"\narena_bytes = \"{arena}\"\nblob_bytes = \"{blob}\"\n\
                 swap_dir = \"{}\"\nswap_bytes = \"{swap}\"\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\n\
                 admin_socket = \"{}\"\n\n\
                 [[volume]]\nname = \"a\"\nsecret_file = \"{}\"\nquota = \"1G\"\n\n\
                 [[volume]]\nname = \"b\"\nsecret_file = \"{}\"\nquota = \"1G\"\n",
                swap_dir.display(),
                admin.display(),
                a.display(),
                b.display()
            ),
        )
        .unwrap();
        Arenad {
            cfg,
            swap_dir,
            port,
            metrics_port,
            admin,
        }
    }

    /// Adds top-level `keys` (TOML lines) to the config.
    pub fn set(&self, keys: &str) {
        let text = std::fs::read_to_string(&self.cfg).unwrap();
        std::fs::write(&self.cfg, format!("{keys}\n{text}")).unwrap();
    }

    /// The value of arenad's exported sample `name` with `labels`.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        ublk_metrics::testing::sample(&self.metrics(), name, labels)
    }

    /// Starts arenad.
    pub fn spawn(&self) -> Proc {
        self.spawn_by(Command::new(arenad_bin()))
    }

    /// Starts arenad the way a typical shell would, under `umask 022`, so a
    /// test can check the modes of the files it creates.
    pub fn spawn_under_umask_022(&self) -> Proc {
        let mut sh = Command::new("sh");
        sh.args(["-c", "umask 022 && exec \"$0\" \"$@\""])
            .arg(arenad_bin());
        self.spawn_by(sh)
    }

    /// Runs `cmd` (arenad, or what execs it) with this config, output muted.
    pub fn spawn_by(&self, mut cmd: Command) -> Proc {
        Proc(Some(
            cmd.arg("--config")
                .arg(&self.cfg)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        ))
    }

    /// Starts arenad with `args` and JSON logs, and returns its stderr
    /// lines as they come.
    pub fn spawn_logged(&self, args: &[&str]) -> (Proc, std::sync::mpsc::Receiver<String>) {
        let (child, lines) = ublk_metrics::testing::spawn_with_log_lines(
            Command::new(arenad_bin())
                .arg("--config")
                .arg(&self.cfg)
                .args(["--log-format", "json"])
                .args(args)
                .env_remove("RUST_LOG"),
        );
        (Proc(Some(child)), lines)
    }

    /// Starts arenad and waits until it serves (its signal handlers are in
    /// place by then).
    pub fn start(&self) -> Proc {
        let child = self.spawn();
        drop(self.connect("a"));
        child
    }

    /// Runs arenad with `args` where it is expected to exit on its own (a
    /// refusal to start, `--repair`); fails the test if it is still running
    /// after 60 s.
    pub fn run(&self, args: &[&str]) -> Output {
        let mut child = Command::new(arenad_bin())
            .arg("--config")
            .arg(&self.cfg)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                child.kill().unwrap();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "arenad {args:?} did not exit: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        child.wait_with_output().unwrap()
    }

    /// A client of `volume`, retried until arenad listens.
    pub fn connect(&self, volume: &str) -> ArenaClient {
        self.connect_in(volume, Arc::default())
    }

    /// A client whose FLUSHes vouch for every client of `domain`.
    pub fn connect_in(&self, volume: &str, domain: Arc<FlushDomain>) -> ArenaClient {
        let mut cfg = self.config(volume);
        cfg.flush_domain = domain;
        self.connect_with(cfg)
    }

    /// The client config of `volume` (its secret, this arenad's port). It
    /// accepts protocol version 1 too, so the fixture also drives an arenad
    /// that predates version 2 (a test's "fails on the old server" run);
    /// arenad offers 2 unless allow_protocol_v1, and the client takes the
    /// newest offered.
    pub fn config(&self, volume: &str) -> ClientConfig {
        let value = if volume == "a" { SECRET_A } else { SECRET_B };
        let mut cfg = ClientConfig::new(format!("127.0.0.1:{}", self.port), volume, secret(value));
        cfg.versions = 1..=crate::proto::VERSION;
        cfg
    }

    /// The address of the control stream.
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A client with `cfg`, retried until arenad listens.
    pub fn connect_with(&self, cfg: ClientConfig) -> ArenaClient {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match ArenaClient::connect(cfg.clone()) {
                Ok(c) => return c,
                Err(ArenaError::Connect { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => panic!("arenad did not come up: {e}"),
            }
        }
    }

    /// The Prometheus text of `/metrics`.
    pub fn metrics(&self) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics_port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    }
}

/// Stops `child` the way systemd does (SIGTERM, which flushes) and checks it
/// exited cleanly.
pub fn terminate(p: Proc) {
    let mut child = p.take();
    Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "SIGTERM must exit 0, got {status}");
}

/// `kill -9`.
pub fn kill9(p: Proc) {
    let mut child = p.take();
    child.kill().unwrap();
    child.wait().unwrap();
}
