//! The real `arenad` process against damaged files: every corruption of its
//! index or swap gives a refusal to start (naming the file, and the offset
//! where one exists) or an error on the read that meets it, never bytes of
//! another key, volume or version; `arenad --repair` rebuilds what the
//! extent headers prove and reports the rest.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::arenad::{kill9, terminate, Arenad};
use common::*;
use futures::executor::block_on;
use target_rdma::blob::ArenaError;
use target_rdma::client::ArenaClient;
use target_rdma::proto::Status;

const BLOB: usize = 64 << 10;

fn arenad(dir: &Path) -> Arenad {
    Arenad::new(dir, "512K", "64K", "16M", None)
}

fn file(p: &Arenad, name: &str) -> PathBuf {
    p.swap_dir.join(name)
}

/// Writes key k of volume a with pattern(k, 1), one FLUSH each, then a key
/// of volume b; leaves arenad killed with `kill -9`, so its journal holds
/// one batch per FLUSH.
fn populate(p: &Arenad, keys: u64) {
    let child = p.spawn();
    let (a, b) = (p.connect("a"), p.connect("b"));
    block_on(async {
        for k in 0..keys {
            a.write(k, 0, &pattern(k, 1, BLOB)).await.unwrap();
            a.flush().await.unwrap();
        }
        b.write(1000, 0, &pattern(1000, 9, BLOB)).await.unwrap();
        b.flush().await.unwrap();
    });
    kill9(child);
}

fn refused(out: &Output) -> String {
    assert!(!out.status.success(), "arenad started on damaged files");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Each volume a key reads back its pattern.
fn all_readable(p: &Arenad, keys: u64) {
    let child = p.spawn();
    let a = p.connect("a");
    let mut out = vec![0; BLOB];
    for k in 0..keys {
        assert!(block_on(a.read_found(k, 0, &mut out)).unwrap(), "key {k}");
        assert!(out == pattern(k, 1, BLOB), "key {k} differs");
    }
    kill9(child);
}

/// The byte offsets of the journal's non-zero 512-byte blocks after its
/// header: one per FLUSH here.
fn journal_blocks(path: &Path) -> Vec<usize> {
    let b = std::fs::read(path).unwrap();
    (512..b.len())
        .step_by(512)
        .filter(|&o| b[o..o + 512].iter().any(|&x| x != 0))
        .collect()
}

#[test]
fn journal_damage_or_a_cut_refuses_to_start_naming_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    populate(&p, 4);
    let j = file(&p, "index.journal");
    let good = std::fs::read(&j).unwrap();
    let blocks = journal_blocks(&j);
    assert_eq!(blocks.len(), 5, "one batch per FLUSH");
    for &o in &blocks {
        // A flipped byte in a record: the first, a middle, or the last one.
        let mut b = good.clone();
        b[o + 40] ^= 0x01;
        std::fs::write(&j, &b).unwrap();
        let err = refused(&p.run(&[]));
        assert!(
            err.contains("index.journal") && err.contains(&format!("at offset {o}")),
            "flip in the block at {o}: {err}"
        );
        // A journal cut after this record.
        std::fs::write(&j, &good[..o + 512]).unwrap();
        let err = refused(&p.run(&[]));
        assert!(
            err.contains("index.journal") && err.contains("truncated"),
            "cut after {o}: {err}"
        );
    }
    std::fs::write(&j, &good).unwrap();
    all_readable(&p, 4);
}

#[test]
fn a_deleted_checkpoint_or_swap_file_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    populate(&p, 3);
    // A clean stop first: the journal is then empty, the index all in the
    // checkpoint.
    terminate(p.start());
    for name in ["index.ckpt", "swap.dat", "swap.meta"] {
        let f = file(&p, name);
        let saved = std::fs::read(&f).unwrap();
        std::fs::remove_file(&f).unwrap();
        let err = refused(&p.run(&[]));
        assert!(
            err.contains(&format!("{name}: is missing")),
            "{name}: {err}"
        );
        std::fs::write(&f, &saved).unwrap();
    }
    let swap = file(&p, "swap.dat");
    let len = std::fs::metadata(&swap).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&swap).unwrap();
    f.set_len(len / 2).unwrap();
    let err = refused(&p.run(&[]));
    assert!(
        err.contains("swap.dat")
            && err.contains("truncated")
            && err.contains(&format!("is {} bytes", len / 2)),
        "{err}"
    );
    f.set_len(len).unwrap();
    all_readable(&p, 3);
}

/// The extent of swap.dat holding exactly `content`.
fn find_extent(swap: &Path, content: &[u8]) -> u64 {
    let b = std::fs::read(swap).unwrap();
    (0..b.len() / BLOB)
        .find(|&e| &b[e * BLOB..(e + 1) * BLOB] == content)
        .map(|e| e as u64)
        .expect("an extent holds the blob")
}

fn read(c: &ArenaClient, key: u64, offset: u32, len: usize) -> Result<Vec<u8>, ArenaError> {
    let mut out = vec![0; len];
    block_on(c.read_found(key, offset, &mut out)).map(|found| {
        assert!(found, "key {key} exists");
        out
    })
}

fn integrity_error(r: Result<Vec<u8>, ArenaError>) -> String {
    match r {
        Err(
            e @ ArenaError::Status {
                status: Status::Internal,
                ..
            },
        ) => {
            let text = e.to_string();
            assert!(text.contains("integrity check failed"), "{text}");
            text
        }
        Err(e) => panic!("expected an integrity error, got {e}"),
        Ok(_) => panic!("damaged bytes were served"),
    }
}

#[test]
fn a_flipped_byte_in_an_extent_fails_that_read_counted_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    populate(&p, 12);
    let swap = file(&p, "swap.dat");
    let e = find_extent(&swap, &pattern(5, 1, BLOB));
    let bad = e * BLOB as u64 + 3 * 4096 + 17;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&swap)
        .unwrap();
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, bad).unwrap();
    f.write_all_at(&[byte[0] ^ 0x80], bad).unwrap();

    let child = p.spawn();
    let a = p.connect("a");
    // The whole blob, and any range covering the bad block: refused.
    let text = integrity_error(read(&a, 5, 0, BLOB));
    assert!(
        text.contains("swap.dat")
            && text.contains(&format!("extent {e}"))
            && text.contains(&format!("at byte {}", e * BLOB as u64 + 3 * 4096)),
        "{text}"
    );
    integrity_error(read(&a, 5, 3 * 4096 + 100, 10));
    // The rest of that blob, and every other blob, reads back.
    assert_eq!(read(&a, 5, 0, 4096).unwrap(), pattern(5, 1, BLOB)[..4096]);
    for k in (0..12).filter(|&k| k != 5) {
        assert!(
            read(&a, k, 0, BLOB).unwrap() == pattern(k, 1, BLOB),
            "key {k}"
        );
    }
    let m = p.metrics();
    assert!(
        m.contains("arenad_integrity_errors_total{kind=\"checksum\"} 2"),
        "{m}"
    );
    // Rewritten whole, the blob is good again.
    block_on(a.write(5, 0, &pattern(5, 2, BLOB))).unwrap();
    assert!(read(&a, 5, 0, BLOB).unwrap() == pattern(5, 2, BLOB));
    kill9(child);
}

#[test]
fn an_extent_swapped_with_another_volumes_serves_neither() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    populate(&p, 12);
    terminate(p.start());
    let swap = file(&p, "swap.dat");
    let ea = find_extent(&swap, &pattern(3, 1, BLOB));
    let eb = find_extent(&swap, &pattern(1000, 9, BLOB));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&swap)
        .unwrap();
    let (mut x, mut y) = (vec![0; BLOB], vec![0; BLOB]);
    f.read_exact_at(&mut x, ea * BLOB as u64).unwrap();
    f.read_exact_at(&mut y, eb * BLOB as u64).unwrap();
    f.write_all_at(&y, ea * BLOB as u64).unwrap();
    f.write_all_at(&x, eb * BLOB as u64).unwrap();

    let child = p.spawn();
    let (a, b) = (p.connect("a"), p.connect("b"));
    integrity_error(read(&a, 3, 0, BLOB));
    integrity_error(read(&a, 3, 8192, 4096));
    integrity_error(read(&b, 1000, 0, BLOB));
    for k in (0..12).filter(|&k| k != 3) {
        assert!(
            read(&a, k, 0, BLOB).unwrap() == pattern(k, 1, BLOB),
            "key {k}"
        );
    }
    kill9(child);
}

#[test]
fn repair_rebuilds_a_lost_index_and_reports_the_unrecoverable() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    populate(&p, 10);
    let swap = file(&p, "swap.dat");
    let bad = find_extent(&swap, &pattern(7, 1, BLOB));
    let f = std::fs::OpenOptions::new().write(true).open(&swap).unwrap();
    f.write_all_at(b"garbage", bad * BLOB as u64 + 1000)
        .unwrap();
    std::fs::remove_file(file(&p, "index.ckpt")).unwrap();
    let err = refused(&p.run(&[]));
    assert!(
        err.contains("index.ckpt: is missing") && err.contains("--repair"),
        "{err}"
    );

    let out = p.run(&["--repair"]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "something was lost: {report}");
    assert!(
        report.contains("volume \"a\": 9 blobs recovered"),
        "{report}"
    );
    assert!(
        report.contains("volume \"b\": 1 blobs recovered"),
        "{report}"
    );
    assert!(
        report.contains("NOT RECOVERED")
            && report.contains(&format!("volume \"a\" key 7 (extent {bad})")),
        "{report}"
    );

    let child = p.spawn();
    let (a, b) = (p.connect("a"), p.connect("b"));
    let mut out = vec![0; BLOB];
    assert!(
        !block_on(a.read_found(7, 0, &mut out)).unwrap(),
        "the damaged blob is gone, not served"
    );
    for k in (0..10).filter(|&k| k != 7) {
        assert!(
            read(&a, k, 0, BLOB).unwrap() == pattern(k, 1, BLOB),
            "key {k}"
        );
    }
    assert!(read(&b, 1000, 0, BLOB).unwrap() == pattern(1000, 9, BLOB));
    kill9(child);
    // The index is whole again: a second repair loses nothing.
    let out = p.run(&["--repair"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_store_in_the_old_format_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    std::fs::create_dir_all(&p.swap_dir).unwrap();
    let mut v1 = b"ARNC".to_vec();
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&[0; 100]);
    std::fs::write(file(&p, "index.ckpt"), v1).unwrap();
    let err = refused(&p.run(&[]));
    assert!(
        err.contains("index.ckpt has on-disk format version 1") && err.contains("does not migrate"),
        "{err}"
    );
}

/// What `--check` printed as problems.
fn problems(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(1),
        "--check passed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("problem: "))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_checkpoint_length_of_2_pow_64_minus_1_is_refused_by_start_check_and_repair_alike() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    populate(&p, 3);
    // The first run's checkpoint is slot 0, the only one written: its body
    // length field (bytes 56..64) past any slot.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(file(&p, "index.ckpt"))
        .unwrap();
    f.write_all_at(&u64::MAX.to_le_bytes(), 56).unwrap();
    let want = "slot 0 at offset 0: field body_len = 18446744073709551615 does not fit";
    let out = p.run(&[]);
    assert_eq!(out.status.code(), Some(1), "a refusal, not a panic");
    let err = refused(&out);
    assert!(err.contains("index.ckpt") && err.contains(want), "{err}");
    let found = problems(&p.run(&["--check"]));
    assert!(
        found.contains("the store in swap_dir: corrupt") && found.contains(want),
        "{found}"
    );
    let out = p.run(&["--repair"]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "nothing lost: {report}");
    assert!(
        report.contains(want),
        "the old index's damage is named: {report}"
    );
    all_readable(&p, 3);
    // The epochs file is read as a start reads it, too.
    let body = "arenad-epochs 1\n18446744073709551615 a\n";
    let crc = crc32c::crc32c(body.as_bytes());
    std::fs::write(file(&p, "epochs"), format!("{body}crc32c {crc:08x}\n")).unwrap();
    let found = problems(&p.run(&["--check"]));
    assert!(
        found.contains("epochs is damaged (line 2: epoch \"18446744073709551615\" is not a number"),
        "{found}"
    );
}

#[test]
fn a_lost_acknowledged_journal_batch_refuses_to_start_and_repair_restores_it() {
    let dir = tempfile::tempdir().unwrap();
    let p = arenad(dir.path());
    // Four FLUSHes, acknowledged, then kill -9: the last one's batch holds
    // volume b's blob.
    populate(&p, 3);
    let j = file(&p, "index.journal");
    let last = *journal_blocks(&j).last().unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&j).unwrap();
    f.write_all_at(&[0; 512], last as u64).unwrap();
    let want = format!("index.journal: at offset {last}: batch 4 is missing");
    let err = refused(&p.run(&[]));
    assert!(err.contains(&want) && err.contains("as synced"), "{err}");
    let found = problems(&p.run(&["--check"]));
    assert!(found.contains(&want), "{found}");
    let out = p.run(&["--repair"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    all_readable(&p, 3);
    let child = p.spawn();
    let b = p.connect("b");
    assert!(read(&b, 1000, 0, BLOB).unwrap() == pattern(1000, 9, BLOB));
    kill9(child);
}
