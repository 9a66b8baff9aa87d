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
    # A key the store refuses is refused after keys it took, and another dtype under a
    # known key is a mismatch.
    with pytest.raises(TypeError, match="bool"):
        kv.push(True, np.zeros(3, dtype=np.float32))
    with pytest.raises(KeyError):
        kv.push(keys[0] * 3, np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="dtype"):
        kv.pull(keys[0], out=np.zeros(3, dtype=np.float64))


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
