//! When restarting cannot help: the restart policy's stop before `--max-restarts` runs out.
//!
//! Each failed attempt gets a signature (the failing rank, the exception's type and the
//! innermost frame of its traceback; for a hang the watch stopped, the ranks it blames and the
//! collective the others wait in) and, where it can be measured, its progress: the highest step
//! `--progress-regex` matched in the workers' output (or the count of matching lines, for a
//! pattern without a capture group), else the collectives its flight recorder completed (where
//! the watch read one). An attempt that fails with the streak's signature and no more progress
//! than the streak's best is a restart without progress; `--max-no-progress-restarts` of them
//! in a row stop the job with its own exit code. Progress not known (no pattern, no flight
//! recorder) never counts: torchrun's floor, restarting while restarts are left, holds.
//!
//! Only the program's own failures count (the fault model's verdict "the program's" on every
//! node): a node lost or suspected, a hang pinned on a node, an elastic group growing are
//! decisions about nodes, and start the streak anew (see `commands::run`).

use std::fmt;

use crate::protocol::{RunResult, StepResult};

/// How far an attempt got, in one measure; two attempts compare only in the same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    /// The highest step `--progress-regex`'s capture group named (none: no line named one).
    Step(Option<u64>),
    /// Lines that matched `--progress-regex` (a pattern without a capture group): the most of
    /// one worker.
    Marks(u64),
    /// Collectives completed, as the flight recorders the watch read say.
    Collectives(u64),
}

impl Progress {
    /// Whether `self` is no more than `best`; None: they are not comparable (not known).
    fn no_more_than(self, best: Progress) -> Option<bool> {
        match (self, best) {
            (Progress::Step(a), Progress::Step(b)) => Some(a <= b),
            (Progress::Marks(a), Progress::Marks(b)) => Some(a <= b),
            (Progress::Collectives(a), Progress::Collectives(b)) => Some(a <= b),
            _ => None,
        }
    }

    /// As `--report` keeps it: the measure and its value.
    pub(crate) fn parts(self) -> (&'static str, Option<u64>) {
        match self {
            Progress::Step(s) => ("step", s),
            Progress::Marks(n) => ("progress_lines", Some(n)),
            Progress::Collectives(n) => ("collectives", Some(n)),
        }
    }
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Step(Some(s)) => write!(f, "step {s}"),
            Progress::Step(None) => f.write_str("no step printed"),
            Progress::Marks(n) => write!(f, "{n} lines matching --progress-regex"),
            Progress::Collectives(n) => write!(f, "{n} collectives completed"),
        }
    }
}

/// How an attempt failed, as far as restarting it goes: two attempts failed the same way when
/// their signatures are equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Signature {
    /// The failing rank (global), or the ranks a hang blames.
    pub ranks: Vec<usize>,
    /// The exception's type ("ValueError"), else how the worker ended ("exited with code 3"),
    /// or the hang ("hang in all_reduce").
    pub what: String,
    /// The innermost frame of its traceback, "file:line", where one was read.
    pub at: Option<String>,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ranks: Vec<String> = self.ranks.iter().map(usize::to_string).collect();
        match self.ranks.len() {
            0 => {}
            1 => write!(f, "rank {}: ", ranks[0])?,
            _ => write!(f, "ranks {}: ", ranks.join(","))?,
        }
        f.write_str(&self.what)?;
        match &self.at {
            Some(at) => write!(f, " at {at}"),
            None => Ok(()),
        }
    }
}

/// One failed attempt of the program's, as the policy counts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Failed {
    /// Its number (as the log directories' attempt_N).
    pub attempt: u32,
    pub signature: Signature,
    pub progress: Option<Progress>,
}

/// The job stops: restarts `first..=last` failed as attempt `base` did with no progress past
/// `best`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GiveUp {
    pub base: u32,
    pub first: u32,
    pub last: u32,
    pub signature: Signature,
    pub best: Progress,
    /// `--max-no-progress-restarts`.
    pub limit: u32,
}

impl GiveUp {
    /// Why the job stops, in one line (after "nrun: stopping: ").
    pub(crate) fn why(&self, restarts_left: u32) -> String {
        let attempts = match self.first == self.last {
            true => format!("attempt {}", self.first),
            false => format!("attempts {}-{}", self.first, self.last),
        };
        format!(
            "{attempts} failed the same way as attempt {} ({}) with no progress past {}; \
             restarting cannot help (--max-no-progress-restarts {}; {restarts_left} restarts \
             were left)",
            self.base, self.signature, self.best, self.limit
        )
    }
}

/// The failures counted so far: the attempt the streak started with, its best progress, and
/// the restarts since that made none.
#[derive(Clone, Debug, Default)]
pub(crate) struct Streak {
    /// `--max-no-progress-restarts` (0: the policy is off).
    limit: u32,
    base: Option<Failed>,
    best: Option<Progress>,
    /// Attempts since `base` that failed its way with no more progress, the first of them.
    count: u32,
    first: u32,
}

impl Streak {
    pub(crate) fn new(limit: u32) -> Streak {
        Streak {
            limit,
            ..Streak::default()
        }
    }

    /// An attempt outside the rule (a node's fault, a hang pinned on a node, the group grown):
    /// the next failure starts a streak of its own.
    pub(crate) fn reset(&mut self) {
        *self = Streak::new(self.limit);
    }

    /// The restarts without progress so far in a row.
    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// Counts a failure of the program's; Some: the job should stop, and why.
    pub(crate) fn failed(&mut self, f: Failed) -> Option<GiveUp> {
        let same = self
            .base
            .as_ref()
            .is_some_and(|b| b.signature == f.signature);
        let none = match (f.progress, self.best) {
            (Some(now), Some(best)) => now.no_more_than(best) == Some(true),
            _ => false,
        };
        if !(same && none) {
            self.best = f.progress;
            self.base = Some(f);
            self.count = 0;
            return None;
        }
        self.count += 1;
        if self.count == 1 {
            self.first = f.attempt;
        }
        let base = self.base.as_ref()?;
        (self.limit > 0 && self.count >= self.limit).then(|| GiveUp {
            base: base.attempt,
            first: self.first,
            last: f.attempt,
            signature: base.signature.clone(),
            best: self.best.unwrap_or(Progress::Step(None)),
            limit: self.limit,
        })
    }
}

/// The attempt's progress: by `--progress-regex` (`step`: it has a capture group) where a failed
/// worker's node read it, else the flight recorders' collectives completed; None: not known.
/// Only nodes whose worker failed report it: "no match" is no progress only where every node
/// reported (else the matches may be on a node nrun stopped, as where rank 0 alone prints).
pub(crate) fn progress(
    results: &[Option<StepResult>],
    regex: Option<bool>,
    collectives: Option<u64>,
) -> Option<Progress> {
    let reports: Vec<Option<nrun_node::output::Progress>> = results
        .iter()
        .flatten()
        .map(|r| match r {
            StepResult::Run(RunResult::Failed(f)) => f.progress.as_deref().copied(),
            _ => None,
        })
        .collect();
    let every = reports.iter().all(Option::is_some);
    let read = reports
        .into_iter()
        .flatten()
        .reduce(|a, b| nrun_node::output::Progress {
            marks: a.marks.max(b.marks),
            step: a.step.max(b.step),
        });
    match (regex, read) {
        (Some(true), Some(p)) if p.step.is_some() || every => Some(Progress::Step(p.step)),
        (Some(false), Some(p)) if p.marks > 0 || every => Some(Progress::Marks(p.marks)),
        _ => collectives.map(Progress::Collectives),
    }
}

/// The signature of a failed attempt: its root cause (`crate::report::first_failure`).
pub(crate) fn signature(first: Option<&RunResult>) -> Signature {
    let Some(RunResult::Failed(f)) = first else {
        let what = match first {
            Some(RunResult::SpawnError(e)) => format!("could not start: {e}"),
            Some(RunResult::TimedOut) => "ran past its deadline".to_string(),
            Some(RunResult::Lost(why)) => format!("lost: {why}"),
            _ => "failed".to_string(),
        };
        return Signature {
            ranks: Vec::new(),
            what,
            at: None,
        };
    };
    // The error file's traceback (torch's @record), else the tail of its stderr.
    let read = f
        .traceback
        .as_deref()
        .and_then(|t| exception(t.lines()))
        .or_else(|| exception(f.stderr_tail.iter().map(String::as_str)));
    let (what, at) = match read {
        Some((what, at)) => (what, at),
        None => (f.how.to_string(), None),
    };
    Signature {
        ranks: vec![f.rank],
        what,
        at,
    }
}

/// The signature of a hang the watch stopped: the ranks it blames and where the others wait.
pub(crate) fn hang_signature(
    stop: &crate::watch::Stop,
    mismatch: Option<&crate::watch::Mismatch>,
) -> Signature {
    match stop {
        crate::watch::Stop::Hang(d) => {
            let op = d.ranks.iter().find_map(|r| r.waiting_in.clone());
            Signature {
                ranks: d.culprits.clone(),
                what: match op {
                    Some(op) => format!("hang in {op}"),
                    None => format!("hang ({})", d.kind.as_str()),
                },
                at: None,
            }
        }
        crate::watch::Stop::Mismatch => Signature {
            ranks: mismatch.map(|m| m.culprits.clone()).unwrap_or_default(),
            what: match mismatch {
                Some(m) => format!("collective mismatch at #{} of group {:?}", m.seq, m.pg),
                None => "collective mismatch".to_string(),
            },
            at: None,
        },
    }
}

/// A Python traceback's exception type and innermost frame ("file:line"), from its lines
/// (torch's "[rankN]: " before each line of an uncaught exception taken off).
fn exception<'a>(lines: impl Iterator<Item = &'a str>) -> Option<(String, Option<String>)> {
    let mut frame = None;
    let mut kind = None;
    for line in lines {
        let line = strip_rank(line).trim_end();
        if let Some(rest) = line.trim_start().strip_prefix("File \"") {
            // `  File "train.py", line 12, in main`
            let Some((file, after)) = rest.split_once("\", line ") else {
                continue;
            };
            let number: String = after.chars().take_while(char::is_ascii_digit).collect();
            frame = Some(format!("{file}:{number}"));
            kind = None;
        } else if frame.is_some() && !line.starts_with([' ', '\t']) && !line.is_empty() {
            // The exception's line after the frames: `ValueError: ...`, `KeyboardInterrupt`.
            let name = line.split(':').next().unwrap_or(line);
            let looks = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_alphanumeric() || c == '_' || c == '.');
            if looks && kind.is_none() {
                kind = Some(name.to_string());
            }
        }
    }
    Some((kind?, frame))
}

/// `line` without torch's "[rankN]: " (or "[rankN]:") before it.
fn strip_rank(line: &str) -> &str {
    let Some(rest) = line.strip_prefix("[rank") else {
        return line;
    };
    let digits = rest.chars().take_while(char::is_ascii_digit).count();
    match rest[digits..].strip_prefix("]:") {
        Some(body) if digits > 0 => body.strip_prefix(' ').unwrap_or(body),
        _ => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Ending, WorkerFailure};

    const TB: &str = "Traceback (most recent call last):
  File \"/tmp/job/train.py\", line 20, in <module>
    main()
  File \"/tmp/job/train.py\", line 12, in main
    raise ValueError(f\"bad batch at step {step}\")
ValueError: bad batch at step 5";

    fn failed(rank: usize, tail: &str, progress: Option<u64>) -> Option<StepResult> {
        Some(StepResult::Run(RunResult::Failed(WorkerFailure {
            rank,
            local_rank: 0,
            pid: 1,
            exit_code: 1,
            how: Ending::Exit(nrun_node::Exit::Code(1)),
            gpu: None,
            at: String::new(),
            stderr_tail: tail.lines().map(str::to_string).collect(),
            traceback: None,
            error_file: Default::default(),
            left_early: Vec::new(),
            error_json: None,
            error_file_kept: false,
            progress: progress.map(|s| {
                Box::new(nrun_node::output::Progress {
                    marks: s + 1,
                    step: Some(s),
                })
            }),
        })))
    }

    fn sig(r: &Option<StepResult>) -> Signature {
        match r {
            Some(StepResult::Run(rr)) => signature(Some(rr)),
            _ => signature(None),
        }
    }

    #[test]
    fn a_signature_is_the_rank_the_exception_and_the_innermost_frame() {
        let s = sig(&failed(1, TB, None));
        assert_eq!(
            s,
            Signature {
                ranks: vec![1],
                what: "ValueError".into(),
                at: Some("/tmp/job/train.py:12".into()),
            }
        );
        assert_eq!(s.to_string(), "rank 1: ValueError at /tmp/job/train.py:12");
        // torch's excepthook prefixes every line; the message's own words do not count.
        let prefixed: String = TB
            .replace("step {step}", "step 7")
            .lines()
            .map(|l| format!("[rank1]: {l}\n"))
            .collect();
        assert_eq!(sig(&failed(1, &prefixed, None)), s);
        // Another rank, another frame, another type: another signature.
        assert_ne!(sig(&failed(0, TB, None)), s);
        assert_ne!(sig(&failed(1, &TB.replace("line 12", "line 13"), None)), s);
        assert_ne!(
            sig(&failed(1, &TB.replace("ValueError:", "KeyError:"), None)),
            s
        );
        // No traceback: how the worker ended.
        let plain = sig(&failed(2, "some output\n", None));
        assert_eq!(plain.what, "exited with code 1");
        assert_eq!(plain.at, None);
        // A chained exception: the last one raised.
        let chained = format!(
            "{TB}\n\nDuring handling of the above exception, another exception occurred:\n\n\
             Traceback (most recent call last):\n  File \"/tmp/job/train.py\", line 30, in <module>\n\
             \x20   raise RuntimeError('again')\nRuntimeError: again"
        );
        let c = sig(&failed(1, &chained, None));
        assert_eq!(
            (c.what.as_str(), c.at.as_deref()),
            ("RuntimeError", Some("/tmp/job/train.py:30"))
        );
    }

    #[test]
    fn a_hang_s_signature_is_the_ranks_blamed_and_the_collective() {
        use crate::watch::{Diagnosis, Kind, RankState, Stop};
        let d = |culprits: Vec<usize>, op: Option<&str>| Diagnosis {
            kind: Kind::Missing,
            conclusion: "rank 1 never entered all_reduce".into(),
            culprits,
            stalled_s: 3.0,
            in_collective: true,
            ranks: vec![RankState {
                rank: 0,
                waiting_in: op.map(str::to_string),
                ..RankState::default()
            }],
            nccl_ras: None,
        };
        let s = hang_signature(&Stop::Hang(d(vec![1], Some("all_reduce"))), None);
        assert_eq!(s.to_string(), "rank 1: hang in all_reduce");
        // The same again (another stall time, other words): the same way.
        let mut again = d(vec![1], Some("all_reduce"));
        again.stalled_s = 9.0;
        assert_eq!(hang_signature(&Stop::Hang(again), None), s);
        assert_ne!(
            hang_signature(&Stop::Hang(d(vec![0], Some("all_reduce"))), None),
            s
        );
        assert_ne!(
            hang_signature(&Stop::Hang(d(vec![1], Some("barrier"))), None),
            s
        );
        assert_eq!(
            hang_signature(&Stop::Hang(d(vec![0, 1], None)), None).to_string(),
            "ranks 0,1: hang (missing)"
        );
    }

    fn at(attempt: u32, what: &str, progress: Option<Progress>) -> Failed {
        Failed {
            attempt,
            signature: Signature {
                ranks: vec![1],
                what: what.into(),
                at: Some("train.py:12".into()),
            },
            progress,
        }
    }

    const STEP5: Option<Progress> = Some(Progress::Step(Some(5)));

    #[test]
    fn the_same_failure_with_no_progress_stops_after_the_limit() {
        let mut s = Streak::new(3);
        assert_eq!(s.failed(at(0, "ValueError", STEP5)), None);
        assert_eq!(s.failed(at(1, "ValueError", STEP5)), None);
        assert_eq!(
            s.failed(at(2, "ValueError", Some(Progress::Step(Some(4))))),
            None
        );
        let g = s.failed(at(3, "ValueError", STEP5)).expect("a stop");
        assert_eq!(
            (g.base, g.first, g.last, g.best),
            (0, 1, 3, Progress::Step(Some(5)))
        );
        assert_eq!(
            g.why(7),
            "attempts 1-3 failed the same way as attempt 0 (rank 1: ValueError at train.py:12) \
             with no progress past step 5; restarting cannot help (--max-no-progress-restarts \
             3; 7 restarts were left)"
        );
    }

    #[test]
    fn progress_a_new_failure_or_an_unknown_measure_starts_anew() {
        // More progress each time: never.
        let mut s = Streak::new(2);
        for (i, step) in [5, 7, 9, 11, 13].into_iter().enumerate() {
            let f = at(i as u32, "ValueError", Some(Progress::Step(Some(step))));
            assert_eq!(s.failed(f), None);
            assert_eq!(s.count(), 0);
        }
        // Another exception each time: never.
        let mut s = Streak::new(2);
        for (i, what) in ["ValueError", "KeyError", "ValueError", "KeyError"]
            .into_iter()
            .enumerate()
        {
            assert_eq!(s.failed(at(i as u32, what, STEP5)), None);
        }
        // Progress not known, or in another measure: never counted.
        let mut s = Streak::new(1);
        assert_eq!(s.failed(at(0, "ValueError", None)), None);
        assert_eq!(s.failed(at(1, "ValueError", None)), None);
        assert_eq!(s.failed(at(2, "ValueError", STEP5)), None);
        let c = Some(Progress::Collectives(5));
        assert_eq!(s.failed(at(3, "ValueError", c)), None);
        assert!(s.failed(at(4, "ValueError", c)).is_some());
        // Off: never; a reset in between: counted from there.
        let mut s = Streak::new(0);
        for i in 0..5 {
            assert_eq!(s.failed(at(i, "ValueError", STEP5)), None);
        }
        assert_eq!(s.count(), 4);
        let mut s = Streak::new(2);
        s.failed(at(0, "ValueError", STEP5));
        s.failed(at(1, "ValueError", STEP5));
        s.reset();
        assert_eq!(s.failed(at(2, "ValueError", STEP5)), None);
        assert_eq!(s.failed(at(3, "ValueError", STEP5)), None);
        let g = s.failed(at(4, "ValueError", STEP5)).expect("a stop");
        assert_eq!((g.base, g.first, g.last), (2, 3, 4));
    }

    #[test]
    fn progress_is_the_pattern_s_where_read_else_the_flight_recorders() {
        let r = [failed(0, TB, Some(5)), failed(1, TB, Some(7)), None];
        assert_eq!(
            progress(&r, Some(true), Some(40)),
            Some(Progress::Step(Some(7)))
        );
        assert_eq!(progress(&r, Some(false), None), Some(Progress::Marks(8)));
        let unread = [failed(0, TB, None)];
        assert_eq!(progress(&unread, Some(true), None), None);
        assert_eq!(
            progress(&unread, Some(true), Some(40)),
            Some(Progress::Collectives(40))
        );
        assert_eq!(progress(&r, None, None), None);
        // No step printed: none where every node reported, unknown where one did not (its
        // workers, stopped by nrun, may be the ones that print).
        let silent = |rank| {
            let mut f = failed(rank, TB, Some(0));
            if let Some(StepResult::Run(RunResult::Failed(w))) = &mut f {
                w.progress = Some(Box::new(nrun_node::output::Progress::default()));
            }
            f
        };
        let all = [silent(0), silent(1)];
        assert_eq!(progress(&all, Some(true), None), Some(Progress::Step(None)));
        assert_eq!(progress(&all, Some(false), None), Some(Progress::Marks(0)));
        let stopped = [Some(StepResult::Run(RunResult::Stopped)), silent(1)];
        assert_eq!(progress(&stopped, Some(true), None), None);
        let printed = [
            Some(StepResult::Run(RunResult::Stopped)),
            failed(1, TB, Some(5)),
        ];
        assert_eq!(
            progress(&printed, Some(true), None),
            Some(Progress::Step(Some(5)))
        );
    }
}
