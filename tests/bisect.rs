//! `nrun bisect` on a real 8-host cluster (network namespaces with sshd), the TCP ring probe,
//! one fault injected per test. Each must name exactly the faulty node, blame no good node, and
//! leave it out of --write-hostfile.

mod common;

use std::process::Command;

use common::*;

/// Runs bisect over the cluster's hostfile (plus `extra_hosts` lines); returns (exit code,
/// stdout, stderr, the written hostfile).
fn bisect(
    s: &Scene,
    c: &Cluster,
    extra_hosts: &str,
    args: &[&str],
) -> (Option<i32>, String, String, String) {
    let hostfile = s.dir.path().join("hosts");
    let mut text_in = std::fs::read_to_string(format!("{}/hosts", c.dir())).unwrap();
    text_in.push_str(extra_hosts);
    std::fs::write(&hostfile, text_in).unwrap();
    let good = s.dir.path().join("good");
    let report = s.dir.path().join("report.json");
    let page = s.dir.path().join("report.html");
    let cfg = c.ssh_opts();
    let mut a = vec![
        "bisect",
        "--hostfile",
        hostfile.to_str().unwrap(),
        "--ssh-opts",
        &cfg,
        "--probe",
        "net",
        "--nproc",
        "2",
        "--preflight-sizes",
        "8:1M:4",
        "--iters",
        "3",
        "--preflight-timeout",
        "5",
        "--timeout",
        "40",
        "--write-hostfile",
        good.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
        "--report-html",
        page.to_str().unwrap(),
        "-x",
        "NRUN_TEST_TAG",
    ];
    a.extend_from_slice(args);
    let out = s.run(&a, &[]);
    let good = std::fs::read_to_string(&good).unwrap_or_default();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap_or_else(|_| "{}".into()))
            .unwrap_or_default();
    if out.status.code() != Some(2) {
        assert!(
            v["nodes"].as_array().is_some_and(|n| !n.is_empty()),
            "report without nodes: {v}"
        );
        assert!(
            v["rounds"].as_array().is_some(),
            "report without rounds: {v}"
        );
        // The page draws the same report: the verdict matrix, a row for every node.
        let html = std::fs::read_to_string(&page).unwrap_or_default();
        assert!(
            html.contains("class=\"bisect-matrix\""),
            "no matrix: {html}"
        );
        for n in v["nodes"].as_array().unwrap() {
            let host = n["host"].as_str().unwrap();
            assert!(
                html.contains(&format!(">{host}</text>")),
                "{host} not drawn"
            );
        }
    }
    (
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr),
        good,
    )
}

/// The verdict column of the final table for each host.
fn verdicts(stdout: &str) -> Vec<(String, String)> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with("node "))
        .skip(1)
        .take_while(|l| !l.contains(" rounds ("))
        .map(|l| {
            let mut w = l.split_whitespace();
            (
                w.next().unwrap_or("").to_string(),
                w.next().unwrap_or("").to_string(),
            )
        })
        .collect()
}

fn only_bad(stdout: &str, host: &str, verdict: &str) {
    only_bad_of(stdout, 8, host, verdict)
}

/// Of `n` hosts, `host` alone has `verdict`; every other is good.
fn only_bad_of(stdout: &str, n: usize, host: &str, verdict: &str) {
    let v = verdicts(stdout);
    assert_eq!(v.len(), n, "every host of the list has a verdict: {stdout}");
    for (h, ver) in &v {
        if h == host {
            assert_eq!(ver, verdict, "{host} should be {verdict}: {stdout}");
        } else {
            assert_eq!(ver, "good", "good node {h} blamed: {stdout}");
        }
    }
}

fn rounds_after_stage1(stdout: &str) -> usize {
    let l = stdout.lines().find(|l| l.contains(" rounds (")).unwrap();
    l.split('(')
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn a_node_with_blocked_high_ports_is_named() {
    let Some(c) = Cluster::up("cb1", 8) else {
        return;
    };
    // New connections from other hosts to cb1-h5 are dropped, ssh excepted.
    assert!(c.try_exec(5, "iptables -A INPUT -i eth0 -p tcp --dport 22 -j ACCEPT && iptables -A INPUT -i eth0 -p tcp -m state --state NEW -j DROP"));
    let s = Scene::new();
    // The fault here is a failure, not slowness: a pair measured slow because the machine is
    // loaded (two CPU hogs made one 5x under its stage's median) must not add rounds, so only
    // a group 100x under the median counts as slow.
    let (code, stdout, stderr, good) =
        bisect(&s, &c, "", &["--no-python-probe", "--slow-factor", "0.01"]);
    assert_eq!(code, Some(96), "{stdout}\n{stderr}");
    only_bad(&stdout, &c.host(5), "bad");
    assert!(
        !good.contains(&c.host(5)) && good.lines().count() == 7,
        "{good}"
    );
    // One bad node among 8: at most ceil(log2 8) + 3 = 6 rounds after stage 1.
    assert!(rounds_after_stage1(&stdout) <= 6, "{stdout}\n{stderr}");
    // Each round was said as it started: which of how many, on which nodes.
    assert!(
        stderr.contains(
            "nrun: bisect round 1 of at least 4 (stage 1: every node alone): 8 group(s) on 8 \
             node(s): "
        ),
        "{stderr}"
    );
    let said = stderr
        .lines()
        .filter(|l| l.starts_with("nrun: bisect round ") && l.contains(" of at least "))
        .count();
    assert_eq!(said, rounds_after_stage1(&stdout) + 1, "{stdout}\n{stderr}");
    s.assert_no_survivors();
}

#[test]
fn a_rate_limited_node_is_slow() {
    let Some(c) = Cluster::up("cb2", 8) else {
        return;
    };
    // A slowed link: netem where the kernel has it, else a token bucket on the node's interface.
    if !c.shape(
        3,
        &[
            "netem rate 50mbit",
            "tbf rate 50mbit burst 64kbit latency 400ms",
        ],
    ) {
        return;
    }
    let s = Scene::new();
    // 50 Mbit/s is some 25x under a veth's rate here; a loaded machine has made a good pair 5x
    // slow: 0.1 tells the one from the other.
    let (code, stdout, stderr, good) =
        bisect(&s, &c, "", &["--no-python-probe", "--slow-factor", "0.1"]);
    assert_eq!(code, Some(96), "{stdout}\n{stderr}");
    only_bad(&stdout, &c.host(3), "slow");
    assert!(!good.contains(&c.host(3)), "{good}");
    s.assert_no_survivors();
}

/// The case that named a healthy node: one host of three shaped to 20 Mbit/s. The ring of all
/// three shows one slow link; only pairs with the shaped host may be slow, so the pairs are
/// tried until it alone is named, and both healthy hosts stay in --write-hostfile.
#[test]
fn one_shaped_node_of_three_is_named_alone() {
    let Some(c) = Cluster::up("cb5", 3) else {
        return;
    };
    if !c.shape(
        3,
        &[
            "netem rate 20mbit",
            "tbf rate 20mbit burst 64kbit latency 400ms",
        ],
    ) {
        return;
    }
    let s = Scene::new();
    let (code, stdout, stderr, good) = bisect(&s, &c, "", &["--no-python-probe"]);
    assert_eq!(code, Some(96), "{stdout}\n{stderr}");
    only_bad_of(&stdout, 3, &c.host(3), "slow");
    assert!(!stdout.contains("too few"), "{stdout}");
    let mut kept: Vec<&str> = good.lines().collect();
    kept.sort();
    assert_eq!(kept, vec![c.host(1), c.host(2)], "{good}");
    s.assert_no_survivors();
}

#[test]
fn a_node_whose_torch_differs_is_named() {
    let Some(c) = Cluster::up("cb3", 8) else {
        return;
    };
    let s = Scene::new();
    // A stand-in Python answering the facts probe: torch differs on host 6 only.
    let py = s.dir.path().join("python3");
    std::fs::write(&py, format!("#!/bin/sh\nif [ \"$(hostname)\" = {} ]; then echo 2.14.0; else echo 2.15.0; fi\necho 13.2\necho 2.30.7\n", c.host(6))).unwrap();
    Command::new("chmod")
        .args(["+x", py.to_str().unwrap()])
        .status()
        .unwrap();
    let (code, stdout, stderr, good) = bisect(
        &s,
        &c,
        "",
        // Not a slowness case: only a group 100x slow counts (load makes good pairs slow).
        &["--python", py.to_str().unwrap(), "--slow-factor", "0.01"],
    );
    assert_eq!(code, Some(96), "{stdout}\n{stderr}");
    only_bad(&stdout, &c.host(6), "bad");
    assert!(
        stdout.contains(
            "facts differ: NCCL - / torch 2.14.0 here, NCCL - / torch 2.15.0 on the other nodes"
        ),
        "{stdout}"
    );
    assert!(!good.contains(&c.host(6)), "{good}");
    s.assert_no_survivors();
}

#[test]
fn an_unreachable_host_is_named_with_sshs_error() {
    let Some(c) = Cluster::up("cb4", 7) else {
        return;
    };
    let s = Scene::new();
    let (code, stdout, stderr, good) = bisect(
        &s,
        &c,
        "cb4-ghost\n",
        // Not a slowness case: only a group 100x slow counts (load makes good pairs slow).
        &["--no-python-probe", "--slow-factor", "0.01"],
    );
    assert_eq!(code, Some(96), "{stdout}\n{stderr}");
    only_bad(&stdout, "cb4-ghost", "unreachable");
    assert!(
        stdout.contains("Could not resolve hostname cb4-ghost"),
        "{stdout}"
    );
    assert_eq!(good.lines().count(), 7, "{good}");
    s.assert_no_survivors();
}
