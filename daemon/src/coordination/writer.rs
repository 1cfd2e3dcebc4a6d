//! The writer lease: exactly one ublkd serves a volume. Each ublkd holds
//! one etcd lease (TTL `etcd.lease_ttl_secs`) and, per volume it serves,
//! the volume's writer key bound to that lease, created only if absent. A
//! second ublkd asking for the volume finds the key and is refused with
//! the holder's name. If this ublkd stops keeping the lease alive (crash,
//! partition, etcd down), etcd deletes its keys when the TTL runs out and
//! another ublkd may take the volumes.
//!
//! Each keepalive that etcd answers moves a deadline,
//! [`VolumeWriter::valid_until`]: the instant the keepalive was *sent* plus
//! the TTL (etcd counts from when it received it, later) minus
//! `etcd.lease_margin_ms` for clock drift. Before it, no other ublkd can
//! be granted the volume; after it, the replication core keeps serving on
//! the peers' epoch fence (docs/REPLICATION.md).
//!
//! A lease etcd no longer knows (expired, or revoked with `etcdctl lease
//! revoke`) does not end the volumes' writers: the keepalive task grants a
//! new lease and takes each volume's writer key again under it. A key
//! still absent is this ublkd's again (a new *term*: the core checks that
//! nobody moved the volume's record meanwhile before it trusts the role);
//! a key another ublkd created means that one holds the volume now, and
//! the writer is fenced for good.
//!
//! The lease id is kept in `<state_dir>/writer-lease`, which this process
//! holds locked: a ublkd restarted after a crash adopts its predecessor's
//! lease while it lives (the devices it recovers keep their writer keys),
//! and two ublkd on one state dir cannot both run.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, LeaseKeepAliveStream, LeaseKeeper};
use parking_lot::Mutex;
use rustix::fs::{flock, FlockOperation};
use target_rdma::replica::Lease;
use ublk_metrics::events;

use super::config::EtcdConfig;
use super::etcd::{self, Etcd, Expect, TxnOutcome};
use super::records::{unix_now, Keys, WriterRecord};
use super::CoordinationError;

/// How long `acquire` waits for a writer key left by this installation's
/// previous (dead) process to vanish with its lease, beyond the TTL.
const PREDECESSOR_GRACE: Duration = Duration::from_secs(2);

/// How often a standby taking the role looks whether the holder gave it up.
const TAKE_POLL: Duration = Duration::from_millis(10);

/// Most pending hand-over requests one poll reads.
const MAX_HANDOVER_REQUESTS: i64 = 1024;

/// What the keepalive task and the per-volume handles share.
struct Shared {
    base: Instant,
    /// Nanoseconds after `base` until which writes may be acknowledged;
    /// 0 while no lease is known to be alive.
    valid_until: AtomicU64,
    lease: AtomicI64,
    ttl: Duration,
    margin: Duration,
    keys: Keys,
    me: WriterRecord,
    volumes: Mutex<BTreeMap<String, Arc<VolumeWriter>>>,
    lease_path: PathBuf,
    /// Leases found gone (expired or revoked) by the keepalive task.
    lost: AtomicU64,
}

impl Shared {
    fn extend_from(&self, sent: Instant) {
        let until = (sent + self.ttl).saturating_duration_since(self.base);
        let until = until.saturating_sub(self.margin).as_nanos() as u64;
        self.valid_until.fetch_max(until.max(1), Ordering::AcqRel);
    }

    fn valid_until(&self) -> Option<Instant> {
        match self.valid_until.load(Ordering::Acquire) {
            0 => None,
            n => Some(self.base + Duration::from_nanos(n)),
        }
    }

    /// Records the lease id for the next ublkd on this state dir (through
    /// a descriptor of its own: the lock stays with [`WriterLease`]).
    fn persist(&self, id: i64) {
        let r = OpenOptions::new()
            .write(true)
            .open(&self.lease_path)
            .and_then(|mut f| {
                f.set_len(0)?;
                f.rewind()?;
                f.write_all(format!("{id}\n").as_bytes())?;
                f.sync_all()
            });
        if let Err(e) = r {
            tracing::warn!(event = events::WRITER_LEASE_FILE_FAILED, path = %self.lease_path.display(), error = %e);
        }
    }
}

/// This ublkd's hold on one volume.
pub struct VolumeWriter {
    volume: String,
    /// The etcd lease the writer key is bound to; 0 while the key is not
    /// ours (the lease was lost and the key not taken again yet, or it is
    /// another ublkd's).
    lease: AtomicI64,
    /// Bumped each time the key is taken again under a new lease.
    term: AtomicU64,
    /// Set once another ublkd holds the key: fenced for good. Checked on
    /// every request, so an atomic; `taken_by` names the holder.
    taken: AtomicBool,
    taken_by: Mutex<Option<String>>,
    /// The standby asking for the volume, as the last poll found it.
    asked_by: Mutex<Option<String>>,
    shared: Arc<Shared>,
}

impl VolumeWriter {
    /// Until when no other ublkd can be granted the volume; `None` when the
    /// volume's writer key is not (or no longer) ours, or no lease is
    /// alive. Two atomic loads: cheap enough for every write.
    pub fn valid_until(&self) -> Option<Instant> {
        if !self.held() {
            return None;
        }
        self.shared.valid_until()
    }

    /// The etcd lease the writer key is bound to, `None` while it is not
    /// ours.
    pub fn lease_id(&self) -> Option<i64> {
        match self.lease.load(Ordering::Acquire) {
            0 => None,
            id => Some(id),
        }
    }

    /// Whether the writer key is ours (the lease may still have lapsed).
    pub fn held(&self) -> bool {
        self.lease_id().is_some()
    }

    /// The role as the replication core sees it.
    pub fn lease(&self) -> Lease {
        if self.taken.load(Ordering::Acquire) {
            let holder = self.taken_by.lock().clone().unwrap_or_default();
            return Lease::Taken { holder };
        }
        if !self.held() {
            return Lease::Lost;
        }
        Lease::Held {
            // An instant already past while no keepalive was answered.
            until: self.shared.valid_until().unwrap_or(self.shared.base),
            term: self.term.load(Ordering::Acquire),
        }
    }

    /// The volume.
    pub fn volume(&self) -> &str {
        &self.volume
    }

    /// The standby asking for the volume's role, if any (as the last
    /// poll, every `etcd.handover_poll_ms`, found it).
    pub fn handover_asked(&self) -> Option<String> {
        self.asked_by.lock().clone()
    }

    /// Takes the writer key from its holder: asks for it (a request key
    /// bound to this ublkd's lease, so a dead standby's request goes with
    /// it) and waits until the holder deleted the key or its lease expired
    /// (etcd deletes the key then), at most one lease TTL plus margins;
    /// then the key is this ublkd's under a new term.
    pub(super) async fn take(&self, etcd: &Etcd) -> Result<(), CoordinationError> {
        let s = &self.shared;
        let key = s.keys.writer(&self.volume);
        let ask = s.keys.handover(&self.volume);
        let me = serde_json::to_vec(&s.me).unwrap_or_default();
        let give_up = Instant::now() + s.ttl + s.margin + PREDECESSOR_GRACE;
        let mut asked = false;
        let lease = loop {
            let lease = s.lease.load(Ordering::Acquire);
            if lease == 0 {
                return Err(CoordinationError::Unavailable {
                    what: "writer lease",
                    detail: "no etcd lease is alive".into(),
                });
            }
            let holder = match etcd
                .put_if(key.clone(), me.clone(), Expect::Absent, Some(lease))
                .await?
            {
                TxnOutcome::Done(_) => break lease,
                TxnOutcome::Conflict(Some(cur)) if cur.lease == lease => break lease,
                TxnOutcome::Conflict(Some(cur)) => {
                    serde_json::from_slice::<WriterRecord>(&cur.value)
                        .map_or_else(|_| "another ublkd".to_string(), |r| r.to_string())
                }
                TxnOutcome::Conflict(None) => continue,
            };
            if Instant::now() >= give_up {
                if asked {
                    let _ = etcd.delete_if(ask.clone(), Expect::Lease(lease)).await;
                }
                return Err(CoordinationError::Held {
                    volume: self.volume.clone(),
                    holder: format!(
                        "{holder}, which did not hand it over and kept its lease alive for {:?}",
                        s.ttl + s.margin + PREDECESSOR_GRACE
                    ),
                });
            }
            if !asked {
                match etcd
                    .put_if(ask.clone(), me.clone(), Expect::Absent, Some(lease))
                    .await?
                {
                    TxnOutcome::Done(_) => asked = true,
                    TxnOutcome::Conflict(Some(cur)) if cur.lease == lease => asked = true,
                    TxnOutcome::Conflict(Some(cur)) => {
                        let other = serde_json::from_slice::<WriterRecord>(&cur.value)
                            .map_or_else(|_| "another ublkd".to_string(), |r| r.to_string());
                        return Err(CoordinationError::Held {
                            volume: self.volume.clone(),
                            holder: format!("{holder}; {other} is already asking for it"),
                        });
                    }
                    TxnOutcome::Conflict(None) => {}
                }
                tracing::info!(event = events::WRITER_HANDOVER_ASKED, volume = %self.volume, holder = %holder);
            }
            etcd.sleep(TAKE_POLL).await;
        };
        if asked {
            let _ = etcd.delete_if(ask, Expect::Lease(lease)).await;
        }
        self.held_again(lease);
        tracing::info!(event = events::WRITER_ACQUIRED, volume = %self.volume, lease);
        Ok(())
    }

    /// Gives the writer key up to the standby that asked for it (the core
    /// flushed and acknowledges nothing more). On an error the key is
    /// still ours.
    pub(super) async fn give_up(&self, etcd: &Etcd) -> Result<(), CoordinationError> {
        let Some((lease, to)) = self.let_go() else {
            return Ok(());
        };
        let deleted = etcd
            .delete_if(self.shared.keys.writer(&self.volume), Expect::Lease(lease))
            .await;
        if let Err(e) = deleted {
            *self.taken_by.lock() = None;
            self.taken.store(false, Ordering::Release);
            self.lease.store(lease, Ordering::Release);
            return Err(e);
        }
        tracing::info!(event = events::WRITER_HANDED_OVER, volume = %self.volume, to = %to);
        Ok(())
    }

    /// Stops holding the key locally, before it is deleted in etcd: the
    /// lease it was bound to and the standby it goes to; `None` when it
    /// was not held.
    fn let_go(&self) -> Option<(i64, String)> {
        let lease = self.lease.swap(0, Ordering::AcqRel);
        if lease == 0 {
            return None;
        }
        let to = self
            .asked_by
            .lock()
            .take()
            .unwrap_or_else(|| "no standby yet".into());
        self.taken_by(to.clone());
        Some((lease, to))
    }

    /// Records what a poll of the hand-over requests found, unless the key
    /// changed hands since the poll looked: a request read while an
    /// earlier term held the key (the one this writer handed over on)
    /// would give the new term's role away the moment it starts.
    fn note_asked(&self, term: u64, who: Option<String>) {
        let mut asked = self.asked_by.lock();
        if self.held() && self.term.load(Ordering::Acquire) == term {
            *asked = who;
        }
    }

    /// The key is ours again under `lease`: a new term, which nobody has
    /// asked for yet.
    fn held_again(&self, lease: i64) {
        *self.asked_by.lock() = None;
        *self.taken_by.lock() = None;
        self.taken.store(false, Ordering::Release);
        self.term.fetch_add(1, Ordering::AcqRel);
        self.lease.store(lease, Ordering::Release);
    }

    /// Another ublkd (`holder`) holds the key: fenced for good.
    fn taken_by(&self, holder: String) {
        *self.taken_by.lock() = Some(holder);
        self.taken.store(true, Ordering::Release);
    }
}

/// This ublkd's writer lease and the volumes it holds.
pub struct WriterLease {
    shared: Arc<Shared>,
    /// `<state_dir>/writer-lease`, locked for as long as this lives.
    _lock: File,
    etcd: Arc<Etcd>,
    task: tokio::task::JoinHandle<()>,
    poll: tokio::task::JoinHandle<()>,
}

/// Opens and locks `<state_dir>/writer-lease`, returning the lease id it
/// names, if any.
fn lock_lease_file(state_dir: &Path) -> Result<(File, PathBuf, Option<i64>), CoordinationError> {
    let path = state_dir.join("writer-lease");
    let io = |e: std::io::Error| CoordinationError::LeaseFile {
        path: path.clone(),
        detail: e.to_string(),
    };
    std::fs::create_dir_all(state_dir).map_err(io)?;
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    flock(&f, FlockOperation::NonBlockingLockExclusive).map_err(|_| {
        CoordinationError::LeaseFile {
            path: path.clone(),
            detail: "locked by another ublkd using the same state_dir".into(),
        }
    })?;
    let mut text = String::new();
    f.read_to_string(&mut text).map_err(io)?;
    Ok((f, path, text.trim().parse().ok()))
}

fn host_name() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// etcd no longer knows the lease: it expired or was revoked
/// ("etcdserver: requested lease not found", or a keepalive answered with
/// TTL 0).
fn lease_gone(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("not found"),
        etcd_client::Error::GRpcStatus(s) => s.message().contains("lease not found"),
        _ => false,
    }
}

impl WriterLease {
    /// Locks the state dir's lease file, adopts the lease it names if etcd
    /// still has it (else grants a new one), and starts keeping it alive.
    pub fn start(
        etcd: &Arc<Etcd>,
        cfg: &EtcdConfig,
        state_dir: &Path,
    ) -> Result<Self, CoordinationError> {
        let (file, lease_path, previous) = lock_lease_file(state_dir)?;
        let ttl = cfg.lease_ttl();
        let shared = Arc::new(Shared {
            base: Instant::now(),
            valid_until: AtomicU64::new(0),
            lease: AtomicI64::new(0),
            ttl,
            margin: Duration::from_millis(cfg.lease_margin_ms),
            keys: Keys::new(&cfg.prefix),
            me: WriterRecord {
                host: cfg.host_id.clone().unwrap_or_else(host_name),
                state_dir: state_dir.to_owned(),
                pid: std::process::id(),
                since: unix_now(),
            },
            volumes: Mutex::new(BTreeMap::new()),
            lease_path,
            lost: AtomicU64::new(0),
        });
        let sent = Instant::now();
        let ttl_secs = ttl.as_secs() as i64;
        let adopted = match previous {
            Some(id) => Etcd::wait(etcd.call("lease_keepalive", move |mut c| async move {
                match c.lease_keep_alive(id).await {
                    Ok(_) => Ok(Some(id)),
                    Err(e) if lease_gone(&e) => Ok(None),
                    Err(e) => Err(e),
                }
            }))?,
            None => None,
        };
        let id = match adopted {
            Some(id) => {
                tracing::info!(event = events::WRITER_LEASE_ADOPTED, lease = id);
                id
            }
            None => {
                let id = Etcd::wait(etcd.call("lease_grant", move |mut c| async move {
                    Ok(c.lease_grant(ttl_secs, None).await?.id())
                }))?;
                shared.persist(id);
                tracing::info!(event = events::WRITER_LEASE_GRANTED, lease = id, ttl_secs);
                id
            }
        };
        shared.lease.store(id, Ordering::Release);
        shared.extend_from(sent);
        let task = etcd.handle().spawn(keepalive(
            etcd.client(),
            Arc::clone(&shared),
            cfg.keepalive_interval(),
            etcd.request_timeout(),
        ));
        let poll = etcd.handle().spawn(poll_handovers(
            etcd.client(),
            Arc::clone(&shared),
            cfg.handover_poll(),
            etcd.request_timeout(),
        ));
        Ok(Self {
            shared,
            _lock: file,
            etcd: Arc::clone(etcd),
            task,
            poll,
        })
    }

    /// The etcd lease id in use (0 while none is alive).
    pub fn lease_id(&self) -> i64 {
        self.shared.lease.load(Ordering::Acquire)
    }

    /// Until when writes may be acknowledged, whatever the volume.
    pub fn valid_until(&self) -> Option<Instant> {
        self.shared.valid_until()
    }

    /// How many times the keepalive found the lease gone.
    pub fn leases_lost(&self) -> u64 {
        self.shared.lost.load(Ordering::Relaxed)
    }

    /// This ublkd's record in writer keys.
    pub fn me(&self) -> &WriterRecord {
        &self.shared.me
    }

    /// Takes `volume`'s writer key: created if absent, kept if ours (an
    /// adopted lease), waited for if this installation's dead predecessor
    /// left it; otherwise refused with [`CoordinationError::Held`] naming the
    /// holder.
    pub fn acquire(&self, volume: &str) -> Result<Arc<VolumeWriter>, CoordinationError> {
        // A handle whose key is not ours any more (taken by another ublkd
        // while the lease was lost) is taken again in place: the volume's
        // coordinator holds it.
        let existing = self.shared.volumes.lock().get(volume).cloned();
        if let Some(v) = &existing {
            if v.held() {
                return Ok(Arc::clone(v));
            }
        }
        let key = self.shared.keys.writer(volume);
        let me = serde_json::to_vec(&self.shared.me).unwrap_or_default();
        let give_up = Instant::now() + self.shared.ttl + PREDECESSOR_GRACE;
        loop {
            let lease = self.lease_id();
            if lease == 0 {
                return Err(CoordinationError::Unavailable {
                    what: "writer lease",
                    detail: "no etcd lease is alive".into(),
                });
            }
            let swap =
                Etcd::wait(
                    self.etcd
                        .put_if(key.clone(), me.clone(), Expect::Absent, Some(lease)),
                )?;
            let holder = match swap {
                TxnOutcome::Done(_) => None,
                TxnOutcome::Conflict(Some(cur)) if cur.lease == lease => {
                    // An adopted lease: the key still names the dead
                    // process; it names this one from now on.
                    let renamed = self.etcd.put_if(
                        key.clone(),
                        me.clone(),
                        Expect::Lease(lease),
                        Some(lease),
                    );
                    if let Err(e) = Etcd::wait(renamed) {
                        tracing::warn!(event = events::WRITER_RENAME_FAILED, volume, error = %e);
                    }
                    None
                }
                TxnOutcome::Conflict(Some(cur)) => Some(
                    serde_json::from_slice::<WriterRecord>(&cur.value).map_err(|e| {
                        CoordinationError::Corrupt {
                            key: key.clone(),
                            detail: e.to_string(),
                        }
                    })?,
                ),
                TxnOutcome::Conflict(None) => continue,
            };
            match (holder, existing.clone()) {
                (None, Some(v)) => {
                    v.held_again(lease);
                    tracing::info!(event = events::WRITER_ACQUIRED, volume, lease);
                    return Ok(v);
                }
                (None, None) => {
                    let v = Arc::new(VolumeWriter {
                        volume: volume.to_owned(),
                        lease: AtomicI64::new(lease),
                        term: AtomicU64::new(0),
                        taken: AtomicBool::new(false),
                        taken_by: Mutex::new(None),
                        asked_by: Mutex::new(None),
                        shared: Arc::clone(&self.shared),
                    });
                    self.shared
                        .volumes
                        .lock()
                        .insert(volume.to_owned(), Arc::clone(&v));
                    tracing::info!(event = events::WRITER_ACQUIRED, volume, lease);
                    return Ok(v);
                }
                (Some(h), _)
                    if h.same_installation(&self.shared.me) && Instant::now() < give_up =>
                {
                    // Our previous process (dead: we hold the state dir's
                    // lock) had it under a lease we could not adopt.
                    std::thread::sleep(Duration::from_millis(250));
                }
                (Some(h), _) => {
                    return Err(CoordinationError::Held {
                        volume: volume.to_owned(),
                        holder: h.to_string(),
                    })
                }
            }
        }
    }

    /// A standby's hold on `volume`: no writer key, until the core takes
    /// the role ([`VolumeWriter::take`]). Refused when this ublkd serves
    /// the volume already.
    pub fn standby(&self, volume: &str) -> Result<Arc<VolumeWriter>, CoordinationError> {
        let mut volumes = self.shared.volumes.lock();
        if volumes.contains_key(volume) {
            return Err(CoordinationError::Invalid(format!(
                "volume {volume:?} is already served by this ublkd"
            )));
        }
        let v = Arc::new(VolumeWriter {
            volume: volume.to_owned(),
            lease: AtomicI64::new(0),
            term: AtomicU64::new(0),
            // Not ours: the keepalive does not take it back.
            taken: AtomicBool::new(true),
            taken_by: Mutex::new(Some("the volume's writer (this ublkd is a standby)".into())),
            asked_by: Mutex::new(None),
            shared: Arc::clone(&self.shared),
        });
        volumes.insert(volume.to_owned(), Arc::clone(&v));
        Ok(v)
    }

    /// Gives `volume` up: its writer key is deleted if it is still ours.
    pub fn release(&self, volume: &str) -> Result<(), CoordinationError> {
        let Some(v) = self.shared.volumes.lock().remove(volume) else {
            return Ok(());
        };
        let lease = v.lease.swap(0, Ordering::AcqRel);
        if lease == 0 {
            return Ok(());
        }
        Etcd::wait(
            self.etcd
                .delete_if(self.shared.keys.writer(volume), Expect::Lease(lease)),
        )
        .map(|_| tracing::info!(event = events::WRITER_RELEASED, volume))
    }
}

impl Drop for WriterLease {
    fn drop(&mut self) {
        // The lease is left to expire or to be adopted by the next ublkd.
        self.task.abort();
        self.poll.abort();
    }
}

/// Keeps the lease alive every `interval`; when etcd says it is gone,
/// grants a new one and re-takes the writer keys still absent.
async fn keepalive(client: Client, shared: Arc<Shared>, interval: Duration, timeout: Duration) {
    let mut keeper = None;
    loop {
        tokio::time::sleep(interval).await;
        let id = shared.lease.load(Ordering::Acquire);
        let sent = Instant::now();
        let mut c = client.clone();
        let round = tokio::time::timeout(timeout, async {
            match keeper.take() {
                None => c.lease_keep_alive(id).await.map(Some),
                Some((mut k, mut s)) => {
                    let (k2, s2): (&mut LeaseKeeper, &mut LeaseKeepAliveStream) = (&mut k, &mut s);
                    k2.keep_alive().await?;
                    match s2.message().await? {
                        Some(r) if r.ttl() > 0 => Ok(Some((k, s))),
                        Some(_) => Err(etcd_client::Error::LeaseKeepAliveError(
                            "lease not found".into(),
                        )),
                        None => Ok(None),
                    }
                }
            }
        })
        .await;
        match round {
            Ok(Ok(Some(ks))) => {
                shared.extend_from(sent);
                keeper = Some(ks);
                retake(&client, &shared, timeout).await;
            }
            Ok(Err(e)) if lease_gone(&e) => {
                shared.valid_until.store(0, Ordering::Release);
                shared.lease.store(0, Ordering::Release);
                shared.lost.fetch_add(1, Ordering::Relaxed);
                for v in shared.volumes.lock().values() {
                    v.lease.store(0, Ordering::Release);
                    tracing::error!(event = events::WRITER_LEASE_LOST, volume = %v.volume, lease = id,
                        "etcd lost the writer lease: taking the volume back under a new one");
                }
                regrant(&client, &shared, timeout).await;
                retake(&client, &shared, timeout).await;
            }
            // etcd unreachable or slow: the deadline is not moved, so it
            // lapses by itself if this goes on; the stream is reopened.
            Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                tracing::warn!(event = events::WRITER_KEEPALIVE_FAILED, lease = id);
            }
        }
    }
}

/// Takes the writer keys of the volumes whose lease was lost again under
/// the current lease: a key still absent is ours again (a new term); one
/// another ublkd created fences our writer for good. etcd unreachable: the
/// next keepalive round tries again.
async fn retake(client: &Client, shared: &Shared, timeout: Duration) {
    let lease = shared.lease.load(Ordering::Acquire);
    if lease == 0 {
        return;
    }
    let lost: Vec<Arc<VolumeWriter>> = shared
        .volumes
        .lock()
        .values()
        .filter(|v| !v.held() && !v.taken.load(Ordering::Acquire))
        .cloned()
        .collect();
    let me = serde_json::to_vec(&shared.me).unwrap_or_default();
    for v in lost {
        let key = shared.keys.writer(&v.volume);
        let mut c = client.clone();
        let take = etcd::put_if(
            &mut c,
            key.clone(),
            vec![(key, Expect::Absent)],
            me.clone(),
            Some(lease),
        );
        let holder = match tokio::time::timeout(timeout, take).await {
            Ok(Ok(TxnOutcome::Done(_))) => None,
            Ok(Ok(TxnOutcome::Conflict(Some(cur)))) if cur.lease == lease => None,
            Ok(Ok(TxnOutcome::Conflict(Some(cur)))) => Some(
                serde_json::from_slice::<WriterRecord>(&cur.value)
                    .map_or_else(|_| "another ublkd".to_string(), |r| r.to_string()),
            ),
            // Gone between the compare and the read, or etcd did not
            // answer: the next round tries again.
            _ => {
                tracing::warn!(event = events::WRITER_RETAKE_FAILED, volume = %v.volume);
                continue;
            }
        };
        match holder {
            None => {
                v.held_again(lease);
                tracing::warn!(event = events::WRITER_RETAKEN, volume = %v.volume, lease);
            }
            Some(who) => {
                tracing::error!(event = events::WRITER_FENCED, volume = %v.volume, holder = %who,
                    "another ublkd took the volume while the writer lease was lost");
                v.taken_by(who);
            }
        }
    }
}

/// A new lease after the old one was found gone, for the writers acquired
/// from now on.
async fn regrant(client: &Client, shared: &Shared, timeout: Duration) {
    let ttl_secs = shared.ttl.as_secs() as i64;
    loop {
        let sent = Instant::now();
        let mut c = client.clone();
        match tokio::time::timeout(timeout, c.lease_grant(ttl_secs, None)).await {
            Ok(Ok(r)) => {
                shared.persist(r.id());
                shared.lease.store(r.id(), Ordering::Release);
                shared.extend_from(sent);
                tracing::info!(
                    event = events::WRITER_LEASE_GRANTED,
                    lease = r.id(),
                    ttl_secs
                );
                return;
            }
            _ => tokio::time::sleep(shared.ttl / 3).await,
        }
    }
}

/// Looks for standbys asking for the volumes this ublkd holds, every
/// `interval` while it holds any: one range read of the request keys.
async fn poll_handovers(
    client: Client,
    shared: Arc<Shared>,
    interval: Duration,
    timeout: Duration,
) {
    loop {
        tokio::time::sleep(interval).await;
        let held: Vec<(Arc<VolumeWriter>, u64)> = shared
            .volumes
            .lock()
            .values()
            .filter(|v| v.held())
            .map(|v| (Arc::clone(v), v.term.load(Ordering::Acquire)))
            .collect();
        if held.is_empty() {
            continue;
        }
        let mut c = client.clone();
        let opts = GetOptions::new()
            .with_prefix()
            .with_limit(MAX_HANDOVER_REQUESTS);
        let Ok(Ok(r)) =
            tokio::time::timeout(timeout, c.get(shared.keys.handovers(), Some(opts))).await
        else {
            continue;
        };
        let asks: BTreeMap<Vec<u8>, String> = r
            .kvs()
            .iter()
            .filter_map(|kv| {
                let who = match serde_json::from_slice::<WriterRecord>(kv.value()) {
                    // This ublkd's own request, left by a take whose
                    // clean-up failed: nobody else is asking.
                    Ok(w) if w.same_installation(&shared.me) => return None,
                    Ok(w) => w.to_string(),
                    Err(_) => "a standby".to_string(),
                };
                Some((kv.key().to_vec(), who))
            })
            .collect();
        for (v, term) in held {
            let key = shared.keys.handover(&v.volume).into_bytes();
            v.note_asked(term, asks.get(&key).cloned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_writer() -> VolumeWriter {
        let shared = Arc::new(Shared {
            base: Instant::now(),
            valid_until: AtomicU64::new(0),
            lease: AtomicI64::new(7),
            ttl: Duration::from_secs(4),
            margin: Duration::from_millis(500),
            keys: Keys::new("/ublk"),
            me: WriterRecord {
                host: "host-a".into(),
                state_dir: "/var/lib/ublkd".into(),
                pid: 1,
                since: 0,
            },
            volumes: Mutex::new(BTreeMap::new()),
            lease_path: PathBuf::from("/nonexistent/writer-lease"),
            lost: AtomicU64::new(0),
        });
        VolumeWriter {
            volume: "vm".into(),
            lease: AtomicI64::new(7),
            term: AtomicU64::new(0),
            taken: AtomicBool::new(false),
            taken_by: Mutex::new(None),
            asked_by: Mutex::new(None),
            shared,
        }
    }

    fn term(v: &VolumeWriter) -> u64 {
        v.term.load(Ordering::Acquire)
    }

    /// A poll that read the standby's request while this writer held the
    /// key, and recorded it after the writer had handed the role over,
    /// must not make the writer give the role away again the moment it
    /// takes it back.
    #[test]
    fn a_request_found_in_an_earlier_term_does_not_ask_for_the_next() {
        let v = held_writer();
        let first = term(&v);
        v.note_asked(first, Some("host-b".into()));
        assert_eq!(v.handover_asked().as_deref(), Some("host-b"));
        assert_eq!(v.let_go(), Some((7, "host-b".to_string())));
        assert!(matches!(v.lease(), Lease::Taken { holder } if holder == "host-b"));

        // The poll's late finding about the term just handed over.
        v.note_asked(first, Some("host-b".into()));
        assert_eq!(v.handover_asked(), None, "not held: nothing recorded");

        // Taken back: a new term nobody asked for, whatever a poll that
        // looked during the last one recorded.
        v.held_again(8);
        assert_eq!(v.handover_asked(), None);
        v.note_asked(first, Some("host-b".into()));
        assert_eq!(v.handover_asked(), None, "a finding about the old term");
        v.note_asked(term(&v), Some("host-c".into()));
        assert_eq!(v.handover_asked().as_deref(), Some("host-c"));
        v.note_asked(term(&v), None);
        assert_eq!(v.handover_asked(), None, "the request was withdrawn");
    }

    #[test]
    fn letting_go_of_a_key_not_held_gives_nothing_away() {
        let v = held_writer();
        assert!(v.let_go().is_some());
        assert_eq!(v.let_go(), None);
    }
}
