//! Issue 45's verdicts on real networks, on namespace hosts with real sshd
//! (scripts/netns-cluster.sh): the launch-host address each agent uses is chosen, not raced;
//! nodes are known by what the kernel says, not by their host names; a static launch meets
//! at node 0's store; the reasons written down are the evidence seen.

mod common;

use common::*;

/// A bridge of the launch host's made for one test (a veth pair on it, so that it has a
/// carrier and counts as up), removed when dropped (also when the test fails).
struct ExtraBridge {
    name: String,
}

impl ExtraBridge {
    fn add(c: &Cluster, name: &str, addr: &str) -> ExtraBridge {
        let b = ExtraBridge { name: name.into() };
        c.exec_here(&format!(
            "ip link add {name} type bridge && ip link add {name}a type veth peer name {name}b \
             && ip link set {name}a master {name} && ip link set {name}a up \
             && ip link set {name}b up && ip addr add {addr}/24 dev {name} && ip link set {name} up"
        ));
        b
    }
}

impl Drop for ExtraBridge {
    fn drop(&mut self) {
        for dev in [format!("{}a", self.name), self.name.clone()] {
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &dev])
                .status();
        }
    }
}

/// The control plane on the path that was checked: each host routes to every address of the
/// launch host (a default route through its bridge), so a race among them could take any;
/// the launch host gets another interface, which goes away mid-job. On every run, every
/// agent uses the launch host's address its ssh connection came from (said in --report), the
/// workers' MASTER_ADDR is that address, and the interface going changes nothing. An address
/// given that a node cannot reach is named with that node's route to it.
#[test]
fn agents_use_the_address_their_ssh_came_from_and_not_another() {
    let Some(c) = Cluster::up("va1", 2) else {
        return;
    };
    let launch = c.launch_addr();
    let extra_addr = format!("10.214.{}.1", c.net());
    let extra_name = format!("{}-x", c.name);
    let s = Scene::new();

    // Given an address the nodes have no route to (no default route yet): named, with the route.
    let out = c.run_on(
        &s,
        2,
        &[
            "--local-addr",
            &extra_addr,
            "--join-timeout",
            "30",
            "--no-python",
            "true",
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(&format!("{extra_addr}:"))
            && err.contains("the address given on the command line")
            && err.contains("this node has no route to it"),
        "{err}"
    );

    for i in 1..=2 {
        c.exec(i, &format!("ip route add default via {launch}"));
    }
    for run in 0..3 {
        let extra = ExtraBridge::add(&c, &extra_name, &extra_addr);
        let report = s.dir.path().join(format!("report{run}.json"));
        let started = s.dir.path().join(format!("started{run}"));
        let go = s.dir.path().join(format!("go{run}"));
        std::fs::create_dir_all(&started).unwrap();
        let script = format!(
            "echo master=$MASTER_ADDR; touch {}/$RANK; while [ ! -e {} ]; do sleep 0.05; done",
            started.display(),
            go.display()
        );
        let child = c.spawn_on(
            &s,
            2,
            &[
                "--report",
                report.to_str().unwrap(),
                "--no-python",
                "sh",
                "-c",
                &script,
            ],
            &[],
        );
        let w = Watched::new(child);
        wait_until("both workers started", || {
            std::fs::read_dir(&started).is_ok_and(|d| d.count() == 2)
        });
        // The other interface goes while the job runs.
        drop(extra);
        std::fs::write(&go, "").unwrap();
        let (out, _) = w.finish();
        let stdout = text(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "run {run}: {stdout}\n{}",
            text(&out.stderr)
        );
        assert_eq!(
            stdout.matches(&format!("master={launch}\n")).count(),
            2,
            "run {run}: {stdout}"
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let control = v["control"].as_array().expect("a control section");
        assert_eq!(control.len(), 2, "run {run}: {control:?}");
        for n in control {
            assert!(
                n["launch_addr"]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("{launch}:")),
                "run {run}: {n}"
            );
            assert_eq!(n["chosen"], "ssh", "run {run}: {n}");
        }
    }
    s.assert_no_survivors();
    c.assert_nothing_left(2);
}

/// Three namespace hosts with one host name (cloned machines look so): they are three
/// machines, since their kernels say so (network namespaces), so the preflight lays out 3
/// nodes, measures the links between them and names the shaped one by the name the user gave
/// (not the host name all three share).
#[test]
fn hosts_sharing_one_hostname_are_three_nodes_and_a_shaped_one_is_named() {
    let Some(c) = Cluster::up("va2", 3) else {
        return;
    };
    for i in 1..=3 {
        c.set_hostname(i, "twin");
    }
    if !c.shape(3, &["tbf rate 200mbit burst 256kbit latency 400ms"]) {
        return;
    }
    let s = Scene::new();
    let out = c.run_on(
        &s,
        3,
        &[
            "--preflight-only",
            "--preflight",
            "net",
            "--nproc",
            "1",
            "--preflight-sizes",
            "8:256K:4",
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("network (TCP ring) all-reduce, 3 ranks on 3 node(s)"),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(94),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    let problems: Vec<&str> = stdout.lines().filter(|l| l.contains("problem:")).collect();
    assert!(problems.iter().any(|p| p.contains("va2-h3")), "{stdout}");
    assert!(!stdout.contains("twin:"), "{stdout}");
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

/// The reason written down is the evidence seen: a spare that never joins because ssh cannot
/// reach it is remembered in --exclude-file and --report with ssh's own error, as the console
/// says it, not as an agent still starting; the job's end line does not say "no faults".
#[test]
fn an_unreachable_hosts_reason_is_sshs_own_error() {
    let Some(c) = Cluster::up("va3", 2) else {
        return;
    };
    let s = Scene::new();
    // In the cluster's subnet, held by no host: ssh's ARP goes unanswered.
    let nowhere = format!("10.213.{}.99", c.net());
    let hosts = format!("{},{nowhere}", c.host(1));
    let exclude = s.dir.path().join("exclude");
    let report = s.dir.path().join("report.json");
    let opts = c.ssh_opts();
    let out = s.run(
        &[
            "-H",
            &hosts,
            "--ssh-opts",
            &opts,
            "--no-python-probe",
            "--nnodes",
            "1",
            "--exclude-file",
            exclude.to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
            "--no-python",
            "true",
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let remembered = std::fs::read_to_string(&exclude).unwrap();
    let line = remembered
        .lines()
        .find(|l| l.starts_with(&nowhere))
        .unwrap_or_else(|| panic!("{nowhere} not remembered: {remembered}\n{err}"));
    assert!(
        line.contains("ssh: connect to host") && line.contains("No route to host"),
        "{line}\n{err}"
    );
    assert!(!line.contains("still starting"), "{line}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let left = &v["nodes"]["left_out"][0];
    assert_eq!(left["host"], nowhere.as_str(), "{v}");
    assert_eq!(left["evidence"], "seen", "{v}");
    assert!(
        left["why"].as_str().unwrap().contains("No route to host"),
        "{v}"
    );
    // The summary's list says the same.
    assert!(
        err.contains(&format!("  {nowhere} (join): ")) && err.contains("No route to host"),
        "{err}"
    );
    let last = err
        .lines()
        .rev()
        .find(|l| l.starts_with("nrun: ran "))
        .unwrap();
    assert!(last.ends_with("; 1 node left out (see above)"), "{err}");
    c.assert_nothing_left(1);
}

/// Ctrl-C while a node is still joining (its ssh hanging on dropped packets) blames nothing
/// on that node: it is said to be interrupted, in the summary and --report, and nothing is
/// remembered in --exclude-file; the end line says the job was interrupted, not "no faults".
#[test]
fn ctrl_c_during_a_join_blames_no_host() {
    let Some(c) = Cluster::up("va4", 2) else {
        return;
    };
    c.exec(2, "iptables -A INPUT -p tcp --dport 22 -j DROP");
    let s = Scene::new();
    let exclude = s.dir.path().join("exclude");
    let report = s.dir.path().join("report.json");
    let child = c.spawn_on(
        &s,
        2,
        &[
            "--exclude-file",
            exclude.to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
            "--no-python",
            "true",
        ],
        &[],
    );
    let w = Watched::new(child);
    w.wait_stderr("1/2 nodes joined");
    signal(w.child(), "INT");
    let (out, _) = w.finish();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    let host2 = c.host(2);
    assert!(
        err.contains(&format!(
            "leaving out {host2} (join): had not joined when nrun was stopped by SIGINT; \
             nothing is known against it"
        )),
        "{err}"
    );
    assert!(!err.contains("still starting"), "{err}");
    assert!(
        std::fs::read_to_string(&exclude)
            .unwrap_or_default()
            .is_empty(),
        "nothing is remembered of an interrupted join"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(v["nodes"]["left_out"][0]["evidence"], "interrupted", "{v}");
    let last = err
        .lines()
        .rev()
        .find(|l| l.starts_with("nrun: ran "))
        .unwrap();
    assert!(last.ends_with("; interrupted, exit 130"), "{err}");
    s.assert_no_survivors();
    c.assert_nothing_left(1);
}

/// A static launch meets as torchrun's does: node 1 with no node 0 says what it waits for,
/// where and until when (within a second of its start), and ends with exit 95 naming node 0's
/// store at the deadline: never exit 0 (its workers never start), never torch's stack.
#[test]
fn a_static_node_without_node_0_waits_says_so_and_fails() {
    let s = Scene::new();
    let port = free_port().to_string();
    let marker = s.dir.path().join("worker-ran");
    let script = format!("touch {}", marker.display());
    let child = s.spawn(
        &[
            &setup::static_args("1", &port, "3")[..],
            &["--no-python", "sh", "-c", script.as_str()],
        ]
        .concat(),
        &[],
    );
    let w = Watched::new(child);
    w.wait_stderr("waiting at node 0's store");
    let (out, _) = w.finish();
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!(
            "node 1 of 2: waiting at node 0's store 127.0.0.1:{port} for node 0 ("
        )) && err.contains("until ")
            && err.contains("3 s, --join-timeout"),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(95), "{err}");
    assert!(
        err.contains(&format!(
            "node 1 of 2: node 0's store at 127.0.0.1:{port} did not answer within 3 s"
        )),
        "{err}"
    );
    assert!(!marker.exists(), "no worker starts before the nodes met");
    assert!(
        !err.contains("Traceback") && !err.contains("terminate called"),
        "{err}"
    );
}

/// A static launch whose node 0 comes late: node 1 waits, node 0 arrives, both run.
#[test]
fn static_nodes_meet_whichever_starts_first() {
    let s = Scene::new();
    let port = free_port().to_string();
    let node = |rank: &str| {
        s.spawn(
            &[
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
                "--no-python",
                "sh",
                "-c",
                "echo rank=$RANK",
            ],
            &[],
        )
    };
    let one = Watched::new(node("1"));
    one.wait_stderr("waiting at node 0's store");
    let zero = Watched::new(node("0"));
    let (o1, _) = one.finish();
    let (o0, _) = zero.finish();
    let all = format!("{}{}", text(&o0.stdout), text(&o1.stdout));
    assert_eq!(o0.status.code(), Some(0), "{all}\n{}", text(&o0.stderr));
    assert_eq!(o1.status.code(), Some(0), "{all}\n{}", text(&o1.stderr));
    assert!(all.contains("rank=0") && all.contains("rank=1"), "{all}");
}

/// Another program on the rendezvous port (one that greets with a banner, one that says
/// nothing) is named as such, with what it answered, for c10d and for a static node; not "no
/// answer ... check the firewall".
#[test]
fn another_program_on_the_rendezvous_port_is_named() {
    use std::io::Write;
    for banner in [Some("SSH-2.0-OpenSSH_9.2"), None] {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port().to_string();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for c in l.incoming() {
                let Ok(mut c) = c else { break };
                if let Some(b) = banner {
                    let _ = c.write_all(format!("{b}\r\n").as_bytes());
                }
                held.push(c);
            }
        });
        let s = Scene::new();
        let endpoint = format!("127.0.0.1:{port}");
        let mut c10d = setup::c10d_args(&endpoint, "job", "20");
        c10d.extend(["--no-python", "true"]);
        let mut static_node = setup::static_args("1", &port, "20");
        static_node.extend(["--no-python", "true"]);
        for (args, flag) in [
            (&c10d[..], "--rdzv-endpoint"),
            (&static_node[..], "--master-port"),
        ] {
            let out = s.run(args, &[]);
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(95), "{err}");
            assert!(
                err.contains(&format!("something else listens at {endpoint}: ")),
                "{err}"
            );
            assert!(err.contains(&format!("another {flag} port")), "{err}");
            match banner {
                Some(b) => assert!(err.contains(b), "{err}"),
                None => assert!(err.contains("answered nothing"), "{err}"),
            }
            assert!(!err.contains("check the firewall"), "{err}");
        }
    }
}

/// The launch tree's inner agents start their children over ssh from their own nodes, whose
/// ssh connections say nothing of the launch host's addresses: each child uses the address
/// its parent uses (chosen "tree"), the launch host's on the cluster's bridge, not another of
/// the launch host's addresses the hosts also route to.
#[test]
fn nodes_of_the_launch_tree_use_their_parents_address() {
    let Some(c) = Cluster::up("va5", 3) else {
        return;
    };
    let launch = c.launch_addr();
    for i in 1..=3 {
        c.exec(i, &format!("ip route add default via {launch}"));
    }
    let _extra = ExtraBridge::add(
        &c,
        &format!("{}-x", c.name),
        &format!("10.214.{}.1", c.net()),
    );
    let s = Scene::new();
    let report = s.dir.path().join("report.json");
    let out = c.run_on(
        &s,
        3,
        &[
            // h1 and h2 started here, h3 by h1.
            "--tree-width",
            "2",
            "--report",
            report.to_str().unwrap(),
            "--no-python",
            "sh",
            "-c",
            "echo master=$MASTER_ADDR",
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert_eq!(
        stdout.matches(&format!("master={launch}\n")).count(),
        3,
        "{stdout}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let chosen: Vec<(String, String)> = v["control"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            assert!(
                n["launch_addr"]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("{launch}:")),
                "{n}"
            );
            (
                n["host"].as_str().unwrap().to_string(),
                n["chosen"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        chosen,
        [
            (c.host(1), "ssh".to_string()),
            (c.host(2), "ssh".to_string()),
            (c.host(3), "tree".to_string())
        ],
        "{v}"
    );
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

/// bisect's own --local-addr pins the launch host's address for every node (said "given" in
/// its --report), whatever else the hosts route to.
#[test]
fn bisect_takes_the_address_it_is_given() {
    let Some(c) = Cluster::up("va6", 2) else {
        return;
    };
    let launch = c.launch_addr();
    for i in 1..=2 {
        c.exec(i, &format!("ip route add default via {launch}"));
    }
    let _extra = ExtraBridge::add(
        &c,
        &format!("{}-x", c.name),
        &format!("10.214.{}.1", c.net()),
    );
    let s = Scene::new();
    let report = s.dir.path().join("report.json");
    let hosts = c.hosts(2);
    let opts = c.ssh_opts();
    let out = s.run(
        &[
            "bisect",
            "-H",
            &hosts,
            "--ssh-opts",
            &opts,
            "--local-addr",
            &launch,
            "--report",
            report.to_str().unwrap(),
            "--probe",
            "cmd",
            "--no-python",
            "--",
            "true",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let control = v["control"].as_array().expect("a control section");
    assert_eq!(control.len(), 2, "{v}");
    for n in control {
        assert_eq!(n["chosen"], "given", "{n}");
        assert!(
            n["launch_addr"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{launch}:")),
            "{n}"
        );
    }
    c.assert_nothing_left(2);
}

/// Node 0 of a static launch whose node 1 never comes: it says it waits at its own store for
/// node 1, and at the deadline ends with exit 95 naming node 1 and the flag to start it with;
/// its workers never start.
#[test]
fn a_static_node_0_without_node_1_names_it() {
    let s = Scene::new();
    let port = free_port().to_string();
    let marker = s.dir.path().join("worker-ran");
    let script = format!("touch {}", marker.display());
    let out = s.run(
        &[
            &setup::static_args("0", &port, "2")[..],
            &["--no-python", "sh", "-c", script.as_str()],
        ]
        .concat(),
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(95), "{err}");
    assert!(
        err.contains(&format!(
            "node 0 of 2: waiting at this node's store 127.0.0.1:{port} for node 1 before the \
             workers start"
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "node 0 of 2: node 1 did not arrive at this node's store 127.0.0.1:{port} within 2 s \
             (--join-timeout): start the same command there with --node-rank 1"
        )),
        "{err}"
    );
    assert!(!marker.exists(), "no worker starts before the nodes met");
}
