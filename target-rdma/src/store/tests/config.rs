//! Configuration: validation, the directory lock, quotas, and volumes configured while running.

use super::support::*;
use super::*;

#[test]
fn quota_limits_distinct_blobs() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(cfg(dir.path(), 4, 16), &vols(3)).unwrap();
    for k in 0..3 {
        s.write(0, k, 0, b"x").unwrap();
    }
    let e = s.write(0, 3, 0, b"x").unwrap_err();
    assert!(
        matches!(&e, StoreError::QuotaExceeded { volume, quota: 3 } if volume == "a"),
        "{e}"
    );
    assert!(s.alloc(0, 3, 1).is_err());
    s.write(0, 2, 0, b"rewrite is fine").unwrap();
    s.write(1, 3, 0, b"other volume has its own quota").unwrap();
    s.remove(0, 0, 1).unwrap();
    s.write(0, 3, 0, b"room again").unwrap();
}

#[test]
fn config_validation_names_key_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let msg = |c: StoreConfig, v: &[VolumeSpec]| match Store::open(c, v) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("config accepted"),
    };
    let mut c = cfg(dir.path(), 4, 8);
    c.blob_bytes = 3000;
    let m = msg(c, &vols(1));
    assert!(m.contains("blob_bytes") && m.contains("3000"), "{m}");
    let mut c = cfg(dir.path(), 4, 8);
    c.blob_bytes = 32 << 20;
    assert!(msg(c, &vols(1)).contains("33554432"));
    let m = msg(cfg(dir.path(), 1, 8), &vols(1));
    assert!(m.contains("arena_bytes") && m.contains("4096"), "{m}");
    let m = msg(cfg(dir.path(), 8, 4), &vols(1));
    assert!(m.contains("swap_bytes") && m.contains("16384"), "{m}");
    let mut c = cfg(dir.path(), 4, 8);
    c.swap_bytes += 1;
    assert!(msg(c, &vols(1)).contains("swap_bytes"));
    let dup = [vols(1)[0].clone(), vols(1)[0].clone()];
    let m = msg(cfg(dir.path(), 4, 8), &dup);
    assert!(m.contains("\"a\" is configured twice"), "{m}");

    drop(open(dir.path(), 4, 8));
    let mut c = cfg(dir.path(), 4, 8);
    c.blob_bytes = 8192;
    c.arena_bytes = 4 * 8192;
    c.swap_bytes = 8 * 8192;
    let m = msg(c, &vols(1));
    assert!(
        m.contains("blob_bytes") && m.contains("8192") && m.contains("4096"),
        "{m}"
    );
}

#[test]
fn second_open_of_a_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 8);
    let e = Store::open(cfg(dir.path(), 4, 8), &vols(10))
        .err()
        .expect("locked");
    assert!(matches!(e, StoreError::Locked { .. }), "{e}");
    drop(s);
    open(dir.path(), 4, 8);
}

#[test]
fn a_volume_configured_while_running_survives_a_crash_and_keeps_its_id() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    s.write(0, 1, 0, &pattern(1)).unwrap();
    let spec = VolumeSpec {
        name: "late".into(),
        quota_blobs: 2,
    };
    let late = s.configure_volume(&spec).unwrap();
    assert_eq!(late, 2, "after a and b");
    assert_eq!(
        s.configure_volume(&spec).unwrap(),
        late,
        "same name, same id"
    );
    s.write(late, 5, 0, &pattern(5)).unwrap();
    s.write(late, 6, 0, &pattern(6)).unwrap();
    assert!(
        matches!(
            s.write(late, 7, 0, &pattern(7)),
            Err(StoreError::QuotaExceeded { .. })
        ),
        "its quota holds"
    );
    // A lower quota refuses new blobs, keeps the old ones; a higher one admits.
    s.configure_volume(&VolumeSpec {
        name: "late".into(),
        quota_blobs: 3,
    })
    .unwrap();
    s.write(late, 7, 0, &pattern(7)).unwrap();
    s.flush().unwrap();
    drop(s); // as after kill -9: no clean shutdown beyond the FLUSH

    // Reopened with the new volume in the config, anywhere in the list.
    let specs = vec![
        VolumeSpec {
            name: "late".into(),
            quota_blobs: 3,
        },
        VolumeSpec {
            name: "a".into(),
            quota_blobs: 1000,
        },
    ];
    let s = Store::open(cfg(dir.path(), 8, 64), &specs).unwrap();
    for key in [5, 6, 7] {
        assert_eq!(blob(&s, 0, key).unwrap(), pattern(key), "late/{key}");
    }
    assert_eq!(blob(&s, 1, 1).unwrap(), pattern(1));
    // "b" is kept but not served until configured again.
    assert!(matches!(
        s.read(2, 1, 0, &mut [0; 8]),
        Err(StoreError::UnknownVolume { .. })
    ));
    assert_eq!(
        s.configure_volume(&VolumeSpec {
            name: "b".into(),
            quota_blobs: 9
        })
        .unwrap(),
        2
    );
}
