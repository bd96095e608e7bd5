//! `nrun __agent` as a child process of nrun: on this host (the launch host's own node, no
//! ssh) or over the system ssh (`--ship` copies this binary first). The process is the link:
//! its exit loses the node, its stderr explains why, and closing its stdin tells the agent the
//! launcher is gone. [`AgentProcess`] is shared with the srun step, which is one such process
//! for every node.

use std::collections::VecDeque;
use std::io::Write as _;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::os::unix::process::ExitStatusExt as _;
use std::process::ExitStatus;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::{oneshot, watch};

use super::{BoxFuture, Bus, Ending, Instructions, Joining, NodeLink, Nudges};
use crate::agent::protocol::Hello;
use crate::error::{Error, Result};
use crate::hosts::Host;
use crate::plan::NodesPlan;
use crate::remote;
use crate::session::Node;

/// Lines of an agent's stderr kept to explain why it failed.
const TAIL_LINES: usize = 10;

/// Bytes read at a time from an agent's stdout and stderr.
const RELAY_BUFFER: usize = 2048;

/// An agent process (or the srun step of all of them) and what nrun saw of it. A task of its
/// own waits for it (and kills it when asked, or when this is dropped), so that its end is an
/// event for the session (a nudge for its node), not something to ask every node about.
pub struct AgentProcess {
    /// How it ended, once it has (set by its task).
    ended: watch::Receiver<Option<ExitStatus>>,
    /// Tells its task to kill it (dropped: the same).
    kill: Option<oneshot::Sender<()>>,
    stdin: Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

impl AgentProcess {
    /// Starts `argv` and gives it `hello` on stdin; its stdout is passed on, its stderr too
    /// and kept for explaining a failure. `what` names it in an error. `own_agent`: `argv` is
    /// this very binary's agent, which sets its parent-death signal itself (see
    /// [`crate::agent::PARENT_VAR`]); anything else (ssh) gets it between fork and exec.
    /// Started by nrun's spawner where there is one (see [`crate::node::spawner`]: starting a
    /// program from nrun itself costs a copy of its file table, which grows with the nodes),
    /// else by nrun. `nudge`: whom to tell, for which node, when it ends.
    pub async fn spawn(
        argv: &[std::ffi::OsString],
        what: &str,
        hello: &Hello,
        own_agent: bool,
        nudge: Option<(Arc<Nudges>, usize)>,
    ) -> Result<Self> {
        let cannot = |e: &dyn std::fmt::Display| {
            Error::usage(format!(
                "cannot run {} to start the agent on {what}: {e}",
                argv[0].to_string_lossy()
            ))
        };
        let started = match crate::node::spawner::client() {
            Some(sp) => by_spawner(&sp, argv, own_agent).await,
            None => by_nrun(argv, own_agent),
        };
        let Started {
            mut stdin,
            stdout,
            stderr,
            ended,
            kill,
        } = started.map_err(|e| cannot(&e))?;
        if let Some(s) = stdin.as_mut() {
            let line = serde_json::to_string(hello)
                .map_err(|e| Error::internal(format!("encoding the agent's instructions: {e}")))?;
            let _ = s.write_all(format!("{line}\n").as_bytes()).await;
        }
        let tail: Arc<Mutex<VecDeque<String>>> = Arc::new(Mutex::new(VecDeque::new()));
        // The agent prefixes its workers' lines; pass them on line by line. Small buffers: two
        // per node, they were a third of the launch host's memory at a thousand nodes (8 KiB
        // each), and a longer line still comes through whole.
        if let Some(out) = stdout {
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::with_capacity(RELAY_BUFFER, out).lines();
                while let Ok(Some(l)) = lines.next_line().await {
                    let _ = writeln!(std::io::stdout().lock(), "{l}");
                }
            });
        }
        if let Some(err) = stderr {
            let tail = tail.clone();
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::with_capacity(RELAY_BUFFER, err).lines();
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
        if let Some((nudges, node)) = nudge {
            let mut done = ended.clone();
            tokio::spawn(async move {
                let _ = done.wait_for(|s| s.is_some()).await;
                nudges.nudge(node);
            });
        }
        Ok(AgentProcess {
            ended,
            kill: Some(kill),
            stdin,
            stderr_tail: tail,
        })
    }

    /// How the process ended, if it has.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        *self.ended.borrow()
    }

    /// Until the process ended.
    async fn wait(&mut self) {
        let _ = self.ended.wait_for(|s| s.is_some()).await;
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

    /// The last line nrun itself (the agent: its lines start with "nrun"), ssh or srun wrote:
    /// the agent's stderr also carries its workers' lines, and a worker's unrelated complaint
    /// is no cause of a lost node.
    pub fn own_words(&self) -> Option<String> {
        let ours = |l: &str| {
            let l = l.trim_start();
            ["nrun", "ssh:", "srun:", "Connection to "]
                .iter()
                .any(|p| l.starts_with(p))
        };
        self.stderr_tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .rev()
            .find(|l| ours(l))
            .cloned()
    }

    /// How it ended, with nrun's or ssh's last words: " (exit status: 255): what it said".
    pub fn epitaph(&mut self) -> Option<String> {
        let st = self.exited()?;
        Some(format!(
            " ({st}){}",
            self.own_words().map_or(String::new(), |w| format!(": {w}"))
        ))
    }

    /// Ends it after the End step: agents leave by themselves; stdin is closed only after
    /// that, so they do not mistake the end for the launcher going away. Stragglers: stdin
    /// closed, then killed.
    pub async fn finish(&mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.wait()).await;
        self.stdin.take();
        let _ = tokio::time::timeout(Duration::from_secs(3), self.wait()).await;
        if self.exited().is_none() {
            if let Some(k) = self.kill.take() {
                let _ = k.send(());
            }
            self.wait().await;
        }
    }
}

type Reader = Box<dyn tokio::io::AsyncRead + Send + Unpin>;

/// A process just started: its standard descriptors, its end once it came, and how to kill it.
struct Started {
    stdin: Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>,
    stdout: Option<Reader>,
    stderr: Option<Reader>,
    ended: watch::Receiver<Option<ExitStatus>>,
    /// Fire (or drop) to kill it.
    kill: oneshot::Sender<()>,
}

/// Starts `argv` through nrun's spawner, on pipes nrun holds the other ends of.
async fn by_spawner(
    sp: &Arc<crate::node::spawner::Client>,
    argv: &[std::ffi::OsString],
    own_agent: bool,
) -> std::io::Result<Started> {
    use tokio::net::unix::pipe;
    let flags = nix::fcntl::OFlag::O_CLOEXEC;
    let (in_r, in_w) = nix::unistd::pipe2(flags)?;
    let (out_r, out_w) = nix::unistd::pipe2(flags)?;
    let (err_r, err_w) = nix::unistd::pipe2(flags)?;
    let env = match (own_agent, crate::node::spawner::pid()) {
        (true, Some(pid)) => vec![(crate::agent::PARENT_VAR.into(), pid.to_string().into())],
        _ => Vec::new(),
    };
    let child = sp
        .start(argv, &env, [in_r, out_w, err_w], !own_agent)
        .await
        .map_err(std::io::Error::other)?;
    let (kill, killed) = oneshot::channel::<()>();
    let (sp, pid, mut ended) = (sp.clone(), child.pid, child.ended.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = async { ended.wait_for(|s| s.is_some()).await.is_ok() } => {}
            // Asked to, or nobody holds this process any more.
            _ = killed => sp.kill(pid, libc::SIGKILL).await,
        }
    });
    Ok(Started {
        stdin: Some(Box::new(pipe::Sender::from_owned_fd(in_w)?)),
        stdout: Some(Box::new(pipe::Receiver::from_owned_fd(out_r)?)),
        stderr: Some(Box::new(pipe::Receiver::from_owned_fd(err_r)?)),
        ended: child.ended,
        kill,
    })
}

/// Starts `argv` from nrun itself (no spawner).
fn by_nrun(argv: &[std::ffi::OsString], own_agent: bool) -> std::io::Result<Started> {
    let mut cmd = tokio::process::Command::new(&argv[0]);
    // Own process group: the terminal's Ctrl-C reaches nrun, which stops the job in order,
    // not ssh. PDEATHSIG: if nrun is killed outright, ssh goes too, the remote side sees its
    // stdin close and the agent stops its workers.
    cmd.args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if own_agent {
        cmd.env(crate::agent::PARENT_VAR, std::process::id().to_string());
    } else {
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn()?;
    let stdin = child
        .stdin
        .take()
        .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>);
    let stdout = child.stdout.take().map(|s| Box::new(s) as Reader);
    let stderr = child.stderr.take().map(|s| Box::new(s) as Reader);
    let (ended_tx, ended) = watch::channel(None);
    let (kill, killed) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let status = tokio::select! {
            st = child.wait() => st,
            // Asked to, or nobody holds this process any more.
            _ = killed => {
                let _ = child.start_kill();
                child.wait().await
            }
        };
        // A wait that failed (it cannot, for a child of ours) reads as an end.
        let status = status.unwrap_or_else(|_| ExitStatus::from_raw(0xff << 8));
        ended_tx.send_replace(Some(status));
    });
    Ok(Started {
        stdin,
        stdout,
        stderr,
        ended,
        kill,
    })
}

/// A node whose agent is a child process of nrun.
pub struct ChildLink {
    process: AgentProcess,
    local: bool,
    /// How soon its agent stops its workers by itself once it cannot reach this host.
    agent_timeout: Duration,
    /// A partition closes no ssh for many seconds; the agent's heartbeat stops at once.
    beat: super::peer::Heartbeat,
}

/// Starts every owned node's agent, at most --ssh-concurrency at a time; each one's end
/// nudges its node in `nudges`.
pub async fn start(
    np: &NodesPlan,
    hosts: &[Host],
    how: &Instructions,
    nudges: &Arc<Nudges>,
) -> Result<Vec<Node>> {
    let sem = Arc::new(tokio::sync::Semaphore::new(np.ssh_concurrency));
    // One copy of the plan shared by every start (a copy each was O(nodes^2) memory).
    let shared = Arc::new(np.clone());
    let mut tasks = Vec::new();
    for (i, h) in hosts.iter().enumerate() {
        let local = crate::net::is_this_host(&h.name);
        // This machine's own node talks to the store over loopback: an address of some other
        // interface could go away under it (and buys nothing).
        let addrs = match local {
            true => loopback_addrs(&how.addrs),
            false => how.addrs.clone(),
        };
        let mut hello = how.hello(i, &h.name, addrs, Vec::new());
        // This host's own agent is watched as a process, not by its heartbeat.
        hello.heartbeat = !local;
        let (sem, np, label) = (sem.clone(), shared.clone(), h.name.clone());
        let nudge = (nudges.clone(), i);
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            start_one(&np, &label, local, &hello, nudge).await
        }));
    }
    let mut nodes = Vec::new();
    for t in tasks {
        nodes.push(
            t.await
                .map_err(|e| Error::internal(format!("starting an agent: {e}")))??,
        );
    }
    Ok(nodes)
}

async fn start_one(
    np: &NodesPlan,
    label: &str,
    local: bool,
    hello: &Hello,
    nudge: (Arc<Nudges>, usize),
) -> Result<Node> {
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
        remote::ssh_command(label, &np.ssh_opts, &remote_nrun)
    };
    let process = AgentProcess::spawn(&argv, label, hello, local, Some(nudge)).await?;
    let agent_timeout = np.agent_timeout;
    let link = ChildLink {
        process,
        local,
        agent_timeout,
        beat: Default::default(),
    };
    Ok(Node::new(label, Box::new(link)))
}

impl NodeLink for ChildLink {
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
        match self.process.epitaph() {
            None if stopped => Some(format!(
                "lost the connection to {label}: its agent stopped its workers when the link \
                 to the launch host broke"
            )),
            // A process of this host that runs is no node cut off (it beats no heartbeat).
            None if self.local => None,
            None => self.beat.silent(bus, node).map(|quiet| {
                format!(
                    "lost the connection to {label}: its agent sent no heartbeat for {:.1} s (its \
                     host is down or cut off from this one); it stops its workers there by itself \
                     within {} s of losing this host (--agent-timeout)",
                    quiet.as_secs_f64(),
                    self.agent_timeout.as_secs_f64()
                )
            }),
            Some(how) => Some(format!(
                "lost the connection to {label}{how}; its agent stops its workers there by itself \
                 within {} s of losing this host (--agent-timeout)",
                self.agent_timeout.as_secs_f64()
            )),
        }
    }

    fn end<'a>(&'a mut self, _: Ending<'a>) -> BoxFuture<'a, ()> {
        Box::pin(self.process.finish())
    }
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
