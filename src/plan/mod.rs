//! From the command line to a [`Mode`]: what nrun was asked to do, as each command's own
//! resolved settings ([`RunSettings`], [`DoctorSettings`], [`BisectSettings`], uv's habit),
//! built from shared parts: the session's ([`SessionPlan`]: store, run id, signals), the
//! workers' ([`WorkersPlan`]: command, environment, logs, console), the nodes' [`Shape`]; and
//! on which nodes ([`nodes`]).
//! Decided once, before anything starts; no I/O besides reading the hostfile and `.nrun_env`,
//! resolving the target on the filesystem and counting GPUs, so every rule is unit-tested.
//!
//! - [`nodes`]: host lists, rank layout, how agents start, what every worker gets ([`env`]).
//! - [`env`]: forwarded variables, `.nrun_env`, `-x`, and warnings about variables.

pub(crate) mod env;
pub(crate) mod exclude;
#[cfg(test)]
mod fuzz;
pub(crate) mod nodes;
pub(crate) mod tree;

pub(crate) use nodes::NodesPlan;

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nrun_base::error::{Error, Result};
use nrun_cli::{
    BisectArgs, Cli, ColorWhen, Command, DoctorArgs, JobArgs, PreflightArgs, Probe, ProbeArgs,
    RendezvousArgs, RunArgs, SweepArgs, TargetArgs, WatchArgs, WatchWhen, WorkerArgs,
};
use nrun_node::find_program;

/// Where the store lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StorePlan {
    /// nrun hosts it: bind `port` (0 = any free port); workers reach it at `advertise` (an
    /// address, or a host name the user chose).
    Host { port: u16, advertise: String },
    /// Another node's nrun hosts it (torchrun-style static multi-node, node rank > 0).
    Remote { addr: String, port: u16 },
}

/// Which of a worker's streams go where; torchrun's 0..3 encoding (1 stdout, 2 stderr, 3 both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Streams(pub u8);

impl Streams {
    pub(crate) fn stdout(self) -> bool {
        self.0 & 1 != 0
    }
    pub(crate) fn stderr(self) -> bool {
        self.0 & 2 != 0
    }
}

/// A per-local-rank stream spec: "3" for every rank, or "0:3,1:1".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum StreamSpec {
    #[default]
    None,
    All(Streams),
    PerRank(Vec<(usize, Streams)>),
}

impl StreamSpec {
    pub(crate) fn parse(flag: &str, s: &str) -> Result<StreamSpec> {
        let bad = || {
            Error::usage(format!(
                "{flag} {s:?} is not a stream spec: use 0 (none), 1 (stdout), 2 (stderr), 3 (both), \
                 or per local rank like 0:3,1:1"
            ))
        };
        let level = |v: &str| match v.trim().parse::<u8>() {
            Ok(n @ 0..=3) => Ok(Streams(n)),
            _ => Err(bad()),
        };
        if !s.contains(':') {
            return Ok(StreamSpec::All(level(s)?));
        }
        let mut v = Vec::new();
        for part in s.split(',') {
            let (r, l) = part.split_once(':').ok_or_else(bad)?;
            v.push((r.trim().parse::<usize>().map_err(|_| bad())?, level(l)?));
        }
        Ok(StreamSpec::PerRank(v))
    }

    pub(crate) fn for_rank(&self, local_rank: usize) -> Streams {
        match self {
            StreamSpec::None => Streams(0),
            StreamSpec::All(s) => *s,
            StreamSpec::PerRank(v) => v
                .iter()
                .find(|(r, _)| *r == local_rank)
                .map_or(Streams(0), |(_, s)| *s),
        }
    }

    fn is_none(&self) -> bool {
        match self {
            StreamSpec::None => true,
            StreamSpec::All(s) => s.0 == 0,
            StreamSpec::PerRank(v) => v.iter().all(|(_, s)| s.0 == 0),
        }
    }
}

/// Where worker output goes besides the console.
#[derive(Clone, Debug, Default)]
pub(crate) struct LogPlan {
    /// Root of the per-rank log files; `None`: no files.
    pub dir: Option<PathBuf>,
    pub redirects: StreamSpec,
    /// Local ranks whose output reaches the console; `None`: all.
    pub console_ranks: Option<BTreeSet<usize>>,
}

/// The preflight, when one runs.
#[derive(Clone, Debug)]
pub(crate) struct PreflightPlan {
    pub mode: nrun_preflight::Mode,
    /// Start the job even if the preflight fails.
    pub warn_only: bool,
    pub min_bytes: u64,
    pub max_bytes: u64,
    pub factor: u64,
    pub iters: u32,
    pub warmup: u32,
    pub timeout: Duration,
    pub min_busbw: Option<f64>,
    /// Slow under this fraction of the links' line rate (one node).
    pub min_efficiency: f64,
    /// GPU health checks not to fail on.
    pub waived: Vec<nrun_preflight::hardware::Waiver>,
    pub report: Option<PathBuf>,
    pub nccl_lib: Option<PathBuf>,
    pub loopback: bool,
}

/// What a session needs from any command: where the store lives, who may write nrun's keys,
/// and what every agent is told.
#[derive(Clone, Debug)]
pub(crate) struct SessionPlan {
    /// The run's name (TORCHELASTIC_RUN_ID; log directories; a static launch's keys).
    pub run_id: String,
    pub store: StorePlan,
    /// Most bytes the store holds for its clients.
    pub store_max_bytes: u64,
    /// Signals passed on to the workers without stopping the job.
    pub forward_signals: Vec<i32>,
    /// The same command on every node, rendezvousing as torchrun's c10d.
    pub c10d: Option<C10d>,
    /// A static --node-rank launch's secret for nrun's keys, derived from NRUN_RDZV_SECRET and
    /// the run id when every node has it (None: the store is open, as torchrun's).
    pub static_secret: Option<String>,
    /// The Python interpreter the job uses (or would use): torch's NCCL, the nodes' facts.
    pub python: Option<PathBuf>,
}

impl SessionPlan {
    /// A session of nrun's own (doctor, bisect) on a store it hosts on any free port, named
    /// `run_id`, open to nothing but its agents.
    fn own(run_id: &str, advertise: &str, python: Option<PathBuf>) -> SessionPlan {
        SessionPlan {
            run_id: run_id.into(),
            store: StorePlan::Host {
                port: 0,
                advertise: advertise.into(),
            },
            store_max_bytes: nrun_store::server::DEFAULT_MAX_BYTES,
            forward_signals: Vec::new(),
            c10d: None,
            static_secret: None,
            python,
        }
    }
}

/// What every worker of a group gets, besides its place: the job's, or a bisect probe's.
#[derive(Clone, Debug)]
pub(crate) struct WorkersPlan {
    /// Workers per node.
    pub nproc: usize,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub role: String,
    pub max_restarts: u32,
    pub log: LogPlan,
    /// Whether OMP_NUM_THREADS gets torchrun's default of 1 (unset and more than one worker).
    pub set_omp_threads: bool,
    /// Whether TORCH_NCCL_ASYNC_ERROR_HANDLING gets torchrun's default of 1 (unset).
    pub set_async_error_handling: bool,
    /// How worker lines look on the console.
    pub console: ConsolePlan,
    /// The rank that reads nrun's stdin, if any.
    pub stdin_rank: Option<usize>,
    /// Every worker sees LOCAL_RANK=0 and only its own GPU.
    pub virtual_local_rank: bool,
    /// Each worker bound to the CPUs of its GPU's NUMA node.
    pub numa_binding: bool,
    /// `--signals-to-handle` as given, exported as TORCHELASTIC_SIGNALS_TO_HANDLE (torchrun sets
    /// it in its own environment, which its workers inherit); empty: not set.
    pub signals_to_handle: String,
}

/// The nodes and workers a command asks for, which [`NodesPlan::resolve`] lays out on hosts.
#[derive(Clone, Debug)]
pub(crate) struct Shape {
    pub nproc: usize,
    /// Nodes wanted (the most, for an elastic range).
    pub nnodes: usize,
    /// Elastic `--nnodes MIN:MAX`: the job goes on with at least this many nodes.
    pub min_nodes: usize,
    /// This node's rank in a static launch.
    pub node_rank: usize,
    /// `--rdzv-conf last_call_timeout`: how long to wait for more nodes once MIN have joined.
    pub last_call: Duration,
    /// `--rdzv-conf join_timeout=S`, which overrides --join-timeout.
    pub rdzv_join_timeout: Option<Duration>,
    /// Nodes rendezvous as torchrun's c10d.
    pub c10d: bool,
    /// The nodes' Python can be probed for torch (a Python job, an interpreter found).
    pub python: bool,
}

impl Shape {
    /// `--nnodes` as the user wrote it: "4" or "2:4".
    pub(crate) fn nnodes_text(&self) -> String {
        match self.min_nodes < self.nnodes {
            true => format!("{}:{}", self.min_nodes, self.nnodes),
            false => self.nnodes.to_string(),
        }
    }

    /// `nproc` workers on each node of a host list (doctor, bisect: the list decides how many).
    fn per_host(nproc: usize, python: bool) -> Shape {
        Shape {
            nproc,
            nnodes: 1,
            min_nodes: 1,
            node_rank: 0,
            last_call: LAST_CALL,
            rdzv_join_timeout: None,
            c10d: false,
            python,
        }
    }

    pub(crate) fn world_size(&self) -> usize {
        self.nproc * self.nnodes
    }
}

/// The job's settings (the default command), decided before anything starts.
#[derive(Clone, Debug)]
pub(crate) struct RunSettings {
    pub session: SessionPlan,
    pub workers: WorkersPlan,
    pub shape: Shape,
    pub shutdown_timeout: Duration,
    pub preflight: Option<PreflightPlan>,
    /// Only the preflight runs (no TARGET).
    pub preflight_only: bool,
    /// The watch over the running job, when it runs.
    pub watch: Option<crate::watch::WatchPlan>,
    /// `--report FILE`: the preflight's and the watch's findings as JSON.
    pub report: Option<PathBuf>,
    /// TORCHELASTIC_ERROR_FILE set for nrun itself: the root cause goes there on failure.
    pub launcher_error_file: Option<PathBuf>,
}

/// `nrun doctor`'s settings: a session to join and check the nodes (its Python is the one
/// probed for torch).
#[derive(Clone, Debug)]
pub(crate) struct DoctorSettings {
    pub session: SessionPlan,
}

/// torchrun's c10d rendezvous: every node runs the same nrun command; the one on the endpoint's
/// host that binds its port hosts the store and drives the job, the others join it and get
/// node ranks in join order.
#[derive(Clone, Debug)]
pub(crate) struct C10d {
    pub host: String,
    pub port: u16,
    pub id: String,
    /// Derived from NRUN_RDZV_SECRET when every node has it; None: nrun's keys are open.
    pub secret: Option<String>,
    /// This node's index when the launcher fixed it (srun: SLURM_NODEID; 0 hosts the store);
    /// None: the nrun that binds the endpoint hosts, the others join in order.
    pub node: Option<usize>,
}

/// How worker lines look on the console.
#[derive(Clone, Debug, Default)]
pub(crate) struct ConsolePlan {
    /// `--log-line-prefix-template`: None for nrun's own prefix.
    pub prefix_template: Option<String>,
    pub color: nrun_node::output::Color,
}

/// What nrun was asked to do, decided once from the command line (ripgrep's LowArgs -> HiArgs):
/// each command's own resolved settings (uv's), and the nodes.
#[derive(Debug)]
pub(crate) enum Mode {
    /// The job (and its preflight), on one node or many.
    Run { run: RunSettings, nodes: NodesPlan },
    /// Facts and checks only (of this host alone without a host list).
    Doctor {
        doctor: DoctorSettings,
        nodes: NodesPlan,
    },
    /// The staged scale-up over the nodes.
    Bisect {
        bisect: BisectSettings,
        nodes: NodesPlan,
    },
}

/// `nrun bisect`'s settings: its session, what each group's workers get, and the stages' rules.
#[derive(Clone, Debug)]
pub(crate) struct BisectSettings {
    pub session: SessionPlan,
    pub workers: WorkersPlan,
    /// The sweep of the nccl and net probes (None: --probe cmd).
    pub sweep: Option<PreflightPlan>,
    pub probe: Probe,
    pub slow_factor: f64,
    pub timeout: Duration,
    pub write_hostfile: Option<PathBuf>,
    /// Append the nodes found not good to --exclude-file.
    pub write_exclude: bool,
    pub report: Option<PathBuf>,
}

type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Decides the [`Mode`] from the parsed command line, the environment and the filesystem.
pub(crate) fn resolve(cli: Cli, env: Env<'_>) -> Result<Mode> {
    let Cli { command, run } = cli;
    match command {
        None => {
            let run_settings = RunSettings::resolve(&run, env)?;
            let nodes = NodesPlan::resolve(&run.nodes, &run_settings.shape, env)?;
            Ok(Mode::Run {
                run: run_settings,
                nodes,
            })
        }
        Some(Command::Doctor(args)) => {
            let DoctorArgs { python, nodes } = *args;
            let python = find_python(python.as_deref(), env);
            let shape = Shape::per_host(1, python.is_some());
            let nodes = NodesPlan::resolve(&nodes, &shape, env)?;
            let doctor = DoctorSettings {
                session: SessionPlan::own("doctor", "127.0.0.1", python),
            };
            Ok(Mode::Doctor { doctor, nodes })
        }
        Some(Command::Completions { .. } | Command::Man) => Err(Error::internal(
            "completions and the manual page are printed before a plan is made",
        )),
        Some(Command::Bisect(args)) => {
            let (bisect, shape) = BisectSettings::resolve(&args, env)?;
            let nodes = NodesPlan::resolve(&args.nodes, &shape, env)?;
            if nodes.in_process {
                return Err(Error::usage(
                    "nrun bisect needs nodes: -H, --hostfile, or a Slurm allocation of several nodes",
                ));
            }
            Ok(Mode::Bisect { bisect, nodes })
        }
    }
}

impl RunSettings {
    /// The job's settings from the default command's flags.
    fn resolve(run: &RunArgs, env: Env<'_>) -> Result<RunSettings> {
        // Inside a Slurm allocation of several nodes (salloc, sbatch; not a step on every
        // node), `--nnodes N` without a rank or an address takes its nodes from the allocation,
        // the rest of it being spares.
        let allocation = nodes::in_allocation(&run.nodes, env)
            && run.rdzv.node_rank.is_none()
            && run.rdzv.master_addr.is_none()
            && run.rdzv.rdzv_endpoint.is_none();
        let uses_hosts = run.nodes.hosts.is_some() || run.nodes.hostfile.is_some() || allocation;
        let RunArgs {
            workers: WorkerArgs { nproc_per_node },
            rdzv,
            job:
                JobArgs {
                    max_restarts,
                    // nrun reacts to exits at once; accepted (and checked) for torchrun's
                    // command lines.
                    monitor_interval,
                    shutdown_timeout,
                    log_dir,
                    redirects,
                    tee,
                    local_ranks_filter,
                    role,
                    log_line_prefix_template,
                    color,
                    signals_to_handle,
                    stdin,
                    virtual_local_rank,
                    numa_binding,
                },
            target,
            preflight,
            watch,
            nodes: _,
            compat,
            // Handled before a plan is made (see `lib.rs`).
            print_completion: _,
            command,
        } = run;
        compat.notes();
        if let Some(m) = monitor_interval {
            positive_secs("--monitor-interval", *m, true)?;
        }
        let nproc = resolve_nproc(nproc_per_node, env)?;
        // Elastic MIN:MAX: up to MAX nodes, going on with MIN or more.
        let (min_nodes, nnodes) = parse_nnodes(&rdzv.nnodes)?;
        let (rdzv_join_timeout, last_call) = parse_rdzv_conf(rdzv.rdzv_conf.as_deref())?;
        if let Some(a) = &rdzv.master_addr {
            check_host("--master-addr", a)?;
        }
        if let Some(a) = &rdzv.local_addr {
            check_host("--local-addr", a)?;
        }
        // The run id names log directories and goes into store keys and the workers'
        // environment: one path component of a plain charset.
        let run_id = match &rdzv.rdzv_id {
            Some(id) if !is_run_id(id) => {
                return Err(Error::usage(format!(
                    "--rdzv-id {id:?}: a run id names a log directory; use 1 to {MAX_RUN_ID} \
                     letters, digits, '.', '-' or '_' (no '/', spaces, newlines or other control \
                     characters; not '.' or '..')"
                )));
            }
            Some(id) => id.clone(),
            // A static launch's nodes each run their own nrun: only a given id is shared.
            None if nnodes > 1 && !uses_hosts => "none".to_string(),
            None => uuid4()?,
        };
        let node_rank = rdzv.node_rank.unwrap_or(0);
        if min_nodes < nnodes && rdzv.node_rank.is_some() {
            return Err(Error::usage(format!(
                "--nnodes {}: an elastic range needs nodes that join (a host list, or c10d \
                 without --node-rank); a static --node-rank launch has a fixed number of nodes",
                rdzv.nnodes
            )));
        }
        if node_rank >= nnodes {
            return Err(Error::usage(format!(
                "--node-rank {node_rank} is out of range for --nnodes {nnodes} (ranks are 0..{})",
                nnodes - 1
            )));
        }
        let mut c10d = resolve_c10d(rdzv, nnodes, uses_hosts, &run_id, env)?;
        let mut nnodes = nnodes;
        let mut min_nodes = min_nodes;
        let mut run_id = run_id;
        // Under `srun` on every node, Slurm says how many nodes there are and which this is.
        if c10d.is_none() && !uses_hosts && rdzv.node_rank.is_none() && nnodes == 1 {
            if let Some((n, c)) = slurm_every_node(env)? {
                (nnodes, min_nodes) = (n, n);
                if rdzv.rdzv_id.is_none() {
                    run_id = c.id.clone();
                }
                c10d = Some(c);
            }
        }
        if min_nodes < nnodes && !uses_hosts && c10d.is_none() {
            return Err(Error::usage(format!(
                "--nnodes {}: an elastic range needs nodes that join: a host list (-H, \
                 --hostfile), or the same command on every node with --rdzv-backend c10d \
                 --rdzv-endpoint HOST:PORT",
                rdzv.nnodes
            )));
        }
        let shutdown_timeout = positive_secs("--shutdown-timeout", *shutdown_timeout, true)?;
        let preflight_plan = resolve_preflight(preflight, env)?;
        if let Some(name) = command.first().filter(|c| nrun_cli::is_command_name(c)) {
            return Err(Error::usage(format!(
                "`{name}` is a command: give its flags after it (nrun {name} -H ...); a script or \
                 program named {name} runs as ./{name}"
            )));
        }
        let (program, args) = if command.is_empty() {
            (OsString::new(), Vec::new())
        } else {
            resolve_command(target, command, env)?
        };
        let python = find_python(target.python.as_deref(), env);
        let store = match &c10d {
            // As with a host list: every node learns its store address when it joins.
            Some(c) => StorePlan::Host {
                port: c.port,
                advertise: String::new(),
            },
            None => resolve_store(rdzv, nnodes, uses_hosts)?,
        };

        let redirects = match redirects {
            Some(s) => StreamSpec::parse("--redirects", s)?,
            None => StreamSpec::None,
        };
        let tee = match tee {
            Some(s) => StreamSpec::parse("--tee", s)?,
            None => StreamSpec::None,
        };
        let console_ranks = match local_ranks_filter {
            None => None,
            Some(s) => Some(parse_rank_set(s, nproc)?),
        };
        let wants_files = !redirects.is_none() || !tee.is_none();
        // torchrun's layout: a directory of its own for each run, `<run id>_<random>`, so a
        // second run with the same --log-dir and id keeps the first's logs.
        let (base, dir_is_temp) = match log_dir {
            Some(d) => {
                nrun_base::files::check_parent_dir(d)
                    .map_err(|e| Error::usage(format!("--log-dir: {e}")))?;
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

        let shape = Shape {
            nproc,
            nnodes,
            min_nodes,
            node_rank,
            last_call,
            rdzv_join_timeout,
            c10d: c10d.is_some(),
            python: !target.no_python && python.is_some(),
        };
        let workers = WorkersPlan {
            nproc,
            program,
            args,
            role: role.clone(),
            max_restarts: *max_restarts,
            log: LogPlan {
                dir,
                redirects,
                console_ranks,
            },
            set_omp_threads: nproc > 1 && env("OMP_NUM_THREADS").is_none(),
            set_async_error_handling: env("TORCH_NCCL_ASYNC_ERROR_HANDLING").is_none(),
            console: ConsolePlan {
                prefix_template: match log_line_prefix_template {
                    Some(t) => Some(check_prefix_template(t)?),
                    None => None,
                },
                color: resolve_color(*color, env),
            },
            stdin_rank: parse_stdin(stdin.as_deref(), nnodes > 1 || uses_hosts)?,
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
        };
        let session = SessionPlan {
            run_id: run_id.clone(),
            store,
            store_max_bytes: parse_bytes("--store-max-bytes", &rdzv.store_max_bytes)?,
            forward_signals: parse_signals(signals_to_handle)?,
            static_secret: env("NRUN_RDZV_SECRET")
                .filter(|v| !v.is_empty() && nnodes > 1 && !uses_hosts && c10d.is_none())
                .map(|v| nrun_store::auth::derive(v.as_bytes(), &run_id)),
            c10d,
            python,
        };
        Ok(RunSettings {
            session,
            workers,
            shape,
            shutdown_timeout,
            preflight: preflight_plan,
            preflight_only: preflight.preflight_only,
            watch: resolve_watch(watch)?,
            report: preflight.report.clone(),
            launcher_error_file: env("TORCHELASTIC_ERROR_FILE")
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
        })
    }
}

impl BisectSettings {
    /// bisect's groups: the probe's preflight (nccl, net) or the user's command (cmd); and the
    /// shape of its nodes (`--nproc` on every host).
    fn resolve(args: &BisectArgs, env: Env<'_>) -> Result<(BisectSettings, Shape)> {
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
                },
            target,
            sweep,
            nodes,
            command,
        } = args;
        let nproc = resolve_nproc(nproc_per_node, env)?;
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
        Ok((
            BisectSettings {
                session: SessionPlan::own("bisect", "", python),
                workers,
                sweep: preflight,
                probe,
                slow_factor: *slow_factor,
                timeout,
                write_hostfile: write_hostfile.clone(),
                write_exclude: *write_exclude,
                report: report.clone(),
            },
            shape,
        ))
    }
}

impl WorkersPlan {
    /// The environment a worker gets on top of nrun's own, exactly as torchrun sets it.
    pub(crate) fn worker_env_at(
        &self,
        run_id: &str,
        p: &Place,
        w: &WorkerSlot<'_>,
    ) -> Vec<(String, String)> {
        let mut env = vec![
            ("RANK".into(), p.rank.to_string()),
            ("LOCAL_RANK".into(), w.local_rank.to_string()),
            ("WORLD_SIZE".into(), p.world_size.to_string()),
            ("LOCAL_WORLD_SIZE".into(), p.local_world_size.to_string()),
            ("GROUP_RANK".into(), p.group_rank.to_string()),
            ("GROUP_WORLD_SIZE".into(), p.group_world_size.to_string()),
            ("ROLE_RANK".into(), p.rank.to_string()),
            ("ROLE_NAME".into(), self.role.clone()),
            ("ROLE_WORLD_SIZE".into(), p.world_size.to_string()),
            ("MASTER_ADDR".into(), w.master_addr.to_string()),
            ("MASTER_PORT".into(), w.master_port.to_string()),
            (
                "TORCHELASTIC_RESTART_COUNT".into(),
                w.restart_count.to_string(),
            ),
            (
                "TORCHELASTIC_MAX_RESTARTS".into(),
                self.max_restarts.to_string(),
            ),
            ("TORCHELASTIC_RUN_ID".into(), run_id.to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into()),
            (
                "TORCHELASTIC_ERROR_FILE".into(),
                w.error_file.display().to_string(),
            ),
        ];
        if !self.signals_to_handle.is_empty() {
            env.push((
                "TORCHELASTIC_SIGNALS_TO_HANDLE".into(),
                self.signals_to_handle.clone(),
            ));
        }
        if self.set_async_error_handling {
            env.push(("TORCH_NCCL_ASYNC_ERROR_HANDLING".into(), "1".into()));
        }
        if self.set_omp_threads {
            env.push(("OMP_NUM_THREADS".into(), "1".into()));
        }
        env
    }

    /// `<run dir>/attempt_<n>[/<host>]/<local_rank>`: torchrun's per-worker log directory; the
    /// host level keeps the nodes of a multi-node run apart on a shared filesystem.
    pub(crate) fn worker_dir(
        &self,
        root: &Path,
        attempt: u32,
        host: Option<&str>,
        local_rank: usize,
    ) -> PathBuf {
        let mut d = attempt_dir(root, attempt);
        if let Some(h) = host {
            d.push(h);
        }
        d.join(local_rank.to_string())
    }
}

/// Longest `--rdzv-id`.
const MAX_RUN_ID: usize = 128;

/// Whether `id` is a run id `--rdzv-id` accepts: `[A-Za-z0-9._-]{1,128}`, not `.` or `..`.
fn is_run_id(id: &str) -> bool {
    (1..=MAX_RUN_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        && id != "."
        && id != ".."
}

/// `<root>/attempt_<n>`: one attempt's directory, of log files or of nrun's scratch.
pub(crate) fn attempt_dir(root: &Path, attempt: u32) -> PathBuf {
    root.join(format!("attempt_{attempt}"))
}

/// Where a worker sits in the whole job.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place {
    pub rank: usize,
    pub group_rank: usize,
    pub local_world_size: usize,
    pub world_size: usize,
    pub group_world_size: usize,
}

/// What differs between the workers of one attempt.
pub(crate) struct WorkerSlot<'a> {
    pub local_rank: usize,
    pub restart_count: u32,
    pub master_addr: &'a str,
    pub master_port: u16,
    pub error_file: &'a Path,
}

/// GPUs this process may use: the NVIDIA driver's device list, narrowed by CUDA_VISIBLE_DEVICES.
/// Read from /proc so that counting needs neither CUDA nor Python.
pub(crate) fn visible_gpus(env: &dyn Fn(&str) -> Option<String>) -> usize {
    let present = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    match env("CUDA_VISIBLE_DEVICES") {
        None => present,
        // CUDA stops at the first entry it cannot parse; -1 hides every device.
        Some(v) => v
            .split(',')
            .map(str::trim)
            .take_while(|s| !s.is_empty() && !s.starts_with('-'))
            .count()
            .min(present),
    }
}

/// A size like 4G, 512M, 64K or 1000000 (bytes), at least 1 MiB.
fn parse_bytes(flag: &str, s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mul) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        Some('T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    match num.parse::<u64>().ok().and_then(|n| n.checked_mul(mul)) {
        Some(n) if n >= 1 << 20 => Ok(n),
        _ => Err(Error::usage(format!(
            "{flag} {s:?}: expected a size of at least 1M, like 4G or 512M"
        ))),
    }
}

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
    let hang_timeout = positive_secs("--hang-timeout", *hang_timeout, false)?;
    Ok(on.then_some(WatchPlan {
        hang_timeout,
        on_hang: *on_hang,
    }))
}

/// Longest duration a flag takes (about 3 years): deadlines computed from it cannot overflow.
const MAX_SECS: f64 = 1e8;

fn positive_secs(flag: &str, v: f64, zero_ok: bool) -> Result<Duration> {
    if v.is_finite() && v <= MAX_SECS && (v > 0.0 || (zero_ok && v == 0.0)) {
        if let Ok(d) = Duration::try_from_secs_f64(v) {
            return Ok(d);
        }
    }
    let what = if zero_ok { "non-negative" } else { "positive" };
    Err(Error::usage(format!(
        "{flag} {v} must be a {what} number of seconds, at most {MAX_SECS:.0}"
    )))
}

/// The job's preflight: which one runs (if any) and its sweep.
fn resolve_preflight(args: &PreflightArgs, env: Env<'_>) -> Result<Option<PreflightPlan>> {
    use nrun_preflight::Mode;
    let PreflightArgs {
        preflight,
        no_preflight,
        preflight_only,
        sweep,
        min_busbw,
        min_efficiency,
        waive,
        report,
        preflight_loopback,
    } = args;
    // Checked whether or not a preflight runs: a bad value is a bad value.
    if let Some(b) = min_busbw.filter(|b| !(b.is_finite() && *b >= 0.0)) {
        return Err(Error::usage(format!(
            "--min-busbw {b} must be a non-negative number of GB/s (finite, 0 or more)"
        )));
    }
    if !(min_efficiency.is_finite() && (0.0..=1.0).contains(min_efficiency)) {
        return Err(Error::usage(format!(
            "--min-efficiency {min_efficiency} must be a fraction in [0, 1] (0 turns it off)"
        )));
    }
    let mut mode: Option<Option<Mode>> = None;
    let mut warn_only = false;
    for part in preflight
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part {
            "warn" => warn_only = true,
            "auto" => {}
            "nccl" => mode = Some(Some(Mode::Nccl)),
            "net" => mode = Some(Some(Mode::Net)),
            "off" | "none" => mode = Some(None),
            other => {
                return Err(Error::usage(format!(
                    "--preflight {other:?}: expected auto, nccl, net or off, optionally with ,warn"
                )));
            }
        }
    }
    if *no_preflight {
        if *preflight_only {
            return Err(Error::usage(
                "--no-preflight and --preflight-only exclude each other",
            ));
        }
        mode = Some(None);
    }
    let mode = match mode {
        Some(m) => m,
        // auto: NCCL where GPUs are visible; elsewhere a job needs no GPU preflight.
        None => (visible_gpus(env) > 0).then_some(Mode::Nccl),
    };
    let Some(mode) = mode else {
        // Flags of a preflight that does not run are still checked: a typo is still a typo.
        sweep_plan(sweep, nrun_preflight::Mode::Net)?;
        if *preflight_only {
            return Err(Error::usage(
                "--preflight-only: no GPU is visible here for the NCCL preflight; use --preflight net \
                 to test the network path alone",
            ));
        }
        return Ok(None);
    };
    let mut pf = sweep_plan(sweep, mode)?;
    pf.warn_only = warn_only;
    pf.min_busbw = *min_busbw;
    pf.min_efficiency = *min_efficiency;
    for w in waive
        .iter()
        .flat_map(|w| w.split(','))
        .map(str::trim)
        .filter(|w| !w.is_empty())
    {
        pf.waived.push(w.parse()?);
    }
    pf.report = report.clone();
    pf.loopback = *preflight_loopback;
    Ok(Some(pf))
}

/// The all-reduce sweep of a preflight or a bisect probe.
fn sweep_plan(sweep: &SweepArgs, mode: nrun_preflight::Mode) -> Result<PreflightPlan> {
    let SweepArgs {
        preflight_sizes,
        iters,
        warmup,
        preflight_timeout,
        nccl_lib,
    } = sweep;
    let net = mode == nrun_preflight::Mode::Net;
    let (min_bytes, max_bytes, factor) = match preflight_sizes {
        Some(s) => nrun_preflight::parse_sizes(s)?,
        None if net => (8, 16 << 20, 4),
        None => (8, 256 << 20, 2),
    };
    let timeout = positive_secs("--preflight-timeout", *preflight_timeout, false)?;
    if let Some(p) = nccl_lib {
        if !p.is_file() {
            return Err(Error::usage(format!(
                "--nccl-lib {}: no such file",
                p.display()
            )));
        }
    }
    Ok(PreflightPlan {
        mode,
        warn_only: false,
        min_bytes,
        max_bytes,
        factor,
        iters: match iters {
            Some(0) => {
                return Err(Error::usage(
                    "--iters 0: at least one timed all-reduce per size is needed",
                ));
            }
            Some(n) => *n,
            None if net => 5,
            None => 20,
        },
        warmup: warmup.unwrap_or(if net { 1 } else { 5 }),
        timeout,
        min_busbw: None,
        min_efficiency: 0.0,
        waived: Vec::new(),
        report: None,
        nccl_lib: nccl_lib.clone(),
        loopback: false,
    })
}

impl PreflightPlan {
    /// What every preflight rank is told; `id` keeps runs sharing a store apart.
    pub(crate) fn settings(
        &self,
        id: String,
        nccl_lib: Option<PathBuf>,
        listen_addr: String,
    ) -> nrun_preflight::Settings {
        nrun_preflight::Settings {
            id,
            mode: self.mode,
            min_bytes: self.min_bytes,
            max_bytes: self.max_bytes,
            factor: self.factor,
            iters: self.iters,
            warmup: self.warmup,
            timeout_ms: self.timeout.as_millis() as u64,
            nccl_lib,
            listen_addr,
            links: true,
        }
    }
}

/// The interpreter a Python job would use: --python, else $PYTHON_EXEC, else python3.
fn python_name(python: Option<&Path>, env: Env<'_>) -> String {
    match (python, env("PYTHON_EXEC")) {
        (Some(p), _) => p.display().to_string(),
        (None, Some(p)) if !p.is_empty() => p,
        _ => "python3".to_string(),
    }
}

/// The interpreter a Python job would use, if it can be found (for locating torch's NCCL).
fn find_python(python: Option<&Path>, env: Env<'_>) -> Option<PathBuf> {
    find_program(&python_name(python, env), env("PATH").as_deref())
}

/// Most workers one node runs: far above any machine's GPUs or useful CPU workers, and low
/// enough that a typo (`--nproc 100000`) is refused before anything is spawned.
pub(crate) const MAX_NPROC: usize = 4096;

/// The soft limit on this user's processes (`ulimit -u`), where there is one and the kernel
/// enforces it (not for root).
fn process_limit() -> Option<u64> {
    // SAFETY: a plain syscall.
    if unsafe { libc::geteuid() } == 0 {
        return None;
    }
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a plain syscall on a local struct.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut l) } == 0;
    (ok && l.rlim_cur != libc::RLIM_INFINITY).then_some(l.rlim_cur)
}

/// `--nproc-per-node`: the count, at most [`MAX_NPROC`] and at most what this machine's process
/// limit lets one user run.
fn resolve_nproc(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let n = resolve_nproc_value(s, env)?;
    check_nproc(n, process_limit())
}

fn check_nproc(n: usize, process_limit: Option<u64>) -> Result<usize> {
    if n > MAX_NPROC {
        return Err(Error::usage(format!(
            "--nproc-per-node {n}: at most {MAX_NPROC} workers per node; use more nodes for more \
             workers"
        )));
    }
    if let Some(limit) = process_limit.filter(|l| n as u64 > *l) {
        return Err(Error::usage(format!(
            "--nproc-per-node {n}: this machine lets this user run at most {limit} processes \
             (ulimit -u); ask for fewer workers or raise the limit"
        )));
    }
    Ok(n)
}

fn resolve_nproc_value(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let cpus = || std::thread::available_parallelism().map_or(1, |n| n.get());
    match s {
        "cpu" => Ok(cpus()),
        "gpu" => match visible_gpus(env) {
            0 => Err(Error::usage(
                "--nproc-per-node gpu: no GPU is visible here (no /proc/driver/nvidia/gpus entries, \
                 or CUDA_VISIBLE_DEVICES hides them); pass a number or `cpu`",
            )),
            n => Ok(n),
        },
        "auto" => Ok(match visible_gpus(env) {
            0 => cpus(),
            n => n,
        }),
        _ => match s.parse::<usize>() {
            Ok(0) => Err(Error::usage(
                "--nproc-per-node 0: at least one worker is needed",
            )),
            Err(_) if s.starts_with('-') => Err(Error::usage(format!(
                "--nproc-per-node {s}: at least one worker is needed"
            ))),
            Ok(n) => Ok(n),
            Err(_) => Err(Error::usage(format!(
                "--nproc-per-node {s:?} is not a number, `gpu`, `cpu` or `auto`"
            ))),
        },
    }
}

/// `--nnodes N` or torchrun's elastic `MIN:MAX`: (MIN, MAX).
fn parse_nnodes(s: &str) -> Result<(usize, usize)> {
    let bad = || {
        Error::usage(format!(
            "--nnodes {s:?} must be N or MIN:MAX with 1 <= MIN <= MAX"
        ))
    };
    let (lo, hi) = match s.split_once(':') {
        Some((a, b)) => (
            a.trim().parse::<usize>().map_err(|_| bad())?,
            b.trim().parse::<usize>().map_err(|_| bad())?,
        ),
        None => {
            let n = s.trim().parse::<usize>().map_err(|_| bad())?;
            (n, n)
        }
    };
    if lo == 0 || lo > hi {
        return Err(bad());
    }
    // c10d and static launches lay out every node up front: bounded as a host list is.
    if hi > crate::hosts::MAX_HOSTS {
        return Err(Error::usage(format!(
            "--nnodes {s:?}: at most {} nodes",
            crate::hosts::MAX_HOSTS
        )));
    }
    Ok((lo, hi))
}

fn parse_rank_set(s: &str, nproc: usize) -> Result<BTreeSet<usize>> {
    let mut set = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.parse::<usize>() {
            Ok(r) if r < nproc => {
                set.insert(r);
            }
            _ => {
                return Err(Error::usage(format!(
                    "--local-ranks-filter {s:?}: {part:?} is not a local rank in 0..{nproc}"
                )));
            }
        }
    }
    Ok(set)
}

/// An address flag's value (`--master-addr`, `--local-addr`): a host name (letters, digits,
/// '-', '.', '_') or an IP address (IPv6 bare, as workers get it in MASTER_ADDR, with an
/// optional zone). The port has its own flag.
fn check_host(flag: &str, s: &str) -> Result<()> {
    let v6 = s
        .split_once('%')
        .map_or(s, |(a, _)| a)
        .parse::<std::net::Ipv6Addr>()
        .is_ok();
    let name = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    if v6 || name {
        return Ok(());
    }
    let hint = if s.contains(['[', ']']) {
        "; write an IPv6 address without brackets"
    } else if s.contains(':') {
        "; give the port with --master-port"
    } else {
        ""
    };
    Err(Error::usage(format!(
        "{flag} {s:?}: expected a host name (letters, digits, '-', '.', '_') or an IP address{hint}"
    )))
}

/// `--rdzv-endpoint HOST[:PORT]`: `[v6]:port`, `[v6]`, a bare IPv6 address, `host:port` or
/// `host`. Anything else (unbalanced brackets, text after `]`, an empty host, a port outside
/// 0-65535, a character no host name or address has) is refused, naming what is accepted.
fn split_host_port(s: &str) -> Result<(String, Option<u16>)> {
    split_endpoint("--rdzv-endpoint", s)
}

/// [`split_host_port`] for `flag`'s value, named in its errors.
fn split_endpoint(flag: &str, s: &str) -> Result<(String, Option<u16>)> {
    let bad = |why: String| {
        Error::usage(format!(
            "{flag} {s:?}: {why}; expected HOST, HOST:PORT, [IPV6] or [IPV6]:PORT \
             (port 0-65535)"
        ))
    };
    let port_of = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| bad(format!("{p:?} is not a port")))
    };
    let is_v6 = |a: &str| {
        // A zone (`fe80::1%eth0`) is allowed after the address.
        let addr = a.split_once('%').map_or(a, |(a, _)| a);
        addr.parse::<std::net::Ipv6Addr>().is_ok()
    };
    if let Some(rest) = s.strip_prefix('[') {
        let Some((h, after)) = rest.split_once(']') else {
            return Err(bad("'[' has no closing ']'".into()));
        };
        if !is_v6(h) {
            return Err(bad(format!("{h:?} in brackets is not an IPv6 address")));
        }
        let port = match after {
            "" => None,
            p => match p.strip_prefix(':') {
                Some(p) => Some(port_of(p)?),
                None => return Err(bad(format!("{after:?} after ']'"))),
            },
        };
        return Ok((h.to_string(), port));
    }
    if s.contains(['[', ']']) {
        return Err(bad("unbalanced brackets".into()));
    }
    let (host, port) = match s.matches(':').count() {
        0 => (s, None),
        1 => {
            let (h, p) = s.split_once(':').unwrap_or((s, ""));
            (h, Some(port_of(p)?))
        }
        _ if is_v6(s) => return Ok((s.to_string(), None)),
        _ => {
            return Err(bad(
                "several ':' but not an IPv6 address (an IPv6 address with a port is written \
                 [ADDR]:PORT)"
                    .into(),
            ));
        }
    };
    if host.is_empty() {
        return Err(bad("no host".into()));
    }
    if !host
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(bad(format!(
            "{host:?} is not a host name or address (letters, digits, '-', '.', '_')"
        )));
    }
    Ok((host.to_string(), port))
}

fn resolve_store(rdzv: &RendezvousArgs, nnodes: usize, uses_hosts: bool) -> Result<StorePlan> {
    let RendezvousArgs {
        nnodes: _,
        node_rank,
        master_addr,
        master_port,
        standalone,
        rdzv_endpoint,
        // nrun always hosts its own store; accepted for torchrun's command lines.
        rdzv_backend: _,
        // Read with the nodes (join_timeout).
        rdzv_conf: _,
        rdzv_id: _,
        store_max_bytes: _,
        local_addr,
    } = rdzv;
    let (mut addr, mut port) = (master_addr.clone(), *master_port);
    if let Some(ep) = rdzv_endpoint {
        let (h, p) = split_host_port(ep)?;
        addr = addr.or(Some(h));
        port = port.or(p);
    }
    // With a host list nrun starts every node itself and hosts the one store here.
    if uses_hosts {
        return Ok(StorePlan::Host {
            port: port.unwrap_or(0),
            advertise: String::new(),
        });
    }
    if *standalone && nnodes > 1 {
        return Err(Error::usage(
            "--standalone is a single-node mode; drop it or use --nnodes 1",
        ));
    }
    if nnodes == 1 {
        let advertise = local_addr
            .clone()
            .or(addr.filter(|a| !matches!(a.as_str(), "localhost" | "127.0.0.1" | "::1" | "")))
            .unwrap_or_else(|| "127.0.0.1".into());
        return Ok(StorePlan::Host {
            port: port.unwrap_or(0),
            advertise,
        });
    }
    // Static multi-node as torchrun: every node runs nrun with the same --master-addr/-port.
    let Some(addr) = addr else {
        return Err(Error::usage(format!(
            "--nnodes {nnodes} needs --master-addr (or --rdzv-endpoint): the address of node rank 0, \
             which hosts the store"
        )));
    };
    let port = port.unwrap_or(29500);
    // c10d: the node that binds the endpoint's port hosts the store (decided at start).
    if node_rank.unwrap_or(0) == 0 {
        Ok(StorePlan::Host {
            port,
            advertise: local_addr.clone().unwrap_or(addr),
        })
    } else {
        Ok(StorePlan::Remote { addr, port })
    }
}

/// torchrun's c10d rendezvous, when asked for (`--rdzv-backend c10d`), or implied (an endpoint
/// and several nodes without `--node-rank`, where a static launch would make every node rank 0).
fn resolve_c10d(
    rdzv: &RendezvousArgs,
    nnodes: usize,
    uses_hosts: bool,
    run_id: &str,
    env: Env<'_>,
) -> Result<Option<C10d>> {
    let backend = rdzv.rdzv_backend.as_deref().unwrap_or("static");
    if !matches!(backend, "static" | "c10d") {
        return Err(Error::usage(format!(
            "--rdzv-backend {backend:?}: nrun serves static and c10d rendezvous itself (etcd is \
             not needed); use c10d"
        )));
    }
    let endpoint = rdzv
        .rdzv_endpoint
        .as_deref()
        .or(rdzv.master_addr.as_deref());
    let wanted = backend == "c10d" || (endpoint.is_some() && rdzv.node_rank.is_none());
    if nnodes < 2 || uses_hosts || !wanted {
        return Ok(None);
    }
    if rdzv.node_rank.is_some() {
        return Err(Error::usage(
            "--rdzv-backend c10d assigns node ranks in join order: drop --node-rank (or use the \
             static backend, where every node gives its own)",
        ));
    }
    let Some(ep) = endpoint else {
        return Err(Error::usage(
            "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]: the host whose nrun hosts the \
             store (the same on every node)",
        ));
    };
    let flag = match rdzv.rdzv_endpoint {
        Some(_) => "--rdzv-endpoint",
        None => "--master-addr",
    };
    let (host, port) = split_endpoint(flag, ep)?;
    let port = port.or(rdzv.master_port).unwrap_or(29400);
    if port == 0 {
        return Err(Error::usage(
            "--rdzv-endpoint: every node must know the port; give one (e.g. HOST:29400)",
        ));
    }
    let secret = env("NRUN_RDZV_SECRET")
        .filter(|s| !s.is_empty())
        .map(|s| nrun_store::auth::derive(s.as_bytes(), run_id));
    Ok(Some(C10d {
        host,
        port,
        id: run_id.to_string(),
        secret,
        node: None,
    }))
}

/// `srun --ntasks-per-node=1 nrun ...` (torchrun's `srun torchrun` form): one nrun per node of
/// a step of several nodes. Node SLURM_NODEID 0 hosts the store on a port derived from the job
/// and step ids; the others join it as their node index. None: not inside such a step.
fn slurm_every_node(env: Env<'_>) -> Result<Option<(usize, C10d)>> {
    let (Some(step), Some(nodes)) = (env("SLURM_STEP_ID"), env("SLURM_STEP_NUM_NODES")) else {
        return Ok(None);
    };
    let nodes: usize = nodes.trim().parse().unwrap_or(1);
    if nodes < 2 {
        return Ok(None);
    }
    let tasks: usize = env("SLURM_STEP_NUM_TASKS")
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(nodes);
    if tasks != nodes {
        return Err(Error::usage(format!(
            "this srun step runs {tasks} tasks on {nodes} nodes: nrun starts the workers itself, \
             one nrun per node (srun --ntasks-per-node=1 nrun --nproc N ...)"
        )));
    }
    let node: usize = env("SLURM_NODEID")
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| Error::usage("SLURM_NODEID is not set in this srun step"))?;
    let list = env("SLURM_STEP_NODELIST")
        .or_else(|| env("SLURM_JOB_NODELIST"))
        .ok_or_else(|| Error::usage("SLURM_STEP_NODELIST is not set in this srun step"))?;
    let first = crate::hosts::expand_slurm_hostlist(&list)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::usage(format!("SLURM_STEP_NODELIST {list:?} names no node")))?;
    let job: u64 = env("SLURM_JOB_ID")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let step: u64 = step.trim().parse().unwrap_or(0);
    // Steps of one job, and jobs sharing a node, get different ports.
    let port = 20000 + ((job * 64 + step) % 20000) as u16;
    let id = format!("slurm-{job}.{step}");
    let secret = env("NRUN_RDZV_SECRET")
        .filter(|s| !s.is_empty())
        .map(|s| nrun_store::auth::derive(s.as_bytes(), &id));
    Ok(Some((
        nodes,
        C10d {
            host: first,
            port,
            id,
            secret,
            node: Some(node),
        },
    )))
}

/// A random (version 4) UUID, as torchrun's standalone run ids.
fn uuid4() -> Result<String> {
    let h = nrun_base::random_hex()
        .map_err(|e| Error::internal(format!("cannot read random bytes: {e}")))?;
    // Version 4 and the RFC 4122 variant, in their nibbles.
    let variant = ["8", "9", "a", "b"][usize::from(h.as_bytes()[16] % 4)];
    Ok(format!(
        "{}-{}-4{}-{variant}{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    ))
}

/// torchrun's default wait for more nodes once MIN have joined.
const LAST_CALL: Duration = Duration::from_secs(30);

/// The fields `--log-line-prefix-template` may name.
const PREFIX_FIELDS: [&str; 4] = ["rank", "local_rank", "role_name", "host"];

/// `--log-line-prefix-template`: every `${...}` must be one of [`PREFIX_FIELDS`] and closed.
fn check_prefix_template(t: &str) -> Result<String> {
    let known = || {
        PREFIX_FIELDS
            .iter()
            .map(|f| format!("${{{f}}}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut rest = t;
    while let Some(at) = rest.find("${") {
        let after = &rest[at + 2..];
        let Some(end) = after.find('}') else {
            return Err(Error::usage(format!(
                "--log-line-prefix-template {t:?}: a '${{' is not closed by '}}'; the fields are {}",
                known()
            )));
        };
        let name = &after[..end];
        if !PREFIX_FIELDS.contains(&name) {
            return Err(Error::usage(format!(
                "--log-line-prefix-template {t:?}: unknown field ${{{name}}}; the fields are {}",
                known()
            )));
        }
        rest = &after[end + 1..];
    }
    Ok(t.to_string())
}

/// torchrun's boolean spellings (`RendezvousParameters.get_as_bool`), any case.
fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "t" | "yes" | "y" => Some(true),
        "0" | "false" | "f" | "no" | "n" => Some(false),
        _ => None,
    }
}

/// Unknown `--rdzv-conf` keys named in the one warning line, at most.
const UNKNOWN_KEYS_SHOWN: usize = 8;

/// `--rdzv-conf k=v,...` (torchrun's keys): the join timeout, if given, and the last call.
/// Every key nrun knows has its value checked (durations finite and in range, booleans as
/// torch spells them, counts whole numbers), even those with no effect here; unknown keys are
/// warned about once, in one line.
fn parse_rdzv_conf(s: Option<&str>) -> Result<(Option<Duration>, Duration)> {
    let (mut join, mut last) = (None, LAST_CALL);
    let mut unknown: Vec<&str> = Vec::new();
    for kv in s
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|k| !k.is_empty())
    {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(Error::usage(format!(
                "--rdzv-conf {kv:?}: expected KEY=VALUE, e.g. join_timeout=600"
            )));
        };
        let (k, v) = (k.trim(), v.trim());
        let secs = || -> Result<Duration> {
            v.parse::<f64>()
                .ok()
                .and_then(|n| positive_secs(k, n, true).ok())
                .ok_or_else(|| {
                    Error::usage(format!(
                        "--rdzv-conf {k}={v}: expected a number of seconds, from 0 to \
                         {MAX_SECS:.0}"
                    ))
                })
        };
        match k {
            "join_timeout" => join = Some(secs()?),
            "last_call_timeout" => last = secs()?,
            "timeout" | "close_timeout" | "read_timeout" | "keep_alive_interval" => {
                secs()?;
            }
            "is_host" | "use_libuv" => {
                if parse_bool(v).is_none() {
                    return Err(Error::usage(format!(
                        "--rdzv-conf {k}={v}: expected a boolean: true, false, 1, 0, yes, no \
                         (also t, f, y, n)"
                    )));
                }
            }
            "keep_alive_max_attempt" => {
                if v.parse::<u32>().is_err() {
                    return Err(Error::usage(format!(
                        "--rdzv-conf {k}={v}: expected a whole number from 0 to {}",
                        u32::MAX
                    )));
                }
            }
            "store_type" => {
                if v.is_empty() {
                    return Err(Error::usage(format!(
                        "--rdzv-conf {k}=: expected a store type, e.g. tcp"
                    )));
                }
            }
            other => {
                if !unknown.contains(&other) {
                    unknown.push(other);
                }
            }
        }
    }
    if join.is_some_and(|j| j.is_zero()) {
        return Err(Error::usage("--rdzv-conf join_timeout must be more than 0"));
    }
    if !unknown.is_empty() {
        tracing::warn!("{}", unknown_keys_line(&unknown));
    }
    Ok((join, last))
}

/// The one line about unknown `--rdzv-conf` keys: the first few named, the rest counted.
fn unknown_keys_line(unknown: &[&str]) -> String {
    let shown: Vec<String> = unknown
        .iter()
        .take(UNKNOWN_KEYS_SHOWN)
        .map(|k| format!("{k:?}"))
        .collect();
    let more = match unknown.len().saturating_sub(UNKNOWN_KEYS_SHOWN) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    let (noun, verb) = match unknown.len() {
        1 => ("key", "has"),
        _ => ("keys", "have"),
    };
    format!(
        "--rdzv-conf: {} unknown {noun} ({}{more}) {verb} no meaning for nrun and {} ignored; \
         nrun knows join_timeout, last_call_timeout, timeout, close_timeout, read_timeout, \
         keep_alive_interval, keep_alive_max_attempt, is_host, use_libuv, store_type",
        unknown.len(),
        shown.join(", "),
        if unknown.len() == 1 { "is" } else { "are" },
    )
}

/// `--color`: auto (a terminal, and NO_COLOR unset or empty), always, never.
fn resolve_color(when: ColorWhen, env: Env<'_>) -> nrun_node::output::Color {
    use nrun_node::output::Color;
    match when {
        ColorWhen::Auto if env("NO_COLOR").is_some_and(|v| !v.is_empty()) => Color::Never,
        ColorWhen::Auto => Color::Auto,
        ColorWhen::Always => Color::Always,
        ColorWhen::Never => Color::Never,
    }
}

/// The stop signals: forwarded, then SIGKILL after the grace period, whatever the list says.
const STOP_SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// `--signals-to-handle SIGTERM,USR1,10`: the signals to pass on without stopping the job.
fn parse_signals(s: &str) -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let upper = name.to_ascii_uppercase();
        let full = match upper.starts_with("SIG") {
            true => upper.clone(),
            false => format!("SIG{upper}"),
        };
        let sig = match name.parse::<i32>() {
            Ok(n) => nix::sys::signal::Signal::try_from(n).ok(),
            Err(_) => full.parse::<nix::sys::signal::Signal>().ok(),
        };
        let Some(sig) = sig else {
            return Err(Error::usage(format!(
                "--signals-to-handle: {name:?} is not a signal (names like SIGUSR1 or USR1, or \
                 numbers)"
            )));
        };
        let n = sig as i32;
        if matches!(n, libc::SIGKILL | libc::SIGSTOP) {
            return Err(Error::usage(format!(
                "--signals-to-handle: {} cannot be caught, so it cannot be passed on",
                sig.as_str()
            )));
        }
        if !STOP_SIGNALS.contains(&n) && !out.contains(&n) {
            out.push(n);
        }
    }
    Ok(out)
}

/// `--stdin RANK|none`; by default local rank 0 of a single-node job gets a terminal or pipe.
fn parse_stdin(s: Option<&str>, several_nodes: bool) -> Result<Option<usize>> {
    use std::io::IsTerminal;
    match s {
        Some("none") => Ok(None),
        Some(r) => {
            let rank = r.parse::<usize>().map_err(|_| {
                Error::usage(format!(
                    "--stdin {r:?}: expected a rank (0, 1, ...) or none"
                ))
            })?;
            if several_nodes {
                return Err(Error::usage(
                    "--stdin: nrun passes its stdin to a rank of a single-node job only (pdb on \
                     a remote node: use a remote debugger such as `python -m remote_pdb`)",
                ));
            }
            Ok(Some(rank))
        }
        None if several_nodes => Ok(None),
        None => {
            let stdin = std::io::stdin();
            // A pipe or a file given with `<`; not /dev/null (a character device, as a tty).
            let data = nix::sys::stat::fstat(libc::STDIN_FILENO)
                .is_ok_and(|st| matches!(st.st_mode & libc::S_IFMT, libc::S_IFIFO | libc::S_IFREG));
            Ok((stdin.is_terminal() || data).then_some(0))
        }
    }
}

fn resolve_command(
    target: &TargetArgs,
    command: &[String],
    env: Env<'_>,
) -> Result<(OsString, Vec<OsString>)> {
    let TargetArgs {
        python,
        module,
        no_python,
        // TARGET runs as a script either way; accepted for torchrun's command lines.
        run_path: _,
    } = target;
    let target = &command[0];
    let rest = command[1..].iter().map(OsString::from);
    let path = env("PATH");
    if *no_python {
        if *module {
            return Err(Error::usage(
                "-m and --no-python exclude each other: a module needs Python",
            ));
        }
        let p = Path::new(target);
        if target.contains('/') {
            let meta = p.metadata().map_err(|_| {
                Error::usage(format!(
                    "program {target} not found (cwd {})",
                    cwd_display()
                ))
            })?;
            if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
                return Err(Error::usage(format!(
                    "program {target} is not executable; chmod +x it, or drop --no-python if it is \
                     a Python script"
                )));
            }
        } else if find_program(target, path.as_deref()).is_none() {
            return Err(Error::usage(format!(
                "program {target} not found on PATH; give its path (./{target}) or check PATH"
            )));
        }
        return Ok((target.into(), rest.collect()));
    }

    let python = python_name(python.as_deref(), env);
    let Some(python_path) = find_program(&python, path.as_deref()) else {
        return Err(Error::usage(format!(
            "python interpreter {python} not found{}; pass --python PATH or set PYTHON_EXEC \
             (or use --no-python to run a program directly)",
            if python.contains('/') { "" } else { " on PATH" }
        )));
    };
    let mut args: Vec<OsString> = vec!["-u".into()];
    if *module {
        args.push("-m".into());
    } else if !Path::new(target).is_file() {
        let hint = if !target.ends_with(".py") && find_program(target, path.as_deref()).is_some() {
            format!("; {target} is a program on PATH: add --no-python to run it directly")
        } else {
            String::new()
        };
        return Err(Error::usage(format!(
            "script {target} not found (cwd {}){hint}",
            cwd_display()
        )));
    }
    args.push(target.into());
    args.extend(rest);
    Ok((python_path.into_os_string(), args))
}

fn cwd_display() -> String {
    std::env::current_dir().map_or_else(|_| "unknown".into(), |p| p.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn plan(args: &[&str]) -> Result<RunSettings> {
        let cli = Cli::try_parse_from(std::iter::once("nrun").chain(args.iter().copied())).unwrap();
        match resolve(cli, &|k| std::env::var(k).ok())? {
            Mode::Run { run, .. } => Ok(run),
            other => panic!("not a run: {other:?}"),
        }
    }

    /// A worker's environment on this node of a torchrun-style layout.
    fn worker_env(p: &RunSettings, w: &WorkerSlot<'_>) -> Vec<(String, String)> {
        let shape = &p.shape;
        let place = Place {
            rank: shape.node_rank * shape.nproc + w.local_rank,
            group_rank: shape.node_rank,
            local_world_size: shape.nproc,
            world_size: shape.world_size(),
            group_world_size: shape.nnodes,
        };
        p.workers.worker_env_at(&p.session.run_id, &place, w)
    }

    #[test]
    fn stream_specs() {
        assert_eq!(
            StreamSpec::parse("-t", "3").unwrap().for_rank(5),
            Streams(3)
        );
        let s = StreamSpec::parse("-t", "0:3,1:1").unwrap();
        assert_eq!(s.for_rank(0), Streams(3));
        assert_eq!(s.for_rank(1), Streams(1));
        assert_eq!(s.for_rank(2), Streams(0));
        assert!(StreamSpec::parse("-t", "4").is_err());
        assert!(StreamSpec::parse("-t", "x:1").is_err());
    }

    #[test]
    fn nproc_values() {
        let env = |_: &str| None;
        assert_eq!(resolve_nproc("8", &env).unwrap(), 8);
        assert!(
            resolve_nproc("0", &env)
                .unwrap_err()
                .message
                .contains("at least one")
        );
        assert!(resolve_nproc("x", &env).is_err());
        assert!(resolve_nproc("cpu", &env).unwrap() >= 1);
        let hidden = |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(|| "-1".to_string());
        assert_eq!(visible_gpus(&hidden), 0);
    }

    #[test]
    fn nnodes_values() {
        assert_eq!(parse_nnodes("2").unwrap(), (2, 2));
        assert_eq!(parse_nnodes("3:3").unwrap(), (3, 3));
        assert_eq!(parse_nnodes("1:4").unwrap(), (1, 4));
        assert!(parse_nnodes("3:2").is_err());
        assert!(parse_nnodes("0").is_err());
        assert!(parse_nnodes("0:2").is_err());
    }

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
    fn bad_targets_are_usage_errors() {
        let e = plan(&["/definitely/missing.py"]).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
        assert!(e.message.contains("not found"), "{}", e.message);
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain.sh");
        std::fs::write(&plain, "echo\n").unwrap();
        let e = plan(&["--no-python", plain.to_str().unwrap()]).unwrap_err();
        assert!(e.message.contains("not executable"), "{}", e.message);
        let e = plan(&["--no-python", "no-such-program-xyz"]).unwrap_err();
        assert!(e.message.contains("not found on PATH"), "{}", e.message);
        let e = plan(&["--python", "/no/python", "x.py"]).unwrap_err();
        assert!(
            e.message
                .contains("python interpreter /no/python not found"),
            "{}",
            e.message
        );
        let e = plan(&["true"]).unwrap_err();
        assert!(e.message.contains("--no-python"), "{}", e.message);
    }

    #[test]
    fn a_command_name_after_run_flags_is_refused() {
        let e = plan(&["-H", "a,b", "doctor"]).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
        assert!(e.message.contains("runs as ./doctor"), "{}", e.message);
    }

    /// Hosts beyond --nnodes (or --spares K of them) are spares; a Slurm allocation of several
    /// nodes is a host list for `--nnodes N`; --exclude-file keeps its hosts out.
    #[test]
    fn spares_come_from_the_host_list_and_the_allocation() {
        let nodes_of = |args: &[&str], env: &dyn Fn(&str) -> Option<String>| {
            let mut v = vec!["nrun"];
            v.extend_from_slice(args);
            v.extend_from_slice(&["--nproc", "2", "--no-python", "true"]);
            match resolve(Cli::try_parse_from(v).unwrap(), env) {
                Ok(Mode::Run { nodes, .. }) => Ok(nodes),
                Ok(_) => panic!("not a run"),
                Err(e) => Err(e),
            }
        };
        let none = |k: &str| std::env::var(k).ok().filter(|_| !k.starts_with("SLURM"));
        let n = nodes_of(&["-H", "a,b,c,d,e", "--nnodes", "4"], &none).unwrap();
        assert_eq!((n.hosts.len(), n.size, n.min_nodes), (5, 4, 4));
        assert_eq!((n.world, n.group_world), (8, 4));
        let n = nodes_of(&["-H", "a,b,c,d,e", "--spares", "2"], &none).unwrap();
        assert_eq!((n.hosts.len(), n.size, n.world), (5, 3, 6));
        let n = nodes_of(&["-H", "a,b,c,d,e", "--nnodes", "2:3"], &none).unwrap();
        assert_eq!((n.hosts.len(), n.size, n.min_nodes), (5, 3, 2));
        let slurm = |k: &str| match k {
            "SLURM_JOB_NODELIST" => Some("n[1-4]".to_string()),
            _ => none(k),
        };
        let n = nodes_of(&["--nnodes", "3"], &slurm).unwrap();
        assert_eq!((n.hosts.len(), n.size), (4, 3));
        assert!(n.from_slurm);
        // Under srun on every node it stays one node of a static launch.
        let step = |k: &str| match k {
            "SLURM_JOB_NODELIST" => Some("n[1-4]".to_string()),
            "SLURM_STEP_NUM_NODES" => Some("4".to_string()),
            _ => none(k),
        };
        assert!(
            nodes_of(
                &["--nnodes", "3", "--node-rank", "1", "--master-addr", "n1"],
                &step
            )
            .unwrap()
            .in_process
        );
        let dir = tempfile::tempdir().unwrap();
        let memo = dir.path().join("bad");
        let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
        std::fs::write(&memo, format!("b  {now}  lost\nz  {now}  other\n")).unwrap();
        let m = memo.to_str().unwrap();
        let n = nodes_of(&["-H", "a,b,c", "--exclude-file", m], &none).unwrap();
        let names: Vec<&str> = n.hosts.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
        assert_eq!(n.avoided.len(), 1);
        let e = nodes_of(
            &["-H", "a,b,c", "--nnodes", "3", "--exclude-file", m],
            &none,
        )
        .unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::NO_NODES);
        assert!(e.message.contains("b (lost)"), "{}", e.message);
    }

    #[test]
    fn include_slots_pin_gpus_on_that_host() {
        let cli = Cli::try_parse_from([
            "nrun",
            "-H",
            "a:4,b:4",
            "--include",
            "a@b:1,3",
            "--nproc",
            "4",
            "--no-python",
            "true",
        ])
        .unwrap();
        let Mode::Run { nodes, .. } = resolve(cli, &|k| std::env::var(k).ok()).unwrap() else {
            panic!("not a run")
        };
        assert_eq!(nodes.layout[0].devices, None);
        assert_eq!(nodes.layout[1].devices.as_deref(), Some("1,3"));
        assert_eq!(nodes.layout[1].ranks, vec![(4, 0, 1), (5, 1, 3)]);
        assert_eq!(nodes.world, 6);
        let cli = Cli::try_parse_from([
            "nrun",
            "-H",
            "a:4,b:4",
            "--include",
            "b:1",
            "-x",
            "CUDA_VISIBLE_DEVICES=0",
            "--no-python",
            "true",
        ])
        .unwrap();
        let e = resolve(cli, &|k| std::env::var(k).ok()).unwrap_err();
        assert!(e.message.contains("CUDA_VISIBLE_DEVICES"), "{}", e.message);
    }

    #[test]
    fn addresses_checked() {
        for good in [
            "gpu1",
            "10.0.0.1",
            "fe80::1",
            "fe80::1%eth0",
            "node-1.example_x",
        ] {
            check_host("--master-addr", good).unwrap();
        }
        for bad in ["", "[::1]", "[::1", "h:29500", "a b", "h/x", "é"] {
            let e = check_host("--master-addr", bad).unwrap_err();
            assert_eq!(e.code, nrun_base::error::exit::USAGE, "{bad:?}");
            assert!(e.message.contains("expected a host name"), "{}", e.message);
        }
    }

    #[test]
    fn nnodes_is_bounded() {
        assert_eq!(parse_nnodes("16384").unwrap(), (16384, 16384));
        assert!(parse_nnodes("16385").is_err());
        assert!(parse_nnodes("1:99999999999").is_err());
        assert!(parse_nnodes("18446744073709551616").is_err());
    }

    #[test]
    fn nproc_is_bounded() {
        assert_eq!(check_nproc(MAX_NPROC, None).unwrap(), MAX_NPROC);
        let e = check_nproc(MAX_NPROC + 1, None).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
        assert!(
            e.message.contains("at most 4096 workers per node"),
            "{}",
            e.message
        );
        let e = check_nproc(100, Some(50)).unwrap_err();
        assert!(
            e.message.contains("at most 50 processes (ulimit -u)"),
            "{}",
            e.message
        );
        assert_eq!(check_nproc(50, Some(50)).unwrap(), 50);
        let e = resolve_nproc("100000", &|_| None).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
    }

    #[test]
    fn endpoints_malformed_are_refused() {
        for bad in [
            "[::1",
            "[::1]x",
            "[::1]:",
            "[::1]:70000",
            "[nope]:1",
            "::1]",
            "a]",
            "host:",
            ":80",
            "a:b:c:d",
            "h st:1",
            "h/x",
            "",
            "[]:1",
        ] {
            let e = split_endpoint("--rdzv-endpoint", bad).unwrap_err();
            assert_eq!(e.code, nrun_base::error::exit::USAGE, "{bad:?}");
            assert!(
                e.message.contains("expected HOST, HOST:PORT"),
                "{}",
                e.message
            );
        }
        assert_eq!(
            split_endpoint("--rdzv-endpoint", "[fe80::1%eth0]:7").unwrap(),
            ("fe80::1%eth0".into(), Some(7))
        );
        assert_eq!(
            split_endpoint("--rdzv-endpoint", "[::1]").unwrap(),
            ("::1".into(), None)
        );
        assert_eq!(
            split_endpoint("--rdzv-endpoint", "node-1.example_x:0").unwrap(),
            ("node-1.example_x".into(), Some(0))
        );
    }

    #[test]
    fn rdzv_conf_values_checked() {
        for bad in [
            "timeout=1e400",
            "timeout=nan",
            "read_timeout=-1",
            "close_timeout=x",
            "last_call_timeout=inf",
            "keep_alive_interval=1e9",
            "is_host=maybe",
            "use_libuv=2",
            "keep_alive_max_attempt=-1",
            "store_type=",
        ] {
            let e = parse_rdzv_conf(Some(bad)).unwrap_err();
            assert_eq!(e.code, nrun_base::error::exit::USAGE, "{bad:?}");
        }
        for good in [
            "is_host=true",
            "is_host=0",
            "is_host=YES",
            "use_libuv=no",
            "timeout=0",
        ] {
            parse_rdzv_conf(Some(good)).unwrap();
        }
        let (join, last) = parse_rdzv_conf(Some("join_timeout=5, last_call_timeout=1.5")).unwrap();
        assert_eq!(join, Some(Duration::from_secs(5)));
        assert_eq!(last, Duration::from_millis(1500));
    }

    #[test]
    fn unknown_rdzv_conf_keys_are_one_line() {
        let keys: Vec<String> = (0..5000).map(|i| format!("k{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let line = unknown_keys_line(&refs);
        assert!(!line.contains('\n'));
        assert!(line.contains("5000 unknown keys"), "{line}");
        assert!(line.contains("and 4992 more"), "{line}");
        assert!(line.len() < 400, "{line}");
        assert!(unknown_keys_line(&["x"]).contains("1 unknown key (\"x\") has"));
    }

    #[test]
    fn prefix_template_fields() {
        for good in [
            "",
            "[${rank}]",
            "${local_rank}/${role_name}@${host}: ",
            "$rank {x} $ {",
        ] {
            assert_eq!(check_prefix_template(good).unwrap(), good);
        }
        for bad in ["${nope}", "${rank", "${}", "${ rank}", "a${rank}${RANK}"] {
            let e = check_prefix_template(bad).unwrap_err();
            assert!(
                e.message.contains("${local_rank}, ${role_name}, ${host}"),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn booleans_as_torch_spells_them() {
        for t in ["1", "true", "TRUE", "t", "yes", "Y"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["0", "false", "F", "no", "n"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        for x in ["maybe", "", "2", "on"] {
            assert_eq!(parse_bool(x), None, "{x}");
        }
    }

    #[test]
    fn endpoints() {
        assert_eq!(split_host_port("h:5").unwrap(), ("h".into(), Some(5)));
        assert_eq!(split_host_port("[::1]:5").unwrap(), ("::1".into(), Some(5)));
        assert_eq!(
            split_host_port("fe80::1").unwrap(),
            ("fe80::1".into(), None)
        );
        assert!(split_host_port("h:x").is_err());
    }
}
