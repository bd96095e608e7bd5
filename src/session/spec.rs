//! The one builder of workers' specs, for the job, its preflight and bisect's groups, on one
//! node or many: torchrun's environment at each worker's place, the run's variables, the
//! node's interface and GPUs, output prefixes, console filters, log and error files.

use std::path::{Path, PathBuf};

use super::Session;
use crate::plan::{Place, WorkerSlot, WorkersPlan};
use crate::protocol::{Step, WorkerSpec};
use nrun_node::output::{Color, Stream};

/// One node of a group that runs together, with its ranks in that group.
#[derive(Clone, Debug)]
pub(crate) struct Member {
    pub node: usize,
    pub group_rank: usize,
    /// (rank in the group, local rank) of each of its workers.
    pub ranks: Vec<(usize, usize)>,
}

/// Nodes that rendezvous together: the whole job, or one of bisect's groups.
#[derive(Clone, Debug)]
pub(crate) struct Group {
    pub members: Vec<Member>,
    pub world: usize,
    /// GROUP_WORLD_SIZE (a static launch's node counts the nodes it does not see).
    pub group_world: usize,
}

impl Group {
    /// Every node of the session, ranks as laid out (c10d nodes with their own worker counts:
    /// numbered in node order, as torchrun's).
    pub(crate) fn all(s: &Session) -> Group {
        if (0..s.nodes.len()).any(|i| own_work(s, i).is_some()) {
            let every: Vec<usize> = (0..s.nodes.len()).collect();
            return Group::of(s, &every);
        }
        Group {
            members: s
                .plan
                .layout
                .iter()
                .enumerate()
                .map(|(i, l)| Member {
                    node: i,
                    group_rank: l.group_rank,
                    ranks: l.ranks.iter().map(|&(r, local, _)| (r, local)).collect(),
                })
                .collect(),
            world: s.plan.world,
            group_world: s.plan.group_world,
        }
    }

    /// `nodes` as a group of their own, ranks numbered from 0 in node order.
    pub(crate) fn of(s: &Session, nodes: &[usize]) -> Group {
        let mut next = 0;
        let members: Vec<Member> = nodes
            .iter()
            .enumerate()
            .map(|(g, &i)| {
                let locals: Vec<usize> = match own_work(s, i) {
                    Some(o) => (0..o.nproc).collect(),
                    None => s.plan.layout[i]
                        .ranks
                        .iter()
                        .map(|&(_, local, _)| local)
                        .collect(),
                };
                let ranks = locals
                    .into_iter()
                    .map(|local| {
                        next += 1;
                        (next - 1, local)
                    })
                    .collect();
                Member {
                    node: i,
                    group_rank: g,
                    ranks,
                }
            })
            .collect();
        Group {
            world: next,
            group_world: members.len(),
            members,
        }
    }

    /// Each member's host, per rank of the group (for naming ranks in reports).
    pub(crate) fn rank_hosts(&self, s: &Session) -> Vec<(usize, String)> {
        self.members
            .iter()
            .flat_map(|m| m.ranks.iter().map(move |&(r, _)| (r, m.node)))
            .map(|(r, i)| (r, s.nodes[i].label.clone()))
            .collect()
    }
}

/// Node `i`'s own worker count and command line, where its own nrun joined with them (c10d).
fn own_work(s: &Session, i: usize) -> Option<&crate::facts::OwnWork> {
    s.nodes[i].joined.as_ref()?.facts.as_ref()?.own.as_ref()
}

/// What every worker of one group run shares.
pub(crate) struct Launch<'a> {
    /// The port of the store the group rendezvous on (MASTER_PORT).
    pub port: u16,
    /// Which worker group of the job this is (its log directory, attempt_<n>).
    pub attempt: u32,
    /// TORCHELASTIC_RESTART_COUNT: restarts after failures so far.
    pub restart_count: u32,
    pub program: &'a str,
    pub args: &'a [String],
    /// Whether the job's --log-dir, --redirects and --local-ranks-filter apply (the
    /// preflight's and bisect's ranks show everything and write no files).
    pub logs: bool,
    /// Keeps this group's error files apart in nrun's scratch directory.
    pub scratch: &'a str,
    /// Variables for one node's workers on top of the rest (the preflight's settings).
    pub extra: &'a dyn Fn(usize) -> Vec<(String, String)>,
    pub grace_ms: u64,
    pub deadline_ms: Option<u64>,
    /// Sample the workers' stacks (the job's attempts, when the watch is on), with this hang
    /// timeout.
    pub watch: Option<std::time::Duration>,
    /// The workers are nrun's own (preflight ranks) and get the run's secret from their agent.
    pub secret: bool,
}

impl Session {
    /// A Run step for every member of `group` (None for the session's other nodes).
    pub(crate) fn steps(
        &self,
        plan: &WorkersPlan,
        group: &Group,
        l: &Launch<'_>,
    ) -> Vec<Option<Step>> {
        let mut steps: Vec<Option<Step>> = vec![None; self.nodes.len()];
        for m in &group.members {
            steps[m.node] = Some(Step::Run {
                workers: self.specs(plan, group, m, l),
                grace_ms: l.grace_ms,
                deadline_ms: l.deadline_ms,
                watch: l.watch.is_some(),
                hang_timeout_ms: l.watch.map(|t| t.as_millis() as u64),
                succession: None,
            });
        }
        steps
    }

    /// One node's workers.
    fn specs(
        &self,
        plan: &WorkersPlan,
        group: &Group,
        m: &Member,
        l: &Launch<'_>,
    ) -> Vec<WorkerSpec> {
        let n = &self.nodes[m.node];
        let joined = n.joined.as_ref();
        // The job's workers on a node that came with its own command line run that (c10d);
        // the preflight's and bisect's ranks (`logs` off) are nrun's own everywhere.
        let own = own_work(self, m.node)
            .filter(|_| l.logs)
            .and_then(|o| o.command.split_first());
        let master_addr = joined.map_or(self.rendezvous.addr.as_str(), |j| &j.master_addr);
        let several = self.nodes.len() > 1;
        // The run's variables first: torchrun's and nrun's own win over them.
        let mut node_env = Vec::new();
        if let Some(ifname) = joined.and_then(|j| j.ifname.as_deref()) {
            node_env.extend(crate::plan::env::interface_env(&self.plan.env, ifname));
        }
        if let Some(d) = &self.plan.layout[m.node].devices {
            node_env.push(("CUDA_VISIBLE_DEVICES".into(), d.clone()));
        }
        node_env.extend((l.extra)(m.node));
        let mut specs = Vec::with_capacity(m.ranks.len());
        for &(rank, local_rank) in &m.ranks {
            let host = several.then_some(n.label.as_str());
            let log_dir = plan
                .log
                .dir
                .as_ref()
                .filter(|_| l.logs)
                .map(|d| plan.worker_dir(d, l.attempt, host, local_rank));
            let error_file: PathBuf = match &log_dir {
                Some(d) => d.join("error.json"),
                // Relative: in the scratch directory of the process that runs the worker
                // (private to it, on its host: agent::exec places it), one directory for the
                // node's workers, a rank's number apart.
                None => crate::plan::attempt_dir(Path::new(l.scratch), l.attempt)
                    .join(format!("error-{rank}.json")),
            };
            let place = Place {
                rank,
                group_rank: m.group_rank,
                local_world_size: m.ranks.len(),
                world_size: group.world,
                group_world_size: group.group_world,
            };
            let slot = WorkerSlot {
                local_rank,
                restart_count: l.restart_count,
                master_addr,
                master_port: l.port,
                error_file: &error_file,
            };
            let mut env = worker_env(&self.plan.env, &self.run_id, plan, &place, &slot);
            env.extend(node_env.iter().cloned());
            if l.logs && plan.virtual_local_rank {
                virtual_local_rank(&mut env, local_rank);
            }
            let shown = !l.logs
                || plan
                    .log
                    .console_ranks
                    .as_ref()
                    .is_none_or(|s| s.contains(&local_rank));
            // Redirected streams leave the console unless teed (torchrun: tee implies the
            // file, and the console too).
            let (red, tee) = match l.logs {
                true => (
                    plan.log.redirects.for_rank(local_rank),
                    plan.log.tee.for_rank(local_rank),
                ),
                false => Default::default(),
            };
            let at = Rank {
                rank,
                local_rank,
                world: group.world,
            };
            let prefix = prefix_of(plan, l.logs, &n.label, several, at);
            let console = [
                shown && (!red.stdout() || tee.stdout()),
                shown && (!red.stderr() || tee.stderr()),
            ];
            // A stream that reaches nrun's terminal alone is a terminal for the worker too
            // (torchrun's workers write to it); one that a log file takes stays a pipe, so
            // the file gets no colour codes (torchrun's redirected workers write to files).
            let tty = [Stream::Out, Stream::Err].map(|st| {
                (l.logs && console[st as usize] && log_dir.is_none())
                    .then(|| nrun_node::output::Tty::of_console(st, &prefix))
                    .flatten()
            });
            specs.push(WorkerSpec {
                rank,
                local_rank,
                program: own.map_or_else(|| l.program.to_string(), |(p, _)| p.clone()),
                args: own.map_or_else(|| l.args.to_vec(), |(_, a)| a.to_vec()),
                env,
                error_file,
                prefix,
                colour: rank,
                console,
                log_dir,
                // A remote agent's own stdout is a pipe (ssh) or srun's: the launcher's
                // terminal decides.
                color: match (plan.console.color, n.is_local()) {
                    (Color::Auto, false) if nrun_node::output::colours(Stream::Out) => {
                        Color::Always
                    }
                    (Color::Auto, false) => Color::Never,
                    (c, _) => c,
                },
                stdin: l.logs && plan.stdin_rank == Some(rank),
                numa: l.logs && plan.numa_binding,
                secret: l.secret,
                tty,
                progress: plan.progress.as_ref().map(|p| p.regex.clone()),
            });
        }
        specs
    }
}

/// A worker's environment before its node's: the run's variables (`run_env`), then torchrun's
/// and nrun's own for its place and slot in run `run_id`.
fn worker_env(
    run_env: &[(String, String)],
    run_id: &str,
    plan: &WorkersPlan,
    place: &Place,
    slot: &WorkerSlot<'_>,
) -> Vec<(String, String)> {
    // The shared secret never reaches a worker, even if a user forwards it (-x, .nrun_env);
    // what workers inherit goes without it too (node::Start::spawn).
    let mut env: Vec<(String, String)> = run_env
        .iter()
        .filter(|(k, _)| k != nrun_store::auth::SHARED_SECRET_VAR)
        .cloned()
        .collect();
    env.extend(plan.worker_env_at(run_id, place, slot));
    env
}

/// A worker's ranks, for its prefix.
#[derive(Clone, Copy)]
struct Rank {
    rank: usize,
    local_rank: usize,
    /// How many ranks the group has.
    world: usize,
}

/// What starts each of a worker's lines: the user's template (a job's workers, `logs`), else
/// its host (`several` nodes) and rank, or nothing for a lone worker.
fn prefix_of(plan: &WorkersPlan, logs: bool, host: &str, several: bool, at: Rank) -> String {
    let Rank {
        rank,
        local_rank,
        world,
    } = at;
    let width = world.saturating_sub(1).to_string().len();
    match (&plan.console.prefix_template, several, world > 1) {
        (Some(t), _, _) if logs => t
            .replace("${rank}", &rank.to_string())
            .replace("${local_rank}", &local_rank.to_string())
            .replace("${role_name}", &plan.role)
            .replace("${host}", host),
        (_, true, _) => format!("[{host}:rank{rank:>width$}]: "),
        (_, false, true) => format!("[rank{rank:>width$}]: "),
        (_, false, false) => String::new(),
    }
}

/// `--virtual-local-rank`: LOCAL_RANK 0, and CUDA_VISIBLE_DEVICES narrowed to the GPU the
/// worker would have used (its local rank's entry of the list it would have seen).
fn virtual_local_rank(env: &mut Vec<(String, String)>, local_rank: usize) {
    let gpu = crate::agent::exec::worker_gpu(env, local_rank);
    env.push(("LOCAL_RANK".into(), "0".into()));
    env.push(("CUDA_VISIBLE_DEVICES".into(), gpu));
}
