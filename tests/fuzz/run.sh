#!/bin/bash
# Coverage-guided fuzzing of what kvstore reads from peers, with afl.rs (AFL++ on stable Rust;
# cargo-fuzz needs a nightly toolchain, which cannot be installed here). Each target runs from
# the committed seed corpus (tests/fuzz/corpus/TARGET) for SECONDS (default 60); a crash fails
# the run and is copied to tests/fuzz/regressions/TARGET/, which `cargo test` replays
# (tests/fuzz_regressions.rs) once it is committed.
#   tests/fuzz/run.sh [SECONDS] [TARGET...]        targets: frames protocol shm
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SECS=${1:-60}
shift || true
TARGETS=${*:-frames protocol shm}
command -v cargo-afl >/dev/null || cargo install cargo-afl --version 0.18.2 --locked
# AFL++'s runtime for this toolchain, built once (cargo-afl refuses to build it again, and
# `cargo afl build` below says plainly if it is still missing).
cargo afl config --build >/dev/null 2>&1 || true
cd "$HERE"
cargo afl build --release
export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_BENCH_UNTIL_CRASH=1
status=0
for t in $TARGETS; do
    out=$(mktemp -d)
    echo "fuzz: $t for ${SECS}s"
    cargo afl fuzz -V "$SECS" -i "corpus/$t" -o "$out" "target/release/$t" >"$out.log" 2>&1 || {
        tail -n 20 "$out.log"
        status=1
    }
    grep -E "execs_done|corpus_count|saved_crashes" "$out/default/fuzzer_stats" 2>/dev/null | tr -s ' ' | paste -sd' ' || true
    crashes=$(find "$out/default/crashes" -type f -name 'id:*' 2>/dev/null | wc -l)
    if [ "$crashes" -gt 0 ]; then
        mkdir -p "regressions/$t"
        cp "$out"/default/crashes/id:* "regressions/$t/"
        echo "fuzz: $t found $crashes crash(es), copied to tests/fuzz/regressions/$t"
        status=1
    fi
    rm -rf "$out" "$out.log"
done
exit $status
