//! The journal's metrics in OpenMetrics text (encoded by `prometheus-client`): written to
//! `--metrics-file` (the node-exporter textfile collector's way: a temporary file renamed over
//! it, every few seconds and at the end) and served on `--metrics-port` at `/metrics` by a tiny
//! HTTP responder. All are gauges (attempts and restarts too: promtool's classic text parser
//! wants a counter's HELP under its `_total` name, which OpenMetrics puts on the family's name);
//! they move with the journal's events; the ledger's seconds are
//! read from the ledger itself at each encoding, so a scrape sees the open phase's time too.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::{Event, Ledger, Phase, now_s};
use crate::watch::RankFigure;
use nrun_base::error::{Error, Result};

/// How often `--metrics-file` is replaced while the job runs.
const FILE_EVERY: Duration = Duration::from_secs(5);
/// `--metrics-port`'s connections held at once: one more closes the oldest, so connections that
/// never finish a request cannot keep a scraper out.
const CONNECTIONS: usize = 64;

type Labels = Vec<(String, String)>;
type FGauge = Gauge<f64, AtomicU64>;

/// The states `nrun_job_state` has a series for: the phases, then how a job ends.
const ENDS: [&str; 5] = ["success", "failed", "hang", "interrupted", "not started"];

#[derive(Default)]
struct Metrics {
    state: Family<Labels, Gauge>,
    attempts: Gauge,
    restarts: Gauge,
    nodes: Family<Labels, Gauge>,
    rank_age: Family<Labels, FGauge>,
    rank_wait: Family<Labels, FGauge>,
    busbw: Family<Labels, FGauge>,
    /// No labels: a family only so that it is absent until a line rate is known.
    line_rate: Family<Labels, FGauge>,
    ledger: Family<Labels, FGauge>,
    wall: FGauge,
    effective: FGauge,
    lost: FGauge,
    exit_code: Gauge,
}

struct Shared {
    registry: Registry,
    m: Metrics,
    ledger: Arc<Mutex<Ledger>>,
    /// The per-rank series set last.
    rank_labels: Mutex<std::collections::HashSet<Labels>>,
    /// `--metrics-file`'s writes, one at a time.
    file: Mutex<FileState>,
}

#[derive(Default)]
struct FileState {
    /// The last is written: a periodic write still under way then must not replace it.
    ended: bool,
    /// A write failed (said once, and once when one works again).
    failing: bool,
}

/// The metrics of one job, and the tasks that publish them.
pub(crate) struct Exporter {
    shared: Arc<Shared>,
    file: Option<PathBuf>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn label(k: &str, v: impl ToString) -> Labels {
    vec![(k.to_string(), v.to_string())]
}

impl Metrics {
    fn register(&self, r: &mut Registry) {
        r.register(
            "nrun_job_state",
            "The job's state: 1 for the phase it is in, or how it ended",
            self.state.clone(),
        );
        r.register(
            "nrun_attempts",
            "Worker groups started so far",
            self.attempts.clone(),
        );
        r.register(
            "nrun_restarts",
            "Restarts of the worker group so far (after a failure or a hang)",
            self.restarts.clone(),
        );
        r.register(
            "nrun_nodes",
            "Nodes by state: in the job, left out, spare",
            self.nodes.clone(),
        );
        r.register_with_unit(
            "nrun_rank_last_progress_age",
            "Since when each rank's Python stack last moved (the watch's view)",
            Unit::Seconds,
            self.rank_age.clone(),
        );
        r.register(
            "nrun_rank_wait_ratio",
            "Share of the watch's samples each rank waited for its peers in collectives (0..1)",
            self.rank_wait.clone(),
        );
        r.register(
            "nrun_preflight_busbw_bytes_per_second",
            "The preflight's all-reduce bus bandwidth by message size (bytes)",
            self.busbw.clone(),
        );
        r.register(
            "nrun_preflight_line_rate_bytes_per_second",
            "The line rate the preflight compared the bus bandwidth against (absent: none)",
            self.line_rate.clone(),
        );
        r.register_with_unit(
            "nrun_ledger",
            "Wall time charged to each phase of the job",
            Unit::Seconds,
            self.ledger.clone(),
        );
        r.register_with_unit(
            "nrun_wall",
            "Time since nrun started (until the job's end)",
            Unit::Seconds,
            self.wall.clone(),
        );
        r.register(
            "nrun_effective_ratio",
            "Running time over wall time",
            self.effective.clone(),
        );
        r.register_with_unit(
            "nrun_lost",
            "Time faults cost (detecting, stopping, restarting, waiting)",
            Unit::Seconds,
            self.lost.clone(),
        );
        r.register(
            "nrun_exit_code",
            "nrun's exit code (-1 while the job runs)",
            self.exit_code.clone(),
        );
    }
}

impl Exporter {
    /// Registers the metrics and starts the file's writer and the port's server (on the tokio
    /// runtime the job runs on).
    pub(crate) fn start(
        ledger: Arc<Mutex<Ledger>>,
        file: Option<PathBuf>,
        listener: Option<std::net::TcpListener>,
    ) -> Exporter {
        let m = Metrics::default();
        let mut registry = Registry::default();
        m.register(&mut registry);
        m.exit_code.set(-1);
        let shared = Arc::new(Shared {
            registry,
            m,
            ledger,
            rank_labels: Mutex::default(),
            file: Mutex::default(),
        });
        set_state(&shared.m, Phase::Launch.key());
        let mut tasks = Vec::new();
        if let Some(path) = file.clone() {
            let sh = shared.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    // Off the runtime's threads: a stalled filesystem holds up only this.
                    let (sh, path) = (sh.clone(), path.clone());
                    let _ =
                        tokio::task::spawn_blocking(move || write_file(&sh, &path, false)).await;
                    tokio::time::sleep(FILE_EVERY).await;
                }
            }));
        }
        if let Some(l) = listener {
            match tokio::net::TcpListener::from_std(l) {
                Ok(l) => tasks.push(tokio::spawn(serve(l, shared.clone()))),
                Err(e) => tracing::warn!("--metrics-port: cannot serve it: {e}"),
            }
        }
        Exporter {
            shared,
            file,
            tasks,
        }
    }

    /// The OpenMetrics text now.
    #[cfg(test)]
    pub(crate) fn text(&self) -> String {
        render(&self.shared)
    }

    /// The job entered `state` (a phase's key).
    pub(crate) fn phase(&self, state: &str) {
        set_state(&self.shared.m, state);
    }

    /// An event's effect on the counters and gauges.
    pub(crate) fn event(&self, e: &Event) {
        let m = &self.shared.m;
        match e {
            Event::AttemptStart { .. } => {
                m.attempts.inc();
            }
            Event::Restart { .. } => {
                m.restarts.inc();
            }
            Event::PreflightSize {
                bytes,
                busbw_gbs,
                line_rate_gbs,
                ..
            } => {
                // The events say GB/s, as the console does; metrics are in base units.
                if let (Some(b), Some(bw)) = (bytes, busbw_gbs) {
                    m.busbw.get_or_create(&label("bytes", b)).set(bw * 1e9);
                }
                if let Some(r) = line_rate_gbs.filter(|r| *r > 0.0) {
                    m.line_rate.get_or_create(&Vec::new()).set(r * 1e9);
                }
            }
            _ => {}
        }
    }

    /// The nodes in the job, left out and spare now.
    pub(crate) fn nodes(&self, active: usize, left_out: usize, spares: usize) {
        let m = &self.shared.m;
        for (k, v) in [("in", active), ("left_out", left_out), ("spare", spares)] {
            m.nodes.get_or_create(&label("state", k)).set(v as i64);
        }
    }

    /// The watch's latest per-rank figures (replacing the previous ones): the current series
    /// are set first and only the ranks gone are removed, so a scrape never sees none.
    pub(crate) fn ranks(&self, figures: &[RankFigure]) {
        let m = &self.shared.m;
        let mut now = std::collections::HashSet::new();
        for r in figures {
            let l = vec![
                ("rank".to_string(), r.rank.to_string()),
                ("host".to_string(), r.host.clone()),
            ];
            m.rank_age.get_or_create(&l).set(r.progress_age_s);
            // No samples yet (a group just restarted): no figure, not the last attempt's.
            match r.wait_share {
                Some(w) => {
                    m.rank_wait.get_or_create(&l).set(w);
                }
                None => {
                    m.rank_wait.remove(&l);
                }
            }
            now.insert(l);
        }
        let mut known = self
            .shared
            .rank_labels
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for gone in known.difference(&now) {
            m.rank_age.remove(gone);
            m.rank_wait.remove(gone);
        }
        *known = now;
    }

    /// The job's end: the final state and exit code, the file written one last time, the
    /// server stopped.
    pub(crate) fn finish(self, outcome: &str, code: u8) {
        set_state(&self.shared.m, outcome);
        self.shared.m.exit_code.set(i64::from(code));
        for t in &self.tasks {
            t.abort();
        }
        if let Some(path) = &self.file {
            write_file(&self.shared, path, true);
        }
    }
}

/// One series per state, 1 for `now`.
fn set_state(m: &Metrics, now: &str) {
    for s in Phase::ALL.iter().map(|p| p.key()).chain(ENDS) {
        m.state
            .get_or_create(&label("state", s))
            .set(i64::from(s == now));
    }
}

/// The OpenMetrics text now: the ledger's figures are taken from the ledger first.
fn render(sh: &Shared) -> String {
    let now = now_s();
    {
        let l = sh.ledger.lock().unwrap_or_else(|e| e.into_inner());
        let t = l.totals(now);
        for p in Phase::ALL {
            sh.m.ledger
                .get_or_create(&label("phase", p.key()))
                .set(t.get(p));
        }
        sh.m.wall.set(t.sum());
        sh.m.effective.set(l.effective(now));
        sh.m.lost.set(l.lost(now));
    }
    let mut out = String::new();
    // Encoding into a String cannot fail.
    let _ = encode(&mut out, &sh.registry);
    out
}

/// Replaces `--metrics-file` with the metrics now (see [`nrun_base::outputs::replace`]); `last`:
/// the job's end, after which no periodic write may replace it. A failure is said once, and
/// once when writing works again.
fn write_file(sh: &Shared, path: &Path, last: bool) {
    let mut st = sh.file.lock().unwrap_or_else(|e| e.into_inner());
    if st.ended {
        return;
    }
    st.ended = last;
    match nrun_base::outputs::replace(path, render(sh).as_bytes()) {
        // The last write is said even after earlier failures: no later one will mend it.
        Err(e) if !st.failing || last => {
            st.failing = true;
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            let then = match last {
                true => "the job's final figures are not in it",
                false => "the file keeps its last figures until a write works",
            };
            tracing::warn!(
                "--metrics-file {}: cannot write it on {}: {e}; {then} (check free space and \
                 permissions of {})",
                path.display(),
                nrun_base::net::hostname(),
                dir.map_or_else(|| ".".into(), |d| d.display().to_string())
            );
        }
        Ok(()) if st.failing => {
            st.failing = false;
            tracing::info!("--metrics-file {}: written again", path.display());
        }
        _ => {}
    }
}

/// Binds `--metrics-port` (the address [`crate::plan`] resolved: loopback unless one was
/// given); a port that cannot be had is a usage error.
pub(crate) fn bind(
    port: Option<&(String, std::net::SocketAddr)>,
) -> Result<Option<std::net::TcpListener>> {
    let Some((given, addr)) = port else {
        return Ok(None);
    };
    let l = std::net::TcpListener::bind(addr).map_err(|e| {
        Error::usage(format!(
            "--metrics-port {given}: cannot listen on {addr} ({e}); pick a free port (above \
             1024 unless nrun runs as root) and an address of this host"
        ))
    })?;
    l.set_nonblocking(true)
        .map_err(|e| Error::internal(format!("--metrics-port {given}: {e}")))?;
    Ok(Some(l))
}

/// Answers each connection's one request: GET /metrics gets the text, anything else 404.
/// Accepting never waits: past [`CONNECTIONS`] held, the oldest connection is closed, so a
/// scraper (which sends its request at once) is served beside any number of slow clients.
async fn serve(l: tokio::net::TcpListener, sh: Arc<Shared>) {
    let mut held: std::collections::VecDeque<tokio::task::AbortHandle> = Default::default();
    let mut pause = Duration::from_millis(100);
    loop {
        let mut conn = match l.accept().await {
            Ok((c, _)) => {
                pause = Duration::from_millis(100);
                c
            }
            // Out of descriptors (EMFILE) and the like: not a reason to spin.
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        held.retain(|h| !h.is_finished());
        if held.len() >= CONNECTIONS
            && let Some(oldest) = held.pop_front()
        {
            // Its task dropped, its socket closes.
            oldest.abort();
        }
        let sh = sh.clone();
        let task = tokio::spawn(async move {
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            // A client that sends no whole request head in 10 s (or 8 KiB) is dropped.
            let read = tokio::time::timeout(Duration::from_secs(10), async {
                while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                true
            })
            .await;
            if read != Ok(true) {
                return;
            }
            let head = String::from_utf8_lossy(&req);
            let mut words = head.split_whitespace();
            let (method, target) = (words.next(), words.next().unwrap_or(""));
            let path = target.split('?').next().unwrap_or("");
            let answer = match (method, path) {
                (Some("GET" | "HEAD"), "/metrics") => {
                    let body = render(&sh);
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/openmetrics-text; \
                         version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\nConnection: \
                         close\r\n\r\n{}",
                        body.len(),
                        if method == Some("HEAD") { "" } else { &body }
                    )
                }
                _ => "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: \
                      22\r\nConnection: close\r\n\r\nnrun serves /metrics\r\n"
                    .to_string(),
            };
            // A client that does not read its answer in 10 s is dropped too.
            let _ = tokio::time::timeout(Duration::from_secs(10), async {
                let _ = conn.write_all(answer.as_bytes()).await;
                let _ = conn.shutdown().await;
            })
            .await;
        });
        held.push_back(task.abort_handle());
    }
}
