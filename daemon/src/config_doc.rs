//! The manual of `ublkd.toml` (`ublkd.toml(5)`, written by
//! `examples/package-docs.rs`): what each key means, next to the config it
//! documents. The keys, their defaults and what a reload applies come from
//! the code (`target_rdma::service::config_doc`, [`crate::reload::RELOADABLE`]);
//! the tests hold this table to [`UblkdConfig`]'s schema.

use std::collections::BTreeMap;

use target_rdma::service::config_doc::{self, Entry, KeyDoc, Reload, Type};

use crate::config::UblkdConfig;
use crate::coordination::config::EtcdConfig;
use crate::reload::RELOADABLE;

/// Every key of `ublkd.toml`, in the order of the config's fields; the
/// keys of a table as `table.KEY`.
pub const KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "state_dir",
        ty: Type::Path,
        meaning: "Absolute directory of ublkd's state: one definition per device in `state_dir/devices/ID.json`, brought back at start.",
    },
    KeyDoc {
        key: "socket",
        ty: Type::Path,
        meaning: "Absolute path of the control socket `ublkctl` talks to.",
    },
    KeyDoc {
        key: "socket_group",
        ty: Type::Str,
        meaning: "A group allowed to use the control socket (mode 0660); unset, root only (mode 0600).",
    },
    KeyDoc {
        key: "socket_max_connections",
        ty: Type::Int,
        meaning: "Control-socket connections served at once, 1 to 1024; more are closed at accept.",
    },
    KeyDoc {
        key: "on_shutdown",
        ty: Type::Choice,
        meaning: "What SIGTERM does with devices: `keep` flushes each device's arena session and leaves the device in the kernel (I/O waits) for the next ublkd to recover; `remove` deletes the devices and their definitions.",
    },
    KeyDoc {
        key: "log_format",
        ty: Type::Choice,
        meaning: "Log lines on stderr as `text` or `json` (flag `--log-format`).",
    },
    KeyDoc {
        key: "log_level",
        ty: Type::Str,
        meaning: "Log filter, such as `info`, `debug` or `ublkd=debug,info`. `RUST_LOG`, when set, overrides it at start and on every reload.",
    },
    KeyDoc {
        key: "connect_timeout_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 600000, allowed for connecting to and authenticating with arenad.",
    },
    KeyDoc {
        key: "request_timeout_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 600000, allowed for each arena request; a request past it completes with ETIMEDOUT.",
    },
    KeyDoc {
        key: "busy_poll_us",
        ty: Type::Int,
        meaning: "Microseconds, 0 to 10000, a queue thread keeps looking for the answer (TCP) or the completion (RDMA) of a request in flight before it sleeps until one arrives. An answer within it costs no sleep and no wake-up; the price is a core spinning while requests are in flight. 0 sleeps at once.",
    },
    KeyDoc {
        key: "device.queues",
        ty: Type::Int,
        meaning: "Hardware queues of a new device, 1 to 4096; each has its own thread, io_uring and arena connection.",
    },
    KeyDoc {
        key: "device.depth",
        ty: Type::Int,
        meaning: "Requests in flight per queue, 1 to 4096 (queues times depth at most 1048576).",
    },
    KeyDoc {
        key: "device.io_buf",
        ty: Type::Size,
        meaning: "Per-request buffer, also the largest I/O: a multiple of 4K from 4K to 1M.",
    },
    KeyDoc {
        key: "device.blob_size",
        ty: Type::Size,
        meaning: "Blob size asked of the volume: 0 takes the volume's, else a power of two from 4K to 16M that must match it.",
    },
    KeyDoc {
        key: "device.transport",
        ty: Type::Choice,
        meaning: "`tcp` moves the data inline on the control stream; `rdma` uses one-sided RDMA or fails clearly at `ublkctl add`; `auto` uses RDMA when this host has a device and the peer grants it, else TCP.",
    },
    KeyDoc {
        key: "device.confidential",
        ty: Type::Bool,
        meaning: "New devices are confidential: every frame of their arena sessions, payloads included, is encrypted and authenticated with AES-256-GCM (protocol version 3, keyed per session from the volume secret), and their payloads stay on the TCP stream (RDMA moves them in the clear). Needs `transport` `tcp` or `auto` (which then means TCP); an arenad that does not speak version 3 is refused at `ublkctl add`. `ublkctl add --confidential` turns it on for one device.",
    },
    KeyDoc {
        key: "device.logical_block_size",
        ty: Type::Int,
        meaning: "Logical block size: 512, 1024, 2048 or 4096.",
    },
    KeyDoc {
        key: "device.physical_block_size",
        ty: Type::Int,
        meaning: "Physical block size: a power of two from `logical_block_size` to 65536.",
    },
    KeyDoc {
        key: "device.max_io_size",
        ty: Type::Size,
        meaning: "Largest request the kernel may send: 0 means `io_buf`, else a multiple of `logical_block_size` no larger than `io_buf`.",
    },
    KeyDoc {
        key: "device.discard",
        ty: Type::Bool,
        meaning: "Advertise DISCARD (whole blobs are dropped, partial ranges zeroed).",
    },
    KeyDoc {
        key: "device.max_discard_size",
        ty: Type::Size,
        meaning: "Largest DISCARD: a non-zero multiple of 512.",
    },
    KeyDoc {
        key: "device.write_zeroes",
        ty: Type::Bool,
        meaning: "Advertise WRITE_ZEROES.",
    },
    KeyDoc {
        key: "device.max_write_zeroes_size",
        ty: Type::Size,
        meaning: "Largest WRITE_ZEROES: a non-zero multiple of 512.",
    },
    KeyDoc {
        key: "device.write_cache",
        ty: Type::Bool,
        meaning: "Advertise a volatile write cache, so FLUSH is the durability point.",
    },
    KeyDoc {
        key: "device.fua",
        ty: Type::Bool,
        meaning: "Advertise FUA; needs `write_cache`.",
    },
    KeyDoc {
        key: "metrics.listen",
        ty: Type::Str,
        meaning: "`IP:port` of the metrics listener (`/metrics`, `/health`, `/live`, `/ready`, `/diagnostics`); `\"\"` or `\"off\"` disables it. A reload moves the listener.",
    },
    KeyDoc {
        key: "metrics.per_device_labels",
        ty: Type::Bool,
        meaning: "Add a `device` label to the device I/O metric families; small hosts only (it multiplies those series by the number of devices).",
    },
    KeyDoc {
        key: "metrics.scan_interval_secs",
        ty: Type::Int,
        meaning: "Seconds, 1 to 300, between two scans of the in-flight request trackers (the in-flight, stalled and oldest-age gauges, `request.stuck` events).",
    },
    KeyDoc {
        key: "metrics.stall_threshold_secs",
        ty: Type::Int,
        meaning: "Age in seconds, 1 to 86400, at which an in-flight request counts as stalled (`ublk_io_stalled`, `ublkctl stats`, `request.stuck`).",
    },
    KeyDoc {
        key: "metrics.slow_threshold_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 0 to 3600000: a request completing at or above it logs `request.slow` (and, with `tracing.enabled`, keeps its spans); 0 turns both off.",
    },
    KeyDoc {
        key: "metrics.openmetrics",
        ty: Type::Bool,
        meaning: "Also serve `/metrics/openmetrics` (OpenMetrics 1.0, with the trace id of a retained request as the exemplar of each latency bucket); `/metrics` stays the Prometheus text format.",
    },
    KeyDoc {
        key: "metrics.max_connections",
        ty: Type::Int,
        meaning: "Connections the metrics listener holds open, 1 to 65536 (one descriptor each); past it a new connection closes the oldest one that has not sent its request head yet.",
    },
    KeyDoc {
        key: "metrics.request_timeout_secs",
        ty: Type::Int,
        meaning: "Seconds, 1 to 300, from accept to a complete request head, however slowly it is sent; then 408 and close.",
    },
    KeyDoc {
        key: "metrics.write_timeout_secs",
        ty: Type::Int,
        meaning: "Seconds, 1 to 300, from a complete request head until its answer has been built and read; then the connection is closed.",
    },
    KeyDoc {
        key: "rdma.device",
        ty: Type::Str,
        meaning: "RDMA device name (`rxe0`, `mlx5_0`) of `rdma` and `auto` devices; unset takes the first device with an active port.",
    },
    KeyDoc {
        key: "rdma.port",
        ty: Type::Int,
        meaning: "RDMA port number, 1 to 255; unset takes the device's first active port.",
    },
    KeyDoc {
        key: "rdma.gid_index",
        ty: Type::Int,
        meaning: "GID table index; unset means 1, the IPv4-mapped RoCEv2 GID on soft-RoCE (index 0, link-local, fails at connect). On RoCE hardware pick the RoCEv2 entry of `show_gids`.",
    },
    KeyDoc {
        key: "rdma.rails",
        ty: Type::Strings,
        meaning: "Two RDMA devices, one per rail, instead of `rdma.device`: `[\"mlx5_0\", \"mlx5_1\"]`, each on the link to the arena peer's device of the same rail (its `rdma_rails`). Each queue connects a QP on both; a payload goes on the rail with fewer bytes outstanding, one of at least `rdma.stripe_bytes` is split across both, and a rail that fails moves its transfers to the other and rejoins by itself. A device that does not open leaves its rail off.",
    },
    KeyDoc {
        key: "rdma.stripe_bytes",
        ty: Type::Size,
        meaning: "With two rails up, payloads of at least this size (4K to 16M, default 128K) are split in two halves moved on both rails at once.",
    },
    KeyDoc {
        key: "rdma.transfer_timeout_ms",
        ty: Type::Int,
        meaning: "How long one RDMA transfer may take, 10 to 60000 ms, before its rail counts as lost: its QP is failed and the transfer moves to the other rail (or to TCP). Unset: `request_timeout_ms`, at most 5000. With two rails this bounds the pause a dead link causes.",
    },
    KeyDoc {
        key: "rdma.lease_cache",
        ty: Type::Int,
        meaning: "Leases each queue keeps across requests, 0 to 65536: a READ or WRITE of a blob whose lease is cached moves its payload with no control round trip. Each pins an arena slot at the peer, which revokes leases beyond a volume's share under pressure. 0 caches none.",
    },
    KeyDoc {
        key: "etcd.endpoints",
        ty: Type::Strings,
        meaning: "1 to 16 client URLs of the etcd cluster, `http://HOST:PORT` or `HOST:PORT`. Without an `[etcd]` table ublkd coordinates alone: replicated volumes keep their membership in the state directory, one host only, no placement pool.",
    },
    KeyDoc {
        key: "etcd.prefix",
        ty: Type::Str,
        meaning: "Every key ublkd reads or writes in etcd starts with it, so one etcd can serve several fleets; starts and ends with `/`, at most 128 bytes.",
    },
    KeyDoc {
        key: "etcd.dial_timeout_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 60000, allowed for connecting to an endpoint.",
    },
    KeyDoc {
        key: "etcd.request_timeout_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 60000, allowed for each etcd request.",
    },
    KeyDoc {
        key: "etcd.lease_ttl_secs",
        ty: Type::Int,
        meaning: "TTL in seconds, 2 to 600, of this ublkd's writer lease: this long after its last successful keepalive, etcd hands its volumes to another writer. Keepalives go every third of it.",
    },
    KeyDoc {
        key: "etcd.lease_margin_ms",
        ty: Type::Int,
        meaning: "Milliseconds taken off the lease's expiry when deciding whether writes may still be acknowledged, for the clock drift between this host and etcd; below two thirds of the TTL.",
    },
    KeyDoc {
        key: "etcd.max_inflight",
        ty: Type::Int,
        meaning: "Most etcd requests in flight at once, 1 to 65536; more fail at once (\"busy\") instead of queueing.",
    },
    KeyDoc {
        key: "etcd.host_id",
        ty: Type::Str,
        meaning: "This ublkd's name in the writer keys and in the error a second writer gets; unset, the host name.",
    },
    KeyDoc {
        key: "etcd.username",
        ty: Type::Str,
        meaning: "etcd user, for clusters with authentication; set with `password_file` or not at all.",
    },
    KeyDoc {
        key: "etcd.password_file",
        ty: Type::Path,
        meaning: "Absolute path of the file holding the etcd user's password (its first line).",
    },
    KeyDoc {
        key: "etcd.handover_poll_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 10 to 10000, between two looks of a writer for standbys asking for its volumes (one etcd range read, only while it serves a replicated volume): part of the pause a hand-over costs.",
    },
    KeyDoc {
        key: "replication.hedge_after_us",
        ty: Type::Int,
        meaning: "Microseconds, 10 to 10000000: a read of a replicated device not answered this long is also sent to a second healthy member.",
    },
    KeyDoc {
        key: "replication.change_deadline_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 600000, a request waits for a membership change (the removal of a member that failed it) before it fails unacknowledged (ETIMEDOUT).",
    },
    KeyDoc {
        key: "replication.coord_timeout_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 600000 and at most `change_deadline_ms`, allowed for one coordination request.",
    },
    KeyDoc {
        key: "replication.rebuild_bytes_per_sec",
        ty: Type::Int,
        meaning: "Rebuild copy rate per device, in bytes per second; 0 is unlimited.",
    },
    KeyDoc {
        key: "replication.rebuild_check_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 600000, between two looks of a replicated device for a failed member whose peer answers again, to rebuild it.",
    },
    KeyDoc {
        key: "replication.replace_after_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 86400000: a member failed this long whose peer does not answer is replaced by a spare from etcd's placement pool (without `[etcd]`, only the same peer is rebuilt, once back).",
    },
    KeyDoc {
        key: "replication.rebuild_backoff_max_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 100 to 86400000: the longest pause before another rebuild of a peer whose rebuilds keep failing; the pause doubles from `rebuild_check_ms` with each failure in a row, up to this.",
    },
    KeyDoc {
        key: "replication.straggler_after_ms",
        ty: Type::Int,
        meaning: "Milliseconds a write or flush waits for a member once another member answered it, 0 or 10 to 600000; a member that has not answered by then is failed like a dead one and rebuilt when it answers again. 0 derives it from the members' recent latency (`straggler_factor`, `straggler_floor_ms`).",
    },
    KeyDoc {
        key: "replication.straggler_floor_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 10 to 600000: the least a derived straggler bound waits.",
    },
    KeyDoc {
        key: "replication.straggler_factor",
        ty: Type::Int,
        meaning: "A derived straggler bound is this many times (1 to 100) the slowest answering member's recent p99 write latency.",
    },
    KeyDoc {
        key: "replication.rebuild_inflight",
        ty: Type::Int,
        meaning: "Rebuild copies (whole blobs) in flight at once per device, 1 to 256.",
    },
    KeyDoc {
        key: "replication.rebuild_yield_above",
        ty: Type::Int,
        meaning: "While the device has more guest requests in flight than this, its rebuild copies one blob at a time.",
    },
    KeyDoc {
        key: "tracing.enabled",
        ty: Type::Bool,
        meaning: "Record sampled spans of block requests: `span.request` and `span.attempt` log records of head-sampled, slow, failed, timed-out and cancelled requests, and the exemplars of `/metrics/openmetrics`.",
    },
    KeyDoc {
        key: "tracing.sample_rate_ppm",
        ty: Type::Int,
        meaning: "Requests per million, 0 to 1000000, kept by the deterministic head sample (1000000: every request), besides every failed, timed-out, cancelled and slow one.",
    },
];

/// Whether a reload applies `key`: [`RELOADABLE`], the list the reload
/// itself goes by.
pub fn reload(key: &str) -> Reload {
    if RELOADABLE.contains(&key) {
        Reload::Applied
    } else {
        Reload::Restart
    }
}

/// The defaults, in TOML spelling: those of [`UblkdConfig::defaults`], and
/// for the `[etcd]` table (absent by default) those of a table that names
/// only its endpoints, which have no default.
pub fn defaults() -> Result<BTreeMap<String, String>, String> {
    let mut cfg = UblkdConfig::defaults();
    cfg.etcd = Some(EtcdConfig::new(Vec::new()));
    let mut leaves = config_doc::toml_leaves(&cfg)?;
    leaves.remove("etcd.endpoints");
    Ok(leaves)
}

/// The manual's entries, one per key.
pub fn entries() -> Result<Vec<Entry>, String> {
    config_doc::entries::<UblkdConfig>(KEYS, &defaults()?, reload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use target_rdma::service::config_doc::{problems, schema_keys};
    use target_rdma::service::config_file::flatten;

    #[test]
    fn every_key_of_the_schema_has_exactly_one_entry() {
        let schema = schema_keys::<UblkdConfig>().unwrap();
        assert!(schema.contains_key("etcd.host_id") && schema["rdma.gid_index"].optional);
        assert_eq!(
            problems(KEYS, &schema, &defaults().unwrap()),
            Vec::<String>::new()
        );
        let entries = entries().unwrap();
        let get = |k: &str| entries.iter().find(|e| e.key == k).unwrap();
        assert_eq!(get("etcd.prefix").default, "\"/ublk/\"");
        assert_eq!(get("etcd.endpoints").default, "required");
        assert_eq!(get("socket_group").default, "unset");
        assert_eq!(get("device.io_buf").default, "\"512K\"");
        assert_eq!(get("on_shutdown").ty, "\"keep\" | \"remove\"");
    }

    #[test]
    fn a_key_added_or_dropped_is_found() {
        let schema = schema_keys::<UblkdConfig>().unwrap();
        let mut extra = KEYS.to_vec();
        extra.push(KeyDoc {
            key: "device.colour",
            ty: Type::Str,
            meaning: "x",
        });
        assert_eq!(
            problems(&extra, &schema, &defaults().unwrap()),
            ["device.colour: documented, but the config has no such key"]
        );
        let dropped: Vec<KeyDoc> = KEYS
            .iter()
            .filter(|k| k.key != "etcd.username")
            .copied()
            .collect();
        assert_eq!(
            problems(&dropped, &schema, &defaults().unwrap()),
            ["etcd.username: a key of the config with no entry in its manual"]
        );
    }

    /// Every key of a config with every optional key set, as a reload
    /// compares them, is documented; every key the reload applies is one.
    #[test]
    fn the_entries_reload_as_the_reload_code_decides() {
        let text = r#"
socket_group = "ublk"
[rdma]
device = "rxe0"
port = 1
gid_index = 3
transfer_timeout_ms = 500
[etcd]
endpoints = ["http://127.0.0.1:2379"]
host_id = "host1"
username = "ublkd"
password_file = "/etc/ublkd/etcd.password"
"#;
        let cfg = UblkdConfig::parse(text, std::path::Path::new("test.toml")).unwrap();
        let flat = flatten(&cfg);
        for key in flat.keys() {
            assert!(KEYS.iter().any(|k| k.key == key), "{key} is not documented");
        }
        assert_eq!(
            flat.len(),
            KEYS.len(),
            "a key of the manual the config did not set"
        );
        for key in RELOADABLE {
            assert!(
                KEYS.iter().any(|k| k.key == *key),
                "reloads apply {key}, not a key"
            );
        }
        let applied = entries()
            .unwrap()
            .into_iter()
            .filter(|e| e.reload == Reload::Applied)
            .count();
        assert_eq!(applied, RELOADABLE.len());
    }
}
