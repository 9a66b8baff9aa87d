//! AdaDelta, Adamax, Signum, FTRL, centered RMSProp and FTML against MXNet 1.9's rules, restated for float64 weights
//! in the order MXNet computes them, so that the values agree exactly.

use crate::{Key, NDArray, Optimizer, OptimizerUpdater};

const W0: [f64; 4] = [1.0, -2.0, 0.5, 0.0];

/// Step `step`'s gradient: of both signs, some clipped, one zero at the first step.
fn grads(step: usize) -> [f64; 4] {
    let s = step as f64;
    [3.0 - s, -0.4 * s, 1.0, 0.25 - 0.5 * s]
}

/// Runs `steps` updates of `opt` on [`W0`] and checks each against `want`, which takes the
/// step's gradient and the expected weights so far (updated in place).
fn check(opt: Optimizer, steps: usize, mut want: impl FnMut(usize, &[f64; 4], &mut [f64; 4])) {
    let mut u = OptimizerUpdater::new(opt.clone());
    let mut w = NDArray::from_vec(&[4], W0.to_vec()).unwrap();
    let mut expect = W0;
    for step in 0..steps {
        let g = grads(step);
        u.update(
            &Key::Int(0),
            &NDArray::from_vec(&[4], g.to_vec()).unwrap(),
            &mut w,
        )
        .unwrap();
        want(step, &g, &mut expect);
        assert_eq!(
            w.to_vec::<f64>().unwrap(),
            expect,
            "{} step {step}",
            opt.name()
        );
    }
    // The parameters cross the wire unchanged, and the state saved goes on exactly in
    // another updater of the same kind.
    assert_eq!(Optimizer::decode(&opt.encode()).unwrap(), opt);
    let mut back = OptimizerUpdater::new(opt.clone().lr(123.0));
    assert!(back.load_states(&u.save_states_and_optimizer()).unwrap());
    let g = NDArray::from_vec(&[4], vec![0.5f64, -0.5, 2.0, -3.0]).unwrap();
    let mut w2 = w.clone();
    u.update(&Key::Int(0), &g, &mut w).unwrap();
    back.update(&Key::Int(0), &g, &mut w2).unwrap();
    assert_eq!(w.to_vec::<f64>().unwrap(), w2.to_vec::<f64>().unwrap());
    let other = if opt.name() == "ftrl" {
        Optimizer::adamax(0.1)
    } else {
        Optimizer::ftrl(0.1)
    };
    assert!(OptimizerUpdater::new(other)
        .load_states(&u.save_states())
        .is_err());
}

fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

#[test]
fn adadelta_steps_as_mxnets_adadelta() {
    // AdaDelta.update: the gradient rescaled and clipped (no weight decay in it); both
    // averages decay by rho; the weight moves by the step plus wd times itself.
    let (rho, eps, wd, rescale, clip) = (0.8, 1e-4, 0.01, 0.5, 0.9);
    let opt = Optimizer::adadelta()
        .rho(rho)
        .epsilon(eps)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip);
    let (mut acc_g, mut acc_d) = ([0.0f64; 4], [0.0f64; 4]);
    check(opt, 4, |_, g, w| {
        for i in 0..4 {
            let cg = (g[i] * rescale).clamp(-clip, clip);
            acc_g[i] = acc_g[i] * rho + (1.0 - rho) * cg * cg;
            let delta = (acc_d[i] + eps).sqrt() / (acc_g[i] + eps).sqrt() * cg;
            acc_d[i] = acc_d[i] * rho + (1.0 - rho) * delta * delta;
            w[i] -= delta + wd * w[i];
        }
    });
    assert_eq!(
        Optimizer::adadelta(),
        Optimizer::AdaDelta {
            lr: 0.01,
            rho: 0.9,
            epsilon: 1e-5,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0
        }
    );
}

#[test]
fn adamax_steps_as_mxnets_adamax() {
    // Adamax.update: weight decay joins the rescaled gradient before the clip; the infinity
    // norm is the larger of its decayed self and the gradient's size; the rate is divided
    // by 1 - beta1^t.
    let (lr, b1, b2, wd, rescale, clip) = (0.1, 0.8, 0.9, 0.02, 0.5, 1.2);
    let opt = Optimizer::adamax(lr)
        .beta1(b1)
        .beta2(b2)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip);
    let (mut m, mut u) = ([0.0f64; 4], [0.0f64; 4]);
    check(opt, 4, |step, g, w| {
        let lr_t = lr / (1.0 - b1.powf((step + 1) as f64));
        for i in 0..4 {
            let cg = (g[i] * rescale + wd * w[i]).clamp(-clip, clip);
            m[i] = m[i] * b1 + (1.0 - b1) * cg;
            u[i] = (b2 * u[i]).max(cg.abs());
            w[i] -= lr_t * m[i] / u[i];
        }
    });
}

#[test]
fn signum_steps_as_mxnets_signum_update_and_signsgd_update() {
    // signum_update: the momentum takes the rescaled, clipped gradient and the weight decay,
    // negated; the weight decays by lr * wd_lh and moves by lr along the momentum's sign.
    let (lr, mom, wd, rescale, clip, wd_lh) = (0.1, 0.7, 0.05, 0.5, 1.0, 0.2);
    let opt = Optimizer::signum(lr)
        .momentum(mom)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip)
        .wd_lh(wd_lh);
    let mut s = [0.0f64; 4];
    check(opt, 4, |_, g, w| {
        for i in 0..4 {
            let cg = (rescale * g[i]).clamp(-clip, clip);
            s[i] = mom * s[i] - (1.0 - mom) * wd * w[i] - (1.0 - mom) * cg;
            w[i] = (1.0 - lr * wd_lh) * w[i] + lr * sign(s[i]);
        }
    });
    // Without the clip, the kernel's other order, (1 - momentum) * rescale * g, which the
    // state shows exactly (the weights see only its sign).
    let (mom, rescale) = (0.7, 0.7);
    let opt = Optimizer::signum(lr)
        .momentum(mom)
        .wd(wd)
        .rescale_grad(rescale);
    let mut u = OptimizerUpdater::new(opt);
    let mut w = NDArray::from_vec(&[4], W0.to_vec()).unwrap();
    let (mut want, mut s) = (W0, [0.0f64; 4]);
    for step in 0..4 {
        let g = grads(step);
        u.update(
            &Key::Int(0),
            &NDArray::from_vec(&[4], g.to_vec()).unwrap(),
            &mut w,
        )
        .unwrap();
        for i in 0..4 {
            s[i] = mom * s[i] - (1.0 - mom) * wd * want[i] - (1.0 - mom) * rescale * g[i];
            want[i] += lr * sign(s[i]);
        }
        assert_eq!(w.to_vec::<f64>().unwrap(), want, "step {step}");
        assert_eq!(
            u.state[&Key::Int(0)].m.to_vec::<f64>().unwrap(),
            s,
            "step {step}"
        );
    }
    // Without momentum, signsgd_update: the gradient's own sign (a zero gradient moves
    // nothing but the decay), and wd as the weight's decay.
    let opt = Optimizer::signum(lr)
        .momentum(0.0)
        .wd(wd)
        .rescale_grad(-3.0)
        .clip_gradient(0.1);
    check(opt, 3, |_, g, w| {
        for i in 0..4 {
            w[i] = (1.0 - lr * wd) * w[i] - lr * sign(g[i]);
        }
    });
    // A negative momentum is none in the kernel, whose state is still kept: each step's
    // sign is the negated gradient's (and weight decay's).
    let opt = Optimizer::signum(lr).momentum(-0.9).wd(wd).wd_lh(wd_lh);
    check(opt, 3, |_, g, w| {
        for i in 0..4 {
            let s = -wd * w[i] - g[i];
            w[i] = (1.0 - lr * wd_lh) * w[i] + lr * sign(s);
        }
    });
}

#[test]
fn a_signum_keys_momentum_state_is_made_at_its_first_update_as_in_mxnet() {
    let g = || NDArray::from_vec(&[2], vec![1.0f64, -2.0]).unwrap();
    let w0 = || NDArray::from_vec(&[2], vec![0.5f64, 0.5]).unwrap();
    // Key 0 starts without momentum (signSGD, no state); the momentum set later gives key 1
    // a state, and key 0, which signSGD runs, refuses it (as MXNet's signsgd_update refuses
    // a momentum), its count unchanged.
    let mut u = OptimizerUpdater::new(Optimizer::signum(0.1).momentum(0.0));
    let (mut a, mut b) = (w0(), w0());
    u.update(&Key::Int(0), &g(), &mut a).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), [0.4, 0.6]);
    u.retune(Optimizer::signum(0.1).momentum(0.5)).unwrap();
    u.update(&Key::Int(1), &g(), &mut b).unwrap();
    assert_eq!(
        u.state[&Key::Int(1)].m.to_vec::<f64>().unwrap(),
        [-0.5, 1.0]
    );
    let err = u.update(&Key::Int(0), &g(), &mut a).unwrap_err();
    assert!(err.to_string().contains("no momentum state"), "{err}");
    assert_eq!(
        (u.state[&Key::Int(0)].t, a.to_vec::<f64>().unwrap()),
        (1, vec![0.4, 0.6])
    );
    // A key that has a state keeps signum_update with the momentum set to 0: weight decay
    // inside the sign, wd_lh's decay outside it.
    let mut u = OptimizerUpdater::new(Optimizer::signum(0.1).momentum(0.5).wd(4.0));
    let mut c = w0();
    u.update(&Key::Int(0), &g(), &mut c).unwrap();
    u.retune(Optimizer::signum(0.1).momentum(0.0).wd(4.0).wd_lh(1.0))
        .unwrap();
    u.update(&Key::Int(0), &g(), &mut c).unwrap();
    // Step 1: s = -0.5 * (4 * 0.5 + g) = [-1.5, 0]; w = [0.4, 0.5]. Step 2 (momentum 0):
    // s = -(4 * w + g) = [-2.6, 0]; w = 0.9 * w + 0.1 * sign(s) = [0.26, 0.45].
    let got = c.to_vec::<f64>().unwrap();
    assert_eq!(got, [0.9 * 0.4 - 0.1, 0.9 * 0.5]);
    // MXNet's Signum without momentum refuses wd_lh at its first update; kvstore at once.
    let mut kv = crate::create("local").unwrap();
    let err = kv
        .set_optimizer(Optimizer::signum(0.1).momentum(0.0).wd_lh(0.1))
        .unwrap_err();
    assert!(err.to_string().contains("wd_lh"), "{err}");
}

#[test]
fn ftrl_steps_as_mxnets_ftrl_update() {
    // FtrlUpdateKernel: z and n accumulate; a weight is 0 while |z| is at most lamda1.
    let (lr, l1, beta, wd, rescale, clip) = (0.2, 0.3, 1.5, 0.01, 0.5, 1.2);
    let opt = Optimizer::ftrl(lr)
        .lamda1(l1)
        .beta(beta)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip);
    let (mut z, mut n) = ([0.0f64; 4], [0.0f64; 4]);
    let mut zeroed = 0;
    check(opt, 4, |_, g, w| {
        for i in 0..4 {
            let cg = (g[i] * rescale).clamp(-clip, clip);
            z[i] += cg - ((n[i] + cg * cg).sqrt() - n[i].sqrt()) * w[i] / lr;
            n[i] += cg * cg;
            w[i] = if z[i].abs() > l1 {
                (sign(z[i]) * l1 - z[i]) / ((beta + n[i].sqrt()) / lr + wd)
            } else {
                zeroed += 1;
                0.0
            };
        }
    });
    // The L1 term zeroed some weights: the test covers both branches.
    assert!(zeroed > 0 && zeroed < 16, "{zeroed}");
}

#[test]
fn the_new_optimizers_take_a_keys_multipliers_and_refuse_a_fractional_kind() {
    for base in [
        Optimizer::adadelta(),
        Optimizer::adamax(0.1),
        Optimizer::signum(0.1),
        Optimizer::ftrl(0.1),
        Optimizer::ftml(0.1),
        Optimizer::rmsprop(0.1).centered(true),
        Optimizer::nadam(0.1),
    ] {
        // A key's lr_mult of 2 and wd_mult of 0 are the optimizer with lr * 2 and no decay.
        let base = base.wd(0.1);
        let lr = base.learning_rate();
        let mut m = OptimizerUpdater::new(base.clone().lr_mult(7, 2.0).wd_mult(7, 0.0));
        let mut plain = OptimizerUpdater::new(base.lr(lr * 2.0).wd(0.0));
        let g = NDArray::from_vec(&[2], vec![0.5f64, -1.5]).unwrap();
        let (mut a, mut b) = (
            NDArray::from_vec(&[2], vec![1.0f64, 2.0]).unwrap(),
            NDArray::from_vec(&[2], vec![1.0f64, 2.0]).unwrap(),
        );
        for _ in 0..2 {
            m.update(&Key::Int(7), &g, &mut a).unwrap();
            plain.update(&Key::Int(7), &g, &mut b).unwrap();
        }
        assert_eq!(a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
    }
    let mut words = Optimizer::ftrl(0.1).encode();
    words[0] = 8.5;
    assert!(Optimizer::decode(&words).is_err());
    assert_eq!(Optimizer::ftrl(1.0).name(), "ftrl");
}

#[test]
fn centered_rmsprop_steps_as_mxnets_rmspropalex_update() {
    // RMSPropAlexUpdateKernel: weight decay joins the rescaled gradient before the clip; the
    // averages of squared gradients and of gradients decay by gamma1, the steps' momentum by
    // gamma2; the new weight is clipped to clip_weights.
    let (lr, g1, g2, eps, wd, rescale, clip, cw) = (0.05, 0.8, 0.7, 1e-6, 0.02, 0.5, 0.9, 1.0);
    let opt = Optimizer::rmsprop(lr)
        .gamma1(g1)
        .epsilon(eps)
        .centered(true)
        .gamma2(g2)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip)
        .clip_weights(cw);
    assert_eq!(opt.encode().len(), 9);
    let (mut n, mut ga, mut delta) = ([0.0f64; 4], [0.0f64; 4], [0.0f64; 4]);
    let mut clipped = false;
    check(opt.clone(), 4, |_, g, w| {
        for i in 0..4 {
            let cg = (g[i] * rescale + wd * w[i]).clamp(-clip, clip);
            n[i] = (1.0 - g1) * cg * cg + g1 * n[i];
            ga[i] = (1.0 - g1) * cg + g1 * ga[i];
            delta[i] = g2 * delta[i] - lr * cg / (n[i] - ga[i] * ga[i] + eps).sqrt();
            let nw = w[i] + delta[i];
            clipped |= nw.abs() > cw;
            w[i] = nw.clamp(-cw, cw);
        }
    });
    assert!(clipped, "the test covers the weights' clip");
    // Both versions are "rmsprop" by name, but the state of one does not go to the other.
    assert_eq!(opt.name(), "rmsprop");
    let plain = opt.clone().centered(false);
    assert_eq!(
        plain,
        Optimizer::rmsprop(lr)
            .gamma1(g1)
            .epsilon(eps)
            .wd(wd)
            .rescale_grad(rescale)
            .clip_gradient(clip)
            .clip_weights(cw)
    );
    assert_eq!(plain.clone().gamma2(0.1), plain);
    let mut u = OptimizerUpdater::new(opt);
    let mut w = NDArray::from_vec(&[4], W0.to_vec()).unwrap();
    u.update(
        &Key::Int(0),
        &NDArray::from_vec(&[4], grads(1).to_vec()).unwrap(),
        &mut w,
    )
    .unwrap();
    let err = OptimizerUpdater::new(plain.clone())
        .load_states(&u.save_states())
        .unwrap_err();
    assert!(err.to_string().contains("centered rmsprop"), "{err}");
    assert!(u.retune(plain).is_err());
    // Nine words for kind 10, eight for the others: any other count is malformed.
    let mut words = Optimizer::rmsprop(0.1).centered(true).encode();
    words.pop();
    assert!(Optimizer::decode(&words).is_err());
    let mut words = Optimizer::rmsprop(0.1).encode();
    words.push(0.0);
    assert!(Optimizer::decode(&words).is_err());
}

#[test]
fn ftml_steps_as_mxnets_ftml_update() {
    // FTMLKernel: weight decay joins the rescaled gradient before the clip; d_t from the
    // bias-corrected root of v; z follows the moving leader; the weight is -z / d_t.
    let (lr, b1, b2, eps, wd, rescale, clip) = (0.05, 0.6, 0.9, 1e-6, 0.02, 0.5, 0.9);
    let opt = Optimizer::ftml(lr)
        .beta1(b1)
        .beta2(b2)
        .epsilon(eps)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip);
    let (mut d, mut v, mut z) = ([0.0f64; 4], [0.0f64; 4], [0.0f64; 4]);
    check(opt, 4, |step, g, w| {
        let t = (step + 1) as f64;
        for i in 0..4 {
            let cg = (rescale * g[i] + wd * w[i]).clamp(-clip, clip);
            v[i] = b2 * v[i] + (1.0 - b2) * (cg * cg);
            let d_t = (1.0 - b1.powf(t)) / lr * ((v[i] / (1.0 - b2.powf(t))).sqrt() + eps);
            z[i] = b1 * z[i] + (1.0 - b1) * cg - (d_t - b1 * d[i]) * w[i];
            d[i] = d_t;
            w[i] = -z[i] / d_t;
        }
    });
    assert_eq!(
        Optimizer::ftml(0.01),
        Optimizer::Ftml {
            lr: 0.01,
            beta1: 0.6,
            beta2: 0.999,
            epsilon: 1e-8,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: 0.0
        }
    );
}

#[test]
fn the_fuzzers_seeds_are_a_centered_rmsprop_body_and_ftmls_saved_states() {
    // tests/fuzz/corpus/protocol/set-optimizer-centered: nine words, no scheduler,
    // multi_precision, key 3's multipliers (2, 1).
    let seed = include_bytes!("../../tests/fuzz/corpus/protocol/set-optimizer-centered");
    let m = Optimizer::decode_with_mults(seed).unwrap();
    assert_eq!(
        m,
        Optimizer::rmsprop(0.01)
            .centered(true)
            .gamma2(0.8)
            .lr_mult(3, 2.0)
            .multi_precision(true)
    );
    // tests/fuzz/corpus/protocol/optimizer-states: version 5 with the optimizer (which the
    // protocol target's Adam then takes), multi_precision, FTML's three arrays and the master
    // copy after one update of key 0, a float16 weight.
    let seed = include_bytes!("../../tests/fuzz/corpus/protocol/optimizer-states");
    let mut u = OptimizerUpdater::new(Optimizer::adam(0.5));
    assert!(u.load_states(seed).unwrap());
    assert_eq!(u.optimizer(), &Optimizer::ftml(0.1));
    assert_eq!(u.num_update(), 1);
    assert!(u.multi_precision);
    assert_eq!(u.state[&Key::Int(0)].master.size(), 2);
    assert_eq!(u.save_states_and_optimizer(), seed);
    // The same saved at version 4 (no counts of keys without state) loads the same.
    let v4 = include_bytes!("../../tests/fuzz/corpus/protocol/optimizer-states-v4");
    let mut old = OptimizerUpdater::new(Optimizer::adam(0.5));
    assert!(old.load_states(v4).unwrap());
    assert_eq!(old.save_states_and_optimizer(), seed);
}

/// MXNet's Nadam.update restated: `schedule` is the optimizer's `m_schedule`, shared by keys.
fn nadam_step(
    (lr, b1, b2, eps, sd, wd, rescale, clip): (f64, f64, f64, f64, f64, f64, f64, f64),
    t: u64,
    schedule: &mut f64,
    g: &[f64; 4],
    w: &mut [f64; 4],
    m: &mut [f64; 4],
    v: &mut [f64; 4],
) {
    let t = t as f64;
    let mom_t = b1 * (1.0 - 0.5 * 0.96f64.powf(t * sd));
    let mom_t_1 = b1 * (1.0 - 0.5 * 0.96f64.powf((t + 1.0) * sd));
    *schedule *= mom_t;
    let next = *schedule * mom_t_1;
    for i in 0..4 {
        let cg = (g[i] * rescale + wd * w[i]).clamp(-clip, clip);
        m[i] = m[i] * b1 + (1.0 - b1) * cg;
        v[i] = v[i] * b2 + (1.0 - b2) * cg * cg;
        let g_prime = cg / (1.0 - *schedule);
        let m_prime = m[i] / (1.0 - next);
        let v_prime = v[i] / (1.0 - b2.powf(t));
        let m_bar = (1.0 - mom_t) * g_prime + mom_t_1 * m_prime;
        w[i] -= lr * m_bar / (v_prime.sqrt() + eps);
    }
}

#[test]
fn nadam_steps_as_mxnets_nadam_with_one_schedule_over_every_key() {
    let p = (0.05, 0.8, 0.9, 1e-6, 0.1, 0.02, 0.5, 0.9);
    let opt = Optimizer::nadam(p.0)
        .beta1(p.1)
        .beta2(p.2)
        .epsilon(p.3)
        .schedule_decay(p.4)
        .wd(p.5)
        .rescale_grad(p.6)
        .clip_gradient(p.7);
    assert_eq!(opt.encode().len(), 9);
    let (mut m, mut v, mut schedule) = ([0.0f64; 4], [0.0f64; 4], 1.0);
    check(opt.clone(), 4, |step, g, w| {
        nadam_step(p, step as u64 + 1, &mut schedule, g, w, &mut m, &mut v);
    });
    // Two keys, updated in turn: the schedule moves at each update, whatever the key (MXNet's
    // m_schedule is the optimizer's), each key's count its own.
    let mut u = OptimizerUpdater::new(opt.clone());
    let mut arrays = [
        NDArray::from_vec(&[4], W0.to_vec()).unwrap(),
        NDArray::from_vec(&[4], W0.to_vec()).unwrap(),
    ];
    let mut want = [(W0, [0.0f64; 4], [0.0f64; 4]); 2];
    let mut schedule = 1.0;
    for step in 0..3 {
        for k in 0..2 {
            let g = grads(step + k);
            let gk = NDArray::from_vec(&[4], g.to_vec()).unwrap();
            u.update(&Key::Int(k as i64), &gk, &mut arrays[k]).unwrap();
            let (w, m, v) = &mut want[k];
            nadam_step(p, step as u64 + 1, &mut schedule, &g, w, m, v);
            assert_eq!(
                arrays[k].to_vec::<f64>().unwrap(),
                *w,
                "key {k} step {step}"
            );
        }
    }
    // Saved with the optimizer, the schedule goes on where it stands, as the update counts
    // do; without it, both stay the loading optimizer's (MXNet keeps them on its optimizer
    // object, which a file of states alone does not carry).
    let mut back = OptimizerUpdater::new(Optimizer::sgd(0.1));
    assert!(back.load_states(&u.save_states_and_optimizer()).unwrap());
    assert_eq!(back.m_schedule, u.m_schedule);
    let mut same = OptimizerUpdater::new(opt);
    assert!(!same.load_states(&u.save_states()).unwrap());
    assert_eq!(same.m_schedule, 1.0);
    assert!(u.m_schedule < 0.5);
    assert_eq!(Optimizer::nadam(0.1).name(), "nadam");
}

#[test]
fn nadams_step_counts_are_each_keys_own_and_its_schedule_the_optimizers() {
    // Key 0 is updated three times before key 1's first update: key 1 runs its step 1 (its
    // own count) with the schedule the four updates made.
    let p = (0.05, 0.8, 0.9, 1e-6, 0.1, 0.0, 1.0, 10.0);
    let opt = Optimizer::nadam(p.0)
        .beta1(p.1)
        .beta2(p.2)
        .epsilon(p.3)
        .schedule_decay(p.4)
        .clip_gradient(p.7);
    let mut u = OptimizerUpdater::new(opt);
    let mut a = NDArray::from_vec(&[4], W0.to_vec()).unwrap();
    let mut b = NDArray::from_vec(&[4], W0.to_vec()).unwrap();
    let (mut wa, mut ma, mut va) = (W0, [0.0f64; 4], [0.0f64; 4]);
    let (mut wb, mut mb, mut vb) = (W0, [0.0f64; 4], [0.0f64; 4]);
    let mut schedule = 1.0;
    for step in 0..3 {
        let g = grads(step);
        let gn = NDArray::from_vec(&[4], g.to_vec()).unwrap();
        u.update(&Key::Int(0), &gn, &mut a).unwrap();
        nadam_step(
            p,
            step as u64 + 1,
            &mut schedule,
            &g,
            &mut wa,
            &mut ma,
            &mut va,
        );
    }
    let g = grads(3);
    let gn = NDArray::from_vec(&[4], g.to_vec()).unwrap();
    u.update(&Key::Int(1), &gn, &mut b).unwrap();
    nadam_step(p, 1, &mut schedule, &g, &mut wb, &mut mb, &mut vb);
    assert_eq!(a.to_vec::<f64>().unwrap(), wa);
    assert_eq!(b.to_vec::<f64>().unwrap(), wb);
    assert_eq!(u.num_update(), 3);
}

#[test]
fn nag_reads_back_the_new_weight_rounded_into_its_dtype() {
    // MXNet's NAGMomKernel on a float16 weight (no master copy) writes the new weight, then
    // reads it back, rounded, for the momentum's weight decay.
    let (lr, mom, wd) = (0.1, 0.9, 0.5);
    let mut u = OptimizerUpdater::new(Optimizer::nag(lr).momentum(mom).wd(wd));
    let f = |x: f32| half::f16::from_f32(x);
    let mut w = NDArray::from_vec(&[2], vec![f(0.3), f(-1.7)]).unwrap();
    let (mut want, mut m) = ([f(0.3), f(-1.7)], [0.0f64; 2]);
    for step in 0..4 {
        let gs = [f(0.5 - step as f32), f(0.25)];
        u.update(
            &Key::Int(0),
            &NDArray::from_vec(&[2], gs.to_vec()).unwrap(),
            &mut w,
        )
        .unwrap();
        for i in 0..2 {
            let (wf, g) = (f64::from(want[i].to_f32()), f64::from(gs[i].to_f32()));
            m[i] *= mom;
            let nw = f((wf - m[i] + (mom + 1.0) * (m[i] - lr * (g + wd * wf))) as f32);
            m[i] -= lr * (g + wd * f64::from(nw.to_f32()));
            want[i] = nw;
        }
        assert_eq!(w.as_slice::<half::f16>().unwrap(), want, "step {step}");
        assert_eq!(
            u.state[&Key::Int(0)].m.to_vec::<f64>().unwrap(),
            m,
            "step {step}"
        );
    }
}
