//! Fixtures of the integration tests that run the real `arenad` binary
//! ([`arenad`]: it needs `CARGO_BIN_EXE_arenad`, which only integration
//! tests see); the in-process fixtures come from `target_rdma::testing`.

#![allow(dead_code)]

pub mod arenad;
pub mod log_lines;

pub use target_rdma::testing::*;
