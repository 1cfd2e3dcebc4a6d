//! What the fuzz targets share. Each target is one line calling
//! `target_rdma::fuzzing`, the entry points the stable corpus replay
//! tests call too.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ublkd::config::UblkdConfig;

/// The directory the file formats are written into, one per fuzzing
/// process and kept for its life: in memory where `/dev/shm` exists, since
/// every input is written as a file before it is decoded.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_owned()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("target-rdma-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("scratch directory {}: {e}", dir.display()));
        dir
    })
}

/// `ublkd.toml` as ublkd reads it (its `parse` validates too).
pub fn check_ublkd_config(data: &[u8]) {
    target_rdma::fuzzing::check_config(data, |text| {
        UblkdConfig::parse(text, Path::new("ublkd.toml"))
    });
}
