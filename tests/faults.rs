//! The fault matrix: every row of docs/fault-model.md's matrix (between the `fault-matrix`
//! markers), run for real. Rows: mode (local, ssh over namespace hosts, srun under a real Slurm,
//! c10d) x fault (injected by tests/fixtures/fault.sh, or from outside: an agent killed, a node
//! cut off, ssh dropped, the launcher signalled) x policy (the row's flags, and `spare`: one host
//! more than --nnodes). Each row checks the exit code, the restarts and the nodes left out
//! (`--report`), that every line of every rank of the last attempt arrived, and that nothing is
//! left running. The expected columns are the docs': a change of rule changes both (and README's
//! short table of verdicts where a verdict changes).

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Output};
use std::time::Duration;

use common::slurm::Slurm;
use common::*;

/// Lines each rank prints before its fault (all must arrive).
const LINES: usize = 50;
/// A hung row fails the test instead of stalling it.
const GUARD: Duration = Duration::from_secs(150);

#[derive(Debug)]
struct Row {
    mode: String,
    fault: String,
    /// The row's flags, without backticks.
    flags: Vec<String>,
    spare: bool,
    /// None: killed by SIGKILL ("killed").
    exit: Option<i32>,
    restarts: Option<u64>,
    left_out: Vec<String>,
}

/// The fault matrix's rows of one mode (docs/fault-model.md).
fn rows(mode: &str) -> Vec<Row> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/fault-model.md"))
        .expect("docs/fault-model.md");
    let table = doc
        .split("<!-- fault-matrix begin -->")
        .nth(1)
        .and_then(|t| t.split("<!-- fault-matrix end -->").next())
        .expect("docs/fault-model.md has the fault-matrix markers");
    let mut out = Vec::new();
    for line in table.lines().filter(|l| l.starts_with('|')).skip(2) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 6, "a fault-matrix row has 6 cells: {line}");
        if cells[0] != mode {
            continue;
        }
        // NRUN_FAULT_ROW=WORDS: only the rows whose fault holds them (one row, by hand).
        if std::env::var("NRUN_FAULT_ROW").is_ok_and(|w| !cells[1].contains(w.as_str())) {
            continue;
        }
        let policy = cells[2];
        let flags = policy
            .split('`')
            .nth(1)
            .unwrap_or_default()
            .split_whitespace()
            .map(String::from)
            .collect();
        out.push(Row {
            mode: mode.into(),
            fault: cells[1].into(),
            flags,
            spare: policy.contains("+ spare"),
            exit: match cells[3] {
                "killed" => None,
                c => Some(c.parse().unwrap_or_else(|_| panic!("exit code in {line}"))),
            },
            restarts: cells[4].parse().ok(),
            left_out: match cells[5] {
                "-" => Vec::new(),
                l => l.split(',').map(|h| h.trim().to_string()).collect(),
            },
        });
    }
    assert!(
        !out.is_empty(),
        "docs/fault-model.md's fault matrix has no {mode} row"
    );
    out
}

/// What the row does to the job from outside, once every rank of the first attempt started.
#[derive(Debug, PartialEq)]
enum Outside {
    None,
    KillAgent,
    /// Every process of node1's namespace (c10d: the rendezvous host) killed with SIGKILL.
    KillHost,
    CutOff,
    /// Cut off, then opened again once the job went on without it.
    CutOffAndBack,
    DropSsh,
    Signal(Signal),
}

/// The FAULT the workers get, and what the test does from outside.
fn fault_of(row: &Row) -> (String, Outside) {
    let f = row.fault.as_str();
    let outside = match f {
        _ if f.starts_with("agent kill -9") => Outside::KillAgent,
        "host kill -9" => Outside::KillHost,
        _ if f.ends_with("cut off") => Outside::CutOff,
        _ if f.ends_with("cut off and back") => Outside::CutOffAndBack,
        _ if f.starts_with("ssh to") => Outside::DropSsh,
        "launcher SIGTERM" => Outside::Signal(Signal::SIGTERM),
        "launcher kill -9" => Outside::Signal(Signal::SIGKILL),
        _ => Outside::None,
    };
    if outside != Outside::None {
        // Everyone runs until the outside fault; the next attempt finishes. A launcher
        // signalled has no next attempt. A c10d host's loss starts the world again under a
        // new host (its attempt 0): the world of 2 runs until the fault.
        let when = match outside {
            Outside::Signal(_) => "always",
            // The group shrunk without the node runs until the node grows it back.
            Outside::CutOffAndBack => "short",
            _ if f.starts_with("host ") => "w2",
            _ => "first",
        };
        return (format!("wait:all:{when}"), outside);
    }
    let kind = [
        ("exit 1", "exit1"),
        ("exception", "raise"),
        ("SIGKILL", "kill"),
        ("SIGSEGV", "segv"),
        ("SIGBUS", "bus"),
        ("OOM", "oom"),
        ("hang", "hang"),
    ]
    .iter()
    .find(|(k, _)| f.contains(k))
    .unwrap_or_else(|| panic!("unknown fault {f:?}"))
    .1;
    let who = match f.contains("every rank") {
        true => "all",
        false => "1",
    };
    let when = match () {
        _ if f.contains("first attempt") => "first".to_string(),
        _ if f.contains("on node2") => "-h2".to_string(),
        _ => "always".to_string(),
    };
    (format!("{kind}:{who}:{when}"), Outside::None)
}

/// One row's run: how nrun ended and what it printed, with the hosts (node1, node2, ...).
struct Ran {
    out: Output,
    report: Option<serde_json::Value>,
    hosts: Vec<String>,
}

fn fixture_cmd() -> [String; 2] {
    ["sh".into(), fixture("fault.sh")]
}

/// The flags every mode gives: the row's, the report, the workers' variables, the fixture.
fn job_args(s: &Scene, row: &Row, fault: &str, report: &str) -> Vec<String> {
    let mut a: Vec<String> = row.flags.clone();
    for kv in [
        format!("FAULT={fault}"),
        format!("LINES={LINES}"),
        // Every row's world: a group smaller than this is a shrunk one.
        "FULL=2".to_string(),
        format!("MARK={}", s.mark().display()),
        format!("NRUN_TEST_TAG={}", s.tag),
        format!("PY={}", torch_python().unwrap_or_default().display()),
    ] {
        a.extend(["-x".into(), kv]);
    }
    let exclude = s.dir.path().join("exclude");
    a.extend(["--report".into(), report.into(), "--no-preflight".into()]);
    a.extend(["--exclude-file".into(), exclude.display().to_string()]);
    a.push("--no-python".into());
    a.extend(fixture_cmd());
    a
}

/// Waits until `n` ranks of attempt 0 marked themselves started.
fn wait_started(s: &Scene, n: usize) {
    wait_until_within(&format!("{n} ranks of attempt 0 to start"), GUARD, || {
        let marks = s.marks();
        let started = marks
            .iter()
            .filter(|l| l.starts_with("started") && l.contains("attempt=0"));
        started.count() >= n
    });
}

/// Does the outside fault to node2 (or node1 for a host's fault, or the launcher `child`).
fn strike(outside: &Outside, child: &Child, c: Option<&Cluster>, node2: usize) {
    match outside {
        Outside::None => {}
        Outside::Signal(sig) => signal(child, sig.as_str()),
        Outside::KillAgent => assert!(c.expect("a cluster").kill_agents(node2)),
        Outside::KillHost => {
            let c = c.expect("a cluster");
            let pids = Command::new("ip")
                .args(["netns", "pids", &c.host(node2)])
                .output()
                .unwrap();
            // One at a time, each allowed to be gone already (a process of the list may end
            // between the listing and its signal).
            for p in text(&pids.stdout).split_whitespace() {
                let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                if let (false, Ok(pid)) =
                    (String::from_utf8_lossy(&cmd).contains("sshd"), p.parse())
                {
                    let _ =
                        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        }
        Outside::CutOff | Outside::CutOffAndBack => c.expect("a cluster").exec(
            node2,
            "iptables -A INPUT -i lo -j ACCEPT && iptables -A INPUT -j DROP && \
             iptables -A OUTPUT -o lo -j ACCEPT && iptables -A OUTPUT -j DROP",
        ),
        Outside::DropSsh => {
            // The launch host's ssh client to node2 (a child of nrun or of its keeper).
            let host = c.expect("a cluster").host(node2);
            let pids = Command::new("pgrep")
                .args(["-f", &format!("^ssh .*{host}")])
                .output()
                .unwrap();
            let pids = text(&pids.stdout);
            assert!(!pids.trim().is_empty(), "no ssh client to {host}");
            for p in pids.split_whitespace() {
                signal_pid(p, "KILL");
            }
        }
    }
}

/// Checks one row's outcome against the matrix's expectation.
fn check(row: &Row, s: &Scene, ran: &Ran, world: usize) {
    let (stdout, stderr) = (text(&ran.out.stdout), text(&ran.out.stderr));
    let ctx = format!("row {row:?}\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    match row.exit {
        Some(code) => assert_eq!(ran.out.status.code(), Some(code), "{ctx}"),
        None => assert_eq!(ran.out.status.signal(), Some(9), "{ctx}"),
    }
    let report = ran.report.as_ref();
    if let (Some(n), Some(r)) = (row.restarts, report) {
        assert_eq!(r["job"]["restarts"].as_u64(), Some(n), "{ctx}\n{r}");
    }
    if let Some(r) = report {
        let left: Vec<String> = r["nodes"]["left_out"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter_map(|l| l["host"].as_str())
                    .map(|h| match ran.hosts.iter().position(|x| x == h) {
                        Some(i) => format!("node{}", i + 1),
                        None => h.to_string(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(left, row.left_out, "{ctx}\n{r}");
    }
    // Only node-level evidence reaches --exclude-file: exactly the nodes left out.
    if row.exit.is_some() {
        let path = s.dir.path().join("exclude");
        let listed: Vec<String> = std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| l.split_whitespace().next())
            .map(|h| match ran.hosts.iter().position(|x| x == h) {
                Some(i) => format!("node{}", i + 1),
                None => h.to_string(),
            })
            .collect();
        assert_eq!(listed, row.left_out, "--exclude-file\n{ctx}");
    }
    // Every line of every rank of the last attempt, where the job got that far; an elastic job
    // that lost nodes without spares goes on smaller.
    let world = match row.spare {
        true => world,
        false => world - row.left_out.len(),
    };
    if let (Some(0), Some(n)) = (row.exit, row.restarts) {
        for rank in 0..world {
            for i in 0..LINES {
                let line = format!("rank {rank} attempt {n} line {i}");
                assert!(stdout.contains(&line), "missing {line:?}\n{ctx}");
            }
            let done = format!("done rank={rank} attempt={n} world={world}");
            assert!(stdout.contains(&done), "missing {done:?}\n{ctx}");
        }
    }
    // A suspicion is a decision of its own in --report, with its evidence.
    if row.fault.starts_with("SIGKILL") && row.left_out.is_empty() {
        let d = report.map(|r| r["job"]["decisions"].to_string());
        assert!(
            d.as_deref().is_some_and(|d| d.contains("node suspected")),
            "{ctx}\n{d:?}"
        );
    }
    // Restarts that cannot help: the job stops with restarts left, and says why.
    if row.flags.iter().any(|f| f == "--progress-regex") && row.exit != Some(0) {
        assert!(
            stderr.contains("; restarting cannot help (--max-no-progress-restarts 3;"),
            "{ctx}"
        );
    }
    // A node that came back says so, with why, and the job grew with it.
    if row.fault.ends_with("and back") {
        assert!(stderr.contains("answers again (lost"), "{ctx}");
        assert!(stderr.contains("grows the job to 2 nodes"), "{ctx}");
        let back = report.map(|r| r["nodes"]["came_back"][0]["host"].clone());
        assert_eq!(
            back.as_ref().and_then(|h| h.as_str()),
            ran.hosts.get(1).map(String::as_str),
            "{ctx}"
        );
    }
    // An OOM kill is named as one (the kernel log or the memory cgroup says so).
    if row.fault.starts_with("OOM") {
        assert!(stderr.contains("out-of-memory killer"), "{ctx}");
    }
    // The decisions say why: each node left out (or kept in against its evidence) is listed
    // at the end with it.
    for n in &row.left_out {
        let i: usize = n.trim_start_matches("node").parse().unwrap_or(0);
        let host = ran
            .hosts
            .get(i.wrapping_sub(1))
            .map_or(n.as_str(), String::as_str);
        assert!(stderr.contains(&format!("  {host} (run): ")), "{ctx}");
    }
    s.assert_no_survivors();
}

fn report_of(path: &std::path::Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// Runs `start` (which starts nrun for a row), strikes from outside, waits.
fn run_row(
    row: &Row,
    s: &Scene,
    world: usize,
    hosts: Vec<String>,
    c: Option<&Cluster>,
    start: impl FnOnce(&str, &str) -> Child,
) -> Ran {
    eprintln!(
        "fault matrix: {} | {} | {:?}",
        row.mode, row.fault, row.flags
    );
    let (fault, outside) = fault_of(row);
    let report = s.dir.path().join("report.json");
    let child = start(&fault, report.to_str().unwrap());
    // A c10d host's fault strikes node1, the host (the row's nrun is node2's).
    let target = match row.fault.starts_with("host ") {
        true => 1,
        false => 2,
    };
    // Over ssh, nrun starts a lost node's agent again and takes it back once it answers: a
    // node whose agent or ssh the row ends takes no new ssh connection for the rest of the row,
    // so it stays out as the row says (the row "cut off and back" is the one that comes back).
    let held = row.mode == "ssh" && matches!(outside, Outside::KillAgent | Outside::DropSsh);
    if outside != Outside::None {
        wait_started(s, world);
        if held {
            c.expect("a cluster").exec(
                2,
                "iptables -A INPUT -p tcp --dport 22 -m state --state NEW -j DROP",
            );
        }
        strike(&outside, &child, c, target);
    }
    if outside == Outside::CutOffAndBack {
        // Once the job went on without node2 (the shrunk group's rank started), it is opened
        // again: nrun's tries to start its agent again find it.
        wait_until_within("the group without node2 to start", GUARD, || {
            s.marks()
                .iter()
                .any(|l| l.starts_with("started") && l.contains("attempt=1"))
        });
        c.expect("a cluster")
            .exec(2, "iptables -F INPUT && iptables -F OUTPUT");
    }
    let (out, took) = wait_with_timeout(child, GUARD);
    eprintln!("fault matrix: row took {:.1} s", took.as_secs_f64());
    let ran = Ran {
        out,
        report: report_of(&report),
        hosts,
    };
    if held || matches!(outside, Outside::CutOff | Outside::CutOffAndBack) {
        // Open node2 again for the next row.
        c.expect("a cluster")
            .exec(target, "iptables -F INPUT && iptables -F OUTPUT");
    }
    ran
}

/// Whether a memory cgroup with a limit can be made here, as tests/fixtures/fault.sh makes
/// one for its OOM.
fn memory_cgroups() -> bool {
    common::cgroup::MemCgroup::try_new("fm-probe", 64 << 20).is_ok()
}

/// OOM rows need a memory cgroup this user can make; the hang row a torch python. A row that
/// cannot run is said, or fails the test under scripts/test.sh (see `cannot_set_up`).
fn runnable(row: &Row) -> bool {
    if row.fault.contains("OOM") && !memory_cgroups() {
        cannot_set_up(&format!(
            "fault matrix row {row:?}: no memory cgroup can be made here (root and the memory \
             controller)"
        ));
        return false;
    }
    if row.fault.contains("hang") && torch_python().is_none() {
        cannot_set_up(&format!(
            "fault matrix row {row:?}: no python with torch (scripts/venv.sh; NRUN_TEST_PYTHON)"
        ));
        return false;
    }
    true
}

#[test]
fn local_rows() {
    for row in rows("local").iter().filter(|r| runnable(r)) {
        let s = Scene::new();
        let host = text(&Command::new("hostname").output().unwrap().stdout)
            .trim()
            .to_string();
        let ran = run_row(row, &s, 2, vec![host], None, |fault, report| {
            let mut args = vec!["--nproc".to_string(), "2".into()];
            args.extend(job_args(&s, row, fault, report));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            s.spawn(&args, &[])
        });
        check(row, &s, &ran, 2);
        for cg in std::fs::read_to_string(format!("{}.cgroups", s.mark().display()))
            .unwrap_or_default()
            .lines()
        {
            let _ = std::fs::remove_dir(cg);
        }
    }
}

#[test]
fn ssh_rows() {
    let Some(c) = Cluster::up("fm", 3) else {
        return;
    };
    for row in rows("ssh").iter().filter(|r| runnable(r)) {
        let s = Scene::new();
        let k = 2 + usize::from(row.spare);
        let hosts: Vec<String> = (1..=k).map(|i| c.host(i)).collect();
        let ran = run_row(row, &s, 2, hosts, Some(&c), |fault, report| {
            let mut args = vec!["--nproc".to_string(), "1".into()];
            if !row.flags.iter().any(|f| f == "--nnodes") {
                args.extend(["--nnodes".into(), "2".into()]);
            }
            args.extend(job_args(&s, row, fault, report));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            c.spawn_on(&s, k, &args, &[])
        });
        check(row, &s, &ran, 2);
        c.assert_nothing_left(3);
    }
}

#[test]
fn srun_rows() {
    let Some(sl) = Slurm::up("fms", 3) else {
        return;
    };
    for row in rows("srun").iter().filter(|r| runnable(r)) {
        let s = Scene::new();
        let k = 2 + usize::from(row.spare);
        let hosts: Vec<String> = (1..=k).map(|i| sl.cluster.host(i)).collect();
        let ran = run_row(row, &s, 2, hosts, Some(&sl.cluster), |fault, report| {
            let mut c = sl.cmd(&s, "salloc");
            c.arg(format!("-N{k}"))
                .arg(nrun_bin())
                .args(["--nnodes", "2", "--nproc", "1", "--no-python-probe"])
                .args(job_args(&s, row, fault, report));
            c.spawn().unwrap()
        });
        check(row, &s, &ran, 2);
        sl.cluster.assert_nothing_left_but_slurmd(3);
    }
}

#[test]
fn c10d_rows() {
    let Some(c) = Cluster::up("fmc", 2) else {
        return;
    };
    for (n, row) in rows("c10d").iter().filter(|r| runnable(r)).enumerate() {
        let s = Scene::new();
        let endpoint = format!("{}:{}", c.addr(1), 29700 + n);
        // A row of the host's loss is read from node2 (it hosts after the loss; its report),
        // the host's own end beside it: killed, or (cut off: it keeps the tie) the job's.
        let host_row = row.fault.starts_with("host ");
        let (main, other) = match host_row {
            true => (2, 1),
            false => (1, 2),
        };
        let hosts = vec![c.host(main), c.host(other)];
        let mut second: Option<Child> = None;
        let mut ran = run_row(row, &s, 2, hosts, Some(&c), |fault, report| {
            let node = |i: usize, report: &str| {
                let mut cmd = c.nrun_in(i);
                cmd.args(["--nproc", "1", "--rdzv-backend", "c10d"])
                    .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "fm"])
                    .arg("--no-python-probe");
                if !row.flags.iter().any(|f| f == "--nnodes") {
                    cmd.args(["--nnodes", "2"]);
                }
                // The other node's --exclude-file apart: the row's is the checked node's.
                let exclude = s.dir.path().join("exclude").display().to_string();
                let apart = s.dir.path().join("exclude-other").display().to_string();
                let args = job_args(&s, row, fault, report).into_iter().map(|a| {
                    match i == other && a == exclude {
                        true => apart.clone(),
                        false => a,
                    }
                });
                cmd.args(args)
                    .env("NRUN_TEST_TAG", &s.tag)
                    // Each node keeps its last succession in the row's directory.
                    .env("XDG_RUNTIME_DIR", s.dir.path())
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                cmd.spawn().unwrap()
            };
            let report_of_other = s.dir.path().join(format!("report-node{other}.json"));
            // The host first: node2 joins it (a host's row reads node2).
            match host_row {
                true => {
                    second = Some(node(1, report_of_other.to_str().unwrap()));
                    node(2, report)
                }
                false => {
                    second = Some(node(2, report_of_other.to_str().unwrap()));
                    node(1, report)
                }
            }
        });
        // The other node ends with the job's code too (the host killed: by SIGKILL; cut off:
        // the host keeps the tie and its world ends 0); its ranks' lines are on its console.
        let (o2, _) = wait_with_timeout(second.take().unwrap(), GUARD);
        let want = match row.fault.as_str() {
            "host kill -9" => None,
            "host cut off" => Some(0),
            _ => row.exit,
        };
        assert_eq!(o2.status.code(), want, "node{other}: {}", text(&o2.stderr));
        if !host_row {
            ran.out.stdout.extend_from_slice(&o2.stdout);
        }
        // After the host's loss node2's world is node2 alone.
        let world = match row.fault.as_str() {
            "host kill -9" => 1,
            _ => 2,
        };
        check(row, &s, &ran, world);
        c.assert_nothing_left(2);
    }
}
