//! Command-line definitions (clap derive) and nothing else: what the flags mean is decided in
//! `plan`. `nrun [OPTIONS] TARGET` is the default command (a job); `doctor` and `bisect` are
//! subcommands with their own flags. Flags shared by several commands live in flattened groups
//! (`NodesArgs`, `SweepArgs`, ...), so each command takes exactly the groups it uses.
//! torchrun's spellings are kept, including its underscore forms (`--nproc_per_node`), so
//! `torchrun ARGS` becomes `nrun ARGS`. Every option can also come from `NRUN_<OPTION>`, or from
//! torchrun's `PET_<OPTION>` (see [`apply_pet_env`]).

use std::path::PathBuf;

use clap::builder::BoolishValueParser;
use clap::builder::TypedValueParser;
use clap::{ArgAction, Args, CommandFactory, Parser, Subcommand, ValueEnum};
use nrun_base::VERSION;

const EXAMPLES: &str = "\
Examples:
  nrun --nproc 8 train.py --lr 0.1        8 workers on this machine (python -u train.py --lr 0.1)
  nrun --nproc gpu -m mypkg.train         one worker per visible GPU, running a module
  nrun --nproc 4 --no-python ./a.out      any program, not only Python
  nrun --nproc 8 --log-dir logs -t 3 x.py  also write logs/<run-id>_<8 hex>/attempt_0/<local-rank>/...
  nrun --nproc 8 --max-restarts 2 x.py    restart the whole group up to twice on failure
  nrun --preflight-only --nproc 8         NCCL all-reduce health check of this node's 8 GPUs
  nrun --preflight-only --preflight net --nproc 4   the TCP network path alone, no GPU needed
  nrun -H gpu1,gpu2 --nproc 8 train.py    16 workers on two nodes over ssh
  nrun doctor [-H gpu1,gpu2]              what each node has (GPUs, driver, NCCL, torch, interfaces)
  nrun bisect --hostfile hosts --nproc 8 --write-hostfile good   find the bad nodes and links
  nrun ./doctor                           a script or program named like a command: give a path
  nrun --hostfile hosts --nnodes 4 --max-restarts 3 --nproc 8 train.py
                                          4 nodes of the hostfile, the rest spares: a bad or
                                          lost node is left out and a spare takes its place
  nrun --nnodes 2 --nproc 8 --rdzv-backend c10d --rdzv-endpoint gpu1:29400 train.py
                                          the same command on every node (torchrun's c10d)
  srun -N 4 --ntasks-per-node 1 nrun --nproc 8 train.py   under Slurm: one nrun per node
  salloc -N 4 nrun --nproc 8 train.py     inside an allocation: nrun starts the nodes (one srun)
  torchrun --nproc-per-node 8 x.py  ->  nrun --nproc-per-node 8 x.py   (same flags, same env)

Workers get torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...)
and rendezvous through the store nrun hosts, so init_process_group(\"env://\") needs no change.

Exit status: 0 all workers succeeded; 2 bad usage or input; 95 nodes could not join or disagree;
96 bisect found bad nodes; 97 a hang stopped the job (--on-hang stop); 98 too few healthy
nodes (nodes left out, no spare left; or a node lost mid-run and not replaced); 90-94 the preflight
failed (90 could not run, 91 NCCL init failed, 92 timed out, 93 wrong results, 94 too slow);
otherwise the first failing worker's exit code (128+N when it died of signal N), or 128+N when
nrun itself was stopped by signal N.";

const DOCTOR_EXAMPLES: &str = "\
Examples:
  nrun doctor                             this host: GPUs, driver, NCCL libraries, torch, interfaces
  nrun doctor -H gpu1,gpu2                every node, checked as a job would check them (joins,
                                          interfaces, versions, node-to-node reachability)

Exit status: 0 the nodes are ready; 2 bad usage; 95 a node could not join, the nodes disagree,
or the python a job would run has no torch there (--no-python-probe: not looked at).";

const REPORT_EXAMPLES: &str = "\
Examples:
  nrun --report run.json --max-restarts 2 train.py   the job writes run.json, then:
  nrun report run.json                    writes run.html beside it and prints its path
  nrun report run.json -o /tmp/incident.html
  nrun --report-html run.html train.py    the job writes the page itself at its end

Exit status: 0 the page was written; 2 the report is missing or not nrun's JSON, or the page
cannot be written.";

const BISECT_EXAMPLES: &str = "\
Examples:
  nrun bisect --hostfile hosts --nproc 8 --write-hostfile good-hosts
  nrun bisect --hostfile hosts --nproc 8 --probe net          no GPUs: the TCP network path
  nrun bisect --hostfile hosts --nproc 8 --probe cmd --timeout 300 -- python train.py --steps 10

Exit status: 0 every node is good; 2 bad usage; 96 a node or link is not good.";

const RUN_EXAMPLES: &str = "\
Examples:
  nrun run --nproc 8 train.py --lr 0.1    the same as nrun --nproc 8 train.py --lr 0.1
  nrun ./run                              a script or program named run

nrun --help for every flag, more examples and the exit status.";

const COMPLETIONS_EXAMPLES: &str = "\
Example:
  nrun completions bash > ~/.local/share/bash-completion/completions/nrun";

const MAN_EXAMPLES: &str = "\
Example:
  nrun man | man -l -                     read it now";

/// The end of `nrun -h`, which shows the flags most runs use; `--help` shows them all.
const SHORT_FOOTER: &str = "\
Example: nrun --nproc 8 train.py. nrun --help for all flags, examples and the exit status.";

#[derive(Parser, Debug, Clone)]
#[command(
    name = "nrun",
    version = VERSION,
    about = "Launch distributed PyTorch/NCCL jobs: one process per GPU, a built-in rendezvous store, clear failures.",
    after_help = SHORT_FOOTER,
    after_long_help = EXAMPLES,
    max_term_width = 100,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    subcommand_value_name = "COMMAND",
    subcommand_help_heading = "Commands (a script named like one runs as ./doctor)",
    // argparse (torchrun) takes the last of a repeated flag.
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// The default command: run a job.
    #[command(flatten)]
    pub run: RunArgs,
}

impl Cli {
    /// `nrun run ARGS` as what it means, `nrun ARGS`: the default command, no subcommand.
    pub fn into_default(self) -> Cli {
        match self.command {
            Some(Command::Run(run)) => Cli {
                command: None,
                run: *run,
            },
            command => Cli { command, ..self },
        }
    }
}

/// Subcommands besides the default run. Each has its own `--help` and takes only its own flags.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Run a job: the default command by name (`nrun run [OPTIONS] TARGET` is
    /// `nrun [OPTIONS] TARGET`); a script named run runs as ./run.
    #[command(after_help = RUN_EXAMPLES, args_override_self = true)]
    Run(Box<RunArgs>),
    /// What each node has (GPUs, driver, NCCL, torch, interfaces) and whether the nodes reach
    /// each other; runs nothing.
    #[command(after_help = DOCTOR_EXAMPLES, args_override_self = true)]
    Doctor(Box<DoctorArgs>),
    /// The staged scale-up that finds the bad nodes and links: every node alone, pairs, 4, 8,
    /// ... all, isolating what fails or is slow.
    #[command(after_help = BISECT_EXAMPLES, args_override_self = true)]
    Bisect(Box<BisectArgs>),
    /// A --report JSON as an HTML page a person reads
    ///
    /// The incident report: a job's, bisect's or the preflight's --report JSON as one
    /// self-contained HTML page (timeline, ledger, bus-bandwidth curve, bisect's matrix, nodes,
    /// decisions, hangs and stragglers); opens from disk, loads nothing.
    #[command(after_help = REPORT_EXAMPLES, args_override_self = true)]
    Report(ReportArgs),
    /// Shell completions on stdout: `nrun completions bash > /etc/bash_completion.d/nrun`
    /// (zsh: a file `_nrun` on $fpath; fish: ~/.config/fish/completions/nrun.fish).
    #[command(after_help = COMPLETIONS_EXAMPLES)]
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: String,
    },
    /// The manual page on stdout: `nrun man > /usr/local/share/man/man1/nrun.1`.
    #[command(after_help = MAN_EXAMPLES)]
    Man,
}

/// `nrun report REPORT.json [-o OUT.html]`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// The JSON a job's, bisect's or `--preflight-only`'s --report wrote.
    #[arg(value_name = "REPORT.json")]
    pub input: PathBuf,
    /// Where to write the page (default: beside the input, its name ending in .html).
    #[arg(short = 'o', long = "output", value_name = "OUT.html")]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub files: FilesArgs,
}

/// How the files nrun writes are made.
#[derive(Args, Debug, Clone)]
pub struct FilesArgs {
    /// Mode of the files nrun creates (reports, pages, events, metrics, exclude file, hostfile),
    /// in octal: 600 by default, as they hold the whole command line; e.g. 644 for a metrics
    /// file another user's collector reads. The umask still applies.
    #[arg(long = "file-mode", env = "NRUN_FILE_MODE", value_name = "OCTAL",
          value_parser = parse_file_mode, default_value = "600")]
    pub file_mode: u32,
}

/// `--file-mode`: three octal digits (or four, the first 0), nothing above 0777.
fn parse_file_mode(s: &str) -> std::result::Result<u32, String> {
    let t = s.trim();
    match u32::from_str_radix(t, 8) {
        Ok(m) if m <= 0o777 && (3..=4).contains(&t.len()) => Ok(m),
        _ => Err(format!(
            "--file-mode {s}: give an octal mode such as 600 or 644 (at most 777)"
        )),
    }
}

/// `nrun [OPTIONS] TARGET [ARGS]...`: the job, with its preflight, on one node or many.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Print a completion script for SHELL (bash, zsh, fish, elvish or powershell) and exit
    /// (torchrun's flag; same as `nrun completions SHELL`).
    #[arg(
        long = "print-completion",
        alias = "print_completion",
        value_name = "SHELL"
    )]
    pub print_completion: Option<String>,

    #[command(flatten)]
    pub workers: WorkerArgs,
    #[command(flatten)]
    pub rdzv: RendezvousArgs,
    #[command(flatten)]
    pub job: JobArgs,
    #[command(flatten)]
    pub target: TargetArgs,
    #[command(flatten)]
    pub preflight: PreflightArgs,
    #[command(flatten)]
    pub watch: WatchArgs,
    #[command(flatten)]
    pub nodes: NodesArgs,
    #[command(flatten)]
    pub compat: CompatArgs,
    #[command(flatten)]
    pub files: FilesArgs,

    /// The script, module or program, followed by its arguments.
    #[arg(
        help_heading = "Arguments",
        value_name = "TARGET [ARGS]...",
        required_unless_present_any = ["preflight_only", "print_completion"],
        num_args = 1..,
        trailing_var_arg = true,
    )]
    pub command: Vec<String>,
}

/// `nrun doctor [NODES]`.
#[derive(Args, Debug, Clone)]
pub struct DoctorArgs {
    /// Python interpreter whose torch is reported (default: $PYTHON_EXEC, else python3 on PATH).
    #[arg(long, env = "NRUN_PYTHON", value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// The launch host's address every node's agent uses (default: the address its ssh
    /// connection came from, else this host's route to it).
    #[arg(long = "local-addr", env = "NRUN_LOCAL_ADDR", value_name = "ADDR")]
    pub local_addr: Option<String>,
    #[command(flatten)]
    pub nodes: NodesArgs,
}

/// `nrun bisect NODES [--probe ...] [-- COMMAND]`.
#[derive(Args, Debug, Clone)]
pub struct BisectArgs {
    #[command(flatten)]
    pub workers: WorkerArgs,
    /// With --probe cmd, how COMMAND runs.
    #[command(flatten)]
    pub target: TargetArgs,
    #[command(flatten)]
    pub probe: ProbeArgs,
    #[command(flatten)]
    pub sweep: SweepArgs,
    #[command(flatten)]
    pub nodes: NodesArgs,
    #[command(flatten)]
    pub files: FilesArgs,

    /// The launch host's address every node's agent and the groups' MASTER_ADDR use (default:
    /// the address its ssh connection came from, else this host's route to it).
    #[arg(long = "local-addr", env = "NRUN_LOCAL_ADDR", value_name = "ADDR")]
    pub local_addr: Option<String>,

    /// With --probe cmd: the command each group runs, after `--`.
    #[arg(value_name = "COMMAND [ARGS]...", trailing_var_arg = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// How many workers each node runs.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Workers")]
pub struct WorkerArgs {
    /// Workers on this node: a number, `gpu` (one per visible GPU), `cpu` (one per core), or
    /// `auto` (GPUs if any, else cores). Not given: 1, torchrun's default, also where a
    /// scheduler's node list gives slots (they count CPUs as often as GPUs) [default: 1]
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc",
        alias = "nproc_per_node",
        env = "NRUN_NPROC_PER_NODE",
        value_name = "N|gpu|cpu|auto",
        allow_negative_numbers = true
    )]
    pub nproc_per_node: Option<String>,
}

/// Where the store is and who hosts it (torchrun's rendezvous flags).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Rendezvous (torchrun's)")]
pub struct RendezvousArgs {
    /// Number of nodes, N or MIN:MAX (elastic, with a host list or c10d: starts with MAX nodes,
    /// or MIN after last_call_timeout, and goes on while at least MIN remain). With a host list
    /// (-H, --hostfile, a scheduler's), the job runs on its first N hosts and the rest are
    /// spares; a list shorter than N is an error. Not given: every host of the list (under
    /// srun on every node, Slurm's node count), else 1.
    #[arg(
        long,
        env = "NRUN_NNODES",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub nnodes: Option<String>,

    /// This node's rank among --nnodes (torchrun-style static multi-node: rank 0 hosts the store).
    /// Without it, several nodes rendezvous as torchrun's c10d: ranks in join order.
    #[arg(
        long = "node-rank",
        alias = "node_rank",
        env = "NRUN_NODE_RANK",
        allow_negative_numbers = true
    )]
    pub node_rank: Option<usize>,

    /// Address workers use to reach the store (default: 127.0.0.1 on one node).
    #[arg(long = "master-addr", alias = "master_addr", env = "NRUN_MASTER_ADDR")]
    pub master_addr: Option<String>,

    /// Port of the store (default: a free port nrun binds and keeps).
    #[arg(
        long = "master-port",
        alias = "master_port",
        env = "NRUN_MASTER_PORT",
        allow_negative_numbers = true
    )]
    pub master_port: Option<u16>,

    /// Single-node job with the store on a free local port (torchrun compatibility; the default).
    /// It says where the store is, so it refuses the flags that say it elsewhere or ask for
    /// several nodes (--rdzv-endpoint, --master-addr, --node-rank, --nnodes N>1, -H, --hostfile);
    /// inside a scheduler's allocation it runs on this node alone.
    #[arg(long, env = "NRUN_STANDALONE", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub standalone: bool,

    /// Rendezvous endpoint HOST[:PORT]; same as --master-addr/--master-port (given with them,
    /// they must agree).
    #[arg(
        long = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        env = "NRUN_RDZV_ENDPOINT"
    )]
    pub rdzv_endpoint: Option<String>,

    /// Rendezvous backend: static (the default) or c10d, which nrun serves with its own store.
    #[arg(
        long = "rdzv-backend",
        alias = "rdzv_backend",
        env = "NRUN_RDZV_BACKEND",
        value_name = "NAME"
    )]
    pub rdzv_backend: Option<String>,

    /// Rendezvous settings KEY=VALUE[,KEY=VALUE] (torchrun's): join_timeout sets --join-timeout
    /// (give one of them);
    /// last_call_timeout (30 s) is how long an elastic MIN:MAX waits for more nodes past MIN;
    /// timeout, close_timeout, read_timeout, is_host and the like are accepted.
    #[arg(
        long = "rdzv-conf",
        alias = "rdzv_conf",
        env = "NRUN_RDZV_CONF",
        value_name = "KEY=VALUE,..."
    )]
    pub rdzv_conf: Option<String>,

    /// Job id, exported as TORCHELASTIC_RUN_ID and naming the log directory (default: a fresh
    /// UUID when nrun starts every node, as torchrun's standalone mode; "none" for a static
    /// --node-rank launch, whose nodes must agree).
    #[arg(
        long = "rdzv-id",
        alias = "rdzv_id",
        env = "NRUN_RDZV_ID",
        value_name = "ID"
    )]
    pub rdzv_id: Option<String>,

    /// Most bytes the store holds for its clients (K/M/G suffixes); a write past it fails that
    /// client with a message, never the job's store (nrun's own keys have a budget of their own).
    /// Its last quarter is kept for addresses holding under a 64th of it each: a client that
    /// fills the store is refused there, while the ranks of other hosts go on writing.
    #[arg(
        long = "store-max-bytes",
        env = "NRUN_STORE_MAX_BYTES",
        default_value = "4G",
        value_name = "SIZE"
    )]
    pub store_max_bytes: String,

    /// Address of this node that workers and other nodes use for the store; with a host list,
    /// the launch host's address every node's agent uses (default: the address its ssh
    /// connection came from, else this host's route to it).
    #[arg(long = "local-addr", alias = "local_addr", env = "NRUN_LOCAL_ADDR")]
    pub local_addr: Option<String>,
}

/// The worker group's life and its output.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Job")]
pub struct JobArgs {
    /// Restart the whole worker group up to N times after a failure (any failure, as
    /// torchrun; a node lost, or at fault twice, gives its place to a spare: README's "Fault
    /// model").
    #[arg(
        long = "max-restarts",
        alias = "max_restarts",
        env = "NRUN_MAX_RESTARTS",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub max_restarts: u32,

    /// Stop restarting after N restarts in a row that failed the same way with no more
    /// progress (0: never; torchrun has no such flag). The same way: the same failing rank,
    /// exception type and innermost frame (its traceback), or the same hang. Progress: the
    /// highest step --progress-regex matched, else the collectives its flight recorder
    /// completed (where the watch read one); unknown progress never stops a job early.
    #[arg(
        long = "max-no-progress-restarts",
        env = "NRUN_MAX_NO_PROGRESS_RESTARTS",
        default_value_t = 3,
        value_name = "N"
    )]
    pub max_no_progress_restarts: u32,

    /// A line of a worker's output matching REGEX is one unit of progress; its first capture
    /// group, if any, is read as a number: the step (e.g. 'step (\d+)'). What
    /// --max-no-progress-restarts compares between attempts.
    #[arg(
        long = "progress-regex",
        env = "NRUN_PROGRESS_REGEX",
        value_name = "REGEX"
    )]
    pub progress_regex: Option<String>,

    /// Accepted for torchrun compatibility: nrun reacts to worker exits at once, it does not poll.
    #[arg(
        long = "monitor-interval",
        alias = "monitor_interval",
        env = "NRUN_MONITOR_INTERVAL",
        hide = true,
        allow_negative_numbers = true
    )]
    pub monitor_interval: Option<f64>,

    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(
        long = "shutdown-timeout",
        alias = "shutdown_timeout",
        env = "NRUN_SHUTDOWN_TIMEOUT",
        default_value_t = 30.0,
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub shutdown_timeout: f64,

    /// Write each worker's stdout and stderr (and error.json) to
    /// DIR/<run-id>_<8 hex>/attempt_<n>/[<host>/]<local-rank>/ (a directory of its own per run).
    #[arg(
        long = "log-dir",
        alias = "log_dir",
        env = "NRUN_LOG_DIR",
        value_name = "DIR"
    )]
    pub log_dir: Option<PathBuf>,

    /// At the job's end, however it ended, write the incident report as one self-contained
    /// HTML page to FILE (what --report holds, drawn: timeline, ledger, preflight, nodes,
    /// decisions, hangs); `nrun report REPORT.json` draws one later.
    #[arg(long = "report-html", env = "NRUN_REPORT_HTML", value_name = "FILE")]
    pub report_html: Option<PathBuf>,

    /// Send streams to the log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank
    /// like 0:3,1:1.
    #[arg(short = 'r', long, env = "NRUN_REDIRECTS", value_name = "SPEC")]
    pub redirects: Option<String>,

    /// Write streams to the log files as well as the console (same SPEC as --redirects).
    #[arg(short = 't', long, env = "NRUN_TEE", value_name = "SPEC")]
    pub tee: Option<String>,

    /// Show console output of these local ranks only, e.g. 0 or 0,3 (log files get everything).
    #[arg(
        long = "local-ranks-filter",
        alias = "local_ranks_filter",
        env = "NRUN_LOCAL_RANKS_FILTER"
    )]
    pub local_ranks_filter: Option<String>,

    /// Role name exported as ROLE_NAME.
    #[arg(long, env = "NRUN_ROLE", default_value = "default")]
    pub role: String,

    /// Prefix of each console line, with ${rank}, ${local_rank}, ${role_name} (torchrun's
    /// fields) and ${host}; empty for none (default "[rank${rank}]: ", host first on several
    /// nodes).
    #[arg(
        long = "log-line-prefix-template",
        alias = "log_line_prefix_template",
        env = "NRUN_LOG_LINE_PREFIX_TEMPLATE",
        value_name = "TEMPLATE"
    )]
    pub log_line_prefix_template: Option<String>,

    /// Colour the rank prefixes: auto (on a terminal; NO_COLOR, CLICOLOR=0 and CLICOLOR_FORCE are
    /// honoured), always, never.
    #[arg(long, env = "NRUN_COLOR", default_value = "auto", value_name = "WHEN",
          value_parser = Choice::<ColorWhen>::new("--color"), hide_possible_values = true)]
    pub color: ColorWhen,

    /// Signals passed on to every worker on every node while the job goes on (a handler in the
    /// workers decides what they mean, e.g. Slurm's --signal=USR1@90 to checkpoint). SIGINT,
    /// SIGTERM and SIGHUP always stop the job: they are forwarded, then SIGKILL after
    /// --shutdown-timeout.
    #[arg(
        long = "signals-to-handle",
        alias = "signals_to_handle",
        env = "NRUN_SIGNALS_TO_HANDLE",
        default_value = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
        value_name = "SIG,..."
    )]
    pub signals_to_handle: String,

    /// Which rank reads nrun's stdin (a rank on this host), or none. Default: local rank 0 of a
    /// single-node job when stdin is a terminal or a pipe, so pdb and `cat data | nrun` work; on
    /// a terminal that worker gets the foreground, the others read /dev/null.
    #[arg(long, env = "NRUN_STDIN", value_name = "RANK|none")]
    pub stdin: Option<String>,

    /// Every worker sees LOCAL_RANK=0 and only its own GPU (CUDA_VISIBLE_DEVICES narrowed to it).
    #[arg(long = "virtual-local-rank", alias = "virtual_local_rank", env = "NRUN_VIRTUAL_LOCAL_RANK", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub virtual_local_rank: bool,

    /// Bind each worker to the CPUs of its GPU's NUMA node: node (or socket, exclusive,
    /// core-complex, treated as node).
    #[arg(
        long = "numa-binding",
        alias = "numa_binding",
        env = "NRUN_NUMA_BINDING",
        value_name = "MODE"
    )]
    pub numa_binding: Option<String>,

    /// Append one JSON object per line to PATH for every event of the job as it happens
    /// (phases, nodes joined and left out, attempts, failures, hangs, restarts, decisions;
    /// torchelastic's fields name, source, timestamp, metadata), e.g. --events job.jsonl.
    #[arg(long = "events", env = "NRUN_EVENTS", value_name = "PATH")]
    pub events: Option<PathBuf>,

    /// Write the job's metrics to PATH in OpenMetrics text (the node-exporter textfile
    /// collector's format), replaced every 5 s and at the end: state, attempts, restarts,
    /// nodes, each rank's progress, busbw, time by phase; e.g. --metrics-file
    /// /var/lib/node_exporter/nrun.prom.
    #[arg(long = "metrics-file", env = "NRUN_METRICS_FILE", value_name = "PATH")]
    pub metrics_file: Option<PathBuf>,

    /// Serve the same metrics on http://ADDR:PORT/metrics while the job runs: on loopback
    /// (127.0.0.1) unless ADDR is given, as an exporter for a scraper on this host; e.g.
    /// --metrics-port 9464, or --metrics-port 0.0.0.0:9464 for every interface ([::]:9464 for
    /// IPv6 too).
    #[arg(
        long = "metrics-port",
        env = "NRUN_METRICS_PORT",
        value_name = "[ADDR:]PORT"
    )]
    pub metrics_port: Option<String>,
}

/// torchrun flags that have no effect in nrun: accepted, with a note, so command lines carry over.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Accepted from torchrun (no effect in nrun)")]
pub struct CompatArgs {
    /// torchrun's multiprocessing start method; nrun starts every worker as a new process.
    #[arg(long = "start-method", alias = "start_method", value_name = "METHOD")]
    pub start_method: Option<String>,
    /// torchrun's event log handler.
    #[arg(
        long = "event-log-handler",
        alias = "event_log_handler",
        value_name = "NAME"
    )]
    pub event_log_handler: Option<String>,
    /// torchrun's LogsSpecs plugin; nrun's log files are set with --log-dir/-r/-t.
    #[arg(long = "logs-specs", alias = "logs_specs", value_name = "NAME")]
    pub logs_specs: Option<String>,
    /// torchrun's filtered copy of stdout lines.
    #[arg(
        long = "duplicate-stdout-filters",
        alias = "duplicate_stdout_filters",
        value_name = "FILTERS"
    )]
    pub duplicate_stdout_filters: Option<String>,
    /// torchrun's filtered copy of stderr lines.
    #[arg(
        long = "duplicate-stderr-filters",
        alias = "duplicate_stderr_filters",
        value_name = "FILTERS"
    )]
    pub duplicate_stderr_filters: Option<String>,
}

/// How TARGET runs: a Python script, a module, or a program.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Target")]
pub struct TargetArgs {
    /// Python interpreter for .py targets and -m (default: $PYTHON_EXEC, else python3 on PATH).
    #[arg(long, env = "NRUN_PYTHON", value_name = "PATH")]
    pub python: Option<PathBuf>,

    /// Run TARGET as a Python module (python -u -m TARGET).
    #[arg(short = 'm', long, env = "NRUN_MODULE", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub module: bool,

    /// Run TARGET as a program, not through Python.
    #[arg(long = "no-python", alias = "no_python", env = "NRUN_NO_PYTHON", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub no_python: bool,

    /// Accepted for torchrun compatibility: TARGET runs as a script either way.
    #[arg(long = "run-path", alias = "run_path", action = ArgAction::SetTrue, hide = true)]
    pub run_path: bool,
}

/// The all-reduce preflight before the job.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Preflight")]
pub struct PreflightArgs {
    /// Before the job, prove the GPUs and links with an all-reduce: auto (NCCL when GPUs are
    /// visible, else none), nccl, net (TCP ring over the network path, no GPU needed) or off;
    /// add `,warn` to start the job even if the preflight fails [default: auto]
    #[arg(long, env = "NRUN_PREFLIGHT_MODE", value_name = "MODE[,warn]")]
    pub preflight: Option<String>,

    /// Skip the preflight (same as --preflight off).
    #[arg(long = "no-preflight", env = "NRUN_NO_PREFLIGHT", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub no_preflight: bool,

    /// Run the preflight alone and report: a faster, clearer all_reduce_perf. No TARGET needed.
    #[arg(long = "preflight-only", env = "NRUN_PREFLIGHT_ONLY", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub preflight_only: bool,

    #[command(flatten)]
    pub sweep: SweepArgs,

    /// Fail the preflight when busbw at the largest size is under this (GB/s).
    #[arg(
        long = "min-busbw",
        env = "NRUN_MIN_BUSBW",
        value_name = "GB/s",
        allow_negative_numbers = true
    )]
    pub min_busbw: Option<f64>,

    /// Fail the preflight when busbw at the largest size (64 MiB or more) is under this fraction
    /// of the line rate of the node's GPU links (NVLink or PCIe, from NVML); 0 turns it off.
    #[arg(
        long = "min-efficiency",
        env = "NRUN_MIN_EFFICIENCY",
        default_value_t = 0.4,
        value_name = "F",
        allow_negative_numbers = true
    )]
    pub min_efficiency: f64,

    /// GPU health checks not to fail the preflight on: ecc (uncorrectable errors), retired
    /// (pages pending retirement), remap (rows pending remap or a failed remap), throttle
    /// (clocks slowed down), mig (MIG mode on).
    #[arg(long, env = "NRUN_WAIVE", value_name = "CHECK[,CHECK]", action = ArgAction::Append)]
    pub waive: Vec<String>,

    /// At the end, however it ended, write the job's record as JSON to FILE: its outcome, the
    /// ledger (wall time by phase, per attempt), every event and decision with its evidence,
    /// the nodes, the preflight's figures and what the watch found (with --preflight-only: the
    /// preflight's); `nrun report FILE` draws it as a page.
    #[arg(long, env = "NRUN_REPORT", value_name = "FILE")]
    pub report: Option<PathBuf>,

    /// Push a single node's preflight traffic through its network path (NCCL_P2P_DISABLE=1
    /// NCCL_SHM_DISABLE=1 for the preflight only).
    #[arg(long = "preflight-loopback", env = "NRUN_PREFLIGHT_LOOPBACK", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub preflight_loopback: bool,
}

/// The watch over the running job: hangs and stragglers named.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Watch")]
pub struct WatchArgs {
    /// Sample every worker's Python stack (from outside, twice a second) to name hangs and
    /// stragglers: auto or on (every worker whose process tree runs Python, wrappers included),
    /// off.
    #[arg(
        long,
        env = "NRUN_WATCH",
        default_value = "auto",
        value_name = "auto|on|off",
        value_parser = Choice::<WatchWhen>::new("--watch"),
        hide_possible_values = true
    )]
    pub watch: WatchWhen,

    /// Seconds a rank may wait in one collective (with none waiting: every rank's stack stand
    /// still) before a hang is diagnosed; the rank missing from that collective is named
    /// [default: 60]
    #[arg(
        long = "hang-timeout",
        env = "NRUN_HANG_TIMEOUT",
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub hang_timeout: Option<f64>,

    /// On a hang: report (say it, keep watching) or stop (say it, stop the job, exit 97)
    /// [default: report]
    #[arg(
        long = "on-hang",
        env = "NRUN_ON_HANG",
        value_name = "report|stop",
        value_parser = Choice::<OnHang>::new("--on-hang"),
        hide_possible_values = true
    )]
    pub on_hang: Option<OnHang>,
}

/// The all-reduce sweep: shared by the preflight and bisect's probes.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Preflight")]
pub struct SweepArgs {
    /// Message sizes of the sweep, MIN:MAX:FACTOR with K/M/G suffixes (default 8:256M:2; 8:16M:4
    /// over the TCP network path, net).
    #[arg(
        long = "preflight-sizes",
        env = "NRUN_PREFLIGHT_SIZES",
        value_name = "MIN:MAX:FACTOR"
    )]
    pub preflight_sizes: Option<String>,

    /// Timed all-reduces per size (default 20; 5 for net).
    #[arg(
        long,
        env = "NRUN_ITERS",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub iters: Option<u32>,

    /// Untimed all-reduces per size before timing (default 5; 1 for net).
    #[arg(
        long,
        env = "NRUN_WARMUP",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub warmup: Option<u32>,

    /// Seconds a rank may take to join and finish communicator init before it is named as stuck.
    #[arg(
        long = "preflight-timeout",
        env = "NRUN_PREFLIGHT_TIMEOUT",
        default_value_t = 30.0,
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub preflight_timeout: f64,

    /// The libnccl to test (default: the one the target Python's torch loads, then
    /// LD_LIBRARY_PATH, then the system's).
    #[arg(long = "nccl-lib", env = "NRUN_NCCL_LIB", value_name = "PATH")]
    pub nccl_lib: Option<PathBuf>,
}

/// Which nodes, how their agents start, and what their workers get.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Nodes")]
pub struct NodesArgs {
    /// Nodes: h1,h2 or h1:8,h2:8 (slots), hostlist ranges as Slurm writes them
    /// (gpu[01-16,20]:8), reached over ssh (or srun inside a Slurm allocation).
    #[arg(short = 'H', long, env = "NRUN_HOSTS", value_name = "HOSTS")]
    pub hosts: Option<String>,

    /// Nodes from a file: `host slots=N` (Open MPI/DeepSpeed), `host:N` (MPICH) or `host` lines.
    #[arg(long, env = "NRUN_HOSTFILE", value_name = "FILE")]
    pub hostfile: Option<PathBuf>,

    /// Only these hosts/slots (DeepSpeed syntax: "h1@h2:0,2").
    #[arg(long, env = "NRUN_INCLUDE", value_name = "SPEC")]
    pub include: Option<String>,

    /// All but these hosts/slots (DeepSpeed syntax).
    #[arg(long, env = "NRUN_EXCLUDE", value_name = "SPEC")]
    pub exclude: Option<String>,

    /// How to start the node agents: auto (srun inside a Slurm allocation, else ssh), ssh (a
    /// Slurm allocation's nodes too, when no hosts are given), srun.
    #[arg(
        long,
        env = "NRUN_LAUNCHER",
        default_value = "auto",
        value_name = "auto|ssh|srun",
        value_parser = Choice::<LauncherChoice>::new("--launcher"),
        hide_possible_values = true
    )]
    pub launcher: LauncherChoice,

    /// Extra options for ssh, e.g. "-F file -p 2222 -i key" (nrun always adds BatchMode=yes).
    #[arg(
        long = "ssh-opts",
        env = "NRUN_SSH_OPTS",
        value_name = "OPTS",
        allow_hyphen_values = true
    )]
    pub ssh_opts: Option<String>,

    /// ssh connections opened at once.
    #[arg(
        long = "ssh-concurrency",
        env = "NRUN_SSH_CONCURRENCY",
        default_value_t = 64,
        allow_negative_numbers = true
    )]
    pub ssh_concurrency: usize,

    /// Beyond this many ssh nodes, nrun starts only this many agents itself and each of them
    /// starts up to this many more over ssh from its own node, level by level (Open MPI's tree
    /// spawn): the launch host then holds ssh processes and pays handshakes for WIDTH nodes, not
    /// all of them (32 covers 1,056 nodes in two levels). The nodes must reach one another over
    /// ssh with the same --ssh-opts (keys, config files at the same paths); where they cannot,
    /// 0 starts every agent from this host. 0 or 1: no tree. Nodes of this machine (loopback
    /// aliases) make a tree of their own, started without ssh. Store traffic goes straight to
    /// this host either way.
    #[arg(
        long = "tree-width",
        env = "NRUN_TREE_WIDTH",
        default_value_t = 32,
        value_name = "WIDTH"
    )]
    pub tree_width: usize,

    /// Copy this nrun binary to every node first (to ~/.cache/nrun) and run that copy.
    #[arg(long, env = "NRUN_SHIP", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub ship: bool,

    /// Path of nrun on the other nodes (default: the same path as here).
    #[arg(long = "remote-nrun", env = "NRUN_REMOTE_NRUN", value_name = "PATH")]
    pub remote_nrun: Option<String>,

    /// Export a variable to every worker on every node: -x VAR (its value here) or -x VAR=VALUE.
    /// NCCL_*, TORCH_*, CUDA_* (not CUDA_VISIBLE_DEVICES), PYTHON*, OMP_*, UCX_* and the
    /// KEY=VALUE lines of .nrun_env (home, then cwd; the later wins) are forwarded anyway.
    #[arg(short = 'x', value_name = "VAR[=VALUE]", action = ArgAction::Append)]
    pub export: Vec<String>,

    /// Network interface for NCCL and gloo on every node (default: the one each node uses to
    /// reach this host, chosen per node).
    #[arg(long, env = "NRUN_IFNAME", value_name = "NAME")]
    pub ifname: Option<String>,

    /// Seconds every node has to start its agent and report [default: 30]
    #[arg(
        long = "join-timeout",
        env = "NRUN_JOIN_TIMEOUT",
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub join_timeout: Option<f64>,

    /// Launch even when NCCL (major.minor) or torch differ between nodes.
    #[arg(long = "allow-mismatch", env = "NRUN_ALLOW_MISMATCH", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub allow_mismatch: bool,

    /// Do not run the target Python on each node to read torch's versions.
    #[arg(long = "no-python-probe", env = "NRUN_NO_PYTHON_PROBE", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub no_python_probe: bool,

    /// How long a node and the launch host may not hear from each other: an agent whose
    /// launch host (its store) does not answer for SECS stops its node's workers by itself (a
    /// partition closes no connection for a long while), and the launch host calls a node lost
    /// after half of it (at least 2.5 s) without that node's heartbeat. Raise it for hosts too
    /// loaded to answer.
    #[arg(
        long = "agent-timeout",
        env = "NRUN_AGENT_TIMEOUT",
        default_value_t = 5.0,
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub agent_timeout: f64,

    /// How many hosts of the list are spares, where the job's node count is not given (given,
    /// the hosts beyond it are); with a c10d rendezvous, how many nodes beyond that count may
    /// join as spares. Spares join and are checked, run nothing, and take the place of a node
    /// left out: one that fails to join or the checks, or is lost mid-run.
    #[arg(long, env = "NRUN_SPARES", value_name = "K")]
    pub spares: Option<usize>,

    /// Nodes to avoid, remembered across runs: hosts listed here (and younger than
    /// --exclude-ttl) are not used, and the nodes this run leaves out are appended, one
    /// `HOST TIME REASON` line each.
    #[arg(long = "exclude-file", env = "NRUN_EXCLUDE_FILE", value_name = "PATH")]
    pub exclude_file: Option<PathBuf>,

    /// How long an --exclude-file entry counts: 24h, 90m, 3600 (seconds).
    #[arg(
        long = "exclude-ttl",
        env = "NRUN_EXCLUDE_TTL",
        default_value = "24h",
        value_name = "DURATION"
    )]
    pub exclude_ttl: String,
}

/// What bisect runs in each group and how it judges.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Bisect")]
pub struct ProbeArgs {
    /// What each group runs: nccl (the NCCL preflight), net (TCP ring, no GPU), or cmd
    /// (the command after `--`, which must exit 0 within --timeout).
    #[arg(
        long,
        env = "NRUN_PROBE",
        default_value = "nccl",
        value_name = "nccl|net|cmd",
        value_parser = Choice::<Probe>::new("--probe"),
        hide_possible_values = true
    )]
    pub probe: Probe,

    /// A group whose busbw is under this fraction of its stage's median is slow (with --probe
    /// net, a group's links judge it instead: slow with a link under 15% of the round's median
    /// link and a tenth of its NIC's speed).
    #[arg(
        long = "slow-factor",
        env = "NRUN_SLOW_FACTOR",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    pub slow_factor: f64,

    /// Seconds each group's run may take.
    #[arg(
        long,
        env = "NRUN_TIMEOUT",
        default_value_t = 120.0,
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub timeout: f64,

    /// Write the good hosts to FILE, in the input hostfile's own format.
    #[arg(
        long = "write-hostfile",
        env = "NRUN_WRITE_HOSTFILE",
        value_name = "FILE"
    )]
    pub write_hostfile: Option<PathBuf>,

    /// Append the nodes found not good to --exclude-file (host, time, verdict and evidence), so
    /// later runs leave them out.
    #[arg(long = "write-exclude", env = "NRUN_WRITE_EXCLUDE", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub write_exclude: bool,

    /// Write the rounds and each node's verdict as JSON to FILE.
    #[arg(long, env = "NRUN_REPORT", value_name = "FILE")]
    pub report: Option<PathBuf>,

    /// Write the same as one self-contained HTML page to FILE (the node x node verdict matrix,
    /// the rounds, the nodes); `nrun report REPORT.json` draws one later.
    #[arg(long = "report-html", env = "NRUN_REPORT_HTML", value_name = "FILE")]
    pub report_html: Option<PathBuf>,
}

impl CompatArgs {
    /// One line for each torchrun flag given that does nothing here.
    pub fn notes(&self) {
        let CompatArgs {
            start_method,
            event_log_handler,
            logs_specs,
            duplicate_stdout_filters,
            duplicate_stderr_filters,
        } = self;
        let given = [
            (
                "--start-method",
                start_method,
                "every worker is a new process",
            ),
            (
                "--event-log-handler",
                event_log_handler,
                "nrun logs to stderr (NRUN_LOG)",
            ),
            (
                "--logs-specs",
                logs_specs,
                "log files are set with --log-dir, -r and -t",
            ),
            (
                "--duplicate-stdout-filters",
                duplicate_stdout_filters,
                "use -t and grep the logs",
            ),
            (
                "--duplicate-stderr-filters",
                duplicate_stderr_filters,
                "use -t and grep the logs",
            ),
        ];
        for (flag, _, why) in given.iter().filter(|(_, v, _)| v.is_some()) {
            tracing::info!("{flag} is accepted from torchrun and has no effect: {why}");
        }
    }
}

/// `--color`: when rank prefixes are coloured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ColorWhen {
    /// On a terminal (NO_COLOR, CLICOLOR=0 and CLICOLOR_FORCE honoured).
    Auto,
    Always,
    Never,
}

/// `--watch`: whether the watch samples the workers' stacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WatchWhen {
    /// Every worker whose process tree runs Python.
    Auto,
    On,
    Off,
}

/// `--launcher`: how node agents start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LauncherChoice {
    /// srun inside a Slurm allocation of several nodes, else ssh.
    Auto,
    Ssh,
    Srun,
}

/// What to do when a hang is found (`--on-hang`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnHang {
    /// Say it once (again after progress resumes), keep watching.
    Report,
    /// Say it, then stop the job (exit code [`nrun_base::error::exit::HANG`]).
    Stop,
}

/// What each bisect group runs (`--probe`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Probe {
    Nccl,
    Net,
    Cmd,
}

/// A closed choice (a [`ValueEnum`]) whose refusal is nrun's own one line, `--color
/// "sometimes": expected auto, always or never`, rather than clap's block: the error is an
/// [`nrun_base::error::Error`] that `lib.rs` finds as the clap error's source and prints as nrun's.
/// Its possible values still reach completions; `hide_possible_values` keeps `--help` as the
/// doc comment words it.
#[derive(Clone)]
pub struct Choice<T> {
    flag: &'static str,
    kind: std::marker::PhantomData<fn() -> T>,
}

impl<T> Choice<T> {
    pub fn new(flag: &'static str) -> Choice<T> {
        Choice {
            flag,
            kind: std::marker::PhantomData,
        }
    }
}

impl<T: ValueEnum + Clone + Send + Sync + 'static> TypedValueParser for Choice<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<T, clap::Error> {
        let flag = self.flag;
        // clap's own parser for a closure turns its error into the clap error's source.
        let parse = move |s: &str| {
            T::from_str(s, false).map_err(|_| {
                let names: Vec<String> = T::value_variants()
                    .iter()
                    .filter_map(|v| v.to_possible_value())
                    .map(|p| p.get_name().to_string())
                    .collect();
                let list = match names.split_last() {
                    Some((last, [])) => last.clone(),
                    Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
                    None => String::new(),
                };
                nrun_base::error::Error::usage(format!("{flag} {s:?}: expected {list}"))
            })
        };
        parse.parse_ref(cmd, arg, value)
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        Some(Box::new(
            T::value_variants()
                .iter()
                .filter_map(|v| v.to_possible_value()),
        ))
    }
}

/// `nrun completions SHELL` and `--print-completion SHELL`: the script on stdout; the exit code.
pub fn print_completions(shell: &str) -> u8 {
    use clap_complete::Shell;
    let Ok(sh) = shell.parse::<Shell>() else {
        eprintln!(
            "nrun: error: no completions for shell {shell:?}: expected bash, zsh, fish, elvish or \
             powershell"
        );
        return nrun_base::error::exit::USAGE;
    };
    // Into a buffer: clap_complete panics when its writer fails (a closed pipe).
    let mut script = Vec::new();
    clap_complete::generate(sh, &mut Cli::command(), "nrun", &mut script);
    nrun_base::stdout(script);
    0
}

/// `nrun man`: the manual page (roff) on stdout; the exit code.
pub fn print_man() -> u8 {
    let page = clap_mangen::Man::new(Cli::command());
    let mut roff = Vec::new();
    match page.render(&mut roff) {
        Ok(()) => {
            // A reader that stopped early (`nrun man | head`) is a quiet end.
            nrun_base::stdout(roff);
            0
        }
        Err(e) => {
            eprintln!("nrun: error: cannot render the manual page: {e}");
            nrun_base::error::exit::INTERNAL
        }
    }
}

/// The flags `nrun -h` shows (by id), under which heading, with the one line it says of each;
/// `--help` shows every flag with its whole text. The ~15 flags most runs use.
const SHORT_HELP: &[(&str, &str, &str)] = &[
    (
        "nproc_per_node",
        "Workers",
        "Workers on this node: N, gpu, cpu, auto [default: 1]",
    ),
    (
        "module",
        "Workers",
        "Run TARGET as a Python module (python -u -m TARGET)",
    ),
    (
        "no_python",
        "Workers",
        "Run TARGET as a program, not through Python",
    ),
    (
        "hosts",
        "Nodes",
        "Nodes: h1,h2 or gpu[01-16]:8, over ssh (srun in Slurm)",
    ),
    (
        "hostfile",
        "Nodes",
        "Nodes from a file: `host slots=N`, `host:N`, `host`",
    ),
    (
        "nnodes",
        "Nodes",
        "Nodes running the job (N or MIN:MAX); more are spares",
    ),
    (
        "node_rank",
        "Nodes",
        "This node's rank, nrun on each node (0 hosts the store)",
    ),
    (
        "master_addr",
        "Nodes",
        "Address of node rank 0, which hosts the store",
    ),
    (
        "rdzv_endpoint",
        "Nodes",
        "The store's HOST:PORT, for --rdzv-backend c10d",
    ),
    (
        "max_restarts",
        "Job",
        "Restart the workers up to N times on failure",
    ),
    (
        "log_dir",
        "Job",
        "Each worker's stdout and stderr to files under DIR",
    ),
    (
        "tee",
        "Job",
        "To log files and the console: 1 stdout, 2 stderr, 3 both",
    ),
    (
        "preflight",
        "Job",
        "All-reduce check first: auto, nccl, net, off [default: auto]",
    ),
    (
        "preflight_only",
        "Job",
        "Run the preflight alone and report (no TARGET)",
    ),
    (
        "on_hang",
        "Job",
        "On a hang: report, or stop the job (exit 97) [default: report]",
    ),
];

/// Shorter value names in `nrun -h`, so each flag keeps to one line.
const SHORT_VALUE_NAMES: &[(&str, &str)] = &[
    ("nproc_per_node", "N"),
    ("node_rank", "RANK"),
    ("master_addr", "HOST"),
    ("rdzv_endpoint", "HOST:PORT"),
    ("max_restarts", "N"),
    ("preflight", "MODE"),
    ("on_hang", "WHAT"),
];

/// The one line `nrun -h` says of each command.
const SHORT_COMMANDS: &[(&str, &str)] = &[
    ("run", "Run a job: `nrun run ARGS` is `nrun ARGS`"),
    (
        "doctor",
        "What each node has, and whether the nodes reach each other",
    ),
    (
        "bisect",
        "Find the bad nodes and links, by a staged scale-up",
    ),
    ("completions", "Shell completions on stdout"),
    ("man", "The manual page on stdout"),
];

/// nrun's command line as clap parses it (and `--help` shows it, whole).
pub fn command() -> clap::Command {
    Cli::command()
}

/// The command as `nrun -h` shows it: only the flags of [`SHORT_HELP`], one line each, under
/// their headings, without the environment variables and defaults `--help` lists.
fn short_command() -> clap::Command {
    let cmd = command().mut_args(|a| {
        let id = a.get_id().as_str().to_string();
        match SHORT_HELP.iter().find(|(k, _, _)| *k == id) {
            Some((_, heading, line)) => {
                let values = a.get_action().takes_values();
                let a = match SHORT_VALUE_NAMES.iter().find(|(k, _)| *k == id) {
                    Some((_, v)) => a.value_name(*v),
                    None => a,
                };
                a.help(*line)
                    .long_help(None)
                    .help_heading(*heading)
                    .hide_env(true)
                    .hide_default_value(values)
                    .hide_possible_values(values)
            }
            // TARGET is in the usage line.
            None => a.hide(true),
        }
    });
    let cmd = cmd
        .about("Launch distributed PyTorch/NCCL jobs, with torchrun's flags.")
        .override_usage("nrun [OPTIONS] TARGET [ARGS]...\n       nrun COMMAND [OPTIONS]")
        .disable_help_subcommand(true);
    SHORT_COMMANDS.iter().fold(cmd, |cmd, (name, about)| {
        cmd.mut_subcommand(*name, |c| c.about(*about).long_about(None))
    })
}

/// Parses the process's command line ([`command`]).
pub fn parse() -> Result<Cli, clap::Error> {
    Cli::try_parse()
}

/// The short help, when the command line that gave `e` asked for it: `nrun -h` or
/// `nrun run -h` (`--help` asks for the whole one; a command's `-h` is that command's help).
pub fn short_help(e: &clap::Error, argv: &[std::ffi::OsString]) -> Option<String> {
    if e.kind() != clap::error::ErrorKind::DisplayHelp {
        return None;
    }
    let mut words = argv.iter().skip(1).map(|a| a.to_str().unwrap_or(""));
    let mut short = false;
    for (i, w) in words.by_ref().enumerate() {
        match w {
            "--help" | "--" => return None,
            "-h" => short = true,
            "run" if i == 0 => {}
            w if i == 0 && is_command_name(w) => return None,
            // A flag's value or TARGET: clap stopped at the help flag before it, or after.
            _ => {}
        }
    }
    short.then(|| short_command().render_help().to_string())
}

/// A clap usage error in nrun's own style: `nrun: error: ...` first, then `  hint: ...` and
/// `  usage: ...` lines, as nrun's own errors with hints (no blank lines, no "For more
/// information" line: the usage line says where help is).
pub fn error_text(e: &clap::Error) -> String {
    let plain = e.render().to_string();
    let mut out: Vec<String> = Vec::new();
    let mut lines = plain.lines().map(str::trim_end).peekable();
    let mut in_usage = false;
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.is_empty() || t.starts_with("For more information") {
            in_usage = false;
            continue;
        }
        if let Some(m) = t.strip_prefix("error: ") {
            // An error ending in ':' lists its items on the next lines: one line instead.
            let mut first = format!("nrun: error: {m}");
            if m.ends_with(':') {
                let mut items = Vec::new();
                while let Some(item) = lines.next_if(|l| !l.trim().is_empty()) {
                    items.push(item.trim().to_string());
                }
                first = format!("{first} {}", items.join(", "));
            }
            out.push(first);
        } else if let Some(m) = t.strip_prefix("tip: ") {
            out.push(format!("  hint: {m}"));
        } else if let Some(m) = t.strip_prefix("Usage: ") {
            out.push(format!("  usage: {m}"));
            in_usage = true;
        } else if in_usage {
            out.push(format!("         {t}"));
        } else {
            out.push(format!("  {t}"));
        }
    }
    out.push("  hint: nrun -h for the common flags, nrun --help for all of them".into());
    out.join("\n")
}

/// Whether `target` is the name of a subcommand (`doctor`, `bisect`), which a run refuses as a
/// script name: `nrun -H a,b doctor` means the command with its flags misplaced. Not `run`:
/// after flags it is a job's TARGET (`nrun --no-python run`), as the run's flags come before it.
pub fn is_command_name(target: &str) -> bool {
    target != "run"
        && Cli::command()
            .get_subcommands()
            .any(|c| c.get_name() == target)
}

/// torchrun reads `PET_<OPTION>` for each option; nrun reads `NRUN_<OPTION>`. Copy every
/// `PET_` variable that has no `NRUN_` counterpart over, before parsing and before any thread
/// starts (mutating the environment is only sound while single-threaded).
pub fn apply_pet_env() {
    let cmd = Cli::command();
    let args = cmd
        .get_arguments()
        .chain(cmd.get_subcommands().flat_map(|c| c.get_arguments()));
    for arg in args {
        let Some(name) = arg.get_env().and_then(|e| e.to_str()) else {
            continue;
        };
        let Some(option) = name.strip_prefix("NRUN_") else {
            continue;
        };
        if std::env::var_os(name).is_some() {
            continue;
        }
        if let Some(v) = std::env::var_os(format!("PET_{option}")) {
            // SAFETY: called first thing in main, before any other thread exists.
            unsafe { std::env::set_var(name, v) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shell clap_complete writes for is named where a shell is asked for (the help of
    /// `--print-completion` and of `nrun completions`, and the refusal of another).
    #[test]
    fn every_completion_shell_is_named() {
        use clap::ValueEnum;
        let mut cmd = Cli::command();
        let flag = cmd
            .get_arguments()
            .find(|a| a.get_id() == "print_completion")
            .and_then(|a| a.get_long_help().or(a.get_help()))
            .map(|h| h.to_string())
            .unwrap();
        let sub = cmd
            .find_subcommand_mut("completions")
            .unwrap()
            .render_long_help()
            .to_string();
        for sh in clap_complete::Shell::value_variants() {
            let name = sh.to_possible_value().unwrap().get_name().to_string();
            assert!(
                flag.contains(&name),
                "--print-completion's help lacks {name}: {flag}"
            );
            assert!(sub.contains(&name), "completions' help lacks {name}: {sub}");
        }
    }

    #[test]
    fn definitions_are_consistent() {
        Cli::command().debug_assert();
        short_command().debug_assert();
        // Every flag the short help names is one of the command's.
        let ids: Vec<String> = Cli::command()
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect();
        for (id, _, _) in SHORT_HELP {
            assert!(ids.iter().any(|i| i == id), "{id}");
        }
        for (name, _) in SHORT_COMMANDS {
            assert!(Cli::command().find_subcommand(name).is_some(), "{name}");
        }
    }

    /// `-h` (top level or `run`) is the short help; `--help` and a command's `-h` are clap's.
    #[test]
    fn short_help_is_asked_by_h_only() {
        let ask = |args: &[&str]| {
            let argv: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
            let e = Cli::try_parse_from(&argv).unwrap_err();
            short_help(&e, &argv)
        };
        let short = ask(&["nrun", "-h"]).unwrap();
        assert!(short.lines().count() < 40, "{short}");
        assert!(
            short
                .trim_end()
                .ends_with("nrun --help for all flags, examples and the exit status.")
        );
        assert!(!short.contains("--ssh-opts") && short.contains("--nproc-per-node <N>"));
        assert_eq!(ask(&["nrun", "run", "-h"]).as_deref(), Some(short.as_str()));
        assert_eq!(
            ask(&["nrun", "--nproc", "2", "-h"]).as_deref(),
            Some(short.as_str())
        );
        assert!(ask(&["nrun", "--help"]).is_none());
        assert!(ask(&["nrun", "doctor", "-h"]).is_none());
        assert!(ask(&["nrun", "bisect", "-h"]).is_none());
    }

    /// clap's usage errors read as nrun's: the prefix, hints and usage indented, no blank line.
    #[test]
    fn clap_errors_in_nruns_style() {
        let e = Cli::try_parse_from(["nrun", "--bogus", "x.py"]).unwrap_err();
        let t = error_text(&e);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0], "nrun: error: unexpected argument '--bogus' found",
            "{t}"
        );
        assert!(lines[1..].iter().all(|l| l.starts_with("  ")), "{t}");
        assert!(t.contains("\n  usage: nrun "), "{t}");
        assert!(t.contains("\n  hint: "), "{t}");
        assert!(
            !t.contains("\n\n") && !t.contains("For more information"),
            "{t}"
        );
        let e = Cli::try_parse_from(["nrun", "run"]).unwrap_err();
        let t = error_text(&e);
        assert!(
            t.starts_with(
                "nrun: error: the following required arguments were not provided: <TARGET"
            ),
            "{t}"
        );
    }

    #[test]
    fn run_is_the_default_command_by_name() {
        let c = Cli::try_parse_from(["nrun", "run", "--nproc", "2", "x.py", "-h"]).unwrap();
        let c = c.into_default();
        assert!(c.command.is_none());
        assert_eq!(c.run.workers.nproc_per_node.as_deref(), Some("2"));
        assert_eq!(c.run.command, ["x.py", "-h"]);
        // After flags, run is a TARGET like any other (a script or program named run).
        let c = Cli::try_parse_from(["nrun", "--no-python", "run", "a"]).unwrap();
        assert!(c.command.is_none());
        assert_eq!(c.run.command, ["run", "a"]);
        assert!(!is_command_name("run") && is_command_name("doctor"));
    }

    #[test]
    fn torchrun_spellings_parse() {
        let c = Cli::try_parse_from([
            "nrun",
            "--nproc_per_node=4",
            "--master_port",
            "1234",
            "--max-restarts",
            "2",
            "train.py",
            "--lr",
            "0.1",
        ])
        .unwrap();
        assert_eq!(c.run.workers.nproc_per_node.as_deref(), Some("4"));
        assert_eq!(c.run.rdzv.master_port, Some(1234));
        assert_eq!(c.run.job.max_restarts, 2);
        assert_eq!(c.run.command, ["train.py", "--lr", "0.1"]);
    }

    #[test]
    fn options_after_the_target_belong_to_it() {
        let c = Cli::try_parse_from(["nrun", "--nproc", "2", "x.py", "--nproc", "9"]).unwrap();
        assert_eq!(c.run.workers.nproc_per_node.as_deref(), Some("2"));
        assert_eq!(c.run.command, ["x.py", "--nproc", "9"]);
    }

    #[test]
    fn subcommands_take_only_their_flags() {
        let c = Cli::try_parse_from(["nrun", "doctor", "-H", "a,b"]).unwrap();
        assert!(
            matches!(c.command, Some(Command::Doctor(ref d)) if d.nodes.hosts.as_deref() == Some("a,b"))
        );
        // Run-only flags are not doctor's; bisect-only flags are not a run's.
        assert!(Cli::try_parse_from(["nrun", "doctor", "--max-restarts", "2"]).is_err());
        assert!(Cli::try_parse_from(["nrun", "--probe", "net", "x.py"]).is_err());
        // After run flags, a command's name is TARGET to clap; `plan` refuses it.
        let c = Cli::try_parse_from(["nrun", "-H", "a,b", "doctor"]).unwrap();
        assert_eq!(c.run.command, ["doctor"]);
        // A script of that name is reached by its path.
        let c = Cli::try_parse_from(["nrun", "./doctor", "x"]).unwrap();
        assert!(c.command.is_none());
        assert_eq!(c.run.command, ["./doctor", "x"]);
        let c = Cli::try_parse_from([
            "nrun", "bisect", "-H", "a,b", "--probe", "cmd", "--", "python", "t.py",
        ])
        .unwrap();
        let Some(Command::Bisect(b)) = c.command.clone() else {
            panic!("not bisect")
        };
        assert_eq!(b.probe.probe, Probe::Cmd);
        assert_eq!(b.command, ["python", "t.py"]);
        // Options after the script are the script's.
        let c = Cli::try_parse_from(["nrun", "x.py", "doctor"]).unwrap();
        assert_eq!(c.run.command, ["x.py", "doctor"]);
    }
}
