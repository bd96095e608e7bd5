//! The ledger's arithmetic on a made-up timeline (seconds since nrun started).

use super::*;
use serde_json::{Value, json};

/// A job: launch 0.2 s, join 1.1, checks 0.4, preflight 9.8; attempt 0 starts at 11.5, its
/// first output at 14.5, fails at 400 (detecting 0.5 s, stopping 1.5), restarts (0.4 s);
/// attempt 1 starts at 402.4, output at 405.4, succeeds at 810.4; ending until 812.4.
fn job() -> Ledger {
    let mut l = Ledger::default();
    l.enter(Phase::Join, 0.2);
    l.enter(Phase::Checks, 1.3);
    l.enter(Phase::Preflight, 1.7);
    l.start_attempt(0, 11.5);
    assert!(l.progress(14.5));
    assert!(!l.progress(15.0), "the first progress is taken once");
    l.enter(Phase::Detecting, 400.0);
    l.enter(Phase::Stopping, 400.5);
    l.end_attempt(Outcome::Failed, 402.0);
    l.restarts = 1;
    l.enter(Phase::Restarting, 402.0);
    l.start_attempt(1, 402.4);
    l.progress(405.4);
    l.end_attempt(Outcome::Success, 810.4);
    l.enter(Phase::Ending, 810.4);
    l.finish(812.4);
    l
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn the_phases_add_up_to_the_wall_time() {
    let l = job();
    let t = l.totals(9999.0);
    assert!(close(t.sum(), 812.4), "{t:?}");
    let v = serde_json::to_value(l.report(9999.0)).unwrap();
    let sum: f64 = v["phases"]
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_f64().unwrap())
        .sum();
    let wall = v["wall_s"].as_f64().unwrap();
    assert!((sum - wall).abs() <= 0.01 * wall, "{sum} vs {wall}");
    assert_eq!(v["phases"].as_object().unwrap().len(), Phase::ALL.len());
    assert!(close(t.get(Phase::Launch), 0.2));
    assert!(close(t.get(Phase::Join), 1.1));
    assert!(close(t.get(Phase::Checks), 0.4));
    assert!(close(t.get(Phase::Preflight), 9.8));
    assert!(close(t.get(Phase::Starting), 6.0));
    assert!(close(t.get(Phase::Running), 385.5 + 405.0));
    assert!(close(t.get(Phase::Detecting), 0.5));
    assert!(close(t.get(Phase::Stopping), 1.5));
    assert!(close(t.get(Phase::Restarting), 0.4));
    assert!(close(t.get(Phase::Ending), 2.0));
}

#[test]
fn each_attempt_has_its_own_phases_and_outcome() {
    let v = serde_json::to_value(job().report(9999.0)).unwrap();
    let a = v["attempts"].as_array().unwrap();
    assert_eq!(a.len(), 2);
    assert_eq!(a[0]["outcome"], "failed");
    assert_eq!(a[1]["outcome"], "success");
    assert_eq!(a[0]["start_s"], 11.5);
    assert_eq!(a[0]["end_s"], 402.0);
    assert_eq!(a[0]["phases"]["starting"], 3.0);
    assert_eq!(a[0]["phases"]["running"], 385.5);
    assert_eq!(a[0]["phases"]["stopping"], 1.5);
    // The restart's time is between the attempts, in no attempt.
    assert_eq!(a[0]["phases"]["restarting"], 0.0);
    assert_eq!(a[1]["phases"]["restarting"], 0.0);
    let in_attempt = |x: &Value| -> f64 {
        x["phases"]
            .as_object()
            .unwrap()
            .values()
            .map(|p| p.as_f64().unwrap())
            .sum()
    };
    assert!((in_attempt(&a[1]) - 408.0).abs() < 1e-6);
}

#[test]
fn the_effective_ratio_and_what_faults_cost() {
    let l = job();
    assert!(close(l.effective(0.0), 790.5 / 812.4));
    // Detecting, stopping, restarting, and the second attempt's start-up.
    assert!(close(l.lost(0.0), 0.5 + 1.5 + 0.4 + 3.0), "{}", l.lost(0.0));
    assert_eq!(
        l.summary(0.0),
        "ran 13 m 32 s, 97.3% of it training; lost: 1 restart, 5.4 s"
    );
}

/// The report page's "lost" per attempt follows the job's rule, and with the time between
/// attempts adds up to the job's `lost_s` (it once counted the first attempt's start-up and
/// left out the restart: 5.0 s + 3.0 s beside the job's 5.4 s).
#[test]
fn the_attempts_lost_add_up_to_the_jobs() {
    let l = job().report(9999.0);
    let a = &l.attempts;
    let lost = |i: usize| crate::report::html::attempt_lost(&a[i], i == 0);
    // Attempt 0: detecting and stopping (its start-up is the job's own); attempt 1: its
    // start-up after the restart.
    assert!(close(lost(0), 0.5 + 1.5), "{}", lost(0));
    assert!(close(lost(1), 3.0), "{}", lost(1));
    let job = l.lost_s;
    // The restart, between the attempts, is the rest.
    assert!(close(job - lost(0) - lost(1), 0.4), "{job}");
    let v = json!({ "job": { "outcome": "success" }, "ledger": serde_json::to_value(&l).unwrap() });
    let r = crate::report::schema::Report::read("job.json", v.to_string().as_bytes()).unwrap();
    let page = crate::report::html::render(r, "job.json");
    assert!(
        page.contains(
            ">between attempts (restarting, waiting for nodes)</td><td class=\"n\">0.4 s<"
        ),
        "{page}"
    );
    assert!(page.contains("<td class=\"n\">5.4 s</td></tr>"), "{page}");
}

#[test]
fn summaries_of_short_long_and_faultless_jobs() {
    let mut l = Ledger::default();
    l.enter(Phase::Join, 0.1);
    l.start_attempt(0, 0.2);
    l.progress(0.3);
    l.end_attempt(Outcome::Success, 4.0);
    l.enter(Phase::Ending, 4.0);
    l.finish(4.2);
    assert_eq!(l.summary(0.0), "ran 4.2 s, 88.1% of it training; no faults");
    // A node that took over hosting a c10d job: the host's loss was a fault.
    let mut took = l.clone();
    took.took_over = Some(2);
    assert_eq!(
        took.summary(0.0),
        "ran 4.2 s, 88.1% of it training; no faults since this node took over hosting (epoch 2: \
         the host before was lost)"
    );
    // A job that failed without a restart says what the failure cost.
    let mut failed = Ledger::default();
    failed.start_attempt(0, 0.0);
    failed.progress(0.5);
    failed.enter(Phase::Detecting, 2.0);
    failed.enter(Phase::Stopping, 2.0);
    failed.end_attempt(Outcome::Failed, 2.3);
    failed.finish(2.3);
    assert_eq!(
        failed.summary(0.0),
        "ran 2.3 s, 65.2% of it training; lost: 0.30 s"
    );
    let mut two = job();
    two.restarts = 2;
    assert!(two.summary(0.0).ends_with("lost: 2 restarts, 5.4 s"));
    // No attempt failed, yet the job did not end well, or without leaving nodes out: no
    // "no faults" (issue 45: it was said after exits 95, 130 and 141).
    for (code, outcome) in [(95, "not started"), (130, "interrupted"), (141, "failed")] {
        let mut l = Ledger {
            exit: Some((code, outcome.to_string())),
            ..Ledger::default()
        };
        l.finish(1.0);
        assert_eq!(
            l.summary(0.0),
            format!("ran 1.0 s, 0.0% of it training; {outcome}, exit {code}")
        );
    }
    let mut spare_out = Ledger {
        exit: Some((0, "success".into())),
        left_out: 1,
        ..Ledger::default()
    };
    spare_out.finish(1.0);
    assert!(
        spare_out
            .summary(0.0)
            .ends_with("; 1 node left out (see above)"),
        "{}",
        spare_out.summary(0.0)
    );
}

#[test]
fn an_attempt_never_seen_to_start_counts_as_running_from_its_start() {
    let mut l = Ledger::default();
    l.start_attempt(0, 1.0);
    l.enter(Phase::Stopping, 5.0);
    l.end_attempt(Outcome::Failed, 6.0);
    l.finish(6.0);
    let t = l.totals(0.0);
    assert!(close(t.get(Phase::Starting), 0.0));
    assert!(close(t.get(Phase::Running), 4.0));
    assert!(close(t.sum(), 6.0));
}

#[test]
fn a_hangs_stall_is_charged_to_detecting() {
    let mut l = Ledger::default();
    l.start_attempt(0, 0.0);
    l.progress(1.0);
    // Declared at 100 s after 60 s of stall: 60 s of "running" were a hang being detected.
    l.enter(Phase::Detecting, 100.0);
    l.shift(Phase::Running, Phase::Detecting, 60.0);
    l.enter(Phase::Stopping, 100.0);
    l.end_attempt(Outcome::Hang, 101.0);
    l.finish(101.0);
    let t = l.totals(0.0);
    assert!(close(t.get(Phase::Running), 39.0));
    assert!(close(t.get(Phase::Detecting), 60.0));
    assert!(close(t.sum(), 101.0));
}

#[test]
fn the_metrics_parse_as_openmetrics_with_the_ledgers_seconds() {
    // No file, no port: nothing runs in the background, so no runtime is needed.
    let m = metrics::Exporter::start(Arc::new(Mutex::new(job())), None, None);
    m.event(&Event::AttemptStart {
        attempt: 0,
        world_size: 2,
        nodes: vec!["a".into()],
    });
    m.event(&Event::Restart { restart_count: 1 });
    // No line rate known: none said (not a line rate of 0).
    assert!(
        !m.text()
            .contains("nrun_preflight_line_rate_bytes_per_second ")
    );
    m.event(&Event::PreflightSize {
        bytes: Some(1048576),
        busbw_gbs: Some(12.5),
        algbw_gbs: None,
        line_rate_gbs: Some(25.0),
    });
    let text = m.text();
    assert!(text.ends_with("# EOF\n"), "{text}");
    for want in [
        "nrun_attempts 1\n",
        "nrun_restarts 1\n",
        "nrun_preflight_busbw_bytes_per_second{bytes=\"1048576\"} 12500000000.0\n",
        "nrun_preflight_line_rate_bytes_per_second 25000000000.0\n",
        "nrun_ledger_seconds{phase=\"preflight\"} 9.8",
        "nrun_job_state{state=\"launch\"} 1\n",
    ] {
        assert!(text.contains(want), "{want:?} not in {text}");
    }
}

/// Per-rank series follow the watch's latest figures: a rank gone is removed, the others stay
/// (set before the old ones go: a scrape never sees none).
#[test]
fn per_rank_series_follow_the_latest_figures() {
    // No file, no port: nothing runs in the background, so no runtime is needed.
    let m = metrics::Exporter::start(Arc::new(Mutex::new(job())), None, None);
    let fig = |rank: usize, age: f64| crate::watch::RankFigure {
        rank,
        host: "h".into(),
        progress_age_s: age,
        wait_share: Some(0.25),
    };
    m.ranks(&[fig(0, 1.0), fig(1, 2.0)]);
    let text = m.text();
    for want in [
        "nrun_rank_last_progress_age_seconds{rank=\"1\",host=\"h\"} 2.0\n",
        "nrun_rank_wait_ratio{rank=\"0\",host=\"h\"} 0.25\n",
    ] {
        assert!(text.contains(want), "{want:?} not in {text}");
    }
    m.ranks(&[fig(0, 3.0)]);
    let text = m.text();
    assert!(
        text.contains("nrun_rank_last_progress_age_seconds{rank=\"0\",host=\"h\"} 3.0\n"),
        "{text}"
    );
    assert!(!text.contains("rank=\"1\""), "{text}");
    // A restarted group's rank without samples yet has no wait figure, not the last one.
    m.ranks(&[crate::watch::RankFigure {
        wait_share: None,
        ..fig(0, 0.5)
    }]);
    let text = m.text();
    assert!(!text.contains("nrun_rank_wait_ratio{"), "{text}");
    assert!(
        text.contains("nrun_rank_last_progress_age_seconds{rank=\"0\",host=\"h\"} 0.5\n"),
        "{text}"
    );
}

/// The journal's own work, timed, for BENCHMARKS 26 (its share of a step is this work over the
/// step's time): a worker's output line in the steady state, a tick of the attempt's wait
/// (20 a second), an event appended to `--events`, the metrics encoded and the file replaced
/// (every 5 s). Not a check: `cargo test --release --lib journal::tests::cost -- --ignored
/// --nocapture`.
#[test]
#[ignore]
fn cost() {
    let per = |n: u32, t: Instant| t.elapsed().as_nanos() as f64 / f64::from(n);
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut j = Journal::new("cost");
    j.attach(
        &JournalPlan {
            events: Some(dir.path().join("ev.jsonl")),
            metrics_file: Some(dir.path().join("m.prom")),
            metrics_port: None,
        },
        None,
    );
    j.attempt_start(0, 16, (0..2).map(|i| format!("node{i}")).collect());
    nrun_base::activity::line();
    let hosts: Vec<String> = (0..2).map(|i| format!("node{i}")).collect();
    j.tick(None, &hosts);
    assert_eq!(j.phase(), Phase::Running);
    // What the relay does per line once the first was seen.
    let n = 50_000_000;
    let t = Instant::now();
    for _ in 0..n {
        if std::hint::black_box(nrun_base::activity::wanted()) {
            nrun_base::activity::line();
        }
    }
    let line = per(n, t);
    let n = 1_000_000;
    let t = Instant::now();
    for _ in 0..n {
        j.tick(None, std::hint::black_box(&hosts));
    }
    let tick = per(n, t);
    let n = 20_000;
    let t = Instant::now();
    for i in 0..n {
        j.emit(Event::NodeJoined {
            node: 0,
            host: format!("node{i}"),
            gpus: 8,
            nccl: None,
            torch: None,
            ifname: None,
        });
    }
    let event = per(n, t);
    let (m, path) = (j.metrics.as_ref().unwrap(), dir.path().join("m2.prom"));
    m.ranks(
        &(0..16)
            .map(|r| crate::watch::RankFigure {
                rank: r,
                host: hosts[r / 8].clone(),
                progress_age_s: 0.5,
                wait_share: Some(0.1),
            })
            .collect::<Vec<_>>(),
    );
    let n = 2_000;
    let t = Instant::now();
    for _ in 0..n {
        nrun_base::outputs::replace(&path, m.text().as_bytes()).unwrap();
    }
    let write = per(n, t);
    println!(
        "journal cost: per output line {line:.2} ns; per tick {tick:.0} ns (20/s: {:.1} us/s); \
         per --events event {event:.0} ns; metrics encoded and replaced (16 ranks) {:.1} us \
         (every 5 s: {:.1} us/s)",
        tick * 20.0 / 1e3,
        write / 1e3,
        write / 5e3
    );
}

/// Every event's name, source, node, rank, message and metadata as `--events` had them before
/// the events were one enum (the shapes the old `json!` literals wrote), for the variants the
/// golden file of tests/events.rs does not reach (a hang, a straggler, a node left out, a
/// spare, the preflight's) and one of each kind it does.
#[test]
fn every_event_keeps_its_name_and_metadata() {
    use crate::watch::{Diagnosis, Kind, RankState, Straggler};
    let state = |rank: usize, waiting_in: Option<&str>| RankState {
        rank,
        host: "h".into(),
        pid: 1,
        state: waiting_in.map_or("in Python code".into(), |o| format!("waiting in {o}")),
        waiting_in: waiting_in.map(String::from),
        frames: Vec::new(),
    };
    let hang = Diagnosis {
        kind: Kind::Missing,
        conclusion: "rank 1 never entered all_reduce".into(),
        culprits: vec![1],
        stalled_s: 4.5,
        in_collective: true,
        ranks: vec![
            state(0, Some("all_reduce")),
            state(1, None),
            state(2, Some("all_reduce")),
        ],
        nccl_ras: None,
    };
    let straggler = Straggler {
        rank: 3,
        host: "h".into(),
        waited_pct: 5.0,
        median_pct: 40.0,
        waits: Vec::new(),
    };
    let table: Vec<(Event, Value)> = vec![
        (
            Event::hang(&hang),
            json!({"name": "hang", "source": "WORKER", "node": null, "host": null, "rank": 1,
                "message": "rank 1 never entered all_reduce",
                "metadata": {"culprit_rank": 1, "culprits": [1], "waiting_in": "all_reduce",
                    "ranks_waiting": [0, 2], "stalled_s": 4.5, "kind": "missing"}}),
        ),
        (
            Event::straggler(&straggler),
            json!({"name": "straggler", "source": "WORKER", "node": null, "host": null,
                "rank": 3, "message": "rank 3 on h is a straggler",
                "metadata": {"wait_share": 0.05, "median_wait_share": 0.4, "host": "h"}}),
        ),
        (
            Event::NodeLeftOut {
                node: 2,
                host: "b".into(),
                stage: "check".into(),
                evidence: "link".into(),
                reason: "cannot be reached".into(),
            },
            json!({"name": "node_left_out", "source": "AGENT", "node": 2, "host": "b",
                "rank": null, "message": "leaving out b: cannot be reached",
                "metadata": {"stage": "check", "evidence": "link",
                    "reason": "cannot be reached"}}),
        ),
        (
            Event::SpareIn {
                node: 4,
                host: "e".into(),
                replaces: Some("b".into()),
            },
            json!({"name": "spare_in", "source": "AGENT", "node": 4, "host": "e", "rank": null,
                "message": "spare e takes a place in the job",
                "metadata": {"replaces": "b"}}),
        ),
        (
            Event::PreflightSize {
                bytes: Some(1 << 20),
                busbw_gbs: Some(12.0),
                algbw_gbs: Some(6.5),
                line_rate_gbs: None,
            },
            json!({"name": "preflight_size", "source": "AGENT", "node": null, "host": null,
                "rank": null, "message": "1048576 B: busbw 12.0 GB/s",
                "metadata": {"bytes": 1048576, "busbw_gbs": 12.0, "algbw_gbs": 6.5,
                    "line_rate_gbs": null}}),
        ),
        (
            Event::PreflightEnd {
                exit_code: 0,
                verdict: "ok".into(),
            },
            json!({"name": "preflight_end", "source": "AGENT", "node": null, "host": null,
                "rank": null, "message": "preflight: ok (exit 0)",
                "metadata": {"exit_code": 0, "verdict": "ok"}}),
        ),
        (
            Event::WorkerFailed {
                node: 1,
                host: "b".into(),
                rank: None,
                how: "lost: no heartbeat".into(),
                exit_code: None,
                signal: None,
            },
            json!({"name": "worker_failed", "source": "AGENT", "node": 1, "host": "b",
                "rank": null, "message": "b: lost: no heartbeat",
                "metadata": {"how": "lost: no heartbeat", "exit_code": null, "signal": null}}),
        ),
        (
            Event::FirstProgress {
                seen: Seen::Progress,
            },
            json!({"name": "first_progress", "source": "AGENT", "node": null, "host": null,
                "rank": null, "message": "first progress seen from the workers",
                "metadata": {"seen": "progress"}}),
        ),
    ];
    for (event, want) in table {
        let mut got = Stamped {
            event,
            t: 1.5,
            attempt: Some(0),
        }
        .json("r1");
        assert_eq!(got["metadata"]["run_id"], "r1", "{got}");
        assert_eq!(got["t"], 1.5);
        assert_eq!(got["attempt"], 0);
        let o = got.as_object_mut().unwrap();
        o["metadata"].as_object_mut().unwrap().remove("run_id");
        for k in ["t", "timestamp", "attempt"] {
            o.remove(k);
        }
        assert_eq!(got, want);
    }
}

/// A line the journal writes reads back as the same event and writes out the same; an older
/// nrun's line that lacks a key still reads as its event; what is not an event line reads as
/// one nrun does not know, whole.
#[test]
fn an_event_line_reads_back_as_its_event() {
    let written = Stamped {
        event: Event::AttemptEnd {
            outcome: Outcome::Hang,
            exit_code: 97,
        },
        t: 8.9,
        attempt: Some(0),
    }
    .json("r1");
    let back: EventRecord = serde_json::from_value(written.clone()).unwrap();
    assert_eq!(
        back.event(),
        Some(&Event::AttemptEnd {
            outcome: Outcome::Hang,
            exit_code: 97
        })
    );
    assert_eq!(serde_json::to_value(&back).unwrap(), written);

    let older = json!({"name": "hang", "t": 8.2, "attempt": 0, "node": 1, "host": "h2",
        "rank": 1, "message": "hang: ...",
        "metadata": {"culprit_rank": 1, "waiting_in": "all_reduce", "run_id": "r0"}});
    let back: EventRecord = serde_json::from_value(older).unwrap();
    match back.event() {
        Some(Event::Hang {
            culprit_rank, kind, ..
        }) => assert_eq!((*culprit_rank, kind), (Some(1), &None)),
        e => panic!("{e:?}"),
    }
    assert_eq!(
        (back.host.as_deref(), back.node, back.rank),
        (Some("h2"), Some(1), Some(1))
    );
    assert_eq!(back.run_id, "r0");

    for (line, name) in [
        (
            json!({"name": "waiting_nodes", "t": 3.0, "metadata": {"n": 2}}),
            "waiting_nodes",
        ),
        (
            json!({"name": "phase", "t": "soon", "metadata": {"phase": "lunch"}}),
            "phase",
        ),
        (json!(3), ""),
    ] {
        let back: EventRecord = serde_json::from_value(line.clone()).unwrap();
        assert_eq!(back.event(), None, "{line}");
        assert_eq!(back.name(), name);
    }
}
