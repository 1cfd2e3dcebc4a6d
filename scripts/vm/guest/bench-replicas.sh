#!/usr/bin/env bash
# Benchmark (not a test): replicated devices on the real kernel, one boot.
# Three devices served at once by one ublkd, on N = 1, 2, 3 of three arenad
# on loopback (a real etcd holds the memberships of N = 2, 3), fio on each
# /dev/ublkbN with the jobs interleaved per job (so a slow stretch of the
# host hits every N alike); prints IOPS / MiB/s and p99 per N with the
# N/N=1 ratios. Then the failover pause: a 4 KiB QD1 writer on the N=2
# device, one of its arenad killed (`kill -9`), the time from the kill to
# the next completed write (fio's per-I/O log, Unix ms).
# Run by scripts/bench-replicas. Env: BENCH_RUNTIME (s per job, default
# 10), BENCH_SIZE (per device, default 64M), BENCH_HEDGE_US (hedge_after_us,
# default 500000).
set -u

BIN=${UBLK_E2E_BIN:-${UBLK_VM_REPO:-$PWD}/target/release}
R=${UBLK_VM_RESULTS:-/tmp/bench-replicas-results}
W=$(mktemp -d /tmp/ublk-bench-rep.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNTIME=${BENCH_RUNTIME:-10}
SIZE=${BENCH_SIZE:-64M}
PEERS=(127.0.0.1:7071 127.0.0.1:7072 127.0.0.1:7073)
ETCD=127.0.0.1:2379
declare -a ARENAD_PIDS=()
mkdir -p "$R" "$W"/{state,run,etcd}
# Swap on the emulated NVMe disk (the guest tmpfs cannot hold three swap
# files); the arenas hold every device, so the jobs measure RAM, not swap.
swap_disk "$W/swap" || { echo "bench: no NVMe disk for swap"; exit 1; }

printf 'bench-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
for i in 0 1 2; do
    mkdir -p "$W/swap/$i"
    cat >"$W/arenad$i.toml" <<TOML
listen = "${PEERS[$i]}"
arena_bytes = "256M"
blob_bytes = "256K"
swap_dir = "$W/swap/$i"
swap_bytes = "512M"
metrics_listen = "off"
[[volume]]
name = "n1"
secret_file = "$W/vol.key"
quota = "1G"
[[volume]]
name = "n2"
secret_file = "$W/vol.key"
quota = "1G"
[[volume]]
name = "n3"
secret_file = "$W/vol.key"
quota = "1G"
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
# Hedge only reads slower than TCG's tail: at the default 2 ms nearly every
# read of the emulated guest (median ~14 ms) would go to two members, and
# "reads equal" would measure the hedge's doubled CPU, not replication.
hedge_after_us = ${BENCH_HEDGE_US:-500000}
change_deadline_ms = 30000
coord_timeout_ms = 5000
TOML
cleanup() {
    [[ -n "${UBLKD_PID:-}" ]] && { kill "$UBLKD_PID"; wait "$UBLKD_PID"; } 2>/dev/null
    for p in "${ARENAD_PIDS[@]}" "${ETCD_PID:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    mountpoint -q "$W/swap" && umount "$W/swap"
}
trap cleanup EXIT

start_etcd "$ETCD" "$W/etcd/data" "$R/etcd.log" || { echo "bench: etcd did not start; see etcd.log"; exit 1; }
for i in 0 1 2; do
    "$BIN/arenad" --config "$W/arenad$i.toml" >"$R/arenad$i.log" 2>&1 &
    ARENAD_PIDS[$i]=$!
    wait_listen "${PEERS[$i]##*:}" "${ARENAD_PIDS[$i]}" || { echo "bench: arenad $i did not start"; exit 1; }
done
start_ublkd "$R/ublkd.log" || { echo "bench: ublkd did not start; see ublkd.log"; exit 1; }

declare -A DEVS=() IDS=()
for n in 1 2 3; do
    peers=()
    for i in $(seq 0 $((n - 1))); do peers+=(--peer "${PEERS[$i]}"); done
    d=$(add_when_etcd --wait "${peers[@]}" --volume "n$n" --secret-file "$W/vol.key" --size "$SIZE" --transport tcp) ||
        { echo "bench: add N=$n failed"; exit 1; }
    DEVS[$n]=$d; IDS[$n]=${d#/dev/ublkb}
    # Fill it, so reads move real payloads (an unwritten blob reads as zeros without one).
    timeout 600 fio --name=fill --filename="$d" --direct=1 --ioengine=libaio --rw=write --bs=1M \
        --iodepth=8 --size="$SIZE" --output=/dev/null || { echo "bench: fill N=$n failed"; exit 1; }
done
ctl list

JOBS=(
    "randwrite-4k-qd1 --rw=randwrite --bs=4k --iodepth=1"
    "randwrite-4k-qd32 --rw=randwrite --bs=4k --iodepth=32"
    "randread-4k-qd1 --rw=randread --bs=4k --iodepth=1"
    "randread-4k-qd32 --rw=randread --bs=4k --iodepth=32"
    "write-1m-qd8 --rw=write --bs=1M --iodepth=8"
)
for job in "${JOBS[@]}"; do
    read -r name args <<<"$job"
    for n in 1 2 3; do
        # shellcheck disable=SC2086
        timeout $((RUNTIME * 6 + 120)) fio --name="$name" --filename="${DEVS[$n]}" --direct=1 \
            --ioengine=libaio --time_based --runtime="$RUNTIME" --ramp_time=1 --size="$SIZE" \
            $args --output-format=json --output="$R/$name-n$n.json" || echo "bench: $name on N=$n failed"
    done
done

python3 - "$R" "${JOBS[@]}" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(name, n):
    try:
        j = json.load(open(os.path.join(out, f"{name}-n{n}.json")))["jobs"][0]
    except Exception:
        return None
    side = j["read"] if j["read"]["io_bytes"] > 0 else j["write"]
    p99 = side["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1000.0
    return side["iops"], side["bw_bytes"] / 2**20, p99
print(f"{'job':<18} {'N=1':>22} {'N=2':>22} {'N=3':>22} {'N2/N1':>6} {'N3/N1':>6}")
for spec in sys.argv[2:]:
    name = spec.split()[0]
    r = [load(name, n) for n in (1, 2, 3)]
    if not all(r):
        print(f"{name:<18} (missing result)")
        continue
    mb = name.startswith("write-1m")
    val = [x[1] if mb else x[0] for x in r]
    unit = "MiB/s" if mb else "IOPS"
    cells = [f"{v:.1f} {unit} p99 {x[2]:.0f}us" if mb else f"{v:.0f} {unit} p99 {x[2]:.0f}us" for v, x in zip(val, r)]
    print(f"{name:<18} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} {val[1] / val[0]:>6.2f} {val[2] / val[0]:>6.2f}")
PY

# ---- failover pause: kill -9 of a member under a QD1 writer (N=2) --------
# The pause is the time from the kill to the completion of the first write
# issued after it (issue = completion - total latency, from fio's per-I/O
# lat log): that write needs the removal recorded in etcd before it is
# acknowledged. A write already acknowledged by both members when the kill
# lands would otherwise count as "completed after the kill".
timeout 300 fio --name=failover --filename="${DEVS[2]}" --direct=1 --ioengine=libaio --rw=randwrite \
    --bs=4k --iodepth=1 --time_based --runtime=$((RUNTIME + 8)) --size="$SIZE" \
    --write_lat_log="$W/failover" --log_avg_msec=0 --log_unix_epoch=1 --output="$R/failover.txt" &
FIO=$!
# fio under TCG takes seconds to start: kill once the device has completed
# 50 writes (its /sys stat; fio's lat log is written in chunks, at a low
# write rate only when fio exits, which let the last run kill too late).
writes() { awk '{print $5}' "/sys/block/${DEVS[2]#/dev/}/stat"; }
base=$(writes)
for _ in $(seq 600); do
    (($(writes) - base >= 50)) && break
    kill -0 "$FIO" 2>/dev/null || break
    sleep 0.1
done
kill_ms=$(date +%s%3N)
kill -9 "${ARENAD_PIDS[1]}"; wait "${ARENAD_PIDS[1]}" 2>/dev/null; ARENAD_PIDS[1]=
wait "$FIO"; fio_rc=$?
cp "$W"/failover_lat.1.log "$R/" 2>/dev/null
python3 - "$W/failover_lat.1.log" "$kill_ms" "$fio_rc" "$(replica_fact "${IDS[2]}" states)" <<'PY'
import sys
log, kill, rc, states = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ios = sorted((int(l.split(",")[0]), int(l.split(",")[1]) / 1e6) for l in open(log) if l.strip())
after = [(done, lat) for done, lat in ios if done - lat >= kill]
before = [done for done, _ in ios if done < kill]
print(f"failover (N=2, 4 KiB QD1 writes, kill -9 of a member): fio rc {rc}, states after: {states}")
if after:
    lats = sorted(lat for _, lat in ios)
    print(f"  kill -> completion of the first write issued after it: {after[0][0] - kill} ms "
          f"(that write's latency {after[0][1]:.0f} ms; run's median write latency {lats[len(lats) // 2]:.0f} ms, max {lats[-1]:.0f} ms)")
    print(f"  {len(before)} writes completed before the kill, {len(after)} issued after")
else:
    print("  no write issued after the kill completed")
PY
