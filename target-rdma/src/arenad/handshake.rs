//! The handshake (CHALLENGE, HELLO, WELCOME) of a new connection, under
//! one absolute deadline: a client sending a byte at a time cannot stretch
//! it. Until it succeeds a connection is a socket and a small task, with
//! nothing read but the bounded HELLO.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::info;

use crate::arenad::admission::Counted;
use crate::arenad::epochs::VolumeEpoch;
use crate::arenad::events;
use crate::arenad::fatal::Fatal;
use crate::arenad::frames::truncated;
use crate::arenad::served::ServedVolume;
use crate::arenad::shared::Shared;
use crate::auth::{self, SessionKeys};
use crate::proto::{
    Challenge, FrameError, Header, Hello, Status, Welcome, CAP_COLD_GET, CAP_RAILS, CAP_RDMA,
    CAP_RDMA_LEASE_KEYS, CAP_TCP_DATA, HANDSHAKE_VERSION, HEADER_LEN, MAC_LEN, MAX_HELLO_BODY,
    MAX_INLINE, VERSION, VERSION_1, VERSION_2, VERSION_3,
};
use crate::rdma::Isolation;
use crate::store::HolderId;

/// What a session is bound to once its HELLO is accepted.
pub(super) struct Session {
    pub(super) vol: Arc<ServedVolume>,
    /// The volume's epoch.
    pub(super) fence: Arc<VolumeEpoch>,
    pub(super) granted: bool,
    /// Granted `CAP_RDMA` by a server isolating RDMA per lease, and
    /// offered `CAP_RDMA_LEASE_KEYS`.
    pub(super) lease_keys: bool,
    /// Granted `CAP_RDMA` and offered `CAP_RAILS`.
    pub(super) per_rail: bool,
    pub(super) version: u8,
    pub(super) keys: Option<SessionKeys>,
    /// The writer's membership epoch.
    pub(super) epoch: u64,
}

/// Runs the handshake within the handshake deadline; returns what the
/// session is bound to.
pub(super) async fn handshake(
    shared: &Shared,
    id: HolderId,
    stream: &mut TcpStream,
    handshaking: Counted,
) -> Result<Session, Fatal> {
    let until = Instant::now() + shared.limits.handshake_timeout;
    match tokio::time::timeout_at(
        until.into(),
        handshake_steps(shared, id, stream, handshaking),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => Err(Fatal::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            "handshake deadline passed",
        ))),
    }
}

async fn handshake_steps(
    shared: &Shared,
    id: HolderId,
    stream: &mut TcpStream,
    handshaking: Counted,
) -> Result<Session, Fatal> {
    let min_version = if shared.limits.allow_v1 {
        VERSION_1
    } else {
        VERSION_2
    };
    let ch = Challenge {
        min_version: u16::from(min_version),
        max_version: u16::from(VERSION),
        server_nonce: auth::nonce(),
        max_inflight: shared.limits.max_inflight,
        max_inline: shared.store.blob_bytes().min(MAX_INLINE),
    };
    let mut frame = Vec::new();
    ch.encode(&mut frame);
    // A connection closed before its first byte is a probe (a health
    // check, a port scan), not a protocol error: the CHALLENGE may meet
    // a reset, or the first read an end of stream.
    let gone = |e: &io::Error| {
        matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
        )
    };
    match stream.write_all(&frame).await {
        Err(e) if gone(&e) => return Err(Fatal::Probe),
        r => r?,
    }
    let mut hb = [0u8; HEADER_LEN];
    match stream.read(&mut hb[..1]).await {
        Ok(0) => return Err(Fatal::Probe),
        Ok(_) => {}
        Err(e) if gone(&e) => return Err(Fatal::Probe),
        Err(e) => return Err(Fatal::Io(e)),
    }
    stream.read_exact(&mut hb[1..]).await.map_err(truncated)?;
    let h = Header::decode(&hb)?;
    h.expect_version(HANDSHAKE_VERSION)?;
    if h.body_len > MAX_HELLO_BODY {
        return Err(Fatal::Frame(FrameError::TooLong {
            what: "HELLO body",
            len: h.body_len.into(),
            max: MAX_HELLO_BODY.into(),
        }));
    }
    let mut body = vec![0u8; h.body_len as usize];
    stream.read_exact(&mut body).await.map_err(truncated)?;
    let chosen = Hello::version_of(&h, &body)?;
    if !(ch.min_version..=ch.max_version).contains(&chosen) {
        return Err(Fatal::Hello(
            Status::VersionMismatch,
            format!(
                "client chose version {chosen}, server speaks {}..={}",
                ch.min_version, ch.max_version
            ),
        ));
    }
    let hello = Hello::decode(&h, &body)?;
    // An unknown volume and a wrong secret look the same to the client,
    // so a scan cannot discover volume names.
    let volumes = Arc::clone(&shared.volumes.read());
    let vol = volumes
        .iter()
        .find(|v| v.name == hello.volume)
        .ok_or(Fatal::Auth("unknown volume"))?;
    if !vol.secret.verify_hello(&ch, &hello) {
        return Err(Fatal::Auth("bad mac"));
    }
    // Authenticated: the place goes back before the WELCOME, so a
    // client that connects again once it has it finds the place free.
    drop(handshaking);
    // Only now, past the MAC: a client without the secret must not learn
    // that the volume exists, nor that it is confidential.
    if vol.confidential && hello.version < u16::from(VERSION_3) {
        return Err(Fatal::Hello(
            Status::VersionMismatch,
            format!(
                "volume {:?} is confidential: it takes only sealed sessions (protocol version 3), \
                 not version {}",
                vol.name, hello.version
            ),
        ));
    }
    let blob = shared.store.blob_bytes();
    if hello.blob_bytes != 0 && hello.blob_bytes != blob {
        return Err(Fatal::Hello(
            Status::Protocol,
            format!(
                "blob size mismatch: client expects {}, volume uses {blob}",
                hello.blob_bytes
            ),
        ));
    }
    let version = hello.version as u8;
    let fence = shared.fencing.epochs.volume(&vol.name);
    if version < VERSION_2 && fence.current() > 0 {
        return Err(Fatal::Hello(
            Status::VersionMismatch,
            format!(
                "volume {:?} has a membership epoch: it needs protocol version 2",
                vol.name
            ),
        ));
    }
    let epoch = shared
        .fencing
        .raise_epoch(&shared.pool, &fence, hello.epoch)
        .await?;
    let rdma = hello.caps & CAP_RDMA != 0;
    let isolation = shared.rdma.isolation();
    // One-sided RDMA would move a sealed session's payloads around the
    // seal, in the clear: such a session keeps them on its stream.
    let declined = if version >= VERSION_3 {
        Some("a sealed session (protocol version 3) moves its payloads on its stream only")
    } else if isolation.is_none() {
        Some("no RDMA device on this peer")
    } else {
        None
    };
    if let (true, Some(reason)) = (rdma, declined) {
        info!(event = events::RDMA_DECLINED, conn = id, reason);
    }
    let granted = rdma && declined.is_none();
    let isolated = isolation == Some(Isolation::Lease);
    let mut welcome = Welcome {
        session_id: id,
        generation: shared.store.generation(),
        blob_bytes: blob,
        caps: hello.caps
            & (CAP_COLD_GET
                | if granted && isolated {
                    CAP_TCP_DATA | CAP_RDMA | CAP_RDMA_LEASE_KEYS | CAP_RAILS
                } else if granted {
                    CAP_TCP_DATA | CAP_RDMA | CAP_RAILS
                } else {
                    CAP_TCP_DATA
                }),
        quota_blobs: vol.quota_blobs,
        epoch,
        mac: [0; MAC_LEN],
    };
    welcome.mac = vol.secret.sign_welcome(&ch, &hello, &welcome);
    welcome.encode(&mut frame, hello.version);
    stream.write_all(&frame).await?;
    info!(event = ublk_metrics::events::SESSION_OPENED, conn = id, volume = %vol.name, generation = welcome.generation, rdma = granted, version, epoch = hello.epoch);
    Ok(Session {
        vol: Arc::clone(vol),
        fence,
        granted,
        lease_keys: granted && isolated && hello.caps & CAP_RDMA_LEASE_KEYS != 0,
        per_rail: granted && hello.caps & CAP_RAILS != 0,
        version,
        keys: (version >= VERSION_2).then(|| vol.secret.session_keys(&ch, &hello)),
        epoch: hello.epoch,
    })
}
