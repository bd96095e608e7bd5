//! `nrun __agent` as a child process of nrun: on this host (the launch host's own node, no
//! ssh) or over the system ssh (`--ship` copies this binary first). The process
//! ([`AgentProcess`], shared with the srun step and with the launch tree's inner agents) is the
//! link: its exit loses the node, its stderr explains why, and closing its stdin tells the
//! agent the launcher is gone. An agent that starts a subtree of the launch tree is one of
//! these too; its loss names the nodes started through it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tree::{Inner, TreeLink};
use super::{BoxFuture, Bus, Ending, Instructions, Joining, Kind, NodeLink, Nudges};
use crate::agent::child::{AgentProcess, Delivery, Relay, Starter, ship};
use crate::hosts::Host;
use crate::plan::NodesPlan;
use crate::protocol::{Branch, Hello, Keys, TreeSsh};
use crate::remote;
use crate::session::Node;
use nrun_base::error::{Error, Result};
use nrun_store::Store;

/// A node whose agent is a child process of nrun.
pub(crate) struct ChildLink {
    process: AgentProcess,
    local: bool,
    /// How soon its agent stops its workers by itself once it cannot reach this host.
    agent_timeout: Duration,
    /// A partition closes no ssh for many seconds; the agent's heartbeat stops at once.
    beat: super::peer::Heartbeat,
    /// The agent starts a subtree of the launch tree.
    me: Option<Arc<Inner>>,
    /// Ends its agent from outside once it is lost by silence (over ssh: a remote node's).
    reaper: Option<Reaper>,
}

/// A second ssh connection to a node whose agent went silent: an agent stopped (SIGSTOP) or
/// hung cannot stop its workers as a cut-off one does, so `nrun __reap` ends it, its keeper
/// and its workers there (see `node::keeper::reap_main`). A host truly cut off is not reached
/// either; its agent stops its workers by itself.
struct Reaper {
    host: String,
    ssh_opts: Vec<String>,
    remote_nrun: String,
    /// Started once; awaited at the link's end, so nothing it started outlives the job.
    task: Option<tokio::task::JoinHandle<()>>,
}

/// How long a reap over ssh may take: --agent-timeout, within these bounds. A host that does
/// not answer by then is cut off, and its agent stops its workers by itself.
const REAP_LIMITS: (Duration, Duration) = (Duration::from_secs(3), Duration::from_secs(10));

impl Reaper {
    fn start(&mut self, bus: &Bus, node: usize, agent_timeout: Duration) {
        if self.task.is_some() {
            return;
        }
        let Some(kept) = bus.joined(node).and_then(|j| j.kept) else {
            return;
        };
        let limit = agent_timeout.clamp(REAP_LIMITS.0, REAP_LIMITS.1);
        let argv =
            remote::ssh_reap_command(&self.host, &self.ssh_opts, &self.remote_nrun, &kept, limit);
        let host = self.host.clone();
        self.task = Some(tokio::spawn(async move {
            let mut cmd = tokio::process::Command::new(&argv[0]);
            cmd.args(&argv[1..])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true);
            let out = tokio::time::timeout(limit, cmd.output()).await;
            match out {
                Ok(Ok(o)) if o.status.success() => {
                    tracing::debug!("{host}: its silent agent and its workers were ended over ssh")
                }
                // `nrun __reap` found none of the run's processes (exit 1, said): gone already,
                // or its record names processes that are not the run's any more.
                Ok(Ok(o))
                    if String::from_utf8_lossy(&o.stderr).contains("found nothing of run") =>
                {
                    tracing::warn!(
                        "{host}: its silent agent was not found there over ssh ({}); its workers \
                         ended with it, or check with `ssh {host} pgrep -a nrun`",
                        String::from_utf8_lossy(&o.stderr).trim()
                    )
                }
                Ok(Ok(o)) => tracing::warn!(
                    "{host}: could not end its silent agent over ssh ({}: {}); its workers may run \
                     on there until that agent stops them (check with `ssh {host} pgrep -a nrun`)",
                    o.status,
                    String::from_utf8_lossy(&o.stderr).trim()
                ),
                Ok(Err(e)) => tracing::warn!("{host}: cannot run ssh to end its silent agent: {e}"),
                Err(_) => tracing::debug!(
                    "{host}: no answer over ssh within {} s to end its silent agent (cut off)",
                    limit.as_secs()
                ),
            }
        }));
    }

    async fn finish(&mut self) {
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

/// Nodes started by this nrun as child processes: over ssh, or on this host without it.
pub(crate) static KIND: Kind = Kind {
    name: "ssh",
    start: |s, hosts| {
        Box::pin(async move {
            let how = Instructions::new(s)?;
            let keys = Keys::new(s.run);
            let hosts = &s.plan.hosts[hosts];
            start(s.plan, hosts, &how, s.nudges, s.store.clone(), keys).await
        })
    },
    check: check_fds,
    spawner: true,
    refuses_ship: None,
    in_process: false,
    joins_by_itself: false,
    named_on_join: false,
    join_hint: |np, _| {
        format!(
            "check each with {}, and that nrun {} is on its PATH or pass --ship",
            reach_hint(&np.ssh_opts),
            env!("CARGO_PKG_VERSION"),
        )
    },
    lost_hint,
    unanswered_hint,
    again: Some(start_again),
};

/// Starts host `label`'s agent again as node `node` (its first was lost), from this host as
/// any spare is (never through the launch tree: the agent that started it may be gone too).
fn start_again(
    again: Arc<super::Again>,
    node: usize,
    label: String,
) -> BoxFuture<'static, Result<Box<dyn NodeLink>>> {
    Box::pin(async move {
        let how = &again.how;
        let local = nrun_base::net::is_this_host(&label);
        let mut hello = match local {
            true => how.hello(node, &label, loopback_addrs(&how.addrs), Vec::new()),
            false => how.remote_hello(node, &label, None, Vec::new()),
        };
        hello.heartbeat = !local;
        // It joins a job whose other nodes may be elsewhere: it answers probes.
        hello.probed = true;
        let relay = Relay {
            nudge: Some((again.nudges.clone(), vec![node])),
            tag: None,
            marks: true,
        };
        let routed = !local && how.pinned.is_none();
        let link = start_one(&again.plan, &label, local, &hello, routed, relay).await?;
        Ok(Box::new(link) as Box<dyn NodeLink>)
    })
}

/// Refuses (exit 1: the system's limit, not the input) nodes `hosts` of the plan whose ssh
/// connections this host's open-file limit cannot hold.
fn check_fds(np: &NodesPlan, hosts: std::ops::Range<usize>) -> Result<()> {
    let list = &np.hosts[hosts];
    // The launch tree's nodes hold no pipes here: the spares and the roots of its two trees do
    // (this machine's nodes, the others: see `start`).
    let owned = &list[..np.size.min(list.len())];
    let roots = |n| crate::plan::tree::roots(n, np.tree_width);
    // Which hosts are this machine is asked only when a tree will be split (for an address it
    // reads this machine's interfaces).
    let direct = match roots(owned.len()) == owned.len() {
        true => list.len(),
        false => {
            let here = owned
                .iter()
                .filter(|h| nrun_base::net::is_this_host(&h.name))
                .count();
            list.len() - owned.len() + roots(here) + roots(owned.len() - here)
        }
    };
    check_fd_limit(list.len(), direct, nrun_node::process::fd_hard_limit())
}

/// Open files the launch host holds for each node started over ssh for the whole run: the ssh
/// child's stdin, stdout and stderr pipes and the agent's two store connections.
pub(crate) const FDS_PER_SSH_NODE: u64 = 5;
/// The same for a node of the launch tree (its ssh runs on another node): its agent's store
/// connections.
pub(crate) const FDS_PER_TREE_NODE: u64 = 2;
/// Open files kept for everything else (the store's listener, logs, the local node's workers'
/// first connections).
const FDS_RESERVED: u64 = 64;

/// Refuses (exit 1: the system's limit, not the input) a host list that this process's open-file
/// limit cannot hold: nrun raises its soft limit to the hard one, so the hard limit is what
/// counts. `direct`: the nodes whose ssh runs here (the rest are the launch tree's). `hard`
/// None: unlimited or unknown.
fn check_fd_limit(nodes: usize, direct: usize, hard: Option<u64>) -> Result<()> {
    let tree = nodes.saturating_sub(direct) as u64;
    let needed = direct as u64 * FDS_PER_SSH_NODE + tree * FDS_PER_TREE_NODE + FDS_RESERVED;
    let per = match tree {
        0 => format!(
            "{FDS_PER_SSH_NODE} per node: the pipes of its ssh (or local agent) and the agent's \
             store connections"
        ),
        _ => format!(
            "{FDS_PER_SSH_NODE} per node started from here: the pipes of its ssh (or local \
             agent) and the agent's store connections, {FDS_PER_TREE_NODE} per node of the \
             launch tree"
        ),
    };
    match hard {
        Some(hard) if hard < needed => Err(Error::internal(format!(
            "{nodes} nodes need about {needed} open files here ({per}), but \
             this host allows {hard} (hard limit): raise it (ulimit -n {needed} as root, or \
             nofile in /etc/security/limits.conf) or use fewer nodes"
        ))),
        _ => Ok(()),
    }
}

/// How to check by hand that ssh reaches a host, for a join failure's hint.
pub(crate) fn reach_hint(ssh_opts: &[String]) -> String {
    let cmd: Vec<&str> = std::iter::once("ssh")
        .chain(ssh_opts.iter().map(String::as_str))
        .chain(["<host>", "true"])
        .collect();
    format!("`{}` (BatchMode: keys, no prompts)", cmd.join(" "))
}

/// What to check about a node started from here whose agent or link was lost.
pub(crate) fn lost_hint(host: &str) -> String {
    match nrun_base::net::is_this_host(host) {
        true => format!(
            "check what ended nrun's agent of {host} on this host (a kill, or the kernel's \
             out-of-memory killer: dmesg)"
        ),
        false => format!("check that {host} is up and reachable (ssh {host} true)"),
    }
}

/// What to check when a node's agent did not answer in time.
pub(crate) fn unanswered_hint(host: &str) -> String {
    format!("check that the launch host still reaches it (ssh {host} true)")
}

/// Starts every owned node's agent, at most --ssh-concurrency at a time; each one's end
/// nudges its node in `nudges`. Beyond `--tree-width` nodes (of this machine, or of others),
/// the launch host starts that many (and the spares) and each of those starts its share of
/// the rest (see
/// `plan::tree`, [`super::tree`]): the others get [`TreeLink`]s.
pub(crate) async fn start(
    np: &NodesPlan,
    hosts: &[Host],
    how: &Instructions,
    nudges: &Arc<Nudges>,
    store: Option<Arc<Store>>,
    keys: Keys,
) -> Result<Vec<Node>> {
    let sem = Arc::new(tokio::sync::Semaphore::new(np.ssh_concurrency));
    // One copy of the plan shared by every start (a copy each was O(nodes^2) memory).
    let shared = Arc::new(np.clone());
    let (starts, elsewhere) = branches(np, hosts);
    let tree_ssh = TreeSsh {
        ssh_opts: np.ssh_opts.clone(),
        remote_nrun: np.remote_nrun.clone(),
        concurrency: np.ssh_concurrency,
        ship: np.ship,
    };
    let mut tasks = Vec::new();
    for b in &starts {
        let (i, label, local) = (b.node, b.label.clone(), b.local);
        // This machine's own node talks to the store over loopback: an address of some other
        // interface could go away under it (and buys nothing). Another's uses the address its
        // ssh connection comes from, else the one the launch host's route to it starts at
        // (`agent::choose`).
        let mut hello = match local {
            true => how.hello(i, &label, loopback_addrs(&how.addrs), Vec::new()),
            false => how.remote_hello(i, &label, None, Vec::new()),
        };
        let routed = !local && how.pinned.is_none();
        // This host's own agent is watched as a process, not by its heartbeat.
        hello.heartbeat = !local;
        hello.probed = elsewhere;
        if !b.children.is_empty() {
            hello.tree = b.children.clone();
            hello.tree_ssh = Some(tree_ssh.clone());
        }
        // Its end is news for its whole subtree too (their ssh ran on its node).
        let nodes: Vec<usize> = std::iter::once(i)
            .chain(b.below().iter().map(|c| c.node))
            .collect();
        let relay = Relay {
            nudge: Some((nudges.clone(), nodes)),
            tag: None,
            marks: true,
        };
        let (sem, np) = (sem.clone(), shared.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            start_one(&np, &label, local, &hello, routed, relay).await
        }));
    }
    if np.ship && starts.iter().any(|b| !b.local) {
        shipping(&starts, &tasks).await;
    }
    let mut links: Vec<Option<Box<dyn NodeLink>>> = (0..hosts.len()).map(|_| None).collect();
    for (b, t) in starts.iter().zip(tasks) {
        let mut link = t
            .await
            .map_err(|e| Error::internal(format!("starting an agent: {e}")))??;
        if !b.children.is_empty() {
            let me = Inner::new(
                b.node,
                &b.label,
                Some(link.process.ended()),
                link.process.marks(),
                b.local,
                below(b),
                nudges.clone(),
            );
            link.me = Some(me.clone());
            let tree = TreeParts {
                store: &store,
                keys: &keys,
                nudges,
                agent_timeout: np.agent_timeout,
            };
            tree.links(&b.children, &[me], &mut links);
        }
        links[b.node] = Some(Box::new(link));
    }
    hosts
        .iter()
        .zip(links)
        .map(|(h, l)| {
            l.map(|l| Node::new(&h.name, l))
                .ok_or_else(|| Error::internal(format!("no agent planned for {}", h.name)))
        })
        .collect()
}

/// --ship: progress of the copies of nrun (each start copies, then starts its agent) until
/// every start ended, naming the hosts still copying once it takes long.
async fn shipping<T>(starts: &[Branch], tasks: &[tokio::task::JoinHandle<T>]) {
    let started = Instant::now();
    // This host's own node copies nothing.
    let copies: Vec<(&str, &tokio::task::JoinHandle<T>)> = starts
        .iter()
        .zip(tasks)
        .filter(|(b, _)| !b.local)
        .map(|(b, t)| (b.label.as_str(), t))
        .collect();
    let n = copies.len();
    let mut p = crate::progress::Progress::new("shipping nrun", Some(n as u64), None);
    loop {
        let done = copies.iter().filter(|(_, t)| t.is_finished()).count();
        p.set(done as u64);
        if done == n {
            break;
        }
        p.waiting(|| {
            let going: Vec<String> = copies
                .iter()
                .filter(|(_, t)| !t.is_finished())
                .map(|(l, _)| l.to_string())
                .collect();
            format!("the copies to {}", crate::progress::few(&going))
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each start is the copy and then the agent's start: the time is both.
    p.finish(Some(&format!(
        "shipped nrun to {n} node(s) and started its agents in {:.1} s",
        started.elapsed().as_secs_f64()
    )));
}

/// The agents this host starts, in node order, each with the subtree it starts in turn; and
/// whether some node is on another machine (or joins as a peer), so that the nodes'
/// reachability is probed (this machine's nodes alone share one network stack: nothing
/// between them to probe).
fn branches(np: &NodesPlan, hosts: &[Host]) -> (Vec<Branch>, bool) {
    let mut starts = Vec::new();
    // This machine's nodes and the others make trees of their own: an agent elsewhere could not
    // start a node of this machine (its name means that agent's own machine there), and this
    // machine's own are started without ssh, by this nrun or by an agent beside it.
    let (mut here, mut there) = (Vec::new(), Vec::new());
    let mut elsewhere = hosts.len() < np.hosts.len();
    for (i, h) in hosts.iter().enumerate() {
        // Asked once per host: for an address, it reads this machine's interfaces.
        let local = nrun_base::net::is_this_host(&h.name);
        elsewhere |= !local;
        // A spare stays a child of this host, so that the node it replaces can be lost with
        // its subtree while the spare is not.
        let direct = np.tree_width == 0 || i >= np.size;
        match (direct, local) {
            (true, _) => starts.push(Branch {
                node: i,
                label: h.name.clone(),
                children: Vec::new(),
                local,
            }),
            (false, true) => here.push((i, h.name.clone())),
            (false, false) => there.push((i, h.name.clone())),
        }
    }
    starts.extend(
        crate::plan::tree::split_packed(&here, np.tree_width)
            .into_iter()
            .map(Branch::into_local),
    );
    starts.extend(crate::plan::tree::split(&there, np.tree_width));
    starts.sort_unstable_by_key(|b| b.node);
    let inner = starts.iter().filter(|b| !b.children.is_empty()).count();
    if inner > 0 {
        tracing::debug!(
            "launch tree: {} agents started here, {inner} of them start {} more ({} levels)",
            starts.len(),
            hosts.len() - starts.len(),
            crate::plan::tree::depth(&starts)
        );
    }
    (starts, elsewhere)
}

/// The nodes below branch `b`, with their labels, in node order.
fn below(b: &Branch) -> Vec<(usize, String)> {
    let mut v: Vec<(usize, String)> = b
        .below()
        .iter()
        .map(|c| (c.node, c.label.clone()))
        .collect();
    v.sort_unstable();
    v
}

/// What the links of the launch tree's nodes share.
struct TreeParts<'a> {
    store: &'a Option<Arc<Store>>,
    keys: &'a Keys,
    nudges: &'a Arc<Nudges>,
    agent_timeout: Duration,
}

impl TreeParts<'_> {
    /// A [`TreeLink`] for every node of `branches`, whose agents the last of `line` starts.
    fn links(
        &self,
        branches: &[Branch],
        line: &[Arc<Inner>],
        out: &mut [Option<Box<dyn NodeLink>>],
    ) {
        for b in branches {
            let me = (!b.children.is_empty()).then(|| {
                Inner::new(
                    b.node,
                    &b.label,
                    None,
                    None,
                    b.local,
                    below(b),
                    self.nudges.clone(),
                )
            });
            out[b.node] = Some(Box::new(TreeLink::new(
                b.node,
                line.to_vec(),
                me.clone(),
                self.store.clone(),
                self.keys.clone(),
                self.agent_timeout,
                b.local,
            )));
            if let Some(m) = me {
                let mut deeper = line.to_vec();
                deeper.push(m);
                self.links(&b.children, &deeper, out);
            }
        }
    }
}

/// Starts node `label`'s agent; `routed`: its Hello gets the launch host's route to it as the
/// address to prefer (looked up while ssh connects).
async fn start_one(
    np: &NodesPlan,
    label: &str,
    local: bool,
    hello: &Hello,
    routed: bool,
    relay: Relay,
) -> Result<ChildLink> {
    let mut reaper = None;
    let starter = if local {
        // The launch host's own node needs no ssh: its agent is a child of nrun, spoken to the
        // same way (stdin, the store) so there is one code path.
        Starter::Here
    } else {
        let remote_nrun = match np.ship {
            true => ship(&np.ssh_opts, label).await?,
            false => np.remote_nrun.clone(),
        };
        reaper = Some(Reaper {
            host: label.to_string(),
            ssh_opts: np.ssh_opts.clone(),
            remote_nrun: remote_nrun.clone(),
            task: None,
        });
        Starter::Program(remote::ssh_command(label, &np.ssh_opts, &remote_nrun))
    };
    let prefer = routed.then(|| route_prefer(label));
    let process = AgentProcess::spawn_with(&starter, label, hello, relay, prefer).await?;
    Ok(ChildLink {
        process,
        local,
        agent_timeout: np.agent_timeout,
        beat: Default::default(),
        me: None,
        reaper,
    })
}

impl NodeLink for ChildLink {
    fn kind(&self) -> &'static Kind {
        &KIND
    }

    fn is_local(&self) -> bool {
        self.local
    }

    fn joining(&mut self) -> Joining {
        match self.process.exited() {
            None => Joining::Pending,
            Some(_) => Joining::Gone,
        }
    }

    fn join_failure(&mut self, label: &str, _waited: Duration, timeout: Duration) -> String {
        match (self.process.exited(), self.process.last_words()) {
            (Some(st), Some(said)) => format!(
                "{label}: {said} (exit {})",
                st.code().map_or("signal".into(), |c| c.to_string())
            ),
            (Some(st), None) => format!(
                "{label}: the agent exited ({st}) without a word; run `ssh {label} nrun --version` \
                 to check nrun is installed there"
            ),
            (None, _) => format!(
                "{label}: did not join within {} s (--join-timeout); ssh is still running: a slow \
                 host, or nrun hanging there",
                timeout.as_secs()
            ),
        }
    }

    fn lost(&mut self, bus: &Bus, node: usize, label: &str, stopped: bool) -> Option<String> {
        let why = self.why_lost(bus, node, label, stopped)?;
        // An inner agent of the launch tree: its subtree goes with it, and says so.
        Some(super::tree::Inner::named_lost(self.me.as_deref(), why))
    }

    fn output(&mut self, node: usize, no: usize) -> Delivery {
        self.process
            .marks()
            .map_or(Delivery::Arrived, |m| m.delivery(node, no))
    }

    fn end<'a>(&'a mut self, _: Ending<'a>) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let reap = async {
                if let Some(r) = self.reaper.as_mut() {
                    r.finish().await;
                }
            };
            tokio::join!(reap, self.process.finish());
        })
    }

    fn kill(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.process.kill().await;
            if let Some(r) = self.reaper.as_mut() {
                r.finish().await;
            }
        })
    }
}

impl ChildLink {
    fn why_lost(&mut self, bus: &Bus, node: usize, label: &str, stopped: bool) -> Option<String> {
        // A process of this host: no link to break, and its workers die with it.
        if let (true, Some(st)) = (self.local, self.process.exited()) {
            let said = self.process.own_words();
            return Some(format!(
                "lost {label}: its agent, a process of this host, {}{}; its workers ended with it",
                crate::agent::child::how_it_ended(&st),
                said.map_or(String::new(), |w| format!(" ({w})"))
            ));
        }
        match self.process.epitaph() {
            None if stopped => Some(format!(
                "lost the connection to {label}: its agent stopped its workers when the link \
                 to the launch host broke"
            )),
            // A process of this host that runs is no node cut off (it beats no heartbeat).
            None if self.local => None,
            None => {
                let quiet = self.beat.silent(bus, node)?;
                // A stopped or hung agent cannot stop its workers: ended from here.
                if let Some(r) = self.reaper.as_mut() {
                    r.start(bus, node, self.agent_timeout);
                }
                Some(format!(
                    "lost the connection to {label}: its agent sent no heartbeat for {:.1} s and \
                     {} (its host is down, cut off from this one or its agent stopped); it stops \
                     its workers there by itself within {} s of losing this host \
                     (--agent-timeout; this host waits half of it, at least 2.5 s), and nrun ends \
                     them from here over ssh if that host answers (an agent stopped or hung)",
                    quiet.as_secs_f64(),
                    self.beat.seen(),
                    self.agent_timeout.as_secs_f64()
                ))
            }
            Some(how) => Some(format!(
                "lost the connection to {label}{how}; its agent stops its workers there by itself \
                 within {} s of losing this host (--agent-timeout)",
                self.agent_timeout.as_secs_f64()
            )),
        }
    }
}

/// The source address of the launch host's route to `host` (an ssh destination: `user@`
/// dropped), as the address its agent is to use where its ssh connection does not say; None
/// where the name does not resolve here within 2 s (an alias of ssh_config, say).
pub(crate) async fn route_prefer(host: &str) -> Option<crate::protocol::Prefer> {
    let name = host.rsplit('@').next().unwrap_or(host);
    let name = name
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let found = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::lookup_host((name.as_str(), 22)),
    )
    .await
    .ok()?
    .ok()?
    .next()?;
    let (src, _) = nrun_base::net::route_from(found)?;
    Some(crate::protocol::Prefer {
        ip: src.to_string(),
        how: crate::protocol::AddrChoice::Route,
    })
}

/// The loopback entries of the coordinator's address list (all of it, if it has none).
fn loopback_addrs(addrs: &[String]) -> Vec<String> {
    let lo: Vec<String> = addrs
        .iter()
        .filter(|a| {
            a.parse::<std::net::SocketAddr>()
                .is_ok_and(|s| s.ip().is_loopback())
        })
        .cloned()
        .collect();
    if lo.is_empty() { addrs.to_vec() } else { lo }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_limit_refuses_too_many_ssh_nodes_as_a_system_refusal() {
        let e = check_fd_limit(400, 400, Some(1024)).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::INTERNAL);
        assert!(e.message.contains("ulimit -n 2064"), "{}", e.message);
        check_fd_limit(400, 400, None).unwrap();
        check_fd_limit(192, 192, Some(1024)).unwrap();
        assert!(check_fd_limit(193, 193, Some(1024)).is_err());
        // With the launch tree, 400 nodes fit: 33 x 5 + 367 x 2 + 64.
        check_fd_limit(400, 33, Some(1024)).unwrap();
        let e = check_fd_limit(2000, 33, Some(1024)).unwrap_err();
        assert!(
            e.message.contains("per node of the launch tree"),
            "{}",
            e.message
        );
    }

    #[test]
    fn reach_hints_have_no_double_space() {
        assert_eq!(
            reach_hint(&[]),
            "`ssh <host> true` (BatchMode: keys, no prompts)"
        );
        assert_eq!(
            reach_hint(&["-p".into(), "2222".into()]),
            "`ssh -p 2222 <host> true` (BatchMode: keys, no prompts)"
        );
    }
}
