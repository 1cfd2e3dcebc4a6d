#!/bin/sh
# /init of the VM harness initramfs (busybox sh); packed by scripts/vm/mkinitramfs.
# Not meant to run on the host.
#
# Kernel command line (set by scripts/vm/run):
#   ublkvm.results=ABS   host path of the writable results share (mount_tag results)
#   ublkvm.script=ABS    guest script, run with bash inside `chroot /host`
#   ublkvm.timeout=SECS  timeout for the guest script
# The guest script's environment comes from ABS_RESULTS/vm.env; its output
# goes to ABS_RESULTS/guest.log, the kernel log to ABS_RESULTS/dmesg.log and
# its exit status to ABS_RESULTS/exit-code (written last).
export PATH=/sbin:/bin:/usr/sbin:/usr/bin

say() { echo "vm-init: $*"; }
halt() { sync; poweroff -f; sleep 10; }
die() { say "FATAL: $*"; halt; }

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
# The kernel runs this for request_module(); 6.12's rxe requests crc32.
echo /sbin/modprobe >/proc/sys/kernel/modprobe

results='' script='' timeout=600
read -r cmdline </proc/cmdline
# shellcheck disable=SC2086 # split the command line into words
for w in $cmdline; do
    case $w in
    ublkvm.results=*) results=${w#*=} ;;
    ublkvm.script=*) script=${w#*=} ;;
    ublkvm.timeout=*) timeout=${w#*=} ;;
    esac
done
[ -n "$results" ] || die "no ublkvm.results= on the kernel command line"
[ -n "$script" ] || die "no ublkvm.script= on the kernel command line"
kver=$(uname -r)

while read -r m; do
    modprobe "$m" || say "FAIL modprobe $m"
done </etc/vm-modules.load
while read -r m; do
    modprobe "$m" 2>/dev/null || say "note: optional module $m not loaded"
done </etc/vm-modules.optional
ip link set lo up

o=trans=virtio,version=9p2000.L,msize=262144
mkdir -p /host
mount -t 9p -o "$o,ro,cache=loose" host /host || die "cannot mount the host root (9p tag host)"
# /tmp is the host's /tmp seen through a tmpfs overlay: a checkout or a
# results dir under the host's /tmp (where CI may clone) stays visible at the
# same path, and the guest's writes stay in the guest.
mkdir -p /ovl && mount -t tmpfs tmpfs /ovl && mkdir -p /ovl/up /ovl/work
mount -t overlay overlay -o lowerdir=/host/tmp,upperdir=/ovl/up,workdir=/ovl/work /host/tmp ||
    die "overlay on /host/tmp"
mount -t tmpfs tmpfs /host/run || die "tmpfs /host/run"
mount -o rbind /proc /host/proc || die "bind /proc"
mount -o rbind /sys /host/sys || die "bind /sys"
mount -o rbind /dev /host/dev || die "bind /dev"
# Let the chroot's kmod find this kernel's modules (same files as ours):
# always as `modprobe -d /run/ublk-vm`, and at /lib/modules when the host
# has that dir to mount over.
mkdir -p "/host/run/ublk-vm/lib/modules/$kver"
mount -o bind "/lib/modules/$kver" "/host/run/ublk-vm/lib/modules/$kver" ||
    say "note: could not expose modules at /run/ublk-vm"
if [ -d /host/lib/modules ] && mount -t tmpfs tmpfs /host/lib/modules; then
    mkdir -p "/host/lib/modules/$kver"
    mount -o bind "/lib/modules/$kver" "/host/lib/modules/$kver" ||
        say "note: could not expose modules at /lib/modules"
fi
mkdir -p "/host$results" 2>/dev/null
mount -t 9p -o "$o,rw" results "/host$results" || die "cannot mount results at $results (9p tag results)"

R=/host$results
say "running $script (timeout ${timeout}s)"
# shellcheck disable=SC2016 # $1/$2 expand in the inner bash
chroot /host /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp TERM=dumb LANG=C.UTF-8 \
    /usr/bin/timeout -k 10 "$timeout" \
    /bin/bash -c 'set -a; . "$1"; set +a; cd "$UBLK_VM_REPO" && exec /bin/bash "$2"' \
    vm-guest "$results/vm.env" "$script" \
    >"$R/guest.log" 2>&1 </dev/null
rc=$?
dmesg >"$R/dmesg.log" 2>&1
echo "$rc" >"$R/exit-code"
say "guest script exited with $rc"
halt
