//! What the watch's looks at a worker cost, measured by the watch itself: each kind of look
//! ([`Look`]) is timed, summed per kind, and (for measurements) can be turned off alone or
//! written to a trace file, so that a worker's slow steps can be laid beside the looks that
//! happened then. `NRUN_WATCH_TRACE=FILE` writes one line per look (`wall_s look rank us`);
//! `NRUN_WATCH_SKIP=stack,locals,status,maps,fr,ras,gpu` turns looks off (docs/watch.md, "What the
//! watch costs").

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant, SystemTime};

/// The looks `NRUN_WATCH_SKIP` turns off.
fn skip_list() -> Vec<String> {
    std::env::var("NRUN_WATCH_SKIP")
        .map(|s| s.split(',').map(|p| p.trim().to_string()).collect())
        .unwrap_or_default()
}

/// Whether `NRUN_WATCH_SKIP` turns look `part` off (for what is set up before the watch runs).
pub(crate) fn skipped(part: &str) -> bool {
    skip_list().iter().any(|s| s == part)
}

/// One kind of look at a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Look {
    /// Opening the worker's Python for reading (py-spy parses its binary and memory map).
    Open,
    /// Reading the Python stack (process_vm_readv of the thread states and frames).
    Stack,
    /// The main thread's context-switch count (/proc/PID/task/PID/status).
    Status,
    /// The memory map searched for libnccl (/proc/PID/maps).
    Maps,
    /// A flight-recorder dump asked for (one byte down its pipe; torch then dumps).
    FrAsk,
    /// Dumps read (the workers' interpreter unpickles them).
    FrRead,
    /// NCCL's RAS asked for the job's status.
    Ras,
    /// The process tree searched for the worker's Python.
    Search,
    /// Its GPU-time counters read (`gpu_time`: a file nrun's NCCL profiler plugin writes).
    GpuTime,
}

impl Look {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Look::Open => "open",
            Look::Stack => "stack",
            Look::Status => "status",
            Look::Maps => "maps",
            Look::FrAsk => "fr",
            Look::FrRead => "fr-read",
            Look::Ras => "ras",
            Look::Search => "search",
            Look::GpuTime => "gpu",
        }
    }
}

/// The sum of one kind of look.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Sum {
    pub count: u64,
    pub total: Duration,
    pub max: Duration,
}

/// The watch's own account of its looks, and the looks turned off.
pub(crate) struct Costs {
    sums: HashMap<Look, Sum>,
    skip: Vec<String>,
    trace: Option<std::fs::File>,
}

impl Costs {
    /// From the environment (see the module's doc): nothing skipped and no trace by default.
    pub(crate) fn from_env() -> Costs {
        let skip = skip_list();
        let trace = std::env::var_os("NRUN_WATCH_TRACE").and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        });
        Costs {
            sums: HashMap::new(),
            skip,
            trace,
        }
    }

    /// The time between two flight-recorder dumps asked while the job runs: `default`, or
    /// `NRUN_WATCH_FR_PERIOD` seconds (to measure a dump's cost, or to have mismatches that do
    /// not hang named at that cost).
    pub(crate) fn fr_period(default: Option<std::time::Duration>) -> Option<std::time::Duration> {
        period_from(
            std::env::var("NRUN_WATCH_FR_PERIOD").ok().as_deref(),
            default,
        )
    }

    /// Whether `part` (a look's name, or "locals") is turned off.
    pub(crate) fn skips(&self, part: &str) -> bool {
        self.skip.iter().any(|s| s == part)
    }

    /// Runs `f` as look `look` at `rank`, timed.
    pub(crate) fn time<T>(&mut self, look: Look, rank: usize, f: impl FnOnce() -> T) -> T {
        let wall = SystemTime::now();
        let t0 = Instant::now();
        let out = f();
        let took = t0.elapsed();
        let s = self.sums.entry(look).or_default();
        s.count += 1;
        s.total += took;
        s.max = s.max.max(took);
        if let Some(t) = self.trace.as_mut() {
            let at = wall
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default();
            let _ = writeln!(
                t,
                "{:.6} {} {rank} {}",
                at.as_secs_f64(),
                look.name(),
                took.as_micros()
            );
        }
        out
    }

    /// One line of the sums, for the debug log at the watch's end.
    pub(crate) fn summary(&self) -> String {
        let mut looks: Vec<(&Look, &Sum)> = self.sums.iter().collect();
        looks.sort_by_key(|(l, _)| l.name());
        looks
            .iter()
            .map(|(l, s)| {
                format!(
                    "{} {}x mean {} us max {} us",
                    l.name(),
                    s.count,
                    s.total.as_micros() / u128::from(s.count.max(1)),
                    s.max.as_micros()
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// What one sample of one worker (every look at it in one round) may take, less the time the
/// watch's thread waited for a CPU ([`Clock`]). A stack read takes 1-2 ms on an H100 node
/// (BENCHMARKS.md); one that takes ten times that contends with something in the worker (its
/// memory map's lock, a driver call) and may cost it as much. A debug build reads about ten
/// times slower.
pub(crate) const LOOK_BUDGET: Duration = Duration::from_millis(match cfg!(debug_assertions) {
    true => 200,
    false => 20,
});

/// The time a look took on the watch's own thread, less the time that thread waited for a CPU
/// (its schedstat's run delay): a busy node that keeps the watch off the CPU costs the workers
/// nothing, while a read blocked on a worker's lock counts.
pub(crate) struct Clock {
    wall: Instant,
    queued: Option<u64>,
}

impl Clock {
    pub(crate) fn start() -> Clock {
        Clock {
            wall: Instant::now(),
            queued: run_delay_ns(),
        }
    }

    pub(crate) fn took(&self) -> Duration {
        let wall = self.wall.elapsed();
        match (self.queued, run_delay_ns()) {
            (Some(a), Some(b)) => wall.saturating_sub(Duration::from_nanos(b.saturating_sub(a))),
            _ => wall,
        }
    }
}

/// This thread's time spent waiting on a run queue, nanoseconds (the second field of
/// /proc/thread-self/schedstat); None where the kernel keeps no such account.
fn run_delay_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
/// The longest time between two samples of a worker backed off: under the five seconds after
/// which a stack not read counts as unknown (stacks::READ_RECENTLY), so hangs are still named.
pub(crate) const MAX_EVERY: Duration = Duration::from_secs(2);
/// Samples over budget in a row before backing off (one may be the watch's own thread
/// preempted on a busy node, which costs the worker nothing).
const OVER: u32 = 2;
/// Samples under budget in a row before looking more often again.
const UNDER: u32 = 40;

/// How often the watch looks at one worker: every `base`, less often while looks at it cost
/// more than [`LOOK_BUDGET`].
#[derive(Clone, Debug)]
pub(crate) struct Pace {
    base: Duration,
    every: Duration,
    next: Option<Instant>,
    over: u32,
    under: u32,
    /// It has backed off before (said once).
    slowed: bool,
}

/// A change of pace, to be said.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Paced {
    /// Looks cost `took` (the last one): every `every` from now; `first`: the first time for
    /// this worker.
    Slower {
        took: Duration,
        every: Duration,
        first: bool,
    },
    /// Looks are cheap again: every `every` from now.
    Faster { every: Duration },
}

impl Pace {
    pub(crate) fn new(base: Duration) -> Pace {
        Pace {
            base,
            every: base,
            next: None,
            over: 0,
            under: 0,
            slowed: false,
        }
    }

    /// Whether the worker is due for a sample at `now`.
    pub(crate) fn due(&self, now: Instant) -> bool {
        self.next.is_none_or(|n| now >= n)
    }

    /// Accounts a sample that took `took`, ending at `now`.
    pub(crate) fn took(&mut self, took: Duration, now: Instant) -> Option<Paced> {
        let mut changed = None;
        if took > LOOK_BUDGET {
            self.under = 0;
            self.over += 1;
            if self.over >= OVER && self.every < MAX_EVERY {
                self.over = 0;
                self.every = (self.every * 2).min(MAX_EVERY);
                changed = Some(Paced::Slower {
                    took,
                    every: self.every,
                    first: !std::mem::replace(&mut self.slowed, true),
                });
            }
        } else {
            self.over = 0;
            self.under += 1;
            if self.under >= UNDER && self.every > self.base {
                self.under = 0;
                self.every = (self.every / 2).max(self.base);
                changed = Some(Paced::Faster { every: self.every });
            }
        }
        // Less a little: the watch's round comes every `base`, and a worker due a moment
        // after a round would wait a whole round more.
        self.next = Some(now + self.every.saturating_sub(self.base / 2));
        changed
    }

    #[cfg(test)]
    pub(crate) fn every(&self) -> Duration {
        self.every
    }
}

/// `NRUN_WATCH_FR_PERIOD`'s value read as seconds (positive), else `default`.
fn period_from(var: Option<&str>, default: Option<Duration>) -> Option<Duration> {
    var.and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: Duration = Duration::from_millis(500);

    #[test]
    fn no_dump_is_asked_while_ranks_run_unless_a_period_is_given() {
        // A pipe dump holds a GPU job's steps at 2-8x for ~5 s (BENCHMARKS.md section 30).
        assert_eq!(crate::flight::PERIOD, None);
        assert_eq!(period_from(None, None), None);
        assert_eq!(period_from(Some("15"), None), Some(Duration::from_secs(15)));
        for bad in ["0", "-3", "inf", "NaN", "soon"] {
            assert_eq!(period_from(Some(bad), None), None, "{bad}");
        }
    }

    #[test]
    fn a_costly_worker_is_looked_at_less_often_and_again_when_cheap() {
        let mut p = Pace::new(BASE);
        let t = Instant::now();
        let cheap = Duration::from_millis(2);
        let dear = LOOK_BUDGET * 3;
        assert!(p.due(t));
        assert_eq!(p.took(cheap, t), None);
        assert!(!p.due(t) && p.due(t + BASE));
        // One dear sample may be the watch's own thread preempted: not yet.
        assert_eq!(p.took(dear, t), None);
        assert_eq!(
            p.took(dear, t),
            Some(Paced::Slower {
                took: dear,
                every: BASE * 2,
                first: true
            })
        );
        assert!(!p.due(t + BASE) && p.due(t + BASE * 2));
        // Never past MAX_EVERY, so a hang is still named.
        for _ in 0..20 {
            p.took(dear, t);
        }
        assert_eq!(p.every(), MAX_EVERY);
        // Cheap again for a while: back step by step.
        let mut back = Vec::new();
        for _ in 0..(UNDER * 3) {
            if let Some(c) = p.took(cheap, t) {
                back.push(c);
            }
        }
        assert_eq!(
            back,
            vec![
                Paced::Faster { every: BASE * 2 },
                Paced::Faster { every: BASE }
            ]
        );
        assert_eq!(p.every(), BASE);
    }
}

#[cfg(test)]
mod clock_tests {
    use super::*;

    #[test]
    fn a_look_is_timed_less_the_wait_for_a_cpu() {
        // Where the kernel keeps the account, the run delay is read and grows monotonically.
        if let Some(a) = run_delay_ns() {
            assert!(run_delay_ns().unwrap() >= a);
        }
        let c = Clock::start();
        std::thread::sleep(Duration::from_millis(30));
        // Sleeping is not waiting for a CPU: it counts (a read blocked on a lock would too).
        assert!(c.took() >= Duration::from_millis(25), "{:?}", c.took());
    }
}
