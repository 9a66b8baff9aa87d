#!/usr/bin/env bash
# The README's benchmark table: each row is a kvperf command, run 3 times; the median of its
# ratio to a reference measured in the same run (the ceiling, memcpy, iperf3, a raw round trip).
# Usage: perf/bench.sh [target/release]   (build first: cargo build --release --workspace --bins)
set -euo pipefail
bin=${1:-target/release}
kvperf="$bin/kvperf"
source "$(dirname "$0")/lib.sh"
row() { # name, json field, kvperf arguments...
    local name=$1 f=$2; shift 2
    local vals=()
    for _ in 1 2 3; do vals+=("$("$kvperf" pushpull "$@" --json --reference 2>/dev/null | field "$f")"); done
    echo "| $name | \`kvperf pushpull $*\` | $f $(med "${vals[@]}") |"
}
echo "| row | command | median of 3 |"
echo "| --- | --- | --- |"
row "W=2 S=2 64 MiB shm, kv.alloc arrays (x zero-copy ceiling)" ratio_limit -n 2 -s 2 --transport shm --size 64M --iters 10 --alloc
row "W=2 S=2 64 MiB shm, heap arrays (x one-copy ceiling)" ratio_limit -n 2 -s 2 --transport shm --size 64M --iters 10
row "W=1 S=1 64 MiB tcp (x iperf3 single stream)" ratio_iperf3 -n 1 -s 1 --transport tcp --size 64M --iters 10
row "W=1 S=1 64 MiB shm (x memcpy)" ratio_memcpy -n 1 -s 1 --transport shm --size 64M --iters 10
# A 4-byte push and its ack against the raw shared-memory round trip (twice the one-way p50).
push=() raw=()
for _ in 1 2 3; do
    push+=("$("$kvperf" pushpull -n 1 -s 1 --transport shm --size 4 --op push --iters 20000 --json 2>/dev/null | field call_p50_us)")
    raw+=("$("$kvperf" lat --transport shm --local --size 4 --iters 20000 2>/dev/null | awk '$1 == "4" { print 2 * $4 }')")
done
echo "| 4-byte push+ack p50, us (x raw shm round trip $(med "${raw[@]}") us) | \`kvperf pushpull -n 1 -s 1 --transport shm --size 4 --op push\`; \`kvperf lat --transport shm --local --size 4\` | $(med "${push[@]}") |"
# The raw shared-memory transport's small-message latency against two threads of one process
# passing the same message through shared memory with nothing else (the same run).
lat=()
for _ in 1 2 3; do
    j=$("$kvperf" lat --transport shm --local --size 64 --iters 20000 --reference --json 2>/dev/null)
    lat+=("$(python3 -c "print($(field p50_us <<<"$j") / $(field ref_p50_us <<<"$j"))")")
done
echo "| 64-byte shm one-way p50 (x two threads through shared memory) | \`kvperf lat --transport shm --local --size 64 --reference\` | $(med "${lat[@]}") |"
# 2-bit gradient compression: quantize (worker) and dequantize (server) against memcpy of the
# same bytes, one core; then compressed push+pull against uncompressed, paired, per transport.
for f in quantize_x_memcpy dequantize_x_memcpy; do
    v=()
    for _ in 1 2 3; do v+=("$("$kvperf" compress --size 64M --json 2>/dev/null | field "$f")"); done
    echo "| 64 MiB of f32: $f | \`kvperf compress --size 64M\` | $(med "${v[@]}") |"
done
for t in tcp shm; do for f in us_per_iter call_p50_us; do
    r=()
    for _ in 1 2 3; do
        a=$("$kvperf" pushpull -n 2 -s 2 --transport "$t" --size 16M --iters 20 --compress --json 2>/dev/null | field "$f")
        b=$("$kvperf" pushpull -n 2 -s 2 --transport "$t" --size 16M --iters 20 --json 2>/dev/null | field "$f")
        r+=("$(python3 -c "print($a / $b)")")
    done
    echo "| W=2 S=2 16 MiB $t: $f compressed/uncompressed (call: the push) | \`kvperf pushpull -n 2 -s 2 --transport $t --size 16M --compress\` (and without) | $(med "${r[@]}") |"
done; done
# Shared memory against TCP, paired: us per iteration, shm/tcp.
for w in 1 2 3; do for s in 1 2; do for spec in 4K:1:2000 1M:1:200 64M:1:10 1K:1000:20; do
    IFS=: read -r size keys iters <<<"$spec"
    r=()
    for _ in 1 2 3; do
        a=$("$kvperf" pushpull -n "$w" -s "$s" --transport shm --size "$size" --keys "$keys" --iters "$iters" --json 2>/dev/null | field us_per_iter)
        b=$("$kvperf" pushpull -n "$w" -s "$s" --transport tcp --size "$size" --keys "$keys" --iters "$iters" --json 2>/dev/null | field us_per_iter)
        r+=("$(python3 -c "print($a / $b)")")
    done
    echo "| W=$w S=$s $size x $keys keys: shm/tcp time | \`kvperf pushpull -n $w -s $s --size $size --keys $keys --transport shm\` (and tcp) | $(med "${r[@]}") |"
done; done; done
