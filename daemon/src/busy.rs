//! Is a block device in use? `del` refuses a busy device unless forced,
//! because deleting it under a mounted filesystem loses that data.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Why a device counts as busy.
#[derive(Debug, PartialEq, Eq)]
pub enum Busy {
    /// Mounted at this mount point.
    Mounted(String),
    /// Another block device (dm, md, ...) sits on top of it.
    Held(Vec<String>),
    /// Some process holds it open exclusively (a filesystem, a VM, mkfs).
    ExclusivelyOpen,
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Mounted(at) => write!(f, "it is mounted on {at}"),
            Self::Held(by) => write!(f, "it is held by {}", by.join(", ")),
            Self::ExclusivelyOpen => write!(f, "it is open exclusively (mounted or in use)"),
        }
    }
}

/// The mount point of the first mountinfo line for device `major:minor`.
pub fn mounted_at(mountinfo: &str, major: u32, minor: u32) -> Option<String> {
    let want = format!("{major}:{minor}");
    mountinfo.lines().find_map(|l| {
        let mut f = l.split(' ');
        let dev = f.nth(2)?;
        let _root = f.next()?;
        let point = f.next()?;
        (dev == want).then(|| point.replace("\\040", " "))
    })
}

/// Checks `/dev/ublkbN` for mounts, holders and exclusive openers.
pub fn check(id: u32) -> io::Result<Option<Busy>> {
    let node = format!("/dev/ublkb{id}");
    let Ok(meta) = std::fs::metadata(&node) else {
        return Ok(None);
    };
    let rdev = meta.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
        if let Some(at) = mounted_at(&mi, major, minor) {
            return Ok(Some(Busy::Mounted(at)));
        }
    }
    let holders = Path::new("/sys/block").join(format!("ublkb{id}/holders"));
    if let Ok(rd) = std::fs::read_dir(holders) {
        let names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        if !names.is_empty() {
            return Ok(Some(Busy::Held(names)));
        }
    }
    // O_EXCL on a block device fails with EBUSY while anyone (in any mount
    // namespace) has it mounted or open exclusively.
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(&node)
    {
        Ok(_) => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(Some(Busy::ExclusivelyOpen)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_mount_point_of_a_device_number() {
        let mi = "22 1 0:21 / /proc rw,nosuid - proc proc rw\n\
                  40 22 259:3 / /mnt/my\\040data rw,relatime - ext4 /dev/ublkb0 rw\n";
        assert_eq!(mounted_at(mi, 259, 3).as_deref(), Some("/mnt/my data"));
        assert_eq!(mounted_at(mi, 259, 4), None);
        assert_eq!(mounted_at("garbage", 1, 2), None);
    }

    #[test]
    fn a_missing_node_is_not_busy() {
        assert_eq!(check(999_999).unwrap(), None);
    }
}
