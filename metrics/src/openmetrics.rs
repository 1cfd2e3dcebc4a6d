//! The OpenMetrics 1.0 text exposition (`/metrics/openmetrics`), made from
//! the Prometheus 0.0.4 one so the two never list different samples.
//!
//! The differences that matter here: a counter family is named without its
//! `_total` suffix in `# HELP`/`# TYPE` (its samples keep it), `# HELP`
//! escapes double quotes, blank lines are not allowed, histogram buckets may
//! carry an exemplar (rendered by [`crate::histogram`]), and the exposition
//! ends with `# EOF`.

use std::collections::BTreeSet;

/// Content type of the OpenMetrics exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Rewrites a 0.0.4 exposition (whose histogram buckets may already carry
/// OpenMetrics exemplars) as OpenMetrics, `# EOF` included.
pub(crate) fn from_text(text: &str) -> String {
    let counters: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let family = |name: &'_ str| -> String {
        match name.strip_suffix("_total") {
            Some(base) if counters.contains(name) => base.to_string(),
            _ => name.to_string(),
        }
    };
    let mut out = String::with_capacity(text.len() + 8);
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push_str("# HELP ");
            out.push_str(&family(name));
            out.push(' ');
            // 0.0.4 escapes `\` and newlines in help text; OpenMetrics
            // also escapes double quotes.
            out.push_str(&help.replace('"', "\\\""));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push_str("# TYPE ");
            out.push_str(&family(name));
            out.push(' ');
            out.push_str(kind);
        } else if line.starts_with('#') {
            // Other comments have no place in OpenMetrics.
            continue;
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out.push_str("# EOF\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_lose_their_suffix_in_metadata_only() {
        let text = "# HELP a_total Things \"quoted\".\n# TYPE a_total counter\na_total{x=\"1\"} 3\n\n\
                    # HELP g_total A gauge that ends like a counter.\n# TYPE g_total gauge\ng_total 1\n\n";
        let om = from_text(text);
        assert_eq!(
            om,
            "# HELP a Things \\\"quoted\\\".\n# TYPE a counter\na_total{x=\"1\"} 3\n\
             # HELP g_total A gauge that ends like a counter.\n# TYPE g_total gauge\ng_total 1\n# EOF\n"
        );
    }
}
