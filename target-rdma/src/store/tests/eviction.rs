//! Eviction, fault-in, the cleaner's write-back and read-ahead.

use std::sync::Arc;

use super::support::*;
use super::*;

#[test]
fn eviction_and_fault_in_through_a_small_arena() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 128);
    for k in 0..64 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    for round in 0..2 {
        for k in (0..64).rev() {
            assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "round {round} key {k}");
        }
    }
    let st = s.stats();
    assert!(
        st.evictions >= 60 && st.write_backs >= 60 && st.fault_ins >= 60,
        "{st:?}"
    );
    assert_eq!(st.swap_bytes_written, st.write_backs * B);
    assert_eq!(st.swap_bytes_read, st.fault_ins * B);
    assert_eq!(st.slots_total, 4);
}

#[test]
fn concurrent_fault_ins_of_one_blob_race_eviction_without_mixing() {
    let dir = tempfile::tempdir().unwrap();
    // More slots than threads, so inline copies alone never pin them all.
    let s = Arc::new(open(dir.path(), 6, 128));
    for k in 0..16 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    // Readers walk the same keys in the same order, so they fault the same
    // blob in at once; a writer evicts under them with whole and partial
    // writes of other keys.
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || {
                for round in 0..20 {
                    for k in 0..16 {
                        let got = blob(&s, 0, k).expect("key exists");
                        assert!(
                            got == pattern(k),
                            "round {round} key {k}: mixed or lost bytes"
                        );
                    }
                }
            })
        })
        .collect();
    let writer = {
        let s = s.clone();
        std::thread::spawn(move || {
            for round in 0..40u64 {
                for k in 16..24 {
                    let want = pattern(k + round * 100);
                    if k % 2 == 0 {
                        s.write(0, k, 0, &want).unwrap();
                    } else {
                        s.write(0, k, 0, &want[..2048]).unwrap();
                        s.write(0, k, 2048, &want[2048..]).unwrap();
                    }
                    assert_eq!(blob(&s, 0, k).unwrap(), want, "round {round} key {k}");
                }
            }
        })
    };
    for r in readers {
        r.join().unwrap();
    }
    writer.join().unwrap();
    let st = s.stats();
    assert!(st.fault_ins > 16 && st.evictions > 16, "{st:?}");
    assert_eq!(st.slots_leased, 0, "{st:?}");
}

#[test]
fn cleaner_writes_back_without_a_flush_and_a_crash_keeps_flushed_data() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    for k in 0..8 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    let flushed = s.stats();
    for k in 0..8 {
        s.write(0, k, 0, &pattern(k + 100)).unwrap();
    }
    // Every slot is dirty now: the cleaner brings clean ones back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let st = loop {
        let st = s.stats();
        let cleaned = st.write_backs >= flushed.write_backs + 2;
        if cleaned || std::time::Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert!(st.slots_clean >= 2, "{st:?}");
    assert!(st.write_backs >= flushed.write_backs + 2, "{st:?}");
    assert_eq!(st.flushes, 1, "{st:?}");
    assert_eq!(
        st.journal_records, flushed.journal_records,
        "cleaning journals nothing"
    );
    for k in 0..8 {
        assert_eq!(
            blob(&s, 0, k).unwrap(),
            pattern(k + 100),
            "key {k} before the crash"
        );
    }
    drop(s); // a crash: no flush

    let s = open(dir.path(), 8, 64);
    for k in 0..8 {
        assert_eq!(
            blob(&s, 0, k).unwrap(),
            pattern(k),
            "key {k} after the crash"
        );
    }
}

/// Two consecutive reads from swap start a read-ahead: with no further
/// request, the background workers fault the next blobs in, with the
/// right contents.
#[test]
fn sequential_reads_fault_the_next_blobs_in_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    for k in 0..24 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    // The arena holds 8 of 24: keys 0..8 were evicted to swap long ago.
    let before = s.stats().fault_ins;
    assert_eq!(blob(&s, 0, 0), Some(pattern(0)));
    assert_eq!(blob(&s, 0, 1), Some(pattern(1)));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while s.stats().fault_ins < before + 2 + engine::READ_AHEAD {
        assert!(
            std::time::Instant::now() < deadline,
            "read-ahead did not fault keys 2..6 in: {:?}",
            s.stats()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    for k in 2..6 {
        assert_eq!(blob(&s, 0, k), Some(pattern(k)), "key {k}");
    }
}
