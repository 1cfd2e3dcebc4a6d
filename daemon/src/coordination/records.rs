//! The key layout in etcd and the JSON records under it. Everything lives
//! under `etcd.prefix` (default `/ublk/`); names in keys are
//! percent-encoded outside `[A-Za-z0-9._-]`, so a volume or peer name can
//! never reach into another key:
//!
//! | key | value | written |
//! |---|---|---|
//! | `<prefix>volumes/<volume>/membership` | [`MembershipRecord`]: epoch, members (peer id or `host:port`) and their states, size, reason | compare-and-swap on the key's `mod_revision` (created only if absent) |
//! | `<prefix>volumes/<volume>/writer` | [`WriterRecord`]: the ublkd serving the volume | created only if absent, bound to that ublkd's etcd lease |
//! | `<prefix>peers/<peer id>` | [`PeerRecord`]: address, capacity, failure domain | `ublkctl peer add` / `del` (or `etcdctl put`) |

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use target_rdma::replica::{MemberRecord, MemberState, Membership};
use ublk_metrics::EpochReason;

/// The keys of one prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

/// Percent-encodes every byte outside `[A-Za-z0-9._-]`.
pub fn encode(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"._-".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Keys {
    /// Keys under `prefix` (which starts and ends with `/`).
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }

    /// The volume's replica set and epoch.
    pub fn membership(&self, volume: &str) -> String {
        format!("{}volumes/{}/membership", self.prefix, encode(volume))
    }

    /// The volume's writer key.
    pub fn writer(&self, volume: &str) -> String {
        format!("{}volumes/{}/writer", self.prefix, encode(volume))
    }

    /// A standby's request for the volume's writer role, bound to the
    /// standby's lease; under its own prefix so that a writer finds every
    /// request in one small range read.
    pub fn handover(&self, volume: &str) -> String {
        format!("{}{}", self.handovers(), encode(volume))
    }

    /// Every pending hand-over request.
    pub fn handovers(&self) -> String {
        format!("{}handover/", self.prefix)
    }

    /// Every volume's keys.
    pub fn volumes(&self) -> String {
        format!("{}volumes/", self.prefix)
    }

    /// One peer of the placement pool.
    pub fn peer(&self, id: &str) -> String {
        format!("{}peers/{}", self.prefix, encode(id))
    }

    /// The placement pool.
    pub fn peers(&self) -> String {
        format!("{}peers/", self.prefix)
    }
}

/// A registered arena peer: what placement chooses from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerRecord {
    /// Stable name (the key), e.g. `mem1`.
    pub id: String,
    /// `host:port` of its arenad.
    pub addr: String,
    /// Bytes of volume this peer may hold (its arenad's swap, typically).
    pub capacity: u64,
    /// Rack, power feed, zone: replicas of one volume go to distinct
    /// domains. A peer without one is a domain of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
}

impl PeerRecord {
    /// The failure domain placement spreads over.
    pub fn domain(&self) -> &str {
        self.failure_domain.as_deref().unwrap_or(&self.id)
    }

    /// Checks what an operator typed.
    pub fn validate(&self) -> Result<(), String> {
        if self.id.is_empty() || self.id.len() > 64 || self.id.chars().any(char::is_control) {
            return Err(format!(
                "peer id {:?}: must be 1 to 64 printable characters",
                self.id
            ));
        }
        if self
            .addr
            .rsplit_once(':')
            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        {
            return Err(format!("peer address {:?}: must be HOST:PORT", self.addr));
        }
        if self.capacity == 0 {
            return Err("peer capacity must be above zero".into());
        }
        if let Some(d) = &self.failure_domain {
            if d.is_empty() || d.len() > 64 {
                return Err(format!("failure domain {d:?}: must be 1 to 64 characters"));
            }
        }
        Ok(())
    }
}

/// Who serves a volume: the value of its writer key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterRecord {
    /// `etcd.host_id` (the host name by default).
    pub host: String,
    /// Its `state_dir`.
    pub state_dir: PathBuf,
    /// Its process id.
    pub pid: u32,
    /// Unix time it took the volume.
    pub since: u64,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl WriterRecord {
    /// The same ublkd installation (host and state dir), whatever process.
    pub fn same_installation(&self, other: &WriterRecord) -> bool {
        self.host == other.host && self.state_dir == other.state_dir
    }
}

impl std::fmt::Display for WriterRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ublkd on {} (pid {}, state dir {}) since {} s",
            self.host,
            self.pid,
            self.state_dir.display(),
            unix_now().saturating_sub(self.since)
        )
    }
}

/// A volume's record in etcd: the membership the replication core reads
/// and swaps (the core's [`Membership`], stored as is, so `etcdctl get`
/// shows the same JSON the file coordinator writes), plus what placement
/// and operators need beside it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MembershipRecord {
    /// Epoch and members.
    #[serde(flatten)]
    pub membership: Membership,
    /// Bytes of the volume, for placement's accounting of peer capacity.
    pub size: u64,
    /// Why the last change was made (an [`EpochReason`] label).
    pub reason: String,
}

impl MembershipRecord {
    /// A new volume of `size` bytes on `peers`, all healthy, at epoch 1.
    pub fn created(peers: &[String], size: u64) -> Result<Self, String> {
        Ok(Self {
            membership: Membership::new_volume(peers)?,
            size,
            reason: EpochReason::Created.as_str().into(),
        })
    }

    /// Members that hold a copy placement must account for (not removed).
    pub fn placed(&self) -> impl Iterator<Item = &MemberRecord> {
        self.membership
            .members
            .iter()
            .filter(|m| m.state != MemberState::Removed)
    }
}

/// Why `old` became `new`, read from the members' states (the core's swap
/// says only what, not why). A failure outranks a rebuild in the same
/// change: it is what an operator must look at.
pub fn reason_of_change(old: &Membership, new: &Membership) -> EpochReason {
    let moved = |to: MemberState| {
        new.members
            .iter()
            .any(|m| m.state == to && old.state(&m.peer) != Some(to))
    };
    if moved(MemberState::Failed) {
        EpochReason::MemberFailed
    } else if moved(MemberState::Removed) && moved(MemberState::Healthy) {
        EpochReason::MemberReplaced
    } else if moved(MemberState::Removed) {
        EpochReason::MemberRemoved
    } else if moved(MemberState::Syncing) {
        EpochReason::RebuildStarted
    } else if moved(MemberState::Healthy) {
        EpochReason::MemberRebuilt
    } else {
        EpochReason::WriterChanged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cannot_reach_into_other_keys() {
        let k = Keys::new("/ublk/");
        assert_eq!(k.membership("vm1"), "/ublk/volumes/vm1/membership");
        assert_eq!(k.writer("a/../b"), "/ublk/volumes/a%2F..%2Fb/writer");
        assert_eq!(k.peer("mem 1%"), "/ublk/peers/mem%201%25");
        assert!(k.membership("x").starts_with(&k.volumes()));
        assert!(k.peer("x").starts_with(&k.peers()));
    }

    #[test]
    fn peers_are_checked() {
        let p = PeerRecord {
            id: "mem1".into(),
            addr: "10.0.0.5:7070".into(),
            capacity: 1 << 30,
            failure_domain: None,
        };
        assert_eq!(p.validate(), Ok(()));
        assert_eq!(p.domain(), "mem1");
        let bad = PeerRecord {
            addr: "nohost".into(),
            ..p.clone()
        };
        assert_eq!(
            bad.validate().unwrap_err(),
            "peer address \"nohost\": must be HOST:PORT"
        );
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(
            json,
            r#"{"id":"mem1","addr":"10.0.0.5:7070","capacity":1073741824}"#
        );
    }

    #[test]
    fn the_reason_is_read_from_the_states_that_moved() {
        let peers = ["a".to_string(), "b".to_string()];
        let base = Membership::new_volume(&peers).unwrap();
        let with = |f: &dyn Fn(&mut Membership)| {
            let mut m = base.clone();
            m.epoch += 1;
            f(&mut m);
            m
        };
        let of = |m: &Membership| reason_of_change(&base, m);
        let failed = with(&|m| m.members[1].state = MemberState::Failed);
        assert_eq!(of(&failed), EpochReason::MemberFailed);
        let removed = with(&|m| m.members[1].state = MemberState::Removed);
        assert_eq!(of(&removed), EpochReason::MemberRemoved);
        let spare = with(&|m| {
            m.members[1].state = MemberState::Failed;
            m.members.push(MemberRecord {
                peer: "c".into(),
                state: MemberState::Syncing,
            });
        });
        assert_eq!(of(&spare), EpochReason::MemberFailed, "a failure outranks");
        let mut syncing = spare.clone();
        syncing.members[1].state = MemberState::Removed;
        assert_eq!(
            reason_of_change(&spare, &syncing),
            EpochReason::MemberRemoved
        );
        let mut rebuilt = syncing.clone();
        rebuilt.members[2].state = MemberState::Healthy;
        assert_eq!(
            reason_of_change(&syncing, &rebuilt),
            EpochReason::MemberRebuilt
        );
        // A spare joining healthy while the member it replaces is removed.
        let mut replaced = spare.clone();
        replaced.members[1].state = MemberState::Removed;
        replaced.members[2].state = MemberState::Healthy;
        assert_eq!(
            reason_of_change(&spare, &replaced),
            EpochReason::MemberReplaced
        );
        assert_eq!(of(&with(&|_| {})), EpochReason::WriterChanged);
    }
}
