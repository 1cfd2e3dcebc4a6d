//! A session's frames on the server: each sent with the session's version
//! and, from version 2, its tag (in version 3 its body sealed); each
//! received checked against its version, the body bound of its opcode
//! (before the body is read) and its tag (and opened, in version 3).

use std::io;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::auth::FrameKey;
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

/// The sending side's tags: assigned by the connection's writer in the
/// order frames reach the socket, whichever task produced them.
pub(super) struct Tagger {
    pub(super) version: u8,
    pub(super) key: Option<FrameKey>,
}

impl Tagger {
    /// Makes an encoded frame (header and body) the session's frame number
    /// `seq`: its version byte set and, from version 2, its tag appended
    /// (in version 3 the body sealed in place, in the buffer the answer
    /// was built in: no second copy).
    pub(super) fn seal(&self, seq: u64, frame: &mut Vec<u8>) {
        frame[4] = self.version;
        if let Some(key) = &self.key {
            let (header, body) = frame.split_at_mut(HEADER_LEN);
            let header: &[u8; HEADER_LEN] = (&*header).try_into().expect("a header");
            let tag = key.protect(seq, header, body);
            frame.extend_from_slice(&tag);
        }
    }
}

/// A request as read: its header, its body, and its share of the
/// connection's body budget (held until it is answered).
pub(super) struct Incoming {
    pub(super) header: Header,
    pub(super) body: Vec<u8>,
    pub(super) _budget: Option<OwnedSemaphorePermit>,
}

/// Bodies up to this size are not counted against the body budget: every
/// request but WRITE has one this small.
const UNCOUNTED_BODY: u32 = 64;

/// A session's receiving side: the version its frames carry and, from
/// version 2, the key and sequence number their tags are checked with.
pub(super) struct FrameCheck {
    pub(super) version: u8,
    pub(super) key: Option<FrameKey>,
    pub(super) seq: u64,
    pub(super) max_inline: u32,
    /// Bytes of request bodies the connection may hold in flight.
    pub(super) budget: Arc<Semaphore>,
    pub(super) budget_bytes: u32,
}

impl FrameCheck {
    /// Reads the next request frame: header, body (bounded by what the
    /// header's opcode allows before a byte of it is read, and waiting for
    /// room in the body budget) and tag. An error once the header is in
    /// names the frame's opcode and request id.
    pub(super) async fn read(
        &mut self,
        r: &mut (impl AsyncRead + Unpin),
    ) -> Result<Option<Incoming>, ReadError> {
        let mut hb = [0u8; HEADER_LEN];
        match r.read(&mut hb[..1]).await {
            Ok(0) => return Ok(None),
            Ok(_) => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
        r.read_exact(&mut hb[1..])
            .await
            .map_err(|e| ReadError::Frame(truncated(e)))?;
        self.read_rest(r, &hb).await.map(Some).map_err(|e| {
            let (op, request_id) = Header::blame(&hb);
            ReadError::Request(op, request_id, e)
        })
    }

    async fn read_rest(
        &mut self,
        r: &mut (impl AsyncRead + Unpin),
        hb: &[u8; HEADER_LEN],
    ) -> Result<Incoming, FrameError> {
        let h = Header::decode(hb)?;
        h.expect_version(self.version)?;
        let max =
            proto::max_request_body(h.opcode, self.max_inline).ok_or(FrameError::Unexpected {
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
        let budget = if h.body_len > UNCOUNTED_BODY {
            let n = h.body_len.min(self.budget_bytes);
            Some(
                Arc::clone(&self.budget)
                    .acquire_many_owned(n)
                    .await
                    .expect("the budget is never closed"),
            )
        } else {
            None
        };
        let mut body = vec![0u8; h.body_len as usize];
        r.read_exact(&mut body).await.map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                FrameError::Truncated {
                    got: HEADER_LEN,
                    want: HEADER_LEN + h.body_len as usize,
                }
            } else {
                e.into()
            }
        })?;
        if let Some(key) = &self.key {
            let mut tag = [0u8; TAG_LEN];
            r.read_exact(&mut tag).await.map_err(truncated)?;
            let seq = self.seq;
            self.seq += 1;
            if !key.open(seq, hb, &mut body, &tag) {
                return Err(FrameError::BadTag {
                    op: h.opcode.name(),
                    seq,
                });
            }
        }
        Ok(Incoming {
            header: h,
            body,
            _budget: budget,
        })
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
