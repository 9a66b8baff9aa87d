//! A distributed store's calls and keys are its own: two stores of one process, and a str
//! key named as the program names it in a server's refusal.

mod util;

use std::time::Duration;

use util::{assert_job_ok, finish, kvrun_check, ManualJob};

/// A str key that no server holds is named as the program names it, not by its number on
/// the wire (before: `UnknownKey(Int(1))`).
#[test]
fn a_servers_refusal_names_a_str_key_as_the_program_does() {
    for t in ["tcp", "shm"] {
        let r = kvrun_check(2, 2, "str_errors", "dist_sync", &[("KVSTORE_TRANSPORT", t)]);
        assert_job_ok(&r, 2, "str_errors");
        assert!(
            r.stdout
                .contains("refused pull unknown: key c has not been initialised"),
            "{}",
            r.all()
        );
    }
}

/// Two distributed stores in one process: waiting on one for the other's call is refused
/// (their call ids are alike: before, it returned the waiting store's own call as this one).
#[test]
fn a_store_refuses_to_wait_for_another_stores_call() {
    let mut job = ManualJob::start_some(2, 1, 1, &["two_stores", "dist_sync"], &[]);
    let w = job.workers.remove(0);
    let (code, out) = finish(w, Duration::from_secs(60));
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("two_stores ok"), "{out}");
    job.kill_all();
}
