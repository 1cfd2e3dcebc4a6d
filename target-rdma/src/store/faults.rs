//! A [`Disk`] that fails on cue, and loses what a real disk would lose.
//!
//! Calls are counted per file role and operation; a rule turns the Nth
//! matching call (or every call from the Nth) into a fault. The disk also
//! keeps, for every 4 KiB page written since it was last durable, what the
//! page held when it was: a successful sync makes the pages it covered
//! durable, a failed one loses them (their durable content stays what it
//! was, whatever later syncs say, as a kernel that drops the dirty pages of
//! a failed writeback does), and [`FaultyDisk::crash`] puts every page that
//! is not durable back to its durable content. A rename is taken as
//! durable at once.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::disk::{Disk, OsDisk, Role, Transfer};

const PAGE: u64 = 4096;

/// What a call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Op {
    Open,
    Read,
    /// A positioned write, or a write queued on the swap's ring.
    Write,
    Sync,
    Allocate,
    Rename,
}

/// How a call fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// With this errno, having done nothing.
    Errno(i32),
    /// A write stores the first half of its bytes and then reports ENOSPC
    /// (a ring write reports the half as its byte count): the disk filled
    /// up under it. Any other call fails with ENOSPC.
    Short,
    /// A write stores the first half of its bytes and then fails with
    /// EIO. Any other call fails with EIO.
    Torn,
}

/// Every fault the sweeps inject, by the operation it is put on.
pub(crate) const EVERY_FAULT: &[(Op, &[Fault])] = &[
    (Op::Open, &[Fault::Errno(libc::EIO)]),
    (Op::Read, &[Fault::Errno(libc::EIO)]),
    (
        Op::Write,
        &[
            Fault::Errno(libc::EIO),
            Fault::Errno(libc::ENOSPC),
            Fault::Short,
            Fault::Torn,
        ],
    ),
    (Op::Sync, &[Fault::Errno(libc::EIO)]),
    (Op::Allocate, &[Fault::Errno(libc::ENOSPC)]),
    (Op::Rename, &[Fault::Errno(libc::EIO)]),
];

#[derive(Clone, Copy, Debug)]
struct Rule {
    role: Role,
    op: Op,
    /// The first matching call it applies to (from 1).
    nth: u64,
    /// Every matching call from `nth` on, not only that one.
    sticky: bool,
    fault: Fault,
}

/// A file's pages since they were last durable.
#[derive(Debug)]
struct Tracked {
    path: PathBuf,
    /// A handle of the disk's own (buffered) to read and restore pages.
    shadow: File,
    /// The durable content of every page written since it was durable.
    saved: BTreeMap<u64, Vec<u8>>,
    /// Pages written since the last sync.
    dirty: BTreeSet<u64>,
}

#[derive(Debug, Default)]
struct State {
    rules: Vec<Rule>,
    calls: BTreeMap<(Role, Op), u64>,
    files: BTreeMap<Role, Tracked>,
    /// After a crash every call fails.
    crashed: bool,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct FaultyDisk {
    os: OsDisk,
    state: Mutex<State>,
}

impl FaultyDisk {
    /// Fails the `nth` (from 1) `op` call on the `role` file with `fault`.
    pub(crate) fn fail_once(&self, role: Role, op: Op, nth: u64, fault: Fault) {
        self.state.lock().rules.push(Rule {
            role,
            op,
            nth,
            sticky: false,
            fault,
        });
    }

    /// Fails every `op` call on the `role` file from the `nth` on.
    pub(crate) fn fail_from(&self, role: Role, op: Op, nth: u64, fault: Fault) {
        self.state.lock().rules.push(Rule {
            role,
            op,
            nth,
            sticky: true,
            fault,
        });
    }

    /// How many `op` calls the `role` file has had.
    pub(crate) fn calls(&self, role: Role, op: Op) -> u64 {
        self.state
            .lock()
            .calls
            .get(&(role, op))
            .copied()
            .unwrap_or(0)
    }

    /// A power cut: every page not durable goes back to its durable
    /// content, and every later call fails with EIO (the store still open
    /// writes nothing more).
    pub(crate) fn crash(&self) -> io::Result<()> {
        let mut st = self.state.lock();
        st.crashed = true;
        for t in st.files.values_mut() {
            for (&page, bytes) in &t.saved {
                t.shadow.write_all_at(bytes, page * PAGE)?;
            }
            t.saved.clear();
            t.dirty.clear();
            t.shadow.sync_all()?;
        }
        Ok(())
    }

    /// Counts a call and returns the fault it is due, if any.
    fn due(&self, role: Role, op: Op) -> Option<Fault> {
        let mut st = self.state.lock();
        if st.crashed {
            return Some(Fault::Errno(libc::EIO));
        }
        let n = st.calls.entry((role, op)).or_insert(0);
        *n += 1;
        let n = *n;
        st.rules
            .iter()
            .find(|r| r.role == role && r.op == op && (n == r.nth || (r.sticky && n > r.nth)))
            .map(|r| r.fault)
    }

    /// Saves the durable content of the pages `offset..offset + len` of
    /// the `role` file that do not have it saved yet, and marks them dirty.
    fn touch(&self, role: Role, offset: u64, len: u64) -> io::Result<()> {
        let mut st = self.state.lock();
        let Some(t) = st.files.get_mut(&role) else {
            return Ok(());
        };
        if len == 0 {
            return Ok(());
        }
        for page in offset / PAGE..=(offset + len - 1) / PAGE {
            if !t.saved.contains_key(&page) {
                let mut bytes = vec![0u8; PAGE as usize];
                let mut got = 0;
                while got < bytes.len() {
                    match t
                        .shadow
                        .read_at(&mut bytes[got..], page * PAGE + got as u64)?
                    {
                        0 => break,
                        n => got += n,
                    }
                }
                t.saved.insert(page, bytes);
            }
            t.dirty.insert(page);
        }
        Ok(())
    }

    /// The first half of `data` written at `offset` (through the disk's
    /// own handle).
    fn write_half(&self, role: Role, data: &[u8], offset: u64) -> io::Result<usize> {
        let half = data.len() / 2;
        let st = self.state.lock();
        if let Some(t) = st.files.get(&role) {
            t.shadow.write_all_at(&data[..half], offset)?;
        }
        Ok(half)
    }
}

fn errno(fault: Fault) -> io::Error {
    io::Error::from_raw_os_error(match fault {
        Fault::Errno(e) => e,
        Fault::Short => libc::ENOSPC,
        Fault::Torn => libc::EIO,
    })
}

impl Disk for FaultyDisk {
    fn open(&self, role: Role, path: &Path, options: &OpenOptions) -> io::Result<File> {
        if let Some(f) = self.due(role, Op::Open) {
            return Err(errno(f));
        }
        let file = self.os.open(role, path, options)?;
        let mut st = self.state.lock();
        let known = st.files.get(&role).is_some_and(|t| t.path == path);
        if !known {
            if let Ok(shadow) = OpenOptions::new().read(true).write(true).open(path) {
                st.files.insert(
                    role,
                    Tracked {
                        path: path.to_path_buf(),
                        shadow,
                        saved: BTreeMap::new(),
                        dirty: BTreeSet::new(),
                    },
                );
            }
        }
        Ok(file)
    }

    fn read_at(&self, role: Role, file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if let Some(f) = self.due(role, Op::Read) {
            return Err(errno(f));
        }
        self.os.read_at(role, file, buf, offset)
    }

    fn write_at(&self, role: Role, file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        let fault = self.due(role, Op::Write);
        self.touch(role, offset, buf.len() as u64)?;
        match fault {
            None => self.os.write_at(role, file, buf, offset),
            Some(f @ (Fault::Short | Fault::Torn)) => {
                self.write_half(role, buf, offset)?;
                Err(errno(f))
            }
            Some(f) => Err(errno(f)),
        }
    }

    fn sync(&self, role: Role, file: &File, metadata: bool) -> io::Result<()> {
        let fault = self.due(role, Op::Sync);
        let mut st = self.state.lock();
        let t = st.files.get_mut(&role);
        match fault {
            Some(f) => {
                // Lost: the dirty pages keep their saved durable content.
                if let Some(t) = t {
                    t.dirty.clear();
                }
                Err(errno(f))
            }
            None => {
                self.os.sync(role, file, metadata)?;
                if let Some(t) = t {
                    for page in std::mem::take(&mut t.dirty) {
                        t.saved.remove(&page);
                    }
                }
                Ok(())
            }
        }
    }

    fn allocate(&self, role: Role, file: &File, len: u64) -> io::Result<()> {
        match self.due(role, Op::Allocate) {
            Some(f) => Err(errno(f)),
            None => self.os.allocate(role, file, len),
        }
    }

    fn rename(&self, role: Role, from: &Path, to: &Path) -> io::Result<()> {
        if let Some(f) = self.due(role, Op::Rename) {
            return Err(errno(f));
        }
        self.os.rename(role, from, to)?;
        if let Some(t) = self.state.lock().files.get_mut(&role) {
            if t.path == from {
                t.path = to.to_path_buf();
            }
        }
        Ok(())
    }

    fn queue(&self, role: Role, _file: &File, t: Transfer<'_>) -> Option<i32> {
        let Some(data) = t.data else {
            return self
                .due(role, Op::Read)
                .map(|f| -errno(f).raw_os_error().unwrap_or(libc::EIO));
        };
        let fault = self.due(role, Op::Write);
        if let Err(e) = self.touch(role, t.offset, u64::from(t.len)) {
            return Some(-e.raw_os_error().unwrap_or(libc::EIO));
        }
        match fault {
            None => None,
            Some(f @ (Fault::Short | Fault::Torn)) => match self.write_half(role, data, t.offset) {
                Ok(half) if f == Fault::Short => Some(half as i32),
                Ok(_) => Some(-libc::EIO),
                Err(e) => Some(-e.raw_os_error().unwrap_or(libc::EIO)),
            },
            Some(f) => Some(-errno(f).raw_os_error().unwrap_or(libc::EIO)),
        }
    }
}
