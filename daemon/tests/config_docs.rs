//! The configuration keys docs/OPERATIONS.md documents in its tables are
//! keys both daemons read: a table row for a key that was renamed or
//! removed would send an operator to a key the daemon refuses.

use std::collections::BTreeSet;
use std::path::Path;

/// The keys the rows of `section`'s tables name (first cell), dotted as
/// the schema tables spell them: `` `[device] depth` `` is `device.depth`,
/// `` `[etcd] username`, `password_file` `` two keys of `etcd`.
fn cited_keys(doc: &str, section: &str, until: &str) -> Vec<String> {
    let start = doc
        .find(section)
        .unwrap_or_else(|| panic!("no {section:?}"));
    let rest = &doc[start..];
    let end = rest.find(until).unwrap_or(rest.len());
    let mut keys = Vec::new();
    for line in rest[..end].lines() {
        let Some(cell) = line.strip_prefix("| `") else {
            continue;
        };
        let cell = &cell[..cell.find(" |").unwrap_or(cell.len())];
        let (table, names) = match cell.strip_prefix('[') {
            Some(t) => {
                let (table, names) = t.split_once("] ").expect("`[table] key`");
                (Some(table), names)
            }
            None => (None, cell),
        };
        for name in names.split(", ") {
            let name = name.trim_matches('`');
            keys.push(match table {
                Some(t) => format!("{t}.{name}"),
                None => name.to_owned(),
            });
        }
    }
    keys
}

#[test]
fn every_key_operations_md_documents_is_a_key_of_the_daemon() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/OPERATIONS.md"),
    )
    .unwrap();
    for (section, until, schema) in [
        ("## ublkd configuration", "\n## ", ublkd::config_doc::KEYS),
        (
            "## arenad configuration",
            "\n### arenad's store",
            target_rdma::arenad::config_doc::KEYS,
        ),
    ] {
        let known: BTreeSet<&str> = schema.iter().map(|k| k.key).collect();
        let cited = cited_keys(&doc, section, until);
        assert!(cited.len() >= 20, "{section}: only {cited:?}");
        for key in &cited {
            assert!(
                known.contains(key.as_str()),
                "docs/OPERATIONS.md, {section}: `{key}` is no key of the daemon's configuration"
            );
        }
    }
}
