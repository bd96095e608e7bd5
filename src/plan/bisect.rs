//! `nrun bisect`'s settings: the probe (a preflight sweep, or the user's command), the stages'
//! rules, and the shape of its nodes.

use std::ffi::OsString;

use nrun_base::error::{Error, Result};
use nrun_cli::{BisectArgs, Probe, ProbeArgs, WorkerArgs};

use super::parse::{positive_secs, resolve_nproc};
use super::preflight::sweep_plan;
use super::program::{find_python, resolve_command};
use super::{BisectSettings, ConsolePlan, Env, LogPlan, SessionPlan, Shape, WorkersPlan};

impl BisectSettings {
    /// bisect's groups: the probe's preflight (nccl, net) or the user's command (cmd); and the
    /// shape of its nodes (`--nproc` on every host).
    pub(super) fn resolve(args: &BisectArgs, env: Env<'_>) -> Result<(BisectSettings, Shape)> {
        let BisectArgs {
            workers: WorkerArgs { nproc_per_node },
            probe:
                ProbeArgs {
                    probe,
                    slow_factor,
                    timeout,
                    write_hostfile,
                    write_exclude,
                    report,
                    report_html,
                },
            target,
            sweep,
            nodes,
            local_addr,
            // Set before a plan is made (see `lib.rs`).
            files: _,
            command,
        } = args;
        if let Some(a) = local_addr {
            super::rdzv::check_host("--local-addr", a)?;
        }
        let nproc = resolve_nproc(nproc_per_node.as_deref().unwrap_or("1"), env)?;
        let probe = *probe;
        if probe == Probe::Cmd && command.is_empty() {
            return Err(Error::usage(
                "--probe cmd runs your command: give it after `--`",
            ));
        }
        if probe != Probe::Cmd && !command.is_empty() {
            return Err(Error::usage(format!(
                "a command ({}) is only run with --probe cmd",
                command.join(" ")
            )));
        }
        if !(*slow_factor > 0.0 && *slow_factor <= 1.0) {
            return Err(Error::usage(format!(
                "--slow-factor {slow_factor} must be in (0, 1]"
            )));
        }
        let timeout = positive_secs("--timeout", *timeout, false)?;
        let preflight = match probe {
            Probe::Cmd => None,
            Probe::Net => Some(sweep_plan(sweep, nrun_preflight::Mode::Net)?),
            Probe::Nccl => Some(sweep_plan(sweep, nrun_preflight::Mode::Nccl)?),
        };
        let (program, args) = if command.is_empty() {
            (OsString::new(), Vec::new())
        } else {
            resolve_command(target, command, env)?
        };
        let python = find_python(target.python.as_deref(), env);
        let shape = Shape::per_host(nproc, !target.no_python && python.is_some());
        // A probe's workers: torchrun's defaults, every line on the console, no log files.
        let workers = WorkersPlan {
            nproc,
            program,
            args,
            role: "default".into(),
            max_restarts: 0,
            max_no_progress_restarts: 0,
            progress: None,
            log: LogPlan::default(),
            set_omp_threads: false,
            set_async_error_handling: false,
            console: ConsolePlan::default(),
            stdin_rank: None,
            virtual_local_rank: false,
            numa_binding: false,
            signals_to_handle: String::new(),
        };
        if *write_exclude && nodes.exclude_file.is_none() {
            return Err(Error::usage(
                "--write-exclude appends to --exclude-file PATH: give that too",
            ));
        }
        super::run::check_outputs(&[
            ("--report", report.as_ref()),
            ("--report-html", report_html.as_ref()),
            ("--write-hostfile", write_hostfile.as_ref()),
            (
                "--exclude-file",
                nodes.exclude_file.as_ref().filter(|_| *write_exclude),
            ),
        ])?;
        Ok((
            BisectSettings {
                session: SessionPlan::own("bisect", "", python, local_addr.clone()),
                workers,
                sweep: preflight,
                probe,
                slow_factor: *slow_factor,
                timeout,
                write_hostfile: write_hostfile.clone(),
                write_exclude: *write_exclude,
                report: report.clone(),
                report_html: report_html.clone(),
            },
            shape,
        ))
    }
}
