//! What a node reports about itself, and the comparison across nodes.
//!
//! Everything is read from the node's own files (/proc, /sys, /etc) and libraries, plus one
//! optional probe of the target Python for torch's versions. The comparison prints one compact
//! table and names what differs; NCCL major.minor or torch differing refuses the launch unless
//! the user allows it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use nrun_base::net::Iface;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NcclLib {
    pub path: String,
    pub version: Option<String>,
    /// --nccl-lib, torch's, LD_LIBRARY_PATH or system.
    pub source: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Facts {
    /// A label, not an identity: cloned VMs and containers share one ([`Facts::machine`]).
    pub hostname: String,
    /// Which machine and network stack this is, as the kernel says: its boot id and its
    /// network namespace ("<boot id>/net:[<inode>]"). Two nodes are one machine only when
    /// these are equal (empty: unknown, an older nrun).
    #[serde(default)]
    pub machine: String,
    pub os: String,
    pub ifaces: Vec<Iface>,
    pub gpus: Vec<String>,
    pub driver: Option<String>,
    pub nccl: Vec<NcclLib>,
    /// torch version, its CUDA and NCCL versions, from the target Python (None: not probed or
    /// no torch there; `torch_error` says which).
    pub torch: Option<String>,
    pub torch_cuda: Option<String>,
    pub torch_nccl: Option<String>,
    pub torch_error: Option<String>,
    pub nrun: String,
    /// Each GPU's PCI bus id and health, from NVML (empty without it).
    #[serde(default)]
    pub gpu_health: Vec<(String, nrun_preflight::hardware::Health)>,
    /// The workers this node's own nrun was asked for (c10d: each node its own command line
    /// and --nproc-per-node, as torchrun's); None where the launch host decides.
    #[serde(default)]
    pub own: Option<OwnWork>,
}

/// One node's own worker count and command line (c10d).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnWork {
    pub nproc: usize,
    /// The program and its arguments, as the workers run them.
    pub command: Vec<String>,
}

/// Whether [`gather`] only reads files and netlink (no Python probe, no GPU driver whose NVML
/// and NCCL copies it would load and run), so that a caller may do it on its own thread.
pub fn quick(python: Option<&Path>) -> bool {
    python.is_none() && !gpu_driver() && ld_library_path().is_none()
}

/// NVIDIA's kernel driver is loaded: NVML can answer, and NCCL could load.
fn gpu_driver() -> bool {
    std::path::Path::new("/proc/driver/nvidia/gpus").exists()
}

/// Where the dynamic loader looks first, if set.
fn ld_library_path() -> Option<String> {
    std::env::var("LD_LIBRARY_PATH")
        .ok()
        .filter(|v| !v.is_empty())
}

/// This machine and network stack as the kernel names them ([`Facts::machine`]); empty where
/// either cannot be read.
pub fn machine() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net").unwrap_or_default();
    match (boot.trim(), netns.to_string_lossy()) {
        ("", _) => String::new(),
        (_, n) if n.is_empty() => String::new(),
        (b, n) => format!("{b}/{n}"),
    }
}

/// This machine as [`machine`] names it, else (unreadable) its host name: the key under which
/// a host left out is refused when its nrun comes back (c10d).
pub fn machine_or_hostname() -> String {
    let m = machine();
    match m.is_empty() {
        true => nrun_base::net::hostname(),
        false => m,
    }
}

/// Gathers this node's facts. `python`: the interpreter to probe for torch (None: skip).
pub fn gather(python: Option<&Path>) -> Facts {
    let mut f = Facts {
        hostname: nrun_base::net::hostname(),
        machine: machine(),
        os: os_name(),
        ifaces: nrun_base::net::interfaces(),
        nrun: nrun_base::VERSION.to_string(),
        ..Facts::default()
    };
    // NVML only where the driver is: loading it elsewhere is a wasted search.
    let driver = gpu_driver();
    if driver {
        f.gpu_health = nrun_preflight::hardware::all_gpus().unwrap_or_default();
    }
    if let Ok(rd) = std::fs::read_dir("/proc/driver/nvidia/gpus") {
        let mut gpus: Vec<String> = rd
            .flatten()
            .map(|e| {
                std::fs::read_to_string(e.path().join("information"))
                    .ok()
                    .and_then(|t| {
                        t.lines()
                            .find_map(|l| l.strip_prefix("Model:").map(|m| m.trim().to_string()))
                    })
                    .unwrap_or_else(|| "NVIDIA GPU".into())
            })
            .collect();
        gpus.sort();
        f.gpus = gpus;
    }
    f.driver = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|t| {
            // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu ..."
            t.lines()
                .next()?
                .split_whitespace()
                .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
                .map(String::from)
        });
    let python_paths = python
        .map(nrun_preflight::nccl::python_package_dirs)
        .unwrap_or_default();
    let ld = ld_library_path();
    let exe = std::env::current_exe().ok();
    // The system's copies (an `ldconfig -p` run, most of an agent's start) only where a driver
    // could load one: NCCL needs GPUs.
    for c in nrun_preflight::nccl::candidates(None, &python_paths, ld.as_deref(), driver) {
        let version = exe.as_ref().and_then(|exe| {
            std::process::Command::new(exe)
                .arg("__nccl-version")
                .arg(&c.path)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        });
        f.nccl.push(NcclLib {
            path: c.path.display().to_string(),
            version,
            source: c.source.describe().to_string(),
        });
    }
    if let Some(py) = python {
        probe_torch(py, &mut f);
    }
    f
}

fn os_name() -> String {
    std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("PRETTY_NAME=")
                    .map(|v| v.trim_matches('"').to_string())
            })
        })
        .unwrap_or_else(|| "Linux".into())
}

fn probe_torch(python: &Path, f: &mut Facts) {
    let code = "import torch, torch.cuda.nccl as n\n\
                v = '.'.join(map(str, n.version())) if torch.version.cuda else ''\n\
                print(torch.__version__); print(torch.version.cuda or ''); print(v)";
    match std::process::Command::new(python)
        .args(["-c", code])
        .output()
    {
        Ok(o) if o.status.success() => {
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            let mut l = out.lines();
            f.torch = l.next().map(String::from);
            f.torch_cuda = l.next().filter(|s| !s.is_empty()).map(String::from);
            f.torch_nccl = l.next().filter(|s| !s.is_empty()).map(String::from);
        }
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            f.torch_error = Some(err.lines().last().unwrap_or("python failed").to_string());
        }
        Err(e) => f.torch_error = Some(format!("cannot run {}: {e}", python.display())),
    }
}

/// The columns of the facts table, as (header, value per node).
fn columns(nodes: &[(String, &Facts)]) -> Vec<(&'static str, Vec<String>)> {
    let col = |f: &dyn Fn(&Facts) -> String| nodes.iter().map(|(_, x)| f(x)).collect::<Vec<_>>();
    let mut cols = vec![
        ("host", nodes.iter().map(|(h, _)| h.clone()).collect()),
        ("hostname", col(&|f| f.hostname.clone())),
        ("os", col(&|f| f.os.clone())),
        ("gpus", col(&|f| gpu_summary(&f.gpus))),
        ("gpu health", col(&health_summary)),
        (
            "driver",
            col(&|f| f.driver.clone().unwrap_or_else(|| "-".into())),
        ),
        (
            "nccl (used)",
            col(&|f| {
                f.nccl.first().map_or("-".into(), |n| {
                    n.version.clone().unwrap_or_else(|| "?".into())
                })
            }),
        ),
        (
            "torch",
            col(&|f| f.torch.clone().unwrap_or_else(|| "-".into())),
        ),
        (
            "torch cuda/nccl",
            col(&|f| {
                format!(
                    "{}/{}",
                    f.torch_cuda.as_deref().unwrap_or("-"),
                    f.torch_nccl.as_deref().unwrap_or("-")
                )
            }),
        ),
        (
            "nrun",
            col(&|f| f.nrun.split_whitespace().next().unwrap_or("?").to_string()),
        ),
    ];
    if nodes.iter().any(|(_, f)| f.own.is_some()) {
        let own = |f: &dyn Fn(&OwnWork) -> String| {
            nodes
                .iter()
                .map(|(_, x)| x.own.as_ref().map_or("-".into(), f))
                .collect::<Vec<_>>()
        };
        cols.push(("workers", own(&|o| o.nproc.to_string())));
        cols.push(("command", own(&|o| o.command.join(" "))));
    }
    cols
}

/// Columns whose values may differ between nodes without a word (torchrun allows each node its
/// own worker count and command line; differing commands get a note of their own).
const PER_NODE: [&str; 2] = ["workers", "command"];

/// "ok", "-" (no NVML) or what is wrong, by check: "ecc on 1 GPU".
fn health_summary(f: &Facts) -> String {
    if f.gpu_health.is_empty() {
        return "-".into();
    }
    let mut checks: std::collections::BTreeMap<&str, usize> = Default::default();
    for (_, h) in &f.gpu_health {
        for p in h.problems() {
            *checks.entry(p.check.name()).or_default() += 1;
        }
    }
    if checks.is_empty() {
        return "ok".into();
    }
    checks
        .iter()
        .map(|(c, n)| format!("{c} on {n} GPU{}", if *n == 1 { "" } else { "s" }))
        .collect::<Vec<_>>()
        .join(", ")
}

fn gpu_summary(g: &[String]) -> String {
    if g.is_empty() {
        return "0".into();
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for m in g {
        *counts.entry(m.as_str()).or_default() += 1;
    }
    counts
        .iter()
        .map(|(m, n)| format!("{n}x {m}"))
        .collect::<Vec<_>>()
        .join("+")
}

fn major_minor(v: &str) -> String {
    v.split('.').take(2).collect::<Vec<_>>().join(".")
}

/// What must agree between nodes for a job to run: NCCL major.minor and torch ("?" unknown).
pub fn compat_key(f: &Facts) -> String {
    let nccl = f
        .nccl
        .first()
        .and_then(|n| n.version.as_deref())
        .map_or("?".to_string(), major_minor);
    format!("NCCL {nccl}, torch {}", f.torch.as_deref().unwrap_or("?"))
}

/// Indices whose key differs from the one a strict majority shares (none without one).
fn outliers(keys: &[String]) -> Vec<usize> {
    let mut counts: std::collections::BTreeMap<&str, usize> = Default::default();
    for k in keys {
        *counts.entry(k).or_default() += 1;
    }
    match counts.iter().find(|(_, c)| **c * 2 > keys.len()) {
        Some((major, _)) => (0..keys.len()).filter(|i| keys[*i] != *major).collect(),
        None => Vec::new(),
    }
}

/// The table, what differs between nodes, and whether that must refuse the launch.
pub struct Comparison {
    pub table: String,
    pub differences: Vec<String>,
    pub refuse: bool,
    /// Nodes (indices into the compared list) whose NCCL/torch differ from the majority's.
    pub odd: Vec<usize>,
    /// Said once, not warned: the nodes run different commands (torchrun allows it).
    pub notes: Vec<String>,
}

pub fn compare(nodes: &[(String, &Facts)]) -> Comparison {
    let cols = columns(nodes);
    let mut t = String::new();
    let widths: Vec<usize> = cols
        .iter()
        .map(|(h, v)| {
            v.iter()
                .map(|s| s.len())
                .chain([h.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let _ = write!(t, " ");
    for ((h, _), w) in cols.iter().zip(&widths) {
        let _ = write!(t, " {h:<w$}");
    }
    let _ = writeln!(t);
    for i in 0..nodes.len() {
        let _ = write!(t, " ");
        for ((_, v), w) in cols.iter().zip(&widths) {
            let _ = write!(t, " {:<w$}", v[i]);
        }
        let _ = writeln!(t);
    }
    let mut differences = Vec::new();
    let mut refuse = false;
    let mut notes = Vec::new();
    for (h, v) in cols.iter().skip(2) {
        let distinct: std::collections::BTreeSet<&String> = v.iter().collect();
        if distinct.len() > 1 {
            let groups: Vec<String> = distinct
                .iter()
                .map(|val| {
                    let who: Vec<&str> = nodes
                        .iter()
                        .zip(v)
                        .filter(|(_, x)| x == val)
                        .map(|((n, _), _)| n.as_str())
                        .collect();
                    format!("{val} on {}", who.join(","))
                })
                .collect();
            match PER_NODE.contains(h) {
                true if *h == "command" => notes.push(format!(
                    "the nodes run different commands (each its own, as torchrun allows): {}",
                    groups.join("; ")
                )),
                true => {}
                false => differences.push(format!("{h} differs: {}", groups.join("; "))),
            }
        }
    }
    // NCCL major.minor and torch must agree; patch-level NCCL differences only warn.
    let nccl: std::collections::BTreeSet<String> = nodes
        .iter()
        .filter_map(|(_, f)| {
            f.nccl
                .first()
                .and_then(|n| n.version.as_deref())
                .map(major_minor)
        })
        .collect();
    let torch: std::collections::BTreeSet<&str> = nodes
        .iter()
        .filter_map(|(_, f)| f.torch.as_deref())
        .collect();
    if nccl.len() > 1 || torch.len() > 1 {
        refuse = true;
    }
    // The nodes that differ from a strict majority can be left out; without one, nobody is
    // to blame.
    let odd = match refuse {
        true => outliers(&nodes.iter().map(|(_, f)| compat_key(f)).collect::<Vec<_>>()),
        false => Vec::new(),
    };
    Comparison {
        table: t,
        differences,
        refuse,
        odd,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(nccl: &str, torch: &str) -> Facts {
        Facts {
            hostname: "h".into(),
            os: "Debian".into(),
            gpus: vec!["NVIDIA H200".into(); 2],
            nccl: vec![NcclLib {
                path: "/x".into(),
                version: Some(nccl.into()),
                source: "torch's".into(),
            }],
            torch: Some(torch.into()),
            nrun: "0.1.0 (x)".into(),
            ..Facts::default()
        }
    }

    #[test]
    fn compare_names_differences_and_refuses_on_nccl_minor() {
        let (a, b, c) = (
            f("2.28.9", "2.11.0"),
            f("2.28.3", "2.11.0"),
            f("2.27.3", "2.11.0"),
        );
        let same = compare(&[("a".into(), &a), ("b".into(), &a)]);
        assert!(
            same.differences.is_empty() && !same.refuse,
            "{:?}",
            same.differences
        );
        let patch = compare(&[("a".into(), &a), ("b".into(), &b)]);
        assert!(!patch.refuse);
        assert!(
            patch
                .differences
                .iter()
                .any(|d| d.contains("nccl (used) differs: 2.28.3 on b; 2.28.9 on a")),
            "{:?}",
            patch.differences
        );
        let minor = compare(&[("a".into(), &a), ("c".into(), &c)]);
        assert!(minor.refuse);
        let torch = compare(&[("a".into(), &a), ("d".into(), &f("2.28.9", "2.10.0"))]);
        assert!(torch.refuse);
        assert!(same.table.contains("2x NVIDIA H200"), "{}", same.table);
    }

    #[test]
    fn this_hosts_facts() {
        let f = gather(None);
        assert!(!f.hostname.is_empty() && !f.ifaces.is_empty());
    }
}
