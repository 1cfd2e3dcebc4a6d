#!/usr/bin/env bash
# Usage: cargo test --release -p target-rdma --no-run --test transport_conformance --test rdma_transport
#        scripts/vm/run scripts/vm/guest/rdma.sh [TIMEOUT_S]
#
# Guest scenario: the RDMA transport over real verbs on soft-RoCE (rxe on
# lo, GID index 1). Runs the transport conformance suite against the RDMA
# transport (with a completion thread, and driven on a ring loop), then the counters test that asserts payloads went by RDMA
# (transferred > 0, TCP payload requests = 0) and that a request above the
# registered buffer size is counted as `too_large`, then the per-lease RDMA
# isolation checks (verbs_isolation_*) and their cost (BENCH lines). Prints
# "PASS name" / "FAIL name" per test and exits non-zero if any failed.
set -uo pipefail

[[ "${UBLK_VM:-}" == 1 ]] || { echo "run me via scripts/vm/run" >&2; exit 2; }

failed=0
newest() { # newest PATTERN : newest host-built test binary matching PATTERN
    find target/release/deps -maxdepth 1 -type f -executable -name "$1" -printf '%T@ %p\n' |
        sort -n | tail -1 | cut -d' ' -f2-
}
run_tests() { # run_tests BINARY NAME ARGS... : one PASS/FAIL line per test
    local bin=$1 filter=$2 log
    log="$UBLK_VM_RESULTS/$(basename "$1")-$2.log"
    if [[ -z "$bin" ]]; then
        echo "FAIL $filter (test binary not built on the host)"
        failed=1
        return
    fi
    RUST_BACKTRACE=1 timeout 600 "$bin" --ignored --test-threads=1 "${@:3}" >"$log" 2>&1
    local rc=$?
    grep -E '^test .* \.\.\. (ok|FAILED)$' "$log" |
        sed -E 's/^test (.*) \.\.\. ok$/PASS \1/; s/^test (.*) \.\.\. FAILED$/FAIL \1/'
    if ((rc != 0)) || ! grep -q '^test result: ok' "$log"; then
        failed=1
        sed 's/^/    /' "$log" | tail -40
    fi
}

timeout 10 /usr/sbin/ip link set lo up
timeout 10 /usr/bin/rdma link add rxe0 type rxe netdev lo || { echo "FAIL rxe-add"; exit 1; }
for _ in $(seq 100); do [[ -c /dev/infiniband/uverbs0 ]] && break; sleep 0.1; done
echo "PASS rxe0-up"

conf=$(newest 'transport_conformance-*')
rt=$(newest 'rdma_transport-*')
# Every case of the suite's rdma_verbs module: the same cases every
# transport passes, over real verbs; then the same with the completions
# reaped on a ring loop (driven, as ublkd's queue threads run it).
run_tests "$conf" conformance rdma_verbs::
run_tests "$conf" conformance-driven rdma_verbs_driven::
run_tests "$rt" counters --exact verbs_payloads_go_by_rdma_and_a_forced_fallback_is_counted
# Per-lease isolation over soft-RoCE (a protection domain per session, a
# region per lease): a client with a valid lease on its own slot cannot READ
# or WRITE another volume's slot, past its own slot's end, with another
# session's key, through a GET lease's key, or with a key whose lease ended
# (COMMIT, RELEASE, a lost COMMIT, a new rail, ended by force: a remote
# access error at once, bytes unchanged); "shared" still serves; the cost
# per lease (BENCH lines, kept in the log).
run_tests "$rt" isolation verbs_isolation_ --show-output
grep -h '^BENCH\|max_pd' "$UBLK_VM_RESULTS"/rdma_transport-*-isolation.log || true

if ((failed)); then echo "rdma: FAILED"; else echo "rdma: all checks passed"; fi
exit "$failed"
