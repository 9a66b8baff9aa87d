"""A local store running MXNet's optimizers (set_optimizer): their rules, constructors and
multipliers as MXNet's, the optimizer object run as given, and their states saved and
loaded."""

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt

SHAPE = (2, 3)


def test_optimizers_match_mxnet_rules():
    kv = kvstore.create()
    w0 = np.ones(4, dtype=np.float64)
    kv.init(0, w0)
    kv.set_optimizer(opt.SGD(learning_rate=0.5, momentum=0.9, wd=0.1, rescale_grad=0.5))
    g = np.full(4, 2.0)
    kv.push(0, g)
    out = np.zeros(4)
    kv.pull(0, out=out)
    assert np.allclose(out, 0.45)
    kv.push(0, g)
    kv.pull(0, out=out)
    assert np.allclose(out, 0.45 - 1.0175)

    kv = kvstore.create()
    kv.init(1, np.ones(2))
    kv.set_optimizer(opt.create("adam", learning_rate=0.01))
    kv.push(1, np.array([3.0, -0.5]))
    out = np.zeros(2)
    kv.pull(1, out=out)
    assert np.allclose(out, [0.99, 1.01], atol=1e-6)
    with pytest.raises(TypeError, match="lr_scheduler"):
        opt.SGD(lr_scheduler=object())
    with pytest.raises(TypeError, match="unexpected"):
        opt.Adam(betta1=0.5)
    with pytest.raises(ValueError):
        opt.create("lamb")
    assert opt.SGD().learning_rate == 0.01 and opt.Adam().lr == 0.001


def test_nag_is_mxnet_s_nag_mom_update():
    # MXNet's NAGMomKernel restated in numpy, float64, in its order: run in place (out=weight),
    # it reads the weight back after writing it, so the momentum's weight decay is the new
    # weight's.
    lr, mom, wd, rescale, clip = 0.1, 0.9, 0.01, 0.5, 0.8
    kv = kvstore.create()
    w0 = np.array([1.0, -2.0, 0.5])
    kv.init(0, w0)
    o = opt.create("nag", momentum=mom, learning_rate=lr, wd=wd, rescale_grad=rescale,
                   clip_gradient=clip)
    assert isinstance(o, opt.NAG)
    kv.set_optimizer(o)
    want, m = w0.copy(), np.zeros(3)
    out = np.zeros(3)
    for step in range(4):
        g = np.array([3.0 - step, -0.4 * step, 1.0])
        kv.push(0, g)
        cg = np.clip(rescale * g, -clip, clip)
        m = mom * m
        want = want - m + (mom + 1) * (m - lr * (cg + wd * want))
        m = m - lr * (cg + wd * want)
        kv.pull(0, out=out)
        np.testing.assert_array_equal(out, want)


def test_adagrad_and_rmsprop_are_mxnet_s():
    # MXNet 1.9's AdaGrad.update (dense) and RMSPropUpdateKernel restated in numpy, float64.
    lr, wd, rescale, clip = 0.1, 0.01, 0.5, 0.8
    grads = [np.array([3.0 - s, -0.4 * s, 1.0]) for s in range(4)]
    w0 = np.array([1.0, -2.0, 0.5])

    kv = kvstore.create()
    kv.init(0, w0)
    o = opt.create("adagrad", eps=1e-6, learning_rate=lr, wd=wd, rescale_grad=rescale,
                   clip_gradient=clip)
    assert isinstance(o, opt.AdaGrad) and o.float_stable_eps == 1e-6
    kv.set_optimizer(o)
    want, hist, out = w0.copy(), np.zeros(3), np.zeros(3)
    for step, g in enumerate(grads):
        if step == 2:
            o.float_stable_eps = 0.5  # a local store runs the object: from the next update on
        kv.push(0, g)
        cg = np.clip(rescale * g, -clip, clip)
        hist += cg * cg
        want = want + (cg / np.sqrt(hist + o.float_stable_eps) + want * wd) * -lr
        kv.pull(0, out=out)
        np.testing.assert_array_equal(out, want)

    g1, eps, cw = 0.8, 1e-8, 1.05
    kv = kvstore.create()
    kv.init(0, w0)
    o = opt.RMSProp(learning_rate=lr, gamma1=g1, epsilon=eps, wd=wd, rescale_grad=rescale,
                    clip_gradient=clip, clip_weights=cw)
    kv.set_optimizer(o)
    want, n = w0.copy(), np.zeros(3)
    for g in grads:
        kv.push(0, g)
        cg = np.clip(rescale * g + wd * want, -clip, clip)
        n = (1 - g1) * (cg * cg) + g1 * n
        want = np.clip(want - lr * (cg / np.sqrt(n + eps)), -cw, cw)
        kv.pull(0, out=out)
        np.testing.assert_array_equal(out, want)
    assert opt.create("rmsprop").learning_rate == 0.001
    # The store runs RMSProp not centered: its state cannot become the centered one's.
    with pytest.raises(ValueError, match="centered rmsprop"):
        o.centered = True
    assert o.centered is False
    kv.push(0, grads[0])  # still the same optimizer, running
    cg = np.clip(rescale * grads[0] + wd * want, -clip, clip)
    n = (1 - g1) * (cg * cg) + g1 * n
    want = np.clip(want - lr * (cg / np.sqrt(n + eps)), -cw, cw)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out, want)


def test_optimizers_take_mxnet_s_constructors_and_refuse_what_they_cannot_honour():
    s = opt.SGD(0.9)  # MXNet's SGD(momentum=0.0, lazy_update=True, **kwargs)
    assert (s.momentum, s.lr, s.learning_rate) == (0.9, 0.01, 0.01)
    a = opt.Adam(0.1, 0.8, 0.99, 1e-6, False)
    assert (a.lr, a.beta1, a.beta2, a.epsilon, a.lazy_update) == (0.1, 0.8, 0.99, 1e-6, False)
    b = opt.SGD(momentum=0.5, rescale_grad=0.5, wd=0.1, clip_gradient=2.0, learning_rate=0.2)
    assert (b.rescale_grad, b.wd, b.clip_gradient, b.lr) == (0.5, 0.1, 2.0, 0.2)
    with pytest.raises(TypeError):
        opt.SGD(use_fused_step=True)  # not an argument of MXNet 1.9's optimizers
    with pytest.raises(AttributeError):
        s.learning_rate = 0.5  # read-only, as MXNet's property
    for bad in [{"begin_num_update": -1}, {"param_dict": {0: 1}}, {"sym": object()}]:
        with pytest.raises(ValueError):
            opt.SGD(**bad)


def test_per_parameter_multipliers_as_mxnet_s():
    kv = kvstore.create()
    kv.init([0, 1, 2], [np.ones(2)] * 3)
    # As in MXNet, param_idx2name gives a bias (a name ending in neither _weight nor _gamma)
    # no weight decay; set_lr_mult takes keys or names.
    o = opt.SGD(learning_rate=0.1, wd=0.5,
                param_idx2name={0: "fc1_weight", 1: "fc1_bias", 2: "bn_gamma"})
    assert o.wd_mult == {"fc1_bias": 0.0}
    o.set_lr_mult({"fc1_weight": 2.0, 2: 0.5})
    kv.set_optimizer(o)
    kv.push([0, 1, 2], [np.ones(2)] * 3)
    out = [np.zeros(2) for _ in range(3)]
    kv.pull([0, 1, 2], out=out)
    # w - lr * lr_mult * (g + wd * wd_mult * w), from w = 1, g = 1.
    np.testing.assert_allclose([o[0] for o in out], [1 - 0.2 * 1.5, 1 - 0.1, 1 - 0.05 * 1.5])
    # A change to the object's multipliers applies from the next update on, made in place too
    # (MXNet reads the dicts at each update).
    o.set_wd_mult({"fc1_bias": 1.0})
    kv.push(1, np.zeros(2))
    kv.pull(1, out=out[1])
    np.testing.assert_allclose(out[1], (1 - 0.1) * (1 - 0.1 * 0.5))
    o.lr_mult[np.int64(1)] = 0.0
    kv.push(1, np.ones(2))
    before = out[1].copy()
    kv.pull(1, out=out[1])
    np.testing.assert_allclose(out[1], before)
    with pytest.raises(ValueError):
        o.lr_mult["fc1_weight"] = float("nan")
    assert o.lr_mult == {"fc1_weight": 2.0, 2: 0.5, 1: 0.0}
    # The store kept what it ran: key 0 still learns at twice the rate, weight decay 0.5.
    kv.push(0, np.ones(2))
    w0 = out[0].copy()
    kv.pull(0, out=out[0])
    np.testing.assert_allclose(out[0], w0 - 0.2 * (1 + 0.5 * w0))
    # Copies are the copies' own: changing one leaves the store alone.
    import copy
    c = copy.deepcopy(o)
    c.lr_mult["fc1_weight"] = 9.0
    o.lr_mult |= {"fc1_weight": 2.0}
    assert o.lr_mult["fc1_weight"] == 2.0 and c.lr_mult["fc1_weight"] == 9.0
    with pytest.raises(TypeError):
        kv.set_optimizer(opt.SGD(param_idx2name={(0, 1): "w"}))


def test_a_local_store_runs_the_optimizer_object_it_was_given():
    kv = kvstore.create()
    kv.init(0, np.zeros(2))
    o = opt.SGD(momentum=0.5, learning_rate=1.0)
    kv.set_optimizer(o)
    g = np.ones(2)
    out = np.zeros(2)
    kv.push(0, g)  # m = -1, w = -1
    o.set_learning_rate(0.5)
    kv.push(0, g)  # m = 0.5 * -1 - 0.5 = -1, w = -2 (the momentum kept, the new rate used)
    kv.pull(0, out=out)
    assert (out == -2).all(), out
    with pytest.raises(TypeError):
        o.lr = "fast"  # refused by the store: the object keeps what the store runs
    assert o.lr == 0.5
    o.momentum = -1.0  # as MXNet: a momentum that is not positive is plain SGD
    kv.push(0, g)
    kv.pull(0, out=out)
    assert (out == -2.5).all(), out
    # Once the store runs another optimizer, changes to the first are not its own.
    kv.set_optimizer(opt.SGD(learning_rate=0.25))
    o.set_learning_rate(100.0)
    kv.push(0, g)
    kv.pull(0, out=out)
    assert (out == -2.75).all(), out


def test_a_change_to_an_optimizer_the_store_stopped_running_meanwhile_is_not_its_own():
    # Another thread sets another optimizer while this one's parameters are read (Python
    # runs there, and the GIL may pass): made certain here by setting it from the read.
    kv = kvstore.create()
    kv.init(0, np.zeros(2))
    other = opt.SGD(learning_rate=0.25)

    class Switching(opt.SGD):
        switch = False

        def _kvstore_spec(self):
            if Switching.switch:
                Switching.switch = False
                kv.set_optimizer(other)
            return super()._kvstore_spec()

    o = Switching(learning_rate=1.0)
    kv.set_optimizer(o)
    Switching.switch = True
    o.set_learning_rate(100.0)  # before, the store ran `other` with this rate
    out = np.zeros(2)
    kv.push(0, np.ones(2))
    kv.pull(0, out=out)
    assert (out == -0.25).all(), out


def test_optimizer_states_save_and_load(tmp_path):
    def store():
        kv = kvstore.create()
        kv.init(0, np.ones(4))
        kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9))
        return kv
    a = store()
    a.push(0, np.ones(4))
    a.save_optimizer_states(str(tmp_path / "s"), dump_optimizer=True)
    b = store()
    b.load_optimizer_states(tmp_path / "s")
    out_a = np.zeros(4)
    # b's weights differ (fresh), but the momentum it loaded is a's: the step is the same.
    a.pull(0, out=out_a)
    b.push(0, np.zeros(4))
    a.push(0, np.zeros(4))
    a_after, b_after = np.zeros(4), np.zeros(4)
    a.pull(0, out=a_after)
    b.pull(0, out=b_after)
    assert np.allclose(out_a - a_after, 1.0 - b_after)
    (tmp_path / "bad").write_bytes(b"garbage")
    with pytest.raises(kvstore.KVStoreError, match="optimizer states"):
        b.load_optimizer_states(tmp_path / "bad")
    with pytest.raises(kvstore.KVStoreError):
        kvstore.create().save_optimizer_states(str(tmp_path / "none"))


def test_states_saved_with_the_optimizer_bring_it_back(tmp_path):
    a = kvstore.create()
    a.init(0, np.zeros(2))
    a.set_optimizer(opt.SGD(momentum=0.9, learning_rate=0.1))
    a.push(0, np.ones(2))  # m = -0.1
    a.save_optimizer_states(str(tmp_path / "states"))
    a.save_optimizer_states(str(tmp_path / "dumped"), dump_optimizer=True)

    def store():
        kv = kvstore.create()
        kv.init(0, np.zeros(2))
        o = opt.SGD(momentum=0.9, learning_rate=1.0)
        kv.set_optimizer(o)
        return kv, o
    out = np.zeros(2)
    # The state only: the store's own learning rate stays.
    b, _ = store()
    b.load_optimizer_states(tmp_path / "states")
    b.push(0, np.ones(2))  # m = 0.9 * -0.1 - 1.0 = -1.09
    b.pull(0, out=out)
    assert np.allclose(out, -1.09), out
    # With the optimizer: its learning rate comes back, and the object the store was given
    # is no longer the one it runs.
    c, o = store()
    c.load_optimizer_states(tmp_path / "dumped")
    o.set_learning_rate(100.0)
    c.push(0, np.ones(2))  # m = 0.9 * -0.1 - 0.1 = -0.19
    c.pull(0, out=out)
    assert np.allclose(out, -0.19), out


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork")
def test_a_forked_child_reads_and_sets_its_optimizer_alone():
    # A child made by fork (a DataLoader worker, say) may read and set the optimizer its
    # parent's store runs; the parent's store refuses the child, so the child's object is its
    # own, and the parent's store is unchanged.
    import os
    kv = kvstore.create()
    kv.init(0, np.ones(4))
    o = opt.SGD(learning_rate=0.5, lr_scheduler=kvstore.lr_scheduler.FactorScheduler(step=1,
                                                                                      factor=0.5))
    kv.set_optimizer(o)
    kv.push(0, np.ones(4))
    assert o.num_update == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            msg = f"{o.num_update} {o.learning_rate}"
            o.wd = 0.25
            msg += f" {o.wd}"
        except BaseException as e:  # noqa: BLE001 - said to the parent, which fails
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    msg = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    # In the child: its own count (begin_num_update), as a fresh object's.
    assert msg == f"0 {o.lr_scheduler(0)} 0.25", msg
    kv.push(0, np.ones(4))
    assert o.num_update == 2 and o.wd == 0.0


def test_momentum_rules_as_mxnet_s_sgd_and_nag():
    # A key first updated with momentum 0 has no momentum state: MXNet's sgd_update then
    # refuses a momentum, and so does the store, changing nothing.
    for cls in (opt.SGD, opt.NAG):
        o = cls(learning_rate=1.0)
        kv = kvstore.create()
        kv.init(0, np.zeros(1))
        kv.set_optimizer(o)
        kv.push(0, np.ones(1))
        o.momentum = 0.9
        with pytest.raises(kvstore.KVStoreError, match="no momentum state"):
            kv.push(0, np.ones(1))
        out = np.zeros(1)
        kv.pull(0, out=out)
        assert out[0] == -1.0
    # MXNet's NAG passes a momentum that is not positive as 0: plain steps.
    kv = kvstore.create()
    kv.init(0, np.zeros(1))
    kv.set_optimizer(opt.NAG(learning_rate=1.0, momentum=-0.5))
    for _ in range(3):
        kv.push(0, np.ones(1))
    out = np.zeros(1)
    kv.pull(0, out=out)
    assert out[0] == -3.0


def test_mxnet_s_smaller_optimizer_calls():
    o = opt.SGD()
    # set_lr_mult and set_wd_mult take what dict.update takes, as MXNet's.
    o.set_lr_mult([(0, 2.0), ("b", 0.5)])
    o.set_wd_mult(iter([(1, 0.0)]))
    assert (o.lr_mult, o.wd_mult) == ({0: 2.0, "b": 0.5}, {1: 0.0})
    with pytest.raises(TypeError, match="multipliers"):
        o.set_lr_mult(3)
    # _set_current_context: the update counts of another device.
    o._update_count(0)
    o._set_current_context(1)
    o._update_count(0)
    o._update_count(0)
    assert o._all_index_update_counts == {0: {0: 1}, 1: {0: 2}}


def test_an_optimizer_of_ones_own_warns_of_float16_as_mxnet_s():
    class Plain(opt.Optimizer):
        def update(self, index, weight, grad, state):
            weight[...] -= self._get_lr(index) * grad

    with pytest.warns(UserWarning, match="Accumulating with float16"):
        Plain().create_state_multi_precision(0, np.ones(2, dtype=np.float16))
