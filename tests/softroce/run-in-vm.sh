#!/bin/bash
# Run a command inside a throwaway Debian 12 VM that has soft-RoCE (rxe0) up.
#
#   run-in-vm.sh [-C DIR] 'SHELL COMMAND'
#   run-in-vm.sh [-C DIR] PROGRAM ARG...     (2+ words: run exactly, no shell parsing;
#                                             so it works as a cargo target runner)
#
# DIR (default: $VM_SHARE, else the current directory) is shared into the VM with
# 9p (read-write) at the SAME absolute path. COMMAND runs with sh, as root, in the
# current directory if that lies inside DIR (else in DIR), with rxe0 bound to the
# VM's virtio-net NIC (eth0, 10.0.2.15/24 by default).
# COMMAND's stdout+stderr are streamed to this script's stdout; the script exits
# with COMMAND's exit status (254: VM setup failed, 255: VM died / timed out).
#
# Environment knobs:
#   VM_CPUS=2        vCPUs               VM_MEM=1024     guest RAM in MiB
#   VM_TIMEOUT=900   seconds for the whole VM run
#   VM_ACCEL=tcg     tcg (default; works here) or kvm (needs a VMX/SVM host, see NOTES.md)
#   VM_IP=10.0.2.15  guest address for eth0 (all RDMA traffic stays inside the VM)
#   VM_RXE=1         0 = do not create rxe0
#   VM_SHARE=DIR     folder to share (default $PWD; -C DIR overrides and also cd's there)
#   VM_PASS_ENV="RUST_BACKTRACE RUST_LOG"  host variables exported into COMMAND
#   VM_NETDEV=...    replace the qemu -netdev backend (default: user,restrict=on = isolated)
#   VM_MAC=52:54:00:12:34:56
#   VM_VERBOSE=1     print the guest console (kernel log) and timings to stderr
#   VM_KEEP=1        keep the control dir (console.log, timing) and print its path
#   SOFTROCE_DIR=/var/tmp/kvstore-softroce   where setup-vm.sh put the image
set -uo pipefail

SR=${SOFTROCE_DIR:-/var/tmp/kvstore-softroce}
DIR=${VM_SHARE:-$PWD}
WORKDIR=$(pwd -P)
if [ "${1:-}" = "-C" ]; then DIR=$2; WORKDIR=; shift 2; fi
if [ $# -lt 1 ]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
fi
if [ $# -eq 1 ]; then CMD=$1; else CMD=$(printf '%q ' "$@"); fi
DIR=$(cd "$DIR" && pwd -P) || { echo "run-in-vm: no such directory" >&2; exit 2; }
case "$WORKDIR/" in "$DIR"/*) ;; *) WORKDIR=$DIR ;; esac
[ "$DIR" = / ] && { echo "run-in-vm: refusing to share / into the VM" >&2; exit 2; }

# prefer the uncompressed vmlinux (PVH direct boot, faster); vmlinuz also works
KERNEL=$SR/kernel/vmlinux
[ -f "$KERNEL" ] || KERNEL=$SR/kernel/vmlinuz
for f in "$KERNEL" "$SR/kernel/initrd.gz" "$SR/root.img"; do
    [ -f "$f" ] || { echo "run-in-vm: $f missing: run setup-vm.sh first" >&2; exit 2; }
done

ACCEL=${VM_ACCEL:-tcg}
case "$ACCEL" in
    tcg) accel_opts=(-accel tcg,thread=multi,tb-size=256 -cpu max) ;;
    kvm) accel_opts=(-accel kvm -cpu host) ;;
    *) echo "run-in-vm: VM_ACCEL must be tcg or kvm" >&2; exit 2 ;;
esac

CTL=$(mktemp -d /tmp/softroce-run.XXXXXX)
cleanup() {
    [ -n "${QPID:-}" ] && kill "$QPID" 2>/dev/null
    [ -n "${TPID:-}" ] && kill "$TPID" 2>/dev/null
    if [ "${VM_KEEP:-0}" = 1 ]; then echo "run-in-vm: control dir kept: $CTL" >&2; else rm -rf "$CTL"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

{
    printf 'VM_SHARE_PATH=%q\n' "$DIR"
    printf 'VM_WORKDIR=%q\n' "$WORKDIR"
    printf 'VM_IP=%q\n' "${VM_IP:-10.0.2.15}"
    printf 'VM_PREFIX=%q\n' "${VM_PREFIX:-24}"
    printf 'VM_RXE=%q\n' "${VM_RXE:-1}"
    for v in ${VM_PASS_ENV:-}; do
        [ -n "${!v+x}" ] && printf 'export %s=%q\n' "$v" "${!v}"
    done
} > "$CTL/env"
printf '%s\n' "$CMD" > "$CTL/cmd"
: > "$CTL/output.log"

t0=$(date +%s.%N)
timeout --foreground -k 5 "${VM_TIMEOUT:-900}" \
qemu-system-x86_64 "${accel_opts[@]}" -M pc -smp "${VM_CPUS:-2}" -m "${VM_MEM:-1024}" \
    -nodefaults -no-user-config -display none -vga none -no-reboot \
    -kernel "$KERNEL" -initrd "$SR/kernel/initrd.gz" \
    -append "console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off tsc=reliable ${VM_APPEND:-}" \
    -drive "file=$SR/root.img,format=raw,if=virtio,snapshot=on,cache=unsafe" \
    -virtfs "local,path=$CTL,mount_tag=ctl,security_model=none" \
    -virtfs "local,path=$DIR,mount_tag=share,security_model=none" \
    -netdev "${VM_NETDEV:-user,id=n0,restrict=on}" \
    -device "virtio-net-pci,netdev=n0,mac=${VM_MAC:-52:54:00:12:34:56}" \
    -serial "file:$CTL/console.log" -serial "file:$CTL/output.log" \
    -monitor none < /dev/null > "$CTL/qemu.log" 2>&1 &
QPID=$!
tail -n +1 -f --pid=$QPID "$CTL/output.log" 2>/dev/null &
TPID=$!
wait $QPID
qrc=$?
QPID=
t1=$(date +%s.%N)
wait $TPID 2>/dev/null
TPID=

if [ -s "$CTL/rc" ]; then rc=$(cat "$CTL/rc"); else rc=255; fi
if [ "$rc" = 254 ] || [ "$rc" = 255 ] || [ "${VM_VERBOSE:-0}" = 1 ]; then
    [ "$rc" = 255 ] && echo "run-in-vm: VM ended without a result (qemu exit $qrc; 124 = VM_TIMEOUT)" >&2
    [ -s "$CTL/setup-error" ] && cat "$CTL/setup-error" >&2
    [ -s "$CTL/qemu.log" ] && sed 's/^/qemu: /' "$CTL/qemu.log" >&2
    echo "---- guest console (tail) ----" >&2
    tail -n 40 "$CTL/console.log" | tr -d '\r' | sed 's/\x1b\[[0-9;?]*[a-zA-Z]//g; s/\x1bc//g' >&2
fi
if [ "${VM_VERBOSE:-0}" = 1 ] || [ -n "${VM_TIMING_FILE:-}" ]; then
    # guest uptimes at milestones + host wall time
    t=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')
    {
        echo "host_wall_s $t"
        [ -f "$CTL/started" ] && awk -v a="$t0" -v b="$(date -r "$CTL/started" +%s.%N)" \
            'BEGIN{printf "host_qemu_start_to_command_s %.2f\n", b-a}'
        [ -f "$CTL/timing" ] && sed 's/^/guest_uptime_s_at_/' "$CTL/timing"
    } > "${VM_TIMING_FILE:-/dev/stderr}"
fi
exit "$rc"
