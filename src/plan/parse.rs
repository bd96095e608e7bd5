//! Flag values that need more than clap: sizes, durations, worker and node counts, rank sets,
//! the console prefix template, signal lists, `--stdin`. Each refuses a bad value with a usage
//! error naming the flag and what it takes.

use std::collections::BTreeSet;
use std::time::Duration;

use nrun_base::error::{Error, Result};

/// GPUs this process may use: the NVIDIA driver's device list, narrowed by CUDA_VISIBLE_DEVICES.
/// Read from /proc so that counting needs neither CUDA nor Python.
pub(super) fn visible_gpus(env: &dyn Fn(&str) -> Option<String>) -> usize {
    let present = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    match env("CUDA_VISIBLE_DEVICES") {
        None => present,
        // CUDA stops at the first entry it cannot parse; -1 hides every device.
        Some(v) => v
            .split(',')
            .map(str::trim)
            .take_while(|s| !s.is_empty() && !s.starts_with('-'))
            .count()
            .min(present),
    }
}

/// A size like 4G, 512M, 64K or 1000000 (bytes), at least 1 MiB.
pub(super) fn parse_bytes(flag: &str, s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mul) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        Some('T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    match num.parse::<u64>().ok().and_then(|n| n.checked_mul(mul)) {
        Some(n) if n >= 1 << 20 => Ok(n),
        _ => Err(Error::usage(format!(
            "{flag} {s:?}: expected a size of at least 1M, like 4G or 512M"
        ))),
    }
}

/// Longest duration a flag takes (about 3 years): deadlines computed from it cannot overflow.
pub(super) const MAX_SECS: f64 = 1e8;

pub(super) fn positive_secs(flag: &str, v: f64, zero_ok: bool) -> Result<Duration> {
    if v.is_finite()
        && v <= MAX_SECS
        && (v > 0.0 || (zero_ok && v == 0.0))
        && let Ok(d) = Duration::try_from_secs_f64(v)
    {
        return Ok(d);
    }
    let what = if zero_ok { "non-negative" } else { "positive" };
    Err(Error::usage(format!(
        "{flag} {v} must be a {what} number of seconds, at most {MAX_SECS:.0}"
    )))
}

/// Most workers one node runs: far above any machine's GPUs or useful CPU workers, and low
/// enough that a typo (`--nproc 100000`) is refused before anything is spawned.
const MAX_NPROC: usize = 4096;

/// The soft limit on this user's processes (`ulimit -u`), where there is one and the kernel
/// enforces it (not for root).
fn process_limit() -> Option<u64> {
    // SAFETY: a plain syscall.
    if unsafe { libc::geteuid() } == 0 {
        return None;
    }
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a plain syscall on a local struct.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut l) } == 0;
    (ok && l.rlim_cur != libc::RLIM_INFINITY).then_some(l.rlim_cur)
}

/// `--nproc-per-node`: the count, at most [`MAX_NPROC`] and at most what this machine's process
/// limit lets one user run.
pub(super) fn resolve_nproc(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let n = resolve_nproc_value(s, env)?;
    check_nproc(n, process_limit())
}

fn check_nproc(n: usize, process_limit: Option<u64>) -> Result<usize> {
    if n > MAX_NPROC {
        return Err(Error::usage(format!(
            "--nproc-per-node {n}: at most {MAX_NPROC} workers per node; use more nodes for more \
             workers"
        )));
    }
    if let Some(limit) = process_limit.filter(|l| n as u64 > *l) {
        return Err(Error::usage(format!(
            "--nproc-per-node {n}: this machine lets this user run at most {limit} processes \
             (ulimit -u); ask for fewer workers or raise the limit"
        )));
    }
    Ok(n)
}

fn resolve_nproc_value(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let cpus = || std::thread::available_parallelism().map_or(1, |n| n.get());
    match s {
        "cpu" => Ok(cpus()),
        "gpu" => match visible_gpus(env) {
            0 => Err(Error::usage(
                "--nproc-per-node gpu: no GPU is visible here (no /proc/driver/nvidia/gpus entries, \
                 or CUDA_VISIBLE_DEVICES hides them); pass a number or `cpu`",
            )),
            n => Ok(n),
        },
        "auto" => Ok(match visible_gpus(env) {
            0 => cpus(),
            n => n,
        }),
        _ => match s.parse::<usize>() {
            Ok(0) => Err(Error::usage(
                "--nproc-per-node 0: at least one worker is needed",
            )),
            Err(_) if s.starts_with('-') => Err(Error::usage(format!(
                "--nproc-per-node {s}: at least one worker is needed"
            ))),
            Ok(n) => Ok(n),
            Err(_) => Err(Error::usage(format!(
                "--nproc-per-node {s:?} is not a number, `gpu`, `cpu` or `auto`"
            ))),
        },
    }
}

/// `--nnodes N` or torchrun's elastic `MIN:MAX`: (MIN, MAX).
pub(super) fn parse_nnodes(s: &str) -> Result<(usize, usize)> {
    let bad = || {
        Error::usage(format!(
            "--nnodes {s:?} must be N or MIN:MAX with 1 <= MIN <= MAX"
        ))
    };
    let (lo, hi) = match s.split_once(':') {
        Some((a, b)) => (
            a.trim().parse::<usize>().map_err(|_| bad())?,
            b.trim().parse::<usize>().map_err(|_| bad())?,
        ),
        None => {
            let n = s.trim().parse::<usize>().map_err(|_| bad())?;
            (n, n)
        }
    };
    if lo == 0 || lo > hi {
        return Err(bad());
    }
    // c10d and static launches lay out every node up front: bounded as a host list is.
    if hi > crate::hosts::MAX_HOSTS {
        return Err(Error::usage(format!(
            "--nnodes {s:?}: at most {} nodes",
            crate::hosts::MAX_HOSTS
        )));
    }
    Ok((lo, hi))
}

pub(super) fn parse_rank_set(s: &str, nproc: usize) -> Result<BTreeSet<usize>> {
    let mut set = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.parse::<usize>() {
            Ok(r) if r < nproc => {
                set.insert(r);
            }
            _ => {
                return Err(Error::usage(format!(
                    "--local-ranks-filter {s:?}: {part:?} is not a local rank in 0..{nproc}"
                )));
            }
        }
    }
    Ok(set)
}

/// The fields `--log-line-prefix-template` may name.
const PREFIX_FIELDS: [&str; 4] = ["rank", "local_rank", "role_name", "host"];

/// `--log-line-prefix-template`: every `${...}` must be one of [`PREFIX_FIELDS`] and closed.
pub(super) fn check_prefix_template(t: &str) -> Result<String> {
    let known = || {
        PREFIX_FIELDS
            .iter()
            .map(|f| format!("${{{f}}}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut rest = t;
    while let Some(at) = rest.find("${") {
        let after = &rest[at + 2..];
        let Some(end) = after.find('}') else {
            return Err(Error::usage(format!(
                "--log-line-prefix-template {t:?}: a '${{' is not closed by '}}'; the fields are {}",
                known()
            )));
        };
        let name = &after[..end];
        if !PREFIX_FIELDS.contains(&name) {
            return Err(Error::usage(format!(
                "--log-line-prefix-template {t:?}: unknown field ${{{name}}}; the fields are {}",
                known()
            )));
        }
        rest = &after[end + 1..];
    }
    Ok(t.to_string())
}

/// The stop signals: forwarded, then SIGKILL after the grace period, whatever the list says.
const STOP_SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// `--signals-to-handle SIGTERM,USR1,10`: the signals to pass on without stopping the job.
pub(super) fn parse_signals(s: &str) -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let upper = name.to_ascii_uppercase();
        let full = match upper.starts_with("SIG") {
            true => upper.clone(),
            false => format!("SIG{upper}"),
        };
        let sig = match name.parse::<i32>() {
            Ok(n) => nix::sys::signal::Signal::try_from(n).ok(),
            Err(_) => full.parse::<nix::sys::signal::Signal>().ok(),
        };
        let Some(sig) = sig else {
            return Err(Error::usage(format!(
                "--signals-to-handle: {name:?} is not a signal (names like SIGUSR1 or USR1, or \
                 numbers)"
            )));
        };
        let n = sig as i32;
        if matches!(n, libc::SIGKILL | libc::SIGSTOP) {
            return Err(Error::usage(format!(
                "--signals-to-handle: {} cannot be caught, so it cannot be passed on",
                sig.as_str()
            )));
        }
        if !STOP_SIGNALS.contains(&n) && !out.contains(&n) {
            out.push(n);
        }
    }
    Ok(out)
}

/// `--stdin RANK|none`; by default local rank 0 of a single-node job gets a terminal or pipe.
pub(super) fn parse_stdin(s: Option<&str>, several_nodes: bool) -> Result<Option<usize>> {
    use std::io::IsTerminal;
    match s {
        Some("none") => Ok(None),
        Some(r) => {
            let rank = r.parse::<usize>().map_err(|_| {
                Error::usage(format!(
                    "--stdin {r:?}: expected a rank (0, 1, ...) or none"
                ))
            })?;
            if several_nodes {
                return Err(Error::usage(
                    "--stdin: nrun passes its stdin to a rank of a single-node job only (pdb on \
                     a remote node: use a remote debugger such as `python -m remote_pdb`)",
                ));
            }
            Ok(Some(rank))
        }
        None if several_nodes => Ok(None),
        None => {
            let stdin = std::io::stdin();
            // A pipe or a file given with `<`; not /dev/null (a character device, as a tty).
            let data = nix::sys::stat::fstat(libc::STDIN_FILENO)
                .is_ok_and(|st| matches!(st.st_mode & libc::S_IFMT, libc::S_IFIFO | libc::S_IFREG));
            Ok((stdin.is_terminal() || data).then_some(0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nproc_values() {
        let env = |_: &str| None;
        assert_eq!(resolve_nproc("8", &env).unwrap(), 8);
        assert!(
            resolve_nproc("0", &env)
                .unwrap_err()
                .message
                .contains("at least one")
        );
        assert!(resolve_nproc("x", &env).is_err());
        assert!(resolve_nproc("cpu", &env).unwrap() >= 1);
        let hidden = |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(|| "-1".to_string());
        assert_eq!(visible_gpus(&hidden), 0);
    }

    #[test]
    fn nnodes_values() {
        assert_eq!(parse_nnodes("2").unwrap(), (2, 2));
        assert_eq!(parse_nnodes("3:3").unwrap(), (3, 3));
        assert_eq!(parse_nnodes("1:4").unwrap(), (1, 4));
        assert!(parse_nnodes("3:2").is_err());
        assert!(parse_nnodes("0").is_err());
        assert!(parse_nnodes("0:2").is_err());
    }

    #[test]
    fn nnodes_is_bounded() {
        assert_eq!(parse_nnodes("16384").unwrap(), (16384, 16384));
        assert!(parse_nnodes("16385").is_err());
        assert!(parse_nnodes("1:99999999999").is_err());
        assert!(parse_nnodes("18446744073709551616").is_err());
    }

    #[test]
    fn nproc_is_bounded() {
        assert_eq!(check_nproc(MAX_NPROC, None).unwrap(), MAX_NPROC);
        let e = check_nproc(MAX_NPROC + 1, None).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
        assert!(
            e.message.contains("at most 4096 workers per node"),
            "{}",
            e.message
        );
        let e = check_nproc(100, Some(50)).unwrap_err();
        assert!(
            e.message.contains("at most 50 processes (ulimit -u)"),
            "{}",
            e.message
        );
        assert_eq!(check_nproc(50, Some(50)).unwrap(), 50);
        let e = resolve_nproc("100000", &|_| None).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
    }

    #[test]
    fn prefix_template_fields() {
        for good in [
            "",
            "[${rank}]",
            "${local_rank}/${role_name}@${host}: ",
            "$rank {x} $ {",
        ] {
            assert_eq!(check_prefix_template(good).unwrap(), good);
        }
        for bad in ["${nope}", "${rank", "${}", "${ rank}", "a${rank}${RANK}"] {
            let e = check_prefix_template(bad).unwrap_err();
            assert!(
                e.message.contains("${local_rank}, ${role_name}, ${host}"),
                "{}",
                e.message
            );
        }
    }
}
