//! Restarts that cannot help (`--max-no-progress-restarts`, `--progress-regex`; src/retry.rs),
//! with real processes: a Python program (tests/python/no_progress.py) whose rank 1 fails at a
//! step it printed, the same way on every attempt or not, under `--max-restarts 10`. The
//! fault matrix's rows of the same rule are tests/faults.rs'.

mod common;

use common::*;
use serde_json::Value;

/// Runs the program in `mode` on two workers with `flags`: nrun's output and its report.
fn run(mode: &str, flags: &[&str]) -> (std::process::Output, Value, Scene) {
    let s = Scene::new();
    let report = s.dir.path().join("report.json");
    let script = py_script("no_progress.py");
    let mut args = vec!["--nproc", "2", "--max-restarts", "10"];
    args.extend(flags);
    args.extend(["--report", report.to_str().unwrap(), &script, mode]);
    let out = s.run(&args, &[]);
    let r: Value = std::fs::read_to_string(&report)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| panic!("no report; stderr: {}", text(&out.stderr)));
    s.assert_no_survivors();
    (out, r, s)
}

const STEP: &[&str] = &["--progress-regex", r"step (\d+)"];

fn ctx(out: &std::process::Output) -> String {
    format!("--- stderr\n{}", text(&out.stderr))
}

/// The issue's target: the same failure at step 5 on every attempt stops after 3 restarts,
/// with the program's exit code and a line that says why.
#[test]
fn the_same_failure_with_no_progress_stops_after_three_restarts() {
    let (out, r, s) = run("same", STEP);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{}", ctx(&out));
    assert_eq!(r["job"]["restarts"], 3, "{}", ctx(&out));
    assert_eq!(r["job"]["attempts"], 4, "{}", ctx(&out));
    let line = err
        .lines()
        .find(|l| l.starts_with("nrun: stopping: "))
        .unwrap_or_else(|| panic!("no stopping line\n{}", ctx(&out)));
    let script = py_script("no_progress.py");
    assert_eq!(
        line,
        format!(
            "nrun: stopping: attempts 1-3 failed the same way as attempt 0 (rank 1: ValueError \
             at {script}:20) with no progress past step 5; restarting cannot help \
             (--max-no-progress-restarts 3; 7 restarts were left)"
        )
    );
    // The report keeps each attempt's signature and progress, and why the job stopped.
    let failures = r["job"]["failures"].as_array().expect("job.failures");
    assert_eq!(failures.len(), 4, "{failures:?}");
    for (i, f) in failures.iter().enumerate() {
        assert_eq!(f["attempt"], i, "{f}");
        assert_eq!(f["progress_measure"], "step", "{f}");
        assert_eq!(f["progress_value"], 5, "{f}");
        assert_eq!(f["no_progress_restarts"], i, "{f}");
        assert_eq!(
            f["signature"],
            format!("rank 1: ValueError at {script}:20"),
            "{f}"
        );
    }
    let why = r["job"]["stopped_because"].as_str().unwrap_or_default();
    assert!(line.ends_with(why) && !why.is_empty(), "{why:?}");
    let last = r["job"]["decisions"]
        .as_array()
        .and_then(|d| d.last())
        .cloned();
    assert_eq!(
        last.as_ref().map(|d| d["action"].clone()),
        Some("stop (restarting cannot help)".into()),
        "{last:?}"
    );
    let events = r["events"].as_array().expect("events");
    let stop: Vec<&Value> = events
        .iter()
        .filter(|e| e["name"] == "no_progress_stop")
        .collect();
    assert_eq!(stop.len(), 1, "{events:?}");
    let m = &stop[0]["metadata"];
    for (k, v) in [
        ("base", 0),
        ("first", 1),
        ("last", 3),
        ("limit", 3),
        ("restarts_left", 7),
    ] {
        assert_eq!(m[k], v, "{k}: {m}");
    }
    // The incident page says it too.
    let report = s.dir.path().join("report.json");
    let page = s.dir.path().join("page.html");
    let drawn = s.run(
        &[
            "report",
            report.to_str().unwrap(),
            "-o",
            page.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(drawn.status.code(), Some(0), "{}", text(&drawn.stderr));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains(
            "restarting cannot help (--max-no-progress-restarts 3; 7 restarts were left)"
        ),
        "the page lacks the reason"
    );
}

/// More progress each attempt (step 5, 7, 9, ...), another exception each attempt, the rule
/// turned off, or no measure of progress: every restart runs (torchrun's floor).
#[test]
fn progress_another_failure_the_rule_off_or_no_measure_run_every_restart() {
    let cases: [(&str, &[&str]); 4] = [
        ("more", STEP),
        ("other", STEP),
        (
            "same",
            &[
                "--progress-regex",
                r"step (\d+)",
                "--max-no-progress-restarts",
                "0",
            ],
        ),
        ("same", &[]),
    ];
    for (mode, flags) in cases {
        let (out, r, _s) = run(mode, flags);
        let what = format!("{mode} {flags:?}\n{}", ctx(&out));
        assert_eq!(out.status.code(), Some(3), "{what}");
        assert_eq!(r["job"]["restarts"], 10, "{what}");
        assert!(!text(&out.stderr).contains("nrun: stopping:"), "{what}");
        assert!(r["job"].get("stopped_because").is_none(), "{what}");
        let failures = r["job"]["failures"].as_array().expect("job.failures");
        assert_eq!(failures.len(), 11, "{what}");
        if mode == "more" {
            let steps: Vec<u64> = failures
                .iter()
                .filter_map(|f| f["progress_value"].as_u64())
                .collect();
            assert_eq!(
                steps,
                (0..11).map(|a| 5 + 2 * a).collect::<Vec<_>>(),
                "{what}"
            );
        }
        if flags.is_empty() {
            // No pattern, no flight recorder: progress unknown, never counted.
            assert!(failures.iter().all(|f| f["progress"].is_null()), "{what}");
        }
    }
}

/// A pattern that is not one is a usage error naming the flag.
#[test]
fn a_bad_progress_regex_is_a_usage_error() {
    let s = Scene::new();
    let out = s.run(
        &["--progress-regex", r"step (\d+", "--no-python", "true"],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("nrun: error: --progress-regex 'step (\\d+' is not a regular expression"),
        "{err}"
    );
}
