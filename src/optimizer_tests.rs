//! The optimizers' update rules, states and retuning, checked by hand-computed values.

use super::*;

#[test]
fn sgd_step() {
    let mut u = OptimizerUpdater::new(Optimizer::sgd(0.1));
    let mut w = NDArray::zeros(&[3]);
    u.update(&Key::Int(0), &NDArray::ones(&[3]), &mut w)
        .unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![-0.1; 3]);
}

#[test]
fn sgd_momentum_and_weight_decay() {
    let opt = Optimizer::Sgd {
        lr: 0.5,
        momentum: 0.9,
        wd: 0.1,
        rescale_grad: 0.5,
        clip_gradient: 0.0,
    };
    let mut u = OptimizerUpdater::new(opt);
    let mut w = NDArray::from_vec(&[1], vec![1.0f64]).unwrap();
    let g = NDArray::from_vec(&[1], vec![2.0f64]).unwrap();
    u.update(&Key::Int(0), &g, &mut w).unwrap();
    // m = -0.5 * (1 + 0.1) = -0.55; w = 0.45
    let w1 = w.to_vec::<f64>().unwrap()[0];
    assert!((w1 - 0.45).abs() < 1e-12);
    u.update(&Key::Int(0), &g, &mut w).unwrap();
    // m = 0.9 * -0.55 - 0.5 * (1 + 0.045) = -1.0175; w = 0.45 - 1.0175
    let w2 = w.to_vec::<f64>().unwrap()[0];
    assert!((w2 - (0.45 - 1.0175)).abs() < 1e-12);
}

#[test]
fn a_retune_keeps_the_state_and_negative_momentum_is_plain_sgd() {
    let g = NDArray::ones(&[1]);
    let k = Key::Int(0);
    let mut u = OptimizerUpdater::new(Optimizer::sgd(1.0).momentum(0.5));
    let mut w = NDArray::zeros(&[1]);
    u.update(&k, &g, &mut w).unwrap(); // m = -1, w = -1
    u.retune(Optimizer::sgd(0.5).momentum(0.5)).unwrap();
    u.update(&k, &g, &mut w).unwrap(); // m = 0.5 * -1 - 0.5 = -1, w = -2
    assert_eq!(w.to_vec::<f32>().unwrap(), [-2.0]);
    assert!(matches!(
        u.retune(Optimizer::adam(0.1)),
        Err(KvError::Incompatible(_))
    ));
    assert_eq!(u.optimizer().name(), "sgd");
    // As MXNet: momentum is used only when positive.
    let mut u = OptimizerUpdater::new(Optimizer::sgd(1.0).momentum(-0.5));
    let mut w = NDArray::zeros(&[1]);
    u.update(&k, &g, &mut w).unwrap();
    u.update(&k, &g, &mut w).unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), [-2.0]);
}

#[test]
fn states_saved_with_the_optimizer_bring_it_back() {
    let g = NDArray::ones(&[1]);
    let k = Key::Int(0);
    let mut a = OptimizerUpdater::new(Optimizer::sgd(0.1).momentum(0.9));
    let mut w = NDArray::zeros(&[1]);
    a.update(&k, &g, &mut w).unwrap(); // m = -0.1
                                       // Without the optimizer: the state only, into the same kind.
    let mut b = OptimizerUpdater::new(Optimizer::sgd(1.0).momentum(0.9));
    assert!(!b.load_states(&a.save_states()).unwrap());
    assert_eq!(b.optimizer(), &Optimizer::sgd(1.0).momentum(0.9));
    let mut c = OptimizerUpdater::new(Optimizer::adam(1.0));
    assert!(c.load_states(&a.save_states()).is_err());
    // With it: the state and the optimizer, whatever ran before.
    assert!(c.load_states(&a.save_states_and_optimizer()).unwrap());
    assert_eq!(c.optimizer(), &Optimizer::sgd(0.1).momentum(0.9));
    let mut w = NDArray::zeros(&[1]);
    c.update(&k, &g, &mut w).unwrap(); // m = 0.9 * -0.1 - 0.1 = -0.19
    let got = w.to_vec::<f32>().unwrap()[0];
    assert!((got + 0.19).abs() < 1e-6, "{got}");
}

#[test]
fn adam_first_step_moves_by_lr() {
    let mut u = OptimizerUpdater::new(Optimizer::adam(0.01));
    let mut w = NDArray::from_vec(&[2], vec![1.0f64, 1.0]).unwrap();
    let g = NDArray::from_vec(&[2], vec![3.0f64, -0.5]).unwrap();
    u.update(&Key::Int(1), &g, &mut w).unwrap();
    let w = w.to_vec::<f64>().unwrap();
    assert!((w[0] - 0.99).abs() < 1e-6, "{w:?}");
    assert!((w[1] - 1.01).abs() < 1e-6, "{w:?}");
}

#[test]
fn encoding_round_trips_and_rejects_garbage() {
    for o in [Optimizer::sgd(0.3), Optimizer::adam(0.001)] {
        assert_eq!(Optimizer::decode(&o.encode()).unwrap(), o);
    }
    assert!(Optimizer::decode(&[9.0; 8]).is_err());
    assert!(Optimizer::decode(&[1.0; 3]).is_err());
    assert!(Optimizer::decode(&[1.0, f64::NAN, 0., 0., 0., 0., 0., 0.]).is_err());
}

#[test]
fn builders_set_fields() {
    let o = Optimizer::sgd(0.1).momentum(0.9).wd(1e-4).rescale_grad(0.5);
    assert_eq!(
        o,
        Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.9,
            wd: 1e-4,
            rescale_grad: 0.5,
            clip_gradient: 0.0
        }
    );
    let a = Optimizer::adam(0.01)
        .beta1(0.8)
        .beta2(0.99)
        .epsilon(1e-6)
        .clip_gradient(1.0);
    assert_eq!(a.encode()[1..5], [0.01, 0.8, 0.99, 1e-6]);
    assert_eq!(a.encode()[7], 1.0);
}

#[test]
fn states_round_trip_and_continue_exactly() {
    let g = NDArray::from_vec(&[2], vec![3.0f64, -0.5]).unwrap();
    let mut a = OptimizerUpdater::new(Optimizer::adam(0.01));
    let mut wa = NDArray::from_vec(&[2], vec![1.0f64, 1.0]).unwrap();
    a.update(&Key::Int(1), &g, &mut wa).unwrap();
    a.update(&Key::Str("w".into()), &g, &mut wa.clone())
        .unwrap();
    let saved = a.save_states();
    let mut b = OptimizerUpdater::new(Optimizer::adam(0.01));
    b.load_states(&saved).unwrap();
    let mut wb = wa.clone();
    a.update(&Key::Int(1), &g, &mut wa).unwrap();
    b.update(&Key::Int(1), &g, &mut wb).unwrap();
    assert_eq!(wa.to_vec::<f64>().unwrap(), wb.to_vec::<f64>().unwrap());
    assert_eq!(b.save_states(), a.save_states());
    // Every truncation is an error, and leaves the state alone.
    for n in 0..saved.len() {
        assert!(b.load_states(&saved[..n]).is_err(), "{n} bytes");
    }
    let mut sgd = OptimizerUpdater::new(Optimizer::sgd(0.1).momentum(0.9));
    assert!(sgd.load_states(&saved).is_err());
    assert_eq!(b.save_states(), a.save_states());
}

#[test]
fn integer_weights_are_refused() {
    let mut u = OptimizerUpdater::new(Optimizer::sgd(0.1));
    let mut w = NDArray::zeros_dtype(&[2], crate::DType::I32);
    let g = NDArray::zeros_dtype(&[2], crate::DType::I32);
    assert!(u.update(&Key::Int(0), &g, &mut w).is_err());
}
