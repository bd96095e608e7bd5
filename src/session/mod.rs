//! A session: the store, one link per node, and the numbered steps they run, from join to end.
//! The job, its preflight, `doctor` and `bisect` all drive their nodes through one [`Session`],
//! on one node or many.
//!
//! - this file: start (store, links), elastic re-forming, end.
//! - [`link`]: the seam: one [`link::NodeLink`] per node, whatever kind of agent serves it
//!   (in-process, a child process here or over ssh, an srun step, a c10d peer), and the launcher
//!   choice. Nothing else in the session knows the kinds.
//! - [`join`]: waiting for the nodes' join records; late arrivals of an elastic job.
//! - [`step`]: [`Session::run_step`], the one place that waits for nodes, stops them on a
//!   failure or a signal, and notices lost ones.
//! - [`check`]: interfaces, NAT, user variables, facts across nodes, node-to-node reachability.
//! - [`roster`]: which nodes run the job, the spares, the nodes left out and why.
//! - [`again`]: a node lost mid-run is started again in the background until it comes back.
//! - [`spec`]: the one builder of workers' specs (environment, prefixes, log and error files).
//!
//! Remote agents get their steps through the store and answer there; the session waits on the
//! store's change notification (and the in-process node's wake), not on a timer.

pub(crate) mod again;
pub(crate) mod c10d;
pub(crate) mod check;
pub(crate) mod join;
pub(crate) mod link;
pub(crate) mod meet;
pub(crate) mod roster;
pub(crate) mod spec;
pub(crate) mod step;
pub(crate) mod succession;

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{oneshot, watch};

use crate::facts::Facts;
use crate::plan::{NodesPlan, SessionPlan, StorePlan};
use crate::protocol::{Keys, Step};
use crate::watch::WatchState;
use nrun_base::error::{Error, Result, exit};
use nrun_node::Signals;
use nrun_store::{self as store, Store};

pub(crate) use link::NodeLink;
pub(crate) use step::Policy;

/// A node of the session.
pub(crate) struct Node {
    /// How the user named it (for a single node, this host's name).
    pub label: String,
    /// How the session reaches it.
    pub link: Box<dyn NodeLink>,
    /// Set once the node has joined.
    pub joined: Option<JoinedNode>,
}

impl Node {
    pub(crate) fn new(label: &str, link: Box<dyn NodeLink>) -> Node {
        Node {
            label: label.to_string(),
            link,
            joined: None,
        }
    }

    pub(crate) fn is_local(&self) -> bool {
        self.link.is_local()
    }

    /// Which machine and network stack it is, as its kernel said when it joined (None:
    /// unknown: not joined, or no facts).
    pub(crate) fn machine(&self) -> Option<&str> {
        let m = &self.joined.as_ref()?.facts.as_ref()?.machine;
        (!m.is_empty()).then_some(m.as_str())
    }
}

impl Session {
    /// Whether nodes `a` and `b` are one machine and network stack: their kernels say so
    /// (boot id and network namespace), or both are the launch host's own. Host names never
    /// decide it: cloned machines share one.
    pub(crate) fn same_machine(&self, a: usize, b: usize) -> bool {
        let (x, y) = (&self.nodes[a], &self.nodes[b]);
        (x.is_local() && y.is_local())
            || matches!((x.machine(), y.machine()), (Some(m), Some(n)) if m == n)
    }

    /// The label of node `i`'s machine: that of the first node that is the same machine, so
    /// that nodes of one machine share it and every other machine has its own (labels are the
    /// names the user gave, distinct where host names are not).
    pub(crate) fn machine_label(&self, i: usize) -> String {
        (0..i).find(|&j| self.same_machine(i, j)).map_or_else(
            || self.nodes[i].label.clone(),
            |j| self.nodes[j].label.clone(),
        )
    }
}

/// Where a remote agent connected from and where it answers probes: its
/// [`crate::protocol::Joined`] record, the facts kept apart in [`JoinedNode::facts`].
pub(crate) struct AgentLink {
    pub local_addr: String,
    pub reached: String,
    /// How the agent chose `reached`.
    pub chosen: crate::protocol::AddrChoice,
    pub probe_addr: String,
}

/// What the session knows of a node that joined.
pub(crate) struct JoinedNode {
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

/// Where workers find the store, and the secret of nrun's keys in it (when this nrun hosts it;
/// a torchrun-style node of rank > 0 cannot know node 0's).
#[derive(Clone, Debug)]
pub(crate) struct Rendezvous {
    pub addr: String,
    pub port: u16,
    pub secret: Option<String>,
}

pub(crate) struct Session {
    pub nodes: Vec<Node>,
    pub plan: NodesPlan,
    rendezvous: Rendezvous,
    /// Distinguishes this run's keys (and temp files) from any other's.
    run: String,
    /// The run's name as the user gave it (TORCHELASTIC_RUN_ID).
    pub run_id: String,
    /// The conversation with the nodes' agents through the store.
    bus: link::Bus,
    /// Stops the store this nrun hosts.
    store_stop: Option<oneshot::Sender<()>>,
    signals: Signals,
    step: usize,
    /// The watch over the job's steps that ask for it (set by the run command).
    watch: Option<WatchState>,
    /// The nodes the job runs on, the spares, those left out and why (see [`roster`]): lost or
    /// failing nodes leave, spares and an elastic job's late joiners come in, between attempts.
    roster: roster::Roster,
    arrivals_checked: Option<Instant>,
    /// The c10d rendezvous this nrun hosts (its id): nodes that come back join it.
    c10d_id: Option<String>,
    /// Lost nodes' agents started again in the background, and those that came back.
    returns: again::Returns,
    /// The c10d form's host: the succession its steps carry (see [`succession`]).
    hosting: Option<succession::Hosting>,
    /// The job's events and phases (the goodput ledger, `--events`, the metrics).
    pub journal: crate::journal::Journal,
}

impl Session {
    /// Serves the store on `listener` (bound earlier, so a taken port was a usage error with
    /// nothing to clean up) and starts every node's agent.
    pub(crate) async fn start(
        plan: &SessionPlan,
        nodes: &NodesPlan,
        listener: Option<std::net::TcpListener>,
    ) -> Result<Session> {
        let mut signals = Signals::install(&plan.forward_signals)?;
        signals.stop_on_closed_console();
        // Leftovers of killed nruns: a directory listing off the launch's path.
        tokio::task::spawn_blocking(nrun_base::files::sweep_scratch);
        nrun_node::process::become_subreaper();
        // A static launch's other nodes run their own nrun, which cannot learn a secret.
        let static_launch = nodes.in_process && nodes.group_world > 1;
        let secret = match (&plan.c10d, static_launch) {
            // Nodes that start on their own agree on a secret only if they share one.
            (Some(c), _) => c.secret.clone(),
            // Static: only a secret every node was given (NRUN_RDZV_SECRET), derived alike.
            (None, true) => plan.static_secret.clone(),
            (None, false) => Some(random_secret()?),
        };
        let (rendezvous, hosted) = host_store(plan, nodes, listener, secret, static_launch)?;
        tracing::debug!("store at {}:{}", rendezvous.addr, rendezvous.port);
        // A static launch's nodes each run their own nrun: they share a run's keys by its id.
        let run = match static_launch {
            true => plan.run_id.clone(),
            false => format!("{}-{}", plan.run_id, std::process::id()),
        };
        let (store, store_stop) = hosted.unzip();
        let mut session = Session {
            nodes: Vec::new(),
            plan: nodes.clone(),
            bus: link::Bus {
                store,
                keys: Keys::new(&run),
                secret: rendezvous.secret.clone(),
                wake: Arc::default(),
                nonces: Default::default(),
                nudges: Arc::default(),
                controls: Default::default(),
                silence: (nodes.agent_timeout / 2).max(link::MIN_SILENCE),
            },
            rendezvous,
            run,
            run_id: plan.run_id.clone(),
            store_stop,
            signals,
            step: 0,
            watch: None,
            roster: roster::Roster::default(),
            arrivals_checked: None,
            c10d_id: None,
            returns: again::Returns::new(),
            hosting: None,
            journal: crate::journal::Journal::new(&plan.run_id),
        };
        session.announce(plan);
        let starting = link::Starting {
            plan: &session.plan,
            session: plan,
            rendezvous: &session.rendezvous,
            run: &session.run,
            nudges: &session.bus.nudges,
            store: session.bus.store.clone(),
        };
        let again = link::Again::new(&starting).map(Arc::new);
        // Thousands of agents take a while to start: a stop signal meanwhile ends nrun at once
        // (the agents started so far die with it: PR_SET_PDEATHSIG, their stdin closed).
        let began = Instant::now();
        session.nodes = tokio::select! {
            nodes = link::start(starting) => nodes?,
            sig = session.signals.stop() => {
                tracing::warn!("interrupted while starting the nodes' agents; stopping");
                return Err(Error::interrupted(sig));
            }
        };
        tracing::debug!(
            "{} agents started in {:.3} s",
            session.nodes.len(),
            began.elapsed().as_secs_f64()
        );
        session.returns.again = again;
        Ok(session)
    }

    /// Writes what an nrun that connects may read: that an nrun listens here, and the c10d
    /// rendezvous it hosts (what a joining node needs to find this run's keys).
    fn announce(&mut self, plan: &SessionPlan) {
        if let (Some(c), Some(st)) = (&plan.c10d, self.store()) {
            // What a joining node needs to find this run's keys.
            st.set(&crate::protocol::c10d_run_key(&c.id), self.run.as_bytes());
            st.set(&crate::protocol::c10d_public_key(&c.id), b"1");
        }
        // Nodes join it in order; one that comes back gets the next index (join::open_slots).
        if self.store().is_some() && plan.c10d.as_ref().is_some_and(|c| c.node.is_none()) {
            self.c10d_id = plan.c10d.as_ref().map(|c| c.id.clone());
            // The c10d form's host is replaceable: its steps say who takes over.
            self.hosting = plan.c10d.as_ref().map(|c| succession::Hosting {
                id: c.id.clone(),
                host: c.host.clone(),
                epoch: c.took_over.as_ref().map_or(1, |t| t.epoch),
                lineage: c
                    .took_over
                    .as_ref()
                    .map_or_else(|| self.run.clone(), |t| t.lineage.clone()),
                port: c.port,
                quorum: c.took_over.as_ref().map_or(0, |t| t.quorum),
                alive: c.took_over.as_ref().map_or(0, |t| t.alive),
                last: None,
            });
        }
        if let (Some(h), Some(st)) = (&self.hosting, self.store()) {
            // Read before joining: a node that knew a newer host refuses this one.
            st.set(
                &crate::protocol::c10d_epoch_key(&h.id),
                format!("{} {}", h.epoch, h.lineage).as_bytes(),
            );
        }
        if let Some(st) = self.store() {
            // Any nrun that connects may read that an nrun listens here, and (set before this,
            // so one who sees this sees that) which c10d rendezvous it hosts: a node of another
            // job or launcher is told so (session::c10d).
            st.set(
                crate::protocol::NRUN_STORE_KEY,
                nrun_base::VERSION.as_bytes(),
            );
        }
    }

    /// The run is this host's node alone, served inside nrun (no host list).
    pub(crate) fn in_process(&self) -> bool {
        self.nodes.first().is_some_and(|n| n.link.kind().in_process)
    }

    /// The store this nrun hosts (none on a static launch's node of rank > 0).
    pub(crate) fn store(&self) -> Option<&Arc<Store>> {
        self.bus.store.as_ref()
    }

    pub(crate) fn keys(&self) -> &Keys {
        &self.bus.keys
    }

    /// Where workers find the store.
    pub(crate) fn rendezvous(&self) -> &Rendezvous {
        &self.rendezvous
    }

    /// What distinguishes this run's keys (and temp files) from any other's.
    pub(crate) fn run(&self) -> &str {
        &self.run
    }

    /// The watch over the job's steps, when the job has one.
    pub(crate) fn watch(&self) -> Option<&WatchState> {
        self.watch.as_ref()
    }

    /// Watches the job's steps from now on (None: no more).
    pub(crate) fn set_watch(&mut self, watch: Option<WatchState>) {
        self.watch = watch;
    }

    /// The watch starts afresh for a step of `world` ranks (a restart's).
    pub(crate) fn reset_watch(&mut self, world: usize) {
        if let Some(w) = self.watch.as_mut() {
            w.reset(world);
        }
    }

    /// How many nodes the session has.
    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Nodes that joined, in order.
    pub(crate) fn joined(&self) -> impl Iterator<Item = (usize, &Node, &JoinedNode)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.joined.as_ref().map(|j| (i, n, j)))
    }

    /// Whether the job may go on with fewer nodes than it wants (`--nnodes MIN:MAX`).
    pub(crate) fn elastic(&self) -> bool {
        self.plan.min_nodes < self.plan.size
    }

    /// The job's group: every node as laid out, or the active ones, ranks numbered anew in
    /// node order (spares, left-out nodes, an elastic job's re-forming).
    pub(crate) fn group(&self) -> spec::Group {
        let active = self.roster.active();
        match active.len() == self.nodes.len() || active.is_empty() {
            true => spec::Group::all(self),
            false => spec::Group::of(self, active),
        }
    }

    /// Ends the session: agents leave their step loop, their connections close, the store stops.
    pub(crate) async fn end(self) {
        self.end_with(exit::SUCCESS).await
    }

    /// Ends the session, telling nodes that joined by themselves the job's exit code (their nrun
    /// exits with it).
    pub(crate) async fn end_with(mut self, code: u8) {
        // A node come back but not taken in yet still gets its End (its nrun waits on it).
        self.open_slots();
        self.adopt_back();
        let no = self.step;
        self.bus.exit(code);
        for (i, n) in self.nodes.iter_mut().enumerate() {
            n.link.deliver(&self.bus, i, no, Some(&Step::End));
        }
        let bus = &self.bus;
        let left: Vec<usize> = self.roster.left_out().iter().map(|l| l.node).collect();
        let ends = self
            .nodes
            .iter_mut()
            .enumerate()
            .map(|(i, n)| {
                // A node left out whose agent's connection closed (the store removed its
                // heartbeat) has nobody left to acknowledge the End: no wait for it.
                let gone = left.contains(&i) && bus.heartbeat(i).is_empty();
                let joined = n.joined.is_some() && !gone;
                n.link.end(link::Ending {
                    bus,
                    node: i,
                    no,
                    joined,
                })
            })
            .collect();
        let began = Instant::now();
        link::join_all(ends).await;
        tracing::debug!("the nodes ended in {:.3} s", began.elapsed().as_secs_f64());
        if let Some(stop) = self.store_stop.take() {
            let _ = stop.send(());
        }
        // A c10d job that ended (not one whose host stood down) has no host to find any more.
        if let Some(h) = &self.hosting
            && !succession::standing_down()
        {
            let _ = std::fs::remove_file(succession::state_file(&h.id));
        }
        // The in-process node's scratch (this process's).
        nrun_base::files::remove_scratch();
    }
}

/// How often the join and the step's wait look at every node (links with nothing to nudge: an
/// srun step, a silent heartbeat; below the heartbeat's 500 ms "looked away"): between those
/// looks, only the nodes whose keys changed or whose links nudged are looked at.
const LOOK_ALL: std::time::Duration = std::time::Duration::from_millis(250);

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
pub(crate) fn serve(
    listener: std::net::TcpListener,
    store: Arc<Store>,
) -> Result<oneshot::Sender<()>> {
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
pub(crate) fn bind_store(plan: &SessionPlan) -> Result<Option<std::net::TcpListener>> {
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
pub(crate) fn bind_rendezvous(plan: &SessionPlan) -> Result<Option<std::net::TcpListener>> {
    let Some(c) = &plan.c10d else {
        return Ok(None);
    };
    // A node index the launcher fixed decides: node 0 hosts, whatever its name resolves to.
    match c.node {
        Some(0) => {}
        Some(_) => return Ok(None),
        None if !nrun_base::net::is_this_host(&c.host) => return Ok(None),
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
    nrun_base::random_hex().map_err(|e| {
        Error::internal(format!(
            "cannot get random bytes from the OS (getrandom) for the run's secret: {e}"
        ))
    })
}

/// The coordinator's addresses for agents to try, "ip:port".
pub(crate) fn coordinator_addrs(port: u16) -> Vec<String> {
    nrun_base::net::reachable_addrs(&nrun_base::net::interfaces())
        .into_iter()
        .map(|ip| SocketAddr::new(ip, port).to_string())
        .collect()
}

/// The user's launch-host address for every remote agent (`--local-addr`), "ip:port"; a name
/// is resolved here. Err: it does not resolve (usage).
pub(crate) fn pinned_addr(plan: &SessionPlan, port: u16) -> Result<Option<String>> {
    let Some(a) = &plan.control_addr else {
        return Ok(None);
    };
    let found = (a.as_str(), port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut v| v.next());
    match found {
        Some(sa) => Ok(Some(
            SocketAddr::new(nrun_base::net::canonical(sa.ip()), port).to_string(),
        )),
        None => Err(Error::usage(format!(
            "--local-addr {a}: not an address of this host, nor a name it resolves"
        ))),
    }
}

/// The store this nrun hosts, and the stop that ends its serving.
type Hosted = (Arc<Store>, oneshot::Sender<()>);

/// The rendezvous of a session: the store this nrun hosts on `listener` (with the stop that
/// ends its serving), or a static launch's node 0's.
fn host_store(
    plan: &SessionPlan,
    nodes: &NodesPlan,
    listener: Option<std::net::TcpListener>,
    secret: Option<String>,
    static_launch: bool,
) -> Result<(Rendezvous, Option<Hosted>)> {
    Ok(match (&plan.store, listener) {
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
            // A node's ranks all connect from its address (torch opens more than one each
            // on init): the cap per address must hold the largest node's. Agents may all
            // come from one address too (nodes behind one NAT address, or one machine
            // standing in for many), two connections each, at once at a launch tree's
            // start: the cap is on connections that have not proved the secret yet.
            let most = nodes
                .layout
                .iter()
                .map(|l| l.ranks.len())
                .max()
                .unwrap_or(1);
            let limits = store.limits();
            let per_peer = limits
                .per_peer
                .max(4 * most + 64)
                .max(2 * nodes.hosts.len() + 64);
            store.set_limits(nrun_store::server::Limits { per_peer, ..limits });
            // Every worker keeps a connection (torch opens more on init), every agent two.
            let needed = nodes.world as u64 * 2 + nodes.hosts.len() as u64 * 2 + 64;
            if let Some(hard) = nrun_node::process::fd_hard_limit().filter(|h| *h < needed) {
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
            (Rendezvous { addr, port, secret }, Some((store, stop)))
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
    })
}
