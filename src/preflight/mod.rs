//! The all-reduce preflight: before the job, prove with the job's exact rank layout, environment
//! and libnccl that a communicator forms across all ranks and all-reduces correctly at speed.
//!
//! - [`nccl`]: libnccl by explicit path, and which one the job would load.
//! - [`cuda`]: the CUDA driver calls (cudarc, loaded at run time).
//! - [`hardware`]: the GPU's links and line rate (NVML), the path NCCL took (its INFO log).
//! - [`worker`]: one preflight rank (nrun itself, started like a job worker): NCCL on a GPU, or a
//!   TCP ring on the CPU (`--preflight=net`).
//! - this file: settings, the store keys ranks report through, and the verdict.
//!
//! Ranks never exit non-zero for a failed check: each writes a [`RankReport`] to the store
//! (error included) and exits 0, so the coordinator sees every rank's view, not only the first
//! to die. A rank that fails sets an abort key; the others stop waiting at once.

pub mod cuda;
pub mod hardware;
pub mod nccl;
pub mod worker;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, exit};

/// Which preflight runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// NCCL all-reduce on the GPUs.
    Nccl,
    /// TCP ring all-reduce over the network path, no GPU needed.
    Net,
}

/// What every preflight rank is told (as JSON in NRUN_PREFLIGHT).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    /// Key space of this preflight run in the store.
    pub id: String,
    pub mode: Mode,
    pub min_bytes: u64,
    pub max_bytes: u64,
    pub factor: u64,
    pub iters: u32,
    pub warmup: u32,
    /// Deadline for communicator init (and for waiting on other ranks), milliseconds.
    pub timeout_ms: u64,
    pub nccl_lib: Option<PathBuf>,
    /// Address this node's ranks listen on in net mode.
    pub listen_addr: String,
    /// Net mode: measure each ring link alone before the sweep (the job's preflight; bisect
    /// compares whole groups instead).
    #[serde(default)]
    pub links: bool,
}

pub const ENV: &str = "NRUN_PREFLIGHT";

impl Settings {
    /// Message sizes of the sweep, in bytes, each a multiple of 4 (float32 elements).
    pub fn sizes(&self) -> Vec<u64> {
        let mut v = Vec::new();
        let mut s = self.min_bytes.max(4);
        while s <= self.max_bytes {
            v.push(s / 4 * 4);
            let next = s.saturating_mul(self.factor.max(2));
            if next == s {
                break;
            }
            s = next;
        }
        v
    }

    /// Every key of this preflight run, spelled here only: the ranks write them, the coordinator
    /// and bisect read them.
    fn key(&self, what: std::fmt::Arguments<'_>) -> Vec<u8> {
        format!("nrun/pf/{}/{what}", self.id).into_bytes()
    }

    /// Rank `rank`'s [`RankReport`], as JSON.
    pub fn result_key(&self, rank: usize) -> Vec<u8> {
        self.key(format_args!("result/{rank}"))
    }

    /// The last of the [`STAGES`] rank `rank` reached.
    pub fn stage_key(&self, rank: usize) -> Vec<u8> {
        self.key(format_args!("stage/{rank}"))
    }

    /// Set (to its rank) by the first rank that fails, so the others stop waiting.
    pub fn abort_key(&self) -> Vec<u8> {
        self.key(format_args!("abort"))
    }

    /// Rank 0's NCCL unique id.
    pub fn uid_key(&self) -> Vec<u8> {
        self.key(format_args!("uid"))
    }

    /// The barrier the ranks leave through together.
    pub fn finished_key(&self) -> Vec<u8> {
        self.key(format_args!("finished"))
    }

    /// Net mode: the address rank `rank` listens on.
    pub fn addr_key(&self, rank: usize) -> Vec<u8> {
        self.key(format_args!("addr/{rank}"))
    }

    /// Net mode: the barrier ending turn `turn` of the link test.
    pub fn link_key(&self, turn: usize) -> Vec<u8> {
        self.key(format_args!("link/{turn}"))
    }

    /// What a preflight rank gets on top of the job's environment: these settings, and with
    /// --preflight-loopback no NVLink/shared-memory path. (The store's secret for nrun's keys
    /// is added by the rank's own agent: it never travels in a step.)
    pub fn rank_env(&self, loopback: bool) -> Vec<(String, String)> {
        let mut env = vec![(
            ENV.to_string(),
            serde_json::to_string(self).unwrap_or_default(),
        )];
        if loopback {
            env.push(("NCCL_P2P_DISABLE".into(), "1".into()));
            env.push(("NCCL_SHM_DISABLE".into(), "1".into()));
        }
        env
    }
}

/// A rank that did not report: its rank, host, and the last stage it reached.
pub type Silent = (usize, String, Option<String>);

/// Every rank's report, read with `get` (a key of these settings -> its value); a rank without
/// one is listed with its host and the last stage it reached (None: it never reached the store).
pub fn reports_from(
    s: &Settings,
    ranks: &[(usize, String)],
    get: &mut dyn FnMut(&[u8]) -> Option<Vec<u8>>,
) -> (BTreeMap<usize, RankReport>, Vec<Silent>) {
    let mut reports = BTreeMap::new();
    let mut silent = Vec::new();
    for (rank, host) in ranks {
        match get(&s.result_key(*rank)).and_then(|r| serde_json::from_slice::<RankReport>(&r).ok())
        {
            Some(rep) => {
                reports.insert(*rank, rep);
            }
            None => {
                let stage = get(&s.stage_key(*rank))
                    .filter(|v| !v.is_empty())
                    .map(|v| String::from_utf8_lossy(&v).into_owned());
                silent.push((*rank, host.clone(), stage));
            }
        }
    }
    (reports, silent)
}

/// Parses `MIN:MAX:FACTOR` with sizes like 8, 64K, 256M, 2G.
pub fn parse_sizes(s: &str) -> Result<(u64, u64, u64), Error> {
    let bad = || {
        Error::usage(format!(
            "--preflight-sizes {s:?}: expected MIN:MAX:FACTOR, e.g. 8:256M:2 (sizes in bytes, K/M/G \
             suffixes)"
        ))
    };
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 3 {
        return Err(bad());
    }
    let size = |p: &str| -> Result<u64, Error> {
        let p = p.trim();
        let (num, mul) = match p.chars().last().map(|c| c.to_ascii_uppercase()) {
            Some('K') => (&p[..p.len() - 1], 1u64 << 10),
            Some('M') => (&p[..p.len() - 1], 1 << 20),
            Some('G') => (&p[..p.len() - 1], 1 << 30),
            _ => (p, 1),
        };
        num.parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(mul))
            .ok_or_else(bad)
    };
    let (min, max) = (size(parts[0])?, size(parts[1])?);
    let factor = parts[2].trim().parse::<u64>().map_err(|_| bad())?;
    if min == 0 || max < min || factor < 2 {
        return Err(bad());
    }
    Ok((min, max, factor))
}

/// One message size's measurements on one rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    pub bytes: u64,
    pub oop_us: f64,
    pub oop_wrong: u64,
    pub ip_us: f64,
    pub ip_wrong: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankError {
    /// setup | store | init | init-timeout | aborted | collective
    pub kind: String,
    pub message: String,
}

/// What one rank reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: usize,
    pub local_rank: usize,
    pub host: String,
    pub pid: u32,
    pub nccl_version: Option<String>,
    pub nccl_path: Option<String>,
    pub gpu: Option<String>,
    pub driver: Option<String>,
    pub init_ms: Option<f64>,
    /// Where this rank's time went, milliseconds per phase in order.
    #[serde(default)]
    pub phases_ms: Vec<(String, f64)>,
    pub rows: Vec<Row>,
    pub error: Option<RankError>,
    /// The GPU's links and health (NVML), when they could be read.
    #[serde(default)]
    pub links: Option<hardware::Links>,
    #[serde(default)]
    pub health: Option<hardware::Health>,
    /// The path NCCL took for this rank's connections (its INFO log).
    #[serde(default)]
    pub path: Option<hardware::NcclPath>,
    /// The GPU's device-to-device copy bandwidth (GB/s, read and write counted).
    #[serde(default)]
    pub mem_gbs: Option<f64>,
    /// The network interfaces this rank's traffic to other nodes leaves by.
    #[serde(default)]
    pub nics: Vec<hardware::Nic>,
    /// The link from the previous rank of the ring, measured alone (`--preflight net`).
    #[serde(default)]
    pub link_in: Option<LinkIn>,
}

/// What one ring link carried when it was the only thing being measured.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct LinkIn {
    /// The rank that sent.
    pub from: usize,
    pub gbs: f64,
}

/// Progress marks a rank leaves in the store, so a silent rank can be placed.
pub const STAGES: [(&str, &str); 6] = [
    ("started", "started, connected to the store"),
    ("loaded", "loaded its libraries and GPU"),
    ("id", "has the unique id, entering communicator init"),
    ("init", "finished communicator init"),
    ("sweep", "running the all-reduce sweep"),
    ("done", "done"),
];

pub fn stage_text(stage: &str) -> &'static str {
    STAGES
        .iter()
        .find(|(s, _)| *s == stage)
        .map_or("in an unknown stage", |(_, t)| t)
}

/// nccl-tests' bus bandwidth for all-reduce: algbw * 2(n-1)/n.
pub fn busbw(bytes: u64, us: f64, nranks: usize) -> (f64, f64) {
    if us <= 0.0 {
        return (0.0, 0.0);
    }
    let algbw = bytes as f64 / (us * 1e-6) / 1e9;
    let n = nranks as f64;
    (
        algbw,
        if nranks > 1 {
            algbw * 2.0 * (n - 1.0) / n
        } else {
            0.0
        },
    )
}

/// How the preflight ended, and the exit code that goes with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// Libraries, GPUs or the store not usable.
    Setup,
    InitFailed,
    Timeout,
    Wrong,
    Slow,
}

impl Verdict {
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Ok => exit::SUCCESS,
            Verdict::Setup => exit::PREFLIGHT_SETUP,
            Verdict::InitFailed => exit::PREFLIGHT_INIT,
            Verdict::Timeout => exit::PREFLIGHT_TIMEOUT,
            Verdict::Wrong => exit::PREFLIGHT_WRONG,
            Verdict::Slow => exit::PREFLIGHT_SLOW,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Setup => "could not run",
            Verdict::InitFailed => "communicator init failed",
            Verdict::Timeout => "timed out",
            Verdict::Wrong => "WRONG RESULTS",
            Verdict::Slow => "too slow",
        }
    }
}

/// Everything the coordinator knows after the preflight group ended.
pub struct Outcome {
    pub world_size: usize,
    pub mode: Mode,
    pub reports: BTreeMap<usize, RankReport>,
    /// Last stage each silent rank reached, with its host.
    pub silent: Vec<Silent>,
    /// A rank that crashed, and how (exit code or signal), from the supervisor.
    pub crashed: Option<(usize, String)>,
    /// The library the ranks were told to load.
    pub nccl_lib: Option<String>,
    pub min_busbw: Option<f64>,
    /// Slow when busbw at the largest size (64 MiB or more) is under this fraction of the line
    /// rate of the job's links (one node; None: not judged).
    pub min_efficiency: Option<f64>,
    /// The NCCL variables set that change its path or speed (named as causes when slow).
    pub path_vars: Vec<String>,
    /// GPU health checks not to fail on (`--waive ecc,throttle`).
    pub waived: Vec<hardware::Waiver>,
    pub wall_s: f64,
    /// Libraries found besides the one used.
    pub other_libs: Vec<String>,
}

/// The table, diagnosis and verdict.
pub struct Summary {
    pub verdict: Verdict,
    pub text: String,
    pub json: serde_json::Value,
    /// What went wrong, most important first (empty when the verdict is ok).
    pub problems: Vec<String>,
    /// Out-of-place (algbw, busbw) in GB/s at the largest size, when every rank reported.
    pub largest: Option<(f64, f64)>,
}

impl Outcome {
    /// Every rank's report, read with `get` (a key of `settings` -> its value), as an outcome
    /// with nothing else known yet: the caller adds what it knows (a crash, limits, timings).
    /// `ranks`: each rank with its host.
    pub fn gather(
        settings: &Settings,
        ranks: &[(usize, String)],
        world_size: usize,
        get: &mut dyn FnMut(&[u8]) -> Option<Vec<u8>>,
    ) -> Outcome {
        let (reports, silent) = reports_from(settings, ranks, get);
        Outcome {
            world_size,
            mode: settings.mode,
            reports,
            silent,
            crashed: None,
            nccl_lib: None,
            min_busbw: None,
            min_efficiency: None,
            path_vars: Vec::new(),
            waived: Vec::new(),
            wall_s: 0.0,
            other_libs: Vec::new(),
        }
    }

    pub fn summarize(&self) -> Summary {
        let mut t = String::new();
        let mut problems: Vec<String> = Vec::new();
        let mut hints: Vec<String> = Vec::new();
        let mut verdict = Verdict::Ok;
        let mut largest = None;
        let mut line_rate: Option<LineRate> = None;
        let mut path_json: Option<hardware::NcclPath> = None;
        let worse = |v: Verdict, cur: &mut Verdict| {
            let rank = |v: Verdict| match v {
                Verdict::Ok => 0,
                Verdict::Slow => 1,
                Verdict::Wrong => 2,
                Verdict::Timeout => 3,
                Verdict::InitFailed => 4,
                Verdict::Setup => 5,
            };
            if rank(v) > rank(*cur) {
                *cur = v;
            }
        };

        // Libraries and versions.
        let mut versions: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for r in self.reports.values() {
            if let Some(v) = &r.nccl_version {
                versions
                    .entry(format!("{v} ({})", r.nccl_path.as_deref().unwrap_or("?")))
                    .or_default()
                    .push(r.rank);
            }
        }
        let hosts: std::collections::BTreeSet<&str> =
            self.reports.values().map(|r| r.host.as_str()).collect();
        let what = match self.mode {
            Mode::Nccl => "NCCL all-reduce",
            Mode::Net => "network (TCP ring) all-reduce",
        };
        let _ = writeln!(
            t,
            "nrun preflight: {what}, {} ranks on {} node(s)",
            self.world_size,
            hosts.len().max(1)
        );
        match versions.len() {
            0 => {
                if let Some(p) = &self.nccl_lib {
                    let _ = writeln!(
                        t,
                        "  NCCL at {p} (no rank got as far as reporting its version)"
                    );
                }
            }
            1 => {
                let _ = writeln!(
                    t,
                    "  NCCL {}",
                    versions.keys().next().map_or("", |s| s.as_str())
                );
            }
            _ => {
                let list: Vec<String> = versions
                    .iter()
                    .map(|(v, ranks)| format!("{v} on ranks {}", ranks_text(ranks)))
                    .collect();
                problems.push(format!("NCCL differs between ranks: {}", list.join("; ")));
                hints.push("load one NCCL everywhere: the same torch build on every node, or --nccl-lib PATH".into());
            }
        }
        for lib in &self.other_libs {
            let _ = writeln!(t, "  also found: {lib}");
        }
        if let Some(r) = self.reports.values().find(|r| r.gpu.is_some()) {
            let gpus: std::collections::BTreeSet<&str> = self
                .reports
                .values()
                .filter_map(|r| r.gpu.as_deref())
                .collect();
            let _ = writeln!(
                t,
                "  GPUs: {}; driver CUDA {}",
                gpus.into_iter().collect::<Vec<_>>().join(", "),
                r.driver.as_deref().unwrap_or("?")
            );
        }
        // Init time per node.
        let mut init_by_host: BTreeMap<&str, f64> = BTreeMap::new();
        for r in self.reports.values() {
            if let Some(ms) = r.init_ms {
                let e = init_by_host.entry(r.host.as_str()).or_insert(0.0);
                *e = e.max(ms);
            }
        }
        if !init_by_host.is_empty() {
            let parts: Vec<String> = init_by_host
                .iter()
                .map(|(h, ms)| format!("{h} {:.0} ms", ms))
                .collect();
            let _ = writeln!(t, "  communicator init: {}", parts.join(", "));
        }
        // Where the time went, phase by phase (slowest rank of each phase).
        let mut phases: Vec<(String, f64)> = Vec::new();
        for r in self.reports.values() {
            for (name, ms) in &r.phases_ms {
                match phases.iter_mut().find(|(n, _)| n == name) {
                    Some((_, m)) => *m = m.max(*ms),
                    None => phases.push((name.clone(), *ms)),
                }
            }
        }
        if !phases.is_empty() {
            let parts: Vec<String> = phases
                .iter()
                .map(|(n, ms)| format!("{n} {ms:.0}"))
                .collect();
            let _ = writeln!(
                t,
                "  time per phase (ms, slowest rank): {}",
                parts.join(", ")
            );
        }

        // Errors per rank.
        let mut by_kind: BTreeMap<String, Vec<&RankReport>> = BTreeMap::new();
        for r in self.reports.values() {
            if let Some(e) = &r.error {
                by_kind.entry(e.kind.clone()).or_default().push(r);
            }
        }
        for (kind, rs) in &by_kind {
            // Ranks that only stopped because another failed are noise next to the cause.
            if kind == "aborted" && by_kind.len() > 1 {
                continue;
            }
            let v = match kind.as_str() {
                "setup" | "store" => Verdict::Setup,
                "init" | "collective" => Verdict::InitFailed,
                "init-timeout" => Verdict::Timeout,
                _ => Verdict::InitFailed,
            };
            worse(v, &mut verdict);
            for r in rs.iter().take(8) {
                let e = r.error.as_ref().map_or("", |e| e.message.as_str());
                problems.push(format!(
                    "rank {} on {} (pid {}): {e}",
                    r.rank, r.host, r.pid
                ));
            }
            if rs.len() > 8 {
                problems.push(format!(
                    "... and {} more ranks with the same kind of failure",
                    rs.len() - 8
                ));
            }
            match kind.as_str() {
                "init" => hints.push(
                    "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET to see NCCL's own reasons; \
                     check NCCL_SOCKET_IFNAME names an interface that exists and is up"
                        .into(),
                ),
                "init-timeout" => hints.push(format!(
                    "a rank stuck in init usually means a peer it cannot reach: check the firewall \
                     between the hosts ({}) and the interface NCCL uses; rerun with NCCL_DEBUG=INFO \
                     NCCL_DEBUG_SUBSYS=INIT,NET",
                    hosts.iter().copied().collect::<Vec<_>>().join(", ")
                )),
                "setup" => hints.push(
                    "check that the NVIDIA driver works (nvidia-smi) and which libnccl is used \
                     (--nccl-lib PATH picks one)"
                        .into(),
                ),
                _ => {}
            }
        }
        for (rank, host, stage) in &self.silent {
            let last = stage
                .as_deref()
                .map_or("had not reached the store".to_string(), |s| {
                    format!("had last {}", stage_text(s))
                });
            problems.push(match (&self.crashed, stage) {
                (Some((cr, how)), _) if cr == rank => {
                    format!("rank {rank} on {host} crashed ({how}); it {last}")
                }
                (Some((cr, _)), _) => format!(
                    "rank {rank} on {host} was stopped by nrun after rank {cr} crashed; it {last}"
                ),
                (None, None) => format!("rank {rank} on {host} never reached the store"),
                (None, Some(s)) => format!(
                    "rank {rank} on {host} went silent: it last {}",
                    stage_text(s)
                ),
            });
        }
        if let Some((cr, how)) = &self.crashed {
            worse(Verdict::Setup, &mut verdict);
            if !self.silent.iter().any(|(r, _, _)| r == cr) {
                problems.push(format!("rank {cr} crashed ({how}) after reporting"));
            }
            hints.push(format!(
                "rank {cr}'s own output above says why it crashed; rerun with NCCL_DEBUG=WARN for NCCL's view"
            ));
        } else if !self.silent.is_empty() {
            worse(Verdict::Timeout, &mut verdict);
            hints.push(
                "a rank that never reached the store cannot connect to MASTER_ADDR:MASTER_PORT from \
                 its host: check the address and the firewall; one stuck in init: see above"
                    .into(),
            );
        }

        // The sweep table: time is the slowest rank's (what a collective costs the job).
        let complete: Vec<&RankReport> = self
            .reports
            .values()
            .filter(|r| r.error.is_none())
            .collect();
        let mut rows_json = Vec::new();
        let mut peak: Option<(u64, f64)> = None;
        let mut any_wrong = 0u64;
        if complete.len() == self.world_size && self.world_size > 0 {
            let n = complete[0].rows.len();
            let _ = writeln!(t);
            let _ = writeln!(
                t,
                "  {:>12} {:>11}   {:>10} {:>11} {:>11} {:>7}   {:>10} {:>11} {:>11} {:>7}",
                "", "", "out-of-place", "", "", "", "in-place", "", "", ""
            );
            let _ = writeln!(
                t,
                "  {:>12} {:>11}   {:>10} {:>11} {:>11} {:>7}   {:>10} {:>11} {:>11} {:>7}",
                "size (B)",
                "count",
                "time (us)",
                "algbw GB/s",
                "busbw GB/s",
                "#wrong",
                "time (us)",
                "algbw GB/s",
                "busbw GB/s",
                "#wrong"
            );
            let mut busbw_sum = 0.0;
            for i in 0..n {
                let bytes = complete[0].rows[i].bytes;
                let oop = complete
                    .iter()
                    .map(|r| r.rows.get(i).map_or(0.0, |x| x.oop_us))
                    .fold(0.0, f64::max);
                let ip = complete
                    .iter()
                    .map(|r| r.rows.get(i).map_or(0.0, |x| x.ip_us))
                    .fold(0.0, f64::max);
                let ow: u64 = complete
                    .iter()
                    .map(|r| r.rows.get(i).map_or(0, |x| x.oop_wrong))
                    .sum();
                let iw: u64 = complete
                    .iter()
                    .map(|r| r.rows.get(i).map_or(0, |x| x.ip_wrong))
                    .sum();
                any_wrong += ow + iw;
                let (oa, ob) = busbw(bytes, oop, self.world_size);
                let (ia, ib) = busbw(bytes, ip, self.world_size);
                busbw_sum += ob;
                peak = Some((bytes, ob.max(ib)));
                largest = Some((oa, ob));
                let _ = writeln!(
                    t,
                    "  {:>12} {:>11}   {:>10.2} {:>11.2} {:>11.2} {:>7}   {:>10.2} {:>11.2} {:>11.2} {:>7}",
                    bytes,
                    bytes / 4,
                    oop,
                    oa,
                    ob,
                    ow,
                    ip,
                    ia,
                    ib,
                    iw
                );
                rows_json.push(serde_json::json!({
                    "bytes": bytes, "count": bytes / 4, "type": "float", "redop": "sum",
                    "out_of_place": {"time_us": oop, "algbw_gbs": oa, "busbw_gbs": ob, "wrong": ow},
                    "in_place": {"time_us": ip, "algbw_gbs": ia, "busbw_gbs": ib, "wrong": iw},
                }));
            }
            if n > 0 {
                let _ = writeln!(
                    t,
                    "  avg busbw (out-of-place, all sizes): {:.2} GB/s",
                    busbw_sum / n as f64
                );
            }
            if any_wrong > 0 {
                worse(Verdict::Wrong, &mut verdict);
                problems.push(format!(
                    "{any_wrong} elements of all-reduce results were wrong: data corruption on a GPU or \
                     link; rerun to see whether it repeats, then test the nodes one by one"
                ));
            }
            // Per-node busbw at the largest size, against the median node.
            if let Some(last) = complete[0].rows.len().checked_sub(1) {
                let bytes = complete[0].rows[last].bytes;
                let mut node_us: BTreeMap<&str, f64> = BTreeMap::new();
                for r in &complete {
                    let e = node_us.entry(r.host.as_str()).or_insert(0.0);
                    *e = e.max(r.rows[last].oop_us);
                }
                if node_us.len() > 1 {
                    let mut bws: Vec<f64> = node_us
                        .values()
                        .map(|us| busbw(bytes, *us, self.world_size).1)
                        .collect();
                    bws.sort_by(f64::total_cmp);
                    let median = bws[bws.len() / 2];
                    for (h, us) in &node_us {
                        let b = busbw(bytes, *us, self.world_size).1;
                        if b < 0.8 * median {
                            problems.push(format!(
                                "node {h} is slow: busbw {b:.1} GB/s at {bytes} B, under 80% of the median node ({median:.1} GB/s)"
                            ));
                        }
                    }
                }
            }
            line_rate = self.against_hardware(&complete, peak, &mut t, &mut problems, &mut hints);
            let (net_rate, net_slow) =
                self.network(&complete, peak, &mut t, &mut problems, &mut hints);
            if net_slow {
                worse(Verdict::Slow, &mut verdict);
            }
            line_rate = line_rate.or(net_rate);
            if let Some(v) = self.health(&complete, &mut t, &mut problems) {
                worse(v, &mut verdict);
            }
            if self.memory(&complete, &mut t, &mut problems) {
                worse(Verdict::Slow, &mut verdict);
            }
            if let Some(p) = NcclPathSum::of(&complete) {
                let _ = writeln!(t, "  NCCL path: {}", p.describe());
                path_json = Some(p);
            }
            if line_rate.as_ref().is_some_and(|l| l.slow) {
                worse(Verdict::Slow, &mut verdict);
            }
            if let (Some(min), Some((bytes, bw))) = (self.min_busbw, peak) {
                if bw < min {
                    worse(Verdict::Slow, &mut verdict);
                    problems.push(format!(
                        "busbw {bw:.2} GB/s at {bytes} B is under --min-busbw {min} GB/s"
                    ));
                    hints.push("check that the GPUs use NVLink/InfiniBand (NCCL_DEBUG=INFO shows the transport) and that no other job shares them".into());
                }
            }
        } else if complete.len() < self.world_size && verdict == Verdict::Ok {
            worse(Verdict::Timeout, &mut verdict);
            problems.push(format!(
                "only {} of {} ranks reported",
                complete.len(),
                self.world_size
            ));
        }

        let _ = writeln!(t);
        for p in &problems {
            let _ = writeln!(t, "  problem: {p}");
        }
        hints.dedup();
        for h in &hints {
            let _ = writeln!(t, "  hint: {h}");
        }
        let detail = match (verdict, peak) {
            (Verdict::Ok, Some((bytes, bw))) if self.world_size > 1 => {
                format!(": busbw {bw:.1} GB/s at {}, 0 wrong", human_bytes(bytes))
            }
            (Verdict::Ok, _) => ": 0 wrong".to_string(),
            _ => String::new(),
        };
        let _ = writeln!(
            t,
            "preflight {}{detail} ({:.2} s; exit code {})",
            verdict.name(),
            self.wall_s,
            verdict.exit_code()
        );
        let json = serde_json::json!({
            "verdict": verdict.name(),
            "exit_code": verdict.exit_code(),
            "mode": self.mode,
            "world_size": self.world_size,
            "wall_s": self.wall_s,
            "nccl": versions.keys().collect::<Vec<_>>(),
            "other_libraries": self.other_libs,
            "ranks": self.reports.values().collect::<Vec<_>>(),
            "silent_ranks": self.silent.iter().map(|(r, h, s)| serde_json::json!({"rank": r, "host": h, "last_stage": s})).collect::<Vec<_>>(),
            "rows": rows_json,
            "problems": problems,
            "hints": hints,
            "line_rate": line_rate,
            "nccl_path": path_json,
        });
        Summary {
            verdict,
            text: t,
            json,
            problems,
            largest,
        }
    }
}

/// The job's line rate and how much of it the preflight got.
#[derive(Clone, Debug, Serialize)]
struct LineRate {
    gbs: f64,
    what: String,
    busbw_gbs: f64,
    efficiency: f64,
    slow: bool,
}

/// The path NCCL took, summed over the ranks.
struct NcclPathSum;

impl NcclPathSum {
    fn of(reports: &[&RankReport]) -> Option<hardware::NcclPath> {
        let mut sum = hardware::NcclPath::default();
        let mut channels = Vec::new();
        for p in reports.iter().filter_map(|r| r.path.as_ref()) {
            for (k, v) in &p.transports {
                *sum.transports.entry(k.clone()).or_default() += v;
            }
            for n in &p.nics {
                if !sum.nics.contains(n) {
                    sum.nics.push(n.clone());
                }
            }
            channels.push(p.channels);
        }
        sum.channels = channels.into_iter().min()?;
        Some(sum)
    }
}

impl Outcome {
    /// Each GPU's memory bandwidth against the job's other GPUs and the model's figure; true
    /// when one is degraded.
    fn memory(&self, reports: &[&RankReport], t: &mut String, problems: &mut Vec<String>) -> bool {
        let seen: Vec<(&RankReport, f64)> = reports
            .iter()
            .filter_map(|r| r.mem_gbs.map(|g| (*r, g)))
            .collect();
        if seen.is_empty() {
            return false;
        }
        let mut all: Vec<f64> = seen.iter().map(|(_, g)| *g).collect();
        all.sort_by(f64::total_cmp);
        let median = all[all.len() / 2];
        let model = seen
            .first()
            .and_then(|(r, _)| r.gpu.as_deref())
            .and_then(hardware::memory_gbs);
        let _ = writeln!(
            t,
            "  GPU memory: copies at {:.0}-{:.0} GB/s{}",
            all[0],
            all[all.len() - 1],
            model.map_or(String::new(), |(m, name)| format!(
                " ({:.0}% of the {name}'s {m:.0} GB/s)",
                100.0 * median / m
            ))
        );
        let mut slow = false;
        for (r, g) in &seen {
            let gpu = r.gpu.as_deref().unwrap_or("its GPU");
            if seen.len() > 1 && *g < 0.8 * median {
                slow = true;
                problems.push(format!(
                    "rank {} on {} ({gpu}): its memory copies at {g:.0} GB/s, under 80% of the \
                     job's median GPU ({median:.0} GB/s): a degraded GPU",
                    r.rank, r.host
                ));
            } else if let Some((m, name)) = model.filter(|(m, _)| *g < hardware::MEMORY_FLOOR * m) {
                slow = true;
                problems.push(format!(
                    "rank {} on {} ({gpu}): its memory copies at {g:.0} GB/s, under {:.0}% of the \
                     {name}'s {m:.0} GB/s",
                    r.rank,
                    r.host,
                    100.0 * hardware::MEMORY_FLOOR
                ));
            }
        }
        slow
    }

    /// Each GPU's health: one line when all are well, a problem for each check that fails and is
    /// not waived; the verdict that goes with the worst.
    fn health(
        &self,
        reports: &[&RankReport],
        t: &mut String,
        problems: &mut Vec<String>,
    ) -> Option<Verdict> {
        let seen: Vec<(&RankReport, &hardware::Health)> = reports
            .iter()
            .filter_map(|r| r.health.as_ref().map(|h| (*r, h)))
            .collect();
        let first = seen.first()?;
        let mut verdict = None;
        let mut unwell = 0;
        for (r, h) in &seen {
            for u in h.problems() {
                unwell += 1;
                let gpu = r.gpu.as_deref().unwrap_or("its GPU");
                if self.waived.contains(&u.check) {
                    let _ = writeln!(
                        t,
                        "  GPU health: rank {} on {} ({gpu}): {} (waived: {})",
                        r.rank, r.host, u.what, u.check
                    );
                    continue;
                }
                problems.push(format!(
                    "rank {} on {} ({gpu}): {} (--waive {} to run anyway)",
                    r.rank, r.host, u.what, u.check
                ));
                let v = if u.slows {
                    Verdict::Slow
                } else {
                    Verdict::Setup
                };
                verdict = Some(match verdict {
                    Some(Verdict::Setup) => Verdict::Setup,
                    _ => v,
                });
            }
        }
        if unwell == 0 {
            let _ = writeln!(
                t,
                "  GPU health: {} GPU(s) ok ({})",
                seen.len(),
                first.1.describe()
            );
        }
        verdict
    }

    /// The measured busbw against the line rate of the job's links (ranks on one node, with
    /// NVML's view of every GPU), with the causes nrun can see when it is too low.
    fn against_hardware(
        &self,
        complete: &[&RankReport],
        peak: Option<(u64, f64)>,
        t: &mut String,
        problems: &mut Vec<String>,
        hints: &mut Vec<String>,
    ) -> Option<LineRate> {
        let (bytes, bw) = peak?;
        let hosts: std::collections::BTreeSet<&str> =
            complete.iter().map(|r| r.host.as_str()).collect();
        let links: Vec<(&RankReport, &hardware::Links)> = complete
            .iter()
            .filter_map(|r| r.links.as_ref().map(|l| (*r, l)))
            .collect();
        if self.world_size < 2 || hosts.len() != 1 || links.len() != complete.len() {
            return None;
        }
        let (gbs, what) = links
            .iter()
            .map(|(_, l)| l.line_rate())
            .min_by(|a, b| a.0.total_cmp(&b.0))?;
        if gbs <= 0.0 {
            return None;
        }
        // GPUs of one model on one node have the same NVLink links: fewer up is a link down.
        // (The model: a rank's GPU is named with its bus id, which no other GPU shares.)
        let most = links.iter().map(|(_, l)| l.nvlink_up).max().unwrap_or(0);
        let down: Vec<&(&RankReport, &hardware::Links)> = links
            .iter()
            .filter(|(r, l)| {
                l.nvlink_up < most
                    && links
                        .iter()
                        .any(|(o, m)| m.nvlink_up == most && gpu_model(o) == gpu_model(r))
            })
            .collect();
        for (r, l) in &down {
            problems.push(format!(
                "rank {}'s GPU on {} has {} NVLink links up, its peers {most}: a link is down \
                 (nvidia-smi nvlink --status); the ring runs at the slowest GPU's rate",
                r.rank, r.host, l.nvlink_up
            ));
        }
        let efficiency = bw / gbs;
        let _ = writeln!(
            t,
            "  line rate: {what}; busbw {bw:.1} GB/s at {} is {:.0}% of it",
            human_bytes(bytes),
            efficiency * 100.0
        );
        let link_down = !down.is_empty();
        // Small messages measure latency, not bandwidth: judge from 64 MiB up.
        let Some(min) = self.min_efficiency.filter(|_| bytes >= 64 << 20) else {
            return Some(LineRate {
                gbs,
                what,
                busbw_gbs: bw,
                efficiency,
                slow: link_down,
            });
        };
        let slow = efficiency < min || link_down;
        if efficiency < min {
            problems.push(format!(
                "busbw {bw:.1} GB/s at {} is {:.0}% of the line rate ({what}), under \
                 --min-efficiency {min}",
                human_bytes(bytes),
                efficiency * 100.0
            ));
            if !self.path_vars.is_empty() {
                hints.push(format!(
                    "set here and changing NCCL's path: {}; unset them unless they are meant",
                    self.path_vars.join(", ")
                ));
            }
            let path = NcclPathSum::of(complete);
            let nvlink = links.iter().map(|(_, l)| l.nvlink_up).max().unwrap_or(0);
            if let Some(p) = path.as_ref().filter(|p| nvlink > 0 && !p.all_p2p()) {
                problems.push(format!(
                    "NVLink is up ({nvlink} links) but NCCL connected through {}: peer to peer \
                     is off or unavailable (NCCL_P2P_DISABLE/NCCL_P2P_LEVEL, or a container \
                     without P2P)",
                    p.describe()
                ));
            }
            if let Some(p) = path.as_ref().filter(|p| p.channels > 0 && p.channels < 4) {
                hints.push(format!(
                    "NCCL used only {} channel(s) (NCCL_MAX_NCHANNELS/NCCL_MIN_NCHANNELS?)",
                    p.channels
                ));
            }
            for (r, l) in links.iter().filter(|(_, l)| l.pcie_degraded()) {
                hints.push(format!(
                    "rank {}'s GPU runs PCIe Gen{} x{}, below its Gen{} x{}: reseat it or check \
                     the slot",
                    r.rank, l.pcie_gen, l.pcie_width, l.pcie_max_gen, l.pcie_max_width
                ));
            }
        }
        Some(LineRate {
            gbs,
            what,
            busbw_gbs: bw,
            efficiency,
            slow,
        })
    }
}

/// Under this fraction of the median node's network rate, a node's NIC is named slow.
const PEER_FLOOR: f64 = 0.5;
/// Under this fraction of the median link, a measured link is named slow: measurements vary
/// with the hosts' CPU load far more than the speeds NICs report do.
const LINK_FLOOR: f64 = 0.25;
/// A TCP stream of the net preflight reaches well over a tenth of any NIC's speed up to
/// 100 Gb/s; a link under it is shaped, erroring or negotiated down.
const TCP_FLOOR: f64 = 0.1;

impl Outcome {
    /// Several nodes: each node's network rate from the NICs its ranks use, the line rate of the
    /// slowest, and (net mode) each measured link against its NIC's speed and the other links.
    /// The line rate, and whether something here makes the run slow.
    fn network(
        &self,
        complete: &[&RankReport],
        peak: Option<(u64, f64)>,
        t: &mut String,
        problems: &mut Vec<String>,
        hints: &mut Vec<String>,
    ) -> (Option<LineRate>, bool) {
        let mut nics: BTreeMap<&str, BTreeMap<&str, &hardware::Nic>> = BTreeMap::new();
        for r in complete {
            let e = nics.entry(r.host.as_str()).or_default();
            for n in &r.nics {
                e.insert(n.name.as_str(), n);
            }
        }
        if nics.len() < 2 {
            return (None, false);
        }
        let mut slow = false;
        for (h, ns) in &nics {
            for n in ns.values().filter(|n| !n.up) {
                slow = true;
                problems.push(format!("node {h}: {} is down", n.name));
            }
        }
        // A node's rate: the NICs its ranks use, together; None when one's speed is unknown.
        let rates: BTreeMap<&str, (f64, String)> = nics
            .iter()
            .filter(|(_, ns)| !ns.is_empty())
            .filter_map(|(h, ns)| {
                let sum = ns.values().map(|n| n.gbs()).sum::<Option<f64>>()?;
                let what: Vec<String> = ns.values().map(|n| n.describe()).collect();
                Some((*h, (sum, what.join(" + "))))
            })
            .collect();
        let described: Vec<String> = nics
            .iter()
            .map(|(h, ns)| {
                let d: Vec<String> = ns.values().map(|n| n.describe()).collect();
                format!(
                    "{h} {}",
                    if d.is_empty() {
                        "?".into()
                    } else {
                        d.join(" + ")
                    }
                )
            })
            .collect();
        let same = rates.len() == nics.len()
            && rates
                .values()
                .all(|(_, w)| Some(w) == rates.values().next().map(|(_, w)| w));
        match same {
            true => {
                let w = rates.values().next().map_or("", |(_, w)| w.as_str());
                let _ = writeln!(t, "  network: {w} on each of {} nodes", nics.len());
            }
            false => {
                let _ = writeln!(t, "  network: {}", described.join("; "));
            }
        }
        if rates.len() >= 2 {
            let mut all: Vec<f64> = rates.values().map(|(g, _)| *g).collect();
            all.sort_by(f64::total_cmp);
            let median = all[all.len() / 2];
            for (h, (g, what)) in &rates {
                if *g < PEER_FLOOR * median {
                    slow = true;
                    problems.push(format!(
                        "node {h}'s network ({what}, {g:.2} GB/s) is {:.0}% of the median \
                         node's ({median:.2} GB/s): the ring runs at its slowest node's rate; \
                         check the cable, the switch port and the negotiated speed (ethtool)",
                        100.0 * g / median
                    ));
                }
            }
        }
        if self.mode == Mode::Net {
            slow |= self.links(complete, &nics, t, problems);
        }
        let (Some((bytes, bw)), Some((h, (gbs, what)))) = (
            peak,
            rates
                .iter()
                .min_by(|a, b| a.1.0.total_cmp(&b.1.0))
                .filter(|_| rates.len() == nics.len()),
        ) else {
            return (None, slow);
        };
        let efficiency = bw / gbs;
        let what = format!("network, slowest node {h} {what} = {gbs:.2} GB/s");
        let _ = writeln!(
            t,
            "  line rate: {what}; busbw {bw:.2} GB/s at {} is {:.0}% of it",
            human_bytes(bytes),
            efficiency * 100.0
        );
        // The TCP ring is bounded by the CPU, not the NIC, on fast networks: judged by its links
        // above. NCCL's busbw is judged against the line rate as on one node.
        let min = self
            .min_efficiency
            .filter(|_| self.mode == Mode::Nccl && bytes >= 64 << 20);
        let line_slow = min.is_some_and(|m| efficiency < m);
        if let Some(m) = min.filter(|_| line_slow) {
            problems.push(format!(
                "busbw {bw:.2} GB/s at {} is {:.0}% of the network's line rate ({what}), under \
                 --min-efficiency {m}",
                human_bytes(bytes),
                efficiency * 100.0
            ));
            let path = NcclPathSum::of(complete);
            if let Some(p) = path.filter(|p| p.transports.contains_key("NET/Socket")) {
                hints.push(format!(
                    "NCCL went through sockets ({}): if the nodes have InfiniBand or RoCE, check \
                     NCCL_IB_DISABLE/NCCL_NET and that the IB devices are visible (ibv_devinfo)",
                    p.describe()
                ));
            }
            if !self.path_vars.is_empty() {
                hints.push(format!(
                    "set here and changing NCCL's path: {}; unset them unless they are meant",
                    self.path_vars.join(", ")
                ));
            }
        }
        (
            Some(LineRate {
                gbs: *gbs,
                what,
                busbw_gbs: bw,
                efficiency,
                slow: line_slow,
            }),
            slow || line_slow,
        )
    }

    /// The net preflight's ring links between nodes, each measured alone: one far under the
    /// others or under its NIC's speed is named with the node it leaves. True when one is.
    fn links(
        &self,
        complete: &[&RankReport],
        nics: &BTreeMap<&str, BTreeMap<&str, &hardware::Nic>>,
        t: &mut String,
        problems: &mut Vec<String>,
    ) -> bool {
        let by_rank: BTreeMap<usize, &RankReport> = complete.iter().map(|r| (r.rank, *r)).collect();
        // (from host, to host, GB/s): only the links that cross between nodes.
        let links: Vec<(&str, &str, f64)> = complete
            .iter()
            .filter_map(|r| {
                let l = r.link_in?;
                let from = by_rank.get(&l.from)?;
                (from.host != r.host).then_some((from.host.as_str(), r.host.as_str(), l.gbs))
            })
            .collect();
        if links.is_empty() {
            return false;
        }
        let parts: Vec<String> = links
            .iter()
            .map(|(a, b, g)| format!("{a} -> {b} {g:.2}"))
            .collect();
        let _ = writeln!(
            t,
            "  links between nodes (GB/s, each alone): {}",
            parts.join(", ")
        );
        let mut all: Vec<f64> = links.iter().map(|l| l.2).collect();
        all.sort_by(f64::total_cmp);
        let median = all[all.len() / 2];
        let mut slow: Vec<(&str, &str)> = Vec::new();
        for (from, to, g) in &links {
            let nic = nics.get(from).and_then(|ns| {
                (ns.len() == 1)
                    .then(|| ns.values().next().copied())
                    .flatten()
            });
            if links.len() >= 2 && *g < LINK_FLOOR * median {
                slow.push((from, to));
                problems.push(format!(
                    "the link from {from} to {to} carried {g:.3} GB/s, {:.0}% of the median \
                     link's {median:.2} GB/s",
                    100.0 * g / median,
                ));
            }
            if let Some((n, speed)) = nic.and_then(|n| n.gbs().map(|s| (n, s))) {
                if *g < TCP_FLOOR * speed {
                    slow.push((from, to));
                    problems.push(format!(
                        "the link from {from} to {to} carried {g:.3} GB/s, {:.0}% of the {} \
                         that {from}'s {} reports ({speed:.2} GB/s)",
                        100.0 * g / speed,
                        hardware::speed_text(n.mbps.unwrap_or(0)),
                        n.name
                    ));
                }
            }
        }
        slow.dedup();
        // A link's data leaves one host and its ACKs the other: either end may be at fault. A
        // host in every slow link (of several) is the one to look at.
        let common: Vec<&str> = slow
            .first()
            .map(|(a, b)| {
                [*a, *b]
                    .into_iter()
                    .filter(|h| slow.iter().all(|(x, y)| x == h || y == h))
                    .collect()
            })
            .unwrap_or_default();
        match (slow.len(), common.as_slice()) {
            (0, _) => {}
            (n, [h]) if n > 1 => problems.push(format!(
                "{h} is in every slow link: check its network first (traffic shaping, errors, \
                 a bad cable or port, its negotiated speed)"
            )),
            (_, _) => {
                for (a, b) in &slow {
                    problems.push(format!(
                        "{a} or {b}: check their network (traffic shaping, errors, a bad cable or \
                         port, the negotiated speed)"
                    ));
                }
            }
        }
        !slow.is_empty()
    }
}

/// The model of a rank's GPU, without the bus id its name ends with.
fn gpu_model(r: &RankReport) -> Option<&str> {
    let g = r.gpu.as_deref()?;
    Some(g.rsplit_once(" (").map_or(g, |(model, _)| model))
}

fn ranks_text(r: &[usize]) -> String {
    r.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_sweep() {
        assert_eq!(parse_sizes("8:256M:2").unwrap(), (8, 256 << 20, 2));
        assert_eq!(parse_sizes("1K:2G:4").unwrap(), (1024, 2 << 30, 4));
        assert!(parse_sizes("8:4:2").is_err());
        assert!(parse_sizes("8:4K:1").is_err());
        assert!(parse_sizes("x").is_err());
        let s = Settings {
            id: "x".into(),
            mode: Mode::Net,
            min_bytes: 8,
            max_bytes: 1024,
            factor: 4,
            iters: 1,
            warmup: 0,
            timeout_ms: 1,
            nccl_lib: None,
            listen_addr: "127.0.0.1".into(),
            links: true,
        };
        assert_eq!(s.sizes(), vec![8, 32, 128, 512]);
        // The keys ranks report through, as the coordinator and bisect read them.
        assert_eq!(s.result_key(3), b"nrun/pf/x/result/3");
        assert_eq!(s.stage_key(3), b"nrun/pf/x/stage/3");
        assert_eq!(s.abort_key(), b"nrun/pf/x/abort");
    }

    #[test]
    fn bus_bandwidth_as_nccl_tests() {
        // 1 GB in 10 ms on 8 ranks: algbw 100 GB/s, busbw 175 GB/s.
        let (a, b) = busbw(1_000_000_000, 10_000.0, 8);
        assert!((a - 100.0).abs() < 1e-9 && (b - 175.0).abs() < 1e-9);
    }

    fn report(rank: usize, host: &str, us: f64, wrong: u64) -> RankReport {
        RankReport {
            nics: Vec::new(),
            link_in: None,
            rank,
            local_rank: rank,
            host: host.into(),
            pid: 1,
            nccl_version: Some("2.28.9".into()),
            nccl_path: Some("/x/libnccl.so.2".into()),
            gpu: None,
            driver: None,
            init_ms: Some(100.0),
            phases_ms: vec![],
            rows: vec![Row {
                bytes: 1 << 20,
                oop_us: us,
                oop_wrong: wrong,
                ip_us: us,
                ip_wrong: 0,
            }],
            error: None,
            links: None,
            health: None,
            path: None,
            mem_gbs: None,
        }
    }

    fn outcome(reports: Vec<RankReport>) -> Outcome {
        Outcome {
            world_size: reports.len(),
            mode: Mode::Nccl,
            reports: reports.into_iter().map(|r| (r.rank, r)).collect(),
            silent: vec![],
            crashed: None,
            nccl_lib: None,
            min_busbw: None,
            min_efficiency: Some(0.4),
            path_vars: vec![],
            waived: vec![],
            wall_s: 1.0,
            other_libs: vec![],
        }
    }

    /// Two ranks on one node with 18 NVLink links each, at 256 MiB in `us`, via `transport`.
    fn nvlink_pair(us: f64, transport: &str) -> Outcome {
        let links = hardware::Links {
            nvlink_up: 18,
            nvlink_gbs: 25.0,
            nvlink_version: 6,
            pcie_gen: 5,
            pcie_width: 16,
            pcie_max_gen: 5,
            pcie_max_width: 16,
        };
        let path = hardware::NcclPath {
            transports: [(transport.to_string(), 24)].into(),
            channels: 24,
            nics: vec![],
        };
        let mut rs = vec![report(0, "a", us, 0), report(1, "a", us, 0)];
        for r in &mut rs {
            r.rows[0].bytes = 256 << 20;
            r.links = Some(links.clone());
            r.path = Some(path.clone());
        }
        outcome(rs)
    }

    #[test]
    fn slow_against_the_line_rate_with_its_causes() {
        // 256 MiB in 900 us on 2 ranks: busbw 298 GB/s, 66% of 450 GB/s.
        let ok = nvlink_pair(900.0, "P2P/CUMEM").summarize();
        assert_eq!(ok.verdict, Verdict::Ok, "{}", ok.text);
        assert!(
            ok.text.contains("line rate: NVLink 18 links x 25 GB/s = 450 GB/s; busbw 298.3 GB/s at 256 MiB is 66% of it")
                && ok.text.contains("NCCL path: P2P/CUMEM x48, 24 channels"),
            "{}",
            ok.text
        );
        // Sockets instead of NVLink: 1% of the line rate, the variable and the path named.
        let mut sockets = nvlink_pair(70_000.0, "NET/Socket");
        sockets.path_vars = vec!["NCCL_P2P_DISABLE=1 (disables NVLink/PCIe peer to peer)".into()];
        let s = sockets.summarize();
        assert_eq!(s.verdict, Verdict::Slow, "{}", s.text);
        assert!(s.text.contains("under --min-efficiency 0.4"), "{}", s.text);
        assert!(
            s.text
                .contains("NVLink is up (18 links) but NCCL connected through NET/Socket x48"),
            "{}",
            s.text
        );
        assert!(s.text.contains("NCCL_P2P_DISABLE=1"), "{}", s.text);
        assert_eq!(s.json["line_rate"]["slow"], true);
        // GPU health: shown when well, a problem (and its verdict) when not, unless waived.
        let mut hot = nvlink_pair(900.0, "P2P/CUMEM");
        let h = hardware::Health {
            temperature_c: Some(41),
            slowdowns: vec!["hardware thermal".into()],
            ..Default::default()
        };
        hot.reports.get_mut(&1).unwrap().health = Some(h.clone());
        let s = hot.summarize();
        assert_eq!(s.verdict, Verdict::Slow, "{}", s.text);
        assert!(
            s.text
                .contains("rank 1 on a (its GPU): clocks slowed down now (hardware thermal)"),
            "{}",
            s.text
        );
        assert!(s.text.contains("--waive throttle"), "{}", s.text);
        hot.waived = vec![hardware::Waiver::Throttle];
        assert_eq!(hot.summarize().verdict, Verdict::Ok);
        // GPU memory: a GPU far under the others (or its model's figure) is named.
        let mut mem = nvlink_pair(900.0, "P2P/CUMEM");
        for (r, g) in mem.reports.values_mut().zip([3900.0, 1500.0]) {
            r.gpu = Some("NVIDIA H200 (0000:00:06.0)".into());
            r.mem_gbs = Some(g);
        }
        let s = mem.summarize();
        assert_eq!(s.verdict, Verdict::Slow, "{}", s.text);
        assert!(
            s.text.contains("GPU memory: copies at 1500-3900 GB/s"),
            "{}",
            s.text
        );
        assert!(
            s.text
                .contains("under 80% of the job's median GPU (3900 GB/s): a degraded GPU"),
            "{}",
            s.text
        );
        // A GPU with NVLink links down among peers with all up.
        let mut down = nvlink_pair(900.0, "P2P/CUMEM");
        if let Some(l) = down.reports.get_mut(&1).unwrap().links.as_mut() {
            l.nvlink_up = 16;
        }
        let s = down.summarize();
        assert_eq!(s.verdict, Verdict::Slow, "{}", s.text);
        assert!(
            s.text
                .contains("rank 1's GPU on a has 16 NVLink links up, its peers 18: a link is down"),
            "{}",
            s.text
        );
        // Turned off, or sizes too small to measure bandwidth: shown, not judged.
        let mut off = nvlink_pair(70_000.0, "P2P/CUMEM");
        off.min_efficiency = None;
        assert_eq!(off.summarize().verdict, Verdict::Ok);
    }

    fn nic(name: &str, mbps: u64) -> hardware::Nic {
        hardware::Nic {
            name: name.into(),
            mbps: Some(mbps),
            up: true,
        }
    }

    /// Three nodes, one rank each, in a net-mode ring 0 -> 1 -> 2 -> 0; `gbs[i]` is what the
    /// link into rank i carried, `mbps[i]` the speed its eth0 reports.
    fn net_ring(gbs: [f64; 3], mbps: [u64; 3]) -> Outcome {
        let mut rs: Vec<RankReport> = (0..3)
            .map(|i| {
                let mut r = report(i, &format!("h{}", i + 1), 10_000.0, 0);
                r.nics = vec![nic("eth0", mbps[i])];
                r.link_in = Some(LinkIn {
                    from: (i + 2) % 3,
                    gbs: gbs[i],
                });
                r
            })
            .collect();
        rs[0].rows[0].bytes = 16 << 20;
        let mut o = outcome(std::mem::take(&mut rs));
        for r in o.reports.values_mut() {
            r.rows[0].bytes = 16 << 20;
        }
        o.mode = Mode::Net;
        o
    }

    #[test]
    fn the_network_against_its_speed_and_the_peers() {
        let ok = net_ring([1.0, 1.1, 0.9], [10_000; 3]).summarize();
        assert_eq!(ok.verdict, Verdict::Ok, "{}", ok.text);
        assert!(
            ok.text.contains("network: eth0 10 Gb/s on each of 3 nodes")
                && ok.text.contains("line rate: network, slowest node h1 eth0 10 Gb/s = 1.25 GB/s")
                && ok.text.contains("links between nodes (GB/s, each alone): h3 -> h1 1.00, h1 -> h2 1.10, h2 -> h3 0.90"),
            "{}",
            ok.text
        );
        // h3's egress shaped to a tenth: the link into h1 names h3, against its speed and peers.
        let s = net_ring([0.1, 1.1, 0.9], [10_000; 3]).summarize();
        assert_eq!(s.verdict, Verdict::Slow, "{}", s.text);
        assert!(
            s.text.contains("the link from h3 to h1 carried 0.100 GB/s, 11% of the median link's 0.90 GB/s")
                && s.text.contains("h3 or h1: check their network")
                && s.text.contains("the link from h3 to h1 carried 0.100 GB/s, 8% of the 10 Gb/s that h3's eth0 reports"),
            "{}",
            s.text
        );
        assert_eq!(
            s.problems
                .iter()
                .filter(|p| p.contains("h1 to") || p.contains("h2 to"))
                .count(),
            0,
            "{}",
            s.text
        );
        // A node whose NIC negotiated a tenth of the others' speed.
        let s = net_ring([1.0, 0.12, 0.9], [10_000, 1000, 10_000]).summarize();
        assert_eq!(s.verdict, Verdict::Slow, "{}", s.text);
        assert!(
            s.text.contains("network: h1 eth0 10 Gb/s; h2 eth0 1 Gb/s; h3 eth0 10 Gb/s")
                && s.text.contains("node h2's network (eth0 1 Gb/s, 0.12 GB/s) is 10% of the median node's (1.25 GB/s)"),
            "{}",
            s.text
        );
        // A NIC that is down.
        let mut down = net_ring([1.0, 1.1, 0.9], [10_000; 3]);
        down.reports.get_mut(&2).unwrap().nics[0].up = false;
        let s = down.summarize();
        assert!(s.text.contains("node h3: eth0 is down"), "{}", s.text);
        // NCCL across nodes: busbw judged against the slowest node's NICs.
        let mut nccl = net_ring([1.0; 3], [100_000; 3]);
        nccl.mode = Mode::Nccl;
        for r in nccl.reports.values_mut() {
            r.link_in = None;
            r.rows[0].bytes = 256 << 20;
            // busbw 2 GB/s of the 12.5 the NICs give.
            r.rows[0].oop_us = 268_435_456.0 / 1.5e3;
            r.rows[0].ip_us = r.rows[0].oop_us;
            r.path = Some(hardware::NcclPath {
                transports: [("NET/Socket".to_string(), 4)].into(),
                channels: 2,
                nics: vec!["eth0".into()],
            });
        }
        let s = nccl.summarize();
        assert_eq!(s.verdict, Verdict::Slow, "{}", s.text);
        assert!(
            s.text.contains("of the network's line rate (network, slowest node h1 eth0 100 Gb/s = 12.50 GB/s), under --min-efficiency 0.4")
                && s.text.contains("NCCL went through sockets (NET/Socket x12 through eth0, 2 channels)"),
            "{}",
            s.text
        );
    }

    /// Summaries of many outcomes, text and JSON, against files recorded from the summary as
    /// it was before findings became data (NRUN_BLESS=1 records them again): a refactor of the
    /// checks must not change a byte of either.
    #[test]
    fn summaries_match_the_recorded_ones() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/summaries");
        let bless = std::env::var_os("NRUN_BLESS").is_some();
        let mut differ = Vec::new();
        for (name, o) in golden_outcomes() {
            let s = o.summarize();
            let got = format!(
                "exit {}\n{}\n--- problems\n{}\n--- json\n{}\n",
                s.verdict.exit_code(),
                s.text,
                s.problems.join("\n"),
                serde_json::to_string_pretty(&s.json).unwrap()
            );
            let path = dir.join(format!("{name}.txt"));
            if bless {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &got).unwrap();
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(got.as_str()) {
                differ.push(format!("{name}:\n{got}"));
            }
        }
        assert!(differ.is_empty(), "{}", differ.join("\n"));
    }

    fn golden_outcomes() -> Vec<(&'static str, Outcome)> {
        let mut v: Vec<(&'static str, Outcome)> = Vec::new();
        let two = || outcome(vec![report(0, "a", 10.0, 0), report(1, "a", 10.0, 0)]);
        v.push(("ok-two", two()));
        let mut one = outcome(vec![report(0, "a", 10.0, 0)]);
        one.nccl_lib = Some("/lib/libnccl.so.2".into());
        one.other_libs =
            vec!["NCCL 2.21.5 at /usr/lib/libnccl.so.2 (the system's; not used)".into()];
        v.push(("ok-one", one));
        v.push((
            "wrong",
            outcome(vec![report(0, "a", 10.0, 3), report(1, "a", 10.0, 0)]),
        ));
        let mut slow = two();
        slow.min_busbw = Some(1000.0);
        v.push(("min-busbw", slow));
        let mut four = outcome(vec![
            report(0, "a", 10.0, 0),
            report(1, "b", 10.0, 0),
            report(2, "c", 10.0, 0),
            report(3, "d", 30.0, 0),
        ]);
        for r in four.reports.values_mut() {
            r.gpu = Some(format!("NVIDIA H200 (0000:00:0{}.0)", r.rank));
            r.driver = Some("12.8".into());
            r.phases_ms = vec![
                ("nccl-load".into(), 5.0 + r.rank as f64),
                ("init".into(), 90.0),
            ];
            r.init_ms = Some(100.0 + 10.0 * r.rank as f64);
        }
        v.push(("slow-node", four));
        let mut silent = outcome(vec![report(0, "a", 10.0, 0), report(1, "b", 10.0, 0)]);
        silent.silent = vec![
            (2, "c".into(), Some("id".into())),
            (3, "d".into(), None),
            (4, "e".into(), Some("bogus".into())),
        ];
        silent.world_size = 5;
        v.push(("silent", silent));
        let mut crashed = outcome(vec![report(0, "a", 10.0, 0)]);
        crashed.silent = vec![(1, "b".into(), Some("init".into())), (2, "c".into(), None)];
        crashed.world_size = 3;
        crashed.crashed = Some((1, "pid 7 killed by SIGSEGV".into()));
        v.push(("crashed-silent", crashed));
        let mut after = two();
        after.crashed = Some((1, "pid 7 exit code 3".into()));
        v.push(("crashed-after-reporting", after));
        let mut partial = two();
        partial.world_size = 3;
        v.push(("incomplete", partial));
        let errs = |kinds: &[&str]| {
            let rs = kinds
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    let mut r = report(i, &format!("h{}", i % 3), 0.0, 0);
                    if !k.is_empty() {
                        r.error = Some(RankError {
                            kind: k.to_string(),
                            message: format!("{k} went wrong"),
                        });
                    }
                    r
                })
                .collect();
            outcome(rs)
        };
        v.push(("init-error", errs(&["", "init"])));
        v.push(("many-init-errors", errs(&["init"; 11])));
        v.push((
            "errors-and-aborted",
            errs(&[
                "aborted",
                "setup",
                "init-timeout",
                "aborted",
                "store",
                "collective",
            ]),
        ));
        v.push(("only-aborted", errs(&["aborted", "aborted"])));
        v.push(("odd-kind", errs(&["", "weird"])));
        let mut other = report(1, "b", 10.0, 0);
        other.nccl_version = Some("2.28.3".into());
        v.push((
            "nccl-differs",
            outcome(vec![report(0, "a", 10.0, 0), other]),
        ));
        let mut empty = outcome(vec![]);
        empty.nccl_lib = Some("/lib/libnccl.so.2".into());
        v.push(("empty", empty));

        // One node's links.
        v.push(("nvlink-ok", nvlink_pair(900.0, "P2P/CUMEM")));
        let mut sockets = nvlink_pair(70_000.0, "NET/Socket");
        sockets.path_vars = vec!["NCCL_P2P_DISABLE=1 (disables NVLink/PCIe peer to peer)".into()];
        v.push(("nvlink-sockets", sockets));
        let mut narrow = nvlink_pair(70_000.0, "P2P/CUMEM");
        for r in narrow.reports.values_mut() {
            if let Some(p) = r.path.as_mut() {
                p.channels = 2;
            }
            if let Some(l) = r.links.as_mut() {
                l.pcie_gen = 4;
                l.pcie_width = 8;
            }
        }
        v.push(("nvlink-narrow", narrow));
        let mut pcie = nvlink_pair(70_000.0, "SHM");
        for r in pcie.reports.values_mut() {
            if let Some(l) = r.links.as_mut() {
                l.nvlink_up = 0;
                l.nvlink_gbs = 0.0;
            }
        }
        v.push(("pcie", pcie));
        let mut small = nvlink_pair(70_000.0, "P2P/CUMEM");
        for r in small.reports.values_mut() {
            r.rows[0].bytes = 1 << 20;
        }
        v.push(("nvlink-small", small));
        let mut off = nvlink_pair(70_000.0, "P2P/CUMEM");
        off.min_efficiency = None;
        v.push(("nvlink-off", off));
        let mut down = nvlink_pair(900.0, "P2P/CUMEM");
        if let Some(l) = down.reports.get_mut(&1).unwrap().links.as_mut() {
            l.nvlink_up = 16;
        }
        v.push(("nvlink-down", down));
        // As real ranks report them: each GPU named with its own bus id.
        let mut down = nvlink_pair(900.0, "P2P/CUMEM");
        for r in down.reports.values_mut() {
            r.gpu = Some(format!("NVIDIA H200 (0000:00:0{}.0)", r.rank));
        }
        if let Some(l) = down.reports.get_mut(&1).unwrap().links.as_mut() {
            l.nvlink_up = 16;
        }
        v.push(("nvlink-down-bus-ids", down));
        let mut hot = nvlink_pair(900.0, "P2P/CUMEM");
        hot.reports.get_mut(&1).unwrap().health = Some(hardware::Health {
            temperature_c: Some(41),
            slowdowns: vec!["hardware thermal".into()],
            ..Default::default()
        });
        v.push(("health-throttle", hot));
        let mut waived = nvlink_pair(900.0, "P2P/CUMEM");
        for r in waived.reports.values_mut() {
            r.gpu = Some(format!("NVIDIA H200 (0000:00:0{}.0)", r.rank));
            r.health = Some(hardware::Health {
                temperature_c: Some(41),
                persistence: Some(true),
                ecc_uncorrected: Some(r.rank as u64 * 2),
                slowdowns: if r.rank == 1 {
                    vec!["hardware thermal".into()]
                } else {
                    vec![]
                },
                mig: Some(r.rank == 1),
                ..Default::default()
            });
        }
        waived.waived = vec![hardware::Waiver::Throttle, hardware::Waiver::Ecc];
        v.push(("health-waived-and-mig", waived));
        let mut well = nvlink_pair(900.0, "P2P/CUMEM");
        for r in well.reports.values_mut() {
            r.health = Some(hardware::Health {
                temperature_c: Some(35),
                persistence: Some(true),
                ecc_uncorrected: Some(0),
                nvlink_errors: Some(3),
                ..Default::default()
            });
        }
        v.push(("health-ok", well));
        let mut mem = nvlink_pair(900.0, "P2P/CUMEM");
        for (r, g) in mem.reports.values_mut().zip([3900.0, 1500.0]) {
            r.gpu = Some("NVIDIA H200 (0000:00:06.0)".into());
            r.mem_gbs = Some(g);
        }
        v.push(("memory-peer", mem));
        let mut mem = nvlink_pair(900.0, "P2P/CUMEM");
        for r in mem.reports.values_mut() {
            r.gpu = Some("NVIDIA H100 (0000:00:06.0)".into());
            r.mem_gbs = Some(1000.0);
        }
        v.push(("memory-model", mem));
        let mut mem = nvlink_pair(900.0, "P2P/CUMEM");
        for r in mem.reports.values_mut() {
            r.mem_gbs = Some(1000.0);
        }
        v.push(("memory-unknown-model", mem));

        // Several nodes.
        v.push(("net-ok", net_ring([1.0, 1.1, 0.9], [10_000; 3])));
        v.push(("net-shaped", net_ring([0.1, 1.1, 0.9], [10_000; 3])));
        v.push(("net-common-host", net_ring([0.1, 0.05, 0.9], [10_000; 3])));
        v.push(("net-two-slow", net_ring([0.01, 1.1, 0.01], [10_000; 3])));
        v.push((
            "net-slow-nic",
            net_ring([1.0, 0.12, 0.9], [10_000, 1000, 10_000]),
        ));
        let mut down = net_ring([1.0, 1.1, 0.9], [10_000; 3]);
        down.reports.get_mut(&2).unwrap().nics[0].up = false;
        v.push(("net-nic-down", down));
        let mut unknown = net_ring([1.0, 1.1, 0.9], [10_000; 3]);
        unknown.reports.get_mut(&1).unwrap().nics[0].mbps = None;
        v.push(("net-speed-unknown", unknown));
        let mut none = net_ring([1.0, 1.1, 0.9], [10_000; 3]);
        none.reports.get_mut(&0).unwrap().nics.clear();
        v.push(("net-no-nic", none));
        let mut two_nics = net_ring([1.0, 1.1, 0.9], [10_000; 3]);
        for r in two_nics.reports.values_mut() {
            r.nics.push(nic("eth1", 25_000));
        }
        v.push(("net-two-nics", two_nics));
        for (name, us) in [
            ("nccl-nodes-slow", 268_435_456.0 / 1.5e3),
            ("nccl-nodes-ok", 268_435_456.0 / 12e3),
        ] {
            let mut nccl = net_ring([1.0; 3], [100_000; 3]);
            nccl.mode = Mode::Nccl;
            nccl.path_vars = vec!["NCCL_IB_DISABLE=1 (no InfiniBand)".into()];
            for r in nccl.reports.values_mut() {
                r.link_in = None;
                r.rows[0].bytes = 256 << 20;
                r.rows[0].oop_us = us;
                r.rows[0].ip_us = us;
                r.path = Some(hardware::NcclPath {
                    transports: [("NET/Socket".to_string(), 4)].into(),
                    channels: 2,
                    nics: vec!["eth0".into()],
                });
            }
            v.push((name, nccl));
        }
        v
    }

    #[test]
    fn verdicts() {
        let ok = outcome(vec![report(0, "a", 10.0, 0), report(1, "a", 10.0, 0)]).summarize();
        assert_eq!(ok.verdict, Verdict::Ok, "{}", ok.text);
        let wrong = outcome(vec![report(0, "a", 10.0, 3), report(1, "a", 10.0, 0)]).summarize();
        assert_eq!(wrong.verdict, Verdict::Wrong);
        assert!(wrong.text.contains("3 elements"), "{}", wrong.text);
        let mut slow = outcome(vec![report(0, "a", 10.0, 0), report(1, "a", 10.0, 0)]);
        slow.min_busbw = Some(1000.0);
        assert_eq!(slow.summarize().verdict, Verdict::Slow);
        // A slow node among four is named.
        let mut four = outcome(vec![
            report(0, "a", 10.0, 0),
            report(1, "b", 10.0, 0),
            report(2, "c", 10.0, 0),
            report(3, "d", 30.0, 0),
        ]);
        let s = four.summarize();
        assert!(s.text.contains("node d is slow"), "{}", s.text);
        // Silent and failing ranks.
        four.silent.push((4, "e".into(), Some("id".into())));
        four.world_size = 5;
        let s = four.summarize();
        assert_eq!(s.verdict, Verdict::Timeout);
        assert!(
            s.text
                .contains("rank 4 on e went silent: it last has the unique id"),
            "{}",
            s.text
        );
        let mut bad = report(1, "b", 0.0, 0);
        bad.error = Some(RankError {
            kind: "init".into(),
            message: "ncclSystemError".into(),
        });
        let s = outcome(vec![report(0, "a", 1.0, 0), bad]).summarize();
        assert_eq!(s.verdict, Verdict::InitFailed);
        assert!(
            s.text.contains("rank 1 on b (pid 1): ncclSystemError")
                && s.text.contains("NCCL_DEBUG=INFO"),
            "{}",
            s.text
        );
        // Different NCCL versions are named.
        let mut other = report(1, "b", 10.0, 0);
        other.nccl_version = Some("2.28.3".into());
        let s = outcome(vec![report(0, "a", 10.0, 0), other]).summarize();
        assert!(s.text.contains("NCCL differs between ranks"), "{}", s.text);
    }
}
