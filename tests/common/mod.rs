//! Helpers for tests that run the real `nrun` binary.
#![allow(dead_code)]

pub(crate) mod cgroup;
pub(crate) mod chromium;
pub(crate) mod setup;
pub(crate) mod skip;
pub(crate) mod slurm;
pub(crate) mod store;

pub(crate) use nix::sys::signal::Signal;
use nix::unistd::Pid;
pub(crate) use skip::{cannot_set_up, current_test, missing_tool};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a test waits for something that normally takes seconds before calling it a hang.
/// Every wait of these helpers is at least this long: a wait ends on its event (a mark, an
/// exit, a line), and its bound only tells a hang from a slow machine, never a pass from a
/// failure (no test may pass or fail by timing; a loaded CI machine is slow, not hung).
pub(crate) const HANG: Duration = Duration::from_secs(120);

/// Polls `done` until it holds; panics naming `what` after [`HANG`] (a hang, not slowness).
pub(crate) fn wait_until(what: &str, done: impl FnMut() -> bool) {
    wait_until_within(what, HANG, done);
}

/// As [`wait_until`], with a hang guard of `guard` (at least [`HANG`]) for work known to take
/// long on a loaded machine (thousands of processes).
pub(crate) fn wait_until_within(what: &str, guard: Duration, mut done: impl FnMut() -> bool) {
    let guard = guard.max(HANG);
    let end = Instant::now() + guard;
    while !done() {
        assert!(Instant::now() < end, "hung: waited {guard:?} for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// As [`wait_until`], inside async code: the runtime's other tasks (a store the test serves)
/// run while it waits.
pub(crate) async fn wait_until_async(what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + HANG;
    while !done() {
        assert!(Instant::now() < end, "hung: waited {HANG:?} for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether `prog` is on PATH or in the sbin directories (where Debian puts iptables and sshd,
/// off a plain user's PATH).
pub(crate) fn have(prog: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .any(|d| d.join(prog).is_file())
}

/// Whether `prog` is here; if not, [`missing_tool`] with `package`, the one that provides it.
pub(crate) fn need_tool(prog: &str, package: &str) -> bool {
    let here = have(prog);
    if !here {
        missing_tool(&current_test(), &format!("{prog} ({package})"));
    }
    here
}

/// Whether this process runs as root; if not, [`cannot_set_up`] naming `what` needs it.
pub(crate) fn need_root(what: &str) -> bool {
    let root = nix_is_root();
    if !root {
        cannot_set_up(&format!("not root: {what} needs root"));
    }
    root
}

pub(crate) fn nrun_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_nrun"))
}

/// A port for a server a test starts later (nrun's `--master-port`), from below the kernel's
/// ephemeral range: a port the kernel handed out as free (`bind :0`) can be taken, before the
/// server binds it, as the local end of another test's outgoing connection.
pub(crate) fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let (base, span) = (10_000u32, low.saturating_sub(10_000).max(1000));
    // Test binaries run side by side: each starts at a place of its own in the span.
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let port = (base + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below the ephemeral range");
}

/// The scratch directory of the nrun (or agent) with process id `pid`: `$TMPDIR/nrun-<pid>-<random>`.
pub(crate) fn scratch_of(pid: u32) -> Option<PathBuf> {
    let prefix = format!("nrun-{pid}-");
    std::fs::read_dir(std::env::temp_dir())
        .ok()?
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
}

/// tests/python/`name`: a script the tests run under a python (torch's, or python3).
pub(crate) fn py_script(name: &str) -> String {
    format!("{}/tests/python/{name}", env!("CARGO_MANIFEST_DIR"))
}

pub(crate) fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A test's private tag and scratch directory. Every process nrun starts inherits the tag in
/// its environment, which is how the tests find leftovers.
pub(crate) struct Scene {
    pub tag: String,
    pub dir: tempfile::TempDir,
}

impl Scene {
    pub(crate) fn new() -> Scene {
        let dir = tempfile::tempdir().unwrap();
        let tag = format!(
            "t{}-{}",
            std::process::id(),
            dir.path().file_name().unwrap().to_string_lossy()
        );
        Scene { tag, dir }
    }

    pub(crate) fn mark(&self) -> PathBuf {
        self.dir.path().join("mark")
    }

    pub(crate) fn marks(&self) -> Vec<String> {
        std::fs::read_to_string(self.mark())
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }

    pub(crate) fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(nrun_bin());
        c.args(args)
            .env("NRUN_TEST_TAG", &self.tag)
            .env("MARK", self.mark())
            .env_remove("NRUN_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    pub(crate) fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut c = self.cmd(args);
        c.envs(env.iter().copied());
        c.output().unwrap()
    }

    /// Runs `nrun --nproc NPROC --python PY SCRIPT`: a one-node torch job.
    pub(crate) fn run_python(&self, py: &str, nproc: &str, script: &str) -> Output {
        self.run(&["--nproc", nproc, "--python", py, script], &[])
    }

    pub(crate) fn spawn(&self, args: &[&str], env: &[(&str, &str)]) -> Child {
        let mut c = self.cmd(args);
        c.envs(env.iter().copied());
        c.spawn().unwrap()
    }

    /// Waits until the mark file has `n` lines equal to `line`. `timeout` is a hang guard,
    /// at least [`HANG`].
    pub(crate) fn wait_marks(&self, line: &str, n: usize, timeout: Duration) {
        let end = Instant::now() + timeout.max(HANG);
        while self.marks().iter().filter(|l| *l == line).count() < n {
            assert!(
                Instant::now() < end,
                "timed out waiting for {n} x {line:?}; marks: {:?}",
                self.marks()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Processes (other than zombies) that carry this test's tag.
    pub(crate) fn survivors(&self) -> Vec<String> {
        let needle = format!("NRUN_TEST_TAG={}", self.tag);
        let mut found = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let name = e.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            let Ok(env) = std::fs::read(e.path().join("environ")) else {
                continue;
            };
            if env.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
                if proc_stat(pid.parse().unwrap_or(0)).is_some_and(|st| st.starts_with('Z')) {
                    continue;
                }
                let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                found.push(format!(
                    "{pid}: {}",
                    String::from_utf8_lossy(&cmd).replace('\0', " ")
                ));
            }
        }
        found
    }

    /// Asserts that nothing tagged is left, waiting while something still is (the kernel
    /// finishing kills, a remote session closing; a loaded machine takes its time): only
    /// what is still there after a minute is left behind.
    pub(crate) fn assert_no_survivors(&self) {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let s = self.survivors();
            if s.is_empty() {
                return;
            }
            if Instant::now() > end {
                for p in &s {
                    if let Some(pid) = p.split(':').next().and_then(|p| p.parse::<i32>().ok()) {
                        kill9(pid);
                    }
                }
                panic!("processes left running: {s:#?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn kill9(pid: i32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}

/// The fields of /proc/PID/stat after the command's name (state first, then the parent's pid),
/// while the process exists.
pub(crate) fn proc_stat(pid: u32) -> Option<String> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    st.rsplit_once(") ").map(|(_, r)| r.to_string())
}

/// The parent of process `pid`, while it exists.
pub(crate) fn parent_of(pid: u32) -> Option<u32> {
    proc_stat(pid)?.split_whitespace().nth(1)?.parse().ok()
}

pub(crate) fn signal(child: &Child, sig: &str) {
    signal_pid(&child.id().to_string(), sig);
}

/// Sends `sig` (`KILL`, `TERM`, ...) to process `pid`, which must exist.
pub(crate) fn signal_pid(pid: &str, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), pid])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// Waits for a child to exit; returns its output and how long it took. `timeout` is a hang
/// guard, at least [`HANG`].
pub(crate) fn wait_with_timeout(mut child: Child, timeout: Duration) -> (Output, Duration) {
    let timeout = timeout.max(HANG);
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), start.elapsed());
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "nrun did not exit within {timeout:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for nrun's store on `addr` (nrun spawned with piped stderr); nrun ending first fails the test with its words.
pub(crate) fn await_listen(child: &mut std::process::Child, addr: std::net::SocketAddr) {
    use std::io::Read;
    let deadline = Instant::now() + HANG;
    while std::net::TcpStream::connect(addr).is_err() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("nrun ended ({status}) before its store listened on {addr}:\n{err}");
        }
        assert!(
            Instant::now() < deadline,
            "nrun's store never listened on {addr}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running child whose stdout and stderr are read as they come: a test waits for a line of
/// it (an event: a node joined, a stop begun) before it acts, and has the whole output at the
/// end.
pub(crate) struct Watched {
    child: Child,
    out: Arc<Mutex<Vec<u8>>>,
    err: Arc<Mutex<Vec<u8>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    start: Instant,
}

impl Watched {
    /// `child` must have been spawned with piped stdout and stderr.
    pub(crate) fn new(mut child: Child) -> Watched {
        fn pump(mut from: impl Read + Send + 'static, to: Arc<Mutex<Vec<u8>>>) -> JoinHandle {
            std::thread::spawn(move || {
                let mut buf = [0u8; 8192];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    to.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            })
        }
        type JoinHandle = std::thread::JoinHandle<()>;
        let (out, err) = (Arc::default(), Arc::default());
        let readers = vec![
            pump(child.stdout.take().unwrap(), Arc::clone(&out)),
            pump(child.stderr.take().unwrap(), Arc::clone(&err)),
        ];
        Watched {
            child,
            out,
            err,
            readers,
            start: Instant::now(),
        }
    }

    pub(crate) fn child(&self) -> &Child {
        &self.child
    }

    pub(crate) fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its stderr so far.
    pub(crate) fn stderr(&self) -> String {
        text(&self.err.lock().unwrap())
    }

    /// Waits until its stderr so far contains `needle` (a hang after [`HANG`]).
    pub(crate) fn wait_stderr(&self, needle: &str) {
        let end = Instant::now() + HANG;
        while !self.stderr().contains(needle) {
            if Instant::now() > end {
                panic!(
                    "hung: waited {HANG:?} for {needle:?} in nrun's stderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for it to exit (a hang after [`HANG`]): its output, and how long it ran.
    pub(crate) fn finish(mut self) -> (Output, Duration) {
        let end = Instant::now() + HANG;
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "hung: nrun did not exit within {HANG:?}\nstderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let took = self.start.elapsed();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let take = |b: &Arc<Mutex<Vec<u8>>>| std::mem::take(&mut *b.lock().unwrap());
        let out = Output {
            status,
            stdout: take(&self.out),
            stderr: take(&self.err),
        };
        (out, took)
    }
}

/// As [`wait_with_timeout`], reading the child's output while it runs (more than a pipe
/// holds: a child blocked writing would never exit).
pub(crate) fn wait_draining(child: Child, timeout: Duration) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            let out = rx.recv().unwrap().unwrap();
            panic!(
                "did not exit within {timeout:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// The one run directory `<logs>/<id>_<random>` a run with `--rdzv-id id` made.
pub(crate) fn run_dir(logs: &Path, id: &str) -> PathBuf {
    let runs: Vec<PathBuf> = std::fs::read_dir(logs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{id}_")))
        })
        .collect();
    assert_eq!(
        runs.len(),
        1,
        "runs of {id} in {}: {runs:?}",
        logs.display()
    );
    runs[0].clone()
}

pub(crate) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The venv's python with torch, looked up once per test binary (an `import torch` takes
/// seconds on a loaded machine).
pub(crate) fn torch_python() -> Option<PathBuf> {
    static FOUND: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    FOUND.get_or_init(find_torch_python).clone()
}

/// [`torch_python`], or None after [`cannot_set_up`] where there is none.
pub(crate) fn need_torch() -> Option<PathBuf> {
    let py = torch_python();
    if py.is_none() {
        cannot_set_up(
            "no python with torch.distributed: scripts/venv.sh makes one; \
             NRUN_TEST_PYTHON=<venv>/bin/python names it",
        );
    }
    py
}

fn find_torch_python() -> Option<PathBuf> {
    let p = std::env::var_os("NRUN_TEST_PYTHON")
        .map(PathBuf::from)
        .or_else(|| {
            let home = std::env::var_os("HOME")?;
            Some(Path::new(&home).join(".cache/nrun/venv/bin/python"))
        })?;
    let ok = Command::new(&p)
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(p)
}

// ---- a cluster of network-namespace hosts, each with its own sshd -------------------

/// A cluster of namespace hosts, removed on drop.
pub(crate) struct Cluster {
    pub name: String,
    pub config: String,
}

impl Cluster {
    /// None where namespaces cannot be made (not root, no sshd): a skip said on stderr, or a
    /// failure under scripts/test.sh (see [`cannot_set_up`]).
    /// `NRUN_TEST_CLUSTER_PREFIX` goes before `name`, so test runs of several worktrees at
    /// once on one machine make clusters of their own (names up to 11 characters in all).
    pub(crate) fn up(name: &str, k: usize) -> Option<Cluster> {
        let prefixed = format!(
            "{}{name}",
            std::env::var("NRUN_TEST_CLUSTER_PREFIX").unwrap_or_default()
        );
        let name = prefixed.as_str();
        let script = format!("{}/scripts/netns-cluster.sh", env!("CARGO_MANIFEST_DIR"));
        if !need_root(&format!(
            "cluster {name} (network namespaces, scripts/netns-cluster.sh)"
        )) || !need_tool("ip", "iproute2")
            || !need_tool("sshd", "openssh-server")
        {
            return None;
        }
        let out = Command::new("bash")
            .args([&script, "up", &k.to_string(), name])
            .output()
            .unwrap();
        if !out.status.success() {
            panic!(
                "netns-cluster.sh up {k} {name} failed:\n{}",
                text(&out.stderr)
            );
        }
        let config = text(&out.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .trim()
            .to_string();
        Some(Cluster {
            name: name.into(),
            config,
        })
    }

    /// The cluster's state directory (ssh_config, hosts, cluster.env).
    pub(crate) fn dir(&self) -> String {
        std::path::Path::new(&self.config)
            .parent()
            .map_or(String::new(), |p| p.display().to_string())
    }

    /// nrun started by hand inside host i's namespace (a node's own command, not over ssh);
    /// the caller adds the flags, the target and where its output goes.
    pub(crate) fn nrun_in(&self, i: usize) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.host(i)]).arg(nrun_bin());
        c
    }

    /// As [`Cluster::nrun_in`], under a host name of its own (HOST-nI, in a UTS namespace of
    /// its own), as a real host has.
    pub(crate) fn nrun_named_in(&self, i: usize) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.host(i)])
            .args([
                "unshare",
                "--uts",
                "sh",
                "-c",
                "hostname \"$0\" && exec \"$@\"",
            ])
            .arg(format!("{}-n{i}", self.host(i)))
            .arg(nrun_bin());
        c
    }

    /// A passive sniffer on host i's eth0 for `secs` seconds (tests/python/sniff.py), writing
    /// every frame to `capture`; capturing when this returns.
    pub(crate) fn sniff(&self, i: usize, secs: u32, capture: &Path) -> Sniffer {
        let script = py_script("sniff.py");
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.host(i), "python3", &script, "eth0"])
            .arg(secs.to_string())
            .arg(capture)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "sniffing", "sniff.py on {}", self.host(i));
        Sniffer {
            child,
            capture: capture.to_path_buf(),
        }
    }

    /// Host i takes new TCP connections to its sshd only (ssh, established connections and its
    /// own outgoing ones still work), so only node-to-node traffic can tell; false, after
    /// [`missing_tool`], without iptables.
    pub(crate) fn firewall(&self, i: usize) -> bool {
        if !need_tool("iptables", "iptables") {
            return false;
        }
        self.exec(
            i,
            "iptables -A INPUT -p tcp --dport 22 -j ACCEPT && iptables -A INPUT -m state --state \
             ESTABLISHED,RELATED -j ACCEPT && iptables -A INPUT -p tcp -j DROP",
        );
        true
    }

    /// Runs `cmd` inside host i's namespace; whether it succeeded.
    pub(crate) fn try_exec(&self, i: usize, cmd: &str) -> bool {
        Command::new("ip")
            .args(["netns", "exec", &self.host(i), "sh", "-c", cmd])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Slows host i's eth0 with the first of `qdiscs` (tc's words after `root`: "tbf rate
    /// 200mbit burst 256kbit latency 400ms") the kernel has; false, after [`cannot_set_up`],
    /// where it has none of them.
    pub(crate) fn shape(&self, i: usize, qdiscs: &[&str]) -> bool {
        let quiet = |q: &str| format!("tc qdisc add dev eth0 root {q} 2>/dev/null");
        if qdiscs.iter().any(|q| self.try_exec(i, &quiet(q))) {
            return true;
        }
        cannot_set_up(&format!(
            "no tc qdisc to slow {}'s link: the kernel lacks {qdiscs:?} (sch_netem, sch_tbf)",
            self.host(i)
        ));
        false
    }

    /// Host i's address on the cluster's bridge (10.213.N.(10+i)).
    pub(crate) fn addr(&self, i: usize) -> String {
        format!("10.213.{}.{}", self.net(), 10 + i)
    }

    /// The cluster's N (its subnet is 10.213.N.0/24): unique among clusters of other names.
    pub(crate) fn net(&self) -> String {
        let env = std::fs::read_to_string(format!("{}/cluster.env", self.dir())).unwrap();
        env.lines()
            .find_map(|l| l.strip_prefix("NRUN_CLUSTER_NET="))
            .unwrap()
            .trim()
            .to_string()
    }

    /// The launch host's address on the cluster's bridge (10.213.N.1).
    pub(crate) fn launch_addr(&self) -> String {
        format!("10.213.{}.1", self.net())
    }

    pub(crate) fn host(&self, i: usize) -> String {
        format!("{}-h{i}", self.name)
    }

    pub(crate) fn hosts(&self, k: usize) -> String {
        (1..=k).map(|i| self.host(i)).collect::<Vec<_>>().join(",")
    }

    /// Runs nrun as `s` on the first `k` hosts over their sshds, the test's tag and mark file
    /// passed to every worker (so leftovers are found), with `extra` flags and TARGET.
    pub(crate) fn run_on(
        &self,
        s: &Scene,
        k: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> std::process::Output {
        self.cmd_on(s, k, extra, env).output().unwrap()
    }

    /// Starts nrun as `s` on the first `k` hosts, as [`Cluster::run_on`] runs it, without waiting.
    pub(crate) fn spawn_on(
        &self,
        s: &Scene,
        k: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Child {
        self.cmd_on(s, k, extra, env).spawn().unwrap()
    }

    /// The command of [`Cluster::run_on`].
    pub(crate) fn cmd_on(
        &self,
        s: &Scene,
        k: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Command {
        self.cmd_on_hosts(s, &self.hosts(k), extra, env)
    }

    /// As [`Cluster::cmd_on`], on `hosts` (names, comma-separated, in the order given).
    pub(crate) fn cmd_on_hosts(
        &self,
        s: &Scene,
        hosts: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Command {
        let opts = self.ssh_opts();
        let mut c = s.cmd(&[
            "-H",
            hosts,
            "--ssh-opts",
            &opts,
            "--no-python-probe",
            "-x",
            "NRUN_TEST_TAG",
            "-x",
            "MARK",
        ]);
        c.args(extra).envs(env.iter().copied());
        c
    }

    /// Kills host i's nrun agents with SIGKILL (as a node dies; not the ssh clients an inner
    /// agent of the launch tree runs); whether there was one. Each
    /// agent and its keeper (its parent, forked from it: the same command line) die in one
    /// kill, children first: a keeper killed first is a stop request to its agent (SIGTERM by
    /// its parent-death signal), which then says "stopped by SIGTERM" before its own SIGKILL.
    pub(crate) fn kill_agents(&self, i: usize) -> bool {
        self.signal_agents(i, Signal::SIGKILL)
    }

    /// Sends `sig` to host i's nrun agents and their keepers, children first; whether one of
    /// them got it.
    pub(crate) fn signal_agents(&self, i: usize, sig: Signal) -> bool {
        let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.host(i)])
            .output()
        else {
            return false;
        };
        let mut pids: Vec<u32> = text(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .filter(|pid| {
                // `nrun __agent`, not an ssh client whose remote command names it.
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                cmd.split(|b| *b == 0).nth(1) == Some(b"__agent")
            })
            .collect();
        pids.sort_unstable_by(|a, b| b.cmp(a));
        // One at a time, and one reached is enough: a process of the list may end between the
        // listing and its signal (`kill` with many pids then fails though the rest were sent).
        let reached = pids
            .iter()
            .filter(|pid| nix::sys::signal::kill(Pid::from_raw(**pid as i32), sig).is_ok());
        reached.count() > 0
    }

    pub(crate) fn ssh_opts(&self) -> String {
        format!("-F {}", self.config)
    }

    /// Processes still running inside the cluster's namespaces, other than each host's sshd
    /// listener; waits up to a minute for them to end (ssh sessions close asynchronously,
    /// slowly on a loaded machine).
    pub(crate) fn assert_nothing_left(&self, k: usize) {
        self.assert_nothing_left_except(k, &[]);
    }

    /// As [`Cluster::assert_nothing_left`], with each host's slurmd allowed to stay.
    pub(crate) fn assert_nothing_left_but_slurmd(&self, k: usize) {
        self.assert_nothing_left_except(k, &["slurmd -f "]);
    }

    fn assert_nothing_left_except(&self, k: usize, daemons: &[&str]) {
        let end = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let mut left = Vec::new();
            for i in 1..=k {
                let out = Command::new("ip")
                    .args(["netns", "pids", &self.host(i)])
                    .output()
                    .unwrap();
                for pid in text(&out.stdout).split_whitespace() {
                    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                    let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                    let stat =
                        std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                    let zombie = stat
                        .rsplit_once(") ")
                        .is_some_and(|(_, r)| r.starts_with('Z'));
                    if cmd.is_empty()
                        || zombie
                        || cmd.contains("[listener]")
                        || daemons.iter().any(|d| cmd.contains(d))
                    {
                        continue;
                    }
                    left.push(format!("{}: {pid} {cmd}", self.host(i)));
                }
            }
            if left.is_empty() {
                return;
            }
            assert!(
                std::time::Instant::now() < end,
                "left running in the cluster: {left:#?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Makes host i's eth0 report `mbps` as its speed (veth always says 10000): a file bound
    /// over the sysfs attribute in the mount namespace of the host's sshd, which every ssh
    /// session there inherits.
    pub(crate) fn report_speed(&self, i: usize, mbps: u64) {
        let dir = format!("{}/{}", self.dir(), self.host(i));
        let pid = std::fs::read_to_string(format!("{dir}/sshd.pid")).unwrap();
        std::fs::write(format!("{dir}/speed"), format!("{mbps}\n")).unwrap();
        let st = Command::new("nsenter")
            .args(["-t", pid.trim(), "-m", "mount", "--bind"])
            .arg(format!("{dir}/speed"))
            .arg("/sys/class/net/eth0/speed")
            .status()
            .unwrap();
        assert!(st.success(), "bind a speed over {}'s eth0", self.host(i));
    }

    /// Sets host i's host name (in the UTS namespace of its sshd, which every ssh session
    /// there inherits).
    pub(crate) fn set_hostname(&self, i: usize, name: &str) {
        let pid =
            std::fs::read_to_string(format!("{}/{}/sshd.pid", self.dir(), self.host(i))).unwrap();
        let st = Command::new("nsenter")
            .args(["-t", pid.trim(), "-u", "hostname", name])
            .status()
            .unwrap();
        assert!(st.success(), "set {}'s host name", self.host(i));
    }

    /// Runs `cmd` on the launch host (the root namespace); panics if it fails.
    pub(crate) fn exec_here(&self, cmd: &str) {
        let st = Command::new("sh").args(["-c", cmd]).status().unwrap();
        assert!(st.success(), "on the launch host: {cmd}");
    }

    pub(crate) fn exec(&self, i: usize, cmd: &str) {
        let st = Command::new("ip")
            .args(["netns", "exec", &self.host(i), "sh", "-c", cmd])
            .status()
            .unwrap();
        assert!(st.success(), "in {}: {cmd}", self.host(i));
    }
}

/// A capture running on a host's wire ([`Cluster::sniff`]).
pub(crate) struct Sniffer {
    child: Child,
    capture: PathBuf,
}

impl Sniffer {
    /// Every frame it saw, concatenated, once its time is up.
    pub(crate) fn wire(mut self) -> Vec<u8> {
        let _ = self.child.wait();
        std::fs::read(&self.capture).unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let script = format!("{}/scripts/netns-cluster.sh", env!("CARGO_MANIFEST_DIR"));
        let _ = Command::new("bash")
            .args([&script, "down", &self.name])
            .output();
    }
}

pub(crate) fn nix_is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| text(&o.stdout).trim() == "0")
}

// ---- whole output: every line a rank wrote, once, in order ---------------------------------

/// A worker (`sh -c`) that writes `n` numbered lines as fast as it can, the last one right
/// before it exits 0: "burst r=RANK i=I" (I from 0).
pub(crate) fn burst(n: usize) -> String {
    format!("i=0; while [ $i -lt {n} ]; do echo \"burst r=$RANK i=$i\"; i=$((i+1)); done; exit 0")
}

/// Asserts that `text` (a console or a log) holds each of rank `rank`'s `n` burst lines once,
/// in order: the numbers read in the order of the text are 0..n.
pub(crate) fn assert_burst(text: &str, rank: usize, n: usize, what: &str) {
    let needle = format!("burst r={rank} i=");
    let seen: Vec<usize> = text
        .lines()
        .filter_map(|l| l.split_once(&needle))
        .map(|(_, i)| i.trim().parse().unwrap_or(usize::MAX))
        .collect();
    let want: Vec<usize> = (0..n).collect();
    if seen != want {
        let missing = want.iter().filter(|i| !seen.contains(i)).count();
        panic!(
            "{what}: rank {rank}'s lines: {} of {n} seen, {missing} missing, first ones {:?}, \
             last ones {:?}",
            seen.len(),
            &seen[..seen.len().min(5)],
            &seen[seen.len().saturating_sub(5)..]
        );
    }
}

/// A worker (`sh -c`) that writes lines of `len` bytes of its rank's digit (rank < 10), `n` of
/// them, each ended with " end$i".
pub(crate) fn long_lines(len: usize, n: usize) -> String {
    format!(
        "i=0; while [ $i -lt {n} ]; do head -c {len} /dev/zero | tr '\\0' \"$RANK\"; echo \" end$i\"; \
         i=$((i+1)); done"
    )
}

/// Asserts that the console `text` holds rank `rank`'s `n` long lines whole: each line of it
/// is one prefix ending in "rank{rank}]: " and then `len` digits and " end$i", in order.
pub(crate) fn assert_long_lines(text: &str, rank: usize, len: usize, n: usize) {
    let (alone, after_host) = (format!("[rank{rank}"), format!(":rank{rank}"));
    let digit = char::from_digit(rank as u32, 10).unwrap();
    let mine: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.split_once("]: ")
                .is_some_and(|(p, _)| p.ends_with(&alone) || p.ends_with(&after_host))
        })
        .collect();
    assert_eq!(mine.len(), n, "rank {rank}: {} lines, not {n}", mine.len());
    for (i, l) in mine.iter().enumerate() {
        let (_, body) = l.split_once("]: ").unwrap();
        let end = format!(" end{i}");
        assert!(
            body.ends_with(&end),
            "rank {rank} line {i} ends {:?}",
            &body[body.len().saturating_sub(40)..]
        );
        let digits = &body[..body.len() - end.len()];
        assert_eq!(digits.len(), len, "rank {rank} line {i}: cut or joined");
        assert!(
            digits.chars().all(|c| c == digit),
            "rank {rank} line {i}: another rank's bytes in it"
        );
    }
}
