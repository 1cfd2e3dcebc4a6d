//! SIGHUP against the real `arenad` process: volumes added and removed,
//! a secret rotated without a restart (new sessions prove the new one,
//! open sessions go on), a bad config kept out, keys that need a restart
//! named, and no exit 129; a volume added by SIGHUP has a membership
//! epoch like the others, kept across unserving and a restart; a volume
//! made confidential by SIGHUP refuses new unsealed sessions while the
//! open ones go on.

mod common;

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use common::arenad::{Arenad, Proc};
use common::log_lines::{has, until};
use common::*;
use futures::executor::block_on;
use target_rdma::arenad::events as arenad_events;
use target_rdma::blob::{ArenaError, ErrorKind};
use target_rdma::client::{ArenaClient, ClientConfig};
use ublk_metrics::events;

const NEW_B: &str = "rotated-secret-of-volume-b-5555";
const SECRET_C: &str = "secret-of-volume-c-added-by-sighup";
const BLOB: usize = 64 << 10;

fn connect(p: &Arenad, volume: &str, secret_value: &str) -> Result<ArenaClient, ArenaError> {
    ArenaClient::connect(ClientConfig::new(
        format!("127.0.0.1:{}", p.port),
        volume,
        secret(secret_value),
    ))
}

fn hup(p: &mut Proc, lines: &Receiver<String>, ends_with: &str) -> Vec<String> {
    p.signal("HUP");
    let seen = until(lines, ends_with);
    assert_eq!(p.exited(), None, "SIGHUP must not end arenad");
    seen
}

#[test]
fn sighup_adds_volumes_rotates_secrets_and_keeps_a_bad_config_out() {
    let dir = tempfile::tempdir().unwrap();
    let p = Arenad::new(dir.path(), "512K", "64K", "64M", None);
    let original = std::fs::read_to_string(&p.cfg).unwrap();
    let (mut proc, lines) = p.spawn_logged(&[]);
    until(&lines, arenad_events::ARENAD_READY);

    // A session of "b" opened before the rotation.
    let old_b = connect(&p, "b", SECRET_B).unwrap();
    block_on(old_b.write(1, 0, &pattern(1, 1, BLOB))).unwrap();
    assert_eq!(
        connect(&p, "c", SECRET_C).map(drop).unwrap_err().kind(),
        ErrorKind::AuthFailed,
        "no volume c yet"
    );

    // Rotate b's secret in place, add volume c, raise a's log level.
    secret_file(dir.path(), "b.key", NEW_B);
    let c_key = secret_file(dir.path(), "c.key", SECRET_C);
    let added = format!(
        "{original}\n[[volume]]\nname = \"c\"\nsecret_file = \"{}\"\nquota = \"1M\"\n",
        c_key.display()
    );
    std::fs::write(&p.cfg, format!("log_level = \"debug\"\n{added}")).unwrap();
    let seen = hup(&mut proc, &lines, events::CONFIG_RELOADED);
    assert!(
        has(&seen, arenad_events::VOLUME_SERVED, "\"volume\":\"c\""),
        "{seen:#?}"
    );
    assert!(
        has(
            &seen,
            arenad_events::VOLUME_SECRET_CHANGED,
            "\"volume\":\"b\""
        ),
        "{seen:#?}"
    );
    assert!(
        has(&seen, events::CONFIG_CHANGED, "\"key\":\"log_level\""),
        "{seen:#?}"
    );

    let c = connect(&p, "c", SECRET_C).expect("the added volume serves");
    block_on(c.write(7, 0, &pattern(7, 1, BLOB))).unwrap();
    let refused = connect(&p, "b", SECRET_B).map(drop).unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::AuthFailed, "{refused}");
    // The refusal names the peer in the log (not in metrics).
    let seen = until(&lines, arenad_events::AUTH_FAILED);
    assert!(
        seen.last().unwrap().contains("\"peer\":\"127.0.0.1:"),
        "{seen:#?}"
    );
    let new_b = connect(&p, "b", NEW_B).expect("the rotated secret opens b");
    // The session that proved the old secret goes on, and sees new writes.
    block_on(new_b.write(2, 0, &pattern(2, 1, BLOB))).unwrap();
    let mut out = vec![0; BLOB];
    block_on(old_b.read_found(1, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(1, 1, BLOB));
    block_on(old_b.read_found(2, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(2, 1, BLOB));

    // A config that does not load changes nothing, and says why.
    std::fs::write(&p.cfg, format!("arena_bytes = \"lots\"\n{added}")).unwrap();
    let seen = hup(&mut proc, &lines, events::CONFIG_RELOAD_FAILED);
    assert!(
        seen.last().unwrap().contains("arena_bytes"),
        "names the key: {seen:#?}"
    );
    connect(&p, "c", SECRET_C).expect("c still served");
    connect(&p, "b", NEW_B).expect("b keeps the rotated secret");

    // Removing c refuses new sessions of c (its open one goes on); a
    // changed arena size is named as needing a restart, and not applied.
    let removed = original.replace("arena_bytes = \"512K\"", "arena_bytes = \"1M\"");
    assert_ne!(removed, original);
    std::fs::write(&p.cfg, &removed).unwrap();
    let seen = hup(&mut proc, &lines, events::CONFIG_RELOADED);
    assert!(
        has(&seen, arenad_events::VOLUME_UNSERVED, "\"volume\":\"c\""),
        "{seen:#?}"
    );
    assert!(
        has(
            &seen,
            events::CONFIG_RESTART_NEEDED,
            "\"key\":\"arena_bytes\""
        ),
        "{seen:#?}"
    );
    assert_eq!(
        connect(&p, "c", SECRET_C).map(drop).unwrap_err().kind(),
        ErrorKind::AuthFailed
    );
    block_on(c.read_found(7, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(7, 1, BLOB));

    // SIGTERM still stops it cleanly after the reloads.
    drop((c, old_b, new_b));
    proc.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = proc.exited() {
            break s;
        }
        assert!(Instant::now() < deadline, "arenad did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

/// A client of `volume` that speaks protocol version 2 only, at `epoch`.
fn connect_v2(p: &Arenad, volume: &str, secret_value: &str, epoch: u64) -> ArenaClient {
    let mut cfg = ClientConfig::new(
        format!("127.0.0.1:{}", p.port),
        volume,
        secret(secret_value),
    );
    cfg.versions = 2..=2;
    cfg.epoch = epoch;
    ArenaClient::connect(cfg).expect("a version 2 session")
}

#[test]
fn a_volume_added_by_sighup_has_a_membership_epoch_that_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let p = Arenad::new(dir.path(), "512K", "64K", "64M", None);
    let original = std::fs::read_to_string(&p.cfg).unwrap();
    let (mut proc, lines) = p.spawn_logged(&[]);
    until(&lines, arenad_events::ARENAD_READY);

    // Volume c comes in by SIGHUP, after a and b (a third volume index).
    let c_key = secret_file(dir.path(), "c.key", SECRET_C);
    let with_c = format!(
        "{original}\n[[volume]]\nname = \"c\"\nsecret_file = \"{}\"\nquota = \"1M\"\n",
        c_key.display()
    );
    std::fs::write(&p.cfg, &with_c).unwrap();
    let seen = hup(&mut proc, &lines, events::CONFIG_RELOADED);
    assert!(
        has(&seen, arenad_events::VOLUME_SERVED, "\"volume\":\"c\""),
        "{seen:#?}"
    );

    let stale = |r: Result<(), ArenaError>| {
        let e = r.expect_err("a stale writer is refused");
        assert_eq!(
            e.status(),
            Some(target_rdma::proto::Status::StaleEpoch),
            "{e}"
        );
    };
    let old = connect_v2(&p, "c", SECRET_C, 1);
    block_on(old.write(1, 0, &pattern(1, 1, BLOB))).unwrap();
    // A newer writer fences the first out; EPOCH raises past it again.
    let new = connect_v2(&p, "c", SECRET_C, 2);
    stale(block_on(old.write(1, 0, &pattern(9, 1, BLOB))));
    assert_eq!(block_on(old.raise_epoch(5)).unwrap(), 5);
    stale(block_on(new.write(2, 0, &pattern(9, 1, BLOB))));
    block_on(old.write(3, 0, &pattern(3, 1, BLOB))).unwrap();
    // a's epoch is its own.
    block_on(connect_v2(&p, "a", SECRET_A, 0).write(1, 0, &pattern(4, 1, BLOB))).unwrap();
    drop((old, new));

    // Unserved and served again, c keeps its epoch.
    std::fs::write(&p.cfg, &original).unwrap();
    hup(&mut proc, &lines, events::CONFIG_RELOADED);
    std::fs::write(&p.cfg, &with_c).unwrap();
    hup(&mut proc, &lines, events::CONFIG_RELOADED);
    stale(block_on(connect_v2(&p, "c", SECRET_C, 4).write(
        4,
        0,
        &pattern(9, 1, BLOB),
    )));

    // After a restart (c now in the config from the start) 5 still holds.
    proc.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    while proc.exited().is_none() {
        assert!(Instant::now() < deadline, "arenad did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_proc, lines) = p.spawn_logged(&[]);
    until(&lines, arenad_events::ARENAD_READY);
    stale(block_on(connect_v2(&p, "c", SECRET_C, 4).write(
        4,
        0,
        &pattern(9, 1, BLOB),
    )));
    let five = connect_v2(&p, "c", SECRET_C, 5);
    let mut out = vec![0; BLOB];
    block_on(five.read_found(1, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(1, 1, BLOB), "the stale write never landed");
    block_on(five.read_found(3, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(3, 1, BLOB));
    let epochs = std::fs::read_to_string(p.swap_dir.join("epochs")).unwrap();
    assert!(epochs.contains("5 c\n"), "{epochs}");
    assert!(!epochs.contains(" a\n"), "a was never raised: {epochs}");
}

/// Whether `volume` is confidential, as `arenactl volumes` lists it.
fn listed_confidential(p: &Arenad, volume: &str) -> bool {
    use target_rdma::admin::{self, Reply, Request, Response};
    match admin::call(&p.admin, Request::Volumes, Duration::from_secs(10)).unwrap() {
        Response::Ok {
            reply: Reply::Volumes { volumes, .. },
        } => {
            volumes
                .iter()
                .find(|v| v.name == volume)
                .unwrap_or_else(|| panic!("no volume {volume} in {volumes:?}"))
                .confidential
        }
        other => panic!("{other:?}"),
    }
}

/// A sealed (protocol version 3) client of `volume`.
fn connect_sealed(p: &Arenad, volume: &str, secret_value: &str) -> ArenaClient {
    let mut cfg = ClientConfig::new(
        format!("127.0.0.1:{}", p.port),
        volume,
        secret(secret_value),
    );
    cfg.confidential = true;
    ArenaClient::connect(cfg).expect("a sealed session")
}

#[test]
fn sighup_makes_a_volume_confidential_for_new_sessions_only() {
    let dir = tempfile::tempdir().unwrap();
    let p = Arenad::new(dir.path(), "512K", "64K", "64M", None);
    let original = std::fs::read_to_string(&p.cfg).unwrap();
    let (mut proc, lines) = p.spawn_logged(&[]);
    until(&lines, arenad_events::ARENAD_READY);

    // A version-2 session of "a", opened while a takes any.
    let open = connect(&p, "a", SECRET_A).unwrap();
    block_on(open.write(1, 0, &pattern(1, 1, BLOB))).unwrap();
    assert!(!listed_confidential(&p, "a"));

    // a's table (the first) gains confidential = true.
    let on = original.replacen(
        "quota = \"1G\"\n",
        "quota = \"1G\"\nconfidential = true\n",
        1,
    );
    assert_ne!(on, original);
    std::fs::write(&p.cfg, &on).unwrap();
    let seen = hup(&mut proc, &lines, events::CONFIG_RELOADED);
    assert!(
        has(
            &seen,
            arenad_events::VOLUME_CONFIDENTIAL_CHANGED,
            "\"confidential\":true"
        ) && has(
            &seen,
            arenad_events::VOLUME_CONFIDENTIAL_CHANGED,
            "\"volume\":\"a\""
        ),
        "{seen:#?}"
    );
    assert!(
        !has(
            &seen,
            arenad_events::VOLUME_CONFIDENTIAL_CHANGED,
            "\"volume\":\"b\""
        ),
        "{seen:#?}"
    );
    assert!(listed_confidential(&p, "a"));
    assert!(!listed_confidential(&p, "b"));

    // A new version-2 session of a is refused, and told why.
    match connect(&p, "a", SECRET_A) {
        Err(ArenaError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, target_rdma::proto::Status::VersionMismatch);
            assert!(
                message.contains("volume \"a\" is confidential")
                    && message.contains("protocol version 3"),
                "{message}"
            );
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a version-2 session of a confidential volume"),
    }
    let seen = until(&lines, arenad_events::HELLO_REFUSED);
    assert!(
        seen.last()
            .unwrap()
            .contains("\"status\":\"version_mismatch\""),
        "{seen:#?}"
    );
    // The open one goes on; a sealed one is served; b is unchanged.
    block_on(open.write(2, 0, &pattern(2, 1, BLOB))).unwrap();
    let sealed = connect_sealed(&p, "a", SECRET_A);
    let mut out = vec![0; BLOB];
    block_on(sealed.read_found(2, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(2, 1, BLOB));
    block_on(open.read_found(1, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(1, 1, BLOB));
    connect(&p, "b", SECRET_B).expect("b still takes version 2");

    // Turned off again, version 2 opens a again.
    std::fs::write(&p.cfg, &original).unwrap();
    let seen = hup(&mut proc, &lines, events::CONFIG_RELOADED);
    assert!(
        has(
            &seen,
            arenad_events::VOLUME_CONFIDENTIAL_CHANGED,
            "\"confidential\":false"
        ),
        "{seen:#?}"
    );
    assert!(!listed_confidential(&p, "a"));
    let again = connect(&p, "a", SECRET_A).expect("a takes version 2 again");
    block_on(again.read_found(2, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(2, 1, BLOB));
    drop((open, sealed, again));
}
