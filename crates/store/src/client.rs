//! A Rust client for the TCPStore protocol, for nrun's own parts (agents, preflight workers, the
//! load generator) and tests. Keys go on the wire exactly as given: torch's clients add a "/"
//! prefix to user keys, so pass "/name" to meet them.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::protocol::{CHECK_READY, Request, STOP_WAITING, VALIDATE_MAGIC, WAIT_CANCELED};

/// How long [`Client::wait_or`] waits for the answer to its CANCEL_WAIT.
pub const CANCEL_REPLY: Duration = Duration::from_secs(3);

pub struct Client {
    stream: BufReader<TcpStream>,
    out: Vec<u8>,
}

fn bad_reply(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("store sent an unexpected {what}"),
    )
}

impl Client {
    /// Connects, retrying refused connections until `timeout` (the server may still be coming
    /// up), then sends VALIDATE and a PING, as torch >= 2.5 does.
    pub async fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<Client> {
        let deadline = Instant::now() + timeout;
        let mut delay = Duration::from_millis(5);
        let stream = loop {
            match TcpStream::connect(addr).await {
                Ok(s) => break s,
                Err(e) if Instant::now() + delay < deadline => {
                    tracing::debug!("connect to store {addr}: {e}; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("connect to store {addr}: {e}"),
                    ));
                }
            }
        };
        Client::from_stream(stream).await
    }

    /// Speaks the handshake (VALIDATE, then a PING as torch >= 2.5 does) on a connected stream.
    pub async fn from_stream(stream: TcpStream) -> io::Result<Client> {
        stream.set_nodelay(true)?;
        // Replies are small; a small buffer keeps thousands of clients cheap (large values are
        // read straight into their own allocation).
        let mut c = Client {
            stream: BufReader::with_capacity(512, stream),
            out: Vec::with_capacity(64),
        };
        c.send(&Request::Validate {
            magic: VALIDATE_MAGIC,
        })
        .await?;
        let nonce = std::process::id();
        if c.ping(nonce).await? != nonce {
            // Something accepted the connection and answered, but not as a store does.
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "something answered on that port, but not as a TCPStore does (wrong reply to \
                 PING): another service there, or a proxy in the way?",
            ));
        }
        Ok(c)
    }

    /// As [`Client::from_stream`], within `wait`, telling a TCPStore from another program
    /// that accepted the connection: one that answers the handshake with other bytes is an
    /// error of kind `InvalidData` whose message says what it answered; one that answers
    /// nothing within `wait` (a TCPStore answers at once: another program, or a stopped one)
    /// is `TimedOut`. A connection closed at once stays an `UnexpectedEof` (a store may close
    /// clients it does not serve).
    pub async fn from_stream_within(stream: TcpStream, wait: Duration) -> io::Result<Client> {
        stream.set_nodelay(true)?;
        let mut c = Client {
            stream: BufReader::with_capacity(512, stream),
            out: Vec::with_capacity(64),
        };
        c.send(&Request::Validate {
            magic: VALIDATE_MAGIC,
        })
        .await?;
        let nonce = std::process::id();
        c.send(&Request::Ping { nonce }).await?;
        let mut got = [0u8; 4];
        match tokio::time::timeout(wait, c.stream.read_exact(&mut got)).await {
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "it accepted the connection but answered nothing to the TCPStore \
                         handshake within {} s (a TCPStore answers at once)",
                        wait.as_secs_f64()
                    ),
                ));
            }
            Ok(r) => r?,
        };
        if u32::from_le_bytes(got) == nonce {
            return Ok(c);
        }
        // What else it says, briefly, to name it ("SSH-2.0-OpenSSH", "HTTP/1.1 400").
        let mut said = got.to_vec();
        let mut more = [0u8; 60];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(200), c.stream.read(&mut more)).await
        {
            said.extend_from_slice(&more[..n]);
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "it answered the TCPStore handshake with {:?}, which no TCPStore says",
                String::from_utf8_lossy(&said).trim_end()
            ),
        ))
    }

    async fn send(&mut self, req: &Request) -> io::Result<()> {
        self.out.clear();
        req.encode(&mut self.out);
        self.stream.get_mut().write_all(&self.out).await
    }

    async fn u8(&mut self) -> io::Result<u8> {
        self.stream.read_u8().await
    }

    async fn i64(&mut self) -> io::Result<i64> {
        self.stream.read_i64_le().await
    }

    async fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let n = self.stream.read_u64_le().await?;
        if n > crate::protocol::MAX_VALUE_LEN {
            return Err(bad_reply("value length"));
        }
        let mut v = vec![0u8; n as usize];
        self.stream.read_exact(&mut v).await?;
        Ok(v)
    }

    /// Proves the run's secret to the store (challenge and response; the secret is not sent),
    /// unlocking nrun's control keys for this connection.
    pub async fn authenticate(&mut self, secret: &[u8]) -> io::Result<()> {
        let nonce = self.get(super::server::CHALLENGE_KEY).await?;
        let proof = super::auth::prove(secret, &nonce);
        self.set(super::server::AUTH_KEY, &proof).await
    }

    pub async fn ping(&mut self, nonce: u32) -> io::Result<u32> {
        self.send(&Request::Ping { nonce }).await?;
        self.stream.read_u32_le().await
    }

    pub async fn set(&mut self, key: &[u8], value: &[u8]) -> io::Result<()> {
        self.send(&Request::Set {
            key: key.to_vec(),
            value: value.to_vec(),
        })
        .await
    }

    /// GET without waiting: a missing key reads as empty.
    pub async fn get(&mut self, key: &[u8]) -> io::Result<Vec<u8>> {
        self.send(&Request::Get { key: key.to_vec() }).await?;
        self.bytes().await
    }

    pub async fn add(&mut self, key: &[u8], delta: i64) -> io::Result<i64> {
        self.send(&Request::Add {
            key: key.to_vec(),
            delta,
        })
        .await?;
        self.i64().await
    }

    pub async fn compare_set(
        &mut self,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> io::Result<Vec<u8>> {
        self.send(&Request::CompareSet {
            key: key.to_vec(),
            expected: expected.to_vec(),
            desired: desired.to_vec(),
        })
        .await?;
        self.bytes().await
    }

    pub async fn check(&mut self, keys: &[&[u8]]) -> io::Result<bool> {
        self.send(&Request::Check {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        })
        .await?;
        Ok(self.u8().await? == CHECK_READY)
    }

    /// Waits until every key exists. With a timeout, a wait that runs out is cancelled the way
    /// torch does it, and `Ok(false)` is returned.
    pub async fn wait(&mut self, keys: &[&[u8]], timeout: Option<Duration>) -> io::Result<bool> {
        self.send(&Request::Wait {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        })
        .await?;
        self.await_stop(timeout).await
    }

    /// Waits until every key exists, or until `interrupt` finishes first: then the wait is
    /// cancelled the way torch cancels one, and the connection is ready for the next request.
    /// Returns whether the keys exist (they may have come as the wait was cancelled), or the
    /// error that broke the connection, and what `interrupt` gave if it finished (even when the
    /// cancel then failed: a store cut off never answers it, and gets [`CANCEL_REPLY`]). What
    /// lets one connection both wait for a key and serve other work meanwhile (an agent's
    /// controls and its views).
    pub async fn wait_or<T>(
        &mut self,
        keys: &[&[u8]],
        interrupt: impl std::future::Future<Output = T>,
    ) -> (io::Result<bool>, Option<T>) {
        let sent = self
            .send(&Request::Wait {
                keys: keys.iter().map(|k| k.to_vec()).collect(),
            })
            .await;
        if let Err(e) = sent {
            return (Err(e), None);
        }
        tokio::pin!(interrupt);
        // One byte read at a time is cancel-safe: it is read whole or not at all.
        let got = tokio::select! {
            biased;
            b = self.u8() => Err(b),
            t = &mut interrupt => Ok(t),
        };
        match got {
            Err(Ok(STOP_WAITING)) => (Ok(true), None),
            Err(Ok(_)) => (Err(bad_reply("reply to WAIT")), None),
            Err(Err(e)) => (Err(e), None),
            Ok(t) => {
                let cancelled = tokio::time::timeout(CANCEL_REPLY, self.cancel()).await;
                let r = cancelled.unwrap_or_else(|_| {
                    Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the store did not answer CANCEL_WAIT",
                    ))
                });
                (r, Some(t))
            }
        }
    }

    /// Cancels the pending wait: whether it had finished (STOP_WAITING may already have been
    /// on its way: then WAIT_CANCELED follows it).
    async fn cancel(&mut self) -> io::Result<bool> {
        self.send(&Request::CancelWait).await?;
        let mut b = self.u8().await?;
        let ready = b == STOP_WAITING;
        if ready {
            b = self.u8().await?;
        }
        if b != WAIT_CANCELED {
            return Err(bad_reply("reply to CANCEL_WAIT"));
        }
        Ok(ready)
    }

    /// Joins the barrier at `key` of `world_size` participants.
    pub async fn barrier(
        &mut self,
        key: &[u8],
        world_size: i64,
        timeout: Option<Duration>,
    ) -> io::Result<bool> {
        self.send(&Request::Barrier {
            key: key.to_vec(),
            world_size,
        })
        .await?;
        self.await_stop(timeout).await
    }

    async fn await_stop(&mut self, timeout: Option<Duration>) -> io::Result<bool> {
        let reply = match timeout {
            None => self.u8().await?,
            Some(t) => match tokio::time::timeout(t, self.u8()).await {
                Ok(r) => r?,
                Err(_) => return self.cancel().await,
            },
        };
        if reply != STOP_WAITING {
            return Err(bad_reply("reply to WAIT"));
        }
        Ok(true)
    }

    /// Sends CANCEL_WAIT with no wait pending; returns the reply byte.
    pub async fn cancel_wait(&mut self) -> io::Result<u8> {
        self.send(&Request::CancelWait).await?;
        self.u8().await
    }

    pub async fn num_keys(&mut self) -> io::Result<i64> {
        self.send(&Request::GetNumKeys).await?;
        self.i64().await
    }

    pub async fn delete_key(&mut self, key: &[u8]) -> io::Result<bool> {
        self.send(&Request::DeleteKey { key: key.to_vec() }).await?;
        Ok(self.i64().await? != 0)
    }

    pub async fn append(&mut self, key: &[u8], value: &[u8]) -> io::Result<()> {
        self.send(&Request::Append {
            key: key.to_vec(),
            value: value.to_vec(),
        })
        .await
    }

    pub async fn multi_get(&mut self, keys: &[&[u8]]) -> io::Result<Vec<Vec<u8>>> {
        self.send(&Request::MultiGet {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        })
        .await?;
        let mut v = Vec::with_capacity(keys.len());
        for _ in keys {
            v.push(self.bytes().await?);
        }
        Ok(v)
    }

    pub async fn multi_set(&mut self, pairs: &[(&[u8], &[u8])]) -> io::Result<()> {
        let pairs = pairs
            .iter()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        self.send(&Request::MultiSet { pairs }).await
    }

    pub async fn queue_push(&mut self, key: &[u8], value: &[u8]) -> io::Result<()> {
        self.send(&Request::QueuePush {
            key: key.to_vec(),
            value: value.to_vec(),
        })
        .await
    }

    /// Pops without blocking: `None` when the queue is empty.
    pub async fn queue_pop(&mut self, key: &[u8]) -> io::Result<Option<Vec<u8>>> {
        self.send(&Request::QueuePop { key: key.to_vec() }).await?;
        if self.i64().await? > 0 {
            Ok(Some(self.bytes().await?))
        } else {
            Ok(None)
        }
    }

    pub async fn queue_len(&mut self, key: &[u8]) -> io::Result<i64> {
        self.send(&Request::QueueLen { key: key.to_vec() }).await?;
        self.i64().await
    }

    pub async fn list_keys(&mut self) -> io::Result<Vec<Vec<u8>>> {
        self.send(&Request::ListKeys).await?;
        let n = self.i64().await?;
        if !(0..=crate::protocol::MAX_KEYS as i64 * 64).contains(&n) {
            return Err(bad_reply("key count"));
        }
        let mut keys = Vec::with_capacity(n as usize);
        for _ in 0..n {
            keys.push(self.bytes().await?);
        }
        Ok(keys)
    }
}
