//! `arenad --check` refuses what a start refuses, for the same cause: each
//! case below is a configuration a start of the arenad binary refuses,
//! and the check must refuse it too, naming the real cause (not a symptom
//! such as "0 bytes free"). Add a case here with every new refusal.

mod common;

use std::path::Path;
use std::process::Output;

use common::arenad::Arenad;

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn problems(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("problem: ").map(str::to_owned))
        .collect()
}

/// The check refuses with a problem containing `check_says`; a start
/// refuses with an error containing `start_says`.
fn both_refuse(a: &Arenad, check_says: &str, start_says: &str) {
    let check = a.run(&["--check"]);
    assert!(!check.status.success(), "--check passed:\n{}", said(&check));
    let found = problems(&check);
    assert!(
        found.iter().any(|p| p.contains(check_says)),
        "--check does not say {check_says:?}:\n{}",
        said(&check)
    );
    let start = a.run(&[]);
    assert!(
        !start.status.success(),
        "the start went on:\n{}",
        said(&start)
    );
    assert!(
        said(&start).contains(start_says),
        "the start does not say {start_says:?}:\n{}",
        said(&start)
    );
}

#[test]
fn a_swap_dir_under_a_regular_file_is_not_a_directory_to_both() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.key");
    let a = Arenad::new(dir.path(), "4M", "64K", "16M", Some(&file.join("swap")));
    both_refuse(
        &a,
        &format!("{} is not a directory", file.display()),
        "Not a directory",
    );
}

#[test]
fn a_swap_dir_on_a_filesystem_without_files_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let a = Arenad::new(
        dir.path(),
        "4M",
        "64K",
        "16M",
        Some(Path::new("/proc/arenad-check-test/swap")),
    );
    both_refuse(
        &a,
        "/proc is on a filesystem that stores no files",
        "/proc/arenad-check-test/swap",
    );
    let check = said(&a.run(&["--check"]));
    assert!(
        !check.contains("free"),
        "a symptom, not the cause:\n{check}"
    );
}

fn meminfo(field: &str) -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// An arenad in `dir` whose arena (and swap, which must be as large) is
/// 2 GiB above `bytes`, and that size in GiB.
fn arena_above(dir: &Path, bytes: u64) -> (u64, Arenad) {
    let gib = (bytes >> 30) + 2;
    let size = format!("{gib}G");
    (gib, Arenad::new(dir, &size, "16M", &size, None))
}

#[test]
fn an_arena_the_kernel_will_not_map_is_refused_by_both() {
    let dir = tempfile::tempdir().unwrap();
    let overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap();
    let (limit, check_says) = match overcommit.trim() {
        "0" => (
            meminfo("MemTotal") + meminfo("SwapTotal"),
            "is more than the host's RAM and swap",
        ),
        "2" => (
            meminfo("CommitLimit").saturating_sub(meminfo("Committed_AS")),
            "is more than the memory left to commit",
        ),
        // Any mapping is made: a start would go on and fill the host, so
        // it is not run; the check warns.
        _ => {
            let (_, a) = arena_above(dir.path(), meminfo("MemAvailable"));
            let out = said(&a.run(&["--check"]));
            assert!(
                out.contains("is more than the host's available memory"),
                "{out}"
            );
            return;
        }
    };
    let (arena, a) = arena_above(dir.path(), limit);
    both_refuse(
        &a,
        &format!("arena_bytes {arena}G {check_says}"),
        "arena failed: Cannot allocate memory",
    );
}

#[test]
fn quotas_above_the_capacity_are_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    // Two volumes of 1G each on a 4M arena and 16M of swap.
    let a = Arenad::new(dir.path(), "4M", "64K", "16M", None);
    let out = a.run(&["--check"]);
    assert!(out.status.success(), "{}", said(&out));
    assert!(
        said(&out).contains(
            "warning: the volumes' quotas add up to 2G, more than the arena and swap hold (20M)"
        ),
        "{}",
        said(&out)
    );
}
