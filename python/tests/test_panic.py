"""A call that panics (a bug) ends its store: every later call is refused, saying why, and
the pull it had in flight never writes into the numpy array it was given, in a job that
goes on without that worker."""

import pytest

from test_dist import run_job

BODY = """
n = 1024
kv.init(0, np.zeros(n, np.float32))
kv.init(1, np.zeros(n, np.float32))
kv._barrier()
if kv.rank == 0:
    # The round of key 0 waits on worker 1, and the pull behind it too.
    kv.push(0, np.ones(n, np.float32))
    out = np.full(n, -1.0, np.float32)
    try:
        kv._panic_in_a_call(0, out)
        print("no panic", flush=True)
    except BaseException as e:
        print(f"raised {type(e).__name__}: {e}", flush=True)
    try:
        kv.pull(1, out=np.zeros(n, np.float32))
        print("a call after the panic went through", flush=True)
    except RuntimeError as e:
        print(f"refused: {e}", flush=True)
    # Worker 1 pushes meanwhile: the round completes (or fails, naming worker 0).
    time.sleep(3)
    print(f"out after: {float(out.min())} {float(out.max())}", flush=True)
else:
    time.sleep(1)
    try:
        kv.push(0, np.full(n, 2.0, np.float32))
        o = np.zeros(n, np.float32)
        kv.pull(0, out=o)
        print(f"worker 1 pulled {float(o[0])}", flush=True)
    except RuntimeError as e:
        print(f"worker 1: {e}", flush=True)
print(f"rank {kv.rank} done", flush=True)
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_call_that_panics_ends_its_store_and_its_pull_never_lands(tmp_path, transport):
    code, out = run_job(tmp_path, BODY, workers=2, servers=1,
                        env={"KVSTORE_TRANSPORT": transport})
    assert "raised PanicException: a call panicked, a bug in kvstore" in out, out
    assert "_panic_in_a_call, as asked (a pull in flight: true)" in out, out
    assert "refused: this KVStore is closed: a call panicked" in out, out
    assert "out after: -1.0 -1.0" in out, out
    assert "[worker 0] rank 0 done" in out and "[worker 1] rank 1 done" in out, out
    assert code == 0, out
