//! Joining: every node's agent publishes its [`Joined`] record in the store (an in-process node
//! is joined here); the session waits until all did, their links say they cannot any more, or
//! --join-timeout passed, and names every node that did not join with its link's words. An
//! elastic job takes in nodes that join later, between attempts; with c10d, also a node that
//! comes back after its first nrun was lost: it joins with the rendezvous' next index, which
//! becomes a node of the session here ([`Session::open_slots`]), and is a fresh join.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::link::{JoinHere, Joining};
use super::{AgentLink, JoinedNode, Node, Session};
use crate::protocol::{AddrChoice, Joined, Step, c10d_next_key, c10d_refused_key, c10d_room_key};
use crate::report::schema::ControlLink;
use nrun_base::error::{Error, Result};

/// How long nodes beyond the job's size may still join once the job has its nodes.
const SPARE_GRACE: Duration = Duration::from_secs(2);

impl Session {
    /// Waits until every agent joined, exited, or --join-timeout passed. Returns the nodes
    /// that did not join, each with what ssh or the agent said. `Err`: interrupted (only the
    /// exit code). `facts`: gather an in-process node's facts too (doctor).
    pub(crate) async fn join(
        &mut self,
        facts: bool,
        python: Option<PathBuf>,
    ) -> Result<Vec<(usize, String)>> {
        let how = JoinHere {
            facts,
            python,
            store_addr: self.rendezvous.addr.clone(),
            store_port: self.rendezvous.port,
            static_launch: self.plan.group_world > 1,
        };
        for n in &mut self.nodes {
            if let Some(here) = n.link.join_here(&how) {
                n.joined = Some(here.await);
            }
        }
        if self.nodes.iter().all(|n| n.joined.is_some()) {
            return Ok(Vec::new());
        }
        self.join_agents().await
    }

    async fn join_agents(&mut self) -> Result<Vec<(usize, String)>> {
        let started = Instant::now();
        let k = self.nodes.len();
        let timeout = self.plan.join_timeout;
        let mut changed = self.store().map(|st| st.subscribe());
        let mut last_report = 0;
        let mut min_reached: Option<Instant> = None;
        let mut size_reached: Option<Instant> = None;
        let early;
        let mut progress = crate::progress::Progress::new(
            "joining nodes",
            Some(k as u64),
            Some(started + timeout),
        );
        // Counted as they change: a node is looked at when a key of its changed or its link
        // nudged (its agent's process ended), and every node on the periodic look (links that
        // nudge nothing: an srun step, a heartbeat).
        let mut joined = self.nodes.iter().filter(|n| n.joined.is_some()).count();
        let mut gone = vec![false; k];
        let mut gones = 0;
        let mut looked: Option<Instant> = None;
        loop {
            let touched = super::link::touched(&self.bus);
            let look: Vec<usize> = match (touched, looked) {
                // A key may name a node this session does not have (a client's own key).
                (Some(t), Some(at)) if at.elapsed() < super::LOOK_ALL => {
                    t.into_iter().filter(|&i| i < k).collect()
                }
                _ => {
                    looked = Some(Instant::now());
                    (0..k).collect()
                }
            };
            self.look_joined(look, &mut joined, &mut gone, &mut gones);
            let pending = k - joined - gones;
            progress.set(joined as u64);
            if !progress.is_live()
                && joined != last_report
                && joined < k
                && started.elapsed() > Duration::from_secs(1)
            {
                tracing::info!("{joined}/{k} nodes joined");
                last_report = joined;
            }
            progress.waiting(|| self.not_joined(&gone));
            // Elastic: once MIN nodes are in, the others get the last call, then the job starts.
            let size = self.plan.size;
            // A host that took over (c10d) waits for a majority of the last world as well.
            let least = self.plan.min_nodes.max(self.quorum());
            let last_call = match joined >= least && joined < size {
                true => {
                    let at = *min_reached.get_or_insert_with(Instant::now);
                    progress.set_deadline((at + self.plan.last_call).min(started + timeout));
                    at.elapsed() >= self.plan.last_call
                }
                false => false,
            };
            // Spares: once the job has its nodes, the rest get a moment more; a spare that
            // joins later is taken in when it is needed.
            let spares_waited = match joined >= size && joined < k {
                true => size_reached.get_or_insert_with(Instant::now).elapsed() >= SPARE_GRACE,
                false => false,
            };
            // A host that took over has every node that may be alive: the rest are dead.
            let all_in = pending == 0 || self.all_alive_in(joined);
            if all_in || started.elapsed() > timeout || last_call || spares_waited {
                early = !(pending == 0 || started.elapsed() > timeout);
                progress.finish(None);
                break;
            }
            // Records arrive as store writes, exits of agents as nudges; the tick keeps the
            // clocks above (and the periodic look).
            tokio::select! {
                () = super::store_changed(&mut changed) => {}
                () = self.bus.nudges.notify.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                sig = self.signals.stop() => return Err(Error::interrupted(sig)),
            }
        }
        // Let stderr relays catch the last words of agents that exited.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let waited = started.elapsed();
        let failures = self.join_failures(waited, timeout, early);
        tracing::info!(
            "{}/{k} nodes joined in {:.2} s",
            self.nodes.iter().filter(|n| n.joined.is_some()).count(),
            waited.as_secs_f64()
        );
        if let Some(differ) = self.control_paths_differ() {
            tracing::info!("{differ}");
        }
        Ok(failures)
    }

    /// Where the joined remote nodes' agents reach the launch host, when that is not one
    /// address for all: each address, how it was chosen, and its nodes. None: one address.
    pub(crate) fn control_paths_differ(&self) -> Option<String> {
        let mut by_addr: std::collections::BTreeMap<String, (AddrChoice, Vec<String>)> =
            std::collections::BTreeMap::new();
        for n in self.nodes.iter().filter(|n| !n.is_local()) {
            let Some(l) = n.joined.as_ref().and_then(|j| j.link.as_ref()) else {
                continue;
            };
            let ip = l
                .reached
                .parse::<std::net::SocketAddr>()
                .map_or(l.reached.clone(), |a| a.ip().to_string());
            by_addr
                .entry(ip)
                .or_insert_with(|| (l.chosen, Vec::new()))
                .1
                .push(n.label.clone());
        }
        if by_addr.len() < 2 {
            return None;
        }
        let each: Vec<String> = by_addr
            .iter()
            .map(|(ip, (how, nodes))| {
                format!(
                    "{ip} (the address {}) from {}",
                    how.words(),
                    crate::progress::few(nodes)
                )
            })
            .collect();
        Some(format!(
            "the nodes reach the launch host at different addresses: {}",
            each.join("; ")
        ))
    }

    /// `--report`'s `control` section: each joined node's launch-host address, how its agent
    /// chose it, and the node's own end of that connection.
    pub(crate) fn control_report(&self) -> Vec<ControlLink> {
        self.nodes
            .iter()
            .filter_map(|n| {
                let l = n.joined.as_ref()?.link.as_ref()?;
                Some(ControlLink {
                    host: n.label.clone(),
                    launch_addr: l.reached.clone(),
                    chosen: l.chosen.as_str().to_string(),
                    node_addr: l.local_addr.clone(),
                })
            })
            .collect()
    }

    /// Who the join waits for (nodes neither joined nor `gone`), and who is in.
    fn not_joined(&self, gone: &[bool]) -> String {
        let (mut missing, mut joined) = (Vec::new(), Vec::new());
        for (i, n) in self.nodes.iter().enumerate() {
            match (n.joined.is_some(), gone.get(i).copied().unwrap_or(false)) {
                (true, _) => joined.push(n.label.clone()),
                (false, false) => missing.push(n.label.clone()),
                (false, true) => {}
            }
        }
        match joined.is_empty() {
            true => crate::progress::few(&missing),
            false => format!(
                "{} (joined: {})",
                crate::progress::few(&missing),
                crate::progress::few(&joined)
            ),
        }
    }

    /// Looks at nodes `look` that have not joined: takes in those whose record came (counted
    /// in `joined`), and marks those whose agent cannot join any more (`gone`, counted in
    /// `gones`; a node may come back from it, as a c10d slot does).
    fn look_joined(
        &mut self,
        look: Vec<usize>,
        joined: &mut usize,
        gone: &mut [bool],
        gones: &mut usize,
    ) {
        for i in look {
            if self.nodes[i].joined.is_some() {
                continue;
            }
            let now_gone = match self.take_joined(i) {
                true => {
                    *joined += 1;
                    false
                }
                false => self.nodes[i].link.joining() == Joining::Gone,
            };
            if now_gone != gone[i] {
                gone[i] = now_gone;
                match now_gone {
                    true => *gones += 1,
                    false => *gones -= 1,
                }
            }
        }
    }

    /// The nodes that did not join, each with why in its link's words. A node still on its
    /// way when the job had its nodes (`early`) is no failure (yet): it is taken in as a spare
    /// if it joins.
    fn join_failures(
        &mut self,
        waited: Duration,
        timeout: Duration,
        early: bool,
    ) -> Vec<(usize, String)> {
        self.nodes
            .iter_mut()
            .enumerate()
            .filter(|(_, n)| n.joined.is_none())
            .filter_map(|(i, n)| {
                let gone = n.link.joining() == Joining::Gone;
                (!early || gone).then(|| (i, n.link.join_failure(&n.label, waited, timeout)))
            })
            .collect()
    }

    /// Takes node `i`'s joined record into the session, if it has published one.
    pub(super) fn take_joined(&mut self, i: usize) -> bool {
        let Some(record) = self.bus.joined(i) else {
            return false;
        };
        let Joined {
            local_addr,
            reached,
            chosen,
            probe_addr,
            mut facts,
            nonce,
            own_sealed,
            kept: _,
        } = record;
        // A c10d node's own command line, sealed with the run's secret for this join.
        if let (Some(sealed), Some(secret)) = (own_sealed, &self.rendezvous.secret) {
            let key = self.bus.keys.joined(i);
            facts.own = nrun_store::auth::open(secret.as_bytes(), &key, nonce.as_bytes(), &sealed)
                .and_then(|json| serde_json::from_slice(&json).ok());
            if facts.own.is_none() {
                tracing::warn!(
                    "node {i}'s own command line could not be opened with the run's secret; \
                     it runs the hosting node's"
                );
            }
        }
        // Every later step of this node is sealed for it (link::Bus::set_step).
        self.bus.nonces.insert(i, nonce);
        if self.nodes[i].link.kind().named_on_join {
            // A joined node is named by its host, kept apart from a namesake.
            let name = facts.hostname.clone();
            // A node left out does not hold its name: the same host come back takes it.
            let taken = |n: &str| {
                self.nodes
                    .iter()
                    .enumerate()
                    .any(|(j, o)| j != i && o.label == n && !self.is_left_out(j))
            };
            self.nodes[i].label = match taken(&name) {
                false => name,
                true => format!("{name}#{i}"),
            };
        }
        self.nodes[i].joined = Some(JoinedNode {
            facts: Some(facts),
            link: Some(AgentLink {
                local_addr,
                reached,
                chosen,
                probe_addr,
            }),
            ifname: None,
            master_addr: String::new(),
            addr: None,
        });
        true
    }

    /// Nodes that joined after the join ended (elastic): taken in, their indices returned. A
    /// lost node's agent started again is not one of them: it comes back through
    /// [`Session::take_back`], with its link.
    pub(super) fn admit_late(&mut self) -> Vec<usize> {
        self.open_slots();
        let waiting: Vec<usize> = (0..self.nodes.len())
            .filter(|i| self.nodes[*i].joined.is_none() && !self.roster.is_returning(*i))
            .collect();
        waiting
            .into_iter()
            .filter(|i| self.take_joined(*i))
            .collect()
    }

    /// Whether a node outside the group has published its joined record while the job is
    /// short of its size (elastic, or spares used up), checked at most once a second; or a
    /// node lost earlier came back with room for it ([`Session::take_back`], every call: a
    /// spare is said at once).
    pub(super) fn arrivals(&mut self) -> bool {
        if self.take_back() {
            return true;
        }
        let active = self.roster.active();
        if active.len() >= self.plan.size || active.is_empty() {
            return false;
        }
        let now = Instant::now();
        if self
            .arrivals_checked
            .is_some_and(|t| now - t < Duration::from_secs(1))
        {
            return false;
        }
        self.arrivals_checked = Some(now);
        // Past the nodes: c10d indices handed out since (a node come back), not yet nodes.
        let beyond = self.handed_out().unwrap_or(0) + 1;
        (0..self.nodes.len().max(beyond))
            .filter(|i| {
                !self.roster.is_active(*i)
                    && self.nodes.get(*i).is_none_or(|n| n.joined.is_none())
                    && !self.is_left_out(*i)
                    && !self.roster.is_returning(*i)
            })
            .any(|i| self.bus.has_joined(i))
    }

    /// The last node index the c10d rendezvous this nrun hosts has handed out (the host is 0).
    fn handed_out(&self) -> Option<usize> {
        let id = self.c10d_id.as_ref()?;
        let raw = self.store()?.get(&c10d_next_key(id))?;
        String::from_utf8_lossy(&raw).trim().parse().ok()
    }

    /// c10d: indices handed out past the session's nodes, up to the last one whose agent joined,
    /// become nodes as the first peers are: placeholders, given the steps so far as idle ones
    /// (an agent takes its steps in order from the first), so that such a node is taken in as
    /// any late joiner. Its index is new: nothing of a lost node's keys is read for it.
    pub(super) fn open_slots(&mut self) {
        let Some(handed) = self.handed_out() else {
            return;
        };
        let Some(top) = (self.nodes.len()..=handed)
            .rev()
            .find(|&i| self.bus.has_joined(i))
        else {
            return;
        };
        let Some(last) = self.plan.layout.last().cloned() else {
            return;
        };
        while self.nodes.len() <= top {
            let i = self.nodes.len();
            // Its own worker count comes with its join (facts.own); the layout is for indexing.
            self.plan.layout.push(crate::plan::nodes::NodeLayout {
                group_rank: i,
                ..last.clone()
            });
            self.nodes
                .push(Node::new(&format!("node{i}"), super::link::peer::link()));
            for no in 0..self.step {
                self.bus.set_step(i, no, &Step::idle());
            }
        }
    }

    /// c10d: tells nodes that may still join what this nrun takes now: how many more nodes
    /// (one past the job's nodes and spares joins only while this is above 0), and each host
    /// left out on evidence against the node itself ([`super::roster::LeftOut::bars_return`]),
    /// whose nrun is refused with that evidence (session::c10d).
    pub(super) fn publish_room(&self) {
        let (Some(id), Some(st)) = (&self.c10d_id, self.store()) else {
            return;
        };
        let slots = self.plan.hosts.len();
        // Held: every node not left out that joined, or is one of the first slots still open.
        let held = (0..self.nodes.len())
            .filter(|&i| !self.is_left_out(i) && (i < slots || self.nodes[i].joined.is_some()))
            .count();
        st.set(
            &c10d_room_key(id),
            slots.saturating_sub(held).to_string().as_bytes(),
        );
        for l in self.roster.left_out().iter().filter(|l| l.bars_return()) {
            // The first evidence stands (a node refused later repeats it).
            let key = self.machine_key(l.node).map(|h| c10d_refused_key(id, &h));
            if let Some(key) = key.filter(|k| !st.contains(k)) {
                let why = format!("{} ({}): {}", l.host, l.stage.as_str(), l.why);
                st.set(&key, why.as_bytes());
            }
        }
    }

    /// Which machine node `i` is, as it reported when it joined ([`crate::facts::Facts::machine`];
    /// its host name where it could not say): host names alone would refuse a clone that shares
    /// one (see [`crate::facts::machine_or_hostname`], its own side).
    pub(super) fn machine_key(&self, i: usize) -> Option<String> {
        let facts = self.nodes.get(i)?.joined.as_ref()?.facts.as_ref()?;
        Some(match facts.machine.is_empty() {
            true => facts.hostname.clone(),
            false => facts.machine.clone(),
        })
    }
}
