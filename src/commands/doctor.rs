//! `nrun doctor`: what each node has and whether the nodes are ready, running nothing. On this
//! host alone: its facts, interfaces, NCCL libraries and torch in detail. With nodes: they join
//! and are checked exactly as for a job (interfaces, versions, node-to-node reachability).
//! Ready also means the python a job would run imports torch on every node (torch missing is
//! not ready: exit 95), unless `--no-python-probe` says not to look.

use crate::facts::Facts;
use crate::plan::{DoctorSettings, NodesPlan};
use crate::session::Session;
use nrun_base::error::{Result, exit};

pub(crate) async fn run(
    doctor: &DoctorSettings,
    nodes: &NodesPlan,
    listener: Option<std::net::TcpListener>,
) -> Result<u8> {
    let mut s = Session::start(&doctor.session, nodes, listener).await?;
    let python = doctor.session.python.as_deref();
    let code = if s.in_process() {
        this_host(&mut s, python).await
    } else {
        cluster(&mut s, python).await
    };
    s.end().await;
    Ok(code)
}

/// Why the python a job would run is not usable on a node (None: it is, or nobody asked).
fn python_not_ready(
    facts: Option<&Facts>,
    python: Option<&std::path::Path>,
    probed: bool,
) -> Option<String> {
    // --no-python-probe: a job that runs no Python; nothing to judge.
    if !probed {
        return None;
    }
    let Some(py) = python else {
        return Some(
            "no python found to run a job (python3 on PATH, $PYTHON_EXEC or --python)".into(),
        );
    };
    let f = facts?;
    if f.torch.is_some() {
        return None;
    }
    Some(format!(
        "{} has no usable torch ({}): pass --python PATH (or set PYTHON_EXEC) to the python of \
         your torch environment, or install torch there",
        py.display(),
        f.torch_error.as_deref().unwrap_or("not found")
    ))
}

async fn cluster(s: &mut Session, python: Option<&std::path::Path>) -> u8 {
    if let Err(e) = super::run::ready(s, None).await {
        return e.code;
    }
    let not_ready: Vec<String> = s
        .joined()
        .filter_map(|(_, n, j)| {
            python_not_ready(j.facts.as_ref(), python, s.plan.python_probe)
                .map(|why| format!("{}: {why}", n.label))
        })
        .collect();
    use std::fmt::Write as _;
    let mut out = String::new();
    for (_, n, j) in s.joined() {
        // How its agent chose that address (none for the launch host's own in-process node).
        let how = j.link.as_ref().map_or(String::new(), |l| {
            format!(", the address {}", l.chosen.words())
        });
        let _ = writeln!(
            out,
            "{}: NCCL_SOCKET_IFNAME would be =={} (it reached the launch host at {}{how})",
            n.label,
            j.ifname.as_deref().unwrap_or("?"),
            j.master_addr
        );
    }
    if not_ready.is_empty() {
        let _ = writeln!(
            out,
            "doctor: {} nodes joined, checked and reach each other",
            s.len()
        );
    }
    nrun_base::stdout(out);
    if !not_ready.is_empty() {
        eprintln!(
            "nrun: error: not ready: {} of {} nodes cannot run a Python job:",
            not_ready.len(),
            s.len()
        );
        for l in &not_ready {
            eprintln!("  {l}");
        }
        return exit::CLUSTER;
    }
    exit::SUCCESS
}

async fn this_host(s: &mut Session, python: Option<&std::path::Path>) -> u8 {
    let probe = python.filter(|_| s.plan.python_probe).map(Into::into);
    if let Err(e) = s.join(true, probe).await {
        return e.code;
    }
    let facts = s
        .nodes
        .first()
        .and_then(|n| n.joined.as_ref())
        .and_then(|j| j.facts.clone())
        .unwrap_or_default();
    let mut out = describe(&facts, python);
    if let Some(w) = crate::plan::env::port_range_warning(&s.plan.env) {
        out.push_str(&format!("warning: {w}\n"));
    }
    nrun_base::stdout(out);
    if let Some(why) = python_not_ready(Some(&facts), python, s.plan.python_probe) {
        eprintln!("nrun: error: not ready: {why}");
        return exit::CLUSTER;
    }
    exit::SUCCESS
}

/// This host's facts, in detail.
fn describe(f: &Facts, python: Option<&std::path::Path>) -> String {
    use std::fmt::Write as _;
    let mut t = crate::facts::compare(&[("this host".to_string(), f)]).table;
    let _ = writeln!(t, "interfaces:");
    for i in &f.ifaces {
        let addrs: Vec<String> = i.addrs.iter().map(|a| a.to_string()).collect();
        let _ = writeln!(
            t,
            "  {:<12} {:<4} mtu {:<6} {}",
            i.name,
            if i.up { "up" } else { "down" },
            i.mtu.map_or("?".into(), |m| m.to_string()),
            addrs.join(" ")
        );
    }
    if !f.gpu_health.is_empty() {
        let _ = writeln!(t, "GPU health (NVML):");
        for (bus, h) in &f.gpu_health {
            let _ = writeln!(t, "  {bus:<16} {}", h.describe());
            for p in h.problems() {
                let _ = writeln!(t, "    problem ({}): {}", p.check, p.what);
            }
        }
    }
    let _ = writeln!(
        t,
        "NCCL libraries (the first is what a job here would load):"
    );
    if f.nccl.is_empty() {
        let _ = writeln!(
            t,
            "  none found (torch's site-packages, LD_LIBRARY_PATH, ldconfig)"
        );
    }
    for l in &f.nccl {
        let _ = writeln!(
            t,
            "  {} {} ({})",
            l.version.as_deref().unwrap_or("?"),
            l.path,
            l.source
        );
    }
    let _ = match (&f.torch, &f.torch_error) {
        (Some(v), _) => writeln!(
            t,
            "torch {v} (CUDA {}, NCCL {})",
            f.torch_cuda.as_deref().unwrap_or("-"),
            f.torch_nccl.as_deref().unwrap_or("-")
        ),
        (None, Some(e)) => writeln!(
            t,
            "torch: not usable with {}: {e}",
            python.map_or("python3".into(), |p| p.display().to_string())
        ),
        (None, None) => writeln!(t, "torch: not probed (no python found)"),
    };
    t
}
