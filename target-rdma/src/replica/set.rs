//! The state one device's queues share: the recorded membership, the
//! members' sessions, and the one path that changes the membership (the
//! removal of failed members, recorded in the coordination store before
//! anything they missed is acknowledged).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{select, Either};
use futures::lock::Mutex as AsyncMutex;
use parking_lot::{Mutex, RwLock};
use ublk_metrics::events;

use super::clock::Timers;
use super::coordinator::{
    CoordError, CoordErrorKind, Coordinator, Lease, MemberState, Membership, Swap,
};
use super::keys::KeyLocks;
use super::member::{Lane, Member, MemberIo, MemberSessions};
use super::ReplicatedIo;
use crate::blob::{ArenaError, ReplicaFailure};
use crate::proto::Status;

/// How a replicated volume waits.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    /// A read not answered after this long is sent to a second healthy
    /// member as well; the first answer wins.
    pub hedge_after: Duration,
    /// How long a request may wait for a membership change (the removal of
    /// a member that failed it) before it fails unacknowledged.
    pub change_deadline: Duration,
    /// Longest wait for one coordination request.
    pub coord_timeout: Duration,
    /// Pause between attempts to reach the coordination store.
    pub coord_retry: Duration,
    /// How long a write or flush waits for a member once a healthy member
    /// answered it: `Some` fixes it; `None` derives it from the members'
    /// recent latency (`straggler_factor` times the slowest member's p99,
    /// the waited-for one's own included, at least `straggler_floor`). A
    /// member that has not answered by then is failed like a dead one.
    pub straggler_after: Option<Duration>,
    /// The least a derived straggler bound waits.
    pub straggler_floor: Duration,
    /// How many of its p99 latencies a member may take beyond the others.
    pub straggler_factor: u32,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            hedge_after: Duration::from_millis(2),
            change_deadline: Duration::from_secs(5),
            coord_timeout: Duration::from_secs(1),
            coord_retry: Duration::from_millis(50),
            straggler_after: None,
            straggler_floor: Duration::from_millis(300),
            straggler_factor: 4,
        }
    }
}

impl ReplicaConfig {
    /// How long to wait for the members that have not answered, once a
    /// healthy one did; `members` are all the request went to: a member
    /// that is always slow (a syncing one under its copy load) is not a
    /// stopped one.
    pub(super) fn straggler_bound<'a, S: MemberIo + 'a>(
        &self,
        members: impl Iterator<Item = &'a Member<S>>,
    ) -> Duration {
        if let Some(fixed) = self.straggler_after {
            return fixed;
        }
        let slowest = members.map(|m| m.write_p99()).max().unwrap_or_default();
        (slowest * self.straggler_factor).max(self.straggler_floor)
    }
}

/// Where this writer stands for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// The coordination store confirms the role: requests run as usual.
    Confirmed,
    /// The store has not confirmed the role lately (it is unreachable, or
    /// the lease was lost and is being taken back): writes are still
    /// acknowledged where every member fences an older writer by epoch,
    /// reads are confirmed by every member, and nothing can change the
    /// membership. Says why.
    Unconfirmed(&'static str),
    /// This writer may no longer serve; says why.
    Fenced(String),
    /// This process holds no writer role (a standby, or a writer that
    /// handed the role over): reads are served, confirmed by every active
    /// member; nothing is acknowledged until
    /// [`ReplicaSet::activate`] takes the role.
    Standby,
}

impl Standing {
    /// Stable lower-case name (`ublkctl`, metrics).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Confirmed => "writer",
            Self::Unconfirmed(_) => "unconfirmed",
            Self::Fenced(_) => "fenced",
            Self::Standby => "standby",
        }
    }
}

/// What a replicated volume counted; the daemon exports it.
#[derive(Debug, Default)]
pub struct ReplicaCounters {
    /// Members taken out of the membership (recorded as failed).
    pub removals: AtomicU64,
    /// Membership changes recorded by this writer.
    pub epoch_changes: AtomicU64,
    /// Reads sent to a second member because the first was slow.
    pub hedged_reads: AtomicU64,
    /// Hedged reads the second member answered first.
    pub hedge_wins: AtomicU64,
    /// Answers discarded because their member turned out stale or failed.
    pub stale_answers: AtomicU64,
    /// Requests refused because the writer is fenced.
    pub fenced: AtomicU64,
    /// Requests refused because a removal could not be recorded in time.
    pub unrecorded: AtomicU64,
    /// Members failed because they answered too late after the others.
    pub stragglers: AtomicU64,
    /// Times the writer role was confirmed again after its lease was lost.
    pub roles_regained: AtomicU64,
    /// Times a peer's `STALE_EPOCH` showed this writer it was fenced (at
    /// most once per writer: it stays fenced).
    pub stale_epoch_fences: AtomicU64,
    /// Times this process took the writer role from another (a hand-over
    /// in).
    pub handovers_in: AtomicU64,
    /// Times this process handed the writer role over to another.
    pub handovers_out: AtomicU64,
}

impl ReplicaCounters {
    pub(super) fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// The membership as the requests see it: one immutable snapshot, replaced
/// whole on every change, so a request never mixes two epochs.
pub(super) struct View<S> {
    pub(super) membership: Membership,
    /// The active members (healthy and syncing), in record order.
    pub(super) active: Vec<(Arc<Member<S>>, MemberState)>,
}

impl<S> View<S> {
    /// Active members' ids.
    pub(super) fn active_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.active.iter().map(|(m, _)| m.id)
    }
}

/// One replicated volume of one device: shared by all its queues
/// ([`ReplicaSet::queue`] gives each queue its [`ReplicatedIo`]).
pub struct ReplicaSet<S> {
    volume: String,
    pub(super) coord: Arc<dyn Coordinator>,
    pub(super) clock: Arc<dyn Timers>,
    pub(super) config: ReplicaConfig,
    /// Every member this writer has sessions for; a peer that came back
    /// (rebuilt) is a later entry of the same peer, which supersedes the
    /// earlier one.
    pub(super) members: RwLock<Vec<Arc<Member<S>>>>,
    view: RwLock<Arc<View<S>>>,
    /// The per-key guard between rebuild copies and writes.
    pub(super) keys: KeyLocks,
    /// Serializes this writer's membership changes: each is conditioned
    /// on the epoch the previous one stored.
    change: AsyncMutex<()>,
    /// Set once this writer learns it may no longer write; cleared only
    /// by [`take_over`](Self::take_over).
    fenced: AtomicBool,
    fence_reason: Mutex<Option<String>>,
    /// The tenure of the writer role the record was last checked under
    /// ([`Lease::Held`]'s `term`).
    term: AtomicU64,
    /// A role check's swap whose answer was lost: if the record holds it,
    /// the check is done.
    checking: Mutex<Option<Membership>>,
    /// Set while this process holds no writer role (a standby): see
    /// [`Standing::Standby`] and handover.rs.
    pub(super) standby: AtomicBool,
    /// A standby's view is behind the record (a peer answered
    /// `STALE_EPOCH`): its next read follows the record first.
    pub(super) behind: AtomicBool,
    /// A standby takes the role on its first write instead of refusing it.
    pub(super) activate_on_write: AtomicBool,
    /// Serializes hand-overs (in and out).
    pub(super) handover: AsyncMutex<()>,
    /// The last hand-overs, newest last (at most
    /// [`HANDOVER_HISTORY`](super::handover::HANDOVER_HISTORY)).
    pub(super) history: Mutex<std::collections::VecDeque<super::Handover>>,
    stats: ReplicaCounters,
}

impl<S: MemberIo> ReplicaSet<S> {
    /// Opens the volume as its writer: reads the record, takes a new epoch
    /// (which fences any earlier writer's sessions) and presents it to
    /// every active member. `sessions` must cover every active member of
    /// the record, each with the same number of queues.
    pub async fn open(
        volume: impl Into<String>,
        coord: Arc<dyn Coordinator>,
        clock: Arc<dyn Timers>,
        config: ReplicaConfig,
        sessions: Vec<(String, MemberSessions<S>)>,
    ) -> Result<Arc<Self>, ArenaError> {
        let volume: String = volume.into();
        let name = volume.clone();
        let refuse = |detail: String| ArenaError::Replica {
            volume: name.clone(),
            failure: ReplicaFailure::NoMember,
            detail,
        };
        let unavailable = |e: CoordError| ArenaError::Replica {
            volume: name.clone(),
            failure: ReplicaFailure::Unrecorded,
            detail: format!("cannot open the volume: {e}"),
        };
        let term = match coord.lease() {
            Lease::Held { term, .. } => term,
            Lease::Lost => {
                return Err(unavailable(CoordError::new(
                    CoordErrorKind::Unavailable,
                    "the writer lease is being taken back",
                )))
            }
            Lease::Taken { holder } => {
                return Err(unavailable(CoordError::new(
                    CoordErrorKind::LeaseHeld,
                    format!("the volume is held by {holder}"),
                )))
            }
        };
        let record = coord.load().await.map_err(unavailable)?;
        let mut next = record.clone();
        next.epoch = record.epoch + 1;
        let set = Self::build(volume, coord, clock, config, sessions, term, record.clone())?;
        let view = set.view_of(&next).map_err(refuse)?;
        match set.coord.compare_and_swap(record.epoch, next).await {
            Ok(Swap::Done) => {}
            Ok(Swap::Lost(now)) => {
                return Err(unavailable(CoordError::new(
                    CoordErrorKind::LeaseHeld,
                    format!("another writer changed the record meanwhile, to {now}"),
                )))
            }
            Err(e) => return Err(unavailable(e)),
        }
        set.install(view).await;
        Ok(set)
    }

    /// The set over `sessions`, serving `record` under tenure `term`, with
    /// no view installed yet.
    pub(super) fn build(
        volume: String,
        coord: Arc<dyn Coordinator>,
        clock: Arc<dyn Timers>,
        config: ReplicaConfig,
        sessions: Vec<(String, MemberSessions<S>)>,
        term: u64,
        record: Membership,
    ) -> Result<Arc<Self>, ArenaError> {
        let name = volume.clone();
        let refuse = |detail: String| ArenaError::Replica {
            volume: name.clone(),
            failure: ReplicaFailure::NoMember,
            detail,
        };
        let queues = sessions.first().map_or(0, |(_, s)| s.queues.len());
        if queues == 0 || sessions.iter().any(|(_, s)| s.queues.len() != queues) {
            return Err(refuse(
                "every member needs one session per queue, and at least one queue".into(),
            ));
        }
        let members: Vec<_> = sessions
            .into_iter()
            .enumerate()
            .map(|(i, (peer, s))| Arc::new(Member::new(peer, i as u64, s)))
            .collect();
        let bytes = members[0].session(Lane::Background).blob_bytes();
        if members
            .iter()
            .any(|m| m.session(Lane::Background).blob_bytes() != bytes)
        {
            return Err(refuse("members disagree on the blob size".into()));
        }
        Ok(Arc::new(Self {
            view: RwLock::new(Arc::new(View {
                membership: record,
                active: Vec::new(),
            })),
            volume,
            coord,
            clock,
            config,
            members: RwLock::new(members),
            keys: KeyLocks::default(),
            change: AsyncMutex::new(()),
            fenced: AtomicBool::new(false),
            fence_reason: Mutex::new(None),
            term: AtomicU64::new(term),
            checking: Mutex::new(None),
            standby: AtomicBool::new(false),
            behind: AtomicBool::new(false),
            activate_on_write: AtomicBool::new(false),
            handover: AsyncMutex::new(()),
            history: Mutex::default(),
            stats: ReplicaCounters::default(),
        }))
    }

    /// The request path of queue `q`.
    pub fn queue(self: &Arc<Self>, q: usize) -> Option<ReplicatedIo<S>> {
        let queues = self.members.read()[0].queues();
        (q < queues).then(|| ReplicatedIo::new(Arc::clone(self), Lane::Queue(q)))
    }

    /// The volume's name.
    pub fn volume(&self) -> &str {
        &self.volume
    }

    /// The membership requests are served under now.
    pub fn membership(&self) -> Membership {
        self.view().membership.clone()
    }

    /// What the volume counted.
    pub fn stats(&self) -> &ReplicaCounters {
        &self.stats
    }

    pub(super) fn view(&self) -> Arc<View<S>> {
        Arc::clone(&self.view.read())
    }

    /// The sessions of `record`'s active members; an error names an active
    /// peer this writer has no sessions for.
    pub(super) fn view_of(&self, record: &Membership) -> Result<View<S>, String> {
        let members = self.members.read();
        let mut active = Vec::new();
        for r in record.active() {
            let m = members
                .iter()
                .rev()
                .find(|m| m.peer == r.peer)
                .ok_or_else(|| format!("{record} names peer {} without sessions", r.peer))?;
            active.push((Arc::clone(m), r.state));
        }
        Ok(View {
            membership: record.clone(),
            active,
        })
    }

    /// Makes `view` the one requests see, then presents its epoch on the
    /// members' background sessions (queues present it on their next
    /// request). A member that cannot take it becomes suspect.
    pub(super) async fn install(&self, view: View<S>) {
        let epoch = view.membership.epoch;
        let active: Vec<_> = view.active.iter().map(|(m, _)| Arc::clone(m)).collect();
        *self.view.write() = Arc::new(view);
        for m in active {
            match m.raise(Lane::Background, epoch).await {
                Ok(()) => {}
                Err(e) if e.status() == Some(Status::StaleEpoch) => self.fence_stale(&e),
                Err(e) => m.suspect(format!("cannot present epoch {epoch}: {e}")),
            }
        }
    }

    /// An error for a refusal of the volume's own.
    pub(super) fn refusal(&self, failure: ReplicaFailure, detail: String) -> ArenaError {
        match failure {
            ReplicaFailure::Fenced => ReplicaCounters::count(&self.stats.fenced),
            ReplicaFailure::Unrecorded => ReplicaCounters::count(&self.stats.unrecorded),
            ReplicaFailure::NoMember | ReplicaFailure::Standby => {}
        }
        ArenaError::Replica {
            volume: self.volume.clone(),
            failure,
            detail,
        }
    }

    /// Fences this writer for good: `why` says what showed it (logged
    /// once, at the first).
    pub(super) fn fence(&self, why: String) {
        let mut reason = self.fence_reason.lock();
        if reason.is_none() {
            tracing::error!(event = events::REPLICA_FENCED, volume = %self.volume, reason = %why);
        }
        reason.get_or_insert(why);
        self.fenced.store(true, Ordering::Release);
    }

    /// A peer answered `STALE_EPOCH`: it has seen a newer membership epoch
    /// than this writer's, so a newer writer owns the volume: fenced for
    /// good, counted once.
    pub(super) fn fence_stale(&self, e: &ArenaError) {
        // A standby was never the writer: its view is only behind.
        if self.standby.load(Ordering::Acquire) {
            self.behind.store(true, Ordering::Release);
            return;
        }
        if !self.fenced.load(Ordering::Acquire) {
            ReplicaCounters::count(&self.stats.stale_epoch_fences);
        }
        self.fence(format!("a newer writer owns the volume: {e}"));
    }

    /// Where this writer stands now. A role found taken by another writer
    /// fences it for good.
    pub fn standing(&self) -> Standing {
        if self.standby.load(Ordering::Acquire) {
            return Standing::Standby;
        }
        if self.fenced.load(Ordering::Acquire) {
            return Standing::Fenced(self.fence_reason.lock().clone().unwrap_or_default());
        }
        match self.coord.lease() {
            Lease::Held { term, .. } if term != self.term.load(Ordering::Acquire) => {
                Standing::Unconfirmed(
                    "the writer role was taken again and the record is not checked yet",
                )
            }
            Lease::Held { until, .. } if until > self.clock.now() => Standing::Confirmed,
            Lease::Held { .. } => Standing::Unconfirmed(
                "the coordination store has not confirmed the writer lease in time",
            ),
            Lease::Lost => Standing::Unconfirmed(
                "the coordination store lost the writer lease; taking it back",
            ),
            Lease::Taken { holder } => {
                let why = format!("another writer holds the volume: {holder}");
                self.fence(why.clone());
                Standing::Fenced(why)
            }
        }
    }

    /// Whether this writer may acknowledge a mutation that every active
    /// member of `view` applied at its epoch: when the role is confirmed,
    /// or when every such member fences an older writer by epoch (no other
    /// writer can take the volume without raising the epoch in the store
    /// and at the members, after which they refuse this one).
    pub(super) fn may_acknowledge(&self, view: &View<S>) -> Result<(), ArenaError> {
        match self.standing() {
            Standing::Confirmed => Ok(()),
            Standing::Unconfirmed(why) => match view.active.iter().find(|(m, _)| !m.fences()) {
                None => Ok(()),
                Some((m, _)) => Err(self.refusal(
                    ReplicaFailure::Unrecorded,
                    format!(
                        "{why}, and member {} cannot fence an older writer by epoch \
                         (protocol version 1): nothing is acknowledged without the lease",
                        m.peer
                    ),
                )),
            },
            Standing::Fenced(why) => Err(self.refusal(ReplicaFailure::Fenced, why)),
            Standing::Standby => Err(self.refusal(
                ReplicaFailure::Standby,
                "this process does not hold the volume's writer role (a standby): it \
                 acknowledges no write until it is activated"
                    .into(),
            )),
        }
    }

    /// Refuses once this writer is fenced.
    pub(super) fn not_fenced(&self) -> Result<(), ArenaError> {
        match self.standing() {
            Standing::Fenced(why) => Err(self.refusal(ReplicaFailure::Fenced, why)),
            _ => Ok(()),
        }
    }

    /// Whether a read must be confirmed by every active member: while the
    /// store does not confirm the role, another writer may have taken the
    /// volume and moved on without a member this writer would read from,
    /// but not without raising the epoch on one of the members of this
    /// writer's view.
    pub(super) fn reads_need_confirmation(&self) -> Result<bool, ArenaError> {
        match self.standing() {
            Standing::Confirmed => Ok(false),
            Standing::Unconfirmed(_) | Standing::Standby => Ok(true),
            Standing::Fenced(why) => Err(self.refusal(ReplicaFailure::Fenced, why)),
        }
    }

    /// Checks the record once the role was taken again under a new lease
    /// (the coordinator re-took the writer key after the store had lost the
    /// lease): if nobody moved the record on meanwhile, this writer raises
    /// the epoch under the new tenure and is confirmed again; if somebody
    /// did, another writer served the volume, and this one is fenced for
    /// good. The device's supervisor calls it periodically; a failure to
    /// reach the store leaves the writer unconfirmed for the next call.
    pub async fn check_role(&self) -> Result<(), ArenaError> {
        self.not_fenced()?;
        let Lease::Held { term, .. } = self.coord.lease() else {
            return Ok(());
        };
        if term == self.term.load(Ordering::Acquire) {
            return Ok(());
        }
        let deadline = self.clock.now() + self.config.change_deadline;
        let unrecorded = |detail: String| self.refusal(ReplicaFailure::Unrecorded, detail);
        let Some(_guard) = self.within(deadline, self.change.lock()).await else {
            return Err(unrecorded(
                "checking the role: another change is running".into(),
            ));
        };
        let timeout = self.clock.now() + self.config.coord_timeout;
        let record = self.read_record("checking the role", timeout).await?;
        let view = self.view();
        let ours = self.checking.lock().take();
        if ours.as_ref() == Some(&record) {
            return self.confirmed_as(term, record).await;
        }
        if record.epoch != view.membership.epoch {
            let why = format!(
                "the writer lease was lost, and when it was taken back the volume's record had \
                 moved on (epoch {} -> {}): another writer served the volume meanwhile; \
                 `ublkctl recover` takes it over",
                view.membership.epoch, record.epoch
            );
            self.fence(why.clone());
            return Err(self.refusal(ReplicaFailure::Fenced, why));
        }
        let mut next = record.clone();
        next.epoch += 1;
        let timeout = self.clock.now() + self.config.coord_timeout;
        *self.checking.lock() = Some(next.clone());
        match self
            .within(
                timeout,
                self.coord.compare_and_swap(record.epoch, next.clone()),
            )
            .await
        {
            Some(Ok(Swap::Done)) => {
                self.checking.lock().take();
                self.confirmed_as(term, next).await
            }
            Some(Ok(Swap::Lost(now))) => {
                self.checking.lock().take();
                let why = format!(
                    "the volume's record moved on while the writer role was taken back (to {now})"
                );
                self.fence(why.clone());
                Err(self.refusal(ReplicaFailure::Fenced, why))
            }
            Some(Err(e)) if e.kind == CoordErrorKind::LeaseHeld => {
                self.fence(e.to_string());
                Err(self.refusal(ReplicaFailure::Fenced, e.to_string()))
            }
            Some(Err(e)) => Err(unrecorded(format!("checking the role: {e}"))),
            None => Err(unrecorded("checking the role: the swap timed out".into())),
        }
    }

    /// The stored record, read by `until`; `what` names the step in the
    /// error (`Unrecorded`) when the store does not answer.
    async fn read_record(&self, what: &str, until: Instant) -> Result<Membership, ArenaError> {
        match self.within(until, self.coord.load()).await {
            Some(Ok(r)) => Ok(r),
            Some(Err(e)) => Err(self.refusal(ReplicaFailure::Unrecorded, format!("{what}: {e}"))),
            None => Err(self.refusal(
                ReplicaFailure::Unrecorded,
                format!("{what}: the store did not answer"),
            )),
        }
    }

    /// The record `now` (stored under tenure `term`) is this writer's:
    /// installed, and the role confirmed.
    async fn confirmed_as(&self, term: u64, now: Membership) -> Result<(), ArenaError> {
        let v = self.view_of(&now).map_err(|why| {
            self.refusal(
                ReplicaFailure::Unrecorded,
                format!("checking the role: {why}"),
            )
        })?;
        ReplicaCounters::count(&self.stats.epoch_changes);
        ReplicaCounters::count(&self.stats.roles_regained);
        self.term.store(term, Ordering::Release);
        tracing::info!(event = events::REPLICA_ROLE_REGAINED, volume = %self.volume, membership = %now);
        self.install(v).await;
        Ok(())
    }

    /// Takes the volume over again after this writer was fenced (what
    /// `ublkctl recover` of a fenced device means): with the role held in
    /// the store again, reads the record, raises its epoch (fencing
    /// whoever served the volume meanwhile) and serves under it. Refused
    /// while the role is not held, or when the record names a peer this
    /// writer has no sessions for.
    pub async fn take_over(&self) -> Result<(), ArenaError> {
        let unrecorded = |detail: String| self.refusal(ReplicaFailure::Unrecorded, detail);
        let term = match self.coord.lease() {
            Lease::Held { term, .. } => term,
            Lease::Lost => return Err(unrecorded("the writer lease is not taken back yet".into())),
            Lease::Taken { holder } => {
                return Err(self.refusal(
                    ReplicaFailure::Fenced,
                    format!("another writer holds the volume: {holder}"),
                ))
            }
        };
        let next = self.raise_role(term, "taking over").await?;
        tracing::warn!(event = events::REPLICA_TAKEN_OVER, volume = %self.volume, membership = %next);
        Ok(())
    }

    /// Makes this process the writer under tenure `term` (held in the
    /// store): reads the record and stores it again at the next epoch, a
    /// syncing member recorded failed (its copy ran in the writer that
    /// had the role before, and stopped with it: the rebuild thread brings
    /// it back), then serves under it, which presents the epoch to every
    /// member and so fences the previous writer. `what` names the step in
    /// errors. Returns the record stored.
    pub(super) async fn raise_role(&self, term: u64, what: &str) -> Result<Membership, ArenaError> {
        let unrecorded = |detail: String| self.refusal(ReplicaFailure::Unrecorded, detail);
        let deadline = self.clock.now() + self.config.change_deadline;
        let Some(_guard) = self.within(deadline, self.change.lock()).await else {
            return Err(unrecorded(format!("{what}: another change is running")));
        };
        let record = self.read_record(what, deadline).await?;
        let mut next = record.clone();
        next.epoch += 1;
        for m in &mut next.members {
            if m.state == MemberState::Syncing {
                m.state = MemberState::Failed;
            }
        }
        let v = self
            .view_of(&next)
            .map_err(|why| unrecorded(format!("{what}: {why}")))?;
        match self
            .within(
                deadline,
                self.coord.compare_and_swap(record.epoch, next.clone()),
            )
            .await
        {
            Some(Ok(Swap::Done)) => {}
            Some(Ok(Swap::Lost(now))) => {
                return Err(unrecorded(format!("{what}: the record moved to {now}")))
            }
            Some(Err(e)) => return Err(unrecorded(format!("{what}: {e}"))),
            None => return Err(unrecorded(format!("{what}: the swap timed out"))),
        }
        self.term.store(term, Ordering::Release);
        *self.fence_reason.lock() = None;
        self.fenced.store(false, Ordering::Release);
        self.behind.store(false, Ordering::Release);
        self.standby.store(false, Ordering::Release);
        ReplicaCounters::count(&self.stats.epoch_changes);
        self.install(v).await;
        Ok(next)
    }

    /// Why each member this writer knows failed, by peer (the newest
    /// member of each peer), for `ublkctl show`.
    pub fn member_failures(&self) -> Vec<(String, String)> {
        let members = self.members.read();
        let mut out: Vec<(String, String)> = Vec::new();
        for m in members.iter().rev() {
            if out.iter().any(|(p, _)| *p == m.peer) {
                continue;
            }
            if m.is_suspect() || m.stale() {
                out.push((m.peer.clone(), m.failure()));
            }
        }
        out
    }

    pub(super) fn count_straggler(&self) {
        ReplicaCounters::count(&self.stats.stragglers);
    }

    pub(super) fn count_stale_answer(&self) {
        ReplicaCounters::count(&self.stats.stale_answers);
    }

    pub(super) fn count_hedge(&self, won: bool) {
        ReplicaCounters::count(&self.stats.hedged_reads);
        if won {
            ReplicaCounters::count(&self.stats.hedge_wins);
        }
    }

    /// Runs `f` with a deadline on the set's clock; `None` when it passed.
    pub(super) async fn within<T>(
        &self,
        deadline: Instant,
        f: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        let f = std::pin::pin!(f);
        match select(f, self.clock.sleep_until(deadline)).await {
            Either::Left((v, _)) => Some(v),
            Either::Right(_) => None,
        }
    }

    /// Takes the members `failed` (ids) out of the membership, recorded in
    /// the coordination store, unless a change since took them out
    /// already. Returns once no member of the current view is in `failed`;
    /// errs when that cannot be recorded by `deadline`, when it would leave
    /// no healthy member, or when this writer is fenced. Each member it
    /// takes out is logged with why it failed: the record says only that.
    pub(super) async fn exclude(
        &self,
        failed: &HashSet<u64>,
        deadline: Instant,
    ) -> Result<(), ArenaError> {
        let what = failed_names(&self.members.read(), failed).join(", ");
        // (peer, why) of the members the last plan that had any took out;
        // `change` plans once more after recording it, and finds none. Not
        // a list made before `change` takes its lock: a concurrent exclude
        // of the same member (another queue's) would log it too.
        let out = Mutex::new(Vec::new());
        let result = self
            .change(&format!("removing {what}"), deadline, |view| {
                let still: Vec<_> = view
                    .active
                    .iter()
                    .filter(|(m, _)| failed.contains(&m.id))
                    .map(|(m, _)| Arc::clone(m))
                    .collect();
                if still.is_empty() {
                    return Ok(None);
                }
                let next = next_of(&view.membership, &still);
                if next.validate().is_err() {
                    // No healthy copy would be left: keep the last ones and let
                    // the caller fail; they may come back.
                    let why: Vec<_> = still.iter().map(|m| m.failure()).collect();
                    for m in &still {
                        m.clear_suspect();
                    }
                    return Err(self.refusal(
                        ReplicaFailure::NoMember,
                        format!("no healthy member left: {}", why.join("; ")),
                    ));
                }
                *out.lock() = still
                    .iter()
                    .map(|m| (m.peer.clone(), m.failure()))
                    .collect();
                Ok(Some((next, still.len() as u64)))
            })
            .await;
        if result.is_ok() {
            for (peer, why) in out.into_inner() {
                tracing::warn!(event = events::REPLICAS_MEMBER_OUT, volume = %self.volume, peer, reason = why);
            }
        }
        result
    }

    /// Records the change `plan` makes to the current view, and installs
    /// the record. `plan` says what to store next and how many members it
    /// takes out, or `None` when nothing remains to do (the change, or one
    /// that makes it moot, is in place). A lost race or an unknown outcome
    /// is followed by reading the record and planning again, until
    /// `deadline`.
    pub(super) async fn change(
        &self,
        what: &str,
        deadline: Instant,
        plan: impl Fn(&View<S>) -> Result<Option<(Membership, u64)>, ArenaError>,
    ) -> Result<(), ArenaError> {
        let unrecorded = |detail: String| self.refusal(ReplicaFailure::Unrecorded, detail);
        let Some(_guard) = self.within(deadline, self.change.lock()).await else {
            return Err(unrecorded(format!(
                "{what}: timed out waiting for another membership change"
            )));
        };
        let mut last_error = String::from("no attempt finished in time");
        let mut tried = false;
        loop {
            self.not_fenced()?;
            let view = self.view();
            let Some((next, removals)) = plan(&view)? else {
                return Ok(());
            };
            // Checked only with work left: a change recorded and
            // installed just past the deadline is done, not failed.
            if tried && self.clock.now() >= deadline {
                break;
            }
            tried = true;
            // Only a confirmed writer may change the record: one whose
            // role lapsed could otherwise follow another writer's record.
            if let Standing::Unconfirmed(why) = self.standing() {
                last_error = why.into();
                let pause = self.clock.now() + self.config.coord_retry;
                if pause >= deadline {
                    break;
                }
                self.clock.sleep_until(pause).await;
                continue;
            }
            let expected = view.membership.epoch;
            let cas = self.coord.compare_and_swap(expected, next.clone());
            let timeout = deadline.min(self.clock.now() + self.config.coord_timeout);
            let settled = match self.within(timeout, cas).await {
                Some(Ok(Swap::Done)) => Some(next.clone()),
                Some(Ok(Swap::Lost(now))) => Some(now),
                Some(Err(e)) if e.kind == CoordErrorKind::LeaseHeld => {
                    self.fence(format!("{e}"));
                    return self.not_fenced();
                }
                Some(Err(e)) => {
                    last_error = e.to_string();
                    None
                }
                None => {
                    last_error = "the compare-and-swap timed out".into();
                    None
                }
            };
            // After an unknown outcome, the record says what happened.
            let settled = match settled {
                Some(s) => Some(s),
                None => {
                    let pause = self.clock.now() + self.config.coord_retry;
                    if pause >= deadline {
                        break;
                    }
                    self.clock.sleep_until(pause).await;
                    let timeout = deadline.min(self.clock.now() + self.config.coord_timeout);
                    match self.within(timeout, self.coord.load()).await {
                        Some(Ok(now)) if now.epoch > expected => Some(now),
                        Some(Ok(_)) => None,
                        Some(Err(e)) => {
                            last_error = e.to_string();
                            None
                        }
                        None => None,
                    }
                }
            };
            if let Some(record) = settled {
                let v = self.view_of(&record).map_err(|why| {
                    unrecorded(format!(
                        "{what}: the record moved on in a way this writer cannot follow: {why}"
                    ))
                })?;
                ReplicaCounters::count(&self.stats.epoch_changes);
                if record == next {
                    self.stats.removals.fetch_add(removals, Ordering::Relaxed);
                }
                self.install(v).await;
            }
        }
        Err(unrecorded(format!(
            "{what} was not recorded in time: {last_error}"
        )))
    }
}

/// The record that takes `still` out of `m`.
fn next_of<S>(m: &Membership, still: &[Arc<Member<S>>]) -> Membership {
    let mut next = m.clone();
    next.epoch += 1;
    for r in next.members.iter_mut() {
        if still.iter().any(|s| s.peer == r.peer) {
            r.state = MemberState::Failed;
        }
    }
    next
}

fn failed_names<S>(members: &[Arc<Member<S>>], failed: &HashSet<u64>) -> Vec<String> {
    members
        .iter()
        .filter(|m| failed.contains(&m.id))
        .map(|m| m.peer.clone())
        .collect()
}
