//! A node whose nrun the user started, as torchrun's c10d rendezvous has it (the same command
//! on every node): it finds the nrun hosting the rendezvous at the endpoint, takes the next node
//! index (join order), and from then on is that node's agent, exactly as one started over ssh.
//! Its heartbeat tells the host it is alive; it exits with the job's exit code.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::protocol::{Hello, Keys, c10d_next_key, c10d_run_key};
use crate::error::{Error, Result};
use crate::node::Signals;
use crate::plan::{C10d, NodesPlan, Plan};
use crate::store::client::Client;

/// Joins the rendezvous `c` and serves as a node of its job; nrun's exit code.
pub async fn join(plan: &Plan, nodes: &NodesPlan, c: &C10d) -> Result<u8> {
    let endpoint = format!("{}:{}", c.host, c.port);
    let addrs: Vec<SocketAddr> = endpoint
        .to_socket_addrs()
        .map_err(|e| Error::usage(format!("--rdzv-endpoint {endpoint}: {e}")))?
        .collect();
    let deadline = Instant::now() + nodes.join_timeout;
    let secs = nodes.join_timeout.as_secs();
    // The hosting nrun may start after this one: try until the join timeout.
    let (mut store, reached) = 'found: loop {
        let mut last = String::new();
        for a in &addrs {
            match Client::connect(*a, Duration::from_secs(2)).await {
                Ok(s) => break 'found (s, *a),
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        if Instant::now() > deadline {
            return Err(Error::cluster(format!(
                "no nrun hosts the rendezvous at {endpoint} ({last}) after {secs} s \
                 (--join-timeout): start the same command on {}, and check the firewall there",
                c.host
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let secret = c.secret.clone().unwrap_or_default();
    let lost = |e: std::io::Error| Error::cluster(format!("the rendezvous at {endpoint}: {e}"));
    super::prove(&mut store, &secret).await.map_err(lost)?;
    // The host publishes its run's name as soon as its store is up.
    let run_key = c10d_run_key(&c.id);
    let wanted: [&[u8]; 1] = [&run_key];
    let left = deadline.saturating_duration_since(Instant::now());
    if !store.wait(&wanted, Some(left)).await.map_err(lost)? {
        return Err(Error::cluster(format!(
            "an nrun listens at {endpoint} but hosts no rendezvous with id {:?} within {secs} s: \
             give every node the same --rdzv-id (and NRUN_RDZV_SECRET, if one has it)",
            c.id
        )));
    }
    let run = String::from_utf8_lossy(&store.get(&run_key).await.map_err(lost)?).into_owned();
    let index = store.add(&c10d_next_key(&c.id), 1).await.map_err(lost)?;
    let node = usize::try_from(index).unwrap_or(usize::MAX);
    if node >= plan.nnodes {
        return Err(Error::cluster(format!(
            "the rendezvous at {endpoint} (id {:?}) already has its --nnodes {} nodes; this one \
             is one too many",
            c.id, plan.nnodes
        )));
    }
    let hello = Hello {
        secret: secret.clone(),
        run: run.clone(),
        node,
        label: crate::net::hostname(),
        addrs: vec![reached.to_string()],
        cwd: std::env::current_dir()
            .map_err(|e| Error::usage(format!("cannot read the current directory: {e}")))?,
        version: crate::cli::VERSION.to_string(),
        python: nodes.python_probe.then(|| plan.python.clone()).flatten(),
        forward_signals: plan.forward_signals.clone(),
    };
    tracing::info!("joined the rendezvous at {endpoint} as node {node}");
    tokio::spawn(heartbeat(reached, secret, Keys::new(&run).alive(node)));
    let signals = Signals::install(&plan.forward_signals)?;
    // Nothing closes: the host going away shows as its store going away.
    let (_keep, gone) = watch::channel(false);
    match super::serve(hello, signals, gone).await {
        Ok(code) => Ok(code.unwrap_or(0)),
        Err(e) => Err(Error::cluster(e)),
    }
}

/// Bumps this node's heartbeat key every second while the process lives.
async fn heartbeat(addr: SocketAddr, secret: String, key: Vec<u8>) {
    let Ok(mut c) = Client::connect(addr, Duration::from_secs(5)).await else {
        return;
    };
    if super::prove(&mut c, &secret).await.is_err() {
        return;
    }
    loop {
        if c.add(&key, 1).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
