//! nrun with a real Slurm: slurmctld in the root namespace, one slurmd per namespace host
//! (scripts/slurm-cluster.sh). Inside an allocation (salloc, sbatch) nrun starts every node's
//! agent with one srun step; started by srun on every node, each nrun takes its node index from
//! Slurm. Skipped (visibly) without root or where Slurm cannot be installed.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::*;

use common::slurm::Slurm;

fn nrun() -> String {
    nrun_bin().display().to_string()
}

fn run(mut c: Command, timeout: Duration) -> Output {
    let child = c.spawn().unwrap();
    wait_with_timeout(child, timeout).0
}

#[test]
fn inside_an_allocation_one_srun_step_starts_every_node() {
    let Some(py) = need_torch() else {
        return;
    };
    let Some(sl) = Slurm::up("sa1", 3) else {
        return;
    };
    let s = Scene::new();
    let script = py_script("gloo_allreduce.py");
    let mut c = sl.cmd(&s, "salloc");
    c.args(["-N3", &nrun(), "--nproc", "2", "--no-python-probe"])
        .args(["--python", py.to_str().unwrap(), &script]);
    let out = run(c, Duration::from_secs(120));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for r in 0..6 {
        assert_eq!(
            stdout
                .matches(&format!("rank {r}/6: all_reduce ok (21)"))
                .count(),
            1,
            "{stdout}"
        );
    }
    // Each node's workers on its own interface and host.
    for i in 1..=3 {
        assert!(
            stdout.contains(&format!("[{}-h{i}:rank", sl.name)),
            "{stdout}"
        );
    }
    assert!(stderr.contains("3/3 nodes joined"), "{stderr}");
    // The network preflight across the allocation.
    let mut c = sl.cmd(&s, "salloc");
    c.args(["-N3", &nrun(), "--nproc", "2", "--no-python-probe"])
        .args([
            "--preflight-only",
            "--preflight",
            "net",
            "--preflight-sizes",
            "8:1M:4",
        ]);
    let out = run(c, Duration::from_secs(120));
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("6 ranks on 3 node(s)"), "{stdout}");
    s.assert_no_survivors();
    sl.cluster.assert_nothing_left_but_slurmd(3);
}

#[test]
fn srun_on_every_node_and_a_failure_ends_the_job_everywhere() {
    let Some(sl) = Slurm::up("sa2", 3) else {
        return;
    };
    let s = Scene::new();
    // The sbatch form: `srun nrun ...` in the batch script, one nrun per node.
    let dir = s.dir.path();
    let batch = dir.join("job.sh");
    let out_file = dir.join("job.out");
    std::fs::write(
        &batch,
        format!(
            "#!/bin/sh\nsrun --ntasks-per-node=1 {} --nproc 2 --no-python-probe --no-python sh -c \
             'echo rank=$RANK group=$GROUP_RANK of=$WORLD_SIZE host=$(hostname); \
             [ \"$FAIL_ON\" = \"$GROUP_RANK\" ] && exit 3; exit 0'\n",
            nrun()
        ),
    )
    .unwrap();
    let mut c = sl.cmd(&s, "sbatch");
    c.args(["-N3", "--wait", "-o"])
        .arg(&out_file)
        .arg(&batch)
        .env("FAIL_ON", "none");
    let out = run(c, Duration::from_secs(120));
    let log = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert_eq!(out.status.code(), Some(0), "{log}\n{}", text(&out.stderr));
    for r in 0..6 {
        assert_eq!(log.matches(&format!("rank={r} ")).count(), 1, "{log}");
    }
    // Node index from Slurm: group 1 runs on the second node.
    assert!(
        log.contains(&format!("rank=2 group=1 of=6 host={}-h2", sl.name)),
        "{log}"
    );

    // A worker failing on node 2 (group 2): every node's nrun exits with its code.
    let mut c = sl.cmd(&s, "sbatch");
    c.args(["-N3", "--wait", "-o"])
        .arg(&out_file)
        .arg(&batch)
        .env("FAIL_ON", "2");
    let out = run(c, Duration::from_secs(120));
    let log = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert_ne!(out.status.code(), Some(0), "{log}");
    assert!(
        log.contains(&format!("rank 4 on {}-h3", sl.name))
            || log.contains(&format!("rank 5 on {}-h3", sl.name)),
        "{log}"
    );
    s.assert_no_survivors();
    sl.cluster.assert_nothing_left_but_slurmd(3);
}

#[test]
fn scancel_ends_every_worker_and_agent() {
    let Some(sl) = Slurm::up("sa3", 3) else {
        return;
    };
    let s = Scene::new();
    let mut c = sl.cmd(&s, "salloc");
    c.args([
        "-N3",
        "-J",
        "nrun-scancel",
        &nrun(),
        "--nproc",
        "2",
        "--no-python-probe",
    ])
    .args([
        "-x",
        "MARK",
        "--no-python",
        "sh",
        "-c",
        "echo up >> $MARK; exec sleep 300",
    ]);
    let child = c.spawn().unwrap();
    s.wait_marks("up", 6, Duration::from_secs(60));
    let mut q = sl.cmd(&s, "squeue");
    q.args(["-h", "-o", "%i", "-n", "nrun-scancel"]);
    let id = text(&q.output().unwrap().stdout).trim().to_string();
    assert!(!id.is_empty());
    let mut k = sl.cmd(&s, "scancel");
    k.arg(&id);
    assert!(k.status().unwrap().success());
    let _ = wait_with_timeout(child, HANG);
    // Nothing of the job is left on any node (the workers' 300 s outlast the waits).
    s.assert_no_survivors();
    sl.cluster.assert_nothing_left_but_slurmd(3);
}

/// Slurm's signal before preemption (`--signal=USR1@90`, or scancel -s USR1) reaches every
/// worker (from Slurm itself, which signals every process of the step; nrun passes it on to no
/// one again), whose handler runs, and the job goes on to finish.
#[test]
fn a_slurm_signal_reaches_every_worker() {
    let Some(py) = need_torch() else {
        return;
    };
    let Some(sl) = Slurm::up("sa4", 2) else {
        return;
    };
    let s = Scene::new();
    let script = py_script("usr1_handler.py");
    let mut c = sl.cmd(&s, "srun");
    c.args([
        "-N2",
        "--ntasks-per-node=1",
        "-J",
        "nrun-usr1",
        &nrun(),
        "--nproc",
        "2",
    ])
    .args([
        "--no-python-probe",
        "--watch",
        "off",
        "--python",
        py.to_str().unwrap(),
        &script,
    ]);
    let child = c.spawn().unwrap();
    s.wait_marks("ready", 4, Duration::from_secs(60));
    let mut q = sl.cmd(&s, "squeue");
    q.args(["-h", "-o", "%i", "-n", "nrun-usr1"]);
    let id = text(&q.output().unwrap().stdout).trim().to_string();
    let mut k = sl.cmd(&s, "scancel");
    k.args(["-s", "USR1", &id]);
    assert!(k.status().unwrap().success());
    let (out, _) = wait_with_timeout(child, Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    for r in 0..4 {
        assert!(
            stdout.contains(&format!("rank {r} handled SIGUSR1: True")),
            "{stdout}"
        );
    }
    s.assert_no_survivors();
    sl.cluster.assert_nothing_left_but_slurmd(2);
}

/// The nrun that srun started as the task of node `node` in scene `s` (its parent is the step's
/// slurmstepd; nrun's own helpers are its children).
fn task_nrun(s: &Scene, node: usize) -> Option<String> {
    let (tag, id) = (
        format!("NRUN_TEST_TAG={}", s.tag),
        format!("SLURM_NODEID={node}"),
    );
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let env = std::fs::read(e.path().join("environ")).ok()?;
        let has = |v: &str| env.split(|b| *b == 0).any(|x| x == v.as_bytes());
        let parent = std::fs::read_to_string(format!("/proc/{}/comm", parent_of(pid)?)).ok()?;
        (has(&tag) && has(&id) && parent.trim_end() == "slurmstepd").then(|| pid.to_string())
    })
}

/// Slurm signals every process of the step, the workers included: nrun passes such a signal
/// on to no one (a copy killed a rank that handled the first). A signal to nrun alone still
/// reaches every worker on every node, once.
#[test]
fn a_slurm_signal_and_one_to_nrun_alone_each_reach_every_worker_once() {
    let Some(py) = need_torch() else {
        return;
    };
    let Some(sl) = Slurm::up("sa9", 2) else {
        return;
    };
    let s = Scene::new();
    let script = py_script("usr_count.py");
    let mut c = sl.cmd(&s, "srun");
    c.args(["-N2", "--ntasks-per-node=1", "-J", "nrun-count", &nrun()])
        .args(["--nproc", "2", "--no-python-probe", "--watch", "off"])
        .args(["--python", py.to_str().unwrap(), &script]);
    let child = c.spawn().unwrap();
    s.wait_marks("ready", 4, Duration::from_secs(60));
    let mut q = sl.cmd(&s, "squeue");
    q.args(["-h", "-o", "%i", "-n", "nrun-count"]);
    let id = text(&q.output().unwrap().stdout).trim().to_string();
    let mut k = sl.cmd(&s, "scancel");
    k.args(["-s", "USR1", &id]);
    assert!(k.status().unwrap().success());
    s.wait_marks("got SIGUSR1", 4, Duration::from_secs(60));
    // The launching node's nrun alone: it passes the signal on to every node.
    let first = task_nrun(&s, 0).expect("node 0's nrun");
    signal_pid(&first, "USR2");
    s.wait_marks("got SIGUSR2", 4, Duration::from_secs(60));
    // Ends the count: after any copy nrun sent before it (standard signals in number order).
    signal_pid(&first, "TERM");
    let (out, _) = wait_with_timeout(child, Duration::from_secs(60));
    let stdout = text(&out.stdout);
    for r in 0..4 {
        assert!(
            stdout.contains(&format!("rank {r}: SIGUSR1 x1, SIGUSR2 x1")),
            "{stdout}\n{}",
            text(&out.stderr)
        );
    }
    s.assert_no_survivors();
    sl.cluster.assert_nothing_left_but_slurmd(2);
}

#[test]
fn inside_an_allocation_of_four_a_bad_node_is_left_out_for_a_job_of_three() {
    if !need_tool("iptables", "iptables") {
        return;
    }
    let Some(sl) = Slurm::up("sa5", 4) else {
        return;
    };
    // sa5-h2 takes new connections from the launch host (x.x.x.1: slurmctld, srun, the
    // store's side) but not from the other nodes: only the ring between nodes can tell.
    sl.cluster.exec(
        2,
        "net=$(ip -4 -o addr show eth0 | awk '{print $4}' | cut -d. -f1-3) && iptables -A INPUT \
         -p tcp -m state --state NEW -m iprange --src-range $net.2-$net.254 -j DROP",
    );
    let s = Scene::new();
    let mut c = sl.cmd(&s, "salloc");
    c.args([
        "-N4",
        &nrun(),
        "--nnodes",
        "3",
        "--nproc",
        "1",
        "--no-python-probe",
    ])
    .args([
        "--no-python",
        "sh",
        "-c",
        "echo host=$(hostname) rank=$RANK world=$WORLD_SIZE",
    ]);
    let out = run(c, Duration::from_secs(120));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("rank={r} world=3")),
            "{stdout}\n{stderr}"
        );
    }
    assert!(
        !stdout.contains(&format!("host={}-h2 ", sl.name)),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!("leaving out {}-h2 (check)", sl.name)),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "for the next sbatch of this job: --exclude={}-h2",
            sl.name
        )),
        "{stderr}"
    );
    s.assert_no_survivors();
    sl.cluster.assert_nothing_left_but_slurmd(4);
}

#[test]
fn inside_an_allocation_a_node_lost_mid_run_is_replaced_by_the_spare() {
    let Some(sl) = Slurm::up("sa6", 4) else {
        return;
    };
    let s = Scene::new();
    let work = "echo \"attempt=$TORCHELASTIC_RESTART_COUNT rank=$RANK world=$WORLD_SIZE host=$(ip netns identify)\"; \
                echo started >> $MARK; [ $TORCHELASTIC_RESTART_COUNT = 0 ] && exec sleep 60; exit 0";
    let mut c = sl.cmd(&s, "salloc");
    c.args([
        "-N4",
        &nrun(),
        "--nnodes",
        "3",
        "--nproc",
        "1",
        "--no-python-probe",
    ])
    .args(["--max-restarts", "1", "--no-python", "sh", "-c", work]);
    let child = c.spawn().unwrap();
    s.wait_marks("started", 3, Duration::from_secs(60));
    let killed = sl.cluster.kill_agents(2);
    assert!(killed);
    let (out, _) = wait_with_timeout(child, Duration::from_secs(90));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let second: Vec<&str> = stdout.lines().filter(|l| l.contains("attempt=1")).collect();
    assert_eq!(second.len(), 3, "{stdout}\n{stderr}");
    assert!(second.iter().all(|l| l.contains("world=3")), "{stdout}");
    assert!(
        !second
            .iter()
            .any(|l| l.contains(&format!("host={}-h2", sl.name))),
        "{stdout}"
    );
    assert!(
        second
            .iter()
            .any(|l| l.contains(&format!("host={}-h4", sl.name))),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!("--exclude={}-h2", sl.name)),
        "{stderr}"
    );
    s.assert_no_survivors();
    sl.cluster.assert_nothing_left_but_slurmd(4);
}

/// Exit 0 means every line arrived, through the srun step: ranks that write thousands of lines
/// right before they exit 0 have every one on the console, whole, when nrun exits. (Lines
/// longer than Slurm's own I/O messages are cut by slurmstepd: see docs/torchrun.md, "Output".)
#[test]
fn inside_an_allocation_every_line_comes_through_srun_before_exit_0() {
    const LINES: usize = 3000;
    let Some(sl) = Slurm::up("sa8", 2) else {
        return;
    };
    let s = Scene::new();
    let work = burst(LINES);
    let mut c = sl.cmd(&s, "salloc");
    c.args(["-N2", &nrun(), "--nproc", "2", "--no-python-probe"])
        .args(["--no-python", "sh", "-c", &work]);
    let out = wait_draining(c.spawn().unwrap(), Duration::from_secs(120));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    for r in 0..4 {
        assert_burst(&stdout, r, LINES, "console");
    }
    assert!(!stdout.contains("nrun-output-end"), "{stderr}");

    s.assert_no_survivors();
    sl.cluster.assert_nothing_left_but_slurmd(2);
}
