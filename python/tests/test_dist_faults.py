"""Faults in distributed jobs of Python workers and servers under kvrun: Ctrl-C, a dead or
silent server, a signal handler that calls the store, and a call that panics (a bug), which
ends its store: every later call is refused, saying why, in a job that goes on without that
worker (and the numpy array its pull had in flight keeps what it held)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from test_dist import free_port, run_job, wait_for


@pytest.mark.parametrize("call", [
    # A push of one array returns at once; the pull after it waits for the round.
    "kv.push(1, np.ones(4)); kv.pull(1, out=np.zeros(4))",
    # A push of a list waits for the servers.
    "kv.push([1], [np.ones(4)])",
    "kv.barrier()",
    # Pushes of several keys return at once and wait in flight for their rounds; the call
    # that waits for them hears the interruption, whichever of them was interrupted first
    # (before, all but the oldest were PeerLost).
    "[kv.push(k, np.ones(4)) for k in (1, 2, 3, 4)]; kv.pull(4, out=np.zeros(4))",
    "[kv.push(k, np.ones(4)) for k in (1, 2, 3, 4)]; kv.pull([3, 4], out=[np.zeros(4), np.zeros(4)])",
    "[kv.push(k, np.ones(4)) for k in (1, 2, 3, 4)]; kv.barrier()",
])
def test_ctrl_c_interrupts_a_blocking_call_and_fences_the_store(tmp_path, call):
    p = run_job(tmp_path, """
        kv.init([1, 2, 3, 4], [np.zeros(4)] * 4)
        if kv.rank == 1:
            time.sleep(8)            # never pushes: rank 0's round waits
            sys.exit(0)
        with open(os.path.join(DIR, "waiting.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(DIR, "waiting.tmp"), os.path.join(DIR, "waiting"))
        try:
            CALL
            print("call returned", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        try:
            kv.push(1, np.ones(4))
        except kvstore.KVStoreError as e:
            print(f"refused after: {e}", flush=True)
        """.replace("CALL", call), wait=False)
    wait_for(p, tmp_path / "waiting")
    time.sleep(0.5)
    pid = int((tmp_path / "waiting").read_text())
    os.kill(pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert "interrupted" in out, out
    # The later push refuses: the job was aborted, or (where key 1's push was in flight) that
    # push's own interruption is its error.
    after = out.split("refused after: ")[1]
    assert after.startswith(("job aborted", "interrupted")) and "interrupted" in after, out
    assert "call returned" not in out, out


def test_ctrl_c_interrupts_a_store_that_waits_for_its_pushes_as_it_is_destroyed(tmp_path):
    # `del kv` waits for the push no call waited for (its round waits on rank 1). Ctrl-C
    # then raises KeyboardInterrupt once the destructor is over (before, the destructor
    # printed the push's failure and the script went on as if no signal had come).
    p = run_job(tmp_path, """
        kv.init(1, np.zeros(4))
        if kv.rank == 1:
            time.sleep(8)            # never pushes: rank 0's round waits
            sys.exit(0)
        with open(os.path.join(DIR, "waiting.tmp"), "w") as f:
            f.write(str(os.getpid()))
        try:
            kv.push(1, np.ones(4))
            os.rename(os.path.join(DIR, "waiting.tmp"), os.path.join(DIR, "waiting"))
            del kv
            for _ in range(20):
                time.sleep(0.05)
            print("went on", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """, wait=False)
    wait_for(p, tmp_path / "waiting")
    time.sleep(0.5)
    pid = int((tmp_path / "waiting").read_text())
    os.kill(pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert "interrupted" in out and "went on" not in out, out


def test_a_dead_server_is_peer_lost(tmp_path):
    p = run_job(tmp_path, """
        kv.init(1, np.zeros(4))
        kv.barrier()
        if kv.rank == 0:
            open(os.path.join(DIR, "ready"), "w").close()
            while not os.path.exists(os.path.join(DIR, "go")):
                time.sleep(0.05)
            try:
                for _ in range(100):
                    kv.push(1, np.ones(4))
                    time.sleep(0.05)
                print("no error", flush=True)
            except kvstore.PeerLost as e:
                print(f"PeerLost: {e}", flush=True)
        """, workers=1, servers=1, wait=False)
    wait_for(p, tmp_path / "ready")
    server = next(int(f.name.split(".")[1]) for f in tmp_path.iterdir()
                  if f.name.startswith("server."))
    os.kill(server, signal.SIGKILL)
    (tmp_path / "go").touch()
    out, _ = p.communicate(timeout=60)
    assert "PeerLost: " in out, out
    assert "no error" not in out, out


def test_ctrl_c_on_a_server_running_a_python_updater_ends_it_by_the_signal(tmp_path):
    # Ctrl-C reaches a server whose Python updater runs for every push: its main thread
    # raises KeyboardInterrupt and the interpreter ends, and the thread serving the job must
    # not take the GIL again then (the interpreter ends such a thread with pthread_exit,
    # which aborts a Rust thread: SIGABRT, in about one run of three before). The server ends
    # by the signal, as Python ends on an uncaught KeyboardInterrupt, every time.
    for trial in range(4):
        run = tmp_path / str(trial)
        run.mkdir()
        p = run_job(run, """
            def add(key, value, stored):
                time.sleep(0.001)  # the GIL let go and taken again inside the updater
                stored += value
            kv._set_updater(add)
            kv.init(1, np.zeros(4))
            open(os.path.join(DIR, "ready"), "w").close()
            try:
                while True:
                    kv.push(1, np.ones(4))
                    kv.pull(1, out=np.zeros(4))
            except kvstore.KVStoreError as e:
                print(f"stopped: {type(e).__name__}: {e}", flush=True)
            """, workers=1, servers=1, wait=False)
        wait_for(p, run / "ready")
        time.sleep(0.2)
        server = next(int(f.name.split(".")[1]) for f in run.iterdir()
                      if f.name.startswith("server."))
        os.kill(server, signal.SIGINT)
        out, _ = p.communicate(timeout=60)
        # The worker hears of it: the server lost, or its last round's update refused (and
        # the updater named by its kind, not by the bytes of its pickle).
        stopped = next(line for line in out.splitlines() if "stopped: " in line)
        assert ("PeerLost" in stopped and "server 0" in stopped) or (
            "the python updater shipped by value: interrupted: this process was interrupted"
            in stopped), out
        first = next(line for line in out.splitlines() if "first failure:" in line)
        assert f"server 0 (pid {server}) was killed by signal 2 (SIGINT)" in first, out


def test_a_store_let_go_of_while_its_server_does_not_answer_lets_other_threads_run(tmp_path):
    # A push returns before its server answers; the store's destructor waits for that answer
    # (the server is stopped, so up to the job's bounds) with the GIL let go, as a call waits.
    rc, out = run_job(tmp_path, """
        import signal, threading
        kv.init(1, np.zeros(4))
        kv.barrier()
        server = next(int(f.split(".")[1]) for f in os.listdir(DIR) if f.startswith("server."))
        os.kill(server, signal.SIGSTOP)
        kv.push(1, np.ones(4))
        ticks, done = [0], [False]
        def count():
            while not done[0]:
                ticks[0] += 1
                time.sleep(0.005)
        t = threading.Thread(target=count)
        t.start()
        time.sleep(0.1)
        t0, before = time.time(), ticks[0]
        del kv
        waited, during = time.time() - t0, ticks[0] - before
        done[0] = True
        t.join()
        print(f"let go of after {waited:.2f} s, {during} ticks meanwhile", flush=True)
        os.kill(server, signal.SIGCONT)
        """, workers=1, servers=1, env={"KVSTORE_TIMEOUT": "3"})
    import re
    m = re.search(r"let go of after ([0-9.]+) s, ([0-9]+) ticks", out)
    assert m, out
    waited, during = float(m.group(1)), int(m.group(2))
    assert waited >= 0.5 and during >= 10 * waited, out


def test_a_signal_handler_that_calls_the_store_it_interrupted_is_refused_not_hung(tmp_path):
    # Rank 0 waits in a barrier for rank 1; a signal's handler, run by the call's check for
    # signals, calls the same store: an error, not a wait for itself.
    code, out = run_job(tmp_path, """
        import signal, threading
        kv.init(1, np.zeros(4))
        if kv.rank == 1:
            time.sleep(3)
        else:
            def handler(sig, frame):
                try:
                    kv.pull(1, out=np.zeros(4))
                    print("handler pulled", flush=True)
                except RuntimeError as e:
                    print(f"handler refused: {e}", flush=True)
            signal.signal(signal.SIGUSR1, handler)
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        kv.barrier()
        print(f"barrier done {kv.rank}", flush=True)
        """)
    assert code == 0, out
    assert "handler refused: this KVStore is in the middle of a call on this thread" in out, out
    assert "handler pulled" not in out, out
    assert "barrier done 0" in out and "barrier done 1" in out, out


def test_ctrl_c_interrupts_a_worker_waiting_to_join_its_job(tmp_path):
    # No scheduler ever listens: the worker's create waits (KVSTORE_TIMEOUT is long); Ctrl-C
    # raises KeyboardInterrupt at once.
    port = free_port()
    script = tmp_path / "join.py"
    script.write_text(textwrap.dedent("""\
        import kvstore
        print("joining", flush=True)
        try:
            kvstore.create("dist_sync")
            print("joined", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """))
    env = dict(os.environ, DMLC_ROLE="worker", DMLC_PS_ROOT_URI="127.0.0.1",
               DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1",
               KVSTORE_SECRET="0123456789abcdef0123", KVSTORE_TIMEOUT="600")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    assert p.stdout.readline().strip() == "joining"
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert "interrupted" in out and "joined" not in out, out


PANIC_BODY = """
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
    code, out = run_job(tmp_path, PANIC_BODY, workers=2, servers=1,
                        env={"KVSTORE_TRANSPORT": transport})
    assert "raised PanicException: a call panicked, a bug in kvstore" in out, out
    assert "_panic_in_a_call, as asked (a pull in flight: true)" in out, out
    assert "refused: this KVStore is closed: a call panicked" in out, out
    assert "out after: -1.0 -1.0" in out, out
    assert "[worker 0] rank 0 done" in out and "[worker 1] rank 1 done" in out, out
    assert code == 0, out
