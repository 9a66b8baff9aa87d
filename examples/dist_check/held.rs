//! A round whose first push the server holds where it lies (a `kv.alloc` array sent over
//! shared memory) fails once that worker leaves before the round completes: its process may
//! write those pages again, and the round must not sum what it wrote.

use std::io::Write;
use std::time::Duration;

use kvstore::{create, DType, KVStore, KvError, NDArray};

use crate::{expect_vals, fail, ok, pulled};

/// Worker 0 pushes from its `kv.alloc` pages; worker 1 pushes only after worker 0's push has
/// timed out (`KVSTORE_TIMEOUT`) and worker 0 has left and filled those pages with NaN. Over
/// shared memory the server held worker 0's push in its pages, so the round fails when worker
/// 0 says goodbye: worker 1's push is refused, naming worker 0, and the stored value is
/// unchanged. Over TCP worker 0's push was copied whole to the server before its call timed
/// out: the round completes with it.
pub(crate) fn leave_held(kv: &mut KVStore) {
    let n = 1 << 14;
    let shm = kv.transports().iter().all(|t| *t == "shm");
    ok("init", kv.init(0, &NDArray::zeros(&[n])));
    ok("barrier", kv.barrier());
    if kv.rank() == 0 {
        let mut a = ok("alloc", kv.alloc(&[n], DType::F32));
        a.fill(1.0);
        match kv.push(0, &a) {
            Err(KvError::Timeout { .. }) => {}
            other => fail(format!("a push waiting on worker 1: {other:?}")),
        }
        // Goodbye: the store's links close, and the pages are the program's again.
        drop(std::mem::replace(kv, ok("a local store", create("local"))));
        a.fill(f64::NAN);
        println!("leave_held: worker 0 left and wrote NaN into its pages");
        let _ = std::io::stdout().flush();
        std::process::exit(0);
    }
    let timeout: f64 = std::env::var("KVSTORE_TIMEOUT")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| fail("leave_held needs KVSTORE_TIMEOUT".into()));
    std::thread::sleep(Duration::from_secs_f64(timeout) + Duration::from_secs(2));
    let pushed = kv.push(0, &NDArray::full(&[n], 2.0));
    let want = match (shm, pushed) {
        (true, Err(e)) if e.to_string().contains("worker 0") => {
            println!("leave_held: the push after worker 0 left failed: {e}");
            0.0
        }
        (false, Ok(())) => 3.0,
        (_, other) => fail(format!(
            "a push after worker 0 left (shm: {shm}): {other:?}"
        )),
    };
    expect_vals(
        "pulled after worker 0 left",
        &pulled(kv, 0, &[n], DType::F32),
        &vec![want; n],
    );
}
