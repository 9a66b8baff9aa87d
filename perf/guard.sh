#!/usr/bin/env bash
# The performance guard of the issue "One data path for every transport": kvperf pushpull
# beside an older build of the store, paired and interleaved (old, new, old, new, ...), the
# median of the per-pair ratios new/old of microseconds per iteration. Above 1.0 is slower.
# Usage: perf/guard.sh OLD_BIN_DIR [NEW_BIN_DIR] [PAIRS]
#   OLD_BIN_DIR holds kvperf and kvrun of the reference, e.g. built with
#   git worktree add /tmp/old 798294a && (cd /tmp/old && cargo build --release -p kvstore-perf --bins)
set -euo pipefail
old=${1:?usage: perf/guard.sh OLD_BIN_DIR [NEW_BIN_DIR] [PAIRS]}
new=${2:-target/release}
pairs=${3:-3}
source "$(dirname "$0")/lib.sh"
one() { "$1/kvperf" pushpull "${@:2}" --json 2>/dev/null | field us_per_iter; }
echo "| cell | new/old per pair | median |"
echo "| --- | --- | --- |"
for ws in "1 1" "2 2"; do
    read -r w s <<<"$ws"
    for t in shm tcp; do
        for spec in 4K:4000 1M:300 64M:12; do
            IFS=: read -r size iters <<<"$spec"
            args=(-n "$w" -s "$s" --transport "$t" --size "$size" --iters "$iters")
            r=()
            for _ in $(seq "$pairs"); do
                a=$(one "$old" "${args[@]}")
                b=$(one "$new" "${args[@]}")
                r+=("$(python3 -c "print(f'{$b / $a:.3f}')")")
            done
            echo "| W=$w S=$s $t $size | ${r[*]} | $(med "${r[@]}") |"
        done
    done
done
