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

In a distributed store, Python's push of a 4 KiB array returns before the servers answer (a
copy is pushed, and the next call takes its result): the Rust loops push the same way
(`push_async` of the store's own array, or of a copy of the lent memory, then the pull, then
the push's wait), so the loops stay the same loop.

A fourth reference, `binding`, is the Python loop's own calls made from Rust
(`KVStore._binding_push_pull_loop`: the class's `push` and `pull` methods called directly):
Python's cost over it is the interpreter's share of the layer (its bytecode, the call, the
arguments' parsing), and the rest of the layer's cost over `lent` is the binding's.

Prints one JSON line per size and reference: seconds per push + pull in Python and in Rust,
the layer's cost per call (half the difference) as a multiple of the empty call and as a
fraction of the Rust loop's time. The layer's cost is the median over many short rounds of the
difference between the Python loop (timed before and after the Rust one) and the Rust loop.
`LAYER_COST_SIZES=4096` picks the sizes (bytes, comma-separated).
"""

import json
import os
import statistics
import sys
import time

import numpy as np

import kvstore

SIZES = [int(s) for s in os.environ.get("LAYER_COST_SIZES", "4096,67108864").split(",")]
REFERENCES = ["own", "lent", "read", "binding"]


def block_for(nbytes):
    """Iterations in one timed block: a few milliseconds of a small call's loop, a few of a
    large one's."""
    return max(4, min(1024, (32 << 20) // max(nbytes, 1)))


def rounds_for(nbytes):
    return 64 if nbytes <= (1 << 20) else 12


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


def empty_calls(kv, iters):
    t = time.perf_counter()
    for _ in range(iters):
        kv._nop()
    return (time.perf_counter() - t) / iters


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "local"
    kv = kvstore.create(kind)
    for i, nbytes in enumerate(SIZES):
        n = nbytes // 4
        v = np.ones(n, dtype=np.float32)
        o = np.zeros(n, dtype=np.float32)
        kv.init(i, v)
        iters = block_for(nbytes)
        rounds = rounds_for(nbytes)
        py = {r: [] for r in REFERENCES}
        rust = {r: [] for r in REFERENCES}
        nop = []
        # Many short rounds, each timing the Python loop just before and just after the Rust
        # one (what one leaves behind, a freed copy or a cold cache, weighs on both alike, and
        # a machine's drift in speed, on both alike); the layer's cost is the median of the
        # rounds' differences. The first rounds warm up.
        for k in range(rounds + 2):
            for r in REFERENCES:
                before = python_loop(kv, i, v, o, iters, r == "read")
                if r == "binding":
                    ru = kv._binding_push_pull_loop(i, v, o, iters)
                else:
                    ru = kv._rust_push_pull_loop(i, v, o, iters, lent=r == "lent", read=r == "read")
                after = python_loop(kv, i, v, o, iters, r == "read")
                if k >= 2:
                    py[r].append((before + after) / 2)
                    rust[r].append(ru / iters)
            if k >= 2:
                nop.append(empty_calls(kv, 2 * iters))
        empty = statistics.median(nop)
        for r in REFERENCES:
            # The read loop's `_read` is one more call: its empty call is not the layer's.
            diffs = [p - q - (empty if r == "read" else 0.0) for p, q in zip(py[r], rust[r])]
            layer = statistics.median(diffs) / 2
            p_med, r_med = statistics.median(py[r]), statistics.median(rust[r])
            row = {
                "store": kind,
                "bytes": nbytes,
                "reference": r,
                "iters": iters * rounds,
                "python_push_pull_s": p_med,
                "rust_push_pull_s": r_med,
                "empty_call_s": empty,
                "layer_per_call_s": layer,
                "layer_over_empty_call": layer / empty,
                "layer_over_rust_loop": 2 * layer / r_med,
            }
            if kv.rank == 0:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
