//! A session: the store, one agent per node, and the numbered steps they run, from join to end.
//! The job, its preflight, `doctor` and `bisect` all drive their nodes through one [`Session`],
//! on one node or many.
//!
//! - this file: start (store, agents), join, [`Session::run_step`] (the one place that waits for
//!   nodes, stops them on a failure or a signal, and notices lost ones), end.
//! - [`agents`]: starting and ending agent processes (a local child, ssh, srun; `--ship`).
//! - [`check`]: interfaces, NAT, user variables, facts across nodes, node-to-node reachability.
//! - [`spec`]: the one builder of workers' specs (environment, prefixes, log and error files).
//!
//! A single node (no host list) is a cluster of one whose agent runs inside nrun: its steps are
//! executed by [`crate::agent::exec`] in this process, on the main thread (which the workers'
//! PR_SET_PDEATHSIG relies on), with the same stop requests a remote agent gets through the
//! store. Remote agents get their steps through the store and answer there; the session waits
//! on the store's change notification, not on a timer.

pub mod agents;
pub mod check;
pub mod spec;

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use crate::agent::exec;
use crate::agent::protocol::{Keys, RunResult, Step, StepResult, stop_value};

use crate::error::{Error, Result, exit};
use crate::facts::Facts;
use crate::node::{Caught, Signals, StopRequest};
use crate::plan::{NodesPlan, Plan, StorePlan};
use crate::store::{self, Store};
use crate::watch::WatchState;

pub use agents::AgentProcess;

/// How a node's agent runs.
pub enum Agent {
    /// Inside nrun: the single node of a run without a host list.
    InProcess,
    /// A child process: `nrun __agent` here, over ssh, or under srun.
    Process(Box<AgentProcess>),
    /// A node's own nrun that joins by itself (c10d): alive while its heartbeat moves.
    Peer(PeerBeat),
}

/// The last heartbeat seen from a node that joined by itself, and when it was seen.
#[derive(Default)]
pub struct PeerBeat {
    last: Option<(Vec<u8>, Instant)>,
}

/// A node's nrun that joined by itself is lost when its heartbeat (every second) stops this
/// long.
const PEER_SILENCE: Duration = Duration::from_secs(10);

/// A node of the session.
pub struct Node {
    /// How the user named it (for a single node, this host's name).
    pub label: String,
    pub agent: Agent,
    /// Set once the node has joined.
    pub joined: Option<JoinedNode>,
}

/// Where a remote agent connected from and where it answers probes: its
/// [`crate::agent::protocol::Joined`] record, the facts kept apart in [`JoinedNode::facts`].
pub struct AgentLink {
    pub local_addr: String,
    pub reached: String,
    pub probe_addr: String,
}

/// What the session knows of a node that joined.
pub struct JoinedNode {
    /// What the node reported (None for an in-process node asked for no facts).
    pub facts: Option<Facts>,
    /// How a remote agent reached the launch host.
    pub link: Option<AgentLink>,
    /// The interface its workers use (NCCL_SOCKET_IFNAME), if nrun chooses one.
    pub ifname: Option<String>,
    /// The address its workers reach the store on (MASTER_ADDR).
    pub master_addr: String,
    /// The address other nodes reach it on.
    pub addr: Option<IpAddr>,
}

impl Node {
    pub fn is_local(&self) -> bool {
        match &self.agent {
            Agent::InProcess => true,
            Agent::Process(p) => p.local,
            Agent::Peer(_) => false,
        }
    }
}

/// Where workers find the store, and the secret of nrun's keys in it (when this nrun hosts it;
/// a torchrun-style node of rank > 0 cannot know node 0's).
#[derive(Clone, Debug)]
pub struct Rendezvous {
    pub addr: String,
    pub port: u16,
    pub secret: Option<String>,
}

/// How [`Session::run_step`] waits.
#[derive(Clone, Copy, Debug)]
pub enum Policy {
    /// One job over all nodes: the first failure anywhere stops every node; a signal is
    /// forwarded to every worker, a second one kills.
    Together,
    /// Independent groups (bisect): each runs to its end or until `deadline`.
    Apart { deadline: Duration },
    /// Quick checks: an agent silent for 30 s has lost its connection.
    Probe,
}

/// The result of a step for each node (None: the node had no step, or did not answer).
pub type Results = Vec<Option<StepResult>>;

/// The in-process node's side of a step: its result, its watch views, its stop requests.
struct Local {
    node: Option<usize>,
    done: oneshot::Receiver<(usize, StepResult)>,
    views: mpsc::UnboundedReceiver<crate::agent::protocol::NodeWatch>,
    stop: watch::Sender<StopRequest>,
}

/// The store this nrun hosts.
struct Hosted {
    store: Arc<Store>,
    stop: Option<oneshot::Sender<()>>,
}

pub struct Session {
    pub nodes: Vec<Node>,
    pub plan: NodesPlan,
    pub rendezvous: Rendezvous,
    /// Distinguishes this run's keys (and temp files) from any other's.
    pub run: String,
    keys: Keys,
    hosted: Option<Hosted>,
    signals: Signals,
    step: usize,
    /// nrun's scratch directory for this run (error files of workers without a log dir).
    pub temp_root: PathBuf,
    /// The watch over the job's steps that ask for it (set by the run command).
    pub watch: Option<WatchState>,
    /// The nodes the job runs on now: those that joined; elastic runs drop lost nodes and take
    /// in late ones between attempts.
    pub active: Vec<usize>,
    /// The one srun step that started every node's agent (inside a Slurm allocation).
    pub step_process: Option<AgentProcess>,
    /// Elastic: the running group was stopped because nodes arrived to take in.
    pub grow: bool,
    arrivals_checked: Option<Instant>,
}

impl Session {
    /// Serves the store on `listener` (bound earlier, so a taken port was a usage error with
    /// nothing to clean up) and starts every node's agent.
    pub async fn start(
        plan: &Plan,
        nodes: &NodesPlan,
        listener: Option<std::net::TcpListener>,
    ) -> Result<Session> {
        let signals = Signals::install(&plan.forward_signals)?;
        // Leftovers of killed nruns: a directory listing off the launch's path.
        tokio::task::spawn_blocking(crate::node::keeper::sweep_scratch);
        crate::node::process::become_subreaper();
        // A static launch's other nodes run their own nrun, which cannot learn a secret.
        let static_launch = nodes.in_process && nodes.group_world > 1;
        let secret = match (&plan.c10d, static_launch) {
            // Nodes that start on their own agree on a secret only if they share one.
            (Some(c), _) => c.secret.clone(),
            // Static: only a secret every node was given (NRUN_RDZV_SECRET), derived alike.
            (None, true) => plan.static_secret.clone(),
            (None, false) => Some(random_secret()?),
        };
        let (rendezvous, hosted) = match (&plan.store, listener) {
            (StorePlan::Host { advertise, .. }, Some(l)) => {
                let port = l
                    .local_addr()
                    .map_err(|e| Error::internal(format!("store listener: {e}")))?
                    .port();
                let store = match &secret {
                    Some(s) => Store::with_secret(s.clone().into_bytes()),
                    None => Store::new(),
                };
                store.set_max_bytes(plan.store_max_bytes);
                // Every worker keeps a connection (torch opens more on init), every agent two.
                let needed = nodes.world as u64 * 2 + nodes.hosts.len() as u64 * 2 + 64;
                if let Some(hard) = crate::node::process::fd_hard_limit().filter(|h| *h < needed) {
                    tracing::warn!(
                        "the job's {} workers may need about {needed} open connections to the store, \
                         but this host allows {hard} open files (hard limit): raise it (limits.conf \
                         nofile, or ulimit -Hn as root) or expect clients to be refused",
                        nodes.world
                    );
                }
                // One node whose workers reach the store over loopback: nothing else may.
                let local = nodes.in_process
                    && !static_launch
                    && advertise.parse::<IpAddr>().is_ok_and(|a| a.is_loopback());
                if local {
                    store.loopback_only();
                }
                let stop = serve(l, store.clone())?;
                let addr = if advertise.is_empty() {
                    "127.0.0.1".to_string()
                } else {
                    advertise.clone()
                };
                (
                    Rendezvous { addr, port, secret },
                    Some(Hosted {
                        store,
                        stop: Some(stop),
                    }),
                )
            }
            (StorePlan::Remote { addr, port }, _) => (
                Rendezvous {
                    addr: addr.clone(),
                    port: *port,
                    secret: plan.static_secret.clone(),
                },
                None,
            ),
            (StorePlan::Host { .. }, None) => return Err(Error::internal("store was not bound")),
        };
        tracing::debug!("store at {}:{}", rendezvous.addr, rendezvous.port);
        // A static launch's nodes each run their own nrun: they share a run's keys by its id.
        let run = match static_launch {
            true => plan.run_id.clone(),
            false => format!("{}-{}", plan.run_id, std::process::id()),
        };
        let mut session = Session {
            nodes: Vec::new(),
            plan: nodes.clone(),
            rendezvous,
            keys: Keys::new(&run),
            run,
            hosted,
            signals,
            step: 0,
            temp_root: crate::node::keeper::scratch_dir(std::process::id()),
            watch: None,
            active: Vec::new(),
            step_process: None,
            grow: false,
            arrivals_checked: None,
        };
        if let (Some(c), Some(st)) = (&plan.c10d, session.store()) {
            // What a joining node needs to find this run's keys.
            st.set(
                &crate::agent::protocol::c10d_run_key(&c.id),
                session.run.as_bytes(),
            );
        }
        session.nodes = if nodes.in_process {
            vec![Node {
                label: nodes.hosts[0].name.clone(),
                agent: Agent::InProcess,
                joined: None,
            }]
        } else {
            let (nodes, step) = agents::start_all(&session, plan).await?;
            session.step_process = step;
            nodes
        };
        Ok(session)
    }

    /// The store this nrun hosts (none on a static launch's node of rank > 0).
    pub fn store(&self) -> Option<&Arc<Store>> {
        self.hosted.as_ref().map(|h| &h.store)
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// How many nodes the session has.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Nodes that joined, in order.
    pub fn joined(&self) -> impl Iterator<Item = (usize, &Node, &JoinedNode)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.joined.as_ref().map(|j| (i, n, j)))
    }

    /// Waits until every agent joined, exited, or --join-timeout passed. Returns the nodes
    /// that did not join, each with what ssh or the agent said. `Err`: interrupted (the exit
    /// code). `facts`: gather an in-process node's facts too (doctor).
    pub async fn join(
        &mut self,
        facts: bool,
        python: Option<PathBuf>,
    ) -> Result<Vec<(usize, String)>, u8> {
        let static_launch = self.plan.group_world > 1;
        for n in &mut self.nodes {
            if !matches!(n.agent, Agent::InProcess) {
                continue;
            }
            let facts = match facts {
                true => {
                    let py = python.clone();
                    tokio::task::spawn_blocking(move || crate::facts::gather(py.as_deref()))
                        .await
                        .ok()
                }
                false => None,
            };
            // A static launch's node finds its interface by the route to node 0's store.
            let ifname = static_launch
                .then(|| {
                    (self.rendezvous.addr.as_str(), self.rendezvous.port)
                        .to_socket_addrs()
                        .ok()
                        .and_then(|mut a| a.next())
                        .and_then(crate::net::route_interface)
                })
                .flatten();
            n.joined = Some(JoinedNode {
                facts,
                link: None,
                ifname,
                master_addr: self.rendezvous.addr.clone(),
                addr: None,
            });
        }
        if self.nodes.iter().all(|n| n.joined.is_some()) {
            return Ok(Vec::new());
        }
        agents::join(self).await
    }

    /// Elastic: whether a node outside the group has published its joined record (checked at
    /// most once a second).
    fn arrivals(&mut self) -> bool {
        if !self.elastic() || self.active.len() >= self.nodes.len() || self.active.is_empty() {
            return false;
        }
        let now = Instant::now();
        if self
            .arrivals_checked
            .is_some_and(|t| now - t < Duration::from_secs(1))
        {
            return false;
        }
        self.arrivals_checked = Some(now);
        (0..self.nodes.len())
            .filter(|i| !self.active.contains(i) && self.nodes[*i].joined.is_none())
            .any(|i| agents::joined_record(self, i).is_some())
    }

    /// Whether the job may go on with fewer nodes than it has (`--nnodes MIN:MAX`).
    pub fn elastic(&self) -> bool {
        self.plan.min_nodes < self.nodes.len()
    }

    /// The job's group: every node, or (elastic) the active ones, ranks numbered anew.
    pub fn group(&self) -> spec::Group {
        match self.active.len() == self.nodes.len() || self.active.is_empty() {
            true => spec::Group::all(self),
            false => spec::Group::of(self, &self.active),
        }
    }

    /// Between attempts of an elastic job: nodes `lost` leave the group, nodes that joined
    /// since come in. Err: fewer than MIN nodes are left (the message).
    pub fn reform(&mut self, lost: &[usize]) -> std::result::Result<(), String> {
        let before = self.active.len();
        self.active.retain(|i| !lost.contains(i));
        let late = agents::admit_late(self);
        if !late.is_empty() {
            // Their interfaces and addresses, as for the nodes that joined in time.
            let f = self.assign_interfaces();
            for w in f.warnings.iter().chain(&f.problems) {
                tracing::warn!("{w}");
            }
        }
        self.active.extend(late.iter().copied());
        self.active.sort_unstable();
        let names = |v: &[usize]| {
            v.iter()
                .map(|i| self.nodes[*i].label.clone())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if self.active.len() < self.plan.min_nodes {
            return Err(format!(
                "{} node(s) left ({}) after losing {}: under the --nnodes minimum of {}",
                self.active.len(),
                names(&self.active),
                names(lost),
                self.plan.min_nodes
            ));
        }
        if self.active.len() != before || !late.is_empty() {
            tracing::warn!(
                "the job goes on with {} nodes: {}{}{}",
                self.active.len(),
                names(&self.active),
                match lost.is_empty() {
                    true => String::new(),
                    false => format!(" (lost: {})", names(lost)),
                },
                match late.is_empty() {
                    true => String::new(),
                    false => format!(" (joined: {})", names(&late)),
                }
            );
        }
        Ok(())
    }

    /// Sends each node its step (`None`: the node sits this step out) and waits for the results
    /// as `policy` says. `Err`: interrupted, with the exit code.
    pub async fn run_step(
        &mut self,
        steps: Vec<Option<Step>>,
        policy: Policy,
    ) -> Result<Results, u8> {
        let step = self.step;
        self.step += 1;
        let mut local = None;
        let mut waiting = Vec::new();
        for (i, s) in steps.into_iter().enumerate() {
            let Some(s) = s else {
                // Sitting out: an empty step keeps its agent's count of steps in line (a node
                // outside the group, or one that joined late); nobody waits for its answer.
                if matches!(self.nodes[i].agent, Agent::Process(_) | Agent::Peer(_)) {
                    self.set_step(i, step, &Step::idle());
                }
                continue;
            };
            match self.nodes[i].agent {
                // An in-process node has no loop to leave; it answers nothing to End.
                Agent::InProcess if matches!(s, Step::End) => continue,
                Agent::InProcess => local = Some((i, s)),
                Agent::Process(_) | Agent::Peer(_) => self.set_step(i, step, &s),
            }
            waiting.push(i);
        }
        let (stop_tx, stop_rx) = watch::channel(StopRequest::None);
        let (done_tx, done_rx) = oneshot::channel();
        let (views_tx, views_rx) = mpsc::unbounded_channel();
        // The in-process node runs in this very future (see the module doc), beside the wait.
        let local_node = local.as_ref().map(|(i, _)| *i);
        let secret = self.rendezvous.secret.clone();
        let here = async move {
            let Some((i, step)) = local else { return };
            let r = match step {
                Step::Run {
                    workers,
                    grace_ms,
                    deadline_ms,
                    watch,
                } => {
                    let views = watch.then_some(views_tx);
                    let r = exec::run_workers(
                        workers,
                        grace_ms,
                        deadline_ms,
                        stop_rx,
                        views,
                        secret.as_deref(),
                    );
                    StepResult::Run(r.await)
                }
                Step::Probe { target, timeout_ms } => StepResult::Probe {
                    error: exec::probe_peer(&target, timeout_ms).await.err(),
                },
                Step::End => return,
            };
            let _ = done_tx.send((i, r));
        };
        let local = Local {
            node: local_node,
            done: done_rx,
            views: views_rx,
            stop: stop_tx,
        };
        let wait = self.wait(step, &waiting, local, policy);
        let ((), results) = tokio::join!(here, wait);
        results
    }

    fn set_step(&self, node: usize, step: usize, s: &Step) {
        if let Some(h) = &self.hosted {
            let key = self.keys.step(node, step);
            let json = serde_json::to_vec(s).unwrap_or_default();
            // Sealed with the run's secret: an agent runs no step it cannot verify.
            let secret = self.rendezvous.secret.as_deref().unwrap_or("");
            h.store.set(
                &key,
                &crate::store::auth::seal(secret.as_bytes(), &key, &json),
            );
        }
    }

    /// Waits for the results of `step` from the nodes in `waiting`.
    async fn wait(
        &mut self,
        step: usize,
        waiting: &[usize],
        here: Local,
        policy: Policy,
    ) -> Result<Results, u8> {
        let Local {
            node: local,
            mut done,
            mut views,
            stop: stop_local,
        } = here;
        let mut results: Results = vec![None; self.nodes.len()];
        let started = Instant::now();
        let mut changed = self.store().map(|s| s.subscribe());
        let mut local_pending = local.is_some();
        let hosts: Vec<String> = self.nodes.iter().map(|n| n.label.clone()).collect();
        // The remote views last read, so an unchanged one is not parsed again.
        let mut last_views: Vec<Vec<u8>> = vec![Vec::new(); self.nodes.len()];
        let mut stopped = false;
        let mut signalled = 0;
        // Signals passed on during this step, numbering their keys.
        let mut forwarded = 0;
        loop {
            if local_pending {
                if let Ok((i, r)) = done.try_recv() {
                    results[i] = Some(r);
                    local_pending = false;
                }
            }
            for &i in waiting {
                if results[i].is_some() || Some(i) == local {
                    continue;
                }
                results[i] = self.remote_result(i, step, stopped);
            }
            if waiting.iter().all(|&i| results[i].is_some()) {
                return Ok(results);
            }
            match policy {
                Policy::Probe if started.elapsed() > Duration::from_secs(30) => {
                    for &i in waiting {
                        let label = &self.nodes[i].label;
                        results[i].get_or_insert_with(|| StepResult::Probe {
                            error: Some(format!(
                                "{label}'s agent did not answer within 30 s; check that the \
                                 launch host still reaches it (ssh {label} true)"
                            )),
                        });
                    }
                    return Ok(results);
                }
                Policy::Apart { deadline } if started.elapsed() > deadline => return Ok(results),
                _ => {}
            }
            let failed = results
                .iter()
                .any(|r| matches!(r, Some(StepResult::Run(r)) if r.is_failure()));
            // Elastic, as torchrun: a node waiting to join makes the group re-form with it.
            if matches!(policy, Policy::Together) && !stopped && self.arrivals() {
                tracing::warn!("a node joined: the worker group restarts to take it in");
                self.grow = true;
                self.stop_step(step, None, &stop_local);
                stopped = true;
            }
            if matches!(policy, Policy::Together) && failed && !stopped {
                self.stop_step(step, None, &stop_local);
                stopped = true;
            }
            if self.watch.is_some() {
                self.remote_views(step, waiting, local, &mut last_views);
                let hang = self.watch.as_mut().is_some_and(|w| w.check(&hosts));
                if hang && !stopped {
                    self.stop_step(step, None, &stop_local);
                    stopped = true;
                }
            }
            let tick = tokio::time::sleep(Duration::from_millis(50));
            tokio::select! {
                // An agent's record arrived.
                () = store_changed(&mut changed) => {}
                Some(v) = views.recv() => {
                    if let (Some(w), Some(i)) = (self.watch.as_mut(), local) {
                        w.observe(i, v);
                    }
                }
                r = &mut done, if local_pending => {
                    local_pending = false;
                    if let Ok((i, r)) = r {
                        results[i] = Some(r);
                    }
                }
                // Agents' processes are checked on this tick (a dropped ssh, a dead host).
                _ = tick => {}
                caught = self.signals.recv() => {
                    let sig = match caught {
                        Caught::Stop(sig) => sig,
                        Caught::Forward(sig) => {
                            self.forward_step(step, forwarded, sig, &stop_local);
                            forwarded += 1;
                            continue;
                        }
                    };
                    signalled += 1;
                    stopped = true;
                    if signalled >= 2 {
                        let _ = stop_local.send(StopRequest::Kill(sig));
                    } else {
                        self.stop_step(step, Some(sig), &stop_local);
                    }
                    // A job waits for its workers to stop; a second signal stops waiting, and
                    // other kinds of steps stop waiting at once.
                    if signalled >= 2 || !matches!(policy, Policy::Together) {
                        tracing::warn!("interrupted; stopping every node");
                        return Err(exit::signal(sig));
                    }
                }
            }
        }
    }

    /// The views the remote nodes of `step` published since `last` was read, into the watch.
    fn remote_views(
        &mut self,
        step: usize,
        waiting: &[usize],
        local: Option<usize>,
        last: &mut [Vec<u8>],
    ) {
        let (Some(store), Some(w)) = (self.hosted.as_ref().map(|h| &h.store), self.watch.as_mut())
        else {
            return;
        };
        for &i in waiting.iter().filter(|i| Some(**i) != local) {
            let Some(raw) = store.get(&self.keys.watch(i, step)) else {
                continue;
            };
            if raw == last[i] {
                continue;
            }
            if let Ok(v) = serde_json::from_slice(&raw) {
                w.observe(i, v);
            }
            last[i] = raw;
        }
    }

    /// Passes signal `sig` (the `seq`th of the step) to every worker of `step` on every node.
    fn forward_step(&self, step: usize, seq: usize, sig: i32, local: &watch::Sender<StopRequest>) {
        if let Some(h) = &self.hosted {
            h.store
                .set(&self.keys.signal(step, seq), sig.to_string().as_bytes());
        }
        let _ = local.send(StopRequest::Forward(sig));
    }

    /// Asks every node to stop `step`: forwarding the user's signal, or politely.
    fn stop_step(&self, step: usize, signal: Option<i32>, local: &watch::Sender<StopRequest>) {
        if let Some(h) = &self.hosted {
            h.store.set(&self.keys.stop(step), &stop_value(signal));
        }
        let _ = local.send(signal.map_or(StopRequest::Polite, StopRequest::Signal));
    }

    /// Node `i`'s result of `step`, if it has one or is lost.
    fn remote_result(&mut self, i: usize, step: usize, stopped: bool) -> Option<StepResult> {
        let raw = self.store().and_then(|s| s.get(&self.keys.result(i, step)));
        let Some(raw) = raw else {
            // The node's agent is gone (ssh dropped, host died): it will not report.
            return self
                .lost(i, false)
                .map(|why| StepResult::Run(RunResult::Lost(why)));
        };
        let r: StepResult = serde_json::from_slice(&raw).ok()?;
        // Stopped without being asked: that agent lost its connection to us.
        if !stopped && matches!(r, StepResult::Run(RunResult::Stopped)) {
            let why = self.lost(i, true).unwrap_or_else(|| {
                format!(
                    "{}'s agent lost its connection to the launch host",
                    self.nodes[i].label
                )
            });
            return Some(StepResult::Run(RunResult::Lost(why)));
        }
        // Interrupted without being asked: a signal on that node (its agent's keeper killed,
        // srun's, or a user's there) took it out of the job.
        if let (false, StepResult::Run(RunResult::Interrupted(sig))) = (stopped, &r) {
            let why = format!(
                "{}'s agent was stopped by {} on that node",
                self.nodes[i].label,
                crate::node::signal_name(*sig)
            );
            return Some(StepResult::Run(RunResult::Lost(why)));
        }
        Some(r)
    }

    /// Whether node `i`'s agent is lost, and how: its process ended, or (`stopped`: it stopped
    /// its workers unasked) its connection to the launch host broke while ssh may still close.
    fn lost(&mut self, i: usize, stopped: bool) -> Option<String> {
        if matches!(self.nodes.get(i)?.agent, Agent::Peer(_)) {
            return self.peer_lost(i, stopped);
        }
        let n = self.nodes.get_mut(i)?;
        let Agent::Process(p) = &mut n.agent else {
            return None;
        };
        match p.exited() {
            None => stopped.then(|| {
                format!(
                    "lost the connection to {}: its agent stopped its workers when the link to the launch host broke",
                    n.label
                )
            }),
            Some(st) => Some(format!(
                "lost the connection to {} ({st}){}",
                n.label,
                p.last_words().map_or(String::new(), |s| format!(": {s}"))
            )),
        }
    }

    /// Whether node `i`, whose own nrun joined (c10d) or whose agent the srun step started, is
    /// lost: the step ended, it stopped unasked, or its heartbeat has been still too long.
    fn peer_lost(&mut self, i: usize, stopped: bool) -> Option<String> {
        let label = self.nodes[i].label.clone();
        if let Some(p) = self.step_process.as_mut() {
            if let Some(st) = p.exited() {
                return Some(format!(
                    "lost {label}: the srun step running its agent ended ({st}){}",
                    p.last_words().map_or(String::new(), |w| format!(": {w}"))
                ));
            }
        }
        let beat = self
            .store()
            .and_then(|st| st.get(&self.keys.alive(i)))
            .unwrap_or_default();
        let Agent::Peer(b) = &mut self.nodes[i].agent else {
            return None;
        };
        let now = Instant::now();
        if b.last.as_ref().is_none_or(|(v, _)| *v != beat) {
            b.last = Some((beat, now));
        }
        let quiet = b.last.as_ref().map_or(Duration::ZERO, |(_, t)| now - *t);
        let why = match (stopped, quiet > PEER_SILENCE) {
            (true, _) => "stopped its workers when its link to this host broke".to_string(),
            (false, true) => format!("sent no heartbeat for {} s", PEER_SILENCE.as_secs()),
            (false, false) => return None,
        };
        Some(format!(
            "lost {label}: its nrun {why}; check that it still runs there and reaches this host"
        ))
    }

    /// Ends the session: agents leave their step loop, their connections close, the store stops.
    pub async fn end(self) {
        self.end_with(exit::SUCCESS).await
    }

    /// Ends the session, telling nodes that joined by themselves the job's exit code (their nrun
    /// exits with it).
    pub async fn end_with(mut self, code: u8) {
        let step = self.step;
        if let Some(st) = self.store() {
            st.set(&self.keys.exit(), code.to_string().as_bytes());
        }
        for i in 0..self.nodes.len() {
            if matches!(self.nodes[i].agent, Agent::Process(_) | Agent::Peer(_)) {
                self.set_step(i, step, &Step::End);
            }
        }
        // A node that joined by itself reads its End before the store goes away.
        if self.nodes.iter().any(|n| matches!(n.agent, Agent::Peer(_))) {
            self.wait_peers_ended(step).await;
        }
        agents::end_all(&mut self.nodes, &mut self.step_process).await;
        if let Some(stop) = self.hosted.as_mut().and_then(|h| h.stop.take()) {
            let _ = stop.send(());
        }
        let _ = std::fs::remove_dir_all(&self.temp_root);
    }
}

impl Session {
    /// Waits (up to 5 s) until every node that joined by itself acknowledged the End step.
    async fn wait_peers_ended(&self, step: usize) {
        let until = Instant::now() + Duration::from_secs(5);
        let peers: Vec<usize> = (0..self.nodes.len())
            .filter(|i| {
                matches!(self.nodes[*i].agent, Agent::Peer(_)) && self.nodes[*i].joined.is_some()
            })
            .collect();
        while Instant::now() < until {
            let done = peers.iter().all(|i| {
                self.store()
                    .is_none_or(|st| st.get(&self.keys.result(*i, step)).is_some())
            });
            if done {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Resolves when a client has written one of nrun's keys (never, without a store here).
pub(crate) async fn store_changed(rx: &mut Option<watch::Receiver<u64>>) {
    match rx.as_mut() {
        Some(c) => {
            let _ = c.changed().await;
        }
        None => std::future::pending().await,
    }
}

/// Serves `store` on `listener` until the returned sender fires (or is dropped).
pub fn serve(listener: std::net::TcpListener, store: Arc<Store>) -> Result<oneshot::Sender<()>> {
    let l = tokio::net::TcpListener::from_std(listener)
        .map_err(|e| Error::internal(format!("store listener: {e}")))?;
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        store::server::serve(l, store, async {
            let _ = rx.await;
        })
        .await
    });
    Ok(tx)
}

/// Binds the store's port when this node hosts it. Done before anything else starts so a port
/// that is taken is a usage error with nothing to clean up.
pub fn bind_store(plan: &Plan) -> Result<Option<std::net::TcpListener>> {
    let StorePlan::Host { port, .. } = plan.store else {
        return Ok(None);
    };
    match store::server::bind(port) {
        Ok(l) => Ok(Some(l)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(Error::usage(format!(
            "--master-port {port} is already in use on this host (another job or store?); pick \
             another port, or omit --master-port and nrun binds a free one"
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(Error::usage(format!(
            "--master-port {port}: permission denied binding it (ports below 1024 need root); pick \
             a port above 1024 or omit --master-port"
        ))),
        Err(e) => Err(Error::internal(format!(
            "cannot bind the store on port {port}: {e}"
        ))),
    }
}

/// A c10d rendezvous' store, when this nrun is the one to host it: its endpoint names this
/// host and the port was free. None: another nrun hosts it (join that one).
pub fn bind_rendezvous(plan: &Plan) -> Result<Option<std::net::TcpListener>> {
    let Some(c) = &plan.c10d else {
        return Ok(None);
    };
    // A node index the launcher fixed decides: node 0 hosts, whatever its name resolves to.
    match c.node {
        Some(0) => {}
        Some(_) => return Ok(None),
        None if !crate::net::is_this_host(&c.host) => return Ok(None),
        None => {}
    }
    match store::server::bind(c.port) {
        Ok(l) => Ok(Some(l)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && c.node.is_none() => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(Error::usage(format!(
            "port {} on {} (node 0 of this srun step) is taken: another job's store? give \
             --rdzv-endpoint HOST:PORT with a free port",
            c.port, c.host
        ))),
        Err(e) => Err(Error::usage(format!(
            "--rdzv-endpoint {}:{}: cannot listen on that port here: {e}",
            c.host, c.port
        ))),
    }
}

/// The secret of nrun's keys for one run.
fn random_secret() -> Result<String> {
    crate::store::auth::random_hex().map_err(|e| {
        Error::internal(format!(
            "cannot get random bytes from the OS (getrandom) for the run's secret: {e}"
        ))
    })
}

/// The coordinator's addresses for agents to try, "ip:port".
pub fn coordinator_addrs(port: u16) -> Vec<String> {
    crate::net::reachable_addrs(&crate::net::interfaces())
        .into_iter()
        .map(|ip| SocketAddr::new(ip, port).to_string())
        .collect()
}
