//! The job: start the session, join and check the nodes, the preflight, then attempts of the
//! worker group on every node until one succeeds or --max-restarts runs out.

use std::ops::ControlFlow;

use super::preflight;

use crate::fault;
use crate::journal::{Event, Outcome, Phase};
use crate::plan::{NodesPlan, RunSettings};
use crate::protocol::StepResult;
use crate::report::schema::{
    AttemptFailure, Decision, JobReport, JobSection, PreflightOnlyReport, PreflightReport, Report,
    RetrySection, SessionParts,
};
use crate::report::{self, JobEnd, JobShape};
use crate::session::roster::Stage;
use crate::session::spec::Launch;
use crate::session::step::{Ended, StepEnd};
use crate::session::{Policy, Session};
use crate::watch::WatchState;
use nrun_base::error::{Error, Result, exit};

/// Runs the job to its end and returns nrun's exit code.
pub(crate) async fn run(
    job: &RunSettings,
    nodes: &NodesPlan,
    listener: Option<std::net::TcpListener>,
    metrics: Option<std::net::TcpListener>,
) -> Result<u8> {
    let mut s = Session::start(&job.session, nodes, listener).await?;
    s.journal.attach(&job.journal, metrics);
    job_start(&mut s, job);
    let mut rec = Record::default();
    let code = drive(&mut s, job, &mut rec).await;
    let code_of = code.as_ref().map_or_else(|e| e.code, |c| *c);
    s.journal.enter(Phase::Ending);
    // Stopped by a signal: the exit code says which (128 + its number).
    let interrupted = code
        .as_ref()
        .err()
        .filter(|e| e.code > 128)
        .map(|e| i32::from(e.code) - 128);
    s.await_last_words(interrupted.is_some()).await;
    s.settle(code.is_ok(), interrupted);
    // --report is written at the end of every job, however it ended, with the nodes left out;
    // --preflight-only's own report is the preflight's (written by it), rewritten only to add
    // the nodes left out.
    // --report-html draws the very value --report holds.
    let parts = SessionParts {
        nodes: s.nodes_report(),
        control: Some(s.control_report()).filter(|c| !c.is_empty()),
        ..SessionParts::default()
    };
    let rewrite = !job.preflight_only || parts.nodes.is_some() || parts.control.is_some();
    let value = match (job.preflight_only, &rec.preflight) {
        (false, _) => Some(Report::Job(rec.report(code_of, &s, parts))),
        (true, Some(pf)) => Some(Report::Preflight(PreflightOnlyReport {
            preflight: pf.clone(),
            session: parts,
        })),
        (true, None) => None,
    };
    s.journal.nodes(
        s.roster().active().len(),
        s.roster().out_now(),
        s.spares().len(),
    );
    // The journal outlives the session: stopping the nodes is the ledger's last phase.
    let mut journal = std::mem::replace(&mut s.journal, crate::journal::Journal::new(""));
    // Nodes whose own nrun joined (c10d) exit with the job's code.
    s.end_with(code_of).await;
    let (ledger, events) = journal.finish(code_of, rec.outcome_of(code_of));
    // The console's last line is said from the job's end as the events record it.
    let end_line = events
        .iter()
        .rev()
        .find_map(|e| e.event().and_then(Event::end_line))
        .map(str::to_string);
    let value = value.map(|mut r| {
        if let Some(parts) = r.session_mut() {
            parts.ledger = Some(ledger);
            parts.events = Some(events);
        }
        r
    });
    let written = match (&job.report, &value) {
        (Some(path), Some(v)) if rewrite => report::write_json("--report", path, v),
        _ => Ok(()),
    };
    let drawn = match (&job.report_html, value) {
        (Some(path), Some(v)) => report::html::write("--report-html", path, v, "this job"),
        _ => Ok(()),
    };
    report::said(written);
    report::said(drawn);
    // The job's last line: where its time went.
    if let Some(line) = end_line {
        tracing::info!("{line}");
    }
    code
}

/// The `job_start` event: the job's shape and command.
fn job_start(s: &mut Session, job: &RunSettings) {
    let command: Vec<String> = std::iter::once(&job.workers.program)
        .chain(&job.workers.args)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let command = command.join(" ");
    let (nnodes, world) = (s.plan.size, s.plan.world);
    if let Some(t) = job.session.c10d.as_ref().and_then(|c| c.took_over.as_ref()) {
        s.journal.took_over(t.epoch);
    }
    s.journal.emit(Event::JobStart {
        run_id: s.run_id.clone(),
        nnodes,
        nproc: job.workers.nproc,
        world_size: world,
        command,
    });
}

/// What `--report` says about the job beside the preflight's findings.
#[derive(Default)]
struct Record {
    /// The preflight's report, when one ran.
    preflight: Option<PreflightReport>,
    /// Worker groups started, and restarts after a failure (TORCHELASTIC_RESTART_COUNT).
    attempts: usize,
    restarts: u32,
    /// How the job ended ("success", "failed", "hang", "interrupted"); None: it never started.
    outcome: Option<Outcome>,
    /// The last failure, in one line (a restart may have followed it).
    headline: Option<String>,
    /// The fault model's decisions, each with its evidence.
    decisions: Vec<Decision>,
    /// Each failed attempt of the program's: its signature and progress.
    failures: Vec<AttemptFailure>,
    /// Why the job stopped with restarts left (restarting could not help).
    stopped_because: Option<String>,
}

impl Record {
    /// How the job ended, for a person and the report.
    fn outcome_of(&self, code: u8) -> &'static str {
        match (self.outcome, code) {
            (Some(o), _) => o.as_str(),
            (None, exit::SUCCESS) => "success",
            // Stopped by a signal before the workers started (Ctrl-C during the join).
            (None, c) if c > 128 => "interrupted",
            (None, _) => "not started",
        }
    }

    fn report(&self, code: u8, s: &Session, session: SessionParts) -> JobReport {
        JobReport {
            // The preflight's keys stay at the top level, where --preflight-only puts them.
            preflight: self.preflight.clone(),
            job: JobSection {
                outcome: self.outcome_of(code).to_string(),
                exit_code: Some(code),
                headline: self.headline.clone(),
                attempts: Some(self.attempts),
                restarts: Some(self.restarts),
                decisions: self.decisions.clone(),
                retry: Box::new(RetrySection {
                    failures: self.failures.clone(),
                    stopped_because: self.stopped_because.clone(),
                }),
            },
            watch: s.watch().map(WatchState::report),
            session,
        }
    }
}

async fn drive(s: &mut Session, job: &RunSettings, rec: &mut Record) -> Result<u8> {
    ready(s, Some(&crate::session::c10d::own_work(job))).await?;
    let mut code = exit::SUCCESS;
    if let Some(pf) = &job.preflight {
        s.journal.enter(Phase::Preflight);
        let mut rounds = 0;
        loop {
            let ended = preflight::run(s, job, pf, rounds).await?;
            preflight_events(s, &ended);
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
            if blamed.is_empty() || blamed.len() * 2 > s.roster().active().len() {
                break;
            }
            // A spare the bisect found bad is left out too, but only a node of the job being
            // replaced makes the preflight worth running again.
            let replaced: Vec<usize> = blamed
                .iter()
                .map(|b| b.0)
                .filter(|i| s.roster().is_active(*i))
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
pub(crate) async fn ready(s: &mut Session, own: Option<&crate::facts::OwnWork>) -> Result<()> {
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
    s.journal.enter(Phase::Join);
    let failures = s.join(false, None).await?;
    joined_events(s);
    if let Some(own) = own.filter(|_| s.plan.peers > 0) {
        for n in s.nodes.iter_mut() {
            if let Some(f) = n.joined.as_mut().and_then(|j| j.facts.as_mut()) {
                f.own.get_or_insert_with(|| own.clone());
            }
        }
    }
    // A c10d slot nobody came to is no node to leave out.
    let came_by_itself = |i: usize| s.nodes[i].link.kind().joins_by_itself;
    let started: Vec<(usize, String)> = failures
        .iter()
        .filter(|(i, _)| !came_by_itself(*i))
        .cloned()
        .collect();
    for (i, why) in &started {
        s.leave_out(*i, Stage::Join, why);
    }
    if let Err(e) = s.fill() {
        return Err(short_at_join(s, &failures, e));
    }
    if s.roster().active().len() < s.plan.size && s.elastic() {
        tracing::warn!(
            "{} of {} nodes joined; the job starts with them (--nnodes {}:{}); a node that \
             joins later is taken in (the worker group restarts with it)",
            s.roster().active().len(),
            s.plan.size,
            s.plan.min_nodes,
            s.plan.size
        );
    }
    // A static launch's node waits at node 0's store for the others, as torchrun's does.
    if s.is_static() {
        s.meet().await?;
    }
    if s.in_process() {
        // Nothing to compare on one node; what the checks would say about variables still holds.
        if let Some(w) = crate::plan::env::port_range_warning(&s.plan.env) {
            tracing::warn!("{w}");
        }
        return Ok(());
    }
    s.journal.enter(Phase::Checks);
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
        if !s.roster().is_active(i) || free > 0 {
            free -= usize::from(s.roster().is_active(i));
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
    if !s.roster().left_out().is_empty() {
        tracing::warn!(
            "the job runs on {} nodes: {} ({} left out, see above)",
            s.roster().active().len(),
            s.names(s.roster().active()),
            s.roster().left_out().len()
        );
    }
    if !spares.is_empty() {
        tracing::info!(
            "the job runs on {} nodes; spare(s): {}",
            s.roster().active().len(),
            s.names(&spares)
        );
    }
    Ok(())
}

/// Too few nodes joined: the nodes that did not, as before spares existed, then exit 98.
fn short_at_join(s: &Session, failures: &[(usize, String)], e: Error) -> Error {
    // A c10d host that took over and found no majority: its own words say why.
    if s.quorum() > 0
        || failures.is_empty()
        || s.roster().left_out().iter().any(|l| l.stage != Stage::Join)
    {
        return e;
    }
    // Most nodes failing to join is the setup's fault (ssh, nrun's path), not theirs; so is a
    // c10d node that never started.
    let by_itself = failures
        .iter()
        .all(|(i, _)| s.nodes[*i].link.kind().joins_by_itself);
    let code = match failures.len() * 2 > s.len() || by_itself {
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
    let torchrun = crate::protocol::torchrun_rdzv_key(&s.run_id);
    match s.store().is_some_and(|st| st.contains(&torchrun)) {
        true => eprintln!(
            "  a torchrun node came to {}:{} for rendezvous {:?}: this endpoint is an nrun \
             rendezvous (every node must use the same launcher): start every node with nrun, \
             or every node with torchrun",
            s.rendezvous().addr,
            s.rendezvous().port,
            s.run_id
        ),
        false => eprintln!("  hint: {}", join_hint(s, failures)),
    }
    if code == exit::NO_NODES {
        eprintln!(
            "nrun: error: the job needs {} node(s) and {} joined (exit {code}: too few healthy \
             nodes)",
            s.plan.min_nodes,
            s.roster().active().len(),
        );
    }
    Error::exit(code)
}

/// The job's root cause for every node whose own nrun joined (c10d): each ends its console with
/// it and writes it to its TORCHELASTIC_ERROR_FILE when the End comes (session::c10d).
fn tell_every_node(s: &Session, summary: &str, error_json: Option<&str>) {
    let why = crate::protocol::RootCause {
        summary: summary.to_string(),
        error_json: error_json.map(str::to_string),
    };
    if let (Some(st), Ok(v)) = (s.store(), serde_json::to_vec(&why)) {
        st.set(&s.keys().root_cause(), &v);
    }
}

/// What to check next when nodes did not join, in the words of how they start: the first
/// failed node started from here names its kind's hint; nodes whose own nrun joins (c10d: by
/// hand, a batch script, Kubernetes pods) involve no ssh or srun.
fn join_hint(s: &Session, failures: &[(usize, String)]) -> String {
    let kinds = || failures.iter().map(|(i, _)| s.nodes[*i].link.kind());
    let kind = kinds()
        .find(|k| !k.joins_by_itself)
        .or_else(|| kinds().next())
        .unwrap_or(crate::session::link::launcher(&s.plan));
    (kind.join_hint)(&s.plan, s.rendezvous())
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
    let named = Named::of(s);
    // c10d nodes with their own worker counts: the sum (as torchrun's WORLD_SIZE).
    let shape = named.shape(s.group().world, &command);
    s.set_watch(job.watch.map(WatchState::new));
    Ok(attempt_loop(s, job, &program, &args, &shape, rec).await)
}

/// Each node's label, own command and what to check if it is lost, by node index.
struct Named {
    hosts: Vec<String>,
    node_commands: Vec<Option<String>>,
    lost_hints: Vec<String>,
}

impl Named {
    fn of(s: &Session) -> Named {
        Named {
            hosts: s.nodes.iter().map(|n| n.label.clone()).collect(),
            node_commands: s
                .nodes
                .iter()
                .map(|n| {
                    let own = n.joined.as_ref()?.facts.as_ref()?.own.as_ref()?;
                    Some(own.command.join(" "))
                })
                .collect(),
            lost_hints: s
                .nodes
                .iter()
                .map(|n| (n.link.kind().lost_hint)(&n.label))
                .collect(),
        }
    }

    fn shape<'a>(&'a self, world: usize, command: &'a str) -> JobShape<'a> {
        JobShape {
            node_commands: &self.node_commands,
            hosts: &self.hosts,
            lost_hints: &self.lost_hints,
            world,
            command,
        }
    }
}

/// The session's nodes named by the preflight's findings, each with its evidence joined.
fn blamed_nodes(s: &Session, blamed: &[(String, String)]) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    for (host, why) in blamed {
        let Some(i) = s
            .roster()
            .active()
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

/// The node of the ranks the hang that stopped the job blames, when they are all on one node.
fn hang_pinned(
    s: &Session,
    group: &crate::session::spec::Group,
    stop: &crate::watch::Stop,
) -> Option<(usize, String)> {
    let w = s.watch()?;
    // Ranks that called different collectives (or sizes) are the program's doing, not a
    // node's: nobody is suspected for it (nor after they did once in this job).
    let crate::watch::Stop::Hang(d) = stop else {
        return None;
    };
    if !w.mismatches.is_empty() || d.kind == crate::watch::Kind::Disagree {
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

/// The fault model's reading of a failed (or hung) attempt: each active node's evidence, and
/// the decision under the job's policy now.
fn judge(
    s: &mut Session,
    results: &[Option<StepResult>],
    hang: Option<(usize, String)>,
    restart_left: bool,
) -> fault::Decision {
    let evidence: Vec<(usize, fault::Evidence)> = results
        .iter()
        .enumerate()
        .map(|(i, r)| match &hang {
            Some((n, why)) if *n == i => (i, fault::Evidence::Hang(why.clone())),
            _ => (i, fault::evidence(r.as_ref())),
        })
        .collect();
    let room = match s.elastic() {
        true => s.roster().active().len().saturating_sub(s.plan.min_nodes),
        false => 0,
    };
    let policy = fault::Policy {
        restart_left,
        spares: s.spares().len(),
        room,
    };
    fault::decide(&evidence, s.suspicions(), policy)
}

/// Says a decision once, with its evidence, and keeps it for --report and as an event.
/// `futile`: restarts are left, but restarting cannot help (crate::retry).
fn tell(s: &mut Session, d: &fault::Decision, attempt: u32, futile: bool, rec: &mut Record) {
    let action = match d.action {
        fault::Action::Restart if d.leave_out.is_empty() => "restart in place",
        fault::Action::Restart => "restart without the node",
        fault::Action::Stop if futile => "stop (restarting cannot help)",
        fault::Action::Stop => "stop (no restart left)",
        fault::Action::StopShort => "stop (too few healthy nodes)",
    };
    for j in &d.judged {
        let host = s.nodes[j.node].label.clone();
        let out = d.leave_out.iter().any(|(n, _)| *n == j.node);
        if j.verdict != fault::Verdict::Program {
            tracing::warn!(
                "{host}: {} ({}): {}{}",
                j.verdict.as_str(),
                j.why,
                match (out, j.verdict) {
                    (true, _) => "it leaves the job",
                    (false, fault::Verdict::Suspect) =>
                        "not enough to leave it out (a second time would be)",
                    (false, _) => "it stays: nothing can take its place",
                },
                match j.verdict {
                    fault::Verdict::Suspect | fault::Verdict::Faulty =>
                        "; the group restarts if restarts are left".to_string(),
                    _ => String::new(),
                }
            );
        }
        rec.decisions.push(Decision {
            attempt: Some(attempt),
            host: host.clone(),
            evidence: j.why.clone(),
            verdict: j.verdict.as_str().to_string(),
            left_out: out,
            action: action.to_string(),
        });
        s.journal.emit(Event::Decision {
            node: j.node,
            host,
            verdict: j.verdict.as_str().to_string(),
            action: action.to_string(),
            evidence: j.why.clone(),
            left_out: out,
        });
    }
}

/// The job's attempts until one ends it: the exit code.
async fn attempt_loop(
    s: &mut Session,
    job: &RunSettings,
    program: &str,
    args: &[String],
    shape: &JobShape<'_>,
    rec: &mut Record,
) -> u8 {
    // `attempt` numbers the worker groups started (log directories); `restarts` those after a
    // failure (TORCHELASTIC_RESTART_COUNT): an elastic job growing is not a failure.
    let mut count = Count {
        streak: crate::retry::Streak::new(job.workers.max_no_progress_restarts),
        ..Count::default()
    };
    loop {
        // Nodes started again since the job began (session::again) have indices of their own.
        let (named, wider);
        let shape = match s.len() > shape.hosts.len() {
            true => {
                named = Named::of(s);
                wider = named.shape(shape.world, shape.command);
                &wider
            }
            false => shape,
        };
        rec.attempts = count.attempt as usize + 1;
        rec.restarts = count.restarts;
        let (group, step) = match run_attempt(s, job, program, args, &count, rec).await {
            Ok(r) => r,
            Err(code) => return code,
        };
        let next = match &step.ending {
            StepEnd::Hung(stop) => after_hang(s, job, &mut count, &group, stop, &step, rec),
            // Elastic: nodes arrived while the group ran; it was stopped to take them in.
            StepEnd::Grow => grown(s, &mut count, rec),
            _ => after_end(s, job, &mut count, shape, &step, rec),
        };
        if let ControlFlow::Break(code) = next {
            return code;
        }
        count.attempt += 1;
    }
}

/// Worker groups started so far, restarts after a failure or a hang, and the restarts in a row
/// that made no progress.
#[derive(Clone, Default)]
struct Count {
    attempt: u32,
    restarts: u32,
    streak: crate::retry::Streak,
}

impl Count {
    fn restart_left(&self, job: &RunSettings) -> bool {
        self.restarts < job.workers.max_restarts
    }

    /// One more restart, in the journal too: how many so far.
    fn restart(&mut self, s: &mut Session) -> u32 {
        self.restarts += 1;
        s.journal.restart(self.restarts);
        self.restarts
    }
}

/// The watch stopped a hung attempt: the fault model's decision on it, applied (a restart
/// goes on; a stop is the job's end, exit 97, or 98 where the group cannot re-form).
fn after_hang(
    s: &mut Session,
    job: &RunSettings,
    count: &mut Count,
    group: &crate::session::spec::Group,
    stop: &crate::watch::Stop,
    step: &Ended,
    rec: &mut Record,
) -> ControlFlow<u8> {
    s.journal.attempt_end(Outcome::Hang, exit::HANG);
    let pinned = hang_pinned(s, group, stop);
    // A hang pinned on a node is the fault model's (a node suspected), not the program's.
    let signature = match pinned {
        None => Some(crate::retry::hang_signature(
            stop,
            s.watch().and_then(|w| w.mismatches.last()),
        )),
        Some(_) => None,
    };
    let futile = no_progress(s, job, count, &step.results, signature, rec);
    let restart_left = count.restart_left(job) && futile.is_none();
    let (_, applied) = apply(
        s,
        &step.results,
        pinned,
        restart_left,
        futile.is_some(),
        count.attempt,
        rec,
    );
    match applied {
        Applied::Restarted => {
            let restarts = count.restart(s);
            tracing::warn!(
                "restarting the worker group after the hang ({restarts} of {} restarts)",
                job.workers.max_restarts
            );
            ControlFlow::Continue(())
        }
        Applied::CannotReform(why) => {
            eprintln!("nrun: error: {why}; the job cannot go on");
            rec.outcome = Some(Outcome::Hang);
            ControlFlow::Break(exit::NO_NODES)
        }
        Applied::Stopped => {
            let code = hang_stop(s, stop, rec);
            if let Some(g) = futile {
                let line = give_up(s, job, count, &g, rec);
                eprint!("{line}");
            }
            ControlFlow::Break(code)
        }
    }
}

/// Elastic: the group stopped to take in nodes that arrived re-forms with them (not a failure:
/// the next one starts a streak of its own).
fn grown(s: &mut Session, count: &mut Count, rec: &mut Record) -> ControlFlow<u8> {
    count.streak.reset();
    s.journal.attempt_end(Outcome::Interrupted, exit::SUCCESS);
    s.journal.enter(Phase::Waiting);
    if let Err(why) = s.reform(&[]) {
        eprintln!("nrun: error: {why}; the job cannot go on");
        rec.outcome = Some(Outcome::Failed);
        return ControlFlow::Break(exit::CLUSTER);
    }
    ControlFlow::Continue(())
}

/// An attempt whose workers all ended: success and an interrupt end the job; a failure gets the
/// fault model's decision, applied (a restart goes on; a stop says why and ends the job).
fn after_end(
    s: &mut Session,
    job: &RunSettings,
    count: &mut Count,
    shape: &JobShape<'_>,
    step: &Ended,
    rec: &mut Record,
) -> ControlFlow<u8> {
    let (code, headline, summary, error_json) = match report::job_end(shape, &step.results) {
        JobEnd::Success => {
            return ControlFlow::Break(ended(s, rec, Outcome::Success, exit::SUCCESS));
        }
        JobEnd::Interrupted(c) => {
            ended(s, rec, Outcome::Interrupted, c);
            tracing::warn!(
                "stopped by {}; every worker was stopped",
                nrun_node::signal_name(i32::from(c) - 128)
            );
            return ControlFlow::Break(c);
        }
        JobEnd::Failed {
            code,
            headline,
            summary,
            error_json,
        } => (code, headline, summary, error_json),
    };
    ended(s, rec, Outcome::Failed, code);
    rec.headline = Some(headline.clone());
    let first = report::first_failure(&step.results).map(|(_, r)| r);
    let signature = Some(crate::retry::signature(first));
    let futile = no_progress(s, job, count, &step.results, signature, rec);
    let restart_left = count.restart_left(job) && futile.is_none();
    let (d, applied) = apply(
        s,
        &step.results,
        None,
        restart_left,
        futile.is_some(),
        count.attempt,
        rec,
    );
    let told = match applied {
        Applied::Restarted => {
            let restarts = count.restart(s);
            tracing::warn!(
                "{headline}; restarting the worker group ({restarts} of {} restarts)",
                job.workers.max_restarts
            );
            return ControlFlow::Continue(());
        }
        Applied::CannotReform(why) => {
            let lost = d.judged.iter().any(|j| j.verdict == fault::Verdict::Lost);
            match lost {
                false => format!("{summary}nrun: error: {why}; the job cannot go on\n"),
                true => format!("{}nrun: error: {why}\n", lost_text(s, &d)),
            }
        }
        Applied::Stopped if d.action == fault::Action::StopShort => format!(
            "{}nrun: error: the job cannot go on without it: no restart left \
             (--max-restarts; exit {}: too few healthy nodes)\n",
            lost_text(s, &d),
            exit::NO_NODES
        ),
        Applied::Stopped => {
            // Restarts left but no use: the failure's summary, then why the job stops.
            let summary = match &futile {
                Some(g) => summary + &give_up(s, job, count, g, rec),
                None => summary,
            };
            return ControlFlow::Break(stop_failed(s, job, shape, code, summary, error_json));
        }
    };
    eprint!("{told}");
    tell_every_node(s, &told, error_json.as_deref());
    ControlFlow::Break(exit::NO_NODES)
}

/// The restart policy's other stop (crate::retry): a failed attempt counted towards
/// --max-no-progress-restarts where it is the program's alone (every node's evidence the
/// program's, no hang pinned on a node: `signature` given), else the streak starts anew; the
/// attempt's signature and progress kept for --report. Some: restarts are left, but the job
/// stops, and why.
fn no_progress(
    s: &Session,
    job: &RunSettings,
    count: &mut Count,
    results: &[Option<StepResult>],
    signature: Option<crate::retry::Signature>,
    rec: &mut Record,
) -> Option<crate::retry::GiveUp> {
    let programs = results.iter().all(|r| {
        matches!(
            fault::evidence(r.as_ref()),
            fault::Evidence::Clear | fault::Evidence::Program(_)
        )
    });
    let Some(signature) = signature.filter(|_| programs) else {
        count.streak.reset();
        return None;
    };
    let regex = job.workers.progress.as_ref().map(|p| p.step);
    let collectives = s.watch().and_then(|w| w.collectives_completed());
    let progress = crate::retry::progress(results, regex, collectives);
    let (measure, value) = progress.map_or(("", None), |p| p.parts());
    let failed = crate::retry::Failed {
        attempt: count.attempt,
        signature: signature.clone(),
        progress,
    };
    let stop = count.streak.failed(failed);
    rec.failures.push(AttemptFailure {
        attempt: count.attempt,
        signature: signature.to_string(),
        progress: progress.map(|p| p.to_string()),
        progress_measure: Some(measure.to_string()).filter(|m| !m.is_empty()),
        progress_value: value,
        no_progress_restarts: count.streak.count(),
    });
    stop.filter(|_| count.restart_left(job))
}

/// The job stops with restarts left: the line that says why (said by the caller), kept for
/// --report and as an event.
fn give_up(
    s: &mut Session,
    job: &RunSettings,
    count: &Count,
    g: &crate::retry::GiveUp,
    rec: &mut Record,
) -> String {
    let left = job.workers.max_restarts.saturating_sub(count.restarts);
    let why = g.why(left);
    rec.stopped_because = Some(why.clone());
    s.journal.emit(Event::NoProgressStop {
        base: g.base,
        first: g.first,
        last: g.last,
        signature: g.signature.to_string(),
        progress: g.best.to_string(),
        limit: g.limit,
        restarts_left: left,
    });
    format!("nrun: stopping: {why}\n")
}

/// The attempt ended, and with it the job (as far as this attempt knows): the record's outcome
/// and the journal's attempt, kept together. Returns `code`.
fn ended(s: &mut Session, rec: &mut Record, outcome: Outcome, code: u8) -> u8 {
    rec.outcome = Some(outcome);
    s.journal.attempt_end(outcome, code);
    code
}

/// Starts one attempt's worker group and waits for it to end: the group and each node's
/// result; Err: the job's exit code (nrun was stopped, or the session failed).
async fn run_attempt(
    s: &mut Session,
    job: &RunSettings,
    program: &str,
    args: &[String],
    count: &Count,
    rec: &mut Record,
) -> Result<(crate::session::spec::Group, Ended), u8> {
    let (attempt, restarts) = (count.attempt, count.restarts);
    if attempt > 0
        && let Some(st) = s.store()
    {
        st.clear_user_keys();
    }
    let world = s.group().world;
    s.reset_watch(world);
    let launch = Launch {
        port: s.rendezvous().port,
        attempt,
        restart_count: restarts,
        program,
        args,
        logs: true,
        scratch: "job",
        extra: &|_| Vec::new(),
        grace_ms: job.shutdown_timeout.as_millis() as u64,
        deadline_ms: None,
        watch: s.watch().map(|w| w.plan.hang_timeout),
        secret: false,
    };
    let group = s.group();
    let steps = s.steps(&job.workers, &group, &launch);
    s.journal.nodes(
        s.roster().active().len(),
        s.roster().out_now(),
        s.spares().len(),
    );
    let hosts = group.members.iter().map(|m| s.nodes[m.node].label.clone());
    s.journal.attempt_start(attempt, world, hosts.collect());
    match s.run_step(steps, Policy::Together).await {
        Ok(step) => {
            failed_events(s, &step.results);
            Ok((group, step))
        }
        Err(e) => {
            let outcome = match e.code > 128 {
                true => Outcome::Interrupted,
                false => Outcome::Failed,
            };
            ended(s, rec, outcome, e.code);
            Err(e.code)
        }
    }
}

/// What applying the fault model's decision did.
enum Applied {
    /// The group re-formed without the nodes left out: the next attempt starts.
    Restarted,
    /// A restart was decided but the group cannot re-form (too few nodes left).
    CannotReform(Error),
    /// No restart: the nodes left out are recorded as such (--exclude-file, --report).
    Stopped,
}

/// The fault model's decision on an attempt's end (a hang the watch stopped, pinned on a node
/// or not, or a failure), told and applied: the nodes kept are flagged; a restart re-forms the
/// group without the nodes left out, a stop records them as left out. One path for a hang and
/// a failure alike; what is said and the exit code are the caller's.
fn apply(
    s: &mut Session,
    results: &[Option<StepResult>],
    hang: Option<(usize, String)>,
    restart_left: bool,
    futile: bool,
    attempt: u32,
    rec: &mut Record,
) -> (fault::Decision, Applied) {
    let d = judge(s, results, hang, restart_left);
    tell(s, &d, attempt, futile, rec);
    for (i, why) in &d.kept {
        s.flag(*i, why);
    }
    // A node lost (its agent or link) may join again; one a fault was pinned on may not.
    let gone: Vec<(usize, Stage, String)> = d
        .leave_out
        .iter()
        .map(|(i, why)| {
            let lost = d
                .judged
                .iter()
                .any(|j| j.node == *i && j.verdict == fault::Verdict::Lost);
            let stage = if lost { Stage::Lost } else { Stage::Run };
            (*i, stage, why.clone())
        })
        .collect();
    let applied = match d.action {
        fault::Action::Restart => match s.reform(&gone) {
            Ok(()) => Applied::Restarted,
            Err(why) => Applied::CannotReform(why),
        },
        fault::Action::Stop | fault::Action::StopShort => {
            for (i, stage, why) in &gone {
                s.leave_out(*i, *stage, why);
            }
            Applied::Stopped
        }
    };
    (d, applied)
}

/// The nodes a decision found lost, each with what to check: the cause of the attempt's end
/// (their peers' failures are its consequences).
fn lost_text(s: &Session, d: &fault::Decision) -> String {
    d.judged
        .iter()
        .filter(|j| j.verdict == fault::Verdict::Lost)
        .map(|j| {
            format!(
                "nrun: error: {}; every worker on the other nodes was stopped\n  hint: {}\n",
                j.why,
                (s.nodes[j.node].link.kind().lost_hint)(&s.nodes[j.node].label)
            )
        })
        .collect()
}

/// The watch stopped a hung job and no restart follows: exit 97.
fn hang_stop(s: &Session, stop: &crate::watch::Stop, rec: &mut Record) -> u8 {
    let what = match stop {
        crate::watch::Stop::Mismatch => "calling a collective differently on some ranks",
        crate::watch::Stop::Hang(_) => "hung",
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
    rec.outcome = Some(Outcome::Hang);
    exit::HANG
}

/// The last attempt failed: the summary with the watch's likely cause, the root cause to every
/// node and to the launcher's error file; the failure's exit code.
fn stop_failed(
    s: &Session,
    job: &RunSettings,
    shape: &JobShape<'_>,
    code: u8,
    summary: String,
    error_json: Option<String>,
) -> u8 {
    // The watch's likely cause goes right under the headline.
    let summary = match s.watch().and_then(|w| w.cause(shape.hosts)) {
        Some(cause) => summary.replacen('\n', &format!("\n{cause}"), 1),
        None => summary,
    };
    eprint!("{summary}");
    tell_every_node(s, &summary, error_json.as_deref());
    // torchrun's habit: the launcher's own error file gets the root cause.
    if let (Some(path), Some(json)) = (&job.launcher_error_file, error_json)
        && let Err(e) = nrun_base::outputs::replace(path, json.as_bytes())
    {
        tracing::warn!(
            "cannot write TORCHELASTIC_ERROR_FILE {}: {e}",
            path.display()
        );
    }
    code
}

/// A `node_joined` event for every node that joined, with its facts in brief.
fn joined_events(s: &mut Session) {
    let joined: Vec<Event> = s
        .joined()
        .map(|(i, n, j)| {
            let f = j.facts.as_ref();
            Event::NodeJoined {
                node: i,
                host: n.label.clone(),
                gpus: f.map_or(0, |f| f.gpus.len()),
                nccl: f
                    .and_then(|f| f.nccl.first())
                    .and_then(|l| l.version.clone()),
                torch: f.and_then(|f| f.torch.clone()),
                ifname: j.ifname.clone(),
            }
        })
        .collect();
    for e in joined {
        s.journal.emit(e);
    }
}

/// A `preflight_size` event per size the preflight measured, and `preflight_end`.
fn preflight_events(s: &mut Session, ended: &preflight::Ended) {
    let r = ended.report.as_ref();
    let line_rate = r.and_then(|r| r.line_rate.as_ref()?.gbs);
    let rows = r.map(|r| r.rows.clone()).unwrap_or_default();
    for row in rows {
        let o = &row["out_of_place"];
        s.journal.emit(Event::PreflightSize {
            bytes: row["bytes"].as_u64(),
            busbw_gbs: o["busbw_gbs"].as_f64(),
            algbw_gbs: o["algbw_gbs"].as_f64(),
            line_rate_gbs: line_rate,
        });
    }
    let verdict = r.map_or("none", |r| r.verdict.as_str());
    s.journal.emit(Event::PreflightEnd {
        exit_code: ended.code,
        verdict: verdict.to_string(),
    });
}

/// A `worker_failed` event for each node's failure in an attempt's results.
fn failed_events(s: &mut Session, results: &[Option<StepResult>]) {
    use crate::protocol::RunResult;
    for (i, r) in results.iter().enumerate() {
        let Some(StepResult::Run(r)) = r else {
            continue;
        };
        let (rank, how, exit_code, signal) = match r {
            RunResult::Failed(f) => (
                Some(f.rank),
                f.how.to_string(),
                Some(f.exit_code),
                f.how.signal_name(),
            ),
            RunResult::SpawnError(e) => (None, format!("could not start: {e}"), None, None),
            RunResult::TimedOut => (None, "timed out".to_string(), None, None),
            RunResult::Lost(why) => (None, format!("lost: {why}"), None, None),
            _ => continue,
        };
        let host = s.nodes[i].label.clone();
        s.journal.emit(Event::WorkerFailed {
            node: i,
            host,
            rank,
            how,
            exit_code,
            signal,
        });
    }
}
