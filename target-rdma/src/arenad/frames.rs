//! A session's frames on the server: each sent with the session's version
//! and, in version 2, its tag; each received checked against its version,
//! the body bound of its opcode (before the body is read) and its tag.

use std::io::{self, BufWriter, Read, Write};
use std::net::TcpStream;

use crate::auth::{self, FrameKey};
use crate::proto::{self, FrameError, Header, Opcode, HEADER_LEN, TAG_LEN};

/// Why [`FrameCheck::read`] got no frame.
pub(super) enum ReadError {
    /// The socket failed before the frame's first byte.
    Io(io::Error),
    /// The header could not be read whole.
    Frame(FrameError),
    /// The frame whose header named this opcode and request id is wrong.
    Request(Opcode, u64, FrameError),
}

/// The sending side of a session: frames get the session's version and,
/// in version 2, their tag.
pub(super) struct FrameWriter {
    pub(super) out: BufWriter<TcpStream>,
    pub(super) version: u8,
    pub(super) key: Option<FrameKey>,
    pub(super) seq: u64,
}

impl FrameWriter {
    /// Sends an encoded frame whose body continues with `payload`.
    pub(super) fn send(&mut self, frame: &mut [u8], payload: &[u8]) -> io::Result<()> {
        frame[4] = self.version;
        if let Some(key) = &self.key {
            let header: &[u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().expect("a header");
            let digest = auth::body_digest(&[&frame[HEADER_LEN..], payload]);
            let tag = key.tag(self.seq, header, &digest);
            self.seq += 1;
            self.out.write_all(frame)?;
            self.out.write_all(payload)?;
            return self.out.write_all(&tag);
        }
        self.out.write_all(frame)?;
        self.out.write_all(payload)
    }

    pub(super) fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// A session's receiving side: the version its frames carry and, in
/// version 2, the key and sequence number their tags are checked with.
pub(super) struct FrameCheck {
    pub(super) version: u8,
    pub(super) key: Option<FrameKey>,
    pub(super) seq: u64,
}

impl FrameCheck {
    /// Reads the next request frame: header, body (bounded by what the
    /// header's opcode allows before a byte of it is read) and tag. An
    /// error once the header is in names the frame's opcode and request id.
    pub(super) fn read(
        &mut self,
        r: &mut impl io::Read,
        body: &mut Vec<u8>,
        max_inline: u32,
    ) -> Result<Option<Header>, ReadError> {
        let mut hb = [0u8; HEADER_LEN];
        match r.read(&mut hb[..1]) {
            Ok(0) => return Ok(None),
            Ok(_) => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
        r.read_exact(&mut hb[1..])
            .map_err(|e| ReadError::Frame(truncated(e)))?;
        self.read_rest(r, &hb, body, max_inline)
            .map(Some)
            .map_err(|e| {
                let (op, request_id) = Header::blame(&hb);
                ReadError::Request(op, request_id, e)
            })
    }

    fn read_rest(
        &mut self,
        r: &mut impl io::Read,
        hb: &[u8; HEADER_LEN],
        body: &mut Vec<u8>,
        max_inline: u32,
    ) -> Result<Header, FrameError> {
        let h = Header::decode(hb)?;
        h.expect_version(self.version)?;
        let max = proto::max_request_body(h.opcode, max_inline).ok_or(FrameError::Unexpected {
            op: h.opcode.name(),
            detail: "not a request",
        })?;
        if h.body_len > max {
            return Err(FrameError::TooLong {
                what: "request body",
                len: h.body_len.into(),
                max: max.into(),
            });
        }
        body.clear();
        io::Read::take(&mut *r, u64::from(h.body_len)).read_to_end(body)?;
        if body.len() != h.body_len as usize {
            return Err(FrameError::Truncated {
                got: HEADER_LEN + body.len(),
                want: HEADER_LEN + h.body_len as usize,
            });
        }
        if let Some(key) = &self.key {
            let mut tag = [0u8; TAG_LEN];
            r.read_exact(&mut tag).map_err(truncated)?;
            let seq = self.seq;
            self.seq += 1;
            if !key.verify(seq, hb, &auth::body_digest(&[body]), &tag) {
                return Err(FrameError::BadTag {
                    op: h.opcode.name(),
                    seq,
                });
            }
        }
        Ok(h)
    }
}

pub(super) fn truncated(e: io::Error) -> FrameError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        FrameError::Truncated {
            got: 0,
            want: HEADER_LEN,
        }
    } else {
        e.into()
    }
}
