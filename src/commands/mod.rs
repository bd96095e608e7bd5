//! One file per command, each on top of a [`crate::session::Session`]:
//! - [`run`]: the job (the default command): join, check, preflight, attempts.
//! - [`preflight`]: the preflight phase, and the one place a preflight's reports are gathered
//!   and summarized (the job's and bisect's probes).
//! - [`doctor`]: facts and checks, running nothing.
//! - [`bisect`]: the staged scale-up.

pub mod bisect;
pub mod doctor;
pub mod preflight;
pub mod run;

use crate::error::{Error, Result};
use crate::plan::Mode;

/// Runs what the command line asked for; returns nrun's exit code.
pub fn execute(mode: Mode) -> Result<u8> {
    let listener = match &mode {
        Mode::Run { plan, .. } | Mode::Bisect { plan, .. } | Mode::Doctor { plan, .. } => {
            crate::session::bind_store(plan)?
        }
    };
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(1, 4);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|e| Error::internal(format!("cannot start the async runtime: {e}")))?;
    // The command's future runs on this (main) thread; in-process workers are spawned from it,
    // which their PR_SET_PDEATHSIG relies on.
    match mode {
        Mode::Run { plan, nodes } => rt.block_on(run::run(&plan, &nodes, listener)),
        Mode::Doctor { plan, nodes } => rt.block_on(doctor::run(&plan, &nodes, listener)),
        Mode::Bisect {
            plan,
            nodes,
            bisect,
        } => rt.block_on(bisect::run(&plan, &nodes, &bisect, listener)),
    }
}
