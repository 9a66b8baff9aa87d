#!/usr/bin/env bash
# Builds what the GPU tests need, here (release, feature `cuda`), into one folder to carry to a
# GPU machine that has the NVIDIA driver and CUDA but no Rust, with the layout the tests expect
# (binaries beside `deps/`), stripped to travel light, and a script that runs them there:
#   tests/gpu/bundle.sh            -> target/gpu-bundle/ (run.sh, release/...)
#   (on the GPU machine)  target/gpu-bundle/run.sh
# run.sh prints nvidia-smi, then runs the ignored GPU tests, the other suites, and the
# walkthrough on every GPU, then the GPU benchmarks and the Python layer's cost.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/gpu-bundle
rm -rf "$out"
mkdir -p "$out/release/deps" "$out/release/examples"
cargo build --release --features kvstore/cuda -p kvstore-launcher --bins
cargo build --release --features kvstore-perf/cuda -p kvstore-perf --bins
cargo build --release --features kvstore/cuda -p kvstore --examples
# The test binaries: the GPU tests, the library's unit tests, and the suites of jobs and
# stores that need no files of the repository (the GPU machine runs the same build with a GPU
# present).
cargo test --release --features kvstore/cuda -p kvstore --lib --tests --no-run \
    --message-format=json 2>/dev/null |
    python3 -c 'import json,shutil,sys
want = {"gpu", "kvstore", "local", "dist", "chaos", "wire", "logs"}
for l in sys.stdin:
    m = json.loads(l)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and t.get("name") in want and m.get("executable"):
        name = "kvstore-lib" if t["name"] == "kvstore" else t["name"]
        shutil.copy(m["executable"], sys.argv[1] + "/" + name)' "$out/release/deps"
# The Python package, for the GPU machine's own interpreter (CPython 3.12 with numpy and
# cloudpickle, by the device tool's notes; none here): PyO3 is told the version instead of
# asking an interpreter, and the module is built as `pip install ./python` builds it.
pyver=${GPU_PYTHON:-3.12}
printf '%s\n' implementation=CPython "version=$pyver" shared=true abi3=false \
    "lib_name=python$pyver" pointer_width=64 build_flags= \
    suppress_build_script_link_lines=false > target/pyo3-gpu.cfg
(cd python && PYO3_CONFIG_FILE=$PWD/../target/pyo3-gpu.cfg CARGO_TARGET_DIR=$PWD/target/gpu \
    cargo build --release --lib)
mkdir -p "$out/py/kvstore"
cp python/kvstore/*.py python/kvstore/py.typed "$out/py/kvstore/"
cp python/target/gpu/release/lib_native.so \
    "$out/py/kvstore/_native.cpython-${pyver/./}-x86_64-linux-gnu.so"
cp python/benches/layer_cost.py "$out/py/"
cp target/release/kvrun target/release/kvperf "$out/release/"
cp target/release/examples/dist_check target/release/examples/walkthrough \
    target/release/examples/train "$out/release/examples/"
strip "$out/release/deps/"* "$out/release/kvrun" "$out/release/kvperf" "$out/release/examples/"* \
    "$out/py/kvstore/"*.so
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# On a GPU machine: the GPU tests (tests/gpu.rs, ignored elsewhere), the library's unit tests,
# the tutorial on every GPU, then the benchmarks: the sum on a GPU against a device copy, GPU
# arrays staged through a local store against pinned copies, and a distributed push+pull of
# GPU arrays against the same job on host arrays.
# Every step runs, whatever the ones before did; the script's status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")"
rc=0
failed() { echo "run.sh: FAILED: $*"; rc=1; }
nvidia-smi || true
n=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$n" -gt 0 ] || failed "no GPU seen by nvidia-smi"
release/deps/gpu --include-ignored --test-threads 1 || failed "tests/gpu.rs"
echo "every optimizer's kernel against the host's rule, the sums' kernels, a call refused for a GPU out of memory (the library's GPU tests):"
release/deps/kvstore-lib --include-ignored --test-threads 1 optimizer::gpu_tests gpu::tests \
    worker::calls::tests::a_call_refused_for_a_gpu || failed "the library's GPU tests"
for t in kvstore-lib local dist wire logs chaos; do
    echo "suite $t (a cuda build, with a GPU present):"
    timeout 120 release/deps/$t --test-threads 4 -q > "/tmp/suite-$t.log" 2>&1 || failed "suite $t"
    tail -4 "/tmp/suite-$t.log"
done
echo "walkthrough on $n GPUs:"
release/examples/walkthrough --gpus "$n" || failed "walkthrough"
echo "the sum on a GPU against a device copy (kvperf gpu), 64 MiB, 2, 4, 8 and 16 values:"
for v in 2 4 8 16; do release/kvperf gpu --values $v || failed "kvperf gpu --values $v"; done
for t in shm tcp; do
    echo "push+pull, W=1 S=1 over $t: host arrays, then GPU arrays"
    release/kvperf pushpull -n 1 -s 1 --transport $t --sizes 64K:64M || failed "pushpull $t"
    release/kvperf pushpull -n 1 -s 1 --transport $t --sizes 64K:64M --gpu ||
        failed "pushpull $t --gpu"
done
echo "push+pull, W=1 S=1 over shm, arrays in the pool's pages: host arrays, then GPU arrays"
release/kvperf pushpull -n 1 -s 1 --transport shm --sizes 64K:64M --alloc || failed "--alloc"
release/kvperf pushpull -n 1 -s 1 --transport shm --sizes 64K:64M --alloc --gpu ||
    failed "--alloc --gpu"
echo "the Python layer's cost on this machine's CPU, 4 KiB (python/benches/layer_cost.py), twice:"
export PYTHONPATH=$PWD/py PATH=$PWD/release:$PATH
python3 -c 'import sys, numpy; print("Python", sys.version.split()[0], "numpy", numpy.__version__)'
for r in 1 2; do
    LAYER_COST_SIZES=4096 timeout 60 python3 py/layer_cost.py || failed "layer_cost local"
    LAYER_COST_SIZES=4096 timeout 90 release/kvrun -n 1 -s 1 python3 py/layer_cost.py dist_sync \
        > /tmp/layer.log 2>&1 || failed "layer_cost dist_sync"
    grep '^\[worker' /tmp/layer.log
done
[ $rc = 0 ] && echo "run.sh: every step passed"
exit $rc
RUN
chmod +x "$out/run.sh"
du -sh "$out"
