//! The watch's eyes on one node: each worker's Python stack, read from outside the process
//! (py-spy as a library, non-blocking, so a worker is never paused), twice a second, summed up
//! in a [`NodeWatch`] about once a second. The agent is the workers' ancestor, so reading their
//! memory (process_vm_readv) is allowed under Yama's default `ptrace_scope=1`; where it is not
//! (scope 2 or 3, or a seccomp profile without process_vm_readv) each rank's view carries the
//! error instead of a stack and the coordinator says so. Conclusions are drawn by the
//! coordinator alone (the watch module).
//!
//! A worker need not be Python itself: a launch script (`sh -c 'exec python train.py'`, a
//! wrapper that starts python as its child) is followed to the Python process it becomes or
//! starts, the topmost Python process of the worker's tree; a worker with no Python in its tree
//! is simply not watched (and nothing is said about it).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::cost::{Costs, Look, Pace, Paced};
use super::flight::{self, FrFiles, FrState};
use super::gpu_time;
use nrun_node::GroupEvent;
use nrun_proto::protocol::{Frame, NodeWatch, RankView};

/// Time between two samples of a rank's stack.
pub const SAMPLE: Duration = Duration::from_millis(500);
/// Time between two published views.
const PUBLISH: Duration = Duration::from_secs(1);
/// Frames kept per rank, innermost first.
const MAX_FRAMES: usize = 8;
/// A rank whose stack changed this recently is running (not stalled).
const ACTIVE: Duration = Duration::from_secs(2);
/// Failed attempts to open a rank (about 5 s: Python may still be starting) before saying why.
const OPEN_TRIES: u32 = 10;

/// The files of one rank the watch reads, nrun's own: its flight recorder's pipe and dump,
/// and its GPU-time counters (`gpu_time`).
#[derive(Clone, Debug, Default)]
pub struct WatchFiles {
    pub fr: Option<FrFiles>,
    pub gpu: Option<std::path::PathBuf>,
}

struct Watched {
    view: RankView,
    /// The worker's own pid (the view's pid is the Python process watched, which may be a
    /// descendant).
    worker: u32,
    spy: Option<py_spy::PythonSpy>,
    tries: u32,
    stack: u64,
    since: Instant,
    /// When its stack was last read whole.
    read: Option<Instant>,
    /// The main thread's voluntary context switches at the last sample.
    switches: Option<u64>,
    /// It runs collectives: seen in one, or it loaded NCCL (whose collectives return at once
    /// and are waited for at the next GPU sync).
    collectives: bool,
    /// Its memory map was searched for NCCL (once, at its first GPU sync: torch is loaded),
    /// and what was found.
    nccl_checked: bool,
    nccl: bool,
    /// When the worker's tree was last searched for a Python process.
    searched: Option<Instant>,
    /// Its flight recorder (NCCL jobs).
    fr: FrState,
    /// Its GPU-time counters (NCCL jobs) and their last readings.
    gpu: Option<(std::path::PathBuf, gpu_time::Window)>,
    /// How often it is sampled: less often while samples cost it more than their budget.
    pace: Pace,
    /// Whether it was sampled in this round (a rank backed off keeps its last view, which
    /// counts once in the straggler statistics, not at every round).
    fresh: bool,
}

/// The earliest a stall's dump is asked (see [`Stalls`]), so that with a short --hang-timeout
/// the collective the ranks stall in is known by the time a hang is called: on an H200 torch
/// wrote the dump about 5 s after the request, which missed a 10 s --hang-timeout when asked
/// at 5 s.
const STALL_DUMP: Duration = Duration::from_secs(2);
/// How long before the coordinator's hang timeout a stall's dump is asked: torch writes it a few
/// seconds after the ask (about 5 s on an H200 with its stack traces), and the hang's
/// conclusion should name the collective.
const DUMP_LEAD: Duration = Duration::from_secs(8);

/// When a node's stall is worth asking its ranks' flight recorders (and NCCL's RAS) for their
/// account. A dump costs the workers (torch stops to write it: BENCHMARKS.md, "The watch's
/// cost"), so it is asked when the stall could become the hang the coordinator calls, not at
/// every communicator's start or short pause: [`DUMP_LEAD`] before the hang timeout, never
/// sooner than [`STALL_DUMP`].
#[derive(Clone, Copy, Debug)]
pub struct Stalls {
    dump_after: Duration,
}

impl Stalls {
    pub(crate) fn new(hang_timeout: Option<Duration>) -> Stalls {
        Stalls {
            dump_after: hang_timeout
                .map_or(STALL_DUMP, |t| t.saturating_sub(DUMP_LEAD).max(STALL_DUMP)),
        }
    }
}
/// A dump asked for and not there after this long is not coming (not an NCCL job).
const DUMP_WAIT: Duration = Duration::from_secs(10);

/// Time between two searches of a worker's tree for Python (a wrapper may start it later).
const SEARCH: Duration = Duration::from_secs(2);

const THREAD: &str = "nrun-watch";

/// A panic on the watch's thread (caught around each `sample`) prints nothing; any other still
/// does.
fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() != Some(THREAD) {
                previous(info);
            }
        }));
    });
}

/// Samples the workers of one step until `events` closes (the group ended); sends views to
/// `out`. Runs on a thread of its own: reading another process's memory blocks.
pub fn spawn(
    mut events: mpsc::UnboundedReceiver<GroupEvent>,
    out: mpsc::UnboundedSender<NodeWatch>,
    files: Vec<(usize, WatchFiles)>,
    ras: Option<String>,
    stall: Stalls,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    quiet_panics();
    std::thread::Builder::new()
        .name(THREAD.into())
        .spawn(move || {
            let mut ranks: Vec<Watched> = Vec::new();
            let mut sources: HashMap<String, Vec<String>> = HashMap::new();
            let mut published = Instant::now();
            let mut periodic = Instant::now();
            let mut ras = ras.map(super::ras::Asker::new);
            let mut costs = Costs::from_env();
            let fr_period = Costs::fr_period(flight::PERIOD);
            let mut dumps = Periodic {
                due: false,
                on: true,
            };
            if costs.skips("ras") {
                ras = None;
            }
            let end = |costs: &Costs| tracing::debug!("the watch's looks: {}", costs.summary());
            loop {
                if !take_events(&mut events, &mut ranks, &files) {
                    end(&costs);
                    return;
                }
                // One look at /proc's process tree serves every rank searched for Python in
                // this round (a thousand workers of another program cost one scan, not 1000).
                let mut tree = None;
                let now = Instant::now();
                for w in ranks.iter_mut() {
                    w.fresh = w.view.exited.is_none() && w.pace.due(now);
                    if !w.fresh {
                        continue;
                    }
                    let clock = super::cost::Clock::start();
                    // A panic in py-spy (attaching to a Python still starting, or reading one
                    // that changes under it) costs the rank a sample, never the watch: the
                    // thread ended silently once, and a restarted group's hang went unnamed.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        sample(w, &mut sources, &mut tree, &mut costs)
                    }));
                    if let Some(p) = w.pace.took(clock.took(), Instant::now()) {
                        say_pace(&w.view, p);
                    }
                }
                // Straggler statistics count the job's running time, not a stall: a sample
                // counts while some rank of the node moved in the last few seconds (a slow rank
                // may be caught at the same line every time).
                if ranks.iter().any(|w| w.since.elapsed() < ACTIVE) {
                    for w in ranks.iter_mut().filter(|w| w.fresh) {
                        count(w, &mut costs);
                    }
                }
                dumps.due = fr_period.is_some_and(|p| periodic.elapsed() >= p);
                if dumps.due {
                    periodic = Instant::now();
                }
                if !costs.skips("fr") {
                    flight_recorders(&mut ranks, &mut dumps, stall, &mut costs);
                }
                if !costs.skips("gpu") {
                    gpu_times(&mut ranks, &mut costs);
                }
                if let Some(asker) = ras.as_mut() {
                    let stalled = nccl_stalled(&mut ranks, stall, &mut costs);
                    costs.time(Look::Ras, 0, || asker.poll(stalled));
                }
                if published.elapsed() >= PUBLISH {
                    published = Instant::now();
                    let snapshot = NodeWatch {
                        ranks: ranks
                            .iter()
                            .map(|w| RankView {
                                unchanged_ms: unchanged(w).as_millis() as u64,
                                ..w.view.clone()
                            })
                            .collect(),
                        ras: ras.as_ref().and_then(|a| a.view.clone()),
                    };
                    if out.send(snapshot).is_err() {
                        end(&costs);
                        return;
                    }
                }
                std::thread::sleep(SAMPLE);
            }
        })
}

/// Takes the group's news (ranks started and exited) into `ranks`; false once the group ended.
fn take_events(
    events: &mut mpsc::UnboundedReceiver<GroupEvent>,
    ranks: &mut Vec<Watched>,
    files: &[(usize, WatchFiles)],
) -> bool {
    loop {
        match events.try_recv() {
            Ok(GroupEvent::Started { rank, pid }) => {
                let f = files
                    .iter()
                    .find(|(r, _)| *r == rank)
                    .map(|(_, f)| f.clone())
                    .unwrap_or_default();
                ranks.push(Watched {
                    view: RankView {
                        rank,
                        pid,
                        ..RankView::default()
                    },
                    worker: pid,
                    spy: None,
                    tries: 0,
                    stack: 0,
                    since: Instant::now(),
                    read: None,
                    switches: None,
                    collectives: false,
                    nccl_checked: false,
                    nccl: false,
                    searched: None,
                    fr: FrState {
                        files: f.fr,
                        ..FrState::default()
                    },
                    gpu: f.gpu.map(|p| (p, gpu_time::Window::default())),
                    pace: Pace::new(SAMPLE),
                    fresh: false,
                })
            }
            Ok(GroupEvent::Exited { rank, exit }) => {
                if let Some(w) = ranks.iter_mut().find(|w| w.view.rank == rank) {
                    w.view.exited = Some(exit);
                    w.spy = None;
                }
            }
            Err(mpsc::error::TryRecvError::Empty) => return true,
            Err(mpsc::error::TryRecvError::Disconnected) => return false,
        }
    }
}

/// Reads the GPU-time counters of the ranks sampled this round (a file of 1 KiB each: never the
/// worker's memory) into their views.
fn gpu_times(ranks: &mut [Watched], costs: &mut Costs) {
    let now = Instant::now();
    for w in ranks.iter_mut().filter(|w| w.fresh) {
        let Some((path, window)) = w.gpu.as_mut() else {
            continue;
        };
        if let Some(c) = costs.time(Look::GpuTime, w.view.rank, || gpu_time::read(path)) {
            window.push(now, c);
            w.view.gpu = window.wait();
        }
    }
}

/// Says that the watch looks at a rank less often (as a warning the first time for that rank:
/// a new driver or kernel that makes reading a worker dear shows here; later in the debug log)
/// or more often again (in the debug log).
fn say_pace(view: &RankView, p: Paced) {
    match p {
        Paced::Slower { took, every, first } => {
            let text = format!(
                "on {}: the watch's sample of rank {} (pid {}) took {} ms, over its budget of {} \
                 ms twice in a row; it now samples that rank every {:.1} s instead of {:.1} s (a \
                 hang is named up to that much later). Reading the worker's stack may contend \
                 with it: docs/watch.md, \"What the watch costs\"",
                nrun_base::net::hostname(),
                view.rank,
                view.pid,
                took.as_millis(),
                super::cost::LOOK_BUDGET.as_millis(),
                every.as_secs_f64(),
                SAMPLE.as_secs_f64()
            );
            match first {
                true => tracing::warn!("{text}"),
                false => tracing::debug!("{text}"),
            }
        }
        Paced::Faster { every } => tracing::debug!(
            "the watch's samples of rank {} are cheap again: every {:.1} s",
            view.rank,
            every.as_secs_f64()
        ),
    }
}

/// The dumps asked while the ranks run, for the straggler statistics and collective mismatches
/// that do not hang (only when `NRUN_WATCH_FR_PERIOD` asks: see [`flight::PERIOD`]).
struct Periodic {
    /// One is due this round.
    due: bool,
    /// Not turned off for their cost.
    on: bool,
}

/// A flight-recorder dump asked while the ranks run (`NRUN_WATCH_FR_PERIOD`) that torch takes
/// longer than this to write (from the ask to the file's time) held its worker up that long: the
/// watch then asks for dumps only when ranks stall. Torch looks at its pipe about once a second.
const DUMP_BUDGET: Duration = Duration::from_secs(3);

/// Asks the ranks' flight recorders for dumps (when the node's ranks stall, and when `periodic`)
/// and reads the dumps that arrived. A dump asked while the ranks run that costs more than
/// [`DUMP_BUDGET`] turns `periodic` dumps off for the rest of the group (said once).
fn flight_recorders(
    ranks: &mut [Watched],
    periodic: &mut Periodic,
    stall: Stalls,
    costs: &mut Costs,
) {
    let live = || {
        ranks
            .iter()
            .filter(|w| w.view.exited.is_none() && w.fr.files.is_some())
    };
    let stalled = stalling(live(), stall.dump_after);
    for w in ranks
        .iter_mut()
        .filter(|w| w.view.exited.is_none() && w.spy.is_some())
    {
        let Some(files) = &w.fr.files else { continue };
        if !stalled {
            w.fr.asked_in_stall = false;
        }
        let ask = (stalled && !w.fr.asked_in_stall) || (periodic.due && periodic.on);
        if ask
            && w.fr.asked.is_none()
            && costs.time(Look::FrAsk, w.view.rank, || flight::ask(files))
        {
            w.fr.asked = Some((Instant::now(), std::time::SystemTime::now()));
            w.fr.asked_in_stall |= stalled;
            w.fr.asked_running = !stalled;
        }
    }
    // The dumps that arrived, read together by one interpreter.
    let mut ready: Vec<(usize, std::path::PathBuf)> = Vec::new();
    for (i, w) in ranks.iter_mut().enumerate() {
        let (Some(files), Some((at, wall))) = (&w.fr.files, w.fr.asked) else {
            continue;
        };
        if let Some((p, written)) = flight::dumped_since(files, wall) {
            let took = written.duration_since(wall).ok();
            if let Some(took) = took.filter(|t| w.fr.asked_running && *t > DUMP_BUDGET)
                && std::mem::replace(&mut periodic.on, false)
            {
                tracing::warn!(
                    "on {}: torch took {:.1} s to write rank {}'s flight-recorder dump, over the \
                     watch's budget of {} s (the worker is held up while it writes): nrun now \
                     asks for dumps only when ranks stall, so stragglers and collective \
                     mismatches that do not hang are named from the stacks alone \
                     (docs/watch.md, \"What the watch costs\")",
                    nrun_base::net::hostname(),
                    took.as_secs_f64(),
                    w.view.rank,
                    DUMP_BUDGET.as_secs()
                );
            }
            ready.push((i, p));
        } else if at.elapsed() > DUMP_WAIT {
            w.fr.asked = None;
        }
    }
    let Some((first, _)) = ready.first() else {
        return;
    };
    let Some(python) = interpreter(ranks[*first].view.pid) else {
        return;
    };
    let paths: Vec<&std::path::Path> = ready.iter().map(|(_, p)| p.as_path()).collect();
    let read = costs.time(Look::FrRead, ranks[*first].view.rank, || {
        flight::read(&python, &paths)
    });
    for ((i, _), v) in ready.iter().zip(read) {
        let i = *i;
        let w = &mut ranks[i];
        // A dump caught half-written is read again at the next sample (until DUMP_WAIT).
        if let Some(v) = v {
            w.view.fr = Some(v);
            w.fr.asked = None;
        }
    }
}

/// Whether these ranks stall, as the coordinator judges a hang (the watch module): one of them
/// has waited in a collective (or the GPU sync after one) for `after`, whatever the
/// others do (a peer polling in a sleep loop moves its own stack, not the collective); or,
/// none waiting, they (some at least) have all been still that long.
fn stalling<'a>(ranks: impl Iterator<Item = &'a Watched> + Clone, after: Duration) -> bool {
    let waits = |w: &&Watched| nrun_proto::protocol::waits_in(&w.view).is_some();
    if ranks.clone().filter(waits).any(|w| unchanged(w) >= after) {
        return true;
    }
    let mut any = false;
    for w in ranks {
        if unchanged(w) < after {
            return false;
        }
        any = true;
    }
    any
}

/// Whether the node's live ranks stall (see [`stalling`]) and some of them run NCCL (its RAS
/// has something to say).
fn nccl_stalled(ranks: &mut [Watched], stall: Stalls, costs: &mut Costs) -> bool {
    let live = |w: &&mut Watched| w.view.exited.is_none();
    stalling(
        ranks.iter().filter(|w| w.view.exited.is_none()),
        stall.dump_after,
    ) && ranks.iter_mut().filter(live).any(|w| loaded_nccl(w, costs))
}

/// Whether the rank's process loaded libnccl (looked up once, at its first GPU sync or stall:
/// torch is loaded by then).
fn loaded_nccl(w: &mut Watched, costs: &mut Costs) -> bool {
    if !w.nccl_checked {
        w.nccl_checked = true;
        let pid = w.view.pid;
        w.nccl = !costs.skips("maps")
            && costs.time(Look::Maps, w.view.rank, || {
                std::fs::read_to_string(format!("/proc/{pid}/maps"))
                    .is_ok_and(|m| m.contains("/libnccl"))
            });
        w.collectives |= w.nccl;
    }
    w.nccl
}

/// The command that runs rank `pid`'s Python as it was started (a venv's `bin/python`, which
/// finds the venv's packages; /proc's exe is the binary the link resolves to), else its exe.
fn interpreter(pid: u32) -> Option<std::path::PathBuf> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let argv0 = cmdline.split(|b| *b == 0).next()?;
    let argv0 = std::path::PathBuf::from(String::from_utf8_lossy(argv0).into_owned());
    match argv0.is_absolute() && argv0.exists() {
        true => Some(argv0),
        false => std::fs::read_link(format!("/proc/{pid}/exe")).ok(),
    }
}

/// Samples in the straggler statistics' window: counts are halved when they reach it, so they
/// speak of the last one to two minutes (a rank that turns slow is named within a minute).
const WINDOW: u32 = 240;

/// One sample in the straggler statistics: a rank waits when it is in a collective, or in a GPU
/// sync (`.item()`, `synchronize()`, a copy to the CPU) of a job that runs collectives: NCCL's
/// return at once and the wait for the peers happens at the next sync.
fn count(w: &mut Watched, costs: &mut Costs) {
    let v = &mut w.view;
    if v.samples >= WINDOW {
        v.samples /= 2;
        v.waiting /= 2;
    }
    v.samples += 1;
    let in_collective = v.collective.is_some();
    let in_sync = nrun_proto::protocol::waits_in(v).is_some();
    w.collectives |= in_collective;
    let waits = in_collective || (in_sync && (w.collectives || loaded_nccl(w, costs)));
    if waits {
        w.view.waiting += 1;
    }
}

/// Reads that fail while a process runs (its memory changing under the reader) say nothing of
/// whether its stack moved: a stack counts as unchanged only as long as it keeps being read.
const READ_RECENTLY: Duration = Duration::from_secs(5);

/// How long the rank's stack is known not to have changed: zero when it was not read whole
/// lately, so that failed reads can never make a running rank look stalled.
fn unchanged(w: &Watched) -> Duration {
    match w.read {
        Some(t) if t.elapsed() <= READ_RECENTLY => w.since.elapsed(),
        _ => Duration::ZERO,
    }
}

fn sample(
    w: &mut Watched,
    sources: &mut HashMap<String, Vec<String>>,
    tree: &mut Option<HashMap<u32, Vec<u32>>>,
    costs: &mut Costs,
) {
    if w.spy.is_none() && !attach(w, tree, costs) {
        return;
    }
    if costs.skips("stack") {
        return;
    }
    let Some(spy) = w.spy.as_mut() else { return };
    // Reading a running process's memory races with it; py-spy can trip over a half-written
    // object. That costs one sample, never the watch (see `quiet_panics`).
    let read = costs.time(Look::Stack, w.view.rank, || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| spy.get_stack_traces()))
    });
    let traces = match read {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            // A Python process under a wrapper may end while the worker goes on (a script that
            // runs python twice): look for the next one.
            if w.view.pid != w.worker && !alive(w.view.pid) {
                w.spy = None;
                w.searched = None;
                return;
            }
            // Gone, or between two states; the exit event says which.
            w.view.error = Some(format!("cannot read its Python stack: {e}"));
            return;
        }
        Err(_) => {
            w.spy = None;
            return;
        }
    };
    // The main thread: its OS thread id is the pid. (Another thread's stack, such as a data
    // loader's idle one, says nothing about the training loop's progress.)
    let pid = u64::from(w.view.pid);
    let main = traces
        .iter()
        .find(|t| t.os_thread_id == Some(pid))
        .or_else(|| {
            traces
                .iter()
                .find(|t| t.frames.last().is_some_and(|f| f.name == "<module>"))
        })
        .or_else(|| traces.first());
    let Some(main) = main else { return };
    w.read = Some(Instant::now());
    // A loop that spends most of its time on one line of module code (no locals to tell one
    // step from the next) is sampled at the same stack again and again: the main thread
    // blocking and waking (a sleep, a socket read, a lock) since the last sample says it moved.
    // A rank that hangs blocks once and stays blocked; one spinning in a GPU sync never blocks.
    let switches = match costs.skips("status") {
        true => None,
        false => costs.time(Look::Status, w.view.rank, || voluntary_switches(pid as u32)),
    };
    if switches.is_some() && w.switches.is_some() && switches != w.switches {
        w.since = Instant::now();
    }
    w.switches = switches;
    let stack = fingerprint(&main.frames);
    if stack != w.stack {
        w.stack = stack;
        w.since = Instant::now();
        w.view.frames = main
            .frames
            .iter()
            .take(MAX_FRAMES)
            .map(|f| Frame {
                name: f.name.clone(),
                file: f.filename.clone(),
                line: f.line,
                code: source_line(sources, &f.filename, f.line),
            })
            .collect();
        w.view.collective = collective(&w.view.frames);
        w.view.error = None;
    }
}

/// Finds the rank's Python process and opens it for reading; false while it cannot (searched
/// again every few seconds, an error said after a few failed opens).
fn attach(w: &mut Watched, tree: &mut Option<HashMap<u32, Vec<u32>>>, costs: &mut Costs) -> bool {
    // The Python process to watch: the worker, what it exec'd, or its topmost Python
    // descendant; searched again every few seconds until found.
    if w.searched.is_some_and(|t| t.elapsed() < SEARCH) {
        return false;
    }
    // The worker's descendants are looked at from the second search on: a wrapper starts
    // its python within moments, and a start of many workers is not slowed by a scan.
    let found = costs.time(Look::Search, w.view.rank, || match w.searched {
        None => Some(w.worker).filter(|p| is_python(*p)),
        Some(_) => python_in_tree(w.worker, tree),
    });
    let Some(pid) = found else {
        w.searched = Some(Instant::now());
        return false;
    };
    if pid != w.view.pid {
        w.view.pid = pid;
        w.tries = 0;
    }
    let mut config = py_spy::Config::default();
    config.blocking = py_spy::config::LockingStrategy::NonBlocking;
    // The addresses of each frame's arguments tell a new call from the same call: a rank
    // that loops through the same line is sampled there again, but with new objects.
    config.dump_locals = u64::from(!costs.skips("locals"));
    let pid = w.view.pid;
    match costs.time(Look::Open, w.view.rank, || {
        py_spy::PythonSpy::new(pid as py_spy::Pid, &config)
    }) {
        Ok(s) => {
            w.spy = Some(s);
            w.view.error = None;
            true
        }
        Err(e) => {
            w.tries += 1;
            if w.tries >= OPEN_TRIES {
                w.view.error = Some(format!("cannot read its Python stack: {e}"));
            }
            false
        }
    }
}

/// Whether process `pid` runs Python: its executable is a python (python3, python3.12, a
/// venv's link to one). One readlink in /proc, which any process of the same user may: cheap
/// enough for a thousand workers of another program.
fn is_python(pid: u32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|p| {
            p.file_name()
                .map(|n| n.to_string_lossy().starts_with("python"))
        })
        .unwrap_or(false)
}

/// The main thread's count of voluntary context switches (times it blocked).
fn voluntary_switches(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
        .trim()
        .parse()
        .ok()
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The topmost Python process of `root`'s tree (`root` itself first), breadth first.
fn python_in_tree(root: u32, tree: &mut Option<HashMap<u32, Vec<u32>>>) -> Option<u32> {
    if is_python(root) {
        return Some(root);
    }
    let children = tree.get_or_insert_with(children_by_parent);
    let mut queue = std::collections::VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        for &c in children.get(&p).into_iter().flatten() {
            if is_python(c) {
                return Some(c);
            }
            queue.push_back(c);
        }
    }
    None
}

/// Every process's children, from /proc/*/stat (the parent is the 4th field, after the name in
/// parentheses, which may itself hold spaces and parentheses).
fn children_by_parent() -> HashMap<u32, Vec<u32>> {
    let mut m: HashMap<u32, Vec<u32>> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return m;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            m.entry(ppid).or_default().push(pid);
        }
    }
    m
}

/// The torch.distributed call a stack waits in: its innermost frame in `distributed_c10d.py`.
pub fn collective(frames: &[Frame]) -> Option<String> {
    frames
        .iter()
        .find(|f| f.file.ends_with("distributed/distributed_c10d.py"))
        .map(|f| f.name.clone())
}

fn fingerprint(frames: &[py_spy::Frame]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in frames {
        f.name.hash(&mut h);
        f.filename.hash(&mut h);
        f.line.hash(&mut h);
        // Addresses alone can repeat: CPython hands a freed object's memory to the next one
        // of its size, so a loop caught at the same line may show the same addresses step after
        // step. The values' text (a loop counter, a step number) tells those steps apart.
        for l in f.locals.iter().flatten() {
            l.addr.hash(&mut h);
            l.repr.hash(&mut h);
        }
    }
    h.finish()
}

/// Largest source file read for a stack's lines.
const MAX_SOURCE_BYTES: u64 = 16 << 20;

/// Line `line` of `file` (1-based), trimmed; files are read once.
fn source_line(cache: &mut HashMap<String, Vec<String>>, file: &str, line: i32) -> Option<String> {
    let lines = cache.entry(file.to_string()).or_insert_with(|| {
        // A source file a traceback names: bounded, a regular file only (never a FIFO).
        nrun_base::files::read_bounded(std::path::Path::new(file), MAX_SOURCE_BYTES)
            .map(|t| {
                String::from_utf8_lossy(&t)
                    .lines()
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    });
    let l = lines.get(usize::try_from(line).ok()?.checked_sub(1)?)?;
    Some(l.trim().to_string()).filter(|l| !l.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watched(code: &str, collective: Option<&str>) -> Watched {
        Watched {
            view: RankView {
                // This process: its memory map is real (and holds no libnccl).
                pid: std::process::id(),
                frames: vec![Frame {
                    name: "main".into(),
                    file: "/job/train.py".into(),
                    line: 9,
                    code: Some(code.into()),
                }],
                collective: collective.map(str::to_string),
                ..RankView::default()
            },
            worker: std::process::id(),
            spy: None,
            tries: 0,
            stack: 0,
            since: Instant::now(),
            read: Some(Instant::now()),
            switches: None,
            collectives: false,
            nccl_checked: false,
            nccl: false,
            searched: None,
            fr: FrState::default(),
            gpu: None,
            pace: Pace::new(SAMPLE),
            fresh: true,
        }
    }

    #[test]
    fn a_gpu_sync_counts_as_waiting_once_the_rank_runs_collectives() {
        let mut w = watched("loss.item()", None);
        count(&mut w, &mut Costs::from_env());
        assert_eq!(
            (w.view.samples, w.view.waiting),
            (1, 0),
            "no collectives yet"
        );
        w.view.collective = Some("all_reduce".into());
        count(&mut w, &mut Costs::from_env());
        w.view.collective = None;
        count(&mut w, &mut Costs::from_env());
        assert_eq!((w.view.samples, w.view.waiting), (3, 2));
        // Plain Python code never counts.
        w.view.frames[0].code = Some("x = x + 1".into());
        count(&mut w, &mut Costs::from_env());
        assert_eq!((w.view.samples, w.view.waiting), (4, 2));
    }

    #[test]
    fn the_statistics_speak_of_the_last_minutes_and_unread_stacks_are_not_stalled() {
        let mut w = watched("loss.item()", Some("all_reduce"));
        for _ in 0..WINDOW {
            count(&mut w, &mut Costs::from_env());
        }
        count(&mut w, &mut Costs::from_env());
        assert_eq!(
            (w.view.samples, w.view.waiting),
            (WINDOW / 2 + 1, WINDOW / 2 + 1)
        );
        w.since = Instant::now() - Duration::from_secs(100);
        assert!(unchanged(&w) >= Duration::from_secs(100));
        // Not read whole lately: how long it has not changed is unknown, never a stall.
        w.read = Some(Instant::now() - READ_RECENTLY - Duration::from_secs(1));
        assert_eq!(unchanged(&w), Duration::ZERO);
    }

    #[test]
    fn the_python_process_of_a_worker_tree_is_found() {
        // This test binary is not Python, and (run by cargo) has no Python child.
        assert!(!is_python(std::process::id()));
        let Some(py) = std::env::var_os("NRUN_TEST_PYTHON") else {
            eprintln!("SKIPPED: NRUN_TEST_PYTHON unset");
            return;
        };
        // sh -> python: the wrapper's child is found, and is Python.
        let mut sh = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "{} -c 'import time; time.sleep(30)'; true",
                py.to_string_lossy()
            ))
            .spawn()
            .unwrap();
        let root = sh.id();
        let found = (0..50).find_map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            python_in_tree(root, &mut None)
        });
        let found = found.expect("the python child");
        // SAFETY: kill(2) on the pid of the child we just found, and its parent we started.
        unsafe { libc::kill(found as i32, libc::SIGKILL) };
        let _ = sh.kill();
        let _ = sh.wait();
        assert_ne!(found, root);
    }
}
