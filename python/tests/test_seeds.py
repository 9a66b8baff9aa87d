"""The seeds' tutorial (../shared/seeds/), run as written with np arrays in place of mx.nd
(and ctx= dropped): every value it prints, exactly."""

import numpy as np

import kvstore

SHAPE = (2, 3)


def grid(v):
    return np.full(SHAPE, v)


def test_mxnet_tutorial_local_store(capsys):
    kv = kvstore.create('local')  # create a local kv store.
    shape = (2, 3)
    kv.init(3, np.ones(shape) * 2)
    a = np.zeros(shape)
    kv.pull(3, out=a)
    assert (a == grid(2)).all()
    print(a)
    assert capsys.readouterr().out == "[[2. 2. 2.]\n [2. 2. 2.]]\n"

    kv.push(3, np.ones(shape) * 8)
    kv.pull(3, out=a)  # pull out the value
    assert (a == grid(8)).all()

    contexts = range(4)
    b = [np.ones(shape) for _ in contexts]
    kv.push(3, b)
    kv.pull(3, out=a)
    assert (a == grid(4)).all()

    def update(key, input, stored):
        print("update on key: %d" % key)
        stored += input * 2
    kv._set_updater(update)
    kv.pull(3, out=a)
    assert (a == grid(4)).all()
    assert capsys.readouterr().out == ""

    kv.push(3, np.ones(shape))
    assert capsys.readouterr().out == "update on key: 3\n"
    kv.pull(3, out=a)
    assert (a == grid(6)).all()

    b = [np.ones(shape) for _ in contexts]
    kv.pull(3, out=b)
    assert (b[1] == grid(6)).all()
    assert all((x == grid(6)).all() for x in b)

    keys = [5, 7, 9]
    kv.init(keys, [np.ones(shape)] * len(keys))
    kv.push(keys, [np.ones(shape)] * len(keys))
    assert capsys.readouterr().out == "update on key: 5\nupdate on key: 7\nupdate on key: 9\n"
    b = [np.zeros(shape)] * len(keys)
    kv.pull(keys, out=b)
    assert (b[1] == grid(3)).all()

    b = [[np.ones(shape) for _ in contexts]] * len(keys)
    kv.push(keys, b)
    assert capsys.readouterr().out == "update on key: 5\nupdate on key: 7\nupdate on key: 9\n"
    kv.pull(keys, out=b)
    assert (b[1][1] == grid(11)).all()
    print(b[1][1])
    assert capsys.readouterr().out == "[[11. 11. 11.]\n [11. 11. 11.]]\n"


def test_notebook_device_store(capsys):
    kv = kvstore.create('device')
    shape = (2, 3)
    kv.init(3, np.ones(shape) * (-2))
    A = np.zeros(shape)
    kv.pull(3, out=A)
    assert repr(A) == "array([[-2., -2., -2.],\n       [-2., -2., -2.]])"

    kv.push(3, np.ones(shape) * (-7))
    kv.pull(3, out=A)
    assert repr(A) == "array([[-7., -7., -7.],\n       [-7., -7., -7.]])"

    contexts = range(3)
    B = [np.ones(shape) for _ in contexts]
    kv.push(3, B)
    kv.pull(3, out=A)
    assert repr(A) == "array([[3., 3., 3.],\n       [3., 3., 3.]])"

    keys = [7, 11, 13, 17]
    values = [np.ones(shape) * (-3)] * len(keys)
    kv.init(keys, values)
    C = [np.zeros(shape)] * len(keys)
    kv.pull(keys, out=C)
    print(C[0])
    assert capsys.readouterr().out == "[[-3. -3. -3.]\n [-3. -3. -3.]]\n"

    D = [[np.ones(shape) * (-0.1) for _ in contexts]] * len(keys)
    kv.push(keys, D)
    kv.pull(keys, out=C)
    assert repr(C[0]) == "array([[-0.3, -0.3, -0.3],\n       [-0.3, -0.3, -0.3]])"

    def update(key, input, stored):
        print("update on key: %d" % key)
        stored += input * 0.01
    kv._set_updater(update)
    kv.pull(3, out=A)
    assert repr(A) == "array([[3., 3., 3.],\n       [3., 3., 3.]])"
    kv.push(3, np.ones(shape) * 5)
    kv.pull(3, out=A)
    assert capsys.readouterr().out == "update on key: 3\n"
    assert np.array_equal(A, grid(3 + 5 * 0.01))
