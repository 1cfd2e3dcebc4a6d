//! Bytes read from swap that do not verify, and `arenad --repair`.

use std::path::Path;

use super::support::*;
use super::*;

#[test]
fn a_flipped_byte_in_an_extent_fails_that_read_until_it_is_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 64);
    for k in 0..8 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    let e3 = s.core.durable_extent((0, 3)).unwrap();
    drop(s);
    flip(&dir.path().join(swap::SWAP_FILE), u64::from(e3) * B + 100);
    let s = open(dir.path(), 4, 64);
    let mut out = vec![0u8; B as usize];
    for _ in 0..2 {
        assert_eq!(
            integrity_kind(s.read(0, 3, 0, &mut out)),
            Some(IntegrityKind::Checksum)
        );
    }
    let e = s.read(0, 3, 0, &mut out).unwrap_err().to_string();
    assert!(
        e.contains("swap.dat")
            && e.contains(&format!("extent {e3}"))
            && e.contains(&format!("at byte {}", u64::from(e3) * B)),
        "{e}"
    );
    assert_eq!(s.stats().integrity_errors, [3, 0]);
    // Everything else reads back; leases and partial writes of the bad blob
    // fail the same way.
    for k in (0..8).filter(|&k| k != 3) {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "key {k}");
    }
    assert!(matches!(s.get(0, 3, 1), Err(StoreError::Integrity { .. })));
    assert!(matches!(
        s.alloc(0, 3, 1),
        Err(StoreError::Integrity { .. })
    ));
    assert!(matches!(
        s.write(0, 3, 10, b"x"),
        Err(StoreError::Integrity { .. })
    ));
    // Rewritten whole, it is good again, durably.
    s.write(0, 3, 0, &pattern(33)).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = open(dir.path(), 4, 64);
    assert_eq!(blob(&s, 0, 3).unwrap(), pattern(33));
}

#[test]
fn an_extent_swapped_with_another_volumes_never_serves_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 64);
    s.write(0, 1, 0, &pattern(1)).unwrap();
    s.write(1, 2, 0, &pattern(2)).unwrap();
    for k in 10..20 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    let (ea, eb) = (
        s.core.durable_extent((0, 1)).unwrap(),
        s.core.durable_extent((1, 2)).unwrap(),
    );
    drop(s);
    let swap_path = dir.path().join(swap::SWAP_FILE);
    let meta_path = dir.path().join(extent::META_FILE);
    let swap_bytes = |f: &Path, off: u64, len: u64| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(f).unwrap();
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, off).unwrap();
        b
    };
    let exchange = |f: &Path, a: u64, b: u64, len: u64| {
        use std::os::unix::fs::FileExt;
        let (x, y) = (swap_bytes(f, a, len), swap_bytes(f, b, len));
        let w = std::fs::OpenOptions::new().write(true).open(f).unwrap();
        w.write_all_at(&y, a).unwrap();
        w.write_all_at(&x, b).unwrap();
    };
    // The payloads alone: they fail their checksums.
    exchange(&swap_path, u64::from(ea) * B, u64::from(eb) * B, B);
    let s = open(dir.path(), 4, 64);
    let mut out = vec![0u8; B as usize];
    assert_eq!(
        integrity_kind(s.read(0, 1, 0, &mut out)),
        Some(IntegrityKind::Checksum)
    );
    assert_eq!(
        integrity_kind(s.read(1, 2, 0, &mut out)),
        Some(IntegrityKind::Checksum)
    );
    drop(s);
    // Payloads and headers together: each header names the other blob.
    let rec = extent::record_len(B as u32) as u64;
    exchange(
        &meta_path,
        4096 + u64::from(ea) * rec,
        4096 + u64::from(eb) * rec,
        rec,
    );
    let s = open(dir.path(), 4, 64);
    assert_eq!(
        integrity_kind(s.read(0, 1, 0, &mut out)),
        Some(IntegrityKind::Header)
    );
    assert_eq!(
        integrity_kind(s.read(1, 2, 100, &mut out[..10])),
        Some(IntegrityKind::Header)
    );
    let e = s.read(0, 1, 0, &mut out).unwrap_err().to_string();
    assert!(
        e.contains("swap.meta") && e.contains("names volume \"b\" key 2"),
        "{e}"
    );
    assert_eq!(s.stats().integrity_errors[IntegrityKind::Header.index()], 3);
    for k in 10..20 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k));
    }
}

#[test]
fn repair_rebuilds_what_the_extents_prove_and_reports_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 64);
    for k in 0..10 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.write(1, 5, 0, &pattern(500)).unwrap();
    s.flush().unwrap();
    // A newer image of key 0 and a removal, both flushed.
    s.write(0, 0, 0, &pattern(100)).unwrap();
    s.remove(0, 9, 10).unwrap();
    s.flush().unwrap();
    let bad = s.core.durable_extent((0, 4)).unwrap();
    drop(s);
    // Restarts that write nothing leave no extent header behind.
    for _ in 0..3 {
        drop(open(dir.path(), 4, 64));
    }
    let generation_before = open(dir.path(), 4, 64).generation();
    flip(&dir.path().join(swap::SWAP_FILE), u64::from(bad) * B + 7);
    std::fs::remove_file(dir.path().join(index::CKPT_FILE)).unwrap();
    assert!(matches!(open_err(dir.path()), StoreError::Corrupt { .. }));

    let r = Store::repair(&cfg(dir.path(), 4, 64), &vols(1000)).unwrap();
    let text = r.to_string();
    assert_eq!(
        r.recovered,
        vec![("a".to_string(), 8), ("b".to_string(), 1)],
        "{text}"
    );
    assert_eq!(r.bad_images_total, 1, "{text}");
    assert_eq!(
        (r.bad_images[0].volume.as_str(), r.bad_images[0].key),
        ("a", 4)
    );
    assert!(!r.complete());
    assert!(
        text.contains("NOT RECOVERED") && text.contains("key 4"),
        "{text}"
    );
    assert!(r.lost.is_none(), "no readable checkpoint");
    assert!(
        r.generation > generation_before,
        "runs that left no extent header are still behind the repaired generation"
    );

    let s = open(dir.path(), 4, 64);
    assert_eq!(
        blob(&s, 0, 0).unwrap(),
        pattern(100),
        "the newest image wins"
    );
    assert!(blob(&s, 0, 4).is_none(), "the bad image is not served");
    assert!(blob(&s, 0, 9).is_none(), "a removed blob stays removed");
    for k in [1, 2, 3, 5, 6, 7, 8] {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "key {k}");
    }
    assert_eq!(blob(&s, 1, 5).unwrap(), pattern(500));
    let g = s.generation();
    drop(s);
    // Repair of a store whose index is fine loses nothing and lists it so.
    let r = Store::repair(&cfg(dir.path(), 4, 64), &vols(1000)).unwrap();
    assert!(r.complete() && r.lost_total == 0, "{r}");
    let s = open(dir.path(), 4, 64);
    assert!(s.generation() > g);
    assert_eq!(blob(&s, 0, 0).unwrap(), pattern(100));
}
