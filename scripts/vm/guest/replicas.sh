#!/usr/bin/env bash
# A replicated device (N=2) on the real kernel, run inside the VM by
# scripts/vm/replicas: a real etcd and two arenad processes on loopback,
# ublkd serving /dev/ublkbN on both. What a guest must not notice:
#   1. ext4 + `fio --verify` while one arenad is killed (`kill -9`): no I/O
#      error (fio, dmesg), the member recorded failed at a new epoch;
#      restarted, it is rebuilt and healthy again; `e2fsck -fn` clean.
#   2. PostgreSQL on that ext4, a client committing numbered rows, the
#      *other* arenad killed mid-loop (so from then on every read is served
#      by the rebuilt member): every commit succeeds, no PANIC, and after a
#      clean restart every acknowledged id is in the table; e2fsck clean.
#   3. Availability, PostgreSQL committing throughout: one arenad stopped
#      (SIGSTOP) for 30 s, then etcd stopped for 30 s (past the 15 s lease
#      TTL), then `kill -9` of ublkd and a restart with no ublkctl command.
#      No commit fails, the longest pause of each phase is printed (and
#      must stay far below request_timeout_ms), the stopped member is
#      failed and rebuilt, the writer rides the etcd outage and is
#      confirmed again, and every acknowledged id is in the table.
# Prints `PASS name` / `FAIL name` and exits non-zero if any failed.
set -u

BIN=${UBLK_E2E_BIN:-$UBLK_VM_REPO/target/release}
R=${UBLK_VM_RESULTS:-/tmp/replicas-results}
W=$(mktemp -d /tmp/ublk-rep.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
chmod 755 "$W"                        # the postgres user walks through it to its data dir
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PEERS=(127.0.0.1:7071 127.0.0.1:7072)
ETCD=127.0.0.1:2379
DEV_SIZE=${REP_DEV_SIZE:-192M}   # arena 64M per peer: swap is in play
failures=0
declare -a summary=() ARENAD_PIDS=()

mkdir -p "$R" "$W"/{state,run,mnt,etcd}
log() { printf '%s replicas: %s\n' "$(date +%T)" "$*" >&2; }
pass() { echo "PASS $1"; summary+=("PASS $1"); }
fail() { echo "FAIL $1${2:+ ($2)}"; summary+=("FAIL $1"); failures=$((failures + 1)); }
die() { fail "$1" "$2"; echo "---- summary ----"; printf '%s\n' "${summary[@]}"; exit 1; }

for b in arenad ublkd ublkctl; do
    [[ -x "$BIN/$b" ]] || die setup "missing $BIN/$b: run scripts/vm/replicas, which builds it"
done
for t in etcd etcdctl; do
    command -v "$t" >/dev/null || die setup "$t missing (scripts/vm/deps installs etcd-server etcd-client)"
done
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[[ -x "$PGBIN/postgres" ]] || die setup "PostgreSQL missing (scripts/vm/deps installs postgresql)"
[[ -c /dev/ublk-control ]] || die setup "/dev/ublk-control missing"
# Both peers' swap dirs on the emulated NVMe disk (one disk, two dirs).
swap_disk "$W/swap" || die setup "swap_dir on NVMe"

printf 'replicas-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
for i in 0 1; do
    mkdir -p "$W/swap/$i"
    cat >"$W/arenad$i.toml" <<TOML
listen = "${PEERS[$i]}"
arena_bytes = "64M"
blob_bytes = "256K"
swap_dir = "$W/swap/$i"
swap_bytes = "768M"
metrics_listen = "127.0.0.1:948$i"
[[volume]]
name = "rep"
secret_file = "$W/vol.key"
quota = "1G"
TOML
done
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
on_shutdown = "keep"
request_timeout_ms = 20000
[device]
queues = 2
depth = 16
io_buf = "1M"
[metrics]
listen = "127.0.0.1:9477"
[etcd]
endpoints = ["http://$ETCD"]
request_timeout_ms = 5000
dial_timeout_ms = 5000
lease_ttl_secs = 15
[replication]
rebuild_check_ms = 500
change_deadline_ms = 30000
coord_timeout_ms = 5000
TOML

# kill9_arenad I: the failure under test.
kill9_arenad() {
    kill -9 "${ARENAD_PIDS[$1]}"
    wait "${ARENAD_PIDS[$1]}" 2>/dev/null
    ARENAD_PIDS[$1]=
}
rep() { replica_fact "$ID" "$1"; }
# wait_rebuilt TIMEOUT_S: until both members are healthy and no rebuild runs.
wait_rebuilt() {
    local end=$((SECONDS + $1))
    while ((SECONDS < end)); do
        [[ "$(rep healthy)" == 2 && "$(rep rebuild)" == none ]] && return 0
        sleep 0.5
    done
    return 1
}
# Kernel-side I/O errors since the scenario began: what a guest would see.
kernel_errors() {
    dmesg | grep -iE 'I/O error|blk_update_request|EXT4-fs (error|warning)|Buffer I/O|ublk.*(error|fail|abort)|JBD2.*(error|abort)'
}
# Sectors the kernel has written to the device.
sectors_written() { awk '{print $7}' "/sys/block/ublkb$ID/stat"; }

PG_DATA=$W/mnt/pg
PG_SOCK=$W/pgsock
PG_LOG=$W/postgres.log
as_postgres() { setpriv --reuid=postgres --regid=postgres --clear-groups -- "$@"; }
pg_ctl() { as_postgres timeout 300 "$PGBIN/pg_ctl" -D "$PG_DATA" "$@"; }
pg_start() {
    pg_ctl start -w -t 280 -l "$PG_LOG" \
        -o "-c listen_addresses='' -c unix_socket_directories=$PG_SOCK -c fsync=on -c synchronous_commit=on"
}
# psql as the superuser over the socket, one statement.
pgq() { timeout 60 "$PGBIN/psql" -h "$PG_SOCK" -U postgres -d postgres -X -q -At -v ON_ERROR_STOP=1 -c "$1"; }
# The client: one session inserting ids 1, 2, ... one autocommit
# transaction each, until $W/pg-stop exists. psql runs the `\echo` after
# the INSERT returned, i.e. after the server acknowledged the commit; each
# acknowledged id is appended to $W/acked (guest tmpfs, not the device
# under test). The first error or silence ends the loop, noted in
# $W/pg-failed (ON_ERROR_STOP: psql exits on an error).
# $1: the id to start after (ids stay unique across loops). Each
# acknowledged id's time ($EPOCHREALTIME, no fork) goes to $W/acked-at.
commit_loop() {
    local i=${1:-0} line
    coproc PSQL { exec "$PGBIN/psql" -h "$PG_SOCK" -U postgres -d postgres -X -q -At -v ON_ERROR_STOP=1 2>>"$R/pg-client.err"; }
    while [[ ! -e "$W/pg-stop" ]]; do
        i=$((i + 1))
        printf 'INSERT INTO commits (id) VALUES (%d);\n\\echo acked %d\n' "$i" "$i" >&"${PSQL[1]}"
        if read -t 120 -r line <&"${PSQL[0]}" && [[ "$line" == "acked $i" ]]; then
            echo "$i" >>"$W/acked"
            echo "$i $EPOCHREALTIME" >>"$W/acked-at"
        else
            echo "$i ${line:-no answer}" >>"$W/pg-failed"
            break
        fi
    done
    exec {PSQL[1]}>&-
    wait "$PSQL_PID"
}
acked() { [[ -e "$W/acked" ]] && wc -l <"$W/acked" || echo 0; }
# longest_pause FROM TO: the longest gap, in seconds, between consecutive
# acknowledged commits from the last one before FROM to the first after TO
# ($EPOCHREALTIME values).
longest_pause() {
    awk -v from="$1" -v to="$2" '
        { t = $2 }
        t < from { prev = t; next }
        { if (prev != "" && t - prev > max) max = t - prev; prev = t; if (t > to) exit }
        END { printf "%.2f\n", max + 0 }' "$W/acked-at"
}
cleanup() {
    [[ -n "${LOOP_PID:-}" ]] && { touch "$W/pg-stop"; wait "$LOOP_PID" 2>/dev/null; }
    [[ -e "$PG_DATA/postmaster.pid" ]] && pg_ctl stop -m immediate >/dev/null 2>&1
    [[ -n "${FIO_PID:-}" ]] && kill "$FIO_PID" 2>/dev/null
    [[ -e "$PG_LOG" ]] && cp "$PG_LOG" "$R/"
    mountpoint -q "$W/mnt" && umount -l "$W/mnt"
    [[ -n "${UBLKD_PID:-}" ]] && { kill "$UBLKD_PID"; wait "$UBLKD_PID"; } 2>/dev/null
    for p in "${ARENAD_PIDS[@]}" "${ETCD_PID:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    mountpoint -q "$W/swap" && umount "$W/swap"
}
trap cleanup EXIT

t0=$SECONDS
dmesg -C
start_etcd "$ETCD" "$W/etcd/data" "$R/etcd.log" || die setup "etcd did not become healthy; see etcd.log"
for i in 0 1; do start_peer "$i" || die setup "arenad $i did not listen; see arenad$i.log"; done
start_ublkd "$R/ublkd.log" || die setup "ublkd did not come up; see ublkd.log"
log "etcd, 2 arenad, ublkd up after $((SECONDS - t0)) s"

DEV=$(add_when_etcd --wait --peer "${PEERS[0]}" --peer "${PEERS[1]}" --volume rep --secret-file "$W/vol.key" \
    --size "$DEV_SIZE" --transport tcp 2>"$R/add.err")
[[ "$DEV" =~ ^/dev/ublkb[0-9]+$ && -b "$DEV" ]] || die add "$(cat "$R/add.err")"
ID=${DEV#/dev/ublkb}
epoch0=$(rep epoch)
if [[ "$(rep states)" == "healthy healthy" && "$(rep active)" == 2 ]] &&
    ETCDCTL_API=3 etcdctl --endpoints "$ETCD" get /ublk/volumes/rep/membership --print-value-only >"$R/membership0.json" &&
    grep -q "\"epoch\":$epoch0" "$R/membership0.json"; then
    pass "add-replicated ($DEV on 2 peers, epoch $epoch0 in etcd)"
else die add-replicated "states $(rep states), etcd $(cat "$R/membership0.json")"; fi

# ---- 1: ext4 + fio verify, kill -9 of peer 1 mid-workload ---------------
log "ext4 + fio, kill -9 arenad 1"
timeout 300 mkfs.ext4 -q -F "$DEV" >"$R/mkfs.log" 2>&1 && timeout 60 mount "$DEV" "$W/mnt" ||
    die ext4-mount "$(cat "$R/mkfs.log")"
start_sectors=$(sectors_written)
timeout 900 fio --output="$R/fio-verify.txt" --directory="$W/mnt" --direct=1 --ioengine=libaio \
    --verify=crc32c --do_verify=1 --verify_state_save=0 --verify_fatal=1 --fsync=16 --end_fsync=1 \
    --bssplit=4k/40:64k/30:256k/15:1m/15 --iodepth=8 \
    --name=seq --rw=write --size=32M --name=rand --rw=randwrite --size=32M &
FIO_PID=$!
# Kill once fio has written 16 MiB (of 64) to the device: mid-workload by
# construction, whatever the speed of the emulated CPU.
while kill -0 "$FIO_PID" 2>/dev/null && (($(sectors_written) - start_sectors < 16 * 2048)); do sleep 0.1; done
if kill -0 "$FIO_PID" 2>/dev/null; then
    kill9_arenad 1
    mid=1
else mid=0; fi
wait "$FIO_PID"; fio_rc=$?; FIO_PID=
after_kill=$(rep states); epoch1=$(rep epoch)
if ((mid)) && [[ $fio_rc -eq 0 && "$after_kill" == "healthy failed" && $epoch1 -gt $epoch0 ]]; then
    pass "fio-verify-through-kill-9 (member failed at epoch $epoch1, fio verify ok)"
else fail fio-verify-through-kill-9 "mid=$mid fio_rc=$fio_rc states '$after_kill' epoch $epoch0 -> $epoch1; see fio-verify.txt"; fi

# ---- the killed peer back: rebuilt, healthy at a newer epoch -------------
log "restart arenad 1, rebuild"
rb0=$SECONDS
start_peer 1 || fail arenad-restart "see arenad1.log"
if wait_rebuilt 600; then
    pass "rebuild ($((SECONDS - rb0)) s for $DEV_SIZE; healthy healthy at epoch $(rep epoch))"
else fail rebuild "states '$(rep states)', remaining $(rep rebuild) after $((SECONDS - rb0)) s"; fi
timeout 60 umount "$W/mnt" && timeout 300 e2fsck -fn "$DEV" >"$R/e2fsck1.log" 2>&1 &&
    pass "e2fsck-clean-after-kill" || fail e2fsck-clean-after-kill "see e2fsck1.log"

# ---- 2: PostgreSQL commit loop, kill -9 of peer 0 mid-loop ---------------
log "postgresql"
pg_ok=1
timeout 60 mount "$DEV" "$W/mnt" || pg_ok=0
chmod 755 "$W/mnt"
mkdir -p "$PG_DATA" "$PG_SOCK" && chown postgres: "$PG_DATA" "$PG_SOCK" && chmod 700 "$PG_DATA"
touch "$PG_LOG" && chown postgres: "$PG_LOG"
if ((pg_ok)) && as_postgres timeout 600 "$PGBIN/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 --locale=C -N \
    >"$R/initdb.log" 2>&1 && sync && pg_start >"$R/pg_ctl.log" 2>&1 &&
    pgq "CREATE TABLE commits (id bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"; then
    pass "postgresql-on-replicated-ext4 ($("$PGBIN/postgres" --version))"
else die postgresql-start "see initdb.log, pg_ctl.log, postgres.log: $(tail -5 "$PG_LOG")"; fi
commit_loop &
LOOP_PID=$!
end=$((SECONDS + 300))
loop_runs() { kill -0 "$LOOP_PID" 2>/dev/null; }
while (($(acked) < 20 && SECONDS < end)) && loop_runs; do sleep 0.2; done
at_kill=$(acked)
loop_runs || fail commit-loop-before-kill "$(cat "$W/pg-failed" 2>/dev/null); see pg-client.err"
kill9_arenad 0
log "arenad 0 killed after $at_kill commits"
while (($(acked) < at_kill + 40 && SECONDS < end)) && loop_runs; do sleep 0.2; done
touch "$W/pg-stop"; wait "$LOOP_PID"; LOOP_PID=
n_acked=$(acked); n_failed=$([[ -e "$W/pg-failed" ]] && wc -l <"$W/pg-failed" || echo 0)
if ((n_failed == 0 && n_acked >= at_kill + 40)) && [[ "$(rep states)" == "failed healthy" ]]; then
    pass "commit-loop-through-kill-9 ($n_acked commits, $at_kill before the kill, 0 failed)"
else fail commit-loop-through-kill-9 "$n_acked acked, $n_failed failed, states '$(rep states)'; see pg-client.err"; fi
# A clean stop and start: the server must come back from its own files.
pg_ctl stop -m fast >>"$R/pg_ctl.log" 2>&1 && pg_start >>"$R/pg_ctl.log" 2>&1 ||
    fail postgresql-restart "$(tail -5 "$PG_LOG")"
pgq "SELECT id FROM commits ORDER BY id" >"$W/in-table" 2>>"$R/pg-client.err"
# (files, not <(...): the guest's devtmpfs has no /dev/fd)
sort "$W/acked" >"$W/acked.sorted"; sort "$W/in-table" >"$W/in-table.sorted"
missing=$(comm -23 "$W/acked.sorted" "$W/in-table.sorted" | wc -l)
if [[ -s "$W/in-table" && -s "$W/acked" && $missing -eq 0 ]] && cmp -s "$W/acked.sorted" "$W/in-table.sorted"; then
    pass "every-acknowledged-commit-present ($n_acked acknowledged, $(wc -l <"$W/in-table") rows)"
else fail every-acknowledged-commit-present "$missing of $n_acked acknowledged ids missing, $(wc -l <"$W/in-table") rows"; fi
if grep -q PANIC "$PG_LOG"; then fail postgresql-no-panic "$(grep PANIC "$PG_LOG" | head -3)"
else pass postgresql-no-panic; fi
pg_ctl stop -m fast >>"$R/pg_ctl.log" 2>&1
cp "$PG_LOG" "$R/"
timeout 60 umount "$W/mnt" && timeout 300 e2fsck -fn "$DEV" >"$R/e2fsck2.log" 2>&1 &&
    pass "e2fsck-clean-after-postgresql (read from the rebuilt member alone)" ||
    fail e2fsck-clean-after-postgresql "see e2fsck2.log"

# ---- redundancy restored again, and what the guest kernel saw ------------
log "restart arenad 0, rebuild"
rb0=$SECONDS
start_peer 0 || fail arenad-restart "see arenad0.log"
if wait_rebuilt 600; then pass "rebuild-again ($((SECONDS - rb0)) s, epoch $(rep epoch))"
else fail rebuild-again "states '$(rep states)', remaining $(rep rebuild)"; fi

# ---- 3: availability under PostgreSQL -----------------------------------
log "availability: PostgreSQL through a stopped member, a stopped etcd, a killed ublkd"
AV_S=${REP_OUTAGE_S:-30}
rm -f "$W/pg-stop" "$W/pg-failed"
av_ok=1
timeout 60 mount "$DEV" "$W/mnt" && pg_start >>"$R/pg_ctl.log" 2>&1 || { av_ok=0; fail availability-start "$(tail -5 "$PG_LOG")"; }
if ((av_ok)); then
    commit_loop "$n_acked" &
    LOOP_PID=$!
    n0=$(acked)
    end=$((SECONDS + 120))
    while (($(acked) < n0 + 20 && SECONDS < end)) && loop_runs; do sleep 0.2; done

    # A: a member that stops answering without dying.
    strag0=$(metric ublk_replica_stragglers_total)
    t_a=$EPOCHREALTIME
    kill -STOP "${ARENAD_PIDS[1]}"
    sleep "$AV_S"
    states_stopped=$(rep states)
    kill -CONT "${ARENAD_PIDS[1]}"
    t_a2=$EPOCHREALTIME
    sleep 3
    pause_a=$(longest_pause "$t_a" "$t_a2")
    strag1=$(metric ublk_replica_stragglers_total)
    echo "member stopped ${AV_S} s: longest commit pause $pause_a s, stragglers $strag0 -> $strag1" >"$R/pause-member.txt"
    if [[ ! -e "$W/pg-failed" && "$states_stopped" == "healthy failed" ]] && loop_runs &&
        awk -v p="$pause_a" 'BEGIN { exit !(p < 10) }' && ((${strag1%.*} > ${strag0%.*})); then
        pass "stopped-member-ejected (longest commit pause $pause_a s over ${AV_S} s of SIGSTOP; states '$states_stopped')"
    else fail stopped-member-ejected "pause $pause_a s, states '$states_stopped', stragglers $strag0 -> $strag1, $(cat "$W/pg-failed" 2>/dev/null)"; fi
    rb0=$SECONDS
    if wait_rebuilt 600; then pass "stopped-member-rebuilt ($((SECONDS - rb0)) s after SIGCONT)"
    else fail stopped-member-rebuilt "states '$(rep states)', remaining $(rep rebuild)"; fi

    # B: etcd stopped past the lease TTL, the membership unchanged.
    t_b=$EPOCHREALTIME
    kill -STOP "$ETCD_PID"
    sleep "$AV_S"
    role_out=$(rep role)
    n_during=$(acked)
    kill -CONT "$ETCD_PID"
    t_b2=$EPOCHREALTIME
    role_back=
    for _ in $(seq 120); do role_back=$(rep role); [[ "$role_back" == writer ]] && break; sleep 0.5; done
    pause_b=$(longest_pause "$t_b" "$t_b2")
    echo "etcd stopped ${AV_S} s: longest commit pause $pause_b s, role during '$role_out', after '$role_back'" >"$R/pause-etcd.txt"
    if [[ ! -e "$W/pg-failed" && "$role_out" == unconfirmed && "$role_back" == writer ]] && loop_runs &&
        awk -v p="$pause_b" 'BEGIN { exit !(p < 5) }'; then
        pass "etcd-outage-served (longest commit pause $pause_b s over ${AV_S} s without etcd; role unconfirmed, then writer again)"
    else fail etcd-outage-served "pause $pause_b s, role '$role_out' -> '$role_back', $(cat "$W/pg-failed" 2>/dev/null)"; fi

    # C: ublkd killed and restarted; nobody runs ublkctl recover.
    t_c=$EPOCHREALTIME
    kill -9 "$UBLKD_PID"; wait "$UBLKD_PID" 2>/dev/null
    start_ublkd "$R/ublkd-restarted.log" || fail ublkd-restart "see ublkd-restarted.log"
    st=
    for _ in $(seq 240); do st=$(show_field "$ID" state); [[ "$st" == live ]] && break; sleep 0.5; done
    n_c=$(acked)
    end=$((SECONDS + 120))
    while (($(acked) < n_c + 20 && SECONDS < end)) && loop_runs; do sleep 0.2; done
    pause_c=$(longest_pause "$t_c" "$EPOCHREALTIME")
    echo "ublkd kill -9 and restart: longest commit pause $pause_c s" >"$R/pause-ublkd.txt"
    if [[ "$st" == live && ! -e "$W/pg-failed" ]] && loop_runs && (($(acked) >= n_c + 20)); then
        pass "ublkd-restart-needs-no-command (live again, longest commit pause $pause_c s)"
    else fail ublkd-restart-needs-no-command "state '$st', $(cat "$W/pg-failed" 2>/dev/null); see ublkd-restarted.log"; fi

    touch "$W/pg-stop"; wait "$LOOP_PID"; LOOP_PID=
    n_acked=$(acked)
    pg_ctl stop -m fast >>"$R/pg_ctl.log" 2>&1 && pg_start >>"$R/pg_ctl.log" 2>&1 ||
        fail postgresql-restart-after-availability "$(tail -5 "$PG_LOG")"
    pgq "SELECT id FROM commits ORDER BY id" >"$W/in-table" 2>>"$R/pg-client.err"
    sort "$W/acked" >"$W/acked.sorted"; sort "$W/in-table" >"$W/in-table.sorted"
    missing=$(comm -23 "$W/acked.sorted" "$W/in-table.sorted" | wc -l)
    if [[ -s "$W/in-table" && $missing -eq 0 ]] && cmp -s "$W/acked.sorted" "$W/in-table.sorted"; then
        pass "every-commit-present-after-availability ($n_acked acknowledged in all)"
    else fail every-commit-present-after-availability "$missing of $n_acked acknowledged ids missing"; fi
    grep -q PANIC "$PG_LOG" && fail postgresql-no-panic-availability "$(grep PANIC "$PG_LOG" | head -3)"
    pg_ctl stop -m fast >>"$R/pg_ctl.log" 2>&1
    timeout 60 umount "$W/mnt" && timeout 300 e2fsck -fn "$DEV" >"$R/e2fsck3.log" 2>&1 &&
        pass "e2fsck-clean-after-availability" || fail e2fsck-clean-after-availability "see e2fsck3.log"
fi
ctl --json show "$ID" >"$R/show.json" 2>&1
dmesg >"$R/dmesg-scenario.log"
if errs=$(kernel_errors); then fail dmesg-clean "$(echo "$errs" | head -5)"
else pass "dmesg-clean (no I/O, ext4 or ublk errors in the guest kernel log)"; fi

if out=$(ctl del --all 2>&1) && [[ "$out" == "deleted $DEV" ]]; then pass "ctl-del-all ($out)"
else fail ctl-del-all "$out"; fi

echo "---- summary ($((SECONDS - t0)) s) ----"
printf '%s\n' "${summary[@]}"
exit $((failures > 0))
