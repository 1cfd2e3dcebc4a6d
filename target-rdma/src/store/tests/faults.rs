//! Disk faults, each injected in turn on each of the store's files: the
//! call that meets one fails with an error naming the file, the store
//! serves on (or refuses, by name, until restarted), and after a power cut
//! every byte a FLUSH acknowledged reads back as it was written.
//!
//! Each case runs the same workload on a [`FaultyDisk`]: a new store,
//! writes that overflow the arena into swap, removes, FLUSHes, a restart,
//! more of the same; the fault is put on the Nth call of one operation of
//! one file, for N over every call the workload makes there (sampled when
//! there are many). Then the power is cut (every page not durable goes
//! back to what it held when it last was) and the store opened on a plain
//! disk must hold, for each key, what the last acknowledged FLUSH covered
//! or something written after it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::support::*;
use super::*;
use crate::store::disk::{Disk, Role};
use crate::store::faults::{Fault, FaultyDisk, Op, EVERY_FAULT};

const SLOTS: u64 = 4;
const EXTENTS: u64 = 24;
const KEYS: u64 = 10;

/// What the store may hold for each key after a crash.
#[derive(Default)]
struct Model {
    /// The content of each key as of the last acknowledged FLUSH (`None`:
    /// absent).
    acked: BTreeMap<u64, Option<Vec<u8>>>,
    /// The content as the store answered it.
    now: BTreeMap<u64, Option<Vec<u8>>>,
    /// Contents written since that FLUSH: a crash may keep any of them.
    since: BTreeMap<u64, Vec<Option<Vec<u8>>>>,
}

impl Model {
    fn wrote(&mut self, key: u64, v: Option<Vec<u8>>) {
        self.since.entry(key).or_default().push(v.clone());
        self.now.insert(key, v);
    }

    fn flushed(&mut self) {
        self.acked = self.now.clone();
        self.since.clear();
    }
}

/// The errors of one case, for the report when it fails.
#[derive(Default)]
struct Seen {
    errors: Vec<String>,
}

impl Seen {
    /// Records `e`, which must name one of the store's files or say why
    /// the store refuses.
    fn error(&mut self, dir: &Path, what: &str, e: &StoreError) {
        let text = e.to_string();
        let named =
            text.contains(&dir.display().to_string()) || matches!(e, StoreError::Refused { .. });
        assert!(
            named,
            "{what}: the error names no file of the store: {text}"
        );
        self.errors.push(format!("{what}: {text}"));
    }
}

fn open_on(disk: &Arc<FaultyDisk>, dir: &Path) -> Result<Store, StoreError> {
    let disk: Arc<dyn Disk> = Arc::clone(disk) as Arc<dyn Disk>;
    Store::open_on(disk, cfg(dir, SLOTS, EXTENTS), &vols(1000))
}

/// Opens the store, retrying once: a fault at open is a refused start,
/// and the operator's next start meets a healthy disk (a once-fault).
fn start(disk: &Arc<FaultyDisk>, dir: &Path, seen: &mut Seen) -> Option<Store> {
    match open_on(disk, dir) {
        Ok(s) => Some(s),
        Err(e) => {
            seen.error(dir, "open", &e);
            match open_on(disk, dir) {
                Ok(s) => Some(s),
                Err(e) => {
                    seen.error(dir, "open again", &e);
                    None
                }
            }
        }
    }
}

fn round(s: &Store, r: u64, m: &mut Model, dir: &Path, seen: &mut Seen) {
    for i in 0..5 {
        let key = (r * 3 + i) % KEYS;
        let data = pattern(r * 100 + key);
        match s.write(0, key, 0, &data) {
            Ok(()) => m.wrote(key, Some(data)),
            Err(e) => seen.error(dir, "write", &e),
        }
    }
    if r % 3 == 2 {
        let key = r % KEYS;
        match s.remove(0, key, key + 1) {
            Ok(_) => m.wrote(key, None),
            Err(e) => seen.error(dir, "remove", &e),
        }
    }
    match s.flush() {
        Ok(()) => m.flushed(),
        Err(e) => seen.error(dir, "flush", &e),
    }
}

/// Runs the workload on `disk` in `dir`, cuts the power, and checks what
/// a plain start finds.
fn run(disk: &Arc<FaultyDisk>, dir: &Path) -> Seen {
    let mut seen = Seen::default();
    let mut m = Model::default();
    for run in 0..2 {
        let Some(s) = start(disk, dir, &mut seen) else {
            break;
        };
        for r in 0..5 {
            round(&s, run * 5 + r, &mut m, dir, &mut seen);
        }
        if run == 1 {
            disk.crash().expect("cutting the power");
        }
        drop(s);
    }
    disk.crash().expect("cutting the power");
    let s = Store::open(cfg(dir, SLOTS, EXTENTS), &vols(1000)).unwrap_or_else(|e| {
        panic!(
            "a start after the crash failed: {e}\nerrors before: {:#?}",
            seen.errors
        )
    });
    for key in 0..KEYS {
        let got = match s.read(0, key, 0, &mut vec![0u8; B as usize]) {
            Ok(_) => blob(&s, 0, key),
            Err(e) => panic!(
                "key {key} does not read after the crash: {e}\nerrors before: {:#?}",
                seen.errors
            ),
        };
        let acked = m.acked.get(&key).cloned().unwrap_or(None);
        let later = m.since.get(&key).cloned().unwrap_or_default();
        assert!(
            got == acked || later.contains(&got),
            "key {key}: after the crash it holds {}, the last FLUSH acknowledged {} \
             (and {} writes since)\nerrors before: {:#?}",
            describe(&got),
            describe(&acked),
            later.len(),
            seen.errors
        );
    }
    seen
}

fn describe(v: &Option<Vec<u8>>) -> String {
    match v {
        None => "nothing".into(),
        Some(b) => format!("{:02x?}…", &b[..8]),
    }
}

/// The calls `op` on `role` makes in a clean run of the workload.
fn calls(role: Role, op: Op) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(FaultyDisk::default());
    let seen = run(&disk, dir.path());
    assert!(seen.errors.is_empty(), "a clean run: {:#?}", seen.errors);
    disk.calls(role, op)
}

/// Every N up to 12, then about 12 more spread to `total`.
fn sample(total: u64) -> Vec<u64> {
    let step = (total / 12).max(1);
    (1..=total)
        .filter(|&n| n <= 12 || n % step == 0 || n == total)
        .collect()
}

/// Each fault of [`EVERY_FAULT`] on each sampled call of each operation
/// of the `role` file.
fn sweep(role: Role) {
    let (mut cases, mut answered) = (0, 0);
    for &(op, faults) in EVERY_FAULT {
        let total = calls(role, op);
        for n in sample(total) {
            for &fault in faults {
                let dir = tempfile::tempdir().unwrap();
                let disk = Arc::new(FaultyDisk::default());
                disk.fail_once(role, op, n, fault);
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&disk, dir.path())
                }));
                match outcome {
                    Err(p) => {
                        eprintln!("{role:?} {op:?} call {n} of {total}: {fault:?}");
                        std::panic::resume_unwind(p);
                    }
                    // Some faults meet background work (a write-back by
                    // the cleaner, the journal's synced mark), which logs
                    // them and tries again later.
                    Ok(seen) => answered += usize::from(!seen.errors.is_empty()),
                }
                cases += 1;
            }
        }
    }
    // A disk that stops writing or syncing that file for good, from the
    // start or half-way.
    for op in [Op::Write, Op::Sync] {
        let total = calls(role, op);
        for n in [1, total.div_ceil(2)] {
            let dir = tempfile::tempdir().unwrap();
            let disk = Arc::new(FaultyDisk::default());
            disk.fail_from(role, op, n, Fault::Errno(libc::EIO));
            let seen = run(&disk, dir.path());
            assert!(
                !seen.errors.is_empty(),
                "{role:?}: {op:?} failing from call {n} of {total} reached no caller"
            );
        }
    }
    assert!(cases >= 10, "{role:?}: only {cases} cases");
    // How many meet background work varies with timing; most do not.
    assert!(
        answered * 4 >= cases,
        "{role:?}: only {answered} of {cases} faults reached a caller"
    );
}

#[test]
fn every_fault_of_the_swap_file_loses_no_acknowledged_byte() {
    sweep(Role::Swap);
}

#[test]
fn every_fault_of_the_extent_table_loses_no_acknowledged_byte() {
    sweep(Role::ExtentTable);
}

#[test]
fn every_fault_of_the_journal_loses_no_acknowledged_byte() {
    sweep(Role::Journal);
}

#[test]
fn every_fault_of_the_checkpoint_loses_no_acknowledged_byte() {
    sweep(Role::Checkpoint);
}
