//! The integration tests' fixtures: all in `target_rdma::testing`
//! (feature `test-utils`), the real `arenad` binary as a child process
//! ([`arenad`]) included.

// Each test binary uses its own part of these.
#![allow(dead_code, unused_imports)]

pub use target_rdma::testing::*;
