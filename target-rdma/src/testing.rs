//! Test support, the one arenad harness of the workspace's tests and
//! benchmarks: an in-process [`Peer`] (the real `Server` over a real `Store`
//! in a temp dir, on loopback) with its own isolated telemetry, which is
//! where tests read what the server counted; and the [`conformance`]
//! suites every backend of a capability runs. Compiled for tests only
//! (feature `test-utils`), never into the daemons.

pub mod arenad;
pub mod conformance;
mod echo;
pub mod log_lines;
mod ports;
mod raw;
mod raw_rail;
pub mod relay;
mod uring;

pub use echo::EchoPeer;
pub use ports::free_port;
pub use raw::{RawSession, Refusal};
pub use raw_rail::RawRail;
pub use uring::UringLoop;

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use ublk_metrics::testing::sample;
use ublk_metrics::{Daemon, Telemetry};

use crate::arenad::epochs::Epochs;
use crate::arenad::observability::ArenadObservability;
use crate::arenad::server::{ServedRails, ServedVolume, Server, ServerLimits, ServerRdma};
use crate::auth::Secret;
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::client::{ArenaClient, ClientConfig, FlushDomain, RdmaTransport, RdmaTransportConfig};
use crate::rdma::{Isolation, RdmaProvider};
use crate::replica::clock::system;
use crate::replica::{
    Coordinator, MemberIo, MemberSessions, Membership, MemoryCoordinator, ReplicaConfig, ReplicaSet,
};
use crate::store::{InProcess, Store, StoreConfig, VolumeSpec};

/// Secret of the default volume "a".
pub const SECRET_A: &str = "secret-of-volume-a-0123456789";
/// Secret of the default volume "b".
pub const SECRET_B: &str = "secret-of-volume-b-9876543210";

/// A secret from a test string.
pub fn secret(s: &str) -> Secret {
    Secret::new(s.as_bytes().to_vec()).expect("a valid test secret")
}

/// Writes a 0600 secret file `name` in `dir` holding `value`.
pub fn secret_file(dir: &Path, name: &str, value: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("{value}\n")).expect("write the secret file");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))
        .expect("chmod the secret file");
    p
}

/// How a [`Peer`] is set up.
#[derive(Clone)]
pub struct PeerOpts {
    /// RAM arena size.
    pub arena_bytes: u64,
    /// Blob size.
    pub blob_bytes: u32,
    /// Swap file size.
    pub swap_bytes: u64,
    /// Quota of every volume, in blobs.
    pub quota_blobs: u64,
    /// Pipeline depth announced to clients.
    pub max_inflight: u32,
    /// Register the arena on these devices, one rail each, and grant RDMA
    /// to clients (none: TCP only).
    pub rdma: Vec<Arc<dyn RdmaProvider>>,
    /// What the RDMA keys handed to sessions reach.
    pub rdma_isolation: Isolation,
    /// Volumes served, as (name, secret); by default "a" and "b".
    pub volumes: Vec<(String, String)>,
    /// Names of the volumes served to sealed sessions only (protocol
    /// version 3, `[[volume]] confidential = true`); by default none.
    pub confidential: Vec<String>,
    /// Accept protocol version 1 sessions.
    pub allow_v1: bool,
    /// Most connections at once.
    pub max_connections: u32,
    /// Cold GETs of a blob after which it is faulted in in the background.
    pub promote_cold_after: u32,
}

impl Default for PeerOpts {
    fn default() -> Self {
        Self {
            arena_bytes: 16 << 20,
            blob_bytes: 64 << 10,
            swap_bytes: 64 << 20,
            quota_blobs: 1 << 20,
            max_inflight: 64,
            rdma: Vec::new(),
            rdma_isolation: Isolation::default(),
            volumes: vec![("a".into(), SECRET_A.into()), ("b".into(), SECRET_B.into())],
            confidential: Vec::new(),
            allow_v1: false,
            max_connections: 64,
            promote_cold_after: 2,
        }
    }
}

/// An arena peer serving from a directory; it can stop serving and serve
/// again on the same address over the same store ([`Peer::pause`],
/// [`Peer::resume`]), or be reopened from its directory
/// ([`Peer::start_at`]), which is a restart (a new generation).
pub struct Peer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its store.
    pub store: Arc<Store>,
    /// Its telemetry (isolated: nothing global).
    pub obs: Arc<ArenadObservability>,
    dir: PathBuf,
    opts: PeerOpts,
    running: Option<(Arc<Server>, JoinHandle<()>)>,
}

impl Peer {
    /// Starts a peer serving `opts.volumes` from `dir` on a free port.
    pub fn start(dir: &Path, opts: PeerOpts) -> Peer {
        Self::start_at(dir, opts, "127.0.0.1:0")
    }

    /// Starts (or restarts) a peer on `addr` over the store in `dir`.
    pub fn start_at(dir: &Path, opts: PeerOpts, addr: &str) -> Peer {
        let store = Arc::new(
            Store::open(
                StoreConfig {
                    dir: dir.to_owned(),
                    arena_bytes: opts.arena_bytes,
                    blob_bytes: opts.blob_bytes,
                    swap_bytes: opts.swap_bytes,
                    swap_reads_in_flight: crate::store::DEFAULT_SWAP_READS_IN_FLIGHT,
                },
                &opts
                    .volumes
                    .iter()
                    .map(|(n, _)| VolumeSpec {
                        name: n.clone(),
                        quota_blobs: opts.quota_blobs,
                    })
                    .collect::<Vec<_>>(),
            )
            .expect("open the store"),
        );
        let obs = ArenadObservability::new(
            Telemetry::isolated(Daemon::Arenad, "test"),
            ublk_metrics::VolumeLabels::default(),
        );
        obs.store_opened(&store, opts.volumes.len());
        let listener = TcpListener::bind(addr).expect("bind the peer's address");
        let mut peer = Peer {
            addr: listener.local_addr().expect("a bound address"),
            store,
            obs,
            dir: dir.to_owned(),
            opts,
            running: None,
        };
        peer.serve(listener);
        peer
    }

    fn serve(&mut self, listener: TcpListener) {
        let volumes = self
            .opts
            .volumes
            .iter()
            .enumerate()
            .map(|(i, (n, s))| ServedVolume {
                name: n.clone(),
                secret: secret(s),
                id: i as u32,
                quota_blobs: self.opts.quota_blobs,
                confidential: self.opts.confidential.contains(n),
            })
            .collect();
        let rails = self.opts.rdma.iter().map(|p| {
            Some(
                ServerRdma::register(Arc::clone(p), &self.store, 64, self.opts.rdma_isolation)
                    .expect("register the arena for RDMA"),
            )
        });
        let rdma = ServedRails::new(rails.collect()).expect("at most two rails");
        let epochs = Epochs::open(&self.dir).expect("load the volumes' epochs");
        epochs.prepare().expect("allocate the volumes' epochs file");
        let server = Server::new(
            Arc::clone(&self.store),
            volumes,
            epochs,
            ServerLimits {
                max_connections: self.opts.max_connections,
                max_inflight: self.opts.max_inflight,
                handshake_timeout: Duration::from_secs(5),
                allow_v1: self.opts.allow_v1,
                max_unauthenticated: self.opts.max_connections,
                handshake_source_prefix_v4: 32,
                handshake_source_prefix_v6: 64,
                write_timeout: Duration::from_secs(5),
                max_queued_frames: 4096,
                max_queued_bytes: 16 << 20,
                blocking_threads: 4,
                promote_cold_after: self.opts.promote_cold_after,
                shutdown_timeout: Duration::from_secs(10),
            },
            rdma,
            Arc::clone(&self.obs),
        )
        .expect("start the server's blocking pool");
        let s = Arc::clone(&server);
        self.obs.serving();
        let thread = std::thread::spawn(move || s.serve(listener).expect("serve"));
        self.running = Some((server, thread));
    }

    /// Stops serving (connections end); the store stays open.
    pub fn pause(&mut self) {
        if let Some((server, thread)) = self.running.take() {
            server.shutdown();
            let _ = thread.join();
        }
    }

    /// Serves again on the same address, over the same store.
    pub fn resume(&mut self) {
        let listener = TcpListener::bind(self.addr).expect("rebind the same address");
        self.serve(listener);
    }

    /// Graceful stop: connections end, the store is flushed.
    pub fn stop(mut self) {
        self.pause();
        self.store.flush().expect("final flush");
    }

    /// A connected client of `volume`.
    pub fn client(&self, volume: &str, secret_value: &str) -> ArenaClient {
        ArenaClient::connect(self.config(volume, secret_value)).expect("connect to the peer")
    }

    /// A connected [`ClientConfig::driven`] client of `volume`, driven by
    /// a thread of its own running a [`UringLoop`] (as a ublk queue
    /// thread's ring would), which ends with the client.
    pub fn driven_client(&self, volume: &str, secret_value: &str) -> ArenaClient {
        let mut cfg = self.config(volume, secret_value);
        cfg.driven = true;
        driven(cfg)
    }

    /// A client config for `volume` on this peer (10 s request timeout).
    pub fn config(&self, volume: &str, secret_value: &str) -> ClientConfig {
        let mut c = ClientConfig::new(self.addr.to_string(), volume, secret(secret_value));
        c.request_timeout = Duration::from_secs(10);
        c
    }

    /// An RDMA transport of volume "a" over `provider` (the peer must grant
    /// RDMA on it) that moves every payload by RDMA (threshold 1 byte,
    /// buffers of `blob` bytes) and caches at most `lease_cache` leases.
    pub fn rdma_session(
        &self,
        provider: Arc<dyn RdmaProvider>,
        blob: u32,
        lease_cache: usize,
    ) -> RdmaTransport {
        self.rdma_transport(provider, blob, lease_cache, None)
    }

    /// [`rdma_session`](Self::rdma_session), driven: its completions are
    /// reaped by its [`CqDriver`](crate::client::CqDriver) on a
    /// [`UringLoop`] thread (as a ublk queue's ring would) until the
    /// transport is dropped, polling for `busy_poll` before it sleeps.
    pub fn driven_rdma_session(
        &self,
        provider: Arc<dyn RdmaProvider>,
        blob: u32,
        lease_cache: usize,
        busy_poll: Duration,
    ) -> RdmaTransport {
        let t = self.rdma_transport(provider, blob, lease_cache, Some(busy_poll));
        let driver = t.cq_driver().expect("a driven transport has a driver");
        on_loop_thread(move |lp| lp.block_on(driver.run(lp)));
        t
    }

    /// The transport of [`rdma_session`](Self::rdma_session); driven with
    /// that busy poll when `driven` is set.
    fn rdma_transport(
        &self,
        provider: Arc<dyn RdmaProvider>,
        blob: u32,
        lease_cache: usize,
        driven: Option<Duration>,
    ) -> RdmaTransport {
        RdmaTransport::connect(
            self.config("a", SECRET_A),
            vec![Ok(provider)],
            RdmaTransportConfig {
                min_rdma_bytes: 1,
                buffer_bytes: blob,
                pool_buffers: 8,
                lease_cache,
                require_rdma: true,
                driven: driven.is_some(),
                busy_poll: driven.unwrap_or_default(),
                ..RdmaTransportConfig::default()
            },
        )
        .expect("an RDMA session")
    }

    /// TCP sessions of volume "a" as one replica member: `queues` queue
    /// sessions and a background one, sharing one flush domain.
    pub fn member_sessions(&self, queues: usize) -> MemberSessions<ArenaClient> {
        let domain = Arc::new(FlushDomain::default());
        let client = || {
            let mut c = self.config("a", SECRET_A);
            c.flush_domain = Arc::clone(&domain);
            ArenaClient::connect(c).expect("connect to the peer")
        };
        MemberSessions {
            queues: (0..queues).map(|_| client()).collect(),
            background: client(),
            epoch: 0,
        }
    }

    /// The value of the peer's exported sample `name` with `labels`
    /// (summed over the other labels).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let text = self.obs.telemetry().render().expect("render the metrics");
        sample(&text, name, labels) as u64
    }

    /// Authenticated sessions open on the peer now.
    pub fn sessions(&self) -> usize {
        self.obs.sessions()
    }

    /// Protocol errors the peer counted, all classes together.
    pub fn protocol_errors(&self) -> u64 {
        self.metric("arenad_protocol_errors_total", &[])
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.pause();
    }
}

/// A deterministic pattern for (key, generation) so mix-ups are detectable.
pub fn pattern(key: u64, gen: u64, len: usize) -> Vec<u8> {
    let mut x =
        key.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ gen.wrapping_mul(0xbf58_476d_1ce4_e5b9) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An in-process store as a replica member: it never restarts under its
/// sessions, so it never loses acknowledged writes, and protocol epochs do
/// not apply to direct calls.
pub struct LocalMember(pub InProcess);

impl BlobIo for LocalMember {
    fn transport(&self) -> Transport {
        self.0.transport()
    }
    fn blob_bytes(&self) -> u32 {
        self.0.blob_bytes()
    }
    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        self.0.read(key, offset, out).await
    }
    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        self.0.write(key, offset, data).await
    }
    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        self.0.remove(start, end).await
    }
    async fn flush(&self) -> Result<(), ArenaError> {
        self.0.flush().await
    }
}

impl MemberIo for LocalMember {
    fn lost_writes(&self) -> bool {
        false
    }
    /// The in-process store has no epochs: like a protocol-1 peer.
    async fn raise_epoch(&self, _epoch: u64) -> Result<bool, ArenaError> {
        Ok(false)
    }
}

/// `queues` sessions (and a background one) of volume 0 of `store`.
pub fn local_member(store: &Arc<Store>, queues: usize) -> MemberSessions<LocalMember> {
    let s = || LocalMember(InProcess::new(Arc::clone(store), 0));
    MemberSessions {
        queues: (0..queues).map(|_| s()).collect(),
        background: s(),
        epoch: 0,
    }
}

/// A new replicated volume over `members` (peer name, sessions), all
/// healthy, coordinated in memory on the system clock.
pub fn replicated<S: MemberIo>(members: Vec<(String, MemberSessions<S>)>) -> Arc<ReplicaSet<S>> {
    let names: Vec<_> = members.iter().map(|(n, _)| n.clone()).collect();
    let coord = MemoryCoordinator::new(system(), Membership::new_volume(&names).expect("names"));
    futures::executor::block_on(ReplicaSet::open(
        "a",
        coord as Arc<dyn Coordinator>,
        system(),
        ReplicaConfig::default(),
        members,
    ))
    .expect("open the replicated volume")
}

/// The host's RDMA device (soft-RoCE in the VM suite): the tests that
/// need one are ignored elsewhere, so a missing device is a panic.
pub fn rdma_device() -> Arc<dyn RdmaProvider> {
    Arc::new(
        crate::rdma::verbs::SidewayProvider::open(&crate::rdma::DeviceSelector::default())
            .expect("an RDMA device (soft-RoCE: scripts/vm/guest/rdma.sh)"),
    )
}

/// Connects a [`ClientConfig::driven`] client and runs its driver on a
/// [`UringLoop`] thread until the client is dropped.
pub fn driven(cfg: ClientConfig) -> ArenaClient {
    assert!(cfg.driven, "a driven config");
    let client = ArenaClient::connect(cfg).expect("connect to the peer");
    drive(&client);
    client
}

/// Runs the driver of `client` (a [`ClientConfig::driven`] one, made
/// elsewhere: ublkd's `Connector`) on a [`UringLoop`] thread until the
/// client is dropped, as its queue thread's ring would.
pub fn drive(client: &ArenaClient) {
    let driver = client.driver().expect("a driven client has a driver");
    on_loop_thread(move |lp| lp.block_on(driver.run(lp)));
}

/// Runs `drive` on a [`UringLoop`] of a thread of its own, as a ublk
/// queue thread runs its ring.
fn on_loop_thread(drive: impl FnOnce(&UringLoop) + Send + 'static) {
    std::thread::Builder::new()
        .name("test-uring".into())
        .spawn(move || drive(&UringLoop::new().expect("an io_uring")))
        .expect("spawn the driver thread");
}
