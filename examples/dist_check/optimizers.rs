//! The built-in optimizers on the servers, each against a local store running the same
//! optimizer on the same summed gradients: SGD with multipliers, NAG, AdaGrad, RMSProp and the
//! rest on sliced keys, multi_precision on a float16 key, Adam with a scheduler.

use kvstore::{create, DType, KVStore, LrScheduler, NDArray, Optimizer};

use crate::{arange, expect_vals, fail, ok, pulled, SHAPE};

pub(crate) fn optimizers(kv: &mut KVStore) {
    let w = kv.num_workers();
    // The sliced key learns twice as fast, without weight decay, on every server.
    let sgd = Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
        wd: 0.01,
        rescale_grad: 1.0 / w as f64,
        clip_gradient: 0.0,
    }
    .lr_mult(6, 2.0)
    .wd_mult(6, 0.0);
    // The reference: a local store with the same optimizer, fed the same summed gradients.
    let mut reference = create("local").unwrap();
    // Set before the keys are initialised (as MXNet's Trainer does): the servers get key 6's
    // multipliers at its init.
    ok("set_optimizer", kv.set_optimizer(sgd.clone()));
    ok("ref optimizer", reference.set_optimizer(sgd));
    let init = NDArray::ones(&[3, 4]);
    let bigw = arange(600, 0.5, DType::F32);
    ok("init", kv.init([4, 6], vec![&init, &bigw]));
    ok("ref init", reference.init([4, 6], vec![&init, &bigw]));
    for step in 0..5 {
        let g = NDArray::full(&[3, 4], (kv.rank() + step) as f64);
        let gb = NDArray::full(&[600], (kv.rank() + 1) as f64);
        let mut out = NDArray::zeros(&[3, 4]);
        ok("pushpull sgd", kv.pushpull(4, &g, &mut out));
        ok("push sgd big", kv.push(6, &gb));
        let all: Vec<NDArray> = (0..w)
            .map(|r| NDArray::full(&[3, 4], (r + step) as f64))
            .collect();
        let allb: Vec<NDArray> = (0..w)
            .map(|r| NDArray::full(&[600], (r + 1) as f64))
            .collect();
        ok("ref push", reference.push([4, 6], &vec![all, allb]));
        expect_vals(
            "sgd step",
            &out,
            &pulled(&mut reference, 4, &[3, 4], DType::F32).to_f64_vec(),
        );
        expect_vals(
            "sgd step on a sliced key",
            &pulled(kv, 6, &[600], DType::F32),
            &pulled(&mut reference, 6, &[600], DType::F32).to_f64_vec(),
        );
    }
    // Plain SGD lr 0.1 on ones from every worker, rescaled by 1/W: -0.1 whatever W (MXNet);
    // -0.2 for key 12, whose learning rate is doubled.
    let plain = Optimizer::sgd(0.1).rescale_grad(1.0 / w as f64);
    ok(
        "init 8, 12",
        kv.init(
            [8, 12],
            vec![&NDArray::zeros(&SHAPE), &NDArray::zeros(&SHAPE)],
        ),
    );
    ok("sgd plain", kv.set_optimizer(plain.lr_mult(12, 2.0)));
    ok(
        "push 8, 12",
        kv.push(
            [8, 12],
            vec![&NDArray::ones(&SHAPE), &NDArray::ones(&SHAPE)],
        ),
    );
    for (key, want) in [(8, -0.1), (12, -0.2)] {
        let got = pulled(kv, key, &SHAPE, DType::F32).to_f64_vec();
        if got.iter().any(|&x| (x - want).abs() > 1e-7) {
            fail(format!("sgd on ones, key {key}: {got:?}"));
        }
    }
    // A call with a key of an integer dtype, which the optimizer cannot update: refused before
    // any key is sent, so key 8 keeps its value (as a local store refuses it).
    let ints = NDArray::zeros_dtype(&SHAPE, DType::I32);
    ok("init 13", kv.init(13, &ints));
    match kv.push([8, 13], vec![&NDArray::ones(&SHAPE), &ints]) {
        Err(kvstore::KvError::Updater { reason, .. }) if reason.contains("float dtype") => {}
        other => fail(format!("a push with an integer key under SGD: {other:?}")),
    }
    let got = pulled(kv, 8, &SHAPE, DType::F32).to_f64_vec();
    if got.iter().any(|&x| (x + 0.1).abs() > 1e-7) {
        fail(format!("key 8 after a refused push: {got:?}"));
    }
    // NAG with momentum on a sliced key, against the same reference.
    let nag = Optimizer::nag(0.05).momentum(0.9).wd(0.01);
    let mut reference = create("local").unwrap();
    ok("nag", kv.set_optimizer(nag.clone()));
    ok("ref nag", reference.set_optimizer(nag));
    ok("init 16", kv.init(16, &bigw));
    ok("ref init 16", reference.init(16, &bigw));
    for step in 0..3 {
        let g = |r: usize| NDArray::full(&[600], (r + step) as f64 - 1.0);
        ok("push nag", kv.push(16, &g(kv.rank())));
        let all: Vec<NDArray> = (0..w).map(g).collect();
        ok("ref push nag", reference.push(16, &all));
    }
    expect_vals(
        "nag on a sliced key",
        &pulled(kv, 16, &[600], DType::F32),
        &pulled(&mut reference, 16, &[600], DType::F32).to_f64_vec(),
    );
    // AdaGrad, RMSProp (some weights clipped), AdaDelta, Adamax, Signum, FTRL, centered
    // RMSProp (nine words on the wire, three states), FTML (three states) and Nadam on sliced
    // keys, against the same reference.
    let others = [
        ("adagrad", Optimizer::adagrad(0.05).wd(0.01), 18),
        (
            "rmsprop",
            Optimizer::rmsprop(0.01).wd(0.01).clip_weights(250.0),
            20,
        ),
        ("adadelta", Optimizer::adadelta().rho(0.8).wd(0.001), 22),
        ("adamax", Optimizer::adamax(0.05).wd(0.001), 24),
        ("signum", Optimizer::signum(0.05).wd_lh(0.01), 26),
        ("ftrl", Optimizer::ftrl(0.5).lamda1(0.5).wd(0.01), 28),
        (
            "centered rmsprop",
            Optimizer::rmsprop(0.01).centered(true).gamma2(0.8),
            30,
        ),
        ("ftml", Optimizer::ftml(0.05).wd(0.01), 32),
        // Each server's momentum schedule moves once a round here (one slice of one key
        // each), as the reference's does.
        (
            "nadam",
            Optimizer::nadam(0.01).wd(0.01).schedule_decay(0.1),
            36,
        ),
    ];
    for (name, opt, key) in others {
        let mut reference = create("local").unwrap();
        ok(name, kv.set_optimizer(opt.clone()));
        ok("ref optimizer", reference.set_optimizer(opt));
        ok("init", kv.init(key, &bigw));
        ok("ref init", reference.init(key, &bigw));
        for step in 0..3 {
            // Sums exact in any order, and never zero (at any number of workers; Adamax would
            // divide by it).
            let g = |r: usize| NDArray::full(&[600], (r + step) as f64 - 0.75);
            ok(name, kv.push(key, &g(kv.rank())));
            let all: Vec<NDArray> = (0..w).map(g).collect();
            ok("ref push", reference.push(key, &all));
        }
        expect_vals(
            name,
            &pulled(kv, key, &[600], DType::F32),
            &pulled(&mut reference, key, &[600], DType::F32).to_f64_vec(),
        );
    }
    // multi_precision on a float16 key cut over the servers: each server keeps the float32
    // master copy of its slice, and the weights are the local reference's.
    let opt = Optimizer::adam(0.02).wd(0.01);
    let mut reference = create("local").unwrap();
    let mut plain = create("local").unwrap();
    ok(
        "multi_precision",
        kv.set_optimizer(opt.clone().multi_precision(true)),
    );
    ok(
        "ref multi_precision",
        reference.set_optimizer(opt.clone().multi_precision(true)),
    );
    ok("plain", plain.set_optimizer(opt));
    let halfw: Vec<half::f16> = (0..600)
        .map(|i| half::f16::from_f32(i as f32 * 0.5))
        .collect();
    let halfw = ok("f16 arange", NDArray::from_vec(&[600], halfw));
    ok("init 34", kv.init(34, &halfw));
    ok("ref init 34", reference.init(34, &halfw));
    ok("plain init 34", plain.init(34, &halfw));
    for step in 0..3 {
        let g = |r: usize| NDArray::full_dtype(&[600], (r + step) as f64 - 0.75, DType::F16);
        ok("push multi_precision", kv.push(34, &g(kv.rank())));
        let all: Vec<NDArray> = (0..w).map(g).collect();
        ok("ref push multi_precision", reference.push(34, &all));
        ok("plain push", plain.push(34, &all));
    }
    let got = pulled(kv, 34, &[600], DType::F16);
    expect_vals(
        "multi_precision on a sliced float16 key",
        &got,
        &pulled(&mut reference, 34, &[600], DType::F16).to_f64_vec(),
    );
    // Without the master copy, steps smaller than half a float16's spacing are lost: the
    // weights differ from those of the same updates without it.
    if got.to_f64_vec() == pulled(&mut plain, 34, &[600], DType::F16).to_f64_vec() {
        fail("multi_precision: the weights are those of updates without a master copy".into());
    }
    // Adam with a learning-rate scheduler (a warm-up to update 3, then halved after updates 2
    // and 3) and
    // counts from 1 (its bias correction too): every server runs it on the keys and slices
    // it holds (key 14 is cut over the servers), each counting its own updates.
    let schedule = LrScheduler::multi_factor([2, 3], 0.5).warmup(3, 0.001);
    let adam = Optimizer::adam(0.01)
        .lr_mult(10, 0.5)
        .lr_scheduler(schedule)
        .begin_num_update(1);
    let mut reference = create("local").unwrap();
    ok("adam", kv.set_optimizer(adam.clone()));
    ok("ref adam", reference.set_optimizer(adam));
    let (small, big) = (NDArray::ones(&[5]), arange(600, 0.5, DType::F32));
    ok("init 10, 14", kv.init([10, 14], vec![&small, &big]));
    ok(
        "ref init 10, 14",
        reference.init([10, 14], vec![&small, &big]),
    );
    for step in 0..4 {
        let g = |r: usize, n: usize| NDArray::full(&[n], (r + step + 1) as f64);
        ok(
            "push adam",
            kv.push([10, 14], vec![&g(kv.rank(), 5), &g(kv.rank(), 600)]),
        );
        let all = |n: usize| (0..w).map(|r| g(r, n)).collect::<Vec<NDArray>>();
        ok(
            "ref push adam",
            reference.push([10, 14], &vec![all(5), all(600)]),
        );
    }
    for (key, n) in [(10, 5), (14, 600)] {
        expect_vals(
            "adam with a scheduler",
            &pulled(kv, key, &[n], DType::F32),
            &pulled(&mut reference, key, &[n], DType::F32).to_f64_vec(),
        );
    }
    let count = reference.optimizer_num_update();
    if !matches!(count, Ok(5)) {
        fail(format!(
            "the reference's num_update after 4 updates from 1: {count:?}"
        ));
    }
}
