//! Findings: what each preflight check saw, as data. A check is a small function from what the
//! ranks reported to findings; [`verdict`] folds them into the verdict (and its exit code), the
//! summary prints them (facts in the report's body, then problems, then hints), and the JSON
//! report's `problems` and `hints` are theirs.

use serde::Serialize;

use super::Verdict;
use super::hardware::Waiver;

/// Which check found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Check {
    /// The NCCL every rank loaded.
    Nccl,
    /// An error a rank reported.
    RankError,
    /// A rank that never reported.
    Silent,
    /// A rank that crashed.
    Crash,
    /// Ranks missing from the reports, with nothing else to explain it.
    Reports,
    /// Wrong all-reduce results.
    Results,
    /// Each node's busbw against the median node's.
    NodeSpeed,
    /// NVLink links up on each GPU of a node.
    Nvlink,
    /// The busbw against the line rate of the job's links.
    LineRate,
    /// The path NCCL took.
    NcclPath,
    /// Each node's network interfaces and their speeds.
    Network,
    /// The net preflight's ring links between nodes, each measured alone.
    Link,
    /// A GPU's health: the check `--waive` names (None: all of them, when every GPU is well).
    Health(Option<Waiver>),
    /// A GPU's memory bandwidth.
    Memory,
    /// `--min-busbw`.
    MinBusbw,
}

/// How much a finding weighs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// A fact or a measurement: shown, not judged.
    Info,
    /// A problem to look at that does not fail the preflight by itself.
    Warn,
    /// A problem that fails the preflight with this verdict.
    Fail(Verdict),
}

/// One thing a check saw, where, and what to do about it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    pub check: Check,
    /// The host it was seen on.
    pub node: Option<String>,
    pub rank: Option<usize>,
    /// The GPU, as its rank named it ("NVIDIA H200 (0000:00:06.0)").
    pub gpu: Option<String>,
    pub severity: Severity,
    /// What was seen, in the words the report prints.
    pub evidence: String,
    /// What to check next, most likely first. Several where a problem has several possible
    /// causes in view (a slow line rate: the NCCL variables set, the channels, a PCIe link).
    pub hints: Vec<String>,
}

impl Finding {
    pub fn new(check: Check, severity: Severity, evidence: impl Into<String>) -> Finding {
        Finding {
            check,
            node: None,
            rank: None,
            gpu: None,
            severity,
            evidence: evidence.into(),
            hints: Vec::new(),
        }
    }

    pub fn info(check: Check, evidence: impl Into<String>) -> Finding {
        Finding::new(check, Severity::Info, evidence)
    }

    pub fn warn(check: Check, evidence: impl Into<String>) -> Finding {
        Finding::new(check, Severity::Warn, evidence)
    }

    pub fn fail(check: Check, verdict: Verdict, evidence: impl Into<String>) -> Finding {
        Finding::new(check, Severity::Fail(verdict), evidence)
    }

    pub fn node(mut self, host: &str) -> Finding {
        self.node = Some(host.to_string());
        self
    }

    pub fn rank(mut self, rank: usize) -> Finding {
        self.rank = Some(rank);
        self
    }

    pub fn gpu(mut self, gpu: Option<&str>) -> Finding {
        self.gpu = gpu.map(str::to_string);
        self
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Finding {
        self.hints.push(hint.into());
        self
    }

    /// A problem (printed as one), not a fact.
    pub(crate) fn is_problem(&self) -> bool {
        self.severity != Severity::Info
    }
}

/// The verdict of the findings: the worst any of them fails with; ok when none fails.
pub fn verdict(findings: &[Finding]) -> Verdict {
    findings
        .iter()
        .filter_map(|f| match f.severity {
            Severity::Fail(v) => Some(v),
            _ => None,
        })
        .max()
        .unwrap_or(Verdict::Ok)
}

/// The problems, in the order the checks found them.
pub fn problems(findings: &[Finding]) -> Vec<String> {
    findings
        .iter()
        .filter(|f| f.is_problem())
        .map(|f| f.evidence.clone())
        .collect()
}

/// The hints, in the order of their findings, a hint repeated right after itself said once.
pub fn hints(findings: &[Finding]) -> Vec<String> {
    let mut h: Vec<String> = findings.iter().flat_map(|f| f.hints.clone()).collect();
    h.dedup();
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use nrun_base::error::exit;

    #[test]
    fn the_worst_failure_decides_the_verdict_and_exit_code() {
        assert_eq!(verdict(&[]), Verdict::Ok);
        let info = Finding::info(Check::LineRate, "line rate: 450 GB/s");
        let warn = Finding::warn(Check::Nccl, "NCCL differs between ranks");
        assert_eq!(verdict(&[info.clone(), warn.clone()]), Verdict::Ok);
        let slow = Finding::fail(Check::Memory, Verdict::Slow, "a degraded GPU");
        let wrong = Finding::fail(Check::Results, Verdict::Wrong, "3 elements wrong");
        let silent = Finding::fail(Check::Silent, Verdict::Timeout, "rank 4 went silent");
        let init = Finding::fail(Check::RankError, Verdict::InitFailed, "ncclSystemError");
        let setup = Finding::fail(Check::Crash, Verdict::Setup, "rank 1 crashed");
        assert_eq!(verdict(&[info, slow.clone(), warn]), Verdict::Slow);
        // Order of the findings does not matter, only the worst.
        let all = [
            slow.clone(),
            setup.clone(),
            wrong.clone(),
            init.clone(),
            silent.clone(),
        ];
        assert_eq!(verdict(&all), Verdict::Setup);
        assert_eq!(verdict(&all[..1]).exit_code(), exit::PREFLIGHT_SLOW);
        assert_eq!(
            verdict(&[slow.clone(), wrong]).exit_code(),
            exit::PREFLIGHT_WRONG
        );
        assert_eq!(
            verdict(&[silent.clone(), slow.clone()]).exit_code(),
            exit::PREFLIGHT_TIMEOUT
        );
        assert_eq!(verdict(&[silent, init]).exit_code(), exit::PREFLIGHT_INIT);
        assert_eq!(verdict(&[slow, setup]).exit_code(), exit::PREFLIGHT_SETUP);
    }

    #[test]
    fn problems_and_hints_in_the_order_found() {
        let f = [
            Finding::info(Check::NcclPath, "NCCL path: SHM x2").hint("not a problem"),
            Finding::fail(
                Check::LineRate,
                Verdict::Slow,
                "busbw is 1% of the line rate",
            )
            .hint("unset NCCL_P2P_DISABLE")
            .hint("only 2 channels"),
            Finding::warn(Check::NcclPath, "NVLink is up but NCCL used SHM")
                .hint("only 2 channels"),
            Finding::warn(Check::NodeSpeed, "node d is slow").hint("unset NCCL_P2P_DISABLE"),
        ];
        assert_eq!(
            problems(&f),
            [
                "busbw is 1% of the line rate",
                "NVLink is up but NCCL used SHM",
                "node d is slow"
            ]
        );
        // A hint repeated right after itself is said once; said again later, it stays.
        assert_eq!(
            hints(&f),
            [
                "not a problem",
                "unset NCCL_P2P_DISABLE",
                "only 2 channels",
                "unset NCCL_P2P_DISABLE"
            ]
        );
    }
}
