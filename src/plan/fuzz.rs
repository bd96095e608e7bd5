//! Seeded, bounded fuzzing of the inputs (CI runs it with the unit tests): random command lines
//! built from nrun's real flag names and values chosen to break parsers, through clap and
//! [`super::resolve`]; random text through the hostfile, `-H` and Slurm hostlist parsers.
//! Nothing may panic; a refusal is exit 2 (bad input) or 1 (the system), never anything else.
//! Nothing is spawned: resolving a plan only reads files and the environment.

use clap::{CommandFactory, Parser};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

use nrun_base::error::exit;
use nrun_cli::Cli;

/// Command lines tried per run (a few seconds in a debug build).
const CLI_CASES: u32 = 2_000;
/// Far above what the cases take even on a loaded CI machine: a guard against a parser turning
/// superlinear, not a benchmark.
const TIME_GUARD: std::time::Duration = std::time::Duration::from_secs(120);

/// A runner with a fixed seed and case count, so CI runs the same inputs every time and in
/// bounded time.
fn runner(cases: u32, seed: u8) -> TestRunner {
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 2_000,
        ..Config::default()
    };
    TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}

/// Every flag spelling the default command, `doctor` and `bisect` take (long names, aliases,
/// short names), from clap's own definitions so new flags are fuzzed too.
fn flag_names() -> Vec<String> {
    let cmd = Cli::command();
    let mut names = Vec::new();
    let args = cmd
        .get_arguments()
        .chain(cmd.get_subcommands().flat_map(|c| c.get_arguments()));
    for a in args {
        if let Some(l) = a.get_long() {
            names.push(format!("--{l}"));
        }
        for l in a.get_all_aliases().unwrap_or_default() {
            names.push(format!("--{l}"));
        }
        if let Some(s) = a.get_short() {
            names.push(format!("-{s}"));
        }
    }
    names.sort();
    names.dedup();
    names
}

/// Values that have broken parsers: numbers at and past their limits, non-finite floats,
/// brackets, colons, template fields, special files, separators, empty and odd text.
const VALUES: &[&str] = &[
    "",
    " ",
    "0",
    "1",
    "2",
    "-1",
    "8",
    "4096",
    "4097",
    "100000",
    "18446744073709551616",
    "99999999999",
    "1e400",
    "-1e400",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "0.5",
    "1e-400",
    "1:4",
    "0:0",
    "3:2",
    ":",
    "::",
    "[::1",
    "[::1]",
    "[::1]:80",
    "[::1]x",
    "::1]",
    "fe80::1%eth0",
    "h:99999",
    "h:",
    ":80",
    "a:b:c",
    "127.0.0.1:0",
    "localhost:29400",
    "gpu",
    "cpu",
    "auto",
    "c10d",
    "static",
    "etcd",
    "none",
    "timeout=1e400",
    "is_host=maybe",
    "is_host=1",
    "join_timeout=0",
    "join_timeout",
    "a=1,b=2,a=3",
    "k=",
    "=v",
    ",,,",
    "${nope}",
    "${rank}",
    "${",
    "$${rank}}",
    "0:3,1:1",
    "7",
    "3:9",
    "SIGTERM,USR1",
    "SIGKILL",
    "99",
    "4G",
    "1M",
    "0K",
    "99999999T",
    "/dev/zero",
    "/dev/urandom",
    "/dev/null",
    "/nonexistent/x",
    "/",
    "h1,h2",
    "h1:8,h2:8",
    "h1@h2:0,2",
    "h[1-3]",
    "h[1-99999999]",
    "[fe80::1]:4",
    "a,,b",
    "user@host",
    "-x",
    "--",
    "x.py",
    "true",
    "é",
    "\u{0}",
    "a\nb",
    "8:256M:2",
    "8:1:2",
    "nccl",
    "net",
    "cmd",
    "off",
    "warn",
    "nccl,warn",
    "ecc",
    "bogus",
    "always",
    "stop",
];

/// One argv element: a real flag, a chosen value, or random text.
fn token(flags: Vec<String>) -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(flags),
        4 => proptest::sample::select(VALUES).prop_map(str::to_string),
        1 => "\\PC{0,12}",
        1 => "[-=:,\\[\\]{}$0-9a-z]{0,10}",
    ]
}

/// A command line: maybe a subcommand, flags and values, maybe a target.
fn argv() -> impl Strategy<Value = Vec<String>> {
    let sub = proptest::sample::select(vec!["", "", "", "doctor", "bisect", "completions", "man"]);
    let target = proptest::sample::select(vec![
        vec![],
        vec!["--no-python".to_string(), "true".to_string()],
        vec!["x.py".to_string()],
        vec!["--".to_string(), "true".to_string()],
    ]);
    let flags = flag_names();
    // Mostly a flag with a value, as people write them; sometimes a lone token anywhere.
    let item = prop_oneof![
        3 => (
            proptest::sample::select(flags.clone()),
            proptest::sample::select(VALUES).prop_map(str::to_string),
        )
            .prop_map(|(f, v)| vec![f, v]),
        1 => token(flags).prop_map(|t| vec![t]),
    ];
    (sub, proptest::collection::vec(item, 0..8), target).prop_map(|(sub, items, target)| {
        let mut a = vec!["nrun".to_string()];
        if !sub.is_empty() {
            a.push(sub.to_string());
        }
        a.extend(items.into_iter().flatten());
        a.extend(target);
        a
    })
}

/// The environment a fuzzed plan sees: this PATH (to find programs), nothing else, so the
/// host's own NRUN_/SLURM_ variables cannot change what is tested.
fn env_of(path: Option<String>) -> impl Fn(&str) -> Option<String> {
    move |k| match k {
        "PATH" => path.clone(),
        _ => None,
    }
}

#[test]
fn command_lines_never_panic_and_refuse_with_1_or_2() {
    let path = std::env::var("PATH").ok();
    let mut r = runner(CLI_CASES, 19);
    let started = std::time::Instant::now();
    // How many command lines clap accepted, and how many of those resolved to a plan.
    let (parsed, planned) = (std::cell::Cell::new(0u32), std::cell::Cell::new(0u32));
    r.run(&argv(), |a| {
        let Ok(cli) = Cli::try_parse_from(&a) else {
            // clap's refusals are printed as usage errors (exit 2) by lib.rs.
            return Ok(());
        };
        parsed.set(parsed.get() + 1);
        match super::resolve(cli, &env_of(path.clone())) {
            Ok(_) => planned.set(planned.get() + 1),
            Err(e) => prop_assert!(
                e.code == exit::USAGE || e.code == exit::INTERNAL,
                "{a:?}: exit {} ({})",
                e.code,
                e.message
            ),
        }
        Ok(())
    })
    .unwrap();
    assert!(started.elapsed() < TIME_GUARD, "{:?}", started.elapsed());
    // The fuzz reaches the plan, and some command lines make one (not only refusals).
    eprintln!(
        "parsed {} of {CLI_CASES}, planned {}",
        parsed.get(),
        planned.get()
    );
    assert!(
        parsed.get() > CLI_CASES / 5 && planned.get() > CLI_CASES / 100,
        "{} {}",
        parsed.get(),
        planned.get()
    );
}

/// Hostfile-like text: host names, slots, keys, comments, brackets and noise, line by line.
fn hostfile_text() -> impl Strategy<Value = String> {
    let word = prop_oneof![
        3 => "[a-z][a-z0-9.-]{0,8}",
        1 => proptest::sample::select(vec![
            "slots=8", "slots=0", "slots=x", "slots=99999999999", "max_slots=2", "k=v", "#",
            "# c", ":8", ":", "[fe80::1]", "[fe80::1]:4", "[::1", "user@", "=", "\t", "\r",
            "host:18446744073709551616", "h[1-3]",
        ]).prop_map(str::to_string),
        1 => "\\PC{0,10}",
    ];
    let line = proptest::collection::vec(word, 0..5).prop_map(|w| w.join(" "));
    proptest::collection::vec(line, 0..30).prop_map(|l| l.join("\n"))
}

#[test]
fn host_lists_never_panic_and_refuse_as_usage() {
    use crate::hosts;
    let mut r = runner(3_000, 9);
    let started = std::time::Instant::now();
    r.run(&hostfile_text(), |text| {
        let usage = |e: nrun_base::error::Error| e.code == exit::USAGE && !e.message.is_empty();
        let parsed = hosts::parse_hostfile(&text, "hosts");
        let filtered = hosts::filter_hostfile(&text, "hosts", &|n| n.len() % 2 == 0);
        // Both accept and reject the same text.
        prop_assert_eq!(parsed.is_ok(), filtered.is_ok(), "{:?}", text);
        if let Err(e) = parsed {
            prop_assert!(usage(e), "{:?}", text);
        }
        let flag = text.replace('\n', ",");
        if let Err(e) = hosts::parse_hosts_flag(&flag) {
            prop_assert!(usage(e), "{:?}", flag);
        }
        if let Err(e) = hosts::expand_slurm_hostlist(&flag) {
            prop_assert!(usage(e), "{:?}", flag);
        }
        Ok(())
    })
    .unwrap();
    assert!(started.elapsed() < TIME_GUARD, "{:?}", started.elapsed());
}
