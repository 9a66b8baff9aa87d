//! The remote command line and its wrapper, run as ssh would run them.

use super::*;

#[test]
fn a_group_seen_empty_after_its_leader_ended_is_not_signalled_again() {
    let spawn = |script: &str| {
        let args = ["-c".to_string(), script.to_string()];
        Child::spawn(
            RoleName::Worker(0),
            None,
            &[],
            Path::new("/bin/sh"),
            &args,
            &[],
        )
        .unwrap()
    };
    let wait = |c: &mut Child, gone: bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(c.poll().is_some() && c.group_gone == gone) {
            assert!(Instant::now() < deadline, "gone={gone}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    // A leader that left a process behind: its group lives on after it (and is stopped
    // with it); once empty, it is gone for good.
    let mut c = spawn("sleep 1 & exit 0");
    wait(&mut c, false);
    assert!(c.group_lives());
    wait(&mut c, true);
    assert!(!c.group_lives());
    let mut c = spawn("exit 0");
    wait(&mut c, true);
}

#[test]
fn the_secret_never_goes_on_the_remote_command_line_and_the_wrapper_reads_it() {
    let env = vec![
        ("DMLC_ROLE".to_string(), "worker".to_string()),
        (SECRET_VAR.to_string(), "0123456789abcdef-hush".to_string()),
    ];
    let cmd = remote_command(Path::new("/bin/prog"), &["a b".into()], &env);
    assert!(!cmd.contains("hush"), "{cmd}");
    assert!(cmd.contains("DMLC_ROLE=worker"), "{cmd}");
    // Run the wrapper as ssh would, with the secret as stdin's first line: the program
    // sees it in its environment.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(REMOTE_WRAPPER)
        .args([
            "kvrun-remote",
            "/",
            "sh",
            "-c",
            "printf %s \"$KVSTORE_SECRET\"",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::{Read, Write};
            // Stdin stays open while the program runs (its end stops the program).
            let mut i = c.stdin.take().unwrap();
            writeln!(i, "0123456789abcdef-hush")?;
            let mut out = String::new();
            c.stdout.take().unwrap().read_to_string(&mut out)?;
            drop(i);
            c.wait()?;
            Ok(out)
        })
        .unwrap();
    assert_eq!(out, "0123456789abcdef-hush");
}

/// Runs a remote command as ssh would (`SHELL -c COMMAND`, from `/`), the secret as
/// stdin's first line and stdin open while it runs: its stdout, and how it ended.
fn run_as_ssh(shell: &str, cmd: &str) -> (String, std::process::Output) {
    let mut c = Command::new(shell)
        .arg("-c")
        .arg(cmd)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut i = c.stdin.take().unwrap();
    writeln!(i, "0123456789abcdef-hush").unwrap();
    let out = {
        use std::io::Read;
        let mut o = String::new();
        c.stdout.take().unwrap().read_to_string(&mut o).unwrap();
        o
    };
    drop(i);
    (out, c.wait_with_output().unwrap())
}

/// A program whose path has a `=` (a run directory such as `lr=0.1`) runs, with its
/// arguments and environment; before, `env` took the path for a variable, and printed the
/// environment (the secret with it) where no argument followed.
#[test]
fn a_remote_program_whose_path_has_an_equals_sign_runs() {
    let dir = std::env::temp_dir().join(format!("kvrun-eq-{}/lr=0.1", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prog = dir.join("prog");
    std::fs::write(
        &prog,
        "#!/bin/sh\nprintf 'ran %s %s' \"$DMLC_ROLE\" \"$#\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
    let env = vec![
        ("DMLC_ROLE".to_string(), "worker".to_string()),
        (SECRET_VAR.to_string(), "0123456789abcdef-hush".to_string()),
    ];
    for (args, want) in [
        (vec![], "ran worker 0"),
        (vec!["x=1".to_string()], "ran worker 1"),
    ] {
        let cmd = remote_command(&prog, &args, &env);
        let (out, _) = run_as_ssh("/bin/sh", &cmd);
        assert_eq!(out, want, "{cmd}");
    }
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn the_remote_command_runs_the_same_under_a_posix_or_a_csh_login_shell() {
    let env = vec![
        ("DMLC_ROLE".to_string(), "worker".to_string()),
        ("ODD".to_string(), "it's $HOME; `x` ! !$ !!x".to_string()),
        ("LINES".to_string(), "one\ntwo\\n\n".to_string()),
        (SECRET_VAR.to_string(), "0123456789abcdef-hush".to_string()),
    ];
    let script = "printf '%s|%s|%s|%s|%s|%s|%s|%s' \"$KVSTORE_SECRET\" \"$DMLC_ROLE\" \"$ODD\" \
         \"$LINES\" \"$PWD\" \"$1\" \"$2\" \"$3\"";
    let odd_args = ["a b'c", "hi!there\r\n", "kvrun-b:\\0041\u{e9}"];
    let mut args = vec!["-c".to_string(), script.to_string(), "zero".to_string()];
    args.extend(odd_args.iter().map(|a| a.to_string()));
    let cmd = remote_command(Path::new("/bin/sh"), &args, &env);
    assert!(!cmd.contains('\n'), "{cmd}");
    let cwd = std::env::current_dir().unwrap();
    // ssh runs the command with the user's login shell: `SHELL -c COMMAND`.
    let shells: Vec<&str> = ["/bin/sh", "/bin/csh", "/bin/tcsh"]
        .into_iter()
        .filter(|s| Path::new(s).exists())
        .collect();
    for shell in &shells {
        let (out, done) = run_as_ssh(shell, &cmd);
        assert_eq!(
            out,
            format!(
                "0123456789abcdef-hush|worker|it's $HOME; `x` ! !$ !!x|one\ntwo\\n\n|{}|{}",
                cwd.display(),
                odd_args.join("|")
            ),
            "{shell}: {}",
            String::from_utf8_lossy(&done.stderr)
        );
    }
    assert!(shells.contains(&"/bin/sh"));
}
