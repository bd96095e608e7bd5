//! The c10d rendezvous host is replaceable: every step the hosting nrun sends carries the
//! [`Succession`] (its epoch, and its other nodes in join order with the address it saw each
//! at), every node keeps the last one (and writes it to a state file on its machine), and a
//! node that loses the host goes down that order (`session::c10d`). A host that took over
//! waits for a majority of the last world's nodes before its workers start ([`Hosting`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use super::Session;
use crate::protocol::{Step, Succession, Successor};
use nrun_base::error::Error;

/// What the nrun hosting a c10d rendezvous (the c10d form: nodes in join order) stamps on its
/// steps.
#[derive(Clone, Debug)]
pub(crate) struct Hosting {
    pub id: String,
    /// This host as its nodes reach it: the endpoint's host (or the address a host that took
    /// over was seen at).
    pub host: String,
    pub epoch: u64,
    /// The job's first host's run name, kept by every host that takes over.
    pub lineage: String,
    /// The port every node would host on: the endpoint's.
    pub port: u16,
    /// Nodes (this one included) that must be in before the first workers start: a strict
    /// majority of the last world's nodes (those known dead not counted), for a host that took
    /// over; 0 for the first host.
    pub quorum: usize,
    /// A host that took over: the last world's nodes that may be alive; once they are all in,
    /// the join waits for no other (the rest are known dead). 0 for the first host.
    pub alive: usize,
    /// The last succession stamped: the last world, and who would take over.
    pub last: Option<Succession>,
}

/// The last succession of a c10d host that stood down, for its node to go down (see
/// `commands::execute`): set once, read once.
static STOOD_DOWN: std::sync::Mutex<Option<Succession>> = std::sync::Mutex::new(None);

/// Whether this nrun's c10d host stood down (its node is to go down the succession).
pub(crate) fn standing_down() -> bool {
    STOOD_DOWN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_some()
}

/// The succession a c10d host that stood down goes down as a fresh node (None: it did not).
pub(crate) fn stood_down() -> Option<Succession> {
    STOOD_DOWN.lock().unwrap_or_else(|e| e.into_inner()).take()
}

impl Session {
    /// Stamps the [`Succession`] on every Run step of `steps` (the c10d form's host only), and
    /// keeps it in this machine's state file.
    pub(crate) fn stamp_succession(&mut self, steps: &mut [Option<Step>]) {
        let Some(h) = &self.hosting else {
            return;
        };
        let world: Vec<usize> = steps
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s, Some(Step::Run { workers, .. }) if !workers.is_empty()))
            .map(|(i, _)| i)
            .collect();
        if world.is_empty() {
            return;
        }
        // In join order (node indices are given in join order), this host's own node excluded.
        let nodes = world
            .iter()
            .filter(|&&i| !self.nodes[i].is_local())
            .filter_map(|&i| {
                let link = self.nodes[i].joined.as_ref()?.link.as_ref()?;
                let ip = link.local_addr.parse::<SocketAddr>().ok()?.ip();
                Some(Successor {
                    node: i,
                    addr: nrun_base::net::canonical(ip).to_string(),
                    port: h.port,
                })
            })
            .collect();
        let s = Succession {
            id: h.id.clone(),
            epoch: h.epoch,
            lineage: h.lineage.clone(),
            host: h.host.clone(),
            world: world.len(),
            nodes,
        };
        for step in steps.iter_mut().flatten() {
            if let Step::Run { succession, .. } = step {
                *succession = Some(s.clone());
            }
        }
        keep(&s);
        // The majority was there when workers first started: from now on this host is the
        // one in place (it keeps a tie).
        if let Some(h) = self.hosting.as_mut() {
            h.quorum = 0;
            h.alive = 0;
            h.last = Some(s);
        }
    }

    /// The c10d host, re-forming after nodes were lost (`gone`: each with why): Err (why, in
    /// words) when it must stand down instead of training on: a node of the last succession
    /// hosts the rendezvous at a newer epoch (this host was frozen or cut off while that one
    /// took over: its nodes' closed connections were no deaths), or the nodes left are under
    /// half of the last world, those known dead (their connection closed) not counted. Its
    /// node then goes down the succession as a fresh node ([`stood_down`]).
    pub(crate) fn may_go_on(
        &self,
        gone: &[(usize, super::roster::Stage, String)],
    ) -> Result<(), String> {
        let Some(h) = &self.hosting else {
            return Ok(());
        };
        let Some(last) = h.last.clone() else {
            return Ok(());
        };
        if gone.is_empty() {
            return Ok(());
        }
        let stand_down = |why: String| {
            *STOOD_DOWN.lock().unwrap_or_else(|e| e.into_inner()) = Some(last.clone());
            Err(why)
        };
        if let Some(newer) = self.newer_host(&last) {
            return stand_down(format!(
                "this node hosted rendezvous {:?} at epoch {}, but {newer} took over meanwhile \
                 (this host was frozen or cut off): it stands down, stops its workers and joins \
                 there as a fresh node",
                h.id, h.epoch
            ));
        }
        // Nodes whose connection closed are dead (their nrun ended, or was killed); a silent
        // one may be alive elsewhere.
        let dead = gone
            .iter()
            .filter(|(i, ..)| self.nodes.get(*i).is_some_and(|n| n.link.closed()))
            .count();
        let active = self.roster().active().len();
        let alive = last.world.saturating_sub(dead);
        if host_keeps(active, last.world, dead) && 2 * active == alive {
            tracing::warn!(
                "this host keeps rendezvous {:?} (epoch {}) with {active} of the last world's {} \
                 nodes that may be alive: a tie, which the host in place keeps (a node that took \
                 over would need a strict majority), so only this world trains",
                h.id,
                h.epoch,
                alive
            );
        }
        if !host_keeps(active, last.world, dead) {
            return stand_down(format!(
                "this host has {active} of the last world's {} nodes ({dead} known dead): under \
                 half of those that may be alive, it must not train (the others may form a \
                 majority elsewhere): it stops its workers and looks for a host in the \
                 succession of the last step",
                last.world
            ));
        }
        Ok(())
    }

    /// Who hosts this rendezvous at a newer epoch than this host's: a node that left for it
    /// said so in this store, or a node of the last succession answers so (one look each).
    fn newer_host(&self, last: &Succession) -> Option<String> {
        let key = crate::protocol::c10d_newer_key(&last.id);
        if let Some(v) = self
            .store()
            .and_then(|st| st.get(&key))
            .filter(|v| newer_than(v, last.epoch, &last.lineage))
        {
            return Some(format!(
                "a host of epoch {} (a node that left this one said so)",
                String::from_utf8_lossy(&v)
            ));
        }
        let last = last.clone();
        // Off this runtime (this is called from the attempt loop, between steps): a thread
        // with a runtime of its own, a second or two per node at most.
        std::thread::scope(|s| {
            s.spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                rt.block_on(super::c10d::newer_among(&last))
            })
            .join()
            .ok()
            .flatten()
        })
    }

    /// How many nodes, this one included, must be in before workers start: a host that took
    /// over waits for a strict majority of the last world (0: no such wait).
    pub(crate) fn quorum(&self) -> usize {
        self.hosting.as_ref().map_or(0, |h| h.quorum)
    }

    /// A host that took over: whether every node of the last world that may be alive is in
    /// (`joined` of them), so that the join need not wait for the others.
    pub(crate) fn all_alive_in(&self, joined: usize) -> bool {
        self.hosting
            .as_ref()
            .is_some_and(|h| h.alive > 0 && joined >= h.alive)
    }

    /// The error when a host that took over has no majority at its join's end.
    pub(crate) fn no_majority(&self, q: usize) -> Error {
        let (id, epoch) = self
            .hosting
            .as_ref()
            .map_or((String::new(), 0), |h| (h.id.clone(), h.epoch));
        Error::cluster(format!(
            "this node took over hosting rendezvous {id:?} (epoch {epoch}), but only {} of the \
             {q} nodes a majority of the last world needs came within --join-timeout: the \
             others may still be with the last host (frozen, or cut off from this node), and a \
             minority never trains (two worlds would); stopping. Check the network between the \
             nodes, then start the same command again on every node",
            self.roster().active().len()
        ))
    }
}

/// Whether a "newer" word (`EPOCH LINEAGE`) names an epoch past `epoch` of `lineage`.
fn newer_than(v: &[u8], epoch: u64, lineage: &str) -> bool {
    let v = String::from_utf8_lossy(v);
    let mut w = v.split_whitespace();
    let e: u64 = w.next().and_then(|e| e.parse().ok()).unwrap_or(0);
    e > epoch && w.next() == Some(lineage)
}

/// Keeps `s` in this machine's state file for its rendezvous, replaced whole.
pub(crate) fn keep(s: &Succession) {
    let path = state_file(&s.id);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Ok(json) = serde_json::to_vec(s)
        && let Err(e) = nrun_base::outputs::replace(&path, &json)
    {
        tracing::debug!("cannot keep the succession in {}: {e}", path.display());
    }
}

/// The last succession this machine's nrun kept for rendezvous `id` (None: none, or another
/// rendezvous').
pub(crate) fn kept(id: &str) -> Option<Succession> {
    let raw = std::fs::read(state_file(id)).ok()?;
    serde_json::from_slice::<Succession>(&raw)
        .ok()
        .filter(|s| s.id == id)
}

/// Where this machine keeps the last succession of rendezvous `id`: under $XDG_RUNTIME_DIR
/// (else ~/.cache) nrun/rdzv/, one file per rendezvous id and machine (boot id and network
/// namespace: nodes that share a home directory keep theirs apart).
pub(crate) fn state_file(id: &str) -> PathBuf {
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let machine = crate::facts::machine_or_hostname();
    base.join("nrun/rdzv")
        .join(format!("{:016x}.json", fnv(&[id, &machine])))
}

/// FNV-1a over `parts` (a file name, stable across builds).
fn fnv(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// How many nodes a new host needs with it (itself included): a strict majority of the last
/// world's `world` nodes, less those known dead (`dead`). The host in place keeps a tie
/// ([`host_keeps`]); a successor does not.
pub(crate) fn successor_quorum(world: usize, dead: usize) -> usize {
    world.saturating_sub(dead) / 2 + 1
}

/// Whether the host in place may go on training with `active` nodes of a last world of
/// `world`, `dead` of them known dead: at least half (it keeps a tie).
pub(crate) fn host_keeps(active: usize, world: usize, dead: usize) -> bool {
    2 * active >= world.saturating_sub(dead)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cases the fault model names: 2 nodes, either one killed or frozen; 3 nodes, the
    /// host killed or one cut off.
    #[test]
    fn the_majority_rule_keeps_one_world() {
        // 2 nodes, the host killed (its connection closed): node 2 hosts alone.
        assert_eq!(successor_quorum(2, 1), 1);
        // 2 nodes, the host frozen: node 2 needs both, the host keeps the tie alone.
        assert_eq!(successor_quorum(2, 0), 2);
        assert!(host_keeps(1, 2, 0));
        // 3 nodes, the host killed: the two survivors together.
        assert_eq!(successor_quorum(3, 1), 2);
        // 3 nodes, one cut off: it cannot host alone; the host keeps the other two.
        assert_eq!(successor_quorum(3, 0), 2);
        assert!(host_keeps(2, 3, 0));
        // 3 nodes, the host cut off from both: it stands down.
        assert!(!host_keeps(1, 3, 0));
        // 3 nodes, one killed and one cut off: the host alone keeps the tie of the 2 that may
        // be alive.
        assert!(host_keeps(1, 3, 1));
    }

    /// A "newer host" word counts within the job's own lineage only: a later job that reuses
    /// the rendezvous id (torchrun's default is "none") is no newer host of this one.
    #[test]
    fn a_newer_host_is_of_the_same_job() {
        assert!(newer_than(b"2 job-41", 1, "job-41"));
        assert!(!newer_than(b"1 job-41", 1, "job-41"));
        assert!(!newer_than(b"5 job-77", 1, "job-41"));
        assert!(!newer_than(b"garbage", 1, "job-41"));
    }

    #[test]
    fn state_files_are_apart_per_rendezvous() {
        assert_ne!(state_file("a"), state_file("b"));
        assert!(state_file("a").to_string_lossy().contains("nrun/rdzv/"));
    }
}
