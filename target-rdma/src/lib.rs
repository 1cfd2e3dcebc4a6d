//! Block target, paging protocol, transports and the arena peer `arenad`.

pub mod arenad;
pub mod auth;
pub mod blob;
pub mod block;
pub mod client;
pub mod config_file;
pub mod proto;
pub mod rdma;
pub mod sd_notify;
pub mod size;
pub mod store;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
