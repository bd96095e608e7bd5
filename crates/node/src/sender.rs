//! Who sent a signal nrun passes on. Slurm signals every process of an srun step (`scancel -s`,
//! srun passing on a signal it got), not nrun alone: with proctrack/cgroup or proctrack/linuxproc
//! nrun's workers on every node have it from slurmstepd already, and passing it on again kills a
//! worker that handled the first and is exiting (its handlers back to the default). Measured:
//! the ranks got SIGUSR1 from slurmstepd and again from nrun 1 ms later. A signal from anyone
//! else (`kill -USR1 <nrun>`) reached nrun alone and is passed on as before. The keeper, which
//! Slurm signals too, passes none of those on to nrun ([`crate::keeper`]).

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

/// The pid of the slurmstepd whose step this nrun is a task of, where that step's process
/// tracking reaches nrun's workers; 0 elsewhere.
static STEPD: AtomicI32 = AtomicI32::new(0);

/// Per signal number: copies from [`STEPD`], and from anyone else, since last looked at.
static FROM_STEP: [AtomicU32; 65] = [const { AtomicU32::new(0) }; 65];
static OTHER: [AtomicU32; 65] = [const { AtomicU32::new(0) }; 65];

/// Notes the sender of every `sig` from now on, where nrun is a task of an srun step (else
/// nothing to note). To be called before tokio's handler for `sig` is registered, so the copy
/// is noted before the stream that reports it wakes.
pub(crate) fn watch(sig: i32) {
    let Some(stepd) = step_daemon() else {
        return;
    };
    STEPD.store(stepd, Ordering::Relaxed);
    let Some(slot) = usize::try_from(sig).ok().filter(|&s| s < FROM_STEP.len()) else {
        return;
    };
    // SAFETY: the action only reads the siginfo (si_pid is set for SI_USER, the only code it
    // is compared under) and adds to atomics: async-signal-safe.
    let registered = unsafe {
        signal_hook_registry::register_sigaction(sig, move |info: &libc::siginfo_t| {
            let stepd = STEPD.load(Ordering::Relaxed);
            let from = info.si_pid();
            let counter = match info.si_code == libc::SI_USER && stepd != 0 && from == stepd {
                true => &FROM_STEP[slot],
                false => &OTHER[slot],
            };
            counter.fetch_add(1, Ordering::Relaxed);
        })
    };
    if let Err(e) = registered {
        // Not fatal: every copy is passed on, as where nothing notes them.
        tracing::debug!("cannot note who sends signal {sig}: {e}");
    }
}

/// Whether every copy of `sig` since the last look came from the step's slurmstepd, which
/// signalled the workers too (none noted: not known, so no).
pub(crate) fn from_step(sig: i32) -> bool {
    let Some(slot) = usize::try_from(sig).ok().filter(|&s| s < FROM_STEP.len()) else {
        return false;
    };
    let step = FROM_STEP[slot].swap(0, Ordering::Relaxed);
    let other = OTHER[slot].swap(0, Ordering::Relaxed);
    step > 0 && other == 0
}

/// The slurmstepd this process (nrun, or its keeper) runs under as a task of an srun step (numbered; the batch step
/// signals the script's process group alone), when its ProctrackType reaches the workers:
/// proctrack/pgid signals the task's process group, and each worker leads its own.
/// Looked up once per process (slurm.conf and /proc read once, not per signal caught).
pub(crate) fn step_daemon() -> Option<i32> {
    static STEP_DAEMON: std::sync::OnceLock<Option<i32>> = std::sync::OnceLock::new();
    *STEP_DAEMON.get_or_init(find_step_daemon)
}

fn find_step_daemon() -> Option<i32> {
    let step: u32 = std::env::var("SLURM_STEP_ID").ok()?.trim().parse().ok()?;
    // Slurm's special steps (batch, extern, interactive) are numbered from 0xfffffff0 up.
    if step >= 0xffff_fff0 || proctrack_pgid() {
        return None;
    }
    // The keeper (nrun's parent), or a shell srun started it under (srun bash -c 'nrun ...').
    let mut pid = std::os::unix::process::parent_id() as i32;
    for _ in 0..4 {
        if pid <= 1 {
            return None;
        }
        if comm(pid).as_deref() == Some("slurmstepd") {
            return Some(pid);
        }
        pid = parent(pid)?;
    }
    None
}

/// Whether the node's slurm.conf (SLURM_CONF, else /etc/slurm/slurm.conf) says
/// ProctrackType=proctrack/pgid. Unreadable: the default, proctrack/cgroup.
fn proctrack_pgid() -> bool {
    let path = std::env::var_os("SLURM_CONF").unwrap_or_else(|| "/etc/slurm/slurm.conf".into());
    let Ok(conf) = std::fs::read_to_string(path) else {
        return false;
    };
    conf.lines().any(|l| {
        let l = l.split('#').next().unwrap_or("");
        let Some((k, v)) = l.split_once('=') else {
            return false;
        };
        k.trim().eq_ignore_ascii_case("ProctrackType")
            && v.trim().eq_ignore_ascii_case("proctrack/pgid")
    })
}

fn comm(pid: i32) -> Option<String> {
    let c = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(c.trim_end().to_string())
}

/// A process's parent, from /proc/PID/stat (after the command's closing parenthesis).
fn parent(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_from_anyone_else_is_passed_on() {
        let sig = libc::SIGRTMIN() + 3;
        let slot = sig as usize;
        assert!(!from_step(sig), "nothing noted: not known");
        FROM_STEP[slot].fetch_add(1, Ordering::Relaxed);
        assert!(from_step(sig));
        assert!(!from_step(sig), "looked at once");
        FROM_STEP[slot].fetch_add(1, Ordering::Relaxed);
        OTHER[slot].fetch_add(1, Ordering::Relaxed);
        assert!(!from_step(sig), "a copy sent to nrun alone is passed on");
    }
}
