//! A static launch's meeting (`--node-rank`/`--master-addr`, torchrun's static rendezvous):
//! every node checks in at node 0's store and waits there for the others before its workers
//! start, saying what it waits for, where and until when; a node 0 that never comes, or a port
//! where something other than a TCPStore answers, ends the wait with that said (never exit 0,
//! never torch's own stack).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::Session;
use crate::protocol::Keys;
use nrun_base::error::{Error, Result};
use nrun_store::client::Client;

/// How long one attempt to reach a store may take: a TCPStore answers its handshake at once.
pub(crate) const CONNECT: Duration = Duration::from_secs(2);

/// When a waiting node first says what it waits for (well within 5 s of its start).
const FIRST_LINE: Duration = Duration::from_secs(1);

/// How often a waiting node looks again.
const LOOK: Duration = Duration::from_millis(200);

/// Why a store could not be reached.
#[derive(Debug)]
pub(crate) enum Unreached {
    /// Something answered as no TCPStore does (its message says what): said at once.
    Other(std::io::Error),
    /// Something accepted the connection and answered nothing: another program, or a store's
    /// nrun that is stopped or not serving yet. Waited for; named at the deadline.
    Silent(std::io::Error),
    /// Nothing answered the connection (`TimedOut`), or the connection failed.
    Io(std::io::Error),
}

/// A store connection to `a`, within [`CONNECT`] for the connection and again for the
/// handshake.
pub(crate) async fn store_at(a: SocketAddr) -> std::result::Result<Client, Unreached> {
    let s = match tokio::time::timeout(CONNECT, tokio::net::TcpStream::connect(a)).await {
        Err(_) => {
            return Err(Unreached::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no answer within {} s (packets dropped on the way?)",
                    CONNECT.as_secs()
                ),
            )));
        }
        Ok(Err(e)) => return Err(Unreached::Io(e)),
        Ok(Ok(s)) => s,
    };
    Client::from_stream_within(s, CONNECT)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => Unreached::Other(e),
            std::io::ErrorKind::TimedOut => Unreached::Silent(e),
            _ => Unreached::Io(e),
        })
}

/// The error for a port where something other than a TCPStore answered: `e` says what.
pub(crate) fn something_else(endpoint: &str, flag: &str, e: &std::io::Error) -> Error {
    let port = endpoint.rsplit(':').next().unwrap_or(endpoint);
    Error::cluster(format!(
        "something else listens at {endpoint}: {e}; it is no TCPStore (no nrun, no torchrun): \
         give this job another {flag} port, or stop the program that holds it there (`ss \
         -ltnp 'sport = :{port}'` shows which)"
    ))
}

/// The key node `k` of a static launch sets at node 0's store when it arrives.
fn arrived(s: &Session, k: usize) -> Vec<u8> {
    s.keys().static_arrived(k)
}

impl Session {
    /// Whether this is a static launch's node (one of several, each with its own nrun).
    pub(crate) fn is_static(&self) -> bool {
        self.in_process() && self.plan.group_world > 1
    }

    /// A static launch: this node checks in at node 0's store and waits until every node has
    /// (up to --join-timeout), saying within a second what it waits for, where and until
    /// when. `Err`: a node missing at the deadline, node 0's store never reached, something
    /// other than a TCPStore at its port (exit 95), or interrupted.
    pub(crate) async fn meet(&mut self) -> Result<()> {
        let me = self.plan.layout.first().map_or(0, |l| l.group_rank);
        let n = self.plan.group_world;
        let timeout = self.plan.join_timeout;
        let started = Instant::now();
        let deadline = started + timeout;
        let mut m = Meeting {
            me,
            n,
            timeout,
            started,
            deadline,
            endpoint: format!("{}:{}", self.rendezvous.addr, self.rendezvous.port),
            addr: self.rendezvous.addr.clone(),
            whose: match self.store().is_some() {
                true => "this node's store",
                false => "node 0's store",
            },
            progress: crate::progress::Progress::new(
                "static rendezvous",
                Some(n as u64),
                Some(deadline),
            ),
            said: false,
        };
        match self.store().cloned() {
            // Node 0 hosts the store: it checks in and looks there itself.
            Some(st) => self.meet_here(&st, &mut m).await,
            // Another node: reach node 0's store, check in, and look there.
            None => self.meet_there(&mut m).await,
        }
    }

    /// Node 0's side of [`Session::meet`]: the store is its own.
    async fn meet_here(&mut self, st: &nrun_store::Store, m: &mut Meeting) -> Result<()> {
        let (me, n) = (m.me, m.n);
        st.set(&arrived(self, me), nrun_base::net::hostname().as_bytes());
        let mut changed = Some(st.subscribe());
        loop {
            let missing: Vec<usize> = (0..n)
                .filter(|&k| !st.contains(&arrived(self, k)))
                .collect();
            m.progress.set((n - missing.len()) as u64);
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= m.deadline {
                m.say(&missing_words(&missing), true);
                return Err(Error::cluster(format!(
                    "node {me} of {n}: {} did not arrive at this node's store {} within {} s \
                     (--join-timeout): start the same command there with --node-rank {} \
                     (--master-addr {} --master-port {}), and check that it reaches this host \
                     (the firewall, the route)",
                    missing_words(&missing),
                    m.endpoint,
                    m.timeout.as_secs(),
                    missing
                        .iter()
                        .map(|k| k.to_string())
                        .collect::<Vec<_>>()
                        .join("/"),
                    self.rendezvous.addr,
                    self.rendezvous.port
                )));
            }
            m.say(&missing_words(&missing), false);
            m.progress.waiting(|| missing_words(&missing));
            tokio::select! {
                () = super::store_changed(&mut changed) => {}
                () = tokio::time::sleep(LOOK) => {}
                sig = self.signals.stop() => return Err(Error::interrupted(sig)),
            }
        }
    }

    /// Another node's side of [`Session::meet`]: node 0's store is reached over the network,
    /// and reached again when the connection breaks.
    async fn meet_there(&mut self, m: &mut Meeting) -> Result<()> {
        let addrs = super::c10d::resolve(&self.rendezvous.addr, self.rendezvous.port)?;
        let secret = self.rendezvous.secret.clone().unwrap_or_default();
        let mut last = String::from("no answer yet");
        // The last answer was a silent one: at the deadline, something else listens there.
        let mut silent: Option<std::io::Error> = None;
        let mut conn: Option<Client> = None;
        loop {
            if conn.is_none() {
                conn = reach(&addrs, &secret, m, &mut last, &mut silent).await?;
            }
            let mut missing: Option<Vec<usize>> = None;
            if let Some(c) = conn.as_mut() {
                match look(c, self.keys(), m.me, m.n).await {
                    Ok(v) => missing = Some(v),
                    Err(e) => {
                        last = format!("{}: {e}", m.endpoint);
                        conn = None;
                    }
                }
            }
            match &missing {
                Some(v) if v.is_empty() => {
                    return Ok(());
                }
                Some(v) => m.progress.set((m.n - v.len()) as u64),
                None => {}
            }
            let what = match &missing {
                Some(v) => missing_words(v),
                None => format!("node 0 ({last})"),
            };
            if Instant::now() >= m.deadline {
                m.say(&what, true);
                return Err(m.not_met(missing.as_deref(), &last, silent.as_ref()));
            }
            m.say(&what, false);
            m.progress.waiting(|| what.clone());
            tokio::select! {
                () = tokio::time::sleep(LOOK) => {}
                sig = self.signals.stop() => return Err(Error::interrupted(sig)),
            }
        }
    }
}

/// Checks in at node 0's store over `c` (as node `me` of `n`) and reads who has: the nodes
/// still missing.
async fn look(c: &mut Client, keys: &Keys, me: usize, n: usize) -> std::io::Result<Vec<usize>> {
    c.set(
        &keys.static_arrived(me),
        nrun_base::net::hostname().as_bytes(),
    )
    .await?;
    let mut out = Vec::new();
    for k in 0..n {
        if !c.check(&[&keys.static_arrived(k)]).await? {
            out.push(k);
        }
    }
    Ok(out)
}

impl Meeting {
    /// The error at the deadline of a node other than node 0: the nodes still `missing`, or
    /// node 0's store never reached (`last` said why; `silent`: something there answered
    /// nothing).
    fn not_met(
        &self,
        missing: Option<&[usize]>,
        last: &str,
        silent: Option<&std::io::Error>,
    ) -> Error {
        let (me, n, endpoint) = (self.me, self.n, &self.endpoint);
        if let (None, Some(e)) = (missing, silent) {
            return something_else(endpoint, "--master-port", e);
        }
        Error::cluster(match missing {
            Some(v) => format!(
                "node {me} of {n}: {} did not arrive at node 0's store {endpoint} within {} s \
                 (--join-timeout): start the same command there with its --node-rank",
                missing_words(v),
                self.timeout.as_secs()
            ),
            None => format!(
                "node {me} of {n}: node 0's store at {endpoint} did not answer within {} s \
                 (--join-timeout; {last}): start the same command with --node-rank 0 on {}, \
                 and check the firewall and the route there",
                self.timeout.as_secs(),
                self.addr
            ),
        })
    }
}

/// A static launch's wait at node 0's store: who waits, for how long, and whether it said so.
/// Its progress bar is cleared when it is dropped, however the wait ends.
struct Meeting {
    me: usize,
    n: usize,
    timeout: Duration,
    started: Instant,
    deadline: Instant,
    endpoint: String,
    /// Node 0's address, as given.
    addr: String,
    whose: &'static str,
    progress: crate::progress::Progress,
    said: bool,
}

impl Meeting {
    /// Says what the node waits for: once, after FIRST_LINE, or at the deadline (`now`) if a
    /// loaded host never looked before.
    fn say(&mut self, what: &str, now: bool) {
        if self.said || !(now || self.started.elapsed() >= FIRST_LINE) {
            return;
        }
        let until = humantime::format_rfc3339_seconds(
            std::time::SystemTime::now() + self.deadline.saturating_duration_since(Instant::now()),
        );
        self.progress.line(&format!(
            "node {} of {}: waiting at {} {} for {what} before the workers start (until \
             {until}: {} s, --join-timeout)",
            self.me,
            self.n,
            self.whose,
            self.endpoint,
            self.timeout.as_secs()
        ));
        self.said = true;
    }
}

/// "node 2", "nodes 1, 3".
fn missing_words(missing: &[usize]) -> String {
    let list: Vec<String> = missing.iter().map(|k| k.to_string()).collect();
    match missing.len() {
        1 => format!("node {}", list[0]),
        _ => format!("nodes {}", list.join(", ")),
    }
}

/// A connection to node 0's store at one of `addrs`, its secret proved: None while none
/// answers (`last` says how the last failed; `silent`: it answered nothing). `Err`: something
/// other than a TCPStore answered, or the store refused the secret.
async fn reach(
    addrs: &[SocketAddr],
    secret: &str,
    m: &mut Meeting,
    last: &mut String,
    silent: &mut Option<std::io::Error>,
) -> Result<Option<Client>> {
    for a in addrs {
        match store_at(*a).await {
            Ok(mut c) => {
                let lost = |e: std::io::Error| Error::cluster(format!("{e}"));
                crate::agent::prove(&mut c, secret, &m.endpoint)
                    .await
                    .map_err(|e| crate::agent::refusal(e, lost))?;
                return Ok(Some(c));
            }
            Err(Unreached::Other(e)) => {
                return Err(something_else(&m.endpoint, "--master-port", &e));
            }
            Err(Unreached::Silent(e)) => {
                *last = format!("{a}: {e}");
                *silent = Some(e);
            }
            Err(Unreached::Io(e)) => {
                *last = format!("{a}: {e}");
                *silent = None;
            }
        }
    }
    Ok(None)
}
