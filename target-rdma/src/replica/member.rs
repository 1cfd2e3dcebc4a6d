//! One member of a replicated volume: what the core needs of its sessions
//! beyond [`BlobIo`], and the state the core keeps about it.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::blob::{ArenaError, BlobIo};
use crate::client::{ArenaClient, RdmaTransport, Session};
use crate::proto::Status;

/// A session to one member, as the replication core uses it.
///
/// All sessions of one member (every queue's and the background one)
/// must report losses together: over TCP and RDMA they share one
/// [`FlushDomain`](crate::client::FlushDomain), which no other member's
/// sessions share.
pub trait MemberIo: BlobIo + Send + Sync {
    /// Whether the member's peer restarted and lost writes it had
    /// acknowledged and not yet flushed: its data is older than what the
    /// volume acknowledged. It must be true before the restarted peer
    /// answers any request, and stay true (a FLUSH that reports the loss
    /// does not make the data current again).
    fn lost_writes(&self) -> bool;

    /// Presents membership epoch `epoch` to the peer, which from then on
    /// refuses sessions of older epochs (`STALE_EPOCH`); later requests,
    /// reconnects included, carry it. `Ok(false)` when the session has no
    /// epochs (protocol version 1): the peer cannot fence an older writer,
    /// so only the writer lease keeps two writers apart.
    fn raise_epoch(&self, epoch: u64) -> impl Future<Output = Result<bool, ArenaError>>;
}

impl MemberIo for ArenaClient {
    fn lost_writes(&self) -> bool {
        ArenaClient::lost_writes(self)
    }

    async fn raise_epoch(&self, epoch: u64) -> Result<bool, ArenaError> {
        match ArenaClient::raise_epoch(self, epoch).await {
            Ok(_) => Ok(true),
            // A protocol-1 session has no epochs: against such a peer
            // (allowed only with allow_protocol_v1) fencing rests on the
            // writer lease alone. docs/REPLICATION.md says so.
            Err(e) if e.status() == Some(Status::VersionMismatch) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl MemberIo for RdmaTransport {
    fn lost_writes(&self) -> bool {
        self.client().lost_writes()
    }

    fn raise_epoch(&self, epoch: u64) -> impl Future<Output = Result<bool, ArenaError>> {
        MemberIo::raise_epoch(self.client(), epoch)
    }
}

impl MemberIo for Session {
    fn lost_writes(&self) -> bool {
        self.client().lost_writes()
    }

    fn raise_epoch(&self, epoch: u64) -> impl Future<Output = Result<bool, ArenaError>> {
        MemberIo::raise_epoch(self.client(), epoch)
    }
}

/// The sessions of one member: one per queue of the device, and one for
/// background work (rebuild copies, epoch changes), so that background
/// traffic never takes a queue's in-flight slots.
pub struct MemberSessions<S> {
    /// Session `q` serves queue `q`.
    pub queues: Vec<S>,
    /// The rebuild's and the epoch changes' session.
    pub background: S,
    /// The membership epoch the sessions presented when they were opened.
    pub epoch: u64,
}

/// Where a member's session serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lane {
    /// A device queue.
    Queue(usize),
    /// Background work.
    Background,
}

/// What the core keeps about one member it has sessions for.
pub(super) struct Member<S> {
    /// The coordination store's name for the peer.
    pub(super) peer: String,
    /// Unique within the set: a peer that comes back is a new member.
    pub(super) id: u64,
    sessions: MemberSessions<S>,
    /// The epoch each session presented last (queues, then background).
    epochs: Vec<AtomicU64>,
    /// A request to it failed and it has not answered since: reads try it
    /// last, and writes that it fails take it out of the membership.
    suspect: AtomicBool,
    /// Why it became suspect, for the error of a request it fails.
    why: Mutex<Option<String>>,
    /// Recent read latency (EWMA, 1/8 weight per answer), in nanoseconds:
    /// reads go to the fastest healthy member first.
    latency: AtomicU64,
    /// Recent write and flush latency and its mean deviation (EWMAs, in
    /// nanoseconds): how long the others wait for a member that has not
    /// answered yet.
    write_latency: AtomicU64,
    write_deviation: AtomicU64,
    /// The last epoch a session presented is one the peer cannot fence by
    /// (protocol version 1).
    unfenced: AtomicBool,
}

impl<S: MemberIo> Member<S> {
    pub(super) fn new(peer: String, id: u64, sessions: MemberSessions<S>) -> Self {
        let epochs = (0..=sessions.queues.len())
            .map(|_| AtomicU64::new(sessions.epoch))
            .collect();
        Self {
            peer,
            id,
            sessions,
            epochs,
            suspect: AtomicBool::new(false),
            why: Mutex::new(None),
            latency: AtomicU64::new(0),
            write_latency: AtomicU64::new(0),
            write_deviation: AtomicU64::new(0),
            unfenced: AtomicBool::new(false),
        }
    }

    pub(super) fn session(&self, lane: Lane) -> &S {
        match lane {
            Lane::Queue(q) => &self.sessions.queues[q],
            Lane::Background => &self.sessions.background,
        }
    }

    fn epoch_slot(&self, lane: Lane) -> &AtomicU64 {
        match lane {
            Lane::Queue(q) => &self.epochs[q],
            Lane::Background => &self.epochs[self.sessions.queues.len()],
        }
    }

    /// The epoch `lane`'s session presented last.
    pub(super) fn session_epoch(&self, lane: Lane) -> u64 {
        self.epoch_slot(lane).load(Ordering::Acquire)
    }

    /// Raises `lane`'s session to `epoch` (never lowers it).
    pub(super) async fn raise(&self, lane: Lane, epoch: u64) -> Result<(), ArenaError> {
        if self.session_epoch(lane) >= epoch {
            return Ok(());
        }
        let fences = self.session(lane).raise_epoch(epoch).await?;
        self.unfenced.store(!fences, Ordering::Release);
        self.epoch_slot(lane).fetch_max(epoch, Ordering::AcqRel);
        Ok(())
    }

    /// Whether its peer refuses an older writer by epoch: false while its
    /// sessions have no epochs.
    pub(super) fn fences(&self) -> bool {
        !self.unfenced.load(Ordering::Acquire)
    }

    /// Whether its peer restarted and lost acknowledged writes (all its
    /// sessions share one flush domain; any of them may have seen it
    /// first).
    pub(super) fn stale(&self) -> bool {
        self.sessions.background.lost_writes()
            || self.sessions.queues.iter().any(|s| s.lost_writes())
    }

    pub(super) fn is_suspect(&self) -> bool {
        self.suspect.load(Ordering::Acquire)
    }

    /// Marks it failed by `e`; the next membership change deals with it.
    pub(super) fn suspect(&self, why: String) {
        *self.why.lock() = Some(why);
        self.suspect.store(true, Ordering::Release);
    }

    /// It stays a member after all (the last copy): requests go to it again.
    pub(super) fn clear_suspect(&self) {
        self.suspect.store(false, Ordering::Release);
    }

    /// Why it is failing, in words.
    pub(super) fn failure(&self) -> String {
        if self.stale() {
            return format!(
                "member {} restarted and lost acknowledged writes",
                self.peer
            );
        }
        match self.why.lock().as_ref() {
            Some(w) => format!("member {} failed: {w}", self.peer),
            None => format!("member {} failed", self.peer),
        }
    }

    pub(super) fn latency_nanos(&self) -> u64 {
        self.latency.load(Ordering::Relaxed)
    }

    /// Folds one read's latency into the average.
    pub(super) fn observe_latency(&self, d: Duration) {
        let sample = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let old = self.latency.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        };
        self.latency.store(new, Ordering::Relaxed);
    }

    /// Folds one write's (or flush's) latency into its averages.
    pub(super) fn observe_write(&self, d: Duration) {
        let sample = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let mean = self.write_latency.load(Ordering::Relaxed);
        if mean == 0 {
            self.write_latency.store(sample, Ordering::Relaxed);
            return;
        }
        let dev = self.write_deviation.load(Ordering::Relaxed);
        let new_dev = dev - dev / 8 + sample.abs_diff(mean) / 8;
        self.write_deviation.store(new_dev, Ordering::Relaxed);
        self.write_latency
            .store(mean - mean / 8 + sample / 8, Ordering::Relaxed);
    }

    /// A high percentile of its recent write latency (mean plus four mean
    /// deviations): a member this much slower than usual is late.
    pub(super) fn write_p99(&self) -> Duration {
        let mean = self.write_latency.load(Ordering::Relaxed);
        let dev = self.write_deviation.load(Ordering::Relaxed);
        Duration::from_nanos(mean.saturating_add(dev.saturating_mul(4)))
    }

    /// The number of queue sessions.
    pub(super) fn queues(&self) -> usize {
        self.sessions.queues.len()
    }
}
