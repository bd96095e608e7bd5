//! A node whose nrun the user started, as torchrun's c10d rendezvous has it (the same command
//! on every node): it finds the nrun hosting the rendezvous at the endpoint, takes the next node
//! index (join order), and from then on is that node's agent, exactly as one started over ssh.
//! Its heartbeat tells the host it is alive; it exits with the job's exit code.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::agent::HostLoss;
use crate::plan::{C10d, NodesPlan, RunSettings, TookOver};
use crate::protocol::{
    Hello, NRUN_STORE_KEY, Succession, Successor, c10d_epoch_key, c10d_newer_key, c10d_next_key,
    c10d_public_key, c10d_refused_key, c10d_room_key, c10d_run_key, torchrun_rdzv_key,
};
use nrun_base::error::{Error, Result};
use nrun_node::Signals;
use nrun_store::client::Client;

/// What a c10d node's serving ended with: the job's exit code, or this node's turn to host
/// the job (it took over: the settings with the new endpoint and epoch, the port bound), which
/// the caller runs as the hosting nrun does (the session cannot name the commands).
pub(crate) enum Served {
    Ended(u8),
    Host(Box<RunSettings>, std::net::TcpListener),
}

/// Joins the rendezvous `c` and serves as a node of its job. When the host is lost, goes down
/// the last step's succession: joins the node that took over hosting, or takes it over itself
/// (see [`super::succession`]).
pub(crate) async fn join(job: &RunSettings, nodes: &NodesPlan, c: &C10d) -> Result<Served> {
    let endpoint = format!("{}:{}", c.host, c.port);
    // The job's record is kept where its session is: the nrun that hosts the rendezvous.
    let unwritten: Vec<&str> = [
        ("--report", job.report.is_some()),
        ("--report-html", job.report_html.is_some()),
        ("--events", job.journal.events.is_some()),
        ("--metrics-file", job.journal.metrics_file.is_some()),
        ("--metrics-port", job.journal.metrics_port.is_some()),
    ]
    .into_iter()
    .filter_map(|(flag, given)| given.then_some(flag))
    .collect();
    if !unwritten.is_empty() {
        tracing::warn!(
            "{} not served on this node: it joins the rendezvous another node's nrun hosts at \
             {endpoint}, which keeps the job's record; give them to the nrun there",
            unwritten.join(", ")
        );
    }
    if c.secret.as_deref().unwrap_or_default().is_empty() {
        tracing::warn!(
            "no NRUN_RDZV_SECRET here: this node runs the steps any client of {endpoint} writes; \
             give every node the same NRUN_RDZV_SECRET to have them signed"
        );
    }
    // The epoch of the last host this node knew: an older host is refused.
    let known = super::succession::kept(&c.id).map_or_else(Known::default, |s| Known {
        epoch: s.epoch,
        lineage: s.lineage,
    });
    serve_from(job, nodes, c.clone(), known).await
}

/// A hosting nrun that stood down (a newer host, or no majority left with it): its node goes
/// down `succ` as a fresh node, as a joined node that lost its host does; never hosts.
pub(crate) async fn rejoin(
    job: &RunSettings,
    nodes: &NodesPlan,
    succ: Succession,
) -> Result<Served> {
    let lost = Lost {
        words: format!(
            "this node stood down as the host of rendezvous {:?} (epoch {})",
            succ.id, succ.epoch
        ),
        dead: 0,
    };
    let c = C10d {
        host: succ.host.clone(),
        port: succ.nodes.first().map_or(0, |n| n.port),
        id: succ.id.clone(),
        secret: job.session.c10d.as_ref().and_then(|c| c.secret.clone()),
        node: None,
        took_over: None,
    };
    match succeed(nodes, &c, &succ, None, &lost).await? {
        Next::Join(next) => serve_from(job, nodes, next, Known::after(&succ)).await,
        Next::Host(..) => Err(Error::internal("a node that stood down took over hosting")),
    }
}

/// Joins the rendezvous `c` (a host of epoch `known` or newer) and serves as a node of its job,
/// going down the succession each time the host is lost.
async fn serve_from(job: &RunSettings, nodes: &NodesPlan, c: C10d, known: Known) -> Result<Served> {
    let (mut c, mut known) = (c, known);
    loop {
        let (served, node) = join_once(job, nodes, &c, &known).await?;
        let e = match served {
            Ok(ended) => return Ok(Served::Ended(ended)),
            Err(e) => e,
        };
        // No succession (the host was lost before any step came) or no word on a lost host
        // (this node's own failure): ends as before.
        let (Some(succ), Some(loss)) = (crate::agent::last_succession(), crate::agent::host_loss())
        else {
            return Err(Error::cluster(e.message));
        };
        if succ.id != c.id {
            return Err(Error::cluster(e.message));
        }
        let lost = Lost::of(&loss, &c, nodes);
        match succeed(nodes, &c, &succ, Some(node), &lost).await? {
            Next::Join(next) => {
                known = Known::after(&succ);
                c = next;
            }
            Next::Host(next, listener) => {
                let mut job = job.clone();
                job.session.store = crate::plan::StorePlan::Host {
                    port: next.port,
                    advertise: next.host.clone(),
                };
                job.session.c10d = Some(next);
                return Ok(Served::Host(Box::new(job), listener));
            }
        }
    }
}

/// How the host was lost, for the words and the majority.
struct Lost {
    /// What happened, in words ("the rendezvous host H:P is gone (...)").
    words: String,
    /// 1 when the host is known dead (its connection closed), else 0.
    dead: usize,
}

impl Lost {
    fn of(loss: &HostLoss, c: &C10d, nodes: &NodesPlan) -> Lost {
        let host = format!("the rendezvous host {}:{}", c.host, c.port);
        match loss {
            HostLoss::Closed(e) => Lost {
                words: format!("{host} is gone (its connection closed: {e})"),
                dead: 1,
            },
            HostLoss::Silent(_) => Lost {
                words: format!(
                    "{host} does not answer (for {} s, --agent-timeout: frozen, or cut off from \
                     this node)",
                    nodes.agent_timeout.as_secs_f64()
                ),
                dead: 0,
            },
        }
    }
}

/// The last host a node knew: its epoch within its job's lineage (epochs compare within one
/// job only: a later job may reuse the rendezvous id). Default: none.
#[derive(Clone, Debug, Default)]
struct Known {
    epoch: u64,
    lineage: String,
}

impl Known {
    /// The host after `succ`'s: its epoch + 1, the same job.
    fn after(succ: &Succession) -> Known {
        Known {
            epoch: succ.epoch + 1,
            lineage: succ.lineage.clone(),
        }
    }

    /// Whether a host of `epoch` in `lineage` is older than this one (then refused).
    fn refuses(&self, epoch: u64, lineage: &str) -> bool {
        lineage == self.lineage && epoch < self.epoch
    }
}

/// What a node that lost its host does next.
enum Next {
    /// Join the node that took over hosting (its endpoint).
    Join(C10d),
    /// Host: this node is the next in the succession (its endpoint, bound).
    Host(C10d, std::net::TcpListener),
}

/// Goes down the last step's succession after the host was lost (`loss`): each node in turn
/// is given the time to notice the loss and bind (twice --agent-timeout and 2 s) and joined if
/// it hosts the rendezvous at a newer epoch; this node (`me`, its index under the lost host;
/// None: a host that stood down, which never hosts) takes over when its turn comes. Err: none
/// within --join-timeout, with what was tried.
async fn succeed(
    nodes: &NodesPlan,
    c: &C10d,
    succ: &Succession,
    me: Option<usize>,
    lost: &Lost,
) -> Result<Next> {
    let started = Instant::now();
    let deadline = started + nodes.join_timeout;
    let per = nodes.agent_timeout * 2 + Duration::from_secs(2);
    let (dead, how) = (lost.dead, &lost.words);
    let quorum = super::succession::successor_quorum(succ.world, dead);
    let alive = succ.world.saturating_sub(dead);
    let who = match me {
        Some(n) => format!("{} (node {n})", nrun_base::net::hostname()),
        None => "this node".to_string(),
    };
    let mut tried = Vec::new();
    for (k, cand) in succ.nodes.iter().enumerate() {
        let place = match k {
            0 => "first".to_string(),
            k => format!("number {} after {} that did not", k + 1, tried.len()),
        };
        let at = format!("{}:{}", cand.addr, cand.port);
        if Some(cand.node) == me {
            match nrun_store::server::bind(cand.port) {
                Ok(l) => {
                    eprintln!(
                        "nrun: {how}; {who} takes over hosting at {at} \
                         (epoch {}; {place} in the succession of the last step); waiting for a \
                         majority: {quorum} of the last {} nodes{}",
                        succ.epoch + 1,
                        succ.world,
                        match dead {
                            0 => String::new(),
                            _ => format!(" ({alive} that may be alive, the host's counted dead)"),
                        }
                    );
                    let next = C10d {
                        took_over: Some(TookOver {
                            epoch: succ.epoch + 1,
                            lineage: succ.lineage.clone(),
                            quorum,
                            alive,
                        }),
                        ..successor_at(cand, &c.id, c.secret.clone())
                    };
                    return Ok(Next::Host(next, l));
                }
                Err(e) => {
                    tried.push(format!("hosting here at port {}: {e}", cand.port));
                    continue;
                }
            }
        }
        eprintln!(
            "nrun: {how}; {who} looks for node {} at {at} ({place} in the \
             succession of the last step, epoch {})",
            cand.node,
            succ.epoch + 1
        );
        let next = successor_at(cand, &c.id, c.secret.clone());
        let until = (Instant::now() + per).min(deadline);
        match hosts_at(&next, &Known::after(succ), until).await {
            Ok(()) => return Ok(Next::Join(next)),
            Err(why) => tried.push(format!("node {} at {at}: {why}", cand.node)),
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    Err(Error::cluster(format!(
        "{how}, and no node of the last step's succession hosts rendezvous {:?} at epoch {} or \
         later after {:.0} s: tried {}; check that the nodes' nrun still run and reach each \
         other, then start the same command again on every node",
        c.id,
        succ.epoch + 1,
        started.elapsed().as_secs_f64(),
        match tried.is_empty() {
            true => "nothing (no other node in the last step)".to_string(),
            false => tried.join("; "),
        }
    )))
}

/// Whether an nrun hosts rendezvous `c` at its endpoint with epoch `epoch` or later, asked
/// until `until` (each attempt bounded); Err: what was found instead.
async fn hosts_at(c: &C10d, want: &Known, until: Instant) -> std::result::Result<(), String> {
    let Ok(addrs) = resolve(&c.host, c.port) else {
        return Err("no address".into());
    };
    let mut last = "no answer".to_string();
    // At least one look, however little time is left.
    let mut first = true;
    while std::mem::take(&mut first) || Instant::now() < until {
        for a in &addrs {
            let left = until.saturating_duration_since(Instant::now());
            let bound = left.clamp(Duration::from_millis(500), Duration::from_secs(2));
            let got = tokio::time::timeout(bound, async {
                let mut store = match super::meet::store_at(*a).await {
                    Ok(s) => s,
                    Err(super::meet::Unreached::Io(e) | super::meet::Unreached::Silent(e)) => {
                        return Err(e.to_string());
                    }
                    Err(super::meet::Unreached::Other(e)) => return Err(e.to_string()),
                };
                match what_listens(&mut store, &c.id).await {
                    Ok(Listener::Ours) => {}
                    Ok(_) => return Err(format!("no rendezvous {:?} there", c.id)),
                    Err(e) => return Err(e.to_string()),
                }
                match host_epoch(&mut store, &c.id).await {
                    Ok((e, l)) if l == want.lineage && e >= want.epoch => Ok(()),
                    Ok((e, l)) if l == want.lineage => {
                        Err(format!("a host of epoch {e}, older than {}", want.epoch))
                    }
                    Ok(_) => Err("a host of another job with this rendezvous id".into()),
                    Err(e) => Err(e.to_string()),
                }
            })
            .await;
            match got {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(why)) => last = why,
                Err(_) => last = "no answer within 2 s".into(),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last)
}

/// The first node of `last` that hosts its rendezvous at a newer epoch, in words (one look
/// each); None: none does.
pub(super) async fn newer_among(last: &Succession) -> Option<String> {
    let (cand, _) = newer_host(last, None).await?;
    Some(format!("node {} at {}:{}", cand.node, cand.addr, cand.port))
}

/// The first node of `last`'s succession that hosts its rendezvous at a newer epoch (one look
/// each): it, and its endpoint with `secret`.
async fn newer_host(last: &Succession, secret: Option<String>) -> Option<(&Successor, C10d)> {
    for cand in &last.nodes {
        let c = successor_at(cand, &last.id, secret.clone());
        if hosts_at(&c, &Known::after(last), Instant::now())
            .await
            .is_ok()
        {
            return Some((cand, c));
        }
    }
    None
}

/// Successor `cand`'s endpoint for rendezvous `id`: where it hosts, should its turn come.
fn successor_at(cand: &Successor, id: &str, secret: Option<String>) -> C10d {
    C10d {
        host: cand.addr.clone(),
        port: cand.port,
        id: id.to_string(),
        secret,
        node: None,
        took_over: None,
    }
}

/// The epoch of the nrun hosting rendezvous `id` on `store` and its job's lineage (1 and none
/// where it says none).
async fn host_epoch(store: &mut Client, id: &str) -> std::io::Result<(u64, String)> {
    let key = c10d_epoch_key(id);
    if !store.check(&[&key]).await? {
        return Ok((1, String::new()));
    }
    let v = String::from_utf8_lossy(&store.get(&key).await?).into_owned();
    let mut w = v.split_whitespace();
    let epoch = w.next().and_then(|e| e.parse().ok()).unwrap_or(1);
    Ok((epoch, w.next().unwrap_or_default().to_string()))
}

/// Where an nrun started again with the same command finds the current host of rendezvous
/// `c`, from the last succession this machine kept: the first of its nodes that hosts `c`'s id
/// at a newer epoch (one look each, a second or two at most). None: none does (host at the
/// endpoint, or join it, as at a first start).
pub(crate) fn current_host(c: &C10d) -> Option<C10d> {
    if c.node.is_some() {
        return None;
    }
    let succ = super::succession::kept(&c.id)?;
    // A runtime of its own, gone when this returns: nrun still has one thread after it (the
    // spawner is forked next).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    let (_, next) = rt.block_on(newer_host(&succ, c.secret.clone()))?;
    tracing::info!(
        "rendezvous {:?} is hosted at {}:{} now (epoch {} or later; this machine's last \
         succession, {}): this node joins it there",
        c.id,
        next.host,
        next.port,
        succ.epoch + 1,
        super::succession::state_file(&c.id).display()
    );
    Some(next)
}

/// Finds the host of rendezvous `c` (epoch `known` or later) and serves as its node until the
/// job's end (Ok: nrun's exit code) or the host's loss (Err); with this node's index there.
async fn join_once(
    job: &RunSettings,
    nodes: &NodesPlan,
    c: &C10d,
    known: &Known,
) -> Result<(std::result::Result<u8, Error>, usize)> {
    let endpoint = format!("{}:{}", c.host, c.port);
    let addrs = resolve(&c.host, c.port)
        .map_err(|e| Error::usage(format!("the rendezvous endpoint {endpoint}: {}", e.message)))?;
    let started = Instant::now();
    let deadline = started + nodes.join_timeout;
    let secs = nodes.join_timeout.as_secs();
    let secret = c.secret.clone().unwrap_or_default();
    // Everything up to the node index, bounded by --join-timeout to the second: a connect or
    // a reply that never comes (packets dropped) cannot hold it past the deadline.
    let mut look = Looking::new(started, deadline);
    look.known = known.clone();
    // The job's --nnodes and the --spares that may wait beside them. A node past them (its
    // index is the next in join order: one that came back after its first nrun was lost) may
    // wait for room where the job can take a node again: elastic, or with spares.
    let slots = Slots {
        slots: nodes.hosts.len(),
        may_wait: nodes.min_nodes < nodes.size || nodes.hosts.len() > nodes.size,
    };
    let found = tokio::time::timeout_at(
        deadline.into(),
        find(&addrs, c, &endpoint, &secret, &mut look, secs, &slots),
    )
    .await;
    let (reached, run, node) = match found {
        Ok(r) => r?,
        Err(_) if look.full => return Err(too_many(&endpoint, c, job, &slots)),
        Err(_) => return Err(look.timed_out(&endpoint, c, secs)),
    };
    look.wait.clear();
    if node >= slots.slots && !slots.may_wait {
        return Err(too_many(&endpoint, c, job, &slots));
    }
    let hello = Hello {
        secret: secret.clone(),
        run: run.clone(),
        node,
        label: nrun_base::net::hostname(),
        addrs: vec![reached.to_string()],
        // The endpoint that answered is the one it uses.
        pinned: true,
        prefer: None,
        cwd: std::env::current_dir()
            .map_err(|e| Error::usage(format!("cannot read the current directory: {e}")))?,
        version: nrun_base::VERSION.to_string(),
        python: nodes
            .python_probe
            .then(|| job.session.python.clone())
            .flatten(),
        forward_signals: job.session.forward_signals.clone(),
        nodes: Vec::new(),
        heartbeat: true,
        agent_timeout_ms: nodes.agent_timeout.as_millis() as u64,
        // torchrun's c10d: this node runs its own command line and worker count.
        own: Some(own_work(job)),
        tree: Vec::new(),
        tree_ssh: None,
        // Its output is this nrun's own console: nothing relays it.
        output_mark: String::new(),
        // The launch host's nodes are elsewhere: they probe this one.
        probed: true,
        state_file: Some(super::succession::state_file(&c.id)),
        epoch: known.epoch,
    };
    // "joined the rendezvous" is said once the host can see this node (agent::join_and_serve).
    let mut signals = Signals::install(&job.session.forward_signals)?;
    signals.stop_on_closed_console();
    // Nothing closes: the host going away shows as its store going away.
    let (gone, _) = watch::channel(false);
    let served = match crate::agent::serve(hello, signals, gone, true).await {
        Ok(ended) => {
            // This node's console (a pod's log) ends with the job's root cause, as the hosting
            // node's does, and its own TORCHELASTIC_ERROR_FILE gets it (issue 23).
            let why = &ended.root_cause;
            if !why.summary.is_empty() {
                eprint!("{}", why.summary);
            }
            if let (Some(path), Some(json)) = (&job.launcher_error_file, &why.error_json)
                && let Err(e) = nrun_base::outputs::replace(path, json.as_bytes())
            {
                tracing::warn!(
                    "cannot write TORCHELASTIC_ERROR_FILE {}: {e}",
                    path.display()
                );
            }
            // The job is over: there is no host to find for it any more.
            let _ = std::fs::remove_file(super::succession::state_file(&c.id));
            Ok(ended.code.unwrap_or(0))
        }
        Err(e) => Err(e),
    };
    Ok((served, node))
}

/// How many node indices the job has (its nodes and spares), and whether a node past them may
/// wait for room.
struct Slots {
    slots: usize,
    may_wait: bool,
}

/// The error for a node past the job's nodes and spares that found (or waited for) no room.
fn too_many(endpoint: &str, c: &C10d, job: &RunSettings, slots: &Slots) -> Error {
    Error::cluster(format!(
        "the rendezvous at {endpoint} (id {:?}) already has its --nnodes {} nodes{}; this one \
         is one too many{} (give every node --spares K to let K more join as spares)",
        c.id,
        job.shape.nnodes,
        match slots.slots.saturating_sub(job.shape.nnodes) {
            0 => String::new(),
            k => format!(" and {k} spare(s)"),
        },
        match slots.may_wait {
            true => " (no node of the job was lost to make room within --join-timeout)",
            false => "",
        }
    ))
}

/// This node's own worker count and command line, as its workers run them.
pub(crate) fn own_work(job: &RunSettings) -> crate::facts::OwnWork {
    let w = &job.workers;
    crate::facts::OwnWork {
        nproc: w.nproc,
        command: std::iter::once(&w.program)
            .chain(&w.args)
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
    }
}

/// What a joining node has learnt about the endpoint so far: for the waiting lines, and for
/// the message if --join-timeout passes.
struct Looking {
    /// The last connection error.
    last: String,
    /// A connection was accepted and closed at once (a store that serves its own host only).
    closed: bool,
    /// A TCPStore answered there, neither an nrun's nor torchrun's rendezvous (yet).
    store: bool,
    /// The last connection was accepted and answered nothing (another program, or a stopped
    /// nrun): named at the deadline.
    silent: Option<std::io::Error>,
    /// The rendezvous was found: this node was joining it when time ran out.
    joining: bool,
    /// This node's index is past the job's nodes and spares: it waited for room.
    full: bool,
    /// When the line that says what this node waits for is due (None: said).
    next_line: Option<Instant>,
    /// The wait's progress: "still waiting" lines with the deadline (a spinner on a terminal).
    wait: crate::progress::Progress,
    /// The epoch of the last host this node knew: a host of an older one is refused (it is
    /// told so, and stands down).
    known: Known,
    /// A host of an older epoch was found there (its epoch).
    stale: Option<u64>,
}

/// Who listens at the endpoint, from what it holds.
enum Listener {
    /// The nrun hosting this rendezvous id.
    Ours,
    /// torchrun's c10d rendezvous with this id.
    Torchrun,
    /// An nrun that hosts no rendezvous with this id: another job.
    OtherNrun,
    /// A TCPStore with neither (yet).
    Unknown,
}

impl Looking {
    fn new(started: Instant, deadline: Instant) -> Looking {
        Looking {
            last: String::new(),
            closed: false,
            store: false,
            silent: None,
            joining: false,
            full: false,
            next_line: Some(started + Duration::from_secs(1)),
            wait: crate::progress::Progress::new("c10d join", None, Some(deadline)),
            known: Known::default(),
            stale: None,
        }
    }

    fn failed(&mut self, a: SocketAddr, e: &std::io::Error) {
        use std::io::ErrorKind::*;
        self.closed |= matches!(e.kind(), UnexpectedEof | ConnectionReset | BrokenPipe);
        self.last = format!("{a}: {e}");
    }

    /// A joiner started before the host says once what it waits for, then how long it has.
    fn progress(&mut self, endpoint: &str, c: &C10d, secs: u64) {
        if self.next_line.is_some_and(|t| Instant::now() >= t) {
            self.wait.line(&format!(
                "waiting for the nrun that hosts rendezvous {:?} at {endpoint} (it may start \
                 after this one; up to {secs} s, --join-timeout)",
                c.id
            ));
            self.next_line = None;
        }
        let last = &self.last;
        self.wait
            .waiting(|| format!("the rendezvous at {endpoint}: {last}"));
    }

    /// The message when --join-timeout passed, from what was seen.
    fn timed_out(&self, endpoint: &str, c: &C10d, secs: u64) -> Error {
        let msg = if let Some(e) = self.stale {
            format!(
                "the nrun at {endpoint} hosts rendezvous {:?} at epoch {e}, older than the \
                 epoch {} this node last knew (a host that was frozen or cut off while another \
                 took over), and no newer host took it back within {secs} s (--join-timeout): \
                 find the current host in the other nodes' consoles and start this node again",
                c.id, self.known.epoch
            )
        } else if self.joining {
            format!(
                "the rendezvous at {endpoint} stopped answering while this node joined it \
                 ({secs} s, --join-timeout): packets dropped between here and there? check the \
                 firewall and the route to {}",
                c.host
            )
        } else if let Some(e) = &self.silent {
            return super::meet::something_else(endpoint, "--rdzv-endpoint", e);
        } else if self.store {
            format!(
                "a TCPStore answers at {endpoint}, but neither an nrun nor torchrun hosts a \
                 rendezvous with id {:?} there after {secs} s (--join-timeout): another job's \
                 store holds that port? give this job another --rdzv-endpoint port, and every \
                 node the same --rdzv-id",
                c.id
            )
        } else if self.closed {
            format!(
                "something at {endpoint} accepts connections and closes them at once ({}) for \
                 {secs} s (--join-timeout): another job's store that serves only its own host \
                 (a single-node nrun, torchrun --standalone) holds that port? give this job \
                 another --rdzv-endpoint port",
                self.last
            )
        } else {
            format!(
                "no nrun hosts the rendezvous at {endpoint} ({}) after {secs} s (--join-timeout): \
                 start the same command on {}, and check the firewall there",
                match self.last.is_empty() {
                    true => "no answer",
                    false => &self.last,
                },
                c.host
            )
        };
        Error::cluster(msg)
    }
}

/// A host of an older epoch than this node's last (it was frozen, or cut off, while the
/// others went on): told so once, it stands down (see session::succession); this node waits
/// for the current one to be found.
async fn stale_host(
    store: &mut Client,
    c: &C10d,
    secret: &str,
    endpoint: &str,
    look: &mut Looking,
    a: SocketAddr,
    epoch: u64,
) {
    if look.stale.is_none() && crate::agent::prove(store, secret, &endpoint).await.is_ok() {
        let newer = format!("{} {}", look.known.epoch, look.known.lineage);
        let _ = store.set(&c10d_newer_key(&c.id), newer.as_bytes()).await;
    }
    look.stale = Some(epoch);
    look.last = format!(
        "{a}: a host of epoch {epoch}, older than this node's last ({})",
        look.known.epoch
    );
}

/// Finds the rendezvous at the endpoint and joins it: the address that reached it, the run's
/// name and this node's index. Retries until the caller's deadline while nothing, or a store
/// that holds no rendezvous yet, listens there; another job's nrun or a torchrun rendezvous
/// there is said at once.
async fn find(
    addrs: &[SocketAddr],
    c: &C10d,
    endpoint: &str,
    secret: &str,
    look: &mut Looking,
    secs: u64,
    slots: &Slots,
) -> Result<(SocketAddr, String, usize)> {
    let (mut store, reached) = loop {
        let mut conn = None;
        for a in addrs {
            use super::meet::Unreached;
            match super::meet::store_at(*a).await {
                Ok(s) => {
                    conn = Some((s, *a));
                    look.silent = None;
                    break;
                }
                // It answered, but as no TCPStore does: said at once, with what it answered.
                Err(Unreached::Other(e)) => {
                    return Err(super::meet::something_else(endpoint, "--rdzv-endpoint", &e));
                }
                // Accepted and silent: the host may be about to serve (or stopped); named if
                // it stays so to the deadline.
                Err(Unreached::Silent(e)) => {
                    look.last = format!("{a}: {e}");
                    look.silent = Some(e);
                }
                Err(Unreached::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
                    look.last = format!("{a}: {e}");
                    look.silent = None;
                }
                Err(Unreached::Io(e)) => {
                    look.silent = None;
                    look.failed(*a, &e);
                }
            }
        }
        if let Some((mut store, a)) = conn {
            match what_listens(&mut store, &c.id).await {
                Ok(Listener::Ours) => match host_epoch(&mut store, &c.id).await {
                    Ok((e, l)) if look.known.refuses(e, &l) => {
                        stale_host(&mut store, c, secret, endpoint, look, a, e).await;
                    }
                    Ok(_) => break (store, a),
                    Err(e) => look.failed(a, &e),
                },
                Ok(Listener::Torchrun) => {
                    return Err(Error::cluster(format!(
                        "the rendezvous at {endpoint} (id {:?}): this endpoint is a torchrun \
                         rendezvous (every node must use the same launcher): start this node \
                         with torchrun as well, or every node with nrun",
                        c.id
                    )));
                }
                Ok(Listener::OtherNrun) => {
                    return Err(Error::cluster(format!(
                        "an nrun listens at {endpoint} but hosts no rendezvous with id {:?}: \
                         another job holds this endpoint (one job per endpoint port): give \
                         every node of this job the same --rdzv-id, or this job another \
                         --rdzv-endpoint port",
                        c.id
                    )));
                }
                Ok(Listener::Unknown) => {
                    look.store = true;
                    look.last = format!("{a}: a TCPStore with no rendezvous {:?} yet", c.id);
                }
                Err(e) => look.failed(a, &e),
            }
        }
        look.progress(endpoint, c, secs);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    look.joining = true;
    let lost = |e: std::io::Error| {
        // A store with a secret closes a client without one that touches nrun's keys.
        let hint = match e.kind() {
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                if secret.is_empty() =>
            {
                " (the hosting nrun has NRUN_RDZV_SECRET and this node has none? give every \
                 node the same one)"
            }
            _ => "",
        };
        Error::cluster(format!("the rendezvous at {endpoint}: {e}{hint}"))
    };
    crate::agent::prove(&mut store, secret, &endpoint)
        .await
        .map_err(|e| Error::cluster(crate::agent::refusal(e, lost).message))?;
    // The host publishes its run's name as soon as its store is up.
    let run_key = c10d_run_key(&c.id);
    let wanted: [&[u8]; 1] = [&run_key];
    if !store.wait(&wanted, None).await.map_err(lost)? {
        return Err(Error::internal(format!(
            "the rendezvous at {endpoint}: a wait for {:?} ended without it",
            c.id
        )));
    }
    let run = String::from_utf8_lossy(&store.get(&run_key).await.map_err(lost)?).into_owned();
    // A node index the launcher fixed (srun's SLURM_NODEID), else the next in join order.
    let node = match c.node {
        Some(n) => n,
        None => {
            let index = store.add(&c10d_next_key(&c.id), 1).await.map_err(lost)?;
            usize::try_from(index).unwrap_or(usize::MAX)
        }
    };
    admitted(&mut store, c, endpoint, look, node, slots, &lost).await?;
    // The agent opens its own connections; this one has done its part.
    Ok((reached, run, node))
}

/// Whether the hosting nrun takes node `node` (Err when not): a node of a host it left out on
/// evidence against the node itself (not its nrun's loss) is refused, with that evidence; a
/// node past the job's nodes and spares waits until the host has room (a node lost) where
/// `slots` allows. `io`: the error for the store connection's failure.
async fn admitted(
    store: &mut Client,
    c: &C10d,
    endpoint: &str,
    look: &mut Looking,
    node: usize,
    slots: &Slots,
    io: &dyn Fn(std::io::Error) -> Error,
) -> Result<()> {
    let host = crate::facts::machine_or_hostname();
    let refused = c10d_refused_key(&c.id, &host);
    if store.check(&[&refused]).await.map_err(io)? {
        let why = String::from_utf8_lossy(&store.get(&refused).await.map_err(io)?).into_owned();
        return Err(Error::no_nodes(format!(
            "the rendezvous at {endpoint} (id {:?}) refuses this node: the job left this host out \
             earlier, on evidence against the node itself: {why}. A node left out so does not \
             come back within the job (one whose nrun or link was lost does): check the node \
             (nrun doctor), then start it for the next job",
            c.id
        )));
    }
    if node < slots.slots || !slots.may_wait {
        return Ok(());
    }
    // Room opens when the host loses a node; it is a decimal count (see Session::publish_room).
    let room = c10d_room_key(&c.id);
    look.full = true;
    let mut said = false;
    loop {
        let free = match store.check(&[&room]).await.map_err(io)? {
            true => String::from_utf8_lossy(&store.get(&room).await.map_err(io)?)
                .trim()
                .parse::<u64>()
                .unwrap_or(0),
            false => 0,
        };
        if free > 0 {
            look.full = false;
            return Ok(());
        }
        if !said {
            look.wait.line(&format!(
                "the rendezvous at {endpoint} has all its nodes: this node waits for room (a \
                 node of the job lost) up to --join-timeout"
            ));
            said = true;
        }
        look.wait
            .waiting(|| format!("room in the rendezvous at {endpoint} (a node of the job lost)"));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Who listens at the endpoint. nrun's marker is read before its c10d key: the host sets the
/// key first, so whoever sees the marker sees the key too.
async fn what_listens(store: &mut Client, id: &str) -> std::io::Result<Listener> {
    if store.check(&[&torchrun_rdzv_key(id)]).await? {
        return Ok(Listener::Torchrun);
    }
    if !store.check(&[NRUN_STORE_KEY]).await? {
        return Ok(Listener::Unknown);
    }
    Ok(match store.check(&[&c10d_public_key(id)]).await? {
        true => Listener::Ours,
        false => Listener::OtherNrun,
    })
}

/// The endpoint's addresses: its name resolved, or (a Slurm node name the resolver does not
/// know) the NodeAddr Slurm has for it.
pub(super) fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    let found = (host, port)
        .to_socket_addrs()
        .map(|a| a.collect::<Vec<_>>());
    match found {
        Ok(a) if !a.is_empty() => Ok(a),
        Ok(_) => Err(Error::usage("resolves to no address")),
        Err(e) => {
            let out = std::process::Command::new("scontrol")
                .args(["show", "node", "-o", host])
                .output();
            let addr = out.ok().and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("NodeAddr=").map(str::to_string))
            });
            match addr.and_then(|a| (a.as_str(), port).to_socket_addrs().ok()) {
                Some(a) => Ok(a.collect()),
                None => Err(Error::usage(format!(
                    "{e} (and Slurm knows no NodeAddr for it)"
                ))),
            }
        }
    }
}
