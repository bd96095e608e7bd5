//! What one client may hold of the store's process: memory in replies and unfinished requests,
//! time, and file descriptors.
//!
//! - Replies: one budget, counted while a reply is built, not after. A reply is sized under the
//!   state's lock before a byte of it is copied, and built only if it fits: the connection's own
//!   [`Limits::out_budget`] (past it, what is queued is written first: pipelined GETs of a large
//!   value cost a bounded buffer), its address's [`Limits::peer_reply_budget`] (all connections
//!   of one client that has not proven nrun's secret, together) and the store's
//!   [`Limits::reply_budget`] (every connection together). A reply that does not fit waits,
//!   unbuilt, until others' replies are written (closed after [`Limits::stall`]); one larger than
//!   a whole budget is refused (the connection closed). Replies of up to [`SMALL_REPLY`] always
//!   fit, so heartbeats and ordinary requests are never held up by someone's large ones, and a
//!   connection that proved nrun's secret (an agent) is counted but never held up. A connection
//!   whose socket takes nothing for [`Limits::stall`] is closed.
//! - Unfinished requests: a request begun must be whole within [`Limits::frame_timeout`], and all
//!   connections' read buffers together stay under [`Limits::partial_budget`] (the connection
//!   whose growth would pass it is closed).
//! - File descriptors: at most [`Limits::per_peer`] connections from one address that have not
//!   proven nrun's secret (loopback, this host's own ranks and agents, excepted; a thousand
//!   nodes' agents behind one NAT address, or the loopback hosts of a benchmark, are this run's
//!   own) and a total
//!   kept below the process's open-file limit. A connection past either cap does not lock others
//!   out: the idlest connection of the address holding the most (never one that proved nrun's
//!   secret, unvalidated ones first, parked waits last) is closed to make room. The job's ranks
//!   and nrun's agents therefore always get in, while an abuser's idle sockets are the ones that
//!   go.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

/// Sent through a connection's wake channel to close it. Never a reply: the channel otherwise
/// carries only STOP_WAITING (0).
pub(super) const EVICT: u8 = 0xff;

/// Budgets, timeouts and caps of the store's connections ([`super::Store::set_limits`]).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Replies queued but unwritten past which a connection is no longer read.
    pub out_budget: usize,
    /// Bytes the replies of all connections may hold together (built and unwritten).
    pub reply_budget: usize,
    /// Bytes the replies of one address's connections that have not proven nrun's secret may
    /// hold together.
    pub peer_reply_budget: usize,
    /// A connection whose socket accepts no reply bytes for this long is closed.
    pub stall: Duration,
    /// A request begun must be whole within this (from its first byte).
    pub frame_timeout: Duration,
    /// Bytes all connections' read buffers may hold together.
    pub partial_budget: usize,
    /// Bytes the keys of all parked WAITs may hold together; a WAIT past it closes its
    /// connection.
    pub wait_budget: usize,
    /// Most connections from one address other than loopback (the session raises it to what
    /// its largest node's ranks need).
    pub per_peer: usize,
    /// Most connections in all; 0: the open-file limit less a reserve for nrun's own files.
    pub total: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            out_budget: 64 << 20,
            reply_budget: 256 << 20,
            peer_reply_budget: 64 << 20,
            stall: Duration::from_secs(30),
            frame_timeout: Duration::from_secs(30),
            partial_budget: 1 << 30,
            wait_budget: 1 << 30,
            per_peer: 1024,
            total: 0,
        }
    }
}

impl Limits {
    /// Most connections in all: the set cap, else what the open-file limit allows.
    pub(super) fn total_cap(&self) -> usize {
        match self.total {
            0 => fd_cap(),
            n => n,
        }
    }
}

/// Read buffers up to this size never count against the partial budget's refusal (every
/// connection may always read ordinary requests); they are still counted.
pub(super) const SMALL_BUFFER: usize = 1 << 20;

/// Replies (all of one connection's queued ones) up to this size fit whatever the budgets hold.
pub(super) const SMALL_REPLY: usize = 64 << 10;

/// The most connections this process can hold: its open-file limit less room for nrun's own
/// files (workers' pipes and logs, agents' links, the listener itself).
pub(super) fn fd_cap() -> usize {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0 {
        l.rlim_cur.min(1 << 20) as usize
    } else {
        1024
    };
    let reserve = (soft / 8).max(128);
    soft.saturating_sub(reserve).max(16)
}

/// One connection as the caps see it; shared between its task and the registry.
pub(super) struct Live {
    pub(super) ip: IpAddr,
    /// Milliseconds since the registry started, at its last whole request.
    last: AtomicU64,
    pub(super) validated: AtomicBool,
    pub(super) authed: AtomicBool,
    /// In a WAIT or BARRIER: idle on the wire, but waiting on purpose.
    pub(super) parked: AtomicBool,
    /// The connection's wake channel, where [`EVICT`] asks it to close (it was chosen to make
    /// room): the channel its task already listens on, so the common path polls nothing more.
    pub(super) wake: OnceLock<mpsc::UnboundedSender<u8>>,
    /// Chosen to make room (read by a task that had not yet set `wake`).
    pub(super) evicted: AtomicBool,
    /// Reply bytes held by all connections from this address (shared by them).
    pub(super) peer_replies: Arc<AtomicUsize>,
    origin: Instant,
}

impl Live {
    pub(super) fn touch(&self) {
        let ms = self.origin.elapsed().as_millis() as u64;
        self.last.store(ms, Ordering::Relaxed);
    }

    /// The order in which connections are closed to make room: smallest first.
    fn keep_rank(&self) -> (bool, bool, u64) {
        (
            self.validated.load(Ordering::Relaxed),
            self.parked.load(Ordering::Relaxed),
            self.last.load(Ordering::Relaxed),
        )
    }
}

/// Every open connection, by peer address.
pub(super) struct Conns {
    by_peer: HashMap<IpAddr, HashMap<u64, Arc<Live>>>,
    /// How many of each address's connections proved nrun's secret.
    authed_by_peer: HashMap<IpAddr, usize>,
    /// Reply bytes each address's connections hold (see [`Live::peer_replies`]); kept while a
    /// connection of the address, even one closed to make room, still holds the count.
    replies_by_peer: HashMap<IpAddr, Arc<AtomicUsize>>,
    total: usize,
    origin: Instant,
}

impl Default for Conns {
    fn default() -> Conns {
        Conns {
            by_peer: HashMap::new(),
            authed_by_peer: HashMap::new(),
            replies_by_peer: HashMap::new(),
            total: 0,
            origin: Instant::now(),
        }
    }
}

impl Conns {
    pub(super) fn total(&self) -> usize {
        self.total
    }

    /// Registers connection `id` from `ip`, first closing another to make room where a cap is
    /// reached; None when nothing can be closed (the new connection is refused).
    pub(super) fn admit(
        &mut self,
        id: u64,
        ip: IpAddr,
        per_peer: usize,
        total: usize,
    ) -> Option<Arc<Live>> {
        // Connections that proved the secret are this run's own: only the total bounds them.
        let from_peer = self.by_peer.get(&ip).map_or(0, HashMap::len)
            - self.authed_by_peer.get(&ip).copied().unwrap_or(0);
        // This host's own clients (a single node's ranks, all on loopback) have only the total.
        if !ip.is_loopback() && from_peer >= per_peer && !self.evict_from(ip) {
            return None;
        }
        if self.total >= total && !self.evict_one() {
            return None;
        }
        let live = Arc::new(Live {
            ip,
            last: AtomicU64::new(self.origin.elapsed().as_millis() as u64),
            validated: AtomicBool::new(false),
            authed: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            wake: OnceLock::new(),
            evicted: AtomicBool::new(false),
            peer_replies: self.replies_by_peer.entry(ip).or_default().clone(),
            origin: self.origin,
        });
        self.by_peer.entry(ip).or_default().insert(id, live.clone());
        self.total += 1;
        Some(live)
    }

    /// Connection `live` just proved nrun's secret (it never unproves it).
    pub(super) fn authenticated(&mut self, live: &Live) {
        *self.authed_by_peer.entry(live.ip).or_default() += 1;
    }

    /// Forgets connection `id` (it ended, or was closed to make room).
    pub(super) fn remove(&mut self, id: u64, ip: IpAddr) {
        if let Some(m) = self.by_peer.get_mut(&ip) {
            if let Some(live) = m.remove(&id) {
                self.total -= 1;
                if live.authed.load(Ordering::Relaxed)
                    && let Some(n) = self.authed_by_peer.get_mut(&ip)
                {
                    *n -= 1;
                    if *n == 0 {
                        self.authed_by_peer.remove(&ip);
                    }
                }
            }
            if m.is_empty() {
                self.by_peer.remove(&ip);
            }
        }
        // Only the registry's own reference left: no connection of the address counts in it.
        if self
            .replies_by_peer
            .get(&ip)
            .is_some_and(|r| Arc::strong_count(r) == 1)
        {
            self.replies_by_peer.remove(&ip);
        }
    }

    /// Closes the idlest connection of the address holding the most (out of file descriptors,
    /// or the total cap reached).
    pub(super) fn evict_one(&mut self) -> bool {
        let mut peers: Vec<(usize, IpAddr)> =
            self.by_peer.iter().map(|(ip, m)| (m.len(), *ip)).collect();
        peers.sort_unstable_by_key(|p| std::cmp::Reverse(p.0));
        peers.into_iter().any(|(_, ip)| self.evict_from(ip))
    }

    /// Closes the connection from `ip` that matters least: never one that proved nrun's
    /// secret; unvalidated before validated, not waiting before waiting, idlest first.
    fn evict_from(&mut self, ip: IpAddr) -> bool {
        let Some(m) = self.by_peer.get(&ip) else {
            return false;
        };
        let victim = m
            .iter()
            .filter(|(_, l)| !l.authed.load(Ordering::Relaxed))
            .min_by_key(|(_, l)| l.keep_rank())
            .map(|(id, l)| (*id, l.clone()));
        let Some((id, live)) = victim else {
            return false;
        };
        live.evicted.store(true, Ordering::Relaxed);
        if let Some(tx) = live.wake.get() {
            let _ = tx.send(EVICT);
        }
        self.remove(id, ip);
        true
    }
}

/// Bytes one connection holds in a shared budget, given back when it ends.
pub(super) struct Held<'a> {
    total: &'a AtomicUsize,
    n: usize,
}

impl<'a> Held<'a> {
    pub(super) fn new(total: &'a AtomicUsize) -> Held<'a> {
        Held { total, n: 0 }
    }

    /// Whether growing to `n` bytes keeps the total within `budget` (small holdings always
    /// may).
    pub(super) fn may_grow(&self, n: usize, budget: usize) -> bool {
        n <= SMALL_BUFFER
            || n <= self.n
            || self.total.load(Ordering::Relaxed).saturating_sub(self.n) + n <= budget
    }

    pub(super) fn set(&mut self, n: usize) {
        // Most calls change nothing: skip the shared atomic then.
        if n == self.n {
            return;
        }
        if n > self.n {
            self.total.fetch_add(n - self.n, Ordering::Relaxed);
        } else {
            self.total.fetch_sub(self.n - n, Ordering::Relaxed);
        }
        self.n = n;
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.total.fetch_sub(self.n, Ordering::Relaxed);
    }
}

/// What [`Replies::room`] decided about a reply.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Room {
    /// Counted: build it.
    Fits,
    /// Not now: write what is queued, or wait for others', then ask again.
    Later,
    /// Larger than a whole budget: it never will.
    Never(String),
}

/// The reply bytes one connection holds, counted in its address's and the store's totals
/// (see the module's doc); given back when it ends.
pub(super) struct Replies<'a> {
    total: &'a AtomicUsize,
    peer: Arc<AtomicUsize>,
    n: usize,
}

impl<'a> Replies<'a> {
    pub(super) fn new(total: &'a AtomicUsize, live: &Live) -> Replies<'a> {
        Replies {
            total,
            peer: live.peer_replies.clone(),
            n: 0,
        }
    }

    /// Counts room for `size` more bytes after the `queued` ones, if every budget has it.
    /// `stranger`: the connection has not proven nrun's secret. One that has (nrun's own agent)
    /// is counted but never held up by the shared budgets, which strangers may have filled: no
    /// client makes the control plane wait.
    pub(super) fn room(&mut self, queued: usize, size: usize, stranger: bool, l: &Limits) -> Room {
        let want = queued.saturating_add(size);
        if want <= self.n || want <= SMALL_REPLY || (!stranger && queued == 0) {
            self.set(want.max(self.n));
            return Room::Fits;
        }
        if queued > 0 && want > l.out_budget {
            return Room::Later;
        }
        if !stranger {
            self.set(want);
            return Room::Fits;
        }
        let (budget, which) = if l.peer_reply_budget < l.reply_budget {
            (l.peer_reply_budget, "one client's replies")
        } else {
            (l.reply_budget, "all replies")
        };
        if size > budget {
            return Room::Never(format!(
                "a reply of {size} bytes is over the store's budget for {which} ({budget} bytes)"
            ));
        }
        let more = want - self.n;
        // Counted first, then checked: two connections racing for the last room cannot both
        // pass; the one that does not fit takes its count back.
        let total = self.total.fetch_add(more, Ordering::Relaxed) + more;
        let peer = self.peer.fetch_add(more, Ordering::Relaxed) + more;
        if total > l.reply_budget || peer > l.peer_reply_budget {
            self.total.fetch_sub(more, Ordering::Relaxed);
            self.peer.fetch_sub(more, Ordering::Relaxed);
            return Room::Later;
        }
        self.n = want;
        Room::Fits
    }

    /// Counts `n` bytes (the connection's reply buffer as it now is).
    pub(super) fn set(&mut self, n: usize) {
        if n == self.n {
            return;
        }
        if n > self.n {
            self.total.fetch_add(n - self.n, Ordering::Relaxed);
            self.peer.fetch_add(n - self.n, Ordering::Relaxed);
        } else {
            self.total.fetch_sub(self.n - n, Ordering::Relaxed);
            self.peer.fetch_sub(self.n - n, Ordering::Relaxed);
        }
        self.n = n;
    }
}

impl Drop for Replies<'_> {
    fn drop(&mut self) {
        self.set(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-address cap bounds what strangers hold: connections from one address that proved
    /// the secret (a NAT's or a benchmark's thousand agents) do not count against it, and are
    /// never closed to make room; strangers past it are refused or make room among themselves.
    #[test]
    fn the_per_address_cap_counts_strangers_only() {
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        let mut c = Conns::default();
        let mut agents = Vec::new();
        for id in 0..5 {
            let live = c.admit(id, ip, 2, 100).expect("admitted");
            live.validated.store(true, Ordering::Relaxed);
            live.authed.store(true, Ordering::Relaxed);
            c.authenticated(&live);
            agents.push(live);
        }
        assert_eq!(c.total(), 5);
        // Two strangers fit; a third takes the place of one of them (the idlest: here both
        // arrived in the same millisecond).
        let s1 = c.admit(10, ip, 2, 100).unwrap();
        let s2 = c.admit(11, ip, 2, 100).unwrap();
        c.admit(12, ip, 2, 100).unwrap();
        let evicted = [&s1, &s2]
            .iter()
            .filter(|s| s.evicted.load(Ordering::Relaxed))
            .count();
        assert_eq!(evicted, 1);
        assert_eq!(c.total(), 7);
        assert!(agents.iter().all(|a| !a.evicted.load(Ordering::Relaxed)));
        // Agents that leave take their count along: strangers still have two places.
        c.remove(0, ip);
        c.remove(1, ip);
        assert_eq!(c.authed_by_peer.get(&ip), Some(&3));
        c.admit(13, ip, 2, 100).unwrap();
        assert_eq!(c.total(), 5, "3 agents, 2 strangers");
        for id in 2..5 {
            c.remove(id, ip);
        }
        assert!(!c.authed_by_peer.contains_key(&ip));
    }

    /// One reply budget: strangers of one address share theirs, everyone shares the store's, a
    /// reply past a whole budget never fits, small replies and agents' always do, and what a
    /// connection gives back is room for the others.
    #[test]
    fn replies_share_one_budget() {
        let l = Limits {
            out_budget: 64,
            reply_budget: 300 << 10,
            peer_reply_budget: 200 << 10,
            ..Limits::default()
        };
        let total = AtomicUsize::new(0);
        let mut c = Conns::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let lives: Vec<_> = [a, a, b, b]
            .iter()
            .enumerate()
            .map(|(i, ip)| c.admit(i as u64, *ip, 10, 100).unwrap())
            .collect();
        let mut r: Vec<_> = lives.iter().map(|l| Replies::new(&total, l)).collect();
        let k = 1 << 10;
        assert_eq!(r[0].room(0, 150 * k, true, &l), Room::Fits);
        // Its address has 50 KiB left: the second connection of `a` waits.
        assert_eq!(r[1].room(0, 100 * k, true, &l), Room::Later);
        // Another address has its own share, within the store's 300 KiB.
        assert_eq!(r[2].room(0, 100 * k, true, &l), Room::Fits);
        // Within its address's share, past the store's.
        assert_eq!(r[3].room(0, 70 * k, true, &l), Room::Later);
        // Small replies always fit; past a whole budget, never.
        assert_eq!(r[3].room(0, 1000, true, &l), Room::Fits);
        assert!(matches!(r[3].room(0, 250 * k, true, &l), Room::Never(_)));
        // An agent is counted, never held up.
        let agent = c.admit(9, b, 10, 100).unwrap();
        let mut ra = Replies::new(&total, &agent);
        assert_eq!(ra.room(0, 400 * k, false, &l), Room::Fits);
        drop(ra);
        // Written: the room is the others'.
        r[0].set(0);
        assert_eq!(r[1].room(0, 100 * k, true, &l), Room::Fits);
        drop(r);
        assert_eq!(total.load(Ordering::Relaxed), 0);
        assert_eq!(lives[0].peer_replies.load(Ordering::Relaxed), 0);
    }
}
