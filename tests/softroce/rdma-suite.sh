#!/usr/bin/env bash
# The RDMA suite over soft-RoCE: builds the verbs backend's tests (feature `rdma`), runs the
# host-side ones here (a host without a device must get a clean error), builds the VM image
# once (setup-vm.sh, cached under $SOFTROCE_DIR), and runs the conformance suite over rdma in
# the VM, where rxe0 is up. Exits with the suite's status.
#   tests/softroce/rdma-suite.sh
# Needs: libibverbs-dev libclang-dev pkg-config (to build), root with apt-get the first time
# (the image is made from Debian packages).
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=tests/softroce

exe() {
    # The test executable cargo built for tests/$1.rs.
    cargo test -p kvstore-transport --features rdma --test "$1" --no-run 2>&1 \
        | sed -n "s|.*Executable tests/$1.rs (\(.*\))|\1|p" | tail -n 1
}

cargo build -p kvstore-transport --features rdma --tests
cargo test -p kvstore-transport --features rdma --lib
T=$(exe conformance)
[ -x "$T" ] || { echo "rdma-suite: no conformance executable" >&2; exit 1; }
# On this host: no device is a clean error (or, on a host with one, the backend opens it).
"$T" rdma_without_a_device_is_a_clean_error

"$HERE/setup-vm.sh"
# In the VM: every conformance test over rdma, the registration cache, and the device found.
VM_TIMEOUT=${VM_TIMEOUT:-600} "$HERE/run-in-vm.sh" -C "$PWD" "$T rdma --test-threads=1"
