#!/usr/bin/env bash
# Real-kernel scenarios for ublkd devices on the RDMA data path over
# soft-RoCE (rxe on lo, GID index 1), run inside the VM by scripts/vm/rdma
# (which builds the release binaries on the host first):
#   - `arenad --check` states the RDMA isolation (rdma_isolation = "lease");
#   - transport = rdma device (keys per lease): fio verify (crc32c, seq + random, 4k..1M),
#     ext4 mkfs/copy/e2fsck/remount checksums; /metrics and `ublkctl stats`
#     prove the payloads went by RDMA (transferred > 0, TCP payloads = 0);
#   - transport = rdma towards a peer with rdma = "off" is refused naming the
#     reason; an `auto` device there serves TCP, `list` says tcp, and its
#     payloads are counted with reason declined_by_peer;
#   - kill -9 ublkd: the RDMA device is recovered and reads back its data;
#   - fault: `rdma link delete rxe0` mid-workload. rxe cannot disassociate
#     its users, so the kernel holds the delete until every process using
#     rxe0 closes it; the workload must finish (nothing hangs), then ublkd
#     and arenad let go, the link goes, the RDMA device is listed `failed`
#     naming the reason, and `ublkctl recover` brings it back over RDMA once
#     the link returns.
# Prints `PASS name` / `FAIL name` per scenario; exits non-zero on a failure.
set -u

BIN=${UBLK_E2E_BIN:-$UBLK_VM_REPO/target/release}
R=${UBLK_VM_RESULTS:-/tmp/rdma-e2e-results}
W=$(mktemp -d /tmp/ublk-rdma-e2e.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
failures=0

mkdir -p "$R" "$W"/{state,nvme,run,mnt}
log() { printf '%s rdma-e2e: %s\n' "$(date +%T)" "$*" >&2; }
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1${2:+ ($2)}"; failures=$((failures + 1)); }
rxe_add() { timeout 20 /usr/bin/rdma link add rxe0 type rxe netdev lo; }
# Both arenads keep their swap on the emulated NVMe disk.
swap_disk "$W/nvme" || { echo "FAIL setup (swap_dir on NVMe)"; exit 1; }

for b in arenad ublkd ublkctl; do
    [[ -x "$BIN/$b" ]] || { echo "FAIL setup (missing $BIN/$b: run scripts/vm/rdma)"; exit 1; }
done
timeout 10 /usr/sbin/ip link set lo up
rxe_add || { echo "FAIL rxe-add"; exit 1; }
for _ in $(seq 100); do [[ -c /dev/infiniband/uverbs0 ]] && break; sleep 0.1; done
pass rxe0-up

printf 'rdma-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
arenad_conf() { # arenad_conf NAME PORT METRICS_PORT RDMA
    cat >"$W/arenad-$1.toml" <<TOML
listen = "127.0.0.1:$2"
arena_bytes = "32M"
blob_bytes = "256K"
swap_dir = "$W/nvme/arena-${1%%-*}"
swap_bytes = "256M"
metrics_listen = "127.0.0.1:$3"
rdma = "$4"
rdma_gid_index = 1
[[volume]]
name = "vm"
secret_file = "$W/vol.key"
quota = "1G"
TOML
}
arenad_conf a 7070 9478 on
arenad_conf a-auto 7070 9478 auto
arenad_conf b 7071 9479 off
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
gid_index = 1
TOML

declare -A ARENAD_PID=()
start_arenad() { # start_arenad CONF PORT
    "$BIN/arenad" --config "$W/arenad-$1.toml" >>"$R/arenad-$1.log" 2>&1 &
    ARENAD_PID[${1%%-*}]=$!
    for _ in $(seq 100); do
        (exec 3<>/dev/tcp/127.0.0.1/"$2") 2>/dev/null && return 0
        kill -0 "${ARENAD_PID[${1%%-*}]}" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}
stop_arenad() { # stop_arenad a|b : SIGTERM (flushes), waits
    kill "${ARENAD_PID[$1]}" 2>/dev/null
    timeout 60 tail --pid="${ARENAD_PID[$1]}" -f /dev/null
}
cleanup() {
    mountpoint -q "$W/mnt" && umount -l "$W/mnt"
    local pids=("${UBLKD_PID:-}" "${ARENAD_PID[@]}")
    for p in "${pids[@]}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do [[ -n "$p" ]] && timeout 20 tail --pid="$p" -f /dev/null; done
    for p in "${pids[@]}"; do [[ -n "$p" ]] && kill -9 "$p" 2>/dev/null; done
}
trap cleanup EXIT

# reads_back DEV SKIP_MIB COUNT_MIB FILE: the device holds FILE there.
# (No process substitution: the guest's devtmpfs has no /dev/fd.)
reads_back() {
    timeout 120 dd if="$1" of="$W/readback" bs=1M skip="$2" count="$3" iflag=direct status=none &&
        cmp "$W/readback" "$4"
}

# `arenad --check` states what an RDMA key reaches (the default: per lease).
if timeout 60 "$BIN/arenad" --config "$W/arenad-a.toml" --check >"$R/check-a.log" 2>&1 &&
    grep -q 'rdma_isolation = "lease": a protection domain per RDMA session' "$R/check-a.log"; then
    pass arenad-check-states-rdma-isolation
else
    fail arenad-check-states-rdma-isolation "$(tail -3 "$R/check-a.log" | tr '\n' ' ')"
fi

start_arenad a 7070 || { echo "FAIL setup (arenad rdma=on did not start; see arenad-a.log)"; exit 1; }
start_arenad b 7071 || { echo "FAIL setup (arenad rdma=off did not start)"; exit 1; }
start_ublkd "$R/ublkd.log" || { echo "FAIL setup (ublkd did not come up)"; tail -20 "$R/ublkd.log"; exit 1; }

# ---- add over RDMA -----------------------------------------------------
DEV=$(ctl add --peer 127.0.0.1:7070 --volume vm --secret-file "$W/vol.key" --size 64M --transport rdma 2>"$R/add.err")
if [[ "$DEV" =~ ^/dev/ublkb[0-9]+$ ]] && wait_node "$DEV"; then pass "rdma-add ($DEV)"
else echo "FAIL rdma-add ($(cat "$R/add.err"))"; exit 1; fi
ID=${DEV#/dev/ublkb}
ctl list | tee "$R/list.txt" | awk -v id="$ID" '$1 == id && $NF == "rdma" { ok = 1 } END { exit !ok }' &&
    pass rdma-list-says-rdma || fail rdma-list-says-rdma "$(cat "$R/list.txt")"

# ---- fio verify over RDMA ------------------------------------------------
log "fio verify"
if timeout 600 fio --output="$R/fio-verify.txt" --filename="$DEV" --direct=1 --ioengine=libaio \
    --verify=crc32c --do_verify=1 --verify_state_save=0 --verify_fatal=1 \
    --bssplit=4k/30:64k/30:256k/20:1m/20 --iodepth=8 \
    --name=seq --rw=write --offset=0 --size=16M \
    --name=rand --rw=randwrite --offset=16M --size=16M; then
    pass rdma-fio-verify
else fail rdma-fio-verify "see fio-verify.txt"; fi

# ---- ext4 over RDMA --------------------------------------------------------
log "ext4"
fs_ok=1
timeout 300 mkfs.ext4 -q -F "$DEV" >"$R/mkfs.log" 2>&1 || fs_ok=0
((fs_ok)) && timeout 60 mount "$DEV" "$W/mnt" || fs_ok=0
if ((fs_ok)); then
    mkdir -p "$W/mnt/tree"
    timeout 300 cp -a "$UBLK_VM_REPO/docs" "$UBLK_VM_REPO/daemon/src" "$UBLK_VM_REPO/target-rdma/src" "$W/mnt/tree/" || fs_ok=0
    (cd "$W/mnt/tree" && find . -type f -print0 | sort -z | xargs -0 sha256sum) >"$W/sums"
    timeout 120 umount "$W/mnt" || fs_ok=0
    timeout 300 e2fsck -fn "$DEV" >"$R/e2fsck.log" 2>&1 || fs_ok=0
    timeout 60 mount "$DEV" "$W/mnt" || fs_ok=0
    (cd "$W/mnt/tree" && timeout 300 sha256sum --quiet -c "$W/sums") >"$R/sha256.log" 2>&1 || fs_ok=0
    timeout 120 umount "$W/mnt" || fs_ok=0
fi
((fs_ok)) && pass "rdma-ext4 ($(wc -l <"$W/sums") files, e2fsck clean, checksums match)" ||
    fail rdma-ext4 "see mkfs/e2fsck/sha256 logs"

# ---- where the payloads went --------------------------------------------
driver_stats "$ID" >"$R/driver-rdma.txt"
ctl stats "$ID" >"$R/stats-rdma.txt" 2>&1
xfer=$(stat_sum "$ID" rdma_transferred)
tcp=$(stat_sum "$ID" tcp_payload_requests)
m_xfer=$(metric 'ublk_driver_rdma_transferred_total{driver="rdma"}')
m_tcp=$(metric 'ublk_driver_tcp_payload_requests_total{')
if ((xfer > 0 && tcp == 0 && m_xfer > 0 && m_tcp == 0)); then
    pass "rdma-payloads-by-rdma ($xfer transfers over RDMA, 0 TCP payload requests; /metrics agrees)"
else fail rdma-payloads-by-rdma "stats: rdma=$xfer tcp=$tcp; /metrics: rdma=$m_xfer tcp=$m_tcp"; fi
# Two queues, each caching leases (the device's queues share a lease group).
hits=$(stat_sum "$ID" lease_cache_hits)
if ((hits > 0)); then pass "rdma-lease-cache-on-two-queues ($hits requests under a cached lease)"
else fail rdma-lease-cache-on-two-queues "lease_cache_hits=$hits"; fi
grep -q "ublkb$ID: RDMA data path - Write: [1-9][0-9]* transfers over RDMA, 0 payload requests over TCP" "$R/stats-rdma.txt" &&
    ! grep -q warning "$R/stats-rdma.txt" && pass rdma-ctl-stats-line || fail rdma-ctl-stats-line "$(cat "$R/stats-rdma.txt")"
(( $(stat_sum "$ID" registrations_pooled) > 0 && $(stat_sum "$ID" registrations_per_op) == 0 )) &&
    pass rdma-pooled-registration || fail rdma-pooled-registration "$(grep registrations "$R/driver-rdma.txt")"

# ---- a peer that declines --------------------------------------------------
out=$(ctl add --peer 127.0.0.1:7071 --volume vm --secret-file "$W/vol.key" --size 16M --transport rdma 2>&1)
if [[ $? -ne 0 && "$out" == *"RDMA transport unavailable: "*"declined RDMA"* ]]; then pass rdma-refused-by-declining-peer
else fail rdma-refused-by-declining-peer "$out"; fi
DEV2=$(ctl add --peer 127.0.0.1:7071 --volume vm --secret-file "$W/vol.key" --size 16M --transport auto 2>"$R/add2.err")
if [[ "$DEV2" =~ ^/dev/ublkb[0-9]+$ ]] && wait_node "$DEV2"; then
    ID2=${DEV2#/dev/ublkb}
    timeout 120 dd if=/dev/urandom of="$W/pattern2" bs=1M count=2 status=none
    timeout 120 dd if="$W/pattern2" of="$DEV2" bs=1M oflag=direct status=none &&
        timeout 120 dd if="$DEV2" of="$W/read2" bs=1M count=2 iflag=direct status=none &&
        cmp "$W/read2" "$W/pattern2" >"$R/auto-cmp.txt" 2>&1 && pass auto-io ||
        fail auto-io "$(cat "$R/auto-cmp.txt"; ls -l "$W/read2" "$W/pattern2")"
    t=$(show_field "$ID2" transport); note=$(show_field "$ID2" transport_note)
    declined=$(stat_sum "$ID2" tcp_payload_requests declined_by_peer)
    ctl stats "$ID2" >"$R/stats-auto.txt" 2>&1
    if [[ "$t" == tcp && "$note" == *declined* ]] && ((declined > 0)) && ! grep -q warning "$R/stats-auto.txt"; then
        pass "auto-falls-back-counted (transport tcp, $declined payloads counted as declined_by_peer)"
    else fail auto-falls-back-counted "transport=$t note=$note declined=$declined $(cat "$R/stats-auto.txt")"; fi
else fail auto-add "$(cat "$R/add2.err")"; fi

# ---- kill -9 ublkd: the RDMA device recovers ------------------------------
log "kill -9"
timeout 120 dd if=/dev/urandom of="$W/pattern" bs=1M count=4 status=none
timeout 120 dd if="$W/pattern" of="$DEV" bs=1M seek=40 oflag=direct conv=fsync status=none || fail pattern-write
kill -9 "$UBLKD_PID"; wait "$UBLKD_PID" 2>/dev/null
if start_ublkd "$R/ublkd.log" && [[ "$(show_field "$ID" state)" == live && "$(show_field "$ID" transport)" == rdma ]] &&
    reads_back "$DEV" 40 4 "$W/pattern" &&
    (( $(stat_sum "$ID" rdma_transferred) > 0 )); then
    pass "rdma-kill9-recovery (same $DEV, over RDMA, data intact)"
else fail rdma-kill9-recovery "$(ctl list 2>&1)"; fi

# ---- fault: delete the rxe link mid-workload ------------------------------
log "link delete"
timeout 300 fio --output="$R/fio-fault.txt" --filename="$DEV" --direct=1 --ioengine=libaio \
    --verify=crc32c --do_verify=1 --verify_state_save=0 --verify_fatal=1 \
    --bs=64k --iodepth=8 --name=fault --rw=randwrite --offset=0 --size=16M &
FIO=$!
sleep 2
( timeout -k 5 600 /usr/bin/rdma link delete rxe0; echo "rc=$?" >"$W/delete.rc" ) >"$R/link-delete.log" 2>&1 &
wait "$FIO"; fio_rc=$?
if ((fio_rc == 0)); then pass "fault-workload-completes (fio verify ok while the link delete is pending)"
else fail fault-workload-completes "fio rc=$fio_rc, see fio-fault.txt"; fi
driver_stats "$ID" >"$R/driver-fault.txt"
echo "counters after the workload: rdma_failed=$(stat_sum "$ID" rdma_failed)" \
    "rdma_timed_out=$(stat_sum "$ID" rdma_timed_out)" \
    "failed_over=$(stat_sum "$ID" rdma_declined_served_tcp)" \
    "tcp_payloads=$(stat_sum "$ID" tcp_payload_requests)"
[[ -e "$W/delete.rc" ]] && echo "note: the link delete finished while in use" ||
    echo "note: the kernel holds the link delete while ublkd and arenad use rxe0 (rxe cannot disassociate users)"
# Let go of rxe0: ublkd dies (the device quiesces, I/O waits), arenad stops cleanly.
kill -9 "$UBLKD_PID"; wait "$UBLKD_PID" 2>/dev/null
stop_arenad a
for _ in $(seq 300); do [[ -e "$W/delete.rc" ]] && break; sleep 0.1; done
if [[ -e "$W/delete.rc" && ! -e /sys/class/infiniband/rxe0 ]]; then pass fault-link-deleted
else fail fault-link-deleted "$(cat "$R/link-delete.log")"; fi
# No RDMA device now: arenad serves TCP only, the RDMA device fails naming why.
start_arenad a-auto 7070 || fail "fault-arenad-auto"
if start_ublkd "$R/ublkd.log" && [[ "$(show_field "$ID" state)" == failed && "$(show_field "$ID" error)" == *"RDMA"* ]]; then
    pass "fault-rdma-device-failed-with-reason ($(show_field "$ID" error))"
else fail fault-rdma-device-failed-with-reason "$(ctl list 2>&1)"; fi
# The link returns: RDMA arenad again, recover, data intact, over RDMA.
rxe_add || fail fault-link-readd
stop_arenad a
start_arenad a 7070 || fail fault-arenad-rdma-again
if timeout 120 "$BIN/ublkctl" --socket "$SOCK" recover "$ID" >"$R/recover.txt" 2>&1 &&
    [[ "$(show_field "$ID" transport)" == rdma ]] &&
    reads_back "$DEV" 40 4 "$W/pattern" &&
    (( $(stat_sum "$ID" rdma_transferred) > 0 )); then
    pass "fault-recovers-when-the-link-returns (over RDMA, data intact)"
else fail fault-recovers-when-the-link-returns "$(cat "$R/recover.txt"; ctl list 2>&1)"; fi

if ((failures)); then echo "rdma-e2e: $failures FAILED"; exit 1; fi
echo "rdma-e2e: all checks passed"
