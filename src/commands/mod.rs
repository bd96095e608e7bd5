//! One file per command, each on top of a [`crate::session::Session`]:
//! - [`run`]: the job (the default command): join, check, preflight, attempts.
//! - [`preflight`]: the preflight phase, and the one place a preflight's reports are gathered
//!   and summarized (the job's and bisect's probes).
//! - [`doctor`]: facts and checks, running nothing.
//! - [`bisect`]: the staged scale-up.
//! - [`report`]: a `--report` JSON drawn as a page (no session).

pub(crate) mod bisect;
pub(crate) mod doctor;
pub(crate) mod preflight;
pub(crate) mod report;
pub(crate) mod run;

use crate::plan::Mode;
use nrun_base::error::{Error, Result};

/// Runs what the command line asked for; returns nrun's exit code.
pub(crate) fn execute(mode: Mode) -> Result<u8> {
    let session = match &mode {
        Mode::Run { run, .. } => &run.session,
        Mode::Doctor { doctor, .. } => &doctor.session,
        Mode::Bisect { bisect, .. } => &bisect.session,
    };
    let nodes = match &mode {
        Mode::Run { nodes, .. } | Mode::Doctor { nodes, .. } | Mode::Bisect { nodes, .. } => nodes,
    };
    crate::session::link::check(nodes)?;
    // c10d, started again with the same command: a node that took over hosting, as this
    // machine's last succession names it, is the host now (not the endpoint's).
    let moved = match &mode {
        Mode::Run { run, .. } => run
            .session
            .c10d
            .as_ref()
            .and_then(crate::session::c10d::current_host),
        _ => None,
    };
    let listener = match (&session.c10d, &moved) {
        (Some(_), Some(_)) => None,
        // c10d: the nrun on the endpoint's host that binds its port hosts; the rest join.
        (Some(_), None) => crate::session::bind_rendezvous(session)?,
        (None, _) => crate::session::bind_store(session)?,
    };
    // --metrics-port, bound as early: a port that cannot be had is a usage error. Only by the
    // nrun that hosts the job: a c10d node that joins another's serves none (it says so).
    let metrics = match &mode {
        Mode::Run { run, .. } if session.c10d.is_none() || listener.is_some() => {
            crate::journal::metrics::bind(run.journal.metrics_port.as_ref())?
        }
        _ => None,
    };
    // Agents started on this host or over ssh are started by a small process forked now,
    // while nrun has one thread and few descriptors (see node::spawner).
    if crate::session::link::needs_spawner(nodes) {
        nrun_node::spawner::fork(crate::agent::forked);
    }
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(1, 4);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|e| Error::internal(format!("cannot start the async runtime: {e}")))?;
    // The command's future runs on this (main) thread; in-process workers are spawned from it,
    // which their PR_SET_PDEATHSIG relies on.
    let started = std::time::Instant::now();
    let code = match mode {
        Mode::Run { run, nodes } => match (&run.session.c10d, listener) {
            (Some(c), None) => {
                let c = moved.as_ref().unwrap_or(c);
                rt.block_on(c10d_node(&run, &nodes, Role::Join(c), None))
            }
            (Some(_), Some(l)) => rt.block_on(c10d_node(&run, &nodes, Role::Host(l), metrics)),
            (None, listener) => rt.block_on(run::run(&run, &nodes, listener, metrics)),
        },
        Mode::Doctor { doctor, nodes } => rt.block_on(doctor::run(&doctor, &nodes, listener)),
        Mode::Bisect { bisect, nodes } => rt.block_on(bisect::run(&bisect, &nodes, listener)),
    };
    // What nrun itself cost (its watch and store included, not its workers): for benchmarks.
    if let Ok(u) = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF) {
        let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
        tracing::debug!(
            "nrun's own CPU: {:.3} s user + {:.3} s system in {:.3} s",
            secs(u.user_time()),
            secs(u.system_time()),
            started.elapsed().as_secs_f64()
        );
    }
    code
}

/// What a c10d node does next.
enum Role<'a> {
    /// Join the rendezvous hosted there.
    Join(&'a crate::plan::C10d),
    /// Host the job on this bound port.
    Host(std::net::TcpListener),
}

/// A c10d node's life, until its job ends: joined to the host, hosting, taking over hosting
/// when the host is lost, or standing down as the host and joining the current one as a fresh
/// node (see session::succession).
async fn c10d_node(
    run: &crate::plan::RunSettings,
    nodes: &crate::plan::NodesPlan,
    role: Role<'_>,
    metrics: Option<std::net::TcpListener>,
) -> Result<u8> {
    use crate::session::c10d::{self, Served};
    let mut served = match role {
        Role::Join(c) => c10d::join(run, nodes, c).await?,
        Role::Host(l) => Served::Host(Box::new(run.clone()), l),
    };
    // Only the first host serves --metrics-port; a node that takes over says so (c10d::join).
    let mut metrics = metrics;
    loop {
        let (job, listener) = match served {
            Served::Ended(code) => return Ok(code),
            Served::Host(job, listener) => (job, listener),
        };
        let code = Box::pin(run::run(&job, nodes, Some(listener), metrics.take())).await;
        // A host that stood down (a newer host, or no majority left with it): its node joins
        // the current host as a fresh node.
        served = match crate::session::succession::stood_down() {
            Some(succ) => c10d::rejoin(&job, nodes, succ).await?,
            None => return code,
        };
    }
}
