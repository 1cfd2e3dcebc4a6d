//! Cross-crate end-to-end tests. `tests/vm.rs` drives the real-kernel VM
//! suites (ublk and soft-RoCE) from cargo.
