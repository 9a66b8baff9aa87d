# Helpers of perf/bench.sh and perf/guard.sh (sourced): a JSON field's last number, and the
# median of numbers.
field() { grep -o "\"$1\":[0-9.e+-]*" | tail -1 | cut -d: -f2; }
med() { python3 -c 'import sys,statistics; print(f"{statistics.median(float(x) for x in sys.argv[1:]):.3g}")' "$@"; }
