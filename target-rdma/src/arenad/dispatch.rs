//! What a request does: where it runs (inline on the connection's task
//! when its store call finds the blob needs no disk; a range read of a
//! cold blob awaited on the swap's shared ring, so a connection keeps many
//! in flight without a thread each; else on the blocking pool) and its
//! store call, which encodes the answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, warn};

use crate::arenad::epochs::Admitted;
use crate::arenad::events;
use crate::arenad::fatal::Fatal;
use crate::arenad::lease_keys::{Grant, Keyed, LeaseKeys};
use crate::arenad::promotion::Touch;
use crate::arenad::request::Decoded;
use crate::arenad::session::Session;
use crate::arenad::shared::Shared;
use crate::proto::{self, FrameError, Header, Lease, Opcode, Request, Status, TAG_LEN, VERSION_2};
use crate::rdma::{Isolation, RdmaError};
use crate::store::{Immediate, StoreError};
use ublk_metrics::Promotion;

/// Answers this large are written straight to the socket (when it is
/// free) even when more requests wait to be answered.
const DIRECT_ALWAYS: usize = 64 << 10;

/// Where a request starts, and what a FLUSH must wait for.
pub(super) struct Placed {
    /// On the connection's task, through the store's calls that decline
    /// rather than wait ([`Wait::No`]).
    pub(super) inline: bool,
    /// Changes what a later FLUSH must cover.
    pub(super) mutates: bool,
    /// A FLUSH.
    pub(super) flush: bool,
}

/// Whether a store call may wait for the disk: on the blocking pool it
/// may; inline on a reactor thread it must not, and the store's `_now`
/// calls decline a blob that would need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Wait {
    Yes,
    No,
}

/// A request's answer, encoded, and its status.
pub(super) struct Answer {
    status: Status,
    frame: Vec<u8>,
}

/// Decides where a request starts: a READ, GET, WRITE or ALLOC inline,
/// where the store decides under the lock that pins the slot whether it
/// can be served without the disk (residency checked any earlier could
/// change before the call); COMMIT and RELEASE inline too, as they only end
/// leases; the rest off the task. Only the opcode decides.
pub(super) fn place(op: Opcode) -> Placed {
    use Opcode::{Alloc, Commit, Flush, Get, GetResident, Read, Release, Remove, Write};
    Placed {
        inline: matches!(
            op,
            Read | Get | GetResident | Write | Alloc | Commit | Release
        ),
        mutates: matches!(op, Write | Alloc | Commit | Release | Remove),
        flush: op == Flush,
    }
}

/// The dispatch of one session's requests: the server's state and the
/// session the requests came on.
#[derive(Clone)]
pub(super) struct Dispatch {
    pub(super) shared: Arc<Shared>,
    pub(super) conn: Arc<Session>,
}

impl Dispatch {
    /// Runs a request that is not answered inline, and says whether its
    /// answer goes straight to the socket: a READ of part of a cold blob
    /// awaited on the swap's ring, its answer queued (not direct) so that
    /// the reads whose completions were reaped together are answered in one
    /// write; anything else (a READ that is not one after all too) on the
    /// pool, answered directly.
    pub(super) async fn execute_off_task(
        &self,
        h: Header,
        req: Decoded,
    ) -> (Result<Answer, Fatal>, bool) {
        if h.opcode == Opcode::Read {
            if let Some(answered) = self.read_cold(&h, &req.request()).await {
                return (answered, false);
            }
        }
        let d = self.clone();
        let answered = self
            .shared
            .pool
            .run(move || {
                let r = d.execute(&h, &req.request(), Wait::Yes);
                drop(req);
                r
            })
            .await
            .unwrap_or_else(|_| Err(Fatal::Internal("a request's store call panicked".into())))
            .and_then(|answered| {
                answered.ok_or_else(|| {
                    Fatal::Internal("a store call on the blocking pool declined to wait".into())
                })
            });
        (answered, true)
    }

    /// A READ of part of a cold blob, awaited; `None` when it is not one
    /// (any more).
    async fn read_cold(&self, h: &Header, req: &Request<'_>) -> Option<Result<Answer, Fatal>> {
        let conn = &self.conn;
        let (op, rid) = (h.opcode, h.request_id);
        let Request::Read { key, offset, len } = *req else {
            return None;
        };
        let _admitted = match self.admit(req, op, rid) {
            Ok(Ok(a)) => a,
            Ok(Err(refused)) => return Some(Ok(refused)),
            Err(fatal) => return Some(Err(fatal)),
        };
        let mut out = Vec::new();
        let read = self
            .shared
            .store
            .read_cold_with(conn.vol.id, key, offset, len as usize, |b| {
                out.reserve_exact(proto::HEADER_LEN + b.len() + TAG_LEN);
                proto::encode_read_head(&mut out, rid, len);
                out.extend_from_slice(b);
                Status::Ok
            })
            .await;
        let result = match read {
            Ok(None) => return None,
            Ok(Some(status)) => Ok(status),
            Err(e) => Err(e),
        };
        Some(self.finish(op, rid, result, out))
    }

    /// Sends a request's answer (straight to the socket if `direct` and it
    /// is free, else queued, waiting for room), counting it; a fatal error
    /// is returned to end the session.
    pub(super) async fn answer(
        &self,
        h: Header,
        started: Instant,
        answered: Result<Answer, Fatal>,
        direct: bool,
    ) -> Result<(), Fatal> {
        let conn = &self.conn;
        match answered {
            Ok(a) => {
                self.shared
                    .obs
                    .answered(h.opcode, a.status, started.elapsed());
                conn.traffic.answered(
                    h.opcode,
                    a.status,
                    (proto::HEADER_LEN + h.body_len as usize) as u64,
                    a.frame.len() as u64,
                );
                // A large answer goes now whatever follows: its own
                // syscall is nothing beside its bytes.
                let direct = direct || a.frame.len() >= DIRECT_ALWAYS;
                conn.outbox.answer(a.frame, direct).await;
                Ok(())
            }
            Err(fatal) => {
                if let Fatal::Store(op, ..) | Fatal::NeedsVersion2(op, ..) = &fatal {
                    self.shared.obs.refused(*op, started.elapsed());
                }
                Err(fatal)
            }
        }
    }

    /// Executes one request and encodes its answer (room left for its tag);
    /// `None` when, with [`Wait::No`], a READ, GET, WRITE or ALLOC would
    /// wait for the disk (its blob in swap only; for WRITE and ALLOC also
    /// no blob yet, or its slot under write-back): nothing was done.
    pub(super) fn execute(
        &self,
        h: &Header,
        req: &Request<'_>,
        wait: Wait,
    ) -> Result<Option<Answer>, Fatal> {
        let conn = &self.conn;
        let op = h.opcode;
        let rid = h.request_id;
        let vol = conn.vol.id;
        let mut out = Vec::new();
        let answer = |out: Vec<u8>, status| Answer { status, frame: out };
        if let Request::Epoch { epoch } = *req {
            if conn.version < VERSION_2 {
                return Err(Fatal::Request(
                    op,
                    rid,
                    FrameError::Unexpected {
                        op: op.name(),
                        detail: "EPOCH needs protocol version 2",
                    },
                ));
            }
            let session = conn.epoch.fetch_max(epoch, Ordering::AcqRel).max(epoch);
            let status = match self.shared.fencing.raise_and_fence(&conn.fence, session) {
                Ok(now) if now > session => {
                    proto::encode_error(&mut out, op, rid, Status::StaleEpoch, &stale(conn, now));
                    Status::StaleEpoch
                }
                Ok(now) => {
                    proto::encode_epoch(&mut out, rid, now);
                    Status::Ok
                }
                Err(e) => {
                    warn!(event = events::EPOCH_PERSIST_FAILED, conn = conn.id, error = %e);
                    proto::encode_error(&mut out, op, rid, Status::Internal, &e.to_string());
                    Status::Internal
                }
            };
            return Ok(Some(answer(out, status)));
        }
        let _admitted = match self.admit(req, op, rid)? {
            Ok(a) => a,
            Err(refused) => return Ok(Some(refused)),
        };
        let holder = conn.id;
        let ok = |()| Status::Ok;
        let result = match *req {
            Request::Epoch { .. } => unreachable!("answered above"),
            Request::Read { key, offset, len } => {
                let encode = |bytes: Option<&[u8]>| match bytes {
                    Some(b) => {
                        out.reserve_exact(proto::HEADER_LEN + b.len() + TAG_LEN);
                        proto::encode_read_head(&mut out, rid, len);
                        out.extend_from_slice(b);
                        Status::Ok
                    }
                    None => {
                        proto::encode_error(&mut out, op, rid, Status::NotFound, "");
                        Status::NotFound
                    }
                };
                let n = len as usize;
                let read = match wait {
                    Wait::Yes => self
                        .shared
                        .store
                        .read_with(vol, key, offset, n, encode)
                        .map(Immediate::Done),
                    Wait::No => self.shared.store.read_now(vol, key, offset, n, encode),
                };
                match read {
                    Ok(Immediate::WouldWait) => return Ok(None),
                    Ok(Immediate::Done(status)) => Ok(status),
                    Err(e) => Err(e),
                }
            }
            Request::Alloc { key } => {
                let grant = self.start_grant();
                let leased = match wait {
                    Wait::Yes => self
                        .shared
                        .store
                        .alloc(vol, key, holder)
                        .map(Immediate::Done),
                    Wait::No => self.shared.store.alloc_now(vol, key, holder),
                };
                match leased {
                    Ok(Immediate::WouldWait) => return Ok(None),
                    Ok(Immediate::Done(lease)) => {
                        let lease = self.key_lease(grant, lease, true);
                        proto::encode_lease(&mut out, op, rid, lease, self.conn.rails.per_rail);
                        Ok(Status::Ok)
                    }
                    Err(e) => Err(e),
                }
            }
            Request::Get { key } | Request::GetResident { key } => {
                let resident_only = op == Opcode::GetResident;
                let grant = self.start_grant();
                let leased = match wait {
                    Wait::Yes if !resident_only => {
                        self.shared.store.get(vol, key, holder).map(Immediate::Done)
                    }
                    _ => self.shared.store.get_now(vol, key, holder),
                };
                match leased {
                    Ok(Immediate::WouldWait) if resident_only => {
                        self.found_cold(key);
                        proto::encode_error(&mut out, op, rid, Status::Cold, "");
                        Ok(Status::Cold)
                    }
                    Ok(Immediate::WouldWait) => return Ok(None),
                    Ok(Immediate::Done(Some(lease))) => {
                        let lease = self.key_lease(grant, lease, false);
                        proto::encode_lease(&mut out, op, rid, lease, self.conn.rails.per_rail);
                        Ok(Status::Ok)
                    }
                    Ok(Immediate::Done(None)) => {
                        proto::encode_error(&mut out, op, rid, Status::NotFound, "");
                        Ok(Status::NotFound)
                    }
                    Err(e) => Err(e),
                }
            }
            Request::Commit { key, token } => {
                self.unkey(&[token]);
                self.shared
                    .store
                    .commit(vol, key, token, holder)
                    .map(|()| proto::encode_ok(&mut out, op, rid))
                    .map(ok)
            }
            Request::Release { ref tokens } => {
                self.unkey(tokens);
                tokens
                    .iter()
                    .try_for_each(|t| self.shared.store.release(*t, holder))
                    .map(|()| proto::encode_ok(&mut out, op, rid))
                    .map(ok)
            }
            Request::Remove { start, end } => self
                .shared
                .store
                .remove(vol, start, end)
                .map(|n| proto::encode_count(&mut out, op, rid, n))
                .map(ok),
            Request::Flush => self
                .shared
                .store
                .flush()
                .map(|()| proto::encode_ok(&mut out, op, rid))
                .map(ok),
            Request::Write { key, offset, data } => {
                let written = match wait {
                    Wait::Yes => self
                        .shared
                        .store
                        .write(vol, key, offset, data)
                        .map(Immediate::Done),
                    Wait::No => self.shared.store.write_now(vol, key, offset, data),
                };
                match written {
                    Ok(Immediate::WouldWait) => return Ok(None),
                    r => r.map(|_| proto::encode_ok(&mut out, op, rid)).map(ok),
                }
            }
            Request::RailConnect { ref endpoint, rail } => {
                return self
                    .rail_connect(op, rid, endpoint, rail)
                    .map(|(s, f)| Some(answer(f, s)))
            }
        };
        self.finish(op, rid, result, out).map(Some)
    }

    /// A GET_RESIDENT found blob `key` in swap only and was answered COLD: when the
    /// blob is due ([`Promotion`](crate::arenad::promotion)), it is faulted
    /// in on the blocking pool in the background (a lease taken and given
    /// back), so later GET_RESIDENTs find it resident.
    fn found_cold(&self, key: u64) {
        let obs = &self.shared.obs;
        let vol = self.conn.vol.id;
        let ticket = match self.shared.promotion.found_cold(vol, key) {
            Touch::Noted => return,
            Touch::Skipped => return obs.promotion(Promotion::Skipped),
            Touch::Promote(t) => t,
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return obs.promotion(Promotion::Skipped);
        };
        let shared = Arc::clone(&self.shared);
        let holder = self.conn.id;
        runtime.spawn(async move {
            let store = Arc::clone(&shared.store);
            let faulted = shared
                .pool
                .run(move || {
                    let _ticket = ticket;
                    let lease = store.get(vol, key, holder)?;
                    lease.map_or(Ok(()), |l| store.release(l.token, holder))
                })
                .await;
            match faulted {
                Ok(Ok(())) => shared.obs.promotion(Promotion::Promoted),
                Ok(Err(e)) => {
                    debug!(key, error = %e, "a cold blob's background fault-in failed");
                    shared.obs.promotion(Promotion::Failed);
                }
                Err(_) => shared.obs.promotion(Promotion::Failed),
            }
        });
    }

    /// Every data operation runs admitted under the volume's epoch, so a
    /// raise waits for it and a stale session gets none: the admission, or
    /// the answer refusing it.
    fn admit(
        &self,
        req: &Request,
        op: Opcode,
        rid: u64,
    ) -> Result<Result<Option<Admitted<'_>>, Answer>, Fatal> {
        let conn = &self.conn;
        if matches!(req, Request::Release { .. } | Request::RailConnect { .. }) {
            return Ok(Ok(None));
        }
        match conn.fence.admit(conn.epoch.load(Ordering::Acquire)) {
            Ok(a) => Ok(Ok(Some(a))),
            Err(now) if conn.version < VERSION_2 => Err(Fatal::NeedsVersion2(
                op,
                rid,
                format!(
                    "volume {:?} moved to membership epoch {now}: it needs protocol version 2",
                    conn.vol.name
                ),
            )),
            Err(now) => {
                let mut out = Vec::new();
                proto::encode_error(&mut out, op, rid, Status::StaleEpoch, &stale(conn, now));
                Ok(Err(Answer {
                    status: Status::StaleEpoch,
                    frame: out,
                }))
            }
        }
    }

    /// The answer to a store call: its own frame in `out`, or an error
    /// frame (a protocol error ends the session).
    fn finish(
        &self,
        op: Opcode,
        rid: u64,
        result: Result<Status, StoreError>,
        mut out: Vec<u8>,
    ) -> Result<Answer, Fatal> {
        let conn = &self.conn;
        let status = match result {
            Ok(status) => status,
            Err(e) => {
                let status = e.status();
                if status == Status::Protocol {
                    return Err(Fatal::Store(op, rid, e));
                }
                if status == Status::Internal {
                    warn!(event = events::STORE_ERROR, conn = conn.id, op = op.name(), error = %e);
                }
                proto::encode_error(&mut out, op, rid, status, &e.to_string());
                status
            }
        };
        Ok(Answer { status, frame: out })
    }

    /// RAIL_CONNECT: one QP per rail of the connection (rail 0 unless the
    /// session names rails), a new one replacing the old (isolated per
    /// lease, in a new protection domain: the old rail's lease keys are
    /// deregistered first; the other rail's stay).
    fn rail_connect(
        &self,
        op: Opcode,
        rid: u64,
        client: &proto::Endpoint,
        rail: Option<u8>,
    ) -> Result<(Status, Vec<u8>), Fatal> {
        let conn = &self.conn;
        let mut out = Vec::new();
        let rails = &conn.rails;
        let unexpected = |detail| {
            Fatal::Request(
                op,
                rid,
                FrameError::Unexpected {
                    op: op.name(),
                    detail,
                },
            )
        };
        if !rails.granted {
            return Err(unexpected(
                "RAIL_CONNECT on a session that was not granted CAP_RDMA",
            ));
        }
        if rail.is_some() && !rails.per_rail {
            return Err(unexpected(
                "RAIL_CONNECT naming a rail on a session that was not granted CAP_RAILS",
            ));
        }
        let index = usize::from(rail.unwrap_or(0));
        let Some(rdma) = self.shared.rdma.rail(index) else {
            let served = self.shared.rdma.served().count();
            proto::encode_error(
                &mut out,
                op,
                rid,
                Status::NotFound,
                &format!(
                    "RDMA rail {index} is not served: this arenad serves {served} of its {} configured rails",
                    self.shared.rdma.configured()
                ),
            );
            return Ok((Status::NotFound, out));
        };
        if rdma.isolation() == Isolation::Lease && !rails.lease_keys {
            proto::encode_error(
                &mut out,
                op,
                rid,
                Status::Internal,
                "RDMA rail refused: this arenad isolates RDMA per lease (rdma_isolation = \"lease\") \
                 and the client did not offer CAP_RDMA_LEASE_KEYS: upgrade the client (or, trusting \
                 every RDMA client with every volume, set rdma_isolation = \"shared\")",
            );
            return Ok((Status::Internal, out));
        }
        // One RAIL_CONNECT of the session at a time; the rail's old QP goes
        // first, keys before QP (the client gives back leases cached from
        // it).
        let mut qps = rails.qps.lock();
        LeaseKeys::clear(&rails.keys, index);
        if let Some(old) = qps[index].take() {
            old.fail();
        }
        match rdma.accept(client) {
            Ok(acc) => {
                rails.keys.lock().set_domain(index, acc.domain);
                qps[index] = Some(acc.qp);
                acc.answer.encode(&mut out, rid);
                Ok((Status::Ok, out))
            }
            Err(e) => {
                warn!(event = events::RDMA_DECLINED, conn = conn.id, rail = index, error = %e);
                proto::encode_error(
                    &mut out,
                    op,
                    rid,
                    Status::Internal,
                    &format!("RDMA rail {index} refused: {e}"),
                );
                Ok((Status::Internal, out))
            }
        }
    }

    /// A session whose RDMA keys are per lease: the ticket of a grant about
    /// to ask the store (see [`LeaseKeys::start`]).
    fn start_grant(&self) -> Option<Grant<'_>> {
        let rails = &self.conn.rails;
        rails.lease_keys.then(|| LeaseKeys::start(&rails.keys))
    }

    /// A granted lease as answered: with a `grant` ticket its key is
    /// registered on each connected rail (over exactly its slot, in the
    /// session's domain of that rail) and each rkey goes with it. A rail
    /// where the lease cannot be keyed (not connected, a failed
    /// registration, ended meanwhile) has no key in the answer: over a
    /// rail isolated per lease the client then moves that payload on
    /// another rail or inline.
    fn key_lease(&self, grant: Option<Grant<'_>>, mut lease: Lease, write: bool) -> Lease {
        let conn = &self.conn;
        let Some(g) = grant else { return lease };
        let rails = &self.shared.rdma;
        let keyed = g.key(
            lease.token,
            |rail, d| match rails.rail(rail) {
                Some(rdma) => rdma.key_slot(d, lease.slot_offset, write),
                None => Err(RdmaError::NoDevice {
                    detail: format!("rail {rail} is not served"),
                }),
            },
            |rail, e| {
                self.shared.obs.lease_key_failed();
                warn!(
                    event = events::RDMA_LEASE_KEY_FAILED,
                    conn = conn.id,
                    token = lease.token,
                    rail,
                    error = %e,
                    "registering the lease's key failed: answered without one on this rail"
                );
            },
        );
        match keyed {
            Keyed::Keys(rkeys) => lease.rkeys = rkeys,
            Keyed::NoRail => {}
            Keyed::Ended => debug!(
                event = events::RDMA_LEASE_ENDED_UNKEYED,
                conn = conn.id,
                token = lease.token,
                "the lease ended before its key was registered: answered without one"
            ),
        }
        lease
    }

    /// The holder ends these leases (COMMIT, RELEASE): their keys are
    /// deregistered before the store can give the slots to anyone else.
    /// One lock per key, so the force-end hook waits for one at most.
    fn unkey(&self, tokens: &[u64]) {
        let conn = &self.conn;
        if conn.rails.lease_keys {
            for &t in tokens {
                conn.rails.keys.lock().end(t);
            }
        }
    }
}

fn stale(conn: &Session, now: u64) -> String {
    format!(
        "stale epoch: this session is at epoch {}, volume {:?} at {now}: a newer writer owns it",
        conn.epoch.load(Ordering::Acquire),
        conn.vol.name
    )
}
