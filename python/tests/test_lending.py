"""How arrays are lent to the store: held for a call and let go after it, kept alive by a view
an updater keeps, and read anew when the keys, dtypes or arrays of a loop change."""

import gc
import sys

import numpy as np
import pytest

import kvstore


def test_arrays_are_let_go_after_each_call():
    kv = kvstore.create()
    kv.init(0, np.zeros(4, dtype=np.float32))
    v = np.ones(4, dtype=np.float32)
    out = np.zeros(4, dtype=np.float32)
    refs = (sys.getrefcount(v), sys.getrefcount(out))
    for _ in range(3):
        kv.push(0, v)
        kv.pull(0, out=out)
    assert (sys.getrefcount(v), sys.getrefcount(out)) == refs
    # numpy resizes an array in place only where nothing else references it.
    v.resize(8, refcheck=True)
    out.resize(8, refcheck=True)
    with pytest.raises(ValueError, match="shape"):
        kv.push(0, v)
    assert sys.getrefcount(v) == refs[0]


def test_an_input_view_an_updater_keeps_keeps_its_array():
    kv = kvstore.create()
    kv.init(0, np.zeros(1024, dtype=np.float32))
    kept = []
    kv._set_updater(lambda key, input, stored: kept.append(input))
    a = np.arange(1024, dtype=np.float32)
    kv.push(0, a)
    del a
    gc.collect()
    # New arrays of the same size, pushed through the store, would reuse a's memory were it
    # freed.
    for i in range(4):
        kv.push(0, np.full(1024, -1.0 - i, dtype=np.float32))
    assert (kept[0] == np.arange(1024, dtype=np.float32)).all()
    assert [k[0] for k in kept[1:]] == [-1.0, -2.0, -3.0, -4.0]


def test_a_stored_view_an_updater_keeps_keeps_its_memory_when_no_copy_can_be_had():
    # The store goes on with a copy of a stored value whose view the updater kept; where that
    # copy cannot be had (out of memory), the view still keeps its memory: written after the
    # store is gone, it writes its own (before, memory the store had freed: a crash here).
    import subprocess
    import textwrap
    script = textwrap.dedent("""\
        import numpy as np, resource, kvstore
        kv = kvstore.create("local")
        n = 1 << 27
        kv.init(0, np.zeros(n, np.float32))
        g = np.ones(n, np.float32)
        kept = []
        kv._set_updater(lambda key, input, stored: kept.append(stored))
        status = [l for l in open("/proc/self/status") if l.startswith("VmSize")]
        vm = int(status[0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        try:
            kv.push(0, g)
            print("no MemoryError")
        except MemoryError:
            pass
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
        del kv
        kept[0][:] = 2
        print("wrote", float(kept[0][0]) + float(kept[0][-1]))
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "wrote 4.0" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "no MemoryError" not in r.stdout, r.stdout


@pytest.mark.parametrize("keys", [[5, 7, 2**40, 6], ["w", "b", "wb", "bw"]])
def test_keys_dtypes_and_arrays_change_between_calls(keys):
    kv = kvstore.create()
    kinds = [np.float32, np.int32, np.float64, np.uint8]
    for k, dt in zip(keys, kinds):
        kv.init(k, np.zeros(3, dtype=dt))
    for round_ in range(3):
        for i, (k, dt) in enumerate(zip(keys, kinds)):
            # A key equal to the last one but another object, and a fresh array each call.
            key = int(str(k)) if isinstance(k, int) else "".join(list(k))
            kv.push(key, np.full(3, round_ + i, dtype=dt))
        for i, (k, dt) in enumerate(zip(keys, kinds)):
            out = np.zeros(3, dtype=dt)
            kv.pull(k, out=out)
            assert out.dtype == dt and (out == round_ + i).all(), (k, dt)
    # A key the store refuses is refused after keys it took; another dtype under a known
    # key is converted, as MXNet converts it.
    with pytest.raises(TypeError, match="bool"):
        kv.push(True, np.zeros(3, dtype=np.float32))
    with pytest.raises(KeyError):
        kv.push(keys[0] * 3, np.zeros(3, dtype=np.float32))
    out = np.zeros(3, dtype=np.float64)
    kv.pull(keys[0], out=out)
    assert out.tolist() == [2.0] * 3


def test_numpy_integer_scalars_are_keys():
    kv = kvstore.create()
    kv.init(5, np.zeros(3, dtype=np.float32))
    kv.push(np.int64(5), np.full(3, 9, dtype=np.float32))
    out = np.zeros(3, dtype=np.float32)
    kv.pull(np.int32(5), out=out)
    assert (out == 9).all()


def test_an_updater_that_calls_its_own_store_gets_an_error_not_a_hang():
    kv = kvstore.create()
    kv.init(0, np.zeros(2))

    def update(key, input, stored):
        kv.pull(0, out=np.zeros(2))
    kv._set_updater(update)
    with pytest.raises(RuntimeError, match="updater cannot call the store"):
        kv.push(0, np.ones(2))
    # The store goes on.
    kv._set_updater(lambda key, input, stored: stored.__setitem__(slice(None), input))
    kv.push(0, np.ones(2))
    out = np.zeros(2)
    kv.pull(0, out=out)
    assert (out == 1).all()


def test_every_form_of_push_and_pull_is_the_same_call():
    # push(key, value) and pull(key, out=o) / pull(key, o) have their own entry; every other
    # form goes through the general one. Both must be the same method to the caller.
    import inspect

    kv = kvstore.create()
    kv.init([0, 1], [np.zeros(3, dtype=np.float32), np.zeros(2)])
    o = np.zeros(3, dtype=np.float32)
    calls = [
        (lambda v: kv.push(0, v), lambda: kv.pull(0, out=o)),
        (lambda v: kv.push(0, v, 1), lambda: kv.pull(0, o)),
        (lambda v: kv.push(key=0, value=v), lambda: kv.pull(key=0, out=o)),
        (lambda v: kv.push(0, value=v, priority=2), lambda: kv.pull(0, o, 3, True)),
        (lambda v: kv.push(0, [v, v]), lambda: kv.pull(0, out=[o], priority=-1)),
        (lambda v: kv.push([0], [v]), lambda: kv.pull([0], out=[o], ignore_sparse=False)),
    ]
    for i, (push, pull) in enumerate(calls):
        v = np.full(3, i + 1, dtype=np.float32)
        push(v)
        o[:] = -1
        pull()
        want = 2 * (i + 1) if i == 4 else i + 1
        assert o.tolist() == [want] * 3, i
    w = np.zeros(2)
    kv.push(1, np.array([1.5, 2.5]))
    kv.pull(1, out=w)
    assert w.tolist() == [1.5, 2.5]
    w[:] = 0
    name = "".join(["o", "ut"])  # a keyword name that is not the interned one
    kv.pull(1, **{name: w})
    assert w.tolist() == [1.5, 2.5]

    with pytest.raises(TypeError, match="missing 1 required positional argument: 'value'"):
        kv.push(0)
    with pytest.raises(TypeError, match="takes from 2 to 3 positional arguments but 4"):
        kv.push(0, o, 1, 2)
    with pytest.raises(TypeError, match="multiple values for argument 'out'"):
        kv.pull(0, o, out=o)
    with pytest.raises(TypeError, match="unexpected keyword argument 'outs'"):
        kv.pull(0, outs=o)
    with pytest.raises(ValueError, match="out="):
        kv.pull(0)
    with pytest.raises(KeyError):
        kv.push(7, o)
    with pytest.raises(KeyError):
        kv.pull(7, out=o)
    with pytest.raises(ValueError, match="shape"):
        kv.push(0, np.zeros(4))
    with pytest.raises(ValueError, match="shape|dtype"):
        kv.pull(0, out=np.zeros(4, dtype=np.float32))
    with pytest.raises(TypeError):
        kv.pull(0, out=object())
    with pytest.raises(TypeError):
        kvstore.KVStore.push(object(), 0, o)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(3, dtype=np.float32)
        ro.flags.writeable = False
        kv.pull(0, out=ro)
    assert o.tolist() == [6.0] * 3  # no failed call wrote it

    # pushpull: (key, value), (key, value, o) and (key, value, out=o) have the own entry.
    # The updater doubles what is pushed, so a result that never landed would show.
    kv._set_updater(lambda key, input, stored: stored.__setitem__(slice(None), input * 2))
    forms = [
        lambda v: kv.pushpull(0, v),
        lambda v: kv.pushpull(0, v, o),
        lambda v: kv.pushpull(0, v, out=o),
        lambda v: kv.pushpull(0, v, out=o, priority=1),
        lambda v: kv.pushpull(key=0, value=v),
        lambda v: kv.pushpull(0, v, o, 2),
        lambda v: kv.pushpull(0, value=v, out=None),
        lambda v: kv.pushpull(0, v, None),
        lambda v: kv.pushpull(0, v, out=None),
    ]
    for i, pp in enumerate(forms):
        v = np.full(3, 10 + i, dtype=np.float32)
        o[:] = -1
        pp(v)
        in_place = i in (0, 4, 6, 7, 8)
        assert (v if in_place else o).tolist() == [2 * (10.0 + i)] * 3, i
        assert (o if in_place else v).tolist() == ([-1.0] if in_place else [10.0 + i]) * 3, i
    with pytest.raises(ValueError, match="out="):
        kv.pull(0, None)
    with pytest.raises(ValueError, match="out="):
        kv.pull(0, out=None)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'value'"):
        kv.pushpull(0)
    with pytest.raises(TypeError, match="multiple values for argument 'out'"):
        kv.pushpull(0, o, o, out=o)
    with pytest.raises(TypeError, match="unexpected keyword argument 'outs'"):
        kv.pushpull(0, o, outs=o)
    with pytest.raises(KeyError):
        kv.pushpull(7, o, out=o)

    assert str(inspect.signature(kvstore.KVStore.pushpull)) == (
        "(self, /, key, value, out=None, priority=0)"
    )
    assert str(inspect.signature(kvstore.KVStore.push)) == "(self, /, key, value, priority=0)"
    assert str(inspect.signature(kvstore.KVStore.pull)) == (
        "(self, /, key, out=None, priority=0, ignore_sparse=True)"
    )
    assert "Pushes values" in kvstore.KVStore.push.__doc__
    assert "Pulls the stored values" in kvstore.KVStore.pull.__doc__


def test_pushpull_lands_the_updated_value_in_place_and_in_outputs():
    # One key and one array have their own route (through the reused shells, the result of
    # a call in place landing in an array of the store's first); the updater makes the result
    # differ from what was pushed, so a result that never landed would show.
    kv = kvstore.create()
    kv.init(0, np.zeros(6, dtype=np.float32))
    kv._set_updater(lambda key, input, stored: stored.__iadd__(input * 2))
    a = np.ones(6, dtype=np.float32)
    kv.pushpull(0, a)
    assert a.tolist() == [2.0] * 6
    o = np.zeros(6, dtype=np.float32)
    kv.pushpull(0, a, out=o)
    assert o.tolist() == [6.0] * 6 and a.tolist() == [2.0] * 6
    kv.pushpull(0, a, a)
    assert a.tolist() == [10.0] * 6
    # Overlapping views: the value read, then the result written over part of it.
    b = np.arange(12, dtype=np.float32)
    kv.pushpull(0, b[0:6], out=b[3:9])
    assert b.tolist() == [0, 1, 2] + [10 + 2 * i for i in range(6)] + [9, 10, 11]

    def stored():
        s = np.zeros(6, dtype=np.float32)
        kv.pull(0, out=s)
        return s.tolist()

    before = stored()
    ro = np.ones(6, dtype=np.float32)
    ro.flags.writeable = False
    for bad, err in [
        (lambda: kv.pushpull(0, a, out=np.zeros(5, dtype=np.float32)), ValueError),
        (lambda: kv.pushpull(0, a, out=ro), ValueError),
        (lambda: kv.pushpull(0, ro), ValueError),
        (lambda: kv.pushpull(9, a), KeyError),
        (lambda: kv.pushpull(0, np.ones(5, dtype=np.float32)), ValueError),
    ]:
        with pytest.raises(err):
            bad()
    assert stored() == before, "a refused pushpull changed the stored value"
    assert a.tolist() == [10.0] * 6

    # Larger than a result array is kept for: the general route, the same result.
    big = np.ones(300_000, dtype=np.float32)
    kv.init(1, np.zeros_like(big))
    kv.pushpull(1, big)
    assert (big == 2).all()


def test_a_key_that_can_change_in_place_is_read_at_every_call():
    # A 0-d numpy integer array is a key (it converts to an int), and it can be changed in
    # place: the store must not take it for the key it named before.
    kv = kvstore.create()
    kv.init([0, 1], [np.zeros(2), np.zeros(2)])
    key = np.array(0)
    kv.push(key, np.ones(2))
    key[...] = 1
    kv.push(key, np.full(2, 5.0))
    a, b = np.zeros(2), np.zeros(2)
    kv.pull(0, out=a)
    kv.pull(1, out=b)
    assert a.tolist() == [1.0, 1.0] and b.tolist() == [5.0, 5.0]
