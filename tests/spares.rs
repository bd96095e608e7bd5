//! Spares and exclusion on a real cluster of network-namespace hosts (real sshd, real
//! iptables): a bad node is left out and a spare takes its place, at the start and mid-run; the
//! program's own failure leaves nobody out; --exclude-file remembers across runs; too few
//! healthy nodes is exit 98; a loaded launch host calls no node dead.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// Held by the test that loads every core on purpose and by the test that measures links: run
/// side by side, the busy loops made every link look slow and the bisect could blame nobody.
static CORES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn cores() -> std::sync::MutexGuard<'static, ()> {
    CORES.lock().unwrap_or_else(|e| e.into_inner())
}

/// nrun on `hosts` (names) with the cluster's ssh config.
fn run_hosts(c: &Cluster, s: &Scene, hosts: &[String], extra: &[&str]) -> std::process::Output {
    c.cmd_on_hosts(s, &hosts.join(","), extra, &[])
        .output()
        .unwrap()
}

#[test]
fn a_firewalled_host_is_left_out_and_a_spare_runs_in_its_place() {
    let Some(c) = Cluster::up("sq1", 5) else {
        return;
    };
    if !c.firewall(2) {
        return;
    }
    let hosts: Vec<String> = (1..=5).map(|i| c.host(i)).collect();
    // As listed, and with the bad host first.
    let first: Vec<String> = [2, 1, 3, 4, 5].iter().map(|i| c.host(*i)).collect();
    for order in [hosts, first] {
        let s = Scene::new();
        let report = s.dir.path().join("report.json");
        let out = run_hosts(
            &c,
            &s,
            &order,
            &[
                "--nnodes",
                "4",
                "--nproc",
                "1",
                "--report",
                report.to_str().unwrap(),
                "--no-python",
                "sh",
                "-c",
                "echo rank=$RANK world=$WORLD_SIZE host=$(hostname)",
            ],
        );
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
        for r in 0..4 {
            assert!(
                stdout.contains(&format!("rank={r} world=4 ")),
                "{stdout}\n{stderr}"
            );
        }
        assert!(!stdout.contains("host=sq1-h2"), "{stdout}");
        assert!(stdout.contains("host=sq1-h5"), "the spare ran: {stdout}");
        assert!(
            stderr.contains("leaving out sq1-h2 (check): sq1-h2 cannot be reached from"),
            "{stderr}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let out = &json["nodes"]["left_out"];
        assert_eq!(out.as_array().map(Vec::len), Some(1), "{json}");
        assert_eq!(out[0]["host"], "sq1-h2");
        assert_eq!(out[0]["stage"], "check");
        assert!(
            out[0]["why"].as_str().unwrap().contains("no answer within"),
            "{json}"
        );
        assert_eq!(json["nodes"]["ran_on"].as_array().unwrap().len(), 4);
        // The journal's events say it too (issue 38): the node left out, the spare in its place.
        let events = json["events"].as_array().unwrap();
        let named = |n: &str| events.iter().find(|e| e["name"] == n).cloned();
        let left = named("node_left_out").unwrap_or_else(|| panic!("{json}"));
        assert_eq!(left["host"], "sq1-h2", "{left}");
        assert_eq!(left["metadata"]["stage"], "check", "{left}");
        let spare = named("spare_in").unwrap_or_else(|| panic!("{json}"));
        assert_eq!(spare["host"], "sq1-h5", "{spare}");
        assert_eq!(spare["metadata"]["replaces"], "sq1-h2", "{spare}");
        s.assert_no_survivors();
    }
    c.assert_nothing_left(5);
}

#[test]
fn a_node_lost_mid_run_is_replaced_by_the_spare() {
    let Some(c) = Cluster::up("sq2", 5) else {
        return;
    };
    let s = Scene::new();
    let work = "echo \"attempt=$TORCHELASTIC_RESTART_COUNT world=$WORLD_SIZE rank=$RANK host=$(hostname) t=$(date +%s.%N)\"; \
                echo started >> $MARK; [ $TORCHELASTIC_RESTART_COUNT = 0 ] && exec sleep 60; exit 0";
    let child = c.spawn_on(
        &s,
        5,
        &[
            "--nnodes",
            "4",
            "--max-restarts",
            "1",
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            work,
        ],
        &[],
    );
    s.wait_marks("started", 8, Duration::from_secs(30));
    let killed = c.kill_agents(3);
    let at_kill = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(killed);
    let (out, _) = wait_with_timeout(child, Duration::from_secs(60));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "the job goes on with 4 nodes: sq2-h1, sq2-h2, sq2-h4, sq2-h5 (lost: sq2-h3) (spare in: sq2-h5)"
        ),
        "{stderr}"
    );
    let second: Vec<&str> = stdout.lines().filter(|l| l.contains("attempt=1")).collect();
    assert_eq!(second.len(), 8, "{stdout}");
    for r in 0..8 {
        assert!(
            second
                .iter()
                .any(|l| l.contains(&format!("world=8 rank={r} "))),
            "{stdout}"
        );
    }
    assert!(
        !second.iter().any(|l| l.contains("host=sq2-h3")),
        "{stdout}"
    );
    assert_eq!(
        second.iter().filter(|l| l.contains("host=sq2-h5")).count(),
        2
    );
    // nrun's own part of the recovery: from the kill to the first worker of the new group.
    let first_start = second
        .iter()
        .filter_map(|l| l.rsplit("t=").next()?.trim().parse::<f64>().ok())
        .fold(f64::MAX, f64::min);
    eprintln!(
        "recovery: kill -> first restarted worker {:.3} s",
        first_start - at_kill
    );
    s.assert_no_survivors();
    c.assert_nothing_left(5);
}

#[test]
fn the_programs_own_failure_leaves_nobody_out() {
    let Some(c) = Cluster::up("sq3", 3) else {
        return;
    };
    let Some(py) = need_torch() else {
        return;
    };
    let s = Scene::new();
    let py = py.display().to_string();
    let out = c.run_on(
        &s,
        3,
        &[
            "--nnodes",
            "2",
            "--max-restarts",
            "1",
            "--nproc",
            "1",
            "--no-python",
            &py,
            "-c",
            "import os; raise ValueError('bad batch on rank ' + os.environ['RANK'])",
        ],
        &[],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("ValueError: bad batch on rank"), "{stderr}");
    assert!(
        stderr.contains("restarting the worker group (1 of 1 restarts)"),
        "{stderr}"
    );
    assert!(!stderr.contains("leaving out"), "{stderr}");
    assert!(!stderr.contains("left out"), "{stderr}");
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

#[test]
fn the_exclude_file_keeps_a_bad_host_out_of_the_next_run_until_it_expires() {
    let Some(c) = Cluster::up("sq4", 4) else {
        return;
    };
    let s = Scene::new();
    let file = s.dir.path().join("bad-nodes");
    let file_s = file.to_str().unwrap().to_string();
    let job = |extra: &[&str]| {
        let mut a = vec!["--nnodes", "3", "--exclude-file", &file_s, "--nproc", "1"];
        a.extend_from_slice(extra);
        a.extend_from_slice(&["--no-python", "sh", "-c", "echo host=$(hostname)"]);
        c.run_on(&s, 4, &a, &[])
    };
    if !c.firewall(1) {
        return;
    }
    let out = job(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let memo = std::fs::read_to_string(&file).unwrap();
    let lines: Vec<&str> = memo.lines().collect();
    assert_eq!(lines.len(), 1, "{memo}");
    let bad = c.host(1);
    assert!(lines[0].starts_with(&format!("{bad}  20")), "{memo}");
    assert!(
        lines[0].contains(&format!("check: {bad} cannot be reached")),
        "{memo}"
    );
    // Repaired, but remembered: the next run does not use it.
    c.exec(1, "iptables -F");
    let out = job(&[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!("not using {bad}: in --exclude-file")),
        "{stderr}"
    );
    assert!(!stdout.contains(&format!("host={bad}")), "{stdout}");
    // An entry older than --exclude-ttl counts no more. Time passing is the subject, and the
    // expiry is certain: the entry's time is written to the second rounded down, before the
    // second job, and a sleep lasts at least as long as asked (load only adds to it).
    std::thread::sleep(Duration::from_millis(2100));
    let out = job(&["--exclude-ttl", "2"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stdout.contains(&format!("host={bad}")),
        "{stdout}\n{stderr}"
    );
    assert!(!stderr.contains("not using"), "{stderr}");
    s.assert_no_survivors();
    c.assert_nothing_left(4);
}

#[test]
fn without_a_spare_a_bad_node_fails_the_job_with_98_naming_it() {
    let Some(c) = Cluster::up("sq5", 3) else {
        return;
    };
    if !c.firewall(3) {
        return;
    }
    let s = Scene::new();
    let out = c.run_on(&s, 3, &["--nproc", "1", "--no-python", "true"], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(98), "{stderr}");
    assert!(
        stderr.contains("the job needs 3 healthy node(s) but has 2 (sq5-h1, sq5-h2)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("sq5-h3 (check): sq5-h3 cannot be reached from"),
        "{stderr}"
    );
    // A host that cannot join: as before, then 98.
    let s = Scene::new();
    let hosts: Vec<String> = vec![c.host(1), "nosuchhost-nrun".into()];
    let out = run_hosts(&c, &s, &hosts, &["--nproc", "1", "--no-python", "true"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(98), "{stderr}");
    assert!(stderr.contains("1 of 2 nodes could not join"), "{stderr}");
    assert!(
        stderr.contains("nosuchhost-nrun: ssh: Could not resolve"),
        "{stderr}"
    );
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

#[test]
fn a_loaded_launch_host_calls_no_node_dead() {
    let _cores = cores();
    let Some(c) = Cluster::up("sq6", 3) else {
        return;
    };
    let s = Scene::new();
    // Twice as many busy loops as cores, at normal priority, for the job's whole run.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let hogs: Vec<std::process::Child> = (0..cores * 2)
        .map(|_| {
            Command::new("sh")
                .args([
                    "-c",
                    "end=$(( $(date +%s) + 12 )); while [ $(date +%s) -lt $end ]; do :; done",
                ])
                .spawn()
                .unwrap()
        })
        .collect();
    let out = c.run_on(
        &s,
        3,
        &[
            "--nproc",
            "1",
            "--no-python",
            "sh",
            "-c",
            "i=0; while [ $i -lt 8 ]; do sleep 1; i=$((i+1)); done; echo done",
        ],
        &[],
    );
    for mut h in hogs {
        let _ = h.kill();
        let _ = h.wait();
    }
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("lost"), "{stderr}");
    assert_eq!(text(&out.stdout).matches("done").count(), 3);
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

/// c10d: `--spares 1` on every node lets a third node join beyond `--nnodes 2`; it waits, and
/// takes the place of a joined node that dies mid-run.
#[test]
fn a_c10d_spare_takes_the_place_of_a_node_that_dies() {
    let Some(c) = Cluster::up("sq7", 3) else {
        return;
    };
    let endpoint = format!("{}:29671", c.addr(1));
    let s = Scene::new();
    let work = "echo \"attempt=$TORCHELASTIC_RESTART_COUNT world=$WORLD_SIZE rank=$RANK host=$(ip netns identify)\"; \
                echo started >> $MARK; [ $TORCHELASTIC_RESTART_COUNT = 0 ] && exec sleep 60; exit 0";
    let node = |host: usize| {
        let mut cmd = c.nrun_in(host);
        cmd.args([
            "--nnodes",
            "2",
            "--spares",
            "1",
            "--nproc",
            "1",
            "--max-restarts",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "sp",
            "--no-python-probe",
            "--no-python",
            "sh",
            "-c",
            work,
        ])
        .env("NRUN_TEST_TAG", &s.tag)
        .env("MARK", s.mark())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        cmd.spawn().unwrap()
    };
    let a = node(1);
    let b = node(2);
    s.wait_marks("started", 2, Duration::from_secs(30));
    // The spare joins while the job runs: it waits, running nothing.
    let spare = Watched::new(node(3));
    spare.wait_stderr("joined the rendezvous at");
    assert_eq!(s.marks().len(), 2, "the spare ran something");
    // sq7-h2's nrun dies (kill -9; its keeper then ends its worker).
    let kid = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", b.id()))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    signal_pid(&kid, "KILL");
    let (oa, _) = wait_with_timeout(a, HANG);
    let (os, _) = spare.finish();
    let _ = wait_with_timeout(b, HANG);
    let all = format!("{}{}", text(&oa.stdout), text(&os.stdout));
    let err = text(&oa.stderr);
    assert_eq!(oa.status.code(), Some(0), "{all}\n{err}");
    assert_eq!(os.status.code(), Some(0), "{all}\n{}", text(&os.stderr));
    // Namespace hosts share one host name: the joined nodes are told apart as vm#1, vm#2.
    assert!(err.contains("(run): lost vm#1"), "{err}");
    assert!(err.contains("(spare in: vm#2)"), "{err}");
    let second: Vec<&str> = all.lines().filter(|l| l.contains("attempt=1")).collect();
    assert_eq!(second.len(), 2, "{all}");
    assert!(
        second
            .iter()
            .any(|l| l.contains(&format!("host={}", c.host(3)))),
        "{all}"
    );
    assert!(second.iter().all(|l| l.contains("world=2")), "{all}");
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

/// The preflight fails with no single node to blame (a shaped link names a pair): the staged
/// scale-up runs on the spot over the nodes and the spare, the slow node is left out, the
/// preflight passes on the new set and the job runs.
#[test]
fn a_preflight_without_a_culprit_is_bisected_on_the_spot() {
    let _cores = cores();
    let Some(c) = Cluster::up("sq8", 5) else {
        return;
    };
    if !c.shape(3, &["tbf rate 200mbit burst 256kbit latency 400ms"]) {
        return;
    }
    let s = Scene::new();
    let report = s.dir.path().join("report.json");
    let out = c.run_on(
        &s,
        5,
        &[
            "--nnodes",
            "4",
            "--nproc",
            "1",
            "--preflight",
            "net",
            "--preflight-sizes",
            // Up to 512 KiB: enough for bandwidth, not latency, to set each group's
            // busbw (at 128 KiB a loaded machine's latency made the shaped group only 2x
            // slower than the others, and two groups need 3x to tell).
            "8:1M:4",
            "--report",
            report.to_str().unwrap(),
            "--no-python",
            "sh",
            "-c",
            "echo rank=$RANK world=$WORLD_SIZE host=$(ip netns identify)",
        ],
        &[],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("the preflight failed and names no single node: bisecting 5 nodes"),
        "{stderr}"
    );
    assert!(
        stderr.contains("leaving out sq8-h3 (preflight): bisect: slow"),
        "{stderr}"
    );
    assert!(stdout.contains("preflight ok"), "{stdout}");
    assert!(!stdout.contains("host=sq8-h3"), "{stdout}");
    assert!(stdout.contains("rank=3 world=4 host=sq8-h5"), "{stdout}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(json["verdict"], "ok", "{json}");
    assert_eq!(json["nodes"]["left_out"][0]["host"], "sq8-h3", "{json}");
    assert_eq!(json["nodes"]["left_out"][0]["stage"], "preflight", "{json}");
    s.assert_no_survivors();
    c.assert_nothing_left(5);
}

/// A hang the watch pins on one node's rank is a suspicion (README's fault model): the group
/// restarts in place; the same node pinned again is node-level evidence, and the spare takes
/// its place.
#[test]
fn a_hang_pinned_twice_on_a_node_brings_in_the_spare() {
    let Some(py) = need_torch() else {
        return;
    };
    let Some(c) = Cluster::up("sq9", 3) else {
        return;
    };
    let s = Scene::new();
    let script = s.dir.path().join("hang_on_h2.py");
    // Rank 1 hangs whenever it runs on sq9-h2.
    std::fs::write(
        &script,
        "import os, time\n\
         import torch, torch.distributed as dist\n\
         dist.init_process_group('gloo', init_method='env://')\n\
         rank, host = dist.get_rank(), os.popen('ip netns identify').read().strip()\n\
         restart = os.environ['TORCHELASTIC_RESTART_COUNT']\n\
         t = torch.ones(4)\n\
         for step in range(10):\n\
         \x20   if step == 5 and rank == 1 and host.endswith('-h2'):\n\
         \x20       time.sleep(300)\n\
         \x20   dist.all_reduce(t)\n\
         \x20   time.sleep(0.2)\n\
         print(f'done rank {rank} restart {restart} on {host}', flush=True)\n",
    )
    .unwrap();
    let (report, page) = (s.dir.path().join("job.json"), s.dir.path().join("job.html"));
    let out = c.run_on(
        &s,
        3,
        &[
            "--report",
            report.to_str().unwrap(),
            "--report-html",
            page.to_str().unwrap(),
            "--nnodes",
            "2",
            "--nproc",
            "1",
            "--max-restarts",
            "2",
            "--hang-timeout",
            "4",
            "--on-hang",
            "stop",
            "--python",
            py.to_str().unwrap(),
            script.to_str().unwrap(),
        ],
        &[],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("sq9-h2: node suspected (the watch pinned a hang on it"),
        "{stderr}"
    );
    assert!(stderr.contains("suspected 2 times in this job"), "{stderr}");
    assert!(
        stderr.contains("leaving out sq9-h2 (run): the watch pinned a hang on it"),
        "{stderr}"
    );
    assert!(stderr.contains("(spare in: sq9-h3)"), "{stderr}");
    assert!(
        stdout.contains("done rank 0 restart 2 on sq9-h1"),
        "{stdout}"
    );
    assert!(
        stdout.contains("done rank 1 restart 2 on sq9-h3"),
        "{stdout}"
    );
    s.assert_no_survivors();
    c.assert_nothing_left(3);
    hang_restart_spare_page(&s, &report, &page);
}

/// Issue 38's "done when", on the real job above: its ledger adds up, and its --report-html page,
/// opened in headless Chromium, shows both hangs, the restarts, the node left out and the spare
/// in, with nothing failing to load.
fn hang_restart_spare_page(s: &Scene, report: &std::path::Path, page: &std::path::Path) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap();
    let ledger = &v["ledger"];
    let wall = ledger["wall_s"].as_f64().unwrap();
    let sum: f64 = ledger["phases"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p.as_f64().unwrap())
        .sum();
    assert!(
        (sum - wall).abs() <= wall * 0.01,
        "phases {sum} s, wall {wall} s: {ledger}"
    );
    assert_eq!(ledger["attempts"].as_array().unwrap().len(), 3, "{ledger}");
    assert!(
        ledger["phases"]["detecting"].as_f64().unwrap() > 0.0,
        "{ledger}"
    );
    let names: Vec<&str> = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    for n in ["hang", "restart", "node_left_out", "spare_in", "decision"] {
        assert!(names.contains(&n), "no {n} event: {names:?}");
    }
    let Some(chrome) =
        common::chromium::chromium("a_hang_pinned_twice_on_a_node_brings_in_the_spare (its page)")
    else {
        return;
    };
    let b = common::chromium::browse(s, &chrome, page, &[]);
    assert_eq!(
        common::chromium::page_complaints(&b.stderr),
        Vec::<&str>::new()
    );
    for needle in [
        "id=\"timeline\"",
        "class=\"attempt bar-hang\"",
        "class=\"attempt bar-success\"",
        "class=\"m m-hang\"",
        "class=\"m m-left_out\"",
        "class=\"m m-spare_in\"",
        "class=\"restart-line\"",
        "class=\"ledger-chart\"",
        "class=\"phase ph-running\"",
        "spare, in for sq9-h2",
        "class=\"decision-table\"",
        "class=\"culprit\"",
    ] {
        assert!(b.dom.contains(needle), "the page lacks {needle}");
    }
    assert_eq!(
        b.dom.matches("class=\"m m-hang\"").count(),
        2,
        "two hangs on sq9-h2's row"
    );
}
