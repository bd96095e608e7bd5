//! Inside a Slurm allocation: every node's agent from one srun step (as PRRTE starts its
//! daemons), each agent finding its node by name in one shared Hello and beating its heartbeat.
//! The coordinator sees one process: a link per node shares it, and a node is lost when the step
//! ends or its heartbeat stops. `--ship` is refused at plan time (srun has no per-node stdin to
//! copy a binary through; `sbcast` is Slurm's way).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

use super::peer::Heartbeat;
use super::{BoxFuture, Bus, Ending, Instructions, Joining, Kind, NodeLink, Nudges};
use crate::agent::child::{AgentProcess, Delivery, Marks, Relay, Starter};
use crate::hosts::Host;
use crate::plan::NodesPlan;
use crate::remote;
use crate::session::Node;
use nrun_base::error::Result;

/// One node of the srun step.
pub(crate) struct StepLink {
    step: Arc<Mutex<AgentProcess>>,
    beat: Heartbeat,
    /// The marks behind each node's output in the step's pipes.
    marks: Option<Arc<Marks>>,
}

/// Nodes whose agents one srun step starts, inside a Slurm allocation.
pub(crate) static KIND: Kind = Kind {
    name: "srun",
    start: |s, hosts| {
        Box::pin(async move {
            let how = Instructions::new(s)?;
            start(s.plan, &s.plan.hosts[hosts], &how, s.nudges).await
        })
    },
    check: super::any_nodes,
    spawner: false,
    refuses_ship: Some(
        "--ship copies nrun to each host over ssh, but here the agents start under srun \
         (a Slurm allocation): put nrun on a path every node sees (--remote-nrun PATH), \
         copy it with `sbcast`, or pass --launcher ssh",
    ),
    in_process: false,
    joins_by_itself: false,
    named_on_join: true,
    join_hint: |_, _| {
        format!(
            "check each with `srun --nodelist=<host> true`, and that nrun {} is at the same path \
             there (--remote-nrun PATH, or `sbcast`)",
            env!("CARGO_PKG_VERSION"),
        )
    },
    lost_hint: |host| {
        format!("check that {host} is up and still in the allocation (`srun -w {host} true`)")
    },
    unanswered_hint: |host| {
        format!("check that {host} still reaches the launch host (`srun -w {host} true`)")
    },
    again: None,
};

/// Starts the one srun step of every node's agent.
pub(crate) async fn start(
    np: &NodesPlan,
    hosts: &[Host],
    how: &Instructions,
    nudges: &Arc<Nudges>,
) -> Result<Vec<Node>> {
    let names: Vec<String> = hosts.iter().map(|h| h.name.clone()).collect();
    // One Hello for every node: the launch host's route to the first of them (a Slurm
    // allocation's nodes share a network) where no address was given.
    let prefer = match names.first() {
        Some(n) => super::child::route_prefer(n).await,
        None => None,
    };
    let hello = how.remote_hello(0, "", prefer, names.clone());
    let starter = Starter::Program(remote::srun_step_command(&names, &np.remote_nrun));
    // Every node's output comes through srun's pipes, each step's ended by its node's marks.
    let relay = Relay {
        nudge: Some((nudges.clone(), Vec::new())),
        tag: None,
        marks: true,
    };
    let process = AgentProcess::spawn(&starter, "the srun step", &hello, relay).await?;
    let marks = process.marks();
    let step = Arc::new(Mutex::new(process));
    Ok(names
        .iter()
        .map(|label| {
            let link = StepLink {
                step: step.clone(),
                beat: Heartbeat::default(),
                marks: marks.clone(),
            };
            Node::new(label, Box::new(link))
        })
        .collect())
}

impl StepLink {
    /// How the step ended and what it said last, if it has ended (unknown while another
    /// link is ending it).
    fn ended(&self) -> Option<String> {
        self.step.try_lock().ok()?.epitaph()
    }
}

impl NodeLink for StepLink {
    fn kind(&self) -> &'static Kind {
        &KIND
    }

    fn joining(&mut self) -> Joining {
        match self.ended() {
            None => Joining::Pending,
            Some(_) => Joining::Gone,
        }
    }

    fn join_failure(&mut self, label: &str, _waited: Duration, timeout: Duration) -> String {
        let why = match self.ended() {
            Some(how) => format!("the srun step of the agents ended{how}"),
            None => format!(
                "its agent did not join within {} s (--join-timeout) though srun still runs: \
                 check that the node reaches this host (and `srun -w {label} true`)",
                timeout.as_secs()
            ),
        };
        format!("{label}: {why}")
    }

    fn lost(&mut self, bus: &Bus, node: usize, label: &str, stopped: bool) -> Option<String> {
        if let Some(how) = self.ended() {
            return Some(format!(
                "lost {label}: the srun step running its agent ended{how}"
            ));
        }
        self.beat.lost(bus, node, label, stopped)
    }

    fn output(&mut self, node: usize, no: usize) -> Delivery {
        self.marks
            .as_ref()
            .map_or(Delivery::Arrived, |m| m.delivery(node, no))
    }

    fn end<'a>(&'a mut self, e: Ending<'a>) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            e.acknowledged().await;
            // The first link here ends the step; the others find it ended.
            self.step.lock().await.finish().await;
        })
    }
}
