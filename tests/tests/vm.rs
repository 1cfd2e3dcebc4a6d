//! The real-kernel suites, driven from cargo: each boots a Debian kernel
//! under QEMU (scripts/vm, docs/VM-TESTS.md) and runs a scenario script
//! whose `PASS name` / `FAIL name` lines are checked here.
//!
//! They take minutes under TCG, so they are `#[ignore]`d in a plain
//! `cargo test`; `scripts/test` runs them with `--ignored`.

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `scripts/vm/<suite>`, echoes its output, and fails unless it exited
/// 0, printed at least `min_pass` PASS lines and no FAIL line.
fn suite(script: &str, args: &[&str], min_pass: usize) {
    let out = Command::new(repo().join(script))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let fails: Vec<&str> = stdout.lines().filter(|l| l.starts_with("FAIL")).collect();
    let passes = stdout.lines().filter(|l| l.starts_with("PASS")).count();
    assert!(fails.is_empty(), "{script}: {fails:#?}");
    assert!(out.status.success(), "{script} exited with {}", out.status);
    assert!(
        passes >= min_pass,
        "{script}: only {passes} PASS lines, expected at least {min_pass}"
    );
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_harness_selftest() {
    suite(
        "scripts/vm/run",
        &["scripts/vm/guest/selftest.sh", "300"],
        10,
    );
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_ublk_end_to_end_over_tcp() {
    suite("scripts/vm/e2e", &["1500"], 15);
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_rdma_over_soft_roce() {
    suite("scripts/vm/rdma", &["600"], 20);
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_two_rdma_rails_through_link_losses() {
    suite("scripts/vm/rails", &["900"], 12);
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_systemd_units_with_rdma_and_ublk() {
    suite("scripts/vm/units", &["900"], 11);
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_replicated_device_through_a_peer_kill() {
    suite("scripts/vm/replicas", &["1500"], 18);
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_writer_role_handed_over_between_two_ublkd() {
    suite("scripts/vm/handover", &["900"], 12);
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_writer_role_handed_over_over_rdma() {
    suite("scripts/vm/handover", &["900", "rdma"], 12);
}

#[test]
#[ignore = "boots a VM: run by scripts/test"]
fn vm_qemu_guest_on_ublk_through_faults_and_live_migration() {
    suite("scripts/vm/guest-vm", &["1800"], 12);
}
