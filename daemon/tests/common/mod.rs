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

/// Opens the volume of `spec` on one peer (the secret is `SECRET_A`) as
/// the device manager's `connect_single` does: driven TCP sessions, one
/// per queue, whose drivers loop threads run here as queue threads' rings
/// do.
pub fn open_single(spec: &::ublkd::device::DeviceSpec) -> Vec<::ublkd::queue_io::QueueIo> {
    use ::ublkd::queue_io::{QueueIo, TagBuffers};
    use std::sync::Arc;
    let connector =
        ::ublkd::device::Connector::new(&::ublkd::config::UblkdConfig::defaults(), Arc::default());
    let bufs: Vec<Arc<TagBuffers>> = (0..spec.queues)
        .map(|_| Arc::new(TagBuffers::new(spec.depth as usize, spec.io_buf as usize)))
        .collect();
    let sessions = connector
        .connect(spec, &spec.peer, &secret(SECRET_A), &bufs, false, true)
        .expect("the volume's sessions");
    let ios: Vec<QueueIo> = sessions
        .queues
        .into_iter()
        .zip(bufs)
        .map(|(s, b)| QueueIo::single(s, b))
        .collect();
    for io in &ios {
        target_rdma::testing::drive(io.session().client());
    }
    ios
}

/// Opens the replicated volume of `spec` (the secret is `SECRET_A`) as the
/// device manager does, its membership kept by the memory coordinator
/// instead of etcd.
pub fn open_replicated(
    spec: &::ublkd::device::DeviceSpec,
) -> (
    Vec<::ublkd::queue_io::QueueIo>,
    std::sync::Arc<::ublkd::device::Replicated>,
) {
    use std::sync::Arc;
    use target_rdma::replica::{Coordinator, Membership, MemoryCoordinator};
    let names = &spec.replicas.as_ref().expect("a replicated spec").peers;
    let connector =
        ::ublkd::device::Connector::new(&::ublkd::config::UblkdConfig::defaults(), Arc::default());
    let coord = MemoryCoordinator::new(
        target_rdma::replica::clock::system(),
        Membership::new_volume(names).expect("a membership"),
    );
    let resolve: ::ublkd::device::Resolve = Arc::new(|n: &str| Ok(n.to_owned()));
    ::ublkd::device::Replicated::open(
        &connector,
        spec,
        &secret(SECRET_A),
        coord as Arc<dyn Coordinator>,
        &resolve,
        &::ublkd::coordination::ReplicationConfig::default(),
    )
    .expect("the replicated volume opens")
}
