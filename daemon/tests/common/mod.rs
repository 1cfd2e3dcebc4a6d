//! Shared fixtures of the daemon's integration tests.
// Each test binary uses its own part of these.
#![allow(dead_code, unused_imports)]

pub mod etcd;
pub mod ublkd;

// The real `arenad` as a child process, and daemons' JSON log lines:
// target-rdma's fixtures.
pub use target_rdma::testing::{arenad, log_lines};

pub use target_rdma::testing::{secret, secret_file, SECRET_A, SECRET_B};
