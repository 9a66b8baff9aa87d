"""How much a store's 4 KiB push + pull slows down when other memory is touched between its
calls, as an interpreter running between them touches its own: the Rust loop of
`benches/layer_cost.py` (`lent`), with a write to each cache line of TOUCH bytes of other
memory after each push and each pull (`KVStore._rust_push_pull_loop(touch=...)`).

    python3 python/benches/cache_sensitivity.py                          # a local store
    kvrun -n 1 -s 1 python3 python/benches/cache_sensitivity.py dist_sync

Prints one JSON line per amount touched: the loop's seconds per push + pull without touching,
and the median over short interleaved rounds of what touching adds. The writes cost the same in
either store; what a distributed store's loop loses beyond a local store's, for the same
amount, is what its own path loses to caches it no longer finds warm.
"""

import json
import statistics
import sys

import numpy as np

import kvstore

TOUCH = [0, 4096, 8192, 16384, 32768]
ITERS = 512


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "local"
    kv = kvstore.create(kind)
    v = np.ones(1024, dtype=np.float32)
    o = np.zeros(1024, dtype=np.float32)
    kv.init(0, v)
    times = {t: [] for t in TOUCH}
    for r in range(42):
        for t in TOUCH:
            s = kv._rust_push_pull_loop(0, v, o, ITERS, lent=True, touch=t) / ITERS
            if r >= 2:
                times[t].append(s)
    base = statistics.median(times[0])
    for t in TOUCH:
        extra = statistics.median(a - b for a, b in zip(times[t], times[0]))
        row = {"store": kind, "bytes": 4096, "touch": t, "push_pull_s": base, "extra_s": extra}
        if kv.rank == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
