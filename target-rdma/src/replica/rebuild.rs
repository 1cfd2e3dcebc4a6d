//! Rebuild: a replacement member (a spare, or a peer back after failing)
//! joins as `syncing`, receives every new write like the others, and is
//! brought up to date by a rate-limited copy of every blob from a healthy
//! member; then it is recorded `healthy`, and a spare's failed predecessor
//! `removed`, in the same change.
//!
//! The copy of a key holds the key's lock (keys.rs) from the read on the
//! healthy member to the write on the new one, so it never overwrites a
//! newer write.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::coordinator::{MemberRecord, MemberState};
use super::member::{Lane, Member, MemberIo, MemberSessions};
use super::set::{ReplicaSet, View};
use crate::blob::{ArenaError, ReplicaFailure, Via};
use crate::proto::Status;

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
}

/// Rebuild progress; the daemon exports it.
#[derive(Debug, Default)]
pub struct RebuildStats {
    /// Blob bytes copied to the new member so far.
    pub bytes_copied: AtomicU64,
    /// Blob bytes of the keys not copied yet.
    pub bytes_remaining: AtomicU64,
}

impl<S: MemberIo> ReplicaSet<S> {
    /// Brings `peer` into the volume with the fresh `sessions`: records it
    /// `syncing` at a new epoch, copies every blob of `cfg.keys` from a
    /// healthy member on the background sessions at `cfg.bytes_per_sec` at
    /// most, then records it `healthy`. Fails (and the new member, if it is
    /// the one that failed, is removed) when a copy cannot be made.
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
        stats.bytes_remaining.store(total, Ordering::Relaxed);
        let start = self.clock.now();
        let mut buf = vec![0u8; blob as usize];
        for key in cfg.keys.clone() {
            self.copy(&member, key, &mut buf).await?;
            stats
                .bytes_copied
                .fetch_add(u64::from(blob), Ordering::Relaxed);
            stats
                .bytes_remaining
                .fetch_sub(u64::from(blob), Ordering::Relaxed);
            if cfg.bytes_per_sec > 0 {
                let copied = stats.bytes_copied.load(Ordering::Relaxed);
                let due = Duration::from_secs_f64(copied as f64 / cfg.bytes_per_sec as f64);
                self.clock.sleep_until(start + due).await;
            }
        }
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
            if e.status() == Some(Status::StaleEpoch) {
                self.fence_stale(&e);
                self.not_fenced()?;
            }
            to.suspect(e.to_string());
            let deadline = self.clock.now() + self.config.change_deadline;
            self.exclude(&[to.id].into_iter().collect(), deadline)
                .await?;
            return Err(e);
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
