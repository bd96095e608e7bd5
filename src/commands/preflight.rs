//! The preflight phase of a job: resolve the libnccl each node's ranks load, run one preflight
//! rank per worker slot with the job's environment, gather what each rank reported, print the
//! table and verdict. Reports are gathered into a summary by `preflight::Outcome::gather`, as
//! bisect's probes are.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::plan::{PreflightPlan, RunSettings};
use crate::protocol::{RunResult, StepResult, THIS_NRUN};
use crate::session::spec::{Group, Launch};
use crate::session::{Policy, Session};
use nrun_base::error::{Result, exit};
use nrun_preflight::{self as preflight, Mode, Settings};
use nrun_store::client::Client;

/// How a preflight ended: its exit code, its report (the JSON of `--report`) when it got that
/// far, and the nodes its failing findings name (host, evidence).
pub(crate) struct Ended {
    pub code: u8,
    pub report: Option<crate::report::schema::PreflightReport>,
    pub blamed: Vec<(String, String)>,
}

impl Ended {
    fn early(code: u8) -> Ended {
        Ended {
            code,
            report: None,
            blamed: Vec::new(),
        }
    }
}

/// Runs the preflight over the job's nodes (the session's group).
/// `round`: how many times it ran before in this session.
pub(crate) async fn run(
    s: &mut Session,
    job: &RunSettings,
    pf: &PreflightPlan,
    round: usize,
) -> Result<Ended> {
    let started = Instant::now();
    let since = |what: &str| {
        tracing::debug!(
            "preflight: {what} at {:.0} ms",
            started.elapsed().as_secs_f64() * 1e3
        )
    };
    // An in-process node reported no facts: its libnccl is resolved here, and the others found
    // are listed (by a task that runs beside the preflight).
    let (here_lib, other_libs) = match (pf.mode, s.in_process()) {
        (Mode::Nccl, true) => {
            let (lib, others) = resolve_nccl(job.session.python.as_deref(), pf).await;
            (lib, Some(others))
        }
        _ => (None, None),
    };
    // Each run of the preflight its own keys (it runs again after nodes were left out); the
    // first's are the same on every node of a static launch.
    let id = match round {
        0 => format!("{}/pf", s.run()),
        n => format!("{}/pf{n}", s.run()),
    };
    let settings: Vec<Settings> = (0..s.len())
        .map(|i| node_settings(s, pf, i, here_lib.clone(), &id))
        .collect();
    let env = |i: usize| settings[i].rank_env(pf.loopback);
    // Ranks enforce the init timeout themselves; this deadline only catches a rank that hangs
    // where it cannot (a CUDA call, a dead peer mid-collective).
    let deadline = pf.timeout * 2 + Duration::from_secs(120);
    let group = s.group();
    let launch = Launch {
        port: s.rendezvous().port,
        attempt: 0,
        restart_count: 0,
        program: THIS_NRUN,
        args: &["__preflight".to_string()],
        logs: false,
        scratch: "preflight",
        extra: &env,
        grace_ms: 3000,
        deadline_ms: Some(deadline.as_millis() as u64),
        watch: None,
        secret: true,
    };
    let steps = s.steps(&job.workers, &group, &launch);
    since("starting ranks");
    let mut sweep = Sweep::new(s, &settings[0], group.world, deadline);
    sweep.sizes.always = job.preflight_only;
    let ran = sweep
        .p
        .during(s.run_step(steps, Policy::Together), |p| sweep.sizes.read(p));
    let results = match ran.await {
        Ok(r) => r.results,
        Err(e) => return Ok(Ended::early(e.code)),
    };
    sweep.done();
    since("ranks ended");
    let crashed = match first_crash(&results) {
        Ok(c) => c,
        Err(code) => return Ok(Ended::early(code)),
    };
    let ranks = every_rank(s, &group, job.workers.nproc);
    let values = read_reports(s, &settings[0], &ranks).await;
    since("reports gathered");
    let other_libs = match other_libs {
        Some(t) => t.await.unwrap_or_default(),
        None => Vec::new(),
    };
    let mut outcome = preflight::Outcome::gather(&settings[0], &ranks, group.world, &mut |k| {
        values.get(k).cloned().filter(|v| !v.is_empty())
    });
    outcome.crashed = crashed;
    outcome.stopped = why_stopped(s, &results, deadline);
    outcome.nccl_lib = here_lib.map(|p| p.display().to_string());
    outcome.min_busbw = pf.min_busbw;
    // --preflight-loopback pushes the traffic off NVLink on purpose: no line rate applies.
    outcome.min_efficiency = Some(pf.min_efficiency).filter(|_| !pf.loopback);
    // What the ranks got: the run's variables (forwarded from here, .nrun_env, -x).
    outcome.path_vars = preflight::hardware::path_variables(&|k| {
        s.plan
            .env
            .iter()
            .find(|(x, _)| x == k)
            .map(|(_, v)| v.clone())
    });
    outcome.waived = pf.waived.clone();
    outcome.wall_s = started.elapsed().as_secs_f64();
    outcome.other_libs = other_libs;
    let summary = outcome.summarize();
    nrun_base::stdout(&summary.text);
    if let Some(path) = &pf.report {
        crate::report::said(crate::report::write_json("--report", path, &summary.json));
    }
    Ok(Ended {
        code: summary.verdict.exit_code(),
        blamed: blamed(&summary.findings),
        report: crate::report::schema::PreflightReport::from_json(summary.json),
    })
}

/// The sweep's progress as the ranks run: each size's line as rank 0 publishes it
/// ([`preflight::SizeReader`]) in the store this nrun hosts (a static launch's other nodes
/// host none: they say only what they wait for).
struct Sweep {
    p: crate::progress::Progress,
    sizes: Sizes,
}

struct Sizes {
    started: Instant,
    /// Sizes are said from the first (the preflight is the command: --preflight-only).
    always: bool,
    store: Option<std::sync::Arc<nrun_store::Store>>,
    settings: Settings,
    reader: preflight::SizeReader,
    total: usize,
    world: usize,
}

impl Sweep {
    fn new(s: &Session, settings: &Settings, world: usize, deadline: Duration) -> Sweep {
        let total = settings.sizes().len();
        Sweep {
            p: crate::progress::Progress::new(
                "preflight",
                Some(total as u64),
                Some(Instant::now() + deadline),
            ),
            sizes: Sizes {
                started: Instant::now(),
                always: false,
                store: s.store().cloned(),
                settings: settings.clone(),
                reader: preflight::SizeReader::default(),
                total,
                world,
            },
        }
    }

    /// The ranks ended: the sizes published last are said, the bar cleared.
    fn done(mut self) {
        if self.sizes.said() {
            self.sizes.read(&mut self.p);
        }
        self.p.finish(None);
    }
}

/// When a sweep's sizes start being said (issue 38: steps of more than ~2 s show progress).
const SAY_SIZES_AFTER: Duration = Duration::from_secs(2);

impl Sizes {
    /// Whether sizes are said: with --preflight-only, each as it comes; before a job, a sweep
    /// of a second or two (every job's NCCL preflight on one node) says nothing but its
    /// verdict, and a longer one says what it has measured, then each size.
    fn said(&self) -> bool {
        self.always || self.started.elapsed() >= SAY_SIZES_AFTER
    }

    fn read(&mut self, p: &mut crate::progress::Progress) {
        if let Some(st) = self.store.as_ref().filter(|_| self.said()) {
            let before = self.reader.count();
            let rows = self.reader.read(&self.settings, &mut |k| st.get(k));
            for (n, row) in (before + 1..).zip(rows) {
                p.line(&format!(
                    "preflight {n}/{}: {}",
                    self.total,
                    row.line(self.world)
                ));
                p.set(n as u64);
            }
        }
        let next = self.settings.sizes().get(self.reader.count()).copied();
        p.waiting(|| match next {
            Some(b) if self.store.is_some() => format!(
                "the preflight ranks (next: {}, size {} of {})",
                preflight::human_bytes(b),
                self.reader.count() + 1,
                self.total
            ),
            _ => "the preflight ranks to finish".to_string(),
        });
    }
}

/// The first rank that crashed (rank, how), warning about ranks that timed out or were lost;
/// Err: nrun was stopped by a signal (the exit code).
fn first_crash(results: &[Option<StepResult>]) -> std::result::Result<Option<(usize, String)>, u8> {
    let mut crashed = None;
    for r in results.iter().flatten() {
        match r {
            StepResult::Run(RunResult::Interrupted(sig)) => {
                tracing::warn!("preflight stopped by {}", nrun_node::signal_name(*sig));
                return Err(exit::signal(*sig));
            }
            StepResult::Run(RunResult::Failed(f)) if crashed.is_none() => {
                crashed = Some((f.rank, format!("pid {} {}", f.pid, f.how)));
            }
            StepResult::Run(RunResult::TimedOut) => {
                tracing::warn!("the preflight ran past its deadline and was stopped")
            }
            StepResult::Run(RunResult::SpawnError(e) | RunResult::Lost(e)) => {
                tracing::warn!("preflight: {e}")
            }
            _ => {}
        }
    }
    Ok(crashed)
}

/// Why nrun ended the preflight's ranks before they all finished, in the words a silent
/// rank is said with: the node lost (its agent's own account: no heartbeat for how long), or
/// the step's deadline (`deadline`) that passed.
fn why_stopped(s: &Session, results: &[Option<StepResult>], deadline: Duration) -> Option<String> {
    results.iter().enumerate().find_map(|(i, r)| match r {
        Some(StepResult::Run(RunResult::Lost(m) | RunResult::SpawnError(m))) => {
            Some(format!("nrun ended every rank: {m}"))
        }
        Some(StepResult::Run(RunResult::TimedOut)) => Some(format!(
            "nrun ended the ranks of {} at the preflight's deadline, {} s (twice \
             --preflight-timeout, and 120 s)",
            s.nodes[i].label,
            deadline.as_secs()
        )),
        _ => None,
    })
}

/// Every rank of the group with its host, in rank order. A static launch's node sees only its
/// own ranks; the others are named by node.
fn every_rank(s: &Session, group: &Group, nproc: usize) -> Vec<(usize, String)> {
    let mut ranks = group.rank_hosts(s);
    let mine: std::collections::BTreeSet<usize> = ranks.iter().map(|r| r.0).collect();
    for r in (0..group.world).filter(|r| !mine.contains(r)) {
        ranks.push((r, format!("node {}", r / nproc.max(1))));
    }
    ranks.sort();
    ranks
}

/// Failing findings that all name a node blame those nodes (host, evidence); one without a
/// node (wrong results everywhere, a version mismatch) blames nobody.
fn blamed(findings: &[preflight::finding::Finding]) -> Vec<(String, String)> {
    let failing: Vec<&preflight::finding::Finding> = findings
        .iter()
        .filter(|f| matches!(f.severity, preflight::finding::Severity::Fail(_)))
        .collect();
    match failing.iter().all(|f| f.node.is_some()) {
        true => failing
            .iter()
            .filter_map(|f| Some((f.node.clone()?, f.evidence.clone())))
            .collect(),
        false => Vec::new(),
    }
}

/// Node `i`'s preflight settings (`id`: the run's key space): --nccl-lib, else the library the
/// node reported, else `here_lib`; its ranks listen (net mode) on the address other nodes reach
/// it on. Bisect's probes use the same.
pub(super) fn node_settings(
    s: &Session,
    pf: &PreflightPlan,
    i: usize,
    here_lib: Option<PathBuf>,
    id: &str,
) -> Settings {
    let joined = s.nodes[i].joined.as_ref();
    let lib = pf.nccl_lib.clone().or_else(|| {
        joined
            .and_then(|j| j.facts.as_ref())
            .and_then(|f| f.nccl.first())
            .map(|l| PathBuf::from(&l.path))
            .or(here_lib)
    });
    let listen = match (
        joined.and_then(|j| j.addr),
        s.nodes[i].link.kind().in_process,
    ) {
        (Some(a), _) => a.to_string(),
        // Ranks on a single node listen where the store is, loopback included.
        (None, true) => match s.rendezvous().addr.parse::<std::net::IpAddr>() {
            Ok(a) if a.is_loopback() => s.rendezvous().addr.clone(),
            _ => "0.0.0.0".into(),
        },
        (None, _) => "0.0.0.0".into(),
    };
    let mut settings = pf.settings(id.to_string(), lib, listen);
    settings.host = Some(s.machine_label(i));
    settings
}

/// Every rank's report and last stage, in one read: from the store this nrun hosts, or with
/// one MULTI_GET from node 0's (a static launch's node of rank > 0).
async fn read_reports(
    s: &Session,
    settings: &Settings,
    ranks: &[(usize, String)],
) -> HashMap<Vec<u8>, Vec<u8>> {
    let keys: Vec<Vec<u8>> = ranks
        .iter()
        .flat_map(|(r, _)| [settings.result_key(*r), settings.stage_key(*r)])
        .collect();
    if let Some(st) = s.store() {
        return keys
            .into_iter()
            .filter_map(|k| st.get(&k).map(|v| (k, v)))
            .collect();
    }
    let store = format!("{}:{}", s.rendezvous().addr, s.rendezvous().port);
    let read = async {
        let addr = store
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::other("the address resolves to nothing"))?;
        let mut c = Client::connect(addr, Duration::from_secs(5)).await?;
        if let Some(secret) = &s.rendezvous().secret {
            c.authenticate(secret.as_bytes()).await?;
        }
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        c.multi_get(&refs).await
    };
    match read.await {
        Ok(vals) => keys.into_iter().zip(vals).collect(),
        Err(e) => {
            // Every rank would read as silent: say why instead.
            tracing::warn!(
                "cannot read the preflight ranks' reports from the store at {store} (node 0's): \
                 {e}; check that node 0's nrun still runs and this node reaches it"
            );
            HashMap::new()
        }
    }
}

/// The libnccl the job would load here, and (as a task that runs beside the preflight) a line
/// for every other one found, with its version.
async fn resolve_nccl(
    python: Option<&std::path::Path>,
    pf: &PreflightPlan,
) -> (Option<PathBuf>, tokio::task::JoinHandle<Vec<String>>) {
    // Even with --nccl-lib, torch's copy is looked up so that a mismatch can be reported.
    let python_paths = python
        .map(preflight::nccl::python_package_dirs)
        .unwrap_or_default();
    let ld = std::env::var("LD_LIBRARY_PATH").ok();
    // The system's copies (ldconfig) only matter for the choice when nothing better exists;
    // otherwise they are listed by the background task below.
    let mut cands =
        preflight::nccl::candidates(pf.nccl_lib.as_deref(), &python_paths, ld.as_deref(), false);
    let listed_system = cands.is_empty();
    if listed_system {
        cands = preflight::nccl::candidates(None, &[], None, true);
    }
    let chosen = cands.first().map(|c| c.path.clone());
    if let Some(c) = cands.first() {
        tracing::debug!(
            "preflight uses {} NCCL at {}",
            c.source.describe(),
            c.path.display()
        );
    }
    let explicit = pf.nccl_lib.clone();
    // Each other library's version is read by a separate nrun process: two libraries with the
    // same soname should not share one process.
    let others = tokio::spawn(async move {
        if !listed_system {
            cands = preflight::nccl::candidates(
                explicit.as_deref(),
                &python_paths,
                ld.as_deref(),
                true,
            );
        }
        let exe = std::env::current_exe().ok();
        let mut lines = Vec::new();
        for c in cands.iter().skip(1) {
            let version = match &exe {
                Some(exe) => tokio::process::Command::new(exe)
                    .arg("__nccl-version")
                    .arg(&c.path)
                    .output()
                    .await
                    .ok()
                    .filter(|o| o.status.success())
                    .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()),
                None => None,
            };
            lines.push(format!(
                "NCCL {} at {} ({}; not used)",
                version.as_deref().unwrap_or("?"),
                c.path.display(),
                c.source.describe()
            ));
        }
        lines
    });
    (chosen, others)
}
