//! Starting a worker without copying the agent: `clone(CLONE_VM | CLONE_VFORK)` runs the child
//! on a small stack of its own inside the agent's memory until it execs, as glibc's posix_spawn
//! does, so no page table is copied and no page of the agent is faulted copy-on-write (a fork
//! was most of an agent's cost at a thousand nodes). posix_spawn itself cannot set what a worker
//! needs before exec: the parent-death signal, the CPU affinity, the open-file limit, the
//! terminal's foreground.
//!
//! The child shares the heap with the agent's other threads, so between clone and exec it makes
//! only system calls on data made ready beforehand: no allocation, no lock, no panic. Its exit is
//! waited for through a pidfd (SIGCHLD where the kernel has none).

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString, c_char, c_int, c_void};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};

const SH: &std::ffi::CStr = c"/bin/sh";

/// The child's stack until exec: its steps are a few system calls deep.
const STACK: usize = 64 * 1024;

/// What to start.
pub(crate) struct Spec<'a> {
    /// The file to run (found on PATH already).
    pub path: &'a std::path::Path,
    /// argv[0].
    pub program: &'a OsStr,
    /// Arguments after the program's name.
    pub args: &'a [OsString],
    /// The whole environment.
    pub env: &'a BTreeMap<OsString, OsString>,
    /// Inherit this process's stdin (else /dev/null).
    pub stdin: bool,
    /// Take the terminal's foreground for the new process group.
    pub foreground: bool,
    pub cpus: Option<&'a [usize]>,
    /// Per stream: a terminal of this size rather than a pipe.
    pub tty: [Option<super::output::Tty>; 2],
}

/// A started child: the leader of its own process group, its stdout and stderr piped here
/// (each with whether it is a terminal's master side rather than a pipe).
pub(crate) struct Spawned {
    pub pid: libc::pid_t,
    pub stdout: (OwnedFd, bool),
    pub stderr: (OwnedFd, bool),
}

/// What the child reads (and, on a failure before exec, writes: `errno`).
#[repr(C)]
struct Steps {
    path: *const c_char,
    argv: *const *const c_char,
    sh_argv: *const *const c_char,
    envp: *const *const c_char,
    /// -1: keep fd 0 as it is.
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    parent: libc::pid_t,
    foreground: bool,
    cpus: Option<libc::cpu_set_t>,
    errno: AtomicI32,
}

/// Starts `spec` as the leader of a new process group, tied to this process (SIGKILL when the
/// calling thread ends: call it from the thread whose end is the process's end).
pub(crate) fn spawn(spec: &Spec) -> io::Result<Spawned> {
    let path = cstring(spec.path.as_os_str())?;
    let argv_c: Vec<CString> = std::iter::once(spec.program)
        .chain(spec.args.iter().map(OsString::as_os_str))
        .map(cstring)
        .collect::<io::Result<_>>()?;
    let envp_c: Vec<CString> = spec
        .env
        .iter()
        .map(|(k, v)| {
            let mut kv = k.clone().into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            cstring(OsStr::from_bytes(&kv))
        })
        .collect::<io::Result<_>>()?;
    let argv: Vec<*const c_char> = argv_c
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    // A file without a "#!" line is a shell script to execvp (and so to std's spawn): the
    // same fallback, made ready in case exec says ENOEXEC.
    let sh_argv: Vec<*const c_char> = [SH.as_ptr(), path.as_ptr()]
        .into_iter()
        .chain(argv_c[1..].iter().map(|c| c.as_ptr()))
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: Vec<*const c_char> = envp_c
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();

    let (out_r, out_w, out_tty) = pipe_or_tty(spec.tty[0])?;
    let (err_r, err_w, err_tty) = pipe_or_tty(spec.tty[1])?;
    let null = if spec.stdin {
        None
    } else {
        let null = c"/dev/null";
        // SAFETY: a constant path; the descriptor is owned at once.
        let fd = unsafe { libc::open(null.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: just opened, owned by nothing else.
        Some(high(unsafe { OwnedFd::from_raw_fd(fd) })?)
    };
    let cpus = spec.cpus.map(|cpus| {
        // SAFETY: cpu_set_t is plain bits; CPU_SET ignores indexes past CPU_SETSIZE.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for c in cpus {
            // SAFETY: as above: sets one bit of a local set.
            unsafe { libc::CPU_SET(*c, &mut set) };
        }
        set
    });
    let steps = Steps {
        path: path.as_ptr(),
        argv: argv.as_ptr(),
        sh_argv: sh_argv.as_ptr(),
        envp: envp.as_ptr(),
        stdin: null.as_ref().map_or(-1, |f| f.as_raw_fd()),
        stdout: out_w.as_raw_fd(),
        stderr: err_w.as_raw_fd(),
        parent: std::process::id() as libc::pid_t,
        foreground: spec.foreground,
        cpus,
        errno: AtomicI32::new(0),
    };
    let mut stack = vec![0u8; STACK];
    // The stack grows down from its end, which must be 16-byte aligned.
    let top = (stack.as_mut_ptr() as usize + STACK) & !15;

    // Signals stay blocked in this thread while the child runs on our memory: a handler run in
    // the child would act on the agent's state. The child unblocks them once it has put every
    // handler back to the default.
    // SAFETY: sigset operations on locals; clone runs `child` on `stack`, which outlives it (this
    // thread is suspended until the child execs or exits); `steps` and the arrays it points into
    // live until after that.
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            child,
            top as *mut c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &steps as *const Steps as *mut c_void,
        );
        let clone_err = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if pid < 0 {
            return Err(clone_err);
        }
        pid
    };
    drop(stack);
    let errno = steps.errno.load(Ordering::Relaxed);
    if errno != 0 {
        // It never ran the program: reap it here, nobody else waits for it.
        let mut status = 0;
        // SAFETY: our own child, waited for once.
        while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
            && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
        {}
        return Err(io::Error::from_raw_os_error(errno));
    }
    drop((out_w, err_w, null));
    Ok(Spawned {
        pid,
        stdout: (out_r, out_tty),
        stderr: (err_r, err_tty),
    })
}

/// The child, until exec. Only system calls: see the module's note.
extern "C" fn child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `Steps`, alive and unchanged until this child execs or
    // exits; every call below is async-signal-safe.
    unsafe {
        let s = &*(arg as *const Steps);
        // If the agent is killed outright (SIGKILL), its workers die with it.
        super::process::die_with(s.parent);
        // Its own session, as torchrun's workers (`start_new_session`): its own process group
        // and its own scheduler autogroup; two CPU-bound workers sharing nrun's stepped 6% slower
        // (BENCHMARKS 26). One that reads the terminal stays in nrun's session, whose
        // foreground group it must become.
        let led = if s.foreground {
            libc::setpgid(0, 0)
        } else {
            libc::setsid()
        };
        if led < 0 {
            fail(s);
        }
        if s.foreground {
            // The terminal's foreground, asked for with SIGTTOU ignored as a background group
            // must (this child's dispositions are its own: no CLONE_SIGHAND).
            let old = libc::signal(libc::SIGTTOU, libc::SIG_IGN);
            libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpid());
            libc::signal(libc::SIGTTOU, old);
        }
        if let Some(set) = &s.cpus {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set);
        }
        super::process::restore_fd_limit();
        // Every descriptor prepared is 3 or above (`high`), so none is overwritten here; dup2
        // clears close-on-exec on the copy.
        if (s.stdin >= 0 && libc::dup2(s.stdin, 0) < 0)
            || libc::dup2(s.stdout, 1) < 0
            || libc::dup2(s.stderr, 2) < 0
        {
            fail(s);
        }
        // Handlers are the agent's code: back to the default before signals are let in. SIGPIPE
        // too, which Rust ignores and a worker must not inherit ignored (as std's spawn does).
        let mut old: libc::sigaction = std::mem::zeroed();
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        for sig in 1..65 {
            if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                continue;
            }
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && (old.sa_sigaction != libc::SIG_IGN || sig == libc::SIGPIPE)
                && old.sa_sigaction != libc::SIG_DFL
            {
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::execve(s.path, s.argv, s.envp);
        if *libc::__errno_location() == libc::ENOEXEC {
            libc::execve(SH.as_ptr(), s.sh_argv, s.envp);
        }
        fail(s)
    }
}

/// Tells the parent why the child could not run the program, and ends the child.
unsafe fn fail(s: &Steps) -> ! {
    // SAFETY: errno is this thread's; _exit runs no handler of the agent's.
    unsafe {
        s.errno.store(*libc::__errno_location(), Ordering::Relaxed);
        libc::_exit(127)
    }
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} holds a NUL byte", s.to_string_lossy()),
        )
    })
}

/// A terminal of size `tty` (master side, worker's side, true), or a pipe where none was asked
/// for or none can be had (no /dev/ptmx in a container: the worker then sees a pipe, as it
/// would have).
fn pipe_or_tty(tty: Option<super::output::Tty>) -> io::Result<(OwnedFd, OwnedFd, bool)> {
    if let Some(t) = tty {
        match pseudo_terminal(t) {
            Ok((m, s)) => return Ok((m, s, true)),
            Err(e) => tracing::debug!("no terminal for a worker ({e}): a pipe instead"),
        }
    }
    pipe().map(|(r, w)| (r, w, false))
}

/// A pseudo-terminal of `size`, (master, worker's side), close-on-exec, both 3 or above. The
/// worker's side is raw (bytes pass as written: no "\n" to "\r\n", no echo) and never
/// anyone's controlling terminal (O_NOCTTY: the worker, a session leader, does not open it); the
/// master is non-blocking, for the runtime.
fn pseudo_terminal(size: super::output::Tty) -> io::Result<(OwnedFd, OwnedFd)> {
    let fail = || Err(io::Error::last_os_error());
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: plain system calls on descriptors owned at once; `name` is NUL-terminated by
    // ptsname_r on success, `t` is a plain struct filled and read by the calls.
    unsafe {
        let m = libc::open(c"/dev/ptmx".as_ptr(), flags | libc::O_NONBLOCK);
        if m < 0 {
            return fail();
        }
        let master = OwnedFd::from_raw_fd(m);
        let mut name = [0 as c_char; 128];
        if libc::grantpt(m) != 0
            || libc::unlockpt(m) != 0
            || libc::ptsname_r(m, name.as_mut_ptr(), name.len()) != 0
        {
            return fail();
        }
        let s = libc::open(name.as_ptr(), flags);
        if s < 0 {
            return fail();
        }
        let worker = OwnedFd::from_raw_fd(s);
        let mut t: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(s, &mut t) != 0 {
            return fail();
        }
        libc::cfmakeraw(&mut t);
        if libc::tcsetattr(s, libc::TCSANOW, &t) != 0 {
            return fail();
        }
        size.set(&worker)?;
        Ok((high(master)?, high(worker)?))
    }
}

/// A close-on-exec pipe, (read end, write end), both 3 or above.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as c_int; 2];
    // SAFETY: pipe2 fills the two descriptors, owned at once.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the two descriptors pipe2 just made, owned by nothing else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((high(r)?, high(w)?))
}

/// `fd`, moved to 3 or above if it is one of 0-2 (nrun started with one of those closed), so
/// the child's dup2 onto 0-2 never overwrites another descriptor it still needs.
fn high(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: a new close-on-exec copy of a descriptor we own.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor fcntl just made, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Waits for child `pid` to exit and reaps it.
pub(crate) async fn wait(pid: libc::pid_t) -> io::Result<ExitStatus> {
    // SAFETY: pidfd_open takes a pid and flags; a descriptor it returns is owned at once.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd >= 0 {
        // SAFETY: the descriptor pidfd_open just returned, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        // SAFETY: the AsyncFd owns the descriptor, which stays open and the same until dropped.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)?
        };
        loop {
            if let Some(s) = try_wait(pid)? {
                return Ok(s);
            }
            // Readable once the process has exited.
            fd.readable().await?.clear_ready();
        }
    }
    // No pidfd (a kernel before 5.3, or a sandbox that forbids it): each SIGCHLD, look again.
    // The listener is made before the first look, so an exit between the two is not missed.
    let mut chld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
    loop {
        if let Some(s) = try_wait(pid)? {
            return Ok(s);
        }
        chld.recv().await;
    }
}

fn try_wait(pid: libc::pid_t) -> io::Result<Option<ExitStatus>> {
    let mut status = 0;
    loop {
        // SAFETY: a wait for our own child into a local.
        match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
            0 => return Ok(None),
            p if p == pid => return Ok(Some(ExitStatus::from_raw(status))),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}
