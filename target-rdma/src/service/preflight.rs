//! The checks a start makes, made without starting: `ublkd --check-config`
//! and `arenad --check` run them so that a check passes exactly when a
//! start would not refuse. What a start refuses is a *problem* (the check
//! exits non-zero); what a start tolerates but an operator should know (a
//! metrics port taken, no ublk driver yet) is a *warning*.

use std::fmt::Write as _;
use std::io;
use std::net::TcpListener;
use std::path::Path;

use rustix::fs::{access, Access};

use super::size::ApproxSize;

/// What the checks found.
#[derive(Debug, Default)]
pub struct Findings {
    /// Checks that passed, one line each.
    pub passed: Vec<String>,
    /// What a start would refuse.
    pub problems: Vec<String>,
    /// What a start tolerates.
    pub warnings: Vec<String>,
}

impl Findings {
    /// A check passed.
    pub fn ok(&mut self, line: impl Into<String>) {
        self.passed.push(line.into());
    }

    /// A start would refuse this.
    pub fn problem(&mut self, line: impl Into<String>) {
        self.problems.push(line.into());
    }

    /// A start would go on, but this is wrong.
    pub fn warn(&mut self, line: impl Into<String>) {
        self.warnings.push(line.into());
    }

    /// Records `result` as passed or as a problem.
    pub fn check(&mut self, result: Result<String, String>) {
        match result {
            Ok(l) => self.ok(l),
            Err(l) => self.problem(l),
        }
    }

    /// The report: one line per check (`ok`, `warning`, `problem`) and a
    /// verdict naming `config`.
    pub fn report(&self, config: &Path) -> String {
        let mut out = String::new();
        for l in &self.passed {
            let _ = writeln!(out, "ok: {l}");
        }
        for l in &self.warnings {
            let _ = writeln!(out, "warning: {l}");
        }
        for l in &self.problems {
            let _ = writeln!(out, "problem: {l}");
        }
        let _ = match (self.problems.len(), self.warnings.len()) {
            (0, 0) => writeln!(out, "{}: ok", config.display()),
            (0, w) => writeln!(out, "{}: ok, {w} warning(s)", config.display()),
            (p, _) => writeln!(
                out,
                "{}: {p} problem(s): a start would refuse this configuration",
                config.display()
            ),
        };
        out
    }
}

/// Prints the effective configuration `cfg` (read from `path`) and what
/// the checks found; returns the exit status a check ends with (1 when a
/// start would refuse).
pub fn print_check<T: serde::Serialize>(cfg: &T, path: &Path, findings: &Findings) -> u8 {
    print!(
        "# effective configuration of {}\n{}",
        path.display(),
        super::config_file::render(cfg)
    );
    print!("{}", findings.report(path));
    u8::from(!findings.problems.is_empty())
}

/// The directory itself when it exists, else its nearest existing
/// ancestor (which the start would create it in).
fn existing(dir: &Path) -> Option<&Path> {
    dir.ancestors().find(|p| p.exists())
}

/// Whether the daemon could create (or use) directory `dir` as `key`:
/// the nearest existing ancestor must be a directory, on a filesystem
/// that stores files and is writable, and writable by this user.
pub fn dir_usable(key: &str, dir: &Path) -> Result<String, String> {
    if dir.exists() && !dir.is_dir() {
        return Err(format!("{key} {}: not a directory", dir.display()));
    }
    let Some(base) = existing(dir) else {
        return Err(format!("{key} {}: no existing parent", dir.display()));
    };
    if !base.is_dir() {
        return Err(format!(
            "{key} {}: {} is not a directory",
            dir.display(),
            base.display()
        ));
    }
    match rustix::fs::statvfs(base) {
        Ok(st) if st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY) => {
            return Err(format!(
                "{key} {}: {} is on a read-only filesystem",
                dir.display(),
                base.display()
            ))
        }
        Ok(st) if st.f_blocks == 0 => {
            return Err(format!(
                "{key} {}: {} is on a filesystem that stores no files (such as /proc or /sys)",
                dir.display(),
                base.display()
            ))
        }
        Ok(_) => {}
        Err(e) => {
            return Err(format!(
                "{key} {}: {}: {}",
                dir.display(),
                base.display(),
                io::Error::from(e)
            ))
        }
    }
    if let Err(e) = access(base, Access::WRITE_OK | Access::EXEC_OK) {
        return Err(format!(
            "{key} {}: {} is not writable: {}",
            dir.display(),
            base.display(),
            io::Error::from(e)
        ));
    }
    Ok(if base == dir {
        format!("{key} {} is writable", dir.display())
    } else {
        format!(
            "{key} {} can be created in {}",
            dir.display(),
            base.display()
        )
    })
}

/// The host's memory as the kernel's overcommit policy counts it
/// (`/proc/meminfo`, `vm.overcommit_memory`).
#[derive(Clone, Copy, Debug)]
pub struct Memory {
    pub total: u64,
    pub swap: u64,
    pub available: u64,
    pub commit_limit: u64,
    pub committed: u64,
    /// `vm.overcommit_memory`: 0 heuristic, 1 always, 2 strict.
    pub overcommit: u8,
}

impl Memory {
    /// This host's.
    pub fn of_host() -> io::Result<Memory> {
        let info = std::fs::read_to_string("/proc/meminfo")?;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok())
                .map(|kib| kib.saturating_mul(1024))
                .ok_or_else(|| io::Error::other(format!("/proc/meminfo has no {name}")))
        };
        let overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")?
            .trim()
            .parse()
            .map_err(|_| io::Error::other("vm.overcommit_memory is not a number"))?;
        Ok(Memory {
            total: field("MemTotal")?,
            swap: field("SwapTotal")?,
            available: field("MemAvailable")?,
            commit_limit: field("CommitLimit")?,
            committed: field("Committed_AS")?,
            overcommit,
        })
    }
}

/// Whether an anonymous mapping of `bytes` (an arena, as `key`) can be made
/// under `m`'s overcommit policy (a problem when the start's mmap would
/// fail), and whether the host has the RAM to fill it (a warning).
pub fn mapping_fits(f: &mut Findings, key: &str, bytes: u64, m: &Memory) {
    let size = ApproxSize(bytes);
    let refused = match m.overcommit {
        // The heuristic refuses one mapping larger than RAM and swap.
        0 => (bytes > m.total.saturating_add(m.swap)).then(|| {
            format!(
                "{key} {size} is more than the host's RAM and swap ({}): mapping it fails \
                 (vm.overcommit_memory = 0)",
                ApproxSize(m.total.saturating_add(m.swap))
            )
        }),
        2 => (bytes > m.commit_limit.saturating_sub(m.committed)).then(|| {
            format!(
                "{key} {size} is more than the memory left to commit ({} of CommitLimit {}): \
                 mapping it fails (vm.overcommit_memory = 2)",
                ApproxSize(m.commit_limit.saturating_sub(m.committed)),
                ApproxSize(m.commit_limit)
            )
        }),
        _ => None,
    };
    match refused {
        Some(why) => f.problem(why),
        None if bytes > m.available => f.warn(format!(
            "{key} {size} is more than the host's available memory ({}): the arena fills as \
             blobs are written, and the host swaps or kills processes before it is full",
            ApproxSize(m.available)
        )),
        None => f.ok(format!(
            "{key} {size} fits the host's available memory ({})",
            ApproxSize(m.available)
        )),
    }
}

/// Whether this process may lock `bytes` of memory (RDMA registration
/// pins what it registers): CAP_IPC_LOCK, or RLIMIT_MEMLOCK at least
/// `bytes`. `None` when it may, else the shortfall.
pub fn lockable(bytes: u64) -> Option<String> {
    const CAP_IPC_LOCK: u32 = 14;
    let cap = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|eff| eff & (1 << CAP_IPC_LOCK) != 0);
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
    match (cap, limit) {
        (true, _) | (_, None) => None,
        (false, Some(l)) if l >= bytes => None,
        (false, Some(l)) => Some(format!(
            "RLIMIT_MEMLOCK is {} and the process lacks CAP_IPC_LOCK (the unit sets \
             LimitMEMLOCK=infinity; run the check as the service runs)",
            ApproxSize(l)
        )),
    }
}

/// Free bytes (for unprivileged users) on the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    let base = existing(dir).unwrap_or(Path::new("/"));
    let st = rustix::fs::statvfs(base)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Whether `dir` has room for `files` (name, full size): the sizes minus
/// what those files already hold on disk.
pub fn room_for(key: &str, dir: &Path, files: &[(&str, u64)]) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt;
    let total: u64 = files.iter().map(|(_, n)| n).sum();
    let held: u64 = files
        .iter()
        .filter_map(|(name, _)| std::fs::metadata(dir.join(name)).ok())
        .map(|m| m.blocks().saturating_mul(512))
        .sum();
    let need = total.saturating_sub(held);
    let free = free_bytes(dir).map_err(|e| format!("{key} {}: {e}", dir.display()))?;
    if free < need {
        return Err(format!(
            "{key} {}: needs {} more for its files ({} in all), the filesystem has {} free",
            dir.display(),
            ApproxSize(need),
            ApproxSize(total),
            ApproxSize(free)
        ));
    }
    Ok(format!(
        "{key} {} has room for its files ({} in all, {} more needed, {} free)",
        dir.display(),
        ApproxSize(total),
        ApproxSize(need),
        ApproxSize(free)
    ))
}

/// Whether `addr` (`IP:port`) can be bound now, as `key`.
pub fn bindable(key: &str, addr: &str) -> Result<String, String> {
    match TcpListener::bind(addr) {
        Ok(l) => {
            drop(l);
            Ok(format!("{key} {addr} can be bound"))
        }
        Err(e) => Err(format!("{key} {addr} cannot be bound: {e}")),
    }
}

/// Whether another process holds the `flock` of `path` (a running daemon
/// on the same directory). A missing file is not held.
pub fn lock_held(path: &Path) -> io::Result<bool> {
    use rustix::fs::{flock, FlockOperation};
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    match flock(&file, FlockOperation::NonBlockingLockShared) {
        Ok(()) => Ok(false),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_ports_and_room_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        assert!(dir_usable("swap_dir", dir.path())
            .unwrap()
            .ends_with("is writable"));
        let sub = dir.path().join("a/b");
        assert!(dir_usable("swap_dir", &sub)
            .unwrap()
            .contains("can be created in"));
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(dir_usable("state_dir", &file)
            .unwrap_err()
            .ends_with("not a directory"));

        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let e = bindable("listen", &addr).unwrap_err();
        assert!(
            e.starts_with(&format!("listen {addr} cannot be bound: ")),
            "{e}"
        );
        drop(taken);
        assert!(bindable("listen", &addr).is_ok());

        let e = room_for("swap_dir", dir.path(), &[("swap.dat", u64::MAX / 2)]).unwrap_err();
        assert!(e.contains("needs") && e.contains("free"), "{e}");
        assert!(room_for("swap_dir", dir.path(), &[("swap.dat", 4096)]).is_ok());
    }

    #[test]
    fn a_held_lock_is_seen() {
        use rustix::fs::{flock, FlockOperation};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock");
        assert!(!lock_held(&path).unwrap());
        let f = std::fs::File::create(&path).unwrap();
        assert!(!lock_held(&path).unwrap());
        flock(&f, FlockOperation::LockExclusive).unwrap();
        assert!(lock_held(&path).unwrap());
    }
}
