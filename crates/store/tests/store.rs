//! The store over real sockets: nrun's client and raw protocol bytes against nrun's server.
//! (Compatibility with torch's own client is in tests/torch.rs.)

// The workspace's one way to serve a store in a test (tests/common/store.rs).
#[path = "../../../tests/common/store.rs"]
mod served;
#[path = "../../../tests/common/skip.rs"]
mod skip;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nrun_store::Store;
use nrun_store::client::Client;
use nrun_store::protocol::{Request, STOP_WAITING, VALIDATE_MAGIC, WAIT_CANCELED};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a test waits for what normally comes at once before calling it a hang: every wait
/// here ends on its event (a byte, a close, a parked wait), and the bound only tells a hang
/// from a loaded machine. Waits expected *not* to end (nothing may come) stay short: load only
/// makes them miss a late wrong answer, never fail a right one.
const HANG: Duration = Duration::from_secs(120);
const HANG_MS: u64 = 120_000;

/// Waits until the store holds `n` parked waits (a hang after [`HANG`]).
async fn parked(store: &Store, n: usize) {
    let end = std::time::Instant::now() + HANG;
    while store.pending_waits().0 != n {
        assert!(
            std::time::Instant::now() < end,
            "{:?}",
            store.pending_waits()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn start() -> (SocketAddr, Arc<Store>) {
    let store = Store::new();
    (served::serve_store(store.clone()).await, store)
}

async fn client(addr: SocketAddr) -> Client {
    Client::connect(addr, HANG).await.unwrap()
}

/// nrun's store with `secret`, served on a loopback port of its own.
async fn serve_with_secret(secret: &[u8]) -> (std::sync::Arc<Store>, SocketAddr) {
    let store = Store::with_secret(secret.to_vec());
    (store.clone(), served::serve_store(store).await)
}

async fn raw(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c]).await.unwrap();
    s
}

fn enc(r: Request) -> Vec<u8> {
    let mut v = Vec::new();
    r.encode(&mut v);
    v
}

/// Reads one byte or reports that none came within `ms`.
async fn read_byte(s: &mut TcpStream, ms: u64) -> Option<u8> {
    tokio::time::timeout(Duration::from_millis(ms), s.read_u8())
        .await
        .ok()
        .and_then(|r| r.ok())
}

#[tokio::test]
async fn basic_operations() {
    let (addr, store) = start().await;
    let mut c = client(addr).await;
    c.set(b"/a", b"1").await.unwrap();
    assert_eq!(c.get(b"/a").await.unwrap(), b"1");
    assert_eq!(c.get(b"/missing").await.unwrap(), b"");
    assert_eq!(c.add(b"/n", 3).await.unwrap(), 3);
    assert_eq!(c.add(b"/n", -1).await.unwrap(), 2);
    assert_eq!(c.get(b"/n").await.unwrap(), b"2");
    assert_eq!(c.compare_set(b"/cs", b"", b"x").await.unwrap(), b"x");
    assert_eq!(c.compare_set(b"/cs2", b"e", b"x").await.unwrap(), b"e");
    assert_eq!(c.compare_set(b"/cs", b"x", b"y").await.unwrap(), b"y");
    assert_eq!(c.compare_set(b"/cs", b"no", b"z").await.unwrap(), b"y");
    assert!(c.check(&[b"/a", b"/n"]).await.unwrap());
    assert!(!c.check(&[b"/a", b"/cs2"]).await.unwrap());
    c.append(b"/ap", b"ab").await.unwrap();
    c.append(b"/ap", b"cd").await.unwrap();
    assert_eq!(c.get(b"/ap").await.unwrap(), b"abcd");
    c.multi_set(&[(b"/m1", b"1"), (b"/m2", b"")]).await.unwrap();
    assert_eq!(
        c.multi_get(&[b"/m2", b"/m1", b"/none"]).await.unwrap(),
        vec![b"".to_vec(), b"1".to_vec(), vec![]]
    );
    let n = c.num_keys().await.unwrap();
    assert_eq!(n as usize, store.num_keys());
    assert!(c.delete_key(b"/a").await.unwrap());
    assert!(!c.delete_key(b"/a").await.unwrap());
    assert_eq!(c.num_keys().await.unwrap(), n - 1);
    let mut keys = c.list_keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, [&b"/ap"[..], b"/cs", b"/m1", b"/m2", b"/n"]);
    assert_eq!(c.ping(77).await.unwrap(), 77);
    store.clear();
    assert_eq!(c.num_keys().await.unwrap(), 0);
}

#[tokio::test]
async fn wait_is_answered_when_the_last_key_appears() {
    let (addr, _) = start().await;
    let mut w = raw(addr).await;
    w.write_all(&enc(Request::Wait {
        keys: vec![b"/x".to_vec(), b"/y".to_vec(), b"/x".to_vec()],
    }))
    .await
    .unwrap();
    assert_eq!(
        read_byte(&mut w, 100).await,
        None,
        "answered before the keys exist"
    );
    let mut c = client(addr).await;
    c.set(b"/x", b"1").await.unwrap();
    assert_eq!(
        read_byte(&mut w, 100).await,
        None,
        "answered with one key still missing"
    );
    c.add(b"/y", 1).await.unwrap();
    assert_eq!(read_byte(&mut w, HANG_MS).await, Some(STOP_WAITING));
    // An immediate wait on existing keys is answered at once.
    let mut c2 = client(addr).await;
    assert!(c2.wait(&[b"/x", b"/y"], None).await.unwrap());
}

#[tokio::test]
async fn wait_timeout_cancel_and_the_race() {
    let (addr, store) = start().await;
    let mut c = client(addr).await;
    // No wait pending: CANCEL_WAIT is still answered.
    assert_eq!(c.cancel_wait().await.unwrap(), WAIT_CANCELED);
    // A wait that times out is cancelled and the connection stays in step.
    assert!(
        !c.wait(&[b"/never"], Some(Duration::from_millis(50)))
            .await
            .unwrap()
    );
    c.set(b"/after", b"ok").await.unwrap();
    assert_eq!(c.get(b"/after").await.unwrap(), b"ok");
    // A cancelled wait must not fire later when its key appears.
    let mut other = client(addr).await;
    other.set(b"/never", b"now").await.unwrap();
    assert_eq!(c.get(b"/never").await.unwrap(), b"now");

    // The race: STOP_WAITING is already on the wire when CANCEL_WAIT is sent. The client then
    // reads STOP_WAITING followed by WAIT_CANCELED, and nothing else.
    let mut w = raw(addr).await;
    w.write_all(&enc(Request::Wait {
        keys: vec![b"/race".to_vec()],
    }))
    .await
    .unwrap();
    // Parked, then woken by the key (no longer parked: its answer is on its way), then the
    // cancel.
    parked(&store, 1).await;
    other.set(b"/race", b"1").await.unwrap();
    parked(&store, 0).await;
    w.write_all(&enc(Request::CancelWait)).await.unwrap();
    assert_eq!(read_byte(&mut w, HANG_MS).await, Some(STOP_WAITING));
    assert_eq!(read_byte(&mut w, HANG_MS).await, Some(WAIT_CANCELED));
    assert_eq!(
        read_byte(&mut w, 100).await,
        None,
        "unsolicited bytes after the cancel"
    );
}

/// One connection waits for a key and does other work between waits (an agent's controls and
/// its views): an interrupted wait leaves the connection in step, a key that came as the wait
/// was cancelled is reported, and a wait that ends by itself gives no interrupt.
#[tokio::test]
async fn a_wait_interrupted_by_other_work_keeps_the_connection_in_step() {
    let (addr, _) = start().await;
    let mut c = client(addr).await;
    let mut other = client(addr).await;
    let (ready, woke) = c
        .wait_or(&[b"/ctl/0"], tokio::time::sleep(Duration::from_millis(50)))
        .await;
    assert_eq!((ready.unwrap(), woke), (false, Some(())));
    // Work between waits is answered in order.
    c.set(b"/view", b"v1").await.unwrap();
    assert_eq!(c.get(b"/view").await.unwrap(), b"v1");
    // The key comes while waiting: ready, no interrupt.
    let setter = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        other.set(b"/ctl/0", b"stop").await.unwrap();
        other
    });
    let (ready, woke) = c.wait_or(&[b"/ctl/0"], std::future::pending::<()>()).await;
    assert_eq!((ready.unwrap(), woke), (true, None));
    assert_eq!(c.get(b"/ctl/0").await.unwrap(), b"stop");
    // The key and the interrupt together: both said, and the connection still in step.
    let mut other = setter.await.unwrap();
    other.set(b"/ctl/1", b"signal 10").await.unwrap();
    let (ready, woke) = c.wait_or(&[b"/ctl/1"], async { 7 }).await;
    let ready = ready.unwrap();
    assert!(ready || woke == Some(7), "{ready} {woke:?}");
    assert_eq!(c.get(b"/ctl/1").await.unwrap(), b"signal 10");
    let (ready, woke) = c
        .wait_or(&[b"/ctl/2"], tokio::time::sleep(Duration::from_millis(20)))
        .await;
    assert_eq!((ready.unwrap(), woke), (false, Some(())));
    assert_eq!(c.num_keys().await.unwrap(), 3);
}

/// The launcher writes a step's control in-process (`Store::set`, from its own thread) just as
/// the agent cancels its wait for it (a signal of its own, its workers' end): whatever the
/// order, the wake comes ahead of the cancel's reply or not at all. A STOP_WAITING sent after
/// WAIT_CANCELED was read as the first byte of the agent's next reply (a GET's length off by
/// one byte, waited for forever: the hang of `srun nrun` after a forwarded SIGUSR1). Every
/// round waits until the wait is parked, then lets the write and the cancel race, the write
/// delayed a little more each round to sweep the cancel's window; the connection is in step
/// when a PING right after answers its own nonce.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_racing_the_cancel_of_its_wait_keeps_the_connection_in_step() {
    use std::sync::mpsc;
    let (addr, store) = start().await;
    let mut c = client(addr).await;
    let (go, rounds) = mpsc::channel::<(Vec<u8>, u32)>();
    let (done, written) = mpsc::channel::<()>();
    let writer = {
        let store = store.clone();
        std::thread::spawn(move || {
            for (key, spin) in rounds {
                // A busy wait, not a sleep: microseconds that move the write across the
                // cancel's window from round to round.
                let at = std::time::Instant::now() + Duration::from_nanos(u64::from(spin));
                while std::time::Instant::now() < at {
                    std::hint::spin_loop();
                }
                store.set(&key, b"signal 10");
                done.send(()).unwrap();
            }
        })
    };
    for round in 0..3000u32 {
        let key = format!("nrun/r/ctl/1/{round}").into_bytes();
        // The interrupt comes once the wait is parked, and starts the write with it.
        let interrupt = async {
            while store.pending_waits().0 == 0 {
                tokio::task::yield_now().await;
            }
            go.send((key.clone(), (round % 100) * 200)).unwrap();
        };
        let (ready, woke) = c.wait_or(&[&key], interrupt).await;
        let ready = ready.unwrap();
        assert!(ready || woke.is_some(), "round {round}");
        written.recv().unwrap();
        // A stray byte shifts the PING's answer (a GET first would wait for a length that
        // never comes).
        let pong = tokio::time::timeout(HANG, c.ping(round)).await;
        assert_eq!(pong.unwrap().unwrap(), round, "round {round}: out of step");
        assert_eq!(c.get(&key).await.unwrap(), b"signal 10", "round {round}");
        assert_eq!(store.pending_waits(), (0, 0, 0), "round {round}");
    }
    drop(go);
    writer.join().unwrap();
}

/// A store cut off (packets dropped: nothing answers, nothing closes) never answers the cancel
/// of an interrupted wait: the wait gives up within CANCEL_REPLY and still hands back what
/// interrupted it (an agent must act on it: its workers stop when the launch host is lost).
#[tokio::test]
async fn an_interrupted_wait_on_a_store_cut_off_gives_up_and_keeps_the_interrupt() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (addr, _) = start().await;
    let cut = Arc::new(AtomicBool::new(false));
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let via = proxy.local_addr().unwrap();
    let forward = cut.clone();
    tokio::spawn(async move {
        let (a, _) = proxy.accept().await.unwrap();
        let b = TcpStream::connect(addr).await.unwrap();
        let (ar, aw) = a.into_split();
        let (br, bw) = b.into_split();
        // Bytes are dropped once cut; the sockets stay open, as a partition leaves them.
        let pipe = |cut: Arc<AtomicBool>| {
            move |mut r: tokio::net::tcp::OwnedReadHalf, mut w: tokio::net::tcp::OwnedWriteHalf| async move {
                let mut buf = vec![0u8; 4096];
                while let Ok(n) = r.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if !cut.load(Ordering::SeqCst) {
                        let _ = w.write_all(&buf[..n]).await;
                    }
                }
                std::future::pending::<()>().await;
            }
        };
        tokio::spawn(pipe(forward.clone())(ar, bw));
        pipe(forward)(br, aw).await;
    });
    let mut c = client(via).await;
    c.set(b"/before", b"1").await.unwrap();
    cut.store(true, Ordering::SeqCst);
    let t = std::time::Instant::now();
    let (ready, woke) = c
        .wait_or(&[b"/ctl/0"], async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            "gone"
        })
        .await;
    let took = t.elapsed();
    assert_eq!(woke, Some("gone"));
    let e = ready.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    assert!(
        took >= nrun_store::client::CANCEL_REPLY && took < HANG,
        "{took:?}"
    );
}

#[tokio::test]
async fn barrier_releases_everyone_at_world_size() {
    let (addr, _) = start().await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        tasks.push(tokio::spawn(async move {
            let mut c = client(addr).await;
            c.barrier(b"/bar", 4, Some(HANG)).await.unwrap()
        }));
    }
    for t in tasks {
        assert!(t.await.unwrap());
    }
    // A barrier short of its world size times out and cancels cleanly.
    let mut c = client(addr).await;
    assert!(
        !c.barrier(b"/bar2", 2, Some(Duration::from_millis(50)))
            .await
            .unwrap()
    );
    assert_eq!(c.get(b"/bar2").await.unwrap(), b"1");
}

#[tokio::test]
async fn queues_wake_one_blocked_pop_per_push() {
    let (addr, store) = start().await;
    let mut c = client(addr).await;
    assert_eq!(c.queue_len(b"/q").await.unwrap(), 0);
    assert_eq!(c.queue_pop(b"/q").await.unwrap(), None);
    assert!(!c.check(&[b"/q"]).await.unwrap());
    // Two blocked pops (WAIT then POP, as torch does); one push wakes exactly one of them.
    let mut w1 = raw(addr).await;
    let mut w2 = raw(addr).await;
    w1.write_all(&enc(Request::Wait {
        keys: vec![b"/q".to_vec()],
    }))
    .await
    .unwrap();
    w2.write_all(&enc(Request::Wait {
        keys: vec![b"/q".to_vec()],
    }))
    .await
    .unwrap();
    parked(&store, 2).await;
    c.queue_push(b"/q", b"a").await.unwrap();
    // One of them wakes (whenever), the other does not.
    let woke = tokio::time::timeout(HANG, async {
        tokio::select! {
            b = w1.read_u8() => (1, b.ok()),
            b = w2.read_u8() => (2, b.ok()),
        }
    })
    .await
    .expect("hung: no blocked pop woke");
    assert_eq!(woke.1, Some(STOP_WAITING), "{woke:?}");
    let (woken, asleep) = match woke.0 {
        1 => (&mut w1, &mut w2),
        _ => (&mut w2, &mut w1),
    };
    assert_eq!(read_byte(asleep, 300).await, None, "one push woke both");
    // The next push wakes the other.
    c.queue_push(b"/q", b"b").await.unwrap();
    assert_eq!(read_byte(asleep, HANG_MS).await, Some(STOP_WAITING));
    assert_eq!(read_byte(woken, 300).await, None);
    assert_eq!(c.queue_len(b"/q").await.unwrap(), 2);
    assert!(c.check(&[b"/q"]).await.unwrap());
    assert_eq!(
        c.queue_pop(b"/q").await.unwrap().as_deref(),
        Some(&b"a"[..])
    );
    assert_eq!(
        c.queue_pop(b"/q").await.unwrap().as_deref(),
        Some(&b"b"[..])
    );
    assert_eq!(c.queue_len(b"/q").await.unwrap(), 0);
}

/// Bad input costs the sender its connection, never the server or anyone else.
#[tokio::test]
async fn malformed_input_closes_only_that_connection() {
    let (addr, _) = start().await;
    let mut good = client(addr).await;
    good.set(b"/k", b"v").await.unwrap();

    let closed = |mut s: TcpStream| async move {
        let mut b = [0u8; 16];
        matches!(
            tokio::time::timeout(HANG, s.read(&mut b)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    };
    // Unknown opcode after VALIDATE.
    let mut s = raw(addr).await;
    s.write_all(&[200]).await.unwrap();
    assert!(closed(s).await);
    // Oversized key, announced but never sent.
    let mut s = raw(addr).await;
    let mut req = vec![3u8];
    req.extend_from_slice(&(1u64 << 40).to_le_bytes());
    s.write_all(&req).await.unwrap();
    assert!(closed(s).await);
    // Too many keys in a WAIT.
    let mut s = raw(addr).await;
    let mut req = vec![6u8];
    req.extend_from_slice(&u64::MAX.to_le_bytes());
    s.write_all(&req).await.unwrap();
    assert!(closed(s).await);
    // A pre-2.2 client: its first request is not VALIDATE (2.1's ADD was opcode 3).
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&[3, 5, 0, 0, 0, 0, 0, 0, 0]).await.unwrap();
    assert!(closed(s).await);
    // VALIDATE with the wrong magic.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&enc(Request::Validate {
        magic: VALIDATE_MAGIC ^ 1,
    }))
    .await
    .unwrap();
    assert!(closed(s).await);
    // ADD on a value that is not a counter.
    let mut s = raw(addr).await;
    s.write_all(&enc(Request::Add {
        key: b"/k".to_vec(),
        delta: 1,
    }))
    .await
    .unwrap();
    assert!(closed(s).await);

    assert_eq!(good.get(b"/k").await.unwrap(), b"v");
    assert_eq!(client(addr).await.get(b"/k").await.unwrap(), b"v");
}

#[tokio::test]
async fn large_values_arrive_in_pieces() {
    let (addr, _) = start().await;
    let mut c = client(addr).await;
    let big: Vec<u8> = (0..8 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    c.set(b"/big", &big).await.unwrap();
    assert_eq!(c.get(b"/big").await.unwrap(), big);
}

#[tokio::test]
async fn many_clients_rendezvous() {
    let (addr, _) = start().await;
    let n = 200;
    let mut tasks = Vec::new();
    for i in 0..n {
        tasks.push(tokio::spawn(async move {
            let mut c = client(addr).await;
            c.add(b"/arrived", 1).await.unwrap();
            if i == 0 {
                c.set(b"/id", b"unique-id").await.unwrap();
            }
            assert!(c.wait(&[b"/id"], Some(HANG)).await.unwrap());
            c.get(b"/id").await.unwrap()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), b"unique-id");
    }
    assert_eq!(
        client(addr).await.get(b"/arrived").await.unwrap(),
        n.to_string().as_bytes()
    );
}

/// An agent's `/alive` counter is removed when its connection closes: the coordinator knows at
/// once that an agent ended or was killed.
#[tokio::test]
async fn an_agents_alive_counter_goes_with_its_connection() {
    let (store, addr) = serve_with_secret(b"s3cret").await;
    let mut agent = client(addr).await;
    agent.authenticate(b"s3cret").await.unwrap();
    agent.add(b"nrun/run/n3/alive", 1).await.unwrap();
    agent.add(b"nrun/run/n3/alive", 1).await.unwrap();
    agent.add(b"nrun/run/n3/count", 1).await.unwrap();
    assert_eq!(store.get(b"nrun/run/n3/alive").unwrap(), b"2");
    // The kernel's view of the connection that tied it, for the coordinator's verdict on a
    // still heartbeat: open, its last beat answered, heard within the test's bound.
    let view = store
        .tied_link(b"nrun/run/n3/alive")
        .expect("a tied connection");
    assert!(view.established, "{view:?}");
    assert!(!view.awaits_reply(), "{view:?}");
    assert!(view.since_received < HANG, "{view:?}");
    assert!(store.tied_link(b"nrun/run/n3/count").is_none());
    // A torch client's key of the same name is its own business: it stays.
    let mut worker = client(addr).await;
    worker.add(b"job/alive", 1).await.unwrap();
    assert!(store.tied_link(b"job/alive").is_none());
    drop(worker);
    // The agent's process ends (or is killed: its kernel closes the socket the same way).
    drop(agent);
    let end = std::time::Instant::now() + HANG;
    while store.contains(b"nrun/run/n3/alive") && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !store.contains(b"nrun/run/n3/alive"),
        "removed with its connection"
    );
    assert!(store.tied_link(b"nrun/run/n3/alive").is_none());
    assert_eq!(
        store.get(b"nrun/run/n3/count").unwrap(),
        b"1",
        "other keys stay"
    );
    assert_eq!(store.get(b"job/alive").unwrap(), b"1");
}

/// With a secret, `nrun/` keys belong to connections that presented it: a torch worker can
/// neither read nor write them, nor see them listed; everything else works as usual.
#[tokio::test]
async fn control_keys_need_the_secret() {
    let (store, addr) = serve_with_secret(b"s3cret").await;

    let mut agent = client(addr).await;
    agent.authenticate(b"s3cret").await.unwrap();
    agent.set(b"nrun/run/plan", b"x").await.unwrap();
    assert_eq!(agent.get(b"nrun/run/plan").await.unwrap(), b"x");
    // The observe prefix stores the address the server saw, not the value sent.
    agent.set(b"nrun/observed/r/0", b"forged").await.unwrap();
    assert_eq!(agent.get(b"nrun/observed/r/0").await.unwrap(), b"127.0.0.1");

    let mut worker = client(addr).await;
    worker.set(b"/user", b"1").await.unwrap();
    assert_eq!(
        worker.list_keys().await.unwrap(),
        vec![b"/user".to_vec()],
        "nrun/ keys must not be listed"
    );
    assert!(
        worker.get(b"nrun/run/plan").await.is_err(),
        "read without the secret"
    );
    let mut worker = client(addr).await;
    let _ = worker.set(b"nrun/run/plan", b"evil").await;
    assert!(
        worker.ping(1).await.is_err(),
        "write without the secret must close the connection"
    );
    // nrun/public/ keys are readable by anyone (what a joining nrun needs before it can prove
    // anything: whether an nrun listens, which c10d rendezvous it hosts), never writable.
    store.set(b"nrun/public/store", b"v1");
    let mut stranger = client(addr).await;
    assert!(stranger.check(&[b"nrun/public/store"]).await.unwrap());
    assert!(!stranger.check(&[b"nrun/public/c10d/x"]).await.unwrap());
    assert_eq!(stranger.get(b"nrun/public/store").await.unwrap(), b"v1");
    let _ = stranger
        .check(&[b"nrun/public/store", b"nrun/run/plan"])
        .await;
    assert!(
        stranger.ping(1).await.is_err(),
        "a read naming a private key beside a public one without the secret"
    );
    let mut stranger = client(addr).await;
    let _ = stranger.set(b"nrun/public/store", b"forged").await;
    assert!(
        stranger.ping(1).await.is_err(),
        "a write of a public key without the secret"
    );
    assert_eq!(store.get(b"nrun/public/store").unwrap(), b"v1");
    // The plain secret is no proof (it never crosses the wire), nor is a proof made for
    // another connection's challenge.
    let mut plain = client(addr).await;
    let _ = plain.set(nrun_store::server::AUTH_KEY, b"s3cret").await;
    assert!(
        plain.ping(1).await.is_err(),
        "the plain secret was accepted"
    );
    let mut sniffer = client(addr).await;
    let theirs = sniffer
        .get(nrun_store::server::CHALLENGE_KEY)
        .await
        .unwrap();
    let _ = sniffer
        .set(
            nrun_store::server::AUTH_KEY,
            &nrun_store::auth::prove(b"s3cret", b"an-earlier-nonce"),
        )
        .await;
    assert!(!theirs.is_empty());
    assert!(
        sniffer.ping(1).await.is_err(),
        "a replayed proof was accepted"
    );
    let mut wrong = client(addr).await;
    let _ = wrong.authenticate(b"guess").await;
    assert!(
        wrong.ping(1).await.is_err(),
        "a wrong secret must close the connection"
    );
    assert_eq!(agent.get(b"nrun/run/plan").await.unwrap(), b"x");
    assert_eq!(store.get(b"nrun/run/plan").unwrap(), b"x");
}

/// One small request asking for a huge reply (an 8 MiB value named 131,072 times: 1 TiB)
/// closes that connection; the store keeps serving everyone else.
#[tokio::test]
async fn a_huge_multi_get_closes_only_that_connection() {
    let (addr, store) = start().await;
    let mut c = client(addr).await;
    c.set(b"/k", &vec![b'v'; 8 << 20]).await.unwrap();
    let mut bomb = raw(addr).await;
    let keys = vec![b"/k".to_vec(); 131_072];
    bomb.write_all(&enc(Request::MultiGet { keys }))
        .await
        .unwrap();
    let mut b = [0u8; 1];
    let closed = tokio::time::timeout(HANG, bomb.read(&mut b)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the bomb's connection stayed open: {closed:?}"
    );
    // Everyone else is served as before.
    assert_eq!(c.get(b"/k").await.unwrap().len(), 8 << 20);
    let mut d = client(addr).await;
    d.set(b"/after", b"1").await.unwrap();
    assert_eq!(d.get(b"/after").await.unwrap(), b"1");
    assert_eq!(store.get(b"/after").unwrap(), b"1");
}

/// Waits that are cancelled or whose connection goes leave no state behind (10 clients x 400
/// distinct keys each, as in the finding).
#[tokio::test]
async fn ended_waits_leave_nothing_behind() {
    let (addr, store) = start().await;
    let mut conns = Vec::new();
    for c in 0..10 {
        let mut s = raw(addr).await;
        let keys: Vec<Vec<u8>> = (0..400)
            .map(|k| format!("/w{c}/{k}").into_bytes())
            .collect();
        s.write_all(&enc(Request::Wait { keys })).await.unwrap();
        conns.push(s);
    }
    let barrier = {
        let mut s = raw(addr).await;
        s.write_all(&enc(Request::Barrier {
            key: b"/b".to_vec(),
            world_size: 5,
        }))
        .await
        .unwrap();
        s
    };
    let deadline = std::time::Instant::now() + HANG;
    while store.pending_waits() != (11, 4000, 1) {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            store.pending_waits()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // One cancels, the others hang up.
    let mut first = conns.remove(0);
    first.write_all(&enc(Request::CancelWait)).await.unwrap();
    assert_eq!(read_byte(&mut first, HANG_MS).await, Some(WAIT_CANCELED));
    drop(conns);
    drop(barrier);
    let deadline = std::time::Instant::now() + HANG;
    while store.pending_waits() != (0, 0, 0) {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            store.pending_waits()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A connection that never says VALIDATE is closed after the handshake time (10 s).
#[tokio::test]
async fn a_silent_connection_is_closed() {
    let (addr, _store) = start().await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(HANG, s.read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "still open: {r:?}");
}

/// A single node's store serves this host only: a client from another address is closed at
/// once, loopback clients (every 127.0.0.x) are served.
#[tokio::test]
async fn a_loopback_only_store_refuses_other_hosts() {
    let (addr, store) = start().await;
    store.loopback_only();
    let mut c = Client::connect(SocketAddr::from(([127, 0, 0, 7], addr.port())), HANG)
        .await
        .unwrap();
    c.set(b"/k", b"v").await.unwrap();
    assert_eq!(c.get(b"/k").await.unwrap(), b"v");
    // This host's own non-loopback address stands in for another host.
    let other = nrun_base::net::reachable_addrs(&nrun_base::net::interfaces())
        .into_iter()
        .find(|ip| ip.is_ipv4() && !ip.is_loopback());
    let Some(ip) = other else {
        skip::cannot_set_up("no non-loopback IPv4 address here for the remote half");
        return;
    };
    let mut s = TcpStream::connect(SocketAddr::new(ip, addr.port()))
        .await
        .unwrap();
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(HANG, s.read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "served {ip}: {r:?}");
}

/// Past the store's cap a write fails the client that made it; the store and its other clients
/// go on, and freeing keys makes room again.
#[tokio::test]
async fn a_full_store_fails_the_writer_not_the_store() {
    let (addr, store) = start().await;
    store.set_max_bytes(4 << 20);
    let mut a = client(addr).await;
    // Within the three quarters any client may fill (the last is kept for small holders).
    a.set(b"/a", &vec![1u8; 5 << 19]).await.unwrap();
    assert_eq!(a.get(b"/a").await.unwrap().len(), 5 << 19);
    let mut b = client(addr).await;
    let _ = b.set(b"/b", &vec![2u8; 2 << 20]).await;
    assert!(b.ping(1).await.is_err(), "the write past the cap was taken");
    assert!(store.get(b"/b").is_none());
    // The others are served; a delete makes room.
    assert!(a.delete_key(b"/a").await.unwrap());
    let mut c = client(addr).await;
    c.set(b"/b", &vec![2u8; 2 << 20]).await.unwrap();
    assert_eq!(c.get(b"/b").await.unwrap().len(), 2 << 20);
}

/// A client from another address that fills the store is refused at three quarters of the
/// cap; the last quarter stays for addresses holding little (under a 64th of the cap each: the
/// job's ranks), whose writes go on until it too is full; what the filler frees, and a SET
/// overwriting its key, count back where they were charged.
#[tokio::test]
async fn a_filled_store_refuses_only_the_client_that_filled_it() {
    let (addr, store) = start().await;
    store.set_max_bytes(64 << 20);
    let from = |ip: [u8; 4]| async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(SocketAddr::from((ip, 0))).unwrap();
        Client::from_stream(sock.connect(addr).await.unwrap())
            .await
            .unwrap()
    };
    let mut filler = from([127, 0, 0, 2]).await;
    let mut taken = 0usize;
    for i in 0.. {
        let key = format!("/fill/{i}");
        if filler
            .set(key.as_bytes(), &vec![7u8; 1 << 20])
            .await
            .is_err()
            || filler.ping(1).await.is_err()
        {
            break;
        }
        taken += 1 << 20;
    }
    assert!(
        (46 << 20..=48 << 20).contains(&taken),
        "the filler took {taken} bytes of 64 MiB"
    );
    // The job's ranks (another address, a few KiB each) still write and read.
    let mut ranks = Vec::new();
    for r in 0..8 {
        let mut c = from([127, 0, 0, 3]).await;
        let key = format!("/rank/{r}");
        c.set(key.as_bytes(), &vec![r as u8; 4000]).await.unwrap();
        assert_eq!(c.get(key.as_bytes()).await.unwrap().len(), 4000);
        ranks.push(c);
    }
    // A second filler from a third address gets only its small share of the reserve.
    let mut second = from([127, 0, 0, 4]).await;
    let mut more = 0usize;
    for i in 0.. {
        let key = format!("/second/{i}");
        if second
            .set(key.as_bytes(), &vec![8u8; 64 << 10])
            .await
            .is_err()
            || second.ping(1).await.is_err()
        {
            break;
        }
        more += 64 << 10;
    }
    assert!(
        more <= 1 << 20,
        "a second address took {more} bytes of the reserve"
    );
    // The ranks go on.
    assert_eq!(ranks[0].get(b"/rank/7").await.unwrap().len(), 4000);
    ranks[0].set(b"/rank/0/again", b"x").await.unwrap();
    assert_eq!(ranks[0].get(b"/rank/0/again").await.unwrap(), b"x");
    // What the filler holds, given back by another client's delete and overwrite, is room
    // for the filler again (counted where it was charged).
    for i in 0..4 {
        assert!(
            ranks[1]
                .delete_key(format!("/fill/{i}").as_bytes())
                .await
                .unwrap()
        );
    }
    ranks[1].set(b"/fill/4", b"").await.unwrap();
    ranks[1].get(b"/fill/4").await.unwrap();
    let mut again = from([127, 0, 0, 2]).await;
    again
        .set(b"/fill/again", &vec![7u8; 4 << 20])
        .await
        .unwrap();
    assert_eq!(again.get(b"/fill/again").await.unwrap().len(), 4 << 20);
}

/// The coordinator learns which of nrun's keys clients set (and only those, in order), so that
/// it looks again at those nodes alone; a list nobody took for long becomes "look at all".
#[tokio::test]
async fn the_store_lists_the_control_keys_clients_set() {
    let (addr, store) = start().await;
    let mut c = client(addr).await;
    c.set(b"nrun/r/n3/joined", b"{}").await.unwrap();
    c.set(b"/user", b"1").await.unwrap();
    c.add(b"nrun/r/n1/alive", 1).await.unwrap();
    c.set(b"nrun/r/n0/result/0", b"{}").await.unwrap();
    // SET has no reply: a GET behind it is answered once it was applied.
    c.get(b"/user").await.unwrap();
    // The coordinator's own writes are no news to it.
    store.set(b"nrun/r/n2/step/0", b"x");
    let got = store.take_changes();
    assert!(!got.overflowed);
    assert_eq!(
        got.keys,
        vec![b"nrun/r/n3/joined".to_vec(), b"nrun/r/n0/result/0".to_vec()]
    );
    assert!(store.take_changes().keys.is_empty(), "taken once");

    for i in 0..70_000 {
        c.set(format!("nrun/r/n{i}/joined").as_bytes(), b"")
            .await
            .unwrap();
    }
    c.get(b"/user").await.unwrap();
    let got = store.take_changes();
    assert!(got.overflowed, "{} keys kept", got.keys.len());
    assert!(got.keys.len() < 70_000);
    assert!(!store.take_changes().overflowed, "cleared by the taking");
}

/// The handshake tells a TCPStore from another program on its port: nrun's store answers;
/// one that greets with its own banner (an sshd) is named with what it said; one that says
/// nothing is named as silent within the wait; a store's at-once close stays an EOF.
#[tokio::test]
async fn the_handshake_names_what_else_listens() {
    let (store_at, _store) = start().await;
    let s = TcpStream::connect(store_at).await.unwrap();
    Client::from_stream_within(s, HANG).await.unwrap();

    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other = l.local_addr().unwrap();
    let (keep, mut kept) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        // First a banner, then silence, then a close.
        let (mut a, _) = l.accept().await.unwrap();
        a.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await.unwrap();
        let _ = keep.send(a);
        let (b, _) = l.accept().await.unwrap();
        let _ = keep.send(b);
        let (c, _) = l.accept().await.unwrap();
        drop(c);
    });
    let e = Client::from_stream_within(TcpStream::connect(other).await.unwrap(), HANG)
        .await
        .err()
        .unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("\"SSH-2.0-OpenSSH_9.2\""), "{e}");
    let _banner = kept.recv().await;
    // Silence: the wait is the bound itself, short (nothing is to come). Its own kind: a
    // silent port may be a stopped store's, which callers wait for.
    let e = Client::from_stream_within(
        TcpStream::connect(other).await.unwrap(),
        Duration::from_millis(300),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    assert!(e.to_string().contains("answered nothing"), "{e}");
    let _silent = kept.recv().await;
    let e = Client::from_stream_within(TcpStream::connect(other).await.unwrap(), HANG)
        .await
        .err()
        .unwrap();
    assert_ne!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
}
