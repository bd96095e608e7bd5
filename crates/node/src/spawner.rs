//! The spawner: a small process forked before nrun's runtime starts, which starts the agents
//! (`nrun __agent` here, ssh for other hosts) on nrun's behalf and reports their ends.
//!
//! Why a process of its own: starting a program copies the starter's file table and closes
//! every descriptor marked close-on-exec again in the child (`do_close_on_exec`). nrun holds
//! several descriptors per node (pipes, store connections), so the k-th of a thousand agents
//! started by nrun itself paid for thousands of descriptors: quadratic in the nodes, a tenth
//! of a thousand-node launch. The spawner holds a handful, and it is small, so even a fork
//! (ssh needs its parent-death signal set between fork and exec) costs little.
//!
//! - It is forked while nrun has one thread ([`fork`]), sets its own parent-death signal
//!   (SIGKILL) and checks nrun is still its parent, and keeps only its socket to nrun.
//! - nrun asks over a `SOCK_SEQPACKET` socket pair: start this program with these three
//!   descriptors as its standard ones (passed with `SCM_RIGHTS`), or signal a child of yours.
//!   Its children are its to reap: it reports each end (pid and wait status) on the socket,
//!   one event for nrun where each agent's pidfd was one descriptor and one wake-up apiece.
//! - nrun's own agents on this machine are forked from it with no exec ([`Program::Agent`]):
//!   the agent's code is already in this process, and an exec of nrun's binary with its
//!   start-up cost ten times the fork of this small process (BENCHMARKS.md, the scale
//!   section). The child is made what an exec would have made it (`become_agent`).
//! - Its children die with it: its agents set their parent-death signal against it, ssh gets
//!   it before its exec. When nrun goes (its socket closes, or the parent-death signal), so
//!   does the spawner, and so does everything it started.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex, OnceLock};

use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, recvmsg,
    sendmsg, socketpair,
};
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::sync::{oneshot, watch};

/// The largest message either side sends (a request's argv).
const MAX_MESSAGE: usize = 1 << 16;

/// A start request.
#[derive(Serialize, Deserialize)]
struct Start {
    id: u64,
    program: Program,
}

/// What a start request runs.
#[derive(Serialize, Deserialize)]
pub enum Program {
    /// A program, exec'd (ssh): `pdeathsig` sets its parent-death signal between fork and
    /// exec (a program that does not set its own).
    Exec { argv: Vec<Vec<u8>>, pdeathsig: bool },
    /// nrun's own agent, forked from the spawner with no exec ([`become_agent`]): an exec of
    /// this 9 MB binary and its start-up cost a process ten times a fork of this small one,
    /// and the agent code is already here. `spawner`: the agent starts agents of its own
    /// (an inner agent of the launch tree with nodes on this machine) and gets a spawner of
    /// its own, forked before its runtime as nrun's is.
    Agent { spawner: bool },
}

impl Program {
    pub fn exec(argv: &[OsString], pdeathsig: bool) -> Program {
        Program::Exec {
            argv: argv.iter().map(|a| a.clone().into_vec()).collect(),
            pdeathsig,
        }
    }
}

/// What travels on the socket, either way.
#[derive(Serialize, Deserialize)]
enum Message {
    Start(Start),
    /// Signal this child (nrun to the spawner), if it has not been reaped.
    Kill {
        pid: u32,
        signal: i32,
    },
    /// The child of request `id` runs as `pid` (spawner to nrun).
    Started {
        id: u64,
        pid: u32,
    },
    /// Request `id` could not start its program: why.
    Failed {
        id: u64,
        error: String,
    },
    /// Child `pid` ended with this wait status.
    Ended {
        pid: u32,
        status: i32,
    },
}

/// nrun's end of the socket, until the runtime makes a [`Client`] of it.
static SOCKET: OnceLock<Mutex<Option<OwnedFd>>> = OnceLock::new();
static CLIENT: OnceLock<Option<Arc<Client>>> = OnceLock::new();
/// What a forked agent runs, given the spawner's pid to die with: the agent lives above this
/// crate, so the binary hands its entry point in ([`fork`]).
static AGENT: OnceLock<fn(i32) -> u8> = OnceLock::new();

/// Forks the spawner. Must run while nrun has a single thread (before its runtime). Without
/// it (fork failed), agents are started by nrun itself. `agent` is the agent's entry point,
/// given the spawner's pid (it ties itself to it).
pub fn fork(agent: fn(i32) -> u8) {
    let _ = AGENT.set(agent);
    let Ok((ours, theirs)) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    ) else {
        return;
    };
    let nrun = nix::unistd::getpid();
    // SAFETY: nrun has one thread here (see the doc); the child runs only `serve`.
    match unsafe { nix::unistd::fork() } {
        Err(_) => {}
        Ok(nix::unistd::ForkResult::Child) => {
            drop(ours);
            serve(theirs, nrun)
        }
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            drop(theirs);
            let _ = SOCKET.set(Mutex::new(Some(ours)));
            // Not one of the workers' orphans: an agent's sweep after its workers spares it.
            crate::process::keep_own(child.as_raw() as u32);
        }
    }
}

/// The spawner's life.
fn serve(sock: OwnedFd, nrun: nix::unistd::Pid) -> ! {
    crate::process::die_with(nrun.as_raw());
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"nrun-spawner".as_ptr(), 0, 0, 0) };
    // Out of the terminal's foreground group: a Ctrl-C is nrun's to handle (it stops the job
    // in order), not a reason for the spawner, and with it every agent, to die.
    let _ = nix::unistd::setpgid(nix::unistd::Pid::from_raw(0), nix::unistd::Pid::from_raw(0));
    // Only its socket (on 3) and the standard descriptors stay: the point of this process.
    let raw = sock.as_raw_fd();
    // SAFETY: dup2 on descriptors this process owns.
    unsafe {
        if raw != 3 {
            libc::dup2(raw, 3);
        }
    }
    close_from(4);
    std::mem::forget(sock);
    // SAFETY: 3 is the socket, dup'ed above (without close-on-exec: set it again).
    let sock = unsafe { OwnedFd::from_raw_fd(3) };
    let _ = nix::fcntl::fcntl(
        sock.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    );
    // Every signal blocked: Slurm signals each process of a step (its --signal, the TERM of
    // scancel), a user may signal the whole tree; those are nrun's to handle, through its
    // agents, in order. The spawner ends with nrun (its socket, its parent-death SIGKILL).
    // Its children start with an empty mask again (see `start`).
    let _ = nix::sys::signal::SigSet::all().thread_block();
    // Children's ends arrive on a signalfd (SIGCHLD, blocked above, queues there).
    let mut mask = nix::sys::signal::SigSet::empty();
    mask.add(nix::sys::signal::Signal::SIGCHLD);
    let Ok(sfd) = nix::sys::signalfd::SignalFd::with_flags(
        &mask,
        nix::sys::signalfd::SfdFlags::SFD_CLOEXEC | nix::sys::signalfd::SfdFlags::SFD_NONBLOCK,
    ) else {
        std::process::exit(1);
    };
    // What every forked agent would otherwise pay for again: where its command line lies,
    // and the CPU feature checks of its ciphers (cpuid traps to the hypervisor in a VM).
    let area = crate::process::ArgArea::of_self();
    nrun_store::auth::warm_up();
    let mut children: std::collections::HashSet<u32> = Default::default();
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut fds = [
            nix::poll::PollFd::new(sock.as_fd(), nix::poll::PollFlags::POLLIN),
            nix::poll::PollFd::new(sfd.as_fd(), nix::poll::PollFlags::POLLIN),
        ];
        if let Err(e) = nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
            if e == nix::errno::Errno::EINTR {
                continue;
            }
            break;
        }
        let sock_ready = fds[0].revents().is_some_and(|r| !r.is_empty());
        let child_ready = fds[1].revents().is_some_and(|r| !r.is_empty());
        if child_ready {
            while let Ok(Some(_)) = sfd.read_signal() {}
            reap(&sock, &mut children);
        }
        if sock_ready {
            match receive(sock.as_raw_fd(), &mut buf) {
                Ok(Some((msg, fds))) => handle(&sock, msg, fds, &mut children, area),
                Ok(None) => break,
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
                Err(_) => break,
            }
        }
    }
    // nrun is gone: so is everything started for it.
    for pid in &children {
        // SAFETY: a plain kill of a child not yet reaped.
        unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
    }
    std::process::exit(0)
}

/// Closes every descriptor from `first` up: close_range (Linux 5.9), else each one listed in
/// /proc/self/fd.
fn close_from(first: RawFd) {
    // SAFETY: close_range and close on this process's own descriptors (one thread).
    unsafe {
        if libc::syscall(libc::SYS_close_range, first as u32, u32::MAX, 0u32) == 0 {
            return;
        }
        let open: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        for fd in open.into_iter().filter(|fd| *fd >= first) {
            libc::close(fd);
        }
    }
}

/// Reaps every child that ended and says so.
fn reap(sock: &OwnedFd, children: &mut std::collections::HashSet<u32>) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on this process's own children.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
        children.remove(&(pid as u32));
        send(
            sock.as_raw_fd(),
            &Message::Ended {
                pid: pid as u32,
                status,
            },
            &[],
        );
    }
}

fn handle(
    sock: &OwnedFd,
    msg: Message,
    fds: Vec<OwnedFd>,
    children: &mut std::collections::HashSet<u32>,
    area: Option<crate::process::ArgArea>,
) {
    match msg {
        Message::Start(s) => {
            let reply = match start(&s, fds, area) {
                Ok(pid) => {
                    children.insert(pid);
                    Message::Started { id: s.id, pid }
                }
                Err(e) => Message::Failed {
                    id: s.id,
                    error: e.to_string(),
                },
            };
            send(sock.as_raw_fd(), &reply, &[]);
        }
        Message::Kill { pid, signal } if children.contains(&pid) => {
            // SAFETY: a plain kill of a child not yet reaped (so its pid is still its own).
            unsafe { libc::kill(pid as i32, signal) };
        }
        _ => {}
    }
}

/// Starts `s` with `fds` as its stdin, stdout and stderr, in a process group of its own.
fn start(
    s: &Start,
    fds: Vec<OwnedFd>,
    area: Option<crate::process::ArgArea>,
) -> std::io::Result<u32> {
    let stdio: [OwnedFd; 3] = fds.try_into().map_err(|_| {
        std::io::Error::other("the start request came without its three descriptors")
    })?;
    let (argv, pdeathsig) = match &s.program {
        Program::Exec { argv, pdeathsig } => (argv, *pdeathsig),
        Program::Agent { spawner } => return fork_agent(stdio, *spawner, area),
    };
    let [stdin, stdout, stderr] = stdio;
    let Some((program, args)) = argv.split_first() else {
        return Err(std::io::Error::other("an empty command line"));
    };
    let mut cmd = std::process::Command::new(std::ffi::OsStr::from_bytes(program));
    cmd.args(args.iter().map(|a| std::ffi::OsStr::from_bytes(a)))
        .stdin(stdin)
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0);
    // The child starts with no signal blocked: this process blocks them all, and a mask is
    // inherited through exec (an agent with SIGUSR1 blocked never passed Slurm's on, its
    // workers with SIGCHLD blocked would miss their own children's ends). A fork of this small
    // process costs little.
    // SAFETY: only async-signal-safe calls between fork and exec (this process has one thread).
    unsafe {
        cmd.pre_exec(move || {
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            if pdeathsig {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    // Reaped by `reap`, not by std.
    Ok(child.id())
}

/// Forks nrun's agent ([`Program::Agent`]) with `stdio` as its standard descriptors.
fn fork_agent(
    stdio: [OwnedFd; 3],
    spawner: bool,
    area: Option<crate::process::ArgArea>,
) -> std::io::Result<u32> {
    let me = nix::unistd::getpid();
    // SAFETY: this process has one thread; the child only sets itself up and runs the agent.
    match unsafe { nix::unistd::fork() } {
        Err(e) => Err(std::io::Error::other(format!(
            "nrun's spawner cannot fork the agent: {e} (check this machine's process limit, \
             ulimit -u, and its free memory)"
        ))),
        Ok(nix::unistd::ForkResult::Child) => become_agent(me, stdio, spawner, area),
        // Ours are closed (dropped) now that the child holds its copies.
        Ok(nix::unistd::ForkResult::Parent { child }) => Ok(child.as_raw() as u32),
    }
}

/// The forked child's life: what an exec of `nrun __agent` would have given it (its own
/// descriptors and nothing else, an empty signal mask, its own process group, no log
/// subscriber), tied to the spawner as `agent::tie_to_parent` ties an exec'd one, then the
/// agent.
fn become_agent(
    spawner_pid: nix::unistd::Pid,
    stdio: [OwnedFd; 3],
    spawner: bool,
    area: Option<crate::process::ArgArea>,
) -> ! {
    crate::process::die_with(spawner_pid.as_raw());
    // SAFETY: dup2 and close on this process's own descriptors. The three land on 0-2
    // whatever their numbers; then everything else goes: the spawner's socket and signalfd (no
    // exec, so close-on-exec closes nothing). The copies above 2 are close-on-exec, so that
    // even a descriptor left open by a failed close reaches no worker.
    unsafe {
        let raw: Vec<RawFd> = stdio.iter().map(|f| f.as_raw_fd()).collect();
        // Moved above 2 first so that dup2 onto 0-2 cannot clobber one still to be copied.
        let high: Vec<RawFd> = raw
            .iter()
            .map(|&fd| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10))
            .collect();
        for (target, fd) in high.iter().enumerate() {
            if *fd < 0 || libc::dup2(*fd, target as RawFd) < 0 {
                libc::_exit(1);
            }
        }
        std::mem::forget(stdio);
    }
    close_from(3);
    let _ = nix::unistd::setpgid(nix::unistd::Pid::from_raw(0), nix::unistd::Pid::from_raw(0));
    let _ = nix::sys::signal::SigSet::empty().thread_set_mask();
    if let Some(a) = area {
        a.retitle(&["nrun", "__agent"]);
    }
    nrun_base::silence_logging();
    let Some(&agent) = AGENT.get() else {
        // SAFETY: _exit ends this forked child at once; only fork sets AGENT, before forking.
        unsafe { libc::_exit(101) }
    };
    if spawner {
        fork(agent);
    }
    // A panic must not unwind into the spawner's frames below (this process is no spawner).
    let pid = spawner_pid.as_raw();
    let code = std::panic::catch_unwind(move || agent(pid)).unwrap_or(101);
    // What exit would do that matters here (std's stdout buffer), without the exit handlers
    // of every loaded library (a tenth of an agent's exit, the image being nrun's).
    let _ = std::io::Write::flush(&mut std::io::stdout());
    // SAFETY: _exit ends the process at once; nothing of this process is left to run.
    unsafe { libc::_exit(i32::from(code)) }
}

fn send(sock: RawFd, msg: &Message, fds: &[RawFd]) -> bool {
    let Ok(bytes) = serde_json::to_vec(msg) else {
        return false;
    };
    let iov = [IoSlice::new(&bytes)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    loop {
        match sendmsg::<()>(sock, &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(_) => return true,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return false,
        }
    }
}

/// One message and the descriptors that came with it; None: the other side closed.
fn receive(
    sock: RawFd,
    buf: &mut [u8],
) -> Result<Option<(Message, Vec<OwnedFd>)>, nix::errno::Errno> {
    let mut space = nix::cmsg_space!([RawFd; 3]);
    let mut iov = [IoSliceMut::new(buf)];
    let r = recvmsg::<()>(sock, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for c in r.cmsgs().into_iter().flatten() {
        if let ControlMessageOwned::ScmRights(got) = c {
            // SAFETY: descriptors just received, owned by nobody else.
            fds.extend(
                got.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let n = r.bytes;
    if n == 0 {
        return Ok(None);
    }
    // A message nrun cannot read is ignored (both sides are this binary).
    Ok(serde_json::from_slice(&buf[..n]).ok().map(|m| (m, fds)))
}

/// nrun's side: requests go out on the socket, one task reads the answers and the ends.
pub struct Client {
    sock: AsyncFd<OwnedFd>,
    state: Mutex<State>,
    next: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct State {
    waiting: HashMap<u64, oneshot::Sender<std::io::Result<Child>>>,
    running: HashMap<u32, watch::Sender<Option<ExitStatus>>>,
}

/// A process the spawner started: its pid and its end, once reported.
pub struct Child {
    pub pid: u32,
    pub ended: watch::Receiver<Option<ExitStatus>>,
}

/// The spawner, if nrun forked one; inside the runtime (its socket is read by a task).
pub fn client() -> Option<Arc<Client>> {
    CLIENT
        .get_or_init(|| {
            let fd = SOCKET.get()?.lock().ok()?.take()?;
            let _ = nix::fcntl::fcntl(
                fd.as_raw_fd(),
                nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
            );
            // SAFETY: the descriptor is owned by the AsyncFd, never replaced nor closed while
            // registered.
            let sock = unsafe { AsyncFd::register(fd) }.ok()?;
            let client = Arc::new(Client {
                sock,
                state: Mutex::default(),
                next: Default::default(),
            });
            tokio::spawn(read_answers(client.clone()));
            Some(client)
        })
        .clone()
}

async fn read_answers(c: Arc<Client>) {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let Ok(mut guard) = c.sock.readable().await else {
            break;
        };
        let got = guard.try_io(|s| receive(s.as_raw_fd(), &mut buf).map_err(std::io::Error::from));
        let msg = match got {
            Err(_would_block) => continue,
            Ok(Ok(Some((m, _)))) => m,
            Ok(Ok(None)) | Ok(Err(_)) => break,
        };
        let mut st = c.state.lock().unwrap_or_else(|e| e.into_inner());
        match msg {
            Message::Started { id, pid } => {
                let (tx, ended) = watch::channel(None);
                st.running.insert(pid, tx);
                if let Some(w) = st.waiting.remove(&id) {
                    let _ = w.send(Ok(Child { pid, ended }));
                }
            }
            Message::Failed { id, error } => {
                if let Some(w) = st.waiting.remove(&id) {
                    let _ = w.send(Err(std::io::Error::other(error)));
                }
            }
            Message::Ended { pid, status } => {
                if let Some(tx) = st.running.remove(&pid) {
                    tx.send_replace(Some(ExitStatus::from_raw(status)));
                }
            }
            _ => {}
        }
    }
    // The spawner is gone (it cannot be, while nrun lives): every child reads as ended.
    let mut st = c.state.lock().unwrap_or_else(|e| e.into_inner());
    for (_, tx) in st.running.drain() {
        tx.send_replace(Some(ExitStatus::from_raw(0xff << 8)));
    }
    st.waiting.clear();
}

impl Client {
    async fn send(&self, msg: &Message, fds: &[RawFd]) -> bool {
        let Ok(bytes) = serde_json::to_vec(msg) else {
            return false;
        };
        loop {
            let Ok(mut guard) = self.sock.writable().await else {
                return false;
            };
            let sent = guard.try_io(|s| {
                let iov = [IoSlice::new(&bytes)];
                let cmsg = [ControlMessage::ScmRights(fds)];
                let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
                sendmsg::<()>(s.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(std::io::Error::from)
            });
            match sent {
                Err(_would_block) => continue,
                Ok(r) => return r.is_ok(),
            }
        }
    }

    /// Starts `program` (in nrun's environment as it was when the spawner forked) with these
    /// descriptors as its standard ones.
    pub async fn start(&self, program: Program, stdio: [OwnedFd; 3]) -> std::io::Result<Child> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .waiting
            .insert(id, tx);
        let msg = Message::Start(Start { id, program });
        // A request the spawner could not read whole would never be answered.
        if serde_json::to_vec(&msg).map_or(true, |b| b.len() > MAX_MESSAGE) {
            self.state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .waiting
                .remove(&id);
            return Err(std::io::Error::other(format!(
                "its command line is longer than nrun's spawner takes ({MAX_MESSAGE} bytes)"
            )));
        }
        let raw: Vec<RawFd> = stdio.iter().map(|f| f.as_raw_fd()).collect();
        if !self.send(&msg, &raw).await {
            self.state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .waiting
                .remove(&id);
            return Err(gone());
        }
        // Ours are closed now that the spawner holds its copies.
        drop(stdio);
        rx.await.unwrap_or_else(|_| Err(gone()))
    }

    /// Sends `signal` to child `pid`, if it has not ended.
    pub async fn kill(&self, pid: u32, signal: i32) {
        self.send(&Message::Kill { pid, signal }, &[]).await;
    }
}

/// The spawner's end, as a client of it sees it.
fn gone() -> std::io::Error {
    std::io::Error::other("nrun's spawner process is gone")
}
