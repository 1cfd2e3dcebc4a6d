//! One queue's request path through a replicated volume: writes to every
//! member, acknowledged only under a membership every member of which
//! acknowledged them; flushes likewise; reads from one healthy member,
//! hedged to a second.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{join_all, select, Either};
use futures::stream::{FuturesUnordered, StreamExt};

use super::coordinator::MemberState;
use super::member::{Lane, Member, MemberIo};
use super::set::{ReplicaSet, View};
use crate::blob::{ArenaError, BlobIo, ErrorKind, ReplicaFailure, Transport, Via};
use crate::proto::{Opcode, Status};

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
    async fn round<T, F>(
        &self,
        view: &View<S>,
        opcode: Opcode,
        op: F,
    ) -> Result<Round<T>, ArenaError>
    where
        F: AsyncFn(&S) -> Result<T, ArenaError>,
    {
        let epoch = view.membership.epoch;
        let mut round = Round {
            epoch,
            acked: HashSet::new(),
            failed: HashSet::new(),
            answers: Vec::new(),
        };
        let mut sent = Vec::new();
        let mut healthy = Vec::new();
        for (m, st) in &view.active {
            if m.stale() {
                round.failed.insert(m.id);
            } else {
                sent.push(Arc::clone(m));
                healthy.push(*st == MemberState::Healthy);
            }
        }
        let results = self.gather(&sent, &healthy, epoch, opcode, &op).await;
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
                // This writer's own newer epoch reached the peer first (the
                // view moved on while the request was out, and the new
                // view's epoch was presented on another of the member's
                // sessions): neither acked nor failed, so `mutate` sends
                // it again under the new view. Were a newer writer's epoch
                // behind it, that round is refused at the current epoch
                // and fences.
                Err(e)
                    if verdict(&e) == Verdict::Fenced
                        && self.set.view().membership.epoch > epoch => {}
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
            self.set.not_fenced()?;
        }
        match fault {
            Some(e) => Err(e),
            None => Ok(round),
        }
    }

    /// Sends `op` to each of `sent` and collects the answers in order. Once
    /// a healthy member (`healthy[i]`) answered, the others get the
    /// straggler bound ([`ReplicaConfig::straggler_after`](super::ReplicaConfig))
    /// to answer too; one that has not by then is failed like a dead member
    /// (its request is dropped: a late answer is discarded, and the member
    /// is rebuilt before it serves again), so a stopped or stuck peer costs
    /// a write that bound, not the request timeout. Only a healthy answer
    /// starts the clock: a syncing member alone holds no copy to go on
    /// with, and the healthy one it would be waiting for may be slow only
    /// because it serves the rebuild's reads. A syncing member is held to
    /// the request timeout, not the bound: it is slowed by its own copy,
    /// a dead one fails that copy anyway, and ejecting it throws the copy
    /// away.
    async fn gather<T, F>(
        &self,
        sent: &[Arc<Member<S>>],
        healthy: &[bool],
        epoch: u64,
        opcode: Opcode,
        op: &F,
    ) -> Vec<Result<T, ArenaError>>
    where
        F: AsyncFn(&S) -> Result<T, ArenaError>,
    {
        let lane = self.lane;
        let clock = &self.set.clock;
        let started = clock.now();
        let mut pending: FuturesUnordered<_> = sent
            .iter()
            .enumerate()
            .map(|(i, m)| async move {
                let start = clock.now();
                let r = async {
                    m.raise(lane, epoch).await?;
                    op(m.session(lane)).await
                }
                .await;
                if r.is_ok() {
                    m.observe_write(clock.now().saturating_duration_since(start));
                }
                (i, r)
            })
            .collect();
        let mut results: Vec<Option<Result<T, ArenaError>>> = sent.iter().map(|_| None).collect();
        let mut late_at = None;
        let mut expired = false;
        while !pending.is_empty() {
            // Past the bound, only syncing members are still waited for.
            let syncing_pending = results.iter().zip(healthy).any(|(r, h)| r.is_none() && !*h);
            if expired && !syncing_pending {
                break;
            }
            let next = pending.next();
            let answer = match late_at.filter(|_| !expired) {
                None => next.await,
                Some(at) => {
                    let timer = std::pin::pin!(clock.sleep_until(at));
                    match select(next, timer).await {
                        Either::Left((a, _)) => a,
                        Either::Right(_) => {
                            expired = true;
                            continue;
                        }
                    }
                }
            };
            let Some((i, r)) = answer else { break };
            if r.is_ok() && healthy[i] && late_at.is_none() && !pending.is_empty() {
                let bound = self.set.config.straggler_bound(sent.iter().map(|m| &**m));
                late_at = Some(clock.now() + bound);
            }
            results[i] = Some(r);
        }
        drop(pending);
        results
            .into_iter()
            .zip(sent)
            .map(|(r, m)| {
                r.unwrap_or_else(|| {
                    self.set.count_straggler();
                    Err(ArenaError::TimedOut {
                        op: opcode,
                        peer: m.peer.clone(),
                        after: late_at
                            .map_or(Duration::ZERO, |at| at.saturating_duration_since(started)),
                    })
                })
            })
            .collect()
    }

    /// Runs the mutation `op` until every member of the membership current
    /// at acknowledgement acknowledged it: failed members are removed
    /// (recorded) first, and a membership that gained a member meanwhile
    /// gets the mutation again.
    ///
    /// `keys` are the blobs it changes (none for a flush): while a member
    /// is syncing, their locks are held while the members are sent to, so
    /// no rebuild copy of those keys interleaves.
    async fn mutate<T, F>(
        &self,
        keys: Option<Range<u64>>,
        opcode: Opcode,
        op: F,
    ) -> Result<Vec<T>, ArenaError>
    where
        F: AsyncFn(&S) -> Result<T, ArenaError>,
    {
        let set = &self.set;
        // A standby sends no mutation to the members (they would take it:
        // it presented the writer's epoch to read).
        if set.is_standby() {
            if !set.activates_on_write() {
                return Err(set
                    .may_acknowledge(&set.view())
                    .err()
                    .unwrap_or_else(|| set.refusal(ReplicaFailure::Standby, "a standby".into())));
            }
            set.activate().await?;
        }
        let deadline = set.clock.now() + set.config.change_deadline;
        loop {
            set.not_fenced()?;
            // Handed over meanwhile: nothing more goes out.
            if set.is_standby() {
                return Err(set.refusal(
                    ReplicaFailure::Standby,
                    "the writer role was handed over while the request ran".into(),
                ));
            }
            let view = set.view();
            let syncing = view
                .active
                .iter()
                .any(|(_, st)| *st == MemberState::Syncing);
            let round = match &keys {
                Some(keys) if syncing => {
                    let _guard = set.keys.lock(keys).await;
                    self.round(&view, opcode, &op).await?
                }
                _ => self.round(&view, opcode, &op).await?,
            };
            if !round.failed.is_empty() {
                set.exclude(&round.failed, deadline).await?;
            }
            let now = set.view();
            let covered = now.active_ids().all(|id| round.acked.contains(&id));
            if covered && !round.acked.is_empty() {
                set.may_acknowledge(&now)?;
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

impl<S: MemberIo> ReplicatedIo<S> {
    /// A read while the store does not confirm the writer role: served
    /// from one healthy member, and confirmed by a one-byte read on every
    /// other active member of the view, each at this writer's epoch. A
    /// writer that took the volume over raised its epoch on at least one
    /// member of this view before it acknowledged anything, so a read all
    /// of them accept is not older than any write the other acknowledged
    /// (docs/REPLICATION.md). A member that does not answer leaves the
    /// read unconfirmed: it fails (the membership cannot change without the
    /// store).
    async fn confirmed_read(
        &self,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> Result<Via, ArenaError> {
        let view = self.set.view();
        let epoch = view.membership.epoch;
        let readers = self.readers(&view);
        let Some(first) = readers.first() else {
            return Err(self.set.refusal(
                ReplicaFailure::NoMember,
                "no healthy member to read from".into(),
            ));
        };
        let others: Vec<_> = view
            .active
            .iter()
            .filter(|(m, _)| m.id != first.id)
            .map(|(m, _)| Arc::clone(m))
            .collect();
        let probe = out.len().min(1);
        let lane = self.lane;
        let checks = join_all(others.iter().map(|m| async move {
            let mut byte = [0u8; 1];
            m.raise(lane, epoch).await?;
            m.session(lane).read(key, offset, &mut byte[..probe]).await
        }));
        let (primary, checks) =
            futures::future::join(self.read_from(first, key, offset, out), checks).await;
        let via = match primary {
            Ok(via) => via,
            Err(e) => return Err(self.unconfirmed(first, e, epoch)),
        };
        for (m, r) in others.iter().zip(checks) {
            if let Err(e) = r {
                return Err(self.unconfirmed(m, e, epoch));
            }
        }
        Ok(via)
    }

    /// A standby's read: confirmed as while the role is unconfirmed, under
    /// the record's current epoch (a member at a newer one refuses it, and
    /// the standby follows the record and reads again).
    async fn standby_read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        self.set.follow_record().await?;
        match self.confirmed_read(key, offset, out).await {
            Err(_) if self.set.is_behind() => {
                self.set.follow_record().await?;
                self.confirmed_read(key, offset, out).await
            }
            r => r,
        }
    }

    /// The error of a read that `m` could not confirm with `e`.
    fn unconfirmed(&self, m: &Member<S>, e: ArenaError, epoch: u64) -> ArenaError {
        match verdict(&e) {
            Verdict::Request => e,
            Verdict::Fenced if self.set.is_standby() => {
                self.set.fence_stale(&e);
                self.set.refusal(
                    ReplicaFailure::Unrecorded,
                    format!("member {} has seen a newer record than this standby: {e}", m.peer),
                )
            }
            Verdict::Fenced if self.set.view().membership.epoch == epoch => {
                self.set.fence_stale(&e);
                self.set
                    .refusal(ReplicaFailure::Fenced, format!("a newer writer owns the volume: {e}"))
            }
            _ => self.set.refusal(
                ReplicaFailure::Unrecorded,
                format!(
                    "the writer role is not confirmed and member {} could not confirm the read: {e}",
                    m.peer
                ),
            ),
        }
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
        if self.set.is_standby() {
            return self.standby_read(key, offset, out).await;
        }
        if self.set.reads_need_confirmation()? {
            return self.confirmed_read(key, offset, out).await;
        }
        let mut tried = HashSet::new();
        let mut last = None;
        loop {
            let view = self.set.view();
            let epoch = view.membership.epoch;
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
                    // As in `round`: our own newer epoch, presented on
                    // another session first; read it again under it.
                    Err(e)
                        if verdict(&e) == Verdict::Fenced
                            && self.set.view().membership.epoch > epoch =>
                    {
                        tried.remove(&id);
                    }
                    Err(e) if verdict(&e) == Verdict::Fenced => {
                        self.set.fence_stale(&e);
                        self.set.not_fenced()?;
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
            .mutate(Some(key..key + 1), Opcode::Write, async |s: &S| {
                s.write(key, offset, data).await
            })
            .await?;
        Ok(vias.into_iter().fold(Via::Nothing, Via::and))
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        let counts = self
            .mutate(Some(start..end), Opcode::Remove, async |s: &S| {
                s.remove(start, end).await
            })
            .await?;
        Ok(counts.into_iter().max().unwrap_or(0))
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        // A standby acknowledged no write, so it has nothing to make
        // durable; and a flush is not a write, so it never takes the role
        // (ublkd stopping flushes every device, QEMU closing its disk).
        if self.set.is_standby() {
            return Ok(());
        }
        self.mutate(None, Opcode::Flush, async |s: &S| s.flush().await)
            .await?;
        Ok(())
    }
}
