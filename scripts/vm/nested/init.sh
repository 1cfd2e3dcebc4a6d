#!/bin/sh
# /init of the nested guest (scripts/vm/mkinitramfs-nested): a QEMU guest
# that the VM scenarios run on /dev/ublkbN (guest-vm.sh, bench-guest.sh).
# Kernel command line: gvm.mode=boot (print the boot time, power off);
# gvm.mode=fio (bench-guest.sh): mount the VM's root (9p tag "host",
# read-only) and run its fio with its libraries: 4 KiB random writes and
# reads at QD1 and QD32, O_DIRECT, on /dev/vda (the device) and /dev/vdb
# (a raw file on the VM's disk), gvm.runtime seconds each, the JSON
# report written to /dev/vdc; or
# gvm.mode=run: mount ext4 from /dev/vda, append numbered records to
# /mnt/records, each with fsync (dd conv=fsync), printing "ACK N UPTIME"
# on the serial console after the fsync returned, until the first 4 bytes
# of /dev/vdb (the control disk, read with O_DIRECT) say STOP; then unmount
# and power off. Numbering continues from the file's last record.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo /sbin/modprobe >/proc/sys/kernel/modprobe
up() { cut -d' ' -f1 /proc/uptime; }
echo "GVM INIT $(up)"
for m in virtio_blk crc32c_generic ext4; do modprobe "$m" || echo "GVM FAIL modprobe $m"; done
mode=$(sed -n 's/.*gvm\.mode=\([a-z]*\).*/\1/p' /proc/cmdline)
if [ "$mode" = boot ]; then
    echo "GVM BOOTED $(up)"
    poweroff -f
fi
if [ "$mode" = fio ]; then
    for m in 9pnet_virtio 9p; do modprobe "$m" || echo "GVM FAIL modprobe $m"; done
    mkdir -p /host
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro host /host || { echo "GVM FAIL mount host"; poweroff -f; }
    n=0
    while [ ! -b /dev/vdc ]; do
        n=$((n + 1)); [ $n -gt 300 ] && { echo "GVM FAIL no /dev/vdc"; poweroff -f; }
        sleep 0.1
    done
    rt=$(sed -n 's/.*gvm\.runtime=\([0-9]*\).*/\1/p' /proc/cmdline)
    lib=/host/usr/lib/x86_64-linux-gnu
    set -- --output-format=json --output=/tmp/fio.json --direct=1 --bs=4k --ioengine=libaio \
        --time_based --runtime="${rt:-15}" --size=64M --randrepeat=0 --eta=never
    for d in vda vdb; do
        for qd in 1 32; do
            for rw in randwrite randread; do
                set -- "$@" --name="$d-$rw-qd$qd" --filename="/dev/$d" --rw=$rw --iodepth=$qd --stonewall
            done
        done
    done
    echo "GVM FIO START $(up)"
    "$lib/ld-linux-x86-64.so.2" --library-path "$lib:$lib/ceph" /host/usr/bin/fio "$@" 2>/tmp/fio.err
    echo "GVM FIO EXIT $? $(up) $(head -c 300 /tmp/fio.err)"
    dd if=/tmp/fio.json of=/dev/vdc conv=fsync 2>/dev/null
    poweroff -f
fi
n=0
while [ ! -b /dev/vda ] || [ ! -b /dev/vdb ]; do
    n=$((n + 1)); [ $n -gt 300 ] && { echo "GVM FAIL no /dev/vda or /dev/vdb"; poweroff -f; }
    sleep 0.1
done
mkdir -p /mnt
mount -t ext4 /dev/vda /mnt || { echo "GVM FAIL mount"; poweroff -f; }
i=$(tail -n 1 /mnt/records 2>/dev/null)
i=${i:-0}
echo "GVM READY $i $(up)"
stop() { [ "$(dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | head -c 4)" = STOP ]; }
while ! stop; do
    i=$((i + 1))
    if echo "$i" | dd of=/mnt/records oflag=append conv=notrunc,fsync 2>/tmp/err; then
        echo "ACK $i $(up)"
    else
        echo "GVM FAIL write $i: $(cat /tmp/err)"
    fi
done
sync
umount /mnt && echo "GVM UMOUNTED"
echo "GVM DONE $i $(up)"
poweroff -f
