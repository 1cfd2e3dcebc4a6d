//! Shared fixtures of the daemon's integration tests.
#![allow(dead_code)]

// The real `arenad` as a child process: target-rdma's fixture, shared.
#[path = "../../../target-rdma/tests/common/arenad.rs"]
pub mod arenad;
pub mod etcd;
#[path = "../../../target-rdma/tests/common/log_lines.rs"]
pub mod log_lines;
pub mod ublkd;

pub use target_rdma::testing::{secret, secret_file, SECRET_A, SECRET_B};
