#!/usr/bin/env bash
# Benchmark (not a test): one RDMA rail against two, in the same boot, on
# two soft-RoCE links each shaped to the same rate (so the links, not the
# emulated CPUs, are the bottleneck; docs/VM-TESTS.md, "Two RDMA links").
# One arenad serves rdma_rails = ["rxb0", "rxb1"]; ublkd "one" has
# [rdma] device = "rxa0", ublkd "two" has rails = ["rxa0", "rxa1"]; their
# devices take turns per job. Then the longest completion gap fio sees on
# the two-rail device when link 1 goes down mid-run.
# Run by scripts/bench-rails. Env: BENCH_RUNTIME (s per job, default 15),
# BENCH_RATE (tc rate per link, default 50mbit), BENCH_TRANSFER_TIMEOUT_MS
# (default 2000).
set -u

BIN=${UBLK_E2E_BIN:-${UBLK_VM_REPO:-$PWD}/target/release}
R=${UBLK_VM_RESULTS:-/tmp/bench-rails-results}
W=$(mktemp -d /tmp/ublk-bench-rails.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNTIME=${BENCH_RUNTIME:-15}
RATE=${BENCH_RATE:-50mbit}
TIMEOUT_MS=${BENCH_TRANSFER_TIMEOUT_MS:-2000}
SIZE=64M
mkdir -p "$R" "$W"/{arena,one/state,one/run,two/state,two/run}

two_rdma_links || exit 1
modprobe -d "$UBLK_VM_MODDIR" sch_tbf || { echo "bench: no sch_tbf module (UBLK_VM_EXTRA_MODULES=sch_tbf)"; exit 1; }
for d in a0 b0 a1 b1; do
    timeout 10 /usr/sbin/tc qdisc add dev $d root tbf rate "$RATE" burst 64kb latency 400ms || exit 1
done

printf 'bench-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
cat >"$W/arenad.toml" <<TOML
listen = "127.0.0.1:7070"
arena_bytes = "192M"
blob_bytes = "1M"
swap_dir = "$W/arena"
swap_bytes = "512M"
metrics_listen = "off"
rdma = "on"
rdma_rails = ["rxb0", "rxb1"]
rdma_gid_index = 1
[[volume]]
name = "one"
secret_file = "$W/vol.key"
quota = "1G"
[[volume]]
name = "two"
secret_file = "$W/vol.key"
quota = "1G"
TOML
for x in one two; do
    if [[ $x == one ]]; then rails='device = "rxa0"'; else rails='rails = ["rxa0", "rxa1"]'; fi
    cat >"$W/$x/ublkd.toml" <<TOML
state_dir = "$W/$x/state"
socket = "$W/$x/run/ublkd.sock"
on_shutdown = "remove"
request_timeout_ms = 30000
[device]
queues = 1
depth = 64
io_buf = "1M"
transport = "rdma"
[metrics]
listen = "off"
[rdma]
$rails
gid_index = 1
transfer_timeout_ms = $TIMEOUT_MS
TOML
done
"$BIN/arenad" --config "$W/arenad.toml" >"$R/arenad.log" 2>&1 &
ARENAD=$!
wait_listen 7070 $ARENAD || { echo "bench: arenad did not start"; exit 1; }
declare -A PIDS=() DEVS=()
for x in one two; do
    # (SOCK first: a prefix assignment sees the ones before it.)
    SOCK=$W/$x/run/ublkd.sock W=$W/$x start_ublkd "$R/ublkd-$x.log" ||
        { echo "bench: ublkd $x did not start"; exit 1; }
    PIDS[$x]=$UBLKD_PID
done
trap 'kill ${PIDS[*]}; sleep 2; kill $ARENAD; wait' EXIT
for x in one two; do
    d=$(SOCK=$W/$x/run/ublkd.sock ctl add --peer 127.0.0.1:7070 --volume "$x" \
        --secret-file "$W/vol.key" --size $SIZE) || exit 1
    wait_node "$d" || exit 1
    DEVS[$x]=$d
    # Fill it, so reads move real payloads.
    timeout 900 fio --name=fill --filename="$d" --direct=1 --ioengine=libaio --rw=write --bs=1M \
        --iodepth=8 --size=$SIZE --output=/dev/null || exit 1
    SOCK=$W/$x/run/ublkd.sock ctl show "${d#/dev/ublkb}" | grep -E '^  (transport|rail)' >"$R/show-$x.txt"
done
cat "$R"/show-*.txt

JOBS=(
    "read-1m-qd8 --rw=read --bs=1M --iodepth=8"
    "write-1m-qd8 --rw=write --bs=1M --iodepth=8"
    "randread-4k-qd32 --rw=randread --bs=4k --iodepth=32"
    "randwrite-4k-qd32 --rw=randwrite --bs=4k --iodepth=32"
)
# run_job DEV NAME ARGS...: prints "iops bw_bytes" of the job.
run_job() {
    local dev=$1 name=$2
    shift 2
    timeout $((RUNTIME * 4 + 120)) fio --name="$name" --filename="$dev" --direct=1 --ioengine=libaio \
        --time_based --runtime="$RUNTIME" --size=$SIZE --output-format=json "$@" --output="$W/job.json" ||
        return 1
    python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
io = j["read"] if j["read"]["io_bytes"] else j["write"]
print(round(io["iops"]), io["bw_bytes"])' "$W/job.json"
}
printf '%-20s %14s %14s %8s\n' job "one rail" "two rails" ratio | tee "$R/bench.txt"
for spec in "${JOBS[@]}"; do
    read -r name args <<<"$spec"
    # shellcheck disable=SC2086
    read -r i1 b1 <<<"$(run_job "${DEVS[one]}" "$name" $args)" || { echo "bench: $name failed"; exit 1; }
    # shellcheck disable=SC2086
    read -r i2 b2 <<<"$(run_job "${DEVS[two]}" "$name" $args)" || { echo "bench: $name failed"; exit 1; }
    if [[ $name == *1m* ]]; then
        a=$(python3 -c "print(f'{$b1 / 1048576:.1f} MiB/s')"); b=$(python3 -c "print(f'{$b2 / 1048576:.1f} MiB/s')")
        ratio=$(python3 -c "print(f'{$b2 / max($b1, 1):.2f}x')")
    else
        a="$i1 IOPS"; b="$i2 IOPS"
        ratio=$(python3 -c "print(f'{$i2 / max($i1, 1):.2f}x')")
    fi
    printf '%-20s %14s %14s %8s\n' "$name" "$a" "$b" "$ratio" | tee -a "$R/bench.txt"
done

# The longest completion gap when link 1 goes down under a 1 MiB read load
# on the two-rail device (fio's completion log, every I/O).
timeout 300 fio --name=gap --filename="${DEVS[two]}" --direct=1 --ioengine=libaio --rw=read \
    --bs=1M --iodepth=8 --time_based --runtime=24 --size=$SIZE \
    --write_lat_log="$W/gap" --log_avg_msec=0 --output="$R/fio-gap.txt" &
FIO=$!
sleep 8
timeout 10 /usr/sbin/ip link set a1 down
sleep 8
timeout 10 /usr/sbin/ip link set a1 up
link_routes 1
wait $FIO
gap=$(cat "$W"/gap_lat*.log | awk -F, '{ print $1 + 0 }' | sort -n |
    awk 'NR > 1 && $1 - p > g { g = $1 - p } { p = $1 } END { print g + 0 }')
# fio's latency log: completion time (ms), latency (ns), ...
longest=$(cat "$W"/gap_lat*.log | awk -F, '$2 > m { m = $2 } END { printf "%d", m / 1000000 }')
echo "link 1 down mid-run: longest completion gap $gap ms, longest request $longest ms (transfer_timeout_ms $TIMEOUT_MS)" |
    tee -a "$R/bench.txt"
SOCK=$W/two/run/ublkd.sock ctl show "${DEVS[two]#/dev/ublkb}" | grep -E '^  rail' | tee -a "$R/bench.txt"
echo "BENCH rails done: links shaped to $RATE each, $RUNTIME s per job"
