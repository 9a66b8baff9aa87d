//! GPU arrays. Without a GPU (or without the `cuda` feature) a GPU is a typed error, which
//! the first test checks on every machine. The others need a GPU and are ignored elsewhere:
//! on a GPU machine, `cargo test --release --features kvstore/cuda --test gpu -- --ignored`
//! (they use every GPU there is, several arrays per GPU where there are fewer than four).

mod util;

use kvstore::{
    cpu, create, gpu, gpu_count, DType, Device, KvError, NDArray, Optimizer, CUDA_BUILT,
};

const SHAPE: [usize; 2] = [2, 3];

/// An array of `dtype` holding `values` (converted as `as` does).
fn array_of(shape: &[usize], dtype: DType, values: &[f64]) -> NDArray {
    use half::{bf16, f16};
    match dtype {
        DType::F32 => NDArray::from_vec(shape, values.iter().map(|&x| x as f32).collect()),
        DType::F64 => NDArray::from_vec(shape, values.to_vec()),
        DType::F16 => NDArray::from_vec(shape, values.iter().map(|&x| f16::from_f64(x)).collect()),
        DType::BF16 => {
            NDArray::from_vec(shape, values.iter().map(|&x| bf16::from_f64(x)).collect())
        }
        DType::I32 => NDArray::from_vec(shape, values.iter().map(|&x| x as i32).collect()),
        DType::I64 => NDArray::from_vec(shape, values.iter().map(|&x| x as i64).collect()),
        _ => NDArray::from_vec(shape, values.iter().map(|&x| x as u8).collect()),
    }
    .unwrap()
}

fn device_error(r: kvstore::Result<NDArray>, what: &str) -> String {
    match r {
        Err(KvError::Device(m)) => m,
        Err(e) => panic!("{what}: {e}, want a device error"),
        Ok(a) => panic!("{what}: an array on {}", a.device()),
    }
}

#[test]
fn a_gpu_that_is_not_there_is_a_typed_error() {
    let n = gpu_count() as u32;
    if !CUDA_BUILT {
        assert_eq!(n, 0, "a build without cuda has no GPU");
    }
    for i in [n, n + 3] {
        let m = device_error(NDArray::ones(&SHAPE).on(gpu(i)), "past the count");
        assert!(m.starts_with(&format!("gpu({i}): ")), "{m}");
        let m = device_error(
            NDArray::ones(&SHAPE).copy_to(gpu(i)),
            "a copy past the count",
        );
        assert!(m.starts_with(&format!("gpu({i}): ")), "{m}");
        let mut kv = create("local").unwrap();
        let m = device_error(
            kv.alloc_on(&SHAPE, DType::F32, gpu(i)),
            "alloc_on past the count",
        );
        assert!(m.starts_with(&format!("gpu({i}): ")), "{m}");
    }
    // Host memory from alloc_on is page-locked only where there is a GPU.
    let mut kv = create("local").unwrap();
    let h = kv.alloc_on(&SHAPE, DType::F64, cpu(0)).unwrap();
    assert_eq!((h.device(), h.dtype()), (cpu(0), DType::F64));
    assert_eq!(h.to_vec::<f64>().unwrap(), vec![0.0; 6]);
    assert_eq!(h.is_pinned(), n > 0);
    match kv.alloc_on(&[usize::MAX, 2], DType::F32, cpu(0)) {
        Err(KvError::TooLarge { .. }) => {}
        other => panic!("an overflowing shape: {other:?}"),
    }
    // CPUs are names: any index is there, and the memory stays where it is.
    let a = NDArray::ones(&SHAPE).on(cpu(7)).unwrap();
    assert_eq!(a.device(), cpu(7));
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0; 6]);
}

/// The tutorial's `n` devices, round robin over the GPUs there are.
fn gpus(n: u32) -> Vec<Device> {
    let count = gpu_count() as u32;
    assert!(count > 0, "this test needs a GPU");
    (0..n).map(|i| gpu(i % count)).collect()
}

fn ones_on(devices: &[Device], scale: f64) -> Vec<NDArray> {
    devices
        .iter()
        .map(|&d| (NDArray::ones(&SHAPE) * scale).on(d).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a GPU"]
fn the_tutorial_on_gpus_every_value() {
    for kind in ["local", "device"] {
        let mut kv = create(kind).unwrap();
        let devices = gpus(4);
        kv.init(3, &(NDArray::ones(&SHAPE) * 2.0).on(devices[0]).unwrap())
            .unwrap();
        let mut a = NDArray::zeros(&SHAPE).on(devices[0]).unwrap();
        kv.pull(3, &mut a).unwrap();
        assert_eq!(a.to_string(), "[[2. 2. 2.]\n [2. 2. 2.]]", "{kind}");
        assert_eq!(a.device(), devices[0]);
        kv.push(3, &ones_on(&devices, 1.0)).unwrap();
        kv.pull(3, &mut a).unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![4.0; 6], "{kind}");
        // A pull into outputs on every GPU.
        let mut outs = ones_on(&devices, 0.0);
        kv.pull(3, &mut outs).unwrap();
        for o in &outs {
            assert_eq!(
                o.to_vec::<f32>().unwrap(),
                vec![4.0; 6],
                "{kind} on {}",
                o.device()
            );
        }
        kv.set_updater(|_, input, stored| stored.axpy(2.0, input))
            .unwrap();
        kv.push(3, &ones_on(&devices, 1.0)).unwrap();
        kv.pull(3, &mut a).unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![12.0; 6], "{kind}");
        let keys = [7, 11, 13, 17];
        kv.init(keys, &ones_on(&gpus(4), -3.0)).unwrap();
        let row = ones_on(&gpus(3), -0.1);
        kv.push(keys, &vec![row; keys.len()]).unwrap();
        let mut c = ones_on(&gpus(4), 0.0);
        kv.pull(keys, &mut c).unwrap();
        // -3 + 2 * (-0.1 * 3), in f32.
        let want = -3.0f32 + 2.0 * (-0.1f32 + -0.1f32 + -0.1f32);
        assert_eq!(c[0].to_vec::<f32>().unwrap(), vec![want; 6], "{kind}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn sums_on_a_gpu_are_the_host_sums_bit_for_bit() {
    let n = (1 << 18) + 3;
    // One kernel sums up to 8 values; more are added 8 at a time to the result.
    for count in [2, 5, 8, 9, 19] {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            sum_on_gpus_against_the_host(n, count, dtype);
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn sums_with_infinities_and_nans_are_the_hosts_nan_for_nan() {
    // inf + -inf, NaN + 1 and the like are NaN on both, though not the same NaN (a GPU makes
    // the canonical one, an x86 CPU its default one or keeps an operand's); every other result
    // is the host's, bit for bit (-0.0 + -0.0 included).
    let specials = [f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 1.0, -0.0, 0.0];
    let n = specials.len() * specials.len();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let a: Vec<f64> = (0..n).map(|i| specials[i % specials.len()]).collect();
        let b: Vec<f64> = (0..n).map(|i| specials[i / specials.len()]).collect();
        let host = [array_of(&[n], dtype, &a), array_of(&[n], dtype, &b)];
        let dev = gpus(1)[0];
        let on_gpu = [host[0].copy_to(dev).unwrap(), host[1].copy_to(dev).unwrap()];
        let mut cpu_kv = create("local").unwrap();
        let mut gpu_kv = create("device").unwrap();
        cpu_kv.init(0, &NDArray::zeros_dtype(&[n], dtype)).unwrap();
        let zeros = NDArray::zeros_dtype(&[n], dtype).on(dev).unwrap();
        gpu_kv.init(0, &zeros).unwrap();
        cpu_kv.push(0, &host[..]).unwrap();
        gpu_kv.push(0, &on_gpu[..]).unwrap();
        let mut want = NDArray::zeros_dtype(&[n], dtype);
        let mut got = NDArray::zeros_dtype(&[n], dtype).on(dev).unwrap();
        cpu_kv.pull(0, &mut want).unwrap();
        gpu_kv.pull(0, &mut got).unwrap();
        for (i, (g, w)) in got
            .to_f64_vec()
            .into_iter()
            .zip(want.to_f64_vec())
            .enumerate()
        {
            let same = (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits();
            assert!(
                same,
                "{dtype}: {} + {} is {g} on the GPU, {w} on the host",
                a[i], b[i]
            );
        }
    }
}

fn sum_on_gpus_against_the_host(n: usize, count: usize, dtype: DType) {
    // Values that round differently in each type: (i * 0.37) mod 11 - 5, per device.
    let host: Vec<NDArray> = (0..count)
        .map(|d| {
            let v: Vec<f64> = (0..n)
                .map(|i| ((i * (d + 3)) as f64 * 0.37) % 11.0 - 5.0)
                .collect();
            array_of(&[n], dtype, &v)
        })
        .collect();
    let on_gpus: Vec<NDArray> = host
        .iter()
        .zip(gpus(count as u32))
        .map(|(a, d)| a.copy_to(d).unwrap())
        .collect();
    // Each store's order: a `device` store's left to right (on the GPU), a `local` store's
    // MXNet's CPU reduce (on the host, GPU values or not).
    for name in ["device", "local"] {
        let mut cpu_kv = create(name).unwrap();
        let mut gpu_kv = create(name).unwrap();
        cpu_kv.init(0, &NDArray::zeros_dtype(&[n], dtype)).unwrap();
        gpu_kv
            .init(
                0,
                &NDArray::zeros_dtype(&[n], dtype).on(gpus(1)[0]).unwrap(),
            )
            .unwrap();
        cpu_kv.push(0, &host).unwrap();
        gpu_kv.push(0, &on_gpus).unwrap();
        let mut want = NDArray::zeros_dtype(&[n], dtype);
        let mut got = NDArray::zeros_dtype(&[n], dtype).on(gpus(1)[0]).unwrap();
        cpu_kv.pull(0, &mut want).unwrap();
        gpu_kv.pull(0, &mut got).unwrap();
        assert_eq!(
            got.as_bytes(),
            want.as_bytes(),
            "{name}: {count} values of {dtype}"
        );
    }
}

/// A `local` store sums in MXNet's CPU order even where its values are on a GPU: here an
/// updater moved the stored value there, so the key's merge buffer is a GPU array too.
#[test]
#[ignore = "needs a GPU"]
fn a_local_store_sums_gpu_values_in_mxnets_cpu_order() {
    let dev = gpus(1)[0];
    let mut kv = create("local").unwrap();
    kv.init(0, &NDArray::zeros_dtype(&[4], DType::F16)).unwrap();
    kv.set_updater(move |_, input, stored| {
        *stored = input.copy_to(dev)?;
        Ok(())
    })
    .unwrap();
    let on = |x: f64| array_of(&[4], DType::F16, &[x; 4]).on(dev).unwrap();
    kv.push(0, &on(1.0)).unwrap();
    // 2048 + (1 + 1) is 2050 in float16; (2048 + 1) + 1, left to right, is 2048.
    kv.push(0, &[on(2048.0), on(1.0), on(1.0)]).unwrap();
    let mut out = NDArray::zeros_dtype(&[4], DType::F16);
    kv.pull(0, &mut out).unwrap();
    assert_eq!(out.to_f64_vec(), vec![2050.0; 4]);
}

/// Through the stores, saved and loaded. (That the kernels ran, not the host through the
/// arrays' mirrors, is checked by the library's `optimizer::gpu_tests`.)
#[test]
#[ignore = "needs a GPU"]
fn optimizers_on_a_gpu_are_the_hosts_bit_for_bit_and_keep_their_state() {
    let n = (1 << 16) + 5;
    let dir = std::env::temp_dir().join(format!("kvstore-gpu-opt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let opts = [
        Optimizer::sgd(0.1).wd(1e-3),
        Optimizer::sgd(0.05)
            .momentum(0.9)
            .wd(1e-4)
            .clip_gradient(1.5),
        Optimizer::adam(0.01)
            .wd(1e-3)
            .rescale_grad(0.5)
            .clip_gradient(2.0),
        Optimizer::nag(0.05).momentum(0.9).wd(1e-2),
        Optimizer::rmsprop(0.01).centered(true).clip_weights(1.4),
        Optimizer::nadam(0.01).wd(1e-3),
        Optimizer::ftml(0.02).clip_gradient(2.0),
        Optimizer::signum(0.01).momentum(0.9).wd_lh(1e-2),
        Optimizer::ftrl(0.1).lamda1(0.05),
    ];
    for opt in opts {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let what = format!("{} on {dtype}", opt.name());
            let weight: Vec<f64> = (0..n).map(|i| ((i as f64) * 0.013) % 3.0 - 1.5).collect();
            let w = array_of(&[n], dtype, &weight);
            let mut cpu_kv = create("local").unwrap();
            let mut gpu_kv = create("device").unwrap();
            cpu_kv.init(7, &w).unwrap();
            gpu_kv.init(7, &w.copy_to(gpus(1)[0]).unwrap()).unwrap();
            cpu_kv.set_optimizer(opt.clone()).unwrap();
            gpu_kv.set_optimizer(opt.clone()).unwrap();
            let step = |cpu_kv: &mut kvstore::KVStore, gpu_kv: &mut kvstore::KVStore, s: usize| {
                let grad: Vec<f64> = (0..n)
                    .map(|i| ((i * (s + 2)) as f64 * 0.71) % 5.0 - 2.5)
                    .collect();
                let g = array_of(&[n], dtype, &grad);
                cpu_kv.push(7, &g).unwrap();
                gpu_kv.push(7, &g.copy_to(gpus(1)[0]).unwrap()).unwrap();
                let mut want = NDArray::zeros_dtype(&[n], dtype);
                let mut got = NDArray::zeros_dtype(&[n], dtype).on(gpus(1)[0]).unwrap();
                cpu_kv.pull(7, &mut want).unwrap();
                gpu_kv.pull(7, &mut got).unwrap();
                assert_eq!(got.as_bytes(), want.as_bytes(), "{what}, step {s}");
            };
            for s in 0..3 {
                step(&mut cpu_kv, &mut gpu_kv, s);
            }
            // The state kept on the GPU is the host's, and goes back there when saved.
            let (a, b) = (dir.join("cpu"), dir.join("gpu"));
            cpu_kv.save_optimizer_states(&a).unwrap();
            gpu_kv.save_optimizer_states(&b).unwrap();
            let saved = std::fs::read(&a).unwrap();
            assert_eq!(std::fs::read(&b).unwrap(), saved, "{what}: saved states");
            // States loaded from a file go to the GPU on the next update. With the optimizer
            // and its counts (MXNet's `dump_optimizer=True`), a fresh device store given the
            // host's weight goes on as the host does (without the states, momentum and Adam's
            // moments and step count would start afresh).
            let dumped = dir.join("dumped");
            cpu_kv.save_optimizer_and_states(&dumped).unwrap();
            let mut now = NDArray::zeros_dtype(&[n], dtype);
            cpu_kv.pull(7, &mut now).unwrap();
            let fresh = |kind: &str, path: &std::path::Path| {
                let mut kv = create(kind).unwrap();
                let w = match kind {
                    "device" => now.copy_to(gpus(1)[0]).unwrap(),
                    _ => now.clone(),
                };
                kv.init(7, &w).unwrap();
                kv.set_optimizer(opt.clone()).unwrap();
                kv.load_optimizer_states(path).unwrap();
                kv
            };
            let mut resumed = fresh("device", &dumped);
            // The states alone keep a fresh store's own counts, as MXNet keeps them on its
            // optimizer object (Adam's bias correction starts again): a fresh host store
            // loaded the same way is the reference.
            let (mut host_states, mut gpu_states) = (fresh("local", &a), fresh("device", &a));
            for s in 3..5 {
                step(&mut cpu_kv, &mut resumed, s);
                step(&mut host_states, &mut gpu_states, s);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs a GPU"]
fn a_gpu_out_of_memory_for_an_arrays_own_memory_is_an_error() {
    // An output that shares its memory (a clone of it is kept) needs memory of its own before
    // it is written; where the GPU has none left, that is KvError::Device, and the clone keeps
    // its value. Then, with memory again, the same calls work.
    let d = gpus(1)[0];
    let n = 64 << 20;
    let mut kv = create("device").unwrap();
    kv.init(0, &NDArray::full(&[n], 2.0).on(d).unwrap())
        .unwrap();
    let src = NDArray::full(&[n], 3.0).on(d).unwrap();
    let mut x = NDArray::zeros(&[n]).on(d).unwrap();
    let keep = x.clone();
    // The GPU filled by device copies of 1 GiB, then 64 MiB, then 1 MiB, until none is given.
    let pieces: Vec<NDArray> = [256 << 20, 16 << 20, 256 << 10]
        .iter()
        .map(|&e| NDArray::zeros(&[e]).on(d).unwrap())
        .collect();
    let mut hog = Vec::new();
    for p in &pieces {
        while let Ok(a) = p.copy_to(d) {
            hog.push(a);
        }
    }
    let copied = x.copy_from(&src);
    assert!(matches!(copied, Err(KvError::Device(_))), "{copied:?}");
    let pulled = kv.pull(0, &mut x);
    assert!(matches!(pulled, Err(KvError::Device(_))), "{pulled:?}");
    drop(hog);
    for i in [0, n - 1] {
        assert_eq!(keep.get(&[i]).unwrap(), 0.0);
    }
    x.copy_from(&src).unwrap();
    assert_eq!(
        (x.get(&[0]).unwrap(), keep.get(&[n - 1]).unwrap()),
        (3.0, 0.0)
    );
    kv.pull(0, &mut x).unwrap();
    assert_eq!(x.get(&[n - 1]).unwrap(), 2.0);
}

#[test]
#[ignore = "needs a GPU"]
fn every_dtype_goes_to_a_gpu_and_back_unchanged() {
    for dtype in DType::ALL {
        let v: Vec<f64> = (0..15).map(f64::from).collect();
        let a = array_of(&[3, 5], dtype, &v);
        for d in gpus(4) {
            let g = a.copy_to(d).unwrap();
            assert_eq!(g.device(), d);
            assert_eq!(g.to_string(), a.to_string(), "{dtype} on {d}");
            assert!(g == a, "{dtype} on {d}: equal to the host array");
            assert!(
                g.is_pinned(),
                "{dtype} on {d}: its host mirror is page-locked"
            );
            let back = g.on(cpu(0)).unwrap();
            assert_eq!(back.as_bytes(), a.as_bytes(), "{dtype} back from {d}");
            assert!(
                back.is_pinned(),
                "{dtype} back from {d}: a page-locked host copy"
            );
            // A copy of it made on write stays page-locked.
            let mut written = back.clone();
            written.fill(1.0);
            assert!(
                written.is_pinned(),
                "{dtype}: a copy made on write of a pinned array"
            );
            assert_eq!(
                back.as_bytes(),
                a.as_bytes(),
                "{dtype}: the original is unchanged"
            );
            assert!(!a.is_pinned(), "a host array of its own is plain memory");
            // Host to GPU and back by copy_from, straight between host memory and the device.
            let mut g2 = NDArray::zeros_dtype(&[3, 5], dtype).on(d).unwrap();
            g2.copy_from(&a).unwrap();
            let mut h = NDArray::zeros_dtype(&[3, 5], dtype);
            h.copy_from(&g2).unwrap();
            assert_eq!(
                h.as_bytes(),
                a.as_bytes(),
                "{dtype} through {d} by copy_from"
            );
            assert!(g2 == a, "{dtype} on {d} after copy_from");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn alloc_on_gives_page_locked_host_memory_and_gpu_arrays() {
    let mut kv = create("local").unwrap();
    kv.init(2, &NDArray::zeros(&SHAPE)).unwrap();
    let mut h = kv.alloc_on(&SHAPE, DType::F32, cpu(0)).unwrap();
    assert!(h.is_pinned() && !h.is_shared_memory());
    let mut g = kv.alloc_on(&SHAPE, DType::F32, gpus(1)[0]).unwrap();
    assert_eq!(g.device(), gpus(1)[0]);
    assert_eq!(g.to_vec::<f32>().unwrap(), vec![0.0; 6]);
    assert!(g.is_pinned(), "a GPU array's host copy is page-locked");
    h.fill(2.5);
    kv.push(2, &h).unwrap();
    kv.pull(2, &mut g).unwrap();
    assert_eq!(g.to_vec::<f32>().unwrap(), vec![2.5; 6]);
    g.copy_from(&(NDArray::ones(&SHAPE) * 4.0).on(gpus(1)[0]).unwrap())
        .unwrap();
    kv.push(2, &g).unwrap();
    kv.pull(2, &mut h).unwrap();
    assert_eq!(h.to_vec::<f32>().unwrap(), vec![4.0; 6]);
}

#[test]
#[ignore = "needs a GPU"]
fn a_list_on_cpus_and_gpus_together_is_refused() {
    let mut kv = create("device").unwrap();
    kv.init(1, &NDArray::ones(&SHAPE)).unwrap();
    let mixed = vec![
        NDArray::ones(&SHAPE),
        NDArray::ones(&SHAPE).on(gpus(1)[0]).unwrap(),
    ];
    match kv.push(1, &mixed) {
        Err(KvError::Device(m)) => assert!(m.contains("CPUs and GPUs"), "{m}"),
        other => panic!("a mixed list: {other:?}"),
    }
    // The same key twice, one value on each kind: the merged list is mixed too.
    match kv.push([1, 1], &mixed) {
        Err(KvError::Device(m)) => assert!(m.contains("CPUs and GPUs"), "{m}"),
        other => panic!("a key given twice, on a CPU and a GPU: {other:?}"),
    }
    let mut a = NDArray::zeros(&SHAPE);
    kv.pull(1, &mut a).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0; 6], "nothing changed");
}

#[test]
#[ignore = "needs a GPU"]
fn a_distributed_job_with_gpu_arrays() {
    for transport in ["tcp", "shm"] {
        let env = [("KVSTORE_TRANSPORT", transport)];
        let r = util::kvrun_check(2, 2, "gpu", "dist_sync", &env);
        util::assert_job_ok(&r, 2, "gpu");
    }
}
