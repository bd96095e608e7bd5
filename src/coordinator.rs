//! The phases of a run, wired together; deliberately thin. Today: plan -> bind the store ->
//! attempts of the local worker group -> summary and exit code.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, exit};
use crate::node::output::{Sink, WorkerOutput};
use crate::node::{self, Outcome, Signals, WorkerCmd};
use crate::plan::{Plan, StorePlan, WorkerSlot};
use crate::report;
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

/// Runs the job to its end and returns nrun's exit code.
pub async fn run(plan: Plan, listener: Option<std::net::TcpListener>) -> Result<u8> {
    let mut signals = Signals::install()?;
    node::process::become_subreaper();

    let (master_addr, master_port, store, stop_store) = match (&plan.store, listener) {
        (StorePlan::Host { advertise, .. }, Some(l)) => {
            let port = l
                .local_addr()
                .map_err(|e| Error::internal(e.to_string()))?
                .port();
            let l = tokio::net::TcpListener::from_std(l)
                .map_err(|e| Error::internal(format!("store listener: {e}")))?;
            let store = Store::new();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let served = store.clone();
            tokio::spawn(async move {
                store::server::serve(l, served, async {
                    let _ = rx.await;
                })
                .await
            });
            (advertise.clone(), port, Some(store), Some(tx))
        }
        (StorePlan::Remote { addr, port }, _) => (addr.clone(), *port, None, None),
        (StorePlan::Host { .. }, None) => return Err(Error::internal("store was not bound")),
    };
    tracing::debug!("store at {master_addr}:{master_port}");
    if plan.set_omp_threads {
        tracing::info!(
            "OMP_NUM_THREADS was unset; set to 1 for each of the {} workers (as torchrun does); set \
             it yourself to tune",
            plan.nproc
        );
    }

    let temp_root = std::env::temp_dir().join(format!("nrun-{}", std::process::id()));
    if plan.log.dir_is_temp {
        if let Some(d) = &plan.log.dir {
            tracing::info!("worker logs go to {}", d.display());
        }
    }
    let host = nix::unistd::gethostname()
        .map_or_else(|_| "localhost".into(), |h| h.to_string_lossy().into_owned());
    let program = std::iter::once(plan.program.to_string_lossy())
        .chain(plan.args.iter().map(|a| a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ");

    let mut code = exit::SUCCESS;
    for attempt in 0..=plan.max_restarts {
        if attempt > 0 {
            if let Some(s) = &store {
                s.clear();
            }
        }
        let workers = build_workers(&plan, attempt, &master_addr, master_port, &temp_root)?;
        let outcome = node::run_group(workers, plan.shutdown_timeout, &mut signals).await?;
        match outcome {
            Outcome::Success => {
                code = exit::SUCCESS;
                break;
            }
            Outcome::Interrupted(sig) => {
                tracing::warn!(
                    "stopped by {}; every worker was stopped",
                    node::signal_name(sig)
                );
                code = exit::signal(sig);
                break;
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
    if let Some(tx) = stop_store {
        let _ = tx.send(());
    }
    let _ = std::fs::remove_dir_all(&temp_root);
    Ok(code)
}

fn build_workers(
    plan: &Plan,
    attempt: u32,
    master_addr: &str,
    master_port: u16,
    temp_root: &Path,
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
        let env = plan.worker_env(&WorkerSlot {
            local_rank,
            restart_count: attempt,
            master_addr,
            master_port,
            error_file: &error_file,
        });
        let redirected = plan.log.redirects.for_rank(local_rank);
        let shown = plan
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
            program: plan.program.clone(),
            args: plan.args.clone(),
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
