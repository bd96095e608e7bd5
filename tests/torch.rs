//! Real torch.distributed clients against nrun's store and under nrun's supervision. Needs the
//! venv that scripts/test.sh makes (or NRUN_TEST_PYTHON); without it each test says it skipped
//! (a failure under scripts/test.sh: see common's `cannot_set_up`).

mod common;

use std::time::Duration;

use common::*;

fn python_or_skip() -> Option<String> {
    need_torch().map(|p| p.display().to_string())
}

#[test]
fn every_store_operation_from_torchs_client() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let s = Scene::new();
    let out = s.run(&["--python", &py, &py_script("store_compat.py")], &[]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("14 passed, 0 failed"), "{stdout}");
}

/// The same checks against PyTorch's own (libuv) server: the expectations are torch's.
#[test]
fn store_expectations_hold_on_torchs_own_server() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let out = std::process::Command::new(&py)
        .args([&py_script("store_compat.py"), "--reference"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("14 passed, 0 failed"));
}

#[test]
fn gloo_all_reduce_on_four_ranks() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let s = Scene::new();
    let out = s.run_python(&py, "4", &py_script("gloo_allreduce.py"));
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    for r in 0..4 {
        assert!(
            stdout.contains(&format!("[rank{r}]: rank {r}/4: all_reduce ok (10)")),
            "{stdout}"
        );
    }
    s.assert_no_survivors();
}

#[test]
fn ddp_example_trains() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let s = Scene::new();
    let train = format!("{}/examples/train.py", env!("CARGO_MANIFEST_DIR"));
    let out = s.run(
        &["--nproc", "2", "--python", &py, &train, "--steps", "5"],
        &[],
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(
        stdout.contains("[rank0]: done: 5 steps on 2 ranks"),
        "{stdout}"
    );
}

/// A worker decorated with torch's @record writes its traceback to TORCHELASTIC_ERROR_FILE;
/// the failure summary shows it.
#[test]
fn failure_summary_shows_the_error_file_traceback() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let s = Scene::new();
    let out = s.run_python(&py, "2", &py_script("fail_with_record.py"));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("rank 1 of 2 exited with code 1 (first failure"),
        "{err}"
    );
    assert!(err.contains("traceback (from "), "{err}");
    assert!(err.contains("ValueError: rank 1 cannot go on"), "{err}");
    s.assert_no_survivors();
}

/// Restarted workers rendezvous again on the same store: stale keys of the failed attempt
/// must not leak into the next one.
#[test]
fn restart_rendezvous_again() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let s = Scene::new();
    let child = s.spawn(
        &[
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            "--python",
            &py,
            &py_script("fail_first_attempt.py"),
        ],
        &[],
    );
    let (out, _) = wait_with_timeout(child, Duration::from_secs(120));
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("attempt 1 all_reduce ok"), "{stdout}");
}

/// Every option of the installed torch's `torchrun` parser, with both spellings, is accepted by
/// nrun on a one-node command line (with a value where it takes one).
#[test]
fn every_torchrun_flag_parses() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let dump = std::process::Command::new(&py)
        .args([
            "-c",
            "import json; from torch.distributed.run import get_args_parser as g\n\
             print(json.dumps([[a.option_strings, a.nargs == 0] for a in g()._actions if a.option_strings]))",
        ])
        .output()
        .unwrap();
    assert!(dump.status.success(), "{}", text(&dump.stderr));
    let opts: Vec<(Vec<String>, bool)> = serde_json::from_slice(&dump.stdout).unwrap();
    assert!(opts.len() > 30, "{opts:?}");
    let s = Scene::new();
    let logs = s.dir.path().join("logs").display().to_string();
    let hello = s.dir.path().join("hello.py").display().to_string();
    std::fs::write(&hello, "print('hello')\n").unwrap();
    // A value each valued option can take on one node; the rest take torch's own defaults.
    let value = |flag: &str| -> &str {
        match flag.trim_start_matches('-').replace('_', "-").as_str() {
            "nnodes" => "1:1",
            "nproc-per-node" => "1",
            "rdzv-backend" => "static",
            "rdzv-endpoint" => "127.0.0.1:0",
            "rdzv-id" => "flagtest",
            "rdzv-conf" => "join_timeout=30,read_timeout=60",
            "max-restarts" => "0",
            "monitor-interval" => "0.1",
            "start-method" => "spawn",
            "event-log-handler" => "null",
            "role" => "trainer",
            "log-dir" => &logs,
            "r" | "redirects" | "t" | "tee" => "0",
            "log-line-prefix-template" => "[${role_name}${rank}]:",
            "local-ranks-filter" => "0",
            "duplicate-stdout-filters" | "duplicate-stderr-filters" => "x",
            "node-rank" => "0",
            "master-addr" => "127.0.0.1",
            "master-port" => "0",
            "local-addr" => "127.0.0.1",
            "logs-specs" => "default",
            "numa-binding" => "node",
            "signals-to-handle" => "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "shutdown-timeout" => "5",
            "print-completion" => "bash",
            other => panic!("no test value for torchrun's --{other}: add one (and support it)"),
        }
    };
    let mut failed = Vec::new();
    for (spellings, flag_only) in &opts {
        for spelling in spellings.iter().filter(|s| *s != "-h" && *s != "--help") {
            let mut args = vec![spelling.as_str()];
            if !flag_only {
                args.push(value(spelling));
            }
            // numa binding needs GPUs to mean anything; it is accepted either way.
            args.extend(["--no-preflight", "--watch", "off", "--no-python", "true"]);
            if *spelling == "-m" || *spelling == "--module" {
                args.truncate(1);
                args.extend(["--no-preflight", "--python", &py, "json.tool", "--help"]);
            }
            if spelling.contains("run") && spelling.contains("path") {
                args.truncate(1);
                args.extend(["--no-preflight", "--python", &py, &hello]);
            }
            if spelling.contains("no-python") || spelling.contains("no_python") {
                args.truncate(1);
                args.extend(["--no-preflight", "true"]);
            }
            let out = s.run(&args, &[]);
            let ok = match spelling.contains("completion") {
                true => out.status.success() && text(&out.stdout).contains("complete"),
                false => out.status.success(),
            };
            if !ok {
                failed.push(format!(
                    "{}: exit {:?}: {}",
                    args.join(" "),
                    out.status.code(),
                    text(&out.stderr)
                ));
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

/// A small seeded generator (xorshift64*), so a failing fuzz case can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn key(&mut self) -> Vec<u8> {
        // Mostly a small set of names (collisions, counters, appends), sometimes anything.
        match self.below(8) {
            0 => self.bytes(64),
            _ => format!("/k{}", self.below(32)).into_bytes(),
        }
    }
}

/// One generated request: well formed, or cut short, flipped, or followed by garbage.
fn fuzz_frame(r: &mut Rng) -> Vec<u8> {
    use nrun_store::protocol::Request as R;
    let keys = |r: &mut Rng| (0..r.below(6)).map(|_| r.key()).collect::<Vec<_>>();
    let req = match r.below(15) {
        0 => R::Set {
            key: r.key(),
            value: r.bytes(512),
        },
        1 => R::CompareSet {
            key: r.key(),
            expected: r.bytes(16),
            desired: r.bytes(256),
        },
        2 => R::Get { key: r.key() },
        3 => R::Add {
            key: r.key(),
            delta: r.next() as i64 % 1000,
        },
        4 => R::Check { keys: keys(r) },
        5 => R::Wait { keys: keys(r) },
        6 => R::GetNumKeys,
        7 => R::DeleteKey { key: r.key() },
        8 => R::Append {
            key: r.key(),
            value: r.bytes(512),
        },
        9 => R::MultiGet { keys: keys(r) },
        10 => R::MultiSet {
            pairs: (0..r.below(4)).map(|_| (r.key(), r.bytes(256))).collect(),
        },
        11 => R::CancelWait,
        12 => R::Ping {
            nonce: r.next() as u32,
        },
        13 => R::QueuePush {
            key: r.key(),
            value: r.bytes(256),
        },
        _ => R::QueuePop { key: r.key() },
    };
    let mut v = Vec::new();
    req.encode(&mut v);
    match r.below(10) {
        0 if !v.is_empty() => v.truncate(r.below(v.len() as u64) as usize),
        1 if !v.is_empty() => {
            let i = r.below(v.len() as u64) as usize;
            v[i] ^= 1 << r.below(8);
        }
        2 => v.extend(r.bytes(64)),
        _ => {}
    }
    v
}

/// 20,000 generated frames (seeded) against the store of a running nrun under a 2 GiB address
/// space limit: nrun survives, its memory stays bounded, and a real torch client still gets
/// answers.
#[test]
fn fuzzed_frames_do_not_hurt_the_store() {
    use std::io::{Read, Write};
    let Some(py) = python_or_skip() else {
        return;
    };
    let port = common::free_port();
    let s = Scene::new();
    let mut c = s.cmd(&[
        "--master-port",
        &port.to_string(),
        "--no-python",
        "sleep",
        "120",
    ]);
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        c.pre_exec(|| {
            let two_gib = 2u64 << 30;
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_AS, two_gib, two_gib)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = c.spawn().unwrap();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    wait_until("nrun's store to listen", || {
        std::net::TcpStream::connect(addr).is_ok()
    });
    // nrun itself is the keeper's child.
    let nrun_pid: u32 = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id()))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let rss_mib = || {
        std::fs::read_to_string(format!("/proc/{nrun_pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib / 1024)
    };
    let before = rss_mib();
    let mut rng = Rng(0x6e72_756e_2d66_757a);
    let mut sent = 0;
    while sent < 20_000 {
        let Ok(mut conn) = std::net::TcpStream::connect(addr) else {
            panic!("the store stopped accepting after {sent} frames");
        };
        conn.set_read_timeout(Some(Duration::from_millis(2)))
            .unwrap();
        conn.set_write_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let _ = conn.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c]);
        for _ in 0..10 {
            let _ = conn.write_all(&fuzz_frame(&mut rng));
            sent += 1;
        }
        let mut sink = [0u8; 4096];
        let _ = conn.read(&mut sink);
        // Dropped: waits and half-read frames end with the connection.
    }
    let after = rss_mib();
    assert!(
        child.try_wait().unwrap().is_none(),
        "nrun died under the fuzz"
    );
    assert!(
        after < before + 128,
        "nrun's RSS grew from {before} to {after} MiB"
    );
    let probe = format!(
        "import datetime, torch.distributed as d\n\
         s = d.TCPStore('127.0.0.1', {port}, is_master=False, timeout=datetime.timedelta(seconds=10))\n\
         s.set('after-fuzz', 'ok'); assert s.get('after-fuzz') == b'ok'; assert s.add('ctr', 2) == 2\n\
         s.wait(['after-fuzz']); print('torch client ok')"
    );
    let out = std::process::Command::new(&py)
        .args(["-c", &probe])
        .output()
        .unwrap();
    assert!(
        text(&out.stdout).contains("torch client ok"),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    signal(&child, "TERM");
    let _ = wait_with_timeout(child, Duration::from_secs(10));
    s.assert_no_survivors();
}

/// The launcher's TORCHELASTIC_ERROR_FILE and the workers' environment as torchrun writes
/// them (issue 23, item 12): torch's own ProcessFailure reads the file's timestamp as epoch
/// seconds, and workers see TORCHELASTIC_SIGNALS_TO_HANDLE.
#[test]
fn launcher_error_file_and_env_read_as_torchs() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let s = Scene::new();
    let launcher = s.dir.path().join("launcher-error.json");
    let launcher_s = launcher.display().to_string();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            "echo SIGS=$TORCHELASTIC_SIGNALS_TO_HANDLE; [ $RANK = 1 ] && { echo boom >&2; exit 3; }; sleep 5",
        ],
        &[("TORCHELASTIC_ERROR_FILE", &launcher_s)],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("SIGS=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"),
        "{}",
        text(&out.stdout)
    );
    let read = std::process::Command::new(&py)
        .args([
            "-c",
            "import sys\n\
             from torch.distributed.elastic.multiprocessing.errors import ProcessFailure\n\
             f = ProcessFailure(local_rank=1, pid=1, exitcode=3, error_file=sys.argv[1])\n\
             print(f.timestamp, f.error_file_data['message']['errorCode'])",
            &launcher_s,
        ])
        .output()
        .unwrap();
    assert!(read.status.success(), "{}", text(&read.stderr));
    let got = text(&read.stdout);
    let mut it = got.split_whitespace();
    let ts: u64 = it.next().unwrap().parse().unwrap();
    assert!(
        ts >= before && ts <= before + 60,
        "timestamp {ts}, started at {before}"
    );
    assert_eq!(it.next(), Some("3"), "{got}");
    // A signal list of the user's own passes through as given.
    let out = s.run(
        &[
            "--signals-to-handle",
            "SIGTERM,SIGUSR1",
            "--no-python",
            "sh",
            "-c",
            "echo SIGS=$TORCHELASTIC_SIGNALS_TO_HANDLE",
        ],
        &[],
    );
    assert_eq!(text(&out.stdout), "SIGS=SIGTERM,SIGUSR1\n");
}

/// torch's excepthook already starts each traceback line with "[rank1]: "; nrun's console
/// says the rank once, as torchrun shows it (issue 23, item 7).
#[test]
fn torchs_own_rank_prefix_is_not_doubled() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let s = Scene::new();
    let out = s.run_python(&py, "2", &py_script("raise_after_init.py"));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("[rank1]: Traceback (most recent call last):"),
        "{err}"
    );
    assert!(
        err.contains("[rank1]: ValueError: rank 1 cannot go on"),
        "{err}"
    );
    assert!(!err.contains("[rank1]: [rank1]: "), "{err}");
    s.assert_no_survivors();
}

/// torchrun (the venv's own) hosting a c10d rendezvous with nrun joining it, and the reverse:
/// each nrun says the endpoint is the other launcher's, within its join timeout (issue 23,
/// item 2).
#[test]
fn mixed_launchers_are_named_both_ways() {
    let Some(py) = python_or_skip() else {
        return;
    };
    let torchrun = std::path::Path::new(&py).with_file_name("torchrun");
    assert!(torchrun.exists(), "{} is missing", torchrun.display());
    let s = Scene::new();
    let c10d = |endpoint: &str, timeout: &str| {
        [
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-id",
            "mixed",
            "--rdzv-endpoint",
            endpoint,
            "--join-timeout",
            timeout,
        ]
        .map(String::from)
    };
    let torchrun_node = |endpoint: &str| {
        std::process::Command::new(&torchrun)
            .args(c10d(endpoint, "20")[..8].iter())
            .args(["--nproc-per-node", "1", "--no-python", "sleep", "30"])
            .env("NRUN_TEST_TAG", &s.tag)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };

    // torchrun hosts; nrun joins and says so at once.
    let endpoint = format!("127.0.0.1:{}", common::free_port());
    let mut host = torchrun_node(&endpoint);
    // Once torchrun holds the port, nrun joins (rather than hosts); torchrun writes its
    // rendezvous state soon after, and nrun waits for a rendezvous until then.
    wait_until("torchrun to bind the endpoint", || {
        std::net::TcpListener::bind(&endpoint).is_err()
    });
    let mut args: Vec<String> = c10d(&endpoint, "20").into();
    args.extend(["--no-python", "true"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = s.run(&args, &[]);
    let _ = host.kill();
    let _ = host.wait();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(95), "{err}");
    assert!(
        err.contains(
            "this endpoint is a torchrun rendezvous (every node must use the same launcher)"
        ),
        "{err}"
    );
    assert!(!err.contains("give every node the same --rdzv-id"), "{err}");

    // nrun hosts; a torchrun comes to it; nrun says so when its join timeout ends.
    let endpoint = format!("127.0.0.1:{}", common::free_port());
    // torchrun's Python takes seconds to start on a loaded machine (over 20 s beside two CPU
    // hogs): a join timeout with room, as nrun names it only when its join timeout ends.
    let mut args: Vec<String> = c10d(&endpoint, "60").into();
    args.extend(["--no-python", "true"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let nrun = s.spawn(&args, &[]);
    // Once nrun holds the port, torchrun comes to it (rather than hosting).
    wait_until("nrun to bind the endpoint", || {
        std::net::TcpListener::bind(&endpoint).is_err()
    });
    let mut joiner = torchrun_node(&endpoint);
    // Ends when its join timeout does (the wait's hang guard tells that from waiting on).
    let (out, _) = wait_with_timeout(nrun, HANG);
    let _ = joiner.kill();
    let _ = joiner.wait();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(95), "{err}");
    assert!(
        err.contains("a torchrun node came to 127.0.0.1:")
            && err.contains(
                "this endpoint is an nrun rendezvous (every node must use the same launcher)"
            ),
        "{err}"
    );
}
