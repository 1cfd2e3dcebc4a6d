//! The threads that run store calls which may block (a fault-in from swap,
//! FLUSH's write-back and fsyncs, an epoch's file sync), so the reactor
//! never waits on a disk. Their number is fixed and they all start with
//! the server: a thread limit reached later (a pids cgroup, RLIMIT_NPROC)
//! cannot take the pool away, and a flood of slow requests queues for it
//! instead of growing it.

use std::collections::VecDeque;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;

use parking_lot::{Condvar, Mutex};
use tokio::sync::{oneshot, Semaphore};

type Job = Box<dyn FnOnce() + Send>;

/// Jobs handed to the threads, and whether the pool is closing.
#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The pool; dropping it lets its threads exit once their job is done.
pub(super) struct Blocking {
    queue: Arc<(Mutex<Queue>, Condvar)>,
    /// One per thread: a job waits (asynchronously) for a free thread, so
    /// the queue never holds more jobs than there are threads.
    free: Arc<Semaphore>,
}

/// A job that panicked (a bug): its request gets an internal error.
#[derive(Debug)]
pub(super) struct Panicked;

impl Blocking {
    /// Starts `threads` threads.
    pub(super) fn start(threads: usize) -> io::Result<Self> {
        let queue = Arc::new((Mutex::new(Queue::default()), Condvar::new()));
        for i in 0..threads {
            let q = Arc::clone(&queue);
            thread::Builder::new()
                .name(format!("arenad-blk-{i}"))
                .spawn(move || work(&q))?;
        }
        Ok(Self {
            queue,
            free: Arc::new(Semaphore::new(threads)),
        })
    }

    /// Runs `f` on a pool thread once one is free, and returns its result.
    pub(super) async fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, Panicked> {
        let permit = Arc::clone(&self.free)
            .acquire_owned()
            .await
            .map_err(|_| Panicked)?;
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let r = catch_unwind(AssertUnwindSafe(f));
            drop(permit);
            if let Ok(r) = r {
                let _ = tx.send(r);
            }
        });
        {
            let (q, cv) = &*self.queue;
            q.lock().jobs.push_back(job);
            cv.notify_one();
        }
        rx.await.map_err(|_| Panicked)
    }
}

impl Drop for Blocking {
    fn drop(&mut self) {
        let (q, cv) = &*self.queue;
        q.lock().closed = true;
        cv.notify_all();
    }
}

fn work(queue: &(Mutex<Queue>, Condvar)) {
    let (q, cv) = queue;
    loop {
        let job = {
            let mut g = q.lock();
            loop {
                if let Some(job) = g.jobs.pop_front() {
                    break job;
                }
                if g.closed {
                    return;
                }
                cv.wait(&mut g);
            }
        };
        job();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_beyond_the_threads_wait_and_all_complete() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let pool = Arc::new(Blocking::start(2).unwrap());
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let results = rt.block_on(futures::future::join_all((0..8).map(|i| {
            let (pool, running, most) =
                (Arc::clone(&pool), Arc::clone(&running), Arc::clone(&most));
            async move {
                pool.run(move || {
                    use std::sync::atomic::Ordering::SeqCst;
                    let now = running.fetch_add(1, SeqCst) + 1;
                    most.fetch_max(now, SeqCst);
                    thread::sleep(std::time::Duration::from_millis(5));
                    running.fetch_sub(1, SeqCst);
                    i
                })
                .await
                .unwrap()
            }
        })));
        assert_eq!(results, (0..8).collect::<Vec<_>>());
        assert!(most.load(std::sync::atomic::Ordering::SeqCst) <= 2);
        let panicked = rt.block_on(pool.run(|| panic!("a bug")));
        assert!(panicked.is_err(), "a panic is an error, not a hang");
        assert_eq!(
            rt.block_on(pool.run(|| 7)).unwrap(),
            7,
            "the thread survives"
        );
    }
}
