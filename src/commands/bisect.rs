//! `nrun bisect`: the staged scale-up that finds the node or link that breaks a multi-node job.
//!
//! Stage 0: every host joins (an unreachable one is named with ssh's error) and reports its
//! facts; a node whose NCCL (major.minor) or torch differs from the majority is bad. Stage 1:
//! every node alone, all at once. Then disjoint pairs, groups of 4, 8, ... up to all nodes; the
//! groups of a stage run at the same time, each with a store (and so a key space and a
//! communicator) of its own. A failing or slow group is isolated: a pair's members are re-paired
//! with nodes that already passed (a node that fails with every partner is bad; a pair whose
//! members pass elsewhere has a bad link); a larger group's halves are re-tested, then its
//! cross pairs. Slow: busbw under `--slow-factor` of the stage's median, or (`--probe net`) a
//! link of the group's ring, measured alone, far under the median of the round's links.
//!
//! Probes: the NCCL preflight (default), `--probe net` (TCP ring, no GPU), or `--probe cmd`
//! (the user's own command, which must exit 0 within `--timeout`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::plan::{BisectSettings, NodesPlan};
use crate::protocol::{RunResult, Step, StepResult, THIS_NRUN};
use crate::session::spec::{Group, Launch};
use crate::session::{Policy, Session};
use nrun_base::error::{Error, Result, exit};
use nrun_cli::Probe;
use nrun_preflight::{self as preflight, Settings, Verdict};
use nrun_store::Store;

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum NodeVerdict {
    Good,
    Bad,
    Slow,
    Unreachable,
    /// Fails only together with some node: a link or pair problem.
    Link,
}

impl NodeVerdict {
    /// As the table, the report's evidence and the exclude file say it.
    fn name(&self) -> String {
        format!("{self:?}").to_lowercase()
    }
}

#[derive(Clone, Debug, Serialize)]
struct NodeResult {
    host: String,
    verdict: NodeVerdict,
    evidence: Vec<String>,
}

impl NodeResult {
    /// "bisect: slow (...) with h1" where the evidence begins with the verdict's name, else
    /// "bisect: failed: ...": why the node is left out (on the spot) or excluded.
    fn why(&self) -> String {
        let (name, evidence) = (self.verdict.name(), self.evidence.join("; "));
        match evidence.starts_with(&name) {
            true => format!("bisect: {evidence}"),
            false => format!("bisect: {name}: {evidence}"),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
struct Round {
    stage: String,
    groups: Vec<GroupOut>,
}

#[derive(Clone, Debug, Serialize)]
struct GroupOut {
    hosts: Vec<String>,
    ok: bool,
    busbw_gbs: Option<f64>,
    evidence: String,
    /// A link of the group's ring far under the round's links (the TCP probe measures each link
    /// alone): slow whatever the group's busbw, which a busy host's latency can even out.
    #[serde(skip_serializing_if = "Option::is_none")]
    slow_link: Option<String>,
    /// The ring's links that cross between nodes, measured alone: (from, to, GB/s, the speed
    /// of the sender's NIC in GB/s where known).
    #[serde(skip)]
    links: Vec<(String, String, f64, Option<f64>)>,
    #[serde(skip)]
    members: Vec<usize>,
}

/// Entry point: runs the stages, prints the table, writes the report and hostfile.
pub(crate) async fn run(
    bp: &BisectSettings,
    nodes: &NodesPlan,
    listener: Option<std::net::TcpListener>,
) -> Result<u8> {
    let started = Instant::now();
    let mut s = Session::start(&bp.session, nodes, listener).await?;
    let mut b = Bisect {
        bp,
        results: s
            .nodes
            .iter()
            .map(|n| NodeResult {
                host: n.label.clone(),
                verdict: NodeVerdict::Good,
                evidence: Vec::new(),
            })
            .collect(),
        rounds: Vec::new(),
        stage1_rounds: 0,
        control: serde_json::Value::Null,
    };
    let outcome = b.stages(&mut s).await;
    // Where each node's agent reached this host, and why that address (--report).
    b.control = s.control_json();
    s.end().await;
    // An interrupted or failed stage has said why; only its exit code is left.
    outcome?;
    b.finish(nodes, started.elapsed())
}

/// The staged scale-up on the spot, over a job's nodes and spares, when its preflight failed
/// with no node to blame: the nodes found not good, each with the evidence. Nodes that did not
/// join or were left out already take no part.
pub(crate) async fn on_the_spot(
    s: &mut Session,
    job: &crate::plan::RunSettings,
    pf: &crate::plan::PreflightPlan,
) -> Result<Vec<(usize, String)>> {
    let bp = BisectSettings {
        session: job.session.clone(),
        workers: job.workers.clone(),
        sweep: Some(pf.clone()),
        probe: match pf.mode {
            nrun_preflight::Mode::Net => Probe::Net,
            _ => Probe::Nccl,
        },
        // As the preflight judges a node against its peers: under half of them is slow. Tighter,
        // the TCP ring's noise on a busy host names healthy nodes.
        slow_factor: 0.5,
        timeout: pf.timeout,
        write_hostfile: None,
        write_exclude: false,
        report: None,
        report_html: None,
    };
    let mut b = Bisect {
        bp: &bp,
        results: s
            .nodes
            .iter()
            .map(|n| NodeResult {
                host: n.label.clone(),
                verdict: NodeVerdict::Good,
                evidence: Vec::new(),
            })
            .collect(),
        rounds: Vec::new(),
        stage1_rounds: 0,
        control: serde_json::Value::Null,
    };
    let outside: Vec<usize> = (0..s.len())
        .filter(|i| s.nodes[*i].joined.is_none() || s.is_left_out(*i))
        .collect();
    for &i in &outside {
        b.mark(i, NodeVerdict::Unreachable, "not in the job".into());
    }
    eprintln!(
        "nrun: the preflight failed and names no single node: bisecting {} nodes on the spot",
        b.alive().len()
    );
    b.scale_up(s).await?;
    Ok(b.results
        .iter()
        .enumerate()
        .filter(|(i, r)| r.verdict != NodeVerdict::Good && !outside.contains(i))
        .map(|(i, r)| (i, r.why()))
        .collect())
}

struct Bisect<'a> {
    bp: &'a BisectSettings,
    results: Vec<NodeResult>,
    rounds: Vec<Round>,
    /// Rounds up to and including stage 1 (the efficiency target counts those after it).
    stage1_rounds: usize,
    /// `--report`'s `control` section: each node's launch-host address and how it was chosen.
    control: serde_json::Value,
}

impl Bisect<'_> {
    async fn stages(&mut self, s: &mut Session) -> Result<()> {
        // ---- stage 0: reachability and facts --------------------------------------------
        let failures = s.join(false, None).await?;
        for (i, msg) in failures {
            self.mark(i, NodeVerdict::Unreachable, msg);
        }
        for (_, p) in s.assign_interfaces().problems {
            eprintln!("nrun bisect: {p}");
        }
        self.facts_stage(s);
        eprintln!(
            "nrun bisect: stage 0: {} of {} hosts reachable and consistent",
            self.alive().len(),
            s.len()
        );
        self.scale_up(s).await
    }

    /// Stage 1 (every node alone), then pairs, groups of 4, ... all, isolating what fails.
    async fn scale_up(&mut self, s: &mut Session) -> Result<()> {
        // ---- stage 1: every node alone ----------------------------------------------------
        let singles: Vec<Vec<usize>> = self.alive().into_iter().map(|i| vec![i]).collect();
        let outs = self.round("stage 1: every node alone", singles, s).await?;
        for g in &outs {
            if !g.ok {
                self.mark(
                    g.members[0],
                    NodeVerdict::Bad,
                    format!("fails alone: {}", g.evidence),
                );
            }
        }
        // Alone, the TCP ring measures the CPU more than any link; only NVLink/PCIe numbers of
        // the NCCL probe say something about a node on its own.
        if self.bp.probe == Probe::Nccl {
            self.slow_check(&outs, "alone");
        }
        self.stage1_rounds = self.rounds.len();

        // ---- stages 2..: pairs, 4, 8, ... all ----------------------------------------------
        let mut size = 2;
        loop {
            let alive = self.alive();
            if alive.len() < 2 {
                break;
            }
            let groups = partition(&alive, size);
            let label = if groups.len() == 1 {
                format!("stage: all {} nodes", alive.len())
            } else {
                format!("stage: groups of {size}")
            };
            let groups_len = groups.len();
            let mut outs = self.round(&label, groups, s).await?;
            let median = median_busbw(&outs);
            // A group slow once is measured again before it is taken apart: isolating it costs
            // rounds, and on a busy host one slow figure is often the host's, not the group's.
            self.confirm_slow(&mut outs, median, s).await?;
            let mut suspects: Vec<GroupOut> = Vec::new();
            for g in outs {
                let slow = self.is_slow(&g, median);
                if !g.ok || slow {
                    suspects.push(GroupOut {
                        ok: g.ok && !slow,
                        ..g
                    });
                }
            }
            for g in suspects {
                self.isolate(g, median, s).await?;
            }
            // One group was all of them (a leftover joins the last group, so this can come
            // before size reaches their count): a larger size would run the same group again.
            if groups_len == 1 || size >= alive.len() {
                break;
            }
            size *= 2;
        }
        Ok(())
    }

    fn alive(&self) -> Vec<usize> {
        self.results
            .iter()
            .enumerate()
            .filter(|(_, r)| r.verdict == NodeVerdict::Good)
            .map(|(i, _)| i)
            .collect()
    }

    fn mark(&mut self, i: usize, v: NodeVerdict, evidence: String) {
        let r = &mut self.results[i];
        // A node already found bad stays bad; unreachable beats everything.
        if r.verdict == NodeVerdict::Good || v == NodeVerdict::Unreachable {
            r.verdict = v;
        }
        r.evidence.push(evidence);
    }

    /// NCCL major.minor and torch against the majority of the joined nodes.
    fn facts_stage(&mut self, s: &Session) {
        let sig = |n: &crate::session::Node| {
            n.joined.as_ref().and_then(|j| j.facts.as_ref()).map(|f| {
                let nccl = f
                    .nccl
                    .first()
                    .and_then(|l| l.version.clone())
                    .map(|v| v.split('.').take(2).collect::<Vec<_>>().join("."));
                (nccl, f.torch.clone())
            })
        };
        let mut counts: BTreeMap<(Option<String>, Option<String>), usize> = BTreeMap::new();
        for n in &s.nodes {
            if let Some(x) = sig(n) {
                *counts.entry(x).or_default() += 1;
            }
        }
        let Some((majority, _)) = counts
            .iter()
            .max_by_key(|(_, c)| **c)
            .map(|(k, c)| (k.clone(), *c))
        else {
            return;
        };
        for (i, n) in s.nodes.iter().enumerate() {
            if let Some(x) = sig(n)
                && x != majority
            {
                let show = |x: &(Option<String>, Option<String>)| {
                    format!(
                        "NCCL {} / torch {}",
                        x.0.as_deref().unwrap_or("-"),
                        x.1.as_deref().unwrap_or("-")
                    )
                };
                self.mark(
                    i,
                    NodeVerdict::Bad,
                    format!(
                        "facts differ: {} here, {} on the other nodes",
                        show(&x),
                        show(&majority)
                    ),
                );
            }
        }
    }

    fn slow_check(&mut self, outs: &[GroupOut], how: &str) {
        let Some(m) = median_busbw(outs) else { return };
        for g in outs {
            if let Some(b) = g.busbw_gbs
                && g.ok
                && b < self.bp.slow_factor * m
            {
                for &i in &g.members {
                    self.mark(
                        i,
                        NodeVerdict::Slow,
                        format!(
                            "busbw {b:.2} GB/s {how}, under {} x the median {m:.2}",
                            self.bp.slow_factor
                        ),
                    );
                }
            }
        }
    }

    /// Narrows a failing or slow group down to nodes or links, re-testing with known-good nodes.
    /// Each round's groups are judged against that round's median busbw (`median`, the one
    /// above, only where a round has a single group): on a busy host another round's figures
    /// differ by more than --slow-factor (a healthy pair at 0.11 GB/s was called slow against
    /// the stage's best group, 0.26 GB/s, two rounds before).
    async fn isolate(&mut self, g: GroupOut, median: Option<f64>, s: &mut Session) -> Result<()> {
        match g.members.len() {
            3.. => self.isolate_halves(g, median, s).await,
            2 => self.isolate_pair(g, median, s).await,
            _ => Ok(()),
        }
    }

    /// A group of more than two: halves first; then, if both halves pass, the pairs across
    /// them. A half of one node runs with a node that passed elsewhere: alone, it sends nothing
    /// over the network, and a node whose own link is slow would pass.
    async fn isolate_halves(
        &mut self,
        g: GroupOut,
        median: Option<f64>,
        s: &mut Session,
    ) -> Result<()> {
        let (a, b) = g.members.split_at(g.members.len() / 2);
        let partner = self.alive().into_iter().find(|i| !g.members.contains(i));
        let half = |h: &[usize]| match (h.len(), partner) {
            (1, Some(p)) => vec![h[0], p],
            _ => h.to_vec(),
        };
        let outs = self
            .round(
                &format!("isolate: halves of {}", names(&g.members, s)),
                vec![half(a), half(b)],
                s,
            )
            .await?;
        let m = median_busbw(&outs).or(median);
        let mut any_bad = false;
        for h in outs {
            if !h.ok || self.is_slow(&h, m) {
                any_bad = true;
                Box::pin(self.isolate(h, m, s)).await?;
            }
        }
        if !any_bad {
            let pairs: Vec<Vec<usize>> = a.iter().zip(b).map(|(x, y)| vec![*x, *y]).collect();
            let outs = self.round("isolate: cross pairs", pairs, s).await?;
            let m = median_busbw(&outs).or(median);
            for p in outs {
                if !p.ok || self.is_slow(&p, m) {
                    Box::pin(self.isolate(p, m, s)).await?;
                }
            }
        }
        Ok(())
    }

    /// A pair: re-pair each member with a different node that already passed.
    async fn isolate_pair(
        &mut self,
        g: GroupOut,
        median: Option<f64>,
        s: &mut Session,
    ) -> Result<()> {
        let what = if g.ok { "slow" } else { "fails" };
        let (x, y) = (g.members[0], g.members[1]);
        let good: Vec<usize> = self
            .alive()
            .into_iter()
            .filter(|i| *i != x && *i != y)
            .collect();
        if good.len() < 2 {
            for &i in &g.members {
                self.mark(
                    i,
                    NodeVerdict::Link,
                    format!(
                        "{what} together with {}; too few other good nodes to tell which",
                        s.nodes[if i == x { y } else { x }].label
                    ),
                );
            }
            return Ok(());
        }
        let mut outs = self
            .round(
                &format!(
                    "isolate: re-pair {} and {}",
                    s.nodes[x].label, s.nodes[y].label
                ),
                vec![vec![x, good[0]], vec![y, good[1]]],
                s,
            )
            .await?;
        let median = median_busbw(&outs).or(median);
        self.confirm_slow(&mut outs, median, s).await?;
        let why = match (g.evidence.as_str(), &g.slow_link) {
            ("", None) => String::new(),
            ("", Some(link)) => format!(" ({link})"),
            (e, _) => format!(" ({e})"),
        };
        let what = format!("{what}{why}");
        // A re-pair that fails makes its node bad; one that only runs slow, slow.
        let judge = |o: &GroupOut| {
            if !o.ok {
                Some(NodeVerdict::Bad)
            } else if self.is_slow(o, median) {
                Some(NodeVerdict::Slow)
            } else {
                None
            }
        };
        let verdicts = [judge(&outs[0]), judge(&outs[1])];
        let partners = [good[0], good[1]];
        match verdicts {
            [None, None] => self.pair_again([x, y], partners, &what, median, s).await,
            v => {
                self.mark_repaired([x, y], partners, v, &outs, &what, s);
                Ok(())
            }
        }
    }

    /// Marks the members of a pair whose re-pairs (`outs`, with `partners`) did not both pass:
    /// the one that fails (or runs slow) again is the culprit; both, both are.
    fn mark_repaired(
        &mut self,
        [x, y]: [usize; 2],
        partners: [usize; 2],
        verdicts: [Option<NodeVerdict>; 2],
        outs: &[GroupOut],
        what: &str,
        s: &Session,
    ) {
        let again = |o: &GroupOut| match (o.busbw_gbs, &o.slow_link) {
            (_, Some(link)) if o.ok => link.clone(),
            (Some(b), _) if o.ok => format!("{b:.3} GB/s"),
            _ if !o.evidence.is_empty() => o.evidence.clone(),
            _ => "failed".into(),
        };
        let good = partners;
        match verdicts {
            [Some(v), None] => self.mark(
                x,
                v,
                format!(
                    "{what} with {}, and again with {} ({}), who pass elsewhere",
                    s.nodes[y].label,
                    s.nodes[good[0]].label,
                    again(&outs[0])
                ),
            ),
            [None, Some(v)] => self.mark(
                y,
                v,
                format!(
                    "{what} with {}, and again with {} ({}), who pass elsewhere",
                    s.nodes[x].label,
                    s.nodes[good[1]].label,
                    again(&outs[1])
                ),
            ),
            [Some(vx), Some(vy)] => {
                self.mark(
                    x,
                    vx,
                    format!(
                        "{what} with {}, and again with {} ({})",
                        s.nodes[y].label,
                        s.nodes[good[0]].label,
                        again(&outs[0])
                    ),
                );
                self.mark(
                    y,
                    vy,
                    format!(
                        "{what} with {}, and again with {} ({})",
                        s.nodes[x].label,
                        s.nodes[good[1]].label,
                        again(&outs[1])
                    ),
                );
            }
            [None, None] => {}
        }
    }

    /// Both members of a pair pass with other partners: a link problem, or a measurement
    /// disturbed by the rest of the stage. The pair alone, once more, tells them apart.
    async fn pair_again(
        &mut self,
        [x, y]: [usize; 2],
        good: [usize; 2],
        what: &str,
        median: Option<f64>,
        s: &mut Session,
    ) -> Result<()> {
        let again = self
            .round(
                &format!(
                    "isolate: {} and {} again",
                    s.nodes[x].label, s.nodes[y].label
                ),
                vec![vec![x, y]],
                s,
            )
            .await?;
        if again[0].ok && !self.is_slow(&again[0], median) {
            return Ok(());
        }
        self.mark(
            x,
            NodeVerdict::Link,
            format!(
                "{what} only with {} (link or pair problem); passes with {}",
                s.nodes[y].label, s.nodes[good[0]].label
            ),
        );
        self.mark(
            y,
            NodeVerdict::Link,
            format!(
                "{what} only with {} (link or pair problem); passes with {}",
                s.nodes[x].label, s.nodes[good[1]].label
            ),
        );
        Ok(())
    }

    /// A group that ran but slow is measured once more and keeps the better figure: one
    /// measurement on a busy host (a shared machine, another job's burst) is not enough to call
    /// a group or a node slow, while a slow NIC or link is slow both times. A failure needs no
    /// second look.
    async fn confirm_slow(
        &mut self,
        outs: &mut [GroupOut],
        median: Option<f64>,
        s: &mut Session,
    ) -> Result<()> {
        let slow: Vec<usize> = (0..outs.len())
            .filter(|&k| outs[k].ok && self.is_slow(&outs[k], median))
            .collect();
        if slow.is_empty() {
            return Ok(());
        }
        let groups: Vec<Vec<usize>> = slow.iter().map(|&k| outs[k].members.clone()).collect();
        let label = groups
            .iter()
            .map(|g| names(g, s))
            .collect::<Vec<_>>()
            .join(", ");
        let again = self
            .round(&format!("slow, once more: {label}"), groups, s)
            .await?;
        for (k, o) in slow.into_iter().zip(again) {
            // The better of the two is kept (a second run that fails says no more than slow).
            let first = &mut outs[k];
            if let (true, Some(a), Some(b)) = (o.ok, first.busbw_gbs, o.busbw_gbs) {
                first.busbw_gbs = Some(a.max(b));
            }
            if o.ok && o.slow_link.is_none() {
                first.slow_link = None;
            }
        }
        Ok(())
    }

    /// Under --slow-factor of the stage's median busbw, or with a slow link.
    fn is_slow(&self, g: &GroupOut, median: Option<f64>) -> bool {
        g.slow_link.is_some()
            || matches!((g.busbw_gbs, median), (Some(b), Some(m)) if b < self.bp.slow_factor * m)
    }

    /// Runs one round: every group at once, each with its own store. Nodes not in a group idle.
    async fn round(
        &mut self,
        stage: &str,
        groups: Vec<Vec<usize>>,
        s: &mut Session,
    ) -> Result<Vec<GroupOut>> {
        let scratch = format!("bisect{}", self.rounds.len());
        let settings: Vec<Option<Settings>> = (0..s.len()).map(|i| self.settings(s, i)).collect();
        let extra = |i: usize| {
            settings[i]
                .as_ref()
                .map_or_else(Vec::new, |x| x.rank_env(false))
        };
        let (program, args) = match self.bp.probe {
            Probe::Nccl | Probe::Net => (THIS_NRUN.to_string(), vec!["__preflight".to_string()]),
            Probe::Cmd => (
                self.bp.workers.program.to_string_lossy().into_owned(),
                self.bp
                    .workers
                    .args
                    .iter()
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect(),
            ),
        };
        // Nodes outside every group sit the round out (the session keeps their steps in line).
        let mut steps: Vec<Option<Step>> = vec![None; s.len()];
        let mut stores = Vec::new();
        let mut stops = Vec::new();
        for g in &groups {
            let (store, port, stop) = match group_store() {
                Ok(x) => x,
                Err(e) => {
                    // Said now, before the nodes are ended, as every stage's failure is.
                    eprintln!("nrun: error: {e}");
                    return Err(Error::exit(e.code));
                }
            };
            let launch = Launch {
                port,
                attempt: 0,
                restart_count: 0,
                program: &program,
                args: &args,
                logs: false,
                scratch: &scratch,
                extra: &extra,
                grace_ms: 2000,
                deadline_ms: Some(self.bp.timeout.as_millis() as u64),
                watch: None,
                secret: false,
            };
            let group = Group::of(s, g);
            for (i, st) in s
                .steps(&self.bp.workers, &group, &launch)
                .into_iter()
                .enumerate()
            {
                if st.is_some() {
                    steps[i] = st;
                }
            }
            stores.push(store);
            stops.push(stop);
        }
        let deadline = self.bp.timeout + Duration::from_secs(30);
        let mut p = self.round_progress(stage, &groups, s, deadline);
        let waits_for = groups.iter().map(|g| names(g, s)).collect::<Vec<_>>();
        let results = p
            .during(s.run_step(steps, Policy::Apart { deadline }), |p| {
                p.waiting(|| format!("the probes of {}", crate::progress::few(&waits_for)))
            })
            .await?;
        p.finish(None);
        let mut outs: Vec<GroupOut> = groups
            .iter()
            .enumerate()
            .map(|(gi, g)| self.evaluate(g, &stores[gi], &results, s, &settings))
            .collect();
        slow_links(&mut outs);
        for (g, out) in groups.iter().zip(&outs) {
            eprintln!(
                "nrun bisect: {stage}: {} {}{}{}",
                names(g, s),
                if out.ok { "ok" } else { "FAILED" },
                out.busbw_gbs
                    .map_or(String::new(), |b| format!(" ({b:.2} GB/s)")),
                out.slow_link
                    .as_ref()
                    .map_or(String::new(), |l| format!(": slow link: {l}"))
            );
        }
        for stop in stops {
            let _ = stop.send(());
        }
        self.rounds.push(Round {
            stage: stage.to_string(),
            groups: outs.clone(),
        });
        Ok(outs)
    }

    /// Says which round starts, of how many (those stage 1 and the doubling group sizes
    /// take; isolating a failure adds rounds), and on which nodes; its progress until
    /// `deadline`.
    fn round_progress(
        &self,
        stage: &str,
        groups: &[Vec<usize>],
        s: &Session,
        deadline: Duration,
    ) -> crate::progress::Progress {
        let k = self.rounds.len() + 1;
        // Stage 1, then one round per doubling of the group size while two groups fit (a
        // leftover joins the last group).
        let doublings = self.alive().len().max(1).ilog2() as usize;
        let planned = self.stage1_rounds.max(1) + doublings;
        let nodes: usize = groups.iter().map(Vec::len).sum();
        let plan = format!("{k} of at least {}", planned.max(k));
        let p = crate::progress::Progress::new(
            &format!("bisect round {k}"),
            None,
            Some(Instant::now() + deadline),
        );
        p.line(&format!(
            "bisect round {plan} ({stage}): {} group(s) on {nodes} node(s): {}",
            groups.len(),
            crate::progress::few(&groups.iter().map(|g| names(g, s)).collect::<Vec<_>>())
        ));
        p
    }

    /// Settings of the preflight ranks on joined node `i` (probes nccl and net).
    fn settings(&self, s: &Session, i: usize) -> Option<Settings> {
        let pf = self.bp.sweep.as_ref()?;
        s.nodes[i].joined.as_ref()?;
        // The net probe's link test stays on: a shaped or slow link stands out from its ring's
        // other links by far more than the group's busbw stands out from other groups'.
        Some(super::preflight::node_settings(s, pf, i, None, "bisect"))
    }

    fn evaluate(
        &self,
        g: &[usize],
        st: &Store,
        results: &[Option<StepResult>],
        s: &Session,
        settings: &[Option<Settings>],
    ) -> GroupOut {
        let hosts: Vec<String> = g.iter().map(|i| s.nodes[*i].label.clone()).collect();
        let mut failure = None;
        for &i in g {
            let label = &s.nodes[i].label;
            match &results[i] {
                Some(StepResult::Run(RunResult::Success)) => {}
                Some(StepResult::Run(RunResult::Failed(f))) => {
                    failure.get_or_insert(format!(
                        "rank {} on {label} {}{}",
                        f.rank,
                        f.how,
                        f.stderr_tail
                            .last()
                            .map_or(String::new(), |l| format!(": {l}"))
                    ));
                }
                Some(StepResult::Run(RunResult::TimedOut)) => {
                    failure.get_or_insert(format!(
                        "{label} ran past --timeout {} s",
                        self.bp.timeout.as_secs()
                    ));
                }
                Some(StepResult::Run(RunResult::Lost(m) | RunResult::SpawnError(m))) => {
                    failure.get_or_insert(m.clone());
                }
                Some(StepResult::Run(RunResult::Interrupted(sig))) => {
                    failure.get_or_insert(format!(
                        "{label}: its agent was stopped by {}",
                        nrun_node::signal_name(*sig)
                    ));
                }
                Some(StepResult::Run(RunResult::Stopped)) => {
                    failure.get_or_insert(format!(
                        "{label}: its workers were stopped before the group finished (its agent \
                         lost the launch host?)"
                    ));
                }
                Some(StepResult::Probe { .. }) => {
                    failure.get_or_insert(format!("{label} answered a probe instead of running"));
                }
                None => {
                    failure.get_or_insert(format!("{label} did not report in time"));
                }
            }
        }
        let mut busbw = None;
        let mut links = Vec::new();
        let probe_settings = settings[g[0]]
            .as_ref()
            .filter(|_| self.bp.probe != Probe::Cmd);
        if let Some(first) = probe_settings {
            let group = Group::of(s, g);
            let ranks = group.rank_hosts(s);
            let outcome =
                preflight::Outcome::gather(first, &ranks, group.world, &mut |k| st.get(k));
            links = outcome.crossing_links();
            let summary = outcome.summarize();
            // Slow is judged here, against the other groups of the stage.
            if !matches!(summary.verdict, Verdict::Ok | Verdict::Slow) {
                // The finding that decided the verdict, not the first warning listed.
                let fail = nrun_preflight::finding::Severity::Fail(summary.verdict);
                let problem = summary
                    .findings
                    .iter()
                    .find(|f| f.severity == fail)
                    .map(|f| f.evidence.clone())
                    .or_else(|| summary.problems.first().cloned())
                    .unwrap_or_else(|| "preflight failed".into());
                failure.get_or_insert(problem);
            }
            // The busbw at the largest size, for the slow checks (alone: the algbw, as busbw
            // is 0 for one rank).
            busbw = summary
                .largest
                .map(|(algbw, bus)| if group.world > 1 { bus } else { algbw });
        }
        GroupOut {
            hosts,
            ok: failure.is_none(),
            busbw_gbs: busbw,
            evidence: failure.unwrap_or_default(),
            slow_link: None,
            links,
            members: g.to_vec(),
        }
    }

    fn finish(&self, nodes: &NodesPlan, took: Duration) -> Result<u8> {
        let width = self
            .results
            .iter()
            .map(|r| r.host.len())
            .max()
            .unwrap_or(4)
            .max(4);
        use std::fmt::Write as _;
        let mut table = format!("{:<width$}  {:<11}  evidence\n", "node", "verdict");
        for r in &self.results {
            let v = r.verdict.name();
            let _ = writeln!(
                table,
                "{:<width$}  {:<11}  {}",
                r.host,
                v,
                if r.evidence.is_empty() {
                    "-".into()
                } else {
                    r.evidence.join("; ")
                }
            );
        }
        let after = self.rounds.len().saturating_sub(self.stage1_rounds);
        let _ = writeln!(
            table,
            "{} rounds ({after} after stage 1) in {:.1} s",
            self.rounds.len(),
            took.as_secs_f64()
        );
        nrun_base::stdout(table);
        let v = serde_json::json!({ "nodes": self.results, "rounds": self.rounds, "rounds_after_stage1": after, "seconds": took.as_secs_f64(), "control": self.control });
        if let Some(path) = &self.bp.report {
            crate::report::said(crate::report::write_json("--report", path, &v));
        }
        if let Some(path) = &self.bp.report_html {
            crate::report::said(crate::report::html::write(
                "--report-html",
                path,
                &v,
                "this bisect",
            ));
        }
        if let Some(path) = &self.bp.write_hostfile {
            let good: Vec<&str> = self
                .results
                .iter()
                .filter(|r| r.verdict == NodeVerdict::Good)
                .map(|r| r.host.as_str())
                .collect();
            let text = match &nodes.hostfile {
                // Keep the input's own lines (format, slots, comments) for the good hosts.
                Some((origin, t)) => {
                    crate::hosts::filter_hostfile(t, origin, &|h| good.contains(&h))?
                }
                None => good.iter().map(|h| format!("{h}\n")).collect(),
            };
            nrun_base::outputs::replace(path, text.as_bytes()).map_err(|e| {
                Error::usage(format!(
                    "cannot write --write-hostfile {}: {e}",
                    path.display()
                ))
            })?;
        }
        if self.bp.write_exclude {
            let Some(f) = &nodes.exclude_file else {
                return Err(Error::usage(
                    "--write-exclude appends to --exclude-file PATH: give that too",
                ));
            };
            let now = std::time::SystemTime::now();
            let found: Vec<crate::plan::exclude::Entry> = self
                .results
                .iter()
                .filter(|r| r.verdict != NodeVerdict::Good)
                .map(|r| crate::plan::exclude::Entry {
                    host: r.host.clone(),
                    at: now,
                    why: r.why(),
                })
                .collect();
            f.append(&found)?;
            if !found.is_empty() {
                eprintln!(
                    "nrun bisect: {} node(s) added to {}",
                    found.len(),
                    f.path.display()
                );
            }
        }
        Ok(
            if self.results.iter().all(|r| r.verdict == NodeVerdict::Good) {
                exit::SUCCESS
            } else {
                exit::BISECT_FOUND
            },
        )
    }
}

fn names(g: &[usize], s: &Session) -> String {
    g.iter()
        .map(|i| s.nodes[*i].label.as_str())
        .collect::<Vec<_>>()
        .join("+")
}

/// A store of a group's own, on a free port, and what stops it.
fn group_store() -> Result<(std::sync::Arc<Store>, u16, tokio::sync::oneshot::Sender<()>)> {
    let l = nrun_store::server::bind(0)
        .map_err(|e| Error::internal(format!("cannot bind a group's store: {e}")))?;
    let port = l
        .local_addr()
        .map_err(|e| Error::internal(format!("a group's store: {e}")))?
        .port();
    let store = Store::new();
    let stop = crate::session::serve(l, store.clone())?;
    Ok((store, port, stop))
}

/// Marks each group with a link far under the median of all the round's links (the preflight's
/// rule, [`preflight::far_under_peers`]): one median over every group, not each ring's own, as
/// on a busy host a healthy link measures many times under another (veth links of one round:
/// 1.1 and 17 GB/s), while a shaped or failing one is tens of times under.
fn slow_links(outs: &mut [GroupOut]) {
    let all: Vec<f64> = outs
        .iter()
        .flat_map(|g| g.links.iter().map(|l| l.2))
        .collect();
    if all.len() < 2 {
        return;
    }
    let median = preflight::median(all);
    for g in outs.iter_mut().filter(|g| g.ok) {
        g.slow_link = g
            .links
            .iter()
            .filter(|l| preflight::far_under_peers(l.2, median, l.3))
            .min_by(|a, b| a.2.total_cmp(&b.2))
            .map(|(from, to, gbs, _)| {
                format!(
                    "the link from {from} to {to} carried {gbs:.3} GB/s, {:.0}% of the round's \
                     median link ({median:.2} GB/s)",
                    100.0 * gbs / median
                )
            });
    }
}

fn median_busbw(outs: &[GroupOut]) -> Option<f64> {
    let v: Vec<f64> = outs
        .iter()
        .filter(|g| g.ok)
        .filter_map(|g| g.busbw_gbs)
        .collect();
    (v.len() >= 2).then(|| nrun_preflight::median(v))
}

/// Disjoint groups of `size` in order; a leftover smaller than 2 joins the last group.
fn partition(nodes: &[usize], size: usize) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = nodes.chunks(size).map(|c| c.to_vec()).collect();
    if groups.len() > 1 && groups.last().is_some_and(|g| g.len() < 2) {
        let last = groups.pop().unwrap_or_default();
        if let Some(g) = groups.last_mut() {
            g.extend(last);
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn why_a_node_is_out_names_its_verdict_once() {
        let r = |verdict, e: &str| NodeResult {
            host: "h1".into(),
            verdict,
            evidence: vec![e.into()],
        };
        assert_eq!(
            r(
                NodeVerdict::Slow,
                "slow (the link h1 -> h2 at 0.02 GB/s) with h2"
            )
            .why(),
            "bisect: slow (the link h1 -> h2 at 0.02 GB/s) with h2"
        );
        assert_eq!(
            r(NodeVerdict::Bad, "exit 1 alone").why(),
            "bisect: bad: exit 1 alone"
        );
    }

    #[test]
    fn partitions() {
        assert_eq!(partition(&[0, 1, 2, 3], 2), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(
            partition(&[0, 1, 2, 3, 4], 2),
            vec![vec![0, 1], vec![2, 3, 4]]
        );
        assert_eq!(partition(&[0, 1, 2, 3, 4], 4), vec![vec![0, 1, 2, 3, 4]]);
        assert_eq!(
            partition(&[0, 1, 2, 3, 4, 5], 4),
            vec![vec![0, 1, 2, 3], vec![4, 5]]
        );
        assert_eq!(partition(&[0, 1], 4), vec![vec![0, 1]]);
    }

    fn group(links: &[(&str, &str, f64)], nic: Option<f64>) -> GroupOut {
        GroupOut {
            hosts: Vec::new(),
            ok: true,
            busbw_gbs: Some(0.1),
            evidence: String::new(),
            slow_link: None,
            links: links
                .iter()
                .map(|(a, b, g)| (a.to_string(), b.to_string(), *g, nic))
                .collect(),
            members: Vec::new(),
        }
    }

    #[test]
    fn a_link_far_under_the_rounds_links_and_its_nic_makes_its_group_slow() {
        // The CI round: a shaped link (200 Mbit/s) among healthy veth links of a loaded host.
        let mut outs = vec![
            group(&[("h1", "h2", 0.88), ("h2", "h1", 1.24)], Some(1.25)),
            group(
                &[("h3", "h4", 0.024), ("h4", "h5", 2.69), ("h5", "h3", 1.1)],
                Some(1.25),
            ),
        ];
        super::slow_links(&mut outs);
        assert_eq!(outs[0].slow_link, None);
        let slow = outs[1].slow_link.as_deref().unwrap_or_default();
        assert!(slow.starts_with("the link from h3 to h4 carried 0.024 GB/s, 2% of the round's median link (1.10 GB/s)"), "{slow}");
        // Healthy links a loaded host measured 15x apart: the slowest is over a tenth of its NIC.
        let mut busy = vec![
            group(&[("h1", "h2", 1.136), ("h2", "h1", 17.08)], Some(1.25)),
            group(&[("h3", "h4", 10.44), ("h4", "h3", 12.0)], Some(1.25)),
        ];
        super::slow_links(&mut busy);
        assert!(busy.iter().all(|g| g.slow_link.is_none()));
        // Where no NIC says its speed, the median alone decides.
        let mut unknown = vec![group(
            &[("h1", "h2", 0.05), ("h2", "h1", 1.0), ("h1", "h3", 1.1)],
            None,
        )];
        super::slow_links(&mut unknown);
        assert!(unknown[0].slow_link.is_some());
    }
}
