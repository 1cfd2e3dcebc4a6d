//! One live control connection: the handshake that opens it, the table of
//! requests in flight on it, and its sending half (a driven connection's
//! send never blocks the owner's loop: `NoWait`). Its receiving half is
//! `receiver.rs`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, IoSlice, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use parking_lot::Mutex;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{sendmsg, SendAncillaryBuffer, SendFlags};
use tokio::sync::Semaphore;
use tracing::debug;
use ublk_metrics::events;

use super::config::ClientConfig;
use super::frames::Landing;
use crate::auth::{self, FrameKey, SessionKeys};
use crate::blob::ArenaError;
use crate::client::driven::{Handoff, TICK};
use crate::proto::{
    self, Challenge, FrameError, Header, Hello, Lease, Opcode, RailAccept, Status, Welcome,
    CAP_COLD_GET, CAP_RAILS, CAP_RDMA, CAP_RDMA_LEASE_KEYS, CAP_TCP_DATA, HANDSHAKE_VERSION,
    HEADER_LEN, MAC_LEN, TAG_LEN, VERSION_2, VERSION_3,
};

/// A successful answer.
pub(super) enum Reply {
    Empty,
    Lease(Lease),
    Count(u64),
    Data(Vec<u8>),
    /// A READ body read straight into the request's [`Landing`].
    Landed,
    NotFound,
    Rail(RailAccept),
}

/// The sending half of a connection: the stream, and from version 2 the
/// key and sequence number that protect each frame.
pub(super) struct Writer {
    pub(super) stream: TcpStream,
    version: u8,
    key: Option<FrameKey>,
    seq: u64,
    /// A version-3 frame's body, sealed here: a WRITE's payload is the
    /// caller's, which stays as it is (a retry or another replica sends it
    /// again). At most the largest body the peer takes, kept for the next.
    sealed: Vec<u8>,
    /// In a driven connection, where its answers are read while a send
    /// waits for room (see [`NoWait`]).
    pub(super) driven: Option<(Arc<Handoff>, Duration)>,
}

impl Writer {
    /// Sends a request: its encoded head, then the payload (vectored, so a
    /// WRITE's payload is never copied in version 2), then its tag.
    /// `digest` is the body's in a version-2 session, computed by the
    /// caller without the lock this writer is behind; version 3 seals the
    /// body while copying it, under the lock (its nonce is the frame's
    /// place in the stream).
    pub(super) fn send(
        &mut self,
        head: &mut [u8],
        payload: &[u8],
        digest: Option<&[u8; 32]>,
    ) -> io::Result<()> {
        head[4] = self.version;
        let (header, fixed) = head.split_at_mut(HEADER_LEN);
        let header: &[u8; HEADER_LEN] = (&*header).try_into().expect("a header");
        let (body, tag): ([&[u8]; 2], Option<[u8; TAG_LEN]>) = match (&self.key, digest) {
            (Some(FrameKey::Tag(key)), Some(digest)) => {
                ([fixed, payload], Some(key.tag(self.seq, header, digest)))
            }
            (Some(FrameKey::Seal(key)), _) => {
                self.sealed.clear();
                self.sealed.extend_from_slice(fixed);
                self.sealed.extend_from_slice(payload);
                let tag = key.seal(self.seq, header, &mut self.sealed);
                ([&self.sealed, &[]], Some(tag))
            }
            _ => ([fixed, payload], None),
        };
        if tag.is_some() {
            self.seq += 1;
        }
        let tag: &[u8] = tag.as_ref().map_or(&[], |t| &t[..]);
        let parts = [&header[..], body[0], body[1], tag];
        match &self.driven {
            Some((answers, limit)) => {
                let mut out = NoWait::new(&self.stream, answers, *limit);
                proto::write_vectored_all(&mut out, &parts)
            }
            None => proto::write_vectored_all(&mut self.stream, &parts),
        }
    }
}

pub(super) struct Pending {
    pub(super) op: Opcode,
    /// Bytes a READ asked for: its answer must carry exactly these.
    pub(super) want_len: Option<u32>,
    /// Where a large READ answer goes, when the caller offered its buffer.
    pub(super) landing: Option<Arc<Landing>>,
    pub(super) deadline: Instant,
    pub(super) tx: oneshot::Sender<Result<Reply, ArenaError>>,
}

pub(super) struct PendingTable {
    pub(super) map: HashMap<u64, Pending>,
    /// Set once the connection is dead; no request may be added after.
    pub(super) dead: Option<String>,
    /// Requests that timed out, whose answers may still come.
    pub(super) expired: Expired,
}

impl Default for PendingTable {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            dead: None,
            expired: Expired::new(),
        }
    }
}

/// One live connection.
pub(super) struct Conn {
    /// The socket's descriptor, for shutting it down without the writer's
    /// lock (a driven send holds it while it reads answers, which may end
    /// the connection). Not a second handle: every descriptor a queue's
    /// connection holds counts against ublkd's `LimitNOFILE`.
    socket: RawFd,
    pub(super) writer: Mutex<Writer>,
    pub(super) pending: Mutex<PendingTable>,
    pub(super) slots: Semaphore,
    pub(super) welcome: Welcome,
    pub(super) max_inline: u32,
    /// Which connection of this client this is (1 for the first).
    pub(super) epoch: u64,
    /// The protocol version the session speaks.
    pub(super) version: u8,
    /// Checks the tags of the server's frames (from version 2) and opens
    /// its sealed bodies (version 3).
    pub(super) server_key: Option<FrameKey>,
}

impl Conn {
    /// Whether a request's body digest goes with it to the writer (version
    /// 2; version 3 seals the body instead).
    pub(super) fn digests_bodies(&self) -> bool {
        self.version == VERSION_2
    }

    pub(super) fn is_dead(&self) -> bool {
        self.pending.lock().dead.is_some()
    }

    /// Requests waiting for their answers.
    pub(super) fn in_flight(&self) -> usize {
        self.pending.lock().map.len()
    }

    /// Marks the connection dead and fails everything in flight.
    pub(super) fn kill(&self, peer: &str, detail: &str) {
        let drained: Vec<Pending> = {
            let mut t = self.pending.lock();
            if t.dead.is_none() {
                t.dead = Some(detail.to_owned());
            }
            t.map.drain().map(|(_, p)| p).collect()
        };
        for p in drained {
            let _ = p.tx.send(Err(ArenaError::Disconnected {
                peer: peer.to_owned(),
                detail: detail.to_owned(),
            }));
        }
        self.slots.close();
        // SAFETY: `socket` is the descriptor of the writer's stream, which
        // `self` owns and never replaces, so it is open for as long as
        // `self` is borrowed here.
        let fd = unsafe { BorrowedFd::borrow_raw(self.socket) };
        let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
    }
}

/// Connects, authenticates both ways and returns the live connection. A
/// reconnect insists on the blob size agreed the first time (`agreed`) and
/// presents the writer's current `epoch`; a `driven` connection's sends
/// never block its owner's loop (its answers are read there).
pub(super) fn handshake(
    cfg: &ClientConfig,
    agreed: u32,
    epoch: u64,
    driven: Option<Arc<Handoff>>,
) -> Result<Conn, ArenaError> {
    let peer = &cfg.peer;
    let io_err = |source: io::Error| ArenaError::Connect {
        peer: peer.clone(),
        source,
    };
    let waited = |what: &str| {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what} timed out after {} s", seconds(cfg.connect_timeout)),
        )
    };
    // A read past the socket's timeout says "Resource temporarily
    // unavailable" (EAGAIN): name it as the timeout it is.
    let proto_err = |source: FrameError| match source {
        FrameError::Io(e) if is_timeout(&e) => ArenaError::Connect {
            peer: peer.clone(),
            source: waited("handshake (no answer from the peer; is it still starting?)"),
        },
        FrameError::Io(e) => ArenaError::Connect {
            peer: peer.clone(),
            source: e,
        },
        source => ArenaError::Protocol {
            peer: peer.clone(),
            source,
        },
    };
    let addrs: Vec<_> = peer.to_socket_addrs().map_err(io_err)?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing");
    let mut stream = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, cfg.connect_timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) if is_timeout(&e) => last = waited("connect"),
            Err(e) => last = e,
        }
    }
    let mut stream = stream.ok_or_else(|| io_err(last))?;
    stream.set_nodelay(true).map_err(io_err)?;
    stream
        .set_read_timeout(Some(cfg.connect_timeout))
        .map_err(io_err)?;

    let mut body = Vec::new();
    let h = read_answer(&mut stream, &mut body).map_err(proto_err)?;
    refused(peer, &h, &body)?;
    let ch = Challenge::decode(&h, &body).map_err(proto_err)?;
    // The newest version both speak within what the caller allows (a
    // downgrade below version 2 would lose the frame tags). Version 3 is
    // the confidential sessions' and only theirs: it seals every body.
    let ours = if cfg.confidential {
        u16::from(VERSION_3)..=u16::from(VERSION_3)
    } else {
        u16::from(*cfg.versions.start())..=u16::from((*cfg.versions.end()).min(VERSION_2))
    };
    let Some(version) = ours
        .clone()
        .rev()
        .find(|v| (ch.min_version..=ch.max_version).contains(v))
    else {
        return Err(ArenaError::Refused {
            peer: peer.clone(),
            status: Status::VersionMismatch,
            message: if cfg.confidential {
                format!(
                    "peer speaks versions {}..={}; a confidential volume needs version 3 (sealed frames)",
                    ch.min_version, ch.max_version
                )
            } else {
                format!(
                    "peer speaks versions {}..={}, this client {}..={}",
                    ch.min_version,
                    ch.max_version,
                    ours.start(),
                    ours.end()
                )
            },
        });
    };
    let mut hello = Hello {
        version,
        // A confidential session's payloads stay on its sealed stream: RDMA
        // would move them in the clear.
        caps: if cfg.offer_rdma && !cfg.confidential {
            CAP_TCP_DATA | CAP_RDMA | CAP_RDMA_LEASE_KEYS | CAP_COLD_GET | CAP_RAILS
        } else {
            CAP_TCP_DATA
        },
        blob_bytes: if agreed != 0 { agreed } else { cfg.blob_bytes },
        epoch: if version >= u16::from(VERSION_2) {
            epoch
        } else {
            0
        },
        client_nonce: auth::nonce(),
        mac: [0; MAC_LEN],
        volume: cfg.volume.clone(),
    };
    hello.mac = cfg.secret.sign_hello(&ch, &hello);
    let mut frame = Vec::new();
    hello.encode(&mut frame);
    stream.write_all(&frame).map_err(io_err)?;

    let h = read_answer(&mut stream, &mut body).map_err(proto_err)?;
    if h.status == Status::AuthFailed {
        return Err(ArenaError::AuthFailed {
            peer: peer.clone(),
            volume: cfg.volume.clone(),
        });
    }
    refused(peer, &h, &body)?;
    let welcome = Welcome::decode(&h, &body, version).map_err(proto_err)?;
    if !cfg.secret.verify_welcome(&ch, &hello, &welcome) {
        return Err(ArenaError::PeerNotAuthentic {
            peer: peer.clone(),
            volume: cfg.volume.clone(),
        });
    }
    let keys = (version >= u16::from(VERSION_2)).then(|| cfg.secret.session_keys(&ch, &hello));
    let (client_key, server_key) = match keys {
        Some(SessionKeys {
            client_to_server,
            server_to_client,
        }) => (Some(client_to_server), Some(server_to_client)),
        None => (None, None),
    };
    stream.set_read_timeout(Some(TICK)).map_err(io_err)?;
    debug!(
        event = events::SESSION_OPENED,
        session = welcome.session_id,
        generation = welcome.generation
    );
    let version = version as u8;
    Ok(Conn {
        socket: stream.as_raw_fd(),
        writer: Mutex::new(Writer {
            stream,
            version,
            key: client_key,
            seq: 0,
            sealed: Vec::new(),
            driven: driven.map(|h| (h, cfg.request_timeout)),
        }),
        pending: Mutex::new(PendingTable::default()),
        slots: Semaphore::new(ch.max_inflight as usize),
        welcome,
        max_inline: ch.max_inline,
        epoch: 0,
        version,
        server_key,
    })
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// `5`, or `0.5` for limits below a second.
fn seconds(d: std::time::Duration) -> String {
    if d.subsec_millis() == 0 {
        d.as_secs().to_string()
    } else {
        format!("{:.1}", d.as_secs_f64())
    }
}

fn read_answer(stream: &mut TcpStream, body: &mut Vec<u8>) -> Result<Header, FrameError> {
    let h = proto::read_frame(stream, body)?.ok_or(FrameError::Truncated {
        got: 0,
        want: proto::HEADER_LEN,
    })?;
    h.expect_version(HANDSHAKE_VERSION)?;
    Ok(h)
}

fn refused(peer: &str, h: &Header, body: &[u8]) -> Result<(), ArenaError> {
    if h.status == Status::Ok {
        return Ok(());
    }
    Err(ArenaError::Refused {
        peer: peer.to_owned(),
        status: h.status,
        message: proto::decode_error(body),
    })
}

/// Ids of requests that timed out, so their answers, if they come, are
/// told from answers to requests never sent. Bounded: the oldest are
/// forgotten first (an answer that late then counts as a mismatch).
pub(super) struct Expired {
    order: VecDeque<u64>,
    ids: HashSet<u64>,
}

impl Expired {
    const KEEP: usize = 4096;

    fn new() -> Self {
        Self {
            order: VecDeque::new(),
            ids: HashSet::new(),
        }
    }

    pub(super) fn add(&mut self, id: u64) {
        if self.order.len() >= Self::KEEP {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        self.order.push_back(id);
        self.ids.insert(id);
    }

    /// Whether `id` timed out (each late answer is recognised once).
    pub(super) fn take(&mut self, id: u64) -> bool {
        self.ids.remove(&id)
    }
}

/// A driven connection's socket as a `Write` that never blocks the loop:
/// when the socket is full it waits (at most `limit`) for room, reading
/// the answers that arrive meanwhile.
pub(super) struct NoWait<'a> {
    stream: &'a TcpStream,
    answers: &'a Handoff,
    limit: Duration,
}

impl<'a> NoWait<'a> {
    pub(super) fn new(stream: &'a TcpStream, answers: &'a Handoff, limit: Duration) -> Self {
        Self {
            stream,
            answers,
            limit,
        }
    }

    /// Waits until the socket has room, pumping answers as they come.
    fn wait(&self, until: Instant) -> io::Result<()> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no room to send for {:?}", self.limit),
                ));
            }
            let fd = self.stream.as_fd();
            let mut fds = [PollFd::new(&fd, PollFlags::OUT | PollFlags::IN)];
            let timeout = Timespec::try_from(left).map_err(io::Error::other)?;
            match poll(&mut fds, Some(&timeout)) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let ready = fds[0].revents();
            if ready.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR) {
                self.answers.pump();
            }
            if ready.intersects(PollFlags::OUT | PollFlags::HUP | PollFlags::ERR) {
                return Ok(());
            }
        }
    }
}

impl Write for NoWait<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let until = Instant::now() + self.limit;
        loop {
            let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
            match sendmsg(
                self.stream,
                bufs,
                &mut SendAncillaryBuffer::default(),
                flags,
            ) {
                Ok(n) => return Ok(n),
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => self.wait(until)?,
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
