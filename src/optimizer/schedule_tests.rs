//! The schedulers against MXNet 1.9.1's `lr_scheduler.py` (the expected rates are what its
//! classes answer for the same arguments, computed with that file), and their place in the
//! optimizers: counts, Adam's step, saved states, the wire.

use super::*;
use crate::{DType, Key, NDArray, OptimizerUpdater};

fn rates(mut s: LrScheduler, upto: u64) -> Vec<f64> {
    (0..upto).map(|n| s.lr(n)).collect()
}

#[test]
fn factor_with_a_linear_warmup_as_mxnet() {
    // FactorScheduler(3, 0.9, stop_factor_lr=0.2, base_lr=0.3, warmup_steps=2,
    // warmup_begin_lr=0.1), in an optimizer with learning_rate=0.5: the warm-up goes to the
    // scheduler's own base_lr, then the optimizer's rate is lowered every 3 updates.
    let s = LrScheduler::factor(3, 0.9)
        .stop_factor_lr(0.2)
        .base_lr(0.3)
        .warmup(2, 0.1)
        .starting_at(0.5);
    let want = [
        0.1,
        0.2,
        0.5,
        0.5,
        0.45,
        0.45,
        0.45,
        0.405,
        0.405,
        0.405,
        0.36450000000000005,
        0.36450000000000005,
        0.36450000000000005,
        0.32805000000000006,
        0.32805000000000006,
        0.32805000000000006,
    ];
    assert_eq!(rates(s.clone(), 16), want);
    // Called first at 15, it passes every step on the way (MXNet's `while`), then stays.
    let mut jump = s;
    assert_eq!(
        (jump.lr(15), jump.lr(4)),
        (0.32805000000000006, 0.32805000000000006)
    );
}

#[test]
fn factor_stops_at_its_floor() {
    let s = LrScheduler::factor(1, 0.5)
        .stop_factor_lr(0.1)
        .starting_at(1.0);
    assert_eq!(rates(s, 7), [1.0, 1.0, 0.5, 0.25, 0.125, 0.1, 0.1]);
}

#[test]
fn multi_factor_as_mxnet() {
    // MultiFactorScheduler([2, 5, 6], 0.1, base_lr=1.0), learning_rate=0.5.
    let s = LrScheduler::multi_factor([2, 5, 6], 0.1)
        .base_lr(1.0)
        .starting_at(0.5);
    let small = 0.0005000000000000001;
    let want = [
        0.5,
        0.5,
        0.5,
        0.05,
        0.05,
        0.05,
        0.005000000000000001,
        small,
        small,
        small,
    ];
    assert_eq!(rates(s, 10), want);
}

#[test]
fn poly_and_cosine_as_mxnet() {
    // PolyScheduler(10, base_lr=0.2, pwr=2, final_lr=0.01, warmup_steps=3,
    // warmup_begin_lr=0.05).
    let poly = LrScheduler::poly(10, 0.2, 2.0)
        .final_lr(0.01)
        .warmup(3, 0.05);
    let want = [
        0.05,
        0.1,
        0.15000000000000002,
        0.2,
        0.14959183673469392,
        0.10693877551020407,
        0.0720408163265306,
        0.04489795918367348,
        0.025510204081632654,
        0.013877551020408167,
        0.01,
        0.01,
        0.01,
    ];
    assert_eq!(rates(poly.clone(), 13), want);
    // Past max_update it keeps the rate it last computed: at first, the optimizer's.
    let mut fresh = poly.starting_at(0.7);
    let got = [fresh.lr(12), fresh.lr(9), fresh.lr(12)];
    assert_eq!(got, [0.7, 0.013877551020408167, 0.013877551020408167]);
    // CosineScheduler(8, base_lr=0.4, final_lr=0.1, warmup_steps=2, warmup_mode='constant').
    let cosine = LrScheduler::cosine(8, 0.4)
        .final_lr(0.1)
        .warmup(2, 0.0)
        .constant_warmup();
    let want = [
        0.0,
        0.0,
        0.4,
        0.37990381056766587,
        0.32500000000000007,
        0.25,
        0.17500000000000004,
        0.1200961894323342,
        0.1,
        0.1,
    ];
    assert_eq!(rates(cosine, 10), want);
}

#[test]
fn what_mxnet_refuses_or_cannot_run_is_refused() {
    let refused = [
        LrScheduler::factor(0, 0.5),
        LrScheduler::factor(2, 1.5),
        LrScheduler::factor(2, f64::NAN),
        LrScheduler::multi_factor([], 0.5),
        LrScheduler::multi_factor([3, 3], 0.5),
        LrScheduler::multi_factor([0, 3], 0.5),
        LrScheduler::poly(0, 0.1, 2.0),
        LrScheduler::cosine(5, 0.1).warmup(5, 0.0),
        LrScheduler::cosine(5, 0.1).warmup(1, 0.2),
        LrScheduler::poly(5, f64::INFINITY, 2.0),
        LrScheduler::poly(5, 0.1, -1.0),
        LrScheduler::multi_factor((1..=1025).collect::<Vec<u64>>(), 0.5),
    ];
    for s in refused {
        assert!(s.check().is_err(), "{s:?}");
        assert!(crate::Optimizer::sgd(0.1).lr_scheduler(s).check().is_err());
    }
    assert!(LrScheduler::multi_factor([1, 3], 0.5).check().is_ok());
    // MXNet runs a decay whose max_update comes before the warm-up's end: past the warm-up
    // the rate stays where it starts.
    let mut early = LrScheduler::cosine(2, 0.4).warmup(4, 0.0).starting_at(0.3);
    assert!(early.check().is_ok());
    assert_eq!(
        [early.lr(3), early.lr(4), early.lr(9)],
        [0.30000000000000004, 0.3, 0.3]
    );
}

#[test]
fn schedulers_travel_and_are_saved_whole() {
    let all = [
        LrScheduler::factor(3, 0.9).warmup(2, 0.001),
        LrScheduler::multi_factor([2, 5, 6], 0.1).constant_warmup(),
        LrScheduler::poly(10, 0.2, 2.0).final_lr(0.01),
        LrScheduler::cosine(8, 0.4),
    ];
    for mut s in all {
        s.lr(7);
        let mut bytes = Vec::new();
        write_extras(&mut bytes, Some(&s), 42);
        let mut r = Reader(&bytes);
        assert_eq!(read_extras(&mut r), Some((Some(s.clone()), 42)));
        assert!(r.0.is_empty());
        for cut in 0..bytes.len() {
            assert_eq!(
                read_extras(&mut Reader(&bytes[..cut])),
                None,
                "{s:?} cut at {cut}"
            );
        }
    }
    let mut bad = Vec::new();
    write_extras(&mut bad, Some(&LrScheduler::factor(3, 0.9)), 0);
    bad[1] = 5; // the scheduler's kind
    assert_eq!(read_extras(&mut Reader(&bad)), None);
}

fn step(u: &mut OptimizerUpdater, key: i64, w: &mut NDArray) {
    let g = NDArray::from_vec(&[1], vec![-1.0f64]).unwrap();
    u.update(&Key::Int(key), &g, w).unwrap();
}

#[test]
fn the_rate_follows_the_most_updates_of_any_key() {
    // SGD with a gradient of -1 adds the rate to the weight at each update.
    let opt = crate::Optimizer::sgd(1.0).lr_scheduler(LrScheduler::factor(2, 0.5));
    let mut u = OptimizerUpdater::new(opt.clone());
    let (mut a, mut b) = (
        NDArray::zeros_dtype(&[1], DType::F64),
        NDArray::zeros_dtype(&[1], DType::F64),
    );
    for _ in 0..4 {
        step(&mut u, 0, &mut a);
    }
    // Key 0 had rates 1, 1, 0.5, 0.5; key 1's first update comes at num_update 4.
    assert_eq!(a.to_vec::<f64>().unwrap(), [3.0]);
    step(&mut u, 1, &mut b);
    assert_eq!(b.to_vec::<f64>().unwrap(), [0.5]);
    assert_eq!(u.num_update(), 4);
    step(&mut u, 0, &mut a);
    assert_eq!((u.num_update(), u.learning_rate()), (5, 0.25));
}

#[test]
fn the_scheduler_it_was_given_goes_on_where_it_stands() {
    // A decay past max_update keeps the rate it last computed (0 here); one started afresh
    // there gives the rate it starts from (the optimizer's, 0.2).
    let opt = crate::Optimizer::sgd(0.2).lr_scheduler(LrScheduler::poly(4, 0.2, 1.0));
    let mut u = OptimizerUpdater::new(opt.clone());
    let mut a = NDArray::zeros_dtype(&[1], DType::F64);
    for _ in 0..5 {
        step(&mut u, 0, &mut a);
    }
    // Rates 0.15, 0.1, 0.05, 0, then 0 (past max_update).
    assert!((a.to_vec::<f64>().unwrap()[0] - 0.3).abs() < 1e-15);
    assert_eq!((u.num_update(), u.learning_rate()), (5, 0.0));
    // Saved and loaded with the optimizer: the counts and the scheduler's state go on.
    let mut other = OptimizerUpdater::new(crate::Optimizer::sgd(9.0));
    assert!(other.load_states(&u.save_states_and_optimizer()).unwrap());
    assert_eq!((other.num_update(), other.learning_rate()), (5, 0.0));
    // The same scheduler given again (a retune of other parameters) goes on.
    u.retune(opt.clone().lr_mult(3, 2.0)).unwrap();
    assert_eq!(u.learning_rate(), 0.0);
    // Another one starts from its own state.
    let other_rule = crate::Optimizer::sgd(0.2).lr_scheduler(LrScheduler::poly(4, 0.2, 2.0));
    u.retune(other_rule).unwrap();
    assert_eq!(u.learning_rate(), 0.2);
    // So does one at another rate, the same rule otherwise (MXNet's new scheduler object).
    u.retune(opt.clone()).unwrap();
    assert_eq!(u.learning_rate(), 0.2);
    // A scheduler stuck at its floor counts the steps left at once: a count from 2^53.
    let far = crate::Optimizer::sgd(1.0)
        .lr_scheduler(LrScheduler::factor(1, 0.5).stop_factor_lr(0.25))
        .begin_num_update(super::MAX_BEGIN);
    let mut u = OptimizerUpdater::new(far);
    step(&mut u, 0, &mut a);
    assert_eq!(u.learning_rate(), 0.25);
    assert!(crate::Optimizer::sgd(0.1)
        .begin_num_update(super::MAX_BEGIN + 1)
        .check()
        .is_err());
}

#[test]
fn begin_num_update_starts_the_counts_and_adams_step() {
    let g = NDArray::from_vec(&[1], vec![1.0f64]).unwrap();
    let mut from_ten = OptimizerUpdater::new(crate::Optimizer::adam(0.1).begin_num_update(10));
    let mut w = NDArray::zeros_dtype(&[1], DType::F64);
    from_ten.update(&Key::Int(0), &g, &mut w).unwrap();
    assert_eq!(from_ten.num_update(), 11);
    // Adam's first step at t = 11: m = 0.1, v = 0.001, lr_t = 0.1 * sqrt(1 - b2^11) /
    // (1 - b1^11).
    let lr_t = 0.1 * (1.0 - 0.999f64.powi(11)).sqrt() / (1.0 - 0.9f64.powi(11));
    let want = -lr_t * 0.1 / (0.001f64.sqrt() + 1e-8);
    assert!((w.to_vec::<f64>().unwrap()[0] - want).abs() < 1e-15);
}

#[test]
fn the_fuzzers_seed_is_a_set_optimizer_body_with_a_scheduler() {
    // tests/fuzz/corpus/protocol/set-optimizer: Adam, multi_factor([2, 3], 0.5) with a
    // 3-update warm-up, counts from 1, key 10's multipliers (0.5, 1).
    let seed = include_bytes!("../../tests/fuzz/corpus/protocol/set-optimizer");
    let m = crate::Optimizer::decode_with_mults(seed).unwrap();
    let want = crate::Optimizer::adam(0.01)
        .lr_mult(10, 0.5)
        .lr_scheduler(LrScheduler::multi_factor([2, 3], 0.5).warmup(3, 0.001))
        .begin_num_update(1);
    assert_eq!(m, want);
}
