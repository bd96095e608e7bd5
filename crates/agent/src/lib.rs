//! `nrun __agent`: the per-node side of a run, started over ssh, srun, or as a local child.
//!
//! - [`protocol`]: the messages and the store keys they travel under.
//! - [`exec`]: what a node does for a step (shared with the in-process agent of one node).
//! - [`stacks`]: the watch's sampling of the workers' Python stacks.
//!
//! The conversation goes through the coordinator's store (see [`protocol`]):
//! 1. the agent reads a [`Hello`] line on stdin (the per-run secret never appears on a command
//!    line), goes to the launch host's cwd, connects to the first coordinator address that
//!    answers, authenticates both ways ([`prove`]: the store proves the secret first), and
//!    publishes a [`Joined`] record with its facts and a nonce chosen for this join;
//! 2. it then executes numbered [`Step`]s (a reachability probe, a group of workers, the end),
//!    each sealed for that nonce, and publishes a [`StepResult`] for each;
//! 3. while a group runs, the agent waits on the step's numbered [`Control`] keys
//!    ([`Keys::control`]): a stop (polite, or the signal the user sent nrun), a signal to pass
//!    on, or the launcher's terminal resized. Its stdin closing (ssh dropped, the launcher
//!    killed), the store unanswered for `--agent-timeout` ([`liveness`]) or the store
//!    connection failing stops the workers at once (SIGKILL within 2 s). Nothing the agent
//!    started outlives it.
//!
//! An inner agent of the launch tree ([`tree`]) also starts the agents of its subtree over ssh
//! ([`child`]: the same agent process the launch host starts) and keeps them until the end.

pub mod child;
mod cost;
pub mod exec;
pub mod flight;
mod gpu_time;
mod liveness;
mod oom;

pub mod ras;
pub mod relay;
pub mod stacks;
pub mod tree;

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt};
use tokio::sync::watch;

use exec::{Done, StepIo};
use nrun_base::error::{Error, Result};
use nrun_base::net;
use nrun_node::{Caught, Signals, StopRequest};
use nrun_proto::protocol::{
    self, AddrChoice, Control, Hello, Joined, Keys, NodeWatch, RunResult, Step, StepResult,
    Succession,
};
use nrun_store::client::Client;

/// Set by nrun (to its pid) on an agent it starts on its own host by exec, without ssh or a
/// spawner (see node::spawner: an agent it forks is tied there), so the agent sets its own
/// parent-death signal ([`tie_to_parent`]). It forks no keeper either: the
/// launcher's keeper and watch on this same host already cover every process below the
/// launcher (they are re-parented to that keeper, and carry its token).
pub(crate) const PARENT_VAR: &str = "NRUN_AGENT_PARENT";

/// A variable as a worker will see it: the last value its environment `env` gives, else nrun's
/// own (which the worker inherits).
pub(crate) fn worker_var(env: &[(String, String)], k: &str) -> Option<String> {
    env.iter()
        .rev()
        .find(|(x, _)| x == k)
        .map(|(_, v)| v.clone())
        .or_else(|| std::env::var(k).ok())
}

/// For an agent started by nrun on this host ([`PARENT_VAR`]): it gets SIGKILL when nrun dies
/// (as the parent's pre_exec used to arrange), and exits at once if nrun is already gone (the
/// signal could not be set in time). Returns whether this is such an agent. Must run before any
/// thread exists.
pub fn tie_to_parent() -> bool {
    let Some(want) = std::env::var_os(PARENT_VAR) else {
        return false;
    };
    // SAFETY: no other thread exists yet (called first thing in main). Not inherited by the
    // workers, whose own nrun (if any) is no agent of this one.
    unsafe { std::env::remove_var(PARENT_VAR) };
    // Unparsable: no parent matches (it exits as a re-parented one would).
    let want = want
        .to_str()
        .and_then(|s| s.parse::<i32>().ok())
        .unwrap_or(-1);
    tie_to(want);
    true
}

/// Ties this agent to `parent`, which started it on this machine (an exec'd agent's launcher,
/// or the spawner that forked it): it dies with it, and needs no watch over its link.
pub(crate) fn tie_to(parent: i32) {
    nrun_node::process::die_with(parent);
    TIED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The agent forked by nrun's spawner (`nrun_node::spawner::fork`): tied to the spawner, then
/// [`main`].
pub fn forked(spawner: i32) -> u8 {
    tie_to(spawner);
    main()
}

/// This agent dies with the nrun that started it on this host ([`tie_to_parent`]).
static TIED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Entry point of `nrun __agent`; returns the exit code.
pub fn main() -> u8 {
    // One thread: an agent waits on its store connections and its workers, and a thousand
    // agents on one host each waking idle worker threads cost their host more than the work.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nrun agent: cannot start: {e}");
            return 1;
        }
    };
    // Workers are spawned from this (main) thread: see node::run_group on PR_SET_PDEATHSIG.
    let code = match rt.block_on(run()) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            e.code
        }
    };
    // Do not wait for the blocking read of stdin: it ends only when the launcher closes it.
    rt.shutdown_background();
    code
}

/// Proves the run's secret on a connection, after the store has proved it knows it too (a
/// challenge of this side's own, answered with [`nrun_store::auth::prove_store`]): a store
/// that cannot is refused with an error of kind `PermissionDenied` naming the secret (see
/// [`refusal`]). A run without a secret (a c10d rendezvous whose nodes share none) has nothing
/// to prove. `at` names the store in messages.
pub async fn prove(
    conn: &mut Client,
    secret: &str,
    at: &(dyn std::fmt::Display + Sync),
) -> std::io::Result<()> {
    if secret.is_empty() {
        return Ok(());
    }
    let mine = nrun_store::auth::nonce()?;
    let key = [nrun_store::server::STORE_PROOF_PREFIX, &mine].concat();
    let refuse = |why: String| std::io::Error::new(std::io::ErrorKind::PermissionDenied, why);
    // Something that is not nrun's store may never answer: no answer is no proof.
    let Ok(answer) = tokio::time::timeout(Duration::from_secs(10), conn.get(&key)).await else {
        return Err(refuse(format!(
            "the store at {at} did not answer this run's challenge within 10 s: refusing it \
             (something other than this run's nrun listens there; compare `nrun --version` on \
             both hosts)"
        )));
    };
    if !nrun_store::auth::verify_store(secret.as_bytes(), &mine, &answer?) {
        return Err(refuse(format!(
            "the store at {at} does not know this run's secret (NRUN_RDZV_SECRET differs, or \
             the nodes run different nrun versions: compare `nrun --version`): refusing it"
        )));
    }
    conn.authenticate(secret.as_bytes()).await
}

/// The error for a failed [`prove`]: a store refused for not knowing the secret as it is,
/// anything else as `lost` words it.
pub fn refusal(e: std::io::Error, lost: impl FnOnce(std::io::Error) -> Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::PermissionDenied => Error::helper(e.to_string()),
        _ => lost(e),
    }
}

async fn run() -> Result<()> {
    let signals = Signals::install(&[]).map_err(|e| Error::helper(e.to_string()))?;
    nrun_node::process::become_subreaper();
    let here = nrun_base::net::hostname();
    let mut stdin = tokio::io::BufReader::new(stdin_reader());
    let mut line = String::new();
    match tokio::time::timeout(Duration::from_secs(60), stdin.read_line(&mut line)).await {
        Ok(Ok(n)) if n > 0 => {}
        _ => {
            return Err(Error::helper(format!(
                "nrun agent on {here}: no instructions on stdin (it is started by nrun, not by hand)"
            )));
        }
    }
    let hello: Hello = serde_json::from_str(&line)
        .map_err(|e| Error::helper(format!("nrun agent on {here}: bad instructions: {e}")))?;
    // Losing stdin means the launcher is gone: stop everything fast.
    let (gone, _) = watch::channel(false);
    let from_stdin = gone.clone();
    tokio::spawn(async move {
        let mut rest = Vec::new();
        let _ = stdin.read_to_end(&mut rest).await;
        // Kept even with no one subscribed yet: the agent reads it once it does.
        from_stdin.send_replace(true);
    });
    // An inner agent of the launch tree starts its children first: their handshakes overlap
    // its own join.
    let subtree = tree::Subtree::start(&hello);
    // Its exit code is not the job's (nrun reads the job's from its results): the End's code
    // and root cause are not read.
    let served = serve(hello, signals, gone, false).await;
    if let Some(t) = subtree {
        // Nothing it started outlives it: at the End its children leave as it does, else
        // they are killed before it exits.
        match served {
            Ok(_) => t.finish().await,
            Err(_) => t.kill().await,
        }
    }
    served.map(|_| ())
}

/// The agent's stdin (the launcher's pipe: its [`Hello`], then its end when the launcher goes)
/// read by the runtime where it is a pipe; tokio's `stdin()` holds a thread blocked in `read`
/// for the agent's whole life. Its own descriptor: dropping it leaves fd 0 open.
fn stdin_reader() -> Box<dyn tokio::io::AsyncRead + Unpin + Send> {
    let pipe = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .ok()
        .and_then(|fd| tokio::net::unix::pipe::Receiver::from_owned_fd(fd).ok());
    match pipe {
        Some(p) => Box::new(p),
        None => Box::new(tokio::io::stdin()),
    }
}

/// The last [`Succession`] this process's agent received from its host (a c10d node's nrun
/// reads it when the host is lost).
static SUCCESSION: std::sync::Mutex<Option<Succession>> = std::sync::Mutex::new(None);

/// How this process's agent lost its host's store, the first word on it (None: not lost).
static LOSS: std::sync::Mutex<Option<HostLoss>> = std::sync::Mutex::new(None);

/// How a node lost its host's store: what decides whether the host counts as dead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostLoss {
    /// Its connection ended (EOF, reset, refused): the host's process is gone, the kernel
    /// closed its sockets.
    Closed(String),
    /// No answer within --agent-timeout: the host may be frozen or cut off, alive elsewhere.
    Silent(String),
}

impl HostLoss {
    fn of(e: &std::io::Error) -> HostLoss {
        match e.kind() {
            std::io::ErrorKind::TimedOut => HostLoss::Silent(e.to_string()),
            _ => HostLoss::Closed(e.to_string()),
        }
    }
}

/// The last succession this process's agent received (see [`Succession`]).
pub fn last_succession() -> Option<Succession> {
    SUCCESSION.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// How this process's agent lost its host (None: it did not, or it has not noticed yet).
pub fn host_loss() -> Option<HostLoss> {
    LOSS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Notes the first word on how the host was lost.
pub(crate) fn lost_host(how: HostLoss) {
    LOSS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert(how);
}

/// Keeps `s` as the last succession, and in `file` (atomically) when it changed: an nrun
/// started again with the same command reads it there to find the current host.
fn keep_succession(s: &Succession, file: Option<&std::path::Path>) {
    let mut last = SUCCESSION.lock().unwrap_or_else(|e| e.into_inner());
    if last.as_ref() == Some(s) {
        return;
    }
    *last = Some(s.clone());
    drop(last);
    if let (Some(path), Ok(json)) = (file, serde_json::to_vec(s)) {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = nrun_base::outputs::replace(path, &json) {
            tracing::debug!("cannot keep the succession in {}: {e}", path.display());
        }
    }
}

/// The agent's life after its [`Hello`]: join the coordinator's store, run the steps it is
/// given, until the end (Ok: the job's exit code, when the coordinator left one) or the
/// coordinator is gone (`gone` set: stdin closed, or the store silent; or the store lost).
pub async fn serve(
    hello: Hello,
    signals: Signals,
    gone: watch::Sender<bool>,
    read_end: bool,
) -> Result<protocol::Ended> {
    // A node's nrun that took over, or rejoined, serves again: a loss is this serving's.
    *LOSS.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let served = join_and_serve(hello, signals, gone, read_end).await;
    // This node's workers are all gone, and so are every other node's (the End): the scratch
    // they used can go.
    nrun_base::files::remove_scratch();
    served
}

async fn join_and_serve(
    hello: Hello,
    mut signals: Signals,
    gone: watch::Sender<bool>,
    read_end: bool,
) -> Result<protocol::Ended> {
    let gone_rx = gone.subscribe();
    let (hello, me) = checked(hello, &mut signals)?;
    let keys = Keys::new(&hello.run);
    let (mut store, reached, local, chosen) = reach_store(&hello, &keys, &me).await?;
    let at = Reached {
        reached,
        local,
        chosen,
    };
    let nonce = publish_joined(&mut store, &hello, &keys, &me, &at).await?;
    // Out of reach (the store silent) sets the same `gone` as stdin closing. An agent of nrun
    // on this very host needs no watch over a link, nor a heartbeat: nrun sees its process,
    // and it dies with nrun (a request every half second per agent, and a connection, saved).
    let _gone = match TIED.load(std::sync::atomic::Ordering::Relaxed) && !hello.heartbeat {
        true => Some(gone),
        false => {
            liveness::spawn(
                reached,
                hello.secret.clone(),
                hello.heartbeat.then(|| keys.alive(hello.node)),
                Duration::from_millis(hello.agent_timeout_ms),
                gone,
                me.clone(),
            );
            None
        }
    };

    let node = Node {
        keys,
        secret: hello.secret.clone(),
        nonce,
        index: hello.node,
        me,
        read_end,
        mark: hello.output_mark.clone(),
        state_file: hello.state_file.clone(),
    };
    node.steps(&mut store, &mut signals, gone_rx).await
}

/// The [`Hello`] with this node's place in it, and "label (host)" for messages, once this
/// host can serve it: the signals it forwards, the same nrun, the launch host's directory.
fn checked(hello: Hello, signals: &mut Signals) -> Result<(Hello, String)> {
    let here = nrun_base::net::hostname();
    let (node, label) = hello.place()?;
    let hello = Hello {
        node,
        label,
        ..hello
    };
    let me = format!("{} ({here})", hello.label);
    signals
        .also_forward(&hello.forward_signals)
        .map_err(|e| Error::helper(format!("nrun agent on {here}: {e}")))?;
    if hello.version != nrun_base::VERSION {
        return Err(Error::helper(format!(
            "nrun on {me} is version {} but the launch host runs {}: install the same nrun there, or pass --ship",
            nrun_base::VERSION,
            hello.version
        )));
    }
    if let Err(e) = std::env::set_current_dir(&hello.cwd) {
        return Err(Error::helper(format!(
            "the launch host's working directory {} does not exist on {me} ({e}): make it exist there (a shared filesystem), or start nrun from a directory every node has",
            hello.cwd.display()
        )));
    }
    Ok((hello, me))
}

/// The error for a store connection lost after it was made.
fn lost(me: &str) -> impl Fn(std::io::Error) -> Error + Copy + '_ {
    move |e: std::io::Error| {
        Error::helper(format!(
            "nrun agent on {me}: lost the launch host's store: {e}"
        ))
    }
}

/// A proven connection to the coordinator's store, the address it went to and how that was
/// chosen, and this end's address; this node is marked seen there.
async fn reach_store(
    hello: &Hello,
    keys: &Keys,
    me: &str,
) -> Result<(Client, SocketAddr, SocketAddr, AddrChoice)> {
    let (mut store, reached, local, how) =
        connect(&hello.addrs, choose(hello)).await.map_err(|e| {
            Error::helper(format!(
                "nrun agent on {me}: cannot reach the launch host's store: {e}"
            ))
        })?;
    let lost = lost(me);
    prove(&mut store, &hello.secret, &reached)
        .await
        .map_err(|e| refusal(e, lost))?;
    store
        .set(&keys.observe(hello.node), b"")
        .await
        .map_err(lost)?;
    Ok((store, reached, local, how))
}

/// The launch host's address this agent uses, and how it was chosen (None: nothing to choose
/// by). The control plane takes the path that was already checked: the user's address, else
/// loopback on the launch host's own machine, else the address this node's ssh connection came
/// from, else the one the launch host (or this node's parent in the launch tree) chose for it.
/// Never whichever answers first: that may be a network nobody checked (a docker bridge, a
/// management network), and it can change from run to run.
pub fn choose(hello: &Hello) -> Option<(SocketAddr, AddrChoice)> {
    let addrs: Vec<SocketAddr> = hello.addrs.iter().filter_map(|a| a.parse().ok()).collect();
    let of = |ip: IpAddr| {
        addrs
            .iter()
            .find(|a| net::canonical(a.ip()) == net::canonical(ip))
            .copied()
    };
    if hello.pinned {
        return addrs.first().map(|a| (*a, AddrChoice::Given));
    }
    if !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback()) {
        return Some((addrs[0], AddrChoice::Local));
    }
    // Behind NAT or a jump host the client address is none of the launch host's: not taken.
    if let Some(a) = ssh_client().and_then(of) {
        return Some((a, AddrChoice::Ssh));
    }
    let p = hello.prefer.as_ref()?;
    let a = p.ip.parse().ok().and_then(of)?;
    Some((a, p.how))
}

/// The client's address of the ssh connection this agent runs in (`SSH_CONNECTION`: client
/// address, client port, server address, server port).
fn ssh_client() -> Option<IpAddr> {
    std::env::var("SSH_CONNECTION")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A connection to the store at the `chosen` address (the route it took is named when it
/// fails), or with none chosen the first of `addrs` to answer; with the address it went to,
/// how that was chosen, and this end's address.
pub async fn connect(
    addrs: &[String],
    chosen: Option<(SocketAddr, AddrChoice)>,
) -> Result<(Client, SocketAddr, SocketAddr, AddrChoice)> {
    let Some((sa, how)) = chosen else {
        let (c, reached, local) = connect_any(addrs).await?;
        return Ok((c, reached, local, AddrChoice::First));
    };
    let (c, local) = connect_one(sa).await.map_err(|e| {
        let route = match net::route_from(sa) {
            Some((src, Some(dev))) => format!("this node's route to it goes from {src} on {dev}"),
            Some((src, None)) => format!("this node's route to it goes from {src}"),
            None => "this node has no route to it".to_string(),
        };
        Error::helper(format!(
            "{sa}, the address {} ({route}): {e}; check the firewall on the launch host and \
             the route between them (`ip route get {}` here), or give the address to use \
             (--local-addr)",
            how.words(),
            sa.ip()
        ))
    })?;
    Ok((c, sa, local, how))
}

/// A store connection to `sa` and this end's address, within 10 s.
async fn connect_one(sa: SocketAddr) -> std::result::Result<(Client, SocketAddr), String> {
    let s = tokio::time::timeout(Duration::from_secs(10), tokio::net::TcpStream::connect(sa))
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
        .map_err(|e| e.to_string())?;
    let local = s.local_addr().map_err(|e| e.to_string())?;
    let c = Client::from_stream(s).await.map_err(|e| e.to_string())?;
    Ok((c, local))
}

/// Where this agent reached the store: the address, this end's, and how it was chosen.
#[derive(Clone, Copy)]
struct Reached {
    reached: SocketAddr,
    local: SocketAddr,
    chosen: AddrChoice,
}

/// Publishes this node's [`Joined`] record (its facts, its probe listener, its own work
/// sealed); returns this join's nonce.
async fn publish_joined(
    store: &mut Client,
    hello: &Hello,
    keys: &Keys,
    me: &str,
    at: &Reached,
) -> Result<String> {
    let Reached {
        reached,
        local,
        chosen,
    } = *at;
    let probe_addr = match hello.probed {
        true => exec::listen_for_probes(local).await.map_err(|e| {
            Error::helper(format!(
                "nrun agent on {me}: cannot listen on a free TCP port for the other nodes' \
                 reachability probes: {e}; check this host's open-file limit (ulimit -n) and \
                 its free ports (sysctl net.ipv4.ip_local_port_range)"
            ))
        })?,
        false => String::new(),
    };
    let mut facts = if nrun_proto::facts::quick(hello.python.as_deref()) {
        // Files and netlink only: a thread of its own would cost the agent more than the work
        // (a thousand agents on one machine: a tenth of their start).
        nrun_proto::facts::gather(hello.python.as_deref())
    } else {
        tokio::task::spawn_blocking({
            let py = hello.python.clone();
            move || nrun_proto::facts::gather(py.as_deref())
        })
        .await
        .map_err(|e| Error::helper(e.to_string()))?
    };
    // This join's own nonce: steps sealed for it cover it (no replay from an earlier run).
    let nonce = nrun_base::random_hex().map_err(|e| {
        Error::helper(format!(
            "nrun agent on {me}: no random bytes from the OS: {e}"
        ))
    })?;
    let own_sealed = match (&hello.own, hello.secret.is_empty()) {
        (Some(own), false) => {
            let json = serde_json::to_vec(own).map_err(|e| Error::helper(e.to_string()))?;
            Some(nrun_store::auth::seal(
                hello.secret.as_bytes(),
                &keys.joined(hello.node),
                nonce.as_bytes(),
                &json,
            ))
        }
        (own, _) => {
            facts.own = own.clone();
            None
        }
    };
    let joined = Joined {
        kept: nrun_node::keeper::kept(),
        nonce: nonce.clone(),
        local_addr: local.to_string(),
        reached: reached.to_string(),
        chosen,
        probe_addr,
        facts,
        own_sealed,
    };
    let record = serde_json::to_vec(&joined).map_err(|e| Error::helper(e.to_string()))?;
    store
        .set(&keys.joined(hello.node), &record)
        .await
        .map_err(lost(me))?;
    // A c10d node (its own work) says it joined only now that the host can see it: a test or a
    // person acting on the line (a spare is in) finds it true.
    if hello.own.is_some() {
        tracing::info!("joined the rendezvous at {reached} as node {}", hello.node);
    }
    Ok(nonce)
}

/// A joined agent's side of the conversation: under which keys it speaks (on its one
/// connection to the store).
struct Node {
    keys: Keys,
    secret: String,
    /// Chosen for this join and published in its [`Joined`] record: steps are sealed for it.
    nonce: String,
    index: usize,
    /// "label (host)", for messages.
    me: String,
    /// At the End, read the job's exit code and root cause (a node whose own nrun exits with
    /// them).
    read_end: bool,
    /// The launch host's token for the line behind each step's output (empty: none).
    mark: String,
    /// Where a c10d node keeps the last succession (see [`keep_succession`]).
    state_file: Option<std::path::PathBuf>,
}

impl Node {
    /// What this node publishes (a step's result, with its stderr tails and tracebacks; the
    /// watch's views of its workers), sealed with the run's secret as its steps are: whoever
    /// reads the store without the secret (a c10d store on the network) learns nothing of it.
    /// Bound to the key only (run, node, step), not to this join: the launch host reads it
    /// whether or not it has taken this join's record in yet.
    fn seal(&self, key: &[u8], value: &[u8]) -> Vec<u8> {
        nrun_store::auth::seal(self.secret.as_bytes(), key, b"", value)
    }

    fn lost(&self, e: std::io::Error) -> Error {
        lost_host(HostLoss::of(&e));
        Error::helper(format!(
            "nrun agent on {}: lost the launch host's store: {e}",
            self.me
        ))
    }

    /// Does the steps it is given, one after another, until the End (Ok: the job's exit code
    /// and root cause, when the coordinator left them) or the coordinator is gone.
    async fn steps(
        &self,
        store: &mut Client,
        signals: &mut Signals,
        mut gone_rx: watch::Receiver<bool>,
    ) -> Result<protocol::Ended> {
        let me = &self.me;
        let lost = |e| self.lost(e);
        for no in 0.. {
            let step = tokio::select! {
                r = self.next_step(store, no) => r?,
                _ = gone_rx.wait_for(|g| *g) => return Err(Error::helper(format!("nrun agent on {me}: the launch host went away; stopping"))),
            };
            if let Step::Run {
                succession: Some(s),
                ..
            } = &step
            {
                keep_succession(s, self.state_file.as_deref());
            }
            let done = match step.runs_workers() {
                true => self.run(store, signals, &gone_rx, no, step).await?,
                // Nothing runs: no stop requests to wait for.
                false => {
                    let (_keep, stop) = watch::channel(StopRequest::None);
                    let io = StepIo {
                        stop,
                        views: None,
                        secret: None,
                    };
                    exec::dispatch(step, io).await
                }
            };
            let result = match done {
                Done::Result(r) => r,
                Done::End => {
                    let (code, root_cause) = match self.read_end {
                        true => {
                            let code = store.get(&self.keys.exit()).await.ok();
                            // Read only if set (a GET of a missing key would wait for it).
                            let why = self.keys.root_cause();
                            let root_cause = match store.check(&[&why]).await {
                                Ok(true) => store.get(&why).await.ok(),
                                _ => None,
                            };
                            (code, root_cause)
                        }
                        false => (None, None),
                    };
                    // Acknowledged, so a coordinator waiting for nodes that joined by
                    // themselves can close its store.
                    let key = self.keys.result(self.index, no);
                    let _ = store.set(&key, &self.seal(&key, b"end")).await;
                    return Ok(protocol::Ended {
                        code: code.and_then(|c| String::from_utf8_lossy(&c).parse().ok()),
                        root_cause: root_cause
                            .and_then(|v| serde_json::from_slice(&v).ok())
                            .unwrap_or_default(),
                    });
                }
            };
            self.end_of_output(no).await;
            let value = serde_json::to_vec(&result).map_err(|e| Error::helper(e.to_string()))?;
            let key = self.keys.result(self.index, no);
            store
                .set(&key, &self.seal(&key, &value))
                .await
                .map_err(lost)?;
            if *gone_rx.borrow() {
                return Err(Error::helper(format!(
                    "nrun agent on {me}: the launch host went away; stopped"
                )));
            }
        }
        Ok(protocol::Ended::default())
    }

    /// Marks the end of step `no`'s output on stdout and stderr, behind its workers' last lines
    /// (their writer is done when the step is), before its result goes out: the launch host
    /// takes the result once both marks came through the pipe that relays this agent, so every
    /// line is on its console before it acts on the result (or exits). Written off the
    /// runtime: a pipe the launch host is slow to read must not stop this agent's heartbeat.
    async fn end_of_output(&self, no: usize) {
        use std::io::Write as _;
        if self.mark.is_empty() {
            return;
        }
        let line = protocol::output_mark(&self.mark, self.index, no);
        // A pipe that is gone: the launch host sees the mark missing and says so.
        let _ = tokio::task::spawn_blocking(move || {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(line.as_bytes()).and_then(|()| out.flush());
            drop(out);
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
        })
        .await;
    }

    /// Waits for step `no` and opens it: only steps sealed with the run's secret for this
    /// join's nonce are run, so nothing injected starts a process, nor does a step captured
    /// from an earlier run. A step sealed before this node joined (bound to no nonce) is taken
    /// only if it runs nothing: an idle step or the End.
    async fn next_step(&self, store: &mut Client, no: usize) -> Result<Step> {
        let me = &self.me;
        let lost = |e| self.lost(e);
        let key = self.keys.step(self.index, no);
        let wanted: [&[u8]; 1] = [&key];
        store.wait(&wanted, None).await.map_err(lost)?;
        let raw = store.get(&key).await.map_err(lost)?;
        let secret = self.secret.as_bytes();
        let read = |json: &[u8]| {
            serde_json::from_slice::<Step>(json).map_err(|e| {
                Error::helper(format!(
                    "nrun agent on {me}: cannot read step {no} from the launch host ({e}); is nrun the same version on both?"
                ))
            })
        };
        if let Some(json) = nrun_store::auth::open(secret, &key, self.nonce.as_bytes(), &raw) {
            return read(&json);
        }
        let unbound = nrun_store::auth::open(secret, &key, b"", &raw)
            .map(|json| read(&json))
            .transpose()?;
        match unbound {
            Some(step) if !step.runs_workers() && !matches!(step, Step::Probe { .. }) => Ok(step),
            Some(_) => Err(Error::helper(format!(
                "nrun agent on {me}: step {no} in the launch host's store is not sealed for this node's join \
                 (a step replayed from an earlier run?); refusing it"
            ))),
            None => Err(Error::helper(format!(
                "nrun agent on {me}: step {no} in the launch host's store is not sealed with this run's \
                 secret for this node's join; refusing it (something other than this run's nrun \
                 wrote it, a step replayed from an earlier run, or the nruns differ: compare \
                 `nrun --version` on both)"
            ))),
        }
    }

    /// Runs a step that starts workers. The one connection to the store waits for the step's
    /// next control (a stop, a signal to pass on) and, between waits, publishes the watch's
    /// views: a wait is cancelled when a view is due, the workers end, or a signal or the
    /// launcher's loss comes first (two more connections per agent and step were a third of a
    /// thousand-node job's descriptors). The workers run in a task of their own, and requests
    /// reach them before a wait is cancelled: a store cut off never answers the cancel.
    async fn run(
        &self,
        store: &mut Client,
        signals: &mut Signals,
        gone_rx: &watch::Receiver<bool>,
        no: usize,
        step: Step,
    ) -> Result<Done> {
        let (tx, rx) = watch::channel(StopRequest::None);
        let (views_tx, mut views) = tokio::sync::mpsc::unbounded_channel();
        let io = StepIo {
            stop: rx,
            views: Some(views_tx),
            secret: (!self.secret.is_empty()).then(|| self.secret.clone()),
        };
        let mut run = tokio::spawn(exec::dispatch(step, io));
        let mut gone = gone_rx.clone();
        let view_key = self.keys.watch(self.index, no);
        let mut seq = 0;
        let mut requests = Requests {
            tx,
            stopping: false,
        };
        // None once the store is lost (and with it every later control and view).
        let mut conn = Some(store);
        // Each source of wake-ups is left out once it has nothing more to say.
        let (mut views_open, mut gone_seen) = (true, false);

        /// What ended a wait for the next control.
        enum Woke {
            Ran(Done),
            View(Option<NodeWatch>),
            /// A signal or the launcher's loss, already passed on to the workers.
            Told,
        }
        loop {
            let key = self.keys.control(no, seq);
            let reqs = &mut requests;
            let interrupt = async {
                tokio::select! {
                    d = &mut run => Woke::Ran(d.unwrap_or_else(|e| {
                        Done::Result(StepResult::Run(RunResult::SpawnError(format!(
                            "the agent's worker supervision failed: {e}"
                        ))))
                    })),
                    v = views.recv(), if views_open => Woke::View(v),
                    // A signal to the agent itself (srun's, or a user's on that node).
                    c = signals.recv() => {
                        reqs.send(match c {
                            Caught::Stop(sig) => StopRequest::Signal(sig),
                            Caught::Forward(sig) => StopRequest::Forward(sig),
                            Caught::Delivered(sig) => StopRequest::Delivered(sig),
                        });
                        Woke::Told
                    }
                    _ = gone.wait_for(|g| *g), if !gone_seen => {
                        reqs.send(StopRequest::Abandon);
                        gone_seen = true;
                        Woke::Told
                    }
                }
            };
            let (ready, woke) = match conn.as_mut() {
                Some(c) => c.wait_or(&[&key], interrupt).await,
                None => (Ok(false), Some(interrupt.await)),
            };
            match ready {
                Ok(true) => {
                    seq += 1;
                    let value = match conn.as_mut() {
                        Some(c) => c.get(&key).await.ok(),
                        None => None,
                    };
                    requests.send(match value.as_deref().and_then(Control::decode) {
                        Some(Control::Forward(sig)) => StopRequest::Forward(sig),
                        // Not a request: the workers' loop looks once a second.
                        Some(Control::Resize(sizes)) => {
                            nrun_node::output::tell_console(sizes);
                            StopRequest::None
                        }
                        Some(Control::Stop(Some(sig))) => StopRequest::Signal(sig),
                        Some(Control::Stop(None)) => StopRequest::Polite,
                        // A value nrun did not write: nothing to do.
                        None => StopRequest::None,
                    });
                }
                Ok(false) => {}
                // The store is gone: the workers stop; no more controls or views.
                Err(_) => {
                    conn = None;
                    requests.send(StopRequest::Abandon);
                }
            }
            match woke {
                Some(Woke::Ran(done)) => return Ok(done),
                Some(Woke::View(Some(v))) => {
                    if let (Some(c), Ok(json)) = (conn.as_mut(), serde_json::to_vec(&v)) {
                        let _ = c.set(&view_key, &self.seal(&view_key, &json)).await;
                    }
                }
                // The watch ended before the workers did: nothing more to publish.
                Some(Woke::View(None)) => views_open = false,
                Some(Woke::Told) | None => {}
            }
        }
    }
}

/// The requests of one step on their way to its workers: the first one other than a forwarded
/// signal is the last (a second stop is the launcher's to act on).
struct Requests {
    tx: watch::Sender<StopRequest>,
    stopping: bool,
}

impl Requests {
    fn send(&mut self, req: StopRequest) {
        if self.stopping || matches!(req, StopRequest::None) {
            return;
        }
        self.stopping = req.stops();
        let _ = self.tx.send(req);
    }
}

/// The first of `addrs` to answer (all tried at once): only where nothing chose one.
async fn connect_any(addrs: &[String]) -> Result<(Client, SocketAddr, SocketAddr)> {
    let mut set = tokio::task::JoinSet::new();
    for a in addrs {
        let Ok(sa) = a.parse::<SocketAddr>() else {
            continue;
        };
        set.spawn(async move {
            connect_one(sa)
                .await
                .map(|(c, local)| (c, sa, local))
                .map_err(|e| format!("{sa}: {e}"))
        });
    }
    let mut errors = Vec::new();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(e.to_string()),
        }
    }
    Err(Error::helper(format!(
        "tried {} ({}); check the firewall on the launch host and the route to it",
        addrs.join(", "),
        errors.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use nrun_store::Store;
    use nrun_store::server;

    async fn serve(store: Arc<Store>) -> SocketAddr {
        let l = server::bind(0).unwrap();
        let port = l.local_addr().unwrap().port();
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        tokio::spawn(async move { server::serve(l, store, std::future::pending()).await });
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    async fn client(at: SocketAddr) -> Client {
        Client::connect(at, Duration::from_secs(5)).await.unwrap()
    }

    /// The store proves the secret before the agent does: a store that knows it is served; one
    /// with another secret (a wrong proof) or none (it stores anything and proves nothing, as a
    /// fake that accepts any proof) is refused, naming the secret.
    #[tokio::test]
    async fn an_agent_refuses_a_store_that_does_not_know_the_secret() {
        let good = serve(Store::with_secret(b"s3cret".to_vec())).await;
        let mut c = client(good).await;
        prove(&mut c, "s3cret", &good).await.unwrap();
        c.set(b"nrun/r/x", b"1").await.unwrap();
        assert_eq!(c.get(b"nrun/r/x").await.unwrap(), b"1", "authenticated");

        for store in [Store::with_secret(b"other".to_vec()), Store::new()] {
            let at = serve(store).await;
            let mut c = client(at).await;
            let e = prove(&mut c, "s3cret", &at).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
            let said = refusal(e, |e| Error::helper(format!("lost: {e}"))).message;
            assert_eq!(
                said,
                format!(
                    "the store at {at} does not know this run's secret (NRUN_RDZV_SECRET \
                     differs, or the nodes run different nrun versions: compare `nrun \
                     --version`): refusing it"
                )
            );
        }

        // Torch clients (no secret, no proof either way) still use the store.
        let mut torch = client(good).await;
        torch.set(b"/user", b"v").await.unwrap();
        assert_eq!(torch.get(b"/user").await.unwrap(), b"v");
    }
}
