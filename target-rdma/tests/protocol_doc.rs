//! docs/PROTOCOL.md is what an independent client is written from, so it
//! must say what the code does: its list of protocol-error classes is the
//! code's (and docs/METRICS.md's lists are too), and its worked examples
//! (a HELLO MAC, the frame keys and a frame's tag, an `epochs` file) are
//! recomputed here from the document's formulas with the primitives alone,
//! checked against the code, and found in the document.

use std::collections::BTreeSet;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use target_rdma::arenad::epochs::{Epochs, EPOCHS_FILE};
use target_rdma::auth::{self, Secret};
use target_rdma::proto::{
    self, Challenge, Hello, Request, Welcome, CAP_TCP_DATA, HEADER_LEN, MAC_LEN, VERSION_2,
};
use ublk_metrics::ProtocolErrorClass;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn code_classes() -> BTreeSet<String> {
    ProtocolErrorClass::ALL
        .iter()
        .map(|c| c.as_str().to_owned())
        .collect()
}

/// The backticked first cells of the rows of the first table after the
/// line `heading`.
fn first_column(doc: &str, heading: &str) -> BTreeSet<String> {
    let rest = doc
        .split_once(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no heading {heading:?}"))
        .1;
    rest.lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|row| {
            let cell = row.split('|').nth(1).unwrap_or_default().trim();
            cell.strip_prefix('`')
                .and_then(|c| c.strip_suffix('`'))
                .unwrap_or_else(|| panic!("{heading}: first cell {cell:?} is not `code`"))
                .to_owned()
        })
        .collect()
}

/// Every list of three or more `code` spans separated by ", " in `line`.
fn backticked_lists(line: &str) -> Vec<BTreeSet<String>> {
    let parts: Vec<&str> = line.split('`').collect();
    let mut lists = Vec::new();
    let mut run = BTreeSet::new();
    for i in (1..parts.len()).step_by(2) {
        run.insert(parts[i].to_owned());
        if parts.get(i + 1) != Some(&", ") {
            let list = std::mem::take(&mut run);
            if list.len() >= 3 {
                lists.push(list);
            }
        }
    }
    lists
}

#[test]
fn the_documented_protocol_error_classes_are_the_codes() {
    let code = code_classes();
    let doc = read("docs/PROTOCOL.md");
    assert_eq!(
        first_column(&doc, "### Protocol error classes"),
        code,
        "docs/PROTOCOL.md, *Protocol error classes*, against ProtocolErrorClass"
    );
    // Every class="..." the document names is one of them.
    for (i, _) in doc.match_indices("class=\"") {
        let value = doc[i + 7..].split('"').next().unwrap_or_default();
        assert!(
            code.contains(value),
            "docs/PROTOCOL.md names class=\"{value}\", which is not exported"
        );
    }
    let metrics = read("docs/METRICS.md");
    for family in [
        "arenad_protocol_errors_total",
        "ublk_driver_frame_errors_total",
    ] {
        let row = metrics
            .lines()
            .find(|l| l.starts_with(&format!("| `{family}`")))
            .unwrap_or_else(|| panic!("docs/METRICS.md has no row for {family}"));
        assert!(
            backticked_lists(row).contains(&code),
            "docs/METRICS.md's {family} row does not list the classes {code:?}: {row}"
        );
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn spaced_hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `x` prefixed by its length as a little-endian `u32`.
fn lp(x: &[u8]) -> Vec<u8> {
    [&(x.len() as u32).to_le_bytes()[..], x].concat()
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut m = Hmac::<Sha256>::new_from_slice(key).unwrap();
    m.update(msg);
    m.finalize().into_bytes().into()
}

/// The worked example of docs/PROTOCOL.md, *Worked example*.
const SECRET: &[u8] = b"correct horse battery staple";
const SERVER_NONCE: [u8; 32] = [0x11; 32];
const CLIENT_NONCE: [u8; 32] = [0x22; 32];
const VOLUME: &str = "vm1";

#[test]
fn the_worked_example_is_what_the_code_computes_and_the_document_quotes() {
    let secret = Secret::new(SECRET.to_vec()).unwrap();
    let ch = Challenge {
        min_version: 2,
        max_version: 2,
        server_nonce: SERVER_NONCE,
        max_inflight: 128,
        max_inline: 1 << 20,
    };
    let hello = Hello {
        version: u16::from(VERSION_2),
        caps: CAP_TCP_DATA,
        blob_bytes: 0,
        epoch: 5,
        client_nonce: CLIENT_NONCE,
        mac: [0; MAC_LEN],
        volume: VOLUME.into(),
    };
    let transcript = [
        &b"arena-v2 client"[..],
        &lp(&2u16.to_le_bytes()),
        &lp(&2u16.to_le_bytes()),
        &lp(&128u32.to_le_bytes()),
        &lp(&(1u32 << 20).to_le_bytes()),
        &lp(&2u16.to_le_bytes()),
        &lp(&CAP_TCP_DATA.to_le_bytes()),
        &lp(&0u32.to_le_bytes()),
        &lp(&5u64.to_le_bytes()),
        &lp(&SERVER_NONCE),
        &lp(&CLIENT_NONCE),
        &lp(VOLUME.as_bytes()),
    ]
    .concat();
    let hello_mac = hmac_sha256(SECRET, &transcript);
    assert_eq!(hello_mac, secret.sign_hello(&ch, &hello));

    let welcome = Welcome {
        session_id: 9,
        generation: 3,
        blob_bytes: 1 << 20,
        caps: CAP_TCP_DATA,
        quota_blobs: 1000,
        epoch: 5,
        mac: [0; MAC_LEN],
    };
    let server_transcript = [
        &b"arena-v2 server"[..],
        &lp(&9u64.to_le_bytes()),
        &lp(&3u64.to_le_bytes()),
        &lp(&(1u32 << 20).to_le_bytes()),
        &lp(&CAP_TCP_DATA.to_le_bytes()),
        &lp(&1000u64.to_le_bytes()),
        &lp(&5u64.to_le_bytes()),
        &lp(&5u64.to_le_bytes()),
        &lp(&SERVER_NONCE),
        &lp(&CLIENT_NONCE),
        &lp(VOLUME.as_bytes()),
    ]
    .concat();
    let welcome_mac = hmac_sha256(SECRET, &server_transcript);
    assert_eq!(welcome_mac, secret.sign_welcome(&ch, &hello, &welcome));

    let key = |label: &[u8]| {
        let msg = [
            label,
            &lp(&SERVER_NONCE),
            &lp(&CLIENT_NONCE),
            &lp(VOLUME.as_bytes()),
        ]
        .concat();
        hmac_sha256(SECRET, &msg)
    };
    let k_c2s = key(b"arena-v2 frames client->server");
    let k_s2c = key(b"arena-v2 frames server->client");

    // The client's first frame after the HELLO answer: ALLOC of key 7 as
    // request 1, frame number 0 of its direction.
    let mut frame = Vec::new();
    proto::encode_request(&mut frame, 1, &Request::Alloc { key: 7 });
    frame[4] = VERSION_2;
    let header: [u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().unwrap();
    let body = &frame[HEADER_LEN..];
    let digest = *blake3::hash(body).as_bytes();
    let input = [
        &b"arena-v2 frame"[..],
        &0u64.to_le_bytes(),
        &header,
        &digest,
    ]
    .concat();
    assert_eq!(input.len(), 78);
    let tag: [u8; 16] = blake3::keyed_hash(&k_c2s, &input).as_bytes()[..16]
        .try_into()
        .unwrap();
    let keys = secret.session_keys(&ch, &hello);
    assert_eq!(
        tag,
        keys.client_to_server
            .protect(0, &header, &mut body.to_vec())
    );
    assert_eq!(digest, auth::body_digest(&[body]));
    // The server's first frame back (its ALLOC answer would do; an empty
    // FLUSH answer to request 2 shows the empty body's digest).
    let mut answer = Vec::new();
    proto::encode_ok(&mut answer, proto::Opcode::Flush, 2);
    answer[4] = VERSION_2;
    let answer_header: [u8; HEADER_LEN] = answer[..HEADER_LEN].try_into().unwrap();
    let empty = *blake3::hash(b"").as_bytes();
    let answer_input = [
        &b"arena-v2 frame"[..],
        &0u64.to_le_bytes(),
        &answer_header,
        &empty,
    ]
    .concat();
    let answer_tag: [u8; 16] = blake3::keyed_hash(&k_s2c, &answer_input).as_bytes()[..16]
        .try_into()
        .unwrap();
    assert_eq!(
        answer_tag,
        keys.server_to_client.protect(0, &answer_header, &mut [])
    );

    // Version 3: the same nonces and volume under the version-3 labels,
    // and the same ALLOC (version byte 3) sealed with AES-256-GCM, the
    // header as associated data, the nonce `seq` (8 bytes LE) and 4 zeros.
    let k3_c2s = key(b"arena-v3 frames client->server");
    let k3_s2c = key(b"arena-v3 frames server->client");
    let mut frame3 = frame.clone();
    frame3[4] = proto::VERSION_3;
    let header3: [u8; HEADER_LEN] = frame3[..HEADER_LEN].try_into().unwrap();
    let seal = |k: &[u8; 32], seq: u64, header: &[u8; HEADER_LEN], body: &[u8]| {
        let key = ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, k).unwrap(),
        );
        let mut nonce = [0u8; 12];
        nonce[..8].copy_from_slice(&seq.to_le_bytes());
        let mut sealed = body.to_vec();
        let tag = key
            .seal_in_place_separate_tag(
                ring::aead::Nonce::assume_unique_for_key(nonce),
                ring::aead::Aad::from(header),
                &mut sealed,
            )
            .unwrap();
        (sealed, tag.as_ref().to_vec())
    };
    let (sealed3, tag3) = seal(&k3_c2s, 0, &header3, &frame3[HEADER_LEN..]);
    let hello3 = Hello {
        version: u16::from(proto::VERSION_3),
        ..hello.clone()
    };
    let keys3 = secret.session_keys(&ch, &hello3);
    let mut ours = frame3[HEADER_LEN..].to_vec();
    assert_eq!(
        tag3,
        keys3
            .client_to_server
            .protect(0, &header3, &mut ours)
            .to_vec()
    );
    assert_eq!(ours, sealed3);
    let mut answer3 = answer.clone();
    answer3[4] = proto::VERSION_3;
    let answer_header3: [u8; HEADER_LEN] = answer3[..HEADER_LEN].try_into().unwrap();
    let (_, answer_tag3) = seal(&k3_s2c, 0, &answer_header3, &[]);
    assert_eq!(
        answer_tag3,
        keys3
            .server_to_client
            .protect(0, &answer_header3, &mut [])
            .to_vec()
    );

    let doc = read("docs/PROTOCOL.md");
    let missing = [
        (
            "transcript's length",
            format!("MAC transcript is {} bytes", transcript.len()),
        ),
        ("HELLO mac", hex(&hello_mac)),
        ("HELLO answer mac", hex(&welcome_mac)),
        ("K_c2s", hex(&k_c2s)),
        ("K_s2c", hex(&k_s2c)),
        ("ALLOC header", spaced_hex(&header)),
        ("ALLOC body", spaced_hex(body)),
        ("BLAKE3 of the ALLOC body", hex(&digest)),
        ("ALLOC tag", hex(&tag)),
        ("FLUSH answer header", spaced_hex(&answer_header)),
        ("BLAKE3 of an empty body", hex(&empty)),
        ("FLUSH answer tag", hex(&answer_tag)),
        ("version-3 K_c2s", hex(&k3_c2s)),
        ("version-3 K_s2c", hex(&k3_s2c)),
        ("version-3 ALLOC header", spaced_hex(&header3)),
        ("sealed ALLOC body", spaced_hex(&sealed3)),
        ("sealed ALLOC tag", hex(&tag3)),
        ("version-3 FLUSH answer tag", hex(&answer_tag3)),
    ]
    .into_iter()
    .filter(|(_, value)| !doc.contains(value))
    .map(|(what, value)| format!("{what}: {value}"))
    .collect::<Vec<_>>();
    assert!(
        missing.is_empty(),
        "docs/PROTOCOL.md does not quote these values of its worked example:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_documented_epochs_file_is_one_arenad_reads() {
    let doc = read("docs/PROTOCOL.md");
    let block = doc
        .split("```\n")
        .find(|b| b.starts_with("arenad-epochs 1\n"))
        .expect("docs/PROTOCOL.md shows an epochs file");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(EPOCHS_FILE), block).unwrap();
    let epochs = Epochs::open(dir.path()).unwrap_or_else(|e| panic!("{e}\n{block}"));
    for line in block.lines().skip(1) {
        let Some((epoch, volume)) = line.split_once(' ') else {
            continue;
        };
        if epoch == "crc32c" {
            continue;
        }
        assert_eq!(epochs.volume(volume).current().to_string(), epoch, "{line}");
    }
}
