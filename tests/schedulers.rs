//! Batch schedulers' node lists as the real binary reads them: a file or variable written
//! exactly as PBS/Torque, SGE/UGE and LSF write theirs, naming this machine's own names
//! (localhost, 127.0.0.x), so the nodes start without ssh; and hostlist ranges in -H.

mod common;

use std::process::Output;

use common::*;

/// Every variable a scheduler sets that nrun reads: each test sets only its own.
const SCHEDULER_VARS: &[&str] = &[
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_STEP_NUM_NODES",
    "PBS_NODEFILE",
    "LSB_DJOB_HOSTFILE",
    "LSB_MCPU_HOSTS",
    "LSB_HOSTS",
    "PE_HOSTFILE",
    "FLUX_JOB_NNODES",
];

/// nrun run with `args` under a scheduler whose variables are `env` (and no other's).
fn run_under(s: &Scene, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = s.cmd(args);
    for v in SCHEDULER_VARS {
        c.env_remove(v);
    }
    c.envs(env.iter().copied());
    c.output().unwrap()
}

/// Each worker says its rank and world; the lines come back labelled with its node.
const SAY_RANK: &[&str] = &[
    "--no-python",
    "sh",
    "-c",
    "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK",
];

/// The run went through on `nodes` (label, ranks in order) and said where they came from first.
fn assert_ran(out: &Output, first_line: &str, nodes: &[(&str, &[usize])]) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(stderr.lines().next(), Some(first_line), "{stderr}");
    let world: usize = nodes.iter().map(|n| n.1.len()).sum();
    for (label, ranks) in nodes {
        for (local, rank) in ranks.iter().enumerate() {
            let line = format!("[{label}:rank{rank}]: rank={rank} world={world} local={local}");
            assert_eq!(stdout.matches(&line).count(), 1, "{line:?} in:\n{stdout}");
        }
    }
}

#[test]
fn pbs_nodefile_one_line_per_slot() {
    let s = Scene::new();
    // Torque's $PBS_NODEFILE for `qsub -l nodes=2:ppn=2`: each host once per slot.
    let file = s.dir.path().join("42.pbs-server");
    std::fs::write(&file, "localhost\nlocalhost\n127.0.0.2\n127.0.0.2\n").unwrap();
    let mut args = vec!["--nproc", "2"];
    args.extend_from_slice(SAY_RANK);
    let out = run_under(&s, &args, &[("PBS_NODEFILE", file.to_str().unwrap())]);
    assert_ran(
        &out,
        "nrun: nodes from PBS_NODEFILE: 2 hosts, 2 slots each (localhost, 127.0.0.2)",
        &[("localhost", &[0, 1]), ("127.0.0.2", &[2, 3])],
    );
    // More workers than the scheduler's slots: started as asked (the slots are said, not a
    // cap), as torchrun would.
    let mut args = vec!["--nproc", "3"];
    args.extend_from_slice(SAY_RANK);
    let out = run_under(&s, &args, &[("PBS_NODEFILE", file.to_str().unwrap())]);
    assert_ran(
        &out,
        "nrun: nodes from PBS_NODEFILE: 2 hosts, 2 slots each (localhost, 127.0.0.2)",
        &[("localhost", &[0, 1, 2]), ("127.0.0.2", &[3, 4, 5])],
    );
    s.assert_no_survivors();
}

#[test]
fn sge_pe_hostfile() {
    let s = Scene::new();
    // SGE/UGE's $PE_HOSTFILE for `qsub -pe mpi 3`: host, slots, queue, processor range.
    let file = s.dir.path().join("pe_hostfile");
    std::fs::write(
        &file,
        "localhost 2 all.q@localhost UNDEFINED\n127.0.0.3 1 all.q@127.0.0.3 UNDEFINED\n",
    )
    .unwrap();
    let out = run_under(&s, SAY_RANK, &[("PE_HOSTFILE", file.to_str().unwrap())]);
    assert_ran(
        &out,
        // --nproc-per-node not given: one worker per node, and the first line says how to use
        // the slots (issue 37).
        "nrun: nodes from PE_HOSTFILE: 2 hosts, 3 slots in all (localhost, 127.0.0.3); 1 worker \
         per node, torchrun's default, as --nproc-per-node is not given (give --nproc-per-node \
         2, or gpu for one per GPU)",
        &[("localhost", &[0]), ("127.0.0.3", &[1])],
    );
    s.assert_no_survivors();
}

#[test]
fn lsf_hostfile_then_mcpu_hosts() {
    let s = Scene::new();
    // `bsub -n 2 -R "span[ptile=1]"`: LSB_DJOB_HOSTFILE one line per slot, and the same job's
    // LSB_MCPU_HOSTS (ending in a space, as LSF writes it); the file is read first.
    let file = s.dir.path().join("1234.hostfile");
    std::fs::write(&file, "127.0.0.4\nlocalhost\n").unwrap();
    let out = run_under(
        &s,
        SAY_RANK,
        &[
            ("LSB_DJOB_HOSTFILE", file.to_str().unwrap()),
            ("LSB_MCPU_HOSTS", "127.0.0.4 1 localhost 1 "),
        ],
    );
    assert_ran(
        &out,
        "nrun: nodes from LSB_DJOB_HOSTFILE: 2 hosts, 1 slot each (127.0.0.4, localhost)",
        &[("127.0.0.4", &[0]), ("localhost", &[1])],
    );
    let out = run_under(
        &s,
        SAY_RANK,
        &[("LSB_MCPU_HOSTS", "127.0.0.4 1 localhost 1 ")],
    );
    assert_ran(
        &out,
        "nrun: nodes from LSB_MCPU_HOSTS: 2 hosts, 1 slot each (127.0.0.4, localhost)",
        &[("127.0.0.4", &[0]), ("localhost", &[1])],
    );
    s.assert_no_survivors();
}

#[test]
fn hosts_given_come_before_the_scheduler() {
    let s = Scene::new();
    let file = s.dir.path().join("nodefile");
    std::fs::write(&file, "gpu-a01\ngpu-a02\n").unwrap();
    // -H wins over $PBS_NODEFILE, and says nothing of it; its range expands.
    let out = run_under(
        &s,
        &[
            "-H",
            "localhost,127.0.0.[5-6]",
            "--no-python",
            "sh",
            "-c",
            "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK",
        ],
        &[("PBS_NODEFILE", file.to_str().unwrap())],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(!stderr.contains("PBS_NODEFILE"), "{stderr}");
    for (label, rank) in [("localhost", 0), ("127.0.0.5", 1), ("127.0.0.6", 2)] {
        let line = format!("[{label}:rank{rank}]: rank={rank} world=3 local=0");
        assert!(stdout.contains(&line), "{line:?} in:\n{stdout}");
    }
    s.assert_no_survivors();
}

#[test]
fn a_range_in_dash_h_reaches_every_host() {
    let s = Scene::new();
    // The docs' `-H gpu[1-5]` form: three hosts, each tried (here ssh can reach none).
    let out = run_under(
        &s,
        &[
            "-H",
            "gpu[1-3]",
            "--ssh-opts",
            "-o ProxyCommand=false",
            "--no-python",
            "true",
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("3 of 3 nodes could not join"), "{err}");
    for h in ["gpu1", "gpu2", "gpu3"] {
        assert!(err.contains(&format!("\n  {h}: ")), "{h} in: {err}");
    }
    assert!(!err.contains("brackets"), "{err}");
    s.assert_no_survivors();
}

#[test]
fn a_bad_scheduler_file_is_one_line_naming_it() {
    let s = Scene::new();
    let file = s.dir.path().join("pe_hostfile");
    std::fs::write(&file, "localhost 2 all.q@localhost UNDEFINED\n127.0.0.2\n").unwrap();
    let out = run_under(&s, SAY_RANK, &[("PE_HOSTFILE", file.to_str().unwrap())]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!(
            "nrun: error: $PE_HOSTFILE ({}) line 2: \"127.0.0.2\" has no slot count",
            file.display()
        )),
        "{err}"
    );
    let out = run_under(
        &s,
        SAY_RANK,
        &[("PBS_NODEFILE", "/nonexistent/nrun-test/aux/7.pbs")],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("$PBS_NODEFILE (/nonexistent/nrun-test/aux/7.pbs): No such file"),
        "{err}"
    );
    s.assert_no_survivors();
}

#[test]
fn a_flux_job_of_several_nodes_says_how_to_give_them() {
    let s = Scene::new();
    // Flux puts no node list in a job's environment, only its size.
    let out = run_under(&s, SAY_RANK, &[("FLUX_JOB_NNODES", "4")]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("rank=0 world=1"), "{stdout}");
    assert!(
        stderr.starts_with(
            "nrun: warning: inside a Flux job of 4 nodes, but nrun reads no Flux node list: this \
             run uses this node only; give the nodes with -H \"$(flux hostlist local)\""
        ),
        "{stderr}"
    );
    // A Flux job of one node is this node: nothing to say.
    let out = run_under(&s, SAY_RANK, &[("FLUX_JOB_NNODES", "1")]);
    assert_eq!(out.status.code(), Some(0));
    assert!(!text(&out.stderr).contains("Flux"), "{}", text(&out.stderr));
    s.assert_no_survivors();
}

/// `--launcher ssh` inside a Slurm allocation with no hosts given: Slurm's node list, reached
/// over ssh (before, the list was not read and the job ran on this node alone); `--standalone`
/// inside an allocation: this node alone.
#[test]
fn launcher_ssh_reads_slurms_list_and_standalone_none() {
    let s = Scene::new();
    let slurm = [("SLURM_JOB_NODELIST", "127.0.0.[2-3]")];
    let mut args = vec!["--launcher", "ssh"];
    args.extend_from_slice(SAY_RANK);
    let out = run_under(&s, &args, &slurm);
    assert_ran(
        &out,
        "nrun: nodes from SLURM_JOB_NODELIST: 2 hosts (127.0.0.2, 127.0.0.3)",
        &[("127.0.0.2", &[0]), ("127.0.0.3", &[1])],
    );
    let mut args = vec!["--standalone", "--nproc", "2"];
    args.extend_from_slice(SAY_RANK);
    let out = run_under(&s, &args, &slurm);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("nodes from"), "{stderr}");
    for rank in 0..2 {
        let line = format!("[rank{rank}]: rank={rank} world=2 local={rank}");
        assert!(stdout.lines().any(|l| l == line), "{line} not in {stdout}");
    }
    s.assert_no_survivors();
}
