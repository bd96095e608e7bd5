//! Running one attempt of a node's worker group: spawn, supervise, stop, clean up.
//!
//! [`run_group`] is the dispatcher: it alone holds the group's state (a `Group`: its workers, the
//! phase of stopping them and why) and `select!`s over worker exits, stop requests from outside (a
//! signal to nrun, another node's failure, a lost coordinator), the group's deadline and the
//! phase's timer; `Group`'s methods say what each of those does. The first worker to fail (or a
//! stop request) stops the group: every process group gets SIGTERM (or the signal nrun
//! received), and SIGKILL after the grace period; a second signal kills at once. Signals themselves are caught by whoever drives the node (the
//! session, or an agent) and arrive here as [`StopRequest`]s. When every worker has exited,
//! leftovers are swept (process groups, then re-parented orphans) before the outcome is returned,
//! so nothing outlives the attempt.

pub mod keeper;
pub mod output;
pub mod process;
mod sender;
pub mod spawner;
mod vfork;

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use nrun_base::error::{Error, Result};
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
    /// Per stream: a terminal of this size instead of a pipe (see [`output::Tty`]).
    pub tty: [Option<output::Tty>; 2],
}

/// What happens to a group's workers, for whoever watches them (the stack sampler).
#[derive(Clone, Debug)]
pub enum GroupEvent {
    Started { rank: usize, pid: u32 },
    Exited { rank: usize, exit: Exit },
}

/// How a process ended (said in words by its `Display`, only where a person reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
            Exit::Signal(s) => nrun_base::error::exit::signal(s),
        }
    }

    /// The signal that ended it, if one did.
    pub fn signal(self) -> Option<i32> {
        match self {
            Exit::Code(_) => None,
            Exit::Signal(s) => Some(s),
        }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Exit::Code(c) => write!(f, "exited with code {c}"),
            Exit::Signal(s) => write!(f, "was killed by {}", signal_name(s)),
        }
    }
}

pub fn signal_name(sig: i32) -> String {
    match Signal::try_from(sig) {
        Ok(s) => s.as_str().to_string(),
        // One word, as kill -l says them, so the name reads (and parses) as the others do.
        Err(_) if (libc::SIGRTMIN()..=libc::SIGRTMAX()).contains(&sig) => {
            format!("SIGRTMIN+{}", sig - libc::SIGRTMIN())
        }
        Err(_) => format!("signal {sig}"),
    }
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
    /// What the group's output showed of its progress (`--progress-regex`).
    pub progress: Option<output::Progress>,
}

/// How long the rest of a group keeps running after its first failure before it is stopped.
const SETTLE: Duration = Duration::from_millis(300);

/// How long before a failure a clean exit counts as a cause rather than a finished rank.
const EARLY: Duration = Duration::from_secs(30);
/// ... and how long after it.
const AROUND: Duration = Duration::from_secs(2);

/// How long the workers' output pipes may stay open after the last worker exited (a worker's
/// last lines still in flight) before nrun stops reading them.
const PUMP_GRACE: Duration = Duration::from_secs(2);

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
    /// Not a stop: Slurm gave this signal to every process of the step, the workers included
    /// (see [`Caught::Delivered`]); nothing to pass on, but a copy by another path soon after
    /// is this one.
    Delivered(i32),
}

impl StopRequest {
    /// Whether it stops the group (a forwarded signal does not).
    pub fn stops(self) -> bool {
        !matches!(
            self,
            StopRequest::None | StopRequest::Forward(_) | StopRequest::Delivered(_)
        )
    }
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

/// What the workers get when nrun is stopped by `sig`: the same signal, but SIGTERM for
/// SIGPIPE (nrun's console closed): Python ignores SIGPIPE, and a worker would see it only
/// when it wrote, so the job would not end.
pub(crate) fn worker_stop_signal(sig: i32) -> Signal {
    match Signal::try_from(sig) {
        Ok(Signal::SIGPIPE) | Err(_) => Signal::SIGTERM,
        Ok(s) => s,
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
    /// The console's pipe closed ([`Signals::stop_on_closed_console`]).
    console: Option<tokio::sync::mpsc::UnboundedReceiver<Caught>>,
}

/// A signal nrun caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caught {
    /// Stops the job.
    Stop(i32),
    /// Passed on to every worker; the job goes on.
    Forward(i32),
    /// A signal to pass on that Slurm sent to every process of the srun step nrun is a task of
    /// (`scancel -s`, srun passing on a signal): every node's workers have it already, so no one
    /// passes it on again; the job goes on.
    Delivered(i32),
}

impl Signals {
    pub fn install(forward: &[i32]) -> Result<Signals> {
        let s = |k: SignalKind| {
            signal(k).map_err(|e| Error::internal(format!("cannot install signal handlers: {e}")))
        };
        // From here a stop signal no longer ends nrun by itself: a write waiting for a
        // FIFO's reader must see it (nrun_base::outputs).
        nrun_base::outputs::watch_stops();
        let mut me = Signals {
            int: s(SignalKind::interrupt())?,
            term: s(SignalKind::terminate())?,
            hup: s(SignalKind::hangup())?,
            forward: Vec::new(),
            injected: None,
            console: None,
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
            sender::watch(sig);
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

    /// A console pipe of this process found closed while writing the workers' output (the
    /// reader of `nrun ... | head` exited) reads as SIGPIPE to nrun: a stop (exit 141),
    /// the workers get SIGTERM (see [`worker_stop_signal`]). For the processes a user started
    /// (the launcher, a c10d node), not an agent.
    pub fn stop_on_closed_console(&mut self) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        output::on_console_closed(tx);
        self.console = Some(rx);
    }

    /// Signals as a caller sends them on the returned channel, besides the real ones: how a
    /// test (the fake link's) plays a Ctrl-C without signalling itself.
    pub fn injected() -> (Signals, tokio::sync::mpsc::UnboundedSender<Caught>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut me = Signals::install(&[]).expect("signal handlers");
        me.injected = Some(rx);
        (me, tx)
    }

    pub async fn recv(&mut self) -> Caught {
        std::future::poll_fn(|cx| {
            use std::task::Poll;
            for r in [&mut self.injected, &mut self.console]
                .into_iter()
                .flatten()
            {
                if let Poll::Ready(Some(c)) = r.poll_recv(cx) {
                    return Poll::Ready(c);
                }
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
                    return Poll::Ready(match sender::from_step(*sig) {
                        true => Caught::Delivered(*sig),
                        false => Caught::Forward(*sig),
                    });
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

/// A worker's command, less its output settings (those go to the one writer, [`Output`]).
struct Start {
    rank: usize,
    local_rank: usize,
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(String, String)>,
    error_file: PathBuf,
    stdin: bool,
    cpus: Option<Vec<usize>>,
    tty: [Option<output::Tty>; 2],
}

impl Start {
    fn split(w: WorkerCmd) -> (Start, WorkerOutput) {
        let WorkerCmd {
            rank,
            local_rank,
            program,
            args,
            env,
            error_file,
            output,
            stdin,
            cpus,
            tty,
        } = w;
        let start = Start {
            rank,
            local_rank,
            program,
            args,
            env,
            error_file,
            stdin,
            cpus,
            tty,
        };
        (start, output)
    }

    /// Starts the worker as the leader of its own session and process group; with `foreground`,
    /// its own group in nrun's session, and the terminal's foreground (it reads nrun's stdin).
    /// `base` is nrun's environment, read once for the group. Called on the thread whose end is
    /// the process's end: the worker's parent-death signal is tied to it.
    fn spawn(
        &self,
        base: &BTreeMap<OsString, OsString>,
        foreground: bool,
    ) -> Result<vfork::Spawned> {
        let _ = std::fs::remove_file(&self.error_file);
        let mut env = base.clone();
        env.extend(
            self.env
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        );
        // nrun's environment (a c10d node's, a static launch's) may hold the shared secret:
        // workers never inherit it.
        env.remove(OsStr::new(nrun_store::auth::SHARED_SECRET_VAR));
        let command = || {
            std::iter::once(&self.program)
                .chain(&self.args)
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" ")
        };
        // The launch host checked the program on its PATH; this host's may differ.
        let search = env.get(OsStr::new("PATH")).and_then(|p| p.to_str());
        let Some(path) = find_program(&self.program.to_string_lossy(), search) else {
            return Err(Error::usage(format!(
                "cannot start rank {}: {}: no executable of that name on this host's PATH ({}); \
                 install it here, or give its full path",
                self.rank,
                command(),
                search.unwrap_or("unset")
            )));
        };
        vfork::spawn(&vfork::Spec {
            path: &path,
            program: &self.program,
            args: &self.args,
            env: &env,
            stdin: self.stdin,
            foreground,
            cpus: self.cpus.as_deref(),
            tty: self.tty,
        })
        .map_err(|e| {
            // The file is there (it was just found): exec found no interpreter for it.
            let check = if e.kind() == std::io::ErrorKind::NotFound {
                format!(
                    "{} is there, so its interpreter is not: check its #! line, or the ELF \
                     loader it was linked against (`file` names it)",
                    path.display()
                )
            } else {
                format!(
                    "check that {} is executable and built for this machine",
                    path.display()
                )
            };
            Error::usage(format!(
                "cannot start rank {}: {}: {e} ({check})",
                self.rank,
                command()
            ))
        })
    }
}

/// Most workers of a group that get terminals of their own: each takes two of the host's ptys
/// (stdout, stderr), which every login and terminal on the host shares (kernel.pty.max, 4,096
/// by default). The others write into pipes: the same output, only `isatty` tells.
const TERMINAL_WORKERS: usize = 64;

/// Ptys left for the host's own use (logins, other jobs) when workers take theirs.
const PTYS_KEPT: usize = 256;

/// The host's ptys not in use now, from /proc (unbounded where it cannot be read).
fn free_ptys() -> usize {
    let read = |f: &str| {
        std::fs::read_to_string(format!("/proc/sys/kernel/pty/{f}"))
            .ok()?
            .trim()
            .parse::<usize>()
            .ok()
    };
    match (read("max"), read("nr")) {
        (Some(max), Some(nr)) => max.saturating_sub(nr),
        _ => usize::MAX,
    }
}

/// Gives terminals to the first workers that asked for one, at most [`TERMINAL_WORKERS`] and
/// as many as `free` ptys allow (keeping [`PTYS_KEPT`]); the others get pipes, said once.
fn bound_terminals(starts: &mut [Start], free: usize) {
    let wanting = starts
        .iter()
        .filter(|s| s.tty.iter().any(Option::is_some))
        .count();
    let room = TERMINAL_WORKERS.min(free.saturating_sub(PTYS_KEPT) / 2);
    if wanting <= room {
        return;
    }
    starts
        .iter_mut()
        .filter(|s| s.tty.iter().any(Option::is_some))
        .skip(room)
        .for_each(|s| s.tty = [None, None]);
    tracing::info!(
        "{wanting} workers on this host write to the terminal: the first {room} see terminals \
         of their own, the other {} pipes (each terminal takes 2 of the host's ptys, {free} \
         free; at most {TERMINAL_WORKERS} are given, {PTYS_KEPT} kept for the host); their \
         output is the same",
        wanting - room
    );
}

/// One started worker: running until its exit is reported.
struct Worker {
    rank: usize,
    local_rank: usize,
    pid: u32,
    group: ProcessGroup,
    exit: Option<(Exit, SystemTime)>,
    tail: Tail,
    error_file: PathBuf,
    /// Its terminals' master sides (copies; the pumps read the originals), with the rank
    /// prefix their width is less: resized as nrun's terminal is ([`Group::follow_console`]).
    ptys: Option<(String, Vec<(Stream, std::os::fd::OwnedFd)>)>,
}

impl Worker {
    /// Supervises a started worker: its pipes go to the writer (the tail of stderr kept), and
    /// its exit is reported on `exits` as its index in the group.
    fn watch(
        idx: usize,
        start: Start,
        child: vfork::Spawned,
        (out, prefix): (&Output, String),
        pumps: &mut Vec<(usize, JoinHandle<()>)>,
        exits: &mpsc::UnboundedSender<(usize, Exit, SystemTime)>,
    ) -> Worker {
        let pid = child.pid as u32;
        let tail: Tail = Arc::new(Mutex::new(Default::default()));
        let mut masters = Vec::new();
        // A pipe tokio cannot take (never seen: pipe2 made them) loses that stream's output, not
        // the worker.
        for ((fd, tty), stream, name, tail) in [
            (child.stdout, Stream::Out, "stdout", None),
            (child.stderr, Stream::Err, "stderr", Some(tail.clone())),
        ] {
            // A copy of a terminal's master side, to resize it; none where the copy fails
            // (out of descriptors): the worker keeps its first size.
            if let (true, Ok(m)) = (tty, fd.try_clone()) {
                masters.push((stream, m));
            }
            let read = match tty {
                // A terminal's master side (non-blocking already): read as a pipe is; its end
                // reads as EIO, which the pump takes for the end.
                true => tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(fd),
                false => tokio::net::unix::pipe::Receiver::from_owned_fd(fd),
            };
            match read {
                Ok(r) => pumps.push((
                    idx,
                    tokio::spawn(output::pump(r, idx, stream, out.sender(), tail)),
                )),
                Err(e) => {
                    tracing::warn!("rank {}: cannot read its {name}: {e}", start.rank)
                }
            }
        }
        let tx = exits.clone();
        tokio::spawn(async move {
            let exit = match vfork::wait(child.pid).await {
                Ok(s) => Exit::from_status(s),
                Err(_) => Exit::Code(1),
            };
            let _ = tx.send((idx, exit, SystemTime::now()));
        });
        Worker {
            rank: start.rank,
            local_rank: start.local_rank,
            pid,
            group: ProcessGroup(Pid::from_raw(pid as i32)),
            exit: None,
            tail,
            error_file: start.error_file,
            ptys: (!masters.is_empty()).then_some((prefix, masters)),
        }
    }

    fn running(&self) -> bool {
        self.exit.is_none()
    }

    /// Whether its last words say it failed because of a peer (see [`failed_by_peer`]).
    fn failed_by_peer(&self) -> bool {
        let tail = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        failed_by_peer(tail.iter().map(String::as_str))
    }
}

/// What a worker that failed because of a peer says last: the connection to the peer closed
/// under a collective, or the collective timed out waiting for it (gloo, NCCL's watchdog,
/// torch's store). Lowercase.
const PEER_SIGNS: [&str; 8] = [
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "collective operation timeout",
    "remote process exited",
    "communicator was aborted",
    "distnetworkerror",
];

/// Whether a failed worker's last words (its stderr's tail, its traceback) show that it failed
/// because of a peer rather than of its own accord: an exception of the program, an exit code
/// without such words, or a signal is the rank's own failure.
pub fn failed_by_peer<'a>(lines: impl IntoIterator<Item = &'a str>) -> bool {
    lines.into_iter().any(|l| {
        let l = l.to_lowercase();
        PEER_SIGNS.iter().any(|s| l.contains(s))
    })
}

/// Where the group is in being stopped: Running, Settling, Grace, Killed, in that order, except
/// that a stop request or the deadline coming after SIGKILL signals again and starts another
/// grace period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing has asked the group to stop.
    Running,
    /// A worker failed: the rest get until then to end by themselves (see [`SETTLE`]), then
    /// SIGTERM.
    Settling(Instant),
    /// The polite signal went out: SIGKILL then.
    Grace(Instant),
    /// SIGKILL went out.
    Killed,
}

/// Why the group is ending; several can pile up, and [`Group::outcome`] says which one wins.
#[derive(Default)]
struct Ending {
    /// The first worker to fail while nothing was stopping the group.
    failure: Option<usize>,
    /// Every worker that failed before nrun stopped anyone (the first, and those that failed
    /// by themselves while the group settled), in order.
    failed: Vec<usize>,
    /// The signal that stopped the group; `Some(0)` once SIGKILL ended a grace period that no
    /// signal started, so a signal after that is not taken for the cause.
    interrupted: Option<i32>,
    timed_out: bool,
    /// Stopped from outside (a polite stop, the coordinator gone).
    stopped: bool,
}

/// The state [`run_group`] alone holds: the workers, how far stopping them has got and why.
struct Group {
    workers: Vec<Worker>,
    /// Workers whose exit is not yet reported: counted, not looked up, as it is asked after
    /// every exit (thousands of them).
    running: usize,
    grace: Duration,
    phase: Phase,
    ending: Ending,
    /// The worker holding the terminal's foreground: the terminal's Ctrl-C reaches it alone.
    foreground: Option<usize>,
    /// The signal last passed on, and when.
    passed_on: Option<(i32, Instant)>,
    /// When the polite signal went out (the grace period began), which it was, and whether the
    /// wait for the workers to end was said (once it took [`GRACE_SAID`]).
    grace_from: Option<(Instant, Signal)>,
    grace_said: bool,
    /// The terminal's sizes (stdout's, stderr's) the workers' terminals last followed; None
    /// before the first look.
    console: Option<[Option<output::Tty>; 2]>,
}

/// A grace period longer than this is not waited through silently.
const GRACE_SAID: Duration = Duration::from_secs(5);

impl Group {
    fn new(grace: Duration) -> Group {
        Group {
            workers: Vec::new(),
            running: 0,
            grace,
            phase: Phase::Running,
            ending: Ending::default(),
            foreground: None,
            passed_on: None,
            grace_from: None,
            grace_said: false,
            console: None,
        }
    }

    /// The terminal the workers' follow (nrun's, or the launcher's as told to an agent) may
    /// have been resized: each running worker's terminals that are not its size less the
    /// worker's prefix are made so, and its process group gets SIGWINCH, as a program at the
    /// terminal itself would (theirs are no one's controlling terminal, so the kernel sends
    /// none). A worker started at the size already is left alone.
    fn follow_console(&mut self, now: [Option<output::Tty>; 2]) {
        if self.console == Some(now) {
            return;
        }
        self.console = Some(now);
        for w in self.workers.iter().filter(|w| w.running()) {
            let Some((prefix, masters)) = &w.ptys else {
                continue;
            };
            let mut resized = false;
            for (stream, m) in masters {
                let Some(want) = now[*stream as usize].map(|t| t.less(prefix)) else {
                    continue;
                };
                if output::Tty::of(m) != Some(want) {
                    resized |= want.set(m).is_ok();
                }
            }
            if resized {
                w.group.signal(Signal::SIGWINCH);
            }
        }
    }

    /// The grace period after `sig` runs until `until` (SIGKILL then); its start is kept for
    /// the note.
    fn grace_until(&mut self, sig: Signal, until: Instant) {
        if !matches!(self.phase, Phase::Grace(_)) {
            self.grace_from = Some((Instant::now(), sig));
        }
        self.phase = Phase::Grace(until);
    }

    /// When to say that the grace period is being waited through (None: said, or none).
    fn grace_note(&self) -> Option<Instant> {
        match (self.phase, self.grace_from, self.grace_said) {
            (Phase::Grace(k), Some((from, _)), false) if k > from + GRACE_SAID => {
                Some(from + GRACE_SAID)
            }
            _ => None,
        }
    }

    /// Says which workers are still running after the polite signal, and until when nrun
    /// waits for them.
    fn say_grace(&mut self) {
        self.grace_said = true;
        let (Phase::Grace(kill_at), Some((_, sig))) = (self.phase, self.grace_from) else {
            return;
        };
        let ranks: Vec<String> = self
            .workers
            .iter()
            .filter(|w| w.running())
            .map(|w| w.rank.to_string())
            .collect();
        tracing::warn!(
            "on {}: rank(s) {} still running {} s after {}; nrun waits up to {} s more \
             (--shutdown-timeout), then sends SIGKILL (a worker that handles {3} and does not \
             exit holds up the job's end: check its signal handler; Ctrl-C to nrun on the launch \
             host kills at once)",
            nrun_base::net::hostname(),
            nrun_base::few(&ranks, 8),
            GRACE_SAID.as_secs(),
            sig.as_str(),
            kill_at.saturating_duration_since(Instant::now()).as_secs()
        );
    }

    /// Whether to pass `sig` on now. One signal can reach a node's agent by several paths (the
    /// launcher's forward through the store, and the agent's own catch when Slurm signals every
    /// process of its step, which the workers got too: [`StopRequest::Delivered`]): the same
    /// signal within [`ONE_SIGNAL`] is passed on once, or a worker that handled it and is
    /// exiting would be killed by the copy.
    fn pass_on(&mut self, sig: i32) -> bool {
        let now = Instant::now();
        let again = self
            .passed_on
            .is_some_and(|(s, at)| s == sig && now.duration_since(at) < ONE_SIGNAL);
        if !again {
            self.passed_on = Some((sig, now));
        }
        !again
    }

    fn running(&self) -> usize {
        self.running
    }

    fn add(&mut self, w: Worker) {
        self.running += usize::from(w.running());
        self.workers.push(w);
    }

    /// `sig` to the process group of every worker not yet exited.
    fn signal(&self, sig: Signal) {
        for w in self.workers.iter().filter(|w| w.running()) {
            w.group.signal(sig);
        }
    }

    /// `sig` now, SIGKILL after the grace period.
    fn terminate(&mut self, sig: Signal) {
        self.signal(sig);
        self.grace_until(sig, Instant::now() + self.grace);
    }

    fn kill(&mut self) {
        self.signal(Signal::SIGKILL);
        self.phase = Phase::Killed;
    }

    /// Worker `idx` exited.
    fn exited(&mut self, idx: usize, exit: Exit, at: SystemTime) {
        if self.workers[idx].exit.replace((exit, at)).is_none() {
            self.running -= 1;
        }
        // The terminal's Ctrl-C, which only the foreground worker got: the user's interrupt,
        // passed on to the rest as if nrun had received it. The terminal comes back to nrun, so
        // a second Ctrl-C reaches it.
        if Some(idx) == self.foreground
            && exit == Exit::Signal(libc::SIGINT)
            && self.ending.failure.is_none()
            && self.ending.interrupted.is_none()
        {
            Terminal::take_back();
            self.foreground = None;
            self.terminate(Signal::SIGINT);
            self.ending.interrupted = Some(libc::SIGINT);
            return;
        }
        // Once anything is stopping the group, a worker failing is its consequence, not a
        // cause.
        if !exit.success() && matches!(self.phase, Phase::Running | Phase::Settling(_)) {
            self.ending.failed.push(idx);
        }
        if !exit.success() && self.phase == Phase::Running {
            self.ending.failure = Some(idx);
            // A moment before stopping the rest: a peer already on its way out (a rank that
            // left its loop early) ends by itself and can be named as the cause.
            self.phase = Phase::Settling(Instant::now() + SETTLE.min(self.grace));
        }
    }

    /// A request from outside the group.
    fn requested(&mut self, req: StopRequest) {
        match req {
            StopRequest::None => {}
            StopRequest::Forward(sig) => {
                if let (Ok(s), true) = (Signal::try_from(sig), self.pass_on(sig)) {
                    self.signal(s);
                }
            }
            StopRequest::Delivered(sig) => {
                self.pass_on(sig);
            }
            StopRequest::Signal(sig) if !matches!(self.phase, Phase::Grace(_)) => {
                self.terminate(worker_stop_signal(sig));
                self.ending.interrupted.get_or_insert(sig);
            }
            // A second signal, or a request to kill: no more waiting.
            StopRequest::Signal(sig) | StopRequest::Kill(sig) => {
                self.kill();
                self.ending.interrupted.get_or_insert(sig);
            }
            StopRequest::Polite | StopRequest::Abandon => {
                self.ending.stopped = true;
                let grace = match req {
                    StopRequest::Abandon => self.grace.min(ABANDON_GRACE),
                    _ => self.grace,
                };
                let by = Instant::now() + grace;
                self.signal(Signal::SIGTERM);
                // A SIGKILL already due sooner stays due.
                match self.phase {
                    Phase::Grace(k) => self.grace_until(Signal::SIGTERM, k.min(by)),
                    _ => self.grace_until(Signal::SIGTERM, by),
                }
            }
        }
    }

    /// Whether the group's deadline may still stop it: once, and not during a grace period.
    fn may_time_out(&self) -> bool {
        !self.ending.timed_out && !matches!(self.phase, Phase::Grace(_))
    }

    fn timed_out(&mut self) {
        self.ending.timed_out = true;
        self.terminate(Signal::SIGTERM);
    }

    /// When the phase moves on by itself (the settling time or the grace period ends).
    fn timer(&self) -> Option<Instant> {
        match self.phase {
            Phase::Settling(t) | Phase::Grace(t) => Some(t),
            Phase::Running | Phase::Killed => None,
        }
    }

    fn timer_passed(&mut self) {
        match self.phase {
            Phase::Settling(_) => self.terminate(Signal::SIGTERM),
            Phase::Grace(_) => {
                self.kill();
                // A later signal is not the cause: whatever started the grace period is.
                self.ending.interrupted.get_or_insert(0);
            }
            Phase::Running | Phase::Killed => {}
        }
    }

    /// Ranks whose process group still has processes (after every worker exited), killed.
    fn kill_leftovers(&self) -> Vec<usize> {
        let mut leftovers = Vec::new();
        for w in &self.workers {
            if w.group.alive() {
                w.group.signal(Signal::SIGKILL);
                leftovers.push(w.rank);
            }
        }
        leftovers
    }

    /// A failure wins over a signal, a signal over the deadline, the deadline over a stop from
    /// outside.
    fn outcome(self) -> Outcome {
        if let Some(first) = self.ending.failure {
            // By evidence, then time: a worker that failed of its own accord (an exception of
            // the program, an exit code, a signal) while the group settled is the cause of the
            // peers that failed because of it (a connection closed, a collective timed out).
            let idx = self
                .ending
                .failed
                .iter()
                .copied()
                .find(|&i| !self.workers[i].failed_by_peer())
                .unwrap_or(first);
            return Outcome::Failed(self.failure(idx));
        }
        match self.ending.interrupted {
            Some(sig) if sig > 0 => Outcome::Interrupted(sig),
            _ if self.ending.timed_out => Outcome::TimedOut,
            _ if self.ending.stopped => Outcome::Stopped,
            _ => Outcome::Success,
        }
    }

    fn failure(&self, idx: usize) -> Failure {
        let w = &self.workers[idx];
        let (exit, at) = w.exit.unwrap_or((Exit::Code(1), SystemTime::now()));
        let stderr_tail = w
            .tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        // A clean exit is a cause only where every failure shows a peer's doing: a rank that
        // failed of its own accord (raised, exited nonzero, died of a signal) is the cause
        // itself, and a peer exiting 0 near it merely finished.
        let own = self
            .ending
            .failed
            .iter()
            .any(|&i| !self.workers[i].failed_by_peer());
        let left_early = match own {
            true => Vec::new(),
            false => self.clean_exits_near(w.rank, at),
        };
        Failure {
            rank: w.rank,
            local_rank: w.local_rank,
            pid: w.pid,
            exit,
            at,
            stderr_tail,
            error_file: w.error_file.clone(),
            left_early,
            progress: None,
        }
    }

    /// The workers other than `rank` that exited 0 shortly before `at` (or just after: the
    /// peers of a rank that leaves early often fail while it is still tearing down), with how
    /// long before (negative: after).
    fn clean_exits_near(&self, rank: usize, at: SystemTime) -> Vec<(usize, f64)> {
        self.workers
            .iter()
            .filter(|o| o.rank != rank)
            .filter_map(|o| {
                let Some((Exit::Code(0), t)) = o.exit else {
                    return None;
                };
                let before = match at.duration_since(t) {
                    Ok(d) => d.as_secs_f64(),
                    Err(e) if e.duration() <= AROUND => -e.duration().as_secs_f64(),
                    Err(_) => return None,
                };
                (before <= EARLY.as_secs_f64()).then_some((o.rank, before))
            })
            .collect()
    }
}

/// How soon SIGKILL follows SIGTERM at most once the coordinator is gone.
const ABANDON_GRACE: Duration = Duration::from_secs(2);

/// Copies of one signal to pass on arrive within this of each other.
const ONE_SIGNAL: Duration = Duration::from_secs(1);

/// The next request on `stop`, or never once it is gone (`None`).
async fn next_request(stop: &mut Option<tokio::sync::watch::Receiver<StopRequest>>) -> StopRequest {
    match stop {
        Some(rx) => stop_requested(rx).await,
        None => std::future::pending().await,
    }
}

/// Runs one attempt of the worker group to its end. `grace` is the time between the polite
/// signal and SIGKILL; past `deadline` (if any) the group is stopped as if it had failed.
pub async fn run_group(
    workers: Vec<WorkerCmd>,
    grace: Duration,
    deadline: Option<Instant>,
    stop: tokio::sync::watch::Receiver<StopRequest>,
    events: Option<mpsc::UnboundedSender<GroupEvent>>,
) -> Result<Outcome> {
    let tell = |e: GroupEvent| {
        if let Some(tx) = &events {
            let _ = tx.send(e);
        }
    };
    let (mut starts, outputs): (Vec<Start>, Vec<WorkerOutput>) =
        workers.into_iter().map(Start::split).unzip();
    bound_terminals(&mut starts, free_ptys());
    // The prefix a worker's terminal is narrower by (kept for its resizes): where it has one.
    let mut prefixes: Vec<String> = starts
        .iter()
        .zip(&outputs)
        .map(|(s, o)| match s.tty.iter().any(Option::is_some) {
            true => o.prefix.clone(),
            false => String::new(),
        })
        .collect();
    let base_env: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
    let terminal = Terminal::ours();
    let mut gave_terminal = false;
    let out = Output::start(outputs);
    let (exits, mut exited) = mpsc::unbounded_channel::<(usize, Exit, SystemTime)>();
    let mut group = Group::new(grace);
    let mut pumps: Vec<(usize, JoinHandle<()>)> = Vec::new();
    let mut spawn_error = None;
    for (idx, start) in starts.into_iter().enumerate() {
        // Thousands of workers take seconds to start: a stop asked for meanwhile starts no
        // more (the loop below acts on it). Yielding now and then lets the coordinator's wait,
        // which shares this task on a single node, hear a signal.
        if idx % 64 == 63 {
            tokio::task::yield_now().await;
        }
        if stop.borrow().stops() {
            break;
        }
        // Workers are in background process groups: a worker reading the terminal would be
        // stopped by SIGTTIN and hang the job, so only the one chosen gets nrun's stdin, and the
        // terminal's foreground with it.
        let foreground = start.stdin && terminal;
        gave_terminal |= foreground;
        if foreground {
            group.foreground = Some(idx);
        }
        let child = match start.spawn(&base_env, foreground) {
            Ok(c) => c,
            Err(e) => {
                spawn_error = Some(e);
                break;
            }
        };
        tell(GroupEvent::Started {
            rank: start.rank,
            pid: child.pid as u32,
        });
        let worker = Worker::watch(
            idx,
            start,
            child,
            (&out, std::mem::take(&mut prefixes[idx])),
            &mut pumps,
            &exits,
        );
        group.add(worker);
    }
    drop(exits);
    if spawn_error.is_some() {
        group.signal(Signal::SIGKILL);
    }

    // After Abandon the sender is gone; there is nothing more to hear.
    let mut stop = Some(stop);
    let mut resizes = group
        .workers
        .iter()
        .any(|w| w.ptys.is_some())
        .then(output::Resizes::start);
    while group.running() > 0 {
        let (timer, note) = (group.timer(), group.grace_note());
        tokio::select! {
            ev = exited.recv() => {
                let Some((idx, exit, at)) = ev else { break };
                tell(GroupEvent::Exited { rank: group.workers[idx].rank, exit });
                group.exited(idx, exit, at);
            }
            req = next_request(&mut stop) => {
                if req == StopRequest::Abandon {
                    stop = None;
                }
                group.requested(req);
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() && group.may_time_out() => {
                group.timed_out();
            }
            _ = tokio::time::sleep_until(timer.unwrap_or_else(Instant::now)), if timer.is_some() => {
                group.timer_passed();
            }
            _ = tokio::time::sleep_until(note.unwrap_or_else(Instant::now)), if note.is_some() => {
                group.say_grace();
            }
            _ = output::Resizes::next(&mut resizes) => group.follow_console(output::followed_console()),
        }
    }

    let progress = sweep(&group, gave_terminal, pumps, out).await;
    match (spawn_error, group.outcome()) {
        (Some(e), _) => Err(e),
        (None, Outcome::Failed(f)) => Ok(Outcome::Failed(Failure { progress, ..f })),
        (None, o) => Ok(o),
    }
}

/// Once every worker has exited: kills what they left behind (first what stayed in their process
/// groups, then what escaped them and was re-parented to nrun), takes the terminal back, and
/// writes out the last of their output, and returns what it showed of progress.
async fn sweep(
    group: &Group,
    gave_terminal: bool,
    pumps: Vec<(usize, JoinHandle<()>)>,
    out: Output,
) -> Option<output::Progress> {
    let leftovers = group.kill_leftovers();
    let orphans = process::kill_orphans();
    if gave_terminal {
        Terminal::take_back();
    }
    // A pipe still open now is held by something outside the job that nrun could not kill
    // (handed its descriptor, or in another pid namespace): one shared deadline, then the pump
    // is aborted, and awaited so its sender is gone before `finish` waits for the writer.
    let deadline = Instant::now() + PUMP_GRACE;
    let mut held = Vec::new();
    for (idx, mut p) in pumps {
        if tokio::time::timeout_at(deadline, &mut p).await.is_err() {
            p.abort();
            let _ = p.await;
            held.push(group.workers[idx].rank);
        }
    }
    held.dedup();
    let progress = out.finish();
    if !leftovers.is_empty() || orphans > 0 {
        tracing::warn!(
            "workers left processes running after they exited (ranks {leftovers:?}, {orphans} outside \
             their process group); nrun killed them"
        );
    }
    if !held.is_empty() {
        tracing::warn!(
            "the output of ranks {held:?} is still held open by a process outside the job \
             (one their workers handed the pipe to, or one in another pid namespace) {}s after \
             they exited; nrun stopped reading it, and what comes later is not shown \
             (check what holds it: `lsof` or `ls -l /proc/*/fd` on this host)",
            PUMP_GRACE.as_secs()
        );
    }
    progress
}

/// The traceback a worker decorated with torch's `@record` wrote to TORCHELASTIC_ERROR_FILE:
/// `{"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}`, or a plain string
/// message from C++ code. The file is read once, by its node's agent (`agent::exec`).
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

/// Finds an executable the way execvp would: a name with a '/' as given, else on PATH.
pub fn find_program(name: &str, path: Option<&str>) -> Option<PathBuf> {
    let is_exec = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if name.contains('/') {
        let p = PathBuf::from(name);
        return is_exec(&p).then_some(p);
    }
    path?
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find(|p| is_exec(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every signal is one word: a real-time one as `kill -l` says it, not "signal 40".
    /// A group's terminals: at most 64 workers get them, fewer where the host has few ptys
    /// free (256 kept for it); workers that asked for none are not counted.
    #[test]
    fn terminals_are_bounded_by_the_group_and_the_hosts_free_ptys() {
        let start = |tty: bool| Start {
            rank: 0,
            local_rank: 0,
            program: "true".into(),
            args: Vec::new(),
            env: Vec::new(),
            error_file: PathBuf::new(),
            stdin: false,
            cpus: None,
            tty: [tty.then_some(output::Tty { cols: 80, rows: 24 }), None],
        };
        for (asked, free, given) in [
            (10, usize::MAX, 10),
            (100, usize::MAX, TERMINAL_WORKERS),
            (100, PTYS_KEPT + 20, 10),
            (100, PTYS_KEPT, 0),
            (5, 0, 0),
        ] {
            let mut starts: Vec<Start> = (0..asked).map(|_| start(true)).collect();
            starts.push(start(false));
            bound_terminals(&mut starts, free);
            let got = starts.iter().filter(|s| s.tty[0].is_some()).count();
            assert_eq!(got, given, "{asked} asked, {free} free");
            // The first ones keep theirs.
            assert!(starts[..got].iter().all(|s| s.tty[0].is_some()));
        }
    }

    #[test]
    fn signals_are_named_in_one_word() {
        assert_eq!(signal_name(libc::SIGKILL), "SIGKILL");
        assert_eq!(signal_name(libc::SIGRTMIN() + 6), "SIGRTMIN+6");
        assert_eq!(
            Exit::Signal(libc::SIGRTMIN()).to_string(),
            "was killed by SIGRTMIN+0"
        );
        assert_eq!(signal_name(999), "signal 999");
    }

    /// nrun stopped by its console's closed pipe stops Python workers (which ignore SIGPIPE)
    /// with SIGTERM; the user's signals are passed on as they are.
    #[test]
    fn a_closed_console_stops_the_workers_with_sigterm() {
        assert_eq!(worker_stop_signal(libc::SIGPIPE), Signal::SIGTERM);
        assert_eq!(worker_stop_signal(libc::SIGINT), Signal::SIGINT);
        assert_eq!(worker_stop_signal(libc::SIGHUP), Signal::SIGHUP);
        assert_eq!(worker_stop_signal(1000), Signal::SIGTERM);
    }

    /// A group of `n` workers that exist only on paper: their process group id is above any
    /// pid_max, so the signals the group sends reach nothing.
    fn on_paper(n: usize, grace: Duration) -> Group {
        let mut g = Group::new(grace);
        for rank in 0..n {
            g.add(Worker {
                rank,
                local_rank: rank,
                pid: 0,
                group: ProcessGroup(Pid::from_raw(i32::MAX)),
                exit: None,
                tail: Default::default(),
                error_file: PathBuf::new(),
                ptys: None,
            });
        }
        g
    }

    const GRACE: Duration = Duration::from_secs(5);

    #[test]
    fn a_failure_settles_then_terminates_then_kills() {
        let mut g = on_paper(2, GRACE);
        g.exited(0, Exit::Code(1), SystemTime::now());
        assert!(matches!(g.phase, Phase::Settling(_)));
        g.timer_passed();
        assert!(matches!(g.phase, Phase::Grace(_)));
        g.timer_passed();
        assert_eq!(g.phase, Phase::Killed);
        g.exited(1, Exit::Signal(libc::SIGKILL), SystemTime::now());
        assert_eq!(g.running(), 0);
        match g.outcome() {
            Outcome::Failed(f) => assert_eq!((f.rank, f.exit), (0, Exit::Code(1))),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn a_failure_once_the_group_is_stopping_is_not_the_cause() {
        let mut g = on_paper(2, GRACE);
        g.requested(StopRequest::Polite);
        g.exited(0, Exit::Code(1), SystemTime::now());
        g.exited(1, Exit::Signal(libc::SIGTERM), SystemTime::now());
        assert!(matches!(g.outcome(), Outcome::Stopped));
    }

    #[test]
    fn a_second_signal_kills_at_once() {
        let mut g = on_paper(1, GRACE);
        g.requested(StopRequest::Signal(libc::SIGINT));
        assert!(matches!(g.phase, Phase::Grace(_)));
        g.requested(StopRequest::Signal(libc::SIGINT));
        assert_eq!(g.phase, Phase::Killed);
        assert!(matches!(g.outcome(), Outcome::Interrupted(libc::SIGINT)));
    }

    #[test]
    fn one_signal_arriving_by_two_paths_is_passed_on_once() {
        let mut g = on_paper(1, GRACE);
        assert!(g.pass_on(libc::SIGUSR1));
        assert!(!g.pass_on(libc::SIGUSR1), "the copy within a second");
        assert!(g.pass_on(libc::SIGUSR2), "another signal passes");
        assert!(
            g.pass_on(libc::SIGUSR1),
            "after another signal, it passes again"
        );
        g.passed_on = Some((libc::SIGUSR1, Instant::now() - ONE_SIGNAL));
        assert!(
            g.pass_on(libc::SIGUSR1),
            "a second later it is a new signal"
        );
    }

    #[test]
    fn a_signal_slurm_gave_the_workers_is_not_passed_on_again() {
        let mut g = on_paper(1, GRACE);
        g.requested(StopRequest::Delivered(libc::SIGUSR1));
        assert_eq!(g.phase, Phase::Running);
        assert!(
            !g.pass_on(libc::SIGUSR1),
            "a copy by another path within a second"
        );
    }

    #[test]
    fn a_forwarded_signal_changes_nothing() {
        let mut g = on_paper(1, GRACE);
        g.requested(StopRequest::Forward(libc::SIGUSR1));
        assert_eq!(g.phase, Phase::Running);
        g.exited(0, Exit::Code(0), SystemTime::now());
        assert!(matches!(g.outcome(), Outcome::Success));
    }

    #[test]
    fn a_signal_after_the_grace_ran_out_is_not_the_cause() {
        let mut g = on_paper(1, GRACE);
        g.requested(StopRequest::Polite);
        g.timer_passed();
        assert_eq!(g.phase, Phase::Killed);
        // Another grace period, but the stop that came first stays the cause.
        g.requested(StopRequest::Signal(libc::SIGTERM));
        assert!(matches!(g.phase, Phase::Grace(_)));
        assert!(matches!(g.outcome(), Outcome::Stopped));
    }

    #[test]
    fn a_lost_coordinator_shortens_the_grace_period() {
        let mut g = on_paper(1, Duration::from_secs(60));
        g.requested(StopRequest::Polite);
        g.requested(StopRequest::Abandon);
        let Phase::Grace(kill_at) = g.phase else {
            panic!("{:?}", g.phase)
        };
        assert!(kill_at <= Instant::now() + ABANDON_GRACE);
        // A later polite stop does not put SIGKILL off again.
        g.requested(StopRequest::Polite);
        assert_eq!(g.phase, Phase::Grace(kill_at));
    }

    #[test]
    fn the_deadline_waits_out_a_grace_period() {
        let mut g = on_paper(1, GRACE);
        assert!(g.may_time_out());
        g.requested(StopRequest::Polite);
        assert!(!g.may_time_out());
        g.timer_passed();
        assert!(g.may_time_out());
        g.timed_out();
        assert!(!g.may_time_out());
        // Timed out wins over stopped from outside.
        assert!(matches!(g.outcome(), Outcome::TimedOut));
    }

    #[test]
    fn ranks_that_left_shortly_before_a_failure_are_named() {
        let mut g = on_paper(4, GRACE);
        let at = SystemTime::now();
        say(&g, 0, &[CLOSED]);
        g.exited(1, Exit::Code(0), at - Duration::from_secs(5));
        g.exited(2, Exit::Code(0), at - Duration::from_secs(40));
        g.exited(0, Exit::Code(1), at);
        g.exited(3, Exit::Code(0), at + Duration::from_secs(1));
        let Outcome::Failed(f) = g.outcome() else {
            panic!("not a failure")
        };
        let ranks: Vec<usize> = f.left_early.iter().map(|(r, _)| *r).collect();
        assert_eq!(ranks, [1, 3]);
        assert!((f.left_early[0].1 - 5.0).abs() < 1e-6);
        assert!((f.left_early[1].1 + 1.0).abs() < 1e-6);
    }

    const CLOSED: &str = "[rank0]: RuntimeError: [pair.cc:561] Connection closed by peer \
                          [127.0.0.1]:943. This is typically caused by a remote worker crashing.";

    /// Worker `idx` wrote `lines` to stderr.
    fn say(g: &Group, idx: usize, lines: &[&str]) {
        let mut t = g.workers[idx].tail.lock().unwrap();
        t.extend(lines.iter().map(|l| l.to_string()));
    }

    /// A rank that failed of its own accord is the cause, never a peer that exited 0 near it
    /// (before or after), and it is the failure reported over a peer that failed because of it.
    #[test]
    fn a_rank_that_raised_is_the_cause_and_a_clean_exit_beside_it_is_not() {
        for (tail, exit) in [
            (
                &["[rank1]: ValueError: rank 1 cannot go on"][..],
                Exit::Code(1),
            ),
            (&[][..], Exit::Code(3)),
            (&[][..], Exit::Signal(libc::SIGSEGV)),
        ] {
            let mut g = on_paper(3, GRACE);
            let at = SystemTime::now();
            say(&g, 1, tail);
            g.exited(0, Exit::Code(0), at - Duration::from_millis(500));
            g.exited(1, exit, at);
            g.exited(2, Exit::Code(0), at + Duration::from_millis(200));
            let Outcome::Failed(f) = g.outcome() else {
                panic!("not a failure")
            };
            assert_eq!((f.rank, f.exit), (1, exit));
            assert!(
                f.left_early.is_empty(),
                "{tail:?} {exit:?}: {:?}",
                f.left_early
            );
        }
        // Rank 0 fails first, of a closed connection; rank 1 raised while the group settled.
        let mut g = on_paper(3, GRACE);
        let at = SystemTime::now();
        say(&g, 0, &[CLOSED]);
        say(&g, 1, &["[rank1]: ValueError: rank 1 cannot go on"]);
        g.exited(2, Exit::Code(0), at - Duration::from_secs(1));
        g.exited(0, Exit::Code(1), at);
        g.exited(1, Exit::Code(1), at + Duration::from_millis(100));
        let Outcome::Failed(f) = g.outcome() else {
            panic!("not a failure")
        };
        assert_eq!(f.rank, 1);
        assert!(f.left_early.is_empty(), "{:?}", f.left_early);
        // A worker stopped by nrun (after the settling time) is no evidence either way.
        let mut g = on_paper(3, GRACE);
        say(&g, 0, &[CLOSED]);
        g.exited(2, Exit::Code(0), at - Duration::from_secs(1));
        g.exited(0, Exit::Code(1), at);
        g.timer_passed();
        g.exited(
            1,
            Exit::Signal(libc::SIGTERM),
            at + Duration::from_millis(400),
        );
        let Outcome::Failed(f) = g.outcome() else {
            panic!("not a failure")
        };
        assert_eq!(f.rank, 0);
        assert_eq!(f.left_early.len(), 1);
        assert_eq!(f.left_early[0].0, 2);
    }

    #[test]
    fn peer_signs_are_told_from_a_rank_of_its_own() {
        for l in [
            CLOSED,
            "RuntimeError: [unbound_buffer.cc:129] Timed out waiting 4000ms for send operation",
            "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6)",
            "torch.distributed.DistBackendError: NCCL error: remote process exited or there was \
             a network error",
        ] {
            assert!(failed_by_peer([l]), "{l}");
        }
        for l in [
            "ValueError: rank 1 cannot go on",
            "torch.OutOfMemoryError: CUDA out of memory.",
            "",
        ] {
            assert!(!failed_by_peer([l]), "{l}");
        }
    }

    #[test]
    fn error_file_formats() {
        let tb = error_file_traceback(
            r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  x\nValueError: boom\n", "timestamp": "1"}}}"#,
        )
        .unwrap();
        assert!(
            tb.starts_with("Traceback") && tb.ends_with("ValueError: boom"),
            "{tb}"
        );
        assert_eq!(
            error_file_traceback(r#"{"message": "c++ error"}"#).unwrap(),
            "c++ error"
        );
        assert!(error_file_traceback("not json").is_none());
    }
}
