//! Headless Chromium for the tests of the incident report page: load a page from disk with a
//! private profile and read its DOM and console (see tests/report_html.rs's module doc for how
//! "nothing failed to load" is checked).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{HANG, Scene, wait_with_timeout};

/// Debian's chromium, else one on PATH; None when there is none (see `missing_tool`).
pub(crate) fn chromium(test: &str) -> Option<PathBuf> {
    let found = std::iter::once(PathBuf::from("/usr/bin/chromium")).chain(
        std::env::var_os("PATH")
            .map(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join("chromium"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default(),
    );
    for c in found {
        if c.is_file() {
            return Some(c);
        }
    }
    super::missing_tool(test, "chromium (Debian's `chromium` package)");
    None
}

/// What one headless Chromium run of a page left: its DOM (with --dump-dom), its stderr, and
/// how long it took from start to exit.
pub(crate) struct Browsed {
    pub dom: String,
    pub stderr: String,
    pub took: Duration,
}

/// Loads `page` from disk in headless Chromium with a private profile; `extra`: more flags
/// (a screenshot instead of the DOM). Every process of it carries the scene's tag, and none
/// may be left running afterwards.
pub(crate) fn browse(s: &Scene, chrome: &Path, page: &Path, extra: &[&str]) -> Browsed {
    let profile = tempfile::tempdir_in(s.dir.path()).unwrap();
    let (out, err) = (profile.path().join("out"), profile.path().join("err"));
    let mut args = vec![
        "--headless=new".to_string(),
        "--no-sandbox".into(),
        "--disable-gpu".into(),
        "--no-first-run".into(),
        "--enable-logging=stderr".into(),
        "--v=0".into(),
        format!("--user-data-dir={}", profile.path().join("p").display()),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    if extra.is_empty() {
        args.push("--dump-dom".into());
    }
    args.push(format!("file://{}", page.display()));
    let started = Instant::now();
    // Output to files, not pipes: a large DOM must not block the browser on a full pipe.
    let child = Command::new(chrome)
        .args(&args)
        .env("NRUN_TEST_TAG", &s.tag)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let (status, _) = wait_with_timeout(child, HANG);
    let took = started.elapsed();
    // Chromium's helpers (zygote, GPU, renderer) end with it; wait for them, kill and fail
    // on any left.
    s.assert_no_survivors();
    let b = Browsed {
        dom: std::fs::read_to_string(&out).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err).unwrap_or_default(),
        took,
    };
    assert!(
        status.status.success(),
        "chromium failed on {}: {}",
        page.display(),
        b.stderr
    );
    b
}

/// The page's console messages and load failures among Chromium's log lines (see the
/// module doc).
pub(crate) fn page_complaints(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| {
            l.contains(":CONSOLE") || l.contains("Failed to load") || l.contains("Uncaught")
        })
        .collect()
}
