//! nrun: a launcher for distributed PyTorch/NCCL jobs.
//!
//! Map of the crate (the phases of a run flow top to bottom):
//! - [`cli`]: clap definitions only; torchrun spellings; NRUN_*/PET_* environment.
//! - [`plan`]: from flags to a [`plan::Plan`]: workers, command, environment, logs. Pure.
//! - [`store`]: the TCPStore-protocol server that workers rendezvous on, and its client.
//! - [`node`]: spawning and supervising a node's workers: process groups, signals, output.
//! - [`coordinator`]: the phases wired together.
//! - [`report`]: how failures and log lines look.
//! - [`error`]: errors for people and the exit codes.

pub mod agent;
pub mod bisect;
pub mod cli;
pub mod cluster;
pub mod coordinator;
pub mod error;
pub mod facts;
pub mod hosts;
pub mod net;
pub mod node;
pub mod plan;
pub mod preflight;
pub mod remote;
pub mod report;
pub mod store;

use std::process::ExitCode;

use clap::Parser;

/// The `nrun` binary.
pub fn main() -> ExitCode {
    // nrun re-runs itself as the preflight rank, and to read a libnccl's version in isolation;
    // these internal entry points are dispatched before the user-facing command line.
    let mut argv = std::env::args_os().skip(1);
    match argv.next().as_deref().and_then(|a| a.to_str()) {
        Some("__preflight") => return ExitCode::from(preflight::worker::main()),
        Some("__agent") => return ExitCode::from(agent::main()),
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
    // `nrun doctor ...` is `nrun --doctor ...`: the same flags, no target.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == "doctor" || a == "bisect") {
        args[1] = format!("--{}", args[1].to_string_lossy()).into();
    }
    let cli = match cli::Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            // clap prints help/version to stdout (exit 0) and usage errors to stderr (exit 2).
            let _ = e.print();
            return ExitCode::from(e.exit_code().clamp(0, 255) as u8);
        }
    };
    init_logging();
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("nrun: error: {e}");
            ExitCode::from(e.code)
        }
    }
}

fn run(cli: cli::Cli) -> error::Result<u8> {
    let env = |k: &str| std::env::var(k).ok();
    let plan = plan::Plan::from_cli(&cli, &env)?;
    let cluster = cluster::plan_cluster(&cli, &plan, &env)?;
    let listener = coordinator::bind_store(&plan)?;
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(1, 4);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|e| error::Error::internal(format!("cannot start the async runtime: {e}")))?;
    // The coordinator future runs on this (main) thread; workers are spawned from it, which
    // their PR_SET_PDEATHSIG relies on.
    if cli.doctor && cluster.is_none() {
        return Ok(cluster::doctor_local(&plan));
    }
    if cli.bisect {
        let Some(cp) = cluster else {
            return Err(error::Error::usage(
                "nrun bisect needs nodes: -H, --hostfile, or a Slurm allocation of several nodes",
            ));
        };
        let probe = match cli.probe.as_str() {
            "nccl" => bisect::Probe::Nccl,
            "net" => bisect::Probe::Net,
            "cmd" if cli.command.is_empty() => {
                return Err(error::Error::usage(
                    "--probe cmd runs your command: give it after `--`",
                ));
            }
            "cmd" => bisect::Probe::Cmd,
            other => {
                return Err(error::Error::usage(format!(
                    "--probe {other:?}: expected nccl, net or cmd"
                )));
            }
        };
        let valid = cli.slow_factor > 0.0
            && cli.slow_factor <= 1.0
            && cli.timeout.is_finite()
            && cli.timeout > 0.0;
        if !valid {
            return Err(error::Error::usage(
                "--slow-factor must be in (0, 1] and --timeout a positive number of seconds",
            ));
        }
        let bp = bisect::BisectPlan {
            probe,
            slow_factor: cli.slow_factor,
            timeout: std::time::Duration::from_secs_f64(cli.timeout),
            write_hostfile: cli.write_hostfile.clone(),
            report: cli.report.clone(),
            hostfile_text: cli
                .hostfile
                .as_ref()
                .and_then(|f| std::fs::read_to_string(f).ok()),
        };
        let Some(l) = listener else {
            return Err(error::Error::internal("no store for bisect"));
        };
        return rt.block_on(bisect::run(&plan, &cp, &bp, l));
    }
    match (cluster, listener) {
        (Some(cp), Some(l)) => rt.block_on(cluster::run(&plan, &cp, l)),
        (Some(_), None) => Err(error::Error::internal("no store for a multi-node run")),
        (None, l) => rt.block_on(coordinator::run(plan, l)),
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
        .with_writer(std::io::stderr)
        .event_format(report::LogFormat)
        .try_init();
}
