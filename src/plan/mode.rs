//! What nrun was asked to do: [`Mode`], each command's own settings ([`RunSettings`],
//! [`DoctorSettings`], [`BisectSettings`]) and the parts they share: the session's
//! ([`SessionPlan`], [`StorePlan`], [`C10d`]) and the nodes' [`Shape`]. Types only; each
//! command's settings are resolved in its own file ([`super::run`], [`super::bisect`]).

use std::path::PathBuf;
use std::time::Duration;

use nrun_cli::Probe;

use super::rdzv::LAST_CALL;
use super::{NodesPlan, PreflightPlan, WorkersPlan};

/// Where the store lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StorePlan {
    /// nrun hosts it: bind `port` (0 = any free port); workers reach it at `advertise` (an
    /// address, or a host name the user chose).
    Host { port: u16, advertise: String },
    /// Another node's nrun hosts it (torchrun-style static multi-node, node rank > 0).
    Remote { addr: String, port: u16 },
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
    /// The launch host's address every remote agent uses (`--local-addr` with nodes nrun
    /// starts); None: chosen per node (`agent::choose`).
    pub control_addr: Option<String>,
}

impl SessionPlan {
    /// A session of nrun's own (doctor, bisect) on a store it hosts on any free port, named
    /// `run_id`, open to nothing but its agents.
    pub(super) fn own(
        run_id: &str,
        advertise: &str,
        python: Option<PathBuf>,
        control_addr: Option<String>,
    ) -> SessionPlan {
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
            control_addr,
        }
    }
}

/// The nodes and workers a command asks for, which [`NodesPlan::resolve`] lays out on hosts.
#[derive(Clone, Debug)]
pub(crate) struct Shape {
    pub nproc: usize,
    /// `--nproc-per-node` was given: not given, a scheduler's slots are said to be unused.
    pub nproc_given: bool,
    /// Nodes wanted (the most, for an elastic range).
    pub nnodes: usize,
    /// `--nnodes` was given (on the command line or in the environment): with a host list, the
    /// job runs on that many of its hosts, even 1; not given, on all of them.
    pub nnodes_given: bool,
    /// Elastic `--nnodes MIN:MAX`: the job goes on with at least this many nodes.
    pub min_nodes: usize,
    /// This node's rank in a static launch.
    pub node_rank: usize,
    /// `--rdzv-conf last_call_timeout`: how long to wait for more nodes once MIN have joined.
    pub last_call: Duration,
    /// `--rdzv-conf join_timeout=S`, which says what --join-timeout says (both: refused).
    pub rdzv_join_timeout: Option<Duration>,
    /// Nodes rendezvous as torchrun's c10d.
    pub c10d: bool,
    /// A torchrun-style launch by rank or address (--node-rank, --master-addr,
    /// --rdzv-endpoint), where every node runs its own nrun, or `--standalone` (this node
    /// alone): no scheduler's node list is read.
    pub ranked: bool,
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
    pub(super) fn per_host(nproc: usize, python: bool) -> Shape {
        Shape {
            nproc,
            nproc_given: true,
            nnodes: 1,
            nnodes_given: false,
            min_nodes: 1,
            node_rank: 0,
            last_call: LAST_CALL,
            rdzv_join_timeout: None,
            c10d: false,
            ranked: false,
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
    /// `--report-html FILE`: the same report as a page a person reads.
    pub report_html: Option<PathBuf>,
    /// `--events`, `--metrics-file`, `--metrics-port`: the journal's consumers.
    pub journal: crate::journal::JournalPlan,
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
    /// Set on the node that took over hosting after the host was lost (see
    /// `session::c10d`): the epoch it hosts and the majority it waits for.
    pub took_over: Option<TookOver>,
}

/// A c10d node that took over hosting: its epoch, and how many nodes (itself included) must
/// be with it before its workers start (a strict majority of the last world's nodes, those
/// known dead not counted).
#[derive(Clone, Debug)]
pub(crate) struct TookOver {
    pub epoch: u64,
    /// The job's lineage (its first host's run name), kept.
    pub lineage: String,
    pub quorum: usize,
    /// The last world's nodes that may be alive (those known dead not counted): once that
    /// many are in, no other is waited for.
    pub alive: usize,
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
    /// `--report-html FILE`: the report drawn.
    pub report_html: Option<PathBuf>,
}
