//! From the command line to a `Plan`: how many workers, what each runs, with which environment,
//! where its output goes. Pure apart from looking at the filesystem to resolve the target (and
//! counting GPUs), so every rule here is unit-tested.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cli::Cli;
use crate::error::{Error, Result};

/// Where the store lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorePlan {
    /// nrun hosts it: bind `port` (0 = any free port); workers reach it at `advertise` (an
    /// address, or a host name the user chose).
    Host { port: u16, advertise: String },
    /// Another node's nrun hosts it (torchrun-style static multi-node, node rank > 0).
    Remote { addr: String, port: u16 },
}

/// Which of a worker's streams go where; torchrun's 0..3 encoding (1 stdout, 2 stderr, 3 both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streams(pub u8);

impl Streams {
    pub fn stdout(self) -> bool {
        self.0 & 1 != 0
    }
    pub fn stderr(self) -> bool {
        self.0 & 2 != 0
    }
}

/// A per-local-rank stream spec: "3" for every rank, or "0:3,1:1".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StreamSpec {
    #[default]
    None,
    All(Streams),
    PerRank(Vec<(usize, Streams)>),
}

impl StreamSpec {
    pub fn parse(flag: &str, s: &str) -> Result<StreamSpec> {
        let bad = || {
            Error::usage(format!(
                "{flag} {s:?} is not a stream spec: use 0 (none), 1 (stdout), 2 (stderr), 3 (both), \
                 or per local rank like 0:3,1:1"
            ))
        };
        let level = |v: &str| match v.trim().parse::<u8>() {
            Ok(n @ 0..=3) => Ok(Streams(n)),
            _ => Err(bad()),
        };
        if !s.contains(':') {
            return Ok(StreamSpec::All(level(s)?));
        }
        let mut v = Vec::new();
        for part in s.split(',') {
            let (r, l) = part.split_once(':').ok_or_else(bad)?;
            v.push((r.trim().parse::<usize>().map_err(|_| bad())?, level(l)?));
        }
        Ok(StreamSpec::PerRank(v))
    }

    pub fn for_rank(&self, local_rank: usize) -> Streams {
        match self {
            StreamSpec::None => Streams(0),
            StreamSpec::All(s) => *s,
            StreamSpec::PerRank(v) => v
                .iter()
                .find(|(r, _)| *r == local_rank)
                .map_or(Streams(0), |(_, s)| *s),
        }
    }

    fn is_none(&self) -> bool {
        match self {
            StreamSpec::None => true,
            StreamSpec::All(s) => s.0 == 0,
            StreamSpec::PerRank(v) => v.iter().all(|(_, s)| s.0 == 0),
        }
    }
}

/// Where worker output goes besides the console.
#[derive(Clone, Debug, Default)]
pub struct LogPlan {
    /// Root of the per-rank log files; `None`: no files.
    pub dir: Option<PathBuf>,
    /// `dir` was made up by nrun because --redirects/--tee were given without --log-dir.
    pub dir_is_temp: bool,
    pub redirects: StreamSpec,
    /// Local ranks whose output reaches the console; `None`: all.
    pub console_ranks: Option<BTreeSet<usize>>,
}

/// The preflight, when one runs.
#[derive(Clone, Debug)]
pub struct PreflightPlan {
    pub mode: crate::preflight::Mode,
    /// Start the job even if the preflight fails.
    pub warn_only: bool,
    pub min_bytes: u64,
    pub max_bytes: u64,
    pub factor: u64,
    pub iters: u32,
    pub warmup: u32,
    pub timeout: Duration,
    pub min_busbw: Option<f64>,
    pub report: Option<PathBuf>,
    pub nccl_lib: Option<PathBuf>,
    pub loopback: bool,
}

/// Everything a run needs, decided before anything starts.
#[derive(Clone, Debug)]
pub struct Plan {
    pub nproc: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub run_id: String,
    pub role: String,
    pub max_restarts: u32,
    pub shutdown_timeout: Duration,
    pub store: StorePlan,
    pub log: LogPlan,
    /// Whether OMP_NUM_THREADS gets torchrun's default of 1 (unset and more than one worker).
    pub set_omp_threads: bool,
    /// Whether TORCH_NCCL_ASYNC_ERROR_HANDLING gets torchrun's default of 1 (unset).
    pub set_async_error_handling: bool,
    pub preflight: Option<PreflightPlan>,
    /// Only the preflight runs (no TARGET).
    pub preflight_only: bool,
    /// The Python interpreter the job uses (or would use), for finding torch's NCCL.
    pub python: Option<PathBuf>,
}

impl Plan {
    pub fn world_size(&self) -> usize {
        self.nproc * self.nnodes
    }

    /// Builds the plan from parsed flags, the process environment and the filesystem.
    pub fn from_cli(cli: &Cli, env: &dyn Fn(&str) -> Option<String>) -> Result<Plan> {
        let nproc = resolve_nproc(&cli.nproc_per_node, env)?;
        let nnodes = parse_nnodes(&cli.nnodes)?;
        if cli.node_rank >= nnodes {
            return Err(Error::usage(format!(
                "--node-rank {} is out of range for --nnodes {nnodes} (ranks are 0..{})",
                cli.node_rank,
                nnodes - 1
            )));
        }
        if !(cli.shutdown_timeout.is_finite() && cli.shutdown_timeout >= 0.0) {
            return Err(Error::usage(format!(
                "--shutdown-timeout {} must be a non-negative number of seconds",
                cli.shutdown_timeout
            )));
        }
        let preflight = resolve_preflight(cli, env)?;
        let (program, args) = if cli.command.is_empty() {
            (OsString::new(), Vec::new())
        } else {
            resolve_command(cli, env)?
        };
        let python = resolve_python(cli, env);
        let store = resolve_store(cli, nnodes)?;

        let redirects = match &cli.redirects {
            Some(s) => StreamSpec::parse("--redirects", s)?,
            None => StreamSpec::None,
        };
        let tee = match &cli.tee {
            Some(s) => StreamSpec::parse("--tee", s)?,
            None => StreamSpec::None,
        };
        let console_ranks = match &cli.local_ranks_filter {
            None => None,
            Some(s) => Some(parse_rank_set(s, nproc)?),
        };
        let wants_files = !redirects.is_none() || !tee.is_none();
        let (dir, dir_is_temp) = match &cli.log_dir {
            Some(d) => (Some(d.clone()), false),
            None if wants_files => (
                Some(std::env::temp_dir().join(format!("nrun-logs-{}", std::process::id()))),
                true,
            ),
            None => (None, false),
        };

        Ok(Plan {
            nproc,
            nnodes,
            node_rank: cli.node_rank,
            program,
            args,
            run_id: cli.rdzv_id.clone(),
            role: cli.role.clone(),
            max_restarts: cli.max_restarts,
            shutdown_timeout: Duration::from_secs_f64(cli.shutdown_timeout),
            store,
            log: LogPlan {
                dir,
                dir_is_temp,
                redirects,
                console_ranks,
            },
            set_omp_threads: nproc > 1 && env("OMP_NUM_THREADS").is_none(),
            set_async_error_handling: env("TORCH_NCCL_ASYNC_ERROR_HANDLING").is_none(),
            preflight,
            preflight_only: cli.preflight_only,
            python,
        })
    }

    /// The environment a worker gets on top of nrun's own, exactly as torchrun sets it.
    pub fn worker_env(&self, w: &WorkerSlot<'_>) -> Vec<(String, String)> {
        let place = Place {
            rank: self.node_rank * self.nproc + w.local_rank,
            group_rank: self.node_rank,
            local_world_size: self.nproc,
            world_size: self.world_size(),
            group_world_size: self.nnodes,
        };
        self.worker_env_at(&place, w)
    }

    /// The environment of a worker at an explicit place in the job (multi-node layouts, where
    /// nodes may run different numbers of workers).
    pub fn worker_env_at(&self, p: &Place, w: &WorkerSlot<'_>) -> Vec<(String, String)> {
        let mut env = vec![
            ("RANK".into(), p.rank.to_string()),
            ("LOCAL_RANK".into(), w.local_rank.to_string()),
            ("WORLD_SIZE".into(), p.world_size.to_string()),
            ("LOCAL_WORLD_SIZE".into(), p.local_world_size.to_string()),
            ("GROUP_RANK".into(), p.group_rank.to_string()),
            ("GROUP_WORLD_SIZE".into(), p.group_world_size.to_string()),
            ("ROLE_RANK".into(), p.rank.to_string()),
            ("ROLE_NAME".into(), self.role.clone()),
            ("ROLE_WORLD_SIZE".into(), p.world_size.to_string()),
            ("MASTER_ADDR".into(), w.master_addr.to_string()),
            ("MASTER_PORT".into(), w.master_port.to_string()),
            (
                "TORCHELASTIC_RESTART_COUNT".into(),
                w.restart_count.to_string(),
            ),
            (
                "TORCHELASTIC_MAX_RESTARTS".into(),
                self.max_restarts.to_string(),
            ),
            ("TORCHELASTIC_RUN_ID".into(), self.run_id.clone()),
            ("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into()),
            (
                "TORCHELASTIC_ERROR_FILE".into(),
                w.error_file.display().to_string(),
            ),
        ];
        if self.set_async_error_handling {
            env.push(("TORCH_NCCL_ASYNC_ERROR_HANDLING".into(), "1".into()));
        }
        if self.set_omp_threads {
            env.push(("OMP_NUM_THREADS".into(), "1".into()));
        }
        env
    }

    /// `<dir>/<run_id>/attempt_<n>/<local_rank>`: torchrun's per-worker log directory.
    pub fn worker_dir(&self, root: &Path, attempt: u32, local_rank: usize) -> PathBuf {
        root.join(&self.run_id)
            .join(format!("attempt_{attempt}"))
            .join(local_rank.to_string())
    }
}

/// Where a worker sits in the whole job.
#[derive(Clone, Copy, Debug)]
pub struct Place {
    pub rank: usize,
    pub group_rank: usize,
    pub local_world_size: usize,
    pub world_size: usize,
    pub group_world_size: usize,
}

/// What differs between the workers of one attempt.
pub struct WorkerSlot<'a> {
    pub local_rank: usize,
    pub restart_count: u32,
    pub master_addr: &'a str,
    pub master_port: u16,
    pub error_file: &'a Path,
}

/// GPUs this process may use: the NVIDIA driver's device list, narrowed by CUDA_VISIBLE_DEVICES.
/// Read from /proc so that counting needs neither CUDA nor Python.
pub fn visible_gpus(env: &dyn Fn(&str) -> Option<String>) -> usize {
    let present = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    match env("CUDA_VISIBLE_DEVICES") {
        None => present,
        // CUDA stops at the first entry it cannot parse; -1 hides every device.
        Some(v) => v
            .split(',')
            .map(str::trim)
            .take_while(|s| !s.is_empty() && !s.starts_with('-'))
            .count()
            .min(present),
    }
}

fn resolve_preflight(
    cli: &Cli,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<PreflightPlan>> {
    use crate::preflight::Mode;
    let mut mode: Option<Option<Mode>> = None;
    let mut warn_only = false;
    for part in cli
        .preflight
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part {
            "warn" => warn_only = true,
            "auto" => {}
            "nccl" => mode = Some(Some(Mode::Nccl)),
            "net" => mode = Some(Some(Mode::Net)),
            "off" | "none" => mode = Some(None),
            other => {
                return Err(Error::usage(format!(
                    "--preflight {other:?}: expected auto, nccl, net or off, optionally with ,warn"
                )));
            }
        }
    }
    if cli.doctor || (cli.bisect && cli.probe == "cmd") {
        return Ok(None);
    }
    if cli.bisect {
        mode = Some(Some(if cli.probe == "net" {
            Mode::Net
        } else {
            Mode::Nccl
        }));
    }
    if cli.no_preflight {
        if cli.preflight_only {
            return Err(Error::usage(
                "--no-preflight and --preflight-only exclude each other",
            ));
        }
        mode = Some(None);
    }
    let mode = match mode {
        Some(m) => m,
        // auto: NCCL where GPUs are visible; elsewhere a job needs no GPU preflight.
        None => (visible_gpus(env) > 0).then_some(Mode::Nccl),
    };
    let Some(mode) = mode else {
        if cli.preflight_only {
            return Err(Error::usage(
                "--preflight-only: no GPU is visible here for the NCCL preflight; use --preflight net \
                 to test the network path alone",
            ));
        }
        return Ok(None);
    };
    let (min_bytes, max_bytes, factor) = match &cli.preflight_sizes {
        Some(s) => crate::preflight::parse_sizes(s)?,
        None if mode == Mode::Net => (8, 16 << 20, 4),
        None => (8, 256 << 20, 2),
    };
    let net = mode == Mode::Net;
    if !(cli.preflight_timeout.is_finite() && cli.preflight_timeout > 0.0) {
        return Err(Error::usage(format!(
            "--preflight-timeout {} must be a positive number of seconds",
            cli.preflight_timeout
        )));
    }
    if let Some(p) = &cli.nccl_lib {
        if !p.is_file() {
            return Err(Error::usage(format!(
                "--nccl-lib {}: no such file",
                p.display()
            )));
        }
    }
    Ok(Some(PreflightPlan {
        mode,
        warn_only,
        min_bytes,
        max_bytes,
        factor,
        iters: cli.iters.unwrap_or(if net { 5 } else { 20 }).max(1),
        warmup: cli.warmup.unwrap_or(if net { 1 } else { 5 }),
        timeout: Duration::from_secs_f64(cli.preflight_timeout),
        min_busbw: cli.min_busbw,
        report: cli.report.clone(),
        nccl_lib: cli.nccl_lib.clone(),
        loopback: cli.preflight_loopback,
    }))
}

/// The interpreter a Python job would use, if it can be found (for locating torch's NCCL).
fn resolve_python(cli: &Cli, env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let name = match (&cli.python, env("PYTHON_EXEC")) {
        (Some(p), _) => p.display().to_string(),
        (None, Some(p)) if !p.is_empty() => p,
        _ => "python3".to_string(),
    };
    find_program(&name, env("PATH").as_deref())
}

fn resolve_nproc(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let cpus = || std::thread::available_parallelism().map_or(1, |n| n.get());
    match s {
        "cpu" => Ok(cpus()),
        "gpu" => match visible_gpus(env) {
            0 => Err(Error::usage(
                "--nproc-per-node gpu: no GPU is visible here (no /proc/driver/nvidia/gpus entries, \
                 or CUDA_VISIBLE_DEVICES hides them); pass a number or `cpu`",
            )),
            n => Ok(n),
        },
        "auto" => Ok(match visible_gpus(env) {
            0 => cpus(),
            n => n,
        }),
        _ => match s.parse::<usize>() {
            Ok(0) => Err(Error::usage(
                "--nproc-per-node 0: at least one worker is needed",
            )),
            Ok(n) => Ok(n),
            Err(_) => Err(Error::usage(format!(
                "--nproc-per-node {s:?} is not a number, `gpu`, `cpu` or `auto`"
            ))),
        },
    }
}

fn parse_nnodes(s: &str) -> Result<usize> {
    let bad = || {
        Error::usage(format!(
            "--nnodes {s:?} must be N or MIN:MAX with MIN == MAX >= 1"
        ))
    };
    let (lo, hi) = match s.split_once(':') {
        Some((a, b)) => (
            a.parse::<usize>().map_err(|_| bad())?,
            b.parse::<usize>().map_err(|_| bad())?,
        ),
        None => {
            let n = s.parse::<usize>().map_err(|_| bad())?;
            (n, n)
        }
    };
    if lo == 0 || lo != hi {
        return Err(if lo != hi && lo > 0 {
            Error::usage(format!(
                "--nnodes {s}: elastic ranges are not supported; nrun starts a fixed number of nodes \
                 (use --nnodes {hi})"
            ))
        } else {
            bad()
        });
    }
    Ok(lo)
}

fn parse_rank_set(s: &str, nproc: usize) -> Result<BTreeSet<usize>> {
    let mut set = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.parse::<usize>() {
            Ok(r) if r < nproc => {
                set.insert(r);
            }
            _ => {
                return Err(Error::usage(format!(
                    "--local-ranks-filter {s:?}: {part:?} is not a local rank in 0..{nproc}"
                )));
            }
        }
    }
    Ok(set)
}

fn split_host_port(s: &str) -> Result<(String, Option<u16>)> {
    // [v6]:port, v6 alone, host:port or host.
    if let Some(rest) = s.strip_prefix('[') {
        if let Some((h, p)) = rest.split_once(']') {
            let port = match p.strip_prefix(':') {
                Some(p) => Some(
                    p.parse()
                        .map_err(|_| Error::usage(format!("bad port in {s:?}")))?,
                ),
                None => None,
            };
            return Ok((h.to_string(), port));
        }
    }
    if s.matches(':').count() == 1 {
        let (h, p) = s.split_once(':').unwrap_or((s, ""));
        let port = p
            .parse()
            .map_err(|_| Error::usage(format!("bad port in {s:?}: {p:?}")))?;
        return Ok((h.to_string(), Some(port)));
    }
    Ok((s.to_string(), None))
}

fn resolve_store(cli: &Cli, nnodes: usize) -> Result<StorePlan> {
    let (mut addr, mut port) = (cli.master_addr.clone(), cli.master_port);
    if let Some(ep) = &cli.rdzv_endpoint {
        let (h, p) = split_host_port(ep)?;
        addr = addr.or(Some(h));
        port = port.or(p);
    }
    // With a host list nrun starts every node itself and hosts the one store here.
    if cli.hosts.is_some() || cli.hostfile.is_some() {
        return Ok(StorePlan::Host {
            port: port.unwrap_or(0),
            advertise: String::new(),
        });
    }
    if cli.standalone && nnodes > 1 {
        return Err(Error::usage(
            "--standalone is a single-node mode; drop it or use --nnodes 1",
        ));
    }
    if nnodes == 1 {
        let advertise = cli
            .local_addr
            .clone()
            .or(addr.filter(|a| !matches!(a.as_str(), "localhost" | "127.0.0.1" | "::1" | "")))
            .unwrap_or_else(|| "127.0.0.1".into());
        return Ok(StorePlan::Host {
            port: port.unwrap_or(0),
            advertise,
        });
    }
    // Static multi-node as torchrun: every node runs nrun with the same --master-addr/-port.
    let Some(addr) = addr else {
        return Err(Error::usage(format!(
            "--nnodes {nnodes} needs --master-addr (or --rdzv-endpoint): the address of node rank 0, \
             which hosts the store"
        )));
    };
    let port = port.unwrap_or(29500);
    if cli.node_rank == 0 {
        Ok(StorePlan::Host {
            port,
            advertise: cli.local_addr.clone().unwrap_or(addr),
        })
    } else {
        Ok(StorePlan::Remote { addr, port })
    }
}

/// Finds an executable the way execvp would: a name with a '/' as given, else on PATH.
pub fn find_program(name: &str, path: Option<&str>) -> Option<PathBuf> {
    let is_exec = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if name.contains('/') {
        let p = PathBuf::from(name);
        return is_exec(&p).then_some(p);
    }
    path?
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find(|p| is_exec(p))
}

fn resolve_command(
    cli: &Cli,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(OsString, Vec<OsString>)> {
    let target = &cli.command[0];
    let rest = cli.command[1..].iter().map(OsString::from);
    let path = env("PATH");
    if cli.no_python {
        if cli.module {
            return Err(Error::usage(
                "-m and --no-python exclude each other: a module needs Python",
            ));
        }
        let p = Path::new(target);
        if target.contains('/') {
            let meta = p.metadata().map_err(|_| {
                Error::usage(format!(
                    "program {target} not found (cwd {})",
                    cwd_display()
                ))
            })?;
            if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
                return Err(Error::usage(format!(
                    "program {target} is not executable; chmod +x it, or drop --no-python if it is \
                     a Python script"
                )));
            }
        } else if find_program(target, path.as_deref()).is_none() {
            return Err(Error::usage(format!(
                "program {target} not found on PATH; give its path (./{target}) or check PATH"
            )));
        }
        return Ok((target.into(), rest.collect()));
    }

    let python = match (&cli.python, env("PYTHON_EXEC")) {
        (Some(p), _) => p.display().to_string(),
        (None, Some(p)) if !p.is_empty() => p,
        _ => "python3".to_string(),
    };
    let Some(python_path) = find_program(&python, path.as_deref()) else {
        return Err(Error::usage(format!(
            "python interpreter {python} not found{}; pass --python PATH or set PYTHON_EXEC \
             (or use --no-python to run a program directly)",
            if python.contains('/') { "" } else { " on PATH" }
        )));
    };
    let mut args: Vec<OsString> = vec!["-u".into()];
    if cli.module {
        args.push("-m".into());
    } else if !Path::new(target).is_file() {
        let hint = if !target.ends_with(".py") && find_program(target, path.as_deref()).is_some() {
            format!("; {target} is a program on PATH: add --no-python to run it directly")
        } else {
            String::new()
        };
        return Err(Error::usage(format!(
            "script {target} not found (cwd {}){hint}",
            cwd_display()
        )));
    }
    args.push(target.into());
    args.extend(rest);
    Ok((python_path.into_os_string(), args))
}

fn cwd_display() -> String {
    std::env::current_dir().map_or_else(|_| "unknown".into(), |p| p.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn plan(args: &[&str]) -> Result<Plan> {
        let cli = Cli::try_parse_from(std::iter::once("nrun").chain(args.iter().copied())).unwrap();
        Plan::from_cli(&cli, &|k| std::env::var(k).ok())
    }

    #[test]
    fn stream_specs() {
        assert_eq!(
            StreamSpec::parse("-t", "3").unwrap().for_rank(5),
            Streams(3)
        );
        let s = StreamSpec::parse("-t", "0:3,1:1").unwrap();
        assert_eq!(s.for_rank(0), Streams(3));
        assert_eq!(s.for_rank(1), Streams(1));
        assert_eq!(s.for_rank(2), Streams(0));
        assert!(StreamSpec::parse("-t", "4").is_err());
        assert!(StreamSpec::parse("-t", "x:1").is_err());
    }

    #[test]
    fn nproc_values() {
        let env = |_: &str| None;
        assert_eq!(resolve_nproc("8", &env).unwrap(), 8);
        assert!(
            resolve_nproc("0", &env)
                .unwrap_err()
                .message
                .contains("at least one")
        );
        assert!(resolve_nproc("x", &env).is_err());
        assert!(resolve_nproc("cpu", &env).unwrap() >= 1);
        let hidden = |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(|| "-1".to_string());
        assert_eq!(visible_gpus(&hidden), 0);
    }

    #[test]
    fn nnodes_values() {
        assert_eq!(parse_nnodes("2").unwrap(), 2);
        assert_eq!(parse_nnodes("3:3").unwrap(), 3);
        assert!(parse_nnodes("1:4").unwrap_err().message.contains("elastic"));
        assert!(parse_nnodes("0").is_err());
    }

    #[test]
    fn worker_env_matches_torchrun() {
        let p = plan(&["--nproc", "4", "--no-python", "true"]).unwrap();
        let env = p.worker_env(&WorkerSlot {
            local_rank: 2,
            restart_count: 1,
            master_addr: "127.0.0.1",
            master_port: 1234,
            error_file: Path::new("/tmp/e.json"),
        });
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("2"));
        assert_eq!(get("LOCAL_RANK"), Some("2"));
        assert_eq!(get("WORLD_SIZE"), Some("4"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("4"));
        assert_eq!(get("GROUP_RANK"), Some("0"));
        assert_eq!(get("ROLE_NAME"), Some("default"));
        assert_eq!(get("MASTER_PORT"), Some("1234"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("1"));
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), Some("True"));
        assert_eq!(get("TORCHELASTIC_ERROR_FILE"), Some("/tmp/e.json"));
        assert_eq!(get("TORCHELASTIC_RUN_ID"), Some("none"));
    }

    #[test]
    fn static_multi_node_ranks_and_store() {
        let p = plan(&[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc",
            "4",
            "--master-addr",
            "10.0.0.1",
            "--no-python",
            "true",
        ])
        .unwrap();
        assert_eq!(
            p.store,
            StorePlan::Remote {
                addr: "10.0.0.1".into(),
                port: 29500
            }
        );
        let env = p.worker_env(&WorkerSlot {
            local_rank: 3,
            restart_count: 0,
            master_addr: "10.0.0.1",
            master_port: 29500,
            error_file: Path::new("/e"),
        });
        assert!(env.contains(&("RANK".into(), "7".into())));
        assert!(env.contains(&("WORLD_SIZE".into(), "8".into())));
        assert!(
            plan(&["--nnodes", "2", "--no-python", "true"])
                .unwrap_err()
                .message
                .contains("--master-addr")
        );
    }

    #[test]
    fn bad_targets_are_usage_errors() {
        let e = plan(&["/definitely/missing.py"]).unwrap_err();
        assert_eq!(e.code, crate::error::exit::USAGE);
        assert!(e.message.contains("not found"), "{}", e.message);
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain.sh");
        std::fs::write(&plain, "echo\n").unwrap();
        let e = plan(&["--no-python", plain.to_str().unwrap()]).unwrap_err();
        assert!(e.message.contains("not executable"), "{}", e.message);
        let e = plan(&["--no-python", "no-such-program-xyz"]).unwrap_err();
        assert!(e.message.contains("not found on PATH"), "{}", e.message);
        let e = plan(&["--python", "/no/python", "x.py"]).unwrap_err();
        assert!(
            e.message
                .contains("python interpreter /no/python not found"),
            "{}",
            e.message
        );
        let e = plan(&["true"]).unwrap_err();
        assert!(e.message.contains("--no-python"), "{}", e.message);
    }

    #[test]
    fn endpoints() {
        assert_eq!(split_host_port("h:5").unwrap(), ("h".into(), Some(5)));
        assert_eq!(split_host_port("[::1]:5").unwrap(), ("::1".into(), Some(5)));
        assert_eq!(
            split_host_port("fe80::1").unwrap(),
            ("fe80::1".into(), None)
        );
        assert!(split_host_port("h:x").is_err());
    }
}
