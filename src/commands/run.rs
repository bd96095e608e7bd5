//! The job: start the session, join and check the nodes, the preflight, then attempts of the
//! worker group on every node until one succeeds or --max-restarts runs out.

use super::preflight;
use crate::agent::protocol::{RunResult, StepResult};
use crate::error::{Error, Result, exit};
use crate::plan::{NodesPlan, RunSettings};
use crate::report::{self, JobEnd, JobShape};
use crate::session::roster::Stage;
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
    s.settle(code.is_ok());
    // --report is written at the end of every job, however it ended, with the nodes left out;
    // --preflight-only's own report is the preflight's (written by it), rewritten only to add
    // the nodes left out.
    let nodes = s.nodes_json();
    let written = match (&job.report, job.preflight_only, &rec.preflight) {
        (Some(path), false, _) => {
            let mut v = rec.json(code_of, &s);
            if let Some(n) = nodes {
                v["nodes"] = n;
            }
            report::write_json("--report", path, &v)
        }
        (Some(path), true, Some(pf)) if nodes.is_some() => {
            let mut v = pf.clone();
            v["nodes"] = nodes.unwrap_or_default();
            report::write_json("--report", path, &v)
        }
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
    ready(s, Some(&crate::agent::peer::own_work(job))).await?;
    let mut code = exit::SUCCESS;
    if let Some(pf) = &job.preflight {
        let mut rounds = 0;
        loop {
            let ended = preflight::run(s, job, pf, rounds).await?;
            (code, rec.preflight) = (ended.code, ended.report);
            rounds += 1;
            // A job (not the health check alone) with spares leaves out the nodes the
            // preflight blames and checks the new set.
            if code == exit::SUCCESS || job.preflight_only || s.spares().is_empty() || rounds > 3 {
                break;
            }
            // No node to blame: the staged scale-up finds it, over the nodes and spares.
            let blamed = match ended.blamed.is_empty() {
                true => super::bisect::on_the_spot(s, job, pf).await?,
                false => blamed_nodes(s, &ended.blamed),
            };
            if blamed.is_empty() || blamed.len() * 2 > s.active.len() {
                break;
            }
            // A spare the bisect found bad is left out too, but only a node of the job being
            // replaced makes the preflight worth running again.
            let replaced: Vec<usize> = blamed
                .iter()
                .map(|b| b.0)
                .filter(|i| s.active.contains(i))
                .collect();
            for (i, why) in &blamed {
                s.leave_out(*i, Stage::Preflight, why);
            }
            if replaced.is_empty() {
                break;
            }
            let came = s.fill()?;
            tracing::warn!(
                "the preflight runs again with {} in place of {}",
                s.names(&came),
                s.names(&replaced)
            );
        }
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

/// Join and check: the job's nodes joined, agree and reach each other. A node that fails to
/// join or a check is left out and a spare takes its place (see session::roster). `Err`: the
/// exit code, the reason already printed. `own`: this nrun's workers, shown for its node beside
/// the nodes whose own nrun joined with theirs (c10d).
pub async fn ready(s: &mut Session, own: Option<&crate::facts::OwnWork>) -> Result<()> {
    if let Some(f) = &s.plan.exclude_file {
        for e in &s.plan.avoided {
            let age = std::time::SystemTime::now()
                .duration_since(e.at)
                .unwrap_or_default();
            tracing::warn!(
                "not using {}: in --exclude-file {} since {} ago ({}); it counts for {}",
                e.host,
                f.path.display(),
                humantime::format_duration(std::time::Duration::from_secs(age.as_secs())),
                e.why,
                humantime::format_duration(f.ttl)
            );
        }
    }
    let failures = s.join(false, None).await?;
    if let Some(own) = own.filter(|_| s.plan.peers > 0) {
        for n in s.nodes.iter_mut() {
            if let Some(f) = n.joined.as_mut().and_then(|j| j.facts.as_mut()) {
                f.own.get_or_insert_with(|| own.clone());
            }
        }
    }
    // A c10d slot nobody came to is no node to leave out.
    let owned = s.plan.owned();
    for (i, why) in failures.iter().filter(|(i, _)| *i < owned) {
        s.leave_out(*i, Stage::Join, why);
    }
    if let Err(e) = s.fill() {
        return Err(short_at_join(s, &failures, e));
    }
    if s.active.len() < s.plan.size && s.elastic() {
        tracing::warn!(
            "{} of {} nodes joined; the job starts with them (--nnodes {}:{}); a node that \
             joins later is taken in (the worker group restarts with it)",
            s.active.len(),
            s.plan.size,
            s.plan.min_nodes,
            s.plan.size
        );
    }
    if s.plan.in_process {
        // Nothing to compare on one node; what the checks would say about variables still holds.
        if let Some(w) = crate::plan::env::port_range_warning(&s.plan.env) {
            tracing::warn!("{w}");
        }
        return Ok(());
    }
    let findings = s.assign_interfaces();
    for (i, why) in s.readiness(findings)? {
        s.leave_out(i, Stage::Check, &why);
    }
    // A sick GPU leaves its node out only where a spare can take its place (a sick spare is
    // no spare).
    let sick = s.gpu_trouble();
    let mut free = s
        .spares()
        .into_iter()
        .filter(|i| !sick.iter().any(|(j, _)| j == i))
        .count();
    for (i, why) in sick {
        if !s.active.contains(&i) || free > 0 {
            free -= usize::from(s.active.contains(&i));
            s.leave_out(i, Stage::Check, &why);
        } else {
            tracing::warn!("{why}; no spare to take its place, so it stays in");
        }
    }
    s.fill()?;
    for (i, why) in s.probe_ring().await? {
        s.leave_out(i, Stage::Check, &why);
    }
    s.fill()?;
    let spares = s.spares();
    if !s.left_out.is_empty() {
        tracing::warn!(
            "the job runs on {} nodes: {} ({} left out, see above)",
            s.active.len(),
            s.names(&s.active),
            s.left_out.len()
        );
    }
    if !spares.is_empty() {
        tracing::info!(
            "the job runs on {} nodes; spare(s): {}",
            s.active.len(),
            s.names(&spares)
        );
    }
    Ok(())
}

/// Too few nodes joined: the nodes that did not, as before spares existed, then exit 98.
fn short_at_join(s: &Session, failures: &[(usize, String)], e: Error) -> Error {
    if failures.is_empty() || s.left_out.iter().any(|l| l.stage != Stage::Join) {
        return e;
    }
    // Most nodes failing to join is the setup's fault (ssh, nrun's path), not theirs; so is a
    // c10d node that never started.
    let code =
        match failures.len() * 2 > s.len() || failures.iter().all(|(i, _)| *i >= s.plan.owned()) {
            true => exit::CLUSTER,
            false => exit::NO_NODES,
        };
    eprintln!(
        "nrun: error: {} of {} nodes could not join:",
        failures.len(),
        s.len()
    );
    for (_, f) in failures {
        eprintln!("  {f}");
    }
    // A torchrun started against this endpoint writes its rendezvous state into our store.
    let torchrun = crate::agent::protocol::torchrun_rdzv_key(&s.run_id);
    match s.store().is_some_and(|st| st.contains(&torchrun)) {
        true => eprintln!(
            "  a torchrun node came to {}:{} for rendezvous {:?}: this endpoint is an nrun \
             rendezvous (every node must use the same launcher): start every node with nrun, \
             or every node with torchrun",
            s.rendezvous.addr, s.rendezvous.port, s.run_id
        ),
        false => eprintln!("  hint: {}", join_hint(s, failures)),
    }
    if code == exit::NO_NODES {
        eprintln!(
            "nrun: error: the job needs {} node(s) and {} joined (exit {code}: too few healthy \
             nodes)",
            s.plan.min_nodes,
            s.active.len(),
        );
    }
    Error::exit(code)
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
    if failures.iter().all(|(i, _)| *i >= s.plan.owned()) {
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
    Ok(attempt_loop(s, job, &program, &args, &shape, rec).await)
}

/// The session's nodes named by the preflight's findings, each with its evidence joined.
fn blamed_nodes(s: &Session, blamed: &[(String, String)]) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    for (host, why) in blamed {
        let Some(i) = s
            .active
            .iter()
            .copied()
            .find(|i| s.nodes[*i].label == *host)
        else {
            continue;
        };
        match out.iter_mut().find(|(j, _)| *j == i) {
            Some((_, w)) => {
                w.push_str("; ");
                w.push_str(why);
            }
            None => out.push((i, why.clone())),
        }
    }
    out
}

/// The node of the ranks the watch's last hang blames, when they are all on one node.
fn hang_pinned(s: &Session, group: &crate::session::spec::Group) -> Option<(usize, String)> {
    let w = s.watch.as_ref()?;
    // Ranks that called different collectives (or sizes) are the program's doing, not a
    // node's: nobody is left out for it.
    if !w.mismatches.is_empty() {
        return None;
    }
    let d = w.hangs.last()?;
    if d.kind == crate::watch::Kind::Disagree {
        return None;
    }
    let node_of = |r: usize| {
        group
            .members
            .iter()
            .find(|m| m.ranks.iter().any(|&(g, _)| g == r))
            .map(|m| m.node)
    };
    let nodes: std::collections::BTreeSet<usize> =
        d.culprits.iter().filter_map(|r| node_of(*r)).collect();
    match (nodes.len(), nodes.first()) {
        (1, Some(&n)) => Some((
            n,
            format!("the watch pinned a hang on it: {}", d.conclusion),
        )),
        _ => None,
    }
}

/// Nodes a failed attempt's failure is pinned on, with the evidence: a lost node (agent or
/// link), or the one node whose workers died by a signal or with a GPU/driver error while no
/// other node's did (the same error everywhere is the program's).
fn pin_failures(results: &[Option<StepResult>]) -> Vec<(usize, String)> {
    let mut lost = Vec::new();
    let mut hard = Vec::new();
    for (i, r) in results.iter().enumerate() {
        match r {
            Some(StepResult::Run(RunResult::Lost(why))) => lost.push((i, why.clone())),
            Some(StepResult::Run(RunResult::Failed(f))) => {
                if let Some(e) = node_fault(f) {
                    hard.push((i, format!("rank {} {}: {e}", f.rank, f.how)));
                }
            }
            _ => {}
        }
    }
    // One node's fault; others' failures are its consequences. On several nodes at once it
    // is more likely the program's.
    if hard.len() == 1 {
        lost.extend(hard);
    }
    lost
}

/// What in a worker's failure points at its node rather than the program: death by a signal
/// the program does not send itself, or a GPU/driver error in its last words.
fn node_fault(f: &crate::agent::protocol::WorkerFailure) -> Option<String> {
    const SIGNS: [&str; 9] = [
        "unhandled cuda error",
        "uncorrectable ecc",
        "ecc error",
        "xid",
        "gpu is lost",
        "fallen off the bus",
        "nvml_error_gpu_is_lost",
        "cudaerrordevicesunavailable",
        "unspecified launch failure",
    ];
    if f.how.contains("killed by SIGKILL") || f.how.contains("killed by SIGBUS") {
        return Some("killed by the system (out of memory, or the node)".into());
    }
    let text = f
        .stderr_tail
        .iter()
        .chain(f.traceback.iter())
        .map(|l| l.to_lowercase())
        .collect::<Vec<_>>();
    SIGNS.iter().find_map(|sign| {
        text.iter()
            .find(|l| l.contains(sign))
            .map(|l| format!("its output shows a GPU fault: {}", l.trim()))
    })
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
        let world = s.group().world;
        if let Some(w) = s.watch.as_mut() {
            w.reset(world);
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
        let group = s.group();
        let steps = s.steps(&job.workers, &group, &launch);
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
            // A hang the watch pins on one node's ranks: that node out, a spare in.
            let pinned = hang_pinned(s, &group);
            if let (Some(p), true) = (pinned, restarts < job.workers.max_restarts) {
                if !s.spares().is_empty() {
                    if let Err(why) = s.reform(&[p]) {
                        eprintln!("nrun: error: {why}; the job cannot go on");
                        rec.outcome = Some("hang");
                        return exit::NO_NODES;
                    }
                    restarts += 1;
                    if let Some(w) = s.watch.as_mut() {
                        w.stopped = false;
                    }
                    tracing::warn!(
                        "restarting the worker group after the hang ({restarts} of {} restarts)",
                        job.workers.max_restarts
                    );
                    continue;
                }
            }
            let what = match s.watch.as_ref().is_some_and(|w| !w.mismatches.is_empty()) {
                true => "calling a collective differently on some ranks",
                false => "hung",
            };
            eprintln!(
                "nrun: error: the watch found the job {what} (see above) and stopped it (--on-hang stop)"
            );
            tell_every_node(
                s,
                &format!(
                    "nrun: error: the watch found the job {what} and stopped it (--on-hang \
                     stop); the hosting node's console names the ranks\n"
                ),
                None,
            );
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
                // A failure pinned on nodes (lost, killed, a GPU error of theirs only) leaves
                // them out; spares (or, elastic, the rest) go on. The program's own failure
                // leaves nobody out.
                let pinned = pin_failures(&results);
                if restarts < job.workers.max_restarts && (!pinned.is_empty() || s.elastic()) {
                    if let Err(why) = s.reform(&pinned) {
                        let told = format!("{summary}nrun: error: {why}; the job cannot go on\n");
                        eprint!("{told}");
                        tell_every_node(s, &told, error_json.as_deref());
                        return exit::NO_NODES;
                    }
                } else {
                    // No restart left: remembered all the same (--exclude-file, --report).
                    for (i, why) in &pinned {
                        s.leave_out(*i, Stage::Run, why);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::protocol::WorkerFailure;

    fn failed(rank: usize, how: &str, tail: &[&str]) -> Option<StepResult> {
        Some(StepResult::Run(RunResult::Failed(WorkerFailure {
            rank,
            local_rank: 0,
            pid: 1,
            exit_code: 1,
            how: how.into(),
            at: String::new(),
            stderr_tail: tail.iter().map(|s| s.to_string()).collect(),
            traceback: None,
            error_file: Default::default(),
            left_early: Vec::new(),
            error_json: None,
            error_file_kept: false,
        })))
    }

    #[test]
    fn failures_are_pinned_on_a_node_only_with_evidence_against_it() {
        let stopped = Some(StepResult::Run(RunResult::Stopped));
        let lost = Some(StepResult::Run(RunResult::Lost(
            "lost b: no heartbeat".into(),
        )));
        // The program's own failure, on every node: nobody is left out.
        let r = [
            failed(0, "exited with code 1", &["ValueError: bad"]),
            failed(1, "exited with code 1", &["ValueError: bad"]),
        ];
        assert!(pin_failures(&r).is_empty());
        // A lost node, and the consequences elsewhere.
        let r = [
            failed(0, "exited with code 1", &["connection closed"]),
            lost,
        ];
        assert_eq!(pin_failures(&r), [(1, "lost b: no heartbeat".to_string())]);
        // One node's worker killed by the system.
        let r = [stopped.clone(), failed(1, "was killed by SIGKILL", &[])];
        let p = pin_failures(&r);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].0, 1);
        assert!(p[0].1.contains("killed by the system"), "{}", p[0].1);
        // A GPU fault in one node's output only; the others failed because of it.
        let r = [
            failed(
                0,
                "exited with code 1",
                &["RuntimeError: NCCL communicator was aborted"],
            ),
            failed(
                1,
                "exited with code 1",
                &["torch.distributed.DistBackendError: NCCL error: unhandled cuda error"],
            ),
        ];
        let p = pin_failures(&r);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].0, 1);
        assert!(p[0].1.contains("GPU fault"), "{}", p[0].1);
        // The same GPU error on two nodes: more likely the program's.
        let r = [
            failed(0, "exited with code 1", &["unhandled cuda error"]),
            failed(1, "exited with code 1", &["unhandled cuda error"]),
        ];
        assert!(pin_failures(&r).is_empty());
        // A segfault (a bug as often as not) is the program's.
        let r = [stopped, failed(1, "was killed by SIGSEGV", &[])];
        assert!(pin_failures(&r).is_empty());
    }
}
