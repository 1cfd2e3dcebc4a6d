//! The ublk driver's feature bits and their names, for `ublkctl features`
//! (which asks the driver itself, so it works without ublkd running).

use std::path::Path;

use libublk::sys;

use crate::device::{DeviceError, UBLK_CONTROL};

/// Asks the driver (`/dev/ublk-control`) for its feature mask; returns it
/// with the names of its bits.
pub fn from_driver() -> Result<(u64, Vec<String>), DeviceError> {
    if !Path::new(UBLK_CONTROL).exists() {
        return Err(DeviceError::UblkMissing);
    }
    let mask = libublk::ctrl::UblkCtrl::get_features().ok_or(DeviceError::Ublk {
        what: "GET_FEATURES",
        id: -1,
        detail: "the driver did not answer (kernel older than 6.5?)".into(),
    })?;
    Ok((mask, names(mask)))
}

/// Every `UBLK_F_*` bit this build knows, with its name.
const NAMES: &[(u64, &str)] = &[
    (sys::UBLK_F_SUPPORT_ZERO_COPY as u64, "SUPPORT_ZERO_COPY"),
    (
        sys::UBLK_F_URING_CMD_COMP_IN_TASK as u64,
        "URING_CMD_COMP_IN_TASK",
    ),
    (sys::UBLK_F_NEED_GET_DATA as u64, "NEED_GET_DATA"),
    (sys::UBLK_F_USER_RECOVERY as u64, "USER_RECOVERY"),
    (
        sys::UBLK_F_USER_RECOVERY_REISSUE as u64,
        "USER_RECOVERY_REISSUE",
    ),
    (sys::UBLK_F_UNPRIVILEGED_DEV as u64, "UNPRIVILEGED_DEV"),
    (sys::UBLK_F_CMD_IOCTL_ENCODE as u64, "CMD_IOCTL_ENCODE"),
    (sys::UBLK_F_USER_COPY as u64, "USER_COPY"),
    (sys::UBLK_F_ZONED as u64, "ZONED"),
    (
        sys::UBLK_F_USER_RECOVERY_FAIL_IO as u64,
        "USER_RECOVERY_FAIL_IO",
    ),
    (sys::UBLK_F_UPDATE_SIZE as u64, "UPDATE_SIZE"),
    (sys::UBLK_F_AUTO_BUF_REG as u64, "AUTO_BUF_REG"),
    (sys::UBLK_F_QUIESCE as u64, "QUIESCE"),
    (sys::UBLK_F_PER_IO_DAEMON as u64, "PER_IO_DAEMON"),
    (sys::UBLK_F_BUF_REG_OFF_DAEMON as u64, "BUF_REG_OFF_DAEMON"),
    (sys::UBLK_F_BATCH_IO as u64, "BATCH_IO"),
    (sys::UBLK_F_NO_AUTO_PART_SCAN as u64, "NO_AUTO_PART_SCAN"),
    (sys::UBLK_F_SAFE_STOP_DEV as u64, "SAFE_STOP_DEV"),
    (sys::UBLK_F_INTEGRITY as u64, "INTEGRITY"),
    (sys::UBLK_F_SHMEM_ZC as u64, "SHMEM_ZC"),
];

/// The names of the set bits; unknown bits appear as `BIT_n`.
pub fn names(mask: u64) -> Vec<String> {
    (0..64u32)
        .filter(|b| mask & (1u64 << b) != 0)
        .map(|b| {
            NAMES
                .iter()
                .find(|(v, _)| *v == 1u64 << b)
                .map_or_else(|| format!("BIT_{b}"), |(_, n)| (*n).to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_known_and_unknown_bits() {
        let mask = (libublk::sys::UBLK_F_USER_RECOVERY | libublk::sys::UBLK_F_USER_RECOVERY_REISSUE)
            as u64
            | 1u64 << 63;
        assert_eq!(
            super::names(mask),
            vec!["USER_RECOVERY", "USER_RECOVERY_REISSUE", "BIT_63"]
        );
    }
}
