//! Real torch.distributed clients against nrun's store and under nrun's supervision. Needs the
//! venv that scripts/test.sh makes (or NRUN_TEST_PYTHON); without it each test says it skipped.

mod common;

use std::time::Duration;

use common::*;

fn python_or_skip(test: &str) -> Option<String> {
    match torch_python() {
        Some(p) => Some(p.display().to_string()),
        None => {
            eprintln!(
                "SKIPPED {test}: no python with torch (run scripts/test.sh, or set NRUN_TEST_PYTHON)"
            );
            None
        }
    }
}

fn script(name: &str) -> String {
    format!("{}/tests/python/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn every_store_operation_from_torchs_client() {
    let Some(py) = python_or_skip("every_store_operation_from_torchs_client") else {
        return;
    };
    let s = Scene::new();
    let out = s.run(&["--python", &py, &script("store_compat.py")], &[]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("14 passed, 0 failed"), "{stdout}");
}

/// The same checks against PyTorch's own (libuv) server: the expectations are torch's.
#[test]
fn store_expectations_hold_on_torchs_own_server() {
    let Some(py) = python_or_skip("store_expectations_hold_on_torchs_own_server") else {
        return;
    };
    let out = std::process::Command::new(&py)
        .args([&script("store_compat.py"), "--reference"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("14 passed, 0 failed"));
}

#[test]
fn gloo_all_reduce_on_four_ranks() {
    let Some(py) = python_or_skip("gloo_all_reduce_on_four_ranks") else {
        return;
    };
    let s = Scene::new();
    let out = s.run(
        &[
            "--nproc",
            "4",
            "--python",
            &py,
            &script("gloo_allreduce.py"),
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    for r in 0..4 {
        assert!(
            stdout.contains(&format!("[rank{r}]: rank {r}/4: all_reduce ok (10)")),
            "{stdout}"
        );
    }
    s.assert_no_survivors();
}

#[test]
fn ddp_example_trains() {
    let Some(py) = python_or_skip("ddp_example_trains") else {
        return;
    };
    let s = Scene::new();
    let train = format!("{}/examples/train.py", env!("CARGO_MANIFEST_DIR"));
    let out = s.run(
        &["--nproc", "2", "--python", &py, &train, "--steps", "5"],
        &[],
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(
        stdout.contains("[rank0]: done: 5 steps on 2 ranks"),
        "{stdout}"
    );
}

/// A worker decorated with torch's @record writes its traceback to TORCHELASTIC_ERROR_FILE;
/// the failure summary shows it.
#[test]
fn failure_summary_shows_the_error_file_traceback() {
    let Some(py) = python_or_skip("failure_summary_shows_the_error_file_traceback") else {
        return;
    };
    let s = Scene::new();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--python",
            &py,
            &script("fail_with_record.py"),
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("rank 1 of 2 exited with code 1 (first failure"),
        "{err}"
    );
    assert!(err.contains("traceback (from "), "{err}");
    assert!(err.contains("ValueError: rank 1 cannot go on"), "{err}");
    s.assert_no_survivors();
}

/// Restarted workers rendezvous again on the same store: stale keys of the failed attempt
/// must not leak into the next one.
#[test]
fn restart_rendezvous_again() {
    let Some(py) = python_or_skip("restart_rendezvous_again") else {
        return;
    };
    let s = Scene::new();
    let child = s.spawn(
        &[
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            "--python",
            &py,
            &script("fail_first_attempt.py"),
        ],
        &[],
    );
    let (out, _) = wait_with_timeout(child, Duration::from_secs(120));
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("attempt 1 all_reduce ok"), "{stdout}");
}

/// Every option of the installed torch's `torchrun` parser, with both spellings, is accepted by
/// nrun on a one-node command line (with a value where it takes one).
#[test]
fn every_torchrun_flag_parses() {
    let Some(py) = python_or_skip("every_torchrun_flag_parses") else {
        return;
    };
    let dump = std::process::Command::new(&py)
        .args([
            "-c",
            "import json; from torch.distributed.run import get_args_parser as g\n\
             print(json.dumps([[a.option_strings, a.nargs == 0] for a in g()._actions if a.option_strings]))",
        ])
        .output()
        .unwrap();
    assert!(dump.status.success(), "{}", text(&dump.stderr));
    let opts: Vec<(Vec<String>, bool)> = serde_json::from_slice(&dump.stdout).unwrap();
    assert!(opts.len() > 30, "{opts:?}");
    let s = Scene::new();
    let logs = s.dir.path().join("logs").display().to_string();
    let hello = s.dir.path().join("hello.py").display().to_string();
    std::fs::write(&hello, "print('hello')\n").unwrap();
    // A value each valued option can take on one node; the rest take torch's own defaults.
    let value = |flag: &str| -> &str {
        match flag.trim_start_matches('-').replace('_', "-").as_str() {
            "nnodes" => "1:1",
            "nproc-per-node" => "1",
            "rdzv-backend" => "static",
            "rdzv-endpoint" => "127.0.0.1:0",
            "rdzv-id" => "flagtest",
            "rdzv-conf" => "join_timeout=30,read_timeout=60",
            "max-restarts" => "0",
            "monitor-interval" => "0.1",
            "start-method" => "spawn",
            "event-log-handler" => "null",
            "role" => "trainer",
            "log-dir" => &logs,
            "r" | "redirects" | "t" | "tee" => "0",
            "log-line-prefix-template" => "[${role_name}${rank}]:",
            "local-ranks-filter" => "0",
            "duplicate-stdout-filters" | "duplicate-stderr-filters" => "x",
            "node-rank" => "0",
            "master-addr" => "127.0.0.1",
            "master-port" => "0",
            "local-addr" => "127.0.0.1",
            "logs-specs" => "default",
            "numa-binding" => "node",
            "signals-to-handle" => "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "shutdown-timeout" => "5",
            "print-completion" => "bash",
            other => panic!("no test value for torchrun's --{other}: add one (and support it)"),
        }
    };
    let mut failed = Vec::new();
    for (spellings, flag_only) in &opts {
        for spelling in spellings.iter().filter(|s| *s != "-h" && *s != "--help") {
            let mut args = vec![spelling.as_str()];
            if !flag_only {
                args.push(value(spelling));
            }
            // numa binding needs GPUs to mean anything; it is accepted either way.
            args.extend(["--no-preflight", "--watch", "off", "--no-python", "true"]);
            if *spelling == "-m" || *spelling == "--module" {
                args.truncate(1);
                args.extend(["--no-preflight", "--python", &py, "json.tool", "--help"]);
            }
            if spelling.contains("run") && spelling.contains("path") {
                args.truncate(1);
                args.extend(["--no-preflight", "--python", &py, &hello]);
            }
            if spelling.contains("no-python") || spelling.contains("no_python") {
                args.truncate(1);
                args.extend(["--no-preflight", "true"]);
            }
            let out = s.run(&args, &[]);
            let ok = match spelling.contains("completion") {
                true => out.status.success() && text(&out.stdout).contains("complete"),
                false => out.status.success(),
            };
            if !ok {
                failed.push(format!(
                    "{}: exit {:?}: {}",
                    args.join(" "),
                    out.status.code(),
                    text(&out.stderr)
                ));
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}
