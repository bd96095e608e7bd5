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
