//! Supervision with the real binary and misbehaving workers (tests/fixtures/worker.sh): exit
//! codes, signals, the grace period, restarts, and that nothing is left running.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

fn worker() -> String {
    fixture("worker.sh")
}

/// Two workers that ignore SIGTERM and SIGINT, under a 600 s grace period, both started.
fn stubborn_pair(s: &Scene) -> std::process::Child {
    let w = worker();
    let child = s.spawn(
        &[
            "--nproc",
            "2",
            "--shutdown-timeout",
            "600",
            "--no-python",
            "sh",
            &w,
        ],
        &[("NRUN_FIXTURE", "stubborn")],
    );
    s.wait_marks("ready", 2, HANG);
    child
}

#[test]
fn first_failure_stops_everyone_and_its_code_passes_through() {
    let s = Scene::new();
    let w = worker();
    let out = s.run(
        &["--nproc", "3", "--no-python", "sh", &w],
        &[("NRUN_FIXTURE", "fail-rank1")],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(
        err.contains("rank 1 of 3 exited with code 7 (first failure"),
        "{err}"
    );
    assert!(
        err.contains("| rank1 is about to fail"),
        "stderr tail missing: {err}"
    );
    assert!(
        err.contains("pid:") && err.contains("time:") && err.contains("host:"),
        "{err}"
    );
    s.assert_no_survivors();
}

#[test]
fn death_by_signal_is_128_plus_n() {
    let s = Scene::new();
    let w = worker();
    let out = s.run(
        &["--nproc", "2", "--no-python", "sh", &w],
        &[("NRUN_FIXTURE", "segv-rank0")],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 11), "{err}");
    assert!(err.contains("rank 0 of 2 was killed by SIGSEGV"), "{err}");
    s.assert_no_survivors();
}

fn forwarded(sig: &str, seen: &str, code: i32) {
    let s = Scene::new();
    let w = worker();
    let child = s.spawn(
        &["--nproc", "3", "--no-python", "sh", &w],
        &[("NRUN_FIXTURE", "trap")],
    );
    s.wait_marks("ready", 3, Duration::from_secs(10));
    signal(&child, sig);
    let (out, _) = wait_with_timeout(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
    for r in 0..3 {
        let line = format!("rank {r} got {seen}");
        assert!(s.marks().contains(&line), "{line} missing: {:?}", s.marks());
    }
    s.assert_no_survivors();
}

#[test]
fn sigterm_reaches_every_worker() {
    forwarded("TERM", "TERM", 143);
}

#[test]
fn sigint_reaches_every_worker() {
    forwarded("INT", "INT", 130);
}

#[test]
fn sighup_stops_every_worker() {
    // SIGHUP is forwarded as such; the fixture has no HUP trap, so the shell dies of it.
    let s = Scene::new();
    let w = worker();
    let child = s.spawn(
        &["--nproc", "2", "--no-python", "sh", &w],
        &[("NRUN_FIXTURE", "sleep")],
    );
    s.wait_marks("ready", 2, Duration::from_secs(10));
    signal(&child, "HUP");
    let (out, _) = wait_with_timeout(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(129), "{}", text(&out.stderr));
    s.assert_no_survivors();
}

#[test]
fn workers_ignoring_sigterm_are_killed_after_the_grace_period() {
    let s = Scene::new();
    let w = worker();
    let child = s.spawn(
        &[
            "--nproc",
            "3",
            "--shutdown-timeout",
            "1",
            "--no-python",
            "sh",
            &w,
        ],
        &[("NRUN_FIXTURE", "stubborn"), ("FAIL_RANK0", "1")],
    );
    let (out, _) = wait_with_timeout(child, Duration::from_secs(15));
    let ended = std::time::SystemTime::now();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    // The others got SIGTERM (their trap says so) and outlived it: SIGKILL only after the
    // grace period, counted from rank 0's failure (a lower bound: load only adds to it).
    for r in 1..3 {
        let line = format!("rank {r} ignored TERM");
        assert!(s.marks().contains(&line), "{line}: {:?}", s.marks());
    }
    let failed_at: u64 = s
        .marks()
        .iter()
        .find_map(|l| l.strip_prefix("rank 0 fails at ")?.parse().ok())
        .expect("rank 0 said when it failed");
    let failed_at = std::time::UNIX_EPOCH + Duration::from_nanos(failed_at);
    let lived = ended.duration_since(failed_at).unwrap_or_default();
    assert!(
        lived >= Duration::from_secs(1),
        "SIGKILL came before the grace period: {lived:?} after the failure"
    );
    s.assert_no_survivors();
}

/// A grace period is not waited through in silence: past 5 s nrun says which ranks it waits
/// for after which signal, how long more, and what comes next; a second signal ends it.
#[test]
fn a_long_grace_period_says_what_it_waits_for() {
    let s = Scene::new();
    let child = Watched::new(stubborn_pair(&s));
    signal(child.child(), "TERM");
    child.wait_stderr("still running 5 s after SIGTERM; nrun waits up to ");
    let err = child.stderr();
    assert!(
        err.contains(": rank(s) 0, 1 still running 5 s after SIGTERM"),
        "{err}"
    );
    assert!(err.contains("then sends SIGKILL"), "{err}");
    signal(child.child(), "TERM");
    let (out, _) = child.finish();
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    s.assert_no_survivors();
}

#[test]
fn second_ctrl_c_kills_at_once() {
    let s = Scene::new();
    let child = stubborn_pair(&s);
    signal(&child, "INT");
    // The first was passed on (both workers ignored it): the next one is a second Ctrl-C, not
    // a copy of the first still pending.
    s.wait_marks("rank 0 ignored INT", 1, HANG);
    s.wait_marks("rank 1 ignored INT", 1, HANG);
    signal(&child, "INT");
    // Within the hang guard, far under the 600 s grace the first began: killed at once.
    let (out, _) = wait_with_timeout(child, HANG);
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    s.assert_no_survivors();
}

#[test]
fn background_grandchildren_do_not_outlive_the_job() {
    for code in ["0", "5"] {
        let s = Scene::new();
        let w = worker();
        let out = s.run(
            &["--nproc", "2", "--no-python", "sh", &w],
            &[("NRUN_FIXTURE", "grandchildren"), ("EXIT_CODE", code)],
        );
        assert_eq!(
            out.status.code(),
            Some(code.parse().unwrap()),
            "{}",
            text(&out.stderr)
        );
        // With a failure, the other rank may be stopped before it spawns anything.
        let spawned = s.marks().len();
        assert!(
            if code == "0" {
                spawned == 2
            } else {
                spawned >= 1
            },
            "{:?}",
            s.marks()
        );
        assert!(
            text(&out.stderr).contains("left processes running"),
            "{}",
            text(&out.stderr)
        );
        s.assert_no_survivors();
    }
}

#[test]
fn killed_launcher_takes_its_workers_along() {
    let s = Scene::new();
    let w = worker();
    let child = s.spawn(
        &["--nproc", "3", "--no-python", "sh", &w],
        &[("NRUN_FIXTURE", "sleep")],
    );
    s.wait_marks("ready", 3, Duration::from_secs(10));
    signal(&child, "KILL");
    let _ = wait_with_timeout(child, Duration::from_secs(5));
    s.assert_no_survivors();
}

#[test]
fn restarts_run_the_whole_group_again() {
    let s = Scene::new();
    let w = worker();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--max-restarts",
            "2",
            "--no-python",
            "sh",
            &w,
        ],
        &[("NRUN_FIXTURE", "restart"), ("SUCCEED_AT", "2")],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    for a in 0..3 {
        for r in 0..2 {
            assert!(
                s.marks().contains(&format!("rank {r} attempt {a}")),
                "{:?}",
                s.marks()
            );
        }
    }
    assert_eq!(
        err.matches("restarting the worker group").count(),
        2,
        "{err}"
    );

    // Out of restarts: the last failure's code.
    let s = Scene::new();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            "--no-python",
            "sh",
            &w,
        ],
        &[("NRUN_FIXTURE", "restart")],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(s.marks().contains(&"rank 1 attempt 1".to_string()));
    s.assert_no_survivors();
}

/// `kill -9` of nrun leaves nothing, not even what its workers started (same process group or
/// after setsid): the keeper (the pid the user sees) and nrun each clean up after the other.
#[test]
fn kill_9_leaves_no_grandchildren() {
    // The launcher the user started (the keeper): nrun stops everything when it goes.
    let s = Scene::new();
    let w = worker();
    let child = s.spawn(
        &[
            "--nproc",
            "2",
            "--shutdown-timeout",
            "2",
            "--no-python",
            "sh",
            &w,
        ],
        &[("NRUN_FIXTURE", "grandchildren-stay")],
    );
    s.wait_marks("ready", 2, Duration::from_secs(10));
    signal(&child, "KILL");
    let _ = wait_with_timeout(child, Duration::from_secs(5));
    s.assert_no_survivors();

    // nrun itself (the keeper's child): the keeper kills what is left and dies as nrun did.
    let s = Scene::new();
    let child = s.spawn(
        &["--nproc", "2", "--no-python", "sh", &w],
        &[("NRUN_FIXTURE", "grandchildren-stay")],
    );
    s.wait_marks("ready", 2, Duration::from_secs(10));
    let nrun: i32 = nrun_under(child.id()).parse().unwrap();
    // Its scratch directory (the workers' error files) goes with it.
    let scratch = scratch_of(nrun as u32).expect("nrun's scratch directory");
    assert!(scratch.exists(), "{}", scratch.display());
    signal_pid(&nrun.to_string(), "KILL");
    // The keeper ends (or the wait's hang guard says it did not).
    let (out, _) = wait_with_timeout(child, HANG);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(9), "the keeper dies as nrun did");
    s.assert_no_survivors();
    assert!(!scratch.exists(), "{} left behind", scratch.display());
}

#[test]
fn the_launchers_error_file_gets_the_root_cause() {
    let s = Scene::new();
    let launcher = s.dir.path().join("launcher-error.json");
    let launcher_s = launcher.display().to_string();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            "[ $RANK = 1 ] && { echo boom >&2; exit 3; }; sleep 5",
        ],
        &[("TORCHELASTIC_ERROR_FILE", &launcher_s)],
    );
    assert_eq!(out.status.code(), Some(3));
    let err = text(&out.stderr);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&launcher).unwrap()).unwrap();
    assert_eq!(v["message"]["errorCode"], 3, "{v}");
    assert!(
        v["message"]["extraInfo"]["py_callstack"]
            .as_str()
            .unwrap()
            .contains("boom"),
        "{v}"
    );
    assert!(
        v["message"]["message"]
            .as_str()
            .unwrap()
            .contains("rank 1 (local rank 1)"),
        "{v}"
    );
    // No scratch path is named in the summary: it is gone once nrun exits.
    assert!(!err.contains("/nrun-"), "{err}");
}

#[test]
fn a_python_without_torch_gets_a_hint() {
    let has_torch = std::process::Command::new("python3")
        .args(["-c", "import torch"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|st| st.success());
    if has_torch {
        cannot_set_up("python3 here has torch: the scenario is a python without it");
        return;
    }
    let s = Scene::new();
    let script = s.dir.path().join("t.py");
    std::fs::write(&script, "import torch\n").unwrap();
    let out = s.run(
        &[
            "--python",
            "python3",
            "--watch",
            "off",
            script.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("python3 has no torch: pass --python PATH (or set PYTHON_EXEC)"),
        "{err}"
    );
}

/// The --log-dir filesystem fills up mid-job: the failed write is said once per file, the
/// console takes the output from there (nothing more is lost), and the end says which files
/// are incomplete.
#[test]
fn a_full_log_filesystem_is_said_and_the_console_keeps_the_output() {
    if !need_root("a small tmpfs for the logs (mount)") {
        return;
    }
    let s = Scene::new();
    let dir = tempfile::tempdir().unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(dir.path())
        .status()
        .is_ok_and(|st| st.success());
    if !mounted {
        cannot_set_up("no tmpfs could be mounted for the logs (mount -t tmpfs)");
        return;
    }
    let logs = dir.path().to_str().unwrap();
    let out = s.run(
        &[
            "--nproc",
            "1",
            "--log-dir",
            logs,
            "--redirects",
            "3",
            "--no-python",
            "sh",
            "-c",
            "i=0; while [ $i -lt 3000 ]; do echo line-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; \
             i=$((i+1)); done; echo END",
        ],
        &[],
    );
    let _ = Command::new("umount").arg(dir.path()).status();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(stderr.matches("cannot write").count(), 1, "{stderr}");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert!(stderr.contains("stdout.log"), "{stderr}");
    assert!(
        stderr.contains("1 log file(s) of this group are incomplete"),
        "{stderr}"
    );
    assert!(
        stdout.contains("line-2999-") && stdout.ends_with("END\n"),
        "{stdout}"
    );
    s.assert_no_survivors();
}

/// SIGTERM while agents are still being started (here: --ship copying to hosts that never
/// answer) ends nrun at once, with nothing left behind.
#[test]
fn sigterm_while_agents_start_is_honoured_at_once() {
    if !need_tool("ssh", "openssh-client") {
        return;
    }
    let s = Scene::new();
    let child = s.spawn(
        &[
            "-H",
            "nohost-a.invalid,nohost-b.invalid",
            "--ship",
            "--ssh-opts",
            "-o ProxyCommand=sleep\\ 100",
            "--no-python",
            "true",
        ],
        &[],
    );
    // While agents start: ssh waits on its proxy (nrun has its signals in hand by then).
    wait_until("ssh's proxy command to run", || {
        s.survivors().iter().any(|p| p.contains(": sleep 100"))
    });
    signal(&child, "TERM");
    let (out, _) = wait_with_timeout(child, HANG);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 15), "{err}");
    assert!(err.contains("interrupted while starting"), "{err}");
    // At once: not after ssh gave up on the hosts by itself (its ConnectTimeout), which would
    // have had its say. (How fast is a benchmark's matter, not a test's.)
    assert!(
        !err.contains("banner exchange") && !err.contains("timed out"),
        "{err}"
    );
    s.assert_no_survivors();
}

/// `kill -9` of the keeper and nrun at once (as `kill -9` of both pids does): neither can clean
/// up, and what the workers left (own process group, setsid, double fork) is killed by the watch.
#[test]
fn kill_9_of_keeper_and_nrun_at_once_leaves_nothing() {
    let s = Scene::new();
    let w = worker();
    let child = s.spawn(
        &["--nproc", "2", "--no-python", "sh", &w],
        &[("NRUN_FIXTURE", "grandchildren-stay")],
    );
    s.wait_marks("ready", 2, Duration::from_secs(10));
    let st = Command::new("kill")
        .args(["-KILL", &child.id().to_string(), &nrun_under(child.id())])
        .status()
        .unwrap();
    assert!(st.success());
    let _ = wait_with_timeout(child, Duration::from_secs(5));
    s.assert_no_survivors();
}

/// The real nrun under the keeper `keeper`: its child that is not the watch (the watch leads a
/// session of its own).
fn nrun_under(keeper: u32) -> String {
    let kids = std::fs::read_to_string(format!("/proc/{keeper}/task/{keeper}/children"))
        .unwrap_or_default();
    let nrun: Vec<&str> = kids
        .split_whitespace()
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // After the command's closing parenthesis: state, ppid, pgrp, session.
            let session = stat
                .rsplit_once(") ")
                .map(|(_, r)| r.split(' ').nth(3).unwrap_or("").to_string());
            session.as_deref() != Some(*p)
        })
        .collect();
    assert_eq!(nrun.len(), 1, "the keeper's children: {kids}");
    nrun[0].to_string()
}

/// SIGTERM while a thousand workers are being started: no more start, those started stop, and
/// nrun ends within a couple of seconds.
#[test]
fn sigterm_while_workers_start_is_honoured_at_once() {
    let s = Scene::new();
    let child = s.spawn(&["--nproc", "1000", "--no-python", "sleep", "60"], &[]);
    // The starting has begun: a first worker runs.
    wait_until("a first worker to start", || {
        s.survivors().iter().any(|p| p.ends_with(": sleep 60 "))
    });
    signal(&child, "TERM");
    // Ends (within the hang guard, far under the workers' 60 s), as interrupted, with nothing
    // left; how fast is BENCHMARKS' matter.
    let (out, _) = wait_with_timeout(child, HANG);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 15), "{err}");
    s.assert_no_survivors();
}

/// An agent nrun starts on its own host is spawned with nothing of nrun's run between fork and
/// exec: it sets its own parent-death signal from NRUN_AGENT_PARENT, so it dies with
/// whatever started it even with its stdin still open and no keeper or watch of that launcher
/// to clean up; started under another parent than it was told, it exits at once.
#[test]
fn a_local_agent_dies_with_its_launcher_by_itself() {
    use std::io::BufRead;
    let s = Scene::new();
    let mut sh = Command::new("sh")
        // A background command's stdin would be /dev/null: the test's pipe goes by fd 3.
        .args([
            "-c",
            "exec 3<&0; NRUN_AGENT_PARENT=$$ \"$0\" __agent <&3 3<&- & echo $!; wait",
        ])
        .arg(nrun_bin())
        .env("NRUN_TEST_TAG", &s.tag)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(sh.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let agent: u32 = line.trim().parse().unwrap();
    // Forked by the shell; once it runs nrun, it waits for its instructions.
    wait_until("the agent to exec nrun", || {
        std::fs::read(format!("/proc/{agent}/cmdline"))
            .is_ok_and(|c| c.split(|b| *b == 0).nth(1) == Some(b"__agent"))
    });
    let st = proc_stat(agent).expect("the agent runs, waiting for its instructions");
    let ppid: u32 = st.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(ppid, sh.id(), "its parent is the one it was told: {st}");
    assert!(!st.starts_with('Z'), "{st}");
    signal(&sh, "KILL");
    let _ = sh.wait();
    wait_until("the agent to die with its parent", || {
        proc_stat(agent).is_none_or(|st| st.starts_with('Z'))
    });
    // Told of a parent it does not have (its launcher died before it could set the signal).
    let out = Command::new(nrun_bin())
        .arg("__agent")
        .env("NRUN_AGENT_PARENT", "1")
        .stdin(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(128 + 9));
    s.assert_no_survivors();
}

/// An agent on nrun's own host is forked by the spawner, no exec: it must be what an exec'd
/// `nrun __agent` was. Each worker reports on its agent (its parent): it reads `nrun __agent`
/// in ps and is named nrun, its parent is the spawner, it holds none of the spawner's
/// descriptors (its socket to nrun), and the workers get the open-file limit nrun started
/// with (nrun raises its own to the hard limit). In a launch tree (more nodes than
/// --tree-width) the inner agents fork theirs the same way, from spawners of their own.
#[test]
fn a_local_agent_is_forked_as_an_execd_one_would_be() {
    use std::os::unix::process::CommandExt;
    let s = Scene::new();
    let report = concat!(
        r#"a=$PPID; sp=$(awk '{print $4}' /proc/$a/stat); sock=$(readlink /proc/$sp/fd/3); "#,
        r#"leak=no; for f in /proc/$a/fd/*; do [ "$(readlink $f)" = "$sock" ] && leak=yes; done; "#,
        r#"echo "agent-$RANK [$(tr '\0' ' ' < /proc/$a/cmdline | sed 's/ *$//')] $(cat /proc/$a/comm) "#,
        r#"parent=$(cat /proc/$sp/comm) leak=$leak nofile=$(ulimit -Sn)""#
    );
    let mut c = s.cmd(&[
        "-H",
        "localhost,127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5",
        "--tree-width",
        "2",
        "--nproc",
        "1",
        "--no-python",
        "sh",
        "-c",
        report,
    ]);
    // SAFETY: setrlimit between fork and exec, with a limit on the stack.
    unsafe {
        c.pre_exec(|| {
            let mut l: libc::rlimit = std::mem::zeroed();
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
            l.rlim_cur = 900.min(l.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            Ok(())
        });
    }
    let out = c.output().unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for r in 0..5 {
        let want = format!("agent-{r} [nrun __agent] nrun parent=nrun-spawner leak=no nofile=900");
        assert!(
            stdout.lines().any(|l| l.ends_with(&want)),
            "{want}:\n{stdout}\n{stderr}"
        );
    }
    s.assert_no_survivors();
}

/// The process that starts nrun's agents (nrun-spawner) blocks every signal: Slurm signals
/// every process of a step (its --signal=USR1, scancel's TERM) and a user may signal the whole
/// tree; those are nrun's to handle through its agents. Signalled, the job goes on and ends as
/// it would; its workers start with no signal blocked.
#[test]
fn signals_to_the_agent_spawner_leave_the_job_to_nrun() {
    let s = Scene::new();
    let child = s.spawn(
        &[
            "-H",
            "localhost,127.0.0.2,127.0.0.3",
            "--nproc",
            "1",
            "--no-python",
            "sh",
            "-c",
            // Each worker runs until the test has signalled the spawner (go file).
            "echo up >> $MARK; while [ ! -e $MARK.go ]; do sleep 0.05; done; \
             echo done-$RANK $(grep SigBlk /proc/self/status)",
        ],
        &[],
    );
    s.wait_marks("up", 3, Duration::from_secs(20));
    // The launched nrun is the keeper; nrun proper, its child, forked the spawner.
    let spawner = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "nrun-spawner")
                && [parent_of(pid), parent_of(pid).and_then(parent_of)].contains(&Some(child.id()))
        })
        .expect("nrun's spawner runs under the nrun started");
    for sig in ["USR1", "TERM", "HUP", "INT"] {
        signal_pid(&spawner.to_string(), sig);
    }
    std::fs::write(format!("{}.go", s.mark().display()), "").unwrap();
    let (out, _) = wait_with_timeout(child, Duration::from_secs(30));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    // Workers start with no signal blocked (the spawner's mask is its own).
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("done-{r} SigBlk: 0000000000000000")),
            "{stdout}\n{stderr}"
        );
    }
    s.assert_no_survivors();
}

/// A worker's output pipe held open by a process outside the job (here the test itself, handed
/// the worker's stdout and stderr over a unix socket, as a daemon or a container runtime might
/// hold them) must not keep nrun from ending: its pumps are given a moment, then dropped.
#[test]
fn an_output_pipe_held_outside_the_job_does_not_hang_the_end() {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::io::IoSliceMut;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::net::UnixListener;

    let s = Scene::new();
    let sock = s.dir.path().join("hold.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let holder = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        let mut byte = [0u8; 1];
        let mut iov = [IoSliceMut::new(&mut byte)];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 2]);
        let msg = recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::empty(),
        )
        .unwrap();
        let mut held = Vec::new();
        for c in msg.cmsgs().unwrap() {
            if let ControlMessageOwned::ScmRights(fds) = c {
                // SAFETY: the kernel gave us these descriptors; nothing else owns them.
                held.extend(
                    fds.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        held
    });
    let script = "import os, socket\n\
                  s = socket.socket(socket.AF_UNIX)\n\
                  s.connect(os.environ['HOLD_SOCK'])\n\
                  socket.send_fds(s, [b'x'], [1, 2])\n\
                  print('handed over', flush=True)\n";
    let child = s.spawn(
        &["--nproc", "1", "--no-python", "python3", "-c", script],
        &[("HOLD_SOCK", sock.to_str().unwrap())],
    );
    let held = holder.join().unwrap();
    assert_eq!(
        held.len(),
        2,
        "the worker did not hand over its stdout and stderr"
    );
    // The pipes stay held until after nrun ends: ending at all (within the hang guard) is
    // the check.
    let (out, _) = wait_with_timeout(child, HANG);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(text(&out.stdout).contains("handed over"), "{err}");
    assert!(
        err.contains("still held open by a process outside the job"),
        "nrun did not say why the end waited: {err}"
    );
    drop(held);
    s.assert_no_survivors();
}

/// A program that passes nrun's checks but cannot be run (its interpreter is missing) fails the
/// start with the reason exec gave, names the rank and what to check, and leaves nothing behind.
#[test]
fn a_program_exec_refuses_is_a_start_error_that_names_why() {
    let s = Scene::new();
    let script = s.dir.path().join("job");
    std::fs::write(&script, "#!/nonexistent/interpreter\necho never\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = s.run(
        &["--nproc", "2", "--no-python", script.to_str().unwrap(), "a"],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot start rank 0:") && err.contains("/job a: No such file or directory"),
        "{err}"
    );
    assert!(err.contains("check its #! line"), "{err}");
    assert!(!text(&out.stdout).contains("never"));
    s.assert_no_survivors();
}

/// A worker starts as a plain exec would make it whatever state nrun is in: its own process
/// group, no signal blocked, no handler of nrun's, SIGPIPE at its default (Rust ignores it),
/// but what the user ignored (SIGALRM here; nrun catches SIGHUP itself, to forward it) still
/// ignored; the shared secret never in its environment.
#[test]
fn a_worker_starts_as_a_plain_exec_would_make_it() {
    let s = Scene::new();
    // cat reads its own status: it sets no handler of its own.
    let probe = "cat /proc/self/status | grep -E '^(SigBlk|SigIgn|SigCgt):'; \
                 echo pgrp=$(cut -d' ' -f5 /proc/$$/stat) pid=$$; \
                 env | grep -c NRUN_RDZV_SECRET || true";
    let mut c = s.cmd(&["--nproc", "2", "--no-python", "sh", "-c", probe]);
    c.env("NRUN_RDZV_SECRET", "not-for-workers");
    // SAFETY: signal() in the child between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut c, || {
            libc::signal(libc::SIGALRM, libc::SIG_IGN);
            Ok(())
        });
    }
    let out = c.output().unwrap();
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let mask = |name: &str| -> Vec<u64> {
        stdout
            .lines()
            .filter_map(|l| l.split_once(&format!("{name}:")))
            .map(|(_, v)| u64::from_str_radix(v.trim(), 16).unwrap())
            .collect()
    };
    let bit = |sig: i32| 1u64 << (sig - 1);
    assert_eq!(mask("SigBlk"), vec![0, 0], "{stdout}");
    assert_eq!(mask("SigCgt"), vec![0, 0], "{stdout}");
    let ignored = mask("SigIgn");
    assert_eq!(ignored.len(), 2, "{stdout}");
    for m in ignored {
        assert!(
            m & bit(libc::SIGALRM) != 0,
            "SIGALRM not kept ignored: {stdout}"
        );
        assert!(
            m & bit(libc::SIGPIPE) == 0,
            "SIGPIPE left ignored: {stdout}"
        );
    }
    for l in stdout.lines().filter(|l| l.contains("pgrp=")) {
        let (g, p) = l
            .rsplit_once("pgrp=")
            .unwrap()
            .1
            .split_once(" pid=")
            .unwrap();
        assert_eq!(g, p, "not the leader of its own group: {l}");
    }
    assert_eq!(
        stdout.lines().filter(|l| l.ends_with(": 0")).count(),
        2,
        "the secret reached a worker: {stdout}"
    );
}

/// The one run directory under `logs`.
fn only_run(logs: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(logs)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
}

/// Exit 0 means every line arrived: ranks that write thousands of lines right before they
/// exit 0 have every one of them on the console and in their logs when nrun exits, with the
/// launch host's node in nrun itself (one node) and as agent processes whose output a pipe
/// relays (two nodes of this machine).
#[test]
fn every_line_written_right_before_exit_0_is_on_the_console_and_in_the_log() {
    const LINES: usize = 5000;
    for hosts in [None, Some("localhost,127.0.0.1")] {
        let s = Scene::new();
        let logs = s.dir.path().join("logs");
        let mut args = vec!["--nproc", "2", "--no-python-probe"];
        if let Some(h) = hosts {
            args.extend(["-H", h]);
        }
        let work = burst(LINES);
        let logs_arg = logs.to_str().unwrap();
        args.extend(["--log-dir", logs_arg, "--tee", "3"]);
        args.extend(["--no-python", "sh", "-c", &work]);
        let out = s.run(&args, &[]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{hosts:?}: {stderr}");
        let ranks = if hosts.is_some() { 4 } else { 2 };
        let run = only_run(&logs);
        for r in 0..ranks {
            assert_burst(&stdout, r, LINES, &format!("{hosts:?} console"));
            let file = match hosts {
                None => run.join(format!("attempt_0/{r}/stdout.log")),
                Some(_) => run.join(format!(
                    "attempt_0/{}/{}/stdout.log",
                    ["localhost", "127.0.0.1"][r / 2],
                    r % 2
                )),
            };
            let log = std::fs::read_to_string(&file).unwrap();
            assert_burst(&log, r, LINES, &format!("{}", file.display()));
        }
        // nrun's marks behind each step's output never reach the console.
        assert!(!stdout.contains("nrun-output-end"), "{hosts:?}");
        assert!(!stderr.contains("nrun-output-end"), "{stderr}");
        s.assert_no_survivors();
    }
}

/// A rank that was started but whose end never reached nrun (its node's agent killed while it
/// ran) fails the job, and the error names it and its host.
#[test]
fn a_rank_whose_end_is_never_reported_fails_the_job_and_is_named() {
    let s = Scene::new();
    let agent = s.dir.path().join("agent");
    let work = format!(
        "[ $RANK = 1 ] && echo $PPID > {}; echo started >> $MARK; exec sleep 60",
        agent.display()
    );
    let child = s.spawn(
        &[
            "-H",
            "localhost,127.0.0.1",
            "--nproc",
            "1",
            "--no-python-probe",
            "--no-python",
            "sh",
            "-c",
            &work,
        ],
        &[],
    );
    s.wait_marks("started", 2, Duration::from_secs(60));
    let pid = std::fs::read_to_string(&agent).unwrap();
    // The worker's parent is its node's agent.
    let cmd = std::fs::read(format!("/proc/{}/cmdline", pid.trim())).unwrap_or_default();
    assert!(
        cmd.split(|b| *b == 0).any(|a| a == b"__agent"),
        "{:?}",
        String::from_utf8_lossy(&cmd)
    );
    signal_pid(pid.trim(), "KILL");
    let (out, _) = wait_with_timeout(child, Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("lost 127.0.0.1"), "{stderr}");
    assert!(
        stderr.contains("rank 1 ran there and its end was never reported"),
        "{stderr}"
    );
    s.assert_no_survivors();
}

/// Lines up to 1 MiB are kept whole, each with its rank's prefix once, never mixed with
/// another rank's, when two ranks print them at once; a longer one is cut into 1 MiB pieces,
/// each marked. In nrun itself and through the pipes of agent processes.
#[test]
fn long_lines_of_two_ranks_at_once_stay_whole() {
    const LEN: usize = 1_000_000;
    for hosts in [None, Some("localhost,127.0.0.1")] {
        let s = Scene::new();
        let mut args = vec!["--nproc", "1", "--no-python-probe"];
        match hosts {
            Some(h) => args.extend(["-H", h]),
            None => args[1] = "2",
        }
        let work = format!(
            "{}; [ $RANK = 0 ] && head -c 2500000 /dev/zero | tr '\\0' x && echo; exit 0",
            long_lines(LEN, 3)
        );
        args.extend(["--no-python", "sh", "-c", &work]);
        let out = s.run(&args, &[]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{hosts:?}: {stderr}");
        for r in 0..2 {
            let digits: Vec<&str> = stdout.lines().filter(|l| !l.contains("xxx")).collect();
            assert_long_lines(&digits.join("\n"), r, LEN, 3);
        }
        // 2,500,000 bytes: two pieces of 1 MiB, marked, and the rest.
        let cut: Vec<&str> = stdout.lines().filter(|l| l.contains("xxx")).collect();
        assert_eq!(cut.len(), 3, "{hosts:?}");
        let mark = " [nrun: line longer than 1 MiB, continued on the next line]";
        for (i, l) in cut.iter().enumerate() {
            let (prefix, body) = l.split_once("]: ").unwrap();
            assert!(prefix.ends_with("rank0"), "{prefix}");
            let xs = body.strip_suffix(mark).unwrap_or(body);
            assert!(xs.bytes().all(|b| b == b'x'), "piece {i}");
            let want = if i < 2 {
                1 << 20
            } else {
                2_500_000 - (2 << 20)
            };
            assert_eq!(xs.len(), want, "piece {i}");
            assert_eq!(body.ends_with(mark), i < 2, "piece {i}");
        }
        s.assert_no_survivors();
    }
}
