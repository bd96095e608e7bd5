//! What one client may hold of the store's process: memory, time, and file descriptors.
//!
//! - Memory: one budget for everything a connection holds (its read buffer of any size, the
//!   request being parsed out of it and applied, its replies built and not yet written), kept
//!   by one type, [`Account`], and asked before the memory is taken: the connection's own
//!   [`Limits::conn_budget`], its address's [`Limits::peer_budget`] (all its connections that
//!   have not proven nrun's secret, loopback addresses included, each address apart) and the
//!   pool of every such connection, [`Limits::memory_budget`], whose last quarter only small
//!   holdings (up to [`SMALL`]: an ordinary request or reply) may use. Connections that proved
//!   nrun's secret (agents) are counted in a pool of their own, [`Limits::own_budget`], which
//!   no stranger can fill: heartbeats, steps and results never wait on an attacker's memory.
//!   A read that does not fit closes its connection (what it sent is the client's to send
//!   again; holding it unread would hold the kernel's buffers instead). A reply that does not
//!   fit waits, unbuilt, until what is queued is written or others give room back (closed
//!   after [`Limits::stall`]); one past the connection's own budget is refused (the connection
//!   closed). Past [`Limits::out_budget`] of queued replies a connection is no longer read, so
//!   pipelined GETs of a large value cost a bounded buffer. A connection whose socket takes
//!   nothing for [`Limits::stall`] is closed.
//! - Time: a request begun must be whole within [`Limits::frame_timeout`]; a connection idle
//!   for [`Limits::idle_hold`] gives back a read buffer larger than the first one (a whole
//!   request of 1 MiB does not keep its megabyte for good).
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
    /// Bytes one connection that has not proven nrun's secret may hold (read buffer, request
    /// being applied, replies).
    pub conn_budget: usize,
    /// Bytes the connections of one address that have not proven nrun's secret may hold
    /// together, beyond their small holdings.
    pub peer_budget: usize,
    /// Bytes all connections that have not proven nrun's secret may hold together.
    pub memory_budget: usize,
    /// Bytes the connections that proved nrun's secret (agents) may hold together.
    pub own_budget: usize,
    /// A connection whose socket accepts no reply bytes for this long is closed.
    pub stall: Duration,
    /// A request begun must be whole within this (from its first byte).
    pub frame_timeout: Duration,
    /// A connection with nothing to read for this long gives back a read buffer grown past
    /// its first size.
    pub idle_hold: Duration,
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
            conn_budget: 80 << 20,
            peer_budget: 64 << 20,
            memory_budget: 256 << 20,
            own_budget: 256 << 20,
            stall: Duration::from_secs(30),
            frame_timeout: Duration::from_secs(30),
            idle_hold: Duration::from_secs(1),
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

/// A connection holding at most this much (an ordinary request or reply, of any number of
/// connections) may use the strangers' whole pool; one holding more, all but its reserve.
pub(super) const SMALL: usize = 4 << 10;

/// The strangers' pool keeps this part of itself (a quarter) for small holdings: the job's
/// ranks' requests fit however many large ones strangers hold.
const RESERVE_DIV: usize = 4;

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
    /// Bytes held by all connections from this address that have not proven nrun's secret
    /// (shared by them; see [`Account`]).
    pub(super) peer_held: Arc<AtomicUsize>,
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
    /// Bytes each address's connections hold (see [`Live::peer_held`]); kept while a
    /// connection of the address, even one closed to make room, still holds the count.
    held_by_peer: HashMap<IpAddr, Arc<AtomicUsize>>,
    total: usize,
    origin: Instant,
}

impl Default for Conns {
    fn default() -> Conns {
        Conns {
            by_peer: HashMap::new(),
            authed_by_peer: HashMap::new(),
            held_by_peer: HashMap::new(),
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
            peer_held: self.held_by_peer.entry(ip).or_default().clone(),
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
            .held_by_peer
            .get(&ip)
            .is_some_and(|r| Arc::strong_count(r) == 1)
        {
            self.held_by_peer.remove(&ip);
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

/// Where a connection's bytes are counted: strangers (every connection that has not proven
/// nrun's secret, the job's torch clients among them) share one pool; nrun's own connections
/// (agents) have theirs, which strangers cannot fill.
pub(super) struct Memory {
    strangers: AtomicUsize,
    own: AtomicUsize,
}

impl Default for Memory {
    fn default() -> Memory {
        Memory {
            strangers: AtomicUsize::new(0),
            own: AtomicUsize::new(0),
        }
    }
}

impl Memory {
    /// Bytes held by all connections together (strangers' and nrun's own).
    pub(super) fn held(&self) -> usize {
        self.strangers.load(Ordering::Relaxed) + self.own.load(Ordering::Relaxed)
    }
}

/// What [`Account::room`] decided.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Room {
    /// Counted: take it.
    Fits,
    /// Not now: a budget this connection shares is full (what it names); written replies,
    /// ended connections or served requests give room back.
    Later(String),
    /// Past what this connection may ever hold (its own budget): it never will.
    Never(String),
}

/// Which part of a connection's holding a request for room is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
    /// Its read buffer, and the request being parsed out of it (a value about to be written).
    Read,
    /// Replies built and not yet written.
    Out,
}

/// Everything one connection holds of the store's memory (its read buffer, the request being
/// applied, its replies), counted in its own total, its address's and its pool's, and checked
/// against all three before the memory is taken (see the module's doc); given back when it
/// ends. The one accounting type of the store's connections.
pub(super) struct Account<'a> {
    memory: &'a Memory,
    /// The address's count (strangers only; see [`Live::peer_held`]).
    peer: Arc<AtomicUsize>,
    /// Proved nrun's secret: counted in nrun's own pool, not its address's or strangers'.
    own: bool,
    read: usize,
    out: usize,
}

impl<'a> Account<'a> {
    pub(super) fn new(memory: &'a Memory, live: &Live) -> Account<'a> {
        Account {
            memory,
            peer: live.peer_held.clone(),
            own: false,
            read: 0,
            out: 0,
        }
    }

    /// Bytes this connection holds.
    pub(super) fn held(&self) -> usize {
        self.read + self.out
    }

    /// Bytes its replies hold.
    pub(super) fn out(&self) -> usize {
        self.out
    }

    /// Asks for `part` to hold `n` bytes (from what it holds now), every budget checked
    /// before it is counted; counted only where it fits. Giving back always fits.
    pub(super) fn room(&mut self, part: Part, n: usize, l: &Limits) -> Room {
        let now = self.part(part);
        if n <= now {
            self.set(part, n);
            return Room::Fits;
        }
        let more = n - now;
        let want = self.held() + more;
        if self.own {
            // Counted first, then checked: two connections racing for the last room cannot
            // both pass; the one that does not fit takes its count back.
            let own = self.memory.own.fetch_add(more, Ordering::Relaxed) + more;
            if own > l.own_budget {
                self.memory.own.fetch_sub(more, Ordering::Relaxed);
                return Room::Later(format!(
                    "nrun's own connections' budget ({} bytes)",
                    l.own_budget
                ));
            }
            *self.part_mut(part) = n;
            return Room::Fits;
        }
        // Small holdings (every ordinary request and reply) may use the whole pool; larger
        // ones all but a reserve, which the many small ones (the job's ranks) keep to
        // themselves, however many large ones strangers hold.
        let small = want <= SMALL;
        let pool_cap = match small {
            true => l.memory_budget,
            false => l.memory_budget - l.memory_budget / RESERVE_DIV,
        };
        let most = l.conn_budget.min(l.peer_budget).min(pool_cap);
        if !small && want > most {
            return Room::Never(format!(
                "{want} bytes are past what one connection without nrun's secret may hold \
                 ({most} bytes: the least of its own, its address's and all such \
                 connections' budgets)"
            ));
        }
        let pool = self.memory.strangers.fetch_add(more, Ordering::Relaxed) + more;
        let peer = self.peer.fetch_add(more, Ordering::Relaxed) + more;
        let full = if pool > pool_cap {
            Some(format!(
                "the budget of all clients without nrun's secret ({pool_cap} bytes{})",
                if small {
                    ""
                } else {
                    " for holdings over 4 KiB"
                }
            ))
        } else if !small && peer > l.peer_budget {
            Some(format!(
                "the budget of one address's clients ({} bytes)",
                l.peer_budget
            ))
        } else {
            None
        };
        if let Some(which) = full {
            self.memory.strangers.fetch_sub(more, Ordering::Relaxed);
            self.peer.fetch_sub(more, Ordering::Relaxed);
            return Room::Later(which);
        }
        *self.part_mut(part) = n;
        Room::Fits
    }

    /// Counts `part` as holding `n` bytes, unchecked: what a connection gives back, or the
    /// slack of a small reply's growth after it was asked for.
    pub(super) fn set(&mut self, part: Part, n: usize) {
        let now = self.part(part);
        if n == now {
            return;
        }
        if n > now {
            self.add(n - now);
        } else {
            self.sub(now - n);
        }
        *self.part_mut(part) = n;
    }

    /// The connection proved nrun's secret: what it holds moves to nrun's own pool.
    pub(super) fn promote(&mut self) {
        if self.own {
            return;
        }
        let n = self.held();
        self.sub(n);
        self.own = true;
        self.add(n);
    }

    fn part(&self, part: Part) -> usize {
        match part {
            Part::Read => self.read,
            Part::Out => self.out,
        }
    }

    fn part_mut(&mut self, part: Part) -> &mut usize {
        match part {
            Part::Read => &mut self.read,
            Part::Out => &mut self.out,
        }
    }

    fn add(&self, n: usize) {
        if self.own {
            self.memory.own.fetch_add(n, Ordering::Relaxed);
        } else {
            self.memory.strangers.fetch_add(n, Ordering::Relaxed);
            self.peer.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn sub(&self, n: usize) {
        if self.own {
            self.memory.own.fetch_sub(n, Ordering::Relaxed);
        } else {
            self.memory.strangers.fetch_sub(n, Ordering::Relaxed);
            self.peer.fetch_sub(n, Ordering::Relaxed);
        }
    }
}

impl Drop for Account<'_> {
    fn drop(&mut self) {
        self.sub(self.held());
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

    /// One budget for what connections hold: strangers of one address share theirs (loopback
    /// addresses each their own), every stranger shares the pool, whose last quarter only small
    /// holdings use; nothing past a connection's most is ever counted; nrun's own connections
    /// have a pool strangers cannot fill; and what a connection gives back is room for others.
    #[test]
    fn connections_share_one_memory_budget() {
        let k = 1 << 10;
        let l = Limits {
            conn_budget: 300 * k,
            peer_budget: 200 * k,
            memory_budget: 400 * k,
            own_budget: 100 * k,
            ..Limits::default()
        };
        let memory = Memory::default();
        let mut c = Conns::default();
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let lives: Vec<_> = [a, a, b, b, b]
            .iter()
            .enumerate()
            .map(|(i, ip)| c.admit(i as u64, *ip, 10, 100).unwrap())
            .collect();
        let mut acct: Vec<_> = lives.iter().map(|l| Account::new(&memory, l)).collect();
        assert_eq!(acct[0].room(Part::Read, 150 * k, &l), Room::Fits);
        // Its address has 50 KiB left: the second connection of `a` does not fit, whether it
        // reads or replies.
        assert!(matches!(
            acct[1].room(Part::Read, 100 * k, &l),
            Room::Later(_)
        ));
        assert!(matches!(
            acct[1].room(Part::Out, 100 * k, &l),
            Room::Later(_)
        ));
        // Another address has its own share, within the pool's 300 KiB for large holdings.
        assert_eq!(acct[2].room(Part::Out, 100 * k, &l), Room::Fits);
        assert!(matches!(
            acct[3].room(Part::Read, 60 * k, &l),
            Room::Later(_)
        ));
        // Small holdings fit in the reserved quarter; past a connection's most, never.
        assert_eq!(acct[3].room(Part::Read, 4 * k, &l), Room::Fits);
        assert!(matches!(
            acct[4].room(Part::Read, 250 * k, &l),
            Room::Never(_)
        ));
        assert_eq!(memory.held(), 254 * k);
        // An agent (it proved the secret) is counted in its own pool: strangers holding theirs
        // do not hold it up, and it never takes theirs.
        let agent = c.admit(9, b, 10, 100).unwrap();
        let mut own = Account::new(&memory, &agent);
        assert_eq!(own.room(Part::Read, 512, &l), Room::Fits);
        own.promote();
        assert_eq!(own.room(Part::Out, 90 * k, &l), Room::Fits);
        assert!(matches!(own.room(Part::Out, 120 * k, &l), Room::Later(_)));
        assert_eq!(lives[2].peer_held.load(Ordering::Relaxed), 104 * k);
        drop(own);
        // Given back: the room is the others'.
        acct[0].set(Part::Read, 512);
        assert_eq!(acct[1].room(Part::Read, 100 * k, &l), Room::Fits);
        drop(acct);
        assert_eq!(memory.held(), 0);
        assert_eq!(lives[0].peer_held.load(Ordering::Relaxed), 0);
    }
}
