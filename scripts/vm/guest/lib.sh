# shellcheck shell=bash
# Helpers shared by the guest scenarios (demo, e2e, rdma-e2e, bench-rdma).
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
