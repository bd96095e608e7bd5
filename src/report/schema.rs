//! The `--report` JSON as types: what the job command, `--preflight-only` and bisect write,
//! and what `nrun report` reads back ([`Report::read`]). The ledger's phases are listed once,
//! in the journal ([`Phase`]), which charges time to them; the page draws them in their order.
//!
//! Written reports hold every key their writer knows; a report read back may lack any key but
//! the one that says what it is (`job`; `verdict`, `rows`; `rounds`, `nodes` as a list): an
//! older report, or one cut by hand, still draws, saying what it lacks. What it has must be of
//! the type nrun writes there (a `ledger` has its wall time, phases and share), or the report
//! is refused, the first such key named. The events read back as [`EventRecord`]s (a line of
//! another nrun as it was), the watch's findings as its types, a job's `nodes` and `control`
//! as theirs, bisect's nodes and rounds as theirs. A preflight's `ranks` and `rows` (the
//! preflight crate's) are carried as JSON of the kind they must be.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::journal::EventRecord;
use crate::watch::WatchReport;

pub(crate) use crate::journal::{AttemptReport, LedgerReport, Phase, PhaseTimes};

/// `job`: how the job ended and what the fault model decided on the way.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct JobSection {
    /// "success", "failed", "hang", "interrupted", "not started".
    pub outcome: String,
    pub exit_code: Option<u8>,
    /// The last failure in one line (a restart may have followed it).
    pub headline: Option<String>,
    /// Worker groups started.
    pub attempts: Option<usize>,
    pub restarts: Option<u32>,
    pub decisions: Vec<Decision>,
    /// The restart policy's view of the failures (boxed: a report's variants stay of a size).
    #[serde(flatten)]
    pub retry: Box<RetrySection>,
}

/// `job`'s keys of the restart policy (crate::retry).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct RetrySection {
    /// Each failed attempt of the program's (not a node's fault): how it failed and how far it
    /// got, what `--max-no-progress-restarts` compares (absent where none failed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<AttemptFailure>,
    /// Why the job stopped with restarts left (restarting could not help), if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_because: Option<String>,
}

/// One failed attempt as the restart policy saw it (crate::retry).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct AttemptFailure {
    pub attempt: u32,
    /// "rank 1: ValueError at train.py:12": two attempts with the same failed the same way.
    pub signature: String,
    /// Its progress in words ("step 5"); None: not known (no --progress-regex, no flight
    /// recorder read).
    pub progress: Option<String>,
    /// "step", "progress_lines" or "collectives", and the number.
    pub progress_measure: Option<String>,
    pub progress_value: Option<u64>,
    /// Restarts in a row, up to this one, that failed this way with no more progress.
    pub no_progress_restarts: u32,
}

/// One of the fault model's decisions, with its evidence.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct Decision {
    pub attempt: Option<u32>,
    pub host: String,
    pub evidence: String,
    pub verdict: String,
    pub left_out: bool,
    pub action: String,
}

/// The preflight's report (nrun_preflight's `Summary::json`), at the top level of a job's
/// report and of `--preflight-only`'s. `verdict` says it is there.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct PreflightReport {
    pub verdict: String,
    #[serde(default)]
    pub exit_code: u8,
    #[serde(default)]
    pub mode: Option<nrun_preflight::Mode>,
    #[serde(default)]
    pub world_size: usize,
    #[serde(default)]
    pub wall_s: f64,
    /// Each NCCL the ranks loaded, "2.28.9 (/path)".
    #[serde(default)]
    pub nccl: Vec<String>,
    #[serde(default)]
    pub other_libraries: Vec<String>,
    /// Each rank's own report (nrun_preflight's `RankReport`).
    #[serde(default)]
    pub ranks: Vec<Value>,
    #[serde(default)]
    pub silent_ranks: Vec<SilentRank>,
    /// The sweep table, a row per size.
    #[serde(default)]
    pub rows: Vec<Value>,
    #[serde(default)]
    pub problems: Vec<String>,
    #[serde(default)]
    pub hints: Vec<String>,
    #[serde(default)]
    pub line_rate: Option<LineRate>,
    #[serde(default)]
    pub nccl_path: Option<Value>,
}

impl PreflightReport {
    /// nrun_preflight's report JSON as this type; a report that does not fit (a bug: the two
    /// are kept alike by the tests) is said and left out of the job's.
    pub(crate) fn from_json(v: Value) -> Option<PreflightReport> {
        serde_json::from_value(v)
            .map_err(|e| tracing::warn!("the preflight's report is left out of --report: {e}"))
            .ok()
    }
}

/// A rank that never reported to the preflight.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct SilentRank {
    pub rank: usize,
    pub host: String,
    pub last_stage: Option<String>,
}

/// The job's line rate and how much of it the preflight got.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct LineRate {
    pub gbs: Option<f64>,
    pub what: String,
    pub busbw_gbs: Option<f64>,
    pub efficiency: Option<f64>,
    pub slow: bool,
}

/// What a job's session adds to a report at its end (a job's and `--preflight-only`'s).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct SessionParts {
    /// The nodes left out and who ran (the roster's); absent when none was left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodesReport>,
    /// Where each node's agent reaches the launch host; absent when no agent joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<Vec<ControlLink>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger: Option<LedgerReport>,
    /// The journal's events (the lines of `--events`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<EventRecord>>,
}

/// A job's `nodes`: its size, where it ran, the spares left, the nodes left out.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct NodesReport {
    pub size: usize,
    #[serde(deserialize_with = "words")]
    pub ran_on: Vec<String>,
    #[serde(deserialize_with = "words")]
    pub spares: Vec<String>,
    pub left_out: Vec<LeftOutReport>,
    /// Nodes lost mid-run whose agents were started again and passed the checks (absent from
    /// an older report).
    pub came_back: Vec<CameBackReport>,
}

/// A node lost mid-run that came back.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct CameBackReport {
    pub host: String,
    /// How it was lost.
    pub why: String,
    /// When it was lost, and when it came back: RFC 3339 to the second.
    pub lost_at: String,
    pub back_at: String,
    /// Starts of its agent it took.
    pub tries: u32,
}

/// A node left out of the job, with its evidence.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct LeftOutReport {
    pub host: String,
    /// Where it was left out ("check", "run", ...).
    pub stage: String,
    /// What kind of evidence ("seen", "link", ...); absent from an older report.
    pub evidence: String,
    pub why: String,
    /// When, RFC 3339 to the second.
    pub at: String,
}

/// How a node's agent reaches the launch host (`control`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct ControlLink {
    pub host: String,
    /// The launch host's address it reached.
    pub launch_addr: String,
    /// How that address was chosen.
    pub chosen: String,
    /// The node's own end of the link.
    pub node_addr: String,
}

/// A list of names read leniently: a null says nothing (""), a number as its digits.
fn words<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let v = Vec::<Value>::deserialize(d)?;
    Ok(v.into_iter()
        .map(|w| match w {
            Value::String(s) => s,
            Value::Null => String::new(),
            w => w.to_string(),
        })
        .collect())
}

/// A job's `--report`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct JobReport {
    /// The preflight's keys stay at the top level, where `--preflight-only` puts them.
    #[serde(flatten)]
    pub preflight: Option<PreflightReport>,
    pub job: JobSection,
    /// The watch's hangs, stragglers and mismatches; null where no watch ran.
    #[serde(default)]
    pub watch: Option<WatchReport>,
    #[serde(flatten)]
    pub session: SessionParts,
}

/// `--preflight-only`'s `--report`: the preflight's, with the session's parts when the job
/// command rewrote it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct PreflightOnlyReport {
    #[serde(flatten)]
    pub preflight: PreflightReport,
    #[serde(flatten)]
    pub session: SessionParts,
}

/// bisect's `--report`: each node's verdict and every round's groups.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct BisectReport {
    #[serde(default)]
    pub nodes: Vec<BisectNode>,
    #[serde(default)]
    pub rounds: Vec<BisectRound>,
    #[serde(default)]
    pub rounds_after_stage1: usize,
    #[serde(default)]
    pub seconds: Option<f64>,
    #[serde(default)]
    pub control: Option<Value>,
}

/// A node's verdict in bisect's report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct BisectNode {
    pub host: String,
    /// "good", "bad", "slow", "unreachable", "link".
    pub verdict: String,
    #[serde(deserialize_with = "words")]
    pub evidence: Vec<String>,
}

/// One round of bisect: its stage and the groups it ran.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct BisectRound {
    pub stage: String,
    pub groups: Vec<BisectGroup>,
}

/// A group of a bisect round and how it did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct BisectGroup {
    #[serde(deserialize_with = "words")]
    pub hosts: Vec<String>,
    /// Always written; absent from a report cut by hand.
    pub ok: Option<bool>,
    pub busbw_gbs: Option<f64>,
    pub evidence: String,
    /// A link of the group's ring far under the round's links.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_link: Option<String>,
}

/// A report nrun wrote, of one of its commands.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Report {
    Job(JobReport),
    Preflight(PreflightOnlyReport),
    Bisect(BisectReport),
}

/// Which command wrote a report, told by the key only its report has.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Job,
    Preflight,
    Bisect,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Job => "job",
            Kind::Preflight => "preflight",
            Kind::Bisect => "bisect",
        }
    }
}

/// Where a report is written from: a job's, a bisect's, a preflight's.
const WRITTEN_BY: &str = "written by `nrun --report FILE`, `nrun --preflight-only --report FILE` \
                          or `nrun bisect --report FILE`";

impl Report {
    /// The report in `bytes` (the file `name`), or why it is not one: what was expected and
    /// what was found, in one sentence that names the file.
    pub(crate) fn read(name: &str, bytes: &[u8]) -> Result<Report, String> {
        let not = |why: String| format!("{name} is not an nrun report: {why} ({WRITTEN_BY})");
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(not("it is empty".into()));
        }
        let v: Value =
            serde_json::from_slice(bytes).map_err(|e| not(format!("it is not JSON ({e})")))?;
        let Value::Object(mut o) = v else {
            return Err(not(format!(
                "it holds {} where a report is an object",
                what(&v)
            )));
        };
        let is = |k: &str| o.get(k).is_some_and(|x| !x.is_null());
        let kind = if o.contains_key("job") {
            Kind::Job
        } else if is("rounds") || o.get("nodes").is_some_and(Value::is_array) {
            Kind::Bisect
        } else if is("verdict") || is("rows") {
            Kind::Preflight
        } else {
            let keys: Vec<&str> = o.keys().map(String::as_str).take(8).collect();
            return Err(not(format!(
                "no `job` object, no preflight `verdict`, no bisect `rounds` (its keys: {})",
                match keys.is_empty() {
                    true => "none".to_string(),
                    false => keys.join(", "),
                }
            )));
        };
        if let Some(e) = o.get("events").filter(|e| !e.is_array() && !e.is_null()) {
            return Err(not(format!(
                "its `events` is {} where a report has a list",
                what(e)
            )));
        }
        if kind == Kind::Job && !o["job"].is_object() {
            return Err(not(format!(
                "its `job` is {} where a job's report has an object",
                what(&o["job"])
            )));
        }
        // A preflight report cut down to its sweep (no verdict) still draws the sweep.
        if kind == Kind::Preflight && !is("verdict") {
            o.insert("verdict".into(), Value::String(String::new()));
        }
        // Taken apart key by key, moving each part (the events, most of a large report, are
        // not copied): serde's flatten would buffer the whole report once more.
        let parsed = match kind {
            Kind::Job => job_of(o).map(Report::Job),
            Kind::Bisect => serde_json::from_value(Value::Object(o))
                .map(Report::Bisect)
                .map_err(|e| e.to_string()),
            Kind::Preflight => preflight_of(o).map(|(preflight, session)| {
                Report::Preflight(PreflightOnlyReport { preflight, session })
            }),
        };
        parsed.map_err(|e| {
            not(format!(
                "a {} report whose keys do not hold what nrun writes: {e}",
                kind.name()
            ))
        })
    }
}

type Map = serde_json::Map<String, Value>;

/// Key `k` of `o`, taken out, as a `T` (absent or null: None); an error names the key.
fn take<T: serde::de::DeserializeOwned>(o: &mut Map, k: &str) -> Result<Option<T>, String> {
    match o.remove(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v)
            .map(Some)
            .map_err(|e| format!("its `{k}`: {e}")),
    }
}

/// The parts a job's session adds, taken out of `o`.
fn session_of(o: &mut Map) -> Result<SessionParts, String> {
    Ok(SessionParts {
        nodes: take(o, "nodes")?,
        control: take(o, "control")?,
        ledger: take(o, "ledger")?,
        events: match o.remove("events") {
            Some(Value::Array(a)) => Some(a.into_iter().map(EventRecord::of_json).collect()),
            _ => None,
        },
    })
}

/// A job's report (its `job` an object: checked by the caller).
fn job_of(mut o: Map) -> Result<JobReport, String> {
    let job = take(&mut o, "job")?.unwrap_or_default();
    let watch = take(&mut o, "watch")?;
    let session = session_of(&mut o)?;
    // The preflight's keys are what is left, where one ran.
    let preflight = match o.get("verdict").is_some_and(|v| !v.is_null()) {
        true => Some(serde_json::from_value(Value::Object(o)).map_err(|e| e.to_string())?),
        false => None,
    };
    Ok(JobReport {
        preflight,
        job,
        watch,
        session,
    })
}

/// `--preflight-only`'s report: the preflight's keys and the session's parts.
fn preflight_of(mut o: Map) -> Result<(PreflightReport, SessionParts), String> {
    let session = session_of(&mut o)?;
    let preflight = serde_json::from_value(Value::Object(o)).map_err(|e| e.to_string())?;
    Ok((preflight, session))
}

/// A JSON value's kind, for saying what was found.
fn what(v: &Value) -> String {
    let mut s = String::new();
    let _ = match v {
        Value::Null => write!(s, "null"),
        Value::Bool(b) => write!(s, "a boolean ({b})"),
        Value::Number(n) => write!(s, "a number ({n})"),
        Value::String(_) => write!(s, "a string"),
        Value::Array(a) => write!(s, "a list of {}", a.len()),
        Value::Object(_) => write!(s, "an object"),
    };
    s
}

impl Serialize for Report {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Report::Job(r) => r.serialize(s),
            Report::Preflight(r) => r.serialize(s),
            Report::Bisect(r) => r.serialize(s),
        }
    }
}

impl Report {
    /// The job's section (a job's report only).
    pub(crate) fn job(&self) -> Option<&JobSection> {
        match self {
            Report::Job(r) => Some(&r.job),
            _ => None,
        }
    }

    pub(crate) fn ledger(&self) -> Option<&LedgerReport> {
        match self {
            Report::Job(r) => r.session.ledger.as_ref(),
            Report::Preflight(r) => r.session.ledger.as_ref(),
            Report::Bisect(_) => None,
        }
    }

    /// What the job's session added at its end (none to bisect's).
    pub(crate) fn session(&self) -> Option<&SessionParts> {
        match self {
            Report::Job(r) => Some(&r.session),
            Report::Preflight(r) => Some(&r.session),
            Report::Bisect(_) => None,
        }
    }

    /// What the job's session adds at its end (none to bisect's).
    pub(crate) fn session_mut(&mut self) -> Option<&mut SessionParts> {
        match self {
            Report::Job(r) => Some(&mut r.session),
            Report::Preflight(r) => Some(&mut r.session),
            Report::Bisect(_) => None,
        }
    }

    /// The preflight's findings: a job's that ran one, `--preflight-only`'s.
    pub(crate) fn preflight(&self) -> Option<&PreflightReport> {
        match self {
            Report::Job(r) => r.preflight.as_ref(),
            Report::Preflight(r) => Some(&r.preflight),
            Report::Bisect(_) => None,
        }
    }
}
