//! The journal on real jobs (issue 38): the goodput ledger in `--report`, `--events` read line
//! by line, `--metrics-file` and `--metrics-port` parsed by Prometheus' own `promtool`, the
//! summary line at the job's end, and a hang from the watch as an event (with torch).

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use common::setup::{LEDGER_PHASES, hang_script, stopped_hang_args};
use common::*;
use serde_json::Value;

/// A worker that says a line, and fails on rank 1 of the first attempt only.
const FAILS_ONCE: &str = "echo \"rank $RANK attempt $TORCHELASTIC_RESTART_COUNT\"; \
    if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then exit 1; fi";

/// `promtool check metrics` on `text`: None when promtool is not installed (`missing_tool`),
/// else its exit status and output.
fn promtool(text: &str) -> Option<(bool, String)> {
    let bin = Path::new("/usr/bin/promtool");
    if !bin.exists() {
        missing_tool(&current_test(), "promtool (Debian's `prometheus` package)");
        return None;
    }
    let mut c = Command::new(bin)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    Some((
        out.status.success(),
        format!("{}{}", text_of(&out.stdout), text_of(&out.stderr)),
    ))
}

fn text_of(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn assert_promtool_accepts(text: &str) {
    if let Some((ok, said)) = promtool(text) {
        assert!(ok, "promtool check metrics refused it: {said}\n{text}");
    }
}

/// Every line of an events file, parsed, with the schema's fields.
fn events_of(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .map(|l| {
            let v: Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            for k in [
                "name",
                "source",
                "timestamp",
                "t",
                "attempt",
                "node",
                "host",
                "rank",
                "message",
                "metadata",
            ] {
                assert!(v.get(k).is_some(), "no {k} in {l}");
            }
            assert!(v["timestamp"].as_u64().unwrap() > 1_600_000_000_000, "{l}");
            assert!(
                ["AGENT", "WORKER"].contains(&v["source"].as_str().unwrap()),
                "{l}"
            );
            assert!(v["metadata"]["run_id"].is_string(), "{l}");
            v
        })
        .collect()
}

fn names(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["name"].as_str().unwrap()).collect()
}

/// The phases of a ledger add up to its wall time within 1%, and every key is there.
fn assert_adds_up(ledger: &Value) {
    let phases = ledger["phases"].as_object().unwrap();
    for k in LEDGER_PHASES {
        assert!(phases[k].as_f64().unwrap() >= 0.0, "{k}: {ledger}");
    }
    let sum: f64 = phases.values().map(|v| v.as_f64().unwrap()).sum();
    let wall = ledger["wall_s"].as_f64().unwrap();
    assert!(wall > 0.0, "{ledger}");
    assert!(
        (sum - wall).abs() <= 0.01 * wall,
        "sum {sum} vs wall {wall}: {ledger}"
    );
    let effective = ledger["effective"].as_f64().unwrap();
    let running = phases["running"].as_f64().unwrap();
    assert!((effective - running / wall).abs() < 1e-3, "{ledger}");
}

/// The case: a worker group that fails once and restarts. The report's ledger has two
/// attempts (failed, then success), the events say the failure, the decision and the restart,
/// in the same order in `--events` and the report; the metrics file is what promtool accepts,
/// with the attempts and the restart counted; the last line of stderr is the summary.
#[test]
fn a_job_that_fails_once_and_restarts_has_both_attempts_in_its_ledger() {
    let s = Scene::new();
    let dir = s.dir.path();
    let (report, events, metrics) = (
        dir.join("report.json"),
        dir.join("events.jsonl"),
        dir.join("nrun.prom"),
    );
    let out = s.run(
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--report",
            report.to_str().unwrap(),
            "--events",
            events.to_str().unwrap(),
            "--metrics-file",
            metrics.to_str().unwrap(),
            "--no-python",
            "sh",
            "-c",
            FAILS_ONCE,
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let ledger = &v["ledger"];
    assert_adds_up(ledger);
    let attempts = ledger["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{ledger}");
    assert_eq!(attempts[0]["outcome"], "failed", "{ledger}");
    assert_eq!(attempts[1]["outcome"], "success", "{ledger}");
    assert!(
        attempts[0]["end_s"].as_f64() <= attempts[1]["start_s"].as_f64(),
        "{ledger}"
    );
    assert_eq!(ledger["restarts"], 1, "{ledger}");
    let summary = ledger["summary"].as_str().unwrap();
    assert!(summary.contains("lost: 1 restart, "), "{summary}");

    // The events file, line by line, is the report's events.
    let lines = events_of(&events);
    let in_report = v["events"].as_array().unwrap();
    assert_eq!(names(&lines), names(in_report));
    let n = names(&lines);
    for want in [
        "job_start",
        "phase",
        "node_joined",
        "attempt_start",
        "first_progress",
        "worker_failed",
        "attempt_end",
        "decision",
        "restart",
        "job_end",
    ] {
        assert!(n.contains(&want), "no {want} in {n:?}");
    }
    let at = |name: &str| n.iter().position(|x| *x == name).unwrap();
    assert!(
        at("worker_failed") < at("decision") && at("decision") < at("restart"),
        "{n:?}"
    );
    let failed = &lines[at("worker_failed")];
    assert_eq!(failed["rank"], 1, "{failed}");
    assert_eq!(failed["source"], "WORKER", "{failed}");
    assert_eq!(failed["attempt"], 0, "{failed}");
    assert_eq!(failed["metadata"]["exit_code"], 1, "{failed}");
    assert_eq!(lines[at("restart")]["metadata"]["restart_count"], 1);
    let end = lines.last().unwrap();
    assert_eq!(end["name"], "job_end");
    assert_eq!(end["metadata"]["exit_code"], 0);
    assert_eq!(end["metadata"]["outcome"], "success");
    let starts = lines.iter().filter(|e| e["name"] == "attempt_start");
    assert_eq!(
        starts
            .map(|e| e["attempt"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1]
    );

    // The metrics file as the textfile collector would read it.
    let m = std::fs::read_to_string(&metrics).unwrap();
    assert_promtool_accepts(&m);
    for want in [
        "nrun_attempts 2\n",
        "nrun_restarts 1\n",
        "nrun_job_state{state=\"success\"} 1\n",
        "nrun_exit_code 0\n",
        "nrun_nodes{state=\"in\"} 1\n",
        "nrun_ledger_seconds{phase=\"running\"} ",
    ] {
        assert!(m.contains(want), "{want:?} not in {m}");
    }
    assert!(m.ends_with("# EOF\n"), "{m}");
    // No temporary file is left beside it.
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // The job's last line: the summary, as in the report.
    let last = err.lines().last().unwrap();
    assert_eq!(last, format!("nrun: {summary}"), "{err}");
    assert!(
        last.starts_with("nrun: ran ") && last.contains("% of it training"),
        "{err}"
    );
    s.assert_no_survivors();
}

/// GET `path` from 127.0.0.1:`port`: the status line and headers, and the body.
fn http_get(port: u16, path: &str) -> (String, String) {
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut all = String::new();
    c.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").unwrap_or((&all, ""));
    (head.to_string(), body.to_string())
}

/// `--metrics-port` answers while the job runs (its workers wait for a file the test writes
/// after scraping), in text promtool accepts, with the job running; `--events` has the
/// attempt's start already (each line is flushed as it happens).
#[test]
fn the_metrics_port_is_scraped_while_the_job_runs() {
    let s = Scene::new();
    let dir = s.dir.path();
    let go = dir.join("go");
    let events = dir.join("events.jsonl");
    let port = free_port();
    let port_s = port.to_string();
    let worker = format!(
        "echo working; echo started >> \"$MARK\"; while [ ! -e {} ]; do sleep 0.05; done",
        go.display()
    );
    let child = s.spawn(
        &[
            "--nproc-per-node",
            "2",
            "--metrics-port",
            &port_s,
            "--events",
            events.to_str().unwrap(),
            "--no-python",
            "sh",
            "-c",
            &worker,
        ],
        &[],
    );
    let w = Watched::new(child);
    s.wait_marks("started", 2, HANG);
    // Both workers have said their line: the journal moves to running when it sees it.
    let mut body = String::new();
    wait_until("the metrics to say the job runs", || {
        let (head, b) = http_get(port, "/metrics");
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        assert!(head.contains("application/openmetrics-text"), "{head}");
        body = b;
        body.contains("nrun_job_state{state=\"running\"} 1\n")
    });
    assert_promtool_accepts(&body);
    for want in [
        "nrun_attempts 1\n",
        "nrun_exit_code -1\n",
        "nrun_restarts 0\n",
    ] {
        assert!(body.contains(want), "{want:?} not in {body}");
    }
    let (head, _) = http_get(port, "/nothing");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    let so_far = names(&events_of(&events))
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>();
    assert!(
        so_far.contains(&"attempt_start".to_string())
            && so_far.contains(&"first_progress".to_string()),
        "{so_far:?}"
    );
    std::fs::write(&go, "").unwrap();
    let (out, _) = w.finish();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let all = events_of(&events);
    assert_eq!(all.last().unwrap()["name"], "job_end");
    s.assert_no_survivors();
}

/// `--metrics-port` beside 1,000 slow clients (issue 46): connections that send half a request
/// head and wait. The port is on loopback only (a port alone); nrun keeps accepting and closes
/// the oldest connections past the ones it holds, so every scrape is answered while they are
/// open (the old server took 16 at a time, each for up to 10 s: a scrape waited minutes).
#[test]
fn the_metrics_port_serves_scrapes_beside_1000_slow_connections() {
    // 1,000 sockets and the test's own: past the usual soft limit of 1,024.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain calls on a valid rlimit.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max.min(8192);
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    if lim.rlim_cur < 1100 {
        cannot_set_up(&format!(
            "the descriptor limit ({}, its hard limit) is under 1,100: raise it (ulimit -Hn)",
            lim.rlim_cur
        ));
        return;
    }
    let s = Scene::new();
    let go = s.dir.path().join("go");
    let port = free_port();
    let worker = format!("while [ ! -e {} ]; do sleep 0.05; done", go.display());
    let child = s.spawn(
        &[
            "--metrics-port",
            &port.to_string(),
            "--no-python",
            "sh",
            "-c",
            &worker,
        ],
        &[],
    );
    let w = Watched::new(child);
    wait_until("the metrics port to answer", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    // Loopback only: not on this host's other addresses.
    let other = nrun_base::net::interfaces()
        .into_iter()
        .flat_map(|i| i.addrs)
        .find(|a| a.is_ipv4() && !a.is_loopback());
    if let Some(a) = other {
        assert!(
            std::net::TcpStream::connect((a, port)).is_err(),
            "--metrics-port {port} answers on {a}"
        );
    }
    let slow: Vec<std::net::TcpStream> = (0..1000)
        .map(|_| {
            let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
            c
        })
        .collect();
    let mut took = Vec::new();
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        // A hang guard only: a scrape that waits behind the slow clients never comes back.
        c.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        write!(c, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let mut all = String::new();
        c.read_to_string(&mut all).unwrap();
        took.push(t.elapsed());
        assert!(all.starts_with("HTTP/1.1 200 OK"), "{all}");
        assert!(all.contains("nrun_job_state"), "{all}");
    }
    eprintln!("5 scrapes beside 1,000 slow connections took {took:?}");
    // nrun held only some of them: the rest were closed (a read sees the end at once).
    let closed = slow
        .iter()
        .filter(|c| {
            c.set_read_timeout(Some(std::time::Duration::from_millis(1)))
                .unwrap();
            match (&mut &**c).read(&mut [0u8; 1]) {
                Ok(0) => true,
                Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
                Ok(_) => false,
            }
        })
        .count();
    assert!(closed >= 900, "{closed} of 1,000 slow connections closed");
    drop(slow);
    std::fs::write(&go, "").unwrap();
    let (out, _) = w.finish();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    s.assert_no_survivors();
}

/// Paths nrun cannot write and a port it cannot have are usage errors (exit 2) before
/// anything starts, naming the flag and the path or port.
#[test]
fn unwritable_paths_and_a_taken_port_are_usage_errors() {
    let s = Scene::new();
    for flag in ["--events", "--metrics-file", "--report", "--report-html"] {
        let path = "/nonexistent-nrun-dir/x";
        let out = s.run(&[flag, path, "--no-python", "true"], &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.starts_with(&format!("nrun: error: {flag} {path}: ")),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let dir = s.dir.path().to_str().unwrap().to_string();
    let out = s.run(&["--metrics-file", &dir, "--no-python", "true"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("it is a directory"));
    let taken = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = s.run(&["--metrics-port", &port, "--no-python", "true"], &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with(&format!("nrun: error: --metrics-port {port}: ")),
        "{err}"
    );
    s.assert_no_survivors();
}

/// A report that cannot be written at the end (its directory went away while the job ran) is
/// said, and the job's own exit code stands: what ran matters more than where its record went.
#[test]
fn a_report_lost_at_the_end_is_said_and_the_exit_code_stands() {
    let s = Scene::new();
    let dir = s.dir.path().join("gone");
    std::fs::create_dir(&dir).unwrap();
    let (json, html) = (dir.join("r.json"), dir.join("r.html"));
    let out = s.run(
        &[
            "--report",
            json.to_str().unwrap(),
            "--report-html",
            html.to_str().unwrap(),
            "--no-python",
            "rmdir",
            dir.to_str().unwrap(),
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    for (flag, path) in [("--report", &json), ("--report-html", &html)] {
        let said = format!("nrun: error: cannot write {flag} {} on ", path.display());
        assert!(err.contains(&said), "{said:?} not in {err}");
    }
    assert!(
        err.lines().last().unwrap().starts_with("nrun: ran "),
        "{err}"
    );
    s.assert_no_survivors();
}

/// A short job that succeeds says its summary as its last line too, with no faults.
#[test]
fn a_short_job_ends_with_its_summary() {
    let s = Scene::new();
    let out = s.run(&["--no-python", "echo", "hi"], &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let last = err.lines().last().unwrap();
    assert!(
        last.starts_with("nrun: ran ") && last.ends_with("of it training; no faults"),
        "{err}"
    );
    // "lost" on nrun's console names a node (tests look for its absence).
    assert!(!err.contains("lost"), "{err}");
}

/// With torch: a rank that sleeps instead of entering the all_reduce (tests/python/hang.py's
/// "sleep" case) is a `hang` event naming it, and the stall before the watch called it is the
/// ledger's detecting time, not running.
#[test]
fn a_hang_is_an_event_and_its_stall_is_detecting_time() {
    let Some(py) = need_torch().map(|p| p.display().to_string()) else {
        return;
    };
    let s = Scene::new();
    let dir = s.dir.path();
    let (report, events) = (dir.join("report.json"), dir.join("events.jsonl"));
    let script = hang_script();
    let mut args = stopped_hang_args(&py);
    args.extend([
        "--report",
        report.to_str().unwrap(),
        "--events",
        events.to_str().unwrap(),
        &script,
    ]);
    let out = s.run(&args, &[("NRUN_HANG_CASE", "sleep")]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(97), "{err}");
    let lines = events_of(&events);
    let hang = lines
        .iter()
        .find(|e| e["name"] == "hang")
        .unwrap_or_else(|| panic!("no hang event: {:?}", names(&lines)));
    assert_eq!(hang["metadata"]["culprit_rank"], 1, "{hang}");
    assert_eq!(hang["rank"], 1, "{hang}");
    assert_eq!(hang["metadata"]["waiting_in"], "all_reduce", "{hang}");
    assert_eq!(
        hang["metadata"]["ranks_waiting"],
        serde_json::json!([0]),
        "{hang}"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let ledger = &v["ledger"];
    assert_adds_up(ledger);
    assert_eq!(ledger["attempts"][0]["outcome"], "hang", "{ledger}");
    // The watch waits --hang-timeout (4 s) of stall before it calls the hang.
    assert!(
        ledger["phases"]["detecting"].as_f64().unwrap() >= 4.0,
        "{ledger}"
    );
    let n = names(&lines);
    assert!(
        n.contains(&"decision") && n.ends_with(&["job_end"]),
        "{n:?}"
    );
    assert!(
        err.lines().last().unwrap().starts_with("nrun: ran "),
        "{err}"
    );
    s.assert_no_survivors();
}
