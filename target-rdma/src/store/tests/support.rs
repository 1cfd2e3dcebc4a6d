//! The helpers the store's tests share.

use std::path::Path;

use super::*;

pub(super) const B: u64 = 4096;

pub(super) fn cfg(dir: &Path, slots: u64, extents: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        arena_bytes: slots * B,
        blob_bytes: B as u32,
        swap_bytes: extents * B,
        swap_reads_in_flight: super::DEFAULT_SWAP_READS_IN_FLIGHT,
    }
}

pub(super) fn vols(quota: u64) -> Vec<VolumeSpec> {
    ["a", "b"]
        .iter()
        .map(|n| VolumeSpec {
            name: (*n).into(),
            quota_blobs: quota,
        })
        .collect()
}

pub(super) fn open(dir: &Path, slots: u64, extents: u64) -> Store {
    Store::open(cfg(dir, slots, extents), &vols(1000)).expect("open store")
}

pub(super) fn blob(store: &Store, vol: VolumeId, key: u64) -> Option<Vec<u8>> {
    let mut out = vec![0u8; B as usize];
    store.read(vol, key, 0, &mut out).unwrap().then_some(out)
}

pub(super) fn pattern(seed: u64) -> Vec<u8> {
    (0..B)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(7)) as u8)
        .collect()
}

/// A store of three keys, one flush each, closed by a crash: its journal
/// holds three one-block batches (at offsets 512, 1024 and 1536).
pub(super) fn three_flushes(dir: &Path) {
    let s = open(dir, 4, 16);
    for k in 0..3 {
        s.write(0, k, 0, &pattern(k)).unwrap();
        s.flush().unwrap();
    }
}

pub(super) fn open_err(dir: &Path) -> StoreError {
    Store::open(cfg(dir, 4, 16), &vols(1000))
        .err()
        .expect("the store must refuse to open")
}

/// Flips one bit of byte `at` of `file`.
pub(super) fn flip(file: &Path, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    use std::os::unix::fs::FileExt;
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x20], at).unwrap();
}

pub(super) fn integrity_kind(r: Result<bool, StoreError>) -> Option<IntegrityKind> {
    match r {
        Err(StoreError::Integrity { kind, .. }) => Some(kind),
        _ => None,
    }
}
