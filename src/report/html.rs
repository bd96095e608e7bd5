//! The incident report a person reads: one self-contained HTML page drawn from a `--report`
//! (the job's, `--preflight-only`'s or bisect's, as the schema's [`Report`]), for `nrun report`
//! and the job's `--report-html`. Every view reads the schema's types (the events as
//! [`EventRecord`]s, matched by variant), but the preflight's ranks and sweep rows, which the
//! schema carries as JSON.
//!
//! The page has no script and loads nothing: inline CSS, charts as inline SVG drawn here, a
//! Content-Security-Policy that forbids every fetch (so a browser says so if anything ever
//! tried), and it opens from disk. Every string from the report is escaped ([`esc`]): a host
//! name or a worker's message is data, never markup. Any key but the one that makes a report
//! may be missing (an older report, a bisect or preflight report): a view whose data is absent
//! says "not recorded".
//!
//! Views, each a `<section class="view" id=...>`: `summary`, `timeline` ([`timeline`]),
//! `ledger`, `preflight` (the bus-bandwidth curve), `bisect` (the verdict matrix, bisect
//! reports only), `nodes`, `decisions`, `watch`. Sizes stay bounded at scale: the timeline
//! merges a row's marks that fall on the same pixels, long lists are cut with a count of what
//! was left out.

mod charts;
mod timeline;

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use crate::journal::{Event, EventRecord};
use crate::watch::{Diagnosis, RankState, WatchReport};

use super::schema::{
    AttemptReport, BisectNode, JobSection, LedgerReport, NodesReport, Phase, PreflightReport,
    Report,
};

/// Most rows a table shows before it says how many it left out.
const TABLE_ROWS: usize = 200;

/// Renders and writes the page; `flag` names where the path came from in an error.
pub(crate) fn write(
    flag: &str,
    path: &Path,
    report: Report,
    source: &str,
) -> nrun_base::error::Result<()> {
    crate::report::write_out(flag, path, render(report, source).as_bytes())
}

/// The whole page. `source`: what the report was read from, shown in the header. The views of
/// the preflight's ranks and sweep rows (carried as JSON by the schema) read that JSON.
pub(crate) fn render(mut r: Report, source: &str) -> String {
    let (v, evs) = json_parts(&mut r);
    let r = &r;
    let mut body = String::new();
    body.push_str(&summary(r, source));
    body.push_str(&timeline::section(&evs, r.ledger().map(|l| l.wall_s)));
    body.push_str(&ledger(r.ledger()));
    body.push_str(&preflight(r.preflight(), &v, &evs));
    if let Report::Bisect(b) = r {
        body.push_str(&charts::bisect(b));
    }
    body.push_str(&nodes(
        &v,
        &evs,
        r.session().and_then(|p| p.nodes.as_ref()),
        match r {
            Report::Bisect(b) => &b.nodes[..],
            _ => &[],
        },
    ));
    body.push_str(&decisions(r.job(), &evs));
    body.push_str(&watch(match r {
        Report::Job(j) => j.watch.as_ref(),
        _ => None,
    }));
    let title = match r {
        Report::Job(j) => format!("nrun job: {}", j.job.outcome),
        Report::Preflight(p) => format!("nrun preflight: {}", p.preflight.verdict),
        Report::Bisect(_) => "nrun bisect".to_string(),
    };
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n\
         <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{}</title>\n<style>{CSS}</style></head>\n<body>\n{body}<footer>written by nrun {}</footer>\n</body></html>\n",
        esc(&title),
        esc(nrun_base::VERSION),
    )
}

/// The preflight's ranks and sweep rows (the sections the schema carries as JSON), moved out
/// of `r` into one object the views of them read, and the events (moved, not copied: they are
/// most of a large report).
fn json_parts(r: &mut Report) -> (Value, Vec<EventRecord>) {
    let mut evs = Vec::new();
    let mut o = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        if !v.is_null() {
            o.insert(k.to_string(), v);
        }
    };
    let list = |l: &mut Vec<Value>| Value::Array(std::mem::take(l));
    if let Some(p) = match r {
        Report::Job(j) => j.preflight.as_mut(),
        Report::Preflight(p) => Some(&mut p.preflight),
        Report::Bisect(_) => None,
    } {
        put("ranks", list(&mut p.ranks));
        put("rows", list(&mut p.rows));
    }
    if let Some(parts) = r.session_mut() {
        evs = parts.events.take().unwrap_or_default();
    }
    (Value::Object(o), evs)
}

/// The header: what ended how, the ledger's one line, and links to the views.
fn summary(r: &Report, source: &str) -> String {
    let mut s = String::from("<section class=\"view\" id=\"summary\">\n");
    let what = match r {
        Report::Job(_) => "job",
        Report::Preflight(_) => "preflight",
        Report::Bisect(_) => "bisect",
    };
    let _ = writeln!(s, "<h1>nrun {what} report</h1>");
    let _ = write!(
        s,
        "<p class=\"source\">from <code>{}</code></p>\n<dl class=\"facts\">",
        esc(source)
    );
    let mut fact = |k: &str, val: String| {
        if !val.is_empty() {
            let _ = write!(s, "<dt>{}</dt><dd>{}</dd>", esc(k), val);
        }
    };
    let (outcome, code) = match r {
        Report::Job(j) => (j.job.outcome.clone(), j.job.exit_code),
        Report::Preflight(p) => (p.preflight.verdict.clone(), Some(p.preflight.exit_code)),
        Report::Bisect(b) => (bisect_outcome(&b.nodes), None),
    };
    if !outcome.is_empty() {
        let class = match outcome.as_str() {
            "success" | "ok" | "every node good" => "good",
            _ => "bad",
        };
        fact(
            "outcome",
            format!("<span class=\"badge {class}\">{}</span>", esc(&outcome)),
        );
    }
    let some = |x: Option<String>| x.map_or(String::new(), |t| esc(&t));
    fact("exit code", some(code.map(|c| c.to_string())));
    // A job that succeeded after a restart still names the failure it got over.
    let failed = match outcome.as_str() {
        "success" => "recovered from",
        _ => "what failed",
    };
    let job = r.job();
    fact(failed, some(job.and_then(|j| j.headline.clone())));
    fact(
        "attempts",
        some(job.and_then(|j| j.attempts).map(|n| n.to_string())),
    );
    fact(
        "restarts",
        some(job.and_then(|j| j.restarts).map(|n| n.to_string())),
    );
    // Restarts were left, but could not help (--max-no-progress-restarts).
    fact(
        "stopped",
        some(job.and_then(|j| j.retry.stopped_because.clone())),
    );
    let ledger = r.ledger();
    fact("ledger", some(ledger.map(|l| l.summary.clone())));
    if let Report::Bisect(b) = r
        && let Some(took) = b.seconds
    {
        fact(
            "took",
            esc(&format!(
                "{} rounds in {}",
                b.rounds.len(),
                nrun_base::duration_text(took)
            )),
        );
    }
    if let Some(e) = ledger.map(|l| l.effective) {
        fact("effective training time", format!("{:.1}%", e * 100.0));
    }
    s.push_str(
        "</dl>\n<nav><a href=\"#timeline\">timeline</a> <a href=\"#ledger\">ledger</a> \
                <a href=\"#preflight\">preflight</a> ",
    );
    if let Report::Bisect(_) = r {
        s.push_str("<a href=\"#bisect\">bisect</a> ");
    }
    s.push_str(
        "<a href=\"#nodes\">nodes</a> <a href=\"#decisions\">decisions</a> \
                <a href=\"#watch\">hangs and stragglers</a></nav>\n</section>\n",
    );
    s
}

fn bisect_outcome(nodes: &[BisectNode]) -> String {
    let bad = nodes.iter().filter(|n| n.verdict != "good").count();
    match bad {
        0 if nodes.is_empty() => String::new(),
        0 => "every node good".to_string(),
        n => format!("{n} of {} nodes not good", nodes.len()),
    }
}

/// What faults cost inside attempt `a` of the ledger (`first`: the job's first), by the rule
/// of the ledger's `lost_s` (`journal::Ledger::lost`): detecting, stopping, restarting and
/// waiting, and the start-up of every worker group after the first.
pub(crate) fn attempt_lost(a: &AttemptReport, first: bool) -> f64 {
    let get = |p: Phase| a.phases.get(&p).copied().unwrap_or(0.0);
    let start_up = if first { 0.0 } else { get(Phase::Starting) };
    [
        Phase::Detecting,
        Phase::Stopping,
        Phase::Restarting,
        Phase::Waiting,
    ]
    .into_iter()
    .map(get)
    .sum::<f64>()
        + start_up
}

/// The ledger: where the wall time went, in total and per attempt.
fn ledger(l: Option<&LedgerReport>) -> String {
    let mut s = open("ledger", "Where the time went (ledger)");
    let Some(l) = l else {
        return s + NOT_RECORDED + "</section>\n";
    };
    let wall = l.wall_s;
    let _ = writeln!(
        s,
        "<p class=\"ledger-summary\">{} <strong class=\"effective\">{:.1}% effective training time</strong></p>",
        esc(&l.summary),
        l.effective * 100.0
    );
    s.push_str(&charts::ledger_bars(l));
    s.push_str("<table class=\"phases\"><thead><tr><th>phase</th><th>seconds</th><th>share</th></tr></thead><tbody>\n");
    for p in Phase::ALL {
        let secs = l.phases.get(&p).copied();
        let share = secs.map_or(String::new(), |x| pct(x, wall));
        let _ = writeln!(
            s,
            "<tr><td><span class=\"sw ph-{p}\"></span>{p}</td><td class=\"n\">{}</td><td class=\"n\">{share}</td></tr>",
            secs.map_or("not recorded".to_string(), |x| format!("{x:.1}")),
            p = p.key(),
        );
    }
    let _ = writeln!(
        s,
        "<tr class=\"total\"><td>wall time</td><td class=\"n\">{wall:.1}</td><td class=\"n\">100%</td></tr></tbody></table>"
    );
    if !l.attempts.is_empty() {
        s.push_str("<h3>Attempts</h3><table class=\"attempts\"><thead><tr><th>attempt</th><th>from</th><th>to</th><th>outcome</th><th>running</th><th>lost</th></tr></thead><tbody>\n");
        for (i, a) in l.attempts.iter().enumerate().take(TABLE_ROWS) {
            let running = a.phases.get(&Phase::Running).copied().unwrap_or(0.0);
            let _ = writeln!(
                s,
                "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td class=\"n\">{running:.1} s</td><td class=\"n\">{:.1} s</td></tr>",
                a.attempt,
                format_args!("{:.1} s", a.start_s),
                format_args!("{:.1} s", a.end_s),
                esc(&a.outcome),
                attempt_lost(a, i == 0),
            );
        }
        // The rows add up to the job's lost time: what no attempt holds (restarting and
        // waiting for nodes between them) has a row of its own.
        let within: f64 = l
            .attempts
            .iter()
            .enumerate()
            .map(|(i, a)| attempt_lost(a, i == 0))
            .sum();
        let between = l.lost_s - within;
        if between >= 0.05 {
            let _ = writeln!(
                s,
                "<tr><td colspan=\"5\">between attempts (restarting, waiting for nodes)</td><td class=\"n\">{between:.1} s</td></tr>"
            );
        }
        let _ = writeln!(
            s,
            "<tr class=\"total\"><td colspan=\"5\">lost in all (the first attempt's start-up is the job's own cost, not lost)</td><td class=\"n\">{:.1} s</td></tr>",
            l.lost_s
        );
        s.push_str("</tbody></table>\n");
        s.push_str(&cut(l.attempts.len(), "attempts"));
    }
    s + "</section>\n"
}

/// The preflight: the bus-bandwidth curve against the line rate, and its verdict.
fn preflight(p: Option<&PreflightReport>, v: &Value, evs: &[EventRecord]) -> String {
    let mut s = open("preflight", "Preflight: bus bandwidth by message size");
    let points = charts::busbw_points(v, evs);
    if points.is_empty() && p.is_none() {
        return s + NOT_RECORDED + "</section>\n";
    }
    let _ = write!(s, "<dl class=\"facts\">");
    if let Some(p) = p {
        let mode = p.mode.map(|m| match m {
            nrun_preflight::Mode::Nccl => "nccl",
            nrun_preflight::Mode::Net => "net",
        });
        for (k, t) in [
            ("verdict", Some(p.verdict.clone())),
            ("exit code", Some(p.exit_code.to_string())),
            ("mode", mode.map(String::from)),
            ("ranks", Some(p.world_size.to_string())),
        ] {
            if let Some(t) = t.filter(|t| !t.is_empty()) {
                let _ = write!(s, "<dt>{k}</dt><dd>{}</dd>", esc(&t));
            }
        }
        let _ = write!(
            s,
            "<dt>took</dt><dd>{}</dd>",
            nrun_base::duration_text(p.wall_s)
        );
        if !p.nccl.is_empty() {
            let _ = write!(s, "<dt>NCCL</dt><dd>{}</dd>", esc(&p.nccl.join(", ")));
        }
        if let Some(lr) = &p.line_rate
            && let Some(g) = lr.gbs
        {
            let _ = write!(
                s,
                "<dt>line rate</dt><dd>{g:.1} GB/s ({}); busbw {:.1} GB/s, {:.0}% of it</dd>",
                esc(&lr.what),
                lr.busbw_gbs.unwrap_or(0.0),
                lr.efficiency.unwrap_or(0.0) * 100.0
            );
        }
    }
    s.push_str("</dl>\n");
    s.push_str(&charts::busbw(p, evs, &points));
    let none = Vec::new();
    for (what, key, items) in [
        ("problem", "problems", p.map_or(&none, |p| &p.problems)),
        ("hint", "hints", p.map_or(&none, |p| &p.hints)),
    ] {
        if !items.is_empty() {
            let _ = write!(s, "<ul class=\"{key}\">");
            for i in items.iter().take(TABLE_ROWS) {
                let _ = write!(s, "<li>{what}: {}</li>", esc(i));
            }
            s.push_str("</ul>\n");
            s.push_str(&cut(items.len(), key));
        }
    }
    if let Some(silent) = p.map(|p| &p.silent_ranks).filter(|a| !a.is_empty()) {
        let _ = write!(
            s,
            "<p class=\"problems\">{} rank(s) never reported: ",
            silent.len()
        );
        let names: Vec<String> = silent
            .iter()
            .take(20)
            .map(|r| format!("rank {} on {}", r.rank, r.host))
            .collect();
        let _ = writeln!(s, "{}</p>", esc(&names.join(", ")));
    }
    s + "</section>\n"
}

/// One row of the node table, gathered from wherever the report mentions the node.
#[derive(Default)]
struct NodeRow {
    host: String,
    status: String,
    gpus: String,
    nccl: String,
    torch: String,
    ifname: String,
    gpu_model: String,
    driver: String,
    ranks: usize,
    verdict: String,
    evidence: String,
}

/// Which of a row's fields a fact fills.
type Field = fn(&mut NodeRow) -> &mut String;

/// The node table: status in the job, versions, GPUs, interface, the preflight's facts and
/// bisect's verdict.
fn nodes(
    v: &Value,
    evs: &[EventRecord],
    job: Option<&NodesReport>,
    bisect: &[BisectNode],
) -> String {
    let mut s = open("nodes", "Nodes");
    let rows = node_rows(v, evs, job, bisect);
    if rows.is_empty() {
        return s + NOT_RECORDED + "</section>\n";
    }
    let cols = [
        "node",
        "status",
        "GPUs",
        "GPU",
        "driver",
        "NCCL",
        "torch",
        "interface",
        "preflight ranks",
        "bisect",
        "evidence",
    ];
    s.push_str("<table class=\"node-table\"><thead><tr>");
    for c in cols {
        let _ = write!(s, "<th>{c}</th>");
    }
    s.push_str("</tr></thead><tbody>\n");
    for r in rows.iter().take(TABLE_ROWS * 6) {
        let ranks = match r.ranks {
            0 => String::new(),
            n => n.to_string(),
        };
        let class = match (r.status.starts_with("left out"), r.verdict.as_str()) {
            (true, _) => " class=\"out\"",
            (_, "" | "good") => "",
            _ => " class=\"out\"",
        };
        s.push_str(&format!("<tr{class}>"));
        for c in [
            &r.host,
            &r.status,
            &r.gpus,
            &r.gpu_model,
            &r.driver,
            &r.nccl,
            &r.torch,
            &r.ifname,
            &ranks,
            &r.verdict,
            &r.evidence,
        ] {
            let _ = write!(s, "<td>{}</td>", esc(c));
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</tbody></table>\n");
    s.push_str(&cut_at(rows.len(), TABLE_ROWS * 6, "nodes"));
    s + "</section>\n"
}

/// The node table's rows, in the order the report first names each node.
fn node_rows(
    v: &Value,
    evs: &[EventRecord],
    job: Option<&NodesReport>,
    bisect: &[BisectNode],
) -> Vec<NodeRow> {
    let mut rows: Vec<NodeRow> = Vec::new();
    let mut at = std::collections::HashMap::<String, usize>::new();
    let mut row = |host: &str| -> usize {
        *at.entry(host.to_string()).or_insert_with(|| {
            rows.push(NodeRow {
                host: host.to_string(),
                ..Default::default()
            });
            rows.len() - 1
        })
    };
    let mut set: Vec<(usize, Field, String)> = Vec::new();
    for e in evs {
        let host = e.host.as_deref().unwrap_or_default();
        if let Some(Event::NodeJoined {
            gpus,
            nccl,
            torch,
            ifname,
            ..
        }) = e.event()
            && !host.is_empty()
        {
            let i = row(host);
            let said = |x: &Option<String>| x.clone().unwrap_or_default();
            set.push((i, |r| &mut r.gpus, gpus.to_string()));
            set.push((i, |r| &mut r.nccl, said(nccl)));
            set.push((i, |r| &mut r.torch, said(torch)));
            set.push((i, |r| &mut r.ifname, said(ifname)));
        }
    }
    let (ran_on, spares, left_out) = match job {
        Some(n) => (&n.ran_on[..], &n.spares[..], &n.left_out[..]),
        None => (&[][..], &[][..], &[][..]),
    };
    for (hosts, status) in [(ran_on, "ran the job"), (spares, "spare")] {
        for h in hosts {
            let i = row(h);
            set.push((i, |r| &mut r.status, status.to_string()));
        }
    }
    for l in left_out {
        let i = row(&l.host);
        let status = format!("left out ({})", l.stage);
        set.push((i, |r| &mut r.status, status));
        set.push((i, |r| &mut r.evidence, l.why.clone()));
    }
    // A spare that came in says whose place it took.
    for (e, replaces) in evs.iter().filter_map(|e| match e.event() {
        Some(Event::SpareIn { replaces, .. }) => Some((e, replaces)),
        _ => None,
    }) {
        let i = row(e.host.as_deref().unwrap_or_default());
        let status = format!("spare, in for {}", replaces.as_deref().unwrap_or_default());
        set.push((i, |r| &mut r.status, status));
    }
    // bisect's nodes: a list of verdicts.
    for b in bisect {
        let i = row(&b.host);
        set.push((i, |r| &mut r.verdict, b.verdict.clone()));
        set.push((i, |r| &mut r.evidence, b.evidence.join("; ")));
    }
    let mut ranks: Vec<(usize, &Value)> = Vec::new();
    for r in v["ranks"].as_array().into_iter().flatten() {
        ranks.push((row(&text(&r["host"])), r));
    }
    for (i, f, val) in set {
        if !val.is_empty() {
            *f(&mut rows[i]) = val;
        }
    }
    for (i, r) in ranks {
        let row = &mut rows[i];
        row.ranks += 1;
        for (dst, key) in [
            (&mut row.gpu_model, "gpu"),
            (&mut row.driver, "driver"),
            (&mut row.nccl, "nccl_version"),
        ] {
            if dst.is_empty() {
                *dst = text(&r[key]);
            }
        }
    }
    rows
}

/// Every decision of the fault model, with its evidence.
fn decisions(job: Option<&JobSection>, evs: &[EventRecord]) -> String {
    let mut s = open("decisions", "Decisions and their evidence");
    let mut rows: Vec<[String; 6]> = Vec::new();
    for d in job.map_or(&[][..], |j| &j.decisions[..]) {
        rows.push([
            d.attempt.map_or(String::new(), |a| a.to_string()),
            d.host.clone(),
            d.verdict.clone(),
            d.action.clone(),
            match d.left_out {
                true => "yes".into(),
                false => "no".into(),
            },
            d.evidence.clone(),
        ]);
    }
    // A report without the job's list still has the decisions among its events.
    if rows.is_empty() {
        for e in evs {
            if let Some(Event::Decision {
                verdict,
                action,
                evidence,
                ..
            }) = e.event()
            {
                rows.push([
                    e.attempt.map_or(String::new(), |a| a.to_string()),
                    e.host.clone().unwrap_or_default(),
                    verdict.clone(),
                    action.clone(),
                    String::new(),
                    evidence.clone(),
                ]);
            }
        }
    }
    if rows.is_empty() {
        let said = match job {
            Some(_) => "<p class=\"not-recorded\">no decision was taken: no attempt failed</p>\n",
            None => NOT_RECORDED,
        };
        return s + said + "</section>\n";
    }
    s.push_str("<table class=\"decision-table\"><thead><tr><th>attempt</th><th>node</th><th>verdict</th><th>action</th><th>left out</th><th>evidence</th></tr></thead><tbody>\n");
    for r in rows.iter().take(TABLE_ROWS) {
        s.push_str("<tr class=\"decision\">");
        for c in r {
            let _ = write!(s, "<td>{}</td>", esc(c));
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</tbody></table>\n");
    s.push_str(&cut(rows.len(), "decisions"));
    s + "</section>\n"
}

/// Most ranks of a hang listed (its culprits always are).
const HANG_RANKS: usize = 16;

/// The watch's hangs, stragglers and mismatched collectives.
fn watch(w: Option<&WatchReport>) -> String {
    let mut s = open("watch", "Hangs and stragglers (the watch)");
    let Some(w) = w else {
        return s + NOT_RECORDED + "</section>\n";
    };
    if w.hangs.is_empty() && w.stragglers.is_empty() && w.mismatches.is_empty() {
        return s
            + "<p class=\"not-recorded\">the watch found no hang, straggler or mismatch</p>\n</section>\n";
    }
    for h in w.hangs.iter().take(TABLE_ROWS) {
        s.push_str(&hang(h));
    }
    if !w.stragglers.is_empty() {
        s.push_str("<h3>Stragglers</h3><table class=\"stragglers\"><thead><tr><th>rank</th><th>node</th><th>waited for peers</th><th>median rank waited</th></tr></thead><tbody>\n");
        for st in w.stragglers.iter().take(TABLE_ROWS) {
            let _ = writeln!(
                s,
                "<tr class=\"straggler\"><td>{}</td><td>{}</td><td class=\"n\">{:.0}%</td><td class=\"n\">{:.0}%</td></tr>",
                st.rank,
                esc(&st.host),
                st.waited_pct,
                st.median_pct,
            );
        }
        s.push_str("</tbody></table>\n");
        s.push_str(&cut(w.stragglers.len(), "stragglers"));
    }
    if !w.mismatches.is_empty() {
        s.push_str("<h3>Mismatched collectives</h3><ul class=\"mismatches\">");
        for m in w.mismatches.iter().take(TABLE_ROWS) {
            let _ = write!(
                s,
                "<li>group {} call #{}: {} (culprits: {})</li>",
                esc(&m.pg),
                m.seq,
                esc(&serde_json::to_string(&m.calls).unwrap_or_default()),
                esc(&numbers(&m.culprits)),
            );
        }
        s.push_str("</ul>\n");
    }
    s + "</section>\n"
}

/// One hang: its kind, stall and conclusion, its ranks (culprits first), and what NCCL's RAS
/// said.
fn hang(h: &Diagnosis) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "<div class=\"hang\"><h3>hang: {}</h3><p>stalled {}; {}</p>",
        esc(h.kind.as_str()),
        nrun_base::duration_text(h.stalled_s),
        esc(&h.conclusion),
    );
    s.push_str("<table><thead><tr><th>rank</th><th>node</th><th>pid</th><th>state</th><th>innermost frames</th></tr></thead><tbody>\n");
    let culprit = |r: &&RankState| h.culprits.contains(&r.rank);
    let shown = h
        .ranks
        .iter()
        .filter(culprit)
        .chain(h.ranks.iter().filter(|r| !culprit(r)))
        .take(HANG_RANKS);
    for r in shown {
        let frames: Vec<&str> = r.frames.iter().take(4).map(String::as_str).collect();
        let class = match culprit(&r) {
            true => " class=\"culprit\"",
            false => "",
        };
        let _ = writeln!(
            s,
            "<tr{class}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><pre>{}</pre></td></tr>",
            r.rank,
            esc(&r.host),
            r.pid,
            esc(&r.state),
            esc(&frames.join("\n")),
        );
    }
    s.push_str("</tbody></table>");
    s.push_str(&cut_at(h.ranks.len(), HANG_RANKS, "ranks"));
    if let Some(ras) = h.nccl_ras.as_ref().filter(|r| !r.findings.is_empty()) {
        let lines: Vec<&str> = ras.findings.iter().take(20).map(String::as_str).collect();
        let _ = write!(
            s,
            "<p>NCCL's RAS (asked on {}):</p><pre>{}</pre>",
            esc(&ras.host),
            esc(&lines.join("\n"))
        );
    }
    s + "</div>\n"
}

/// Numbers joined with "; ", as the page says a list.
fn numbers(xs: &[usize]) -> String {
    xs.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

const NOT_RECORDED: &str = "<p class=\"not-recorded\">not recorded in this report</p>\n";

/// A view's opening: its section and heading.
fn open(id: &str, title: &str) -> String {
    format!("<section class=\"view\" id=\"{id}\">\n<h2>{title}</h2>\n")
}

/// "N more not shown" under a list cut at [`TABLE_ROWS`].
fn cut(len: usize, what: &str) -> String {
    cut_at(len, TABLE_ROWS, what)
}

fn cut_at(len: usize, max: usize, what: &str) -> String {
    match len > max {
        true => format!("<p class=\"cut\">{} more {what} not shown</p>\n", len - max),
        false => String::new(),
    }
}

/// Escapes text for HTML content and attribute values alike.
pub(super) fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// A JSON value as a person reads it: a string as is, null as nothing, the rest as JSON.
pub(super) fn text(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => format!("{}", (f * 1000.0).round() / 1000.0),
            _ => n.to_string(),
        },
        v => v.to_string(),
    }
}

/// `part` as a share of `whole`, "12.3%" (nothing for a whole of 0).
fn pct(part: f64, whole: f64) -> String {
    match whole > 0.0 {
        true => format!("{:.1}%", 100.0 * part / whole),
        false => String::new(),
    }
}

/// One stylesheet for the page; the phase and mark colours are shared by charts and legends.
const CSS: &str = "
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em}
h3{font-size:1em}section.view{margin-bottom:2em}nav a{margin-right:1em}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:.2em 1em}dt{color:#666}dd{margin:0}
.badge{padding:0 .5em;border-radius:3px;color:#fff}.badge.good{background:#2a7}.badge.bad{background:#c33}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}tr.total td{font-weight:bold}
tr.out td,tr.culprit td{background:#fdecea}td:first-child{white-space:nowrap}pre{margin:0;white-space:pre-wrap;font-size:12px}
.not-recorded,.cut,.source,footer{color:#777;font-style:italic}
svg{display:block;max-width:100%;height:auto;margin:.5em 0}svg text{font:11px system-ui,sans-serif;fill:#333}
.axis path{stroke:#888}.axis line.grid{stroke:#e4e4e4}
.sw{display:inline-block;width:.8em;height:.8em;margin-right:.3em;vertical-align:-1px}
.ph-launch{fill:#8da0cb;background:#8da0cb}.ph-join{fill:#a6cee3;background:#a6cee3}
.ph-checks{fill:#b3b3b3;background:#b3b3b3}.ph-preflight{fill:#80b1d3;background:#80b1d3}
.ph-starting{fill:#bebada;background:#bebada}.ph-running{fill:#4daf4a;background:#4daf4a}
.ph-detecting{fill:#ff7f00;background:#ff7f00}.ph-stopping{fill:#e41a1c;background:#e41a1c}
.ph-restarting{fill:#f781bf;background:#f781bf}.ph-waiting{fill:#ffd92f;background:#ffd92f}
.ph-ending{fill:#999;background:#999}
.bar-success{fill:#4daf4a}.bar-failed{fill:#e8a0a0}.bar-hang{fill:#f4b860}.bar-interrupted{fill:#bbb}.bar-running{fill:#9fd39b}
.row-bg{fill:transparent}.row-bg:hover{fill:#f0f0ff}
.m{stroke:#222;stroke-width:.5}.m-failed{fill:#e41a1c}.m-hang{fill:#ff7f00}.m-straggler{fill:#ffd92f}
.m-left_out{fill:#222}.m-spare_in{fill:#1f78b4}.m-joined{fill:#aaa;stroke:none}.m-decision{fill:#984ea3}
.m-restart{fill:#f781bf}.m-waiting{fill:#ffd92f}.m-preflight{fill:#80b1d3}.m-end{fill:#555}
.restart-line{stroke:#f781bf;stroke-dasharray:4 3}
.legend span.item{margin-right:1em;white-space:nowrap}.legend .sw{border:1px solid #555}
.legend .m-failed{background:#e41a1c}.legend .m-hang{background:#ff7f00}.legend .m-straggler{background:#ffd92f}
.legend .m-left_out{background:#222}.legend .m-spare_in{background:#1f78b4}.legend .m-decision{background:#984ea3}
.legend .m-preflight{background:#80b1d3}.legend .m-end{background:#555}.legend .m-restart{background:#f781bf}.legend .m-joined{background:#aaa}.legend .m-waiting{background:#ffd92f}
.curve-oop{fill:none;stroke:#1f78b4;stroke-width:2}.curve-ip{fill:none;stroke:#a6cee3;stroke-width:2;stroke-dasharray:5 3}
.pt{fill:#1f78b4}.line-rate{stroke:#e41a1c;stroke-width:1.5;stroke-dasharray:6 4}
.cell-good{fill:#4daf4a}.cell-bad{fill:#e41a1c}.cell-slow{fill:#ff7f00}.cell-unreachable{fill:#222}
.cell-link{fill:#984ea3}.cell-group_failed{fill:#f4b0b0}.cell-untested{fill:#eee}
.legend .cell-good{background:#4daf4a}.legend .cell-bad{background:#e41a1c}.legend .cell-slow{background:#ff7f00}
.legend .cell-unreachable{background:#222}.legend .cell-link{background:#984ea3}
.legend .cell-group_failed{background:#f4b0b0}.legend .cell-untested{background:#eee}
";

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn markup_in_a_string_is_escaped_in_text_and_attributes() {
        assert_eq!(
            esc("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    /// The page of `v`, read as `nrun report` reads a file.
    fn page(v: &Value) -> String {
        let r = Report::read("t.json", v.to_string().as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        render(r, "t.json")
    }

    /// A report may lack any key but the one that says what it is (an older report, one cut
    /// by hand): every view is still there, saying what it lacks.
    #[test]
    fn a_report_missing_its_keys_still_makes_every_view() {
        let partial = [
            json!({"job": {}}),
            json!({"job": {"outcome": "failed"}, "events": [{"t": "soon"}, 3, null]}),
            json!({"job": {"decisions": [{}]}, "rows": [{}], "watch": {"hangs": [{}]},
                   "nodes": {"left_out": [{}], "ran_on": [null]}, "events": null}),
            json!({"verdict": "ok"}),
            json!({"rows": [{}]}),
            json!({"rounds": [{"groups": [{"hosts": ["a"]}, {}]}], "nodes": [{"host": "a"}, {}]}),
        ];
        for v in partial {
            let page = page(&v);
            for id in [
                "summary",
                "timeline",
                "ledger",
                "preflight",
                "nodes",
                "decisions",
                "watch",
            ] {
                assert!(page.contains(&format!("id=\"{id}\"")), "{id} in {v}");
            }
            assert!(page.ends_with("</html>\n"));
        }
    }

    /// What is not a report is refused, the file named, with what was expected and what was
    /// found: no JSON, JSON of another kind, a report's key holding what nrun never writes.
    #[test]
    fn what_is_not_a_report_is_refused_saying_why() {
        let cases: [(&[u8], &str); 9] = [
            (b"", "it is empty"),
            (b" \n", "it is empty"),
            (b"{\"job\": ", "it is not JSON (EOF while parsing"),
            (
                b"[1, 2]",
                "it holds a list of 2 where a report is an object",
            ),
            (
                b"{}",
                "no `job` object, no preflight `verdict`, no bisect `rounds` (its keys: none)",
            ),
            (b"{\"name\": 1, \"x\": []}", "(its keys: name, x)"),
            (
                b"{\"job\": null}",
                "its `job` is null where a job's report has an object",
            ),
            (
                b"{\"job\": {}, \"events\": {}}",
                "its `events` is an object where a report has a list",
            ),
            (
                b"{\"job\": {}, \"ledger\": {\"wall_s\": \"x\"}}",
                "a job report whose keys do not hold what nrun writes: its `ledger`: invalid type: \
                 string",
            ),
        ];
        for (bytes, why) in cases {
            let e = Report::read("x.json", bytes).unwrap_err();
            assert!(
                e.starts_with("x.json is not an nrun report: ") && e.contains(why),
                "{}: {e}",
                String::from_utf8_lossy(bytes)
            );
            assert!(e.contains("written by `nrun --report FILE`"), "{e}");
        }
        let e = Report::read("x.json", br#"{"job": {"decisions": [null, 1]}}"#).unwrap_err();
        assert!(
            e.contains("invalid type: null, expected struct Decision"),
            "{e}"
        );
        let e = Report::read("x.json", br#"{"job": {}, "ledger": {"wall_s": 1.0, "phases": {"coffee": 1.0}, "effective": 0.5}}"#).unwrap_err();
        assert!(e.contains("unknown variant `coffee`"), "{e}");
    }

    /// What nrun wrote reads back as it was: the report fixtures, typed and written again,
    /// hold the same JSON (keys older fixtures lack aside: those are written as null or empty);
    /// job-net-preflight-restart.json (a job with a net preflight, a failure and a restart,
    /// written by the binary before the typed schema) reads back whole.
    #[test]
    fn a_report_reads_back_as_it_was_written() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/report");
        for name in [
            "job-fail-restart.json",
            "job-hang-restart-spare.json",
            "job-hang-restart-spare.schema38-sample.json",
            "preflight-only-net.json",
            "bisect-slow-node.json",
            "job-net-preflight-restart.json",
        ] {
            let text = std::fs::read_to_string(format!("{dir}/{name}")).unwrap();
            let r = Report::read(name, text.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
            let mut want: Value = serde_json::from_str(&text).unwrap();
            let got = serde_json::to_value(&r).unwrap();
            // What the fixture lacks is written by today's nrun: compare the keys it has.
            fn within(want: &Value, got: &Value, at: &str) {
                match (want, got) {
                    (Value::Object(w), Value::Object(g)) => {
                        for (k, x) in w {
                            match g.get(k) {
                                Some(y) => within(x, y, &format!("{at}.{k}")),
                                None => panic!("{at}.{k} was dropped"),
                            }
                        }
                    }
                    (Value::Array(w), Value::Array(g)) => {
                        assert_eq!(w.len(), g.len(), "{at}");
                        for (i, (x, y)) in w.iter().zip(g).enumerate() {
                            within(x, y, &format!("{at}[{i}]"));
                        }
                    }
                    _ => assert_eq!(want, got, "{at}"),
                }
            }
            if let Some(o) = want.as_object_mut() {
                o.remove("_comment");
            }
            within(&want, &got, name);
            // Today's report (the binary's before the typed schema) reads back whole.
            if name == "job-net-preflight-restart.json" {
                assert_eq!(got, want, "{name}");
            }
            assert_eq!(
                Report::read(name, got.to_string().as_bytes()).unwrap(),
                r,
                "{name}"
            );
        }
    }

    #[test]
    fn time_ticks_are_round_in_seconds_minutes_or_hours() {
        assert_eq!(timeline::ticks(21.0), [0.0, 5.0, 10.0, 15.0, 20.0]);
        assert_eq!(timeline::ticks(20010.0)[1], 3600.0);
        assert!(timeline::ticks(1e-3).len() <= 9);
    }

    /// A node's 8 ranks failing at once are one mark whose tooltip counts them; a second
    /// failure later on the same row stays its own mark.
    #[test]
    fn marks_of_one_kind_at_one_place_merge_and_count() {
        let mut ev: Vec<serde_json::Value> = (0..8)
            .map(|r| {
                json!({"name": "worker_failed", "t": 100.0 + r as f64 * 0.001, "node": 0,
                       "host": "h1", "rank": r, "message": format!("rank {r} failed"),
                       "metadata": {"how": "exited with code 1", "exit_code": 1}})
            })
            .collect();
        ev.push(
            json!({"name": "worker_failed", "t": 900.0, "node": 0, "host": "h1",
                       "rank": 0, "message": "again", "metadata": {"how": "was killed by SIGKILL"}}),
        );
        let page = page(&json!({"job": {}, "events": ev}));
        assert_eq!(page.matches("class=\"m m-failed\"").count(), 2);
        assert!(page.contains("8 × failed"), "{page}");
        assert!(page.contains("… and 3 more"));
    }
}
