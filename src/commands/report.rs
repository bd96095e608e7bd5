//! `nrun report REPORT.json [-o OUT.html]`: a `--report` JSON (the job's, bisect's, the
//! preflight's) drawn as the page a person reads ([`crate::report::html`]). No session, no
//! nodes: it reads one file and writes one.

use std::path::{Path, PathBuf};

use nrun_base::error::{Error, Result, exit};

/// The largest report `nrun report` reads: a 1,024-node job's is a few MiB; more is not a
/// report nrun wrote (and its JSON would take several times this in memory).
const MAX_REPORT: u64 = 64 << 20;

/// Writes the page and prints its path; a missing or unreadable input, or one that is not a
/// report ([`crate::report::schema::Report::read`] says why), is a usage error (2). The input
/// is read as [`nrun_base::files::read_bounded`] reads: a regular file of at most
/// [`MAX_REPORT`], opened without blocking (`/dev/zero` or a FIFO is refused at once, named).
pub(crate) fn run(input: &Path, output: Option<&Path>) -> Result<u8> {
    let bytes = nrun_base::files::read_bounded(input, MAX_REPORT).map_err(|e| {
        Error::usage(format!(
            "cannot read the report {}: {e} (give the file a job's, bisect's or \
             --preflight-only's --report FILE wrote)",
            input.display()
        ))
    })?;
    let name = input.display().to_string();
    let report = crate::report::schema::Report::read(&name, &bytes).map_err(Error::usage)?;
    drop(bytes);
    let out = output.map_or_else(|| beside(input), Path::to_path_buf);
    crate::report::html::write("-o", &out, report, &name)?;
    nrun_base::stdout(format!("{}\n", out.display()));
    Ok(exit::SUCCESS)
}

/// REPORT.json -> REPORT.html, in the same directory.
fn beside(input: &Path) -> PathBuf {
    input.with_extension("html")
}
