//! Each rank's time in collectives on its GPU, counted by nrun's NCCL profiler plugin
//! (`nccl/profiler.c`, built into this binary): the straggler statistics of NCCL jobs, whose
//! ranks all wait at the same GPU sync, so that their stacks cannot tell a slow GPU from its
//! peers. A rank that waits for a slow peer spends the wait inside the collective's kernel; the
//! slow rank reaches the collective last and hardly waits.
//!
//! The flight recorder knows the same, but only in a dump, and a dump costs the running ranks
//! seconds (BENCHMARKS.md section 30); the plugin costs them nothing measurable (section 33):
//! NCCL calls it on the rank's own threads, it adds each collective's kernel time to a counter
//! in a file mapped shared, and the watch reads that file (1 KiB) once a sample, never the
//! worker's memory.
//!
//! A plugin the user named (`NCCL_PROFILER_PLUGIN`) wins: nrun then installs none and names a
//! GPU straggler only from flight-recorder dumps, if asked for (`NRUN_WATCH_FR_PERIOD`).

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nrun_proto::protocol::GpuWait;

/// The plugin, as built by build.rs.
const PLUGIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libnccl-profiler-nrun.so"));
const PLUGIN_FILE: &str = "libnccl-profiler-nrun.so";

// The counters file's layout: profiler.c's header comment.
const MAGIC: u64 = 0x3146_5250_5255_4e4e;
const HEADER: usize = 64;
const SLOTS: usize = 16;
const SLOT: usize = 64;
const FILE_BYTES: usize = HEADER + SLOTS * SLOT;

/// The time a rank's wait is measured over: long enough to hold many steps, short enough that
/// a rank that turns slow is seen within it.
const WINDOW: Duration = Duration::from_secs(10);
/// The least span and collectives a window needs before it says anything.
const MIN_SPAN: Duration = Duration::from_secs(5);
const MIN_COLLECTIVES: u64 = 20;

/// nrun's plugin, installed in a node's scratch directory for one step's workers.
#[derive(Debug)]
pub(crate) struct Plugin {
    path: PathBuf,
    dir: PathBuf,
}

impl Plugin {
    /// Installs the plugin under `dir` (the agent's private scratch directory), once per step:
    /// none where the workers' environment `env` (the node's: they differ only in their ranks)
    /// or NCCL's configuration names a profiler plugin, or where `dir` cannot load one.
    pub(crate) fn install(env: &[(String, String)], dir: &Path) -> Option<Plugin> {
        if crate::worker_var(env, VAR).is_some() || in_nccl_conf(env) {
            return None;
        }
        let path = dir.join(PLUGIN_FILE);
        if let Err(e) = executable_here(dir).and_then(|()| install(&path)) {
            tracing::debug!(
                "cannot set up the NCCL profiler plugin in {}: {e}; GPU stragglers are named \
                 only from flight-recorder dumps",
                dir.display()
            );
            return None;
        }
        Some(Plugin {
            path,
            dir: dir.to_path_buf(),
        })
    }

    /// The variables that load it for global rank `rank`, with that rank's fresh counters file.
    pub(crate) fn setup(&self, rank: usize) -> Option<(Vec<(String, String)>, PathBuf)> {
        let counters = self.dir.join(format!("gpu-time-{rank}"));
        if let Err(e) = counters_file(&counters) {
            tracing::debug!(
                "cannot make {}: {e}; rank {rank}'s GPU time is not read",
                counters.display()
            );
            return None;
        }
        let add = vec![
            (VAR.to_string(), self.path.to_string_lossy().into_owned()),
            (
                "NRUN_NCCL_PROFILE".to_string(),
                counters.to_string_lossy().into_owned(),
            ),
        ];
        Some((add, counters))
    }
}

const VAR: &str = "NCCL_PROFILER_PLUGIN";

/// Whether one of NCCL's configuration files (`NCCL_CONF_FILE`, else `~/.nccl.conf` and
/// `/etc/nccl.conf`) names a profiler plugin: nrun's variable would override it.
fn in_nccl_conf(env: &[(String, String)]) -> bool {
    let var = |k: &str| crate::worker_var(env, k);
    let files: Vec<PathBuf> = match var("NCCL_CONF_FILE") {
        Some(f) => vec![f.into()],
        None => var("HOME")
            .map(|h| Path::new(&h).join(".nccl.conf"))
            .into_iter()
            .chain([PathBuf::from("/etc/nccl.conf")])
            .collect(),
    };
    files.iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines()
                .any(|l| l.trim_start().starts_with("NCCL_PROFILER_PLUGIN="))
        })
    })
}

/// Err where `dir` is on a file system mounted noexec (a hardened /tmp): no library loads
/// from there, and NCCL would say why only in its INFO log.
fn executable_here(dir: &Path) -> std::io::Result<()> {
    use nix::sys::statvfs::{FsFlags, statvfs};
    match statvfs(dir) {
        Ok(s) if s.flags().contains(FsFlags::ST_NOEXEC) => Err(std::io::Error::other(
            "it is on a file system mounted noexec (set TMPDIR to a directory on another)",
        )),
        _ => Ok(()),
    }
}

/// Writes the plugin to `path` unless it is there already (one per scratch directory).
fn install(path: &Path) -> std::io::Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == PLUGIN.len() as u64) {
        return Ok(());
    }
    let part = path.with_extension("part");
    std::fs::write(&part, PLUGIN)?;
    std::fs::rename(&part, path)
}

/// A fresh counters file at `path`: the header, no slot claimed (private to this user: the
/// plugin maps only a file of its own user, never creates one).
fn counters_file(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut b = vec![0u8; FILE_BYTES];
    b[..8].copy_from_slice(&MAGIC.to_ne_bytes());
    let _ = std::fs::remove_file(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?
        .write_all(&b)
}

/// One reading of a rank's counters: of its largest communicator (the job's world; the first
/// made among equals), the collectives completed and their kernel time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Counters {
    /// The communicator's hash: readings of another communicator do not compare.
    pub comm: u64,
    pub colls: u64,
    pub kernel_ns: u64,
}

/// The plugin counts a collective's channels in 1/65536 parts of it.
const ONE_COLL: u64 = 65536;

/// The counters in `bytes` (a counters file), if the plugin has claimed a slot.
pub(crate) fn parse(bytes: &[u8]) -> Option<Counters> {
    let u64_at = |o: usize| Some(u64::from_ne_bytes(bytes.get(o..o + 8)?.try_into().ok()?));
    let i32_at = |o: usize| Some(i32::from_ne_bytes(bytes.get(o..o + 4)?.try_into().ok()?));
    if u64_at(0)? != MAGIC {
        return None;
    }
    let claimed = (i32_at(8)? as u32 as usize).min(SLOTS);
    (0..claimed)
        .map(|i| HEADER + i * SLOT)
        .filter(|&o| i32_at(o + 32).is_some_and(|ready| ready == 1))
        .filter_map(|o| {
            let nranks = i32_at(o + 12)?;
            let c = Counters {
                comm: u64_at(o)?,
                colls: u64_at(o + 16)? / ONE_COLL,
                kernel_ns: u64_at(o + 24)?,
            };
            Some((nranks, c))
        })
        .rev()
        .max_by_key(|(nranks, _)| *nranks)
        .map(|(_, c)| c)
}

/// A rank's counters file read now: twice, until two reads agree (the plugin updates it while
/// it is read; a reading torn between two updates would stay in the window for its length).
pub(crate) fn read(path: &Path) -> Option<Counters> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    let once = || {
        let mut b = vec![0u8; FILE_BYTES];
        let n = f.read_at(&mut b, 0).ok()?;
        b.truncate(n);
        Some(b)
    };
    let mut last = once()?;
    for _ in 0..3 {
        let now = once()?;
        if now == last {
            return parse(&now);
        }
        last = now;
    }
    None
}

/// A rank's readings over the last [`WINDOW`], each with the kernel time counted up to it. A
/// reading adds at most the wall time since the one before: a long collective (every rank but
/// one waiting in a barrier while it saves a checkpoint) is counted as it ends, all at once,
/// and must not make one interval a whole window's evidence.
#[derive(Debug, Default)]
pub(crate) struct Window {
    readings: VecDeque<(Instant, Counters, u64)>,
}

impl Window {
    pub(crate) fn push(&mut self, at: Instant, c: Counters) {
        let counted = match self.readings.back() {
            // Another communicator, or counters that went back (a restarted worker): anew.
            Some((_, b, _)) if b.comm != c.comm || c.colls < b.colls => {
                self.readings.clear();
                0
            }
            Some((t, b, counted)) => {
                let wall = u64::try_from(at.duration_since(*t).as_nanos()).unwrap_or(u64::MAX);
                counted + c.kernel_ns.saturating_sub(b.kernel_ns).min(wall)
            }
            None => 0,
        };
        self.readings.push_back((at, c, counted));
        while self
            .readings
            .get(1)
            .is_some_and(|(t, _, _)| at.duration_since(*t) >= WINDOW)
        {
            self.readings.pop_front();
        }
    }

    /// Its time in collectives over the window, once the window holds enough of both.
    pub(crate) fn wait(&self) -> Option<GpuWait> {
        let ((t0, a, k0), (t1, b, k1)) = (self.readings.front()?, self.readings.back()?);
        let span = t1.duration_since(*t0);
        let colls = b.colls.saturating_sub(a.colls);
        (span >= MIN_SPAN && colls >= MIN_COLLECTIVES).then(|| GpuWait {
            waited_ms: k1.saturating_sub(*k0) as f64 / 1e6,
            span_ms: span.as_secs_f64() * 1e3,
            collectives: colls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A counters file with `slots` (nranks, collectives, kernel ns, ready); slot i's
    /// communicator hash is 100 + i.
    fn file(slots: &[(i32, u64, u64, u32)]) -> Vec<u8> {
        let mut b = vec![0u8; FILE_BYTES];
        b[..8].copy_from_slice(&MAGIC.to_ne_bytes());
        b[8..12].copy_from_slice(&(slots.len() as u32).to_ne_bytes());
        for (i, &(nranks, colls, ns, ready)) in slots.iter().enumerate() {
            let o = HEADER + i * SLOT;
            b[o..o + 8].copy_from_slice(&(100 + i as u64).to_ne_bytes());
            b[o + 12..o + 16].copy_from_slice(&nranks.to_ne_bytes());
            b[o + 16..o + 24].copy_from_slice(&(colls * ONE_COLL).to_ne_bytes());
            b[o + 24..o + 32].copy_from_slice(&ns.to_ne_bytes());
            b[o + 32..o + 36].copy_from_slice(&ready.to_ne_bytes());
        }
        b
    }

    fn counters(comm: u64, colls: u64, kernel_ns: u64) -> Counters {
        Counters {
            comm,
            colls,
            kernel_ns,
        }
    }

    #[test]
    fn the_largest_communicator_is_read_and_a_slot_not_in_use_is_not() {
        let c = |comm, colls, ns| Some(counters(comm, colls, ns));
        assert_eq!(parse(&file(&[(2, 5, 50, 1), (8, 7, 70, 1)])), c(101, 7, 70));
        // Equal sizes: the first made (a job's world comes before its subgroups).
        assert_eq!(parse(&file(&[(8, 1, 10, 1), (8, 2, 20, 1)])), c(100, 1, 10));
        // Being filled in, or finalized: not read.
        assert_eq!(parse(&file(&[(8, 1, 10, 0), (2, 2, 20, 1)])), c(101, 2, 20));
        assert_eq!(parse(&file(&[])), None);
        let mut wrong = file(&[(2, 5, 50, 1)]);
        wrong[0] ^= 1;
        assert_eq!(parse(&wrong), None);
        assert_eq!(parse(&[0u8; 10]), None);
    }

    #[test]
    fn a_window_says_nothing_until_it_holds_enough_and_forgets_the_old() {
        let t = Instant::now();
        let at = |s: u64| t + Duration::from_secs(s);
        let mut w = Window::default();
        let ms = 1_000_000;
        for s in 0..5 {
            w.push(at(s), counters(1, 10 * s, 200 * ms * s));
        }
        assert!(w.wait().is_none(), "4 s is under the least span");
        w.push(at(5), counters(1, 50, 1000 * ms));
        let g = w.wait().unwrap();
        assert_eq!(
            (g.waited_ms, g.span_ms, g.collectives),
            (1000.0, 5000.0, 50)
        );
        for s in 6..=20 {
            w.push(at(s), counters(1, 10 * s, 200 * ms * s));
        }
        let g = w.wait().unwrap();
        assert_eq!(
            (g.waited_ms, g.span_ms),
            (2000.0, 10_000.0),
            "the last 10 s"
        );
        // A restarted worker's counters start from zero; another communicator is another
        // count.
        w.push(at(21), counters(1, 3, 1));
        assert!(w.wait().is_none());
        for s in 22..30 {
            w.push(at(s), counters(1, 100 * s, 200 * ms * s));
        }
        w.push(at(30), counters(2, 100_000, 0));
        assert!(w.wait().is_none());
    }

    #[test]
    fn one_long_collective_counts_no_more_than_the_time_it_was_read_in() {
        // Every rank but one waits 8 s in a barrier while that one saves a checkpoint: the
        // barrier's kernel time is counted as it ends, in one reading.
        let t = Instant::now();
        let at = |s: u64| t + Duration::from_secs(s);
        let mut w = Window::default();
        let ms = 1_000_000;
        for s in 0..=10 {
            let barrier = if s >= 5 { 8_000 * ms } else { 0 };
            w.push(at(s), counters(1, 10 * s, 100 * ms * s + barrier));
        }
        let g = w.wait().unwrap();
        // 100 ms a second, and the barrier's reading its one second: 2 s of 10, not 9.
        assert_eq!(g.waited_ms, 100.0 * 9.0 + 1000.0);
    }

    #[test]
    fn the_user_s_plugin_wins_and_ours_is_installed_once_with_fresh_counters() {
        let d = tempfile::tempdir().unwrap();
        let user = vec![("NCCL_PROFILER_PLUGIN".to_string(), "theirs".to_string())];
        assert!(Plugin::install(&user, d.path()).is_none());
        // Named in NCCL's configuration file instead.
        let conf = d.path().join("nccl.conf");
        std::fs::write(&conf, "NCCL_DEBUG=WARN\nNCCL_PROFILER_PLUGIN=theirs\n").unwrap();
        let conf_env = vec![("NCCL_CONF_FILE".to_string(), conf.display().to_string())];
        assert!(Plugin::install(&conf_env, d.path()).is_none());
        std::fs::write(&conf, "NCCL_DEBUG=WARN\n").unwrap();
        assert!(Plugin::install(&conf_env, d.path()).is_some());
        let plugin = Plugin::install(&[], d.path()).unwrap();
        let (add, counters) = plugin.setup(3).unwrap();
        assert_eq!(counters, d.path().join("gpu-time-3"));
        assert!(add.contains(&(
            "NRUN_NCCL_PROFILE".to_string(),
            counters.to_string_lossy().into_owned()
        )));
        let so = d.path().join(PLUGIN_FILE);
        assert_eq!(std::fs::read(&so).unwrap(), PLUGIN);
        assert_eq!(read(&counters), None, "no slot claimed yet");
        std::fs::write(&counters, file(&[(2, 4, 40, 1)])).unwrap();
        let want = Counters {
            comm: 100,
            colls: 4,
            kernel_ns: 40,
        };
        assert_eq!(read(&counters), Some(want));
        // Set up again (a restarted group): the counters start afresh.
        plugin.setup(3).unwrap();
        assert_eq!(read(&counters), None);
    }

    /// NCCL's side of profiler API v5, as far as the plugin uses it (nccl/profiler.c).
    #[repr(C)]
    struct Descr {
        kind: u64,
        parent: *mut std::ffi::c_void,
        rank: i32,
        /// The union: a collective's (seq u64, 4 pointers/sizes, root, datatype, nChannels at
        /// byte 56) or a kernel channel's (channel u8, GPU timer u64 at byte 8).
        u: [u64; 12],
    }
    type Init = unsafe extern "C" fn(
        *mut *mut std::ffi::c_void,
        u64,
        *mut i32,
        *const std::ffi::c_char,
        i32,
        i32,
        i32,
        *const std::ffi::c_void,
    ) -> i32;
    type Start =
        unsafe extern "C" fn(*mut std::ffi::c_void, *mut *mut std::ffi::c_void, *mut Descr) -> i32;
    type Stop = unsafe extern "C" fn(*mut std::ffi::c_void) -> i32;
    type Record = unsafe extern "C" fn(*mut std::ffi::c_void, i32, *mut u64) -> i32;
    impl Descr {
        fn new(kind: u64, parent: *mut std::ffi::c_void, rank: i32) -> Descr {
            Descr {
                kind,
                parent,
                rank,
                u: [0; 12],
            }
        }
    }

    /// v4's init takes the communicator's hash after its name; the rest is v5's (the
    /// descriptor's one-byte type reads the same from [`Descr`]'s, little-endian).
    type InitV4 = unsafe extern "C" fn(
        *mut *mut std::ffi::c_void,
        *mut i32,
        *const std::ffi::c_char,
        u64,
        i32,
        i32,
        i32,
        *const std::ffi::c_void,
    ) -> i32;
    #[repr(C)]
    struct ProfilerV4 {
        name: *const std::ffi::c_char,
        init: InitV4,
        start: Start,
        stop: Stop,
        record: Record,
        finalize: Stop,
    }
    /// An API version's event calls.
    struct Calls {
        start: Start,
        stop: Stop,
        record: Record,
        finalize: Stop,
    }
    #[repr(C)]
    struct ProfilerV5 {
        name: *const std::ffi::c_char,
        init: Init,
        start: Start,
        stop: Stop,
        record: Record,
        finalize: Stop,
    }

    /// The plugin as NCCL drives it: loaded from the file nrun installs, a communicator of 4
    /// ranks and one of 2 made, collectives of two channels each started, their kernels'
    /// channels started and stopped with GPU timer stamps, as NCCL's proxy thread does; the
    /// counters file then holds the larger communicator's collectives and kernel time. The
    /// plugin reads its file's name from the environment, as in a worker: this test runs in a
    /// process of its own ([`in_own_process`]) that has it there from the start.
    #[test]
    fn the_plugin_counts_each_collective_s_kernel_time_as_nccl_drives_it() {
        // NCCL 2.28 and later call API v5; 2.27 calls v4.
        for api in ["5", "4"] {
            let d = tempfile::tempdir().unwrap();
            let (_, counters) = Plugin::install(&[], d.path()).unwrap().setup(0).unwrap();
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "--ignored", "--nocapture"])
                .arg("gpu_time::tests::in_own_process")
                .env("NRUN_NCCL_PROFILE", &counters)
                .env("NRUN_PLUGIN_DIR", d.path())
                .env("NRUN_PLUGIN_API", api)
                .status()
                .unwrap();
            assert!(status.success(), "the plugin's run (API v{api}): {status}");
            // Each collective: its channels' mean kernel time, (40 + 42) / 2.
            let want = Counters {
                comm: 9,
                colls: IN_FLIGHT,
                kernel_ns: IN_FLIGHT * 41,
            };
            assert_eq!(read(&counters), Some(want), "API v{api}");
        }
    }

    /// Collectives enqueued before the first kernel runs: more than the plugin's ring (256).
    const IN_FLIGHT: u64 = 300;

    /// [`the_plugin_counts_each_collective_s_kernel_time_as_nccl_drives_it`]'s NCCL side.
    #[test]
    #[ignore = "run by the_plugin_counts_each_collective_s_kernel_time_as_nccl_drives_it"]
    fn in_own_process() {
        // Run alone (--include-ignored), it has nothing to do.
        let Some(dir) = std::env::var_os("NRUN_PLUGIN_DIR") else {
            return;
        };
        let so = Path::new(&dir).join(PLUGIN_FILE);
        // SAFETY: the library is the plugin built from nccl/profiler.c, whose load runs no code.
        let lib = unsafe { libloading::Library::new(&so) }.unwrap();
        let null: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the symbols are the plugin's ncclProfiler_v5 and _v4 structs, laid out as
        // ProfilerV5 and ProfilerV4.
        let (v5, v4) = unsafe {
            (
                &**lib.get::<*const ProfilerV5>(b"ncclProfiler_v5").unwrap(),
                &**lib.get::<*const ProfilerV4>(b"ncclProfiler_v4").unwrap(),
            )
        };
        let v4_called = std::env::var("NRUN_PLUGIN_API").as_deref() == Ok("4");
        let init = |ctx: &mut *mut std::ffi::c_void, hash: u64, mask: &mut i32, n, rank| {
            // SAFETY: the arguments NCCL passes, to the API version it calls.
            unsafe {
                match v4_called {
                    false => (v5.init)(ctx, hash, mask, null.cast(), 1, n, rank, null.cast()),
                    true => (v4.init)(ctx, mask, null.cast(), hash, 1, n, rank, null.cast()),
                }
            }
        };
        let p = match v4_called {
            false => Calls {
                start: v5.start,
                stop: v5.stop,
                record: v5.record,
                finalize: v5.finalize,
            },
            true => Calls {
                start: v4.start,
                stop: v4.stop,
                record: v4.record,
                finalize: v4.finalize,
            },
        };
        let (mut small, mut world, mut mask) = (null, null, 0);
        assert_eq!(init(&mut small, 7, &mut mask, 2, 1), 0);
        assert_eq!(mask, 2 | 64, "collectives and kernel channels");
        assert_eq!(init(&mut world, 9, &mut mask, 4, 3), 0);
        // SAFETY: every call below passes arguments as NCCL does, and handles the plugin made.
        unsafe {
            // As NCCL does: a group event (2.27 starts collectives only under one), each
            // collective started and stopped as it is enqueued, more of them than the plugin's
            // ring holds before any kernel runs; then each collective's two channels.
            let mut group = Descr::new(1, null, 3);
            let mut g = null;
            (p.start)(world, &mut g, &mut group);
            assert!(!g.is_null(), "a group event needs a handle");
            let mut handles = Vec::new();
            for seq in 0..IN_FLIGHT {
                let mut coll = Descr::new(2, g, 3);
                coll.u[0] = seq;
                coll.u[7] = 2; // nChannels: the first byte at offset 56 of the union
                let mut h = null;
                (p.start)(world, &mut h, &mut coll);
                assert!(!h.is_null());
                (p.stop)(h);
                handles.push(h);
            }
            (p.stop)(g);
            for (seq, &h) in (0..).zip(&handles) {
                for ch in 0..2u64 {
                    let mut k = Descr::new(64, h, 3);
                    (k.u[0], k.u[1]) = (ch, 1_000 + 100 * seq + 5 * ch);
                    let mut kh = null;
                    (p.start)(world, &mut kh, &mut k);
                    let mut stop = 1_040 + 100 * seq + 7 * ch;
                    (p.record)(kh, 22, &mut stop);
                    (p.stop)(kh);
                    (p.stop)(kh); // twice: counted once
                }
            }
            // A collective of the small communicator: not the one read; it ends.
            let mut coll = Descr::new(2, null, 1);
            coll.u[7] = 1;
            let mut h = null;
            (p.start)(small, &mut h, &mut coll);
            // Events the plugin did not ask for, and no handle: ignored.
            (p.stop)(null);
            (p.finalize)(small);
        }
        // Communicators past the file's slots go unmeasured, but NCCL keeps one mask for the
        // process: theirs must not turn the others' events off.
        for i in 0..SLOTS as u64 {
            let mut ctx = null;
            let mut mask = -1;
            assert_eq!(init(&mut ctx, 100 + i, &mut mask, 2, 0), 0);
            assert_eq!(mask, 2 | 64, "communicator {}", i + 3);
        }
    }
}
