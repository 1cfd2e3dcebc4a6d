#!/usr/bin/env bash
# A QEMU guest on /dev/ublkbN, run inside the test VM by scripts/vm/guest-vm
# (nested TCG): the guest's disk is a replicated device (N=2; real etcd,
# two arenad on loopback), attached as
#   -drive file=/dev/ublkbN,format=raw,if=virtio,cache=none,aio=native
# and its /init (scripts/vm/nested/init.sh, initramfs built on the host by
# scripts/vm/mkinitramfs-nested) mounts ext4 from /dev/vda and appends
# numbered records with fsync, printing "ACK N UPTIME" on its serial console
# once the fsync returned. Each console line is stamped with the outer
# wall clock as it arrives. While the guest writes:
#   1. `kill -9` of ublkd and its restart (no ublkctl command: the device
#      is recovered by the restarted ublkd);
#   2. `kill -9` of one arenad, its restart and rebuild;
#   3. (GVM_MIGRATE=1, the default) live migration to a second ublkd
#      (host-b) whose standby device was added with --activate-on-write:
#      destination QEMU `-incoming`, `migrate -d` on the source's monitor;
#      the guest's first write on the destination takes the writer role;
#   4. and back: the destination QEMU started paused (-S, as libvirt does),
#      `ublkctl activate` on host-a at the migration's completion (what a
#      libvirt hook would run), then `cont`.
# Then the guest is stopped cleanly (STOP on its control disk /dev/vdb: it
# unmounts and powers off), `e2fsck -fn` on the device is clean, every
# ACKed record is in the file, no I/O error on either console or in dmesg.
# The longest gap between consecutive ACKs (outer wall clock) is printed
# per phase, the migrations' as `BENCH migrate` lines, the boot time as
# `BENCH guest-vm`.
# GVM_ACKS (default 3): records to see acknowledged in each phase;
# GVM_FULL=1 raises it to 60 (docs/VM-TESTS.md).
# Prints `PASS name` / `FAIL name` and exits non-zero if any failed.
set -u

BIN=${UBLK_E2E_BIN:-$UBLK_VM_REPO/target/release}
R=${UBLK_VM_RESULTS:-/tmp/guest-vm-results}
W=$(mktemp -d /tmp/ublk-gvm.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/a/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PEERS=(127.0.0.1:7071 127.0.0.1:7072)
ETCD=127.0.0.1:2379
DEV_SIZE=${GVM_DEV_SIZE:-128M}
TTL=${GVM_LEASE_TTL:-6}
if [[ ${GVM_FULL:-0} == 1 ]]; then ACKS=${GVM_ACKS:-60}; else ACKS=${GVM_ACKS:-3}; fi
MIGRATE=${GVM_MIGRATE:-1}
CACHE=$("$UBLK_VM_REPO/scripts/vm/cache-dir")
# The uncompressed kernel (PVH entry) scripts/vm/mkinitramfs-nested extracts:
# no decompression under nested TCG.
KERNEL=$CACHE/kernel/$UBLK_VM_KVER/vmlinux
[[ -f $KERNEL ]] || KERNEL=$CACHE/kernel/$UBLK_VM_KVER/boot/vmlinuz-$UBLK_VM_KVER
# A named, migration-safe CPU model: with `-cpu max` a nested guest once
# crashed right after the migration (preempt count corrupt: "scheduling
# while atomic", then list corruption in the scheduler), before its first
# write; TCG's `max` is not a model migration promises to keep stable.
GVM_CPU=${GVM_CPU:-qemu64}
# The nested QEMU stays on one of the VM's CPUs: its JIT writes the code it
# then runs, and the outer TCG must see that as self-modifying code; nested
# guests crashed at random (early boot: a fault in the kernel's own text
# patching; after a migration: a jump into data) while it could move
# between CPUs.
GVM_PIN=${GVM_PIN:-1}
GVM_APPEND="console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off nokaslr no_timer_check tsc=reliable"
INITRD=${GVM_INITRD:-$(ls -t "$CACHE"/initramfs/nested-"$UBLK_VM_KVER"-*.cpio.gz 2>/dev/null | head -1)}
failures=0
declare -a summary=() ARENAD_PIDS=()
declare -A QPID=()

mkdir -p "$R" "$W"/{a,b}/{state,run} "$W"/{etcd,mnt}
log() { printf '%s guest-vm: %s\n' "$(date +%T)" "$*" >&2; }
pass() { echo "PASS $1"; summary+=("PASS $1"); }
fail() { echo "FAIL $1${2:+ ($2)}"; summary+=("FAIL $1"); failures=$((failures + 1)); }
die() { fail "$1" "$2"; echo "---- summary ----"; printf '%s\n' "${summary[@]}"; exit 1; }

for b in arenad ublkd ublkctl; do
    [[ -x "$BIN/$b" ]] || die setup "missing $BIN/$b: run scripts/vm/guest-vm, which builds it"
done
for t in etcd etcdctl python3 qemu-system-x86_64; do
    command -v "$t" >/dev/null || die setup "$t missing (scripts/vm/deps)"
done
[[ -f "$KERNEL" && -f "$INITRD" ]] || die setup "no nested kernel/initramfs ($KERNEL, '$INITRD'): run scripts/vm/guest-vm, which builds it"
[[ -c /dev/ublk-control ]] || die setup "/dev/ublk-control missing"
swap_disk "$W/swap" || die setup "swap_dir on NVMe"

printf 'guest-vm-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
for i in 0 1; do
    mkdir -p "$W/swap/$i"
    cat >"$W/arenad$i.toml" <<TOML
listen = "${PEERS[$i]}"
arena_bytes = "64M"
blob_bytes = "256K"
swap_dir = "$W/swap/$i"
swap_bytes = "512M"
metrics_listen = "127.0.0.1:948$i"
[[volume]]
name = "vm1"
secret_file = "$W/vol.key"
quota = "1G"
TOML
done
host_conf a 9477 1
host_conf b 9478 1
rep() { replica_fact "$ID_A" "$1"; }
wait_rebuilt() {
    local end=$((SECONDS + $1))
    while ((SECONDS < end)); do
        [[ "$(rep healthy)" == 2 && "$(rep rebuild)" == none ]] && return 0
        sleep 1
    done
    return 1
}
kernel_errors() {
    dmesg | grep -iE 'I/O error|blk_update_request|EXT4-fs (error|warning)|Buffer I/O|ublk.*(error|fail|abort)|JBD2.*(error|abort)'
}

# ---- the nested guest ----------------------------------------------------
# stamp: each line of stdin prefixed with the outer wall clock.
stamp() { local l; while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "${l%$'\r'}"; done; }
# gvm_start NAME DEV [QEMU ARGS...]: QEMU on DEV in the background, its
# console stamped into $R/gvm-NAME.log, its monitor on $W/mon-NAME.sock.
gvm_start() {
    local name=$1 dev=$2
    shift 2
    mkfifo "$W/con-$name"
    stamp <"$W/con-$name" >"$R/gvm-$name.log" &
    taskset -c "$GVM_PIN" qemu-system-x86_64 -accel tcg -cpu "$GVM_CPU" -m 256M -smp 1 -display none -no-reboot -nic none \
        -kernel "$KERNEL" -initrd "$INITRD" \
        -append "$GVM_APPEND gvm.mode=run" \
        -drive "file=$dev,format=raw,if=virtio,cache=none,aio=native" \
        -drive "file=$W/ctl.img,format=raw,if=virtio" \
        -serial stdio -monitor "unix:$W/mon-$name.sock,server=on,wait=off" "$@" \
        </dev/null >"$W/con-$name" 2>"$R/qemu-$name.err" &
    QPID[$name]=$!
    for _ in $(seq 300); do [[ -S "$W/mon-$name.sock" ]] && return 0; kill -0 "${QPID[$name]}" 2>/dev/null || return 1; sleep 0.1; done
    return 1
}
# hmp NAME CMD: one human-monitor command; prints its output.
hmp() {
    timeout 60 python3 - "$W/mon-$1.sock" "$2" <<'PY'
import re, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.settimeout(50)
def prompt():
    buf = b""
    while not buf.endswith(b"(qemu) "):
        d = s.recv(65536)
        if not d:
            break
        buf += d
    return buf.decode(errors="replace")
prompt()
s.sendall(sys.argv[2].encode() + b"\n")
out = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", prompt()).replace("\r", "")
print(out.replace("(qemu) ", "").strip())
PY
}
# migrate FROM PORT: `migrate -d` on FROM's monitor, polled until done;
# prints the final `info migrate` and fails unless it completed. Unless
# GVM_LIVE=1, the source is stopped first, so its RAM goes over once, in
# full, while the guest is paused (docs/VM-TESTS.md: a pre-copy of a
# running guest under TCG inside TCG crashed the guest on arrival in 2 of
# 4 runs, before it touched the disk); the disk's hand-over is the same.
migrate() {
    : >"$R/migrate-$1.txt"
    ((${GVM_LIVE:-0})) || hmp "$1" stop >>"$R/migrate-$1.txt"
    hmp "$1" "migrate -d tcp:127.0.0.1:$2" >>"$R/migrate-$1.txt"
    local out end=$((SECONDS + ${GVM_MIGRATE_TIMEOUT:-600}))
    while ((SECONDS < end)); do
        out=$(hmp "$1" "info migrate")
        case $out in
        *"Migration status: completed"*) echo "$out" >>"$R/migrate-$1.txt"; return 0 ;;
        *"Migration status: failed"* | *"Migration status: cancelled"*) echo "$out" >>"$R/migrate-$1.txt"; return 1 ;;
        esac
        sleep 0.5
    done
    echo "$out" >>"$R/migrate-$1.txt"
    return 1
}
# ACKs over every console so far: "N OUTER_TIME UPTIME NAME", by N.
acks() { awk '$2 == "ACK" { n = FILENAME; sub(/.*gvm-/, "", n); sub(/\.log$/, "", n); print $3, $1, $4, n }' "$R"/gvm-*.log 2>/dev/null | sort -n; }
n_acks() { acks | wc -l; }
last_ack() { acks | tail -1 | cut -d' ' -f1; }
# wait_acks N TIMEOUT_S [NAME]: until N more records are ACKed (on NAME's
# console when given).
wait_acks() {
    local n0 end=$((SECONDS + $2))
    n0=$(acks | awk -v c="${3:-}" 'c == "" || $4 == c' | wc -l)
    while ((SECONDS < end)); do
        (($(acks | awk -v c="${3:-}" 'c == "" || $4 == c' | wc -l) >= n0 + $1)) && return 0
        sleep 1
    done
    return 1
}
# gap FROM [TO]: the longest gap in seconds (outer clock) between
# consecutive ACKs, from the last one before FROM to the first after TO
# (the end when absent); "max_s/uptime_max_s" (the guest's own clock stops
# while QEMU is paused, so it hides a switchover's downtime).
gap() {
    acks | awk -v from="$1" -v to="${2:-1e18}" '
        $2 < from { pt = $2; pu = $3; next }
        { if (pt != "") { if ($2 - pt > m) m = $2 - pt; if ($3 - pu > mu) mu = $3 - pu }
          pt = $2; pu = $3; if ($2 > to) exit }
        END { printf "%.2f/%.2f\n", m + 0, mu + 0 }'
}
console_errors() { grep -hiE 'GVM FAIL|I/O error|EXT4-fs (error|warning)|blk_update_request|Buffer I/O|JBD2|Kernel panic|Oops' "$R"/gvm-*.log; }

cleanup() {
    local p
    for p in "${QPID[@]}"; do kill "$p" 2>/dev/null; done
    mountpoint -q "$W/mnt" && umount -l "$W/mnt"
    for p in "${PID_A:-}" "${PID_B:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null; done
    for p in "${ARENAD_PIDS[@]}" "${ETCD_PID:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    mountpoint -q "$W/swap" && umount "$W/swap"
}
trap cleanup EXIT

t0=$SECONDS
dmesg -C
start_etcd "$ETCD" "$W/etcd/data" "$R/etcd.log" || die setup "etcd did not become healthy; see etcd.log"
for i in 0 1; do start_peer "$i" || die setup "arenad $i did not listen; see arenad$i.log"; done
start_host a || die setup "ublkd A did not come up; see ublkd-a.log"
if ((MIGRATE)); then start_host b || die setup "ublkd B did not come up; see ublkd-b.log"; fi
DEV_A=$(SOCK=$W/a/run/ublkd.sock add_when_etcd --wait --peer "${PEERS[0]}" --peer "${PEERS[1]}" --volume vm1 \
    --secret-file "$W/vol.key" --size "$DEV_SIZE" --transport tcp 2>"$R/add-a.err")
[[ "$DEV_A" =~ ^/dev/ublkb[0-9]+$ && -b "$DEV_A" ]] || die add "$(cat "$R/add-a.err")"
ID_A=${DEV_A#/dev/ublkb}
timeout 300 mkfs.ext4 -q -F "$DEV_A" >"$R/mkfs.log" 2>&1 || die mkfs "$(cat "$R/mkfs.log")"
truncate -s 1M "$W/ctl.img"
log "etcd, 2 arenad, ublkd, $DEV_A with ext4 after $((SECONDS - t0)) s"

# ---- boot ---------------------------------------------------------------
tb=$EPOCHREALTIME
gvm_start a "$DEV_A" || die guest-start "see qemu-a.err: $(cat "$R/qemu-a.err")"
end=$((SECONDS + ${GVM_BOOT_TIMEOUT:-900}))
while ((SECONDS < end)) && ! grep -q 'GVM READY' "$R/gvm-a.log"; do
    kill -0 "${QPID[a]}" 2>/dev/null || break
    sleep 1
done
if grep -q 'GVM READY' "$R/gvm-a.log"; then
    boot_s=$(awk -v a="$tb" '/GVM READY/ { printf "%.1f", $1 - a; exit }' "$R/gvm-a.log")
    up_s=$(awk '/GVM READY/ { print $5; exit }' "$R/gvm-a.log")
    echo "BENCH guest-vm boot_s=$boot_s guest_uptime_at_ready_s=$up_s" | tee -a "$R/bench.txt"
    pass "nested-guest-boots (QEMU TCG in the TCG VM, on $DEV_A: ext4 mounted after $boot_s s)"
else die nested-guest-boots "no GVM READY after $((SECONDS - t0)) s; see gvm-a.log, qemu-a.err: $(tail -3 "$R/gvm-a.log")"; fi
t_first=$EPOCHREALTIME
if wait_acks "$ACKS" 600; then
    pass "guest-writes (first $ACKS records fsynced in $(awk -v a="$t_first" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }') s)"
else die guest-writes "$(n_acks) ACKs; see gvm-a.log"; fi

# ---- 1: kill -9 ublkd, restart ------------------------------------------
log "kill -9 ublkd"
t1=$EPOCHREALTIME
kill -9 "$PID_A"; wait "$PID_A" 2>/dev/null
start_host a || fail ublkd-restart "see ublkd-a.log"
st=
for _ in $(seq 240); do st=$(dev_state a "$ID_A"); [[ $st == live ]] && break; sleep 0.5; done
if [[ $st == live ]] && wait_acks "$ACKS" 600; then
    pass "guest-through-ublkd-kill-9 (device live again, longest ACK gap $(gap "$t1") s wall/guest)"
else fail guest-through-ublkd-kill-9 "state '$st', $(n_acks) ACKs; see ublkd-a.log"; fi

# ---- 2: kill -9 arenad 1, restart, rebuild ------------------------------
log "kill -9 arenad 1"
t2=$EPOCHREALTIME
kill -9 "${ARENAD_PIDS[1]}"; wait "${ARENAD_PIDS[1]}" 2>/dev/null
if wait_acks "$ACKS" 600 && [[ $(rep states) == "healthy failed" ]]; then
    pass "guest-through-arenad-kill-9 (member failed at epoch $(rep epoch), longest ACK gap $(gap "$t2") s)"
else fail guest-through-arenad-kill-9 "states '$(rep states)', $(n_acks) ACKs"; fi
rb0=$SECONDS
start_peer 1 || fail arenad-restart "see arenad1.log"
if wait_rebuilt 900 && wait_acks "$ACKS" 600; then
    pass "guest-through-rebuild (rebuilt in $((SECONDS - rb0)) s while the guest wrote; longest ACK gap since the kill $(gap "$t2") s)"
else fail guest-through-rebuild "states '$(rep states)', remaining $(rep rebuild)"; fi

live=a
if ((MIGRATE)); then
    # ---- 3: live migration to host-b, its standby activated on write -----
    log "migrate to host-b"
    DEV_B=$(SOCK=$W/b/run/ublkd.sock add_when_etcd --wait --standby --activate-on-write --peer "${PEERS[0]}" --peer "${PEERS[1]}" --volume vm1 \
        --secret-file "$W/vol.key" --size "$DEV_SIZE" --transport tcp 2>"$R/add-b.err")
    if [[ "$DEV_B" =~ ^/dev/ublkb[0-9]+$ && -b "$DEV_B" ]]; then
        ID_B=${DEV_B#/dev/ublkb}
        gvm_start b "$DEV_B" -incoming tcp:127.0.0.1:4444 || fail migrate-destination "$(cat "$R/qemu-b.err")"
        tm=$EPOCHREALTIME
        if migrate a 4444; then
            t_done=$EPOCHREALTIME
            # A source stopped before the migration leaves the destination
            # paused too (QEMU carries the run state over).
            ((${GVM_LIVE:-0})) || hmp b cont >/dev/null
            hmp a quit >/dev/null; wait "${QPID[a]}" 2>/dev/null; unset 'QPID[a]'
            if wait_acks "$ACKS" 600 b; then
                live=b
                g=$(gap "$tm")
                echo "BENCH migrate a->b activate=on-write migration_s=$(awk -v a="$tm" -v b="$t_done" 'BEGIN { printf "%.1f", b - a }') longest_ack_gap_wall_s/guest_s=$g" |
                    tee -a "$R/bench.txt"
                ra=$(role a "$ID_A") rb=$(role b "$ID_B")
                if [[ $ra == standby && $rb == writer ]]; then
                    pass "migrate-to-standby-activated-on-write (roles a '$ra' b '$rb', longest ACK gap $g s; $(grep -m1 'downtime' "$R/migrate-a.txt" | tr -s ' '))"
                else fail migrate-to-standby-activated-on-write "roles a '$ra' b '$rb'"; fi
            else fail migrate-to-standby-activated-on-write "no ACK on the destination; roles a '$(role a "$ID_A")' b '$(role b "$ID_B")'; see gvm-b.log"; fi
        else fail migrate-to-standby-activated-on-write "migration did not complete: $(tail -5 "$R/migrate-a.txt")"; fi
    else fail add-standby "$(cat "$R/add-b.err")"; fi

    # ---- 4: and back, activated by `ublkctl activate` at completion -------
    if [[ $live == b ]]; then
        log "migrate back to host-a"
        gvm_start a2 "$DEV_A" -S -incoming tcp:127.0.0.1:4445 || fail migrate-back-destination "$(cat "$R/qemu-a2.err")"
        tm=$EPOCHREALTIME
        if migrate b 4445; then
            t_done=$EPOCHREALTIME
            act=$(ctl_a activate "$ID_A" 2>&1); act_rc=$?
            act_ms=$(awk -v a="$t_done" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", (b - a) * 1000 }')
            hmp a2 cont >/dev/null
            hmp b quit >/dev/null; wait "${QPID[b]}" 2>/dev/null; unset 'QPID[b]'
            if ((act_rc == 0)) && wait_acks "$ACKS" 600 a2; then
                live=a2
                g=$(gap "$tm")
                echo "BENCH migrate b->a activate=ublkctl-at-completion activate_ms=$act_ms migration_s=$(awk -v a="$tm" -v b="$t_done" 'BEGIN { printf "%.1f", b - a }') longest_ack_gap_wall_s/guest_s=$g" |
                    tee -a "$R/bench.txt"
                ra=$(role a "$ID_A") rb=$(role b "$ID_B")
                if [[ $ra == writer && $rb == standby ]]; then
                    pass "migrate-back-activated-at-completion (activate $act_ms ms, roles a '$ra' b '$rb', longest ACK gap $g s)"
                else fail migrate-back-activated-at-completion "roles a '$ra' b '$rb'"; fi
            else fail migrate-back-activated-at-completion "activate rc $act_rc: $act; $(n_acks) ACKs; see gvm-a2.log"; fi
        else fail migrate-back-activated-at-completion "migration did not complete: $(tail -5 "$R/migrate-b.txt")"; fi
    fi
fi

# ---- clean stop, then the device checked from outside --------------------
log "stop the guest ($live)"
printf 'STOP' | dd of="$W/ctl.img" conv=notrunc status=none
end=$((SECONDS + 600))
while ((SECONDS < end)) && kill -0 "${QPID[$live]}" 2>/dev/null; do sleep 1; done
if grep -q 'GVM UMOUNTED' "$R/gvm-$live.log" && ! kill -0 "${QPID[$live]}" 2>/dev/null; then
    pass "guest-clean-shutdown ($(grep -ho 'GVM DONE [0-9]*' "$R/gvm-$live.log"))"
else fail guest-clean-shutdown "see gvm-$live.log: $(tail -3 "$R/gvm-$live.log")"; fi
for p in "${QPID[@]}"; do kill "$p" 2>/dev/null; done
wait "${QPID[@]}" 2>/dev/null
QPID=()
# Nothing cached in this kernel for either device may stand in for what
# the guest wrote through the other (O_DIRECT writes only invalidate the
# cache of the device they went through).
blockdev --flushbufs "$DEV_A" ${DEV_B:+"$DEV_B"} 2>/dev/null
echo 3 >/proc/sys/vm/drop_caches
if timeout 300 e2fsck -fn "$DEV_A" >"$R/e2fsck.log" 2>&1; then pass "e2fsck-clean ($DEV_A)"
else fail e2fsck-clean "see e2fsck.log: $(tail -3 "$R/e2fsck.log")"; fi
acks | cut -d' ' -f1 >"$W/acked"
if timeout 60 mount -o ro "$DEV_A" "$W/mnt" && cp "$W/mnt/records" "$W/records"; then
    umount "$W/mnt"
    missing=$(python3 -c '
import sys
acked = set(open(sys.argv[1]).read().split()); have = set(open(sys.argv[2]).read().split())
print(len(acked - have))' "$W/acked" "$W/records")
    n=$(wc -l <"$W/acked")
    if ((missing == 0 && n > 0)); then pass "every-acked-record-present ($n ACKed, $(wc -l <"$W/records") in the file)"
    else fail every-acked-record-present "$missing of $n ACKed records missing"; fi
else fail every-acked-record-present "cannot mount $DEV_A read-only"; fi
if errs=$(console_errors); then fail guest-console-clean "$(echo "$errs" | head -5)"
else pass "guest-console-clean (no I/O or ext4 error in the nested guest)"; fi
dmesg >"$R/dmesg-scenario.log"
if errs=$(kernel_errors); then fail dmesg-clean "$(echo "$errs" | head -5)"
else pass "dmesg-clean (no I/O, ext4 or ublk error in the VM's kernel log)"; fi
echo "ACKs: $(n_acks), longest ACK gap over the whole run $(gap 0) s (wall/guest)"

# ---- the standby's ublkd stopped: the writer keeps the role --------------
# host-b's device is a standby again since the migration back, added with
# --activate-on-write. Its ublkd's SIGTERM (on_shutdown = "keep" flushes
# every device) must not take the role from host-a, etcd running.
if [[ $live == a2 ]]; then
    kill -TERM "$PID_B"; wait "$PID_B" 2>/dev/null; PID_B=
    ra=$(role a "$ID_A")
    # A write that changes nothing (block 0 read back) on host-a's device.
    if [[ $ra == writer ]] && dd if="$DEV_A" of="$W/blk0" bs=4096 count=1 iflag=direct status=none &&
        dd if="$W/blk0" of="$DEV_A" bs=4096 count=1 oflag=direct conv=notrunc status=none 2>"$W/blk0.err"; then
        pass "standby-shutdown-keeps-writer (host-b's ublkd stopped; host-a still writer and writing)"
    else fail standby-shutdown-keeps-writer "host-a role '$ra' ($(role_reason a "$ID_A")), write: $(cat "$W/blk0.err" 2>/dev/null); host-b's log: $(grep -E 'handover_asked|flush_failed|writer.acquired' "$R/ublkd-b.log" | tail -2 | cut -c1-240)"; fi
fi

echo "---- summary ($((SECONDS - t0)) s) ----"
printf '%s\n' "${summary[@]}"
exit $((failures > 0))
