//! The fuzz corpus as a test: every input under `fuzz/corpus/<target>/`
//! (the seeds, real encodings) and `fuzz/regressions/<target>/` (inputs
//! the fuzzer found crashing, minimized) is fed to the entry point the
//! fuzz target `<target>` calls, so a crash once found stays fixed with a
//! plain `cargo test` and no nightly toolchain. Failures are listed by
//! target and file, all of them, not only the first.
//!
//! `cargo test -p target-rdma --test fuzz_corpus -- --ignored` writes the
//! seeds again from the real encoders (after a format change).

use std::cell::RefCell;
use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use target_rdma::arenad::epochs::{Epochs, EPOCHS_FILE};
use target_rdma::fuzzing::{self, TARGETS};
use target_rdma::proto::{
    self, Challenge, Endpoint, Hello, Lease, Opcode, RailAccept, Request, Status, Welcome, MAC_LEN,
    NONCE_LEN, VERSION_1, VERSION_2, VERSION_3,
};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files of `fuzz/<kind>/<target>`, sorted; none when it is missing.
fn files(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join(kind).join(target);
    let mut out: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(rd) => rd.map(|e| e.expect("a corpus entry").path()).collect(),
        Err(_) => Vec::new(),
    };
    out.retain(|p| p.is_file());
    out.sort();
    out
}

thread_local! {
    /// Where the last panic on this thread happened, for the report.
    static PANICKED_AT: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Runs `f`; where and why it panicked, if it did. The panic hook (set
/// by the test) records the location, which the payload does not carry.
fn panic_of(f: impl FnOnce()) -> Option<String> {
    let payload = catch_unwind(AssertUnwindSafe(f)).err()?;
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".into());
    Some(format!("{}: {msg}", PANICKED_AT.with(|p| p.take())))
}

#[test]
fn every_corpus_and_regression_input_decodes_without_a_panic() {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Some(l) = info.location() {
            PANICKED_AT.with(|p| *p.borrow_mut() = format!("{}:{}", l.file(), l.line()));
        }
        hook(info);
    }));
    let mut failures = Vec::new();
    let mut inputs = 0;
    for target in TARGETS {
        let seeds = files("corpus", target);
        assert!(
            !seeds.is_empty(),
            "fuzz/corpus/{target} has no seed: run this test's generator (--ignored)"
        );
        for path in seeds.iter().chain(&files("regressions", target)) {
            inputs += 1;
            let bytes = fs::read(path).unwrap();
            let scratch = tempfile::tempdir().unwrap();
            if let Some(why) = panic_of(|| fuzzing::run(target, scratch.path(), &bytes)) {
                let rel = path.strip_prefix(fuzz_dir()).unwrap_or(path);
                failures.push(format!("{}: {why}", rel.display()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {inputs} fuzz inputs panicked:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The `shipped` config seeds are the example configs as shipped now, so
/// a key added to one reaches the fuzzer.
#[test]
fn the_shipped_config_seeds_are_the_shipped_configs() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for (target, shipped) in [
        ("arenad_config", "systemd/arenad.toml"),
        ("ublkd_config", "systemd/ublkd.toml"),
    ] {
        let seed = fuzz_dir().join("corpus").join(target).join("seed-shipped");
        assert!(
            fs::read(&seed).unwrap() == fs::read(repo.join(shipped)).unwrap(),
            "fuzz/corpus/{target}/seed-shipped is not {shipped}: run this test's generator (--ignored)"
        );
    }
}

/// Replaces the `seed-*` files of `fuzz/corpus/<target>` by `seeds`.
fn write_seeds(target: &str, seeds: &[(&str, Vec<u8>)]) {
    let dir = fuzz_dir().join("corpus").join(target);
    fs::create_dir_all(&dir).unwrap();
    for old in files("corpus", target) {
        if old
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("seed-")
        {
            fs::remove_file(old).unwrap();
        }
    }
    for (name, bytes) in seeds {
        fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
    }
}

fn frame(encode: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    encode(&mut out);
    out
}

fn hello(version: u8) -> Hello {
    Hello {
        version: version.into(),
        caps: proto::CAP_TCP_DATA | proto::CAP_RDMA,
        blob_bytes: 1 << 20,
        epoch: if version >= VERSION_2 { 3 } else { 0 },
        client_nonce: [5; NONCE_LEN],
        mac: [6; MAC_LEN],
        volume: "vm1.disk-0".into(),
    }
}

fn frame_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let ep = Endpoint {
        qpn: 0x12,
        psn: 0x345,
        lid: 0,
        mtu: 5,
        gid: [9; 16],
    };
    let requests = [
        ("alloc", Request::Alloc { key: 7 }),
        ("commit", Request::Commit { key: 7, token: 9 }),
        ("get", Request::Get { key: 7 }),
        (
            "release",
            Request::Release {
                tokens: vec![1, 2, 3],
            },
        ),
        ("remove", Request::Remove { start: 4, end: 90 }),
        ("flush", Request::Flush),
        (
            "write",
            Request::Write {
                key: 7,
                offset: 512,
                data: b"sixteen bytes!!!",
            },
        ),
        (
            "read",
            Request::Read {
                key: 7,
                offset: 0,
                len: 4096,
            },
        ),
        (
            "rail-connect",
            Request::RailConnect {
                endpoint: ep,
                rail: None,
            },
        ),
        (
            "rail-connect-rail",
            Request::RailConnect {
                endpoint: ep,
                rail: Some(1),
            },
        ),
        ("epoch", Request::Epoch { epoch: 12 }),
    ];
    let mut seeds: Vec<(&str, Vec<u8>)> = requests
        .iter()
        .map(|(name, req)| (*name, frame(|o| proto::encode_request(o, 41, req))))
        .collect();
    let ch = Challenge {
        min_version: VERSION_1.into(),
        max_version: VERSION_2.into(),
        server_nonce: [4; NONCE_LEN],
        max_inflight: 64,
        max_inline: 1 << 20,
    };
    let welcome = Welcome {
        session_id: 1,
        generation: 2,
        blob_bytes: 1 << 20,
        caps: proto::CAP_TCP_DATA,
        quota_blobs: 1000,
        epoch: 3,
        mac: [8; MAC_LEN],
    };
    let lease = |rkeys| Lease {
        slot_offset: 1 << 20,
        token: 77,
        rkeys,
    };
    let accept = RailAccept {
        endpoint: ep,
        arena_base: 0x7f00_0000_0000,
        arena_len: 64 << 20,
        rkey: 0x1234,
    };
    seeds.extend([
        ("challenge", frame(|o| ch.encode(o))),
        ("welcome-v1", frame(|o| welcome.encode(o, VERSION_1.into()))),
        ("welcome-v2", frame(|o| welcome.encode(o, VERSION_2.into()))),
        ("rail-accept", frame(|o| accept.encode(o, 41))),
        (
            "lease",
            frame(|o| proto::encode_lease(o, Opcode::Alloc, 41, lease([None, None]), false)),
        ),
        (
            "lease-rkey",
            frame(|o| proto::encode_lease(o, Opcode::Get, 41, lease([Some(5), None]), false)),
        ),
        (
            "lease-rail-keys",
            frame(|o| proto::encode_lease(o, Opcode::Get, 41, lease([None, Some(6)]), true)),
        ),
        (
            "count",
            frame(|o| proto::encode_count(o, Opcode::Remove, 41, 86)),
        ),
        ("revoke", frame(|o| proto::encode_revoke(o, 7, 77))),
        (
            "error",
            frame(|o| proto::encode_error(o, Opcode::Write, 41, Status::NoSpace, "quota reached")),
        ),
        ("ok", frame(|o| proto::encode_ok(o, Opcode::Commit, 41))),
    ]);
    // A session's stream: several frames back to back, version 2.
    let mut stream = Vec::new();
    for (_, f) in &seeds[..6] {
        let mut f = f.clone();
        f[4] = VERSION_2;
        stream.extend(f);
    }
    seeds.push(("stream-v2", stream));
    seeds
}

/// Writes the committed seed corpus from the real encoders.
#[test]
#[ignore = "writes fuzz/corpus; run after a format change"]
fn write_the_seed_corpus() {
    write_seeds("frames", &frame_seeds());
    write_seeds(
        "hello",
        &[
            ("v1", frame(|o| hello(VERSION_1).encode(o))),
            ("v2", frame(|o| hello(VERSION_2).encode(o))),
            ("v3", frame(|o| hello(VERSION_3).encode(o))),
        ],
    );

    // The store's files, each from an input its round trip reads as values.
    let store_seeds = |round_trip: fn(&Path, &[u8]) -> Vec<u8>, inputs: &[&[u8]]| {
        inputs
            .iter()
            .enumerate()
            .map(|(i, input)| {
                let scratch = tempfile::tempdir().unwrap();
                (
                    ["empty", "small", "full"][i],
                    round_trip(scratch.path(), input),
                )
            })
            .collect::<Vec<_>>()
    };
    let pattern: Vec<u8> = (0..600u32).map(|i| (i * 37 % 251) as u8).collect();
    let inputs: [&[u8]; 3] = [&[], &pattern[..80], &pattern];
    write_seeds(
        "checkpoint",
        &store_seeds(fuzzing::checkpoint_round_trip, &inputs),
    );
    write_seeds(
        "journal",
        &store_seeds(fuzzing::journal_round_trip, &inputs),
    );
    write_seeds(
        "extent_table",
        &store_seeds(fuzzing::extent_table_round_trip, &inputs),
    );

    let scratch = tempfile::tempdir().unwrap();
    let epochs = Epochs::open(scratch.path()).unwrap();
    let file = || fs::read(scratch.path().join(EPOCHS_FILE)).unwrap();
    let raise = |volume: &str, epoch| {
        epochs.raise(&epochs.volume(volume), epoch, || {}).unwrap();
    };
    raise("vm1", 4);
    let mut epoch_seeds = vec![("one", file())];
    raise("b.disk-2", 17);
    raise("c_", 1);
    epoch_seeds.push(("three", file()));
    raise("vm1", proto::MAX_EPOCH);
    epoch_seeds.push(("max", file()));
    // Format 1: what an operator writes by hand.
    let body = "arenad-epochs 1\n7 vm1\n12 vm2\n";
    let format1 = format!("{body}crc32c {:08x}\n", crc32c::crc32c(body.as_bytes()));
    epoch_seeds.push(("format1", format1.into_bytes()));
    write_seeds("epochs", &epoch_seeds);

    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let minimal = "blob_bytes = \"4K\"\narena_bytes = \"64K\"\nswap_bytes = \"1M\"\n\n\
                   [[volume]]\nname = \"a\"\nsecret_file = \"/etc/arenad/a.key\"\nquota = 16\n";
    write_seeds(
        "arenad_config",
        &[
            (
                "shipped",
                fs::read(repo.join("systemd/arenad.toml")).unwrap(),
            ),
            ("minimal", minimal.as_bytes().to_vec()),
        ],
    );
    write_seeds(
        "ublkd_config",
        &[(
            "shipped",
            fs::read(repo.join("systemd/ublkd.toml")).unwrap(),
        )],
    );
}
