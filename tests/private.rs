//! nrun on a host other users share (issue 35): its scratch and log directories are private
//! (random name, 0700, files 0600), it reads no file another user could have planted (fake
//! scratch directories, flight-recorder dumps, `/tmp/nccl_trace_rank_N`), refuses a planted
//! `.nrun_env` or `--log-dir` with a message naming it, reads only bounded regular files, and
//! takes only a plain `--rdzv-id`.
//!
//! The second user: where the tests run as root, `nrun-other` (made with `useradd` if absent)
//! plants files with `setpriv`; elsewhere those tests skip, said (a failure under
//! scripts/test.sh: see common's `cannot_set_up`).

mod common;

use common::*;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const OTHER: &str = "nrun-other";

/// The second user's uid, made if absent; None (after `cannot_set_up`) where that cannot be.
fn other_user() -> Option<u32> {
    if !need_root(&format!("a second local user ({OTHER}) to plant files")) {
        return None;
    }
    let uid = || {
        let o = Command::new("id").args(["-u", OTHER]).output().ok()?;
        String::from_utf8_lossy(&o.stdout).trim().parse().ok()
    };
    if uid().is_none() {
        let made = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
            ])
            .arg(OTHER)
            .status();
        // Another test binary may have made it meanwhile.
        if !made.is_ok_and(|s| s.success()) && uid().is_none() {
            cannot_set_up(&format!(
                "useradd {OTHER} failed (a second user to plant files)"
            ));
            return None;
        }
    }
    if !need_tool("setpriv", "util-linux") {
        return None;
    }
    uid()
}

/// Runs the shell script `script` as the second user; panics if it fails.
fn as_other(script: &str) {
    let out = Command::new("setpriv")
        .args(["--reuid", OTHER, "--regid", OTHER, "--clear-groups", "--"])
        .args(["sh", "-ec", script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "as {OTHER}: {script}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A pickle that, once loaded, runs `touch <marker>`: what a planted dump would do.
fn evil_pickle(marker: &Path) -> Vec<u8> {
    format!("cos\nsystem\n(S'touch {}'\ntR.", marker.display()).into_bytes()
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Every directory under `root` (itself included) 0700, every file 0600, all this user's.
fn assert_private_tree(root: &Path) -> usize {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let mut n = 0;
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        assert_eq!(mode(&d), 0o700, "{}", d.display());
        assert_eq!(std::fs::metadata(&d).unwrap().uid(), me, "{}", d.display());
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                todo.push(e.path());
            } else {
                assert_eq!(m.mode() & 0o7777, 0o600, "{}", e.path().display());
                n += 1;
            }
        }
    }
    n
}

#[test]
fn scratch_and_log_directories_are_private() {
    // The workers' error files, without --log-dir: in the scratch directory of the nrun that
    // runs them, `$TMPDIR/nrun-<pid>-<10 hex>`, 0700 down to the attempt's directory.
    let s = Scene::new();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--no-python",
            "sh",
            "-c",
            r#"d=$(dirname "$TORCHELASTIC_ERROR_FILE"); echo "$d $(stat -c %a "$d") $(stat -c %a "$d/../..")" >> "$MARK""#,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let marks = s.marks();
    assert_eq!(marks.len(), 2, "{marks:?}");
    for m in &marks {
        let f: Vec<&str> = m.split(' ').collect();
        assert_eq!(&f[1..], ["700", "700"], "{m}");
        let dir = Path::new(f[0]);
        assert!(dir.ends_with("job/attempt_0"), "{m}");
        let root = dir.parent().unwrap().parent().unwrap();
        let name = root.file_name().unwrap().to_str().unwrap();
        let (pid, random) = name
            .strip_prefix("nrun-")
            .and_then(|n| n.split_once('-'))
            .unwrap_or_else(|| panic!("{name}"));
        assert!(pid.parse::<u32>().is_ok(), "{name}");
        assert!(
            random.len() == 10 && random.bytes().all(|b| b.is_ascii_hexdigit()),
            "{name}"
        );
        assert_eq!(root.parent(), Some(std::env::temp_dir().as_path()), "{m}");
        // Gone with the job.
        assert!(!root.exists(), "{} left behind", root.display());
    }

    // --log-dir: 0700 directories, 0600 files (torchrun's run directory is private too).
    let logs = s.dir.path().join("logs");
    let out = s.run(
        &[
            "--nproc",
            "2",
            "--log-dir",
            logs.to_str().unwrap(),
            "--redirects",
            "3",
            "--no-python",
            "sh",
            "-c",
            "echo out; echo err >&2",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(assert_private_tree(&logs), 4, "two logs per worker");

    // The default log directory (no --log-dir, --redirects): `$TMPDIR/nrun-logs-<id>_<random>`.
    let id = format!("wdlogs{}", std::process::id());
    let out = s.run(
        &[
            "--nproc",
            "1",
            "--rdzv-id",
            &id,
            "--redirects",
            "3",
            "--no-python",
            "true",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let prefix = format!("nrun-logs-{id}_");
    let made: Vec<PathBuf> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    assert_eq!(made.len(), 1, "{made:?}");
    let n = assert_private_tree(&made[0]);
    std::fs::remove_dir_all(&made[0]).unwrap();
    assert_eq!(n, 2);
}

#[test]
fn nrun_env_must_be_a_small_regular_file() {
    let s = Scene::new();
    let home = s.dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let env_file = home.join(".nrun_env");
    let run = |cwd: &Path| {
        let mut c = s.cmd(&["--nproc", "1", "--no-python", "true"]);
        c.env("HOME", &home).current_dir(cwd);
        let (out, took) = wait_with_timeout(c.spawn().unwrap(), Duration::from_secs(60));
        assert!(took < Duration::from_secs(60), "nrun hung");
        out
    };
    // A symlink to /dev/zero (endless) and a FIFO (no writer: an open that never returns).
    std::os::unix::fs::symlink("/dev/zero", &env_file).unwrap();
    let out = run(s.dir.path());
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&env_file.display().to_string()) && err.contains("is a device"),
        "{err}"
    );
    std::fs::remove_file(&env_file).unwrap();
    let c = std::ffi::CString::new(env_file.to_str().unwrap()).unwrap();
    // SAFETY: a plain syscall on a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let out = run(s.dir.path());
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&env_file.display().to_string()) && err.contains("is a FIFO"),
        "{err}"
    );
    std::fs::remove_file(&env_file).unwrap();
    // Larger than 1 MiB, in the cwd this time.
    let cwd = s.dir.path().join("cwd");
    std::fs::create_dir(&cwd).unwrap();
    std::fs::write(cwd.join(".nrun_env"), vec![b'#'; (1 << 20) + 1]).unwrap();
    let out = run(&cwd);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cwd/.nrun_env") && err.contains("larger than 1 MiB"),
        "{err}"
    );
    // Others may write it: refused as well (it sets the workers' environment).
    std::fs::write(cwd.join(".nrun_env"), "A=1\n").unwrap();
    std::fs::set_permissions(
        cwd.join(".nrun_env"),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    let out = run(&cwd);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("0666: other users may write it"), "{err}");
    std::fs::set_permissions(
        cwd.join(".nrun_env"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    assert_eq!(run(&cwd).status.code(), Some(0));
}

#[test]
fn bad_rdzv_ids_are_usage_errors() {
    let s = Scene::new();
    let long = "a".repeat(129);
    for id in [
        "a b",
        "a\nb",
        "a\tb",
        "x\u{1b}[31m",
        "",
        "..",
        "a/b",
        "é",
        long.as_str(),
    ] {
        let out = s.run(&["--rdzv-id", id, "--no-python", "true"], &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{id:?}: {err}");
        assert!(
            err.contains("--rdzv-id") && err.contains("1 to 128"),
            "{id:?}: {err}"
        );
    }
    let ok = "A-z_0.9".to_string() + &"a".repeat(121);
    let out = s.run(&["--rdzv-id", &ok, "--no-python", "true"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// A second user plants what the old nrun used: `$TMPDIR/nrun-<pid>` directories for the next
/// pids with fake dumps, scratch-like names (one a symlink to a directory of ours), and a
/// `/tmp/nccl_trace_rank_0` pickle dated in the future. A Python worker keeps a dump pipe open
/// (as torch's recorder does) and stalls, so the watch asks it for a dump, twice (the second
/// ask comes once the first one's wait is over): nrun runs no planted pickle, removes nothing
/// of the other user's, follows no planted symlink.
#[test]
fn a_second_users_planted_files_are_neither_read_nor_run() {
    let Some(other) = other_user() else { return };
    // Any Python (no torch needed): the watch asks Python workers only.
    let py = std::env::var_os("NRUN_TEST_PYTHON").unwrap_or_else(|| "python3".into());
    if !Command::new(&py)
        .args(["-c", "pass"])
        .status()
        .is_ok_and(|s| s.success())
    {
        cannot_set_up("no Python (NRUN_TEST_PYTHON or python3)");
        return;
    }
    let s = Scene::new();
    // Where the pickle would leave its mark, if it ran (as root: it can write here).
    let pwned = s.dir.path().join("pwned");
    let tmp = std::env::temp_dir();
    let plant = tmp.join(format!("wd-plant-{}", std::process::id()));
    std::fs::create_dir(&plant).unwrap();
    std::fs::set_permissions(&plant, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let pickle = plant.join("evil.pkl");
    std::fs::write(&pickle, evil_pickle(&pwned)).unwrap();
    std::fs::set_permissions(&pickle, std::fs::Permissions::from_mode(0o644)).unwrap();
    // A directory of ours a planted symlink points to: the sweep must not empty it.
    let victim = s.dir.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(victim.join("keep"), "x").unwrap();
    let dead = (4_000_000u32..).find(|p| !Path::new(&format!("/proc/{p}")).exists());
    let dead = dead.unwrap();
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/ns_last_pid")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let trace = Path::new("/tmp/nccl_trace_rank_0");
    let _ = std::fs::remove_file(trace);
    // Whatever happens, what was planted goes (the other user's only).
    let _clean = Planted {
        paths: [
            trace.to_path_buf(),
            plant.clone(),
            tmp.join(format!("nrun-{dead}-0123456789")),
            tmp.join(format!("nrun-{dead}-abcdefabcd")),
        ]
        .into_iter()
        .chain((last + 1..=last + 400).map(|p| tmp.join(format!("nrun-{p}"))))
        .collect(),
        uid: other,
    };
    let tmp_s = tmp.display();
    let pickle_s = pickle.display();
    as_other(&format!(
        "for p in $(seq {from} {to}); do d={tmp_s}/nrun-$p/job/attempt_0; \
         mkdir -p $d 2>/dev/null || continue; cp {pickle_s} $d/fr-dump-0; \
         chmod -R a+rwX {tmp_s}/nrun-$p; done
         mkdir -m 0700 {tmp_s}/nrun-{dead}-0123456789
         cp {pickle_s} {tmp_s}/nrun-{dead}-0123456789/fr-dump-0
         ln -s {victim} {tmp_s}/nrun-{dead}-abcdefabcd
         cp {pickle_s} {trace}; touch -d '+1 day' {trace}",
        from = last + 1,
        to = last + 400,
        victim = victim.display(),
        trace = trace.display(),
    ));
    let worker = s.dir.path().join("ask.py");
    std::fs::write(
        &worker,
        r#"
import os
pipe = os.environ["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] + os.environ["RANK"] + ".pipe"
os.mkfifo(pipe)
fd = os.open(pipe, os.O_RDWR)  # a reader, as torch's recorder keeps one
for _ in range(2):
    os.read(fd, 1)  # blocks (a stall) until nrun asks for a dump
    with open(os.environ["MARK"], "a") as m:
        m.write("asked\n")
"#,
    )
    .unwrap();
    let mut c = s.cmd(&["--nproc", "1", "--watch", "on"]);
    c.arg("--python").arg(&py).arg(&worker);
    let (out, took) = wait_with_timeout(c.spawn().unwrap(), Duration::from_secs(120));
    let err = text(&out.stderr);
    assert!(took < Duration::from_secs(120), "nrun hung: {err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(s.marks(), ["asked", "asked"], "{err}");
    assert!(!pwned.exists(), "a planted pickle ran: {err}");
    // The other user's files are theirs still; the symlink was not followed.
    let planted = tmp.join(format!("nrun-{dead}-0123456789"));
    assert_eq!(std::fs::metadata(&planted).unwrap().uid(), other);
    assert!(planted.join("fr-dump-0").exists());
    assert!(victim.join("keep").exists(), "the sweep followed a symlink");
    assert!(trace.exists());
}

/// Paths the second user planted, removed when the test ends (those still theirs, and the
/// planting directory).
struct Planted {
    paths: Vec<PathBuf>,
    uid: u32,
}

impl Drop for Planted {
    fn drop(&mut self) {
        for p in &self.paths {
            let Ok(m) = std::fs::symlink_metadata(p) else {
                continue;
            };
            if m.uid() == self.uid
                || p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("wd-plant-"))
            {
                let _ = match m.is_dir() {
                    true => std::fs::remove_dir_all(p),
                    false => std::fs::remove_file(p),
                };
            }
        }
    }
}

/// A planted `.nrun_env` (in a shared working directory) and a `--log-dir` of another user's:
/// refused, exit 2, the file or directory named.
#[test]
fn a_second_users_nrun_env_and_log_dir_are_refused() {
    let Some(_) = other_user() else { return };
    let s = Scene::new();
    let shared = std::env::temp_dir().join(format!("wd-shared-{}", std::process::id()));
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let sh = shared.display();
    as_other(&format!(
        "echo LD_PRELOAD=/nonexistent/evil.so > {sh}/.nrun_env; chmod 644 {sh}/.nrun_env
         mkdir -m 0777 {sh}/logs"
    ));
    let mut c = s.cmd(&["--nproc", "1", "--no-python", "true"]);
    c.current_dir(&shared);
    let out = c.output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("{sh}/.nrun_env")) && err.contains("planted by another user"),
        "{err}"
    );
    let logs = shared.join("logs");
    let out = s.run(
        &[
            "--nproc",
            "1",
            "--log-dir",
            logs.to_str().unwrap(),
            "--no-python",
            "true",
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("refusing directory {}", logs.display())),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&shared);
}

/// Issue 46: another user's symlink or FIFO at every path nrun writes (`--report`,
/// `--report-html`, `--events`, `--metrics-file`, bisect's `--write-hostfile` and
/// `--exclude-file`, `nrun report -o`), in a sticky directory every user may write: refused
/// before anything runs (exit 2, the link or FIFO and its owner named), nothing written where
/// a link points, no open blocked on a FIFO. Also a chain: root's `latest` -> the other user's
/// `run43` -> the target.
#[test]
fn a_second_users_links_and_fifos_at_output_paths_are_refused() {
    let Some(other) = other_user() else { return };
    let s = Scene::new();
    let shared = std::env::temp_dir().join(format!("wd-out-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&shared);
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let target = s.dir.path().join("target");
    std::fs::write(&target, "keep\n").unwrap();
    let sh = shared.display();
    let tg = target.display();
    let names = [
        "report", "html", "events", "prom", "hosts", "exclude", "page",
    ];
    let plant: String = names
        .iter()
        .map(|n| format!("ln -s {tg} {sh}/{n}; mkfifo -m 0666 {sh}/{n}.fifo\n"))
        .collect();
    as_other(&format!("{plant}ln -s {tg} {sh}/run43"));
    std::os::unix::fs::symlink("run43", shared.join("latest")).unwrap();
    // An input for `nrun report`, and a job's report to compare.
    let input = s.dir.path().join("r.json");
    let out = s.run(
        &["--report", input.to_str().unwrap(), "--no-python", "true"],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let run = |args: Vec<String>| {
        let mut c = s.cmd(&[]);
        c.args(&args);
        let (out, _) = wait_with_timeout(c.spawn().unwrap(), HANG);
        (out.status.code(), text(&out.stderr))
    };
    let at = |n: &str| format!("{sh}/{n}");
    for fifo in ["", ".fifo"] {
        let job = |flag: &str, n: &str| {
            vec![
                flag.to_string(),
                at(&format!("{n}{fifo}")),
                "--no-python".into(),
                "true".into(),
            ]
        };
        let bisect = |flags: &[&str], n: &str| {
            let mut a: Vec<String> = ["bisect", "-H", "localhost", "--probe", "cmd", "--no-python"]
                .map(String::from)
                .to_vec();
            a.extend(flags.iter().map(|f| f.to_string()));
            a.push(at(&format!("{n}{fifo}")));
            a.extend(["--", "true"].map(String::from));
            a
        };
        let cases = [
            ("--report", job("--report", "report")),
            ("--report-html", job("--report-html", "html")),
            ("--events", job("--events", "events")),
            ("--metrics-file", job("--metrics-file", "prom")),
            ("--write-hostfile", bisect(&["--write-hostfile"], "hosts")),
            (
                "--exclude-file",
                bisect(&["--write-exclude", "--exclude-file"], "exclude"),
            ),
            (
                "-o",
                vec![
                    "report".into(),
                    input.display().to_string(),
                    "-o".into(),
                    at(&format!("page{fifo}")),
                ],
            ),
        ];
        for (flag, args) in cases {
            let (code, err) = run(args);
            let owner = format!("uid {other}");
            let what = match fifo {
                "" => "symbolic link",
                _ => "FIFO",
            };
            assert_eq!(code, Some(2), "{flag} at another user's {what}: {err}");
            assert!(
                err.contains(flag) && err.contains(&owner) && err.contains(what),
                "{flag} at another user's {what}: {err}"
            );
        }
    }
    // root's link to the other user's link: refused at the other user's.
    let (code, err) = run(vec![
        "--report".into(),
        at("latest"),
        "--no-python".into(),
        "true".into(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(&format!("{sh}/run43")), "{err}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep\n");
    let _ = std::fs::remove_dir_all(&shared);
}

/// Issue 46: a FIFO of this user's at `--report` whose reader takes nothing (its pipe full): a
/// SIGTERM ends nrun, which waits for the reader only until a stop signal comes (it used to
/// stay blocked in the write, its signal handler having taken SIGTERM's default action away).
#[test]
fn a_stop_signal_ends_nrun_waiting_on_a_fifo() {
    let s = Scene::new();
    let fifo = s.dir.path().join("report.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a plain syscall on a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // The reader: opened, its pipe made one page, never read.
    let reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a valid descriptor.
    let size = unsafe { libc::fcntl(reader.as_raw_fd(), libc::F_SETPIPE_SZ, 4096) };
    assert!(size > 0);
    let child = s.spawn(
        &[
            "--report",
            fifo.to_str().unwrap(),
            // Four workers' events: a report well past the pipe's page.
            "--nproc",
            "4",
            "--no-python",
            "true",
        ],
        &[],
    );
    let pid = child.id();
    let queued = || {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD on a valid descriptor, into an int.
        unsafe { libc::ioctl(reader.as_raw_fd(), libc::FIONREAD, &mut n) };
        n
    };
    // The report is larger than the pipe: nrun waits for the reader once it is full.
    wait_until("nrun to fill the FIFO", || queued() >= size);
    signal_pid(&pid.to_string(), "TERM");
    let (out, took) = wait_with_timeout(child, HANG);
    let err = text(&out.stderr);
    eprintln!("nrun ended {took:?} after SIGTERM");
    assert!(
        err.contains("a stop signal came while nrun waited for the reader"),
        "{err}"
    );
    drop(reader);
}
