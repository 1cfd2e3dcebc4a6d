//! The closed request loop the arena and serving benches both drive, so
//! their figures come from the same client-side work per request.

use std::cell::RefCell;

use futures::stream::{FuturesUnordered, StreamExt};
use target_rdma::client::ArenaClient;

#[derive(Clone, Copy)]
pub enum Dir {
    Read,
    Write,
}

/// Keeps `qd` requests of `c` in flight at the `(key, offset)` pairs
/// `next` yields while `running()` holds; the requests completed. Reads
/// borrow a buffer from `pool` (one per slot of depth) and give it back,
/// as a ublk queue reuses its buffers: allocating per request would
/// measure the allocator.
pub async fn closed_loop(
    c: &ArenaClient,
    dir: Dir,
    qd: usize,
    data: &[u8],
    pool: &RefCell<Vec<Vec<u8>>>,
    mut next: impl FnMut() -> (u64, u32),
    running: impl Fn() -> bool,
) -> u64 {
    let mut ops = 0;
    let mut inflight = FuturesUnordered::new();
    loop {
        while inflight.len() < qd && running() {
            let (key, off) = next();
            inflight.push(async move {
                match dir {
                    Dir::Write => c.write(key, off, data).await,
                    Dir::Read => {
                        let mut out = pool.borrow_mut().pop().expect("a buffer per slot");
                        let r = c.read_found(key, off, &mut out).await.map(|_| ());
                        pool.borrow_mut().push(out);
                        r
                    }
                }
            });
        }
        match inflight.next().await {
            Some(r) => {
                r.expect("bench request");
                ops += 1;
            }
            None => return ops,
        }
    }
}
