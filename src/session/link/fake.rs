//! A scripted node for unit tests of the session's policies, with no processes: its "agent" is a
//! task that answers through a real in-memory [`Store`] as a remote agent does (so the session's
//! reading of results, lost nodes and unasked stops is the real one), on tokio's paused clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::{BoxFuture, Bus, Ending, Joining, Kind, NodeLink};
use crate::protocol::{Keys, RunResult, Step, StepResult};
use crate::session::roster::Roster;
use crate::session::{Node, Rendezvous, Session};
use nrun_node::{Signals, StopRequest};
use nrun_store::Store;

/// What a fake node does with the steps it is given.
#[derive(Clone, Debug)]
pub(crate) enum Script {
    /// Answers each step with this after a while.
    Answer(StepResult, Duration),
    /// Runs until asked to stop: then answers Stopped (or Interrupted by the forwarded signal);
    /// a Kill is not needed to make it answer.
    UntilStopped,
    /// Runs until asked to stop, and then never answers (workers that ignore SIGTERM).
    Deaf,
    /// Its agent's process ends after a while, with these last words.
    Dies(Duration, &'static str),
}

/// What a fake node saw, for the test to check.
#[derive(Default, Debug)]
pub(crate) struct Seen {
    pub steps: Vec<(usize, Option<Step>)>,
    pub requests: Vec<StopRequest>,
    pub ended: bool,
}

/// A kind of link of its own, in the one file plus the one line in `link::LAUNCHERS` that any
/// new kind takes: a plan whose launcher is "fake" gets a fake node (answering every step at
/// once) for each host it owns.
pub(crate) static KIND: Kind = Kind {
    name: "fake",
    start: |s, hosts| {
        let nodes = s.plan.hosts[hosts]
            .iter()
            .map(|h| {
                node(
                    &h.name,
                    Script::Answer(StepResult::Run(RunResult::Success), Duration::ZERO),
                )
                .0
            })
            .collect();
        Box::pin(async move { Ok(nodes) })
    },
    check: super::any_nodes,
    spawner: false,
    refuses_ship: Some("--ship: a fake node has no host to copy nrun to"),
    in_process: false,
    joins_by_itself: false,
    named_on_join: false,
    join_hint: |_, _| "a fake node never joins".to_string(),
    lost_hint: |host| format!("{host} is a fake node"),
    unanswered_hint: |host| format!("{host} is a fake node"),
    again: None,
};

pub(crate) struct FakeLink {
    /// Its kind: its own, or one it stands in for (to test what that kind tells the user).
    kind: &'static Kind,
    script: Script,
    seen: Arc<Mutex<Seen>>,
    requests: watch::Sender<StopRequest>,
    started: Option<Instant>,
}

/// A fake node and what it will have seen.
pub(crate) fn node(label: &str, script: Script) -> (Node, Arc<Mutex<Seen>>) {
    node_as(label, script, &KIND)
}

/// A fake node standing in for a node of `kind` (its hints are that kind's).
pub(crate) fn node_as(
    label: &str,
    script: Script,
    kind: &'static Kind,
) -> (Node, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let link = FakeLink {
        kind,
        script,
        seen: seen.clone(),
        requests: watch::channel(StopRequest::None).0,
        started: None,
    };
    (Node::new(label, Box::new(link)), seen)
}

/// A session over `nodes` (joined), with a store of its own and signals a test injects.
pub(crate) fn session(
    nodes: Vec<Node>,
) -> (
    Session,
    tokio::sync::mpsc::UnboundedSender<nrun_node::Caught>,
) {
    let (signals, inject) = Signals::injected();
    let hosts = nodes
        .iter()
        .map(|n| crate::hosts::Host::new(n.label.clone()))
        .collect();
    let mut s = Session {
        plan: crate::plan::NodesPlan::for_tests(hosts),
        nodes,
        rendezvous: Rendezvous {
            addr: "127.0.0.1".into(),
            port: 0,
            secret: None,
        },
        run: "fake".into(),
        run_id: "fake".into(),
        bus: Bus {
            store: Some(Store::new()),
            keys: Keys::new("fake"),
            secret: None,
            wake: Arc::default(),
            nonces: Default::default(),
            nudges: Arc::default(),
            controls: Default::default(),
            silence: crate::session::link::MIN_SILENCE,
        },
        store_stop: None,
        signals,
        step: 0,
        watch: None,
        roster: Roster::default(),
        arrivals_checked: None,
        c10d_id: None,
        returns: crate::session::again::Returns::new(),
        hosting: None,
        journal: crate::journal::Journal::new("fake"),
    };
    for n in &mut s.nodes {
        n.joined = Some(crate::session::JoinedNode {
            facts: None,
            link: None,
            ifname: None,
            master_addr: "127.0.0.1".into(),
            addr: None,
        });
    }
    s.roster = Roster::of((0..s.nodes.len()).collect());
    (s, inject)
}

impl NodeLink for FakeLink {
    fn kind(&self) -> &'static Kind {
        self.kind
    }

    fn joining(&mut self) -> Joining {
        Joining::Pending
    }

    fn join_failure(&mut self, label: &str, _waited: Duration, _timeout: Duration) -> String {
        format!("{label}: a fake node never joins")
    }

    fn deliver(&mut self, bus: &Bus, node: usize, no: usize, step: Option<&Step>) -> bool {
        self.seen.lock().unwrap().steps.push((no, step.cloned()));
        let Some(step) = step else { return false };
        self.started = Some(Instant::now());
        let (tx, mut rx) = watch::channel(StopRequest::None);
        self.requests = tx;
        let store = bus.store.clone().expect("a fake session has a store");
        let key = bus.keys.result(node, no);
        // Sealed as an agent seals it (`agent::Node::seal`).
        let secret = bus.secret.clone().unwrap_or_default();
        let publish = move |r: StepResult| {
            let json = serde_json::to_vec(&r).unwrap();
            store.set(
                &key,
                &nrun_store::auth::seal(secret.as_bytes(), &key, b"", &json),
            )
        };
        let script = self.script.clone();
        let probe = matches!(step, Step::Probe { .. });
        tokio::spawn(async move {
            let stopped = async {
                let _ = rx.wait_for(|r| r.stops()).await;
                *rx.borrow()
            };
            match script {
                Script::Answer(r, after) => {
                    tokio::time::sleep(after).await;
                    publish(r);
                }
                Script::UntilStopped => {
                    let r = match stopped.await {
                        StopRequest::Signal(sig) | StopRequest::Kill(sig) => {
                            RunResult::Interrupted(sig)
                        }
                        _ => RunResult::Stopped,
                    };
                    match probe {
                        true => publish(StepResult::Probe { error: None }),
                        false => publish(StepResult::Run(r)),
                    }
                }
                Script::Deaf | Script::Dies(..) => std::future::pending().await,
            }
        });
        true
    }

    fn lost(&mut self, _bus: &Bus, _node: usize, label: &str, stopped: bool) -> Option<String> {
        match self.script {
            Script::Dies(after, words) if self.started.is_some_and(|t| t.elapsed() >= after) => {
                Some(format!(
                    "lost the connection to {label} (exit status: 255): {words}"
                ))
            }
            _ => stopped.then(|| format!("lost the connection to {label}: it stopped unasked")),
        }
    }

    fn request(&mut self, req: StopRequest) {
        self.seen.lock().unwrap().requests.push(req);
        let _ = self.requests.send(req);
    }

    fn end<'a>(&'a mut self, _: Ending<'a>) -> BoxFuture<'a, ()> {
        self.seen.lock().unwrap().ended = true;
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::WorkerFailure;
    use crate::session::Policy;
    use crate::session::roster::Stage;
    use crate::session::step::StepEnd;
    use nrun_node::Caught;

    fn run_step() -> Step {
        Step::Run {
            workers: Vec::new(),
            grace_ms: 1000,
            deadline_ms: None,
            watch: false,
            hang_timeout_ms: None,
            succession: None,
        }
    }

    fn failed(rank: usize) -> StepResult {
        StepResult::Run(RunResult::Failed(WorkerFailure {
            rank,
            local_rank: 0,
            pid: 1,
            exit_code: 3,
            how: crate::protocol::Ending::Exit(nrun_node::Exit::Code(3)),
            gpu: None,
            at: String::new(),
            stderr_tail: Vec::new(),
            traceback: None,
            error_file: Default::default(),
            left_early: Vec::new(),
            error_json: None,
            error_file_kept: false,
            progress: None,
        }))
    }

    fn ok() -> StepResult {
        StepResult::Run(RunResult::Success)
    }

    fn is(r: &Option<StepResult>, f: impl Fn(&RunResult) -> bool) -> bool {
        matches!(r, Some(StepResult::Run(x)) if f(x))
    }

    #[tokio::test(start_paused = true)]
    async fn together_the_first_failure_stops_every_other_node() {
        let (a, _) = node("a", Script::Answer(failed(0), Duration::from_millis(200)));
        let (b, seen_b) = node("b", Script::UntilStopped);
        let (c, seen_c) = node("c", Script::UntilStopped);
        let (mut s, _sig) = session(vec![a, b, c]);
        let steps = vec![Some(run_step()); 3];
        let ended = s.run_step(steps, Policy::Together).await.unwrap();
        assert!(
            matches!(ended.ending, StepEnd::Failed),
            "{:?}",
            ended.ending
        );
        let r = ended.results;
        assert!(is(
            &r[0],
            |x| matches!(x, RunResult::Failed(f) if f.rank == 0)
        ));
        assert!(is(&r[1], |x| matches!(x, RunResult::Stopped)));
        assert!(is(&r[2], |x| matches!(x, RunResult::Stopped)));
        assert_eq!(seen_b.lock().unwrap().requests, [StopRequest::Polite]);
        assert_eq!(seen_c.lock().unwrap().requests, [StopRequest::Polite]);
    }

    #[tokio::test(start_paused = true)]
    async fn together_a_lost_node_is_named_by_its_link_and_stops_the_rest() {
        let (a, _) = node(
            "a",
            Script::Dies(Duration::from_secs(2), "Connection reset by peer"),
        );
        let (b, seen_b) = node("b", Script::UntilStopped);
        let (mut s, _sig) = session(vec![a, b]);
        let ended = s
            .run_step(vec![Some(run_step()); 2], Policy::Together)
            .await
            .unwrap();
        assert!(
            matches!(ended.ending, StepEnd::Failed),
            "{:?}",
            ended.ending
        );
        let r = ended.results;
        assert!(is(&r[0], |x| matches!(x, RunResult::Lost(w)
            if w == "lost the connection to a (exit status: 255): Connection reset by peer")));
        assert!(is(&r[1], |x| matches!(x, RunResult::Stopped)));
        assert_eq!(seen_b.lock().unwrap().requests, [StopRequest::Polite]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_agent_that_stops_or_is_interrupted_unasked_is_lost() {
        let stopped = StepResult::Run(RunResult::Stopped);
        let interrupted = StepResult::Run(RunResult::Interrupted(libc::SIGTERM));
        let (a, _) = node("a", Script::Answer(stopped, Duration::from_millis(10)));
        let (b, _) = node("b", Script::Answer(interrupted, Duration::from_millis(10)));
        let (mut s, _sig) = session(vec![a, b]);
        let r = s
            .run_step(
                vec![Some(run_step()); 2],
                Policy::Apart {
                    deadline: Duration::from_secs(5),
                },
            )
            .await
            .unwrap()
            .results;
        assert!(is(
            &r[0],
            |x| matches!(x, RunResult::Lost(w) if w.contains("a: it stopped unasked"))
        ));
        assert!(is(
            &r[1],
            |x| matches!(x, RunResult::Lost(w) if w == "b's agent was stopped by SIGTERM on that node")
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn apart_groups_run_to_their_end_or_the_deadline_and_stop_nobody() {
        let (a, seen_a) = node("a", Script::Answer(failed(0), Duration::from_secs(1)));
        let (b, _) = node("b", Script::Answer(ok(), Duration::from_secs(3)));
        let (c, seen_c) = node("c", Script::Deaf);
        let (mut s, _sig) = session(vec![a, b, c]);
        let t = Instant::now();
        let deadline = Duration::from_secs(10);
        let ended = s
            .run_step(vec![Some(run_step()); 3], Policy::Apart { deadline })
            .await
            .unwrap();
        assert!(
            matches!(ended.ending, StepEnd::TimedOut),
            "{:?}",
            ended.ending
        );
        let r = ended.results;
        assert!(is(&r[0], |x| matches!(x, RunResult::Failed(_))));
        assert!(is(&r[1], |x| matches!(x, RunResult::Success)));
        assert!(r[2].is_none(), "a node that never answers has no result");
        assert!(t.elapsed() >= deadline && t.elapsed() < deadline + Duration::from_secs(1));
        assert!(seen_a.lock().unwrap().requests.is_empty());
        assert!(seen_c.lock().unwrap().requests.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn probe_a_silent_agent_is_named_after_30_s() {
        let (a, _) = node("a", Script::UntilStopped);
        // A node started over ssh: its hint is ssh's.
        let (b, _) = node_as("b", Script::Deaf, &crate::session::link::child::KIND);
        let (mut s, _sig) = session(vec![a, b]);
        let probe = Step::Probe {
            target: "10.0.0.2:1".into(),
            timeout_ms: 100,
        };
        let t = Instant::now();
        let ended = s
            .run_step(vec![None, Some(probe)], Policy::Probe)
            .await
            .unwrap();
        assert!(
            matches!(ended.ending, StepEnd::TimedOut),
            "{:?}",
            ended.ending
        );
        let r = ended.results;
        assert!(
            r[0].is_none(),
            "a node sitting the step out is not waited for"
        );
        match &r[1] {
            Some(StepResult::Probe { error: Some(e) }) => {
                assert_eq!(
                    e,
                    "b's agent did not answer within 30 s; check that the launch host still reaches it (ssh b true)"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed() >= Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn sitting_out_keeps_the_count_of_steps_and_needs_no_answer() {
        let (a, seen_a) = node("a", Script::Answer(ok(), Duration::from_millis(5)));
        let (b, seen_b) = node("b", Script::Deaf);
        let (mut s, _sig) = session(vec![a, b]);
        for _ in 0..2 {
            let ended = s
                .run_step(vec![Some(run_step()), None], Policy::Together)
                .await
                .unwrap();
            assert!(matches!(ended.ending, StepEnd::Done), "{:?}", ended.ending);
        }
        let steps: Vec<(usize, bool)> = seen_b
            .lock()
            .unwrap()
            .steps
            .iter()
            .map(|(n, s)| (*n, s.is_some()))
            .collect();
        assert_eq!(steps, [(0, false), (1, false)]);
        assert_eq!(seen_a.lock().unwrap().steps.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_signal_is_forwarded_and_a_second_one_kills_and_stops_waiting() {
        let (a, seen_a) = node("a", Script::Deaf);
        let (b, seen_b) = node("b", Script::Deaf);
        let (mut s, sig) = session(vec![a, b]);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            sig.send(Caught::Forward(libc::SIGUSR1)).unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            sig.send(Caught::Stop(libc::SIGINT)).unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            sig.send(Caught::Stop(libc::SIGINT)).unwrap();
        });
        let code = s
            .run_step(vec![Some(run_step()); 2], Policy::Together)
            .await
            .unwrap_err()
            .code;
        assert_eq!(code, nrun_base::error::exit::signal(libc::SIGINT));
        let want = [
            StopRequest::Forward(libc::SIGUSR1),
            StopRequest::Signal(libc::SIGINT),
            StopRequest::Kill(libc::SIGINT),
        ];
        assert_eq!(seen_a.lock().unwrap().requests, want);
        assert_eq!(seen_b.lock().unwrap().requests, want);
        // Agents read the same through the store, in order: the signal passed on, then the
        // stop with the user's signal.
        use crate::protocol::Control;
        let control = |seq| {
            let v = s.store().unwrap().get(&s.keys().control(0, seq));
            v.and_then(|v| Control::decode(&v))
        };
        assert_eq!(control(0), Some(Control::Forward(libc::SIGUSR1)));
        assert_eq!(control(1), Some(Control::Stop(Some(libc::SIGINT))));
        assert_eq!(control(2), None);
    }

    #[tokio::test(start_paused = true)]
    async fn one_signal_stops_the_job_and_waits_for_its_workers() {
        let (a, _) = node("a", Script::UntilStopped);
        let (b, _) = node("b", Script::UntilStopped);
        let (mut s, sig) = session(vec![a, b]);
        sig.send(Caught::Stop(libc::SIGTERM)).unwrap();
        let ended = s
            .run_step(vec![Some(run_step()); 2], Policy::Together)
            .await
            .unwrap();
        assert!(
            matches!(ended.ending, StepEnd::Interrupted),
            "{:?}",
            ended.ending
        );
        let r = ended.results;
        for x in &r {
            assert!(
                is(
                    x,
                    |x| matches!(x, RunResult::Interrupted(s) if *s == libc::SIGTERM)
                ),
                "{x:?}"
            );
        }
    }

    /// Elastic: a node that joins while the group runs stops it, and the step says so (the job
    /// re-forms with the node; no side flag carries it).
    #[tokio::test(start_paused = true)]
    async fn a_node_that_joins_mid_step_ends_it_to_grow() {
        let (a, seen_a) = node("a", Script::UntilStopped);
        let (b, seen_b) = node("b", Script::UntilStopped);
        let (c, _) = node("c", Script::Deaf);
        let (mut s, _sig) = session(vec![a, b, c]);
        s.nodes[2].joined = None;
        s.roster = Roster::of(vec![0, 1]);
        s.plan.min_nodes = 2;
        s.store().unwrap().set(&s.keys().joined(2), b"{}");
        let ended = s
            .run_step(
                vec![Some(run_step()), Some(run_step()), None],
                Policy::Together,
            )
            .await
            .unwrap();
        assert!(matches!(ended.ending, StepEnd::Grow), "{:?}", ended.ending);
        assert!(is(&ended.results[0], |x| matches!(x, RunResult::Stopped)));
        assert_eq!(seen_a.lock().unwrap().requests, [StopRequest::Polite]);
        assert_eq!(seen_b.lock().unwrap().requests, [StopRequest::Polite]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_signal_stops_waiting_at_once_outside_a_job() {
        let (a, seen_a) = node("a", Script::Deaf);
        let (mut s, sig) = session(vec![a]);
        sig.send(Caught::Stop(libc::SIGINT)).unwrap();
        let deadline = Duration::from_secs(60);
        let code = s
            .run_step(vec![Some(run_step())], Policy::Apart { deadline })
            .await
            .unwrap_err()
            .code;
        assert_eq!(code, 130);
        assert_eq!(
            seen_a.lock().unwrap().requests,
            [StopRequest::Signal(libc::SIGINT)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_reaches_every_link() {
        let (a, seen_a) = node("a", Script::Deaf);
        let (b, seen_b) = node("b", Script::Deaf);
        let (s, _sig) = session(vec![a, b]);
        s.end_with(3).await;
        for seen in [seen_a, seen_b] {
            let seen = seen.lock().unwrap();
            assert!(seen.ended);
            assert!(matches!(seen.steps.last(), Some((0, Some(Step::End)))));
        }
    }

    /// Three nodes for a job of two: the third is a spare; a node lost mid-run leaves, the
    /// spare comes in, ranks renumbered by node order; without a spare the job is short (98).
    #[tokio::test(start_paused = true)]
    async fn a_lost_node_is_left_out_and_a_spare_takes_its_place() {
        let (a, _) = node("a", Script::UntilStopped);
        let (b, _) = node(
            "b",
            Script::Dies(Duration::from_secs(1), "Connection reset by peer"),
        );
        let (c, seen_c) = node("c", Script::UntilStopped);
        let (mut s, _sig) = session(vec![a, b, c]);
        s.plan.size = 2;
        s.plan.min_nodes = 2;
        s.plan.world = 2;
        s.plan.group_world = 2;
        s.roster = Roster::of(vec![0, 1]);
        assert_eq!(s.spares(), [2]);
        let mut steps = vec![None; 3];
        for m in &s.group().members {
            steps[m.node] = Some(run_step());
        }
        let r = s.run_step(steps, Policy::Together).await.unwrap().results;
        // The spare sat the step out.
        let seen: Vec<(usize, bool)> = seen_c
            .lock()
            .unwrap()
            .steps
            .iter()
            .map(|(no, st)| (*no, st.is_some()))
            .collect();
        assert_eq!(seen, [(0, false)]);
        let lost: Vec<(usize, Stage, String)> = r
            .iter()
            .enumerate()
            .filter_map(|(i, x)| match x {
                Some(StepResult::Run(RunResult::Lost(w))) => Some((i, Stage::Lost, w.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(lost.len(), 1);
        assert_eq!(lost[0].0, 1);
        s.reform(&lost).unwrap();
        assert_eq!(s.roster().active(), [0, 2]);
        assert!(s.spares().is_empty());
        assert_eq!(s.roster().left_out().len(), 1);
        assert_eq!(s.roster().left_out()[0].host, "b");
        assert!(
            s.roster().left_out()[0]
                .why
                .contains("Connection reset by peer")
        );
        let g = s.group();
        let placed: Vec<(usize, usize)> =
            g.members.iter().map(|m| (m.node, m.group_rank)).collect();
        assert_eq!(placed, [(0, 0), (2, 1)]);
        assert_eq!(g.members[1].ranks, [(1, 0)]);
        assert_eq!((g.world, g.group_world), (2, 2));
        // Now no spare is left: losing another node leaves the job short, exit 98.
        let e = s
            .reform(&[(0, Stage::Lost, "lost a".to_string())])
            .unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::NO_NODES);
        assert!(
            e.message.contains("needs 2 healthy node(s) but has 1 (c)"),
            "{}",
            e.message
        );
        assert!(e.message.contains("b (run): "), "{}", e.message);
        assert!(e.message.contains("a (run): lost a"), "{}", e.message);
    }

    /// A node whose GPU is sick or missing is named with the evidence; a node with its GPUs
    /// well is not; nodes without GPUs in a job without GPUs are not.
    #[tokio::test(start_paused = true)]
    async fn sick_or_missing_gpus_are_pinned_on_their_node() {
        use nrun_preflight::hardware::Health;
        let (a, _) = node("a", Script::UntilStopped);
        let (b, _) = node("b", Script::UntilStopped);
        let (c, _) = node("c", Script::UntilStopped);
        let (mut s, _sig) = session(vec![a, b, c]);
        let well = Health {
            temperature_c: Some(40),
            persistence: Some(true),
            ecc_uncorrected: Some(0),
            pages_pending_retirement: Some(false),
            slowdowns: vec![],
            mig: Some(false),
            remap_pending: Some(false),
            remap_failed: Some(false),
            nvlink_errors: Some(0),
        };
        assert!(s.gpu_trouble().is_empty());
        let facts = |gpus: usize, h: &Health| crate::facts::Facts {
            gpus: vec!["H200".into(); gpus],
            gpu_health: (0..gpus)
                .map(|g| (format!("0000:0{g}:00.0"), h.clone()))
                .collect(),
            ..Default::default()
        };
        let sick = Health {
            ecc_uncorrected: Some(7),
            ..well.clone()
        };
        s.nodes[0].joined.as_mut().unwrap().facts = Some(facts(1, &well));
        s.nodes[1].joined.as_mut().unwrap().facts = Some(facts(1, &sick));
        s.nodes[2].joined.as_mut().unwrap().facts = Some(facts(0, &well));
        let t = s.gpu_trouble();
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!(t[0].0, 1);
        assert!(
            t[0].1.starts_with("b: unhealthy GPU (GPU 0000:00:00.0: "),
            "{}",
            t[0].1
        );
        assert_eq!(t[1].0, 2);
        assert!(
            t[1].1.contains("c: has 0 GPU(s) for its 1 workers"),
            "{}",
            t[1].1
        );
    }

    /// Elastic c10d, a node come back: after a node's loss the host publishes room for one
    /// more; the node's nrun joins with the rendezvous' next index, which becomes a node of its
    /// own (the steps so far given to it as idle ones, sealed for no join) and is taken in under
    /// its host's name. A host left out on evidence against the node itself is published as
    /// refused, with that evidence, and a node of it that joined all the same is left out.
    #[tokio::test(start_paused = true)]
    async fn a_node_that_comes_back_gets_a_new_index_unless_its_host_was_refused() {
        use crate::protocol::{Joined, c10d_next_key, c10d_refused_key, c10d_room_key};
        let (a, _) = node("a", Script::UntilStopped);
        let (b, _) = node("b", Script::UntilStopped);
        let (mut s, _sig) = session(vec![a, b]);
        s.plan.min_nodes = 1;
        s.c10d_id = Some("j".into());
        for (i, host) in ["ha", "hb"].iter().enumerate() {
            let facts = crate::facts::Facts {
                hostname: host.to_string(),
                ..Default::default()
            };
            s.nodes[i].joined.as_mut().unwrap().facts = Some(facts);
        }
        let st = s.store().unwrap().clone();
        let room = || String::from_utf8(st.get(&c10d_room_key("j")).unwrap()).unwrap();
        s.step = 3;
        s.reform(&[(
            1,
            Stage::Lost,
            "lost b: its agent closed its connection".into(),
        )])
        .unwrap();
        assert_eq!(s.roster().active(), [0]);
        assert_eq!(room(), "1");
        assert!(!st.contains(&c10d_refused_key("j", "hb")));
        // The same host's nrun again: index 2 (the host is 0, b was 1).
        st.set(&c10d_next_key("j"), b"2");
        let joined = |host: &str| Joined {
            local_addr: String::new(),
            reached: String::new(),
            chosen: Default::default(),
            probe_addr: String::new(),
            nonce: "n2".into(),
            facts: crate::facts::Facts {
                hostname: host.into(),
                ..Default::default()
            },
            own_sealed: None,
            kept: None,
        };
        st.set(
            &s.keys().joined(2),
            &serde_json::to_vec(&joined("hb")).unwrap(),
        );
        s.arrivals_checked = None;
        assert!(s.arrivals());
        assert_eq!(s.admit_late(), [2]);
        assert_eq!(s.nodes[2].label, "hb");
        assert_eq!(s.plan.layout.len(), 3);
        for no in 0..3 {
            let raw = st.get(&s.keys().step(2, no)).unwrap();
            let json = nrun_store::auth::open(b"", &s.keys().step(2, no), b"", &raw).unwrap();
            assert!(
                !serde_json::from_slice::<Step>(&json)
                    .unwrap()
                    .runs_workers()
            );
        }
        assert_eq!(s.spares(), [2]);

        // A host left out on the node's own evidence is refused, and no room is left for it.
        s.leave_out(2, Stage::Preflight, "its all-reduce results were wrong");
        s.fill().unwrap();
        let why = st.get(&c10d_refused_key("j", "hb")).unwrap();
        assert!(
            String::from_utf8_lossy(&why)
                .contains("(preflight): its all-reduce results were wrong"),
            "{}",
            String::from_utf8_lossy(&why)
        );
        st.set(&c10d_next_key("j"), b"3");
        st.set(
            &s.keys().joined(3),
            &serde_json::to_vec(&joined("hb")).unwrap(),
        );
        s.fill().unwrap();
        assert!(s.is_left_out(3));
        let l = s.roster().left_out().iter().find(|l| l.node == 3).unwrap();
        assert!(l.why.contains("left out earlier in this job"), "{}", l.why);
        assert_eq!(s.roster().active(), [0]);
    }

    /// Each kind words its own hints: a node an srun step started, or one whose own nrun joined
    /// (c10d), is never told to check ssh, whether it did not answer, was lost or did not join.
    #[tokio::test(start_paused = true)]
    async fn an_srun_or_c10d_node_gets_its_own_hint_and_none_about_ssh() {
        use crate::session::link::{child, peer, srun};
        let (a, _) = node_as("a", Script::Deaf, &srun::KIND);
        let (b, _) = node_as("b", Script::Deaf, &peer::KIND);
        let (c, _) = node_as("c", Script::Deaf, &child::KIND);
        let (mut s, _sig) = session(vec![a, b, c]);
        let probe = || {
            Some(Step::Probe {
                target: "10.0.0.2:1".into(),
                timeout_ms: 100,
            })
        };
        let r = s
            .run_step(vec![probe(), probe(), probe()], Policy::Probe)
            .await
            .unwrap()
            .results;
        let said: Vec<String> = r
            .iter()
            .map(|r| match r {
                Some(StepResult::Probe { error: Some(e) }) => e.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(said[0].contains("`srun -w a true`"), "{}", said[0]);
        assert!(said[1].contains("b's nrun still runs"), "{}", said[1]);
        assert!(said[2].contains("(ssh c true)"), "{}", said[2]);
        let rdzv = s.rendezvous.clone();
        for (n, said) in s.nodes.iter().zip(&said).take(2) {
            let k = n.link.kind();
            let hints = [
                said.clone(),
                (k.lost_hint)(&n.label),
                (k.join_hint)(&s.plan, &rdzv),
            ];
            for h in hints {
                assert!(!h.contains("ssh"), "{}: {h}", k.name);
            }
        }
        let srun_join = (srun::KIND.join_hint)(&s.plan, &rdzv);
        assert!(
            srun_join.contains("`srun --nodelist=<host> true`"),
            "{srun_join}"
        );
        let peer_join = (peer::KIND.join_hint)(&s.plan, &rdzv);
        assert!(peer_join.contains("--rdzv-endpoint"), "{peer_join}");
        assert!((child::KIND.join_hint)(&s.plan, &rdzv).contains("`ssh <host> true`"));
    }

    /// A new kind of link is one file (here, this one's `KIND`) and one line in
    /// `link::LAUNCHERS`: a plan naming it gets its nodes from its `start`, the spawner and
    /// --ship as it says, c10d peers beside them, and a session runs steps on them.
    #[tokio::test(start_paused = true)]
    async fn a_new_kind_is_one_file_and_one_line() {
        use crate::plan::{SessionPlan, StorePlan};
        use crate::session::link::{self, Starting, peer};
        let hosts = ["n0", "n1", "n2"].map(crate::hosts::Host::new).to_vec();
        let mut np = crate::plan::NodesPlan::for_tests(hosts);
        np.launcher = "fake";
        np.peers = 1;
        let kinds: Vec<(&str, std::ops::Range<usize>)> = link::chosen(&np)
            .into_iter()
            .map(|(k, r)| (k.name, r))
            .collect();
        assert_eq!(kinds, [("fake", 0..2), (peer::KIND.name, 2..3)]);
        assert!(!link::needs_spawner(&np), "a fake node needs no spawner");
        link::check(&np).unwrap();
        np.ship = true;
        let e = link::check(&np).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
        assert!(
            e.message.contains("a fake node has no host"),
            "{}",
            e.message
        );
        np.ship = false;
        let session_plan = SessionPlan {
            run_id: "fake".into(),
            store: StorePlan::Host {
                port: 0,
                advertise: String::new(),
            },
            store_max_bytes: nrun_store::server::DEFAULT_MAX_BYTES,
            forward_signals: Vec::new(),
            c10d: None,
            static_secret: None,
            python: None,
            control_addr: None,
        };
        let rendezvous = Rendezvous {
            addr: "127.0.0.1".into(),
            port: 0,
            secret: None,
        };
        let nodes = link::start(Starting {
            plan: &np,
            session: &session_plan,
            rendezvous: &rendezvous,
            run: "fake",
            nudges: &Arc::default(),
            store: None,
        })
        .await
        .unwrap();
        let names: Vec<(&str, &str)> = nodes
            .iter()
            .map(|n| (n.label.as_str(), n.link.kind().name))
            .collect();
        assert_eq!(
            names,
            [("n0", "fake"), ("n1", "fake"), ("n2", peer::KIND.name)]
        );
        // The fake's nodes answer a job's step as any link does, through the store.
        let fakes = nodes.into_iter().take(2).collect();
        let (mut s, _sig) = session(fakes);
        let r = s
            .run_step(vec![Some(run_step()), Some(run_step())], Policy::Together)
            .await
            .unwrap()
            .results;
        assert!(
            r.iter().all(|r| is(r, |x| matches!(x, RunResult::Success))),
            "{r:?}"
        );
    }
}
