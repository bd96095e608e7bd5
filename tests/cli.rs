//! The command line as users meet it: bad input, environment options, worker environment,
//! output routing and log files. Runs the real binary.

mod common;

use std::net::TcpListener;

use common::setup::c10d_args;
use common::*;

/// Bad input: exit 2, one line naming the problem, never a panic or backtrace.
fn usage_error(args: &[&str], env: &[(&str, &str)], expect: &str) {
    let s = Scene::new();
    let out = s.run(args, env);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        err.contains(expect),
        "{args:?}: expected {expect:?} in: {err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{err}"
    );
    if !expect.contains("unexpected argument") {
        assert_eq!(err.lines().count(), 1, "not one line: {err}");
        assert!(err.starts_with("nrun: error: "), "{err}");
    }
}

#[test]
fn bad_input_is_one_clear_line_and_exit_2() {
    usage_error(&["--bogus", "x.py"], &[], "unexpected argument '--bogus'");
    usage_error(
        &["--nproc", "0", "--no-python", "true"],
        &[],
        "--nproc-per-node 0: at least one worker",
    );
    usage_error(
        &["--nproc", "lots", "--no-python", "true"],
        &[],
        "is not a number",
    );
    usage_error(
        &["missing_script.py"],
        &[],
        "script missing_script.py not found (cwd ",
    );
    let s = Scene::new();
    let plain = s.dir.path().join("plain.sh");
    std::fs::write(&plain, "echo hi\n").unwrap();
    let plain = plain.to_str().unwrap();
    usage_error(
        &["--no-python", plain],
        &[],
        &format!("program {plain} is not executable"),
    );
    usage_error(
        &["--no-python", "no-such-prog-nrun"],
        &[],
        "program no-such-prog-nrun not found on PATH",
    );
    usage_error(
        &["--python", "/nope/python3", "x.py"],
        &[],
        "python interpreter /nope/python3 not found",
    );
    usage_error(
        &["x.py"],
        &[("PYTHON_EXEC", "no-such-python-nrun")],
        "python interpreter no-such-python-nrun not found on PATH",
    );
    usage_error(
        &["-r", "7", "--no-python", "true"],
        &[],
        "--redirects \"7\" is not a stream spec",
    );
    usage_error(
        &["--nnodes", "1:4", "--no-python", "true"],
        &[],
        "--nnodes 1:4: an elastic range needs nodes that join",
    );
    usage_error(
        &["--local-ranks-filter", "5", "--no-python", "true"],
        &[],
        "is not a local rank in 0..1",
    );
}

#[test]
fn taken_master_port_is_named() {
    // Hold a port the way another job would.
    let held = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    usage_error(
        &["--master-port", &port, "--no-python", "true"],
        &[],
        &format!("--master-port {port} is already in use on this host"),
    );
}

#[test]
fn help_and_version() {
    let s = Scene::new();
    let out = s.run(&["--help"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    for needle in [
        "Examples:",
        "--nproc-per-node",
        "--max-restarts",
        "--log-dir",
        "Exit status:",
        "torchrun",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}");
    }
    let out = s.run(&["--version"], &[]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).starts_with(&format!("nrun {}", env!("CARGO_PKG_VERSION"))));
}

/// stdout closed before nrun writes (`nrun completions zsh | head -c1` once head has gone):
/// a quiet exit 0, no panic, no backtrace, nothing on stderr (issue 23, item 9).
#[test]
fn stdout_closed_early_is_a_quiet_exit() {
    let s = Scene::new();
    for args in [
        &["completions", "zsh"][..],
        &["completions", "bash"],
        &["--print-completion", "fish"],
        &["man"],
        &["--help"],
        &["doctor", "--help"],
        &["--version"],
        &["doctor", "--no-python-probe"],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = s
            .cmd(args)
            .env("RUST_BACKTRACE", "1")
            .stdout(writer)
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("backtrace") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
    }
}

/// Help text with its line wraps undone, so a phrase can be found whole.
fn flat(help: &str) -> String {
    help.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The `[default: X]` clap shows for `flag` in `help`.
fn documented_default(help: &str, flag: &str) -> String {
    let h = flat(help);
    let at = h
        .find(&format!("{flag} "))
        .unwrap_or_else(|| panic!("{flag} not in help"));
    let rest = &h[at..];
    let d = rest.find("[default: ").expect("a default") + "[default: ".len();
    rest[d..rest[d..].find(']').unwrap() + d].to_string()
}

/// The long options a command's help defines (with their aliases).
fn defined_flags(help: &str) -> Vec<String> {
    let mut out = vec!["--help".to_string()];
    for line in help.lines() {
        let t = line.trim_start();
        let t = t.strip_prefix("-").map_or(t, |_| t);
        let t = match t.split_once(", ") {
            Some((short, rest)) if short.len() == 2 && short.starts_with('-') => rest,
            _ => t,
        };
        if let Some(f) = t.strip_prefix("--") {
            let name: String = f
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            out.push(format!("--{name}"));
        }
        for key in ["[alias: ", "[aliases: "] {
            if let Some(i) = line.find(key) {
                let list = &line[i + key.len()..];
                let list = &list[..list.find(']').unwrap_or(list.len())];
                out.extend(list.split(", ").map(|a| a.trim().to_string()));
            }
        }
    }
    out
}

/// The `--flags` a help text mentions anywhere (descriptions, examples).
fn mentioned_flags(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = help.as_bytes();
    for (i, _) in help.match_indices("--") {
        if i > 0 && !matches!(b[i - 1], b' ' | b'(' | b'[' | b'`' | b'\n') {
            continue;
        }
        let name: String = help[i + 2..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(format!("--{name}"));
        }
    }
    out
}

/// What `--help` documents (defaults, the log directory's layout, `.nrun_env`'s order, the
/// flags each command's help names) is what nrun does (issue 23, item 8).
#[test]
fn help_texts_are_true() {
    let s = Scene::new();
    let help = text(&s.run(&["--help"], &[]).stdout);
    let doctor = text(&s.run(&["doctor", "--help"], &[]).stdout);
    let bisect = text(&s.run(&["bisect", "--help"], &[]).stdout);

    // Every flag a subcommand's help names is one of its own (its examples' scripts aside).
    for (name, h) in [("doctor", &doctor), ("bisect", &bisect)] {
        let defined = defined_flags(h);
        for f in mentioned_flags(h) {
            if f == "--steps" {
                continue; // train.py's own, in bisect's --probe cmd example
            }
            assert!(
                defined.contains(&f),
                "`nrun {name} --help` names {f}, which {name} does not take"
            );
        }
    }
    // Every flag the run's help names is nrun's (a run's or, in their examples, doctor's and
    // bisect's), or srun's/sbatch's/the script's in an example.
    let mut defined = defined_flags(&help);
    defined.extend(defined_flags(&doctor));
    defined.extend(defined_flags(&bisect));
    for f in mentioned_flags(&help) {
        let foreign = [
            "--lr",
            "--ntasks-per-node",
            "--gpus-per-node",
            "--signal",
            "--epochs",
        ];
        assert!(
            defined.contains(&f) || foreign.contains(&f.as_str()),
            "`nrun --help` names {f}, which nrun does not take"
        );
    }

    // --nnodes: MIN:MAX is elastic (with nodes that join), not refused unless MIN == MAX.
    let h = flat(&help);
    assert!(!h.contains("MIN == MAX"), "stale --nnodes help");
    assert!(
        h.contains("MIN:MAX (elastic, with a host list or c10d"),
        "{h}"
    );
    let out = s.run(&["--nnodes", "1:2", "--no-python", "true"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("an elastic range needs nodes that join: a host list"),
        "{}",
        text(&out.stderr)
    );

    // Documented defaults, as the workers see them.
    let out = s.run(
        &[
            "--no-python",
            "sh",
            "-c",
            "echo \"$LOCAL_WORLD_SIZE|$ROLE_NAME|$TORCHELASTIC_MAX_RESTARTS|$TORCHELASTIC_SIGNALS_TO_HANDLE\"",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let want = format!(
        "{}|{}|{}|{}\n",
        documented_default(&help, "--nproc-per-node"),
        documented_default(&help, "--role"),
        documented_default(&help, "--max-restarts"),
        documented_default(&help, "--signals-to-handle"),
    );
    assert_eq!(text(&out.stdout), want);

    // --log-dir's documented layout, filled in, is where the files are.
    let layout = "DIR/<run-id>_<8 hex>/attempt_<n>/[<host>/]<local-rank>/";
    assert!(h.contains(layout), "--log-dir help lacks {layout}");
    assert!(
        h.contains("logs/<run-id>_<8 hex>/attempt_0/<local-rank>/"),
        "the --log-dir example"
    );
    let logs = s.dir.path().join("logs");
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--rdzv-id",
            "helpid",
            "--log-dir",
            logs.to_str().unwrap(),
            "--no-python",
            "true",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let run = run_dir(&logs, "helpid");
    let hex = run.file_name().unwrap().to_string_lossy()["helpid_".len()..].to_string();
    assert!(
        hex.len() == 8 && hex.chars().all(|c| c.is_ascii_hexdigit()),
        "{hex}"
    );
    let path = layout
        .replace("DIR", logs.to_str().unwrap())
        .replace("<run-id>", "helpid")
        .replace("<8 hex>", &hex)
        .replace("<n>", "0")
        .replace("[<host>/]", "")
        .replace("<local-rank>", "1");
    for f in ["stdout.log", "stderr.log"] {
        let p = std::path::Path::new(&path).join(f);
        assert!(p.exists(), "{} (from --help) is missing", p.display());
    }

    // -x: .nrun_env is read from home, then the cwd, the later winning, as --help and the docs say.
    let said = "KEY=VALUE lines of .nrun_env (home, then cwd; the later wins)";
    assert!(h.contains(said), "-x help lacks {said:?}");
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/multi-node.md"))
        .unwrap();
    assert!(flat(&doc).contains("`.nrun_env` (home, then cwd"));
    let home = s.dir.path().join("home");
    let cwd = s.dir.path().join("cwd");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&cwd).unwrap();
    std::fs::write(home.join(".nrun_env"), "A=home\nB=home\n").unwrap();
    std::fs::write(cwd.join(".nrun_env"), "A=cwd\n").unwrap();
    let out = s
        .cmd(&["--no-python", "sh", "-c", "echo $A $B"])
        .env("HOME", &home)
        .current_dir(&cwd)
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "cwd home\n", "{}", text(&out.stderr));
}

/// A c10d node that does not join gets a hint about c10d (the endpoint, the join timeout), or
/// about pods under Kubernetes; no ssh is involved, so no ssh hint (issue 23, item 3).
#[test]
fn a_c10d_join_failure_gets_a_hint_of_its_mode() {
    let s = Scene::new();
    let port = common::free_port().to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let args = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "hint",
        "--join-timeout",
        "1",
        "--no-python",
        "true",
    ];
    let out = s.run(&args, &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(95), "{err}");
    assert!(
        err.contains(&format!(
            "hint: check that every node's nrun started within --join-timeout (1 s) of this one \
             and reaches {endpoint}"
        )),
        "{err}"
    );
    assert!(!err.contains("ssh") && !err.contains("--ship"), "{err}");
    assert!(!err.contains("  <host>") && !err.contains("` ("), "{err}");
    let out = s.run(&args, &[("KUBERNETES_SERVICE_HOST", "10.0.0.1")]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(95), "{err}");
    assert!(
        err.contains("hint: check that every pod of the job is running (`kubectl get pods`)"),
        "{err}"
    );
    assert!(!err.contains("ssh"), "{err}");
}

/// Another job holding the endpoint (a single-node nrun on that port, a c10d job of another
/// id) is named at once as such, not as "unexpected end of file" (issue 23, item 5).
#[test]
fn another_job_holding_the_endpoint_is_named() {
    let s = Scene::new();
    let port = common::free_port().to_string();
    let endpoint = format!("127.0.0.1:{port}");
    // The other job runs until the test stops it.
    let other = s.spawn(
        &["--master-port", &port, "--no-python", "sleep", "600"],
        &[],
    );
    // The other job's store is up once its port is taken.
    wait_until("the other job to bind its port", || {
        TcpListener::bind(&endpoint).is_err()
    });
    // A join timeout far past the bound below: refused at once, not when it ends.
    let mut args = c10d_args(&endpoint, "mine", "300");
    args.extend(["--no-python", "true"]);
    let started = std::time::Instant::now();
    let out = s.run(&args, &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(95), "{err}");
    assert!(
        err.contains(&format!(
            "an nrun listens at {endpoint} but hosts no rendezvous with id \"mine\": another job \
             holds this endpoint (one job per endpoint port)"
        )),
        "{err}"
    );
    assert!(!err.contains("end of file"), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    signal(&other, "TERM");
    let _ = wait_with_timeout(other, std::time::Duration::from_secs(20));
    s.assert_no_survivors();
}

/// A joiner started before the hosting nrun says once what it waits for, then a progress line,
/// and joins when the host comes (issue 23, item 11).
#[test]
fn a_joiner_started_first_says_what_it_waits_for() {
    let s = Scene::new();
    let endpoint = format!("127.0.0.1:{}", common::free_port());
    let mut args = c10d_args(&endpoint, "early", "120");
    args.extend(["--no-python", "true"]);
    // The joiner must not host: the port is taken (by nothing that answers) until the host
    // takes it over.
    let hold = TcpListener::bind(&endpoint).unwrap();
    let joiner = Watched::new(s.spawn(&args, &[]));
    // The host comes once the joiner has said how long it has waited.
    joiner.wait_stderr(&format!("still waiting for the rendezvous at {endpoint}: "));
    drop(hold);
    let host = s.spawn(&args, &[]);
    let (oj, _) = joiner.finish();
    let (oh, _) = wait_with_timeout(host, std::time::Duration::from_secs(60));
    let err = text(&oj.stderr);
    assert_eq!(oj.status.code(), Some(0), "{err}\n{}", text(&oh.stderr));
    assert_eq!(oh.status.code(), Some(0), "{}", text(&oh.stderr));
    assert_eq!(
        err.matches(&format!(
            "waiting for the nrun that hosts rendezvous \"early\" at {endpoint} (it may start \
             after this one; up to 120 s, --join-timeout)"
        ))
        .count(),
        1,
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "nrun: c10d join: still waiting for the rendezvous at {endpoint}: "
        )) && err.contains(" s; deadline ")
            && err.contains(" s)\n"),
        "{err}"
    );
    assert!(err.contains("joined the rendezvous at"), "{err}");
}

/// A c10d node that joins another nrun's rendezvous keeps no record of the job: its --events,
/// --report and metrics flags are said to be the hosting nrun's, not silently dropped; the
/// hosting nrun writes its own. The joiner does not take --metrics-port either: the host on
/// the same machine, given the same command line, binds it.
#[test]
fn a_joiner_says_the_job_record_flags_are_the_hosts() {
    let s = Scene::new();
    let endpoint = format!("127.0.0.1:{}", common::free_port());
    let metrics_port = common::free_port().to_string();
    let (mine, hosts) = (
        s.dir.path().join("joiner.jsonl"),
        s.dir.path().join("host.jsonl"),
    );
    // The same command on both, but for its events file.
    let spawn = |events: &std::path::Path| {
        let mut a = c10d_args(&endpoint, "record", "120");
        a.extend(["--events", events.to_str().unwrap()]);
        a.extend(["--metrics-port", &metrics_port, "--no-python", "true"]);
        s.spawn(&a, &[])
    };
    let hold = TcpListener::bind(&endpoint).unwrap();
    let joiner = Watched::new(spawn(&mine));
    joiner.wait_stderr(
        "--events, --metrics-port not served on this node: it joins the rendezvous another \
         node's nrun hosts at ",
    );
    drop(hold);
    let host = spawn(&hosts);
    let (oj, _) = joiner.finish();
    let (oh, _) = wait_with_timeout(host, std::time::Duration::from_secs(60));
    assert_eq!(oj.status.code(), Some(0), "{}", text(&oj.stderr));
    assert_eq!(oh.status.code(), Some(0), "{}", text(&oh.stderr));
    assert!(!mine.exists(), "the joiner wrote an events file");
    let events = std::fs::read_to_string(&hosts).unwrap();
    assert!(events.contains("\"name\":\"job_end\""), "{events}");
}

fn lines_of(out: &std::process::Output) -> Vec<String> {
    text(&out.stdout).lines().map(String::from).collect()
}

/// Each worker leads a session of its own, as torchrun's (`start_new_session`): its own process
/// group, and its own scheduler autogroup, not nrun's (BENCHMARKS 26: 5-6% of step time).
#[test]
fn workers_lead_their_own_sessions_as_torchruns() {
    let s = Scene::new();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            // Fields 5 and 6 of /proc/PID/stat: the process group and the session.
            "echo $$ $(cut -d' ' -f5,6 /proc/$$/stat)",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let lines = lines_of(&out);
    assert_eq!(lines.len(), 2, "{lines:?}");
    for l in &lines {
        let ids: Vec<&str> = l.split(": ").nth(1).unwrap().split(' ').collect();
        assert_eq!(ids.len(), 3, "{l}");
        assert!(
            ids[0] == ids[1] && ids[1] == ids[2],
            "not a session leader: {l}"
        );
    }
}

#[test]
fn worker_environment_is_torchruns() {
    let s = Scene::new();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--rdzv-id",
            "job7",
            "--no-python",
            "sh",
            "-c",
            "echo RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LWS=$LOCAL_WORLD_SIZE \
           GROUP_RANK=$GROUP_RANK ROLE=$ROLE_NAME MA=$MASTER_ADDR MP=$MASTER_PORT \
           AGENT=$TORCHELASTIC_USE_AGENT_STORE RUN=$TORCHELASTIC_RUN_ID OMP=$OMP_NUM_THREADS \
           ASYNC=$TORCH_NCCL_ASYNC_ERROR_HANDLING ERR=$TORCHELASTIC_ERROR_FILE",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let lines = lines_of(&out);
    assert_eq!(lines.len(), 2, "{lines:?}");
    let rank1 = lines
        .iter()
        .find(|l| l.starts_with("[rank1]: "))
        .expect("rank prefix");
    for kv in [
        "RANK=1",
        "LOCAL_RANK=1",
        "WORLD_SIZE=2",
        "LWS=2",
        "GROUP_RANK=0",
        "ROLE=default",
        "MA=127.0.0.1",
        "AGENT=True",
        "RUN=job7",
        "OMP=1",
        "ASYNC=1",
    ] {
        assert!(
            rank1.split_whitespace().any(|w| w == kv),
            "{kv} not in {rank1}"
        );
    }
    let port: u16 = rank1
        .split("MP=")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(port > 0);
    assert!(rank1.contains("/attempt_0/error-1.json"), "{rank1}");
    assert!(text(&out.stderr).contains("OMP_NUM_THREADS was unset"));
}

#[test]
fn options_come_from_nrun_and_pet_environment() {
    let s = Scene::new();
    let out = s.run(
        &["--no-python", "sh", "-c", "echo r$RANK"],
        &[("PET_NPROC_PER_NODE", "3")],
    );
    assert_eq!(lines_of(&out).len(), 3, "{}", text(&out.stdout));
    let out = s.run(
        &["--no-python", "sh", "-c", "echo r$RANK"],
        &[("PET_NPROC_PER_NODE", "3"), ("NRUN_NPROC_PER_NODE", "2")],
    );
    assert_eq!(
        lines_of(&out).len(),
        2,
        "NRUN_ wins over PET_: {}",
        text(&out.stdout)
    );
    let out = s.run(
        &["--nproc", "1", "--no-python", "sh", "-c", "echo r$RANK"],
        &[("NRUN_NPROC_PER_NODE", "4")],
    );
    assert_eq!(
        lines_of(&out).len(),
        1,
        "the flag wins over the environment"
    );
}

#[test]
fn single_worker_output_is_unprefixed() {
    let s = Scene::new();
    let out = s.run(&["--no-python", "sh", "-c", "echo hello"], &[]);
    assert_eq!(text(&out.stdout), "hello\n");
}

/// `--redirects 3 --tee 3`, as torchrun users pass them: tee wins, so the console shows every
/// stream (torchrun's does) and the files get them too; per rank, only the teed streams of a
/// redirected rank reach the console.
#[test]
fn tee_wins_over_redirects() {
    let s = Scene::new();
    let w = fixture("worker.sh");
    let logs = s.dir.path().join("logs");
    let logs_s = logs.to_str().unwrap();
    let fx = [("NRUN_FIXTURE", "output")];
    let run = |id: &str, r: &str, t: &str| {
        let args = [
            "--nproc",
            "2",
            "--log-dir",
            logs_s,
            "--rdzv-id",
            id,
            "--redirects",
            r,
            "--tee",
            t,
            "--no-python",
            "sh",
            &w,
        ];
        let out = s.run(&args, &fx);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        (text(&out.stdout), text(&out.stderr))
    };
    let (out, err) = run("both", "3", "3");
    for r in 0..2 {
        assert!(out.contains(&format!("[rank{r}]: out of {r}\n")), "{out}");
        assert!(
            out.contains(&format!("[rank{r}]: partial of {r}\n")),
            "{out}"
        );
        assert!(err.contains(&format!("[rank{r}]: err of {r}\n")), "{err}");
        let d = run_dir(&logs, "both").join(format!("attempt_0/{r}"));
        assert_eq!(
            std::fs::read_to_string(d.join("stdout.log")).unwrap(),
            format!("out of {r}\npartial of {r}\n")
        );
        assert_eq!(
            std::fs::read_to_string(d.join("stderr.log")).unwrap(),
            format!("err of {r}\n")
        );
    }
    // Rank 0's stdout teed, its stderr and all of rank 1 redirected only.
    let (out, err) = run("part", "3", "0:1");
    assert_eq!(out, "[rank0]: out of 0\n[rank0]: partial of 0\n");
    assert!(!err.contains("err of"), "{err}");
    for r in 0..2 {
        let d = run_dir(&logs, "part").join(format!("attempt_0/{r}"));
        assert_eq!(
            std::fs::read_to_string(d.join("stderr.log")).unwrap(),
            format!("err of {r}\n")
        );
    }
}

#[test]
fn log_dir_redirects_tee_and_filter() {
    let s = Scene::new();
    let w = fixture("worker.sh");
    let logs = s.dir.path().join("logs");
    let logs_s = logs.to_str().unwrap();
    let fx = [("NRUN_FIXTURE", "output")];

    // --log-dir alone: files for every rank and stream, console as usual.
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--log-dir",
            logs_s,
            "--rdzv-id",
            "r1",
            "--no-python",
            "sh",
            &w,
        ],
        &fx,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for r in 0..2 {
        let d = run_dir(&logs, "r1").join(format!("attempt_0/{r}"));
        assert_eq!(
            std::fs::read_to_string(d.join("stdout.log")).unwrap(),
            format!("out of {r}\npartial of {r}\n")
        );
        assert_eq!(
            std::fs::read_to_string(d.join("stderr.log")).unwrap(),
            format!("err of {r}\n")
        );
    }
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("[rank0]: out of 0\n") && stdout.contains("[rank1]: partial of 1\n"),
        "{stdout}"
    );

    // -r 1: stdout only to the files.
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--log-dir",
            logs_s,
            "--rdzv-id",
            "r2",
            "-r",
            "1",
            "--no-python",
            "sh",
            &w,
        ],
        &fx,
    );
    assert_eq!(text(&out.stdout), "");
    assert!(text(&out.stderr).contains("[rank1]: err of 1"));
    assert!(
        std::fs::read_to_string(run_dir(&logs, "r2").join("attempt_0/1/stdout.log"))
            .unwrap()
            .contains("out of 1")
    );

    // --local-ranks-filter 1: console shows rank 1 only; files still get everything.
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--log-dir",
            logs_s,
            "--rdzv-id",
            "r3",
            "--local-ranks-filter",
            "1",
            "--no-python",
            "sh",
            &w,
        ],
        &fx,
    );
    let stdout = text(&out.stdout);
    assert!(
        !stdout.contains("rank0") && stdout.contains("[rank1]: out of 1"),
        "{stdout}"
    );
    assert!(
        std::fs::read_to_string(run_dir(&logs, "r3").join("attempt_0/0/stdout.log"))
            .unwrap()
            .contains("out of 0")
    );

    // -t without --log-dir: nrun picks a directory and says where.
    let out = s.run(&["--nproc", "2", "-t", "3", "--no-python", "sh", &w], &fx);
    let err = text(&out.stderr);
    let dir = err
        .lines()
        .find_map(|l| l.strip_prefix("nrun: worker logs go to "))
        .expect(&err);
    assert!(
        std::path::Path::new(dir)
            .join("attempt_0/0/stdout.log")
            .exists(),
        "{dir}"
    );
    let _ = std::fs::remove_dir_all(dir);

    // The same --log-dir and id again: a directory of its own, the first run's logs kept.
    let again = |_| {
        s.run(
            &[
                "--nproc",
                "1",
                "--log-dir",
                logs_s,
                "--rdzv-id",
                "same",
                "--no-python",
                "echo",
                "x",
            ],
            &[],
        )
    };
    let (a, b) = (again(1), again(2));
    assert!(a.status.success() && b.status.success());
    let runs: Vec<String> = std::fs::read_dir(&logs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("same_"))
        .collect();
    assert_eq!(runs.len(), 2, "{runs:?}");
    for r in &runs {
        assert_eq!(
            std::fs::read_to_string(logs.join(r).join("attempt_0/0/stdout.log")).unwrap(),
            "x\n"
        );
        assert!(text(&a.stderr).contains(r.as_str()) || text(&b.stderr).contains(r.as_str()));
    }
}

#[test]
fn doctor_on_this_host() {
    let s = Scene::new();
    let out = s.run(&["doctor", "--no-python-probe"], &[]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(
        stdout.contains("this host") && stdout.contains("interfaces:") && stdout.contains("lo "),
        "{stdout}"
    );
    assert!(stdout.contains("NCCL libraries"), "{stdout}");
}

/// A python that cannot import torch: the system's python3 without its site directories.
pub fn python_without_torch(dir: &std::path::Path) -> String {
    let p = dir.join("python-without-torch");
    std::fs::write(&p, "#!/bin/sh\nexec python3 -I -S \"$@\"\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p.display().to_string()
}

/// doctor judges the python a job would run: torch missing there is not ready (exit 95, as
/// `doctor --help` says); the venv's python with torch is (issue 23, item 10).
#[test]
fn doctor_judges_the_python_that_would_run() {
    let s = Scene::new();
    let nopy = python_without_torch(s.dir.path());
    let out = s.run(&["doctor", "--python", &nopy], &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(95), "{err}");
    assert!(
        err.contains(&format!(
            "nrun: error: not ready: {nopy} has no usable torch ("
        )),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let help = text(&s.run(&["doctor", "--help"], &[]).stdout);
    assert!(
        flat(&help).contains("95 a node could not join, the nodes disagree, or the python a job would run has no torch"),
        "{help}"
    );
    // Not asked to look: ready.
    let out = s.run(&["doctor", "--python", &nopy, "--no-python-probe"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // With torch (said, or a failure under scripts/test.sh, where there is none): ready.
    if let Some(py) = need_torch() {
        let out = s.run(&["doctor", "--python", py.to_str().unwrap()], &[]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert!(
            text(&out.stdout).contains("torch 2."),
            "{}",
            text(&out.stdout)
        );
    }
}

/// `-x` and `.nrun_env` reach the workers of a single-node run too, as they do on several.
#[test]
fn exports_and_nrun_env_apply_on_one_node() {
    let s = Scene::new();
    std::fs::write(
        s.dir.path().join(".nrun_env"),
        "FROM_FILE=file-value\nBOTH=from-file\n",
    )
    .unwrap();
    let out = s
        .cmd(&[
            "--nproc",
            "2",
            "-x",
            "FROM_X=x-value",
            "-x",
            "BOTH=from-x",
            "--no-python",
            "sh",
            "-c",
            "echo file=$FROM_FILE x=$FROM_X both=$BOTH rank=$RANK",
        ])
        .current_dir(s.dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let lines = lines_of(&out);
    assert_eq!(lines.len(), 2, "{lines:?}");
    for l in &lines {
        // -x wins over .nrun_env; torchrun's variables are still nrun's own.
        assert!(
            l.contains("file=file-value x=x-value both=from-x rank="),
            "{l}"
        );
    }
    usage_error(
        &["-x", "NRUN_SURELY_UNSET_VAR", "--no-python", "true"],
        &[],
        "-x NRUN_SURELY_UNSET_VAR: NRUN_SURELY_UNSET_VAR is not set here",
    );
}

/// `doctor` and `bisect` are commands with their own help and flags; a command's name after a
/// run's flags is refused with the way to run a script of that name.
#[test]
fn subcommands_have_their_own_help_and_flags() {
    let s = Scene::new();
    let out = s.run(&["--help"], &[]);
    let help = text(&out.stdout);
    assert!(help.contains("doctor") && help.contains("bisect"), "{help}");
    assert!(help.contains("./doctor"), "{help}");
    let out = s.run(&["doctor", "--help"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    assert!(
        help.contains("--hostfile") && help.contains("Exit status"),
        "{help}"
    );
    assert!(
        !help.contains("--max-restarts") && !help.contains("--probe"),
        "{help}"
    );
    let out = s.run(&["bisect", "--help"], &[]);
    let help = text(&out.stdout);
    assert!(
        help.contains("--probe") && help.contains("--write-hostfile") && help.contains("--iters"),
        "{help}"
    );
    assert!(!help.contains("--max-restarts"), "{help}");
    // A bisect-only flag is not a run's, a run-only flag not doctor's.
    usage_error(
        &["--probe", "net", "--no-python", "true"],
        &[],
        "unexpected argument '--probe'",
    );
    usage_error(
        &["doctor", "--max-restarts", "2"],
        &[],
        "unexpected argument '--max-restarts'",
    );
    usage_error(
        &["-H", "a,b", "doctor"],
        &[],
        "`doctor` is a command: give its flags after it",
    );
    usage_error(
        &["bisect", "--probe", "cmd", "-H", "a,b"],
        &[],
        "--probe cmd runs your command: give it after `--`",
    );
    usage_error(&["bisect"], &[], "nrun bisect needs nodes");
}

/// Numbers out of range are one clear line and exit 2, never a panic (issue 14's findings).
#[test]
fn huge_negative_and_odd_numbers_are_usage_errors() {
    usage_error(
        &["--nproc", "-1", "--no-python", "true"],
        &[],
        "--nproc-per-node -1: at least one worker is needed",
    );
    for flag in [
        "--shutdown-timeout",
        "--preflight-timeout",
        "--join-timeout",
        "--hang-timeout",
    ] {
        usage_error(
            &[flag, "1e20", "--no-python", "true"],
            &[],
            &format!("{flag} 100000000000000000000 must be a"),
        );
    }
    usage_error(
        &["--preflight", "net", "--iters", "0", "--no-python", "true"],
        &[],
        "--iters 0: at least one timed all-reduce",
    );
    usage_error(
        &[
            "--preflight",
            "net",
            "--min-busbw",
            "nan",
            "--no-python",
            "true",
        ],
        &[],
        "--min-busbw NaN must be a non-negative number",
    );
    usage_error(
        &["--rdzv-id", "../../x", "--no-python", "true"],
        &[],
        "--rdzv-id \"../../x\": a run id names a log directory",
    );
    usage_error(
        &["-x", "", "--no-python", "true"],
        &[],
        "-x needs a variable",
    );
    usage_error(
        &["-x", "A B=1", "--no-python", "true"],
        &[],
        "-x A B=1: \"A B\" is not a variable name",
    );
}

/// nrun raises its own limit on open files to the hard limit (its store holds a connection per
/// worker); its workers get the limit they would have had without it.
#[test]
fn the_open_file_limit_is_raised_for_nrun_not_for_workers() {
    let s = Scene::new();
    let out = std::process::Command::new("sh")
        .args([
            "-c",
            "ulimit -S -n 1024 && exec \"$0\" \"$@\"",
            common::nrun_bin().to_str().unwrap(),
            "--no-python",
            "sh",
            "-c",
            "echo worker=$(ulimit -n) nrun=$(awk '/open files/ {print $4}' /proc/$PPID/limits) hard=$(ulimit -H -n)",
        ])
        .env("NRUN_TEST_TAG", &s.tag)
        .output()
        .unwrap();
    let line = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{line}{}", text(&out.stderr));
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(field("worker="), "1024", "{line}");
    assert_eq!(field("nrun="), field("hard="), "{line}");
}

/// A job larger than the open-file hard limit allows is told so before it starts.
#[test]
fn a_job_too_large_for_the_open_file_limit_is_warned() {
    let out = std::process::Command::new("sh")
        .args([
            "-c",
            "ulimit -n 100 && ulimit -H -n 100 && exec \"$0\" \"$@\"",
            common::nrun_bin().to_str().unwrap(),
            "--nproc",
            "30",
            "--no-python",
            "true",
        ])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("the job's 30 workers may need about")
            && err.contains("this host allows 100 open files"),
        "{err}"
    );
}

#[test]
fn torchrun_output_and_flag_habits() {
    let s = Scene::new();
    // A repeated flag takes the last value, as argparse does.
    let out = s.run(
        &[
            "--nproc",
            "3",
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            "echo $WORLD_SIZE",
        ],
        &[],
    );
    let mut got = lines_of(&out);
    got.sort();
    assert_eq!(got, ["[rank0]: 2", "[rank1]: 2"], "{}", text(&out.stderr));
    // torchrun's prefix template; an empty one means no prefix.
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--role",
            "trainer",
            "--log-line-prefix-template",
            "<${role_name}:${rank}/${local_rank}> ",
            "--local-ranks-filter",
            "1",
            "--no-python",
            "echo",
            "hi",
        ],
        &[],
    );
    assert_eq!(lines_of(&out), ["<trainer:1/1> hi"]);
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--log_line_prefix_template",
            "",
            "--no-python",
            "echo",
            "hi",
        ],
        &[],
    );
    assert_eq!(lines_of(&out), ["hi", "hi"]);
    // Colour: always colours even into a pipe; NO_COLOR wins over auto.
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--color",
            "always",
            "--local-ranks-filter",
            "0",
            "--no-python",
            "echo",
            "x",
        ],
        &[],
    );
    assert!(
        text(&out.stdout).starts_with("\x1b[36m[rank0]: \x1b[0mx"),
        "{:?}",
        text(&out.stdout)
    );
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--local-ranks-filter",
            "0",
            "--no-python",
            "echo",
            "x",
        ],
        &[("NO_COLOR", "1")],
    );
    assert_eq!(text(&out.stdout), "[rank0]: x\n");
    // CLICOLOR_FORCE colours a pipe with --color auto, unless NO_COLOR is set too.
    let auto = [
        "--nproc",
        "2",
        "--local-ranks-filter",
        "0",
        "--no-python",
        "echo",
        "x",
    ];
    let out = s.run(&auto, &[("CLICOLOR_FORCE", "1")]);
    assert_eq!(text(&out.stdout), "\x1b[36m[rank0]: \x1b[0mx\n");
    let out = s.run(&auto, &[("CLICOLOR_FORCE", "1"), ("NO_COLOR", "1")]);
    assert_eq!(text(&out.stdout), "[rank0]: x\n");
    // --virtual-local-rank: LOCAL_RANK 0 and one GPU each.
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--virtual-local-rank",
            "--no-python",
            "sh",
            "-c",
            "echo $LOCAL_RANK $CUDA_VISIBLE_DEVICES",
        ],
        &[("CUDA_VISIBLE_DEVICES", "4,6")],
    );
    let mut got = lines_of(&out);
    got.sort();
    assert_eq!(got, ["[rank0]: 0 4", "[rank1]: 0 6"]);
    // Flags with no effect here say so, and the job runs.
    let out = s.run(&["--start-method", "fork", "--no-python", "true"], &[]);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains("--start-method is accepted from torchrun and has no effect"),
        "{}",
        text(&out.stderr)
    );
    // Completions and the manual page.
    let out = s.run(&["completions", "fish"], &[]);
    assert!(out.status.success() && text(&out.stdout).contains("complete -c nrun"));
    let out = s.run(&["--print-completion", "zsh"], &[]);
    assert!(out.status.success() && text(&out.stdout).contains("#compdef nrun"));
    let out = s.run(&["man"], &[]);
    assert!(
        out.status.success() && text(&out.stdout).contains(".TH nrun"),
        "{}",
        text(&out.stdout)
    );
    let out = s.run(&["completions", "cmd.exe"], &[]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn torchrun_flag_values_are_checked() {
    usage_error(
        &[
            "--signals-to-handle",
            "SIGTERM,SIGNOPE",
            "--no-python",
            "true",
        ],
        &[],
        "--signals-to-handle: \"SIGNOPE\" is not a signal",
    );
    usage_error(
        &["--signals-to-handle", "KILL", "--no-python", "true"],
        &[],
        "SIGKILL cannot be caught",
    );
    usage_error(
        &["--stdin", "first", "--no-python", "true"],
        &[],
        "--stdin \"first\": expected a rank",
    );
    usage_error(
        &["--numa-binding", "everywhere", "--no-python", "true"],
        &[],
        "--numa-binding \"everywhere\": expected node",
    );
    usage_error(
        &["--rdzv-conf", "join_timeout", "--no-python", "true"],
        &[],
        "--rdzv-conf \"join_timeout\": expected KEY=VALUE",
    );
    usage_error(
        &["--rdzv-conf", "join_timeout=-3", "--no-python", "true"],
        &[],
        "--rdzv-conf join_timeout",
    );
    usage_error(
        &["--color", "sometimes", "--no-python", "true"],
        &[],
        "--color \"sometimes\"",
    );
}

/// Every accepted value is checked: malformed endpoints, non-finite or out-of-range durations,
/// booleans torch would not take, NaN thresholds, unknown template fields.
#[test]
fn malformed_values_are_usage_errors() {
    let run = |extra: &[&str]| {
        let mut a = extra.to_vec();
        a.extend(["--no-python", "true"]);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let cases: &[(&[&str], &str)] = &[
        (
            &["--rdzv-endpoint", "[::1"],
            "--rdzv-endpoint \"[::1\": '[' has no closing ']'; expected HOST, HOST:PORT, [IPV6]",
        ),
        (&["--rdzv-endpoint", "[::1]x"], "\"x\" after ']'"),
        (&["--rdzv-endpoint", "::1]:80"], "unbalanced brackets"),
        (&["--rdzv-endpoint", "h:99999"], "\"99999\" is not a port"),
        (&["--rdzv-endpoint", ":80"], "no host"),
        (&["--rdzv-endpoint", "a:b:c"], "not an IPv6 address"),
        (
            &["--rdzv-conf", "timeout=1e400"],
            "--rdzv-conf timeout=1e400: expected a number of seconds",
        ),
        (&["--rdzv-conf", "read_timeout=nan"], "read_timeout=nan"),
        (
            &["--rdzv-conf", "is_host=maybe"],
            "--rdzv-conf is_host=maybe: expected a boolean: true, false, 1, 0, yes, no",
        ),
        (
            &["--min-busbw", "nan"],
            "--min-busbw NaN must be a non-negative number",
        ),
        (
            &["--min-busbw", "-1"],
            "--min-busbw -1 must be a non-negative",
        ),
        (
            &["--min-efficiency", "inf"],
            "--min-efficiency inf must be a fraction",
        ),
        (&["--monitor-interval", "nan"], "--monitor-interval NaN"),
        (
            &["--log-line-prefix-template", "${nope}"],
            "unknown field ${nope}; the fields are ${rank}, ${local_rank}, ${role_name}, ${host}",
        ),
        (
            &["--log-line-prefix-template", "[${rank]"],
            "is not closed by '}'",
        ),
        (
            &["--master-addr", "[::1"],
            "--master-addr \"[::1\": expected a host name (letters, digits, '-', '.', '_') or an \
             IP address; write an IPv6 address without brackets",
        ),
        (
            &["--master-addr", "h:1"],
            "give the port with --master-port",
        ),
        (
            &["--local-addr", "a b"],
            "--local-addr \"a b\": expected a host name",
        ),
    ];
    for (args, expect) in cases {
        let a = run(args);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        usage_error(&a, &[], expect);
    }
    // The same values from the environment (NRUN_/PET_) are checked alike.
    usage_error(
        &["--no-python", "true"],
        &[("PET_RDZV_ENDPOINT", "[::1")],
        "'[' has no closing ']'",
    );
}

/// Values torch accepts still run; unknown --rdzv-conf keys are one warning line, however many.
#[test]
fn good_values_run_and_unknown_keys_warn_once() {
    let s = Scene::new();
    let out = s.run(
        &[
            "--rdzv-endpoint",
            "[::1]:0",
            "--rdzv-conf",
            "is_host=YES,use_libuv=0,timeout=900,read_timeout=60",
            "--log-line-prefix-template",
            "${host}/${role_name}/${rank}/${local_rank}: ",
            "--min-busbw",
            "0",
            "--no-python",
            "true",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let conf: Vec<String> = (0..5000).map(|i| format!("k{i}=1")).collect();
    let conf = conf.join(",");
    let out = s.run(&["--rdzv-conf", &conf, "--no-python", "true"], &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("--rdzv-conf")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("5000 unknown keys (\"k0\", \"k1\"") && lines[0].contains("4992 more"),
        "{err}"
    );
}

/// Inputs are bounded before anything is spawned: workers per node, hostfile kind and size,
/// host count.
#[test]
fn unbounded_inputs_are_refused_before_spawning() {
    usage_error(
        &["--nproc", "100000", "--no-python", "true"],
        &[],
        "--nproc-per-node 100000: at most 4096 workers per node",
    );
    for dev in ["/dev/zero", "/dev/urandom"] {
        usage_error(
            &["--hostfile", dev, "--no-python", "true"],
            &[],
            &format!("--hostfile {dev}: is a device; give a regular file of host lines"),
        );
    }
    let s = Scene::new();
    let fifo = s.dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let fifo = fifo.to_str().unwrap();
    usage_error(
        &["--hostfile", fifo, "--no-python", "true"],
        &[],
        "is a FIFO (a pipe, as <(...) gives",
    );
    let big = s.dir.path().join("big");
    std::fs::write(&big, vec![b'#'; (16 << 20) + 1]).unwrap();
    usage_error(
        &["--hostfile", big.to_str().unwrap(), "--no-python", "true"],
        &[],
        "is larger than 16 MiB",
    );
    let many: Vec<String> = (0..16_385).map(|i| format!("h{i}")).collect();
    let hostfile = s.dir.path().join("many");
    std::fs::write(&hostfile, many.join("\n")).unwrap();
    usage_error(
        &[
            "--hostfile",
            hostfile.to_str().unwrap(),
            "--no-python",
            "true",
        ],
        &[],
        "more than 16384 hosts",
    );
    usage_error(
        &["-H", &many.join(","), "--no-python", "true"],
        &[],
        "-H/--hosts names more than 16384 hosts",
    );
}

/// nrun on `hosts` with `extra` flags and then `job`, under a hard (and soft) limit of 1,024
/// open files; bounded in time.
fn under_1024_files(
    s: &Scene,
    hosts: &[String],
    extra: &[&str],
    job: &[&str],
) -> std::process::Output {
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 1024 && exec \"$0\" \"$@\"")
        .arg(nrun_bin())
        .args(["-H", &hosts.join(",")])
        .args(extra)
        .args(job)
        .env("NRUN_TEST_TAG", &s.tag)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_with_timeout(child, std::time::Duration::from_secs(300)).0
}

/// More ssh nodes than the open-file limit holds: the system's refusal (exit 1, as the table
/// says), naming `ulimit -n`, before any ssh starts. Without the launch tree every node's ssh
/// runs here (5 files each); with it (the default) 32 do, and the others' agents hold 2.
#[test]
fn too_many_nodes_for_the_open_file_limit_exit_1() {
    let s = Scene::new();
    let refused = |n: usize, extra: &[&str]| {
        let hosts: Vec<String> = (0..n).map(|i| format!("h{i}")).collect();
        let out = under_1024_files(&s, &hosts, extra, &["--no-python", "true"]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    };
    let err = refused(400, &["--tree-width", "0"]);
    assert!(
        err.starts_with("nrun: error: 400 nodes need about 2064 open files")
            && err.contains("allows 1024 (hard limit): raise it (ulimit -n 2064"),
        "{err}"
    );
    // 32 x 5 + 568 x 2 + 64: the tree's 32 roots hold pipes here, the rest store connections.
    let err = refused(600, &[]);
    assert!(
        err.starts_with("nrun: error: 600 nodes need about 1360 open files")
            && err.contains("2 per node of the launch tree")
            && err.contains("allows 1024 (hard limit): raise it (ulimit -n 1360"),
        "{err}"
    );
}

/// 400 nodes of this machine (loopback aliases, as the scale benchmark uses) under a hard limit
/// of 1,024 open files: the launch tree starts them too (32 here, the rest from those), so
/// the job runs and exits 0 (issue 21's target); flat, the same job is refused up front.
#[test]
fn four_hundred_local_nodes_run_under_a_limit_of_1024_files() {
    let hosts: Vec<String> = (0..400)
        .map(|i| format!("127.1.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let s = Scene::new();
    // 400 agents starting on a loaded two-core machine.
    let job = [
        "--join-timeout",
        "120",
        "--no-python",
        "sh",
        "-c",
        "echo up",
    ];
    let run = |extra: &[&str]| under_1024_files(&s, &hosts, extra, &job);
    let out = run(&[]);
    let (o, err) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(
        o.lines().filter(|l| l.ends_with("]: up")).count(),
        400,
        "{o}"
    );
    for rank in [0, 31, 32, 399] {
        let host = &hosts[rank];
        // Rank numbers are padded to the widest (399).
        assert!(o.contains(&format!("[{host}:rank{rank:>3}]: up")), "{o}");
    }
    let out = run(&["--tree-width", "0"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("400 nodes need about 2064 open files"),
        "{err}"
    );
    s.assert_no_survivors();
}

/// A node count is bounded as a host list is: c10d lays out every node up front (found by the
/// fuzz: 99999999999 nodes aborted on a 6 TB allocation).
#[test]
fn huge_node_counts_are_usage_errors() {
    usage_error(
        &[
            "--nnodes",
            "99999999999",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:1",
            "--no-python",
            "true",
        ],
        &[],
        "--nnodes \"99999999999\": at most 16384 nodes",
    );
    usage_error(
        &["--nnodes", "1:16385", "--no-python", "true"],
        &[],
        "at most 16384 nodes",
    );
}

/// A seeded sample of hostile values for the flags a one-node run reads, through the real
/// binary (the in-process fuzz in src/plan/fuzz.rs covers every flag): exit 0, 1 or 2, never a
/// panic or a backtrace. The target is always `true`, so nothing runs for long.
#[test]
fn hostile_values_through_the_binary_exit_0_1_or_2() {
    const FLAGS: &[&str] = &[
        "--rdzv-conf",
        "--rdzv-endpoint",
        "--min-busbw",
        "--min-efficiency",
        "--log-line-prefix-template",
        "--monitor-interval",
        "--master-addr",
        "--local-addr",
        "--store-max-bytes",
        "--signals-to-handle",
        "--redirects",
        "--tee",
        "--local-ranks-filter",
        "--stdin",
        "--numa-binding",
        "--color",
        "--role",
        "--shutdown-timeout",
        "--max-restarts",
        "--hang-timeout",
        "--rdzv-id",
        "--preflight-sizes",
        "--nproc",
    ];
    const VALUES: &[&str] = &[
        "",
        "0",
        "1",
        "2",
        "-1",
        "1e400",
        "nan",
        "inf",
        "-inf",
        "[::1",
        "[::1]x",
        "::1]",
        "a:b:c",
        "h:99999",
        ":80",
        "timeout=1e400",
        "is_host=maybe",
        "a=1,b=2",
        "${nope}",
        "${rank",
        "${rank}",
        "0:3,1:1",
        "99999999T",
        "SIGKILL",
        "é",
        "a\nb",
        "\u{1b}[31m",
        "18446744073709551616",
        "x=",
        ",,",
        "[fe80::1]:4",
        "../x",
        "8:1:2",
        "3",
    ];
    // xorshift64*: a fixed sequence, the same on every run.
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |n: usize| {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    };
    let s = Scene::new();
    for _ in 0..40 {
        let mut args: Vec<&str> = Vec::new();
        for _ in 0..1 + next(3) {
            args.push(FLAGS[next(FLAGS.len())]);
            args.push(VALUES[next(VALUES.len())]);
        }
        args.extend(["--no-preflight", "--watch", "off", "--no-python", "true"]);
        let out = s.run(&args, &[]);
        let err = text(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(0..=2)),
            "{args:?}: {:?} {err}",
            out.status
        );
        assert!(
            !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
            "{args:?}: {err}"
        );
    }
}

/// Flags that would override each other in silence are refused at once (exit 2), naming both
/// flags (issue 37): the issue's own `--standalone --rdzv-endpoint` line hung 30 minutes.
#[test]
fn conflicting_flags_name_both_and_exit_2() {
    let s = Scene::new();
    for (args, both) in [
        (
            &[
                "--standalone",
                "--rdzv-endpoint",
                "nosuch.invalid:29400",
                "--nproc",
                "2",
                "ok.py",
            ][..],
            ["--standalone", "--rdzv-endpoint"],
        ),
        (
            &[
                "-H",
                "127.0.0.2,127.0.0.3",
                "--nnodes",
                "3",
                "--no-python",
                "true",
            ],
            ["--nnodes 3", "the host list has 2 hosts"],
        ),
        (
            &[
                "-H",
                "127.0.0.2",
                "--rdzv-backend",
                "c10d",
                "--no-python",
                "true",
            ],
            ["-H", "--rdzv-backend c10d"],
        ),
        (
            &[
                "--master-addr",
                "a",
                "--rdzv-endpoint",
                "b:29400",
                "--nnodes",
                "2",
                "--no-python",
                "true",
            ],
            ["--master-addr a", "--rdzv-endpoint b:29400"],
        ),
        (
            &["--preflight-only", "--preflight", "net", "train.py"],
            ["--preflight-only", "train.py"],
        ),
        (
            &[
                "--no-preflight",
                "--preflight",
                "net",
                "--no-python",
                "true",
            ],
            ["--no-preflight", "--preflight net"],
        ),
    ] {
        let start = std::time::Instant::now();
        let out = s.run(args, &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("nrun: error: "), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        for flag in both {
            assert!(err.contains(flag), "{args:?}: {flag:?} not in {err}");
        }
        // Refused before anything starts (a hang guard, not a benchmark).
        assert!(
            start.elapsed() < HANG,
            "{args:?} took {:?}",
            start.elapsed()
        );
    }
}

/// An explicit `--nnodes 1` with a host list of two is one node, the other a spare, said as
/// the run starts (it ran on both before); from NRUN_NNODES as from the command line.
#[test]
fn explicit_nnodes_1_is_one_node() {
    let s = Scene::new();
    let job = [
        "-H",
        "127.0.0.2,127.0.0.3",
        "--no-python",
        "sh",
        "-c",
        "echo world=$WORLD_SIZE nodes=$GROUP_WORLD_SIZE",
    ];
    for (extra, env) in [
        (&["--nnodes", "1"][..], &[][..]),
        (&[][..], &[("NRUN_NNODES", "1")][..]),
    ] {
        let args: Vec<&str> = extra.iter().chain(job.iter()).copied().collect();
        let out = s.run(&args, env);
        let (o, err) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{err}");
        let lines: Vec<&str> = o.lines().collect();
        assert_eq!(lines.len(), 1, "{o}");
        assert!(lines[0].ends_with("world=1 nodes=1"), "{o}");
        assert!(
            err.contains("the job runs on 1 of 2 hosts (--nnodes 1)")
                && err.contains("spares")
                && err.contains("127.0.0.3"),
            "{err}"
        );
    }
    // Not given: every host of the list.
    let out = s.run(&job, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).lines().count(),
        2,
        "{}",
        text(&out.stdout)
    );
    s.assert_no_survivors();
}

/// `-h` is a short help that fits a screen and points at `--help`; `--help` has every flag.
#[test]
fn short_and_long_help() {
    let s = Scene::new();
    let out = s.run(&["-h"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let short = text(&out.stdout);
    assert!(
        short.lines().count() < 40,
        "{} lines:\n{short}",
        short.lines().count()
    );
    assert!(
        short
            .trim_end()
            .ends_with("nrun --help for all flags, examples and the exit status.")
    );
    for flag in [
        "--nproc-per-node",
        "-H, --hosts",
        "--nnodes",
        "--max-restarts",
        "--no-python",
    ] {
        assert!(short.contains(flag), "-h lacks {flag}");
    }
    assert!(
        !short.contains("--ssh-opts") && !short.contains("[env: "),
        "{short}"
    );
    let long = text(&s.run(&["--help"], &[]).stdout);
    assert!(
        long.lines().count() > 100 && long.contains("--ssh-opts") && long.contains("Examples:")
    );
    assert_eq!(text(&s.run(&["run", "-h"], &[]).stdout), short);
    // -H's help says ranges are taken.
    assert!(
        flat(&long).contains("(gpu[01-16,20]:8)"),
        "-H help lacks ranges"
    );
}

/// `nrun run ...` is the default command; a script or program named run still runs, by its
/// path or after flags.
#[test]
fn run_by_name_and_a_script_named_run() {
    let s = Scene::new();
    let out = s.run(
        &[
            "run",
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            "echo w=$WORLD_SIZE",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).matches("w=2").count(),
        2,
        "{}",
        text(&out.stdout)
    );
    let out = s.run(&["run", "--help"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("--nproc-per-node"));

    let bin = s.dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = bin.join("run");
    std::fs::write(&script, "#!/bin/sh\necho ran \"$@\" rank=$RANK\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for args in [
        &["--no-python", "./run", "a"][..],
        &["--no-python", "run", "a"],
        &["run", "--no-python", "run", "a"],
    ] {
        let out = s
            .cmd(args)
            .current_dir(&bin)
            .env("PATH", &path)
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert_eq!(text(&out.stdout), "ran a rank=0\n", "{args:?}");
    }
}

/// Every command's help ends with an example.
#[test]
fn every_commands_help_has_an_example() {
    let s = Scene::new();
    for cmd in ["run", "doctor", "bisect", "completions", "man"] {
        for help in ["-h", "--help"] {
            let out = s.run(&[cmd, help], &[]);
            assert_eq!(out.status.code(), Some(0), "{cmd} {help}");
            let h = text(&out.stdout);
            let tail: Vec<&str> = h.trim_end().lines().rev().take(8).collect();
            assert!(
                tail.iter().any(|l| l.starts_with("Example"))
                    && tail.iter().any(|l| l.contains(" nrun ")),
                "nrun {cmd} {help} does not end with an example:\n{h}"
            );
        }
    }
}

/// clap's usage errors look like nrun's own: `nrun: error:` first, hint and usage lines
/// indented under it, no blank line, exit 2.
#[test]
fn usage_errors_in_one_style() {
    let s = Scene::new();
    for args in [
        &["--bogus", "x.py"][..],
        &["run"],
        &["--nproc"],
        &["doctor", "--max-restarts", "2"],
    ] {
        let out = s.run(args, &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert!(lines[0].starts_with("nrun: error: "), "{args:?}: {err}");
        assert!(
            lines[1..].iter().all(|l| l.starts_with("  ")),
            "{args:?}: {err}"
        );
        // clap gives a usage line with most errors (not a missing value's).
        assert!(
            err.contains("\n  usage: nrun") || args == ["--nproc"],
            "{args:?}: {err}"
        );
        assert!(
            lines.last().unwrap().starts_with("  hint: "),
            "{args:?}: {err}"
        );
        assert!(
            !err.contains("\n\n") && !err.contains("Usage:"),
            "{args:?}: {err}"
        );
    }
}
