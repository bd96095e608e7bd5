//! Whether a worker killed by SIGKILL was the out-of-memory killer's: the fault model
//! (the fault module) treats every system kill as a suspicion of the node, but the person
//! reading the summary needs to know it was memory, and how much.
//!
//! Two witnesses, each read only when a worker died of SIGKILL, each optional (a container may
//! hide both): the kernel log (`/dev/kmsg`, root or CAP_SYSLOG), whose "Killed process <pid>"
//! line gives the worker's resident memory at the kill; and the oom_kill counter of the agent's
//! memory cgroup (v2 `memory.events`, which counts its whole subtree, so workers moved below it
//! count too; v1 `memory.oom_control`), compared with its value when the workers started.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use nrun_proto::protocol::Oom;

/// The cgroup's OOM kills when the workers started.
pub(super) struct Mark {
    /// The file with the cgroup's oom_kill counter, and the one with its limit.
    events: Option<(PathBuf, PathBuf)>,
    kills: Option<u64>,
}

/// Reads the counter before the workers start.
pub(super) fn mark() -> Mark {
    let events = own_cgroup();
    let kills = events.as_ref().and_then(|(e, _)| oom_kills(e));
    Mark { events, kills }
}

/// Why worker `pid`, just dead of SIGKILL, was killed, where a witness says it was memory.
pub(super) fn explain(mark: &Mark, pid: u32) -> Option<Oom> {
    if let Some(rss) = kernel_says(pid) {
        return Some(Oom::Kernel { rss });
    }
    let ((path, limit), before) = (mark.events.as_ref()?, mark.kills?);
    let after = oom_kills(path)?;
    (after > before).then(|| Oom::Cgroup {
        limit: std::fs::read_to_string(limit)
            .map(|m| m.trim().to_string())
            .unwrap_or_else(|_| "?".into()),
        limit_file: limit.clone(),
        kills: after - before,
    })
}

/// This process's memory cgroup: the file with its oom_kill counter and the one with its limit
/// (cgroup v2, else v1's memory controller).
fn own_cgroup() -> Option<(PathBuf, PathBuf)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let v2 = text.lines().find_map(|l| l.strip_prefix("0::")).map(|rel| {
        let dir = PathBuf::from("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
        (dir.join("memory.events"), dir.join("memory.max"))
    });
    let v1 = text
        .lines()
        .find_map(|l| l.split_once(":memory:").map(|(_, rel)| rel))
        .map(|rel| {
            let dir = PathBuf::from("/sys/fs/cgroup/memory").join(rel.trim_start_matches('/'));
            (
                dir.join("memory.oom_control"),
                dir.join("memory.limit_in_bytes"),
            )
        });
    [v2, v1].into_iter().flatten().find(|(e, _)| e.exists())
}

fn oom_kills(events: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(events).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

/// The resident memory the kernel log gives for `pid`'s OOM kill ("anon-rss:123456kB").
fn kernel_says(pid: u32) -> Option<String> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .ok()?;
    let needle = format!("Killed process {pid} (");
    let mut found = None;
    let mut buf = vec![0u8; 8192];
    // One record a read, oldest first, until EAGAIN; bounded in case the log never drains.
    for _ in 0..100_000 {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                if let Some(at) = rec.find(&needle) {
                    found = Some(rec[at..].to_string());
                }
            }
            // EPIPE: records were overwritten while we read; the next read goes on.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    let line = found?;
    let rss = line
        .split([',', ' '])
        .find_map(|w| w.strip_prefix("anon-rss:"))
        .map(
            |v| match v.strip_suffix("kB").and_then(|k| k.parse::<u64>().ok()) {
                Some(kb) => format!("{} MiB", kb / 1024),
                None => v.to_string(),
            },
        );
    Some(rss.unwrap_or_else(|| "memory unknown".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_witness_says_nothing() {
        // A pid no kernel line names, and a counter that did not move.
        let m = Mark {
            events: None,
            kills: None,
        };
        assert_eq!(explain(&m, u32::MAX), None);
        let dir = tempfile::tempdir().unwrap();
        let ev = dir.path().join("memory.events");
        std::fs::write(&ev, "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n").unwrap();
        let m = Mark {
            events: Some((ev.clone(), dir.path().join("memory.max"))),
            kills: oom_kills(&ev),
        };
        assert_eq!(m.kills, Some(1));
        assert_eq!(explain(&m, u32::MAX), None);
        // The counter moved: the cgroup's OOM killer, with its limit.
        std::fs::write(&ev, "oom_kill 2\n").unwrap();
        std::fs::write(dir.path().join("memory.max"), "268435456\n").unwrap();
        let why = explain(&m, u32::MAX).unwrap();
        assert_eq!(
            why,
            Oom::Cgroup {
                limit_file: dir.path().join("memory.max"),
                limit: "268435456".into(),
                kills: 1
            }
        );
        // Said as the summary says it.
        let said = why.to_string();
        assert!(said.contains("memory.max: 268435456"), "{said}");
        assert!(said.contains("1 OOM kill(s)"), "{said}");
    }
}
