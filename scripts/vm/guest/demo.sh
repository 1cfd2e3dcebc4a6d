#!/usr/bin/env bash
# The demo itself: arenad + ublkd with temporary configs, one device, an
# ext4 filesystem with files whose checksums are verified after a remount,
# `ublkctl list` and `stats`, then cleanup. Runs on any host with ublk_drv
# (scripts/demo runs it directly there, or inside the VM otherwise).
set -euo pipefail

REPO=${UBLK_VM_REPO:-$(cd "$(dirname "$0")/../../.." && pwd)}
BIN=$REPO/target/release
W=$(mktemp -d /tmp/ublk-demo.XXXX)
SOCK=$W/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PEER=127.0.0.1:7171
LOGS=${UBLK_VM_RESULTS:-$W}
say() { printf '\n== %s\n' "$*"; }

cleanup() {
    set +e
    mountpoint -q "$W/mnt" && umount "$W/mnt"
    [[ -n "${ID:-}" ]] && ctl del "$ID" >/dev/null 2>&1
    [[ -n "${UBLKD_PID:-}" ]] && kill "$UBLKD_PID" && wait "$UBLKD_PID"
    [[ -n "${ARENAD:-}" ]] && kill "$ARENAD" && wait "$ARENAD"
    rm -rf "$W"
}
trap cleanup EXIT

mkdir -p "$W/mnt" "$W/swap" "$W/state"
head -c 32 /dev/urandom | base64 >"$W/demo.key"
chmod 600 "$W/demo.key"
cat >"$W/arenad.toml" <<TOML
listen = "$PEER"
arena_bytes = "64M"
blob_bytes = "1M"
swap_dir = "$W/swap"
swap_bytes = "256M"
[[volume]]
name = "demo"
secret_file = "$W/demo.key"
quota = "256M"
TOML
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
on_shutdown = "remove"
TOML

say "starting arenad ($PEER) and ublkd (socket $SOCK)"
"$BIN/arenad" --config "$W/arenad.toml" >"$LOGS/demo-arenad.log" 2>&1 &
ARENAD=$!
start_ublkd "$LOGS/demo-ublkd.log" || { echo "demo: ublkd did not start; see $LOGS/demo-ublkd.log"; exit 1; }

say "ublkctl add --peer $PEER --volume demo --size 128M --queues 2"
DEV=$(ctl add --peer "$PEER" --volume demo --secret-file "$W/demo.key" --size 128M --queues 2 --depth 32)
ID=${DEV#/dev/ublkb}
echo "$DEV"
for _ in $(seq 200); do [[ -b "$DEV" ]] && break; sleep 0.05; done

say "mkfs.ext4 $DEV, mount, write files"
timeout 300 mkfs.ext4 -q -F "$DEV"
mount "$DEV" "$W/mnt"
mkdir "$W/mnt/files"
for i in 1 2 3 4; do head -c $((i * 1024 * 1024)) /dev/urandom >"$W/mnt/files/blob$i.bin"; done
cp -a "$REPO/docs" "$W/mnt/files/docs"
(cd "$W/mnt/files" && find . -type f -print0 | sort -z | xargs -0 sha256sum) >"$W/sums"
echo "$(wc -l <"$W/sums") files written"
sync
umount "$W/mnt"

say "e2fsck -fn, remount, verify checksums"
timeout 300 e2fsck -fn "$DEV"
mount "$DEV" "$W/mnt"
(cd "$W/mnt/files" && sha256sum --quiet -c "$W/sums")
echo "all $(wc -l <"$W/sums") checksums match"

say "ublkctl list"
ctl list
say "ublkctl stats $ID"
ctl stats "$ID"

say "verified filesystem on $DEV: $(df -h "$W/mnt" | tail -1)"
[[ "$DEV" == /dev/ublkb0 ]] || echo "(note: the device is $DEV, not /dev/ublkb0: another ublk device existed)"
say "cleaning up (umount, ublkctl del $ID, stop daemons)"
