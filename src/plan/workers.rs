//! What every worker of a group gets besides its place ([`WorkersPlan`]): its command, logs
//! ([`LogPlan`], [`StreamSpec`]) and console ([`ConsolePlan`]); and, per worker, the
//! environment torchrun sets ([`WorkersPlan::worker_env_at`]) and its log directory.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use nrun_base::error::{Error, Result};

/// Which of a worker's streams go where; torchrun's 0..3 encoding (1 stdout, 2 stderr, 3 both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Streams(pub u8);

impl Streams {
    pub(crate) fn stdout(self) -> bool {
        self.0 & 1 != 0
    }
    pub(crate) fn stderr(self) -> bool {
        self.0 & 2 != 0
    }
}

/// A per-local-rank stream spec: "3" for every rank, or "0:3,1:1".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum StreamSpec {
    #[default]
    None,
    All(Streams),
    PerRank(Vec<(usize, Streams)>),
}

impl StreamSpec {
    pub(crate) fn parse(flag: &str, s: &str) -> Result<StreamSpec> {
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

    pub(crate) fn for_rank(&self, local_rank: usize) -> Streams {
        match self {
            StreamSpec::None => Streams(0),
            StreamSpec::All(s) => *s,
            StreamSpec::PerRank(v) => v
                .iter()
                .find(|(r, _)| *r == local_rank)
                .map_or(Streams(0), |(_, s)| *s),
        }
    }

    pub(super) fn is_none(&self) -> bool {
        match self {
            StreamSpec::None => true,
            StreamSpec::All(s) => s.0 == 0,
            StreamSpec::PerRank(v) => v.iter().all(|(_, s)| s.0 == 0),
        }
    }
}

/// Where worker output goes besides the console.
#[derive(Clone, Debug, Default)]
pub(crate) struct LogPlan {
    /// Root of the per-rank log files; `None`: no files.
    pub dir: Option<PathBuf>,
    /// Streams kept off the console (written to the files only)...
    pub redirects: StreamSpec,
    /// ... unless teed: to the files and the console (torchrun's `--tee` wins over
    /// `--redirects`).
    pub tee: StreamSpec,
    /// Local ranks whose output reaches the console; `None`: all.
    pub console_ranks: Option<BTreeSet<usize>>,
}

/// What every worker of a group gets, besides its place: the job's, or a bisect probe's.
#[derive(Clone, Debug)]
pub(crate) struct WorkersPlan {
    /// Workers per node.
    pub nproc: usize,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub role: String,
    pub max_restarts: u32,
    /// `--max-no-progress-restarts`: restarts in a row that failed the same way with no more
    /// progress before the job stops (0: never).
    pub max_no_progress_restarts: u32,
    /// `--progress-regex`, checked: what the workers' nodes match their output lines with.
    pub progress: Option<ProgressPlan>,
    pub log: LogPlan,
    /// Whether OMP_NUM_THREADS gets torchrun's default of 1 (unset and more than one worker).
    pub set_omp_threads: bool,
    /// Whether TORCH_NCCL_ASYNC_ERROR_HANDLING gets torchrun's default of 1 (unset).
    pub set_async_error_handling: bool,
    /// How worker lines look on the console.
    pub console: ConsolePlan,
    /// The rank that reads nrun's stdin, if any.
    pub stdin_rank: Option<usize>,
    /// Every worker sees LOCAL_RANK=0 and only its own GPU.
    pub virtual_local_rank: bool,
    /// Each worker bound to the CPUs of its GPU's NUMA node.
    pub numa_binding: bool,
    /// `--signals-to-handle` as given, exported as TORCHELASTIC_SIGNALS_TO_HANDLE (torchrun sets
    /// it in its own environment, which its workers inherit); empty: not set.
    pub signals_to_handle: String,
}

/// `--progress-regex`: a line of a worker's output matching `regex` is one unit of progress.
#[derive(Clone, Debug)]
pub(crate) struct ProgressPlan {
    pub regex: String,
    /// It has a capture group: its number is the step (else the count of lines is progress).
    pub step: bool,
}

impl ProgressPlan {
    /// `--progress-regex REGEX` checked: a pattern the regex crate refuses is a usage error.
    pub(crate) fn parse(regex: &str) -> Result<ProgressPlan> {
        let re = regex::Regex::new(regex).map_err(|e| {
            // The crate's parse errors draw the pattern over lines; their last line says what.
            let e = e.to_string();
            let what = e
                .lines()
                .last()
                .unwrap_or_default()
                .trim_start_matches("error: ");
            Error::usage(format!(
                "--progress-regex '{regex}' is not a regular expression: {what} (the syntax is \
                 Rust's regex crate's, close to Python's re without look-around; e.g. \
                 'step (\\d+)')"
            ))
        })?;
        Ok(ProgressPlan {
            regex: regex.to_string(),
            step: re.captures_len() > 1,
        })
    }
}

/// How worker lines look on the console.
#[derive(Clone, Debug, Default)]
pub(crate) struct ConsolePlan {
    /// `--log-line-prefix-template`: None for nrun's own prefix.
    pub prefix_template: Option<String>,
    pub color: nrun_node::output::Color,
}

/// torchrun's variables that every worker gets from nrun whatever nrun was given: the
/// fixed part of [`WorkersPlan::worker_env_at`].
pub(crate) const TORCHRUN_VARS: [&str; 16] = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
];

/// The one line that says which of [`TORCHRUN_VARS`] were set for nrun (its environment, `-x`,
/// `.nrun_env`: `job`) and so replaced in every worker, as torchrun replaces them without a
/// word; None where none was. A user who exported MASTER_PORT expects the workers to use it.
pub(crate) fn replaced_vars_line(
    env: &dyn Fn(&str) -> Option<String>,
    job: &[(String, String)],
) -> Option<String> {
    let set: Vec<&str> = TORCHRUN_VARS
        .into_iter()
        .filter(|k| env(k).is_some() || job.iter().any(|(x, _)| x == k))
        .collect();
    if set.is_empty() {
        return None;
    }
    let mut line = format!(
        "{} set for nrun (its environment, -x or .nrun_env): each worker gets the job's own \
         instead (its rank, the world size, the store nrun hosts), as torchrun sets them",
        set.join(", ")
    );
    if set.iter().any(|k| k.starts_with("MASTER_")) {
        line += "; to choose the store's address give --master-addr/--master-port";
    }
    if env("TORCHELASTIC_RUN_ID").is_some() {
        line += "; TORCHELASTIC_RUN_ID is set: is nrun started inside another launcher's worker?";
    }
    Some(line)
}

impl WorkersPlan {
    /// The environment a worker gets on top of nrun's own, exactly as torchrun sets it.
    pub(crate) fn worker_env_at(
        &self,
        run_id: &str,
        p: &Place,
        w: &WorkerSlot<'_>,
    ) -> Vec<(String, String)> {
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
            ("TORCHELASTIC_RUN_ID".into(), run_id.to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into()),
            (
                "TORCHELASTIC_ERROR_FILE".into(),
                w.error_file.display().to_string(),
            ),
        ];
        if !self.signals_to_handle.is_empty() {
            env.push((
                "TORCHELASTIC_SIGNALS_TO_HANDLE".into(),
                self.signals_to_handle.clone(),
            ));
        }
        if self.set_async_error_handling {
            env.push(("TORCH_NCCL_ASYNC_ERROR_HANDLING".into(), "1".into()));
        }
        if self.set_omp_threads {
            env.push(("OMP_NUM_THREADS".into(), "1".into()));
        }
        env
    }

    /// `<run dir>/attempt_<n>[/<host>]/<local_rank>`: torchrun's per-worker log directory; the
    /// host level keeps the nodes of a multi-node run apart on a shared filesystem.
    pub(crate) fn worker_dir(
        &self,
        root: &Path,
        attempt: u32,
        host: Option<&str>,
        local_rank: usize,
    ) -> PathBuf {
        let mut d = attempt_dir(root, attempt);
        if let Some(h) = host {
            d.push(h);
        }
        d.join(local_rank.to_string())
    }
}

/// `<root>/attempt_<n>`: one attempt's directory, of log files or of nrun's scratch.
pub(crate) fn attempt_dir(root: &Path, attempt: u32) -> PathBuf {
    root.join(format!("attempt_{attempt}"))
}

/// Where a worker sits in the whole job.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place {
    pub rank: usize,
    pub group_rank: usize,
    pub local_world_size: usize,
    pub world_size: usize,
    pub group_world_size: usize,
}

/// What differs between the workers of one attempt.
pub(crate) struct WorkerSlot<'a> {
    pub local_rank: usize,
    pub restart_count: u32,
    pub master_addr: &'a str,
    pub master_port: u16,
    pub error_file: &'a Path,
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
