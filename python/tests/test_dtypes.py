"""Values and outputs of another dtype than their key's are converted, as MXNet converts
them (numpy's float64 default meeting a float32 key, say): every form of every call, in one
process and in a distributed job; a call whose dtypes agree lends its arrays as before."""

import array

import numpy as np
import pytest

import kvstore

from test_dist import run_job

SHAPE = (2, 3)


def f32(v):
    return np.full(SHAPE, v, dtype=np.float32)


@pytest.fixture
def kv():
    kv = kvstore.create("local")
    kv.init(3, f32(0))
    kv.init(5, np.zeros(SHAPE, dtype=np.int32))
    return kv


def test_pushed_values_of_another_dtype_are_converted(kv):
    kv.push(3, np.full(SHAPE, 8.0))                      # float64 into float32
    out = f32(-1)
    kv.pull(3, out=out)
    assert out.tolist() == f32(8).tolist()
    # Several values per key, of several dtypes, summed in the key's dtype.
    kv.push(3, [np.full(SHAPE, 1.25), f32(2), np.full(SHAPE, 3, dtype=np.int64)])
    kv.pull(3, out=out)
    assert out.tolist() == f32(6.25).tolist()
    # Lists of keys; float into an int32 key casts as MXNet's cast does (toward zero).
    kv.push([3, 5], [np.full(SHAPE, 0.5, dtype=np.float16), np.full(SHAPE, -2.7)])
    i = np.zeros(SHAPE, dtype=np.int32)
    kv.pull([3, 5], out=[out, i])
    assert out.tolist() == f32(0.5).tolist() and i.tolist() == np.full(SHAPE, -2).tolist()
    # The value given is not changed.
    v = np.full(SHAPE, 4.0)
    kv.push(3, v)
    assert v.dtype == np.float64 and (v == 4.0).all()


def test_objects_with_the_buffer_protocol_are_converted_as_numpy_arrays(kv):
    # numpy reads them as arrays, so they convert as arrays do (before, a DTypeMismatch).
    kv.init(9, np.zeros(4, dtype=np.float32))
    kv.push(9, array.array("d", [1.5, 2, 3, 4]))
    first = array.array("d", [0] * 4)
    kv.pull(9, out=first)
    assert first.tolist() == [1.5, 2, 3, 4]
    kv.push(9, [memoryview(array.array("i", [1, 1, 1, 1])), np.ones(4, dtype=np.float32)])
    out, back = array.array("d", [0] * 4), bytearray(4)
    kv.pull(9, out=[memoryview(out), back])
    assert out.tolist() == [2.0] * 4 and list(back) == [2] * 4


def test_outputs_of_another_dtype_get_the_value_cast_into_them(kv):
    kv.push(3, f32(2.5))
    a, b, c = np.zeros(SHAPE), np.zeros(SHAPE, dtype=np.int64), f32(0)
    kv.pull(3, out=[a, b, c])
    assert a.dtype == np.float64 and (a == 2.5).all()
    assert b.dtype == np.int64 and (b == 2).all()
    assert (c == 2.5).all()
    # Into a view: its memory, not a copy of it.
    big = np.zeros((4, 3))
    kv.pull(3, out=big[1:3])
    assert big.tolist() == [[0] * 3, [2.5] * 3, [2.5] * 3, [0] * 3]
    # broadcast and row_sparse_pull take them too.
    out = np.zeros((4, 2))
    kv.broadcast(7, np.arange(8, dtype=np.float32).reshape(4, 2), out=out)
    assert out.tolist() == np.arange(8.0).reshape(4, 2).tolist()
    rows = np.full((4, 2), -1.0)
    kv.row_sparse_pull(7, out=rows, row_ids=np.array([3, 1]))
    assert rows.tolist() == [[0, 0], [2, 3], [0, 0], [6, 7]]


def test_pushpull_converts_values_and_outputs_in_place_or_not(kv):
    v = np.full(SHAPE, 1.5)                 # float64, in place
    kv.pushpull(3, v)
    assert v.dtype == np.float64 and (v == 1.5).all()
    o = np.zeros(SHAPE, dtype=np.float16)
    kv.pushpull(3, np.full(SHAPE, 4, dtype=np.int64), out=o)
    assert (o == 4).all()
    outs = [np.zeros(SHAPE, dtype=np.int64), np.zeros(SHAPE)]
    kv.pushpull([3, 5], [np.full(SHAPE, 5.0), np.full(SHAPE, 7.9)], out=outs)
    assert (outs[0] == 5).all() and (outs[1] == 7).all()
    # An updater sees the key's dtype.
    seen = []

    def update(key, value, stored):
        seen.append((value.dtype, stored.dtype))
        stored += value * 2

    kv._set_updater(update)
    kv.push(3, np.ones(SHAPE))
    out = np.zeros(SHAPE)
    kv.pull(3, out=out)
    assert seen == [(np.float32, np.float32)] and (out == 7).all()


def test_dtypes_the_store_lacks_are_converted_into_the_keys(kv):
    # int8, bool, uint16 and another byte order: kept by no key, converted as MXNet converts.
    kv.push(3, np.full(SHAPE, -3, dtype=np.int8))
    out = f32(0)
    kv.pull(3, out=out)
    assert (out == -3).all()
    kv.push(3, [np.ones(SHAPE, dtype=bool), np.full(SHAPE, 2, dtype=np.uint16)])
    kv.pull(3, out=out)
    assert (out == 3).all()
    kv.push(3, np.full(SHAPE, 1.5, dtype=">f4"))
    outs = [np.zeros(SHAPE, dtype=np.int8), np.zeros(SHAPE, dtype=">f8"), np.zeros(SHAPE, bool)]
    kv.pull(3, out=outs)
    assert (outs[0] == 1).all() and (outs[1] == 1.5).all() and outs[1].dtype == ">f8"
    assert outs[2].all()
    # Nothing converts an init's value (it makes the key's dtype), or a complex number.
    with pytest.raises(kvstore.UnsupportedDType, match="unsupported dtype"):
        kv.init(9, np.zeros(SHAPE, dtype=np.int8))
    with pytest.raises(TypeError, match="unsupported dtype"):
        kv.push(3, np.ones(SHAPE, dtype=np.complex64))
    with pytest.raises(TypeError, match="unsupported dtype"):
        kv.pull(3, out=np.zeros(SHAPE, dtype=np.complex128))
    kv.pull(3, out=out)
    assert (out == 1.5).all()


def test_what_cannot_be_converted_is_refused_and_changes_nothing(kv):
    kv.push(3, f32(1))
    with pytest.raises(ValueError, match="shape"):
        kv.push(3, np.ones((3, 2)))                  # another shape is never converted
    with pytest.raises(KeyError):
        kv.push([3, 99], [np.ones(SHAPE), np.ones(SHAPE)])
    ro = np.zeros(SHAPE)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        kv.pull(3, out=ro)
    with pytest.raises(TypeError, match="dtype"):
        kv.push(3, np.ones(SHAPE, dtype=np.complex64))   # a dtype the store lacks
    # A pushpull whose value and output both need converting refuses an output it could not
    # write before anything is pushed (the push went through, then the copy-back failed).
    with pytest.raises(ValueError, match="read-only"):
        kv.pushpull(3, np.full(SHAPE, 7, dtype=np.int8), out=ro)
    with pytest.raises(ValueError, match="C-contiguous"):
        kv.pushpull(3, np.full(SHAPE, 7, dtype=np.int8), out=np.zeros((2, 6))[:, ::2])
    # Dtypes numpy can neither export nor hand over by DLPack are the store's refusal too.
    for odd in (np.zeros(SHAPE, dtype="M8[s]"), np.zeros(SHAPE, dtype="m8[s]")):
        with pytest.raises(kvstore.UnsupportedDType, match="dtype or memory"):
            kv.push(3, odd)
        with pytest.raises(TypeError):
            kv.init(40, odd)
    out = f32(0)
    kv.pull(3, out=out)
    assert (out == 1).all()
    assert issubclass(kvstore.DTypeMismatch, ValueError)


def test_a_distributed_job_converts_as_a_local_store_does(tmp_path):
    code, out = run_job(tmp_path, """
        kv.init(0, np.zeros((4, 3), dtype=np.float32))
        kv.init(1, np.zeros(10, dtype=np.int64))
        for step in range(3):
            kv.push(0, np.full((4, 3), 0.5 * (kv.rank + 1)))          # float64
            kv.push(1, np.full(10, 2.0 + kv.rank, dtype=np.float32))
            a = np.zeros((4, 3))
            b = np.zeros(10, dtype=np.float16)
            kv.pull([0, 1], out=[a, b])
            assert (a == 1.5).all() and (b == 5).all(), (a, b)
            v = np.full((4, 3), 1.0)
            kv.pushpull(0, v)
            assert v.dtype == np.float64 and (v == 2.0).all(), v
        print(f"worker {kv.rank} converted", flush=True)
        """)
    assert code == 0, out
    assert "worker 0 converted" in out and "worker 1 converted" in out, out
