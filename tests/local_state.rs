//! The `local` and `device` stores, continued: saved optimizer states, compression's
//! residuals, calls in flight, the update order of keys, and the order of a list's sum.

use kvstore::{create, Compression, DType, KvError, NDArray, Optimizer};

const SHAPE: [usize; 2] = [2, 3];

fn pull(kv: &mut kvstore::KVStore, key: i32) -> Vec<f32> {
    let mut a = NDArray::zeros(&SHAPE);
    kv.pull(key, &mut a).unwrap();
    a.to_vec::<f32>().unwrap()
}

#[test]
fn optimizer_states_save_and_load_for_local_stores() {
    let dir = std::env::temp_dir().join(format!("kvstore-optstates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("states");
    let mut kv = create("local").unwrap();
    kv.init(0, &NDArray::ones(&SHAPE)).unwrap();
    // No built-in optimizer: nothing to save.
    assert!(matches!(
        kv.save_optimizer_states(&path),
        Err(KvError::Unsupported(_))
    ));
    kv.set_optimizer(Optimizer::sgd(0.1).momentum(0.9).wd(1e-4))
        .unwrap();
    kv.push(0, &NDArray::ones(&SHAPE)).unwrap();
    kv.save_optimizer_states(&path).unwrap();
    let before = pull(&mut kv, 0);
    // A second store with the same weights and the loaded momentum takes the same step.
    let mut other = create("local").unwrap();
    other
        .init(0, &NDArray::from_vec(&SHAPE, before.clone()).unwrap())
        .unwrap();
    other
        .set_optimizer(Optimizer::sgd(0.1).momentum(0.9).wd(1e-4))
        .unwrap();
    other.load_optimizer_states(&path).unwrap();
    kv.push(0, &NDArray::ones(&SHAPE)).unwrap();
    other.push(0, &NDArray::ones(&SHAPE)).unwrap();
    assert_eq!(pull(&mut kv, 0), pull(&mut other, 0));
    // Without the momentum the step differs.
    let mut fresh = create("local").unwrap();
    fresh
        .init(0, &NDArray::from_vec(&SHAPE, before).unwrap())
        .unwrap();
    fresh
        .set_optimizer(Optimizer::sgd(0.1).momentum(0.9).wd(1e-4))
        .unwrap();
    fresh.push(0, &NDArray::ones(&SHAPE)).unwrap();
    assert_ne!(pull(&mut fresh, 0), pull(&mut kv, 0));
    // Adam cannot load SGD's states; a truncated file is refused.
    fresh.set_optimizer(Optimizer::adam(0.1)).unwrap();
    assert!(fresh.load_optimizer_states(&path).is_err());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    assert!(other.load_optimizer_states(&path).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_device_store_compresses_each_value_with_its_own_residual() {
    let mut kv = create("device").unwrap();
    kv.set_gradient_compression(Compression::two_bit(0.5).unwrap())
        .unwrap();
    kv.init(0, &NDArray::zeros(&[4])).unwrap();
    kv.init(1, &NDArray::zeros_dtype(&[4], DType::F64)).unwrap();
    let g = |v: [f32; 4]| NDArray::from_vec(&[4], v.to_vec()).unwrap();
    let mut out = NDArray::zeros(&[4]);
    // Device 0 pushes 0.3 each time, device 1 -0.6 then 0.2: what each sends is summed.
    let sends = [[0.0, -0.5], [0.5, 0.0], [0.0, 0.0]];
    for (step, d1) in [-0.6, 0.2, 0.2].into_iter().enumerate() {
        kv.pushpull(0, &vec![g([0.3; 4]), g([d1; 4])], &mut out)
            .unwrap();
        let want = sends[step][0] + sends[step][1];
        assert_eq!(out.to_vec::<f32>().unwrap(), [want; 4], "step {step}");
    }
    // float64 values are not compressed: refused, nothing changes.
    let e = kv.push(1, &NDArray::full_dtype(&[4], 1.0, DType::F64));
    assert!(matches!(e, Err(KvError::Unsupported(m)) if m.contains("float32")));
    let mut f = NDArray::full_dtype(&[4], 7.0, DType::F64);
    kv.pull(1, &mut f).unwrap();
    assert_eq!(f.to_vec::<f64>().unwrap(), [0.0; 4]);
    let e = create("local")
        .unwrap()
        .set_gradient_compression(Compression::two_bit(0.5).unwrap());
    assert!(matches!(e, Err(KvError::Unsupported(m)) if m.contains("local store")));
}

#[test]
fn calls_in_flight_pair_their_outputs_with_the_keys_given() {
    let mut kv = create("local").unwrap();
    kv.init([3, 5], &[NDArray::zeros(&SHAPE), NDArray::zeros(&SHAPE)])
        .unwrap();
    let v = |x: f32| NDArray::ones(&SHAPE) * x;
    let p = kv
        .pushpull_async([3, 5], &[v(2.0), v(7.0)], vec![NDArray::zeros(&SHAPE); 2])
        .unwrap();
    let got: Vec<Vec<f32>> = kv
        .wait(p)
        .unwrap()
        .iter()
        .map(|o| o.to_vec().unwrap())
        .collect();
    assert_eq!(got, [vec![2.0; 6], vec![7.0; 6]]);
    // One output per key given: a key twice (its values summed into one push, one result)
    // is refused, and so is a count of outputs that is not the keys'; before, the first was
    // refused as "1 keys but 2 values" and the second accepted, its outputs paired wrongly.
    assert!(matches!(
        kv.pushpull_async([3, 3], &[v(1.0), v(1.0)], vec![NDArray::zeros(&SHAPE); 2]),
        Err(KvError::Unsupported(_))
    ));
    assert!(matches!(
        kv.pushpull_async(
            [3, 3, 5],
            &[v(1.0), v(1.0), v(1.0)],
            vec![NDArray::zeros(&SHAPE); 2]
        ),
        Err(KvError::LengthMismatch { keys: 3, values: 2 })
    ));
    assert_eq!(pull(&mut kv, 3), vec![2.0; 6], "nothing was pushed");
    // A pull in flight takes a key twice, one output each.
    let p = kv
        .pull_async([5, 5], vec![NDArray::zeros(&SHAPE); 2])
        .unwrap();
    for o in kv.wait(p).unwrap() {
        assert_eq!(o.to_vec::<f32>().unwrap(), vec![7.0; 6]);
    }
}

#[test]
fn a_str_key_initialised_again_keeps_its_place_in_the_update_order() {
    // A local store updates a call's str keys in the order of their first inits (MXNet's key
    // numbers). "a", lost to an updater that replaced its value and initialised again, keeps
    // its place before "b" and "c"; it took a number that "c" then took too.
    let mut kv = create("local").unwrap();
    let one = NDArray::ones(&[2]);
    kv.init(["a", "b"], &[one.clone(), one.clone()]).unwrap();
    kv.set_updater(|_, _, stored| {
        *stored = NDArray::zeros(&[3]);
        Ok(())
    })
    .unwrap();
    assert!(kv.push("a", &one).is_err());
    kv.init("a", &one).unwrap();
    kv.init("c", &one).unwrap();
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = order.clone();
    kv.set_updater(move |k, input, stored| {
        seen.lock().unwrap().push(k.to_string());
        stored.copy_from(input)
    })
    .unwrap();
    kv.push(["c", "a", "b"], &[one.clone(), one.clone(), one.clone()])
        .unwrap();
    assert_eq!(*order.lock().unwrap(), ["a", "b", "c"]);
}

/// Several values of a key are summed in MXNet's order for the store: a `local` store as
/// MXNet's CPU reduce (each next four among themselves first), a `device` store left to
/// right. In float16 the two part: 2048 + 1 + 1 is 2050 and 2048.
#[test]
fn several_values_are_summed_in_mxnets_order_for_the_store() {
    for (kind, want) in [("local", 2050.0), ("device", 2048.0)] {
        let mut kv = create(kind).unwrap();
        kv.init(0, &NDArray::zeros_dtype(&[1], DType::F16)).unwrap();
        let vals = [
            NDArray::full_dtype(&[1], 2048.0, DType::F16),
            NDArray::full_dtype(&[1], 1.0, DType::F16),
            NDArray::full_dtype(&[1], 1.0, DType::F16),
        ];
        kv.push(0, &vals).unwrap();
        let mut out = NDArray::zeros_dtype(&[1], DType::F16);
        kv.pull(0, &mut out).unwrap();
        assert_eq!(out.to_f64_vec(), [want], "{kind}");
    }
}
