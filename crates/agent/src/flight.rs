//! PyTorch's flight recorder, read from outside the workers: each NCCL process group keeps a
//! ring of its last collectives (sequence number, op, sizes, state, with
//! `TORCH_NCCL_ENABLE_TIMING` each one's duration), and dumps it to a file when a byte is
//! written to its dump pipe (`TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>.pipe`, polled by torch's
//! heartbeat monitor about once a second). nrun turns it on with a small ring ([`BUFFER`]
//! entries; measured on an H200: no step-time cost within 0.1%), asks for a dump when a node's
//! ranks stall (see [`PERIOD`] for why not while they run) and reads each rank's last
//! enqueued and last completed collective. The dump is a Python pickle: the worker's own
//! interpreter turns it into JSON ([`HELPER`]), so no pickle reader lives here.
//!
//! A variable the user set wins (their ring size, pipe or dump file; nrun then reads no dump:
//! it reads them only from its own private scratch directory, see [`nrun_base::files`]); the
//! recorder exists for NCCL groups only, so gloo jobs get no pipe and nothing is read.
//!
//! Unpickling a dump runs whatever the pickle says, so a dump is read only if it is a regular
//! file (not a symlink) of this user, writable by nobody else, in a directory only this user
//! can write (mode 0700, made fresh): no other user can have put it there. Its bytes reach the
//! helper on stdin; the helper opens no path.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde::Deserialize;

use nrun_proto::protocol::{FrOp, FrRun, FrView};

/// Entries in each process group's ring: enough to see the last few steps' collectives.
pub(crate) const BUFFER: &str = "64";
/// Time between two dumps asked while the job runs: none by default. Torch symbolizes every
/// entry's Python stack while it writes a pipe dump (it ignores `TORCH_INCLUDE_STACK_TRACE`
/// there), taking the workers' GIL for seconds: one dump on an H100 held 10 ms steps at 2-8x
/// for about 5 s (BENCHMARKS.md section 30). `NRUN_WATCH_FR_PERIOD` asks for them.
pub const PERIOD: Option<Duration> = None;

/// One rank's pipe and dump file.
#[derive(Clone, Debug)]
pub struct FrFiles {
    pub pipe: PathBuf,
    pub dump: PathBuf,
}

/// The variables that turn the recorder on for global rank `rank` (each only where neither the
/// worker's environment `env` nor nrun's own sets it), with the files they name, under `dir`.
pub fn setup(
    env: &[(String, String)],
    rank: usize,
    dir: &Path,
) -> (Vec<(String, String)>, FrFiles) {
    let given = |k: &str| crate::worker_var(env, k);
    let mut add = Vec::new();
    // torch renamed some of these (TORCH_NCCL_* to TORCH_FR_*) and warns in every worker's
    // stderr when it finds an old name set, so nrun sets the name torch 2.11 reads without a
    // warning; the user's value under either name wins. (An older torch that knows only the
    // old names keeps its own ring and dumps to its default file, which nrun never reads.)
    let pick =
        |names: &[&str], set: &[&str], ours: String, add: &mut Vec<(String, String)>| match names
            .iter()
            .find_map(|n| given(n))
        {
            Some(v) => v,
            None => {
                for n in set {
                    add.push((n.to_string(), ours.clone()));
                }
                ours
            }
        };
    let stem = |name: &str| dir.join(name).to_string_lossy().into_owned();
    const BUF: [&str; 2] = ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"];
    pick(&BUF, &BUF[..1], BUFFER.into(), &mut add);
    const PIPE: [&str; 2] = [
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
        "TORCH_FR_DEBUG_INFO_PIPE_FILE",
    ];
    let pipe = pick(&PIPE, &PIPE, stem("fr-pipe-"), &mut add);
    const DUMP: [&str; 2] = ["TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"];
    let ours = stem("fr-dump-");
    let dump = pick(&DUMP, &DUMP[..1], ours.clone(), &mut add);
    // The stack traces in a dump: nrun reads none, and torch symbolizes them while the dump is
    // written (BENCHMARKS.md, "The watch's cost"). Left to the user where the dumps are theirs.
    if dump == ours && given("TORCH_INCLUDE_STACK_TRACE").is_none() {
        add.push(("TORCH_INCLUDE_STACK_TRACE".into(), "0".into()));
    }
    // Each collective's duration on the GPU: the straggler statistics of NCCL jobs, whose ranks
    // all wait at the same GPU sync. Measured on an H200: +0.07% of step time.
    if given("TORCH_NCCL_ENABLE_TIMING").is_none() {
        add.push(("TORCH_NCCL_ENABLE_TIMING".into(), "1".into()));
    }
    let files = FrFiles {
        pipe: PathBuf::from(format!("{pipe}{rank}.pipe")),
        dump: PathBuf::from(format!("{dump}{rank}")),
    };
    (add, files)
}

/// Asks for a dump: one byte down the pipe. A pipe nobody reads (not an NCCL job, torch not yet
/// there) refuses at once (ENXIO) rather than block; anything but a FIFO (never through a
/// symlink) gets nothing.
pub fn ask(f: &FrFiles) -> bool {
    use std::io::Write;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&f.pipe)
        .and_then(|mut p| match p.metadata()?.file_type().is_fifo() {
            true => p.write_all(b"1"),
            false => Err(std::io::ErrorKind::InvalidInput.into()),
        })
        .is_ok()
}

/// The dump and when it was written, if one newer than `since` is in the file nrun named
/// (never a symlink).
pub(crate) fn dumped_since(f: &FrFiles, since: SystemTime) -> Option<(PathBuf, SystemTime)> {
    std::fs::symlink_metadata(&f.dump)
        .ok()
        .filter(|m| m.is_file())
        .and_then(|m| m.modified().ok())
        .filter(|t| *t >= since)
        .map(|t| (f.dump.clone(), t))
}

/// Largest dump read: a ring of [`BUFFER`] entries per group is a few hundred KiB.
const MAX_DUMP_BYTES: u64 = 64 << 20;

/// Turns each pickled dump into one JSON line with the fields read here.
const HELPER: &str = r#"
import json, pickle, struct, sys
keys = ("record_id", "collective_seq_id", "profiling_name", "state", "input_sizes",
        "input_dtypes", "duration_ms", "time_created_ns", "is_p2p", "retired")
data = sys.stdin.buffer.read()
at = 0
while at + 8 <= len(data):
    (n,) = struct.unpack_from("<Q", data, at)
    blob = data[at + 8 : at + 8 + n]
    at += 8 + n
    try:
        d = pickle.loads(blob)
        out = []
        for e in d.get("entries", []):
            x = {k: e.get(k) for k in keys}
            pg = e.get("process_group") or ("", "")
            x["pg"] = str(pg[0])
            out.append(x)
        print(json.dumps({"entries": out}, default=str))
    except Exception as e:
        print(json.dumps({"error": repr(e)}))
"#;

#[derive(Deserialize, Default)]
struct Dump {
    #[serde(default)]
    entries: Vec<Entry>,
    error: Option<String>,
}

#[derive(Deserialize, Clone, Default)]
struct Entry {
    #[serde(default)]
    record_id: u64,
    #[serde(default)]
    collective_seq_id: u64,
    #[serde(default)]
    profiling_name: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    input_sizes: Vec<Vec<u64>>,
    #[serde(default)]
    input_dtypes: Vec<String>,
    duration_ms: Option<f64>,
    time_created_ns: Option<u64>,
    #[serde(default)]
    is_p2p: bool,
    /// Done with: torch retires an entry once the work completed (gloo's entries keep the
    /// state "scheduled").
    #[serde(default)]
    retired: bool,
    #[serde(default)]
    pg: String,
}

impl Entry {
    fn done(&self) -> bool {
        self.state == "completed" || self.retired
    }
}

/// Reads the dumps in `files` with `python` (the workers' interpreter); one summary per file, in
/// order (None where a file could not be read, or was refused: see the module's doc).
pub fn read(python: &Path, files: &[&Path]) -> Vec<Option<FrView>> {
    // Each dump length-prefixed on the helper's stdin (an empty one where it was refused).
    let mut input = Vec::new();
    for f in files {
        let bytes = match nrun_base::files::read_own(f, MAX_DUMP_BYTES) {
            Ok(b) => b,
            Err(nrun_base::files::ReadError::Missing) => Vec::new(),
            Err(e) => {
                // Once: a dump refused (a worker's umask of 002, say) is refused at every ask.
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    tracing::warn!(
                        "refusing the flight recorder's dump {}: {e}; dumps that are not this \
                         user's alone are not read (the watch goes on without them)",
                        f.display()
                    )
                });
                Vec::new()
            }
        };
        input.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        input.extend_from_slice(&bytes);
    }
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(HELPER)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            // Written from a thread: the helper's output may fill its pipe before it has read
            // all of its input.
            let mut stdin = c.stdin.take();
            let feed = std::thread::spawn(move || {
                if let Some(i) = stdin.as_mut() {
                    let _ = i.write_all(&input);
                }
            });
            let out = c.wait_with_output();
            let _ = feed.join();
            out
        });
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let lines: Vec<String> = text
        .map(|t| t.lines().map(str::to_string).collect())
        .unwrap_or_default();
    (0..files.len())
        .map(|i| {
            let d: Dump = serde_json::from_str(lines.get(i)?).ok()?;
            match d.error {
                Some(_) => None,
                None => summarize(&d.entries),
            }
        })
        .collect()
}

/// Bytes per element of a torch dtype as the recorder names it ("Float", "BFloat16", ...).
fn dtype_bytes(t: &str) -> u64 {
    match t {
        "Double" | "Long" | "ComplexFloat" => 8,
        "Float" | "Int" => 4,
        "Half" | "BFloat16" | "Short" => 2,
        "ComplexDouble" => 16,
        _ => 1,
    }
}

fn op_of(e: &Entry) -> FrOp {
    let bytes = e
        .input_sizes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n: u64 = shape.iter().product();
            n * e.input_dtypes.get(i).map_or(1, |t| dtype_bytes(t))
        })
        .sum();
    FrOp {
        seq: e.collective_seq_id,
        // "nccl:all_reduce" -> "all_reduce"
        op: e
            .profiling_name
            .rsplit_once(':')
            .map_or(e.profiling_name.as_str(), |(_, o)| o)
            .to_string(),
        bytes,
        pg: e.pg.clone(),
        state: match e.done() {
            true => "completed".into(),
            false => e.state.clone(),
        },
    }
}

/// A rank's last enqueued and last completed collective (of the group of its last one), and
/// how long its collectives took on the GPU over the span the ring covers.
fn summarize(entries: &[Entry]) -> Option<FrView> {
    let coll: Vec<&Entry> = entries.iter().filter(|e| !e.is_p2p).collect();
    let last = coll.iter().max_by_key(|e| e.record_id)?;
    let group: Vec<&&Entry> = coll.iter().filter(|e| e.pg == last.pg).collect();
    let completed = group
        .iter()
        .filter(|e| e.done())
        .max_by_key(|e| e.collective_seq_id);
    // The straggler statistics: time in collectives over the time the ring covers, from the
    // completed entries with a duration.
    let timed: Vec<&&&Entry> = group
        .iter()
        .filter(|e| e.done() && e.duration_ms.is_some())
        .collect();
    let created: Vec<u64> = timed.iter().filter_map(|e| e.time_created_ns).collect();
    let (waited_ms, span_ms) = match (created.iter().min(), created.iter().max()) {
        (Some(a), Some(b)) if b > a && timed.len() >= 3 => {
            // The first entry's own time is outside the span that starts at its creation.
            let first = timed.iter().min_by_key(|e| e.time_created_ns)?;
            let sum: f64 = timed.iter().filter_map(|e| e.duration_ms).sum();
            (
                Some(sum - first.duration_ms.unwrap_or(0.0)),
                Some((b - a) as f64 / 1e6),
            )
        }
        _ => (None, None),
    };
    Some(FrView {
        last: op_of(last),
        completed: completed.map(|e| op_of(e)),
        waited_ms,
        span_ms,
        runs: runs(&group),
    })
}

/// Runs kept per rank: a training step's collectives repeat, so a few runs cover the ring.
const RUNS: usize = 16;

/// The group's collectives by sequence number, folded into runs of the same op and size (the
/// most recent [`RUNS`] of them).
fn runs(group: &[&&Entry]) -> Vec<FrRun> {
    let mut ops: Vec<FrOp> = group.iter().map(|e| op_of(e)).collect();
    ops.sort_by_key(|o| o.seq);
    ops.dedup_by_key(|o| o.seq);
    let mut runs: Vec<FrRun> = Vec::new();
    for o in ops {
        match runs.last_mut() {
            Some(r) if r.last + 1 == o.seq && r.op == o.op && r.bytes == o.bytes => r.last = o.seq,
            _ => runs.push(FrRun {
                first: o.seq,
                last: o.seq,
                op: o.op,
                bytes: o.bytes,
            }),
        }
    }
    let skip = runs.len().saturating_sub(RUNS);
    runs.split_off(skip)
}

/// Where the recorder stands for one rank of the watch thread.
#[derive(Default)]
pub(crate) struct FrState {
    pub files: Option<FrFiles>,
    /// When a dump was last asked for (wall clock, to compare with the file's time).
    pub asked: Option<(Instant, SystemTime)>,
    /// A dump was asked for during the current stall.
    pub asked_in_stall: bool,
    /// The dump asked for last was asked while the ranks ran (not for a stall).
    pub asked_running: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, seq: u64, state: &str, ms: f64, at_ms: u64) -> Entry {
        Entry {
            record_id: id,
            collective_seq_id: seq,
            profiling_name: "nccl:all_reduce".into(),
            state: state.into(),
            input_sizes: vec![vec![1 << 20]],
            input_dtypes: vec!["Float".into()],
            duration_ms: Some(ms),
            time_created_ns: Some(at_ms * 1_000_000),
            is_p2p: false,
            retired: false,
            pg: "0".into(),
        }
    }

    #[test]
    fn the_last_enqueued_and_completed_collectives_and_the_time_waited() {
        let e = [
            entry(0, 1, "completed", 10.0, 0),
            entry(1, 2, "completed", 30.0, 100),
            entry(2, 3, "completed", 30.0, 200),
            entry(3, 4, "scheduled", 0.0, 300),
        ];
        let v = summarize(&e).unwrap();
        assert_eq!((v.last.seq, v.last.op.as_str()), (4, "all_reduce"));
        assert_eq!(v.last.bytes, 4 << 20);
        assert_eq!(v.completed.as_ref().map(|c| c.seq), Some(3));
        assert_eq!(v.waited_ms, Some(60.0));
        assert_eq!(v.span_ms, Some(200.0));
        assert!(summarize(&[]).is_none());
    }

    #[test]
    fn the_ring_is_folded_into_runs_of_the_same_op_and_size() {
        let mut e: Vec<Entry> = (1..=8)
            .map(|i| entry(i, i, "completed", 1.0, i * 100))
            .collect();
        // #6 on: a quarter of the elements; a p2p entry between them is no collective.
        for x in e.iter_mut().skip(5) {
            x.input_sizes = vec![vec![1 << 18]];
        }
        e.push(Entry {
            is_p2p: true,
            ..entry(9, 0, "completed", 1.0, 900)
        });
        let runs = summarize(&e).unwrap().runs;
        let got: Vec<(u64, u64, &str, u64)> = runs
            .iter()
            .map(|r| (r.first, r.last, r.op.as_str(), r.bytes))
            .collect();
        assert_eq!(
            got,
            vec![(1, 5, "all_reduce", 4 << 20), (6, 8, "all_reduce", 1 << 20)]
        );
        // Alternating sizes keep the most recent runs only.
        let e: Vec<Entry> = (1..=40)
            .map(|i| Entry {
                input_sizes: vec![vec![1 + i % 2]],
                ..entry(i, i, "completed", 1.0, i)
            })
            .collect();
        let runs = summarize(&e).unwrap().runs;
        assert_eq!((runs.len(), runs[0].first, runs[15].last), (RUNS, 25, 40));
    }

    /// A dump is read only from a regular file of this user's that nobody else may write, not
    /// through a symlink: anything else could have been planted, and unpickling runs code.
    #[test]
    fn only_a_dump_of_this_users_own_is_read() {
        use std::os::unix::fs::PermissionsExt;
        let Some(py) = std::env::var_os("NRUN_TEST_PYTHON") else {
            eprintln!("SKIPPED: NRUN_TEST_PYTHON unset");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("dump0");
        let write = "import pickle, sys; e = {'record_id': 0, 'collective_seq_id': 1, \
            'profiling_name': 'nccl:all_reduce', 'state': 'completed', 'input_sizes': [[4]], \
            'input_dtypes': ['Float'], 'process_group': ('0', 'x'), 'is_p2p': False, \
            'retired': True, 'duration_ms': 1.0, 'time_created_ns': 0}; \
            open(sys.argv[1], 'wb').write(pickle.dumps({'entries': [e]}))";
        let ok = std::process::Command::new(&py)
            .args(["-c", write])
            .arg(&good)
            .status()
            .unwrap();
        assert!(ok.success());
        std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = dir.path().join("link0");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        let open = dir.path().join("open0");
        std::fs::copy(&good, &open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        let v = read(Path::new(&py), &[&good, &link, &open, &good]);
        let seq = |i: usize| v[i].as_ref().map(|f| (f.last.seq, f.last.bytes));
        assert_eq!(
            (seq(0), seq(1), seq(2), seq(3)),
            (Some((1, 16)), None, None, Some((1, 16)))
        );
    }

    /// A real dump: torch's own recorder of a one-rank gloo group, read by the helper.
    #[test]
    fn a_real_dump_is_read() {
        let Some(py) = std::env::var_os("NRUN_TEST_PYTHON") else {
            eprintln!("SKIPPED: NRUN_TEST_PYTHON unset");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let dump = dir.path().join("dump0");
        let script = r#"
import sys, torch, torch.distributed as dist
import torch._C._distributed_c10d as c
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
t = torch.ones(1024)
for _ in range(5):
    dist.all_reduce(t)
open(sys.argv[1], "wb").write(c._dump_fr_trace())
for _ in range(2):
    dist.all_reduce(torch.ones(256))
open(sys.argv[1] + "b", "wb").write(c._dump_fr_trace())
dist.destroy_process_group()
"#;
        let ok = std::process::Command::new(&py)
            .args(["-c", script])
            .arg(&dump)
            .env("TORCH_FR_BUFFER_SIZE", "64")
            .status()
            .unwrap();
        assert!(ok.success());
        let v = read(Path::new(&py), &[dump.as_path(), Path::new("/nonexistent")]);
        assert_eq!(v.len(), 2);
        let fr = v[0].clone().expect("the dump read");
        assert_eq!(
            (fr.last.seq, fr.last.op.as_str(), fr.last.bytes),
            (5, "all_reduce", 4096)
        );
        // torch retires an entry from the work's completion callback, which may come just
        // after all_reduce returned: the last one may still be "scheduled" in the dump.
        let done = fr.completed.map(|c| c.seq);
        assert!(matches!(done, Some(4 | 5)), "{done:?}");
        assert!(v[1].is_none());
        // The sizes in order, as the coordinator compares them across ranks.
        let later = dir.path().join("dump0b");
        let fr = read(Path::new(&py), &[later.as_path()])[0].clone().unwrap();
        let runs: Vec<(u64, u64, u64)> =
            fr.runs.iter().map(|r| (r.first, r.last, r.bytes)).collect();
        assert_eq!(runs, vec![(1, 5, 4096), (6, 7, 1024)], "{:?}", fr.runs);
    }

    #[test]
    fn the_users_own_settings_win() {
        let dir = Path::new("/scratch/w0");
        let (add, f) = setup(&[], 3, dir);
        assert!(add.contains(&("TORCH_FR_BUFFER_SIZE".into(), BUFFER.into())));
        // Never a name torch warns about.
        assert!(
            !add.iter().any(|(k, _)| k == "TORCH_NCCL_TRACE_BUFFER_SIZE"
                || k == "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        );
        assert_eq!(f.pipe, Path::new("/scratch/w0/fr-pipe-3.pipe"));
        assert_eq!(f.dump, Path::new("/scratch/w0/fr-dump-3"));
        // Nrun's own dumps are written without the stack traces it never reads.
        assert!(add.contains(&("TORCH_INCLUDE_STACK_TRACE".into(), "0".into())));
        let env = [
            ("TORCH_FR_BUFFER_SIZE".to_string(), "0".to_string()),
            (
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE".to_string(),
                "/x/t_".to_string(),
            ),
        ];
        let (add, f) = setup(&env, 3, dir);
        assert!(
            !add.iter().any(|(k, _)| k.contains("BUFFER_SIZE")),
            "{add:?}"
        );
        assert_eq!(f.dump, Path::new("/x/t_3"));
        // The user's dumps keep what torch puts in them.
        assert!(
            !add.iter().any(|(k, _)| k == "TORCH_INCLUDE_STACK_TRACE"),
            "{add:?}"
        );
    }
}
