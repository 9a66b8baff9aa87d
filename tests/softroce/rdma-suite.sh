#!/usr/bin/env bash
# The RDMA suite over soft-RoCE. Builds with the `rdma` feature (release, in target/rdma, apart
# from the default build), runs the host-side tests here (a host without a device gets clean
# errors), builds the VM image once (setup-vm.sh, cached under $SOFTROCE_DIR), and runs in the
# VM, where rxe0 is up: the transport conformance suite over rdma, the store's distributed
# tests over rdma (tests/rdma.rs), kvperf over rdma beside perftest on the same device
# (perf-in-vm.sh), and then a job across two VMs (two-vm-job.sh). Exits non-zero on any failure.
#   tests/softroce/rdma-suite.sh
# Needs: libibverbs-dev libclang-dev pkg-config (to build), root with apt-get the first time
# (the image is made from Debian packages). SKIP_PERF=1 and SKIP_TWO_VM=1 leave those parts out.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=tests/softroce
export CARGO_TARGET_DIR=$PWD/target/rdma

exe() {
    # The test executable cargo built for tests/$2.rs of package $1.
    cargo test --release -p "$1" --features rdma --test "$2" --no-run 2>&1 \
        | sed -n "s|.*Executable tests/$2.rs (\(.*\))|\1|p" | tail -n 1
}

cargo build --release -p kvstore --features rdma --examples
cargo build --release -p kvstore-launcher -p kvstore-perf --features kvstore-perf/rdma --bins
cargo test --release -p kvstore-transport --features rdma --lib
CONF=$(exe kvstore-transport conformance)
BACK=$(exe kvstore-transport backends)
TRUST=$(exe kvstore-transport trust)
DIST=$(exe kvstore rdma)
for t in "$CONF" "$BACK" "$TRUST" "$DIST"; do
    [ -x "$t" ] || { echo "rdma-suite: a test executable is missing" >&2; exit 1; }
done

# Runs a test executable, its output shown as it comes, and fails where it ran no test (a
# filter that a rename left matching nothing passes silently otherwise). Also defined in the
# VM's command below.
RAN='ran() { f=$(mktemp); { "$@" && echo kvstore-ran-rc=0 || echo "kvstore-ran-rc=$?"; } 2>&1 | tee "$f"; rc=$(sed -n "s/^kvstore-ran-rc=//p" "$f"); n=$(grep -c "test result: ok\. [1-9]" "$f" || true); rm -f "$f"; [ "$rc" = 0 ] || return "${rc:-1}"; [ "${n:-0}" -gt 0 ] || { echo "ran no test: $*" >&2; return 1; }; }'
eval "$RAN"

# On this host (no device): clean errors, and a job that runs over TCP and says why.
ran "$BACK" --exact rdma_without_a_device_is_a_clean_error
ran "$DIST" --exact rdma_forced_without_a_device_is_an_error_naming_the_reason

"$HERE/setup-vm.sh"
# In the VM: the conformance suite and the backend's own tests over rdma (vgem gives the
# dma-buf that the backend tries to register, which rxe refuses); the store's tests over rdma,
# the port-down fault last (it takes eth0 down and up again).
VM_MEM=${VM_MEM:-2048} VM_TIMEOUT=${VM_TIMEOUT:-1200} "$HERE/run-in-vm.sh" -C "$PWD" \
    "set -e; $RAN; modprobe vgem; ran $CONF rdma --test-threads=1; \
     ran $BACK rdma --test-threads=1; ran $TRUST --test-threads=1; \
     ran $DIST --test-threads=1 --skip rdma_forced_without --skip rdma_the_port_going_down \
       --skip rdma_the_locked_memory_limit; \
     ran $DIST --test-threads=1 rdma_the_port_going_down; \
     ulimit -l 64; ran setpriv --reuid=65534 --regid=65534 --clear-groups -- \
       $DIST --test-threads=1 rdma_the_locked_memory_limit"

if [ "${SKIP_PERF:-0}" != 1 ]; then
    VM_TIMEOUT=${VM_TIMEOUT:-600} "$HERE/run-in-vm.sh" -C "$PWD" \
        "sh $HERE/perf-in-vm.sh $CARGO_TARGET_DIR/release/kvperf"
fi
if [ "${SKIP_TWO_VM:-0}" != 1 ]; then
    "$HERE/two-vm-job.sh" "$CARGO_TARGET_DIR/release"
fi
