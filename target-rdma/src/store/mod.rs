//! Temporary in-memory stand-in for the swap-backed store, so the server, client and target build and test while the real engine is finished on its branch; replaced by it.
use crate::proto::Lease;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;

pub struct StoreConfig {
    pub dir: PathBuf,
    pub arena_bytes: u64,
    pub blob_bytes: u32,
    pub swap_bytes: u64,
}
pub struct VolumeSpec {
    pub name: String,
    pub quota_blobs: u64,
}
pub type VolumeId = u32;
pub type HolderId = u64;
pub type RevokeHook = Box<dyn Fn(HolderId, VolumeId, u64, u64) + Send + Sync>;
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no space")]
    NoSpace,
    #[error("quota {volume} {quota}")]
    QuotaExceeded { volume: String, quota: u64 },
    #[error("busy")]
    Busy,
    #[error("unknown lease {token}")]
    UnknownLease { token: u64 },
    #[error("lease mismatch {token}")]
    LeaseMismatch { token: u64 },
    #[error("out of range {offset} {len} {blob_bytes}")]
    OutOfRange {
        offset: u32,
        len: usize,
        blob_bytes: u32,
    },
    #[error("io {what}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("corrupt {file}: {detail}")]
    Corrupt { file: PathBuf, detail: String },
    #[error("invalid config {key}: {detail}")]
    InvalidConfig { key: &'static str, detail: String },
}
#[derive(Default, Debug, Clone)]
pub struct StoreStats {}
pub struct Store {
    blob: u32,
    m: Mutex<HashMap<(u32, u64), Vec<u8>>>,
    leases: Mutex<HashMap<u64, (HolderId, u32, u64)>>,
    next: Mutex<u64>,
}
impl Store {
    pub fn open(cfg: StoreConfig, _v: &[VolumeSpec]) -> Result<Store, StoreError> {
        Ok(Store {
            blob: cfg.blob_bytes,
            m: Default::default(),
            leases: Default::default(),
            next: Mutex::new(1),
        })
    }
    pub fn generation(&self) -> u64 {
        1
    }
    pub fn blob_bytes(&self) -> u32 {
        self.blob
    }
    pub fn set_revoke_hook(&self, _h: RevokeHook) {}
    fn chk(&self, offset: u32, len: usize) -> Result<(), StoreError> {
        if offset as usize + len > self.blob as usize {
            Err(StoreError::OutOfRange {
                offset,
                len,
                blob_bytes: self.blob,
            })
        } else {
            Ok(())
        }
    }
    pub fn write(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> Result<(), StoreError> {
        self.chk(offset, data.len())?;
        let mut m = self.m.lock();
        let b = m
            .entry((vol, key))
            .or_insert_with(|| vec![0; self.blob as usize]);
        b[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    pub fn read(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> Result<bool, StoreError> {
        self.chk(offset, out.len())?;
        let m = self.m.lock();
        match m.get(&(vol, key)) {
            Some(b) => {
                out.copy_from_slice(&b[offset as usize..offset as usize + out.len()]);
                Ok(true)
            }
            None => {
                out.fill(0);
                Ok(false)
            }
        }
    }
    fn lease(&self, vol: VolumeId, key: u64, holder: HolderId) -> Lease {
        let mut n = self.next.lock();
        *n += 1;
        self.leases.lock().insert(*n, (holder, vol, key));
        Lease {
            slot_offset: 0,
            token: *n,
        }
    }
    pub fn alloc(&self, vol: VolumeId, key: u64, holder: HolderId) -> Result<Lease, StoreError> {
        self.m
            .lock()
            .entry((vol, key))
            .or_insert_with(|| vec![0; self.blob as usize]);
        Ok(self.lease(vol, key, holder))
    }
    pub fn get(
        &self,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Option<Lease>, StoreError> {
        if !self.m.lock().contains_key(&(vol, key)) {
            return Ok(None);
        }
        Ok(Some(self.lease(vol, key, holder)))
    }
    pub fn commit(
        &self,
        _vol: VolumeId,
        _key: u64,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.release(token, holder)
    }
    pub fn release(&self, token: u64, holder: HolderId) -> Result<(), StoreError> {
        match self.leases.lock().remove(&token) {
            Some((h, _, _)) if h == holder => Ok(()),
            _ => Err(StoreError::UnknownLease { token }),
        }
    }
    pub fn with_lease<R>(
        &self,
        token: u64,
        _holder: HolderId,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, StoreError> {
        let (_, v, k) = *self
            .leases
            .lock()
            .get(&token)
            .ok_or(StoreError::UnknownLease { token })?;
        Ok(f(self.m.lock().get_mut(&(v, k)).unwrap()))
    }
    pub fn remove(&self, vol: VolumeId, start: u64, end: u64) -> Result<u64, StoreError> {
        let mut m = self.m.lock();
        let before = m.len();
        m.retain(|(v, k), _| !(*v == vol && *k >= start && *k < end));
        Ok((before - m.len()) as u64)
    }
    pub fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
    pub fn drop_holder(&self, holder: HolderId) {
        self.leases.lock().retain(|_, (h, _, _)| *h != holder);
    }
    pub fn stats(&self) -> StoreStats {
        StoreStats::default()
    }
}
