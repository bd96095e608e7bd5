//! Progress of long work as a user sees it (issue 37 item 4, issue 38 item 4): plain lines
//! when stderr is piped, a live bar on a real pseudo-terminal that ends in one clean line, plain
//! lines on a terminal under NO_COLOR or TERM=dumb, and a "still waiting" line that names what
//! is waited for and the deadline for a wait past 5 s.

mod common;

use common::setup::{c10d_args, net_preflight_args};
use common::*;

/// A c10d host of 2 nodes whose second node is not started (yet): the join waits.
fn c10d_host(endpoint: &str, timeout: &str) -> Vec<String> {
    let mut args = c10d_args(endpoint, "progress", timeout);
    args.extend(["--no-python", "true"]);
    args.into_iter().map(String::from).collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Piped: once the host waited 5 s it says for whom and until when, and the job goes on when
/// the late node comes.
#[test]
fn a_c10d_host_says_who_it_waits_for_and_until_when() {
    let s = Scene::new();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let args = c10d_host(&endpoint, "120");
    let host = Watched::new(s.spawn(&strs(&args), &[]));
    host.wait_stderr("joining nodes: still waiting for node1 (joined: ");
    let line = host
        .stderr()
        .lines()
        .find(|l| l.contains("still waiting for node1"))
        .unwrap()
        .to_string();
    assert!(line.starts_with("nrun: joining nodes: still waiting for node1 (joined: "));
    assert!(line.contains(" after 5 s; deadline "), "{line}");
    // The deadline is --join-timeout from the start: 115 s are left, give or take a second.
    let left: u64 = line
        .rsplit("(in ")
        .next()
        .and_then(|t| t.strip_suffix(" s)"))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!((110..=116).contains(&left), "{line}");
    // The late node joins: the wait ends and the job runs.
    let late = s.run(&strs(&args), &[]);
    assert_eq!(late.status.code(), Some(0), "{}", text(&late.stderr));
    let (out, _) = host.finish();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("2/2 nodes joined in"), "{err}");
    // No bar drawn into a pipe.
    assert!(!err.contains('\u{1b}') && !err.contains('\r'), "{err:?}");
}

/// What the terminal showed, and the exit code.
fn on_terminal(s: &Scene, args: &[String], env: &[(&str, &str)]) -> (String, i64) {
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(py_script("pty_drive.py"));
    cmd.arg("--").arg(nrun_bin()).args(args);
    cmd.env("NRUN_TEST_TAG", &s.tag)
        .env_remove("NO_COLOR")
        .env_remove("NRUN_LOG")
        .env("TERM", "xterm")
        .envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("pty_drive: {e}: {}", text(&out.stderr)));
    let shown = v["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c[1].as_str().unwrap().to_string())
        .collect();
    (shown, v["status"].as_i64().unwrap())
}

fn has_python_pty() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import pty"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        cannot_set_up("no python3 with the pty module (it drives the terminal)");
    }
    ok
}

/// On a terminal: a live bar that says whom it waits for and the deadline, redrawn in place,
/// cleared at the end, and one clean line after it.
#[test]
fn on_a_terminal_the_join_is_a_live_bar_then_one_clean_line() {
    if !has_python_pty() {
        return;
    }
    let s = Scene::new();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let (shown, status) = on_terminal(&s, &c10d_host(&endpoint, "6"), &[]);
    assert_eq!(status, 95, "{shown:?}");
    assert!(shown.contains("nrun: joining nodes "), "{shown:?}");
    assert!(shown.contains(" 1/2 "), "{shown:?}");
    assert!(
        shown.contains("waiting for node1 (joined: ") && shown.contains("; deadline "),
        "{shown:?}"
    );
    // Drawn in place (cleared and redrawn), not a line per change.
    assert!(shown.matches("\u{1b}[2K").count() >= 2, "{shown:?}");
    assert!(!shown.contains("still waiting"), "{shown:?}");
    // The last draw is cleared and the final line stands alone on its line.
    let (bar, after) = shown.split_once("nrun: 1/2 nodes joined in").unwrap();
    assert!(
        bar.ends_with("\u{1b}[2K") || bar.ends_with("\u{1b}[1A"),
        "{bar:?}"
    );
    assert!(!after.contains("joining nodes"), "{after:?}");
    let final_line = after.split("\r\n").next().unwrap();
    assert!(final_line.ends_with(" s"), "{after:?}");
}

/// NO_COLOR or TERM=dumb: plain lines on a terminal too, the wait said as when piped.
#[test]
fn no_color_and_a_dumb_term_give_plain_lines() {
    if !has_python_pty() {
        return;
    }
    let s = Scene::new();
    for env in [("NO_COLOR", "1"), ("TERM", "dumb")] {
        let endpoint = format!("127.0.0.1:{}", free_port());
        let (shown, status) = on_terminal(&s, &c10d_host(&endpoint, "7"), &[env]);
        assert_eq!(status, 95, "{env:?}: {shown:?}");
        assert!(
            shown.contains("\r\nnrun: joining nodes: still waiting for node1 (joined: ")
                || shown.starts_with("nrun: joining nodes: still waiting for node1 (joined: "),
            "{env:?}: {shown:?}"
        );
        assert!(
            shown.contains(" after 5 s; deadline "),
            "{env:?}: {shown:?}"
        );
        assert!(
            !shown.contains('\u{1b}') && !shown.contains('█'),
            "{env:?}: {shown:?}"
        );
        assert!(
            shown.contains("nrun: 1/2 nodes joined in"),
            "{env:?}: {shown:?}"
        );
    }
}

/// The preflight's sweep: each size's line as rank 0 measured it, in order, besides the table
/// at the end (the TCP ring on 3 real ranks; the NCCL sweep publishes the same way). With
/// --preflight-only every size is said (before a job, once the sweep took 2 s).
#[test]
fn the_preflight_says_each_size_as_it_is_measured() {
    let s = Scene::new();
    let out = s.run(&net_preflight_args(), &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let sizes = [
        "8 B", "32 B", "128 B", "512 B", "2 KiB", "8 KiB", "32 KiB", "128 KiB", "512 KiB",
    ];
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("nrun: preflight ") && l.contains(" wrong (rank 0)"))
        .collect();
    assert_eq!(lines.len(), sizes.len(), "{err}");
    for (i, (l, size)) in lines.iter().zip(sizes).enumerate() {
        let head = format!("nrun: preflight {}/9: {size}: busbw ", i + 1);
        assert!(l.starts_with(&head), "{l}\n{err}");
        assert!(l.ends_with(" GB/s, 0 wrong (rank 0)"), "{l}");
    }
    assert!(text(&out.stdout).contains("preflight ok: busbw "));
}

/// Bisect says each round as it starts (which of how many, on which nodes), then its verdicts:
/// three nodes of this host (loopback addresses), the TCP ring probe.
#[test]
fn bisect_says_its_rounds() {
    let s = Scene::new();
    let out = s.run(
        &[
            "bisect",
            "-H",
            "127.0.0.1,127.0.0.2,127.0.0.3",
            "--probe",
            "net",
            "--nproc",
            "1",
            "--preflight-sizes",
            "8:64K:4",
            "--iters",
            "2",
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}\n{}", text(&out.stdout));
    let r1 = "nrun: bisect round 1 of at least 2 (stage 1: every node alone): 3 group(s) on 3 \
              node(s): 127.0.0.1, 127.0.0.2, 127.0.0.3\n";
    let r2 = "nrun: bisect round 2 of at least 2 (stage: all 3 nodes): 1 group(s) on 3 node(s): \
              127.0.0.1+127.0.0.2+127.0.0.3\n";
    let (a, b) = (err.find(r1), err.find(r2));
    assert!(a.is_some() && b.is_some(), "{err}");
    // Each round's verdicts follow it.
    let v1 = err
        .find("nrun bisect: stage 1: every node alone: 127.0.0.1 ok")
        .unwrap();
    let v2 = err
        .find("nrun bisect: stage: all 3 nodes: 127.0.0.1+127.0.0.2+127.0.0.3 ok")
        .unwrap();
    assert!(a < Some(v1) && Some(v1) < b && b < Some(v2), "{err}");
}

/// ssh connects and --ship copies that hang (an `ssh` that never answers: a stand-in on PATH,
/// so no timeout of the real ssh can end the wait before the line) name the hosts waited for
/// once 5 s passed; SIGTERM then ends nrun at once.
#[test]
fn slow_ssh_connects_and_copies_name_their_hosts() {
    let s = Scene::new();
    let bin = s.dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let ssh = bin.join("ssh");
    std::fs::write(&ssh, "#!/bin/sh\nexec sleep 600\n").unwrap();
    std::fs::set_permissions(&ssh, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for (ship, line) in [
        (
            false,
            "nrun: joining nodes: still waiting for nohost-a.invalid, nohost-b.invalid after 5 s; \
             deadline ",
        ),
        (
            true,
            "nrun: shipping nrun: still waiting for the copies to nohost-a.invalid, \
             nohost-b.invalid after 5 s",
        ),
    ] {
        let mut args = vec![
            "-H",
            "nohost-a.invalid,nohost-b.invalid",
            "--no-python-probe",
            "--no-python",
            "true",
        ];
        if ship {
            args.insert(0, "--ship");
        }
        let nrun = Watched::new(s.spawn(&args, &[("PATH", path.as_str())]));
        nrun.wait_stderr(line);
        signal(nrun.child(), "TERM");
        let (out, _) = nrun.finish();
        assert_eq!(out.status.code(), Some(128 + 15), "{}", text(&out.stderr));
    }
    s.assert_no_survivors();
}
