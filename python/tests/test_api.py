"""MXNet's KVStore API on numpy arrays: arrays in and out without copies, every error case,
threads and fork (a store's optimizers: test_store_optimizers.py)."""

import enum
import os
import threading

import numpy as np
import pytest

import kvstore

SHAPE = (2, 3)


@pytest.fixture
def kv():
    kv = kvstore.create("local")
    kv.init(3, np.ones(SHAPE, dtype=np.float32))
    return kv


def test_names_and_properties():
    for name, kind in [("local", "local"), ("device", "device"),
                       ("local_allreduce_cpu", "local"), ("local_allreduce_device", "device")]:
        kv = kvstore.create(name)
        assert (kv.type, kv.rank, kv.num_workers) == (name, 0, 1)
    assert kvstore.create().type == "local"
    with pytest.raises(ValueError, match="dist_device_sync"):
        kvstore.create("nope")
    assert kvstore.create().is_capable("optimizer")
    m = kvstore.create().metrics()
    assert m["calls"] == 0 and m["servers"] == [] and kvstore.create().placement_map() == ""
    assert kvstore.create().is_capable("OPTIMIZER")
    with pytest.raises(ValueError):
        kvstore.create().is_capable("teleport")


def test_pull_writes_in_place_and_keeps_the_object(kv):
    out = np.zeros(SHAPE, dtype=np.float32)
    address = out.__array_interface__["data"][0]
    kv.pull(3, out=out)
    assert out.__array_interface__["data"][0] == address
    assert (out == 1).all()
    # A view of a bigger array is written in place too (rows of a C-contiguous array).
    big = np.zeros((4, 3), dtype=np.float32)
    kv.pull(3, out=big[1:3])
    assert (big[1:3] == 1).all() and (big[0] == 0).all() and (big[3] == 0).all()


def test_every_dtype_round_trips():
    kv = kvstore.create("local")
    for i, dt in enumerate([np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8]):
        v = (np.arange(6).reshape(SHAPE) + 1).astype(dt)
        kv.init(100 + i, v)
        kv.push(100 + i, [v, v])
        out = np.zeros(SHAPE, dtype=dt)
        kv.pull(100 + i, out=out)
        assert out.dtype == dt and (out == 2 * v).all(), dt


def test_array_interface_and_dlpack_objects(kv):
    class Interface:
        def __init__(self, a):
            self.a = a
            self.__array_interface__ = a.__array_interface__

    class DLPack:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    target = np.zeros(SHAPE, dtype=np.float32)
    kv.push(3, Interface(np.full(SHAPE, 5, dtype=np.float32)))
    kv.pull(3, out=Interface(target))
    assert (target == 5).all()
    kv.push(3, DLPack(np.full(SHAPE, 6, dtype=np.float32)))
    target2 = np.zeros(SHAPE, dtype=np.float32)
    kv.pull(3, out=DLPack(target2))
    assert (target2 == 6).all()
    # numpy's own from_dlpack sees the same memory.
    assert np.from_dlpack(DLPack(target2)).__array_interface__["data"][0] == \
        target2.__array_interface__["data"][0]
    # One that numpy imports read-only (here its producer says so; numpy before 2.2.5 imports
    # every one so) is refused as an output, saying why.
    frozen = np.zeros(SHAPE, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="imports it from DLPack"):
        kv.pull(3, out=DLPack(frozen))
    assert (frozen == 0).all()


def test_pushpull_broadcast_and_priority(kv):
    v = np.full(SHAPE, 4, dtype=np.float32)
    out = np.zeros(SHAPE, dtype=np.float32)
    kv.pushpull(3, v, out=out, priority=5)
    assert (out == 4).all()
    # In place when out is None.
    w = np.full(SHAPE, 7, dtype=np.float32)
    kv.pushpull(3, w)
    assert (w == 7).all()
    # out=value explicitly, and a list of devices.
    ws = [np.full(SHAPE, 1, dtype=np.float32), np.full(SHAPE, 2, dtype=np.float32)]
    kv.pushpull(3, ws, out=ws)
    assert all((x == 3).all() for x in ws)
    b = np.zeros(SHAPE)
    kv.broadcast(8, np.full(SHAPE, 9.0), out=b, priority=-1)
    assert (b == 9).all()
    kv.push([3, 8], [np.ones(SHAPE, dtype=np.float32), np.ones(SHAPE)], priority=2)
    outs = [np.zeros(SHAPE, dtype=np.float32), np.zeros(SHAPE)]
    kv.pull([3, 8], out=outs, priority=1)
    assert (outs[0] == 1).all() and (outs[1] == 1).all()


def test_row_sparse_pull_writes_the_rows_asked_for_and_zeros_the_rest():
    kv = kvstore.create("local")
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    kv.init("emb", w)
    out = np.full((4, 3), -1, dtype=np.float32)
    kv.row_sparse_pull("emb", out=out, row_ids=np.array([3, 1, 3], dtype=np.int64))
    want = np.zeros((4, 3), dtype=np.float32)
    want[[1, 3]] = w[[1, 3]]
    assert (out == want).all(), out
    # One list of ids for a list of outputs, or one list each; priority as MXNet's.
    outs = [np.ones((4, 3), dtype=np.float32) for _ in range(2)]
    kv.row_sparse_pull("emb", out=outs, row_ids=[0], priority=3)
    assert all((o[0] == w[0]).all() and (o[1:] == 0).all() for o in outs)
    kv.row_sparse_pull("emb", out=outs, row_ids=[np.array([2]), [0, 1]])
    assert (outs[0][2] == w[2]).all() and (outs[0][[0, 1, 3]] == 0).all()
    assert (outs[1][:2] == w[:2]).all() and (outs[1][2:] == 0).all()
    # One list of ids alone in a list serves every output too (MXNet's single_rowid).
    kv.row_sparse_pull("emb", out=outs, row_ids=[np.array([3])])
    assert all((o[3] == w[3]).all() and (o[:3] == 0).all() for o in outs)
    # Errors: nothing is written.
    before = out.copy()
    with pytest.raises(ValueError, match="out of range"):
        kv.row_sparse_pull("emb", out=out, row_ids=[4])
    with pytest.raises(ValueError, match="negative"):
        kv.row_sparse_pull("emb", out=out, row_ids=[-1])
    with pytest.raises(TypeError):
        kv.row_sparse_pull("emb", out=out, row_ids="1")
    with pytest.raises(ValueError, match="row_ids"):
        kv.row_sparse_pull("emb", out=out)
    with pytest.raises(ValueError):
        kv.row_sparse_pull("emb", out=np.zeros((3, 3), dtype=np.float32), row_ids=[0])
    with pytest.raises(ValueError, match="2 lists of row ids for 1 outputs"):
        kv.row_sparse_pull("emb", out=out, row_ids=[[0], [1]])
    with pytest.raises(KeyError):
        kv.row_sparse_pull("nope", out=out, row_ids=[0])
    assert (out == before).all()
    # A bad list or output after a good one: nothing is written, the first output included.
    firsts = [o.copy() for o in outs]
    with pytest.raises(ValueError, match="out of range"):
        kv.row_sparse_pull("emb", out=outs, row_ids=[[0], [9]])
    with pytest.raises(ValueError):
        kv.row_sparse_pull("emb", out=[outs[0], np.zeros((4, 2), dtype=np.float32)], row_ids=[1])
    assert all((o == f).all() for o, f in zip(outs, firsts))


def test_a_store_is_a_kvstorebase_as_in_mxnet():
    # MXNet's KVStore subclasses KVStoreBase, and its model code checks that.
    assert isinstance(kvstore.create("local"), kvstore.KVStoreBase)
    assert not isinstance(object(), kvstore.KVStoreBase)

    @kvstore.KVStoreBase.register
    class Mine(kvstore.KVStoreBase):
        pass

    assert isinstance(kvstore.create("mine"), kvstore.KVStoreBase)
    # MXNet's interface: each method raises NotImplementedError until a store implements it.
    with pytest.raises(NotImplementedError):
        kvstore.create("mine").pushpull(0, np.ones(1))
    with pytest.raises(NotImplementedError):
        kvstore.create("mine").rank
    # A class registered under a taken name replaces it, with MXNet's warning.
    with pytest.warns(UserWarning, match="overriding existing kvstore"):
        @kvstore.KVStoreBase.register
        class mine(kvstore.KVStoreBase):  # noqa: N801
            pass
    assert type(kvstore.create("MINE")) is mine
    # MXNet's TestStore: no values kept; broadcast copies, pushpull sums.
    t = kvstore.create("teststore")
    assert (t.type, t.rank, t.num_workers, t.is_capable("optimizer")) == ("teststore", 0, 1,
                                                                          False)
    outs = [np.zeros(2), np.zeros(2)]
    t.broadcast(0, np.full(2, 3.0), out=outs)
    assert all((o == 3).all() for o in outs)
    vs = [np.ones(2), np.full(2, 2.0)]
    t.pushpull(0, vs)
    assert all((v == 3).all() for v in vs)
    t.pushpull(0, [np.ones(2), np.ones(2)], out=outs)
    assert all((o == 2).all() for o in outs)


def test_a_refused_call_changes_nothing_it_did_not_do(kv):
    # A refused broadcast initialises nothing: its output is checked first.
    with pytest.raises(ValueError, match="nothing was initialised"):
        kv.broadcast(5, np.ones((2, 3)), out=np.zeros((3, 3)))
    # So is an output of a dtype the store cannot lend (converted when the shape is right).
    with pytest.raises(ValueError, match="nothing was initialised"):
        kv.broadcast(5, np.ones((2, 3), dtype=np.float32), out=np.zeros((3, 3), dtype=np.int8))
    with pytest.raises(ValueError, match="nothing was initialised"):
        kv.broadcast([6, 7], [np.ones(2, dtype=np.float32)] * 2,
                     out=[np.zeros(2, dtype=np.int8), np.zeros(5, dtype=np.float32)])
    b = np.zeros((2, 3))
    kv.broadcast(5, np.ones((2, 3)), out=b)
    assert (b == 1).all()
    i8 = np.zeros(2, dtype=np.int8)
    kv.broadcast([6, 7], [np.ones(2, dtype=np.float32)] * 2, out=[i8, np.zeros(2, np.float32)])
    assert (i8 == 1).all()
    # A refused pull does not choose the store's kind of keys: only keys stored do.
    fresh = kvstore.create()
    with pytest.raises(KeyError):
        fresh.pull("w", out=np.zeros(1))
    fresh.init(3, np.ones(1))
    with pytest.raises(TypeError, match="integer keys or string keys"):
        fresh.init("w", np.ones(1))


def test_flags_are_taken_by_their_truth_as_mxnet_s(kv, tmp_path):
    # MXNet passes ignore_sparse and dump_optimizer through ctypes.c_bool and `if`: any object.
    out = np.zeros(SHAPE, dtype=np.float32)
    kv.pull(3, out=out, ignore_sparse=0)
    kv.pull(3, out=out, ignore_sparse=None)
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
    kv.save_optimizer_states(str(tmp_path / "a"), dump_optimizer=1)
    kv.save_optimizer_states(str(tmp_path / "b"), dump_optimizer=0)
    assert (tmp_path / "a").read_bytes() != (tmp_path / "b").read_bytes()
    kv.save_optimizer_states(str(tmp_path / "c"), dump_optimizer=True)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "c").read_bytes()


def test_string_keys():
    kv = kvstore.create()
    kv.init(["w", "b"], [np.ones(SHAPE), np.zeros(SHAPE)])
    kv.push("b", np.full(SHAPE, 3.0))
    out = np.zeros(SHAPE)
    kv.pull("b", out=out)
    assert (out == 3).all()
    with pytest.raises(TypeError, match="integer keys or string keys"):
        kv.push(1, np.ones(SHAPE))


class Big(enum.IntEnum):
    KEY = 2**70


def test_errors_are_python_exceptions(kv):
    with pytest.raises(KeyError):
        kv.push(99, np.ones(SHAPE, dtype=np.float32))
    with pytest.raises(KeyError):
        kv.pull(99, out=np.zeros(SHAPE, dtype=np.float32))
    # An int key beyond 64 bits is too large (the message says so), however it is passed.
    for call in (lambda: kv.push(2**70, np.ones(SHAPE, dtype=np.float32)),
                 lambda: kv.pull(2**70, out=np.zeros(SHAPE, dtype=np.float32)),
                 lambda: kv.push([2**70], [np.ones(SHAPE, dtype=np.float32)]),
                 lambda: kv.pushpull(-2**64, np.ones(SHAPE, dtype=np.float32)),
                 # An int that is not Python's own (its __index__) as much.
                 lambda: kv.push(np.uint64(2**63), np.ones(SHAPE, dtype=np.float32)),
                 lambda: kv.push(Big.KEY, np.ones(SHAPE, dtype=np.float32))):
        with pytest.raises(OverflowError, match="2\\*\\*63"):
            call()
    with pytest.raises(ValueError, match="shape"):
        kv.push(3, np.ones((3, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        kv.pull(3, out=np.zeros((6,), dtype=np.float32))
    with pytest.raises(ValueError, match="already initialised"):
        kv.init(3, np.ones(SHAPE, dtype=np.float32))
    with pytest.raises(ValueError, match="3 keys but 2"):
        kv.push([3, 3, 3], [np.ones(SHAPE, dtype=np.float32)] * 2)
    with pytest.raises(ValueError, match="needs out"):
        kv.pull(3)
    with pytest.raises(TypeError, match="key"):
        kv.push(3.5, np.ones(SHAPE, dtype=np.float32))
    with pytest.raises(TypeError, match="numpy array"):
        kv.push(3, "not an array")
    with pytest.raises(TypeError, match="numpy array"):
        kv.push(3, [1.0, 2.0])
    with pytest.raises(TypeError, match="dtype"):
        kv.push(3, np.ones(SHAPE, dtype=np.complex64))
    with pytest.raises(TypeError, match="dtype"):
        kv.init(8, np.ones(SHAPE, dtype=">f4"))  # not this machine's byte order
    with pytest.raises(TypeError, match="dtype"):
        kv.init(8, np.ones(SHAPE, dtype=np.int8))
    # A subclass of ndarray is an ndarray, in place.
    m = np.zeros(SHAPE, dtype=np.float32).view(np.matrix)
    kv.pull(3, out=m)
    assert m.sum() != 0
    ro = np.zeros(SHAPE, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kv.pull(3, out=ro)
    with pytest.raises(ValueError, match="C-contiguous"):
        kv.pull(3, out=np.zeros((3, 2), dtype=np.float32).T)
    with pytest.raises(ValueError, match="C-contiguous"):
        kv.pushpull(3, np.ones((3, 2), dtype=np.float32).T)  # in place: written
    big = np.zeros(12, dtype=np.float32)
    with pytest.raises(ValueError, match="overlap"):
        kv.pull([3, 3], out=[big[:6].reshape(SHAPE), big[3:9].reshape(SHAPE)])
    # As much in place, where a list's values are its outputs, and for row_sparse_pull's
    # outputs (before, both were written one after the other).
    with pytest.raises(ValueError, match="overlap"):
        kv.pushpull([3, 3], [big[:6].reshape(SHAPE), big[3:9].reshape(SHAPE)])
    with pytest.raises(ValueError, match="overlap"):
        kv.pushpull([3], [[big[:6].reshape(SHAPE), big[3:9].reshape(SHAPE)]])
    with pytest.raises(ValueError, match="overlap"):
        kv.row_sparse_pull(3, out=[big[:6].reshape(SHAPE), big[3:9].reshape(SHAPE)], row_ids=[0])
    with pytest.raises(TypeError, match="callable"):
        kv._set_updater(5)
    with pytest.raises(TypeError, match="kvstore.optimizer"):
        kv.set_optimizer("sgd")
    # Nothing above changed the stored value.
    out = np.zeros(SHAPE, dtype=np.float32)
    kv.pull(3, out=out)
    assert (out == 1).all()


def test_values_of_any_layout_are_read_as_mxnet_reads_them(kv):
    # MXNet's arrays are contiguous, so a transpose or a column slice is a copy there; a numpy
    # view of that kind is read through a contiguous copy, as is one that is not aligned.
    # Outputs are written in place, so they must be contiguous (above).
    grid = np.arange(12, dtype=np.float32).reshape(2, 6)
    cols = grid[:, :3]
    transposed = np.arange(6, dtype=np.float32).reshape(3, 2).T
    raw = np.zeros(4 * 6 + 1, dtype=np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(SHAPE)
    unaligned[:] = 7
    assert not cols.flags.c_contiguous and not unaligned.flags.aligned
    out = np.zeros(SHAPE, dtype=np.float32)
    kv.init(5, transposed)
    kv.pull(5, out=out)
    assert (out == transposed).all()
    kv.push(5, cols)
    kv.pull(5, out=out)
    assert (out == [[0, 1, 2], [6, 7, 8]]).all()
    kv.push(5, [cols, transposed, unaligned, np.broadcast_to(np.float32(1), SHAPE)])
    kv.pull(5, out=out)
    assert (out == cols + transposed + 7 + 1).all()
    # Converted as well as copied: float64 columns into the float32 key.
    kv.pushpull(5, grid.astype(np.float64)[:, 3:], out=out)
    assert (out == [[3, 4, 5], [9, 10, 11]]).all()
    kv.broadcast(6, cols, out=out)
    assert (out == cols).all()
    # The views were only read.
    assert (grid == np.arange(12).reshape(2, 6)).all() and (unaligned == 7).all()


def test_updater_exceptions_propagate_as_themselves(kv):
    class Boom(Exception):
        pass

    def update(key, input, stored):
        raise Boom(f"no update for {key}")
    kv._set_updater(update)
    with pytest.raises(Boom, match="no update for 3"):
        kv.push(3, np.ones(SHAPE, dtype=np.float32))


def test_updater_views_are_in_place_and_may_outlive_the_call(kv):
    kept = []

    def update(key, input, stored):
        assert not input.flags.writeable and stored.flags.writeable
        assert stored.shape == SHAPE and stored.dtype == np.float32
        stored += input * 2
        kept.append((input, stored))
    kv._set_updater(update)
    kv.push(3, np.ones(SHAPE, dtype=np.float32))
    out = np.zeros(SHAPE, dtype=np.float32)
    kv.pull(3, out=out)
    assert (out == 3).all()
    # The kept view is its own memory now: writing it does not change the store.
    kept[0][1][:] = -100
    kv.pull(3, out=out)
    assert (out == 3).all()
    kv.push(3, np.ones(SHAPE, dtype=np.float32))
    kv.pull(3, out=out)
    assert (out == 5).all()
    assert (kept[0][1] == -100).all()


def test_create_is_mxnet_s():
    assert kvstore.create("LOCAL").type == "local"
    assert kvstore.create("nccl").type == "nccl"
    # Other names as MXNet's KVStore::Create reads them, by what they contain; the type is
    # the name given, in lower case.
    for name in ["local_device", "Local_Update_Device", "my_local"]:
        kv = kvstore.create(name)
        assert kv.type == name.lower() and kv.num_workers == 1
    with pytest.raises(ValueError, match="none of"):
        kvstore.create("lcoal")
    with pytest.raises(ValueError, match="Horovod"):
        kvstore.create("horovod")
    with pytest.raises(TypeError):
        kvstore.create(3)
    kv = kvstore.create()
    assert kv.OPTIMIZER == kvstore.KVStore.OPTIMIZER == kvstore.KVStoreBase.OPTIMIZER
    assert kv.is_capable(kvstore.KVStoreBase.OPTIMIZER)

    @kvstore.KVStoreBase.register
    class MyStore(kvstore.KVStoreBase):
        pass
    try:
        assert isinstance(kvstore.create("MyStore"), MyStore)
    finally:
        del kvstore.KVStoreBase.kv_registry["mystore"]


def test_threads_share_a_store_safely():
    kv = kvstore.create()
    kv.init(0, np.zeros(1000))

    def add(key, input, stored):
        stored += input
    kv._set_updater(add)
    errors = []

    def work():
        try:
            for _ in range(200):
                kv.push(0, np.ones(1000))
                kv.pull(0, out=np.zeros(1000))
        except Exception as e:  # noqa: BLE001 - any error fails the test
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    out = np.zeros(1000)
    kv.pull(0, out=out)
    assert (out == 800).all()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_is_told_it_cannot_use_the_store(kv):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            kv.push(3, np.ones(SHAPE, dtype=np.float32))
            msg = b"no error"
        except RuntimeError as e:
            msg = str(e).encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    msg = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    assert "fork" in msg and f"process {os.getpid()}" in msg, msg
    kv.push(3, np.ones(SHAPE, dtype=np.float32))


def test_an_updater_let_go_of_may_call_its_store(tmp_path):
    # Letting go of the updater a store ran can run Python code (its __del__, a weak
    # reference's callback) that calls the store again: it gets an answer, never a deadlock
    # on a lock the replacing call still held. Run apart, so that a deadlock fails the test
    # instead of hanging the suite.
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "replace.py"
    script.write_text(textwrap.dedent(f"""\
        import numpy as np
        import kvstore
        from kvstore import optimizer as opt
        kv = kvstore.create()
        kv.init(0, np.zeros(4, dtype=np.float32))
        seen = []
        class Old:
            def __call__(self, key, value, stored):
                stored[:] = value
            def __del__(self):
                try:
                    kv.save_optimizer_states({str(tmp_path)!r} + "/s")
                    seen.append("saved")
                except Exception as e:
                    seen.append(f"{{type(e).__name__}}: {{e}}")
        kv._set_updater(Old())
        kv.push(0, np.ones(4, dtype=np.float32))
        kv._set_updater(opt.get_updater(opt.SGD()))
        print(seen, flush=True)
        """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "['saved']", out


def test_memory_a_call_cannot_have_is_a_memory_error(tmp_path):
    # An in-place pushpull lands its result in memory of its own first; where there is none
    # to have, a MemoryError as numpy's, and the store goes on (before, Rust's allocation
    # failure aborted the interpreter). Run apart, under a limit on its address space.
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "oom.py"
    script.write_text(textwrap.dedent("""\
        import resource
        import numpy as np
        import kvstore
        kv = kvstore.create()
        v = np.ones(64 << 20, dtype=np.float32)  # 256 MiB
        kv.init(0, v)
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
        try:
            kv.pushpull(0, v)
            print("no error", flush=True)
        except MemoryError as e:
            print(f"MemoryError: {e}", flush=True)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        out = np.zeros(4, dtype=np.float32)
        kv.init(1, np.full(4, 2, dtype=np.float32))
        kv.pull(1, out=out)
        print(out.tolist(), (v == 1).all(), flush=True)
        """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out
    assert out.stdout.splitlines() == [
        "MemoryError: shape [67108864] of float32 is too large: its size in bytes overflows, "
        "or no memory can be had for it", "[2.0, 2.0, 2.0, 2.0] True"], out


def test_threads_saving_a_python_updaters_states_do_not_deadlock(tmp_path):
    # Each save runs the updater's get_states (Python, which may hand the GIL to the other
    # thread) without holding the store's locks; run apart, so that a deadlock fails the
    # test instead of hanging the suite.
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "saves.py"
    script.write_text(textwrap.dedent(f"""\
        import sys, threading
        import numpy as np
        import kvstore
        from kvstore import optimizer as opt
        kv = kvstore.create()
        kv.init(0, np.zeros(1 << 20, dtype=np.float32))
        kv._set_updater(opt.get_updater(opt.SGD(momentum=0.9)))
        kv.push(0, np.ones(1 << 20, dtype=np.float32))
        def saver(i):
            for n in range(40):
                kv.save_optimizer_states({str(tmp_path)!r} + f"/s{{i}}")
        ts = [threading.Thread(target=saver, args=(i,)) for i in range(2)]
        sys.setswitchinterval(1e-6)
        [t.start() for t in ts]
        [t.join() for t in ts]
        print("saved", flush=True)
        """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "saved" in out.stdout, out
