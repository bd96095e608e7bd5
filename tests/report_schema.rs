//! The `--report` schema holds still: a cheap local job's report (a failure, a restart in
//! place), normalized, is compared with a golden file the binary wrote before the report became
//! typed structs (tests/fixtures/report/golden/), and so is the page `nrun report` draws from
//! each report fixture (golden/pages/). (`nrun report` refusing what is not a report:
//! tests/report_html.rs and the schema's unit tests.)
//!
//! Normalized: every float (times, shares) becomes `"<f64>"`, which keeps its type (an integer
//! stays an integer); the volatile integers (`timestamp`, `pid`) become `"<int>"`; in strings, the
//! run id, the repository's path and the host's name become placeholders and decimals `<n>`.
//! Events are compared by kind: for each event name, the keys it has and the JSON types each
//! key took (the events' own golden comparison is the journal's); which events a run emits races
//! only in `first_progress` of the second attempt (its workers may exit before their output is
//! read), so names are compared as a set.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use common::*;
use serde_json::{Map, Value, json};

const GOLDEN: &str = "report/golden/job-fail-restart.normalized.json";

/// Set to rewrite the golden file from this binary (only with the binary the schema is
/// defined by; the diff is the review).
const UPDATE: &str = "NRUN_UPDATE_GOLDEN";

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// `s` with each whole-word occurrence of `word` replaced by `by`.
fn replace_word(s: &str, word: &str, by: &str) -> String {
    if word.is_empty() {
        return s.to_string();
    }
    let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_');
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find(word) {
        let before = rest[..i].chars().last().or_else(|| out.chars().last());
        let after = rest[i + word.len()..].chars().next();
        out.push_str(&rest[..i]);
        match is_word(before) || is_word(after) {
            true => out.push_str(word),
            false => out.push_str(by),
        }
        rest = &rest[i + word.len()..];
    }
    out.push_str(rest);
    out
}

/// Decimal numbers (`0.05`, `20.1`) and whole seconds (`12 s`: a duration of 10 s or more) as
/// `<n>`: durations and shares in a sentence.
fn decimals(s: &str) -> String {
    let c: Vec<char> = s.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < c.len() {
        let start = i;
        while i < c.len() && c[i].is_ascii_digit() {
            i += 1;
        }
        let digits = i > start;
        if digits && i + 1 < c.len() && c[i] == '.' && c[i + 1].is_ascii_digit() {
            i += 1;
            while i < c.len() && c[i].is_ascii_digit() {
                i += 1;
            }
            out.push_str("<n>");
            continue;
        }
        let seconds = c.get(i) == Some(&' ')
            && c.get(i + 1) == Some(&'s')
            && !c.get(i + 2).is_some_and(|x| x.is_alphanumeric());
        match digits {
            true if seconds => out.push_str("<n>"),
            true => out.extend(&c[start..i]),
            false => {
                out.push(c[i]);
                i += 1;
            }
        }
    }
    out
}

struct Norm {
    run_id: String,
    repo: String,
    host: String,
}

impl Norm {
    fn string(&self, s: &str) -> String {
        let s = s
            .replace(&self.run_id, "<run_id>")
            .replace(&self.repo, "<repo>");
        decimals(&replace_word(&s, &self.host, "<host>"))
    }

    fn value(&self, key: &str, v: &Value) -> Value {
        match v {
            Value::Number(n) if n.is_f64() => json!("<f64>"),
            Value::Number(_) if matches!(key, "timestamp" | "pid") => json!("<int>"),
            Value::String(s) => json!(self.string(s)),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.value(key, x)).collect()),
            Value::Object(o) => Value::Object(
                o.iter()
                    .map(|(k, x)| (k.clone(), self.value(k, x)))
                    .collect(),
            ),
            _ => v.clone(),
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "f64",
        Value::Number(_) => "int",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Each event name -> each key (`metadata.K` for metadata's) -> the types it took.
fn event_shapes(events: &[Value]) -> Value {
    let mut m: BTreeMap<String, BTreeMap<String, BTreeSet<&str>>> = BTreeMap::new();
    for e in events {
        let name = e["name"].as_str().unwrap_or("?").to_string();
        let keys = m.entry(name).or_default();
        for (k, v) in e.as_object().into_iter().flatten() {
            keys.entry(k.clone()).or_default().insert(type_name(v));
            if k == "metadata" {
                for (mk, mv) in v.as_object().into_iter().flatten() {
                    keys.entry(format!("metadata.{mk}"))
                        .or_default()
                        .insert(type_name(mv));
                }
            }
        }
    }
    serde_json::to_value(m).unwrap()
}

/// The report with its volatile values normalized and its events as their shapes.
fn normalized(report: &Value) -> Value {
    let run_id = report["events"][0]["metadata"]["run_id"]
        .as_str()
        .expect("the first event names the run id")
        .to_string();
    let n = Norm {
        run_id,
        repo: env!("CARGO_MANIFEST_DIR").to_string(),
        host: hostname(),
    };
    let mut v = n.value("", report);
    let events = report["events"].as_array().cloned().unwrap_or_default();
    v["events"] = event_shapes(&events);
    v
}

/// Keys the golden file has that this report may lack, and why.
const RACY: [&str; 1] = ["first_progress"];

#[test]
fn a_jobs_report_keeps_its_schema() {
    let s = Scene::new();
    let path = s.dir.path().join("r.json");
    let o = s.run(
        &[
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            "--preflight",
            "off",
            "--report",
            path.to_str().unwrap(),
            "--no-python",
            "sh",
            &fixture("fault.sh"),
        ],
        &[("FAULT", "exit1:1:first"), ("LINES", "2")],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let got = normalized(&report);
    let golden_path = fixture(GOLDEN);
    if std::env::var_os(UPDATE).is_some() {
        let text = serde_json::to_string_pretty(&got).unwrap() + "\n";
        std::fs::write(&golden_path, text).unwrap();
    }
    let mut want: Value =
        serde_json::from_str(&std::fs::read_to_string(&golden_path).unwrap()).unwrap();
    // The one event that may be missing (see the module's doc) is compared where present.
    if let (Some(w), Some(g)) = (want["events"].as_object_mut(), got["events"].as_object()) {
        for k in RACY {
            if !g.contains_key(k) {
                w.remove(k);
            }
        }
    }
    assert_eq!(
        serde_json::to_string_pretty(&got).unwrap(),
        serde_json::to_string_pretty(&want).unwrap(),
        "the report's schema changed (golden: {golden_path}; {UPDATE}=1 rewrites it)"
    );
    s.assert_no_survivors();
}

/// The normalizer itself: floats and volatile integers hidden, the rest kept.
#[test]
fn the_normalizer_hides_only_what_varies() {
    let n = Norm {
        run_id: "abc-123".into(),
        repo: "/src/nrun".into(),
        host: "vm".into(),
    };
    let v = json!({"t": 0.5, "attempt": 1, "pid": 77, "timestamp": 9,
        "message": "vm: job abc-123 ran 0.05 s in /src/nrun/x, 20.1% (vmx 3), 12 s, 2 sets"});
    let mut m = Map::new();
    m.insert("t".into(), json!("<f64>"));
    m.insert("attempt".into(), json!(1));
    m.insert("pid".into(), json!("<int>"));
    m.insert("timestamp".into(), json!("<int>"));
    m.insert(
        "message".into(),
        json!("<host>: job <run_id> ran <n> s in <repo>/x, <n>% (vmx 3), <n> s, 2 sets"),
    );
    assert_eq!(n.value("", &v), Value::Object(m));
    assert!(Path::new(&fixture(GOLDEN)).exists());
}

/// The page of a report, without what names the binary or the file: the footer's version and
/// the header's source.
fn page_body(page: &str) -> String {
    page.lines()
        .filter(|l| !l.starts_with("<footer>written by nrun"))
        .map(|l| match l.starts_with("<p class=\"source\">from <code>") {
            true => "<p class=\"source\">from <code>REPORT</code></p>",
            false => l,
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// `nrun report` draws each report fixture as the binary before the typed schema drew it
/// (golden pages in tests/fixtures/report/golden/pages/): reading a report into the schema's
/// types loses nothing the page shows.
#[test]
fn the_page_of_each_report_fixture_is_the_golden_one() {
    let s = Scene::new();
    for name in [
        "bisect-slow-node",
        "job-fail-restart",
        "job-hang-restart-spare",
        "job-hang-restart-spare.schema38-sample",
        "preflight-only-net",
        "job-net-preflight-restart",
    ] {
        let out = s.dir.path().join(format!("{name}.html"));
        let input = fixture(&format!("report/{name}.json"));
        let o = s.run(&["report", &input, "-o", out.to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", text(&o.stderr));
        let got = page_body(&std::fs::read_to_string(&out).unwrap());
        let golden = fixture(&format!("report/golden/pages/{name}.html"));
        if std::env::var_os(UPDATE).is_some() {
            std::fs::write(&golden, &got).unwrap();
        }
        let want = std::fs::read_to_string(&golden).unwrap();
        if got != want {
            let at = got
                .lines()
                .zip(want.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            panic!(
                "{name}: the page differs from {golden} at line {}:\n  got:  {}\n  want: {}",
                at + 1,
                got.lines().nth(at).unwrap_or("(end)"),
                want.lines().nth(at).unwrap_or("(end)")
            );
        }
    }
    s.assert_no_survivors();
}
