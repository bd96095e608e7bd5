//! The launch tree (`--tree-width`, issue 21 item 3) on a real cluster of network-namespace
//! hosts (real sshd, real ssh from node to node, real iptables): inner agents start the next
//! level over ssh from their own node; every rank's output reaches the launch host; a child
//! the inner host cannot reach is named with ssh's own error and that host; an inner agent
//! killed mid-run is named with its subtree and the job ends, or goes on with spares; nothing
//! is left running anywhere.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// ssh clients this test's nrun runs on the launch host (they carry its tag; those an inner
/// agent runs on its node do not).
fn launch_host_ssh(s: &Scene) -> usize {
    s.survivors()
        .iter()
        .filter(|p| {
            p.split_once(": ")
                .is_some_and(|(_, cmd)| cmd.starts_with("ssh "))
        })
        .count()
}

/// Seven hosts, width 2: h1 and h2 are started from here, h1 starts h3 (which starts h5) and
/// h4, h2 starts h6 and h7. Every rank runs with its own place in the job, its output
/// prefixed, and the launch host held two ssh processes.
#[test]
fn a_job_through_a_three_level_tree_runs_and_leaves_nothing() {
    let Some(c) = Cluster::up("tr1", 7) else {
        return;
    };
    let s = Scene::new();
    let child = c.spawn_on(
        &s,
        7,
        &[
            "--tree-width",
            "2",
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            // Every rank runs until the test has counted the ssh processes (the go file).
            "echo rank=$RANK of=$WORLD_SIZE node=$GROUP_RANK host=$(hostname); echo up >> $MARK; \
             while [ ! -e $MARK.go ]; do sleep 0.05; done",
        ],
        &[("NRUN_LOG", "debug")],
    );
    s.wait_marks("up", 14, Duration::from_secs(60));
    let ssh_here = launch_host_ssh(&s);
    std::fs::write(format!("{}.go", s.mark().display()), "").unwrap();
    let (out, _) = wait_with_timeout(child, Duration::from_secs(60));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("launch tree: 2 agents started here, 2 of them start 5 more (3 levels)"),
        "{stderr}"
    );
    assert_eq!(ssh_here, 2, "ssh processes on the launch host mid-run");
    for r in 0..14 {
        let node = r / 2 + 1;
        let line = stdout
            .lines()
            .find(|l| l.contains(&format!("rank={r} ")))
            .unwrap_or_else(|| panic!("rank {r} missing: {stdout}"));
        assert!(
            // Ranks padded to the width of the largest (14 ranks: two places).
            line.starts_with(&format!("[{}:rank{r:>2}]: ", c.host(node))),
            "{line}"
        );
        assert!(
            line.contains(&format!("of=14 node={} host={}", node - 1, c.host(node))),
            "{line}"
        );
    }
    s.assert_no_survivors();
    c.assert_nothing_left(7);

    // --ship through the tree: each inner agent copies its own binary to its children.
    let out = c.run_on(
        &s,
        7,
        &[
            "--tree-width",
            "2",
            "--ship",
            "--nproc",
            "1",
            "--no-python",
            "sh",
            "-c",
            "echo rank=$RANK nrun=$(readlink /proc/$PPID/exe)",
        ],
        &[],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for r in 0..7 {
        let line = stdout
            .lines()
            .find(|l| l.contains(&format!("rank={r} ")))
            .unwrap_or_else(|| panic!("rank {r} missing: {stdout}"));
        // The worker's parent is the agent: the shipped copy, on every level.
        assert!(line.contains("/.cache/nrun/nrun-"), "{line}");
    }
    s.assert_no_survivors();
    c.assert_nothing_left(7);
}

/// h1 cannot reach h4 (its packets to h4's sshd are refused) though the launch host could: h4
/// is named with ssh's own error and the host whose ssh failed, with what to check.
#[test]
fn a_child_its_inner_host_cannot_reach_is_named_with_ssh_and_that_host() {
    let Some(c) = Cluster::up("tr2", 5) else {
        return;
    };
    if !need_tool("iptables", "iptables") {
        return;
    }
    c.exec(
        1,
        &format!(
            "iptables -A OUTPUT -d {} -p tcp --dport 22 -j REJECT --reject-with tcp-reset",
            c.addr(4)
        ),
    );
    let s = Scene::new();
    let out = c.run_on(
        &s,
        5,
        &["--tree-width", "2", "--nproc", "1", "--no-python", "true"],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(98), "{err}");
    assert!(err.contains("1 of 5 nodes could not join"), "{err}");
    assert!(
        err.contains(&format!(
            "tr2-h4: ssh from tr2-h1 (which starts tr2-h4's agent in the launch tree) exited \
             255: ssh: connect to host {} port 22: Connection refused",
            c.addr(4)
        )),
        "{err}"
    );
    assert!(
        err.contains("`ssh tr2-h1 ssh tr2-h4 true`") && err.contains("--tree-width 0"),
        "{err}"
    );
    s.assert_no_survivors();
    c.assert_nothing_left(5);
}

/// An inner agent killed outright mid-run (kill -9 of its nrun, not of the ssh it started):
/// it is named with the node started through it, that node says it was lost with it, and the
/// job ends (no spare) or goes on with spares, nothing left running anywhere.
#[test]
fn a_killed_inner_agent_is_named_with_its_subtree() {
    let Some(c) = Cluster::up("tr3", 7) else {
        return;
    };
    let s = Scene::new();
    let work = "echo \"attempt=$TORCHELASTIC_RESTART_COUNT world=$WORLD_SIZE rank=$RANK host=$(hostname)\"; \
                echo started >> $MARK; [ $TORCHELASTIC_RESTART_COUNT = 0 ] && exec sleep 600; exit 0";
    // (Attempt 0 sleeps past the waits' hang guard: a job ending within it was stopped.)
    let h = |i: usize| c.host(i);

    // Five nodes, no spare: h2 starts h5; killing h2 loses both and the job ends.
    let child = c.spawn_on(
        &s,
        5,
        &[
            "--tree-width",
            "2",
            "--nproc",
            "1",
            "--no-python",
            "sh",
            "-c",
            work,
        ],
        &[],
    );
    s.wait_marks("started", 5, Duration::from_secs(60));
    assert!(c.kill_agents(2));
    let (out, _) = wait_with_timeout(child, HANG);
    let err = text(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(&format!("lost the connection to {}", h(2)))
            && err.contains(&format!(
                "the 1 node started through it in the launch tree goes with it: {}",
                h(5)
            )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "lost {} with {}, which started its agent in the launch tree",
            h(5),
            h(2)
        )),
        "{err}"
    );
    s.assert_no_survivors();
    c.assert_nothing_left(7);
    std::fs::write(s.mark(), "").unwrap();

    // Seven hosts, two spares (started from here): the spares take the places of h2 and h5.
    let child = c.spawn_on(
        &s,
        7,
        &[
            "--tree-width",
            "2",
            "--spares",
            "2",
            "--max-restarts",
            "1",
            "--nproc",
            "1",
            "--no-python",
            "sh",
            "-c",
            work,
        ],
        &[],
    );
    s.wait_marks("started", 5, Duration::from_secs(60));
    assert!(c.kill_agents(2));
    let (out, _) = wait_with_timeout(child, HANG);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "the job goes on with 5 nodes: {}, {}, {}, {}, {} (lost: {}, {}) (spare in: {}, {})",
            h(1),
            h(3),
            h(4),
            h(6),
            h(7),
            h(2),
            h(5),
            h(6),
            h(7)
        )),
        "{stderr}"
    );
    let second: Vec<&str> = stdout.lines().filter(|l| l.contains("attempt=1")).collect();
    assert_eq!(second.len(), 5, "{stdout}");
    assert!(
        !second
            .iter()
            .any(|l| l.contains(&format!("host={} ", h(2)))
                || l.ends_with(&format!("host={}", h(5)))),
        "{stdout}"
    );
    s.assert_no_survivors();
    c.assert_nothing_left(7);
}

/// The launcher killed outright (SIGKILL to the pid started) or interrupted (SIGINT) mid-run:
/// every agent, its workers and every ssh of the tree go, on every level.
#[test]
fn a_killed_or_interrupted_launcher_leaves_nothing_in_the_tree() {
    let Some(c) = Cluster::up("tr4", 5) else {
        return;
    };
    for (sig, code) in [("KILL", None), ("INT", Some(130))] {
        let s = Scene::new();
        let child = c.spawn_on(
            &s,
            5,
            &[
                "--tree-width",
                "2",
                "--nproc",
                "2",
                "--no-python",
                "sh",
                "-c",
                // Past the waits' hang guard: what ends within it was stopped.
                "echo up >> $MARK; exec sleep 600",
            ],
            &[],
        );
        s.wait_marks("up", 10, Duration::from_secs(60));
        signal(&child, sig);
        let (out, _) = wait_with_timeout(child, HANG);
        if let Some(code) = code {
            assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
        }
        s.assert_no_survivors();
        c.assert_nothing_left(5);
    }
}

/// Waits until each of `n` workers has written "RANK PPID" to the mark file, then kills rank
/// `rank`'s agent (its worker's parent) outright.
fn kill_agent_of_rank(s: &Scene, rank: usize, n: usize) {
    wait_until(&format!("{n} workers' marks"), || s.marks().len() >= n);
    let marks = s.marks();
    let line = marks
        .iter()
        .find(|m| m.split(' ').next() == Some(rank.to_string().as_str()))
        .unwrap();
    let agent = line.split(' ').nth(1).unwrap().to_string();
    signal_pid(&agent, "KILL");
}

/// Seven nodes of this machine (loopback aliases), width 2: the tree starts them too, without
/// ssh (an `ssh` first on PATH that only complains is never run): 127.1.9.1 starts .3 (which
/// starts .5) and .4, 127.1.9.2 starts .6 and .7. Then that second inner agent killed outright:
/// its nodes' agents and workers die with it (parent-death signals), it is named with them,
/// the job ends, and nothing is left running.
#[test]
fn this_machines_nodes_go_through_the_tree_without_ssh() {
    let s = Scene::new();
    let bin = s.dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let fake = bin.join("ssh");
    std::fs::write(&fake, "#!/bin/sh\necho ssh-ran >> \"$MARK\"\nexit 255\n").unwrap();
    Command::new("chmod")
        .arg("755")
        .arg(&fake)
        .status()
        .unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let hosts: Vec<String> = (1..=7).map(|i| format!("127.1.9.{i}")).collect();
    let run = |work: &str| {
        s.spawn(
            &[
                "-H",
                &hosts.join(","),
                "--tree-width",
                "2",
                "--nproc",
                "1",
                "--no-python",
                "sh",
                "-c",
                work,
            ],
            &[("PATH", &path)],
        )
    };
    let (out, _) = wait_with_timeout(
        run("echo \"rank=$RANK world=$WORLD_SIZE\""),
        Duration::from_secs(60),
    );
    let (o, err) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{o}\n{err}");
    for (rank, host) in hosts.iter().enumerate() {
        assert!(
            o.contains(&format!("[{host}:rank{rank}]: rank={rank} world=7")),
            "{o}"
        );
    }
    assert!(!s.marks().iter().any(|m| m == "ssh-ran"), "{:?}", s.marks());
    s.assert_no_survivors();

    // Each worker says its agent's pid; rank 1's agent is the inner one of .6 and .7.
    // Past the wait's hang guard: a job ending within it was stopped.
    let child = run("echo \"$RANK $PPID\" >> $MARK; exec sleep 600");
    kill_agent_of_rank(&s, 1, 7);
    let (out, _) = wait_with_timeout(child, HANG);
    let err = text(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("lost 127.1.9.2: its agent, a process of this host, was killed by SIGKILL")
            && err.contains("what ended nrun's agent of 127.1.9.2 on this host")
            && err.contains(
                "the 2 nodes started through it in the launch tree go with it: 127.1.9.6, \
                 127.1.9.7"
            ),
        "{err}"
    );
    assert!(!s.marks().iter().any(|m| m == "ssh-ran"), "{:?}", s.marks());
    s.assert_no_survivors();
}

/// A node of this machine deep in the tree (started by an agent beside it, no heartbeat) whose
/// agent is killed outright: the agent that started it writes its end up, the launch host
/// names it so, and the job ends with nothing left.
#[test]
fn a_killed_local_leaf_agent_is_named_by_the_agent_that_started_it() {
    let s = Scene::new();
    let hosts: Vec<String> = (1..=7).map(|i| format!("127.1.8.{i}")).collect();
    let child = s.spawn(
        &[
            "-H",
            &hosts.join(","),
            "--tree-width",
            "2",
            "--nproc",
            "1",
            "--no-python",
            "sh",
            "-c",
            "echo \"$RANK $PPID\" >> $MARK; exec sleep 60",
        ],
        &[],
    );
    // 127.1.8.5 (rank 4) is started by 127.1.8.3, itself started by 127.1.8.1.
    kill_agent_of_rank(&s, 4, 7);
    let (out, _) = wait_with_timeout(child, Duration::from_secs(60));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(98), "{err}");
    assert!(
        err.contains(
            "lost 127.1.8.5: its agent (a process of this host, started by 127.1.8.3's agent in \
             the launch tree) was killed by SIGKILL"
        ),
        "{err}"
    );
    s.assert_no_survivors();
}
