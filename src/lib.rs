//! nrun: a launcher for distributed PyTorch/NCCL jobs.
//!
//! Map of the crate. A run flows one way: the command line becomes a [`plan::Mode`]; a
//! [`session::Session`] starts the store and one link per node, joins and checks them and
//! drives their steps; a command (the job, doctor, bisect) decides which steps.
//! - [`cli`]: clap definitions only: the default run, `doctor`, `bisect`; flattened flag groups.
//! - [`plan`]: from flags to a [`plan::Mode`]: each command's own resolved settings (the
//!   session's, the workers', the preflight's...) and its nodes and rank layout; no I/O besides
//!   reading the hostfile and the filesystem checks.
//! - [`hosts`]: host lists: hostfile formats, Slurm hostlists, include/exclude, rank layout.
//! - [`commands`]: one file per command (`run`, `preflight`, `doctor`, `bisect`) on a session.
//! - [`session`]: store + links + join + checks + steps + end, for one node or many; the one
//!   worker-spec builder. The seam: [`session::link::NodeLink`], one per node, implemented by
//!   each kind of agent (in-process, a child here or over ssh, an srun step, a c10d peer; a
//!   fake in tests); only [`session::link::start`] knows the kinds.
//! - [`agent`]: the per-node side: the protocol (messages and keys), the one step dispatcher
//!   ([`agent::exec::dispatch`], also the in-process node's), sampling the workers' Python
//!   stacks, and the `nrun __agent` process.
//! - [`remote`]: ssh and srun command lines (pure).
//! - [`node`]: one node's worker group: spawning, process groups, stop requests, output, logs;
//!   the keeper, and the spawner that starts the agents.
//! - [`store`]: the TCPStore protocol: a pure codec, the tokio server, a client, and the
//!   proof of the run's secret (challenge-response, sealed steps).
//! - [`preflight`]: NCCL by path, CUDA through cudarc, the per-rank worker, the verdict.
//! - [`net`]: interfaces, this host's name, routes. [`facts`]: what a node reports, compared.
//! - [`watch`]: the coordinator's conclusions from the agents' stack samples: hangs (which rank
//!   is missing from the collective the others wait in), stragglers, a failure's likely cause.
//! - [`fault`]: the fault model: a failed attempt's evidence per node, the verdict (the
//!   program's, a node suspected, at fault or lost) and the action (restart, spare, shrink, stop).
//! - [`report`]: how a job ended, the failure summary, JSON reports, log format.
//! - [`error`]: errors for people and the exit codes. [`files`]: private directories, bounded
//!   reads.

// Public: what the integration tests (tests/*.rs) use as a library (the store, NCCL by path,
// interfaces) and `node`, whose owners still prune it; the rest is the crate's own, so an
// item nobody uses is reported as dead.
pub(crate) mod agent;
pub(crate) mod cli;
pub(crate) mod commands;
pub(crate) mod error;
pub(crate) mod facts;
pub(crate) mod fault;
pub(crate) mod files;
pub(crate) mod hosts;
pub mod net;
pub mod node;
pub(crate) mod plan;
pub mod preflight;
pub(crate) mod remote;
pub(crate) mod report;
pub(crate) mod session;
pub mod store;
pub(crate) mod watch;

use std::process::ExitCode;

use clap::Parser;

/// The `nrun` binary.
pub fn main() -> ExitCode {
    // nrun re-runs itself as the preflight rank, and to read a libnccl's version in isolation;
    // these internal entry points are dispatched before the user-facing command line.
    node::process::raise_fd_limit();
    let mut argv = std::env::args_os().skip(1);
    let first = argv.next();
    // Everything but a preflight rank, a library probe or an agent of nrun on this very host
    // (covered by that nrun's keeper) gets a keeper (see node::keeper): forked here, before any
    // thread exists.
    let kept = match first.as_deref().and_then(|a| a.to_str()) {
        Some("__preflight" | "__nccl-version" | "__reap") => false,
        Some("__agent") => !agent::tie_to_parent(),
        _ => true,
    };
    if kept {
        node::keeper::start();
    }
    match first.as_deref().and_then(|a| a.to_str()) {
        Some("__preflight") => return ExitCode::from(preflight::worker::main()),
        Some("__agent") => return ExitCode::from(agent::main()),
        Some("__reap") => return ExitCode::from(node::keeper::reap_main(argv)),
        Some("__nccl-version") => {
            return match argv
                .next()
                .map(|p| preflight::nccl::Nccl::open(std::path::Path::new(&p)))
            {
                Some(Ok(n)) => {
                    println!("{}", n.version);
                    ExitCode::SUCCESS
                }
                Some(Err(e)) => {
                    eprintln!("{e}");
                    ExitCode::from(error::exit::INTERNAL)
                }
                None => ExitCode::from(error::exit::USAGE),
            };
        }
        _ => {}
    }
    cli::apply_pet_env();
    let cli = match cli::Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // A closed choice refused (cli::Choice): nrun's own one line, as for any bad value.
            let ours = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<error::Error>());
            if let Some(ours) = ours {
                eprintln!("nrun: error: {ours}");
                return ExitCode::from(ours.code);
            }
            // clap prints help/version to stdout (exit 0) and usage errors to stderr (exit 2).
            let _ = e.print();
            return ExitCode::from(e.exit_code().clamp(0, 255) as u8);
        }
    };
    init_logging();
    // Completions and the manual page need the command line's definition, not a plan.
    let shell = match &cli.command {
        Some(cli::Command::Completions { shell }) => Some(shell.as_str()),
        None => cli.run.print_completion.as_deref(),
        _ => None,
    };
    if let Some(shell) = shell {
        return ExitCode::from(cli::print_completions(shell));
    }
    if matches!(cli.command, Some(cli::Command::Man)) {
        return ExitCode::from(cli::print_man());
    }
    let env = |k: &str| std::env::var(k).ok();
    match plan::resolve(cli, &env).and_then(commands::execute) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if e.has_message() {
                eprintln!("nrun: error: {e}");
            }
            ExitCode::from(e.code)
        }
    }
}

/// Where nrun's log lines go: stderr, or nowhere once [`silence_logging`] was called.
struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match SILENT.load(std::sync::atomic::Ordering::Relaxed) {
            true => Ok(buf.len()),
            false => std::io::stderr().write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

static SILENT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// An agent forked from nrun's spawner (see node::spawner) inherits nrun's log subscriber,
/// where an exec'd agent has none: it says nothing through it, as an exec'd one does not.
pub(crate) fn silence_logging() {
    SILENT.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// NRUN_LOG=error|warn|info|debug|trace sets how much nrun says (default info).
fn init_logging() {
    use tracing::level_filters::LevelFilter;
    let level = match std::env::var("NRUN_LOG")
        .as_deref()
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Ok("error") => LevelFilter::ERROR,
        Ok("warn") | Ok("warning") => LevelFilter::WARN,
        Ok("debug") => LevelFilter::DEBUG,
        Ok("trace") => LevelFilter::TRACE,
        Ok("off") | Ok("quiet") => LevelFilter::OFF,
        _ => LevelFilter::INFO,
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(|| LogWriter)
        .event_format(report::LogFormat)
        .try_init();
}
