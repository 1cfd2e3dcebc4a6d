//! Shared fixtures: an in-process `arenad` on loopback over a temp dir.

#![allow(dead_code)]

pub mod arenad;

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use target_rdma::arenad::server::{ServedVolume, Server, ServerLimits, ServerRdma};
use target_rdma::auth::Secret;
use target_rdma::client::{ArenaClient, ClientConfig};
use target_rdma::rdma::RdmaProvider;
use target_rdma::store::{Store, StoreConfig, VolumeSpec};

pub const SECRET_A: &str = "secret-of-volume-a-0123456789";
pub const SECRET_B: &str = "secret-of-volume-b-9876543210";

pub fn secret(s: &str) -> Secret {
    Secret::new(s.as_bytes().to_vec()).unwrap()
}

/// Writes a 0600 secret file.
pub fn secret_file(dir: &Path, name: &str, value: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("{value}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

pub struct Peer {
    pub addr: SocketAddr,
    pub server: Arc<Server>,
    pub store: Arc<Store>,
    thread: Option<JoinHandle<()>>,
}

pub struct PeerOpts {
    pub arena_bytes: u64,
    pub blob_bytes: u32,
    pub swap_bytes: u64,
    pub quota_blobs: u64,
    pub max_inflight: u32,
    /// Register the arena on this device and grant RDMA to clients.
    pub rdma: Option<Arc<dyn RdmaProvider>>,
}

impl Default for PeerOpts {
    fn default() -> Self {
        Self {
            arena_bytes: 16 << 20,
            blob_bytes: 64 << 10,
            swap_bytes: 64 << 20,
            quota_blobs: 1 << 20,
            max_inflight: 64,
            rdma: None,
        }
    }
}

impl Peer {
    /// Protocol errors the server counted, all classes together.
    pub fn protocol_errors(&self) -> u64 {
        self.server.counters().protocol_errors().values().sum()
    }

    /// Starts a peer serving volumes "a" and "b" from `dir`.
    pub fn start(dir: &Path, opts: &PeerOpts) -> Peer {
        Self::start_at(dir, opts, "127.0.0.1:0")
    }

    pub fn start_at(dir: &Path, opts: &PeerOpts, addr: &str) -> Peer {
        let specs = [("a", SECRET_A), ("b", SECRET_B)];
        let store = Arc::new(
            Store::open(
                StoreConfig {
                    dir: dir.to_owned(),
                    arena_bytes: opts.arena_bytes,
                    blob_bytes: opts.blob_bytes,
                    swap_bytes: opts.swap_bytes,
                },
                &specs.map(|(n, _)| VolumeSpec {
                    name: n.into(),
                    quota_blobs: opts.quota_blobs,
                }),
            )
            .unwrap(),
        );
        let volumes = specs
            .iter()
            .enumerate()
            .map(|(i, (n, s))| ServedVolume {
                name: (*n).into(),
                secret: secret(s),
                id: i as u32,
                quota_blobs: opts.quota_blobs,
            })
            .collect();
        let listener = TcpListener::bind(addr).unwrap();
        let addr = listener.local_addr().unwrap();
        let rdma = opts
            .rdma
            .clone()
            .map(|p| ServerRdma::register(p, &store, 64).unwrap());
        let server = Server::with_rdma(
            Arc::clone(&store),
            volumes,
            ServerLimits {
                max_connections: 64,
                max_inflight: opts.max_inflight,
                handshake_timeout: Duration::from_secs(5),
            },
            rdma,
        );
        let s = Arc::clone(&server);
        let thread = Some(std::thread::spawn(move || s.serve(listener).unwrap()));
        Peer {
            addr,
            server,
            store,
            thread,
        }
    }

    pub fn client(&self, volume: &str, secret_value: &str) -> ArenaClient {
        ArenaClient::connect(self.config(volume, secret_value)).unwrap()
    }

    pub fn config(&self, volume: &str, secret_value: &str) -> ClientConfig {
        let mut c = ClientConfig::new(self.addr.to_string(), volume, secret(secret_value));
        c.request_timeout = Duration::from_secs(10);
        c
    }

    /// Graceful stop: connections end, the store is flushed.
    pub fn stop(mut self) {
        self.server.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.store.flush().unwrap();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.server.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
