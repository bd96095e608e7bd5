//! Load generator for TCPStore servers (nrun's and PyTorch's), used by scripts/bench.sh.
//!
//!   storebench rtt ADDR [ITERS]          one client: SET then GET, per-iteration latency
//!   storebench burst ADDR N              N separate processes connect at one instant
//!                                        (connect, VALIDATE, PING): admission latency
//!   storebench rendezvous ADDR N         N connections: connect, VALIDATE, PING, ADD, WAIT
//!                                        until all arrived, GET; total wall time
//!
//! Prints one JSON object per run on stdout. ADDR is host:port.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nrun_store::client::Client;

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn addr(s: &str) -> SocketAddr {
    s.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| {
            eprintln!("storebench: bad address {s:?}");
            std::process::exit(2)
        })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("");
    match mode {
        "rtt" => rtt(
            addr(&args[2]),
            args.get(3).and_then(|n| n.parse().ok()).unwrap_or(20000),
        ),
        "burst" => burst(&args[2], args[3].parse().expect("N")),
        "burst-child" => burst_child(addr(&args[2])),
        "rendezvous" => {
            raise_nofile();
            rendezvous(addr(&args[2]), args[3].parse().expect("N"))
        }
        _ => {
            eprintln!("usage: storebench rtt|burst|rendezvous ADDR [N]");
            std::process::exit(2)
        }
    }
}

fn rtt(a: SocketAddr, iters: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = Client::connect(a, Duration::from_secs(10)).await.expect("connect");
        let value = vec![7u8; 64];
        for _ in 0..1000 {
            c.set(b"/rtt", &value).await.unwrap();
            c.get(b"/rtt").await.unwrap();
        }
        let mut us = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            c.set(b"/rtt", &value).await.unwrap();
            c.get(b"/rtt").await.unwrap();
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        us.sort_by(f64::total_cmp);
        println!(
            "{{\"mode\":\"rtt\",\"iters\":{iters},\"median_us\":{:.1},\"p90_us\":{:.1},\"p99_us\":{:.1}}}",
            percentile(&us, 0.5),
            percentile(&us, 0.9),
            percentile(&us, 0.99)
        );
    });
}

/// Spawns N copies of this program, waits until every one is ready, then releases them all at
/// one instant through a shared pipe that carries the start time.
fn burst(a: &str, n: usize) {
    raise_nofile();
    let (go_r, go_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
    let exe = std::env::current_exe().unwrap();
    let mut kids = Vec::with_capacity(n);
    for _ in 0..n {
        let stdin = go_r.try_clone().expect("dup");
        let child = Command::new(&exe)
            .args(["burst-child", a])
            .stdin(Stdio::from(stdin))
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn");
        kids.push(child);
    }
    drop(go_r);
    // Each child writes "r" once it is ready to go.
    let mut outs: Vec<_> = kids.iter_mut().map(|k| k.stdout.take().unwrap()).collect();
    for o in &mut outs {
        let mut b = [0u8; 1];
        o.read_exact(&mut b).expect("child ready");
    }
    let t0 = monotonic_ns();
    let mut go = std::fs::File::from(go_w);
    let msg: Vec<u8> = std::iter::repeat_n(t0.to_le_bytes(), n).flatten().collect();
    go.write_all(&msg).unwrap();
    drop(go);
    let mut ms = Vec::with_capacity(n);
    let mut failed = 0;
    for (mut o, mut k) in outs.into_iter().zip(kids) {
        let mut s = String::new();
        let _ = o.read_to_string(&mut s);
        let _ = k.wait();
        match s.trim().parse::<u64>() {
            Ok(ns) => ms.push(ns as f64 / 1e6),
            Err(_) => failed += 1,
        }
    }
    ms.sort_by(f64::total_cmp);
    println!(
        "{{\"mode\":\"burst\",\"n\":{n},\"failed\":{failed},\"median_ms\":{:.2},\"p90_ms\":{:.2},\"max_ms\":{:.2}}}",
        percentile(&ms, 0.5),
        percentile(&ms, 0.9),
        ms.last().copied().unwrap_or(f64::NAN)
    );
}

fn burst_child(a: SocketAddr) {
    let mut out = std::io::stdout();
    out.write_all(b"r").unwrap();
    out.flush().unwrap();
    // A raw read of exactly 8 bytes: std's buffered stdin would swallow the other children's
    // start times from the shared pipe.
    let mut t0 = [0u8; 8];
    if nix::unistd::read(0, &mut t0).ok() != Some(8) {
        return;
    }
    let t0 = u64::from_le_bytes(t0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut delay = Duration::from_millis(10);
    // Retry like torch's client does: refused or reset connections are retried with backoff.
    loop {
        let attempt = (|| -> std::io::Result<()> {
            let mut s = TcpStream::connect(a)?;
            s.set_nodelay(true)?;
            s.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 13, 1, 2, 3, 4])?;
            let mut pong = [0u8; 4];
            s.read_exact(&mut pong)?;
            if pong != [1, 2, 3, 4] {
                return Err(std::io::Error::other("bad pong"));
            }
            Ok(())
        })();
        match attempt {
            Ok(()) => break,
            Err(_) if Instant::now() < deadline => {
                std::thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(_) => return,
        }
    }
    println!("{}", monotonic_ns() - t0);
}

fn rendezvous(a: SocketAddr, n: usize) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let tag = format!("/rdzv{}", std::process::id());
    rt.block_on(async move {
        let t0 = Instant::now();
        let mut tasks = Vec::with_capacity(n);
        for _ in 0..n {
            let tag = tag.clone();
            tasks.push(tokio::spawn(async move {
                let mut c = Client::connect(a, Duration::from_secs(300)).await?;
                let connected = t0.elapsed().as_secs_f64();
                let arrived = format!("{tag}/arrived");
                let done = format!("{tag}/done");
                if c.add(arrived.as_bytes(), 1).await? == n as i64 {
                    c.set(done.as_bytes(), b"all here").await?;
                }
                c.wait(&[done.as_bytes()], None).await?;
                let v = c.get(done.as_bytes()).await?;
                Ok::<_, std::io::Error>((v == b"all here", connected, c))
            }));
        }
        let mut ok = 0;
        let mut errors = 0;
        let mut first_error = String::new();
        let mut keep = Vec::with_capacity(n);
        let mut connect_s = Vec::with_capacity(n);
        for t in tasks {
            match t.await {
                Ok(Ok((true, connected, c))) => {
                    ok += 1;
                    connect_s.push(connected);
                    keep.push(c);
                }
                Ok(Err(e)) => {
                    errors += 1;
                    if first_error.is_empty() {
                        first_error = e.to_string();
                    }
                }
                _ => errors += 1,
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        connect_s.sort_by(f64::total_cmp);
        println!(
            "{{\"mode\":\"rendezvous\",\"n\":{n},\"ok\":{ok},\"errors\":{errors},\"secs\":{secs:.3},\"connected_p50_s\":{:.3},\"connected_max_s\":{:.3},\"first_error\":{:?}}}",
            percentile(&connect_s, 0.5),
            connect_s.last().copied().unwrap_or(f64::NAN),
            first_error
        );
        drop(keep);
    });
}
