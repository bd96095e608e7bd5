//! nrun: a launcher for distributed PyTorch/NCCL jobs; the top crate of the workspace (plan,
//! session and links, watch, fault model, commands, the binary's entry).
//!
//! The crates below it, each a layer that knows nothing of those above (docs/architecture.md):
//! `nrun-base` (errors and exit codes, host names, private files), `nrun-store` (the TCPStore
//! codec, server, client, the run's secret), `nrun-preflight` (NCCL/CUDA, the all-reduce
//! worker, findings), `nrun-node` (one node's worker group: spawning, supervision, output, the
//! keeper and the spawner), `nrun-proto` (what the launcher and the agents say: `protocol`,
//! `facts`, `remote`, re-exported here under those names), `nrun-agent` (the per-node side,
//! `nrun __agent`, re-exported as `agent`: it cannot name plan, session or commands),
//! `nrun-cli` (clap definitions only).
//!
//! Map of this crate, lowest layer first; a module uses only those before it (no cycle).
//! A run flows one way: the command line becomes a [`plan::Mode`]; a [`session::Session`]
//! starts the store and one link per node, joins and checks them and drives their steps; a
//! command (the job, doctor, bisect) decides which steps.
//! - [`progress`]: bars on a terminal, plain lines elsewhere, and "still waiting" lines, for
//!   every long step.
//! - [`hosts`]: host lists: hostfile formats, Slurm hostlists, include/exclude, rank layout.
//! - `facts`, `protocol`, `remote` (from `nrun-proto`). [`report`]: how a job ended, the failure
//!   summary, JSON reports, log format. [`fault`]: the fault model: a failed attempt's
//!   evidence per node, the verdict (the program's, a node suspected, at fault or lost) and the
//!   action (restart, spare, shrink, stop).
//! - `agent` (from `nrun-agent`): the per-node side: the one step dispatcher (also the
//!   in-process node's), sampling the workers' Python stacks, and the `nrun __agent` process.
//! - [`watch`]: the coordinator's conclusions from the agents' stack samples: hangs (which rank
//!   is missing from the collective the others wait in), stragglers, a failure's likely cause.
//! - [`retry`]: when restarting cannot help: each failed attempt's signature and progress,
//!   and the streak of restarts without progress that stops the job
//!   (`--max-no-progress-restarts`).
//! - [`journal`]: the job's events and phases, one stream: the goodput ledger (derived from
//!   the phase transitions), `--events`, the metrics (`--metrics-file`, `--metrics-port`).
//! - [`plan`]: from flags to a [`plan::Mode`]: each command's own resolved settings (the
//!   session's, the workers', the preflight's...) and its nodes and rank layout; no I/O besides
//!   reading the hostfile and the filesystem checks.
//! - [`session`]: store + links + join + checks + steps + end, for one node or many; the one
//!   worker-spec builder; a c10d node's own side ([`session::c10d`]). The seam:
//!   [`session::link::NodeLink`], one per node, implemented by each kind of node (in-process,
//!   a child here or over ssh, an srun step, a c10d peer; a fake in tests).
//! - [`commands`]: one file per command (`run`, `preflight`, `doctor`, `bisect`) on a session;
//!   `report` draws a `--report` JSON as a page.

// Only `main` is public: the integration tests use the crates below as libraries, so an
// item of this crate that nobody uses is reported as dead.
pub(crate) use nrun_agent as agent;
pub(crate) mod commands;
pub(crate) use nrun_proto::facts;
pub(crate) mod fault;
pub(crate) mod hosts;
pub(crate) mod journal;
pub(crate) mod plan;
pub(crate) mod progress;
pub(crate) use nrun_proto::protocol;
pub(crate) use nrun_proto::remote;
pub(crate) mod report;
pub(crate) mod retry;
pub(crate) mod session;
pub(crate) mod watch;

use std::process::ExitCode;

/// The `nrun` binary.
pub fn main() -> ExitCode {
    // nrun re-runs itself as the preflight rank, and to read a libnccl's version in isolation;
    // these internal entry points are dispatched before the user-facing command line.
    // The ledger's zero: launch time counts from here.
    journal::mark_start();
    nrun_node::process::raise_fd_limit();
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
        nrun_node::keeper::start();
    }
    match first.as_deref().and_then(|a| a.to_str()) {
        Some("__preflight") => return ExitCode::from(nrun_preflight::worker::main()),
        Some("__agent") => return ExitCode::from(agent::main()),
        Some("__reap") => return ExitCode::from(nrun_node::keeper::reap_main(argv)),
        Some("__nccl-version") => {
            return match argv
                .next()
                .map(|p| nrun_preflight::nccl::Nccl::open(std::path::Path::new(&p)))
            {
                Some(Ok(n)) => {
                    println!("{}", n.version);
                    ExitCode::SUCCESS
                }
                Some(Err(e)) => {
                    eprintln!("{e}");
                    ExitCode::from(nrun_base::error::exit::INTERNAL)
                }
                None => ExitCode::from(nrun_base::error::exit::USAGE),
            };
        }
        _ => {}
    }
    nrun_cli::apply_pet_env();
    let cli = match nrun_cli::parse() {
        Ok(c) => c.into_default(),
        Err(e) => {
            // A closed choice refused (cli::Choice): nrun's own one line, as for any bad value.
            let ours = std::error::Error::source(&e)
                .and_then(|s| s.downcast_ref::<nrun_base::error::Error>());
            if let Some(ours) = ours {
                eprintln!("nrun: error: {ours}");
                return ExitCode::from(ours.code);
            }
            // Help and version go to stdout (exit 0); usage errors to stderr in nrun's style.
            let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
            if let Some(short) = nrun_cli::short_help(&e, &argv) {
                nrun_base::stdout(short.into_bytes());
                return ExitCode::SUCCESS;
            }
            if e.use_stderr() {
                eprintln!("{}", nrun_cli::error_text(&e));
            } else {
                let _ = e.print();
            }
            return ExitCode::from(e.exit_code().clamp(0, 255) as u8);
        }
    };
    init_logging();
    // Every file nrun creates from here on gets this mode (nrun_base::outputs).
    let files = match &cli.command {
        None => Some(&cli.run.files),
        Some(nrun_cli::Command::Bisect(b)) => Some(&b.files),
        Some(nrun_cli::Command::Report(r)) => Some(&r.files),
        _ => None,
    };
    if let Some(f) = files {
        nrun_base::outputs::set_mode(f.file_mode);
    }
    // Completions and the manual page need the command line's definition, not a plan.
    let shell = match &cli.command {
        Some(nrun_cli::Command::Completions { shell }) => Some(shell.as_str()),
        None => cli.run.print_completion.as_deref(),
        _ => None,
    };
    if let Some(shell) = shell {
        return ExitCode::from(nrun_cli::print_completions(shell));
    }
    if matches!(cli.command, Some(nrun_cli::Command::Man)) {
        return ExitCode::from(nrun_cli::print_man());
    }
    // `nrun report` reads one file and writes one: no plan, no session.
    if let Some(nrun_cli::Command::Report(a)) = &cli.command {
        return match commands::report::run(&a.input, a.output.as_deref()) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("nrun: error: {e}");
                ExitCode::from(e.code)
            }
        };
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

/// Where nrun's log lines go: stderr, or nowhere once [`nrun_base::silence_logging`] was called.
struct LogWriter;

impl std::io::Write for LogWriter {
    /// A stderr that fails (closed: `nrun ... 2>&1 | head`) loses the line, quietly: an error
    /// here is reported by the log subscriber with `eprintln!`, which panics on that stderr.
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !nrun_base::logging_silenced() {
            let _ = std::io::stderr().write_all(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
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
