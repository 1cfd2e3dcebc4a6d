//! docs/PROTOCOL.md is what an independent client is written from, so it
//! must say what the code does: its list of protocol-error classes is the
//! code's (and docs/METRICS.md's lists are too).

use std::collections::BTreeSet;
use std::path::Path;

use ublk_metrics::ProtocolErrorClass;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn code_classes() -> BTreeSet<String> {
    ProtocolErrorClass::ALL
        .iter()
        .map(|c| c.as_str().to_owned())
        .collect()
}

/// The backticked first cells of the rows of the first table after the
/// line `heading`.
fn first_column(doc: &str, heading: &str) -> BTreeSet<String> {
    let rest = doc
        .split_once(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no heading {heading:?}"))
        .1;
    rest.lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|row| {
            let cell = row.split('|').nth(1).unwrap_or_default().trim();
            cell.strip_prefix('`')
                .and_then(|c| c.strip_suffix('`'))
                .unwrap_or_else(|| panic!("{heading}: first cell {cell:?} is not `code`"))
                .to_owned()
        })
        .collect()
}

/// Every list of three or more `code` spans separated by ", " in `line`.
fn backticked_lists(line: &str) -> Vec<BTreeSet<String>> {
    let parts: Vec<&str> = line.split('`').collect();
    let mut lists = Vec::new();
    let mut run = BTreeSet::new();
    for i in (1..parts.len()).step_by(2) {
        run.insert(parts[i].to_owned());
        if parts.get(i + 1) != Some(&", ") {
            let list = std::mem::take(&mut run);
            if list.len() >= 3 {
                lists.push(list);
            }
        }
    }
    lists
}

#[test]
fn the_documented_protocol_error_classes_are_the_codes() {
    let code = code_classes();
    let doc = read("docs/PROTOCOL.md");
    assert_eq!(
        first_column(&doc, "### Protocol error classes"),
        code,
        "docs/PROTOCOL.md, *Protocol error classes*, against ProtocolErrorClass"
    );
    // Every class="..." the document names is one of them.
    for (i, _) in doc.match_indices("class=\"") {
        let value = doc[i + 7..].split('"').next().unwrap_or_default();
        assert!(
            code.contains(value),
            "docs/PROTOCOL.md names class=\"{value}\", which is not exported"
        );
    }
    let metrics = read("docs/METRICS.md");
    for family in [
        "arenad_protocol_errors_total",
        "ublk_driver_frame_errors_total",
    ] {
        let row = metrics
            .lines()
            .find(|l| l.starts_with(&format!("| `{family}`")))
            .unwrap_or_else(|| panic!("docs/METRICS.md has no row for {family}"));
        assert!(
            backticked_lists(row).contains(&code),
            "docs/METRICS.md's {family} row does not list the classes {code:?}: {row}"
        );
    }
}
