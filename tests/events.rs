//! `--events`' schema held still: a local job that fails (an exit code, then a SIGKILL) and
//! restarts twice writes, field for field, the events of tests/golden/events.jsonl once what
//! varies from run to run (times, the run's id, the host, paths, durations) is masked. The
//! golden file was written by the binary before the events became one typed enum (issue 47):
//! a change of an event's name, field, message or order shows here. `NRUN_GOLDEN_WRITE=1`
//! writes it anew (for a change of schema meant as one, said in the commit).

mod common;

use std::path::Path;

use common::*;
use serde_json::{Value, json};

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/events.jsonl");

/// `s` with every duration ("0.12 s", "1 m 3 s") and share ("61.4%") said as N.
fn mask_numbers(s: &str) -> String {
    let words: Vec<&str> = s.split(' ').collect();
    let mut out = Vec::with_capacity(words.len());
    for (i, w) in words.iter().enumerate() {
        let unit = words
            .get(i + 1)
            .map(|u| u.trim_end_matches([',', ';']))
            .is_some_and(|u| ["s", "m", "h"].contains(&u));
        let share = w
            .strip_suffix('%')
            .is_some_and(|n| n.parse::<f64>().is_ok());
        out.push(match (w.parse::<f64>().is_ok() && unit, share) {
            (true, _) => "N",
            (_, true) => "N%",
            _ => w,
        });
    }
    out.join(" ")
}

/// One event with what varies from run to run masked.
fn normalize(mut v: Value, host: &str) -> Value {
    let run_id = v["metadata"]["run_id"].as_str().unwrap_or("").to_string();
    let repo = env!("CARGO_MANIFEST_DIR");
    let text = |s: &str| {
        let s = s.replace(&run_id, "<run_id>").replace(repo, "<repo>");
        match s.strip_prefix(host) {
            Some(rest) => format!("<host>{rest}"),
            None => s,
        }
    };
    for k in ["timestamp", "t"] {
        assert!(v[k].is_number(), "{k} in {v}");
        v[k] = json!(0);
    }
    if v["host"].as_str() == Some(host) {
        v["host"] = json!("<host>");
    }
    let name = v["name"].as_str().unwrap().to_string();
    if let Some(m) = v["message"].as_str().map(text) {
        v["message"] = json!(mask_numbers(&m));
    }
    let meta = v["metadata"].as_object_mut().unwrap();
    for (k, x) in meta.iter_mut() {
        match (name.as_str(), k.as_str()) {
            // A node's facts (GPUs, torch, NCCL) are the machine's: their names are the schema.
            ("node_joined", k) if k != "run_id" => *x = json!("<fact>"),
            ("attempt_start", "nodes") => *x = json!(["<host>"]),
            _ => {
                if let Some(s) = x.as_str() {
                    *x = json!(mask_numbers(&text(s)));
                }
            }
        }
    }
    v
}

/// The golden: the events of a job with a program's failure, a suspicion (SIGKILL) and
/// two restarts are those of the binary before the typed events, in the file and the report.
#[test]
fn the_events_of_a_failing_job_keep_their_schema() {
    let s = Scene::new();
    let dir = s.dir.path();
    let (events, report) = (dir.join("events.jsonl"), dir.join("report.json"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/events.sh");
    let out = s.run(
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--events",
            events.to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
            "--no-python",
            "sh",
            script.to_str().unwrap(),
        ],
        &[("EVENTS", events.to_str().unwrap())],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let lines: Vec<Value> = std::fs::read_to_string(&events)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let host = lines
        .iter()
        .find_map(|e| e["host"].as_str())
        .expect("an event names the host")
        .to_string();
    let got: Vec<String> = lines
        .iter()
        .map(|e| normalize(e.clone(), &host).to_string())
        .collect();
    // The report's events are the same, line for line.
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let in_report: Vec<String> = r["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| normalize(e.clone(), &host).to_string())
        .collect();
    assert_eq!(got, in_report);
    let got = got.join("\n") + "\n";
    if std::env::var_os("NRUN_GOLDEN_WRITE").is_some_and(|v| v == "1") {
        std::fs::write(GOLDEN, &got).unwrap();
    }
    let want = std::fs::read_to_string(GOLDEN).unwrap();
    for (i, (g, w)) in got.lines().zip(want.lines()).enumerate() {
        assert_eq!(g, w, "event {i} differs from {GOLDEN}");
    }
    assert_eq!(got.lines().count(), want.lines().count(), "{got}");
    s.assert_no_survivors();
}
