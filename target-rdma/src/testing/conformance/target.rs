//! One suite, every block target: each must match the in-memory reference
//! ([`MemTarget`]) byte for byte and say which path carried each request.
//!
//! A target runs it as a device of [`SIZE`] bytes over volume "a" of a
//! store sized by [`store_config`] (or of a [`Peer`](crate::testing::Peer)
//! started with [`peer_opts`]): blobs of [`BLOB`] bytes in an 8-slot
//! arena, so a 64-blob device evicts constantly.

use std::path::Path;

use futures::executor::block_on;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::Fixture;
use crate::blob::{Transport, Via};
use crate::block::{BlockTarget, MemTarget, TargetError};
use crate::store::{StoreConfig, VolumeSpec};
use crate::testing::{pattern, PeerOpts};

/// Blob size of the suite's volume.
pub const BLOB: u32 = 16 << 10;
/// Device size: 64 blobs.
pub const SIZE: u64 = 1 << 20;
/// RAM arena: 8 blobs.
pub const ARENA_BYTES: u64 = 8 * BLOB as u64;

/// A store for the suite in `dir`, and its volume "a".
pub fn store_config(dir: &Path) -> (StoreConfig, Vec<VolumeSpec>) {
    super::store_of_volume_a(dir, BLOB, ARENA_BYTES, 1 << 20)
}

/// An arena peer for the suite (volume "a" is the one the cases use).
pub fn peer_opts() -> PeerOpts {
    PeerOpts {
        arena_bytes: ARENA_BYTES,
        blob_bytes: BLOB,
        ..PeerOpts::default()
    }
}

fn read(t: &impl BlockTarget, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xee; len];
    block_on(t.read(offset, &mut buf)).unwrap();
    buf
}

/// A fresh device reads zeros, its last sector included.
pub fn fresh_device_reads_zeros(t: &impl BlockTarget) {
    assert!(read(t, 0, 64 << 10).iter().all(|b| *b == 0));
    assert!(read(t, SIZE - 512, 512).iter().all(|b| *b == 0));
}

/// An unaligned write over several blobs reads back, and the bytes before
/// it stay as they were.
pub fn writes_spanning_blobs_read_back(t: &impl BlockTarget) {
    let data = pattern(1, 1, 3 * BLOB as usize + 1536);
    block_on(t.write(u64::from(BLOB) - 512, &data, false)).unwrap();
    assert!(read(t, u64::from(BLOB) - 512, data.len()) == data);
    assert!(
        read(t, 0, BLOB as usize - 512).iter().all(|b| *b == 0),
        "bytes before the write changed"
    );
}

/// A FUA write and a flush succeed, and the write reads back.
pub fn fua_and_flush_succeed(t: &impl BlockTarget) {
    block_on(t.write(4096, &[7; 4096], true)).unwrap();
    block_on(t.flush()).unwrap();
    assert_eq!(read(t, 4096, 4096), vec![7; 4096]);
}

/// DISCARD and WRITE_ZEROES read back as zeros over exactly their range.
pub fn discard_and_write_zeroes_read_back_zeros(t: &impl BlockTarget) {
    let all = pattern(2, 1, SIZE as usize / 4);
    block_on(t.write(0, &all, false)).unwrap();
    // Partial blob at each end and whole blobs in between.
    let (off, len) = (1000u64, 3 * u64::from(BLOB) + 777);
    block_on(t.discard(off, len)).unwrap();
    let got = read(t, 0, all.len());
    assert_eq!(got[..off as usize], all[..off as usize]);
    assert!(got[off as usize..(off + len) as usize]
        .iter()
        .all(|b| *b == 0));
    assert_eq!(got[(off + len) as usize..], all[(off + len) as usize..]);

    block_on(t.write_zeroes(0, 512)).unwrap();
    assert!(read(t, 0, 512).iter().all(|b| *b == 0));
}

/// The path a target's payloads take (every target under the suite moves
/// every payload on its own data path, none fails over).
fn own_path(t: &impl BlockTarget) -> Via {
    match t.transport() {
        Transport::InProcess => Via::InProcess,
        Transport::Tcp => Via::Tcp,
        Transport::Rdma => Via::Rdma,
    }
}

/// Each success says which path carried its payloads; a flush moved none.
pub fn every_success_names_the_path_that_carried_it(t: &impl BlockTarget) {
    let via = own_path(t);
    let data = pattern(3, 1, 2 * BLOB as usize + 100);
    assert_eq!(block_on(t.write(BLOB.into(), &data, false)).unwrap(), via);
    assert_eq!(block_on(t.write(0, &data[..512], true)).unwrap(), via);
    let mut buf = vec![0; data.len()];
    assert_eq!(block_on(t.read(BLOB.into(), &mut buf)).unwrap(), via);
    assert!(buf == data);
    assert_eq!(block_on(t.flush()).unwrap(), Via::Nothing, "no payload");
    // Partial blobs at the ends are zero-filled: a payload each.
    assert_eq!(block_on(t.discard(100, 2 * u64::from(BLOB))).unwrap(), via);
}

/// A request past the end fails at once with EIO, saying so.
pub fn out_of_range_is_eio_not_a_hang(t: &impl BlockTarget) {
    let mut buf = vec![0; 1024];
    let e = block_on(t.read(SIZE - 512, &mut buf)).unwrap_err();
    assert!(matches!(e, TargetError::OutOfRange { .. }), "{e}");
    assert_eq!(e.errno(), libc::EIO);
    assert!(e.to_string().contains("past the end"), "{e}");
    assert!(block_on(t.write(u64::MAX - 10, &buf, false)).is_err());
    assert!(block_on(t.discard(SIZE, 1)).is_err());
}

/// One block request of a random sequence.
#[derive(Debug, Clone)]
pub enum Op {
    /// Writes `.1` bytes of `.2` at `.0`.
    Write(u64, usize, u8),
    /// Reads `.1` bytes at `.0`.
    Read(u64, usize),
    /// Discards `.1` bytes at `.0`.
    Discard(u64, u64),
    /// Writes `.1` zero bytes at `.0`.
    Zeroes(u64, u64),
    /// Flushes.
    Flush,
}

/// Unaligned requests of up to 70 000 bytes anywhere on the device.
pub fn op() -> impl Strategy<Value = Op> {
    let off = 0..SIZE - 70_000;
    prop_oneof![
        4 => (off.clone(), 1..70_000usize, any::<u8>()).prop_map(|(o, l, b)| Op::Write(o, l, b)),
        3 => (off.clone(), 1..70_000usize).prop_map(|(o, l)| Op::Read(o, l)),
        1 => (off.clone(), 1..70_000u64).prop_map(|(o, l)| Op::Discard(o, l)),
        1 => (off, 1..70_000u64).prop_map(|(o, l)| Op::Zeroes(o, l)),
        1 => Just(Op::Flush),
    ]
}

/// Runs `ops` on `target` and on the reference; every read must match.
pub fn matches_the_reference(target: &impl BlockTarget, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let reference = MemTarget::new(SIZE);
    block_on(async {
        for op in ops {
            match op {
                Op::Write(o, l, b) => {
                    let data = vec![b; l];
                    reference.write(o, &data, false).await.unwrap();
                    target.write(o, &data, false).await.unwrap();
                }
                Op::Read(o, l) => {
                    let (mut a, mut b) = (vec![0; l], vec![1; l]);
                    reference.read(o, &mut a).await.unwrap();
                    target.read(o, &mut b).await.unwrap();
                    prop_assert!(a == b, "read {}+{} differs", o, l);
                }
                Op::Discard(o, l) => {
                    reference.discard(o, l).await.unwrap();
                    target.discard(o, l).await.unwrap();
                }
                Op::Zeroes(o, l) => {
                    reference.write_zeroes(o, l).await.unwrap();
                    target.write_zeroes(o, l).await.unwrap();
                }
                Op::Flush => {
                    target.flush().await.unwrap();
                }
            }
        }
        Ok(())
    })
}

/// `cases` random sequences of up to 40 operations, each on a fresh target
/// from `fixture`, match the reference; panics with the smallest sequence
/// found that does not.
pub fn random_operations_match_the_reference<T: BlockTarget>(
    fixture: impl Fn() -> Fixture<T>,
    cases: u32,
) {
    let mut runner = TestRunner::new(Config {
        cases,
        ..Config::default()
    });
    let ops = proptest::collection::vec(op(), 1..40);
    if let Err(e) = runner.run(&ops, |ops| matches_the_reference(&fixture().backend, ops)) {
        panic!("{e}");
    }
}
