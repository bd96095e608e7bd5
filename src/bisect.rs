//! `nrun bisect`: the staged scale-up that finds the node or link that breaks a multi-node job.
//!
//! Stage 0: every host joins (an unreachable one is named with ssh's error) and reports its
//! facts; a node whose NCCL (major.minor) or torch differs from the majority is bad. Stage 1:
//! every node alone, all at once. Then disjoint pairs, groups of 4, 8, ... up to all nodes; the
//! groups of a stage run at the same time, each with a store (and so a key space and a
//! communicator) of its own. A failing or slow group is isolated: a pair's members are re-paired
//! with nodes that already passed (a node that fails with every partner is bad; a pair whose
//! members pass elsewhere has a bad link); a larger group's halves are re-tested, then its
//! cross pairs. Slow: busbw under `--slow-factor` of the stage's median.
//!
//! Probes: the NCCL preflight (default), `--probe net` (TCP ring, no GPU), or `--probe cmd`
//! (the user's own command, which must exit 0 within `--timeout`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::agent::{RunResult, Step, StepResult, WorkerSpec};
use crate::cluster::{self, ClusterPlan, Node};
use crate::error::{Error, Result, exit};
use crate::node::Signals;
use crate::plan::Plan;
use crate::preflight::{self, Mode, Verdict};
use crate::store::{self, Store};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    Nccl,
    Net,
    Cmd,
}

#[derive(Clone, Debug)]
pub struct BisectPlan {
    pub probe: Probe,
    pub slow_factor: f64,
    pub timeout: Duration,
    pub write_hostfile: Option<PathBuf>,
    pub report: Option<PathBuf>,
    /// The hostfile's text, to write the good hosts back in the input's own format.
    pub hostfile_text: Option<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NodeVerdict {
    Good,
    Bad,
    Slow,
    Unreachable,
    /// Fails only together with some node: a link or pair problem.
    Link,
}

#[derive(Clone, Debug, Serialize)]
struct NodeResult {
    host: String,
    verdict: NodeVerdict,
    evidence: Vec<String>,
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
    #[serde(skip)]
    members: Vec<usize>,
}

/// Entry point: runs the stages, prints the table, writes the report and hostfile.
pub async fn run(
    plan: &Plan,
    cp: &ClusterPlan,
    bp: &BisectPlan,
    listener: std::net::TcpListener,
) -> Result<u8> {
    let started = Instant::now();
    let mut signals = Signals::install()?;
    crate::node::process::become_subreaper();
    let secret = cluster::random_secret();
    let run_id = format!("{}-{}", plan.run_id, std::process::id());
    let port = listener
        .local_addr()
        .map_err(|e| Error::internal(e.to_string()))?
        .port();
    let main_store = Store::with_secret(secret.clone().into_bytes());
    let l =
        tokio::net::TcpListener::from_std(listener).map_err(|e| Error::internal(e.to_string()))?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let served = main_store.clone();
    tokio::spawn(async move {
        store::server::serve(l, served, async {
            let _ = stop_rx.await;
        })
        .await
    });
    let addrs: Vec<String> = crate::net::reachable_addrs(&crate::net::interfaces())
        .into_iter()
        .map(|ip| SocketAddr::new(ip, port).to_string())
        .collect();
    let cwd = std::env::current_dir()
        .map_err(|e| Error::usage(format!("cannot read the current directory: {e}")))?;
    let mut nodes = cluster::start_agents(plan, cp, &secret, &run_id, &addrs, &cwd).await?;

    let mut b = Bisect {
        plan,
        cp,
        bp,
        store: main_store.clone(),
        run_id: run_id.clone(),
        step: 0,
        results: nodes
            .iter()
            .map(|n| NodeResult {
                host: n.label.clone(),
                verdict: NodeVerdict::Good,
                evidence: Vec::new(),
            })
            .collect(),
        rounds: Vec::new(),
        stage1_rounds: 0,
    };
    let outcome = b.stages(&mut nodes, &mut signals).await;
    for i in 0..nodes.len() {
        cluster::set_step(&main_store, &run_id, i, b.step, &Step::End);
    }
    cluster::end_agents(&mut nodes).await;
    let _ = stop_tx.send(());
    if let Err(code) = outcome {
        return Ok(code);
    }
    b.finish(started.elapsed())
}

struct Bisect<'a> {
    plan: &'a Plan,
    cp: &'a ClusterPlan,
    bp: &'a BisectPlan,
    store: Arc<Store>,
    run_id: String,
    step: usize,
    results: Vec<NodeResult>,
    rounds: Vec<Round>,
    /// Rounds up to and including stage 1 (the efficiency target counts those after it).
    stage1_rounds: usize,
}

impl Bisect<'_> {
    async fn stages(
        &mut self,
        nodes: &mut [Node],
        signals: &mut Signals,
    ) -> std::result::Result<(), u8> {
        // ---- stage 0: reachability and facts --------------------------------------------
        let failures = cluster::join(self.cp, &self.store, &self.run_id, nodes, signals).await?;
        for (i, msg) in failures {
            self.mark(i, NodeVerdict::Unreachable, msg);
        }
        let (problems, _) = cluster::assign_interfaces(self.cp, &self.store, &self.run_id, nodes)
            .map_err(|e| e.code)?;
        for p in problems {
            eprintln!("nrun bisect: {p}");
        }
        self.facts_stage(nodes);
        eprintln!(
            "nrun bisect: stage 0: {} of {} hosts reachable and consistent",
            self.alive().len(),
            nodes.len()
        );

        // ---- stage 1: every node alone ----------------------------------------------------
        let singles: Vec<Vec<usize>> = self.alive().into_iter().map(|i| vec![i]).collect();
        let outs = self
            .round("stage 1: every node alone", singles, nodes, signals)
            .await?;
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
            let outs = self.round(&label, groups, nodes, signals).await?;
            let median = median_busbw(&outs);
            let mut suspects: Vec<GroupOut> = Vec::new();
            for g in outs {
                let slow = matches!((g.busbw_gbs, median), (Some(b), Some(m)) if b < self.bp.slow_factor * m);
                if !g.ok || slow {
                    suspects.push(GroupOut {
                        ok: g.ok && !slow,
                        ..g
                    });
                }
            }
            for g in suspects {
                self.isolate(g, median, nodes, signals).await?;
            }
            if size >= alive.len() {
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
    fn facts_stage(&mut self, nodes: &[Node]) {
        let sig = |n: &Node| {
            n.joined.as_ref().map(|j| {
                let nccl = j
                    .facts
                    .nccl
                    .first()
                    .and_then(|l| l.version.clone())
                    .map(|v| v.split('.').take(2).collect::<Vec<_>>().join("."));
                (nccl, j.facts.torch.clone())
            })
        };
        let mut counts: BTreeMap<(Option<String>, Option<String>), usize> = BTreeMap::new();
        for n in nodes {
            if let Some(s) = sig(n) {
                *counts.entry(s).or_default() += 1;
            }
        }
        let Some((majority, _)) = counts
            .iter()
            .max_by_key(|(_, c)| **c)
            .map(|(k, c)| (k.clone(), *c))
        else {
            return;
        };
        for (i, n) in nodes.iter().enumerate() {
            if let Some(s) = sig(n) {
                if s != majority {
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
                            show(&s),
                            show(&majority)
                        ),
                    );
                }
            }
        }
    }

    fn slow_check(&mut self, outs: &[GroupOut], how: &str) {
        let Some(m) = median_busbw(outs) else { return };
        for g in outs {
            if let Some(b) = g.busbw_gbs {
                if g.ok && b < self.bp.slow_factor * m {
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
    }

    /// Narrows a failing or slow group down to nodes or links, re-testing with known-good nodes.
    async fn isolate(
        &mut self,
        g: GroupOut,
        median: Option<f64>,
        nodes: &mut [Node],
        signals: &mut Signals,
    ) -> std::result::Result<(), u8> {
        let what = if g.ok { "slow" } else { "fails" };
        if g.members.len() > 2 {
            // Halves first; then, if both halves pass, the pairs across them.
            let (a, b) = g.members.split_at(g.members.len() / 2);
            let outs = self
                .round(
                    &format!("isolate: halves of {}", names(&g.members, nodes)),
                    vec![a.to_vec(), b.to_vec()],
                    nodes,
                    signals,
                )
                .await?;
            let mut any_bad = false;
            for h in outs {
                if !h.ok || self.is_slow(&h, median) {
                    any_bad = true;
                    Box::pin(self.isolate(h, median, nodes, signals)).await?;
                }
            }
            if !any_bad {
                let pairs: Vec<Vec<usize>> = a.iter().zip(b).map(|(x, y)| vec![*x, *y]).collect();
                let outs = self
                    .round("isolate: cross pairs", pairs, nodes, signals)
                    .await?;
                for p in outs {
                    if !p.ok || self.is_slow(&p, median) {
                        Box::pin(self.isolate(p, median, nodes, signals)).await?;
                    }
                }
            }
            return Ok(());
        }
        if g.members.len() < 2 {
            return Ok(());
        }
        // A pair: re-pair each member with a different node that already passed.
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
                        nodes[if i == x { y } else { x }].label
                    ),
                );
            }
            return Ok(());
        }
        let outs = self
            .round(
                &format!("isolate: re-pair {} and {}", nodes[x].label, nodes[y].label),
                vec![vec![x, good[0]], vec![y, good[1]]],
                nodes,
                signals,
            )
            .await?;
        let why = if g.evidence.is_empty() {
            String::new()
        } else {
            format!(" ({})", g.evidence)
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
        let (jx, jy) = (judge(&outs[0]), judge(&outs[1]));
        let again = |o: &GroupOut| match o.busbw_gbs {
            Some(b) if o.ok => format!("{b:.3} GB/s"),
            _ if !o.evidence.is_empty() => o.evidence.clone(),
            _ => "failed".into(),
        };
        match (jx, jy) {
            (Some(v), None) => self.mark(
                x,
                v,
                format!(
                    "{what} with {}, and again with {} ({}), who pass elsewhere",
                    nodes[y].label,
                    nodes[good[0]].label,
                    again(&outs[0])
                ),
            ),
            (None, Some(v)) => self.mark(
                y,
                v,
                format!(
                    "{what} with {}, and again with {} ({}), who pass elsewhere",
                    nodes[x].label,
                    nodes[good[1]].label,
                    again(&outs[1])
                ),
            ),
            (Some(vx), Some(vy)) => {
                self.mark(
                    x,
                    vx,
                    format!(
                        "{what} with {}, and again with {} ({})",
                        nodes[y].label,
                        nodes[good[0]].label,
                        again(&outs[0])
                    ),
                );
                self.mark(
                    y,
                    vy,
                    format!(
                        "{what} with {}, and again with {} ({})",
                        nodes[x].label,
                        nodes[good[1]].label,
                        again(&outs[1])
                    ),
                );
            }
            (None, None) => {
                // Both pass with other partners: a link problem, or a measurement disturbed by
                // the rest of the stage. The pair alone, once more, tells them apart.
                let again = self
                    .round(
                        &format!("isolate: {} and {} again", nodes[x].label, nodes[y].label),
                        vec![vec![x, y]],
                        nodes,
                        signals,
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
                        nodes[y].label, nodes[good[0]].label
                    ),
                );
                self.mark(
                    y,
                    NodeVerdict::Link,
                    format!(
                        "{what} only with {} (link or pair problem); passes with {}",
                        nodes[x].label, nodes[good[1]].label
                    ),
                );
            }
        }
        Ok(())
    }

    /// Under --slow-factor of the stage's median busbw.
    fn is_slow(&self, g: &GroupOut, median: Option<f64>) -> bool {
        matches!((g.busbw_gbs, median), (Some(b), Some(m)) if b < self.bp.slow_factor * m)
    }

    /// Runs one round: every group at once, each with its own store. Nodes not in a group idle.
    async fn round(
        &mut self,
        stage: &str,
        groups: Vec<Vec<usize>>,
        nodes: &mut [Node],
        signals: &mut Signals,
    ) -> std::result::Result<Vec<GroupOut>, u8> {
        let step = self.step;
        self.step += 1;
        let world_of = |g: &Vec<usize>| g.iter().map(|i| self.cp.layout[*i].len()).sum::<usize>();
        let mut stores = Vec::new();
        let mut stops = Vec::new();
        for g in &groups {
            let l = store::server::bind(0).map_err(|_| exit::INTERNAL)?;
            let gport = l.local_addr().map_err(|_| exit::INTERNAL)?.port();
            let l = tokio::net::TcpListener::from_std(l).map_err(|_| exit::INTERNAL)?;
            let st = Store::new();
            let served = st.clone();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(async move {
                store::server::serve(l, served, async {
                    let _ = rx.await;
                })
                .await
            });
            stops.push(tx);
            let world = world_of(g);
            let mut rank0 = 0;
            for (gi, &node) in g.iter().enumerate() {
                let specs = self.specs(node, gi, g.len(), rank0, world, gport, nodes);
                rank0 += specs.len();
                let deadline_ms = Some(self.bp.timeout.as_millis() as u64);
                cluster::set_step(
                    &self.store,
                    &self.run_id,
                    node,
                    step,
                    &Step::Run {
                        workers: specs,
                        grace_ms: 2000,
                        deadline_ms,
                    },
                );
            }
            stores.push(st);
        }
        // Joined nodes outside every group idle through this step.
        let busy: Vec<usize> = groups.iter().flatten().copied().collect();
        let idle: Vec<usize> = (0..nodes.len())
            .filter(|i| nodes[*i].joined.is_some() && !busy.contains(i))
            .collect();
        for &i in &idle {
            cluster::set_step(
                &self.store,
                &self.run_id,
                i,
                step,
                &Step::Run {
                    workers: Vec::new(),
                    grace_ms: 0,
                    deadline_ms: None,
                },
            );
        }
        let wait: Vec<usize> = busy.iter().chain(idle.iter()).copied().collect();
        let results = self.collect(&wait, step, nodes, signals).await?;
        let mut outs = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            let out = self.evaluate(g, &stores[gi], &results, nodes);
            eprintln!(
                "nrun bisect: {stage}: {} {}{}",
                names(g, nodes),
                if out.ok { "ok" } else { "FAILED" },
                out.busbw_gbs
                    .map_or(String::new(), |b| format!(" ({b:.2} GB/s)"))
            );
            outs.push(out);
        }
        for s in stops {
            let _ = s.send(());
        }
        self.rounds.push(Round {
            stage: stage.to_string(),
            groups: outs.clone(),
        });
        Ok(outs)
    }

    /// Settings of the preflight ranks on node `n` (probes nccl and net).
    fn settings(&self, n: &Node) -> Option<preflight::Settings> {
        let pf = self.plan.preflight.as_ref()?;
        let lib = pf.nccl_lib.clone().or_else(|| {
            n.joined
                .as_ref()
                .and_then(|j| j.facts.nccl.first())
                .map(|l| PathBuf::from(&l.path))
        });
        let listen = n.addr.map_or_else(|| "0.0.0.0".into(), |a| a.to_string());
        Some(preflight::Settings::new(pf, "bisect".into(), lib, listen))
    }

    /// Node `node`'s workers as the `group_rank`-th node of a group of `group_size` nodes and
    /// `world` ranks whose store listens on `port`, its ranks starting at `rank0`.
    #[allow(clippy::too_many_arguments)]
    fn specs(
        &self,
        node: usize,
        group_rank: usize,
        group_size: usize,
        rank0: usize,
        world: usize,
        port: u16,
        nodes: &[Node],
    ) -> Vec<WorkerSpec> {
        let n = &nodes[node];
        let ranks: Vec<(usize, usize)> = self.cp.layout[node]
            .iter()
            .enumerate()
            .map(|(k, &(_, local, _))| (rank0 + k, local))
            .collect();
        let (program, args, extra) = match (self.bp.probe, self.settings(n)) {
            (Probe::Nccl | Probe::Net, Some(s)) => (
                self.cp.remote_nrun.clone(),
                vec!["__preflight".to_string()],
                s.rank_env(false, None),
            ),
            _ => (
                self.plan.program.to_string_lossy().into_owned(),
                self.plan
                    .args
                    .iter()
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect(),
                Vec::new(),
            ),
        };
        let scratch = format!("bisect{}-node{node}", self.step);
        let l = cluster::Launch {
            world,
            nnodes: group_size,
            port,
            attempt: 0,
            program: &program,
            args: &args,
            logs: false,
            scratch: &scratch,
        };
        cluster::node_specs(self.plan, self.cp, n, group_rank, &ranks, &l, &extra)
    }

    async fn collect(
        &self,
        wait: &[usize],
        step: usize,
        nodes: &mut [Node],
        signals: &mut Signals,
    ) -> std::result::Result<BTreeMap<usize, StepResult>, u8> {
        let mut got = BTreeMap::new();
        let deadline = Instant::now() + self.bp.timeout + Duration::from_secs(30);
        loop {
            for &i in wait {
                if got.contains_key(&i) {
                    continue;
                }
                if let Some(raw) = self.store.get(&crate::agent::key(
                    &self.run_id,
                    &format!("n{i}/result/{step}"),
                )) {
                    if let Ok(r) = serde_json::from_slice::<StepResult>(&raw) {
                        got.insert(i, r);
                    }
                } else if nodes[i]
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten())
                    .is_some()
                {
                    got.insert(
                        i,
                        StepResult::Run(RunResult::Lost(format!(
                            "lost the connection to {}",
                            nodes[i].label
                        ))),
                    );
                }
            }
            if got.len() == wait.len() || Instant::now() > deadline {
                return Ok(got);
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(2)) => {}
                sig = signals.recv() => return Err(exit::signal(sig)),
            }
        }
    }

    fn evaluate(
        &self,
        g: &[usize],
        st: &Store,
        results: &BTreeMap<usize, StepResult>,
        nodes: &[Node],
    ) -> GroupOut {
        let hosts: Vec<String> = g.iter().map(|i| nodes[*i].label.clone()).collect();
        let mut failure = None;
        for &i in g {
            match results.get(&i) {
                Some(StepResult::Run(RunResult::Success)) => {}
                Some(StepResult::Run(RunResult::Failed {
                    rank,
                    how,
                    stderr_tail,
                    ..
                })) => {
                    failure.get_or_insert(format!(
                        "rank {rank} on {} {how}{}",
                        nodes[i].label,
                        stderr_tail
                            .last()
                            .map_or(String::new(), |l| format!(": {l}"))
                    ));
                }
                Some(StepResult::Run(RunResult::TimedOut)) => {
                    failure.get_or_insert(format!(
                        "{} ran past --timeout {} s",
                        nodes[i].label,
                        self.bp.timeout.as_secs()
                    ));
                }
                Some(StepResult::Run(RunResult::Lost(m) | RunResult::SpawnError(m))) => {
                    failure.get_or_insert(m.clone());
                }
                Some(other) => {
                    failure.get_or_insert(format!("{}: {other:?}", nodes[i].label));
                }
                None => {
                    failure.get_or_insert(format!("{} did not report in time", nodes[i].label));
                }
            }
        }
        let mut busbw = None;
        if self.bp.probe != Probe::Cmd {
            let world: usize = g.iter().map(|i| self.cp.layout[*i].len()).sum();
            let mut ranks = Vec::new();
            for &i in g {
                for _ in &self.cp.layout[i] {
                    ranks.push((ranks.len(), nodes[i].label.clone()));
                }
            }
            let (reports, silent) = match self.settings(&nodes[g[0]]) {
                Some(s) => preflight::reports_from(&s, &ranks, &mut |k| st.get(k)),
                None => Default::default(),
            };
            let summary = preflight::Outcome {
                world_size: world,
                mode: if self.bp.probe == Probe::Net {
                    Mode::Net
                } else {
                    Mode::Nccl
                },
                reports,
                silent,
                crashed: None,
                nccl_lib: None,
                min_busbw: None,
                wall_s: 0.0,
                other_libs: Vec::new(),
            }
            .summarize();
            if summary.verdict != Verdict::Ok {
                let problem = summary.json["problems"]
                    .as_array()
                    .and_then(|a| a.first())
                    .and_then(|p| p.as_str())
                    .unwrap_or("preflight failed")
                    .to_string();
                failure.get_or_insert(problem);
            }
            // The busbw at the largest size, for the slow checks (alone: the algbw, as busbw is 0
            // for one rank).
            busbw = summary.json["rows"]
                .as_array()
                .and_then(|rows| rows.last())
                .and_then(|r| {
                    let o = &r["out_of_place"];
                    if world > 1 {
                        o["busbw_gbs"].as_f64()
                    } else {
                        o["algbw_gbs"].as_f64()
                    }
                });
        }
        GroupOut {
            hosts,
            ok: failure.is_none(),
            busbw_gbs: busbw,
            evidence: failure.unwrap_or_default(),
            members: g.to_vec(),
        }
    }

    fn finish(&self, took: Duration) -> Result<u8> {
        let width = self
            .results
            .iter()
            .map(|r| r.host.len())
            .max()
            .unwrap_or(4)
            .max(4);
        println!("{:<width$}  {:<11}  evidence", "node", "verdict");
        for r in &self.results {
            let v = format!("{:?}", r.verdict).to_lowercase();
            println!(
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
        println!(
            "{} rounds ({after} after stage 1) in {:.1} s",
            self.rounds.len(),
            took.as_secs_f64()
        );
        if let Some(path) = &self.bp.report {
            let v = serde_json::json!({ "nodes": self.results, "rounds": self.rounds, "rounds_after_stage1": after, "seconds": took.as_secs_f64() });
            crate::coordinator::write_report(path, &v)?;
        }
        if let Some(path) = &self.bp.write_hostfile {
            let good: Vec<&str> = self
                .results
                .iter()
                .filter(|r| r.verdict == NodeVerdict::Good)
                .map(|r| r.host.as_str())
                .collect();
            let text = match &self.bp.hostfile_text {
                // Keep the input's own lines (format, slots, comments) for the good hosts.
                Some(t) => t
                    .lines()
                    .filter(|l| {
                        let first = l
                            .split('#')
                            .next()
                            .unwrap_or("")
                            .split_whitespace()
                            .next()
                            .unwrap_or("");
                        let host = first.split(':').next().unwrap_or("");
                        host.is_empty() || good.contains(&host)
                    })
                    .map(|l| format!("{l}\n"))
                    .collect::<String>(),
                None => good.iter().map(|h| format!("{h}\n")).collect(),
            };
            std::fs::write(path, text).map_err(|e| {
                Error::usage(format!(
                    "cannot write --write-hostfile {}: {e}",
                    path.display()
                ))
            })?;
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

fn names(g: &[usize], nodes: &[Node]) -> String {
    g.iter()
        .map(|i| nodes[*i].label.as_str())
        .collect::<Vec<_>>()
        .join("+")
}

fn median_busbw(outs: &[GroupOut]) -> Option<f64> {
    let mut v: Vec<f64> = outs
        .iter()
        .filter(|g| g.ok)
        .filter_map(|g| g.busbw_gbs)
        .collect();
    if v.len() < 2 {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
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
}
