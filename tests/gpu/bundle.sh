#!/usr/bin/env bash
# Builds what the GPU tests need, here (release, feature `cuda`), into one folder to carry to a
# GPU machine that has the NVIDIA driver and CUDA but no Rust, with the layout the tests expect
# (binaries beside `deps/`), stripped to travel light, and a script that runs them there:
#   tests/gpu/bundle.sh            -> target/gpu-bundle/ (run.sh, release/...)
#   (on the GPU machine)  target/gpu-bundle/run.sh
# run.sh prints nvidia-smi, then runs the ignored GPU tests and the walkthrough on every GPU,
# and measures the sum on a GPU against a device copy (kvperf gpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/gpu-bundle
rm -rf "$out"
mkdir -p "$out/release/deps" "$out/release/examples"
cargo build --release --features kvstore/cuda -p kvstore-launcher --bins
cargo build --release --features kvstore-perf/cuda -p kvstore-perf --bins
cargo build --release --features kvstore/cuda -p kvstore --examples
test_bin=$(cargo test --release --features kvstore/cuda -p kvstore --test gpu --no-run \
    --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
cp "$test_bin" "$out/release/deps/gpu"
cp target/release/kvrun target/release/kvperf "$out/release/"
cp target/release/examples/dist_check target/release/examples/walkthrough "$out/release/examples/"
strip "$out/release/deps/gpu" "$out/release/kvrun" "$out/release/kvperf" "$out/release/examples/"*
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# On a GPU machine: the GPU tests (tests/gpu.rs, ignored elsewhere) and the tutorial on every GPU.
set -uo pipefail
cd "$(dirname "$0")"
nvidia-smi || true
n=$(nvidia-smi -L 2>/dev/null | wc -l)
release/deps/gpu --include-ignored --test-threads 1
echo "walkthrough on $n GPUs:"
release/examples/walkthrough --gpus "$n"
echo "the sum on a GPU against a device copy (kvperf gpu), 64 MiB, 2 and 4 values:"
release/kvperf gpu --values 2
release/kvperf gpu --values 4
RUN
chmod +x "$out/run.sh"
du -sh "$out"
