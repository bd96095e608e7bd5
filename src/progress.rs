//! Progress of long work, one mechanism for every step that can take more than a few seconds
//! (nodes joining, shipping nrun, the preflight's sizes, bisect's rounds, a c10d host waiting
//! for its nodes): a live bar on a terminal; one plain line per stage elsewhere (stderr not a
//! terminal, `NO_COLOR`, `TERM=dumb`); and for any wait past [`FIRST_WAIT`] a line saying what
//! it waits for and until when (a clock time and "in N s"), repeated at a growing interval so
//! that a long wait is heard without flooding a log.

use std::time::{Duration, Instant, SystemTime};

/// When a wait is first said.
pub(crate) const FIRST_WAIT: Duration = Duration::from_secs(5);
/// The longest gap between two "still waiting" lines.
const MAX_GAP: Duration = Duration::from_secs(30);
/// When a bar is first drawn.
const SHOW_AFTER: Duration = Duration::from_secs(1);
/// How often a terminal's bar message is recomputed (the waited-for list may be long).
const REDRAW: Duration = Duration::from_millis(500);

/// Whether progress is drawn live: stderr is a terminal, and neither `NO_COLOR` (set, not empty)
/// nor `TERM=dumb` asks for plain text, and nrun's log lines are not silenced.
pub(crate) fn live() -> bool {
    live_in(std::io::IsTerminal::is_terminal(&std::io::stderr()), &|k| {
        std::env::var(k).ok()
    }) && !nrun_base::logging_silenced()
        && tracing::enabled!(tracing::Level::INFO)
}

fn live_in(terminal: bool, env: &dyn Fn(&str) -> Option<String>) -> bool {
    terminal
        && env("NO_COLOR").is_none_or(|v| v.is_empty())
        && env("TERM").is_none_or(|v| v != "dumb")
}

/// One piece of long work: `done` of `total` (no total: a wait with nothing to count).
pub(crate) struct Progress {
    what: String,
    /// Whether a bar is drawn here ([`live`]); it is made once the work took a second.
    live: bool,
    total: Option<u64>,
    done: u64,
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    deadline: Option<Instant>,
    /// When the next "still waiting" line is due (since `started`), and the gap after it.
    next_wait: Duration,
    gap: Duration,
    drawn: Option<Instant>,
}

impl Progress {
    /// Progress of `what` ("joining nodes"), `total` steps, until `deadline` if there is one.
    pub(crate) fn new(what: &str, total: Option<u64>, deadline: Option<Instant>) -> Progress {
        Self::drawn(what, total, deadline, live())
    }

    fn drawn(what: &str, total: Option<u64>, deadline: Option<Instant>, live: bool) -> Progress {
        Progress {
            what: what.to_string(),
            live,
            total,
            done: 0,
            bar: None,
            started: Instant::now(),
            deadline,
            next_wait: FIRST_WAIT,
            gap: FIRST_WAIT,
            drawn: None,
        }
    }

    /// Draws the bar once the work took [`SHOW_AFTER`]: a quick step flashes no bar.
    fn show(&mut self) {
        if !self.live || self.bar.is_some() || self.started.elapsed() < SHOW_AFTER {
            return;
        }
        let (b, template) = match self.total {
            Some(n) => (
                indicatif::ProgressBar::new(n),
                "nrun: {prefix} {bar:20} {pos}/{len} {elapsed} {msg}",
            ),
            None => (
                indicatif::ProgressBar::new_spinner(),
                "nrun: {prefix} {spinner} {elapsed} {msg}",
            ),
        };
        b.set_style(
            indicatif::ProgressStyle::with_template(template)
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_prefix(self.what.clone());
        // Its clock counts from the work's start, not from the first draw.
        let b = b.with_elapsed(self.started.elapsed());
        b.set_position(self.done);
        b.enable_steady_tick(Duration::from_millis(200));
        self.bar = Some(b);
    }

    /// The bar is cleared (the work goes on without it: a c10d node that found its host).
    pub(crate) fn clear(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }

    /// Whether a bar is drawn (else plain lines are written).
    pub(crate) fn is_live(&self) -> bool {
        self.live
    }

    /// `done` steps are done.
    pub(crate) fn set(&mut self, done: u64) {
        self.done = done;
        self.show();
        if let Some(b) = &self.bar {
            b.set_position(done);
        }
    }

    /// The wait now ends at `deadline` (an elastic job's last call).
    pub(crate) fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = Some(deadline);
    }

    /// A line for a stage that ended: above the bar on a terminal, a log line elsewhere.
    pub(crate) fn line(&self, text: &str) {
        match &self.bar {
            Some(b) => b.suspend(|| tracing::info!("{text}")),
            None => tracing::info!("{text}"),
        }
    }

    /// Called as the work waits (at least once a second): on a terminal, the bar says what it
    /// waits for (`waits_for`, computed only when it is shown); elsewhere, once the wait passed
    /// [`FIRST_WAIT`], a line "still waiting for ... after N s; deadline HH:MM:SS (in N s)",
    /// again 10, 20, then every 30 s later.
    pub(crate) fn waiting(&mut self, waits_for: impl FnOnce() -> String) {
        self.show();
        let now = Instant::now();
        let waited = now - self.started;
        match &self.bar {
            Some(b) if waited >= SHOW_AFTER && self.drawn.is_none_or(|t| now - t >= REDRAW) => {
                self.drawn = Some(now);
                b.set_message(format!("waiting for {}{}", waits_for(), self.until(now)));
            }
            Some(_) => {}
            None if !self.live && waited >= self.next_wait => {
                let what = waits_for();
                tracing::info!(
                    "{}: still waiting for {what} after {} s{}",
                    self.what,
                    waited.as_secs(),
                    self.until(now)
                );
                self.gap = (self.gap * 2).min(MAX_GAP);
                // On the schedule (5, 15, 35 s...), not drifting with when the line came.
                self.next_wait = match self.next_wait + self.gap {
                    t if t > waited => t,
                    _ => waited + self.gap,
                };
            }
            None => {}
        }
    }

    /// "; deadline 21:04:05 (in 25 s)", or nothing without a deadline.
    fn until(&self, now: Instant) -> String {
        self.deadline.map_or(String::new(), |d| {
            let left = d.saturating_duration_since(now);
            format!(
                "; deadline {} (in {} s)",
                clock(SystemTime::now() + left),
                left.as_secs_f64().ceil() as u64
            )
        })
    }

    /// Runs `work` to its end, calling `tick` with this progress every quarter second
    /// meanwhile (to count what came, and to say what it still waits for).
    pub(crate) async fn during<F: std::future::Future>(
        &mut self,
        work: F,
        mut tick: impl FnMut(&mut Progress),
    ) -> F::Output {
        tokio::pin!(work);
        let mut every = tokio::time::interval(Duration::from_millis(250));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                out = &mut work => return out,
                _ = every.tick() => tick(self),
            }
        }
    }

    /// The work ended: the bar is cleared, and `line` (if any) said.
    pub(crate) fn finish(self, line: Option<&str>) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
        if let Some(l) = line {
            tracing::info!("{l}");
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // A bar left behind by an early return (an error, a signal) is not left drawn.
        if let Some(b) = self.bar.as_ref().filter(|b| !b.is_finished()) {
            b.finish_and_clear();
        }
    }
}

/// `t` as this machine's local clock time, HH:MM:SS.
pub(crate) fn clock(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as libc::time_t;
    // SAFETY: tm is a plain C struct, valid all zeroes.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: localtime_r writes only into `tm`, a plain struct of ours.
    let ok = !unsafe { libc::localtime_r(&secs, &mut tm) }.is_null();
    match ok {
        true => format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec),
        false => format!("{secs} s since the epoch"),
    }
}

/// `names` as a short list: the first few, then how many more ("a, b, c and 12 more").
pub(crate) fn few(names: &[String]) -> String {
    match names.is_empty() {
        true => "nothing".to_string(),
        false => nrun_base::few(names, 4),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_only_on_a_terminal_without_no_color_or_a_dumb_term() {
        let none = |_: &str| None;
        assert!(live_in(true, &none));
        assert!(!live_in(false, &none));
        let no_color = |k: &str| (k == "NO_COLOR").then(|| "1".to_string());
        assert!(!live_in(true, &no_color));
        let empty = |k: &str| (k == "NO_COLOR").then(String::new);
        assert!(live_in(true, &empty));
        let dumb = |k: &str| (k == "TERM").then(|| "dumb".to_string());
        assert!(!live_in(true, &dumb));
    }

    #[test]
    fn waits_are_said_after_five_seconds_then_at_growing_gaps() {
        let mut p = Progress::drawn("joining nodes", Some(3), None, false);
        let mut said = Vec::new();
        // As if the wait were at each second of the first two minutes.
        for s in 0..120u64 {
            p.started = Instant::now() - Duration::from_secs(s);
            let mut asked = false;
            p.waiting(|| {
                asked = true;
                "b".into()
            });
            if asked {
                said.push(s);
            }
        }
        assert_eq!(said, [5, 15, 35, 65, 95]);
    }

    #[test]
    fn the_deadline_reads_as_a_clock_time_and_seconds_left() {
        let p = Progress::drawn(
            "x",
            None,
            Some(Instant::now() + Duration::from_secs(25)),
            false,
        );
        let u = p.until(Instant::now());
        assert!(u.starts_with("; deadline "), "{u}");
        assert!(u.ends_with("(in 25 s)"), "{u}");
        assert_eq!(
            clock(SystemTime::UNIX_EPOCH + Duration::from_secs(3)).len(),
            8
        );
    }

    #[test]
    fn long_lists_are_cut() {
        let n = |k: usize| (0..k).map(|i| format!("n{i}")).collect::<Vec<_>>();
        assert_eq!(few(&n(2)), "n0, n1");
        assert_eq!(few(&n(4)), "n0, n1, n2, n3");
        assert_eq!(few(&n(10)), "n0, n1, n2 and 7 more");
    }
}
