//! The ledger's phases (the one list: [`Phase::ALL`], [`Phase::key`] and serde's names all come
//! from it) and the ledger as `--report` holds it. Here, below the report, which reads them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The ledger's phases, each with its key in the report, in the order time flows: the one list
/// ([`Phase::ALL`], [`Phase::key`] and serde's names all come from it).
macro_rules! phases {
    ($($(#[$doc:meta])* $name:ident = $key:literal,)*) => {
        /// What the job is doing; the ledger's keys, in order.
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        pub(crate) enum Phase {
            $($(#[$doc])* #[serde(rename = $key)] $name,)*
        }

        impl Phase {
            pub(crate) const ALL: [Phase; [$($key),*].len()] = [$(Phase::$name),*];

            pub(crate) fn key(self) -> &'static str {
                match self {
                    $(Phase::$name => $key,)*
                }
            }
        }
    };
}

phases! {
    /// From nrun's start to the plan made.
    Launch = "launch",
    /// Waiting for the nodes to join.
    Join = "join",
    Checks = "checks",
    Preflight = "preflight",
    /// A worker group started, nothing seen of it yet.
    Starting = "starting",
    Running = "running",
    /// Finding out what a fault was (a hang's stall is charged here).
    Detecting = "detecting",
    Stopping = "stopping",
    Restarting = "restarting",
    /// Waiting for nodes to come (elastic).
    Waiting = "waiting",
    Ending = "ending",
}

impl Phase {
    /// The phases of a worker group's life, where the watch and the step's wait move the job.
    pub(crate) fn in_attempt(self) -> bool {
        matches!(self, Phase::Starting | Phase::Running | Phase::Detecting)
    }
}

/// Seconds charged to each phase, as the report holds them (every phase when written; a
/// phase missing from a report read back is "not recorded").
pub(crate) type PhaseTimes = BTreeMap<Phase, f64>;

/// `ledger`: where the wall time went, in total and per worker group.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct LedgerReport {
    pub wall_s: f64,
    pub phases: PhaseTimes,
    /// Running over wall, to 4 digits.
    pub effective: f64,
    #[serde(default)]
    pub attempts: Vec<AttemptReport>,
    #[serde(default)]
    pub restarts: u32,
    #[serde(default)]
    pub lost_s: f64,
    /// The line said at the job's end.
    #[serde(default)]
    pub summary: String,
}

/// One worker group's time in the ledger.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct AttemptReport {
    pub attempt: u32,
    pub start_s: f64,
    pub end_s: f64,
    /// "success", "failed", "hang", "interrupted", ...; "running" while it runs.
    pub outcome: String,
    #[serde(default)]
    pub phases: PhaseTimes,
}
