//! The etcd v3 client (`etcd-client`, gRPC over tonic) on a small tokio
//! runtime of its own, bridged to callers that are not tokio: ublk queue
//! threads run their own io_uring executor and the device manager is plain
//! threads. [`Etcd::call`] spawns the request on the runtime and returns a
//! future that completes through a oneshot channel, which any executor can
//! poll (and `futures::executor::block_on` can wait for).
//!
//! Every request is bounded: at most `etcd.max_inflight` in flight (more
//! fail at once, never queue without limit) and each has
//! `etcd.request_timeout_ms`. Decisions that must be unique are etcd
//! transactions ([`Etcd::put_if`], [`Etcd::delete_if`]): compare on a key's
//! `mod_revision` (or its absence), so two writers racing for the same
//! change cannot both win. There is no consensus of our own here.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, PutOptions, Txn, TxnOp,
    TxnOpResponse,
};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::{oneshot, Semaphore};

use super::config::EtcdConfig;
use super::CoordinationError;

/// Most keys one prefix listing returns (placement pool, volumes): a bound
/// on the memory a listing costs; a fleet larger than this needs paging.
pub const MAX_LIST: i64 = 100_000;

/// A key's value as etcd holds it, with the revisions a transaction can be
/// conditioned on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versioned {
    /// The value.
    pub value: Vec<u8>,
    /// Revision of the last change: what a compare-and-swap compares.
    pub mod_revision: i64,
    /// Revision of the key's creation.
    pub create_revision: i64,
    /// The etcd lease the key is bound to (0: none).
    pub lease: i64,
}

impl From<&KeyValue> for Versioned {
    fn from(kv: &KeyValue) -> Self {
        Self {
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
            create_revision: kv.create_revision(),
            lease: kv.lease(),
        }
    }
}

/// What a conditional change expects to find.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// The key does not exist (`create_revision == 0`).
    Absent,
    /// The key was last changed at this revision.
    Revision(i64),
    /// The key is bound to this etcd lease.
    Lease(i64),
}

/// The outcome of a conditional change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOutcome {
    /// Done; the store's revision after it.
    Done(i64),
    /// The condition did not hold; the key as it is now (`None`: absent).
    Conflict(Option<Versioned>),
}

impl Expect {
    fn compare(self, key: &str) -> Compare {
        match self {
            Self::Absent => Compare::create_revision(key, CompareOp::Equal, 0),
            Self::Revision(r) => Compare::mod_revision(key, CompareOp::Equal, r),
            Self::Lease(id) => Compare::lease(key, CompareOp::Equal, id),
        }
    }
}

/// The connection to etcd and the runtime it runs on. Cheap to share
/// (`Arc`); dropping the last one stops the runtime.
pub struct Etcd {
    client: Client,
    runtime: Option<Runtime>,
    handle: Handle,
    slots: Arc<Semaphore>,
    max_inflight: u32,
    timeout: Duration,
    prefix: String,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("prefix", &self.prefix)
            .finish()
    }
}

fn etcd_err(what: &'static str, e: etcd_client::Error) -> CoordinationError {
    CoordinationError::Unavailable {
        what,
        detail: e.to_string(),
    }
}

impl Etcd {
    /// Starts the runtime thread and the client. The connection itself is
    /// made lazily, so an etcd that is down at start is found by the first
    /// request (which fails within the request timeout), not here.
    pub fn connect(cfg: &EtcdConfig) -> Result<Arc<Self>, CoordinationError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ublkd-etcd")
            .enable_all()
            .build()
            .map_err(|e| CoordinationError::Unavailable {
                what: "runtime",
                detail: e.to_string(),
            })?;
        let handle = runtime.handle().clone();
        let timeout = Duration::from_millis(cfg.request_timeout_ms);
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(cfg.dial_timeout_ms))
            .with_timeout(timeout)
            .with_keep_alive(timeout, timeout)
            .with_require_leader(true);
        if let (Some(user), Some(file)) = (&cfg.username, &cfg.password_file) {
            let text =
                std::fs::read_to_string(file).map_err(|e| CoordinationError::Unavailable {
                    what: "password_file",
                    detail: format!("{}: {e}", file.display()),
                })?;
            let password = text.lines().next().unwrap_or("").to_owned();
            opts = opts.with_user(user.clone(), password);
        }
        let endpoints = cfg.endpoints.clone();
        let client = handle
            .block_on(async move {
                tokio::time::timeout(timeout * 2, Client::connect(endpoints, Some(opts))).await
            })
            .map_err(|_| CoordinationError::Unavailable {
                what: "connect",
                detail: format!("no answer within {:?}", timeout * 2),
            })?
            .map_err(|e| etcd_err("connect", e))?;
        Ok(Arc::new(Self {
            client,
            runtime: Some(runtime),
            handle,
            slots: Arc::new(Semaphore::new(cfg.max_inflight as usize)),
            max_inflight: cfg.max_inflight,
            timeout,
            prefix: cfg.prefix.clone(),
        }))
    }

    /// The configured key prefix (`etcd.prefix`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The per-request limit.
    pub fn request_timeout(&self) -> Duration {
        self.timeout
    }

    /// The runtime, for the long-lived tasks of this module (the lease
    /// keepalive).
    pub(super) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// A client handle, for those tasks.
    pub(super) fn client(&self) -> Client {
        self.client.clone()
    }

    /// Runs `f` on the runtime with the request timeout; the returned
    /// future is executor-agnostic. Fails at once with
    /// [`CoordinationError::Busy`] when `etcd.max_inflight` requests are out.
    pub fn call<T, F, Fut>(
        &self,
        what: &'static str,
        f: F,
    ) -> impl Future<Output = Result<T, CoordinationError>> + Send + 'static
    where
        T: Send + 'static,
        F: FnOnce(Client) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    {
        let started = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => {
                let (tx, rx) = oneshot::channel();
                let (client, timeout) = (self.client.clone(), self.timeout);
                self.handle.spawn(async move {
                    let r = match tokio::time::timeout(timeout, f(client)).await {
                        Ok(r) => r.map_err(|e| etcd_err(what, e)),
                        Err(_) => Err(CoordinationError::Unavailable {
                            what,
                            detail: format!("no answer within {timeout:?}"),
                        }),
                    };
                    drop(permit);
                    let _ = tx.send(r);
                });
                Ok(rx)
            }
            Err(_) => Err(CoordinationError::Busy(self.max_inflight)),
        };
        async move {
            started?.await.unwrap_or_else(|_| {
                Err(CoordinationError::Unavailable {
                    what,
                    detail: "the etcd runtime stopped".into(),
                })
            })
        }
    }

    /// A timer on the runtime that any executor can await (the replication
    /// core polls on a ublk queue thread, which has no tokio timers).
    pub fn sleep(&self, d: Duration) -> impl Future<Output = ()> + Send + 'static {
        let (tx, rx) = oneshot::channel::<()>();
        self.handle.spawn(async move {
            tokio::time::sleep(d).await;
            let _ = tx.send(());
        });
        async move {
            let _ = rx.await;
        }
    }

    /// Waits for [`Etcd::call`] on this thread. Never call it on the
    /// runtime's own thread.
    pub fn wait<T>(
        fut: impl Future<Output = Result<T, CoordinationError>>,
    ) -> Result<T, CoordinationError> {
        futures::executor::block_on(fut)
    }

    /// The key's value, `None` when absent.
    pub fn get(
        &self,
        key: String,
    ) -> impl Future<Output = Result<Option<Versioned>, CoordinationError>> + Send + 'static {
        self.call("get", move |mut c| async move {
            let r = c.get(key, None).await?;
            Ok(r.kvs().first().map(Versioned::from))
        })
    }

    /// Every key under `prefix` (at most [`MAX_LIST`]), in key order.
    pub fn list(
        &self,
        prefix: String,
    ) -> impl Future<Output = Result<Vec<(String, Versioned)>, CoordinationError>> + Send + 'static
    {
        self.call("list", move |mut c| async move {
            let r = c
                .get(
                    prefix,
                    Some(GetOptions::new().with_prefix().with_limit(MAX_LIST)),
                )
                .await?;
            Ok(r.kvs()
                .iter()
                .map(|kv| {
                    (
                        String::from_utf8_lossy(kv.key()).into_owned(),
                        Versioned::from(kv),
                    )
                })
                .collect())
        })
    }

    /// Puts `value` at `key` if `expect` holds, bound to etcd lease `lease`
    /// when given (the key then vanishes with the lease): one transaction.
    pub fn put_if(
        &self,
        key: String,
        value: Vec<u8>,
        expect: Expect,
        lease: Option<i64>,
    ) -> impl Future<Output = Result<TxnOutcome, CoordinationError>> + Send + 'static {
        self.call("put_if", move |mut c| async move {
            let conditions = vec![(key.clone(), expect)];
            put_if(&mut c, key, conditions, value, lease).await
        })
    }

    /// Puts `value` at `key` if every condition holds (each on its own
    /// key): one transaction. A conflict reports `key` as it is now.
    pub fn put_if_all(
        &self,
        key: String,
        conditions: Vec<(String, Expect)>,
        value: Vec<u8>,
    ) -> impl Future<Output = Result<TxnOutcome, CoordinationError>> + Send + 'static {
        self.call("put_if", move |mut c| async move {
            put_if(&mut c, key, conditions, value, None).await
        })
    }

    /// Deletes `key` if `expect` holds: one transaction.
    pub fn delete_if(
        &self,
        key: String,
        expect: Expect,
    ) -> impl Future<Output = Result<TxnOutcome, CoordinationError>> + Send + 'static {
        self.call("delete_if", move |mut c| async move {
            let txn = Txn::new()
                .when([expect.compare(&key)])
                .and_then([TxnOp::delete(key.clone(), None)])
                .or_else([TxnOp::get(key, None)]);
            swap_outcome(c.txn(txn).await?)
        })
    }
}

/// The conditional put's transaction.
pub(super) async fn put_if(
    c: &mut Client,
    key: String,
    conditions: Vec<(String, Expect)>,
    value: Vec<u8>,
    lease: Option<i64>,
) -> Result<TxnOutcome, etcd_client::Error> {
    let opts = lease.map(|id| PutOptions::new().with_lease(id));
    let when: Vec<Compare> = conditions.iter().map(|(k, e)| e.compare(k)).collect();
    let txn = Txn::new()
        .when(when)
        .and_then([TxnOp::put(key.clone(), value, opts)])
        .or_else([TxnOp::get(key, None)]);
    swap_outcome(c.txn(txn).await?)
}

pub(super) fn swap_outcome(r: etcd_client::TxnResponse) -> Result<TxnOutcome, etcd_client::Error> {
    if r.succeeded() {
        return Ok(TxnOutcome::Done(r.header().map_or(0, |h| h.revision())));
    }
    let now = r.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(g) => Some(g.kvs().first().map(Versioned::from)),
        _ => None,
    });
    Ok(TxnOutcome::Conflict(now.flatten()))
}

impl Drop for Etcd {
    fn drop(&mut self) {
        // Requests still out fail with "the etcd runtime stopped".
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}
