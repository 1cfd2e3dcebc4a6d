# shellcheck shell=bash
# Helpers shared by the guest scenarios (demo, e2e, rdma-e2e, bench-rdma,
# bench-swap).
# Source it after setting BIN (the release binaries), SOCK (ublkd's control
# socket) and W (the scenario's work dir holding ublkd.toml).

ctl() { timeout 180 "$BIN/ublkctl" --socket "$SOCK" "$@"; }

# wait_node DEV: /dev/ublkbN appears shortly after `add` returns.
wait_node() { for _ in $(seq 200); do [[ -b "$1" ]] && return 0; sleep 0.05; done; return 1; }

# start_ublkd LOG: starts ublkd on $W/ublkd.toml (its output appended to
# LOG), sets UBLKD_PID, and waits up to 90 s for the control socket to
# answer; fails at once if ublkd exits.
start_ublkd() {
    RUST_LOG=${RUST_LOG:-info} "$BIN/ublkd" --config "$W/ublkd.toml" >>"$1" 2>&1 &
    UBLKD_PID=$!
    for _ in $(seq 900); do
        ctl list >/dev/null 2>&1 && return 0
        kill -0 "$UBLKD_PID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# swap_disk DIR: a fresh ext4 on the emulated NVMe disk scripts/vm/run
# attaches (/dev/nvme0n1), mounted at DIR, for arenad's swap_dir; so swap
# I/O meets a real block device with O_DIRECT and queue depth, not tmpfs.
# Fails, saying why on stderr, when there is no such disk.
swap_disk() {
    local dev=/dev/nvme0n1
    for _ in $(seq 100); do [[ -b $dev ]] && break; sleep 0.1; done
    [[ -b $dev ]] || { echo "no NVMe disk $dev (scripts/vm/run attaches one unless UBLK_VM_NVME=0)" >&2; return 1; }
    mkdir -p "$1"
    timeout 300 mkfs.ext4 -q -F -E nodiscard "$dev" >&2 || return 1
    timeout 60 mount "$dev" "$1"
}
