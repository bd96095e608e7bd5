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
    if !c.try_exec(
        3,
        "tc qdisc add dev eth0 root tbf rate 200mbit burst 256kbit latency 400ms",
    ) {
        missing_tool(
            "hosts_sharing_one_hostname_are_three_nodes_and_a_shaped_one_is_named",
            "tc",
        );
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
