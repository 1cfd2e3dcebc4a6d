//! The conformance suites, as functions over any backend, so that every
//! backend runs the same cases: the fakes and references in this crate's
//! tests, the production sessions and a ublkd queue's way to its volume in
//! the daemon's.
//!
//! - [`blob`]: every [`BlobIo`](crate::blob::BlobIo) (transport, session,
//!   replicated volume) behaves the same, failures included.
//! - [`target`]: every [`BlockTarget`](crate::block::BlockTarget) matches
//!   the in-memory reference byte for byte and names the path that carried
//!   each request.
//!
//! A test crate lists its backends with [`blob_conformance!`] or
//! [`target_conformance!`](crate::target_conformance): one function per
//! backend, returning a [`Fixture`], becomes one test module running every
//! case. A backend sized by the suite's constants (`blob::BLOB`,
//! `blob::QUOTA`, [`blob::peer_opts`], ...) passes every case.
//!
//! [`blob_conformance!`]: crate::blob_conformance

pub mod blob;
pub mod target;

use std::any::Any;
use std::path::Path;

use crate::store::{StoreConfig, VolumeSpec, DEFAULT_SWAP_READS_IN_FLIGHT};

/// A backend under test, plus whatever must outlive it (its peers, their
/// directories), which is dropped after it.
pub struct Fixture<T> {
    /// What the cases run on.
    pub backend: T,
    keep: Vec<Box<dyn Any>>,
}

impl<T> Fixture<T> {
    /// A backend that needs nothing else alive.
    pub fn new(backend: T) -> Self {
        Self {
            backend,
            keep: Vec::new(),
        }
    }

    /// The same fixture over `wrap(backend)` (a session over a transport,
    /// a target over a session).
    pub fn map<U>(self, wrap: impl FnOnce(T) -> U) -> Fixture<U> {
        Fixture {
            backend: wrap(self.backend),
            keep: self.keep,
        }
    }

    /// Keeps `thing` alive until after the backend is dropped.
    pub fn keep(mut self, thing: impl Any) -> Self {
        self.keep.push(Box::new(thing));
        self
    }
}

/// One test module per backend running every case of the
/// [`blob`](crate::testing::conformance::blob) suite: `name => transport`,
/// where `name()` returns a [`Fixture`] of a `BlobIo` whose
/// [`transport`](crate::blob::BlobIo::transport) is `transport`. Attributes
/// before a name (`#[ignore = ".."]`) apply to each of its tests.
#[macro_export]
macro_rules! blob_conformance {
    ($($(#[$attr:meta])* $fixture:ident => $kind:expr),* $(,)?) => {$(
        mod $fixture {
            // `$kind` is written in the caller's scope.
            #[allow(unused_imports)]
            use super::*;
            use $crate::testing::conformance::blob as suite;
            $(#[$attr])* #[test] fn transport() {
                assert_eq!($crate::blob::BlobIo::transport(&super::$fixture().backend), $kind)
            }
            $(#[$attr])* #[test] fn unwritten_blobs_read_as_zeros() {
                suite::unwritten_blobs_read_as_zeros(&super::$fixture().backend)
            }
            $(#[$attr])* #[test] fn partial_writes_keep_the_rest_of_the_blob() {
                suite::partial_writes_keep_the_rest_of_the_blob(&super::$fixture().backend)
            }
            $(#[$attr])* #[test] fn whole_blobs_round_trip_beyond_the_arena() {
                suite::whole_blobs_round_trip_beyond_the_arena(&super::$fixture().backend)
            }
            $(#[$attr])* #[test] fn remove_drops_exactly_the_range() {
                suite::remove_drops_exactly_the_range(&super::$fixture().backend)
            }
            $(#[$attr])* #[test] fn ranges_past_the_blob_end_are_refused() {
                suite::ranges_past_the_blob_end_are_refused(&super::$fixture().backend)
            }
            $(#[$attr])* #[test] fn a_volume_at_its_quota_refuses_new_blobs_but_not_old_ones() {
                suite::a_volume_at_its_quota_refuses_new_blobs_but_not_old_ones(
                    &super::$fixture().backend,
                )
            }
            $(#[$attr])* #[test] fn concurrent_writes_to_many_keys() {
                suite::concurrent_writes_to_many_keys(&super::$fixture().backend)
            }
        }
    )*};
}

/// One test module per backend running every case of the
/// [`target`](crate::testing::conformance::target) suite: `name()` returns
/// a [`Fixture`] of a `BlockTarget` of
/// [`target::SIZE`](crate::testing::conformance::target::SIZE) bytes over
/// blobs of [`target::BLOB`](crate::testing::conformance::target::BLOB)
/// bytes. With `reference: cases` after a name, its module also runs that
/// many random operation sequences against the reference.
#[macro_export]
macro_rules! target_conformance {
    ($($fixture:ident $(reference: $cases:expr)?),* $(,)?) => {$(
        mod $fixture {
            use $crate::testing::conformance::target as suite;
            #[test] fn fresh_device_reads_zeros() {
                suite::fresh_device_reads_zeros(&super::$fixture().backend)
            }
            #[test] fn writes_spanning_blobs_read_back() {
                suite::writes_spanning_blobs_read_back(&super::$fixture().backend)
            }
            #[test] fn fua_and_flush_succeed() {
                suite::fua_and_flush_succeed(&super::$fixture().backend)
            }
            #[test] fn discard_and_write_zeroes_read_back_zeros() {
                suite::discard_and_write_zeroes_read_back_zeros(&super::$fixture().backend)
            }
            #[test] fn every_success_names_the_path_that_carried_it() {
                suite::every_success_names_the_path_that_carried_it(&super::$fixture().backend)
            }
            #[test] fn out_of_range_is_eio_not_a_hang() {
                suite::out_of_range_is_eio_not_a_hang(&super::$fixture().backend)
            }
            $(
                /// Random unaligned operations (an 8-slot arena under a
                /// 64-blob device, so eviction runs constantly) match the
                /// reference.
                #[test] fn random_operations_match_the_reference() {
                    suite::random_operations_match_the_reference(super::$fixture, $cases)
                }
            )?
        }
    )*};
}

/// A store in `dir` for a suite: its one volume "a" with `quota_blobs`
/// blobs of `blob_bytes`, an arena of `arena_bytes`, 64 MiB of swap.
fn store_of_volume_a(
    dir: &Path,
    blob_bytes: u32,
    arena_bytes: u64,
    quota_blobs: u64,
) -> (StoreConfig, Vec<VolumeSpec>) {
    (
        StoreConfig {
            dir: dir.to_owned(),
            arena_bytes,
            blob_bytes,
            swap_bytes: 64 << 20,
            swap_reads_in_flight: DEFAULT_SWAP_READS_IN_FLIGHT,
        },
        vec![VolumeSpec {
            name: "a".into(),
            quota_blobs,
        }],
    )
}
