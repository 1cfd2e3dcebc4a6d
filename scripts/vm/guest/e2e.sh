#!/usr/bin/env bash
# Real-kernel end-to-end scenarios for ublkd + arenad, run inside the VM by
# scripts/vm/e2e (which builds the release binaries on the host first).
# Prints `PASS name` / `FAIL name` per scenario and exits non-zero if any
# failed. Everything lives under /tmp (guest tmpfs); logs go to
# $UBLK_VM_RESULTS.
set -u

BIN=${UBLK_E2E_BIN:-$UBLK_VM_REPO/target/release}
R=${UBLK_VM_RESULTS:-/tmp/e2e-results}
W=$(mktemp -d /tmp/ublk-e2e.XXXXXX)   # the guest /tmp shows the host's: never a fixed name
SOCK=$W/run/ublkd.sock
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PEER=127.0.0.1:7070
DEV_SIZE=96M       # larger than the arena, so swap is in play
ARENA=32M
failures=0
declare -a summary=()

mkdir -p "$R" "$W"/{state,arena,run,mnt}
log() { printf '%s e2e: %s\n' "$(date +%T)" "$*" >&2; }
pass() { echo "PASS $1"; summary+=("PASS $1"); }
fail() { echo "FAIL $1${2:+ ($2)}"; summary+=("FAIL $1"); failures=$((failures + 1)); }
# arenad's swap lives on the emulated NVMe disk, as it would in production.
swap_disk "$W/arena" || { echo "FAIL setup (swap_dir on NVMe)"; exit 1; }

for b in arenad ublkd ublkctl; do
    [[ -x "$BIN/$b" ]] || { echo "FAIL setup (missing $BIN/$b: run scripts/vm/e2e, which builds it)"; exit 1; }
done
[[ -c /dev/ublk-control ]] || { echo "FAIL setup (/dev/ublk-control missing)"; exit 1; }

printf 'e2e-volume-secret-0123456789abcdef\n' >"$W/vol.key"
chmod 600 "$W/vol.key"
cat >"$W/arenad.toml" <<TOML
listen = "$PEER"
arena_bytes = "$ARENA"
blob_bytes = "256K"
swap_dir = "$W/arena"
swap_bytes = "512M"
metrics_listen = "127.0.0.1:9478"
[[volume]]
name = "e2e"
secret_file = "$W/vol.key"
quota = "1G"
[[volume]]
name = "sealed"
secret_file = "$W/vol.key"
quota = "64M"
confidential = true
TOML
cat >"$W/ublkd.toml" <<TOML
state_dir = "$W/state"
socket = "$SOCK"
on_shutdown = "keep"
request_timeout_ms = 60000
log_format = "json"
[device]
queues = 2
depth = 16
io_buf = "1M"
[metrics]
listen = "127.0.0.1:9477"
openmetrics = true
slow_threshold_ms = 1000
[tracing]
enabled = true
TOML

start_arenad() {
    "$BIN/arenad" --config "$W/arenad.toml" >>"$R/arenad.log" 2>&1 &
    ARENAD_PID=$!
    for _ in $(seq 100); do
        (exec 3<>/dev/tcp/127.0.0.1/7070) 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}
# GET on 127.0.0.1; prints the body, exit status 0 only for HTTP 200.
http() { timeout 30 /usr/bin/curl -sf "http://127.0.0.1:$1"; }
# HTTP status of a GET (000 when nothing answers).
http_code() { timeout 30 /usr/bin/curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1"; }
# Polls ublkd's /ready until it answers $1 (200 or 503), up to 60 s.
ready_is() {
    for _ in $(seq 120); do
        [[ "$(http_code 9477/ready)" == "$1" ]] && return 0
        sleep 0.5
    done
    return 1
}
cleanup() {
    [[ -n "${PROM_PID:-}" ]] && kill "$PROM_PID" 2>/dev/null
    mountpoint -q "$W/mnt" && umount -l "$W/mnt"
    [[ -n "${UBLKD_PID:-}" ]] && kill "$UBLKD_PID" 2>/dev/null
    [[ -n "${ARENAD_PID:-}" ]] && kill "$ARENAD_PID" 2>/dev/null
    wait 2>/dev/null
    mountpoint -q "$W/arena" && umount "$W/arena"
}
trap cleanup EXIT

t0=$SECONDS
start_arenad || { echo "FAIL setup (arenad did not listen; see arenad.log)"; exit 1; }
# `features` asks the driver itself: no ublkd needed (none runs yet).
out=$(timeout 60 "$BIN/ublkctl" --socket "$W/none.sock" features 2>&1)
if [[ $? -eq 0 && "$out" == *USER_RECOVERY* ]]; then pass ctl-features-without-ublkd
else fail ctl-features-without-ublkd "$out"; fi
start_ublkd "$R/ublkd.log" || { echo "FAIL setup (ublkd did not come up; see ublkd.log)"; cat "$R/ublkd.log"; exit 1; }

# ---- control-plane errors and add -------------------------------------
out=$(ctl add --peer "$PEER" --volume e2e --secret-file "$W/vol.key" --size 64M --transport rdma 2>&1)
if [[ $? -ne 0 && "$out" == *"RDMA transport unavailable: "*"use --transport tcp or --transport auto"* ]]; then pass ctl-rdma-refused
else fail ctl-rdma-refused "$out"; fi
out=$(ctl add --peer 127.0.0.1:1 --volume e2e --secret-file "$W/vol.key" --size 64M 2>&1)
if [[ $? -ne 0 && "$out" == *"cannot connect to arena peer 127.0.0.1:1"* ]]; then pass ctl-peer-unreachable
else fail ctl-peer-unreachable "$out"; fi
printf 'a-wrong-secret-0123456789abcdef\n' >"$W/bad.key"; chmod 600 "$W/bad.key"
out=$(ctl add --peer "$PEER" --volume e2e --secret-file "$W/bad.key" --size 64M 2>&1)
if [[ $? -ne 0 && "$out" == *"authentication failed"* ]]; then pass ctl-auth-failed
else fail ctl-auth-failed "$out"; fi
out=$(ctl add --peer "$PEER" --volume e2e --secret-file "$W/vol.key" --size 2G 2>&1)
if [[ $? -ne 0 && "$out" == *"--size 2G is above the quota of volume \"e2e\""* ]] && ! ctl list | grep -q ublkb; then
    pass ctl-quota-refused-before-the-kernel
else fail ctl-quota-refused-before-the-kernel "$out"; fi
out=$(ctl show 42 2>&1)
if [[ $? -ne 0 && "$out" == *"no device 42"* ]]; then pass ctl-unknown-device
else fail ctl-unknown-device "$out"; fi
out=$(ctl features 2>&1)
if [[ $? -eq 0 && "$out" == *USER_RECOVERY* ]]; then pass ctl-features; else fail ctl-features "$out"; fi
echo "$out" >"$R/features.txt"

# --wait: the node exists when add returns.
DEV=$(ctl add --wait --peer "$PEER" --volume e2e --secret-file "$W/vol.key" --size "$DEV_SIZE" --transport auto 2>"$R/add.err")
if [[ "$DEV" =~ ^/dev/ublkb[0-9]+$ ]] && [[ -b "$DEV" ]]; then pass "add --wait ($DEV)"
else echo "FAIL add ($(cat "$R/add.err"))"; exit 1; fi
ID=${DEV#/dev/ublkb}
# The udev rule names the disk by its volume (udevadm test runs the rule's
# PROGRAM against the live device; the VM has no udevd to make the link).
if command -v udevadm >/dev/null; then
    mkdir -p /run/udev/rules.d
    sed -e "s#/usr/local/bin/ublkctl#$BIN/ublkctl --config $W/ublkd.toml#" \
        "$UBLK_VM_REPO/systemd/60-ublk.rules" >/run/udev/rules.d/60-ublk.rules
    udevadm test --action=add "/sys/class/block/ublkb$ID" >"$R/udev-test.txt" 2>&1
    if grep -q "disk/by-id/ublk-e2e" "$R/udev-test.txt"; then pass "udev-rule (/dev/disk/by-id/ublk-e2e)"
    else fail udev-rule "$(grep -iE 'ublk|PROGRAM|error' "$R/udev-test.txt" | tail -20)"; fi
    rm -f /run/udev/rules.d/60-ublk.rules
else fail udev-rule "udevadm missing (scripts/vm/deps installs udev)"; fi
ctl list | tee "$R/list.txt" | grep -q "tcp" && pass ctl-list-says-tcp || fail ctl-list-says-tcp
ctl --json show "$ID" >"$R/show.json" && grep -q '"state": "live"' "$R/show.json" && pass ctl-show-live || fail ctl-show-live

# resize: a 6.12 driver has no UPDATE_SIZE, so it is refused naming that,
# and the device keeps its size (a driver with it must grow the disk).
size0=$(blockdev --getsize64 "$DEV")
out=$(ctl resize "$ID" --size 128M 2>&1); rc=$?
if grep -q UPDATE_SIZE "$R/features.txt"; then
    [[ $rc -eq 0 && "$(blockdev --getsize64 "$DEV")" == $((128 << 20)) ]] && pass resize-grows ||
        fail resize-grows "$out"
elif [[ $rc -ne 0 && "$out" == *"cannot be resized: the kernel's ublk driver has no UPDATE_SIZE"* &&
    "$(blockdev --getsize64 "$DEV")" == "$size0" ]] && ctl show "$ID" | grep -q "($size0 bytes)"; then
    pass resize-refused-without-update-size
else fail resize-refused-without-update-size "$out (size $size0 -> $(blockdev --getsize64 "$DEV"))"; fi

# ---- 1: fio verify, sequential + random, 4k..1M, several jobs ----------
log "fio"
if timeout 900 fio --output="$R/fio-verify.txt" --filename="$DEV" --direct=1 --ioengine=libaio \
    --verify=crc32c --do_verify=1 --verify_state_save=0 --verify_fatal=1 --bssplit=4k/30:64k/30:256k/20:1m/20 --iodepth=8 \
    --name=seq --rw=write --offset=0 --size=40M \
    --name=rand1 --rw=randwrite --offset=40M --size=28M \
    --name=rand2 --rw=randwrite --offset=68M --size=28M; then
    pass fio-verify
else fail fio-verify "see fio-verify.txt"; fi

# ---- metrics: a real Prometheus scrapes both daemons; the request counter
# equals the I/Os the kernel completed for the device ----------------------
log "prometheus"
http 9477/ready >"$R/ublkd-ready.json" && pass "ublkd-ready ($(cat "$R/ublkd-ready.json"))" ||
    fail ublkd-ready "$(cat "$R/ublkd-ready.json")"
http 9477/metrics >"$R/ublkd-metrics.txt"; http 9478/metrics >"$R/arenad-metrics.txt"
if /usr/bin/promtool check metrics <"$R/ublkd-metrics.txt" >"$R/promtool.txt" 2>&1 &&
    /usr/bin/promtool check metrics <"$R/arenad-metrics.txt" >>"$R/promtool.txt" 2>&1; then
    pass promtool-check-metrics
else fail promtool-check-metrics "see promtool.txt"; fi
http 9477/diagnostics >"$R/ublkd-diagnostics.json"; http 9478/diagnostics >"$R/arenad-diagnostics.json"
if grep -q '"direct_io": *true' "$R/arenad-diagnostics.json" && [[ "$(findmnt -no SOURCE "$W/arena")" == /dev/nvme0n1 ]]; then
    pass "swap-on-nvme-direct-io (swap_dir on /dev/nvme0n1, O_DIRECT)"
else fail swap-on-nvme-direct-io "$(findmnt -no SOURCE "$W/arena"), $(cat "$R/arenad-diagnostics.json")"; fi
if grep -qs -e e2e-volume-secret -e "$PEER" -e '"e2e"' "$R/ublkd-diagnostics.json" "$R/arenad-diagnostics.json"; then
    fail diagnostics-redacted "secret, peer or volume in diagnostics"
else pass diagnostics-redacted; fi
http 9477/metrics/openmetrics >"$R/ublkd-openmetrics.txt"
# ublkd is scraped as OpenMetrics (with exemplars): Prometheus's own parser
# must take it, or the request count below never arrives.
cat >"$W/prom.yml" <<YML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: ublkd
    metrics_path: /metrics/openmetrics
    static_configs: [{targets: ["127.0.0.1:9477"]}]
  - job_name: arenad
    static_configs: [{targets: ["127.0.0.1:9478"]}]
YML
/usr/bin/prometheus --config.file="$W/prom.yml" --storage.tsdb.path="$W/prom" \
    --enable-feature=exemplar-storage \
    --web.listen-address=127.0.0.1:9090 >"$R/prometheus.log" 2>&1 &
PROM_PID=$!
# The kernel's completed I/Os: reads, writes (with write-zeroes), discards, flushes.
kernel_ios=$(awk '{print $1 + $5 + $12 + $16}' "/sys/block/ublkb$ID/stat")
query() { http "9090/api/v1/query?query=$1" | sed -n 's/.*"value":\[[^,]*,"\([^"]*\)"\].*/\1/p'; }
prom_ios=""; up=""
for _ in $(seq 240); do
    up=$(query 'sum(up)')
    prom_ios=$(query 'sum(ublk_io_requests_total)')
    [[ "$up" == 2 && "$prom_ios" == "$kernel_ios" ]] && break
    sleep 0.5
done
echo "kernel completed $kernel_ios I/Os ($(cat "/sys/block/ublkb$ID/stat")); prometheus: sum(ublk_io_requests_total) = ${prom_ios:-none}, sum(up) = ${up:-none}" | tee "$R/prometheus-query.txt"
if [[ "$up" == 2 && -n "$prom_ios" && "$prom_ios" == "$kernel_ios" ]]; then
    pass "prometheus-request-count ($prom_ios = kernel completions)"
else fail prometheus-request-count "prometheus ${prom_ios:-none} vs kernel $kernel_ios, up ${up:-none}; see prometheus.log"; fi

# ---- from a latency spike to the request: arenad stopped for 3 s (longer
# than slow_threshold_ms) makes one read slow; Prometheus's exemplar query
# returns its trace id, and ublkd's log has its spans -----------------------
log "exemplar"
kill -STOP "$ARENAD_PID"
timeout 120 dd if="$DEV" of=/dev/null bs=4k count=1 skip=777 iflag=direct status=none &
DD=$!
sleep 3
kill -CONT "$ARENAD_PID"
wait "$DD"; dd_rc=$?
# Exemplars of buckets at or above 2 s: the stopped read (the highest value).
slow_trace=""
for _ in $(seq 60); do
    http "9090/api/v1/query_exemplars?query=ublk_io_latency_seconds_bucket&start=$(($(date +%s) - 600))&end=$(($(date +%s) + 60))" \
        >"$R/exemplars.json"
    slow_trace=$(/usr/bin/python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
ex = [(float(e["value"]), e["labels"].get("trace_id", ""), s["seriesLabels"].get("op", ""))
      for s in d.get("data", []) for e in s["exemplars"]]
slow = sorted(x for x in ex if x[0] >= 2.0 and x[2] == "read")
print(slow[-1][1] if slow else "")' "$R/exemplars.json" 2>>"$R/exemplars.err")
    [[ -n "$slow_trace" ]] && break
    sleep 1
done
grep "\"trace_id\":\"${slow_trace:-none}\"" "$R/ublkd.log" >"$R/slow-spans.log"
if [[ $dd_rc -eq 0 && -n "$slow_trace" ]] &&
    grep -q '"event":"span.request".*"retention":"slow"' "$R/slow-spans.log" &&
    grep -q '"event":"span.attempt".*"transport":"tcp"' "$R/slow-spans.log"; then
    corr=$(sed -n 's/.*"event":"span.request".*"corr":\([0-9]*\).*/\1/p' "$R/slow-spans.log" | head -1)
    if grep -q "\"event\":\"request.slow\".*\"corr\":$corr[,}]" "$R/ublkd.log"; then
        pass "exemplar-to-spans (trace $slow_trace: span.request slow, span.attempt, request.slow of corr $corr)"
    else fail exemplar-to-spans "no request.slow for corr ${corr:-none}"; fi
else
    fail exemplar-to-spans "dd $dd_rc, trace ${slow_trace:-none}; see exemplars.json, slow-spans.log"
fi
tcp_conns=$(query 'sum(ublk_tcp_connections)'); tcp_rtt=$(query 'max(ublk_tcp_rtt_max_seconds)')
if [[ "$tcp_conns" == 2 ]] && awk -v r="${tcp_rtt:-0}" 'BEGIN { exit !(r > 0) }'; then
    pass "tcp-info (2 arena connections, max RTT $tcp_rtt s)"
else fail tcp-info "connections ${tcp_conns:-none}, rtt ${tcp_rtt:-none}"; fi
kill "$PROM_PID" 2>/dev/null; wait "$PROM_PID" 2>/dev/null; PROM_PID=

# add -n ID --read-only --cpus: the id asked for, a disk the kernel will
# not write, its queue thread pinned to the CPU asked for.
ro=$(ctl add -n 7 --read-only --cpus 0 --wait --peer "$PEER" --volume e2e --secret-file "$W/vol.key" --size 4M 2>&1)
# (after the Prometheus count: its I/Os would be in ublkd's totals; the log
# is JSON here, key=value in the text format, so either shape is matched)
tid=$(grep 'queue.pinned' "$R/ublkd.log" | grep -E 'device(=|":)7[^0-9]' | grep -oE 'tid(=|":)[0-9]+' | tail -1 | grep -oE '[0-9]+$')
allowed=$(awk '/^Cpus_allowed_list/ { print $2 }' "/proc/$UBLKD_PID/task/${tid:-none}/status" 2>/dev/null)
if [[ "$allowed" == 0 ]]; then pass "add --cpus 0 (queue thread $tid on CPU 0)"
else fail add-cpus "tid=$tid allowed=$allowed $(grep queue.p "$R/ublkd.log" | tail -3)"; fi
if [[ "$ro" == /dev/ublkb7 && -b /dev/ublkb7 && "$(blockdev --getro /dev/ublkb7)" == 1 ]] &&
    ! dd if=/dev/zero of=/dev/ublkb7 bs=4k count=1 oflag=direct status=none 2>/dev/null &&
    ctl show 7 | grep -q "read-only" && ctl del 7 >/dev/null; then
    pass "add -n 7 --read-only"
else fail add-n-read-only "$ro $(ctl show 7 2>&1)"; ctl del --force 7 >/dev/null 2>&1; fi

# A confidential device: its volume takes only sealed sessions (arenad
# refuses a device that is not confidential, naming why); one that is
# moves verified data on the real kernel path, every frame sealed.
plain=$(ctl add -n 8 --peer "$PEER" --volume sealed --secret-file "$W/vol.key" --size 16M 2>&1)
sealed=$(ctl add -n 8 --confidential --wait --peer "$PEER" --volume sealed --secret-file "$W/vol.key" --size 16M 2>&1)
head -c 8M /dev/urandom >"$W/sealed.pattern"
why=
[[ "$plain" == *"is confidential"* ]] || why+=" plain add: $plain;"
[[ "$sealed" == /dev/ublkb8 ]] || why+=" sealed add: $sealed;"
ctl show 8 | grep -Eq "frames +sealed \(AES-256-GCM, protocol v3\)" || why+=" show: $(ctl show 8 2>&1);"
timeout 120 dd if="$W/sealed.pattern" of=/dev/ublkb8 bs=1M oflag=direct status=none 2>"$R/sealed-dd.err" ||
    why+=" write: $(cat "$R/sealed-dd.err");"
timeout 120 dd if=/dev/ublkb8 bs=1M count=8 iflag=direct status=none 2>"$R/sealed-dd.err" |
    cmp -s - "$W/sealed.pattern" || why+=" read back differs: $(cat "$R/sealed-dd.err");"
out=$(ctl del 8 2>&1) || why+=" del: $out;"
if [[ -z "$why" ]]; then pass "add --confidential (sealed frames, data verified; a plain device refused)"
else fail add-confidential "$why"; ctl del --force 8 >/dev/null 2>&1; fi

# ---- 2: ext4 mkfs, copy a tree, fsck, remount, checksums -----------------
log "ext4"
fs_ok=1
timeout 300 mkfs.ext4 -q -F "$DEV" >"$R/mkfs.log" 2>&1 || fs_ok=0
((fs_ok)) && timeout 60 mount "$DEV" "$W/mnt" || fs_ok=0
if ((fs_ok)); then
    mkdir -p "$W/mnt/tree"
    cp -a "$UBLK_VM_REPO/daemon" "$UBLK_VM_REPO/target-rdma" "$UBLK_VM_REPO/docs" "$W/mnt/tree/" || fs_ok=0
    head -c 12M /dev/urandom >"$W/mnt/tree/random.bin"
    (cd "$W/mnt/tree" && find . -type f -print0 | sort -z | xargs -0 sha256sum) >"$W/sums"
    sync
    timeout 60 umount "$W/mnt" || fs_ok=0
    timeout 300 e2fsck -fn "$DEV" >"$R/e2fsck.log" 2>&1 || fs_ok=0
    timeout 60 mount "$DEV" "$W/mnt" || fs_ok=0
    (cd "$W/mnt/tree" && sha256sum --quiet -c "$W/sums") >"$R/sha256.log" 2>&1 || fs_ok=0
    umount "$W/mnt" 2>/dev/null
fi
((fs_ok)) && pass "ext4 ($(wc -l <"$W/sums") files, e2fsck clean, checksums match)" || fail ext4 "see mkfs/e2fsck/sha256 logs"

# ---- del refuses a mounted device ---------------------------------------
if timeout 60 mount "$DEV" "$W/mnt"; then
    out=$(ctl del "$ID" 2>&1)
    if [[ $? -ne 0 && "$out" == *"is busy"* ]]; then pass ctl-del-refuses-mounted
    else fail ctl-del-refuses-mounted "$out"; echo "FAIL setup (device gone)"; exit 1; fi
    umount "$W/mnt"
else fail ctl-del-refuses-mounted "mount failed"; fi

# ---- 5: discard reads back zeros -----------------------------------------
log "discard"
head -c 8M /dev/urandom >"$W/rand8"
dd if="$W/rand8" of="$DEV" bs=1M oflag=direct conv=fsync status=none
head -c 8M /dev/zero >"$W/zero8"
if timeout 120 blkdiscard -o 0 -l 8M "$DEV" &&
    timeout 120 dd if="$DEV" of="$W/after8" bs=1M count=8 iflag=direct status=none &&
    cmp "$W/after8" "$W/zero8"; then
    pass discard-reads-zeros
else
    fail discard-reads-zeros "$(cmp "$W/after8" "$W/zero8" 2>&1 | head -1)"
    od -An -tx1 "$W/after8" | head -3
    ctl stats "$ID"
fi

# ---- 3: kill -9 ublkd under a write workload, restart, recover ----------
log "crash recovery"
before=$(stat -c %t:%T "$DEV")
timeout 900 fio --output="$R/fio-crash.txt" --filename="$DEV" --direct=1 --ioengine=libaio \
    --verify=crc32c --do_verify=1 --verify_state_save=0 --verify_fatal=1 --bs=64k --iodepth=8 \
    --name=crash --rw=write --offset=0 --size=48M &
FIO=$!
sleep 4
kill -9 "$UBLKD_PID"; wait "$UBLKD_PID" 2>/dev/null
log "ublkd killed; device state: $(cat /sys/block/ublkb$ID/stat 2>/dev/null | awk '{print $9}') in flight"
sleep 1
node_stayed=0; [[ -b "$DEV" ]] && node_stayed=1
start_ublkd "$R/ublkd.log" || log "ublkd restart failed"
recovered=0
for _ in $(seq 300); do
    ctl --json show "$ID" 2>/dev/null | grep -q '"state": "live"' && { recovered=1; break; }
    sleep 0.2
done
wait "$FIO"; fio_rc=$?
after=$(stat -c %t:%T "$DEV" 2>/dev/null)
if ((node_stayed && recovered)) && [[ $fio_rc -eq 0 && "$before" == "$after" ]]; then
    pass "crash-recovery (kill -9 mid-write, same $DEV, fio verify ok)"
else
    fail crash-recovery "node_stayed=$node_stayed recovered=$recovered fio_rc=$fio_rc dev $before -> $after"
fi

# Counters restart with ublkd (the crash above): read 1 MiB so this ublkd has
# moved payloads whatever the timing of the crash scenario.
timeout 120 dd if="$DEV" of=/dev/null bs=64k count=16 iflag=direct status=none
# --interval 0: totals and latencies since the device started (the dd is
# over before a rate sample would begin).
ctl stats --interval 0 "$ID" >"$R/stats.txt" 2>&1
if grep -q "writes" "$R/stats.txt" && grep -q "stalled" "$R/stats.txt" &&
    grep -Eq "^  reads +[1-9][0-9]* .* [0-9.]+ (us|ms|s) +[0-9.]+ (us|ms|s)$" "$R/stats.txt" &&
    grep -Eq "ublkb$ID: TCP data path - Read: 0 transfers over RDMA, [1-9][0-9]* payload requests over TCP" "$R/stats.txt" &&
    ! grep -q "warning" "$R/stats.txt"; then
    # An `auto` device that negotiated TCP (no RDMA device in this VM) is
    # held to TCP: no "configured for RDMA" warning (scripts/vm/guest/rdma-e2e.sh
    # checks the RDMA side).
    pass "ctl-stats (counters, p50/p99 per op, stalled, driver block, no RDMA warning for auto on TCP)"
else fail ctl-stats "$(cat "$R/stats.txt")"; fi

# ---- 4: arenad restart after sync keeps data ----------------------------
log "arenad restart"
head -c 16M /dev/urandom >"$W/pattern"
dd if="$W/pattern" of="$DEV" bs=1M oflag=direct conv=fsync status=none
sync
ready_is 200 || log "ublkd not ready before the arenad restart: $(http 9477/ready)"
kill "$ARENAD_PID"; wait "$ARENAD_PID" 2>/dev/null
if ready_is 503 && timeout 30 /usr/bin/curl -s http://127.0.0.1:9477/ready | grep -q peer_disconnected; then
    peer_down=1
else peer_down=0; fi
start_arenad || log "arenad restart failed"
if ((peer_down)) && ready_is 200; then pass "ready-follows-peer (503 peer_disconnected, then 200)"
else fail ready-follows-peer "peer_down=$peer_down, now $(timeout 30 /usr/bin/curl -s http://127.0.0.1:9477/ready)"; fi
if timeout 300 dd if="$DEV" bs=1M count=16 iflag=direct status=none | cmp -s - "$W/pattern"; then
    pass arenad-restart-keeps-flushed-data
else
    fail arenad-restart-keeps-flushed-data "data differs after arenad restart: needs the swap-backed store (the in-memory stand-in loses everything on restart)"
fi

# ---- teardown ------------------------------------------------------------
if out=$(ctl del --all 2>&1) && [[ "$out" == "deleted $DEV" ]] && ! ctl list | grep -q ublkb; then
    pass "ctl-del-all ($out)"
else fail ctl-del-all "$out"; fi
ctl list >>"$R/list.txt"

echo "---- summary ($((SECONDS - t0)) s) ----"
printf '%s\n' "${summary[@]}"
exit $((failures > 0))
