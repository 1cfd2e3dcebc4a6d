//! The `_now` calls: what they decline so that the reactor never waits for the disk.

use super::support::*;
use super::*;

/// A blob whose slot the cleaner is writing to swap reports
/// `WritingBack` for as long as the disk write holds its slot locked, so
/// arenad sends a WRITE or ALLOC of it to the blocking pool instead of
/// blocking its reactor on the slot lock; and if the write-back begins
/// after that check, `write_now` and `alloc_now` decline rather than wait
/// (here they would wait for as long as the test holds the slots, for
/// ever). Reads and the data are unaffected.
#[test]
fn a_slot_under_write_back_is_reported_so_writes_wait_off_the_reactor() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    for k in 0..7 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    assert_eq!(s.residency(0, 0), Residency::Resident);
    // Hold the bytes of every slot but the last free one, as a slow disk
    // would hold a write-back's: the cleaner's write-back, woken by the
    // write that dirties the last slot, stops at the first of them.
    let held: Vec<_> = (0..7)
        .map(|k| s.core.arena.write(s.core.slot_of((0, k)).unwrap()))
        .collect();
    s.write(0, 7, 0, &pattern(7)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let writing_back = loop {
        let states: Vec<Residency> = (0..7).map(|k| s.residency(0, k)).collect();
        if states.contains(&Residency::WritingBack) || std::time::Instant::now() > deadline {
            break states;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    assert!(
        writing_back.contains(&Residency::WritingBack),
        "{writing_back:?}"
    );
    let busy = writing_back
        .iter()
        .position(|r| *r == Residency::WritingBack)
        .unwrap() as u64;
    assert_eq!(
        s.write_now(0, busy, 0, &pattern(100 + busy)).unwrap(),
        Immediate::WouldWait
    );
    assert_eq!(s.alloc_now(0, busy, 1).unwrap(), Immediate::WouldWait);
    assert_eq!(s.stats().leases_held, 0, "a declined ALLOC leases nothing");
    drop(held);
    // Reading shares the write-back's lock: served, once the test's
    // stand-in for the slow disk lets go of the bytes.
    assert_eq!(
        s.read_now(0, busy, 0, B as usize, |b| b.unwrap().to_vec())
            .unwrap(),
        Immediate::Done(pattern(busy))
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while (0..8).any(|k| s.residency(0, k) != Residency::Resident) {
        assert!(std::time::Instant::now() < deadline, "the write-back ended");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // A write-back that begins between arenad's residency check and the
    // write: the blob still resident, its bytes held for reading.
    let reading = s.core.arena.read(s.core.slot_of((0, busy)).unwrap());
    assert_eq!(
        s.write_now(0, busy, 0, &pattern(100 + busy)).unwrap(),
        Immediate::WouldWait
    );
    drop(reading);
    assert_eq!(
        s.write_now(0, busy, 0, &pattern(100 + busy)).unwrap(),
        Immediate::Done(()),
        "the write-back ended: written at once"
    );
    for k in 0..8 {
        let want = if k == busy { 100 + k } else { k };
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(want), "key {k}");
    }
}

/// The `_now` calls of a blob that is in swap only decline: serving them
/// would read the disk on the caller's thread. Nothing is faulted in.
/// `write_now` and `alloc_now` of no blob decline too (they would take a
/// slot, maybe by a write-back); `read_now` and `get_now` of no blob answer
/// that there is none.
#[test]
fn calls_that_must_not_wait_decline_cold_and_absent_blobs() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    for k in 0..24 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    assert_eq!(s.residency(0, 0), Residency::Cold);
    let before = s.stats();
    for k in [0, 1000] {
        assert_eq!(
            s.write_now(0, k, 0, &[1; 4096]).unwrap(),
            Immediate::WouldWait,
            "key {k}"
        );
        assert_eq!(s.alloc_now(0, k, 1).unwrap(), Immediate::WouldWait);
    }
    assert_eq!(
        s.read_now(0, 0, 0, 1024, |b| b.is_some()).unwrap(),
        Immediate::WouldWait
    );
    assert_eq!(s.get_now(0, 0, 1).unwrap(), Immediate::WouldWait);
    assert_eq!(
        s.read_now(0, 1000, 0, 1024, |b| b.is_some()).unwrap(),
        Immediate::Done(false)
    );
    assert_eq!(s.get_now(0, 1000, 1).unwrap(), Immediate::Done(None));
    let after = s.stats();
    assert_eq!(after.fault_ins, before.fault_ins);
    assert_eq!(after.swap_bytes_read, before.swap_bytes_read);
    assert_eq!(after.leases_held, 0);
    assert_eq!(s.residency(0, 0), Residency::Cold);
    assert_eq!(s.residency(0, 1000), Residency::Absent);
    assert_eq!(blob(&s, 0, 0).unwrap(), pattern(0));
    // A resident blob is written at once, and so is its lease.
    assert_eq!(
        s.write_now(0, 23, 0, &pattern(123)).unwrap(),
        Immediate::Done(())
    );
    assert_eq!(blob(&s, 0, 23).unwrap(), pattern(123));
    assert_eq!(
        s.read_now(0, 23, 1024, 1024, |b| b.unwrap().to_vec())
            .unwrap(),
        Immediate::Done(pattern(123)[1024..2048].to_vec())
    );
    assert!(matches!(
        s.get_now(0, 23, 1).unwrap(),
        Immediate::Done(Some(_))
    ));
    assert!(matches!(s.alloc_now(0, 23, 1).unwrap(), Immediate::Done(_)));
}
