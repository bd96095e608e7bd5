//! Files nrun writes where a person said (`--report`, `--report-html`, `nrun report -o`,
//! `--events`, `--metrics-file`, `--exclude-file`, bisect's `--write-hostfile`, the launcher's
//! `TORCHELASTIC_ERROR_FILE`): one opener for all, [`replace`] and [`append`], and one check
//! before a job starts, [`check`]; workers' log files, made fresh in nrun's private
//! directories: [`create_private`].
//!
//! The path is walked one name at a time (`openat`, never following a name by itself), so what
//! is judged is what is written:
//! - A symbolic link, anywhere in the chain (a link to a link, a directory on the way), is
//!   followed only if it belongs to this user or to root: the kernel's `protected_symlinks`
//!   rule applied to every link, whatever the directory, and with a directory's owner trusted
//!   only where that owner is this user or root (another user's directory is theirs to swap).
//!   Otherwise nothing is written and the error names the link and its owner.
//! - What is found at the end: a regular file is replaced (a temporary file beside it renamed
//!   over it) or appended to (a file of one name, not a hard link to a file elsewhere; in a
//!   directory others may write, only this user's or the directory owner's: the kernel's
//!   `protected_regular` rule); a FIFO or socket of this user's or root's, a terminal or
//!   /dev/null is written in place, as a shell's `>` would; any other device is refused.
//!   `/dev/stdout` and `/dev/fd/N` (links in /proc to nrun's own descriptors) are written in
//!   place, never truncated.
//! - Opened non-blocking (a FIFO nobody reads is an error, not a hang) and checked on the open
//!   descriptor. A write that must wait for a FIFO's reader waits only until a stop signal
//!   (SIGINT, SIGTERM, SIGHUP) comes, or for its patience ([`OutFile::patience`]: `--events`
//!   must not stall the job): the write fails then, said, and nrun goes on.
//! - Files nrun creates get mode 0600 (less what the umask takes), or [`set_mode`]'s
//!   (`--file-mode`): reports and events hold the whole command line.

use std::collections::VecDeque;
use std::ffi::{CStr, CString};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// The mode of files nrun creates, before the umask.
static MODE: AtomicU32 = AtomicU32::new(0o600);

/// Sets the mode of the files nrun creates from now on (`--file-mode`); the umask still
/// applies, as to any file made.
pub fn set_mode(mode: u32) {
    MODE.store(mode & 0o777, Ordering::Relaxed);
}

/// Stop signals caught since [`watch_stops`].
static STOPS: AtomicU32 = AtomicU32::new(0);

/// Counts SIGINT, SIGTERM and SIGHUP, so a write waiting for a reader ends on one. Called
/// where nrun takes those signals over (their default action, which would end a blocked
/// write, is gone from then on); once is enough.
pub fn watch_stops() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: the action only increments an atomic, which is async-signal-safe.
            let _ = unsafe {
                signal_hook_registry::register(sig, || {
                    STOPS.fetch_add(1, Ordering::Relaxed);
                })
            };
        }
    });
}

fn euid() -> u32 {
    crate::files::euid()
}

fn refuse(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, message)
}

fn cstring(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the path"))
}

fn check_fd(fd: libc::c_int) -> io::Result<OwnedFd> {
    match fd {
        -1 => Err(io::Error::last_os_error()),
        // SAFETY: a descriptor just returned by the kernel, owned by nobody else.
        fd => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
    }
}

fn open_at(dir: &OwnedFd, name: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: a valid descriptor and C string.
    check_fd(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    })
}

fn stat_fd(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: stat is plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a stat to fill.
    match unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } {
        0 => Ok(st),
        _ => Err(io::Error::last_os_error()),
    }
}

/// What is at `name` in `dir`, a link not followed; None if nothing.
fn stat_at(dir: &OwnedFd, name: &CStr) -> io::Result<Option<libc::stat>> {
    // SAFETY: as in stat_fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, C string and stat.
    let r = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    match r {
        0 => Ok(Some(st)),
        _ => match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::NotFound => Ok(None),
            e => Err(e),
        },
    }
}

fn is_type(st: &libc::stat, t: libc::mode_t) -> bool {
    st.st_mode & libc::S_IFMT == t
}

/// Whether `fd` is on /proc, whose links to descriptors (`/proc/self/fd/1`) the kernel
/// resolves itself: their text (`pipe:[123]`) names no path.
fn on_proc(fd: &OwnedFd) -> bool {
    // SAFETY: statfs is plain data; fstatfs fills it.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a statfs to fill.
    unsafe { libc::fstatfs(fd.as_raw_fd(), &mut s) == 0 && s.f_type == libc::PROC_SUPER_MAGIC }
}

/// The path's last name, resolved: its directory (held open) and its name there.
struct Resolved {
    dir: OwnedFd,
    name: CString,
    /// The path as walked, for messages.
    shown: PathBuf,
    /// What is there now (a link not followed): None if nothing.
    now: Option<libc::stat>,
    /// A link in /proc to a descriptor: opened through (the kernel resolves it).
    proc_link: bool,
}

/// The most links one path may go through (the kernel's own bound).
const MAX_LINKS: usize = 40;

/// Where a walk starts: "/" for an absolute path, else the working directory; held open.
fn open_root(absolute: bool) -> io::Result<OwnedFd> {
    let start: &CStr = if absolute { c"/" } else { c"." };
    // SAFETY: a valid C string.
    check_fd(unsafe {
        libc::open(
            start.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    })
}

/// A path's names, in order: empty names and "." left out (they name where the walk is).
fn names(path: &[u8]) -> Vec<Vec<u8>> {
    path.split(|&c| c == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .map(<[u8]>::to_vec)
        .collect()
}

/// The error for a path that names a directory, where nrun writes a file.
fn is_a_directory(p: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::IsADirectory,
        format!("{}: it is a directory", p.display()),
    )
}

/// Opens the symbolic link `name` in `dir` itself (held, so that its owner and its text are
/// read from what was opened) if it is this user's or root's; Err: it is another user's, who
/// may have planted it. `here` is the link as walked and `path` the path given, for the message.
fn open_trusted_link(
    dir: &OwnedFd,
    name: &CStr,
    here: &Path,
    path: &Path,
) -> io::Result<(OwnedFd, libc::stat)> {
    let link = open_at(dir, name, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
    let st = stat_fd(&link)?;
    let me = euid();
    if st.st_uid != me && st.st_uid != 0 {
        return Err(refuse(format!(
            "refusing to follow the symbolic link {} (in the path {}): it belongs to uid {}, \
             neither this user ({me}) nor root, so another user may have planted it; nrun \
             writes nothing where it points. Remove it, or give the path you mean",
            here.display(),
            path.display(),
            st.st_uid
        )));
    }
    Ok((link, st))
}

/// The text of the symbolic link open at `link` (by [`open_trusted_link`]).
fn read_link(link: &OwnedFd) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: a valid descriptor, an empty name (the link itself) and a buffer of its size.
    let n = unsafe {
        libc::readlinkat(
            link.as_raw_fd(),
            c"".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// Walks `path` a name at a time, following only trusted links (see the module's doc).
fn resolve(path: &Path) -> io::Result<Resolved> {
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "no path given"));
    }
    let mut dir = open_root(bytes[0] == b'/')?;
    let mut shown = PathBuf::from(if bytes[0] == b'/' { "/" } else { "" });
    // The names still to walk: a link's text goes in front of the rest.
    let mut todo: VecDeque<Vec<u8>> = names(bytes).into();
    let mut links = 0;
    loop {
        let Some(c) = todo.pop_front() else {
            return Err(is_a_directory(if shown.as_os_str().is_empty() {
                Path::new(".")
            } else {
                &shown
            }));
        };
        let name = cstring(&c)?;
        let here = shown.join(std::ffi::OsStr::from_bytes(&c));
        let last = todo.is_empty();
        if c == b".." {
            dir = open_at(&dir, &name, libc::O_PATH | libc::O_DIRECTORY, 0)?;
            shown = here;
            continue;
        }
        let Some(st) = stat_at(&dir, &name)? else {
            if last {
                return Ok(Resolved {
                    dir,
                    name,
                    shown: here,
                    now: None,
                    proc_link: false,
                });
            }
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no directory {}", here.display()),
            ));
        };
        if !is_type(&st, libc::S_IFLNK) {
            if last {
                return Ok(Resolved {
                    dir,
                    name,
                    shown: here,
                    now: Some(st),
                    proc_link: false,
                });
            }
            // O_NOFOLLOW: a link swapped in since is an error, never followed.
            dir = open_at(
                &dir,
                &name,
                libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                0,
            )?;
            shown = here;
            continue;
        }
        links += 1;
        if links > MAX_LINKS {
            return Err(io::Error::other(format!(
                "{}: more than {MAX_LINKS} symbolic links (a loop?)",
                path.display()
            )));
        }
        let (link, ls) = open_trusted_link(&dir, &name, &here, path)?;
        if !is_type(&ls, libc::S_IFLNK) {
            // Swapped since the look: walk it again.
            todo.push_front(c);
            continue;
        }
        if last && on_proc(&dir) {
            return Ok(Resolved {
                dir,
                name,
                shown: here,
                now: Some(ls),
                proc_link: true,
            });
        }
        let target = read_link(&link)?;
        if target.first() == Some(&b'/') {
            dir = open_root(true)?;
            shown = PathBuf::from("/");
        }
        for part in names(&target).into_iter().rev() {
            todo.push_front(part);
        }
        if todo.is_empty() {
            // A link to "/" or ".": a directory.
            return Err(is_a_directory(&here));
        }
    }
}

/// How a file at the end of the path is written.
#[derive(Clone, Copy, PartialEq)]
enum How {
    Replace,
    Append,
}

/// What kind of special file `st` is, if nrun writes into it in place; Err: why not.
fn special_ok(st: &libc::stat, shown: &Path, proc_link: bool) -> io::Result<()> {
    let me = euid();
    let owner_ok = proc_link || st.st_uid == me || st.st_uid == 0;
    let t = st.st_mode & libc::S_IFMT;
    let what = match t {
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a device",
        libc::S_IFBLK => "a block device",
        _ => "not a regular file",
    };
    if t == libc::S_IFDIR {
        return Err(is_a_directory(shown));
    }
    if t == libc::S_IFBLK {
        return Err(refuse(format!(
            "{} is {what}: nrun writes only files, FIFOs, terminals and /dev/null",
            shown.display()
        )));
    }
    if !owner_ok {
        return Err(refuse(format!(
            "refusing to write {}: it is {what} of uid {}, neither this user ({me}) nor root, \
             so another user may have planted it; remove it or choose another path",
            shown.display(),
            st.st_uid
        )));
    }
    Ok(())
}

/// Whether the character device open at `fd` is one nrun writes to: a terminal or /dev/null.
fn device_ok(fd: &OwnedFd, st: &libc::stat, shown: &Path) -> io::Result<()> {
    // SAFETY: a plain query on a valid descriptor.
    let tty = unsafe { libc::isatty(fd.as_raw_fd()) } == 1;
    let null = libc::major(st.st_rdev) == 1 && libc::minor(st.st_rdev) == 3;
    match tty || null {
        true => Ok(()),
        false => Err(refuse(format!(
            "{} is a device other than a terminal or /dev/null: nrun does not write there",
            shown.display()
        ))),
    }
}

/// A file nrun writes, opened by [`append`] (or in place by [`replace`]): writes to a FIFO
/// whose reader is slow wait, until a stop signal comes.
#[derive(Debug)]
pub struct OutFile {
    file: std::fs::File,
    path: PathBuf,
    /// How long one write may wait for a reader; None: until a stop signal.
    patience: Option<std::time::Duration>,
}

impl OutFile {
    /// Gives up a write that waited `d` for the reader (an error that says so): for a file
    /// written while the job runs (`--events`), whose writer must not stall the job.
    pub fn patience(mut self, d: std::time::Duration) -> OutFile {
        self.patience = Some(d);
        self
    }

    /// Waits until `fd` takes bytes again; Err once a stop signal came since `seen`, or the
    /// write began longer ago than its patience.
    fn wait(&self, seen: u32, began: std::time::Instant) -> io::Result<()> {
        if let Some(d) = self.patience
            && began.elapsed() >= d
        {
            return Err(io::Error::other(format!(
                "its reader took nothing for {} s",
                d.as_secs_f64()
            )));
        }
        if STOPS.load(Ordering::Relaxed) != seen {
            return Err(io::Error::other(format!(
                "a stop signal came while nrun waited for the reader of {} (the rest is not \
                 written)",
                self.path.display()
            )));
        }
        let mut p = libc::pollfd {
            fd: self.file.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd. A short timeout: the signal's count is looked at again.
        unsafe { libc::poll(&mut p, 1, 100) };
        Ok(())
    }
}

impl Write for OutFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let (seen, began) = (STOPS.load(Ordering::Relaxed), std::time::Instant::now());
        loop {
            match (&self.file).write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(seen, began)?,
                r => return r,
            }
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Opens what `r` names for writing in place (append, or a special file), judged on the
/// open descriptor.
fn open_in_place(r: &Resolved, how: How) -> io::Result<OutFile> {
    let mut flags = libc::O_WRONLY | libc::O_NONBLOCK | libc::O_NOCTTY;
    if !r.proc_link {
        flags |= libc::O_NOFOLLOW;
    }
    if how == How::Append {
        flags |= libc::O_APPEND;
        if r.now.is_none() {
            flags |= libc::O_CREAT;
        }
    }
    let fd = open_at(&r.dir, &r.name, flags, MODE.load(Ordering::Relaxed)).map_err(|e| match e
        .raw_os_error()
    {
        Some(libc::ENXIO) => io::Error::new(
            e.kind(),
            format!(
                "{} is a FIFO (or socket) nobody reads: start its reader first",
                r.shown.display()
            ),
        ),
        Some(libc::ELOOP) => refuse(format!(
            "{} became a symbolic link while nrun opened it; nothing written",
            r.shown.display()
        )),
        _ => io::Error::new(e.kind(), format!("{}: {e}", r.shown.display())),
    })?;
    let st = stat_fd(&fd)?;
    if is_type(&st, libc::S_IFREG) {
        if how == How::Append && !r.proc_link {
            append_ok(&st, &r.dir, &r.shown)?;
        }
    } else {
        special_ok(&st, &r.shown, r.proc_link)?;
        if is_type(&st, libc::S_IFCHR) {
            device_ok(&fd, &st, &r.shown)?;
        }
    }
    Ok(OutFile {
        file: std::fs::File::from(fd),
        path: r.shown.clone(),
        patience: None,
    })
}

/// Whether the regular file `st` in `dir` may be appended to: a file of one name (not a hard
/// link to a file elsewhere) and, where others may write the directory, this user's or the
/// directory owner's (the kernel's `protected_regular` rule, for any such directory).
fn append_ok(st: &libc::stat, dir: &OwnedFd, shown: &Path) -> io::Result<()> {
    let me = euid();
    if st.st_nlink > 1 {
        return Err(refuse(format!(
            "refusing to append to {}: it has {} names (hard links), so it may be a file \
             elsewhere; give a file of one name",
            shown.display(),
            st.st_nlink
        )));
    }
    let d = stat_fd(dir)?;
    let shared = d.st_mode & 0o022 != 0;
    if st.st_uid != me && st.st_uid != d.st_uid && shared {
        return Err(refuse(format!(
            "refusing to append to {}: it belongs to uid {}, neither this user ({me}) nor its \
             directory's owner, in a directory others may write; was it planted by another \
             user? Remove it or choose another path",
            shown.display(),
            st.st_uid
        )));
    }
    Ok(())
}

/// Opens `path` for appending, created (mode: [`set_mode`]'s) if missing: see the module's
/// doc for what is followed and what is refused.
pub fn append(path: &Path) -> io::Result<OutFile> {
    let r = resolve(path)?;
    if let Some(st) = &r.now
        && !r.proc_link
    {
        if is_type(st, libc::S_IFREG) {
            append_ok(st, &r.dir, &r.shown)?;
        } else {
            special_ok(st, &r.shown, false)?;
        }
    }
    open_in_place(&r, How::Append)
}

/// Replaces `path` with `bytes` at once: written to a new temporary file beside it (a dot name,
/// which readers such as the textfile collector skip), then renamed over it: a reader sees the
/// old file or the new one, never part. Each call has a name of its own (pid and random bits),
/// so two writers of one path cannot cut each other's file. A special file is written in
/// place. See the module's doc for what is followed and what is refused.
pub fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let r = resolve(path)?;
    match &r.now {
        Some(st) if r.proc_link || !is_type(st, libc::S_IFREG) => {
            if !r.proc_link {
                special_ok(st, &r.shown, false)?;
            }
            return open_in_place(&r, How::Replace)?.write_all(bytes);
        }
        _ => {}
    }
    let mut salt = [0u8; 6];
    crate::random_bytes(&mut salt)?;
    let tmp = cstring(
        format!(
            ".{}.{}.{}.tmp",
            String::from_utf8_lossy(r.name.as_bytes()),
            std::process::id(),
            crate::hex(&salt)
        )
        .as_bytes(),
    )?;
    let fd = open_at(
        &r.dir,
        &tmp,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
        MODE.load(Ordering::Relaxed),
    )
    .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", r.shown.display())))?;
    // From here the temporary file is this call's own: removed if the rest fails.
    let done = std::fs::File::from(fd).write_all(bytes).and_then(|()| {
        // SAFETY: valid descriptors and C strings.
        match unsafe {
            libc::renameat(
                r.dir.as_raw_fd(),
                tmp.as_ptr(),
                r.dir.as_raw_fd(),
                r.name.as_ptr(),
            )
        } {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    });
    if done.is_err() {
        // SAFETY: valid descriptor and C string.
        unsafe { libc::unlinkat(r.dir.as_raw_fd(), tmp.as_ptr(), 0) };
    }
    done
}

/// Creates the file `path` for writing, fresh (never one that exists, never through a
/// symlink), mode 0600.
pub fn create_private(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            io::ErrorKind::AlreadyExists => io::Error::new(
                e.kind(),
                format!(
                    "refusing to write {}: it exists already (nrun makes its files fresh); was it \
                 planted by another user? Remove it or choose another directory",
                    path.display()
                ),
            ),
            _ => io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display())),
        })
}

/// Whether `path` can be written as [`replace`] (`append` false) or [`append`] would, checked
/// without creating or opening anything: the links it goes through, what is there, and that
/// its directory is writable (or the file, where written in place). Err: why not.
pub fn check(path: &Path, append: bool) -> io::Result<()> {
    let r = resolve(path)?;
    let access = |name: &CStr, mode: i32| {
        // SAFETY: a valid descriptor and C string.
        match unsafe { libc::faccessat(r.dir.as_raw_fd(), name.as_ptr(), mode, 0) } {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    };
    let dir_w = || {
        let shown = r.shown.parent().unwrap_or(Path::new("."));
        access(c".", libc::W_OK | libc::X_OK)
            .map_err(|e| io::Error::new(e.kind(), format!("directory {}: {e}", shown.display())))
    };
    match &r.now {
        None => dir_w(),
        Some(_) if r.proc_link => Ok(()),
        Some(st) if is_type(st, libc::S_IFREG) => {
            if append {
                append_ok(st, &r.dir, &r.shown)?;
                access(&r.name, libc::W_OK)
            } else {
                dir_w()
            }
        }
        Some(st) => {
            special_ok(st, &r.shown, false)?;
            access(&r.name, libc::W_OK)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

    /// A file replaced holds the new bytes whole, leaves no temporary beside it, and a
    /// reader's open copy of the old one is not cut (the rename swaps whole files).
    #[test]
    fn replace_swaps_whole_files_and_leaves_nothing_beside() {
        let top = tempfile::tempdir().unwrap();
        let p = top.path().join("m.prom");
        replace(&p, b"old\n").unwrap();
        let mut held = std::fs::File::open(&p).unwrap();
        replace(&p, b"new\n").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new\n");
        let mut old = String::new();
        held.read_to_string(&mut old).unwrap();
        assert_eq!(old, "old\n");
        let names: Vec<_> = std::fs::read_dir(top.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["m.prom"]);
        // No directory: the error names it, and nothing is left.
        let gone = top.path().join("no").join("m.prom");
        let e = replace(&gone, b"x").unwrap_err().to_string();
        assert!(e.contains("no directory"), "{e}");
        // Made 0600, or the mode asked for (the umask aside).
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
    }

    /// A link of this user's at the path is followed: its file gets the bytes, the link stays
    /// (a dangling one makes its file); a special file is written to, never renamed over
    /// (`--report /dev/null` as root must not put a regular file in /dev/null's place).
    #[test]
    fn replace_follows_own_links_and_writes_into_special_files() {
        let top = tempfile::tempdir().unwrap();
        let run = top.path().join("run42.html");
        std::fs::write(&run, "old").unwrap();
        let latest = top.path().join("latest.html");
        symlink("run42.html", &latest).unwrap();
        replace(&latest, b"new").unwrap();
        assert!(
            std::fs::symlink_metadata(&latest)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read(&run).unwrap(), b"new");
        let dangling = top.path().join("next.html");
        symlink("run43.html", &dangling).unwrap();
        replace(&dangling, b"43").unwrap();
        assert_eq!(std::fs::read(top.path().join("run43.html")).unwrap(), b"43");
        // A directory on the way through a link, and `..`.
        let sub = top.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        symlink("sub", top.path().join("via")).unwrap();
        replace(&top.path().join("via/../via/x"), b"x").unwrap();
        assert_eq!(std::fs::read(sub.join("x")).unwrap(), b"x");
        let looped = top.path().join("loop");
        symlink("loop", &looped).unwrap();
        assert!(replace(&looped, b"x").is_err());
        replace(Path::new("/dev/null"), b"nothing").unwrap();
        let null = std::fs::metadata("/dev/null").unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_char_device(
            &null.file_type()
        ));
        let to_null = top.path().join("to-null");
        symlink("/dev/null", &to_null).unwrap();
        replace(&to_null, b"nothing").unwrap();
        // Other devices are refused; /dev/stdout (a /proc link to a descriptor) is written.
        let e = replace(Path::new("/dev/zero"), b"x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("other than a terminal"), "{e}");
        replace(Path::new("/dev/stdout"), b"").unwrap();
        assert!(check(Path::new("/dev/stdout"), false).is_ok());
        assert!(check(top.path(), false).is_err());
    }

    /// Another user's link is followed nowhere in a chain; a FIFO nobody reads is an error,
    /// not a hang; appends go only to this user's files of one name.
    #[test]
    fn others_links_fifos_and_hard_links_are_refused() {
        let top = tempfile::tempdir().unwrap();
        let target = top.path().join("target");
        std::fs::write(&target, "keep").unwrap();
        if euid() == 0 {
            // Root's own link to another user's link to the target.
            let theirs = top.path().join("run43");
            symlink(&target, &theirs).unwrap();
            std::os::unix::fs::lchown(&theirs, Some(65534), Some(65534)).unwrap();
            let latest = top.path().join("latest");
            symlink("run43", &latest).unwrap();
            for p in [&theirs, &latest] {
                let e = replace(p, b"x").unwrap_err().to_string();
                assert!(e.contains("run43") && e.contains("uid 65534"), "{e}");
                assert!(append(p).is_err());
                assert!(check(p, true).is_err() && check(p, false).is_err());
            }
            // A directory on the way that is another user's link.
            let e = replace(&theirs.join("x"), b"x").unwrap_err().to_string();
            assert!(e.contains("uid 65534"), "{e}");
            // Another user's file in a directory others may write is not appended to (in
            // one of this user's alone, it is theirs to give).
            let shared = top.path().join("shared");
            std::fs::create_dir(&shared).unwrap();
            let f = shared.join("their-events");
            std::fs::write(&f, "").unwrap();
            std::os::unix::fs::chown(&f, Some(65534), Some(65534)).unwrap();
            append(&f).unwrap();
            std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
            assert!(append(&f).unwrap_err().to_string().contains("uid 65534"));
            assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        }
        let fifo = top.path().join("fifo");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a plain syscall on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = append(&fifo).unwrap_err().to_string();
        assert!(e.contains("nobody reads"), "{e}");
        assert!(replace(&fifo, b"x").is_err());
        // With a reader: written in place.
        let mut reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        append(&fifo).unwrap().write_all(b"line\n").unwrap();
        let mut got = [0u8; 5];
        reader.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"line\n");
        // A reader that takes nothing: a write with patience gives up, saying so.
        let mut w = append(&fifo)
            .unwrap()
            .patience(std::time::Duration::from_millis(50));
        let e = loop {
            if let Err(e) = w.write_all(&[b'x'; 4096]) {
                break e.to_string();
            }
        };
        assert!(e.contains("took nothing"), "{e}");
        let linked = top.path().join("linked");
        std::fs::hard_link(&target, &linked).unwrap();
        let e = append(&linked).unwrap_err().to_string();
        assert!(e.contains("2 names"), "{e}");
        // Appended to: made 0600, then added to.
        let ev = top.path().join("ev");
        append(&ev).unwrap().write_all(b"a\n").unwrap();
        append(&ev).unwrap().write_all(b"b\n").unwrap();
        assert_eq!(std::fs::read(&ev).unwrap(), b"a\nb\n");
        assert_eq!(std::fs::metadata(&ev).unwrap().mode() & 0o777, 0o600);
    }

    use std::os::unix::fs::OpenOptionsExt;
}
