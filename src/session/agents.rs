//! Agent processes: `nrun __agent` started as a local child (the launch host's own node), over
//! the system ssh, or under srun; what they say on stderr; joining; ending them.

use std::collections::VecDeque;
use std::io::Write as _;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin};

use super::{Agent, JoinedNode, Node, Session};
use crate::agent::protocol::{Hello, Joined};
use crate::error::{Error, Result, exit};
use crate::plan::{NodesPlan, Plan};
use crate::remote::{self, Launcher};

/// Lines of an agent's stderr kept to explain why it failed.
const TAIL_LINES: usize = 10;

/// A node's agent process and what nrun saw of it.
pub struct AgentProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// The launch host's own node (no ssh).
    pub local: bool,
}

impl AgentProcess {
    /// How the process ended, if it has.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last non-empty line it wrote to stderr.
    pub fn last_words(&self) -> Option<String> {
        self.stderr_tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .cloned()
    }
}

/// Starts every node's agent, at most --ssh-concurrency at a time.
pub async fn start_all(s: &Session, plan: &Plan) -> Result<(Vec<Node>, Option<AgentProcess>)> {
    let np = &s.plan;
    let addrs = super::coordinator_addrs(s.rendezvous.port);
    let cwd = std::env::current_dir()
        .map_err(|e| Error::usage(format!("cannot read the current directory: {e}")))?;
    let secret = s.rendezvous.secret.clone().unwrap_or_default();
    let sem = Arc::new(tokio::sync::Semaphore::new(np.ssh_concurrency));
    let mut tasks = Vec::new();
    let first_peer = np.hosts.len() - np.peers;
    if np.launcher == Launcher::Srun && np.peers == 0 {
        return start_step(s, plan, &addrs, cwd, &secret).await;
    }
    for (i, h) in np.hosts.iter().enumerate() {
        if i >= first_peer {
            continue;
        }
        let local = crate::net::is_this_host(&h.name);
        let hello = Hello {
            secret: secret.clone(),
            run: s.run.clone(),
            node: i,
            label: h.name.clone(),
            // This machine's own node talks to the store over loopback: an address of some
            // other interface could go away under it (and buys nothing).
            addrs: if local {
                loopback_addrs(&addrs)
            } else {
                addrs.clone()
            },
            cwd: cwd.clone(),
            version: crate::cli::VERSION.to_string(),
            python: if np.python_probe {
                plan.python.clone()
            } else {
                None
            },
            forward_signals: plan.forward_signals.clone(),
            nodes: Vec::new(),
            heartbeat: false,
        };
        let (sem, np, label) = (sem.clone(), np.clone(), h.name.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            start_one(&np, &label, local, &hello).await
        }));
    }
    let mut nodes = Vec::new();
    for t in tasks {
        nodes.push(
            t.await
                .map_err(|e| Error::internal(format!("starting an agent: {e}")))??,
        );
    }
    // Nodes whose own nrun joins (c10d): named when they do.
    nodes.extend(np.hosts[first_peer..].iter().map(|h| Node {
        label: h.name.clone(),
        agent: Agent::Peer(super::PeerBeat::default()),
        joined: None,
    }));
    Ok((nodes, None))
}

/// Inside a Slurm allocation: every node's agent from one srun step, each finding its node by
/// name in a shared Hello and beating its heartbeat (the coordinator sees one process).
async fn start_step(
    s: &Session,
    plan: &Plan,
    addrs: &[String],
    cwd: std::path::PathBuf,
    secret: &str,
) -> Result<(Vec<Node>, Option<AgentProcess>)> {
    let np = &s.plan;
    let names: Vec<String> = np.hosts.iter().map(|h| h.name.clone()).collect();
    let hello = Hello {
        secret: secret.to_string(),
        run: s.run.clone(),
        node: 0,
        label: String::new(),
        addrs: addrs.to_vec(),
        cwd,
        version: crate::cli::VERSION.to_string(),
        python: np.python_probe.then(|| plan.python.clone()).flatten(),
        forward_signals: plan.forward_signals.clone(),
        nodes: names.clone(),
        heartbeat: true,
    };
    let argv = remote::srun_step_command(&names, &np.remote_nrun);
    let step = spawn_process(&argv, "the srun step", false, &hello).await?;
    let nodes = names
        .into_iter()
        .map(|label| Node {
            label,
            agent: Agent::Peer(super::PeerBeat::default()),
            joined: None,
        })
        .collect();
    Ok((nodes, Some(step)))
}

async fn start_one(np: &NodesPlan, label: &str, local: bool, hello: &Hello) -> Result<Node> {
    let argv = if local {
        // The launch host's own node needs no ssh: its agent is a child of nrun, spoken to the
        // same way (stdin, the store) so there is one code path.
        let exe = std::env::current_exe()
            .map_err(|e| Error::internal(format!("cannot find nrun's own executable: {e}")))?;
        vec![exe.into_os_string(), "__agent".into()]
    } else {
        let remote_nrun = match np.ship {
            true => ship(np, label).await?,
            false => np.remote_nrun.clone(),
        };
        match np.launcher {
            Launcher::Ssh => remote::ssh_command(label, &np.ssh_opts, &remote_nrun),
            Launcher::Srun => remote::srun_command(label, &remote_nrun),
        }
    };
    let process = spawn_process(&argv, label, local, hello).await?;
    Ok(Node {
        label: label.to_string(),
        agent: Agent::Process(Box::new(process)),
        joined: None,
    })
}

/// Starts `argv` (an agent, or the srun step of all of them) and gives it `hello` on stdin;
/// its stdout is passed on, its stderr too and kept for explaining a failure.
async fn spawn_process(
    argv: &[std::ffi::OsString],
    label: &str,
    local: bool,
    hello: &Hello,
) -> Result<AgentProcess> {
    let mut cmd = tokio::process::Command::new(&argv[0]);
    // Own process group: the terminal's Ctrl-C reaches nrun, which stops the job in order,
    // not ssh. PDEATHSIG: if nrun is killed outright, ssh goes too, the remote side sees its
    // stdin close and the agent stops its workers.
    cmd.args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| {
        Error::usage(format!(
            "cannot run {} to start the agent on {label}: {e}",
            argv[0].to_string_lossy()
        ))
    })?;
    let mut stdin = child.stdin.take();
    if let Some(s) = stdin.as_mut() {
        let line = serde_json::to_string(hello)
            .map_err(|e| Error::internal(format!("encoding the agent's instructions: {e}")))?;
        let _ = s.write_all(format!("{line}\n").as_bytes()).await;
    }
    let tail: Arc<Mutex<VecDeque<String>>> = Arc::new(Mutex::new(VecDeque::new()));
    // The agent prefixes its workers' lines; pass them on line by line.
    if let Some(out) = child.stdout.take() {
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(out).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let _ = writeln!(std::io::stdout().lock(), "{l}");
            }
        });
    }
    if let Some(err) = child.stderr.take() {
        let tail = tail.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(err).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let _ = writeln!(std::io::stderr().lock(), "{l}");
                let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(l);
            }
        });
    }
    Ok(AgentProcess {
        child,
        stdin,
        stderr_tail: tail,
        local,
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

/// Copies the running nrun to `~/.cache/nrun/nrun-<version>` on the host; returns that path.
async fn ship(np: &NodesPlan, label: &str) -> Result<String> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::internal(format!("cannot find nrun's own executable: {e}")))?;
    let version = env!("CARGO_PKG_VERSION");
    let rev = env!("NRUN_GIT_REV");
    let path = format!("~/.cache/nrun/nrun-{version}-{rev}");
    // A per-copy temporary name: nodes that share a home directory must not race.
    let remote_cmd = format!(
        "mkdir -p ~/.cache/nrun && t={p}.tmp.$$ && cat > $t && chmod +x $t && mv -f $t {p}",
        p = path
    );
    let mut argv = remote::ssh_command(label, &np.ssh_opts, "true");
    argv.pop();
    argv.push(remote_cmd.into());
    let bin = std::fs::File::open(&exe)
        .map_err(|e| Error::internal(format!("cannot read {}: {e}", exe.display())))?;
    let out = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::from(bin))
        .output()
        .await
        .map_err(|e| Error::usage(format!("cannot run ssh: {e}")))?;
    if !out.status.success() {
        return Err(Error::usage(format!(
            "--ship: copying nrun to {label} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(path)
}

/// Waits until every agent joined, exited, or --join-timeout passed; see [`Session::join`].
pub(super) async fn join(s: &mut Session) -> std::result::Result<Vec<(usize, String)>, u8> {
    let started = Instant::now();
    let k = s.nodes.len();
    let timeout = s.plan.join_timeout;
    let mut changed = s.store().map(|st| st.subscribe());
    let mut last_report = 0;
    let mut min_reached: Option<Instant> = None;
    // A progress bar where a person watches (stderr is a terminal), plain lines elsewhere.
    let bar = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
        let b = indicatif::ProgressBar::new(k as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "nrun: joining nodes {bar:30} {pos}/{len} {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    loop {
        let mut pending = 0;
        // The srun step that started the agents, if it ended: none of them will join now.
        let step_gone = s.step_process.as_mut().and_then(|p| p.exited()).is_some();
        for i in 0..k {
            if s.nodes[i].joined.is_some() {
                continue;
            }
            if take_joined(s, i) {
                continue;
            }
            match &mut s.nodes[i].agent {
                Agent::Process(p) => pending += usize::from(p.exited().is_none()),
                Agent::Peer(_) => pending += usize::from(!step_gone),
                Agent::InProcess => {}
            }
        }
        let joined = s.nodes.iter().filter(|n| n.joined.is_some()).count();
        match &bar {
            Some(b) => b.set_position(joined as u64),
            None if joined != last_report
                && joined < k
                && started.elapsed() > Duration::from_secs(1) =>
            {
                tracing::info!("{joined}/{k} nodes joined");
                last_report = joined;
            }
            None => {}
        }
        // Elastic: once MIN nodes are in, the others get the last call, then the job starts.
        let last_call = match joined >= s.plan.min_nodes && joined < k {
            true => min_reached.get_or_insert_with(Instant::now).elapsed() >= s.plan.last_call,
            false => false,
        };
        if pending == 0 || started.elapsed() > timeout || last_call {
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
            break;
        }
        // Records arrive as store writes; exits of agents are seen on the tick.
        tokio::select! {
            () = super::store_changed(&mut changed) => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            sig = s.signals.stop() => return Err(exit::signal(sig)),
        }
    }
    // Let stderr relays catch the last words of agents that exited.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut failures = Vec::new();
    for (i, n) in s.nodes.iter_mut().enumerate() {
        if n.joined.is_some() {
            continue;
        }
        let label = &n.label;
        let p = match &mut n.agent {
            Agent::Process(p) => p,
            Agent::Peer(_) if s.step_process.is_some() => {
                let step = s.step_process.as_mut();
                let why = match step.map(|p| (p.exited(), p.last_words())) {
                    Some((Some(st), said)) => format!(
                        "the srun step of the agents ended ({st}){}",
                        said.map_or(String::new(), |w| format!(": {w}"))
                    ),
                    _ => format!(
                        "its agent did not join within {} s (--join-timeout) though srun still \
                         runs: check that the node reaches this host (and `srun -w {label} true`)",
                        timeout.as_secs()
                    ),
                };
                failures.push((i, format!("{label}: {why}")));
                continue;
            }
            Agent::Peer(_) => {
                failures.push((
                    i,
                    format!(
                        "{label}: no nrun joined as this node in {:.0} s: start the same nrun \
                         command on every node, with the same --rdzv-endpoint and --rdzv-id",
                        started.elapsed().as_secs_f64()
                    ),
                ));
                continue;
            }
            Agent::InProcess => continue,
        };
        failures.push((i, match (p.exited(), p.last_words()) {
            (Some(st), Some(said)) => format!("{label}: {said} (exit {})", st.code().map_or("signal".into(), |c| c.to_string())),
            (Some(st), None) => format!("{label}: the agent exited ({st}) without a word; run `ssh {label} nrun --version` to check nrun is installed there"),
            (None, _) => format!(
                "{label}: did not join within {} s (--join-timeout); ssh is still running: a slow host, or nrun hanging there",
                timeout.as_secs()
            ),
        }));
    }
    tracing::info!(
        "{}/{k} nodes joined in {:.2} s",
        k - failures.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(failures)
}

/// Node `i`'s joined record, if its agent has published one.
pub(super) fn joined_record(s: &Session, i: usize) -> Option<Joined> {
    let raw = s.store()?.get(&s.keys.joined(i))?;
    serde_json::from_slice(&raw).ok()
}

/// Takes node `i`'s joined record into the session, if it has published one.
fn take_joined(s: &mut Session, i: usize) -> bool {
    let Some(record) = joined_record(s, i) else {
        return false;
    };
    let Joined {
        local_addr,
        reached,
        probe_addr,
        facts,
    } = record;
    if matches!(s.nodes[i].agent, Agent::Peer(_)) {
        // A joined node is named by its host, kept apart from a namesake.
        let name = facts.hostname.clone();
        let taken = |n: &str| {
            s.nodes
                .iter()
                .enumerate()
                .any(|(j, o)| j != i && o.label == n)
        };
        s.nodes[i].label = match taken(&name) {
            false => name,
            true => format!("{name}#{i}"),
        };
    }
    s.nodes[i].joined = Some(JoinedNode {
        facts: Some(facts),
        link: Some(super::AgentLink {
            local_addr,
            reached,
            probe_addr,
        }),
        ifname: None,
        master_addr: String::new(),
        addr: None,
    });
    true
}

/// Nodes that joined after the join ended (elastic): taken in, their indices returned.
pub(super) fn admit_late(s: &mut Session) -> Vec<usize> {
    let waiting: Vec<usize> = (0..s.nodes.len())
        .filter(|i| s.nodes[*i].joined.is_none())
        .collect();
    waiting.into_iter().filter(|i| take_joined(s, *i)).collect()
}

/// Ends every agent process (and the srun step that started them, if one did): they leave on
/// the End step by themselves; stdin is closed only after that, so they do not mistake the end
/// for the launcher going away. Stragglers: stdin closed, then killed.
pub(super) async fn end_all(nodes: &mut [Node], step: &mut Option<AgentProcess>) {
    let mut procs: Vec<&mut AgentProcess> = nodes
        .iter_mut()
        .filter_map(|n| match &mut n.agent {
            Agent::Process(p) => Some(&mut **p),
            _ => None,
        })
        .chain(step.as_mut())
        .collect();
    wait_exits(&mut procs, Duration::from_secs(2)).await;
    for p in procs.iter_mut() {
        p.stdin.take();
    }
    wait_exits(&mut procs, Duration::from_secs(3)).await;
    for p in procs.iter_mut() {
        if p.exited().is_none() {
            let _ = p.child.start_kill();
            let _ = p.child.wait().await;
        }
    }
}

/// Waits until every process has exited or `d` has passed.
async fn wait_exits(procs: &mut [&mut AgentProcess], d: Duration) {
    let deadline = tokio::time::Instant::now() + d;
    for p in procs.iter_mut() {
        let _ = tokio::time::timeout_at(deadline, p.child.wait()).await;
    }
}
