//! A peer that speaks the protocol and does nothing else: the real
//! version-2 handshake (challenge, HELLO MAC check, signed WELCOME, session
//! keys), then every WRITE answered OK and every READ answered with zeros,
//! each frame's tag checked and each answer tagged, with no store behind
//! it. Measured against a raw socket ping-pong of the same bytes it gives
//! the cost of the client's path alone (`cargo bench --bench arena`,
//! `BENCH_ONLY=rtt`); any other request is refused with `INTERNAL`.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;

use crate::auth::{self, FrameKey, Secret, TagKey};
use crate::proto::{
    self, Challenge, Hello, Opcode, Request, Status, Welcome, CAP_TCP_DATA, HANDSHAKE_VERSION,
    MAC_LEN, TAG_LEN, VERSION_2,
};

/// The echo peer's listener; one thread per connection, until the process
/// ends (a benchmark's lifetime).
pub struct EchoPeer {
    /// Where it listens (loopback).
    pub addr: SocketAddr,
}

impl EchoPeer {
    /// Serves `volume` with `secret` and blobs of `blob_bytes` on a fresh
    /// loopback port.
    pub fn start(volume: &str, secret: Secret, blob_bytes: u32) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let addr = l.local_addr().expect("listener address");
        let volume = volume.to_owned();
        thread::spawn(move || {
            for (id, s) in l.incoming().enumerate() {
                let Ok(s) = s else { continue };
                let (volume, secret) = (volume.clone(), secret.clone());
                thread::spawn(move || {
                    let _ = serve(s, id as u64 + 1, &volume, &secret, blob_bytes);
                });
            }
        });
        Self { addr }
    }
}

fn refuse(detail: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, detail.to_owned())
}

fn serve(
    mut s: TcpStream,
    session_id: u64,
    volume: &str,
    secret: &Secret,
    blob_bytes: u32,
) -> io::Result<()> {
    s.set_nodelay(true)?;
    let ch = Challenge {
        min_version: u16::from(VERSION_2),
        max_version: u16::from(VERSION_2),
        server_nonce: auth::nonce(),
        max_inflight: 64,
        max_inline: blob_bytes,
    };
    let mut frame = Vec::new();
    ch.encode(&mut frame);
    proto::write_vectored_all(&mut s, &[&frame])?;
    let mut body = Vec::new();
    let h = proto::read_frame(&mut s, &mut body)
        .map_err(|e| refuse(&e.to_string()))?
        .ok_or_else(|| refuse("closed before HELLO"))?;
    h.expect_version(HANDSHAKE_VERSION)
        .map_err(|e| refuse(&e.to_string()))?;
    let hello = Hello::decode(&h, &body).map_err(|e| refuse(&e.to_string()))?;
    if hello.volume != volume || !secret.verify_hello(&ch, &hello) {
        return Err(refuse("bad HELLO"));
    }
    let mut welcome = Welcome {
        session_id,
        generation: 1,
        blob_bytes,
        caps: CAP_TCP_DATA,
        quota_blobs: u64::MAX,
        epoch: hello.epoch,
        mac: [0; MAC_LEN],
    };
    welcome.mac = secret.sign_welcome(&ch, &hello, &welcome);
    frame.clear();
    welcome.encode(&mut frame, hello.version);
    proto::write_vectored_all(&mut s, &[&frame])?;
    let keys = secret.session_keys(&ch, &hello);
    let (FrameKey::Tag(check), FrameKey::Tag(sign)) =
        (keys.client_to_server, keys.server_to_client)
    else {
        return Err(refuse("the echo peer speaks version 2 only"));
    };
    let zeros = vec![0u8; blob_bytes as usize];
    let (mut got, mut sent) = (0u64, 0u64);
    while let Some(h) = proto::read_frame(&mut s, &mut body).map_err(|e| refuse(&e.to_string()))? {
        h.expect_version(VERSION_2)
            .map_err(|e| refuse(&e.to_string()))?;
        let mut tag = [0u8; TAG_LEN];
        s.read_exact(&mut tag)?;
        let hb = h.encode();
        if !check.verify(got, &hb, &auth::body_digest(&[&body]), &tag) {
            return Err(refuse("bad tag"));
        }
        got += 1;
        frame.clear();
        let payload: &[u8] = match proto::decode_request(&h, &body) {
            Ok(Request::Write { .. }) => {
                proto::encode_ok(&mut frame, Opcode::Write, h.request_id);
                &[]
            }
            Ok(Request::Read { len, .. }) if len <= blob_bytes => {
                proto::encode_read_head(&mut frame, h.request_id, len);
                &zeros[..len as usize]
            }
            _ => {
                proto::encode_error(
                    &mut frame,
                    h.opcode,
                    h.request_id,
                    Status::Internal,
                    "the echo peer serves only READ and WRITE",
                );
                &[]
            }
        };
        send(&mut s, &sign, &mut sent, &mut frame, payload)?;
    }
    Ok(())
}

/// Sends one answer: its head, payload and tag in one vectored write.
fn send(
    s: &mut TcpStream,
    key: &TagKey,
    seq: &mut u64,
    head: &mut [u8],
    payload: &[u8],
) -> io::Result<()> {
    head[4] = VERSION_2;
    let header: &[u8; proto::HEADER_LEN] = head[..proto::HEADER_LEN].try_into().expect("a header");
    let tag = key.tag(
        *seq,
        header,
        &auth::body_digest(&[&head[proto::HEADER_LEN..], payload]),
    );
    *seq += 1;
    proto::write_vectored_all(s, &[head, payload, &tag])
}
