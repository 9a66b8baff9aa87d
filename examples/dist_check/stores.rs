//! The scenarios of a store's own calls and keys: two stores of one process, and str keys
//! a server refuses.

use kvstore::{create, KVStore, KvError, NDArray};

use crate::{expect_vals, fail, ok, SHAPE};

/// A store of str keys whose workers initialise different keys (a program's bug): rank 1's
/// second key is on no server, whose refusal names it by its number on the wire; the error
/// names the key as the program does.
pub(crate) fn str_errors(kv: &mut KVStore) {
    let keys = if kv.rank() == 0 {
        vec!["a"]
    } else {
        vec!["b", "c"]
    };
    let vals = vec![NDArray::ones(&SHAPE); keys.len()];
    ok("init", kv.init(keys, &vals));
    if kv.rank() == 1 {
        match kv.pull("c", &mut NDArray::zeros(&SHAPE)) {
            Err(KvError::UnknownKey(kvstore::Key::Str(k))) if k == "c" => {
                println!(
                    "refused pull unknown: {}",
                    KvError::UnknownKey(kvstore::Key::Str(k))
                )
            }
            other => fail(format!("a pull of a key no server holds: {other:?}")),
        }
    }
}

/// Both workers of a job as two stores of this process (their ranks the scheduler's to give):
/// a call in flight of one is not the other's to wait for, though their call ids are alike.
pub(crate) fn two_stores(kind: &str) {
    // Before any thread reads the environment.
    std::env::remove_var("KVSTORE_RANK");
    let start = |v: f64| {
        let kind = kind.to_string();
        std::thread::spawn(move || {
            let mut kv = ok("create", create(&kind));
            ok("init", kv.init(20, &NDArray::full(&[4], v)));
            kv
        })
    };
    let (a, b) = (start(3.0), start(3.0));
    let join = |t: std::thread::JoinHandle<KVStore>| {
        t.join()
            .unwrap_or_else(|_| fail("a store's thread panicked".into()))
    };
    let (mut a, mut b) = (join(a), join(b));
    let mine = ok("pull_async", a.pull_async(20, vec![NDArray::zeros(&[4])]));
    let theirs = ok("pull_async", b.pull_async(20, vec![NDArray::zeros(&[4])]));
    match b.wait(mine) {
        Err(KvError::Unsupported(e)) if e.contains("another store") => {}
        other => fail(format!("a store waited for another's call: {other:?}")),
    }
    let got = ok("wait", b.wait(theirs));
    expect_vals("the store's own pull", &got[0], &[3.0; 4]);
    let again = ok("pull_async", a.pull_async(20, vec![NDArray::zeros(&[4])]));
    let got = ok("wait", a.wait(again));
    expect_vals("the other store's pull", &got[0], &[3.0; 4]);
    println!("two_stores ok");
}
