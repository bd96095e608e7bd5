//! The seam between a session and its nodes: one [`NodeLink`] per node, whatever kind of agent
//! serves it (the shape of PRRTE's plm module table and of torch elastic's
//! `_start_workers/_monitor_workers/_stop_workers`). The session delivers steps, reads results,
//! asks whether a node is lost and ends it through this trait only; it never asks which kind a
//! link is.
//!
//! - [`inproc`]: the single node of a run without a host list, served inside nrun.
//! - [`child`]: `nrun __agent` as a child process: on this host, or over ssh (`--ship`).
//! - [`srun`]: one srun step that starts every node's agent; a link per node on it.
//! - [`peer`]: a node whose own nrun joined (torchrun's c10d), alive while its heartbeat moves.
//! - [`tree`]: a node of the launch tree, whose agent another node's agent started over ssh
//!   (`--tree-width`); the launch host's own children of the tree are `child` links.
//! - `fake` (tests): a scripted node, to test the session's policies without processes.
//!
//! Every link but the in-process one speaks through the store: the session's [`Bus`] seals its
//! steps and reads its results, views and heartbeats, so the kinds differ only in how they
//! start, stay alive, explain themselves and end. What a kind is apart from its links (how to
//! start it, whether it needs the spawner or takes --ship, how to check its nodes by hand) is
//! its [`Kind`], a `static KIND` in its file; the session and the commands read those facts
//! and never ask which kind a link is. Adding a launcher: a new file here with its `KIND` and
//! its `NodeLink`, and one line in [`LAUNCHERS`] (`fake` shows both).

pub(crate) mod child;
pub(crate) mod inproc;
pub(crate) mod peer;
pub(crate) mod srun;
pub(crate) mod tree;

#[cfg(test)]
pub(crate) mod fake;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::{JoinedNode, Node};
pub(crate) use crate::agent::child::Delivery;
pub(crate) use crate::agent::relay::Nudges;
use crate::plan::NodesPlan;
use crate::plan::SessionPlan;
use crate::protocol::{Control, Hello, Joined, Keys, NodeWatch, RunResult, Step, StepResult};
use nrun_base::error::{Error, Result};
use nrun_node::StopRequest;
use nrun_store::Store;

/// A future a link hands the session (async methods of a trait object).
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where a node stands while the session waits for it to join.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Joining {
    /// Its agent may still join.
    Pending,
    /// Its agent cannot join any more (its process ended): the session stops waiting for it.
    Gone,
}

/// What an in-process node needs to join (it has no agent to report for it).
pub(crate) struct JoinHere {
    /// Gather its facts (doctor), with this Python for torch's versions.
    pub facts: bool,
    pub python: Option<std::path::PathBuf>,
    /// Where its workers find the store.
    pub store_addr: String,
    pub store_port: u16,
    /// Its node is one of a static launch's (it finds its interface by the route to the store).
    pub static_launch: bool,
}

/// How a kind starts the agents of the plan's nodes `hosts` (a range of `np.hosts`).
pub(crate) type Start =
    for<'a> fn(&'a Starting<'a>, std::ops::Range<usize>) -> BoxFuture<'a, Result<Vec<Node>>>;

/// What every link of one kind shares, said once in its file (`static KIND`): how its nodes
/// start and are reached, and what to check on them by hand. The session and the commands read
/// these facts of a node's or a plan's kind; they never ask which kind it is.
pub(crate) struct Kind {
    /// The `--launcher` value that picks it (for the kinds [`LAUNCHERS`] lists); its name.
    pub name: &'static str,
    /// Starts the agents of the plan's nodes `hosts` (a range of `np.hosts`).
    pub start: Start,
    /// Refuses (an error the user can act on) nodes `hosts` of the plan it cannot serve (ssh:
    /// more than this host's open files hold), before anything starts.
    pub check: fn(&NodesPlan, std::ops::Range<usize>) -> Result<()>,
    /// Its agents are forked by the spawner ([`nrun_node::spawner`]), which is forked before
    /// nrun starts its threads.
    pub spawner: bool,
    /// Why `--ship` cannot work with it (None: it can).
    pub refuses_ship: Option<&'static str>,
    /// Served inside nrun: its ranks listen where the store is, and the run is this node alone.
    pub in_process: bool,
    /// Its node's own nrun joins (c10d): nothing here starts it, so one that never came is no
    /// node to leave out, and nodes of this kind that did not join are no fault of the launch.
    pub joins_by_itself: bool,
    /// Named by the host it reports when it joins, not by a label the user gave (a node whose
    /// own nrun joined, or one an srun step started).
    pub named_on_join: bool,
    /// What to check when its nodes did not join.
    pub join_hint: fn(&NodesPlan, &super::Rendezvous) -> String,
    /// What to check about node `host` when its agent or its link was lost.
    pub lost_hint: fn(host: &str) -> String,
    /// What to check when node `host`'s agent did not answer a quick check in time.
    pub unanswered_hint: fn(host: &str) -> String,
    /// Starts a node's agent again, as a node of its own (its first agent was lost): None
    /// where this kind cannot (its agents start elsewhere, or by themselves).
    pub again: Option<StartAgain>,
}

/// Starts host `label`'s agent as node `node` of the session: the link, once its process runs
/// (whether it joins is the caller's to see).
pub(crate) type StartAgain =
    fn(Arc<Again>, usize, String) -> BoxFuture<'static, Result<Box<dyn NodeLink>>>;

/// What starting a node's agent again needs, kept from the session's start: the plan, what
/// every agent is told, and where their ends are said.
pub(crate) struct Again {
    pub plan: Arc<NodesPlan>,
    pub how: Instructions,
    pub nudges: Arc<Nudges>,
}

impl Again {
    /// None where the plan's launcher starts no agent again.
    pub(crate) fn new(s: &Starting<'_>) -> Option<Again> {
        if launcher(s.plan).again.is_none() || s.plan.in_process {
            return None;
        }
        Some(Again {
            plan: Arc::new(s.plan.clone()),
            how: Instructions::new(s).ok()?,
            nudges: s.nudges.clone(),
        })
    }
}

/// The kinds `--launcher` picks among (the plan names one): one line per kind. A run without a
/// host list is served in-process ([`inproc`]), and c10d nodes join as [`peer`]s, whatever the
/// launcher; the launch tree's nodes are started by [`child`] links' agents.
const LAUNCHERS: &[&Kind] = &[
    &child::KIND,
    &srun::KIND,
    #[cfg(test)]
    &fake::KIND,
];

/// The kind of link that starts the agents of the hosts this nrun owns, as the plan's
/// launcher names it.
pub(crate) fn launcher(np: &NodesPlan) -> &'static Kind {
    LAUNCHERS
        .iter()
        .copied()
        .find(|k| k.name == np.launcher)
        .unwrap_or(&child::KIND)
}

/// The one place kinds are chosen: which kind serves which of the plan's nodes (by index).
pub(crate) fn chosen(np: &NodesPlan) -> Vec<(&'static Kind, std::ops::Range<usize>)> {
    if np.in_process {
        return vec![(&inproc::KIND, 0..1)];
    }
    let owned = np.owned();
    vec![
        (launcher(np), 0..owned),
        (&peer::KIND, owned..np.hosts.len()),
    ]
}

/// Refuses what the plan's kinds cannot do, before anything starts: `--ship` where the
/// launcher does not copy binaries (a usage error), nodes a kind cannot serve.
pub(crate) fn check(np: &NodesPlan) -> Result<()> {
    if let Some(why) = launcher(np).refuses_ship.filter(|_| np.ship) {
        return Err(Error::usage(why));
    }
    for (kind, hosts) in chosen(np) {
        (kind.check)(np, hosts)?;
    }
    Ok(())
}

/// A kind's [`Kind::check`] that refuses nothing.
pub(crate) fn any_nodes(_: &NodesPlan, _: std::ops::Range<usize>) -> Result<()> {
    Ok(())
}

/// Whether the plan's nodes need the spawner forked before nrun starts its threads.
pub(crate) fn needs_spawner(np: &NodesPlan) -> bool {
    chosen(np)
        .iter()
        .any(|(k, hosts)| k.spawner && !hosts.is_empty())
}

/// One node of a session, as the session sees it, whatever serves it.
pub(crate) trait NodeLink: Send {
    /// Its kind's facts and hints.
    fn kind(&self) -> &'static Kind;

    /// The launch host's own node (its output needs no colour decision from afar).
    fn is_local(&self) -> bool {
        false
    }

    /// The node's join record built here, for a node with no agent to report one.
    fn join_here<'a>(&'a mut self, _how: &'a JoinHere) -> Option<BoxFuture<'a, JoinedNode>> {
        None
    }

    /// Whether its agent may still join.
    fn joining(&mut self) -> Joining;

    /// Why the node did not join (after `waited`, with `timeout` the limit), for the user.
    fn join_failure(&mut self, label: &str, waited: Duration, timeout: Duration) -> String;

    /// Gives the node step `no` (`None`: it sits the step out, keeping its count of steps in
    /// line). Returns whether an answer is to be waited for.
    fn deliver(&mut self, bus: &Bus, node: usize, no: usize, step: Option<&Step>) -> bool {
        bus.set_step(node, no, step.unwrap_or(&Step::idle()));
        step.is_some()
    }

    /// The node's part of the step, run in this very process beside the session's wait (the
    /// in-process node); None for nodes served elsewhere.
    fn local_work(&mut self) -> Option<BoxFuture<'static, ()>> {
        None
    }

    /// The node's result of step `no`, once it has one or is lost. `stopped`: the session
    /// asked every node to stop. An agent that stopped or was interrupted without being asked
    /// has left the job: it is lost.
    fn result(
        &mut self,
        bus: &Bus,
        node: usize,
        no: usize,
        label: &str,
        stopped: bool,
    ) -> Option<StepResult> {
        judge_result(self, bus, node, no, label, stopped)
    }

    /// The node's watch view during step `no`, if a new one arrived.
    fn view(&mut self, bus: &Bus, node: usize, no: usize, last: &mut Vec<u8>) -> Option<NodeWatch> {
        bus.view(node, no, last)
    }

    /// Whether the node is lost, and why, in words. `stopped`: its agent stopped its workers
    /// without being asked (it lost its link to this host).
    fn lost(&mut self, bus: &Bus, node: usize, label: &str, stopped: bool) -> Option<String>;

    /// Whether the node, found lost, is known dead: its connection closed (its nrun ended or
    /// was killed), where a frozen or cut-off node is only silent. Only a peer (c10d) tells.
    fn closed(&self) -> bool {
        false
    }

    /// A stop or a signal for its running step, for a node that does not read the store's
    /// broadcast keys (which the session writes for all the others).
    fn request(&mut self, _req: StopRequest) {}

    /// Whether every line its workers wrote in step `no` has reached this host's console (a
    /// node whose output a pipe of this host relays: its agent's marks behind that step came
    /// through, see [`crate::agent::child::Marks`]); a node whose output needs no relay has it
    /// there with its result.
    fn output(&mut self, _node: usize, _no: usize) -> Delivery {
        Delivery::Arrived
    }

    /// Ends the link, once the session delivered End: waits for its agent to leave, then ends
    /// what is left of it. Every link's end runs at once. Nothing to end by default.
    fn end<'a>(&'a mut self, _: Ending<'a>) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }

    /// Ends the link at once, its agent killed without waiting for it to leave (one started
    /// again that did not join before the job ended, or gave up). Nothing to end by default.
    fn kill(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// [`NodeLink::result`] as most links have it: the node's published result, or its loss; a
/// result that means the node left the job unasked reads as lost.
pub(crate) fn judge_result<L: NodeLink + ?Sized>(
    link: &mut L,
    bus: &Bus,
    node: usize,
    no: usize,
    label: &str,
    stopped: bool,
) -> Option<StepResult> {
    let Some(r) = bus.result(node, no) else {
        // Its agent is gone (ssh dropped, host died): it will not report.
        return link
            .lost(bus, node, label, false)
            .map(|why| StepResult::Run(RunResult::Lost(why)));
    };
    let why = match (stopped, &r) {
        // Stopped without being asked: that agent lost its connection to us.
        (false, StepResult::Run(RunResult::Stopped)) => link
            .lost(bus, node, label, true)
            .unwrap_or_else(|| format!("{label}'s agent lost its connection to the launch host")),
        // Interrupted without being asked: a signal on that node (its agent's keeper
        // killed, srun's, or a user's there) took it out of the job.
        (false, StepResult::Run(RunResult::Interrupted(sig))) => format!(
            "{label}'s agent was stopped by {} on that node",
            nrun_node::signal_name(*sig)
        ),
        _ => return Some(r),
    };
    Some(StepResult::Run(RunResult::Lost(why)))
}

/// What a link's end needs to know.
pub(crate) struct Ending<'a> {
    pub bus: &'a Bus,
    pub node: usize,
    /// The End step's number.
    pub no: usize,
    /// Its agent joined (and so acknowledges the End).
    pub joined: bool,
}

impl Ending<'_> {
    /// Waits (up to 5 s) until a node that joined acknowledged the End, so that its nrun reads
    /// the job's exit code before the store goes away.
    pub(crate) async fn acknowledged(self) {
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while self.joined
            && tokio::time::Instant::now() < until
            && !self.bus.answered(self.node, self.no)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The shortest heartbeat silence that loses a node: five beats, whatever --agent-timeout.
pub(crate) const MIN_SILENCE: std::time::Duration = std::time::Duration::from_millis(2500);

/// The coordinator's side of the conversation through the store: the one place that seals
/// steps and reads what agents publish.
pub(crate) struct Bus {
    pub(super) store: Option<Arc<Store>>,
    pub(super) keys: Keys,
    pub(super) secret: Option<String>,
    /// Woken by work done in this process (the in-process node's result and views), as the
    /// store's own notification is by agents' writes.
    pub(super) wake: Arc<Notify>,
    /// Each joined node's nonce, from its Joined record (read once, when the node is taken in).
    pub(super) nonces: std::collections::HashMap<usize, String>,
    /// Nodes whose links have news the store does not carry (an agent's process ended).
    pub(super) nudges: Arc<Nudges>,
    /// The step whose controls were last written, and how many (see [`Keys::control`]).
    pub(super) controls: std::sync::Mutex<(usize, usize)>,
    /// How long a node's heartbeat (every half second, `agent::liveness`) may be still
    /// before the node is lost: half of --agent-timeout, at least [`MIN_SILENCE`] (2.5 s by
    /// default: five beats missed), so that this host calls a cut-off node lost (and a spare
    /// may take its place) before that node's agent stops its workers by itself, unless the
    /// kernel's view of the agent's connection shows the agent still beating (see
    /// [`peer::Heartbeat`]). An agent whose connection closes is lost at once: the store
    /// removes its counter ([`nrun_store::server::LIVE_SUFFIX`]).
    pub(super) silence: std::time::Duration,
}

/// The nodes to look at again since the last call: named by a key the store says changed, or
/// nudged by their links. None: every node (the store dropped its list).
pub(super) fn touched(bus: &Bus) -> Option<Vec<usize>> {
    let mut nodes = bus.nudges.take();
    if let Some(st) = &bus.store {
        let changes = st.take_changes();
        if changes.overflowed {
            return None;
        }
        nodes.extend(changes.keys.iter().filter_map(|k| bus.keys.node_of(k)));
    }
    nodes.sort_unstable();
    nodes.dedup();
    Some(nodes)
}

impl Bus {
    /// Writes node `node`'s step `no`, sealed with the run's secret for the nonce its agent
    /// chose when it joined (an agent runs no step it cannot verify, nor one sealed for another
    /// join). A node the session has not taken in yet gets steps bound to no nonce: its agent
    /// takes such a step only if it runs nothing (see `agent::Node::next_step`).
    pub(crate) fn set_step(&self, node: usize, no: usize, step: &Step) {
        let Some(store) = &self.store else { return };
        let key = self.keys.step(node, no);
        let json = serde_json::to_vec(step).unwrap_or_default();
        let secret = self.secret.as_deref().unwrap_or("");
        let bound = self.nonces.get(&node).map_or("", String::as_str);
        store.set(
            &key,
            &nrun_store::auth::seal(secret.as_bytes(), &key, bound.as_bytes(), &json),
        );
    }

    /// What a node published under `key`, opened with the run's secret (its agent sealed it,
    /// `agent::Node::seal`): None when missing, or not sealed with it (written by something
    /// other than that node's agent).
    fn opened(&self, key: &[u8]) -> Option<Vec<u8>> {
        let raw = self.store.as_ref()?.get(key)?;
        let secret = self.secret.as_deref().unwrap_or("");
        let opened = nrun_store::auth::open(secret.as_bytes(), key, b"", &raw);
        if opened.is_none() {
            // Asked again at every look: said at debug level, not once a poll.
            tracing::debug!(
                "{} in this host's store is not sealed with this run's secret: ignored (written \
                 by something other than this run's agent, or the nruns differ: compare `nrun \
                 --version` on both)",
                String::from_utf8_lossy(key)
            );
        }
        opened
    }

    /// Node `node`'s result of step `no`, if it published one.
    pub(crate) fn result(&self, node: usize, no: usize) -> Option<StepResult> {
        let raw = self.opened(&self.keys.result(node, no))?;
        serde_json::from_slice(&raw).ok()
    }

    /// Whether node `node` published anything as its result of step `no` (End's is no JSON).
    pub(crate) fn answered(&self, node: usize, no: usize) -> bool {
        self.store
            .as_ref()
            .is_none_or(|st| st.contains(&self.keys.result(node, no)))
    }

    /// Node `node`'s view during step `no`, if it changed since `last`.
    pub(crate) fn view(&self, node: usize, no: usize, last: &mut Vec<u8>) -> Option<NodeWatch> {
        let raw = self.opened(&self.keys.watch(node, no))?;
        if raw == *last {
            return None;
        }
        let v = serde_json::from_slice(&raw).ok();
        *last = raw;
        v
    }

    /// Node `node`'s joined record, if its agent has published one.
    pub(crate) fn joined(&self, node: usize) -> Option<Joined> {
        let raw = self.store.as_ref()?.get(&self.keys.joined(node))?;
        serde_json::from_slice(&raw).ok()
    }

    /// Whether node `node`'s agent has published its joined record (not read: it carries the
    /// node's facts, and this is asked every second of an elastic job).
    pub(crate) fn has_joined(&self, node: usize) -> bool {
        self.store
            .as_ref()
            .is_some_and(|st| st.contains(&self.keys.joined(node)))
    }

    /// Node `node`'s heartbeat counter as last written (empty before the first).
    pub(crate) fn heartbeat(&self, node: usize) -> Vec<u8> {
        self.store
            .as_ref()
            .and_then(|st| st.get(&self.keys.alive(node)))
            .unwrap_or_default()
    }

    /// The kernel's view of node `node`'s heartbeat connection to this host's store (None: no
    /// open one), the evidence asked for before a still heartbeat loses the node
    /// ([`peer::Heartbeat`]).
    pub(crate) fn heartbeat_link(&self, node: usize) -> Option<nrun_store::server::LinkView> {
        self.store.as_ref()?.tied_link(&self.keys.alive(node))
    }

    /// Asks every agent to stop step `no`: forwarding the user's signal, or politely.
    pub(crate) fn stop(&self, no: usize, signal: Option<i32>) {
        self.control(no, Control::Stop(signal));
    }

    /// Passes signal `sig` to every agent's workers of step `no`.
    pub(crate) fn signal(&self, no: usize, sig: i32) {
        self.control(no, Control::Forward(sig));
    }

    /// Tells every agent of step `no` the launcher's terminal's new sizes.
    pub(crate) fn resize(&self, no: usize, sizes: [Option<nrun_node::output::Tty>; 2]) {
        self.control(no, Control::Resize(sizes));
    }

    /// Writes step `no`'s next control, in the one series agents read in order.
    fn control(&self, no: usize, c: Control) {
        let Some(st) = &self.store else { return };
        let seq = {
            let mut at = self.controls.lock().unwrap_or_else(|e| e.into_inner());
            if at.0 != no {
                *at = (no, 0);
            }
            at.1 += 1;
            at.1 - 1
        };
        st.set(&self.keys.control(no, seq), &c.encode());
    }

    /// Leaves the job's exit code for nodes that exit with it.
    pub(crate) fn exit(&self, code: u8) {
        if let Some(st) = &self.store {
            st.set(&self.keys.exit(), code.to_string().as_bytes());
        }
    }
}

/// What every agent started by this nrun is told, less its own node's place.
pub(crate) struct Instructions {
    pub secret: String,
    pub run: String,
    /// Every address of the launch host's store, "ip:port" (loopback last).
    pub addrs: Vec<String>,
    /// The one address the user gave (`--local-addr`), "ip:port": every remote agent uses it.
    pub pinned: Option<String>,
    pub cwd: std::path::PathBuf,
    pub python: Option<std::path::PathBuf>,
    pub forward_signals: Vec<i32>,
    pub agent_timeout: Duration,
}

impl Instructions {
    pub(crate) fn new(s: &Starting<'_>) -> Result<Instructions> {
        let plan = s.session;
        Ok(Instructions {
            secret: s.rendezvous.secret.clone().unwrap_or_default(),
            run: s.run.to_string(),
            addrs: super::coordinator_addrs(s.rendezvous.port),
            pinned: super::pinned_addr(plan, s.rendezvous.port)?,
            cwd: std::env::current_dir()
                .map_err(|e| Error::usage(format!("cannot read the current directory: {e}")))?,
            python: s.plan.python_probe.then(|| plan.python.clone()).flatten(),
            forward_signals: plan.forward_signals.clone(),
            agent_timeout: s.plan.agent_timeout,
        })
    }

    /// The Hello of a node of another machine, as [`Instructions::hello`]: the user's address
    /// pinned, else every address with `prefer` (the launch host's choice for it).
    pub(crate) fn remote_hello(
        &self,
        node: usize,
        label: &str,
        prefer: Option<crate::protocol::Prefer>,
        nodes: Vec<String>,
    ) -> Hello {
        match &self.pinned {
            Some(p) => Hello {
                pinned: true,
                ..self.hello(node, label, vec![p.clone()], nodes)
            },
            None => Hello {
                prefer,
                ..self.hello(node, label, self.addrs.clone(), nodes)
            },
        }
    }

    /// The Hello of node `node` (`label`), or with `nodes` the one Hello of a step starting
    /// all of them (each agent finds its own by name).
    pub(crate) fn hello(
        &self,
        node: usize,
        label: &str,
        addrs: Vec<String>,
        nodes: Vec<String>,
    ) -> Hello {
        Hello {
            secret: self.secret.clone(),
            run: self.run.clone(),
            node,
            label: label.to_string(),
            addrs,
            pinned: false,
            prefer: None,
            cwd: self.cwd.clone(),
            version: nrun_base::VERSION.to_string(),
            python: self.python.clone(),
            forward_signals: self.forward_signals.clone(),
            // Every remote agent beats: a dead or cut-off node is named within 3 s.
            heartbeat: true,
            nodes,
            agent_timeout_ms: self.agent_timeout.as_millis() as u64,
            own: None,
            tree: Vec::new(),
            tree_ssh: None,
            // srun's nodes are other machines; the ssh launcher decides per job (link::child).
            probed: true,
            // Its output comes through a pipe of this host's: marked at each step's end. No
            // random bytes (never seen): no marks, and results are taken as they come.
            output_mark: nrun_base::random_hex().unwrap_or_default(),
            state_file: None,
            epoch: 0,
        }
    }
}

/// What starting the links needs of the session.
pub(crate) struct Starting<'a> {
    pub plan: &'a NodesPlan,
    pub session: &'a SessionPlan,
    pub rendezvous: &'a super::Rendezvous,
    pub run: &'a str,
    pub nudges: &'a Arc<Nudges>,
    /// The store this nrun hosts (the launch tree's links read their nodes' keys in it).
    pub store: Option<Arc<Store>>,
}

/// A link for every node of the session, each started by its kind ([`chosen`]).
pub(crate) async fn start(s: Starting<'_>) -> Result<Vec<Node>> {
    let mut nodes = Vec::with_capacity(s.plan.hosts.len());
    for (kind, hosts) in chosen(s.plan) {
        if !hosts.is_empty() {
            nodes.extend((kind.start)(&s, hosts).await?);
        }
    }
    Ok(nodes)
}

/// Drives every future of `work` to its end, together. Each is polled only when it was woken
/// (a waker of its own): polling all of them on every wake-up was quadratic in the nodes when
/// a thousand agents' ends wake one by one. A future woken many times before its poll is
/// queued once and polled once: the in-process node's one future is woken by each of its
/// thousands of workers' ends, and by tokio's budget on every poll past it, so a queue of every
/// wake-up made one poll per wake, each poll woke again, and the queue grew without end.
pub(super) async fn join_all(work: Vec<BoxFuture<'_, ()>>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Poll, Wake, Waker};

    /// Futures woken since the last poll (each once), and the task to wake for them.
    #[derive(Default)]
    struct Woken {
        ready: std::sync::Mutex<(Vec<usize>, Option<Waker>)>,
    }
    struct One {
        index: usize,
        /// In `ready` already, not yet polled.
        queued: AtomicBool,
        woken: Arc<Woken>,
    }
    impl Wake for One {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref()
        }
        fn wake_by_ref(self: &Arc<Self>) {
            if self.queued.swap(true, Ordering::AcqRel) {
                return;
            }
            let mut r = self.woken.ready.lock().unwrap_or_else(|e| e.into_inner());
            r.0.push(self.index);
            if let Some(w) = r.1.take() {
                w.wake();
            }
        }
    }

    let woken = Arc::new(Woken::default());
    // Every future is queued to be polled once to begin with.
    let ones: Vec<Arc<One>> = (0..work.len())
        .map(|index| {
            Arc::new(One {
                index,
                queued: AtomicBool::new(true),
                woken: woken.clone(),
            })
        })
        .collect();
    let wakers: Vec<Waker> = ones.iter().map(|o| Waker::from(o.clone())).collect();
    let mut work: Vec<Option<BoxFuture<'_, ()>>> = work.into_iter().map(Some).collect();
    let mut left = work.len();
    woken
        .ready
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .0
        .extend(0..work.len());
    std::future::poll_fn(|cx| {
        // One round per poll, the task's waker registered first: a future woken while this
        // round runs (or at once, by tokio's budget) has this task polled again after the
        // runtime had its turn, never in a loop here.
        let ready = {
            let mut r = woken.ready.lock().unwrap_or_else(|e| e.into_inner());
            r.1 = Some(cx.waker().clone());
            std::mem::take(&mut r.0)
        };
        for i in ready {
            // Cleared before the poll: a wake-up during it queues the future again.
            ones[i].queued.store(false, Ordering::Release);
            let Some(f) = work[i].as_mut() else { continue };
            let mut own = std::task::Context::from_waker(&wakers[i]);
            if f.as_mut().poll(&mut own).is_ready() {
                work[i] = None;
                left -= 1;
            }
        }
        match left {
            0 => Poll::Ready(()),
            _ => Poll::Pending,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Each future is polled when it was woken, not on every other one's wake-up (the ends of
    /// a thousand links wake one by one).
    #[tokio::test]
    async fn join_all_polls_only_what_was_woken() {
        let polls = Arc::new(AtomicUsize::new(0));
        let mut work: Vec<BoxFuture<'static, ()>> = Vec::new();
        for i in 0..100u64 {
            let polls = polls.clone();
            let mut sleep = Box::pin(tokio::time::sleep(Duration::from_millis(2 * i)));
            work.push(Box::pin(std::future::poll_fn(move |cx| {
                polls.fetch_add(1, Ordering::Relaxed);
                sleep.as_mut().poll(cx)
            })));
        }
        join_all(work).await;
        // Once to begin with, once when woken (all of them on every wake-up: about 5,000).
        let n = polls.load(Ordering::Relaxed);
        assert!(n <= 300, "{n} polls");
    }

    /// A future woken many times between two polls is polled once for them (the in-process
    /// node's future, woken by each of thousands of workers' ends and by tokio's budget): a
    /// poll per wake-up, each waking again, grew the queue without end.
    #[tokio::test]
    async fn join_all_polls_a_future_woken_many_times_once() {
        let polls = Arc::new(AtomicUsize::new(0));
        let counted = polls.clone();
        let work: Vec<BoxFuture<'static, ()>> = vec![Box::pin(std::future::poll_fn(move |cx| {
            if counted.fetch_add(1, Ordering::Relaxed) + 1 >= 50 {
                return std::task::Poll::Ready(());
            }
            // Ten wake-ups per poll, as many ends coming in between two polls.
            for _ in 0..10 {
                cx.waker().wake_by_ref();
            }
            std::task::Poll::Pending
        }))];
        let mut all = Box::pin(join_all(work));
        let mut rounds = 0;
        std::future::poll_fn(|cx| {
            rounds += 1;
            all.as_mut().poll(cx)
        })
        .await;
        // One poll of the future per round of join_all (a queue of every wake-up: 1, 10, 100...).
        assert_eq!(polls.load(Ordering::Relaxed), 50);
        assert_eq!(rounds, 50);
    }
}
