//! Range reads of cold blobs straight from swap, blocking and awaited.

use std::path::Path;
use std::sync::Arc;

use super::support::*;
use super::*;

fn cfg_blob(dir: &Path, blob: u32, slots: u64, extents: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        arena_bytes: slots * u64::from(blob),
        blob_bytes: blob,
        swap_bytes: extents * u64::from(blob),
        swap_reads_in_flight: super::DEFAULT_SWAP_READS_IN_FLIGHT,
    }
}

fn big_pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(131) ^ seed.wrapping_mul(0x9e37) ^ (i >> 9)) as u8)
        .collect()
}

/// Blob size of [`sixteen_blobs_twelve_cold`]'s store.
const COLD_BLOB: u32 = 64 << 10;

/// A store of 4 slots holding 16 written and flushed 64 KiB blobs
/// (`big_pattern(k)` for key k of volume 0): keys 0..12 are in swap only.
fn sixteen_blobs_twelve_cold(dir: &Path) -> Store {
    let s = Store::open(cfg_blob(dir, COLD_BLOB, 4, 64), &vols(1000)).unwrap();
    for k in 0..16 {
        s.write(0, k, 0, &big_pattern(k, COLD_BLOB as usize))
            .unwrap();
    }
    s.flush().unwrap();
    s
}

/// [`sixteen_blobs_twelve_cold`]'s store `s` reopened after a bit of block 5
/// (4 KiB blocks from 0) of cold key 7 flipped on disk.
fn with_block_5_of_key_7_damaged(s: Store, dir: &Path) -> Store {
    let e7 = s.core.durable_extent((0, 7)).unwrap();
    drop(s);
    flip(
        &dir.join(swap::SWAP_FILE),
        u64::from(e7) * u64::from(COLD_BLOB) + 5 * 4096 + 1,
    );
    Store::open(cfg_blob(dir, COLD_BLOB, 4, 64), &vols(1000)).unwrap()
}

#[test]
fn a_partial_read_of_a_cold_blob_reads_only_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let s = sixteen_blobs_twelve_cold(dir.path());
    // Keys 0..12 are cold now (4 slots).
    let before = s.stats();
    let mut out = vec![0u8; 4096];
    assert!(s.read(0, 2, 8192, &mut out).unwrap());
    assert_eq!(out[..], big_pattern(2, COLD_BLOB as usize)[8192..12288]);
    // Unaligned, across a block boundary: two blocks read.
    let mut odd = vec![0u8; 100];
    assert!(s.read(0, 5, 4050, &mut odd).unwrap());
    assert_eq!(odd[..], big_pattern(5, COLD_BLOB as usize)[4050..4150]);
    let after = s.stats();
    assert_eq!(after.fault_ins, before.fault_ins, "no fault-in");
    assert_eq!(after.swap_bytes_read - before.swap_bytes_read, 3 * 4096);
    assert_eq!(
        after.slots_free + after.slots_clean,
        before.slots_free + before.slots_clean
    );
    // A damaged block fails only the reads that cover it.
    let e7 = s.core.durable_extent((0, 7)).unwrap();
    let s = with_block_5_of_key_7_damaged(s, dir.path());
    assert!(s.read(0, 7, 0, &mut out).unwrap());
    assert_eq!(
        integrity_kind(s.read(0, 7, 5 * 4096 + 4000, &mut out[..200])),
        Some(IntegrityKind::Checksum)
    );
    let e = s.read(0, 7, 5 * 4096, &mut out).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "at byte {}",
            u64::from(e7) * u64::from(COLD_BLOB) + 5 * 4096
        )),
        "{e}"
    );
    let mut whole = vec![0u8; COLD_BLOB as usize];
    assert_eq!(
        integrity_kind(s.read(0, 7, 0, &mut whole)),
        Some(IntegrityKind::Checksum)
    );
    assert!(s.read(0, 7, 6 * 4096, &mut out).unwrap());
}

/// Random range reads that land on consecutive blobs start no read-ahead
/// (each would fault whole blobs in for one block); a stream of range
/// reads crossing into the next blob, from its first byte, does.
#[test]
fn only_range_reads_from_a_blobs_first_byte_count_toward_read_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let s = sixteen_blobs_twelve_cold(dir.path());
    let before = s.stats().fault_ins;
    let mut out = vec![0u8; 4096];
    for k in 0..6u64 {
        assert!(s.read(0, k, 4096 * (k as u32 + 1), &mut out).unwrap());
        let got = futures::executor::block_on(s.read_cold_with(0, k, 4096, 4096, <[u8]>::to_vec));
        assert_eq!(
            got.unwrap().as_deref(),
            Some(&big_pattern(k, COLD_BLOB as usize)[4096..8192])
        );
    }
    assert_eq!(s.core.last_read(), None, "no read noted");
    assert_eq!(s.stats().fault_ins, before, "no fault-in");
    assert!(s.read(0, 6, 0, &mut out).unwrap());
    assert_eq!(s.core.last_read(), Some((0, 6)));
    assert!(s.read(0, 7, 0, &mut out).unwrap());
    // Keys 8..12 are cold: read-ahead faults them in.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while s.stats().fault_ins < before + engine::READ_AHEAD {
        assert!(
            std::time::Instant::now() < deadline,
            "read-ahead did not fault keys 8..12 in: {:?}",
            s.stats()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A thread serving swap reads on its own ring (as arenad's workers do):
/// reads awaited together by its tasks return their blocks; a task dropped
/// with its read in flight, and the runtime ending with reads in flight,
/// leave the buffers to the ring until the kernel is done; then the
/// thread's reads go to the shared ring again. Refused off a
/// current-thread runtime.
#[test]
fn cold_range_reads_on_a_threads_own_ring_return_their_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(sixteen_blobs_twelve_cold(dir.path()));
    assert!(s.serve_swap_reads_here().is_err(), "no runtime");
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    assert!(multi.block_on(async { s.serve_swap_reads_here() }).is_err());
    drop(multi);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let before = s.stats();
    let pattern =
        |k: u64, at: u32| big_pattern(k, COLD_BLOB as usize)[at as usize..][..4096].to_vec();
    rt.block_on(async {
        s.serve_swap_reads_here().unwrap();
        assert!(s.core.swap.reads_served_here());
        let mut tasks = tokio::task::JoinSet::new();
        for k in [0u64, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11] {
            for at in (0..4u32).map(|i| i * 12288 + 4096) {
                let s = Arc::clone(&s);
                tasks.spawn(async move {
                    (
                        k,
                        at,
                        s.read_cold_with(0, k, at, 4096, <[u8]>::to_vec).await,
                    )
                });
            }
        }
        while let Some(done) = tasks.join_next().await {
            let (k, at, r) = done.unwrap();
            assert_eq!(r.unwrap(), Some(pattern(k, at)), "key {k} at {at}");
        }
        // Pushed, then the task goes away before its read completes.
        let gone = {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.read_cold_with(0, 3, 8192, 4096, <[u8]>::to_vec).await })
        };
        tokio::task::yield_now().await;
        gone.abort();
        // And one still in flight when the runtime ends.
        let s2 = Arc::clone(&s);
        drop(tokio::spawn(async move {
            s2.read_cold_with(0, 5, 8192, 4096, <[u8]>::to_vec).await
        }));
        tokio::task::yield_now().await;
    });
    drop(rt);
    assert!(!s.core.swap.reads_served_here());
    let got = futures::executor::block_on(s.read_cold_with(0, 2, 8192, 4096, <[u8]>::to_vec));
    assert_eq!(got.unwrap(), Some(pattern(2, 8192)));
    let after = s.stats();
    assert_eq!(after.fault_ins, before.fault_ins, "no fault-in");
    assert!(after.swap_bytes_read - before.swap_bytes_read >= 49 * 4096);
}

#[test]
fn cold_range_reads_awaited_together_return_their_blocks_and_verify() {
    let dir = tempfile::tempdir().unwrap();
    let s = sixteen_blobs_twelve_cold(dir.path());
    // Keys 0..12 are cold (4 slots); 48 reads of them awaited at once, no
    // key right after the one before (which would start read-ahead).
    let before = s.stats();
    let keys = [0u64, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11];
    let reads = keys
        .into_iter()
        .flat_map(|k| (0..4u32).map(move |i| (k, i * 12288 + 4096)));
    let got = futures::executor::block_on(futures::future::join_all(reads.map(|(k, at)| {
        let s = &s;
        async move {
            let r = s.read_cold_with(0, k, at, 4096, <[u8]>::to_vec).await;
            (k, at, r)
        }
    })));
    for (k, at, r) in got {
        let want = &big_pattern(k, COLD_BLOB as usize)[at as usize..at as usize + 4096];
        assert_eq!(r.unwrap().as_deref(), Some(want), "key {k} at {at}");
    }
    let after = s.stats();
    assert_eq!(after.fault_ins, before.fault_ins, "no fault-in");
    assert_eq!(after.swap_bytes_read - before.swap_bytes_read, 48 * 4096);
    // Not cold range reads: a resident blob, no blob, the whole blob.
    let none =
        |k, at, len| futures::executor::block_on(s.read_cold_with(0, k, at, len, |_| ())).unwrap();
    assert_eq!(none(15, 0, 4096), None, "resident");
    assert_eq!(none(99, 0, 4096), None, "absent");
    assert_eq!(none(3, 0, COLD_BLOB as usize), None, "whole blob");
    // A damaged block fails the read that covers it, as the blocking path.
    let s = with_block_5_of_key_7_damaged(s, dir.path());
    let bad = futures::executor::block_on(s.read_cold_with(0, 7, 5 * 4096 + 10, 100, |_| ()));
    assert!(
        matches!(
            bad,
            Err(StoreError::Integrity {
                kind: IntegrityKind::Checksum,
                ..
            })
        ),
        "{bad:?}"
    );
    assert_eq!(s.stats().integrity_errors, [1, 0]);
    let good = futures::executor::block_on(s.read_cold_with(0, 7, 6 * 4096, 4096, <[u8]>::to_vec));
    assert_eq!(
        good.unwrap().as_deref(),
        Some(&big_pattern(7, COLD_BLOB as usize)[6 * 4096..7 * 4096])
    );
}

#[test]
fn cold_range_reads_race_rewrites_without_false_errors_or_mixed_versions() {
    const BLOB: u32 = 16 << 10;
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(Store::open(cfg_blob(dir.path(), BLOB, 4, 256), &vols(1000)).unwrap());
    let fill = |k: u64, v: u64| vec![(k * 16 + v % 16) as u8; BLOB as usize];
    for k in 0..16 {
        s.write(0, k, 0, &fill(k, 0)).unwrap();
    }
    s.flush().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..4u64)
        .map(|r| {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = r;
                let mut out = vec![0u8; 6000];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i = i
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let k = (i >> 33) % 16;
                    let off = ((i >> 20) % 8000) as u32;
                    assert!(s.read(0, k, off, &mut out).unwrap(), "key {k}");
                    // Each half of the blob is written at once (a partial
                    // round writes the halves one after the other), so each
                    // half read is one version, and every byte is key k's.
                    let split = (8192 - off as usize).min(out.len());
                    for half in [&out[..split], &out[split..]] {
                        let v = half.first().copied().unwrap_or((k * 16) as u8);
                        assert!(
                            u64::from(v / 16) == k && half.iter().all(|&b| b == v),
                            "key {k} off {off}: mixed or foreign bytes"
                        );
                    }
                }
            })
        })
        .collect();
    for round in 1..60u64 {
        for k in (round % 3..16).step_by(3) {
            if round % 2 == 0 {
                s.write(0, k, 0, &fill(k, round)).unwrap();
            } else {
                let b = fill(k, round);
                s.write(0, k, 0, &b[..8192]).unwrap();
                s.write(0, k, 8192, &b[8192..]).unwrap();
            }
        }
        if round % 4 == 0 {
            s.flush().unwrap();
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    assert_eq!(s.stats().integrity_errors, [0, 0]);
}
