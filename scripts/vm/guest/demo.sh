#!/usr/bin/env bash
# The demo itself: arenad + ublkd with temporary configs, one device, an
# ext4 filesystem with files whose checksums are verified after a remount,
# /ready and /metrics of both daemons, `ublkctl list` and `stats`, then
# cleanup. Runs on any host with ublk_drv (scripts/demo runs it directly
# there, or inside the VM otherwise). Every step prints the exact command
# it runs (`$ ...`, ready to paste while the demo runs); the last line is
# the verdict, `demo: PASS ...` or `demo: FAIL ...`. In the VM the verdict
# goes to $UBLK_VM_RESULTS/verdict for scripts/demo to print last.
set -euo pipefail

REPO=${UBLK_VM_REPO:-$(cd "$(dirname "$0")/../../.." && pwd)}
BIN=$REPO/target/release
W=$(mktemp -d /tmp/ublk-demo.XXXX)
SOCK=$W/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PEER=127.0.0.1:7171
ARENAD_METRICS=127.0.0.1:9578
UBLKD_METRICS=127.0.0.1:9577
LOGS=${UBLK_VM_RESULTS:-$W}
STEP='' NSTEPS=9 N=0 SUMMARY=''

step() { N=$((N + 1)); STEP=$*; printf '\n== %d/%d %s\n' "$N" "$NSTEPS" "$*"; }
# show CMD...: print CMD as a shell line that can be pasted.
show() { printf '$'; printf ' %q' "$@"; printf '\n'; }
run() { show "$@"; "$@"; }
show_bg() { show "$@" | sed 's/$/ \&/'; }
ready() { # ready NAME ADDR: prints /ready; succeeds on 200.
    local code
    show curl -s "http://$2/ready"
    code=$(curl -s -o "$W/ready.json" -w '%{http_code}' "http://$2/ready" || true)
    printf '%s (HTTP %s)\n' "$(cat "$W/ready.json" 2>/dev/null)" "$code"
    [[ "$code" == 200 ]]
}

verdict() {
    local line=$1
    if [[ -n "${UBLK_VM_RESULTS:-}" && "${UBLK_VM:-0}" == 1 ]]; then
        printf '%s\n' "$line" >"$UBLK_VM_RESULTS/verdict"
    else
        printf '\n%s\n' "$line"
    fi
}
cleanup() {
    local rc=$?
    set +e
    printf '\n== cleanup (umount, ublkctl del, stop daemons)\n'
    mountpoint -q "$W/mnt" && umount "$W/mnt"
    [[ -n "${ID:-}" ]] && ctl del "$ID" >/dev/null 2>&1
    [[ -n "${UBLKD_PID:-}" ]] && kill "$UBLKD_PID" && wait "$UBLKD_PID"
    [[ -n "${ARENAD:-}" ]] && kill "$ARENAD" && wait "$ARENAD"
    # Keep the work dir (configs, daemon logs) of a failed run outside the VM.
    [[ $rc -eq 0 || "$LOGS" != "$W" ]] && rm -rf "$W"
    if [[ $rc -eq 0 ]]; then
        verdict "demo: PASS: $SUMMARY"
    else
        verdict "demo: FAIL at step $N/$NSTEPS ($STEP), exit status $rc; daemon logs: $LOGS/demo-arenad.log, $LOGS/demo-ublkd.log"
    fi
}
trap cleanup EXIT

mkdir -p "$W/mnt" "$W/swap" "$W/state"
(umask 077 && head -c 32 /dev/urandom | base64 >"$W/demo.key")
cat >"$W/arenad.toml" <<TOML
listen = "$PEER"
arena_bytes = "64M"
blob_bytes = "1M"
swap_dir = "$W/swap"
swap_bytes = "256M"
metrics_listen = "$ARENAD_METRICS"
[[volume]]
name = "demo"
secret_file = "$W/demo.key"
quota = "256M"
TOML
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
on_shutdown = "remove"
[metrics]
listen = "$UBLKD_METRICS"
TOML

step "start arenad: the arena peer on $PEER (configs and key in $W)"
show_bg "$BIN/arenad" --config "$W/arenad.toml"
"$BIN/arenad" --config "$W/arenad.toml" >"$LOGS/demo-arenad.log" 2>&1 &
ARENAD=$!
show_bg "$BIN/ublkd" --config "$W/ublkd.toml"
start_ublkd "$LOGS/demo-ublkd.log" || { echo "ublkd did not start; see $LOGS/demo-ublkd.log"; exit 1; }
for _ in $(seq 100); do curl -sf -o /dev/null "http://$ARENAD_METRICS/ready" && break; sleep 0.1; done

step "both daemons answer /ready"
ready arenad "$ARENAD_METRICS"
ready ublkd "$UBLKD_METRICS"

step "add a 128M device backed by volume demo"
show "$BIN/ublkctl" --socket "$SOCK" add --peer "$PEER" --volume demo --secret-file "$W/demo.key" \
    --size 128M --queues 2 --depth 32
DEV=$(ctl add --peer "$PEER" --volume demo --secret-file "$W/demo.key" --size 128M --queues 2 --depth 32)
ID=${DEV#/dev/ublkb}
echo "$DEV"
wait_node "$DEV"

step "mkfs.ext4, mount, write files"
run timeout 300 mkfs.ext4 -q -F "$DEV"
run mount "$DEV" "$W/mnt"
mkdir "$W/mnt/files"
for i in 1 2 3 4; do head -c $((i * 1024 * 1024)) /dev/urandom >"$W/mnt/files/blob$i.bin"; done
cp -a "$REPO/docs" "$W/mnt/files/docs"
(cd "$W/mnt/files" && find . -type f -print0 | sort -z | xargs -0 sha256sum) >"$W/sums"
FILES=$(wc -l <"$W/sums")
echo "$FILES files written (4 random blobs of 1-4 MiB and docs/)"
run sync
run umount "$W/mnt"

step "e2fsck, remount, verify every checksum"
run timeout 300 e2fsck -fn "$DEV"
run mount "$DEV" "$W/mnt"
(cd "$W/mnt/files" && sha256sum --quiet -c "$W/sums")
echo "all $FILES checksums match"

step "ublkctl list"
run "$BIN/ublkctl" --socket "$SOCK" list

step "ublkctl stats $ID"
run "$BIN/ublkctl" --socket "$SOCK" stats "$ID"

step "/metrics: the requests ublkd served and the arena's operations"
show curl -s "http://$UBLKD_METRICS/metrics"
curl -s "http://$UBLKD_METRICS/metrics" >"$W/ublkd.prom"
grep -E '^ublk_io_requests_total' "$W/ublkd.prom"
REQS=$(awk '/^ublk_io_requests_total/ { s += $2 } END { print s + 0 }' "$W/ublkd.prom")
show curl -s "http://$ARENAD_METRICS/metrics"
curl -s "http://$ARENAD_METRICS/metrics" >"$W/arenad.prom"
grep -E '^arenad_ops_total\{.*outcome="ok"' "$W/arenad.prom"
grep -E '^arenad_ops_total\{op="read",outcome="not_found"' "$W/arenad.prom" || true
echo "(three read counts, three layers: ublkctl stats and ublk_io_requests_total count the"
echo " kernel's block requests; the data-path line counts payload requests to arenad, more"
echo " when a block request spans two blobs; arenad_ops_total counts those by outcome:"
echo " ok for a blob that exists, not_found for one never written, which reads as zeros)"
[[ $REQS -gt 0 ]]

step "the filesystem, still mounted"
run df -h "$W/mnt"
ready ublkd "$UBLKD_METRICS"
SUMMARY="ext4 on $DEV (128M in arena volume demo) survived e2fsck and a remount with all $FILES checksums intact; $REQS block requests served, /ready 200 on both daemons"
[[ "$DEV" == /dev/ublkb0 ]] || SUMMARY+=" (the device is $DEV: another ublk device existed)"
