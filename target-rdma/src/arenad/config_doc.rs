//! The manual of `arenad.toml` (`arenad.toml(5)`, written by
//! `daemon/examples/package-docs.rs`): what each key means, next to the
//! config it documents. The keys, their defaults and what a reload applies
//! come from the code ([`crate::service::config_doc`]); the tests hold this
//! table to [`ArenadConfig`]'s schema.

use std::collections::BTreeMap;

use crate::arenad::config::ArenadConfig;
use crate::arenad::reload::{RELOADABLE, RELOADABLE_TABLES};
use crate::service::config_doc::{self, Entry, KeyDoc, Reload, Type};

/// Every key of `arenad.toml`, in the order of the config's blocks; the
/// keys of each `[[volume]]` table as `volume.KEY`.
pub const KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "listen",
        ty: Type::Str,
        meaning: "The `IP:port` the control stream listens on: the address ublkd's devices name as their peer (flag `--listen`).",
    },
    KeyDoc {
        key: "arena_bytes",
        ty: Type::Size,
        meaning: "Size of the RAM arena: blobs are served from it, and registered with the RDMA device when one is used. A multiple of `blob_bytes` holding at least 2 blobs (flag `--arena-bytes`).",
    },
    KeyDoc {
        key: "blob_bytes",
        ty: Type::Size,
        meaning: "Size of one blob (arena slot): a power of two from 4K to 16M. A device's `blob_size` must match it (flag `--blob-bytes`).",
    },
    KeyDoc {
        key: "swap_dir",
        ty: Type::Path,
        meaning: "Directory of the store: the swap file, its extent headers, the index (checkpoint and journal), the volumes' membership epochs and the lock file (flag `--swap-dir`).",
    },
    KeyDoc {
        key: "swap_bytes",
        ty: Type::Size,
        meaning: "Capacity of the swap file, where cold blobs are paged out: a multiple of `blob_bytes`, at least `arena_bytes` (flag `--swap-bytes`).",
    },
    KeyDoc {
        key: "swap_reads_in_flight",
        ty: Type::Int,
        meaning: "Most reads of parts of cold blobs in flight on the swap's io_uring rings at once (over all worker threads), 1 to 4096; more wait for room. Each holds a buffer of the read's size while in flight.",
    },
    KeyDoc {
        key: "max_connections",
        ty: Type::Int,
        meaning: "Most client connections at once, authenticated or not, 1 to 65536; more are refused with a `BUSY` frame naming the limit (flag `--max-connections`).",
    },
    KeyDoc {
        key: "max_inflight",
        ty: Type::Int,
        meaning: "Most requests one connection may keep in flight, 1 to 4096, announced in the handshake (flag `--max-inflight`).",
    },
    KeyDoc {
        key: "handshake_timeout_secs",
        ty: Type::Int,
        meaning: "Seconds, 1 to 600, a new connection has to complete its whole HELLO; one deadline, not one per read.",
    },
    KeyDoc {
        key: "rdma",
        ty: Type::Choice,
        meaning: "Whether to serve RDMA: `auto` registers the arena when an RDMA device opens and else serves TCP and says so; `on` needs a device or the start fails; `off` serves TCP only.",
    },
    KeyDoc {
        key: "rdma_device",
        ty: Type::Str,
        meaning: "RDMA device name (`rxe0`, `mlx5_0`); unset takes the first device with an active port.",
    },
    KeyDoc {
        key: "rdma_rails",
        ty: Type::Strings,
        meaning: "Two RDMA devices, one per rail, instead of `rdma_device`: `[\"mlx5_0\", \"mlx5_1\"]`. A client connects a QP on each rail and names the rail; each lease answer carries a key per rail. `rdma_port` and `rdma_gid_index` apply to both. With `rdma = \"auto\"` a device that does not open leaves its rail unserved (the other keeps its index); with `on` both must open.",
    },
    KeyDoc {
        key: "rdma_port",
        ty: Type::Int,
        meaning: "RDMA port number; unset takes the device's first active port.",
    },
    KeyDoc {
        key: "rdma_gid_index",
        ty: Type::Int,
        meaning: "GID table index: 1 is the IPv4-mapped RoCEv2 GID on soft-RoCE; on RoCE hardware pick the RoCEv2 entry of `show_gids`.",
    },
    KeyDoc {
        key: "rdma_isolation",
        ty: Type::Choice,
        meaning: "What an RDMA session's keys reach: `lease`, a protection domain per session and a memory region per lease over exactly its slot; `shared`, one key to the whole arena for every session (no registration per lease, and every RDMA client is trusted with every volume).",
    },
    KeyDoc {
        key: "metrics_listen",
        ty: Type::Str,
        meaning: "`IP:port` of the metrics listener (`/metrics`, `/health`, `/live`, `/ready`, `/diagnostics`); `\"\"` or `\"off\"` disables it (flag `--metrics-listen`).",
    },
    KeyDoc {
        key: "log_format",
        ty: Type::Choice,
        meaning: "Log lines on stderr as `text` or `json` (flag `--log-format`).",
    },
    KeyDoc {
        key: "log_level",
        ty: Type::Str,
        meaning: "Log filter, such as `info`, `debug` or `target_rdma=debug,info`. `RUST_LOG`, when set, overrides it at start and on every reload.",
    },
    KeyDoc {
        key: "allow_protocol_v1",
        ty: Type::Bool,
        meaning: "Also accept protocol version 1 sessions: no per-frame tags (anyone able to write into the TCP stream can inject frames) and no membership epochs. Only while older clients are upgraded.",
    },
    KeyDoc {
        key: "max_unauthenticated",
        ty: Type::Int,
        meaning: "Most connections still in their handshake, counted within `max_connections` and shared between their sources (see `handshake_source_prefix_v4`): what sockets that never authenticate can hold. Unset: 64, or `max_connections` if that is smaller.",
    },
    KeyDoc {
        key: "handshake_source_prefix_v4",
        ty: Type::Int,
        meaning: "IPv4 peers within one prefix of this length (0 to 32) are one source of handshakes: when all `max_unauthenticated` places are taken, a source holding fewer takes the oldest place of the source holding the most. 32: each address; 0: all of IPv4 one source.",
    },
    KeyDoc {
        key: "handshake_source_prefix_v6",
        ty: Type::Int,
        meaning: "The same for IPv6 peers (0 to 128); 64 because a host usually holds a whole /64 and can connect from any address in it.",
    },
    KeyDoc {
        key: "write_timeout_secs",
        ty: Type::Int,
        meaning: "Seconds, 1 to 600, a socket write to a client may block (a client that does not read its answers); past it the connection ends, and its leases with it.",
    },
    KeyDoc {
        key: "max_queued_frames",
        ty: Type::Int,
        meaning: "Most frames (answers and REVOKEs) waiting in one connection's outbound queue, 16 to 1048576. A REVOKE that finds it full disconnects the client (it is not reading); an answer waits for room.",
    },
    KeyDoc {
        key: "max_queued_bytes",
        ty: Type::Size,
        meaning: "Most bytes waiting in one connection's outbound queue, and most bytes of request bodies one connection may have in flight, 64K to 1G: past it the connection's answers wait for room and its requests are not read.",
    },
    KeyDoc {
        key: "blocking_threads",
        ty: Type::Int,
        meaning: "Threads, 1 to 1024, that run the store calls that may block (a fault-in from swap, FLUSH, EPOCH, REMOVE, RAIL_CONNECT, a write that needs a slot); started with the server.",
    },
    KeyDoc {
        key: "promote_cold_after",
        ty: Type::Int,
        meaning: "0 to 1024. An RDMA client reading part of a blob that is in swap only gets COLD for its GET_RESIDENT at once, and reads the range it wants inline, served at that size from swap. A blob found cold this many times while it is among the last blobs found cold (an eighth of the arena's slots, at most 64) is faulted into the arena in the background (at most 2 at once), so its later reads go by RDMA. 0: never (cold blobs stay in swap until written or read whole).",
    },
    KeyDoc {
        key: "shutdown_timeout_secs",
        ty: Type::Int,
        meaning: "Seconds, 1 to 50, SIGTERM gives the connections to finish their requests and drain their answers before they are cut; the final flush follows, within the unit's TimeoutStopSec=60s.",
    },
    KeyDoc {
        key: "metrics_max_connections",
        ty: Type::Int,
        meaning: "Connections the metrics listener holds open, 1 to 65536 (one descriptor each); past it a new connection closes the oldest one that has not sent its request yet.",
    },
    KeyDoc {
        key: "metrics_request_timeout_secs",
        ty: Type::Int,
        meaning: "Seconds, 1 to 300, from accept to a complete request head on the metrics listener, however slowly it is sent; then 408 and close.",
    },
    KeyDoc {
        key: "metrics_write_timeout_secs",
        ty: Type::Int,
        meaning: "Seconds, 1 to 300, from a complete request head until its answer has been built and read; then the connection is closed.",
    },
    KeyDoc {
        key: "metrics_volume_labels",
        ty: Type::Bool,
        meaning: "Label the per-volume metric families (`arenad_volume_*`) with each volume's name; `false` counts every volume under `_other`, for hosts whose volume names must not leave the host.",
    },
    KeyDoc {
        key: "metrics_max_volume_labels",
        ty: Type::Int,
        meaning: "Most volumes labelled by name, at most 4096, in the order they are first served; the rest are counted together under `_other`, so the series stay bounded however many tenants there are.",
    },
    KeyDoc {
        key: "admin_socket",
        ty: Type::Str,
        meaning: "Absolute path of the Unix socket `arenactl` talks to; `\"\"` or `\"off\"` disables it. A socket that cannot be set up is logged and arenad serves without it.",
    },
    KeyDoc {
        key: "admin_socket_group",
        ty: Type::Str,
        meaning: "Group whose members may use the admin socket (mode 0660); unset, root (or arenad's own user) only (mode 0600).",
    },
    KeyDoc {
        key: "admin_max_connections",
        ty: Type::Int,
        meaning: "Admin connections served at once, 1 to 1024; more are closed at accept.",
    },
    KeyDoc {
        key: "volume_lease_share",
        ty: Type::Int,
        meaning: "Leases a volume holds before its further leases are the first revoked for a volume under its own share; at least 1. Unset: the arena's slots divided by the served volumes (at least 1).",
    },
    KeyDoc {
        key: "connection_max_leases",
        ty: Type::Int,
        meaning: "Most leases one connection holds at once, at least 1; past it BUSY, and its oldest lease is revoked. Unset: the arena's slots.",
    },
    KeyDoc {
        key: "revoke_deadline_ms",
        ty: Type::Int,
        meaning: "Milliseconds, 10 to 600000, a revoked lease may stay out before it is ended by force (its holder's later COMMIT answers LEASE_LOST).",
    },
    KeyDoc {
        key: "volume.name",
        ty: Type::Str,
        meaning: "The name clients open: 1 to 64 bytes of `A-Z a-z 0-9 . _ -`, unique among the volumes.",
    },
    KeyDoc {
        key: "volume.secret_file",
        ty: Type::Path,
        meaning: "File holding the volume's secret (mode 0600 or stricter), read at start and on every reload: a rotated secret is the one new sessions must prove; sessions already open keep going.",
    },
    KeyDoc {
        key: "volume.quota",
        ty: Type::Size,
        meaning: "Most bytes of blobs the volume may hold, rounded up to whole blobs and at least one blob; a change holds for new blobs.",
    },
    KeyDoc {
        key: "volume.confidential",
        ty: Type::Bool,
        meaning: "Serve the volume to sealed sessions only (protocol version 3: every frame body encrypted with AES-256-GCM, payloads inline on the TCP stream, never by RDMA). A HELLO of version 1 or 2 that proves the secret is refused with `VERSION_MISMATCH`; one that does not is refused `AUTH_FAILED` as for any volume, so it learns nothing. The clients need `confidential = true` (ublkd: `ublkctl add --confidential`). A change holds for new sessions; open ones go on. The blobs stay in the clear in the arena and swap file.",
    },
];

/// Whether a reload applies `key` (a key of [`KEYS`]), as
/// [`crate::arenad::reload`] decides: its lists, not a second one.
pub fn reload(key: &str) -> Reload {
    let table = key.split('.').next().filter(|_| key.contains('.'));
    if RELOADABLE.contains(&key) || table.is_some_and(|t| RELOADABLE_TABLES.contains(&t)) {
        Reload::Applied
    } else {
        Reload::Restart
    }
}

/// The defaults, in TOML spelling: those of [`ArenadConfig::defaults`]
/// (no volume: a `[[volume]]` table has no defaults).
pub fn defaults() -> Result<BTreeMap<String, String>, String> {
    config_doc::toml_leaves(&ArenadConfig::defaults())
}

/// The manual's entries, one per key.
pub fn entries() -> Result<Vec<Entry>, String> {
    config_doc::entries::<ArenadConfig>(KEYS, &defaults()?, reload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::config_doc::{problems, schema_keys};
    use crate::service::config_file::flatten;

    #[test]
    fn every_key_of_the_schema_has_exactly_one_entry() {
        let schema = schema_keys::<ArenadConfig>().unwrap();
        assert!(schema.contains_key("volume.quota") && schema["rdma_port"].optional);
        assert_eq!(
            problems(KEYS, &schema, &defaults().unwrap()),
            Vec::<String>::new()
        );
        assert_eq!(entries().unwrap().len(), KEYS.len());
    }

    #[test]
    fn a_key_added_or_dropped_is_found() {
        let schema = schema_keys::<ArenadConfig>().unwrap();
        let mut extra = KEYS.to_vec();
        extra.push(KeyDoc {
            key: "arena_size",
            ty: Type::Size,
            meaning: "x",
        });
        assert_eq!(
            problems(&extra, &schema, &defaults().unwrap()),
            ["arena_size: documented, but the config has no such key"]
        );
        let dropped: Vec<KeyDoc> = KEYS
            .iter()
            .filter(|k| k.key != "rdma_port")
            .copied()
            .collect();
        assert_eq!(
            problems(&dropped, &schema, &defaults().unwrap()),
            ["rdma_port: a key of the config with no entry in its manual"]
        );
    }

    /// Every key of a config with a volume and every optional key set, as
    /// a reload compares them, is documented, with the reload the reload
    /// code gives it.
    #[test]
    fn the_entries_reload_as_the_reload_code_decides() {
        let text = r#"
rdma_device = "rxe0"
rdma_port = 1
max_unauthenticated = 8
admin_socket_group = "arenad"
volume_lease_share = 4
connection_max_leases = 16
[[volume]]
name = "vm1"
secret_file = "/etc/arenad/vm1.key"
quota = "1G"
confidential = true
"#;
        let cfg = ArenadConfig::parse(text, std::path::Path::new("test.toml")).unwrap();
        let entries = entries().unwrap();
        let flat = flatten(&cfg);
        for key in flat.keys() {
            let doc_key = key.replace("[0]", "");
            let e = entries.iter().find(|e| e.key == doc_key);
            let e = e.unwrap_or_else(|| panic!("{key} is not documented"));
            let want = if crate::arenad::reload::applies(key) {
                Reload::Applied
            } else {
                Reload::Restart
            };
            assert_eq!(e.reload, want, "{key}");
        }
        assert_eq!(
            flat.len(),
            KEYS.len(),
            "a key of the manual the config did not set"
        );
        let applied: Vec<&str> = entries
            .iter()
            .filter(|e| e.reload == Reload::Applied)
            .map(|e| e.key)
            .collect();
        assert_eq!(
            applied,
            [
                "log_level",
                "volume.name",
                "volume.secret_file",
                "volume.quota",
                "volume.confidential"
            ]
        );
    }
}
