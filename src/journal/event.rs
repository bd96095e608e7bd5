//! The job's events: one enum, a variant per `name` of `--events` and `--report`'s `events`,
//! whose fields are that event's `metadata` (the same names and JSON shapes as ever:
//! docs/report.md, and tests/events.rs' golden file). Made where things happen (the job
//! command, the roster, the journal from the watch's findings); the journal stamps them, the
//! metrics and the events file consume them by matching variants. Words (`message`) are made
//! from the fields, for a person reading the file.

use serde::Serialize;
use serde_json::{Map, Value, json};

use super::Phase;
use crate::watch::{Diagnosis, Kind, Straggler};

/// One thing that happened in the job (see the module's doc).
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "name", content = "metadata", rename_all = "snake_case")]
pub(crate) enum Event {
    /// The job's shape and command.
    JobStart {
        #[serde(skip)]
        run_id: String,
        nnodes: usize,
        nproc: usize,
        world_size: usize,
        command: String,
    },
    /// The job entered a phase of the ledger.
    Phase { phase: Phase },
    /// A node joined, with its facts in brief.
    NodeJoined {
        #[serde(skip)]
        node: usize,
        #[serde(skip)]
        host: String,
        gpus: usize,
        nccl: Option<String>,
        torch: Option<String>,
        ifname: Option<String>,
    },
    /// A worker group starts (its number is the event's `attempt`).
    AttemptStart {
        #[serde(skip)]
        attempt: u32,
        world_size: usize,
        nodes: Vec<String>,
    },
    /// The attempt's first output line, or first sign of progress the watch saw.
    FirstProgress { seen: Seen },
    /// The worker group ended.
    AttemptEnd {
        outcome: &'static str,
        exit_code: u8,
    },
    /// A node's failure in an attempt: a worker's ending (rank, code, signal), or the node's
    /// (could not start, timed out, lost).
    WorkerFailed {
        #[serde(skip)]
        node: usize,
        #[serde(skip)]
        host: String,
        #[serde(skip)]
        rank: Option<usize>,
        how: String,
        exit_code: Option<u8>,
        signal: Option<String>,
    },
    /// The fault model's verdict on a node and what nrun does.
    Decision {
        #[serde(skip)]
        node: usize,
        #[serde(skip)]
        host: String,
        verdict: &'static str,
        action: &'static str,
        evidence: String,
        left_out: bool,
    },
    /// A restart was decided.
    Restart { restart_count: u32 },
    /// The watch found a hang.
    Hang {
        #[serde(skip)]
        conclusion: String,
        culprit_rank: Option<usize>,
        culprits: Vec<usize>,
        waiting_in: Option<String>,
        ranks_waiting: Vec<usize>,
        stalled_s: f64,
        kind: Kind,
    },
    /// The watch found a straggler.
    Straggler {
        #[serde(skip)]
        rank: usize,
        wait_share: f64,
        median_wait_share: f64,
        host: String,
    },
    /// A node left out of the job for good.
    NodeLeftOut {
        #[serde(skip)]
        node: usize,
        #[serde(skip)]
        host: String,
        stage: &'static str,
        evidence: &'static str,
        reason: String,
    },
    /// A spare takes a place in the job (of the node named, where one left).
    SpareIn {
        #[serde(skip)]
        node: usize,
        #[serde(skip)]
        host: String,
        replaces: Option<String>,
    },
    /// One message size the preflight measured (GB/s, as the console says them).
    PreflightSize {
        bytes: Option<u64>,
        busbw_gbs: Option<f64>,
        algbw_gbs: Option<f64>,
        line_rate_gbs: Option<f64>,
    },
    /// The preflight ended.
    PreflightEnd { exit_code: u8, verdict: String },
    /// The job ended.
    JobEnd {
        exit_code: u8,
        outcome: String,
        summary: String,
    },
}

/// What moved an attempt from starting to running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Seen {
    Output,
    Progress,
}

impl Event {
    /// The `hang` event of the watch's diagnosis `d`.
    pub(crate) fn hang(d: &Diagnosis) -> Event {
        Event::Hang {
            conclusion: d.conclusion.clone(),
            culprit_rank: d.culprits.first().copied(),
            culprits: d.culprits.clone(),
            waiting_in: d.ranks.iter().find_map(|r| r.waiting_in.clone()),
            ranks_waiting: d
                .ranks
                .iter()
                .filter(|r| r.waiting_in.is_some())
                .map(|r| r.rank)
                .collect(),
            stalled_s: d.stalled_s,
            kind: d.kind.clone(),
        }
    }

    /// The `straggler` event of the watch's finding `s`.
    pub(crate) fn straggler(s: &Straggler) -> Event {
        Event::Straggler {
            rank: s.rank,
            wait_share: s.waited_pct / 100.0,
            median_wait_share: s.median_pct / 100.0,
            host: s.host.clone(),
        }
    }

    /// The node it is about (its index and host), where one.
    pub(crate) fn node(&self) -> Option<(usize, &str)> {
        match self {
            Event::NodeJoined { node, host, .. }
            | Event::WorkerFailed { node, host, .. }
            | Event::Decision { node, host, .. }
            | Event::NodeLeftOut { node, host, .. }
            | Event::SpareIn { node, host, .. } => Some((*node, host)),
            _ => None,
        }
    }

    /// The rank it is about, where one: a rank's event (torchelastic's source WORKER).
    pub(crate) fn rank(&self) -> Option<usize> {
        match self {
            Event::WorkerFailed { rank, .. } => *rank,
            Event::Hang { culprit_rank, .. } => *culprit_rank,
            Event::Straggler { rank, .. } => Some(*rank),
            _ => None,
        }
    }

    /// Torchelastic's source: WORKER for a rank's event, else AGENT.
    pub(crate) fn source(&self) -> &'static str {
        match self.rank() {
            Some(_) => "WORKER",
            None => "AGENT",
        }
    }

    /// The event in words, for a person reading the events.
    pub(crate) fn message(&self) -> String {
        match self {
            Event::JobStart {
                run_id, command, ..
            } => format!("job {run_id} starts: {command}"),
            Event::Phase { phase } => format!("entering {}", phase.key()),
            Event::NodeJoined { host, .. } => format!("{host} joined"),
            Event::AttemptStart {
                attempt,
                world_size,
                ..
            } => format!("worker group {attempt} starts ({world_size} workers)"),
            Event::FirstProgress { seen } => {
                let how = match seen {
                    Seen::Output => "output",
                    Seen::Progress => "progress",
                };
                format!("first {how} seen from the workers")
            }
            Event::AttemptEnd { outcome, .. } => format!("worker group ended: {outcome}"),
            Event::WorkerFailed { host, how, .. } => format!("{host}: {how}"),
            Event::Decision {
                host,
                verdict,
                action,
                ..
            } => format!("{host}: {verdict} -> {action}"),
            Event::Restart { restart_count } => format!("restart {restart_count}"),
            Event::Hang { conclusion, .. } => conclusion.clone(),
            Event::Straggler { rank, host, .. } => {
                format!("rank {rank} on {host} is a straggler")
            }
            Event::NodeLeftOut { host, reason, .. } => format!("leaving out {host}: {reason}"),
            Event::SpareIn { host, .. } => format!("spare {host} takes a place in the job"),
            // Said as the report's JSON has them (a whole number of GB/s keeps its ".0").
            Event::PreflightSize {
                bytes, busbw_gbs, ..
            } => format!("{} B: busbw {} GB/s", json!(bytes), json!(busbw_gbs)),
            Event::PreflightEnd { exit_code, verdict } => {
                format!("preflight: {verdict} (exit {exit_code})")
            }
            Event::JobEnd { summary, .. } => format!("nrun: {summary}"),
        }
    }

    /// Its name and metadata as `--events` writes them, the job's `run_id` added.
    pub(crate) fn name_and_metadata(&self, run_id: &str) -> (Value, Value) {
        let mut v = serde_json::to_value(self).unwrap_or_else(|_| json!({}));
        let name = v.get_mut("name").map(Value::take).unwrap_or(Value::Null);
        let mut meta = match v.get_mut("metadata").map(Value::take) {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        meta.insert("run_id".into(), json!(run_id));
        (name, Value::Object(meta))
    }
}
