//! Thousands of local workers end, normally and on SIGTERM, with nrun's memory bounded (issue
//! 35, item 2: 2,048 workers' end ran nrun out of memory). Each run is inside a memory cgroup
//! with its workers, so a regression fails the test (the OOM killer ends nrun), not the machine.
//! Skipped, said (a failure under scripts/test.sh), where no memory cgroup can be made (not
//! root, no cgroup v2 or v1 memory controller).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cgroup::MemCgroup;
use common::*;

const WORKERS: usize = 2048;
/// The cgroup's limit: nrun and its 2,048 workers.
const LIMIT: u64 = 2 << 30;
/// nrun's own peak resident memory, at most.
const NRUN_RSS: u64 = 256 << 20;

/// Starts nrun in `cg` (moved in before its exec, so its workers are in it too), with an
/// open-file limit that allows the workers' pipes.
fn spawn_in(cg: &MemCgroup, s: &Scene, args: &str) -> Child {
    let script = format!(
        "echo $$ > {}/cgroup.procs && ulimit -n 65536 2>/dev/null; exec {} {args}",
        cg.dir.display(),
        nrun_bin().display()
    );
    let mut c = Command::new("sh");
    c.args(["-c", &script])
        .env("NRUN_TEST_TAG", &s.tag)
        .env("MARK", s.mark())
        .env_remove("NRUN_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c.spawn().unwrap()
}

/// The highest VmHWM seen of the real nrun (the keeper's first child) until `keeper` exits, and
/// its exit. Peak memory only grows, so the last reading is what it came to.
fn watch_nrun(mut keeper: Child) -> (std::process::Output, u64) {
    let k = keeper.id();
    let mut hwm = 0u64;
    let began = Instant::now();
    loop {
        if let Some(nrun) = std::fs::read_to_string(format!("/proc/{k}/task/{k}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .next()
        {
            let status =
                std::fs::read_to_string(format!("/proc/{nrun}/status")).unwrap_or_default();
            if let Some(kb) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            {
                hwm = hwm.max(kb << 10);
            }
        }
        if keeper.try_wait().unwrap().is_some() {
            break;
        }
        // A hung guard: 2,048 workers take seconds to start on a loaded machine, not minutes.
        if began.elapsed() > Duration::from_secs(300) {
            let _ = keeper.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (keeper.wait_with_output().unwrap(), hwm)
}

fn assert_bounded(cg: &MemCgroup, hwm: u64, err: &str) {
    let peak = cg.peak();
    eprintln!(
        "{WORKERS} workers: nrun's peak RSS {} MiB, the cgroup's peak {} MiB",
        hwm >> 20,
        peak >> 20
    );
    assert!(hwm > 0, "nrun's memory was never read: {err}");
    assert!(hwm < NRUN_RSS, "nrun's peak RSS {hwm} bytes: {err}");
    assert!(peak < LIMIT, "the cgroup's peak {peak} bytes: {err}");
    // Nothing of the job is left in the cgroup (its keeper swept it before exiting; the kernel
    // takes a moment to remove what was killed).
    wait_until(&format!("the cgroup to empty; nrun said: {err}"), || {
        cg.procs().is_empty()
    });
}

#[test]
fn two_thousand_workers_end_within_a_memory_bound() {
    let Some(cg) = MemCgroup::new("end", LIMIT) else {
        return;
    };
    let s = Scene::new();
    let nrun = spawn_in(
        &cg,
        &s,
        &format!("--nproc {WORKERS} --no-python /bin/sleep 1"),
    );
    let (out, hwm) = watch_nrun(nrun);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_bounded(&cg, hwm, &err);
    s.assert_no_survivors();
}

#[test]
fn two_thousand_workers_stop_on_sigterm_within_a_memory_bound() {
    let Some(cg) = MemCgroup::new("sigterm", LIMIT) else {
        return;
    };
    let s = Scene::new();
    let marks = s.dir.path().join("started");
    std::fs::create_dir(&marks).unwrap();
    // Each worker leaves a file named by its rank once it runs, then waits to be stopped.
    let nrun = spawn_in(
        &cg,
        &s,
        &format!(
            "--nproc {WORKERS} --no-python sh -c 'touch {}/$RANK; exec sleep 600'",
            marks.display()
        ),
    );
    // A hung guard: 2,048 workers take seconds to start on a loaded machine, not minutes.
    wait_until_within(
        &format!("all {WORKERS} workers to start"),
        Duration::from_secs(300),
        || std::fs::read_dir(&marks).unwrap().count() >= WORKERS,
    );
    signal(&nrun, "TERM");
    let (out, hwm) = watch_nrun(nrun);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert_bounded(&cg, hwm, &err);
    s.assert_no_survivors();
}
