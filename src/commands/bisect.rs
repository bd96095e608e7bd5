//! `nrun bisect`: the staged scale-up that finds the node or link that breaks a multi-node job.
//!
//! Stage 0: every host joins (an unreachable one is named with ssh's error) and reports its
//! facts; a node whose NCCL (major.minor) or torch differs from the majority is bad. Stage 1:
//! every node alone, all at once. Then disjoint pairs, groups of 4, 8, ... up to all nodes; the
//! groups of a stage run at the same time, each with a store (and so a key space and a
//! communicator) of its own. Every group adds to a node x node matrix ([`matrix`]); after each
//! stage, rounds of disjoint pairs are run until its one rule judges every bad pair: a node
//! alone, a pair, or (only when no pair that could tell is left) too few nodes to tell. Slow:
//! busbw under `--slow-factor` of a round's median, or (`--probe net`, whose links judge it
//! instead of its busbw) a link of the group's ring, measured alone, far under the median of
//! every link measured so far.
//!
//! Probes: the NCCL preflight (default), `--probe net` (TCP ring, no GPU), or `--probe cmd`
//! (the user's own command, which must exit 0 within `--timeout`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::plan::{BisectSettings, NodesPlan};
use crate::protocol::{RunResult, Step, StepResult, THIS_NRUN};
use crate::report::schema::{BisectGroup, BisectNode, BisectRound};
use crate::session::spec::{Group, Launch};
use crate::session::{Policy, Session};
use nrun_base::error::{Error, Result, exit};
use nrun_cli::Probe;
use nrun_preflight::{self as preflight, Settings, Verdict};
use nrun_store::Store;

mod matrix;

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
    /// As the report holds it.
    fn report(&self) -> BisectNode {
        BisectNode {
            host: self.host.clone(),
            verdict: self.verdict.name(),
            evidence: self.evidence.clone(),
        }
    }

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

impl Round {
    /// As the report holds it.
    fn report(&self) -> BisectRound {
        BisectRound {
            stage: self.stage.clone(),
            groups: self
                .groups
                .iter()
                .map(|g| BisectGroup {
                    hosts: g.hosts.clone(),
                    ok: Some(g.ok),
                    busbw_gbs: g.busbw_gbs,
                    evidence: g.evidence.clone(),
                    slow_link: g.slow_link.clone(),
                })
                .collect(),
        }
    }
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
    /// The ring's links that cross between nodes, measured alone.
    #[serde(skip)]
    links: Vec<NodeLink>,
    #[serde(skip)]
    members: Vec<usize>,
}

/// A ring link between two nodes of a group, measured alone (the net probe).
#[derive(Clone, Debug)]
struct NodeLink {
    /// The nodes (the session's index) the link leaves and enters.
    from: usize,
    to: usize,
    gbs: f64,
    /// The speed of the sender's NIC in GB/s, where it says.
    nic: Option<f64>,
    /// Far under the links measured so far: the words that say so.
    slow: Option<String>,
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
        matrix: matrix::Matrix::default(),
        median: None,
        links_seen: Vec::new(),
        control: serde_json::Value::Null,
    };
    let outcome = b.stages(&mut s).await;
    // Where each node's agent reached this host, and why that address (--report).
    b.control = serde_json::to_value(s.control_report()).unwrap_or_default();
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
        matrix: matrix::Matrix::default(),
        median: None,
        links_seen: Vec::new(),
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
    /// What pairs did together, and the judge over it.
    matrix: matrix::Matrix,
    /// The last median busbw of a round of several groups.
    median: Option<f64>,
    /// Every link between nodes measured so far (GB/s): a round of one pair judges its links
    /// against these, not against each other alone.
    links_seen: Vec<f64>,
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

    /// Stage 1 (every node alone), then pairs, groups of 4, ... all; after each stage, what
    /// failed or ran slow is taken apart in pairs until the matrix ([`matrix`]) judges it.
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
            let outs = self.round(&label, groups, s).await?;
            self.median = median_busbw(&outs).or(self.median);
            for g in &outs {
                self.record(g);
            }
            self.settle(s).await?;
            // One group was all of them (a leftover joins the last group, so this can come
            // before size reaches their count): a larger size would run the same group again.
            if groups_len == 1 || size >= alive.len() {
                break;
            }
            size *= 2;
        }
        Ok(())
    }

    /// Adds what group `g` did to the matrix: a pair's run; a larger group that passed clears
    /// its nodes; a larger group's ring links between nodes (the net probe) are runs of those
    /// pairs, and clear the nodes whose links in and out were good; a larger group that failed
    /// or ran slow with no link to show makes its nodes suspects, tried in pairs. Slow busbw is
    /// judged against the last median of several groups (a round of one group has none).
    fn record(&mut self, g: &GroupOut) {
        let median = self.median;
        let slow = self.is_slow(g, median);
        let run = match (g.ok, slow) {
            (false, _) => matrix::Run::Fails(g.evidence.clone()),
            (true, true) => matrix::Run::Slow(
                g.slow_link
                    .clone()
                    .or_else(|| {
                        let (b, m) = (g.busbw_gbs?, median?);
                        Some(format!(
                            "busbw {b:.3} GB/s, under {} x the median group's {m:.3}",
                            self.bp.slow_factor
                        ))
                    })
                    .unwrap_or_default(),
            ),
            (true, false) => matrix::Run::Good,
        };
        match g.members.as_slice() {
            [] | [_] => {}
            [a, b] => self.matrix.record(*a, *b, run),
            members if run == matrix::Run::Good => {
                members.iter().for_each(|&n| self.matrix.clear(n));
            }
            members => {
                let slow_links: Vec<&NodeLink> =
                    g.links.iter().filter(|l| l.slow.is_some()).collect();
                if !g.ok || slow_links.is_empty() {
                    members.iter().for_each(|&n| self.matrix.suspect(n));
                    return;
                }
                for l in &slow_links {
                    let e = l.slow.clone().unwrap_or_default();
                    self.matrix.record(l.from, l.to, matrix::Run::Slow(e));
                }
                // A node whose links in and out of the ring were good passed.
                for &n in members {
                    let mine: Vec<&NodeLink> = g
                        .links
                        .iter()
                        .filter(|l| l.from == n || l.to == n)
                        .collect();
                    if mine.len() >= 2 && mine.iter().all(|l| l.slow.is_none()) {
                        self.matrix.clear(n);
                    }
                }
            }
        }
    }

    /// Runs the pairs the matrix asks for, a round at a time, until it has nothing left to
    /// try; then marks what it judged.
    async fn settle(&mut self, s: &mut Session) -> Result<()> {
        loop {
            let alive = self.alive();
            let next = self.matrix.next_round(&alive);
            if next.is_empty() {
                break;
            }
            let groups: Vec<Vec<usize>> = next.iter().map(|p| p.to_vec()).collect();
            let outs = self.round("isolate: pairs", groups, s).await?;
            self.median = median_busbw(&outs).or(self.median);
            for g in &outs {
                self.record(g);
            }
        }
        let alive = self.alive();
        let names: Vec<String> = s.nodes.iter().map(|n| n.label.clone()).collect();
        for j in self.matrix.judge(&alive, &names) {
            self.mark(j.node, j.verdict, j.evidence);
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

    /// With a slow link; where no link between nodes was measured (the NCCL and command
    /// probes), under --slow-factor of the stage's median busbw. A ring's links measured alone
    /// judge it without its busbw: under two CPU hogs every pair of 4 nodes ran near 0.2 GB/s
    /// and a healthy one at 0.151, under 0.8 x the median 0.201, over links that measured
    /// healthy; a shaped link measures a hundredth of its peers.
    fn is_slow(&self, g: &GroupOut, median: Option<f64>) -> bool {
        group_slow(g, median, self.bp.slow_factor)
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
            .await?
            .results;
        p.finish(None);
        let mut outs: Vec<GroupOut> = groups
            .iter()
            .enumerate()
            .map(|(gi, g)| self.evaluate(g, &stores[gi], &results, s, &settings))
            .collect();
        slow_links(&mut outs, &mut self.links_seen, &|i| {
            s.nodes[i].label.clone()
        });
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
            // Ranks to nodes by the group's layout (not by the hostnames the ranks report).
            let node_of = |r: usize| {
                group
                    .members
                    .iter()
                    .find(|m| m.ranks.iter().any(|&(x, _)| x == r))
                    .map(|m| m.node)
            };
            links = outcome
                .rank_links()
                .into_iter()
                .filter_map(|(from, to, gbs, nic)| {
                    let (from, to) = (node_of(from)?, node_of(to)?);
                    (from != to).then_some(NodeLink {
                        from,
                        to,
                        gbs,
                        nic,
                        slow: None,
                    })
                })
                .collect();
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
        let v = crate::report::schema::Report::Bisect(crate::report::schema::BisectReport {
            nodes: self.results.iter().map(NodeResult::report).collect(),
            rounds: self.rounds.iter().map(Round::report).collect(),
            rounds_after_stage1: after,
            seconds: Some(took.as_secs_f64()),
            control: Some(self.control.clone()),
        });
        if let Some(path) = &self.bp.report {
            crate::report::said(crate::report::write_json("--report", path, &v));
        }
        if let Some(path) = &self.bp.report_html {
            crate::report::said(crate::report::html::write(
                "--report-html",
                path,
                v,
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

/// Marks each link far under the median of every link measured so far (`seen`, this round's
/// added; the preflight's rule, [`preflight::far_under_peers`]), and each group by its slowest
/// such link: one median over many links, not each ring's own, as on a busy host a healthy
/// link measures many times under another (veth links of one round: 1.1 and 17 GB/s), while a
/// shaped or failing one is tens of times under; and a round of one pair has only two.
fn slow_links(outs: &mut [GroupOut], seen: &mut Vec<f64>, name: &dyn Fn(usize) -> String) {
    seen.extend(outs.iter().flat_map(|g| g.links.iter().map(|l| l.gbs)));
    if seen.len() < 2 {
        return;
    }
    let median = preflight::median(seen.clone());
    for g in outs.iter_mut().filter(|g| g.ok) {
        for l in g.links.iter_mut() {
            if preflight::far_under_peers(l.gbs, median, l.nic) {
                l.slow = Some(format!(
                    "the link from {} to {} carried {:.3} GB/s, {:.0}% of the median link \
                     ({median:.2} GB/s)",
                    name(l.from),
                    name(l.to),
                    l.gbs,
                    100.0 * l.gbs / median
                ));
            }
        }
        g.slow_link = g
            .links
            .iter()
            .filter(|l| l.slow.is_some())
            .min_by(|a, b| a.gbs.total_cmp(&b.gbs))
            .and_then(|l| l.slow.clone());
    }
}

/// [`Bisect::is_slow`] with `factor` for --slow-factor.
fn group_slow(g: &GroupOut, median: Option<f64>, factor: f64) -> bool {
    g.slow_link.is_some()
        || (g.links.is_empty()
            && matches!((g.busbw_gbs, median), (Some(b), Some(m)) if b < factor * m))
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

    fn group(links: &[(usize, usize, f64)], nic: Option<f64>) -> GroupOut {
        GroupOut {
            hosts: Vec::new(),
            ok: true,
            busbw_gbs: Some(0.1),
            evidence: String::new(),
            slow_link: None,
            links: links
                .iter()
                .map(|&(from, to, gbs)| NodeLink {
                    from,
                    to,
                    gbs,
                    nic,
                    slow: None,
                })
                .collect(),
            members: Vec::new(),
        }
    }

    fn name(i: usize) -> String {
        format!("h{i}")
    }

    #[test]
    fn a_group_whose_links_were_measured_is_judged_by_them_not_its_busbw() {
        // The load flake: a healthy pair at 0.151 GB/s under 0.8 x the median group's 0.201,
        // over links that measured healthy.
        let mut healthy = vec![group(&[(1, 3, 1.9), (3, 1, 2.4)], Some(1.25))];
        healthy[0].busbw_gbs = Some(0.151);
        super::slow_links(&mut healthy, &mut vec![2.0, 2.2, 0.01], &name);
        assert!(!group_slow(&healthy[0], Some(0.201), 0.8));
        // The shaped pair of the same round: its link is slow whatever its busbw.
        let mut shaped = vec![group(&[(1, 2, 0.012), (2, 1, 2.1)], Some(1.25))];
        super::slow_links(&mut shaped, &mut vec![2.0, 2.2, 1.9], &name);
        assert!(group_slow(&shaped[0], Some(0.201), 0.8));
        // No links measured (the NCCL or command probe): busbw against the median decides.
        let mut nccl = group(&[], None);
        nccl.busbw_gbs = Some(0.151);
        assert!(group_slow(&nccl, Some(0.201), 0.8));
        nccl.busbw_gbs = Some(0.19);
        assert!(!group_slow(&nccl, Some(0.201), 0.8));
    }

    #[test]
    fn a_link_far_under_the_links_so_far_and_its_nic_makes_its_group_slow() {
        // The CI round: a shaped link (200 Mbit/s) among healthy veth links of a loaded host.
        let mut outs = vec![
            group(&[(1, 2, 0.88), (2, 1, 1.24)], Some(1.25)),
            group(&[(3, 4, 0.024), (4, 5, 2.69), (5, 3, 1.1)], Some(1.25)),
        ];
        let mut seen = Vec::new();
        super::slow_links(&mut outs, &mut seen, &name);
        assert_eq!(outs[0].slow_link, None);
        let slow = outs[1].slow_link.as_deref().unwrap_or_default();
        assert!(
            slow.starts_with(
                "the link from h3 to h4 carried 0.024 GB/s, 2% of the median link (1.10 GB/s)"
            ),
            "{slow}"
        );
        // A later round of the shaped pair alone is judged against every link so far.
        let mut alone = vec![group(&[(3, 4, 0.02), (4, 3, 0.03)], Some(1.25))];
        super::slow_links(&mut alone, &mut seen, &name);
        assert!(
            alone[0].links.iter().all(|l| l.slow.is_some()),
            "{:?}",
            alone[0].links
        );
        // Healthy links a loaded host measured 15x apart: the slowest is over a tenth of its NIC.
        let mut busy = vec![
            group(&[(1, 2, 1.136), (2, 1, 17.08)], Some(1.25)),
            group(&[(3, 4, 10.44), (4, 3, 12.0)], Some(1.25)),
        ];
        super::slow_links(&mut busy, &mut Vec::new(), &name);
        assert!(busy.iter().all(|g| g.slow_link.is_none()));
        // Where no NIC says its speed, the median alone decides.
        let mut unknown = vec![group(&[(1, 2, 0.05), (2, 1, 1.0), (1, 3, 1.1)], None)];
        super::slow_links(&mut unknown, &mut Vec::new(), &name);
        assert!(unknown[0].slow_link.is_some());
    }
}
