//! The preflight plan: which preflight runs before the job (if any), its checks and its
//! all-reduce sweep (shared with bisect's probes), and what each of its ranks is told.

use std::path::PathBuf;
use std::time::Duration;

use nrun_base::error::{Error, Result};
use nrun_cli::{PreflightArgs, SweepArgs};

use super::Env;
use super::parse::{positive_secs, visible_gpus};

/// The preflight, when one runs.
#[derive(Clone, Debug)]
pub(crate) struct PreflightPlan {
    pub mode: nrun_preflight::Mode,
    /// Start the job even if the preflight fails.
    pub warn_only: bool,
    pub min_bytes: u64,
    pub max_bytes: u64,
    pub factor: u64,
    pub iters: u32,
    pub warmup: u32,
    pub timeout: Duration,
    pub min_busbw: Option<f64>,
    /// Slow under this fraction of the links' line rate (one node).
    pub min_efficiency: f64,
    /// GPU health checks not to fail on.
    pub waived: Vec<nrun_preflight::hardware::Waiver>,
    pub report: Option<PathBuf>,
    pub nccl_lib: Option<PathBuf>,
    pub loopback: bool,
}

/// The job's preflight: which one runs (if any) and its sweep.
pub(super) fn resolve_preflight(
    args: &PreflightArgs,
    env: Env<'_>,
) -> Result<Option<PreflightPlan>> {
    use nrun_preflight::Mode;
    let PreflightArgs {
        preflight,
        no_preflight,
        preflight_only,
        sweep,
        min_busbw,
        min_efficiency,
        waive,
        report,
        preflight_loopback,
    } = args;
    // Checked whether or not a preflight runs: a bad value is a bad value.
    if let Some(b) = min_busbw.filter(|b| !(b.is_finite() && *b >= 0.0)) {
        return Err(Error::usage(format!(
            "--min-busbw {b} must be a non-negative number of GB/s (finite, 0 or more)"
        )));
    }
    if !(min_efficiency.is_finite() && (0.0..=1.0).contains(min_efficiency)) {
        return Err(Error::usage(format!(
            "--min-efficiency {min_efficiency} must be a fraction in [0, 1] (0 turns it off)"
        )));
    }
    let mut mode: Option<Option<Mode>> = None;
    let mut warn_only = false;
    for part in preflight
        .as_deref()
        .unwrap_or("auto")
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part {
            "warn" => warn_only = true,
            "auto" => {}
            "nccl" => mode = Some(Some(Mode::Nccl)),
            "net" => mode = Some(Some(Mode::Net)),
            "off" | "none" => mode = Some(None),
            other => {
                return Err(Error::usage(format!(
                    "--preflight {other:?}: expected auto, nccl, net or off, optionally with ,warn"
                )));
            }
        }
    }
    if *no_preflight {
        if *preflight_only {
            return Err(Error::usage(
                "--no-preflight and --preflight-only exclude each other",
            ));
        }
        if let (Some(p), Some(Some(_))) = (preflight, mode) {
            return Err(Error::usage(format!(
                "--no-preflight and --preflight {p} exclude each other: one skips the preflight, \
                 the other asks for it; give one of them"
            )));
        }
        mode = Some(None);
    }
    let mode = match mode {
        Some(m) => m,
        // auto: NCCL where GPUs are visible; elsewhere a job needs no GPU preflight.
        None => (visible_gpus(env) > 0).then_some(Mode::Nccl),
    };
    let Some(mode) = mode else {
        // Flags of a preflight that does not run are still checked: a typo is still a typo.
        sweep_plan(sweep, nrun_preflight::Mode::Net)?;
        if *preflight_only {
            return Err(Error::usage(
                "--preflight-only: no GPU is visible here for the NCCL preflight; use --preflight net \
                 to test the network path alone",
            ));
        }
        return Ok(None);
    };
    let mut pf = sweep_plan(sweep, mode)?;
    pf.warn_only = warn_only;
    pf.min_busbw = *min_busbw;
    pf.min_efficiency = *min_efficiency;
    for w in waive
        .iter()
        .flat_map(|w| w.split(','))
        .map(str::trim)
        .filter(|w| !w.is_empty())
    {
        pf.waived.push(w.parse()?);
    }
    pf.report = report.clone();
    pf.loopback = *preflight_loopback;
    Ok(Some(pf))
}

/// The all-reduce sweep of a preflight or a bisect probe.
pub(super) fn sweep_plan(sweep: &SweepArgs, mode: nrun_preflight::Mode) -> Result<PreflightPlan> {
    let SweepArgs {
        preflight_sizes,
        iters,
        warmup,
        preflight_timeout,
        nccl_lib,
    } = sweep;
    let net = mode == nrun_preflight::Mode::Net;
    let (min_bytes, max_bytes, factor) = match preflight_sizes {
        Some(s) => nrun_preflight::parse_sizes(s)?,
        None if net => (8, 16 << 20, 4),
        None => (8, 256 << 20, 2),
    };
    let timeout = positive_secs("--preflight-timeout", *preflight_timeout, false)?;
    if let Some(p) = nccl_lib
        && !p.is_file()
    {
        return Err(Error::usage(format!(
            "--nccl-lib {}: no such file",
            p.display()
        )));
    }
    Ok(PreflightPlan {
        mode,
        warn_only: false,
        min_bytes,
        max_bytes,
        factor,
        iters: match iters {
            Some(0) => {
                return Err(Error::usage(
                    "--iters 0: at least one timed all-reduce per size is needed",
                ));
            }
            Some(n) => *n,
            None if net => 5,
            None => 20,
        },
        warmup: warmup.unwrap_or(if net { 1 } else { 5 }),
        timeout,
        min_busbw: None,
        min_efficiency: 0.0,
        waived: Vec::new(),
        report: None,
        nccl_lib: nccl_lib.clone(),
        loopback: false,
    })
}

impl PreflightPlan {
    /// What every preflight rank is told; `id` keeps runs sharing a store apart.
    pub(crate) fn settings(
        &self,
        id: String,
        nccl_lib: Option<PathBuf>,
        listen_addr: String,
    ) -> nrun_preflight::Settings {
        nrun_preflight::Settings {
            id,
            mode: self.mode,
            min_bytes: self.min_bytes,
            max_bytes: self.max_bytes,
            factor: self.factor,
            iters: self.iters,
            warmup: self.warmup,
            timeout_ms: self.timeout.as_millis() as u64,
            nccl_lib,
            listen_addr,
            links: true,
            host: None,
        }
    }
}
