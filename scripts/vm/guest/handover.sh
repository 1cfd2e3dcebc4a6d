#!/usr/bin/env bash
# Hand-over of a replicated volume's writer role between two ublkd on the
# real kernel (docs/REPLICATION.md "Hand-over"), run inside the VM by
# scripts/vm/handover; no guest VM yet, just block I/O on /dev/ublkbN:
#   a real etcd, two arenad on loopback, ublkd A (host-a) the writer of
#   volume "ho" (N=2), ublkd B (host-b, its own state dir, socket, metrics
#   port) with `add --standby` of the same volume (no --peer: a standby
#   follows the members the volume's record in etcd names).
#   1. B's standby device serves reads (A's records, O_DIRECT) and refuses
#      a write (EIO); `show` says standby on B, writer on A.
#   2. Two writers (4 KiB and 64 KiB numbered records, O_DIRECT, each
#      acknowledged record logged with its time) write on A; each moves to
#      the other device when its write fails, retrying the same record,
#      as a migrating guest would. `ublkctl activate` on B under that load:
#      the writers land on B, A's device refuses writes and says standby.
#      The pause (A's last acknowledged write to B's first) and the
#      activate command's duration are printed as `BENCH handover` lines.
#   3. Hand back: `ublkctl activate` on A under load.
#   4. Every acknowledged record read back (O_DIRECT) on both devices.
#   5. The old writer killed mid-hand-over: `ublkctl activate` on B, then
#      `kill -9` of ublkd A at once; B gets the role (at the latest when
#      A's etcd lease expires: lease_ttl_secs HO_LEASE_TTL, default 4);
#      ublkd A restarted does not serve its device as a writer (it lists
#      it failed, "already served by" host-b, and `ublkctl del --force`
#      fails the writes queued in it; or it serves it as a standby), the
#      writers move to B, no acknowledged record lost.
# HO_TRANSPORT=tcp (default) or rdma (soft-RoCE on lo, as rdma-e2e.sh).
# Prints `PASS name` / `FAIL name` and exits non-zero if any failed.
set -u

BIN=${UBLK_E2E_BIN:-$UBLK_VM_REPO/target/release}
R=${UBLK_VM_RESULTS:-/tmp/handover-results}
W=$(mktemp -d /tmp/ublk-ho.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/a/run/ublkd.sock             # lib.sh's ctl; ctl_a / ctl_b below pick one
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PEERS=(127.0.0.1:7071 127.0.0.1:7072)
ETCD=127.0.0.1:2379
TRANSPORT=${HO_TRANSPORT:-tcp}
TTL=${HO_LEASE_TTL:-4}
MARGIN=${HO_LEASE_MARGIN_MS:-1000}
DEV_SIZE=128M
SMALL_BASE=0 SMALL_SLOTS=16384      # 4 KiB records in [0, 64M)
BIG_BASE=$((64 << 20)) BIG_SLOTS=768 # 64 KiB records in [64M, 112M)
PROBE_OFF=$((127 << 20))            # refused-write probes, outside both
failures=0
declare -a summary=() ARENAD_PIDS=() WRITER_PIDS=()

mkdir -p "$R" "$W"/{a,b}/{state,run} "$W"/etcd
log() { printf '%s handover: %s\n' "$(date +%T)" "$*" >&2; }
pass() { echo "PASS $1"; summary+=("PASS $1"); }
fail() { echo "FAIL $1${2:+ ($2)}"; summary+=("FAIL $1"); failures=$((failures + 1)); }
die() { fail "$1" "$2"; echo "---- summary ----"; printf '%s\n' "${summary[@]}"; exit 1; }

for b in arenad ublkd ublkctl; do
    [[ -x "$BIN/$b" ]] || die setup "missing $BIN/$b: run scripts/vm/handover, which builds it"
done
for t in etcd etcdctl python3; do
    command -v "$t" >/dev/null || die setup "$t missing (scripts/vm/deps installs etcd-server etcd-client)"
done
[[ -c /dev/ublk-control ]] || die setup "/dev/ublk-control missing"
swap_disk "$W/swap" || die setup "swap_dir on NVMe"

if [[ $TRANSPORT == rdma ]]; then
    /usr/sbin/ip link set lo up
    /usr/bin/rdma link add rxe0 type rxe netdev lo 2>"$R/rxe.err" || die setup "rdma link add: $(cat "$R/rxe.err")"
fi

printf 'handover-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
for i in 0 1; do
    mkdir -p "$W/swap/$i"
    cat >"$W/arenad$i.toml" <<TOML
listen = "${PEERS[$i]}"
arena_bytes = "128M"
blob_bytes = "256K"
swap_dir = "$W/swap/$i"
swap_bytes = "512M"
metrics_listen = "127.0.0.1:948$i"
$([[ $TRANSPORT == rdma ]] && printf 'rdma = "on"\nrdma_gid_index = 1\n')
[[volume]]
name = "ho"
secret_file = "$W/vol.key"
quota = "1G"
TOML
done
host_conf a 9477 2 "$([[ $TRANSPORT == rdma ]] && printf '[rdma]\ngid_index = 1\n')"
host_conf b 9478 2 "$([[ $TRANSPORT == rdma ]] && printf '[rdma]\ngid_index = 1\n')"

# rec TAG I BS: record I of writer TAG, BS bytes (text, space padded).
rec() { printf '%-*s\n' $(($3 - 1)) "$1 $2"; }
# write_at DEV OFF BS TAG I: one O_DIRECT write of a record.
write_at() {
    rec "$4" "$5" "$3" | timeout 120 dd of="$1" bs="$3" seek="$(($2 / $3))" count=1 \
        iflag=fullblock oflag=direct status=none 2>>"$R/writer-$4.err"
}
# writer TAG BS BASE SLOTS: numbered records I = 1, 2, ... at slot
# I % SLOTS, until $W/stop exists. It writes on DEVS[cur]; when a write
# fails it moves to the other device and retries the same record there
# (every 10 ms), as a guest that migrated would. Each acknowledged record
# is logged as "I DEVICE EPOCHREALTIME" in $W/acked-TAG, each failed
# attempt as "I DEVICE TIME" in $W/failed-TAG.
writer() {
    local tag=$1 bs=$2 base=$3 slots=$4 i=0 cur=0
    while [[ ! -e "$W/stop" ]]; do
        i=$((i + 1))
        while ! write_at "${DEVS[cur]}" $((base + (i % slots) * bs)) "$bs" "$tag" "$i"; do
            echo "$i ${DEVS[cur]} $EPOCHREALTIME" >>"$W/failed-$tag"
            cur=$((1 - cur))
            [[ -e "$W/stop" ]] && return 0
            sleep 0.01
        done
        echo "$i ${DEVS[cur]} $EPOCHREALTIME" >>"$W/acked-$tag"
    done
}
start_writers() {
    rm -f "$W/stop"
    writer s4k 4096 $SMALL_BASE $SMALL_SLOTS &
    WRITER_PIDS=($!)
    writer b64k 65536 $BIG_BASE $BIG_SLOTS &
    WRITER_PIDS+=($!)
}
stop_writers() {
    touch "$W/stop"
    local p
    for p in "${WRITER_PIDS[@]}"; do wait "$p" 2>/dev/null; done
    WRITER_PIDS=()
}
acked() { [[ -e "$W/acked-$1" ]] && wc -l <"$W/acked-$1" || echo 0; }
# acked_on TAG DEV: records of TAG acknowledged on DEV.
acked_on() { [[ -e "$W/acked-$1" ]] && awk -v d="$2" '$2 == d' "$W/acked-$1" | wc -l || echo 0; }
# wait_acked TAG DEV N TIMEOUT_S: until N more of TAG's records are
# acknowledged on DEV than now.
wait_acked() {
    local n0 end=$((SECONDS + $4))
    n0=$(acked_on "$1" "$2")
    while (($(acked_on "$1" "$2") < n0 + $3 && SECONDS < end)); do sleep 0.2; done
    (($(acked_on "$1" "$2") >= n0 + $3))
}
# switch_pause TAG FROM TO AFTER: seconds from TAG's last record
# acknowledged on FROM to its first on TO, the first such switch whose
# record was acknowledged after time AFTER.
switch_pause() {
    awk -v f="$2" -v t="$3" -v after="$4" '
        $3 < after { prev = $2; pt = $3; next }
        prev == f && $2 == t { printf "%.3f\n", $3 - pt; found = 1; exit }
        { prev = $2; pt = $3 }
        END { if (!found) print "none" }' "$W/acked-$1"
}
# verify DEV: every writer's last acknowledged record per slot reads back
# from DEV (O_DIRECT); prints "checked N" or the first mismatches.
verify() {
    python3 - "$1" "$W" <<'PY'
import mmap, os, sys
dev, w = sys.argv[1], sys.argv[2]
fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)
bad, n = [], 0
for tag, bs, base, slots in (("s4k", 4096, 0, 16384), ("b64k", 65536, 64 << 20, 768)):
    last = {}
    try:
        for line in open(f"{w}/acked-{tag}"):
            i = int(line.split()[0])
            last[i % slots] = i
    except FileNotFoundError:
        pass
    view = memoryview(buf)[:bs]
    for slot, i in sorted(last.items()):
        os.preadv(fd, [view], base + slot * bs)
        want = (f"{tag} {i}".ljust(bs - 1) + "\n").encode()
        n += 1
        if bytes(view) != want:
            bad.append(f"{tag} {i} slot {slot}: {bytes(view[:24])!r}")
print(f"checked {n}" if not bad else f"{len(bad)} of {n} bad: " + "; ".join(bad[:5]))
sys.exit(1 if bad else 0)
PY
}
# refuses_write DEV: an O_DIRECT write to DEV fails.
refuses_write() { ! rec probe 0 4096 | timeout 60 dd of="$1" bs=4096 seek=$((PROBE_OFF / 4096)) count=1 oflag=direct status=none 2>"$W/probe.err"; }
ms_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", (b - a) * 1000 }'; }

cleanup() {
    [[ ${#WRITER_PIDS[@]} -gt 0 ]] && { touch "$W/stop"; sleep 1; kill "${WRITER_PIDS[@]}" 2>/dev/null; }
    cp "$W"/acked-* "$W"/failed-* "$R/" 2>/dev/null
    local p ps=()
    for p in "${PID_A:-}" "${PID_B:-}" "${ARENAD_PIDS[@]}" "${ETCD_PID:-}"; do
        [[ -n "$p" ]] && kill "$p" 2>/dev/null && ps+=("$p")
    done
    # Only the daemons: a writer stuck in a device nobody serves would hold
    # a plain `wait` until the VM's timeout.
    ((${#ps[@]})) && wait "${ps[@]}" 2>/dev/null
    mountpoint -q "$W/swap" && umount "$W/swap"
}
trap cleanup EXIT

t0=$SECONDS
dmesg -C
start_etcd "$ETCD" "$W/etcd/data" "$R/etcd.log" || die setup "etcd did not become healthy; see etcd.log"
for i in 0 1; do start_peer "$i" || die setup "arenad $i did not listen; see arenad$i.log"; done
start_host a || die setup "ublkd A did not come up; see ublkd-a.log"
start_host b || die setup "ublkd B did not come up; see ublkd-b.log"
log "etcd, 2 arenad, 2 ublkd up after $((SECONDS - t0)) s ($TRANSPORT)"

DEV_A=$(SOCK=$W/a/run/ublkd.sock add_when_etcd --wait --peer "${PEERS[0]}" --peer "${PEERS[1]}" --volume ho \
    --secret-file "$W/vol.key" --size $DEV_SIZE --transport "$TRANSPORT" 2>"$R/add-a.err")
[[ "$DEV_A" =~ ^/dev/ublkb[0-9]+$ && -b "$DEV_A" ]] || die add-writer "$(cat "$R/add-a.err")"
ID_A=${DEV_A#/dev/ublkb}
# Records written by A before B exists: B's reads must see them.
for i in 1 2 3; do write_at "$DEV_A" $((SMALL_BASE + i * 4096)) 4096 s4k "$i" && echo "$i $DEV_A $EPOCHREALTIME" >>"$W/acked-s4k"; done
DEV_B=$(SOCK=$W/b/run/ublkd.sock add_when_etcd --wait --standby --volume ho --secret-file "$W/vol.key" \
    --size $DEV_SIZE --transport "$TRANSPORT" 2>"$R/add-b.err")
[[ "$DEV_B" =~ ^/dev/ublkb[0-9]+$ && -b "$DEV_B" ]] || die add-standby "$(cat "$R/add-b.err")"
ID_B=${DEV_B#/dev/ublkb}
DEVS=("$DEV_A" "$DEV_B")
ra=$(role a "$ID_A") rb=$(role b "$ID_B")
ta=$(dev_field a "$ID_A" transport) tb=$(dev_field b "$ID_B" transport)
if [[ $ra == writer && $rb == standby && $ta == "$TRANSPORT" && $tb == "$TRANSPORT" ]]; then
    pass "add-writer-and-standby ($DEV_A writer on host-a, $DEV_B standby on host-b, both serving over $ta)"
else die add-writer-and-standby "roles A '$ra' B '$rb' ($(role_reason b "$ID_B")), transports '$ta' '$tb'"; fi

# ---- 1: the standby reads, refuses writes --------------------------------
if out=$(verify "$DEV_B"); then pass "standby-reads-writer-data ($out records written by A)"
else fail standby-reads-writer-data "$out"; fi
if refuses_write "$DEV_B"; then pass "standby-refuses-write ($(head -c 120 "$W/probe.err"))"
else fail standby-refuses-write "a write to the standby $DEV_B succeeded"; fi
[[ $(role b "$ID_B") == standby && $(role a "$ID_A") == writer ]] ||
    fail roles-after-refused-write "A '$(role a "$ID_A")' B '$(role b "$ID_B")'"

# ---- 2: activate on B under load ----------------------------------------
log "writers on A, activate on B"
start_writers
wait_acked s4k "$DEV_A" 40 300 && wait_acked b64k "$DEV_A" 4 300 ||
    fail writers-on-a "s4k $(acked s4k), b64k $(acked b64k); see writer-*.err"
# handover FROM TO: `ublkctl activate` on host TO under load; checks the
# writers moved, the roles, FROM refusing writes; prints BENCH lines.
handover() {
    local from=$1 to=$2 t_act act_ms p_s p_b out
    local dev_from dev_to id_to id_from
    if [[ $from == a ]]; then dev_from=$DEV_A dev_to=$DEV_B id_from=$ID_A id_to=$ID_B
    else dev_from=$DEV_B dev_to=$DEV_A id_from=$ID_B id_to=$ID_A; fi
    t_act=$EPOCHREALTIME
    out=$(SOCK=$W/$to/run/ublkd.sock ctl activate "$id_to" 2>&1); local rc=$?
    act_ms=$(ms_since "$t_act")
    echo "$out" >"$R/activate-$from-$to.txt"
    if ((rc == 0)) && wait_acked s4k "$dev_to" 20 300 && wait_acked b64k "$dev_to" 3 300; then
        p_s=$(switch_pause s4k "$dev_from" "$dev_to" "$t_act")
        p_b=$(switch_pause b64k "$dev_from" "$dev_to" "$t_act")
        echo "BENCH handover $from->$to transport=$TRANSPORT activate_ms=$act_ms pause_4k_s=$p_s pause_64k_s=$p_b" |
            tee -a "$R/bench.txt"
        pass "handover-$from-to-$to-under-load (activate $act_ms ms, write pause 4k $p_s s, 64k $p_b s)"
    else
        fail "handover-$from-to-$to-under-load" "activate rc $rc ($act_ms ms): $out; acked on $dev_to: s4k $(acked_on s4k "$dev_to") b64k $(acked_on b64k "$dev_to")"
        return 1
    fi
    local rf rt
    rf=$(role "$from" "$id_from") rt=$(role "$to" "$id_to")
    if [[ $rf == standby && $rt == writer ]] && refuses_write "$dev_from"; then
        pass "old-writer-now-standby-$from (refuses writes: $(head -c 80 "$W/probe.err"); role reason: $(role_reason "$from" "$id_from"))"
    else fail "old-writer-now-standby-$from" "roles $from '$rf' $to '$rt', write refused: $(cat "$W/probe.err")"; fi
}
handover a b

# ---- 3: hand back to A --------------------------------------------------
log "activate on A (hand back)"
handover b a

# ---- 4: every acknowledged record, on both devices ----------------------
stop_writers
n_s=$(acked s4k) n_b=$(acked b64k)
if out_a=$(verify "$DEV_A") && out_b=$(verify "$DEV_B"); then
    pass "no-acknowledged-record-lost ($n_s 4k + $n_b 64k acknowledged; $out_a on A, $out_b on B; $(cat "$W"/failed-* 2>/dev/null | wc -l) refused attempts retried)"
else fail no-acknowledged-record-lost "A: ${out_a:-?} B: ${out_b:-?}"; fi

# ---- 5: the old writer killed in the middle of a hand-over --------------
log "writers on A, activate on B, kill -9 ublkd A"
start_writers
wait_acked s4k "$DEV_A" 20 300 || fail writers-on-a-again "s4k $(acked s4k)"
t_act=$EPOCHREALTIME
(SOCK=$W/b/run/ublkd.sock ctl activate "$ID_B" >"$R/activate-kill.txt" 2>&1; echo $? >"$W/activate-kill.rc"; echo "$EPOCHREALTIME" >"$W/activate-kill.end") &
ACT_PID=$!
sleep 0.05
kill -9 "$PID_A"; wait "$PID_A" 2>/dev/null
t_kill=$EPOCHREALTIME
wait "$ACT_PID"
act_rc=$(cat "$W/activate-kill.rc")
act_end=$(cat "$W/activate-kill.end")
act_ms=$(awk -v a="$t_act" -v b="$act_end" 'BEGIN { printf "%.0f", (b - a) * 1000 }')
kill_ms=$(awk -v a="$t_kill" -v b="$act_end" 'BEGIN { printf "%.0f", (b - a) * 1000 }')
last_a=$(awk -v d="$DEV_A" '$2 == d { t = $3 } END { print t }' "$W/acked-s4k")
rb=$(role b "$ID_B")
if [[ $act_rc == 0 && $rb == writer ]]; then
    pass "activate-with-writer-killed (role taken $act_ms ms after the request, $kill_ms ms after kill -9; lease TTL $TTL s)"
else fail activate-with-writer-killed "rc $act_rc, role '$rb': $(cat "$R/activate-kill.txt")"; fi
# The writers are stuck in A's device (ublkd A is gone, the kernel holds
# its requests for a recovery); A's host comes back. Its device's
# definition still says writer, the role is B's now: the restarted ublkd
# must not serve it as a writer. It lists it failed ("already served by
# ... host-b": docs/OPERATIONS.md, a failed device waits for the
# operator) or serves it as a standby / fenced.
start_host a || fail ublkd-a-restart "see ublkd-a.log"
st_a= role_a=
for _ in $(seq 240); do
    st_a=$(dev_state a "$ID_A") role_a=$(role a "$ID_A")
    [[ $st_a == failed || $role_a == standby || $role_a == fenced ]] && break
    sleep 0.5
done
if [[ $st_a == failed ]]; then
    pass "restarted-old-writer-does-not-write ($DEV_A listed failed: $(dev_reason a "$ID_A" | head -c 160))"
    # The operator's step for a failed device whose volume moved on: its
    # queued requests fail, and the writers move to B.
    if out=$(ctl_a del --force "$ID_A" 2>&1); then pass "old-writer-device-deleted ($out: its queued writes fail, nothing acknowledged)"
    else fail old-writer-device-deleted "$out"; fi
elif [[ $role_a == standby || $role_a == fenced ]]; then
    pass "restarted-old-writer-does-not-write ($DEV_A role '$role_a': $(role_reason a "$ID_A"))"
else fail restarted-old-writer-does-not-write "$DEV_A state '$st_a' role '$role_a'; see ublkd-a.log"; fi
if wait_acked s4k "$DEV_B" 20 300 && wait_acked b64k "$DEV_B" 3 300; then
    first_b=$(awk -v d="$DEV_B" -v after="$t_act" '$2 == d && $3 > after { print $3; exit }' "$W/acked-s4k")
    echo "BENCH handover a->b-killed transport=$TRANSPORT activate_ms=$act_ms after_kill_ms=$kill_ms lease_ttl_s=$TTL last_ack_a_to_first_ack_b_s=$(awk -v a="$last_a" -v b="$first_b" 'BEGIN { printf "%.3f", b - a }') (includes ublkd A's restart)" |
        tee -a "$R/bench.txt"
    pass "writers-on-new-writer-after-kill ($(acked_on s4k "$DEV_B") 4k records on B)"
else fail writers-on-new-writer-after-kill "acked on B: s4k $(acked_on s4k "$DEV_B") b64k $(acked_on b64k "$DEV_B"); state of A: $(ctl_a list 2>&1 | tr '\n' ' ')"; fi
stop_writers
if out=$(verify "$DEV_B"); then pass "no-acknowledged-record-lost-after-kill ($(acked s4k) 4k + $(acked b64k) 64k acknowledged in all; $out on B)"
else fail no-acknowledged-record-lost-after-kill "$out"; fi

ctl_a --json show "$ID_A" >"$R/show-a.json" 2>&1
ctl_b --json show "$ID_B" >"$R/show-b.json" 2>&1
dmesg >"$R/dmesg-scenario.log"
echo "---- summary ($((SECONDS - t0)) s) ----"
printf '%s\n' "${summary[@]}"
exit $((failures > 0))
