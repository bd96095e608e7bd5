//! libnccl by explicit path, and finding which libnccl a job would load.
//!
//! A preflight that loads another NCCL than the job proves little, and loaders that dlopen fixed
//! names ("libnccl.so") silently pick the system's copy over the one PyTorch bundles. So nrun
//! resolves a path first ([`candidates`], in the order the job's loader would look; the
//! launcher picks one and hands it to the ranks as `Settings::nccl_lib`) and opens exactly
//! that file. The 9 functions used are bound by hand: NCCL's C API is small and stable, and
//! this keeps nrun free of CUDA headers.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use libloading::Library;

pub(crate) type NcclResult = c_int;
pub(crate) const NCCL_SUCCESS: NcclResult = 0;
pub(crate) const NCCL_IN_PROGRESS: NcclResult = 7;
pub(crate) const NCCL_FLOAT32: c_int = 7;
pub(crate) const NCCL_SUM: c_int = 0;

/// An `ncclComm_t` made by [`Nccl::init_nonblocking`] or [`Nccl::split_blocking`]; only
/// those make one, so the functions taking it never see a stray pointer.
#[derive(Clone, Copy, Debug)]
pub struct Comm(*mut c_void);

impl Comm {
    fn null() -> Comm {
        Comm(std::ptr::null_mut())
    }
}

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

/// `ncclConfig_t` as of NCCL 2.18 (fields up to `splitShare`). NCCL reads `size` and `version`
/// and fills later fields with defaults, so this layout works with every newer library.
#[repr(C)]
pub struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

const CONFIG_UNDEF_INT: c_int = c_int::MIN;

impl Config {
    /// NCCL_CONFIG_INITIALIZER with `blocking` set as given.
    pub fn new(blocking: bool) -> Config {
        Config::with(blocking, CONFIG_UNDEF_INT)
    }

    fn with(blocking: bool, split_share: c_int) -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 21800,
            blocking: blocking as c_int,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share,
        }
    }
}

type FnGetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type FnGetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type RawComm = *mut c_void;
type FnInitRankConfig =
    unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut Config) -> NcclResult;
type FnGetAsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
type FnComm = unsafe extern "C" fn(RawComm) -> NcclResult;
type FnCommSplit =
    unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut Config) -> NcclResult;
type FnGetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type FnGetLastError = unsafe extern "C" fn(RawComm) -> *const c_char;
type FnAllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    *mut c_void,
) -> NcclResult;

/// The NCCL functions nrun calls, bound from one library file.
pub struct Nccl {
    pub path: PathBuf,
    pub version: NcclVersion,
    get_unique_id: FnGetUniqueId,
    init_rank_config: FnInitRankConfig,
    get_async_error: FnGetAsyncError,
    comm_abort: FnComm,
    get_error_string: FnGetErrorString,
    get_last_error: Option<FnGetLastError>,
    comm_split: Option<FnCommSplit>,
    all_reduce: FnAllReduce,
    // Keeps the function pointers above valid.
    _lib: Library,
}

/// A decoded `ncclGetVersion` code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl NcclVersion {
    /// Since 2.9 the code is major*10000 + minor*100 + patch; before, major*1000 + minor*100 +
    /// patch (so 2.8.4 is 2804 and 2.9.6 is 20906).
    pub(crate) fn from_code(code: i32) -> NcclVersion {
        let c = code.max(0) as u32;
        if c >= 10000 {
            NcclVersion {
                major: c / 10000,
                minor: (c % 10000) / 100,
                patch: c % 100,
            }
        } else {
            NcclVersion {
                major: c / 1000,
                minor: (c % 1000) / 100,
                patch: c % 100,
            }
        }
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Why a library could not be used.
#[derive(Debug)]
pub struct LoadError(pub String);

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Nccl {
    /// Opens exactly `path` and binds the functions nrun needs.
    pub fn open(path: &Path) -> Result<Nccl, LoadError> {
        // SAFETY: loading a shared library runs its initialisers; libnccl's are benign, and
        // the path is what the user or the resolution below chose.
        let lib = unsafe { Library::new(path) }
            .map_err(|e| LoadError(format!("cannot load NCCL library {}: {e}", path.display())))?;
        macro_rules! sym {
            ($name:literal, $ty:ty) => {
                // SAFETY: the symbol has this C signature in every NCCL >= 2.14.
                *unsafe { lib.get::<$ty>($name) }.map_err(|e| {
                    LoadError(format!(
                        "{} is not a usable NCCL (>= 2.14) library: missing {}: {e}",
                        path.display(),
                        String::from_utf8_lossy(&$name[..$name.len() - 1])
                    ))
                })?
            };
        }
        let get_version: FnGetVersion = sym!(b"ncclGetVersion\0", FnGetVersion);
        let mut code = 0;
        // SAFETY: writes one int.
        unsafe { get_version(&mut code) };
        let nccl = Nccl {
            path: path.to_path_buf(),
            version: NcclVersion::from_code(code),
            get_unique_id: sym!(b"ncclGetUniqueId\0", FnGetUniqueId),
            init_rank_config: sym!(b"ncclCommInitRankConfig\0", FnInitRankConfig),
            get_async_error: sym!(b"ncclCommGetAsyncError\0", FnGetAsyncError),
            comm_abort: sym!(b"ncclCommAbort\0", FnComm),
            get_error_string: sym!(b"ncclGetErrorString\0", FnGetErrorString),
            // ncclGetLastError arrived in 2.13; treat it as optional all the same.
            // SAFETY: where present, the symbol has this C signature.
            get_last_error: unsafe { lib.get::<FnGetLastError>(b"ncclGetLastError\0") }
                .ok()
                .map(|s| *s),
            // ncclCommSplit arrived in 2.18.
            // SAFETY: where present (>= 2.18), the symbol has this C signature.
            comm_split: unsafe { lib.get::<FnCommSplit>(b"ncclCommSplit\0") }
                .ok()
                .map(|s| *s),
            all_reduce: sym!(b"ncclAllReduce\0", FnAllReduce),
            _lib: lib,
        };
        Ok(nccl)
    }

    pub(crate) fn error_string(&self, r: NcclResult) -> String {
        // SAFETY: NCCL returns a static string for any code.
        let p = unsafe { (self.get_error_string)(r) };
        cstr(p).unwrap_or_else(|| format!("NCCL error {r}"))
    }

    /// NCCL's own description of the last error, of a communicator or (None) global.
    pub(crate) fn last_error(&self, comm: Option<Comm>) -> Option<String> {
        let f = self.get_last_error?;
        // SAFETY: returns a pointer to an internal, NUL-terminated buffer.
        cstr(unsafe { f(comm.unwrap_or_else(Comm::null).0) }).filter(|s| !s.is_empty())
    }

    pub fn unique_id(&self) -> Result<UniqueId, NcclResult> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte id.
        check(unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id)
    }

    /// Starts a non-blocking communicator init; poll [`Nccl::async_error`] until it is not
    /// IN_PROGRESS.
    pub(crate) fn init_nonblocking(
        &self,
        nranks: i32,
        id: UniqueId,
        rank: i32,
    ) -> (Comm, NcclResult) {
        let mut comm: RawComm = std::ptr::null_mut();
        let mut config = Config::new(false);
        // SAFETY: comm and config outlive the call; NCCL copies the config.
        let r = unsafe { (self.init_rank_config)(&mut comm, nranks, id, rank, &mut config) };
        (Comm(comm), r)
    }

    pub(crate) fn async_error(&self, comm: Comm) -> NcclResult {
        let mut state = NCCL_SUCCESS;
        // SAFETY: comm came from init; state is written.
        let r = unsafe { (self.get_async_error)(comm.0, &mut state) };
        if r != NCCL_SUCCESS { r } else { state }
    }

    /// A blocking child of `comm` over the same ranks, sharing its resources.
    ///
    /// Why: on a non-blocking communicator NCCL runs every collective's launch on a thread of
    /// its own (and returns IN_PROGRESS), tens of microseconds per call that small-message
    /// latency would show. Init stays non-blocking (for the deadline); timing uses this child.
    /// `None` when the library has no ncclCommSplit (< 2.18).
    pub(crate) fn split_blocking(
        &self,
        comm: Comm,
        rank: i32,
        deadline: std::time::Instant,
    ) -> Option<Result<Comm, NcclResult>> {
        let f = self.comm_split?;
        let mut child: RawComm = std::ptr::null_mut();
        let mut config = Config::with(true, 1);
        // SAFETY: comm is an initialised communicator; child and config outlive the call.
        let r = unsafe { f(comm.0, 0, rank, &mut child, &mut config) };
        if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
            return Some(Err(r));
        }
        // On a non-blocking parent the split finishes in the background: wait until the parent
        // is idle again and the child exists and is ready.
        loop {
            let parent = self.async_error(comm);
            if parent != NCCL_SUCCESS && parent != NCCL_IN_PROGRESS {
                return Some(Err(parent));
            }
            if parent == NCCL_SUCCESS && !child.is_null() {
                match self.async_error(Comm(child)) {
                    NCCL_SUCCESS => return Some(Ok(Comm(child))),
                    NCCL_IN_PROGRESS => {}
                    e => return Some(Err(e)),
                }
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Abandons a communicator that failed or hung.
    pub fn abort(&self, comm: Comm) {
        if !comm.0.is_null() {
            // SAFETY: comm came from init and is not used afterwards.
            unsafe { (self.comm_abort)(comm.0) };
        }
    }

    /// Enqueues a float32 sum all-reduce of `count` elements on `stream`.
    ///
    /// # Safety
    /// `send` and `recv` must be device buffers of at least `count` floats on the
    /// communicator's device, and `stream` a stream of that device.
    pub(crate) unsafe fn all_reduce_f32(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        comm: Comm,
        stream: *mut c_void,
    ) -> NcclResult {
        // SAFETY: the caller upholds the buffers' and stream's contract above; `comm` came
        // from init.
        unsafe {
            (self.all_reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                NCCL_FLOAT32,
                NCCL_SUM,
                comm.0,
                stream,
            )
        }
    }
}

fn check(r: NcclResult) -> Result<(), NcclResult> {
    if r == NCCL_SUCCESS { Ok(()) } else { Err(r) }
}

fn cstr(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: NCCL hands out NUL-terminated strings.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Where a candidate library was found, in resolution order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// --nccl-lib or NRUN_NCCL_LIB.
    Explicit,
    /// The NCCL the target Python's torch loads (nvidia/nccl/lib in its site-packages).
    Torch,
    LdLibraryPath,
    /// The system's (ldconfig's cache).
    System,
}

impl Source {
    pub fn describe(self) -> &'static str {
        match self {
            Source::Explicit => "--nccl-lib",
            Source::Torch => "torch's",
            Source::LdLibraryPath => "LD_LIBRARY_PATH",
            Source::System => "system",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Candidate {
    pub path: PathBuf,
    pub source: Source,
}

/// Every libnccl.so.2 nrun can see, best first: the explicit one, then the one the target
/// Python's torch would load (given its sys.path), then LD_LIBRARY_PATH, then (with `system`)
/// the system's.
pub fn candidates(
    explicit: Option<&Path>,
    python_paths: &[PathBuf],
    ld_library_path: Option<&str>,
    system: bool,
) -> Vec<Candidate> {
    let mut v: Vec<Candidate> = Vec::new();
    let mut push = |p: PathBuf, source: Source| {
        let real = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
        if !v
            .iter()
            .any(|c| std::fs::canonicalize(&c.path).unwrap_or_else(|_| c.path.clone()) == real)
        {
            v.push(Candidate { path: p, source });
        }
    };
    if let Some(p) = explicit {
        push(p.to_path_buf(), Source::Explicit);
    }
    for sp in python_paths {
        for rel in ["nvidia/nccl/lib/libnccl.so.2", "torch/lib/libnccl.so.2"] {
            let p = sp.join(rel);
            if p.is_file() {
                push(p, Source::Torch);
            }
        }
    }
    for dir in ld_library_path
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
    {
        let p = Path::new(dir).join("libnccl.so.2");
        if p.is_file() {
            push(p, Source::LdLibraryPath);
        }
    }
    if system {
        for p in system_libraries() {
            push(p, Source::System);
        }
    }
    v
}

/// libnccl.so.2 entries of the ldconfig cache, or the usual directories if ldconfig is absent.
fn system_libraries() -> Vec<PathBuf> {
    let from_cache = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let mut v: Vec<PathBuf> = from_cache
        .lines()
        .filter(|l| l.trim_start().starts_with("libnccl.so.2 "))
        .filter_map(|l| l.rsplit_once("=> ").map(|(_, p)| PathBuf::from(p.trim())))
        .collect();
    if v.is_empty() {
        for d in [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/local/lib",
            "/usr/lib",
        ] {
            let p = Path::new(d).join("libnccl.so.2");
            if p.is_file() {
                v.push(p);
            }
        }
    }
    v
}

/// Where the target Python keeps packages, for finding the NCCL its torch loads. The layout
/// of a venv or prefix (`<prefix>/lib/python3.X/site-packages`) is looked at first; only when
/// no libnccl is found there is the interpreter itself asked for its sys.path (tens of ms).
pub fn python_package_dirs(python: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    // Not canonicalized: a venv's python is a link into the base install, but its packages
    // live under the venv.
    if let Some(prefix) = python.parent().and_then(Path::parent) {
        for lib in ["lib", "lib64"] {
            if let Ok(rd) = std::fs::read_dir(prefix.join(lib)) {
                for e in rd.flatten() {
                    if e.file_name().to_string_lossy().starts_with("python3") {
                        dirs.push(e.path().join("site-packages"));
                        dirs.push(e.path().join("dist-packages"));
                    }
                }
            }
        }
    }
    let has_nccl = dirs.iter().any(|d| {
        d.join("nvidia/nccl/lib/libnccl.so.2").is_file()
            || d.join("torch/lib/libnccl.so.2").is_file()
    });
    if has_nccl {
        dirs
    } else {
        python_sys_path(python)
    }
}

/// The target Python's sys.path. One short probe of the interpreter.
pub(crate) fn python_sys_path(python: &Path) -> Vec<PathBuf> {
    std::process::Command::new(python)
        .args([
            "-c",
            "import sys; print('\\n'.join(p for p in sys.path if p))",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes() {
        assert_eq!(NcclVersion::from_code(22809).to_string(), "2.28.9");
        assert_eq!(NcclVersion::from_code(21903).to_string(), "2.19.3");
        assert_eq!(NcclVersion::from_code(20906).to_string(), "2.9.6");
        assert_eq!(NcclVersion::from_code(2804).to_string(), "2.8.4");
        assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
    }

    #[test]
    fn config_layout_is_nccl_2_18() {
        // size_t, 2 x uint, 4 x int, pointer, int (+ padding) on LP64.
        assert_eq!(std::mem::size_of::<Config>(), 48);
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        let e = Nccl::open(Path::new("/nonexistent/libnccl.so.2"))
            .err()
            .unwrap();
        assert!(
            e.0.contains("cannot load NCCL library /nonexistent/libnccl.so.2"),
            "{e}"
        );
        let e = Nccl::open(Path::new("/lib/x86_64-linux-gnu/libc.so.6"))
            .err()
            .unwrap();
        assert!(e.0.contains("not a usable NCCL"), "{e}");
    }
}
