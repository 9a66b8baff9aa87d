//! Replays the fuzzers' seed corpus and every input they found to crash (tests/fuzz:
//! `corpus/TARGET`, `regressions/TARGET`) through the same entry points, so that a crash once
//! found stays fixed without AFL installed.

use std::path::Path;

fn replay(target: &str, run: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz");
    let mut n = 0;
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with('.'))
            {
                continue;
            }
            let data = std::fs::read(&p).unwrap();
            run(&data);
            n += 1;
        }
    }
    assert!(n > 0, "no inputs for {target}");
}

#[test]
fn frames() {
    replay("frames", kvstore_transport::fuzz::frames);
}

#[test]
fn protocol() {
    replay("protocol", kvstore::fuzz::protocol);
}

#[test]
fn shm() {
    replay("shm", kvstore_transport::fuzz::shm);
}
