//! One preflight rank: `nrun __preflight`, started by the coordinator exactly like a job worker
//! (same RANK/WORLD_SIZE/MASTER_* environment, same NCCL_* variables), with its settings in
//! NRUN_PREFLIGHT. It reports through the store and exits 0 whatever it found; see `mod.rs`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::cuda::{self, Gpu};
use super::nccl::{self, Nccl, UniqueId};
use super::{Mode, RankError, RankReport, Row, Settings, hardware};
use nrun_base::error::{Error, Result};
use nrun_store::client::Client;

/// Element i of rank r's input: small integers, so float sums are exact in any order, and
/// different per rank and position, so a misplaced or missing contribution shows.
fn pattern(rank: usize, i: usize) -> f32 {
    ((i + 3 * rank) % 13 + 1) as f32
}

const PERIOD: usize = 13;

/// The expected all-reduce result, periodic in the element index.
fn expected(world: usize) -> [f32; PERIOD] {
    let mut e = [0f32; PERIOD];
    for (i, v) in e.iter_mut().enumerate() {
        *v = (0..world).map(|r| pattern(r, i)).sum();
    }
    e
}

fn count_wrong(out: &[f32], exp: &[f32; PERIOD]) -> u64 {
    let mut wrong = 0u64;
    for chunk in out.chunks(PERIOD) {
        for (v, e) in chunk.iter().zip(exp.iter()) {
            wrong += (v != e) as u64;
        }
    }
    wrong
}

fn err(kind: &str, message: impl Into<String>) -> RankError {
    RankError {
        kind: kind.into(),
        message: message.into(),
    }
}

/// The store connection and what every step needs.
struct Ctx {
    rt: tokio::runtime::Runtime,
    store: Client,
    s: Settings,
    rank: usize,
    world: usize,
    /// The store's address (where the other nodes are reached from).
    master: SocketAddr,
}

impl Ctx {
    fn set(&mut self, key: &[u8], value: &[u8]) {
        let _ = self.rt.block_on(self.store.set(key, value));
    }

    /// Rank 0 publishes each size's row as soon as it is measured (the launcher shows the
    /// sweep as it goes); outside the timed runs, one store write per size.
    fn measured(&mut self, index: usize, row: &Row) {
        if self.rank == 0 {
            let key = self.s.size_key(index);
            self.set(&key, &serde_json::to_vec(row).unwrap_or_default());
        }
    }

    fn stage(&mut self, stage: &str) {
        let key = self.s.stage_key(self.rank);
        self.set(&key, stage.as_bytes());
    }

    /// The rank that failed and made everyone stop, if any.
    fn aborted(&mut self) -> Option<String> {
        let key = self.s.abort_key();
        let ready = self.rt.block_on(self.store.check(&[&key])).unwrap_or(false);
        if !ready {
            return None;
        }
        let v = self.rt.block_on(self.store.get(&key)).unwrap_or_default();
        Some(String::from_utf8_lossy(&v).into_owned())
    }

    /// Waits for another rank's key until the deadline, watching for an abort.
    fn wait_key(
        &mut self,
        key: &[u8],
        deadline: Instant,
        waiting_for: &str,
    ) -> Result<Vec<u8>, RankError> {
        loop {
            let got = self
                .rt
                .block_on(self.store.wait(&[key], Some(Duration::from_millis(50))))
                .map_err(|e| {
                    err(
                        "store",
                        format!("lost the store while waiting for {waiting_for}: {e}"),
                    )
                })?;
            if got {
                return self
                    .rt
                    .block_on(self.store.get(key))
                    .map_err(|e| err("store", format!("lost the store: {e}")));
            }
            if let Some(who) = self.aborted() {
                return Err(err("aborted", format!("stopped: rank {who} failed")));
            }
            if Instant::now() > deadline {
                return Err(err(
                    "init-timeout",
                    format!(
                        "timed out after {} ms waiting for {waiting_for}",
                        self.s.timeout_ms
                    ),
                ));
            }
        }
    }
}

fn env_usize(k: &str) -> Result<usize> {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            Error::helper(format!(
                "{k} is not set to a number (nrun __preflight runs only under nrun)"
            ))
        })
}

/// Entry point of `nrun __preflight`. Returns the process exit code.
pub fn main() -> u8 {
    let code = match run() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("nrun preflight: error: {e}");
            e.code
        }
    };
    // Leave without running exit handlers: NCCL's and CUDA's teardown of communicators that
    // were deliberately not destroyed can crash, and the driver reclaims everything anyway.
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process at once; nothing after it runs.
    unsafe { libc::_exit(code as i32) }
}

/// Where this rank's NCCL writes its INFO log (see [`nccl_log_to_file`]).
/// Device-to-device copies timed for the memory bandwidth check.
const MEM_COPIES: usize = 5;

/// In this rank's own private scratch directory ([`nrun_base::files::scratch`]), removed once read:
/// NCCL opens the file by name, following symlinks, so never a guessable path in a shared one.
fn nccl_log_path() -> Option<std::path::PathBuf> {
    nrun_base::files::scratch().ok().map(|d| d.join("nccl.log"))
}

/// NCCL's transport lines go to a file of this rank's own, read after the sweep: the path NCCL
/// took, in its own words. Only this process is affected, never the job.
fn nccl_log_to_file() {
    // SAFETY: called before this process starts any thread.
    unsafe {
        std::env::set_var("NCCL_DEBUG", "INFO");
        std::env::set_var("NCCL_DEBUG_SUBSYS", "P2P,SHM,NET");
        if let Some(p) = nccl_log_path() {
            std::env::set_var("NCCL_DEBUG_FILE", p);
        }
    }
}

fn run() -> Result<()> {
    let s: Settings = serde_json::from_str(
        &std::env::var(super::ENV)
            .map_err(|_| Error::helper(format!("{} is not set", super::ENV)))?,
    )
    .map_err(|e| Error::helper(format!("bad {}: {e}", super::ENV)))?;
    if s.mode == Mode::Nccl {
        nccl_log_to_file();
    }
    let rank = env_usize("RANK")?;
    let world = env_usize("WORLD_SIZE")?;
    let local_rank = env_usize("LOCAL_RANK")?;
    let master = format!(
        "{}:{}",
        std::env::var("MASTER_ADDR").unwrap_or_default(),
        std::env::var("MASTER_PORT").unwrap_or_default()
    );
    let addr: SocketAddr = master
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Error::helper(format!("cannot resolve the store address {master}")))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::helper(e.to_string()))?;
    let mut store = rt
        .block_on(Client::connect(addr, Duration::from_millis(s.timeout_ms)))
        .map_err(|e| {
            Error::helper(format!(
                "rank {rank} cannot reach the store at {master}: {e}"
            ))
        })?;
    // Multi-node runs reserve nrun's keys to those holding the run's secret.
    if let Ok(secret) = std::env::var("NRUN_SECRET") {
        rt.block_on(store.authenticate(secret.as_bytes()))
            .map_err(|e| Error::helper(format!("rank {rank}: store: {e}")))?;
    }
    let host = s.host.clone().unwrap_or_else(nrun_base::net::hostname);
    let mut ctx = Ctx {
        rt,
        store,
        s,
        rank,
        world,
        master: addr,
    };
    ctx.stage("started");
    let mut rep = RankReport {
        rank,
        local_rank,
        host,
        pid: std::process::id(),
        nccl_version: None,
        nccl_path: None,
        gpu: None,
        driver: None,
        init_ms: None,
        phases_ms: Vec::new(),
        rows: Vec::new(),
        error: None,
        links: None,
        health: None,
        path: None,
        mem_gbs: None,
        nics: Vec::new(),
        link_in: None,
        link_out: None,
        sweep_cut: None,
    };
    let result = match ctx.s.mode {
        Mode::Nccl => run_nccl(&mut ctx, &mut rep, local_rank),
        Mode::Net => run_net(&mut ctx, &mut rep),
    };
    // The NCCL log was read (or not, on a failure) by now; nothing of it stays behind.
    nrun_base::files::remove_scratch();
    if let Err(e) = result {
        if e.kind != "aborted" {
            let key = ctx.s.abort_key();
            ctx.set(&key, rank.to_string().as_bytes());
        }
        rep.error = Some(e);
    }
    let json = serde_json::to_vec(&rep).map_err(|e| Error::helper(e.to_string()))?;
    let key = ctx.s.result_key(rank);
    ctx.set(&key, &json);
    ctx.stage("done");
    // Leave together: a rank whose last collective finished may still have bytes in flight to
    // a peer (NCCL's proxy threads), and exiting would cut them off.
    if rep.error.is_none() {
        let key = ctx.s.finished_key();
        let _ = ctx.rt.block_on(ctx.store.barrier(
            &key,
            ctx.world as i64,
            Some(Duration::from_secs(10)),
        ));
    }
    Ok(())
}

/// Times phases of a rank's work for the report.
struct Phases {
    last: Instant,
    list: Vec<(String, f64)>,
}

impl Phases {
    fn new() -> Phases {
        Phases {
            last: Instant::now(),
            list: Vec::new(),
        }
    }

    fn mark(&mut self, name: &str) {
        let now = Instant::now();
        self.list
            .push((name.to_string(), (now - self.last).as_secs_f64() * 1e3));
        self.last = now;
    }
}

/// Elements compared per block: a multiple of the pattern's period, so every block of a
/// correct result equals the same expected block and the check is a memcmp.
const CHECK_BLOCK: usize = PERIOD * 4096;
/// Page-locked staging buffer for copying results back, in floats.
const STAGING: usize = CHECK_BLOCK * 256;

fn expected_block(world: usize) -> Vec<u32> {
    let e = expected(world);
    (0..CHECK_BLOCK).map(|i| e[i % PERIOD].to_bits()).collect()
}

/// Counts wrong elements of `dev[..count]`, copying it back through `staging`.
fn check_device(
    gpu: &Gpu,
    dev: &cuda::DeviceBuf,
    count: usize,
    staging: &mut cuda::HostBuf,
    exp: &[u32],
) -> Result<u64, cuda::CudaError> {
    let mut wrong = 0u64;
    let mut off = 0;
    while off < count {
        let n = (count - off).min(STAGING);
        gpu.download_at(staging, dev, off, n)?;
        let got = staging.as_bits(n);
        // Chunks start at multiples of STAGING and blocks at multiples of CHECK_BLOCK, so every
        // block starts at a multiple of the pattern's period.
        for block in got.chunks(CHECK_BLOCK) {
            let want = &exp[..block.len()];
            if block != want {
                wrong += block.iter().zip(want).filter(|(a, b)| a != b).count() as u64;
            }
        }
        off += n;
    }
    Ok(wrong)
}

/// The GPU-side checker, if it loads and passes a self-test on this rank's own input (which
/// differs from the all-reduce result in every element when there are several ranks, and
/// equals it with one). Otherwise results are checked on the host.
fn gpu_checker(
    gpu: &Gpu,
    rank: usize,
    world: usize,
    send: Option<&cuda::DeviceBuf>,
    max_count: usize,
) -> Option<cuda::Checker> {
    let send = send?;
    let exp: Vec<f32> = expected(world).to_vec();
    let mut c = match cuda::Checker::new(gpu, &exp) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(
                "rank {rank}: GPU check kernel unavailable ({e}); checking on the host"
            );
            return None;
        }
    };
    let n = max_count.min(CHECK_BLOCK);
    let want = if world > 1 { n as u64 } else { 0 };
    match c.count_wrong(gpu, send, n) {
        Ok(got) if got == want => Some(c),
        other => {
            eprintln!(
                "nrun preflight: rank {rank}: GPU check kernel failed its self-test ({other:?}, expected {want}); checking on the host"
            );
            None
        }
    }
}

/// The send and receive buffers, and the GPU's memory bandwidth (GB/s) measured on them.
type Buffers = (cuda::DeviceBuf, cuda::DeviceBuf, Option<f64>);

/// NVML's read of a GPU's links and health, in a thread of its own.
type LinksRead = std::thread::JoinHandle<Result<(hardware::Links, hardware::Health), Error>>;

/// What the NCCL preflight's setup opened: this rank's GPU, the library, and NVML's read of the
/// GPU's links, under way in a thread. (The GPU first: fields drop in order, and the GPU went
/// before the library when this was one function.)
struct NcclRank {
    gpu: Gpu,
    nccl: Nccl,
    links: LinksRead,
}

/// A communicator that formed, and the buffers filled while it did.
struct Formed {
    comm: nccl::Comm,
    send: cuda::DeviceBuf,
    recv: cuda::DeviceBuf,
    checker: Option<cuda::Checker>,
    max_count: usize,
}

/// NCCL's words for a failure: its error string and, where it has one, its last message.
fn nccl_error(nccl: &Nccl, r: nccl::NcclResult, comm: nccl::Comm) -> String {
    let mut m = nccl.error_string(r);
    if let Some(last) = nccl.last_error(Some(comm)) {
        m.push_str(&format!(": {last}"));
    }
    m
}

/// The NCCL preflight of one rank: set up, form the communicator, sweep, report what the
/// hardware and NCCL's path were.
fn run_nccl(ctx: &mut Ctx, rep: &mut RankReport, local_rank: usize) -> Result<(), RankError> {
    let deadline = Instant::now() + Duration::from_millis(ctx.s.timeout_ms);
    let mut ph = Phases::new();
    let r = nccl_setup(ctx, rep, local_rank, &mut ph)?;
    let id = unique_id(ctx, deadline)?;
    ctx.stage("id");
    ph.mark("unique-id");
    let mut formed = nccl_init(ctx, rep, &r, id, deadline, &mut ph)?;
    nccl_sweep(ctx, rep, &r, &mut formed)?;
    ph.mark("sweep");
    nccl_hardware(rep, r.links);
    rep.phases_ms = ph.list;
    // Neither the buffers nor the communicators are torn down: the process ends right after
    // reporting (see `main`), and freeing memory NCCL may still reference only risks a crash.
    std::mem::forget((formed.send, formed.recv));
    Ok(())
}

/// Loads libnccl (rank 0 publishes the unique id at once), checks the driver, opens this
/// rank's GPU and starts reading its links.
fn nccl_setup(
    ctx: &mut Ctx,
    rep: &mut RankReport,
    local_rank: usize,
    ph: &mut Phases,
) -> Result<NcclRank, RankError> {
    let path = ctx.s.nccl_lib.clone().ok_or_else(|| {
        err("setup", "no libnccl.so.2 found (torch's, LD_LIBRARY_PATH or the system's); pass --nccl-lib PATH")
    })?;
    let nccl = Nccl::open(&path).map_err(|e| err("setup", e.0))?;
    rep.nccl_version = Some(nccl.version.to_string());
    rep.nccl_path = Some(path.display().to_string());
    // Rank 0 publishes the unique id first: it needs no GPU, and the others can start init as
    // soon as their GPU is ready.
    if ctx.rank == 0 {
        let id = nccl.unique_id().map_err(|r| {
            let mut m = format!("ncclGetUniqueId: {}", nccl.error_string(r));
            if let Some(last) = nccl.last_error(None) {
                m.push_str(&format!(": {last}"));
            }
            err("init", m)
        })?;
        let key = ctx.s.uid_key();
        ctx.set(&key, &id.internal);
    }
    ph.mark("nccl-load");
    if !cuda::driver_present() {
        return Err(err(
            "setup",
            "libcuda.so.1 not found: no NVIDIA driver on this host (use --preflight=net for the network path alone)",
        ));
    }
    let (dmaj, dmin) = cuda::driver_version().map_err(|e| err("setup", e.0))?;
    rep.driver = Some(format!("{dmaj}.{dmin}"));
    // The pip wheels say which CUDA the library was built for; an older driver cannot run it.
    let lib = path.to_string_lossy();
    let built_for = if lib.contains("cu13") {
        Some(13)
    } else if lib.contains("cu12") {
        Some(12)
    } else {
        None
    };
    let gpu = Gpu::open(local_rank as i32).map_err(|e| {
        let mut m = e.0;
        if let Some(need) = built_for.filter(|n| *n > dmaj) {
            m.push_str(&format!(
                "; the driver supports CUDA {dmaj}.{dmin} but this NCCL is built for CUDA {need}: update the driver"
            ));
        }
        err("setup", m)
    })?;
    rep.gpu = Some(format!("{} ({})", gpu.name, gpu.pci_bus_id));
    // The GPU's links, read while NCCL initialises (NVML's own start costs tens of ms).
    let links = {
        let bus = gpu.pci_bus_id.clone();
        std::thread::spawn(move || hardware::inspect(&bus))
    };
    ctx.stage("loaded");
    ph.mark("cuda");
    Ok(NcclRank { gpu, nccl, links })
}

/// The communicator's unique id: rank 0 reads back its own, the others wait for it.
fn unique_id(ctx: &mut Ctx, deadline: Instant) -> Result<UniqueId, RankError> {
    let key = ctx.s.uid_key();
    let mut id = UniqueId { internal: [0; 128] };
    if ctx.rank == 0 {
        let bytes = ctx
            .rt
            .block_on(ctx.store.get(&key))
            .map_err(|e| err("store", e.to_string()))?;
        id.internal.copy_from_slice(&bytes[..128.min(bytes.len())]);
    } else {
        let bytes = ctx.wait_key(&key, deadline, "rank 0's NCCL unique id")?;
        if bytes.len() != 128 {
            return Err(err(
                "init",
                format!(
                    "unique id of {} bytes from the store, expected 128",
                    bytes.len()
                ),
            ));
        }
        id.internal.copy_from_slice(&bytes);
    }
    Ok(id)
}

/// Forms the communicator: non-blocking init polled against the deadline (so a hang becomes a
/// diagnosis), the buffers filled and the memory bandwidth measured meanwhile, then a blocking
/// child communicator split off to time on.
fn nccl_init(
    ctx: &mut Ctx,
    rep: &mut RankReport,
    r: &NcclRank,
    id: UniqueId,
    deadline: Instant,
    ph: &mut Phases,
) -> Result<Formed, RankError> {
    let (nccl, gpu) = (&r.nccl, &r.gpu);
    let t0 = Instant::now();
    let (comm, st) = nccl.init_nonblocking(ctx.world as i32, id, ctx.rank as i32);
    if st != nccl::NCCL_SUCCESS && st != nccl::NCCL_IN_PROGRESS {
        let m = nccl_error(nccl, st, comm);
        nccl.abort(comm);
        return Err(err("init", format!("ncclCommInitRankConfig: {m}")));
    }
    // NCCL works in a thread of its own meanwhile, so the buffers are prepared here.
    let sizes = ctx.s.sizes();
    let max_count = (sizes.last().copied().unwrap_or(4) / 4) as usize;
    let buffers = fill_buffers(gpu, ctx.rank, max_count);
    let checker = gpu_checker(
        gpu,
        ctx.rank,
        ctx.world,
        buffers.as_ref().ok().map(|b| &b.0),
        max_count,
    );
    ph.mark("buffers");
    let mut last_check = Instant::now();
    loop {
        let st = nccl.async_error(comm);
        if st == nccl::NCCL_SUCCESS {
            break;
        }
        if st != nccl::NCCL_IN_PROGRESS {
            let m = nccl_error(nccl, st, comm);
            nccl.abort(comm);
            return Err(err("init", format!("ncclCommInitRankConfig: {m}")));
        }
        if Instant::now() > deadline {
            nccl.abort(comm);
            return Err(err(
                "init-timeout",
                format!(
                    "NCCL communicator init did not finish within {} ms (stuck waiting for peers)",
                    ctx.s.timeout_ms
                ),
            ));
        }
        if last_check.elapsed() > Duration::from_millis(50) {
            last_check = Instant::now();
            if let Some(who) = ctx.aborted() {
                nccl.abort(comm);
                return Err(err(
                    "aborted",
                    format!("stopped during init: rank {who} failed"),
                ));
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    rep.init_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
    ph.mark("init");
    let (send, recv, mem_gbs) = buffers.map_err(|e| err("setup", e.0))?;
    rep.mem_gbs = mem_gbs;
    let split_deadline = Instant::now()
        + Duration::from_secs(10).min(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1)),
        );
    // NRUN_PREFLIGHT_NO_SPLIT=1 times on the non-blocking communicator itself (a way around an
    // NCCL whose split misbehaves).
    let split = if std::env::var_os("NRUN_PREFLIGHT_NO_SPLIT").is_some() {
        None
    } else {
        nccl.split_blocking(comm, ctx.rank as i32, split_deadline)
    };
    let comm = match split {
        // No ncclCommSplit, or it did not finish: time on the non-blocking parent instead.
        None => comm,
        Some(Ok(child)) => child,
        Some(Err(st)) => {
            return Err(err(
                "init",
                format!("ncclCommSplit: {}", nccl_error(nccl, st, comm)),
            ));
        }
    };
    ctx.stage("init");
    ph.mark("split");
    Ok(Formed {
        comm,
        send,
        recv,
        checker,
        max_count,
    })
}

/// The send buffer filled with this rank's pattern, the receive buffer, and the GPU's memory
/// bandwidth from device-to-device copies of the largest buffer (read and write both count),
/// from 64 MiB up where it is meaningful.
fn fill_buffers(gpu: &Gpu, rank: usize, max_count: usize) -> Result<Buffers, cuda::CudaError> {
    let send = gpu.alloc(max_count * 4)?;
    let recv = gpu.alloc(max_count * 4)?;
    // Fill: one block from the host, then doubling device-to-device copies (block sizes stay
    // multiples of the pattern's period, so the pattern continues).
    let first: Vec<f32> = (0..CHECK_BLOCK.min(max_count))
        .map(|i| pattern(rank, i))
        .collect();
    gpu.upload(&send, &first)?;
    let mut filled = first.len();
    while filled < max_count {
        let n = filled.min(max_count - filled);
        gpu.copy_within_async(&send, 0, filled, n)?;
        filled += n;
    }
    gpu.synchronize()?;
    let bytes = max_count * 4;
    let mem_gbs = if bytes >= 64 << 20 {
        let (start, end) = (gpu.event()?, gpu.event()?);
        gpu.copy_async(&recv, &send, bytes)?;
        gpu.record(&start)?;
        for _ in 0..MEM_COPIES {
            gpu.copy_async(&recv, &send, bytes)?;
        }
        gpu.record(&end)?;
        gpu.synchronize()?;
        let ms = gpu.elapsed_ms(&start, &end)? as f64;
        (ms > 0.0).then(|| 2.0 * bytes as f64 * MEM_COPIES as f64 / (ms * 1e-3) / 1e9)
    } else {
        None
    };
    Ok((send, recv, mem_gbs))
}

/// The sweep: every size out-of-place then in-place, timed over the iterations, each result
/// checked (on the GPU where its checker loaded, else on the host).
fn nccl_sweep(
    ctx: &mut Ctx,
    rep: &mut RankReport,
    r: &NcclRank,
    f: &mut Formed,
) -> Result<(), RankError> {
    let (nccl, gpu, comm, max_count) = (&r.nccl, &r.gpu, f.comm, f.max_count);
    let (send, recv, checker) = (&f.send, &f.recv, &mut f.checker);
    // Host staging only where the GPU checker is unavailable.
    let mut staging = None;
    let exp = expected_block(ctx.world);
    let mut check = |dev: &cuda::DeviceBuf, count: usize| -> Result<u64, cuda::CudaError> {
        match checker.as_mut() {
            Some(c) => c.count_wrong(gpu, dev, count),
            None => {
                if staging.is_none() {
                    staging =
                        Some(gpu.alloc_host(STAGING.min(max_count.next_multiple_of(CHECK_BLOCK)))?);
                }
                match staging.as_mut() {
                    Some(st) => check_device(gpu, dev, count, st, &exp),
                    None => Err(cuda::CudaError("no staging buffer".into())),
                }
            }
        }
    };
    let (start, end) = match (gpu.event(), gpu.event()) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return Err(err("setup", e.0)),
    };
    let all_reduce = |src: u64, dst: u64, count: usize| -> Result<(), RankError> {
        // SAFETY: src/dst are our device buffers of max_count floats; count <= max_count.
        let mut st = unsafe { nccl.all_reduce_f32(src, dst, count, comm, gpu.stream.cast()) };
        while st == nccl::NCCL_IN_PROGRESS {
            st = nccl.async_error(comm);
        }
        if st != nccl::NCCL_SUCCESS {
            return Err(err(
                "collective",
                format!(
                    "ncclAllReduce of {count} floats: {}",
                    nccl_error(nccl, st, comm)
                ),
            ));
        }
        Ok(())
    };
    let cu = |e: cuda::CudaError| err("collective", e.0);
    ctx.stage("sweep");
    for bytes in ctx.s.sizes() {
        let count = (bytes / 4) as usize;
        let timed = |src: u64, dst: u64| -> Result<f64, RankError> {
            for _ in 0..ctx.s.warmup {
                all_reduce(src, dst, count)?;
            }
            gpu.record(&start).map_err(cu)?;
            for _ in 0..ctx.s.iters {
                all_reduce(src, dst, count)?;
            }
            gpu.record(&end).map_err(cu)?;
            Ok(gpu.elapsed_ms(&start, &end).map_err(cu)? as f64 * 1e3 / ctx.s.iters.max(1) as f64)
        };
        let oop_us = timed(send.ptr, recv.ptr)?;
        let oop_wrong = check(recv, count).map_err(cu)?;
        let ip_us = timed(recv.ptr, recv.ptr)?;
        // Timed in-place runs compound the data; check one run on fresh input.
        gpu.copy_async(recv, send, count * 4).map_err(cu)?;
        all_reduce(recv.ptr, recv.ptr, count)?;
        gpu.synchronize().map_err(cu)?;
        let ip_wrong = check(recv, count).map_err(cu)?;
        let row = Row {
            bytes,
            oop_us,
            oop_wrong,
            ip_us,
            ip_wrong,
        };
        ctx.measured(rep.rows.len(), &row);
        rep.rows.push(row);
    }
    Ok(())
}

/// What the sweep ran on: the GPU's links and health (NVML), and the path NCCL took (its INFO
/// log, removed once read) with the network interfaces it went through.
fn nccl_hardware(rep: &mut RankReport, links: LinksRead) {
    if let Some((l, h)) = links.join().ok().and_then(Result::ok) {
        rep.links = Some(l);
        rep.health = Some(h);
    }
    let text = nccl_log_path().and_then(|log| nrun_base::files::read_own(&log, 16 << 20).ok());
    if let Some(text) = text {
        let text = String::from_utf8_lossy(&text);
        rep.path = Some(hardware::parse_nccl_log(&text)).filter(|p| !p.transports.is_empty());
    }
    if let Some(p) = &rep.path {
        rep.nics = p.nics.iter().map(|n| hardware::Nic::read(n)).collect();
    }
}

// ---- network-only preflight: a TCP ring all-reduce -------------------------------------------

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn read_f32s(s: &mut TcpStream, out: &mut [f32]) -> std::io::Result<()> {
    // SAFETY: every bit pattern is a valid f32.
    let b = unsafe {
        std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(out))
    };
    s.read_exact(b)
}

/// The ring: a stream to the next rank (written by a sender thread, so sending and receiving
/// overlap and neither side blocks the other) and one from the previous rank.
struct Ring {
    to_next: std::sync::mpsc::Sender<Vec<u8>>,
    from_prev: TcpStream,
    sender: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    /// The link test's own connections (to the next rank, from the previous one), dropped
    /// after it: what a slow link still holds in flight when its time is up is thrown away
    /// with them, never waited for.
    probe: Option<(TcpStream, TcpStream)>,
}

/// What each link of the net preflight's ring carries alone before the sweep, and how often.
const LINK_BYTES: usize = 8 << 20;
const LINK_ROUNDS: usize = 3;
/// How long one turn of the link test may take: a healthy link moves [`LINK_BYTES`] in
/// milliseconds, a link 100x slower than its peers is known from what arrives in this time,
/// and a slow link costs the test about a second, not the minutes its bytes would take.
const LINK_WINDOW: Duration = Duration::from_millis(250);
/// How long the receiver of a turn waits for its first byte: the sender's start may lag on a
/// loaded host; a link that carries nothing in this time is broken.
const LINK_FIRST_BYTE: Duration = Duration::from_secs(3);
/// The most time one size of the sweep is predicted to take (all its runs) over the ring's
/// slowest link: larger sizes are left out, so a slow link costs the sweep seconds.
const SIZE_BUDGET: Duration = Duration::from_secs(2);

/// How one turn of the link test went on the receiving side.
enum Received {
    /// The rate in GB/s, and whether the window ran out before every byte came.
    Rate(f64, bool),
    /// Nothing arrived within [`LINK_FIRST_BYTE`].
    Nothing,
}

impl Ring {
    /// Sends up to `bytes` on the link test's connection for at most [`LINK_WINDOW`] (twice
    /// it: the receiver's window starts at its first byte); whether the time ran out.
    fn send_link(&mut self, bytes: usize) -> std::io::Result<bool> {
        let Some((out, _)) = self.probe.as_mut() else {
            return Ok(false);
        };
        let buf = vec![0x5au8; 256 << 10];
        let end = Instant::now() + 2 * LINK_WINDOW;
        let mut sent = 0;
        while sent < bytes {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(true);
            }
            out.set_write_timeout(Some(left))?;
            match out.write(&buf[..(bytes - sent).min(buf.len())]) {
                Ok(k) => sent += k,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }

    /// Receives up to `bytes` from the previous rank for at most [`LINK_WINDOW`] after the
    /// first of them arrives: the rate in GB/s, timed from the first bytes (not the wait for
    /// the sender) to the last or to the window's end.
    fn recv_link(&mut self, bytes: usize) -> std::io::Result<Received> {
        let Some((_, from)) = self.probe.as_mut() else {
            return Ok(Received::Nothing);
        };
        let mut buf = vec![0u8; 1 << 20];
        let (mut got, mut first) = (0, 0);
        let mut start: Option<Instant> = None;
        let waited = Instant::now();
        while got < bytes {
            let end = match start {
                Some(s) => s + LINK_WINDOW,
                None => waited + LINK_FIRST_BYTE,
            };
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            from.set_read_timeout(Some(left))?;
            let want = (bytes - got).min(buf.len());
            let k = match from.read(&mut buf[..want]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => k,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if start.is_none() {
                start = Some(Instant::now());
                first = k;
            }
            got += k;
        }
        let Some(start) = start else {
            return Ok(Received::Nothing);
        };
        let secs = start.elapsed().as_secs_f64().max(1e-6);
        Ok(Received::Rate(
            (got - first) as f64 / secs / 1e9,
            got < bytes,
        ))
    }

    fn chunk(count: usize, n: usize, i: usize) -> std::ops::Range<usize> {
        let base = count / n;
        let extra = count % n;
        let start = i * base + i.min(extra);
        start..start + base + usize::from(i < extra)
    }

    /// In-place ring all-reduce of `data`: reduce-scatter, then all-gather.
    fn all_reduce(&mut self, data: &mut [f32], rank: usize, n: usize) -> std::io::Result<()> {
        let count = data.len();
        let mut incoming = vec![0f32; count / n + 1];
        let send = |ring: &Ring, r: std::ops::Range<usize>, data: &[f32]| {
            ring.to_next
                .send(as_bytes(&data[r]).to_vec())
                .map_err(|_| std::io::Error::other("sender thread ended"))
        };
        for step in 0..n - 1 {
            let s = Self::chunk(count, n, (rank + n - step) % n);
            send(self, s, data)?;
            let r = Self::chunk(count, n, (rank + n - step - 1) % n);
            let buf = &mut incoming[..r.len()];
            read_f32s(&mut self.from_prev, buf)?;
            for (d, x) in data[r].iter_mut().zip(buf.iter()) {
                *d += *x;
            }
        }
        for step in 0..n - 1 {
            let s = Self::chunk(count, n, (rank + 1 + n - step) % n);
            send(self, s, data)?;
            let r = Self::chunk(count, n, (rank + n - step) % n);
            read_f32s(&mut self.from_prev, &mut data[r])?;
        }
        Ok(())
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        let (tx, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.to_next, tx));
        if let Some(t) = self.sender.take() {
            let _ = t.join();
        }
    }
}

fn run_net(ctx: &mut Ctx, rep: &mut RankReport) -> Result<(), RankError> {
    let deadline = Instant::now() + Duration::from_millis(ctx.s.timeout_ms);
    let (listener, me) = listen(ctx, rep)?;
    let t0 = Instant::now();
    let mut ring = None;
    if ctx.world > 1 {
        let mut r = connect_ring(ctx, &listener, me, deadline)?;
        ctx.stage("links");
        test_links(ctx, rep, &mut r, deadline)?;
        ring = Some(r);
    }
    rep.init_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
    ctx.stage("init");
    ctx.stage("sweep");
    sweep(ctx, rep, ring.as_mut())
}

fn net_err(what: &str, e: std::io::Error) -> RankError {
    err("init", format!("{what}: {e}"))
}

/// Listens for the previous rank and publishes the address it reaches us at.
fn listen(ctx: &mut Ctx, rep: &mut RankReport) -> Result<(TcpListener, SocketAddr), RankError> {
    let listener = TcpListener::bind((ctx.s.listen_addr.as_str(), 0))
        .map_err(|e| net_err(&format!("cannot listen on {}", ctx.s.listen_addr), e))?;
    let mut me = listener.local_addr().map_err(|e| net_err("listener", e))?;
    // Listening on every address (a node that does not know its own): the others reach it at
    // the address this host uses towards the store.
    if me.ip().is_unspecified() {
        let toward = std::net::UdpSocket::bind(SocketAddr::new(me.ip(), 0))
            .and_then(|u| u.connect(ctx.master).and_then(|()| u.local_addr()));
        if let Ok(a) = toward {
            me.set_ip(a.ip());
        }
    }
    let key = ctx.s.addr_key(ctx.rank);
    ctx.set(&key, me.to_string().as_bytes());
    if let Some(i) =
        nrun_base::net::owner(&nrun_base::net::interfaces(), me.ip()).filter(|i| !i.loopback)
    {
        rep.nics = vec![hardware::Nic::read(&i.name)];
    }
    ctx.stage("loaded");
    Ok((listener, me))
}

/// Connects to the next rank and takes the previous one's connection: this rank's place in the
/// ring.
fn connect_ring(
    ctx: &mut Ctx,
    listener: &TcpListener,
    me: SocketAddr,
    deadline: Instant,
) -> Result<Ring, RankError> {
    let (rank, n) = (ctx.rank, ctx.world);
    let next = (rank + 1) % n;
    let key = ctx.s.addr_key(next);
    let next_addr = String::from_utf8_lossy(&ctx.wait_key(
        &key,
        deadline,
        &format!("rank {next}'s address"),
    )?)
    .into_owned();
    ctx.stage("id");
    let addr: SocketAddr = next_addr
        .parse()
        .map_err(|_| err("init", format!("bad address {next_addr} from rank {next}")))?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    let connect = || {
        TcpStream::connect_timeout(&addr, left).map_err(|e| {
            let kind = if e.kind() == std::io::ErrorKind::TimedOut { "init-timeout" } else { "init" };
            err(kind, format!("cannot connect to rank {next} at {addr}: {e} (firewall or wrong interface between the hosts?)"))
        })
    };
    // The ring's connection, then the link test's, each saying which it is in its first byte:
    // the accept queue orders them by when each handshake completed there, which loss can
    // reorder (a lossy row's run, taken one for the other, read link-test bytes as results).
    let tagged = |tag: u8| -> Result<TcpStream, RankError> {
        let mut s = connect()?;
        s.write_all(&[tag]).map_err(|e| {
            err(
                "init",
                format!("cannot write to rank {next} at {addr}: {e}"),
            )
        })?;
        Ok(s)
    };
    let mut out = tagged(RING_TAG)?;
    out.set_nodelay(true).ok();
    let probe_out = match ctx.s.links {
        true => Some(tagged(PROBE_TAG)?),
        false => None,
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| net_err("listener", e))?;
    let (mut from_prev, mut probe_in) = (None, None);
    while from_prev.is_none() || (probe_out.is_some() && probe_in.is_none()) {
        let (tag, s) = accept_tagged(ctx, listener, me, deadline)?;
        match tag {
            RING_TAG if from_prev.is_none() => from_prev = Some(s),
            PROBE_TAG if probe_out.is_some() && probe_in.is_none() => probe_in = Some(s),
            _ => {
                let prev = (ctx.rank + ctx.world - 1) % ctx.world;
                return Err(err(
                    "init",
                    format!(
                        "a connection to {me} (rank {prev}'s?) began with byte {tag}, neither the ring's nor the link test's: is another program connecting to this port?"
                    ),
                ));
            }
        }
    }
    let from_prev = from_prev.ok_or_else(|| err("init", "no ring connection"))?;
    let probe = probe_out.zip(probe_in);
    from_prev.set_nonblocking(false).ok();
    from_prev.set_nodelay(true).ok();
    from_prev
        .set_read_timeout(Some(Duration::from_millis(ctx.s.timeout_ms)))
        .ok();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        for buf in rx {
            out.write_all(&buf)?;
        }
        Ok(())
    });
    Ok(Ring {
        to_next: tx,
        from_prev,
        sender: Some(sender),
        probe,
    })
}

/// The first byte of the ring's connection and of the link test's.
const RING_TAG: u8 = b'R';
const PROBE_TAG: u8 = b'P';

/// A connection of the previous rank and the tag it begins with, by the deadline.
fn accept_tagged(
    ctx: &mut Ctx,
    listener: &TcpListener,
    me: SocketAddr,
    deadline: Instant,
) -> Result<(u8, TcpStream), RankError> {
    let mut s = accept_prev(ctx, listener, me, deadline)?;
    s.set_nonblocking(false).ok();
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    s.set_read_timeout(Some(left)).ok();
    let mut tag = [0u8];
    s.read_exact(&mut tag).map_err(|e| {
        let prev = (ctx.rank + ctx.world - 1) % ctx.world;
        err(
            "init-timeout",
            format!("rank {prev}'s connection to {me} sent nothing within the timeout: {e}"),
        )
    })?;
    Ok((tag[0], s))
}

/// The previous rank's connection, by the deadline, unless a rank fails meanwhile.
fn accept_prev(
    ctx: &mut Ctx,
    listener: &TcpListener,
    me: SocketAddr,
    deadline: Instant,
) -> Result<TcpStream, RankError> {
    let prev = (ctx.rank + ctx.world - 1) % ctx.world;
    loop {
        match listener.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(err(
                        "init-timeout",
                        format!(
                            "rank {prev} never connected to {me} within {} ms",
                            ctx.s.timeout_ms
                        ),
                    ));
                }
                if let Some(who) = ctx.aborted() {
                    return Err(err("aborted", format!("stopped: rank {who} failed")));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(net_err("accept", e)),
        }
    }
}

/// Measures this rank's incoming link: each link alone on its wire, so a slow one is seen and
/// placed (in the all-reduce the slowest link sets every rank's time). Neighbouring links take
/// turns: a host sending while it receives delays its own ACKs behind its data, and a shaped or
/// slow egress would then drag the link into it down too. Each turn is bounded by time
/// ([`LINK_WINDOW`]), not bytes: a slow link is measured from what it carries in that time.
fn test_links(
    ctx: &mut Ctx,
    rep: &mut RankReport,
    r: &mut Ring,
    deadline: Instant,
) -> Result<(), RankError> {
    let (rank, n) = (ctx.rank, ctx.world);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    if !ctx.s.links {
        return Ok(());
    }
    let (phases, phase_of) = link_phases(&ring_hosts(ctx, deadline)?);
    let phase = |link: usize| phase_of[link];
    // Every rank in its ring first: a sender bounds its turn from its own start, and a
    // receiver still connecting (a lost handshake packet costs a second) would find the sender
    // gone and measure only what the sockets buffered. Seen with 5% of the packets into a node
    // dropped: a link that carries 1-3 GB/s measured 0.0026, its receiver 0.77 s late.
    let key = ctx.s.link_start_key();
    link_barrier(ctx, &key, n, deadline, "start")?;
    // Once a turn runs out of time on either end, that link is measured: its later turns
    // would only wait out their windows again (its connection still full of the first's bytes).
    let (mut send_done, mut recv_done) = (false, false);
    // Each link three times, its best kept: a 5 ms transfer on a busy host can lose half its
    // time to one scheduling delay, and a link is only named slow for what it cannot do.
    for turn in 0..phases * LINK_ROUNDS {
        let p = turn % phases;
        if phase(rank) == p && !send_done {
            send_done = r
                .send_link(LINK_BYTES)
                .map_err(|e| err("collective", format!("link test to rank {next}: {e}")))?;
        }
        if phase(prev) == p && !recv_done {
            let got = r
                .recv_link(LINK_BYTES)
                .map_err(|e| err("collective", format!("link test from rank {prev}: {e}")))?;
            let (gbs, timed_out) = match got {
                Received::Rate(gbs, cut) => (gbs, cut),
                // Nothing in seconds: the link carries nothing, and is measured at 0.
                Received::Nothing => (0.0, true),
            };
            recv_done = timed_out;
            let best = rep.link_in.map_or(gbs, |l| l.gbs.max(gbs));
            rep.link_in = Some(super::LinkIn {
                from: prev,
                gbs: best,
            });
        }
        let key = ctx.s.link_key(turn);
        link_barrier(ctx, &key, n, deadline, &format!("turn {turn}"))?;
    }
    // Every rank's measured link, for the sweep's sizes (each rank reads the same).
    {
        let gbs = rep.link_in.map_or(0.0, |l| l.gbs);
        let key = ctx.s.link_rate_key(rank);
        ctx.set(&key, gbs.to_string().as_bytes());
        let key = ctx.s.link_key(phases * LINK_ROUNDS);
        link_barrier(ctx, &key, n, deadline, "rates")?;
    }
    if let Some((out, _)) = r.probe.as_ref() {
        rep.link_out =
            sent_and_lost(out).map(|(segments, retransmitted, spurious)| super::LinkOut {
                to: next,
                segments,
                retransmitted,
                spurious,
            });
    }
    r.probe = None;
    Ok(())
}

/// The kernel's count of segments sent on `s`, of those sent again, and of those the receiver
/// reported getting twice (TCP_INFO's tcpi_segs_out, tcpi_total_retrans and tcpi_dsack_dups;
/// read from the kernel's layout, which glibc's struct stops short of). A kernel older than
/// tcpi_dsack_dups (4.19) reports no spurious ones.
fn sent_and_lost(s: &TcpStream) -> Option<(u32, u32, u32)> {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 256];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `buf` and sets `len` to how many.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    // 8 one-byte fields, 23 u32 fields (tcpi_rto .. tcpi_rcv_space), tcpi_total_retrans,
    // 4 u64 fields (pacing rates, bytes acked and received), tcpi_segs_out; further on, after
    // 7 u32 and 6 u64 fields (tcpi_segs_in .. tcpi_bytes_retrans), tcpi_dsack_dups.
    let got = &buf[..(len as usize).min(buf.len())];
    let u32_at = |at: usize| {
        got.get(at..at + 4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    };
    match rc == 0 {
        true => Some((u32_at(136)?, u32_at(100)?, u32_at(216).unwrap_or(0))),
        false => None,
    }
}

/// Waits at the link test's barrier `key` until all `n` ranks are in, or `deadline`; `what`
/// names the point of the test in the error.
fn link_barrier(
    ctx: &mut Ctx,
    key: &[u8],
    n: usize,
    deadline: Instant,
    what: &str,
) -> Result<(), RankError> {
    let left = deadline.saturating_duration_since(Instant::now());
    let all = ctx
        .rt
        .block_on(ctx.store.barrier(key, n as i64, Some(left)))
        .map_err(|e| err("collective", format!("link test, {what}: {e}")))?;
    match all {
        true => Ok(()),
        false => Err(err(
            "init-timeout",
            format!("link test, {what}: not every rank arrived within the timeout"),
        )),
    }
}

/// Each rank's address without its port (ranks of one node share it), in rank order, once
/// every rank has published its own.
fn ring_hosts(ctx: &mut Ctx, deadline: Instant) -> Result<Vec<String>, RankError> {
    let keys: Vec<Vec<u8>> = (0..ctx.world).map(|r| ctx.s.addr_key(r)).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let left = deadline.saturating_duration_since(Instant::now());
    let lost = |e: std::io::Error| err("store", format!("lost the store reading the ring: {e}"));
    if !ctx
        .rt
        .block_on(ctx.store.wait(&refs, Some(left)))
        .map_err(lost)?
    {
        return Err(err(
            "init-timeout",
            "not every rank published its address within the timeout",
        ));
    }
    let values = ctx.rt.block_on(ctx.store.multi_get(&refs)).map_err(lost)?;
    Ok(values
        .iter()
        .map(|v| {
            let a = String::from_utf8_lossy(v);
            a.parse::<SocketAddr>()
                .map_or_else(|_| a.to_string(), |s| s.ip().to_string())
        })
        .collect())
}

/// The link test's turns: (how many, each link's turn; link r goes from rank r to r + 1).
/// Links between nodes alternate (a third turn for the last of an odd count), so no node sends
/// and receives between nodes in one turn: its ACKs would queue behind its own data, and a
/// slow egress would drag the link into it down too. A node's ranks are consecutive, so with
/// several ranks a node the links between nodes are not every other link: they are counted
/// by the hosts' addresses. Links within a node take the first turn.
fn link_phases(hosts: &[String]) -> (usize, Vec<usize>) {
    let n = hosts.len();
    let crossing: Vec<usize> = (0..n).filter(|&r| hosts[r] != hosts[(r + 1) % n]).collect();
    let m = crossing.len();
    let mut phase = vec![0; n];
    for (k, &r) in crossing.iter().enumerate() {
        phase[r] = match m % 2 == 1 && k == m - 1 {
            true => 2,
            false => k % 2,
        };
    }
    (if m % 2 == 1 { 3 } else { 2 }, phase)
}

/// The slowest link of the ring as every rank published it (rank, GB/s); None where a rate
/// is missing (the link test was off).
fn slowest_link(ctx: &mut Ctx) -> Option<(usize, f64)> {
    let mut slowest: Option<(usize, f64)> = None;
    for rank in 0..ctx.world {
        let key = ctx.s.link_rate_key(rank);
        let v = ctx.rt.block_on(ctx.store.get(&key)).ok()?;
        let gbs: f64 = String::from_utf8_lossy(&v).parse().ok()?;
        if slowest.is_none_or(|(_, g)| gbs < g) {
            slowest = Some((rank, gbs));
        }
    }
    slowest
}

/// The sweep's sizes, less those predicted to take over [`SIZE_BUDGET`] over the slowest link
/// (`gbs`, into `rank`): a ring all-reduce moves 2(n-1)/n of a size over every link, once per
/// run. The first size always stays. Every rank computes the same list from the same rates.
fn sizes_within_budget(
    sizes: Vec<u64>,
    runs: u32,
    world: usize,
    slowest: Option<(usize, f64)>,
) -> (Vec<u64>, Option<String>) {
    let Some((rank, gbs)) = slowest else {
        return (sizes, None);
    };
    let n = world as f64;
    let secs = |b: u64| runs.max(1) as f64 * 2.0 * (n - 1.0) / n * b as f64 / (gbs.max(1e-9) * 1e9);
    let keep = sizes
        .iter()
        .enumerate()
        .take_while(|(k, b)| *k == 0 || secs(**b) <= SIZE_BUDGET.as_secs_f64())
        .count();
    if keep == sizes.len() {
        return (sizes, None);
    }
    let note = format!(
        "sizes from {} up not run: over the slowest link (into rank {rank}, {gbs:.4} GB/s) each \
         would take over {} s",
        super::human_bytes(sizes[keep]),
        SIZE_BUDGET.as_secs()
    );
    (sizes[..keep].to_vec(), Some(note))
}

/// The all-reduce sweep over the ring (none: a single rank), one row per size.
fn sweep(
    ctx: &mut Ctx,
    rep: &mut RankReport,
    mut ring: Option<&mut Ring>,
) -> Result<(), RankError> {
    let (rank, n) = (ctx.rank, ctx.world);
    let exp = expected(n);
    let slowest = match ring.is_some() && ctx.s.links {
        true => slowest_link(ctx),
        false => None,
    };
    let (sizes, cut) =
        sizes_within_budget(ctx.s.sizes(), ctx.s.warmup + ctx.s.iters.max(1), n, slowest);
    rep.sweep_cut = cut;
    let max_count = (sizes.last().copied().unwrap_or(4) / 4) as usize;
    let input: Vec<f32> = (0..max_count).map(|i| pattern(rank, i)).collect();
    let mut buf = vec![0f32; max_count];
    for bytes in sizes {
        let count = (bytes / 4) as usize;
        let mut run = |buf: &mut [f32], iters: u32| -> Result<f64, RankError> {
            let t = Instant::now();
            for _ in 0..iters {
                buf.copy_from_slice(&input[..count]);
                if let Some(r) = ring.as_deref_mut() {
                    r.all_reduce(buf, rank, n).map_err(|e| {
                        err("collective", format!("ring all-reduce of {bytes} B: {e}"))
                    })?;
                }
            }
            Ok(t.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64)
        };
        run(&mut buf[..count], ctx.s.warmup)?;
        let us = run(&mut buf[..count], ctx.s.iters.max(1))?;
        let wrong = count_wrong(&buf[..count], &exp);
        // The ring works in place; out-of-place would only add a copy, so both columns show the
        // same run.
        let row = Row {
            bytes,
            oop_us: us,
            oop_wrong: wrong,
            ip_us: us,
            ip_wrong: wrong,
        };
        ctx.measured(rep.rows.len(), &row);
        rep.rows.push(row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_between_nodes_take_turns_whatever_the_ranks_per_node() {
        let h = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        // One rank a node: every other link; the last of an odd count a turn of its own.
        assert_eq!(
            link_phases(&h(&["a", "b", "c", "d"])),
            (2, vec![0, 1, 0, 1])
        );
        assert_eq!(link_phases(&h(&["a", "b", "c"])), (3, vec![0, 1, 2]));
        // Two ranks a node, three nodes: the links between nodes (1, 3, 5) take turns.
        let (p, of) = link_phases(&h(&["a", "a", "b", "b", "c", "c"]));
        assert_eq!((p, [of[1], of[3], of[5]]), (3, [0, 1, 2]));
        let (p, of) = link_phases(&h(&["a", "a", "b", "b"]));
        assert_eq!((p, [of[1], of[3]]), (2, [0, 1]));
    }

    #[test]
    fn a_slow_link_leaves_out_the_sizes_it_would_take_seconds_on() {
        let sizes: Vec<u64> = (0..11).map(|k| 8u64 << (2 * k)).collect();
        // 20 Mbit/s into rank 0, 6 runs a size, 3 ranks: 512 KiB takes 1.7 s, 2 MiB 6.7 s.
        let (kept, note) = sizes_within_budget(sizes.clone(), 6, 3, Some((0, 0.0025)));
        assert_eq!(kept.last(), Some(&(512 << 10)), "{kept:?}");
        assert!(note.is_some_and(|n| n.contains("into rank 0")));
        // A healthy veth ring keeps every size.
        let (kept, note) = sizes_within_budget(sizes.clone(), 6, 3, Some((1, 1.5)));
        assert_eq!((kept, note), (sizes.clone(), None));
        // A link that carried nothing keeps the first size only.
        let (kept, _) = sizes_within_budget(sizes, 6, 3, Some((2, 0.0)));
        assert_eq!(kept, vec![8]);
    }

    #[test]
    fn ring_chunks_cover_everything_once() {
        for count in [1, 2, 7, 13, 100] {
            for n in 1..6 {
                let mut seen = vec![0; count];
                for i in 0..n {
                    for j in Ring::chunk(count, n, i) {
                        seen[j] += 1;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "count {count} n {n}");
            }
        }
    }

    #[test]
    fn the_pattern_detects_a_missing_rank() {
        let exp = expected(4);
        let good: Vec<f32> = (0..100)
            .map(|i| (0..4).map(|r| pattern(r, i)).sum())
            .collect();
        assert_eq!(count_wrong(&good, &exp), 0);
        let missing: Vec<f32> = (0..100)
            .map(|i| (0..3).map(|r| pattern(r, i)).sum())
            .collect();
        assert_eq!(count_wrong(&missing, &exp), 100);
    }
}
