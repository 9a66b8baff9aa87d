//! NAG, AdaGrad and RMSProp: their steps against MXNet's, restated, and their states.

use super::*;

#[test]
fn nag_steps_as_mxnets_nag_mom_update() {
    // MXNet's nag_mom_update (src/operator/optimizer_op-inl.h, NAGMomKernel), restated in its
    // order for float64 weights: the momentum decays, the weight moves by it and by
    // (1 + momentum) times the step, then the step joins the momentum, with the weight decay
    // of the new weight (MXNet's NAG runs the kernel with out=weight: it reads the weight
    // back after writing it).
    let (lr, mom, wd, rescale, clip) = (0.1, 0.9, 0.01, 0.5, 0.8);
    let opt = Optimizer::nag(lr)
        .momentum(mom)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip);
    let mut u = OptimizerUpdater::new(opt);
    let mut w = NDArray::from_vec(&[3], vec![1.0f64, -2.0, 0.5]).unwrap();
    let (mut want_w, mut want_m) = ([1.0f64, -2.0, 0.5], [0.0f64; 3]);
    for step in 0..4 {
        let grads = [3.0 - step as f64, -0.4 * step as f64, 1.0];
        let g = NDArray::from_vec(&[3], grads.to_vec()).unwrap();
        u.update(&Key::Int(0), &g, &mut w).unwrap();
        for i in 0..3 {
            let (w0, cg) = (want_w[i], (rescale * grads[i]).clamp(-clip, clip));
            want_m[i] *= mom;
            want_w[i] = w0 - want_m[i] + (mom + 1.0) * (want_m[i] - lr * (cg + wd * w0));
            want_m[i] -= lr * (cg + wd * want_w[i]);
        }
        assert_eq!(w.to_vec::<f64>().unwrap(), want_w, "step {step}");
    }
    // Without momentum it is SGD, as MXNet's NAG.
    let mut nag = OptimizerUpdater::new(Optimizer::nag(0.1).wd(0.5));
    let mut sgd = OptimizerUpdater::new(Optimizer::sgd(0.1).wd(0.5));
    let (mut a, mut b) = (NDArray::ones(&[2]), NDArray::ones(&[2]));
    for _ in 0..3 {
        nag.update(&Key::Int(0), &NDArray::ones(&[2]), &mut a)
            .unwrap();
        sgd.update(&Key::Int(0), &NDArray::ones(&[2]), &mut b)
            .unwrap();
    }
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    // As MXNet's NAG: a key whose momentum was 0 at its first update has no momentum state
    // and runs sgd_update, which takes no momentum: once a momentum is set, its updates are
    // refused (MXNet's kernel refuses the argument), changing nothing; a key first updated
    // after that gets the state and moves by nag_mom_update.
    nag.retune(Optimizer::nag(0.1).wd(0.5).momentum(0.9))
        .unwrap();
    let mut fresh = NDArray::ones(&[2]);
    let before = (a.to_vec::<f32>().unwrap(), nag.state[&Key::Int(0)].t);
    for _ in 0..2 {
        let one = NDArray::ones(&[2]);
        let e = nag
            .update(&Key::Int(0), &one, &mut a)
            .expect_err("no momentum state");
        assert!(e.to_string().contains("NAG has no momentum state"), "{e}");
        nag.update(&Key::Int(1), &one, &mut fresh).unwrap();
    }
    assert_eq!(
        (a.to_vec::<f32>().unwrap(), nag.state[&Key::Int(0)].t),
        before
    );
    assert_eq!(nag.state[&Key::Int(0)].m.size(), 0);
    assert_eq!(nag.state[&Key::Int(1)].m.size(), 2);
    // Step 1 from 1: m = -0.1 * (1 + 0.5), w = 1 - 0 + 1.9 * m; step 2 as the formula above.
    let (mut w, mut m) = (1.0f64, 0.0f64);
    for _ in 0..2 {
        let w0 = w;
        m *= 0.9;
        w = w0 - m + 1.9 * (m - 0.1 * (1.0 + 0.5 * w0));
        w = f64::from(w as f32);
        m -= 0.1 * (1.0 + 0.5 * w);
    }
    let got = fresh.to_vec::<f32>().unwrap();
    assert!((f64::from(got[0]) - w).abs() < 1e-6, "{got:?} against {w}");
    // Its state is saved, and only a NAG takes it.
    let saved = u.save_states();
    assert!(OptimizerUpdater::new(Optimizer::sgd(0.1))
        .load_states(&saved)
        .is_err());
    let mut back = OptimizerUpdater::new(Optimizer::nag(0.3));
    assert!(!back.load_states(&saved).unwrap());
}

#[test]
fn adagrad_steps_as_mxnets_adagrad() {
    // MXNet 1.9's AdaGrad.update (python/mxnet/optimizer/optimizer.py, dense), restated for
    // float64 weights: the history grows by the square of the rescaled, clipped gradient, and
    // the weight moves by lr times (gradient / sqrt(history + eps) + wd * weight).
    let (lr, eps, wd, rescale, clip) = (0.1, 1e-7, 0.01, 0.5, 0.8);
    let opt = Optimizer::adagrad(lr)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip);
    assert_eq!(
        opt,
        Optimizer::adagrad(lr)
            .epsilon(eps)
            .wd(wd)
            .rescale_grad(rescale)
            .clip_gradient(clip)
    );
    let mut u = OptimizerUpdater::new(opt);
    let mut w = NDArray::from_vec(&[3], vec![1.0f64, -2.0, 0.5]).unwrap();
    let (mut want_w, mut hist) = ([1.0f64, -2.0, 0.5], [0.0f64; 3]);
    for step in 0..4 {
        let grads = [3.0 - step as f64, -0.4 * step as f64, 1.0];
        let g = NDArray::from_vec(&[3], grads.to_vec()).unwrap();
        u.update(&Key::Int(0), &g, &mut w).unwrap();
        for i in 0..3 {
            let cg = (rescale * grads[i]).clamp(-clip, clip);
            hist[i] += cg * cg;
            let div = cg / (hist[i] + eps).sqrt();
            want_w[i] += (div + want_w[i] * wd) * -lr;
        }
        assert_eq!(w.to_vec::<f64>().unwrap(), want_w, "step {step}");
    }
    // The first step of a plain AdaGrad moves each weight by about lr against its gradient.
    let mut plain = OptimizerUpdater::new(Optimizer::adagrad(0.5));
    let mut a = NDArray::from_vec(&[2], vec![1.0f32, 1.0]).unwrap();
    let g = NDArray::from_vec(&[2], vec![4.0f32, -0.25]).unwrap();
    plain.update(&Key::Int(1), &g, &mut a).unwrap();
    let got = a.to_vec::<f32>().unwrap();
    assert!(
        (got[0] - 0.5).abs() < 1e-6 && (got[1] - 1.5).abs() < 1e-5,
        "{got:?}"
    );
    // Its state is saved, and only an AdaGrad takes it.
    let saved = u.save_states();
    assert!(OptimizerUpdater::new(Optimizer::rmsprop(0.1))
        .load_states(&saved)
        .is_err());
    let mut back = OptimizerUpdater::new(Optimizer::adagrad(0.3));
    assert!(!back.load_states(&saved).unwrap());
    let g = NDArray::from_vec(&[3], vec![1.0f64, 1.0, 1.0]).unwrap();
    let mut w2 = w.clone();
    u.update(&Key::Int(0), &g, &mut w).unwrap();
    back.retune(
        Optimizer::adagrad(lr)
            .wd(wd)
            .rescale_grad(rescale)
            .clip_gradient(clip),
    )
    .unwrap();
    back.update(&Key::Int(0), &g, &mut w2).unwrap();
    assert_eq!(w.to_vec::<f64>().unwrap(), w2.to_vec::<f64>().unwrap());
}

#[test]
fn rmsprop_steps_as_mxnets_rmsprop_update() {
    // MXNet's rmsprop_update (src/operator/optimizer_op-inl.h, RMSPropUpdateKernel),
    // restated for float64 weights: weight decay joins the rescaled gradient before the clip,
    // the average decays by gamma1, and the new weight is clipped to clip_weights.
    let (lr, g1, eps, wd, rescale, clip, cw) = (0.05, 0.8, 1e-8, 0.02, 0.5, 0.9, 1.05);
    let opt = Optimizer::rmsprop(lr)
        .gamma1(g1)
        .epsilon(eps)
        .wd(wd)
        .rescale_grad(rescale)
        .clip_gradient(clip)
        .clip_weights(cw);
    let mut u = OptimizerUpdater::new(opt.clone());
    let mut w = NDArray::from_vec(&[3], vec![1.0f64, -2.0, 0.5]).unwrap();
    let (mut want_w, mut n) = ([1.0f64, -2.0, 0.5], [0.0f64; 3]);
    for step in 0..4 {
        let grads = [3.0 - step as f64, -0.4 * step as f64, 1.0];
        let g = NDArray::from_vec(&[3], grads.to_vec()).unwrap();
        u.update(&Key::Int(0), &g, &mut w).unwrap();
        for i in 0..3 {
            let cg = (rescale * grads[i] + wd * want_w[i]).clamp(-clip, clip);
            n[i] = (1.0 - g1) * (cg * cg) + g1 * n[i];
            want_w[i] = (want_w[i] - lr * (cg / (n[i] + eps).sqrt())).clamp(-cw, cw);
        }
        assert_eq!(w.to_vec::<f64>().unwrap(), want_w, "step {step}");
        if step == 0 {
            // -2.0 was clipped to the weights' bound.
            assert_eq!(want_w[1], -cw);
        }
    }
    assert_eq!(Optimizer::decode(&opt.encode()).unwrap(), opt);
    assert_eq!(opt.name(), "rmsprop");
    let ag = Optimizer::adagrad(0.3).epsilon(1e-6).clip_gradient(2.0);
    assert_eq!(Optimizer::decode(&ag.encode()).unwrap(), ag);
}

#[test]
fn rmsprop_clips_only_where_asked_and_its_state_continues_exactly() {
    let grads = |s: usize| NDArray::from_vec(&[3], vec![40.0f64 - s as f64, -30.0, 0.25]);
    let run = |o: Optimizer| {
        let mut u = OptimizerUpdater::new(o);
        let mut w = NDArray::from_vec(&[3], vec![1.0f64, -2.0, 0.5]).unwrap();
        for s in 0..3 {
            u.update(&Key::Int(0), &grads(s).unwrap(), &mut w).unwrap();
        }
        (u, w.to_vec::<f64>().unwrap())
    };
    // A clip of 0 or less is none (MXNet passes neither when it is 0, and its kernel clips
    // only at 0 or more).
    let plain = run(Optimizer::rmsprop(0.5)).1;
    assert_eq!(
        run(Optimizer::rmsprop(0.5)
            .clip_gradient(0.0)
            .clip_weights(-1.0))
        .1,
        plain
    );
    assert_ne!(run(Optimizer::rmsprop(0.5).clip_gradient(0.5)).1, plain);
    let clipped = run(Optimizer::rmsprop(0.5).clip_weights(0.75)).1;
    assert!(clipped.iter().all(|x| x.abs() <= 0.75) && clipped != plain);
    // Saved and loaded, the state goes on as it would have.
    let (mut u, _) = run(Optimizer::rmsprop(0.5).gamma1(0.7));
    let mut back = OptimizerUpdater::new(Optimizer::rmsprop(0.5).gamma1(0.7));
    assert!(!back.load_states(&u.save_states()).unwrap());
    let mut a = NDArray::from_vec(&[3], vec![0.1f64, 0.2, 0.3]).unwrap();
    let mut b = a.clone();
    u.update(&Key::Int(0), &grads(5).unwrap(), &mut a).unwrap();
    back.update(&Key::Int(0), &grads(5).unwrap(), &mut b)
        .unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
}

#[test]
fn adagrad_and_rmsprop_take_a_keys_multipliers() {
    for (base, doubled) in [
        (
            Optimizer::adagrad(0.1).wd(0.2),
            Optimizer::adagrad(0.2).wd(0.0),
        ),
        (
            Optimizer::rmsprop(0.1).wd(0.2),
            Optimizer::rmsprop(0.2).wd(0.0),
        ),
    ] {
        // Key 7's rate doubled and its weight decay gone, as another optimizer's for all keys.
        let mut m = OptimizerUpdater::new(base.lr_mult(7, 2.0).wd_mult(7, 0.0));
        let mut d = OptimizerUpdater::new(doubled);
        let (mut a, mut b) = (NDArray::ones(&[4]), NDArray::ones(&[4]));
        for _ in 0..3 {
            let g = NDArray::full(&[4], 0.5);
            m.update(&Key::Int(7), &g, &mut a).unwrap();
            d.update(&Key::Int(7), &g, &mut b).unwrap();
        }
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert_ne!(a.to_vec::<f32>().unwrap(), vec![1.0; 4]);
    }
}

/// Adam and Adamax with `beta1 = 1` (or Adam with `beta2` above 1): the bias correction is
/// not a number, and the step is refused with the weight unchanged (MXNet's Python raises).
/// Before, the weight silently became NaN.
#[test]
fn a_bias_correction_that_is_not_a_number_is_refused() {
    for opt in [
        Optimizer::adam(0.1).beta1(1.0),
        Optimizer::adamax(0.1).beta1(1.0),
        Optimizer::adam(0.1).beta2(1.5),
    ] {
        let mut u = OptimizerUpdater::new(opt.clone());
        let mut w = NDArray::from_vec(&[2], vec![1.0f32, -2.0]).unwrap();
        let err = u
            .update(&Key::Int(3), &NDArray::ones(&[2]), &mut w)
            .unwrap_err();
        assert!(
            matches!(&err, KvError::Updater { key: Key::Int(3), reason } if reason.contains("bias-corrected learning rate at step 1")),
            "{opt:?}: {err}"
        );
        assert_eq!(w.to_vec::<f32>().unwrap(), [1.0, -2.0], "{opt:?}");
    }
    // Sound betas step as ever.
    let mut u = OptimizerUpdater::new(Optimizer::adam(0.1).beta1(0.5));
    let mut w = NDArray::from_vec(&[1], vec![1.0f32]).unwrap();
    u.update(&Key::Int(0), &NDArray::ones(&[1]), &mut w)
        .unwrap();
    assert!(w.to_vec::<f32>().unwrap()[0] < 1.0);
}
