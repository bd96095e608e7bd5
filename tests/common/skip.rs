//! A test whose set-up cannot be made here (no root, no torch, a tool missing): a failure under
//! scripts/test.sh (NRUN_TEST_REQUIRE_TOOLS=1), where a skip would let CI pass a check it never
//! ran; a skip, said on stderr, in a developer's narrow run. std only: the workspace crates'
//! tests include this file too (`#[path]`).
#![allow(dead_code)]

use std::io::Write;

/// Whether this run must run every scenario (scripts/test.sh sets NRUN_TEST_REQUIRE_TOOLS=1):
/// a test whose set-up cannot be made then fails instead of skipping, so that CI cannot pass a
/// check it never ran.
pub(crate) fn setup_required() -> bool {
    std::env::var_os("NRUN_TEST_REQUIRE_TOOLS").is_some_and(|v| v == "1")
}

/// The running test's name: libtest runs each test on a thread named after it.
pub(crate) fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("a test off its own thread")
        .to_string()
}

/// A test whose set-up cannot be made here; `missing` says what is missing and what provides
/// it. Under scripts/test.sh (NRUN_TEST_REQUIRE_TOOLS=1) a failure naming it; in a developer's
/// run a skip, said in one line on stderr. The caller returns (passes) after it.
pub(crate) fn cannot_set_up(missing: &str) {
    skip_or_fail(&current_test(), missing);
}

/// A test whose tool (`tool`, installed by scripts/test.sh) is missing: as [`cannot_set_up`].
pub(crate) fn missing_tool(test: &str, tool: &str) {
    skip_or_fail(
        test,
        &format!("{tool} is not installed (scripts/test.sh installs it)"),
    );
}

fn skip_or_fail(test: &str, missing: &str) {
    if setup_required() {
        panic!(
            "{test}: cannot run its scenario: {missing}; NRUN_TEST_REQUIRE_TOOLS=1 makes that a failure, not a skip"
        );
    }
    // Straight to fd 2, not through eprintln!: libtest keeps a passing test's eprintln! to
    // itself, and a skip nobody sees is the silent pass this is here to end.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {missing}");
}
