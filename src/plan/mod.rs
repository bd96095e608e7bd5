//! From the command line to a [`Mode`]: what nrun was asked to do, as each command's own
//! resolved settings ([`RunSettings`], [`DoctorSettings`], [`BisectSettings`], uv's habit),
//! built from shared parts: the session's ([`SessionPlan`]: store, run id, signals), the
//! workers' ([`WorkersPlan`]: command, environment, logs, console), the nodes' [`Shape`]; and
//! on which nodes ([`nodes`]).
//! Decided once, before anything starts; no I/O besides reading the hostfile and `.nrun_env`,
//! resolving the target on the filesystem and counting GPUs, so every rule is unit-tested.
//!
//! - `mode`: the types: [`Mode`], each command's settings, the session's and nodes' parts.
//! - `run`: the job's settings from the default command's flags, step by step.
//! - `bisect`: `nrun bisect`'s settings (doctor's are made here, in [`resolve`]).
//! - `workers`: what every worker gets: command, logs, console, torchrun's environment.
//! - `rdzv`: the rendezvous: store address, c10d, a Slurm step, run id, `--rdzv-conf`.
//! - `preflight`: the preflight plan and its all-reduce sweep.
//! - `program`: the target as a program and arguments, the Python interpreter.
//! - `parse`: flag values clap cannot check alone (sizes, durations, counts, signals, ...).
//! - [`nodes`]: host lists, rank layout, how agents start, what every worker gets ([`env`]).
//! - [`env`]: forwarded variables, `.nrun_env`, `-x`, and warnings about variables.
//! - [`exclude`]: the exclude file; [`tree`]: the launch tree's shape.

pub(crate) mod env;
pub(crate) mod exclude;
#[cfg(test)]
mod fuzz;
pub(crate) mod nodes;
pub(crate) mod tree;

mod bisect;
mod mode;
mod parse;
mod preflight;
mod program;
mod rdzv;
mod run;
mod workers;

pub(crate) use mode::{
    BisectSettings, C10d, DoctorSettings, Mode, RunSettings, SessionPlan, Shape, StorePlan,
    TookOver,
};
pub(crate) use nodes::NodesPlan;
pub(crate) use preflight::PreflightPlan;
use workers::{ConsolePlan, LogPlan, StreamSpec};
pub(crate) use workers::{Place, ProgressPlan, WorkerSlot, WorkersPlan, attempt_dir};
// nodes.rs reads its durations as every flag does.
use parse::positive_secs;

use nrun_base::error::{Error, Result};
use nrun_cli::{Cli, Command, DoctorArgs};

use program::find_python;

type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Decides the [`Mode`] from the parsed command line, the environment and the filesystem.
pub(crate) fn resolve(cli: Cli, env: Env<'_>) -> Result<Mode> {
    let Cli { command, run } = cli.into_default();
    match command {
        None => {
            let run_settings = RunSettings::resolve(&run, env)?;
            let nodes = NodesPlan::resolve(&run.nodes, &run_settings.shape, env)?;
            // The nodes a job leaves out are appended at its end: a file that cannot take them
            // is said now, not after the job.
            run::check_outputs(&[(
                "--exclude-file",
                nodes.exclude_file.as_ref().map(|f| &f.path),
            )])?;
            if let Some(line) = workers::replaced_vars_line(env, &nodes.env) {
                tracing::warn!("{line}");
            }
            Ok(Mode::Run {
                run: run_settings,
                nodes,
            })
        }
        Some(Command::Doctor(args)) => {
            let DoctorArgs {
                python,
                local_addr,
                nodes,
            } = *args;
            if let Some(a) = &local_addr {
                rdzv::check_host("--local-addr", a)?;
            }
            let python = find_python(python.as_deref(), env);
            let shape = Shape::per_host(1, python.is_some());
            let nodes = NodesPlan::resolve(&nodes, &shape, env)?;
            let doctor = DoctorSettings {
                session: SessionPlan::own("doctor", "127.0.0.1", python, local_addr),
            };
            Ok(Mode::Doctor { doctor, nodes })
        }
        Some(Command::Run(_) | Command::Completions { .. } | Command::Man | Command::Report(_)) => {
            Err(Error::internal(
                "completions, the manual page and `nrun report` are done before a plan is made \
                 (and run is the default command)",
            ))
        }
        Some(Command::Bisect(args)) => {
            let (bisect, shape) = BisectSettings::resolve(&args, env)?;
            let nodes = NodesPlan::resolve(&args.nodes, &shape, env)?;
            if nodes.in_process {
                return Err(Error::usage(
                    "nrun bisect needs nodes: -H, --hostfile, or a scheduler's allocation of several \
                     nodes (Slurm, PBS, LSF, SGE)",
                ));
            }
            Ok(Mode::Bisect { bisect, nodes })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    pub(super) fn plan(args: &[&str]) -> Result<RunSettings> {
        let cli = Cli::try_parse_from(std::iter::once("nrun").chain(args.iter().copied())).unwrap();
        match resolve(cli, &|k| std::env::var(k).ok())? {
            Mode::Run { run, .. } => Ok(run),
            other => panic!("not a run: {other:?}"),
        }
    }

    /// A worker's environment on this node of a torchrun-style layout.
    pub(super) fn worker_env(p: &RunSettings, w: &WorkerSlot<'_>) -> Vec<(String, String)> {
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

    /// Every variable torchrun sets whatever the environment holds is named when it was set
    /// for nrun; the list is the worker environment's own fixed part.
    #[test]
    fn torchrun_variables_set_for_nrun_are_named_as_replaced() {
        let p = plan(&["--nproc", "2", "--no-python", "true"]).unwrap();
        let slot = WorkerSlot {
            local_rank: 1,
            restart_count: 0,
            master_addr: "127.0.0.1",
            master_port: 29500,
            error_file: std::path::Path::new("/e"),
        };
        // Those are set only where unset (torchrun's defaults) or asked for.
        let fixed: Vec<String> = worker_env(&p, &slot)
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| {
                !matches!(
                    k.as_str(),
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING"
                        | "OMP_NUM_THREADS"
                        | "TORCHELASTIC_SIGNALS_TO_HANDLE"
                )
            })
            .collect();
        assert_eq!(fixed, workers::TORCHRUN_VARS);
        let none = |_: &str| None;
        assert_eq!(workers::replaced_vars_line(&none, &[]), None);
        let env = |k: &str| matches!(k, "MASTER_PORT" | "RANK").then(|| "7".to_string());
        let job = [("WORLD_SIZE".to_string(), "3".to_string())];
        let line = workers::replaced_vars_line(&env, &job).unwrap();
        assert!(
            line.starts_with("RANK, WORLD_SIZE, MASTER_PORT set for nrun"),
            "{line}"
        );
        assert!(line.contains("--master-addr/--master-port"), "{line}");
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

    /// One place decides where the hosts come from: -H/--hostfile, else Slurm, PBS, LSF, SGE
    /// in that order; a scheduler's slots bound --nproc as a hostfile's do; only Slurm's nodes
    /// start with srun.
    #[test]
    fn schedulers_node_lists_in_a_fixed_order() {
        let dir = tempfile::tempdir().unwrap();
        let pbs = dir.path().join("aux-42.pbs");
        std::fs::write(&pbs, "p1\np1\np2\np2\n").unwrap();
        let pe = dir.path().join("pe_hostfile");
        std::fs::write(&pe, "s1 4 all.q@s1 UNDEFINED\ns2 4 all.q@s2 UNDEFINED\n").unwrap();
        let pbs = pbs.to_str().unwrap().to_string();
        let pe = pe.to_str().unwrap().to_string();
        let vars = |set: &'static [&'static str]| {
            let (pbs, pe) = (pbs.clone(), pe.clone());
            move |k: &str| -> Option<String> {
                let scheduler = ["SLURM", "PBS_", "LSB_", "PE_HOSTFILE", "FLUX_"];
                if !set.contains(&k) {
                    // The test's own environment, but for any scheduler's.
                    return std::env::var(k)
                        .ok()
                        .filter(|_| !scheduler.iter().any(|p| k.starts_with(p)));
                }
                Some(match k {
                    "SLURM_JOB_NODELIST" => "n[1-3]".into(),
                    "PBS_NODEFILE" => pbs.clone(),
                    "LSB_MCPU_HOSTS" => "l1 2 l2 2 ".into(),
                    "PE_HOSTFILE" => pe.clone(),
                    _ => return None,
                })
            }
        };
        let nodes_of = |args: &[&str], env: &dyn Fn(&str) -> Option<String>| {
            let mut v = vec!["nrun"];
            v.extend_from_slice(args);
            v.extend_from_slice(&["--no-python", "true"]);
            match resolve(Cli::try_parse_from(v).unwrap(), env) {
                Ok(Mode::Run { nodes, .. }) => Ok(nodes),
                Ok(_) => panic!("not a run"),
                Err(e) => Err(e),
            }
        };
        let names = |n: &NodesPlan| n.hosts.iter().map(|h| h.name.clone()).collect::<Vec<_>>();
        let all = vars(&[
            "SLURM_JOB_NODELIST",
            "PBS_NODEFILE",
            "LSB_MCPU_HOSTS",
            "PE_HOSTFILE",
        ]);
        // The user's hosts first, then each scheduler in turn.
        let n = nodes_of(&["-H", "gpu[1-2]"], &all).unwrap();
        assert_eq!(
            (names(&n), n.launcher),
            (vec!["gpu1".into(), "gpu2".into()], "ssh")
        );
        let n = nodes_of(&[], &all).unwrap();
        assert_eq!(
            (names(&n), n.launcher, n.from_slurm),
            (vec!["n1".into(), "n2".into(), "n3".into()], "srun", true)
        );
        let n = nodes_of(
            &[],
            &vars(&["PBS_NODEFILE", "LSB_MCPU_HOSTS", "PE_HOSTFILE"]),
        )
        .unwrap();
        assert_eq!(
            (names(&n), n.launcher, n.from_slurm),
            (vec!["p1".into(), "p2".into()], "ssh", false)
        );
        // The scheduler's slots are said in the first line, not kept as a cap.
        assert_eq!(n.hosts[0].slots, None);
        let n = nodes_of(&[], &vars(&["LSB_MCPU_HOSTS", "PE_HOSTFILE"])).unwrap();
        assert_eq!(names(&n), ["l1", "l2"]);
        let n = nodes_of(&["--nproc", "4"], &vars(&["PE_HOSTFILE"])).unwrap();
        assert_eq!(
            (names(&n), n.world, n.in_process),
            (vec!["s1".into(), "s2".into()], 8, false)
        );
        // More workers than the scheduler's slots: started as asked, as torchrun would.
        let n = nodes_of(&["--nproc", "3"], &vars(&["PBS_NODEFILE"])).unwrap();
        assert_eq!(n.world, 6);
        // --launcher ssh reaches Slurm's nodes over ssh (before this it read PBS's list
        // instead, or none); PBS's are reached over ssh.
        let n = nodes_of(
            &["--launcher", "ssh"],
            &vars(&["SLURM_JOB_NODELIST", "PBS_NODEFILE"]),
        )
        .unwrap();
        assert_eq!(
            (names(&n), n.launcher, n.from_slurm),
            (vec!["n1".into(), "n2".into(), "n3".into()], "ssh", true)
        );
        let n = nodes_of(&["--launcher", "ssh"], &vars(&["PBS_NODEFILE"])).unwrap();
        assert_eq!(
            (names(&n), n.launcher),
            (vec!["p1".into(), "p2".into()], "ssh")
        );
        // A static launch (every node's own nrun) reads no list.
        let n = nodes_of(
            &["--nnodes", "2", "--node-rank", "1", "--master-addr", "p1"],
            &vars(&["PBS_NODEFILE"]),
        )
        .unwrap();
        assert!(n.in_process);
        // A file the variable names that cannot be read: what, where and what to check.
        let gone = |k: &str| match k {
            "PBS_NODEFILE" => Some("/nonexistent/aux/7.pbs".to_string()),
            k => vars(&[])(k),
        };
        let e = nodes_of(&[], &gone).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
        assert!(
            e.message
                .starts_with("$PBS_NODEFILE (/nonexistent/aux/7.pbs): No such file"),
            "{}",
            e.message
        );
        assert!(
            e.message.contains("unset PBS_NODEFILE and give -H"),
            "{}",
            e.message
        );
        // One node of a scheduler is this one: no list, as without a scheduler.
        std::fs::write(&pbs, "p1\np1\n").unwrap();
        assert!(nodes_of(&[], &vars(&["PBS_NODEFILE"])).unwrap().in_process);
    }

    fn nodes_or_err(r: Result<Mode>) -> NodesPlan {
        match r.unwrap() {
            Mode::Run { nodes, .. } => nodes,
            _ => panic!("not a run"),
        }
    }

    /// Flags that would override each other in silence are usage errors naming both flags
    /// (issue 37): the store's place, the nodes, the count of nodes.
    #[test]
    fn conflicting_flags_are_usage_errors_naming_both() {
        let none = |k: &str| {
            let scheduler = ["SLURM", "PBS_", "LSB_", "PE_HOSTFILE", "FLUX_"];
            std::env::var(k)
                .ok()
                .filter(|_| !scheduler.iter().any(|p| k.starts_with(p)))
        };
        let resolve_with = |args: &[&str], env: &dyn Fn(&str) -> Option<String>| {
            let mut v = vec!["nrun"];
            v.extend_from_slice(args);
            v.extend_from_slice(&["--no-python", "true"]);
            resolve(Cli::try_parse_from(v).unwrap(), env)
        };
        let refused = |args: &[&str], both: [&str; 2]| {
            let e = resolve_with(args, &none).unwrap_err();
            assert_eq!(
                e.code,
                nrun_base::error::exit::USAGE,
                "{args:?}: {}",
                e.message
            );
            for flag in both {
                assert!(
                    e.message.contains(flag),
                    "{args:?}: {flag} not in {}",
                    e.message
                );
            }
            e.message
        };
        let m = refused(
            &["--standalone", "--rdzv-endpoint", "nosuch.invalid:29400"],
            ["--standalone", "--rdzv-endpoint"],
        );
        assert!(
            m.contains("drop --rdzv-endpoint for a single-node job"),
            "{m}"
        );
        refused(
            &["--standalone", "--master-addr", "10.0.0.1"],
            ["--standalone", "--master-addr"],
        );
        refused(
            &["--standalone", "--node-rank", "0"],
            ["--standalone", "--node-rank"],
        );
        refused(&["--standalone", "-H", "a,b"], ["--standalone", "-H"]);
        refused(
            &["--standalone", "--nnodes", "2"],
            ["--standalone", "--nnodes 1"],
        );
        refused(
            &[
                "--master-addr",
                "a",
                "--rdzv-endpoint",
                "b:29400",
                "--nnodes",
                "2",
            ],
            ["--master-addr a", "--rdzv-endpoint b:29400"],
        );
        refused(
            &[
                "--master-port",
                "1",
                "--rdzv-endpoint",
                "b:29400",
                "--nnodes",
                "2",
            ],
            ["--master-port 1", "--rdzv-endpoint b:29400"],
        );
        refused(
            &["-H", "a,b", "--rdzv-endpoint", "a:1"],
            ["-H", "--rdzv-endpoint"],
        );
        refused(
            &["-H", "a,b", "--master-addr", "a"],
            ["-H", "--master-addr"],
        );
        refused(
            &["-H", "a,b", "--rdzv-backend", "c10d"],
            ["-H", "--rdzv-backend c10d"],
        );
        refused(
            &["-H", "a,b,c", "--nnodes", "1", "--spares", "1"],
            ["--spares", "--nnodes"],
        );
        refused(&["-H", "a,b", "--nnodes", "3"], ["--nnodes 3", "2 hosts"]);
        refused(
            &[
                "-H",
                "a,b",
                "--join-timeout",
                "5",
                "--rdzv-conf",
                "join_timeout=3",
            ],
            ["--join-timeout", "--rdzv-conf join_timeout"],
        );
        refused(
            &["--no-preflight", "--preflight", "nccl,warn"],
            ["--no-preflight", "--preflight nccl,warn"],
        );
        resolve_with(&["--no-preflight", "--preflight", "off"], &none).unwrap();
        refused(
            &["--watch", "off", "--on-hang", "stop"],
            ["--watch off", "--on-hang stop"],
        );
        refused(
            &["--watch", "off", "--hang-timeout", "5"],
            ["--watch off", "--hang-timeout"],
        );
        resolve_with(&["--watch", "off", "--on-hang", "report"], &none).unwrap();
        let n = nodes_or_err(resolve_with(
            &["-H", "a", "--rdzv-conf", "join_timeout=3"],
            &none,
        ));
        assert_eq!(n.join_timeout, std::time::Duration::from_secs(3));
        let e = resolve(
            Cli::try_parse_from(["nrun", "--preflight-only", "--preflight", "net", "x.py"])
                .unwrap(),
            &none,
        )
        .unwrap_err();
        assert!(e.message.contains("--preflight-only") && e.message.contains("x.py"));
        // Agreeing flags are no conflict: the same host, the port given once.
        resolve_with(
            &[
                "--master-addr",
                "b",
                "--rdzv-endpoint",
                "b:29400",
                "--master-port",
                "29400",
            ],
            &none,
        )
        .unwrap();
        resolve_with(
            &["--standalone", "--rdzv-backend", "c10d", "--nproc", "2"],
            &none,
        )
        .unwrap();

        // An explicit --nnodes 1 with a host list is one node; the other hosts are spares.
        let nodes = nodes_or_err;
        let n = nodes(resolve_with(&["-H", "a,b", "--nnodes", "1"], &none));
        assert_eq!(
            (n.hosts.len(), n.size, n.world, n.group_world),
            (2, 1, 1, 1)
        );
        assert!(!n.in_process);
        // Not given: every host of the list.
        let n = nodes(resolve_with(&["-H", "a,b"], &none));
        assert_eq!((n.size, n.group_world), (2, 2));

        // --standalone inside an allocation: this node alone.
        let slurm = |k: &str| match k {
            "SLURM_JOB_NODELIST" => Some("n[1-4]".to_string()),
            k => none(k),
        };
        assert!(nodes(resolve_with(&["--standalone"], &slurm)).in_process);
        assert!(!nodes(resolve_with(&[], &slurm)).in_process);

        // srun on every node: --nnodes must say Slurm's count, which it may.
        let step = |k: &str| match k {
            "SLURM_JOB_NODELIST" | "SLURM_STEP_NODELIST" => Some("n[1-4]".to_string()),
            "SLURM_STEP_NUM_NODES" | "SLURM_STEP_NUM_TASKS" => Some("4".to_string()),
            "SLURM_STEP_ID" => Some("0".to_string()),
            "SLURM_NODEID" => Some("1".to_string()),
            "SLURM_JOB_ID" => Some("7".to_string()),
            k => none(k),
        };
        let e = resolve_with(&["--nnodes", "2"], &step).unwrap_err();
        assert!(
            e.message.contains("--nnodes 2") && e.message.contains("on 4 nodes"),
            "{}",
            e.message
        );
        let Mode::Run { run, .. } = resolve_with(&["--nnodes", "4"], &step).unwrap() else {
            panic!("not a run")
        };
        assert_eq!((run.shape.nnodes, run.session.c10d.is_some()), (4, true));
        let Mode::Run { run, .. } = resolve_with(&[], &step).unwrap() else {
            panic!("not a run")
        };
        assert_eq!(run.shape.nnodes, 4);
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
}
