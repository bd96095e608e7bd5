//! The keeper: what makes "nothing outlives the job" hold even when nrun is killed with SIGKILL.
//!
//! A worker's own children (same process group, or after `setsid`) are not reached by the
//! parent-death signal, which goes to direct children only. So nrun starts as two processes: the
//! keeper (the pid the user sees) forks the real nrun at once and becomes a child subreaper.
//! - nrun (the child) gets SIGTERM when the keeper dies (PR_SET_PDEATHSIG): killing the keeper
//!   with SIGKILL is a stop request, and nrun stops its workers and sweeps what they left, as it
//!   does for any stop (it is a subreaper of its own subtree).
//! - When nrun itself dies (even by SIGKILL), its workers get SIGKILL from the kernel and every
//!   descendant left is re-parented to the keeper, which kills them all before it exits with
//!   nrun's status.
//! - Signals sent to the keeper are passed on to nrun. A signal the terminal sent (Ctrl-C, Ctrl-\)
//!   reached nrun too, being in the same foreground process group, so it is not passed twice:
//!   `si_code` tells the terminal (SI_KERNEL) from a `kill` (SI_USER). Nor is a signal to pass
//!   on (not SIGINT, SIGTERM, SIGHUP) that the slurmstepd of the step sent: Slurm signals every
//!   process of the step, nrun included (see `sender`).
//! - When both die at once (`kill -9` of the two), neither can clean up: the watch does. The
//!   keeper forks it first, in a process group of its own, deaf to signals, holding the read end
//!   of a pipe whose write ends only the keeper and nrun hold (close-on-exec: no worker has
//!   one). When the pipe reads end-of-file, both are gone: every process whose environment
//!   carries this run's token in [`KEEP_VAR`] (set before the forks, so every worker and its
//!   descendants inherit it) is killed. At a normal end it finds none and exits at once.

use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, fork};

const PASSED_ON: [Signal; 7] = [
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGCHLD,
];

/// The variable every process of a run inherits, listing the tokens of the keepers above it
/// (an agent started by nrun on the same host adds its own).
pub(crate) const KEEP_VAR: &str = "NRUN_KEEP";

/// This process's keeper and its run's token, once forked off ([`start`]).
static KEPT: std::sync::OnceLock<(u32, String)> = std::sync::OnceLock::new();

/// An agent's keeper and the token every process of its run on that host carries
/// (this module): what `nrun __reap` needs to end them all.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Kept {
    pub keeper: u32,
    pub agent: u32,
    pub token: String,
}

/// What ends this process's run on this host from outside ([`reap_main`]); None without a
/// keeper.
pub fn kept() -> Option<Kept> {
    KEPT.get().map(|(keeper, token)| Kept {
        keeper: *keeper,
        agent: std::process::id(),
        token: token.clone(),
    })
}

/// `nrun __reap KEEPER AGENT TOKEN`, run over ssh by a launch host that lost this host's agent
/// by its silent heartbeat: an agent stopped (SIGSTOP) or hung cannot stop its workers, nor can
/// its keeper and watch if they were stopped with it. SIGKILL, which a stopped process cannot
/// hold off, goes only to processes the token names, each checked on a pidfd held across the
/// check (a pid reused in between is never hit): the keeper if it is the very process the
/// token names (its pid and start time, [`start`]), its children (the agent first, then the
/// watch) while they are that keeper's, then every process carrying the token (the workers and
/// theirs). Exit 0 once it killed some and none is left; 1 when it found none of them (said on
/// stderr: the launch host warns), or could not kill one; 2 for arguments that do not parse.
pub fn reap_main(mut args: impl Iterator<Item = std::ffi::OsString>) -> u8 {
    let mut arg = || args.next().and_then(|a| a.into_string().ok());
    let (Some(keeper), Some(agent), Some(token)) = (
        arg().and_then(|p| p.parse::<i32>().ok()),
        arg().and_then(|p| p.parse::<i32>().ok()),
        arg().filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.')),
    ) else {
        eprintln!(
            "nrun __reap: expected KEEPER-PID AGENT-PID TOKEN (as an agent's joined record has \
             them); this entry point is nrun's own, run by a launch host over ssh"
        );
        return nrun_base::error::exit::USAGE;
    };
    let host = nrun_base::net::hostname();
    let started = token
        .split_once('.')
        .filter(|(pid, _)| pid.parse() == Ok(keeper))
        .and_then(|(_, t)| t.parse::<u64>().ok());
    let Some(started) = started else {
        eprintln!(
            "nrun __reap on {host}: token {token} does not name keeper {keeper} (KEEPER.START); \
             nothing killed"
        );
        return nrun_base::error::exit::USAGE;
    };
    let is_agent = |pid: i32| {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        cmd.split(|b| *b == 0).nth(1) == Some(b"__agent".as_slice())
    };
    let the_keeper = |pid: i32| start_time(pid) == Some(started) && is_agent(pid);
    let mut killed = 0usize;
    let mut failed: Vec<String> = Vec::new();
    let mut hit = |pid: i32, ours: &dyn Fn() -> bool| match kill_checked(pid, ours) {
        Ok(true) => killed += 1,
        Ok(false) => {}
        Err(e) => failed.push(format!("{pid}: {e}")),
    };
    if keeper > 1 && the_keeper(keeper) {
        let keepers_child = |pid: i32| the_keeper(keeper) && parent(pid) == Some(keeper);
        // The agent first: its workers get their parent-death signal at once.
        if is_agent(agent) {
            hit(agent, &|| keepers_child(agent));
        }
        let children = std::fs::read_to_string(format!("/proc/{keeper}/task/{keeper}/children"))
            .unwrap_or_default();
        for c in children
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            hit(c, &|| keepers_child(c));
        }
        hit(keeper, &|| the_keeper(keeper));
    }
    let me = std::process::id();
    let killed_workers = std::cell::Cell::new(0usize);
    kill_until_gone(
        || carrying(&token, me),
        |p| {
            let ours = || carries(p.as_raw() as u32, &token);
            if kill_checked(p.as_raw(), &ours) == Ok(true) {
                killed_workers.set(killed_workers.get() + 1);
            }
        },
    );
    let killed = killed + killed_workers.get();
    let left = carrying(&token, me).len();
    if !failed.is_empty() || left > 0 {
        eprintln!(
            "nrun __reap on {host}: could not kill every process of run {token} ({}{left} \
             still carry its token); check with `pgrep -a nrun` there",
            failed.iter().map(|f| format!("{f}; ")).collect::<String>()
        );
        return nrun_base::error::exit::INTERNAL;
    }
    if killed == 0 {
        eprintln!(
            "nrun __reap on {host}: found nothing of run {token}: keeper {keeper} and agent \
             {agent} are gone or other processes now, and no process carries the token; \
             nothing killed"
        );
        return nrun_base::error::exit::INTERNAL;
    }
    0
}

/// `pid`'s start time, in clock ticks since boot (/proc/PID/stat's 22nd field): with its pid,
/// which process it is (a pid reused later has a later one).
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces: the
    // state is the 3rd field, the start time the 22nd.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// `pid`'s parent.
fn parent(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok())
}

/// SIGKILL to `pid` if `ours()` holds of it, on a pidfd opened before the check: if the pid was
/// reused between, the pidfd names the old process and the signal goes nowhere. Ok(true):
/// killed; Ok(false): not ours, or gone.
fn kill_checked(pid: i32, ours: &dyn Fn() -> bool) -> Result<bool, String> {
    // SAFETY: pidfd_open takes a pid and flags; it returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ESRCH) => Ok(false),
            // A kernel older than 5.3: the check and the kill by pid, as close as they come.
            Some(libc::ENOSYS) if ours() => {
                nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL)
                    .map(|()| true)
                    .or_else(|e| match e {
                        nix::errno::Errno::ESRCH => Ok(false),
                        e => Err(e.to_string()),
                    })
            }
            Some(libc::ENOSYS) => Ok(false),
            _ => Err(e.to_string()),
        };
    }
    // SAFETY: a descriptor just returned, owned here.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    if !ours() {
        return Ok(false);
    }
    // SAFETY: pidfd_send_signal on a valid pidfd, no siginfo, no flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    match r {
        0 => Ok(true),
        _ => match std::io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::ESRCH) => Ok(false),
            e => Err(e.to_string()),
        },
    }
}

/// Forks the keeper off. Returns in the child (the real nrun); never returns in the keeper.
/// Must run before any thread exists. Where fork fails, nrun runs without a keeper.
pub fn start() {
    // The keeper's pid and start time: which process it is, as `nrun __reap` checks it (the
    // watch and the workers carry it in their environment).
    let me = std::process::id();
    let token = format!("{me}.{}", start_time(me as i32).unwrap_or(0));
    let tokens = match std::env::var(KEEP_VAR) {
        Ok(v) if !v.is_empty() => format!("{v} {token}"),
        _ => token.clone(),
    };
    // SAFETY: no other thread exists yet (called first thing in main).
    unsafe { std::env::set_var(KEEP_VAR, tokens) };
    // Both ends open in nrun and the keeper; each closes what it does not need below.
    let pipe = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).ok();
    let mut set = SigSet::empty();
    for s in PASSED_ON {
        set.add(s);
    }
    // Blocked across the fork so nothing is lost; the child unblocks at once.
    let Ok(old) = set.thread_swap_mask(SigmaskHow::SIG_BLOCK) else {
        return;
    };
    let keeper = nix::unistd::getpid();
    // SAFETY: no other thread exists yet (called first thing in main).
    match unsafe { fork() } {
        Err(_) => {
            let _ = old.thread_set_mask();
        }
        Ok(ForkResult::Child) => {
            // SAFETY: prctl with integer arguments.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM, 0, 0, 0) };
            if nix::unistd::getppid() != keeper {
                // The keeper is already gone: behave as if told to stop.
                std::process::exit(i32::from(nrun_base::error::exit::signal(libc::SIGTERM)));
            }
            let _ = old.thread_set_mask();
            let _ = KEPT.set((keeper.as_raw() as u32, token));
            // The real nrun holds its write end of the watch's pipe until it exits.
            if let Some((read, write)) = pipe {
                drop(read);
                std::mem::forget(write);
            }
        }
        Ok(ForkResult::Parent { child }) => {
            // After nrun, so nrun stays the keeper's first child.
            let watch = pipe.and_then(|(read, write)| start_watch(read, write, &token));
            keep(child, &set, watch)
        }
    }
}

/// Forks the watch (see the module doc); returns the write end of its pipe, which the keeper
/// keeps open for its life (None: no watch, where fork fails).
fn start_watch(
    read: std::os::fd::OwnedFd,
    write: std::os::fd::OwnedFd,
    token: &str,
) -> Option<(std::os::fd::OwnedFd, Pid)> {
    // SAFETY: the keeper has no other thread.
    match unsafe { fork() } {
        Err(_) => None,
        Ok(ForkResult::Child) => {
            drop(write);
            watch(read, token)
        }
        Ok(ForkResult::Parent { child }) => {
            drop(read);
            Some((write, child))
        }
    }
}

/// The watch's life: deaf to signals and out of the job's process group and terminal, it
/// waits for the pipe's end, then kills what carries `token`.
fn watch(read: std::os::fd::OwnedFd, token: &str) -> ! {
    let _ = SigSet::all().thread_block();
    let _ = nix::unistd::setsid();
    // Not named "nrun": `pkill -9 nrun`, which kills the keeper and nrun at once, is the case
    // the watch is for.
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"nr-watch".as_ptr(), 0, 0, 0) };
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        use std::os::fd::AsRawFd;
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors, which this process owns.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
    // A byte: the keeper cleaned up and ended normally; nothing to do. End of file with no
    // byte: both writers died without a word.
    let mut buf = [0u8; 1];
    let clean = loop {
        match nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&read), &mut buf) {
            Err(nix::errno::Errno::EINTR) => continue,
            Ok(n) => break n > 0,
            Err(_) => break false,
        }
    };
    if !clean {
        let me = std::process::id();
        kill_until_gone(
            || carrying(token, me),
            |p| {
                let _ = nix::sys::signal::kill(p, Signal::SIGKILL);
            },
        );
    }
    std::process::exit(0)
}

/// Processes (other than `me`) whose environment lists `token` in [`KEEP_VAR`].
fn carrying(token: &str, me: u32) -> Vec<Pid> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| carries(*pid, token))
        .map(|pid| Pid::from_raw(pid as i32))
        .collect()
}

/// Whether process `pid`'s environment lists `token` in [`KEEP_VAR`].
fn carries(pid: u32, token: &str) -> bool {
    let needle = format!("{KEEP_VAR}=");
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    env.split(|b| *b == 0).any(|v| {
        v.strip_prefix(needle.as_bytes())
            .is_some_and(|list| String::from_utf8_lossy(list).split(' ').any(|t| t == token))
    })
}

/// `watch`: the watch's pipe (held open while the keeper lives) and pid, which is no orphan to
/// kill: it ends by itself once the keeper has gone.
fn keep(child: Pid, set: &SigSet, watch: Option<(std::os::fd::OwnedFd, Pid)>) -> ! {
    let watch_pid = watch.as_ref().map(|(_, p)| *p);
    super::process::become_subreaper();
    let mut status = None;
    // Slurm gives a signal to every process of the step, nrun too: the keeper passes on none
    // of those it passes on without stopping the job (a copy reached nrun's workers twice).
    let stepd = super::sender::step_daemon();
    let from_step = |info: &libc::siginfo_t, sig: i32| {
        // SAFETY: si_pid is set for SI_USER, the only code it is read under.
        info.si_code == libc::SI_USER
            && ![libc::SIGINT, libc::SIGTERM, libc::SIGHUP].contains(&sig)
            && stepd == Some(unsafe { info.si_pid() })
    };
    while status.is_none() {
        // SAFETY: siginfo_t is a plain C struct for which all zeroes is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waits for one of the blocked signals in `set`.
        let sig = unsafe { libc::sigwaitinfo(set.as_ref(), &mut info) };
        if sig == libc::SIGCHLD {
            status = reap(Some(child));
        } else if sig > 0 && info.si_code != libc::SI_KERNEL && !from_step(&info, sig) {
            let _ = nix::sys::signal::kill(child, Signal::try_from(sig).ok());
        }
    }
    // nrun is gone: whatever it left is now ours.
    let left = || {
        let _ = reap(None);
        orphans()
            .into_iter()
            .filter(|p| Some(*p) != watch_pid)
            .collect()
    };
    kill_until_gone(left, |p| {
        let _ = nix::sys::signal::killpg(p, Signal::SIGKILL);
        let _ = nix::sys::signal::kill(p, Signal::SIGKILL);
    });
    // The watch need not look for survivors: there are none.
    if let Some((pipe, _)) = &watch {
        let _ = nix::unistd::write(pipe, b"k");
    }
    // nrun's scratch directory (and its agents' on this host), which it had no chance to
    // remove when it was killed: those of processes that are gone, this user's, by name.
    if matches!(status, Some(WaitStatus::Signaled(..))) {
        nrun_base::files::sweep_scratch();
    }
    match status {
        Some(WaitStatus::Signaled(_, sig, _)) => {
            // Die the way nrun died, so the shell sees the same status.
            // SAFETY: resets one signal's disposition, unblocks it and raises it.
            unsafe {
                libc::signal(sig as i32, libc::SIG_DFL);
                let mut one = SigSet::empty();
                one.add(sig);
                let _ = one.thread_unblock();
                libc::raise(sig as i32);
            }
            std::process::exit(i32::from(nrun_base::error::exit::signal(sig as i32)))
        }
        Some(WaitStatus::Exited(_, code)) => std::process::exit(code),
        _ => std::process::exit(1),
    }
}

/// Kills what `left` lists until it lists nothing, for at most 3 s (a process may be between
/// fork and exec, or re-parented a moment late).
fn kill_until_gone(left: impl Fn() -> Vec<Pid>, kill: impl Fn(Pid)) {
    let until = Instant::now() + Duration::from_secs(3);
    loop {
        let pids = left();
        if pids.is_empty() || Instant::now() > until {
            return;
        }
        pids.into_iter().for_each(&kill);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Reaps every child that ended; returns `child`'s status if it was among them.
fn reap(child: Option<Pid>) -> Option<WaitStatus> {
    let mut found = None;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return found,
            Ok(s) => {
                if s.pid() == child {
                    found = Some(s);
                }
            }
        }
    }
}

/// This process's children (the re-parented orphans): the keeper is single-threaded, so its
/// task's `children` file lists them all (no scan of /proc).
fn orphans() -> Vec<Pid> {
    let me = std::process::id();
    std::fs::read_to_string(format!("/proc/{me}/task/{me}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .map(Pid::from_raw)
        .collect()
}

#[cfg(test)]
mod tests {
    /// Arguments that do not parse are a usage error, and nothing is killed.
    #[test]
    fn reap_refuses_what_does_not_parse() {
        for args in [
            &[][..],
            &["1", "2"],
            &["x", "2", "3.4"],
            &["1", "2", "3;rm"],
        ] {
            let args = args.iter().map(std::ffi::OsString::from);
            assert_eq!(super::reap_main(args), nrun_base::error::exit::USAGE);
        }
    }

    fn reap(args: &[String]) -> u8 {
        super::reap_main(args.iter().map(std::ffi::OsString::from))
    }

    fn alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
        })
    }

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !done() {
            assert!(std::time::Instant::now() < end, "hung waiting for {what}");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Issue 46: `__reap` kills a keeper only if it is the very process the token names (pid
    /// and start time), its agent only while that keeper's child, workers only if they carry
    /// the token; and says (exit 1) when it found nothing of the run. Real processes: a keeper
    /// and an agent whose command lines read `... __agent ...`, as nrun's do.
    #[test]
    fn reap_kills_only_what_the_token_names_and_says_when_it_found_nothing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("__agent"),
            "if [ \"$1\" = keeper ]; then sh __agent agent & fi; while :; do sleep 0.05; done\n",
        )
        .unwrap();
        let mut keeper = std::process::Command::new("sh")
            .args(["__agent", "keeper"])
            .current_dir(dir.path())
            .spawn()
            .unwrap();
        let k = keeper.id() as i32;
        let mut agent = 0;
        wait_for("the agent", || {
            let kids =
                std::fs::read_to_string(format!("/proc/{k}/task/{k}/children")).unwrap_or_default();
            let is_agent = |p: &i32| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.split(|b| *b == 0).nth(1) == Some(b"__agent".as_slice()))
            };
            agent = kids
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .find(is_agent)
                .unwrap_or(0);
            agent > 0
        });
        let started = super::start_time(k).unwrap();
        // Another start time: another process by that pid. Nothing is killed; said.
        let stale = format!("{k}.{}", started + 1);
        assert_eq!(reap(&[k.to_string(), agent.to_string(), stale]), 1);
        assert!(alive(k) && alive(agent));
        // A token that names another keeper: refused.
        assert_eq!(reap(&[k.to_string(), agent.to_string(), "1.5".into()]), 2);
        assert!(alive(k) && alive(agent));
        // The keeper's own token: both killed.
        let token = format!("{k}.{started}");
        assert_eq!(reap(&[k.to_string(), agent.to_string(), token.clone()]), 0);
        // Neither ends by itself (each loops): both were killed.
        let st = keeper.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(9));
        wait_for("the agent to end", || !alive(agent));
        // Nothing of the run left: exit 1.
        assert_eq!(reap(&[k.to_string(), agent.to_string(), token]), 1);
        // Workers are found by their token alone (their keeper and agent gone).
        let gone = 999_999_999;
        let token = format!("{gone}.5");
        let mut worker = std::process::Command::new("sleep")
            .arg("60")
            .env(super::KEEP_VAR, format!("1.2 {token}"))
            .spawn()
            .unwrap();
        wait_for("the worker's exec", || {
            std::fs::read(format!("/proc/{}/environ", worker.id()))
                .is_ok_and(|e| e.windows(token.len()).any(|w| w == token.as_bytes()))
        });
        assert_eq!(reap(&[gone.to_string(), "2".into(), token]), 0);
        let st = worker.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(9));
    }
}
