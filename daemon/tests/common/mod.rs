//! Shared fixtures of the daemon's integration tests.
#![allow(dead_code)]

pub mod etcd;
pub mod ublkd;
