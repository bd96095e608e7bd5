//! NCCL's RAS (reliability, availability, serviceability; on by default since NCCL 2.24): every
//! NCCL process keeps a keep-alive mesh with its peers, and one of each node's processes answers
//! `ncclras`'s text protocol on `localhost:28028` (NCCL_RAS_ADDR). Asked for its status, it
//! gathers every process of the job and says which ranks are missing, dead, or have launched a
//! different number of collectives. The watch asks it when a node's ranks stall, so that the
//! report of a hang carries NCCL's own account beside the stacks and the flight recorders.
//!
//! Only the node of global rank 0 asks: one answer covers the whole job, and each question is a
//! collective over every process's RAS thread (N nodes asking would be N^2 messages).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nrun_proto::protocol::RasView;

/// NCCL's default client address.
const DEFAULT_ADDR: &str = "localhost:28028";
/// The client protocol `ncclras` speaks (NCCL ignores the number and answers with its own).
const PROTOCOL: u32 = 2;
/// How long RAS may wait for the other processes' answers: a dead peer costs this much.
const PEER_TIMEOUT_S: u32 = 5;
/// The most of an answer kept (a big job's status is a few KiB: outliers are summarised).
const MAX_TEXT: usize = 32 * 1024;
/// Asked again this long after the last answer while the ranks stay stalled.
const AGAIN: Duration = Duration::from_secs(10);

/// Where this node's NCCL answers, from the workers' environment: None when they turned RAS
/// off (NCCL_RAS_ENABLE=0).
pub fn target(env: &[(String, String)]) -> Option<String> {
    let get = |k: &str| crate::worker_var(env, k);
    if get("NCCL_RAS_ENABLE").is_some_and(|v| v.trim() == "0") {
        return None;
    }
    Some(get("NCCL_RAS_ADDR").unwrap_or_else(|| DEFAULT_ADDR.to_string()))
}

/// Asks RAS at `addr` for its status, as `ncclras` does; the text it answered, or why not.
pub fn status(addr: &str) -> std::io::Result<String> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot resolve {addr}: {e}")))?
        .collect();
    let mut last = std::io::Error::other(format!("{addr} resolves to no address"));
    for a in addrs {
        match ask(a) {
            Ok(text) => return Ok(text),
            Err(e) => last = std::io::Error::new(e.kind(), format!("{a}: {e}")),
        }
    }
    Err(last)
}

fn ask(a: SocketAddr) -> std::io::Result<String> {
    let s = TcpStream::connect_timeout(&a, Duration::from_secs(1))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    let unexpected = |what: &str, got: &str| {
        std::io::Error::other(format!("unexpected answer to {what}: {:?}", got.trim()))
    };
    w.write_all(format!("CLIENT PROTOCOL {PROTOCOL}\n").as_bytes())?;
    r.read_line(&mut line)?;
    if !line.to_ascii_uppercase().starts_with("SERVER PROTOCOL") {
        return Err(unexpected("the handshake", &line));
    }
    line.clear();
    w.write_all(format!("TIMEOUT {PEER_TIMEOUT_S}\n").as_bytes())?;
    r.read_line(&mut line)?;
    if line.trim() != "OK" {
        return Err(unexpected("TIMEOUT", &line));
    }
    // The answer waits for every process (at most the timeout above, and a leg more).
    r.get_ref()
        .set_read_timeout(Some(Duration::from_secs(2 * PEER_TIMEOUT_S as u64 + 2)))?;
    w.write_all(b"STATUS\n")?;
    let mut text = Vec::new();
    r.take(MAX_TEXT as u64).read_to_end(&mut text)?;
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// The lines of a status's "Errors" and "Warnings" sections: what RAS found wrong, as NCCL
/// words it ("Communicator ranks have different AllReduce operation counts", "Rank 1 has
/// launched up to operation 5 -- GPU 0 managed by process 456 on node 10.0.0.2").
pub fn findings(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut inside = false;
    for (i, l) in lines.iter().enumerate() {
        let underlined = lines.get(i + 1).is_some_and(|n| is_rule(n));
        if underlined {
            inside = matches!(l.trim(), "Errors" | "Warnings");
            continue;
        }
        if inside && !is_rule(l) && !l.trim().is_empty() {
            out.push(l.trim().to_string());
        }
    }
    out
}

fn is_rule(l: &str) -> bool {
    let l = l.trim();
    !l.is_empty() && l.chars().all(|c| c == '=')
}

/// The watch thread's side: asks on a thread of its own (an answer may take seconds) while the
/// node's ranks are stalled, and keeps the latest answer for the node's view.
pub(crate) struct Asker {
    addr: String,
    pending: Option<mpsc::Receiver<std::io::Result<String>>>,
    asked: Option<Instant>,
    pub view: Option<RasView>,
}

impl Asker {
    pub(crate) fn new(addr: String) -> Asker {
        Asker {
            addr,
            pending: None,
            asked: None,
            view: None,
        }
    }

    /// Called on every round of the watch: `stalled` says whether the node's NCCL ranks have
    /// all been still for a while. Asks once per stall and again every so often during it.
    pub(crate) fn poll(&mut self, stalled: bool) {
        if let Some(rx) = &self.pending {
            match rx.try_recv() {
                Ok(answer) => {
                    let (text, error) = match answer {
                        Ok(text) => (Some(text), None),
                        Err(e) => (None, Some(e.to_string())),
                    };
                    self.view = Some(RasView {
                        at_ms: nrun_proto::protocol::unix_ms(),
                        text,
                        error,
                    });
                    self.pending = None;
                }
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => self.pending = None,
            }
        }
        if !stalled {
            self.asked = None;
            return;
        }
        if self.asked.is_some_and(|t| t.elapsed() < AGAIN) {
            return;
        }
        let (tx, rx) = mpsc::channel();
        let addr = self.addr.clone();
        let spawned = std::thread::Builder::new()
            .name("nrun-ras".into())
            .spawn(move || {
                let _ = tx.send(status(&addr));
            });
        if spawned.is_ok() {
            self.pending = Some(rx);
            self.asked = Some(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL 2.28.9's answer on the H200, two ranks sharing GPU 0, rank 1 asleep before the 6th
    /// all_reduce (scripts/probe/ras.py).
    const HANG: &str = "NCCL version 2.28.9 compiled with CUDA 13.0
CUDA runtime version 13000, driver version 13000

Job summary
===========

  Nodes  Processes         GPUs  Processes     GPUs
(total)   per node  per process    (total)  (total)
      1          2            1          2        2

Communicators... (0.000s)
=============

Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors
    #  in group  per comm  per node  per comm  in group
    0         1         1         2         2         2   RUNNING  MISMATCH

Errors
======

Warnings
========

#0-0 (f4406ee025fe2c59) MISMATCH
  Communicator ranks have different AllReduce operation counts
  Rank 0 has launched up to operation 6 -- GPU 0 managed by process 455 on node 192.0.2.2
  Rank 1 has launched up to operation 5 -- GPU 0 managed by process 456 on node 192.0.2.2

";

    #[test]
    fn the_errors_and_warnings_of_a_status() {
        assert_eq!(
            findings(HANG),
            vec![
                "#0-0 (f4406ee025fe2c59) MISMATCH",
                "Communicator ranks have different AllReduce operation counts",
                "Rank 0 has launched up to operation 6 -- GPU 0 managed by process 455 on node \
                 192.0.2.2",
                "Rank 1 has launched up to operation 5 -- GPU 0 managed by process 456 on node \
                 192.0.2.2",
            ]
        );
        assert!(findings("Job summary\n===\n  1 2 3\n").is_empty());
        assert!(findings("").is_empty());
    }

    #[test]
    fn the_address_follows_the_workers_settings() {
        assert_eq!(target(&[]).as_deref(), Some(DEFAULT_ADDR));
        let env = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        assert_eq!(
            target(&env("NCCL_RAS_ADDR", "127.0.0.1:29999")).as_deref(),
            Some("127.0.0.1:29999")
        );
        assert_eq!(target(&env("NCCL_RAS_ENABLE", "0")), None);
    }

    /// The client's side of the protocol against a server that answers as NCCL does.
    #[test]
    fn status_speaks_ncclras_protocol() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut w = s;
            let mut got = Vec::new();
            for answer in ["SERVER PROTOCOL 2\n", "OK\n", HANG] {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                got.push(line.trim().to_string());
                w.write_all(answer.as_bytes()).unwrap();
            }
            got
        });
        assert_eq!(status(&addr).unwrap(), HANG);
        assert_eq!(
            server.join().unwrap(),
            vec!["CLIENT PROTOCOL 2", "TIMEOUT 5", "STATUS"]
        );
        // Nobody there: said, not waited for.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let gone = free.local_addr().unwrap().to_string();
        drop(free);
        let e = status(&gone).unwrap_err().to_string();
        assert!(e.contains(&gone), "{e}");
    }
}
