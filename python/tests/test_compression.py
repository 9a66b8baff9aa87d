"""MXNet's set_gradient_compression (2bit): values checked against the rule written here in
numpy, in one process and in a distributed job."""

import numpy as np
import pytest

import kvstore
from test_dist import run_job


def sent(grads, t):
    """What pushing `grads` in turn sends under 2-bit compression with threshold `t`, and the
    residual left: MXNet's rule, element by element (float32 throughout)."""
    r = np.zeros_like(grads[0], dtype=np.float32)
    t = np.float32(t)
    out = []
    for g in grads:
        r = r + g.astype(np.float32)
        s = np.where(r >= t, t, np.where(r <= -t, -t, np.float32(0)))
        r = r - s
        out.append(s.astype(np.float32))
    return out, r


def test_the_tutorial_sequence_on_a_device_store():
    # MXNet's nightly test: t = 0.5, an updater adding twice the push (rescale_grad 2).
    kv = kvstore.create("local_allreduce_device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("w", np.zeros((2, 3), dtype=np.float32))
    kv._set_updater(lambda key, g, w: w.__iadd__(2 * g))
    out = np.zeros((2, 3), dtype=np.float32)
    seen = []
    for g in (0.4, 0.2, 0.2, 0.2, -0.5):
        kv.push("w", np.full((2, 3), g, dtype=np.float32))
        kv.pull("w", out=out)
        seen.append(float(out[0, 0]))
    # 0.4 sends 0; 0.6 sends 0.5 (0.1 kept); 0.3 sends 0; 0.5 sends 0.5; -0.5 sends -0.5.
    assert seen == [0.0, 1.0, 1.0, 2.0, 1.0]


def test_each_device_value_has_its_own_residual():
    rng = np.random.default_rng(7)
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": "2bit"})          # MXNet's default threshold, 0.5
    shape = (37,)
    kv.init(0, np.zeros(shape, dtype=np.float32))
    grads = [[rng.uniform(-0.6, 0.6, shape).astype(np.float32) for _ in range(5)]
             for _ in range(3)]
    want = [sent(gs, 0.5)[0] for gs in grads]
    out = np.zeros(shape, dtype=np.float32)
    for step in range(5):
        kv.pushpull(0, [grads[d][step] for d in range(3)], out=out)
        # ASSIGN: the stored value is the step's sum of what each device sent.
        expect = want[0][step] + want[1][step] + want[2][step]
        np.testing.assert_array_equal(out, expect)


def test_bad_parameters_and_stores_are_refused():
    kv = kvstore.create("device")
    with pytest.raises(TypeError):
        kv.set_gradient_compression([("type", "2bit")])
    for bad in ({}, {"type": "1bit"}, {"type": "2bit", "threshold": 0},
                {"type": "2bit", "threshold": -0.5}, {"type": "2bit", "threshold": "x"},
                {"type": "2bit", "threshhold": 0.5}):
        with pytest.raises(ValueError):
            kv.set_gradient_compression(bad)
    for name in ("local", "nccl"):           # MXNet's: 'device' or 'dist' in the name
        with pytest.raises(kvstore.KVStoreError, match=f"{name} store"):
            kvstore.create(name).set_gradient_compression({"type": "2bit"})
    # Only float32 values are compressed; a refused push changes nothing.
    kv.set_gradient_compression({"type": "2bit", "threshold": 1})
    kv.init(1, np.ones(4))
    with pytest.raises(kvstore.KVStoreError, match="float32"):
        kv.push(1, np.ones(4))
    out = np.zeros(4)
    kv.pull(1, out=out)
    assert (out == 1).all()


def test_a_distributed_job_sums_what_each_worker_sent(tmp_path):
    code, out = run_job(tmp_path, """
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.25})
        shape = (3, 111)                 # sliced over both servers (bound 100)
        kv.init(0, np.zeros(shape, dtype=np.float32))
        try:
            kv.set_gradient_compression({"type": "2bit"})
        except kvstore.KVStoreError as e:
            print(f"late: {'before' in str(e)}", flush=True)

        def grads(rank):
            rng = np.random.default_rng(rank)
            return [rng.uniform(-0.4, 0.4, shape).astype(np.float32) for _ in range(4)]

        def sent(gs, t=np.float32(0.25)):
            r, out = np.zeros(shape, dtype=np.float32), []
            for g in gs:
                r = r + g
                s = np.where(r >= t, t, np.where(r <= -t, -t, np.float32(0))).astype(np.float32)
                r = r - s
                out.append(s)
            return out

        mine = grads(kv.rank)
        every = [sent(grads(w)) for w in range(kv.num_workers)]
        out = np.zeros(shape, dtype=np.float32)
        for step in range(4):
            kv.push(0, mine[step])
            kv.pull(0, out=out)
            want = sum(every[w][step] for w in range(kv.num_workers))
            np.testing.assert_array_equal(out, want)
            kv._barrier()
        pushed = sum(s["bytes_pushed"] for s in kv.metrics()["servers"])
        print(f"worker {kv.rank} done, pushed {pushed} bytes", flush=True)
        """, env={"KVSTORE_BIGARRAY_BOUND": "100"})
    assert code == 0, out
    assert out.count("late: True") == 2, out
    # 333 elements in slices of 166 and 167: 44 + 44 bytes a push, against 1332 whole.
    for w in range(2):
        assert f"worker {w} done, pushed {4 * 88} bytes" in out, out
