//! `multi_precision`: float16 and bfloat16 weights updated through a float32 master copy, as
//! MXNet's `update_multi_precision`, restated step by step.

use half::{bf16, f16};

use crate::{Key, NDArray, Optimizer, OptimizerUpdater};

fn h(xs: &[f32]) -> NDArray {
    NDArray::from_vec(&[xs.len()], xs.iter().map(|&x| f16::from_f32(x)).collect()).unwrap()
}

fn values(a: &NDArray) -> Vec<f32> {
    a.as_slice::<f16>()
        .unwrap()
        .iter()
        .map(|x| x.to_f32())
        .collect()
}

#[test]
fn small_steps_accumulate_in_the_master_copy_and_are_lost_without_it() {
    // At 1.0 a float16 is spaced 2^-10 apart: a step of about 1e-4 rounds back to 1.0 every
    // time, unless the steps add up in float32.
    let (lr, g) = (0.01, h(&[0.01, -0.01]));
    let gv = f64::from(f16::from_f32(0.01).to_f32());
    let mut plain = OptimizerUpdater::new(Optimizer::sgd(lr));
    let mut mp = OptimizerUpdater::new(Optimizer::sgd(lr).multi_precision(true));
    let (mut a, mut b) = (h(&[1.0, 1.0]), h(&[1.0, 1.0]));
    let mut master = [1.0f32, 1.0];
    for step in 0..20 {
        plain.update(&Key::Int(0), &g, &mut a).unwrap();
        mp.update(&Key::Int(0), &g, &mut b).unwrap();
        master[0] = (f64::from(master[0]) - lr * gv) as f32;
        master[1] = (f64::from(master[1]) + lr * gv) as f32;
        let want: Vec<f32> = master.iter().map(|&m| f16::from_f32(m).to_f32()).collect();
        assert_eq!(values(&b), want, "step {step}");
        assert_eq!(
            mp.state[&Key::Int(0)].master.to_vec::<f32>().unwrap(),
            master
        );
    }
    assert_eq!(values(&a), [1.0, 1.0]);
    assert!(values(&b)[0] < 1.0 && values(&b)[1] > 1.0);
    // No state for SGD without momentum beyond the master copy; none at all without it.
    assert_eq!(plain.state[&Key::Int(0)].master.size(), 0);
}

#[test]
fn momentum_and_weight_decay_run_on_the_master_copy_and_bfloat16_takes_one_too() {
    let (lr, mom, wd) = (0.05, 0.9, 0.1);
    let opt = Optimizer::sgd(lr)
        .momentum(mom)
        .wd(wd)
        .multi_precision(true);
    let mut u = OptimizerUpdater::new(opt);
    let mut w = NDArray::from_vec(&[2], vec![bf16::from_f32(0.3), bf16::from_f32(-1.7)]).unwrap();
    let mut master = [bf16::from_f32(0.3).to_f32(), bf16::from_f32(-1.7).to_f32()];
    let mut m = [0.0f64; 2];
    for step in 0..5 {
        let gs = [0.25f32 - 0.1 * step as f32, 0.5];
        let g = NDArray::from_vec(&[2], gs.iter().map(|&x| bf16::from_f32(x)).collect()).unwrap();
        u.update(&Key::Int(1), &g, &mut w).unwrap();
        for i in 0..2 {
            let gi = f64::from(bf16::from_f32(gs[i]).to_f32());
            let wf = f64::from(master[i]);
            m[i] = mom * m[i] - lr * (gi + wd * wf);
            master[i] = (wf + m[i]) as f32;
        }
        let got: Vec<f32> = w
            .as_slice::<bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let want: Vec<f32> = master.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        assert_eq!(got, want, "step {step}");
    }
    // A float32 weight keeps no copy: the flag concerns half types only.
    let mut f = NDArray::from_vec(&[1], vec![1.0f32]).unwrap();
    u.update(
        &Key::Int(2),
        &NDArray::from_vec(&[1], vec![1.0f32]).unwrap(),
        &mut f,
    )
    .unwrap();
    assert_eq!(u.state[&Key::Int(2)].master.size(), 0);
}

#[test]
fn the_master_copy_is_made_at_a_keys_first_update_and_saved_with_the_state() {
    let g = h(&[0.01, 0.02, -0.03]);
    // Key 0 is first updated without multi_precision: it keeps no copy after it is turned on;
    // key 1, first updated after, makes one from its weight.
    let mut u = OptimizerUpdater::new(Optimizer::adam(0.001));
    let (mut a, mut b) = (h(&[1.0, 2.0, 3.0]), h(&[1.0, 2.0, 3.0]));
    u.update(&Key::Int(0), &g, &mut a).unwrap();
    u.retune(Optimizer::adam(0.001).multi_precision(true))
        .unwrap();
    u.update(&Key::Int(0), &g, &mut a).unwrap();
    u.update(&Key::Int(1), &g, &mut b).unwrap();
    assert_eq!(u.state[&Key::Int(0)].master.size(), 0);
    assert_eq!(u.state[&Key::Int(1)].master.size(), 3);
    // Saved and loaded (with the optimizer, multi_precision included), the copy goes on
    // exactly: the next updates agree with the updater that saved them, bit for bit.
    let saved = u.save_states_and_optimizer();
    let mut back = OptimizerUpdater::new(Optimizer::sgd(1.0));
    assert!(back.load_states(&saved).unwrap());
    assert!(back.multi_precision);
    let mut b2 = b.clone();
    for _ in 0..3 {
        u.update(&Key::Int(1), &g, &mut b).unwrap();
        back.update(&Key::Int(1), &g, &mut b2).unwrap();
        assert_eq!(values(&b), values(&b2));
    }
    assert_eq!(
        u.state[&Key::Int(1)].master.to_vec::<f32>().unwrap(),
        back.state[&Key::Int(1)].master.to_vec::<f32>().unwrap()
    );
    // The flag travels with the optimizer.
    let m = Optimizer::adam(0.1).multi_precision(true);
    let wire = m.encode_head();
    assert_eq!(Optimizer::decode_with_mults(&wire).unwrap(), m);
    let mut bad = wire.clone();
    *bad.last_mut().unwrap() = 2;
    assert!(Optimizer::decode_with_mults(&bad).is_err());
}

#[test]
fn nag_with_a_master_copy_takes_mxnets_mp_nag_mom_update_order() {
    // MP_NAGMomKernel: the momentum's weight decay is of the copy just updated (as the kernel
    // without a copy, run in place, reads the weight back), then the copy is rounded into the
    // weight.
    let (lr, mom, wd, rescale) = (0.1, 0.9, 0.5, 0.5);
    let opt = Optimizer::nag(lr)
        .momentum(mom)
        .wd(wd)
        .rescale_grad(rescale)
        .multi_precision(true);
    let mut u = OptimizerUpdater::new(opt);
    let mut w = h(&[1.0, -2.0]);
    let (mut master, mut m) = ([1.0f32, -2.0], [0.0f64; 2]);
    for step in 0..4 {
        let gs = [0.5f32 - step as f32, 0.25];
        let g = h(&gs);
        u.update(&Key::Int(0), &g, &mut w).unwrap();
        for i in 0..2 {
            let gi = f64::from(f16::from_f32(gs[i]).to_f32()) * rescale;
            let wf = f64::from(master[i]);
            m[i] *= mom;
            let nw = (wf - m[i] + (mom + 1.0) * (m[i] - lr * (gi + wd * wf))) as f32;
            m[i] -= lr * (gi + wd * f64::from(nw));
            master[i] = nw;
        }
        assert_eq!(
            u.state[&Key::Int(0)].m.to_vec::<f64>().unwrap(),
            m,
            "step {step}"
        );
        let want: Vec<f32> = master.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        assert_eq!(values(&w), want, "step {step}");
    }
}

#[test]
fn a_master_copy_of_another_size_is_made_afresh_from_the_weight() {
    // (Loaded from states saved for another shape of the key, say.)
    let mut u = OptimizerUpdater::new(Optimizer::sgd(0.5).multi_precision(true));
    let mut w = h(&[1.0, 2.0]);
    u.update(&Key::Int(0), &h(&[0.0, 0.0]), &mut w).unwrap();
    u.state.get_mut(&Key::Int(0)).unwrap().master =
        NDArray::from_vec(&[3], vec![9.0f32; 3]).unwrap();
    u.update(&Key::Int(0), &h(&[1.0, 1.0]), &mut w).unwrap();
    assert_eq!(values(&w), [0.5, 1.5]);
    assert_eq!(
        u.state[&Key::Int(0)].master.to_vec::<f32>().unwrap(),
        [0.5, 1.5]
    );
}

#[test]
fn a_bfloat16_weight_is_its_master_copy_rounded_through_float32() {
    // The weight is the master copy rounded to nearest even, every element, every step. The
    // `half` crate's own bf16::from_f64 keeps only the top 32 bits of the f64 before rounding,
    // so a float32 just past a halfway point (0xbf9a8006, element 477 at the second step
    // here) rounded down: Element::from_f64 must be the one called.
    let n = 16387;
    let key = Key::Int(3);
    let bf = |xs: Vec<f64>| {
        NDArray::from_vec(&[xs.len()], xs.into_iter().map(bf16::from_f64).collect()).unwrap()
    };
    let mut w = bf((0..n).map(|i| ((i as f64) * 0.013) % 3.0 - 1.5).collect());
    let opt = Optimizer::sgd(0.05)
        .momentum(0.9)
        .wd(1e-4)
        .clip_gradient(1.5);
    let mut u = OptimizerUpdater::new(opt.multi_precision(true));
    for s in 0..3 {
        let g = bf((0..n)
            .map(|i| ((i * (s + 2)) as f64 * 0.71) % 5.0 - 2.5)
            .collect());
        u.update(&key, &g, &mut w).unwrap();
        let master = u.state[&key].master.to_vec::<f32>().unwrap();
        let want: Vec<bf16> = master.iter().map(|&m| bf16::from_f32(m)).collect();
        let got = w.as_slice::<bf16>().unwrap();
        let bad = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits());
        assert_eq!(
            bad, None,
            "step {s}: the first element not its master rounded"
        );
    }
}
