#!/usr/bin/env bash
# The shipped systemd units, run by a real systemd inside the VM: a systemd
# (PID 1 of its own PID namespace, in container mode) starts arenad.service
# and ublkd.service exactly as installed on a host, with all their
# hardening, and the scenarios check that it does not break ublk or RDMA:
#   - arenad with rdma = "on" on soft-RoCE starts (DevicePolicy=closed
#     admits /dev/infiniband/uverbsN);
#   - ublkd runs in its own mount namespace; `ublkctl add --transport rdma`
#     gives a /dev/ublkbN (ublk-control, ublkcN, ublkbN admitted; io_uring,
#     mlock and the RDMA registration pass the syscall filter and limits)
#     that carries ext4 and fio verify, payloads moved by RDMA;
#   - files of both daemons are private (UMask=0077 and the code's modes);
#   - descriptors per queue fit the LimitNOFILE= arithmetic of ublkd.service;
#   - `arenactl` (the unit's admin socket) lists the ublkd host's sessions
#     on the volume with their leases; `arenactl disconnect` ends one and
#     the device goes on (fio verify); `systemctl reload arenad` (ExecReload
#     = arenactl reload) fails on a broken config and arenad keeps serving;
#   - `systemctl kill -s KILL ublkd`: systemd restarts it and the device is
#     recovered with its data;
#   - the journal holds no "Operation not permitted" (a filtered syscall).
# The host's root is read-only here: /etc, /usr/local/bin and /var/lib get
# tmpfs overlays so the install steps of docs/OPERATIONS.md run as written.
# Prints `PASS name` / `FAIL name`; exits non-zero on a failure.
set -u

REPO=${UBLK_VM_REPO:?}
BIN=$REPO/target/release
R=${UBLK_VM_RESULTS:-/tmp}
W=$(mktemp -d /tmp/ublk-units.XXXXXX)
failures=0
log() { printf '%s units: %s\n' "$(date +%T)" "$*" >&2; }
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1${2:+ ($2)}"; failures=$((failures + 1)); }
ctl() { timeout 180 "$BIN/ublkctl" "$@"; }
# systemctl and journalctl run inside systemd's PID and mount namespaces
# (the manager does not take clients whose PID it cannot see).
SDPID=''
sc() { timeout 120 nsenter -t "$SDPID" -m -p -r -w systemctl "$@"; }
jc() { timeout 120 nsenter -t "$SDPID" -m -p -r -w journalctl --no-pager "$@"; }
# The host PID of the one ublkd (MainPID is systemd's namespace's).
ublkd_pid() {
    local p
    for p in /proc/[0-9]*; do
        [[ $(cat "$p/comm" 2>/dev/null) == ublkd ]] && { echo "${p#/proc/}"; return; }
    done
}

for b in arenad arenactl ublkd ublkctl; do
    [[ -x "$BIN/$b" ]] || { echo "FAIL setup (missing $BIN/$b: run scripts/vm/units)"; exit 1; }
done

# Writable layers over the read-only host root.
overlay() { # overlay DIR
    local up=$W/ovl/${1//\//_}
    mkdir -p "$up/u" "$up/w"
    mount -t overlay overlay -o "lowerdir=$1,upperdir=$up/u,workdir=$up/w" "$1"
}
mount -t tmpfs tmpfs "$W" && mkdir -p "$W/ovl" || { echo "FAIL setup (tmpfs)"; exit 1; }
for d in /etc /usr/local/bin /var/lib; do overlay "$d" || { echo "FAIL setup (overlay $d)"; exit 1; }; done

timeout 10 /usr/sbin/ip link set lo up
timeout 20 /usr/bin/rdma link add rxe0 type rxe netdev lo || { echo "FAIL rxe-add"; exit 1; }
for _ in $(seq 100); do [[ -c /dev/infiniband/uverbs0 ]] && break; sleep 0.1; done
grep -E ' (ublk-char|infiniband_verbs|blkext)$' /proc/devices >"$R/units-proc-devices.txt"

# The by-hand install of docs/OPERATIONS.md.
install -m 0755 "$BIN"/{ublkd,ublkctl,arenad,arenactl} /usr/local/bin/
install -d -m 0755 /etc/ublkd /etc/arenad
install -m 0644 "$REPO/systemd/ublkd.toml" /etc/ublkd/ublkd.toml
cat >/etc/arenad/arenad.toml <<'TOML'
listen = "127.0.0.1:7070"
arena_bytes = "64M"
blob_bytes = "256K"
swap_bytes = "512M"
rdma = "on"
[[volume]]
name = "vm1"
secret_file = "/etc/arenad/vm1.key"
quota = "1G"
TOML
(umask 077 && head -c 32 /dev/urandom | base64 >/etc/arenad/vm1.key && cp /etc/arenad/vm1.key /etc/ublkd/vm1.key)
# arenad's system user, and its secret readable by it.
timeout 30 systemd-sysusers "$REPO/systemd/arenad.sysusers" && chown arenad: /etc/arenad/vm1.key ||
    { echo "FAIL setup (systemd-sysusers)"; exit 1; }
install -m 0644 "$REPO/systemd/ublkd.service" "$REPO/systemd/arenad.service" /etc/systemd/system/
systemctl enable arenad ublkd >/dev/null 2>&1 || { echo "FAIL setup (systemctl enable)"; exit 1; }
# Boot only what the services need, not the host's whole multi-user.target.
cat >/etc/systemd/system/ublk-units-test.target <<'UNIT'
[Unit]
Description=ublk units test
Requires=basic.target
After=basic.target
Wants=arenad.service ublkd.service
AllowIsolate=yes
UNIT

log "starting systemd"
# With a /tmp of its own: its boot empties /tmp (tmpfiles.d `D /tmp`), and
# the guest's /tmp holds a checkout or results dir under the host's /tmp.
unshare --pid --fork --mount-proc sh -c 'mount -t tmpfs -o mode=1777 tmpfs /tmp && exec "$@"' sh \
    env -i container=ublk-vm PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    /lib/systemd/systemd --system --unit=ublk-units-test.target --log-target=console --log-level=info --show-status=no \
    >"$R/units-systemd.log" 2>&1 </dev/null &
UNSHARE=$!
for _ in $(seq 100); do
    SDPID=$(cat "/proc/$UNSHARE/task/$UNSHARE/children" 2>/dev/null | tr -d ' ')
    [[ -n "$SDPID" ]] && break
    sleep 0.1
done
cleanup() {
    set +e
    mountpoint -q "$W/mnt" && umount "$W/mnt"
    sc stop ublkd arenad >/dev/null 2>&1
    jc -o short-monotonic >"$R/units-journal.log" 2>&1
    [[ -n "$SDPID" ]] && kill -9 "$SDPID" 2>/dev/null
    kill -9 "$UNSHARE" 2>/dev/null
}
trap cleanup EXIT
[[ -n "$SDPID" ]] || { echo "FAIL setup (systemd did not start)"; exit 1; }

for _ in $(seq 600); do
    # One unit at a time: `is-active A B` succeeds when either is active.
    [[ -S /run/systemd/private && $(sc is-active arenad) == active && $(sc is-active ublkd) == active ]] && break
    sc is-failed arenad >/dev/null 2>&1 && break
    sc is-failed ublkd >/dev/null 2>&1 && break
    sleep 0.2
done
{
    sc --no-pager status arenad ublkd
    sc --no-pager list-units --failed
    ps -ef
} >"$R/units-status.txt" 2>&1

if [[ $(sc is-active arenad) == active ]] && jc -u arenad | grep -q 'rdma.enabled'; then
    pass arenad-unit-starts-with-rdma-on
else
    fail arenad-unit-starts-with-rdma-on "see units-status.txt"
fi
if [[ $(sc is-active ublkd) == active ]]; then pass ublkd-unit-starts; else fail ublkd-unit-starts "see units-status.txt"; fi

# arenad as its own user, with CAP_IPC_LOCK (bit 14) as its only capability.
apid=''
for p in /proc/[0-9]*; do [[ $(cat "$p/comm" 2>/dev/null) == arenad ]] && apid=${p#/proc/}; done
auser=$(ps -o user= -p "$apid" 2>/dev/null | tr -d ' ')
acaps=$(awk '/^CapEff:/ { print $2 }' "/proc/$apid/status" 2>/dev/null)
if [[ $auser == arenad && $acaps == 0000000000004000 ]]; then
    pass arenad-runs-unprivileged
else
    fail arenad-runs-unprivileged "user '$auser' CapEff '$acaps'"
fi

# Not ours (where the device's filesystem gets mounted), not systemd's.
pid=$(ublkd_pid)
ns=$(readlink "/proc/$pid/ns/mnt")
if [[ -n "$pid" && -n "$ns" && $ns != $(readlink /proc/self/ns/mnt) && $ns != $(readlink "/proc/$SDPID/ns/mnt") ]]; then
    pass ublkd-own-mount-namespace
else
    fail ublkd-own-mount-namespace "pid $pid ns $ns"
fi

fds() { find "/proc/$(ublkd_pid)/fd" -mindepth 1 -maxdepth 1 | wc -l; }
queues() { ctl --json list | grep -oE '"queues": *[0-9]+' | awk -F: '{ s += $2 } END { print s + 0 }'; }
fd0=$(fds)
DEV=$(ctl add --peer 127.0.0.1:7070 --volume vm1 --secret-file /etc/ublkd/vm1.key \
    --size 256M --queues 2 --depth 16 --transport rdma 2>"$W/add.err")
if [[ "$DEV" == /dev/ublkb* ]]; then
    pass ublkctl-add-rdma-under-the-unit
else
    fail ublkctl-add-rdma-under-the-unit "$(cat "$W/add.err")"
    exit 1
fi
ID=${DEV#/dev/ublkb}
for _ in $(seq 200); do [[ -b "$DEV" ]] && break; sleep 0.05; done
fd1=$(fds) q1=$(queues)
DEV2=$(ctl add --peer 127.0.0.1:7070 --volume vm1 --secret-file /etc/ublkd/vm1.key \
    --size 64M --queues 4 --depth 16 --transport rdma 2>>"$W/add.err")
fd2=$(fds) q2=$(queues)
per_queue=-1
[[ $q2 -gt $q1 ]] && per_queue=$(((fd2 - fd1 + q2 - q1 - 1) / (q2 - q1)))
echo "descriptors: $fd0 idle, $fd1 with $q1 queues, $fd2 with $q2 queues ($per_queue per queue, LimitNOFILE assumes 6)"
if [[ "$DEV2" == /dev/ublkb* && $per_queue -ge 0 && $per_queue -le 6 ]]; then
    pass ublkd-descriptors-per-queue-fit-limit
else
    fail ublkd-descriptors-per-queue-fit-limit "$per_queue per queue"
fi
[[ "$DEV2" == /dev/ublkb* ]] && ctl del "${DEV2#/dev/ublkb}" >/dev/null

mkdir -p "$W/mnt"
if timeout 300 mkfs.ext4 -q -F "$DEV" && mount "$DEV" "$W/mnt" &&
    head -c 8M /dev/urandom >"$W/mnt/data" && sha256sum "$W/mnt/data" | cut -d' ' -f1 >"$W/sum" &&
    umount "$W/mnt" && timeout 300 e2fsck -fn "$DEV" >/dev/null; then
    pass ext4-on-the-units-device
else
    fail ext4-on-the-units-device
fi
if timeout 300 fio --name=v --filename="$DEV" --rw=randwrite --bs=64k --size=32M --offset=128M \
    --direct=1 --verify=crc32c --do_verify=1 --output="$R/units-fio.txt" >/dev/null 2>&1; then
    pass fio-verify-on-the-units-device
else
    fail fio-verify-on-the-units-device "see units-fio.txt"
fi
rdma=$(curl -s http://127.0.0.1:9477/metrics | awk '/^ublk_driver_rdma_transferred_total/ { s += $2 } END { print s + 0 }')
if [[ $rdma -gt 0 ]]; then pass payloads-moved-by-rdma; else fail payloads-moved-by-rdma "$rdma"; fi

# arenactl, as an operator on the memory node runs it.
actl() { timeout 60 /usr/local/bin/arenactl "$@"; }
field() { python3 -c 'import json, sys; d = json.load(sys.stdin); print(eval(sys.argv[1]))' "$1"; }
sessions=$(actl --json sessions --volume vm1 2>"$W/arenactl.err")
n=$(field 'len(d["sessions"])' <<<"$sessions" 2>/dev/null)
rdma_sessions=$(field 'sum(s["transport"] == "rdma" and s["rails"] == 1 for s in d["sessions"])' <<<"$sessions" 2>/dev/null)
vol_sessions=$(actl --json volumes 2>>"$W/arenactl.err" | field '[v["sessions"] for v in d["volumes"] if v["name"] == "vm1"][0]' 2>/dev/null)
echo "arenactl: $n sessions on vm1 ($rdma_sessions over RDMA), volumes says $vol_sessions"
actl sessions >"$R/units-arenactl-sessions.txt" 2>&1
if [[ ${n:-0} -ge 2 && $rdma_sessions == "$n" && $vol_sessions == "$n" ]] &&
    field 'all("leases" in s for s in d["sessions"])' <<<"$sessions" | grep -q True; then
    pass arenactl-shows-the-hosts-sessions
else
    fail arenactl-shows-the-hosts-sessions "$(cat "$W/arenactl.err") $sessions"
fi
victim=$(field 'd["sessions"][0]["id"]' <<<"$sessions" 2>/dev/null)
if [[ -n "$victim" ]] && actl disconnect "$victim" >"$W/disconnect.out" 2>&1 &&
    timeout 300 fio --name=d --filename="$DEV" --rw=randwrite --bs=64k --size=16M --offset=160M \
        --direct=1 --verify=crc32c --do_verify=1 --output="$R/units-fio-disconnect.txt" >/dev/null 2>&1 &&
    jc -u arenad | grep -q 'session.disconnected'; then
    pass arenactl-disconnect-and-the-device-goes-on
else
    fail arenactl-disconnect-and-the-device-goes-on "$(cat "$W/disconnect.out" 2>/dev/null); see units-fio-disconnect.txt"
fi
# A broken config: the reload fails, arenad keeps serving the running one.
cp /etc/arenad/arenad.toml "$W/arenad.toml.good"
echo 'blob_bytes = "3K"' >>/etc/arenad/arenad.toml
apid=$(sc show -p MainPID --value arenad)
if ! sc reload arenad 2>"$W/reload.err" && [[ $(sc is-active arenad) == active ]] &&
    [[ $(sc show -p MainPID --value arenad) == "$apid" ]] && actl volumes >/dev/null &&
    jc -u arenad | grep -q 'config.reload_failed'; then
    pass systemctl-reload-arenad-fails-on-a-broken-config
else
    fail systemctl-reload-arenad-fails-on-a-broken-config "$(cat "$W/reload.err")"
fi
cp "$W/arenad.toml.good" /etc/arenad/arenad.toml

bad=$(find /var/lib/arenad /var/lib/ublkd /run/ublkd /run/arenad -mindepth 1 \( -type f -o -type s \) -perm /077 -printf '%m %p\n')
if [[ -z "$bad" ]]; then pass daemons-files-private; else fail daemons-files-private "$bad"; fi

# systemctl reload: SIGHUP re-reads the configs; same processes, still
# active, and each logs config.reloaded.
pids="$(sc show -p MainPID --value arenad) $(sc show -p MainPID --value ublkd)"
if sc reload arenad && sc reload ublkd && sleep 1 &&
    [[ "$(sc show -p MainPID --value arenad) $(sc show -p MainPID --value ublkd)" == "$pids" ]] &&
    [[ $(sc is-active arenad) == active && $(sc is-active ublkd) == active ]] &&
    jc -u arenad | grep -q 'config.reloaded' && jc -u ublkd | grep -q 'config.reloaded'; then
    pass systemctl-reload-both-units
else
    fail systemctl-reload-both-units "pids $pids -> $(sc show -p MainPID --value arenad) $(sc show -p MainPID --value ublkd)"
fi

old=$(sc show -p MainPID --value ublkd) new=''
sc kill -s KILL ublkd
for _ in $(seq 300); do
    new=$(sc show -p MainPID --value ublkd)
    [[ "$new" -gt 0 && "$new" != "$old" && $(sc is-active ublkd) == active ]] && break
    sleep 0.2
done
if [[ "$old" -gt 0 && "$new" -gt 0 && "$new" != "$old" ]] && mount "$DEV" "$W/mnt" &&
    [[ $(sha256sum "$W/mnt/data" | cut -d' ' -f1) == $(cat "$W/sum") ]]; then
    pass systemd-restarts-ublkd-and-the-device-recovers
else
    fail systemd-restarts-ublkd-and-the-device-recovers "pid $old -> $new"
fi
mountpoint -q "$W/mnt" && umount "$W/mnt"
ctl del "$ID" >/dev/null || fail ublkctl-del

sc stop ublkd arenad
if ! jc -u ublkd -u arenad >"$W/journal" || grep -i 'operation not permitted\|permission denied\|EPERM' "$W/journal"; then
    fail no-denied-operations-in-the-journal
else
    pass no-denied-operations-in-the-journal
fi
echo "units: $failures failure(s)"
exit $((failures > 0))
