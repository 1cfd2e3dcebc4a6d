#!/usr/bin/env bash
# Benchmark (not a test), run by scripts/bench-latency in the VM or on a
# host with ublk_drv: the same fio jobs on null_blk, loop on tmpfs, kernel
# NBD -> nbdkit memory, libublk's `ramdisk` example (BENCH_RAMDISK_BIN, the
# ceiling of a ublk device with no network), and ublkd over TCP and RDMA,
# interleaved per job in one boot, and ublkd over TCP with a confidential
# volume (`sealed`: every frame sealed with AES-256-GCM, protocol version 3);
# prints a table, the ublkd/NBD and ublkd/loop ratios, sealed/tcp (what
# confidentiality costs) and the share of the ramdisk ceiling.
# Env: BENCH_RUNTIME (s per job, default 10), BENCH_SIZE (default 128M),
# BENCH_DEVICES (subset of "null loop nbd ramdisk tcp sealed rdma"), BENCH_PERF
# (1: ublkd and arenad during the ublkd QD1 jobs; system: the whole machine
# during every job on nbd, tcp, sealed and rdma),
# BENCH_BUSY_POLL_US / BENCH_LEASE_CACHE (busy_poll_us, [rdma] lease_cache of
# this build's ublkd),
# BENCH_BASELINE_BIN (a directory with another build's ublkd and ublkctl:
# a second ublkd serves devices tcp-base and rdma-base in the same boot,
# against the same arenad, so the two builds' ratios share every condition).
set -u

BIN=${UBLK_E2E_BIN:-${UBLK_VM_REPO:-$PWD}/target/release}
R=${UBLK_VM_RESULTS:-/tmp/bench-latency-results}
W=$(mktemp -d /tmp/ublk-bench-lat.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNTIME=${BENCH_RUNTIME:-10}
SIZE=${BENCH_SIZE:-128M}
WANT=" ${BENCH_DEVICES:-null loop nbd ramdisk tcp sealed rdma} "
# The ramdisk example takes the device id it is given; ublkd numbers its
# devices from 0.
RAMDISK_ID=9
mkdir -p "$R" "$W"/{state,arena,run}
log() { printf '%s bench: %s\n' "$(date +%T)" "$*" >&2; }
want() { [[ "$WANT" == *" $1 "* ]]; }
modload() {
    if [[ -n "${UBLK_VM_MODDIR:-}" ]]; then modprobe -d "$UBLK_VM_MODDIR" "$@"; else modprobe "$@"; fi
}
size_mib=$(numfmt --from=iec "$SIZE")
size_mib=$((size_mib / 1048576))

declare -A DEVS=()
PIDS=()
cleanup() {
    set +e
    [[ -n "${DEVS[nbd]:-}" ]] && nbd-client -d "${DEVS[nbd]}" >/dev/null 2>&1
    [[ -n "${DEVS[loop]:-}" ]] && losetup -d "${DEVS[loop]}"
    [[ -n "${DEVS[ramdisk]:-}" ]] && "$BENCH_RAMDISK_BIN" del "$RAMDISK_ID"
    [[ -n "${UBLKD_PID:-}" ]] && kill "$UBLKD_PID" && sleep 1
    [[ -n "${BASE_PID:-}" ]] && kill "$BASE_PID" && sleep 1
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    rm -f /dev/shm/bench-loop.img
}
trap cleanup EXIT

if want null; then
    if modload null_blk nr_devices=1 gb=1 memory_backed=1 queue_mode=2 irqmode=0 \
        submit_queues=1 hw_queue_depth=64 && [[ -b /dev/nullb0 ]]; then
        DEVS[null]=/dev/nullb0
    else
        log "null_blk unavailable"
    fi
fi
if want loop; then
    modload loop 2>/dev/null
    truncate -s "$SIZE" /dev/shm/bench-loop.img
    DEVS[loop]=$(losetup -f --show /dev/shm/bench-loop.img) || { log "losetup failed"; unset 'DEVS[loop]'; }
fi
if want nbd; then
    modload nbd nbds_max=1 2>/dev/null
    nbdkit --exit-with-parent -i 127.0.0.1 -p 10809 --foreground memory "$SIZE" >"$R/nbdkit.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/10809) 2>/dev/null && break; sleep 0.1; done
    if timeout 30 nbd-client -b 4096 127.0.0.1 10809 /dev/nbd0 >"$R/nbd-client.log" 2>&1; then
        DEVS[nbd]=/dev/nbd0
    else
        log "nbd-client failed: $(cat "$R/nbd-client.log")"
    fi
fi

if want ramdisk; then
    if [[ -x "${BENCH_RAMDISK_BIN:-}" ]] &&
        timeout 60 "$BENCH_RAMDISK_BIN" add "$RAMDISK_ID" "$size_mib" >"$R/ramdisk.log" 2>&1 &&
        wait_node "/dev/ublkb$RAMDISK_ID"; then
        DEVS[ramdisk]=/dev/ublkb$RAMDISK_ID
    else
        log "libublk ramdisk unavailable (BENCH_RAMDISK_BIN=${BENCH_RAMDISK_BIN:-}): $(tail -3 "$R/ramdisk.log" 2>/dev/null)"
    fi
fi
RDMA_DEV=
if want rdma; then
    rdma_device || RDMA_DEV=
fi
BASE=${BENCH_BASELINE_BIN:-}
VOLUMES=(tcp sealed rdma)
[[ -n "$BASE" ]] && VOLUMES+=(tcp-base rdma-base)
if want tcp || want sealed || [[ -n "$RDMA_DEV" ]]; then
    rdma_mode=off
    [[ -n "$RDMA_DEV" ]] && rdma_mode=on
    printf 'bench-volume-secret-0123456789abcdef\n' >"$W/vol.key"
    chmod 600 "$W/vol.key"
    # Arena large enough for every device, with a quarter spare: every job
    # runs resident, and the cleaner (which starts below an eighth clean or
    # free) stays idle, as it would on a host that is not short of memory.
    cat >"$W/arenad.toml" <<TOML
listen = "127.0.0.1:7070"
arena_bytes = "$((size_mib * ${#VOLUMES[@]} * 5 / 4 + 64))M"
blob_bytes = "1M"
swap_dir = "$W/arena"
swap_bytes = "$((size_mib * ${#VOLUMES[@]} * 2 + 128))M"
metrics_listen = "off"
rdma = "$rdma_mode"
${RDMA_DEV:+rdma_device = \"$RDMA_DEV\"}
${RDMA_DEV:+rdma_gid_index = $GID}
TOML
    for v in "${VOLUMES[@]}"; do
        printf '[[volume]]\nname = "%s"\nsecret_file = "%s"\nquota = "%s"\n' \
            "$v" "$W/vol.key" "$SIZE" >>"$W/arenad.toml"
    done
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
${RDMA_DEV:+[rdma]}
${RDMA_DEV:+device = \"$RDMA_DEV\"}
${RDMA_DEV:+gid_index = $GID}
TOML
    # The baseline build's ublkd: the same keys, its own state and socket
    # (this build's extra [rdma] keys only go to this build's ublkd).
    mkdir -p "$W/base/state" "$W/base/run"
    sed -e "s|$W/state|$W/base/state|; s|$SOCK|$W/base/run/ublkd.sock|" "$W/ublkd.toml" >"$W/base/ublkd.toml"
    [[ -n "${BENCH_BUSY_POLL_US:-}" ]] && sed -i "1i busy_poll_us = $BENCH_BUSY_POLL_US" "$W/ublkd.toml"
    if [[ -n "$RDMA_DEV" && -n "${BENCH_LEASE_CACHE:-}" ]]; then
        echo "lease_cache = $BENCH_LEASE_CACHE" >>"$W/ublkd.toml"
    fi
    "$BIN/arenad" --config "$W/arenad.toml" >"$R/arenad.log" 2>&1 &
    ARENAD=$!
    PIDS+=("$ARENAD")
    for _ in $(seq 300); do
        (exec 3<>/dev/tcp/127.0.0.1/7070) 2>/dev/null && break
        kill -0 "$ARENAD" 2>/dev/null || { log "arenad exited: $(tail -3 "$R/arenad.log")"; exit 1; }
        sleep 0.1
    done
    start_ublkd "$R/ublkd.log" || { log "ublkd did not start; see $R/ublkd.log"; exit 1; }
    for t in tcp sealed rdma; do
        want "$t" || continue
        [[ $t = rdma && -z "$RDMA_DEV" ]] && continue
        how=(--transport "$t")
        [[ $t = sealed ]] && how=(--transport tcp --confidential)
        if d=$(ctl add --peer 127.0.0.1:7070 --volume "$t" --secret-file "$W/vol.key" --size "$SIZE" "${how[@]}") &&
            wait_node "$d"; then
            DEVS[$t]=$d
        else
            log "ublkd $t device failed"
        fi
    done
    ctl list
    if [[ -n "$BASE" ]]; then
        bctl() { timeout 180 "$BASE/ublkctl" --socket "$W/base/run/ublkd.sock" "$@"; }
        RUST_LOG=${RUST_LOG:-info} "$BASE/ublkd" --config "$W/base/ublkd.toml" >>"$R/ublkd-base.log" 2>&1 &
        BASE_PID=$!
        for _ in $(seq 900); do bctl list >/dev/null 2>&1 && break; sleep 0.1; done
        for t in tcp rdma; do
            want "$t" || continue
            [[ $t = rdma && -z "$RDMA_DEV" ]] && continue
            if d=$(bctl add --peer 127.0.0.1:7070 --volume "$t-base" --secret-file "$W/vol.key" --size "$SIZE" --transport "$t") &&
                wait_node "$d"; then
                DEVS[$t-base]=$d
            else
                log "baseline ublkd $t device failed; see $R/ublkd-base.log"
            fi
        done
        bctl list
    fi
fi

ORDER=()
for d in null loop nbd ramdisk tcp sealed rdma tcp-base rdma-base; do [[ -n "${DEVS[$d]:-}" ]] && ORDER+=("$d"); done
log "devices: $(for d in "${ORDER[@]}"; do printf '%s=%s ' "$d" "${DEVS[$d]}"; done)"
for d in "${ORDER[@]}"; do
    # Prefill, so reads move real payloads (an unwritten blob reads as zeros without one).
    timeout 900 fio --name=fill --filename="${DEVS[$d]}" --direct=1 --ioengine=libaio --rw=write \
        --bs=1M --iodepth=8 --size="$SIZE" --output=/dev/null || log "prefill of $d failed"
done

JOBS=(
    "randread-4k-qd1 --rw=randread --bs=4k --iodepth=1"
    "randwrite-4k-qd1 --rw=randwrite --bs=4k --iodepth=1"
    "randread-4k-qd32 --rw=randread --bs=4k --iodepth=32"
    "randwrite-4k-qd32 --rw=randwrite --bs=4k --iodepth=32"
    "read-1m-qd8 --rw=read --bs=1M --iodepth=8"
)
# BENCH_PERF=1 samples ublkd and arenad (with call graphs) where a QD1
# request's time goes; BENCH_PERF=system samples both vCPUs whatever runs
# (fio, the kernel's NBD and ublk paths, soft-RoCE, the daemons, idle), for
# the jobs that keep the machine busy: where its CPU goes, per process and
# per symbol.
perf_on() {
    local what
    case "${BENCH_PERF:-0}" in
    1)
        [[ "$1" == *-qd1 && ( "$2" = tcp || "$2" = rdma ) ]] || return 0
        what=(-p "$UBLKD_PID,$ARENAD" -g)
        ;;
    system) [[ " nbd tcp sealed rdma " == *" $2 "* ]] || return 0; what=(-a) ;;
    *) return 0 ;;
    esac
    command -v perf >/dev/null || { log "perf not installed"; return 0; }
    timeout $((RUNTIME + 30)) perf record -q -F 999 -e cpu-clock "${what[@]}" \
        -o "$R/perf-$1-$2.data" -- sleep "$RUNTIME" >/dev/null 2>&1 &
    PERF_PID=$!
}
perf_off() {
    [[ -n "${PERF_PID:-}" ]] || return 0
    wait "$PERF_PID"
    PERF_PID=
    local data=$R/perf-$1-$2.data
    {
        if [[ "$BENCH_PERF" = system ]]; then
            echo "share of both vCPUs by process (swapper: idle):"
            perf report -i "$data" --stdio --no-children --sort comm 2>/dev/null |
                grep -v '^#' | grep '%' | head -12
            echo "top symbols:"
        fi
        perf report -i "$data" --stdio --no-children -g none --sort comm,dso,sym 2>/dev/null |
            grep -v '^#' | grep -v '^$' | grep '%' | head -25
    } >"$R/perf-$1-$2.txt"
}
for job in "${JOBS[@]}"; do
    read -r name args <<<"$job"
    for d in "${ORDER[@]}"; do
        perf_on "$name" "$d"
        # shellcheck disable=SC2086
        timeout $((RUNTIME * 6 + 120)) fio --name="$name" --filename="${DEVS[$d]}" --direct=1 \
            --ioengine=libaio --time_based --runtime="$RUNTIME" --ramp_time=1 --size="$SIZE" \
            $args --output-format=json --output="$R/$name-$d.json" || log "$name on $d failed"
        perf_off "$name" "$d"
    done
done

python3 - "$R" "${ORDER[*]}" "${JOBS[@]}" <<'PY'
import json, sys, os
out, order = sys.argv[1], sys.argv[2].split()
jobs = [s.split()[0] for s in sys.argv[3:]]
def load(name, d):
    try:
        j = json.load(open(os.path.join(out, f"{name}-{d}.json")))["jobs"][0]
    except Exception:
        return None
    side = j["read"] if j["read"]["io_bytes"] > 0 else j["write"]
    pct = side["clat_ns"].get("percentile", {})
    return dict(iops=side["iops"], mib=side["bw_bytes"] / 2**20,
                p50=pct.get("50.000000", 0) / 1000, p99=pct.get("99.000000", 0) / 1000)
res = {(n, d): load(n, d) for n in jobs for d in order}
print(f"{'job':<18} " + " ".join(f"{d + ' IOPS':>15}" for d in order))
for n in jobs:
    print(f"{n:<18} " + " ".join(f"{res[n, d]['iops']:>15.0f}" if res[n, d] else f"{'-':>15}" for d in order))
print()
print(f"{'job':<18} " + " ".join(f"{d + ' p50/p99 us':>18}" for d in order))
for n in jobs:
    cells = []
    for d in order:
        r = res[n, d]
        cells.append(f"{r['p50']:>8.0f}/{r['p99']:<9.0f}" if r else f"{'-':>18}")
    print(f"{n:<18} " + " ".join(cells))
print()
pairs = [(u, b) for u in ("tcp", "sealed", "rdma", "tcp-base", "rdma-base") for b in ("nbd", "loop") if u in order and b in order]
pairs += [(u, u + "-base") for u in ("tcp", "rdma") if u in order and u + "-base" in order]
pairs += [("sealed", "tcp")] if "sealed" in order and "tcp" in order else []
print(f"{'ratio (IOPS)':<18} " + " ".join(f"{u + '/' + b:>10}" for u, b in pairs))
for n in jobs:
    cells = []
    for u, b in pairs:
        a, c = res[n, u], res[n, b]
        cells.append(f"{a['iops'] / c['iops']:>9.2f}x" if a and c and c["iops"] else f"{'-':>10}")
    print(f"{n:<18} " + " ".join(cells))
ublk = [u for u in ("tcp", "sealed", "rdma", "tcp-base", "rdma-base") if u in order]
if "ramdisk" in order and ublk:
    print()
    print(f"{'of the ceiling':<18} " + " ".join(f"{u + '/ramdisk':>14}" for u in ublk))
    for n in jobs:
        c = res[n, "ramdisk"]
        cells = [f"{res[n, u]['iops'] / c['iops']:>13.2f}x" if res[n, u] and c and c["iops"] else f"{'-':>14}" for u in ublk]
        print(f"{n:<18} " + " ".join(cells))
PY
for f in "$R"/perf-*.txt; do
    [[ -f "$f" ]] || continue
    echo "--- profile $(basename "$f" .txt) (top samples: comm, dso, symbol) ---"
    cat "$f"
done
# A daemon that died mid-run (the guest's OOM killer, say) leaves zeros in
# every later cell: the figures are void, and the run says so and fails.
dead=()
for p in ARENAD UBLKD_PID BASE_PID; do
    [[ -n "${!p:-}" ]] && ! kill -0 "${!p}" 2>/dev/null && dead+=("$p=${!p}")
done
if ((${#dead[@]})); then
    echo "bench: FAIL: a daemon exited during the run (${dead[*]}; see console.log and the daemons' logs): the figures are void"
    exit 1
fi
