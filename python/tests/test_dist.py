"""Distributed jobs of Python workers and servers under kvrun: the same script in every
process, as MXNet's server role runs inside the user's script."""

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kvrun():
    env = os.environ.get("KVRUN")
    if env:
        return env
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "kvrun"
        if p.exists():
            return str(p)
    pytest.skip("kvrun is not built (cargo build --release -p kvstore-launcher)")


def free_port():
    """A free TCP port on loopback (nothing listens there once this returns)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp_path, body, workers=2, servers=2, env=None, timeout=120, wait=True,
            name="dist_sync"):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""\
        import os, sys, time
        import numpy as np
        import kvstore
        ROLE = os.environ.get("DMLC_ROLE", "worker")
        DIR = sys.argv[1]
        open(os.path.join(DIR, f"{ROLE}.{os.getpid()}"), "w").close()
        try:
            kv = kvstore.create(NAME)
        except SystemExit as e:
            print(f"{ROLE} ends with SystemExit({e.code})", flush=True)
            raise
        """).replace("NAME", repr(name)) + textwrap.dedent(body))
    cmd = [kvrun(), "-n", str(workers), "-s", str(servers), sys.executable, str(script),
           str(tmp_path)]
    e = {**os.environ, "KVSTORE_TIMEOUT": "30", **(env or {})}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e)
    if not wait:
        return p
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def wait_for(p, path, secs=60):
    """Waits until the job `p` makes `path` (failing if it ends first, or takes too long)."""
    deadline = time.time() + secs
    while not path.exists():
        assert time.time() < deadline and p.poll() is None, p.communicate()[0]
        time.sleep(0.05)


def test_python_updater_and_optimizer_run_on_the_servers(tmp_path):
    # Made by the name the tutorial gives ('dist'), which MXNet reads as dist_sync.
    code, out = run_job(tmp_path, """
        assert kv.type == "dist", kv.type
        shape = (2, 3)
        big = (600, 1000)      # sliced over both servers (bound 100000)
        kv.init(3, np.ones(shape) * 2)
        kv.init(4, np.zeros(big, dtype=np.float32))

        def update(key, input, stored):
            print("update on key: %d" % key, flush=True)
            stored += input * 2

        kv._set_updater(update)
        if kv.rank == 0:
            # A child made by fork is refused, and its exit does not end its parent's part.
            pid = os.fork()
            if pid == 0:
                try:
                    kv.push(3, np.ones(shape))
                except RuntimeError as e:
                    print(f"child refused: {'fork' in str(e)}", flush=True)
                sys.exit(0)
            os.waitpid(pid, 0)
        kv.push(3, np.ones(shape))
        a = np.zeros(shape)
        kv.pull(3, out=a)
        assert (a == 6).all(), a          # 2 + (1 + 1) * 2
        kv.push(3, np.ones(shape))        # returns before the servers answer
        b = np.ones(shape)
        kv.pushpull(3, b)                 # in place, after that push's round
        assert (b == 14).all(), b         # 6 + (1 + 1) * 2 + (1 + 1) * 2
        g = np.full(big, kv.rank + 1, dtype=np.float32)
        out = np.zeros(big, dtype=np.float32)
        kv.pushpull(4, g, out=out)
        assert (out == 6).all(), out       # 0 + (1 + 2) * 2
        sgd = kvstore.optimizer.SGD(learning_rate=0.1)
        sgd.set_lr_mult({4: 2.0})             # on both servers' slices
        kv.set_optimizer(sgd)
        kv.push(4, g)
        kv.pull(4, out=out)
        assert np.allclose(out, 6 - 0.2 * 3), out
        m = kv.metrics()
        assert m["calls"] > 0 and len(m["servers"]) == 2, m
        # Pushes of slices: key 3 three times; key 4 (two slices) in a pushpull and a push.
        assert sum(s["pushes"] for s in m["servers"]) == 7, m
        assert "key 4: server 0 [0, 300000), server 1 [300000, 600000)" in kv.placement_map()
        if kv.rank == 0:
            states = os.path.join(DIR, "states")
            kv.save_optimizer_states(states)
            kv.load_optimizer_states(states)
            print(f"saved and loaded {os.path.getsize(states)} bytes of state", flush=True)
        print(f"worker {kv.rank} of {kv.num_workers} done", flush=True)
        """, env={"KVSTORE_BIGARRAY_BOUND": "100000"}, name="dist")
    assert code == 0, out
    for w in range(2):
        assert f"worker {w} of 2 done" in out, out
    assert out.count("update on key: 3") == 3, out
    # Key 4 is sliced: each server ran the updater on its slice.
    assert out.count("update on key: 4") == 2, out
    assert out.count("server ends with SystemExit(0)") == 2, out
    assert "saved and loaded" in out, out
    assert "child refused: True" in out, out


def test_a_small_call_that_waits_long_lets_other_threads_run(tmp_path):
    # A small pull keeps the GIL while it waits a few microseconds, and lets go of it once it
    # waits longer: here, behind rank 0's own push, for rank 1's push, a second.
    code, out = run_job(tmp_path, """
        import threading
        kv.init(1, np.zeros(4))
        pushed_file = os.path.join(DIR, "pushed")
        if kv.rank == 1:
            # Rank 0's push returns before this push (MXNet's push is asynchronous): were it
            # to wait for the round, this would wait for it, and the job end in its timeout.
            while not os.path.exists(pushed_file):
                time.sleep(0.01)
            time.sleep(1.0)
            kv.push(1, np.ones(4))
        else:
            ticks, done = [0], threading.Event()
            def tick():
                while not done.is_set():
                    ticks[0] += 1
                    time.sleep(0.001)
            t = threading.Thread(target=tick)
            t.start()
            time.sleep(0.2)
            before = ticks[0]
            start = time.time()
            kv.push(1, np.ones(4))
            open(pushed_file, "w").close()
            kv.pull(1, out=np.zeros(4))
            waited = time.time() - start
            during = ticks[0] - before
            done.set()
            t.join()
            print(f"waited {waited:.2f} s, ticks {during}", flush=True)
            # The pull waited a second for rank 1's push, and the other thread ran meanwhile.
            assert during > 100, (waited, during)
        o = np.zeros(4)
        kv.pull(1, out=o)
        assert (o == 2).all(), o
        print("pulled", flush=True)
        """)
    assert code == 0, out
    assert out.count("pulled") == 2, out
    assert "ticks" in out, out


def test_the_python_training_example_reaches_its_known_answer():
    example = ROOT / "python" / "examples" / "train.py"
    cmd = [kvrun(), "-n", "2", "-s", "2", sys.executable, str(example)]
    env = dict(os.environ, TRAIN_OUTPUTS="256", KVSTORE_TIMEOUT="60")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=180)
    assert p.returncode == 0, p.stdout
    for rank in range(2):
        assert "reached the known answer: relative error" in p.stdout, p.stdout
        assert f"(rank {rank} of 2)" in p.stdout, p.stdout


def test_a_push_returns_before_the_servers_answer_and_a_pull_sees_it(tmp_path):
    code, out = run_job(tmp_path, """
        kv.init(1, np.zeros(4))
        kv.init(2, np.zeros(300000, dtype=np.float32))
        pushed_file = os.path.join(DIR, "pushed")
        if kv.rank == 1:
            # Rank 1 pushes once rank 0's push returned: a push that waited for the round
            # (for this push) would never return, and the job would end in its timeout.
            while not os.path.exists(pushed_file):
                time.sleep(0.01)
        a = np.full(4, kv.rank + 1.0)
        kv.push(1, a)
        if kv.rank == 0:
            open(pushed_file, "w").close()
            print("rank 0's push returned before rank 1 pushed", flush=True)
        a[:] = -1000                  # the push sent what it was given
        o = np.zeros(4)
        kv.pull(1, out=o)             # after this worker's push: the round's result
        assert (o == 3).all(), o

        def update(key, input, stored):
            stored += input

        kv._set_updater(update)
        # Two pushes of a key in a row: the second goes after the first's round.
        kv.push(1, np.ones(4))
        kv.push(1, np.ones(4))
        kv.pull(1, out=o)
        assert (o == 3 + 2 + 2).all(), o
        # A push of more than 1 MiB waits for the servers, with the same result.
        big = np.ones(300000, dtype=np.float32)
        kv.push(2, big)
        kv.pull(2, out=big)
        assert (big == 2).all(), big[:4]
        print(f"worker {kv.rank} done", flush=True)
        """)
    assert code == 0, out
    assert "rank 0's push returned before rank 1 pushed" in out, out
    assert "worker 0 done" in out and "worker 1 done" in out, out


def test_row_sparse_pull_moves_the_rows_of_a_value_cut_over_the_servers(tmp_path):
    code, out = run_job(tmp_path, """
        w = np.arange(50 * 8, dtype=np.float64).reshape(50, 8)
        kv.init("emb", w)
        kv.push("emb", w * (kv.rank + 1))
        o = np.full((50, 8), -1.0)
        rows = [49, 0, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 0]
        kv.row_sparse_pull("emb", out=o, row_ids=np.array(rows))
        want = np.zeros((50, 8))
        want[rows] = w[rows] * 3      # the round's sum of both workers' pushes
        assert (o == want).all(), o
        print(f"worker {kv.rank} rows ok", flush=True)
        """, env={"KVSTORE_BIGARRAY_BOUND": "100"})
    assert code == 0, out
    assert "worker 0 rows ok" in out and "worker 1 rows ok" in out, out


# An updater that refuses every update.
REFUSE = """
def refuse(key, input, stored):
    raise ValueError(f"no updates for key {key}")
"""


def test_a_failed_push_is_raised_by_the_next_call(tmp_path):
    code, out = run_job(tmp_path, REFUSE + textwrap.dedent("""
        kv.init(5, np.zeros(4))
        kv._set_updater(refuse)
        kv.push(5, np.ones(4))        # returns before the server's updater runs
        print("push returned", flush=True)
        o = np.zeros(4)
        try:
            kv.pull(5, out=o)
            print("no error", flush=True)
        except kvstore.KVStoreError as e:
            print(f"pull raised: {e}", flush=True)
        kv.push(5, np.ones(4))        # not waited for by any call: said when the store goes
        """), workers=1, servers=1)
    assert "push returned" in out, out
    raised = out.split("pull raised: ")[1] if "pull raised: " in out else ""
    assert "no updates for key 5" in raised, out
    # The server's traceback comes with it, as the README says: the updater's frame.
    assert "Traceback (most recent call last)" in raised and "in refuse" in raised, out
    assert "no error" not in out, out
    assert "a push that no later call waited for failed" in out, out


def test_an_updater_error_on_a_sliced_key_leaves_the_store_usable(tmp_path):
    # Each server's slice fails alike, after its round: the rounds stay in step, and the store
    # goes on (a push that one server refused before its round while another may have taken
    # its slice makes the store unusable; this is not one).
    code, out = run_job(tmp_path, REFUSE + textwrap.dedent("""
        kv.init(5, np.zeros(300))
        kv._set_updater(refuse)
        try:
            kv.push([5], [np.ones(300)])   # a list waits for the servers
            print("no error", flush=True)
        except kvstore.KVStoreError as e:
            print(f"push raised {type(e).__name__}", flush=True)
        o = np.full(300, -1.0)
        kv.pull(5, out=o)
        print(f"pulled {o[0]} {o[-1]}", flush=True)
        """), workers=1, servers=2, env={"KVSTORE_BIGARRAY_BOUND": "100"})
    assert code == 0, out
    assert "push raised KVStoreError" in out and "pulled 0.0 0.0" in out, out


def test_multipliers_reach_the_servers_by_str_key(tmp_path):
    code, out = run_job(tmp_path, """
        o = kvstore.optimizer.SGD(learning_rate=0.1, wd=0.5,
                                  param_idx2name={0: "fc1_weight", 1: "fc1_bias"})
        # Before the keys are initialised, as MXNet's Trainer does: their multipliers reach
        # the servers at their init. The store's keys are the names: the bias gets no weight
        # decay, and the int indexes of param_idx2name name no key of it.
        kv.set_optimizer(o)
        kv.init(["fc1_bias", "fc1_weight"], [np.ones(3), np.ones(300)])
        kv.push(["fc1_bias", "fc1_weight"], [np.ones(3), np.ones(300)])
        b, w = np.zeros(3), np.zeros(300)
        kv.pull(["fc1_bias", "fc1_weight"], out=[b, w])
        n = kv.num_workers
        np.testing.assert_allclose(b, 1 - 0.1 * n)
        np.testing.assert_allclose(w, 1 - 0.1 * (n + 0.5))
        print(f"worker {kv.rank} done", flush=True)
        """, env={"KVSTORE_BIGARRAY_BOUND": "100"})
    assert code == 0, out
    for w in range(2):
        assert f"worker {w} done" in out, out


def test_the_servers_run_the_learning_rate_scheduler(tmp_path):
    code, out = run_job(tmp_path, """
        from kvstore.lr_scheduler import FactorScheduler, CosineScheduler
        # Every server runs the scheduler on the updates it makes: a key on one server, and
        # one cut over both (bound 100). A gradient of -1 from each worker adds the rate
        # times the number of workers at each round.
        kv.init(["small", "big"], [np.zeros(3), np.zeros(300)])
        kv.set_optimizer(kvstore.optimizer.SGD(
            learning_rate=1.0, lr_scheduler=FactorScheduler(step=2, factor=0.5),
            rescale_grad=1.0 / kv.num_workers))
        small, big = np.zeros(3), np.zeros(300)
        for _ in range(5):
            kv.push(["small", "big"], [-np.ones(3), -np.ones(300)])
        kv.pull(["small", "big"], out=[small, big])
        # Rates 1, 1, 0.5, 0.5, 0.25 (MXNet's FactorScheduler(2, 0.5) from 1).
        np.testing.assert_array_equal(small, 3.25)
        np.testing.assert_array_equal(big, 3.25)
        # A new optimizer counts afresh, from begin_num_update (10: the cosine's warm-up is
        # over), on the server of a key initialised after it.
        kv.set_optimizer(kvstore.optimizer.SGD(
            learning_rate=0.4, begin_num_update=10, rescale_grad=1.0 / kv.num_workers,
            lr_scheduler=CosineScheduler(max_update=12, base_lr=0.4, final_lr=0.2,
                                         warmup_steps=10, warmup_begin_lr=0.0)))
        kv.init("late", np.zeros(3))
        late = np.zeros(3)
        for _ in range(3):
            kv.push("late", -np.ones(3))
        kv.pull("late", out=late)
        # num_update 11, 12, 13: 0.2 + 0.2 * (1 + cos(pi / 2)) / 2, then 0.2, then 0.2.
        np.testing.assert_allclose(late, 0.3 + 0.2 + 0.2, rtol=0, atol=1e-12)
        print(f"worker {kv.rank} done", flush=True)
        """, env={"KVSTORE_BIGARRAY_BOUND": "100"})
    assert code == 0, out
    for w in range(2):
        assert f"worker {w} done" in out, out


def test_get_updater_set_on_a_worker_runs_on_the_servers(tmp_path):
    # MXNet's kv._set_updater(get_updater(opt)): the Updater travels to the servers by value
    # and runs there on each server's slices, its state kept per key; the weights are those of
    # a local store running the same optimizer on the same summed gradients.
    code, out = run_job(tmp_path, """
        from kvstore import optimizer as opt
        make = lambda: opt.Adam(learning_rate=0.01, wd=0.001)
        big = (300, 1000)      # sliced over both servers (bound 100000)
        w0 = np.linspace(-1, 1, 300000, dtype=np.float32).reshape(big)
        kv.init([0, 1], [np.ones(5, dtype=np.float32), w0])
        kv._set_updater(opt.get_updater(make()))
        ref = kvstore.create()
        ref.init([0, 1], [np.ones(5, dtype=np.float32), w0])
        ref.set_optimizer(make())
        outs = [np.zeros(5, dtype=np.float32), np.zeros(big, dtype=np.float32)]
        want = [np.zeros(5, dtype=np.float32), np.zeros(big, dtype=np.float32)]
        for step in range(3):
            g = lambda r, shape: np.full(shape, r + step - 0.75, dtype=np.float32)
            kv.push([0, 1], [g(kv.rank, 5), g(kv.rank, big)])
            ref.push([0, 1], [[g(r, 5) for r in range(2)], [g(r, big) for r in range(2)]])
        kv.pull([0, 1], out=outs)
        ref.pull([0, 1], out=want)
        for o, w in zip(outs, want):
            assert np.array_equal(o, w), (o, w)
        assert not np.array_equal(outs[1], w0)
        print(f"worker {kv.rank} matches", flush=True)
        """, env={"KVSTORE_BIGARRAY_BOUND": "100000"})
    assert code == 0, out
    assert out.count("matches") == 2, out


def test_an_optimizer_of_ones_own_runs_on_the_servers(tmp_path):
    code, out = run_job(tmp_path, """
        from kvstore import optimizer as O

        class Halving(O.Optimizer):
            def update(self, index, weight, grad, state):
                weight -= 0.5 * grad

        kv.init(3, np.zeros(4))
        kv.set_optimizer(Halving())
        kv.push(3, np.ones(4))
        o = np.zeros(4)
        kv.pull(3, out=o)
        # The round's sum (one per worker), halved, once.
        assert (o == -0.5 * kv.num_workers).all(), o
        print(f"worker {kv.rank} done", flush=True)
        """)
    assert code == 0, out
    assert "worker 0 done" in out and "worker 1 done" in out, out


def test_a_job_started_by_mpirun_takes_its_roles_from_the_ranks(tmp_path):
    # As mpirun starts a program: three copies, told only their rank (Open MPI's variables),
    # no DMLC_ROLE. Rank 0 runs the scheduler and rank 1 a server inside create, each ending
    # with SystemExit(0) as under kvrun; rank 2 is the worker.
    port = free_port()
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""\
        import os
        import numpy as np
        import kvstore
        rank = os.environ["OMPI_COMM_WORLD_RANK"]
        try:
            kv = kvstore.create("dist_sync")
        except SystemExit as e:
            print(f"rank {rank} ends with SystemExit({e.code})", flush=True)
            raise
        kv.init(3, np.ones((2, 3)))
        kv.push(3, np.ones((2, 3)) * 4)
        out = np.zeros((2, 3))
        kv.pull(3, out=out)
        print(f"rank {rank} is worker {kv.rank} of {kv.num_workers}: {out.sum()}", flush=True)
        """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "OMPI_", "PMI_",
                                                                       "SLURM_"))}
    env.update({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
                "KVSTORE_ROOT_PORT": str(port), "KVSTORE_SECRET": "a-secret-of-the-mpirun-test",
                "KVSTORE_TIMEOUT": "30"})
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**env, "OMPI_COMM_WORLD_RANK": str(r)})
             for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert "rank 0 ends with SystemExit(0)" in outs[0], outs
    assert "rank 1 ends with SystemExit(0)" in outs[1], outs
    assert "rank 2 is worker 0 of 1: 24.0" in outs[2], outs
