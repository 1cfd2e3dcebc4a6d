//! The decoders of untrusted bytes as the fuzz targets (`target-rdma/fuzz`)
//! and the corpus replay test (`tests/fuzz_corpus.rs`) call them, so that
//! every input the fuzzer keeps is replayed by a plain `cargo test`. Each
//! `check_*` takes arbitrary bytes and must not panic; where the format
//! has an encoder, what decodes is encoded again and must decode to the
//! same value. The store's file formats are in [`crate::store::fuzzing`].
//!
//! Not an interface of the crate: hidden, and only those two call it.
#![doc(hidden)]

use std::path::Path;

use serde::Serialize;

use crate::arenad::config::{ArenadConfig, ConfigError};
use crate::arenad::epochs::Epochs;
use crate::auth::Secret;
use crate::proto::{
    self, Challenge, Header, Hello, Opcode, RailAccept, Status, Welcome, FLAG_RESPONSE,
    HANDSHAKE_VERSION, HEADER_LEN, MAX_HELLO_BODY, MAX_INLINE, VERSION,
};
use crate::service::config_file::{flatten, render};
pub use crate::store::fuzzing::{
    check_checkpoint, check_extent_table, check_journal, checkpoint_round_trip,
    extent_table_round_trip, journal_round_trip,
};

/// The fuzz targets of this crate, each named as its corpus directory
/// (`target-rdma/fuzz/corpus/<name>`) and its file in `fuzz_targets/`.
pub const TARGETS: &[&str] = &[
    "frames",
    "hello",
    "checkpoint",
    "journal",
    "extent_table",
    "epochs",
    "arenad_config",
];

/// Runs the target `name` (one of [`TARGETS`]) on `input`; `dir` is an
/// empty directory the file formats are written into, reused from one
/// input to the next.
pub fn run(name: &str, dir: &Path, input: &[u8]) {
    match name {
        "frames" => check_frames(input),
        "hello" => check_hello(input),
        "checkpoint" => {
            check_checkpoint(dir, input);
            checkpoint_round_trip(dir, input);
        }
        "journal" => {
            check_journal(dir, input);
            journal_round_trip(dir, input);
        }
        "extent_table" => {
            check_extent_table(dir, input);
            extent_table_round_trip(dir, input);
        }
        "epochs" => check_epochs(dir, input),
        "arenad_config" => check_arenad_config(input),
        _ => panic!("no fuzz target {name:?}; the targets are {TARGETS:?}"),
    }
}

/// The body `encode` puts after the header, once read back as a frame.
fn reencoded_body(encode: impl FnOnce(&mut Vec<u8>)) -> (Header, Vec<u8>) {
    let mut out = Vec::new();
    encode(&mut out);
    let mut body = Vec::new();
    let h = proto::read_frame(&mut &out[..], &mut body)
        .expect("an encoded frame reads back")
        .expect("an encoded frame is not the end of the stream");
    (h, body)
}

/// Reads frames off the input as a connection would, and decodes each as
/// the side receiving it does: requests as the server (after the
/// handshake), responses as the client.
pub fn check_frames(input: &[u8]) {
    let mut stream = input;
    let mut body = Vec::new();
    while let Ok(Some(h)) = proto::read_frame(&mut stream, &mut body) {
        if h.is_response() {
            check_response(&h, &body);
        } else {
            check_request(&h, &body);
        }
    }
}

fn check_request(h: &Header, body: &[u8]) {
    // The server refuses a body above this bound before reading it; the
    // decoder must not care.
    let _ = proto::max_request_body(h.opcode, MAX_INLINE);
    let Ok(req) = proto::decode_request(h, body) else {
        return;
    };
    let (h2, body2) = reencoded_body(|out| proto::encode_request(out, h.request_id, &req));
    assert_eq!(body2, body, "{:?}: the encoding is not canonical", h.opcode);
    assert_eq!(h2.request_id, h.request_id);
    assert_eq!(proto::decode_request(&h2, &body2).ok(), Some(req));
}

fn check_response(h: &Header, body: &[u8]) {
    if h.status != Status::Ok {
        // Invalid UTF-8 decodes to longer replacement characters, which
        // the encoder's length bound may cut: what comes back is a prefix.
        let msg = proto::decode_error(body);
        let (_, back) =
            reencoded_body(|out| proto::encode_error(out, h.opcode, h.request_id, h.status, &msg));
        let back = proto::decode_error(&back);
        assert!(
            msg.starts_with(&back),
            "{back:?} is not a prefix of {msg:?}"
        );
        return;
    }
    let id = h.request_id;
    match h.opcode {
        Opcode::Challenge => {
            if let Ok(ch) = Challenge::decode(h, body) {
                let (h2, b2) = reencoded_body(|out| ch.encode(out));
                assert_eq!(Challenge::decode(&h2, &b2).ok(), Some(ch));
            }
        }
        Opcode::Hello => {
            for version in [1, u16::from(VERSION)] {
                if let Ok(w) = Welcome::decode(h, body, version) {
                    let (h2, b2) = reencoded_body(|out| w.encode(out, version));
                    assert_eq!(Welcome::decode(&h2, &b2, version).ok(), Some(w));
                }
            }
        }
        Opcode::RailConnect => {
            if let Ok(r) = RailAccept::decode(h, body) {
                let (h2, b2) = reencoded_body(|out| r.encode(out, id));
                assert_eq!(RailAccept::decode(&h2, &b2).ok(), Some(r));
            }
        }
        Opcode::Alloc | Opcode::Get | Opcode::GetResident => {
            if let Ok(lease) = proto::decode_lease(h, body) {
                let per_rail = body.len() == proto::LEASE_PER_RAIL_BODY;
                let (h2, b2) =
                    reencoded_body(|out| proto::encode_lease(out, h.opcode, id, lease, per_rail));
                assert_eq!(proto::decode_lease(&h2, &b2).ok(), Some(lease));
            }
        }
        Opcode::Remove | Opcode::Epoch => {
            if let Ok(n) = proto::decode_count(h, body) {
                let (h2, b2) = reencoded_body(|out| proto::encode_count(out, h.opcode, id, n));
                assert_eq!(proto::decode_count(&h2, &b2).ok(), Some(n));
            }
        }
        Opcode::Revoke => {
            if let Ok((key, token)) = proto::decode_revoke(h, body) {
                let (h2, b2) = reencoded_body(|out| proto::encode_revoke(out, key, token));
                assert_eq!(proto::decode_revoke(&h2, &b2).ok(), Some((key, token)));
            }
        }
        Opcode::Commit | Opcode::Release | Opcode::Flush | Opcode::Write | Opcode::Read => {}
    }
}

/// What the handshake does with the bytes a new connection sends: the
/// header (the handshake version, a bounded body), the HELLO, and its MAC
/// checked against a fixed secret and challenge.
pub fn check_hello(input: &[u8]) {
    let Some((head, body)) = input.split_first_chunk::<HEADER_LEN>() else {
        return;
    };
    let Ok(h) = Header::decode(head) else { return };
    if h.expect_version(HANDSHAKE_VERSION).is_err()
        || h.body_len > MAX_HELLO_BODY
        || body.len() < h.body_len as usize
    {
        return;
    }
    let Ok(hello) = Hello::decode(&h, &body[..h.body_len as usize]) else {
        return;
    };
    let secret = Secret::new(vec![7; 32]).expect("a 32-byte secret");
    let ch = Challenge {
        min_version: 1,
        max_version: u16::from(VERSION),
        server_nonce: [3; proto::NONCE_LEN],
        max_inflight: 1,
        max_inline: 1,
    };
    let signed = Hello {
        mac: secret.sign_hello(&ch, &hello),
        ..hello.clone()
    };
    assert!(secret.verify_hello(&ch, &signed), "a signed HELLO verifies");
    let (h2, b2) = reencoded_body(|out| hello.encode(out));
    assert_eq!(h2.flags & FLAG_RESPONSE, 0);
    assert_eq!(Hello::decode(&h2, &b2).ok(), Some(hello));
}

/// Input: the epochs file. When it loads, a raise must be saved in a file
/// that loads again, whatever names and epochs the input held.
pub fn check_epochs(dir: &Path, input: &[u8]) {
    let path = dir.join(crate::arenad::epochs::EPOCHS_FILE);
    std::fs::write(&path, input).unwrap_or_else(|e| panic!("scratch file {}: {e}", path.display()));
    let Ok(epochs) = Epochs::open(dir) else {
        return;
    };
    let volume = epochs.volume("fuzz");
    let Some(raised) = volume
        .current()
        .checked_add(1)
        .filter(|&e| e <= proto::MAX_EPOCH)
    else {
        return;
    };
    assert_eq!(epochs.raise(&volume, raised, || {}).ok(), Some(raised));
    drop((volume, epochs));
    let again = Epochs::open(dir).expect("a saved epochs file loads");
    assert_eq!(again.volume("fuzz").current(), raised);
}

/// Input: a config file. One that parses and validates must render as
/// text (what `--check` prints) that parses to the same config.
pub fn check_config<T: Serialize>(input: &[u8], parse: impl Fn(&str) -> Result<T, ConfigError>) {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    let Ok(cfg) = parse(text) else { return };
    let rendered = render(&cfg);
    let again = parse(&rendered)
        .unwrap_or_else(|e| panic!("the rendered config does not parse: {e}\n{rendered}"));
    assert_eq!(flatten(&again), flatten(&cfg), "rendered:\n{rendered}");
}

/// `arenad.toml` as arenad reads it: parsed, then validated.
pub fn check_arenad_config(input: &[u8]) {
    check_config(input, |text| {
        let cfg = ArenadConfig::parse(text, Path::new("arenad.toml"))?;
        cfg.validate()?;
        Ok(cfg)
    });
}
