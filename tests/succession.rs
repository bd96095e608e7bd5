//! The c10d rendezvous host is replaceable (issue 48): three namespace nodes, each running the
//! same nrun command by itself (no ssh), real gloo workers (tests/python/succession.py). The
//! host killed: the survivors re-form under the next node of the succession; the old host's
//! nrun started again finds it and joins. A host frozen: exactly one world trains at any time.
//! A node cut off alone: it never trains alone.

mod common;

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// One node's nrun: its console in files of the scene's directory.
struct Node {
    child: Child,
    err: PathBuf,
}

impl Node {
    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Waits for its exit (a hang guard, not a pace): its code.
    fn wait(mut self) -> (Option<i32>, String) {
        let end = Instant::now() + HANG;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return (st.code(), self.stderr());
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                panic!("nrun did not end: {}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The job's command on node `i` of `c`: c10d, `--nnodes 1:3`, one gloo worker per node.
fn start(
    c: &Cluster,
    s: &Scene,
    py: &std::path::Path,
    i: usize,
    run: usize,
    extra: &[&str],
) -> Node {
    start_with(c, s, py, i, run, extra, ("3", &c.addr(1)))
}

/// As [`start`], the job ending at a world of `end.0` under a master other than `end.1`.
fn start_with(
    c: &Cluster,
    s: &Scene,
    py: &std::path::Path,
    i: usize,
    run: usize,
    extra: &[&str],
    end: (&str, &str),
) -> Node {
    let endpoint = format!("{}:29711", c.addr(1));
    let err = s.dir.path().join(format!("n{i}-{run}.err"));
    let out = s.dir.path().join(format!("n{i}-{run}.out"));
    let mut cmd = c.nrun_named_in(i);
    cmd.args([
        "--nnodes",
        "1:3",
        "--nproc",
        "1",
        "--max-restarts",
        "5",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "j-succ",
        "--no-python-probe",
        "--python",
        py.to_str().unwrap(),
    ])
    .args(extra)
    .arg(py_script("succession.py"))
    .env("NRUN_TEST_TAG", &s.tag)
    .env("MARK", s.mark())
    .env("FULL_WORLD", end.0)
    .env("FIRST_MASTER", end.1)
    // Each node keeps its last succession in a directory of the scene's (not the user's).
    .env("XDG_RUNTIME_DIR", s.dir.path())
    .stdin(Stdio::null())
    .stdout(std::fs::File::create(&out).unwrap())
    .stderr(std::fs::File::create(&err).unwrap());
    Node {
        child: cmd.spawn().unwrap(),
        err,
    }
}

/// How many ranks marked themselves up in a world of `world` under `master`.
fn up_under(s: &Scene, world: usize, master: &str) -> usize {
    let mark = format!("up world={world} master={master}");
    s.marks().iter().filter(|l| **l == mark).count()
}

/// How many "up" marks of a world of `world` under a master other than `not` there are, and
/// that master (the last seen).
fn ups(s: &Scene, world: usize, not: &str) -> (usize, String) {
    let mut n = 0;
    let mut master = String::new();
    for l in s.marks() {
        let Some(rest) = l.strip_prefix(&format!("up world={world} master=")) else {
            continue;
        };
        if rest != not {
            n += 1;
            master = rest.to_string();
        }
    }
    (n, master)
}

/// Kills every process of host `i`'s namespace but its sshd with SIGKILL (the node dies);
/// when, in seconds since the epoch.
fn kill_host(c: &Cluster, i: usize) -> f64 {
    signal_host(c, i, nix::sys::signal::Signal::SIGKILL)
}

/// Sends `sig` to every process of host `i`'s namespace but its sshd; when, in seconds since
/// the epoch.
fn signal_host(c: &Cluster, i: usize, sig: nix::sys::signal::Signal) -> f64 {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", &c.host(i)])
        .output()
        .unwrap();
    let at = now();
    for pid in text(&out.stdout).split_whitespace() {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmd).contains("sshd") {
            continue;
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid.parse().unwrap()), sig);
    }
    at
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Three c10d nodes, `--nnodes 1:3`: the host node's every process killed with SIGKILL. The
/// survivors re-form under the next node of the last step's succession (the workers' new
/// MASTER_ADDR) and train at world 2, said on the new host's console; the old host's nrun
/// started again with the same command finds the new host through its machine's last
/// succession, joins it, and the world is 3 again (the job then ends 0 everywhere). Prints
/// nrun's share of the takeover: from the kill to the new workers' start.
#[test]
fn the_c10d_host_killed_hands_over_and_comes_back_as_a_node() {
    let Some(py) = need_torch() else {
        return;
    };
    let Some(c) = Cluster::up("sk", 3) else {
        return;
    };
    let s = Scene::new();
    let first = c.addr(1);
    let a = start(&c, &s, &py, 1, 0, &[]);
    let b = start(&c, &s, &py, 2, 0, &[]);
    let d = start(&c, &s, &py, 3, 0, &[]);
    wait_until("the first world of 3", || up_under(&s, 3, &first) >= 3);
    let killed = kill_host(&c, 1);
    let (code, _) = a.wait();
    assert_ne!(code, Some(0));
    wait_until("the survivors' world of 2 under a new host", || {
        ups(&s, 2, &first).0 >= 2
    });
    let (_, host) = ups(&s, 2, &first);
    assert!(host == c.addr(2) || host == c.addr(3), "{host}");
    // nrun's share: from the kill to the first new worker's start (the rest is python's).
    let times = std::fs::read_to_string(format!("{}.times", s.mark().display())).unwrap();
    let new: Vec<Vec<f64>> = times
        .lines()
        .filter(|l| l.starts_with(&format!("2 {host} ")))
        .map(|l| {
            l.split(' ')
                .skip(2)
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .collect();
    assert_eq!(new.len(), 2, "{times}");
    let first_start = new.iter().map(|v| v[0]).fold(f64::MAX, f64::min);
    let last_ready = new.iter().map(|v| v[1]).fold(0.0, f64::max);
    eprintln!(
        "the host killed: the survivors trained again {:.2} s after the kill: {:.2} s to the new \
         workers' start (nrun's share: loss noticed, succession, new store, join, group), \
         {:.2} s the workers' own start (python, torch, init)",
        last_ready - killed,
        first_start - killed,
        last_ready - first_start
    );
    // The old host's node, started again with the same command: it joins the new host.
    let a2 = start(&c, &s, &py, 1, 1, &[]);
    wait_until("the world of 3 again under the new host", || {
        up_under(&s, 3, &host) >= 3
    });
    let (new_host, joiner) = match host == c.addr(2) {
        true => (b, d),
        false => (d, b),
    };
    let (ch, eh) = new_host.wait();
    let (cj, ej) = joiner.wait();
    let (ca, ea) = a2.wait();
    assert_eq!(ch, Some(0), "{eh}");
    assert_eq!(cj, Some(0), "{ej}");
    assert_eq!(ca, Some(0), "{ea}");
    assert!(
        eh.contains(&format!(
            "takes over hosting at {host}:29711 (epoch 2; first in the succession"
        )),
        "{eh}"
    );
    assert!(
        eh.contains("waiting for a majority: 2 of the last 3 nodes"),
        "{eh}"
    );
    assert!(ej.contains("looks for node"), "{ej}");
    assert!(
        ea.contains(&format!("is hosted at {host}:29711 now")),
        "{ea}"
    );
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

/// Waits until node `n`'s console says it joined the rendezvous.
fn joined(n: &Node) {
    wait_until("a node's join", || {
        n.stderr().contains("joined the rendezvous at")
    });
}

/// Three c10d nodes; the first in the succession (node 2, joined first) cut off from the others
/// by a firewall that drops every packet in its namespace. The host keeps the other two (2 of
/// 3) and trains on at world 2; node 2, alone, takes over hosting by the succession but waits
/// for a majority (2 of 3: the silent host may be alive) that never comes, never trains, and
/// stops at its --join-timeout saying why (exit 95).
#[test]
fn a_c10d_node_cut_off_alone_never_trains_alone() {
    let Some(py) = need_torch() else {
        return;
    };
    if !need_tool("iptables", "iptables") {
        return;
    }
    let Some(c) = Cluster::up("sp", 3) else {
        return;
    };
    let s = Scene::new();
    let first = c.addr(1);
    // The job ends once it trained at world 2 under the first host.
    let end = ("2", "none");
    let flags = ["--join-timeout", "20"];
    let a = start_with(&c, &s, &py, 1, 0, &flags, end);
    let b = start_with(&c, &s, &py, 2, 0, &flags, end);
    joined(&b);
    let d = start_with(&c, &s, &py, 3, 0, &flags, end);
    wait_until("the first world of 3", || up_under(&s, 3, &first) >= 3);
    c.exec(
        2,
        "iptables -A INPUT -i eth0 -j DROP && iptables -A OUTPUT -o eth0 -j DROP",
    );
    let (cb, eb) = b.wait();
    let (ca, ea) = a.wait();
    let (cd, ed) = d.wait();
    assert_eq!(ca, Some(0), "{ea}");
    assert_eq!(cd, Some(0), "{ed}");
    assert_eq!(cb, Some(95), "{eb}");
    assert!(
        eb.contains(&format!(
            "takes over hosting at {}:29711 (epoch 2; first in the succession",
            c.addr(2)
        )),
        "{eb}"
    );
    assert!(
        eb.contains("waiting for a majority: 2 of the last 3 nodes"),
        "{eb}"
    );
    assert!(eb.contains("a minority never trains"), "{eb}");
    // Node 2 never trained alone: no world of 1, no step under its address.
    let marks = s.marks();
    assert!(
        !marks.iter().any(|l| l.starts_with("up world=1 ")),
        "{marks:?}"
    );
    let steps = std::fs::read_to_string(format!("{}.steps", s.mark().display())).unwrap();
    assert!(!steps.contains(&format!(" {} ", c.addr(2))), "{steps}");
    assert_eq!(up_under(&s, 2, &first), 2, "{marks:?}");
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

/// Three c10d nodes; the host node's every process frozen with SIGSTOP. The others find it
/// silent, node 2 (first in the succession) takes over at epoch 2 and node 3 joins it: they
/// train at world 2. Then the old host is resumed (SIGCONT): it finds the newer host, stands
/// down (its workers stop) and its node joins the new host as a fresh node: world 3 under
/// the new host, the job ends 0 everywhere. Exactly one world trained at any time: the steps
/// each world's rank 0 wrote, by MASTER_ADDR, fall in intervals that do not overlap.
#[test]
fn a_c10d_host_frozen_and_resumed_stands_down_and_one_world_trains() {
    let Some(py) = need_torch() else {
        return;
    };
    let Some(c) = Cluster::up("sf", 3) else {
        return;
    };
    let s = Scene::new();
    let first = c.addr(1);
    let flags = ["--rdzv-conf", "last_call_timeout=3"];
    let a = start(&c, &s, &py, 1, 0, &flags);
    let b = start(&c, &s, &py, 2, 0, &flags);
    joined(&b);
    let d = start(&c, &s, &py, 3, 0, &flags);
    wait_until("the first world of 3", || up_under(&s, 3, &first) >= 3);
    signal_host(&c, 1, nix::sys::signal::Signal::SIGSTOP);
    let new = c.addr(2);
    wait_until("the world of 2 under node 2", || up_under(&s, 2, &new) >= 2);
    signal_host(&c, 1, nix::sys::signal::Signal::SIGCONT);
    let (ca, ea) = a.wait();
    let (cb, eb) = b.wait();
    let (cd, ed) = d.wait();
    assert_eq!(ca, Some(0), "{ea}");
    assert_eq!(cb, Some(0), "{eb}");
    assert_eq!(cd, Some(0), "{ed}");
    assert!(
        eb.contains(&format!(
            "takes over hosting at {new}:29711 (epoch 2; first in the succession"
        )),
        "{eb}"
    );
    assert!(ea.contains("it stands down"), "{ea}");
    let marks = s.marks();
    assert_eq!(up_under(&s, 3, &new), 3, "{marks:?}");
    // One world at a time: each master's steps span an interval; no two overlap.
    let steps = std::fs::read_to_string(format!("{}.steps", s.mark().display())).unwrap();
    let mut spans: std::collections::BTreeMap<(String, String), (f64, f64)> = Default::default();
    for l in steps.lines() {
        let f: Vec<&str> = l.split(' ').collect();
        let t: f64 = f[3].parse().unwrap();
        let e = spans
            .entry((f[1].to_string(), f[2].to_string()))
            .or_insert((t, t));
        e.0 = e.0.min(t);
        e.1 = e.1.max(t);
    }
    let v: Vec<_> = spans.iter().collect();
    for (i, (wa, a)) in v.iter().enumerate() {
        for (wb, b) in &v[i + 1..] {
            if wa.1 != wb.1 {
                assert!(
                    a.1 < b.0 || b.1 < a.0,
                    "{wa:?} {a:?} and {wb:?} {b:?} overlap:\n{steps}"
                );
            }
        }
    }
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}
