//! Rebuild: a replacement member (a spare, or a peer back after failing)
//! joins as `syncing`, receives every new write like the others, and is
//! brought up to date by a rate-limited copy of every blob from a healthy
//! member; then, once a FLUSH made the copy durable on it, it is recorded
//! `healthy`, and a spare's failed predecessor `removed`, in the same
//! change.
//!
//! The copy of a key holds the key's lock (keys.rs) from the read on the
//! healthy member to the write on the new one, so it never overwrites a
//! newer write. Several copies run at once, each under its own key's lock:
//! one copy waits out two round trips, so a copy at a time leaves the link
//! idle most of the time.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{select, Either};
use futures::stream::{FuturesUnordered, StreamExt};
use parking_lot::Mutex;

use super::coordinator::{MemberRecord, MemberState};
use super::member::{Lane, Member, MemberIo, MemberSessions};
use super::set::{ReplicaSet, View};
use crate::blob::{ArenaError, ReplicaFailure, Via};
use crate::proto::Status;

/// Copies in flight by default: enough to cover the round trips of a
/// loopback or LAN link (docs/BENCHMARKS.md), few enough that the copies'
/// key locks rarely meet the guest's writes (8 of 64 stripes).
pub const DEFAULT_INFLIGHT: usize = 8;

/// What to rebuild.
#[derive(Clone, Debug)]
pub struct RebuildConfig {
    /// The device's keys: every blob the volume can hold. Keys without a
    /// blob on the healthy member are removed on the new one.
    pub keys: Range<u64>,
    /// Copy rate limit, in bytes per second (0: unlimited).
    pub bytes_per_sec: u64,
    /// How long each membership change of the rebuild may take.
    pub change_deadline: Duration,
    /// The failed member a spare replaces: recorded `removed` when the
    /// spare is recorded `healthy` (at the same epoch), and earlier
    /// `removed` records are dropped then, so the record stays bounded.
    /// `None` for a peer rebuilt in its own place.
    pub replaces: Option<String>,
    /// Copies in flight at once (0 counts as 1).
    pub inflight: usize,
    /// The guest's load: while it is busy, one copy at a time.
    pub guest: Option<GuestLoad>,
}

impl Default for RebuildConfig {
    fn default() -> Self {
        Self {
            keys: 0..0,
            bytes_per_sec: 0,
            change_deadline: Duration::from_secs(5),
            replaces: None,
            inflight: DEFAULT_INFLIGHT,
            guest: None,
        }
    }
}

/// How busy the guest keeps the device, so the rebuild gives way to it:
/// a copy holds a key lock a guest write may wait for, and shares the
/// link and the peers with the guest's requests. Sampled before each copy
/// starts; a busy guest narrows the rebuild to one copy at a time (never
/// to none: a degraded volume must still become whole under a constant
/// load).
#[derive(Clone)]
pub struct GuestLoad {
    /// The guest's requests in flight on the device now.
    pub in_flight: Arc<dyn Fn() -> u64 + Send + Sync>,
    /// Busy above this many.
    pub above: u64,
}

impl GuestLoad {
    fn busy(&self) -> bool {
        (self.in_flight)() > self.above
    }
}

impl fmt::Debug for GuestLoad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestLoad")
            .field("in_flight", &(self.in_flight)())
            .field("above", &self.above)
            .finish()
    }
}

/// Rebuild progress; the daemon exports it.
#[derive(Debug, Default)]
pub struct RebuildStats {
    /// Blob bytes copied to the new member so far.
    pub bytes_copied: AtomicU64,
    /// Blob bytes of the keys not copied yet.
    pub bytes_remaining: AtomicU64,
    /// `(when, bytes_copied)` samples of the recent window, oldest first,
    /// at least [`SAMPLE_EVERY`] apart, so the rate costs a bounded deque
    /// whatever the blob size.
    samples: Mutex<VecDeque<(Instant, u64)>>,
}

/// The window the current rate is measured over: long enough to smooth
/// over a few slow copies, short enough to show a change within seconds.
pub const RATE_WINDOW: Duration = Duration::from_secs(5);
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

impl RebuildStats {
    /// Bytes per second copied over the last [`RATE_WINDOW`] before `now`
    /// (or since the rebuild began, when that is more recent); it decays
    /// while copies stall, and is 0 before any rebuild began.
    pub fn rate(&self, now: Instant) -> u64 {
        let copied = self.bytes_copied.load(Ordering::Relaxed);
        let samples = self.samples.lock();
        let since = now.checked_sub(RATE_WINDOW);
        // The newest sample at or before the window's start, else the
        // oldest (the rebuild began within the window).
        let Some(&(at, base)) = samples
            .iter()
            .rev()
            .find(|(at, _)| since.is_some_and(|s| *at <= s))
            .or(samples.front())
        else {
            return 0;
        };
        let secs = now.saturating_duration_since(at).as_secs_f64();
        if secs <= 0.0 {
            return 0;
        }
        (copied.saturating_sub(base) as f64 / secs) as u64
    }

    /// The time until the rebuild is done at its current rate; `None` when
    /// no rate is known yet.
    pub fn eta(&self, now: Instant) -> Option<Duration> {
        let rate = self.rate(now);
        let left = self.bytes_remaining.load(Ordering::Relaxed);
        if rate == 0 {
            return None;
        }
        Duration::try_from_secs_f64(left as f64 / rate as f64).ok()
    }

    fn begin(&self, now: Instant, total: u64) {
        self.bytes_remaining.store(total, Ordering::Relaxed);
        let mut samples = self.samples.lock();
        samples.clear();
        samples.push_back((now, self.bytes_copied.load(Ordering::Relaxed)));
    }

    fn copied(&self, now: Instant, bytes: u64) {
        let copied = self.bytes_copied.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.bytes_remaining.fetch_sub(bytes, Ordering::Relaxed);
        let mut samples = self.samples.lock();
        if samples
            .back()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) < SAMPLE_EVERY)
        {
            return;
        }
        samples.push_back((now, copied));
        // Keep one sample at or before the window's start: the rate's base.
        while samples.len() > 2
            && samples[1].0 <= now.checked_sub(RATE_WINDOW).unwrap_or(samples[1].0)
        {
            samples.pop_front();
        }
    }
}

/// The rate limit: each copy is admitted no earlier than the previous
/// one's admission plus its bytes' share of the rate. A copy that starts
/// late earns no credit for later ones (the bucket holds one copy), so
/// the rate holds over any window, not only on average.
struct Pacer {
    bytes_per_sec: u64,
    next: Instant,
}

impl Pacer {
    /// When the next copy may start.
    fn due(&self) -> Instant {
        self.next
    }

    /// A copy of `bytes` starts at `now`.
    fn admit(&mut self, now: Instant, bytes: u64) {
        if self.bytes_per_sec == 0 {
            return;
        }
        let nanos = u128::from(bytes) * 1_000_000_000 / u128::from(self.bytes_per_sec);
        let cost = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
        self.next = self.next.max(now) + cost;
    }
}

impl<S: MemberIo> ReplicaSet<S> {
    /// Brings `peer` into the volume with the fresh `sessions`: records it
    /// `syncing` at a new epoch, copies every blob of `cfg.keys` from a
    /// healthy member on the background sessions at `cfg.bytes_per_sec` at
    /// most, flushes it, then records it `healthy`. Fails (and the new
    /// member, if it is the one that failed, is removed) when a copy cannot
    /// be made or made durable.
    pub async fn rebuild(
        &self,
        peer: &str,
        sessions: MemberSessions<S>,
        cfg: &RebuildConfig,
        stats: &RebuildStats,
    ) -> Result<(), ArenaError> {
        let blob = self.view().active[0]
            .0
            .session(Lane::Background)
            .blob_bytes();
        let member = self.join(peer, sessions, blob)?;
        let deadline = || self.clock.now() + cfg.change_deadline;
        self.change(
            &format!("adding {peer} as syncing"),
            deadline(),
            |view| match view.membership.state(peer) {
                Some(MemberState::Syncing) => Ok(None),
                Some(MemberState::Healthy) => Err(self.refusal(
                    ReplicaFailure::NoMember,
                    format!("{peer} is a healthy member already"),
                )),
                _ => {
                    let mut next = view.membership.clone();
                    next.epoch += 1;
                    match next.members.iter_mut().find(|r| r.peer == peer) {
                        Some(r) => r.state = MemberState::Syncing,
                        None => next.members.push(MemberRecord {
                            peer: peer.into(),
                            state: MemberState::Syncing,
                        }),
                    }
                    next.validate().map_err(|why| {
                        self.refusal(ReplicaFailure::NoMember, format!("adding {peer}: {why}"))
                    })?;
                    Ok(Some((next, 0)))
                }
            },
        )
        .await?;
        let total = (cfg.keys.end - cfg.keys.start) * u64::from(blob);
        let start = self.clock.now();
        stats.begin(start, total);
        let pacer = self.copy_all(&member, cfg, stats, blob, start).await?;
        // The last copies' share of the rate: the rebuild as a whole never
        // runs faster than the limit.
        self.clock.sleep_until(pacer.due()).await;
        self.flush_copy(&member).await?;
        self.change(
            &format!("marking {peer} healthy"),
            deadline(),
            |view| match view.membership.state(peer) {
                Some(MemberState::Healthy) => Ok(None),
                Some(MemberState::Syncing) => {
                    let mut next = view.membership.clone();
                    next.epoch += 1;
                    let old = cfg.replaces.as_deref();
                    let replaced =
                        old.is_some_and(|old| next.state(old).is_some_and(|s| !s.is_active()));
                    if replaced {
                        next.members.retain(|r| r.state != MemberState::Removed);
                    }
                    for r in next.members.iter_mut() {
                        if r.peer == peer {
                            r.state = MemberState::Healthy;
                        } else if replaced && Some(r.peer.as_str()) == old {
                            r.state = MemberState::Removed;
                        }
                    }
                    Ok(Some((next, 0)))
                }
                _ => Err(self.refusal(
                    ReplicaFailure::NoMember,
                    format!("{peer} left the membership during its rebuild"),
                )),
            },
        )
        .await
    }

    /// Copies every key of `cfg.keys` to `to`, `cfg.inflight` copies at
    /// once (one while the guest is busy), each admitted by the rate
    /// limit. On a failure no further copy starts; the ones in flight end
    /// before the first error is returned, so none outlives the rebuild.
    async fn copy_all(
        &self,
        to: &Arc<Member<S>>,
        cfg: &RebuildConfig,
        stats: &RebuildStats,
        blob: u32,
        start: Instant,
    ) -> Result<Pacer, ArenaError> {
        let mut pacer = Pacer {
            bytes_per_sec: cfg.bytes_per_sec,
            next: start,
        };
        let mut keys = cfg.keys.clone();
        let mut bufs: Vec<Vec<u8>> = Vec::new();
        let mut running = FuturesUnordered::new();
        let mut failed = None;
        loop {
            let width = match &cfg.guest {
                Some(g) if g.busy() => 1,
                _ => cfg.inflight.max(1),
            };
            let more = failed.is_none() && running.len() < width && !keys.is_empty();
            let done = if more {
                let now = self.clock.now();
                let due = pacer.due();
                if due <= now {
                    if let Some(key) = keys.next() {
                        pacer.admit(now, u64::from(blob));
                        let mut buf = bufs.pop().unwrap_or_else(|| vec![0u8; blob as usize]);
                        running.push(async move {
                            let r = self.copy(to, key, &mut buf).await;
                            (r, buf)
                        });
                    }
                    continue;
                }
                if running.is_empty() {
                    self.clock.sleep_until(due).await;
                    continue;
                }
                match select(running.next(), self.clock.sleep_until(due)).await {
                    Either::Left((done, _)) => done,
                    Either::Right(_) => continue,
                }
            } else {
                running.next().await
            };
            let Some((result, buf)) = done else {
                break;
            };
            bufs.push(buf);
            match result {
                Ok(()) => stats.copied(self.clock.now(), u64::from(blob)),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(pacer),
        }
    }

    /// Adds the member whose sessions are `sessions`; it is in no view yet.
    fn join(
        &self,
        peer: &str,
        sessions: MemberSessions<S>,
        blob: u32,
    ) -> Result<Arc<Member<S>>, ArenaError> {
        let mut members = self.members.write();
        let queues = members[0].queues();
        if sessions.queues.len() != queues || sessions.background.blob_bytes() != blob {
            return Err(self.refusal(
                ReplicaFailure::NoMember,
                format!("{peer}: sessions must match the volume's queues and blob size"),
            ));
        }
        let id = members.iter().map(|m| m.id).max().unwrap_or(0) + 1;
        let m = Arc::new(Member::new(peer.into(), id, sessions));
        members.push(Arc::clone(&m));
        Ok(m)
    }

    /// Copies blob `key` from a healthy member to `to`, under the key's
    /// lock. A failure of `to` removes it.
    ///
    /// A `STALE_EPOCH` answer to a copy made under an older epoch than the
    /// view's now is this writer's own newer epoch, presented on another
    /// session of the member first (a queue's write under the new view,
    /// as io.rs describes for writes): the copy is made again under the
    /// new view, until the change deadline. At the current epoch it is a
    /// newer writer's, and fences.
    async fn copy(&self, to: &Arc<Member<S>>, key: u64, buf: &mut [u8]) -> Result<(), ArenaError> {
        let keys = key..key + 1;
        let deadline = self.clock.now() + self.config.change_deadline;
        loop {
            let (epoch, result) = {
                let _guard = self.keys.lock(&keys).await;
                let view = self.view();
                if !view.active_ids().any(|id| id == to.id) {
                    return Err(self.refusal(
                        ReplicaFailure::NoMember,
                        format!("{} left the membership during its rebuild", to.peer),
                    ));
                }
                let epoch = view.membership.epoch;
                let found = match self.read_healthy(&view, key, buf).await {
                    Ok(found) => found,
                    Err(e) if self.overtaken(&e, epoch, deadline) => continue,
                    Err(e) => return Err(e),
                };
                let s = to.session(Lane::Background);
                let result = async {
                    to.raise(Lane::Background, epoch).await?;
                    match found {
                        Via::Nothing => s.remove(key, key + 1).await.map(|_| ()),
                        _ => s.write(key, 0, buf).await.map(|_| ()),
                    }
                }
                .await;
                (epoch, result)
            };
            let Err(e) = result else {
                return Ok(());
            };
            if self.overtaken(&e, epoch, deadline) {
                continue;
            }
            return Err(self.copy_failed(to, e).await);
        }
    }

    /// Makes the copy durable on `to` before `to` counts as a copy: a
    /// member that restarted during its rebuild lost part of it, and this
    /// FLUSH says so. It also spares the guest's first FLUSH after `to`
    /// turns healthy from writing the whole copy back on `to` alone while
    /// the other members flush a few writes; the straggler bound, derived
    /// from their latencies, would eject `to` again. A failure removes `to`,
    /// as a failed copy does.
    async fn flush_copy(&self, to: &Arc<Member<S>>) -> Result<(), ArenaError> {
        let deadline = self.clock.now() + self.config.change_deadline;
        loop {
            let epoch = self.view().membership.epoch;
            let result = async {
                to.raise(Lane::Background, epoch).await?;
                to.session(Lane::Background).flush().await
            }
            .await;
            let Err(e) = result else {
                return Ok(());
            };
            if self.overtaken(&e, epoch, deadline) {
                continue;
            }
            return Err(self.copy_failed(to, e).await);
        }
    }

    /// `to` failed a request of its rebuild with `e`: it leaves the
    /// membership (a `STALE_EPOCH` of a newer writer fences this one
    /// instead). Returns the error the rebuild ends with.
    async fn copy_failed(&self, to: &Arc<Member<S>>, e: ArenaError) -> ArenaError {
        if e.status() == Some(Status::StaleEpoch) {
            self.fence_stale(&e);
            if let Err(fenced) = self.not_fenced() {
                return fenced;
            }
        }
        to.suspect(e.to_string());
        let deadline = self.clock.now() + self.config.change_deadline;
        match self.exclude(&[to.id].into_iter().collect(), deadline).await {
            Ok(()) => e,
            Err(not_recorded) => not_recorded,
        }
    }

    /// Whether `e`, the answer to a request made under `epoch`, is a
    /// `STALE_EPOCH` caused by this writer's own newer view (and there is
    /// time left to make the request again under it).
    fn overtaken(&self, e: &ArenaError, epoch: u64, deadline: std::time::Instant) -> bool {
        e.status() == Some(Status::StaleEpoch)
            && self.view().membership.epoch > epoch
            && self.clock.now() < deadline
    }

    /// Reads whole blob `key` from a healthy, non-stale member of `view`,
    /// on its background session raised to the view's epoch. A
    /// `STALE_EPOCH` answer under a view that has moved on is returned as
    /// is (the caller reads again under the new one).
    async fn read_healthy(
        &self,
        view: &View<S>,
        key: u64,
        buf: &mut [u8],
    ) -> Result<Via, ArenaError> {
        let epoch = view.membership.epoch;
        let mut last = None;
        for (m, st) in &view.active {
            if *st != MemberState::Healthy || m.stale() {
                continue;
            }
            let read = async {
                m.raise(Lane::Background, epoch).await?;
                m.session(Lane::Background).read(key, 0, buf).await
            };
            match read.await {
                Ok(_) if m.stale() => {}
                Ok(via) => return Ok(via),
                Err(e)
                    if e.status() == Some(Status::StaleEpoch)
                        && self.view().membership.epoch > epoch =>
                {
                    return Err(e)
                }
                Err(e) => last = Some(format!("{}: {e}", m.peer)),
            }
        }
        Err(self.refusal(
            ReplicaFailure::NoMember,
            format!(
                "no healthy member to copy blob {key} from ({})",
                last.unwrap_or_else(|| "none".into())
            ),
        ))
    }
}
