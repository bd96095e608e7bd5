//! The single node of a run without a host list, served inside nrun: its steps are done by the
//! agent's own dispatcher ([`crate::agent::exec::dispatch`]) in this process, on the main thread
//! beside the session's wait (the workers' PR_SET_PDEATHSIG relies on the thread that forks them
//! living as long as they do), with the stop requests a remote agent gets through the store.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot, watch};

use super::{BoxFuture, Bus, JoinHere, Joining, Kind, NodeLink};
use crate::agent::exec::{self, Done, StepIo};
use crate::protocol::{NodeWatch, Step, StepResult};
use crate::session::JoinedNode;
use crate::session::Node;
use nrun_node::StopRequest;

/// The in-process node's link: the step it was given, and its running step's channels.
#[derive(Default)]
pub(crate) struct InProcess {
    /// Delivered, not yet started.
    pending: Option<(Step, Option<String>, Arc<Notify>)>,
    stop: Option<watch::Sender<StopRequest>>,
    done: Option<oneshot::Receiver<StepResult>>,
    views: Option<mpsc::UnboundedReceiver<NodeWatch>>,
}

/// The one node of a run without a host list.
pub(crate) static KIND: Kind = Kind {
    name: "in-process",
    start: |s, _| {
        let name = &s.plan.hosts[0].name;
        Box::pin(async move { Ok(vec![Node::new(name, link())]) })
    },
    check: super::any_nodes,
    spawner: false,
    refuses_ship: None,
    in_process: true,
    joins_by_itself: false,
    named_on_join: false,
    join_hint: |_, _| "check this host's node with `nrun doctor`".to_string(),
    lost_hint: super::child::lost_hint,
    unanswered_hint: |_| "check that this host is not overloaded".to_string(),
    again: None,
};

pub(crate) fn link() -> Box<dyn NodeLink> {
    Box::<InProcess>::default()
}

impl NodeLink for InProcess {
    fn kind(&self) -> &'static Kind {
        &KIND
    }

    fn is_local(&self) -> bool {
        true
    }

    fn join_here<'a>(&'a mut self, how: &'a JoinHere) -> Option<BoxFuture<'a, JoinedNode>> {
        Some(Box::pin(async move {
            let facts = match how.facts {
                true => {
                    let py = how.python.clone();
                    tokio::task::spawn_blocking(move || crate::facts::gather(py.as_deref()))
                        .await
                        .ok()
                }
                false => None,
            };
            // A static launch's node finds its interface by the route to node 0's store.
            let ifname = how
                .static_launch
                .then(|| {
                    use std::net::ToSocketAddrs;
                    (how.store_addr.as_str(), how.store_port)
                        .to_socket_addrs()
                        .ok()
                        .and_then(|mut a| a.next())
                        .and_then(nrun_base::net::route_interface)
                })
                .flatten();
            JoinedNode {
                facts,
                link: None,
                ifname,
                master_addr: how.store_addr.clone(),
                addr: None,
            }
        }))
    }

    fn joining(&mut self) -> Joining {
        // It joins in `join_here`, never through an agent.
        Joining::Gone
    }

    fn join_failure(&mut self, label: &str, _waited: Duration, _timeout: Duration) -> String {
        format!("{label}: this host's own node could not join")
    }

    fn deliver(&mut self, bus: &Bus, _node: usize, _no: usize, step: Option<&Step>) -> bool {
        // It has no step loop to keep in line, and nothing to leave at the End.
        let Some(step) = step.filter(|s| !matches!(s, Step::End)) else {
            return false;
        };
        self.pending = Some((step.clone(), bus.secret.clone(), bus.wake.clone()));
        true
    }

    fn local_work(&mut self) -> Option<BoxFuture<'static, ()>> {
        let (step, secret, wake) = self.pending.take()?;
        let (stop_tx, stop) = watch::channel(StopRequest::None);
        let (done_tx, done) = oneshot::channel();
        let (views_tx, views) = mpsc::unbounded_channel();
        self.stop = Some(stop_tx);
        self.done = Some(done);
        self.views = Some(views);
        Some(Box::pin(async move {
            let io = StepIo {
                stop,
                // Views come about once a second: the session's tick reads them.
                views: Some(views_tx),
                secret: secret.clone(),
            };
            if let Done::Result(r) = exec::dispatch(step, io).await {
                let _ = done_tx.send(r);
            }
            wake.notify_one();
        }))
    }

    /// Its result as the dispatcher gave it: an interrupt unasked here is the user's Ctrl-C at
    /// the terminal a rank held, not a node leaving.
    fn result(
        &mut self,
        _bus: &Bus,
        _node: usize,
        _no: usize,
        _label: &str,
        _stopped: bool,
    ) -> Option<StepResult> {
        self.done.as_mut()?.try_recv().ok()
    }

    fn view(
        &mut self,
        _bus: &Bus,
        _node: usize,
        _no: usize,
        _last: &mut Vec<u8>,
    ) -> Option<NodeWatch> {
        self.views.as_mut()?.try_recv().ok()
    }

    fn lost(&mut self, _bus: &Bus, _node: usize, _label: &str, _stopped: bool) -> Option<String> {
        None
    }

    fn request(&mut self, req: StopRequest) {
        if let Some(tx) = &self.stop {
            let _ = tx.send(req);
        }
    }
}
