//! The standard `process_*` metrics of the daemon itself (start time, CPU
//! seconds, resident and virtual memory, open and allowed descriptors),
//! read from Linux `/proc` at each scrape, so the fleet dashboard and
//! node-level alerts see both daemons like any other exporter. Where
//! `/proc` cannot be read the families are left out, not faked.

use std::fmt::Write as _;
use std::fs;

use crate::families;

/// The values of one scrape.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    start_time_seconds: f64,
    cpu_seconds: f64,
    resident_bytes: u64,
    virtual_bytes: u64,
    open_fds: u64,
    max_fds: u64,
}

/// Fields of `/proc/self/stat` after the command name, which may itself
/// hold spaces and parentheses: everything after the last `)`.
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().collect())
}

fn sample() -> Option<Sample> {
    let stat = fs::read_to_string("/proc/self/stat").ok()?;
    let f = stat_fields(&stat)?;
    // proc(5) numbers fields from 1 with the pid; `f[0]` is field 3.
    let field = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    let page = rustix::param::page_size() as u64;
    let boot = fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok())?;
    // The directory's own descriptor is open while it is listed.
    let open_fds = fs::read_dir("/proc/self/fd")
        .ok()?
        .count()
        .saturating_sub(1) as u64;
    let max_fds = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    Some(Sample {
        start_time_seconds: boot as f64 + field(22)? as f64 / ticks,
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        resident_bytes: field(24)?.saturating_mul(page),
        virtual_bytes: field(23)?,
        open_fds,
        max_fds,
    })
}

/// Appends the process families to an exposition.
pub(crate) fn render(out: &mut String) {
    let Some(s) = sample() else { return };
    let values: [(&str, String); 6] = [
        (
            "process_start_time_seconds",
            s.start_time_seconds.to_string(),
        ),
        ("process_cpu_seconds_total", s.cpu_seconds.to_string()),
        (
            "process_resident_memory_bytes",
            s.resident_bytes.to_string(),
        ),
        ("process_virtual_memory_bytes", s.virtual_bytes.to_string()),
        ("process_open_fds", s.open_fds.to_string()),
        ("process_max_fds", s.max_fds.to_string()),
    ];
    for (name, value) in values {
        let kind = match families::PROCESS.iter().find(|f| f.name == name) {
            Some(f) if f.kind == families::Kind::Counter => "counter",
            _ => "gauge",
        };
        let _ = writeln!(out, "# HELP {name} {}", families::help(name));
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name} {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_name_with_spaces_and_parens_does_not_shift_fields() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 0 0 20 0 1 0 500 1000 25";
        let f = stat_fields(stat).unwrap();
        assert_eq!(
            (f[0], f[11], f[12], f[19], f[20], f[21]),
            ("S", "7", "3", "500", "1000", "25")
        );
    }

    #[test]
    fn this_process_is_sampled_sensibly() {
        let s = sample().expect("Linux /proc");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(s.start_time_seconds <= now + 1.0 && s.start_time_seconds > now - 86_400.0 * 365.0);
        assert!(s.resident_bytes > 0 && s.virtual_bytes >= s.resident_bytes);
        // Other tests of this binary open and close files on their own
        // threads, so only a floor is certain: the files held here count.
        let held: Vec<_> = (0..64)
            .map(|_| std::fs::File::open("/proc/self/stat").unwrap())
            .collect();
        let with = sample().unwrap().open_fds;
        assert!(
            with >= held.len() as u64,
            "the {} open files count: {with}",
            held.len()
        );
        drop(held);
        assert!(s.max_fds >= s.open_fds);
    }
}
