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

/// Runs [`watch`] on a thread of its own, with its own runtime, at a higher priority where
/// this process may raise it (CAP_SYS_NICE, root): the agent's one runtime thread also forwards
/// workers' output, takes stacks and publishes views, and a node whose data loaders pin every
/// core must still beat on time. Where no thread can be made, on the agent's runtime.
pub(super) fn spawn(
    addr: SocketAddr,
    secret: String,
    heartbeat: Option<Vec<u8>>,
    timeout: Duration,
    gone: watch::Sender<bool>,
    me: String,
) {
    // Taken back from the thread's closure if the thread cannot start.
    let args = std::sync::Arc::new(std::sync::Mutex::new(Some((secret, heartbeat, gone, me))));
    let theirs = args.clone();
    let started = std::thread::Builder::new()
        .name("nrun-heartbeat".into())
        .spawn(move || {
            let Some((secret, heartbeat, gone, me)) =
                theirs.lock().unwrap_or_else(|e| e.into_inner()).take()
            else {
                return;
            };
            // Nice -5 for this thread only (Linux: a thread's own nice); refused without
            // CAP_SYS_NICE, and the thread is then still apart from the agent's work.
            // SAFETY: gettid and setpriority on this thread's own id.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, -5);
            }
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(watch(addr, secret, heartbeat, timeout, gone, me)),
                Err(e) => {
                    eprintln!("nrun agent on {me}: cannot start its heartbeat: {e}");
                    gone.send_replace(true);
                }
            }
        });
    if started.is_err()
        && let Some((secret, heartbeat, gone, me)) =
            args.lock().unwrap_or_else(|e| e.into_inner()).take()
    {
        tokio::spawn(watch(addr, secret, heartbeat, timeout, gone, me));
    }
}

/// Asks the store at `addr` every half second (bumping `heartbeat`, if given); when a request is not
/// answered within `timeout`, or the connection fails, says so once and sets `gone`.
async fn watch(
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
            super::lost_host(super::HostLoss::of(&e));
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
