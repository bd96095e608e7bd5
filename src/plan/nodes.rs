//! Which nodes a run uses and how: `-H`, `--hostfile`, or inside a batch scheduler's allocation
//! of several nodes its node list (Slurm, PBS/Torque, LSF, SGE/UGE: [`scheduler_nodes`]);
//! `--include/--exclude`, `--nnodes`; the rank layout; how each node's agent starts; what every
//! worker everywhere gets. Without a host list the run is a single node (this host, or this
//! node of a torchrun-style static launch) whose agent runs in-process.

use std::time::Duration;

use crate::hosts::{self, Host};
use crate::remote;
use nrun_base::error::{Error, Result};
use nrun_cli::{LauncherChoice, NodesArgs};

use super::Shape;

/// How long the nodes have to join when neither --join-timeout nor --rdzv-conf says.
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);

/// One node's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NodeLayout {
    /// The node's GROUP_RANK.
    pub group_rank: usize,
    /// (global rank, local rank, slot index) of each of its workers.
    pub ranks: Vec<(usize, usize, usize)>,
    /// CUDA_VISIBLE_DEVICES for the node's workers when `--include host:SLOTS` picked GPUs.
    pub devices: Option<String>,
}

/// Everything about the nodes, decided before anything starts.
#[derive(Clone, Debug)]
pub(crate) struct NodesPlan {
    pub hosts: Vec<Host>,
    pub layout: Vec<NodeLayout>,
    /// Ranks and nodes in the whole job (a static launch runs one node of several).
    pub world: usize,
    pub group_world: usize,
    /// The single node of a run without a host list: its agent runs inside nrun.
    pub in_process: bool,
    /// The kind of link that starts the agents of the hosts nrun owns, by its name (see
    /// `session::link::LAUNCHERS`): `ssh` or `srun`.
    pub launcher: &'static str,
    pub ssh_opts: Vec<String>,
    pub ssh_concurrency: usize,
    /// Agents one agent starts over ssh at most, the launch host's included (`--tree-width`;
    /// 0: no launch tree). See `plan::tree`.
    pub tree_width: usize,
    pub ship: bool,
    /// Variables every worker on every node gets (forwarded, .nrun_env, -x).
    pub env: Vec<(String, String)>,
    pub ifname: Option<String>,
    pub join_timeout: Duration,
    pub allow_mismatch: bool,
    pub python_probe: bool,
    pub remote_nrun: String,
    /// The hostfile's text, so bisect can write the good hosts back in the input's format.
    pub hostfile: Option<(String, String)>,
    /// The last `peers` hosts are nodes whose own nrun joins (c10d): placeholders until then.
    pub peers: usize,
    /// Elastic: the job goes on with at least this many nodes (all of them otherwise).
    pub min_nodes: usize,
    /// Elastic: how long to wait for more nodes once `min_nodes` joined.
    pub last_call: Duration,
    /// An agent stops its workers when the launch host's store is silent this long.
    pub agent_timeout: Duration,
    /// How many nodes the job runs on (MAX when elastic); the hosts beyond are spares.
    pub size: usize,
    /// Hosts --exclude-file kept out of this run, with the reason it gives.
    pub avoided: Vec<super::exclude::Entry>,
    /// Where nodes this run leaves out are remembered.
    pub exclude_file: Option<super::exclude::ExcludeFile>,
    /// The hosts came from a Slurm allocation (the next sbatch gets an --exclude= list).
    pub from_slurm: bool,
}

impl NodesPlan {
    /// How many nodes this nrun starts itself; the rest (the last `peers`) are c10d slots that a
    /// node's own nrun fills by joining.
    pub(crate) fn owned(&self) -> usize {
        self.hosts.len() - self.peers
    }

    /// Every node of `hosts` with one worker, joined by agents over ssh: the plan of a session a
    /// unit test builds by hand.
    #[cfg(test)]
    pub(crate) fn for_tests(hosts: Vec<Host>) -> NodesPlan {
        let n = hosts.len();
        NodesPlan {
            layout: (0..n)
                .map(|i| NodeLayout {
                    group_rank: i,
                    ranks: vec![(i, 0, 0)],
                    devices: None,
                })
                .collect(),
            hosts,
            world: n,
            group_world: n,
            in_process: false,
            launcher: "ssh",
            ssh_opts: Vec::new(),
            ssh_concurrency: 1,
            tree_width: 0,
            ship: false,
            env: Vec::new(),
            ifname: None,
            join_timeout: Duration::from_secs(30),
            allow_mismatch: false,
            python_probe: false,
            remote_nrun: "nrun".into(),
            hostfile: None,
            peers: 0,
            min_nodes: n,
            last_call: Duration::from_secs(30),
            agent_timeout: Duration::from_secs(5),
            size: n,
            avoided: Vec::new(),
            exclude_file: None,
            from_slurm: false,
        }
    }

    /// The nodes of a command of `shape`.
    pub(crate) fn resolve(
        args: &NodesArgs,
        shape: &Shape,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<NodesPlan> {
        let HostList {
            list,
            hostfile,
            from_slurm,
            said,
        } = host_list(args, shape, env)?;
        if let Some(line) = said {
            tracing::info!("{line}");
        }
        let mut nodes = NodesPlan::settings(args, shape, env, from_slurm)?;
        nodes.in_process = list.is_none();
        nodes.hostfile = hostfile;
        if shape.c10d {
            nodes.c10d(shape, args.spares)?;
            return Ok(nodes);
        }
        let Some(list) = list else {
            nodes.this_node(args, shape)?;
            return Ok(nodes);
        };
        let list = nodes.choose_hosts(list, args, shape)?;
        if shape.node_rank != 0 {
            return Err(Error::usage(
                "--node-rank is for torchrun-style launches on every node; with a host list nrun starts every node itself",
            ));
        }
        // What the launcher's kind cannot hold (ssh's open files per node) is refused when
        // the command starts (`session::link::check`).
        nodes.lay_out(list, shape)?;
        if nodes.size < nodes.hosts.len() {
            tracing::info!(
                "{}",
                spares_line(&nodes.hosts, nodes.size, shape, args.spares)
            );
        }
        Ok(nodes)
    }

    /// What the flags say about every node, whatever the host list: the launcher, the job's
    /// variables, ssh, timeouts, nrun's path. The nodes themselves come after.
    fn settings(
        args: &NodesArgs,
        shape: &Shape,
        env: &dyn Fn(&str) -> Option<String>,
        from_slurm: bool,
    ) -> Result<NodesPlan> {
        let NodesArgs {
            launcher,
            ssh_opts,
            ssh_concurrency,
            tree_width,
            ship,
            remote_nrun,
            export,
            ifname,
            join_timeout,
            allow_mismatch,
            no_python_probe,
            agent_timeout,
            exclude_file,
            exclude_ttl,
            ..
        } = args;
        // What the launcher cannot do (--ship under srun) is refused when the command starts
        // (`session::link::check`).
        let launcher = match launcher {
            LauncherChoice::Auto if from_slurm => "srun",
            LauncherChoice::Auto | LauncherChoice::Ssh => "ssh",
            LauncherChoice::Srun => "srun",
        };
        let vars = super::env::job_env(export, env)?;
        let join_timeout = match (shape.rdzv_join_timeout, join_timeout) {
            (Some(_), Some(_)) => {
                return Err(Error::usage(
                    "--join-timeout and --rdzv-conf join_timeout both say how long the nodes \
                     have to join; give one of them",
                ));
            }
            (Some(t), None) => t,
            (None, Some(t)) => super::positive_secs("--join-timeout", *t, false)?,
            (None, None) => JOIN_TIMEOUT,
        };
        let ssh_opts = remote::split_opts(ssh_opts.as_deref().unwrap_or(""))?;
        let remote_nrun = match remote_nrun {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .map_err(|e| Error::internal(format!("cannot find nrun's own executable: {e}")))?
                .display()
                .to_string(),
        };
        Ok(NodesPlan {
            hosts: Vec::new(),
            layout: Vec::new(),
            world: 0,
            group_world: 0,
            in_process: false,
            launcher,
            ssh_opts,
            ssh_concurrency: (*ssh_concurrency).max(1),
            // Width 1 would be a chain of ssh hops, one handshake after another: no tree.
            tree_width: match *tree_width {
                0 | 1 => 0,
                w => w,
            },
            ship: *ship,
            env: vars,
            ifname: ifname.clone(),
            join_timeout,
            allow_mismatch: *allow_mismatch,
            // A --no-python job has no torch to report.
            python_probe: !no_python_probe && shape.python,
            remote_nrun,
            hostfile: None,
            peers: 0,
            // Every node, unless elastic (set below with the nodes).
            min_nodes: shape.nnodes,
            last_call: shape.last_call,
            agent_timeout: super::positive_secs("--agent-timeout", *agent_timeout, false)?,
            size: shape.nnodes,
            avoided: Vec::new(),
            exclude_file: match exclude_file {
                Some(p) => Some(super::exclude::new(p, exclude_ttl)?),
                None => None,
            },
            from_slurm,
        })
    }

    /// c10d: this host's node (a local agent, as in ssh mode) and the nodes that will join: up
    /// to --nnodes (MAX) run the job, `--spares K` more may join and wait.
    fn c10d(&mut self, shape: &Shape, spares: Option<usize>) -> Result<()> {
        let k = spares.unwrap_or(0);
        let mut list = vec![Host::new(nrun_base::net::hostname())];
        list.extend((1..shape.nnodes + k).map(|i| Host::new(format!("node{i}"))));
        self.layout = hosts::rank_layout(&list, shape.nproc)?
            .into_iter()
            .enumerate()
            .map(|(i, ranks)| NodeLayout {
                group_rank: i,
                ranks,
                devices: None,
            })
            .collect();
        self.world = shape.world_size();
        self.group_world = shape.nnodes;
        self.in_process = false;
        self.peers = shape.nnodes - 1 + k;
        self.min_nodes = shape.min_nodes;
        self.size = shape.nnodes;
        self.hosts = list;
        Ok(())
    }

    /// No host list: this node alone, or this node's share of a static launch.
    fn this_node(&mut self, args: &NodesArgs, shape: &Shape) -> Result<()> {
        if args.spares.is_some() {
            return Err(Error::usage(
                "--spares needs more nodes than the job uses: a host list (-H, --hostfile, a \
                 scheduler's allocation), or --rdzv-backend c10d where spares join by themselves",
            ));
        }
        if args.include.is_some() || args.exclude.is_some() {
            return Err(Error::usage(
                "--include/--exclude need a host list (-H, --hostfile or a scheduler's allocation)",
            ));
        }
        let r0 = shape.node_rank * shape.nproc;
        self.hosts = vec![Host::new(nrun_base::net::hostname())];
        self.layout = vec![NodeLayout {
            group_rank: shape.node_rank,
            ranks: (0..shape.nproc).map(|l| (r0 + l, l, l)).collect(),
            devices: None,
        }];
        self.world = shape.world_size();
        self.group_world = shape.nnodes;
        // The session holds this node only (the others run their own nrun).
        (self.size, self.min_nodes) = (1, 1);
        Ok(())
    }

    /// The hosts of `list` the job may use (--include/--exclude, --exclude-file), and how many
    /// of them run it (`size`: --nnodes, --spares); refuses a list too short.
    fn choose_hosts(
        &mut self,
        list: Vec<Host>,
        args: &NodesArgs,
        shape: &Shape,
    ) -> Result<Vec<Host>> {
        let mut list =
            hosts::apply_include_exclude(list, args.include.as_deref(), args.exclude.as_deref())?;
        if let Some(f) = &self.exclude_file {
            let avoid = f.read(std::time::SystemTime::now())?;
            list.retain(|h| match avoid.iter().find(|e| e.host == h.name) {
                Some(e) => {
                    self.avoided.push(e.clone());
                    false
                }
                None => true,
            });
        }
        let elastic = shape.min_nodes < shape.nnodes;
        // An explicit `--nnodes 1` is one node (the rest spares), as any other N.
        let nnodes_given = shape.nnodes_given;
        self.size = match (args.spares, nnodes_given) {
            (Some(_), true) => {
                return Err(Error::usage(format!(
                    "--spares and --nnodes both say how many nodes run the job; give one (with \
                     --nnodes {}, the hosts beyond {} are the spares)",
                    shape.nnodes_text(),
                    shape.nnodes
                )));
            }
            (Some(k), false) if k >= list.len() => {
                return Err(Error::usage(format!(
                    "--spares {k} leaves no node to run the job: the host list has {}",
                    hosts_text(&list)
                )));
            }
            (Some(k), false) => list.len() - k,
            // Elastic: up to MAX nodes run, at least MIN to start.
            (None, true) if elastic => list.len().min(shape.nnodes),
            (None, true) => shape.nnodes,
            (None, false) => list.len(),
        };
        let short = shape.min_nodes.max(if elastic { 0 } else { self.size });
        if list.len() < short {
            if !self.avoided.is_empty() {
                return Err(Error::no_nodes(format!(
                    "--nnodes {} but only {} remain after --exclude-file left out {}; give \
                         more hosts, or remove repaired nodes from the file",
                    shape.nnodes_text(),
                    hosts_text(&list),
                    self.avoided
                        .iter()
                        .map(|e| format!("{} ({})", e.host, e.why))
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            hosts::take_nnodes(list.clone(), short)?;
        }
        Ok(list)
    }

    /// The ranks of each host of `list`, the GPUs `--include host:SLOTS` picked, and the world
    /// as the job starts.
    fn lay_out(&mut self, list: Vec<Host>, shape: &Shape) -> Result<()> {
        let layout = hosts::rank_layout(&list, shape.nproc)?;
        let pinned = self.env.iter().any(|(k, _)| k == "CUDA_VISIBLE_DEVICES");
        self.layout = Vec::with_capacity(list.len());
        for (i, (h, ranks)) in list.iter().zip(layout).enumerate() {
            // DeepSpeed's meaning of `--include host:0,2`: those GPUs, as local ranks 0..k.
            let devices = match &h.only_slots {
                Some(_) if pinned => {
                    return Err(Error::usage(format!(
                        "--include/--exclude pick GPUs on {} but CUDA_VISIBLE_DEVICES is also \
                         exported (-x or .nrun_env); give only one of them",
                        h.name
                    )));
                }
                Some(_) => Some(
                    ranks
                        .iter()
                        .map(|r| r.2.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                ),
                None => None,
            };
            self.layout.push(NodeLayout {
                group_rank: i,
                ranks,
                devices,
            });
        }
        // The world as the job starts: the first `size` nodes (spares renumber it when they
        // come in).
        self.world = self.layout[..self.size].iter().map(|l| l.ranks.len()).sum();
        self.group_world = self.size;
        let elastic = shape.min_nodes < shape.nnodes;
        self.min_nodes = match elastic {
            true => shape.min_nodes,
            false => self.size,
        };
        self.hosts = list;
        Ok(())
    }
}

/// A hostfile's origin and text.
type Hostfile = (String, String);

/// Where the hosts of a run come from, as [`host_list`] decides.
struct HostList {
    /// None: no list (this node alone, or a static launch).
    list: Option<Vec<Host>>,
    /// The --hostfile's origin and text.
    hostfile: Option<Hostfile>,
    /// The hosts are a Slurm allocation's.
    from_slurm: bool,
    /// The scheduler's variable they came from, said as the run starts.
    said: Option<String>,
}

/// The host list, from one place in a fixed order: -H or --hostfile; else, unless a static
/// launch, the node list of the batch scheduler nrun runs under ([`scheduler_nodes`]: Slurm,
/// PBS/Torque, LSF, SGE/UGE) when it names several nodes. None: no list.
fn host_list(
    args: &NodesArgs,
    shape: &Shape,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<HostList> {
    let mut out = HostList {
        list: None,
        hostfile: None,
        from_slurm: false,
        said: None,
    };
    match (&args.hosts, &args.hostfile) {
        (Some(_), Some(_)) => {
            return Err(Error::usage(
                "-H/--hosts and --hostfile exclude each other; give one of them",
            ));
        }
        (Some(h), None) => out.list = Some(hosts::parse_hosts_flag(h)?),
        (None, Some(f)) => {
            let origin = f.display().to_string();
            let text = read_hostfile(f, &format!("--hostfile {origin}"), "")?;
            out.list = Some(hosts::parse_hostfile(&text, &origin)?);
            out.hostfile = Some((origin, text));
        }
        (None, None) => {}
    }
    if out.list.is_some() {
        return Ok(out);
    }
    // Static torchrun-style launches name their nodes by rank, not by a host list (inside
    // an allocation, a c10d or a ranked launch is one).
    let static_launch =
        shape.ranked || (shape.nnodes > 1 && (shape.c10d || !in_allocation(args, env)));
    if static_launch {
        return Ok(out);
    }
    match scheduler_nodes(env)? {
        // One node: this one, run in-process as without a scheduler.
        Some(a) if a.hosts.len() > 1 => {
            out.said = Some(a.said() + &unused_slots(&a.hosts, shape));
            out.from_slurm = a.slurm;
            // A scheduler's slots are said, not a cap on --nproc-per-node: they count CPU
            // slots as often as GPUs (PBS Pro writes one line per chunk unless mpiprocs is
            // asked), and torchrun, whose flags nrun takes, starts --nproc-per-node whatever
            // the scheduler gave.
            let mut hosts = a.hosts;
            for h in &mut hosts {
                h.slots = None;
            }
            out.list = Some(hosts);
        }
        Some(_) => {}
        None => flux_note(env),
    }
    Ok(out)
}

/// Where `--nproc-per-node` was not given and the scheduler gives more slots than the one
/// worker per node torchrun starts, the end of the first line says so and how to use them
/// (slots do not become --nproc: they count CPUs as often as GPUs).
fn unused_slots(hosts: &[Host], shape: &Shape) -> String {
    let most = hosts.iter().filter_map(|h| h.slots).max().unwrap_or(1);
    if shape.nproc_given || most <= shape.nproc {
        return String::new();
    }
    format!(
        "; {} worker per node, torchrun's default, as --nproc-per-node is not given (give \
         --nproc-per-node {most}, or gpu for one per GPU)",
        shape.nproc
    )
}

/// The line said when a host list is longer than the job: which hosts wait as spares.
fn spares_line(hosts: &[Host], size: usize, shape: &Shape, spares: Option<usize>) -> String {
    let why = match spares {
        Some(k) => format!("--spares {k}"),
        None => format!("--nnodes {}", shape.nnodes_text()),
    };
    let rest: Vec<&str> = hosts[size..].iter().map(|h| h.name.as_str()).collect();
    format!(
        "the job runs on {size} of {} hosts ({why}); the others are spares, which join, are \
         checked and take a left-out node's place: {}",
        hosts.len(),
        nrun_base::few(&rest, 8)
    )
}

/// A batch scheduler's node list, read when nrun was given no hosts.
struct Allocation {
    /// The variable the nodes came from ("PBS_NODEFILE").
    var: &'static str,
    hosts: Vec<Host>,
    /// Slurm's: its agents may start with srun.
    slurm: bool,
}

impl Allocation {
    /// "nodes from PBS_NODEFILE: 4 hosts, 8 slots each (n1, n2, n3, n4)".
    fn said(&self) -> String {
        let slots: Vec<usize> = self.hosts.iter().filter_map(|h| h.slots).collect();
        let slots = match slots.first() {
            None => String::new(),
            Some(&n) if slots.iter().all(|&s| s == n) => {
                format!(", {n} slot{} each", if n == 1 { "" } else { "s" })
            }
            Some(_) => format!(", {} slots in all", slots.iter().sum::<usize>()),
        };
        let names: Vec<&str> = self.hosts.iter().map(|h| h.name.as_str()).collect();
        format!(
            "nodes from {}: {} hosts{slots} ({})",
            self.var,
            self.hosts.len(),
            nrun_base::few(&names, 8)
        )
    }
}

/// The node list of the batch scheduler nrun runs under, looked for in a fixed order: Slurm
/// (started with srun, or over ssh with `--launcher ssh`), PBS/Torque, LSF, SGE/UGE; the first whose variable is set decides.
/// None: no scheduler's variable. Slots come from the scheduler where it says them.
fn scheduler_nodes(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Allocation>> {
    let set = |k: &'static str| env(k).filter(|v| !v.trim().is_empty()).map(|v| (k, v));
    let found = |var, hosts, slurm| Ok(Some(Allocation { var, hosts, slurm }));
    // Under `--launcher ssh` too: the allocation's nodes, reached over ssh.
    if let Some((var, nl)) = set("SLURM_JOB_NODELIST").or_else(|| set("SLURM_NODELIST")) {
        let names = hosts::expand_slurm_hostlist(&nl)?;
        return found(var, names.into_iter().map(Host::new).collect(), true);
    }
    // A file a scheduler names: its path in messages, with the variable.
    let file = |var: &'static str, path: String, parse: fn(&str, &str) -> Result<Vec<Host>>| {
        let label = format!("${var} ({path})");
        let hint = format!("; check that nrun runs inside the job, or unset {var} and give -H");
        let text = read_hostfile(std::path::Path::new(&path), &label, &hint)?;
        found(var, parse(&text, &label)?, false)
    };
    if let Some((var, path)) = set("PBS_NODEFILE") {
        return file(var, path, hosts::parse_slot_lines);
    }
    if let Some((var, path)) = set("LSB_DJOB_HOSTFILE") {
        return file(var, path, hosts::parse_slot_lines);
    }
    if let Some((var, v)) = set("LSB_MCPU_HOSTS") {
        return found(var, hosts::parse_lsf_mcpu_hosts(&v)?, false);
    }
    if let Some((var, v)) = set("LSB_HOSTS") {
        return found(var, hosts::parse_lsb_hosts(&v)?, false);
    }
    if let Some((var, path)) = set("PE_HOSTFILE") {
        return file(var, path, hosts::parse_pe_hostfile);
    }
    Ok(None)
}

/// Flux gives a job no node list in its environment: inside a Flux job of several nodes with no
/// hosts given, say how to give them rather than run on this node alone unannounced.
fn flux_note(env: &dyn Fn(&str) -> Option<String>) {
    let nodes = env("FLUX_JOB_NNODES").and_then(|n| n.trim().parse::<usize>().ok());
    if let Some(n) = nodes.filter(|&n| n > 1) {
        tracing::warn!(
            "inside a Flux job of {n} nodes, but nrun reads no Flux node list: this run uses this \
             node only; give the nodes with -H \"$(flux hostlist local)\""
        );
    }
}

/// Inside a scheduler's allocation of several nodes ([`scheduler_nodes`]) and not in a Slurm
/// step of several (srun on every node), with no host list: the allocation is the host list. A
/// scheduler's list that cannot be read counts, so that [`host_list`] names what is wrong.
pub(crate) fn in_allocation(args: &NodesArgs, env: &dyn Fn(&str) -> Option<String>) -> bool {
    let in_step = env("SLURM_STEP_NUM_NODES")
        .and_then(|n| n.parse::<usize>().ok())
        .is_some_and(|n| n > 1);
    args.hosts.is_none()
        && args.hostfile.is_none()
        && !in_step
        && match scheduler_nodes(env) {
            Ok(a) => a.is_some_and(|a| a.hosts.len() > 1),
            Err(_) => true,
        }
}

/// "2 hosts: a, b" for messages.
fn hosts_text(list: &[Host]) -> String {
    match list.len() {
        0 => "no hosts".to_string(),
        1 => format!("1 host: {}", list[0].name),
        n => format!(
            "{n} hosts: {}",
            list.iter()
                .map(|h| h.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Largest hostfile read: 16 MiB is hundreds of thousands of lines, more than [`hosts::MAX_HOSTS`]
/// needs, and bounds what a wrong path (a log, an image) costs.
pub(crate) const MAX_HOSTFILE_BYTES: u64 = 16 << 20;

/// A hostfile's text: a regular file (not a device such as /dev/zero or /dev/urandom, not a
/// FIFO, socket or directory, which could block or never end) of at most
/// [`MAX_HOSTFILE_BYTES`], in UTF-8 ([`nrun_base::files::read_text`]).
/// `label` names the file in messages ("--hostfile hosts"); `extra` ends a message.
fn read_hostfile(path: &std::path::Path, label: &str, extra: &str) -> Result<String> {
    use nrun_base::files::ReadError;
    nrun_base::files::read_text(path, MAX_HOSTFILE_BYTES, nrun_base::files::Writer::Anyone).map_err(
        |e| {
            let hint = match &e {
                ReadError::NotRegular(_) => {
                    "; give a regular file of host lines (`host slots=N`, `host:N` or `host`)"
                        .into()
                }
                ReadError::TooBig(_) => {
                    format!(
                        "; a hostfile lists at most {} hosts, one per line",
                        hosts::MAX_HOSTS
                    )
                }
                ReadError::NotOwn(_) => "; write one host per line".into(),
                ReadError::Missing => String::new(),
                ReadError::Io(_) => String::new(),
            };
            let e = match e {
                ReadError::Missing => "No such file or directory".to_string(),
                e => e.to_string(),
            };
            Error::usage(format!("{label}: {e}{hint}{extra}"))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_says_the_variable_hosts_and_slots() {
        let said = |var, hosts: Vec<Host>| {
            Allocation {
                var,
                hosts,
                slurm: false,
            }
            .said()
        };
        let slots = |n: &str, s| Host {
            slots: Some(s),
            ..Host::new(n)
        };
        assert_eq!(
            said("PBS_NODEFILE", vec![slots("a", 8), slots("b", 8)]),
            "nodes from PBS_NODEFILE: 2 hosts, 8 slots each (a, b)"
        );
        assert_eq!(
            said("PE_HOSTFILE", vec![slots("a", 1), slots("b", 1)]),
            "nodes from PE_HOSTFILE: 2 hosts, 1 slot each (a, b)"
        );
        assert_eq!(
            said("LSB_MCPU_HOSTS", vec![slots("a", 4), slots("b", 2)]),
            "nodes from LSB_MCPU_HOSTS: 2 hosts, 6 slots in all (a, b)"
        );
        let many: Vec<Host> = (1..=10).map(|i| Host::new(format!("n{i}"))).collect();
        assert_eq!(
            said("SLURM_JOB_NODELIST", many),
            "nodes from SLURM_JOB_NODELIST: 10 hosts (n1, n2, n3, n4, n5, n6, n7 and 3 more)"
        );
    }

    /// --nproc-per-node not given under a scheduler with slots: 1 worker, said with the way
    /// to use the slots; given, nothing more is said.
    #[test]
    fn unused_slots_are_said_when_nproc_is_not_given() {
        let slots = |n: &str, s| Host {
            slots: Some(s),
            ..Host::new(n)
        };
        let hosts = [slots("a", 8), slots("b", 8)];
        let mut shape = Shape::per_host(1, false);
        shape.nproc_given = false;
        let said = unused_slots(&hosts, &shape);
        assert!(
            said.contains("1 worker per node, torchrun's default")
                && said.contains("--nproc-per-node 8, or gpu"),
            "{said}"
        );
        shape.nproc_given = true;
        assert_eq!(unused_slots(&hosts, &shape), "");
        shape.nproc_given = false;
        assert_eq!(unused_slots(&[slots("a", 1), slots("b", 1)], &shape), "");
        assert_eq!(unused_slots(&[Host::new("a")], &shape), "");
    }

    #[test]
    fn the_spares_are_said() {
        let hosts: Vec<Host> = ["a", "b", "c"].into_iter().map(Host::new).collect();
        let mut shape = Shape::per_host(1, false);
        shape.nnodes_given = true;
        assert_eq!(
            spares_line(&hosts, 1, &shape, None),
            "the job runs on 1 of 3 hosts (--nnodes 1); the others are spares, which join, are \
             checked and take a left-out node's place: b, c"
        );
        assert!(spares_line(&hosts, 2, &shape, Some(1)).contains("(--spares 1)"));
    }

    #[test]
    fn hostfile_reads_only_bounded_regular_files() {
        let msg = |p: &str| {
            read_hostfile(std::path::Path::new(p), p, "")
                .unwrap_err()
                .message
        };
        assert!(
            msg("/dev/zero").contains("is a device"),
            "{}",
            msg("/dev/zero")
        );
        assert!(msg("/dev/urandom").contains("is a device"));
        assert!(msg("/").contains("is a directory"));
        assert!(msg("/nonexistent/nrun-hosts").contains("No such file"));
        let dir = std::env::temp_dir().join(format!("nrun-hostfile-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a plain syscall on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_hostfile(&fifo, "fifo", "").unwrap_err();
        assert!(e.message.contains("is a FIFO"), "{}", e.message);
        let big = dir.join("big");
        std::fs::write(&big, vec![b'a'; MAX_HOSTFILE_BYTES as usize + 1]).unwrap();
        let e = read_hostfile(&big, "big", "").unwrap_err();
        assert!(e.message.contains("larger than 16 MiB"), "{}", e.message);
        let bin = dir.join("bin");
        std::fs::write(&bin, b"node1\n\xff\xfe\n").unwrap();
        let e = read_hostfile(&bin, "bin", "").unwrap_err();
        assert!(
            e.message
                .contains("not UTF-8 text (invalid byte at offset 6)"),
            "{}",
            e.message
        );
        let ok = dir.join("ok");
        std::fs::write(&ok, "node1 slots=2\n").unwrap();
        assert_eq!(read_hostfile(&ok, "ok", "").unwrap(), "node1 slots=2\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
