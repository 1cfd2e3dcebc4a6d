//! A session's own rail, set up by hand as a hostile client would: its
//! QP, the server's RAIL_CONNECT answer and a registered local buffer, for
//! tests that post one-sided operations with keys of their choosing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::executor::block_on;

use crate::client::ArenaClient;
use crate::proto::RailAccept;
use crate::rdma::{Access, MemoryRegion, QueuePair, RdmaOp, RdmaProvider, WorkRequest};

/// One QP of a session, connected to the server's QP on one rail. Bringing
/// one up replaces the session's previous QP on that rail at the server
/// (and, isolated per lease, deregisters every key the session had there).
pub struct RawRail {
    qp: Box<dyn QueuePair>,
    /// The server's RAIL_CONNECT answer.
    pub accept: RailAccept,
    mr: MemoryRegion,
    buf: Vec<u8>,
}

impl RawRail {
    /// Rail `rail` of `c`'s session on device `p`, with a local buffer of
    /// `len` bytes.
    pub fn up(p: &Arc<dyn RdmaProvider>, c: &ArenaClient, rail: u8, len: u32) -> RawRail {
        let qp = p.domain().create_qp(16).expect("a QP");
        let accept = block_on(c.rail_connect(rail, qp.endpoint())).expect("RAIL_CONNECT");
        qp.connect(&accept.endpoint).expect("connect the QP");
        let mut buf = vec![0u8; len as usize];
        // SAFETY: `buf` lives as long as the region (declared after it, so
        // dropped later; its heap block never moves) and is only touched by
        // the device while a request the caller waits for is in flight.
        let mr = unsafe {
            p.domain()
                .register(buf.as_mut_ptr(), buf.len(), Access::Local)
        }
        .expect("register the local buffer");
        RawRail {
            qp,
            accept,
            mr,
            buf,
        }
    }

    /// One signaled READ or WRITE of `len` bytes at arena offset `offset`
    /// with `rkey`; returns its completion status. A completion must come
    /// within 20 s (a refused key is NAKed at once; a responder that drops
    /// requests makes the requester's retries run out well before).
    pub fn one_sided(&self, op: RdmaOp, offset: u64, rkey: u32, len: u32) -> u32 {
        self.qp
            .post(&WorkRequest {
                wr_id: 7,
                op,
                local_addr: self.mr.addr as u64,
                lkey: self.mr.lkey,
                len,
                remote_addr: self.accept.arena_base + offset,
                rkey,
            })
            .expect("post");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut done = Vec::new();
            self.qp.poll(&mut done).expect("poll");
            if let Some(c) = done.iter().find(|c| c.wr_id == 7) {
                return c.status;
            }
            assert!(Instant::now() < deadline, "no completion within 20 s");
            self.qp
                .wait(Duration::from_millis(100))
                .expect("wait for a completion");
        }
    }

    /// The local buffer (what a READ brought, or what a WRITE sends).
    pub fn local(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}
