//! An agent as a child process: `nrun __agent` on this host, or ssh starting one on another
//! (`--ship` copies this binary there first). Used by the launch host's links
//! (`session::link::child`, the srun step) and by an inner agent of the launch tree
//! ([`super::tree`]), which starts its children's agents the same way. The process is the
//! link: its exit loses the node, its stderr explains why, and closing its stdin tells the
//! agent the launcher is gone.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::os::unix::process::ExitStatusExt as _;
use std::process::ExitStatus;

use tokio::io::AsyncWriteExt;
use tokio::sync::{oneshot, watch};

use crate::relay::Nudges;
pub use crate::relay::{Delivery, Marks};
use crate::relay::{Passing, Reader, Stream, own_line};
use nrun_base::error::{Error, Result};
use nrun_proto::protocol::Hello;
use nrun_proto::remote;

/// How long an agent's pipes may stay open after its end, held by something it left.
const RELAY_DRAIN: Duration = Duration::from_secs(2);

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
    /// The marks behind each step's output that came through its pipes (None: not read here).
    marks: Option<Arc<Marks>>,
    /// The tasks passing its stdout and stderr on.
    relays: Vec<tokio::task::JoinHandle<()>>,
}

/// What starts a node's agent.
pub enum Starter {
    /// This very binary's agent, on this machine (the launch host's own nodes, an inner agent's
    /// nodes of its own machine): forked by nrun's spawner where there is one (no exec, see
    /// [`nrun_node::spawner::Program::Agent`]), else `nrun __agent`, which sets its
    /// parent-death signal itself (see [`crate::PARENT_VAR`]).
    Here,
    /// A program that starts it elsewhere (ssh, srun): it gets its parent-death signal
    /// between fork and exec.
    Program(Vec<std::ffi::OsString>),
}

impl AgentProcess {
    /// Starts an agent and gives it `hello` on stdin; its stdout is passed on, its stderr too
    /// and kept for explaining a failure. `what` names it in an error. Started by nrun's
    /// spawner where there is one (see [`nrun_node::spawner`]: starting a program from nrun
    /// itself costs a copy of its file table, which grows with the nodes), else by nrun.
    /// `relay`: how its lines are passed on (see [`Relay`]).
    pub async fn spawn(starter: &Starter, what: &str, hello: &Hello, relay: Relay) -> Result<Self> {
        let none: Option<std::future::Ready<Option<nrun_proto::protocol::Prefer>>> = None;
        Self::spawn_with(starter, what, hello, relay, none).await
    }

    /// As [`AgentProcess::spawn`], the Hello's [`Hello::prefer`] set from `prefer` (when
    /// given) once the process runs: a name lookup for it overlaps ssh's own connection
    /// instead of delaying it.
    pub async fn spawn_with(
        starter: &Starter,
        what: &str,
        hello: &Hello,
        relay: Relay,
        prefer: Option<impl std::future::Future<Output = Option<nrun_proto::protocol::Prefer>>>,
    ) -> Result<Self> {
        let cannot = |e: &dyn std::fmt::Display| {
            let program = match starter {
                Starter::Here => "nrun".to_string(),
                Starter::Program(argv) => argv[0].to_string_lossy().into_owned(),
            };
            Error::usage(format!(
                "cannot run {program} to start the agent on {what}: {e}"
            ))
        };
        // An agent that starts agents on this machine (an inner agent of the launch tree) gets
        // a spawner of its own.
        let spawner = hello.tree.iter().any(|b| b.local);
        let started = match nrun_node::spawner::client() {
            Some(sp) => by_spawner(&sp, starter, spawner).await,
            None => by_nrun(starter),
        };
        let Started {
            mut stdin,
            stdout,
            stderr,
            ended,
            kill,
        } = started.map_err(|e| cannot(&e))?;
        let late;
        let hello = match prefer {
            Some(p) => {
                late = Hello {
                    prefer: p.await,
                    ..hello.clone()
                };
                &late
            }
            None => hello,
        };
        if let Some(s) = stdin.as_mut() {
            let line = serde_json::to_string(hello)
                .map_err(|e| Error::internal(format!("encoding the agent's instructions: {e}")))?;
            let _ = s.write_all(format!("{line}\n").as_bytes()).await;
        }
        let tail: Arc<Mutex<VecDeque<String>>> = Arc::new(Mutex::new(VecDeque::new()));
        // The launch host reads the marks behind each step's output (see [`Marks`]); an inner
        // agent of the launch tree passes its children's on with their lines.
        let marks = (relay.marks && !hello.output_mark.is_empty()).then(|| {
            Arc::new(Marks::new(
                hello.output_mark.clone(),
                relay.nudge.as_ref().map(|(n, _)| n.clone()),
            ))
        });
        // The agent prefixes its workers' lines; pass them on line by line.
        let mut relays = Vec::new();
        for (pipe, stream) in [(stdout, Stream::Out), (stderr, Stream::Err)] {
            let Some(pipe) = pipe else { continue };
            let to = Passing {
                stream,
                marks: marks.clone(),
                tag: relay.tag.clone(),
                tail: (stream == Stream::Err).then(|| tail.clone()),
            };
            relays.push(tokio::spawn(to.relay(pipe)));
        }
        if let Some((nudges, nodes)) = relay.nudge {
            let mut done = ended.clone();
            tokio::spawn(async move {
                let _ = done.wait_for(|s| s.is_some()).await;
                for n in nodes {
                    nudges.nudge(n);
                }
            });
        }
        Ok(AgentProcess {
            ended,
            kill: Some(kill),
            stdin,
            stderr_tail: tail,
            marks,
            relays,
        })
    }

    /// How the process ended, if it has.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        *self.ended.borrow()
    }

    /// Its end, for another to watch (the nodes of the launch tree it starts).
    pub fn ended(&self) -> watch::Receiver<Option<ExitStatus>> {
        self.ended.clone()
    }

    /// Kills it now and waits for its end (an inner agent of the launch tree leaving early:
    /// its children must not outlive it).
    pub async fn kill(&mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
        self.wait().await;
    }

    /// Until the process ended.
    pub async fn wait(&mut self) {
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
        self.stderr_tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .rev()
            .find(|l| own_line(l))
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
        // What it wrote last is passed on before nrun goes on (and exits): its pipes end with
        // it, unless a process it left holds them (bounded).
        let relays = std::mem::take(&mut self.relays);
        let _ = tokio::time::timeout(RELAY_DRAIN, futures_join(relays)).await;
    }

    /// The marks read from its pipes, if the launch host reads them.
    pub fn marks(&self) -> Option<Arc<Marks>> {
        self.marks.clone()
    }
}

/// Awaits every task of `tasks`.
async fn futures_join(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in tasks {
        let _ = t.await;
    }
}

/// How an exit status reads in a node's failure: "exited 255", "was killed by SIGKILL".
pub fn how_it_ended(st: &ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exited {c}"),
        (None, Some(s)) => format!("was killed by {}", nrun_node::signal_name(s)),
        _ => format!("ended ({st})"),
    }
}

/// How an agent process's output is passed on and its end told.
#[derive(Default)]
pub struct Relay {
    /// The launch host: it reads the marks behind each step's output (an inner agent of the
    /// launch tree passes them on).
    pub marks: bool,
    /// Whom to nudge, for which nodes, when it ends (the launch host's session).
    pub nudge: Option<(Arc<Nudges>, Vec<usize>)>,
    /// Its own lines (nrun's, ssh's) on stderr go on as "TAG: line" (a child of an inner agent
    /// of the launch tree, named by its node).
    pub tag: Option<String>,
}

/// A process just started: its standard descriptors, its end once it came, and how to kill it.
struct Started {
    stdin: Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>,
    stdout: Option<Reader>,
    stderr: Option<Reader>,
    ended: watch::Receiver<Option<ExitStatus>>,
    /// Fire (or drop) to kill it.
    kill: oneshot::Sender<()>,
}

/// Starts the agent through nrun's spawner, on pipes nrun holds the other ends of.
/// `spawner`: a forked agent gets a spawner of its own.
async fn by_spawner(
    sp: &Arc<nrun_node::spawner::Client>,
    starter: &Starter,
    spawner: bool,
) -> std::io::Result<Started> {
    use nrun_node::spawner::Program;
    use tokio::net::unix::pipe;
    let flags = nix::fcntl::OFlag::O_CLOEXEC;
    let (in_r, in_w) = nix::unistd::pipe2(flags)?;
    let (out_r, out_w) = nix::unistd::pipe2(flags)?;
    let (err_r, err_w) = nix::unistd::pipe2(flags)?;
    let program = match starter {
        Starter::Here => Program::Agent { spawner },
        Starter::Program(argv) => Program::exec(argv, true),
    };
    let child = sp
        .start(program, [in_r, out_w, err_w])
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

/// Starts the agent from nrun itself (no spawner).
fn by_nrun(starter: &Starter) -> std::io::Result<Started> {
    let (argv, own_agent) = match starter {
        Starter::Here => {
            let exe = std::env::current_exe().map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot find nrun's own executable: {e}"))
            })?;
            (vec![exe.into_os_string(), "__agent".into()], true)
        }
        Starter::Program(argv) => (argv.clone(), false),
    };
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
        cmd.env(crate::PARENT_VAR, std::process::id().to_string());
    } else {
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                Ok(())
            });
        }
    }
    // Spared by the sweep of the workers' orphans (this is no orphan: an inner agent's ssh
    // lives from one group of workers to the next).
    let mut child = nrun_node::process::spawn_own(|| {
        let c = cmd.spawn()?;
        let pid = c.id();
        Ok((c, pid))
    })?;
    let pid = child.id();
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
        if let Some(pid) = pid {
            nrun_node::process::disown(pid);
        }
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

/// Copies the running nrun to `~/.cache/nrun/nrun-<version>` on the host; returns that path.
pub async fn ship(ssh_opts: &[String], label: &str) -> Result<String> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::internal(format!("cannot find nrun's own executable: {e}")))?;
    let version = env!("CARGO_PKG_VERSION");
    let rev = nrun_base::GIT_REV;
    let path = format!("~/.cache/nrun/nrun-{version}-{rev}");
    // A per-copy temporary name: nodes that share a home directory must not race.
    let remote_cmd = format!(
        "mkdir -p ~/.cache/nrun && t={p}.tmp.$$ && cat > $t && chmod +x $t && mv -f $t {p}",
        p = path
    );
    let mut argv = remote::ssh_command(label, ssh_opts, "true");
    argv.pop();
    argv.push(remote_cmd.into());
    let bin = std::fs::File::open(&exe)
        .map_err(|e| Error::internal(format!("cannot read {}: {e}", exe.display())))?;
    let out = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        // A start abandoned (the job ended meanwhile) leaves no copy running.
        .kill_on_drop(true)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_reads_as_a_code_or_a_signal() {
        assert_eq!(how_it_ended(&ExitStatus::from_raw(255 << 8)), "exited 255");
        assert_eq!(
            how_it_ended(&ExitStatus::from_raw(9)),
            "was killed by SIGKILL"
        );
        assert!(own_line(
            "ssh: connect to host b7 port 22: Connection refused"
        ));
        assert!(own_line("nrun agent on b7 (b7): the launch host went away"));
        assert!(!own_line("[b7:rank3]: ssh: not ours"));
    }
}
