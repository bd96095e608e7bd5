//! A joining c10d node against a store that is not its run's (issue 19, item 4): a fake store
//! at the endpoint that accepts any proof, or a store that knows the secret but serves a step
//! sealed for an earlier run. Both layers hold on their own: the node refuses a store that
//! cannot prove the secret, and a step whose seal does not cover this join's nonce. The
//! "fake" is nrun's own store on loopback, driven by the test as a coordinator would.
//! The same harness shows what a joined node publishes back (issue 35, item 6): its step's
//! result, stderr tail included, is sealed in the store, not plain text.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::store::serve_store;
use common::*;
use nrun_store::Store;

const SHARED: &str = "a-shared-secret-of-this-cluster";
/// The run whose keys the captured step was written under.
const OLD_RUN: &str = "j-replay-4242";

/// A store on a free port of this host; its address.
/// A step running one worker that writes its environment to `marker`, as a coordinator
/// writes it.
fn run_step(marker: &std::path::Path) -> Vec<u8> {
    serde_json::json!({"Run": {
        "workers": [{
            "rank": 0, "local_rank": 0, "program": "sh",
            "args": ["-c", format!("env > {}; echo ran-the-step", marker.display())],
            "env": [], "error_file": marker.with_extension("error.json"),
            "prefix": "", "colour": 0, "console": [true, true],
        }],
        "grace_ms": 1000, "deadline_ms": null,
    }})
    .to_string()
    .into_bytes()
}

fn step_key(no: usize) -> Vec<u8> {
    format!("nrun/{OLD_RUN}/n1/step/{no}").into_bytes()
}

/// A store as a rendezvous host leaves it for rendezvous `id`: its run's name published (the
/// first node to join is node 1, the host being node 0).
fn host_keys(store: &Store, id: &str) {
    store.set(format!("nrun/c10d/{id}/run").as_bytes(), OLD_RUN.as_bytes());
    // What any nrun hosting rendezvous `id` shows anyone (an impostor can show it too).
    store.set(format!("nrun/public/c10d/{id}").as_bytes(), b"1");
    store.set(b"nrun/public/store", b"an nrun");
}

/// The same nrun command a second node of rendezvous `id` at `at` runs, with the shared secret.
fn join(s: &Scene, at: SocketAddr, id: &str) -> tokio::process::Child {
    join_with(s, at, id, Some(SHARED))
}

fn join_with(s: &Scene, at: SocketAddr, id: &str, shared: Option<&str>) -> tokio::process::Child {
    let marker = s.dir.path().join("ran");
    let mut cmd = tokio::process::Command::new(nrun_bin());
    if let Some(v) = shared {
        cmd.env("NRUN_RDZV_SECRET", v);
    } else {
        cmd.env_remove("NRUN_RDZV_SECRET");
    }
    cmd.args([
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &at.to_string(),
        "--rdzv-id",
        id,
        "--join-timeout",
        "10",
        "--no-python-probe",
        "--no-python",
        "sh",
        "-c",
        &format!("touch {}", marker.display()),
    ])
    .env("NRUN_TEST_TAG", &s.tag)
    .current_dir(s.dir.path())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .kill_on_drop(true)
    .spawn()
    .unwrap()
}

async fn finish(child: tokio::process::Child) -> (Option<i32>, String) {
    // A hang guard: the node ends on what the store tells it, in seconds.
    let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("hung: the joining node did not end within 120 s")
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), all)
}

/// A step sealed for node 1 of the old run when its agent had chosen `nonce`.
fn captured(secret: &str, marker: &std::path::Path, nonce: &[u8]) -> Vec<u8> {
    nrun_store::auth::seal(secret.as_bytes(), &step_key(0), nonce, &run_step(marker))
}

/// Layer 1: a store that accepts any proof (it has no secret: it stores whatever it is sent)
/// and one with another secret both serve a step captured from an earlier run; the joining
/// node refuses the store before it reads a step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_store_is_refused_before_any_step() {
    let id = "j-fake";
    let secret = nrun_store::auth::derive(SHARED.as_bytes(), id);
    for store in [Store::new(), Store::with_secret(b"another-run".to_vec())] {
        let s = Scene::new();
        let marker = s.dir.path().join("ran-the-captured-step");
        host_keys(&store, id);
        store.set(&step_key(0), &captured(&secret, &marker, b"an-old-nonce"));
        let at = serve_store(store).await;
        let (code, all) = finish(join(&s, at, id)).await;
        assert_ne!(code, Some(0), "{all}");
        assert!(
            all.contains(&format!(
                "the store at {}:{} does not know this run's secret (NRUN_RDZV_SECRET differs, or the nodes run different nrun versions",
                at.ip(),
                at.port()
            )),
            "{all}"
        );
        assert!(!marker.exists(), "the captured step ran: {all}");
        assert!(!s.dir.path().join("ran").exists());
        s.assert_no_survivors();
    }
}

/// Layer 2: a store that does prove the secret (a relay to the real one, or a host whose
/// store was read) serves a step sealed for this node in an earlier run: the node refuses it,
/// and a step bound to no join is refused too when it starts workers. A step sealed for this
/// join's own nonce (read from its Joined record, as the coordinator does) runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_sealed_for_an_earlier_join_is_refused() {
    let id = "j-replayed";
    let secret = nrun_store::auth::derive(SHARED.as_bytes(), id);
    for old_nonce in [&b"an-old-nonce"[..], b""] {
        let s = Scene::new();
        let marker = s.dir.path().join("ran-the-captured-step");
        let store = Store::with_secret(secret.clone().into_bytes());
        host_keys(&store, id);
        store.set(&step_key(0), &captured(&secret, &marker, old_nonce));
        let at = serve_store(store).await;
        let (code, all) = finish(join(&s, at, id)).await;
        assert_ne!(code, Some(0), "{all}");
        assert!(
            all.contains("step 0 in the launch host's store is not sealed")
                && all.contains("for this node's join")
                && all.contains("refusing it"),
            "{all}"
        );
        assert!(!marker.exists(), "the captured step ran: {all}");
        s.assert_no_survivors();
    }

    // The same step sealed for the nonce this join published runs: what was refused above was
    // the nonce, not the step.
    let s = Scene::new();
    let marker = s.dir.path().join("ran-the-live-step");
    let store = Store::with_secret(secret.clone().into_bytes());
    host_keys(&store, id);
    let at = serve_store(store.clone()).await;
    let child = join(&s, at, id);
    let joined = format!("nrun/{OLD_RUN}/n1/joined").into_bytes();
    wait_until_async("the node's Joined record", || store.get(&joined).is_some()).await;
    let record: serde_json::Value =
        serde_json::from_slice(&store.get(&joined).expect("no Joined record")).unwrap();
    let nonce = record["nonce"].as_str().unwrap().to_string();
    assert_eq!(nonce.len(), 32, "128 random bits, hex");
    store.set(&step_key(0), &captured(&secret, &marker, nonce.as_bytes()));
    let result = format!("nrun/{OLD_RUN}/n1/result/0").into_bytes();
    wait_until_async("the live step's result", || store.get(&result).is_some()).await;
    store.set(format!("nrun/{OLD_RUN}/exit").as_bytes(), b"0");
    let end = nrun_store::auth::seal(
        secret.as_bytes(),
        &step_key(1),
        nonce.as_bytes(),
        b"\"End\"",
    );
    store.set(&step_key(1), &end);
    let (code, all) = finish(child).await;
    assert_eq!(code, Some(0), "{all}");
    assert!(marker.exists(), "the live step did not run: {all}");
    // Its worker did not inherit the shared secret from the joining nrun's environment.
    let env = std::fs::read_to_string(&marker).unwrap();
    assert!(env.contains("NRUN_TEST_TAG="), "{env}");
    assert!(
        !env.contains("NRUN_RDZV_SECRET") && !env.contains(SHARED),
        "{env}"
    );
    s.assert_no_survivors();
}

/// The shared secret never reaches a worker: not inherited from nrun's environment, not even
/// when forwarded by name with -x; other variables are forwarded as asked.
#[test]
fn workers_never_see_the_shared_secret() {
    let s = Scene::new();
    let out = s.run(
        &[
            "--nproc",
            "2",
            "-x",
            "NRUN_RDZV_SECRET",
            "-x",
            "HF_TOKEN=hf_forwarded_token",
            "--no-python",
            "sh",
            "-c",
            "env; echo printed env of rank $RANK",
        ],
        &[("NRUN_RDZV_SECRET", SHARED)],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("printed env of rank {r}")),
            "{stdout}"
        );
    }
    assert_eq!(
        stdout.matches("HF_TOKEN=hf_forwarded_token").count(),
        2,
        "{stdout}"
    );
    assert!(!stdout.contains("NRUN_RDZV_SECRET"), "{stdout}");
    assert!(!stdout.contains(SHARED), "{stdout}");
    s.assert_no_survivors();
}

/// A node without the shared secret joining a host that has one is told why it was turned
/// away, not just that the connection ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_secret_is_told_why() {
    let id = "j-nosecret";
    let secret = nrun_store::auth::derive(SHARED.as_bytes(), id);
    let store = Store::with_secret(secret.into_bytes());
    host_keys(&store, id);
    let at = serve_store(store).await;
    let s = Scene::new();
    let (code, all) = finish(join_with(&s, at, id, None)).await;
    assert_ne!(code, Some(0), "{all}");
    assert!(
        all.contains("the hosting nrun has NRUN_RDZV_SECRET and this node has none?"),
        "{all}"
    );
    assert!(!s.dir.path().join("ran").exists());
}

/// A c10d node's result of a step whose worker fails with words on stderr: in the store it is
/// sealed (neither the words nor the JSON around them readable), and it opens with the run's
/// secret to the result the agent published, the words in its stderr tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_c10d_step_result_is_sealed_in_the_store() {
    let id = "j-sealed-result";
    let secret = nrun_store::auth::derive(SHARED.as_bytes(), id);
    let s = Scene::new();
    let words = format!("Traceback-of-{}", s.tag);
    let store = Store::with_secret(secret.clone().into_bytes());
    host_keys(&store, id);
    let at = serve_store(store.clone()).await;
    let child = join(&s, at, id);
    let joined = format!("nrun/{OLD_RUN}/n1/joined").into_bytes();
    wait_until_async("the node's Joined record", || store.get(&joined).is_some()).await;
    let record: serde_json::Value = serde_json::from_slice(&store.get(&joined).unwrap()).unwrap();
    let nonce = record["nonce"].as_str().unwrap().to_string();
    let step = serde_json::json!({"Run": {
        "workers": [{
            "rank": 0, "local_rank": 0, "program": "sh",
            "args": ["-c", format!("echo {words} >&2; exit 3")],
            "env": [], "error_file": s.dir.path().join("error.json"),
            "prefix": "", "colour": 0, "console": [true, true],
        }],
        "grace_ms": 1000, "deadline_ms": null,
    }})
    .to_string();
    let sealed = nrun_store::auth::seal(
        secret.as_bytes(),
        &step_key(0),
        nonce.as_bytes(),
        step.as_bytes(),
    );
    store.set(&step_key(0), &sealed);
    let key = format!("nrun/{OLD_RUN}/n1/result/0").into_bytes();
    wait_until_async("the step's result", || store.get(&key).is_some()).await;
    let raw = store.get(&key).unwrap();
    store.set(format!("nrun/{OLD_RUN}/exit").as_bytes(), b"3");
    let end = nrun_store::auth::seal(
        secret.as_bytes(),
        &step_key(1),
        nonce.as_bytes(),
        b"\"End\"",
    );
    store.set(&step_key(1), &end);
    let (_, all) = finish(child).await;
    let has = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
    assert!(
        !has(&raw, words.as_bytes()) && !has(&raw, b"stderr_tail") && !has(&raw, b"Run"),
        "the result is plain text in the store: {}",
        String::from_utf8_lossy(&raw)
    );
    let opened = nrun_store::auth::open(secret.as_bytes(), &key, b"", &raw)
        .expect("the result does not open with the run's secret");
    let opened = String::from_utf8_lossy(&opened);
    assert!(opened.contains(&words), "{opened}\n{all}");
    s.assert_no_survivors();
}
