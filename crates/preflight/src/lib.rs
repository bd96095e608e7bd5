//! The all-reduce preflight: before the job, prove with the job's exact rank layout, environment
//! and libnccl that a communicator forms across all ranks and all-reduces correctly at speed.
//!
//! - [`nccl`]: libnccl by explicit path, and which one the job would load.
//! - [`cuda`]: the CUDA driver calls (cudarc, loaded at run time).
//! - [`hardware`]: the GPU's links and line rate (NVML), the path NCCL took (its INFO log).
//! - [`worker`]: one preflight rank (nrun itself, started like a job worker): NCCL on a GPU, or a
//!   TCP ring on the CPU (`--preflight=net`).
//! - [`finding`]: what a check found, as data, and the fold of findings into the verdict.
//! - `checks.rs`: the checks, each a function from the ranks' reports to findings.
//! - `summary.rs`: the sweep table, the checks run in order, the text and the JSON report.
//! - this file: settings, the store keys ranks report through, and the verdict.
//!
//! Ranks never exit non-zero for a failed check: each writes a [`RankReport`] to the store
//! (error included) and exits 0, so the coordinator sees every rank's view, not only the first
//! to die. A rank that fails sets an abort key; the others stop waiting at once.

mod checks;
pub use checks::median;
pub mod cuda;
pub mod finding;
pub mod hardware;
pub mod nccl;
mod summary;
pub use checks::far_under_peers;
pub mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use nrun_base::error::{Error, exit};

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
    /// The node's label as the launcher names it, one per machine (host names are labels that
    /// cloned machines share): what the ranks report as their host, so that ranks are grouped
    /// by machine and links between machines are told apart. None: this host's name.
    #[serde(default)]
    pub host: Option<String>,
}

pub(crate) const ENV: &str = "NRUN_PREFLIGHT";

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

    /// Size `index` of the sweep (in [`Settings::sizes`]' order), as rank 0 measured it: a
    /// [`Row`] as JSON, set as soon as it is measured, so that the launcher shows the sweep as
    /// it goes ([`SizeReader`]); the reports come only at the end.
    pub fn size_key(&self, index: usize) -> Vec<u8> {
        self.key(format_args!("size/{index}"))
    }

    /// Set (to its rank) by the first rank that fails, so the others stop waiting.
    pub(crate) fn abort_key(&self) -> Vec<u8> {
        self.key(format_args!("abort"))
    }

    /// Rank 0's NCCL unique id.
    pub(crate) fn uid_key(&self) -> Vec<u8> {
        self.key(format_args!("uid"))
    }

    /// The barrier the ranks leave through together.
    pub(crate) fn finished_key(&self) -> Vec<u8> {
        self.key(format_args!("finished"))
    }

    /// Net mode: the address rank `rank` listens on.
    pub(crate) fn addr_key(&self, rank: usize) -> Vec<u8> {
        self.key(format_args!("addr/{rank}"))
    }

    /// Net mode: the barrier ending turn `turn` of the link test.
    pub(crate) fn link_key(&self, turn: usize) -> Vec<u8> {
        self.key(format_args!("link/{turn}"))
    }

    /// Net mode: the barrier every rank reaches, its ring connected, before the link test.
    pub(crate) fn link_start_key(&self) -> Vec<u8> {
        self.key(format_args!("link/start"))
    }

    /// Net mode: what the link into rank `rank` carried in the link test (GB/s, as text).
    pub(crate) fn link_rate_key(&self, rank: usize) -> Vec<u8> {
        self.key(format_args!("link-rate/{rank}"))
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
pub(crate) fn reports_from(
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

impl Row {
    /// One line for this size as rank 0 measured it: "1 MiB: busbw 12.30 GB/s, 0 wrong (rank
    /// 0)" (the better of out-of-place and in-place; one rank alone: its algbw). The table at
    /// the end has every rank's.
    pub fn line(&self, world: usize) -> String {
        let best = self.oop_us.min(self.ip_us).max(0.0);
        let (alg, bus) = busbw(self.bytes, best, world);
        let bw = match world > 1 {
            true => format!("busbw {bus:.2} GB/s"),
            false => format!("algbw {alg:.2} GB/s"),
        };
        format!(
            "{}: {bw}, {} wrong (rank 0)",
            human_bytes(self.bytes),
            self.oop_wrong + self.ip_wrong
        )
    }
}

/// Reads the sweep's sizes as rank 0 publishes them ([`Settings::size_key`]), in order.
#[derive(Default)]
pub struct SizeReader {
    next: usize,
}

impl SizeReader {
    /// The sizes published since the last call, in order (a size waits for those before it).
    pub fn read(
        &mut self,
        s: &Settings,
        get: &mut dyn FnMut(&[u8]) -> Option<Vec<u8>>,
    ) -> Vec<Row> {
        let mut rows = Vec::new();
        while let Some(row) =
            get(&s.size_key(self.next)).and_then(|v| serde_json::from_slice::<Row>(&v).ok())
        {
            rows.push(row);
            self.next += 1;
        }
        rows
    }

    /// How many sizes were read.
    pub fn count(&self) -> usize {
        self.next
    }
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
    /// What the link to the next rank lost in the link test (`--preflight net`): the kernel's
    /// count of segments sent and retransmitted on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_out: Option<LinkOut>,
    /// The sweep's larger sizes left out, and why (a slow link would take too long on them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep_cut: Option<String>,
}

/// What the sender of a ring link saw of it in the link test (TCP_INFO).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct LinkOut {
    /// The rank it sends to.
    pub to: usize,
    pub segments: u32,
    pub retransmitted: u32,
    /// Of those, how many the receiver got twice (its DSACKs, TCP_INFO's tcpi_dsack_dups):
    /// sent again too early, not lost.
    #[serde(default)]
    pub spurious: u32,
}

/// What one ring link carried when it was the only thing being measured.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct LinkIn {
    /// The rank that sent.
    pub from: usize,
    pub gbs: f64,
}

/// Progress marks a rank leaves in the store, so a silent rank can be placed; each text reads
/// after "last seen: ".
pub(crate) const STAGES: [(&str, &str); 7] = [
    ("started", "connected to the store"),
    ("loaded", "libraries and GPU loaded"),
    ("id", "unique id in hand, entering communicator init"),
    (
        "links",
        "the TCP ring connected, measuring its links between nodes",
    ),
    ("init", "communicator init finished"),
    ("sweep", "in the all-reduce sweep"),
    ("done", "done"),
];

pub(crate) fn stage_text(stage: &str) -> &'static str {
    STAGES.iter().find(|(s, _)| *s == stage).map_or(
        "in a stage this nrun does not know (is nrun the same version on every host?)",
        |(_, t)| t,
    )
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

/// How the preflight ended, and the exit code that goes with it. Declared from best to worst:
/// the verdict of several findings is the greatest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Ok,
    Slow,
    Wrong,
    Timeout,
    InitFailed,
    /// Libraries, GPUs or the store not usable.
    Setup,
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

    pub fn name(self) -> &'static str {
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
    /// Why nrun ended the ranks before every one reported, where it did: a node lost (its
    /// agent's silence, with how long), or the preflight's own deadline passed. A silent rank
    /// is said with it: which deadline passed, not only where the rank was.
    pub stopped: Option<String>,
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
    /// What every check found, in the order the report prints it.
    pub findings: Vec<finding::Finding>,
    pub text: String,
    /// The report's JSON (`--report`), serialised from the same findings and measurements.
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
            stopped: None,
            nccl_lib: None,
            min_busbw: None,
            min_efficiency: None,
            path_vars: Vec::new(),
            waived: Vec::new(),
            wall_s: 0.0,
            other_libs: Vec::new(),
        }
    }
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
            host: None,
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
            link_out: None,
            sweep_cut: None,
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
            stopped: None,
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
        // A loaded host's CPU-bound link: a tenth of another's yet over a tenth of its NIC's
        // speed says nothing of the network, and names nobody.
        let busy = net_ring([0.3, 7.77, 2.32], [10_000; 3]).summarize();
        assert_eq!(busy.verdict, Verdict::Ok, "{}", busy.text);
        // A node whose NIC negotiated a tenth of the others' speed.
        let s = net_ring([1.0, 0.12, 0.9], [10_000, 1000, 10_000]).summarize();
        assert_eq!(s.verdict, Verdict::Slow, "{}", s.text);
        assert!(
            s.text.contains("network: h1 eth0 10 Gb/s; h2 eth0 1 Gb/s; h3 eth0 10 Gb/s")
                && s.text.contains("node h2's network (eth0 1 Gb/s, 0.12 GB/s) is 10% of the median node's (1.25 GB/s)"),
            "{}",
            s.text
        );
        // The CI's lossy link (5% of what reaches h2 dropped) on a loaded host: stalled in
        // timeouts, it sent few segments, too few for the loss rule of a link at full rate.
        let mut stalled = net_ring([3.37, 0.005, 0.0004], [10_000; 3]);
        for (r, segments, retransmitted) in [(0, 60, 8), (1, 30, 0), (2, 17_400, 0)] {
            stalled.reports.get_mut(&r).unwrap().link_out = Some(LinkOut {
                to: (r + 1) % 3,
                segments,
                retransmitted,
                spurious: 0,
            });
        }
        let s = stalled.summarize();
        assert!(
            s.text
                .contains("the link from h1 to h2 retransmitted 13.3% of its segments (8 of 60)")
                && !s.text.contains("from h2 to h3 retransmitted"),
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
        whole_outcomes(&mut v);
        error_outcomes(&mut v);
        link_outcomes(&mut v);
        health_outcomes(&mut v);
        net_outcomes(&mut v);
        v
    }

    /// Whole runs: results, busbw, slow and silent nodes, crashes.
    fn whole_outcomes(v: &mut Vec<(&'static str, Outcome)>) {
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
        // The same ranks when nrun ended them after losing a node: the silence says so.
        let mut lost = outcome(silent.reports.values().cloned().collect());
        lost.silent = silent.silent.clone();
        lost.world_size = 5;
        lost.stopped = Some(
            "nrun ended every rank: lost the connection to c: its agent sent no heartbeat for \
             2.6 s"
                .into(),
        );
        v.push(("silent", silent));
        v.push(("silent-lost", lost));
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
    }

    /// Ranks' errors, versions and empty runs.
    fn error_outcomes(v: &mut Vec<(&'static str, Outcome)>) {
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
    }

    /// One node's links.
    fn link_outcomes(v: &mut Vec<(&'static str, Outcome)>) {
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
    }

    /// One node's GPU health and memory bandwidth.
    fn health_outcomes(v: &mut Vec<(&'static str, Outcome)>) {
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
    }

    /// Several nodes: their links and NICs, and NCCL over sockets.
    fn net_outcomes(v: &mut Vec<(&'static str, Outcome)>) {
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
        // A lossy link at full rate (5% of its segments sent again, a few of them received
        // twice), a healthy one's few, and a healthy one on a loaded host that resent 2% too
        // early (its receiver got each twice).
        let mut lossy = net_ring([1.0, 1.1, 0.9], [10_000; 3]);
        for (r, retransmitted, spurious) in [(0, 815, 45), (1, 3, 0), (2, 360, 360)] {
            lossy.reports.get_mut(&r).unwrap().link_out = Some(LinkOut {
                to: (r + 1) % 3,
                segments: 18_000,
                retransmitted,
                spurious,
            });
        }
        v.push(("net-lossy", lossy));
        // The sweep cut short over a slow link.
        let mut cut = net_ring([0.002, 1.1, 0.9], [10_000; 3]);
        cut.reports.get_mut(&0).unwrap().sweep_cut = Some(
            "sizes from 2 MiB up not run: over the slowest link (into rank 0, 0.0020 GB/s) each \
             would take over 2 s"
                .into(),
        );
        v.push(("net-sweep-cut", cut));
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
                .contains("rank 4 on e went silent; last seen: unique id in hand"),
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
