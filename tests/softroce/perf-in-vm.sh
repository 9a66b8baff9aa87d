#!/bin/sh
# Runs INSIDE the soft-RoCE VM (rdma-suite.sh starts it): kvperf over rdma beside perftest on
# the same device in the same run, and the ratios. Emulated speeds vary fivefold with the host's
# load: only the ratios mean anything, and no figure is asserted (a kvperf run that fails, or
# prints none, fails the script; perftest's are shown as they come).
#   sh tests/softroce/perf-in-vm.sh PATH/TO/kvperf
set -eu
K=$1
DEV=$(ls /sys/class/infiniband | head -n 1)
IP=$(ip -4 -o addr show dev eth0 | awk '{sub("/.*","",$4); print $4; exit}')
ITERS=${PERF_ITERS:-1000}

# perftest: server in the background, client here; prints the client's result line.
perftest() { # tool size
    "$1" -d "$DEV" -s "$2" -n "$ITERS" -F ${3:+"$3"} > /tmp/pt.server 2>&1 &
    sleep 1
    "$1" -d "$DEV" -s "$2" -n "$ITERS" -F ${3:+"$3"} "$IP" > /tmp/pt.client 2>&1
    wait
    awk -v s="$2" '$1 == s && NF >= 4 { print; exit }' /tmp/pt.client
}
# kvperf's run (set -e stops the script where it fails), then a field of its JSON line, which
# must be there: a run that printed no figure fails the script rather than leave a blank.
kv() { # field args...
    f=$1
    shift
    "$K" "$@" --json > /tmp/kv.out
    v=$(field "$f" < /tmp/kv.out)
    [ -n "$v" ] || { cat /tmp/kv.out >&2; echo "perf-in-vm: kvperf $* gave no $f" >&2; exit 1; }
    echo "$v"
}
# A field of kvperf's JSON line.
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" | head -n 1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }

echo "device $DEV at $IP, $ITERS iterations a size"
echo
echo "bandwidth, one-sided writes (kvperf bw --mode write: a WRITE_WITH_IMM into each granted slot)"
printf '%8s %14s %14s %8s\n' size "kvperf Gb/s" "ib_write_bw" ratio
for s in 65536 1048576; do
    k=$(kv gbits_per_s bw --transport rdma --local --size "$s" --iters "$ITERS" --mode write)
    p=$(perftest ib_write_bw "$s" --report_gbits | awk '{ print $4 }')
    echo "$p" > "/tmp/wbw.$s"
    # One write at a time (as a store's call waits for its answer): the pushpull rows' ceiling.
    kv gbits_per_s bw --transport rdma --local --size "$s" --iters "$ITERS" --mode write \
        --window 1 > "/tmp/w1.$s"
    printf '%8s %14s %14s %8s\n' "$s" "$k" "$p" "$(ratio "$k" "$p")"
done
echo
echo "latency, 8 bytes, one way (half the round trip), us: kvperf p50 against perftest t_typical"
ks=$(kv p50_us lat --transport rdma --local --size 8 --iters "$ITERS" --mode send)
kw=$(kv p50_us lat --transport rdma --local --size 8 --iters "$ITERS" --mode write)
ke=$(export KVSTORE_RDMA_WRITE_IMM=0; kv p50_us lat --transport rdma --local --size 8 \
    --iters "$ITERS" --mode write)
ps=$(perftest ib_send_lat 8 | awk '{ print $5 }')
pw=$(perftest ib_write_lat 8 | awk '{ print $5 }')
printf '%-36s %8s %14s %8s\n' "" kvperf "perftest" ratio
printf '%-36s %8s %14s %8s\n' "send (kvperf --mode send)" "$ks" "ib_send_lat $ps" "$(ratio "$ks" "$ps")"
printf '%-36s %8s %14s %8s\n' "put as WRITE_WITH_IMM (the default)" "$kw" "ib_send_lat $ps" "$(ratio "$kw" "$ps")"
printf '%-36s %8s %14s %8s\n' "put as an eager SEND (WRITE_IMM=0)" "$ke" "ib_send_lat $ps" "$(ratio "$ke" "$ps")"
printf '%-36s %8s %14s %8s\n' "" "" "ib_write_lat $pw" ""
echo
echo "the store: W=1 S=1 push+pull over rdma (kvperf pushpull: 2 x size a round), against ib_write_bw"
echo "and against kvperf bw with one write in flight (--window 1), as a call waits for its answer"
printf '%8s %14s %14s %8s %14s %8s\n' size "kvperf Gb/s" "ib_write_bw" ratio "window 1" ratio
for s in 65536 1048576; do
    "$K" pushpull -n 1 -s 1 --transport rdma --size "$s" --iters 20 --json > /tmp/pp.out 2>&1
    grep -q "server 0 rdma" /tmp/pp.out || { cat /tmp/pp.out; echo "not over rdma"; exit 1; }
    g=$(grep '"gbps_all"' /tmp/pp.out | tail -n 1 | field gbps_all)
    [ -n "$g" ] || { cat /tmp/pp.out; echo "perf-in-vm: pushpull gave no gbps_all"; exit 1; }
    g=$(echo "$g" | awk '{ printf "%.3f", $1 * 8 }')
    p=$(cat "/tmp/wbw.$s")
    w=$(cat "/tmp/w1.$s")
    printf '%8s %14s %14s %8s %14s %8s\n' "$s" "$g" "$p" "$(ratio "$g" "$p")" "$w" "$(ratio "$g" "$w")"
done
