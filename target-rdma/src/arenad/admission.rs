//! What a connection must get past before the server spends more than a
//! socket and a small task on it: its place in the connection limits, a
//! handshake place shared between the sources connecting (so no one source
//! can hold them all while others wait), and throttled logs for the
//! resource errors of a flood.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::arenad::served::ServerLimits;
use crate::proto::{self, Opcode, Status};

/// The message of the BUSY frame of a connection refused a handshake place,
/// or displaced from one.
pub(super) const HANDSHAKES_FULL: &str = "too many connections in their handshake";

/// The error frame a connection closed before its handshake gets instead of
/// (or after) its CHALLENGE.
pub(super) fn busy_frame(message: &str) -> Vec<u8> {
    let mut frame = Vec::new();
    proto::encode_error(&mut frame, Opcode::Challenge, 0, Status::Busy, message);
    frame
}

/// The server's connection counters: the connections with a task
/// (authenticated or not), those still in their handshake by source, and
/// the next connection's id.
pub(super) struct Admission {
    open: Arc<AtomicUsize>,
    handshakes: Arc<Mutex<Handshakes>>,
    next_conn: AtomicU64,
}

impl Admission {
    pub(super) fn new() -> Self {
        Self {
            open: Arc::default(),
            handshakes: Arc::default(),
            next_conn: AtomicU64::new(1),
        }
    }

    /// Takes a place among the connections with a task, below `limit`.
    pub(super) fn open(&self, limit: u32) -> Option<Counted> {
        Counted::take(&self.open, limit)
    }

    /// Takes a handshake place for connection `id` from `peer`: one of
    /// `max_unauthenticated`, or, when all are taken and `peer`'s source
    /// holds fewer than the source holding the most (see
    /// [`Handshakes::admit`]), the place of that source's oldest
    /// connection, which is told to close.
    pub(super) fn handshaking(
        &self,
        id: u64,
        peer: IpAddr,
        limits: &ServerLimits,
    ) -> Result<(Handshaking, Option<Displaced>), Refused> {
        let source = Source::of(
            peer,
            limits.handshake_source_prefix_v4,
            limits.handshake_source_prefix_v6,
        );
        let displaced = Arc::new(Notify::new());
        let pending = Pending {
            id,
            displaced: Arc::clone(&displaced),
        };
        let limit = limits.max_unauthenticated as usize;
        let victim = self
            .handshakes
            .lock()
            .admit(limit, source, pending)
            .map_err(|held| Refused { source, held })?;
        // Told outside the lock; a victim task not yet waiting finds the
        // permit when it does.
        let victim = victim.map(|(v, pending)| {
            pending.displaced.notify_one();
            v
        });
        let place = Counted(Place::Handshake {
            handshakes: Arc::clone(&self.handshakes),
            source,
            id,
        });
        Ok((Handshaking { place, displaced }, victim))
    }

    /// The next connection's id.
    pub(super) fn next_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// How many connections have a task now.
    pub(super) fn open_now(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// A connection's handshake place, and the signal that it was displaced
/// from it (its handshake then ends with a BUSY frame).
pub(super) struct Handshaking {
    pub(super) place: Counted,
    pub(super) displaced: Arc<Notify>,
}

/// A connection refused a handshake place: its source and how many places
/// that source holds.
pub(super) struct Refused {
    pub(super) source: Source,
    pub(super) held: usize,
}

/// The connection displaced to make room: its id, its source and how many
/// places that source held.
pub(super) struct Displaced {
    pub(super) id: u64,
    pub(super) source: Source,
    pub(super) held: usize,
}

/// Where connections come from, as the handshake places are shared: the
/// peer's address within its IPv4 or IPv6 prefix (an IPv4-mapped IPv6
/// address counts as IPv4), so one host or one network is one source
/// however many addresses it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Source {
    net: IpAddr,
    prefix: u8,
}

impl Source {
    fn of(ip: IpAddr, prefix_v4: u8, prefix_v6: u8) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(a) => {
                let prefix = prefix_v4.min(32);
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                Self {
                    net: Ipv4Addr::from_bits(a.to_bits() & mask).into(),
                    prefix,
                }
            }
            IpAddr::V6(a) => {
                let prefix = prefix_v6.min(128);
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                Self {
                    net: Ipv6Addr::from_bits(a.to_bits() & mask).into(),
                    prefix,
                }
            }
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.net, self.prefix)
    }
}

/// A connection in its handshake.
struct Pending {
    id: u64,
    displaced: Arc<Notify>,
}

/// The connections in their handshake by source, each source's oldest
/// first (ids grow with time), and the sources ordered by how many places
/// they hold. At most `max_unauthenticated` connections, so at most as
/// many sources; the lock is never held across an await or socket I/O.
#[derive(Default)]
struct Handshakes {
    total: usize,
    sources: HashMap<Source, VecDeque<Pending>>,
    /// (places held, oldest id reversed, source): the last is the source
    /// holding the most, of those the one whose oldest connection is oldest.
    by_load: BTreeSet<(usize, Reverse<u64>, Source)>,
}

impl Handshakes {
    fn load(&self, source: Source) -> Option<(usize, Reverse<u64>, Source)> {
        let q = self.sources.get(&source)?;
        Some((q.len(), Reverse(q.front()?.id), source))
    }

    /// Changes `source`'s queue with `f`, keeping the order and the total.
    fn update<R>(&mut self, source: Source, f: impl FnOnce(&mut VecDeque<Pending>) -> R) -> R {
        if let Some(k) = self.load(source) {
            self.by_load.remove(&k);
        }
        let q = self.sources.entry(source).or_default();
        let before = q.len();
        let r = f(q);
        let after = q.len();
        if after == 0 {
            self.sources.remove(&source);
        }
        self.total = self.total + after - before;
        if let Some(k) = self.load(source) {
            self.by_load.insert(k);
        }
        r
    }

    /// Places `pending` (from `source`) if one of `limit` is free, else in
    /// the place of the oldest connection of the source holding the most,
    /// returned, when `source` holds none or at least two fewer (so the
    /// two would not take places back and forth), else refuses it with how
    /// many `source` holds. Sources that all want more places end up
    /// holding shares within one of each other.
    fn admit(
        &mut self,
        limit: usize,
        source: Source,
        pending: Pending,
    ) -> Result<Option<(Displaced, Pending)>, usize> {
        if self.total < limit {
            self.update(source, |q| q.push_back(pending));
            return Ok(None);
        }
        let held = self.sources.get(&source).map_or(0, VecDeque::len);
        let Some(&(most, _, top)) = self.by_load.last() else {
            return Err(held);
        };
        if held != 0 && held.saturating_add(2) > most {
            return Err(held);
        }
        let Some(victim) = self.update(top, VecDeque::pop_front) else {
            return Err(held);
        };
        self.update(source, |q| q.push_back(pending));
        let displaced = Displaced {
            id: victim.id,
            source: top,
            held: most,
        };
        Ok(Some((displaced, victim)))
    }

    /// Gives back the place of connection `id` of `source`, if it still
    /// holds one (a displaced connection no longer does).
    fn remove(&mut self, source: Source, id: u64) {
        if !self.sources.contains_key(&source) {
            return;
        }
        self.update(source, |q| {
            if let Ok(i) = q.binary_search_by_key(&id, |p| p.id) {
                q.remove(i);
            }
        });
    }
}

/// Holds a connection's place in one of the server's limits while it
/// lives.
pub(super) struct Counted(Place);

enum Place {
    Open(Arc<AtomicUsize>),
    Handshake {
        handshakes: Arc<Mutex<Handshakes>>,
        source: Source,
        id: u64,
    },
}

impl Counted {
    /// Takes a place below `limit`, or `None` when all are taken.
    fn take(count: &Arc<AtomicUsize>, limit: u32) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit as usize).then_some(n + 1)
            })
            .ok()
            .map(|_| Counted(Place::Open(Arc::clone(count))))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        match &self.0 {
            Place::Open(count) => {
                count.fetch_sub(1, Ordering::AcqRel);
            }
            Place::Handshake {
                handshakes,
                source,
                id,
            } => handshakes.lock().remove(*source, *id),
        }
    }
}

/// Logs a recurring resource error at most once per interval, with how many
/// were not logged since.
#[derive(Default)]
pub(super) struct Throttled {
    last: Option<Instant>,
    muted: u64,
}

const LOG_INTERVAL: Duration = Duration::from_secs(10);

impl Throttled {
    pub(super) fn log(&mut self, log: impl FnOnce(u64)) {
        if self.last.is_some_and(|t| t.elapsed() < LOG_INTERVAL) {
            self.muted += 1;
            return;
        }
        self.last = Some(Instant::now());
        log(std::mem::take(&mut self.muted));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(last: u8) -> Source {
        Source::of(IpAddr::from([10, 0, 0, last]), 32, 64)
    }

    fn pending(id: u64) -> Pending {
        Pending {
            id,
            displaced: Arc::new(Notify::new()),
        }
    }

    /// Admits connection `id` from `source`: the id of the connection it
    /// displaced, if any, or the refusal's count.
    fn admit(
        h: &mut Handshakes,
        limit: usize,
        source: Source,
        id: u64,
    ) -> Result<Option<u64>, usize> {
        h.admit(limit, source, pending(id)).map(|v| {
            v.map(|(d, p)| {
                assert_eq!(d.id, p.id);
                d.id
            })
        })
    }

    fn held(h: &Handshakes, source: Source) -> usize {
        h.sources.get(&source).map_or(0, VecDeque::len)
    }

    #[test]
    fn a_full_source_is_refused_and_a_smaller_one_takes_its_oldest_place() {
        let (a, b) = (src(1), src(2));
        let mut h = Handshakes::default();
        for id in 1..=4 {
            assert_eq!(admit(&mut h, 4, a, id), Ok(None));
        }
        assert_eq!(admit(&mut h, 4, a, 5), Err(4));
        // b holds none: a's oldest goes, then the next oldest.
        assert_eq!(admit(&mut h, 4, b, 6), Ok(Some(1)));
        assert_eq!(admit(&mut h, 4, b, 7), Ok(Some(2)));
        // Two each: neither takes from the other.
        assert_eq!(admit(&mut h, 4, b, 8), Err(2));
        assert_eq!(admit(&mut h, 4, a, 9), Err(2));
        assert_eq!((h.total, held(&h, a), held(&h, b)), (4, 2, 2));
        // A displaced connection's end gives back nothing; a live one's
        // does.
        h.remove(a, 1);
        assert_eq!(h.total, 4);
        h.remove(a, 3);
        assert_eq!((h.total, held(&h, a)), (3, 1));
        assert_eq!(admit(&mut h, 4, b, 10), Ok(None));
    }

    #[test]
    fn among_equal_sources_the_oldest_connection_goes() {
        let mut h = Handshakes::default();
        for id in 1..=3 {
            assert_eq!(admit(&mut h, 3, src(id as u8), id), Ok(None));
        }
        // Every source holds one: a new one takes the oldest place, and
        // the source that lost it takes the next oldest when it returns.
        assert_eq!(admit(&mut h, 3, src(4), 4), Ok(Some(1)));
        assert_eq!(admit(&mut h, 3, src(1), 5), Ok(Some(2)));
        assert_eq!(admit(&mut h, 3, src(4), 6), Err(1));
        assert_eq!(h.total, 3);
    }

    #[test]
    fn sources_that_all_want_more_end_within_one_of_each_other() {
        let limit = 64;
        let mut h = Handshakes::default();
        // The first source fills every place, then three others and it
        // keep asking until every one of them is refused.
        let mut id = 0;
        while admit(&mut h, limit, src(1), id).is_ok() {
            id += 1;
        }
        let sources = [src(1), src(2), src(3), src(4)];
        let mut refused_in_a_row = 0;
        while refused_in_a_row < sources.len() {
            assert!(id < 10_000, "places change hands forever");
            let s = sources[id as usize % sources.len()];
            id += 1;
            match admit(&mut h, limit, s, id) {
                Ok(_) => refused_in_a_row = 0,
                Err(_) => refused_in_a_row += 1,
            }
        }
        let counts: Vec<usize> = sources.iter().map(|&s| held(&h, s)).collect();
        assert_eq!(counts.iter().sum::<usize>(), limit);
        assert!(counts.iter().all(|&n| n == 16), "{counts:?}");
        assert_eq!(h.by_load.len(), sources.len());
    }

    #[test]
    fn sources_are_addresses_within_their_prefix() {
        let v4 = |s: &str, p| Source::of(s.parse().unwrap(), p, 64).to_string();
        assert_eq!(v4("10.1.2.3", 32), "10.1.2.3/32");
        assert_eq!(v4("10.1.2.3", 24), "10.1.2.0/24");
        assert_eq!(v4("10.1.2.3", 0), "0.0.0.0/0");
        // An IPv4 client of a dual-stack listener is an IPv4 source.
        assert_eq!(v4("::ffff:10.1.2.3", 24), "10.1.2.0/24");
        let v6 = |s: &str, p| Source::of(s.parse().unwrap(), 32, p).to_string();
        assert_eq!(v6("2001:db8:1:2:3:4:5:6", 64), "2001:db8:1:2::/64");
        assert_eq!(v6("2001:db8:1:2:3:4:5:6", 128), "2001:db8:1:2:3:4:5:6/128");
        assert_eq!(v6("2001:db8::1", 0), "::/0");
        assert_eq!(
            Source::of("10.9.9.9".parse().unwrap(), 8, 64),
            Source::of("10.1.1.1".parse().unwrap(), 8, 64)
        );
    }
}
