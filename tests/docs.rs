//! The docs' own test: README.md and docs/*.md say only what this binary does.
//!
//! - Every command in a `sh` fenced block runs here with the real binary (`nrun` on PATH, a fresh
//!   working directory and HOME) and must exit 0 (or N, where its comment says `# exits N`), unless [`NOT_RUN`] names it with the reason it
//!   cannot run on a machine without a GPU, a cluster or a scheduler. An entry of [`NOT_RUN`] that
//!   no document shows any more fails the test, so the list stays the docs' own. A `scripts/`
//!   command's script must exist and be executable, run or not.
//! - Every `--flag` the docs name is one of the flags `nrun --help` (or a subcommand's `--help`)
//!   shows, in either spelling (`--nproc_per_node` is `--nproc-per-node`), or one nrun takes but
//!   hides from `--help` (asked of the binary), or is another tool's, listed in [`FOREIGN`] with
//!   its owner. The known flags are read from the binary, so a flag
//!   that lands in nrun is known here as soon as its `--help` shows it: nothing to add.
//! - Every relative link leads to a file, and a `#anchor` to a heading there; every `scripts/X`
//!   named is an executable file there.
//! - Every fenced block names its language (an unnamed one could hide a command from this test).
//! - README stays a page a newcomer reads in 5 minutes (at most 15,000 bytes) and shows the quick
//!   start's two commands; its table of verdicts is docs/fault-model.md's.
//! - What the docs say nrun refuses, it refuses ([`REFUSED`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Why a documented command does not run in this test.
#[derive(Debug, Clone, Copy)]
enum Why {
    /// Needs GPUs (NCCL preflight), or torch (examples/train.py, or the user's own `train.py`).
    GpuOrTorch,
    /// Names hosts of a real cluster (gpu1, a hostfile `hosts`) reached over ssh.
    Cluster,
    /// Runs under a scheduler (salloc, srun, a batch script).
    Scheduler,
    /// Builds or installs (minutes; scripts/test.sh and scripts/wheel-check.sh run these).
    Builds,
    /// Writes a system directory.
    System,
    /// Makes network namespaces, sshd or Slurm daemons as root (the cluster tests do).
    Root,
}

/// The documented commands this test does not run, exactly as the docs write them (comments
/// stripped, spaces collapsed), each with its reason.
const NOT_RUN: &[(&str, Why)] = &[
    ("scripts/wheel.sh", Why::Builds),
    ("pip install dist/nrun-*.whl", Why::Builds),
    ("cargo install --path .", Why::Builds),
    ("scripts/demo.sh", Why::Builds),
    ("scripts/test.sh", Why::Builds),
    ("scripts/test.sh --fast", Why::Builds),
    ("cargo test --test docs", Why::Builds),
    ("cargo test -p nrun-store", Why::Builds),
    (
        ". \"$(scripts/slurm-cluster.sh up 3 | tail -1)\"",
        Why::Root,
    ),
    ("scripts/slurm-cluster.sh down", Why::Root),
    ("scripts/netns-cluster.sh up 3", Why::Root),
    (
        "nrun completions bash > /etc/bash_completion.d/nrun",
        Why::System,
    ),
    ("nrun man > /usr/local/share/man/man1/nrun.1", Why::System),
    ("nrun --nproc 8 examples/train.py --lr 0.1", Why::GpuOrTorch),
    ("nrun --nproc 8 train.py", Why::GpuOrTorch),
    (
        "nrun --nproc 8 --hang-timeout 120 --on-hang stop train.py",
        Why::GpuOrTorch,
    ),
    ("nrun --preflight-only --nproc 8", Why::GpuOrTorch),
    (
        "nrun --preflight-only --nproc 8 --preflight-sizes 8:2G:2 --report pf.json",
        Why::GpuOrTorch,
    ),
    ("nrun -H gpu1,gpu2 --nproc 8 train.py", Why::Cluster),
    (
        "nrun --hostfile hosts --nnodes 4 --nproc 8 train.py",
        Why::Cluster,
    ),
    ("nrun doctor -H gpu1,gpu2", Why::Cluster),
    (
        "nrun --nnodes 2 --nproc 8 --rdzv-endpoint gpu1:29400 --rdzv-id job1 train.py",
        Why::Cluster,
    ),
    (
        "nrun --nnodes 2 --nproc 8 --rdzv-backend c10d --rdzv-endpoint gpu1:29400 --rdzv-id job1 train.py",
        Why::Cluster,
    ),
    (
        "nrun --hostfile hosts --spares 2 --max-restarts 3 --exclude-file ~/.nrun-bad-nodes --nproc 8 train.py",
        Why::Cluster,
    ),
    (
        "nrun -H gpu[1-5] --nnodes 4 --max-restarts 3 --exclude-file ~/.nrun-bad-nodes --nproc 8 train.py",
        Why::Cluster,
    ),
    (
        "nrun --hostfile hosts --spares 2 --nproc 8 train.py",
        Why::Cluster,
    ),
    (
        "nrun bisect --hostfile hosts --nproc 8 --write-hostfile good-hosts",
        Why::Cluster,
    ),
    (
        "nrun bisect --hostfile hosts --nproc 8 --probe net",
        Why::Cluster,
    ),
    (
        "nrun bisect --hostfile hosts --nproc 8 --probe cmd --timeout 300 -- python train.py --steps 10",
        Why::Cluster,
    ),
    (
        "salloc -N 4 --gpus-per-node 8 nrun --nproc 8 train.py",
        Why::Scheduler,
    ),
    (
        "srun -N 4 --ntasks-per-node 1 nrun --nproc 8 train.py",
        Why::Scheduler,
    ),
    ("srun nrun --nproc 8 train.py --epochs 10", Why::Scheduler),
    (
        "salloc -N 5 nrun --nnodes 4 --nproc 8 train.py",
        Why::Scheduler,
    ),
];

/// Flags the docs name that belong to another program, with that program.
const FOREIGN: &[(&str, &str)] = &[
    ("--gpus-per-node", "salloc/sbatch"),
    ("--ntasks-per-node", "srun/sbatch"),
    ("--signal", "sbatch"),
    ("--nodes", "srun (nrun's own srun step)"),
    ("--whole", "srun (nrun's own srun step)"),
    ("--kill-on-bad-exit", "srun (nrun's own srun step)"),
    ("--path", "cargo install"),
    ("--release", "cargo build"),
    ("--test", "cargo test"),
    ("--fast", "scripts/test.sh"),
    ("--lr", "examples/train.py, or the user's script"),
    ("--epochs", "train.py, the user's script"),
    ("--steps", "examples/train.py, or the user's script"),
    ("--batch", "examples/train.py"),
];

/// What the docs say nrun refuses: (the phrase in the docs, the arguments, the exit code, a
/// piece of the error). Each runs with no GPU visible; a GPU-dependent one is skipped on a GPU
/// machine.
const REFUSED: &[(&str, &[&str], i32, &str, bool)] = &[
    (
        "`nrun --preflight-only` (mode `auto`) is refused at once (exit 2",
        &["--preflight-only", "--nproc", "8"],
        2,
        "no GPU is visible here for the NCCL preflight",
        true,
    ),
    (
        "an abbreviated flag (`--nproc-per` for `--nproc-per-node`",
        &["--nproc-per", "2", "--no-python", "true"],
        2,
        "--nproc-per-node",
        false,
    ),
    (
        "`--print-completion tcsh` (nrun's completions are bash",
        &["--print-completion", "tcsh"],
        2,
        "tcsh",
        false,
    ),
];

/// Flags the docs mention as refused (not flags of nrun).
const NOT_FLAGS: &[&str] = &["--nproc-per"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every docs/*.md, with their text.
fn documents() -> Vec<(PathBuf, String)> {
    let mut paths = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    paths.extend(docs);
    paths
        .into_iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, text)
        })
        .collect()
}

fn name(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// A fenced block: its language and its lines.
struct Block {
    lang: String,
    lines: Vec<String>,
    /// 1-based line of the opening fence.
    at: usize,
}

/// The fenced blocks of a markdown text, and its lines outside them.
fn blocks(text: &str) -> (Vec<Block>, Vec<String>) {
    let mut out = Vec::new();
    let mut prose = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if let Some(info) = t.strip_prefix("```") {
            match open.take() {
                Some(b) => out.push(b),
                None => {
                    open = Some(Block {
                        lang: info.trim().to_string(),
                        lines: Vec::new(),
                        at: i + 1,
                    })
                }
            }
            continue;
        }
        match &mut open {
            Some(b) => b.lines.push(line.to_string()),
            None => prose.push(line.to_string()),
        }
    }
    assert!(open.is_none(), "a fenced block is never closed");
    (out, prose)
}

/// A shell line without its trailing `# comment` (a `#` after a space, outside quotes), its
/// spaces collapsed; and the exit code the comment promises (`# exits 3: ...`), else 0.
fn strip_comment(line: &str) -> (String, i32) {
    let mut quote = None;
    let mut prev = ' ';
    let mut out = String::new();
    for ch in line.chars() {
        match quote {
            Some(q) if ch == q => quote = None,
            Some(_) => {}
            None if ch == '\'' || ch == '"' => quote = Some(ch),
            None if ch == '#' && prev.is_whitespace() => break,
            None => {}
        }
        out.push(ch);
        prev = ch;
    }
    let comment = line[out.len()..].trim_start_matches('#').trim_start();
    let exits = comment
        .strip_prefix("exits ")
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    (out.split_whitespace().collect::<Vec<_>>().join(" "), exits)
}

/// The commands of a `sh` block with the exit code each promises: comment lines and blank lines
/// skipped, `\` continuations joined.
fn commands(block: &Block) -> Vec<(String, i32)> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in &block.lines {
        let t = line.trim();
        if pending.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(t);
        out.push(strip_comment(&pending));
        pending.clear();
    }
    out
}

/// Every command of every `sh` block, with where it is and the exit code it promises.
fn all_commands() -> Vec<(String, String, i32)> {
    let mut out = Vec::new();
    for (path, text) in documents() {
        for b in blocks(&text).0.iter().filter(|b| b.lang == "sh") {
            for (c, exits) in commands(b) {
                out.push((format!("{}:{}", name(&path), b.at), c, exits));
            }
        }
    }
    out
}

/// A shell's environment without what would change nrun's behaviour (a scheduler's node list,
/// nrun's and torchrun's own variables) and with `nrun` on PATH.
fn shell(cmd: &str, dir: &Path) -> Command {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let link = bin.join("nrun");
    if !link.exists() {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_nrun"), &link).unwrap();
    }
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    // A hung command fails the test instead of stalling it (60 s is far above any of them).
    let mut c = Command::new("timeout");
    c.args(["--kill-after=5", "60", "sh", "-c", cmd]);
    c.current_dir(&work).env("HOME", dir);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().to_string();
        let scheduler = [
            "SLURM_",
            "PBS_",
            "LSB_",
            "PET_",
            "NRUN_",
            "FLUX_",
            "TORCHELASTIC_",
        ]
        .iter()
        .any(|p| k.starts_with(p));
        if scheduler || k == "PE_HOSTFILE" {
            c.env_remove(&k);
        }
    }
    let path = std::env::var("PATH").unwrap_or_default();
    c.env("PATH", format!("{}:{path}", bin.display()));
    c
}

fn said(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn every_documented_command_runs_or_says_why_not() {
    let not_run: BTreeMap<&str, Why> = NOT_RUN.iter().copied().collect();
    let cmds = all_commands();
    assert!(!cmds.is_empty(), "no `sh` block in README.md or docs/");
    let shown: BTreeSet<&str> = cmds.iter().map(|(_, c, _)| c.as_str()).collect();
    let stale: Vec<&&str> = not_run.keys().filter(|c| !shown.contains(**c)).collect();
    assert!(
        stale.is_empty(),
        "NOT_RUN names commands no document shows any more (remove them): {stale:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut ran = BTreeSet::new();
    for (at, cmd, exits) in &cmds {
        let first = cmd.split_whitespace().next().unwrap_or_default();
        if first.starts_with("scripts/") {
            let script = root().join(first);
            let mode = std::fs::metadata(&script)
                .unwrap_or_else(|e| panic!("{at}: `{cmd}`: {first}: {e}"))
                .permissions();
            assert!(
                std::os::unix::fs::PermissionsExt::mode(&mode) & 0o111 != 0,
                "{at}: {first} is not executable"
            );
        }
        if let Some(why) = not_run.get(cmd.as_str()) {
            eprintln!("not run ({why:?}): {cmd}");
            continue;
        }
        if !ran.insert(cmd.clone()) {
            continue;
        }
        let out = shell(cmd, dir.path()).output().expect("sh");
        assert_eq!(
            out.status.code(),
            Some(*exits),
            "{at}: the documented command `{cmd}` did not exit {exits} here (a comment \
             `# exits N` says it should exit N; if it cannot run without a GPU, a cluster or a \
             scheduler, add it to NOT_RUN with the reason):\n{}",
            said(&out)
        );
        eprintln!("ran: {cmd}");
    }
    assert!(
        !ran.is_empty(),
        "the docs show no command this machine can run"
    );
}

/// The long flags a `--help` text shows: the flag column of its option lines, and aliases.
fn help_flags(help: &str, into: &mut BTreeSet<String>) {
    let long = |tok: &str| -> Option<String> {
        let t = tok.trim_matches(|c: char| c == ',' || c == ']' || c == '[');
        let t = t.split(['=', '<', '[']).next().unwrap_or_default();
        (t.starts_with("--") && t.len() > 2).then(|| t.replace('_', "-"))
    };
    for line in help.lines() {
        let t = line.trim_start();
        if t.starts_with('-') {
            for tok in t.split_whitespace().take_while(|w| w.starts_with('-')) {
                into.extend(long(tok));
            }
        }
    }
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for part in flat.split("[alias").skip(1) {
        let list = part.split(']').next().unwrap_or_default();
        for tok in list.split([' ', ',', ':']) {
            into.extend(long(tok));
        }
    }
}

/// nrun's flags, read from the binary: `--help` and every subcommand's.
fn nrun_flags() -> BTreeSet<String> {
    let help = |args: &[&str]| -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_nrun"))
            .args(args)
            .output()
            .expect("nrun --help");
        assert!(out.status.success(), "nrun {args:?}: {}", said(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = help(&["--help"]);
    let mut flags = BTreeSet::new();
    help_flags(&top, &mut flags);
    // The subcommands: the indented names under "Commands", up to the blank line.
    let subs: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .filter(|s| s != "help")
        .collect();
    assert!(subs.len() >= 2, "no subcommands read from --help:\n{top}");
    for s in subs {
        help_flags(&help(&[&s, "--help"]), &mut flags);
    }
    assert!(flags.contains("--nproc-per-node") && flags.contains("--nproc"));
    flags
}

/// Whether nrun takes a flag its `--help` hides (torchrun's flags nrun accepts and ignores, such
/// as `--monitor-interval`): clap names an unknown flag "unexpected argument"; `--version`
/// after it ends a known one's parse without running anything.
fn hidden_flag(flag: &str) -> bool {
    let out = Command::new(env!("CARGO_BIN_EXE_nrun"))
        .args([&format!("{flag}=1"), "--version"])
        .output()
        .expect("nrun");
    !String::from_utf8_lossy(&out.stderr).contains(&format!("unexpected argument '{flag}'"))
}

/// Every `--flag` in a text (prose, tables and blocks alike), normalized to dashes.
fn flags_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(off) = text[i..].find("--") {
        let at = i + off;
        let before = at.checked_sub(1).map(|j| b[j]);
        let mut end = at + 2;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'-' || b[end] == b'_')
        {
            end += 1;
        }
        let word_start = before.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == b'-'));
        if word_start && end > at + 2 && b[at + 2].is_ascii_alphabetic() {
            out.insert(text[at..end].trim_end_matches('-').replace('_', "-"));
        }
        i = end.max(at + 2);
    }
    out
}

#[test]
fn every_documented_flag_is_nrun_s_or_another_tool_s() {
    let known = nrun_flags();
    let foreign: BTreeMap<&str, &str> = FOREIGN.iter().copied().collect();
    let mut used_foreign = BTreeSet::new();
    let mut unknown = Vec::new();
    for (path, text) in documents() {
        for f in flags_in(&text) {
            if known.contains(&f) || NOT_FLAGS.contains(&f.as_str()) {
                continue;
            }
            if foreign.contains_key(f.as_str()) {
                used_foreign.insert(f);
                continue;
            }
            if !hidden_flag(&f) {
                unknown.push(format!("{}: {f}", name(&path)));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "the docs name flags nrun's --help does not show (a flag renamed or removed?), nor \
         FOREIGN lists as another program's:\n{}",
        unknown.join("\n")
    );
    for (f, owner) in FOREIGN {
        assert!(
            !known.contains(*f),
            "FOREIGN lists {f} as {owner}'s, but it is nrun's own flag now: remove it from FOREIGN"
        );
        assert!(
            used_foreign.contains(*f),
            "FOREIGN lists {f} ({owner}), which no document names any more: remove it"
        );
    }
}

#[test]
fn the_checker_reads_flags_as_written() {
    let f = flags_in(
        "`--nproc_per_node`, --rdzv-conf K=V, `-- python x`, a --- rule, x--y, --exclude=a",
    );
    let want: BTreeSet<String> = ["--nproc-per-node", "--rdzv-conf", "--exclude"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(f, want);
    let mut h = BTreeSet::new();
    help_flags(
        "  -r, --redirects <SPEC>\n          text [env: X=] [aliases:\n          --a_b, --c]\n      --tee=<X>\n",
        &mut h,
    );
    let want: BTreeSet<String> = ["--redirects", "--a-b", "--c", "--tee"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(h, want);
    let b = Block {
        lang: "sh".into(),
        lines: vec![
            "# a comment".into(),
            "nrun -H 'a#b' --nproc 2 x  # a note".into(),
            "nrun --a \\".into(),
            "  --b".into(),
        ],
        at: 1,
    };
    let want = [
        ("nrun -H 'a#b' --nproc 2 x".to_string(), 0),
        ("nrun --a --b".to_string(), 0),
    ];
    assert_eq!(commands(&b), want);
    assert_eq!(
        strip_comment("nrun x  # exits 139: SIGSEGV"),
        ("nrun x".into(), 139)
    );
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    blocks(text)
        .1
        .iter()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| slug(l.trim_start_matches('#')))
        .collect()
}

/// The `](target)` links of a text's prose.
fn links(text: &str) -> Vec<String> {
    let prose = blocks(text).1.join("\n");
    prose
        .split("](")
        .skip(1)
        .filter_map(|s| s.split(')').next())
        .map(String::from)
        .collect()
}

#[test]
fn every_link_leads_to_a_file_and_heading() {
    let mut bad = Vec::new();
    for (path, text) in documents() {
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                path.clone()
            } else {
                path.parent().unwrap().join(file)
            };
            if !target.exists() {
                bad.push(format!(
                    "{}: ({link}): no file {}",
                    name(&path),
                    target.display()
                ));
                continue;
            }
            if !anchor.is_empty() {
                let t = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&t).contains(anchor) {
                    bad.push(format!(
                        "{}: ({link}): no heading #{anchor} there",
                        name(&path)
                    ));
                }
            }
        }
    }
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

#[test]
fn every_script_named_exists() {
    let mut bad = Vec::new();
    for (path, text) in documents() {
        for part in text.split("scripts/").skip(1) {
            let file: String = part
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
                .collect();
            let file = file.trim_end_matches('.');
            let p = root().join("scripts").join(file);
            let ok = std::fs::metadata(&p).is_ok_and(|m| {
                m.is_dir() || std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
            });
            if !ok {
                bad.push(format!("{}: scripts/{file}", name(&path)));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "the docs name scripts that are not there (or not executable):\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_fenced_block_names_its_language() {
    const LANGS: &[&str] = &["sh", "text", "yaml", "json", "python", "rust", "toml"];
    for (path, text) in documents() {
        for b in blocks(&text).0 {
            assert!(
                LANGS.contains(&b.lang.as_str()),
                "{}:{}: a fenced block's language is {:?}: `sh` for commands (this test runs \
                 them), `text` for output, or one of {LANGS:?}",
                name(&path),
                b.at,
                b.lang
            );
        }
    }
}

#[test]
fn readme_is_a_short_page_with_the_quick_start() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(
        readme.len() <= 15_000,
        "README.md is {} bytes; keep it a page a newcomer reads in 5 minutes (at most 15,000) \
         and move the detail into docs/",
        readme.len()
    );
    let quick: Vec<String> = all_commands()
        .into_iter()
        .filter(|(at, _, _)| at.starts_with("README.md"))
        .map(|(_, c, _)| c)
        .collect();
    for c in ["scripts/demo.sh", "scripts/test.sh"] {
        assert!(
            quick.iter().any(|q| q == c),
            "README's quick start lacks {c}"
        );
    }
}

/// The table whose header starts with `| evidence | verdict |`, as lines.
fn verdicts(text: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| !l.starts_with("| evidence | verdict |"))
        .take_while(|l| l.starts_with('|'))
        .map(String::from)
        .collect()
}

#[test]
fn readme_s_fault_verdicts_are_the_fault_model_s() {
    let readme = verdicts(&std::fs::read_to_string(root().join("README.md")).unwrap());
    let doc = verdicts(&std::fs::read_to_string(root().join("docs/fault-model.md")).unwrap());
    assert!(readme.len() > 2, "README has no table of verdicts");
    assert_eq!(
        readme, doc,
        "README's verdicts differ from docs/fault-model.md's"
    );
}

#[test]
fn what_the_docs_say_is_refused_is_refused() {
    let all: String = documents()
        .into_iter()
        .map(|(_, t)| t)
        .collect::<Vec<_>>()
        .join("\n");
    let flat = all.split_whitespace().collect::<Vec<_>>().join(" ");
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus").is_ok_and(|mut d| d.next().is_some());
    let dir = tempfile::tempdir().unwrap();
    for (phrase, args, code, error, needs_no_gpu) in REFUSED {
        assert!(
            flat.contains(phrase),
            "the docs no longer say {phrase:?}: update REFUSED"
        );
        if *needs_no_gpu && gpus {
            eprintln!("skipped (a GPU is visible): nrun {args:?}");
            continue;
        }
        let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        let out = shell(&format!("nrun {}", quoted.join(" ")), dir.path())
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(*code),
            "nrun {args:?}: {}",
            said(&out)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(error),
            "nrun {args:?} does not say {error:?}: {}",
            said(&out)
        );
    }
}
