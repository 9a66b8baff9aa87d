"""Data-parallel training of a linear model with a known answer, in Python on numpy.

Every worker holds its own shard of synthetic data Y = X @ W* (X: n x d, W*: d x k). Each step
it computes the gradient of the mean squared error on its shard, pushes it and pulls the
weights (one pushpull); the servers average the workers' gradients and apply SGD with momentum
in place. At the end every worker checks that its weights are W*.

    kvrun -n 4 -s 2 python3 python/examples/train.py

The same script runs in every process: in the server and scheduler processes
kvstore.create('dist_sync') serves until the job ends and raises SystemExit.
Options (environment): TRAIN_STEPS (default 40), TRAIN_OUTPUTS k (default 1024),
TRAIN_FEATURES d (default 64).
"""

import os
import sys
import time

import numpy as np

import kvstore


def main():
    kv = kvstore.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    d = int(os.environ.get("TRAIN_FEATURES", 64))
    k = int(os.environ.get("TRAIN_OUTPUTS", 1024))
    steps = int(os.environ.get("TRAIN_STEPS", 40))
    n = max(16, -(-4 * d // workers))

    # This worker's shard of the data, and the answer every worker must find.
    rng = np.random.default_rng(1234 + rank)
    x = rng.uniform(-1, 1, size=(n, d)).astype(np.float32)
    j, c = np.meshgrid(np.arange(d), np.arange(k), indexing="ij")
    w_true = (((j * 7 + c * 3) % 11) * 0.1 - 0.5).astype(np.float32)
    y = x @ w_true

    # Heavy-ball parameters from the spread of the data's curvature (see examples/train.rs).
    r = min(0.9, (d / (n * workers)) ** 0.5) * 1.1
    lo, hi = max(0.05, 1 - r) ** 2 / 3, (1 + r) ** 2 / 3
    lr = 4 / (hi ** 0.5 + lo ** 0.5) ** 2
    kappa = (hi / lo) ** 0.5
    momentum = ((kappa - 1) / (kappa + 1)) ** 2

    w = np.zeros((d, k), dtype=np.float32)
    kv.init(0, w)
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=lr, momentum=momentum,
                                           rescale_grad=1.0 / workers))
    kv.pull(0, out=w)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        residual = x @ w - y
        loss = 0.5 * float(np.mean(residual * residual))
        grad = (x.T @ residual / n).astype(np.float32)
        kv.pushpull(0, grad, out=w)
        if rank == 0 and (step % 10 == 0 or step in (1, steps)):
            print(f"step {step:3}/{steps}  loss {loss:.3e}  "
                  f"({step / (time.perf_counter() - start):.1f} steps/s)", flush=True)
    kv.barrier()
    kv.pull(0, out=w)
    rel = float(np.linalg.norm(w - w_true) / np.linalg.norm(w_true))
    if rel < 1e-3:
        print(f"reached the known answer: relative error {rel:.2e} (rank {rank} of {workers})",
              flush=True)
        return 0
    print(f"did not converge: relative error {rel:.2e} (rank {rank} of {workers})", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
