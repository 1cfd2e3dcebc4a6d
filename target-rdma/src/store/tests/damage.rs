//! Numbers read from the store's files that are out of range (lengths,
//! counts, extents): a start (`Store::open`), the check (`Store::check`,
//! `arenad --check`) and a repair (`Store::repair`, `arenad --repair`)
//! refuse or report them alike, naming the file, the slot or batch and
//! the field, and none of them panics; and damage is blamed on the file
//! that holds it, the configuration only when it changed.

use std::os::unix::fs::FileExt;
use std::path::Path;

use super::support::*;
use super::*;

/// Bytes of one checkpoint slot of the stores made here.
fn slot_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(index::CKPT_FILE)).unwrap().len() / 2
}

fn read_at(file: &Path, at: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    std::fs::File::open(file)
        .unwrap()
        .read_exact_at(&mut b, at)
        .unwrap();
    b
}

fn write_at(file: &Path, at: u64, bytes: &[u8]) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .write_all_at(bytes, at)
        .unwrap();
}

/// Writes `value` at `at` of the checkpoint slot at `slot` and, when
/// `fix`, recomputes the slot's checksum, so that only the field's own
/// check can catch it.
fn set_ckpt_field(dir: &Path, slot: u64, at: u64, value: &[u8], fix: bool) {
    let p = dir.join(index::CKPT_FILE);
    write_at(&p, slot + at, value);
    if fix {
        let body = u64::from_le_bytes(read_at(&p, slot + 56, 8).try_into().unwrap());
        let crc = crc32c::crc32c(&read_at(&p, slot, body as usize));
        write_at(&p, slot + body, &crc.to_le_bytes());
    }
}

/// Writes `value` at `at` of the journal block at `block` and fixes the
/// block's CRC.
fn set_journal_field(dir: &Path, block: u64, at: u64, value: &[u8]) {
    let p = dir.join(index::JOURNAL_FILE);
    write_at(&p, block + at, value);
    let crc = crc32c::crc32c(&read_at(&p, block, 508));
    write_at(&p, block + 508, &crc.to_le_bytes());
}

fn check(dir: &Path) -> Result<StoreCheck, StoreError> {
    Store::check(&cfg(dir, 4, 16), &vols(1000))
}

fn repair(dir: &Path) -> RepairReport {
    Store::repair(&cfg(dir, 4, 16), &vols(1000)).expect("repair runs")
}

/// A store run twice, so that both checkpoint slots are written: slot 0
/// epoch 1 (empty), slot 1 epoch 2 (the newest) holding keys 0 to 2 of
/// volume "a", and the empty journal of epoch 2.
fn two_runs(dir: &Path) {
    three_flushes(dir);
    drop(open(dir, 4, 16));
}

/// A start and the check both refuse the store naming `want`; a repair
/// names it in its report and rebuilds, and the store then opens with
/// every blob.
fn refused_alike(dir: &Path, want: &str) {
    let e = open_err(dir).to_string();
    assert!(e.contains(want), "start: want {want:?} in {e}");
    let e = check(dir).expect_err("the check refuses it").to_string();
    assert!(e.contains(want), "check: want {want:?} in {e}");
    let r = repair(dir);
    assert!(
        r.complete() && r.to_string().contains(want),
        "repair: want {want:?} in {r}"
    );
    let s = open(dir, 4, 16);
    for k in 0..3 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "key {k} after repair");
    }
}

#[test]
fn checkpoint_length_and_count_fields_are_refused_by_start_check_and_repair() {
    let (slot, journal) = {
        let dir = tempfile::tempdir().unwrap();
        two_runs(dir.path());
        let journal = std::fs::metadata(dir.path().join(index::JOURNAL_FILE)).unwrap();
        (slot_len(dir.path()), journal.len())
    };
    // (offset in the slot, field, values, checksum fixed): the body length
    // locates the checksum, the others are caught by their own checks.
    let u64s = |v: [u64; 4]| v.map(|x| x.to_le_bytes().to_vec());
    let u32s = |v: [u32; 4]| v.map(|x| x.to_le_bytes().to_vec());
    let cases = [
        (
            56,
            "body_len",
            u64s([0, 1 << 63, u64::MAX, slot - 3]),
            false,
        ),
        (48, "blobs", u64s([0, 1 << 63, u64::MAX, 4]), true),
        (
            32,
            "journal_bytes",
            u64s([0, 1 << 63, u64::MAX, journal + 512]),
            true,
        ),
        (
            40,
            "volumes",
            u32s([3, 1 << 31, u32::MAX, 1 << 16 | 1]),
            true,
        ),
    ];
    for (at, field, values, fix) in cases {
        for v in values {
            let dir = tempfile::tempdir().unwrap();
            two_runs(dir.path());
            set_ckpt_field(dir.path(), slot, at, &v, fix);
            let shown = if v.len() == 8 {
                u64::from_le_bytes(v[..].try_into().unwrap())
            } else {
                u64::from(u32::from_le_bytes(v[..].try_into().unwrap()))
            };
            let want = if field == "volumes" && shown == 3 {
                // One volume more than named: its name runs into the blobs.
                format!("slot 1 at offset {slot}: ")
            } else if field == "journal_bytes" && shown == journal + 512 {
                // A journal size, past the journal's end.
                format!("index.journal: is {journal} bytes but was preallocated to {shown}")
            } else {
                format!("field {field} = {shown}")
            };
            refused_alike(dir.path(), &want);
        }
    }
}

#[test]
fn a_damaged_spare_checkpoint_slot_is_named_and_overwritten_not_refused() {
    for (at, v, fix) in [
        (56, u64::MAX, false),
        (56, 1 << 63, false),
        (48, 1 << 63, true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        two_runs(dir.path());
        set_ckpt_field(dir.path(), 0, at, &v.to_le_bytes(), fix);
        let c = check(dir.path()).expect("a start would go on");
        let field = if at == 56 { "body_len" } else { "blobs" };
        assert!(
            c.warnings
                .iter()
                .any(|w| w.contains("slot 0 at offset 0")
                    && w.contains(&format!("field {field} = {v}"))),
            "{c:?}"
        );
        let s = open(dir.path(), 4, 16);
        assert_eq!(blob(&s, 0, 2).unwrap(), pattern(2));
        drop(s);
        assert!(
            check(dir.path()).unwrap().warnings.is_empty(),
            "the start rewrote it"
        );
        assert!(repair(dir.path()).complete());
    }
}

#[test]
fn journal_length_fields_are_refused_by_start_check_and_repair() {
    // Batch 2 at offset 1024: parts (u32, blocks in the batch), used and
    // records (u16), each with the block's CRC fixed.
    let cases: [(u64, &str, Vec<Vec<u8>>); 3] = [
        (
            8,
            "parts",
            [0, 1u32 << 31, u32::MAX, 100_000]
                .map(|x| x.to_le_bytes().to_vec())
                .to_vec(),
        ),
        (
            14,
            "used",
            [477u16, 1 << 15, u16::MAX]
                .map(|x| x.to_le_bytes().to_vec())
                .to_vec(),
        ),
        (
            12,
            "records",
            [0u16, 1 << 15, u16::MAX]
                .map(|x| x.to_le_bytes().to_vec())
                .to_vec(),
        ),
    ];
    for (at, field, values) in cases {
        for v in values {
            let dir = tempfile::tempdir().unwrap();
            three_flushes(dir.path());
            set_journal_field(dir.path(), 1024, at, &v);
            let shown = if v.len() == 4 {
                u64::from(u32::from_le_bytes(v[..].try_into().unwrap()))
            } else {
                u64::from(u16::from_le_bytes(v[..].try_into().unwrap()))
            };
            let e = open_err(dir.path()).to_string();
            assert!(
                e.contains("at offset 1024 (batch 2)"),
                "{field} {shown}: {e}"
            );
            refused_alike(dir.path(), &format!("{field} = {shown}"));
        }
    }
}

#[test]
fn a_zeroed_synced_batch_is_refused_and_repair_restores_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    s.write(0, 0, 0, &pattern(0)).unwrap();
    s.flush().unwrap();
    s.write(0, 1, 0, &pattern(1)).unwrap();
    s.flush().unwrap();
    // The last batch: a new blob of volume "b", and an overwrite of a
    // blob of "a" whose old extent it frees.
    s.write(1, 7, 0, &pattern(7)).unwrap();
    s.write(0, 0, 0, &pattern(100)).unwrap();
    s.flush().unwrap();
    drop(s);
    let journal = dir.path().join(index::JOURNAL_FILE);
    write_at(&journal, 1536, &[0; 512]);
    let want = "index.journal: at offset 1536: batch 3 is missing";
    let e = open_err(dir.path()).to_string();
    assert!(
        e.contains(want) && e.contains("marks batches 1 to 3 as synced"),
        "{e}"
    );
    let e = check(dir.path()).expect_err("refused").to_string();
    assert!(e.contains(want), "{e}");
    let r = repair(dir.path());
    assert!(r.complete(), "{r}");
    assert!(
        r.old_index.contains("compared as far as it reads: checkpoint epoch 1 and the 2 journal batches before the damage"),
        "{}",
        r.old_index
    );
    let s = open(dir.path(), 4, 16);
    assert_eq!(blob(&s, 0, 0).unwrap(), pattern(100));
    assert_eq!(blob(&s, 0, 1).unwrap(), pattern(1));
    assert_eq!(blob(&s, 1, 7).unwrap(), pattern(7));
}

#[test]
fn an_extent_past_the_swap_in_a_journal_batch_is_that_batchs_damage() {
    for extent in [16u32, 1 << 31, u32::MAX] {
        let dir = tempfile::tempdir().unwrap();
        three_flushes(dir.path());
        // Batch 3's one Put: its extent field (block offset 32 + 13).
        set_journal_field(dir.path(), 1536, 45, &extent.to_le_bytes());
        let e = open_err(dir.path());
        assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
        refused_alike(
            dir.path(),
            &format!(
                "index.journal: batch 3 at offset 1536: the record of volume \"a\" key 2 names swap \
                 extent {extent}, but the swap had 16 extents"
            ),
        );
    }
}

#[test]
fn an_extent_two_blobs_map_is_named_by_the_batch_that_maps_it_again() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    for k in 0..3 {
        s.write(0, k, 0, &pattern(k)).unwrap();
        s.flush().unwrap();
    }
    let e0 = s.core.durable_extent((0, 0)).unwrap();
    drop(s);
    set_journal_field(dir.path(), 1536, 45, &e0.to_le_bytes());
    let e = open_err(dir.path()).to_string();
    assert!(
        e.contains(&format!(
            "index.journal: batch 3 at offset 1536: the record of volume \"a\" key 2 names swap \
             extent {e0}, which volume \"a\" key 0 maps"
        )),
        "{e}"
    );
    assert!(check(dir.path()).is_err());
    // Repair keeps the newest image of each blob: key 2's extent header
    // still names key 2.
    assert!(repair(dir.path()).complete());
}

#[test]
fn a_lowered_swap_bytes_is_the_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    for k in 0..8 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    drop(s);
    let smaller = || {
        Store::open(cfg(dir.path(), 4, 4), &vols(1000))
            .err()
            .expect("refused")
    };
    // Named by the journal, then (after a start checkpointed it) by the
    // checkpoint: either way the setting, not damage.
    for _ in 0..2 {
        let e = smaller();
        assert!(
            matches!(
                e,
                StoreError::InvalidConfig {
                    key: "swap_bytes",
                    ..
                }
            ) && e
                .to_string()
                .contains("now holds only 4 extents (the store was written with 16)"),
            "{e}"
        );
        drop(open(dir.path(), 4, 16));
    }
}

#[test]
fn extent_header_fields_are_named_by_start_check_and_repair() {
    for blocks in [0u32, 1 << 31, u32::MAX, 2] {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path(), 4, 16);
        for k in 0..3 {
            s.write(0, k, 0, &pattern(k)).unwrap();
        }
        s.flush().unwrap();
        let e1 = s.core.durable_extent((0, 1)).unwrap();
        drop(s);
        // The header's block count, its CRC fixed (4 KiB blobs: 1 block).
        let meta = dir.path().join(extent::META_FILE);
        let rec = 4096 + u64::from(e1) * extent::record_len(B as u32) as u64;
        write_at(&meta, rec + 4, &blocks.to_le_bytes());
        let crc = crc32c::crc32c(&read_at(&meta, rec, 44));
        write_at(&meta, rec + 44, &crc.to_le_bytes());
        let want = format!("field blocks = {blocks}, extents here have 1");
        // A start serves the other blobs and refuses this one's reads.
        let c = check(dir.path()).expect("a start goes on");
        assert!(
            c.warnings.iter().any(|w| w.contains("swap.meta: 1 blobs")
                && w.contains(&format!("volume \"a\" key 1 (extent {e1})"))
                && w.contains(&want)),
            "{c:?}"
        );
        let s = open(dir.path(), 4, 16);
        let e = s.read(0, 1, 0, &mut [0; 16]).unwrap_err().to_string();
        assert!(e.contains(&want), "{e}");
        assert_eq!(blob(&s, 0, 2).unwrap(), pattern(2));
        drop(s);
        let r = repair(dir.path());
        assert!(
            !r.complete() && r.bad_headers == [(e1, want.clone())],
            "{r}"
        );
    }
}

#[test]
fn an_extent_table_header_field_is_refused_by_start_and_check_and_repaired() {
    for v in [0u32, 1 << 31, u32::MAX] {
        let dir = tempfile::tempdir().unwrap();
        three_flushes(dir.path());
        let meta = dir.path().join(extent::META_FILE);
        write_at(&meta, 12, &v.to_le_bytes());
        let crc = crc32c::crc32c(&read_at(&meta, 0, 16));
        write_at(&meta, 16, &crc.to_le_bytes());
        let e = open_err(dir.path()).to_string();
        assert!(e.contains("swap.meta: header field record_len"), "{e}");
        refused_alike(
            dir.path(),
            &format!("header field record_len = {v}, but 4096-byte extents have 48-byte records"),
        );
    }
}

#[test]
fn the_check_reads_without_writing_and_says_what_a_start_would_do() {
    let dir = tempfile::tempdir().unwrap();
    let c = check(&dir.path().join("none")).unwrap();
    assert!(c.summary.contains("no store"), "{c:?}");
    assert!(!dir.path().join("none").exists());
    three_flushes(dir.path());
    let c = check(dir.path()).unwrap();
    assert!(
        c.summary.contains(
            "checkpoint epoch 1 (slot 0), 3 journal batches (3 marked synced); 3 blobs indexed"
        ),
        "{c:?}"
    );
    // Damage: refused, and nothing written (a start would not get as far
    // as writing either).
    let journal = dir.path().join(index::JOURNAL_FILE);
    let good = std::fs::read(&journal).unwrap();
    flip(&journal, 1536 + 100);
    let names = [
        index::JOURNAL_FILE,
        index::CKPT_FILE,
        extent::META_FILE,
        swap::SWAP_FILE,
    ];
    let files: Vec<Vec<u8>> = names
        .iter()
        .map(|f| std::fs::read(dir.path().join(f)).unwrap())
        .collect();
    let e = check(dir.path()).expect_err("refused").to_string();
    assert!(
        e.contains("at offset 1536 (batch 3): checksum mismatch"),
        "{e}"
    );
    for (f, before) in names.iter().zip(&files) {
        assert_eq!(
            &std::fs::read(dir.path().join(f)).unwrap(),
            before,
            "{f} changed"
        );
    }
    std::fs::write(&journal, good).unwrap();
    // An open store is not read under it.
    let s = open(dir.path(), 4, 16);
    assert!(matches!(check(dir.path()), Err(StoreError::Locked { .. })));
    drop(s);
}
