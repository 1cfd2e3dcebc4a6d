//! A member that fails on command, for the replication tests (feature
//! `test-utils`): blobs in memory with the durability an arena peer has
//! (a crash keeps only what the last FLUSH covered, and says so to every
//! session from then on), and the faults a network has (partition, delay,
//! a request or its answer dropped), on the test's clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::clock::Timers;
use super::member::{MemberIo, MemberSessions};
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::proto::{Opcode, Status};

/// Faults of a [`FakePeer`], as seen by every session to it.
#[derive(Clone, Debug, Default)]
pub struct FakeFault {
    /// Every request fails as a broken connection (partition, peer down).
    pub down: bool,
    /// Every request is answered this late.
    pub delay: Duration,
    /// The next this many requests are lost before the peer sees them
    /// (they time out).
    pub drop_requests: u32,
    /// The next this many requests are applied and their answers lost
    /// (they time out).
    pub drop_answers: u32,
    /// New blobs are refused beyond this many (quota).
    pub quota_blobs: Option<usize>,
    /// Reads and writes of a session that presented an older epoch than
    /// the peer has seen are refused `STALE_EPOCH`, as arenad does.
    pub fence_epochs: bool,
}

#[derive(Default)]
struct PeerState {
    blobs: HashMap<u64, Vec<u8>>,
    /// What the last FLUSH made durable: what a crash keeps.
    durable: HashMap<u64, Vec<u8>>,
    /// Writes acknowledged since the last FLUSH.
    unflushed: bool,
    /// One flag per set of sessions (a flush domain): a crash that lost
    /// acknowledged writes sets every existing one, for good; sessions
    /// opened later start clean.
    domains: Vec<Arc<Domain>>,
    epoch: u64,
    fault: FakeFault,
}

/// One arena peer holding one volume's blobs in memory.
pub struct FakePeer {
    name: String,
    blob_bytes: u32,
    clock: Arc<dyn Timers>,
    state: Mutex<PeerState>,
    /// Requests it is answering now, and the most it ever answered at once.
    in_flight: AtomicU64,
    peak: AtomicU64,
}

impl FakePeer {
    /// An empty peer named `name`.
    pub fn new(name: &str, blob_bytes: u32, clock: Arc<dyn Timers>) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            blob_bytes,
            clock,
            state: Mutex::default(),
            in_flight: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        })
    }

    /// Its name (the coordination store's peer identity).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sessions for a device of `queues` queues.
    pub fn sessions(self: &Arc<Self>, queues: usize) -> MemberSessions<FakeSession> {
        let domain = Arc::new(Domain::default());
        self.state.lock().domains.push(Arc::clone(&domain));
        let s = || FakeSession {
            peer: Arc::clone(self),
            domain: Arc::clone(&domain),
            epoch: AtomicU64::new(0),
        };
        MemberSessions {
            queues: (0..queues).map(|_| s()).collect(),
            background: s(),
            epoch: 0,
        }
    }

    /// Cuts the `nth` set of sessions made by [`sessions`](Self::sessions)
    /// off from it, or heals the cut: a partition between one writer and
    /// the peer that other writers do not see.
    pub fn cut_sessions(&self, nth: usize, cut: bool) {
        if let Some(d) = self.state.lock().domains.get(nth) {
            d.cut.store(cut, Ordering::Release);
        }
    }

    /// Replaces its faults.
    pub fn set_fault(&self, f: FakeFault) {
        self.state.lock().fault = f;
    }

    /// Changes its faults in place.
    pub fn update_fault(&self, f: impl FnOnce(&mut FakeFault)) {
        f(&mut self.state.lock().fault);
    }

    /// Crashes and restarts it: what the last FLUSH did not cover is gone.
    pub fn crash(&self) {
        let mut s = self.state.lock();
        s.blobs = s.durable.clone();
        if s.unflushed {
            for d in &s.domains {
                d.lost.store(true, Ordering::Release);
                d.report.store(true, Ordering::Release);
            }
        }
        s.unflushed = false;
    }

    /// Blob `key` as it holds it now, without faults.
    pub fn blob(&self, key: u64) -> Option<Vec<u8>> {
        self.state.lock().blobs.get(&key).cloned()
    }

    /// Blob `key` as the last FLUSH left it durable: what a crash keeps.
    pub fn durable_blob(&self, key: u64) -> Option<Vec<u8>> {
        self.state.lock().durable.get(&key).cloned()
    }

    /// Whether a crash lost writes it had acknowledged to its newest
    /// sessions (the ones a volume that rebuilt it uses).
    pub fn lost(&self) -> bool {
        self.state
            .lock()
            .domains
            .last()
            .is_some_and(|d| d.lost.load(Ordering::Acquire))
    }

    /// The most requests it answered at once, over all its sessions.
    pub fn peak_in_flight(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// The highest membership epoch presented to it.
    pub fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    /// Waits the injected delay, then applies `f` unless a fault says
    /// otherwise.
    async fn request<T>(
        &self,
        op: Opcode,
        f: impl FnOnce(&mut PeerState) -> Result<T, ArenaError>,
    ) -> Result<T, ArenaError> {
        let now = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        self.peak.fetch_max(now, Ordering::AcqRel);
        let delay = self.state.lock().fault.delay;
        if !delay.is_zero() {
            self.clock.sleep(delay).await;
        }
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        let timed_out = || ArenaError::TimedOut {
            op,
            peer: self.name.clone(),
            after: Duration::from_secs(1),
        };
        let mut s = self.state.lock();
        if s.fault.down {
            return Err(ArenaError::Disconnected {
                peer: self.name.clone(),
                detail: "partitioned (injected)".into(),
            });
        }
        if s.fault.drop_requests > 0 {
            s.fault.drop_requests -= 1;
            return Err(timed_out());
        }
        let r = f(&mut s)?;
        if s.fault.drop_answers > 0 {
            s.fault.drop_answers -= 1;
            return Err(timed_out());
        }
        Ok(r)
    }

    fn status(&self, op: Opcode, status: Status, message: &str) -> ArenaError {
        ArenaError::Status {
            op,
            peer: self.name.clone(),
            status,
            message: message.into(),
        }
    }

    fn check_range(&self, op: Opcode, offset: u32, len: usize) -> Result<(), ArenaError> {
        if u64::from(offset) + len as u64 > u64::from(self.blob_bytes) {
            return Err(self.status(op, Status::Protocol, "range past the blob end"));
        }
        Ok(())
    }
}

/// A session to a [`FakePeer`].
pub struct FakeSession {
    peer: Arc<FakePeer>,
    domain: Arc<Domain>,
    /// The highest epoch this session presented.
    epoch: AtomicU64,
}

impl FakeSession {
    /// A broken connection while its sessions are cut off from the peer.
    fn check_cut(&self) -> Result<(), ArenaError> {
        if self.domain.cut.load(Ordering::Acquire) {
            return Err(ArenaError::Disconnected {
                peer: self.peer.name.clone(),
                detail: "this writer is partitioned from the peer (injected)".into(),
            });
        }
        Ok(())
    }

    /// `STALE_EPOCH` when the peer fences epochs and has seen a newer one
    /// than this session presented.
    fn check_epoch(&self, s: &PeerState, op: Opcode) -> Result<(), ArenaError> {
        if s.fault.fence_epochs && self.epoch.load(Ordering::Acquire) < s.epoch {
            return Err(self
                .peer
                .status(op, Status::StaleEpoch, "stale epoch (fake)"));
        }
        Ok(())
    }
}

/// What the sessions of one member share, as TCP sessions share a
/// `FlushDomain`.
#[derive(Default)]
struct Domain {
    /// A crash lost writes acknowledged to them (for good).
    lost: AtomicBool,
    /// They are partitioned from the peer (other sessions are not).
    cut: AtomicBool,
    /// Their next FLUSH reports that loss.
    report: AtomicBool,
}

impl BlobIo for FakeSession {
    fn transport(&self) -> Transport {
        Transport::InProcess
    }

    fn blob_bytes(&self) -> u32 {
        self.peer.blob_bytes
    }

    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        let p = &self.peer;
        p.check_range(Opcode::Read, offset, out.len())?;
        let found = p
            .request(Opcode::Read, |s| {
                self.check_cut()?;
                self.check_epoch(s, Opcode::Read)?;
                Ok(s.blobs.get(&key).cloned())
            })
            .await?;
        let at = offset as usize;
        match found {
            Some(b) => {
                out.copy_from_slice(&b[at..at + out.len()]);
                Ok(Via::InProcess)
            }
            None => {
                out.fill(0);
                Ok(Via::Nothing)
            }
        }
    }

    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        let p = &self.peer;
        p.check_range(Opcode::Write, offset, data.len())?;
        let bytes = p.blob_bytes as usize;
        p.request(Opcode::Write, |s| {
            self.check_cut()?;
            self.check_epoch(s, Opcode::Write)?;
            let full = s.fault.quota_blobs.is_some_and(|q| s.blobs.len() >= q);
            if full && !s.blobs.contains_key(&key) {
                return Err(p.status(Opcode::Write, Status::QuotaExceeded, "quota (injected)"));
            }
            let b = s.blobs.entry(key).or_insert_with(|| vec![0; bytes]);
            b[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            s.unflushed = true;
            Ok(Via::InProcess)
        })
        .await
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        self.peer
            .request(Opcode::Remove, |s| {
                self.check_cut()?;
                self.check_epoch(s, Opcode::Remove)?;
                let before = s.blobs.len();
                s.blobs.retain(|k, _| !(start..end).contains(k));
                s.unflushed = true;
                Ok((before - s.blobs.len()) as u64)
            })
            .await
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        let p = &self.peer;
        let report = &self.domain.report;
        p.request(Opcode::Flush, |s| {
            self.check_cut()?;
            self.check_epoch(s, Opcode::Flush)?;
            if report.swap(false, Ordering::AcqRel) {
                return Err(ArenaError::UnflushedDataLost {
                    peer: p.name.clone(),
                    old: 1,
                    new: 2,
                });
            }
            s.durable = s.blobs.clone();
            s.unflushed = false;
            Ok(())
        })
        .await
    }
}

impl MemberIo for FakeSession {
    fn lost_writes(&self) -> bool {
        self.domain.lost.load(Ordering::Acquire)
    }

    /// As a protocol-1 peer when it does not fence epochs.
    async fn raise_epoch(&self, epoch: u64) -> Result<bool, ArenaError> {
        self.peer
            .request(Opcode::Hello, |s| {
                self.check_cut()?;
                if s.fault.fence_epochs && epoch < s.epoch {
                    return Err(self.peer.status(
                        Opcode::Epoch,
                        Status::StaleEpoch,
                        "stale epoch (fake)",
                    ));
                }
                s.epoch = s.epoch.max(epoch);
                self.epoch.fetch_max(epoch, Ordering::AcqRel);
                Ok(s.fault.fence_epochs)
            })
            .await
    }
}
