//! Process groups and leftovers: the OS-level half of "nothing is left running".
//!
//! Each worker leads its own session and process group (as torchrun's, `start_new_session`; one
//! that reads the terminal only its own group), so one `killpg` reaches the worker and every
//! descendant that stayed in its group; the terminal's Ctrl-C does not reach workers directly
//! (they are not in the foreground group), nrun forwards it instead.
//!
//! A descendant that leaves its group (`setsid`, daemons) escapes `killpg`. nrun therefore makes
//! itself a child subreaper (`PR_SET_CHILD_SUBREAPER`, Linux >= 3.4): orphaned descendants are
//! re-parented to nrun rather than to init, so at the end nrun can find them among its own
//! children and kill them too. See prctl(2).

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::Pid;

/// A worker's process group; its id is the worker's pid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ProcessGroup(pub Pid);

impl ProcessGroup {
    /// Sends `sig` to every process of the group; false when none is left.
    pub(crate) fn signal(self, sig: Signal) -> bool {
        killpg(self.0, sig) != Err(Errno::ESRCH)
    }

    /// Whether any process of the group is still alive (zombies included until reaped).
    pub(crate) fn alive(self) -> bool {
        killpg(self.0, None) != Err(Errno::ESRCH)
    }
}

/// The soft limit on open files nrun started with (what its workers get back).
static FD_SOFT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Raises nrun's own limit on open files to the hard limit: the store holds a connection per
/// worker, and the common soft limit of 1024 locks clients out of a large job. Workers get the
/// limit they would have had without nrun (see [`restore_fd_limit`]).
pub fn raise_fd_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            FD_SOFT.store(l.rlim_cur, std::sync::atomic::Ordering::Relaxed);
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// The hard limit on open files (None where it is unlimited or cannot be read).
pub fn fd_hard_limit() -> Option<u64> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a plain syscall on a local struct.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0;
    (ok && l.rlim_max != libc::RLIM_INFINITY).then_some(l.rlim_max)
}

/// In a child between fork and exec: puts back the soft limit nrun started with.
/// Async-signal-safe (an atomic load and two syscalls).
pub(crate) fn restore_fd_limit() {
    let soft = FD_SOFT.load(std::sync::atomic::Ordering::Relaxed);
    if soft == u64::MAX {
        return;
    }
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = soft;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// Ties this process to `parent`: SIGKILL when it dies (PR_SET_PDEATHSIG), and an exit at once
/// (as if killed) when it is already gone, the signal set too late: re-parented meanwhile.
/// For a process nrun started on its own machine (the spawner, an agent it forked or exec'd).
pub fn die_with(parent: i32) {
    // SAFETY: prctl with integer arguments; _exit ends the process at once (nothing of it is
    // left to flush: this runs first thing in the child).
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        if libc::getppid() != parent {
            libc::_exit(i32::from(nrun_base::error::exit::signal(libc::SIGKILL)));
        }
    }
}

/// Makes orphaned descendants of nrun re-parent to nrun (see the module doc).
pub fn become_subreaper() {
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
}

/// Pids of this process's current children, from /proc/self/task/*/children.
fn children() -> Vec<Pid> {
    let mut pids = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return pids;
    };
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
            pids.extend(
                s.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .map(Pid::from_raw),
            );
        }
    }
    pids
}

fn is_zombie(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(false)
}

/// Children nrun started on purpose and waits for itself, beside its workers: an inner agent's
/// ssh clients of the launch tree (see `agent::child`), which live from one group of workers to
/// the next. [`kill_orphans`] spares them; a spawn holds the lock until the pid is in, so no
/// sweep sees a child that is not yet known.
static OWN: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

/// Runs `spawn` (which starts one child and returns its pid) so that [`kill_orphans`] spares
/// that child until [`disown`].
pub fn spawn_own<T>(
    spawn: impl FnOnce() -> std::io::Result<(T, Option<u32>)>,
) -> std::io::Result<T> {
    let mut own = OWN.lock().unwrap_or_else(|e| e.into_inner());
    let (t, pid) = spawn()?;
    if let Some(pid) = pid {
        own.push(pid as i32);
    }
    Ok(t)
}

/// `pid`, a child started otherwise (the spawner, forked), is spared as [`spawn_own`]'s are.
pub(crate) fn keep_own(pid: u32) {
    OWN.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(pid as i32);
}

/// A child of [`spawn_own`] was waited for: a pid the kernel may give again is no longer one
/// to spare.
pub fn disown(pid: u32) {
    OWN.lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|p| *p != pid as i32);
}

/// Kills and reaps every process still parented to nrun: descendants of workers that escaped
/// their process group and were re-parented here, but not the children nrun started on
/// purpose ([`spawn_own`]: their statuses are their waiters'). Call only after every worker
/// was waited for, or this would reap a worker's status out from under its waiter. Returns how
/// many it killed.
pub(crate) fn kill_orphans() -> usize {
    let own = OWN.lock().unwrap_or_else(|e| e.into_inner());
    let orphans = || {
        children()
            .into_iter()
            .filter(|p| !own.contains(&p.as_raw()))
            .collect::<Vec<_>>()
    };
    let mut killed = 0;
    // Killing one orphan re-parents its own children to us; a few rounds catch those.
    for _ in 0..50 {
        let kids = orphans();
        if kids.is_empty() {
            break;
        }
        for pid in &kids {
            let running = !is_zombie(*pid);
            let _ = killpg(*pid, Signal::SIGKILL);
            if kill(*pid, Signal::SIGKILL).is_ok() && running {
                killed += 1;
            }
        }
        for pid in kids {
            let _ = waitpid(pid, None);
        }
    }
    // Zombies of orphans that had already exited on their own (one by one: a wait for any
    // child would take the status of one of nrun's own).
    for pid in orphans() {
        let _ = waitpid(pid, Some(WaitPidFlag::WNOHANG));
    }
    killed
}

/// Where the kernel reads this process's command line from: its argv area, `[start, end)`
/// (fields 48 and 49 of /proc/self/stat). The same in every process forked from this one.
#[derive(Clone, Copy)]
pub(crate) struct ArgArea {
    start: usize,
    end: usize,
}

impl ArgArea {
    pub(crate) fn of_self() -> Option<ArgArea> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let (_, rest) = stat.rsplit_once(") ")?;
        // After the parenthesized name the fields count from the third.
        let mut fields = rest.split_whitespace().skip(45);
        let start = fields.next()?.parse().ok()?;
        let end = fields.next()?.parse().ok()?;
        (end > start).then_some(ArgArea { start, end })
    }

    /// Makes this process read as `args` in `ps` and /proc/PID/cmdline, and names it after the
    /// first: a process forked without exec would read as its parent's command line. What
    /// setproctitle does: the area is overwritten in place (cut to its length, the rest
    /// zeroed, the last byte a NUL so that the kernel reads no further).
    pub(crate) fn retitle(self, args: &[&str]) {
        if let Some(first) = args.first() {
            let name: Vec<u8> = first.bytes().take(15).chain([0]).collect();
            // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
            unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr(), 0, 0, 0) };
        }
        let mut title: Vec<u8> = args.iter().flat_map(|a| a.bytes().chain([0])).collect();
        title.resize(self.end - self.start, 0);
        if let Some(last) = title.last_mut() {
            *last = 0;
        }
        // SAFETY: [start, end) is this process's own argv area (mapped, writable: the top of
        // the main thread's stack, written by the kernel at exec), which nothing else writes;
        // this process has one thread (just forked). std's env::args keeps the old argv
        // pointers into it, so it reads as cut pieces afterwards: nothing after this reads it
        // (the agent takes its instructions from stdin).
        unsafe {
            std::ptr::copy_nonoverlapping(title.as_ptr(), self.start as *mut u8, title.len())
        };
    }
}
