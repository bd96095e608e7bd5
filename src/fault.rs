//! The fault model: what nrun can see when an attempt of the worker group fails (evidence), what
//! it concludes about each node (verdict), and what it does under the job's policy (action).
//!
//! One table, written down in README ("Fault model", the verdicts) and docs/fault-model.md (the
//! verdicts and the fault matrix), and checked twice: the unit tests below (the rules, on
//! synthetic results) and `tests/faults.rs` (the matrix: real processes, every mode, read from
//! docs/fault-model.md). A change of rule changes all of them.
//!
//! The rules, in short:
//! - torchrun's behaviour is the floor: where it would restart the group (any worker failure,
//!   within `--max-restarts`), nrun restarts it, spare or not, one node or many.
//! - A suspicion is not a verdict: a worker killed by the system (SIGKILL, SIGBUS: the OOM
//!   killer, a cgroup, the node), a soft GPU error in its last words, or a hang the watch pins
//!   on one node's ranks suspects that node; the group restarts in place. The same node
//!   suspected a second time in the job is node-level evidence.
//! - Node-level evidence: the agent or link lost, a hard GPU/driver fault (XID, ECC, a GPU
//!   fallen off the bus or lost), a second suspicion. Such a node is left out where the job can
//!   go on without it (a spare takes its place, or an elastic job shrinks within MIN); a lost
//!   node is left out always (nothing runs there). Only node-level evidence reaches
//!   `--exclude-file`.
//! - The same sign on several nodes at once is the program's (or the network's), not a node's.
//!
//! Checks before the job (join, facts, interfaces, ring, GPU health, preflight) leave nodes out
//! on their own evidence (session::roster, commands::run::ready); this module judges attempts.

use std::collections::BTreeMap;

use crate::protocol::{Ending, GpuSign, RunResult, StepResult, WorkerFailure};

/// What one node's result of a failed attempt says about the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Evidence {
    /// Nothing against it: its workers exited 0, or nrun stopped them.
    Clear,
    /// A worker's own ending: an exit code, an exception, a signal programs bring on themselves
    /// (SIGSEGV, SIGABRT, SIGFPE, SIGILL, a SIGTERM of its own...).
    Program(String),
    /// A worker killed by the system: SIGKILL or SIGBUS (the OOM killer, a cgroup, the node).
    Killed(String),
    /// A GPU error in a worker's last words that a program can cause too ("unhandled cuda
    /// error", "unspecified launch failure").
    SoftGpu(String),
    /// A GPU or driver fault no program causes: an XID, an ECC error, a GPU lost or fallen off
    /// the bus.
    HardGpu(String),
    /// The node's agent or its link was lost.
    Lost(String),
    /// The watch pinned a hang on this node's ranks alone.
    Hang(String),
}

/// What nrun concludes about a node from its evidence and its history in the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The program's doing: the node is not at fault.
    Program,
    /// The node may be at fault; once is not enough to act on it.
    Suspect,
    /// Node-level evidence: left out where the job can go on without it; --exclude-file.
    Faulty,
    /// Nothing runs there any more: left out.
    Lost,
}

impl Verdict {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Verdict::Program => "the program's",
            Verdict::Suspect => "node suspected",
            Verdict::Faulty => "node at fault",
            Verdict::Lost => "node lost",
        }
    }
}

/// What the job allows after a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Policy {
    /// --max-restarts not used up.
    pub restart_left: bool,
    /// Spares joined and waiting.
    pub spares: usize,
    /// Nodes the job may lose and still run (elastic: active - MIN; 0 otherwise).
    pub room: usize,
}

/// What nrun does after a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// The group starts again: in place, with spares for the nodes left out, or shrunk.
    Restart,
    /// The job ends with the failure's exit code.
    Stop,
    /// The job ends short of a node: one was lost and no restart is left: exit 98, too few
    /// healthy nodes (with a restart left, the roster looks for its place, and finding none is
    /// exit 98 too).
    StopShort,
}

/// The judgement of one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Judged {
    pub node: usize,
    pub verdict: Verdict,
    /// The evidence in words ("rank 3 was killed by SIGKILL: ...").
    pub why: String,
}

/// The decision after a failed attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Decision {
    /// Every node with evidence (not Clear), in node order.
    pub judged: Vec<Judged>,
    /// Nodes to leave out now, with the evidence.
    pub leave_out: Vec<(usize, String)>,
    /// Nodes with node-level evidence that stay (no spare, no room): remembered at the end
    /// (--exclude-file, --report), restarted in place meanwhile (torchrun's floor).
    pub kept: Vec<(usize, String)>,
    pub action: Action,
}

/// The job's memory of suspicions: a second one of the same node is node-level evidence.
#[derive(Clone, Debug, Default)]
pub(crate) struct History {
    suspected: BTreeMap<usize, u32>,
}

impl History {
    #[cfg(test)]
    pub(crate) fn times_suspected(&self, node: usize) -> u32 {
        self.suspected.get(&node).copied().unwrap_or(0)
    }
}

/// The evidence one node's result gives.
pub(crate) fn evidence(r: Option<&StepResult>) -> Evidence {
    evidence_worded(r, &|e| e.to_string())
}

/// [`evidence`], with a worker's ending said by `words`: the evidence's kind is read from the
/// types alone (the ending, the GPU signs its node read), never from the words, which only
/// go into the evidence's text for the console and the report.
fn evidence_worded(r: Option<&StepResult>, words: &dyn Fn(&Ending) -> String) -> Evidence {
    match r {
        Some(StepResult::Run(RunResult::Lost(why))) => Evidence::Lost(why.clone()),
        Some(StepResult::Run(RunResult::Failed(f))) => worker_evidence(f, words),
        Some(StepResult::Run(RunResult::SpawnError(e))) => {
            Evidence::Program(format!("its workers could not start: {e}"))
        }
        Some(StepResult::Run(RunResult::TimedOut)) => {
            Evidence::Program("its workers ran past their deadline".into())
        }
        _ => Evidence::Clear,
    }
}

fn worker_evidence(f: &WorkerFailure, words: &dyn Fn(&Ending) -> String) -> Evidence {
    let who = format!("rank {} {}", f.rank, words(&f.how));
    match (f.gpu.as_deref(), &f.how) {
        (Some(GpuSign::Hard(line)), _) => {
            Evidence::HardGpu(format!("{who}: its output shows a GPU fault: {line}"))
        }
        // The node's agent names an OOM kill where it knows.
        (_, Ending::OutOfMemory(_)) => Evidence::Killed(who),
        (_, how) if how.by_the_system() => Evidence::Killed(format!(
            "{who}: killed by the system (out of memory, a cgroup, or the node)"
        )),
        (Some(GpuSign::Soft(line)), _) => {
            Evidence::SoftGpu(format!("{who}: its output shows a GPU error: {line}"))
        }
        _ => Evidence::Program(who),
    }
}

/// Judges an attempt's evidence (one per node of the job, in node order; a hang the watch
/// pinned on one node's ranks comes as that node's [`Evidence::Hang`]) and decides under
/// `policy`. Records the suspicions in `history`.
pub(crate) fn decide(
    results: &[(usize, Evidence)],
    history: &mut History,
    policy: Policy,
) -> Decision {
    // A sign that points at a node only counts when one node shows it: the same on several
    // nodes is the program's (or the fabric's), and their failures are its consequences.
    let pointing = results
        .iter()
        .filter(|(_, e)| {
            matches!(
                e,
                Evidence::Killed(_) | Evidence::SoftGpu(_) | Evidence::HardGpu(_)
            )
        })
        .count();
    let mut judged = Vec::new();
    for (node, e) in results {
        let (verdict, why) = match e {
            Evidence::Clear => continue,
            Evidence::Program(w) => (Verdict::Program, w.clone()),
            Evidence::Lost(w) => (Verdict::Lost, w.clone()),
            Evidence::Killed(w) | Evidence::SoftGpu(w) | Evidence::HardGpu(w) if pointing > 1 => (
                Verdict::Program,
                format!("{w} (on {pointing} nodes at once: the program's)"),
            ),
            Evidence::HardGpu(w) => (Verdict::Faulty, w.clone()),
            Evidence::Killed(w) | Evidence::SoftGpu(w) | Evidence::Hang(w) => {
                let n = history.suspected.entry(*node).or_insert(0);
                *n += 1;
                match *n {
                    1 => (Verdict::Suspect, w.clone()),
                    k => (
                        Verdict::Faulty,
                        format!("{w} (suspected {k} times in this job)"),
                    ),
                }
            }
        };
        judged.push(Judged {
            node: *node,
            verdict,
            why,
        });
    }
    let lost: Vec<(usize, String)> = judged
        .iter()
        .filter(|j| j.verdict == Verdict::Lost)
        .map(|j| (j.node, j.why.clone()))
        .collect();
    // Faulty nodes leave where something can take their place (after the lost ones, which
    // leave in any case); the rest stay and are restarted in place.
    let mut places = (policy.spares + policy.room).saturating_sub(lost.len());
    let mut leave_out = lost.clone();
    let mut kept = Vec::new();
    for j in judged.iter().filter(|j| j.verdict == Verdict::Faulty) {
        match places > 0 {
            true => {
                places -= 1;
                leave_out.push((j.node, j.why.clone()));
            }
            false => kept.push((j.node, j.why.clone())),
        }
    }
    // A lost node ends the job unless the group restarts without it; whether a place is
    // found for it (a spare, a node that joined since, elastic room) is the roster's to say
    // (Session::reform: too few is exit 98).
    let action = match (policy.restart_left, lost.is_empty()) {
        (true, _) => Action::Restart,
        (false, false) => Action::StopShort,
        (false, true) => Action::Stop,
    };
    Decision {
        judged,
        leave_out,
        kept,
        action,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Oom;
    use nrun_node::Exit;

    fn failure(rank: usize, how: Ending, tail: &[&str]) -> Option<StepResult> {
        Some(StepResult::Run(RunResult::Failed(
            WorkerFailure {
                rank,
                local_rank: 0,
                pid: 1,
                exit_code: 1,
                how,
                gpu: None,
                at: String::new(),
                stderr_tail: tail.iter().map(|s| s.to_string()).collect(),
                traceback: None,
                error_file: Default::default(),
                left_early: Vec::new(),
                error_json: None,
                error_file_kept: false,
                progress: None,
            }
            .with_signs(),
        )))
    }

    const EXIT1: Ending = Ending::Exit(Exit::Code(1));
    const KILL: Ending = Ending::Exit(Exit::Signal(libc::SIGKILL));
    const BUS: Ending = Ending::Exit(Exit::Signal(libc::SIGBUS));
    const SEGV: Ending = Ending::Exit(Exit::Signal(libc::SIGSEGV));

    fn oom() -> Ending {
        Ending::OutOfMemory(Box::new(Oom::Kernel {
            rss: "123456kB".into(),
        }))
    }

    fn ev(rs: &[Option<StepResult>]) -> Vec<(usize, Evidence)> {
        rs.iter()
            .enumerate()
            .map(|(i, r)| (i, evidence(r.as_ref())))
            .collect()
    }

    const NO_SPARE: Policy = Policy {
        restart_left: true,
        spares: 0,
        room: 0,
    };
    const SPARE: Policy = Policy {
        restart_left: true,
        spares: 1,
        room: 0,
    };
    const LAST: Policy = Policy {
        restart_left: false,
        spares: 1,
        room: 0,
    };

    fn stopped() -> Option<StepResult> {
        Some(StepResult::Run(RunResult::Stopped))
    }

    fn lost() -> Option<StepResult> {
        Some(StepResult::Run(RunResult::Lost(
            "lost b: no heartbeat".into(),
        )))
    }

    #[test]
    fn the_programs_failure_restarts_in_place_and_leaves_nobody_out() {
        let r = [
            failure(0, EXIT1, &["ValueError: bad"]),
            failure(1, EXIT1, &["ValueError: bad"]),
        ];
        for p in [NO_SPARE, SPARE] {
            let d = decide(&ev(&r), &mut History::default(), p);
            assert_eq!(d.action, Action::Restart);
            assert!(d.leave_out.is_empty() && d.kept.is_empty(), "{d:?}");
            assert!(d.judged.iter().all(|j| j.verdict == Verdict::Program));
        }
        // A segfault is a bug as often as not: the program's.
        let r = [stopped(), failure(1, SEGV, &[])];
        let d = decide(&ev(&r), &mut History::default(), SPARE);
        assert_eq!(d.judged[0].verdict, Verdict::Program);
        assert!(d.leave_out.is_empty());
        // No restart left: the job stops with the worker's code.
        let d = decide(&ev(&r), &mut History::default(), LAST);
        assert_eq!(d.action, Action::Stop);
    }

    #[test]
    fn a_worker_killed_by_the_system_is_a_suspicion_restarted_in_place() {
        // On one node, with or without a spare: the group restarts in place (torchrun would).
        let r = [stopped(), failure(1, KILL, &[])];
        for p in [NO_SPARE, SPARE] {
            let mut h = History::default();
            let d = decide(&ev(&r), &mut h, p);
            assert_eq!(d.action, Action::Restart);
            assert_eq!(d.judged[0].verdict, Verdict::Suspect);
            assert!(d.leave_out.is_empty() && d.kept.is_empty(), "{d:?}");
            assert!(d.judged[0].why.contains("killed by the system"), "{d:?}");
            // The same node again: node-level evidence, out where a spare can take its place.
            let d = decide(&ev(&r), &mut h, p);
            assert_eq!(d.judged[0].verdict, Verdict::Faulty);
            assert!(d.judged[0].why.contains("suspected 2 times"), "{d:?}");
            assert_eq!(d.action, Action::Restart);
            match p.spares {
                0 => assert_eq!((d.leave_out.len(), d.kept.len()), (0, 1)),
                _ => assert_eq!((d.leave_out.len(), d.kept.len()), (1, 0)),
            }
        }
        // SIGBUS too; an OOM kill is named as such.
        let d = decide(
            &ev(&[failure(0, oom(), &[])]),
            &mut History::default(),
            NO_SPARE,
        );
        assert_eq!(d.judged[0].verdict, Verdict::Suspect);
        assert!(d.judged[0].why.contains("out-of-memory"), "{d:?}");
        let r = [failure(0, BUS, &[])];
        let d = decide(&ev(&r), &mut History::default(), NO_SPARE);
        assert_eq!(d.judged[0].verdict, Verdict::Suspect);
        // Killed on two nodes at once: the program's (it ate the memory everywhere).
        let r = [failure(0, KILL, &[]), failure(1, KILL, &[])];
        let d = decide(&ev(&r), &mut History::default(), SPARE);
        assert!(
            d.judged.iter().all(|j| j.verdict == Verdict::Program),
            "{d:?}"
        );
    }

    #[test]
    fn a_lost_node_is_left_out_and_its_place_taken_or_the_job_stops_short() {
        let r = [failure(0, EXIT1, &["connection closed"]), lost()];
        let d = decide(&ev(&r), &mut History::default(), SPARE);
        assert_eq!(d.action, Action::Restart);
        assert_eq!(d.leave_out, [(1, "lost b: no heartbeat".to_string())]);
        assert_eq!(d.judged[0].verdict, Verdict::Program);
        // No spare known now: the group restarts without it if the roster finds a place (a
        // node that joined since), else too few (98); no restart left: 98 at once.
        let d = decide(&ev(&r), &mut History::default(), NO_SPARE);
        assert_eq!((d.action, d.leave_out.len()), (Action::Restart, 1));
        let p = Policy {
            restart_left: false,
            ..NO_SPARE
        };
        let d = decide(&ev(&r), &mut History::default(), p);
        assert_eq!((d.action, d.leave_out.len()), (Action::StopShort, 1));
        // Elastic room: the job shrinks.
        let d = decide(
            &ev(&r),
            &mut History::default(),
            Policy {
                room: 1,
                ..NO_SPARE
            },
        );
        assert_eq!(d.action, Action::Restart);
        // No restart left, spare or not: the job ends short of the node.
        let d = decide(&ev(&r), &mut History::default(), LAST);
        assert_eq!(d.action, Action::StopShort);
    }

    #[test]
    fn a_gpu_fault_no_program_causes_is_node_level_at_once() {
        let r = [
            failure(0, EXIT1, &["RuntimeError: NCCL communicator was aborted"]),
            failure(
                1,
                EXIT1,
                &["NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"],
            ),
        ];
        let d = decide(&ev(&r), &mut History::default(), SPARE);
        assert_eq!(d.leave_out.len(), 1);
        assert_eq!(d.leave_out[0].0, 1);
        assert!(d.leave_out[0].1.contains("GPU fault"), "{d:?}");
        // No spare: restarted in place all the same, and remembered.
        let d = decide(&ev(&r), &mut History::default(), NO_SPARE);
        assert_eq!(
            (d.action, d.leave_out.len(), d.kept.len()),
            (Action::Restart, 0, 1)
        );
        // A GPU error a program causes too: a suspicion.
        let r = [
            stopped(),
            failure(
                1,
                EXIT1,
                &["DistBackendError: NCCL error: unhandled cuda error"],
            ),
        ];
        let d = decide(&ev(&r), &mut History::default(), SPARE);
        assert_eq!(d.judged[0].verdict, Verdict::Suspect);
        assert!(d.leave_out.is_empty());
        // The same error on two nodes: the program's.
        let r = [
            failure(0, EXIT1, &["unhandled cuda error"]),
            failure(1, EXIT1, &["unhandled cuda error"]),
        ];
        let d = decide(&ev(&r), &mut History::default(), SPARE);
        assert!(
            d.judged.iter().all(|j| j.verdict == Verdict::Program),
            "{d:?}"
        );
    }

    #[test]
    fn a_hang_pinned_on_one_node_is_a_suspicion_then_node_level() {
        let mut h = History::default();
        let r = [(0, Evidence::Hang("rank 1 never entered all_reduce".into()))];
        let d = decide(&r, &mut h, SPARE);
        assert_eq!(
            (d.judged[0].verdict, d.leave_out.len()),
            (Verdict::Suspect, 0)
        );
        let d = decide(&r, &mut h, SPARE);
        assert_eq!(
            (d.judged[0].verdict, d.leave_out.len()),
            (Verdict::Faulty, 1)
        );
        assert_eq!(h.times_suspected(0), 2);
    }
    /// No verdict depends on a message's words: every ending said in other words (the old
    /// words of another ending among them, which the fault model once read) gives the same
    /// table: each kind of ending's verdict, and the same sign on two nodes the program's.
    #[test]
    fn the_verdicts_hold_whatever_the_words() {
        let hard = &["NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"][..];
        let soft = &["DistBackendError: NCCL error: unhandled cuda error"][..];
        let table: [(Option<StepResult>, Verdict); 9] = [
            (failure(0, EXIT1, &[]), Verdict::Program),
            (failure(0, SEGV, &[]), Verdict::Program),
            (failure(0, KILL, &[]), Verdict::Suspect),
            (failure(0, BUS, &[]), Verdict::Suspect),
            (failure(0, oom(), &[]), Verdict::Suspect),
            (failure(0, EXIT1, hard), Verdict::Faulty),
            (failure(0, EXIT1, soft), Verdict::Suspect),
            (failure(0, KILL, hard), Verdict::Faulty),
            (lost(), Verdict::Lost),
        ];
        let wordings: [&dyn Fn(&Ending) -> String; 4] = [
            &|e| e.to_string(),
            &|e| format!("{e:?}").chars().rev().collect(),
            &|_| "was killed by SIGKILL (killed by the kernel's out-of-memory killer)".into(),
            &|_| "exited with code 0".into(),
        ];
        for words in wordings {
            let ev = |rs: &[&Option<StepResult>]| -> Vec<(usize, Evidence)> {
                rs.iter()
                    .enumerate()
                    .map(|(i, r)| (i, evidence_worded(r.as_ref(), words)))
                    .collect()
            };
            for (r, want) in &table {
                let d = decide(&ev(&[r]), &mut History::default(), SPARE);
                let said = words(&match r {
                    Some(StepResult::Run(RunResult::Failed(f))) => f.how.clone(),
                    _ => EXIT1,
                });
                assert_eq!(d.judged[0].verdict, *want, "{r:?} said as {said:?}: {d:?}");
                assert_eq!(d.action, Action::Restart);
                let out = usize::from(matches!(want, Verdict::Faulty | Verdict::Lost));
                assert_eq!(d.leave_out.len(), out, "{d:?}");
            }
            // A system kill on two nodes at once: the program's, in any words.
            let two = [&table[2].0, &failure(1, KILL, &[])];
            let d = decide(&ev(&two), &mut History::default(), SPARE);
            assert!(
                d.judged.iter().all(|j| j.verdict == Verdict::Program),
                "{d:?}"
            );
        }
    }
}
