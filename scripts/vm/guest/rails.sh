#!/usr/bin/env bash
# Two RDMA rails on the real kernel, run inside the VM by scripts/vm/rails:
# two veth pairs with a soft-RoCE device on each end (docs/VM-TESTS.md,
# "Two RDMA links"), arenad serving rdma_rails = ["rxb0", "rxb1"], ublkd
# with [rdma] rails = ["rxa0", "rxa1"]:
#   - a transport = rdma device shows both rails up; ext4 and fio verify
#     (4k..1M) over it; payload bytes moved on both rails (/metrics), none
#     over TCP;
#   - under a fio verify load, link 1 taken down, then up again, then link
#     0: fio ends with no error, no payload over TCP, each rail lost and
#     back in `ublkctl show` within RAILS_REJOIN_S (default 60) of its
#     link coming up; the longest completion gap fio saw is written to
#     the results (rails-gap.txt);
#   - kill -9 ublkd: the device comes back on both rails, data intact;
#   - a peer serving one rail: rail 1 is off (not served), the device
#     works on rail 0, no payload over TCP.
# Prints `PASS name` / `FAIL name` per check; exits non-zero on a failure.
set -u

BIN=${UBLK_E2E_BIN:-$UBLK_VM_REPO/target/release}
R=${UBLK_VM_RESULTS:-/tmp/rails-results}
W=$(mktemp -d /tmp/ublk-rails.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
REJOIN_S=${RAILS_REJOIN_S:-60}
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
failures=0

mkdir -p "$R" "$W"/{state,nvme,run,mnt}
log() { printf '%s rails: %s\n' "$(date +%T)" "$*" >&2; }
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1${2:+ ($2)}"; failures=$((failures + 1)); }
ip() { timeout 20 /usr/sbin/ip "$@"; }
swap_disk "$W/nvme" || { echo "FAIL setup (swap_dir on NVMe)"; exit 1; }
for b in arenad ublkd ublkctl; do
    [[ -x "$BIN/$b" ]] || { echo "FAIL setup (missing $BIN/$b: run scripts/vm/rails)"; exit 1; }
done

# ---- two links: veth pairs aN/bN, rxe rxaN (ublkd) and rxbN (arenad) ----
two_rdma_links || { echo "FAIL setup (two RDMA links)"; exit 1; }
pass "two-links-up ($(ls /sys/class/infiniband | tr '\n' ' '))"

printf 'rails-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
arenad_conf() { # arenad_conf NAME PORT METRICS_PORT RDMA_KEYS
    cat >"$W/arenad-$1.toml" <<TOML
listen = "127.0.0.1:$2"
arena_bytes = "48M"
blob_bytes = "256K"
swap_dir = "$W/nvme/arena-$1"
swap_bytes = "256M"
metrics_listen = "127.0.0.1:$3"
rdma = "on"
rdma_gid_index = 1
$4
[[volume]]
name = "vm"
secret_file = "$W/vol.key"
quota = "1G"
TOML
}
arenad_conf two 7070 9478 'rdma_rails = ["rxb0", "rxb1"]'
arenad_conf one 7071 9479 'rdma_device = "rxb0"'
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
on_shutdown = "keep"
request_timeout_ms = 30000
[device]
queues = 2
depth = 16
io_buf = "1M"
transport = "rdma"
[metrics]
listen = "127.0.0.1:9477"
[rdma]
rails = ["rxa0", "rxa1"]
gid_index = 1
stripe_bytes = "128K"
transfer_timeout_ms = 1000
TOML

declare -A ARENAD_PID=()
start_arenad() { # start_arenad NAME PORT
    "$BIN/arenad" --config "$W/arenad-$1.toml" >>"$R/arenad-$1.log" 2>&1 &
    ARENAD_PID[$1]=$!
    wait_listen "$2" "${ARENAD_PID[$1]}"
}
cleanup() {
    pkill -f "fio --output=$R" 2>/dev/null
    mountpoint -q "$W/mnt" && umount -l "$W/mnt"
    local pids=("${UBLKD_PID:-}" "${ARENAD_PID[@]}")
    for p in "${pids[@]}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do [[ -n "$p" ]] && timeout 20 tail --pid="$p" -f /dev/null; done
    for p in "${pids[@]}"; do [[ -n "$p" ]] && kill -9 "$p" 2>/dev/null; done
}
trap cleanup EXIT

# rails ID: "rail state queues_up/queues bytes lost off" per rail of device ID.
rails() {
    ctl --json show "$1" | python3 -c '
import json, sys
for r in json.load(sys.stdin)["device"].get("rails", []):
    up, q = r["queues_up"], r["queues"]
    state = "off" if r.get("off") and up == 0 else "down" if up == 0 else "degraded" if up < q else "up"
    print(r["rail"], state, f"{up}/{q}", r["bytes"], r["lost"], (r.get("off") or "-").replace(" ", "_"))'
}
rail_field() { rails "$1" | awk -v r="$2" -v f="$3" '$1 == r { print $f }'; }
# wait_rail ID RAIL STATE SECONDS: until the rail is in STATE; prints the wait.
wait_rail() {
    local t0=$SECONDS
    while ((SECONDS - t0 <= $4)); do
        [[ "$(rail_field "$1" "$2" 2)" == "$3" ]] && { echo $((SECONDS - t0)); return 0; }
        sleep 1
    done
    return 1
}

start_arenad two 7070 || { echo "FAIL setup (arenad on two rails did not start; see arenad-two.log)"; exit 1; }
start_ublkd "$R/ublkd.log" || { echo "FAIL setup (ublkd did not come up)"; tail -20 "$R/ublkd.log"; exit 1; }
DEV=$(ctl add --peer 127.0.0.1:7070 --volume vm --secret-file "$W/vol.key" --size 96M --transport rdma 2>"$R/add.err")
if [[ "$DEV" =~ ^/dev/ublkb[0-9]+$ ]] && wait_node "$DEV"; then pass "add-two-rails ($DEV)"
else echo "FAIL add-two-rails ($(cat "$R/add.err"))"; exit 1; fi
ID=${DEV#/dev/ublkb}
rails "$ID" >"$R/rails-start.txt"
ctl show "$ID" >"$R/show-start.txt" 2>&1
[[ "$(rail_field "$ID" 0 2)" == up && "$(rail_field "$ID" 1 2)" == up ]] &&
    grep -q 'rail 1 .*rxa1:1/gid1 up (2/2 queues up)' "$R/show-start.txt" &&
    pass "show-both-rails-up" || fail show-both-rails-up "$(cat "$R/show-start.txt")"

# ---- ext4 and fio verify over two rails ------------------------------------
log "ext4"
fs_ok=1
timeout 300 mkfs.ext4 -q -F "$DEV" >"$R/mkfs.log" 2>&1 || fs_ok=0
((fs_ok)) && timeout 60 mount "$DEV" "$W/mnt" || fs_ok=0
if ((fs_ok)); then
    mkdir -p "$W/mnt/tree"
    timeout 300 cp -a "$UBLK_VM_REPO/docs" "$UBLK_VM_REPO/target-rdma/src" "$W/mnt/tree/" || fs_ok=0
    (cd "$W/mnt/tree" && find . -type f -print0 | sort -z | xargs -0 sha256sum) >"$W/sums"
    timeout 120 umount "$W/mnt" || fs_ok=0
    timeout 300 e2fsck -fn "$DEV" >"$R/e2fsck.log" 2>&1 || fs_ok=0
    timeout 60 mount "$DEV" "$W/mnt" || fs_ok=0
    (cd "$W/mnt/tree" && timeout 300 sha256sum --quiet -c "$W/sums") >"$R/sha256.log" 2>&1 || fs_ok=0
    timeout 120 umount "$W/mnt" || fs_ok=0
fi
((fs_ok)) && pass "ext4 ($(wc -l <"$W/sums") files, e2fsck clean, checksums match)" ||
    fail ext4 "see mkfs/e2fsck/sha256 logs"
log "fio verify"
if timeout 900 fio --output="$R/fio-verify.txt" --filename="$DEV" --direct=1 --ioengine=libaio \
    --verify=crc32c --do_verify=1 --verify_state_save=0 --verify_fatal=1 \
    --bssplit=4k/30:64k/30:256k/20:1m/20 --iodepth=8 \
    --name=seq --rw=write --offset=0 --size=16M \
    --name=rand --rw=randwrite --offset=16M --size=16M; then
    pass fio-verify
else fail fio-verify "see fio-verify.txt"; fi
b0=$(metric 'ublk_driver_rail_bytes_total{rail="0",rdma_device="rxa0:1/gid1"}')
b1=$(metric 'ublk_driver_rail_bytes_total{rail="1",rdma_device="rxa1:1/gid1"}')
tcp=$(stat_sum "$ID" tcp_payload_requests)
if ((b0 > 0 && b1 > 0 && tcp == 0)); then
    pass "payloads-on-both-rails (rail 0 $b0 bytes, rail 1 $b1 bytes, 0 over TCP)"
else fail payloads-on-both-rails "rail0=$b0 rail1=$b1 tcp=$tcp"; fi

# ---- links down and up under load ------------------------------------------
# A fio verify load across both flaps; its latency log gives the longest
# completion gap.
log "link flaps"
timeout 600 fio --output="$R/fio-flaps.txt" --filename="$DEV" --direct=1 --ioengine=libaio \
    --verify=crc32c --verify_backlog=16 --verify_state_save=0 --verify_fatal=1 \
    --bssplit=4k/50:256k/30:1m/20 --iodepth=8 --time_based --runtime=90 \
    --write_lat_log="$W/flaps" --log_avg_msec=0 \
    --name=flaps --rw=randwrite --offset=0 --size=32M &
FIO=$!
sleep 8
flap() { # flap N: link N down for 6 s, then up with its routes again
    log "link $1 down"
    ip link set a$1 down
    sleep 6
    local lost
    lost=$(rail_field "$ID" "$1" 5)
    echo "link $1 down: rail $1 $(rail_field "$ID" "$1" 2), lost $lost" >>"$R/flaps.txt"
    log "link $1 up"
    ip link set a$1 up
    ip link set b$1 up
    link_routes "$1"
    local waited
    if waited=$(wait_rail "$ID" "$1" up "$REJOIN_S"); then
        echo "rail $1 back up ${waited}s after its link came up" >>"$R/flaps.txt"
        pass "rail-$1-lost-and-back (lost $lost times, up again ${waited}s after the link, bound ${REJOIN_S}s)"
    else
        fail "rail-$1-lost-and-back" "not up within ${REJOIN_S}s: $(rails "$ID" | tr '\n' ' ')"
    fi
    ((lost > 0)) || fail "rail-$1-was-lost" "lost=$lost"
}
flap 1
sleep 5
flap 0
wait "$FIO"; fio_rc=$?
ctl show "$ID" >"$R/show-after-flaps.txt" 2>&1
tcp=$(stat_sum "$ID" tcp_payload_requests)
if ((fio_rc == 0)) && ((tcp == 0)); then
    pass "flaps-no-error-no-tcp (fio verify ok, 0 payloads over TCP while a rail was up)"
else fail flaps-no-error-no-tcp "fio rc=$fio_rc tcp=$tcp, see fio-flaps.txt"; fi
# The longest gap between completions (ms), from fio's latency log
# (time of completion in ms, first column).
if ls "$W"/flaps_lat*.log >/dev/null 2>&1; then
    cat "$W"/flaps_lat*.log | awk -F, '{ print $1 + 0 }' | sort -n |
        awk 'NR > 1 && $1 - p > g { g = $1 - p } { p = $1 } END { print g + 0 }' >"$R/rails-gap.txt"
    echo "BENCH rails longest completion gap across both flaps: $(cat "$R/rails-gap.txt") ms (transfer_timeout_ms 1000)"
fi
if dmesg | grep -iE 'I/O error|ublk.*(fail|error)' >"$R/dmesg-errors.txt"; then
    fail no-kernel-io-errors "$(head -3 "$R/dmesg-errors.txt")"
else pass no-kernel-io-errors; fi

# ---- kill -9 ublkd: back on both rails --------------------------------------
log "kill -9"
timeout 60 dd if=/dev/urandom of="$W/pattern" bs=1M count=4 status=none
timeout 120 dd if="$W/pattern" of="$DEV" bs=1M seek=40 oflag=direct conv=fsync status=none || fail pattern-write
kill -9 "$UBLKD_PID"; wait "$UBLKD_PID" 2>/dev/null
if start_ublkd "$R/ublkd.log" && [[ "$(show_field "$ID" state)" == live ]] &&
    wait_rail "$ID" 0 up 30 >/dev/null && wait_rail "$ID" 1 up 30 >/dev/null &&
    timeout 120 dd if="$DEV" of="$W/readback" bs=1M skip=40 count=4 iflag=direct status=none &&
    cmp -s "$W/readback" "$W/pattern"; then
    pass "kill9-recovery-on-two-rails (data intact)"
else fail kill9-recovery-on-two-rails "$(rails "$ID" | tr '\n' ' '; ctl list 2>&1)"; fi

# ---- a peer that serves one rail ------------------------------------------
start_arenad one 7071 || fail one-rail-arenad
DEV2=$(ctl add --peer 127.0.0.1:7071 --volume vm --secret-file "$W/vol.key" --size 16M --transport rdma 2>"$R/add2.err")
if [[ "$DEV2" =~ ^/dev/ublkb[0-9]+$ ]] && wait_node "$DEV2"; then
    ID2=${DEV2#/dev/ublkb}
    timeout 60 dd if=/dev/urandom of="$W/pattern2" bs=1M count=4 status=none
    timeout 120 dd if="$W/pattern2" of="$DEV2" bs=1M oflag=direct status=none &&
        timeout 120 dd if="$DEV2" of="$W/read2" bs=1M count=4 iflag=direct status=none &&
        cmp -s "$W/read2" "$W/pattern2" || fail one-rail-io
    ctl show "$ID2" >"$R/show-one-rail.txt" 2>&1
    tcp=$(stat_sum "$ID2" tcp_payload_requests)
    if [[ "$(rail_field "$ID2" 0 2)" == up && "$(rail_field "$ID2" 1 2)" == off ]] &&
        grep -q 'not served' "$R/show-one-rail.txt" && ((tcp == 0)); then
        pass "one-rail-peer (rail 1 off: not served; rail 0 carries everything, 0 over TCP)"
    else fail one-rail-peer "tcp=$tcp $(cat "$R/show-one-rail.txt")"; fi
else fail one-rail-add "$(cat "$R/add2.err")"; fi

if ((failures)); then echo "rails: $failures FAILED"; exit 1; fi
echo "rails: all checks passed"
