//! The TCPStore server: a tokio task per connection over one shared key-value state.
//!
//! The state sits behind a std `Mutex`: no `.await` happens while it is held and every operation
//! is a few hash-map steps, so an async lock would only add cost. Replies are written only by the
//! connection's own task, in request order; a WAIT or BARRIER that cannot finish at once parks
//! the connection, and whoever later completes it sends a STOP_WAITING byte through that
//! connection's channel. Keeping every write in one task is what makes the CANCEL_WAIT race come
//! out right: a STOP_WAITING already queued is written before the WAIT_CANCELED reply.
//!
//! That task serves the requests it has buffered only while their replies fit the connection's
//! memory budget, sized and counted before each is built (its own share, its address's, the
//! store's), then writes them before reading or serving more: a client that pipelines GETs of
//! a large value without reading holds one budget's worth of replies, not all of them, and no
//! number of such connections holds more than the store's. Its read buffer is counted in the
//! same budget before it grows (see [`conns`], with what else a client may hold: time,
//! connections).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::protocol::{
    FrameScan, Parsed, ProtocolError, Request, STOP_WAITING, Scanned, VALIDATE_MAGIC, put_bytes,
};

mod cmd;
mod conns;

pub use conns::Limits;
use conns::{Account, Conns, EVICT, Live, Memory, Part, Room, SMALL};

type ConnId = u64;

/// A connection parked in WAIT or BARRIER.
struct Parked {
    /// Distinguishes this wait from earlier ones of the same connection, whose entries in
    /// `watchers` may still linger after a CANCEL_WAIT.
    generation: u64,
    /// Keys still missing (WAIT); barriers complete all at once instead.
    remaining: usize,
    wake: mpsc::UnboundedSender<u8>,
    /// The keys it is listed under (in `watchers`, or its barrier key in `barriers`), so a
    /// cancelled wait or a closed connection leaves nothing behind.
    keys: Vec<Vec<u8>>,
    barrier: bool,
    /// What its keys cost while it waits (counted in `State::waiting`).
    cost: usize,
}

/// A stored value and the address that wrote it last: its whole cost counts in that address's
/// share of --store-max-bytes ([`State::by_owner`]).
struct Value {
    bytes: Vec<u8>,
    owner: IpAddr,
}

/// A queue, with the address that made it (its key's cost counts in that address's share);
/// each item counts in its pusher's.
struct Queue {
    owner: IpAddr,
    items: VecDeque<Value>,
}

/// The owner of what nrun writes in-process (the coordinator's own keys).
const NRUN: IpAddr = IpAddr::V6(Ipv6Addr::UNSPECIFIED);

#[derive(Default)]
struct State {
    kv: HashMap<Vec<u8>, Value>,
    queues: HashMap<Vec<u8>, Queue>,
    /// key -> waits that still miss it.
    watchers: HashMap<Vec<u8>, Vec<(ConnId, u64)>>,
    parked: HashMap<ConnId, Parked>,
    /// barrier key -> waits parked on it.
    barriers: HashMap<Vec<u8>, Vec<(ConnId, u64)>>,
    /// Bytes held by parked waits' keys (each listed twice: in the wait and in `watchers`).
    waiting: usize,
    /// Bytes held in clients' keys, values and queued items, each entry with its
    /// [`ENTRY_COST`] or [`ITEM_COST`] (checked against the store's cap, --store-max-bytes).
    bytes: usize,
    /// The same for nrun's own keys (`nrun/`), checked against their own reserved budget
    /// ([`CONTROL_MAX_BYTES`]): clients filling the store never make the control plane fail.
    control: usize,
    /// `bytes` by the address that wrote them: who filled the store, refused past
    /// [`RESERVE_DIV`]'s mark while others' small writes go on (see `Store::check_room`).
    by_owner: HashMap<IpAddr, usize>,
}

/// What a key (of the map or a queue) costs beyond its bytes: the map's slot, the vectors'
/// headers, the allocator's rounding. Counted so that many empty values still fill the cap.
const ENTRY_COST: usize = 64;
/// What a queued item costs beyond its bytes.
const ITEM_COST: usize = 32;

impl State {
    /// Counts `n` bytes of `key`'s (nrun's own, or a client's, in its owner's share).
    fn charge(&mut self, control: bool, owner: IpAddr, n: usize) {
        if control {
            self.control += n;
        } else {
            self.bytes += n;
            *self.by_owner.entry(owner).or_default() += n;
        }
    }

    /// Gives back `n` bytes counted by [`State::charge`].
    fn credit(&mut self, control: bool, owner: IpAddr, n: usize) {
        if control {
            self.control = self.control.saturating_sub(n);
            return;
        }
        self.bytes = self.bytes.saturating_sub(n);
        if let Some(held) = self.by_owner.get_mut(&owner) {
            *held = held.saturating_sub(n);
            if *held == 0 {
                self.by_owner.remove(&owner);
            }
        }
    }

    /// Stores `value` under `key` for `owner`, keeping the byte counts.
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>, owner: IpAddr) {
        let (klen, control) = (key.len(), is_control(&key));
        let added = ENTRY_COST + klen + value.len();
        let old = self.kv.insert(
            key,
            Value {
                bytes: value,
                owner,
            },
        );
        if let Some(old) = old {
            self.credit(control, old.owner, ENTRY_COST + klen + old.bytes.len());
        }
        self.charge(control, owner, added);
    }

    fn remove(&mut self, key: &[u8]) -> bool {
        match self.kv.remove(key) {
            Some(old) => {
                let n = ENTRY_COST + key.len() + old.bytes.len();
                self.credit(is_control(key), old.owner, n);
                true
            }
            None => false,
        }
    }

    /// The byte counts from scratch (after a clear).
    fn recount(&mut self) {
        (self.bytes, self.control) = (0, 0);
        self.by_owner.clear();
        let mut counts = Vec::new();
        for (k, v) in &self.kv {
            counts.push((is_control(k), v.owner, ENTRY_COST + k.len() + v.bytes.len()));
        }
        for (k, q) in &self.queues {
            counts.push((is_control(k), q.owner, ENTRY_COST + k.len()));
            for v in &q.items {
                counts.push((is_control(k), v.owner, ITEM_COST + v.bytes.len()));
            }
        }
        for (control, owner, n) in counts {
            self.charge(control, owner, n);
        }
    }

    /// Takes connection `conn`'s parked wait, giving back what its keys cost.
    fn unpark(&mut self, conn: ConnId) -> Option<Parked> {
        let p = self.parked.remove(&conn)?;
        self.waiting = self.waiting.saturating_sub(p.cost);
        Some(p)
    }

    /// Drops connection `conn`'s pending WAIT or BARRIER and every entry listing it.
    fn forget_wait(&mut self, conn: ConnId) {
        let Some(p) = self.unpark(conn) else {
            return;
        };
        let lists = if p.barrier {
            &mut self.barriers
        } else {
            &mut self.watchers
        };
        for k in &p.keys {
            if let Some(list) = lists.get_mut(k) {
                list.retain(|(c, g)| !(*c == conn && *g == p.generation));
                if list.is_empty() {
                    lists.remove(k);
                }
            }
        }
    }

    fn exists(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.items.is_empty())
    }

    /// A key was written: every wait that missed it has one key fewer to wait for. `only_one`
    /// serves queue pushes, which satisfy a single blocked pop.
    fn written(&mut self, key: &[u8], only_one: bool) {
        let Some(mut list) = self.watchers.remove(key) else {
            return;
        };
        let mut woken = 0;
        let mut i = 0;
        while i < list.len() {
            if only_one && woken == 1 {
                break;
            }
            let (conn, generation) = list[i];
            i += 1;
            let Some(p) = self.parked.get_mut(&conn) else {
                continue;
            };
            if p.generation != generation {
                continue;
            }
            p.remaining -= 1;
            woken += 1;
            if p.remaining == 0
                && let Some(p) = self.unpark(conn)
            {
                let _ = p.wake.send(STOP_WAITING);
            }
        }
        if i < list.len() {
            list.drain(..i);
            self.watchers.insert(key.to_vec(), list);
        }
    }

    fn counter(&self, key: &[u8]) -> Result<i64, Refusal> {
        match self.kv.get(key) {
            None => Ok(0),
            Some(v) => std::str::from_utf8(&v.bytes)
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .ok_or_else(|| {
                    format!(
                        "ADD on key {} whose value is not a decimal counter",
                        String::from_utf8_lossy(key)
                    )
                    .into()
                }),
        }
    }

    fn add(&mut self, key: &[u8], delta: i64, owner: IpAddr) -> Result<i64, Refusal> {
        let v = self.counter(key)?.wrapping_add(delta);
        self.put(key.to_vec(), v.to_string().into_bytes(), owner);
        self.written(key, false);
        Ok(v)
    }
}

/// The store shared by all connections.
#[derive(Default)]
pub struct Store {
    state: Mutex<State>,
    next_conn: AtomicU64,
    next_wait: AtomicU64,
    /// With a secret, keys under `nrun/` (nrun's own control plane) are reserved to connections
    /// that presented it: torch workers can neither read nor write them.
    secret: Option<Vec<u8>>,
    /// Bumped whenever a client SETs one of nrun's keys: the coordinator waits on this instead
    /// of polling for its agents' records.
    control_writes: watch::Sender<u64>,
    /// Which of nrun's keys clients set since the coordinator last asked ([`Store::take_changes`]):
    /// it looks again at those nodes only, not at every node on every write.
    changes: Mutex<Changes>,
    /// Serve only clients on this host (a single node's store): others are closed at accept.
    loopback_only: std::sync::atomic::AtomicBool,
    /// Most bytes clients may store (keys, values, queued items); 0: no cap.
    max_bytes: AtomicU64,
    /// Budgets, timeouts and connection caps (see [`Limits`]).
    limits: Mutex<Limits>,
    /// Every open connection, by peer address (the caps, and who is closed first).
    conns: Mutex<Conns>,
    /// What connections hold (read buffers, requests being applied, replies), counted by
    /// each connection's [`Account`].
    memory: Memory,
    /// Told when a connection gives back a large share of [`Store::memory`]: whoever waits
    /// for room for a reply asks again.
    freed: tokio::sync::Notify,
    /// Most bytes nrun's own keys may hold ([`CONTROL_MAX_BYTES`]), apart from clients'.
    control_max: AtomicU64,
    /// [`Limits::wait_budget`], where the state's lock holder reads it.
    wait_budget: AtomicUsize,
    /// The socket of the connection that tied each key to itself ([`LIVE_SUFFIX`]), for
    /// [`Store::tied_link`]: forgotten (under this lock) before that socket is closed, so the
    /// descriptor read is never another's.
    tied: Mutex<HashMap<Vec<u8>, (ConnId, std::os::fd::RawFd)>>,
}

/// The kernel's view of a connection (TCP_INFO), as [`Store::tied_link`] gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkView {
    /// The connection is established (not closing, not closed by the peer).
    pub established: bool,
    /// Since the peer last sent data.
    pub since_received: Duration,
    /// Since this end last sent data (a reply).
    pub since_sent: Duration,
    /// Segments this end sent that the peer's host has not acknowledged.
    pub unacked: u32,
}

impl LinkView {
    /// Whether the peer spoke after this end last did: its request is this end's to answer.
    pub fn awaits_reply(&self) -> bool {
        self.since_received < self.since_sent
    }
}

/// Reads TCP_INFO of socket `fd`.
fn link_view(fd: std::os::fd::RawFd) -> Option<LinkView> {
    // SAFETY: tcp_info is plain data; the kernel fills at most `len` bytes of it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket of this store (see `Store::tied`), `info` is `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    (r == 0).then(|| LinkView {
        // TCP_ESTABLISHED is 1 in Linux's tcp_states.h.
        established: info.tcpi_state == 1,
        since_received: Duration::from_millis(info.tcpi_last_data_recv.into()),
        since_sent: Duration::from_millis(info.tcpi_last_data_sent.into()),
        unacked: info.tcpi_unacked,
    })
}

/// nrun's keys that clients set, in order, until the coordinator takes them.
#[derive(Default, Debug)]
pub struct Changes {
    pub keys: Vec<Vec<u8>>,
    /// More were set than [`MAX_CHANGES`] (nobody took them for a while): the taker must look
    /// at everything.
    pub overflowed: bool,
}

/// Keys kept for [`Store::take_changes`] (a few MiB at most): past it, only "look at
/// everything" is kept.
const MAX_CHANGES: usize = 1 << 16;

/// Prefix of nrun's own keys.
pub(crate) const CONTROL_PREFIX: &[u8] = b"nrun/";
/// GET this key for a challenge (a fresh nonce for this connection), then SET [`AUTH_KEY`] to
/// the proof of the secret over it (see `store::auth`); neither is stored.
pub const CHALLENGE_KEY: &[u8] = b"nrun/challenge";
pub const AUTH_KEY: &[u8] = b"nrun/auth";
/// A GET of this prefix and a client's own challenge (hex) is answered with the store's proof
/// of the secret over it ([`super::auth::prove_store`]): the client checks the store too.
pub const STORE_PROOF_PREFIX: &[u8] = b"nrun/store-proof/";
/// A SET under this prefix stores the address the server sees the connection come from, not
/// the value sent: how an agent learns whether NAT sits between it and the coordinator.
pub const OBSERVE_PREFIX: &[u8] = b"nrun/observed/";

/// A control key ending in this that a connection ADDs to is that connection's:
/// the store removes it when the connection closes (as ZooKeeper's ephemeral nodes). An
/// agent's heartbeat counter is such a key, so an agent that ends or is killed (its socket
/// closed by its kernel) is known at once, not after its heartbeat has been silent a while.
pub const LIVE_SUFFIX: &[u8] = b"/alive";

/// Keys one connection may tie to itself ([`LIVE_SUFFIX`]): an agent needs one.
const MAX_LIVE_KEYS: usize = 4;

/// The per-connection part of the protocol state.
struct Conn {
    id: ConnId,
    validated: bool,
    authed: bool,
    /// The keys removed when this connection closes ([`LIVE_SUFFIX`]).
    live_keys: Vec<Vec<u8>>,
    /// Its socket, for the kernel's view of it ([`Store::tied_link`]).
    fd: std::os::fd::RawFd,
    /// The challenge this connection was given, until it answers.
    nonce: Option<Vec<u8>>,
    peer: SocketAddr,
    /// Its address, as the store's shares count it (the owner of what it writes).
    owner: IpAddr,
    wake: mpsc::UnboundedSender<u8>,
    /// What the connection caps see of this connection.
    live: Arc<Live>,
    /// The limits it started with.
    limits: Limits,
}

fn is_control(key: &[u8]) -> bool {
    key.starts_with(CONTROL_PREFIX)
}

/// nrun's keys anyone may read (never write) without the secret: what an nrun that connects
/// needs to know before it can prove anything, namely whether this store is an nrun's and which
/// c10d rendezvous it hosts (so a node of another job, or of another launcher, is told so).
pub(crate) const PUBLIC_PREFIX: &[u8] = b"nrun/public/";

/// A key a read request may name without the secret: not nrun's, or nrun's public ones.
fn readable(key: &[u8]) -> bool {
    !is_control(key) || key.starts_with(PUBLIC_PREFIX)
}

/// Whether a request names any of nrun's control keys.
fn touches_control(req: &Request) -> bool {
    match req {
        Request::Get { key } => !readable(key),
        Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
            !keys.iter().all(|k| readable(k))
        }
        Request::Set { key, .. }
        | Request::CompareSet { key, .. }
        | Request::Add { key, .. }
        | Request::DeleteKey { key }
        | Request::Append { key, .. }
        | Request::QueuePush { key, .. }
        | Request::QueuePop { key }
        | Request::QueueLen { key }
        | Request::Barrier { key, .. } => is_control(key),
        Request::MultiSet { pairs } => pairs.iter().any(|(k, _)| is_control(k)),
        Request::Validate { .. }
        | Request::GetNumKeys
        | Request::CancelWait
        | Request::Ping { .. }
        | Request::ListKeys => false,
    }
}

/// Why the store closes a client's connection: logged (rate-limited), and the client sees its
/// connection close, as PyTorch's own server does with a request it cannot serve.
#[derive(Debug)]
pub(super) struct Refusal(String);

impl From<String> for Refusal {
    fn from(s: String) -> Refusal {
        Refusal(s)
    }
}

impl From<&str> for Refusal {
    fn from(s: &str) -> Refusal {
        Refusal(s.to_string())
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Store {
    pub fn new() -> Arc<Store> {
        Store::build(None)
    }

    /// A store whose `nrun/` keys need `secret` (see [`AUTH_KEY`]).
    pub fn with_secret(secret: Vec<u8>) -> Arc<Store> {
        Store::build(Some(secret))
    }

    fn build(secret: Option<Vec<u8>>) -> Arc<Store> {
        Arc::new(Store {
            secret,
            max_bytes: AtomicU64::new(DEFAULT_MAX_BYTES),
            control_max: AtomicU64::new(CONTROL_MAX_BYTES),
            ..Store::default()
        })
    }

    /// Caps what clients may store: a write past it fails that client, not the store.
    pub fn set_max_bytes(&self, max: u64) {
        self.max_bytes.store(max, Ordering::Relaxed);
    }

    /// Replaces the budgets, timeouts and connection caps (before serving: open connections
    /// keep the limits they started with).
    pub fn set_limits(&self, limits: Limits) {
        self.wait_budget
            .store(limits.wait_budget, Ordering::Relaxed);
        *self.limits.lock().unwrap_or_else(|e| e.into_inner()) = limits;
    }

    fn wait_budget(&self) -> usize {
        match self.wait_budget.load(Ordering::Relaxed) {
            0 => Limits::default().wait_budget,
            n => n,
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Open connections (tests, diagnostics).
    pub fn connections(&self) -> usize {
        self.conns_lock().total()
    }

    fn conns_lock(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serve clients on this host only: a single node's workers reach the store over loopback,
    /// and nothing on the network should reach it at all.
    pub fn loopback_only(&self) {
        self.loopback_only
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Changes whenever a client has set one of nrun's own keys (`nrun/...`).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.control_writes.subscribe()
    }

    /// Sets a key in-process (the coordinator's own writes), waking waiters.
    pub fn set(&self, key: &[u8], value: &[u8]) {
        let mut s = self.lock();
        s.put(key.to_vec(), value.to_vec(), NRUN);
        s.written(key, false);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that
        // matters more than losing the store, so keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets every key, queue and wait: used between restart attempts so a new attempt never
    /// reads the previous attempt's rendezvous keys (torch >= 2.6 does not prefix them).
    pub fn clear(&self) {
        *self.lock() = State::default();
    }

    /// Forgets every key but nrun's own (`nrun/`): between restart attempts of a multi-node
    /// job, whose agents keep using their control keys.
    pub fn clear_user_keys(&self) {
        let mut s = self.lock();
        s.kv.retain(|k, _| is_control(k));
        s.queues.clear();
        s.recount();
    }

    /// A key's value, read in-process.
    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.lock().kv.get(key).map(|v| v.bytes.clone())
    }

    /// Whether `key` is set (nothing copied).
    pub fn contains(&self, key: &[u8]) -> bool {
        self.lock().kv.contains_key(key)
    }

    /// Pending waits, and the watcher and barrier entries listing them (tests, diagnostics):
    /// all three drop to 0 once every wait has ended, been cancelled or lost its connection.
    pub fn pending_waits(&self) -> (usize, usize, usize) {
        let s = self.lock();
        (
            s.parked.len(),
            s.watchers.values().map(Vec::len).sum(),
            s.barriers.values().map(Vec::len).sum(),
        )
    }

    /// Bytes all connections hold: read buffers, requests being applied, replies not yet
    /// written (tests, diagnostics).
    pub fn held_bytes(&self) -> usize {
        self.memory.held()
    }

    /// Bytes counted against --store-max-bytes (tests, diagnostics).
    pub fn stored_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Number of keys, as GETNUMKEYS would answer.
    pub fn num_keys(&self) -> usize {
        self.lock().kv.len()
    }

    /// Forgets connection `conn`: its parked wait, and the keys it tied to itself.
    fn disconnect(&self, conn: ConnId, live_keys: &[Vec<u8>]) {
        {
            let mut tied = self.tied_lock();
            for k in live_keys {
                if tied.get(k).is_some_and(|(c, _)| *c == conn) {
                    tied.remove(k);
                }
            }
        }
        let mut s = self.lock();
        s.forget_wait(conn);
        for k in live_keys {
            s.remove(k);
        }
        drop(s);
        for k in live_keys {
            self.changed(k.clone());
        }
        if !live_keys.is_empty() {
            // Whoever watches nrun's keys looks again (the coordinator, at that node).
            self.control_writes.send_modify(|v| *v += 1);
        }
    }

    /// Applies one request, appending its reply (if any) to `out`. An `Err` closes the
    /// connection with that message; `Ok(Some(req))` gives the request back unserved: its reply
    /// does not fit the connection's memory budget yet (see [`conns`]).
    fn apply(
        &self,
        c: &mut Conn,
        req: Request,
        out: &mut Vec<u8>,
        acct: &mut Account<'_>,
    ) -> Result<Option<Request>, Refusal> {
        let control = match &req {
            Request::Set { key, .. } if is_control(key) => Some(key.clone()),
            _ => None,
        };
        let live = match &req {
            // Whoever may write nrun's keys (with the secret, or any client of a store without
            // one, as torch's) may tie one: the write itself is checked as any other.
            Request::Add { key, .. }
                if is_control(key)
                    && key.ends_with(LIVE_SUFFIX)
                    && c.live_keys.len() < MAX_LIVE_KEYS
                    && !c.live_keys.contains(key) =>
            {
                Some(key.clone())
            }
            _ => None,
        };
        let r = self.apply_request(c, req, out, acct);
        let served = matches!(r, Ok(None));
        if let (Some(key), true) = (live, served) {
            self.tied_lock().insert(key.clone(), (c.id, c.fd));
            c.live_keys.push(key);
        }
        // After the write, so whoever wakes finds it.
        if let (Some(key), true) = (control, served) {
            self.changed(key);
            self.control_writes.send_modify(|v| *v += 1);
        }
        r
    }

    fn changed(&self, key: Vec<u8>) {
        let mut c = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        if c.keys.len() < MAX_CHANGES {
            c.keys.push(key);
        } else {
            c.overflowed = true;
            c.keys = Vec::new();
        }
    }

    fn tied_lock(&self) -> MutexGuard<'_, HashMap<Vec<u8>, (ConnId, std::os::fd::RawFd)>> {
        self.tied.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The kernel's view of the connection that tied `key` to itself ([`LIVE_SUFFIX`]): None
    /// when no open connection holds it. The coordinator asks it of an agent whose heartbeat is
    /// still: whether that agent's host sent anything lately, or waits on this one.
    pub fn tied_link(&self, key: &[u8]) -> Option<LinkView> {
        let tied = self.tied_lock();
        let (_, fd) = tied.get(key)?;
        link_view(*fd)
    }

    /// nrun's keys clients set since the last call, for the coordinator (see [`Changes`]).
    pub fn take_changes(&self) -> Changes {
        std::mem::take(&mut *self.changes.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Who may ask and whether it fits are settled here, in this order: VALIDATE first, then
    /// nrun's secret for its own keys, then the byte cap; each verb is then served by its own
    /// function in [`cmd`].
    fn apply_request(
        &self,
        c: &mut Conn,
        req: Request,
        out: &mut Vec<u8>,
        acct: &mut Account<'_>,
    ) -> Result<Option<Request>, Refusal> {
        if !c.validated {
            validate_first(c, req)?;
            return Ok(None);
        }
        if let Some(secret) = &self.secret
            && authenticate(secret, c, &req, out)?
        {
            return Ok(None);
        }
        let req = observed(c, req);
        let mut s = self.lock();
        self.check_room(&s, &req, c.owner)?;
        let s = &mut *s;
        // Without the secret, nrun's own keys are neither listed nor counted.
        let hide = self.secret.is_some() && !c.authed;
        // The reply is sized and counted before a byte of it is built.
        let size = cmd::reply_size(s, &req, hide);
        let want = out.len().saturating_add(size);
        if want > out.capacity() {
            // Past the connection's own share of queued replies, what is queued is written
            // first.
            if !out.is_empty() && want > c.limits.out_budget {
                return Ok(Some(req));
            }
            match acct.room(Part::Out, want, &c.limits) {
                Room::Fits => {}
                Room::Later(_) => return Ok(Some(req)),
                Room::Never(why) => return Err(format!("a reply of {size} bytes: {why}").into()),
            }
            // Exactly what was counted: the reply is built in it without growing it.
            out.try_reserve_exact(want - out.len())
                .map_err(|_| format!("cannot allocate a reply of {size} bytes"))?;
        }
        match req {
            Request::Validate { magic } => cmd::validate(magic)?,
            Request::Set { key, value } => cmd::set(s, key, value, c.owner),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => cmd::compare_set(s, key, expected, desired, c.owner, out),
            Request::Get { key } => cmd::get(s, &key, out),
            Request::Add { key, delta } => cmd::add(s, &key, delta, c.owner, out)?,
            Request::Check { keys } => cmd::check(s, &keys, out),
            Request::Wait { keys } => {
                cmd::wait(s, c, &self.next_wait, keys, self.wait_budget(), out)?
            }
            Request::GetNumKeys => cmd::get_num_keys(s, hide, out),
            Request::DeleteKey { key } => cmd::delete_key(s, &key, out),
            Request::Append { key, value } => cmd::append(s, key, value, c.owner)?,
            Request::MultiGet { keys } => cmd::multi_get(s, &keys, out),
            Request::MultiSet { pairs } => cmd::multi_set(s, pairs, c.owner),
            Request::CancelWait => cmd::cancel_wait(s, c, out),
            Request::Ping { nonce } => cmd::ping(nonce, out),
            Request::QueuePush { key, value } => cmd::queue_push(s, key, value, c.owner),
            Request::QueuePop { key } => cmd::queue_pop(s, &key, out),
            Request::QueueLen { key } => cmd::queue_len(s, &key, out),
            Request::ListKeys => cmd::list_keys(s, hide, out),
            Request::Barrier { key, world_size } => {
                cmd::barrier(s, c, &self.next_wait, key, world_size, out)?
            }
        }
        Ok(None)
    }

    /// Refuses a write that would take clients' keys past --store-max-bytes (0: no cap), or
    /// nrun's own keys past their reserved budget: each class fills only itself, so a client
    /// filling the store fails that client, never nrun's control plane. Within clients' keys,
    /// the last quarter of the cap is kept for addresses holding little (each under a 64th of
    /// it: the job's ranks, whose keys are a rendezvous's and a few barriers'): the address that
    /// filled the store is refused there, while the others' writes go on.
    fn check_room(&self, s: &State, req: &Request, owner: IpAddr) -> Result<(), Refusal> {
        // (clients' bytes, nrun's bytes) the write may add.
        let mut incoming = (0usize, 0usize);
        let mut add = |key: &[u8], n: usize| match is_control(key) {
            true => incoming.1 += n,
            false => incoming.0 += n,
        };
        match req {
            Request::Set { key, value } | Request::Append { key, value } => {
                add(key, ENTRY_COST + key.len() + value.len())
            }
            Request::CompareSet { key, desired, .. } => {
                add(key, ENTRY_COST + key.len() + desired.len())
            }
            Request::QueuePush { key, value } => {
                add(key, ENTRY_COST + ITEM_COST + key.len() + value.len())
            }
            // A counter: at most 20 decimal digits.
            Request::Add { key, .. } | Request::Barrier { key, .. } => {
                add(key, ENTRY_COST + key.len() + 20)
            }
            Request::MultiSet { pairs } => {
                for (k, v) in pairs {
                    add(k, ENTRY_COST + k.len() + v.len());
                }
            }
            _ => {}
        }
        let max = self.max_bytes.load(Ordering::Relaxed) as usize;
        let after = s.bytes.saturating_add(incoming.0);
        if incoming.0 > 0 && max > 0 && after > max {
            return Err(format!(
                "the store is full: {} bytes held, {} more asked, limit {max} \
                 (--store-max-bytes)",
                s.bytes, incoming.0
            )
            .into());
        }
        let mine = s.by_owner.get(&owner).copied().unwrap_or(0) + incoming.0;
        let (reserve, small) = (max / RESERVE_DIV, max / SMALL_SHARE_DIV);
        if incoming.0 > 0 && max > 0 && after > max - reserve && mine > small {
            return Err(format!(
                "the store is full but for its reserve: {} bytes held, {} more asked, limit \
                 {max} (--store-max-bytes), of which the last {reserve} are kept for clients \
                 whose address holds under {small} bytes; {owner} holds {}",
                s.bytes,
                incoming.0,
                mine - incoming.0
            )
            .into());
        }
        let control_max = self.control_max.load(Ordering::Relaxed) as usize;
        if incoming.1 > 0 && s.control.saturating_add(incoming.1) > control_max {
            return Err(format!(
                "nrun's own keys are full: {} bytes held, {} more asked, limit {control_max} \
                 (nrun's reserved budget, apart from --store-max-bytes)",
                s.control, incoming.1
            )
            .into());
        }
        Ok(())
    }
}

/// A connection's first request must be VALIDATE with torch's magic.
fn validate_first(c: &mut Conn, req: Request) -> Result<(), Refusal> {
    match req {
        Request::Validate {
            magic: VALIDATE_MAGIC,
        } => {
            c.validated = true;
            Ok(())
        }
        _ => Err(PRE_2_2.into()),
    }
}

/// nrun's secret, by challenge and response (the secret itself never crosses the wire): a GET
/// of [`CHALLENGE_KEY`], a SET of [`AUTH_KEY`] or a GET under [`STORE_PROOF_PREFIX`] (the store
/// proving the secret to a client) is answered here (`Ok(true)`); any other
/// request may go on (`Ok(false)`) unless it touches `nrun/` keys without the secret.
fn authenticate(
    secret: &[u8],
    c: &mut Conn,
    req: &Request,
    out: &mut Vec<u8>,
) -> Result<bool, Refusal> {
    if let Request::Get { key } = req {
        if let Some(theirs) = key.strip_prefix(STORE_PROOF_PREFIX) {
            if theirs.is_empty() || theirs.len() > 256 {
                return Err("a challenge to the store must be 1 to 256 bytes".into());
            }
            put_bytes(out, &super::auth::prove_store(secret, theirs));
            return Ok(true);
        }
        if key == CHALLENGE_KEY {
            let nonce = super::auth::nonce().map_err(|e| format!("no challenge: {e}"))?;
            put_bytes(out, &nonce);
            c.nonce = Some(nonce);
            return Ok(true);
        }
    }
    if let Request::Set { key, value } = req
        && key == AUTH_KEY
    {
        let proven = c
            .nonce
            .take()
            .is_some_and(|n| super::auth::verify(secret, &n, value));
        if proven {
            c.authed = true;
            return Ok(true);
        }
        return Err("wrong proof of nrun's secret for its control keys".into());
    }
    if !c.authed && touches_control(req) {
        return Err(
            "a connection without nrun's secret touched nrun's control keys (nrun/...)".into(),
        );
    }
    Ok(false)
}

/// A SET under [`OBSERVE_PREFIX`] stores the address the connection comes from instead of its
/// value.
fn observed(c: &Conn, req: Request) -> Request {
    match req {
        Request::Set { key, .. } if key.starts_with(OBSERVE_PREFIX) => {
            let seen = nrun_base::net::canonical(c.peer.ip());
            Request::Set {
                key,
                value: seen.to_string().into_bytes(),
            }
        }
        r => r,
    }
}

/// Starting size of a connection's read buffer: requests are mostly tens of bytes, and with
/// tens of thousands of connections a larger start costs real memory. It grows on demand.
const INITIAL_BUFFER: usize = 512;
/// What clients may store by default (--store-max-bytes): generous, but not the whole machine.
pub const DEFAULT_MAX_BYTES: u64 = 4 << 30;
/// The part of --store-max-bytes (a quarter) that only addresses holding little may fill.
const RESERVE_DIV: usize = 4;
/// What "little" is: under this part of --store-max-bytes (a 64th) for all of an address's keys.
const SMALL_SHARE_DIV: usize = 64;
/// What nrun's own keys (agents' records and heartbeats, steps, results, views) may hold,
/// reserved apart from --store-max-bytes. Only nrun writes them where the run has a secret.
pub(crate) const CONTROL_MAX_BYTES: u64 = 512 << 20;
/// Time a new connection has to send VALIDATE before it is closed.
const HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(10);

const PRE_2_2: &str = "first request is not VALIDATE: a torch client older than 2.2 (or not a \
TCPStore client at all); nrun's store works with torch 2.2 and newer";

/// Binds the store's listening socket: dual-stack `[::]` where IPv6 exists, else `0.0.0.0`,
/// with a large backlog set explicitly (tokio's default of 128 makes the kernel reset clients
/// when thousands connect at once). Port 0 picks a free port, and the socket stays bound for
/// the whole job, so nothing can take the port between choosing and using it.
///
/// Torch clients that arrive in hundreds can still take 5 s each to connect, whatever store they
/// reach: each first asks DNS for the store's name (c10d formats the address it is about to
/// connect to with `getnameinfo`), and a DNS server that drops part of the burst costs glibc's
/// 5 s resolver timeout before the SYN is even sent (BENCHMARKS.md, section 13;
/// tests/store_burst.rs measures the accept path with that lookup answered locally).
pub fn bind(port: u16) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let backlog = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .unwrap_or(4096)
        .max(4096);
    let v6 = (|| {
        let s = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
        s.set_only_v6(false)?;
        Ok::<_, io::Error>(s)
    })();
    let (sock, addr): (Socket, SocketAddr) = match v6 {
        Ok(s) => (s, (Ipv6Addr::UNSPECIFIED, port).into()),
        Err(_) => (
            Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?,
            (Ipv4Addr::UNSPECIFIED, port).into(),
        ),
    };
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(backlog)?;
    sock.set_nonblocking(true)?;
    Ok(sock.into())
}

/// A warning about a client, at most 10 in any 10 s; the rest are counted and said once the
/// window passes, so a flood of bad connections cannot flood the output.
fn quiet_warn(msg: std::fmt::Arguments<'_>) {
    static WINDOW: Mutex<Option<(std::time::Instant, u32, u32)>> = Mutex::new(None);
    let mut w = WINDOW.lock().unwrap_or_else(|e| e.into_inner());
    let now = std::time::Instant::now();
    let (start, said, quiet) = w.get_or_insert((now, 0, 0));
    if now.duration_since(*start) > std::time::Duration::from_secs(10) {
        if *quiet > 0 {
            tracing::warn!("store: {quiet} more such warnings were not shown");
        }
        (*start, *said, *quiet) = (now, 0, 0);
    }
    if *said < 10 {
        *said += 1;
        tracing::warn!("{msg}");
    } else {
        *quiet += 1;
    }
}

/// Serves connections until `shutdown` completes; open connections are then dropped.
pub async fn serve(listener: TcpListener, store: Arc<Store>, shutdown: impl Future<Output = ()>) {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    let mut backoff_ms = 1;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    backoff_ms = 1;
                    if store.loopback_only.load(Ordering::Relaxed)
                        && !nrun_base::net::canonical(peer.ip()).is_loopback()
                    {
                        quiet_warn(format_args!(
                            "store: refusing {peer}: this single-node store serves this host only"
                        ));
                        continue;
                    }
                    let Some((id, live)) = store.admit(peer) else {
                        let limits = store.limits();
                        quiet_warn(format_args!(
                            "store: refusing {peer}: no connection slot is free (at most \
                             {} from one address, {} in all, set by this host's open-file limit) \
                             and every open one is an agent of this run; raise `ulimit -n` for \
                             nrun here",
                            limits.per_peer,
                            limits.total_cap()
                        ));
                        continue;
                    };
                    let store = store.clone();
                    let stop = stop_rx.clone();
                    let ip = live.ip;
                    tokio::spawn(async move {
                        // `live` ends with the connection, before the registry forgets it (its
                        // address's reply count goes once no connection holds it).
                        connection(stream, peer, &store, stop, id, live).await;
                        store.conns_lock().remove(id, ip);
                    });
                }
                Err(e) => {
                    // Out of file descriptors (or similar): close the idlest connection of the
                    // address holding the most, keep serving the others, and say so once
                    // rather than once a second.
                    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if out_of_fds {
                        store.conns_lock().evict_one();
                        quiet_warn(format_args!(
                            "store: accept failed: {e}; closing idle connections to make room"
                        ));
                    } else {
                        quiet_warn(format_args!("store: accept failed: {e}; retrying in {backoff_ms} ms"));
                    }
                    tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
                    backoff_ms = (backoff_ms * 2).min(1000);
                }
            }
        }
    }
    let _ = stop_tx.send(true);
}

impl Store {
    /// Registers a new connection under the caps (see [`Limits`]); None: refused.
    fn admit(&self, peer: SocketAddr) -> Option<(ConnId, Arc<Live>)> {
        let limits = self.limits();
        let total = limits.total_cap();
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let ip = nrun_base::net::canonical(peer.ip());
        let live = self.conns_lock().admit(id, ip, limits.per_peer, total)?;
        Some((id, live))
    }
}

/// Writes `out`, closing (an error) when the peer takes nothing for `stall`.
async fn write_out(wr: &mut OwnedWriteHalf, out: &[u8], stall: Duration) -> io::Result<()> {
    // Most replies fit the socket's buffer at once: no timer for those.
    let mut pos = match wr.try_write(out) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => return Err(e),
    };
    while pos < out.len() {
        match tokio::time::timeout(stall, wr.write(&out[pos..])).await {
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "it read none of its replies for {} s ({} bytes waiting)",
                        stall.as_secs(),
                        out.len() - pos
                    ),
                ));
            }
            Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(Ok(n)) => pos += n,
            Ok(Err(e)) => return Err(e),
        }
    }
    Ok(())
}

/// What [`next_request`] found.
enum Next {
    /// A whole request, which used the first `len` bytes.
    Request(Request, usize),
    /// At least this many bytes in all are needed first.
    Need(usize),
}

/// The next whole request at the start of `buf`. Most requests arrive whole and are parsed at
/// once; one that does not is framed by the resumable scan (each byte looked at once, however
/// many reads it takes) and parsed when whole, so a request costs at most two parses.
fn next_request(scan: &mut FrameScan, buf: &[u8]) -> Result<Next, ProtocolError> {
    if scan.is_fresh()
        && let Parsed::Complete(req, len) = Request::parse(buf)?
    {
        return Ok(Next::Request(req, len));
    }
    match scan.scan(buf)? {
        Scanned::Incomplete { need } => Ok(Next::Need(need)),
        Scanned::Complete(len) => {
            *scan = FrameScan::default();
            match Request::parse(&buf[..len])? {
                Parsed::Complete(req, _) => Ok(Next::Request(req, len)),
                // The scan and the parse agree on every input (tests/codec_scan_props.rs).
                Parsed::Incomplete { .. } => Err(ProtocolError::RequestTooLarge(len)),
            }
        }
    }
}

/// Largest buffer a connection keeps between requests: beyond it, a buffer that served a large
/// request or reply is given back once empty (smaller ones once idle, [`Limits::idle_hold`]).
const KEEP_BUFFER: usize = 64 << 10;

/// Closes the connection (Break) or keeps serving it (Continue).
type Flow = ControlFlow<()>;

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    store: &Store,
    stop: watch::Receiver<bool>,
    id: ConnId,
    live: Arc<Live>,
) {
    let limits = store.limits();
    let _ = stream.set_nodelay(true);
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let (rd, wr) = stream.into_split();
    let (wake_tx, wake_rx) = mpsc::unbounded_channel::<u8>();
    let _ = live.wake.set(wake_tx.clone());
    // Chosen to make room before its task could hear it: said as the others are.
    if live.evicted.load(Ordering::Relaxed) {
        quiet_warn(format_args!(
            "store: closing a new connection from {peer} to make room for others (connection caps)"
        ));
        return;
    }
    let c = Conn {
        id,
        validated: false,
        authed: false,
        live_keys: Vec::new(),
        fd,
        nonce: None,
        peer,
        owner: live.ip,
        wake: wake_tx,
        live: live.clone(),
        limits: limits.clone(),
    };
    // Its first buffer is asked for as any other: an address that holds its whole budget
    // gets no more connections served.
    let mut acct = Account::new(&store.memory, &live);
    if let Room::Later(why) | Room::Never(why) = acct.room(Part::Read, INITIAL_BUFFER, &limits) {
        quiet_warn(format_args!(
            "store: closing a new connection from {peer}: no room in {why}"
        ));
        return;
    }
    let buf = BytesMut::with_capacity(INITIAL_BUFFER);
    let out = Vec::with_capacity(256);
    acct.set(Part::Read, buf.capacity());
    acct.set(Part::Out, out.capacity());
    let mut task = ConnTask {
        store,
        peer,
        rd,
        wr,
        wake_rx,
        stop,
        c,
        alloc: buf.capacity(),
        buf,
        frame: 0,
        out,
        acct,
        live,
        limits,
        pending: None,
        room_since: None,
        need: 1,
        scan: FrameScan::default(),
        begun: None,
        handshake_by: tokio::time::Instant::now() + HANDSHAKE,
    };
    let _ = task.run().await;
    task.finish();
}

/// One connection's task: its socket, its buffers, and where its requests have got to.
struct ConnTask<'a> {
    store: &'a Store,
    peer: SocketAddr,
    limits: Limits,
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    wake_rx: mpsc::UnboundedReceiver<u8>,
    stop: watch::Receiver<bool>,
    c: Conn,
    live: Arc<Live>,
    /// What has been read and not yet served.
    buf: BytesMut,
    /// The size of `buf`'s allocation (its capacity less what was served from its front).
    alloc: usize,
    /// The request being received, counted a second time while it is parsed and applied (the
    /// request's own copy of its value): 0 for small ones.
    frame: usize,
    /// Replies served and not yet written.
    out: Vec<u8>,
    /// What `buf`, `frame` and `out` hold, in the store's budgets.
    acct: Account<'a>,
    /// A request whose reply did not fit the memory budget yet: served before anything is read.
    pending: Option<Request>,
    /// Since when it has waited for room (with nothing of its own queued).
    room_since: Option<tokio::time::Instant>,
    /// Bytes in all the request being received needs.
    need: usize,
    /// Where the request being received has got to, so each byte is scanned once.
    scan: FrameScan,
    /// When the first byte of the request being received arrived.
    begun: Option<tokio::time::Instant>,
    handshake_by: tokio::time::Instant,
}

impl ConnTask<'_> {
    /// Serves the connection until it closes (always Break).
    async fn run(&mut self) -> Flow {
        loop {
            self.serve_buffered()?;
            if !self.out.is_empty() {
                self.flush().await?;
            } else if self.pending.is_some() {
                self.wait_for_room().await?;
            } else {
                self.make_room_to_read()?;
                self.read().await?;
            }
        }
    }

    /// Serves the whole requests already here, while the replies fit the output budget; past
    /// it, the replies are written before anything more is read or served.
    #[inline]
    fn serve_buffered(&mut self) -> Flow {
        while self.out.len() < self.limits.out_budget {
            let parsed = match self.pending.take() {
                Some(req) => Ok(Next::Request(req, 0)),
                None => next_request(&mut self.scan, &self.buf),
            };
            match parsed {
                Ok(Next::Request(req, 0)) => {
                    // Given back unserved before: its bytes are already consumed.
                    if !self.apply(req)? {
                        break;
                    }
                    self.applied();
                    self.room_since = None;
                }
                Ok(Next::Request(req, len)) => {
                    self.consume(len);
                    if matches!(req, Request::CancelWait) {
                        // Forgotten first, then the wakes taken: a write that wakes the wait
                        // does so under the store's lock, so once the wait is forgotten every
                        // STOP_WAITING sent for it is in the channel and goes out ahead of the
                        // reply. Taken before the forget, a write landing between the two
                        // sent its STOP_WAITING after WAIT_CANCELED: a byte the client took
                        // for the answer to its next request (an agent's next GET then read a
                        // length off by one byte and waited forever).
                        self.store.lock().forget_wait(self.c.id);
                        self.take_wakes()?;
                    }
                    if !self.apply(req)? {
                        break;
                    }
                    self.applied();
                    self.publish_state();
                }
                Ok(Next::Need(n)) => {
                    self.need = n;
                    break;
                }
                Err(e) => {
                    let what = if self.c.validated {
                        e.to_string()
                    } else {
                        PRE_2_2.to_string()
                    };
                    let peer = self.peer;
                    quiet_warn(format_args!(
                        "store: closing connection from {peer}: {what}"
                    ));
                    return Flow::Break(());
                }
            }
        }
        Flow::Continue(())
    }

    /// Drops the first `len` bytes, a request just received whole (its parsed copy is still
    /// counted until it is applied).
    #[inline]
    fn consume(&mut self, len: usize) {
        self.begun = None;
        if len == self.buf.len() && self.alloc > KEEP_BUFFER {
            // A large request, now parsed: its buffer goes back at once.
            self.fresh_buffer();
        } else {
            // Advanced, never split: the allocation stays the buffer's own, so its front is
            // reused in place (see `make_room_to_read`).
            self.buf.advance(len);
        }
        self.live.touch();
        self.live.parked.store(false, Ordering::Relaxed);
    }

    /// A first-size read buffer in place of the one held (empty).
    fn fresh_buffer(&mut self) {
        self.buf = BytesMut::with_capacity(INITIAL_BUFFER);
        self.alloc = self.buf.capacity();
        self.acct.set(Part::Read, self.alloc + self.frame);
    }

    /// The request just applied no longer holds its copy of the frame.
    #[inline]
    fn applied(&mut self) {
        if self.frame > 0 {
            self.frame = 0;
            self.acct.set(Part::Read, self.alloc);
        }
    }

    /// Queues the STOP_WAITING bytes already sent to this connection, ahead of a CANCEL_WAIT's
    /// reply (its wait forgotten first); Break: it was chosen to make room.
    #[inline]
    fn take_wakes(&mut self) -> Flow {
        while let Ok(b) = self.wake_rx.try_recv() {
            if b == EVICT {
                say_evicted(self.peer);
                return Flow::Break(());
            }
            self.out.push(b);
        }
        Flow::Continue(())
    }

    /// Applies one request: true, served; false, given back to wait for room in the reply
    /// budget (`pending`); Break, refused.
    #[inline]
    fn apply(&mut self, req: Request) -> ControlFlow<(), bool> {
        let r = self
            .store
            .apply(&mut self.c, req, &mut self.out, &mut self.acct);
        // Small replies that were built without asking (a challenge, a flag) are counted too.
        if self.out.capacity() != self.acct.out() {
            self.acct.set(Part::Out, self.out.capacity());
        }
        match r {
            Ok(None) => ControlFlow::Continue(true),
            Ok(Some(req)) => {
                self.pending = Some(req);
                ControlFlow::Continue(false)
            }
            Err(msg) => {
                let peer = self.peer;
                quiet_warn(format_args!("store: closing connection from {peer}: {msg}"));
                ControlFlow::Break(())
            }
        }
    }

    /// Tells the connection caps what the last request changed.
    #[inline]
    fn publish_state(&mut self) {
        let live = &self.live;
        if self.c.validated != live.validated.load(Ordering::Relaxed) {
            live.validated.store(self.c.validated, Ordering::Relaxed);
        }
        if self.c.authed != live.authed.load(Ordering::Relaxed) {
            live.authed.store(self.c.authed, Ordering::Relaxed);
            // Its memory is counted apart from strangers' from now on.
            self.acct.promote();
            // Counted where the caps look (a connection evicted meanwhile is gone from them:
            // nothing to count).
            let mut conns = self.store.conns_lock();
            if !live.evicted.load(Ordering::Relaxed) {
                conns.authenticated(live);
            }
        }
    }

    /// Writes the replies served so far.
    async fn flush(&mut self) -> Flow {
        if let Err(e) = write_out(&mut self.wr, &self.out, self.limits.stall).await {
            if e.kind() == io::ErrorKind::TimedOut {
                let peer = self.peer;
                quiet_warn(format_args!("store: closing connection from {peer}: {e}"));
            }
            return Flow::Break(());
        }
        let written = self.out.len();
        self.out.clear();
        if self.out.capacity() > KEEP_BUFFER {
            self.out = Vec::with_capacity(256);
        }
        self.acct.set(Part::Out, self.out.capacity());
        if written > SMALL {
            self.store.freed.notify_waiters();
        }
        Flow::Continue(())
    }

    /// Nothing of its own queued, and still no room for `pending`'s reply: others' replies hold
    /// the budget. It waits for them to be written (or their connections closed), as long as a
    /// client may leave its replies unread.
    async fn wait_for_room(&mut self) -> Flow {
        let since = *self
            .room_since
            .get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() > self.limits.stall {
            quiet_warn(format_args!(
                "store: closing connection from {}: its reply waited {} s for room in the \
                 store's memory budget ({} bytes held by all connections)",
                self.peer,
                self.limits.stall.as_secs(),
                self.store.held_bytes()
            ));
            return Flow::Break(());
        }
        tokio::select! {
            biased;
            woke = self.wake_rx.recv() => match woke {
                Some(EVICT) | None => return Flow::Break(()),
                Some(b) => self.out.push(b),
            },
            _ = self.stop.changed() => return Flow::Break(()),
            _ = self.store.freed.notified() => {}
            // Room given back by a connection that ended, or in small amounts, is not
            // announced: look again now and then.
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        Flow::Continue(())
    }

    /// Notes when the request under way began and makes room in the buffer for what it still
    /// needs, asked of the connection's budgets before it is taken: a request that does not
    /// fit closes its connection.
    #[inline]
    fn make_room_to_read(&mut self) -> Flow {
        if self.buf.is_empty() {
            self.begun = None;
        } else if self.begun.is_none() {
            self.begun = Some(tokio::time::Instant::now());
        }
        // The request under way says how much more it needs (`need` > what is buffered).
        let len = self.buf.len();
        let want = self.need.saturating_sub(len).max(1);
        if self.buf.capacity() - len >= want {
            return Flow::Continue(());
        }
        // What was served from the front of the allocation is reused in place where that is
        // cheap (BytesMut moves the bytes back when at least as many were served as remain):
        // no more memory.
        let front = self.alloc - self.buf.capacity();
        if len + want <= self.alloc && front >= len {
            self.buf.reserve(want);
            debug_assert_eq!(self.buf.capacity(), self.alloc);
            return Flow::Continue(());
        }
        // A larger allocation (what the request needs, or twice the last one where a request
        // of many keys says its size a key at a time: linear, not quadratic, copying), and the
        // request's parsed copy once whole: both asked for first.
        let alloc = (len + want).max(2 * self.alloc).max(INITIAL_BUFFER);
        let frame = if self.need > SMALL { self.need } else { 0 };
        match self.acct.room(Part::Read, alloc + frame, &self.limits) {
            Room::Fits => {}
            Room::Later(why) | Room::Never(why) => {
                quiet_warn(format_args!(
                    "store: closing connection from {}: a request of {} bytes does not fit \
                     {why}",
                    self.peer, self.need
                ));
                return Flow::Break(());
            }
        }
        let mut grown = BytesMut::with_capacity(alloc);
        grown.extend_from_slice(&self.buf);
        self.buf = grown;
        self.alloc = self.buf.capacity();
        self.frame = frame;
        self.acct.set(Part::Read, self.alloc + self.frame);
        Flow::Continue(())
    }

    /// Reads more of the request under way, or queues a STOP_WAITING sent meanwhile; closes on
    /// the peer's end, an eviction, the store's stop, or a request too slow to arrive.
    async fn read(&mut self) -> Flow {
        let peer = self.peer;
        let frame_by = self.begun.map(|t| t + self.limits.frame_timeout);
        let handshake_by = self.handshake_by;
        let grown =
            self.buf.is_empty() && (self.alloc > INITIAL_BUFFER || self.out.capacity() > 256);
        tokio::select! {
            biased;
            woke = self.wake_rx.recv() => match woke {
                Some(EVICT) => {
                    say_evicted(peer);
                    return Flow::Break(());
                }
                Some(b) => {
                    self.live.parked.store(false, Ordering::Relaxed);
                    self.out.push(b);
                }
                None => {}
            },
            read = self.rd.read_buf(&mut self.buf) => match read {
                Ok(0) => {
                    if !self.buf.is_empty() {
                        tracing::debug!("store: {peer} closed with {} bytes of a request unread", self.buf.len());
                    }
                    return Flow::Break(());
                }
                Err(_) => return Flow::Break(()),
                Ok(_) => {
                    // Refuse an old client on its first byte, before its differently-shaped
                    // request could keep us waiting for bytes it never sends.
                    if !self.c.validated && self.buf.first().is_some_and(|&b| b != 0) {
                        quiet_warn(format_args!("store: closing connection from {peer}: {PRE_2_2}"));
                        return Flow::Break(());
                    }
                }
            },
            _ = self.stop.changed() => return Flow::Break(()),
            // Idle: a buffer grown for an earlier request goes back (a torch client may sit
            // idle for hours between requests; its first-size buffer is all it keeps).
            _ = tokio::time::sleep(self.limits.idle_hold), if grown => {
                self.fresh_buffer();
                self.out = Vec::with_capacity(256);
                self.acct.set(Part::Out, self.out.capacity());
            }
            _ = tokio::time::sleep_until(handshake_by), if !self.c.validated => {
                quiet_warn(format_args!("store: closing connection from {peer}: no VALIDATE within {} s", HANDSHAKE.as_secs()));
                return Flow::Break(());
            }
            _ = tokio::time::sleep_until(frame_by.unwrap_or(handshake_by)), if self.c.validated && frame_by.is_some() => {
                quiet_warn(format_args!(
                    "store: closing connection from {peer}: a request begun {} s ago is still \
                     unfinished ({} bytes received)",
                    self.limits.frame_timeout.as_secs(),
                    self.buf.len()
                ));
                return Flow::Break(());
            }
        }
        Flow::Continue(())
    }

    /// Forgets the connection's waits and keys, and gives its memory back.
    fn finish(self) {
        self.store.disconnect(self.c.id, &self.c.live_keys);
        drop(self.acct);
        self.store.freed.notify_waiters();
    }
}

/// Says that an idle connection is closed to make room ([`EVICT`]).
fn say_evicted(peer: SocketAddr) {
    quiet_warn(format_args!(
        "store: closing an idle connection from {peer} to make room for others (connection caps)"
    ));
}
