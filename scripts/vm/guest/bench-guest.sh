#!/usr/bin/env bash
# Benchmark (not a test), run inside the VM by scripts/bench-guest: what a
# QEMU guest sees of a replicated /dev/ublkbN (N=2 over TCP: a real etcd,
# two arenad on loopback, swap on the emulated NVMe disk) against a raw
# file on the VM's own NVMe disk, one nested guest, same boot. Both are
# attached the way docs/OPERATIONS.md says (format=raw, if=virtio,
# cache=none, aio=native), both filled with random bytes first; the guest
# (scripts/vm/nested/init.sh, gvm.mode=fio) runs the VM's fio from a 9p
# share of the VM's root: 4 KiB random writes and reads at QD1 and QD32,
# O_DIRECT, BENCH_RUNTIME seconds each (default 15), and writes fio's JSON
# report to a third disk. Prints `BENCH guest-fio` lines (IOPS and mean
# and p99 completion latency per job, device and file) and one ratio line
# per job; fio.json in the results.
set -u

BIN=${UBLK_E2E_BIN:-$UBLK_VM_REPO/target/release}
R=${UBLK_VM_RESULTS:-/tmp/bench-guest-results}
W=$(mktemp -d /tmp/ublk-bguest.XXXXXX)
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PEERS=(127.0.0.1:7071 127.0.0.1:7072)
ETCD=127.0.0.1:2379
RUNTIME=${BENCH_RUNTIME:-15}
CACHE=$("$UBLK_VM_REPO/scripts/vm/cache-dir")
KERNEL=$CACHE/kernel/$UBLK_VM_KVER/vmlinux
INITRD=${GVM_INITRD:-}
declare -a ARENAD_PIDS=()

mkdir -p "$R" "$W"/{state,run,etcd}
log() { printf '%s bench-guest: %s\n' "$(date +%T)" "$*" >&2; }
die() { echo "bench-guest: $*" >&2; exit 1; }
for b in arenad ublkd ublkctl; do [[ -x "$BIN/$b" ]] || die "missing $BIN/$b: run scripts/bench-guest"; done
[[ -f "$KERNEL" && -f "$INITRD" ]] || die "no nested kernel/initramfs ($KERNEL, '$INITRD'): run scripts/bench-guest"
command -v fio >/dev/null || die "fio missing"
swap_disk "$W/disk" || die "swap_dir on NVMe"

printf 'bench-guest-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
for i in 0 1; do
    mkdir -p "$W/disk/swap$i"
    cat >"$W/arenad$i.toml" <<TOML
listen = "${PEERS[$i]}"
arena_bytes = "256M"
blob_bytes = "256K"
swap_dir = "$W/disk/swap$i"
swap_bytes = "512M"
[[volume]]
name = "bench"
secret_file = "$W/vol.key"
quota = "1G"
TOML
done
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
[device]
queues = 1
depth = 64
io_buf = "1M"
[etcd]
endpoints = ["http://$ETCD"]
host_id = "host-a"
TOML

cleanup() {
    [[ -n "${QPID:-}" ]] && kill "$QPID" 2>/dev/null
    [[ -n "${UBLKD_PID:-}" ]] && kill "$UBLKD_PID" 2>/dev/null
    for p in "${ARENAD_PIDS[@]}" "${ETCD_PID:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    mountpoint -q "$W/disk" && umount "$W/disk"
}
trap cleanup EXIT

start_etcd "$ETCD" "$W/etcd/data" "$R/etcd.log" || die "etcd did not become healthy; see etcd.log"
for i in 0 1; do start_peer "$i" || die "arenad $i did not listen; see arenad$i.log"; done
start_ublkd "$R/ublkd.log" || die "ublkd did not come up; see ublkd.log"
DEV=$(add_when_etcd --wait --peer "${PEERS[0]}" --peer "${PEERS[1]}" --volume bench \
    --secret-file "$W/vol.key" --size 128M --transport tcp 2>"$R/add.err")
[[ "$DEV" =~ ^/dev/ublkb[0-9]+$ && -b "$DEV" ]] || die "add: $(cat "$R/add.err")"
RAW=$W/disk/raw.img
# Every block fio touches holds data on both, so no read is of a hole.
for t in "$DEV" "$RAW"; do
    dd if=/dev/urandom of="$t" bs=1M count=64 oflag=direct conv=notrunc status=none || die "fill $t"
done
truncate -s 1M "$W/out.img"
log "etcd, 2 arenad, ublkd, $DEV (N=2, TCP) and $RAW filled; booting the guest"

t0=$SECONDS
qemu-system-x86_64 -accel tcg -cpu "${GVM_CPU:-qemu64}" -m 512M -smp 1 -display none -no-reboot -nic none \
    -kernel "$KERNEL" -initrd "$INITRD" \
    -append "console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off nokaslr no_timer_check tsc=reliable gvm.mode=fio gvm.runtime=$RUNTIME" \
    -drive "file=$DEV,format=raw,if=virtio,cache=none,aio=native" \
    -drive "file=$RAW,format=raw,if=virtio,cache=none,aio=native" \
    -drive "file=$W/out.img,format=raw,if=virtio" \
    -virtfs local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap \
    -serial "file:$R/gvm.log" </dev/null 2>"$R/qemu.err" &
QPID=$!
wait "$QPID"
QPID=
log "guest done after $((SECONDS - t0)) s: $(grep -a 'GVM FIO' "$R/gvm.log" | tr '\n' ' ')"
tr -d '\0' <"$W/out.img" >"$R/fio.json"
python3 - "$R/fio.json" "$DEV" <<'PY' || die "no fio report from the guest; see gvm.log and qemu.err in the results"
import json, sys
jobs = {j["jobname"]: j for j in json.load(open(sys.argv[1]))["jobs"]}
def fig(j):
    side = j["write"] if "write" in j["jobname"] else j["read"]
    c = side["clat_ns"]
    return side["iops"], c["mean"] / 1e3, c.get("percentile", {}).get("99.000000", 0) / 1e3
for name in sorted(jobs):
    iops, mean, p99 = fig(jobs[name])
    print(f"BENCH guest-fio job={name} iops={iops:.0f} clat_mean_us={mean:.0f} clat_p99_us={p99:.0f}")
for name in sorted(n for n in jobs if n.startswith("vda-")):
    dev, raw = fig(jobs[name]), fig(jobs["vdb-" + name[4:]])
    print(f"BENCH guest-fio ratio {name[4:]}: device ({sys.argv[2]}) / raw file IOPS {dev[0] / raw[0]:.2f}, mean latency {dev[1] / raw[1]:.2f}")
PY
