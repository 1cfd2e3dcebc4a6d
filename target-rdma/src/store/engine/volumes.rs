//! A volume as the engine keeps it: its name, quota and blob count, and
//! whether it is served.

pub(super) struct Volume {
    pub(super) name: String,
    pub(super) quota: u64,
    pub(super) blobs: u64,
    /// Configured (served); a volume found only in the persisted index is
    /// kept, unserved, so its blobs survive.
    pub(super) served: bool,
}

/// The volumes' names, in id order (what a checkpoint records).
pub(super) fn names(volumes: &[Volume]) -> Vec<&str> {
    volumes.iter().map(|v| v.name.as_str()).collect()
}
