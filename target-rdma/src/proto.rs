//! Wire format of the paging protocol spoken between `arenad` and its clients.
//!
//! Every frame is a fixed 24-byte little-endian header followed by a body whose
//! length the header states and whose layout the opcode fixes. The decoder
//! checks magic, version, opcode, reserved bits and every length against the
//! limits below *before* it allocates, so a hostile peer cannot make us buffer
//! more than one bounded frame. `docs/PROTOCOL.md` is the normative spec; keep
//! the two in step.

use std::io::{self, Read, Write};

use ublk_metrics::ProtocolErrorClass;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"ARNA";
/// Version 1: frames after the handshake are not authenticated.
pub const VERSION_1: u8 = 1;
/// Version 2: every frame after the handshake carries a [`TAG_LEN`]-byte
/// tag keyed from the handshake; HELLO carries the writer's epoch, and
/// EPOCH / `STALE_EPOCH` exist.
pub const VERSION_2: u8 = 2;
/// Version 3: version 2 with every frame body after the handshake sealed
/// with AES-256-GCM (encrypted, the tag its GCM tag): the sessions of a
/// volume that asks for confidentiality.
pub const VERSION_3: u8 = 3;
/// The newest protocol version this build speaks.
pub const VERSION: u8 = VERSION_3;
/// The version byte of the handshake frames (CHALLENGE, HELLO and its
/// answer), whatever the session negotiates: a client of any version can
/// read the CHALLENGE and tell which versions the peer offers.
pub const HANDSHAKE_VERSION: u8 = VERSION_1;
/// Length of the tag that follows every version-2 or -3 frame after the
/// handshake.
pub const TAG_LEN: usize = 16;
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 24;
/// Largest payload an inline WRITE or READ may carry (also the largest blob).
pub const MAX_INLINE: u32 = 16 << 20;
/// Largest body any frame may declare: an inline payload plus its fixed fields.
pub const MAX_BODY: u32 = MAX_INLINE + 64;
/// Most lease tokens one RELEASE may carry.
pub const MAX_RELEASE_BATCH: u32 = 1024;
/// Longest volume name.
pub const MAX_VOLUME_NAME: usize = 64;
/// Longest error message a peer may send.
pub const MAX_ERROR_MESSAGE: usize = 256;
/// Length of the authentication nonces and MACs.
pub const NONCE_LEN: usize = 32;
/// Length of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;

/// Header flag: this frame answers a request (or is server-initiated).
pub const FLAG_RESPONSE: u16 = 1;
const KNOWN_FLAGS: u16 = FLAG_RESPONSE;

/// Capability bit: the client can move payloads inline on the TCP stream.
pub const CAP_TCP_DATA: u32 = 1;
/// Capability bit: the client can move payloads by one-sided RDMA.
pub const CAP_RDMA: u32 = 1 << 1;
/// Capability bit (with [`CAP_RDMA`]): the client uses the per-lease rkey
/// that ALLOC and GET answers carry (a memory region over that slot only,
/// in the session's own protection domain), not one key to the whole
/// arena. A server isolating RDMA per lease grants it and refuses
/// RAIL_CONNECT to a client that did not offer it.
pub const CAP_RDMA_LEASE_KEYS: u32 = 1 << 2;
/// Capability bit: the server knows [`Opcode::GetResident`] (the client
/// offers it to learn that).
pub const CAP_COLD_GET: u32 = 1 << 3;
/// Capability bit (with [`CAP_RDMA`]): RAIL_CONNECT names a rail index
/// (one RDMA device of the server each), a session may have a QP on each
/// rail, and every lease answer carries a key per rail (the 28-byte lease
/// body). Granted to a client that offers it whenever RDMA is.
pub const CAP_RAILS: u32 = 1 << 4;
/// Rails a server serves and a session may connect, at most.
pub const MAX_RAILS: usize = 2;

/// Operation carried by a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Server → client, first frame of a connection: versions and a nonce.
    Challenge = 0x01,
    /// Client → server: version, volume, capabilities and the auth MAC.
    Hello = 0x02,
    /// Client → server after a HELLO that granted `CAP_RDMA`: exchange QP
    /// endpoints; the answer names the arena's memory region.
    RailConnect = 0x03,
    /// Lease a slot for writing; content is kept, a new key gets zeros.
    Alloc = 0x10,
    /// The leased slot's content is now the blob's content.
    Commit = 0x11,
    /// Lease a slot for reading, or NOT_FOUND.
    Get = 0x12,
    /// Drop a batch of leases.
    Release = 0x13,
    /// Drop every blob in a key range.
    Remove = 0x14,
    /// Make every acknowledged COMMIT and WRITE durable.
    Flush = 0x15,
    /// Write a byte range of a blob inline.
    Write = 0x16,
    /// Read a byte range of a blob inline.
    Read = 0x17,
    /// Raise the session's (and maybe the volume's) membership epoch
    /// (version 2).
    Epoch = 0x18,
    /// Lease a slot for reading if the blob is in it; [`Status::Cold`] if
    /// the blob is in swap only (nothing is faulted in: the client reads
    /// the range it wants inline, which is served at that size from swap),
    /// or NOT_FOUND. With [`CAP_COLD_GET`].
    GetResident = 0x19,
    /// Server → client: give a lease back.
    Revoke = 0x20,
}

impl Opcode {
    /// Decodes an opcode byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0x01 => Self::Challenge,
            0x02 => Self::Hello,
            0x03 => Self::RailConnect,
            0x10 => Self::Alloc,
            0x11 => Self::Commit,
            0x12 => Self::Get,
            0x13 => Self::Release,
            0x14 => Self::Remove,
            0x15 => Self::Flush,
            0x16 => Self::Write,
            0x17 => Self::Read,
            0x18 => Self::Epoch,
            0x19 => Self::GetResident,
            0x20 => Self::Revoke,
            _ => return None,
        })
    }

    /// Stable lower-case name, used in logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::Challenge => "challenge",
            Self::Hello => "hello",
            Self::RailConnect => "rail_connect",
            Self::Alloc => "alloc",
            Self::Commit => "commit",
            Self::Get => "get",
            Self::Release => "release",
            Self::Remove => "remove",
            Self::Flush => "flush",
            Self::Write => "write",
            Self::Read => "read",
            Self::Epoch => "epoch",
            Self::GetResident => "get_resident",
            Self::Revoke => "revoke",
        }
    }
}

/// Outcome carried in a response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// GET or READ of a key that holds no blob (READ: the range is zeros).
    NotFound = 1,
    /// Arena and swap are both full.
    NoSpace = 2,
    /// The volume's quota is used up.
    QuotaExceeded = 3,
    /// Every arena slot is leased; revocations were sent, retry shortly.
    Busy = 4,
    /// Malformed, oversized or out-of-order frame; the connection is closed.
    Protocol = 5,
    /// Authentication failed; the connection is closed.
    AuthFailed = 6,
    /// No common protocol version; the connection is closed.
    VersionMismatch = 7,
    /// The server is shutting down.
    ShuttingDown = 8,
    /// A storage error on the peer (swap or index I/O).
    Internal = 9,
    /// COMMIT of a lease whose blob was removed meanwhile (or that the peer
    /// force-ended after a revocation): the write is dropped and the lease
    /// ended; the client may write again.
    LeaseLost = 10,
    /// The session's epoch is below the volume's: a newer writer took the
    /// volume over. The connection stays (version 2).
    StaleEpoch = 11,
    /// GET_RESIDENT of a blob that is in swap only: no lease; READ the
    /// range wanted.
    Cold = 12,
}

impl Status {
    /// Decodes a status code.
    pub fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            0 => Self::Ok,
            1 => Self::NotFound,
            2 => Self::NoSpace,
            3 => Self::QuotaExceeded,
            4 => Self::Busy,
            5 => Self::Protocol,
            6 => Self::AuthFailed,
            7 => Self::VersionMismatch,
            8 => Self::ShuttingDown,
            9 => Self::Internal,
            10 => Self::LeaseLost,
            11 => Self::StaleEpoch,
            12 => Self::Cold,
            _ => return None,
        })
    }

    /// Stable lower-case name, used in logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::NotFound => "not_found",
            Self::NoSpace => "no_space",
            Self::QuotaExceeded => "quota_exceeded",
            Self::Busy => "busy",
            Self::Protocol => "protocol",
            Self::AuthFailed => "auth_failed",
            Self::VersionMismatch => "version_mismatch",
            Self::ShuttingDown => "shutting_down",
            Self::Internal => "internal",
            Self::LeaseLost => "lease_lost",
            Self::StaleEpoch => "stale_epoch",
            Self::Cold => "cold",
        }
    }
}

/// Why a frame was rejected. Each variant names the offending field and value.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream failed or ended.
    #[error("stream error: {0}")]
    Io(#[from] io::Error),
    /// The stream ended inside a frame.
    #[error("truncated frame: stream ended after {got} of {want} bytes")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes the frame needed.
        want: usize,
    },
    /// The first four bytes were not `ARNA`.
    #[error("bad magic {0:02x?}, expected \"ARNA\"")]
    BadMagic([u8; 4]),
    /// A version this build does not speak, or not the session's.
    #[error("unsupported protocol version {0}, this session speaks {1}")]
    BadVersion(u8, u8),
    /// An opcode byte with no meaning.
    #[error("unknown opcode {0:#04x}")]
    BadOpcode(u8),
    /// Flag bits or reserved fields that must be zero were not.
    #[error("reserved bits set: flags {flags:#06x}, reserved {reserved:#06x}")]
    Reserved {
        /// The flags field.
        flags: u16,
        /// The reserved field.
        reserved: u16,
    },
    /// A status code with no meaning.
    #[error("unknown status code {0}")]
    BadStatus(u16),
    /// A body longer than the protocol allows.
    #[error("{what} length {len} exceeds the limit {max}")]
    TooLong {
        /// Which length.
        what: &'static str,
        /// The declared length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A body whose length does not match its opcode's layout.
    #[error("{op} body is {len} bytes, expected {expected}")]
    BadBodyLength {
        /// The opcode's name.
        op: &'static str,
        /// The body length received.
        len: usize,
        /// What the layout requires.
        expected: String,
    },
    /// A field with a value the protocol forbids.
    #[error("invalid {field}: {detail}")]
    Invalid {
        /// The field's name.
        field: &'static str,
        /// What was wrong with it.
        detail: String,
    },
    /// A frame that is valid on its own but not allowed in this direction or state.
    #[error("unexpected {op} frame: {detail}")]
    Unexpected {
        /// The opcode's name.
        op: &'static str,
        /// Why it was unexpected.
        detail: &'static str,
    },
    /// A version-2 or -3 frame whose tag does not verify: injected, replayed,
    /// reordered, or altered on the way.
    #[error("frame {seq} ({op}) fails its authentication tag: injected, replayed, reordered or altered in transit")]
    BadTag {
        /// The opcode's name.
        op: &'static str,
        /// The frame's sequence number in its direction.
        seq: u64,
    },
    /// More requests in flight than the CHALLENGE announced.
    #[error("request {request_id} exceeds the {limit} requests in flight announced in CHALLENGE")]
    TooManyInFlight {
        /// The request's id.
        request_id: u64,
        /// The announced `max_inflight`.
        limit: u32,
    },
}

impl FrameError {
    /// The protocol-error class of the error: the one vocabulary of
    /// arenad's `arenad_protocol_errors_total{class}` and `protocol.error`
    /// log lines and of the client's frame-error counters and log lines
    /// (docs/PROTOCOL.md, *Protocol error classes*). A stream that failed
    /// (`Io`) is never counted as a protocol error by either side.
    pub fn class(&self) -> ProtocolErrorClass {
        match self {
            Self::Truncated { .. }
            | Self::BadMagic(_)
            | Self::Reserved { .. }
            | Self::BadStatus(_) => ProtocolErrorClass::Framing,
            Self::BadVersion(..) => ProtocolErrorClass::Version,
            Self::BadOpcode(_) => ProtocolErrorClass::Opcode,
            Self::TooLong { .. } | Self::BadBodyLength { .. } => ProtocolErrorClass::Length,
            Self::Unexpected { .. } | Self::TooManyInFlight { .. } => ProtocolErrorClass::Sequence,
            Self::BadTag { .. } => ProtocolErrorClass::Tag,
            Self::Io(_) | Self::Invalid { .. } => ProtocolErrorClass::Other,
        }
    }
}

/// Decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The version byte: [`HANDSHAKE_VERSION`] on handshake frames, the
    /// session's version after.
    pub version: u8,
    /// What the frame carries.
    pub opcode: Opcode,
    /// Flag bits (`FLAG_*`).
    pub flags: u16,
    /// Matches a response to its request; 0 for server-initiated frames.
    pub request_id: u64,
    /// Outcome; always `Ok` in requests.
    pub status: Status,
    /// Bytes of body that follow the header.
    pub body_len: u32,
}

impl Header {
    /// Whether this frame is a response or server-initiated.
    pub fn is_response(&self) -> bool {
        self.flags & FLAG_RESPONSE != 0
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = self.version;
        b[5] = self.opcode as u8;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..18].copy_from_slice(&(self.status as u16).to_le_bytes());
        // b[18..20]: reserved, zero.
        b[20..24].copy_from_slice(&self.body_len.to_le_bytes());
        b
    }

    /// Decodes and validates a header, including the body length limit.
    /// Any version this build speaks passes; the session checks that it is
    /// its own ([`Header::expect_version`]).
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, FrameError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if !(VERSION_1..=VERSION).contains(&b[4]) {
            return Err(FrameError::BadVersion(b[4], VERSION));
        }
        let opcode = Opcode::from_u8(b[5]).ok_or(FrameError::BadOpcode(b[5]))?;
        let flags = u16::from_le_bytes([b[6], b[7]]);
        let reserved = u16::from_le_bytes([b[18], b[19]]);
        if flags & !KNOWN_FLAGS != 0 || reserved != 0 {
            return Err(FrameError::Reserved { flags, reserved });
        }
        let request_id = u64::from_le_bytes(b[8..16].try_into().expect("8-byte slice"));
        let raw_status = u16::from_le_bytes([b[16], b[17]]);
        let status = Status::from_u16(raw_status).ok_or(FrameError::BadStatus(raw_status))?;
        let body_len = u32::from_le_bytes(b[20..24].try_into().expect("4-byte slice"));
        if body_len > MAX_BODY {
            return Err(FrameError::TooLong {
                what: "body",
                len: body_len.into(),
                max: MAX_BODY.into(),
            });
        }
        Ok(Self {
            version: b[4],
            opcode,
            flags,
            request_id,
            status,
            body_len,
        })
    }

    /// Fails unless the frame carries `version` (the session's, or
    /// [`HANDSHAKE_VERSION`] during the handshake).
    pub fn expect_version(&self, version: u8) -> Result<(), FrameError> {
        if self.version != version {
            return Err(FrameError::BadVersion(self.version, version));
        }
        Ok(())
    }

    /// What an error frame answering a broken frame with these raw header
    /// bytes names: its opcode (CHALLENGE when the opcode byte is unknown)
    /// and its request id, read from the bytes whatever else is wrong.
    pub fn blame(b: &[u8; HEADER_LEN]) -> (Opcode, u64) {
        let op = Opcode::from_u8(b[5]).unwrap_or(Opcode::Challenge);
        let id = u64::from_le_bytes(b[8..16].try_into().expect("8-byte slice"));
        (op, id)
    }
}

/// The largest body a request of `op` may declare after the handshake,
/// given the `max_inline` the server announced: every length is known from
/// the header, before a byte of the body is read. `None` for opcodes that
/// are not requests.
pub fn max_request_body(op: Opcode, max_inline: u32) -> Option<u32> {
    Some(match op {
        Opcode::Alloc | Opcode::Get | Opcode::GetResident | Opcode::Epoch => 8,
        Opcode::Commit | Opcode::Remove | Opcode::Read => 16,
        Opcode::Release => 4 + 8 * MAX_RELEASE_BATCH,
        Opcode::Flush => 0,
        Opcode::Write => 16 + max_inline.min(MAX_INLINE),
        Opcode::RailConnect => RAIL_CONNECT_BODY as u32,
        Opcode::Challenge | Opcode::Hello | Opcode::Revoke => return None,
    })
}

/// Bytes of an RDMA endpoint on the wire.
pub const ENDPOINT_LEN: usize = 28;
/// Bytes of a RAIL_CONNECT body that names its rail ([`CAP_RAILS`]): the
/// endpoint, the rail index and three reserved zero bytes.
pub const RAIL_CONNECT_BODY: usize = ENDPOINT_LEN + 4;
/// Largest HELLO body (version 2, longest volume name): what a server reads
/// before authentication, at most.
pub const MAX_HELLO_BODY: u32 =
    2 + 4 + 4 + 8 + NONCE_LEN as u32 + MAC_LEN as u32 + 1 + MAX_VOLUME_NAME as u32;

/// Fills `buf` from the stream; a clean end before the first byte is `Ok(false)`.
fn read_exact_or_eof(r: &mut impl Read, buf: &mut [u8]) -> Result<bool, FrameError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(FrameError::Truncated {
                    got,
                    want: buf.len(),
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Reads one frame. `Ok(None)` is a clean end of stream between frames.
///
/// The body is read into `body`, which is cleared and reused so that a
/// connection does not allocate per frame.
pub fn read_frame(r: &mut impl Read, body: &mut Vec<u8>) -> Result<Option<Header>, FrameError> {
    let mut hb = [0u8; HEADER_LEN];
    if !read_exact_or_eof(r, &mut hb)? {
        return Ok(None);
    }
    let header = Header::decode(&hb)?;
    let want = header.body_len as usize;
    body.clear();
    // `take` + `read_to_end` fills the reused buffer without zeroing it
    // first: for a 1 MiB WRITE that memset cost as much as the copy.
    r.take(want as u64).read_to_end(body)?;
    if body.len() != want {
        return Err(FrameError::Truncated {
            got: HEADER_LEN + body.len(),
            want: HEADER_LEN + want,
        });
    }
    Ok(Some(header))
}

/// Bounds-checked little-endian reader over a frame body.
struct Cursor<'a> {
    op: &'static str,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(op: Opcode, buf: &'a [u8]) -> Self {
        Self {
            op: op.name(),
            buf,
            pos: 0,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.buf.len() - self.pos < n {
            return Err(FrameError::BadBodyLength {
                op: self.op,
                len: self.buf.len(),
                expected: format!("at least {}", self.pos + n),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        Ok(self.take(N)?.try_into().expect("N"))
    }
    fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }

    fn endpoint(&mut self) -> Result<Endpoint, FrameError> {
        let ep = Endpoint {
            qpn: self.u32()?,
            psn: self.u32()?,
            lid: self.u16()?,
            mtu: self.u8()?,
            gid: {
                let reserved = self.u8()?;
                if reserved != 0 {
                    return Err(FrameError::Invalid {
                        field: "endpoint reserved byte",
                        detail: format!("must be 0, got {reserved}"),
                    });
                }
                self.array()?
            },
        };
        if ep.qpn > 0xff_ffff || ep.psn > 0xff_ffff || !(1..=5).contains(&ep.mtu) {
            return Err(FrameError::Invalid {
                field: "endpoint",
                detail: format!(
                    "qpn {:#x} and psn {:#x} must fit 24 bits, mtu {} must be 1..=5",
                    ep.qpn, ep.psn, ep.mtu
                ),
            });
        }
        Ok(ep)
    }

    /// Fails unless the whole body was consumed.
    fn finish(self) -> Result<(), FrameError> {
        if self.pos != self.buf.len() {
            return Err(FrameError::BadBodyLength {
                op: self.op,
                len: self.buf.len(),
                expected: format!("exactly {}", self.pos),
            });
        }
        Ok(())
    }
}

/// First frame from the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// Oldest protocol version the server speaks.
    pub min_version: u16,
    /// Newest protocol version the server speaks.
    pub max_version: u16,
    /// Fresh random nonce the client must MAC.
    pub server_nonce: [u8; NONCE_LEN],
    /// Most requests the client may keep in flight on this connection.
    pub max_inflight: u32,
    /// Largest inline payload the server accepts.
    pub max_inline: u32,
}

/// Client's authenticated greeting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The protocol version the client chose from the challenge's range.
    pub version: u16,
    /// `CAP_*` bits the client offers.
    pub caps: u32,
    /// Blob size the client expects; 0 accepts the volume's.
    pub blob_bytes: u32,
    /// The writer's membership epoch for the volume (version 2; 0 in a
    /// version-1 HELLO, where it is not on the wire).
    pub epoch: u64,
    /// The client's nonce, MACed by the server in its reply.
    pub client_nonce: [u8; NONCE_LEN],
    /// HMAC over the handshake transcript with the volume secret.
    pub mac: [u8; MAC_LEN],
    /// The volume to open.
    pub volume: String,
}

/// Server's answer to an accepted HELLO.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    /// Process-unique session id, for correlating logs.
    pub session_id: u64,
    /// Incremented each time the arena restarts; leases from an older
    /// generation are void.
    pub generation: u64,
    /// The volume's blob size.
    pub blob_bytes: u32,
    /// `CAP_*` bits in force for this session.
    pub caps: u32,
    /// The volume's quota in blobs.
    pub quota_blobs: u64,
    /// The volume's epoch once this HELLO was taken into account (version
    /// 2; not on the wire in version 1): above the HELLO's epoch, the
    /// session is stale from the start.
    pub epoch: u64,
    /// HMAC proving the server knows the secret too.
    pub mac: [u8; MAC_LEN],
}

/// A slot lease: where the blob sits in the arena and the token that pins it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lease {
    /// Byte offset of the slot in the arena.
    pub slot_offset: u64,
    /// Token that COMMIT and RELEASE name.
    pub token: u64,
    /// Per rail, the rkey of the memory region registered over exactly
    /// this slot in the session's protection domain on that rail
    /// (`CAP_RDMA_LEASE_KEYS` sessions with the rail connected); each dies
    /// with the lease. Without [`CAP_RAILS`] only rail 0 exists.
    pub rkeys: [Option<u32>; MAX_RAILS],
}

impl Lease {
    /// A lease without RDMA keys.
    pub fn unkeyed(slot_offset: u64, token: u64) -> Self {
        Self {
            slot_offset,
            token,
            rkeys: [None; MAX_RAILS],
        }
    }
}

/// A request a client sends after the handshake. A WRITE borrows its
/// payload, so neither side copies it into or out of a frame buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// See [`Opcode::Alloc`].
    Alloc {
        /// Blob key.
        key: u64,
    },
    /// See [`Opcode::Commit`].
    Commit {
        /// Blob key.
        key: u64,
        /// Lease token from ALLOC.
        token: u64,
    },
    /// See [`Opcode::Get`].
    Get {
        /// Blob key.
        key: u64,
    },
    /// See [`Opcode::GetResident`].
    GetResident {
        /// Blob key.
        key: u64,
    },
    /// See [`Opcode::Release`].
    Release {
        /// Lease tokens to drop.
        tokens: Vec<u64>,
    },
    /// See [`Opcode::Remove`]; drops keys in `start..end`.
    Remove {
        /// First key.
        start: u64,
        /// One past the last key.
        end: u64,
    },
    /// See [`Opcode::Flush`].
    Flush,
    /// See [`Opcode::Write`].
    Write {
        /// Blob key.
        key: u64,
        /// Byte offset inside the blob.
        offset: u32,
        /// The bytes.
        data: &'a [u8],
    },
    /// See [`Opcode::Read`].
    Read {
        /// Blob key.
        key: u64,
        /// Byte offset inside the blob.
        offset: u32,
        /// Bytes wanted.
        len: u32,
    },
    /// See [`Opcode::RailConnect`]: the client's QP endpoint, on a rail.
    RailConnect {
        /// The client's QP.
        endpoint: Endpoint,
        /// The rail ([`CAP_RAILS`] sessions; `None`: the 28-byte body of
        /// other sessions, which is rail 0).
        rail: Option<u8>,
    },
    /// See [`Opcode::Epoch`]: the epoch the session moves to.
    Epoch {
        /// The writer's membership epoch.
        epoch: u64,
    },
}

impl Request<'_> {
    /// The request's opcode.
    pub fn opcode(&self) -> Opcode {
        match self {
            Self::Alloc { .. } => Opcode::Alloc,
            Self::Commit { .. } => Opcode::Commit,
            Self::Get { .. } => Opcode::Get,
            Self::GetResident { .. } => Opcode::GetResident,
            Self::Release { .. } => Opcode::Release,
            Self::Remove { .. } => Opcode::Remove,
            Self::Flush => Opcode::Flush,
            Self::Write { .. } => Opcode::Write,
            Self::Read { .. } => Opcode::Read,
            Self::RailConnect { .. } => Opcode::RailConnect,
            Self::Epoch { .. } => Opcode::Epoch,
        }
    }
}

/// Encodes a frame (header and body) into `out`, which is cleared first.
pub fn encode_frame(
    out: &mut Vec<u8>,
    opcode: Opcode,
    flags: u16,
    request_id: u64,
    status: Status,
    body: impl FnOnce(&mut Vec<u8>),
) {
    out.clear();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    body(out);
    let body_len = u32::try_from(out.len() - HEADER_LEN).expect("encoder bodies are bounded");
    let h = Header {
        version: HANDSHAKE_VERSION,
        opcode,
        flags,
        request_id,
        status,
        body_len,
    };
    out[..HEADER_LEN].copy_from_slice(&h.encode());
}

/// Encodes the header and the fixed fields of a request. For WRITE the
/// payload itself is *not* appended: the caller sends it after these bytes
/// (vectored), so a large payload is never copied into the frame buffer.
pub fn encode_request_head(out: &mut Vec<u8>, request_id: u64, req: &Request<'_>) {
    let mut payload = 0;
    encode_frame(
        out,
        req.opcode(),
        0,
        request_id,
        Status::Ok,
        |b| match req {
            Request::Alloc { key } | Request::Get { key } | Request::GetResident { key } => {
                put_u64(b, *key)
            }
            Request::Epoch { epoch } => put_u64(b, *epoch),
            Request::Commit { key, token } => {
                put_u64(b, *key);
                put_u64(b, *token);
            }
            Request::Release { tokens } => {
                put_u32(b, tokens.len() as u32);
                tokens.iter().for_each(|t| put_u64(b, *t));
            }
            Request::Remove { start, end } => {
                put_u64(b, *start);
                put_u64(b, *end);
            }
            Request::Flush => {}
            Request::Write { key, offset, data } => {
                put_u64(b, *key);
                put_u32(b, *offset);
                put_u32(b, data.len() as u32);
                payload = data.len();
            }
            Request::Read { key, offset, len } => {
                put_u64(b, *key);
                put_u32(b, *offset);
                put_u32(b, *len);
            }
            Request::RailConnect { endpoint, rail } => {
                put_endpoint(b, endpoint);
                if let Some(r) = rail {
                    b.extend_from_slice(&[*r, 0, 0, 0]);
                }
            }
        },
    );
    let body_len = (out.len() - HEADER_LEN + payload) as u32;
    out[20..24].copy_from_slice(&body_len.to_le_bytes());
}

/// Encodes a whole request, payload included, into `out`.
pub fn encode_request(out: &mut Vec<u8>, request_id: u64, req: &Request<'_>) {
    encode_request_head(out, request_id, req);
    if let Request::Write { data, .. } = req {
        out.extend_from_slice(data);
    }
}

/// Decodes a request body. HELLO and server-only opcodes are rejected here;
/// the handshake has its own decoders.
pub fn decode_request<'a>(h: &Header, body: &'a [u8]) -> Result<Request<'a>, FrameError> {
    if h.is_response() {
        return Err(FrameError::Unexpected {
            op: h.opcode.name(),
            detail: "response flag set on a client request",
        });
    }
    if h.status != Status::Ok {
        return Err(FrameError::Invalid {
            field: "status",
            detail: format!("requests carry status 0, got {}", h.status as u16),
        });
    }
    let mut c = Cursor::new(h.opcode, body);
    let req = match h.opcode {
        Opcode::Alloc => Request::Alloc { key: c.u64()? },
        Opcode::Get => Request::Get { key: c.u64()? },
        Opcode::GetResident => Request::GetResident { key: c.u64()? },
        Opcode::Commit => Request::Commit {
            key: c.u64()?,
            token: c.u64()?,
        },
        Opcode::Release => {
            let n = c.u32()?;
            if n == 0 || n > MAX_RELEASE_BATCH {
                return Err(FrameError::Invalid {
                    field: "release count",
                    detail: format!("{n} not in 1..={MAX_RELEASE_BATCH}"),
                });
            }
            let tokens = (0..n).map(|_| c.u64()).collect::<Result<_, _>>()?;
            Request::Release { tokens }
        }
        Opcode::Remove => {
            let (start, end) = (c.u64()?, c.u64()?);
            if start >= end {
                return Err(FrameError::Invalid {
                    field: "remove range",
                    detail: format!("start {start} must be below end {end}"),
                });
            }
            Request::Remove { start, end }
        }
        Opcode::Flush => Request::Flush,
        Opcode::Write => {
            let (key, offset, len) = (c.u64()?, c.u32()?, c.u32()?);
            check_inline_len(len)?;
            let data = c.rest();
            if data.len() != len as usize {
                return Err(FrameError::BadBodyLength {
                    op: "write",
                    len: body.len(),
                    expected: format!("exactly {}", 16 + len as usize),
                });
            }
            Request::Write { key, offset, data }
        }
        Opcode::Read => {
            let (key, offset, len) = (c.u64()?, c.u32()?, c.u32()?);
            check_inline_len(len)?;
            Request::Read { key, offset, len }
        }
        Opcode::RailConnect => {
            let endpoint = c.endpoint()?;
            let rail = if body.len() > ENDPOINT_LEN {
                let [r, reserved @ ..] = c.array::<4>()?;
                if reserved != [0; 3] {
                    return Err(FrameError::Invalid {
                        field: "rail_connect reserved bytes",
                        detail: format!("{reserved:?} must be zero"),
                    });
                }
                if usize::from(r) >= MAX_RAILS {
                    return Err(FrameError::Invalid {
                        field: "rail index",
                        detail: format!("{r} is not below {MAX_RAILS}"),
                    });
                }
                Some(r)
            } else {
                None
            };
            Request::RailConnect { endpoint, rail }
        }
        Opcode::Epoch => Request::Epoch {
            epoch: check_epoch(c.u64()?)?,
        },
        Opcode::Challenge | Opcode::Hello | Opcode::Revoke => {
            return Err(FrameError::Unexpected {
                op: h.opcode.name(),
                detail: "not a request opcode after the handshake",
            })
        }
    };
    c.finish()?;
    Ok(req)
}

fn check_inline_len(len: u32) -> Result<(), FrameError> {
    if len == 0 {
        return Err(FrameError::Invalid {
            field: "inline length",
            detail: "must be at least 1".into(),
        });
    }
    if len > MAX_INLINE {
        return Err(FrameError::TooLong {
            what: "inline payload",
            len: len.into(),
            max: MAX_INLINE.into(),
        });
    }
    Ok(())
}

fn put_endpoint(b: &mut Vec<u8>, ep: &Endpoint) {
    put_u32(b, ep.qpn);
    put_u32(b, ep.psn);
    put_u16(b, ep.lid);
    b.push(ep.mtu);
    b.push(0);
    b.extend_from_slice(&ep.gid);
}

/// One side of an RDMA queue pair, as RAIL_CONNECT exchanges it: everything
/// the peer needs to bring its QP to RTR with ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Path MTU as an IBV enum value (1 = 256 .. 5 = 4096).
    pub mtu: u8,
    /// GID at the chosen index.
    pub gid: [u8; 16],
}

/// The server's answer to RAIL_CONNECT: its QP endpoint and the arena's
/// memory region (remote address = `arena_base + slot_offset + offset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailAccept {
    /// The server's QP.
    pub endpoint: Endpoint,
    /// Address of the arena's first byte in the server's address space.
    pub arena_base: u64,
    /// Arena length in bytes.
    pub arena_len: u64,
    /// Remote key of the arena region.
    pub rkey: u32,
}

impl RailAccept {
    /// Encodes the successful RAIL_CONNECT answer.
    pub fn encode(&self, out: &mut Vec<u8>, request_id: u64) {
        encode_frame(
            out,
            Opcode::RailConnect,
            FLAG_RESPONSE,
            request_id,
            Status::Ok,
            |b| {
                put_endpoint(b, &self.endpoint);
                put_u64(b, self.arena_base);
                put_u64(b, self.arena_len);
                put_u32(b, self.rkey);
            },
        );
    }

    /// Decodes the successful RAIL_CONNECT answer.
    pub fn decode(h: &Header, body: &[u8]) -> Result<Self, FrameError> {
        let mut c = Cursor::new(h.opcode, body);
        let v = Self {
            endpoint: c.endpoint()?,
            arena_base: c.u64()?,
            arena_len: c.u64()?,
            rkey: c.u32()?,
        };
        c.finish()?;
        if v.arena_base.checked_add(v.arena_len).is_none() {
            return Err(FrameError::Invalid {
                field: "arena region",
                detail: format!(
                    "base {:#x} + length {} overflows",
                    v.arena_base, v.arena_len
                ),
            });
        }
        Ok(v)
    }
}

fn put_u16(b: &mut Vec<u8>, v: u16) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

impl Challenge {
    /// Encodes the CHALLENGE frame.
    pub fn encode(&self, out: &mut Vec<u8>) {
        encode_frame(out, Opcode::Challenge, FLAG_RESPONSE, 0, Status::Ok, |b| {
            put_u16(b, self.min_version);
            put_u16(b, self.max_version);
            b.extend_from_slice(&self.server_nonce);
            put_u32(b, self.max_inflight);
            put_u32(b, self.max_inline);
        });
    }

    /// Decodes a CHALLENGE frame.
    pub fn decode(h: &Header, body: &[u8]) -> Result<Self, FrameError> {
        expect(h, Opcode::Challenge, true)?;
        let mut c = Cursor::new(h.opcode, body);
        let v = Self {
            min_version: c.u16()?,
            max_version: c.u16()?,
            server_nonce: c.array()?,
            max_inflight: c.u32()?,
            max_inline: c.u32()?,
        };
        c.finish()?;
        if v.min_version > v.max_version || v.max_inflight == 0 || v.max_inline == 0 {
            return Err(FrameError::Invalid {
                field: "challenge",
                detail: format!(
                    "versions {}..={}, max_inflight {}, max_inline {}",
                    v.min_version, v.max_version, v.max_inflight, v.max_inline
                ),
            });
        }
        Ok(v)
    }
}

impl Hello {
    /// Encodes the HELLO frame.
    pub fn encode(&self, out: &mut Vec<u8>) {
        encode_frame(out, Opcode::Hello, 0, 0, Status::Ok, |b| {
            put_u16(b, self.version);
            put_u32(b, self.caps);
            put_u32(b, self.blob_bytes);
            if self.version >= u16::from(VERSION_2) {
                put_u64(b, self.epoch);
            }
            b.extend_from_slice(&self.client_nonce);
            b.extend_from_slice(&self.mac);
            b.push(self.volume.len() as u8);
            b.extend_from_slice(self.volume.as_bytes());
        });
    }

    /// The version a HELLO names: the first two bytes of its body, whatever
    /// follows. The server checks it against the versions it offered
    /// before it decodes the rest, so a HELLO of a version it does not
    /// speak is answered `VERSION_MISMATCH` rather than a length error
    /// of a layout it would have had to guess.
    pub fn version_of(h: &Header, body: &[u8]) -> Result<u16, FrameError> {
        expect(h, Opcode::Hello, false)?;
        Cursor::new(h.opcode, body).u16()
    }

    /// Decodes a HELLO frame, validating the volume name. The layout is
    /// the one of the version the HELLO names (version 2 adds `epoch`).
    pub fn decode(h: &Header, body: &[u8]) -> Result<Self, FrameError> {
        expect(h, Opcode::Hello, false)?;
        let mut c = Cursor::new(h.opcode, body);
        let version = c.u16()?;
        let caps = c.u32()?;
        let blob_bytes = c.u32()?;
        let epoch = if version >= u16::from(VERSION_2) {
            check_epoch(c.u64()?)?
        } else {
            0
        };
        let client_nonce = c.array()?;
        let mac = c.array()?;
        let n = c.u8()? as usize;
        let name = c.take(n)?;
        c.finish()?;
        let volume = String::from_utf8(name.to_vec())
            .ok()
            .filter(|v| valid_volume_name(v))
            .ok_or_else(|| FrameError::Invalid {
                field: "volume name",
                detail: format!("must be 1..={MAX_VOLUME_NAME} bytes of [A-Za-z0-9._-]"),
            })?;
        Ok(Self {
            version,
            caps,
            blob_bytes,
            epoch,
            client_nonce,
            mac,
            volume,
        })
    }
}

/// The highest membership epoch a HELLO or EPOCH may present: a writer at
/// `u64::MAX` could never be fenced out, since no higher epoch exists.
pub const MAX_EPOCH: u64 = u64::MAX - 1;

/// `epoch`, unless it is above [`MAX_EPOCH`].
fn check_epoch(epoch: u64) -> Result<u64, FrameError> {
    if epoch > MAX_EPOCH {
        return Err(FrameError::Invalid {
            field: "epoch",
            detail: format!(
                "{epoch} is above the highest membership epoch {MAX_EPOCH}: a writer there could never be fenced out"
            ),
        });
    }
    Ok(epoch)
}

/// Whether `name` is an acceptable volume name: short, printable, no separators.
pub fn valid_volume_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_VOLUME_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Welcome {
    /// Encodes the HELLO reply of a session of `version`.
    pub fn encode(&self, out: &mut Vec<u8>, version: u16) {
        encode_frame(out, Opcode::Hello, FLAG_RESPONSE, 0, Status::Ok, |b| {
            put_u64(b, self.session_id);
            put_u64(b, self.generation);
            put_u32(b, self.blob_bytes);
            put_u32(b, self.caps);
            put_u64(b, self.quota_blobs);
            if version >= u16::from(VERSION_2) {
                put_u64(b, self.epoch);
            }
            b.extend_from_slice(&self.mac);
        });
    }

    /// Decodes the HELLO reply of a session of `version`; a non-OK status
    /// is returned as an error message by [`decode_error`].
    pub fn decode(h: &Header, body: &[u8], version: u16) -> Result<Self, FrameError> {
        expect(h, Opcode::Hello, true)?;
        let mut c = Cursor::new(h.opcode, body);
        let v = Self {
            session_id: c.u64()?,
            generation: c.u64()?,
            blob_bytes: c.u32()?,
            caps: c.u32()?,
            quota_blobs: c.u64()?,
            epoch: if version >= u16::from(VERSION_2) {
                c.u64()?
            } else {
                0
            },
            mac: c.array()?,
        };
        c.finish()?;
        Ok(v)
    }
}

fn expect(h: &Header, op: Opcode, response: bool) -> Result<(), FrameError> {
    if h.opcode != op {
        return Err(FrameError::Unexpected {
            op: h.opcode.name(),
            detail: if response {
                "expected a different server frame here"
            } else {
                "expected a different client frame here"
            },
        });
    }
    if h.is_response() != response {
        return Err(FrameError::Unexpected {
            op: h.opcode.name(),
            detail: "wrong direction (response flag)",
        });
    }
    Ok(())
}

/// Encodes an error response: the status and a short human-readable message.
pub fn encode_error(
    out: &mut Vec<u8>,
    opcode: Opcode,
    request_id: u64,
    status: Status,
    message: &str,
) {
    let mut end = message.len().min(MAX_ERROR_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    encode_frame(out, opcode, FLAG_RESPONSE, request_id, status, |b| {
        b.extend_from_slice(&message.as_bytes()[..end]);
    });
}

/// Decodes the message of an error response.
pub fn decode_error(body: &[u8]) -> String {
    let end = body.len().min(MAX_ERROR_MESSAGE);
    String::from_utf8_lossy(&body[..end]).into_owned()
}

/// Encodes a successful response with a lease body (ALLOC, GET,
/// GET_RESIDENT): in a [`CAP_RAILS`] session (`per_rail`) the 28-byte body
/// with a key per rail, otherwise 16 bytes, or 20 with rail 0's key.
pub fn encode_lease(
    out: &mut Vec<u8>,
    opcode: Opcode,
    request_id: u64,
    lease: Lease,
    per_rail: bool,
) {
    encode_frame(out, opcode, FLAG_RESPONSE, request_id, Status::Ok, |b| {
        put_u64(b, lease.slot_offset);
        put_u64(b, lease.token);
        if per_rail {
            let mask = lease
                .rkeys
                .iter()
                .enumerate()
                .filter(|(_, k)| k.is_some())
                .fold(0u8, |m, (i, _)| m | 1 << i);
            b.extend_from_slice(&[mask, 0, 0, 0]);
            for k in lease.rkeys {
                put_u32(b, k.unwrap_or(0));
            }
        } else if let Some(rkey) = lease.rkeys[0] {
            put_u32(b, rkey);
        }
    });
}

/// Bytes of a lease body with a key per rail ([`CAP_RAILS`]).
pub const LEASE_PER_RAIL_BODY: usize = 16 + 4 + 4 * MAX_RAILS;

/// Decodes a lease body: 16 bytes, 20 with rail 0's key, or
/// [`LEASE_PER_RAIL_BODY`] with a key per rail (a mask byte saying which
/// rails have one, three reserved zero bytes, then each rail's key, 0 for
/// none).
pub fn decode_lease(h: &Header, body: &[u8]) -> Result<Lease, FrameError> {
    let mut c = Cursor::new(h.opcode, body);
    let mut lease = Lease::unkeyed(c.u64()?, c.u64()?);
    if body.len() == LEASE_PER_RAIL_BODY {
        let [mask, reserved @ ..] = c.array::<4>()?;
        if reserved != [0; 3] || mask >> MAX_RAILS != 0 {
            return Err(FrameError::Invalid {
                field: "lease key mask",
                detail: format!(
                    "mask {mask:#x} names rails past {MAX_RAILS} or reserved bytes {reserved:?} are not zero"
                ),
            });
        }
        for (i, slot) in lease.rkeys.iter_mut().enumerate() {
            let k = c.u32()?;
            match (mask >> i & 1 == 1, k) {
                (true, k) => *slot = Some(k),
                (false, 0) => {}
                (false, k) => {
                    return Err(FrameError::Invalid {
                        field: "lease key",
                        detail: format!("rail {i} has key {k:#x} but the mask names none"),
                    })
                }
            }
        }
    } else if body.len() > 16 {
        lease.rkeys[0] = Some(c.u32()?);
    }
    c.finish()?;
    Ok(lease)
}

/// Encodes a successful response with a single `u64` (REMOVE: blobs removed).
pub fn encode_count(out: &mut Vec<u8>, opcode: Opcode, request_id: u64, count: u64) {
    encode_frame(out, opcode, FLAG_RESPONSE, request_id, Status::Ok, |b| {
        put_u64(b, count)
    });
}

/// Decodes a `u64` response body.
pub fn decode_count(h: &Header, body: &[u8]) -> Result<u64, FrameError> {
    let mut c = Cursor::new(h.opcode, body);
    let v = c.u64()?;
    c.finish()?;
    Ok(v)
}

/// Encodes an empty successful response (COMMIT, RELEASE, FLUSH, WRITE).
pub fn encode_ok(out: &mut Vec<u8>, opcode: Opcode, request_id: u64) {
    encode_frame(out, opcode, FLAG_RESPONSE, request_id, Status::Ok, |_| {});
}

/// Encodes a successful EPOCH answer: the volume's epoch, now the session's.
pub fn encode_epoch(out: &mut Vec<u8>, request_id: u64, epoch: u64) {
    encode_count(out, Opcode::Epoch, request_id, epoch);
}

/// Encodes the head of a READ response carrying `len` payload bytes, which
/// the caller sends right after it.
pub fn encode_read_head(out: &mut Vec<u8>, request_id: u64, len: u32) {
    encode_frame(
        out,
        Opcode::Read,
        FLAG_RESPONSE,
        request_id,
        Status::Ok,
        |_| {},
    );
    out[20..24].copy_from_slice(&len.to_le_bytes());
}

/// Encodes a server-initiated REVOKE of a lease.
pub fn encode_revoke(out: &mut Vec<u8>, key: u64, token: u64) {
    encode_frame(out, Opcode::Revoke, FLAG_RESPONSE, 0, Status::Ok, |b| {
        put_u64(b, key);
        put_u64(b, token);
    });
}

/// Decodes a REVOKE body into `(key, token)`.
pub fn decode_revoke(h: &Header, body: &[u8]) -> Result<(u64, u64), FrameError> {
    let mut c = Cursor::new(h.opcode, body);
    let v = (c.u64()?, c.u64()?);
    c.finish()?;
    Ok(v)
}

/// Writes `parts` in order as vectored writes, retrying partial writes.
pub fn write_vectored_all(w: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
    let mut parts: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    let mut first = 0;
    while first < parts.len() {
        let slices: Vec<io::IoSlice<'_>> =
            parts[first..].iter().map(|p| io::IoSlice::new(p)).collect();
        let mut n = w.write_vectored(&slices)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let p = &mut parts[first];
            let k = n.min(p.len());
            *p = &p[k..];
            n -= k;
            if p.is_empty() {
                first += 1;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(req: Request<'_>) {
        let mut buf = Vec::new();
        encode_request(&mut buf, 42, &req);
        let mut body = Vec::new();
        let h = read_frame(&mut &buf[..], &mut body).unwrap().unwrap();
        assert_eq!(h.request_id, 42);
        assert_eq!(h.opcode, req.opcode());
        assert_eq!(decode_request(&h, &body).unwrap(), req);
    }

    #[test]
    fn every_request_round_trips() {
        roundtrip(Request::Alloc { key: 7 });
        roundtrip(Request::Commit { key: 7, token: 99 });
        roundtrip(Request::Get { key: u64::MAX });
        roundtrip(Request::GetResident { key: 3 });
        roundtrip(Request::Release {
            tokens: vec![1, 2, 3],
        });
        roundtrip(Request::Remove { start: 3, end: 9 });
        roundtrip(Request::Flush);
        roundtrip(Request::Write {
            key: 1,
            offset: 512,
            data: &[0xab; 4096],
        });
        roundtrip(Request::Read {
            key: 1,
            offset: 0,
            len: 4096,
        });
        roundtrip(Request::RailConnect {
            endpoint: test_endpoint(),
            rail: None,
        });
        roundtrip(Request::RailConnect {
            endpoint: test_endpoint(),
            rail: Some(1),
        });
    }

    fn test_endpoint() -> Endpoint {
        Endpoint {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 7,
            mtu: 3,
            gid: [0x11; 16],
        }
    }

    #[test]
    fn rail_frames_round_trip_and_reject_bad_endpoints() {
        let acc = RailAccept {
            endpoint: test_endpoint(),
            arena_base: 0x7f00_0000_0000,
            arena_len: 1 << 30,
            rkey: 0x1234,
        };
        let mut buf = Vec::new();
        acc.encode(&mut buf, 5);
        let (h, b) = decode_one(&buf);
        assert_eq!(
            (h.request_id, RailAccept::decode(&h, &b).unwrap()),
            (5, acc)
        );
        assert_eq!(b.len(), 48);

        // A rail index makes the body 32 bytes; an index past the last
        // rail, or reserved bytes set, are refused.
        let mut railed = Vec::new();
        encode_request(
            &mut railed,
            1,
            &Request::RailConnect {
                endpoint: test_endpoint(),
                rail: Some(1),
            },
        );
        assert_eq!(railed.len(), HEADER_LEN + RAIL_CONNECT_BODY);
        for (at, val, field) in [
            (HEADER_LEN + 28, MAX_RAILS as u8, "rail index"),
            (HEADER_LEN + 30, 1, "rail_connect reserved bytes"),
        ] {
            let mut bad = railed.clone();
            bad[at] = val;
            assert!(
                matches!(frame_error(&bad), FrameError::Invalid { field: f, .. } if f == field),
                "{field}"
            );
        }

        let mut req = Vec::new();
        encode_request(
            &mut req,
            1,
            &Request::RailConnect {
                endpoint: test_endpoint(),
                rail: None,
            },
        );
        assert_eq!(req.len(), HEADER_LEN + 28);
        for (at, val, field) in [
            (HEADER_LEN + 3, 0x01, "endpoint"), // qpn above 24 bits
            (HEADER_LEN + 10, 9, "endpoint"),   // mtu enum
            (HEADER_LEN + 11, 1, "endpoint reserved byte"),
        ] {
            let mut bad = req.clone();
            bad[at] = val;
            assert!(
                matches!(frame_error(&bad), FrameError::Invalid { field: f, .. } if f == field),
                "{field}"
            );
        }
    }

    fn decode_one(buf: &[u8]) -> (Header, Vec<u8>) {
        let mut body = Vec::new();
        let h = read_frame(&mut &buf[..], &mut body).unwrap().unwrap();
        (h, body)
    }

    #[test]
    fn handshake_frames_round_trip() {
        let ch = Challenge {
            min_version: 1,
            max_version: 1,
            server_nonce: [5; NONCE_LEN],
            max_inflight: 128,
            max_inline: 1 << 20,
        };
        let mut buf = Vec::new();
        ch.encode(&mut buf);
        let (h, b) = decode_one(&buf);
        assert_eq!(Challenge::decode(&h, &b).unwrap(), ch);

        // Version 2 carries the epochs; version 1 has no room for them.
        for (version, epoch) in [(2u16, 41), (1, 0)] {
            let hello = Hello {
                version,
                caps: CAP_TCP_DATA,
                blob_bytes: 1 << 20,
                epoch,
                client_nonce: [9; NONCE_LEN],
                mac: [3; MAC_LEN],
                volume: "vm-1.disk_a".into(),
            };
            hello.encode(&mut buf);
            let (h, b) = decode_one(&buf);
            assert_eq!(Hello::decode(&h, &b).unwrap(), hello);
            assert!(b.len() <= MAX_HELLO_BODY as usize);

            let w = Welcome {
                session_id: 5,
                generation: 2,
                blob_bytes: 1 << 20,
                caps: CAP_TCP_DATA,
                quota_blobs: 1000,
                epoch: epoch + u64::from(epoch > 0),
                mac: [8; MAC_LEN],
            };
            w.encode(&mut buf, version);
            let (h, b) = decode_one(&buf);
            assert_eq!(Welcome::decode(&h, &b, version).unwrap(), w);
        }
    }

    #[test]
    fn the_longest_hello_is_max_hello_body() {
        let hello = Hello {
            version: u16::from(VERSION),
            caps: CAP_TCP_DATA,
            blob_bytes: 0,
            epoch: u64::MAX,
            client_nonce: [0; NONCE_LEN],
            mac: [0; MAC_LEN],
            volume: "v".repeat(MAX_VOLUME_NAME),
        };
        let mut buf = Vec::new();
        hello.encode(&mut buf);
        assert_eq!(buf.len() - HEADER_LEN, MAX_HELLO_BODY as usize);
    }

    #[test]
    fn responses_round_trip() {
        let mut buf = Vec::new();
        let lease = Lease::unkeyed(1 << 30, 77);
        encode_lease(&mut buf, Opcode::Get, 9, lease, false);
        let (h, b) = decode_one(&buf);
        assert!(h.is_response());
        assert_eq!((h.request_id, decode_lease(&h, &b).unwrap()), (9, lease));
        // A keyed lease carries its rkey (20 bytes); other lengths are refused.
        let keyed = Lease {
            rkeys: [Some(0xabcd_ef01), None],
            ..lease
        };
        encode_lease(&mut buf, Opcode::Alloc, 8, keyed, false);
        let (h, b) = decode_one(&buf);
        assert_eq!((b.len(), decode_lease(&h, &b).unwrap()), (20, keyed));
        assert!(decode_lease(&h, &b[..18]).is_err());
        assert!(decode_lease(&h, &[b.as_slice(), &[0]].concat()).is_err());
        // Per rail: 28 bytes whatever is keyed, a key 0 on a rail the mask
        // names is a key, a key on a rail it does not name is refused.
        for rkeys in [[None, None], [None, Some(0)], [Some(5), Some(6)]] {
            let l = Lease { rkeys, ..lease };
            encode_lease(&mut buf, Opcode::Get, 7, l, true);
            let (h, b) = decode_one(&buf);
            assert_eq!((b.len(), decode_lease(&h, &b).unwrap()), (28, l));
        }
        let l = Lease {
            rkeys: [None, Some(6)],
            ..lease
        };
        encode_lease(&mut buf, Opcode::Get, 7, l, true);
        let (h, mut b) = decode_one(&buf);
        b[20..24].copy_from_slice(&9u32.to_le_bytes());
        assert!(
            decode_lease(&h, &b).is_err(),
            "a key the mask does not name"
        );
        b[20..24].fill(0);
        b[16] = 0b110;
        assert!(decode_lease(&h, &b).is_err(), "a rail past the last");
        b[16] = 0b010;
        b[17] = 1;
        assert!(decode_lease(&h, &b).is_err(), "a reserved byte set");

        encode_count(&mut buf, Opcode::Remove, 10, 12);
        let (h, b) = decode_one(&buf);
        assert_eq!(decode_count(&h, &b).unwrap(), 12);

        encode_ok(&mut buf, Opcode::Flush, 11);
        let (h, b) = decode_one(&buf);
        assert_eq!(
            (h.opcode, h.status, b.len()),
            (Opcode::Flush, Status::Ok, 0)
        );

        encode_error(
            &mut buf,
            Opcode::Alloc,
            12,
            Status::NoSpace,
            "arena and swap full",
        );
        let (h, b) = decode_one(&buf);
        assert_eq!(h.status, Status::NoSpace);
        assert_eq!(decode_error(&b), "arena and swap full");

        encode_revoke(&mut buf, 4, 5);
        let (h, b) = decode_one(&buf);
        assert_eq!(decode_revoke(&h, &b).unwrap(), (4, 5));

        encode_read_head(&mut buf, 13, 3);
        buf.extend_from_slice(b"abc");
        let (h, b) = decode_one(&buf);
        assert_eq!((h.opcode, &b[..]), (Opcode::Read, &b"abc"[..]));
    }

    fn frame_error(buf: &[u8]) -> FrameError {
        let mut body = Vec::new();
        match read_frame(&mut &buf[..], &mut body) {
            Err(e) => e,
            Ok(Some(h)) => decode_request(&h, &body).unwrap_err(),
            Ok(None) => panic!("clean EOF"),
        }
    }

    fn valid_alloc() -> Vec<u8> {
        let mut buf = Vec::new();
        encode_request(&mut buf, 1, &Request::Alloc { key: 1 });
        buf
    }

    #[test]
    fn decoder_rejects_each_malformed_case() {
        let good = valid_alloc();
        assert!(matches!(
            frame_error(&good[..10]),
            FrameError::Truncated { got: 10, want: 24 }
        ));
        assert!(matches!(
            frame_error(&good[..30]),
            FrameError::Truncated { .. }
        ));

        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(frame_error(&b), FrameError::BadMagic(_)));

        let mut b = good.clone();
        b[4] = 9;
        assert!(matches!(frame_error(&b), FrameError::BadVersion(9, _)));

        let mut b = good.clone();
        b[5] = 0x7e;
        assert!(matches!(frame_error(&b), FrameError::BadOpcode(0x7e)));

        let mut b = good.clone();
        b[7] = 0x80;
        assert!(matches!(frame_error(&b), FrameError::Reserved { .. }));

        let mut b = good.clone();
        b[18] = 1;
        assert!(matches!(frame_error(&b), FrameError::Reserved { .. }));

        let mut b = good.clone();
        b[16] = 200;
        assert!(matches!(frame_error(&b), FrameError::BadStatus(200)));

        let mut b = good.clone();
        b[20..24].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
        assert!(matches!(
            frame_error(&b),
            FrameError::TooLong { what: "body", .. }
        ));

        // Body length that does not match the opcode's layout, both ways.
        let mut b = good.clone();
        b.push(0);
        b[20..24].copy_from_slice(&9u32.to_le_bytes());
        assert!(matches!(frame_error(&b), FrameError::BadBodyLength { .. }));
        let mut b = good[..HEADER_LEN + 4].to_vec();
        b[20..24].copy_from_slice(&4u32.to_le_bytes());
        assert!(matches!(frame_error(&b), FrameError::BadBodyLength { .. }));

        // Oversized inline payload declared inside the body.
        let mut b = Vec::new();
        encode_request(
            &mut b,
            1,
            &Request::Read {
                key: 1,
                offset: 0,
                len: 1,
            },
        );
        b[HEADER_LEN + 12..HEADER_LEN + 16].copy_from_slice(&(MAX_INLINE + 1).to_le_bytes());
        assert!(matches!(
            frame_error(&b),
            FrameError::TooLong {
                what: "inline payload",
                ..
            }
        ));

        // Inline write whose declared length disagrees with the body.
        let mut b = Vec::new();
        encode_request(
            &mut b,
            1,
            &Request::Write {
                key: 1,
                offset: 0,
                data: &[1; 8],
            },
        );
        b[HEADER_LEN + 12..HEADER_LEN + 16].copy_from_slice(&9u32.to_le_bytes());
        assert!(matches!(frame_error(&b), FrameError::BadBodyLength { .. }));

        // Empty range, empty and oversized release batches.
        let mut b = Vec::new();
        encode_request(&mut b, 1, &Request::Remove { start: 5, end: 5 });
        assert!(matches!(
            frame_error(&b),
            FrameError::Invalid {
                field: "remove range",
                ..
            }
        ));
        encode_request(&mut b, 1, &Request::Release { tokens: vec![] });
        assert!(matches!(
            frame_error(&b),
            FrameError::Invalid {
                field: "release count",
                ..
            }
        ));
        encode_request(
            &mut b,
            1,
            &Request::Release {
                tokens: vec![0; MAX_RELEASE_BATCH as usize + 1],
            },
        );
        assert!(matches!(
            frame_error(&b),
            FrameError::Invalid {
                field: "release count",
                ..
            }
        ));

        // Handshake and server-only opcodes are out of order as requests.
        let mut b = Vec::new();
        encode_revoke(&mut b, 1, 1);
        assert!(matches!(frame_error(&b), FrameError::Unexpected { .. }));
        let mut b = good.clone();
        b[6] = FLAG_RESPONSE as u8;
        assert!(matches!(frame_error(&b), FrameError::Unexpected { .. }));
    }

    #[test]
    fn hello_rejects_bad_volume_names() {
        for name in ["", "a/b", "..\u{e9}", &"x".repeat(65)] {
            let hello = Hello {
                version: 1,
                caps: 0,
                blob_bytes: 0,
                epoch: 0,
                client_nonce: [0; NONCE_LEN],
                mac: [0; MAC_LEN],
                volume: name.into(),
            };
            let mut buf = Vec::new();
            hello.encode(&mut buf);
            let (h, b) = decode_one(&buf);
            assert!(Hello::decode(&h, &b).is_err(), "{name:?} accepted");
        }
    }

    #[test]
    fn clean_eof_between_frames_is_not_an_error() {
        let mut body = Vec::new();
        assert!(read_frame(&mut &[][..], &mut body).unwrap().is_none());
    }

    #[test]
    fn vectored_write_sends_head_then_payload() {
        let mut out = Vec::new();
        write_vectored_all(&mut out, &[b"head", b"", b"payload", b"tag"]).unwrap();
        assert_eq!(out, b"headpayloadtag");
    }
}
