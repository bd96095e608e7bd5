//! A node of the launch tree (`--tree-width`): its agent is started over ssh by an inner agent
//! on another node (as Open MPI's PRRTE daemons start the next level), not by this host.
//!
//! What the tree saves the launch host is the ssh processes, their three pipes each and the
//! handshakes: it starts `width` agents, each of which starts up to `width` more (see
//! `plan::tree` for the shape, `agent::tree` for the inner agent's side). Store traffic is not
//! relayed: every agent, wherever it was started, connects to the coordinator's store itself
//! (joins, steps, results, views, heartbeats), as the job's torch workers do anyway. The store
//! is built for many thousands of clients (one connection per agent is a small part of what the
//! workers open), and a relay would put every step and result of a subtree through one process
//! whose loss would then hide the state of nodes that are still fine.
//!
//! So a node of the tree is alive, lost and ended as a c10d peer is (its heartbeat, its closed
//! connection, its acknowledgement of the End), plus what only the tree knows: the inner agent
//! that started it writes `Keys::tree_lost` with how its ssh ended when that happens before the
//! End (its join failure or loss, in ssh's words, naming the inner host), and a lost inner
//! agent takes its subtree with it (their ssh ran on its node): each of those nodes says it was
//! lost with that agent, and the agent's own loss lists them ([`Inner`]).

use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::peer::Heartbeat;
use super::{BoxFuture, Bus, Delivery, Ending, Joining, Kind, NodeLink, Nudges};
use crate::agent::child::Marks;
use crate::protocol::{Keys, RunResult, StepResult};
use nrun_store::Store;

/// How long a node of the tree whose agent stopped unasked (or whose connection closed) waits
/// for its inner agent's loss to show before it is named lost on its own: the loss of an
/// inner agent reaches this host through its ssh, its subtree's through the store, in either
/// order.
const HOLD: Duration = Duration::from_millis(1500);

/// Nodes named in a lost inner agent's message before "and N more".
const NAMED: usize = 8;

/// An agent of the launch tree that starts others, as the links of the nodes below it see it.
pub(crate) struct Inner {
    pub node: usize,
    pub label: String,
    /// Its ssh (or, of this machine, its process) from this host, when the launch host
    /// started it.
    ended: Option<watch::Receiver<Option<ExitStatus>>>,
    /// Of the launch host's own machine: started without ssh.
    local: bool,
    /// The marks behind its subtree's output, read from its pipes (the one the launch host
    /// started: every line of its subtree comes up through it).
    marks: Option<Arc<Marks>>,
    /// Why it was lost, once its own link said so.
    why: Mutex<Option<String>>,
    /// The nodes started through it (its whole subtree), in node order.
    below: Vec<(usize, String)>,
    nudges: Arc<Nudges>,
}

impl Inner {
    pub(crate) fn new(
        node: usize,
        label: &str,
        ended: Option<watch::Receiver<Option<ExitStatus>>>,
        marks: Option<Arc<Marks>>,
        local: bool,
        below: Vec<(usize, String)>,
        nudges: Arc<Nudges>,
    ) -> Arc<Inner> {
        Arc::new(Inner {
            node,
            label: label.to_string(),
            ended,
            local,
            marks,
            why: Mutex::new(None),
            below,
            nudges,
        })
    }

    /// Its own link found it lost (`why`, in that link's words): the nodes below are looked at
    /// again at once.
    pub(crate) fn lost_as(&self, why: &str) {
        let mut w = self.why.lock().unwrap_or_else(|e| e.into_inner());
        if w.is_none() {
            *w = Some(why.to_string());
            for (n, _) in &self.below {
                self.nudges.nudge(*n);
            }
        }
    }

    /// How a link of an inner agent (or none) says its node is lost: an inner agent's reason is
    /// remembered for its subtree, which goes with it, and the words say so.
    pub(crate) fn named_lost(me: Option<&Inner>, why: String) -> String {
        match me {
            Some(m) => {
                m.lost_as(&why);
                format!("{why}{}", m.through())
            }
            None => why,
        }
    }

    /// Whether it is gone, and how, in a few words: its link said so, its ssh from this host
    /// ended, or the agent above it wrote that its ssh ended.
    fn gone(&self, store: Option<&Store>, keys: &Keys) -> Option<String> {
        if let Some(w) = self.why.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Some(w);
        }
        if let Some(st) = self.ended.as_ref().and_then(|e| *e.borrow()) {
            return Some(match self.local {
                true => format!(
                    "its agent, a process of this host, {}",
                    crate::agent::child::how_it_ended(&st)
                ),
                false => format!("its ssh from the launch host ended ({st})"),
            });
        }
        let said = store?.get(&keys.tree_lost(self.node))?;
        let said = String::from_utf8_lossy(&said);
        Some(match self.local {
            true => format!("its agent, a process of this host, {said}"),
            false => format!("the ssh that started it {said}"),
        })
    }

    /// "; the 3 nodes started through it in the launch tree go with it: b3, b4, b5".
    pub(crate) fn through(&self) -> String {
        let n = self.below.len();
        let mut names: Vec<&str> = self
            .below
            .iter()
            .take(NAMED)
            .map(|(_, l)| l.as_str())
            .collect();
        let more = n.saturating_sub(NAMED);
        if more > 0 {
            names.push("...");
        }
        format!(
            "; the {n} node{} started through it in the launch tree go{} with it: {}{}",
            if n == 1 { "" } else { "s" },
            if n == 1 { "es" } else { "" },
            names.join(", "),
            match more {
                0 => String::new(),
                k => format!(" ({k} more)"),
            }
        )
    }
}

/// A node whose agent an inner agent of the launch tree started.
pub(crate) struct TreeLink {
    node: usize,
    /// The inner agents above it, the one the launch host started first; the last started it.
    line: Vec<Arc<Inner>>,
    /// Itself, when it starts others in turn.
    me: Option<Arc<Inner>>,
    store: Option<Arc<Store>>,
    keys: Keys,
    beat: Heartbeat,
    agent_timeout: Duration,
    /// Its agent runs on this machine, started by an agent beside it: watched as a process by
    /// that agent (which writes its end up), not by a heartbeat.
    local: bool,
    /// Since when its agent's own state said lost while nothing above it did (see [`HOLD`]).
    held: Option<Instant>,
}

impl TreeLink {
    pub(crate) fn new(
        node: usize,
        line: Vec<Arc<Inner>>,
        me: Option<Arc<Inner>>,
        store: Option<Arc<Store>>,
        keys: Keys,
        agent_timeout: Duration,
        local: bool,
    ) -> TreeLink {
        TreeLink {
            node,
            line,
            me,
            store,
            keys,
            beat: Heartbeat::default(),
            agent_timeout,
            local,
            held: None,
        }
    }

    /// The inner agent that started this node's agent.
    fn parent(&self) -> &str {
        self.line.last().map_or("?", |p| p.label.as_str())
    }

    /// What its parent wrote when the ssh starting this node ended before the End.
    fn own_end(&self, node: usize) -> Option<String> {
        let said = self.store.as_ref()?.get(&self.keys.tree_lost(node))?;
        Some(String::from_utf8_lossy(&said).into_owned())
    }

    /// The first agent above it that is gone, with how.
    fn ancestor_gone(&self) -> Option<(&str, String)> {
        self.line.iter().find_map(|a| {
            a.gone(self.store.as_deref(), &self.keys)
                .map(|why| (a.label.as_str(), why))
        })
    }

    /// Whether what this node's own agent shows (stopped unasked, its connection closed) has
    /// waited long enough for an inner agent's loss to explain it instead.
    fn waited_for_the_line(&mut self) -> bool {
        self.held.get_or_insert_with(Instant::now).elapsed() >= HOLD
    }

    /// Its loss in words, before the subtree's part.
    fn why_lost(&mut self, bus: &Bus, node: usize, label: &str, stopped: bool) -> Option<String> {
        if let Some(said) = self.own_end(node) {
            let parent = self.parent();
            return Some(match self.local {
                true => format!(
                    "lost {label}: its agent (a process of this host, started by {parent}'s \
                     agent in the launch tree) {said}; its workers ended with it"
                ),
                false => format!(
                    "lost the connection to {label}: the ssh from {parent} that started its \
                     agent in the launch tree {said}; its agent stops its workers there by \
                     itself within {} s of losing its ssh or this host (--agent-timeout)",
                    self.agent_timeout.as_secs_f64()
                ),
            });
        }
        if let Some((anc, why)) = self.ancestor_gone() {
            return Some(format!(
                "lost {label} with {anc}, which started its agent in the launch tree: {anc}: {why}"
            ));
        }
        let (own, hold) = match stopped {
            true => (
                Some(format!(
                    "lost the connection to {label}: its agent stopped its workers when its ssh \
                     from {} (the launch tree) or this host went away",
                    self.parent()
                )),
                true,
            ),
            // Its process is watched by the agent beside it, which writes its end up.
            false if self.local => (None, false),
            // Its connection closed (its counter gone) may be its inner agent's loss coming
            // the other way; a silent heartbeat has waited long enough already.
            false => (
                self.beat.lost(bus, node, label, false),
                bus.heartbeat(node).is_empty(),
            ),
        };
        match own {
            Some(w) if !hold || self.waited_for_the_line() => Some(w),
            _ => None,
        }
    }
}

/// Nodes of the launch tree: started over ssh by another node's agent. [`super::child`]
/// links start them (their roots), so no plan chooses this kind; its hints are ssh's.
pub(crate) static KIND: Kind = Kind {
    name: "ssh (launch tree)",
    start: |_, _| Box::pin(async { Ok(Vec::new()) }),
    check: super::any_nodes,
    spawner: false,
    refuses_ship: None,
    in_process: false,
    joins_by_itself: false,
    named_on_join: false,
    join_hint: |np, r| (super::child::KIND.join_hint)(np, r),
    lost_hint: super::child::lost_hint,
    unanswered_hint: super::child::unanswered_hint,
    again: None,
};

impl NodeLink for TreeLink {
    fn kind(&self) -> &'static Kind {
        &KIND
    }

    fn output(&mut self, node: usize, no: usize) -> Delivery {
        self.line
            .first()
            .and_then(|top| top.marks.as_ref())
            .map_or(Delivery::Arrived, |m| m.delivery(node, no))
    }

    fn is_local(&self) -> bool {
        self.local
    }

    fn joining(&mut self) -> Joining {
        match self.own_end(self.node).is_some() || self.ancestor_gone().is_some() {
            true => Joining::Gone,
            false => Joining::Pending,
        }
    }

    fn join_failure(&mut self, label: &str, waited: Duration, timeout: Duration) -> String {
        let parent = self.parent().to_string();
        let below = match &self.me {
            Some(m) => m.through(),
            None => String::new(),
        };
        let own_end = self.own_end(self.node);
        if let (None, Some((anc, why))) = (&own_end, self.ancestor_gone()) {
            return format!(
                "{label}: not started: its agent is started by {anc} in the launch tree, and \
                 {anc} is gone ({why})"
            );
        }
        if self.local {
            // Started beside its parent on this machine: no ssh to check.
            return match own_end {
                Some(said) => format!(
                    "{label}: its agent, started on this host by {parent}'s in the launch tree, \
                     {said}{below}"
                ),
                None => format!(
                    "{label}: did not join within {} s (--join-timeout, {:.0} s waited); its \
                     agent is started on this host by {parent}'s in the launch tree: this host \
                     too loaded to start them all in time (raise --join-timeout), or nrun \
                     hanging here{below}",
                    timeout.as_secs(),
                    waited.as_secs_f64()
                ),
            };
        }
        let check = format!(
            "check that {parent} reaches {label} over ssh with the same --ssh-opts (`ssh \
             {parent} ssh {label} true`), or pass --tree-width 0 to start every agent from this \
             host"
        );
        if let Some(said) = own_end {
            return format!(
                "{label}: ssh from {parent} (which starts {label}'s agent in the launch tree) \
                 {said}; {check}{below}"
            );
        }
        format!(
            "{label}: did not join within {} s (--join-timeout, {:.0} s waited); its agent is \
             started over ssh from {parent} in the launch tree: a slow host, or nrun hanging \
             there; {check}{below}",
            timeout.as_secs(),
            waited.as_secs_f64()
        )
    }

    fn result(
        &mut self,
        bus: &Bus,
        node: usize,
        no: usize,
        label: &str,
        stopped: bool,
    ) -> Option<StepResult> {
        if matches!(
            bus.result(node, no),
            Some(StepResult::Run(RunResult::Stopped))
        ) {
            // Stopped with everyone else when its inner agent was lost: its ssh went with that
            // agent, so it is lost too (it would not run the next attempt). Stopped unasked: say
            // why only once the line above had its chance to explain it.
            let line_gone = self.own_end(node).is_some() || self.ancestor_gone().is_some();
            if !stopped || line_gone {
                return self
                    .lost(bus, node, label, true)
                    .map(|why| StepResult::Run(RunResult::Lost(why)));
            }
        }
        super::judge_result(self, bus, node, no, label, stopped)
    }

    fn lost(&mut self, bus: &Bus, node: usize, label: &str, stopped: bool) -> Option<String> {
        let why = self.why_lost(bus, node, label, stopped)?;
        Some(Inner::named_lost(self.me.as_deref(), why))
    }

    fn end<'a>(&'a mut self, e: Ending<'a>) -> BoxFuture<'a, ()> {
        Box::pin(e.acknowledged())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_inner_agent_names_its_subtree() {
        let nudges = Arc::new(Nudges::default());
        let below = (3..40).map(|i| (i, format!("b{i}"))).collect();
        let inner = Inner::new(2, "b2", None, None, false, below, nudges.clone());
        assert_eq!(
            inner.through(),
            "; the 37 nodes started through it in the launch tree go with it: b3, b4, b5, b6, \
             b7, b8, b9, b10, ... (29 more)"
        );
        let one = Inner::new(
            2,
            "b2",
            None,
            None,
            false,
            vec![(3, "b3".into())],
            nudges.clone(),
        );
        assert_eq!(
            one.through(),
            "; the 1 node started through it in the launch tree goes with it: b3"
        );
        // Its loss is said once, and looks at the nodes below again.
        inner.lost_as("first");
        inner.lost_as("second");
        assert_eq!(inner.gone(None, &Keys::new("r")).as_deref(), Some("first"));
        assert_eq!(nudges.take().len(), 37);
    }
}
