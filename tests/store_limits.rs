//! What one client may take of the store (issue 19, items 1-3), over real sockets: replies
//! streamed under a budget, unfinished requests timed out, every stored byte counted, framing in
//! linear time, and connection caps that keep the job's ranks able to connect.
//!
//! The torch halves need a python with torch (NRUN_TEST_PYTHON, see tests/common); without one
//! they check with nrun's own client and say so.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::store::{VALIDATE, raw_from, serve_store};
use common::{
    HANG, Scene, await_listen, need_torch, signal, text, wait_until, wait_until_async,
    wait_with_timeout,
};
use nrun_store::Store;
use nrun_store::client::Client;
use nrun_store::protocol::Request;
use nrun_store::server::Limits;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn enc(r: Request) -> Vec<u8> {
    let mut v = Vec::new();
    r.encode(&mut v);
    v
}

/// Whether the server closes `s` within `within`.
async fn closed(s: &mut TcpStream, within: Duration) -> bool {
    let mut b = [0u8; 4096];
    let end = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(end, s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

/// The kernel's send and receive queues (bytes) of this machine's TCP sockets on local port
/// `local` (and remote port `remote`, where given; a listening socket's receive queue is its
/// backlog of connections not yet accepted), from /proc/net/tcp and tcp6.
fn tcp_queues(local: u16, remote: Option<u16>) -> Vec<(u64, u64)> {
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next()?, 16).ok();
    let mut found = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let t = std::fs::read_to_string(table).unwrap_or_default();
        for line in t.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let queues = f.get(4).and_then(|q| q.split_once(':'));
            let (Some(l), Some(r), Some((tx, rx))) = (f.get(1), f.get(2), queues) else {
                continue;
            };
            let remote_ok = remote.is_none_or(|want| port(r) == Some(want));
            if port(l) == Some(local) && remote_ok {
                let hex = |h: &str| u64::from_str_radix(h, 16).unwrap_or(0);
                found.push((hex(tx), hex(rx)));
            }
        }
    }
    found
}

/// Whether the store on `port` took every connection off its listen queue (accepted it, or
/// accepted and closed it past its caps).
fn all_accepted(port: u16) -> bool {
    let listening = tcp_queues(port, Some(0));
    !listening.is_empty() && listening.iter().all(|&(_, backlog)| backlog == 0)
}

/// A torch TCPStore client's set/get against `port`, or nrun's client where torch is missing.
fn torch_set_get(port: u16, key: &str) {
    // Without torch (said, or a failure under scripts/test.sh): nrun's client checks instead.
    let Some(py) = need_torch() else {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let mut c = Client::connect(addr, Duration::from_secs(10))
                .await
                .unwrap();
            c.set(format!("/{key}").as_bytes(), b"ok").await.unwrap();
            assert_eq!(c.get(format!("/{key}").as_bytes()).await.unwrap(), b"ok");
        });
        return;
    };
    let probe = format!(
        "import datetime, torch.distributed as d\n\
         s = d.TCPStore('127.0.0.1', {port}, is_master=False, timeout=datetime.timedelta(seconds=20))\n\
         s.set('{key}', 'ok'); assert s.get('{key}') == b'ok'\n\
         print('torch client ok')"
    );
    let t0 = Instant::now();
    let out = std::process::Command::new(&py)
        .args(["-c", &probe])
        .output()
        .unwrap();
    assert!(
        text(&out.stdout).contains("torch client ok"),
        "torch client failed after {:?}:\n{}\n{}",
        t0.elapsed(),
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// Item 1: one connection SETs 8 MiB and pipelines 1,000 GETs of it (26 KB asking for 8 GiB of
/// replies). nrun, under a 3 GiB address-space limit, must neither abort nor grow: the replies
/// wait under the connection's output budget while it does not read, and flow when it does.
/// A torch client then still completes set/get against the same store.
#[test]
fn pipelined_gets_of_a_large_value_stay_within_an_address_space_limit() {
    use std::io::{Read, Write};
    let port = common::free_port();
    let s = Scene::new();
    let mut c = s.cmd(&[
        "--master-port",
        &port.to_string(),
        "--no-python",
        "sleep",
        "300",
    ]);
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        c.pre_exec(|| {
            let limit = 3u64 << 30;
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_AS, limit, limit)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = c.spawn().unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    await_listen(&mut child, addr);
    let nrun_pid: u32 = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id()))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let rss_mib = || {
        std::fs::read_to_string(format!("/proc/{nrun_pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib / 1024)
    };
    let before = rss_mib();

    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    let mut req = VALIDATE.to_vec();
    req.extend(enc(Request::Set {
        key: b"/big".to_vec(),
        value: vec![7u8; 8 << 20],
    }));
    for _ in 0..1000 {
        req.extend(enc(Request::Get {
            key: b"/big".to_vec(),
        }));
    }
    conn.write_all(&req).unwrap();
    // Not reading: the store must pause this connection, not build 8 GiB of replies. It has
    // answered as far as the socket takes (its end's send queue backs up: the SET and GETs
    // were read and replies are waiting on this client) ...
    let mine = conn.local_addr().unwrap().port();
    wait_until(
        "the store's replies to back up on a client that does not read",
        || tcp_queues(port, Some(mine)).iter().any(|&(tx, _)| tx > 0),
    );
    // ... and a store that did not pause would grow past the bound below in milliseconds
    // (32 replies past its budget): this is time for such a store to show, not a wait for an
    // event.
    std::thread::sleep(Duration::from_secs(3));
    let paused = rss_mib();
    // Reading: the replies flow (each is the 8-byte length, then the value).
    conn.set_read_timeout(Some(HANG)).unwrap();
    let mut got = 0usize;
    let mut b = vec![0u8; 1 << 20];
    while got < 200 << 20 {
        let n = conn.read(&mut b).unwrap();
        assert!(n > 0, "the store closed a connection that was reading");
        got += n;
    }
    let reading = rss_mib();
    drop(conn);
    eprintln!("nrun's RSS: {before} MiB before, {paused} MiB paused, {reading} MiB reading");
    assert!(
        child.try_wait().unwrap().is_none(),
        "nrun died under the pipelined GETs"
    );
    assert!(
        paused < before + 256 && reading < before + 256,
        "nrun's RSS grew from {before} MiB to {paused} MiB (not reading) and {reading} MiB \
         (reading)"
    );
    torch_set_get(port, "after-gets");
    signal(&child, "TERM");
    let (out, _) = wait_with_timeout(child, Duration::from_secs(20));
    assert!(
        !text(&out.stderr).contains("memory allocation"),
        "{}",
        text(&out.stderr)
    );
    s.assert_no_survivors();
}

/// Item 1: a client that does not read its replies is closed after the stall time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_closed() {
    let store = Store::new();
    store.set_limits(Limits {
        stall: Duration::from_secs(1),
        out_budget: 1 << 20,
        ..Limits::default()
    });
    let addr = serve_store(store.clone()).await;
    let mut c = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
    c.set(b"/big", &vec![1u8; 4 << 20]).await.unwrap();
    assert_eq!(c.ping(1).await.unwrap(), 1);
    let mut s = raw_from([127, 0, 0, 1], addr).await.unwrap();
    let mut req = Vec::new();
    for _ in 0..64 {
        req.extend(enc(Request::Get {
            key: b"/big".to_vec(),
        }));
    }
    // Counted by the store first (its accept may lag the client's connect on a busy host),
    // so that the wait below sees this connection close, not its arrival.
    wait_until_async("the store to take the connection", || {
        store.connections() >= 2
    })
    .await;
    // Timed from before the request: the store cannot give up sooner than the stall time.
    let t0 = Instant::now();
    s.write_all(&req).await.unwrap();
    // Wait for the store to give up on it, without reading; then the reads see the close.
    wait_until_async("the store to close a client that never reads", || {
        store.connections() <= 1
    })
    .await;
    assert!(
        t0.elapsed() >= Duration::from_millis(950),
        "closed too early: {:?}",
        t0.elapsed()
    );
    assert!(closed(&mut s, HANG).await);
    // The others are served.
    assert_eq!(c.get(b"/big").await.unwrap().len(), 4 << 20);
}

/// Item 2: an 8 MiB MULTI_SET frame begun but never finished is closed after the frame
/// timeout, and its buffer is given back; trickling a byte now and then does not keep it open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_request_is_closed_after_the_frame_timeout() {
    let store = Store::new();
    store.set_limits(Limits {
        frame_timeout: Duration::from_secs(1),
        ..Limits::default()
    });
    let addr = serve_store(store.clone()).await;
    let baseline = store.held_bytes();
    let mut frame = enc(Request::MultiSet {
        pairs: vec![(b"/k".to_vec(), vec![3u8; 8 << 20])],
    });
    frame.truncate(frame.len() - 1);
    let mut s = raw_from([127, 0, 0, 1], addr).await.unwrap();
    s.write_all(&frame).await.unwrap();
    let t0 = Instant::now();
    wait_until_async("the frame to be buffered", || {
        store.held_bytes() >= baseline + (8 << 20)
    })
    .await;
    // A second one trickles a byte every 200 ms.
    let mut t = raw_from([127, 0, 0, 1], addr).await.unwrap();
    let trickle = tokio::spawn(async move {
        let frame = enc(Request::Set {
            key: b"/t".to_vec(),
            value: vec![1u8; 100],
        });
        for b in frame {
            if t.write_all(&[b]).await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    });
    assert!(
        closed(&mut s, HANG).await,
        "the unfinished frame's connection stayed open"
    );
    let took = t0.elapsed();
    // Not before the frame timeout (load only adds to it); the upper bound is a hang guard
    // (a frame never finished is otherwise held for good).
    assert!(
        took >= Duration::from_millis(800) && took < HANG,
        "closed after {took:?}"
    );
    assert!(trickle.await.unwrap(), "a trickled request was served");
    wait_until_async("the closed frames' buffers to be given back", || {
        store.held_bytes() <= baseline + (1 << 20)
    })
    .await;
    assert!(store.get(b"/k").is_none() && store.get(b"/t").is_none());
    // Whole requests are served as ever, however slow the client between them.
    let mut c = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
    c.set(b"/a", b"1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(c.get(b"/a").await.unwrap(), b"1");
}

/// Item 2: QUEUE_PUSH counts against --store-max-bytes, empty items and the queue's key too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_pushes_are_refused_past_the_store_cap() {
    let store = Store::new();
    store.set_max_bytes(1 << 20);
    let addr = serve_store(store.clone()).await;
    // 1 KiB items: at most 768 fit, the three quarters one client may fill (the last quarter
    // is kept for addresses holding little, issue 46).
    let mut c = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
    let mut pushed = 0;
    while c.queue_push(b"/q", &[5u8; 1024]).await.is_ok() && c.ping(1).await.is_ok() {
        pushed += 1;
        assert!(
            pushed <= 768,
            "pushed {pushed} KiB into 3/4 of a 1 MiB store"
        );
    }
    assert!(pushed > 700, "refused after {pushed} pushes");
    assert!(store.stored_bytes() <= 1 << 20);
    // Empty items (pipelined, into a store of their own): each still costs its place.
    let store = Store::new();
    store.set_max_bytes(1 << 20);
    let addr = serve_store(store.clone()).await;
    let mut s = raw_from([127, 0, 0, 1], addr).await.unwrap();
    let mut req = Vec::new();
    for i in 0..200_000u32 {
        req.extend(enc(Request::QueuePush {
            key: format!("/e{}", i % 7).into_bytes(),
            value: vec![],
        }));
    }
    req.extend(enc(Request::Ping { nonce: 9 }));
    let _ = s.write_all(&req).await;
    let mut b = [0u8; 4];
    let r = tokio::time::timeout(HANG, s.read_exact(&mut b)).await;
    assert!(
        matches!(r, Ok(Err(_))),
        "200,000 empty pushes were all taken: {r:?}"
    );
    assert!(store.stored_bytes() <= 1 << 20);
    let held = (0..7).map(|i| format!("/e{i}")).collect::<Vec<_>>();
    let mut c = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
    let mut items = 0;
    for k in &held {
        items += c.queue_len(k.as_bytes()).await.unwrap();
    }
    assert!(
        items > 0 && items <= (1 << 20) / 32,
        "{items} empty items in 1 MiB"
    );
    // Popping makes room again.
    let before = store.stored_bytes();
    for _ in 0..10 {
        assert!(c.queue_pop(b"/e0").await.unwrap().is_some());
    }
    assert!(store.stored_bytes() < before);
    c.queue_push(b"/e0", b"x").await.unwrap();
    assert!(c.ping(2).await.is_ok());
}

/// Item 2: a CHECK of 25,000 large keys (8,000 bytes each: 191 MiB) is framed and parsed in time
/// linear in its size; the store used to parse from the start after every read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_of_many_large_keys_parses_in_linear_time() {
    let store = Store::new();
    // Budgets past the request's size (twice it while it is parsed): this is about time.
    store.set_limits(Limits {
        conn_budget: 1 << 30,
        peer_budget: 1 << 30,
        memory_budget: 2 << 30,
        ..Limits::default()
    });
    let addr = serve_store(store.clone()).await;
    async fn check_time(addr: SocketAddr, n: usize) -> Duration {
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let mut k = format!("/{i}/").into_bytes();
                k.resize(8000, b'k');
                k
            })
            .collect();
        let req = enc(Request::Check { keys });
        let mut s = raw_from([127, 0, 0, 1], addr).await.unwrap();
        let t0 = Instant::now();
        let (mut rd, mut wr) = s.split();
        // Sent in paced pieces, as a remote client's bytes arrive: many reads per request.
        let send = async {
            for piece in req.chunks(1 << 20) {
                wr.write_all(piece).await?;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            std::io::Result::Ok(())
        };
        let (w, r) = tokio::join!(send, rd.read_u8());
        w.unwrap();
        assert_eq!(r.unwrap(), nrun_store::protocol::CHECK_NOT_READY);
        t0.elapsed()
    }
    let mut small = Duration::MAX;
    let mut large = Duration::MAX;
    for _ in 0..2 {
        small = small.min(check_time(addr, 6_250).await);
        large = large.min(check_time(addr, 25_000).await);
    }
    eprintln!("CHECK of 6,250 keys: {small:?}; of 25,000 keys: {large:?}");
    // Linear is 4x; quadratic 16x. Slack for a loaded machine.
    assert!(
        large < small * 8 + Duration::from_millis(500),
        "4x the keys took {:.1}x the time ({small:?} -> {large:?})",
        large.as_secs_f64() / small.as_secs_f64()
    );
    assert!(large < HANG, "hung: {large:?}");
}

/// Item 3: thousands of idle validated connections (from the ranks' own address and from
/// others) neither lock out a torch client nor an agent that proved nrun's secret, and nrun
/// never holds more than its caps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_idle_connections_do_not_lock_out_a_torch_client() {
    let store = Store::with_secret(b"s3cret".to_vec());
    store.set_limits(Limits {
        per_peer: 400,
        total: 600,
        ..Limits::default()
    });
    let addr = serve_store(store.clone()).await;
    let mut agent = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
    agent.authenticate(b"s3cret").await.unwrap();
    agent.set(b"nrun/x", b"1").await.unwrap();
    // The abuser: 1,500 idle sockets from the ranks' address, 1,500 from another.
    let mut idle = Vec::new();
    for from in [[127, 0, 0, 1], [127, 0, 0, 2]] {
        for _ in 0..1500 {
            if let Ok(s) = raw_from(from, addr).await {
                idle.push(s);
            }
        }
    }
    // Every one of them went through the caps (accepted, or accepted and closed).
    wait_until_async("the store to accept every idle socket", || {
        all_accepted(addr.port())
    })
    .await;
    assert!(store.connections() <= 600, "{} open", store.connections());
    let port = addr.port();
    // The client's own 20 s timeout (connect retries included) is the check: locked out, it
    // fails; how fast it gets in is not bounded here.
    tokio::task::spawn_blocking(move || torch_set_get(port, "after-idle"))
        .await
        .unwrap();
    // The agent kept its connection through it all.
    assert_eq!(agent.get(b"nrun/x").await.unwrap(), b"1");
    assert!(store.connections() <= 600);
    drop(idle);
}

/// Item 3: nrun under an open-file limit of 256 (soft and hard) with 1,000 idle sockets thrown
/// at its store: the total cap stays below the limit, so accept never fails with "Too many open
/// files" (no loop of it in the log), the idle sockets are the ones closed, and a torch client
/// still connects and completes set/get.
#[test]
fn idle_sockets_never_run_nrun_out_of_file_descriptors() {
    let port = common::free_port();
    let s = Scene::new();
    let mut c = s.cmd(&[
        "--master-port",
        &port.to_string(),
        "--no-python",
        "sleep",
        "300",
    ]);
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        c.pre_exec(|| {
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, 256, 256)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = c.spawn().unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    await_listen(&mut child, addr);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let idle = rt.block_on(async {
        let mut idle = Vec::new();
        for _ in 0..1000 {
            if let Ok(s) = raw_from([127, 0, 0, 1], addr).await {
                idle.push(s);
            }
        }
        idle
    });
    // Every one of them went through nrun's caps (accepted, or accepted and closed).
    wait_until("nrun's store to accept every idle socket", || {
        all_accepted(port)
    });
    assert!(
        child.try_wait().unwrap().is_none(),
        "nrun died under the idle sockets"
    );
    torch_set_get(port, "after-fds");
    drop(idle);
    signal(&child, "TERM");
    let (out, _) = wait_with_timeout(child, Duration::from_secs(20));
    let stderr = text(&out.stderr);
    assert!(
        !stderr.contains("Too many open files") && !stderr.contains("accept failed"),
        "{stderr}"
    );
    s.assert_no_survivors();
}

/// Item 2: unfinished requests of all connections together stay under the store's budget for
/// what connections hold: the connection whose request would pass it is closed; the others are
/// served. A request being received counts twice its size (its buffer, and the copy parsed out
/// of it), and large holdings may use three quarters of the budget: 16 MiB holds one 4 MiB
/// request, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_requests_share_one_budget() {
    let store = Store::new();
    store.set_limits(Limits {
        memory_budget: 16 << 20,
        ..Limits::default()
    });
    let addr = serve_store(store.clone()).await;
    let mut frame = enc(Request::Set {
        key: b"/k".to_vec(),
        value: vec![3u8; 4 << 20],
    });
    frame.truncate(frame.len() - 1);
    let mut a = raw_from([127, 0, 0, 1], addr).await.unwrap();
    a.write_all(&frame).await.unwrap();
    wait_until_async("the first frame to be buffered", || {
        store.held_bytes() >= 4 << 20
    })
    .await;
    let mut b = raw_from([127, 0, 0, 2], addr).await.unwrap();
    let _ = b.write_all(&frame).await;
    assert!(
        closed(&mut b, HANG).await,
        "a second 4 MiB unfinished request fit a 16 MiB budget"
    );
    assert!(store.held_bytes() <= 12 << 20);
    // The first finishes and is served; small requests always are.
    a.write_all(&[3]).await.unwrap();
    let mut c = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
    wait_until_async("the first request to be served", || {
        store.get(b"/k").is_some()
    })
    .await;
    assert_eq!(c.get(b"/k").await.unwrap().len(), 4 << 20);
}

/// Every held byte counted: the keys of parked WAITs share one budget; a WAIT past it closes
/// its connection, and ended waits give their share back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_waits_share_one_budget() {
    let store = Store::new();
    store.set_limits(Limits {
        wait_budget: 1 << 20,
        ..Limits::default()
    });
    let addr = serve_store(store.clone()).await;
    let big = |tag: &str| {
        (0..100)
            .map(|i| {
                let mut k = format!("/{tag}/{i}/").into_bytes();
                k.resize(4000, b'w');
                k
            })
            .collect::<Vec<_>>()
    };
    // 100 keys of 4,000 bytes: 0.8 MB held while parked; a second such wait does not fit.
    let mut a = raw_from([127, 0, 0, 1], addr).await.unwrap();
    a.write_all(&enc(Request::Wait { keys: big("a") }))
        .await
        .unwrap();
    wait_until_async("the first wait to park", || store.pending_waits().0 >= 1).await;
    let mut b = raw_from([127, 0, 0, 1], addr).await.unwrap();
    b.write_all(&enc(Request::Wait { keys: big("b") }))
        .await
        .unwrap();
    assert!(
        closed(&mut b, HANG).await,
        "a wait past the budget was parked"
    );
    // Small waits still park and are answered.
    let mut c = raw_from([127, 0, 0, 1], addr).await.unwrap();
    c.write_all(&enc(Request::Wait {
        keys: vec![b"/small".to_vec()],
    }))
    .await
    .unwrap();
    let mut setter = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
    setter.set(b"/small", b"1").await.unwrap();
    assert_eq!(
        c.read_u8().await.unwrap(),
        nrun_store::protocol::STOP_WAITING
    );
    // The first wait ends (its connection goes): its share comes back.
    drop(a);
    wait_until_async("the ended waits to give their share back", || {
        store.pending_waits() == (0, 0, 0)
    })
    .await;
    let mut d = raw_from([127, 0, 0, 1], addr).await.unwrap();
    d.write_all(&enc(Request::Wait { keys: big("d") }))
        .await
        .unwrap();
    wait_until_async("a wait to park in the budget given back", || {
        store.pending_waits().0 >= 1
    })
    .await;
}
