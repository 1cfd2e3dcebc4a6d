#!/usr/bin/env bash
# Benchmark (not a test): 4 KiB random reads of cold blobs at QD32 through a
# real /dev/ublkbN (TCP, one queue), against fio 4 KiB random reads at QD32
# on the same emulated NVMe disk, same boot. Run by scripts/bench-swap.
#
# arenad's swap_dir is an ext4 on the NVMe disk; the device is 4x the arena
# and written full, then arenad is restarted so that every blob starts in
# swap. The same device is then read with its blobs resident (a range that
# fits the arena, faulted in first): the ceiling the ublk path itself sets,
# so cold / resident is what swap costs. With BENCH_BASELINE_ARENAD set (an
# arenad binary of another build), the same run is repeated with it on a
# fresh swap_dir, for a before/after in one boot. With BENCH_ARENA_BIN (the
# arena benchmark's executable), its cold-read case runs too, swap dir on
# the same disk: the store with 32 reads in flight, against fio in the same
# boot. Env: BENCH_RUNTIME (s per job, default 20), BENCH_SIZE (device
# size, default 128M; the arena is a quarter of it), BENCH_SECS /
# BENCH_ROUNDS for the arena benchmark.
set -u

BIN=${UBLK_E2E_BIN:-${UBLK_VM_REPO:-$PWD}/target/release}
R=${UBLK_VM_RESULTS:-/tmp/bench-swap-results}
W=$(mktemp -d /tmp/ublk-bench-swap.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNTIME=${BENCH_RUNTIME:-20}
SIZE_MIB=${BENCH_SIZE:-128M}
SIZE_MIB=${SIZE_MIB%M}
mkdir -p "$R" "$W"/{state,run}

swap_disk "$W/nvme" || { echo "bench: no NVMe disk"; exit 1; }
printf 'bench-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
on_shutdown = "remove"
request_timeout_ms = 120000
[device]
queues = 1
depth = 64
io_buf = "1M"
[metrics]
listen = "off"
TOML

ARENAD_PID=
cleanup() {
    [[ -n "${UBLKD_PID:-}" ]] && kill "$UBLKD_PID" 2>/dev/null
    [[ -n "$ARENAD_PID" ]] && kill "$ARENAD_PID" 2>/dev/null
    wait 2>/dev/null
    umount "$W/nvme" 2>/dev/null
}
trap cleanup EXIT

# fio JSON -> "IOPS p99_us"
summary() {
    python3 - "$1" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]["read"]
p99 = j["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1000
print(f"{j['iops']:.0f} {p99:.0f}")
PY
}
randread() { # randread NAME FILE [SIZE]
    timeout $((RUNTIME * 4 + 300)) fio --name="$1" --filename="$2" ${3:+--size="$3"} --direct=1 \
        --ioengine=libaio --rw=randread --bs=4k --iodepth=32 --time_based --runtime="$RUNTIME" \
        --ramp_time=2 --randrepeat=0 --output-format=json --output="$R/$1.json" >/dev/null ||
        echo "bench: fio $1 failed" >&2
}

# The disk itself: a file on the same ext4.
randread nvme-file "$W/nvme/fio.bin" "${SIZE_MIB}M"
rm -f "$W/nvme/fio.bin"

start_arenad() { # start_arenad BINARY SWAP_DIR
    cat >"$W/arenad.toml" <<TOML
listen = "127.0.0.1:7070"
arena_bytes = "$((SIZE_MIB / 4))M"
blob_bytes = "1M"
swap_dir = "$2"
swap_bytes = "$((SIZE_MIB * 2))M"
metrics_listen = "127.0.0.1:9470"
rdma = "off"
[[volume]]
name = "swap"
secret_file = "$W/vol.key"
quota = "1G"
TOML
    "$1" --config "$W/arenad.toml" >>"$R/arenad.log" 2>&1 &
    ARENAD_PID=$!
    for _ in $(seq 300); do (exec 3<>/dev/tcp/127.0.0.1/7070) 2>/dev/null && return 0; sleep 0.1; done
    return 1
}

# arenad's swap bytes read so far (its metrics endpoint).
swap_read_bytes() {
    python3 - <<'PY'
import urllib.request
for line in urllib.request.urlopen("http://127.0.0.1:9470/metrics", timeout=30).read().decode().splitlines():
    if line.startswith("arenad_swap_read_bytes_total"):
        print(int(float(line.split()[-1])))
        break
else:
    print(0)
PY
}

start_ublkd "$R/ublkd.log" || { echo "bench: ublkd did not start; see $R/ublkd.log"; exit 1; }
run_arenad() { # run_arenad NAME BINARY
    local swap=$W/nvme/$1
    start_arenad "$2" "$swap" || { echo "bench: arenad $1 did not start"; return 1; }
    local dev
    dev=$(ctl add --peer 127.0.0.1:7070 --volume swap --secret-file "$W/vol.key" --size "${SIZE_MIB}M" --transport tcp) || return 1
    wait_node "$dev" || return 1
    timeout 900 dd if=/dev/urandom of="$dev" bs=1M count="$SIZE_MIB" oflag=direct conv=fsync status=none || return 1
    # A restart empties the arena: every blob is in swap when the reads start.
    kill "$ARENAD_PID"; wait "$ARENAD_PID" 2>/dev/null
    start_arenad "$2" "$swap" || { echo "bench: arenad $1 did not restart"; return 1; }
    # The queue reconnects on its next request.
    timeout 300 dd if="$dev" of=/dev/null bs=4k count=1 iflag=direct status=none
    randread "ublk-$1" "$dev"
    # The same device, ublkd and arenad with the blobs resident: the first
    # eighth of the device (half the arena) read whole once, 1 MiB reads
    # that fault each blob in, then random 4 KiB reads over just that
    # range. What the ublk path itself delivers here, with no disk read.
    timeout 900 dd if="$dev" of=/dev/null bs=1M count=$((SIZE_MIB / 8)) iflag=direct status=none
    local before
    before=$(swap_read_bytes)
    randread "ublk-$1-resident" "$dev" "$((SIZE_MIB / 8))M"
    # Proof that the range stayed resident: swap bytes read during the job.
    echo $(($(swap_read_bytes) - before)) >"$R/ublk-$1-resident.swap"
    ctl del "${dev#/dev/ublkb}" >/dev/null
    kill "$ARENAD_PID"; wait "$ARENAD_PID" 2>/dev/null; ARENAD_PID=
}
run_arenad this "$BIN/arenad"
[[ -n "${BENCH_BASELINE_ARENAD:-}" ]] && run_arenad baseline "$BENCH_BASELINE_ARENAD"

read -r disk disk_p99 <<<"$(summary "$R/nvme-file.json")"
echo "4 KiB random reads, QD32, ${RUNTIME}s each, emulated NVMe, device ${SIZE_MIB}M = 4x the arena, all blobs in swap:"
printf '%-34s %8s %10s %8s\n' "what" "IOPS" "p99 us" "ratio"
printf '%-34s %8s %10s %8s\n' "fio on a file on the NVMe ext4" "$disk" "$disk_p99" "1.00"
for name in this baseline; do
    [[ -f "$R/ublk-$name.json" ]] || continue
    read -r iops p99 <<<"$(summary "$R/ublk-$name.json")"
    printf '%-34s %8s %10s %8s\n' "ublk, arenad ($name build)" "$iops" "$p99" "$(python3 -c "print(f'{$iops / $disk:.2f}')")"
    [[ -f "$R/ublk-$name-resident.json" ]] || continue
    read -r res res_p99 <<<"$(summary "$R/ublk-$name-resident.json")"
    printf '%-34s %8s %10s %8s\n' "  same device, blobs resident" "$res" "$res_p99" "$(python3 -c "print(f'{$res / $disk:.2f}')")"
    echo "  cold / resident, $name build: $(python3 -c "print(f'{$iops / $res:.2f}')")" \
        "(swap bytes read during the resident job: $(cat "$R/ublk-$name-resident.swap" 2>/dev/null))"
done

# The store itself, many reads in flight: the arena benchmark's cold-read
# case (its own fio baseline) with its swap dir on the same disk.
if [[ -n "${BENCH_ARENA_BIN:-}" ]]; then
    kill "$UBLKD_PID" 2>/dev/null; wait "$UBLKD_PID" 2>/dev/null; UBLKD_PID=
    mkdir -p "$W/nvme/arena-bench"
    echo
    BENCH_ONLY=cold BENCH_ROUNDS=${BENCH_ROUNDS:-1} BENCH_SECS=${BENCH_SECS:-10} BENCH_DIR="$W/nvme/arena-bench" \
        timeout 1500 "$BENCH_ARENA_BIN" --bench 2>&1 | tee "$R/arena-cold.txt"
fi
