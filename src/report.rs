//! What nrun tells people: the failure summary and log formatting. The one place that knows how
//! messages look.

use std::fmt::Write as _;
use std::path::Path;

use crate::node::Failure;

/// The failure summary, in the spirit of torchrun's "Root Cause (first observed failure)" block,
/// plus the worker's own last words.
pub fn failure_summary(f: &Failure, host: &str, world_size: usize, program: &str) -> String {
    let mut s = String::new();
    let others = if world_size > 1 {
        "; every other worker was stopped"
    } else {
        ""
    };
    let _ = writeln!(
        s,
        "nrun: error: rank {} of {world_size} {} (first failure{others})",
        f.rank,
        f.exit.describe()
    );
    let _ = writeln!(s, "  command:    {program}");
    let _ = writeln!(s, "  host:       {host}");
    let _ = writeln!(s, "  local rank: {}", f.local_rank);
    let _ = writeln!(s, "  pid:        {}", f.pid);
    let _ = writeln!(
        s,
        "  time:       {}",
        humantime::format_rfc3339_seconds(f.at)
    );
    if let Some(tb) = read_error_file(&f.error_file) {
        let _ = writeln!(s, "  traceback (from {}):", f.error_file.display());
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
    s
}

/// The traceback a worker decorated with torch's `@record` wrote to TORCHELASTIC_ERROR_FILE:
/// `{"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}`, or a plain string
/// message from C++ code.
pub fn read_error_file(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let m = v.get("message")?;
    if let Some(s) = m.as_str() {
        return Some(s.to_string());
    }
    let msg = m
        .get("message")
        .and_then(|x| x.as_str())
        .unwrap_or_default();
    let stack = m
        .get("extraInfo")
        .and_then(|e| e.get("py_callstack"))
        .and_then(|x| x.as_str())
        .unwrap_or_default();
    let out = if stack.is_empty() {
        msg.to_string()
    } else {
        stack.trim_end().to_string()
    };
    (!out.is_empty()).then_some(out)
}

/// Log lines look like `nrun: warning: ...`, so they read as nrun's own next to worker output.
pub struct LogFormat;

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

    #[test]
    fn error_file_formats() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("error.json");
        std::fs::write(
            &p,
            r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  x\nValueError: boom\n", "timestamp": "1"}}}"#,
        )
        .unwrap();
        let tb = read_error_file(&p).unwrap();
        assert!(
            tb.starts_with("Traceback") && tb.ends_with("ValueError: boom"),
            "{tb}"
        );
        std::fs::write(&p, r#"{"message": "c++ error"}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap(), "c++ error");
        std::fs::write(&p, "not json").unwrap();
        assert!(read_error_file(&p).is_none());
        assert!(read_error_file(&dir.path().join("missing")).is_none());
    }
}
