//! FLUSH: every dirty slot written back, with the store lock held once
//! in-flight write-backs are done, so that everything acknowledged before
//! it is covered, then the index committed ([`commit_index`]).

use super::commit::commit_index;
use super::shared::{Core, Guard};
use super::write_back::WriteBack;
use crate::store::error::StoreError;

/// Most write-backs per submission during a flush.
const WRITE_BATCH: usize = 64;
/// Most of those whose slot is copied first (ALLOC-leased), so a flush
/// holds at most this many blob copies.
const COPY_BATCH: usize = 8;

/// Writes back every dirty slot, leased ones included (their bytes are
/// in place), and commits the index. Runs in rounds when free extents
/// are short: each commit frees the extents the last round superseded.
/// In-flight write-backs are waited for first, and the lock is then held
/// throughout, so everything acknowledged before the call is covered.
pub(in crate::store) fn flush(core: &Core, g: &mut Guard<'_>) -> Result<(), StoreError> {
    g.transit.flush_waiting += 1;
    while g.transit.writes > 0 {
        core.settled.wait(g);
    }
    g.transit.flush_waiting -= 1;
    let res = flush_locked(core, g);
    // Evictors held back while we waited may go on.
    core.settled.notify_all();
    res
}

fn flush_locked(core: &Core, g: &mut Guard<'_>) -> Result<(), StoreError> {
    let st = &mut **g;
    let dirty: Vec<u32> = (0..st.slots.len() as u32)
        .filter(|&s| {
            let m = &st.slots.meta[s as usize];
            m.owner.is_some() && m.dirty
        })
        .collect();
    let mut todo = &dirty[..];
    while !todo.is_empty() {
        let st = &mut **g;
        let mut free = st.images.extents.free_count();
        let (mut n, mut copies) = (0, 0);
        for &s in todo.iter().take(WRITE_BATCH) {
            if st.slots.meta[s as usize].writers > 0 {
                // Copied before writing (see `WriteBack::copy`): a few
                // per batch bound that memory.
                if copies == COPY_BATCH {
                    break;
                }
                copies += 1;
            }
            if WriteBack::needs_fresh(st, s) {
                if free == 0 {
                    break;
                }
                free -= 1;
            }
            n += 1;
        }
        if n == 0 {
            commit_index(st, &core.swap)?;
            if st.images.extents.free_count() == 0 {
                return Err(st.no_space());
            }
            continue;
        }
        let plan = WriteBack::plan(st, &core.swap, &todo[..n], true)?;
        core.write_back(g, &plan, false, false)?;
        todo = &todo[n..];
    }
    commit_index(g, &core.swap)?;
    g.counters.flushes += 1;
    Ok(())
}
