//! The watch's conclusions, drawn by the coordinator alone from the views every node's agent
//! publishes ([`NodeWatch`]: each rank's Python stack, the collective it waits in, how long its
//! stack has not changed). A **hang**: a rank has waited in one collective call for
//! `--hang-timeout`, whatever its peers do meanwhile (a peer that polls or spins moves its own
//! stack, not the collective); with no rank in a collective, no rank's stack has changed for
//! that long. The diagnosis names the ranks that wait, the rank that has not entered the collective the others
//! wait in (or has exited), or the ranks that disagree on the collective. All ranks busy at the
//! same place (a checkpoint, an evaluation) is said as such and blames nobody. A **straggler**:
//! a rank that almost never waits in collectives while the others often do (they wait for it).
//! The same judgement names the likely cause when the job fails with a collective timeout.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::protocol::{NodeWatch, RankView, waits_in};
use nrun_cli::OnHang;

/// The watch's settings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WatchPlan {
    pub hang_timeout: Duration,
    pub on_hang: OnHang,
}

/// How a stall looks.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Kind {
    /// Some ranks wait in a collective that others have not entered (or have exited).
    Missing,
    /// The ranks wait in different collectives.
    Disagree,
    /// Every rank waits in the same collective: none is missing.
    AllWaiting,
    /// No rank waits in a collective; all are at the same place.
    AllBusy,
    /// No rank waits in a collective, and they are at different places.
    Busy,
    /// Read back from a report that does not say, or says what this nrun does not know; the
    /// watch never finds it.
    #[default]
    #[serde(other)]
    Unknown,
}

impl Kind {
    /// Its name in the report (`all_waiting`).
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            Kind::Missing => "missing",
            Kind::Disagree => "disagree",
            Kind::AllWaiting => "all_waiting",
            Kind::AllBusy => "all_busy",
            Kind::Busy => "busy",
            Kind::Unknown => "",
        }
    }
}

/// One rank's line in a diagnosis.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct RankState {
    pub rank: usize,
    pub host: String,
    pub pid: u32,
    /// "waiting in all_reduce", "in Python code", "exited with code 0", "unknown".
    pub state: String,
    /// The collective it waits in, where it waits in one (what `state` says in words).
    #[serde(skip)]
    pub waiting_in: Option<String>,
    /// Innermost first, "name (file:line): code".
    pub frames: Vec<String>,
}

/// What the watch concluded about a stall.
/// Read back from a report, a key an older nrun did not write reads as its default; what the
/// watch does not report (`in_collective`) as false.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Diagnosis {
    #[serde(default)]
    pub kind: Kind,
    /// The conclusion in one sentence.
    #[serde(default)]
    pub conclusion: String,
    /// The ranks it blames (none for AllWaiting, AllBusy, Busy).
    #[serde(default)]
    pub culprits: Vec<usize>,
    /// Seconds since the last progress: the longest wait in a collective, or (no rank in
    /// one) since any rank's stack last moved.
    #[serde(default)]
    pub stalled_s: f64,
    /// Some rank waits in a collective (the stall is judged by it, not by the stacks).
    #[serde(skip)]
    pub in_collective: bool,
    #[serde(default)]
    pub ranks: Vec<RankState>,
    /// NCCL's own account of the job (its RAS), asked during this stall, where it answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl_ras: Option<NcclRas>,
}

/// What NCCL's RAS said during a stall (see `agent::ras`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct NcclRas {
    /// The node that asked.
    pub host: String,
    /// Its "Errors" and "Warnings" lines.
    pub findings: Vec<String>,
    /// The whole answer, or why there was none.
    pub status: Option<String>,
    pub error: Option<String>,
}

/// Lines of RAS's findings printed with a hang (the report has all of them).
const RAS_LINES: usize = 8;

/// The RAS answer among `views` given during the last `stalled_s` seconds (asked while the
/// ranks stalled: an older one speaks of another moment).
fn ras_of(views: &HashMap<usize, NodeWatch>, hosts: &[String], stalled_s: f64) -> Option<NcclRas> {
    let since = crate::protocol::unix_ms().saturating_sub((stalled_s * 1e3) as u64);
    let (node, r) = views
        .iter()
        .filter_map(|(n, v)| Some((*n, v.ras.as_ref()?)))
        .filter(|(_, r)| r.at_ms >= since)
        .max_by_key(|(_, r)| r.at_ms)?;
    Some(NcclRas {
        host: hosts.get(node).cloned().unwrap_or_else(|| "?".into()),
        findings: r
            .text
            .as_deref()
            .map(crate::agent::ras::findings)
            .unwrap_or_default(),
        status: r.text.clone(),
        error: r.error.clone(),
    })
}

/// A rank with where it runs.
pub(crate) struct Seen<'a> {
    pub host: &'a str,
    pub view: &'a RankView,
}

fn frame_text(f: &crate::protocol::Frame) -> String {
    match &f.code {
        Some(c) => format!("{} ({}:{}): {c}", f.name, f.file, f.line),
        None => format!("{} ({}:{})", f.name, f.file, f.line),
    }
}

/// Where a rank is, in a few words: its innermost frame outside torch and the standard library,
/// else its innermost frame.
fn place(v: &RankView) -> String {
    let user = v
        .frames
        .iter()
        .find(|f| !f.file.contains("/site-packages/") && !f.file.contains("/lib/python3"));
    match user.or(v.frames.first()) {
        Some(f) => frame_text(f),
        None => "an unknown place".into(),
    }
}

/// "rank 0 waits" or "ranks 0,2 wait".
fn wait_text(r: &[usize]) -> String {
    match r.len() {
        1 => format!("{} waits", ranks_text(r)),
        _ => format!("{} wait", ranks_text(r)),
    }
}

fn ranks_text(r: &[usize]) -> String {
    let s: Vec<String> = r.iter().map(|x| x.to_string()).collect();
    match r.len() {
        1 => format!("rank {}", s[0]),
        _ => format!("ranks {}", s.join(",")),
    }
}

/// What a diagnosis concludes: its kind, its sentence, the ranks it blames.
type Conclusion = (Kind, String, Vec<usize>);

/// The ranks of a stall, by what their stacks show.
struct Groups<'s, 'a> {
    /// The ranks waiting in each collective.
    by_op: BTreeMap<String, Vec<usize>>,
    /// Alive and in no collective.
    busy: Vec<&'s Seen<'a>>,
    exited: Vec<&'s Seen<'a>>,
    /// Alive, but no stack could be read.
    unreadable: Vec<usize>,
}

impl<'s, 'a> Groups<'s, 'a> {
    fn of(ranks: &'s [Seen<'a>]) -> Self {
        let mut g = Groups {
            by_op: BTreeMap::new(),
            busy: Vec::new(),
            exited: Vec::new(),
            unreadable: Vec::new(),
        };
        for s in ranks {
            match (&s.view.exited, waits_in(s.view)) {
                (Some(_), _) => g.exited.push(s),
                (None, Some(op)) => g.by_op.entry(op).or_default().push(s.view.rank),
                (None, None) if s.view.frames.is_empty() => g.unreadable.push(s.view.rank),
                (None, None) => g.busy.push(s),
            }
        }
        g
    }
}

/// The diagnosis of a stall, from every rank's latest view.
pub(crate) fn diagnose(ranks: &[Seen<'_>]) -> Option<Diagnosis> {
    if ranks.is_empty() {
        return None;
    }
    let g = Groups::of(ranks);
    // How long the stall has lasted: the longest wait in a collective (a peer that has not
    // entered it may be moving all the while), else the time every stack stood still.
    let waited_ms = ranks
        .iter()
        .filter(|s| s.view.exited.is_none() && waits_in(s.view).is_some())
        .map(|s| s.view.unchanged_ms)
        .max();
    let stalled_ms = waited_ms.unwrap_or_else(|| {
        ranks
            .iter()
            .filter(|s| s.view.exited.is_none())
            .map(|s| s.view.unchanged_ms)
            .min()
            .unwrap_or(0)
    });
    let states = rank_states(ranks);
    let (kind, conclusion, culprits) = stacks_conclusion(&g);
    // The flight recorder (NCCL jobs) knows which collective each rank last enqueued and
    // completed: where it speaks, its sentence is the conclusion.
    let (kind, conclusion, culprits) = match flight_conclusion(ranks) {
        Some(fr) => fr,
        None => (kind, conclusion, culprits),
    };
    // A collective the ranks called differently before the stall is where it went wrong.
    let (kind, conclusion, culprits) = match mismatch(ranks) {
        Some(m) => (Kind::Disagree, m.text(), m.culprits),
        None => (kind, conclusion, culprits),
    };
    let conclusion = match g.unreadable.is_empty() {
        true => conclusion,
        false => format!(
            "{conclusion} ({}: stack unreadable)",
            ranks_text(&g.unreadable)
        ),
    };
    Some(Diagnosis {
        kind,
        conclusion,
        culprits,
        stalled_s: stalled_ms as f64 / 1e3,
        in_collective: waited_ms.is_some(),
        ranks: states,
        nccl_ras: None,
    })
}

/// Each rank's state and stack, as the diagnosis shows them.
fn rank_states(ranks: &[Seen<'_>]) -> Vec<RankState> {
    ranks
        .iter()
        .map(|s| RankState {
            rank: s.view.rank,
            host: s.host.to_string(),
            pid: s.view.pid,
            state: match (&s.view.exited, waits_in(s.view), &s.view.error) {
                (Some(e), _, _) => e.to_string(),
                (None, Some(op), _) => format!("waiting in {op}"),
                (None, None, Some(e)) if s.view.frames.is_empty() => format!("unknown: {e}"),
                (None, None, _) => "in Python code".into(),
            },
            waiting_in: match &s.view.exited {
                Some(_) => None,
                None => waits_in(s.view),
            },
            frames: s.view.frames.iter().map(frame_text).collect(),
        })
        .collect()
}

/// What the stacks alone say.
fn stacks_conclusion(g: &Groups<'_, '_>) -> Conclusion {
    let by_op = &g.by_op;
    if !by_op.is_empty() && (!g.busy.is_empty() || !g.exited.is_empty()) {
        missing(g)
    } else if by_op.len() > 1 {
        let most = by_op
            .values()
            .max_by_key(|r| r.len())
            .cloned()
            .unwrap_or_default();
        let groups: Vec<String> = by_op
            .iter()
            .map(|(o, r)| format!("{} in {o}", ranks_text(r)))
            .collect();
        let culprits = by_op
            .values()
            .filter(|r| **r != most)
            .flatten()
            .copied()
            .collect();
        (
            Kind::Disagree,
            format!(
                "the ranks disagree on the collective: {}",
                groups.join(", ")
            ),
            culprits,
        )
    } else if let Some((op, r)) = by_op.iter().next() {
        (
            Kind::AllWaiting,
            format!(
                "{} in {op} and none is missing: a transport or link problem between them \
                 (or different tensor sizes); run the preflight on these nodes",
                wait_text(r)
            ),
            Vec::new(),
        )
    } else {
        all_busy(&g.busy)
    }
}

/// Some ranks wait in a collective the others have not entered (busy elsewhere, exited, or in
/// another collective): those are the culprits.
fn missing(g: &Groups<'_, '_>) -> Conclusion {
    // The collective most ranks wait in is the one the others have not reached.
    let (op, waiting) = g
        .by_op
        .iter()
        .max_by_key(|(_, r)| r.len())
        .map(|(o, r)| (o.clone(), r.clone()))
        .unwrap_or_default();
    let mut parts = Vec::new();
    let mut culprits = Vec::new();
    for s in &g.busy {
        parts.push(format!(
            "rank {} on {} has not entered it: it is in {}",
            s.view.rank,
            s.host,
            place(s.view)
        ));
        culprits.push(s.view.rank);
    }
    for s in &g.exited {
        parts.push(format!(
            "rank {} on {} {} before entering it",
            s.view.rank,
            s.host,
            s.view
                .exited
                .map_or_else(|| "exited".to_string(), |e| e.to_string())
        ));
        culprits.push(s.view.rank);
    }
    for (o, r) in g.by_op.iter().filter(|(o, _)| **o != op) {
        parts.push(format!("{} in {o} instead", wait_text(r)));
        culprits.extend(r);
    }
    (
        Kind::Missing,
        format!("{} in {op}; {}", wait_text(&waiting), parts.join("; ")),
        culprits,
    )
}

/// No rank waits in a collective: all in one place (a long step), or in several.
fn all_busy(busy: &[&Seen<'_>]) -> Conclusion {
    let places: BTreeMap<String, Vec<usize>> = busy.iter().fold(BTreeMap::new(), |mut m, s| {
        m.entry(place(s.view)).or_default().push(s.view.rank);
        m
    });
    if places.len() == 1 {
        let p = places.keys().next().cloned().unwrap_or_default();
        (
            Kind::AllBusy,
            format!("all ranks in {p}: a long step, checkpoint or evaluation, not one rank's hang"),
            Vec::new(),
        )
    } else {
        let list: Vec<String> = places
            .iter()
            .map(|(p, r)| format!("{} in {p}", ranks_text(r)))
            .collect();
        (
            Kind::Busy,
            format!("no rank waits in a collective: {}", list.join("; ")),
            Vec::new(),
        )
    }
}

/// "4 MiB", "512 KiB", "8 B".
fn size_text(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{:.0} MiB", b as f64 / (1 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.0} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// "all_reduce #6 (4 MiB)", naming the process group when it is not the default one.
fn op_text(o: &crate::protocol::FrOp) -> String {
    let group = match o.pg.as_str() {
        "0" | "" | "default_pg" => String::new(),
        g => format!(", group {g}"),
    };
    format!("{} #{} ({}{group})", o.op, o.seq, size_text(o.bytes))
}

/// The stall as the ranks' flight recorders tell it: the collective the most advanced ranks
/// wait in (sequence number, op, size), the ranks that completed only the one before (and
/// where their stack is), or the ranks that disagree on its op or size. None unless every rank
/// still running has a dump and one of them waits.
fn flight_conclusion(ranks: &[Seen<'_>]) -> Option<Conclusion> {
    use crate::protocol::FrOp;
    let running: Vec<&Seen<'_>> = ranks.iter().filter(|s| s.view.exited.is_none()).collect();
    if running.is_empty() || running.iter().any(|s| s.view.fr.is_none()) {
        return None;
    }
    let waits = |s: &Seen<'_>| -> Option<FrOp> {
        let fr = s.view.fr.as_ref()?;
        (fr.last.state != "completed").then(|| fr.last.clone())
    };
    let top = running
        .iter()
        .filter_map(|s| waits(s))
        .map(|o| o.seq)
        .max()?;
    // The ranks waiting in collective #top, by what they call it.
    let mut at_top: BTreeMap<(String, u64), Vec<usize>> = BTreeMap::new();
    for s in &running {
        if let Some(o) = waits(s).filter(|o| o.seq == top) {
            at_top
                .entry((o.op.clone(), o.bytes))
                .or_default()
                .push(s.view.rank);
        }
    }
    if at_top.len() > 1 {
        let groups: Vec<String> = at_top
            .iter()
            .map(|((op, b), r)| format!("{} {op} ({})", ranks_text(r), size_text(*b)))
            .collect();
        let culprits = odd_ones_out(at_top.values());
        return Some((
            Kind::Disagree,
            format!(
                "the ranks disagree on collective #{top}: {} (flight recorder)",
                groups.join(", ")
            ),
            culprits,
        ));
    }
    let (_, waiting) = at_top.iter().next()?;
    let op = running
        .iter()
        .find_map(|s| waits(s).filter(|o| o.seq == top))?;
    let mut parts = vec![format!("{} in {}", wait_text(waiting), op_text(&op))];
    let mut culprits = Vec::new();
    for s in ranks.iter().filter(|s| !waiting.contains(&s.view.rank)) {
        let fr = s.view.fr.as_ref();
        let done = fr
            .and_then(|f| f.completed.as_ref())
            .map_or("no collective".to_string(), |c| format!("#{}", c.seq));
        let text = match (&s.view.exited, fr.and_then(|_| waits(s))) {
            (Some(e), _) if fr.is_some() => {
                format!("rank {} {e} after completing {done}", s.view.rank)
            }
            (Some(e), _) => format!("rank {} {e}", s.view.rank),
            (None, Some(o)) => format!("rank {} waits in {} behind them", s.view.rank, op_text(&o)),
            (None, None) => format!(
                "rank {} completed {done} and is in {}",
                s.view.rank,
                place(s.view)
            ),
        };
        parts.push(text);
        culprits.push(s.view.rank);
    }
    let kind = match culprits.is_empty() {
        true => {
            parts.push(
                "none is missing: a transport or link problem between them; run the preflight \
                 on these nodes"
                    .into(),
            );
            Kind::AllWaiting
        }
        false => Kind::Missing,
    };
    Some((kind, parts.join("; "), culprits))
}

/// Of ranks grouped by what they did, those outside the largest group; nobody when two groups
/// tie for largest (a tie blames nobody in particular).
fn odd_ones_out<'a>(groups: impl Iterator<Item = &'a Vec<usize>> + Clone) -> Vec<usize> {
    let most = groups.clone().map(Vec::len).max().unwrap_or(0);
    match groups.clone().filter(|r| r.len() == most).count() {
        1 => groups
            .filter(|r| r.len() != most)
            .flatten()
            .copied()
            .collect(),
        _ => Vec::new(),
    }
}

/// Ops whose input must be the same size on every rank of the group. all_to_all, gather,
/// scatter and the list forms of all_gather and reduce_scatter (uneven inputs allowed) may
/// differ by design.
const SAME_SIZE: &[&str] = &[
    "all_reduce",
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "_allgather_base",
    "all_gather_into_tensor",
    "_reduce_scatter_base",
    "reduce_scatter_tensor",
];

/// The first collective the ranks' flight recorders disagree on: a rank that calls another op,
/// or the same all_reduce (broadcast, all_gather, ...) with another size, at the same sequence
/// number of the same process group. NCCL does not check: such a job hangs, or goes on with
/// wrong results.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Mismatch {
    pub pg: String,
    pub seq: u64,
    /// What each set of ranks called there: op, bytes (where every rank must agree on them),
    /// ranks.
    pub calls: Vec<(String, Option<u64>, Vec<usize>)>,
    /// The ranks apart from the most (none on a tie).
    pub culprits: Vec<usize>,
}

impl Mismatch {
    pub(crate) fn text(&self) -> String {
        let group = match self.pg.as_str() {
            "0" | "" | "default_pg" => String::new(),
            g => format!(" of group {g}"),
        };
        let calls: Vec<String> = self
            .calls
            .iter()
            .map(|(op, b, r)| match b {
                Some(b) => format!("{} {op} ({})", ranks_text(r), size_text(*b)),
                None => format!("{} {op}", ranks_text(r)),
            })
            .collect();
        format!(
            "the ranks disagree on collective #{}{group}: {} (flight recorder)",
            self.seq,
            calls.join(", ")
        )
    }
}

/// Compares the runs of every rank's flight recorder: the lowest sequence number that two or
/// more ranks of one group both recorded and called differently.
pub(crate) fn mismatch(ranks: &[Seen<'_>]) -> Option<Mismatch> {
    use crate::protocol::FrRun;
    let mut by_pg: BTreeMap<&str, Vec<(usize, &[FrRun])>> = BTreeMap::new();
    for s in ranks {
        if let Some(fr) = &s.view.fr {
            by_pg
                .entry(fr.last.pg.as_str())
                .or_default()
                .push((s.view.rank, fr.runs.as_slice()));
        }
    }
    let mut found: Option<Mismatch> = None;
    for (pg, members) in by_pg {
        // Calls can differ only where some rank's run begins.
        let mut starts: Vec<u64> = members
            .iter()
            .flat_map(|(_, runs)| runs.iter().map(|r| r.first))
            .collect();
        starts.sort_unstable();
        starts.dedup();
        for seq in starts {
            if found.as_ref().is_some_and(|f| f.seq <= seq) {
                break;
            }
            let mut calls: BTreeMap<(&str, Option<u64>), Vec<usize>> = BTreeMap::new();
            for (rank, runs) in &members {
                if let Some(r) = runs.iter().find(|r| r.first <= seq && seq <= r.last) {
                    // Sizes that may differ by design are not compared.
                    let bytes = SAME_SIZE.contains(&r.op.as_str()).then_some(r.bytes);
                    calls.entry((r.op.as_str(), bytes)).or_default().push(*rank);
                }
            }
            if calls.len() < 2 {
                continue;
            }
            let culprits = odd_ones_out(calls.values());
            found = Some(Mismatch {
                pg: pg.to_string(),
                seq,
                calls: calls
                    .into_iter()
                    .map(|((op, b), r)| (op.to_string(), b, r))
                    .collect(),
                culprits,
            });
            break;
        }
    }
    found
}

/// A rank the others keep waiting for.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct Straggler {
    pub rank: usize,
    pub host: String,
    /// Percent of its samples it waited for peers (in a collective, or in the GPU sync after
    /// one), and the median rank's.
    pub waited_pct: f64,
    pub median_pct: f64,
    /// The evidence: every rank's wait percentage, by rank.
    pub waits: Vec<(usize, f64)>,
}

/// Samples a rank needs before it can be called a straggler.
const STRAGGLER_SAMPLES: u32 = 30;

/// How many standard errors the gap between the median rank and the lowest must be: each
/// rank's percentage is a count of samples, which on a balanced job differ by chance; 3.5 makes
/// a balanced job of 2 to 1000 ranks name nobody (binomial tail under 1e-4 per rank).
const STRAGGLER_Z: f64 = 3.5;

/// The straggler among `ranks`, if one stands out: the median rank waits for peers in at least
/// a tenth of its samples, one rank alone waits at most a third as often, and the gap is too
/// large for sampling chance. A rank 20% slower than the others makes them wait about a sixth
/// of each step while it hardly waits.
pub(crate) fn straggler(ranks: &[Seen<'_>]) -> Option<Straggler> {
    let live: Vec<&Seen<'_>> = ranks
        .iter()
        .filter(|s| s.view.exited.is_none() && s.view.samples >= STRAGGLER_SAMPLES)
        .collect();
    if live.len() < 2 {
        return None;
    }
    let pct = |s: &Seen<'_>| 100.0 * f64::from(s.view.waiting) / f64::from(s.view.samples);
    let mut all: Vec<f64> = live.iter().map(|s| pct(s)).collect();
    all.sort_by(f64::total_cmp);
    let median = all[all.len() / 2];
    let low = live.iter().min_by(|a, b| pct(a).total_cmp(&pct(b)))?;
    let second = all.get(1).copied().unwrap_or(median);
    let p = pct(low);
    let m = median / 100.0;
    let n = f64::from(
        low.view
            .samples
            .min(live.iter().map(|s| s.view.samples).max()?),
    );
    let sigma = 100.0 * (m * (1.0 - m) / n).sqrt();
    // One rank alone at the bottom, far under the rest.
    let stands_out = median >= 10.0
        && p <= median / 3.0
        && second > median / 2.0
        && median - p >= STRAGGLER_Z * sigma;
    stands_out.then(|| Straggler {
        rank: low.view.rank,
        host: low.host.to_string(),
        waited_pct: p,
        median_pct: median,
        waits: live.iter().map(|s| (s.view.rank, pct(s))).collect(),
    })
}

/// How much more of its time the median rank must spend in collectives on the GPU than the
/// straggler: a rank 20% slower makes the others wait 1/6 (17%) of each step.
const FR_GAP: f64 = 0.15;

/// How long the GPU-time counters must name the same straggler before it is said: a window's
/// length (the agent's 10 s), so that two windows that share no reading both name it (their
/// window slides every second: two looks in a row are nearly the same evidence, where two
/// flight-recorder dumps in a row are not).
const GPU_SUSTAIN: Duration = Duration::from_secs(10);

/// A rank's share of its time spent in collectives on the GPU, and where it was read: from
/// nrun's NCCL profiler plugin over the last seconds, else from its flight recorder's last dump.
fn gpu_share(s: &Seen<'_>) -> Option<(f64, GpuEvidence)> {
    if let Some(g) = s.view.gpu.filter(|g| g.span_ms > 0.0) {
        return Some((
            (g.waited_ms / g.span_ms).clamp(0.0, 1.0),
            GpuEvidence::Plugin(g),
        ));
    }
    let fr = s.view.fr.as_ref()?;
    let (w, span) = (fr.waited_ms?, fr.span_ms?);
    (span >= 500.0).then_some(((w / span).clamp(0.0, 1.0), GpuEvidence::Dump(span)))
}

/// Where a rank's GPU time was read (see [`gpu_share`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum GpuEvidence {
    Plugin(crate::protocol::GpuWait),
    /// A dump, told apart from the next by its span (ms).
    Dump(f64),
}

/// The straggler by the ranks' time in collectives on the GPU (NCCL jobs, where every rank
/// waits at the same GPU sync and stacks cannot tell them apart): the others wait for a slow
/// rank inside the collective; it does not.
pub(crate) fn gpu_straggler(ranks: &[Seen<'_>]) -> Option<Straggler> {
    let shares: Vec<(&Seen<'_>, (f64, GpuEvidence))> = ranks
        .iter()
        .filter(|s| s.view.exited.is_none())
        .filter_map(|s| Some((s, gpu_share(s)?)))
        .collect();
    // The plugin's evidence covers the last seconds, a dump its own span: where some ranks
    // have the plugin's, only those compare.
    let plugin = |e: &GpuEvidence| matches!(e, GpuEvidence::Plugin(_));
    let any_plugin = shares.iter().any(|(_, (_, e))| plugin(e));
    let timed: Vec<(&Seen<'_>, f64)> = shares
        .into_iter()
        .filter(|(_, (_, e))| !any_plugin || plugin(e))
        .map(|(s, (f, _))| (s, f))
        .collect();
    if timed.len() < 2 {
        return None;
    }
    let mut all: Vec<f64> = timed.iter().map(|(_, f)| *f).collect();
    all.sort_by(f64::total_cmp);
    let median = all[all.len() / 2];
    let second = all[1];
    let (low, p) = timed.iter().min_by(|a, b| a.1.total_cmp(&b.1))?;
    (median - p >= FR_GAP && second - p >= FR_GAP).then(|| Straggler {
        rank: low.view.rank,
        host: low.host.to_string(),
        waited_pct: 100.0 * p,
        median_pct: 100.0 * median,
        waits: timed
            .iter()
            .map(|(s, f)| (s.view.rank, 100.0 * f))
            .collect(),
    })
}

/// How long a rank's stack stays unreadable before the watch says so.
const UNREADABLE_SAID: Duration = Duration::from_secs(10);

/// How long after the last stall seen a failure is still put down to it.
const STALL_TO_FAILURE: Duration = Duration::from_secs(5);

/// A stall that blames someone: ranks waiting at least 2 s in a collective another rank has
/// not entered (or a different one); with the longest wait, milliseconds.
fn stall_of(seen: &[Seen<'_>]) -> Option<(Diagnosis, u64)> {
    let waited = seen
        .iter()
        .filter(|s| s.view.exited.is_none() && waits_in(s.view).is_some())
        .map(|s| s.view.unchanged_ms)
        .max()?;
    let d = diagnose(seen)?;
    (matches!(d.kind, Kind::Missing | Kind::Disagree) && waited >= 2000).then_some((d, waited))
}

/// Whether the live ranks stall, by the collectives they wait in: a rank that has waited in
/// one collective call (or the GPU sync after one) for `timeout_ms` is stuck, whatever its
/// peers do meanwhile: a peer that polls in a sleep loop or spins in Python moves its own
/// stack, but no collective progresses. With no rank in a collective, a stall is every stack
/// standing still (a deadlock in Python code, every rank paused at one place).
fn stalled(live: &[&Seen<'_>], timeout_ms: u64) -> bool {
    let waited = live
        .iter()
        .filter(|s| waits_in(s.view).is_some())
        .map(|s| s.view.unchanged_ms)
        .max();
    waited.is_some_and(|w| w >= timeout_ms)
        || live.iter().all(|s| s.view.unchanged_ms >= timeout_ms)
}

/// Every rank of `views`, with its host, by rank.
fn seen_of<'a>(views: &'a HashMap<usize, NodeWatch>, hosts: &'a [String]) -> Vec<Seen<'a>> {
    let mut v: Vec<Seen<'a>> = views
        .iter()
        .flat_map(|(n, w)| {
            let host = hosts.get(*n).map_or("?", |h| h.as_str());
            w.ranks.iter().map(move |view| Seen { host, view })
        })
        .collect();
    v.sort_by_key(|s| s.view.rank);
    v
}

/// One rank's figures from the latest views, for the metrics (see `journal::metrics`).
pub(crate) struct RankFigure {
    pub rank: usize,
    pub host: String,
    /// Seconds its stack has not changed (in a collective: how long it has waited there).
    pub progress_age_s: f64,
    /// Share of its samples it waited for peers (0..1); None before it has any.
    pub wait_share: Option<f64>,
}

/// The coordinator's watch over one step: the latest view of every node, what was said.
pub(crate) struct WatchState {
    pub plan: WatchPlan,
    views: HashMap<usize, NodeWatch>,
    /// The views when ranks last waited for a missing rank, and when.
    last_stall: Option<(Instant, HashMap<usize, NodeWatch>)>,
    hang_said: bool,
    unreadable_said: bool,
    /// Since when each rank's stack could not be read: a Python that is still starting (or
    /// exiting) cannot be, for a moment, which is not worth a warning.
    unreadable_since: HashMap<usize, Instant>,
    straggler_said: HashMap<usize, Instant>,
    /// The GPU-time straggler, the distinct readings in a row that named it (one dump covers
    /// a few seconds, two in a row make it sustained), the last, and since when.
    gpu_suspect: Option<(usize, u32, GpuEvidence, Instant)>,
    /// The collective mismatch last said (process group, sequence number).
    mismatch_said: Option<(String, u64)>,
    last_check: Option<Instant>,
    /// The ranks of the step watched (0: not known), and when it started: a hang is not called
    /// while some of them were never seen in a node's view (their node's watch starting, its
    /// views on the way), for at most twice the hang timeout.
    world: usize,
    step_started: Instant,
    /// The findings not yet taken by the journal ([`WatchState::take_found`]).
    found: Vec<Finding>,
    /// Every hang found, for the report.
    pub hangs: Vec<Diagnosis>,
    pub stragglers: Vec<Straggler>,
    pub mismatches: Vec<Mismatch>,
}

/// `--report`'s `watch`: every hang, straggler and mismatch the watch found (a list an older
/// report lacks is empty).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct WatchReport {
    pub hangs: Vec<Diagnosis>,
    pub stragglers: Vec<Straggler>,
    pub mismatches: Vec<Mismatch>,
}

/// Why the watch stops a job (`--on-hang stop`).
#[derive(Clone, Debug)]
pub(crate) enum Stop {
    /// Ranks called a collective differently (the last of [`WatchState::mismatches`]).
    Mismatch,
    /// The job hung, as diagnosed (also the last of [`WatchState::hangs`]).
    Hang(Diagnosis),
}

/// A hang or a straggler the watch found, as it found it (the journal makes it an event).
#[derive(Clone, Debug)]
pub(crate) enum Finding {
    Hang(Diagnosis),
    Straggler(Straggler),
}

impl WatchState {
    /// The findings since the last call, in the order found.
    pub(crate) fn take_found(&mut self) -> Vec<Finding> {
        std::mem::take(&mut self.found)
    }

    /// The findings not taken yet.
    pub(crate) fn found(&self) -> &[Finding] {
        &self.found
    }

    pub(crate) fn new(plan: WatchPlan) -> WatchState {
        WatchState {
            plan,
            views: HashMap::new(),
            last_stall: None,
            hang_said: false,
            unreadable_said: false,
            unreadable_since: HashMap::new(),
            straggler_said: HashMap::new(),
            gpu_suspect: None,
            mismatch_said: None,
            last_check: None,
            world: 0,
            step_started: Instant::now(),
            found: Vec::new(),
            hangs: Vec::new(),
            stragglers: Vec::new(),
            mismatches: Vec::new(),
        }
    }

    /// Node `node`'s latest view.
    pub(crate) fn observe(&mut self, node: usize, v: NodeWatch) {
        self.views.insert(node, v);
    }

    /// Forgets the views of a finished step (a restart starts afresh); the next has `world`
    /// ranks.
    pub(crate) fn reset(&mut self, world: usize) {
        self.world = world;
        self.step_started = Instant::now();
        self.views.clear();
        self.last_stall = None;
        self.hang_said = false;
        self.mismatch_said = None;
        self.last_check = None;
    }

    /// Looks at the views (at most once a second): prints a hang or a straggler when one is
    /// found. Some: the job should stop, and why (a hang or a collective mismatch, with
    /// `--on-hang stop`).
    pub(crate) fn check(&mut self, hosts: &[String]) -> Option<Stop> {
        if self
            .last_check
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return None;
        }
        self.last_check = Some(Instant::now());
        // The views are lent out while the parts of the check look at them and update the rest.
        let views = std::mem::take(&mut self.views);
        let stop = self.check_views(&views, hosts);
        self.views = views;
        stop
    }

    fn check_views(&mut self, views: &HashMap<usize, NodeWatch>, hosts: &[String]) -> Option<Stop> {
        let seen = seen_of(views, hosts);
        // The last stall seen is what explains a failure that follows it: by the time ranks
        // fail, their stacks show the error being raised, then every rank stopped.
        if stall_of(&seen).is_some() {
            self.last_stall = Some((Instant::now(), views.clone()));
        }
        if self.say_mismatch(&seen) {
            return Some(Stop::Mismatch);
        }
        // A rank whose stack cannot be read (not yet, or not at all) says nothing about progress.
        let live: Vec<&Seen<'_>> = seen
            .iter()
            .filter(|s| s.view.exited.is_none() && !s.view.frames.is_empty())
            .collect();
        self.note_unreadable(&seen);
        if live.is_empty() {
            return None;
        }
        for s in &live {
            tracing::trace!(
                "watch: rank {} samples {} waiting {} unchanged {} ms in {:?}",
                s.view.rank,
                s.view.samples,
                s.view.waiting,
                s.view.unchanged_ms,
                s.view.collective
            );
        }
        let timeout = self.plan.hang_timeout.as_millis() as u64;
        // Every rank seen (or long enough waited for): the one missing may be the one the
        // others wait for, and the call would blame nobody.
        let all_seen =
            seen.len() >= self.world || self.step_started.elapsed() >= 2 * self.plan.hang_timeout;
        let stalled = all_seen && stalled(&live, timeout);
        let mut stop = None;
        if !stalled {
            self.hang_said = false;
        } else if !self.hang_said {
            self.hang_said = true;
            if let Some(mut d) = diagnose(&seen) {
                d.nccl_ras = ras_of(views, hosts, d.stalled_s);
                eprint!("{}", hang_text(&d, self.plan.hang_timeout));
                if self.plan.on_hang == OnHang::Stop && d.kind != Kind::AllBusy {
                    stop = Some(Stop::Hang(d.clone()));
                }
                self.found.push(Finding::Hang(d.clone()));
                self.hangs.push(d);
            }
        }
        let by_gpu = self.sustained_gpu_straggler(&seen, Instant::now());
        if let Some(s) = straggler(&seen).or(by_gpu).filter(|_| !stalled) {
            self.say_straggler(s);
        }
        stop
    }

    /// A collective called differently by some ranks is said as soon as the dumps show it:
    /// NCCL may hang on it, or go on with wrong results while the stacks keep moving. True:
    /// said, and the job stops (`--on-hang stop`).
    fn say_mismatch(&mut self, seen: &[Seen<'_>]) -> bool {
        let Some(m) = mismatch(seen) else {
            return false;
        };
        let key = (m.pg.clone(), m.seq);
        if self.mismatch_said.as_ref() == Some(&key) {
            return false;
        }
        self.mismatch_said = Some(key);
        let stop = self.plan.on_hang == OnHang::Stop;
        let host = |r: usize| {
            seen.iter()
                .find(|s| s.view.rank == r)
                .map_or("?", |s| s.host)
        };
        let who = match m.culprits.as_slice() {
            [] => "each rank does".to_string(),
            [r] => format!("rank {r} on {} does", host(*r)),
            r => format!(
                "{} (on {}) do",
                ranks_text(r),
                r.iter().map(|&r| host(r)).collect::<Vec<_>>().join(", ")
            ),
        };
        tracing::warn!(
            "collective mismatch: {}; NCCL does not check this, so the job hangs or computes \
             wrong results: see what {who} differently before that collective{}",
            m.text(),
            if stop {
                "; stopping the job (--on-hang stop)"
            } else {
                ""
            }
        );
        self.mismatches.push(m);
        stop
    }

    /// Notes since when each rank's stack is unreadable (read again: forgotten), and says the
    /// first that stays so.
    fn note_unreadable(&mut self, seen: &[Seen<'_>]) {
        let before = std::mem::take(&mut self.unreadable_since);
        self.unreadable_since = seen
            .iter()
            .filter(|s| s.view.frames.is_empty() && s.view.error.is_some())
            .filter(|s| s.view.exited.is_none())
            .map(|s| {
                let r = s.view.rank;
                (r, before.get(&r).copied().unwrap_or_else(Instant::now))
            })
            .collect();
        if self.unreadable_said {
            return;
        }
        if let Some(s) = seen.iter().find(|s| {
            self.unreadable_since
                .get(&s.view.rank)
                .is_some_and(|t| t.elapsed() >= UNREADABLE_SAID)
        }) {
            self.unreadable_said = true;
            tracing::warn!(
                "the watch cannot read rank {}'s Python stack on {} ({}); a hang is named \
                 only from the ranks it can read",
                s.view.rank,
                s.host,
                s.view.error.as_deref().unwrap_or("?")
            );
        }
    }

    /// The GPU-time straggler once the evidence holds: two flight-recorder dumps in a row (told
    /// apart by their span), or the plugin's counters over [`GPU_SUSTAIN`].
    fn sustained_gpu_straggler(&mut self, seen: &[Seen<'_>], now: Instant) -> Option<Straggler> {
        let Some(s) = gpu_straggler(seen) else {
            self.gpu_suspect = None;
            return None;
        };
        let evidence = seen
            .iter()
            .find(|x| x.view.rank == s.rank)
            .and_then(|x| Some(gpu_share(x)?.1))?;
        let (n, since) = match self.gpu_suspect {
            Some((r, n, last, since)) if r == s.rank => (n + u32::from(last != evidence), since),
            _ => (1, now),
        };
        self.gpu_suspect = Some((s.rank, n, evidence, since));
        let held = match evidence {
            GpuEvidence::Plugin(_) => now.duration_since(since) >= GPU_SUSTAIN,
            GpuEvidence::Dump(_) => true,
        };
        (n >= 2 && held).then_some(s)
    }

    /// Says a straggler, at most once a minute for each rank.
    fn say_straggler(&mut self, s: Straggler) {
        let due = self
            .straggler_said
            .get(&s.rank)
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(60));
        if !due {
            return;
        }
        self.straggler_said.insert(s.rank, Instant::now());
        let each: Vec<String> = s
            .waits
            .iter()
            .map(|(r, p)| format!("{r}: {p:.0}%"))
            .collect();
        tracing::warn!(
            "rank {} on {} is a straggler: it waited for peers (in collectives or the GPU \
             sync after them) {:.0}% of the time, the median rank {:.0}%: the others \
             wait for it (each rank's wait: {})",
            s.rank,
            s.host,
            s.waited_pct,
            s.median_pct,
            each.join(", ")
        );
        self.found.push(Finding::Straggler(s.clone()));
        self.stragglers.push(s);
    }

    /// The likely cause of a failure, from the last views: a rank missing from the collective
    /// the others had waited in for at least a few seconds.
    pub(crate) fn cause(&self, hosts: &[String]) -> Option<String> {
        // A stall that ended long before the failure did not cause it.
        let (at, views) = self.last_stall.as_ref()?;
        if at.elapsed() > STALL_TO_FAILURE {
            return None;
        }
        let (d, waited) = stall_of(&seen_of(views, hosts))?;
        Some(format!(
            "  likely cause (the watch saw ranks wait {:.0} s): {}\n",
            waited as f64 / 1e3,
            d.conclusion
        ))
    }

    /// Some rank of the step has been seen in a collective (or its flight recorder has one):
    /// the workers are at work, the journal's sign that they left their start-up.
    pub(crate) fn progressed(&self) -> bool {
        self.views
            .values()
            .flat_map(|v| &v.ranks)
            .any(|r| r.waiting > 0 || r.collective.is_some() || r.fr.is_some())
    }

    /// The most collectives any rank's flight recorder completed, as the last dumps read this
    /// step say (the sequence number of its last completed one); None: no dump was read.
    pub(crate) fn collectives_completed(&self) -> Option<u64> {
        self.views
            .values()
            .flat_map(|v| &v.ranks)
            .filter_map(|r| r.fr.as_ref()?.completed.as_ref())
            .map(|op| op.seq)
            .max()
    }

    /// Each rank's last-progress age and wait share, as the latest views say (the metrics).
    pub(crate) fn rank_figures(&self, hosts: &[String]) -> Vec<RankFigure> {
        let mut out: Vec<_> = self
            .views
            .iter()
            .flat_map(|(node, v)| v.ranks.iter().map(move |r| (*node, r)))
            .filter(|(_, r)| r.exited.is_none())
            .map(|(node, r)| RankFigure {
                rank: r.rank,
                host: hosts.get(node).cloned().unwrap_or_default(),
                progress_age_s: r.unchanged_ms as f64 / 1e3,
                wait_share: (r.samples > 0).then(|| f64::from(r.waiting) / f64::from(r.samples)),
            })
            .collect();
        out.sort_by_key(|f| f.rank);
        out
    }

    /// The watch's findings for `--report`.
    pub(crate) fn report(&self) -> WatchReport {
        WatchReport {
            hangs: self.hangs.clone(),
            stragglers: self.stragglers.clone(),
            mismatches: self.mismatches.clone(),
        }
    }
}

/// The hang report, as printed.
pub(crate) fn hang_text(d: &Diagnosis, timeout: Duration) -> String {
    let mut t = String::new();
    let what = match d.in_collective {
        true => "a collective has not progressed",
        false => "no rank has made progress",
    };
    let _ = writeln!(
        t,
        "nrun: hang: {what} for {:.0} s (--hang-timeout {} s)",
        d.stalled_s,
        timeout.as_secs()
    );
    for r in &d.ranks {
        let _ = writeln!(
            t,
            "  rank {} on {} (pid {}): {}",
            r.rank, r.host, r.pid, r.state
        );
        for f in r.frames.iter().take(4) {
            let _ = writeln!(t, "      {f}");
        }
    }
    let _ = writeln!(t, "  conclusion: {}", d.conclusion);
    if let Some(ras) = d.nccl_ras.as_ref().filter(|r| !r.findings.is_empty()) {
        let _ = writeln!(t, "  NCCL's RAS (asked on {}):", ras.host);
        for l in ras.findings.iter().take(RAS_LINES) {
            let _ = writeln!(t, "      {l}");
        }
        if ras.findings.len() > RAS_LINES {
            let _ = writeln!(
                t,
                "      ... {} more lines in --report",
                ras.findings.len() - RAS_LINES
            );
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Frame;

    fn frame(name: &str, file: &str, line: i32) -> Frame {
        Frame {
            name: name.into(),
            file: file.into(),
            line,
            code: None,
        }
    }

    fn waiting(rank: usize, op: &str) -> RankView {
        RankView {
            rank,
            pid: 100 + rank as u32,
            frames: vec![
                frame(
                    op,
                    "/v/site-packages/torch/distributed/distributed_c10d.py",
                    2500,
                ),
                frame("main", "/job/train.py", 12),
            ],
            collective: Some(op.into()),
            unchanged_ms: 61_000,
            samples: 100,
            waiting: 40,
            ..RankView::default()
        }
    }

    fn busy(rank: usize, line: i32) -> RankView {
        RankView {
            rank,
            pid: 100 + rank as u32,
            frames: vec![frame("main", "/job/train.py", line)],
            unchanged_ms: 61_000,
            samples: 100,
            waiting: 1,
            ..RankView::default()
        }
    }

    fn seen(v: &[RankView]) -> Vec<Seen<'_>> {
        v.iter().map(|view| Seen { host: "h1", view }).collect()
    }

    #[test]
    fn the_rank_missing_from_the_collective_is_named() {
        let v = [
            waiting(0, "all_reduce"),
            busy(1, 7),
            waiting(2, "all_reduce"),
        ];
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!(d.kind, Kind::Missing);
        assert_eq!(d.culprits, [1]);
        assert!(
            d.conclusion.starts_with("ranks 0,2 wait in all_reduce; rank 1 on h1 has not entered it: it is in main (/job/train.py:7)"),
            "{}",
            d.conclusion
        );
        let mut gone = busy(1, 7);
        gone.exited = Some(nrun_node::Exit::Code(0));
        let v = [waiting(0, "all_reduce"), gone];
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!((d.kind, d.culprits), (Kind::Missing, vec![1]));
        assert!(
            d.conclusion
                .contains("exited with code 0 before entering it"),
            "{}",
            d.conclusion
        );
    }

    #[test]
    fn disagreement_all_waiting_and_all_busy() {
        let v = [
            waiting(0, "all_reduce"),
            waiting(1, "all_gather"),
            waiting(2, "all_reduce"),
        ];
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!((d.kind, d.culprits.clone()), (Kind::Disagree, vec![1]));
        assert!(
            d.conclusion.contains("rank 1 in all_gather"),
            "{}",
            d.conclusion
        );
        let v = [waiting(0, "all_reduce"), waiting(1, "all_reduce")];
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!(d.kind, Kind::AllWaiting);
        assert!(d.culprits.is_empty());
        let v = [busy(0, 30), busy(1, 30)];
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!(d.kind, Kind::AllBusy);
        assert!(
            d.conclusion
                .starts_with("all ranks in main (/job/train.py:30)"),
            "{}",
            d.conclusion
        );
        let v = [busy(0, 30), busy(1, 31)];
        assert_eq!(diagnose(&seen(&v)).unwrap().kind, Kind::Busy);
    }

    #[test]
    fn an_unreadable_rank_is_said_and_never_blamed_nor_counted_as_stalled() {
        let unread = RankView {
            rank: 2,
            error: Some("cannot read its Python stack: permission denied".into()),
            unchanged_ms: 90_000,
            ..RankView::default()
        };
        let v = [waiting(0, "all_reduce"), busy(1, 7), unread.clone()];
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!(d.culprits, [1]);
        assert!(
            d.conclusion.ends_with("(rank 2: stack unreadable)"),
            "{}",
            d.conclusion
        );
        // Nothing readable: no verdict at all.
        let plan = WatchPlan {
            hang_timeout: Duration::from_secs(60),
            on_hang: OnHang::Stop,
        };
        let mut w = WatchState::new(plan);
        w.observe(
            0,
            NodeWatch {
                ras: None,
                ranks: vec![unread],
            },
        );
        assert!(w.check(&["h1".to_string()]).is_none());
        assert!(w.hangs.is_empty());
        // Said only once it has stayed unreadable a while (a Python still starting cannot be
        // read for a moment); a rank read again starts over.
        assert!(!w.unreadable_said);
        let since = Instant::now() - UNREADABLE_SAID;
        w.unreadable_since.insert(2, since);
        w.last_check = None;
        w.check(&["h1".to_string()]);
        assert!(w.unreadable_said);
        w.observe(
            0,
            NodeWatch {
                ras: None,
                ranks: vec![busy(2, 7)],
            },
        );
        w.last_check = None;
        w.check(&["h1".to_string()]);
        assert!(w.unreadable_since.is_empty());
    }

    #[test]
    fn a_rank_stuck_behind_an_nccl_collective_waits_at_its_next_sync() {
        let mut gpu = busy(0, 50);
        gpu.frames[0].code = Some("t[0].item()".into());
        let mut sleeper = busy(1, 31);
        sleeper
            .frames
            .insert(0, frame("stuck_forever", "/job/train.py", 31));
        let v = [gpu, sleeper];
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!((d.kind, d.culprits.clone()), (Kind::Missing, vec![1]));
        assert!(
            d.conclusion.starts_with("rank 0 waits in a GPU sync (t[0].item()); rank 1 on h1 has not entered it: it is in stuck_forever"),
            "{}",
            d.conclusion
        );
    }

    #[test]
    fn a_straggler_stands_out_and_a_balanced_job_has_none() {
        let mut v = vec![
            waiting(0, "all_reduce"),
            waiting(1, "all_reduce"),
            waiting(2, "all_reduce"),
        ];
        v[2].waiting = 3;
        let s = straggler(&seen(&v)).unwrap();
        assert_eq!(s.rank, 2);
        assert!(s.waited_pct < 5.0 && s.median_pct >= 40.0);
        v[2].waiting = 38;
        assert!(straggler(&seen(&v)).is_none());
        // Too few samples to judge.
        for r in &mut v {
            r.samples = 10;
        }
        assert!(straggler(&seen(&v)).is_none());
    }

    #[test]
    fn a_rank_a_fifth_slower_is_a_straggler_and_sampling_chance_is_not() {
        // Two ranks, one 20% slower: the other waits a sixth of each step at its GPU sync.
        let mut fast = busy(0, 50);
        fast.frames[0].code = Some("loss.item()".into());
        let (mut fast, mut slow) = (fast.clone(), fast);
        slow.rank = 1;
        (fast.samples, fast.waiting) = (120, 20);
        (slow.samples, slow.waiting) = (120, 1);
        let v = [fast.clone(), slow.clone()];
        let s = straggler(&seen(&v)).unwrap();
        assert_eq!(s.rank, 1);
        assert_eq!(s.waits.len(), 2);
        assert!((s.waits[0].1 - 16.7).abs() < 0.1, "{:?}", s.waits);
        // The same figures after 30 samples are within chance: nobody named yet.
        (fast.samples, fast.waiting) = (30, 5);
        (slow.samples, slow.waiting) = (30, 1);
        assert!(straggler(&seen(&[fast.clone(), slow.clone()])).is_none());
        // A balanced job whose ranks' counts differ by chance.
        let balanced: Vec<RankView> = [18, 20, 22, 15]
            .iter()
            .enumerate()
            .map(|(r, w)| RankView {
                rank: r,
                samples: 120,
                waiting: *w,
                ..fast.clone()
            })
            .collect();
        assert!(straggler(&seen(&balanced)).is_none());
    }

    fn fr(seq: u64, state: &str, bytes: u64) -> crate::protocol::FrView {
        use crate::protocol::{FrOp, FrView};
        let op = |seq, state: &str| FrOp {
            seq,
            op: "all_reduce".into(),
            bytes,
            pg: "0".into(),
            state: state.into(),
        };
        FrView {
            last: op(seq, state),
            completed: Some(op(
                if state == "completed" { seq } else { seq - 1 },
                "completed",
            )),
            waited_ms: None,
            span_ms: None,
            runs: Vec::new(),
        }
    }

    #[test]
    fn the_flight_recorder_names_the_collective_and_the_rank_behind() {
        let mut v = [
            waiting(0, "all_reduce"),
            busy(1, 31),
            waiting(2, "all_reduce"),
        ];
        v[1].frames
            .insert(0, frame("stuck_forever", "/job/train.py", 31));
        v[0].fr = Some(fr(6, "started", 4 << 20));
        v[1].fr = Some(fr(5, "completed", 4 << 20));
        v[2].fr = Some(fr(6, "scheduled", 4 << 20));
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!(
            (d.kind.clone(), d.culprits.clone()),
            (Kind::Missing, vec![1])
        );
        assert_eq!(
            d.conclusion,
            "ranks 0,2 wait in all_reduce #6 (4 MiB); rank 1 completed #5 and is in \
             stuck_forever (/job/train.py:31)"
        );
        // Different sizes of the same collective.
        v[1] = waiting(1, "all_reduce");
        v[1].fr = Some(fr(6, "started", 16 << 20));
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!(
            (d.kind.clone(), d.culprits.clone()),
            (Kind::Disagree, vec![1])
        );
        assert_eq!(
            d.conclusion,
            "the ranks disagree on collective #6: ranks 0,2 all_reduce (4 MiB), rank 1 \
             all_reduce (16 MiB) (flight recorder)"
        );
        // A rank without a dump: the stacks' conclusion stands.
        v[1].fr = None;
        let d = diagnose(&seen(&v)).unwrap();
        assert_eq!(d.kind, Kind::AllWaiting);
        assert!(!d.conclusion.contains('#'), "{}", d.conclusion);
    }

    #[test]
    fn the_flight_recorders_timings_name_a_gpu_straggler_and_not_a_balanced_job() {
        let mut v = [busy(0, 50), busy(1, 50)];
        let timed = |w: f64| {
            let mut f = fr(100, "completed", 4 << 20);
            (f.waited_ms, f.span_ms) = (Some(w), Some(5000.0));
            f
        };
        // Rank 1 is 20% slower: rank 0 waits a sixth of each step in the all_reduce.
        v[0].fr = Some(timed(900.0));
        v[1].fr = Some(timed(60.0));
        let s = gpu_straggler(&seen(&v)).unwrap();
        assert_eq!((s.rank, s.waits.len()), (1, 2));
        assert!((s.median_pct - 18.0).abs() < 0.1, "{s:?}");
        // Balanced, one rank always a little later (it waits less): nobody.
        v[0].fr = Some(timed(400.0));
        v[1].fr = Some(timed(100.0));
        assert!(gpu_straggler(&seen(&v)).is_none());
    }

    #[test]
    fn the_plugin_s_gpu_time_names_a_gpu_straggler_before_a_dump_and_not_a_balanced_job() {
        use crate::protocol::GpuWait;
        let mut v = [busy(0, 50), busy(1, 50), busy(2, 50)];
        let waited = |w: f64| {
            Some(GpuWait {
                waited_ms: w,
                span_ms: 10_000.0,
                collectives: 400,
            })
        };
        // Rank 2 is slow: ranks 0 and 1 wait a third of the time inside the collectives.
        (v[0].gpu, v[1].gpu, v[2].gpu) = (waited(3300.0), waited(3500.0), waited(200.0));
        let s = gpu_straggler(&seen(&v)).unwrap();
        assert_eq!(s.rank, 2);
        assert!((s.waited_pct - 2.0).abs() < 0.01 && (s.median_pct - 33.0).abs() < 0.01);
        // A dump that says otherwise is older evidence: the plugin's reading stands.
        let mut f = fr(100, "completed", 4 << 20);
        (f.waited_ms, f.span_ms) = (Some(4000.0), Some(5000.0));
        v[2].fr = Some(f.clone());
        assert_eq!(gpu_straggler(&seen(&v)).unwrap().rank, 2);
        // A rank with only a dump (its own span) does not compare with the plugin's ranks.
        (f.waited_ms, f.span_ms) = (Some(0.0), Some(5000.0));
        let mut only_dump = busy(3, 50);
        only_dump.fr = Some(f);
        let four = [v[0].clone(), v[1].clone(), v[2].clone(), only_dump];
        let s = gpu_straggler(&seen(&four)).unwrap();
        assert_eq!((s.rank, s.waits.len()), (2, 3));
        // Balanced (each rank waits a little, one a little less): nobody.
        (v[0].gpu, v[1].gpu, v[2].gpu) = (waited(900.0), waited(800.0), waited(300.0));
        assert!(gpu_straggler(&seen(&v)).is_none());
        // Two slow ranks of three: the median waits as little as they do; nobody is alone.
        (v[0].gpu, v[1].gpu, v[2].gpu) = (waited(3300.0), waited(200.0), waited(250.0));
        assert!(gpu_straggler(&seen(&v)).is_none());
    }

    #[test]
    fn the_plugin_s_straggler_is_said_once_it_held_a_window_and_a_dump_s_after_two_dumps() {
        use crate::protocol::GpuWait;
        let mut w = WatchState::new(WatchPlan {
            hang_timeout: Duration::from_secs(60),
            on_hang: OnHang::Stop,
        });
        let t = Instant::now();
        let at = |s: u64| t + Duration::from_secs(s);
        let mut v = [busy(0, 50), busy(1, 50)];
        let look = |w: &mut WatchState, v: &mut [RankView; 2], s: u64| {
            // The window slides each second: new counts at every look.
            let g = |ms: f64| GpuWait {
                waited_ms: ms,
                span_ms: 10_000.0,
                collectives: 400 + s,
            };
            (v[0].gpu, v[1].gpu) = (Some(g(4000.0)), Some(g(100.0)));
            w.sustained_gpu_straggler(&seen(v), at(s)).map(|x| x.rank)
        };
        assert_eq!(look(&mut w, &mut v, 0), None);
        assert_eq!(
            look(&mut w, &mut v, 5),
            None,
            "5 s is not yet a window's length"
        );
        assert_eq!(look(&mut w, &mut v, 10), Some(1));
        // A look that names nobody starts the count again.
        v[1].gpu = None;
        assert!(w.sustained_gpu_straggler(&seen(&v), at(11)).is_none());
        assert_eq!(look(&mut w, &mut v, 12), None);
        assert_eq!(look(&mut w, &mut v, 22), Some(1));
        // From dumps: the same dump twice is one; a second dump names it.
        let mut w = WatchState::new(WatchPlan {
            hang_timeout: Duration::from_secs(60),
            on_hang: OnHang::Stop,
        });
        let dump = |waited: f64, span: f64| {
            let mut f = fr(100, "completed", 4 << 20);
            (f.waited_ms, f.span_ms) = (Some(waited), Some(span));
            Some(f)
        };
        let mut v = [busy(0, 50), busy(1, 50)];
        (v[0].fr, v[1].fr) = (dump(900.0, 5000.0), dump(60.0, 5000.0));
        assert!(w.sustained_gpu_straggler(&seen(&v), at(0)).is_none());
        assert!(w.sustained_gpu_straggler(&seen(&v), at(15)).is_none());
        v[1].fr = dump(70.0, 5100.0);
        assert_eq!(
            w.sustained_gpu_straggler(&seen(&v), at(16)).unwrap().rank,
            1
        );
    }

    /// A view whose flight recorder holds `runs` (first, last, op, bytes) of group `pg`.
    fn recorded(rank: usize, pg: &str, runs: &[(u64, u64, &str, u64)]) -> RankView {
        use crate::protocol::FrRun;
        let mut v = busy(rank, 40);
        let mut f = fr(runs.last().map_or(1, |r| r.1), "completed", 0);
        f.last.pg = pg.into();
        f.runs = runs
            .iter()
            .map(|&(first, last, op, bytes)| FrRun {
                first,
                last,
                op: op.into(),
                bytes,
            })
            .collect();
        v.fr = Some(f);
        v
    }

    #[test]
    fn the_first_collective_called_differently_is_found_in_the_recorders() {
        let ar = "all_reduce";
        // Rank 1 all-reduces 4x the bytes from #6 on; rank 0 went on further.
        let v = [
            recorded(0, "0", &[(1, 40, ar, 4096)]),
            recorded(1, "0", &[(1, 5, ar, 4096), (6, 12, ar, 16384)]),
        ];
        let m = mismatch(&seen(&v)).unwrap();
        assert_eq!(
            (m.seq, m.culprits.clone()),
            (6, vec![]),
            "a tie blames nobody"
        );
        assert_eq!(
            m.text(),
            "the ranks disagree on collective #6: rank 0 all_reduce (4 KiB), rank 1 all_reduce \
             (16 KiB) (flight recorder)"
        );
        // With a third rank the odd one out is named, and the hang's conclusion says it.
        let mut v3 = vec![
            v[0].clone(),
            v[1].clone(),
            recorded(2, "0", &[(1, 9, ar, 4096)]),
        ];
        assert_eq!(mismatch(&seen(&v3)).unwrap().culprits, vec![1]);
        v3[0] = waiting(0, "all_reduce");
        v3[0].fr = v[0].fr.clone();
        let d = diagnose(&seen(&v3)).unwrap();
        assert_eq!(
            (d.kind.clone(), d.culprits.clone()),
            (Kind::Disagree, vec![1])
        );
        assert!(d.conclusion.contains("collective #6"), "{}", d.conclusion);
        // Another op at the same number: named, sizes left out where they may differ.
        let v = [
            recorded(0, "0", &[(1, 8, ar, 4096)]),
            recorded(1, "0", &[(1, 6, ar, 4096), (7, 7, "all_to_all", 512)]),
        ];
        let m = mismatch(&seen(&v)).unwrap();
        assert_eq!(m.seq, 7);
        assert!(
            m.text().contains("rank 1 all_to_all (flight"),
            "{}",
            m.text()
        );
        // Nothing to find: all_to_all sizes differ by design; ranks of other groups, and
        // records that do not overlap, are not compared; the same calls agree.
        for v in [
            [
                recorded(0, "0", &[(1, 8, "all_to_all", 4096)]),
                recorded(1, "0", &[(1, 8, "all_to_all", 512)]),
            ],
            [
                recorded(0, "0", &[(1, 8, ar, 4096)]),
                recorded(1, "1", &[(1, 8, ar, 512)]),
            ],
            [
                recorded(0, "0", &[(30, 40, ar, 4096)]),
                recorded(1, "0", &[(1, 12, ar, 512)]),
            ],
            [
                recorded(0, "0", &[(1, 3, ar, 4096), (4, 9, "broadcast", 8)]),
                recorded(1, "0", &[(2, 3, ar, 4096), (4, 5, "broadcast", 8)]),
            ],
        ] {
            assert_eq!(mismatch(&seen(&v)), None);
        }
    }

    #[test]
    fn a_mismatch_is_said_once_and_stops_the_job_only_when_asked() {
        let hosts = vec!["h1".to_string()];
        let ranks = || NodeWatch {
            ras: None,
            ranks: vec![
                recorded(0, "0", &[(1, 40, "all_reduce", 4096)]),
                recorded(
                    1,
                    "0",
                    &[(1, 5, "all_reduce", 4096), (6, 9, "all_reduce", 64)],
                ),
            ],
        };
        for (on_hang, stops) in [(OnHang::Report, false), (OnHang::Stop, true)] {
            let mut w = WatchState::new(WatchPlan {
                hang_timeout: Duration::from_secs(600),
                on_hang,
            });
            w.observe(0, ranks());
            let stop = w.check(&hosts);
            assert_eq!(stop.is_some(), stops);
            assert!(matches!(stop, None | Some(Stop::Mismatch)));
            assert_eq!(w.mismatches.len(), 1);
            w.last_check = None;
            w.observe(0, ranks());
            assert!(w.check(&hosts).is_none() || stops);
            assert_eq!(w.mismatches.len(), 1, "said once");
            assert_eq!(w.report().mismatches[0].seq, 6);
        }
    }

    #[test]
    fn no_hang_is_called_before_every_rank_was_seen() {
        let hosts = vec!["h1".to_string(), "h2".to_string()];
        let mut w = WatchState::new(WatchPlan {
            hang_timeout: Duration::from_secs(60),
            on_hang: OnHang::Stop,
        });
        w.reset(2);
        // Rank 0 waits in all_reduce; rank 1's node has sent no view yet (a test under load:
        // a hang called on rank 0 alone, "none is missing", while rank 1 slept).
        w.observe(
            0,
            NodeWatch {
                ras: None,
                ranks: vec![waiting(0, "all_reduce")],
            },
        );
        assert!(w.check(&hosts).is_none());
        assert!(w.hangs.is_empty());
        w.last_check = None;
        w.observe(
            1,
            NodeWatch {
                ras: None,
                ranks: vec![busy(1, 30)],
            },
        );
        assert!(w.check(&hosts).is_some());
        assert_eq!(w.hangs.len(), 1);
        assert!(
            w.hangs[0].conclusion.contains("rank 1 on h2"),
            "{}",
            w.hangs[0].conclusion
        );
    }

    #[test]
    fn a_hang_is_said_once_until_progress_resumes_and_stop_obeys_the_kind() {
        let plan = WatchPlan {
            hang_timeout: Duration::from_secs(60),
            on_hang: OnHang::Stop,
        };
        let hosts = vec!["h1".to_string()];
        let mut w = WatchState::new(plan);
        w.observe(
            0,
            NodeWatch {
                ras: None,
                ranks: vec![busy(0, 30), busy(1, 30)],
            },
        );
        // Everyone at the same place: reported, never stopped.
        assert!(w.check(&hosts).is_none());
        assert_eq!(w.hangs.len(), 1);
        w.last_check = None;
        w.observe(
            0,
            NodeWatch {
                ras: None,
                ranks: vec![waiting(0, "all_reduce"), busy(1, 7)],
            },
        );
        assert!(
            w.check(&hosts).is_none(),
            "said once until progress resumes"
        );
        w.last_check = None;
        // Progress: the collective completed, rank 0 is in the next one.
        let (mut next, mut moving) = (waiting(0, "all_reduce"), busy(1, 8));
        (next.unchanged_ms, moving.unchanged_ms) = (10, 10);
        w.observe(
            0,
            NodeWatch {
                ras: None,
                ranks: vec![next, moving],
            },
        );
        assert!(w.check(&hosts).is_none());
        assert!(!w.hang_said);
        w.last_check = None;
        w.observe(
            0,
            NodeWatch {
                ras: None,
                ranks: vec![waiting(0, "all_reduce"), busy(1, 7)],
            },
        );
        assert!(matches!(w.check(&hosts), Some(Stop::Hang(_))));
        assert_eq!(w.hangs.len(), 2);
        assert!(
            w.cause(&hosts)
                .is_some_and(|c| c.contains("rank 1 on h1 has not entered it"))
        );
    }

    /// A rank that has not entered the collective its peers wait in is the culprit once they
    /// have waited --hang-timeout, whatever it does meanwhile: its stack moving (a poll in a
    /// sleep loop, a spin in Python) is not progress. Before the timeout, nothing is said.
    #[test]
    fn a_rank_that_polls_outside_the_collective_its_peers_wait_in_is_the_culprit() {
        let plan = WatchPlan {
            hang_timeout: Duration::from_secs(5),
            on_hang: OnHang::Stop,
        };
        let hosts = vec!["h1".to_string(), "h2".to_string()];
        let mut poller = busy(1, 7);
        poller.frames[0].code = Some("time.sleep(1)".into());
        poller.unchanged_ms = 300;
        for (waited_ms, hang) in [(4_900, false), (5_000, true)] {
            let mut w = WatchState::new(plan);
            w.reset(3);
            let mut r0 = waiting(0, "all_reduce");
            r0.unchanged_ms = waited_ms;
            let mut r2 = waiting(2, "all_reduce");
            r2.unchanged_ms = 1_000;
            w.observe(
                0,
                NodeWatch {
                    ras: None,
                    ranks: vec![r0, r2],
                },
            );
            w.observe(
                1,
                NodeWatch {
                    ras: None,
                    ranks: vec![poller.clone()],
                },
            );
            assert_eq!(w.check(&hosts).is_some(), hang, "waited {waited_ms} ms");
            assert_eq!(w.hangs.len(), usize::from(hang));
            if hang {
                let d = &w.hangs[0];
                assert_eq!(
                    (d.kind.clone(), d.culprits.clone()),
                    (Kind::Missing, vec![1])
                );
                assert!(
                    d.conclusion.starts_with("ranks 0,2 wait in all_reduce; rank 1 on h2 has not entered it: it is in main (/job/train.py:7): time.sleep(1)"),
                    "{}",
                    d.conclusion
                );
                assert_eq!(d.stalled_s, 5.0);
                let text = hang_text(d, plan.hang_timeout);
                assert!(
                    text.starts_with(
                        "nrun: hang: a collective has not progressed for 5 s (--hang-timeout 5 s)\n"
                    ),
                    "{text}"
                );
            }
        }
        // Every rank busy and moving (no collective waited in): no hang, however long.
        let mut w = WatchState::new(plan);
        w.observe(
            0,
            NodeWatch {
                ras: None,
                ranks: vec![poller.clone(), RankView { rank: 0, ..poller }],
            },
        );
        assert!(w.check(&hosts[..1]).is_none());
        assert!(w.hangs.is_empty());
    }

    /// NCCL's RAS answer given during the stall goes with the hang (its findings printed, the
    /// whole of it in the report); one from before the stall does not.
    #[test]
    fn a_hang_carries_what_nccls_ras_said_during_it() {
        let plan = WatchPlan {
            hang_timeout: Duration::from_secs(60),
            on_hang: OnHang::Report,
        };
        let hosts = vec!["h1".to_string(), "h2".to_string()];
        let now_ms = crate::protocol::unix_ms();
        let status = "Errors\n======\n\nWarnings\n========\n\n#0-0 (f4) MISMATCH\n  \
                      Communicator ranks have different AllReduce operation counts\n";
        let ras = |at_ms| crate::protocol::RasView {
            at_ms,
            text: Some(status.into()),
            error: None,
        };
        for (at_ms, said) in [(now_ms - 5_000, true), (now_ms - 120_000, false)] {
            let mut w = WatchState::new(plan);
            w.observe(
                0,
                NodeWatch {
                    ras: None,
                    ranks: vec![waiting(0, "all_reduce")],
                },
            );
            w.observe(
                1,
                NodeWatch {
                    ras: Some(ras(at_ms)),
                    ranks: vec![busy(1, 7)],
                },
            );
            w.check(&hosts);
            let d = &w.hangs[0];
            assert_eq!(d.nccl_ras.is_some(), said, "{:?}", d.nccl_ras);
            let text = hang_text(d, plan.hang_timeout);
            assert_eq!(text.contains("NCCL's RAS (asked on h2):"), said, "{text}");
            if said {
                assert!(text.contains(
                    "      Communicator ranks have different AllReduce operation counts\n"
                ));
                let json = serde_json::to_value(w.report()).unwrap();
                assert_eq!(json["hangs"][0]["nccl_ras"]["host"], "h2");
                assert_eq!(json["hangs"][0]["nccl_ras"]["status"], status);
            }
        }
    }
}
