//! A node whose own nrun joins by itself (torchrun's c10d: the same command on every node): a
//! placeholder until it joins, then alive while its heartbeat moves (the [`Heartbeat`] every
//! link with a remote agent keeps). Nothing of it is a process
//! of this nrun, so its end is its acknowledgement of the End step (its nrun then exits with the
//! job's code, which it reads before the store goes away).

use std::time::Duration;

use tokio::time::Instant;

use nrun_store::server::LinkView;

use super::{BoxFuture, Bus, Ending, Joining, Kind, NodeLink};
use crate::session::Node;

/// Longer than this between two looks at a heartbeat, this process was not looking (busy, or
/// between steps): the time does not count against the node.
const LOOKED_AWAY: Duration = Duration::from_millis(500);

/// The last heartbeat seen from a node, and since when it has been still.
#[derive(Default)]
pub(crate) struct Heartbeat {
    last: Option<(Vec<u8>, Instant)>,
    looked: Option<Instant>,
    /// The whole seconds of stillness last logged (debug, once a second while still): the
    /// record that this host counted that long and did not call the node lost.
    said: u64,
    /// What the node's connection showed when its stillness passed the bound, for the verdict.
    seen: String,
    /// Spared once while still (logged once).
    spared: bool,
    /// Its connection closed when it was found lost: its nrun died (the kernel closed the
    /// socket), as no node frozen or cut off shows (the c10d host's majority counts on it).
    closed: bool,
}

/// The kernel's view of a still node's heartbeat connection: its agent is alive when its host
/// sent a beat within the bound (this host has not taken it yet: a launch host too busy) or its
/// last beat awaits this host's reply. Either is this host's delay, not the node's; past
/// [`SPARED_FOR`] bounds, the node is lost whatever this host's state.
#[derive(Debug, PartialEq, Eq)]
enum Evidence {
    /// Its connection shows it beating.
    Beating(String),
    /// Its connection is gone or silent too.
    Gone(String),
}

/// How many silence bounds a node whose connection shows it beating may stay still.
const SPARED_FOR: u32 = 2;

fn evidence(view: Option<LinkView>, silence: Duration, quiet: Duration) -> Evidence {
    let Some(v) = view else {
        return Evidence::Gone("its connection to this host's store is gone".into());
    };
    if !v.established {
        return Evidence::Gone("its connection to this host's store is closing".into());
    }
    let heard = v.since_received.as_secs_f64();
    let beating = v.since_received < silence || v.awaits_reply();
    if beating && quiet <= silence * SPARED_FOR {
        return Evidence::Beating(format!(
            "its host sent its last beat {heard:.1} s ago{}",
            if v.awaits_reply() {
                ", which awaits this host's reply"
            } else {
                ""
            }
        ));
    }
    let unacked = match v.unacked {
        0 => String::new(),
        n => format!(", and its host acknowledged none of this host's last {n} segments"),
    };
    Evidence::Gone(format!(
        "nothing came on its connection for {heard:.1} s{unacked}"
    ))
}

impl Heartbeat {
    /// Whether node `node` is lost: it stopped its workers unasked, or its heartbeat has been
    /// still too long.
    pub(crate) fn lost(
        &mut self,
        bus: &Bus,
        node: usize,
        label: &str,
        stopped: bool,
    ) -> Option<String> {
        let beat = bus.heartbeat(node);
        // The store removes the counter when the agent's connection closes: the agent ended,
        // or its process was killed (its kernel closed the socket). Silence is for the rest.
        let closed = beat.is_empty() && self.last.as_ref().is_some_and(|(v, _)| !v.is_empty());
        let silent = self.still(bus, node, beat);
        // Kept: the next look finds the counter gone already, no longer a close.
        self.closed |= closed && !stopped;
        let why = match (stopped, closed, silent) {
            (true, ..) => "stopped its workers when its link to this host broke".to_string(),
            (false, true, _) => {
                "closed its connection to this host: its nrun ended there, or was killed"
                    .to_string()
            }
            (false, false, Some(quiet)) => format!(
                "sent no heartbeat for {:.1} s and {}: its host is down, cut off from this one \
                 or its nrun stopped (--agent-timeout sets how long silence may last)",
                quiet.as_secs_f64(),
                self.seen
            ),
            (false, false, None) => return None,
        };
        Some(format!(
            "lost {label}: its agent {why}; check that it still runs there and reaches this host"
        ))
    }

    /// How long node `node`'s heartbeat has been still, once that is longer than the bus's
    /// silence and the kernel's view of its connection shows no beat either (what it showed:
    /// [`Heartbeat::seen`]).
    pub(crate) fn silent(&mut self, bus: &Bus, node: usize) -> Option<Duration> {
        self.still(bus, node, bus.heartbeat(node))
    }

    /// What the node's connection showed when it was found silent (for its verdict).
    pub(crate) fn seen(&self) -> &str {
        &self.seen
    }

    fn still(&mut self, bus: &Bus, node: usize, beat: Vec<u8>) -> Option<Duration> {
        let quiet = self.quiet(node, beat, Instant::now());
        if quiet <= bus.silence {
            return None;
        }
        // Silence alone is no verdict: a busy launch host may not have taken beats that came.
        match evidence(bus.heartbeat_link(node), bus.silence, quiet) {
            Evidence::Beating(why) => {
                if !self.spared {
                    self.spared = true;
                    tracing::debug!(
                        "node {node}'s heartbeat has been still for {:.1} s, but {why}: not lost",
                        quiet.as_secs_f64()
                    );
                }
                None
            }
            Evidence::Gone(why) => {
                self.seen = why;
                Some(quiet)
            }
        }
    }

    /// How long the heartbeat has been still at `now`, not counting time this process spent
    /// elsewhere (a launch host under load must not call its nodes dead).
    fn quiet(&mut self, node: usize, beat: Vec<u8>, now: Instant) -> Duration {
        if let (Some(looked), Some((_, since))) = (self.looked, self.last.as_mut()) {
            let away = now - looked;
            if away > LOOKED_AWAY {
                *since += away;
            }
        }
        self.looked = Some(now);
        if self.last.as_ref().is_none_or(|(v, _)| *v != beat) {
            self.last = Some((beat, now));
            self.said = 0;
            self.spared = false;
        }
        let Some((beat, since)) = self.last.as_ref() else {
            return Duration::ZERO;
        };
        let quiet = now.saturating_duration_since(*since);
        // Counted stillness, for the debug log (no counter yet: not joined, nothing to say).
        if quiet.as_secs() > self.said && !beat.is_empty() {
            self.said = quiet.as_secs();
            tracing::debug!("node {node}'s heartbeat has been still for {} s", self.said);
        }
        quiet
    }
}

/// Nodes whose own nrun joins (c10d): placeholders named `node1`... until they join.
pub(crate) static KIND: Kind = Kind {
    name: "c10d",
    start: |s, hosts| {
        let peers = &s.plan.hosts[hosts];
        Box::pin(async move { Ok(peers.iter().map(|h| Node::new(&h.name, link())).collect()) })
    },
    check: super::any_nodes,
    spawner: false,
    refuses_ship: None,
    in_process: false,
    joins_by_itself: true,
    named_on_join: true,
    join_hint,
    lost_hint: |host| {
        format!("check that {host} is up and that its nrun still runs and reaches this host")
    },
    unanswered_hint: |host| format!("check that {host}'s nrun still runs and reaches this host"),
    again: None,
};

/// What to check when nodes whose own nrun joins did not: no ssh or srun is involved (they
/// start by hand, from a batch script, as Kubernetes pods).
fn join_hint(np: &crate::plan::NodesPlan, r: &crate::session::Rendezvous) -> String {
    let endpoint = format!("{}:{}", r.addr, r.port);
    let secs = np.join_timeout.as_secs_f64();
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        return format!(
            "check that every pod of the job is running (`kubectl get pods`) and reaches \
             {endpoint} (the head pod's service), and that each started within --join-timeout \
             ({secs:.0} s) of this one"
        );
    }
    format!(
        "check that every node's nrun started within --join-timeout ({secs:.0} s) of this one \
         and reaches {endpoint} (`nc -z {} {}` there: a firewall, or another \
         --rdzv-endpoint)",
        r.addr, r.port
    )
}

/// A node whose own nrun joins by itself.
pub(crate) struct PeerLink {
    beat: Heartbeat,
}

pub(crate) fn link() -> Box<dyn NodeLink> {
    Box::new(PeerLink {
        beat: Heartbeat::default(),
    })
}

impl NodeLink for PeerLink {
    fn kind(&self) -> &'static Kind {
        &KIND
    }

    fn joining(&mut self) -> Joining {
        Joining::Pending
    }

    fn join_failure(&mut self, label: &str, waited: Duration, _timeout: Duration) -> String {
        format!(
            "{label}: no nrun joined as this node in {:.0} s: start the same nrun command on \
             every node, with the same --rdzv-endpoint and --rdzv-id",
            waited.as_secs_f64()
        )
    }

    fn lost(&mut self, bus: &Bus, node: usize, label: &str, stopped: bool) -> Option<String> {
        self.beat.lost(bus, node, label, stopped)
    }

    fn closed(&self) -> bool {
        self.beat.closed
    }

    fn end<'a>(&'a mut self, e: Ending<'a>) -> BoxFuture<'a, ()> {
        Box::pin(e.acknowledged())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_millis(2500);

    fn view(received_ms: u64, sent_ms: u64, unacked: u32) -> Option<LinkView> {
        Some(LinkView {
            established: true,
            since_received: Duration::from_millis(received_ms),
            since_sent: Duration::from_millis(sent_ms),
            unacked,
        })
    }

    fn beating(e: &Evidence) -> bool {
        matches!(e, Evidence::Beating(_))
    }

    #[test]
    fn a_still_heartbeat_is_lost_only_when_its_connection_is_silent_too() {
        let still = Duration::from_millis(2600);
        // A beat came 0.3 s ago, which this host has not taken yet: spared.
        assert!(beating(&evidence(view(300, 800, 0), BOUND, still)));
        // Its last beat awaits this host's reply (this host did not answer): spared.
        let e = evidence(view(2700, 3200, 0), BOUND, still);
        assert!(beating(&e), "{e:?}");
        // Answered, then nothing for 2.6 s (an agent stopped, or its host cut off): lost.
        let e = evidence(view(2700, 2600, 0), BOUND, still);
        assert_eq!(
            e,
            Evidence::Gone("nothing came on its connection for 2.7 s".into())
        );
        let e = evidence(view(2700, 200, 3), BOUND, still);
        assert!(
            matches!(&e, Evidence::Gone(w) if w.contains("acknowledged none of this host's last 3")),
            "{e:?}"
        );
        // No connection, or one closing: lost.
        assert!(!beating(&evidence(None, BOUND, still)));
        let mut closing = view(100, 600, 0);
        if let Some(v) = closing.as_mut() {
            v.established = false;
        }
        assert!(!beating(&evidence(closing, BOUND, still)));
        // Spared for twice the bound at most, whatever the connection shows.
        assert!(!beating(&evidence(
            view(100, 600, 0),
            BOUND,
            Duration::from_millis(5100)
        )));
    }
}
