//! The preflight's summary: the sweep table from every rank's rows, the checks run in order
//! (each returns findings), the verdict folded from the findings, and the two views of one
//! result: the text report and the JSON report (`--report`), serialised from [`Report`].

use std::fmt::Write as _;

use serde::Serialize;

use super::checks::{LineRate, Nodes, nccl_path};
use super::finding::{self, Check, Finding};
use super::{Mode, Outcome, RankReport, Summary, Verdict, busbw, hardware, human_bytes};

/// One message size's timing, the slowest rank's (what a collective costs the job).
#[derive(Clone, Debug, Serialize)]
struct Timing {
    time_us: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
    /// Wrong elements, summed over the ranks.
    wrong: u64,
}

/// One row of the sweep table, as nccl-tests prints it.
#[derive(Clone, Debug, Serialize)]
struct SweepRow {
    bytes: u64,
    count: u64,
    #[serde(rename = "type")]
    kind: &'static str,
    redop: &'static str,
    out_of_place: Timing,
    in_place: Timing,
}

/// The sweep over every rank, when every rank reported one.
struct Sweep {
    rows: Vec<SweepRow>,
    /// The largest size and its best busbw (out-of-place or in-place).
    peak: Option<(u64, f64)>,
}

impl Sweep {
    fn of(complete: &[&RankReport], world: usize) -> Sweep {
        let n = complete[0].rows.len();
        let timing = |i: usize, us: fn(&super::Row) -> f64, wrong: fn(&super::Row) -> u64| {
            let bytes = complete[0].rows[i].bytes;
            let time_us = complete
                .iter()
                .map(|r| r.rows.get(i).map_or(0.0, us))
                .fold(0.0, f64::max);
            let wrong = complete
                .iter()
                .map(|r| r.rows.get(i).map_or(0, wrong))
                .sum();
            let (algbw_gbs, busbw_gbs) = busbw(bytes, time_us, world);
            Timing {
                time_us,
                algbw_gbs,
                busbw_gbs,
                wrong,
            }
        };
        let rows: Vec<SweepRow> = (0..n)
            .map(|i| {
                let bytes = complete[0].rows[i].bytes;
                SweepRow {
                    bytes,
                    count: bytes / 4,
                    kind: "float",
                    redop: "sum",
                    out_of_place: timing(i, |x| x.oop_us, |x| x.oop_wrong),
                    in_place: timing(i, |x| x.ip_us, |x| x.ip_wrong),
                }
            })
            .collect();
        let peak = rows
            .last()
            .map(|r| (r.bytes, r.out_of_place.busbw_gbs.max(r.in_place.busbw_gbs)));
        Sweep { rows, peak }
    }

    /// Out-of-place (algbw, busbw) at the largest size.
    fn largest(&self) -> Option<(f64, f64)> {
        self.rows
            .last()
            .map(|r| (r.out_of_place.algbw_gbs, r.out_of_place.busbw_gbs))
    }

    /// Wrong elements in any result.
    fn wrong_results(&self) -> Vec<Finding> {
        let wrong: u64 = self
            .rows
            .iter()
            .map(|r| r.out_of_place.wrong + r.in_place.wrong)
            .sum();
        if wrong == 0 {
            return Vec::new();
        }
        vec![Finding::fail(
            Check::Results,
            Verdict::Wrong,
            format!(
                "{wrong} elements of all-reduce results were wrong: data corruption on a GPU or \
                 link; rerun to see whether it repeats, then test the nodes one by one"
            ),
        )]
    }
}

/// A rank that did not report, as the JSON report lists it.
#[derive(Serialize)]
struct SilentRank<'a> {
    rank: usize,
    host: &'a str,
    last_stage: Option<&'a str>,
}

/// The JSON report (`--report`): what the text says, as data.
#[derive(Serialize)]
struct Report<'a> {
    verdict: &'static str,
    exit_code: u8,
    mode: Mode,
    world_size: usize,
    wall_s: f64,
    /// Each NCCL the ranks loaded, "2.28.9 (/path)".
    nccl: Vec<String>,
    other_libraries: &'a [String],
    ranks: Vec<&'a RankReport>,
    silent_ranks: Vec<SilentRank<'a>>,
    rows: &'a [SweepRow],
    problems: Vec<String>,
    hints: Vec<String>,
    line_rate: Option<LineRate>,
    nccl_path: Option<hardware::NcclPath>,
}

impl Outcome {
    /// Every check over what the ranks reported, the verdict they make, and the report.
    pub fn summarize(&self) -> Summary {
        let complete = self.complete();
        let mut findings = Vec::new();
        findings.extend(self.nccl_versions());
        findings.extend(self.rank_errors());
        findings.extend(self.silent_ranks());
        // The rest judge the sweep, which needs every rank's.
        let sweep = (complete.len() == self.world_size && self.world_size > 0)
            .then(|| Sweep::of(&complete, self.world_size));
        let (mut line_rate, mut path) = (None, None);
        match &sweep {
            Some(sw) => {
                findings.extend(sw.wrong_results());
                findings.extend(self.node_speed(&complete));
                let gpu_rate = self.gpu_line_rate(&complete, sw.peak);
                findings.extend(self.gpu_link_checks(&complete, gpu_rate.as_ref()));
                let nodes = Nodes::of(&complete);
                findings.extend(self.network(&nodes));
                findings.extend(self.ring_links(&complete, &nodes));
                let net_rate = self.network_line_rate(&nodes, sw.peak);
                findings.extend(self.network_rate_checks(&complete, net_rate.as_ref()));
                findings.extend(self.health(&complete));
                findings.extend(self.memory(&complete));
                path = nccl_path(&complete);
                if let Some(p) = &path {
                    findings.push(Finding::info(
                        Check::NcclPath,
                        format!("NCCL path: {}", p.describe()),
                    ));
                }
                findings.extend(self.min_busbw(sw.peak));
                line_rate = gpu_rate.or(net_rate);
            }
            None => {
                let missing = self.missing_reports(complete.len(), &findings);
                findings.extend(missing);
            }
        }
        let verdict = finding::verdict(&findings);
        let text = self.render(sweep.as_ref(), &findings, verdict);
        let report = Report {
            verdict: verdict.name(),
            exit_code: verdict.exit_code(),
            mode: self.mode,
            world_size: self.world_size,
            wall_s: self.wall_s,
            nccl: self.versions().into_keys().collect(),
            other_libraries: &self.other_libs,
            ranks: self.reports.values().collect(),
            silent_ranks: self
                .silent
                .iter()
                .map(|(rank, host, stage)| SilentRank {
                    rank: *rank,
                    host,
                    last_stage: stage.as_deref(),
                })
                .collect(),
            rows: sweep.as_ref().map_or(&[], |s| &s.rows),
            problems: finding::problems(&findings),
            hints: finding::hints(&findings),
            line_rate,
            nccl_path: path,
        };
        let json = serde_json::to_value(&report).unwrap_or_default();
        Summary {
            verdict,
            text,
            json,
            problems: report.problems,
            largest: sweep.as_ref().and_then(Sweep::largest),
            findings,
        }
    }

    /// The text report: what ran where, the sweep table, the facts the checks found, the
    /// problems, the hints, and the verdict line.
    fn render(&self, sweep: Option<&Sweep>, findings: &[Finding], verdict: Verdict) -> String {
        let mut t = String::new();
        let what = match self.mode {
            Mode::Nccl => "NCCL all-reduce",
            Mode::Net => "network (TCP ring) all-reduce",
        };
        let _ = writeln!(
            t,
            "nrun preflight: {what}, {} ranks on {} node(s)",
            self.world_size,
            self.hosts().len().max(1)
        );
        // Several versions are a problem, listed there.
        let versions = self.versions();
        match versions.len() {
            0 => {
                if let Some(p) = &self.nccl_lib {
                    let _ = writeln!(
                        t,
                        "  NCCL at {p} (no rank got as far as reporting its version)"
                    );
                }
            }
            1 => {
                let _ = writeln!(
                    t,
                    "  NCCL {}",
                    versions.keys().next().map_or("", |s| s.as_str())
                );
            }
            _ => {}
        }
        for lib in &self.other_libs {
            let _ = writeln!(t, "  also found: {lib}");
        }
        if let Some(r) = self.reports.values().find(|r| r.gpu.is_some()) {
            let gpus: std::collections::BTreeSet<&str> = self
                .reports
                .values()
                .filter_map(|r| r.gpu.as_deref())
                .collect();
            let _ = writeln!(
                t,
                "  GPUs: {}; driver CUDA {}",
                gpus.into_iter().collect::<Vec<_>>().join(", "),
                r.driver.as_deref().unwrap_or("?")
            );
        }
        self.render_times(&mut t);
        if let Some(sw) = sweep {
            render_table(&mut t, sw);
        }
        for f in findings.iter().filter(|f| !f.is_problem()) {
            let _ = writeln!(t, "  {}", f.evidence);
        }
        let _ = writeln!(t);
        for p in finding::problems(findings) {
            let _ = writeln!(t, "  problem: {p}");
        }
        for h in finding::hints(findings) {
            let _ = writeln!(t, "  hint: {h}");
        }
        let detail = match (verdict, sweep.and_then(|s| s.peak)) {
            (Verdict::Ok, Some((bytes, bw))) if self.world_size > 1 => {
                format!(": busbw {bw:.1} GB/s at {}, 0 wrong", human_bytes(bytes))
            }
            (Verdict::Ok, _) => ": 0 wrong".to_string(),
            _ => String::new(),
        };
        let _ = writeln!(
            t,
            "preflight {}{detail} ({:.2} s; exit code {})",
            verdict.name(),
            self.wall_s,
            verdict.exit_code()
        );
        t
    }

    /// Communicator init per node, and where the time went phase by phase (the slowest rank
    /// of each).
    fn render_times(&self, t: &mut String) {
        let mut init_by_host: std::collections::BTreeMap<&str, f64> = Default::default();
        for r in self.reports.values() {
            if let Some(ms) = r.init_ms {
                let e = init_by_host.entry(r.host.as_str()).or_insert(0.0);
                *e = e.max(ms);
            }
        }
        if !init_by_host.is_empty() {
            let parts: Vec<String> = init_by_host
                .iter()
                .map(|(h, ms)| format!("{h} {:.0} ms", ms))
                .collect();
            let _ = writeln!(t, "  communicator init: {}", parts.join(", "));
        }
        let mut phases: Vec<(String, f64)> = Vec::new();
        for r in self.reports.values() {
            for (name, ms) in &r.phases_ms {
                match phases.iter_mut().find(|(n, _)| n == name) {
                    Some((_, m)) => *m = m.max(*ms),
                    None => phases.push((name.clone(), *ms)),
                }
            }
        }
        if !phases.is_empty() {
            let parts: Vec<String> = phases
                .iter()
                .map(|(n, ms)| format!("{n} {ms:.0}"))
                .collect();
            let _ = writeln!(
                t,
                "  time per phase (ms, slowest rank): {}",
                parts.join(", ")
            );
        }
    }
}

/// The sweep table, nccl-tests' columns.
fn render_table(t: &mut String, sw: &Sweep) {
    let _ = writeln!(t);
    let _ = writeln!(
        t,
        "  {:>12} {:>11}   {:>10} {:>11} {:>11} {:>7}   {:>10} {:>11} {:>11} {:>7}",
        "", "", "out-of-place", "", "", "", "in-place", "", "", ""
    );
    let _ = writeln!(
        t,
        "  {:>12} {:>11}   {:>10} {:>11} {:>11} {:>7}   {:>10} {:>11} {:>11} {:>7}",
        "size (B)",
        "count",
        "time (us)",
        "algbw GB/s",
        "busbw GB/s",
        "#wrong",
        "time (us)",
        "algbw GB/s",
        "busbw GB/s",
        "#wrong"
    );
    for r in &sw.rows {
        let (o, i) = (&r.out_of_place, &r.in_place);
        let _ = writeln!(
            t,
            "  {:>12} {:>11}   {:>10.2} {:>11.2} {:>11.2} {:>7}   {:>10.2} {:>11.2} {:>11.2} {:>7}",
            r.bytes,
            r.count,
            o.time_us,
            o.algbw_gbs,
            o.busbw_gbs,
            o.wrong,
            i.time_us,
            i.algbw_gbs,
            i.busbw_gbs,
            i.wrong
        );
    }
    if !sw.rows.is_empty() {
        let avg = sw
            .rows
            .iter()
            .map(|r| r.out_of_place.busbw_gbs)
            .sum::<f64>()
            / sw.rows.len() as f64;
        let _ = writeln!(t, "  avg busbw (out-of-place, all sizes): {avg:.2} GB/s");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finding::Severity;
    use crate::hardware::Waiver;

    fn empty(world_size: usize) -> Outcome {
        Outcome {
            world_size,
            mode: Mode::Nccl,
            reports: Default::default(),
            silent: vec![],
            crashed: None,
            stopped: None,
            nccl_lib: None,
            min_busbw: None,
            min_efficiency: None,
            path_vars: vec![],
            waived: vec![],
            wall_s: 0.5,
            other_libs: vec![],
        }
    }

    #[test]
    fn the_renderer_prints_facts_then_problems_then_hints_then_the_verdict() {
        let findings = [
            Finding::info(
                Check::LineRate,
                "line rate: NVLink 18 links x 25 GB/s = 450 GB/s",
            ),
            Finding::fail(Check::Memory, Verdict::Slow, "rank 1 on a: a degraded GPU")
                .node("a")
                .rank(1)
                .hint("reset the GPU"),
            Finding::info(Check::NcclPath, "NCCL path: P2P/CUMEM x48, 24 channels"),
            Finding::warn(Check::NodeSpeed, "node b is slow").hint("reset the GPU"),
        ];
        let o = empty(2);
        let verdict = finding::verdict(&findings);
        assert_eq!(
            o.render(None, &findings, verdict),
            "nrun preflight: NCCL all-reduce, 2 ranks on 1 node(s)\n\
             \x20 line rate: NVLink 18 links x 25 GB/s = 450 GB/s\n\
             \x20 NCCL path: P2P/CUMEM x48, 24 channels\n\
             \n\
             \x20 problem: rank 1 on a: a degraded GPU\n\
             \x20 problem: node b is slow\n\
             \x20 hint: reset the GPU\n\
             preflight too slow (0.50 s; exit code 94)\n"
        );
        // Nothing found: ok, with nothing measured to quote.
        assert_eq!(
            o.render(None, &[], Verdict::Ok),
            "nrun preflight: NCCL all-reduce, 2 ranks on 1 node(s)\n\
             \n\
             preflight ok: 0 wrong (0.50 s; exit code 0)\n"
        );
    }

    #[test]
    fn findings_say_where_and_the_json_is_the_same_result() {
        // A rank that never reported, and one whose GPU is throttled.
        let mut o = empty(1);
        o.silent = vec![(0, "b".into(), Some("init".into()))];
        let s = o.summarize();
        assert_eq!(s.verdict, Verdict::Timeout);
        let f = &s.findings[0];
        assert_eq!(
            (f.check, f.node.as_deref(), f.rank, f.severity),
            (
                Check::Silent,
                Some("b"),
                Some(0),
                Severity::Fail(Verdict::Timeout)
            )
        );
        assert_eq!(s.json["verdict"], "timed out");
        assert_eq!(s.json["exit_code"], 92);
        assert_eq!(s.json["problems"][0], f.evidence.as_str());
        assert_eq!(s.json["hints"].as_array().unwrap().len(), f.hints.len());
        assert_eq!(s.json["silent_ranks"][0]["last_stage"], "init");

        let h = hardware::Health {
            slowdowns: vec!["power brake".into()],
            ..Default::default()
        };
        let mut o = empty(0);
        let r: RankReport = serde_json::from_value(serde_json::json!({
            "rank": 0, "local_rank": 0, "host": "a", "pid": 9, "nccl_version": null,
            "nccl_path": null, "gpu": "NVIDIA H200 (0000:00:06.0)", "driver": null,
            "init_ms": null, "rows": [], "error": null,
        }))
        .unwrap();
        o.reports.insert(
            0,
            RankReport {
                health: Some(h),
                ..r
            },
        );
        o.world_size = 1;
        let s = o.summarize();
        let f = s
            .findings
            .iter()
            .find(|f| f.check == Check::Health(Some(Waiver::Throttle)))
            .unwrap();
        assert_eq!(f.severity, Severity::Fail(Verdict::Slow));
        assert_eq!(f.gpu.as_deref(), Some("NVIDIA H200 (0000:00:06.0)"));
        assert_eq!(s.verdict, Verdict::Slow);
        // Waived, the same finding is a fact, and the verdict ok.
        o.waived = vec![Waiver::Throttle];
        let s = o.summarize();
        assert_eq!(s.verdict, Verdict::Ok);
        assert!(
            s.findings.iter().all(|f| f.severity == Severity::Info),
            "{:?}",
            s.findings
        );
        assert!(s.text.contains("(waived: throttle)"), "{}", s.text);
    }
}
