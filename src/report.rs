//! What nrun tells people: how a job ended and the failure summary (one for one node or many),
//! JSON reports ([`schema`]: their types), and log formatting. The one place that knows how
//! messages look; [`html`]: the same reports as a page a person reads.

pub(crate) mod html;
pub(crate) mod schema;

use std::fmt::Write as _;
use std::path::Path;

use crate::protocol::{RunResult, StepResult, WorkerFailure};
use nrun_base::error::{Error, Result, exit};

/// How one attempt of the job ended, over every node.
#[derive(Debug)]
pub(crate) enum JobEnd {
    Success,
    /// Stopped by a signal to nrun: the exit code.
    Interrupted(u8),
    /// The first failure: the exit code, a one-line headline and the whole summary.
    Failed {
        code: u8,
        headline: String,
        summary: String,
        /// For the launcher's TORCHELASTIC_ERROR_FILE (a worker failed).
        error_json: Option<String>,
    },
}

/// Where the job ran, for naming a failure.
pub(crate) struct JobShape<'a> {
    /// Each node's label, by node index.
    pub hosts: &'a [String],
    /// What to check about each node if it is lost, in the words of its kind, by node index.
    pub lost_hints: &'a [String],
    pub world: usize,
    /// The command line the workers ran.
    pub command: &'a str,
    /// By node index, a node's own command line where it differs (c10d nodes bring theirs).
    pub node_commands: &'a [Option<String>],
}

/// The failure that caused the others among the nodes' results, or how the attempt otherwise
/// ended. A failing worker beats a lost node; among failed workers, by evidence, then time: a
/// rank that failed of its own accord (an exception, an exit code, a signal) beats one that
/// failed because of a peer (a connection closed, a collective timed out), whose clock may
/// even read earlier on another node.
pub(crate) fn job_end(shape: &JobShape<'_>, results: &[Option<StepResult>]) -> JobEnd {
    if let Some((i, r)) = first_failure(results) {
        let host = shape.hosts.get(i).map_or("?", |h| h.as_str());
        return match r {
            RunResult::Failed(f) => {
                let summary = failure_summary(f, host, shape);
                JobEnd::Failed {
                    code: f.exit_code.max(1),
                    headline: format!("rank {} on {host} {}", f.rank, f.how),
                    summary,
                    error_json: Some(launcher_error_json(f, host)),
                }
            }
            RunResult::SpawnError(e) => failed(
                exit::USAGE,
                format!("nrun: error: cannot start workers on {host}: {e}\n"),
            ),
            RunResult::Lost(e) => {
                let hint = shape.lost_hints.get(i).map_or_else(
                    || format!("check that {host} is up and reachable"),
                    String::clone,
                );
                failed(
                    exit::CLUSTER,
                    format!(
                        "nrun: error: {e}; every worker on the other nodes was stopped\n  hint: {hint}\n"
                    ),
                )
            }
            _ => failed(
                exit::INTERNAL,
                format!("nrun: error: workers on {host} ran past their deadline\n"),
            ),
        };
    }
    if let Some(sig) = results.iter().find_map(|r| match r {
        Some(StepResult::Run(RunResult::Interrupted(s))) => Some(*s),
        _ => None,
    }) {
        return JobEnd::Interrupted(exit::signal(sig));
    }
    if results
        .iter()
        .any(|r| matches!(r, Some(StepResult::Run(RunResult::Stopped))))
    {
        return JobEnd::Interrupted(exit::signal(libc::SIGINT));
    }
    JobEnd::Success
}

/// The failure that caused the others among the nodes' results (see [`job_end`]): its node
/// and result.
pub(crate) fn first_failure(results: &[Option<StepResult>]) -> Option<(usize, &RunResult)> {
    let mut first: Option<(usize, &RunResult)> = None;
    for (i, r) in results.iter().enumerate() {
        let Some(StepResult::Run(rr)) = r else {
            continue;
        };
        if !rr.is_failure() {
            continue;
        }
        let better = match (first, rr) {
            (None, _) => true,
            (Some((_, RunResult::Failed(a))), RunResult::Failed(b)) => {
                (by_peer(b), &b.at) < (by_peer(a), &a.at)
            }
            (Some((_, RunResult::Failed(_))), _) => false,
            (Some(_), RunResult::Failed(_)) => true,
            _ => false,
        };
        if better {
            first = Some((i, rr));
        }
    }
    first
}

/// Whether a worker's failure shows a peer's doing (see [`nrun_node::failed_by_peer`]).
fn by_peer(f: &WorkerFailure) -> bool {
    let lines = f.stderr_tail.iter().chain(f.traceback.iter());
    nrun_node::failed_by_peer(lines.map(String::as_str))
}

fn failed(code: u8, summary: String) -> JobEnd {
    JobEnd::Failed {
        code,
        headline: summary
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("nrun: error: ")
            .to_string(),
        summary,
        error_json: None,
    }
}

/// The failure summary, in the spirit of torchrun's "Root Cause (first observed failure)" block,
/// plus the worker's own last words.
pub(crate) fn failure_summary(f: &WorkerFailure, host: &str, shape: &JobShape<'_>) -> String {
    let mut s = String::new();
    let several = shape.hosts.len() > 1;
    let (who, others) = match (several, shape.world > 1) {
        (true, _) => (
            format!("rank {} on {host}", f.rank),
            "; every worker on every node was stopped",
        ),
        (false, true) => (
            format!("rank {} of {}", f.rank, shape.world),
            "; every other worker was stopped",
        ),
        (false, false) => (format!("rank {} of {}", f.rank, shape.world), ""),
    };
    let _ = writeln!(s, "nrun: error: {who} {} (first failure{others})", f.how);
    for (rank, before) in &f.left_early {
        let when = match *before >= 0.0 {
            true => format!("{before:.1} s before"),
            false => format!("{:.1} s after", -before),
        };
        let _ = writeln!(
            s,
            "  likely cause: rank {rank} on {host} exited with code 0 {when} this failure while \
             the others still ran: a rank that leaves its loop early (one collective fewer) \
             makes its peers fail"
        );
    }
    let command = shape
        .hosts
        .iter()
        .position(|h| h == host)
        .and_then(|i| shape.node_commands.get(i)?.as_deref())
        .unwrap_or(shape.command);
    let _ = writeln!(s, "  command:    {command}");
    let _ = writeln!(s, "  host:       {host}");
    let _ = writeln!(s, "  local rank: {}", f.local_rank);
    let _ = writeln!(s, "  pid:        {}", f.pid);
    let _ = writeln!(s, "  time:       {}", f.at);
    if let Some(tb) = &f.traceback {
        let on = if several {
            format!(" on {host}")
        } else {
            String::new()
        };
        // A scratch error file is gone when nrun exits: name it only when it stays.
        match f.error_file_kept {
            true => {
                let _ = writeln!(s, "  traceback (from {}{on}):", f.error_file.display());
            }
            false => {
                let _ = writeln!(s, "  traceback (from its error file):");
            }
        }
        for line in tb.lines() {
            let _ = writeln!(s, "    {line}");
        }
    }
    if !f.stderr_tail.is_empty() {
        let _ = writeln!(s, "  last {} lines of its stderr:", f.stderr_tail.len());
        for line in &f.stderr_tail {
            let _ = writeln!(s, "    | {line}");
        }
    } else {
        let _ = writeln!(s, "  (it wrote nothing to stderr)");
    }
    if f.stderr_tail
        .iter()
        .any(|l| l.contains("No module named 'torch'"))
    {
        let python = command.split_whitespace().next().unwrap_or("python3");
        let _ = writeln!(
            s,
            "  hint: {python} has no torch: pass --python PATH (or set PYTHON_EXEC) to the python \
             of your torch environment (`python -c 'import sys; print(sys.executable)'` there)"
        );
    }
    s
}

/// What the launcher's own TORCHELASTIC_ERROR_FILE gets, as torchrun writes it: the root-cause
/// worker's error file with its exit code added, or a record of the failure when it wrote none.
pub(crate) fn launcher_error_json(f: &WorkerFailure, host: &str) -> String {
    let parsed = f
        .error_json
        .as_deref()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok());
    let v = match parsed {
        Some(mut v) => {
            if let Some(m) = v.get_mut("message").and_then(|m| m.as_object_mut()) {
                m.entry("errorCode").or_insert(f.exit_code.into());
            }
            v
        }
        None => serde_json::json!({
            "message": {
                "message": format!("rank {} (local rank {}) on {host} {}", f.rank, f.local_rank, f.how),
                "extraInfo": {
                    "py_callstack": f.stderr_tail.join("\n"),
                    "timestamp": epoch_seconds(&f.at),
                },
                "errorCode": f.exit_code,
            }
        }),
    };
    v.to_string()
}

/// torch's error files carry the time as a string of seconds since the epoch
/// (`str(int(time.time()))`, elastic's error_handler), which ProcessFailure reads with `int()`;
/// nrun's records carry RFC 3339 (shown in the summary).
fn epoch_seconds(rfc3339: &str) -> String {
    humantime::parse_rfc3339_weak(rfc3339)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or_else(|| "0".to_string(), |d| d.as_secs().to_string())
}

/// Writes a `--report FILE` as pretty JSON, its keys in order at every level (as a JSON value
/// holds them), whatever order the report's structs declare them in.
pub(crate) fn write_json(flag: &str, path: &Path, report: &impl serde::Serialize) -> Result<()> {
    let json = serde_json::to_value(report).unwrap_or_default();
    let text = serde_json::to_string_pretty(&json).unwrap_or_default();
    write_out(flag, path, (text + "\n").as_bytes())
}

/// Replaces the file of `flag` (a report) at once (a reader never sees part of it); what
/// failed, where, and what to check.
pub(crate) fn write_out(flag: &str, path: &Path, bytes: &[u8]) -> Result<()> {
    nrun_base::outputs::replace(path, bytes).map_err(|e| {
        Error::usage(format!(
            "cannot write {flag} {} on {}: {e} (check that its directory exists and is \
             writable, and its free space)",
            path.display(),
            nrun_base::net::hostname()
        ))
    })
}

/// A report that could not be written at a command's end: said, and the command's exit code
/// kept (what the job did matters more than where its report went).
pub(crate) fn said(written: Result<()>) {
    if let Err(e) = written {
        tracing::error!("{}", e.message);
    }
}

/// Log lines look like `nrun: warning: ...`, so they read as nrun's own next to worker output.
pub(crate) struct LogFormat;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for LogFormat
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut w: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let level = match *event.metadata().level() {
            tracing::Level::ERROR => "error: ",
            tracing::Level::WARN => "warning: ",
            tracing::Level::INFO => "",
            tracing::Level::DEBUG => "debug: ",
            tracing::Level::TRACE => "trace: ",
        };
        write!(w, "nrun: {level}")?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(rank: usize, at: &str, tail: &str) -> Option<StepResult> {
        Some(StepResult::Run(RunResult::Failed(WorkerFailure {
            rank,
            local_rank: 0,
            pid: 1,
            exit_code: 1,
            how: crate::protocol::Ending::Exit(nrun_node::Exit::Code(1)),
            gpu: None,
            at: at.into(),
            stderr_tail: vec![tail.into()],
            traceback: None,
            error_file: Default::default(),
            left_early: Vec::new(),
            error_json: None,
            error_file_kept: false,
            progress: None,
        })))
    }

    /// Across nodes, a rank's own exception beats a peer's closed connection even when the
    /// peer's node stamped its failure earlier; between two of a kind, the earlier wins.
    #[test]
    fn the_failure_named_is_the_one_of_its_own_accord_then_the_earliest() {
        let hosts = ["a".to_string(), "b".to_string(), "c".to_string()];
        let shape = JobShape {
            hosts: &hosts,
            lost_hints: &[],
            world: 3,
            command: "python train.py",
            node_commands: &[],
        };
        let closed = "RuntimeError: Connection closed by peer [10.0.0.2]:943";
        let headline = |r: &[Option<StepResult>]| match job_end(&shape, r) {
            JobEnd::Failed { headline, .. } => headline,
            e => panic!("{e:?}"),
        };
        let r = [
            failed(0, "2026-01-01T00:00:01Z", closed),
            failed(1, "2026-01-01T00:00:02Z", "ValueError: rank 1 cannot go on"),
            failed(2, "2026-01-01T00:00:00Z", closed),
        ];
        assert_eq!(headline(&r), "rank 1 on b exited with code 1");
        let r = [
            failed(0, "2026-01-01T00:00:01Z", closed),
            None,
            failed(2, "2026-01-01T00:00:00Z", closed),
        ];
        assert_eq!(headline(&r), "rank 2 on c exited with code 1");
    }
}
