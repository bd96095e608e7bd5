//! [`Session::run_step`]: sends each node its numbered step and waits for the results as a
//! [`Policy`] says, the one place that stops nodes on a failure or a signal, forwards signals,
//! feeds the watch, and names lost nodes. It speaks to nodes through their links only.

use std::time::Duration;

use tokio::time::Instant;

use super::Session;
use crate::protocol::{RunResult, Step, StepResult};
use crate::session::link::Delivery;
use nrun_base::error::{Error, Result};
use nrun_node::output::{Resizes, Tty};
use nrun_node::{Caught, StopRequest};

/// How [`Session::run_step`] waits.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Policy {
    /// One job over all nodes: the first failure anywhere stops every node; a signal is
    /// forwarded to every worker, a second one kills.
    Together,
    /// Independent groups (bisect): each runs to its end or until `deadline`.
    Apart { deadline: Duration },
    /// Quick checks: an agent silent for 30 s has lost its connection.
    Probe,
}

/// How long a [`Policy::Probe`] step waits for an answer.
const PROBE_WAIT: Duration = Duration::from_secs(30);

/// How long a node's result waits for the end of its output to come through the pipe that
/// relays its agent (see [`crate::agent::child::Marks`]): a guard against a link that stalls,
/// not a pace (the marks come right behind the lines, milliseconds after the result).
const OUTPUT_WAIT: Duration = Duration::from_secs(30);

/// The result of a step for each node (None: the node had no step, or did not answer).
pub(crate) type Results = Vec<Option<StepResult>>;

/// Why a step's wait ended; how each node's workers ended is in the results beside it.
#[derive(Clone, Debug)]
pub(crate) enum StepEnd {
    /// Every node with the step answered, and nothing stopped them.
    Done,
    /// A node failed (its workers, or its link): in a job, every node was asked to stop.
    Failed,
    /// The watch found the job hung, or its ranks calling a collective differently, and
    /// stopped it (`--on-hang stop`); said first, whatever else ended the step meanwhile.
    Hung(crate::watch::Stop),
    /// Elastic: a node waited to join, and the group was stopped to re-form with it.
    Grow,
    /// The user's stop signal, forwarded to every worker, whose ends were waited for (a second
    /// signal, or a step that is no job's, ends the wait at once: [`Session::run_step`]'s Err).
    Interrupted,
    /// The policy's wait ran out (a probe's, or the groups' deadline) before every node
    /// answered.
    TimedOut,
}

/// A step's end: why, and each node's result.
#[derive(Debug)]
pub(crate) struct Ended {
    pub results: Results,
    pub ending: StepEnd,
}

/// What one wait has done so far.
#[derive(Default)]
struct Waiting {
    /// Every node was asked to stop (a failure, a hang, a signal, arrivals).
    stopped: bool,
    /// The watch asked to stop the job (the last time it did).
    hung: Option<crate::watch::Stop>,
    /// Nodes arrived to take in (elastic), and the group was stopped for them.
    grow: bool,
    /// A node failed.
    failed: bool,
    /// Stop signals the user sent.
    signalled: usize,
    /// Since when a node's result waits for the end of its output.
    held: std::collections::HashMap<usize, Instant>,
    /// The ranks each node runs in this step.
    ranks: Vec<Vec<usize>>,
}

impl Waiting {
    /// Why the wait ended, every node having answered (or the wait having run out).
    fn ending(&mut self, timed_out: bool) -> StepEnd {
        if let Some(stop) = self.hung.take() {
            return StepEnd::Hung(stop);
        }
        match (self.grow, timed_out, self.failed, self.signalled > 0) {
            (true, ..) => StepEnd::Grow,
            (_, true, ..) => StepEnd::TimedOut,
            (_, _, true, _) => StepEnd::Failed,
            (.., true) => StepEnd::Interrupted,
            _ => StepEnd::Done,
        }
    }
}

impl Session {
    /// Sends each node its step (`None`: the node sits this step out) and waits for the results
    /// as `policy` says: they, and why the step ended. `Err`: interrupted without waiting for
    /// the workers' ends, with the exit code.
    pub(crate) async fn run_step(
        &mut self,
        mut steps: Vec<Option<Step>>,
        policy: Policy,
    ) -> Result<Ended> {
        self.stamp_succession(&mut steps);
        let no = self.step;
        self.step += 1;
        let mut waiting = Vec::new();
        let ranks = steps
            .iter()
            .map(|s| match s {
                Some(Step::Run { workers, .. }) => workers.iter().map(|w| w.rank).collect(),
                _ => Vec::new(),
            })
            .collect();
        for (i, s) in steps.iter().enumerate() {
            if self.nodes[i].link.deliver(&self.bus, i, no, s.as_ref()) {
                waiting.push(i);
            }
        }
        // A node served in this process does its part here, beside the wait (see link::inproc).
        let work = self
            .nodes
            .iter_mut()
            .filter_map(|n| n.link.local_work())
            .collect();
        let began = Instant::now();
        let ((), results) = tokio::join!(
            super::link::join_all(work),
            self.wait(no, &waiting, policy, ranks)
        );
        // Where a launch's time goes, step by step (benchmarks at scale).
        tracing::debug!(
            "step {no} ({} nodes, {policy:?}) took {:.3} s",
            waiting.len(),
            began.elapsed().as_secs_f64()
        );
        results
    }

    /// Waits for the results of step `no` from the nodes in `waiting`.
    async fn wait(
        &mut self,
        no: usize,
        waiting: &[usize],
        policy: Policy,
        ranks: Vec<Vec<usize>>,
    ) -> Result<Ended> {
        let mut results: Results = vec![None; self.nodes.len()];
        let started = Instant::now();
        let mut changed = self.store().map(|s| s.subscribe());
        let wake = self.bus.wake.clone();
        let hosts: Vec<String> = self.nodes.iter().map(|n| n.label.clone()).collect();
        // The views last read, so an unchanged one is not parsed again.
        let mut last_views: Vec<Vec<u8>> = vec![Vec::new(); self.nodes.len()];
        let mut w = Waiting {
            ranks,
            ..Waiting::default()
        };
        // Counted as results arrive: a node is looked at when a key of its changed or its link
        // nudged, every node on the periodic look (a silent heartbeat, an srun step) and when
        // work in this process woke the wait.
        let mut waited = vec![false; self.nodes.len()];
        for &i in waiting {
            waited[i] = true;
        }
        let mut left = waiting.len();
        let mut looked: Option<Instant> = None;
        let agents = self.nodes.iter().any(|n| !n.link.kind().in_process);
        let mut console = Console::watch(matches!(policy, Policy::Together) && agents);
        let mut look_all = true;
        loop {
            let touched = super::link::touched(&self.bus);
            let look: Vec<usize> = match touched {
                Some(t) if !look_all && looked.is_some_and(|at| at.elapsed() < super::LOOK_ALL) => {
                    // A key may name a node this session does not have (a client's own key).
                    t.into_iter()
                        .filter(|&i| waited.get(i) == Some(&true))
                        .collect()
                }
                _ => {
                    looked = Some(Instant::now());
                    waiting.to_vec()
                }
            };
            look_all = false;
            for &i in &look {
                if results[i].is_none() {
                    results[i] = self.node_result(i, no, &mut w);
                    if let Some(r) = &results[i] {
                        left -= 1;
                        w.failed |= matches!(r, StepResult::Run(r) if r.is_failure());
                    }
                    if w.failed && !w.stopped {
                        self.journal.fault(0.0);
                    }
                }
            }
            let timed_out = match policy {
                Policy::Probe => started.elapsed() > PROBE_WAIT,
                Policy::Apart { deadline } => started.elapsed() > deadline,
                Policy::Together => false,
            };
            if left == 0 || timed_out {
                if matches!(policy, Policy::Probe) && left > 0 {
                    self.unanswered(waiting, &mut results);
                }
                let ending = w.ending(left > 0);
                return Ok(Ended { results, ending });
            }
            let together = matches!(policy, Policy::Together);
            // Elastic, as torchrun: a node waiting to join makes the group re-form with it.
            if together && !w.stopped && self.arrivals() {
                tracing::warn!("a node joined: the worker group restarts to take it in");
                w.grow = true;
                self.stop_step(no, None, &mut w);
            }
            if together && w.failed && !w.stopped {
                self.stop_step(no, None, &mut w);
            }
            if self.watch.is_some() {
                self.read_views(no, &look, &mut last_views);
                let hang = self.watch.as_mut().and_then(|ws| ws.check(&hosts));
                if hang.is_some() && !w.stopped {
                    self.journal.hang_stops(self.watch.as_ref());
                    self.stop_step(no, None, &mut w);
                }
                // A hang found after the group was stopped for another reason still says why
                // its ranks did not end.
                w.hung = hang.or(w.hung.take());
            }
            self.journal.tick(self.watch.as_mut(), &hosts);
            tokio::select! {
                // An agent's record arrived.
                () = super::store_changed(&mut changed) => {}
                // The in-process node finished its part (it reads no store key).
                () = wake.notified() => look_all = true,
                // An agent's process ended (a dropped ssh).
                () = self.bus.nudges.notify.notified() => {}
                // The watch's clock, and the periodic look (a dead host's heartbeat).
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                caught = self.signals.recv() => self.caught(no, caught, together, &mut w)?,
                sizes = Console::resized(&mut console) => self.bus.resize(no, sizes),
            }
        }
    }

    /// What a quick check's nodes in `waiting` that did not answer in time get, each with what
    /// to check in its kind's words.
    fn unanswered(&self, waiting: &[usize], results: &mut Results) {
        for &i in waiting {
            let label = &self.nodes[i].label;
            let hint = (self.nodes[i].link.kind().unanswered_hint)(label);
            results[i].get_or_insert_with(|| StepResult::Probe {
                error: Some(format!(
                    "{label}'s agent did not answer within {} s; {hint}",
                    PROBE_WAIT.as_secs()
                )),
            });
        }
    }

    /// A signal the user sent during step `no`: forwarded, or a stop (a second one kills).
    /// `Err`: the wait ends, interrupted.
    fn caught(&mut self, no: usize, caught: Caught, together: bool, w: &mut Waiting) -> Result<()> {
        let sig = match caught {
            Caught::Stop(sig) => sig,
            Caught::Forward(sig) => {
                self.forward(no, sig);
                return Ok(());
            }
            // Slurm signalled every process of the step, on every node: passed on by no one.
            Caught::Delivered(sig) => {
                tracing::debug!(
                    "{}: Slurm sent it to every process of the step; not passed on",
                    nrun_node::signal_name(sig)
                );
                self.request_all(StopRequest::Delivered(sig));
                return Ok(());
            }
        };
        w.signalled += 1;
        if w.signalled >= 2 {
            w.stopped = true;
            self.request_all(StopRequest::Kill(sig));
        } else {
            self.stop_step(no, Some(sig), w);
        }
        // A job waits for its workers to stop; a second signal stops waiting, and other kinds
        // of steps stop waiting at once.
        if w.signalled >= 2 || !together {
            tracing::warn!("interrupted; stopping every node");
            return Err(Error::interrupted(sig));
        }
        Ok(())
    }

    /// The views the nodes of step `no` published since they were last read, into the watch.
    fn read_views(&mut self, no: usize, waiting: &[usize], last: &mut [Vec<u8>]) {
        let Some(ws) = self.watch.as_mut() else {
            return;
        };
        for &i in waiting {
            while let Some(v) = self.nodes[i].link.view(&self.bus, i, no, &mut last[i]) {
                ws.observe(i, v);
            }
        }
    }

    /// Gives every link a request (those that read the store's keys ignore it).
    fn request_all(&mut self, req: StopRequest) {
        for n in &mut self.nodes {
            n.link.request(req);
        }
    }

    /// Passes signal `sig` to every worker of step `no` on every node.
    fn forward(&mut self, no: usize, sig: i32) {
        self.bus.signal(no, sig);
        self.request_all(StopRequest::Forward(sig));
    }

    /// Asks every node to stop step `no`: forwarding the user's signal, or politely.
    fn stop_step(&mut self, no: usize, signal: Option<i32>, w: &mut Waiting) {
        w.stopped = true;
        self.journal.stopping();
        self.bus.stop(no, signal);
        self.request_all(signal.map_or(StopRequest::Polite, StopRequest::Signal));
    }

    /// Node `i`'s result of step `no`, if it has one or is lost. A result is taken once every
    /// line of the node's workers is on this host's console (the result of a node whose output
    /// a pipe relays comes through the store, faster than its lines): else the output was
    /// lost on the way, and so is the node, named with its ranks, whose ends were not all heard.
    fn node_result(&mut self, i: usize, no: usize, w: &mut Waiting) -> Option<StepResult> {
        let n = &mut self.nodes[i];
        let r = n.link.result(&self.bus, i, no, &n.label, w.stopped)?;
        let ran = |ranks: &[usize]| match ranks {
            [] => String::new(),
            [r] => format!("; rank {r} ran there and its end was never reported"),
            _ => format!(
                "; ranks {} ran there and their ends were never reported",
                ranks
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let ranks = w.ranks.get(i).map_or(&[][..], |r| &r[..]);
        let missing = match &r {
            StepResult::Run(RunResult::Lost(why)) => {
                return Some(StepResult::Run(RunResult::Lost(format!(
                    "{why}{}",
                    ran(ranks)
                ))));
            }
            StepResult::Run(_) => match n.link.output(i, no) {
                Delivery::Arrived => return Some(r),
                Delivery::Pending { console, moved } => {
                    let held = w.held.entry(i).or_insert_with(|| {
                        tracing::debug!("{}: result of step {no} waits for its output", n.label);
                        Instant::now()
                    });
                    // This host's console is behind (a paused pager): the link is not at fault.
                    if console {
                        *held = Instant::now();
                    }
                    // Lines still coming through are progress: the wait runs from the last.
                    let since = moved.map_or(*held, |m| Instant::from_std(m).max(*held));
                    if since.elapsed() < OUTPUT_WAIT {
                        return None;
                    }
                    format!(
                        "did not reach this host: nothing came through for {} s after its result",
                        OUTPUT_WAIT.as_secs()
                    )
                }
                Delivery::Cut(pipe) => format!("was cut off: its agent's {pipe} ended first"),
            },
            _ => return Some(r),
        };
        let label = &n.label;
        Some(StepResult::Run(RunResult::Lost(format!(
            "lost {label}'s output: the end of its workers' output {missing}, so lines of its \
             ranks ({}) may be missing here; the link that relays its agent (ssh, srun) broke \
             or stalls: check that {label} is reachable and not overloaded",
            ranks
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))))
    }
}

/// The launcher's terminal, watched during a job's step: its agents' workers have terminals
/// of its size (less their prefix) and are told its sizes at the step's start and when they
/// change (the in-process node's workers follow nrun's terminal by themselves, in the node's
/// own loop).
struct Console {
    resizes: Option<Resizes>,
    /// None: not told yet.
    sent: Option<[Option<Tty>; 2]>,
}

impl Console {
    /// None where no node has an agent to tell, or neither of nrun's outputs is a terminal.
    fn watch(agents: bool) -> Option<Console> {
        let terminal = nrun_node::output::console_sizes()
            .iter()
            .any(Option::is_some);
        (agents && terminal).then(|| Console {
            resizes: Some(Resizes::start()),
            sent: None,
        })
    }

    /// The terminal's sizes, once they differ from those last told.
    async fn resized(me: &mut Option<Console>) -> [Option<Tty>; 2] {
        let Some(c) = me else {
            return std::future::pending().await;
        };
        loop {
            Resizes::next(&mut c.resizes).await;
            let now = nrun_node::output::console_sizes();
            if c.sent != Some(now) {
                c.sent = Some(now);
                return now;
            }
        }
    }
}
