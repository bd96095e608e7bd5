//! The job's journal: one timestamped stream of events (schema: the `events` of `--report`,
//! the lines of `--events`), and the phase the job is in. The goodput ledger is derived from
//! the phase transitions alone: every moment since nrun started is charged to exactly one
//! phase, so the phases add up to the wall time by construction, per attempt and in total.
//!
//! Consumers of the one stream: `--report`'s `ledger` and `events` ([`Journal::finish`]),
//! `--events PATH` (a JSON line per event, flushed as it happens), the metrics
//! ([`metrics`]: `--metrics-file`, `--metrics-port`) and the one summary line at the job's end.
//! The journal decides nothing: it only records what the session and the job command did.

mod event;
pub(crate) mod metrics;
mod phase;

pub(crate) use event::{Body, Event, EventRecord, Outcome, Seen};

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use crate::watch::{Finding, WatchState};

/// nrun's start (the ledger's zero), as an instant and in ms since the Unix epoch.
static START: OnceLock<(Instant, u64)> = OnceLock::new();

/// Marks nrun's start: called first thing in `main`, so launch time includes the plan's.
pub(crate) fn mark_start() {
    start();
}

fn start() -> (Instant, u64) {
    *START.get_or_init(|| (Instant::now(), crate::protocol::unix_ms()))
}

/// Seconds since nrun started.
pub(crate) fn now_s() -> f64 {
    start().0.elapsed().as_secs_f64()
}

/// Where the journal's consumers write (the job's flags; resolved and checked by the plan).
#[derive(Clone, Debug, Default)]
pub(crate) struct JournalPlan {
    /// `--events PATH`: a JSON line per event, appended.
    pub events: Option<PathBuf>,
    /// `--metrics-file PATH`: OpenMetrics text, replaced every few seconds.
    pub metrics_file: Option<PathBuf>,
    /// `--metrics-port [ADDR:]PORT`: the same text over HTTP, as given and as the address.
    pub metrics_port: Option<(String, std::net::SocketAddr)>,
}

pub(crate) use phase::{AttemptReport, LedgerReport, Phase, PhaseTimes};

/// Seconds spent in each phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Phases([f64; Phase::ALL.len()]);

impl Phases {
    pub(crate) fn get(&self, p: Phase) -> f64 {
        self.0[p as usize]
    }

    fn add(&mut self, p: Phase, s: f64) {
        self.0[p as usize] += s;
    }

    pub(crate) fn sum(&self) -> f64 {
        self.0.iter().sum()
    }

    /// The report's seconds per phase, to the microsecond.
    fn times(&self) -> PhaseTimes {
        Phase::ALL
            .iter()
            .map(|p| (*p, round6(self.get(*p))))
            .collect()
    }
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// Seconds to the microsecond: the phases' sum stays within rounding of the wall time.
fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// One worker group's time.
#[derive(Clone, Debug)]
struct AttemptTime {
    attempt: u32,
    start_s: f64,
    end_s: Option<f64>,
    outcome: Option<Outcome>,
    phases: Phases,
    /// Output or progress was seen (the move from starting to running happened).
    progressed: bool,
}

/// The ledger: the current phase since when, and the seconds charged to each phase so far.
#[derive(Clone, Debug)]
pub(crate) struct Ledger {
    phase: Phase,
    since: f64,
    total: Phases,
    attempts: Vec<AttemptTime>,
    restarts: u32,
    /// Set by [`Ledger::finish`]: the job's end (the wall time).
    ended: Option<f64>,
    /// How the job ended: its exit code and outcome ("interrupted", "not started", ...), once
    /// known ([`Journal::finish`]).
    exit: Option<(u8, String)>,
    /// Nodes left out of the job, as last told ([`Journal::nodes`]).
    left_out: usize,
    /// The epoch at which this nrun took over hosting a c10d job whose host was lost (its
    /// record starts there: the loss was a fault, not "no faults").
    took_over: Option<u64>,
}

impl Default for Ledger {
    fn default() -> Ledger {
        Ledger {
            phase: Phase::Launch,
            since: 0.0,
            total: Phases::default(),
            attempts: Vec::new(),
            restarts: 0,
            ended: None,
            exit: None,
            left_out: 0,
            took_over: None,
        }
    }
}

impl Ledger {
    fn open(&mut self) -> Option<&mut AttemptTime> {
        self.attempts.last_mut().filter(|a| a.end_s.is_none())
    }

    /// Charges the time since the last transition to the current phase (and open attempt).
    fn charge(&mut self, now: f64) {
        let dt = (now - self.since).max(0.0);
        let p = self.phase;
        self.total.add(p, dt);
        if let Some(a) = self.open() {
            a.phases.add(p, dt);
        }
        self.since = now.max(self.since);
    }

    /// Enters phase `p` at `now`. False: already in it.
    pub(crate) fn enter(&mut self, p: Phase, now: f64) -> bool {
        if self.ended.is_some() || p == self.phase {
            return false;
        }
        self.charge(now);
        self.phase = p;
        true
    }

    /// Moves up to `secs` already charged to `from` in the open attempt (and the total) to `to`:
    /// a hang's stall was spent detecting it, not running.
    fn shift(&mut self, from: Phase, to: Phase, secs: f64) {
        let Some(a) = self.open() else {
            return;
        };
        let s = secs.min(a.phases.get(from)).max(0.0);
        a.phases.add(from, -s);
        a.phases.add(to, s);
        self.total.add(from, -s);
        self.total.add(to, s);
    }

    /// A worker group starts at `now`.
    pub(crate) fn start_attempt(&mut self, attempt: u32, now: f64) {
        self.enter(Phase::Starting, now);
        self.charge(now);
        self.attempts.push(AttemptTime {
            attempt,
            start_s: now,
            end_s: None,
            outcome: None,
            phases: Phases::default(),
            progressed: false,
        });
    }

    /// The first output or progress of the open attempt: starting -> running. False: the
    /// attempt had already progressed (or none is open, or it is past starting).
    pub(crate) fn progress(&mut self, now: f64) -> bool {
        match self.open() {
            Some(a) if !a.progressed => a.progressed = true,
            _ => return false,
        }
        self.phase == Phase::Starting && self.enter(Phase::Running, now)
    }

    /// The open attempt ends at `now` (its phase goes on outside it until the next one).
    pub(crate) fn end_attempt(&mut self, outcome: Outcome, now: f64) {
        self.charge(now);
        let Some(a) = self.open() else {
            return;
        };
        // Nothing was seen of the workers before the attempt ended: its time counts as
        // running from its start (nrun cannot tell their start-up from their work).
        if !a.progressed {
            let s = a.phases.get(Phase::Starting);
            a.phases.add(Phase::Starting, -s);
            a.phases.add(Phase::Running, s);
            self.total.add(Phase::Starting, -s);
            self.total.add(Phase::Running, s);
        }
        if let Some(a) = self.open() {
            a.outcome = Some(outcome);
            a.end_s = Some(now);
        }
    }

    /// The job ends at `now`: the last phase is charged and the ledger closes.
    pub(crate) fn finish(&mut self, now: f64) {
        if self.ended.is_none() {
            if self.open().is_some() {
                self.end_attempt(Outcome::Interrupted, now);
            }
            self.charge(now);
            self.ended = Some(now);
        }
    }

    /// The totals at `now`, the open phase's time included.
    pub(crate) fn totals(&self, now: f64) -> Phases {
        let mut t = self.total;
        if self.ended.is_none() {
            t.add(self.phase, (now - self.since).max(0.0));
        }
        t
    }

    fn wall(&self, now: f64) -> f64 {
        self.ended.unwrap_or(now)
    }

    /// What faults cost: detecting, stopping, restarting, waiting for nodes, and the start-up
    /// of every worker group after the first (the first one's is the job's own cost).
    pub(crate) fn lost(&self, now: f64) -> f64 {
        let t = self.totals(now);
        let later_starts: f64 = self
            .attempts
            .iter()
            .skip(1)
            .map(|a| a.phases.get(Phase::Starting))
            .sum();
        [
            Phase::Detecting,
            Phase::Stopping,
            Phase::Restarting,
            Phase::Waiting,
        ]
        .iter()
        .map(|p| t.get(*p))
        .sum::<f64>()
            + later_starts
    }

    /// Running over wall (0 for a job that took no time).
    pub(crate) fn effective(&self, now: f64) -> f64 {
        let wall = self.wall(now);
        match wall > 0.0 {
            true => self.totals(now).get(Phase::Running) / wall,
            false => 0.0,
        }
    }

    /// The one line said at the job's end (without "nrun: ").
    pub(crate) fn summary(&self, now: f64) -> String {
        let lost = self.lost(now);
        let restarts = match self.restarts {
            0 => String::new(),
            1 => "1 restart, ".to_string(),
            n => format!("{n} restarts, "),
        };
        // A job without a fault says so in other words: "lost" on a console means a node.
        let faulted = self.restarts > 0
            || self
                .attempts
                .iter()
                .any(|a| a.outcome.is_some_and(Outcome::is_fault));
        // "no faults" only where there were none: no failure, no node left out, exit 0.
        let lost = match (faulted, &self.exit, self.left_out) {
            (true, _, _) => format!("lost: {restarts}{}", nrun_base::duration_text(lost)),
            (false, Some((code, outcome)), _) if *code != 0 => format!("{outcome}, exit {code}"),
            (false, _, 0) => match self.took_over {
                None => "no faults".to_string(),
                Some(e) => format!(
                    "no faults since this node took over hosting (epoch {e}: the host before \
                     was lost)"
                ),
            },
            (false, _, 1) => "1 node left out (see above)".to_string(),
            (false, _, n) => format!("{n} nodes left out (see above)"),
        };
        format!(
            "ran {}, {:.1}% of it training; {lost}",
            nrun_base::duration_text(self.wall(now)),
            100.0 * self.effective(now)
        )
    }

    /// `--report`'s `ledger`.
    pub(crate) fn report(&self, now: f64) -> LedgerReport {
        let attempts = self
            .attempts
            .iter()
            .map(|a| AttemptReport {
                attempt: a.attempt,
                start_s: round6(a.start_s),
                end_s: round6(a.end_s.unwrap_or(now)),
                outcome: a.outcome.map_or("running", Outcome::as_str).to_string(),
                phases: a.phases.times(),
            })
            .collect();
        LedgerReport {
            wall_s: round6(self.wall(now)),
            phases: self.totals(now).times(),
            effective: (self.effective(now) * 1e4).round() / 1e4,
            attempts,
            restarts: self.restarts,
            lost_s: round6(self.lost(now)),
            summary: self.summary(now),
        }
    }
}

/// An event as the journal recorded it: when, in which attempt.
struct Stamped {
    event: Event,
    /// Seconds since nrun started.
    t: f64,
    attempt: Option<u32>,
}

impl Stamped {
    /// The event's line of `--events` (an element of `--report`'s `events`).
    fn record(self, run_id: &str) -> EventRecord {
        let node = self.event.node().map(|(i, h)| (i, h.to_string()));
        EventRecord {
            run_id: run_id.to_string(),
            source: self.event.source().to_string(),
            timestamp: Some(start().1 + (self.t * 1000.0) as u64),
            t: Some(round3(self.t)),
            attempt: self.attempt,
            node: node.as_ref().map(|n| n.0),
            host: node.map(|n| n.1),
            rank: self.event.rank(),
            message: self.event.message(),
            body: Body::Known(self.event),
        }
    }

    /// The line as JSON.
    #[cfg(test)]
    fn json(self, run_id: &str) -> serde_json::Value {
        serde_json::to_value(self.record(run_id)).unwrap_or_default()
    }
}

/// An event's line of `--events`.
fn line(e: &EventRecord) -> String {
    serde_json::to_string(e).unwrap_or_default()
}

/// The session's journal (see the module's doc).
pub(crate) struct Journal {
    run_id: String,
    ledger: Arc<Mutex<Ledger>>,
    events: Vec<EventRecord>,
    /// `--events`: the file and its path (for the warning when a write fails).
    sink: Option<(PathBuf, nrun_base::outputs::OutFile)>,
    metrics: Option<metrics::Exporter>,
    attempt: Option<u32>,
    /// When the metrics last took the watch's per-rank figures.
    ranks_at: Option<Instant>,
}

impl Journal {
    /// The journal of a session; the ledger starts in `launch` at nrun's start.
    pub(crate) fn new(run_id: &str) -> Journal {
        Journal {
            run_id: run_id.to_string(),
            ledger: Arc::default(),
            events: Vec::new(),
            sink: None,
            metrics: None,
            attempt: None,
            ranks_at: None,
        }
    }

    /// Starts the consumers the job asked for: the events file (opened for appending), the
    /// metrics file's writer and the metrics port's server (on `listener`, bound earlier).
    /// The plan checked the paths; a failure now is said and the job goes on without it.
    pub(crate) fn attach(&mut self, plan: &JournalPlan, listener: Option<std::net::TcpListener>) {
        if let Some(p) = &plan.events {
            // A FIFO's reader that stalls must not stall the job: a line it does not take
            // within a second ends the events there (said).
            match nrun_base::outputs::append(p)
                .map(|f| f.patience(std::time::Duration::from_secs(1)))
            {
                Ok(f) => self.sink = Some((p.clone(), f)),
                Err(e) => tracing::warn!("--events {}: cannot open it: {e}", p.display()),
            }
        }
        if plan.metrics_file.is_some() || listener.is_some() {
            let m =
                metrics::Exporter::start(self.ledger.clone(), plan.metrics_file.clone(), listener);
            m.phase(self.phase().key());
            self.metrics = Some(m);
        }
        // The events recorded before (the session's start) go out first, in order.
        if let Some(m) = &self.metrics {
            for e in self.events.iter().filter_map(EventRecord::event) {
                m.event(e);
            }
        }
        let earlier: Vec<String> = self.events.iter().map(line).collect();
        for line in earlier {
            self.write_line(line);
        }
    }

    /// This nrun took over hosting a c10d job at `epoch` (its host was lost).
    pub(crate) fn took_over(&self, epoch: u64) {
        self.lock().took_over = Some(epoch);
    }

    /// The nodes in the job, left out and spare now (the metrics).
    pub(crate) fn nodes(&self, active: usize, left_out: usize, spares: usize) {
        self.lock().left_out = left_out;
        if let Some(m) = &self.metrics {
            m.nodes(active, left_out, spares);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The phase the job is in.
    pub(crate) fn phase(&self) -> Phase {
        self.lock().phase
    }

    /// Enters phase `p` (an event when it changes).
    pub(crate) fn enter(&mut self, p: Phase) {
        let now = now_s();
        if self.lock().enter(p, now) {
            self.stamp(Event::Phase { phase: p }, now);
            if let Some(m) = &self.metrics {
                m.phase(p.key());
            }
        }
    }

    /// Records `e` now.
    pub(crate) fn emit(&mut self, e: Event) {
        self.stamp(e, now_s());
    }

    fn stamp(&mut self, event: Event, t: f64) {
        if let Some(m) = &self.metrics {
            m.event(&event);
        }
        let e = Stamped {
            event,
            t,
            attempt: self.attempt,
        }
        .record(&self.run_id);
        if self.sink.is_some() {
            self.write_line(line(&e));
        }
        self.events.push(e);
    }

    /// One line to `--events`: one write, unbuffered, so `tail -f` sees it at once.
    fn write_line(&mut self, mut line: String) {
        let Some((path, f)) = &mut self.sink else {
            return;
        };
        line.push('\n');
        if let Err(err) = f.write_all(line.as_bytes()) {
            tracing::warn!(
                "--events {}: cannot write to it ({err}); no more events go there",
                path.display()
            );
            self.sink = None;
        }
    }

    /// A worker group starts: attempt `attempt` (a `phase` and an `attempt_start` event).
    pub(crate) fn attempt_start(&mut self, attempt: u32, world: usize, hosts: Vec<String>) {
        let now = now_s();
        nrun_base::activity::arm();
        self.attempt = Some(attempt);
        self.lock().start_attempt(attempt, now);
        if let Some(m) = &self.metrics {
            m.phase(Phase::Starting.key());
        }
        self.stamp(
            Event::Phase {
                phase: Phase::Starting,
            },
            now,
        );
        self.stamp(
            Event::AttemptStart {
                attempt,
                world_size: world,
                nodes: hosts,
            },
            now,
        );
    }

    /// The attempt ended (its results are in).
    pub(crate) fn attempt_end(&mut self, outcome: Outcome, exit_code: u8) {
        let now = now_s();
        self.lock().end_attempt(outcome, now);
        self.stamp(Event::AttemptEnd { outcome, exit_code }, now);
    }

    /// A restart was decided: the `restart` event, and the ledger's count.
    pub(crate) fn restart(&mut self, restart_count: u32) {
        self.lock().restarts = restart_count;
        self.enter(Phase::Restarting);
        self.emit(Event::Restart { restart_count });
    }

    /// Looked at from the step's wait (often): the first output line or sign of progress moves
    /// the attempt from starting to running; the watch's new hangs and stragglers become events;
    /// the metrics get the per-rank figures (once a second).
    pub(crate) fn tick(&mut self, mut watch: Option<&mut WatchState>, hosts: &[String]) {
        if let Some(w) = watch.as_deref_mut() {
            self.watch_findings(w, hosts);
        }
        self.see_progress(watch.as_deref());
    }

    /// Starting -> running at the first output line or sign of progress.
    fn see_progress(&mut self, watch: Option<&WatchState>) {
        if self.phase() != Phase::Starting {
            return;
        }
        let output = nrun_base::activity::first_line_ms();
        let progressed = watch.is_some_and(WatchState::progressed);
        if output.is_some() || progressed {
            // The line's own time where one came first (the wait looks every 50 ms at most).
            let now = now_s();
            let at = output.map_or(now, |ms| {
                (ms.saturating_sub(start().1) as f64 / 1e3).min(now)
            });
            let seen = match output {
                Some(_) => Seen::Output,
                None => Seen::Progress,
            };
            if self.lock().progress(at) {
                self.stamp(
                    Event::Phase {
                        phase: Phase::Running,
                    },
                    at,
                );
                self.stamp(Event::FirstProgress { seen }, at);
                if let Some(m) = &self.metrics {
                    m.phase(Phase::Running.key());
                }
            }
        }
    }

    /// The watch's new hangs and stragglers become events; per-rank figures for the metrics.
    fn watch_findings(&mut self, w: &mut WatchState, hosts: &[String]) {
        for f in w.take_found() {
            self.emit(match &f {
                Finding::Hang(d) => Event::hang(d),
                Finding::Straggler(st) => Event::straggler(st),
            });
        }
        if let Some(m) = &self.metrics
            && self
                .ranks_at
                .is_none_or(|t| t.elapsed().as_secs_f64() >= 1.0)
        {
            self.ranks_at = Some(Instant::now());
            m.ranks(&w.rank_figures(hosts));
        }
    }

    /// A fault was seen (a failure's result, or a hang that stops the job): the time of the
    /// stall (`stalled_s`, a hang's) was spent detecting it; the job is detecting until nrun
    /// stops the group.
    pub(crate) fn fault(&mut self, stalled_s: f64) {
        if !self.phase().in_attempt() {
            return;
        }
        // Output that came before the fault was seen moved the attempt to running first.
        self.see_progress(None);
        let now = now_s();
        let mut l = self.lock();
        let from = l.phase;
        let entered = l.enter(Phase::Detecting, now);
        if entered && stalled_s > 0.0 {
            l.shift(from, Phase::Detecting, stalled_s);
        }
        drop(l);
        if entered {
            self.stamp(
                Event::Phase {
                    phase: Phase::Detecting,
                },
                now,
            );
            if let Some(m) = &self.metrics {
                m.phase(Phase::Detecting.key());
            }
        }
    }

    /// The watch stops the job for a hang just found (or a collective mismatch): the stall
    /// before the hang was called was spent detecting it.
    pub(crate) fn hang_stops(&mut self, watch: Option<&WatchState>) {
        let new = watch.and_then(|w| {
            w.found().iter().rev().find_map(|f| match f {
                Finding::Hang(d) => Some(d.stalled_s),
                Finding::Straggler(_) => None,
            })
        });
        self.fault(new.unwrap_or(0.0));
    }

    /// The worker group is being stopped (a fault, a signal, nodes arriving).
    pub(crate) fn stopping(&mut self) {
        if self.phase().in_attempt() {
            self.enter(Phase::Stopping);
        }
    }

    /// The job ended with `code`: the ledger closes, `job_end` is recorded and the metrics
    /// written one last time. Returns `--report`'s `ledger` and `events` (the last one the
    /// `job_end` that the console's end line is said from: [`Event::end_line`]).
    pub(crate) fn finish(&mut self, code: u8, outcome: &str) -> (LedgerReport, Vec<EventRecord>) {
        let now = now_s();
        self.enter(Phase::Ending);
        let summary = {
            let mut l = self.lock();
            l.exit = Some((code, outcome.to_string()));
            l.finish(now);
            l.summary(now)
        };
        self.attempt = None;
        self.stamp(
            Event::JobEnd {
                exit_code: code,
                outcome: outcome.to_string(),
                summary,
            },
            now,
        );
        if let Some(m) = self.metrics.take() {
            m.finish(outcome, code);
        }
        let ledger = self.lock().report(now);
        (ledger, std::mem::take(&mut self.events))
    }
}

#[cfg(test)]
mod tests;
