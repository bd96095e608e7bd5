//! nrun at a terminal and in a pipeline, as torchrun users use it: pdb on rank 0 through nrun's
//! stdin on a real pseudo-terminal, progress bars drawn with '\r' shown as they come, stdin
//! piped to rank 0, signals passed on to every worker while the job goes on.

mod common;

use std::time::Duration;

use common::*;

fn python() -> Option<String> {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import pty"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        cannot_set_up("no python3 with the pty module (it drives the terminal)");
    }
    ok.then(|| "python3".to_string())
}

/// What the terminal showed, and how the command ended.
struct Screen {
    chunks: Vec<(f64, String)>,
    status: i64,
    end: f64,
}

impl Screen {
    fn text(&self) -> String {
        self.chunks.iter().map(|(_, c)| c.as_str()).collect()
    }

    /// When `needle` had first been shown (seconds from the start).
    fn shown_at(&self, needle: &str) -> Option<f64> {
        let mut acc = String::new();
        for (t, c) in &self.chunks {
            acc.push_str(c);
            if acc.contains(needle) {
                return Some(*t);
            }
        }
        None
    }
}

/// Runs `nrun ARGS` on a pseudo-terminal, answering each pattern with its text.
fn on_terminal(s: &Scene, answers: &[(&str, &str)], args: &[&str]) -> Screen {
    on_terminal_with(s, answers, args, &[])
}

/// `on_terminal` with more environment: `PTY_SIZE` (the terminal's size), the worker's own.
fn on_terminal_with(
    s: &Scene,
    answers: &[(&str, &str)],
    args: &[&str],
    env: &[(&str, &str)],
) -> Screen {
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(py_script("pty_drive.py"));
    for (p, t) in answers {
        cmd.args([p, t]);
    }
    cmd.arg("--").arg(nrun_bin()).args(args);
    cmd.env("NRUN_TEST_TAG", &s.tag).env("MARK", s.mark());
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "pty_drive: {e}: {}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        )
    });
    Screen {
        chunks: v["chunks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c[0].as_f64().unwrap(), c[1].as_str().unwrap().to_string()))
            .collect(),
        status: v["status"].as_i64().unwrap(),
        end: v["end"].as_f64().unwrap(),
    }
}

#[test]
fn pdb_on_rank_0_through_the_terminal() {
    let Some(py) = python() else { return };
    let s = Scene::new();
    let sc = on_terminal(
        &s,
        &[("(Pdb) ", "p answer + 41\\n"), ("(Pdb) ", "c\\n")],
        &[
            "--nproc",
            "2",
            "--watch",
            "off",
            "--python",
            &py,
            &py_script("pdb_rank0.py"),
        ],
    );
    let t = sc.text();
    assert_eq!(sc.status, 0, "{t}");
    // pdb's answer, on the line after the echoed command. Rank 0's stdout is a terminal too,
    // so readline edits the line and echoes it itself (through nrun, after the prompt), and
    // the answer is a line of rank 0's own.
    let unprefixed = |l: &str| {
        let l = l.trim_end();
        l.strip_prefix("\u{1b}[36m[rank0]: \u{1b}[0m")
            .or_else(|| l.strip_prefix("[rank0]: "))
            .unwrap_or(l)
            .to_string()
    };
    let lines: Vec<String> = t.lines().map(unprefixed).collect();
    let asked = lines
        .iter()
        .position(|l| l.ends_with("p answer + 41"))
        .unwrap_or_else(|| panic!("{t}"));
    assert_eq!(lines.get(asked + 1).map(String::as_str), Some("42"), "{t}");
    assert!(
        t.contains("[rank0]: \u{1b}[0m(Pdb) ") || t.contains("[rank0]: (Pdb) "),
        "{t}"
    );
    assert!(t.contains("rank 0 after the breakpoint"), "{t}");
    assert!(t.contains("rank 1 after the breakpoint"), "{t}");
    s.assert_no_survivors();
}

#[test]
fn a_progress_bar_is_shown_before_its_line_ends() {
    let s = Scene::new();
    // The worker goes on only once the terminal has shown each step (it reads the answer to
    // it): a line shown only when it ended would never end.
    let sc = on_terminal(
        &s,
        &[("10%", "\\n"), ("60%", "\\n")],
        &[
            "--nproc",
            "1",
            "--no-python",
            "sh",
            "-c",
            "printf '10%%\\r'; read x; printf '60%%\\r'; read x; printf '100%%\\n'",
        ],
    );
    let t = sc.text();
    assert_eq!(sc.status, 0, "{t}");
    let (first, last) = (sc.shown_at("10%"), sc.shown_at("100%"));
    assert!(first.is_some() && first <= last, "{t:?}");
    assert!(
        t.contains("10%\r") && t.contains("60%\r") && t.contains("100%"),
        "{t:?}"
    );
    s.assert_no_survivors();
}

#[test]
fn a_pipe_reaches_rank_0_alone() {
    let s = Scene::new();
    let mut c = s.cmd(&[
        "--nproc",
        "2",
        "--no-python",
        "sh",
        "-c",
        "read x; echo \"rank $RANK read [$x]\"",
    ]);
    c.stdin(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"hello from the pipe\n").unwrap();
    }
    let (out, _) = wait_with_timeout(child, Duration::from_secs(20));
    let stdout = text(&out.stdout);
    // `read` fails at the end of /dev/null: rank 1 exits 1, which is the job's exit code.
    assert!(
        stdout.contains("[rank0]: rank 0 read [hello from the pipe]"),
        "{stdout}"
    );
    assert!(stdout.contains("[rank1]: rank 1 read []"), "{stdout}");
    // --stdin none: nobody reads it.
    let mut c = s.cmd(&[
        "--nproc",
        "1",
        "--stdin",
        "none",
        "--no-python",
        "sh",
        "-c",
        "cat; echo end",
    ]);
    c.stdin(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    {
        use std::io::Write;
        let _ = child.stdin.take().unwrap().write_all(b"unread\n");
    }
    let (out, _) = wait_with_timeout(child, Duration::from_secs(20));
    assert_eq!(text(&out.stdout), "end\n");
    s.assert_no_survivors();
}

#[test]
fn sigusr1_reaches_every_worker_and_the_job_goes_on() {
    let Some(py) = python() else { return };
    let s = Scene::new();
    let child = s.spawn(
        &[
            "--nproc",
            "3",
            "--watch",
            "off",
            "--python",
            &py,
            &py_script("usr1_handler.py"),
        ],
        &[],
    );
    s.wait_marks("ready", 3, Duration::from_secs(20));
    signal(&child, "USR1");
    let (out, _) = wait_with_timeout(child, Duration::from_secs(30));
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("rank {r} handled SIGUSR1: True")),
            "{stdout}"
        );
    }
    assert_eq!(s.marks().iter().filter(|l| *l == "handled True").count(), 3);
    s.assert_no_survivors();
}

/// Ctrl-C at the terminal while rank 0 holds its foreground (for pdb): the whole job stops as
/// if nrun had received it, with the interrupt's exit code, not a failure of rank 0.
#[test]
fn ctrl_c_at_the_terminal_stops_the_job() {
    let Some(py) = python() else { return };
    let s = Scene::new();
    let sc = on_terminal(
        &s,
        // Both ranks ready (either order), then Ctrl-C.
        &[("ready", ""), ("ready", "\\x03")],
        &[
            "--nproc",
            "2",
            "--watch",
            "off",
            "--python",
            &py,
            &py_script("sleep_ready.py"),
        ],
    );
    let t = sc.text();
    assert_eq!(sc.status, 130, "ended {:.1} s in: {t}", sc.end);
    assert!(
        t.contains("stopped by SIGINT; every worker was stopped"),
        "{t}"
    );
    assert!(!t.contains("first failure"), "{t}");
    // (The ranks sleep 600 s and pty_drive.py kills what runs past 120 s: status 130 is the
    // interrupt's doing.)
    s.assert_no_survivors();
}

/// `nrun ... | head -2`, with the real `head` in a shell pipeline: once head has exited, nrun's
/// next write of the workers' output finds the pipe closed and the job stops, as torchrun's
/// does (its workers die of BrokenPipeError there): said once on stderr, exit 141 (SIGPIPE)
/// under `pipefail`, every worker gone. On one node (nrun writes the workers' lines itself)
/// and two (nrun relays its agents' pipes); and with `2>&1`, where nrun's own stderr is the
/// closed pipe too (nothing can be said, the job still ends).
#[test]
fn a_pipe_whose_reader_exits_ends_the_job() {
    let Some(py) = python() else { return };
    for (hosts, merged) in [
        ("", false),
        ("-H localhost,127.0.0.1", false),
        ("", true),
        ("-H localhost,127.0.0.1", true),
    ] {
        let s = Scene::new();
        let line = format!(
            "set -o pipefail; '{}' {hosts} --nproc 2 --watch off --python {py} '{}' {} | head -2; \
             echo \"statuses ${{PIPESTATUS[*]}}\" >&2",
            nrun_bin().display(),
            py_script("print_forever.py"),
            if merged { "2>&1" } else { "" }
        );
        let mut c = std::process::Command::new("bash");
        c.args(["-c", &line])
            .env("NRUN_TEST_TAG", &s.tag)
            .env("MARK", s.mark())
            .env_remove("NRUN_LOG")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let (out, _) = wait_with_timeout(c.spawn().unwrap(), Duration::from_secs(60));
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        let case = format!("{hosts} merged={merged}");
        assert_eq!(stdout.lines().count(), 2, "{case}: {stdout}");
        assert!(stderr.contains("statuses 141 0"), "{case}: {stderr}");
        if !merged {
            assert!(
                stdout
                    .lines()
                    .all(|l| l.contains("rank") && l.contains(" line ")),
                "{case}: {stdout}"
            );
            assert_eq!(
                stderr.matches("a pipe whose reader exited").count(),
                1,
                "{case}: {stderr}"
            );
            assert!(
                stderr.contains("stopped by SIGPIPE; every worker was stopped"),
                "{case}: {stderr}"
            );
        }
        s.assert_no_survivors();
    }
}

/// On a terminal, each worker's stdout and stderr are a terminal too, of nrun's size less the
/// rank prefix, so tqdm draws a full-width bar and rich and Python colour, as under torchrun
/// (whose workers write to the terminal itself); on one node ("[rank0]: ", 9 columns) and on
/// two, whose agents start the workers ("[localhost:rank0]: ", 19). A stream that goes to a
/// log file, or nrun's own output into a pipe, stays a pipe.
#[test]
fn workers_see_a_terminal_of_nruns_width() {
    let Some(py) = python() else { return };
    let shape = py_script("terminal_shape.py");
    let args = |extra: &[&'static str]| -> Vec<String> {
        let mut a: Vec<String> = extra.iter().map(|x| x.to_string()).collect();
        a.extend(["--nproc", "2", "--watch", "off", "--python", &py, &shape].map(String::from));
        a
    };
    for (hosts, cols) in [(&[][..], 91), (&["-H", "localhost,127.0.0.1"][..], 81)] {
        let s = Scene::new();
        let a = args(hosts);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let sc = on_terminal_with(&s, &[], &a, &[("PTY_SIZE", "100x30")]);
        let t = sc.text();
        assert_eq!(sc.status, 0, "{t}");
        let ranks = if hosts.is_empty() { 2 } else { 4 };
        for r in 0..ranks {
            for stream in ["stdout", "stderr"] {
                let want = format!("rank {r} {stream} tty=True size=({cols}, 30)");
                assert!(t.contains(&want), "{want}: {t:?}");
            }
            // tqdm's bar, where installed: as wide as the worker's terminal, not the 10
            // columns it draws into a pipe.
            if !t.contains(&format!("rank {r} has no tqdm")) {
                let bar = t
                    .split(['\r', '\n'])
                    .find(|l| l.contains(&format!("bar{r}: 100%")))
                    .unwrap_or_else(|| panic!("{t:?}"));
                let body = bar.split('|').nth(1).unwrap_or("");
                assert!(body.chars().count() > 20, "{bar:?}");
            }
        }
        s.assert_no_survivors();
    }
    // Into a pipe, or with a log file taking the streams: pipes, as for torchrun's workers.
    let s = Scene::new();
    let logs = s.dir.path().join("logs");
    let logs = logs.to_str().unwrap().to_string();
    for extra in [vec![], vec!["--log-dir".to_string(), logs]] {
        let mut a = args(&[]);
        a.splice(0..0, extra);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = s.run(&a, &[]);
        let all = text(&out.stdout) + &text(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{all}");
        assert_eq!(all.matches("tty=False size=None").count(), 4, "{all}");
    }
    s.assert_no_survivors();
}

/// A resized terminal resizes the workers' terminals, less the prefix, and each worker gets
/// SIGWINCH, as under torchrun, whose workers share the terminal: on one node with rank 0
/// holding the terminal's foreground (it reads stdin; the terminal's SIGWINCH goes to it, not
/// to nrun) and with `--stdin none` (nrun's own SIGWINCH); on two, whose agents are told the
/// launcher's new size ("[localhost:rank0]: ", 19 columns).
#[test]
fn a_resized_terminal_resizes_the_workers() {
    let Some(py) = python() else { return };
    let resize = py_script("terminal_resize.py");
    let cases: [(&[&str], usize, &str); 3] = [
        (&["--stdin", "0"], 2, "111x40"),
        (&["--stdin", "none"], 2, "111x40"),
        (&["-H", "localhost,127.0.0.1"], 4, "101x40"),
    ];
    for (extra, ranks, want) in cases {
        let s = Scene::new();
        // Every rank's handler is in, then the terminal is made larger.
        let mut answers = vec![("resize-ready", ""); ranks - 1];
        answers.push(("resize-ready", "@resize 120x40"));
        let mut args = vec!["--nproc", "2", "--watch", "off"];
        args.extend(extra);
        args.extend(["--python", &py, &resize]);
        let sc = on_terminal_with(
            &s,
            &answers,
            &args,
            &[("PTY_SIZE", "100x30"), ("WANT", want)],
        );
        let t = sc.text();
        assert_eq!(sc.status, 0, "{extra:?}: {t}");
        let (c, r) = want.split_once('x').unwrap();
        for rank in 0..ranks {
            let said = format!("rank {rank} resized to ({c}, {r}) on SIGWINCH");
            assert!(t.contains(&said), "{extra:?}: {said}: {t:?}");
        }
        s.assert_no_survivors();
    }
}

/// Issue 46: each worker on a terminal takes two of the host's ptys; a group gives terminals
/// to at most 64 workers (fewer where the host has few free), the others write into pipes,
/// and nrun says so once. Their output reaches the terminal all the same.
#[test]
fn terminals_for_workers_are_bounded_and_said() {
    // The bound is 64 where the host has ptys to spare (384 free, and room for the test's own).
    let read = |f: &str| -> Option<usize> {
        std::fs::read_to_string(format!("/proc/sys/kernel/pty/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    if let (Some(max), Some(nr)) = (read("max"), read("nr"))
        && max.saturating_sub(nr) < 1024
    {
        cannot_set_up(&format!(
            "too few free ptys: {max} (kernel.pty.max), {nr} in use; it needs 1,024 free"
        ));
        return;
    }
    let s = Scene::new();
    let sc = on_terminal(
        &s,
        &[],
        &[
            "--nproc",
            "70",
            "--watch",
            "off",
            "--no-python",
            "sh",
            "-c",
            "if [ -t 1 ]; then echo is-a-tty; else echo is-a-pipe; fi",
        ],
    );
    let t = sc.text();
    assert_eq!(sc.status, 0, "{t}");
    assert_eq!(t.matches("is-a-tty").count(), 64, "{t}");
    assert_eq!(t.matches("is-a-pipe").count(), 6, "{t}");
    assert!(
        t.contains("70 workers on this host write to the terminal: the first 64"),
        "{t}"
    );
    s.assert_no_survivors();
}
