//! One queue's request path through a replicated volume: writes to every
//! member, acknowledged only under a membership every member of which
//! acknowledged them; flushes likewise; reads from one healthy member,
//! hedged to a second.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use futures::future::{join_all, select, Either};

use super::coordinator::MemberState;
use super::member::{Lane, Member, MemberIo};
use super::set::{ReplicaSet, View};
use crate::blob::{ArenaError, BlobIo, ErrorKind, ReplicaFailure, Transport, Via};
use crate::proto::Status;

/// What a member's error says about whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// The request itself is at fault (range past the blob end, quota,
    /// full peer): the caller gets the error, no member is blamed.
    Request,
    /// The member failed: it must leave the membership before anything it
    /// missed is acknowledged.
    Member,
    /// The peer has seen a newer membership epoch (`STALE_EPOCH`): another
    /// writer took the volume over, and this one is fenced.
    Fenced,
}

fn verdict(e: &ArenaError) -> Verdict {
    match e.kind() {
        ErrorKind::Status(Status::Protocol | Status::QuotaExceeded | Status::NoSpace) => {
            Verdict::Request
        }
        _ if e.status() == Some(Status::StaleEpoch) => Verdict::Fenced,
        _ => Verdict::Member,
    }
}

/// A replicated volume as one queue's [`BlobIo`]: the queue's session of
/// each member, and the device's shared [`ReplicaSet`].
pub struct ReplicatedIo<S> {
    set: Arc<ReplicaSet<S>>,
    lane: Lane,
}

/// What one mutation (write, remove) got from the members it was sent to.
struct Round<T> {
    epoch: u64,
    acked: HashSet<u64>,
    failed: HashSet<u64>,
    answers: Vec<T>,
}

impl<S: MemberIo> ReplicatedIo<S> {
    pub(super) fn new(set: Arc<ReplicaSet<S>>, lane: Lane) -> Self {
        Self { set, lane }
    }

    /// The device's shared state.
    pub fn set(&self) -> &Arc<ReplicaSet<S>> {
        &self.set
    }

    /// Sends `op` to every member of the view that is not known stale, in
    /// parallel, on this queue's sessions. A suspect member (one whose
    /// earlier request failed) gets it too: what it missed was not
    /// acknowledged, or it would be out of the membership, so it may
    /// acknowledge this one.
    async fn round<T, F>(&self, view: &View<S>, op: F) -> Result<Round<T>, ArenaError>
    where
        F: AsyncFn(&S) -> Result<T, ArenaError>,
    {
        let epoch = view.membership.epoch;
        let lane = self.lane;
        let mut round = Round {
            epoch,
            acked: HashSet::new(),
            failed: HashSet::new(),
            answers: Vec::new(),
        };
        let mut sent = Vec::new();
        for (m, _) in &view.active {
            if m.stale() {
                round.failed.insert(m.id);
            } else {
                sent.push(Arc::clone(m));
            }
        }
        let results = join_all(sent.iter().map(|m| {
            let op = &op;
            async move {
                m.raise(lane, epoch).await?;
                op(m.session(lane)).await
            }
        }))
        .await;
        let mut fault = None;
        let mut fenced = None;
        for (m, r) in sent.iter().zip(results) {
            match r {
                // A peer that lost acknowledged writes may have answered:
                // its answer does not count.
                Ok(_) if m.stale() => {
                    round.failed.insert(m.id);
                }
                Ok(v) => {
                    m.clear_suspect();
                    round.acked.insert(m.id);
                    round.answers.push(v);
                }
                Err(e) if verdict(&e) == Verdict::Request => fault = Some(e),
                Err(e) if verdict(&e) == Verdict::Fenced => fenced = Some(e),
                Err(e) => {
                    m.suspect(e.to_string());
                    round.failed.insert(m.id);
                }
            }
        }
        if let Some(e) = fenced {
            // Not a member failure: the member is fine, this writer is
            // not. Nothing is acknowledged from here on.
            self.set.fence_stale(&e);
            self.set.may_acknowledge()?;
        }
        match fault {
            Some(e) => Err(e),
            None => Ok(round),
        }
    }

    /// Runs the mutation `op` until every member of the membership current
    /// at acknowledgement acknowledged it: failed members are removed
    /// (recorded) first, and a membership that gained a member meanwhile
    /// gets the mutation again.
    ///
    /// `keys` are the blobs it changes (none for a flush): while a member
    /// is syncing, their locks are held while the members are sent to, so
    /// no rebuild copy of those keys interleaves.
    async fn mutate<T, F>(&self, keys: Option<Range<u64>>, op: F) -> Result<Vec<T>, ArenaError>
    where
        F: AsyncFn(&S) -> Result<T, ArenaError>,
    {
        let set = &self.set;
        let deadline = set.clock.now() + set.config.change_deadline;
        loop {
            set.may_acknowledge()?;
            let view = set.view();
            let syncing = view
                .active
                .iter()
                .any(|(_, st)| *st == MemberState::Syncing);
            let round = match &keys {
                Some(keys) if syncing => {
                    let _guard = set.keys.lock(keys).await;
                    self.round(&view, &op).await?
                }
                _ => self.round(&view, &op).await?,
            };
            if !round.failed.is_empty() {
                set.exclude(&round.failed, deadline).await?;
            }
            let now = set.view();
            let covered = now.active_ids().all(|id| round.acked.contains(&id));
            if covered && !round.acked.is_empty() {
                set.may_acknowledge()?;
                return Ok(round.answers);
            }
            if set.clock.now() >= deadline {
                return Err(set.refusal(
                    ReplicaFailure::Unrecorded,
                    format!(
                        "the membership kept changing (epoch {} -> {}) and the request \
                         could not reach all of it in time",
                        round.epoch, now.membership.epoch
                    ),
                ));
            }
        }
    }

    /// The members a read may go to: healthy and not stale; fastest
    /// first, suspect ones last (they hold every acknowledged write, or
    /// they would be out of the membership, but they may be down).
    fn readers(&self, view: &View<S>) -> Vec<Arc<Member<S>>> {
        let mut r: Vec<_> = view
            .active
            .iter()
            .filter(|(m, st)| *st == MemberState::Healthy && !m.stale())
            .map(|(m, _)| Arc::clone(m))
            .collect();
        r.sort_by_key(|m| (m.is_suspect(), m.latency_nanos()));
        r
    }

    /// One read from `m` into `out`; the answer is dropped when `m` turned
    /// out stale (its peer may have answered after losing acknowledged
    /// writes).
    async fn read_from(
        &self,
        m: &Member<S>,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> Result<Via, ArenaError> {
        let epoch = self.set.view().membership.epoch;
        m.raise(self.lane, epoch).await?;
        let start = self.set.clock.now();
        let via = m.session(self.lane).read(key, offset, out).await?;
        if m.stale() {
            self.set.count_stale_answer();
            return Err(self.set.refusal(
                ReplicaFailure::NoMember,
                format!("{}: its answer was discarded", m.failure()),
            ));
        }
        m.clear_suspect();
        m.observe_latency(self.set.clock.now().saturating_duration_since(start));
        Ok(via)
    }

    /// A read from `first`, hedged to `second` after the configured delay
    /// into a buffer of its own; the first success wins and the other read
    /// is dropped (its session discards the late answer).
    async fn hedged(
        &self,
        first: &Member<S>,
        second: Option<&Member<S>>,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> Vec<(u64, Result<Via, ArenaError>)> {
        let Some(second) = second else {
            return vec![(first.id, self.read_from(first, key, offset, out).await)];
        };
        let mut spare = vec![0u8; out.len()];
        // The futures borrow `out` and `spare` until the end of this block.
        let (results, spare_won) = {
            let primary = std::pin::pin!(self.read_from(first, key, offset, out));
            let timer = self.set.clock.sleep(self.set.config.hedge_after);
            let primary = match select(primary, timer).await {
                Either::Left((r, _)) => return vec![(first.id, r)],
                Either::Right((_, primary)) => primary,
            };
            let backup = std::pin::pin!(self.read_from(second, key, offset, &mut spare));
            match select(primary, backup).await {
                Either::Left((Ok(v), _)) => (vec![(first.id, Ok(v))], false),
                Either::Right((Ok(v), _)) => (vec![(second.id, Ok(v))], true),
                Either::Left((Err(e), backup)) => {
                    let r = backup.await;
                    let won = r.is_ok();
                    (vec![(first.id, Err(e)), (second.id, r)], won)
                }
                Either::Right((Err(e), primary)) => {
                    let r = primary.await;
                    (vec![(second.id, Err(e)), (first.id, r)], false)
                }
            }
        };
        if spare_won {
            out.copy_from_slice(&spare);
        }
        self.set.count_hedge(spare_won);
        results
    }
}

impl<S: MemberIo> BlobIo for ReplicatedIo<S> {
    fn transport(&self) -> Transport {
        self.set.view().active[0].0.session(self.lane).transport()
    }

    fn blob_bytes(&self) -> u32 {
        self.set.view().active[0].0.session(self.lane).blob_bytes()
    }

    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        let mut tried = HashSet::new();
        let mut last = None;
        loop {
            let view = self.set.view();
            let readers: Vec<_> = self
                .readers(&view)
                .into_iter()
                .filter(|m| !tried.contains(&m.id))
                .collect();
            let Some(first) = readers.first() else {
                let why = last.map_or_else(
                    || "no healthy member to read from".to_string(),
                    |e: ArenaError| format!("no healthy member answered; last: {e}"),
                );
                return Err(self.set.refusal(ReplicaFailure::NoMember, why));
            };
            for (id, r) in self
                .hedged(first, readers.get(1).map(|m| &**m), key, offset, out)
                .await
            {
                tried.insert(id);
                match r {
                    Ok(via) => return Ok(via),
                    Err(e) if verdict(&e) == Verdict::Request => return Err(e),
                    Err(e) if verdict(&e) == Verdict::Fenced => {
                        self.set.fence_stale(&e);
                        self.set.may_acknowledge()?;
                    }
                    Err(e) => {
                        if let Some(m) = readers.iter().find(|m| m.id == id) {
                            if !matches!(e.kind(), ErrorKind::Replica(_)) {
                                m.suspect(e.to_string());
                            }
                        }
                        last = Some(e);
                    }
                }
            }
        }
    }

    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        let vias = self
            .mutate(Some(key..key + 1), async |s: &S| {
                s.write(key, offset, data).await
            })
            .await?;
        Ok(vias.into_iter().fold(Via::Nothing, Via::and))
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        let counts = self
            .mutate(Some(start..end), async |s: &S| s.remove(start, end).await)
            .await?;
        Ok(counts.into_iter().max().unwrap_or(0))
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        self.mutate(None, async |s: &S| s.flush().await).await?;
        Ok(())
    }
}
