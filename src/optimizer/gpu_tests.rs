//! Every built-in optimizer on a GPU against the same on the host, bit for bit: the weight
//! after each step, and the state, which must stay on the GPU (so that the kernels ran, not
//! the host through the arrays' mirrors). They need a GPU and are ignored elsewhere; the GPU
//! bundle (tests/gpu/bundle.sh) runs them with `--include-ignored`.

use half::{bf16, f16};

use crate::{gpu, gpu_count, DType, Device, Key, Multiplied, NDArray, Optimizer, OptimizerUpdater};

/// One of each kind, with its switches on where it has them (clips, weight decays, the
/// rescale; Signum in both its orders, with the clip and without), so that every line of every
/// rule runs.
fn every_optimizer() -> Vec<Optimizer> {
    let all = vec![
        Optimizer::sgd(0.1).wd(1e-3).clip_gradient(0.9),
        Optimizer::sgd(0.05)
            .momentum(0.9)
            .wd(1e-4)
            .clip_gradient(1.5),
        Optimizer::nag(0.1).wd(1e-3),
        Optimizer::nag(0.05)
            .momentum(0.9)
            .wd(1e-2)
            .clip_gradient(1.5),
        Optimizer::adam(0.01).wd(1e-3).clip_gradient(2.0),
        Optimizer::adagrad(0.1).wd(1e-3).clip_gradient(1.5),
        Optimizer::rmsprop(0.01)
            .wd(1e-3)
            .clip_gradient(2.0)
            .clip_weights(1.2),
        Optimizer::rmsprop(0.01)
            .centered(true)
            .gamma2(0.8)
            .wd(1e-3)
            .clip_weights(1.4),
        Optimizer::nadam(0.01).wd(1e-3).clip_gradient(2.0),
        Optimizer::ftml(0.02).wd(1e-3),
        Optimizer::adadelta().wd(1e-3).clip_gradient(2.0),
        Optimizer::adamax(0.01).wd(1e-3).clip_gradient(1.0),
        Optimizer::signum(0.01)
            .momentum(0.9)
            .wd(1e-3)
            .wd_lh(1e-2)
            .clip_gradient(1.0),
        Optimizer::signum(0.01).momentum(0.8).wd(1e-3),
        Optimizer::signum(0.01).momentum(0.0).wd(1e-3),
        Optimizer::ftrl(0.1)
            .lamda1(0.05)
            .beta(1.0)
            .wd(1e-3)
            .clip_gradient(2.0),
    ];
    // A rescale for all (signSGD's rule ignores it, as MXNet's does).
    all.into_iter().map(|o| o.rescale_grad(0.75)).collect()
}

/// An array of `dtype` holding `values` (the same inputs for the host and the GPU).
fn array(dtype: DType, values: &[f64]) -> NDArray {
    let shape = [values.len()];
    match dtype {
        DType::F32 => NDArray::from_vec(&shape, values.iter().map(|&x| x as f32).collect()),
        DType::F64 => NDArray::from_vec(&shape, values.to_vec()),
        DType::F16 => NDArray::from_vec(&shape, values.iter().map(|&x| f16::from_f64(x)).collect()),
        _ => NDArray::from_vec(&shape, values.iter().map(|&x| bf16::from_f64(x)).collect()),
    }
    .unwrap()
}

/// The host's and the GPU's updaters, each given the same gradients for five steps.
fn host_and_gpu_agree(opt: Multiplied, dtype: DType, what: &str) {
    let n = (1 << 14) + 3;
    let dev = gpu(0);
    let key = Key::Int(3);
    let w0: Vec<f64> = (0..n).map(|i| ((i as f64) * 0.013) % 3.0 - 1.5).collect();
    let mut host_w = array(dtype, &w0);
    let mut gpu_w = host_w.copy_to(dev).unwrap();
    let mut host = OptimizerUpdater::new(opt.clone());
    let mut on_gpu = OptimizerUpdater::new(opt);
    for s in 0..5 {
        // Gradients of both signs, zeros, and some past every clip.
        let g: Vec<f64> = (0..n)
            .map(|i| ((i * (s + 2)) as f64 * 0.71) % 5.0 - 2.5)
            .collect();
        let g = array(dtype, &g);
        host.update(&key, &g, &mut host_w).unwrap();
        let gpu_g = g.copy_to(dev).unwrap();
        // The update takes the GPU's path (plain SGD and signSGD keep no state to show it).
        assert!(crate::gpu::optim::applies(&gpu_g, &gpu_w), "{what}");
        on_gpu.update(&key, &gpu_g, &mut gpu_w).unwrap();
        assert_eq!(gpu_w.device(), dev, "{what}");
        let got = gpu_w.copy_to(crate::cpu(0)).unwrap();
        if got.as_bytes() != host_w.as_bytes() {
            // The first element that differs, with its state on both sides.
            let (a, b) = (got.to_f64_vec(), host_w.to_f64_vec());
            let i = (0..n)
                .find(|&i| a[i].to_bits() != b[i].to_bits())
                .unwrap_or(0);
            let at = |u: &OptimizerUpdater, name: &str| {
                let st = &u.state[&key];
                let m = |x: &NDArray| x.to_f64_vec().get(i).copied();
                format!(
                    "{name}: m {:?} v {:?} d {:?} master {:?}",
                    m(&st.m),
                    m(&st.v),
                    m(&st.d),
                    m(&st.master)
                )
            };
            panic!(
                "{what}, step {s}: element {i} is {} on the GPU, {} on the host ({}; {})",
                a[i],
                b[i],
                at(&on_gpu, "GPU"),
                at(&host, "host")
            );
        }
        let st = &on_gpu.state[&key];
        for (name, a) in [
            ("m", &st.m),
            ("v", &st.v),
            ("d", &st.d),
            ("master", &st.master),
        ] {
            if a.size() != 0 {
                assert_eq!(a.device(), dev, "{what}: its {name} state is on the GPU");
            }
        }
    }
    // The states, brought back to the host to be saved, are the host's.
    assert_eq!(
        on_gpu.save_states(),
        host.save_states(),
        "{what}: the states"
    );
}

fn needs_a_gpu() {
    assert!(
        gpu_count() > 0,
        "this test needs a GPU (cargo test --features cuda -- --ignored on a GPU machine)"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn every_optimizer_on_a_gpu_is_the_hosts_bit_for_bit() {
    needs_a_gpu();
    for opt in every_optimizer() {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let what = format!("{opt:?} on {dtype}");
            host_and_gpu_agree(opt.clone().into(), dtype, &what);
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn multi_precision_on_a_gpu_is_the_hosts_bit_for_bit() {
    needs_a_gpu();
    for opt in every_optimizer() {
        for dtype in [DType::F16, DType::BF16] {
            let what = format!("{opt:?} on {dtype} with multi_precision");
            host_and_gpu_agree(opt.clone().multi_precision(true), dtype, &what);
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_key_moved_between_the_host_and_a_gpu_keeps_its_state() {
    // The state follows the update: a key updated on the host, then on the GPU, then on the
    // host again goes on as one updated on the host throughout.
    needs_a_gpu();
    let dev = gpu(0);
    let n = 1000;
    for opt in every_optimizer() {
        let what = format!("{opt:?}");
        let opt = opt.multi_precision(true);
        let key = Key::Int(1);
        let w0: Vec<f64> = (0..n).map(|i| (i as f64) * 0.002 - 1.0).collect();
        let mut host_w = array(DType::F16, &w0);
        let mut moved_w = host_w.clone();
        let mut host = OptimizerUpdater::new(opt.clone());
        let mut moved = OptimizerUpdater::new(opt);
        for s in 0..6 {
            let g: Vec<f64> = (0..n)
                .map(|i| ((i * (s + 3)) as f64 * 0.37) % 3.0 - 1.5)
                .collect();
            let g = array(DType::F16, &g);
            host.update(&key, &g, &mut host_w).unwrap();
            let place: Device = if (2..4).contains(&s) {
                dev
            } else {
                crate::cpu(0)
            };
            moved_w = moved_w.copy_to(place).unwrap();
            moved
                .update(&key, &g.copy_to(place).unwrap(), &mut moved_w)
                .unwrap();
            let got = moved_w.copy_to(crate::cpu(0)).unwrap();
            assert_eq!(got.as_bytes(), host_w.as_bytes(), "{what}, step {s}");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn nag_on_a_gpu_runs_by_the_keys_state_as_the_host_whatever_its_momentum_becomes() {
    // A key updated first with momentum 0 has no momentum state and runs sgd_update, which
    // refuses a momentum set later (on the GPU as on the host, changing nothing); one first
    // updated with any other momentum (a negative one too) runs nag_mom_update, with the
    // momentum where it is positive and 0 where not.
    needs_a_gpu();
    let dev = gpu(0);
    let n = (1 << 12) + 3;
    let key = Key::Int(5);
    let nag = |m: f64| Optimizer::nag(0.05).momentum(m).wd(1e-3);
    for (first, then) in [(0.0, 0.9), (0.9, 0.0), (-0.5, 0.5)] {
        let what = format!("NAG, momentum {first} then {then}");
        let w0: Vec<f64> = (0..n).map(|i| ((i as f64) * 0.011) % 3.0 - 1.5).collect();
        let mut host_w = array(DType::F32, &w0);
        let mut gpu_w = host_w.copy_to(dev).unwrap();
        let mut host = OptimizerUpdater::new(nag(first));
        let mut on_gpu = OptimizerUpdater::new(nag(first));
        for s in 0..4 {
            if s == 2 {
                host.retune(nag(then)).unwrap();
                on_gpu.retune(nag(then)).unwrap();
            }
            let g: Vec<f64> = (0..n)
                .map(|i| ((i * (s + 2)) as f64 * 0.71) % 5.0 - 2.5)
                .collect();
            let g = array(DType::F32, &g);
            if first == 0.0 && then > 0.0 && s >= 2 {
                let on_host = host.update(&key, &g, &mut host_w).expect_err(&what);
                let here = on_gpu
                    .update(&key, &g.copy_to(dev).unwrap(), &mut gpu_w)
                    .expect_err(&what);
                assert_eq!(here.to_string(), on_host.to_string(), "{what}, step {s}");
                assert!(here.to_string().contains("no momentum state"), "{here}");
            } else {
                host.update(&key, &g, &mut host_w).unwrap();
                on_gpu
                    .update(&key, &g.copy_to(dev).unwrap(), &mut gpu_w)
                    .unwrap_or_else(|e| panic!("{what}, step {s}: {e}"));
            }
            let got = gpu_w.copy_to(crate::cpu(0)).unwrap();
            assert_eq!(got.as_bytes(), host_w.as_bytes(), "{what}, step {s}");
        }
        assert_eq!(
            on_gpu.save_states(),
            host.save_states(),
            "{what}: the states"
        );
    }
}
