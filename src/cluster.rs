//! Multi-node runs: the coordinator's side. Phases as in design.md:
//! join (start agents, collect what each node reports) -> check (interfaces, NAT, facts across
//! nodes, node-to-node reachability) -> preflight -> run -> end. Every remote node runs
//! `nrun __agent` (see `agent.rs`), driven through numbered steps in the store.

use std::collections::VecDeque;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin};

use crate::agent::{self, Hello, Joined, RunResult, Step, StepResult, WorkerSpec};
use crate::error::{Error, Result, exit};
use crate::hosts::Host;
use crate::net;
use crate::node::Signals;
use crate::plan::{Place, Plan, WorkerSlot};
use crate::remote::{self, Launcher};
use crate::store::{self, Store};

/// Everything about the nodes, decided before anything starts.
#[derive(Clone, Debug)]
pub struct ClusterPlan {
    pub hosts: Vec<Host>,
    /// Per node: (global rank, local rank, slot).
    pub layout: Vec<Vec<(usize, usize, usize)>>,
    pub launcher: Launcher,
    pub ssh_opts: Vec<String>,
    pub ssh_concurrency: usize,
    pub ship: bool,
    /// Variables every worker on every node gets (forwarded, -x, .nrun_env).
    pub env: Vec<(String, String)>,
    pub ifname: Option<String>,
    pub join_timeout: Duration,
    pub allow_mismatch: bool,
    pub python_probe: bool,
    pub remote_nrun: String,
    /// `nrun doctor`: join, check, probe, report; run nothing.
    pub doctor: bool,
}

/// A node's agent and what nrun saw of it.
pub(crate) struct Node {
    pub(crate) label: String,
    pub(crate) child: Option<Child>,
    pub(crate) stdin: Option<ChildStdin>,
    pub(crate) stderr_tail: Arc<Mutex<VecDeque<String>>>,
    pub(crate) joined: Option<Joined>,
    /// The interface this node uses (NCCL_SOCKET_IFNAME), and the coordinator address it reached.
    pub(crate) ifname: String,
    pub(crate) master_addr: String,
    /// The address other nodes use to reach this one.
    pub(crate) addr: Option<IpAddr>,
    pub(crate) local: bool,
}

pub(crate) fn random_secret() -> String {
    let mut b = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut b);
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn tail_of(t: &Arc<Mutex<VecDeque<String>>>) -> Vec<String> {
    t.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .cloned()
        .collect()
}

/// Runs a multi-node job; returns nrun's exit code.
pub async fn run(plan: &Plan, cp: &ClusterPlan, listener: std::net::TcpListener) -> Result<u8> {
    let mut signals = Signals::install()?;
    crate::node::process::become_subreaper();
    let secret = random_secret();
    let run_id = format!("{}-{}", plan.run_id, std::process::id());
    let port = listener
        .local_addr()
        .map_err(|e| Error::internal(e.to_string()))?
        .port();
    let store = Store::with_secret(secret.clone().into_bytes());
    let l =
        tokio::net::TcpListener::from_std(listener).map_err(|e| Error::internal(e.to_string()))?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let served = store.clone();
    tokio::spawn(async move {
        store::server::serve(l, served, async {
            let _ = stop_rx.await;
        })
        .await
    });

    let addrs: Vec<String> = net::reachable_addrs(&net::interfaces())
        .into_iter()
        .map(|ip| SocketAddr::new(ip, port).to_string())
        .collect();
    let cwd = std::env::current_dir()
        .map_err(|e| Error::usage(format!("cannot read the current directory: {e}")))?;
    let mut nodes = start_agents(plan, cp, &secret, &run_id, &addrs, &cwd).await?;

    let mut step = 0usize;
    let code = drive(
        plan,
        cp,
        &store,
        &run_id,
        &secret,
        port,
        &mut nodes,
        &mut signals,
        &mut step,
    )
    .await;
    // The end: agents leave their step loop, then their ssh sessions close.
    for i in 0..nodes.len() {
        set_step(&store, &run_id, i, step, &Step::End);
    }
    end_agents(&mut nodes).await;
    let _ = stop_tx.send(());
    code
}

pub(crate) async fn start_agents(
    plan: &Plan,
    cp: &ClusterPlan,
    secret: &str,
    run_id: &str,
    addrs: &[String],
    cwd: &Path,
) -> Result<Vec<Node>> {
    let sem = Arc::new(tokio::sync::Semaphore::new(cp.ssh_concurrency.max(1)));
    let mut tasks = Vec::new();
    for (i, h) in cp.hosts.iter().enumerate() {
        let hello = Hello {
            secret: secret.to_string(),
            run: run_id.to_string(),
            node: i,
            label: h.name.clone(),
            // This machine's own node talks to the store over loopback: an address of some
            // other interface could go away under it (and buys nothing).
            addrs: if is_this_host(&h.name) {
                loopback_addrs(addrs)
            } else {
                addrs.to_vec()
            },
            cwd: cwd.to_path_buf(),
            version: crate::cli::VERSION.to_string(),
            python: if cp.python_probe {
                plan.python.clone()
            } else {
                None
            },
        };
        let (sem, cp, label) = (sem.clone(), cp.clone(), h.name.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            start_one(&cp, &label, &hello).await
        }));
    }
    let mut nodes = Vec::new();
    for t in tasks {
        nodes.push(t.await.map_err(|e| Error::internal(e.to_string()))??);
    }
    Ok(nodes)
}

async fn start_one(cp: &ClusterPlan, label: &str, hello: &Hello) -> Result<Node> {
    let mut remote_nrun = cp.remote_nrun.clone();
    if cp.ship && !is_this_host(label) {
        remote_nrun = ship(cp, label).await?;
    }
    let argv = if is_this_host(label) {
        // The launch host's own node needs no ssh: its agent is a child of nrun, spoken to the
        // same way (stdin, the store) so there is one code path.
        let exe = std::env::current_exe().map_err(|e| Error::internal(e.to_string()))?;
        vec![exe.into_os_string(), "__agent".into()]
    } else {
        match cp.launcher {
            Launcher::Ssh => remote::ssh_command(label, &cp.ssh_opts, &remote_nrun),
            Launcher::Srun => remote::srun_command(&[label.to_string()], &remote_nrun),
        }
    };
    let mut cmd = tokio::process::Command::new(&argv[0]);
    // Own process group: the terminal's Ctrl-C reaches nrun, which stops the job in order,
    // not ssh. PDEATHSIG: if nrun is killed outright, ssh goes too, the remote side sees its
    // stdin close and the agent stops its workers.
    cmd.args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::usage(format!("cannot run {}: {e}", argv[0].to_string_lossy())))?;
    let mut stdin = child.stdin.take();
    if let Some(s) = stdin.as_mut() {
        let line = serde_json::to_string(hello).map_err(|e| Error::internal(e.to_string()))? + "\n";
        let _ = s.write_all(line.as_bytes()).await;
    }
    let tail: Arc<Mutex<VecDeque<String>>> = Arc::new(Mutex::new(VecDeque::new()));
    // The agent prefixes its workers' lines; pass them on line by line.
    if let Some(out) = child.stdout.take() {
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(out).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let _ = writeln!(std::io::stdout().lock(), "{l}");
            }
        });
    }
    if let Some(err) = child.stderr.take() {
        let tail = tail.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(err).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let _ = writeln!(std::io::stderr().lock(), "{l}");
                let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                if t.len() == 10 {
                    t.pop_front();
                }
                t.push_back(l);
            }
        });
    }
    Ok(Node {
        label: label.to_string(),
        child: Some(child),
        stdin,
        stderr_tail: tail,
        joined: None,
        ifname: String::new(),
        master_addr: String::new(),
        addr: None,
        local: is_this_host(label),
    })
}

/// The loopback entries of the coordinator's address list (all of it, if it has none).
fn loopback_addrs(addrs: &[String]) -> Vec<String> {
    let lo: Vec<String> = addrs
        .iter()
        .filter(|a| a.parse::<SocketAddr>().is_ok_and(|s| s.ip().is_loopback()))
        .cloned()
        .collect();
    if lo.is_empty() { addrs.to_vec() } else { lo }
}

/// Whether a host name means this machine: localhost, a loopback address, this host's name,
/// or one of its addresses.
pub(crate) fn is_this_host(label: &str) -> bool {
    let name = label.rsplit('@').next().unwrap_or(label);
    if name == "localhost" {
        return true;
    }
    if let Ok(ip) = name.parse::<IpAddr>() {
        return ip.is_loopback()
            || net::interfaces().iter().any(|i| {
                i.addrs
                    .iter()
                    .any(|a| net::canonical(*a) == net::canonical(ip))
            });
    }
    let me = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    !me.is_empty() && (name == me || me.split('.').next() == Some(name))
}

/// Copies the running nrun to `~/.cache/nrun/nrun-<version>` on the host; returns that path.
async fn ship(cp: &ClusterPlan, label: &str) -> Result<String> {
    let exe = std::env::current_exe().map_err(|e| Error::internal(e.to_string()))?;
    let version = env!("CARGO_PKG_VERSION");
    let rev = env!("NRUN_GIT_REV");
    let path = format!("~/.cache/nrun/nrun-{version}-{rev}");
    // A per-copy temporary name: nodes that share a home directory must not race.
    let remote_cmd = format!(
        "mkdir -p ~/.cache/nrun && t={p}.tmp.$$ && cat > $t && chmod +x $t && mv -f $t {p}",
        p = path
    );
    let mut argv = remote::ssh_command(label, &cp.ssh_opts, "true");
    argv.pop();
    argv.push(remote_cmd.into());
    let bin = std::fs::File::open(&exe)
        .map_err(|e| Error::internal(format!("cannot read {}: {e}", exe.display())))?;
    let out = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::from(bin))
        .output()
        .await
        .map_err(|e| Error::usage(format!("cannot run ssh: {e}")))?;
    if !out.status.success() {
        return Err(Error::usage(format!(
            "--ship: copying nrun to {label} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(path)
}

pub(crate) async fn end_agents(nodes: &mut [Node]) {
    // Agents leave on the End step by themselves; stdin is closed only after that, so they do
    // not mistake the end for the launcher going away. Stragglers: stdin closed, then killed.
    wait_exits(nodes, Duration::from_secs(2)).await;
    for n in nodes.iter_mut() {
        n.stdin.take();
    }
    wait_exits(nodes, Duration::from_secs(3)).await;
    for n in nodes.iter_mut() {
        if let Some(c) = n.child.as_mut() {
            if c.try_wait().ok().flatten().is_none() {
                let _ = c.start_kill();
                let _ = c.wait().await;
            }
        }
    }
}

/// Waits until every agent's ssh has exited or `d` has passed.
async fn wait_exits(nodes: &mut [Node], d: Duration) {
    let deadline = tokio::time::Instant::now() + d;
    for n in nodes.iter_mut() {
        if let Some(c) = n.child.as_mut() {
            let _ = tokio::time::timeout_at(deadline, c.wait()).await;
        }
    }
}

/// Exit code when nodes cannot join or do not agree.
pub const CLUSTER_FAILED: u8 = exit::CLUSTER;

/// Decides each joined node's interface, its coordinator address and the address other nodes
/// reach it on; returns (problems, warnings).
pub(crate) fn assign_interfaces(
    cp: &ClusterPlan,
    store: &Store,
    run_id: &str,
    nodes: &mut [Node],
) -> Result<(Vec<String>, Vec<String>)> {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    for (i, n) in nodes.iter_mut().enumerate() {
        // Nodes that did not join (bisect goes on without them) have nothing to decide.
        let Some(j) = n.joined.as_ref() else { continue };
        let local: SocketAddr = j
            .local_addr
            .parse()
            .map_err(|_| Error::internal("bad local address"))?;
        let reached: SocketAddr = j
            .reached
            .parse()
            .map_err(|_| Error::internal("bad reached address"))?;
        let iface = net::owner(&j.facts.ifaces, local.ip());
        n.master_addr = net::canonical(reached.ip()).to_string();
        n.addr = Some(net::canonical(local.ip()));
        match (&cp.ifname, iface) {
            (Some(want), _) => {
                let ok = j.facts.ifaces.iter().any(|f| &f.name == want && f.up);
                if !ok {
                    problems.push(format!(
                        "--ifname {want}: no such interface up on {}",
                        n.label
                    ));
                }
                n.ifname = want.clone();
            }
            (None, Some(f)) => n.ifname = f.name.clone(),
            (None, None) => problems.push(format!(
                "{}: reached the launch host from {}, which no interface of the node holds",
                n.label,
                local.ip()
            )),
        }
        if let Some(seen) = store.get(
            &[
                store::server::OBSERVE_PREFIX,
                format!("{run_id}/{i}").as_bytes(),
            ]
            .concat(),
        ) {
            let seen = String::from_utf8_lossy(&seen).into_owned();
            let mine = net::canonical(local.ip()).to_string();
            if seen != mine {
                warnings.push(format!(
                    "{}: the launch host sees it connect from {seen} but it sent from {mine}: NAT or an asymmetric route between them; NCCL between nodes may not get through",
                    n.label
                ));
            }
        }
    }
    // The launch host's own node reached the store over whichever of its addresses answered
    // first; for the others it is the address they reached, on the interface holding it.
    let remote_reached = nodes
        .iter()
        .filter(|n| !n.local)
        .map(|n| n.master_addr.clone())
        .next();
    if let Some(ip) = remote_reached
        .as_ref()
        .and_then(|a| a.parse::<IpAddr>().ok())
    {
        for n in nodes.iter_mut().filter(|n| n.local) {
            let Some(j) = n.joined.as_ref() else { continue };
            let ifs = &j.facts.ifaces;
            if let Some(f) = net::owner(ifs, ip) {
                if cp.ifname.is_none() {
                    n.ifname = f.name.clone();
                }
                n.addr = Some(ip);
                n.master_addr = ip.to_string();
            }
        }
    }
    Ok((problems, warnings))
}

/// Waits until every agent joined, exited, or --join-timeout passed. Returns the nodes that
/// did not join, each with what ssh or the agent said. `Err`: interrupted (the exit code).
pub(crate) async fn join(
    cp: &ClusterPlan,
    store: &Store,
    run_id: &str,
    nodes: &mut [Node],
    signals: &mut Signals,
) -> std::result::Result<Vec<(usize, String)>, u8> {
    // ---- join ---------------------------------------------------------------------------
    let started = Instant::now();
    let k = nodes.len();
    let mut last_report = 0;
    // A progress bar where a person watches (stderr is a terminal), plain lines elsewhere.
    let bar = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
        let b = indicatif::ProgressBar::new(k as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "nrun: joining nodes {bar:30} {pos}/{len} {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    loop {
        let mut pending = 0;
        for (i, n) in nodes.iter_mut().enumerate() {
            if n.joined.is_some() {
                continue;
            }
            if let Some(raw) = store.get(&agent::key(run_id, &format!("n{i}/joined"))) {
                n.joined = serde_json::from_slice(&raw).ok();
                continue;
            }
            let exited = n
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
                .is_some();
            if !exited {
                pending += 1;
            }
        }
        let joined = nodes.iter().filter(|n| n.joined.is_some()).count();
        match &bar {
            Some(b) => b.set_position(joined as u64),
            None if joined != last_report
                && joined < k
                && started.elapsed() > Duration::from_secs(1) =>
            {
                tracing::info!("{joined}/{k} nodes joined");
                last_report = joined;
            }
            None => {}
        }
        if pending == 0 || started.elapsed() > cp.join_timeout {
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
            break;
        }
        // In-process checks of a few keys: polling every 2 ms costs nothing and keeps the
        // phases from waiting on a timer.
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(2)) => {}
            sig = signals.recv() => return Err(exit::signal(sig)),
        }
    }
    // Let stderr relays catch the last words of agents that exited.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut failures = Vec::new();
    for (i, n) in nodes.iter_mut().enumerate() {
        if n.joined.is_some() {
            continue;
        }
        let tail = tail_of(&n.stderr_tail);
        let said = tail.iter().rev().find(|l| !l.trim().is_empty()).cloned();
        let status = n.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        failures.push((i, match (status, said) {
            (Some(st), Some(said)) => format!("{}: {} (exit {})", n.label, said, st.code().map_or("signal".into(), |c| c.to_string())),
            (Some(st), None) => format!("{}: the agent exited ({st}) without a word; run `ssh {} nrun --version` to check nrun is installed there", n.label, n.label),
            (None, _) => format!(
                "{}: did not join within {} s (--join-timeout); ssh is still running: a slow host, or nrun hanging there",
                n.label,
                cp.join_timeout.as_secs()
            ),
        }));
    }
    tracing::info!(
        "{}/{k} nodes joined in {:.2} s",
        k - failures.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(failures)
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    plan: &Plan,
    cp: &ClusterPlan,
    store: &Arc<Store>,
    run_id: &str,
    secret: &str,
    port: u16,
    nodes: &mut [Node],
    signals: &mut Signals,
    step: &mut usize,
) -> Result<u8> {
    let k = nodes.len();
    let failures = match join(cp, store, run_id, nodes, signals).await {
        Ok(f) => f,
        Err(code) => return Ok(code),
    };
    let failures: Vec<String> = failures.into_iter().map(|(_, m)| m).collect();
    if !failures.is_empty() {
        eprintln!(
            "nrun: error: {} of {k} nodes could not join:",
            failures.len()
        );
        for f in &failures {
            eprintln!("  {f}");
        }
        eprintln!(
            "  hint: check each with `ssh {} <host> true` (BatchMode: keys, no prompts), and that nrun {} is on its PATH or pass --ship",
            cp.ssh_opts.join(" "),
            env!("CARGO_PKG_VERSION")
        );
        return Ok(CLUSTER_FAILED);
    }

    // ---- check --------------------------------------------------------------------------
    let (mut problems, mut warnings) = assign_interfaces(cp, store, run_id, nodes)?;
    let user_ifname = cp
        .env
        .iter()
        .find(|(k, _)| k == "NCCL_SOCKET_IFNAME")
        .map(|(_, v)| v.clone());
    if let Some(v) = &user_ifname {
        for n in nodes.iter() {
            let ifs = &n.joined.as_ref().expect("joined").facts.ifaces;
            if !ifname_matches_any(v, ifs) {
                problems.push(format!(
                    "NCCL_SOCKET_IFNAME={v} matches no interface that is up on {} (it has: {})",
                    n.label,
                    ifs.iter()
                        .filter(|f| f.up)
                        .map(|f| f.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
    }
    let mtus: std::collections::BTreeSet<u32> = nodes
        .iter()
        .filter_map(|n| {
            n.joined
                .as_ref()
                .and_then(|j| j.facts.ifaces.iter().find(|f| f.name == n.ifname))
                .and_then(|f| f.mtu)
        })
        .collect();
    if mtus.len() > 1 {
        warnings.push(format!("the chosen interfaces' MTUs differ between nodes ({mtus:?}): large messages may be dropped or fragmented"));
    }
    if cp.env.iter().any(|(k, _)| k == "NCCL_PORT_RANGE") {
        warnings.push("NCCL_PORT_RANGE is not an NCCL variable and does nothing: to confine NCCL's ports narrow the kernel's ephemeral range (sysctl net.ipv4.ip_local_port_range=\"50000 51000\"); NCCL_COMM_ID pins only the bootstrap port".into());
    }
    let facts: Vec<(String, &crate::facts::Facts)> = nodes
        .iter()
        .map(|n| (n.label.clone(), &n.joined.as_ref().expect("joined").facts))
        .collect();
    let cmp = crate::facts::compare(&facts);
    eprint!("{}", cmp.table);
    for d in &cmp.differences {
        warnings.push(d.clone());
    }
    if cmp.refuse && !cp.allow_mismatch {
        problems.push("NCCL major.minor or torch differ between nodes (see above): a job would fail or hang in init; make them equal, or pass --allow-mismatch".into());
    }
    for w in &warnings {
        tracing::warn!("{w}");
    }
    if !problems.is_empty() {
        eprintln!("nrun: error: the nodes are not ready:");
        for p in &problems {
            eprintln!("  {p}");
        }
        return Ok(CLUSTER_FAILED);
    }

    // ---- node-to-node reachability, ring order -------------------------------------------
    if k > 1 {
        for (i, n) in nodes.iter().enumerate() {
            let next = &nodes[(i + 1) % k];
            let published: SocketAddr = next
                .joined
                .as_ref()
                .expect("joined")
                .probe_addr
                .parse()
                .map_err(|_| Error::internal("bad probe address"))?;
            let target =
                SocketAddr::new(next.addr.unwrap_or(published.ip()), published.port()).to_string();
            let _ = n;
            set_step(
                store,
                run_id,
                i,
                *step,
                &Step::Probe {
                    target,
                    timeout_ms: 5000,
                },
            );
        }
        let results = collect(store, run_id, k, *step, None, signals, &mut lost_fn(nodes)).await?;
        *step += 1;
        let mut bad = Vec::new();
        for (i, r) in results.iter().enumerate() {
            if let Some(StepResult::Probe { error: Some(e) }) = r {
                let next = &nodes[(i + 1) % k];
                bad.push(format!(
                    "{} cannot reach {}: {e}; check the firewall between {} and {} (nrun probed the address {} uses for NCCL, interface {})",
                    nodes[i].label, next.label, nodes[i].label, next.label, next.label, next.ifname
                ));
            }
        }
        if !bad.is_empty() {
            eprintln!("nrun: error: nodes cannot reach each other:");
            for b in &bad {
                eprintln!("  {b}");
            }
            return Ok(CLUSTER_FAILED);
        }
    }

    if cp.doctor {
        for n in nodes.iter() {
            println!(
                "{}: NCCL_SOCKET_IFNAME would be =={} (it reached the launch host at {})",
                n.label, n.ifname, n.master_addr
            );
        }
        println!("doctor: {k} nodes joined, checked and reach each other");
        return Ok(exit::SUCCESS);
    }

    // ---- preflight ----------------------------------------------------------------------
    if let Some(pf) = &plan.preflight {
        let this = *step;
        *step += 1;
        let code = run_preflight(
            plan, pf, cp, store, run_id, secret, port, nodes, this, signals,
        )
        .await?;
        if code != exit::SUCCESS && (plan.preflight_only || !pf.warn_only) {
            return Ok(code);
        }
    }
    if plan.preflight_only {
        return Ok(exit::SUCCESS);
    }

    // ---- the job ------------------------------------------------------------------------
    let exe_args: Vec<String> = plan
        .args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let program = plan.program.to_string_lossy().into_owned();
    let mut code = exit::SUCCESS;
    for attempt in 0..=plan.max_restarts {
        if attempt > 0 {
            store.clear_user_keys();
        }
        let specs = job_specs(
            plan,
            cp,
            nodes,
            port,
            attempt,
            &program,
            &exe_args,
            true,
            &|_| Vec::new(),
        );
        let this = *step;
        *step += 1;
        for (i, s) in specs.into_iter().enumerate() {
            let deadline_ms = None;
            set_step(
                store,
                run_id,
                i,
                this,
                &Step::Run {
                    workers: s,
                    grace_ms: plan.shutdown_timeout.as_millis() as u64,
                    deadline_ms,
                },
            );
        }
        let results = collect(
            store,
            run_id,
            k,
            this,
            Some(this),
            signals,
            &mut lost_fn(nodes),
        )
        .await?;
        match summarize_job(plan, nodes, &results) {
            JobEnd::Success => return Ok(exit::SUCCESS),
            JobEnd::Interrupted(c) => return Ok(c),
            JobEnd::Failed(c, text) => {
                code = c;
                if attempt < plan.max_restarts {
                    tracing::warn!(
                        "a worker failed; restarting the worker group on every node ({} of {} restarts)",
                        attempt + 1,
                        plan.max_restarts
                    );
                    continue;
                }
                eprint!("{text}");
            }
        }
    }
    Ok(code)
}

/// Whether node i's agent connection (ssh) has ended, and how it ended.
/// Whether node i's agent is lost, and how: its ssh ended, or (`stopped`: it stopped its
/// workers unasked) its connection to the launch host broke while ssh may still be closing.
pub(crate) fn lost_fn(nodes: &mut [Node]) -> impl FnMut(usize, bool) -> Option<String> + '_ {
    move |i, stopped| {
        let n = nodes.get_mut(i)?;
        let Some(st) = n.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) else {
            return stopped.then(|| {
                format!("lost the connection to {}: its agent stopped its workers when the link to the launch host broke", n.label)
            });
        };
        let said = tail_of(&n.stderr_tail)
            .into_iter()
            .rev()
            .find(|l| !l.trim().is_empty());
        Some(format!(
            "lost the connection to {} ({st}){}",
            n.label,
            said.map_or(String::new(), |s| format!(": {s}"))
        ))
    }
}

/// NCCL_SOCKET_IFNAME semantics: comma list of prefixes; `=` exact names; `^` excludes.
fn ifname_matches_any(spec: &str, ifs: &[net::Iface]) -> bool {
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, list) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let pats: Vec<&str> = list.split(',').filter(|p| !p.is_empty()).collect();
    ifs.iter().filter(|f| f.up && !f.loopback).any(|f| {
        let hit = pats.iter().any(|p| {
            if exact {
                f.name == *p
            } else {
                f.name.starts_with(p)
            }
        });
        hit != exclude
    })
}

pub fn set_step(store: &Store, run_id: &str, node: usize, step: usize, s: &Step) {
    let v = serde_json::to_vec(s).unwrap_or_default();
    store.set(&agent::key(run_id, &format!("n{node}/step/{step}")), &v);
}

/// Waits for every node's result of `step`. With `stop_step`, the first failed node (or a
/// signal) makes the coordinator stop the others; a second signal stops waiting for grace.
pub async fn collect(
    store: &Store,
    run_id: &str,
    k: usize,
    step: usize,
    stop_step: Option<usize>,
    signals: &mut Signals,
    lost: &mut dyn FnMut(usize, bool) -> Option<String>,
) -> Result<Vec<Option<StepResult>>> {
    let mut results: Vec<Option<StepResult>> = vec![None; k];
    let started = Instant::now();
    let mut stopped = false;
    let mut signalled = 0;
    loop {
        for (i, r) in results.iter_mut().enumerate() {
            if r.is_none() {
                if let Some(raw) = store.get(&agent::key(run_id, &format!("n{i}/result/{step}"))) {
                    *r = serde_json::from_slice(&raw).ok();
                    // Stopped without being asked: that agent lost its connection to us.
                    if !stopped && matches!(r, Some(StepResult::Run(RunResult::Stopped))) {
                        let why = lost(i, true).unwrap_or_else(|| {
                            format!("node {i}'s agent lost its connection to the launch host")
                        });
                        *r = Some(StepResult::Run(RunResult::Lost(why)));
                    }
                } else if let Some(why) = lost(i, false) {
                    // The node's agent is gone (ssh dropped, host died): it will not report.
                    *r = Some(StepResult::Run(RunResult::Lost(why)));
                }
            }
        }
        if results.iter().all(Option::is_some) {
            return Ok(results);
        }
        // A probe answers within seconds; an agent silent for long has lost its connection.
        if stop_step.is_none() && started.elapsed() > Duration::from_secs(30) {
            for (i, r) in results.iter_mut().enumerate() {
                if r.is_none() {
                    *r = Some(StepResult::Probe {
                        error: Some(format!("node {i}'s agent did not answer within 30 s")),
                    });
                }
            }
            return Ok(results);
        }
        // A node stopped without being asked to (its agent lost the launcher) counts too.
        let failed = results.iter().any(|r| {
            matches!(
                r,
                Some(StepResult::Run(
                    RunResult::Failed { .. }
                        | RunResult::SpawnError(_)
                        | RunResult::TimedOut
                        | RunResult::Lost(_)
                ))
            )
        });
        if let (Some(s), true, false) = (stop_step, failed, stopped) {
            store.set(&agent::key(run_id, &format!("stop/{s}")), b"");
            stopped = true;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(2)) => {}
            _sig = signals.recv() => {
                signalled += 1;
                if let Some(s) = stop_step {
                    store.set(&agent::key(run_id, &format!("stop/{s}")), b"");
                    stopped = true;
                }
                if signalled >= 2 || stop_step.is_none() {
                    return Err(Error { code: exit::signal(libc::SIGINT), message: "interrupted; stopping every node".into() });
                }
            }
        }
    }
}

/// NCCL_SOCKET_IFNAME (exact name) and GLOO_SOCKET_IFNAME for a node's workers, unless the
/// user set them (then they were checked on every node).
pub(crate) fn interface_env(cp: &ClusterPlan, n: &Node) -> Vec<(String, String)> {
    let mut env = Vec::new();
    if !cp.env.iter().any(|(k, _)| k == "NCCL_SOCKET_IFNAME") {
        env.push(("NCCL_SOCKET_IFNAME".into(), format!("={}", n.ifname)));
    }
    if !cp.env.iter().any(|(k, _)| k == "GLOO_SOCKET_IFNAME") {
        env.push(("GLOO_SOCKET_IFNAME".into(), n.ifname.clone()));
    }
    env
}

/// What every worker of one group run shares.
pub(crate) struct Launch<'a> {
    /// Ranks in the whole group, and its nodes.
    pub world: usize,
    pub nnodes: usize,
    /// The port of the store the group rendezvous on (MASTER_PORT).
    pub port: u16,
    pub attempt: u32,
    pub program: &'a str,
    pub args: &'a [String],
    /// Whether the job's --log-dir, --redirects and --local-ranks-filter apply (the preflight's
    /// and bisect's ranks show everything and write no files).
    pub logs: bool,
    /// Directory under nrun's temp dir keeping this run's error files apart.
    pub scratch: &'a str,
}

/// One node's workers for a group run: `ranks` are (rank in the group, local rank), the node is
/// the group's node number `group_rank`.
pub(crate) fn node_specs(
    plan: &Plan,
    cp: &ClusterPlan,
    n: &Node,
    group_rank: usize,
    ranks: &[(usize, usize)],
    l: &Launch<'_>,
    extra: &[(String, String)],
) -> Vec<WorkerSpec> {
    let width = l.world.saturating_sub(1).to_string().len();
    let temp_root = std::env::temp_dir()
        .join(format!("nrun-{}", std::process::id()))
        .join(l.scratch);
    let mut specs = Vec::new();
    for &(rank, local_rank) in ranks {
        let error_file: PathBuf = plan
            .worker_dir(&temp_root, l.attempt, local_rank)
            .join("error.json");
        let place = Place {
            rank,
            group_rank,
            local_world_size: ranks.len(),
            world_size: l.world,
            group_world_size: l.nnodes,
        };
        let mut env = cp.env.clone();
        env.extend(plan.worker_env_at(
            &place,
            &WorkerSlot {
                local_rank,
                restart_count: l.attempt,
                master_addr: &n.master_addr,
                master_port: l.port,
                error_file: &error_file,
            },
        ));
        env.extend(interface_env(cp, n));
        env.extend(extra.iter().cloned());
        let shown = !l.logs
            || plan
                .log
                .console_ranks
                .as_ref()
                .is_none_or(|s| s.contains(&local_rank));
        let red = if l.logs {
            plan.log.redirects.for_rank(local_rank)
        } else {
            Default::default()
        };
        specs.push(WorkerSpec {
            rank,
            local_rank,
            program: l.program.to_string(),
            args: l.args.to_vec(),
            env,
            error_file,
            prefix: format!("[{}:rank{rank:>width$}]: ", n.label),
            colour: rank,
            console: [shown && !red.stdout(), shown && !red.stderr()],
            // <dir>/<run-id>/attempt_<n>/<host>/<local rank>: the host level keeps nodes
            // apart on a shared filesystem.
            log_dir: plan.log.dir.as_ref().filter(|_| l.logs).map(|d| {
                d.join(&plan.run_id)
                    .join(format!("attempt_{}", l.attempt))
                    .join(&n.label)
                    .join(local_rank.to_string())
            }),
        });
    }
    specs
}

/// Every node's workers for one attempt of the job (or its preflight), ranks as laid out.
#[allow(clippy::too_many_arguments)]
fn job_specs(
    plan: &Plan,
    cp: &ClusterPlan,
    nodes: &[Node],
    port: u16,
    attempt: u32,
    program: &str,
    args: &[String],
    logs: bool,
    per_node_extra: &dyn Fn(usize) -> Vec<(String, String)>,
) -> Vec<Vec<WorkerSpec>> {
    let world: usize = cp.layout.iter().map(Vec::len).sum();
    cp.layout
        .iter()
        .enumerate()
        .map(|(i, layout)| {
            let ranks: Vec<(usize, usize)> = layout.iter().map(|&(r, l, _)| (r, l)).collect();
            let scratch = format!("node{i}");
            let l = Launch {
                world,
                nnodes: cp.hosts.len(),
                port,
                attempt,
                program,
                args,
                logs,
                scratch: &scratch,
            };
            node_specs(plan, cp, &nodes[i], i, &ranks, &l, &per_node_extra(i))
        })
        .collect()
}

/// The preflight of a multi-node run: one rank per worker slot on every node, started by the
/// agents like the job's workers; each node's ranks load that node's libnccl (or --nccl-lib)
/// and, for the TCP ring, listen on the node's own address.
#[allow(clippy::too_many_arguments)]
async fn run_preflight(
    plan: &Plan,
    pf: &crate::plan::PreflightPlan,
    cp: &ClusterPlan,
    store: &Store,
    run_id: &str,
    secret: &str,
    port: u16,
    nodes: &mut [Node],
    step: usize,
    signals: &mut Signals,
) -> Result<u8> {
    let started = Instant::now();
    let settings = |n: &Node| {
        let lib = pf.nccl_lib.clone().or_else(|| {
            n.joined
                .as_ref()
                .and_then(|j| j.facts.nccl.first())
                .map(|l| PathBuf::from(&l.path))
        });
        let listen = n.addr.map_or_else(|| "0.0.0.0".into(), |a| a.to_string());
        crate::preflight::Settings::new(pf, format!("{run_id}/pf"), lib, listen)
    };
    let env = |i: usize| settings(&nodes[i]).rank_env(pf.loopback, Some(secret));
    let specs = job_specs(
        plan,
        cp,
        nodes,
        port,
        0,
        &cp.remote_nrun,
        &["__preflight".to_string()],
        false,
        &env,
    );
    // Ranks enforce the init timeout themselves; this only catches one hung where it cannot.
    let deadline_ms = (pf.timeout * 2 + Duration::from_secs(120)).as_millis() as u64;
    for (i, s) in specs.into_iter().enumerate() {
        set_step(
            store,
            run_id,
            i,
            step,
            &Step::Run {
                workers: s,
                grace_ms: 3000,
                deadline_ms: Some(deadline_ms),
            },
        );
    }
    let results = collect(
        store,
        run_id,
        nodes.len(),
        step,
        Some(step),
        signals,
        &mut lost_fn(nodes),
    )
    .await?;
    let crashed = results.iter().flatten().find_map(|r| match r {
        StepResult::Run(RunResult::Failed { rank, pid, how, .. }) => {
            Some((*rank, format!("pid {pid} {how}")))
        }
        _ => None,
    });
    let ranks: Vec<(usize, String)> = cp
        .layout
        .iter()
        .enumerate()
        .flat_map(|(i, l)| l.iter().map(move |&(r, _, _)| (r, i)))
        .map(|(r, i)| (r, nodes[i].label.clone()))
        .collect();
    let base = settings(&nodes[0]);
    let (reports, silent) = crate::preflight::reports_from(&base, &ranks, &mut |k| store.get(k));
    let summary = crate::preflight::Outcome {
        world_size: ranks.len(),
        mode: pf.mode,
        reports,
        silent,
        crashed,
        nccl_lib: None,
        min_busbw: pf.min_busbw,
        wall_s: started.elapsed().as_secs_f64(),
        other_libs: Vec::new(),
    }
    .summarize();
    print!("{}", summary.text);
    if let Some(path) = &pf.report {
        crate::coordinator::write_report(path, &summary.json)?;
    }
    Ok(summary.verdict.exit_code())
}

enum JobEnd {
    Success,
    Interrupted(u8),
    Failed(u8, String),
}

fn summarize_job(plan: &Plan, nodes: &[Node], results: &[Option<StepResult>]) -> JobEnd {
    let world: usize = results.len();
    let _ = world;
    let mut first: Option<(usize, &RunResult)> = None;
    for (i, r) in results.iter().enumerate() {
        if let Some(StepResult::Run(
            rr @ (RunResult::Failed { .. }
            | RunResult::SpawnError(_)
            | RunResult::TimedOut
            | RunResult::Lost(_)),
        )) = r
        {
            // The earliest failure by time: Failed results carry one.
            let better = match (first, rr) {
                (None, _) => true,
                (Some((_, RunResult::Failed { at: a, .. })), RunResult::Failed { at: b, .. }) => {
                    b < a
                }
                _ => false,
            };
            if better {
                first = Some((i, rr));
            }
        }
    }
    if let Some((i, r)) = first {
        let mut t = String::new();
        use std::fmt::Write as _;
        match r {
            RunResult::Failed {
                rank,
                local_rank,
                pid,
                exit_code,
                how,
                at,
                stderr_tail,
                traceback,
            } => {
                let _ = writeln!(
                    t,
                    "nrun: error: rank {rank} on {} {how} (first failure; every worker on every node was stopped)",
                    nodes[i].label
                );
                let _ = writeln!(
                    t,
                    "  command:    {} {}",
                    plan.program.to_string_lossy(),
                    plan.args
                        .iter()
                        .map(|a| a.to_string_lossy())
                        .collect::<Vec<_>>()
                        .join(" ")
                );
                let _ = writeln!(t, "  host:       {}", nodes[i].label);
                let _ = writeln!(t, "  local rank: {local_rank}");
                let _ = writeln!(t, "  pid:        {pid}");
                let _ = writeln!(t, "  time:       {at}");
                if let Some(tb) = traceback {
                    let _ = writeln!(t, "  traceback (from its error file):");
                    for l in tb.lines() {
                        let _ = writeln!(t, "    {l}");
                    }
                }
                if !stderr_tail.is_empty() {
                    let _ = writeln!(t, "  last {} lines of its stderr:", stderr_tail.len());
                    for l in stderr_tail {
                        let _ = writeln!(t, "    | {l}");
                    }
                }
                return JobEnd::Failed((*exit_code).max(1), t);
            }
            RunResult::SpawnError(e) => {
                let _ = writeln!(
                    t,
                    "nrun: error: cannot start workers on {}: {e}",
                    nodes[i].label
                );
                return JobEnd::Failed(exit::USAGE, t);
            }
            RunResult::Lost(e) => {
                let _ = writeln!(
                    t,
                    "nrun: error: {e}; every worker on the other nodes was stopped"
                );
                let _ = writeln!(
                    t,
                    "  hint: check that {} is up and reachable (ssh {} true)",
                    nodes[i].label, nodes[i].label
                );
                return JobEnd::Failed(exit::CLUSTER, t);
            }
            _ => {
                let _ = writeln!(
                    t,
                    "nrun: error: workers on {} ran past their deadline",
                    nodes[i].label
                );
                return JobEnd::Failed(exit::INTERNAL, t);
            }
        }
    }
    if let Some(sig) = results.iter().find_map(|r| match r {
        Some(StepResult::Run(RunResult::Interrupted(s))) => Some(*s),
        _ => None,
    }) {
        return JobEnd::Interrupted(exit::signal(sig));
    }
    if results
        .iter()
        .any(|r| matches!(r, Some(StepResult::Run(RunResult::Stopped))))
    {
        return JobEnd::Interrupted(exit::signal(libc::SIGINT));
    }
    JobEnd::Success
}

/// Decides whether this is a multi-node run and with which nodes: `-H`, `--hostfile`, or,
/// inside a Slurm allocation of several nodes, SLURM_JOB_NODELIST. `None`: a single-node run.
pub fn plan_cluster(
    cli: &crate::cli::Cli,
    plan: &Plan,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<ClusterPlan>> {
    use crate::hosts;
    let mut from_slurm = false;
    let mut list = match (&cli.hosts, &cli.hostfile) {
        (Some(_), Some(_)) => {
            return Err(Error::usage(
                "-H/--hosts and --hostfile exclude each other; give one of them",
            ));
        }
        (Some(h), None) => Some(hosts::parse_hosts_flag(h)?),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .map_err(|e| Error::usage(format!("--hostfile {}: {e}", f.display())))?;
            Some(hosts::parse_hostfile(&text, &f.display().to_string())?)
        }
        (None, None) => None,
    };
    if list.is_none() && cli.launcher != "ssh" {
        if let Some(nl) = env("SLURM_JOB_NODELIST").or_else(|| env("SLURM_NODELIST")) {
            let names = hosts::expand_slurm_hostlist(&nl)?;
            if names.len() > 1 {
                from_slurm = true;
                list = Some(names.into_iter().map(Host::new).collect());
            }
        }
    }
    let Some(mut list) = list else {
        if cli.include.is_some() || cli.exclude.is_some() {
            return Err(Error::usage(
                "--include/--exclude need a host list (-H, --hostfile or a Slurm allocation)",
            ));
        }
        return Ok(None);
    };
    list = hosts::apply_include_exclude(list, cli.include.as_deref(), cli.exclude.as_deref())?;
    if cli.nnodes != "1" {
        list = hosts::take_nnodes(list, plan.nnodes)?;
    }
    if cli.node_rank != 0 {
        return Err(Error::usage(
            "--node-rank is for torchrun-style launches on every node; with a host list nrun starts every node itself",
        ));
    }
    let layout = hosts::rank_layout(&list, plan.nproc)?;
    let launcher = match cli.launcher.as_str() {
        "auto" if from_slurm => Launcher::Srun,
        "auto" | "ssh" => Launcher::Ssh,
        "srun" => Launcher::Srun,
        other => {
            return Err(Error::usage(format!(
                "--launcher {other:?}: expected auto, ssh or srun"
            )));
        }
    };
    let ssh_opts =
        remote::split_opts(cli.ssh_opts.as_deref().unwrap_or("")).map_err(Error::usage)?;
    // What every worker everywhere gets: forwarded variables, then .nrun_env (home, then the
    // cwd's, which wins), then -x.
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| remote::forwarded(k))
        .collect();
    let home = env("HOME").map(PathBuf::from);
    for dir in [home, std::env::current_dir().ok()].into_iter().flatten() {
        let p = dir.join(".nrun_env");
        if let Ok(text) = std::fs::read_to_string(&p) {
            for (k, v) in
                remote::parse_env_file(&text, &p.display().to_string()).map_err(Error::usage)?
            {
                vars.retain(|(x, _)| *x != k);
                vars.push((k, v));
            }
        }
    }
    for x in &cli.export {
        let (k, v) = match x.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => match env(x) {
                Some(v) => (x.clone(), v),
                None => {
                    return Err(Error::usage(format!(
                        "-x {x}: {x} is not set here; give a value with -x {x}=VALUE"
                    )));
                }
            },
        };
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(Error::usage(format!(
                "-x {x}: {k:?} is not a variable name"
            )));
        }
        vars.retain(|(x, _)| *x != k);
        vars.push((k, v));
    }
    if !(cli.join_timeout.is_finite() && cli.join_timeout > 0.0) {
        return Err(Error::usage(format!(
            "--join-timeout {} must be a positive number of seconds",
            cli.join_timeout
        )));
    }
    let remote_nrun = match &cli.remote_nrun {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| Error::internal(e.to_string()))?
            .display()
            .to_string(),
    };
    Ok(Some(ClusterPlan {
        hosts: list,
        layout,
        launcher,
        ssh_opts,
        ssh_concurrency: cli.ssh_concurrency,
        ship: cli.ship,
        env: vars,
        ifname: cli.ifname.clone(),
        join_timeout: Duration::from_secs_f64(cli.join_timeout),
        allow_mismatch: cli.allow_mismatch,
        python_probe: !cli.no_python_probe && !cli.no_python && plan.python.is_some(),
        remote_nrun,
        doctor: cli.doctor,
    }))
}

/// `nrun doctor` for this node alone: its facts and interfaces.
pub fn doctor_local(plan: &Plan) -> u8 {
    let f = crate::facts::gather(plan.python.as_deref());
    let cmp = crate::facts::compare(&[("this host".to_string(), &f)]);
    print!("{}", cmp.table);
    println!("interfaces:");
    for i in &f.ifaces {
        let addrs: Vec<String> = i.addrs.iter().map(|a| a.to_string()).collect();
        println!(
            "  {:<12} {:<4} mtu {:<6} {}",
            i.name,
            if i.up { "up" } else { "down" },
            i.mtu.map_or("?".into(), |m| m.to_string()),
            addrs.join(" ")
        );
    }
    println!("NCCL libraries (the first is what a job here would load):");
    if f.nccl.is_empty() {
        println!("  none found (torch's site-packages, LD_LIBRARY_PATH, ldconfig)");
    }
    for l in &f.nccl {
        println!(
            "  {} {} ({})",
            l.version.as_deref().unwrap_or("?"),
            l.path,
            l.source
        );
    }
    match (&f.torch, &f.torch_error) {
        (Some(t), _) => println!(
            "torch {t} (CUDA {}, NCCL {})",
            f.torch_cuda.as_deref().unwrap_or("-"),
            f.torch_nccl.as_deref().unwrap_or("-")
        ),
        (None, Some(e)) => println!(
            "torch: not usable with {}: {e}",
            plan.python
                .as_ref()
                .map_or("python3".into(), |p| p.display().to_string())
        ),
        (None, None) => println!("torch: not probed (no python found)"),
    }
    if std::env::var_os("NCCL_PORT_RANGE").is_some() {
        println!(
            "warning: NCCL_PORT_RANGE is not an NCCL variable; narrow net.ipv4.ip_local_port_range instead"
        );
    }
    exit::SUCCESS
}
