//! [`Rails`]: the one or two rails of a transport, and which one a payload
//! takes. A payload goes on a rail whose QP is up, the one with fewer bytes
//! outstanding; a rail that was lost is brought up again by the first
//! request that finds it due, and its first transfer is the only one on it
//! until it gets through, so a rail that comes back onto a dead link
//! delays one request, not all of them. A payload of at least
//! `stripe_bytes` is split across both rails when both carry traffic.

use std::sync::Arc;
use std::time::Instant;

use super::driver::{CqDriver, RailDriver};
use super::leases::Leases;
use super::rail::Rail;
use super::rail_slot::RailSlot;
use super::stats::TcpReason;
use crate::client::tcp::ArenaClient;
use crate::rdma::RdmaError;

/// The rails of one transport (one or two).
pub(super) struct Rails {
    slots: Vec<RailSlot>,
    busy_poll: std::time::Duration,
    min_bytes: usize,
    max_bytes: usize,
}

/// A rail chosen for a payload, and its QP.
pub(super) struct Chosen<'a> {
    pub(super) slot: &'a RailSlot,
    pub(super) rail: Arc<Rail>,
    /// It holds the one try of the rail's unproven QP: given up when the
    /// payload is done with the rail, however it ended.
    probe: bool,
}

impl<'a> Chosen<'a> {
    fn new(slot: &'a RailSlot, rail: Arc<Rail>) -> Self {
        Self {
            slot,
            rail,
            probe: false,
        }
    }
}

impl Drop for Chosen<'_> {
    fn drop(&mut self) {
        if self.probe {
            self.slot.end_probe();
        }
    }
}

impl Rails {
    /// Rails over `slots`, rail `i` at index `i`.
    pub(super) fn new(
        slots: Vec<RailSlot>,
        busy_poll: std::time::Duration,
        min_bytes: u32,
        max_bytes: u32,
    ) -> Self {
        Self {
            slots,
            busy_poll,
            min_bytes: min_bytes as usize,
            max_bytes: max_bytes as usize,
        }
    }

    /// Every rail.
    pub(super) fn slots(&self) -> &[RailSlot] {
        &self.slots
    }

    /// Why payloads go over TCP, when no rail will be used: the first
    /// rail's reason and every rail's explanation.
    pub(super) fn off(&self) -> Option<(TcpReason, String)> {
        let mut reason = None;
        let mut why = Vec::new();
        for s in &self.slots {
            let (r, w) = s.off()?;
            reason.get_or_insert(r);
            why.push(if self.slots.len() > 1 {
                format!("rail {}: {w}", s.index)
            } else {
                w
            });
        }
        reason.map(|r| (r, why.join("; ")))
    }

    /// `Ok(devices)` while payloads go by RDMA (the devices of the rails
    /// that may carry them, `+`-joined), or why they go over TCP.
    pub(super) fn status(&self) -> Result<String, String> {
        if let Some((_, why)) = self.off() {
            return Err(why);
        }
        Ok(self
            .slots
            .iter()
            .filter(|s| s.uses_rdma())
            .map(RailSlot::device)
            .collect::<Vec<_>>()
            .join("+"))
    }

    /// Whether payloads go by RDMA on some rail. Cheap: no allocation, a
    /// short lock per rail.
    pub(super) fn uses_rdma(&self) -> bool {
        self.slots.iter().any(RailSlot::uses_rdma)
    }

    /// The completion driver of driven rails; `None` otherwise.
    pub(super) fn cq_driver(&self) -> Option<CqDriver> {
        let rails: Option<Vec<RailDriver>> = self
            .slots
            .iter()
            .map(|s| {
                s.cq.as_ref().map(|handoff| RailDriver {
                    handoff: Arc::clone(handoff),
                    busy_poll: self.busy_poll,
                })
            })
            .collect();
        rails.map(|rails| CqDriver { rails })
    }

    /// Registers `[addr, addr + len)` on every rail's device. A rail whose
    /// device refuses it is turned off (its payloads would all bounce);
    /// an error only when no rail is left.
    ///
    /// # Safety
    ///
    /// As [`RdmaTransport::register_io_buffers`](super::RdmaTransport::register_io_buffers).
    pub(super) unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        stats: &super::stats::RdmaStats,
    ) -> Result<(), RdmaError> {
        let mut last = None;
        for s in &self.slots {
            // SAFETY: forwarded contract.
            if let Err(e) = unsafe { s.memory.register(addr, len, stats) } {
                if self.slots.len() > 1 {
                    s.turn_off(TcpReason::RegistrationFailed, e.to_string());
                }
                last = Some(e);
            }
        }
        match last {
            Some(e) if !self.uses_rdma() || self.slots.len() == 1 => Err(e),
            _ => Ok(()),
        }
    }

    /// The transport is dropped: every QP is torn down and the drivers end.
    pub(super) fn shut_down(&self) {
        for s in &self.slots {
            s.shut_down();
        }
    }

    /// The rail for a payload of `len` bytes, or why it goes over TCP.
    /// Rails other than `after` come first (a retry after a failure on
    /// `after`); a rail that is due is brought up on the way.
    pub(super) async fn pick<'a>(
        &'a self,
        len: usize,
        client: &ArenaClient,
        leases: &Leases,
        after: Option<u8>,
    ) -> Result<Chosen<'a>, TcpReason> {
        if len < self.min_bytes {
            return Err(TcpReason::BelowThreshold);
        }
        // Every rail off: their reason, whatever the size.
        if let Some(reason) = self.all_off() {
            return Err(reason);
        }
        if len > self.max_bytes {
            return Err(TcpReason::TooLarge);
        }
        let epoch = client.connection_epoch();
        let now = Instant::now();
        // A lost rail comes back through the request that finds it due
        // (one at a time: it is `Connecting` meanwhile), unless this is
        // the retry of a transfer that just failed.
        if after.is_none() && self.slots.len() > 1 {
            if let Some(s) = self.slots.iter().find(|s| s.due(epoch, now)) {
                let _ = s.route(len, client, leases).await;
            }
        }
        if let Some(chosen) = self.ready(after, client.connection_epoch()) {
            return Ok(chosen);
        }
        let mut reason = None;
        let order = self
            .slots
            .iter()
            .filter(|s| Some(s.index) != after)
            .chain(self.slots.iter().filter(|s| Some(s.index) == after));
        for slot in order {
            match slot.route(len, client, leases).await {
                Ok(rail) => return Ok(Chosen::new(slot, rail)),
                Err(r) => {
                    reason.get_or_insert(r);
                }
            }
        }
        Err(reason.unwrap_or(TcpReason::QpError))
    }

    /// The first rail's reason when no rail will be used (no allocation).
    fn all_off(&self) -> Option<TcpReason> {
        let mut first = None;
        for s in &self.slots {
            first = Some(first.unwrap_or(s.off_reason()?));
        }
        first
    }

    /// A rail whose QP is up, other than `after`: an unproven one when its
    /// one try is free (the request that takes it proves it), else the
    /// proven one with fewer bytes outstanding (or, even, fewer transfers).
    fn ready(&self, after: Option<u8>, epoch: Option<u64>) -> Option<Chosen<'_>> {
        let others = || self.slots.iter().filter(move |s| Some(s.index) != after);
        let any_proven = self.slots.iter().any(RailSlot::proven);
        if any_proven {
            for slot in others().filter(|s| !s.proven()) {
                if let Some(rail) = slot.ready(epoch).filter(|_| slot.try_probe()) {
                    let mut probe = Chosen::new(slot, rail);
                    probe.probe = true;
                    return Some(probe);
                }
            }
        }
        others()
            .filter(|s| s.proven() || !any_proven)
            .filter_map(|slot| slot.ready(epoch).map(|rail| (slot, rail)))
            // Fewer bytes outstanding; when even, fewer transfers so far
            // (idle rails take turns).
            .min_by_key(|(s, _)| (s.outstanding(), s.transfers()))
            .map(|(slot, rail)| Chosen::new(slot, rail))
    }

    /// The other rail, to carry half of a payload with `first`: only a
    /// proven one that is up.
    pub(super) fn partner(&self, first: &RailSlot, epoch: Option<u64>) -> Option<Chosen<'_>> {
        self.slots
            .iter()
            .filter(|s| s.index != first.index && s.proven())
            .find_map(|slot| slot.ready(epoch).map(|rail| Chosen::new(slot, rail)))
    }
}
