//! A resumable frame reader: bytes accumulate in one buffer and whole frames
//! are handed out, so a read timeout between or inside frames loses nothing.
//! The client's reader thread relies on this to wake up periodically and
//! expire requests without a second thread. In a version-2 session each
//! frame's tag is read after its body and handed out with the body's
//! digest, computed as the bytes arrive; in a version-3 session with the
//! sealed body, which the receiver opens in place.

use std::io::{self, Read};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::proto::{FrameError, Header, HEADER_LEN, TAG_LEN};

/// What a version-2 or -3 frame brings to check its tag: the digest of the
/// body received (version 2) and the tag that followed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trailer {
    /// BLAKE3 of the body (version 2; a sealed body is opened instead).
    pub digest: Option<[u8; 32]>,
    /// The tag the sender put after the body.
    pub tag: [u8; TAG_LEN],
}

/// Bodies at least this large are read straight into a buffer of their own
/// and handed over by value, so a READ answer is not copied twice.
pub const OWNED_BODY_MIN: usize = 64 << 10;

/// A frame body: a view into the reader's buffer, a large body it owns, or
/// a large body already in the [`Landing`] its request offered.
pub enum Body<'a> {
    /// Small body, valid until the next call.
    Buffered(&'a mut [u8]),
    /// Large body, read directly from the stream.
    Owned(Vec<u8>),
    /// Large body of this many bytes, read directly into its landing.
    Landed(usize),
}

impl Body<'_> {
    /// The bytes the reader holds; empty for a landed body.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Body::Buffered(b) => b,
            Body::Owned(v) => v,
            Body::Landed(_) => &[],
        }
    }

    /// The bytes the reader holds, to open a sealed body in place; empty
    /// for a landed one.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Body::Buffered(b) => b,
            Body::Owned(v) => v,
            Body::Landed(_) => &mut [],
        }
    }

    /// The body as an owned vector (no copy for large bodies; empty for a
    /// landed one).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            Body::Buffered(b) => b.to_vec(),
            Body::Owned(v) => v,
            Body::Landed(_) => Vec::new(),
        }
    }
}

/// A caller's buffer that a large answer body is read into directly, so a
/// 1 MiB READ is not copied again from a reader-owned buffer.
///
/// The reader writes only while the landing is `Writing`; [`Landing::abandon`]
/// (the owner's drop guard) waits out a write in progress and forbids any
/// later one, so once it returns the buffer is the owner's again. The owner
/// must therefore keep the buffer alive until `abandon` has run: it holds the
/// buffer borrowed for as long as the guard lives.
pub struct Landing {
    ptr: *mut u8,
    len: usize,
    state: Mutex<LandState>,
    idle: Condvar,
}

// SAFETY: `ptr` is only dereferenced by the reader thread between
// `begin_write` and `end_write`, which the state mutex orders against
// `abandon` on the owner's thread; the owner does not touch the buffer until
// the landing is `Done` (reported through the answer) or abandoned.
unsafe impl Send for Landing {}
// SAFETY: as for `Send`: all shared access goes through `state`.
unsafe impl Sync for Landing {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LandState {
    /// Waiting for its answer, or partly filled between two reads.
    Open,
    /// The reader is writing into it now.
    Writing,
    /// Filled; the answer says so.
    Done,
    /// The owner gave the buffer back: never write into it again.
    Abandoned,
}

impl Landing {
    /// Offers `buf` for an answer of exactly `buf.len()` bytes.
    ///
    /// # Safety
    ///
    /// `buf` must stay allocated, and must not be read or written by
    /// anyone else, until [`abandon`](Self::abandon) has returned or the
    /// landing [`is_done`](Self::is_done).
    pub unsafe fn new(buf: &mut [u8]) -> Arc<Self> {
        Arc::new(Self {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            state: Mutex::new(LandState::Open),
            idle: Condvar::new(),
        })
    }

    /// Bytes the answer must carry to land here.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the landing wants no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the body landed.
    pub fn is_done(&self) -> bool {
        *self.state.lock() == LandState::Done
    }

    /// The owner is done with the buffer (answered, failed or dropped):
    /// waits for a write in progress (one read call, bounded by the
    /// stream's read timeout) and forbids any later write.
    pub fn abandon(&self) {
        let mut st = self.state.lock();
        while *st == LandState::Writing {
            self.idle.wait(&mut st);
        }
        if *st != LandState::Done {
            *st = LandState::Abandoned;
        }
    }

    /// Reads from `r` into the landing from `filled`, feeding what arrived
    /// to `hash`; `None` when abandoned.
    fn read_into(
        &self,
        r: &mut impl Read,
        filled: usize,
        hash: Option<&mut blake3::Hasher>,
    ) -> Option<io::Result<usize>> {
        {
            let mut st = self.state.lock();
            if *st != LandState::Open {
                return None;
            }
            *st = LandState::Writing;
        }
        // SAFETY: the state is `Writing`, so `abandon` has not returned and
        // will not until we leave it: the owner's buffer of `len` bytes is
        // alive and not accessed by the owner; `filled <= len`.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.ptr.add(filled), self.len - filled) };
        let r = r.read(dst);
        if let (Ok(n), Some(h)) = (&r, hash) {
            h.update(&dst[..*n]);
        }
        *self.state.lock() = LandState::Open;
        self.idle.notify_all();
        Some(r)
    }

    /// Copies bytes the reader already buffered to the landing's start.
    fn fill_prefix(&self, bytes: &[u8]) -> bool {
        let st = self.state.lock();
        if *st != LandState::Open {
            return false;
        }
        // SAFETY: we hold the state lock with the landing `Open`, so
        // `abandon` cannot return meanwhile; `bytes.len() <= len` (checked by
        // the caller).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr, bytes.len()) };
        drop(st);
        true
    }

    fn finish(&self) -> bool {
        let mut st = self.state.lock();
        if *st != LandState::Open {
            return false;
        }
        *st = LandState::Done;
        true
    }
}

/// Where a large body is being read to.
enum Large {
    /// The body so far; in a tagged session the digest of a prefix that a
    /// landing saw before it was abandoned, and that prefix's length.
    Owned(Vec<u8>, Option<(Box<blake3::Hasher>, usize)>),
    /// The landing, bytes filled, and their running digest (tagged sessions).
    Landing(Arc<Landing>, usize, Option<Box<blake3::Hasher>>),
}

/// A whole body waiting for its tag (tagged sessions), with its digest
/// (version 2).
enum Tail {
    Owned(Vec<u8>, Option<[u8; 32]>),
    Landed(usize, [u8; 32]),
}

/// What follows a frame's body, and what the reader computes for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Protection {
    /// Nothing (version 1).
    #[default]
    Plain,
    /// A tag over the body's digest, computed as the body arrives; large
    /// bodies may land in their request's buffer (version 2).
    Tagged,
    /// A tag after a sealed body, handed out whole to be opened in place:
    /// never landed, as the ciphertext must not reach the owner's buffer
    /// (version 3).
    Sealed,
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
    /// A large body being filled: its header and where it goes.
    large: Option<(Header, Large)>,
    /// A large body complete, its tag still to come.
    tail: Option<(Header, Tail)>,
    /// What follows each frame's body.
    protection: Protection,
    pool: std::sync::Arc<BodyPool>,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self {
            buf: vec![0; 256 << 10],
            start: 0,
            end: 0,
            large: None,
            tail: None,
            protection: Protection::Plain,
            pool: std::sync::Arc::default(),
        }
    }
}

/// One frame as the reader hands it out.
pub type Frame<'a> = (Header, Body<'a>, Option<Trailer>);

impl FrameReader {
    /// A reader that takes its large-body buffers from `pool`; unless
    /// `Plain`, every frame is followed by a [`TAG_LEN`]-byte tag.
    pub fn with_pool(pool: std::sync::Arc<BodyPool>, protection: Protection) -> Self {
        Self {
            pool,
            protection,
            ..Self::default()
        }
    }

    /// Returns the next whole frame, with its [`Trailer`] in a tagged
    /// session. `Ok(None)` is a clean end of stream between frames; a
    /// timeout surfaces as `FrameError::Io` with the partial frame kept for
    /// the next call. `land` is asked, for each large body, whether a
    /// [`Landing`] of exactly its length awaits it.
    pub fn next<'a>(
        &'a mut self,
        r: &mut impl Read,
        land: impl Fn(&Header) -> Option<Arc<Landing>>,
    ) -> Result<Option<Frame<'a>>, FrameError> {
        loop {
            if self.tail.is_some() {
                if self.end - self.start >= TAG_LEN {
                    let mut tag = [0; TAG_LEN];
                    tag.copy_from_slice(&self.buf[self.start..self.start + TAG_LEN]);
                    self.start += TAG_LEN;
                    let Some((h, tail)) = self.tail.take() else {
                        unreachable!("tail checked above")
                    };
                    let (body, digest) = match tail {
                        Tail::Owned(v, d) => (Body::Owned(v), d),
                        Tail::Landed(n, d) => (Body::Landed(n), Some(d)),
                    };
                    return Ok(Some((h, body, Some(Trailer { digest, tag }))));
                }
                self.make_room(TAG_LEN);
                self.fill(r)?;
                continue;
            }
            if let Some((h, large)) = &mut self.large {
                let want = h.body_len as usize;
                if let Large::Landing(landing, filled, hash) = large {
                    while *filled < want {
                        match landing.read_into(r, *filled, hash.as_deref_mut()) {
                            Some(Ok(0)) => {
                                return Err(FrameError::Truncated {
                                    got: HEADER_LEN + *filled,
                                    want: HEADER_LEN + want,
                                })
                            }
                            Some(Ok(n)) => *filled += n,
                            Some(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                            Some(Err(e)) => return Err(e.into()),
                            // The owner left: the rest of the body is drained.
                            None => break,
                        }
                    }
                    let filled = *filled;
                    let hash = hash.take();
                    if filled == want && landing.finish() {
                        let h = *h;
                        self.large = None;
                        match hash {
                            Some(hash) => {
                                let digest = *hash.finalize().as_bytes();
                                self.tail = Some((h, Tail::Landed(want, digest)));
                                continue;
                            }
                            None => return Ok(Some((h, Body::Landed(want), None))),
                        }
                    }
                    // The bytes already landed are the owner's: the drained
                    // copy gets zeros in their place, and the digest goes on
                    // from what the landing saw.
                    let mut body = self.pool.take(want);
                    body.resize(filled, 0);
                    *large = Large::Owned(body, hash.map(|h| (h, filled)));
                }
                let Large::Owned(body, _) = large else {
                    unreachable!("landing handled above")
                };
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
                let Some((h, Large::Owned(body, hash))) = self.large.take() else {
                    unreachable!("owned body checked above")
                };
                let digest = match (self.protection, hash) {
                    (Protection::Plain, _) => return Ok(Some((h, Body::Owned(body), None))),
                    (Protection::Sealed, _) => None,
                    (Protection::Tagged, Some((mut hash, from))) => {
                        hash.update(&body[from..]);
                        Some(*hash.finalize().as_bytes())
                    }
                    (Protection::Tagged, None) => Some(crate::auth::body_digest(&[&body])),
                };
                self.tail = Some((h, Tail::Owned(body, digest)));
                continue;
            }
            let avail = self.end - self.start;
            if avail >= HEADER_LEN {
                let hb: &[u8; HEADER_LEN] = self.buf[self.start..self.start + HEADER_LEN]
                    .try_into()
                    .expect("header");
                let h = Header::decode(hb)?;
                let len = h.body_len as usize;
                let tagged = self.protection != Protection::Plain;
                let trailer = if tagged { TAG_LEN } else { 0 };
                let total = HEADER_LEN + len + trailer;
                if avail >= total {
                    let body = self.start + HEADER_LEN..self.start + HEADER_LEN + len;
                    self.start += total;
                    let trailer = tagged.then(|| {
                        let mut tag = [0; TAG_LEN];
                        tag.copy_from_slice(&self.buf[body.end..body.end + TAG_LEN]);
                        Trailer {
                            digest: (self.protection == Protection::Tagged)
                                .then(|| crate::auth::body_digest(&[&self.buf[body.clone()]])),
                            tag,
                        }
                    });
                    return Ok(Some((h, Body::Buffered(&mut self.buf[body]), trailer)));
                }
                if len >= OWNED_BODY_MIN && avail < HEADER_LEN + len {
                    let have = &self.buf[self.start + HEADER_LEN..self.end];
                    let landing = match self.protection {
                        Protection::Sealed => None,
                        _ => land(&h).filter(|l| l.len() == len),
                    };
                    let large = match landing {
                        Some(l) if l.fill_prefix(have) => {
                            let hash = tagged.then(|| {
                                let mut hash = Box::new(blake3::Hasher::new());
                                hash.update(have);
                                hash
                            });
                            Large::Landing(l, have.len(), hash)
                        }
                        _ => {
                            let mut body = self.pool.take(len);
                            body.extend_from_slice(have);
                            Large::Owned(body, None)
                        }
                    };
                    self.start = self.end;
                    self.large = Some((h, large));
                    continue;
                }
                self.make_room(total);
            } else {
                self.make_room(HEADER_LEN);
            }
            if !self.fill(r)? {
                return Ok(None);
            }
        }
    }

    /// Reads more bytes into the buffer; `false` on a clean end of stream
    /// between frames.
    fn fill(&mut self, r: &mut impl Read) -> Result<bool, FrameError> {
        loop {
            match r.read(&mut self.buf[self.end..]) {
                Ok(0) if self.end == self.start && self.tail.is_none() => return Ok(false),
                Ok(0) => {
                    return Err(FrameError::Truncated {
                        got: self.end - self.start,
                        want: HEADER_LEN.max(self.end - self.start + 1),
                    })
                }
                Ok(n) => {
                    self.end += n;
                    return Ok(true);
                }
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
            match r.next(&mut src, |_| None) {
                Ok(Some((h, body, _))) => {
                    if h.opcode == Opcode::Read {
                        assert!(body.bytes().iter().all(|b| *b == h.request_id as u8));
                        let large = h.request_id % 2 == 1;
                        assert_eq!(matches!(body, Body::Owned(_)), large);
                        assert_eq!(
                            body.bytes().len(),
                            if large { OWNED_BODY_MIN + 3 } else { 5000 }
                        );
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
            r.next(&mut &f[..], |_| None).map(|f| f.map(|(h, ..)| h)),
            Err(FrameError::Truncated { .. })
        ));
    }

    /// Large READ answers land in their request's buffer across split reads
    /// and timeouts; one abandoned mid-body is drained, its buffer untouched
    /// from then on, and the frames after it are intact.
    #[test]
    fn large_bodies_land_in_place_and_an_abandoned_landing_is_drained() {
        let len = OWNED_BODY_MIN + 5;
        let mut stream = Vec::new();
        let mut f = Vec::new();
        for i in 0..6u64 {
            encode_read_head(&mut f, i, len as u32);
            stream.extend_from_slice(&f);
            stream.extend(std::iter::repeat_n(i as u8 + 1, len));
        }
        let mut bufs: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; len]).collect();
        let landings: Vec<Arc<Landing>> = bufs
            .iter_mut()
            // SAFETY: `bufs` outlives the landings, and is only read after
            // every landing is done or abandoned.
            .map(|b| unsafe { Landing::new(b) })
            .collect();
        let mut src = Trickle {
            data: &stream,
            chunk: 4099,
            stall: false,
        };
        let mut r = FrameReader::default();
        let mut landed = Vec::new();
        loop {
            match r.next(&mut src, |h| {
                Some(Arc::clone(&landings[h.request_id as usize]))
            }) {
                Ok(Some((h, body, _))) => match body {
                    Body::Landed(n) => {
                        assert_eq!(n, len);
                        landed.push(h.request_id);
                    }
                    Body::Owned(v) => {
                        assert_eq!(h.request_id, 3, "only the abandoned one is owned");
                        assert_eq!(v.len(), len);
                    }
                    Body::Buffered(_) => panic!("large body buffered"),
                },
                Ok(None) => break,
                Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Abandon request 3 once its body has started arriving.
                    if matches!(&r.large, Some((h, Large::Landing(_, n, _))) if h.request_id == 3 && *n > 0)
                    {
                        landings[3].abandon();
                    }
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(landed, [0, 1, 2, 4, 5]);
        assert!(!landings[3].is_done());
        drop(landings);
        for (i, b) in bufs.iter().enumerate() {
            if i == 3 {
                assert!(b.contains(&0), "abandoned buffer was filled");
            } else {
                assert!(b.iter().all(|x| *x == i as u8 + 1), "buffer {i}");
            }
        }
    }
}
