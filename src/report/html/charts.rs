//! The page's other charts, as inline SVG: the ledger's stacked bars, the preflight's
//! bus-bandwidth curve against the line rate (log x axis), and bisect's verdict matrix.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde_json::Value;

use super::{esc, text};
use crate::journal::{Event, EventRecord};
use crate::report::schema::{BisectReport, BisectRound};
use crate::report::schema::{LedgerReport, PhaseTimes, PreflightReport};

/// The ledger as stacked bars: the whole job, then each attempt placed on the job's time.
pub(super) fn ledger_bars(l: &LedgerReport) -> String {
    let wall = l.wall_s;
    let (w, gutter, bar_h) = (1000.0, 90.0, 22.0);
    let shown = l.attempts.len().min(super::TABLE_ROWS);
    let height = bar_h + 10.0 + (bar_h * 0.7 + 4.0) * shown as f64 + 4.0;
    let mut s = format!(
        "<svg class=\"ledger-chart\" viewBox=\"0 0 {} {height:.0}\" width=\"{}\" height=\"{height:.0}\" role=\"img\" aria-label=\"ledger\">\n",
        gutter + w,
        gutter + w
    );
    let scale = |secs: f64| secs / wall.max(1e-9) * w;
    let stack = |s: &mut String, phases: &PhaseTimes, x0: f64, y: f64, h: f64, of: &str| {
        let mut x = x0;
        for (p, secs) in phases.iter().filter(|(_, x)| **x > 0.0) {
            let dx = scale(*secs);
            let _ = write!(
                s,
                "<rect class=\"phase ph-{}\" x=\"{x:.2}\" y=\"{y:.1}\" width=\"{dx:.2}\" height=\"{h:.1}\"><title>{}</title></rect>",
                p.key(),
                esc(&format!(
                    "{of}{}: {} ({:.1}% of the wall time)",
                    p.key(),
                    nrun_base::duration_text(*secs),
                    100.0 * secs / wall.max(1e-9)
                ))
            );
            x += dx;
        }
    };
    let _ = write!(
        s,
        "<text x=\"0\" y=\"{:.1}\">whole job</text>",
        bar_h / 2.0 + 4.0
    );
    stack(&mut s, &l.phases, gutter, 0.0, bar_h, "");
    for (i, a) in l.attempts.iter().take(shown).enumerate() {
        let y = bar_h + 10.0 + (bar_h * 0.7 + 4.0) * i as f64;
        let _ = write!(
            s,
            "<text x=\"0\" y=\"{:.1}\">attempt {}</text>",
            y + bar_h * 0.35 + 4.0,
            a.attempt
        );
        let x0 = gutter + scale(a.start_s);
        let of = format!("attempt {} ({}): ", a.attempt, a.outcome);
        stack(&mut s, &a.phases, x0, y, bar_h * 0.7, &of);
    }
    s + "</svg>\n"
}

/// One size of the preflight's sweep: bytes, out-of-place and in-place busbw (GB/s).
pub(super) struct Point {
    bytes: f64,
    oop: f64,
    ip: Option<f64>,
    title: String,
}

/// The sweep's sizes: the report's `rows`, else the `preflight_size` events.
pub(super) fn busbw_points(v: &Value, evs: &[EventRecord]) -> Vec<Point> {
    let mut pts: Vec<Point> = v["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let bytes = r["bytes"].as_f64()?;
            let o = &r["out_of_place"];
            let oop = o["busbw_gbs"].as_f64()?;
            Some(Point {
                bytes,
                oop,
                ip: r["in_place"]["busbw_gbs"].as_f64(),
                title: format!(
                    "{}: busbw {oop:.2} GB/s, algbw {:.2} GB/s, {:.1} us out of place; {} wrong",
                    nrun_preflight::human_bytes(bytes as u64),
                    o["algbw_gbs"].as_f64().unwrap_or(0.0),
                    o["time_us"].as_f64().unwrap_or(0.0),
                    text(&o["wrong"])
                ),
            })
        })
        .collect();
    if pts.is_empty() {
        for e in evs.iter().filter_map(EventRecord::event) {
            if let Event::PreflightSize {
                bytes: Some(bytes),
                busbw_gbs: Some(oop),
                ..
            } = *e
            {
                let bytes = bytes as f64;
                pts.push(Point {
                    bytes,
                    oop,
                    ip: None,
                    title: format!(
                        "{}: busbw {oop:.2} GB/s",
                        nrun_preflight::human_bytes(bytes as u64)
                    ),
                });
            }
        }
    }
    pts.retain(|p| p.bytes > 0.0 && p.oop.is_finite());
    pts.sort_by(|a, b| a.bytes.total_cmp(&b.bytes));
    pts
}

/// The expected line rate and what it is, from the preflight's report or its events.
fn line_rate(p: Option<&PreflightReport>, evs: &[EventRecord]) -> Option<(f64, String)> {
    if let Some(lr) = p.and_then(|p| p.line_rate.as_ref())
        && let Some(g) = lr.gbs
    {
        return Some((g, lr.what.clone()));
    }
    evs.iter()
        .filter_map(EventRecord::event)
        .find_map(|e| match *e {
            Event::PreflightSize { line_rate_gbs, .. } => line_rate_gbs,
            _ => None,
        })
        .map(|g| (g, "the GPUs' or NICs' line rate".to_string()))
}

/// The bus-bandwidth curve: busbw by message size (log2 x), the line rate as a dashed line.
pub(super) fn busbw(p: Option<&PreflightReport>, evs: &[EventRecord], pts: &[Point]) -> String {
    if pts.is_empty() {
        return "<p class=\"not-recorded\">no sweep recorded (the preflight did not get as far as measuring)</p>\n".into();
    }
    let (left, right, top, bottom, w, h) = (70.0, 20.0, 20.0, 40.0, 900.0, 320.0);
    let rate = line_rate(p, evs);
    let ymax = pts
        .iter()
        .map(|p| p.oop.max(p.ip.unwrap_or(0.0)))
        .chain(rate.as_ref().map(|r| r.0))
        .fold(0.0, f64::max)
        .max(1e-6)
        * 1.1;
    let (lo, hi) = (
        pts[0].bytes.log2(),
        pts[pts.len() - 1]
            .bytes
            .log2()
            .max(pts[0].bytes.log2() + 1.0),
    );
    let x = |b: f64| left + (b.log2() - lo) / (hi - lo) * w;
    let y = |g: f64| top + h - g / ymax * h;
    let mut s = format!(
        "<svg class=\"busbw-chart\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" role=\"img\" aria-label=\"bus bandwidth by message size\">\n<g class=\"axis\">",
        left + w + right,
        top + h + bottom,
        left + w + right,
        top + h + bottom
    );
    // x ticks at powers of 4 bytes, y ticks at 5 steps.
    let mut b = 2f64.powf(lo.ceil());
    while b.log2() <= hi + 1e-9 {
        if (b.log2() as i64) % 2 == 0 || hi - lo <= 8.0 {
            let xb = x(b);
            let _ = write!(
                s,
                "<line class=\"grid\" x1=\"{xb:.1}\" x2=\"{xb:.1}\" y1=\"{top}\" y2=\"{}\"/><text x=\"{xb:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                top + h,
                top + h + 16.0,
                esc(&nrun_preflight::human_bytes(b as u64))
            );
        }
        b *= 2.0;
    }
    for i in 0..=5 {
        let g = ymax / 1.1 * i as f64 / 5.0;
        let yg = y(g);
        let _ = write!(
            s,
            "<line class=\"grid\" x1=\"{left}\" x2=\"{}\" y1=\"{yg:.1}\" y2=\"{yg:.1}\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            left + w,
            left - 6.0,
            yg + 4.0,
            gbs(g)
        );
    }
    let _ = writeln!(
        s,
        "<path d=\"M{left} {top}V{}H{}\" fill=\"none\"/><text x=\"{}\" y=\"{}\" text-anchor=\"middle\">message size (bytes, log scale)</text><text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">busbw GB/s</text></g>",
        top + h,
        left + w,
        left + w / 2.0,
        top + h + 34.0,
        top + h / 2.0,
        top + h / 2.0
    );
    if let Some((g, what)) = &rate {
        let yg = y(*g);
        let _ = writeln!(
            s,
            "<line class=\"line-rate\" x1=\"{left}\" x2=\"{}\" y1=\"{yg:.1}\" y2=\"{yg:.1}\"><title>{}</title></line><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">line rate {} GB/s</text>",
            left + w,
            esc(&format!("expected line rate: {g:.1} GB/s ({what})")),
            left + w - 4.0,
            yg - 4.0,
            gbs(*g)
        );
    }
    let path = |f: &dyn Fn(&Point) -> Option<f64>| -> String {
        let mut d = String::new();
        for p in pts {
            if let Some(g) = f(p) {
                let c = if d.is_empty() { 'M' } else { 'L' };
                let _ = write!(d, "{c}{:.1} {:.1}", x(p.bytes), y(g));
            }
        }
        d
    };
    if pts
        .iter()
        .any(|p| p.ip.is_some_and(|ip| (ip - p.oop).abs() > 1e-9))
    {
        let _ = writeln!(
            s,
            "<path class=\"curve-ip\" d=\"{}\"><title>in place</title></path>",
            path(&|p| p.ip)
        );
    }
    let _ = writeln!(
        s,
        "<path class=\"curve-oop\" d=\"{}\"><title>out of place</title></path>",
        path(&|p| Some(p.oop))
    );
    for p in pts {
        let _ = write!(
            s,
            "<circle class=\"pt\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\"><title>{}</title></circle>",
            x(p.bytes),
            y(p.oop),
            esc(&p.title)
        );
    }
    s + "\n</svg>\n<p class=\"legend\">solid: busbw out of place; dashed blue: in place (where it differs); dashed red: the expected line rate. Hover a point for its numbers.</p>\n"
}

fn gbs(g: f64) -> String {
    match g {
        g if g >= 10.0 => format!("{g:.0}"),
        g if g >= 1.0 => format!("{g:.1}"),
        g => format!("{g:.2}"),
    }
}

/// Most hosts the matrix draws; the nodes not good come first.
const MATRIX_HOSTS: usize = 48;

/// What the matrix knows about a pair of nodes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Cell {
    Untested,
    /// Passed together (in a pair, or in a larger group that passed).
    Good,
    /// Failed in a larger group with them both: not this pair's fault alone.
    GroupFailed,
    Slow,
    Bad,
}

impl Cell {
    fn class(self) -> &'static str {
        match self {
            Cell::Untested => "untested",
            Cell::Good => "good",
            Cell::GroupFailed => "group_failed",
            Cell::Slow => "slow",
            Cell::Bad => "bad",
        }
    }
}

/// bisect's verdicts: a node x node matrix (diagonal: each node's verdict; off it: how the
/// pair did together), and each round's groups.
pub(super) fn bisect(b: &BisectReport) -> String {
    let mut s = super::open("bisect", "Bisect: nodes and links");
    let (nodes, rounds) = (&b.nodes[..], &b.rounds[..]);
    if nodes.is_empty() && rounds.is_empty() {
        return s + super::NOT_RECORDED + "</section>\n";
    }
    let verdict: HashMap<String, (String, String)> = nodes
        .iter()
        .map(|n| (n.host.clone(), (n.verdict.clone(), n.evidence.join("; "))))
        .collect();
    // Hosts: the nodes not good first, then the rest, cut at MATRIX_HOSTS.
    let mut hosts: Vec<String> = nodes.iter().map(|n| n.host.clone()).collect();
    hosts.sort_by_key(|h| verdict.get(h).is_some_and(|v| v.0 == "good"));
    let all = hosts.len();
    hosts.truncate(MATRIX_HOSTS);
    let at: HashMap<&str, usize> = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| (h.as_str(), i))
        .collect();
    let n = hosts.len();
    let cells = pair_cells(rounds, &at, n);
    let cell_px = if n <= 16 { 28.0 } else { 14.0 };
    let gutter = 8.0 + 7.0 * hosts.iter().map(String::len).max().unwrap_or(4).min(30) as f64;
    let size = gutter + cell_px * n as f64 + 4.0;
    let _ = writeln!(
        s,
        "<svg class=\"bisect-matrix\" viewBox=\"0 0 {size:.0} {size:.0}\" width=\"{size:.0}\" height=\"{size:.0}\" role=\"img\" aria-label=\"bisect verdicts\">"
    );
    for (i, h) in hosts.iter().enumerate() {
        let c = gutter + cell_px * (i as f64 + 0.5);
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text><text x=\"{c:.1}\" y=\"{:.1}\" text-anchor=\"start\" transform=\"rotate(-90 {c:.1} {:.1})\">{}</text>",
            gutter - 4.0,
            c + 4.0,
            esc(h),
            gutter - 4.0,
            gutter - 4.0,
            esc(h)
        );
    }
    for a in 0..n {
        for b in 0..n {
            let (class, title) = match a == b {
                true => {
                    let (vd, ev) = verdict.get(&hosts[a]).cloned().unwrap_or_default();
                    (
                        // A class of the page's own, whatever the report's verdict says.
                        format!(
                            "cell-{}",
                            match vd.as_str() {
                                v @ ("good" | "bad" | "slow" | "unreachable" | "link") => v,
                                _ => "untested",
                            }
                        ),
                        format!(
                            "{}: {vd}{}",
                            hosts[a],
                            if ev.is_empty() {
                                String::new()
                            } else {
                                format!(": {ev}")
                            }
                        ),
                    )
                }
                false => {
                    let (c, why) = &cells[a * n + b];
                    (
                        format!("cell-{}", c.class()),
                        format!(
                            "{} with {}: {}{why}",
                            hosts[a],
                            hosts[b],
                            c.class().replace('_', " ") + if why.is_empty() { "" } else { ": " }
                        ),
                    )
                }
            };
            let _ = write!(
                s,
                "<rect class=\"cell {class}\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\"><title>{}</title></rect>",
                gutter + cell_px * b as f64,
                gutter + cell_px * a as f64,
                cell_px - 1.0,
                cell_px - 1.0,
                esc(&title)
            );
        }
    }
    s.push_str(
        "</svg>\n<p class=\"legend\">diagonal: the node's verdict; off it: the pair together. ",
    );
    for (k, what) in [
        ("good", "good / passed together"),
        ("slow", "slow (a slow link)"),
        ("bad", "bad / the pair failed"),
        ("link", "link: fails only with some node"),
        ("unreachable", "unreachable"),
        ("group_failed", "failed in a larger group"),
        ("untested", "not tested together"),
    ] {
        let _ = write!(
            s,
            "<span class=\"item\"><span class=\"sw cell-{k}\"></span>{what}</span>"
        );
    }
    s.push_str("</p>\n");
    s.push_str(&super::cut_at(all, MATRIX_HOSTS, "nodes (all good)"));
    s.push_str(&rounds_table(rounds));
    s + "</section>\n"
}

/// How each pair of the matrix's hosts did together over the rounds (row-major, n x n): the
/// worst that any group of both says, with its words. A slow link names its two ends; only
/// that pair is slow, the rest of its group passed.
fn pair_cells(rounds: &[BisectRound], at: &HashMap<&str, usize>, n: usize) -> Vec<(Cell, String)> {
    let mut cells = vec![(Cell::Untested, String::new()); n * n];
    for r in rounds {
        let stage = r.stage.clone();
        for g in &r.groups {
            let members: Vec<usize> = g
                .hosts
                .iter()
                .filter_map(|h| at.get(h.as_str()).copied())
                .collect();
            let size = g.hosts.len();
            let slow = g.slow_link.clone().unwrap_or_default();
            let ends = link_ends(&slow).map(|(a, b)| (at.get(a).copied(), at.get(b).copied()));
            let cell = match (g.ok, size) {
                (Some(true), _) => Cell::Good,
                (_, 2) => Cell::Bad,
                _ => Cell::GroupFailed,
            };
            let mut said: Vec<String> = vec![stage.clone()];
            said.extend(g.busbw_gbs.map(|b| format!("{b:.2} GB/s")));
            said.extend([g.evidence.clone(), slow.clone()]);
            said.retain(|x| !x.is_empty());
            let why = said.join("; ");
            for &a in &members {
                for &b in &members {
                    // The slow link's pair, or the whole group where its ends are not named.
                    let slow_here = !slow.is_empty()
                        && ends.is_none_or(|(x, y)| {
                            (x, y) == (Some(a), Some(b)) || (x, y) == (Some(b), Some(a))
                        });
                    let cell = match slow_here && cell == Cell::Good {
                        true => Cell::Slow,
                        false => cell,
                    };
                    let c = &mut cells[a * n + b];
                    if a != b && cell >= c.0 {
                        *c = (cell, why.clone());
                    }
                }
            }
        }
    }
    cells
}

/// The two hosts of bisect's "the link from A to B carried ...".
fn link_ends(slow: &str) -> Option<(&str, &str)> {
    let rest = slow.strip_prefix("the link from ")?;
    let (from, rest) = rest.split_once(" to ")?;
    let (to, _) = rest.split_once(" carried")?;
    Some((from, to))
}

/// Each round: its stage and groups, the failed and slow ones spelled out.
fn rounds_table(rounds: &[BisectRound]) -> String {
    let mut s = String::from(
        "<h3>Rounds</h3><table class=\"rounds\"><thead><tr><th>round</th><th>stage</th><th>groups</th><th>not ok or slow</th></tr></thead><tbody>\n",
    );
    for (i, r) in rounds.iter().enumerate().take(super::TABLE_ROWS) {
        let groups = &r.groups;
        let odd: Vec<String> = groups
            .iter()
            .filter(|g| g.ok != Some(true) || g.slow_link.as_ref().is_some_and(|l| !l.is_empty()))
            .take(20)
            .map(|g| {
                let mut said = vec![match g.ok {
                    Some(true) => "ok".to_string(),
                    _ => "failed".to_string(),
                }];
                said.extend(g.busbw_gbs.map(|b| format!("{b:.2} GB/s")));
                said.extend([g.evidence.clone(), g.slow_link.clone().unwrap_or_default()]);
                said.retain(|x| !x.is_empty());
                format!("{}: {}", g.hosts.join("+"), said.join("; "))
            })
            .collect();
        let _ = writeln!(
            s,
            "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td></tr>",
            i + 1,
            esc(&r.stage),
            groups.len(),
            esc(&odd.join("\n")).replace('\n', "<br>")
        );
    }
    s.push_str("</tbody></table>\n");
    s + &super::cut(rounds.len(), "rounds")
}
