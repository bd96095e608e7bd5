//! A node whose own nrun joins by itself (torchrun's c10d: the same command on every node): a
//! placeholder until it joins, then alive while its heartbeat moves. Nothing of it is a process
//! of this nrun, so its end is its acknowledgement of the End step (its nrun then exits with the
//! job's code, which it reads before the store goes away).

use std::time::{Duration, Instant};

use super::{BoxFuture, Bus, Ending, Joining, NodeLink};

/// A node is lost when its heartbeat (every second) stops this long.
pub const SILENCE: Duration = Duration::from_secs(10);

/// The last heartbeat seen from a node, and when it was seen.
#[derive(Default)]
pub struct Heartbeat {
    last: Option<(Vec<u8>, Instant)>,
}

impl Heartbeat {
    /// Whether node `node` is lost: it stopped its workers unasked, or its heartbeat has been
    /// still too long.
    pub fn lost(&mut self, bus: &Bus, node: usize, label: &str, stopped: bool) -> Option<String> {
        let beat = bus.heartbeat(node);
        let now = Instant::now();
        if self.last.as_ref().is_none_or(|(v, _)| *v != beat) {
            self.last = Some((beat, now));
        }
        let quiet = self.last.as_ref().map_or(Duration::ZERO, |(_, t)| now - *t);
        let why = match (stopped, quiet > SILENCE) {
            (true, _) => "stopped its workers when its link to this host broke".to_string(),
            (false, true) => format!("sent no heartbeat for {} s", SILENCE.as_secs()),
            (false, false) => return None,
        };
        Some(format!(
            "lost {label}: its nrun {why}; check that it still runs there and reaches this host"
        ))
    }
}

/// A node whose own nrun joins by itself.
pub struct PeerLink {
    beat: Heartbeat,
}

pub fn link() -> Box<dyn NodeLink> {
    Box::new(PeerLink {
        beat: Heartbeat::default(),
    })
}

impl NodeLink for PeerLink {
    fn named_on_join(&self) -> bool {
        true
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

    fn end<'a>(&'a mut self, e: Ending<'a>) -> BoxFuture<'a, ()> {
        Box::pin(e.acknowledged())
    }
}
