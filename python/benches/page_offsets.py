"""A pull into numpy arrays whose data starts at different offsets into a page, against one
that starts at a page, in one run: 16 bytes in is where numpy puts an array of more than
128 KiB (malloc's header), and where glibc's `rep movsb` copies ran 15-30 times slower on AMD
CPUs before the store's copies avoided it (`kvstore_transport::copy`).

    python3 python/benches/page_offsets.py                          # a local store
    kvrun -n 1 -s 1 python3 python/benches/page_offsets.py dist_sync

Prints one JSON line per size and offset: microseconds per pull (the median of 7 rounds) and
its ratio to the pull into the page-aligned array of the same size.
"""

import json
import statistics
import sys
import time

import numpy as np

import kvstore

SIZES = [4096, 16384, 65536, 262144, 1 << 20]
OFFSETS = [0, 16, 48, 64, 2048]


def at_offset(nbytes, offset):
    """A float32 array of `nbytes` whose data starts `offset` bytes into a page."""
    raw = np.zeros(nbytes + 8192, np.uint8)
    start = (-raw.ctypes.data) % 4096 + offset
    return raw[start:start + nbytes].view(np.float32)


def per_pull(kv, key, out, iters):
    t = time.perf_counter()
    for _ in range(iters):
        kv.pull(key, out=out)
    return (time.perf_counter() - t) / iters


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "local"
    kv = kvstore.create(kind)
    for nbytes in SIZES:
        kv.init(nbytes, np.ones(nbytes // 4, np.float32))
        outs = {off: at_offset(nbytes, off) for off in OFFSETS}
        iters = max(20, min(2000, (64 << 20) // nbytes))
        times = {off: [] for off in OFFSETS}
        for _ in range(7):  # rounds alternate the offsets, so drift weighs on all alike
            for off, out in outs.items():
                per_pull(kv, nbytes, out, 5)
                times[off].append(per_pull(kv, nbytes, out, iters))
        base = statistics.median(times[0])
        for off in OFFSETS:
            t = statistics.median(times[off])
            if kv.rank == 0:
                print(json.dumps({"store": kind, "bytes": nbytes, "offset": off,
                                  "us_per_pull": round(t * 1e6, 3),
                                  "over_page_aligned": round(t / base, 3)}), flush=True)


if __name__ == "__main__":
    main()
