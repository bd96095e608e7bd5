//! The sweep's sizes as they are measured: rank 0 publishes each size's row to nrun's store
//! (as the preflight worker does, over a client connection) and the launcher reads them from
//! the store it hosts, in order, as they come.

// The workspace's one way to serve a store in a test (tests/common/store.rs).
#[path = "../../../tests/common/store.rs"]
mod served;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nrun_preflight::{Mode, Row, Settings, SizeReader};
use nrun_store::Store;
use nrun_store::client::Client;

async fn start() -> (SocketAddr, Arc<Store>) {
    let store = Store::new();
    (served::serve_store(store.clone()).await, store)
}

fn settings() -> Settings {
    Settings {
        id: "run1/pf".into(),
        mode: Mode::Net,
        min_bytes: 8,
        max_bytes: 1 << 20,
        factor: 4,
        iters: 1,
        warmup: 0,
        timeout_ms: 1000,
        nccl_lib: None,
        listen_addr: "127.0.0.1".into(),
        links: false,
        host: None,
    }
}

fn row(bytes: u64, us: f64) -> Row {
    Row {
        bytes,
        oop_us: us,
        oop_wrong: 0,
        ip_us: us,
        ip_wrong: 0,
    }
}

#[tokio::test]
async fn sizes_published_by_rank_0_are_read_in_order_as_they_come() {
    let (addr, store) = start().await;
    let s = settings();
    let mut rank0 = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
    let publish = |i: usize, r: &Row| (s.size_key(i), serde_json::to_vec(r).unwrap());
    // A set has no reply: a read on the same connection after it means the store applied it.
    async fn applied(c: &mut Client, k: &[u8]) {
        assert!(c.check(&[k]).await.unwrap());
    }
    let mut reader = SizeReader::default();
    let mut get = |k: &[u8]| store.get(k);
    assert!(reader.read(&s, &mut get).is_empty(), "nothing measured yet");

    let (k, v) = publish(0, &row(8, 10.0));
    rank0.set(&k, &v).await.unwrap();
    applied(&mut rank0, &k).await;
    // Size 2 before size 1 (never so from one rank, but a reader must not skip a size).
    let (k, v) = publish(2, &row(128, 30.0));
    rank0.set(&k, &v).await.unwrap();
    applied(&mut rank0, &k).await;
    let first = reader.read(&s, &mut |k| store.get(k));
    assert_eq!(first.iter().map(|r| r.bytes).collect::<Vec<_>>(), [8]);
    assert_eq!(reader.count(), 1);

    let (k, v) = publish(1, &row(32, 20.0));
    rank0.set(&k, &v).await.unwrap();
    applied(&mut rank0, &k).await;
    let next = reader.read(&s, &mut |k| store.get(k));
    assert_eq!(next.iter().map(|r| r.bytes).collect::<Vec<_>>(), [32, 128]);
    assert_eq!(reader.count(), 3);
    assert!(reader.read(&s, &mut |k| store.get(k)).is_empty());

    // The keys live in the preflight run's key space, beside its reports.
    assert_eq!(s.size_key(1), b"nrun/pf/run1/pf/size/1");
    // 1 MiB in 100 us on 4 ranks: algbw 10.49 GB/s, busbw 3/4 of twice that.
    assert_eq!(
        row(1 << 20, 100.0).line(4),
        "1 MiB: busbw 15.73 GB/s, 0 wrong (rank 0)"
    );
    assert_eq!(
        row(1 << 20, 100.0).line(1),
        "1 MiB: algbw 10.49 GB/s, 0 wrong (rank 0)"
    );
}
