//! The `local` and `device` stores: every value of the tutorial, and bad input.

use std::sync::{Arc, Mutex};

use kvstore::{cpu, create, DType, Key, KvError, NDArray, Optimizer};

const SHAPE: [usize; 2] = [2, 3];

fn pull(kv: &mut kvstore::KVStore, key: i32) -> Vec<f32> {
    let mut a = NDArray::zeros(&SHAPE);
    kv.pull(key, &mut a).unwrap();
    a.to_vec::<f32>().unwrap()
}

fn ones_on(n: u32) -> Vec<NDArray> {
    (0..n)
        .map(|i| NDArray::ones(&SHAPE).on(cpu(i)).unwrap())
        .collect()
}

#[test]
fn tutorial_local_store_every_value() {
    let mut kv = create("local").unwrap();
    assert_eq!(kv.r#type(), "local");
    assert_eq!((kv.rank(), kv.num_workers()), (0, 1));
    kv.init(3, &(NDArray::ones(&SHAPE) * 2.0)).unwrap();
    let mut a = NDArray::zeros(&SHAPE);
    kv.pull(3, &mut a).unwrap();
    assert_eq!(a.to_string(), "[[2. 2. 2.]\n [2. 2. 2.]]");

    kv.push(3, &(NDArray::ones(&SHAPE) * 8.0)).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![8.0; 6]);

    kv.push(3, &ones_on(4)).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![4.0; 6]);

    let calls = Arc::new(Mutex::new(Vec::new()));
    let seen = calls.clone();
    kv.set_updater(move |key, input, stored| {
        seen.lock().unwrap().push(format!("update on key: {key}"));
        stored.axpy(2.0, input)
    })
    .unwrap();
    assert_eq!(
        pull(&mut kv, 3),
        vec![4.0; 6],
        "setting the updater changes nothing"
    );
    kv.push(3, &NDArray::ones(&SHAPE)).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![6.0; 6]);
    assert_eq!(*calls.lock().unwrap(), vec!["update on key: 3"]);

    let mut b = ones_on(4);
    kv.pull(3, &mut b).unwrap();
    for x in &b {
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![6.0; 6]);
    }
    assert_eq!(b[1].to_string(), "[[6. 6. 6.]\n [6. 6. 6.]]");

    let keys = [5, 7, 9];
    kv.init(keys, &vec![NDArray::ones(&SHAPE); 3]).unwrap();
    calls.lock().unwrap().clear();
    kv.push(keys, &vec![NDArray::ones(&SHAPE); 3]).unwrap();
    assert_eq!(
        *calls.lock().unwrap(),
        vec!["update on key: 5", "update on key: 7", "update on key: 9"]
    );
    let mut b = vec![NDArray::zeros(&SHAPE); 3];
    kv.pull(keys, &mut b).unwrap();
    for x in &b {
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![3.0; 6]);
    }

    let mut b = vec![ones_on(4); 3];
    kv.push(keys, &b).unwrap();
    kv.pull(keys, &mut b).unwrap();
    for row in &b {
        for x in row {
            assert_eq!(x.to_vec::<f32>().unwrap(), vec![11.0; 6]);
        }
    }
    assert_eq!(b[1][1].to_string(), "[[11. 11. 11.]\n [11. 11. 11.]]");
}

#[test]
fn tutorial_device_store_every_value() {
    let mut kv = create("device").unwrap();
    assert_eq!(kv.r#type(), "device");
    kv.init(3, &(NDArray::ones(&SHAPE) * -2.0)).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![-2.0; 6]);
    kv.push(3, &(NDArray::ones(&SHAPE) * -7.0)).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![-7.0; 6]);
    kv.push(3, &ones_on(3)).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![3.0; 6]);

    let keys = [7, 11, 13, 17];
    kv.init(keys, &vec![NDArray::ones(&SHAPE) * -3.0; 4])
        .unwrap();
    let mut c = vec![NDArray::zeros(&SHAPE); 4];
    kv.pull(keys, &mut c).unwrap();
    assert_eq!(c[0].to_string(), "[[-3. -3. -3.]\n [-3. -3. -3.]]");
    let row: Vec<NDArray> = ones_on(3).into_iter().map(|a| a * -0.1).collect();
    kv.push(keys, &vec![row; 4]).unwrap();
    kv.pull(keys, &mut c).unwrap();
    let expected = (-0.1f32) + (-0.1f32) + (-0.1f32);
    for x in &c {
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![expected; 6]);
    }
    assert_eq!(c[0].to_string(), "[[-0.3 -0.3 -0.3]\n [-0.3 -0.3 -0.3]]");

    // The notebook's last cell: updater stored += input * 0.01, push 5 → 3 + 0.05.
    kv.set_updater(|_, input, stored| stored.axpy(0.01, input))
        .unwrap();
    assert_eq!(pull(&mut kv, 3), vec![3.0; 6]);
    kv.push(3, &(NDArray::ones(&SHAPE) * 5.0)).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![3.0f32 + 0.01f32 * 5.0; 6]);
}

#[test]
fn unknown_type_lists_the_valid_ones() {
    let err = create("dist_magic").err().unwrap();
    let text = err.to_string();
    assert!(matches!(err, KvError::UnknownType { .. }));
    for t in ["local", "device", "dist_sync", "dist_async"] {
        assert!(text.contains(t), "{text}");
    }
}

fn store_with_key3() -> kvstore::KVStore {
    let mut kv = create("local").unwrap();
    kv.init(3, &(NDArray::ones(&SHAPE) * 2.0)).unwrap();
    kv
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let mut kv = store_with_key3();
    let ones = NDArray::ones(&SHAPE);
    let mut out = NDArray::zeros(&SHAPE);

    assert!(matches!(
        kv.push(4, &ones),
        Err(KvError::UnknownKey(Key::Int(4)))
    ));
    assert!(matches!(kv.pull(4, &mut out), Err(KvError::UnknownKey(_))));
    assert!(matches!(
        kv.init(3, &ones),
        Err(KvError::DoubleInit(Key::Int(3)))
    ));
    assert!(matches!(
        kv.push(3, &NDArray::ones(&[3, 2])),
        Err(KvError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        kv.push(3, &NDArray::full_dtype(&SHAPE, 1.0, DType::F64)),
        Err(KvError::DTypeMismatch { .. })
    ));
    assert!(matches!(
        kv.pull(3, &mut NDArray::zeros(&[6])),
        Err(KvError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        kv.pull(3, &mut NDArray::zeros_dtype(&SHAPE, DType::I32)),
        Err(KvError::DTypeMismatch { .. })
    ));
    assert!(matches!(
        kv.push([3, 3, 3], &vec![ones.clone(); 2]),
        Err(KvError::LengthMismatch { keys: 3, values: 2 })
    ));
    let empty: Vec<NDArray> = Vec::new();
    assert!(matches!(kv.push(3, &empty), Err(KvError::EmptyValues(_))));
    // One bad key in a list: nothing of the list is applied.
    kv.init(8, &ones).unwrap();
    let vals = vec![ones.clone() * 5.0, NDArray::ones(&[1])];
    assert!(kv.push([3, 8], &vals).is_err());
    // A bad value in a device list: nothing applied either.
    assert!(kv
        .push(3, &vec![ones.clone(), NDArray::ones(&[7])])
        .is_err());
    // Double init inside one call, and a list of two values for one key.
    assert!(matches!(
        kv.init([20, 20], &vec![ones.clone(); 2]),
        Err(KvError::DoubleInit(_))
    ));
    assert!(matches!(
        kv.init(21, &vec![ones.clone(); 2]),
        Err(KvError::DoubleInit(_))
    ));
    assert!(matches!(kv.push(20, &ones), Err(KvError::UnknownKey(_))));

    assert_eq!(pull(&mut kv, 3), vec![2.0; 6], "the stored value is intact");
    assert_eq!(pull(&mut kv, 8), vec![1.0; 6]);
    // Pull with one bad output of several leaves the good outputs untouched too.
    let mut outs = vec![NDArray::zeros(&SHAPE), NDArray::zeros(&[1])];
    assert!(kv.pull(3, &mut outs).is_err());
    assert_eq!(outs[0].to_vec::<f32>().unwrap(), vec![0.0; 6]);
    // pushpull validates the outputs before pushing.
    let mut bad_out = NDArray::zeros(&[6]);
    assert!(kv.pushpull(3, &(ones.clone() * 9.0), &mut bad_out).is_err());
    assert_eq!(pull(&mut kv, 3), vec![2.0; 6]);
}

/// An updater's refusal of `k`.
fn refused(k: &Key) -> kvstore::Result<()> {
    Err(KvError::Updater {
        key: k.clone(),
        reason: "no".into(),
    })
}

/// Whether `r` is an updater's error saying the key's value is lost.
fn says_lost(r: kvstore::Result<()>) {
    match r {
        Err(KvError::Updater { reason, .. }) => assert!(reason.contains("lost"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn updater_errors_propagate_and_shape_changes_are_refused() {
    let mut kv = store_with_key3();
    kv.set_updater(|k, _, _| refused(k)).unwrap();
    assert!(matches!(
        kv.push(3, &NDArray::ones(&SHAPE)),
        Err(KvError::Updater { .. })
    ));
    kv.set_updater(|_, _, stored| {
        *stored = NDArray::zeros(&[1]);
        Ok(())
    })
    .unwrap();
    // Pushed as a list, so the key has a merge buffer of its shape.
    let two = [NDArray::ones(&SHAPE), NDArray::ones(&SHAPE)];
    assert!(matches!(kv.push(3, &two), Err(KvError::Updater { .. })));
    // The value the updater threw away is lost: every call of the key says so (before, the
    // key held the [1] array, and a push of two [1] values panicked in the old-shape merge
    // buffer), until the key is initialised again.
    let ones1 = [NDArray::ones(&[1]), NDArray::ones(&[1])];
    for r in [
        kv.push(3, &ones1),
        kv.push(3, &two),
        kv.pull(3, &mut NDArray::zeros(&[1])),
        kv.pull(3, &mut NDArray::zeros(&SHAPE)),
    ] {
        says_lost(r);
    }
    kv.set_updater(|_, input, stored| stored.copy_from(input))
        .unwrap();
    kv.init(3, &(NDArray::ones(&SHAPE) * 5.0)).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![5.0; 6]);
    kv.push(3, &two).unwrap();
    assert_eq!(pull(&mut kv, 3), vec![2.0; 6]);
    // An updater that replaced the value and then failed has lost it as much (before, the key
    // held the [1] array, and took pushes of that shape).
    kv.set_updater(|k, _, stored| {
        *stored = NDArray::zeros(&[1]);
        refused(k)
    })
    .unwrap();
    assert!(matches!(
        kv.push(3, &NDArray::ones(&SHAPE)),
        Err(KvError::Updater { .. })
    ));
    says_lost(kv.push(3, &NDArray::ones(&[1])));
}

#[test]
fn the_store_never_aliases_caller_arrays() {
    let mut kv = create("local").unwrap();
    let mut v = NDArray::ones(&SHAPE);
    kv.init(1, &v).unwrap();
    v.fill(100.0);
    let mut out = NDArray::zeros(&SHAPE);
    kv.pull(1, &mut out).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![1.0; 6]);
    let mut p = NDArray::ones(&SHAPE) * 4.0;
    kv.push(1, &p).unwrap();
    p.fill(-1.0);
    kv.pull(1, &mut out).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![4.0; 6]);
    out.fill(0.0);
    let mut again = NDArray::zeros(&SHAPE);
    kv.pull(1, &mut again).unwrap();
    assert_eq!(again.to_vec::<f32>().unwrap(), vec![4.0; 6]);
}

#[test]
fn string_keys_and_no_mixing() {
    let mut kv = create("local").unwrap();
    kv.init(["weight", "bias"], &vec![NDArray::ones(&SHAPE); 2])
        .unwrap();
    kv.push("weight", &ones_on(2)).unwrap();
    let mut out = NDArray::zeros(&SHAPE);
    kv.pull("weight", &mut out).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![2.0; 6]);
    assert!(matches!(
        kv.init(3, &NDArray::ones(&SHAPE)),
        Err(KvError::MixedKeyTypes(_))
    ));
}

#[test]
fn a_refused_call_does_not_choose_the_kind_of_keys() {
    // Only keys stored choose whether the store's keys are ints or strs: a pull, push or
    // broadcast that is refused leaves the store as it was.
    let mut kv = create("local").unwrap();
    let mut out = NDArray::zeros(&SHAPE);
    assert!(matches!(
        kv.pull("w", &mut out),
        Err(KvError::UnknownKey(_))
    ));
    assert!(matches!(
        kv.push("w", &NDArray::ones(&SHAPE)),
        Err(KvError::UnknownKey(_))
    ));
    let mut wrong = NDArray::zeros(&[2]);
    assert!(matches!(
        kv.broadcast("w", &NDArray::ones(&SHAPE), &mut wrong),
        Err(KvError::ShapeMismatch { .. })
    ));
    kv.init(3, &NDArray::ones(&SHAPE)).unwrap();
    kv.pull(3, &mut out).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![1.0; 6]);
    // A refused init of a str key leaves the int keys the store's kind too.
    assert!(matches!(
        kv.init("w", &NDArray::ones(&SHAPE)),
        Err(KvError::MixedKeyTypes(_))
    ));
    kv.init(4, &NDArray::ones(&SHAPE)).unwrap();
}

#[test]
fn duplicate_keys_in_one_push_are_summed() {
    let mut kv = store_with_key3();
    kv.push(
        [3, 3],
        &vec![NDArray::ones(&SHAPE), NDArray::ones(&SHAPE) * 2.0],
    )
    .unwrap();
    assert_eq!(pull(&mut kv, 3), vec![3.0; 6]);
}

#[test]
fn pushpull_and_optimizers() {
    let mut kv = create("local").unwrap();
    kv.init(0, &NDArray::zeros(&SHAPE)).unwrap();
    kv.set_optimizer(Optimizer::sgd(0.1)).unwrap();
    let mut out = NDArray::zeros(&SHAPE);
    kv.pushpull(0, &NDArray::ones(&SHAPE), &mut out).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![-0.1; 6]);
    kv.pushpull(0, &ones_on(4), &mut out).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![-0.1f32 - 0.4f32; 6]);
    kvstore::register_updater("halve_then_add", |_, input, stored| {
        stored.scale_inplace(0.5);
        stored.add_assign(input)
    });
    kv.set_server_updater("halve_then_add").unwrap();
    kv.init(1, &(NDArray::ones(&SHAPE) * 4.0)).unwrap();
    kv.push(1, &NDArray::ones(&SHAPE)).unwrap();
    let mut o = NDArray::zeros(&SHAPE);
    kv.pull(1, &mut o).unwrap();
    assert_eq!(o.to_vec::<f32>().unwrap(), vec![3.0; 6]);
    assert!(kv.set_server_updater("nope").is_err());
}

#[test]
fn every_dtype_round_trips() {
    let mut kv = create("local").unwrap();
    for (i, dt) in DType::ALL.into_iter().enumerate() {
        kv.init(i as i32, &NDArray::full_dtype(&[4], 3.0, dt))
            .unwrap();
        kv.push(i as i32, &vec![NDArray::full_dtype(&[4], 2.0, dt); 2])
            .unwrap();
        let mut out = NDArray::zeros_dtype(&[4], dt);
        kv.pull(i as i32, &mut out).unwrap();
        assert_eq!(out.to_f64_vec(), vec![4.0; 4], "{dt}");
    }
}

#[test]
fn local_barrier_returns_at_once() {
    let mut kv = create("local").unwrap();
    kv.barrier().unwrap();
}

#[test]
fn broadcast_priority_pull_into_and_scalars() {
    let mut kv = create("local").unwrap();
    assert_eq!(kv.type_name(), "local");
    assert_eq!(kv.r#type(), "local");
    let mut out = NDArray::zeros(&SHAPE);
    kv.broadcast(4, &(NDArray::ones(&SHAPE) * 2.5f32), &mut out)
        .unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), [2.5; 6]);
    // broadcast initialises: twice is a double init.
    assert!(matches!(
        kv.broadcast(4, &NDArray::ones(&SHAPE), &mut out),
        Err(KvError::DoubleInit(_))
    ));
    // An output that does not fit is refused before anything is stored: the key can be
    // broadcast again, right.
    assert!(matches!(
        kv.broadcast(9, &NDArray::ones(&SHAPE), &mut NDArray::zeros(&[3])),
        Err(KvError::ShapeMismatch { .. })
    ));
    kv.broadcast(9, &NDArray::ones(&SHAPE), &mut out).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), [1.0; 6]);
    kv.with_priority(7)
        .push(4, &(NDArray::ones(&SHAPE) * 3))
        .unwrap();
    let mut flat = [0.0f32; 6];
    kv.with_priority(-3).pull_into(4, &mut flat).unwrap();
    assert_eq!(flat, [3.0; 6]);
    assert!(matches!(
        kv.pull_into(4, &mut [0.0f64; 6]),
        Err(KvError::DTypeMismatch { .. })
    ));
    assert!(matches!(
        kv.pull_into(4, &mut [0.0f32; 5]),
        Err(KvError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        kv.pull_into(99, &mut flat),
        Err(KvError::UnknownKey(_))
    ));
    assert_eq!(kv.key_info(4).unwrap(), (SHAPE.to_vec(), DType::F32));
    assert!(matches!(
        NDArray::try_zeros(&[usize::MAX, 2]),
        Err(KvError::TooLarge { .. })
    ));
    assert!(matches!(
        NDArray::try_zeros_dtype(&[1 << 62, 4], DType::F64),
        Err(KvError::TooLarge { .. })
    ));
    assert_eq!(NDArray::try_zeros(&[2, 2]).unwrap().size(), 4);
    // Sizes within the address range that no layout takes, or no allocator gives, are refused
    // as well (they panicked making the layout, or aborted the process).
    assert!(matches!(
        NDArray::try_zeros(&[(1 << 61) - 1]),
        Err(KvError::TooLarge { .. })
    ));
    assert!(matches!(
        NDArray::try_zeros(&[1 << 60]),
        Err(KvError::TooLarge { .. })
    ));
    assert!(matches!(
        kv.alloc_on(&[isize::MAX as usize], DType::U8, kvstore::Device::Cpu(0)),
        Err(KvError::TooLarge { .. })
    ));
    // Shapes whose element count wraps (to 0 here) are refused by every constructor, in
    // every build: none makes an array whose storage is smaller than its shape says.
    let huge = [1usize << 32, 1 << 32];
    for r in [
        NDArray::from_vec(&huge, Vec::<f32>::new()),
        NDArray::from_slice(&huge, &[] as &[u8]),
        NDArray::from_bytes(&huge, DType::U8, &[]),
        create("local").unwrap().alloc(&[usize::MAX], DType::U8),
    ] {
        assert!(matches!(r, Err(KvError::TooLarge { .. })), "{r:?}");
    }
    for shape in [[usize::MAX, 1], [1 << 62, 4]] {
        let made = std::panic::catch_unwind(|| NDArray::ones(&shape));
        assert!(made.is_err(), "an array of {shape:?} was made");
    }
}
