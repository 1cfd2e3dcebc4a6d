#!/usr/bin/env bash
# Benchmark (not a test): 4 KiB random reads of cold blobs at QD32 through a
# real /dev/ublkbN (TCP or RDMA, one queue), against fio 4 KiB random reads
# at QD32 on the same emulated NVMe disk, same boot. Run by scripts/bench-swap.
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
# BENCH_ROUNDS for the arena benchmark, BENCH_TRANSPORT (the device's
# transport: tcp, the default, or rdma, or "tcp rdma" for both one after the
# other, each on a fresh swap_dir and device). rdma is soft-RoCE (rxe0 on lo,
# GID index 1) as in bench-rdma.sh, or a real RDMA device when one exists; the
# device is added with --transport rdma (no TCP fallback) and must list as
# rdma; around its cold and resident jobs the script prints the deltas of
# ublkd's ublk_driver_tcp_payload_requests_total{driver="rdma"} by reason, of
# ublk_driver_rdma_transferred_total and of arenad's swap read bytes (the
# counters include fio's 2 s ramp, the IOPS do not). BENCH_PROMOTE_COLD_AFTER
# sets arenad's promote_cold_after (default: arenad's own).
set -u

BIN=${UBLK_E2E_BIN:-${UBLK_VM_REPO:-$PWD}/target/release}
R=${UBLK_VM_RESULTS:-/tmp/bench-swap-results}
W=$(mktemp -d /tmp/ublk-bench-swap.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNTIME=${BENCH_RUNTIME:-20}
SIZE_MIB=${BENCH_SIZE:-128M}
SIZE_MIB=${SIZE_MIB%M}
TRANSPORTS=${BENCH_TRANSPORT:-tcp}
mkdir -p "$R" "$W"/{state,run}
for t in $TRANSPORTS; do
    [[ $t == tcp || $t == rdma ]] || { echo "bench: BENCH_TRANSPORT: tcp, rdma or \"tcp rdma\", not $t"; exit 2; }
done
[[ -n "${TRANSPORTS// /}" ]] || { echo "bench: BENCH_TRANSPORT is empty"; exit 2; }

swap_disk "$W/nvme" || { echo "bench: no NVMe disk"; exit 1; }
printf 'bench-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"

# RDMA: a real device when one exists, else soft-RoCE on lo (rdma_device).
RDMA_DEV=
UBLKD_METRICS=off
if [[ " $TRANSPORTS " == *" rdma "* ]]; then
    rdma_device || exit 1
    # ublkd's driver counters are read from its /metrics.
    UBLKD_METRICS=127.0.0.1:9477
fi
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
listen = "$UBLKD_METRICS"
${RDMA_DEV:+[rdma]}
${RDMA_DEV:+device = \"$RDMA_DEV\"}
${RDMA_DEV:+gid_index = $GID}
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

start_arenad() { # start_arenad BINARY SWAP_DIR TRANSPORT
    cat >"$W/arenad.toml" <<TOML
listen = "127.0.0.1:7070"
arena_bytes = "$((SIZE_MIB / 4))M"
blob_bytes = "1M"
swap_dir = "$2"
swap_bytes = "$((SIZE_MIB * 2))M"
metrics_listen = "127.0.0.1:9470"
${BENCH_PROMOTE_COLD_AFTER:+promote_cold_after = $BENCH_PROMOTE_COLD_AFTER}
$(if [[ $3 == rdma ]]; then
    printf 'rdma = "on"\nrdma_device = "%s"\nrdma_gid_index = %s\n' "$RDMA_DEV" "$GID"
else
    echo 'rdma = "off"'
fi)
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

# ublkd's RDMA driver counters (its /metrics): "rdma_transferred N" and
# "tcp_payload REASON N" lines, into file $1.
rdma_counters() {
    python3 - "$UBLKD_METRICS" >"$1" <<'PY'
import re, sys, urllib.request
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=30).read().decode()
for line in text.splitlines():
    m = re.match(r'^(\w+)\{([^}]*)\}\s+(\S+)', line)
    if not m:
        continue
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
    if labels.get("driver") != "rdma":
        continue
    if m[1] == "ublk_driver_rdma_transferred_total":
        print("rdma_transferred", int(float(m[3])))
    elif m[1] == "ublk_driver_tcp_payload_requests_total":
        print("tcp_payload", labels.get("reason", "-"), int(float(m[3])))
PY
}
# rail_connects: ublkd's ublk_driver_rail_connects_total{driver="rdma"}, the
# queue pairs brought up so far.
rail_connects() {
    python3 - "$UBLKD_METRICS" <<'PY'
import re, sys, urllib.request
n = 0
for line in urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=30).read().decode().splitlines():
    if re.match(r'^ublk_driver_rail_connects_total\{[^}]*driver="rdma"', line):
        n += int(float(line.split()[-1]))
print(n)
PY
}
# rdma_delta BEFORE AFTER SWAP_FILE: one line, the deltas between two
# rdma_counters files and the swap bytes read during the job.
rdma_delta() {
    python3 - "$@" <<'PY'
import sys
def load(path):
    tcp, xfer = {}, 0
    try:
        for line in open(path):
            f = line.split()
            if f[0] == "rdma_transferred":
                xfer += int(f[1])
            elif f[0] == "tcp_payload":
                tcp[f[1]] = tcp.get(f[1], 0) + int(f[2])
    except (OSError, IndexError, ValueError):
        return None
    return tcp, xfer
b, a = load(sys.argv[1]), load(sys.argv[2])
try:
    swap = open(sys.argv[3]).read().strip()
except OSError:
    swap = "?"
if not a or not b:
    print(f"counters missing; swap bytes read {swap}")
    sys.exit()
reasons = sorted(set(a[0]) | set(b[0]))
by = [f"{r}={a[0].get(r, 0) - b[0].get(r, 0)}" for r in reasons if a[0].get(r, 0) - b[0].get(r, 0)]
print(f"TCP payload requests by reason: {' '.join(by) or 'none'}; "
      f"RDMA transfers {a[1] - b[1]}; swap bytes read {swap}")
PY
}

start_ublkd "$R/ublkd.log" || { echo "bench: ublkd did not start; see $R/ublkd.log"; exit 1; }
# is_rdma DEV: `ublkctl list` shows the device on the RDMA transport.
is_rdma() {
    ctl list | tee -a "$R/list.txt" | awk -v id="${1#/dev/ublkb}" '$1 == id && $NF == "rdma" { ok = 1 } END { exit !ok }'
}
run_arenad() { # run_arenad NAME BINARY TRANSPORT
    # Results are named NAME for tcp (as before), NAME-rdma for rdma.
    local key=$1
    [[ $3 == rdma ]] && key=$1-rdma
    local swap=$W/nvme/$key
    start_arenad "$2" "$swap" "$3" || { echo "bench: arenad $key did not start"; return 1; }
    local dev
    dev=$(ctl add --peer 127.0.0.1:7070 --volume swap --secret-file "$W/vol.key" --size "${SIZE_MIB}M" --transport "$3") ||
        { echo "bench: ublkctl add ($key, --transport $3) failed"; return 1; }
    wait_node "$dev" || return 1
    if [[ $3 == rdma ]] && ! is_rdma "$dev"; then echo "bench: $dev ($key) is not on RDMA"; return 1; fi
    timeout 900 dd if=/dev/urandom of="$dev" bs=1M count="$SIZE_MIB" oflag=direct conv=fsync status=none || return 1
    local rails=0
    [[ $3 == rdma ]] && rails=$(rail_connects)
    # A restart empties the arena: every blob is in swap when the reads start.
    kill "$ARENAD_PID"; wait "$ARENAD_PID" 2>/dev/null
    start_arenad "$2" "$swap" "$3" || { echo "bench: arenad $key did not restart"; return 1; }
    # The queue reconnects on its next request.
    timeout 300 dd if="$dev" of=/dev/null bs=4k count=1 iflag=direct status=none
    # Its queue pair may come up only seconds later (a rail set up while the
    # control connection reconnects is retried): until then payloads go over
    # TCP (qp_error), so the cold job waits for it.
    if [[ $3 == rdma ]]; then
        for _ in $(seq 120); do
            (($(rail_connects) > rails)) && break
            sleep 0.5
            timeout 60 dd if="$dev" of=/dev/null bs=4k count=1 iflag=direct status=none
        done
        (($(rail_connects) > rails)) || echo "bench: $key: no RDMA queue pair 60 s after the arenad restart"
    fi
    if [[ $3 == rdma ]] && ! is_rdma "$dev"; then echo "bench: $dev ($key) is not on RDMA after the restart"; return 1; fi
    local before
    if [[ $3 == rdma ]]; then
        before=$(swap_read_bytes)
        rdma_counters "$R/ublk-$key.before"
    fi
    randread "ublk-$key" "$dev"
    if [[ $3 == rdma ]]; then
        rdma_counters "$R/ublk-$key.after"
        echo $(($(swap_read_bytes) - before)) >"$R/ublk-$key.swap"
    fi
    # The same device, ublkd and arenad with the blobs resident: the first
    # eighth of the device (half the arena) read whole once, 1 MiB reads
    # that fault each blob in, then random 4 KiB reads over just that
    # range. What the ublk path itself delivers here, with no disk read.
    timeout 900 dd if="$dev" of=/dev/null bs=1M count=$((SIZE_MIB / 8)) iflag=direct status=none
    before=$(swap_read_bytes)
    [[ $3 == rdma ]] && rdma_counters "$R/ublk-$key-resident.before"
    randread "ublk-$key-resident" "$dev" "$((SIZE_MIB / 8))M"
    [[ $3 == rdma ]] && rdma_counters "$R/ublk-$key-resident.after"
    # Proof that the range stayed resident: swap bytes read during the job.
    echo $(($(swap_read_bytes) - before)) >"$R/ublk-$key-resident.swap"
    [[ $3 == rdma ]] && ctl stats "${dev#/dev/ublkb}" >"$R/stats-$key.txt" 2>&1
    ctl del "${dev#/dev/ublkb}" >/dev/null
    kill "$ARENAD_PID"; wait "$ARENAD_PID" 2>/dev/null; ARENAD_PID=
}
for t in $TRANSPORTS; do
    run_arenad this "$BIN/arenad" "$t"
    [[ -n "${BENCH_BASELINE_ARENAD:-}" ]] && run_arenad baseline "$BENCH_BASELINE_ARENAD" "$t"
done

read -r disk disk_p99 <<<"$(summary "$R/nvme-file.json")"
echo "4 KiB random reads, QD32, ${RUNTIME}s each, emulated NVMe, device ${SIZE_MIB}M = 4x the arena, all blobs in swap:"
printf '%-34s %8s %10s %8s\n' "what" "IOPS" "p99 us" "ratio"
printf '%-34s %8s %10s %8s\n' "fio on a file on the NVMe ext4" "$disk" "$disk_p99" "1.00"
for t in $TRANSPORTS; do
for name in this baseline; do
    key=$name what="ublk, arenad ($name build)" build="$name build"
    [[ $t == rdma ]] && key=$name-rdma what="ublk RDMA, arenad ($name build)" build="$name build, rdma"
    [[ -f "$R/ublk-$key.json" ]] || continue
    read -r iops p99 <<<"$(summary "$R/ublk-$key.json")"
    printf '%-34s %8s %10s %8s\n' "$what" "$iops" "$p99" "$(python3 -c "print(f'{$iops / $disk:.2f}')")"
    [[ $t == rdma ]] && echo "  cold job: $(rdma_delta "$R/ublk-$key".{before,after,swap})"
    [[ -f "$R/ublk-$key-resident.json" ]] || continue
    read -r res res_p99 <<<"$(summary "$R/ublk-$key-resident.json")"
    printf '%-34s %8s %10s %8s\n' "  same device, blobs resident" "$res" "$res_p99" "$(python3 -c "print(f'{$res / $disk:.2f}')")"
    [[ $t == rdma ]] && echo "  resident job: $(rdma_delta "$R/ublk-$key-resident".{before,after,swap})"
    echo "  cold / resident, $build: $(python3 -c "print(f'{$iops / $res:.2f}')")" \
        "(swap bytes read during the resident job: $(cat "$R/ublk-$key-resident.swap" 2>/dev/null))"
done
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
