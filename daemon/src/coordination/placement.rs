//! Placement: which registered peers hold a volume's replicas. Pure
//! functions over the pool and what is already placed on it, so the rule
//! is tested without etcd: every replica on a distinct peer *and* in a
//! distinct failure domain (a peer without one is a domain of its own),
//! only peers with room for the whole volume, and among those the ones
//! with the most free bytes first (ties by id, so the choice is
//! deterministic). A pool that cannot satisfy the rule is an error naming
//! what is missing, never a silent doubling-up in one domain.

use std::collections::{BTreeMap, BTreeSet};

use super::records::{MembershipRecord, PeerRecord};

/// Bytes already placed on each peer id: the sum of the sizes of the
/// volumes whose membership lists it (removed members excluded).
pub fn used_bytes<'a>(
    memberships: impl IntoIterator<Item = &'a MembershipRecord>,
) -> BTreeMap<String, u64> {
    let mut used = BTreeMap::new();
    for m in memberships {
        for member in m.placed() {
            *used.entry(member.peer.clone()).or_insert(0u64) += m.size;
        }
    }
    used
}

/// Chooses `n` peers for a volume of `size` bytes. `avoid_peers` are never
/// chosen (the volume's current members, for a spare) and
/// `avoid_domains` are domains already holding a replica.
pub fn choose(
    pool: &[PeerRecord],
    used: &BTreeMap<String, u64>,
    size: u64,
    n: usize,
    avoid_peers: &BTreeSet<String>,
    avoid_domains: &BTreeSet<String>,
) -> Result<Vec<PeerRecord>, String> {
    let free = |p: &PeerRecord| {
        p.capacity
            .saturating_sub(used.get(&p.id).copied().unwrap_or(0))
    };
    let mut candidates: Vec<&PeerRecord> = pool
        .iter()
        .filter(|p| !avoid_peers.contains(&p.id) && free(p) >= size)
        .collect();
    candidates.sort_by(|a, b| free(b).cmp(&free(a)).then_with(|| a.id.cmp(&b.id)));
    let mut domains = avoid_domains.clone();
    let mut chosen = Vec::with_capacity(n);
    for p in candidates {
        if chosen.len() == n {
            break;
        }
        if domains.insert(p.domain().to_owned()) {
            chosen.push(p.clone());
        }
    }
    if chosen.len() == n {
        return Ok(chosen);
    }
    let with_room = pool
        .iter()
        .filter(|p| !avoid_peers.contains(&p.id) && free(p) >= size)
        .count();
    Err(format!(
        "placement needs {n} peer(s) in distinct failure domains with {size} bytes free; \
         the pool of {} peer(s) has {with_room} with room, in {} usable domain(s) \
         (register more with `ublkctl peer add`, or name peers with --peer)",
        pool.len(),
        chosen.len()
    ))
}

#[cfg(test)]
mod tests {
    use target_rdma::replica::MemberState;

    use super::*;

    fn peer(id: &str, cap: u64, domain: Option<&str>) -> PeerRecord {
        PeerRecord {
            id: id.into(),
            addr: format!("{id}:7070"),
            capacity: cap,
            failure_domain: domain.map(Into::into),
        }
    }

    fn ids(v: &[PeerRecord]) -> Vec<&str> {
        v.iter().map(|p| p.id.as_str()).collect()
    }

    const G: u64 = 1 << 30;

    #[test]
    fn replicas_spread_over_domains_before_free_space() {
        let pool = [
            peer("a1", 100 * G, Some("rack-a")),
            peer("a2", 90 * G, Some("rack-a")),
            peer("b1", 10 * G, Some("rack-b")),
            peer("c1", 50 * G, Some("rack-c")),
        ];
        let none = BTreeSet::new();
        let got = choose(&pool, &BTreeMap::new(), G, 3, &none, &none).unwrap();
        assert_eq!(ids(&got), ["a1", "c1", "b1"]);
        // Two racks only for three replicas: refused, not doubled up.
        let e = choose(&pool[..3], &BTreeMap::new(), G, 3, &none, &none).unwrap_err();
        assert!(e.contains("has 3 with room, in 2 usable domain(s)"), "{e}");
    }

    #[test]
    fn only_peers_with_room_are_chosen_and_usage_counts() {
        let pool = [
            peer("m1", 10 * G, None),
            peer("m2", 10 * G, None),
            peer("m3", 4 * G, None),
        ];
        let vol = |size, peer: &str| MembershipRecord::created(&[peer.into()], size).unwrap();
        let mut removed = vol(100 * G, "m2");
        removed.membership.members[0].state = MemberState::Removed;
        let placed = [vol(8 * G, "m1"), removed];
        let used = used_bytes(&placed);
        assert_eq!(used.get("m1"), Some(&(8 * G)));
        assert_eq!(used.get("m2"), None, "removed members hold nothing");
        let none = BTreeSet::new();
        let got = choose(&pool, &used, 3 * G, 2, &none, &none).unwrap();
        assert_eq!(ids(&got), ["m2", "m3"]);
        assert!(choose(&pool, &used, 5 * G, 2, &none, &none).is_err());
    }

    #[test]
    fn a_spare_avoids_the_members_and_their_domains() {
        let pool = [
            peer("a1", 10 * G, Some("a")),
            peer("a2", 10 * G, Some("a")),
            peer("b1", 5 * G, Some("b")),
        ];
        let members: BTreeSet<String> = ["a1".to_string()].into();
        let domains: BTreeSet<String> = ["a".to_string()].into();
        let got = choose(&pool, &BTreeMap::new(), G, 1, &members, &domains).unwrap();
        assert_eq!(ids(&got), ["b1"]);
    }
}
