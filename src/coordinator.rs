//! The phases of a run, wired together; deliberately thin: plan -> bind the store -> preflight
//! (when one runs) -> attempts of the worker group -> summary and exit code.

use std::fs::File;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, Result, exit};
use crate::node::output::{Sink, WorkerOutput};
use crate::node::{self, Outcome, Signals, WorkerCmd};
use crate::plan::{Plan, PreflightPlan, StorePlan, WorkerSlot};
use crate::preflight::{self, Mode, RankReport};
use crate::report;
use crate::store::client::Client;
use crate::store::{self, Store};

/// Binds the store's port when this node hosts it. Done before anything else starts so a port
/// that is taken is a usage error with nothing to clean up.
pub fn bind_store(plan: &Plan) -> Result<Option<std::net::TcpListener>> {
    let StorePlan::Host { port, .. } = plan.store else {
        return Ok(None);
    };
    match store::server::bind(port) {
        Ok(l) => Ok(Some(l)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(Error::usage(format!(
            "--master-port {port} is already in use on this host (another job or store?); pick \
             another port, or omit --master-port and nrun binds a free one"
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(Error::usage(format!(
            "--master-port {port}: permission denied binding it (ports below 1024 need root); pick \
             a port above 1024 or omit --master-port"
        ))),
        Err(e) => Err(Error::internal(format!(
            "cannot bind the store on port {port}: {e}"
        ))),
    }
}

/// Where workers find the store, and the secret for nrun's own keys in it (when this nrun
/// hosts it; a torchrun-style node of rank > 0 cannot know node 0's).
struct StoreAddr {
    addr: String,
    port: u16,
    secret: Option<String>,
}

/// Runs the job to its end and returns nrun's exit code.
pub async fn run(plan: Plan, listener: Option<std::net::TcpListener>) -> Result<u8> {
    let mut signals = Signals::install()?;
    node::process::become_subreaper();

    let (store_addr, store, stop_store) = match (&plan.store, listener) {
        (StorePlan::Host { advertise, .. }, Some(l)) => {
            let port = l
                .local_addr()
                .map_err(|e| Error::internal(e.to_string()))?
                .port();
            let l = tokio::net::TcpListener::from_std(l)
                .map_err(|e| Error::internal(format!("store listener: {e}")))?;
            // nrun's own keys (the preflight's) are out of the workers' reach. Not in
            // torchrun-style static mode: the other nodes' nruns could not know the secret.
            let secret = (plan.nnodes == 1).then(crate::cluster::random_secret);
            let store = match &secret {
                Some(s) => Store::with_secret(s.clone().into_bytes()),
                None => Store::new(),
            };
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let served = store.clone();
            tokio::spawn(async move {
                store::server::serve(l, served, async {
                    let _ = rx.await;
                })
                .await
            });
            (
                StoreAddr {
                    addr: advertise.clone(),
                    port,
                    secret,
                },
                Some(store),
                Some(tx),
            )
        }
        (StorePlan::Remote { addr, port }, _) => (
            StoreAddr {
                addr: addr.clone(),
                port: *port,
                secret: None,
            },
            None,
            None,
        ),
        (StorePlan::Host { .. }, None) => return Err(Error::internal("store was not bound")),
    };
    tracing::debug!("store at {}:{}", store_addr.addr, store_addr.port);
    let temp_root = std::env::temp_dir().join(format!("nrun-{}", std::process::id()));

    let mut code = exit::SUCCESS;
    if let Some(pf) = &plan.preflight {
        code = run_preflight(&plan, pf, &store_addr, &mut signals, &temp_root).await?;
        if code != exit::SUCCESS && pf.warn_only && !plan.preflight_only {
            tracing::warn!(
                "the preflight failed (exit code {code}); starting the job anyway (--preflight ...,warn)"
            );
            code = exit::SUCCESS;
        }
    }
    if code == exit::SUCCESS && !plan.preflight_only {
        code = run_job(
            &plan,
            &store_addr,
            store.as_deref(),
            &mut signals,
            &temp_root,
        )
        .await?;
    }
    if let Some(tx) = stop_store {
        let _ = tx.send(());
    }
    let _ = std::fs::remove_dir_all(&temp_root);
    Ok(code)
}

async fn run_job(
    plan: &Plan,
    sa: &StoreAddr,
    store: Option<&Store>,
    signals: &mut Signals,
    temp_root: &Path,
) -> Result<u8> {
    if plan.set_omp_threads {
        tracing::info!(
            "OMP_NUM_THREADS was unset; set to 1 for each of the {} workers (as torchrun does); set \
             it yourself to tune",
            plan.nproc
        );
    }
    if plan.log.dir_is_temp {
        if let Some(d) = &plan.log.dir {
            tracing::info!("worker logs go to {}", d.display());
        }
    }
    if std::env::var_os("NCCL_PORT_RANGE").is_some() {
        tracing::warn!(
            "NCCL_PORT_RANGE is not an NCCL variable and does nothing: to confine NCCL's ports \
             narrow the kernel's ephemeral range (sysctl net.ipv4.ip_local_port_range=\"50000 51000\"); \
             NCCL_COMM_ID pins only the bootstrap port"
        );
    }
    let host = hostname();
    let program = std::iter::once(plan.program.to_string_lossy())
        .chain(plan.args.iter().map(|a| a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ");

    let mut code = exit::SUCCESS;
    for attempt in 0..=plan.max_restarts {
        if attempt > 0 {
            if let Some(s) = store {
                s.clear();
            }
        }
        let workers = build_workers(
            plan,
            attempt,
            sa,
            temp_root,
            &plan.program,
            &plan.args,
            &[],
            true,
        )?;
        match node::run_group(workers, plan.shutdown_timeout, None, signals, None).await? {
            Outcome::Success => return Ok(exit::SUCCESS),
            Outcome::TimedOut | Outcome::Stopped => return Ok(exit::INTERNAL),
            Outcome::Interrupted(sig) => {
                tracing::warn!(
                    "stopped by {}; every worker was stopped",
                    node::signal_name(sig)
                );
                return Ok(exit::signal(sig));
            }
            Outcome::Failed(f) => {
                code = f.exit.exit_code();
                if attempt < plan.max_restarts {
                    tracing::warn!(
                        "rank {} {}; restarting the worker group ({} of {} restarts)",
                        f.rank,
                        f.exit.describe(),
                        attempt + 1,
                        plan.max_restarts
                    );
                    continue;
                }
                eprint!(
                    "{}",
                    report::failure_summary(&f, &host, plan.world_size(), &program)
                );
                if code == exit::SUCCESS {
                    code = exit::INTERNAL;
                }
            }
        }
    }
    Ok(code)
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .map_or_else(|_| "localhost".into(), |h| h.to_string_lossy().into_owned())
}

/// The preflight phase: resolve the libnccl the job would load, run one preflight rank per
/// worker slot with the job's environment, gather what each rank reported, print the verdict.
async fn run_preflight(
    plan: &Plan,
    pf: &PreflightPlan,
    sa: &StoreAddr,
    signals: &mut Signals,
    temp_root: &Path,
) -> Result<u8> {
    let started = Instant::now();
    let since = |what: &str| {
        tracing::debug!(
            "preflight: {what} at {:.0} ms",
            started.elapsed().as_secs_f64() * 1e3
        )
    };
    let (nccl_lib, other_libs) = match pf.mode {
        Mode::Nccl => resolve_nccl(plan, pf).await,
        Mode::Net => (None, tokio::spawn(async { Vec::new() })),
    };
    // Ranks on this one node listen where the store is, loopback included.
    let listen = match sa.addr.parse::<std::net::IpAddr>() {
        Ok(a) if a.is_loopback() => sa.addr.clone(),
        _ => "0.0.0.0".into(),
    };
    let settings = preflight::Settings::new(pf, format!("{}/0", plan.run_id), nccl_lib, listen);
    let extra = settings.rank_env(pf.loopback, sa.secret.as_deref());
    let exe = std::env::current_exe()
        .map_err(|e| Error::internal(format!("cannot find nrun's own executable: {e}")))?;
    let workers = build_workers(
        plan,
        0,
        sa,
        temp_root,
        exe.as_os_str(),
        &["__preflight".into()],
        &extra,
        false,
    )?;
    since("starting ranks");
    // Ranks enforce the init timeout themselves; this deadline only catches a rank that hangs
    // where it cannot (a CUDA call, a dead peer mid-collective).
    let deadline = tokio::time::Instant::now() + pf.timeout * 2 + Duration::from_secs(120);
    let outcome = node::run_group(
        workers,
        Duration::from_secs(3),
        Some(deadline),
        signals,
        None,
    )
    .await?;
    let crashed = match &outcome {
        Outcome::Interrupted(sig) => {
            tracing::warn!("preflight stopped by {}", node::signal_name(*sig));
            return Ok(exit::signal(*sig));
        }
        Outcome::Failed(f) => Some((f.rank, format!("pid {} {}", f.pid, f.exit.describe()))),
        Outcome::TimedOut | Outcome::Stopped => {
            tracing::warn!("the preflight ran past its deadline and was stopped");
            None
        }
        Outcome::Success => None,
    };
    since("ranks ended");
    let (reports, silent) = gather_reports(plan, sa, &settings).await;
    since("reports gathered");
    let other_libs = other_libs.await.unwrap_or_default();
    since("other libraries probed");
    let summary = preflight::Outcome {
        world_size: plan.world_size(),
        mode: pf.mode,
        reports,
        silent,
        crashed,
        nccl_lib: settings.nccl_lib.as_ref().map(|p| p.display().to_string()),
        min_busbw: pf.min_busbw,
        wall_s: started.elapsed().as_secs_f64(),
        other_libs,
    }
    .summarize();
    print!("{}", summary.text);
    if let Some(path) = &pf.report {
        write_report(path, &summary.json)?;
    }
    Ok(summary.verdict.exit_code())
}

/// Reads every rank's report from the store (one MULTI_GET: the store may be another node's, in
/// torchrun-style static mode); a rank without one is listed with its last stage.
async fn gather_reports(
    plan: &Plan,
    sa: &StoreAddr,
    s: &preflight::Settings,
) -> (
    std::collections::BTreeMap<usize, RankReport>,
    Vec<preflight::Silent>,
) {
    let host = hostname();
    // Ranks are contiguous per node; this node's are the only ones it can name.
    let ranks: Vec<(usize, String)> = (0..plan.world_size())
        .map(|r| {
            (
                r,
                if r / plan.nproc == plan.node_rank {
                    host.clone()
                } else {
                    format!("node {}", r / plan.nproc)
                },
            )
        })
        .collect();
    let keys: Vec<Vec<u8>> = ranks
        .iter()
        .flat_map(|(r, _)| [s.key(&format!("result/{r}")), s.key(&format!("stage/{r}"))])
        .collect();
    let mut values = std::collections::HashMap::new();
    let addr = (sa.addr.as_str(), sa.port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next());
    if let Some(mut c) = match addr {
        Some(a) => Client::connect(a, Duration::from_secs(5)).await.ok(),
        None => None,
    } {
        if let Some(secret) = &sa.secret {
            let _ = c
                .set(crate::store::server::AUTH_KEY, secret.as_bytes())
                .await;
        }
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        if let Ok(vals) = c.multi_get(&refs).await {
            values = keys.iter().cloned().zip(vals).collect();
        }
    }
    preflight::reports_from(s, &ranks, &mut |k| {
        values.get(k).cloned().filter(|v| !v.is_empty())
    })
}

/// The libnccl the job would load, and (as a task that runs beside the preflight) a line for
/// every other one found, with its version.
async fn resolve_nccl(
    plan: &Plan,
    pf: &PreflightPlan,
) -> (Option<PathBuf>, tokio::task::JoinHandle<Vec<String>>) {
    // Even with --nccl-lib, torch's copy is looked up so that a mismatch can be reported.
    let python_paths = plan
        .python
        .as_deref()
        .map(preflight::nccl::python_package_dirs)
        .unwrap_or_default();
    let ld = std::env::var("LD_LIBRARY_PATH").ok();
    // The system's copies (ldconfig) only matter for the choice when nothing better exists;
    // otherwise they are listed by the background task below.
    let mut cands =
        preflight::nccl::candidates(pf.nccl_lib.as_deref(), &python_paths, ld.as_deref(), false);
    let listed_system = cands.is_empty();
    if listed_system {
        cands = preflight::nccl::candidates(None, &[], None, true);
    }
    let chosen = cands.first().map(|c| c.path.clone());
    if let Some(c) = cands.first() {
        tracing::debug!(
            "preflight uses {} NCCL at {}",
            c.source.describe(),
            c.path.display()
        );
    }
    let explicit = pf.nccl_lib.clone();
    // Each other library's version is read by a separate nrun process: two libraries with the
    // same soname should not share one process.
    let others = tokio::spawn(async move {
        if !listed_system {
            cands = preflight::nccl::candidates(
                explicit.as_deref(),
                &python_paths,
                ld.as_deref(),
                true,
            );
        }
        let exe = std::env::current_exe().ok();
        let mut lines = Vec::new();
        for c in cands.iter().skip(1) {
            let version = match &exe {
                Some(exe) => tokio::process::Command::new(exe)
                    .arg("__nccl-version")
                    .arg(&c.path)
                    .output()
                    .await
                    .ok()
                    .filter(|o| o.status.success())
                    .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()),
                None => None,
            };
            lines.push(format!(
                "NCCL {} at {} ({}; not used)",
                version.as_deref().unwrap_or("?"),
                c.path.display(),
                c.source.describe()
            ));
        }
        lines
    });
    (chosen, others)
}

/// One WorkerCmd per local rank. `logs` says whether the job's log files and console filters
/// apply (the preflight's ranks write no log files).
#[allow(clippy::too_many_arguments)]
fn build_workers(
    plan: &Plan,
    attempt: u32,
    sa: &StoreAddr,
    temp_root: &Path,
    program: &std::ffi::OsStr,
    args: &[std::ffi::OsString],
    extra_env: &[(String, String)],
    logs: bool,
) -> Result<Vec<WorkerCmd>> {
    let prefixed = plan.world_size() > 1;
    let width = (plan.world_size().saturating_sub(1)).to_string().len();
    let mut workers = Vec::with_capacity(plan.nproc);
    for local_rank in 0..plan.nproc {
        let rank = plan.node_rank * plan.nproc + local_rank;
        let log_dir = plan
            .log
            .dir
            .as_ref()
            .filter(|_| logs)
            .map(|d| plan.worker_dir(d, attempt, local_rank));
        let err_dir = log_dir
            .clone()
            .unwrap_or_else(|| plan.worker_dir(temp_root, attempt, local_rank));
        std::fs::create_dir_all(&err_dir).map_err(|e| {
            Error::usage(format!(
                "cannot create log directory {}: {e}",
                err_dir.display()
            ))
        })?;
        let error_file = err_dir.join("error.json");
        let mut env = plan.worker_env(&WorkerSlot {
            local_rank,
            restart_count: attempt,
            master_addr: &sa.addr,
            master_port: sa.port,
            error_file: &error_file,
        });
        env.extend(extra_env.iter().cloned());
        env.extend(static_interface_env(plan, sa));
        let redirected = if logs {
            plan.log.redirects.for_rank(local_rank)
        } else {
            Default::default()
        };
        let shown = !logs
            || plan
                .log
                .console_ranks
                .as_ref()
                .is_none_or(|s| s.contains(&local_rank));
        let sink = |redirect: bool, name: &str| -> Result<Sink> {
            let file = match &log_dir {
                Some(d) => Some(create_log(&d.join(name))?),
                None => None,
            };
            Ok(Sink {
                console: shown && !redirect,
                file,
            })
        };
        workers.push(WorkerCmd {
            rank,
            local_rank,
            program: program.to_os_string(),
            args: args.to_vec(),
            env,
            error_file,
            output: WorkerOutput {
                prefix: if prefixed {
                    format!("[rank{rank:>width$}]: ")
                } else {
                    String::new()
                },
                colour: rank,
                sinks: [
                    sink(redirected.stdout(), "stdout.log")?,
                    sink(redirected.stderr(), "stderr.log")?,
                ],
            },
        });
    }
    Ok(workers)
}

fn create_log(p: &PathBuf) -> Result<File> {
    File::create(p)
        .map_err(|e| Error::usage(format!("cannot create log file {}: {e}", p.display())))
}

/// Writes `--report FILE` as pretty JSON.
pub fn write_report(path: &Path, json: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(json).unwrap_or_default();
    std::fs::write(path, text + "\n")
        .map_err(|e| Error::usage(format!("cannot write --report {}: {e}", path.display())))
}

/// torchrun-style static multi-node (`--nnodes N` on every node): the interface this node uses
/// to reach node 0's store becomes NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME, unless the user set
/// them. Left to themselves, gloo and NCCL pick by hostname lookup and often end up on loopback
/// or the wrong network.
fn static_interface_env(plan: &Plan, sa: &StoreAddr) -> Vec<(String, String)> {
    if plan.nnodes < 2 {
        return Vec::new();
    }
    let Some(target) = (sa.addr.as_str(), sa.port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
    else {
        return Vec::new();
    };
    // A connected UDP socket sends nothing; it only asks the kernel for the route's source.
    let bind: SocketAddr = if target.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let local = std::net::UdpSocket::bind(bind)
        .and_then(|u| u.connect(target).and_then(|_| u.local_addr()));
    let ifs = crate::net::interfaces();
    let Some(name) = local
        .ok()
        .and_then(|l| crate::net::owner(&ifs, l.ip()))
        .map(|i| i.name.clone())
    else {
        return Vec::new();
    };
    let mut env = Vec::new();
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        env.push(("NCCL_SOCKET_IFNAME".to_string(), format!("={name}")));
    }
    if std::env::var_os("GLOO_SOCKET_IFNAME").is_none() {
        env.push(("GLOO_SOCKET_IFNAME".to_string(), name));
    }
    env
}
