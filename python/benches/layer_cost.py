"""The Python layer's cost, measured: a push + pull loop on numpy arrays against the same
loop in Rust (`KVStore._rust_push_pull_loop`, the store's own arrays), and an empty method
call (`KVStore._nop`) as the reference, in one run.

    python3 python/benches/layer_cost.py                          # a local store
    kvrun -n 1 -s 1 python3 python/benches/layer_cost.py dist_sync

Prints one JSON line per size: seconds per push+pull in Python and in Rust, the Python
layer's cost per call (half the difference) as a multiple of the empty call, and as a
fraction of the Rust loop's time. Medians of 7 interleaved rounds.
"""

import json
import statistics
import sys
import time

import numpy as np

import kvstore

SIZES = [4 << 10, 64 << 20]


def iters_for(nbytes):
    return max(4, min(20000, (256 << 20) // max(nbytes, 1) // 8))


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "local"
    kv = kvstore.create(kind)
    for i, nbytes in enumerate(SIZES):
        n = nbytes // 4
        v = np.ones(n, dtype=np.float32)
        o = np.zeros(n, dtype=np.float32)
        kv.init(i, v)
        iters = iters_for(nbytes)
        py, rust, nop = [], [], []
        for _ in range(8):
            t = time.perf_counter()
            for _ in range(iters):
                kv.push(i, v)
                kv.pull(i, out=o)
            py.append((time.perf_counter() - t) / iters)
            rust.append(kv._rust_push_pull_loop(i, v, o, iters) / iters)
            t = time.perf_counter()
            for _ in range(2 * iters):
                kv._nop()
            nop.append((time.perf_counter() - t) / (2 * iters))
        # The first round warms up.
        py, rust, nop = (statistics.median(x[1:]) for x in (py, rust, nop))
        layer = (py - rust) / 2
        row = {
            "store": kind,
            "bytes": nbytes,
            "iters": iters,
            "python_push_pull_s": py,
            "rust_push_pull_s": rust,
            "empty_call_s": nop,
            "layer_per_call_s": layer,
            "layer_over_empty_call": layer / nop,
            "layer_over_rust_loop": (py - rust) / rust,
        }
        if kv.rank == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
