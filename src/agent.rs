//! `nrun __agent`: the per-node side of a multi-node run, started over ssh (or srun).
//!
//! The conversation goes through the coordinator's store, in nrun's authenticated key space
//! (`nrun/<run>/...`), so there is one port and one protocol:
//! 1. the agent reads a [`Hello`] line on stdin (the per-run secret never appears on a command
//!    line), goes to the launch host's cwd, connects to the first coordinator address that
//!    answers, authenticates, and publishes a [`Joined`] record with its facts;
//! 2. it then executes numbered [`Step`]s (a reachability probe, a group of workers, the end)
//!    and publishes a [`StepResult`] for each;
//! 3. a `stop/<step>` key stops a running group politely; its stdin closing (ssh dropped, the
//!    launcher killed) or the store connection failing stops it within 2 s. Nothing the agent
//!    started outlives it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::facts::Facts;
use crate::node::output::{Sink, WorkerOutput};
use crate::node::{self, Outcome, Signals, StopRequest, WorkerCmd};
use crate::store::client::Client;

/// The first line an agent reads on stdin.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub secret: String,
    pub run: String,
    pub node: usize,
    /// How the user named this host.
    pub label: String,
    /// Coordinator addresses to try, "ip:port".
    pub addrs: Vec<String>,
    pub cwd: PathBuf,
    pub version: String,
    /// The Python to probe for torch's versions; None skips the probe.
    pub python: Option<PathBuf>,
}

/// What an agent publishes once connected.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Joined {
    /// The address of this node's end of its store connection.
    pub local_addr: String,
    /// The coordinator address that answered.
    pub reached: String,
    /// Where this node answers reachability probes from other nodes.
    pub probe_addr: String,
    pub facts: Facts,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Step {
    /// Connect to another node's probe listener.
    Probe {
        target: String,
        timeout_ms: u64,
    },
    /// Run a group of workers to its end.
    Run {
        workers: Vec<WorkerSpec>,
        grace_ms: u64,
        deadline_ms: Option<u64>,
    },
    End,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerSpec {
    pub rank: usize,
    pub local_rank: usize,
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub error_file: PathBuf,
    pub prefix: String,
    pub colour: usize,
    /// Whether stdout / stderr reach the console.
    pub console: [bool; 2],
    /// Where this worker's stdout.log and stderr.log go on its node (--log-dir), if anywhere.
    #[serde(default)]
    pub log_dir: Option<PathBuf>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum StepResult {
    Probe { error: Option<String> },
    Run(RunResult),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum RunResult {
    Success,
    Failed {
        rank: usize,
        local_rank: usize,
        pid: u32,
        exit_code: u8,
        how: String,
        at: String,
        stderr_tail: Vec<String>,
        traceback: Option<String>,
    },
    Interrupted(i32),
    TimedOut,
    Stopped,
    SpawnError(String),
    /// Set by the coordinator for a node whose agent connection ended without a result.
    Lost(String),
}

pub fn key(run: &str, what: &str) -> Vec<u8> {
    format!("nrun/{run}/{what}").into_bytes()
}

/// Entry point of `nrun __agent`; returns the exit code.
pub fn main() -> u8 {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
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
            3
        }
    };
    // Do not wait for the blocking read of stdin: it ends only when the launcher closes it.
    rt.shutdown_background();
    code
}

fn host() -> String {
    nix::unistd::gethostname().map_or_else(|_| "?".into(), |h| h.to_string_lossy().into_owned())
}

async fn run() -> Result<(), String> {
    let mut signals = Signals::install().map_err(|e| e.to_string())?;
    node::process::become_subreaper();
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
    let mut line = String::new();
    match tokio::time::timeout(Duration::from_secs(60), stdin.read_line(&mut line)).await {
        Ok(Ok(n)) if n > 0 => {}
        _ => {
            return Err(format!(
                "nrun agent on {}: no instructions on stdin (it is started by nrun, not by hand)",
                host()
            ));
        }
    }
    let hello: Hello = serde_json::from_str(&line)
        .map_err(|e| format!("nrun agent on {}: bad instructions: {e}", host()))?;
    let me = format!("{} ({})", hello.label, host());
    if hello.version != crate::cli::VERSION {
        return Err(format!(
            "nrun on {me} is version {} but the launch host runs {}: install the same nrun there, or pass --ship",
            crate::cli::VERSION,
            hello.version
        ));
    }
    if let Err(e) = std::env::set_current_dir(&hello.cwd) {
        return Err(format!(
            "the launch host's working directory {} does not exist on {me} ({e}): make it exist there (a shared filesystem), or start nrun from a directory every node has",
            hello.cwd.display()
        ));
    }

    // The first coordinator address that answers wins; they are tried at once.
    let (mut store, reached, local) = connect_any(&hello.addrs)
        .await
        .map_err(|e| format!("{me} cannot reach the launch host's store: {e}"))?;
    store
        .set(crate::store::server::AUTH_KEY, hello.secret.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let observe = [
        crate::store::server::OBSERVE_PREFIX,
        format!("{}/{}", hello.run, hello.node).as_bytes(),
    ]
    .concat();
    store.set(&observe, b"").await.map_err(|e| e.to_string())?;

    // Probes from other nodes arrive on the address the coordinator picks for this node
    // (normally this end of the path to it), so listen on every address.
    let any: std::net::IpAddr = if local.is_ipv4() {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let probe = tokio::net::TcpListener::bind(SocketAddr::new(any, 0))
        .await
        .map_err(|e| format!("{me}: cannot open a probe listener: {e}"))?;
    let probe_addr = SocketAddr::new(
        local.ip(),
        probe.local_addr().map_err(|e| e.to_string())?.port(),
    );
    tokio::spawn(async move {
        while let Ok((mut s, _)) = probe.accept().await {
            tokio::spawn(async move {
                let mut b = [0u8; 10];
                if s.read_exact(&mut b).await.is_ok() {
                    let _ = s.write_all(&b).await;
                }
            });
        }
    });
    let facts = tokio::task::spawn_blocking({
        let py = hello.python.clone();
        move || crate::facts::gather(py.as_deref())
    })
    .await
    .map_err(|e| e.to_string())?;
    let joined = Joined {
        local_addr: local.to_string(),
        reached: reached.to_string(),
        probe_addr: probe_addr.to_string(),
        facts,
    };
    let k = key(&hello.run, &format!("n{}/joined", hello.node));
    store
        .set(&k, &serde_json::to_vec(&joined).map_err(|e| e.to_string())?)
        .await
        .map_err(|e| e.to_string())?;

    // Losing stdin means the launcher is gone: stop everything fast.
    let (gone_tx, mut gone_rx) = watch::channel(false);
    tokio::spawn(async move {
        let mut rest = Vec::new();
        let _ = stdin.read_to_end(&mut rest).await;
        let _ = gone_tx.send(true);
    });

    for step_no in 0.. {
        let step_key = key(&hello.run, &format!("n{}/step/{step_no}", hello.node));
        let wanted: [&[u8]; 1] = [&step_key];
        let got = tokio::select! {
            r = store.wait(&wanted, None) => r,
            _ = gone_rx.wait_for(|g| *g) => return Err(format!("{me}: the launch host went away; stopping")),
        };
        got.map_err(|e| format!("{me}: lost the launch host's store: {e}"))?;
        let raw = store.get(&step_key).await.map_err(|e| e.to_string())?;
        let step: Step = serde_json::from_slice(&raw).map_err(|e| format!("{me}: cannot read step {step_no} from the launch host ({e}); is nrun the same version on both?"))?;
        let result = match step {
            Step::End => return Ok(()),
            Step::Probe { target, timeout_ms } => StepResult::Probe {
                error: probe_peer(&target, timeout_ms).await.err(),
            },
            Step::Run {
                workers,
                grace_ms,
                deadline_ms,
            } => {
                let (tx, rx) = watch::channel(StopRequest::None);
                let stop_key = key(&hello.run, &format!("stop/{step_no}"));
                let mut gone = gone_rx.clone();
                // A second connection waits for the stop key while this one is idle: one request
                // in flight per connection.
                let mut conn = Client::connect(reached, Duration::from_secs(10))
                    .await
                    .map_err(|e| e.to_string())?;
                conn.set(crate::store::server::AUTH_KEY, hello.secret.as_bytes())
                    .await
                    .map_err(|e| e.to_string())?;
                let watcher = tokio::spawn(async move {
                    let wanted: [&[u8]; 1] = [&stop_key];
                    tokio::select! {
                        r = conn.wait(&wanted, None) => {
                            let _ = tx.send(if r.is_ok() { StopRequest::Polite } else { StopRequest::Abandon });
                        }
                        _ = gone.wait_for(|g| *g) => { let _ = tx.send(StopRequest::Abandon); }
                    }
                });
                let r = run_workers(workers, grace_ms, deadline_ms, &mut signals, rx).await;
                watcher.abort();
                StepResult::Run(r)
            }
        };
        let rk = key(&hello.run, &format!("n{}/result/{step_no}", hello.node));
        store
            .set(
                &rk,
                &serde_json::to_vec(&result).map_err(|e| e.to_string())?,
            )
            .await
            .map_err(|e| e.to_string())?;
        if *gone_rx.borrow() {
            return Err(format!("{me}: the launch host went away; stopped"));
        }
    }
    Ok(())
}

async fn connect_any(addrs: &[String]) -> Result<(Client, SocketAddr, SocketAddr), String> {
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
                    let local = s.local_addr().map_err(|e| e.to_string())?;
                    let c = Client::from_stream(s)
                        .await
                        .map_err(|e| format!("{sa}: {e}"))?;
                    Ok((c, sa, local))
                }
                Ok(Err(e)) => Err(format!("{sa}: {e}")),
                Err(_) => Err(format!("{sa}: timed out")),
            }
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
    Err(format!(
        "tried {} ({}); check the firewall on the launch host and the route to it",
        addrs.join(", "),
        errors.join("; ")
    ))
}

async fn probe_peer(target: &str, timeout_ms: u64) -> Result<(), String> {
    let sa: SocketAddr = target
        .parse()
        .map_err(|_| format!("bad probe address {target}"))?;
    let t = Duration::from_millis(timeout_ms);
    let mut s = match tokio::time::timeout(t, tokio::net::TcpStream::connect(sa)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(format!("connect to {sa}: {e}")),
        Err(_) => {
            return Err(format!(
                "connect to {sa}: no answer within {timeout_ms} ms (dropped by a firewall?)"
            ));
        }
    };
    let msg = *b"nrun-probe";
    let mut back = [0u8; 10];
    match tokio::time::timeout(t, async {
        s.write_all(&msg).await?;
        s.read_exact(&mut back).await
    })
    .await
    {
        Ok(Ok(_)) if back == msg => Ok(()),
        Ok(Ok(_)) => Err(format!(
            "{sa} answered with something else (another service on that port?)"
        )),
        Ok(Err(e)) => Err(format!("{sa}: {e}")),
        Err(_) => Err(format!(
            "{sa}: connected but no echo within {timeout_ms} ms"
        )),
    }
}

async fn run_workers(
    specs: Vec<WorkerSpec>,
    grace_ms: u64,
    deadline_ms: Option<u64>,
    signals: &mut Signals,
    stop: watch::Receiver<StopRequest>,
) -> RunResult {
    let mut cmds = Vec::with_capacity(specs.len());
    for w in specs {
        if let Some(dir) = w.error_file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // Log files live on the worker's own node, as torchrun's do.
        let file = |name: &str| {
            w.log_dir.as_ref().and_then(|d| {
                std::fs::create_dir_all(d).ok()?;
                std::fs::File::create(d.join(name)).ok()
            })
        };
        let (out_file, err_file) = (file("stdout.log"), file("stderr.log"));
        cmds.push(WorkerCmd {
            rank: w.rank,
            local_rank: w.local_rank,
            program: w.program.into(),
            args: w.args.into_iter().map(Into::into).collect(),
            env: w.env,
            error_file: w.error_file,
            output: WorkerOutput {
                prefix: w.prefix,
                colour: w.colour,
                sinks: [
                    Sink {
                        console: w.console[0],
                        file: out_file,
                    },
                    Sink {
                        console: w.console[1],
                        file: err_file,
                    },
                ],
            },
        });
    }
    let deadline = deadline_ms.map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    match node::run_group(
        cmds,
        Duration::from_millis(grace_ms),
        deadline,
        signals,
        Some(stop),
    )
    .await
    {
        Err(e) => RunResult::SpawnError(format!("{} on {}", e.message, host())),
        Ok(Outcome::Success) => RunResult::Success,
        Ok(Outcome::Interrupted(s)) => RunResult::Interrupted(s),
        Ok(Outcome::TimedOut) => RunResult::TimedOut,
        Ok(Outcome::Stopped) => RunResult::Stopped,
        Ok(Outcome::Failed(f)) => RunResult::Failed {
            rank: f.rank,
            local_rank: f.local_rank,
            pid: f.pid,
            exit_code: f.exit.exit_code(),
            how: f.exit.describe(),
            at: humantime::format_rfc3339_seconds(f.at).to_string(),
            traceback: crate::report::read_error_file(&f.error_file),
            stderr_tail: f.stderr_tail,
        },
    }
}
