//! `nrun report REPORT.json [-o OUT.html]`: a `--report` JSON (the job's, bisect's, the
//! preflight's) drawn as the page a person reads ([`crate::report::html`]). No session, no
//! nodes: it reads one file and writes one.

use std::path::{Path, PathBuf};

use nrun_base::error::{Error, Result, exit};

/// Writes the page and prints its path; a missing or unreadable input is a usage error (2).
pub(crate) fn run(input: &Path, output: Option<&Path>) -> Result<u8> {
    let text = std::fs::read_to_string(input).map_err(|e| {
        Error::usage(format!(
            "cannot read the report {}: {e} (give the file a job's, bisect's or \
             --preflight-only's --report FILE wrote)",
            input.display()
        ))
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        Error::usage(format!(
            "{} is not JSON ({e}); nrun report reads the file --report FILE wrote",
            input.display()
        ))
    })?;
    if !v.is_object() {
        return Err(Error::usage(format!(
            "{} holds JSON but not a report (an object with nrun's keys, such as job, rows, \
             rounds, ledger, events); nrun report reads the file --report FILE wrote",
            input.display()
        )));
    }
    let out = output.map_or_else(|| beside(input), Path::to_path_buf);
    let source = input.display().to_string();
    crate::report::html::write("-o", &out, &v, &source)?;
    nrun_base::stdout(format!("{}\n", out.display()));
    Ok(exit::SUCCESS)
}

/// REPORT.json -> REPORT.html, in the same directory.
fn beside(input: &Path) -> PathBuf {
    input.with_extension("html")
}
