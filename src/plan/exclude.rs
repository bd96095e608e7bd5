//! `--exclude-file`: nodes to avoid, remembered across runs. One line per node a run (or
//! `nrun bisect --write-exclude`) left out:
//!
//! ```text
//! # host  when (UTC, RFC 3339)  why
//! node3  2026-12-01T12:40:05Z  lost: its agent was killed by SIGKILL
//! ```
//!
//! Entries older than `--exclude-ttl` are ignored (a repaired node comes back by itself); the
//! file is only ever appended to, so several jobs may share it.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nrun_base::error::{Error, Result};

/// A node to avoid, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub host: String,
    pub at: SystemTime,
    pub why: String,
}

/// The exclude file of a run: where it is and how long its entries count.
#[derive(Clone, Debug)]
pub(crate) struct ExcludeFile {
    pub path: PathBuf,
    pub ttl: Duration,
}

/// Largest exclude file read (it only grows by a line per bad node).
const MAX_BYTES: u64 = 16 << 20;

impl ExcludeFile {
    /// The entries still in force at `now`, latest per host; a missing file has none.
    pub(crate) fn read(&self, now: SystemTime) -> Result<Vec<Entry>> {
        let origin = self.path.display();
        let text = match nrun_base::files::read_text(
            &self.path,
            MAX_BYTES,
            nrun_base::files::Writer::Anyone,
        ) {
            Ok(t) => t,
            Err(nrun_base::files::ReadError::Missing) => return Ok(Vec::new()),
            Err(e @ nrun_base::files::ReadError::NotRegular(_)) => {
                return Err(Error::usage(format!(
                    "--exclude-file {origin}: {e}; give a file nrun may append to"
                )));
            }
            Err(e @ nrun_base::files::ReadError::TooBig(_)) => {
                return Err(Error::usage(format!(
                    "--exclude-file {origin}: {e}; start a new one"
                )));
            }
            Err(e) => return Err(Error::usage(format!("--exclude-file {origin}: {e}"))),
        };
        let mut out: Vec<Entry> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let e = parse_line(line)
                .map_err(|why| Error::usage(format!("--exclude-file {origin}:{}: {why}", n + 1)))?;
            let Some(e) = e else { continue };
            let age = now.duration_since(e.at).unwrap_or(Duration::ZERO);
            if age > self.ttl {
                continue;
            }
            match out.iter_mut().find(|o| o.host == e.host) {
                Some(o) if o.at < e.at => *o = e,
                Some(_) => {}
                None => out.push(e),
            }
        }
        Ok(out)
    }

    /// Appends `entries` (one write, so lines of jobs sharing the file do not interleave).
    pub(crate) fn append(&self, entries: &[Entry]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let text: String = entries.iter().map(format_line).collect();
        let origin = self.path.display();
        let mut f = nrun_base::outputs::append(&self.path).map_err(|e| {
            Error::internal(format!(
                "cannot append to --exclude-file {origin}: {e}; the nodes left out were \
                     printed above"
            ))
        })?;
        f.write_all(text.as_bytes())
            .map_err(|e| Error::internal(format!("cannot write --exclude-file {origin}: {e}")))
    }
}

/// One entry as a line: host, time, reason (on one line).
pub(crate) fn format_line(e: &Entry) -> String {
    let why: String = e
        .why
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    format!(
        "{}  {}  {}\n",
        e.host,
        humantime::format_rfc3339_seconds(e.at),
        why.trim()
    )
}

/// A line of the file: None for blank lines and `#` comments.
fn parse_line(line: &str) -> Result<Option<Entry>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let (host, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
    let rest = rest.trim_start();
    let (when, why) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
    let at = humantime::parse_rfc3339_weak(when).map_err(|_| {
        Error::usage(format!(
            "`{when}` is not a time; each line is `HOST TIME REASON` with TIME as \
             2026-12-01T12:00:00Z"
        ))
    })?;
    Ok(Some(Entry {
        host: host.to_string(),
        at,
        why: why.trim().to_string(),
    }))
}

/// `--exclude-ttl`: "24h", "90m", "3600" (seconds).
pub(crate) fn parse_ttl(s: &str) -> Result<Duration> {
    let s = s.trim();
    let d = match s.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => humantime::parse_duration(s).map_err(|_| {
            Error::usage(format!(
                "--exclude-ttl {s}: not a duration; give e.g. 24h, 90m or 3600 (seconds)"
            ))
        })?,
    };
    if d.is_zero() {
        return Err(Error::usage(
            "--exclude-ttl 0 would ignore every entry; give a positive duration such as 24h",
        ));
    }
    Ok(d)
}

/// For a path given on the command line (kept as given in messages).
pub(crate) fn new(path: &Path, ttl: &str) -> Result<ExcludeFile> {
    Ok(ExcludeFile {
        path: path.to_path_buf(),
        ttl: parse_ttl(ttl)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bounded_regular_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a plain syscall on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let now = SystemTime::now();
        for (p, why) in [
            (PathBuf::from("/dev/zero"), "is a device"),
            (fifo, "is a FIFO"),
            (dir.path().to_path_buf(), "is a directory"),
        ] {
            let f = ExcludeFile {
                path: p.clone(),
                ttl: Duration::from_secs(3600),
            };
            let e = f.read(now).unwrap_err();
            assert_eq!(e.code, nrun_base::error::exit::USAGE);
            let want = format!("--exclude-file {}: {why}", p.display());
            assert!(e.message.starts_with(&want), "{}", e.message);
        }
    }

    #[test]
    fn entries_round_trip_expire_and_keep_the_latest() {
        let dir = tempfile::tempdir().unwrap();
        let f = ExcludeFile {
            path: dir.path().join("bad-nodes"),
            ttl: Duration::from_secs(3600),
        };
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert!(f.read(now).unwrap().is_empty());
        let old = Entry {
            host: "n1".into(),
            at: now - Duration::from_secs(7200),
            why: "lost".into(),
        };
        let fresh = Entry {
            host: "n2".into(),
            at: now - Duration::from_secs(60),
            why: "failed the facts check:\nNCCL 2.21".into(),
        };
        f.append(&[old.clone(), fresh.clone()]).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&f.path)
            .unwrap()
            .write_all(b"# a comment\n\nn2   2020-01-01T00:00:00Z   older\n")
            .unwrap();
        let got = f.read(now).unwrap();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].host, "n2");
        assert_eq!(got[0].why, "failed the facts check: NCCL 2.21");
        // The expired entry counts again with a longer ttl.
        let long = ExcludeFile {
            ttl: Duration::from_secs(3 * 3600),
            ..f.clone()
        };
        assert_eq!(long.read(now).unwrap().len(), 2);
    }

    #[test]
    fn bad_lines_and_ttls_are_usage_errors_naming_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        std::fs::write(&path, "n1 2026-12-01T00:00:00Z ok\nn2 yesterday bad\n").unwrap();
        let f = ExcludeFile {
            path,
            ttl: Duration::from_secs(60),
        };
        let e = f.read(SystemTime::now()).unwrap_err();
        assert_eq!(e.code, 2);
        assert!(
            e.message.contains(":2: `yesterday` is not a time"),
            "{}",
            e.message
        );
        assert_eq!(parse_ttl("24h").unwrap(), Duration::from_secs(86400));
        assert_eq!(parse_ttl("90").unwrap(), Duration::from_secs(90));
        assert!(parse_ttl("0").is_err());
        assert!(
            parse_ttl("soon")
                .unwrap_err()
                .message
                .contains("not a duration")
        );
    }
}
