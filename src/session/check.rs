//! Checking the joined nodes before anything runs: each node's interface and the addresses it
//! is reached on, NAT between it and the launch host, the user's NCCL_SOCKET_IFNAME, MTUs, the
//! facts across nodes, and a ring of node-to-node connections. Problems refuse the launch with
//! the node named; warnings are printed and the run goes on.

use std::net::{IpAddr, SocketAddr};

use super::{Policy, Session};
use crate::protocol::{Step, StepResult};
use nrun_base::error::{Error, Result, exit};
use nrun_base::net;

/// What the checks found: problems keep a node out of the job (`Some(node)`: pinned on it) or
/// refuse the launch (`None`); warnings do not.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    pub problems: Vec<(Option<usize>, String)>,
    pub warnings: Vec<String>,
}

impl Session {
    /// Decides each joined remote node's interface, the address its workers reach the store
    /// on, and the address other nodes reach it on.
    pub(crate) fn assign_interfaces(&mut self) -> Findings {
        let mut f = Findings::default();
        let want = self.plan.ifname.clone();
        let seen_by_store: Vec<Option<String>> = (0..self.nodes.len())
            .map(|i| {
                self.store()
                    .and_then(|s| s.get(&self.keys().observe(i)))
                    .map(|v| String::from_utf8_lossy(&v).into_owned())
            })
            .collect();
        for (i, n) in self.nodes.iter_mut().enumerate() {
            // Nodes that did not join (bisect goes on without them) have nothing to decide.
            let Some(j) = n.joined.as_mut() else { continue };
            let (Some(link), Some(facts)) = (&j.link, &j.facts) else {
                continue;
            };
            let (Ok(local), Ok(reached)) = (
                link.local_addr.parse::<SocketAddr>(),
                link.reached.parse::<SocketAddr>(),
            ) else {
                f.problems.push((
                    Some(i),
                    format!("{}: its agent reported unreadable addresses", n.label),
                ));
                continue;
            };
            let ifaces = &facts.ifaces;
            j.master_addr = net::canonical(reached.ip()).to_string();
            j.addr = Some(net::canonical(local.ip()));
            match (&want, net::owner(ifaces, local.ip())) {
                (Some(want), _) => {
                    if !ifaces.iter().any(|x| &x.name == want && x.up) {
                        f.problems.push((
                            Some(i),
                            format!("--ifname {want}: no such interface up on {}", n.label),
                        ));
                    }
                    j.ifname = Some(want.clone());
                }
                (None, Some(x)) => j.ifname = Some(x.name.clone()),
                (None, None) => f.problems.push((
                    Some(i),
                    format!(
                        "{}: reached the launch host from {}, which no interface of the node holds",
                        n.label,
                        local.ip()
                    ),
                )),
            }
            if let Some(seen) = &seen_by_store[i] {
                let mine = net::canonical(local.ip()).to_string();
                if *seen != mine {
                    f.warnings.push(format!(
                        "{}: the launch host sees it connect from {seen} but it sent from {mine}: NAT or an asymmetric route between them; NCCL between nodes may not get through",
                        n.label
                    ));
                }
            }
        }
        // The launch host's own node reached the store over whichever of its addresses
        // answered first (loopback); for the others it is the address they reached, on the
        // interface holding it.
        let remote_reached = self
            .nodes
            .iter()
            .filter(|n| !n.is_local())
            .find_map(|n| n.joined.as_ref())
            .and_then(|j| j.master_addr.parse::<IpAddr>().ok());
        if let Some(ip) = remote_reached {
            for n in self.nodes.iter_mut().filter(|n| n.is_local()) {
                let Some(j) = n.joined.as_mut() else { continue };
                let Some(facts) = &j.facts else { continue };
                if let Some(x) = net::owner(&facts.ifaces, ip) {
                    if want.is_none() {
                        j.ifname = Some(x.name.clone());
                    }
                    j.addr = Some(ip);
                    j.master_addr = ip.to_string();
                }
            }
        }
        f
    }

    /// Everything else a job needs before it starts: the user's interface variable matches on
    /// every node, MTUs agree, NCCL and torch agree (unless --allow-mismatch). Prints the
    /// facts table and the warnings; returns the problems pinned on one node each (the caller
    /// leaves those nodes out). `Err`: a problem no single node can be blamed for (printed;
    /// only the exit code).
    pub(crate) fn readiness(&self, mut f: Findings) -> Result<Vec<(usize, String)>> {
        let user_ifname = self
            .plan
            .env
            .iter()
            .find(|(k, _)| k == "NCCL_SOCKET_IFNAME")
            .map(|(_, v)| v.clone());
        if let Some(v) = &user_ifname {
            for (i, n, j) in self.joined() {
                let ifs = j.facts.as_ref().map_or(&[][..], |x| &x.ifaces[..]);
                if !ifname_matches_any(v, ifs) {
                    f.problems.push((
                        Some(i),
                        format!(
                            "NCCL_SOCKET_IFNAME={v} matches no interface that is up on {} (it has: {})",
                            n.label,
                            ifs.iter()
                                .filter(|x| x.up)
                                .map(|x| x.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ));
                }
            }
        }
        let mtus: Vec<(String, u32)> = self
            .joined()
            .filter_map(|(_, n, j)| {
                let facts = j.facts.as_ref()?;
                let name = j.ifname.as_ref()?;
                let mtu = facts.ifaces.iter().find(|x| &x.name == name)?.mtu?;
                Some((n.label.clone(), mtu))
            })
            .collect();
        if let Some(w) = mtu_warning(&mtus) {
            f.warnings.push(w);
        }
        if let Some(w) = crate::plan::env::port_range_warning(&self.plan.env) {
            f.warnings.push(w.to_string());
        }
        let joined: Vec<(usize, String, &crate::facts::Facts)> = self
            .joined()
            .filter_map(|(i, n, j)| j.facts.as_ref().map(|x| (i, n.label.clone(), x)))
            .collect();
        let facts: Vec<(String, &crate::facts::Facts)> =
            joined.iter().map(|(_, l, x)| (l.clone(), *x)).collect();
        let cmp = crate::facts::compare(&facts);
        eprint!("{}", cmp.table);
        f.warnings.extend(cmp.differences.iter().cloned());
        for n in &cmp.notes {
            tracing::info!("{n}");
        }
        if cmp.refuse && !self.plan.allow_mismatch {
            match cmp.odd.is_empty() {
                true => f.problems.push((None, "NCCL major.minor or torch differ between nodes (see above): a job would fail or hang in init; make them equal, or pass --allow-mismatch".into())),
                false => {
                    for &k in &cmp.odd {
                        let (i, label, x) = &joined[k];
                        f.problems.push((
                            Some(*i),
                            format!(
                                "{label}: {} where most nodes have {} (see above): a job would fail or hang in init; --allow-mismatch runs anyway",
                                crate::facts::compat_key(x),
                                joined
                                    .iter()
                                    .enumerate()
                                    .find(|(o, _)| !cmp.odd.contains(o))
                                    .map_or(String::new(), |(_, (_, _, y))| crate::facts::compat_key(y))
                            ),
                        ));
                    }
                }
            }
        }
        for w in &f.warnings {
            tracing::warn!("{w}");
        }
        let (mut pinned, mut unpinned): (Vec<_>, Vec<_>) =
            f.problems.into_iter().partition(|(n, _)| n.is_some());
        // Most nodes failing the same way is the setting's fault, not theirs.
        let blamed: std::collections::BTreeSet<_> = pinned.iter().map(|(n, _)| *n).collect();
        if blamed.len() * 2 > self.joined().count() {
            unpinned.append(&mut pinned);
        }
        if unpinned.is_empty() {
            return Ok(pinned
                .into_iter()
                .map(|(n, p)| (n.unwrap_or(0), p))
                .collect());
        }
        eprintln!("nrun: error: the nodes are not ready:");
        for (_, p) in unpinned.iter().chain(&pinned) {
            eprintln!("  {p}");
        }
        Err(Error::exit(exit::CLUSTER))
    }

    /// Every node connects to the next one (a ring) on the addresses NCCL will use, so a
    /// firewall between two nodes is named before NCCL hangs on it. The job's nodes and the
    /// spares are probed together. Returns the nodes a failure is pinned on (the caller leaves
    /// them out); `Err`: failed links no single node can be blamed for (printed; exit 95).
    pub(crate) async fn probe_ring(&mut self) -> Result<Vec<(usize, String)>> {
        let ring: Vec<usize> = (0..self.nodes.len())
            .filter(|i| self.nodes[*i].joined.is_some() && !self.is_left_out(*i))
            .collect();
        let k = ring.len();
        let pairs = ring_pairs(&ring, |a, b| self.same_machine(a, b));
        if pairs.is_empty() {
            return Ok(Vec::new());
        }
        let failed = self.probe_pairs(&pairs, 5000).await?;
        if failed.is_empty() {
            return Ok(Vec::new());
        }
        // A node on both of its ring links' failures is the one cut off. A single failed link
        // a -> b is asked again through a third node c (c -> b, a -> c): whichever of a and b
        // also fails with c is the bad one.
        let mut pinned: Vec<(usize, String)> = Vec::new();
        let count = |n: usize| failed.iter().filter(|(a, b, _)| *a == n || *b == n).count();
        for &n in &ring {
            if count(n) >= 2 && count(n) < failed.len() + usize::from(k == 2) * 2 {
                let (a, b, e) = failed.iter().find(|(a, b, _)| *a == n || *b == n).unwrap();
                pinned.push((n, self.unreachable(*a, *b, e)));
            }
        }
        let single: Vec<&(usize, usize, String)> = failed
            .iter()
            .filter(|(a, b, _)| count(*a) == 1 && count(*b) == 1)
            .collect();
        let mut unresolved: Vec<String> = Vec::new();
        let third = ring.iter().copied().find(|n| count(*n) == 0);
        if let (Some(c), false) = (third, single.is_empty()) {
            // One more round with the first ambiguous link (one probe per node and step).
            let (a, b, e) = single[0].clone();
            let again = self.probe_pairs(&[(c, b), (a, c)], 3000).await?;
            let b_bad = again.iter().any(|(x, y, _)| *x == c && *y == b);
            let a_bad = again.iter().any(|(x, y, _)| *x == a && *y == c);
            match (a_bad, b_bad) {
                (false, true) => pinned.push((
                    b,
                    format!(
                        "{x} cannot be reached from {} nor {}: {e}; check the firewall on {x} \
                         (nrun probed the address it uses for NCCL, interface {})",
                        self.nodes[a].label,
                        self.nodes[c].label,
                        self.ifname(b),
                        x = self.nodes[b].label,
                    ),
                )),
                (true, false) => pinned.push((
                    a,
                    format!(
                        "{x} cannot reach {} nor {}: {e}; check the firewall on {x} (its \
                         outgoing connections)",
                        self.nodes[b].label,
                        self.nodes[c].label,
                        x = self.nodes[a].label,
                    ),
                )),
                _ => unresolved.push(self.unreachable(a, b, &e)),
            }
            for (a, b, e) in single.iter().skip(1) {
                unresolved.push(self.unreachable(*a, *b, e));
            }
        } else {
            for (a, b, e) in &single {
                unresolved.push(self.unreachable(*a, *b, e));
            }
        }
        if k == 2 && pinned.is_empty() && unresolved.is_empty() {
            unresolved.extend(failed.iter().map(|(a, b, e)| self.unreachable(*a, *b, e)));
        }
        if unresolved.is_empty() {
            return Ok(pinned);
        }
        eprintln!("nrun: error: nodes cannot reach each other:");
        for b in unresolved.iter().chain(pinned.iter().map(|(_, w)| w)) {
            eprintln!("  {b}");
        }
        Err(Error::exit(exit::CLUSTER))
    }

    /// The interface node `i`'s workers use ("?" before it is known).
    fn ifname(&self, i: usize) -> &str {
        self.nodes[i]
            .joined
            .as_ref()
            .and_then(|j| j.ifname.as_deref())
            .unwrap_or("?")
    }

    /// "a cannot reach b: ...; check the firewall ..." for a failed probe.
    fn unreachable(&self, a: usize, b: usize, e: &str) -> String {
        let (me, next) = (&self.nodes[a], &self.nodes[b]);
        let ifname = self.ifname(b);
        format!(
            "{a} cannot reach {b}: {e}; check the firewall between {a} and {b} (nrun probed the address {b} uses for NCCL, interface {ifname})",
            a = me.label,
            b = next.label
        )
    }

    /// Each `(a, b)`: a connects to b's probe address within `timeout_ms` (the second round is
    /// shorter: a link that answered anything answers in milliseconds). Returns the failed ones
    /// with the error.
    async fn probe_pairs(
        &mut self,
        pairs: &[(usize, usize)],
        timeout_ms: u64,
    ) -> Result<Vec<(usize, usize, String)>> {
        let mut steps = vec![None; self.nodes.len()];
        let mut target_of = vec![None; self.nodes.len()];
        for &(a, b) in pairs {
            let target = self.nodes[b].joined.as_ref().and_then(|j| {
                let published: SocketAddr = j.link.as_ref()?.probe_addr.parse().ok()?;
                Some(SocketAddr::new(
                    j.addr.unwrap_or(published.ip()),
                    published.port(),
                ))
            });
            target_of[a] = Some(b);
            steps[a] = Some(match target {
                Some(t) => Step::Probe {
                    target: t.to_string(),
                    timeout_ms,
                },
                None => Step::Probe {
                    target: String::new(),
                    timeout_ms: 0,
                },
            });
        }
        let results = self.run_step(steps, Policy::Probe).await?.results;
        Ok(results
            .into_iter()
            .enumerate()
            .filter_map(|(a, r)| match (r, target_of[a]) {
                (Some(StepResult::Probe { error: Some(e) }), Some(b)) => Some((a, b, e)),
                _ => None,
            })
            .collect())
    }

    /// Nodes whose GPUs are unhealthy (NVML's health checks), or that have fewer GPUs than
    /// workers where the other nodes have enough, each with the evidence.
    pub(crate) fn gpu_trouble(&self) -> Vec<(usize, String)> {
        let any_gpus = self
            .joined()
            .any(|(_, _, j)| j.facts.as_ref().is_some_and(|f| !f.gpus.is_empty()));
        let mut out = Vec::new();
        for (i, n, j) in self.joined() {
            let Some(f) = &j.facts else { continue };
            if self.is_left_out(i) {
                continue;
            }
            let sick: Vec<String> = f
                .gpu_health
                .iter()
                .flat_map(|(gpu, h)| {
                    h.problems()
                        .into_iter()
                        .map(move |p| format!("GPU {gpu}: {}", p.what))
                })
                .collect();
            let workers = self.plan.layout[i].ranks.len();
            if !sick.is_empty() {
                out.push((
                    i,
                    format!("{}: unhealthy GPU ({})", n.label, sick.join("; ")),
                ));
            } else if any_gpus && f.gpus.len() < workers && self.plan.layout[i].devices.is_none() {
                out.push((
                    i,
                    format!(
                        "{}: has {} GPU(s) for its {workers} workers (the other nodes have theirs)",
                        n.label,
                        f.gpus.len()
                    ),
                ));
            }
        }
        out
    }
}

/// The ring's links `(a, b)` (a connects to b) that can be blocked: those between two nodes of
/// one machine (`same`: the launch host's, or one the kernels say is one) share one network
/// stack and are left out, so a job of this machine's nodes alone probes nothing (its agents
/// open no probe listener: the same locality, decided in `link::child::start`, sets their
/// `Hello::probed`).
fn ring_pairs(ring: &[usize], same: impl Fn(usize, usize) -> bool) -> Vec<(usize, usize)> {
    let k = ring.len();
    if k < 2 {
        return Vec::new();
    }
    (0..k)
        .map(|p| (ring[p], ring[(p + 1) % k]))
        .filter(|&(a, b)| !same(a, b))
        .collect()
}

/// The chosen interfaces' MTUs (node, MTU) where they differ: the nodes off the most common
/// MTU named with theirs.
fn mtu_warning(mtus: &[(String, u32)]) -> Option<String> {
    let mut count: std::collections::BTreeMap<u32, usize> = std::collections::BTreeMap::new();
    for (_, m) in mtus {
        *count.entry(*m).or_default() += 1;
    }
    if count.len() < 2 {
        return None;
    }
    let (&common, _) = count.iter().max_by_key(|(m, c)| (**c, **m))?;
    let odd: Vec<String> = mtus
        .iter()
        .filter(|(_, m)| *m != common)
        .map(|(n, m)| format!("{n}: {m}"))
        .collect();
    Some(format!(
        "the chosen interfaces' MTUs differ between nodes ({}; the others: {common}): large \
         messages may be dropped or fragmented; set one MTU on every node's interface",
        nrun_base::few(&odd, 4)
    ))
}

/// NCCL_SOCKET_IFNAME semantics: comma list of prefixes; `=` exact names; `^` excludes.
fn ifname_matches_any(spec: &str, ifs: &[net::Iface]) -> bool {
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, list) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let pats: Vec<&str> = list.split(',').filter(|p| !p.is_empty()).collect();
    ifs.iter().filter(|f| f.up && !f.loopback).any(|f| {
        let hit = pats.iter().any(|p| {
            if exact {
                f.name == *p
            } else {
                f.name.starts_with(p)
            }
        });
        hit != exclude
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_mtu_off_the_others_names_its_node() {
        let m = |v: &[(&str, u32)]| {
            v.iter()
                .map(|(n, m)| (n.to_string(), *m))
                .collect::<Vec<_>>()
        };
        assert_eq!(mtu_warning(&m(&[("a", 1500), ("b", 1500)])), None);
        let w = mtu_warning(&m(&[("a", 1500), ("b", 1400), ("c", 1500)])).unwrap();
        assert!(w.contains("(b: 1400; the others: 1500)"), "{w}");
    }

    fn iface(name: &str) -> net::Iface {
        net::Iface {
            name: name.into(),
            up: true,
            loopback: false,
            mtu: None,
            addrs: Vec::new(),
        }
    }

    #[test]
    fn links_within_one_machine_are_not_probed() {
        let all = |_, _| false;
        assert_eq!(ring_pairs(&[0, 1, 2], all), [(0, 1), (1, 2), (2, 0)]);
        assert_eq!(ring_pairs(&[4], all), []);
        // Two nodes of one machine (0, 1) and one elsewhere (2): 0 -> 1 is one machine's own.
        assert_eq!(
            ring_pairs(&[0, 1, 2], |a, b| a < 2 && b < 2),
            [(1, 2), (2, 0)]
        );
        assert_eq!(ring_pairs(&[0, 1, 2], |_, _| true), []);
    }

    #[test]
    fn nccl_socket_ifname_semantics() {
        let ifs = [iface("eth0"), iface("ib0")];
        assert!(ifname_matches_any("eth", &ifs));
        assert!(ifname_matches_any("=ib0", &ifs));
        assert!(!ifname_matches_any("=eth", &ifs));
        assert!(!ifname_matches_any("en", &ifs));
        assert!(ifname_matches_any("^eth", &ifs));
        assert!(!ifname_matches_any("^eth,ib", &ifs));
    }
}
