"""The Python layer's cost, measured: a push + pull loop on numpy arrays against the same
loop in Rust (`KVStore._rust_push_pull_loop`), and an empty method call (`KVStore._nop`) as
the reference, in one run.

    python3 python/benches/layer_cost.py                          # a local store
    kvrun -n 1 -s 1 python3 python/benches/layer_cost.py dist_sync

Three Rust loops are the reference, each against the Python loop that does the same:
- `own`: push and pull on copies in the store's own arrays (what a Rust program that lets the
  store allocate does);
- `lent`: push and pull on the numpy arrays' memory, lent as a Rust caller lends its own
  (`NDArray::from_raw_parts`): the same path through the store as Python's;
- `read`: `own`, then a read of what each pull brought (one load per cache line, as a training
  step reads its weights). The Python loop reads too, through `KVStore._read`, whose empty
  call is subtracted. In a distributed store a server writes the store's own arrays in place,
  from its core: a loop that never reads them never pays to bring them back, which a numpy
  array's pull (landing in the store's pages, copied in by this process) pays at once.

Prints one JSON line per size and reference: seconds per push + pull in Python and in Rust,
the layer's cost per call (half the difference) as a multiple of the empty call and as a
fraction of the Rust loop's time. Medians of 7 interleaved rounds, each timing the Python loop
before and after the Rust one.
"""

import json
import statistics
import sys
import time

import numpy as np

import kvstore

SIZES = [4 << 10, 64 << 20]
REFERENCES = ["own", "lent", "read"]


def iters_for(nbytes):
    return max(12, min(20000, (256 << 20) // max(nbytes, 1) // 8))


def python_loop(kv, key, v, o, iters, read):
    t = time.perf_counter()
    if read:
        for _ in range(iters):
            kv.push(key, v)
            kv.pull(key, out=o)
            kv._read(o)
    else:
        for _ in range(iters):
            kv.push(key, v)
            kv.pull(key, out=o)
    return (time.perf_counter() - t) / iters


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "local"
    kv = kvstore.create(kind)
    for i, nbytes in enumerate(SIZES):
        n = nbytes // 4
        v = np.ones(n, dtype=np.float32)
        o = np.zeros(n, dtype=np.float32)
        kv.init(i, v)
        iters = iters_for(nbytes)
        times = {(r, side): [] for r in REFERENCES for side in ("py", "rust")}
        nop = []
        for _ in range(8):
            for r in REFERENCES:
                # Python before and after Rust: what one leaves behind (a freed copy, a cold
                # cache) weighs on both sides alike.
                before = python_loop(kv, i, v, o, iters, r == "read")
                rust = kv._rust_push_pull_loop(i, v, o, iters, lent=r == "lent", read=r == "read")
                after = python_loop(kv, i, v, o, iters, r == "read")
                times[r, "py"].append((before + after) / 2)
                times[r, "rust"].append(rust / iters)
            t = time.perf_counter()
            for _ in range(2 * iters):
                kv._nop()
            nop.append((time.perf_counter() - t) / (2 * iters))
        # The first round warms up.
        med = {k: statistics.median(x[1:]) for k, x in times.items()}
        empty = statistics.median(nop[1:])
        for r in REFERENCES:
            py, rust = med[r, "py"], med[r, "rust"]
            # The read loop's `_read` is one more call: its empty call is not the layer's.
            layer = (py - rust - (empty if r == "read" else 0.0)) / 2
            row = {
                "store": kind,
                "bytes": nbytes,
                "reference": r,
                "iters": iters,
                "python_push_pull_s": py,
                "rust_push_pull_s": rust,
                "empty_call_s": empty,
                "layer_per_call_s": layer,
                "layer_over_empty_call": layer / empty,
                "layer_over_rust_loop": 2 * layer / rust,
            }
            if kv.rank == 0:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
