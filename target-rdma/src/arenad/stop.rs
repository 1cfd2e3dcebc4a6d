//! The server's stop signal: set once by [`crate::arenad::server::Server::shutdown`],
//! awaited by the accept loop and every connection.

use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// Whether the server is stopping, and the wake-up of those waiting for it.
pub(super) struct Stop {
    stopping: AtomicBool,
    notify: Notify,
}

impl Stop {
    pub(super) fn new() -> Self {
        Self {
            stopping: AtomicBool::new(false),
            notify: Notify::new(),
        }
    }

    /// Makes every [`Stop::stopped`] resolve, now and from now on.
    pub(super) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Resolves once [`Stop::stop`] was called.
    pub(super) async fn stopped(&self) {
        let mut n = pin!(self.notify.notified());
        n.as_mut().enable();
        if self.stopping.load(Ordering::SeqCst) {
            return;
        }
        n.await;
    }
}
