//! Block target, paging protocol, transports and the arena peer `arenad`.

pub mod proto;
pub mod store;
