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
//! 3. a `stop/<step>` key stops a running group politely; its stdin closing (ssh dropped, the
//!    launcher killed) or the store connection failing stops it within 2 s. Nothing the agent
//!    started outlives it.
//!
//! An inner agent of the launch tree ([`tree`]) also starts the agents of its subtree over ssh
//! ([`child`]: the same agent process the launch host starts) and keeps them until the end.

pub mod child;
pub mod exec;
pub mod flight;
mod liveness;
pub mod peer;
pub mod protocol;
pub mod stacks;
pub mod tree;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt};
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::node::{Caught, Signals, StopRequest};
use crate::store::client::Client;
use exec::{Done, StepIo};
use protocol::{Hello, Joined, Keys, Step};

/// Set by nrun (to its pid) on an agent it starts on its own host, without ssh. nrun starts it
/// through the small spawner, whose child only clears its signal mask before the exec, so the
/// agent sets its own parent-death signal ([`tie_to_parent`]). It forks no keeper either: the
/// launcher's keeper and watch on this same host already cover every process below the
/// launcher (they are re-parented to that keeper, and carry its token).
pub const PARENT_VAR: &str = "NRUN_AGENT_PARENT";

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
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    let want = want.to_str().and_then(|s| s.parse::<i32>().ok());
    if want != Some(nix::unistd::getppid().as_raw()) {
        // Re-parented before the signal was set: the launcher died during the spawn.
        std::process::exit(i32::from(crate::error::exit::signal(libc::SIGKILL)));
    }
    TIED.store(true, std::sync::atomic::Ordering::Relaxed);
    true
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
/// challenge of this side's own, answered with [`crate::store::auth::prove_store`]): a store
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
    let mine = crate::store::auth::nonce()?;
    let key = [crate::store::server::STORE_PROOF_PREFIX, &mine].concat();
    let refuse = |why: String| std::io::Error::new(std::io::ErrorKind::PermissionDenied, why);
    // Something that is not nrun's store may never answer: no answer is no proof.
    let Ok(answer) = tokio::time::timeout(Duration::from_secs(10), conn.get(&key)).await else {
        return Err(refuse(format!(
            "the store at {at} did not answer this run's challenge within 10 s: refusing it \
             (something other than this run's nrun listens there; compare `nrun --version` on \
             both hosts)"
        )));
    };
    if !crate::store::auth::verify_store(secret.as_bytes(), &mine, &answer?) {
        return Err(refuse(format!(
            "the store at {at} does not know this run's secret (NRUN_RDZV_SECRET differs?): \
             refusing it"
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

/// Waits for the signal key `key` on `conn`: the signal to pass on (None: the connection broke,
/// or a bad value), and the connection back for the next key.
async fn wait_signal(mut conn: Client, key: Vec<u8>) -> (Client, Option<i32>) {
    let keys: [&[u8]; 1] = [&key];
    let sig = match conn.wait(&keys, None).await {
        Ok(_) => conn
            .get(&key)
            .await
            .ok()
            .and_then(|v| String::from_utf8_lossy(&v).parse().ok()),
        // The connection is gone: the stop watch sees the same and ends the step.
        Err(_) => std::future::pending().await,
    };
    (conn, sig)
}

async fn run() -> Result<()> {
    let signals = Signals::install(&[]).map_err(|e| Error::helper(e.to_string()))?;
    crate::node::process::become_subreaper();
    let here = crate::net::hostname();
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
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

/// The agent's life after its [`Hello`]: join the coordinator's store, run the steps it is
/// given, until the end (Ok: the job's exit code, when the coordinator left one) or the
/// coordinator is gone (`gone` set: stdin closed, or the store silent; or the store lost).
pub async fn serve(
    hello: Hello,
    mut signals: Signals,
    gone: watch::Sender<bool>,
    read_end: bool,
) -> Result<protocol::Ended> {
    let gone_rx = gone.subscribe();
    let here = crate::net::hostname();
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
    if hello.version != crate::cli::VERSION {
        return Err(Error::helper(format!(
            "nrun on {me} is version {} but the launch host runs {}: install the same nrun there, or pass --ship",
            crate::cli::VERSION,
            hello.version
        )));
    }
    if let Err(e) = std::env::set_current_dir(&hello.cwd) {
        return Err(Error::helper(format!(
            "the launch host's working directory {} does not exist on {me} ({e}): make it exist there (a shared filesystem), or start nrun from a directory every node has",
            hello.cwd.display()
        )));
    }
    let keys = Keys::new(&hello.run);

    // The first coordinator address that answers wins; they are tried at once.
    let (mut store, reached, local) = connect_any(&hello.addrs).await.map_err(|e| {
        Error::helper(format!(
            "nrun agent on {me}: cannot reach the launch host's store: {e}"
        ))
    })?;
    let lost = |e: std::io::Error| {
        Error::helper(format!(
            "nrun agent on {me}: lost the launch host's store: {e}"
        ))
    };
    prove(&mut store, &hello.secret, &reached)
        .await
        .map_err(|e| refusal(e, lost))?;
    store
        .set(&keys.observe(hello.node), b"")
        .await
        .map_err(lost)?;

    // Probes from other nodes arrive on the address the coordinator picks for this node
    // (normally this end of the path to it), so listen on every address.
    let any: std::net::IpAddr = if local.is_ipv4() {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let probe = tokio::net::TcpListener::bind(SocketAddr::new(any, 0))
        .await
        .map_err(|e| {
            Error::helper(format!(
                "nrun agent on {me}: cannot open a probe listener: {e}"
            ))
        })?;
    let probe_addr = SocketAddr::new(
        local.ip(),
        probe
            .local_addr()
            .map_err(|e| Error::helper(e.to_string()))?
            .port(),
    );
    tokio::spawn(exec::serve_probes(probe));
    let mut facts = tokio::task::spawn_blocking({
        let py = hello.python.clone();
        move || crate::facts::gather(py.as_deref())
    })
    .await
    .map_err(|e| Error::helper(e.to_string()))?;
    // This join's own nonce: steps sealed for it cover it (no replay from an earlier run).
    let nonce = crate::store::auth::random_hex().map_err(|e| {
        Error::helper(format!(
            "nrun agent on {me}: no random bytes from the OS: {e}"
        ))
    })?;
    let own_sealed = match (&hello.own, hello.secret.is_empty()) {
        (Some(own), false) => {
            let json = serde_json::to_vec(own).map_err(|e| Error::helper(e.to_string()))?;
            Some(crate::store::auth::seal(
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
        nonce: nonce.clone(),
        local_addr: local.to_string(),
        reached: reached.to_string(),
        probe_addr: probe_addr.to_string(),
        facts,
        own_sealed,
    };
    let record = serde_json::to_vec(&joined).map_err(|e| Error::helper(e.to_string()))?;
    store
        .set(&keys.joined(hello.node), &record)
        .await
        .map_err(lost)?;
    // Out of reach (the store silent) sets the same `gone` as stdin closing. An agent of nrun
    // on this very host needs no watch over a link, nor a heartbeat: nrun sees its process,
    // and it dies with nrun (a request every half second per agent, and a connection, saved).
    let _gone = match TIED.load(std::sync::atomic::Ordering::Relaxed) && !hello.heartbeat {
        true => Some(gone),
        false => {
            tokio::spawn(liveness::watch(
                reached,
                hello.secret.clone(),
                hello.heartbeat.then(|| keys.alive(hello.node)),
                Duration::from_millis(hello.agent_timeout_ms),
                gone,
                me.clone(),
            ));
            None
        }
    };

    let node = Node {
        keys,
        reached,
        secret: hello.secret.clone(),
        nonce,
        index: hello.node,
        me,
        read_end,
    };
    node.steps(&mut store, &mut signals, gone_rx).await
}

/// A joined agent's side of the conversation: where it reached the store and under which keys
/// it speaks.
struct Node {
    keys: Keys,
    reached: SocketAddr,
    secret: String,
    /// Chosen for this join and published in its [`Joined`] record: steps are sealed for it.
    nonce: String,
    index: usize,
    /// "label (host)", for messages.
    me: String,
    /// At the End, read the job's exit code and root cause (a node whose own nrun exits with
    /// them).
    read_end: bool,
}

impl Node {
    fn lost(&self, e: std::io::Error) -> Error {
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
                    let _ = store.set(&self.keys.result(self.index, no), b"end").await;
                    return Ok(protocol::Ended {
                        code: code.and_then(|c| String::from_utf8_lossy(&c).parse().ok()),
                        root_cause: root_cause
                            .and_then(|v| serde_json::from_slice(&v).ok())
                            .unwrap_or_default(),
                    });
                }
            };
            let value = serde_json::to_vec(&result).map_err(|e| Error::helper(e.to_string()))?;
            store
                .set(&self.keys.result(self.index, no), &value)
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
        if let Some(json) = crate::store::auth::open(secret, &key, self.nonce.as_bytes(), &raw) {
            return read(&json);
        }
        let unbound = crate::store::auth::open(secret, &key, b"", &raw)
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

    /// A connection of its own, authenticated (one request in flight per connection).
    async fn connect(&self) -> Result<Client> {
        let lost = |e| self.lost(e);
        let mut conn = Client::connect(self.reached, Duration::from_secs(10))
            .await
            .map_err(lost)?;
        prove(&mut conn, &self.secret, &self.reached)
            .await
            .map_err(|e| refusal(e, lost))?;
        Ok(conn)
    }

    /// Runs a step that starts workers: stop requests and signals to pass on arrive on two
    /// connections of their own, and the watch's views go out on the main one, idle meanwhile.
    async fn run(
        &self,
        store: &mut Client,
        signals: &mut Signals,
        gone_rx: &watch::Receiver<bool>,
        no: usize,
        step: Step,
    ) -> Result<Done> {
        let (tx, rx) = watch::channel(StopRequest::None);
        let stop_conn = self.connect().await?;
        let sig_conn = self.connect().await?;
        let watcher = self.stop_requests(stop_conn, sig_conn, signals, gone_rx.clone(), no, tx);
        let (views_tx, mut views) = tokio::sync::mpsc::unbounded_channel();
        let io = StepIo {
            stop: rx,
            views: Some(views_tx),
            secret: (!self.secret.is_empty()).then_some(self.secret.as_str()),
        };
        let run = exec::dispatch(step, io);
        tokio::pin!(run);
        tokio::pin!(watcher);
        let view_key = self.keys.watch(self.index, no);
        loop {
            tokio::select! {
                r = &mut run => return Ok(r),
                // Never ends: the watcher waits forever once it has spoken.
                () = &mut watcher => {}
                Some(v) = views.recv() => {
                    if let Ok(json) = serde_json::to_vec(&v) {
                        let _ = store.set(&view_key, &json).await;
                    }
                }
            }
        }
    }

    /// Turns step `no`'s stop key, its signal keys, the launcher going away and signals to the
    /// agent itself into requests for the running group, on `tx`.
    async fn stop_requests(
        &self,
        mut conn: Client,
        sig_conn: Client,
        signals: &mut Signals,
        mut gone: watch::Receiver<bool>,
        no: usize,
        tx: watch::Sender<StopRequest>,
    ) {
        let stop_key = self.keys.stop(no);
        let wanted: [&[u8]; 1] = [&stop_key];
        // Both waits live across the loop: a WAIT dropped mid-flight would leave its reply to
        // confuse the next request on that connection.
        let stop_wait = async {
            match conn.wait(&wanted, None).await {
                Ok(_) => match conn
                    .get(&stop_key)
                    .await
                    .ok()
                    .and_then(|v| protocol::stop_signal(&v))
                {
                    Some(sig) => StopRequest::Signal(sig),
                    None => StopRequest::Polite,
                },
                Err(_) => StopRequest::Abandon,
            }
        };
        tokio::pin!(stop_wait);
        let mut seq = 0;
        let mut sig_wait = Box::pin(wait_signal(sig_conn, self.keys.signal(no, seq)));
        let last = loop {
            let req = tokio::select! {
                r = &mut stop_wait => r,
                (c, sig) = &mut sig_wait => {
                    seq += 1;
                    sig_wait = Box::pin(wait_signal(c, self.keys.signal(no, seq)));
                    match sig {
                        Some(sig) => StopRequest::Forward(sig),
                        None => continue,
                    }
                }
                _ = gone.wait_for(|g| *g) => StopRequest::Abandon,
                // A signal to the agent itself (srun's, or a user's on that node).
                caught = signals.recv() => match caught {
                    Caught::Stop(sig) => StopRequest::Signal(sig),
                    Caught::Forward(sig) => StopRequest::Forward(sig),
                },
            };
            if !matches!(req, StopRequest::Forward(_)) {
                break req;
            }
            let _ = tx.send(req);
        };
        let _ = tx.send(last);
        // Keep the sender: dropping it would read as the coordinator going away.
        std::future::pending::<()>().await;
    }
}

async fn connect_any(addrs: &[String]) -> Result<(Client, SocketAddr, SocketAddr)> {
    let mut set = tokio::task::JoinSet::new();
    for a in addrs {
        let Ok(sa) = a.parse::<SocketAddr>() else {
            continue;
        };
        set.spawn(async move {
            let s =
                tokio::time::timeout(Duration::from_secs(10), tokio::net::TcpStream::connect(sa))
                    .await;
            match s {
                Ok(Ok(s)) => {
                    let local = s.local_addr().map_err(|e| Error::helper(e.to_string()))?;
                    let c = Client::from_stream(s)
                        .await
                        .map_err(|e| Error::helper(format!("{sa}: {e}")))?;
                    Ok((c, sa, local))
                }
                Ok(Err(e)) => Err(Error::helper(format!("{sa}: {e}"))),
                Err(_) => Err(Error::helper(format!("{sa}: timed out"))),
            }
        });
    }
    let mut errors = Vec::new();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => errors.push(e.message),
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
    use crate::store::Store;
    use crate::store::server;

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
                     differs?): refusing it"
                )
            );
        }

        // Torch clients (no secret, no proof either way) still use the store.
        let mut torch = client(good).await;
        torch.set(b"/user", b"v").await.unwrap();
        assert_eq!(torch.get(b"/user").await.unwrap(), b"v");
    }
}
