#!/usr/bin/env bash
# Benchmark (not a test): a member of an N=2 device rebuilt under guest
# load, run inside the VM by scripts/bench-rebuild. A real etcd and two
# arenad on loopback (swap on the NVMe disk), the device filled by a 1 MiB
# QD8 sequential write (its own write rate: the baseline), then a 4 KiB
# QD1 random writer for BENCH_RUNTIME s (the latency baseline); then one
# arenad killed (`kill -9`), a write to fail it, restarted, and the same
# QD1 writer run for exactly as long as the rebuild runs. Prints both
# rates, both latencies and their ratios. BENCH_YIELD_ABOVE sets
# [replication] rebuild_yield_above (default: ublkd's).
set -u

BIN=${UBLK_E2E_BIN:-${UBLK_VM_REPO:-$PWD}/target/release}
R=${UBLK_VM_RESULTS:-/tmp/bench-rebuild-results}
W=$(mktemp -d /tmp/ublk-bench-rb.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
SIZE=${BENCH_SIZE:-1G}
RUNTIME=${BENCH_RUNTIME:-20}
PEERS=(127.0.0.1:7071 127.0.0.1:7072)
ETCD=127.0.0.1:2379
declare -a ARENAD_PIDS=()
mkdir -p "$R" "$W"/{state,run,etcd}
swap_disk "$W/swap" || { echo "bench: no NVMe disk for swap"; exit 1; }

printf 'bench-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
for i in 0 1; do
    mkdir -p "$W/swap/$i"
    cat >"$W/arenad$i.toml" <<TOML
listen = "${PEERS[$i]}"
arena_bytes = "256M"
blob_bytes = "256K"
swap_dir = "$W/swap/$i"
swap_bytes = "1536M"
metrics_listen = "off"
[[volume]]
name = "rb"
secret_file = "$W/vol.key"
quota = "2G"
TOML
done
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
on_shutdown = "remove"
request_timeout_ms = 20000
[device]
queues = 1
depth = 64
io_buf = "1M"
[metrics]
listen = "off"
[etcd]
endpoints = ["http://$ETCD"]
request_timeout_ms = 5000
dial_timeout_ms = 5000
lease_ttl_secs = 15
[replication]
hedge_after_us = 500000
change_deadline_ms = 30000
coord_timeout_ms = 5000
rebuild_check_ms = 500
${BENCH_YIELD_ABOVE:+rebuild_yield_above = $BENCH_YIELD_ABOVE}
TOML
cleanup() {
    [[ -n "${FIO_PID:-}" ]] && kill "$FIO_PID" 2>/dev/null
    [[ -n "${UBLKD_PID:-}" ]] && { kill "$UBLKD_PID"; wait "$UBLKD_PID"; } 2>/dev/null
    for p in "${ARENAD_PIDS[@]}" "${ETCD_PID:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    mountpoint -q "$W/swap" && umount "$W/swap"
}
trap cleanup EXIT
# fio_json FILE FIELD: the write bandwidth (bw, bytes/s), mean latency
# (lat, ns), writes done (ios) or fio's error (error) of FILE's job.
fio_json() {
    /usr/bin/python3 -c '
import json, sys
text = open(sys.argv[1]).read()
# fio stopped by SIGINT writes a line before its JSON.
j = json.loads(text[text.index("{"):])["jobs"][0]
w = j["write"]
print({"bw": w["bw_bytes"], "lat": w["lat_ns"]["mean"], "ios": w["total_ios"], "error": j["error"]}[sys.argv[2]])' "$1" "$2"
}

start_etcd "$ETCD" "$W/etcd/data" "$R/etcd.log" || { echo "bench: etcd did not start"; exit 1; }
for i in 0 1; do start_peer "$i" || { echo "bench: arenad $i did not start"; exit 1; }; done
start_ublkd "$R/ublkd.log" || { echo "bench: ublkd did not start"; exit 1; }
DEV=$(add_when_etcd --wait --peer "${PEERS[0]}" --peer "${PEERS[1]}" --volume rb --secret-file "$W/vol.key" \
    --size "$SIZE" --transport tcp) || { echo "bench: add failed"; exit 1; }
ID=${DEV#/dev/ublkb}
rep() { replica_fact "$ID" "$1"; }

# Baseline 1: the device's own sequential write rate (and every blob exists).
timeout 1800 fio --name=seq --filename="$DEV" --direct=1 --ioengine=libaio --rw=write --bs=1M \
    --iodepth=8 --size="$SIZE" --output-format=json --output="$R/seq-write.json" ||
    { echo "bench: sequential write failed"; exit 1; }
# Baseline 2: 4 KiB QD1 random writes without a rebuild.
QD1=(--name=qd1 --filename="$DEV" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k --iodepth=1 --output-format=json)
timeout 600 fio "${QD1[@]}" --runtime="$RUNTIME" --time_based --output="$R/qd1-idle.json" ||
    { echo "bench: QD1 baseline failed"; exit 1; }

# The member out and back: killed, failed by a write, restarted.
kill -9 "${ARENAD_PIDS[1]}"; wait "${ARENAD_PIDS[1]}" 2>/dev/null
dd if=/dev/zero of="$DEV" bs=4k count=1 oflag=direct conv=notrunc status=none
[[ "$(rep states)" == "healthy failed" ]] || { echo "bench: member not failed: $(rep states)"; exit 1; }
start_peer 1 || { echo "bench: arenad 1 did not restart"; exit 1; }
timeout 1800 fio "${QD1[@]}" --runtime=1800 --time_based --output="$R/qd1-rebuild.json" &
FIO_PID=$!
for _ in $(seq 600); do [[ "$(rep rebuild)" != none ]] && break; sleep 0.1; done
t0=$EPOCHREALTIME
# Until the member is healthy (a rebuild that fails is retried: counted).
for _ in $(seq 18000); do [[ "$(rep states)" == "healthy healthy" ]] && break; sleep 0.2; done
t1=$EPOCHREALTIME
kill -INT "$FIO_PID" 2>/dev/null; wait "$FIO_PID"; FIO_PID=
[[ "$(rep states)" == "healthy healthy" ]] || { echo "bench: rebuild did not complete: $(rep states)"; exit 1; }
attempts=$(grep -c 'event="rebuild.started"' "$R/ublkd.log")

bytes=$(numfmt --from=iec "$SIZE")
/usr/bin/python3 - "$bytes" "$t0" "$t1" "$(fio_json "$R/seq-write.json" bw)" \
    "$(fio_json "$R/qd1-idle.json" lat)" "$(fio_json "$R/qd1-rebuild.json" lat)" <<'PY' | tee "$R/summary.txt"
import sys
size, t0, t1, seq, idle, during = map(float, sys.argv[1:])
rate = size / (t1 - t0)
mib = 1 << 20
print(f"rebuild of {size / mib:.0f} MiB: {t1 - t0:.1f} s, {rate / mib:.1f} MiB/s")
print(f"device sequential write (1 MiB QD8): {seq / mib:.1f} MiB/s")
print(f"rebuild / sequential write: {rate / seq:.2f}x")
print(f"4 KiB QD1 write latency: {idle / 1e6:.2f} ms without a rebuild, {during / 1e6:.2f} ms during it: {during / idle:.2f}x")
PY
echo "rebuild attempts: $attempts; the QD1 writer during it: $(fio_json "$R/qd1-rebuild.json" ios) writes, fio error $(fio_json "$R/qd1-rebuild.json" error)" |
    tee -a "$R/summary.txt"
