//! Which nodes the job runs on: the active ones (at most the plan's `size`, ranks numbered by
//! node order), the spares (joined, checked, running nothing), the nodes left out with the
//! evidence that put them out, and the suspicions against those that stay. One mechanism for
//! every reason a node leaves (it did not join, failed a check, was lost or failed in a way
//! pinned on it mid-run) and for every way one comes in (a spare, or an elastic job's late
//! joiner).
//!
//! [`Roster`] holds those states and their transitions; the session's methods here do what
//! goes with them (the events, the checks of a node taken in, the words at the job's end).

use std::time::SystemTime;

use super::Session;
use crate::fault;
use crate::journal::Event;
use crate::report::schema::{CameBackReport, LeftOutReport, NodesReport};
use nrun_base::error::{Error, Result};

/// The nodes' states in the job. A node is active, a spare (joined, neither active nor left
/// out), left out (with why), or none of those yet (not joined); an active node may also be
/// kept in on evidence against it, or suspected once (the fault model's [`fault::History`]).
#[derive(Default)]
pub(crate) struct Roster {
    /// The nodes the job runs on now, in node order once filled.
    active: Vec<usize>,
    /// Nodes taken out of the job, with the evidence, in the order they left.
    left_out: Vec<LeftOut>,
    /// Node-level evidence against nodes that stayed in, nothing being there to take their
    /// place (see [`crate::fault`]): remembered like the nodes left out at the end.
    kept: Vec<LeftOut>,
    /// Suspicions: a second one against a node is node-level evidence.
    suspicions: fault::History,
    /// Nodes lost mid-run whose agents are being started again (see [`super::again`]).
    returning: Vec<Returning>,
    /// The nodes lost whose agents were started again, once each (back, failed the checks, or
    /// still being tried).
    tried: Vec<usize>,
}

/// A node whose agent is being started again: the session's node `node` (a placeholder until
/// its agent joins) for node `was`, left out as lost.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Returning {
    pub node: usize,
    pub was: usize,
}

impl Roster {
    /// The nodes the job runs on now.
    pub(crate) fn active(&self) -> &[usize] {
        &self.active
    }

    pub(crate) fn is_active(&self, i: usize) -> bool {
        self.active.contains(&i)
    }

    /// The nodes left out so far, in the order they left.
    pub(crate) fn left_out(&self) -> &[LeftOut] {
        &self.left_out
    }

    pub(crate) fn is_left_out(&self, i: usize) -> bool {
        self.left_out.iter().any(|l| l.node == i)
    }

    /// How many nodes are out of the job now: those left out, less those that came back.
    pub(crate) fn out_now(&self) -> usize {
        self.left_out.iter().filter(|l| l.back.is_none()).count()
    }

    /// Whether node `i` is one whose agent is being started again (not joined yet).
    pub(crate) fn is_returning(&self, i: usize) -> bool {
        self.returning.iter().any(|r| r.node == i)
    }

    /// Whether node `was`, left out, had its agent started again already (one that came back
    /// as another node, or failed the checks then, is not tried again).
    pub(crate) fn retried(&self, was: usize) -> bool {
        self.tried.contains(&was)
    }

    /// Node `r.node` starts node `r.was`'s agent again.
    pub(crate) fn start_return(&mut self, r: Returning) {
        self.tried.push(r.was);
        self.returning.push(r);
    }

    /// Node `node`'s agent joined (or gave up): it is no longer being started; whose it was.
    pub(crate) fn end_return(&mut self, node: usize) -> Option<Returning> {
        let at = self.returning.iter().position(|r| r.node == node)?;
        Some(self.returning.remove(at))
    }

    /// Node `was`, left out as lost, came back as node `back.node` and passed the checks: it
    /// is no longer held against (not remembered, not reported as left out).
    pub(crate) fn came_back(&mut self, was: usize, back: Back) {
        if let Some(l) = self.left_out.iter_mut().find(|l| l.node == was) {
            l.back = Some(back);
        }
    }

    /// Of `nodes` nodes, those that joined (`joined`) and wait to take a place, in node order.
    fn spares(&self, nodes: usize, joined: impl Fn(usize) -> bool) -> Vec<usize> {
        (0..nodes)
            .filter(|&i| joined(i) && !self.is_active(i) && !self.is_left_out(i))
            .collect()
    }

    /// Takes `l.node` out of the job (and out of the active nodes). False: it was out already.
    fn leave_out(&mut self, l: LeftOut) -> bool {
        if self.is_left_out(l.node) {
            return false;
        }
        self.active.retain(|a| *a != l.node);
        self.left_out.push(l);
        true
    }

    /// Keeps `l.node` in on node-level evidence, remembered for the end (the first evidence
    /// stands; a node left out has its own).
    fn keep(&mut self, l: LeftOut) {
        if !self.is_left_out(l.node) && !self.kept.iter().any(|k| k.node == l.node) {
            self.kept.push(l);
        }
    }

    /// Node `i` takes a place in the job.
    fn take_in(&mut self, i: usize) {
        self.active.push(i);
    }

    /// The hosts whose places spares fill: the last nodes left out, as many as the job of
    /// `size` misses.
    fn gaps(&self, size: usize) -> Vec<String> {
        let missing = size.saturating_sub(self.active.len());
        let l: Vec<&LeftOut> = self.left_out.iter().filter(|l| l.back.is_none()).collect();
        l[l.len().saturating_sub(missing)..]
            .iter()
            .map(|x| x.host.clone())
            .collect()
    }

    /// At the job's end: the nodes kept in on evidence are listed with those left out.
    fn settle(&mut self) {
        for k in std::mem::take(&mut self.kept) {
            if !self.is_left_out(k.node) {
                self.left_out.push(k);
            }
        }
    }

    /// The nodes left out (not those that came back), as `--report` JSON.
    pub(crate) fn left_out_report(&self) -> Vec<LeftOutReport> {
        self.left_out
            .iter()
            .filter(|l| l.back.is_none())
            .map(|l| LeftOutReport {
                host: l.host.clone(),
                stage: l.stage.as_str().to_string(),
                evidence: l.evidence.as_str().to_string(),
                why: l.why.clone(),
                at: humantime::format_rfc3339_seconds(l.at).to_string(),
            })
            .collect()
    }

    /// The nodes lost mid-run that came back, as `--report` JSON.
    pub(crate) fn came_back_report(&self) -> Vec<CameBackReport> {
        self.left_out
            .iter()
            .filter_map(|l| {
                let b = l.back.as_ref()?;
                Some(CameBackReport {
                    host: l.host.clone(),
                    why: l.why.clone(),
                    lost_at: humantime::format_rfc3339_seconds(l.at).to_string(),
                    back_at: humantime::format_rfc3339_seconds(b.at).to_string(),
                    tries: b.tries,
                })
            })
            .collect()
    }

    /// A roster whose active nodes are `active` (the fake links' sessions).
    #[cfg(test)]
    pub(crate) fn of(active: Vec<usize>) -> Roster {
        Roster {
            active,
            ..Roster::default()
        }
    }
}

/// When a node was left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stage {
    /// It did not join (in time).
    Join,
    /// Its facts, interface or links failed the checks before the job.
    Check,
    /// The preflight named it bad or slow.
    Preflight,
    /// A failure was pinned on it while the job ran.
    Run,
    /// It was lost while the job ran (its agent or link gone): said as "run" too (when it left),
    /// but nothing is held against the node itself.
    Lost,
}

impl Stage {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Stage::Join => "join",
            Stage::Check => "check",
            Stage::Preflight => "preflight",
            Stage::Run | Stage::Lost => "run",
        }
    }
}

/// What kind of evidence left a node out: typed where it was seen, so that the summary, the
/// events, `--report` and `--exclude-file` tell the same story.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Evidence {
    /// Something seen: its link's own error (ssh's, srun's, its agent's), a check's or the
    /// preflight's finding, a fault of its workers, its loss.
    Seen,
    /// Nothing heard: it had not joined when the job ended and its link, given a moment more,
    /// still said nothing (ssh still connecting, or its agent still starting).
    Unheard,
    /// nrun was stopped (Ctrl-C, a signal) while the node was still joining: nothing is known
    /// against it, and nothing is remembered (--exclude-file).
    Interrupted,
}

impl Evidence {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Evidence::Seen => "seen",
            Evidence::Unheard => "unheard",
            Evidence::Interrupted => "interrupted",
        }
    }
}

/// A node left out, and why.
#[derive(Clone, Debug)]
pub(crate) struct LeftOut {
    pub node: usize,
    pub host: String,
    pub stage: Stage,
    /// What kind of evidence it is.
    pub evidence: Evidence,
    /// The evidence, in words.
    pub why: String,
    pub at: SystemTime,
    /// Lost, it came back (its agent started again, the checks passed).
    pub back: Option<Back>,
}

/// How a node lost mid-run came back.
#[derive(Clone, Debug)]
pub(crate) struct Back {
    pub at: SystemTime,
    /// Starts of its agent it took.
    pub tries: u32,
}

impl LeftOut {
    /// Whether the evidence is against the node itself (a failed check or preflight, a fault of
    /// its workers pinned on it), so that a node of its host that joins again within the job
    /// is refused. A node that never joined, or whose agent or link was lost, may come back:
    /// that is a fresh join, checked as any.
    pub(crate) fn bars_return(&self) -> bool {
        match self.stage {
            Stage::Join | Stage::Lost => false,
            Stage::Check | Stage::Preflight | Stage::Run => true,
        }
    }

    /// Whether it is worth remembering in --exclude-file: not a node nrun was stopped from
    /// waiting for, nor one that came back.
    pub(crate) fn remembered(&self) -> bool {
        self.evidence != Evidence::Interrupted && self.back.is_none()
    }
}

/// How long the job's end waits for the link of a node that has not joined to end by itself
/// and say why (ssh's own error: "No route to host" comes after a few seconds of ARP), before
/// the node is written down as unheard.
const LAST_WORDS: std::time::Duration = std::time::Duration::from_secs(5);

impl Session {
    /// Which nodes run the job, wait as spares, or were left out.
    pub(crate) fn roster(&self) -> &Roster {
        &self.roster
    }

    /// Nodes that joined and wait to take a left-out node's place, in node order.
    pub(crate) fn spares(&self) -> Vec<usize> {
        self.roster
            .spares(self.nodes.len(), |i| self.nodes[i].joined.is_some())
    }

    pub(crate) fn is_left_out(&self, i: usize) -> bool {
        self.roster.is_left_out(i)
    }

    /// The suspicions against the job's nodes, which the fault model reads and adds to.
    pub(crate) fn suspicions(&mut self) -> &mut fault::History {
        &mut self.roster.suspicions
    }

    /// Remembers node-level evidence against node `i`, which stays in the job (nothing can take
    /// its place): at the end it is listed and remembered (--exclude-file) with those left out.
    pub(crate) fn flag(&mut self, i: usize, why: &str) {
        let host = self.nodes[i].label.clone();
        self.roster.keep(LeftOut {
            node: i,
            host,
            stage: Stage::Run,
            evidence: Evidence::Seen,
            why: format!("{why} (kept in: nothing could take its place)"),
            at: SystemTime::now(),
            back: None,
        });
    }

    /// Takes node `i` out of the job for good, saying why (evidence seen).
    pub(crate) fn leave_out(&mut self, i: usize, stage: Stage, why: &str) {
        self.leave_out_for(i, stage, Evidence::Seen, why);
    }

    /// Takes node `i` out of the job for good on `evidence` of that kind, in words `why`.
    pub(crate) fn leave_out_for(&mut self, i: usize, stage: Stage, evidence: Evidence, why: &str) {
        if self.is_left_out(i) {
            return;
        }
        let host = self.nodes[i].label.clone();
        // The reason usually names the node already.
        let why = why
            .strip_prefix(&format!("{host}: "))
            .unwrap_or(why)
            .to_string();
        tracing::warn!("leaving out {host} ({}): {why}", stage.as_str());
        self.journal.emit(Event::NodeLeftOut {
            node: i,
            host: host.clone(),
            stage: stage.as_str().to_string(),
            evidence: evidence.as_str().to_string(),
            reason: why.clone(),
        });
        self.roster.leave_out(LeftOut {
            node: i,
            host,
            stage,
            evidence,
            why,
            at: SystemTime::now(),
            back: None,
        });
    }

    /// Brings the job back to its size: nodes that joined since are taken in (their interfaces
    /// decided), then spares take the empty places, in node order. Returns the nodes that came
    /// in. `Err`: fewer nodes than the job's minimum remain (exit 98, the left-out nodes named).
    pub(crate) fn fill(&mut self) -> Result<Vec<usize>> {
        let late = self.admit_late();
        self.check_late(&late);
        let mut came = Vec::new();
        // The places the spares fill.
        let gaps = self.roster.gaps(self.plan.size);
        let mut spared = 0;
        for i in self.spares() {
            if self.roster.active.len() >= self.plan.size {
                break;
            }
            // A spare that died while it waited is no spare.
            let n = &mut self.nodes[i];
            if let Some(why) = n.link.lost(&self.bus, i, &n.label, false) {
                // The first fill takes in the job's own nodes the same way: those are no spares.
                let when = match i >= self.plan.size {
                    true => "lost while a spare",
                    false => "lost before its first step",
                };
                self.leave_out(i, Stage::Lost, &format!("{when}: {why}"));
                continue;
            }
            self.roster.take_in(i);
            came.push(i);
            if i >= self.plan.size {
                let replaces = gaps.get(spared).cloned();
                spared += 1;
                let host = self.nodes[i].label.clone();
                self.journal.emit(Event::SpareIn {
                    node: i,
                    host,
                    replaces,
                });
            }
        }
        self.roster.active.sort_unstable();
        self.publish_room();
        if self.roster.active.len() < self.plan.min_nodes {
            return Err(self.too_few());
        }
        if self.roster.active.len() < self.quorum() {
            return Err(self.no_majority(self.quorum()));
        }
        Ok(came)
    }

    /// The checks of nodes `late` that joined after the job began (an elastic job's late
    /// joiners, a lost node's agent started again): those that fail are left out, said why.
    pub(crate) fn check_late(&mut self, late: &[usize]) {
        // Its host's earlier evidence is the reason that matters, before any check of its own.
        for &n in late {
            if let Some(why) = self.barred(n) {
                self.leave_out(n, Stage::Check, &why);
            }
        }
        if late.is_empty() {
            return;
        }
        let f = self.assign_interfaces();
        for w in f.warnings.iter() {
            tracing::warn!("{w}");
        }
        for (node, p) in f.problems {
            match node.filter(|n| late.contains(n)) {
                Some(n) => self.leave_out(n, Stage::Check, &p),
                None => tracing::warn!("{p}"),
            }
        }
        for &n in late {
            if let Some(why) = self.mismatch(n) {
                self.leave_out(n, Stage::Check, &why);
            }
        }
    }

    /// Why node `n`, joined late, may not run: its host was left out earlier in this job on
    /// evidence against the node itself (its nrun is told so when it joins, session::c10d; this
    /// is for one that joined before that was known).
    fn barred(&self, n: usize) -> Option<String> {
        let host = self.machine_key(n)?;
        self.roster
            .left_out
            .iter()
            .find(|l| {
                l.node != n && l.bars_return() && self.machine_key(l.node) == Some(host.clone())
            })
            .map(|l| {
                format!(
                    "this host was left out earlier in this job ({}): {}",
                    l.stage.as_str(),
                    l.why
                )
            })
    }

    /// The error for a job left with fewer healthy nodes than it needs, naming every node left
    /// out and why.
    pub(crate) fn too_few(&self) -> Error {
        let mut m = format!(
            "the job needs {} healthy node(s) but has {}",
            self.plan.min_nodes,
            self.roster.active.len()
        );
        if !self.roster.active.is_empty() {
            m.push_str(&format!(" ({})", self.names(&self.roster.active)));
        }
        m.push_str("; left out:");
        for l in self.roster.left_out.iter().filter(|l| l.back.is_none()) {
            m.push_str(&format!("\n  {} ({}): {}", l.host, l.stage.as_str(), l.why));
        }
        let spares = self.plan.hosts.len().saturating_sub(self.plan.size);
        m.push_str(&match spares {
            0 => "\n  hint: list more hosts than --nnodes and nrun takes spares in the place of \
                  nodes it leaves out"
                .to_string(),
            k => format!("\n  hint: all {k} spare(s) were used or left out too; list more hosts"),
        });
        Error::no_nodes(m)
    }

    /// Labels of nodes, comma separated.
    pub(crate) fn names(&self, v: &[usize]) -> String {
        v.iter()
            .map(|i| self.nodes[*i].label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Between attempts: nodes `gone` (each with its stage, Run or Lost, and the evidence)
    /// leave the job, spares and late joiners come in. Err: fewer than the minimum are left.
    pub(crate) fn reform(&mut self, gone: &[(usize, Stage, String)]) -> Result<()> {
        let before: Vec<usize> = self.roster.active.clone();
        for (i, stage, why) in gone {
            self.leave_out(*i, *stage, why);
        }
        let came = self.fill()?;
        // The c10d host re-forms only with half of the last world, and only if no newer host
        // took over (see session::succession).
        self.may_go_on(gone).map_err(Error::no_nodes)?;
        let active = &self.roster.active;
        if *active != before {
            let gone: Vec<usize> = before
                .iter()
                .copied()
                .filter(|i| !active.contains(i))
                .collect();
            // Spares have the places past the job's size; past those, nodes that came back.
            let spares = self.plan.size..self.plan.hosts.len();
            let (spare, joined): (Vec<usize>, Vec<usize>) =
                came.iter().partition(|i| spares.contains(*i));
            tracing::warn!(
                "the job goes on with {} nodes: {}{}{}{}",
                active.len(),
                self.names(active),
                match gone.is_empty() {
                    true => String::new(),
                    false => format!(" (lost: {})", self.names(&gone)),
                },
                match spare.is_empty() {
                    true => String::new(),
                    false => format!(" (spare in: {})", self.names(&spare)),
                },
                match joined.is_empty() {
                    true => String::new(),
                    false => format!(" (joined: {})", self.names(&joined)),
                }
            );
        }
        // The job goes on: nodes lost in it are started again, to come back.
        self.retry_lost();
        Ok(())
    }

    /// Why node `n` cannot run with the active nodes (NCCL major.minor or torch differ from
    /// theirs), unless --allow-mismatch.
    fn mismatch(&self, n: usize) -> Option<String> {
        if self.plan.allow_mismatch {
            return None;
        }
        let key = |i: usize| {
            self.nodes[i]
                .joined
                .as_ref()
                .and_then(|j| j.facts.as_ref())
                .map(crate::facts::compat_key)
        };
        let mine = key(n)?;
        let other = self.roster.active.iter().find_map(|&a| key(a))?;
        (mine != other).then(|| {
            format!(
                "its NCCL/torch ({}) differ from the job's nodes' ({})",
                mine, other
            )
        })
    }

    /// Nodes that never joined and are not written down yet (c10d slots nobody came to are no
    /// nodes).
    fn unsettled(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                !self.nodes[i].link.kind().joins_by_itself
                    && self.nodes[i].joined.is_none()
                    && !self.is_left_out(i)
                    && !self.roster.is_returning(i)
            })
            .collect()
    }

    /// At the job's end, before [`Session::settle`]: gives the links of nodes that never
    /// joined up to [`LAST_WORDS`] to end by themselves, so that each is written down with its
    /// own error (ssh's "No route to host") rather than as unheard. Not when nrun was
    /// interrupted: the user wants out.
    pub(crate) async fn await_last_words(&mut self, interrupted: bool) {
        if interrupted || self.unsettled().is_empty() {
            return;
        }
        let until = tokio::time::Instant::now() + LAST_WORDS;
        loop {
            let waiting = self
                .unsettled()
                .into_iter()
                .any(|i| self.nodes[i].link.joining() == super::link::Joining::Pending);
            if !waiting || tokio::time::Instant::now() >= until {
                break;
            }
            // A link's end nudges; the tick bounds the wait.
            tokio::select! {
                () = self.bus.nudges.notify.notified() => {}
                () = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
            }
        }
        // Let the relays of their stderr pass on the last line.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    /// At the job's end: nodes that never joined are named with their links' last words (or
    /// as unheard; as interrupted where nrun was stopped by signal `interrupted` while they
    /// joined), the nodes left out are listed, remembered in --exclude-file (all but the
    /// interrupted) and given as the next sbatch's --exclude= inside Slurm. `list`: print the
    /// nodes left out (an error that ended the job named them already).
    pub(crate) fn settle(&mut self, list: bool, interrupted: Option<i32>) {
        let timeout = self.plan.join_timeout;
        for i in self.unsettled() {
            let n = &mut self.nodes[i];
            let (evidence, why) = match (n.link.joining(), interrupted) {
                (super::link::Joining::Gone, _) => (
                    Evidence::Seen,
                    n.link.join_failure(&n.label, timeout, timeout),
                ),
                (super::link::Joining::Pending, Some(sig)) => (
                    Evidence::Interrupted,
                    format!(
                        "{}: had not joined when nrun was stopped by {}; nothing is known \
                         against it",
                        n.label,
                        nrun_node::signal_name(sig)
                    ),
                ),
                (super::link::Joining::Pending, None) => (
                    Evidence::Unheard,
                    format!(
                        "{}: had not joined by the job's end, and its link said nothing in {} s \
                         more (ssh still connecting, or its agent still starting: a slow host, \
                         or a network that drops its packets)",
                        n.label,
                        LAST_WORDS.as_secs()
                    ),
                ),
            };
            self.leave_out_for(i, Stage::Join, evidence, &why);
        }
        self.roster.settle();
        let back: Vec<&LeftOut> = self
            .roster
            .left_out
            .iter()
            .filter(|l| l.back.is_some())
            .collect();
        if list && !back.is_empty() {
            let mut text = format!("nrun: {} node(s) lost in this job came back:", back.len());
            for l in back {
                let at = l.back.as_ref().map_or(l.at, |b| b.at);
                let gone = at.duration_since(l.at).unwrap_or_default().as_secs_f64();
                text.push_str(&format!("\n  {} (out for {gone:.0} s): {}", l.host, l.why));
            }
            eprintln!("{text}");
        }
        let left_out: Vec<&LeftOut> = self
            .roster
            .left_out
            .iter()
            .filter(|l| l.back.is_none())
            .collect();
        if left_out.is_empty() {
            return;
        }
        let mut text = format!("nrun: {} node(s) left out of this job:", left_out.len());
        for l in &left_out {
            text.push_str(&format!("\n  {} ({}): {}", l.host, l.stage.as_str(), l.why));
        }
        if list {
            eprintln!("{text}");
        }
        if let Some(f) = self
            .plan
            .exclude_file
            .as_ref()
            .filter(|_| left_out.iter().any(|l| l.remembered()))
        {
            let entries: Vec<crate::plan::exclude::Entry> = left_out
                .iter()
                .filter(|l| l.remembered())
                .map(|l| crate::plan::exclude::Entry {
                    host: l.host.clone(),
                    at: l.at,
                    why: format!("{}: {}", l.stage.as_str(), l.why),
                })
                .collect();
            match f.append(&entries) {
                Ok(()) => eprintln!(
                    "nrun: remembered in {} (later runs avoid them for {})",
                    f.path.display(),
                    humantime::format_duration(f.ttl)
                ),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        let hosts: Vec<&str> = left_out
            .iter()
            .filter(|l| l.remembered())
            .map(|l| l.host.as_str())
            .collect();
        if self.plan.from_slurm && !hosts.is_empty() {
            eprintln!(
                "nrun: for the next sbatch of this job: --exclude={}",
                hosts.join(",")
            );
        }
    }

    /// `--report`'s `nodes` section: the job's size, where it ran, the spares left, the nodes
    /// left out with their evidence; None when nothing was left out.
    pub(crate) fn nodes_report(&self) -> Option<NodesReport> {
        if self.roster.left_out.is_empty() {
            return None;
        }
        let names = |v: &[usize]| -> Vec<String> {
            v.iter().map(|i| self.nodes[*i].label.clone()).collect()
        };
        Some(NodesReport {
            size: self.plan.size,
            ran_on: names(&self.roster.active),
            spares: names(&self.spares()),
            left_out: self.roster.left_out_report(),
            came_back: self.roster.came_back_report(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(node: usize, stage: Stage) -> LeftOut {
        LeftOut {
            node,
            host: format!("h{node}"),
            stage,
            evidence: Evidence::Seen,
            why: format!("why {node}"),
            at: SystemTime::now(),
            back: None,
        }
    }

    /// The transitions: a node left out leaves the active ones once (its first evidence
    /// stands); spares are the joined nodes in neither list; a spare taken in fills the place
    /// of the last node left out; nodes kept in on evidence join the list at the end, unless
    /// they left since.
    #[test]
    fn the_roster_moves_nodes_between_states_once() {
        let mut r = Roster::of(vec![0, 1, 2]);
        let joined = |i: usize| i != 4;
        assert_eq!(r.spares(5, joined), [3]);
        assert!(r.leave_out(out(1, Stage::Run)));
        assert!(!r.leave_out(out(1, Stage::Lost)), "left out once");
        assert_eq!(r.left_out()[0].stage, Stage::Run);
        assert_eq!(r.active(), [0, 2]);
        assert!(r.is_left_out(1) && !r.is_active(1));
        assert_eq!(r.gaps(3), ["h1"]);
        r.take_in(3);
        assert!(r.spares(5, joined).is_empty());
        assert!(r.gaps(3).is_empty());
        r.keep(out(0, Stage::Run));
        r.keep(out(1, Stage::Run));
        r.keep(out(2, Stage::Run));
        assert!(r.leave_out(out(2, Stage::Lost)));
        assert_eq!(r.left_out().len(), 2, "kept nodes wait for the end");
        r.settle();
        let listed: Vec<(usize, Stage)> = r.left_out().iter().map(|l| (l.node, l.stage)).collect();
        assert_eq!(
            listed,
            [(1, Stage::Run), (2, Stage::Lost), (0, Stage::Run)],
            "a kept node is listed once, and one left out since with its own evidence"
        );
        assert_eq!(r.left_out_report()[1].stage, "run");
    }

    /// A node lost and started again: being started, it is neither a spare nor left out; back,
    /// its entry no longer fills a gap, is reported as came back (not left out), and is not
    /// remembered; it is tried once.
    #[test]
    fn a_lost_node_that_came_back_is_no_longer_held_against() {
        let mut r = Roster::of(vec![0, 1]);
        assert!(r.leave_out(out(1, Stage::Lost)));
        r.start_return(Returning { node: 2, was: 1 });
        assert!(r.is_returning(2) && r.retried(1) && !r.is_left_out(2));
        assert_eq!(r.gaps(2), ["h1"]);
        assert_eq!(r.out_now(), 1);
        let came = r.end_return(2).map(|x| x.was);
        assert_eq!(came, Some(1));
        assert!(!r.is_returning(2));
        assert!(r.retried(1), "tried once, whatever its checks say");
        r.came_back(
            1,
            Back {
                at: SystemTime::now(),
                tries: 3,
            },
        );
        assert!(r.retried(1), "tried once");
        assert!(r.gaps(2).is_empty(), "it fills no gap");
        assert!(r.left_out_report().is_empty());
        assert_eq!(r.out_now(), 0, "the metrics count it out no more");
        assert_eq!(r.came_back_report()[0].host, "h1");
        assert_eq!(r.came_back_report()[0].tries, 3);
        assert!(!r.left_out()[0].remembered());
        assert!(
            r.is_left_out(1),
            "its first node stays out: it came back as another"
        );
    }
}
