//! The store's tests, by mechanism; the helpers they share are in
//! `support`.

use super::*;

mod cold_reads;
mod config;
mod damage;
mod eviction;
mod faults;
mod integrity;
mod io;
mod lease;
mod model;
mod recovery;
mod residency;
mod support;
