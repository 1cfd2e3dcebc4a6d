//! What the fuzz targets share. Each target is one line calling
//! `target_rdma::fuzzing`, the entry points the stable corpus replay
//! tests call too.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ublkd::config::UblkdConfig;

const PREFIX: &str = "target-rdma-fuzz-";

/// The directory the file formats are written into, one per fuzzing
/// process (libFuzzer's `-fork` runs many): in memory where `/dev/shm`
/// exists, since every input is written as a file before it is decoded.
/// A process cannot remove its own when libFuzzer ends it, so each new one
/// removes those of processes that are gone.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_owned()
        } else {
            std::env::temp_dir()
        };
        for entry in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let pid = name.to_str().and_then(|n| n.strip_prefix(PREFIX));
            if pid.is_some_and(|pid| !Path::new("/proc").join(pid).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = base.join(format!("{PREFIX}{}", std::process::id()));
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
