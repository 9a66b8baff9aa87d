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
    // As MXNet: momentum is used only when positive. A negative one at a key's first update
    // makes its momentum state all the same (MXNet's create_state: a momentum not 0), which
    // a positive momentum later moves.
    let mut u = OptimizerUpdater::new(Optimizer::sgd(1.0).momentum(-0.5));
    let mut w = NDArray::zeros(&[1]);
    u.update(&k, &g, &mut w).unwrap();
    u.update(&k, &g, &mut w).unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), [-2.0]);
    u.retune(Optimizer::sgd(1.0).momentum(0.5)).unwrap();
    u.update(&k, &g, &mut w).unwrap(); // m = 0.5 * 0 - 1, w = -3
    u.update(&k, &g, &mut w).unwrap(); // m = 0.5 * -1 - 1, w = -4.5
    assert_eq!(w.to_vec::<f32>().unwrap(), [-4.5]);
    // A key first updated with momentum 0 has none: a positive momentum later is refused,
    // as MXNet's sgd_update refuses it, and the key is left as it was.
    let mut u = OptimizerUpdater::new(Optimizer::sgd(1.0));
    let mut w = NDArray::zeros(&[1]);
    u.update(&k, &g, &mut w).unwrap();
    u.retune(Optimizer::sgd(1.0).momentum(0.9)).unwrap();
    let e = u.update(&k, &g, &mut w).expect_err("no momentum state");
    assert!(
        matches!(&e, KvError::Updater { reason, .. } if reason.contains("SGD has no momentum state")),
        "{e}"
    );
    assert_eq!(w.to_vec::<f32>().unwrap(), [-1.0]);
    assert_eq!(u.num_update(), 1);
}

#[test]
fn nag_with_a_momentum_not_positive_moves_as_sgd_as_mxnets() {
    // MXNet's NAG passes its momentum to nag_mom_update only where it is positive: a negative
    // one (which made the key's state) steps as plain SGD, keeping a state of -lr * g.
    let k = Key::Int(0);
    let mut nag = OptimizerUpdater::new(Optimizer::nag(1.0).momentum(-0.5));
    let mut w = NDArray::zeros(&[1]);
    for want in [-1.0f32, -2.0, -3.0] {
        nag.update(&k, &NDArray::ones(&[1]), &mut w).unwrap();
        assert_eq!(w.to_vec::<f32>().unwrap(), [want]);
    }
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
    for o in [
        Optimizer::sgd(0.3),
        Optimizer::nag(0.2).momentum(0.9).wd(0.1),
        Optimizer::adam(0.001),
    ] {
        assert_eq!(Optimizer::decode(&o.encode()).unwrap(), o);
    }
    assert!(Optimizer::decode(&[99.0; 8]).is_err());
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
    // Without the optimizer, the loading optimizer's update counts stand, as MXNet keeps them
    // on its optimizer object: a fresh one's bias correction starts again on the loaded
    // moments, from `begin_num_update`, and one that has counted goes on from its count.
    for (begin, fresh) in [
        (0, OptimizerUpdater::new(Optimizer::adam(0.01))),
        (
            10,
            OptimizerUpdater::new(Optimizer::adam(0.01).begin_num_update(10)),
        ),
    ] {
        let mut fresh = fresh;
        assert!(!fresh.load_states(&saved).unwrap());
        assert_eq!(fresh.num_update(), begin);
        assert_eq!(fresh.state[&Key::Int(1)].t, begin);
        assert_eq!(fresh.state[&Key::Int(1)].m, a.state[&Key::Int(1)].m);
        assert_eq!(fresh.state[&Key::Int(1)].v, a.state[&Key::Int(1)].v);
        fresh.update(&Key::Int(1), &g, &mut wa.clone()).unwrap();
        assert_eq!(fresh.state[&Key::Int(1)].t, begin + 1);
    }
    let mut own = OptimizerUpdater::new(Optimizer::adam(0.01));
    for _ in 0..3 {
        own.update(&Key::Int(1), &g, &mut wa.clone()).unwrap();
    }
    own.update(&Key::Int(9), &g, &mut wa.clone()).unwrap();
    assert!(!own.load_states(&saved).unwrap());
    assert_eq!(own.state[&Key::Int(1)].t, 3);
    // A key the file has no state for loses it (as MXNet's states are replaced whole) but
    // keeps its count: its next update makes a fresh state, counted on.
    assert!(!own.state.contains_key(&Key::Int(9)));
    // And a later load that has its state goes on from that count (before, from
    // `begin_num_update`: the kept count was dropped).
    let with_9 = {
        let mut other = OptimizerUpdater::new(Optimizer::adam(0.01));
        other.update(&Key::Int(9), &g, &mut wa.clone()).unwrap();
        other.save_states()
    };
    let mut keep = OptimizerUpdater::new(Optimizer::adam(0.01));
    for _ in 0..2 {
        keep.update(&Key::Int(9), &g, &mut wa.clone()).unwrap();
    }
    assert!(!keep.load_states(&saved).unwrap());
    assert!(!keep.load_states(&with_9).unwrap());
    assert_eq!(keep.state[&Key::Int(9)].t, 2);
    // A file saved with the optimizer keeps that count, where it has no state to carry it:
    // loaded, key 9 goes on from 1 (before, from `begin_num_update`, the count lost).
    let dumped = own.save_states_and_optimizer();
    let mut elsewhere = OptimizerUpdater::new(Optimizer::adam(0.01));
    assert!(elsewhere.load_states(&dumped).unwrap());
    assert_eq!(elsewhere.num_update(), 3);
    assert!(!elsewhere.state.contains_key(&Key::Int(9)));
    assert_eq!(elsewhere.save_states(), own.save_states());
    elsewhere.update(&Key::Int(9), &g, &mut wa.clone()).unwrap();
    assert_eq!(elsewhere.state[&Key::Int(9)].t, 2);
    // A file without the optimizer does not bring the saving store's counts.
    let mut plain = OptimizerUpdater::new(Optimizer::adam(0.01));
    assert!(!plain.load_states(&own.save_states()).unwrap());
    plain.update(&Key::Int(9), &g, &mut wa.clone()).unwrap();
    assert_eq!(plain.state[&Key::Int(9)].t, 1);
    // A key counted twice, or both counted and with state, is refused.
    let mut twice = dumped.clone();
    let n = twice.len();
    let entry = twice[n - 17..].to_vec();
    twice[n - 25..n - 17].copy_from_slice(&2u64.to_le_bytes());
    twice.extend_from_slice(&entry);
    assert!(elsewhere.load_states(&twice).is_err());
    own.update(&Key::Int(9), &g, &mut wa.clone()).unwrap();
    assert_eq!(own.state[&Key::Int(9)].t, 2);
    // With the optimizer, the counts come too: the state goes on exactly.
    let mut b = OptimizerUpdater::new(Optimizer::adam(0.01));
    assert!(b.load_states(&a.save_states_and_optimizer()).unwrap());
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

#[test]
fn multipliers_scale_a_keys_learning_rate_and_weight_decay() {
    let opt = Optimizer::sgd(0.1)
        .wd(0.5)
        .lr_mult("b", 2.0)
        .wd_mult("b", 0.0)
        .lr_mult(3, 0.5);
    let mut u = OptimizerUpdater::new(opt);
    // w = 1, g = 1: w - lr * lr_mult * (g + wd * wd_mult * w).
    for (key, want) in [
        (Key::from("a"), 1.0 - 0.1 * 1.5),
        (Key::from("b"), 1.0 - 0.2),
        (Key::Int(3), 1.0 - 0.05 * 1.5),
    ] {
        let mut w = NDArray::ones(&[2]);
        u.update(&key, &NDArray::ones(&[2]), &mut w).unwrap();
        let got = w.to_vec::<f32>().unwrap();
        assert!(
            got.iter().all(|x| (*x as f64 - want).abs() < 1e-7),
            "{key}: {got:?}"
        );
    }
}

#[test]
fn multipliers_travel_by_key_number_and_are_saved_with_a_dumped_optimizer() {
    let opt = Optimizer::adam(0.01).lr_mult(7, 0.5).wd_mult("x", 0.0);
    let mut wire = opt.encode_head();
    let numbered = opt.mults.entries().map(|(k, m)| match k {
        Key::Int(i) => (*i as u64, m),
        Key::Str(_) => (99, m),
    });
    wire.extend(encode_mults(numbered.collect()));
    let got = Optimizer::decode_with_mults(&wire).unwrap();
    assert_eq!(got.opt, opt.opt);
    assert_eq!(got.mults_of(&Key::Int(7)), (0.5, 1.0));
    assert_eq!(got.mults_of(&Key::Int(99)), (1.0, 0.0));
    assert!(Optimizer::decode_with_mults(&wire[..wire.len() - 1]).is_err());
    // The multipliers follow the head: 64 bytes of parameters, the extras' length, and their
    // 10 bytes (no scheduler, count from 0, no multi_precision).
    let at = 64 + 8 + 10;
    let mut twice = wire.clone();
    twice.extend_from_slice(&wire[at..at + 24]);
    assert!(Optimizer::decode_with_mults(&twice).is_err());
    wire[at + 8..at + 16].copy_from_slice(&f64::NAN.to_le_bytes());
    assert!(Optimizer::decode_with_mults(&wire).is_err());
    assert!(Optimizer::sgd(0.1)
        .lr_mult(1, f64::INFINITY)
        .check()
        .is_err());
    // Parameters as much as factors: a server would refuse it, and its own states file
    // could not be read back.
    for opt in [
        Optimizer::sgd(0.1).clip_gradient(f64::INFINITY),
        Optimizer::adam(f64::NAN),
    ] {
        assert!(Multiplied::from(opt).check().is_err());
    }

    let mut u = OptimizerUpdater::new(opt.clone());
    let mut w = NDArray::ones(&[2]);
    u.update(&Key::Int(7), &NDArray::ones(&[2]), &mut w)
        .unwrap();
    let mut other = OptimizerUpdater::new(Optimizer::adam(0.02));
    assert!(other.load_states(&u.save_states_and_optimizer()).unwrap());
    assert_eq!((&other.opt, &other.mults), (&opt.opt, &opt.mults));
    // Without the optimizer, the store's multipliers stay.
    let mut kept = OptimizerUpdater::new(Optimizer::adam(0.02));
    assert!(!kept.load_states(&u.save_states()).unwrap());
    assert_eq!(kept.mults, Mults::default());
    // Files of version 1 (no multipliers), 2 (no scheduler) and 4 (no counts of keys without
    // state) load. A version 5 file: magic, parameters (64), no multipliers (8), no scheduler
    // and count 0 (9), no multi_precision (1), Nadam's schedule (8), no keys (8), no counts (8).
    let v5 = OptimizerUpdater::new(Optimizer::adam(0.01)).save_states();
    assert_eq!(v5.len(), 8 + 64 + 8 + 9 + 1 + 8 + 8 + 8);
    let keys_end = v5.len() - 8;
    let mut v1 = b"KVOPTSD1".to_vec();
    v1.extend_from_slice(&v5[8..72]);
    v1.extend_from_slice(&v5[98..keys_end]);
    assert!(kept.load_states(&v1).unwrap());
    assert_eq!(kept.opt, Optimizer::adam(0.01));
    let mut v2 = b"KVOPTSD2".to_vec();
    v2.extend_from_slice(&v5[8..80]);
    v2.extend_from_slice(&v5[98..keys_end]);
    assert!(kept.load_states(&v2).unwrap());
    assert_eq!(kept.opt, Optimizer::adam(0.01));
    let mut v4 = b"KVOPTSD4".to_vec();
    v4.extend_from_slice(&v5[8..keys_end]);
    assert!(kept.load_states(&v4).unwrap());
    // A version 4 file read as 5 is cut short.
    v4[..8].copy_from_slice(b"KVOPTSD5");
    assert!(kept.load_states(&v4).is_err());
    // A version 2 file with a key's state, without the optimizer: the state and its count.
    let mut two = OptimizerUpdater::new(Optimizer::adam(0.01));
    let mut w = NDArray::ones(&[2]);
    for _ in 0..2 {
        two.update(&Key::Int(4), &NDArray::ones(&[2]), &mut w)
            .unwrap();
    }
    let v5 = two.save_states();
    // Version 4 keeps a third array and a master copy per key (Adam's are empty, their
    // lengths 0 last, before the 0 counts of version 5), and multi_precision and Nadam's
    // schedule before the keys; 2 and 3 do not.
    assert_eq!(v5[v5.len() - 24..], [0; 24]);
    let mut v2 = b"KVOPTST2".to_vec();
    v2.extend_from_slice(&v5[8..80]);
    v2.extend_from_slice(&v5[98..v5.len() - 24]);
    // Loaded without the optimizer, the states come and the counts stay (0 here): what is
    // saved again differs from the file only in the key's count, 8 bytes after its key.
    let counted = |mut b: Vec<u8>| {
        let at = 8 + 64 + 8 + 9 + 1 + 8 + 8 + 9;
        b[at..at + 8].copy_from_slice(&2u64.to_le_bytes());
        b
    };
    let mut loaded = OptimizerUpdater::new(Optimizer::adam(0.5));
    assert!(!loaded.load_states(&v2).unwrap());
    assert_eq!(loaded.num_update(), 0);
    assert_eq!(counted(loaded.save_states())[89..], v5[89..]);
    let mut v3 = b"KVOPTST3".to_vec();
    v3.extend_from_slice(&v5[8..89]);
    v3.extend_from_slice(&v5[98..v5.len() - 24]);
    let mut loaded = OptimizerUpdater::new(Optimizer::adam(0.5));
    assert!(!loaded.load_states(&v3).unwrap());
    assert_eq!(counted(loaded.save_states())[89..], v5[89..]);
    // A version 3 file read as 4 is cut short.
    v3[..8].copy_from_slice(b"KVOPTST4");
    assert!(loaded.load_states(&v3).is_err());
}

#[test]
fn an_update_that_fails_after_the_count_moved_changes_nothing() {
    // A failure after the count moves (on a GPU: out of memory for the state, a launch that
    // fails) leaves the key's count, the optimizer's, Nadam's schedule and the weight as they
    // were; a moment of the wrong dtype, planted here, makes the host's update fail there.
    let key = Key::Int(1);
    let g = NDArray::from_vec(&[2], vec![0.5f32, -0.5]).unwrap();
    let mut u = OptimizerUpdater::new(
        Optimizer::nadam(0.1).lr_scheduler(LrScheduler::factor(1, 0.5).base_lr(0.1)),
    );
    let mut w = NDArray::from_vec(&[2], vec![1.0f32, 2.0]).unwrap();
    u.update(&key, &g, &mut w).unwrap();
    let (kept_w, kept_schedule) = (w.to_vec::<f32>().unwrap(), u.m_schedule);
    assert_ne!(kept_schedule, 1.0);
    let good = std::mem::replace(
        &mut u.state.get_mut(&key).unwrap().m,
        NDArray::zeros_dtype(&[2], DType::F32),
    );
    assert!(u.update(&key, &g, &mut w).is_err());
    assert_eq!(u.state[&key].t, 1);
    assert_eq!(u.num_update(), 1);
    assert_eq!(u.m_schedule, kept_schedule);
    assert_eq!(w.to_vec::<f32>().unwrap(), kept_w);
    // With its state back, the key goes on as one that never failed.
    u.state.get_mut(&key).unwrap().m = good;
    let mut clean = OptimizerUpdater::new(
        Optimizer::nadam(0.1).lr_scheduler(LrScheduler::factor(1, 0.5).base_lr(0.1)),
    );
    let mut w2 = NDArray::from_vec(&[2], vec![1.0f32, 2.0]).unwrap();
    for _ in 0..2 {
        clean.update(&key, &g, &mut w2).unwrap();
    }
    u.update(&key, &g, &mut w).unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), w2.to_vec::<f32>().unwrap());
    assert_eq!(u.num_update(), 2);
}

#[test]
fn float16_weights_without_a_master_copy_are_warned_of_once_as_mxnet_does() {
    use std::sync::{Arc, Mutex};
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let w = buf.clone();
    let sub = tracing_subscriber::fmt()
        .with_writer(move || w.clone())
        .with_ansi(false)
        .finish();
    // Two keys updated twice each: how many warnings.
    let warnings = |opt: Multiplied, dtype: DType| {
        buf.0.lock().unwrap().clear();
        let mut u = OptimizerUpdater::new(opt);
        for _ in 0..2 {
            for k in 0..2 {
                let g = NDArray::full_dtype(&[3], 0.5, dtype);
                let mut w = NDArray::full_dtype(&[3], 1.0, dtype);
                u.update(&Key::Int(k), &g, &mut w).unwrap();
            }
        }
        let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        out.matches("Accumulating with float16 in optimizer")
            .count()
    };
    tracing::subscriber::with_default(sub, || {
        assert_eq!(warnings(Optimizer::sgd(0.1).into(), DType::F16), 1);
        assert_eq!(
            warnings(Optimizer::sgd(0.1).multi_precision(true), DType::F16),
            0
        );
        assert_eq!(warnings(Optimizer::sgd(0.1).into(), DType::F32), 0);
        // (MXNet's check is for float16 only.)
        assert_eq!(warnings(Optimizer::sgd(0.1).into(), DType::BF16), 0);
    });
}

#[test]
fn a_first_update_that_fails_keeps_the_count_a_load_kept() {
    // Key 9 counted 2, then a load without the optimizer took its state but kept its count.
    let g = NDArray::from_vec(&[2], vec![1.0f64, -1.0]).unwrap();
    let mut w = NDArray::from_vec(&[2], vec![1.0f64, 1.0]).unwrap();
    let mut u = OptimizerUpdater::new(Optimizer::adam(0.01));
    for _ in 0..2 {
        u.update(&Key::Int(9), &g, &mut w).unwrap();
    }
    let without_9 = OptimizerUpdater::new(Optimizer::adam(0.01)).save_states();
    assert!(!u.load_states(&without_9).unwrap());
    // A first update that fails (no bias-corrected rate with beta1 1) is all or nothing:
    // the kept count stays (before, it was gone, and the next update counted from 1).
    u.retune(Optimizer::adam(0.01).beta1(1.0)).unwrap();
    assert!(u.update(&Key::Int(9), &g, &mut w).is_err());
    u.retune(Optimizer::adam(0.01)).unwrap();
    u.update(&Key::Int(9), &g, &mut w).unwrap();
    assert_eq!(u.state[&Key::Int(9)].t, 3);
}
