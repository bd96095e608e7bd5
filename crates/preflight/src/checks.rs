//! The preflight's checks: each a small function from what the ranks reported (and the sweep
//! measured) to [`Finding`]s, in the order the report prints them. `summary.rs` runs them.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::finding::{Check, Finding};
use super::{Mode, Outcome, RankReport, Verdict, busbw, hardware, human_bytes, stage_text};

/// The job's line rate and how much of it the preflight got.
#[derive(Clone, Debug, Serialize)]
pub(super) struct LineRate {
    gbs: f64,
    what: String,
    busbw_gbs: f64,
    efficiency: f64,
    slow: bool,
    /// The message size the busbw is of.
    #[serde(skip)]
    bytes: u64,
    /// The efficiency it was judged against (None: not judged).
    #[serde(skip)]
    min: Option<f64>,
}

impl LineRate {
    fn under_min(&self) -> Option<f64> {
        self.min.filter(|m| self.efficiency < *m)
    }
}

/// The path NCCL took, summed over the ranks.
pub(super) fn nccl_path(reports: &[&RankReport]) -> Option<hardware::NcclPath> {
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

/// Each rank's GPU links (NVML), when every rank of one node has them: the links of the node's
/// line rate.
type GpuLinks<'a> = Vec<(&'a RankReport, &'a hardware::Links)>;

/// The GPUs with fewer NVLink links up than another of their model: GPUs of one model on one
/// node have the same links, so fewer up is a link down.
fn links_down<'a>(links: &GpuLinks<'a>) -> GpuLinks<'a> {
    let most = links.iter().map(|(_, l)| l.nvlink_up).max().unwrap_or(0);
    links
        .iter()
        .filter(|(r, l)| {
            l.nvlink_up < most
                && links
                    .iter()
                    .any(|(o, m)| m.nvlink_up == most && gpu_model(o) == gpu_model(r))
        })
        .copied()
        .collect()
}

/// The network interfaces each node's ranks use, and each node's rate from them.
pub(super) struct Nodes<'a> {
    nics: BTreeMap<&'a str, BTreeMap<&'a str, &'a hardware::Nic>>,
    /// A node's rate: the NICs its ranks use, together (GB/s), and what they are; only nodes
    /// whose NICs all say their speed.
    rates: BTreeMap<&'a str, (f64, String)>,
}

impl<'a> Nodes<'a> {
    pub(super) fn of(complete: &[&'a RankReport]) -> Nodes<'a> {
        let mut nics: BTreeMap<&str, BTreeMap<&str, &hardware::Nic>> = BTreeMap::new();
        for r in complete {
            let e = nics.entry(r.host.as_str()).or_default();
            for n in &r.nics {
                e.insert(n.name.as_str(), n);
            }
        }
        let rates = nics
            .iter()
            .filter(|(_, ns)| !ns.is_empty())
            .filter_map(|(h, ns)| {
                let sum = ns.values().map(|n| n.gbs()).sum::<Option<f64>>()?;
                let what: Vec<String> = ns.values().map(|n| n.describe()).collect();
                Some((*h, (sum, what.join(" + "))))
            })
            .collect();
        Nodes { nics, rates }
    }

    /// Only several nodes have a network between them to judge.
    fn several(&self) -> bool {
        self.nics.len() >= 2
    }

    /// The NIC a node's ranks use, where they use one only (a link's speed is judged by it).
    fn single_nic(&self, host: &str) -> Option<&'a hardware::Nic> {
        self.nics.get(host).and_then(|ns| {
            (ns.len() == 1)
                .then(|| ns.values().next().copied())
                .flatten()
        })
    }
}

/// Under this fraction of the median node's network rate, a node's NIC is named slow.
const PEER_FLOOR: f64 = 0.5;
/// Under this fraction of the median link, a measured link is named slow (where its NIC says
/// its speed, only if under [`TCP_FLOOR`] of it too): measurements vary with the hosts' CPU
/// load far more than the speeds NICs report do (on a loaded 2-core host, healthy veth links
/// of one ring measured 0.52 and 7.77 GB/s, best of two rounds).
const LINK_FLOOR: f64 = 0.15;
/// A TCP stream of the net preflight reaches well over a tenth of any NIC's speed up to
/// 100 Gb/s; a link under it is shaped, erroring or negotiated down.
const TCP_FLOOR: f64 = 0.1;

/// A link that lost more than this share of the segments it sent in the link test (sent them
/// again, and the receiver did not get them twice) loses packets, if it lost at least
/// [`LOSS_SEGMENTS`] or its rate is already slow: loss that stalls a link in retransmission
/// timeouts leaves it few segments to send in the test's time (the CI's lossy link, at 0.005
/// GB/s, stayed under [`LOSS_SEGMENTS`]; beside CPU hogs, a link dropping 5%: 38 of 134
/// segments sent again at 0.000 GB/s, 91 of 1573 at 0.007).
///
/// Resent is not lost: on a loaded namespace host, healthy links resent up to 2.8% (495 of
/// 17920; 428 of 17846 once failed tests/cluster.rs's net preflight), in bursts of 45 segments
/// (a 64 KB GSO packet) their receivers saw out of order, with no drop counted on the receiving
/// host (softnet_stat, TcpExt's and Ip's drops): the receivers got those segments twice and
/// said so (DSACK, TCP_INFO's tcpi_dsack_dups). Beside two CPU hogs on a 2-core host, 13 runs
/// of the matrix's 5%-lossy link resent 3.2% to 6.8% (577 of 18004 to 1261 of 18669; 198 of
/// 3235 stalled), 0 received twice in 11 of them (1 and 90 in the others); 826 healthy links
/// resent 13743 segments, 13083 of them received twice, leaving at most 56 (0.32%), or 90
/// (0.51%) on the lossy node's other link (its DSACKs come in through the drop). A share of
/// all resent overlaps (earlier, 45 lossy runs: 2.4% to 7.6%; 4 of these healthy links over
/// 2%); a rule relative to the ring's other links would blame them too (beside the one that
/// resent 360 of 17790, its ring's two other links resent nothing). Not counting those
/// received twice, lossy links lose 6x the share healthy ones do.
const LOSS_SHARE: f64 = 0.01;
const LOSS_SEGMENTS: u32 = 20;

/// Whether a link measured alone at `gbs` is far under its peers' `median`: under
/// [`LINK_FLOOR`] of it and, where its NIC says its speed (`nic_gbs`), under [`TCP_FLOOR`] of
/// that too (a CPU-bound link of a loaded host can measure a tenth of another's). The
/// preflight's ring and bisect's rounds judge by it.
pub fn far_under_peers(gbs: f64, median: f64, nic_gbs: Option<f64>) -> bool {
    gbs < LINK_FLOOR * median && nic_gbs.is_none_or(|s| gbs < TCP_FLOOR * s)
}

/// The net preflight's measured links that cross between nodes: (from host, to host, GB/s).
fn crossing_links<'a>(complete: &[&'a RankReport]) -> Vec<(&'a str, &'a str, f64)> {
    let by_rank: BTreeMap<usize, &RankReport> = complete.iter().map(|r| (r.rank, *r)).collect();
    complete
        .iter()
        .filter_map(|r| {
            let l = r.link_in?;
            let from = by_rank.get(&l.from)?;
            (from.host != r.host).then_some((from.host.as_str(), r.host.as_str(), l.gbs))
        })
        .collect()
}

/// A link found slow: the host it leaves, the host it reaches, and the finding that says so.
type SlowLink<'a> = (&'a str, &'a str, Finding);

/// The ring's links that carried far less than the median link or than the NIC they leave by
/// reports, each named by the node it leaves, whose egress is the likelier cause.
fn slow_rates<'a>(links: &[(&'a str, &'a str, f64)], nodes: &Nodes) -> Vec<SlowLink<'a>> {
    let median = median(links.iter().map(|l| l.2).collect());
    let slow_link =
        |from: &str, text: String| Finding::fail(Check::Link, Verdict::Slow, text).node(from);
    let mut out = Vec::new();
    for &(from, to, g) in links {
        let nic = nodes.single_nic(from);
        if links.len() >= 2 && far_under_peers(g, median, nic.and_then(|n| n.gbs())) {
            let text = format!(
                "the link from {from} to {to} carried {g:.3} GB/s, {:.0}% of the median link's \
                 {median:.2} GB/s",
                100.0 * g / median,
            );
            out.push((from, to, slow_link(from, text)));
        }
        if let Some((n, speed)) = nic.and_then(|n| n.gbs().map(|s| (n, s)))
            && g < TCP_FLOOR * speed
        {
            let text = format!(
                "the link from {from} to {to} carried {g:.3} GB/s, {:.0}% of the {} that \
                 {from}'s {} reports ({speed:.2} GB/s)",
                100.0 * g / speed,
                hardware::speed_text(n.mbps.unwrap_or(0)),
                n.name
            );
            out.push((from, to, slow_link(from, text)));
        }
    }
    out
}

/// Whether a link that sent `segments` in the link test, `lost` of them again (not counting
/// those the receiver got twice), lost packets; `slow`: its rate was already named slow.
fn loses_packets(segments: u32, lost: u32, slow: bool) -> bool {
    let share = f64::from(lost) / f64::from(segments.max(1));
    share > LOSS_SHARE && (lost >= LOSS_SEGMENTS || slow)
}

/// The ring's links that lost packets (their senders sent them again, and the receivers did
/// not get them twice): slow for NCCL whatever the rate a short test reached over them.
/// `slow`: the links (from host, to host) already named slow by their rate.
fn lossy_links<'a>(complete: &[&'a RankReport], slow: &[(&str, &str)]) -> Vec<SlowLink<'a>> {
    let by_rank: BTreeMap<usize, &RankReport> = complete.iter().map(|r| (r.rank, *r)).collect();
    let mut out = Vec::new();
    for r in complete {
        let Some(l) = r.link_out else { continue };
        let Some(to) = by_rank.get(&l.to).map(|t| t.host.as_str()) else {
            continue;
        };
        let lost = l.retransmitted.saturating_sub(l.spurious);
        let share = f64::from(lost) / f64::from(l.segments.max(1));
        tracing::debug!(
            "link test: {} -> {to} sent {} segments, {} of them again, {} of those received \
             twice",
            r.host,
            l.segments,
            l.retransmitted,
            l.spurious
        );
        let named = slow.contains(&(r.host.as_str(), to));
        if to != r.host && loses_packets(l.segments, lost, named) {
            let twice = match l.retransmitted - lost {
                0 => String::new(),
                n => format!(", not counting {n} the receiver got twice"),
            };
            let text = format!(
                "the link from {} to {to} retransmitted {:.1}% of its segments ({lost} of \
                 {}{twice}): packets are lost between them",
                r.host,
                100.0 * share,
                l.segments
            );
            out.push((
                r.host.as_str(),
                to,
                Finding::fail(Check::Link, Verdict::Slow, text),
            ));
        }
    }
    out
}

/// Where to look for the slow links' cause. A link's data leaves one host and its ACKs the
/// other: either end may be at fault. A host in every slow link (of several) is the one to look
/// at; otherwise each link's two ends are.
fn slow_ends(slow: &[(&str, &str)]) -> Vec<Finding> {
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
        (0, _) => Vec::new(),
        (n, [h]) if n > 1 => vec![
            Finding::fail(
                Check::Link,
                Verdict::Slow,
                format!(
                    "{h} is in every slow link: check its network first (traffic shaping, \
                     errors, a bad cable or port, its negotiated speed)"
                ),
            )
            .node(h),
        ],
        (_, _) => slow
            .iter()
            .map(|(a, b)| {
                Finding::fail(
                    Check::Link,
                    Verdict::Slow,
                    format!(
                        "{a} or {b}: check their network (traffic shaping, errors, a bad cable \
                         or port, the negotiated speed)"
                    ),
                )
            })
            .collect(),
    }
}

impl Outcome {
    /// The reports of the ranks that finished without an error.
    pub(super) fn complete(&self) -> Vec<&RankReport> {
        self.reports
            .values()
            .filter(|r| r.error.is_none())
            .collect()
    }

    /// The ring's links as ranks (from, to, GB/s, the sending rank's NIC speed where it has
    /// one and says it), every one measured, for a caller that places ranks by itself (bisect:
    /// by node, whatever the hostnames).
    pub fn rank_links(&self) -> Vec<(usize, usize, f64, Option<f64>)> {
        self.complete()
            .into_iter()
            .filter_map(|r| {
                let l = r.link_in?;
                let nic = self
                    .reports
                    .get(&l.from)
                    .and_then(|f| match f.nics.as_slice() {
                        [n] => n.gbs(),
                        _ => None,
                    });
                Some((l.from, r.rank, l.gbs, nic))
            })
            .collect()
    }

    /// Each NCCL the ranks loaded ("2.28.9 (/path)"), with the ranks that loaded it.
    pub(super) fn versions(&self) -> BTreeMap<String, Vec<usize>> {
        let mut versions: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for r in self.reports.values() {
            if let Some(v) = &r.nccl_version {
                versions
                    .entry(format!("{v} ({})", r.nccl_path.as_deref().unwrap_or("?")))
                    .or_default()
                    .push(r.rank);
            }
        }
        versions
    }

    /// The hosts that reported.
    pub(super) fn hosts(&self) -> BTreeSet<&str> {
        self.reports.values().map(|r| r.host.as_str()).collect()
    }

    /// Ranks that loaded different NCCLs.
    pub(super) fn nccl_versions(&self) -> Vec<Finding> {
        let versions = self.versions();
        if versions.len() < 2 {
            return Vec::new();
        }
        let list: Vec<String> = versions
            .iter()
            .map(|(v, ranks)| format!("{v} on ranks {}", ranks_text(ranks)))
            .collect();
        vec![
            Finding::warn(
                Check::Nccl,
                format!("NCCL differs between ranks: {}", list.join("; ")),
            )
            .hint(
                "load one NCCL everywhere: the same torch build on every node, or --nccl-lib PATH",
            ),
        ]
    }

    /// The errors ranks reported, by kind, with the verdict and the hint of each kind.
    pub(super) fn rank_errors(&self) -> Vec<Finding> {
        let mut by_kind: BTreeMap<&str, Vec<&RankReport>> = BTreeMap::new();
        for r in self.reports.values() {
            if let Some(e) = &r.error {
                by_kind.entry(e.kind.as_str()).or_default().push(r);
            }
        }
        let mut out = Vec::new();
        for (kind, rs) in &by_kind {
            // Ranks that only stopped because another failed are noise next to the cause.
            if *kind == "aborted" && by_kind.len() > 1 {
                continue;
            }
            let v = match *kind {
                "setup" | "store" => Verdict::Setup,
                "init" | "collective" => Verdict::InitFailed,
                "init-timeout" => Verdict::Timeout,
                _ => Verdict::InitFailed,
            };
            let mut found: Vec<Finding> = rs
                .iter()
                .take(8)
                .map(|r| {
                    let e = r.error.as_ref().map_or("", |e| e.message.as_str());
                    Finding::fail(
                        Check::RankError,
                        v,
                        format!("rank {} on {} (pid {}): {e}", r.rank, r.host, r.pid),
                    )
                    .node(&r.host)
                    .rank(r.rank)
                    .gpu(r.gpu.as_deref())
                })
                .collect();
            if rs.len() > 8 {
                found.push(Finding::fail(
                    Check::RankError,
                    v,
                    format!(
                        "... and {} more ranks with the same kind of failure",
                        rs.len() - 8
                    ),
                ));
            }
            let hint = match *kind {
                "init" => Some(
                    "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET to see NCCL's own \
                     reasons; check NCCL_SOCKET_IFNAME names an interface that exists and is up"
                        .to_string(),
                ),
                "init-timeout" => Some(format!(
                    "a rank stuck in init usually means a peer it cannot reach: check the firewall \
                     between the hosts ({}) and the interface NCCL uses; rerun with NCCL_DEBUG=INFO \
                     NCCL_DEBUG_SUBSYS=INIT,NET",
                    self.hosts().into_iter().collect::<Vec<_>>().join(", ")
                )),
                "setup" => Some(
                    "check that the NVIDIA driver works (nvidia-smi) and which libnccl is used \
                     (--nccl-lib PATH picks one)"
                        .to_string(),
                ),
                _ => None,
            };
            if let (Some(h), Some(first)) = (hint, found.first_mut()) {
                first.hints.push(h);
            }
            out.extend(found);
        }
        out
    }

    /// Ranks that never reported (each with the last stage it reached) and a rank that crashed.
    pub(super) fn silent_ranks(&self) -> Vec<Finding> {
        // A crash explains the silence of the others: nrun stopped them.
        let v = match self.crashed {
            Some(_) => Verdict::Setup,
            None => Verdict::Timeout,
        };
        let mut out: Vec<Finding> = self
            .silent
            .iter()
            .map(|(rank, host, stage)| {
                let last = stage
                    .as_deref()
                    .map_or("it had not reached the store".to_string(), |s| {
                        format!("last seen: {}", stage_text(s))
                    });
                let (check, text) = match (&self.crashed, stage) {
                    (Some((cr, how)), _) if cr == rank => (
                        Check::Crash,
                        format!("rank {rank} on {host} crashed ({how}); {last}"),
                    ),
                    (Some((cr, _)), _) => (
                        Check::Silent,
                        format!(
                            "rank {rank} on {host} was stopped by nrun after rank {cr} crashed; \
                             {last}"
                        ),
                    ),
                    (None, None) => (
                        Check::Silent,
                        format!("rank {rank} on {host} never reached the store"),
                    ),
                    (None, Some(_)) => (
                        Check::Silent,
                        match &self.stopped {
                            Some(why) => {
                                format!("rank {rank} on {host} went silent; {last}; {why}")
                            }
                            None => format!(
                                "rank {rank} on {host} went silent; {last}; its process ended \
                                 without a report and no deadline of nrun's passed (it lost the \
                                 store?)"
                            ),
                        },
                    ),
                };
                Finding::fail(check, v, text).node(host).rank(*rank)
            })
            .collect();
        match &self.crashed {
            Some((cr, how)) => {
                let hint = format!(
                    "rank {cr}'s own output above says why it crashed; rerun with NCCL_DEBUG=WARN \
                     for NCCL's view"
                );
                match out.iter_mut().find(|f| f.rank == Some(*cr)) {
                    Some(f) => f.hints.push(hint),
                    None => out.push(
                        Finding::fail(
                            Check::Crash,
                            Verdict::Setup,
                            format!("rank {cr} crashed ({how}) after reporting"),
                        )
                        .rank(*cr)
                        .hint(hint),
                    ),
                }
            }
            None => {
                if let Some(first) = out.first_mut() {
                    first.hints.push(
                        "a rank that never reached the store cannot connect to \
                         MASTER_ADDR:MASTER_PORT from its host: check the address and the \
                         firewall; one stuck in init: see above"
                            .into(),
                    );
                }
            }
        }
        out
    }

    /// Fewer ranks reported than ran, with nothing found so far to say why.
    pub(super) fn missing_reports(&self, complete: usize, so_far: &[Finding]) -> Vec<Finding> {
        if complete >= self.world_size || super::finding::verdict(so_far) != Verdict::Ok {
            return Vec::new();
        }
        vec![Finding::fail(
            Check::Reports,
            Verdict::Timeout,
            format!("only {complete} of {} ranks reported", self.world_size),
        )]
    }

    /// Each node's busbw at the largest size against the median node's.
    pub(super) fn node_speed(&self, complete: &[&RankReport]) -> Vec<Finding> {
        let Some(last) = complete[0].rows.len().checked_sub(1) else {
            return Vec::new();
        };
        let bytes = complete[0].rows[last].bytes;
        let mut node_us: BTreeMap<&str, f64> = BTreeMap::new();
        for r in complete {
            let e = node_us.entry(r.host.as_str()).or_insert(0.0);
            *e = e.max(r.rows.get(last).map_or(0.0, |x| x.oop_us));
        }
        if node_us.len() < 2 {
            return Vec::new();
        }
        let bws: Vec<f64> = node_us
            .values()
            .map(|us| busbw(bytes, *us, self.world_size).1)
            .collect();
        let median = median(bws);
        node_us
            .iter()
            .filter_map(|(h, us)| {
                let b = busbw(bytes, *us, self.world_size).1;
                (b < 0.8 * median).then(|| {
                    Finding::warn(
                        Check::NodeSpeed,
                        format!(
                            "node {h} is slow: busbw {b:.1} GB/s at {bytes} B, under 80% of the \
                             median node ({median:.1} GB/s)"
                        ),
                    )
                    .node(h)
                })
            })
            .collect()
    }

    /// The line rate of the links between one node's GPUs (NVML's view of every GPU), and how
    /// much of it the busbw at the largest size (`peak`) is. None: several nodes, one rank,
    /// links unknown.
    pub(super) fn gpu_line_rate(
        &self,
        complete: &[&RankReport],
        peak: Option<(u64, f64)>,
    ) -> Option<LineRate> {
        let (bytes, bw) = peak?;
        let links = self.gpu_links(complete)?;
        let (gbs, what) = links
            .iter()
            .map(|(_, l)| l.line_rate())
            .min_by(|a, b| a.0.total_cmp(&b.0))?;
        if gbs <= 0.0 {
            return None;
        }
        let efficiency = bw / gbs;
        // Small messages measure latency, not bandwidth: judge from 64 MiB up.
        let min = self.min_efficiency.filter(|_| bytes >= 64 << 20);
        let slow = min.is_some_and(|m| efficiency < m) || !links_down(&links).is_empty();
        Some(LineRate {
            gbs,
            what,
            busbw_gbs: bw,
            efficiency,
            slow,
            bytes,
            min,
        })
    }

    /// Every rank's GPU links, when the ranks are on one node and each has them.
    fn gpu_links<'a>(&self, complete: &[&'a RankReport]) -> Option<GpuLinks<'a>> {
        let hosts: BTreeSet<&str> = complete.iter().map(|r| r.host.as_str()).collect();
        let links: GpuLinks = complete
            .iter()
            .filter_map(|r| r.links.as_ref().map(|l| (*r, l)))
            .collect();
        (self.world_size >= 2 && hosts.len() == 1 && links.len() == complete.len()).then_some(links)
    }

    /// One node's GPU links against its line rate: a link down, the busbw under
    /// --min-efficiency of the line rate, and the causes nrun can see.
    pub(super) fn gpu_link_checks(
        &self,
        complete: &[&RankReport],
        rate: Option<&LineRate>,
    ) -> Vec<Finding> {
        let (Some(rate), Some(links)) = (rate, self.gpu_links(complete)) else {
            return Vec::new();
        };
        let most = links.iter().map(|(_, l)| l.nvlink_up).max().unwrap_or(0);
        let mut out: Vec<Finding> = links_down(&links)
            .iter()
            .map(|(r, l)| {
                Finding::fail(
                    Check::Nvlink,
                    Verdict::Slow,
                    format!(
                        "rank {}'s GPU on {} has {} NVLink links up, its peers {most}: a link is \
                         down (nvidia-smi nvlink --status); the ring runs at the slowest GPU's \
                         rate",
                        r.rank, r.host, l.nvlink_up
                    ),
                )
                .node(&r.host)
                .rank(r.rank)
                .gpu(r.gpu.as_deref())
            })
            .collect();
        let (bw, what) = (rate.busbw_gbs, &rate.what);
        out.push(Finding::info(
            Check::LineRate,
            format!(
                "line rate: {what}; busbw {bw:.1} GB/s at {} is {:.0}% of it",
                human_bytes(rate.bytes),
                rate.efficiency * 100.0
            ),
        ));
        let Some(min) = rate.under_min() else {
            return out;
        };
        let mut slow = Finding::fail(
            Check::LineRate,
            Verdict::Slow,
            format!(
                "busbw {bw:.1} GB/s at {} is {:.0}% of the line rate ({what}), under \
                 --min-efficiency {min}",
                human_bytes(rate.bytes),
                rate.efficiency * 100.0
            ),
        );
        if !self.path_vars.is_empty() {
            slow = slow.hint(format!(
                "set here and changing NCCL's path: {}; unset them unless they are meant",
                self.path_vars.join(", ")
            ));
        }
        let path = nccl_path(complete);
        let nvlink = most;
        let through = path
            .as_ref()
            .filter(|p| nvlink > 0 && !p.all_p2p())
            .map(|p| {
                Finding::warn(
                    Check::NcclPath,
                    format!(
                        "NVLink is up ({nvlink} links) but NCCL connected through {}: peer to \
                         peer is off or unavailable (NCCL_P2P_DISABLE/NCCL_P2P_LEVEL, or a \
                         container without P2P)",
                        p.describe()
                    ),
                )
            });
        if let Some(p) = path.as_ref().filter(|p| p.channels > 0 && p.channels < 4) {
            slow = slow.hint(format!(
                "NCCL used only {} channel(s) (NCCL_MAX_NCHANNELS/NCCL_MIN_NCHANNELS?)",
                p.channels
            ));
        }
        for (r, l) in links.iter().filter(|(_, l)| l.pcie_degraded()) {
            slow = slow.hint(format!(
                "rank {}'s GPU runs PCIe Gen{} x{}, below its Gen{} x{}: reseat it or check \
                 the slot",
                r.rank, l.pcie_gen, l.pcie_width, l.pcie_max_gen, l.pcie_max_width
            ));
        }
        out.push(slow);
        out.extend(through);
        out
    }

    /// Several nodes: a NIC that is down, the NICs each node's ranks use, and a node whose
    /// network is far under the others'.
    pub(super) fn network(&self, nodes: &Nodes) -> Vec<Finding> {
        if !nodes.several() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (h, ns) in &nodes.nics {
            for n in ns.values().filter(|n| !n.up) {
                out.push(
                    Finding::fail(
                        Check::Network,
                        Verdict::Slow,
                        format!("node {h}: {} is down", n.name),
                    )
                    .node(h),
                );
            }
        }
        let rates = &nodes.rates;
        let same = rates.len() == nodes.nics.len()
            && rates
                .values()
                .all(|(_, w)| Some(w) == rates.values().next().map(|(_, w)| w));
        let line = match same {
            true => {
                let w = rates.values().next().map_or("", |(_, w)| w.as_str());
                format!("network: {w} on each of {} nodes", nodes.nics.len())
            }
            false => {
                let described: Vec<String> = nodes
                    .nics
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
                format!("network: {}", described.join("; "))
            }
        };
        out.push(Finding::info(Check::Network, line));
        if rates.len() >= 2 {
            let all: Vec<f64> = rates.values().map(|(g, _)| *g).collect();
            let median = median(all);
            for (h, (g, what)) in rates {
                if *g < PEER_FLOOR * median {
                    out.push(
                        Finding::fail(
                            Check::Network,
                            Verdict::Slow,
                            format!(
                                "node {h}'s network ({what}, {g:.2} GB/s) is {:.0}% of the \
                                 median node's ({median:.2} GB/s): the ring runs at its slowest \
                                 node's rate; check the cable, the switch port and the \
                                 negotiated speed (ethtool)",
                                100.0 * g / median
                            ),
                        )
                        .node(h),
                    );
                }
            }
        }
        out
    }

    /// Several nodes: the line rate of the slowest node's NICs, and how much of it the busbw at
    /// the largest size is. None: a node's NIC speed unknown.
    pub(super) fn network_line_rate(
        &self,
        nodes: &Nodes,
        peak: Option<(u64, f64)>,
    ) -> Option<LineRate> {
        if !nodes.several() || nodes.rates.len() != nodes.nics.len() {
            return None;
        }
        let (bytes, bw) = peak?;
        let (h, (gbs, what)) = nodes.rates.iter().min_by(|a, b| a.1.0.total_cmp(&b.1.0))?;
        let efficiency = bw / gbs;
        // The TCP ring is bounded by the CPU, not the NIC, on fast networks: judged by its links
        // instead. NCCL's busbw is judged against the line rate as on one node.
        let min = self
            .min_efficiency
            .filter(|_| self.mode == Mode::Nccl && bytes >= 64 << 20);
        Some(LineRate {
            gbs: *gbs,
            what: format!("network, slowest node {h} {what} = {gbs:.2} GB/s"),
            busbw_gbs: bw,
            efficiency,
            slow: min.is_some_and(|m| efficiency < m),
            bytes,
            min,
        })
    }

    /// The busbw against the network's line rate, with the causes nrun can see when it is low.
    pub(super) fn network_rate_checks(
        &self,
        complete: &[&RankReport],
        rate: Option<&LineRate>,
    ) -> Vec<Finding> {
        let Some(rate) = rate else {
            return Vec::new();
        };
        let (bw, what) = (rate.busbw_gbs, &rate.what);
        let mut out = vec![Finding::info(
            Check::LineRate,
            format!(
                "line rate: {what}; busbw {bw:.2} GB/s at {} is {:.0}% of it",
                human_bytes(rate.bytes),
                rate.efficiency * 100.0
            ),
        )];
        let Some(m) = rate.under_min() else {
            return out;
        };
        let mut slow = Finding::fail(
            Check::LineRate,
            Verdict::Slow,
            format!(
                "busbw {bw:.2} GB/s at {} is {:.0}% of the network's line rate ({what}), under \
                 --min-efficiency {m}",
                human_bytes(rate.bytes),
                rate.efficiency * 100.0
            ),
        );
        if let Some(p) = nccl_path(complete).filter(|p| p.transports.contains_key("NET/Socket")) {
            slow = slow.hint(format!(
                "NCCL went through sockets ({}): if the nodes have InfiniBand or RoCE, check \
                 NCCL_IB_DISABLE/NCCL_NET and that the IB devices are visible (ibv_devinfo)",
                p.describe()
            ));
        }
        if !self.path_vars.is_empty() {
            slow = slow.hint(format!(
                "set here and changing NCCL's path: {}; unset them unless they are meant",
                self.path_vars.join(", ")
            ));
        }
        out.push(slow);
        out
    }

    /// The net preflight's ring links between nodes, each measured alone: one far under the
    /// others or under its NIC's speed is named with the node it leaves, one that lost packets
    /// is named, and then where to look ([`slow_ends`]).
    pub(super) fn ring_links(&self, complete: &[&RankReport], nodes: &Nodes) -> Vec<Finding> {
        if self.mode != Mode::Net || !nodes.several() {
            return Vec::new();
        }
        let links = crossing_links(complete);
        if links.is_empty() {
            return Vec::new();
        }
        let parts: Vec<String> = links
            .iter()
            .map(|(a, b, g)| format!("{a} -> {b} {g:.2}"))
            .collect();
        let mut out = vec![Finding::info(
            Check::Link,
            format!(
                "links between nodes (GB/s, each alone): {}",
                parts.join(", ")
            ),
        )];
        if let Some(cut) = complete.iter().find_map(|r| r.sweep_cut.as_ref()) {
            out.push(Finding::info(Check::Link, format!("the sweep's {cut}")));
        }
        let mut found = slow_rates(&links, nodes);
        let by_rate: Vec<(&str, &str)> = found.iter().map(|(a, b, _)| (*a, *b)).collect();
        found.extend(lossy_links(complete, &by_rate));
        let mut slow: Vec<(&str, &str)> = found.iter().map(|(a, b, _)| (*a, *b)).collect();
        out.extend(found.into_iter().map(|(_, _, f)| f));
        slow.dedup();
        out.extend(slow_ends(&slow));
        out
    }

    /// Each GPU's health: one line when all are well; otherwise each check that fails, a
    /// problem unless waived.
    pub(super) fn health(&self, complete: &[&RankReport]) -> Vec<Finding> {
        let seen: Vec<(&RankReport, &hardware::Health)> = complete
            .iter()
            .filter_map(|r| r.health.as_ref().map(|h| (*r, h)))
            .collect();
        let Some(first) = seen.first() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (r, h) in &seen {
            for u in h.problems() {
                let gpu = r.gpu.as_deref().unwrap_or("its GPU");
                let check = Check::Health(Some(u.check));
                let f = if self.waived.contains(&u.check) {
                    Finding::info(
                        check,
                        format!(
                            "GPU health: rank {} on {} ({gpu}): {} (waived: {})",
                            r.rank, r.host, u.what, u.check
                        ),
                    )
                } else {
                    let v = if u.slows {
                        Verdict::Slow
                    } else {
                        Verdict::Setup
                    };
                    Finding::fail(
                        check,
                        v,
                        format!(
                            "rank {} on {} ({gpu}): {} (--waive {} to run anyway)",
                            r.rank, r.host, u.what, u.check
                        ),
                    )
                };
                out.push(f.node(&r.host).rank(r.rank).gpu(r.gpu.as_deref()));
            }
        }
        if out.is_empty() {
            out.push(Finding::info(
                Check::Health(None),
                format!(
                    "GPU health: {} GPU(s) ok ({})",
                    seen.len(),
                    first.1.describe()
                ),
            ));
        }
        out
    }

    /// Each GPU's memory bandwidth against the job's other GPUs and the model's figure.
    pub(super) fn memory(&self, complete: &[&RankReport]) -> Vec<Finding> {
        let seen: Vec<(&RankReport, f64)> = complete
            .iter()
            .filter_map(|r| r.mem_gbs.map(|g| (*r, g)))
            .collect();
        if seen.is_empty() {
            return Vec::new();
        }
        let mut all: Vec<f64> = seen.iter().map(|(_, g)| *g).collect();
        // Sorted: the range is shown beside the median.
        all.sort_by(f64::total_cmp);
        let median = all[all.len() / 2];
        let model = seen
            .first()
            .and_then(|(r, _)| r.gpu.as_deref())
            .and_then(hardware::memory_gbs);
        let mut out = vec![Finding::info(
            Check::Memory,
            format!(
                "GPU memory: copies at {:.0}-{:.0} GB/s{}",
                all[0],
                all[all.len() - 1],
                model.map_or(String::new(), |(m, name)| format!(
                    " ({:.0}% of the {name}'s {m:.0} GB/s)",
                    100.0 * median / m
                ))
            ),
        )];
        for (r, g) in &seen {
            let gpu = r.gpu.as_deref().unwrap_or("its GPU");
            let text = if seen.len() > 1 && *g < 0.8 * median {
                format!(
                    "rank {} on {} ({gpu}): its memory copies at {g:.0} GB/s, under 80% of the \
                     job's median GPU ({median:.0} GB/s): a degraded GPU",
                    r.rank, r.host
                )
            } else if let Some((m, name)) = model.filter(|(m, _)| *g < hardware::MEMORY_FLOOR * m) {
                format!(
                    "rank {} on {} ({gpu}): its memory copies at {g:.0} GB/s, under {:.0}% of \
                     the {name}'s {m:.0} GB/s",
                    r.rank,
                    r.host,
                    100.0 * hardware::MEMORY_FLOOR
                )
            } else {
                continue;
            };
            out.push(
                Finding::fail(Check::Memory, Verdict::Slow, text)
                    .node(&r.host)
                    .rank(r.rank)
                    .gpu(r.gpu.as_deref()),
            );
        }
        out
    }

    /// The busbw at the largest size under --min-busbw.
    pub(super) fn min_busbw(&self, peak: Option<(u64, f64)>) -> Vec<Finding> {
        let (Some(min), Some((bytes, bw))) = (self.min_busbw, peak) else {
            return Vec::new();
        };
        if bw >= min {
            return Vec::new();
        }
        vec![
            Finding::fail(
                Check::MinBusbw,
                Verdict::Slow,
                format!("busbw {bw:.2} GB/s at {bytes} B is under --min-busbw {min} GB/s"),
            )
            .hint(
                "check that the GPUs use NVLink/InfiniBand (NCCL_DEBUG=INFO shows the transport) \
                 and that no other job shares them",
            ),
        ]
    }
}

/// The upper median of `v` (not empty): the middle value, the higher of two.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::loses_packets;

    #[test]
    fn a_link_loses_packets_on_many_lost_segments_or_on_a_few_when_it_is_slow() {
        // Lossy links (5% dropped) beside CPU hogs, none of their resent segments received
        // twice: at full rate, and stalled in timeouts.
        assert!(loses_packets(18_004, 577, false));
        assert!(loses_packets(18_669, 1261, false));
        assert!(loses_packets(134, 38, true));
        assert!(loses_packets(1573, 91, true));
        assert!(loses_packets(13_053, 492, true));
        // The least a 5% lossy link resent in earlier matrix runs, before those received
        // twice were counted (the lossy links since: none of theirs).
        assert!(loses_packets(17_857, 427, false));
        // Healthy links under load: what is left of their resent segments (135, 158, 180, 495)
        // once those received twice (90, 102, 158, 495) are taken out; and the lossy node's
        // other link (180 resent, 90 received twice: its DSACKs come in through the drop).
        assert!(!loses_packets(17_554, 45, false));
        assert!(!loses_packets(17_588, 56, false));
        assert!(!loses_packets(17_587, 22, false));
        assert!(!loses_packets(17_920, 0, false));
        assert!(!loses_packets(17_595, 90, false));
        // A lossy link stalled in timeouts, and one with some of its resent received twice.
        assert!(loses_packets(3235, 198, true));
        assert!(loses_packets(18_557, 1035, false));
        // Too few to tell at a rate that is not slow.
        assert!(!loses_packets(60, 8, false));
        assert!(loses_packets(60, 8, true));
        // A shaped link's stray one, and nothing sent.
        assert!(!loses_packets(2265, 1, true));
        assert!(!loses_packets(0, 0, true));
        // A link stalled after its first segments: one sent again is loss.
        assert!(loses_packets(40, 1, true));
        assert!(!loses_packets(40, 1, false));
    }
}
