"""A training step's communication in Python, timed: each worker pushes a gradient for each
of KEYS keys, one call a key (as Gluon's Trainer does), then pulls each key's weights.

    kvrun -n 2 -s 2 python3 python/benches/step.py             # KEYS=32, BYTES=4096
    STEP_KEYS=64 STEP_BYTES=65536 kvrun -n 2 -s 2 python3 python/benches/step.py

Prints one JSON line: the median step time over STEPS steps, and the median time of one
push + pull round of a single key, measured in the same run (a step that waited for each
push would take about KEYS of those).
"""

import json
import os
import statistics
import time

import numpy as np

import kvstore

KEYS = int(os.environ.get("STEP_KEYS", "32"))
NBYTES = int(os.environ.get("STEP_BYTES", "4096"))
STEPS = int(os.environ.get("STEP_STEPS", "300"))


def main():
    kv = kvstore.create("dist_sync")
    n = NBYTES // 4
    grads = [np.full(n, kv.rank + 1.0, dtype=np.float32) for _ in range(KEYS)]
    weights = [np.zeros(n, dtype=np.float32) for _ in range(KEYS)]
    for k in range(KEYS):
        kv.init(k, weights[k])
    want = kv.num_workers * (kv.num_workers + 1) / 2
    steps, rounds = [], []
    for s in range(STEPS + 10):
        t = time.perf_counter()
        for k in range(KEYS):
            kv.push(k, grads[k], priority=-k)
        for k in range(KEYS):
            kv.pull(k, out=weights[k], priority=-k)
        step = time.perf_counter() - t
        t = time.perf_counter()
        kv.push(0, grads[0])
        kv.pull(0, out=weights[0])
        one = time.perf_counter() - t
        if s >= 10:
            steps.append(step)
            rounds.append(one)
    assert all((w == want).all() for w in weights), "wrong weights"
    if kv.rank == 0:
        print(json.dumps({
            "workers": kv.num_workers, "keys": KEYS, "bytes": NBYTES,
            "step_s": statistics.median(steps), "one_key_round_s": statistics.median(rounds),
        }), flush=True)


if __name__ == "__main__":
    main()
