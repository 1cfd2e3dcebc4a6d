//! Writes, reads and removes through the store, and its range, volume and space errors.

use super::support::*;
use super::*;

#[test]
fn write_read_round_trip_and_partial_writes() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 16);
    let mut out = vec![0xffu8; 100];
    assert!(!s.read(0, 7, 0, &mut out).unwrap());
    assert!(out.iter().all(|&b| b == 0), "absent key reads as zeros");

    s.write(0, 7, 100, b"hello").unwrap();
    let full = blob(&s, 0, 7).unwrap();
    assert_eq!(&full[100..105], b"hello");
    assert!(
        full[..100].iter().chain(&full[105..]).all(|&b| b == 0),
        "new key starts as zeros"
    );

    s.write(0, 7, 102, b"LL").unwrap();
    let mut part = [0u8; 5];
    assert!(s.read(0, 7, 100, &mut part).unwrap());
    assert_eq!(&part, b"heLLo");
    assert!(blob(&s, 1, 7).is_none(), "volumes are separate");

    s.write(0, 8, 0, &pattern(8)).unwrap();
    assert_eq!(blob(&s, 0, 8).unwrap(), pattern(8));
}

#[test]
fn range_volume_and_limit_errors() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 8);
    let e = s.write(0, 1, 4090, &[0; 7]).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::OutOfRange {
                offset: 4090,
                len: 7,
                blob_bytes: 4096
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("4090") && e.to_string().contains("4096"),
        "{e}"
    );
    let mut big = vec![0u8; 4097];
    assert!(matches!(
        s.read(0, 1, 0, &mut big),
        Err(StoreError::OutOfRange { .. })
    ));
    let e = s.write(2, 1, 0, b"x").unwrap_err();
    assert!(
        matches!(e, StoreError::UnknownVolume { vol: 2, count: 2 }),
        "{e}"
    );
}

#[test]
fn remove_drops_a_key_range() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 32);
    for k in 0..10 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.write(1, 5, 0, b"other volume").unwrap();
    assert_eq!(s.remove(0, 3, 7).unwrap(), 4);
    for k in 0..10 {
        assert_eq!(blob(&s, 0, k).is_some(), !(3..7).contains(&k), "key {k}");
    }
    assert!(blob(&s, 1, 5).is_some());
    assert_eq!(s.remove(0, 3, 7).unwrap(), 0);
    assert_eq!(s.remove(0, 9, 2).unwrap(), 0, "empty range");
    s.write(0, 4, 0, b"again").unwrap();
    assert_eq!(&blob(&s, 0, 4).unwrap()[..5], b"again");
}

#[test]
fn no_space_when_arena_and_swap_are_full() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 2, 4);
    let mut written = Vec::new();
    let mut err = None;
    for k in 0..16 {
        match s.write(0, k, 0, &pattern(k)) {
            Ok(()) => written.push(k),
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let e = err.expect("a 2-slot arena with 4 extents fills up");
    assert!(
        matches!(
            e,
            StoreError::NoSpace {
                slots: 2,
                extents: 4
            }
        ),
        "{e}"
    );
    assert_eq!(
        written,
        [0, 1, 2],
        "capacity is the swap less one spare extent"
    );
    s.flush().unwrap();
    for round in 0..3u64 {
        for &k in &written {
            s.write(0, k, 0, &pattern(k + round)).unwrap();
        }
        s.flush().unwrap();
    }
    for &k in &written {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k + 2), "key {k}");
    }
    s.remove(0, 0, 1).unwrap();
    s.write(0, 9, 0, b"room after remove").unwrap();
}
