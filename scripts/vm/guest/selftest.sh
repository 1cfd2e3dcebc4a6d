#!/usr/bin/env bash
# Usage: scripts/vm/run scripts/vm/guest/selftest.sh [TIMEOUT_S]
#
# Guest scenario that proves the VM harness works: ublk control node,
# soft-RoCE (rxe on lo), libibverbs, the chroot's module access and the
# writable results share. Prints "PASS name" / "FAIL name" per check and
# exits non-zero if any check failed. Runs inside the VM only.
set -uo pipefail

[[ "${UBLK_VM:-}" == 1 ]] || { echo "run me via scripts/vm/run" >&2; exit 2; }

failed=0
check() { # check NAME CMD... : runs CMD under a timeout, reports the result
    local name=$1 run=(timeout 30)
    shift
    # Shell functions cannot run under timeout(1); ours bound themselves.
    if declare -F "$1" >/dev/null; then run=(); fi
    if "${run[@]}" "$@" >"$UBLK_VM_RESULTS/check-$name.log" 2>&1; then
        echo "PASS $name"
    else
        echo "FAIL $name (rc=$?)"
        sed 's/^/    /' "$UBLK_VM_RESULTS/check-$name.log"
        failed=1
    fi
}
# shellcheck disable=SC2317 # called via check
wait_for() { # wait_for SECS TEST-ARGS... : polls `test ARGS` every 0.1 s
    local deadline=$((SECONDS + $1))
    shift
    until test "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

echo "kernel $(uname -r), repo $UBLK_VM_REPO"
check kernel-version test "$(uname -r)" = "$UBLK_VM_KVER"
check ublk-control test -c /dev/ublk-control
check lo-up /usr/sbin/ip link set lo up
check rxe-add /usr/bin/rdma link add rxe0 type rxe netdev lo
check rxe-sysfs wait_for 10 -e /sys/class/infiniband/rxe0
check uverbs-node wait_for 10 -c /dev/infiniband/uverbs0
check ibv-devices bash -c 'ibv_devices | grep -qw rxe0'
check ibv-devinfo bash -c 'ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE'
check modprobe-chroot /usr/sbin/modprobe -d "$UBLK_VM_MODDIR" null_blk nr_devices=0
# The kernel autoloads dummy via the initramfs modprobe (rtnl-link-dummy).
check module-autoload bash -c '/usr/sbin/ip link add vmtest0 type dummy && /usr/sbin/ip link del vmtest0'
# shellcheck disable=SC2016 # expands in the inner bash
check results-write bash -c 'echo ok >"$UBLK_VM_RESULTS/selftest-wrote" && test "$(cat "$UBLK_VM_RESULTS/selftest-wrote")" = ok'
check repo-readable test -f "$UBLK_VM_REPO/Cargo.toml"
check tmp-writable bash -c 'f=$(mktemp /tmp/selftest.XXXXXX) && echo x >"$f" && rm "$f"'

if ((failed)); then echo "selftest: FAILED"; else echo "selftest: all checks passed"; fi
exit "$failed"
