//! A node lost mid-run comes back. Once the group re-formed without it (a spare in its place,
//! or an elastic job shrunk), its agent is started again in the background, a try after 2 s,
//! then 4, 8 ... up to 60 s between tries, until the job ends. The try runs as a task of its
//! own; its node is a new one of the session (a placeholder until its agent joins: an agent
//! reads its steps from the first, so the lost node's own keys cannot serve it). The task
//! tells the session through a channel when an agent joined, which the step's wait reads as it
//! reads an elastic job's late joiners ([`Session::arrivals`]): the node passes the checks a
//! late joiner passes and becomes a spare, or grows an elastic job below its MAX (the group
//! restarts with it). Only a node lost (its agent or link) is tried again: one with evidence
//! against it (a GPU fault, a failed check, a second suspicion) stays out, as does every node
//! of a job that has neither spares nor room to grow (it ended when the node was lost).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, oneshot};

use super::link::{Again, BoxFuture, Ending, Joining, Kind, NodeLink, StartAgain};
use super::roster::{Back, Evidence, Returning, Stage};
use super::{Node, Session};
use crate::journal::Event;
use crate::protocol::Step;
use nrun_store::Store;

/// The first wait before a lost node's agent is started again; each failed try doubles it.
const FIRST_TRY: Duration = Duration::from_secs(2);
/// The longest wait between two tries.
const LONGEST_WAIT: Duration = Duration::from_secs(60);
/// How often a try looks for its agent's join record, besides the store's own wake-ups.
const LOOK: Duration = Duration::from_millis(100);

/// The session's side of the tries: what starting an agent again needs, and the channel on
/// which the tries' agents that joined come.
pub(crate) struct Returns {
    /// None: this session's nodes are not started again (in-process, srun, c10d).
    pub(super) again: Option<Arc<Again>>,
    tx: mpsc::UnboundedSender<Came>,
    rx: mpsc::UnboundedReceiver<Came>,
}

impl Returns {
    /// No tries yet, and nothing to start them with (the session sets [`Returns::again`]).
    pub(crate) fn new() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Returns {
            again: None,
            tx,
            rx,
        }
    }
}

/// A try whose agent joined: its node and link, and how many tries it took.
pub(crate) struct Came {
    node: usize,
    link: Box<dyn NodeLink>,
    tries: u32,
}

impl Session {
    /// Once the group re-formed: each node left out as lost (not on evidence against it) gets
    /// its agent started again in the background, as a new node of the session, where the job
    /// can take it back (it has spares, or room to grow) and its kind can start it again.
    pub(crate) fn retry_lost(&mut self) {
        let Some(again) = self.returns.again.clone() else {
            return;
        };
        let room = self.elastic() || self.plan.hosts.len() > self.plan.size;
        let Some(store) = self
            .store()
            .cloned()
            .filter(|_| room && self.c10d_id.is_none())
        else {
            return;
        };
        let lost: Vec<(usize, StartAgain)> = self
            .roster
            .left_out()
            .iter()
            .filter(|l| l.stage == Stage::Lost && l.evidence == Evidence::Seen)
            .filter(|l| !self.roster.retried(l.node))
            .filter_map(|l| Some((l.node, self.nodes[l.node].link.kind().again?)))
            .collect();
        for (was, start) in lost {
            let node = self.nodes.len();
            let host = self.nodes[was].label.clone();
            let layout = crate::plan::nodes::NodeLayout {
                group_rank: node,
                ..self.plan.layout[was].clone()
            };
            self.plan.layout.push(layout);
            // Its agent takes the steps so far as idle ones, from the first.
            for no in 0..self.step {
                self.bus.set_step(node, no, &Step::idle());
            }
            let (stop, stopped) = oneshot::channel();
            let t = Try {
                start,
                again: again.clone(),
                node,
                host: host.clone(),
                store: store.clone(),
                key: self.keys().joined(node),
                limit: self.plan.join_timeout,
                tx: self.returns.tx.clone(),
            };
            let task = tokio::spawn(t.run(stopped));
            self.nodes.push(Node::new(
                &host,
                Box::new(Coming {
                    stop: Some(stop),
                    task: Some(task),
                }),
            ));
            self.roster.start_return(Returning { node, was });
            tracing::info!(
                "{host} is started again in the background while the job goes on (tries {}, {}, \
                 {} ... s apart, at most {} s): it comes back once it answers",
                FIRST_TRY.as_secs(),
                FIRST_TRY.as_secs() * 2,
                FIRST_TRY.as_secs() * 4,
                LONGEST_WAIT.as_secs()
            );
        }
    }

    /// Nodes lost earlier whose agents joined again: each passes the checks a late joiner
    /// passes (left out, said why, if not) and becomes a spare, or, where the elastic job is
    /// below its MAX, grows it: true then (the group restarts to take it in). Said with why.
    pub(crate) fn take_back(&mut self) -> bool {
        let mut grows = 0;
        while let Ok(c) = self.returns.rx.try_recv() {
            let Some(r) = self.roster.end_return(c.node) else {
                continue;
            };
            // Its placeholder's try has ended: the link is its agent's now.
            self.nodes[c.node].link = c.link;
            let host = self.nodes[c.node].label.clone();
            if !self.take_joined(c.node) {
                self.leave_out(
                    c.node,
                    Stage::Check,
                    &format!("{host}: its agent, started again, left no join record to read"),
                );
                continue;
            }
            self.check_late(&[c.node]);
            if let Some((_, why)) = self.gpu_trouble().into_iter().find(|(i, _)| *i == c.node) {
                self.leave_out(c.node, Stage::Check, &why);
            }
            if self.is_left_out(c.node) {
                tracing::warn!(
                    "{host} answers again but failed the checks (see above): it stays out"
                );
                continue;
            }
            let Some(lost) = self.roster.left_out().iter().find(|l| l.node == r.was) else {
                continue;
            };
            let (lost_at, cause) = (lost.at, cause(&lost.why));
            let ago = SystemTime::now()
                .duration_since(lost_at)
                .unwrap_or_default()
                .as_secs_f64();
            let active = self.roster.active().len();
            // An elastic job below its MAX grows (a job that is full, or not running, has a spare).
            let grow = active > 0 && active + grows < self.plan.size;
            let now = match grow {
                true => {
                    grows += 1;
                    format!("grows the job to {} nodes", active + grows)
                }
                false => "is a spare now".to_string(),
            };
            tracing::info!(
                "{host} answers again (lost {ago:.0} s ago: {cause}); it passed the checks and \
                 {now}"
            );
            self.roster.came_back(
                r.was,
                Back {
                    at: SystemTime::now(),
                    tries: c.tries,
                },
            );
            self.journal.emit(Event::NodeBack {
                node: c.node,
                host,
                lost_s: (ago * 10.0).round() / 10.0,
                cause: cause.to_string(),
                tries: c.tries,
                now: match grow {
                    true => "grows",
                    false => "spare",
                }
                .to_string(),
            });
        }
        grows > 0
    }

    /// At the job's end: agents that joined again but were not taken yet become their nodes'
    /// links, so that they get the End and leave as the others do.
    pub(super) fn adopt_back(&mut self) {
        while let Ok(c) = self.returns.rx.try_recv() {
            if self.roster.end_return(c.node).is_some() {
                self.nodes[c.node].link = c.link;
            }
        }
    }
}

/// How a node was lost, in short, from its loss's words (the links' words for it:
/// [`super::link::child`]).
fn cause(why: &str) -> &'static str {
    match () {
        _ if why.contains("sent no heartbeat") => "its heartbeat stopped",
        _ if why.contains("when the link to the launch host broke") => {
            "its agent lost its link to this host"
        }
        _ if why.contains("was stopped by") => "its agent was stopped by a signal",
        _ if why.contains("lost its connection to the launch host") => {
            "its agent lost its connection to this host"
        }
        _ => "its agent's connection dropped",
    }
}

/// One lost node's tries: what starts its agent, and where its join shows.
struct Try {
    start: StartAgain,
    again: Arc<Again>,
    node: usize,
    host: String,
    store: Arc<Store>,
    /// Where its agent's join record appears.
    key: Vec<u8>,
    /// How long a try waits for its agent to join (--join-timeout).
    limit: Duration,
    tx: mpsc::UnboundedSender<Came>,
}

impl Try {
    /// Tries until an agent joins (sent to the session) or `stopped` (the job's end): each
    /// try's agent that did not join is killed before the next, and at the stop.
    async fn run(self, mut stopped: oneshot::Receiver<()>) {
        let mut wait = FIRST_TRY;
        let mut tries = 0;
        let mut changed = self.store.subscribe();
        loop {
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = &mut stopped => return,
            }
            tries += 1;
            // A record left by an earlier try's agent is not this one's join.
            let before = self.store.get(&self.key);
            let started = tokio::select! {
                r = (self.start)(self.again.clone(), self.node, self.host.clone()) => r,
                _ = &mut stopped => return,
            };
            let why = match started {
                Err(e) => e.message,
                Ok(mut link) => {
                    let began = Instant::now();
                    let joined = loop {
                        let now = self.store.get(&self.key);
                        if now.is_some() && now != before {
                            break true;
                        }
                        if link.joining() == Joining::Gone || began.elapsed() >= self.limit {
                            break false;
                        }
                        tokio::select! {
                            _ = changed.changed() => {}
                            () = tokio::time::sleep(LOOK) => {}
                            _ = &mut stopped => {
                                link.kill().await;
                                return;
                            }
                        }
                    };
                    if joined {
                        let came = Came {
                            node: self.node,
                            link,
                            tries,
                        };
                        // The session gone: the link goes with the message, its agent killed.
                        if let Err(mpsc::error::SendError(mut c)) = self.tx.send(came) {
                            c.link.kill().await;
                        }
                        return;
                    }
                    let why = link.join_failure(&self.host, began.elapsed(), self.limit);
                    link.kill().await;
                    why
                }
            };
            tracing::debug!(
                "{}: not back yet (try {tries}: {why}); next try in {} s",
                self.host,
                wait.mul_f32(2.0).min(LONGEST_WAIT).as_secs()
            );
            wait = (wait * 2).min(LONGEST_WAIT);
        }
    }
}

/// The placeholder of a node whose agent is being started again: it sits the steps out (its
/// agent, once it joins, takes them as idle ones) and, at the job's end, stops its tries.
struct Coming {
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// A node being started again: no launcher of its own (its tries use its first kind's).
static KIND: Kind = Kind {
    name: "started again",
    start: |_, _| Box::pin(async { Ok(Vec::new()) }),
    check: super::link::any_nodes,
    spawner: false,
    refuses_ship: None,
    in_process: false,
    joins_by_itself: false,
    named_on_join: false,
    join_hint: |np, _| super::link::child::reach_hint(&np.ssh_opts),
    lost_hint: super::link::child::lost_hint,
    unanswered_hint: super::link::child::unanswered_hint,
    again: None,
};

impl Coming {
    /// Stops the tries and waits for them: nothing they started outlives the job.
    async fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl NodeLink for Coming {
    fn kind(&self) -> &'static Kind {
        &KIND
    }

    fn joining(&mut self) -> Joining {
        Joining::Pending
    }

    fn join_failure(&mut self, label: &str, _waited: Duration, _timeout: Duration) -> String {
        format!("{label}: its agent, lost in this job, was being started again")
    }

    fn lost(
        &mut self,
        _bus: &super::link::Bus,
        _node: usize,
        _label: &str,
        _stopped: bool,
    ) -> Option<String> {
        None
    }

    fn end<'a>(&'a mut self, _: Ending<'a>) -> BoxFuture<'a, ()> {
        Box::pin(self.stop())
    }

    fn kill(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(self.stop())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The causes said when a node comes back, from the links' own words for its loss.
    #[test]
    fn a_loss_is_said_in_short() {
        assert_eq!(
            cause(
                "lost the connection to h2: its agent sent no heartbeat for 2.6 s and the \
                 connection was silent"
            ),
            "its heartbeat stopped"
        );
        assert_eq!(
            cause("lost the connection to h2 (exit status: 255): Connection closed"),
            "its agent's connection dropped"
        );
    }
}
