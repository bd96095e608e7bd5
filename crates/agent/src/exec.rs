//! What a node does for a step, shared by the agent process (`nrun __agent` on another node)
//! and the in-process agent of a single-node run: [`dispatch`] is the one step dispatcher (start
//! a step's workers and supervise them to their end, probe another node, or end).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use super::stacks::WatchFiles;
use nrun_base::error::{Error, Result};
use nrun_node::output::{Sink, WorkerOutput};
use nrun_node::{self as node, Outcome, StopRequest, WorkerCmd};
use nrun_proto::protocol::{
    Ending, NodeWatch, RunResult, Step, StepResult, THIS_NRUN, WorkerFailure, WorkerSpec,
};

/// The CPUs close to the GPU a worker uses (NVML's affinity of that device); None, with a
/// warning, when unknown. NVML numbers GPUs in PCI order, as CUDA does for GPUs of one model
/// (CUDA_DEVICE_ORDER=PCI_BUS_ID makes it so for mixed ones).
fn gpu_cpus(env: &[(String, String)], local_rank: usize) -> Option<Vec<usize>> {
    let gpu = crate::exec::worker_gpu(env, local_rank);
    let Ok(index) = gpu.parse::<u32>() else {
        tracing::warn!(
            "--numa-binding: local rank {local_rank}'s GPU is {gpu:?}, not an index; not bound"
        );
        return None;
    };
    match nrun_preflight::hardware::cpu_affinity(index) {
        Ok(cpus) => Some(cpus),
        Err(e) => {
            tracing::warn!("--numa-binding: local rank {local_rank}: {e}; not bound");
            None
        }
    }
}

/// What a node made of a step.
#[derive(Debug)]
pub enum Done {
    /// Its result, to publish.
    Result(StepResult),
    /// The session ended: leave the step loop.
    End,
}

/// What a node's side of a running step gets from outside the node.
pub struct StepIo {
    /// Stop requests and signals to pass on.
    pub stop: watch::Receiver<StopRequest>,
    /// Where the watch's views go, if the step asks for the watch.
    pub views: Option<tokio::sync::mpsc::UnboundedSender<NodeWatch>>,
    /// The run's secret, for nrun's own ranks.
    pub secret: Option<String>,
}

/// The one step dispatcher: does `step` on this node. A Run with no workers (a node outside
/// every group of a bisect round) succeeds at once.
pub async fn dispatch(step: Step, io: StepIo) -> Done {
    let result = match step {
        Step::End => return Done::End,
        Step::Probe { target, timeout_ms } => StepResult::Probe {
            error: probe_peer(&target, timeout_ms)
                .await
                .err()
                .map(|e| e.message),
        },
        Step::Run { workers, .. } if workers.is_empty() => StepResult::Run(RunResult::Success),
        Step::Run {
            workers,
            grace_ms,
            deadline_ms,
            watch,
            hang_timeout_ms,
            ..
        } => {
            let views = io.views.filter(|_| watch);
            let r = run_workers(
                workers,
                grace_ms,
                deadline_ms,
                io.stop,
                views,
                hang_timeout_ms.map(Duration::from_millis),
                io.secret.as_deref(),
            );
            StepResult::Run(r.await)
        }
    };
    Done::Result(result)
}

/// Runs one step's workers to their end; `stop` carries requests from outside the node. With
/// `watch`, their stacks are sampled and the node's views sent there (see [`super::stacks`]).
async fn run_workers(
    specs: Vec<WorkerSpec>,
    grace_ms: u64,
    deadline_ms: Option<u64>,
    stop: watch::Receiver<StopRequest>,
    watch: Option<tokio::sync::mpsc::UnboundedSender<NodeWatch>>,
    hang_timeout: Option<Duration>,
    secret: Option<&str>,
) -> RunResult {
    let mut cmds = Vec::with_capacity(specs.len());
    let this_nrun = std::env::current_exe();
    let specs = match in_scratch(specs) {
        Ok(s) => s,
        Err(e) => return RunResult::SpawnError(e.to_string()),
    };
    // Error files in nrun's scratch (no --log-dir) are read, then removed after the step; the
    // directory at the End ([`nrun_base::files::remove_scratch`]).
    let scratch: Vec<std::path::PathBuf> = specs
        .iter()
        .filter(|w| w.log_dir.is_none())
        .map(|w| w.error_file.clone())
        .collect();
    let mut watch_files = Vec::new();
    // The node of rank 0 asks NCCL's RAS about the job when its ranks stall.
    let ras = specs
        .iter()
        .find(|w| w.rank == 0)
        .and_then(|w| super::ras::target(&w.env));
    // --progress-regex, checked by the launcher: one compiled pattern for every worker.
    let progress = specs
        .iter()
        .find_map(|w| w.progress.as_deref())
        .and_then(|re| match regex::Regex::new(re) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!("--progress-regex {re:?}: {e}; this node's progress is not read");
                None
            }
        });
    // nrun's NCCL profiler plugin, installed once for the step's workers (see gpu_time).
    let plugin = match (watch.is_some(), nrun_base::files::scratch(), specs.first()) {
        (true, Ok(dir), Some(w)) if !super::cost::skipped("gpu") => {
            super::gpu_time::Plugin::install(&w.env, &dir)
        }
        _ => None,
    };
    for w in specs {
        let progress = progress.clone().filter(|_| w.progress.is_some());
        let watching = watch.is_some().then_some(plugin.as_ref());
        match worker_cmd(w, &this_nrun, watching, secret, &mut watch_files, progress) {
            Ok(cmd) => cmds.push(cmd),
            Err(e) => return RunResult::SpawnError(e.message),
        }
    }
    let deadline = deadline_ms.map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    let (ended, ended_rx) = tokio::sync::oneshot::channel::<()>();
    let events = match watch {
        Some(out) if !cmds.is_empty() => {
            let stall = super::stacks::Stalls::new(hang_timeout);
            Some(start_watch(out, ended_rx, &watch_files, ras, stall))
        }
        _ => None,
    };
    let grace = Duration::from_millis(grace_ms);
    let oom_mark = super::oom::mark();
    let outcome = node::run_group(cmds, grace, deadline, stop, events).await;
    drop(ended);
    let result = run_result(outcome, &oom_mark, &scratch);
    // The dump pipes and files and the GPU-time counters are nrun's own (only those are in
    // `watch_files`).
    for (_, f) in &watch_files {
        for p in f.fr.iter().flat_map(|f| [&f.pipe, &f.dump]).chain(&f.gpu) {
            let _ = std::fs::remove_file(p);
        }
    }
    for f in &scratch {
        // Looked up first: most workers leave none, and an unlink locks the directory.
        if f.symlink_metadata().is_ok() {
            let _ = std::fs::remove_file(f);
        }
    }
    result
}

/// How to start one worker: its program, logs, CPUs and environment. With `watching` (and the
/// step's NCCL profiler plugin, where installed), the files the watch reads of it (its flight
/// recorder's and GPU-time counters, nrun's own) are added to `watch_files`. Err: why it cannot
/// start.
fn worker_cmd(
    w: WorkerSpec,
    this_nrun: &std::io::Result<std::path::PathBuf>,
    watching: Option<Option<&super::gpu_time::Plugin>>,
    secret: Option<&str>,
    watch_files: &mut Vec<(usize, WatchFiles)>,
    progress: Option<regex::Regex>,
) -> Result<WorkerCmd> {
    let program = match (w.program.as_str(), this_nrun) {
        (THIS_NRUN, Ok(exe)) => exe.clone().into_os_string(),
        (THIS_NRUN, Err(e)) => {
            return Err(Error::internal(format!(
                "cannot find nrun's own executable: {e}"
            )));
        }
        (p, _) => p.into(),
    };
    if let (None, Some(dir)) = (&w.log_dir, w.error_file.parent()) {
        // Looked up first: the lookup takes no lock on the parent, a mkdir does.
        if !dir.is_dir() {
            let _ = nrun_base::files::make_private_dirs(dir);
        }
    }
    // Log files live on the worker's own node, as torchrun's do.
    let (out_file, err_file) = match &w.log_dir {
        Some(d) => open_logs(d)?,
        None => (None, None),
    };
    let cpus = match w.numa {
        true => gpu_cpus(&w.env, w.local_rank),
        false => None,
    };
    let mut env = w.env;
    // The watch turns on PyTorch's flight recorder (NCCL jobs), its pipe and dump in this
    // process's scratch directory: dumps are read from there only (a pipe or dump file the
    // user named is theirs, left alone); and nrun's NCCL profiler plugin, its counters there.
    if let (Some(plugin), Ok(dir)) = (watching, nrun_base::files::scratch()) {
        let (add, files) = super::flight::setup(&env, w.rank, &dir);
        env.extend(add);
        let fr = (files.pipe.starts_with(&dir) && files.dump.starts_with(&dir)).then_some(files);
        let gpu = plugin.and_then(|p| p.setup(w.rank)).map(|(add, counters)| {
            env.extend(add);
            counters
        });
        watch_files.push((w.rank, WatchFiles { fr, gpu }));
    }
    if let (true, Some(s)) = (w.secret, secret) {
        env.push(("NRUN_SECRET".into(), s.to_string()));
    }
    Ok(WorkerCmd {
        tty: w.tty,
        stdin: w.stdin,
        cpus,
        rank: w.rank,
        local_rank: w.local_rank,
        program,
        args: w.args.into_iter().map(Into::into).collect(),
        env,
        error_file: w.error_file,
        output: WorkerOutput {
            rank: w.rank,
            prefix: w.prefix,
            colour: w.colour,
            color: w.color,
            sinks: [
                Sink {
                    console: w.console[0],
                    file: out_file,
                    path: w.log_dir.as_ref().map(|d| d.join("stdout.log")),
                },
                Sink {
                    console: w.console[1],
                    file: err_file,
                    path: w.log_dir.as_ref().map(|d| d.join("stderr.log")),
                },
            ],
            progress,
        },
    })
}

/// The watch of a step's workers, sending the node's views to `out`; the group's events go to
/// the sender returned. The watch's thread starts when its first sample is due: a group that is
/// over by then (`ended`: a quick step, a failed start) costs no thread. Its events wait in the
/// channel.
fn start_watch(
    out: tokio::sync::mpsc::UnboundedSender<NodeWatch>,
    ended: tokio::sync::oneshot::Receiver<()>,
    watch_files: &[(usize, WatchFiles)],
    ras: Option<String>,
    stall: super::stacks::Stalls,
) -> tokio::sync::mpsc::UnboundedSender<node::GroupEvent> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let files = watch_files.to_vec();
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::time::sleep(super::stacks::SAMPLE) => {}
            _ = ended => return,
        }
        if let Err(e) = super::stacks::spawn(rx, out, files, ras, stall) {
            tracing::warn!("cannot start the watch: {e}; the job runs unwatched");
        }
    });
    tx
}

/// What the node reports of its group's outcome: for a failed worker, its error file (read
/// once: its traceback, and the file as written) and whether the kernel's OOM killer ended it.
fn run_result(
    outcome: Result<Outcome>,
    oom_mark: &super::oom::Mark,
    scratch: &[std::path::PathBuf],
) -> RunResult {
    let error_json = match &outcome {
        Ok(Outcome::Failed(f)) => nrun_base::files::read_text(
            &f.error_file,
            MAX_ERROR_FILE_BYTES,
            nrun_base::files::Writer::Anyone,
        )
        .map_err(|e| match e {
            nrun_base::files::ReadError::Missing => {}
            e => tracing::warn!("error file {}: {e}; not read", f.error_file.display()),
        })
        .ok(),
        _ => None,
    };
    let oom = match &outcome {
        Ok(Outcome::Failed(f)) if f.exit == node::Exit::Signal(libc::SIGKILL) => {
            super::oom::explain(oom_mark, f.pid)
        }
        _ => None,
    };
    match outcome {
        Err(e) => RunResult::SpawnError(e.message),
        Ok(Outcome::Success) => RunResult::Success,
        Ok(Outcome::Interrupted(s)) => RunResult::Interrupted(s),
        Ok(Outcome::TimedOut) => RunResult::TimedOut,
        Ok(Outcome::Stopped) => RunResult::Stopped,
        Ok(Outcome::Failed(f)) => RunResult::Failed(
            WorkerFailure {
                rank: f.rank,
                local_rank: f.local_rank,
                pid: f.pid,
                exit_code: f.exit.exit_code(),
                how: match oom {
                    Some(o) => Ending::OutOfMemory(Box::new(o)),
                    None => Ending::Exit(f.exit),
                },
                gpu: None,
                at: humantime::format_rfc3339_seconds(f.at).to_string(),
                traceback: error_json.as_deref().and_then(node::error_file_traceback),
                error_json,
                error_file_kept: !scratch.contains(&f.error_file),
                stderr_tail: f.stderr_tail,
                error_file: f.error_file,
                left_early: f.left_early,
                progress: f.progress.map(Box::new),
            }
            .with_signs(),
        ),
    }
}

/// Largest error file read: a traceback with its locals, as torch's `@record` writes it.
const MAX_ERROR_FILE_BYTES: u64 = 16 << 20;

/// Places the error files the coordinator gave as relative paths (no --log-dir) in this
/// process's own scratch directory ([`nrun_base::files::scratch`]), each worker's
/// TORCHELASTIC_ERROR_FILE with them: a node's scratch is its own, never a path another host
/// named.
fn in_scratch(mut specs: Vec<WorkerSpec>) -> std::io::Result<Vec<WorkerSpec>> {
    if specs.iter().all(|w| w.error_file.is_absolute()) {
        return Ok(specs);
    }
    let root = nrun_base::files::scratch()?;
    for w in specs.iter_mut().filter(|w| w.error_file.is_relative()) {
        let at = root.join(&w.error_file);
        for (k, v) in w.env.iter_mut() {
            if k == "TORCHELASTIC_ERROR_FILE" {
                *v = at.to_string_lossy().into_owned();
            }
        }
        w.error_file = at;
    }
    Ok(specs)
}

type Logs = (Option<std::fs::File>, Option<std::fs::File>);

/// A worker's log files, made fresh in a directory of this user's (0700 directories, 0600
/// files, as torchrun's run directory is private): one planted by another user is refused,
/// named.
fn open_logs(dir: &std::path::Path) -> Result<Logs> {
    let fail = |e: std::io::Error| {
        Error::internal(format!(
            "worker log directory (--log-dir, or $TMPDIR for --redirects/--tee without it): \
             {e}; check that it is writable on this node"
        ))
    };
    nrun_base::files::make_private_dirs(dir).map_err(fail)?;
    let open = |name: &str| nrun_base::outputs::create_private(&dir.join(name)).map_err(fail);
    Ok((Some(open("stdout.log")?), Some(open("stderr.log")?)))
}

/// Listens for the other nodes' probes on a free port of every address (they arrive on the
/// address the coordinator picks for this node, normally `local`: this end of the path to it)
/// and echoes them ([`serve_probes`]). Returns the address to publish: `local`'s, that port.
pub(crate) async fn listen_for_probes(local: SocketAddr) -> std::io::Result<String> {
    let any: std::net::IpAddr = match local.is_ipv4() {
        true => std::net::Ipv4Addr::UNSPECIFIED.into(),
        false => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(any, 0)).await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(serve_probes(listener));
    Ok(SocketAddr::new(local.ip(), port).to_string())
}

/// Echoes 10 bytes back on every connection: the other side of [`probe_peer`].
async fn serve_probes(listener: tokio::net::TcpListener) {
    while let Ok((mut s, _)) = listener.accept().await {
        tokio::spawn(async move {
            let mut b = [0u8; 10];
            if s.read_exact(&mut b).await.is_ok() {
                let _ = s.write_all(&b).await;
            }
        });
    }
}

/// Connects to another node's probe listener and checks its echo.
pub(crate) async fn probe_peer(target: &str, timeout_ms: u64) -> Result<()> {
    let sa: SocketAddr = target
        .parse()
        .map_err(|_| Error::cluster(format!("bad probe address {target}")))?;
    let t = Duration::from_millis(timeout_ms);
    let mut s = match tokio::time::timeout(t, tokio::net::TcpStream::connect(sa)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(Error::cluster(format!("connect to {sa}: {e}"))),
        Err(_) => {
            return Err(Error::cluster(format!(
                "connect to {sa}: no answer within {timeout_ms} ms (dropped by a firewall?)"
            )));
        }
    };
    let msg = *b"nrun-probe";
    let mut back = [0u8; 10];
    match tokio::time::timeout(t, async {
        s.write_all(&msg).await?;
        s.read_exact(&mut back).await
    })
    .await
    {
        Ok(Ok(_)) if back == msg => Ok(()),
        Ok(Ok(_)) => Err(Error::cluster(format!(
            "{sa} answered with something else (another service on that port?)"
        ))),
        Ok(Err(e)) => Err(Error::cluster(format!("{sa}: {e}"))),
        Err(_) => Err(Error::cluster(format!(
            "{sa}: connected but no echo within {timeout_ms} ms"
        ))),
    }
}

/// The GPU (as CUDA_VISIBLE_DEVICES names it) a worker of local rank `local_rank` uses: the
/// entry at its local rank of the list it sees (its own variables, else nrun's), the one entry
/// when it sees one, or its local rank when nothing narrows the GPUs.
pub fn worker_gpu(env: &[(String, String)], local_rank: usize) -> String {
    let seen = crate::worker_var(env, "CUDA_VISIBLE_DEVICES").filter(|v| !v.trim().is_empty());
    let Some(list) = seen else {
        return local_rank.to_string();
    };
    let list: Vec<&str> = list.split(',').map(str::trim).collect();
    match list.as_slice() {
        [one] => one.to_string(),
        many => many
            .get(local_rank)
            .map_or_else(|| local_rank.to_string(), |g| g.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_gpu() {
        let env = |v: &str| vec![("CUDA_VISIBLE_DEVICES".to_string(), v.to_string())];
        assert_eq!(worker_gpu(&env("4,6"), 1), "6");
        assert_eq!(worker_gpu(&env("5"), 1), "5");
        assert_eq!(worker_gpu(&env("0,1"), 3), "3");
        assert_eq!(worker_gpu(&env("GPU-ab12,GPU-cd34"), 0), "GPU-ab12");
    }
}
