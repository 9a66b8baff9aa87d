#!/usr/bin/env bash
# A W=2 S=2 job across two VMs, each with its own rxe0, joined by a qemu UDP socket link on
# 127.0.0.1, so RoCE v2 frames really cross a virtio NIC. VM A (10.0.2.15) runs the scheduler,
# server 0 and worker 0; VM B (10.0.2.16) runs server 1 and worker 1, with roles from the
# environment (as under mpirun). Every value is checked by dist_check; this script asserts the
# transport of every pair: shared memory on the same host, RDMA across the hosts.
#   tests/softroce/two-vm-job.sh [DIR with kvrun and examples/dist_check, built with rdma]
set -uo pipefail
cd "$(dirname "$0")/../.."
HERE=tests/softroce
BIN=${1:-target/rdma/release}
PORT=${PORT:-47931}
export VM_CPUS=${VM_CPUS:-2} VM_TIMEOUT=${VM_TIMEOUT:-900}
NA="socket,id=n0,udp=127.0.0.1:$((PORT + 1)),localaddr=127.0.0.1:$PORT"
NB="socket,id=n0,udp=127.0.0.1:$PORT,localaddr=127.0.0.1:$((PORT + 1))"
LOGS=$(mktemp -d /tmp/two-vm-job.XXXXXX)
trap 'rm -rf "$LOGS"' EXIT

JOB="export DMLC_PS_ROOT_URI=10.0.2.15 DMLC_PS_ROOT_PORT=9100 DMLC_NUM_SERVER=2 \
DMLC_NUM_WORKER=2 KVSTORE_SECRET=two-vm-job-of-the-rdma-suite KVSTORE_TIMEOUT=120 KVSTORE_BIGARRAY_BOUND=100"
P="$BIN/examples/dist_check seed dist_sync"
# Each VM: its processes in the background, then the worker; waits for all, prints every log.
vm_cmd() { # roles "name:role:rank ..."
    # Under emulation one VM may boot minutes after the other (both share the host's two
    # cores): each waits for the other to answer before its job starts its 120 s rendezvous.
    local wait_peer="up=0; for i in \$(seq 80); do ping -c 1 -W 5 ${2} > /dev/null && { up=1; break; }; sleep 1; done"
    local c="$JOB; $wait_peer; [ \$up = 1 ] && echo \"${2} answered after \$i pings\" || echo 'no ping'; pids=''"
    local r name role rank
    for r in $1; do
        IFS=: read -r name role rank <<< "$r"
        c="$c; DMLC_ROLE=$role KVSTORE_RANK=$rank $P > /tmp/$name.log 2>&1 & pids=\"\$pids \$!\""
    done
    c="$c; rc=0; for p in \$pids; do wait \$p || rc=1; done"
    for r in $1; do
        name=${r%%:*}
        c="$c; sed 's/^/[$name] /' /tmp/$name.log"
    done
    echo "$c; exit \$rc"
}

VM_NETDEV="$NA" VM_IP=10.0.2.15 VM_MAC=52:54:00:12:34:56 "$HERE/run-in-vm.sh" -C "$PWD" \
    "$(vm_cmd "scheduler:scheduler:0 server0:server:0 worker0:worker:0" 10.0.2.16)" \
    > "$LOGS/a" 2>&1 &
a=$!
VM_NETDEV="$NB" VM_IP=10.0.2.16 VM_MAC=52:54:00:12:34:57 "$HERE/run-in-vm.sh" -C "$PWD" \
    "$(vm_cmd "server1:server:1 worker1:worker:1" 10.0.2.15)" > "$LOGS/b" 2>&1
brc=$?
wait $a
arc=$?
cat "$LOGS/a" "$LOGS/b"
fail=0
[ $arc = 0 ] && [ $brc = 0 ] || { echo "two-vm-job: VM A rc=$arc, VM B rc=$brc"; fail=1; }
expect() { # log pattern
    grep -q -- "$2" "$LOGS/$1" || { echo "two-vm-job: missing in VM $1: $2"; fail=1; }
}
expect a "\[worker0\] rank 0 reaches server 0 at .* via shm"
expect a "\[worker0\] rank 0 reaches server 1 at .* via rdma"
expect b "\[worker1\] rank 1 reaches server 0 at .* via rdma"
expect b "\[worker1\] rank 1 reaches server 1 at .* via shm"
expect a "\[worker0\] seed ok rank 0 of 2"
expect b "\[worker1\] seed ok rank 1 of 2"
[ $fail = 0 ] && echo "two-vm-job: ok (shm within each VM, rdma across them, every value exact)"
exit $fail
