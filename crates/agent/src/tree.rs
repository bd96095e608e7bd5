//! An inner agent of the launch tree (`--tree-width`): right after its [`Hello`], it starts
//! the agents of the nodes its Hello lists under `tree` over ssh from its own node (those of
//! its own machine without ssh: the launch host's loopback aliases), as the launch host starts
//! its own (the same [`AgentProcess`], options, nrun path, concurrency and
//! `--ship`; each child gets its own Hello with its own subtree), while it joins and serves its
//! own node as any agent does.
//!
//! What it relays is their output: each child's stdout and stderr lines go on to its own,
//! which reach the launch host through its own ssh (a child's own nrun and ssh lines named
//! `child: ...`, so the launch host does not take them for this agent's last words). Store
//! traffic is not relayed: every child connects to the coordinator's store itself (see
//! `session::link::tree` for why).
//!
//! A child whose ssh ends before the End is written up in the store (`Keys::tree_lost`: how
//! ssh ended and what it or nrun said last), so the launch host names it with ssh's own error
//! and this host. At the End it finishes its children as the launch host does its own
//! (`AgentProcess::finish`) before it exits; if it leaves any other way (its stdin closed: the
//! launch host is gone; its store lost) it kills them first, and if it is killed outright their
//! ssh dies with it (PR_SET_PDEATHSIG): either way each child's stdin closes and that agent
//! stops its workers and exits.
//!
//! With `--ship`, this agent copies its own binary (the launch host's, shipped to it) to each
//! child first: the same version, and no extra handshakes for the launch host.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;

use super::child::{AgentProcess, Relay, Starter, how_it_ended, ship};
use nrun_proto::protocol::{Branch, Hello, Keys, TreeSsh};
use nrun_store::client::Client;

/// Where the subtree's agents are in their lives, as the inner agent decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    /// The End came: they leave by themselves (then stdin closed, then killed).
    Finish,
    /// This agent leaves early: kill them now.
    Kill,
}

/// The children of this agent in the launch tree, each served by a task of its own.
pub(crate) struct Subtree {
    phase: watch::Sender<Phase>,
    children: JoinSet<()>,
}

impl Subtree {
    /// Starts the children `hello.tree` lists (None: it lists none).
    pub(crate) fn start(hello: &Hello) -> Option<Subtree> {
        if hello.tree.is_empty() {
            return None;
        }
        let ssh = hello.tree_ssh.clone().unwrap_or_default();
        let sem = Arc::new(tokio::sync::Semaphore::new(ssh.concurrency.max(1)));
        let (phase, _) = watch::channel(Phase::Running);
        // Its children use the launch host's address it uses: their ssh connections come from
        // this node, which says nothing of the launch host's addresses.
        let chosen = super::choose(hello);
        let prefer = match chosen {
            Some((a, _)) => Some(nrun_proto::protocol::Prefer {
                ip: a.ip().to_string(),
                how: nrun_proto::protocol::AddrChoice::Tree,
            }),
            None => hello.prefer.clone(),
        };
        let report = Arc::new(Reporter {
            me: hello.label.clone(),
            addrs: hello.addrs.clone(),
            chosen,
            secret: hello.secret.clone(),
            keys: Keys::new(&hello.run),
            conn: tokio::sync::Mutex::new(None),
        });
        let mut children = JoinSet::new();
        for b in &hello.tree {
            let child = Hello {
                node: b.node,
                label: b.label.clone(),
                tree: b.children.clone(),
                tree_ssh: (!b.children.is_empty()).then(|| ssh.clone()),
                // A node started from another elsewhere is watched by the launch host through
                // its heartbeat alone; one of the launch host's machine, as a process by its
                // starter.
                heartbeat: !b.local,
                nodes: Vec::new(),
                own: None,
                prefer: prefer.clone(),
                ..hello.clone()
            };
            children.spawn(serve_child(
                b.clone(),
                child,
                ssh.clone(),
                sem.clone(),
                report.clone(),
                phase.subscribe(),
            ));
        }
        Some(Subtree { phase, children })
    }

    /// At the End: every child's agent leaves, then its ssh ends (as the launch host ends its
    /// own).
    pub(crate) async fn finish(self) {
        self.end(Phase::Finish).await
    }

    /// Leaving early: every child's ssh is killed now.
    pub(crate) async fn kill(self) {
        self.end(Phase::Kill).await
    }

    async fn end(mut self, how: Phase) {
        self.phase.send_replace(how);
        while self.children.join_next().await.is_some() {}
    }
}

/// One child: ship to it if asked, start its agent, and keep it until the end; an ssh that ends
/// before then is written up for the launch host.
async fn serve_child(
    b: Branch,
    hello: Hello,
    ssh: TreeSsh,
    sem: Arc<tokio::sync::Semaphore>,
    report: Arc<Reporter>,
    mut phase: watch::Receiver<Phase>,
) {
    let start = async {
        let _permit = sem.acquire().await;
        // A node of the launch host's machine (this one) is started as the launch host starts
        // its own: this binary, no ssh (its agent dies with this one, its workers with it).
        let local = b.local;
        let starter = match (local, ssh.ship) {
            (true, _) => Starter::Here,
            (false, true) => {
                let nrun = ship(&ssh.ssh_opts, &b.label).await?;
                Starter::Program(nrun_proto::remote::ssh_command(
                    &b.label,
                    &ssh.ssh_opts,
                    &nrun,
                ))
            }
            (false, false) => Starter::Program(nrun_proto::remote::ssh_command(
                &b.label,
                &ssh.ssh_opts,
                &ssh.remote_nrun,
            )),
        };
        let relay = Relay {
            nudge: None,
            tag: Some(b.label.clone()),
            // The launch host reads them: passed on with the lines.
            marks: false,
        };
        AgentProcess::spawn(&starter, &b.label, &hello, relay).await
    };
    let started = tokio::select! {
        r = start => r,
        // The end came before it started (dropping a start under way kills what it began).
        _ = phase.wait_for(|p| *p != Phase::Running) => return,
    };
    let mut process = match started {
        Ok(p) => p,
        Err(e) => {
            report.lost(&b, &format!("could not start: {e}")).await;
            return;
        }
    };
    let mut ended = process.ended();
    let mut watching = phase.clone();
    // Its ssh ended by itself (true), or the end came first (false).
    let by_itself = tokio::select! {
        _ = ended.wait_for(|s| s.is_some()) => true,
        _ = watching.wait_for(|p| *p != Phase::Running) => false,
    };
    let now = *phase.borrow();
    match (by_itself, now) {
        (true, Phase::Running) => {
            // Let its stderr relay catch ssh's last words.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let how = process
                .exited()
                .map_or("ended".to_string(), |st| how_it_ended(&st));
            let said = process
                .own_words()
                .or_else(|| process.last_words())
                .map_or(String::new(), |w| format!(": {w}"));
            report.lost(&b, &format!("{how}{said}")).await;
        }
        (true, _) => {}
        (false, Phase::Kill) => process.kill().await,
        (false, _) => process.finish().await,
    }
}

/// Writes a child's end into the launch host's store, on a connection of its own (opened when
/// first needed: most trees never need one).
struct Reporter {
    /// This agent's node, for its last words.
    me: String,
    addrs: Vec<String>,
    /// The launch host's address this agent uses ([`super::choose`]).
    chosen: Option<(std::net::SocketAddr, nrun_proto::protocol::AddrChoice)>,
    secret: String,
    keys: Keys,
    conn: tokio::sync::Mutex<Option<Client>>,
}

impl Reporter {
    /// Writes child `b`'s end up, trying for a few seconds. A child elsewhere that cannot be
    /// reported is still found by its heartbeat; one of this machine has none, so this agent
    /// then ends, and the launch host finds it and its subtree lost instead of waiting on them.
    async fn lost(&self, b: &Branch, what: &str) {
        let mut wait = Duration::from_millis(200);
        for _ in 0..5 {
            if self.try_lost(b.node, what).await {
                return;
            }
            tokio::time::sleep(wait).await;
            wait *= 2;
        }
        if b.local {
            eprintln!(
                "nrun agent on {}: cannot tell the launch host that {}'s agent ended ({what}): \
                 stopping, so that it finds the nodes started here lost",
                self.me, b.label
            );
            std::process::exit(1);
        }
    }

    async fn try_lost(&self, node: usize, what: &str) -> bool {
        let mut conn = self.conn.lock().await;
        if conn.is_none() {
            *conn = self.connect().await;
        }
        let Some(c) = conn.as_mut() else {
            return false;
        };
        let done = c
            .set(&self.keys.tree_lost(node), what.as_bytes())
            .await
            .is_ok();
        if !done {
            *conn = None;
        }
        done
    }

    async fn connect(&self) -> Option<Client> {
        let (mut c, reached, _, _) = super::connect(&self.addrs, self.chosen).await.ok()?;
        super::prove(&mut c, &self.secret, &reached).await.ok()?;
        Some(c)
    }
}
