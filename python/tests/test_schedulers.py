"""Learning-rate schedulers: MXNet 1.9.1's rates (the expected values are what its
lr_scheduler.py answers for the same arguments), run by a local store where the optimizer runs,
saved with its states, and refused where the store cannot run them."""

import numpy as np
import pytest

import kvstore
from kvstore import lr_scheduler as lrs
from kvstore import optimizer as opt


def test_the_schedulers_give_mxnet_s_rates():
    f = lrs.FactorScheduler(3, 0.9, stop_factor_lr=0.2, base_lr=0.3, warmup_steps=2,
                            warmup_begin_lr=0.1)
    f.base_lr = 0.5  # what an optimizer given learning_rate=0.5 does
    assert [f(n) for n in range(11)] == [0.1, 0.2, 0.5, 0.5, 0.45, 0.45, 0.45, 0.405, 0.405,
                                         0.405, 0.36450000000000005]
    m = lrs.MultiFactorScheduler([2, 5, 6], 0.1, base_lr=0.5)
    assert [m(n) for n in range(8)] == [0.5, 0.5, 0.5, 0.05, 0.05, 0.05, 0.005000000000000001,
                                        0.0005000000000000001]
    p = lrs.PolyScheduler(10, base_lr=0.2, pwr=2, final_lr=0.01, warmup_steps=3,
                          warmup_begin_lr=0.05)
    assert [p(n) for n in (0, 3, 4, 9, 10, 12)] == [0.05, 0.2, 0.14959183673469392,
                                                    0.013877551020408167, 0.01, 0.01]
    c = lrs.CosineScheduler(8, base_lr=0.4, final_lr=0.1, warmup_steps=2,
                            warmup_mode="constant")
    # Past max_update it keeps the rate it last computed (at 7, then at 8).
    assert [c(n) for n in (1, 2, 3, 7, 9, 8, 9)] == [0.0, 0.4, 0.37990381056766587,
                                                     0.1200961894323342, 0.1200961894323342,
                                                     0.1, 0.1]
    assert lrs.FactorScheduler(np.int64(2)).step == 2
    for bad in [lambda: lrs.FactorScheduler(0), lambda: lrs.FactorScheduler(2, factor=2),
                lambda: lrs.MultiFactorScheduler([3, 3]), lambda: lrs.PolyScheduler(0),
                lambda: lrs.CosineScheduler(5, warmup_steps=5),
                lambda: lrs.FactorScheduler(2, base_lr=0.1, warmup_begin_lr=0.2),
                lambda: lrs.FactorScheduler(2, warmup_mode="cubic")]:
        with pytest.raises(ValueError):
            bad()


def running(scheduler):
    """An SGD with ``scheduler`` and a local store running it, with key 0 of two zeros."""
    o = opt.SGD(lr_scheduler=scheduler)
    kv = kvstore.create()
    kv.init(0, np.zeros(2))
    kv.set_optimizer(o)
    return o, kv


def grad_steps(kv, key, n):
    """n pushes of a gradient of -1 (SGD adds the rate at each), then the weight."""
    for _ in range(n):
        kv.push(key, -np.ones(2))
    out = np.zeros(2)
    kv.pull(key, out=out)
    return out


def test_a_local_store_runs_the_scheduler_and_counts_updates_as_mxnet():
    kv = kvstore.create()
    kv.init([0, 1], [np.zeros(2), np.zeros(2)])
    s = lrs.FactorScheduler(step=2, factor=0.5)
    o = opt.SGD(learning_rate=1.0, lr_scheduler=s)
    assert (o.lr, s.base_lr) == (1.0, 1.0)
    kv.set_optimizer(o)
    # Rates 1, 1, 0.5, 0.5 for key 0; key 1's first update comes at num_update 4.
    np.testing.assert_array_equal(grad_steps(kv, 0, 4), 3.0)
    assert o.num_update == 4
    np.testing.assert_array_equal(grad_steps(kv, 1, 1), 0.5)
    assert o.learning_rate == 0.5
    # MXNet refuses set_learning_rate with a scheduler.
    with pytest.raises(UserWarning):
        o.set_learning_rate(0.1)
    # A new scheduler starts from its own state.
    o.lr_scheduler = lrs.MultiFactorScheduler([100], base_lr=2.0)
    np.testing.assert_array_equal(grad_steps(kv, 0, 1), 5.0)
    # One the store cannot run is refused, and the store goes on with the one it runs.
    class Mine(lrs.FactorScheduler):
        def __call__(self, num_update):
            return 0.5

    with pytest.raises(TypeError, match="lr_scheduler"):
        o.lr_scheduler = Mine(2)
    np.testing.assert_array_equal(grad_steps(kv, 0, 1), 7.0)


def test_a_change_to_other_parameters_keeps_the_scheduler_where_it_stands():
    kv = kvstore.create()
    kv.init(0, np.zeros(2))
    o = opt.SGD(learning_rate=0.2, lr_scheduler=lrs.PolyScheduler(4, base_lr=0.2, pwr=1))
    kv.set_optimizer(o)
    # Rates 0.15, 0.1, 0.05, 0, then 0: past max_update a decay keeps the rate it last
    # computed (one started afresh there would give 0.2).
    np.testing.assert_allclose(grad_steps(kv, 0, 5), 0.3, rtol=0, atol=1e-15)
    o.wd = 0.0
    np.testing.assert_allclose(grad_steps(kv, 0, 1), 0.3, rtol=0, atol=1e-15)


def test_a_change_to_the_scheduler_applies_from_the_next_update_as_mxnet_s():
    # MXNet's optimizer calls the scheduler object at every update: a change to it applies to
    # the next update, from the state the updates had reached.
    s = lrs.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    o, kv = running(s)
    # Rates 1, 1, 0.5, 0.5, 0.25 (MXNet's FactorScheduler at updates 1 to 5).
    assert grad_steps(kv, 0, 5)[0] == 3.25
    # The object takes the state the store reached (count 4, base_lr 0.25), then the change.
    s.base_lr = 2.0
    assert (s.count, s.base_lr) == (4, 2.0)
    # Update 6: 2.0; update 7 passes another step: 1.0.
    assert grad_steps(kv, 0, 2)[0] == 3.25 + 3.0
    # Reading the rate, then changing another parameter, does not step the schedule back.
    assert o.learning_rate == 1.0
    o.wd = 0.0
    assert grad_steps(kv, 0, 2)[0] == 3.25 + 3.0 + 1.0 + 0.5
    # A value the store refuses is not kept.
    p = lrs.PolyScheduler(10, base_lr=0.5)
    o2, kv2 = running(p)
    with pytest.raises(ValueError, match="max_steps"):
        p.max_update = 20
    assert p.max_update == 10
    assert grad_steps(kv2, 0, 1)[0] == 0.5 * (1 - 1 / 10) ** 2
    # A copy of the optimizer holds a copy of the scheduler, which changes nothing here.
    import copy
    c = copy.deepcopy(o)
    assert c.lr_scheduler is not s
    c.lr_scheduler.base_lr = 100.0
    assert grad_steps(kv, 0, 1)[0] == 3.25 + 3.0 + 1.0 + 0.5 + 0.5


def test_a_refused_scheduler_change_leaves_the_object_and_the_stores_as_they_were():
    # Refused after the store ran updates: what the catch-up did with the bad value is undone
    # too, and the store keeps its rate.
    s = lrs.FactorScheduler(step=10, factor=0.5, base_lr=1.0)
    o, kv = running(s)
    assert grad_steps(kv, 0, 5)[0] == 5.0
    for bad in (0, -1):
        with pytest.raises((kvstore.KVStoreError, OverflowError), match="step|negative"):
            s.step = bad
        assert (s.step, s.base_lr, s.count) == (10, 1.0, 0)
        assert grad_steps(kv, 0, 1)[0] == 6.0 + (bad == -1)
    # A decay past max_update: the object takes the rate the store kept (the last computed),
    # and a refused change keeps it.
    p = lrs.PolyScheduler(10, base_lr=0.5, final_lr=0.001, pwr=1)
    o2, kv2 = running(p)
    w = grad_steps(kv2, 0, 15)[0]
    with pytest.raises(ValueError, match="max_steps"):
        p.max_update = 20
    assert grad_steps(kv2, 0, 1)[0] == w + 0.001
    p.final_lr = 0.0005  # past max_update the rate stays what it was, as MXNet's object's
    assert (p.base_lr, grad_steps(kv2, 0, 1)[0]) == (0.001, w + 0.002)


def test_a_fenced_store_does_not_hold_up_its_scheduler_in_another_store():
    # A store fenced by a panic runs nothing more: a second store given the same optimizer
    # starts, and the scheduler's rates are read, without asking it.
    s = lrs.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    o, a = running(s)
    grad_steps(a, 0, 3)
    with pytest.raises(BaseException, match="_panic_in_a_call"):
        a._panic_in_a_call(0, np.zeros(2))
    with pytest.raises(RuntimeError):
        a.push(0, np.ones(2))
    b = kvstore.create()
    b.init(0, np.zeros(2))
    b.set_optimizer(o)
    # The fenced store's count is gone with it: the object is where it was before.
    assert (s.base_lr, s.count) == (1.0, 0)
    assert grad_steps(b, 0, 3)[0] == 2.5


def test_threads_reading_and_changing_a_scheduler_leave_it_whole():
    import sys
    import threading
    s = lrs.FactorScheduler(step=3, factor=0.9, base_lr=0.1)
    o, kv = running(s)
    grad_steps(kv, 0, 2)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def read(k):
            for i in range(300):
                s(i % 7 + k)
                o.learning_rate
        threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for _ in range(100):
            s.stop_factor_lr = 1e-8
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not s.__dict__.get("_in_step")
    w = grad_steps(kv, 0, 0)[0]
    s.base_lr = 5.0  # heard by the store: a step of 5 next
    assert grad_steps(kv, 0, 1)[0] == w + 5.0


def test_the_store_runs_the_rates_the_python_objects_give():
    # Random schedulers through a local store (SGD on gradients of -1 adds each rate to the
    # weight, in float64), against the same objects' own rates summed in the same order.
    import copy
    import random
    rng = random.Random(7)
    for _ in range(60):
        kind = rng.choice("fmpc")
        ws = rng.choice([0, 0, 2, 5])
        warm = dict(warmup_steps=ws, warmup_begin_lr=rng.choice([0, 0.001]),
                    warmup_mode=rng.choice(["linear", "constant"]))
        base = rng.choice([0.01, 0.3, 0.1234])
        if kind == "f":
            s = lrs.FactorScheduler(rng.randint(1, 4), rng.choice([0.9, 0.5, 1.0]),
                                    stop_factor_lr=rng.choice([1e-8, 0.05]), base_lr=base,
                                    **warm)
        elif kind == "m":
            s = lrs.MultiFactorScheduler(sorted(rng.sample(range(1, 20), 3)),
                                         rng.choice([0.9, 0.1]), base_lr=base, **warm)
        elif kind == "p":
            s = lrs.PolyScheduler(rng.randint(ws + 1, 20), base_lr=base,
                                  pwr=rng.choice([1, 2, 0.5]),
                                  final_lr=rng.choice([0, 0.001]), **warm)
        else:
            s = lrs.CosineScheduler(rng.randint(ws + 1, 20), base_lr=base,
                                    final_lr=rng.choice([0, 0.001]), **warm)
        begin = rng.choice([0, 3])
        o = opt.SGD(learning_rate=rng.choice([None, 0.7]), lr_scheduler=s,
                    begin_num_update=begin)
        mine = copy.deepcopy(o.lr_scheduler)
        kv = kvstore.create()
        kv.init(0, np.zeros(2))
        kv.set_optimizer(o)
        n = rng.randint(1, 25)
        want = 0.0
        for k in range(1, n + 1):
            want += mine(begin + k)
        got = grad_steps(kv, 0, n)
        assert got[0] == want, (s._spec(), begin, n)


def test_learning_rate_none_takes_the_scheduler_s_and_a_given_one_replaces_it():
    with pytest.warns(UserWarning, match="overwritten"):
        o = opt.SGD(learning_rate=0.3, lr_scheduler=lrs.PolyScheduler(4, base_lr=0.2))
    assert o.lr_scheduler.base_lr == 0.3
    o = opt.SGD(lr_scheduler=lrs.PolyScheduler(4, base_lr=0.2, pwr=1))
    assert o.lr is None and o.learning_rate == 0.2
    kv = kvstore.create()
    kv.init(0, np.zeros(2))
    kv.set_optimizer(o)
    # num_update 1, 2, 3, 4: 0.15, 0.1, 0.05, 0.0.
    np.testing.assert_allclose(grad_steps(kv, 0, 4), 0.3, rtol=0, atol=1e-15)


def test_begin_num_update_starts_adam_s_step_and_the_schedule():
    kv = kvstore.create()
    kv.init(0, np.zeros(1))
    kv.set_optimizer(opt.Adam(learning_rate=0.1, begin_num_update=10))
    kv.push(0, np.ones(1))
    out = np.zeros(1)
    kv.pull(0, out=out)
    lr_t = 0.1 * np.sqrt(1 - 0.999 ** 11) / (1 - 0.9 ** 11)
    np.testing.assert_allclose(out, -lr_t * 0.1 / (np.sqrt(0.001) + 1e-8), rtol=1e-12)


def test_begin_num_update_set_later_starts_the_keys_first_updated_after_it():
    # MXNet's _update_count reads begin_num_update when it first sees a key. Before, a change
    # after set_optimizer was ignored: key 1 took step 1.
    kv = kvstore.create()
    kv.init([0, 1], [np.zeros(1), np.zeros(1)])
    o = opt.Adam(learning_rate=0.1)
    kv.set_optimizer(o)
    kv.push(0, np.ones(1))
    o.begin_num_update = 10
    kv.push(1, np.ones(1))
    out = np.zeros(1)
    for key, t in [(0, 1), (1, 11)]:
        kv.pull(key, out=out)
        lr_t = 0.1 * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        np.testing.assert_allclose(out, -lr_t * 0.1 / (np.sqrt(0.001) + 1e-8), rtol=1e-12)


def test_schedulers_the_store_cannot_run_are_refused():
    class Mine(lrs.FactorScheduler):
        def __call__(self, num_update):
            return 0.5

    with pytest.raises(TypeError, match="lr_scheduler"):
        opt.SGD(lr_scheduler=Mine(2))
    with pytest.raises(TypeError, match="lr_scheduler"):
        opt.SGD(lr_scheduler=lambda n: 0.1)

    class Named(lrs.CosineScheduler):  # the rule kept: it runs
        pass

    assert opt.SGD(lr_scheduler=Named(5)).lr_scheduler.max_update == 5
    with pytest.raises(TypeError):
        opt.SGD(begin_num_update=1.5)
    # Any whole number, as MXNet takes it.
    for n in (np.int64(3), 3.0, np.float32(3)):
        assert opt.SGD(begin_num_update=n).begin_num_update == 3
    with pytest.raises(ValueError):
        opt.SGD(begin_num_update=2**53 + 1)
    # A decay whose attributes no longer agree (changed after it was made) cannot run.
    p = lrs.PolyScheduler(10, warmup_steps=2)
    p.warmup_steps = 3
    with pytest.raises(ValueError, match="make a new one"):
        kvstore.create().set_optimizer(opt.SGD(lr_scheduler=p))
    # What MXNet accepts but would divide by zero is refused up front; a max_update before
    # the warm-up's end runs, as in MXNet.
    with pytest.raises(ValueError):
        lrs.PolyScheduler(5, pwr=-1)
    assert lrs.CosineScheduler(2, base_lr=0.4, warmup_steps=4)(9) == 0.4


def test_the_scheduler_is_saved_with_a_dumped_optimizer(tmp_path):
    kv = kvstore.create()
    kv.init(0, np.zeros(2))
    kv.set_optimizer(opt.SGD(learning_rate=1.0, lr_scheduler=lrs.FactorScheduler(2, 0.5)))
    grad_steps(kv, 0, 3)
    kv.save_optimizer_states(str(tmp_path / "s"), dump_optimizer=True)
    other = kvstore.create()
    other.init(0, np.zeros(2))
    o = opt.SGD(learning_rate=9.0)
    other.set_optimizer(o)
    other.load_optimizer_states(str(tmp_path / "s"))
    # Updates 4 and 5 at rates 0.5 and 0.25, as the saved store would go on.
    np.testing.assert_array_equal(grad_steps(other, 0, 2), 0.75)
    # The store runs the loaded optimizer now, not `o`: its count is not o's.
    assert o.num_update == 0
