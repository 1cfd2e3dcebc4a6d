//! A resumable frame reader: bytes accumulate in one buffer and whole frames
//! are handed out, so a read timeout between or inside frames loses nothing.
//! The client's reader thread relies on this to wake up periodically and
//! expire requests without a second thread.

use std::io::{self, Read};

use crate::proto::{FrameError, Header, HEADER_LEN};

/// Bodies at least this large are read straight into a buffer of their own
/// and handed over by value, so a READ answer is not copied twice.
pub const OWNED_BODY_MIN: usize = 64 << 10;

/// A frame body: a view into the reader's buffer, or a large body it owns.
pub enum Body<'a> {
    /// Small body, valid until the next call.
    Buffered(&'a [u8]),
    /// Large body, read directly from the stream.
    Owned(Vec<u8>),
}

impl std::ops::Deref for Body<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Body::Buffered(b) => b,
            Body::Owned(v) => v,
        }
    }
}

impl Body<'_> {
    /// The body as an owned vector (no copy for large bodies).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            Body::Buffered(b) => b.to_vec(),
            Body::Owned(v) => v,
        }
    }
}

/// Large-body buffers handed back by their consumers for reuse, so a
/// stream of 1 MiB answers does not allocate (and page-fault) 1 MiB each.
#[derive(Default)]
pub struct BodyPool {
    free: parking_lot::Mutex<Vec<Vec<u8>>>,
}

impl BodyPool {
    /// Buffers kept at most; beyond that returned buffers are freed.
    const KEEP: usize = 16;

    /// Returns a buffer for reuse.
    pub fn give(&self, mut buf: Vec<u8>) {
        let mut free = self.free.lock();
        if free.len() < Self::KEEP {
            buf.clear();
            free.push(buf);
        }
    }

    fn take(&self, len: usize) -> Vec<u8> {
        let mut buf = self.free.lock().pop().unwrap_or_default();
        buf.reserve_exact(len);
        buf
    }
}

/// Buffer for frames arriving on one stream.
pub struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// A large body being filled: its header and the bytes so far.
    large: Option<(Header, Vec<u8>)>,
    pool: std::sync::Arc<BodyPool>,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self {
            buf: vec![0; 256 << 10],
            start: 0,
            end: 0,
            large: None,
            pool: std::sync::Arc::default(),
        }
    }
}

impl FrameReader {
    /// A reader that takes its large-body buffers from `pool`.
    pub fn with_pool(pool: std::sync::Arc<BodyPool>) -> Self {
        Self {
            pool,
            ..Self::default()
        }
    }

    /// Returns the next whole frame. `Ok(None)` is a clean end of stream
    /// between frames; a timeout surfaces as `FrameError::Io` with the
    /// partial frame kept for the next call.
    pub fn next<'a>(
        &'a mut self,
        r: &mut impl Read,
    ) -> Result<Option<(Header, Body<'a>)>, FrameError> {
        loop {
            if let Some((h, body)) = &mut self.large {
                let want = h.body_len as usize;
                while body.len() < want {
                    // Appends without zeroing; on a timeout the bytes read so
                    // far stay in `body` for the next call.
                    match r.take((want - body.len()) as u64).read_to_end(body) {
                        Ok(_) if body.len() < want => {
                            return Err(FrameError::Truncated {
                                got: HEADER_LEN + body.len(),
                                want: HEADER_LEN + want,
                            })
                        }
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                let h = *h;
                let (_, body) = self.large.take().expect("checked above");
                return Ok(Some((h, Body::Owned(body))));
            }
            let avail = self.end - self.start;
            if avail >= HEADER_LEN {
                let hb: &[u8; HEADER_LEN] = self.buf[self.start..self.start + HEADER_LEN]
                    .try_into()
                    .expect("header");
                let h = Header::decode(hb)?;
                let len = h.body_len as usize;
                let total = HEADER_LEN + len;
                if avail >= total {
                    let body = self.start + HEADER_LEN..self.start + total;
                    self.start += total;
                    return Ok(Some((h, Body::Buffered(&self.buf[body]))));
                }
                if len >= OWNED_BODY_MIN {
                    let mut body = self.pool.take(len);
                    body.extend_from_slice(&self.buf[self.start + HEADER_LEN..self.end]);
                    self.start = self.end;
                    self.large = Some((h, body));
                    continue;
                }
                self.make_room(total);
            } else {
                self.make_room(HEADER_LEN);
            }
            match r.read(&mut self.buf[self.end..]) {
                Ok(0) if self.end == self.start => return Ok(None),
                Ok(0) => {
                    return Err(FrameError::Truncated {
                        got: self.end - self.start,
                        want: HEADER_LEN.max(self.end - self.start + 1),
                    })
                }
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Ensures `need` bytes fit from `start`, compacting or growing (growth
    /// is bounded: only bodies below `OWNED_BODY_MIN` are buffered here).
    fn make_room(&mut self, need: usize) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.buf.len() - self.start >= need && self.end < self.buf.len() {
            return;
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
        if self.buf.len() < need {
            self.buf.resize(need, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{encode_ok, encode_read_head, Opcode};

    /// Hands out at most `chunk` bytes per read, then reports a timeout once.
    struct Trickle<'a> {
        data: &'a [u8],
        chunk: usize,
        stall: bool,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            self.stall = !self.stall;
            if self.stall && !self.data.is_empty() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = self.chunk.min(out.len()).min(self.data.len());
            out[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[test]
    fn frames_survive_timeouts_and_split_reads() {
        let mut stream = Vec::new();
        let mut f = Vec::new();
        for i in 0..50u64 {
            // Alternate buffered and owned (large) bodies.
            let len = if i % 2 == 0 { 5000 } else { OWNED_BODY_MIN + 3 };
            encode_read_head(&mut f, i, len as u32);
            stream.extend_from_slice(&f);
            stream.extend(std::iter::repeat_n(i as u8, len));
            encode_ok(&mut f, Opcode::Flush, 1000 + i);
            stream.extend_from_slice(&f);
        }
        let mut src = Trickle {
            data: &stream,
            chunk: 777,
            stall: false,
        };
        let mut r = FrameReader::default();
        let mut seen = Vec::new();
        loop {
            match r.next(&mut src) {
                Ok(Some((h, body))) => {
                    if h.opcode == Opcode::Read {
                        assert!(body.iter().all(|b| *b == h.request_id as u8));
                        let large = h.request_id % 2 == 1;
                        assert_eq!(matches!(body, Body::Owned(_)), large);
                        assert_eq!(body.len(), if large { OWNED_BODY_MIN + 3 } else { 5000 });
                    }
                    seen.push(h.request_id);
                }
                Ok(None) => break,
                Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        let want: Vec<u64> = (0..50).flat_map(|i| [i, 1000 + i]).collect();
        assert_eq!(seen, want);
    }

    #[test]
    fn eof_inside_a_frame_is_truncation() {
        let mut f = Vec::new();
        encode_read_head(&mut f, 1, 10);
        f.extend_from_slice(b"abc");
        let mut r = FrameReader::default();
        assert!(matches!(
            r.next(&mut &f[..]),
            Err(FrameError::Truncated { .. })
        ));
    }
}
