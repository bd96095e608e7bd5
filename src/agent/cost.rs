//! What the watch's looks at a worker cost, measured by the watch itself: each kind of look
//! ([`Look`]) is timed, summed per kind, and (for measurements) can be turned off alone or
//! written to a trace file, so that a worker's slow steps can be laid beside the looks that
//! happened then. `NRUN_WATCH_TRACE=FILE` writes one line per look (`wall_s look rank us`);
//! `NRUN_WATCH_SKIP=stack,locals,status,maps,fr,ras` turns looks off (docs/watch.md, "What the
//! watch costs").

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant, SystemTime};

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
        let skip = std::env::var("NRUN_WATCH_SKIP")
            .map(|s| s.split(',').map(|p| p.trim().to_string()).collect())
            .unwrap_or_default();
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
