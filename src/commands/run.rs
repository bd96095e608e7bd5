//! The job: start the session, join and check the nodes, the preflight, then attempts of the
//! worker group on every node until one succeeds or --max-restarts runs out.

use super::preflight;
use crate::agent::protocol::{RunResult, StepResult};
use crate::error::{Error, Result, exit};
use crate::plan::{NodesPlan, RunSettings};
use crate::report::{self, JobEnd, JobShape};
use crate::session::spec::Launch;
use crate::session::{Policy, Session};
use crate::watch::WatchState;

/// Runs the job to its end and returns nrun's exit code.
pub async fn run(
    job: &RunSettings,
    nodes: &NodesPlan,
    listener: Option<std::net::TcpListener>,
) -> Result<u8> {
    let mut s = Session::start(&job.session, nodes, listener).await?;
    let mut rec = Record::default();
    let code = drive(&mut s, job, &mut rec).await;
    let code_of = code.as_ref().map_or_else(|e| e.code, |c| *c);
    // --report is written at the end of every job, however it ended; --preflight-only's own
    // report is the preflight's (written by it).
    let written = match (&job.report, job.preflight_only) {
        (Some(path), false) => report::write_json("--report", path, &rec.json(code_of, &s)),
        _ => Ok(()),
    };
    // Nodes whose own nrun joined (c10d) exit with the job's code.
    s.end_with(code_of).await;
    written?;
    code
}

/// What `--report` says about the job beside the preflight's findings.
#[derive(Default)]
struct Record {
    /// The preflight's report, when one ran.
    preflight: Option<serde_json::Value>,
    /// Worker groups started, and restarts after a failure (TORCHELASTIC_RESTART_COUNT).
    attempts: usize,
    restarts: u32,
    /// How the job ended ("success", "failed", "hang", "interrupted"); None: it never started.
    outcome: Option<&'static str>,
    /// The last failure, in one line (a restart may have followed it).
    headline: Option<String>,
}

impl Record {
    fn json(&self, code: u8, s: &Session) -> serde_json::Value {
        let outcome = match (self.outcome, code) {
            (Some(o), _) => o,
            (None, exit::SUCCESS) => "success",
            (None, _) => "not started",
        };
        // The preflight's keys stay at the top level, where --preflight-only puts them.
        let mut v = self
            .preflight
            .clone()
            .unwrap_or_else(|| serde_json::json!({}));
        v["job"] = serde_json::json!({
            "outcome": outcome,
            "exit_code": code,
            "headline": self.headline,
            "attempts": self.attempts,
            "restarts": self.restarts,
        });
        v["watch"] = s
            .watch
            .as_ref()
            .map_or(serde_json::Value::Null, WatchState::json);
        v
    }
}

async fn drive(s: &mut Session, job: &RunSettings, rec: &mut Record) -> Result<u8> {
    ready(s).await?;
    let mut code = exit::SUCCESS;
    if let Some(pf) = &job.preflight {
        (code, rec.preflight) = preflight::run(s, job, pf).await?;
        if code != exit::SUCCESS && pf.warn_only && !job.preflight_only {
            tracing::warn!(
                "the preflight failed (exit code {code}); starting the job anyway (--preflight ...,warn)"
            );
            code = exit::SUCCESS;
        }
    }
    if code != exit::SUCCESS || job.preflight_only {
        return Ok(code);
    }
    attempts(s, job, rec).await
}

/// Join and check: every node joined, the nodes agree and reach each other. `Err`: the exit
/// code, the reason already printed.
pub async fn ready(s: &mut Session) -> Result<()> {
    let failures = s.join(false, None).await?;
    let joined = s.len() - failures.len();
    if !failures.is_empty() && s.elastic() && joined >= s.plan.min_nodes {
        tracing::warn!(
            "{joined} of {} nodes joined; the job starts with them (--nnodes {}:{}); a node that \
             joins later is taken in (the worker group restarts with it):",
            s.len(),
            s.plan.min_nodes,
            s.len()
        );
        for (_, f) in &failures {
            tracing::warn!("  {f}");
        }
    } else if !failures.is_empty() {
        eprintln!(
            "nrun: error: {} of {} nodes could not join:",
            failures.len(),
            s.len()
        );
        for (_, f) in &failures {
            eprintln!("  {f}");
        }
        let launcher = s.plan.launcher;
        eprintln!(
            "  hint: check each with {}, and that nrun {} {}",
            launcher.reach_hint(&s.plan.ssh_opts),
            env!("CARGO_PKG_VERSION"),
            launcher.install_hint()
        );
        return Err(Error::exit(exit::CLUSTER));
    }
    s.active = s.joined().map(|(i, _, _)| i).collect();
    if s.plan.in_process {
        // Nothing to compare on one node; what the checks would say about variables still holds.
        if let Some(w) = crate::plan::env::port_range_warning(&s.plan.env) {
            tracing::warn!("{w}");
        }
        return Ok(());
    }
    let findings = s.assign_interfaces();
    s.readiness(findings)?;
    s.probe_ring().await
}

/// The job's attempts, counted in `rec`.
async fn attempts(s: &mut Session, job: &RunSettings, rec: &mut Record) -> Result<u8> {
    if job.workers.set_omp_threads {
        tracing::info!(
            "OMP_NUM_THREADS was unset; set to 1 for each of the {} workers (as torchrun does); set \
             it yourself to tune",
            job.workers.nproc
        );
    }
    if let Some(d) = &job.workers.log.dir {
        tracing::info!("worker logs go to {}", d.display());
    }
    let program = job.workers.program.to_string_lossy().into_owned();
    let args: Vec<String> = job
        .workers
        .args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let command = std::iter::once(program.clone())
        .chain(args.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ");
    let hosts: Vec<String> = s.nodes.iter().map(|n| n.label.clone()).collect();
    let shape = JobShape {
        hosts: &hosts,
        world: s.plan.world,
        command: &command,
    };
    s.watch = job.watch.map(WatchState::new);
    Ok(attempt_loop(s, job, &program, &args, &shape, rec).await)
}

async fn attempt_loop(
    s: &mut Session,
    job: &RunSettings,
    program: &str,
    args: &[String],
    shape: &JobShape<'_>,
    rec: &mut Record,
) -> u8 {
    let mut code = exit::SUCCESS;
    // `attempt` numbers the worker groups started (log directories); `restarts` those after a
    // failure (TORCHELASTIC_RESTART_COUNT): an elastic job growing is not a failure.
    let mut restarts = 0;
    for attempt in 0u32.. {
        rec.attempts = attempt as usize + 1;
        rec.restarts = restarts;
        if attempt > 0 {
            if let Some(st) = s.store() {
                st.clear_user_keys();
            }
        }
        if let Some(w) = s.watch.as_mut() {
            w.reset();
        }
        let launch = Launch {
            port: s.rendezvous.port,
            attempt,
            restart_count: restarts,
            program,
            args,
            logs: true,
            scratch: "job",
            extra: &|_| Vec::new(),
            grace_ms: job.shutdown_timeout.as_millis() as u64,
            deadline_ms: None,
            watch: s.watch.is_some(),
            secret: false,
        };
        let steps = s.steps(&job.workers, &s.group(), &launch);
        let results = match s.run_step(steps, Policy::Together).await {
            Ok(r) => r,
            Err(e) => {
                rec.outcome = Some(if e.code > 128 {
                    "interrupted"
                } else {
                    "failed"
                });
                return e.code;
            }
        };
        if s.watch.as_ref().is_some_and(|w| w.stopped) {
            eprintln!("nrun: error: the job hung (see above) and was stopped (--on-hang stop)");
            rec.outcome = Some("hang");
            return exit::HANG;
        }
        // Elastic: nodes arrived while the group ran; it was stopped to take them in.
        if std::mem::take(&mut s.grow) {
            if let Err(why) = s.reform(&[]) {
                eprintln!("nrun: error: {why}; the job cannot go on");
                rec.outcome = Some("failed");
                return exit::CLUSTER;
            }
            continue;
        }
        match report::job_end(shape, &results) {
            JobEnd::Success => {
                rec.outcome = Some("success");
                return exit::SUCCESS;
            }
            JobEnd::Interrupted(c) => {
                rec.outcome = Some("interrupted");
                tracing::warn!(
                    "stopped by {}; every worker was stopped",
                    crate::node::signal_name(i32::from(c) - 128)
                );
                return c;
            }
            JobEnd::Failed {
                code: c,
                headline,
                summary,
                error_json,
            } => {
                code = c;
                rec.outcome = Some("failed");
                rec.headline = Some(headline.clone());
                // Elastic: lost nodes leave, late ones come in, if MIN nodes remain.
                if restarts < job.workers.max_restarts && s.elastic() {
                    let lost: Vec<usize> = results
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| matches!(r, Some(StepResult::Run(RunResult::Lost(_)))))
                        .map(|(i, _)| i)
                        .collect();
                    if let Err(why) = s.reform(&lost) {
                        eprint!("{summary}");
                        eprintln!("nrun: error: {why}; the job cannot go on");
                        return c;
                    }
                }
                if restarts < job.workers.max_restarts {
                    restarts += 1;
                    tracing::warn!(
                        "{headline}; restarting the worker group ({restarts} of {} restarts)",
                        job.workers.max_restarts
                    );
                    continue;
                }
                // The watch's likely cause goes right under the headline.
                let summary = match s.watch.as_ref().and_then(|w| w.cause(shape.hosts)) {
                    Some(cause) => summary.replacen('\n', &format!("\n{cause}"), 1),
                    None => summary,
                };
                eprint!("{summary}");
                // torchrun's habit: the launcher's own error file gets the root cause.
                if let (Some(path), Some(json)) = (&job.launcher_error_file, error_json) {
                    if let Err(e) = std::fs::write(path, json) {
                        tracing::warn!(
                            "cannot write TORCHELASTIC_ERROR_FILE {}: {e}",
                            path.display()
                        );
                    }
                }
                return code;
            }
        }
    }
    code
}
