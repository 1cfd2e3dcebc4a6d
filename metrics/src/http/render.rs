//! The render workers: build the answers that read daemon state off the
//! event loop, so a slow or stuck render never delays `/health` or the
//! other connections.
//!
//! Two workers, so one stuck render (a collector waiting on a lock a
//! wedged daemon holds) still leaves `/ready` an answer; a bounded queue in
//! front of them, so a flood of scrapes costs a fixed amount of memory and
//! is told 503 at once instead of waiting.

use super::routes::{self, Rendered};
use crate::telemetry::Telemetry;
use parking_lot::Mutex;
use rustix::fd::OwnedFd;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::Arc;

/// Render workers.
const WORKERS: usize = 2;
/// Requests waiting for a worker; past it a request is answered 503.
const QUEUE: usize = 16;

/// A request for a worker, naming its connection.
pub(super) struct Job {
    pub token: u64,
    pub what: Rendered,
    pub head_only: bool,
}

/// A built answer for the connection `token`.
pub(super) struct Done {
    pub token: u64,
    pub answer: Vec<u8>,
}

/// The queue in front of the workers; dropping it lets them exit once
/// their current render returns.
pub(super) struct Renderers {
    jobs: SyncSender<Job>,
}

impl Renderers {
    /// Starts the workers; each finished answer goes to `done`, and a
    /// write to the eventfd `wake` tells the event loop.
    pub(super) fn spawn(
        tel: &Arc<Telemetry>,
        done: &Sender<Done>,
        wake: &Arc<OwnedFd>,
    ) -> std::io::Result<Renderers> {
        let (jobs, rx) = mpsc::sync_channel(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..WORKERS {
            let (tel, done, wake, rx) = (
                Arc::clone(tel),
                done.clone(),
                Arc::clone(wake),
                Arc::clone(&rx),
            );
            std::thread::Builder::new()
                .name("metrics-render".into())
                .spawn(move || work(&tel, &rx, &done, &wake))?;
        }
        Ok(Renderers { jobs })
    }

    /// Queues `job`; gives it back when the queue is full.
    pub(super) fn submit(&self, job: Job) -> Result<(), Job> {
        self.jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(j) | TrySendError::Disconnected(j) => j,
        })
    }
}

fn work(tel: &Telemetry, rx: &Mutex<Receiver<Job>>, done: &Sender<Done>, wake: &OwnedFd) {
    loop {
        // The lock only hands jobs out; no socket I/O happens under it.
        let job = rx.lock().recv();
        let Ok(job) = job else { return };
        let answer = routes::render(tel, job.what, job.head_only);
        if done
            .send(Done {
                token: job.token,
                answer,
            })
            .is_err()
        {
            return;
        }
        // Adds 1 to the counter; it cannot overflow within any lifetime.
        let _ = rustix::io::write(wake, &1u64.to_ne_bytes());
    }
}
