//! A memory cgroup of a test's own (cgroup v2's memory.max, or v1's memory.limit_in_bytes
//! where only v1 has the memory controller): nrun and its workers run in it, so a test can
//! bound and read their memory together, and an overrun ends the job, not the machine.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::cannot_set_up;

/// A memory cgroup with a limit, emptied (SIGKILL) and removed on drop.
pub(crate) struct MemCgroup {
    pub dir: PathBuf,
    /// cgroup v2 (memory.max, memory.peak, memory.events), else v1 (memory.limit_in_bytes,
    /// memory.max_usage_in_bytes, memory.oom_control).
    v2: bool,
}

impl MemCgroup {
    /// A cgroup named for `test` and this process, limited to `bytes`, without swap; None,
    /// after [`cannot_set_up`], where none can be made (not root, no memory controller).
    pub(crate) fn new(test: &str, bytes: u64) -> Option<MemCgroup> {
        MemCgroup::try_new(test, bytes)
            .map_err(|e| cannot_set_up(&e))
            .ok()
    }

    /// As [`MemCgroup::new`], saying nothing: why not, where none can be made.
    pub(crate) fn try_new(test: &str, bytes: u64) -> Result<MemCgroup, String> {
        let name = format!("nrun-test-{test}-{}", std::process::id());
        let v2 = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|w| w == "memory"));
        let (dir, limit) = match v2 {
            true => (PathBuf::from("/sys/fs/cgroup").join(&name), "memory.max"),
            false => (
                PathBuf::from("/sys/fs/cgroup/memory").join(&name),
                "memory.limit_in_bytes",
            ),
        };
        if let Err(e) = std::fs::create_dir(&dir) {
            return Err(format!(
                "cannot make a memory cgroup at {} ({e}): it needs root and a writable cgroup \
                 tree with the memory controller",
                dir.display()
            ));
        }
        // Made: dropped (removed) on any failure from here.
        let cg = MemCgroup { dir, v2 };
        if let Err(e) = std::fs::write(cg.dir.join(limit), bytes.to_string()) {
            return Err(format!("cannot set {limit} in {} ({e})", cg.dir.display()));
        }
        // No swap to escape to: v2's setting where the controller offers it, v1's swappiness.
        let _ = std::fs::write(cg.dir.join("memory.swap.max"), "0");
        if !v2 {
            let _ = std::fs::write(cg.dir.join("memory.swappiness"), "0");
        }
        Ok(cg)
    }

    fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// The processes in it.
    pub(crate) fn procs(&self) -> Vec<String> {
        std::fs::read_to_string(self.procs_file())
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }

    /// Moves process `pid` (and the children it starts from now on) into the cgroup.
    pub(crate) fn add(&self, pid: u32) {
        std::fs::write(self.procs_file(), pid.to_string()).unwrap();
    }

    /// Starts `c`'s process in the cgroup (before it execs, so all it allocates is counted).
    pub(crate) fn enter(&self, c: &mut std::process::Command) {
        let procs = std::ffi::CString::new(self.procs_file().to_str().unwrap()).unwrap();
        // SAFETY: open, write, close only, between fork and exec (no allocation).
        unsafe {
            use std::os::unix::process::CommandExt;
            c.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
                Ok(())
            });
        }
    }

    /// How many processes the kernel killed for the cgroup's limit.
    pub(crate) fn oom_kills(&self) -> u64 {
        let file = match self.v2 {
            true => "memory.events",
            false => "memory.oom_control",
        };
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The cgroup's peak memory (all its processes, their sockets and page cache), in bytes.
    pub(crate) fn peak(&self) -> u64 {
        let file = match self.v2 {
            true => "memory.peak",
            false => "memory.max_usage_in_bytes",
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        for p in self.procs().iter().filter_map(|p| p.parse().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        // The kernel frees the cgroup a moment after its last process ends.
        let end = Instant::now() + Duration::from_secs(10);
        while std::fs::remove_dir(&self.dir).is_err() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
