//! Shared fixtures of the daemon's integration tests.
// Each test binary uses its own part of these.
#![allow(dead_code, unused_imports)]

pub mod etcd;
pub mod ublkd;

// The real `arenad` as a child process, and daemons' JSON log lines:
// target-rdma's fixtures.
pub use target_rdma::testing::{arenad, log_lines};

pub use target_rdma::testing::{secret, secret_file, SECRET_A, SECRET_B};

/// A device of one queue on volume "a" of `peers` (replicated when more
/// than one) over TCP: `size` bytes, blobs of `blob` bytes, requests of
/// up to `io` bytes. `secret_file` is whatever the test passes the secret
/// by.
pub fn device_spec(
    peers: &[String],
    size: u64,
    blob: u64,
    io: u64,
    secret_file: std::path::PathBuf,
) -> ::ublkd::device::DeviceSpec {
    ::ublkd::device::DeviceSpec {
        id: 0,
        peer: peers[0].clone(),
        volume: "a".into(),
        secret_file,
        size,
        queues: 1,
        depth: 4,
        io_buf: io,
        blob_size: blob,
        transport: ::ublkd::config::TransportChoice::Tcp,
        confidential: false,
        logical_block_size: 512,
        physical_block_size: 4096,
        max_io_size: io,
        discard: true,
        max_discard_size: 1 << 30,
        write_zeroes: true,
        max_write_zeroes_size: 1 << 30,
        write_cache: true,
        fua: true,
        read_only: false,
        cpus: Vec::new(),
        replicas: (peers.len() > 1).then(|| ::ublkd::device::ReplicaSpec {
            peers: peers.to_vec(),
            ..Default::default()
        }),
    }
}
