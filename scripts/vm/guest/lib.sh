# shellcheck shell=bash
# Helpers shared by the guest scenarios (demo, e2e, rdma-e2e, rails,
# replicas, handover, guest-vm, bench-rdma, bench-rails, bench-swap,
# bench-latency, bench-replicas, bench-rebuild, bench-guest).
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

# start_peer I: starts arena peer I of PEERS on $W/arenadI.toml (output
# appended to $R/arenadI.log), sets ARENAD_PIDS[I], waits until it listens.
start_peer() {
    "$BIN/arenad" --config "$W/arenad$1.toml" >>"$R/arenad$1.log" 2>&1 &
    ARENAD_PIDS[$1]=$!
    wait_listen "${PEERS[$1]##*:}" "${ARENAD_PIDS[$1]}"
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

# rdma_device: sets RDMA_DEV and GID to the first RDMA device the machine
# has (GID index BENCH_GID_INDEX, default 0), else to soft-RoCE rxe0 on lo
# (GID index 1, the IPv4-mapped entry); says which on stderr. Fails, saying
# why, when neither can be had.
rdma_device() {
    local devices=(/sys/class/infiniband/*)
    if [[ -e "${devices[0]}" ]]; then
        RDMA_DEV=$(basename "${devices[0]}")
        GID=${BENCH_GID_INDEX:-0}
        echo "using RDMA device $RDMA_DEV (no soft-RoCE setup)" >&2
        return 0
    fi
    if [[ -n "${UBLK_VM_MODDIR:-}" ]]; then modprobe -d "$UBLK_VM_MODDIR" rdma_rxe; else modprobe rdma_rxe; fi 2>/dev/null
    timeout 10 /usr/sbin/ip link set lo up
    timeout 20 /usr/bin/rdma link add rxe0 type rxe netdev lo || { echo "rdma link add failed: no RDMA device" >&2; return 1; }
    for _ in $(seq 100); do [[ -c /dev/infiniband/uverbs0 ]] && break; sleep 0.1; done
    RDMA_DEV=rxe0
    GID=1
    echo "no RDMA device; using soft-RoCE rxe0 on lo" >&2
}

# two_rdma_links: two soft-RoCE links in the init netns (docs/VM-TESTS.md,
# "Two RDMA links"): veth pairs aN/bN (10.N+1.0.1 and .2), rxe rxaN on aN
# (ublkd's rails) and rxbN on bN (arenad's), and the policy routes that
# send each direction across its pair. Fails, saying why, if one is missing.
two_rdma_links() {
    modprobe -d "$UBLK_VM_MODDIR" veth && modprobe -d "$UBLK_VM_MODDIR" rdma_rxe ||
        { echo "veth or rdma_rxe module missing" >&2; return 1; }
    local ip=/usr/sbin/ip i n d
    timeout 10 $ip link set lo up
    sysctl -qw net.ipv4.conf.all.accept_local=1 net.ipv4.conf.all.rp_filter=0
    # Local traffic would take the local table and lo: the policy routes
    # send each direction out of its end of the pair first.
    timeout 10 $ip rule del pref 0 lookup local && timeout 10 $ip rule add pref 100 lookup local || return 1
    for i in 0 1; do
        n=$((i + 1))
        timeout 10 $ip link add a$i type veth peer name b$i || return 1
        timeout 10 $ip addr add 10.$n.0.1/24 dev a$i
        timeout 10 $ip addr add 10.$n.0.2/24 dev b$i
        for d in a$i b$i; do
            sysctl -qw net.ipv4.conf.$d.accept_local=1 net.ipv4.conf.$d.rp_filter=0
            timeout 10 $ip link set $d up
        done
        timeout 10 $ip rule add pref 10 to 10.$n.0.2 iif lo lookup 1$n
        timeout 10 $ip rule add pref 10 to 10.$n.0.1 iif lo lookup 2$n
        link_routes $i || return 1
        timeout 20 /usr/bin/rdma link add rxa$i type rxe netdev a$i &&
            timeout 20 /usr/bin/rdma link add rxb$i type rxe netdev b$i ||
            { echo "rxe on link $i failed" >&2; return 1; }
    done
    for _ in $(seq 100); do [[ -c /dev/infiniband/uverbs3 ]] && return 0; sleep 0.1; done
    echo "the rxe devices did not appear" >&2
    return 1
}

# link_routes N: the policy routes of link N (taking the link down drops
# them: add them again when it comes back up).
link_routes() {
    local n=$(($1 + 1))
    timeout 10 /usr/sbin/ip route replace 10.$n.0.2 dev a$1 src 10.$n.0.1 table 1$n &&
        timeout 10 /usr/sbin/ip route replace 10.$n.0.1 dev b$1 src 10.$n.0.2 table 2$n
}

# wait_listen PORT PID: until something listens on 127.0.0.1:PORT (up to
# 30 s); fails at once if process PID exits.
wait_listen() {
    for _ in $(seq 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# start_etcd ADDR DIR LOG: a single-member etcd (Debian's etcd-server) for
# the replicated-device scenarios, clients on ADDR (HOST:PORT; its peer
# port is the next one), data in DIR; sets ETCD_PID and waits up to 60 s
# until it answers as healthy.
start_etcd() {
    local peer="http://${1%:*}:$((${1##*:} + 1))"
    etcd --name vm --data-dir "$2" --listen-client-urls "http://$1" --advertise-client-urls "http://$1" \
        --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
        --initial-cluster "vm=$peer" >"$3" 2>&1 &
    ETCD_PID=$!
    for _ in $(seq 300); do
        ETCDCTL_API=3 timeout 10 etcdctl --endpoints "$1" --dial-timeout 2s endpoint health >/dev/null 2>&1 && return 0
        kill -0 "$ETCD_PID" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

# replica_fact ID FIELD: one fact of device ID's replica set, from
# `ublkctl --json show`: epoch, healthy, active, states (space-separated,
# record order) or rebuild (bytes remaining, "none" when none runs).
replica_fact() {
    ctl --json show "$1" 2>/dev/null | /usr/bin/python3 -c '
import json, sys
r = json.load(sys.stdin)["device"].get("replicas") or {}
f = sys.argv[1]
if f == "states":
    print(" ".join(m["state"] for m in r.get("members", [])))
elif f == "rebuild":
    b = r.get("rebuild")
    print("none" if b is None else b["bytes_remaining"])
else:
    print(r.get(f, ""))' "$2"
}

# add_when_etcd ARGS...: `ctl add ARGS...`, retried for up to 60 s while
# ublkd has not reached etcd yet (it dials in the background); prints the
# node, errors on stderr.
add_when_etcd() {
    local out end=$((SECONDS + 60))
    while :; do
        out=$(ctl add "$@" 2>&1) && { echo "$out"; return 0; }
        [[ "$out" == *"etcd unavailable"* && $SECONDS -lt $end ]] || { echo "$out" >&2; return 1; }
        sleep 0.5
    done
}

# Two ublkd in one VM as two hosts of a fleet (handover.sh, guest-vm.sh):
# host X (a, b) keeps its config, state dir and socket in $W/X and its log
# in $R/ublkd-X.log; its host id is host-X; etcd at $ETCD, lease TTL $TTL,
# lease margin $MARGIN (ublkd's default when unset).
# host_conf X METRICS_PORT QUEUES [TOML]: host X's ublkd.toml, TOML (more
# tables, an [rdma] one say) appended.
host_conf() {
    cat >"$W/$1/ublkd.toml" <<TOML
state_dir = "$W/$1/state"
socket = "$W/$1/run/ublkd.sock"
on_shutdown = "keep"
request_timeout_ms = 20000
[device]
queues = $3
depth = 16
io_buf = "1M"
[metrics]
listen = "127.0.0.1:$2"
[etcd]
endpoints = ["http://$ETCD"]
request_timeout_ms = 5000
dial_timeout_ms = 5000
lease_ttl_secs = $TTL
lease_margin_ms = ${MARGIN:-2000}
handover_poll_ms = 50
host_id = "host-$1"
[replication]
rebuild_check_ms = 500
change_deadline_ms = 30000
coord_timeout_ms = 5000
${4:-}
TOML
}
ctl_a() { SOCK=$W/a/run/ublkd.sock ctl "$@"; }
ctl_b() { SOCK=$W/b/run/ublkd.sock ctl "$@"; }
# start_host X: host X's ublkd; sets PID_X.
start_host() {
    local rc=0 sock=$W/$1/run/ublkd.sock dir=$W/$1
    W=$dir SOCK=$sock start_ublkd "$R/ublkd-$1.log" || rc=1
    printf -v "PID_${1^^}" '%s' "$UBLKD_PID"
    return $rc
}
# role X ID / role_reason X ID: device ID's writer role on host X
# (writer, standby, unconfirmed, fenced) and why.
role() { SOCK=$W/$1/run/ublkd.sock replica_fact "$2" role; }
role_reason() { SOCK=$W/$1/run/ublkd.sock replica_fact "$2" role_reason; }
# dev_state X ID / dev_reason X ID: device ID's state on host X (live,
# failed, ...) and why.
dev_field() { SOCK=$W/$1/run/ublkd.sock show_field "$2" "$3"; }
dev_state() { dev_field "$1" "$2" state; }
dev_reason() { dev_field "$1" "$2" error; }

# show_field ID KEY: a field of device ID in `ublkctl --json show` (empty
# when the device or the field is missing).
show_field() {
    ctl --json show "$1" 2>/dev/null |
        /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["device"].get(sys.argv[1], ""))' "$2" 2>/dev/null
}
# driver_stats ID: device ID's driver counters from `ublkctl --json stats`,
# one "name op reason value" line each.
driver_stats() {
    ctl --json stats "$1" | /usr/bin/python3 -c '
import json, sys
for d in json.load(sys.stdin)["driver"]:
    for c in (d.get("stats") or {}).get("counters", []):
        print(c["name"], c.get("op", "-"), c.get("reason", "-"), c["value"])'
}
# stat_sum ID NAME [REASON]: driver counter NAME of device ID, summed over
# ops (and reasons, unless one is named).
stat_sum() {
    driver_stats "$1" | awk -v n="$2" -v r="${3:-}" \
        '$1 == n && (r == "" || $3 == r) { s += $4 } END { print s + 0 }'
}
# metric PREFIX: ublkd's exposition samples whose line starts with PREFIX,
# summed (0 when none).
metric() {
    timeout 30 /usr/bin/curl -sf http://127.0.0.1:9477/metrics |
        awk -v p="$1" 'index($0, p) == 1 { s += $NF } END { print s + 0 }'
}
