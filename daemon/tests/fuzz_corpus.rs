//! The `ublkd_config` fuzz target's corpus as a test (the other targets'
//! are replayed by target-rdma's `fuzz_corpus` test): every input under
//! `target-rdma/fuzz/corpus/ublkd_config/` and
//! `target-rdma/fuzz/regressions/ublkd_config/` goes through the check the
//! fuzz target runs, and every one that panics is listed.

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use ublkd::config::UblkdConfig;

fn inputs(kind: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target-rdma/fuzz")
        .join(kind)
        .join("ublkd_config");
    let mut out: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(rd) => rd.map(|e| e.expect("a corpus entry").path()).collect(),
        Err(_) => Vec::new(),
    };
    out.retain(|p| p.is_file());
    out.sort();
    out
}

#[test]
fn every_ublkd_config_corpus_input_parses_or_is_refused_without_a_panic() {
    let seeds = inputs("corpus");
    assert!(!seeds.is_empty(), "the ublkd_config corpus has no seed");
    let mut failures = Vec::new();
    let all: Vec<PathBuf> = seeds.into_iter().chain(inputs("regressions")).collect();
    for path in &all {
        let bytes = fs::read(path).unwrap();
        let run = catch_unwind(AssertUnwindSafe(|| {
            target_rdma::fuzzing::check_config(&bytes, |text| {
                UblkdConfig::parse(text, Path::new("ublkd.toml"))
            })
        }));
        if let Err(payload) = run {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            failures.push(format!("{}: {msg}", path.display()));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} inputs panicked:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
}
