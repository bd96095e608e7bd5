//! Running one attempt of a node's worker group: spawn, supervise, stop, clean up.
//!
//! [`run_group`] is the dispatcher: it alone holds the group's state and `select!`s over worker
//! exits, stop requests from outside (a signal to nrun, another node's failure, a lost coordinator)
//! and the SIGKILL deadline. The first worker to fail (or a stop request) stops the group: every
//! process group gets SIGTERM (or the signal nrun received), and SIGKILL after the grace period; a
//! second signal kills at once. Signals themselves are caught by whoever drives the node (the
//! session, or an agent) and arrive here as [`StopRequest`]s. When every worker has exited,
//! leftovers are swept (process groups, then re-parented orphans) before the outcome is returned,
//! so nothing outlives the attempt.

pub mod keeper;
pub mod output;
pub mod process;

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{Error, Result};
use output::{Output, Stream, Tail, WorkerOutput};
use process::ProcessGroup;

/// One worker to start.
pub struct WorkerCmd {
    pub rank: usize,
    pub local_rank: usize,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    pub error_file: PathBuf,
    pub output: WorkerOutput,
    /// Reads nrun's stdin (in the terminal's foreground when stdin is one).
    pub stdin: bool,
    /// CPUs to bind the worker to (--numa-binding).
    pub cpus: Option<Vec<usize>>,
}

/// What happens to a group's workers, for whoever watches them (the stack sampler).
#[derive(Clone, Debug)]
pub enum GroupEvent {
    Started { rank: usize, pid: u32 },
    Exited { rank: usize, exit: Exit },
}

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    fn from_status(s: ExitStatus) -> Exit {
        match (s.code(), s.signal()) {
            (Some(c), _) => Exit::Code(c),
            (None, Some(sig)) => Exit::Signal(sig),
            (None, None) => Exit::Code(1),
        }
    }

    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    /// The exit code nrun passes on: the code itself, or 128+N for signal N.
    pub fn exit_code(self) -> u8 {
        match self {
            Exit::Code(c) => c.clamp(0, 255) as u8,
            Exit::Signal(s) => crate::error::exit::signal(s),
        }
    }

    pub fn describe(self) -> String {
        match self {
            Exit::Code(c) => format!("exited with code {c}"),
            Exit::Signal(s) => format!("was killed by {}", signal_name(s)),
        }
    }
}

pub fn signal_name(sig: i32) -> String {
    Signal::try_from(sig).map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_string())
}

/// The first worker failure of an attempt, with what the summary shows.
#[derive(Debug)]
pub struct Failure {
    pub rank: usize,
    pub local_rank: usize,
    pub pid: u32,
    pub exit: Exit,
    pub at: SystemTime,
    pub stderr_tail: Vec<String>,
    pub error_file: PathBuf,
    /// Workers that exited 0 shortly before this failure (or within 2 s after it) while the
    /// others still ran (rank, seconds before; negative: after): a rank that left its loop
    /// early makes its peers fail.
    pub left_early: Vec<(usize, f64)>,
}

/// How long the rest of a group keeps running after its first failure before it is stopped.
const SETTLE: Duration = Duration::from_millis(300);

/// How long before a failure a clean exit counts as a cause rather than a finished rank.
const EARLY: Duration = Duration::from_secs(30);
/// ... and how long after it.
const AROUND: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub enum Outcome {
    Success,
    Failed(Failure),
    /// nrun itself received this signal and stopped the workers.
    Interrupted(i32),
    /// The group's deadline passed; the workers were stopped.
    TimedOut,
    /// Stopped from outside (the coordinator, or a lost coordinator), not by a failure here.
    Stopped,
}

/// A request from outside the group to stop it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopRequest {
    /// Keep running.
    None,
    /// The user sent nrun this signal: forward it, SIGKILL after the grace period.
    Signal(i32),
    /// The user sent this signal again: SIGKILL now.
    Kill(i32),
    /// Another node failed: SIGTERM, SIGKILL after the grace period.
    Polite,
    /// The coordinator is gone (ssh dropped, launcher killed): SIGTERM, SIGKILL within 2 s.
    Abandon,
    /// Not a stop: pass this signal to every worker's process group and go on.
    Forward(i32),
}

/// Resolves with the next request other than [`StopRequest::None`]; a sender that went away
/// without asking reads as the coordinator being gone.
async fn stop_requested(rx: &mut tokio::sync::watch::Receiver<StopRequest>) -> StopRequest {
    loop {
        if rx.changed().await.is_err() {
            return StopRequest::Abandon;
        }
        let v = *rx.borrow_and_update();
        if v != StopRequest::None {
            return v;
        }
    }
}

/// SIGINT, SIGTERM and SIGHUP to nrun, which stop the job, and the signals to pass on to the
/// workers (`--signals-to-handle`), as one stream. Installed once, before any worker starts, so
/// a signal arriving during start-up is not lost. Whoever drives a node turns them into
/// [`StopRequest`]s.
pub struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    forward: Vec<(i32, tokio::signal::unix::Signal)>,
    /// Signals a test sends without signalling the test process.
    injected: Option<tokio::sync::mpsc::UnboundedReceiver<Caught>>,
}

/// A signal nrun caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caught {
    /// Stops the job.
    Stop(i32),
    /// Passed on to every worker; the job goes on.
    Forward(i32),
}

impl Signals {
    pub fn install(forward: &[i32]) -> Result<Signals> {
        let s = |k: SignalKind| {
            signal(k).map_err(|e| Error::internal(format!("cannot install signal handlers: {e}")))
        };
        let mut me = Signals {
            int: s(SignalKind::interrupt())?,
            term: s(SignalKind::terminate())?,
            hup: s(SignalKind::hangup())?,
            forward: Vec::new(),
            injected: None,
        };
        me.also_forward(forward)?;
        Ok(me)
    }

    /// Catches these signals too, to pass them on.
    pub fn also_forward(&mut self, forward: &[i32]) -> Result<()> {
        for &sig in forward {
            if self.forward.iter().any(|(s, _)| *s == sig) {
                continue;
            }
            let st = signal(SignalKind::from_raw(sig)).map_err(|e| {
                Error::internal(format!(
                    "cannot catch {} to pass it on: {e}",
                    signal_name(sig)
                ))
            })?;
            self.forward.push((sig, st));
        }
        Ok(())
    }

    /// Signals as a test sends them on the returned channel.
    #[cfg(test)]
    pub(crate) fn injected() -> (Signals, tokio::sync::mpsc::UnboundedSender<Caught>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut me = Signals::install(&[]).expect("signal handlers");
        me.injected = Some(rx);
        (me, tx)
    }

    pub async fn recv(&mut self) -> Caught {
        std::future::poll_fn(|cx| {
            use std::task::Poll;
            if let Some(Poll::Ready(Some(c))) = self.injected.as_mut().map(|r| r.poll_recv(cx)) {
                return Poll::Ready(c);
            }
            for (sig, st) in [
                (libc::SIGINT, &mut self.int),
                (libc::SIGTERM, &mut self.term),
                (libc::SIGHUP, &mut self.hup),
            ] {
                if let Poll::Ready(Some(())) = st.poll_recv(cx) {
                    return Poll::Ready(Caught::Stop(sig));
                }
            }
            for (sig, st) in &mut self.forward {
                if let Poll::Ready(Some(())) = st.poll_recv(cx) {
                    return Poll::Ready(Caught::Forward(*sig));
                }
            }
            Poll::Pending
        })
        .await
    }

    /// The next stop signal; signals to pass on that arrive meanwhile have no one to reach.
    pub async fn stop(&mut self) -> i32 {
        loop {
            if let Caught::Stop(sig) = self.recv().await {
                return sig;
            }
        }
    }
}

/// nrun's terminal, when stdin is one and nrun is in its foreground (not started with `&`).
struct Terminal;

impl Terminal {
    fn ours() -> bool {
        use std::io::IsTerminal;
        // SAFETY: plain queries of this process's own state.
        std::io::stdin().is_terminal()
            && unsafe { libc::tcgetpgrp(libc::STDIN_FILENO) == libc::getpgrp() }
    }

    /// Makes nrun's group the terminal's foreground again, after a worker had it.
    fn take_back() {
        // SAFETY: SIGTTOU ignored around tcsetpgrp, as a background group must to ask for the
        // foreground; the old disposition is put back.
        unsafe {
            let old = libc::signal(libc::SIGTTOU, libc::SIG_IGN);
            libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpgrp());
            libc::signal(libc::SIGTTOU, old);
        }
    }
}

struct Running {
    rank: usize,
    local_rank: usize,
    pid: u32,
    group: ProcessGroup,
    exit: Option<(Exit, SystemTime)>,
    tail: Tail,
    error_file: PathBuf,
}

/// Runs one attempt of the worker group to its end. `grace` is the time between the polite
/// signal and SIGKILL; past `deadline` (if any) the group is stopped as if it had failed.
pub async fn run_group(
    workers: Vec<WorkerCmd>,
    grace: Duration,
    deadline: Option<Instant>,
    mut stop: tokio::sync::watch::Receiver<StopRequest>,
    events: Option<mpsc::UnboundedSender<GroupEvent>>,
) -> Result<Outcome> {
    let tell = |e: GroupEvent| {
        if let Some(tx) = &events {
            let _ = tx.send(e);
        }
    };
    let mut outputs = Vec::with_capacity(workers.len());
    let mut cmds = Vec::with_capacity(workers.len());
    for w in workers {
        let WorkerCmd { output, .. } = w;
        outputs.push(output);
        cmds.push((
            w.rank,
            w.local_rank,
            w.program,
            w.args,
            w.env,
            w.error_file,
            w.stdin,
            w.cpus,
        ));
    }
    let terminal = Terminal::ours();
    let mut gave_terminal = false;
    // The worker holding the terminal's foreground: the terminal's Ctrl-C reaches it alone.
    let mut foreground_idx: Option<usize> = None;
    let out = Output::start(outputs);
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<(usize, Exit, SystemTime)>();
    let mut running: Vec<Running> = Vec::with_capacity(cmds.len());
    let mut pumps: Vec<JoinHandle<()>> = Vec::new();
    let mut spawn_error = None;

    for (idx, (rank, local_rank, program, args, env, error_file, stdin, cpus)) in
        cmds.into_iter().enumerate()
    {
        let _ = std::fs::remove_file(&error_file);
        let mut cmd = tokio::process::Command::new(&program);
        // Workers are in background process groups: a worker reading the terminal would be
        // stopped by SIGTTIN and hang the job, so only the one chosen gets nrun's stdin, and the
        // terminal's foreground with it.
        let foreground = stdin && terminal;
        gave_terminal |= foreground;
        if foreground {
            foreground_idx = Some(idx);
        }
        cmd.args(&args)
            .envs(env)
            .process_group(0)
            .stdin(if stdin {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let parent = std::process::id() as libc::pid_t;
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for c in cpus.iter().flatten() {
            // SAFETY: CPU_SET on a zeroed set; indexes past CPU_SETSIZE are ignored by the libc.
            unsafe { libc::CPU_SET(*c, &mut set) };
        }
        let bind = cpus.is_some();
        // SAFETY: only async-signal-safe calls (prctl, getppid, setpgid, signal, tcsetpgrp,
        // sched_setaffinity, _exit) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // If nrun is killed outright (SIGKILL), its workers die with it. Spawning happens
                // on the main thread, whose exit is the process's exit (see prctl(2) on threads).
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                if foreground {
                    // Its own group first (as process_group(0) makes it), then the terminal's
                    // foreground, asked for with SIGTTOU ignored as a background group must.
                    libc::setpgid(0, 0);
                    libc::signal(libc::SIGTTOU, libc::SIG_IGN);
                    libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpid());
                    libc::signal(libc::SIGTTOU, libc::SIG_DFL);
                }
                if bind {
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
                }
                process::restore_fd_limit();
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                spawn_error = Some(Error::usage(format!(
                    "cannot start rank {rank}: {} {}: {e}",
                    program.to_string_lossy(),
                    args.iter()
                        .map(|a| a.to_string_lossy())
                        .collect::<Vec<_>>()
                        .join(" ")
                )));
                break;
            }
        };
        let pid = child.id().unwrap_or(0);
        tell(GroupEvent::Started { rank, pid });
        let tail: Tail = Arc::new(Mutex::new(Default::default()));
        if let Some(o) = child.stdout.take() {
            pumps.push(tokio::spawn(output::pump(
                o,
                idx,
                Stream::Out,
                out.sender(),
                None,
            )));
        }
        if let Some(e) = child.stderr.take() {
            pumps.push(tokio::spawn(output::pump(
                e,
                idx,
                Stream::Err,
                out.sender(),
                Some(tail.clone()),
            )));
        }
        let tx = ev_tx.clone();
        tokio::spawn(async move {
            let exit = match child.wait().await {
                Ok(s) => Exit::from_status(s),
                Err(_) => Exit::Code(1),
            };
            let _ = tx.send((idx, exit, SystemTime::now()));
        });
        running.push(Running {
            rank,
            local_rank,
            pid,
            group: ProcessGroup(Pid::from_raw(pid as i32)),
            exit: None,
            tail,
            error_file,
        });
    }
    drop(ev_tx);

    let mut first_failure: Option<usize> = None;
    let mut interrupted: Option<i32> = None;
    let mut timed_out = false;
    let mut stopped = false;
    let mut closed = false;
    let mut kill_at: Option<Instant> = None;
    let mut term_at: Option<Instant> = None;
    let stop_all = |running: &[Running], sig: Signal| {
        for r in running.iter().filter(|r| r.exit.is_none()) {
            r.group.signal(sig);
        }
    };
    if spawn_error.is_some() {
        stop_all(&running, Signal::SIGKILL);
    }
    let mut left = running.len();
    while left > 0 {
        tokio::select! {
            ev = ev_rx.recv() => {
                let Some((idx, exit, at)) = ev else { break };
                running[idx].exit = Some((exit, at));
                tell(GroupEvent::Exited { rank: running[idx].rank, exit });
                left -= 1;
                // The terminal's Ctrl-C, which only the foreground worker got: the user's
                // interrupt, passed on to the rest as if nrun had received it. The terminal
                // comes back to nrun, so a second Ctrl-C reaches it.
                if Some(idx) == foreground_idx && exit == Exit::Signal(libc::SIGINT) && first_failure.is_none() && interrupted.is_none() {
                    Terminal::take_back();
                    foreground_idx = None;
                    stop_all(&running, Signal::SIGINT);
                    kill_at = Some(Instant::now() + grace);
                    interrupted = Some(libc::SIGINT);
                    continue;
                }
                if !exit.success() && first_failure.is_none() && interrupted.is_none() && kill_at.is_none() && term_at.is_none() && !timed_out && !stopped {
                    first_failure = Some(idx);
                    // A moment before stopping the rest: a peer already on its way out (a rank
                    // that left its loop early) ends by itself and can be named as the cause.
                    term_at = Some(Instant::now() + SETTLE.min(grace));
                }
            }
            req = stop_requested(&mut stop), if !closed => {
                match req {
                    StopRequest::None => {}
                    StopRequest::Forward(sig) => {
                        if let Ok(s) = Signal::try_from(sig) {
                            stop_all(&running, s);
                        }
                    }
                    StopRequest::Signal(sig) if kill_at.is_none() => {
                        let s = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
                        stop_all(&running, s);
                        kill_at = Some(Instant::now() + grace);
                        interrupted.get_or_insert(sig);
                    }
                    // A second signal, or a request to kill: no more waiting.
                    StopRequest::Signal(sig) | StopRequest::Kill(sig) => {
                        stop_all(&running, Signal::SIGKILL);
                        interrupted.get_or_insert(sig);
                    }
                    StopRequest::Polite | StopRequest::Abandon => {
                        stopped = true;
                        let fast = Instant::now() + grace.min(Duration::from_secs(2));
                        let by = if req == StopRequest::Abandon { fast } else { Instant::now() + grace };
                        stop_all(&running, Signal::SIGTERM);
                        kill_at = Some(kill_at.map_or(by, |k| k.min(by)));
                        // The sender is gone after Abandon; there is nothing more to hear.
                        closed = req == StopRequest::Abandon;
                    }
                }
            }
            _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)).await }, if deadline.is_some() && !timed_out && kill_at.is_none() => {
                timed_out = true;
                stop_all(&running, Signal::SIGTERM);
                kill_at = Some(Instant::now() + grace);
            }
            _ = async { tokio::time::sleep_until(term_at.unwrap_or_else(Instant::now)).await }, if term_at.is_some() => {
                term_at = None;
                if kill_at.is_none() {
                    stop_all(&running, Signal::SIGTERM);
                    kill_at = Some(Instant::now() + grace);
                }
            }
            _ = async { tokio::time::sleep_until(kill_at.unwrap_or_else(Instant::now)).await }, if kill_at.is_some() => {
                stop_all(&running, Signal::SIGKILL);
                kill_at = None;
                // A later exit must not be taken for a new first failure.
                interrupted.get_or_insert(0);
            }
        }
    }

    // Everything the workers left behind: first what stayed in their process groups, then what
    // escaped them and was re-parented to nrun.
    let mut leftovers = Vec::new();
    for r in &running {
        if r.group.alive() {
            r.group.signal(Signal::SIGKILL);
            leftovers.push(r.rank);
        }
    }
    let orphans = process::kill_orphans();
    if gave_terminal {
        Terminal::take_back();
    }
    for p in pumps {
        // A pipe still open means something we could not see holds it; do not hang on it.
        let _ = tokio::time::timeout(Duration::from_secs(2), p).await;
    }
    out.finish();
    if !leftovers.is_empty() || orphans > 0 {
        tracing::warn!(
            "workers left processes running after they exited (ranks {leftovers:?}, {orphans} outside \
             their process group); nrun killed them"
        );
    }
    if let Some(e) = spawn_error {
        return Err(e);
    }

    if let Some(idx) = first_failure {
        let r = &running[idx];
        let (exit, at) = r.exit.unwrap_or((Exit::Code(1), SystemTime::now()));
        let stderr_tail = r
            .tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        // A clean exit just after the failure counts too: the peers of a rank that leaves early
        // often fail while it is still tearing down.
        let left_early = running
            .iter()
            .filter(|o| o.rank != r.rank)
            .filter_map(|o| match o.exit {
                Some((Exit::Code(0), t)) => {
                    let before = match at.duration_since(t) {
                        Ok(d) => d.as_secs_f64(),
                        Err(e) if e.duration() <= AROUND => -e.duration().as_secs_f64(),
                        Err(_) => return None,
                    };
                    (before <= EARLY.as_secs_f64()).then_some((o.rank, before))
                }
                _ => None,
            })
            .collect();
        return Ok(Outcome::Failed(Failure {
            rank: r.rank,
            local_rank: r.local_rank,
            pid: r.pid,
            exit,
            at,
            stderr_tail,
            error_file: r.error_file.clone(),
            left_early,
        }));
    }
    match interrupted {
        Some(sig) if sig > 0 => Ok(Outcome::Interrupted(sig)),
        _ if timed_out => Ok(Outcome::TimedOut),
        _ if stopped => Ok(Outcome::Stopped),
        _ => Ok(Outcome::Success),
    }
}

/// The traceback a worker decorated with torch's `@record` wrote to TORCHELASTIC_ERROR_FILE:
/// `{"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}`, or a plain string
/// message from C++ code.
pub fn read_error_file(path: &Path) -> Option<String> {
    error_file_traceback(&std::fs::read_to_string(path).ok()?)
}

/// The traceback in an error file's text (see [`read_error_file`]).
pub fn error_file_traceback(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let m = v.get("message")?;
    if let Some(s) = m.as_str() {
        return Some(s.to_string());
    }
    let msg = m
        .get("message")
        .and_then(|x| x.as_str())
        .unwrap_or_default();
    let stack = m
        .get("extraInfo")
        .and_then(|e| e.get("py_callstack"))
        .and_then(|x| x.as_str())
        .unwrap_or_default();
    let out = if stack.is_empty() {
        msg.to_string()
    } else {
        stack.trim_end().to_string()
    };
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_file_formats() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("error.json");
        std::fs::write(
            &p,
            r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  x\nValueError: boom\n", "timestamp": "1"}}}"#,
        )
        .unwrap();
        let tb = read_error_file(&p).unwrap();
        assert!(
            tb.starts_with("Traceback") && tb.ends_with("ValueError: boom"),
            "{tb}"
        );
        std::fs::write(&p, r#"{"message": "c++ error"}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap(), "c++ error");
        std::fs::write(&p, "not json").unwrap();
        assert!(read_error_file(&p).is_none());
        assert!(read_error_file(&dir.path().join("missing")).is_none());
    }
}
