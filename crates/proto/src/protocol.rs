//! The agent protocol: what the coordinator and a node's agent say to each other, and where.
//!
//! Everything goes through the coordinator's store, in nrun's authenticated key space
//! (`nrun/<run>/...`), so there is one port, one protocol and one client. The coordinator
//! writes a node's numbered [`Step`]s; the agent answers each with a [`StepResult`]; a step's
//! numbered [`Control`] keys ask every node to stop its workers, pass a signal on, or resize
//! their terminals. [`Keys`] spells the agents' keys (the preflight's
//! ranks spell theirs in `preflight::Settings`); the coordinator reads and writes them through
//! `session::link::Bus`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::facts::Facts;
use nrun_node::output::Tty;

/// Why the job ended, as the coordinator told it: every node whose own nrun joined (c10d)
/// tells it too, so each node's console (a Kubernetes pod's log) says which rank failed,
/// where and how.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RootCause {
    /// The failure summary as the coordinator printed it (empty: nothing failed).
    pub summary: String,
    /// What the launcher's own TORCHELASTIC_ERROR_FILE gets (torchrun's habit).
    pub error_json: Option<String>,
}

/// How the coordinator ended the job, as an agent read it at the End.
#[derive(Debug, Default)]
pub struct Ended {
    /// The job's exit code, when the coordinator left one.
    pub code: Option<u8>,
    pub root_cause: RootCause,
}

/// The first line an agent reads on stdin (the per-run secret never appears on a command line).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub secret: String,
    pub run: String,
    pub node: usize,
    /// How the user named this host.
    pub label: String,
    /// Coordinator addresses, "ip:port": the one this agent uses is chosen among them
    /// ([`Hello::pinned`], then its ssh connection, then [`Hello::prefer`]; see
    /// `agent::choose`), and only with nothing to choose by is the first to answer taken.
    pub addrs: Vec<String>,
    /// `addrs` holds the one address the user gave (`--local-addr`): that one, nothing else.
    #[serde(default)]
    pub pinned: bool,
    /// The launch host's address this node is to use where its ssh connection does not say
    /// (the source address of the launch host's route to it; a launch tree's child: the one
    /// its parent uses), and how it was chosen. None: unknown.
    #[serde(default)]
    pub prefer: Option<Prefer>,
    pub cwd: PathBuf,
    pub version: String,
    /// The Python to probe for torch's versions; None skips the probe.
    pub python: Option<PathBuf>,
    /// Signals the agent passes on to its workers when it gets them itself (from srun, say).
    #[serde(default)]
    pub forward_signals: Vec<i32>,
    /// One srun step started every agent with this same Hello: each finds its node by name
    /// (SLURMD_NODENAME) among these labels, and `node`/`label` are ignored.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// Bump a heartbeat key every half second (the coordinator names a silent node lost).
    #[serde(default)]
    pub heartbeat: bool,
    /// The launch host's store unanswered this long: the agent stops its workers by itself.
    #[serde(default = "default_agent_timeout_ms")]
    pub agent_timeout_ms: u64,
    /// A node whose own nrun joins (c10d): its own worker count and command line, reported in
    /// its facts; the job's workers there are these.
    #[serde(default)]
    pub own: Option<crate::facts::OwnWork>,
    /// The launch tree below this agent: the nodes it starts over ssh from its own node, each
    /// with its own subtree (empty: a leaf, or no tree). See `agent::tree`.
    #[serde(default)]
    pub tree: Vec<Branch>,
    /// How to start them (set when `tree` is not empty).
    #[serde(default)]
    pub tree_ssh: Option<TreeSsh>,
    /// Other nodes probe this one's reachability: false when every node of the job is the
    /// launch host's machine (one network stack, nothing between them to probe), and the agent
    /// then opens no probe listener (a thousand of them on one machine, after earlier runs,
    /// spent over a quarter of the job's CPU in the kernel's search for a free port).
    #[serde(default = "probed_by_default")]
    pub probed: bool,
    /// Chosen at random by the launch host for an agent whose output it relays (a pipe of its
    /// own, ssh's or srun's): after each step the agent writes [`output_mark`] with it on
    /// stdout and stderr, behind the last line of that step's workers, and the launch host
    /// takes the step's result only once both came through (see `session::step`). Empty: the
    /// agent's output is its own console (a c10d peer's nrun), nothing to mark.
    #[serde(default)]
    pub output_mark: String,
    /// A c10d node's own nrun: where it keeps the last [`Succession`] it received, so that an
    /// nrun started again with the same command finds the current host (None: kept nowhere).
    #[serde(default)]
    pub state_file: Option<PathBuf>,
    /// A c10d node: the epoch of the last host it knew (0: none), which a host of an older
    /// epoch is told of and stands down for.
    #[serde(default)]
    pub epoch: u64,
}

/// What starts the line that ends a step's output in an agent's stdout and stderr: then the
/// Hello's `output_mark`, the node and the step number. A control character first: no
/// worker's line is taken for one by chance (and the token, random per run, by intent).
pub const OUTPUT_MARK: &str = "\u{1}nrun-output-end ";

/// The line an agent writes behind step `no`'s output of node `node`.
pub fn output_mark(token: &str, node: usize, no: usize) -> String {
    format!("{OUTPUT_MARK}{token} {node} {no}\n")
}

/// A mark line read back (without its '\n'): its node and step, if it is one with `token`.
pub fn read_output_mark(line: &str, token: &str) -> Option<(usize, usize)> {
    let rest = line.strip_prefix(OUTPUT_MARK)?;
    let mut parts = rest.split(' ');
    if parts.next()? != token {
        return None;
    }
    let node = parts.next()?.parse().ok()?;
    let no = parts.next()?.parse().ok()?;
    parts.next().is_none().then_some((node, no))
}

fn probed_by_default() -> bool {
    true
}

/// How the launch host's address an agent uses was chosen: said in the join's output where
/// nodes differ, and in `--report`'s `control` section.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AddrChoice {
    /// The user gave it (`--local-addr`; a c10d node: the endpoint it found).
    Given,
    /// The launch host's address this node's ssh connection came from (`SSH_CONNECTION`).
    Ssh,
    /// The source address of the launch host's route to this node.
    Route,
    /// The address this node's parent in the launch tree uses.
    Tree,
    /// Loopback: a node of the launch host's own machine.
    Local,
    /// Nothing to choose by (an agent started by srun whose name the launch host could not
    /// resolve, or an older nrun): the first address to answer.
    #[default]
    First,
}

impl AddrChoice {
    /// In words, for messages: "the address <this>".
    pub fn words(self) -> &'static str {
        match self {
            AddrChoice::Given => "given on the command line (--local-addr, --rdzv-endpoint)",
            AddrChoice::Ssh => "its ssh connection came from",
            AddrChoice::Route => "of the launch host's route to it",
            AddrChoice::Tree => "its parent in the launch tree uses",
            AddrChoice::Local => "of loopback (the launch host's own machine)",
            AddrChoice::First => "that answered first (nothing to choose by)",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AddrChoice::Given => "given",
            AddrChoice::Ssh => "ssh",
            AddrChoice::Route => "route",
            AddrChoice::Tree => "tree",
            AddrChoice::Local => "local",
            AddrChoice::First => "first",
        }
    }
}

/// A launch-host address chosen for a node by someone other than the node ([`Hello::prefer`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prefer {
    /// The launch host's IP address (no port).
    pub ip: String,
    pub how: AddrChoice,
}

/// A node of the launch tree and the nodes its agent starts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Branch {
    pub node: usize,
    pub label: String,
    #[serde(default)]
    pub children: Vec<Branch>,
    /// A node of the launch host's own machine: started without ssh (by nrun, or in that
    /// machine's tree by the agent beside it) and watched as its process. Decided once, on the
    /// launch host (a name of the machine it means there), never again where the tree is walked.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub local: bool,
}

impl Branch {
    /// This branch and all below it marked as nodes of the launch host's own machine.
    pub fn into_local(mut self) -> Branch {
        self.local = true;
        self.children = self.children.into_iter().map(Branch::into_local).collect();
        self
    }

    /// Every node below this one, depth first.
    pub fn below(&self) -> Vec<&Branch> {
        let mut out = Vec::new();
        let mut todo: Vec<&Branch> = self.children.iter().rev().collect();
        while let Some(b) = todo.pop() {
            out.push(b);
            todo.extend(b.children.iter().rev());
        }
        out
    }
}

/// What an inner agent of the launch tree needs to start its children as the launch host
/// starts its own: the same ssh options, nrun's path there, how many at once, `--ship`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeSsh {
    pub ssh_opts: Vec<String>,
    pub remote_nrun: String,
    pub concurrency: usize,
    pub ship: bool,
}

/// `--agent-timeout`'s default, 5 s.
pub(crate) const AGENT_TIMEOUT_MS: u64 = 5000;

fn default_agent_timeout_ms() -> u64 {
    AGENT_TIMEOUT_MS
}

impl Hello {
    /// This agent's node index and label: its own, or (a shared Hello) found by node name.
    pub fn place(&self) -> nrun_base::error::Result<(usize, String)> {
        if self.nodes.is_empty() {
            return Ok((self.node, self.label.clone()));
        }
        let me = std::env::var("SLURMD_NODENAME").unwrap_or_else(|_| nrun_base::net::hostname());
        if let Some(i) = self.nodes.iter().position(|n| *n == me) {
            return Ok((i, me));
        }
        // Names can differ in form (short, FQDN): the step's node index is the same order.
        match std::env::var("SLURM_NODEID")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
        {
            Some(i) if i < self.nodes.len() => Ok((i, self.nodes[i].clone())),
            _ => Err(nrun_base::error::Error::helper(format!(
                "nrun agent on {me}: this node is not among the job's nodes ({})",
                self.nodes.join(", ")
            ))),
        }
    }
}

/// What an agent publishes once connected.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Joined {
    /// The address of this node's end of its store connection.
    pub local_addr: String,
    /// The coordinator address this agent uses.
    pub reached: String,
    /// How it was chosen.
    #[serde(default)]
    pub chosen: AddrChoice,
    /// Where this node answers reachability probes from other nodes (empty: it is not probed,
    /// see [`Hello::probed`]).
    pub probe_addr: String,
    /// Chosen at random by the agent for this join: every step sealed for it covers this, so a
    /// step captured from an earlier run (or join) does not open here.
    pub nonce: String,
    pub facts: Facts,
    /// With the run's secret, a node's own work (c10d) travels sealed like a step (its command
    /// line may carry what the wire must not show), bound to this join's nonce; without it,
    /// in `facts.own`, in clear as the steps are.
    #[serde(default)]
    pub own_sealed: Option<Vec<u8>>,
    /// How the launch host ends this agent from outside when it cannot end itself (stopped by
    /// SIGSTOP, hung): `nrun __reap` over a second ssh connection. None: an agent with no
    /// keeper of its own (one tied to a parent on its host, which dies with it).
    #[serde(default)]
    pub kept: Option<Kept>,
}

pub use nrun_node::keeper::Kept;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Step {
    /// Connect to another node's probe listener.
    Probe {
        target: String,
        timeout_ms: u64,
    },
    /// Run a group of workers to its end (an empty group: idle through this step).
    Run {
        workers: Vec<WorkerSpec>,
        grace_ms: u64,
        deadline_ms: Option<u64>,
        /// Sample the workers' Python stacks and publish a [`NodeWatch`] (see `watch`).
        #[serde(default)]
        watch: bool,
        /// With the watch: the hang timeout the coordinator judges by, which tells the node
        /// when a stall is worth a flight-recorder dump (absent from an older launcher: the
        /// node asks early).
        #[serde(default)]
        hang_timeout_ms: Option<u64>,
        /// A c10d rendezvous' host: who takes over hosting if it is lost (None: not c10d, or
        /// an older launcher).
        #[serde(default)]
        succession: Option<Succession>,
    },
    End,
}

/// Who takes over hosting a c10d rendezvous when its host is lost, as the step that carries
/// it left the world: every node keeps the last one it received (`agent::last_succession`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Succession {
    /// The rendezvous id (`--rdzv-id`): a host found for another is no successor.
    pub id: String,
    /// 1 for the host the nodes first found at the endpoint, +1 each time a new host takes
    /// over: a host of an older epoch is refused.
    pub epoch: u64,
    /// The run name of the job's first host, kept by every host that takes over: epochs
    /// compare within one job only (a later job may reuse the rendezvous id).
    #[serde(default)]
    pub lineage: String,
    /// The host as its nodes reach it: the endpoint's host, or the address a host that took
    /// over was seen at.
    pub host: String,
    /// How many nodes the step's world has, the host included (the majority is of these).
    pub world: usize,
    /// The step's other nodes in join order, the host excluded: the order of takeover.
    pub nodes: Vec<Successor>,
}

/// A node that would take over hosting: where the host saw it, and the port it would host on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Successor {
    /// Its node index under the host that sent the succession.
    pub node: usize,
    /// Its address as the host saw its connection come (no port).
    pub addr: String,
    pub port: u16,
}

impl Step {
    /// Whether it starts workers (and so needs stop requests and signals while it runs).
    pub fn runs_workers(&self) -> bool {
        matches!(self, Step::Run { workers, .. } if !workers.is_empty())
    }

    /// Nothing to do this step (a node outside every group of a bisect round).
    pub fn idle() -> Step {
        Step::Run {
            workers: Vec::new(),
            grace_ms: 0,
            deadline_ms: None,
            watch: false,
            hang_timeout_ms: None,
            succession: None,
        }
    }
}

/// A [`WorkerSpec::program`] meaning "the nrun that runs this agent" (preflight ranks): the
/// path differs between nodes with --ship or --remote-nrun.
pub const THIS_NRUN: &str = "<nrun>";

/// One worker as its node's agent starts it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerSpec {
    pub rank: usize,
    pub local_rank: usize,
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub error_file: PathBuf,
    pub prefix: String,
    pub colour: usize,
    /// Whether stdout / stderr reach the console.
    pub console: [bool; 2],
    /// Where this worker's stdout.log and stderr.log go on its node (--log-dir), if anywhere.
    #[serde(default)]
    pub log_dir: Option<PathBuf>,
    #[serde(default)]
    pub color: nrun_node::output::Color,
    /// Reads nrun's stdin (a rank on the launch host only).
    #[serde(default)]
    pub stdin: bool,
    /// Bound to the CPUs of its GPU's NUMA node, found on its node.
    #[serde(default)]
    pub numa: bool,
    /// One of nrun's own ranks: its agent gives it the run's secret (NRUN_SECRET), which is
    /// never written into a step (nothing that opens a step belongs in one).
    #[serde(default)]
    pub secret: bool,
    /// Per stream (stdout, stderr): a terminal of this size (columns, rows) instead of a pipe,
    /// where the launcher's own stream is one ([`nrun_node::output::Tty`]).
    #[serde(default)]
    pub tty: [Option<nrun_node::output::Tty>; 2],
    /// `--progress-regex`: its node counts the lines of its output that match, and the
    /// highest step they name ([`nrun_node::output::Progress`]).
    #[serde(default)]
    pub progress: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum StepResult {
    Probe { error: Option<String> },
    Run(RunResult),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum RunResult {
    Success,
    Failed(WorkerFailure),
    Interrupted(i32),
    TimedOut,
    Stopped,
    SpawnError(String),
    /// Set by the coordinator for a node whose agent connection ended without a result.
    Lost(String),
}

impl RunResult {
    /// A result that stops the other nodes' workers (a failure here, or a lost node).
    pub fn is_failure(&self) -> bool {
        matches!(
            self,
            RunResult::Failed(_)
                | RunResult::SpawnError(_)
                | RunResult::TimedOut
                | RunResult::Lost(_)
        )
    }
}

/// The first failing worker of a node, with what the failure summary shows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerFailure {
    pub rank: usize,
    pub local_rank: usize,
    pub pid: u32,
    pub exit_code: u8,
    /// How it ended: what the fault model and the events match on; its words ("exited with
    /// code 3", "was killed by SIGKILL (killed by the kernel's out-of-memory killer ...)") are
    /// for the console and the report.
    pub how: Ending,
    /// A GPU error in its last words (its stderr's tail, its traceback), as its node read them.
    #[serde(default)]
    pub gpu: Option<Box<GpuSign>>,
    /// RFC 3339, seconds.
    pub at: String,
    pub stderr_tail: Vec<String>,
    pub traceback: Option<String>,
    /// Where the traceback came from (TORCHELASTIC_ERROR_FILE on its node).
    pub error_file: PathBuf,
    /// Ranks of its node that exited 0 shortly before it failed (rank, seconds before), named
    /// only where every failure of the node shows a peer's doing (see node::failed_by_peer).
    #[serde(default)]
    pub left_early: Vec<(usize, f64)>,
    /// The error file as the worker wrote it (for the launcher's own TORCHELASTIC_ERROR_FILE).
    #[serde(default)]
    pub error_json: Option<String>,
    /// The error file stays after the job (it is under --log-dir, not nrun's scratch).
    #[serde(default)]
    pub error_file_kept: bool,
    /// What its node's workers' output showed of their progress (`--progress-regex`; none
    /// without it, or from an older agent).
    #[serde(default)]
    pub progress: Option<Box<nrun_node::output::Progress>>,
}

impl WorkerFailure {
    /// Reads the GPU signs in its last words ([`GpuSign::find`]): the node does, once.
    pub fn with_signs(mut self) -> WorkerFailure {
        let tail = self.stderr_tail.iter().chain(self.traceback.iter());
        self.gpu = GpuSign::find(tail.map(String::as_str)).map(Box::new);
        self
    }
}

/// How a failed worker ended, as its node saw it. Said in words (`Display`) only where a
/// person reads them: no decision depends on the wording.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ending {
    /// It exited with a code, or a signal ended it.
    Exit(nrun_node::Exit),
    /// SIGKILL, and a witness on its node says the out-of-memory killer sent it.
    OutOfMemory(Box<Oom>),
}

/// The witness of an out-of-memory kill (agent::oom).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Oom {
    /// The kernel log's line for the kill: the worker's resident memory then ("123456kB").
    Kernel { rss: String },
    /// The oom_kill counter of the agent's memory cgroup rose: the limit's file, the limit,
    /// and the kills since the workers started.
    Cgroup {
        limit_file: PathBuf,
        limit: String,
        kills: u64,
    },
}

impl Ending {
    /// The signal that ended the worker, if one did.
    pub fn signal(&self) -> Option<i32> {
        match self {
            Ending::Exit(e) => e.signal(),
            Ending::OutOfMemory(_) => Some(libc::SIGKILL),
        }
    }

    /// The signal's name ("SIGKILL"), if one ended the worker.
    pub fn signal_name(&self) -> Option<String> {
        self.signal().map(nrun_node::signal_name)
    }

    /// Killed by the system, not by its own doing: SIGKILL or SIGBUS (the OOM killer, a
    /// cgroup, the node).
    pub fn by_the_system(&self) -> bool {
        matches!(self.signal(), Some(libc::SIGKILL | libc::SIGBUS))
    }
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ending::Exit(e) => write!(f, "{e}"),
            Ending::OutOfMemory(o) => {
                write!(f, "{} ({o})", nrun_node::Exit::Signal(libc::SIGKILL))
            }
        }
    }
}

impl std::fmt::Display for Oom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Oom::Kernel { rss } => write!(
                f,
                "killed by the kernel's out-of-memory killer (kernel log: {rss} resident at the \
                 kill)"
            ),
            Oom::Cgroup {
                limit_file,
                limit,
                kills,
            } => write!(
                f,
                "killed by the out-of-memory killer of its cgroup ({}: {limit}, {kills} OOM \
                 kill(s) since the workers started)",
                limit_file.display()
            ),
        }
    }
}

/// A GPU error in a worker's last words, the line that shows it (lower case, trimmed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuSign {
    /// A GPU or driver fault no program causes: an XID, an ECC error, a GPU lost or fallen
    /// off the bus.
    Hard(String),
    /// An error a program can cause as well as a sick GPU ("unhandled cuda error",
    /// "unspecified launch failure").
    Soft(String),
}

/// Signs in a worker's last words of a GPU or driver fault that no program causes.
const HARD_GPU: [&str; 6] = [
    "xid",
    "uncorrectable ecc",
    "ecc error",
    "fallen off the bus",
    "gpu is lost",
    "nvml_error_gpu_is_lost",
];

/// Signs of a GPU error a program can cause as well as a sick GPU.
const SOFT_GPU: [&str; 3] = [
    "unhandled cuda error",
    "unspecified launch failure",
    "cudaerrordevicesunavailable",
];

impl GpuSign {
    /// The worker's own output is text: it is read here, where its node turns it into
    /// evidence, and nowhere after. A hard sign anywhere wins over a soft one.
    pub fn find<'a>(lines: impl Iterator<Item = &'a str>) -> Option<GpuSign> {
        let text: Vec<String> = lines.map(str::to_lowercase).collect();
        let find = |signs: &[&str]| {
            signs.iter().find_map(|s| {
                text.iter()
                    .find(|l| l.contains(s))
                    .map(|l| l.trim().to_string())
            })
        };
        find(&HARD_GPU)
            .map(GpuSign::Hard)
            .or_else(|| find(&SOFT_GPU).map(GpuSign::Soft))
    }
}

/// One frame of a rank's Python stack.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    pub name: String,
    pub file: String,
    pub line: i32,
    /// The source line, read on the rank's node.
    #[serde(default)]
    pub code: Option<String>,
}

/// One rank as its node's watch last saw it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RankView {
    pub rank: usize,
    pub pid: u32,
    /// The main thread's stack, innermost frame first (at most a few).
    pub frames: Vec<Frame>,
    /// The torch.distributed call it waits in (`all_reduce`, `barrier`, ...), if any.
    pub collective: Option<String>,
    /// How long its stack has not changed, milliseconds.
    pub unchanged_ms: u64,
    /// Samples taken, and in how many it waited in a collective (straggler statistics).
    pub samples: u32,
    pub waiting: u32,
    /// Set once the worker has ended (words only where a person reads them: its `Display`).
    pub exited: Option<nrun_node::Exit>,
    /// Why its stack could not be read, if it could not.
    pub error: Option<String>,
    /// Its flight recorder's last dump (NCCL jobs), if one was read.
    #[serde(default)]
    pub fr: Option<FrView>,
    /// Its time in collectives on the GPU over the last seconds (NCCL jobs, from nrun's NCCL
    /// profiler plugin: see `agent::gpu_time`).
    #[serde(default)]
    pub gpu: Option<GpuWait>,
}

/// A rank's time in collectives' kernels on its GPU over a span of wall time: the time it
/// waited for its peers (a slow rank reaches each collective last and hardly waits).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuWait {
    pub waited_ms: f64,
    pub span_ms: f64,
    /// Collectives completed in the span.
    pub collectives: u64,
}

/// A rank's flight recorder, summed up (see `agent::flight`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FrView {
    /// The last collective enqueued, and the last completed (of the same process group).
    pub last: FrOp,
    pub completed: Option<FrOp>,
    /// Time its completed collectives took on the GPU over the span of the ring (ms), when
    /// torch timed them: the time it waited for its peers.
    pub waited_ms: Option<f64>,
    pub span_ms: Option<f64>,
    /// The ring's collectives of that group in order, as runs of the same op and size: what
    /// the coordinator compares across ranks to find the first collective they disagree on.
    #[serde(default)]
    pub runs: Vec<FrRun>,
}

/// Collectives `first..=last` of one process group, all the same op and size.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FrRun {
    pub first: u64,
    pub last: u64,
    pub op: String,
    pub bytes: u64,
}

/// One collective in a flight recorder.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FrOp {
    /// The collective's sequence number in its process group.
    pub seq: u64,
    pub op: String,
    /// Bytes of its inputs.
    pub bytes: u64,
    /// The process group's name.
    pub pg: String,
    /// "scheduled", "started" or "completed".
    pub state: String,
}

/// What a node's watch publishes about its ranks, about once a second.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NodeWatch {
    pub ranks: Vec<RankView>,
    /// NCCL's RAS status, asked while the node's ranks stall (the node of rank 0 only).
    #[serde(default)]
    pub ras: Option<RasView>,
}

/// Milliseconds since the Unix epoch: when a [`RasView`] was taken, comparable across hosts.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What NCCL's RAS said when last asked (see `agent::ras`), or why it could not be asked.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RasView {
    /// When it answered, ms since the Unix epoch.
    pub at_ms: u64,
    pub text: Option<String>,
    pub error: Option<String>,
}

/// A request to every node running step `no`, the `seq`th of that step ([`Keys::control`]):
/// stops and forwarded signals are one series, so an agent waits on one key at a time on its
/// one connection to the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// Stop the step: politely (None: another node failed; SIGTERM, SIGKILL after the grace
    /// period), or with the signal the user sent nrun.
    Stop(Option<i32>),
    /// Pass this signal on to every worker.
    Forward(i32),
    /// The launcher's terminal (stdout's and stderr's sizes) was resized: the workers'
    /// terminals follow it.
    Resize([Option<Tty>; 2]),
}

impl Control {
    pub fn encode(self) -> Vec<u8> {
        match self {
            Control::Stop(None) => b"stop".to_vec(),
            Control::Stop(Some(s)) => format!("stop {s}").into_bytes(),
            Control::Forward(s) => format!("signal {s}").into_bytes(),
            Control::Resize(sizes) => {
                let [o, e] =
                    sizes.map(|t| t.map_or("-".into(), |t| format!("{}x{}", t.cols, t.rows)));
                format!("resize {o} {e}").into_bytes()
            }
        }
    }

    pub fn decode(value: &[u8]) -> Option<Control> {
        let text = std::str::from_utf8(value).ok()?;
        if let Some(sizes) = text.strip_prefix("resize ") {
            let size = |w: &str| -> Option<Option<Tty>> {
                if w == "-" {
                    return Some(None);
                }
                let (c, r) = w.split_once('x')?;
                Some(Some(Tty {
                    cols: c.parse().ok()?,
                    rows: r.parse().ok()?,
                }))
            };
            let mut words = sizes.split(' ');
            let (o, e) = (size(words.next()?)?, size(words.next()?)?);
            return words.next().is_none().then_some(Control::Resize([o, e]));
        }
        let mut words = text.split(' ');
        let what = words.next()?;
        let sig = words.next().map(str::parse::<i32>);
        match (what, sig, words.next()) {
            ("stop", None, None) => Some(Control::Stop(None)),
            ("stop", Some(Ok(s)), None) => Some(Control::Stop(Some(s))),
            ("signal", Some(Ok(s)), None) => Some(Control::Forward(s)),
            _ => None,
        }
    }
}

/// The keys of one run's conversation.
#[derive(Clone, Debug)]
pub struct Keys {
    run: String,
}

impl Keys {
    pub fn new(run: &str) -> Keys {
        Keys { run: run.into() }
    }

    fn key(&self, what: std::fmt::Arguments<'_>) -> Vec<u8> {
        format!("nrun/{}/{what}", self.run).into_bytes()
    }

    /// The node a key of this run is about (`nrun/<run>/n<node>/...`), if any.
    pub fn node_of(&self, key: &[u8]) -> Option<usize> {
        let rest = key
            .strip_prefix(b"nrun/")?
            .strip_prefix(self.run.as_bytes())?
            .strip_prefix(b"/n")?;
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if rest.get(digits) != Some(&b'/') {
            return None;
        }
        std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
    }

    /// Where node `node` publishes its [`Joined`] record.
    pub fn joined(&self, node: usize) -> Vec<u8> {
        self.key(format_args!("n{node}/joined"))
    }

    /// Node `node`'s step number `step`.
    pub fn step(&self, node: usize, step: usize) -> Vec<u8> {
        self.key(format_args!("n{node}/step/{step}"))
    }

    /// Node `node`'s result of step `step`.
    pub fn result(&self, node: usize, step: usize) -> Vec<u8> {
        self.key(format_args!("n{node}/result/{step}"))
    }

    /// The `seq`th [`Control`] of step `step`, for every node.
    pub fn control(&self, step: usize, seq: usize) -> Vec<u8> {
        self.key(format_args!("ctl/{step}/{seq}"))
    }

    /// The job's exit code, set before the end (a node started on its own exits with it).
    pub fn exit(&self) -> Vec<u8> {
        self.key(format_args!("exit"))
    }

    /// The job's [`RootCause`] (JSON), set with the exit code: a node started on its own ends
    /// its console with it and writes it to its TORCHELASTIC_ERROR_FILE.
    pub fn root_cause(&self) -> Vec<u8> {
        self.key(format_args!("root-cause"))
    }

    /// Bumped every second by a node started on its own (c10d): it is alive.
    pub fn alive(&self, node: usize) -> Vec<u8> {
        self.key(format_args!("n{node}/alive"))
    }

    /// Set by an inner agent of the launch tree when the ssh that starts node `node`'s agent
    /// ended before the End: how it ended and what ssh or nrun said last (text).
    pub fn tree_lost(&self, node: usize) -> Vec<u8> {
        self.key(format_args!("n{node}/tree-lost"))
    }

    /// Node `node`'s latest [`NodeWatch`] during step `step`.
    pub fn watch(&self, node: usize, step: usize) -> Vec<u8> {
        self.key(format_args!("n{node}/watch/{step}"))
    }

    /// Set at node 0's store by node `node` of a static launch when it arrives (its host
    /// name): each waits there until all have (`session::meet`).
    pub fn static_arrived(&self, node: usize) -> Vec<u8> {
        self.key(format_args!("static/{node}"))
    }

    /// A SET here stores the address the store sees node `node` connect from (NAT check).
    pub fn observe(&self, node: usize) -> Vec<u8> {
        [
            nrun_store::server::OBSERVE_PREFIX,
            format!("{}/{node}", self.run).as_bytes(),
        ]
        .concat()
    }
}

/// Where the nrun hosting a c10d rendezvous `id` leaves its run's name (the keys' namespace).
pub fn c10d_run_key(id: &str) -> Vec<u8> {
    format!("nrun/c10d/{id}/run").into_bytes()
}

/// Readable without the secret: set by every nrun that hosts a store (its version), so a
/// joining nrun knows an nrun listens there.
pub const NRUN_STORE_KEY: &[u8] = b"nrun/public/store";

/// Readable without the secret: set by the nrun hosting c10d rendezvous `id`, so a node with
/// another id (another job on that endpoint) is told so at once.
pub fn c10d_public_key(id: &str) -> Vec<u8> {
    format!("nrun/public/c10d/{id}").into_bytes()
}

/// What torchrun's c10d rendezvous backend writes first, for run `id`
/// (`torch.distributed.elastic.rendezvous.c10d_rendezvous_backend`: `"torch.rendezvous." +
/// run_id`, by compare_set at its start): how nrun tells a torchrun node apart. On the wire,
/// as torch's TCPStore client sends every key, with its "/" prefix (`keyPrefix_`).
pub fn torchrun_rdzv_key(id: &str) -> Vec<u8> {
    format!("/torch.rendezvous.{id}").into_bytes()
}

/// Set by a c10d node in the store of a host it left for a newer one (that epoch, decimal): a
/// host that was frozen reads it when it wakes and stands down instead of taking its nodes'
/// closed connections for deaths.
pub fn c10d_newer_key(id: &str) -> Vec<u8> {
    format!("nrun/public/c10d/{id}/newer").into_bytes()
}

/// The epoch of the nrun hosting c10d rendezvous `id` and its job's lineage ("EPOCH LINEAGE",
/// see [`Succession::lineage`]), readable before joining.
pub fn c10d_epoch_key(id: &str) -> Vec<u8> {
    format!("nrun/public/c10d/{id}/epoch").into_bytes()
}

/// The counter a joining node adds 1 to for its node index, in join order.
pub fn c10d_next_key(id: &str) -> Vec<u8> {
    format!("nrun/c10d/{id}/next").into_bytes()
}

/// How many more nodes the nrun hosting c10d rendezvous `id` takes now (decimal; unset: none
/// beyond its slots): a node whose index is past the slots (one that came back after its first
/// nrun was lost) joins if this is above 0 (the session publishes it).
pub fn c10d_room_key(id: &str) -> Vec<u8> {
    format!("nrun/c10d/{id}/room").into_bytes()
}

/// Set by the nrun hosting c10d rendezvous `id` for a machine it left out on evidence against
/// the node itself (not its nrun's loss): the evidence, in words. A node of that machine
/// (`host`: its boot id and network namespace, `facts::machine_or_hostname`; host names are
/// shared by clones) is refused.
pub fn c10d_refused_key(id: &str, host: &str) -> Vec<u8> {
    format!("nrun/c10d/{id}/refused/{host}").into_bytes()
}

/// What a rank waits in: a torch.distributed collective, or a point where the CPU waits for the
/// GPU (NCCL collectives are asynchronous: a rank stuck behind one waits at its next `.item()`,
/// `.cpu()` or `synchronize()`), said as "a GPU sync (<its line>)".
pub fn waits_in(v: &RankView) -> Option<String> {
    if let Some(op) = &v.collective {
        return Some(op.clone());
    }
    const SYNCS: [&str; 6] = [
        ".item()",
        ".cpu()",
        ".tolist()",
        ".numpy()",
        "synchronize(",
        ".wait()",
    ];
    let f = v.frames.iter().find(|f| {
        (f.name == "synchronize" && f.file.ends_with("torch/cuda/__init__.py"))
            || f.code
                .as_deref()
                .is_some_and(|c| SYNCS.iter().any(|m| c.contains(m)))
    })?;
    let line = f.code.as_deref().unwrap_or(&f.name);
    Some(format!("a GPU sync ({line})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_in_nruns_space_and_stop_values_round_trip() {
        let k = Keys::new("job-7");
        assert_eq!(k.step(2, 5), b"nrun/job-7/n2/step/5");
        assert_eq!(k.result(0, 1), b"nrun/job-7/n0/result/1");
        assert_eq!(k.control(3, 0), b"nrun/job-7/ctl/3/0");
        assert_eq!(k.joined(1), b"nrun/job-7/n1/joined");
        assert!(k.observe(1).starts_with(nrun_store::server::OBSERVE_PREFIX));
        for c in [
            Control::Stop(None),
            Control::Stop(Some(2)),
            Control::Forward(10),
            Control::Resize([
                Some(Tty {
                    cols: 120,
                    rows: 40,
                }),
                None,
            ]),
            Control::Resize([None, Some(Tty { cols: 0, rows: 0 })]),
        ] {
            assert_eq!(Control::decode(&c.encode()), Some(c));
        }
        for bad in [
            &b""[..],
            b"stop x",
            b"signal",
            b"signal 1 2",
            b"go",
            b"resize",
            b"resize 1x2",
            b"resize 1x2 3x4 5x6",
            b"resize 1x -",
            b"resize 70000x2 -",
        ] {
            assert_eq!(Control::decode(bad), None);
        }
    }

    /// An inner agent's Hello carries its subtree and how to start it; a Hello from before
    /// the launch tree reads as a leaf.
    #[test]
    fn a_hello_with_a_subtree_round_trips() {
        let leaf = |node: usize| Branch {
            local: false,
            node,
            label: format!("b{node}"),
            children: Vec::new(),
        };
        let hello = Hello {
            secret: "s".into(),
            run: "r".into(),
            node: 1,
            label: "b1".into(),
            addrs: vec!["10.0.0.1:29500".into()],
            pinned: false,
            prefer: Some(Prefer {
                ip: "10.0.0.1".into(),
                how: AddrChoice::Route,
            }),
            cwd: "/w".into(),
            version: "v".into(),
            python: None,
            forward_signals: vec![10],
            nodes: Vec::new(),
            heartbeat: true,
            agent_timeout_ms: 5000,
            own: None,
            tree: vec![
                Branch {
                    node: 3,
                    label: "b3".into(),
                    children: vec![leaf(5)],
                    local: true,
                },
                leaf(4),
            ],
            tree_ssh: Some(TreeSsh {
                ssh_opts: vec!["-F".into(), "/c".into()],
                remote_nrun: "/opt/nrun".into(),
                concurrency: 64,
                ship: true,
            }),
            probed: false,
            output_mark: "t0".into(),
            state_file: None,
            epoch: 0,
        };
        let json = serde_json::to_string(&hello).unwrap();
        let back: Hello = serde_json::from_str(&json).unwrap();
        assert_eq!(back.tree, hello.tree);
        assert_eq!(back.tree_ssh, hello.tree_ssh);
        assert!(!back.probed);
        assert_eq!(back.prefer, hello.prefer);
        // The mark behind a step's output reads back only with its own token, whole.
        let mark = output_mark(&back.output_mark, 3, 7);
        let line = mark.trim_end_matches('\n');
        assert_eq!(read_output_mark(line, "t0"), Some((3, 7)));
        assert_eq!(read_output_mark(line, "t1"), None);
        assert_eq!(read_output_mark(&format!("{line} 1"), "t0"), None);
        assert_eq!(read_output_mark("nrun-output-end t0 3 7", "t0"), None);
        assert_eq!(
            back.tree[0]
                .below()
                .iter()
                .map(|b| b.node)
                .collect::<Vec<_>>(),
            [5]
        );
        let old = r#"{"secret":"s","run":"r","node":0,"label":"a","addrs":[],"cwd":"/",
            "version":"v","python":null}"#;
        let old: Hello = serde_json::from_str(old).unwrap();
        assert!(old.tree.is_empty() && old.tree_ssh.is_none() && old.probed);
        assert!(!old.pinned && old.prefer.is_none());
        assert_eq!(Keys::new("r").tree_lost(7), b"nrun/r/n7/tree-lost");
        assert_eq!(
            Keys::new("r").node_of(&Keys::new("r").tree_lost(7)),
            Some(7)
        );
    }

    /// The coordinator looks again only at the node a changed key names.
    #[test]
    fn a_key_names_its_node() {
        let k = Keys::new("job-7");
        assert_eq!(k.node_of(&k.joined(12)), Some(12));
        assert_eq!(k.node_of(&k.result(0, 3)), Some(0));
        assert_eq!(k.node_of(&k.alive(2047)), Some(2047));
        assert_eq!(k.node_of(&k.control(3, 1)), None);
        assert_eq!(k.node_of(&Keys::new("job-70").joined(1)), None);
        assert_eq!(k.node_of(b"nrun/job-7/n"), None);
        assert_eq!(k.node_of(b"nrun/job-7/n5"), None);
        assert_eq!(k.node_of(b"nrun/job-7/nx/joined"), None);
    }
}
