//! The job's events: one enum, a variant per `name` of `--events` and `--report`'s `events`,
//! whose fields are that event's `metadata` (the same names and JSON shapes as ever:
//! docs/report.md, and tests/events.rs' golden file). Made where things happen (the job
//! command, the roster, the journal from the watch's findings); the journal stamps them, the
//! metrics and the events file consume them by matching variants. Words (`message`) are made
//! from the fields, for a person reading the file.
//!
//! Read back ([`EventRecord`]) from any nrun's report: a field an older nrun did not write
//! reads as its default (empty, zero, none), so its events still match their variants.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::Phase;
use crate::watch::{Diagnosis, Kind, Straggler};

/// One thing that happened in the job (see the module's doc).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", content = "metadata", rename_all = "snake_case")]
pub(crate) enum Event {
    /// The job's shape and command.
    JobStart {
        #[serde(skip)]
        run_id: String,
        #[serde(default)]
        nnodes: usize,
        #[serde(default)]
        nproc: usize,
        #[serde(default)]
        world_size: usize,
        #[serde(default)]
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
        #[serde(default)]
        gpus: usize,
        nccl: Option<String>,
        torch: Option<String>,
        ifname: Option<String>,
    },
    /// A worker group starts (its number is the event's `attempt`).
    AttemptStart {
        #[serde(skip)]
        attempt: u32,
        #[serde(default)]
        world_size: usize,
        #[serde(default)]
        nodes: Vec<String>,
    },
    /// The attempt's first output line, or first sign of progress the watch saw.
    FirstProgress {
        #[serde(default)]
        seen: Seen,
    },
    /// The worker group ended.
    AttemptEnd {
        outcome: Outcome,
        #[serde(default)]
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
        #[serde(default)]
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
        #[serde(default)]
        verdict: String,
        #[serde(default)]
        action: String,
        #[serde(default)]
        evidence: String,
        #[serde(default)]
        left_out: bool,
    },
    /// A restart was decided.
    Restart { restart_count: u32 },
    /// Restarts were left but the job stops: attempts `first..=last` failed as attempt `base`
    /// did (`signature`) with no progress past `progress` (`--max-no-progress-restarts`).
    NoProgressStop {
        #[serde(default)]
        base: u32,
        #[serde(default)]
        first: u32,
        #[serde(default)]
        last: u32,
        #[serde(default)]
        signature: String,
        #[serde(default)]
        progress: String,
        #[serde(default)]
        limit: u32,
        #[serde(default)]
        restarts_left: u32,
    },
    /// The watch found a hang.
    Hang {
        #[serde(skip)]
        conclusion: String,
        culprit_rank: Option<usize>,
        #[serde(default)]
        culprits: Vec<usize>,
        waiting_in: Option<String>,
        #[serde(default)]
        ranks_waiting: Vec<usize>,
        #[serde(default)]
        stalled_s: f64,
        /// Absent from an older nrun's report.
        kind: Option<Kind>,
    },
    /// The watch found a straggler.
    Straggler {
        #[serde(skip)]
        rank: usize,
        #[serde(default)]
        wait_share: f64,
        #[serde(default)]
        median_wait_share: f64,
        #[serde(default)]
        host: String,
    },
    /// A node left out of the job for good.
    NodeLeftOut {
        #[serde(skip)]
        node: usize,
        #[serde(skip)]
        host: String,
        #[serde(default)]
        stage: String,
        #[serde(default)]
        evidence: String,
        #[serde(default)]
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
    /// A node lost earlier in the job answers again and passed the checks: a spare now
    /// (`now`: "spare"), or the elastic job grows with it ("grows").
    NodeBack {
        #[serde(skip)]
        node: usize,
        #[serde(skip)]
        host: String,
        /// Seconds since it was lost.
        #[serde(default)]
        lost_s: f64,
        /// How it was lost, in short.
        #[serde(default)]
        cause: String,
        /// Starts of its agent it took.
        #[serde(default)]
        tries: u32,
        #[serde(default)]
        now: String,
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
        #[serde(default)]
        exit_code: u8,
        outcome: String,
        #[serde(default)]
        summary: String,
    },
}

/// What moved an attempt from starting to running.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Seen {
    /// Also an older nrun's, which said no more than "first output".
    #[default]
    Output,
    Progress,
}

/// How a worker group ended: `attempt_end`'s `outcome`, the ledger's per attempt, and the
/// job's (serialized as the words the reports have always held).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Outcome {
    Success,
    Failed,
    Hang,
    Interrupted,
}

impl Outcome {
    /// The word the reports and the console say.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failed => "failed",
            Outcome::Hang => "hang",
            Outcome::Interrupted => "interrupted",
        }
    }

    /// A fault ended the group (what the ledger's "lost" counts).
    pub(crate) fn is_fault(self) -> bool {
        matches!(self, Outcome::Failed | Outcome::Hang)
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
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
            kind: Some(d.kind.clone()),
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
            | Event::SpareIn { node, host, .. }
            | Event::NodeBack { node, host, .. } => Some((*node, host)),
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
            Event::NoProgressStop {
                first,
                last,
                signature,
                progress,
                ..
            } => format!(
                "stopping: attempts {first}-{last} failed the same way ({signature}) with no \
                 progress past {progress}"
            ),
            Event::Hang { conclusion, .. } => conclusion.clone(),
            Event::Straggler { rank, host, .. } => {
                format!("rank {rank} on {host} is a straggler")
            }
            Event::NodeLeftOut { host, reason, .. } => format!("leaving out {host}: {reason}"),
            Event::SpareIn { host, .. } => format!("spare {host} takes a place in the job"),
            Event::NodeBack {
                host, lost_s, now, ..
            } => match now.as_str() {
                "grows" => format!("{host} answers again after {lost_s} s: the job grows with it"),
                _ => format!("{host} answers again after {lost_s} s: a spare now"),
            },
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

    /// The console's last line, from the job's end (`job_end` only): where its time went.
    pub(crate) fn end_line(&self) -> Option<&str> {
        match self {
            Event::JobEnd { summary, .. } => Some(summary),
            _ => None,
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

/// One line of `--events` (an element of `--report`'s `events`): the event where nrun knows
/// it, stamped with when, in which attempt, on which node and rank, and said in words. Written
/// as the journal always wrote it; read back by `nrun report` from any nrun's report: a line
/// whose name or metadata this nrun does not know keeps them as they were ([`Body::Other`]),
/// and a key that is missing or of another type reads as absent.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct EventRecord {
    pub body: Body,
    /// The job's run id (the line's `metadata.run_id`).
    pub run_id: String,
    /// "AGENT" or "WORKER" (torchelastic's sources).
    pub source: String,
    /// Milliseconds since the Unix epoch.
    pub timestamp: Option<u64>,
    /// Seconds since nrun started.
    pub t: Option<f64>,
    pub attempt: Option<u32>,
    pub node: Option<usize>,
    pub host: Option<String>,
    pub rank: Option<usize>,
    pub message: String,
}

/// What an [`EventRecord`] tells.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Body {
    /// An event this nrun writes. Its fields that the line holds outside `metadata` (node,
    /// host, rank, words) are the record's, not the event's, once read back.
    Known(Event),
    /// A line of another nrun: its name and metadata as they were.
    Other { name: String, metadata: Value },
}

impl EventRecord {
    /// The event, where nrun knows it.
    pub(crate) fn event(&self) -> Option<&Event> {
        match &self.body {
            Body::Known(e) => Some(e),
            Body::Other { .. } => None,
        }
    }

    /// The line's name and metadata (the job's `run_id` in it, as written).
    fn name_and_metadata(&self) -> (Value, Value) {
        match &self.body {
            Body::Known(e) => e.name_and_metadata(&self.run_id),
            Body::Other { name, metadata } => (json!(name), metadata.clone()),
        }
    }

    /// The event's name (`node_joined`), for a person reading the page.
    pub(crate) fn name(&self) -> String {
        match &self.body {
            Body::Known(e) => serde_json::to_value(e)
                .ok()
                .and_then(|mut v| v.get_mut("name").map(Value::take))
                .and_then(|n| n.as_str().map(str::to_string))
                .unwrap_or_default(),
            Body::Other { name, .. } => name.clone(),
        }
    }

    /// The record of a line read back: see the type's doc for what is lenient.
    pub(crate) fn of_json(v: Value) -> EventRecord {
        // What is not an object is a line that says nothing.
        let mut o = match v {
            Value::Object(o) => o,
            _ => Map::new(),
        };
        let string = |v: Option<Value>| match v {
            Some(Value::String(s)) => Some(s),
            _ => None,
        };
        let index = |v: Option<Value>| v.and_then(|n| n.as_u64()).map(|n| n as usize);
        let name = string(o.remove("name")).unwrap_or_default();
        let metadata = match o.remove("metadata") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(m) => m,
        };
        let run_id = metadata
            .get("run_id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        // Read in place (a line's metadata is not copied to try it); none reads as empty.
        let line = Value::Object(Map::from_iter([
            ("name".to_string(), Value::String(name)),
            ("metadata".to_string(), metadata),
        ]));
        let body = match (Event::deserialize(&line), line) {
            (Ok(e), _) => Body::Known(e),
            (Err(_), mut l) => Body::Other {
                name: string(l.get_mut("name").map(Value::take)).unwrap_or_default(),
                metadata: l.get_mut("metadata").map(Value::take).unwrap_or_default(),
            },
        };
        EventRecord {
            body,
            run_id,
            source: string(o.remove("source")).unwrap_or_default(),
            timestamp: o.remove("timestamp").and_then(|n| n.as_u64()),
            t: o.remove("t").and_then(|n| n.as_f64()),
            attempt: o
                .remove("attempt")
                .and_then(|n| n.as_u64())
                .and_then(|n| u32::try_from(n).ok()),
            node: index(o.remove("node")),
            host: string(o.remove("host")),
            rank: index(o.remove("rank")),
            message: string(o.remove("message")).unwrap_or_default(),
        }
    }
}

impl Serialize for EventRecord {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (name, metadata) = self.name_and_metadata();
        json!({
            "name": name,
            "source": self.source,
            "timestamp": self.timestamp,
            "t": self.t,
            "attempt": self.attempt,
            "node": self.node,
            "host": self.host,
            "rank": self.rank,
            "message": self.message,
            "metadata": metadata,
        })
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for EventRecord {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Value::deserialize(d).map(EventRecord::of_json)
    }
}
