//! A node lost mid-run comes back (issue 48, item 2), on a real cluster of network-namespace
//! hosts (real sshd, real iptables): cut off, it is left out and a spare takes its place; opened
//! again, nrun's background tries start its agent again, it passes the checks and waits as a
//! spare; the job ends 0, --exclude-file does not list it, --report says it came back, and
//! nothing is left running. (An elastic job growing back with it is the fault matrix's row
//! "node2 cut off and back", tests/faults.rs.)

mod common;

use std::time::Duration;

use common::*;

/// A hung run fails the test instead of stalling it.
const GUARD: Duration = Duration::from_secs(150);

#[test]
fn a_node_cut_off_and_opened_again_comes_back_as_a_spare() {
    let Some(c) = Cluster::up("cb1", 3) else {
        return;
    };
    if !need_tool("iptables", "iptables") {
        return;
    }
    let s = Scene::new();
    let report = s.dir.path().join("report.json");
    let events = s.dir.path().join("events.jsonl");
    let exclude = s.dir.path().join("exclude");
    let release = s.dir.path().join("release");
    // Each rank marks its start, then runs until the test releases it (every node shares this
    // machine's files).
    let worker = format!(
        "echo \"started rank=$RANK attempt=$TORCHELASTIC_RESTART_COUNT host=$(ip netns identify)\" \
         >> \"$MARK\"; while [ ! -e {} ]; do sleep 0.1; done; \
         echo \"done rank=$RANK world=$WORLD_SIZE\"",
        release.display()
    );
    let (report_s, events_s, exclude_s) = (
        report.display().to_string(),
        events.display().to_string(),
        exclude.display().to_string(),
    );
    // Three hosts for two nodes: the third is a spare.
    let child = c.spawn_on(
        &s,
        3,
        &[
            "--nnodes",
            "2",
            "--nproc",
            "1",
            "--max-restarts",
            "1",
            "--no-preflight",
            "--report",
            &report_s,
            "--events",
            &events_s,
            "--exclude-file",
            &exclude_s,
            "--no-python",
            "sh",
            "-c",
            &worker,
        ],
        &[],
    );
    let started = |attempt: usize, n: usize| {
        let want = format!("attempt={attempt}");
        wait_until_within(
            &format!("{n} ranks of attempt {attempt} to start"),
            GUARD,
            || {
                s.marks()
                    .iter()
                    .filter(|l| l.starts_with("started") && l.contains(&want))
                    .count()
                    >= n
            },
        );
    };
    started(0, 2);
    let h2 = c.host(2);
    c.exec(
        2,
        "iptables -A INPUT -i lo -j ACCEPT && iptables -A INPUT -j DROP && \
         iptables -A OUTPUT -o lo -j ACCEPT && iptables -A OUTPUT -j DROP",
    );
    // The spare took node2's place: then node2 is opened again.
    started(1, 2);
    let on_spare = s
        .marks()
        .iter()
        .any(|l| l.contains("attempt=1") && l.ends_with(&c.host(3)));
    c.exec(2, "iptables -F INPUT && iptables -F OUTPUT");
    let opened = std::time::Instant::now();
    wait_until_within("node2 to come back (a node_back event)", GUARD, || {
        std::fs::read_to_string(&events)
            .unwrap_or_default()
            .lines()
            .any(|l| l.contains("\"name\":\"node_back\"") && l.contains(&h2))
    });
    // How long nrun took to take it back once it could (the tries' 2 s first wait included).
    eprintln!(
        "comeback: opened -> node_back {:.2} s",
        opened.elapsed().as_secs_f64()
    );
    std::fs::write(&release, "").unwrap();
    let (out, _) = wait_with_timeout(child, GUARD);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    let ctx = format!("--- stdout\n{stdout}\n--- stderr\n{stderr}");
    assert_eq!(out.status.code(), Some(0), "{ctx}");
    assert!(on_spare, "the spare ran in node2's place: {:?}", s.marks());
    // Said with why: how long it was out, how it was lost, what it is now.
    let said = stderr
        .lines()
        .find(|l| l.contains(&format!("{h2} answers again (lost ")))
        .unwrap_or_else(|| panic!("no line says {h2} came back\n{ctx}"));
    assert!(said.contains("its heartbeat stopped"), "{said}");
    assert!(
        said.ends_with("it passed the checks and is a spare now"),
        "{said}"
    );
    for rank in 0..2 {
        let done = format!("done rank={rank} world=2");
        assert!(stdout.contains(&done), "missing {done:?}\n{ctx}");
    }
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let nodes = &r["nodes"];
    assert_eq!(nodes["left_out"], serde_json::json!([]), "{nodes}");
    assert_eq!(nodes["came_back"][0]["host"], h2.as_str(), "{nodes}");
    assert!(
        nodes["came_back"][0]["why"]
            .as_str()
            .is_some_and(|w| w.contains("no heartbeat")),
        "{nodes}"
    );
    assert_eq!(nodes["spares"], serde_json::json!([h2]), "{nodes}");
    assert_eq!(r["job"]["restarts"], 1, "{}", r["job"]);
    // The event carries the same: lost some seconds before, as a spare.
    let back = r["events"]
        .as_array()
        .and_then(|v| v.iter().find(|e| e["name"] == "node_back"))
        .unwrap_or_else(|| panic!("no node_back event: {}", r["events"]));
    assert_eq!(back["host"], h2.as_str(), "{back}");
    assert_eq!(back["metadata"]["now"], "spare", "{back}");
    assert!(
        back["metadata"]["lost_s"].as_f64().is_some_and(|s| s > 0.0),
        "{back}"
    );
    // A node that came back is not remembered against.
    let listed = std::fs::read_to_string(&exclude).unwrap_or_default();
    assert!(
        !listed
            .lines()
            .any(|l| !l.starts_with('#') && l.starts_with(&h2)),
        "--exclude-file lists {h2}:\n{listed}"
    );
    s.assert_no_survivors();
    c.assert_nothing_left(3);
}

/// An elastic job (`--nnodes 1:2`) whose node's agent is killed (its host up, its sshd
/// answering) goes on with one node; the agent started again joins within a try or two and
/// grows the job back to two nodes (the group restarts, no restart counted). The node that
/// came back is named like any other: its rank's failure in the grown group is said on its
/// host, and the restart in place that follows ends the job 0.
#[test]
fn an_elastic_job_grows_back_with_a_node_whose_agent_was_killed() {
    let Some(c) = Cluster::up("cb2", 2) else {
        return;
    };
    let s = Scene::new();
    let report = s.dir.path().join("report.json");
    let report_s = report.display().to_string();
    // Attempt 0 and the shrunk group wait; in the grown one (restart 1, both nodes) rank 1
    // fails once; the restart after it ends.
    let worker = "a=$TORCHELASTIC_RESTART_COUNT; \
         echo \"started rank=$RANK attempt=$a world=$WORLD_SIZE\" >> \"$MARK\"; \
         if [ $a = 0 ] || [ $WORLD_SIZE = 1 ]; then exec sleep 600; fi; \
         if [ $a = 1 ] && [ $RANK = 1 ]; then echo 'rank 1 fails once' >&2; exit 1; fi; \
         [ $a = 1 ] && exec sleep 600; \
         echo \"done rank=$RANK attempt=$a world=$WORLD_SIZE\"";
    let child = c.spawn_on(
        &s,
        2,
        &[
            "--nnodes",
            "1:2",
            "--nproc",
            "1",
            "--max-restarts",
            "2",
            "--no-preflight",
            "--report",
            &report_s,
            "--no-python",
            "sh",
            "-c",
            worker,
        ],
        &[],
    );
    let started = |attempt: usize, world: usize, n: usize| {
        let want = format!("attempt={attempt} world={world}");
        wait_until_within(&format!("{n} x {want}"), GUARD, || {
            s.marks().iter().filter(|l| l.ends_with(&want)).count() >= n
        });
    };
    started(0, 2, 2);
    let killed = std::time::Instant::now();
    assert!(c.kill_agents(2), "no agent on node2");
    // From the kill to the grown group's start (the node lost, the job shrunk, the node's
    // agent started again after 2 s, checked, the group restarted with it).
    started(1, 2, 2);
    eprintln!(
        "comeback: agent killed -> grown group started {:.2} s",
        killed.elapsed().as_secs_f64()
    );
    let (out, _) = wait_with_timeout(child, GUARD);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    let ctx = format!(
        "--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- marks {:?}",
        s.marks()
    );
    assert_eq!(out.status.code(), Some(0), "{ctx}");
    // The shrunk group ran, then the grown one.
    started(1, 1, 1);
    started(1, 2, 2);
    let h2 = c.host(2);
    let said = stderr
        .lines()
        .find(|l| l.contains(&format!("{h2} answers again (lost ")))
        .unwrap_or_else(|| panic!("no line says {h2} came back\n{ctx}"));
    assert!(
        said.ends_with("it passed the checks and grows the job to 2 nodes"),
        "{said}"
    );
    assert!(stderr.contains(&format!("rank 1 on {h2} ")), "{ctx}");
    for rank in 0..2 {
        let done = format!("done rank={rank} attempt=2 world=2");
        assert!(stdout.contains(&done), "missing {done:?}\n{ctx}");
    }
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["job"]["restarts"], 2, "{}", r["job"]);
    assert_eq!(
        r["nodes"]["came_back"][0]["host"],
        h2.as_str(),
        "{}",
        r["nodes"]
    );
    assert_eq!(
        r["nodes"]["left_out"],
        serde_json::json!([]),
        "{}",
        r["nodes"]
    );
    assert_eq!(
        r["nodes"]["ran_on"],
        serde_json::json!([c.host(1), h2]),
        "{}",
        r["nodes"]
    );
    s.assert_no_survivors();
    c.assert_nothing_left(2);
}
