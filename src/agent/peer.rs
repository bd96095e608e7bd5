//! A node whose nrun the user started, as torchrun's c10d rendezvous has it (the same command
//! on every node): it finds the nrun hosting the rendezvous at the endpoint, takes the next node
//! index (join order), and from then on is that node's agent, exactly as one started over ssh.
//! Its heartbeat tells the host it is alive; it exits with the job's exit code.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::protocol::{Hello, c10d_next_key, c10d_run_key};
use crate::error::{Error, Result};
use crate::node::Signals;
use crate::plan::{C10d, NodesPlan, RunSettings};
use crate::store::client::Client;

/// Joins the rendezvous `c` and serves as a node of its job; nrun's exit code.
pub async fn join(job: &RunSettings, nodes: &NodesPlan, c: &C10d) -> Result<u8> {
    let endpoint = format!("{}:{}", c.host, c.port);
    let addrs = resolve(&c.host, c.port)
        .map_err(|e| Error::usage(format!("the rendezvous endpoint {endpoint}: {}", e.message)))?;
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
    if secret.is_empty() {
        tracing::warn!(
            "no NRUN_RDZV_SECRET here: this node runs the steps any client of {endpoint} writes; \
             give every node the same NRUN_RDZV_SECRET to have them signed"
        );
    }
    let lost = |e: std::io::Error| {
        // A store with a secret closes a client without one that touches nrun's keys.
        let hint = match e.kind() {
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                if secret.is_empty() =>
            {
                " (the hosting nrun has NRUN_RDZV_SECRET and this node has none? give every \
                 node the same one)"
            }
            _ => "",
        };
        Error::cluster(format!("the rendezvous at {endpoint}: {e}{hint}"))
    };
    super::prove(&mut store, &secret, &endpoint)
        .await
        .map_err(|e| Error::cluster(super::refusal(e, lost).message))?;
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
    // A node index the launcher fixed (srun's SLURM_NODEID), else the next in join order.
    let node = match c.node {
        Some(n) => n,
        None => {
            let index = store.add(&c10d_next_key(&c.id), 1).await.map_err(lost)?;
            usize::try_from(index).unwrap_or(usize::MAX)
        }
    };
    // The job's --nnodes and the --spares that may wait beside them.
    let slots = nodes.hosts.len();
    if node >= slots {
        return Err(Error::cluster(format!(
            "the rendezvous at {endpoint} (id {:?}) already has its --nnodes {} nodes{}; this one \
             is one too many (give every node --spares K to let K more join as spares)",
            c.id,
            job.shape.nnodes,
            match slots - job.shape.nnodes {
                0 => String::new(),
                k => format!(" and {k} spare(s)"),
            }
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
        python: nodes
            .python_probe
            .then(|| job.session.python.clone())
            .flatten(),
        forward_signals: job.session.forward_signals.clone(),
        nodes: Vec::new(),
        heartbeat: true,
        agent_timeout_ms: nodes.agent_timeout.as_millis() as u64,
    };
    // The agent opens its own connections; this one has done its part.
    drop(store);
    tracing::info!("joined the rendezvous at {endpoint} as node {node}");
    let signals = Signals::install(&job.session.forward_signals)?;
    // Nothing closes: the host going away shows as its store going away.
    let (gone, _) = watch::channel(false);
    match super::serve(hello, signals, gone).await {
        Ok(code) => Ok(code.unwrap_or(0)),
        Err(e) => Err(Error::cluster(e.message)),
    }
}

/// The endpoint's addresses: its name resolved, or (a Slurm node name the resolver does not
/// know) the NodeAddr Slurm has for it.
fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    let found = (host, port)
        .to_socket_addrs()
        .map(|a| a.collect::<Vec<_>>());
    match found {
        Ok(a) if !a.is_empty() => Ok(a),
        Ok(_) => Err(Error::usage("resolves to no address")),
        Err(e) => {
            let out = std::process::Command::new("scontrol")
                .args(["show", "node", "-o", host])
                .output();
            let addr = out.ok().and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("NodeAddr=").map(str::to_string))
            });
            match addr.and_then(|a| (a.as_str(), port).to_socket_addrs().ok()) {
                Some(a) => Ok(a.collect()),
                None => Err(Error::usage(format!(
                    "{e} (and Slurm knows no NodeAddr for it)"
                ))),
            }
        }
    }
}
