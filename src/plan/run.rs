//! The job's settings (the default command): [`RunSettings::resolve`] in steps of one concern
//! each: the rendezvous ([`job_rdzv`]), the command, the log files, what the workers get, the
//! session; and the watch over the running job.

use std::ffi::OsString;
use std::path::PathBuf;

use nrun_base::error::{Error, Result};
use nrun_cli::{
    ColorWhen, JobArgs, OnHang, RendezvousArgs, RunArgs, TargetArgs, WatchArgs, WatchWhen,
    WorkerArgs,
};

use super::parse::{
    check_prefix_template, parse_bytes, parse_rank_set, parse_signals, parse_stdin, positive_secs,
    resolve_nproc,
};
use super::preflight::resolve_preflight;
use super::program::{find_python, resolve_command};
use super::rdzv::{JobRdzv, check_conflicts, job_rdzv, resolve_store};
use super::{
    ConsolePlan, Env, LogPlan, ProgressPlan, RunSettings, SessionPlan, Shape, StorePlan,
    StreamSpec, WorkersPlan, nodes,
};

impl RunSettings {
    /// The job's settings from the default command's flags. Checked in the order the flags'
    /// concerns are resolved, so that of several bad values the same one is named first.
    pub(super) fn resolve(run: &RunArgs, env: Env<'_>) -> Result<RunSettings> {
        let uses_hosts = uses_hosts(run, env);
        let RunArgs {
            workers: WorkerArgs { nproc_per_node },
            rdzv,
            job,
            target,
            preflight,
            watch,
            nodes,
            compat,
            // Handled before a plan is made (see `lib.rs`).
            print_completion: _,
            // Set before a plan is made (see `lib.rs`).
            files: _,
            command,
        } = run;
        compat.notes();
        check_conflicts(rdzv, nodes)?;
        if preflight.preflight_only && !command.is_empty() {
            return Err(Error::usage(format!(
                "--preflight-only runs the preflight alone, not {0}: drop --preflight-only to \
                 run {0} after the preflight, or drop {0} to test the nodes only",
                command[0]
            )));
        }
        // nrun reacts to exits at once; accepted (and checked) for torchrun's command lines.
        if let Some(m) = job.monitor_interval {
            positive_secs("--monitor-interval", m, true)?;
        }
        // Not given: torchrun's 1, whatever slots a host list or scheduler gives.
        let nproc = resolve_nproc(nproc_per_node.as_deref().unwrap_or("1"), env)?;
        let rz = job_rdzv(rdzv, uses_hosts, env)?;
        let shutdown_timeout = positive_secs("--shutdown-timeout", job.shutdown_timeout, true)?;
        let preflight_plan = resolve_preflight(preflight, env)?;
        let command = job_command(target, command, env)?;
        let python = find_python(target.python.as_deref(), env);
        let store = match &rz.c10d {
            // As with a host list: every node learns its store address when it joins.
            Some(c) => StorePlan::Host {
                port: c.port,
                advertise: String::new(),
            },
            None => resolve_store(rdzv, rz.nnodes, uses_hosts)?,
        };
        let log = LogPlan::for_job(job, nproc, &rz.run_id)?;
        let shape = Shape {
            nproc,
            nproc_given: nproc_per_node.is_some(),
            nnodes: rz.nnodes,
            nnodes_given: rdzv.nnodes.is_some(),
            min_nodes: rz.min_nodes,
            node_rank: rz.node_rank,
            last_call: rz.last_call,
            rdzv_join_timeout: rz.rdzv_join_timeout,
            c10d: rz.c10d.is_some(),
            ranked: ranked(rdzv) || rdzv.standalone,
            python: !target.no_python && python.is_some(),
        };
        let several_nodes = rz.nnodes > 1 || uses_hosts;
        let workers = WorkersPlan::for_job(job, nproc, command, log, several_nodes, env)?;
        let session = SessionPlan::for_job(rdzv, job, rz, store, uses_hosts, python, env)?;
        Ok(RunSettings {
            session,
            workers,
            shape,
            shutdown_timeout,
            preflight: preflight_plan,
            preflight_only: preflight.preflight_only,
            watch: resolve_watch(watch)?,
            report: preflight.report.clone(),
            report_html: job.report_html.clone(),
            journal: journal_plan(job, preflight.report.as_ref())?,
            launcher_error_file: env("TORCHELASTIC_ERROR_FILE")
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
        })
    }
}

/// The files the job writes (`--report`, `--report-html`, `--events`, `--metrics-file`) must be
/// writable now: see [`check_outputs`]. `--metrics-port` is bound by the command.
fn journal_plan(job: &JobArgs, report: Option<&PathBuf>) -> Result<crate::journal::JournalPlan> {
    check_outputs(&[
        ("--report", report),
        ("--report-html", job.report_html.as_ref()),
        ("--events", job.events.as_ref()),
        ("--metrics-file", job.metrics_file.as_ref()),
    ])?;
    Ok(crate::journal::JournalPlan {
        events: job.events.clone(),
        metrics_file: job.metrics_file.clone(),
        metrics_port: match &job.metrics_port {
            Some(given) => Some((given.clone(), metrics_addr(given)?)),
            None => None,
        },
    })
}

/// `--metrics-port [ADDR:]PORT`: a port alone is on loopback (a scraper on this host, as
/// exporters serve by default); an address is taken as given (`0.0.0.0:9464`, `[::1]:9464`).
fn metrics_addr(given: &str) -> Result<std::net::SocketAddr> {
    let t = given.trim();
    if let Ok(port) = t.parse::<u16>() {
        return Ok((std::net::Ipv4Addr::LOCALHOST, port).into());
    }
    t.parse().map_err(|_| {
        Error::usage(format!(
            "--metrics-port {given}: give a port (9464, served on 127.0.0.1) or an address and \
             a port (0.0.0.0:9464 for every IPv4 interface, [::]:9464 for IPv6)"
        ))
    })
}

/// Files a command writes must be writable before it starts: a usage error, not a job that runs
/// for hours and then cannot say what happened. Checked without creating anything (the file,
/// or its directory where it does not exist yet).
pub(crate) fn check_outputs(outputs: &[(&str, Option<&PathBuf>)]) -> Result<()> {
    for (flag, path) in outputs {
        if let Some(p) = path
            && let Err(why) = writable(flag, p)
        {
            // A refusal says what to do itself.
            let why = match why.starts_with("refusing") {
                true => why,
                false => format!("cannot write it ({why}); give a file in a writable directory"),
            };
            return Err(Error::usage(format!("{flag} {}: {why}", p.display())));
        }
    }
    Ok(())
}

/// Whether `p` can be written (created in its directory, replaced there, or appended to for
/// `--events` and `--exclude-file`): why not ([`nrun_base::outputs::check`]).
fn writable(flag: &str, p: &std::path::Path) -> std::result::Result<(), String> {
    let append = matches!(flag, "--events" | "--exclude-file");
    nrun_base::outputs::check(p, append).map_err(|e| e.to_string())
}

/// `--log-dir` must take the run's directory now (this host's; each node makes its own at
/// the start): made where it does not exist, so the nearest part of the path that does must be
/// a directory this user may write in. Not a job that starts and then cannot log.
fn check_log_dir(d: &std::path::Path) -> Result<()> {
    use nix::unistd::{AccessFlags, access};
    let given = d.display();
    let mut at = d;
    let meta = loop {
        match std::fs::metadata(at) {
            Ok(m) => break m,
            // Missing, or under a file: the parts above say which.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                at = match at.parent() {
                    Some(p) if p.as_os_str().is_empty() => std::path::Path::new("."),
                    Some(p) => p,
                    None => return Ok(()),
                }
            }
            Err(e) => {
                return Err(Error::usage(format!(
                    "--log-dir {given}: cannot reach {}: {e}; give a directory you may write in",
                    at.display()
                )));
            }
        }
    };
    if !meta.is_dir() {
        return Err(Error::usage(format!(
            "--log-dir {given}: {} is not a directory; give a directory for the workers' logs",
            at.display()
        )));
    }
    access(at, AccessFlags::W_OK | AccessFlags::X_OK).map_err(|e| {
        Error::usage(format!(
            "--log-dir {given}: nrun cannot create the run's log directory in {} ({}, as uid \
             {}); give a directory you may write in, or leave --log-dir out",
            at.display(),
            std::io::Error::from(e),
            nix::unistd::geteuid()
        ))
    })
}

/// Whether nrun starts the nodes itself: a host list, or a scheduler's allocation of several
/// nodes (Slurm's salloc or sbatch, not a step on every node; PBS, LSF, SGE), where `--nnodes N` without a rank or an address
/// takes its nodes from the allocation, the rest of it being spares.
fn uses_hosts(run: &RunArgs, env: Env<'_>) -> bool {
    // `--standalone` is this node alone, inside an allocation too.
    let allocation =
        nodes::in_allocation(&run.nodes, env) && !ranked(&run.rdzv) && !run.rdzv.standalone;
    run.nodes.hosts.is_some() || run.nodes.hostfile.is_some() || allocation
}

/// A torchrun-style launch by rank or address: every node's own nrun takes its place by them.
fn ranked(rdzv: &RendezvousArgs) -> bool {
    rdzv.node_rank.is_some() || rdzv.master_addr.is_some() || rdzv.rdzv_endpoint.is_some()
}

/// The job's program and arguments; none for a preflight alone (no TARGET).
fn job_command(
    target: &TargetArgs,
    command: &[String],
    env: Env<'_>,
) -> Result<(OsString, Vec<OsString>)> {
    if let Some(name) = command.first().filter(|c| nrun_cli::is_command_name(c)) {
        return Err(Error::usage(format!(
            "`{name}` is a command: give its flags after it (nrun {name} -H ...); a script or \
             program named {name} runs as ./{name}"
        )));
    }
    if command.is_empty() {
        return Ok((OsString::new(), Vec::new()));
    }
    resolve_command(target, command, env).map_err(|mut e| {
        // `nrun -H a,b run x.py`: run as a command comes first.
        if command[0] == "run" {
            e.message += "; to run a job, `run` comes first: nrun run [OPTIONS] TARGET";
        }
        e
    })
}

impl LogPlan {
    /// `--redirects`, `--tee`, `--local-ranks-filter` and `--log-dir`: which streams go to files
    /// and where, and which ranks reach the console.
    fn for_job(job: &JobArgs, nproc: usize, run_id: &str) -> Result<LogPlan> {
        let redirects = match &job.redirects {
            Some(s) => StreamSpec::parse("--redirects", s)?,
            None => StreamSpec::None,
        };
        let tee = match &job.tee {
            Some(s) => StreamSpec::parse("--tee", s)?,
            None => StreamSpec::None,
        };
        let console_ranks = match &job.local_ranks_filter {
            None => None,
            Some(s) => Some(parse_rank_set(s, nproc)?),
        };
        let wants_files = !redirects.is_none() || !tee.is_none();
        // torchrun's layout: a directory of its own for each run, `<run id>_<random>`, so a
        // second run with the same --log-dir and id keeps the first's logs.
        let (base, dir_is_temp) = match &job.log_dir {
            Some(d) => {
                nrun_base::files::check_parent_dir(d)
                    .map_err(|e| Error::usage(format!("--log-dir: {e}")))?;
                check_log_dir(d)?;
                (Some(d.clone()), false)
            }
            None if wants_files => (Some(std::env::temp_dir()), true),
            None => (None, false),
        };
        let dir = match base {
            Some(b) => {
                let suffix = nrun_base::random_hex()
                    .map_err(|e| Error::internal(format!("cannot read random bytes: {e}")))?;
                let prefix = if dir_is_temp { "nrun-logs-" } else { "" };
                Some(b.join(format!("{prefix}{run_id}_{}", &suffix[..8])))
            }
            None => None,
        };
        Ok(LogPlan {
            dir,
            redirects,
            tee,
            console_ranks,
        })
    }
}

impl WorkersPlan {
    /// What the job's workers get: the command, torchrun's defaults where the environment
    /// leaves them unset, the console, stdin, and the role and binding flags.
    fn for_job(
        job: &JobArgs,
        nproc: usize,
        (program, args): (OsString, Vec<OsString>),
        log: LogPlan,
        several_nodes: bool,
        env: Env<'_>,
    ) -> Result<WorkersPlan> {
        // Every job flag named, so that a new one is not forgotten: the timeouts are read by
        // `RunSettings::resolve`, the log flags by `LogPlan::for_job`.
        let JobArgs {
            max_restarts,
            max_no_progress_restarts,
            progress_regex,
            monitor_interval: _,
            shutdown_timeout: _,
            log_dir: _,
            redirects: _,
            tee: _,
            local_ranks_filter: _,
            report_html: _,
            role,
            log_line_prefix_template,
            color,
            signals_to_handle,
            stdin,
            virtual_local_rank,
            numa_binding,
            // The journal's consumers: `journal_plan`.
            events: _,
            metrics_file: _,
            metrics_port: _,
        } = job;
        Ok(WorkersPlan {
            nproc,
            program,
            args,
            role: role.clone(),
            max_restarts: *max_restarts,
            max_no_progress_restarts: *max_no_progress_restarts,
            progress: progress_regex
                .as_deref()
                .map(ProgressPlan::parse)
                .transpose()?,
            log,
            set_omp_threads: nproc > 1 && env("OMP_NUM_THREADS").is_none(),
            set_async_error_handling: env("TORCH_NCCL_ASYNC_ERROR_HANDLING").is_none(),
            console: ConsolePlan {
                prefix_template: match log_line_prefix_template {
                    Some(t) => Some(check_prefix_template(t)?),
                    None => None,
                },
                color: resolve_color(*color),
            },
            stdin_rank: parse_stdin(stdin.as_deref(), several_nodes)?,
            signals_to_handle: signals_to_handle.clone(),
            virtual_local_rank: *virtual_local_rank,
            numa_binding: match numa_binding.as_deref() {
                None => false,
                Some("node" | "socket" | "exclusive" | "core-complex") => true,
                Some(other) => {
                    return Err(Error::usage(format!(
                        "--numa-binding {other:?}: expected node, socket, exclusive or core-complex"
                    )));
                }
            },
        })
    }
}

impl SessionPlan {
    /// The job's session: its rendezvous, store, the store's bound, the signals passed on, and
    /// a static launch's secret.
    fn for_job(
        rdzv: &RendezvousArgs,
        job: &JobArgs,
        rz: JobRdzv,
        store: StorePlan,
        uses_hosts: bool,
        python: Option<PathBuf>,
        env: Env<'_>,
    ) -> Result<SessionPlan> {
        let JobRdzv {
            nnodes,
            run_id,
            c10d,
            ..
        } = rz;
        Ok(SessionPlan {
            store,
            store_max_bytes: parse_bytes("--store-max-bytes", &rdzv.store_max_bytes)?,
            forward_signals: parse_signals(&job.signals_to_handle)?,
            static_secret: env("NRUN_RDZV_SECRET")
                .filter(|v| !v.is_empty() && nnodes > 1 && !uses_hosts && c10d.is_none())
                .map(|v| nrun_store::auth::derive(v.as_bytes(), &run_id)),
            run_id,
            c10d,
            python,
            control_addr: rdzv.local_addr.clone().filter(|_| uses_hosts),
        })
    }
}

/// How long a rank may wait in one collective before a hang is diagnosed, unless given.
const HANG_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The watch: on unless turned off. `auto` and `on` differ no more: with either, each node's
/// agent watches every worker whose process tree runs Python (a `--no-python` wrapper that
/// execs or starts python included) and leaves other programs alone.
fn resolve_watch(args: &WatchArgs) -> Result<Option<crate::watch::WatchPlan>> {
    use crate::watch::WatchPlan;
    let WatchArgs {
        watch,
        hang_timeout,
        on_hang,
    } = args;
    let on = match watch {
        WatchWhen::Auto | WatchWhen::On => true,
        WatchWhen::Off => false,
    };
    // The watch's flags with the watch off would do nothing: refused, as any conflict.
    if let (false, Some(flag)) = (
        on,
        [
            (hang_timeout.is_some(), "--hang-timeout"),
            (*on_hang == Some(OnHang::Stop), "--on-hang stop"),
        ]
        .iter()
        .find_map(|(given, flag)| given.then_some(*flag)),
    ) {
        return Err(Error::usage(format!(
            "--watch off and {flag} exclude each other: with the watch off no hang is found; \
             drop one of them"
        )));
    }
    let hang_timeout = match hang_timeout {
        Some(t) => positive_secs("--hang-timeout", *t, false)?,
        None => HANG_TIMEOUT,
    };
    Ok(on.then_some(WatchPlan {
        hang_timeout,
        on_hang: on_hang.unwrap_or(OnHang::Report),
    }))
}

/// `--color`: auto (decided where the lines are written: [`nrun_node::output::colours`]),
/// always, never.
fn resolve_color(when: ColorWhen) -> nrun_node::output::Color {
    use nrun_node::output::Color;
    match when {
        ColorWhen::Auto => Color::Auto,
        ColorWhen::Always => Color::Always,
        ColorWhen::Never => Color::Never,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::tests::{plan, worker_env};
    use crate::plan::{StorePlan, WorkerSlot};

    #[test]
    fn worker_env_matches_torchrun() {
        let p = plan(&["--nproc", "4", "--no-python", "true"]).unwrap();
        let env = worker_env(
            &p,
            &WorkerSlot {
                local_rank: 2,
                restart_count: 1,
                master_addr: "127.0.0.1",
                master_port: 1234,
                error_file: Path::new("/tmp/e.json"),
            },
        );
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("2"));
        assert_eq!(get("LOCAL_RANK"), Some("2"));
        assert_eq!(get("WORLD_SIZE"), Some("4"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("4"));
        assert_eq!(get("GROUP_RANK"), Some("0"));
        assert_eq!(get("ROLE_NAME"), Some("default"));
        assert_eq!(get("MASTER_PORT"), Some("1234"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("1"));
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), Some("True"));
        assert_eq!(get("TORCHELASTIC_ERROR_FILE"), Some("/tmp/e.json"));
        // A run nrun starts alone gets a fresh UUID, as torchrun's standalone runs.
        let id = get("TORCHELASTIC_RUN_ID").unwrap();
        assert_eq!(
            (id.len(), &id[14..15], id.matches('-').count()),
            (36, "4", 4),
            "{id}"
        );
    }

    #[test]
    fn static_multi_node_ranks_and_store() {
        let p = plan(&[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc",
            "4",
            "--master-addr",
            "10.0.0.1",
            "--no-python",
            "true",
        ])
        .unwrap();
        assert_eq!(
            p.session.store,
            StorePlan::Remote {
                addr: "10.0.0.1".into(),
                port: 29500
            }
        );
        let env = worker_env(
            &p,
            &WorkerSlot {
                local_rank: 3,
                restart_count: 0,
                master_addr: "10.0.0.1",
                master_port: 29500,
                error_file: Path::new("/e"),
            },
        );
        assert!(env.contains(&("RANK".into(), "7".into())));
        assert!(env.contains(&("WORLD_SIZE".into(), "8".into())));
        assert!(
            plan(&["--nnodes", "2", "--no-python", "true"])
                .unwrap_err()
                .message
                .contains("--master-addr")
        );
    }

    #[test]
    fn a_command_name_after_run_flags_is_refused() {
        let e = plan(&["-H", "a,b", "doctor"]).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
        assert!(e.message.contains("runs as ./doctor"), "{}", e.message);
    }
}
