//! `ublkctl activate` and `release`: a replicated device's writer role
//! moved between ublkd processes (replica/handover.rs in target-rdma has
//! the rules). The device's rebuild thread records the role in the
//! device's definition as it changes, and hands the role over when a
//! standby asks for it.

use std::sync::Arc;

use futures::executor::block_on;
use ublk_metrics::events;

use super::replicas::Replicated;
use super::{DeviceError, Manager};
use crate::ctl::DeviceInfo;

impl Manager {
    /// Takes a standby device's writer role: the writer is asked through
    /// etcd, flushes and gives it up (or, not answering, loses it when its
    /// lease expires); then the epoch is raised and writes are served.
    /// Nothing to do for a device that holds the role.
    pub fn activate(&self, id: u32) -> Result<DeviceInfo, DeviceError> {
        let rep = self.replicated(id)?;
        block_on(rep.set().activate())?;
        tracing::info!(event = events::DEVICE_ACTIVATED, id, volume = %rep.set().volume());
        self.info(id)
    }

    /// Hands a device's writer role over to the standby asking for it:
    /// no write is acknowledged from now on, every member flushes what was,
    /// and the role is given up. A device that is a standby already has
    /// nothing to hand over.
    pub fn release(&self, id: u32) -> Result<DeviceInfo, DeviceError> {
        let rep = self.replicated(id)?;
        block_on(rep.set().release())?;
        tracing::info!(event = events::DEVICE_RELEASED, id, volume = %rep.set().volume());
        self.info(id)
    }

    fn replicated(&self, id: u32) -> Result<Arc<Replicated>, DeviceError> {
        let devs = self.devices.lock();
        let dev = devs.get(&id).ok_or(DeviceError::Unknown(id))?;
        dev.replicated
            .as_ref()
            .map(|(r, _)| Arc::clone(r))
            .ok_or_else(|| {
                DeviceError::BadRequest(format!(
                    "device {id} has no writer role to move: only replicated devices \
                     (--peer given more than once, --replicas, or --standby) hand over"
                ))
            })
    }
}
