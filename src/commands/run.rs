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
    let code = drive(&mut s, job).await;
    // Nodes whose own nrun joined (c10d) exit with the job's code.
    s.end_with(code.as_ref().map_or_else(|e| e.code, |c| *c))
        .await;
    code
}

async fn drive(s: &mut Session, job: &RunSettings) -> Result<u8> {
    ready(s, Some(&crate::agent::peer::own_work(job))).await?;
    let mut code = exit::SUCCESS;
    let mut report = None;
    if let Some(pf) = &job.preflight {
        (code, report) = preflight::run(s, job, pf).await?;
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
    attempts(s, job, report).await
}

/// Join and check: every node joined, the nodes agree and reach each other. `Err`: the exit
/// code, the reason already printed. `own`: this nrun's workers, shown for its node beside
/// the nodes whose own nrun joined with theirs (c10d).
pub async fn ready(s: &mut Session, own: Option<&crate::facts::OwnWork>) -> Result<()> {
    let failures = s.join(false, None).await?;
    if let Some(own) = own.filter(|_| s.plan.peers > 0) {
        for n in s.nodes.iter_mut() {
            if let Some(f) = n.joined.as_mut().and_then(|j| j.facts.as_mut()) {
                f.own.get_or_insert_with(|| own.clone());
            }
        }
    }
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
        // A torchrun started against this endpoint writes its rendezvous state into our store.
        let torchrun = crate::agent::protocol::torchrun_rdzv_key(&s.run_id);
        let torchrun_came = s.store().is_some_and(|st| st.contains(&torchrun));
        if torchrun_came {
            eprintln!(
                "  a torchrun node came to {}:{} for rendezvous {:?}: this endpoint is an nrun \
                 rendezvous (every node must use the same launcher): start every node with nrun, \
                 or every node with torchrun",
                s.rendezvous.addr, s.rendezvous.port, s.run_id
            );
        }
        if !torchrun_came {
            eprintln!("  hint: {}", join_hint(s, &failures));
        }
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

/// The job's root cause for every node whose own nrun joined (c10d): each ends its console with
/// it and writes it to its TORCHELASTIC_ERROR_FILE when the End comes (agent::peer).
fn tell_every_node(s: &Session, summary: &str, error_json: Option<&str>) {
    let why = crate::agent::protocol::RootCause {
        summary: summary.to_string(),
        error_json: error_json.map(str::to_string),
    };
    if let (Some(st), Ok(v)) = (s.store(), serde_json::to_vec(&why)) {
        st.set(&s.keys().root_cause(), &v);
    }
}

/// What to check next when nodes did not join, in the words of how they start: nodes whose own
/// nrun joins (c10d: by hand, a batch script, Kubernetes pods) involve no ssh or srun.
fn join_hint(s: &Session, failures: &[(usize, String)]) -> String {
    let first_peer = s.plan.hosts.len() - s.plan.peers;
    if failures.iter().all(|(i, _)| *i >= first_peer) {
        let endpoint = format!("{}:{}", s.rendezvous.addr, s.rendezvous.port);
        let secs = s.plan.join_timeout.as_secs_f64();
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            return format!(
                "check that every pod of the job is running (`kubectl get pods`) and reaches \
                 {endpoint} (the head pod's service), and that each started within --join-timeout \
                 ({secs:.0} s) of this one"
            );
        }
        return format!(
            "check that every node's nrun started within --join-timeout ({secs:.0} s) of this one \
             and reaches {endpoint} (`nc -z {} {}` there: a firewall, or another \
             --rdzv-endpoint)",
            s.rendezvous.addr, s.rendezvous.port
        );
    }
    let launcher = s.plan.launcher;
    format!(
        "check each with {}, and that nrun {} {}",
        launcher.reach_hint(&s.plan.ssh_opts),
        env!("CARGO_PKG_VERSION"),
        launcher.install_hint()
    )
}

/// The job's attempts; `report` is what the preflight wrote to `--report`, which the watch's
/// findings join.
async fn attempts(
    s: &mut Session,
    job: &RunSettings,
    report: Option<serde_json::Value>,
) -> Result<u8> {
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
    let node_commands: Vec<Option<String>> = s
        .nodes
        .iter()
        .map(|n| {
            let own = n.joined.as_ref()?.facts.as_ref()?.own.as_ref()?;
            Some(own.command.join(" "))
        })
        .collect();
    let shape = JobShape {
        node_commands: &node_commands,
        hosts: &hosts,
        // c10d nodes with their own worker counts: the sum (as torchrun's WORLD_SIZE).
        world: s.group().world,
        command: &command,
    };
    s.watch = job.watch.map(WatchState::new);
    let code = attempt_loop(s, job, &program, &args, &shape).await;
    // What the watch found goes into --report beside the preflight's findings.
    if let (Some(w), Some(path)) = (&s.watch, &job.report) {
        if !w.hangs.is_empty() || !w.stragglers.is_empty() {
            let mut json = report.unwrap_or_else(|| serde_json::json!({}));
            json["watch"] = w.json();
            report::write_json("--report", path, &json)?;
        }
    }
    Ok(code)
}

async fn attempt_loop(
    s: &mut Session,
    job: &RunSettings,
    program: &str,
    args: &[String],
    shape: &JobShape<'_>,
) -> u8 {
    let mut code = exit::SUCCESS;
    // `attempt` numbers the worker groups started (log directories); `restarts` those after a
    // failure (TORCHELASTIC_RESTART_COUNT): an elastic job growing is not a failure.
    let mut restarts = 0;
    for attempt in 0.. {
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
            Err(e) => return e.code,
        };
        if s.watch.as_ref().is_some_and(|w| w.stopped) {
            let line = "nrun: error: the job hung and was stopped (--on-hang stop); the hosting \
                        node's console names the ranks";
            eprintln!("nrun: error: the job hung (see above) and was stopped (--on-hang stop)");
            tell_every_node(s, &format!("{line}\n"), None);
            return exit::HANG;
        }
        // Elastic: nodes arrived while the group ran; it was stopped to take them in.
        if std::mem::take(&mut s.grow) {
            if let Err(why) = s.reform(&[]) {
                eprintln!("nrun: error: {why}; the job cannot go on");
                return exit::CLUSTER;
            }
            continue;
        }
        match report::job_end(shape, &results) {
            JobEnd::Success => return exit::SUCCESS,
            JobEnd::Interrupted(c) => {
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
                // Elastic: lost nodes leave, late ones come in, if MIN nodes remain.
                if restarts < job.workers.max_restarts && s.elastic() {
                    let lost: Vec<usize> = results
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| matches!(r, Some(StepResult::Run(RunResult::Lost(_)))))
                        .map(|(i, _)| i)
                        .collect();
                    if let Err(why) = s.reform(&lost) {
                        let told = format!("{summary}nrun: error: {why}; the job cannot go on\n");
                        eprint!("{told}");
                        tell_every_node(s, &told, error_json.as_deref());
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
                tell_every_node(s, &summary, error_json.as_deref());
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
