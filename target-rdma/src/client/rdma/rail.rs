//! The rail: one QP brought up against the peer on the current control
//! connection (RAIL_CONNECT, by `Rails`), and the decision, per payload,
//! to use it, bring it up again, or send the payload inline on TCP for a
//! counted reason. A failed setup keeps payloads on TCP for
//! [`RAIL_RETRY`] before the next try; a rail belongs to one control
//! connection and is replaced when the connection is.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::completion::CompletionEngine;
use super::stats::TcpReason;
use crate::proto::RailAccept;

/// How long a failed rail setup keeps requests on TCP before the next try.
pub(super) const RAIL_RETRY: Duration = Duration::from_secs(1);

/// One QP brought up against the peer on one control connection.
pub(super) struct Rail {
    pub(super) engine: Arc<CompletionEngine>,
    pub(super) remote: RailAccept,
    /// The control connection it belongs to.
    pub(super) epoch: u64,
}

impl Rail {
    /// Whether payloads may use it: its QP is healthy and it belongs to
    /// control connection `epoch` (the live one).
    pub(super) fn serves(&self, epoch: Option<u64>) -> bool {
        self.engine.broken().is_none() && Some(self.epoch) == epoch
    }
}

impl Drop for Rail {
    fn drop(&mut self) {
        self.engine.shutdown();
    }
}

pub(super) enum RailState {
    Up(Arc<Rail>),
    /// Being (re-)established by one request; others go to TCP meanwhile.
    Connecting,
    /// Down; the next attempt is allowed from this instant.
    Down(Instant),
    /// RDMA will not be used on this transport.
    Off(TcpReason, String),
}

/// What one payload does, by [`RailState::route`].
pub(super) enum Route {
    /// Move it over this rail.
    Use(Arc<Rail>),
    /// Send it inline on TCP.
    Tcp(TcpReason),
    /// Bring a rail up first (the state is `Connecting` now).
    Establish,
}

/// The payload sizes RDMA takes.
#[derive(Clone, Copy)]
pub(super) struct Sizes {
    /// Smaller goes inline: a control round trip costs more than the copy.
    pub(super) min: usize,
    /// Larger goes inline: it does not fit a registered buffer.
    pub(super) max: usize,
}

impl RailState {
    /// The route of a payload of `len` bytes while control connection
    /// `epoch` is live.
    pub(super) fn route(
        &mut self,
        len: usize,
        sizes: Sizes,
        epoch: Option<u64>,
        now: Instant,
    ) -> Route {
        if len < sizes.min {
            return Route::Tcp(TcpReason::BelowThreshold);
        }
        match self {
            RailState::Off(reason, _) => return Route::Tcp(*reason),
            RailState::Up(rail) if rail.serves(epoch) => {
                if len > sizes.max {
                    return Route::Tcp(TcpReason::TooLarge);
                }
                return Route::Use(Arc::clone(rail));
            }
            RailState::Connecting => return Route::Tcp(TcpReason::QpError),
            RailState::Down(at) if now < *at => return Route::Tcp(TcpReason::QpError),
            // Broken, of an old connection, or down long enough: replaced
            // (dropping an old rail tears its QP down).
            _ => *self = RailState::Connecting,
        }
        Route::Establish
    }

    /// A setup that `route` asked for ended: up, or down until `now` plus
    /// [`RAIL_RETRY`]. A transport turned off stays off.
    pub(super) fn settle(&mut self, setup: &Result<Arc<Rail>, String>, now: Instant) {
        match setup {
            Ok(rail) => *self = RailState::Up(Arc::clone(rail)),
            Err(_) if matches!(self, RailState::Off(..)) => {}
            Err(_) => *self = RailState::Down(now + RAIL_RETRY),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::loopback::LoopbackProvider;
    use crate::rdma::{QueuePair, RdmaProvider};

    const SIZES: Sizes = Sizes {
        min: 512,
        max: 4096,
    };

    fn rail(epoch: u64) -> Arc<Rail> {
        let qp: Arc<dyn QueuePair> = LoopbackProvider::new()
            .domain()
            .create_qp(4)
            .unwrap()
            .into();
        let endpoint = qp.endpoint();
        Arc::new(Rail {
            engine: CompletionEngine::new(qp, 4, Duration::from_secs(5), Arc::default()),
            remote: RailAccept {
                endpoint,
                arena_base: 0,
                arena_len: 1 << 20,
                rkey: 1,
            },
            epoch,
        })
    }

    fn tcp(r: Route) -> Option<TcpReason> {
        match r {
            Route::Tcp(reason) => Some(reason),
            _ => None,
        }
    }

    #[test]
    fn a_healthy_rail_of_the_live_connection_carries_what_fits() {
        let now = Instant::now();
        let mut st = RailState::Up(rail(3));
        assert!(matches!(st.route(512, SIZES, Some(3), now), Route::Use(_)));
        assert!(matches!(st.route(4096, SIZES, Some(3), now), Route::Use(_)));
        assert_eq!(
            tcp(st.route(511, SIZES, Some(3), now)),
            Some(TcpReason::BelowThreshold)
        );
        assert_eq!(
            tcp(st.route(4097, SIZES, Some(3), now)),
            Some(TcpReason::TooLarge)
        );
        assert!(matches!(st, RailState::Up(_)), "nothing replaced it");
    }

    #[test]
    fn a_broken_or_stale_rail_is_replaced_by_one_request_while_others_use_tcp() {
        let now = Instant::now();
        let broken = rail(3);
        broken.engine.fail("work completion error");
        for (mut st, epoch) in [
            (RailState::Up(broken), Some(3)),
            (RailState::Up(rail(3)), Some(4)),
            (RailState::Up(rail(3)), None),
        ] {
            assert!(matches!(
                st.route(1024, SIZES, epoch, now),
                Route::Establish
            ));
            assert!(matches!(st, RailState::Connecting));
            assert_eq!(
                tcp(st.route(1024, SIZES, epoch, now)),
                Some(TcpReason::QpError)
            );
        }
    }

    #[test]
    fn a_failed_setup_waits_before_the_next_try_and_off_stays_off() {
        let now = Instant::now();
        let mut st = RailState::Connecting;
        st.settle(&Err("refused".into()), now);
        assert_eq!(
            tcp(st.route(1024, SIZES, Some(1), now)),
            Some(TcpReason::QpError)
        );
        let later = now + RAIL_RETRY;
        assert!(matches!(
            st.route(1024, SIZES, Some(1), later),
            Route::Establish
        ));
        st.settle(&Ok(rail(1)), later);
        assert!(matches!(
            st.route(1024, SIZES, Some(1), later),
            Route::Use(_)
        ));

        let mut off = RailState::Off(TcpReason::Declined, "peer has no device".into());
        assert_eq!(
            tcp(off.route(1024, SIZES, Some(1), now)),
            Some(TcpReason::Declined)
        );
        off.settle(&Err("x".into()), now);
        assert_eq!(
            tcp(off.route(1024, SIZES, Some(1), later)),
            Some(TcpReason::Declined)
        );
        assert_eq!(
            tcp(off.route(100, SIZES, Some(1), now)),
            Some(TcpReason::BelowThreshold),
            "the size rule comes first"
        );
    }
}
