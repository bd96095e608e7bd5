//! The agent's watch over its link to the launch host: a request to the store every half second, on
//! a connection of its own, each given `--agent-timeout` to be answered. A partition (packets
//! dropped, not refused) closes no socket and no ssh for many seconds; this notices it, and the
//! agent stops its workers by itself, as when its stdin closes. Agents the coordinator cannot
//! watch as processes (c10d nodes, an srun step's) bump their heartbeat key with the same
//! request, so one connection serves both.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;

use nrun_store::client::Client;

/// How often the store is asked: the coordinator calls a node lost after half of
/// --agent-timeout without a beat (`session::link::Bus::silence`).
const EVERY: Duration = Duration::from_millis(500);

/// Why the launch host counts as gone, for the agent's last words.
fn why(addr: SocketAddr, timeout: Duration) -> String {
    format!(
        "no answer from the launch host's store at {addr} for {} s (--agent-timeout): it is down \
         or cut off from this node; stopping this node's workers",
        timeout.as_secs_f64()
    )
}

/// Asks the store at `addr` every half second (bumping `heartbeat`, if given); when a request is not
/// answered within `timeout`, or the connection fails, says so once and sets `gone`.
pub(super) async fn watch(
    addr: SocketAddr,
    secret: String,
    heartbeat: Option<Vec<u8>>,
    timeout: Duration,
    gone: watch::Sender<bool>,
    me: String,
) {
    let alive = async {
        let mut c = Client::connect(addr, timeout).await?;
        tokio::time::timeout(timeout, super::prove(&mut c, &secret, &addr))
            .await
            .map_err(|_| std::io::ErrorKind::TimedOut)??;
        let mut n = 0u32;
        loop {
            let ask = async {
                match &heartbeat {
                    Some(key) => c.add(key, 1).await.map(|_| ()),
                    None => c.ping(n).await.map(|_| ()),
                }
            };
            match tokio::time::timeout(timeout, ask).await {
                Ok(r) => r?,
                Err(_) => return Err(std::io::Error::from(std::io::ErrorKind::TimedOut)),
            }
            n = n.wrapping_add(1);
            tokio::time::sleep(EVERY).await;
        }
    };
    let r: std::io::Result<()> = alive.await;
    // At the end of a run the store goes away before the agent has left: nothing to say then,
    // the agent is already on its way out.
    if !gone.is_closed() {
        if let Err(e) = r {
            let what = match e.kind() {
                std::io::ErrorKind::TimedOut => why(addr, timeout),
                _ => format!(
                    "lost the launch host's store at {addr}: {e}; stopping this node's workers"
                ),
            };
            eprintln!("nrun agent on {me}: {what}");
        }
        gone.send_replace(true);
    }
}
