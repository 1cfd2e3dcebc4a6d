//! Local memory for one RDMA transfer, in order of preference: the caller's
//! buffer in place when it lies in a region registered once (ublkd's tag
//! buffers); a buffer of the transport's registered pool (one copy, counted
//! as a bounce); a registration made for that one transfer (counted). When
//! none works the payload goes inline on TCP, for the reason returned.

use std::sync::Arc;

use parking_lot::Mutex;
use tracing::warn;
use ublk_metrics::events;

use super::stats::{RdmaStats, TcpReason};
use crate::rdma::{Access, MemoryRegion, RdmaError, RdmaProvider};

/// Registered memory owned by the transport, lent one buffer at a time.
pub(super) struct Pool {
    // Deregistered before the memory is freed.
    mr: MemoryRegion,
    mem: *mut [u8],
    buffer_bytes: usize,
    free: Mutex<Vec<usize>>,
}

// SAFETY: the pool memory is only reached through buffers lent exclusively
// (one index to one `Local` at a time, under `free`).
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl Pool {
    /// `buffers` buffers of `buffer_bytes`, registered as one region.
    pub(super) fn new(
        provider: &dyn RdmaProvider,
        buffers: u32,
        buffer_bytes: u32,
    ) -> Result<Self, RdmaError> {
        let len = buffers as usize * buffer_bytes as usize;
        let mem = Box::into_raw(vec![0u8; len].into_boxed_slice());
        // SAFETY: `mem` is a live allocation of `len` bytes, freed in Drop
        // only after the region (declared first) is deregistered.
        let mr = match unsafe {
            provider
                .domain()
                .register(mem.cast::<u8>(), len, Access::Local)
        } {
            Ok(mr) => mr,
            Err(e) => {
                // SAFETY: `mem` came from Box::into_raw above and was not shared.
                drop(unsafe { Box::from_raw(mem) });
                return Err(e);
            }
        };
        Ok(Self {
            mr,
            mem,
            buffer_bytes: buffer_bytes as usize,
            free: Mutex::new((0..buffers as usize).collect()),
        })
    }

    fn addr(&self, i: usize) -> usize {
        self.mr.addr + i * self.buffer_bytes
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: `mem` came from Box::into_raw in `new`; every buffer is
        // lent to a `Local` that borrows the pool, so none is left.
        drop(unsafe { Box::from_raw(self.mem) });
    }
}

/// Regions the caller registered, sorted by address, so a transfer finds
/// its region by binary search (a queue registers one region per tag).
#[derive(Default)]
pub(super) struct Regions(Vec<MemoryRegion>);

impl Regions {
    fn insert(&mut self, mr: MemoryRegion) {
        let at = self.0.partition_point(|r| r.addr < mr.addr);
        self.0.insert(at, mr);
    }

    /// The key of the region holding all of `[addr, addr + len)`.
    fn lkey(&self, addr: usize, len: usize) -> Option<u32> {
        // The last region starting at or before `addr` is the only candidate.
        let i = self.0.partition_point(|r| r.addr <= addr);
        i.checked_sub(1)
            .map(|i| &self.0[i])
            .filter(|r| r.contains(addr, len))
            .map(|r| r.lkey)
    }
}

/// Local memory for one transfer; a pool buffer goes back when it drops, a
/// per-transfer registration is deregistered.
pub(super) enum Local<'a> {
    /// In place, inside a registered region.
    Region { lkey: u32, addr: usize },
    /// A pool buffer, lent to this transfer alone.
    Pool {
        pool: &'a Pool,
        index: usize,
        stats: &'a RdmaStats,
    },
    /// The caller's memory, registered for this transfer.
    PerOp(MemoryRegion),
}

impl Local<'_> {
    /// Key and address for the work request.
    pub(super) fn lkey_addr(&self) -> (u32, usize) {
        match self {
            Local::Region { lkey, addr } => (*lkey, *addr),
            Local::Pool { pool, index, .. } => (pool.mr.lkey, pool.addr(*index)),
            Local::PerOp(mr) => (mr.lkey, mr.addr),
        }
    }

    /// Before a WRITE: copies the payload into a pool buffer (the other
    /// kinds already are the payload).
    pub(super) fn copy_in(&self, src: &[u8]) {
        if let Local::Pool { pool, index, .. } = self {
            let n = src.len().min(pool.buffer_bytes);
            // SAFETY: buffer `index` is lent to this `Local` alone, and `n`
            // bytes fit in it.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), pool.addr(*index) as *mut u8, n) };
        }
    }

    /// After a completed READ: copies the payload out of a pool buffer (the
    /// other kinds received it in place).
    pub(super) fn copy_out(&self, dst: &mut [u8]) {
        if let Local::Pool { pool, index, .. } = self {
            let n = dst.len().min(pool.buffer_bytes);
            // SAFETY: buffer `index` is lent to this `Local` alone, the READ
            // into it completed, and `n` bytes fit in it.
            unsafe {
                std::ptr::copy_nonoverlapping(pool.addr(*index) as *const u8, dst.as_mut_ptr(), n)
            };
        }
    }
}

impl Drop for Local<'_> {
    fn drop(&mut self) {
        if let Local::Pool { pool, index, stats } = self {
            pool.free.lock().push(*index);
            stats.pool_return();
        }
    }
}

/// Where one transport's transfers find local memory.
pub(super) struct Memory {
    provider: Option<Arc<dyn RdmaProvider>>,
    // Dropped with the transport, after its QP (see RdmaTransport).
    regions: Mutex<Regions>,
    pool: Option<Pool>,
}

impl Memory {
    /// Memory of a transport on `provider` (none: every payload goes by TCP).
    pub(super) fn new(provider: Option<Arc<dyn RdmaProvider>>, pool: Option<Pool>) -> Self {
        Self {
            provider,
            regions: Mutex::new(Regions::default()),
            pool,
        }
    }

    /// Registers `[addr, addr + len)` for in-place transfers.
    ///
    /// # Safety
    ///
    /// The memory must stay valid until `self` is dropped, and is not to be
    /// touched while a transfer using it runs.
    pub(super) unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        stats: &RdmaStats,
    ) -> Result<(), RdmaError> {
        let Some(p) = &self.provider else {
            return Err(RdmaError::NoDevice {
                detail: "this transport has no RDMA device".into(),
            });
        };
        // SAFETY: forwarded contract; the region lives in `self`.
        let mr = unsafe { p.domain().register(addr, len, Access::Local) }
            .inspect_err(|_| stats.inc(|s| &s.registration_failures))?;
        self.regions.lock().insert(mr);
        Ok(())
    }

    /// Local memory for `len` bytes at `addr`, or why the payload goes by TCP.
    pub(super) fn local<'a>(
        &'a self,
        addr: usize,
        len: usize,
        stats: &'a RdmaStats,
    ) -> Result<Local<'a>, TcpReason> {
        if let Some(lkey) = self.regions.lock().lkey(addr, len) {
            stats.inc(|s| &s.registrations_pooled);
            return Ok(Local::Region { lkey, addr });
        }
        if let Some(pool) = self.pool.as_ref().filter(|p| len <= p.buffer_bytes) {
            if let Some(index) = pool.free.lock().pop() {
                stats.pool_take();
                stats.inc(|s| &s.registrations_pooled);
                stats.inc(|s| &s.bounce_copies);
                return Ok(Local::Pool { pool, index, stats });
            }
        }
        let p = self.provider.as_ref().ok_or(TcpReason::NoLocalDevice)?;
        // SAFETY: the caller's buffer outlives the request, whose future
        // borrows it; an abandoned request fails the QP (InFlight) before
        // the borrow ends, and the region is dropped when the request ends.
        match unsafe { p.domain().register(addr as *mut u8, len, Access::Local) } {
            Ok(mr) => {
                stats.inc(|s| &s.registrations_per_op);
                Ok(Local::PerOp(mr))
            }
            Err(e) => {
                stats.inc(|s| &s.registration_failures);
                warn!(event = events::RDMA_REGISTER_FAILED, error = %e);
                Err(TcpReason::RegistrationFailed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::loopback::LoopbackProvider;

    fn region(addr: usize, len: usize, lkey: u32) -> MemoryRegion {
        MemoryRegion::new(addr, len, lkey, lkey, Box::new(()))
    }

    #[test]
    fn a_transfer_finds_the_one_region_that_holds_all_of_it() {
        let mut r = Regions::default();
        for (addr, key) in [(3000, 3), (1000, 1), (2000, 2)] {
            r.insert(region(addr, 500, key));
        }
        assert_eq!(r.lkey(1000, 500), Some(1));
        assert_eq!(r.lkey(2100, 100), Some(2));
        assert_eq!(r.lkey(3499, 1), Some(3));
        assert_eq!(r.lkey(1400, 200), None, "runs past its region");
        assert_eq!(r.lkey(1600, 10), None, "between regions");
        assert_eq!(r.lkey(999, 10), None, "before the first");
        assert_eq!(r.lkey(4000, 1), None, "after the last");
    }

    #[test]
    fn pool_buffers_are_lent_once_bounce_and_come_back() {
        let p = LoopbackProvider::new();
        let stats = RdmaStats::default();
        let m = Memory::new(Some(p.clone()), Some(Pool::new(&*p, 2, 4096).unwrap()));
        let mut src = vec![7u8; 4096];
        let a = m.local(src.as_mut_ptr() as usize, 4096, &stats).unwrap();
        let b = m.local(src.as_mut_ptr() as usize, 4096, &stats).unwrap();
        assert!(matches!(a, Local::Pool { .. }) && matches!(b, Local::Pool { .. }));
        assert_ne!(a.lkey_addr().1, b.lkey_addr().1, "two distinct buffers");
        a.copy_in(&src);
        let mut back = vec![0u8; 4096];
        a.copy_out(&mut back);
        assert_eq!(back, src, "the bounce buffer holds the payload");
        // Exhausted: the third registers its memory for itself.
        let c = m.local(src.as_mut_ptr() as usize, 4096, &stats).unwrap();
        assert!(matches!(c, Local::PerOp(_)));
        assert_eq!(
            stats.pool_in_use.load(std::sync::atomic::Ordering::Relaxed),
            2
        );
        drop((a, b, c));
        assert_eq!(
            stats.pool_in_use.load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        assert_eq!(
            stats.pool_peak.load(std::sync::atomic::Ordering::Relaxed),
            2
        );
        assert!(matches!(
            m.local(src.as_mut_ptr() as usize, 4096, &stats).unwrap(),
            Local::Pool { .. }
        ));
    }

    #[test]
    fn registered_memory_is_used_in_place_and_failures_say_why() {
        let p = LoopbackProvider::new();
        let stats = RdmaStats::default();
        let m = Memory::new(Some(p.clone()), None);
        let mut buf = vec![0u8; 8192];
        // SAFETY: `buf` outlives `m`'s use of it in this test.
        unsafe { m.register(buf.as_mut_ptr(), buf.len(), &stats) }.unwrap();
        let addr = buf.as_mut_ptr() as usize + 4096;
        assert!(matches!(
            m.local(addr, 4096, &stats).unwrap(),
            Local::Region { addr: a, .. } if a == addr
        ));
        p.refuse_registrations_of(100);
        let other = [0u8; 100];
        assert_eq!(
            m.local(other.as_ptr() as usize, 100, &stats).err(),
            Some(TcpReason::RegistrationFailed)
        );
        let none = Memory::new(None, None);
        assert_eq!(
            none.local(other.as_ptr() as usize, 100, &stats).err(),
            Some(TcpReason::NoLocalDevice)
        );
        drop(m);
        drop(buf);
    }
}
