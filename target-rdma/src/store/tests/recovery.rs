//! Durability across crashes, and the damaged or missing index files a start refuses.

use super::support::*;
use super::*;

#[test]
fn flushed_data_survives_a_crash_and_generation_bumps() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 64);
    let g1 = s.generation();
    for k in 0..20 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.write(1, 3, 0, b"vol b").unwrap();
    s.flush().unwrap();
    s.write(0, 0, 0, b"unflushed overwrite").unwrap();
    s.write(0, 99, 0, b"unflushed new").unwrap();
    s.remove(0, 5, 6).unwrap();
    drop(s); // a crash: no flush

    let s = open(dir.path(), 4, 64);
    assert_eq!(s.generation(), g1 + 1);
    for k in 0..20 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "key {k}");
    }
    assert!(blob(&s, 0, 99).is_none());
    assert_eq!(&blob(&s, 1, 3).unwrap()[..5], b"vol b");
    assert!(s.stats().swap_extents_used >= 21);

    // Volumes are persisted by name: a new order maps them back.
    drop(s);
    let swapped = [vols(1000)[1].clone(), vols(1000)[0].clone()];
    let s = Store::open(cfg(dir.path(), 4, 64), &swapped).unwrap();
    assert_eq!(&blob(&s, 0, 3).unwrap()[..5], b"vol b");
    assert_eq!(blob(&s, 1, 7).unwrap(), pattern(7));
    // A volume left out of the list keeps its blobs for a later run.
    drop(s);
    let s = Store::open(cfg(dir.path(), 4, 64), &swapped[..1]).unwrap();
    assert!(s.read(1, 7, 0, &mut [0; 1]).is_err());
    drop(s);
    let s = open(dir.path(), 4, 64);
    assert_eq!(blob(&s, 0, 7).unwrap(), pattern(7));
}

#[test]
fn repeated_flushes_checkpoint_and_free_superseded_extents() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    for round in 0..100u64 {
        for k in 0..6 {
            s.write(0, k, 0, &pattern(round * 10 + k)).unwrap();
        }
        s.flush().unwrap();
    }
    let st = s.stats();
    assert!(st.checkpoints >= 3, "{st:?}");
    assert!(
        st.swap_extents_used <= 12,
        "old extents are recycled: {st:?}"
    );
    drop(s);
    let s = open(dir.path(), 4, 16);
    for k in 0..6 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(990 + k));
    }
}

#[test]
fn a_torn_last_batch_past_the_synced_mark_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(index::JOURNAL_FILE);
    let s = open(dir.path(), 4, 64);
    for k in 0..2 {
        s.write(0, k, 0, &pattern(k)).unwrap();
        s.flush().unwrap();
    }
    // The journal as it was when the second FLUSH returned.
    let before = std::fs::read(&p).unwrap();
    // A commit of 20 blobs: a batch of two blocks, at 1536 and 2048.
    for k in 10..30 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    drop(s);
    let after = std::fs::read(&p).unwrap();
    // The crash came while that batch was being written: its first block
    // reached the disk, its second did not, and the header still marks
    // batch 2 as the last synced. Never acknowledged: a start drops it.
    let mut torn = before.clone();
    torn[1536..2048].copy_from_slice(&after[1536..2048]);
    std::fs::write(&p, &torn).unwrap();
    let c = Store::check(&cfg(dir.path(), 4, 64), &vols(1000)).unwrap();
    assert!(
        c.summary.contains(
            "2 journal batches (2 marked synced), and a torn batch 3 at offset 1536 past the synced mark"
        ) && c.warnings.is_empty(),
        "{c:?}"
    );
    let s = open(dir.path(), 4, 64);
    assert_eq!(blob(&s, 0, 0).unwrap(), pattern(0));
    assert_eq!(blob(&s, 0, 1).unwrap(), pattern(1));
    assert!(
        blob(&s, 0, 10).is_none() && blob(&s, 0, 29).is_none(),
        "the unacknowledged commit is dropped"
    );
    s.write(0, 10, 0, &pattern(10)).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = open(dir.path(), 4, 64);
    assert_eq!(
        blob(&s, 0, 10).unwrap(),
        pattern(10),
        "later commits survive"
    );
    drop(s);
    // The same batch torn after its append returned (the header marks it
    // synced): an acknowledged commit lost, refused.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(index::JOURNAL_FILE);
    let s = open(dir.path(), 4, 64);
    for k in 10..30 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    drop(s);
    let mut b = std::fs::read(&p).unwrap();
    b[1024..1536].fill(0);
    std::fs::write(&p, &b).unwrap();
    let e = Store::open(cfg(dir.path(), 4, 64), &vols(1000))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("at offset 512: batch 1 is incomplete (its block at offset 1024 is zeros)"),
        "{e}"
    );
}

#[test]
fn a_damaged_or_cut_journal_refuses_to_start_naming_the_offset() {
    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    let p = dir.path().join(index::JOURNAL_FILE);
    let good = std::fs::read(&p).unwrap();
    // A flipped byte in any record, the last one included, is damage: a
    // torn write leaves zeros, never wrong bytes.
    for at in [530, 1040, 1560, 2047] {
        let mut b = good.clone();
        b[at] ^= 0x04;
        std::fs::write(&p, &b).unwrap();
        let e = open_err(dir.path());
        let block = at / 512 * 512;
        assert!(
            matches!(e, StoreError::Corrupt { .. })
                && e.to_string().contains("index.journal")
                && e.to_string().contains(&format!("at offset {block}")),
            "flip at {at}: {e}"
        );
    }
    // A journal cut after any record (or anywhere) is refused.
    for cut in [512, 1024, 1536, 2048, 2047, good.len() - 1] {
        std::fs::write(&p, &good[..cut]).unwrap();
        let e = open_err(dir.path());
        assert!(
            e.to_string().contains("index.journal") && e.to_string().contains("truncated"),
            "cut at {cut}: {e}"
        );
    }
    std::fs::remove_file(&p).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("index.journal: is missing"), "{e}");
    // Put back, it opens and nothing was lost.
    std::fs::write(&p, &good).unwrap();
    let s = open(dir.path(), 4, 16);
    for k in 0..3 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k));
    }
}

#[test]
fn a_missing_checkpoint_refuses_unless_the_store_never_held_anything() {
    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    let ckpt = dir.path().join(index::CKPT_FILE);
    let saved = std::fs::read(&ckpt).unwrap();
    std::fs::remove_file(&ckpt).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.to_string().contains("index.ckpt: is missing") && e.to_string().contains("--repair"),
        "{e}"
    );
    // Still refused after a clean close (the journal then is empty; the
    // extent headers still say blobs exist).
    std::fs::write(&ckpt, &saved).unwrap();
    drop(open(dir.path(), 4, 16));
    std::fs::remove_file(&ckpt).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("index.ckpt: is missing"), "{e}");

    // A store that never held a blob (or a creation cut short) starts over.
    let empty = tempfile::tempdir().unwrap();
    drop(open(empty.path(), 4, 16));
    std::fs::remove_file(empty.path().join(index::CKPT_FILE)).unwrap();
    let s = open(empty.path(), 4, 16);
    assert!(blob(&s, 0, 0).is_none());
}

#[test]
fn a_missing_or_short_swap_file_or_extent_table_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    let swap = dir.path().join(swap::SWAP_FILE);
    let len = std::fs::metadata(&swap).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&swap)
        .unwrap()
        .set_len(len - B)
        .unwrap();
    let e = open_err(dir.path());
    assert!(
        e.to_string().contains("swap.dat") && e.to_string().contains("truncated"),
        "{e}"
    );
    std::fs::remove_file(&swap).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("swap.dat: is missing"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    let meta = dir.path().join(extent::META_FILE);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&meta)
        .unwrap()
        .set_len(4096 + 8)
        .unwrap();
    let e = open_err(dir.path());
    assert!(
        e.to_string().contains("swap.meta") && e.to_string().contains("truncated"),
        "{e}"
    );
    std::fs::remove_file(&meta).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("swap.meta: is missing"), "{e}");
}

#[test]
fn a_damaged_checkpoint_slot_the_journal_needs_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Two runs: slot 0 holds epoch 1, slot 1 epoch 2 with the journal of 2.
    drop(open(dir.path(), 4, 16));
    three_flushes(dir.path());
    let p = dir.path().join(index::CKPT_FILE);
    let good = std::fs::read(&p).unwrap();
    let slot = good.len() / 2;
    // The older slot is not needed: damage there is harmless.
    let mut b = good.clone();
    b[20] ^= 1;
    std::fs::write(&p, &b).unwrap();
    let s = open(dir.path(), 4, 16);
    assert_eq!(blob(&s, 0, 2).unwrap(), pattern(2));
    drop(s);
    // Now the newest (this run's checkpoint, slot 0 again) is damaged and
    // the journal extends it: refused, not replaced by the older slot.
    three_flushes(dir.path());
    let good = std::fs::read(&p).unwrap();
    let newest = {
        let epoch = |o: usize| u64::from_le_bytes(good[o + 24..o + 32].try_into().unwrap());
        if epoch(0) > epoch(slot) {
            0
        } else {
            slot
        }
    };
    let mut b = good.clone();
    b[newest + 70] ^= 1;
    std::fs::write(&p, &b).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.to_string().contains("index.ckpt")
            && e.to_string().contains("belongs to checkpoint epoch"),
        "{e}"
    );
}

#[test]
fn a_store_of_the_old_format_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut v1 = b"ARNC".to_vec();
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&[0; 52]);
    std::fs::write(dir.path().join(index::CKPT_FILE), &v1).unwrap();
    std::fs::write(dir.path().join(swap::SWAP_FILE), vec![0; 16 * B as usize]).unwrap();
    let e = open_err(dir.path());
    assert!(
        matches!(e, StoreError::OldFormat { version: 1, .. })
            && e.to_string()
                .contains("index.ckpt has on-disk format version 1")
            && e.to_string().contains("does not migrate"),
        "{e}"
    );
}

#[test]
fn corrupt_checkpoint_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    s.write(0, 1, 0, b"x").unwrap();
    s.flush().unwrap();
    drop(s);
    let p = dir.path().join(index::CKPT_FILE);
    let mut b = std::fs::read(&p).unwrap();
    b[30] ^= 1;
    std::fs::write(&p, b).unwrap();
    let e = Store::open(cfg(dir.path(), 4, 16), &vols(10))
        .err()
        .expect("corrupt");
    assert!(
        matches!(e, StoreError::Corrupt { .. }) && e.to_string().contains("index.ckpt"),
        "{e}"
    );
}
