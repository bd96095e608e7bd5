//! Words that are true (issue 47): what nrun says of a path it cannot use (a directory, a file
//! that does not run), of a flag's file it cannot write (before the job, naming the flag), of
//! torchrun's variables it replaces in the workers; the shells it completes; and the README's
//! first command runs as written. Runs the real binary.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;

/// A usage error: exit 2, one line naming `expect`, never a panic.
fn refused(out: &Output, args: &[&str], expect: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        err.contains(expect),
        "{args:?}: expected {expect:?} in: {err}"
    );
    assert_eq!(err.lines().count(), 1, "{args:?}: not one line: {err}");
    assert!(err.starts_with("nrun: error: "), "{err}");
}

#[test]
fn an_unusable_python_or_target_says_what_it_is() {
    let s = Scene::new();
    let d = s.dir.path().to_str().unwrap();
    let plain = s.dir.path().join("plain");
    std::fs::write(&plain, "").unwrap();
    std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
    let plain = plain.to_str().unwrap();
    let script = s.dir.path().join("x.py");
    std::fs::write(&script, "").unwrap();
    let script = script.to_str().unwrap();
    for (args, expect) in [
        (vec![d], format!("script {d} is a directory (cwd ")),
        (
            vec!["--no-python", d],
            format!("program {d} is a directory"),
        ),
        (
            vec!["--python", d, script],
            format!("python interpreter {d} is a directory"),
        ),
        (
            vec!["--python", plain, script],
            format!("python interpreter {plain} is not executable (mode 644)"),
        ),
    ] {
        refused(&s.run(&args, &[]), &args, &expect);
    }
}

/// Runs nrun with `args` as a user other than root where the tests run as root (nobody, by
/// setpriv), so that a directory's permissions bind; None (said) where that cannot be.
fn as_unprivileged(s: &Scene, args: &[&str]) -> Option<Output> {
    let mut c = match nix::unistd::geteuid().is_root() {
        true => {
            if Command::new("setpriv").arg("--version").output().is_err() {
                missing_tool("as_unprivileged", "setpriv (util-linux)");
                return None;
            }
            let mut c = Command::new("setpriv");
            c.args([
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                "--",
            ])
            .arg(nrun_bin());
            c
        }
        false => Command::new(nrun_bin()),
    };
    let out = c
        .args(args)
        .current_dir(s.dir.path())
        .env("NRUN_TEST_TAG", &s.tag)
        // Not root's home: its .nrun_env is refused to another user before the flags are.
        .env("HOME", s.dir.path())
        .env_remove("NRUN_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    Some(out)
}

/// `--log-dir` and `--exclude-file` that cannot be written are refused before anything starts,
/// naming the flag: no "worker logs go to" line, no worker run.
#[test]
fn an_unwritable_log_dir_or_exclude_file_is_refused_before_the_job() {
    let s = Scene::new();
    let file = s.dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    let under_file = file.join("sub");
    let under_file = under_file.to_str().unwrap();
    let mark = s.mark();
    let worker = format!("echo ran >> {}", mark.display());
    let job = |flag: &str, path: &str| -> Vec<String> {
        [
            flag,
            path,
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            worker.as_str(),
        ]
        .map(String::from)
        .to_vec()
    };
    let check = |out: &Output, args: &[String], expect: &[&str]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        for e in expect {
            refused(out, &args, e);
        }
        assert!(!text(&out.stderr).contains("worker logs go to"));
        assert!(!mark.exists(), "{args:?}: a worker ran");
    };
    let args = job("--log-dir", under_file);
    check(
        &s.run(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]),
        &args,
        &[&format!(
            "--log-dir {under_file}: {} is not a directory",
            file.display()
        )],
    );
    let args = job("--exclude-file", under_file);
    check(
        &s.run(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]),
        &args,
        &[&format!("--exclude-file {under_file}: cannot write it")],
    );

    // A directory this user may not write in.
    std::fs::set_permissions(s.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ro = s.dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let logs = ro.join("logs");
    let logs = logs.to_str().unwrap();
    let args = job("--log-dir", logs);
    let Some(out) = as_unprivileged(&s, &args.iter().map(String::as_str).collect::<Vec<_>>())
    else {
        return;
    };
    check(
        &out,
        &args,
        &[
            &format!(
                "--log-dir {logs}: nrun cannot create the run's log directory in {}",
                ro.display()
            ),
            "Permission denied",
            "give a directory you may write in",
        ],
    );
    let bad = ro.join("bad-nodes");
    let bad = bad.to_str().unwrap();
    let args = job("--exclude-file", bad);
    let out = as_unprivileged(&s, &args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    check(
        &out,
        &args,
        &[
            &format!("--exclude-file {bad}: cannot write it"),
            "Permission denied",
        ],
    );
}

/// torchrun's variables set in nrun's environment are named once as replaced, and the workers
/// get the job's own; without them nothing is said.
#[test]
fn torchrun_variables_in_the_environment_are_named_once_as_replaced() {
    let s = Scene::new();
    let worker = "echo \"$RANK $WORLD_SIZE $MASTER_PORT\" >> \"$MARK\"";
    let args = ["--nproc", "2", "--no-python", "sh", "-c", worker];
    let out = s.run(
        &args,
        &[("MASTER_PORT", "1"), ("RANK", "5"), ("WORLD_SIZE", "9")],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let said: Vec<&str> = err.lines().filter(|l| l.contains("set for nrun")).collect();
    assert_eq!(said.len(), 1, "{err}");
    assert!(
        said[0].starts_with("nrun: warning: RANK, WORLD_SIZE, MASTER_PORT set for nrun"),
        "{err}"
    );
    assert!(said[0].contains("--master-addr/--master-port"), "{err}");
    let mut marks = s.marks();
    marks.sort();
    assert_eq!(marks.len(), 2, "{marks:?}");
    for (i, m) in marks.iter().enumerate() {
        let w: Vec<&str> = m.split(' ').collect();
        assert_eq!(w[..2], [i.to_string().as_str(), "2"], "{marks:?}");
        assert_ne!(
            w[2], "1",
            "the workers' MASTER_PORT is the store's: {marks:?}"
        );
    }

    let s = Scene::new();
    let mut c = s.cmd(&args);
    for k in [
        "MASTER_PORT",
        "MASTER_ADDR",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
    ] {
        c.env_remove(k);
    }
    let out = c.output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("set for nrun"),
        "{}",
        text(&out.stderr)
    );
}

/// `--print-completion`'s help names every shell it serves, and each is served.
#[test]
fn every_completion_shell_is_named_and_served() {
    let s = Scene::new();
    let help = text(&s.run(&["--help"], &[]).stdout);
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    let at = flat
        .find("--print-completion <SHELL>")
        .expect("--print-completion in --help");
    let about = &flat[at..(at + 200).min(flat.len())];
    assert!(
        about.contains("(bash, zsh, fish, elvish or powershell)"),
        "{about}"
    );
    for sh in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = s.run(&["--print-completion", sh], &[]);
        assert_eq!(out.status.code(), Some(0), "{sh}: {}", text(&out.stderr));
        assert!(text(&out.stdout).contains("nrun"), "{sh}: no script");
    }
}

/// The README's first command, as written, from the repository's root: the example it names
/// takes the flags it passes (the venv's python with torch, given as NRUN_PYTHON).
#[test]
fn readmes_first_command_runs_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let first = readme
        .split("```sh\n")
        .skip(1)
        .find_map(|b| {
            let block = b.split("```").next()?;
            block.lines().find(|l| l.starts_with("nrun "))
        })
        .expect("an nrun command in README");
    let (cmd, _) = first.split_once('#').unwrap_or((first, ""));
    let args: Vec<&str> = cmd.split_whitespace().skip(1).collect();
    assert!(
        args.iter()
            .any(|a| a.ends_with(".py") && root.join(a).is_file()),
        "README's first command names no script of this repository: {first}"
    );
    let Some(py) = need_torch() else { return };
    let s = Scene::new();
    let out = s
        .cmd(&args)
        .current_dir(root)
        .env("NRUN_PYTHON", &py)
        .output()
        .unwrap();
    let (o, e) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{first}:\n{o}\n{e}");
    assert!(o.contains("done: "), "{first}:\n{o}\n{e}");
    // The flag reached the script (it prints what it took).
    if let Some(lr) = args.iter().position(|a| *a == "--lr").map(|i| args[i + 1]) {
        assert!(o.contains(&format!("lr={lr} ")), "{first}:\n{o}\n{e}");
    }
}
