//! The observability contract shared by `ublkd` and `arenad`.
