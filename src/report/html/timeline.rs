//! The timeline: one row per node over the job's time, from the report's `events`: each
//! attempt as a bar on the nodes it ran on, and marks for failures, hangs, stragglers, nodes
//! left out, spares in, joins; a top row for the job itself (its phases, decisions, waits) and
//! a dashed line at each restart. Every bar and mark has a `<title>` (the browser's tooltip).
//!
//! At scale a row's marks of one kind that land within [`MERGE_PX`] of each other become one
//! mark whose title counts them (a node whose 8 ranks failed at once is one mark), and rows
//! shrink to a few pixels with a label every few rows; the file stays a few hundred bytes a
//! node.

use std::collections::HashMap;
use std::fmt::Write as _;

use super::esc;
use crate::journal::{Event, EventRecord, Outcome};
use crate::report::schema::Phase;

/// Width of the plot area and of the label gutter, in SVG units.
const PLOT_W: f64 = 1000.0;
const GUTTER: f64 = 150.0;
/// Marks of one kind on one row closer than this (in SVG units) are drawn as one.
const MERGE_PX: f64 = 3.0;
/// Titles a merged mark lists before it counts the rest.
const MERGED_TITLES: usize = 4;

/// A mark on a row: its kind (the CSS class `m-<kind>`), where, and what its tooltip says.
struct Mark {
    kind: &'static str,
    x: f64,
    title: String,
}

/// An attempt's bar on a row.
struct Bar {
    x0: f64,
    x1: f64,
    class: String,
    title: String,
}

#[derive(Default)]
struct Row {
    label: String,
    /// The node's index where an event gave it, for the rows' order.
    node: Option<usize>,
    bars: Vec<Bar>,
    marks: Vec<Mark>,
}

/// An attempt as its events tell it: its number, start, nodes, and end (time, outcome).
struct Attempt {
    n: Option<u32>,
    t0: f64,
    hosts: Vec<String>,
    ended: Option<(f64, Outcome)>,
}

/// The rows, by host, in the order of their node index (then of first mention).
#[derive(Default)]
struct Rows {
    rows: Vec<Row>,
    at: HashMap<String, usize>,
}

impl Rows {
    fn get(&mut self, host: &str, node: Option<usize>) -> &mut Row {
        let i = *self.at.entry(host.to_string()).or_insert_with(|| {
            self.rows.push(Row {
                label: host.to_string(),
                ..Default::default()
            });
            self.rows.len() - 1
        });
        let r = &mut self.rows[i];
        if r.node.is_none() {
            r.node = node;
        }
        r
    }
}

/// The mark kind an event draws on its node's row (or the job's row), if any.
fn mark_kind(e: &Event) -> Option<&'static str> {
    Some(match e {
        Event::WorkerFailed { .. } => "failed",
        Event::Hang { .. } => "hang",
        Event::Straggler { .. } => "straggler",
        Event::NodeLeftOut { .. } => "left_out",
        Event::SpareIn { .. } => "spare_in",
        Event::NodeJoined { .. } => "joined",
        Event::Decision { .. } => "decision",
        Event::Restart { .. } => "restart",
        Event::PreflightEnd { .. } => "preflight",
        Event::JobEnd { .. } => "end",
        _ => return None,
    })
}

/// What the events put on the chart: the rows' marks, the job's row, the restarts, the
/// phases and the attempts.
#[derive(Default)]
struct Chart {
    rows: Rows,
    job: Row,
    restarts: Vec<(f64, String)>,
    phases: Vec<(f64, Phase)>,
    attempts: Vec<Attempt>,
}

impl Chart {
    /// The chart of `evs` (each with its time), `x` placing a time on it.
    fn of(evs: &[(f64, &EventRecord)], x: &dyn Fn(f64) -> f64) -> Chart {
        let mut c = Chart {
            job: Row {
                label: "job".into(),
                ..Default::default()
            },
            ..Default::default()
        };
        // The attempts not ended yet, by number: an end finds its start at once, whatever
        // the count.
        let mut open: HashMap<Option<u32>, Vec<usize>> = HashMap::new();
        for &(t, e) in evs {
            let Some(ev) = e.event() else {
                continue;
            };
            match ev {
                Event::Phase { phase } => c.phases.push((t, *phase)),
                Event::AttemptStart { nodes, .. } => {
                    open.entry(e.attempt).or_default().push(c.attempts.len());
                    c.attempts.push(Attempt {
                        n: e.attempt,
                        t0: t,
                        hosts: nodes.clone(),
                        ended: None,
                    });
                }
                Event::AttemptEnd { outcome, .. } => {
                    if let Some(i) = open.get_mut(&e.attempt).and_then(Vec::pop) {
                        c.attempts[i].ended = Some((t, *outcome));
                    }
                }
                Event::Restart { .. } => c.restarts.push((t, title(e, t))),
                _ => {}
            }
            let Some(kind) = mark_kind(ev) else {
                continue;
            };
            let mark = Mark {
                kind,
                x: x(t),
                title: title(e, t),
            };
            match e.host.as_deref().filter(|h| !h.is_empty()) {
                None => c.job.marks.push(mark),
                Some(host) => c.rows.get(host, e.node).marks.push(mark),
            }
        }
        c
    }

    /// Each attempt's bar on the rows of its nodes; an attempt that names no node is one band
    /// across every node's row (returned), not a bar on each: the page stays linear in the
    /// report (a bar per row and attempt was quadratic).
    fn bars(&mut self, end: f64, x: &dyn Fn(f64) -> f64) -> Vec<Bar> {
        let mut on_all: Vec<Bar> = Vec::new();
        for a in &self.attempts {
            let (t1, outcome, class) = match a.ended {
                Some((t1, o)) => (t1, o.as_str(), format!("bar-{o}")),
                None => (
                    end,
                    "running at the report's end",
                    "bar-running".to_string(),
                ),
            };
            let n = a.n.map_or(String::new(), |n| n.to_string());
            let span = format!(
                "{} to {}, {outcome}",
                nrun_base::duration_text(a.t0),
                nrun_base::duration_text(t1)
            );
            if a.hosts.is_empty() {
                on_all.push(Bar {
                    x0: x(a.t0),
                    x1: x(t1),
                    class: class.clone(),
                    title: format!("attempt {n} on every node: {span}"),
                });
            }
            for h in &a.hosts {
                self.rows.get(h, None).bars.push(Bar {
                    x0: x(a.t0),
                    x1: x(t1),
                    class: class.clone(),
                    title: format!("attempt {n} on {h}: {span}"),
                });
            }
        }
        on_all
    }
}

/// The timeline section, of the report's events over `wall_s` (the ledger's, where one).
pub(super) fn section(events: &[EventRecord], wall_s: Option<f64>) -> String {
    let s = super::open("timeline", "Timeline: nodes over time");
    let evs: Vec<(f64, &EventRecord)> = events.iter().filter_map(|e| Some((e.t?, e))).collect();
    if evs.is_empty() {
        return s + super::NOT_RECORDED + "</section>\n";
    }
    let end = evs
        .iter()
        .map(|e| e.0)
        .fold(wall_s.unwrap_or(0.0), f64::max)
        .max(1e-3);
    let x = |t: f64| GUTTER + (t.clamp(0.0, end) / end) * PLOT_W;
    let mut chart = Chart::of(&evs, &x);
    let on_all = chart.bars(end, &x);
    let Chart {
        rows,
        mut job,
        restarts,
        phases,
        attempts,
    } = chart;
    let mut rows = rows.rows;
    // Node order; rows without an index (a host only named) keep theirs after.
    rows.sort_by_key(|r| r.node.unwrap_or(usize::MAX));
    for r in rows.iter_mut().chain(std::iter::once(&mut job)) {
        merge(&mut r.marks);
    }
    s + &legend(rows.len(), &attempts)
        + &draw(&job, &rows, &on_all, &phases, &restarts, end, &x)
        + "</section>\n"
}

/// An event's tooltip: when, where, what.
fn title(e: &EventRecord, t: f64) -> String {
    let mut s = format!("{} ", nrun_base::duration_text(t));
    if let Some(host) = e.host.as_deref().filter(|h| !h.is_empty()) {
        let _ = write!(s, "{host}");
        if let Some(r) = e.rank {
            let _ = write!(s, " rank {r}");
        }
        s.push_str(": ");
    }
    match e.message.is_empty() {
        true => s.push_str(&e.name().replace('_', " ")),
        false => s.push_str(&e.message),
    }
    s
}

/// Merges each run of same-kind marks within [`MERGE_PX`] into one whose title counts them.
fn merge(marks: &mut Vec<Mark>) {
    marks.sort_by(|a, b| a.kind.cmp(b.kind).then(a.x.total_cmp(&b.x)));
    let mut out: Vec<(Mark, usize, Vec<String>)> = Vec::new();
    for m in marks.drain(..) {
        match out.last_mut() {
            Some((first, n, titles)) if first.kind == m.kind && m.x - first.x <= MERGE_PX => {
                *n += 1;
                if titles.len() < MERGED_TITLES {
                    titles.push(m.title);
                }
            }
            _ => out.push((m, 1, Vec::new())),
        }
    }
    for (mut m, n, more) in out {
        if n > 1 {
            let mut t = format!("{n} × {}\n{}", m.kind.replace('_', " "), m.title);
            for o in &more {
                t.push('\n');
                t.push_str(o);
            }
            if n > 1 + more.len() {
                let _ = write!(t, "\n… and {} more", n - 1 - more.len());
            }
            m.title = t;
        }
        marks.push(m);
    }
}

/// The key to the colours and marks, and what the chart shows.
fn legend(nodes: usize, attempts: &[Attempt]) -> String {
    let mut s = format!(
        "<p class=\"legend\">{nodes} node(s), one row each; {} attempt(s). ",
        attempts.len()
    );
    for (k, what) in [
        ("failed", "worker failed"),
        ("hang", "hang"),
        ("straggler", "straggler"),
        ("left_out", "node left out"),
        ("spare_in", "spare in"),
        ("joined", "node joined"),
        ("decision", "decision"),
        ("restart", "restart"),
        ("waiting", "waiting for nodes"),
        ("preflight", "preflight ended"),
        ("end", "job ended"),
    ] {
        let _ = write!(
            s,
            "<span class=\"item\"><span class=\"sw m-{k}\"></span>{what}</span>"
        );
    }
    s.push_str("<br>Bars: attempts (green: succeeded, red: failed, orange: hang, grey: interrupted); top row: the job's phases. Hover a mark or bar for its details.</p>\n");
    s
}

/// The SVG: axis, the job's row, the nodes' rows, restart lines.
fn draw(
    job: &Row,
    rows: &[Row],
    on_all: &[Bar],
    phases: &[(f64, Phase)],
    restarts: &[(f64, String)],
    end: f64,
    x: &dyn Fn(f64) -> f64,
) -> String {
    let rh: f64 = match rows.len() {
        0..=40 => 18.0,
        41..=200 => 8.0,
        _ => 4.0,
    };
    // A label every `every` rows, where rows are too thin for one each.
    let every = (12.0 / rh).ceil().max(1.0) as usize;
    let top = 24.0;
    let job_h = 22.0;
    let y0 = top + job_h + 6.0;
    let height = y0 + rh * rows.len() as f64 + 8.0;
    let width = GUTTER + PLOT_W + 40.0;
    let mut s = format!(
        "<svg class=\"timeline-chart\" viewBox=\"0 0 {width} {height}\" width=\"{width}\" height=\"{height}\" role=\"img\" aria-label=\"timeline\">\n"
    );
    // Time axis along the top.
    s.push_str("<g class=\"axis\">");
    for t in ticks(end) {
        let xt = x(t);
        let _ = write!(
            s,
            "<line class=\"grid\" x1=\"{xt:.1}\" x2=\"{xt:.1}\" y1=\"{}\" y2=\"{height}\"/><text x=\"{xt:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            top - 6.0,
            top - 10.0,
            esc(&nrun_base::duration_text(t))
        );
    }
    s.push_str("</g>\n");
    // The job's row: its phases as segments, then its marks.
    let _ = write!(
        s,
        "<text x=\"4\" y=\"{:.1}\">job</text><g class=\"job-row\">",
        top + job_h / 2.0 + 4.0
    );
    for (i, (t, p)) in phases.iter().enumerate() {
        let t1 = phases.get(i + 1).map_or(end, |n| n.0);
        let class = p.key();
        let _ = write!(
            s,
            "<rect class=\"phase ph-{class}\" x=\"{:.1}\" y=\"{top}\" width=\"{:.2}\" height=\"{}\"><title>{}</title></rect>",
            x(*t),
            (x(t1) - x(*t)).max(0.5),
            job_h / 2.0,
            esc(&format!(
                "{class}: {} to {} ({})",
                nrun_base::duration_text(*t),
                nrun_base::duration_text(t1),
                nrun_base::duration_text(t1 - t)
            ))
        );
    }
    for m in &job.marks {
        s.push_str(&mark(m, top + job_h * 0.75, 5.0));
    }
    s.push_str("</g>\n<g class=\"node-rows\">\n");
    // Attempts on every node: one band over all the rows.
    let band = rh * rows.len().max(1) as f64;
    for b in on_all {
        let _ = writeln!(
            s,
            "<rect class=\"attempt {}\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\"><title>{}</title></rect>",
            b.class,
            b.x0,
            y0 + rh * 0.15,
            (b.x1 - b.x0).max(0.5),
            band - rh * 0.3,
            esc(&b.title)
        );
    }
    for (i, r) in rows.iter().enumerate() {
        let y = y0 + rh * i as f64;
        let label = match rh >= 8.0 || i % every == 0 {
            true => format!(
                "<text x=\"4\" y=\"{:.1}\" font-size=\"{}\">{}</text>",
                y + rh.max(10.0) - 2.0,
                if rh >= 8.0 { 11.0 } else { 9.0 },
                esc(&r.label)
            ),
            false => String::new(),
        };
        let _ = write!(s, "<g class=\"node-row\">{label}");
        for b in &r.bars {
            let _ = write!(
                s,
                "<rect class=\"attempt {}\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\"><title>{}</title></rect>",
                b.class,
                b.x0,
                y + rh * 0.15,
                (b.x1 - b.x0).max(0.5),
                rh * 0.7,
                esc(&b.title)
            );
        }
        for m in &r.marks {
            s.push_str(&mark(m, y + rh / 2.0, (rh * 0.45).max(3.0)));
        }
        s.push_str("</g>\n");
    }
    s.push_str("</g>\n");
    for (t, title) in restarts {
        let xt = x(*t);
        let _ = writeln!(
            s,
            "<line class=\"restart-line\" x1=\"{xt:.1}\" x2=\"{xt:.1}\" y1=\"{top}\" y2=\"{height}\"><title>{}</title></line>",
            esc(title)
        );
    }
    s + "</svg>\n"
}

/// One mark: a shape by kind, centred at (m.x, y), `r` its half size.
fn mark(m: &Mark, y: f64, r: f64) -> String {
    let (x, k, t) = (m.x, m.kind, esc(&m.title));
    match k {
        // Diamonds for the watch's findings, squares for nodes leaving or coming, circles else.
        "hang" | "straggler" => format!(
            "<path class=\"m m-{k}\" d=\"M{x:.1} {:.1}L{:.1} {y:.1}L{x:.1} {:.1}L{:.1} {y:.1}Z\"><title>{t}</title></path>",
            y - r * 1.2,
            x + r * 1.2,
            y + r * 1.2,
            x - r * 1.2
        ),
        "left_out" | "spare_in" => format!(
            "<rect class=\"m m-{k}\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\"><title>{t}</title></rect>",
            x - r,
            y - r,
            2.0 * r,
            2.0 * r
        ),
        _ => format!(
            "<circle class=\"m m-{k}\" cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"{r:.1}\"><title>{t}</title></circle>"
        ),
    }
}

/// Round time ticks over [0, end]: the first step of seconds, minutes or hours a person
/// counts in that gives at most 8 of them.
pub(super) fn ticks(end: f64) -> Vec<f64> {
    const STEPS: [f64; 22] = [
        0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0,
        3600.0, 7200.0, 10800.0, 21600.0, 43200.0, 86400.0, 172800.0,
    ];
    let step = STEPS
        .iter()
        .copied()
        .find(|s| end / s <= 8.0)
        .unwrap_or(end / 8.0);
    (0..=((end / step) as usize))
        .map(|i| i as f64 * step)
        .collect()
}
