//! `ublkd`: serves ublk block devices backed by a remote arena.
