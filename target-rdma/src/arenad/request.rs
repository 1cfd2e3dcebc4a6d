//! A request decoded once, on the reader, and handed whole to wherever it
//! runs (inline, the swap's ring, the blocking pool): the frame moves with
//! it, so a WRITE's payload is never copied out of its body, and the
//! body's share of the connection's budget is held until it is dropped.

use std::borrow::Cow;

use crate::arenad::fatal::Fatal;
use crate::arenad::frames::Incoming;
use crate::proto::{self, Request};

/// A request as read and decoded.
pub(super) struct Decoded {
    /// The request; a WRITE's `data` is left empty here: its payload is
    /// the body's last `payload` bytes (see [`Decoded::request`]).
    req: Request<'static>,
    payload: usize,
    frame: Incoming,
}

impl Decoded {
    /// Decodes `frame`'s body; a protocol error names the frame's opcode
    /// and request id.
    pub(super) fn decode(frame: Incoming) -> Result<Self, Fatal> {
        let h = frame.header;
        let decoded = proto::decode_request(&h, &frame.body)
            .map_err(|e| Fatal::Request(h.opcode, h.request_id, e))?;
        let (req, payload) = Self::detach(decoded, &frame.body);
        Ok(Self {
            req,
            payload,
            frame,
        })
    }

    /// The request, a WRITE's payload borrowed from the body.
    pub(super) fn request(&self) -> Cow<'_, Request<'_>> {
        match self.req {
            Request::Write { key, offset, .. } => {
                let body = &self.frame.body;
                Cow::Owned(Request::Write {
                    key,
                    offset,
                    data: &body[body.len() - self.payload..],
                })
            }
            ref req => Cow::Borrowed(req),
        }
    }

    /// `req` without its borrow of `body`, and the length of a WRITE's
    /// payload: the decoder takes it as the rest of the body, so it is the
    /// body's tail.
    fn detach(req: Request<'_>, body: &[u8]) -> (Request<'static>, usize) {
        let req = match req {
            Request::Write { key, offset, data } => {
                debug_assert!(std::ptr::eq(
                    data.as_ptr(),
                    body[body.len() - data.len()..].as_ptr()
                ));
                return (
                    Request::Write {
                        key,
                        offset,
                        data: &[],
                    },
                    data.len(),
                );
            }
            Request::Alloc { key } => Request::Alloc { key },
            Request::Commit { key, token } => Request::Commit { key, token },
            Request::Get { key } => Request::Get { key },
            Request::GetResident { key } => Request::GetResident { key },
            Request::Release { tokens } => Request::Release { tokens },
            Request::Remove { start, end } => Request::Remove { start, end },
            Request::Flush => Request::Flush,
            Request::Read { key, offset, len } => Request::Read { key, offset, len },
            Request::RailConnect { endpoint, rail } => Request::RailConnect { endpoint, rail },
            Request::Epoch { epoch } => Request::Epoch { epoch },
        };
        (req, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Header, HEADER_LEN};

    fn decoded(req: &Request<'_>) -> Decoded {
        let mut frame = Vec::new();
        proto::encode_request(&mut frame, 9, req);
        let head: &[u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().unwrap();
        let header = Header::decode(head).unwrap();
        Decoded::decode(Incoming {
            header,
            body: frame[HEADER_LEN..].to_vec(),
            _budget: None,
        })
        .ok()
        .unwrap()
    }

    #[test]
    fn a_request_decoded_once_is_the_request_sent() {
        let data: Vec<u8> = (0..200u8).collect();
        for req in [
            Request::Write {
                key: 7,
                offset: 64,
                data: &data,
            },
            Request::Release {
                tokens: vec![1, 2, 3],
            },
            Request::Read {
                key: 7,
                offset: 0,
                len: 4096,
            },
            Request::Flush,
        ] {
            assert_eq!(*decoded(&req).request(), req);
        }
    }
}
