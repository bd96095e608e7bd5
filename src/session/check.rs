//! Checking the joined nodes before anything runs: each node's interface and the addresses it
//! is reached on, NAT between it and the launch host, the user's NCCL_SOCKET_IFNAME, MTUs, the
//! facts across nodes, and a ring of node-to-node connections. Problems refuse the launch with
//! the node named; warnings are printed and the run goes on.

use std::net::{IpAddr, SocketAddr};

use super::{Policy, Session};
use crate::agent::protocol::{Step, StepResult};
use crate::error::{Error, Result, exit};
use crate::net;

/// What the checks found: problems refuse the launch, warnings do not.
#[derive(Debug, Default)]
pub struct Findings {
    pub problems: Vec<String>,
    pub warnings: Vec<String>,
}

impl Session {
    /// Decides each joined remote node's interface, the address its workers reach the store
    /// on, and the address other nodes reach it on.
    pub fn assign_interfaces(&mut self) -> Findings {
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
                f.problems.push(format!(
                    "{}: its agent reported unreadable addresses",
                    n.label
                ));
                continue;
            };
            let ifaces = &facts.ifaces;
            j.master_addr = net::canonical(reached.ip()).to_string();
            j.addr = Some(net::canonical(local.ip()));
            match (&want, net::owner(ifaces, local.ip())) {
                (Some(want), _) => {
                    if !ifaces.iter().any(|x| &x.name == want && x.up) {
                        f.problems.push(format!(
                            "--ifname {want}: no such interface up on {}",
                            n.label
                        ));
                    }
                    j.ifname = Some(want.clone());
                }
                (None, Some(x)) => j.ifname = Some(x.name.clone()),
                (None, None) => f.problems.push(format!(
                    "{}: reached the launch host from {}, which no interface of the node holds",
                    n.label,
                    local.ip()
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
    /// facts table, the warnings and (as an error) the problems; `Err` only carries the exit code.
    pub fn readiness(&self, mut f: Findings) -> Result<()> {
        let user_ifname = self
            .plan
            .env
            .iter()
            .find(|(k, _)| k == "NCCL_SOCKET_IFNAME")
            .map(|(_, v)| v.clone());
        if let Some(v) = &user_ifname {
            for (_, n, j) in self.joined() {
                let ifs = j.facts.as_ref().map_or(&[][..], |x| &x.ifaces[..]);
                if !ifname_matches_any(v, ifs) {
                    f.problems.push(format!(
                        "NCCL_SOCKET_IFNAME={v} matches no interface that is up on {} (it has: {})",
                        n.label,
                        ifs.iter()
                            .filter(|x| x.up)
                            .map(|x| x.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
            }
        }
        let mtus: std::collections::BTreeSet<u32> = self
            .joined()
            .filter_map(|(_, _, j)| {
                let facts = j.facts.as_ref()?;
                let name = j.ifname.as_ref()?;
                facts.ifaces.iter().find(|x| &x.name == name)?.mtu
            })
            .collect();
        if mtus.len() > 1 {
            f.warnings.push(format!("the chosen interfaces' MTUs differ between nodes ({mtus:?}): large messages may be dropped or fragmented"));
        }
        if let Some(w) = crate::plan::env::port_range_warning(&self.plan.env) {
            f.warnings.push(w.to_string());
        }
        let facts: Vec<(String, &crate::facts::Facts)> = self
            .joined()
            .filter_map(|(_, n, j)| j.facts.as_ref().map(|x| (n.label.clone(), x)))
            .collect();
        let cmp = crate::facts::compare(&facts);
        eprint!("{}", cmp.table);
        f.warnings.extend(cmp.differences.iter().cloned());
        for n in &cmp.notes {
            tracing::info!("{n}");
        }
        if cmp.refuse && !self.plan.allow_mismatch {
            f.problems.push("NCCL major.minor or torch differ between nodes (see above): a job would fail or hang in init; make them equal, or pass --allow-mismatch".into());
        }
        for w in &f.warnings {
            tracing::warn!("{w}");
        }
        if f.problems.is_empty() {
            return Ok(());
        }
        eprintln!("nrun: error: the nodes are not ready:");
        for p in &f.problems {
            eprintln!("  {p}");
        }
        Err(Error::exit(exit::CLUSTER))
    }

    /// Every node connects to the next one (a ring) on the addresses NCCL will use, so a
    /// firewall between two nodes is named before NCCL hangs on it.
    pub async fn probe_ring(&mut self) -> Result<()> {
        // The ring of the nodes that joined (an elastic job starts without the others).
        let ring: Vec<usize> = (0..self.nodes.len())
            .filter(|i| self.nodes[*i].joined.is_some())
            .collect();
        let k = ring.len();
        if k < 2 {
            return Ok(());
        }
        let mut next_of = vec![None; self.nodes.len()];
        let mut steps = vec![None; self.nodes.len()];
        for (pos, &i) in ring.iter().enumerate() {
            let next = ring[(pos + 1) % k];
            next_of[i] = Some(next);
            let target = self.nodes[next].joined.as_ref().and_then(|j| {
                let published: SocketAddr = j.link.as_ref()?.probe_addr.parse().ok()?;
                Some(SocketAddr::new(
                    j.addr.unwrap_or(published.ip()),
                    published.port(),
                ))
            });
            steps[i] = Some(match target {
                Some(t) => Step::Probe {
                    target: t.to_string(),
                    timeout_ms: 5000,
                },
                None => Step::Probe {
                    target: String::new(),
                    timeout_ms: 0,
                },
            });
        }
        let results = self.run_step(steps, Policy::Probe).await?;
        let mut bad = Vec::new();
        for (i, r) in results.iter().enumerate() {
            if let (Some(StepResult::Probe { error: Some(e) }), Some(n)) = (r, next_of[i]) {
                let (me, next) = (&self.nodes[i], &self.nodes[n]);
                let ifname = next
                    .joined
                    .as_ref()
                    .and_then(|j| j.ifname.as_deref())
                    .unwrap_or("?");
                bad.push(format!(
                    "{a} cannot reach {b}: {e}; check the firewall between {a} and {b} (nrun probed the address {b} uses for NCCL, interface {ifname})",
                    a = me.label,
                    b = next.label
                ));
            }
        }
        if bad.is_empty() {
            return Ok(());
        }
        eprintln!("nrun: error: nodes cannot reach each other:");
        for b in &bad {
            eprintln!("  {b}");
        }
        Err(Error::exit(exit::CLUSTER))
    }
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
