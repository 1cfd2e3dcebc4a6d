//! The threads connections run on: one single-threaded tokio runtime per
//! worker thread, and each connection handed to one of them for its whole
//! life (its socket registered with that runtime's reactor, its tasks and
//! timers run only there). A request read and answered inline so never
//! crosses a thread: the thread epoll woke reads it, runs it and writes
//! the answer, where a work-stealing runtime woke a second thread per
//! request (two futex calls per QD1 round trip, measured). The threads
//! start with the server, so a thread limit reached later cannot stop it.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

/// One worker: where its connections are spawned, and its stop signal.
struct Worker {
    handle: Handle,
    stop: oneshot::Sender<()>,
    thread: JoinHandle<()>,
}

/// The worker threads; dropping them lets each thread end its runtime.
pub(super) struct Workers {
    workers: Vec<Worker>,
    next: AtomicUsize,
}

impl Workers {
    /// Starts `threads` worker threads, each running its own runtime and
    /// first running `init` there (within the runtime).
    pub(super) fn start(
        threads: usize,
        init: impl FnOnce() + Clone + Send + 'static,
    ) -> io::Result<Self> {
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let rt = Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()?;
            let handle = rt.handle().clone();
            let (stop, stopped) = oneshot::channel::<()>();
            let init = init.clone();
            let thread = thread::Builder::new()
                .name(format!("arenad-io-{i}"))
                .spawn(move || {
                    rt.block_on(async {
                        init();
                        let _ = stopped.await;
                    });
                    // Connections still open past the shutdown deadline
                    // are cut here.
                    rt.shutdown_timeout(Duration::from_secs(1));
                })?;
            workers.push(Worker {
                handle,
                stop,
                thread,
            });
        }
        Ok(Self {
            workers,
            next: AtomicUsize::new(0),
        })
    }

    /// Runs `task` on the next worker in turn.
    pub(super) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        drop(self.workers[i].handle.spawn(task));
    }

    /// Ends every worker's runtime (cutting what still runs there) and
    /// waits for its thread.
    pub(super) fn stop(self) {
        let threads: Vec<JoinHandle<()>> = self
            .workers
            .into_iter()
            .map(|w| {
                let _ = w.stop.send(());
                w.thread
            })
            .collect();
        for t in threads {
            let _ = t.join();
        }
    }
}
