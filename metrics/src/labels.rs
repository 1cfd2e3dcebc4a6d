//! Closed label vocabularies.
//!
//! Every Prometheus label value this crate emits comes from one of these enums
//! or from a target name validated by [`validate_target`], so the number of
//! series is fixed by the code, never by traffic.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A label value that does not fit the bounded vocabulary.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LabelError {
    /// Target names become label values; keeping them short and plain makes
    /// escaping unnecessary and stops a volume name from leaking in.
    #[error("target label {value:?} must be 1-32 characters of [a-z0-9_]")]
    InvalidTarget {
        /// The rejected value.
        value: String,
    },
}

/// Checks a target label (`arena`, `mem`, ...).
pub fn validate_target(value: &str) -> Result<(), LabelError> {
    let ok = !value.is_empty()
        && value.len() <= 32
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(LabelError::InvalidTarget {
            value: value.chars().take(64).collect(),
        })
    }
}

macro_rules! count_variants {
    () => { 0usize };
    ($head:ident $($tail:ident)*) => { 1usize + count_variants!($($tail)*) };
}

macro_rules! closed_enum {
    (
        $(#[$meta:meta])*
        $name:ident { $( $(#[$vmeta:meta])* $variant:ident => $text:literal ),+ $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every value, in declaration order; the index of a value in this
            /// slice is [`Self::index`].
            pub const ALL: [$name; count_variants!($($variant)+)] = [$($name::$variant),+];
            /// Number of values.
            pub const COUNT: usize = count_variants!($($variant)+);

            /// The label value.
            pub const fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            /// Dense index, used to address fixed arrays of handles without
            /// hashing on the hot path.
            pub const fn index(self) -> usize {
                self as usize
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

pub(crate) use closed_enum;
pub(crate) use count_variants;

closed_enum! {
    /// Block operation of a ublk request.
    IoOp {
        /// READ.
        Read => "read",
        /// WRITE.
        Write => "write",
        /// FLUSH.
        Flush => "flush",
        /// DISCARD.
        Discard => "discard",
        /// WRITE_ZEROES.
        WriteZeroes => "write_zeroes",
    }
}

impl IoOp {
    /// Title used in human summaries (`ublkctl stats`).
    pub const fn title(self) -> &'static str {
        match self {
            IoOp::Read => "Read",
            IoOp::Write => "Write",
            IoOp::Flush => "Flush",
            IoOp::Discard => "Discard",
            IoOp::WriteZeroes => "Write zeroes",
        }
    }

    pub(crate) const fn from_index(i: u8) -> IoOp {
        match i {
            0 => IoOp::Read,
            1 => IoOp::Write,
            2 => IoOp::Flush,
            3 => IoOp::Discard,
            _ => IoOp::WriteZeroes,
        }
    }
}

closed_enum! {
    /// Error class of a failed block request, derived from its errno so that
    /// a new errno never creates a new series.
    ErrnoClass {
        /// EIO (5).
        Eio => "eio",
        /// ENOSPC (28): the arena or swap is full.
        Enospc => "enospc",
        /// ETIMEDOUT (110).
        Etimedout => "etimedout",
        /// ENOLINK (67): the peer is gone.
        Enolink => "enolink",
        /// ENOMEM (12).
        Enomem => "enomem",
        /// EINVAL (22): a request the target refused as malformed.
        Einval => "einval",
        /// Anything else.
        Other => "other",
    }
}

impl ErrnoClass {
    /// Classifies a Linux errno; the sign is ignored because ublk completes
    /// requests with negative errno values.
    pub const fn from_errno(errno: i32) -> ErrnoClass {
        match errno.unsigned_abs() {
            5 => ErrnoClass::Eio,
            28 => ErrnoClass::Enospc,
            110 => ErrnoClass::Etimedout,
            67 => ErrnoClass::Enolink,
            12 => ErrnoClass::Enomem,
            22 => ErrnoClass::Einval,
            _ => ErrnoClass::Other,
        }
    }
}

closed_enum! {
    /// Transport that carries (or carried) a request's payload.
    Transport {
        /// One-sided RDMA READ/WRITE into the peer's arena.
        Rdma => "rdma",
        /// Payload inline on the TCP control stream.
        Tcp => "tcp",
        /// Direct calls into a store in the same process (the reference
        /// transport of the conformance suites and benchmarks).
        InProcess => "in_process",
    }
}

impl Transport {
    /// The transports a ublkd serves block requests over. Its accounting
    /// registers their series up front; the in-process one serves only
    /// tests and benchmarks, so a daemon's exposition never carries it.
    pub const SERVED: [Transport; 2] = [Transport::Rdma, Transport::Tcp];
}

closed_enum! {
    /// Terminal state of a logical request or a physical attempt.
    Outcome {
        /// Completed successfully.
        Success => "success",
        /// Completed with an error.
        Failure => "failure",
        /// Abandoned before completing (future dropped, device removed).
        Cancelled => "cancelled",
    }
}

closed_enum! {
    /// Where a request or attempt failed.
    Phase {
        /// Establishing the TCP control connection or RDMA queue pair.
        Connect => "connect",
        /// HELLO / authentication exchange.
        Handshake => "handshake",
        /// Memory registration.
        Register => "register",
        /// Slot or lease allocation (ALLOC / GET).
        Alloc => "alloc",
        /// Posting a work request or writing a frame.
        Post => "post",
        /// Polling the completion queue or reading the response.
        Poll => "poll",
        /// A completion that reported an error.
        Completion => "completion",
        /// COMMIT / RELEASE.
        Commit => "commit",
        /// FLUSH.
        Flush => "flush",
        /// Swap or journal I/O on the peer.
        Swap => "swap",
        /// Tear-down.
        Shutdown => "shutdown",
    }
}

closed_enum! {
    /// Why a request or attempt failed.
    Reason {
        /// A deadline expired.
        Timeout => "timeout",
        /// The peer or transport is not reachable.
        Unavailable => "unavailable",
        /// Out of slots, buffers, leases or space.
        ResourceExhausted => "resource_exhausted",
        /// A malformed or unexpected frame.
        Protocol => "protocol",
        /// An RDMA work completion with a non-success status.
        WcError => "wc_error",
        /// Authentication or authorisation refused.
        Auth => "auth",
        /// A local or remote I/O error.
        Io => "io",
        /// The peer closed the connection.
        PeerClosed => "peer_closed",
        /// The request was cancelled.
        Canceled => "canceled",
        /// A bug or an unexpected state.
        Internal => "internal",
    }
}

macro_rules! failure_causes {
    (
        $(#[$meta:meta])*
        $name:ident { $( $(#[$vmeta:meta])* $variant:ident => ($phase:ident, $reason:ident) ),+ $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every cause, in declaration order; the index of a cause in
            /// this slice is [`Self::index`].
            pub const ALL: [$name; count_variants!($($variant)+)] = [$($name::$variant),+];
            /// Number of causes.
            pub const COUNT: usize = count_variants!($($variant)+);

            /// The `phase` label of the cause.
            pub const fn phase(self) -> Phase {
                match self { $($name::$variant => Phase::$phase),+ }
            }

            /// The `reason` label of the cause.
            pub const fn reason(self) -> Reason {
                match self { $($name::$variant => Reason::$reason),+ }
            }

            /// Dense index into the fixed arrays of failure counters.
            pub const fn index(self) -> usize {
                self as usize
            }
        }
    };
}

failure_causes! {
    /// Where and why a block request (or one of its attempts) failed: the
    /// (`phase`, `reason`) pairs a failure can carry. The failure families
    /// register exactly these pairs, so they render at zero from the start
    /// without the 110 pairs of `Phase` x `Reason` that nothing records;
    /// a failure the taxonomy cannot place needs a row here first. (The
    /// `completion`/`wc_error` pair of an RDMA attempt that failed over is
    /// not a request failure; [`crate::RequestSpan::fail_over`] counts it.)
    FailureCause {
        /// The arena could not be reached, or no member of a replicated
        /// volume could.
        ConnectUnavailable => (Connect, Unavailable),
        /// The peer refused our credentials or could not prove its own.
        HandshakeAuth => (Handshake, Auth),
        /// The peer refused the session at the handshake.
        HandshakeUnavailable => (Handshake, Unavailable),
        /// The peer had no slot, quota or capacity for the request.
        AllocExhausted => (Alloc, ResourceExhausted),
        /// The request itself was malformed (outside the device, or a
        /// descriptor that does not make sense).
        PostProtocol => (Post, Protocol),
        /// No answer in time.
        PollTimeout => (Poll, Timeout),
        /// The connection broke before the answer.
        PollPeerClosed => (Poll, PeerClosed),
        /// The answer broke the protocol.
        PollProtocol => (Poll, Protocol),
        /// A replicated write whose missing member could not be recorded
        /// in time.
        CompletionTimeout => (Completion, Timeout),
        /// The peer answered that we are not allowed (a fenced or standby
        /// writer, or a refused credential).
        CompletionAuth => (Completion, Auth),
        /// The peer answered with a protocol or version error.
        CompletionProtocol => (Completion, Protocol),
        /// The peer answered that it is shutting down.
        CompletionUnavailable => (Completion, Unavailable),
        /// The peer answered a data request with an error.
        CompletionIo => (Completion, Io),
        /// A flush failed, or the peer lost acknowledged, unflushed writes.
        FlushIo => (Flush, Io),
    }
}

/// The `device` label value of device `id`: its kernel name (`ublkb0`), so
/// per-device series join with node_exporter's `node_disk_*{device="ublkb0"}`.
pub fn device_label(id: u32) -> String {
    format!("ublkb{id}")
}

closed_enum! {
    /// Why the metrics HTTP listener ([`crate::http`]) ended a connection or
    /// request without its answer.
    HttpRejection {
        /// No complete request head within `request_timeout` of accept.
        RequestDeadline => "request_deadline",
        /// The oldest connection still without a request head, closed to
        /// make room for a new one at `max_connections`.
        Shed => "shed",
        /// A new connection at `max_connections` when every open one had
        /// already delivered its request (nothing idle to shed).
        Refused => "refused",
        /// A request head larger than `max_request_bytes` (answered 400).
        Oversized => "oversized",
        /// The render queue was full (answered 503).
        Busy => "busy",
        /// The answer was not built and written within `write_timeout`.
        WriteDeadline => "write_deadline",
        /// `accept` failed (EMFILE, ENFILE, ENOMEM); accepting pauses
        /// briefly and resumes.
        AcceptError => "accept_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_classes_ignore_sign() {
        assert_eq!(ErrnoClass::from_errno(-5), ErrnoClass::Eio);
        assert_eq!(ErrnoClass::from_errno(110), ErrnoClass::Etimedout);
        assert_eq!(ErrnoClass::from_errno(i32::MIN), ErrnoClass::Other);
    }

    #[test]
    fn target_labels_are_bounded() {
        assert!(validate_target("arena").is_ok());
        assert!(validate_target("").is_err());
        assert!(validate_target("Arena").is_err());
        assert!(validate_target("a\"b").is_err());
        assert!(validate_target(&"x".repeat(33)).is_err());
    }

    /// Two causes with one (phase, reason) would be one series counted
    /// under two names in the code.
    #[test]
    fn failure_causes_are_distinct_pairs() {
        let pairs: std::collections::BTreeSet<_> = FailureCause::ALL
            .iter()
            .map(|c| (c.phase(), c.reason()))
            .collect();
        assert_eq!(pairs.len(), FailureCause::COUNT);
        for (i, c) in FailureCause::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
        }
    }

    #[test]
    fn indexes_are_dense() {
        for (i, op) in IoOp::ALL.iter().enumerate() {
            assert_eq!(op.index(), i);
            assert_eq!(IoOp::from_index(i as u8), *op);
        }
    }
}
