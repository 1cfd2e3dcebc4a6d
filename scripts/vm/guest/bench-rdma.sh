#!/usr/bin/env bash
# Benchmark (not a test): fio on /dev/ublkbN over RDMA and over TCP in the
# same boot, same arenad, interleaved per job; prints IOPS, bandwidth and
# p99 completion latency side by side with the RDMA/TCP ratio.
# Run by scripts/bench-rdma (in the VM, or directly on a host that has ublk).
# Uses a real RDMA device when one exists; otherwise sets up soft-RoCE
# (rxe on lo). Env: BENCH_RUNTIME (s per job, default 10), BENCH_SIZE (64M).
set -u

BIN=${UBLK_E2E_BIN:-${UBLK_VM_REPO:-$PWD}/target/release}
R=${UBLK_VM_RESULTS:-/tmp/bench-rdma-results}
W=$(mktemp -d /tmp/ublk-bench-rdma.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNTIME=${BENCH_RUNTIME:-10}
SIZE=${BENCH_SIZE:-64M}
mkdir -p "$R" "$W"/{state,arena,run}

rdma_device || exit 1

printf 'bench-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
cat >"$W/arenad.toml" <<TOML
listen = "127.0.0.1:7070"
arena_bytes = "320M"
blob_bytes = "1M"
swap_dir = "$W/arena"
swap_bytes = "1G"
metrics_listen = "off"
rdma = "on"
rdma_device = "$RDMA_DEV"
rdma_gid_index = $GID
[[volume]]
name = "rdma"
secret_file = "$W/vol.key"
quota = "1G"
[[volume]]
name = "tcp"
secret_file = "$W/vol.key"
quota = "1G"
TOML
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
on_shutdown = "remove"
[device]
queues = 1
depth = 64
io_buf = "1M"
[metrics]
listen = "off"
[rdma]
device = "$RDMA_DEV"
gid_index = $GID
TOML
"$BIN/arenad" --config "$W/arenad.toml" >"$R/arenad.log" 2>&1 &
ARENAD=$!
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/7070) 2>/dev/null && break; sleep 0.1; done
start_ublkd "$R/ublkd.log" || { echo "bench: ublkd did not start; see $R/ublkd.log"; kill $ARENAD; exit 1; }
trap 'kill $UBLKD_PID; sleep 1; kill $ARENAD; wait' EXIT

declare -A DEVS=()
for t in rdma tcp; do
    d=$(ctl add --peer 127.0.0.1:7070 --volume "$t" --secret-file "$W/vol.key" --size "$SIZE" --transport "$t") || exit 1
    wait_node "$d" || exit 1
    DEVS[$t]=$d
    # Fill it, so reads move real payloads (an unwritten blob reads as zeros without one).
    timeout 600 fio --name=fill --filename="$d" --direct=1 --ioengine=libaio --rw=write --bs=1M \
        --iodepth=8 --size="$SIZE" --output=/dev/null || exit 1
done
ctl list

JOBS=(
    "randread-4k-qd1 --rw=randread --bs=4k --iodepth=1"
    "randread-4k-qd32 --rw=randread --bs=4k --iodepth=32"
    "randwrite-4k-qd1 --rw=randwrite --bs=4k --iodepth=1"
    "randwrite-4k-qd32 --rw=randwrite --bs=4k --iodepth=32"
    "read-1m-qd4 --rw=read --bs=1M --iodepth=4"
    "write-1m-qd4 --rw=write --bs=1M --iodepth=4"
)
for job in "${JOBS[@]}"; do
    read -r name args <<<"$job"
    for t in rdma tcp; do
        # shellcheck disable=SC2086
        timeout $((RUNTIME * 6 + 120)) fio --name="$name" --filename="${DEVS[$t]}" --direct=1 \
            --ioengine=libaio --time_based --runtime="$RUNTIME" --ramp_time=1 --size="$SIZE" \
            $args --output-format=json --output="$R/$name-$t.json" || echo "bench: $name on $t failed"
    done
done
ctl stats >"$R/stats.txt" 2>&1

python3 - "$R" "${JOBS[@]}" <<'PY'
import json, sys, os
out = sys.argv[1]
rows = []
def load(name, t):
    try:
        j = json.load(open(os.path.join(out, f"{name}-{t}.json")))["jobs"][0]
    except Exception:
        return None
    side = j["read"] if j["read"]["io_bytes"] > 0 else j["write"]
    p99 = side["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1000.0
    return side["iops"], side["bw_bytes"] / 2**20, p99
def ratio(a, b):
    return f"{a / b:.2f}" if b else "-"
print(f"{'job':<20} {'RDMA IOPS':>10} {'TCP IOPS':>10} {'ratio':>6} {'RDMA MiB/s':>11} {'TCP MiB/s':>10} {'ratio':>6} {'RDMA p99 us':>12} {'TCP p99 us':>11} {'ratio':>6}")
for spec in sys.argv[2:]:
    name = spec.split()[0]
    r, t = load(name, "rdma"), load(name, "tcp")
    if not r or not t:
        print(f"{name:<20} (missing result)")
        continue
    print(f"{name:<20} {r[0]:>10.0f} {t[0]:>10.0f} {ratio(r[0], t[0]):>6} {r[1]:>11.1f} {t[1]:>10.1f} {ratio(r[1], t[1]):>6} {r[2]:>12.0f} {t[2]:>11.0f} {ratio(r[2], t[2]):>6}")
PY
echo "--- data path (ublkctl stats) ---"
grep -E "data path|warning|  rdma_|  tcp_" "$R/stats.txt"
