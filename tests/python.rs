//! The Python package's tests (`python/tests`, pytest), run by `cargo test`: the package is
//! built and installed (`pip install ./python`, which fetches maturin, numpy, cloudpickle and
//! pytest from PyPI) into a virtual environment under `target/`, and pytest runs against it
//! with this build's `kvrun`. A machine without `python3` skips them, saying so.

mod util;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn run(cmd: &mut Command, what: &str, limit: Duration) -> util::Run {
    let r = util::run_limited(cmd, limit);
    assert_eq!(r.code, Some(0), "{what} failed\n{}", r.all());
    r
}

#[test]
fn the_python_package_passes_its_tests() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if Command::new(&python).arg("--version").output().is_err() {
        return util::skip(&format!(
            "no {python}: the Python package's tests did not run"
        ));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = util::target_dir().join("pyenv");
    let py = venv.join("bin").join("python");
    if !py.exists() {
        run(
            Command::new(&python).args(["-m", "venv"]).arg(&venv),
            "making a virtual environment",
            Duration::from_secs(300),
        );
    }
    run(
        Command::new(&py)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .arg(format!("{}[test]", root.join("python").display()))
            .current_dir(root),
        "pip install ./python",
        Duration::from_secs(1500),
    );
    let r = run(
        Command::new(&py)
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "python/tests",
            ])
            .env("KVRUN", util::bin("kvrun"))
            .env("OPENBLAS_NUM_THREADS", "1")
            .current_dir(root),
        "pytest python/tests",
        Duration::from_secs(900),
    );
    // pytest's summary names its skips ("3 passed, 1 skipped in 2.0s"): a skip here is a test
    // that did not run, which fails where `KVSTORE_TEST_STRICT=1` says every test must.
    if let Some(summary) = r.stdout.lines().rev().find(|l| l.contains(" skipped")) {
        util::skip(&format!("pytest skipped tests: {summary}\n{}", r.all()));
    }
}
