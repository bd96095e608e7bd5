//! Files on a host other users share: nrun's private directories and its reads.
//!
//! - [`make_private_dir`]: a fresh directory of a random name (mkdtemp's way: `mkdir` refuses an
//!   existing name, another is drawn), mode 0700, then checked ([`check_private_dir`]): another
//!   user can neither plant a directory nrun would use nor read what nrun writes there.
//! - [`scratch`]: this process's own scratch directory, `$TMPDIR/nrun-<pid>-<random>` (workers'
//!   error files, the flight recorder's pipes and dumps, the preflight's NCCL log); the pid says
//!   whose it is, so [`sweep_scratch`] removes those of nruns that are gone, and only those.
//! - [`read_bounded`]: the one way nrun reads a file a person or another program names
//!   (hostfiles, `.nrun_env`, exclude files, error files, dumps): a regular file only, opened
//!   without blocking and judged by what was opened, at most a given size.
//! - [`read_own`]: a file a worker wrote, trusted only if this user owns it and nobody else may
//!   write it (opened without following a symlink, checked on the open file).
//!
//! The files nrun writes where a person said are [`crate::outputs`]'s.

use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The user nrun runs as.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Random characters in a private directory's name (hex: 40 bits).
const RANDOM_CHARS: usize = 10;

/// Creates `<parent>/<prefix><random>`, fresh (never one that exists), mode 0700, and checks
/// it once made.
pub(crate) fn make_private_dir(parent: &Path, prefix: &str) -> io::Result<PathBuf> {
    for _ in 0..100 {
        let r = crate::random_hex().map_err(|e| {
            with(
                &e,
                format!("cannot read random bytes for a directory's name: {e}"),
            )
        })?;
        let dir = parent.join(format!("{prefix}{}", &r[..RANDOM_CHARS]));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                // The umask may have taken more than group's and others' bits.
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
                check_private_dir(&dir)?;
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(with(
                    &e,
                    format!(
                        "cannot create a private directory in {}: {e}; check that it exists and \
                         that this user may write there (TMPDIR)",
                        parent.display()
                    ),
                ));
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!(
            "cannot create a private directory in {}: 100 random names were all taken",
            parent.display()
        ),
    ))
}

/// Whether `dir` is a directory (not a symlink to one) of this user that no other may use.
pub(crate) fn check_private_dir(dir: &Path) -> io::Result<()> {
    let refuse = |why: String| {
        Err(denied(format!(
            "refusing directory {}: {why}; nrun keeps its files only in directories of its own \
             (made fresh, mode 0700). Was it made by another user? Remove it or choose another path",
            dir.display()
        )))
    };
    let m =
        std::fs::symlink_metadata(dir).map_err(|e| with(&e, format!("{}: {e}", dir.display())))?;
    if m.file_type().is_symlink() {
        return refuse("it is a symbolic link".into());
    }
    if !m.is_dir() {
        return refuse("it is not a directory".into());
    }
    if m.uid() != euid() {
        return refuse(format!("it belongs to uid {}, not to {}", m.uid(), euid()));
    }
    if m.mode() & 0o077 != 0 {
        return refuse(format!(
            "its mode is {:04o}: other users may use it",
            m.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Whether files nrun makes in `dir` (an existing directory a person named) are safe from
/// other users: `dir` is this user's or root's, and others may not write it unless it is sticky
/// (as /tmp: nobody may then rename or remove what is not theirs). A missing `dir` passes: nrun
/// makes it, 0700.
pub fn check_parent_dir(dir: &Path) -> io::Result<()> {
    let Ok(m) = std::fs::metadata(dir) else {
        return Ok(());
    };
    let refuse = |why: String| {
        Err(denied(format!(
            "refusing directory {}: {why}, so another user could swap what nrun writes there; \
             choose a directory of your own",
            dir.display()
        )))
    };
    if m.uid() != euid() && m.uid() != 0 {
        return refuse(format!("it belongs to uid {}", m.uid()));
    }
    if m.mode() & 0o002 != 0 && m.mode() & 0o1000 == 0 {
        return refuse(format!(
            "its mode is {:04o}: every user may write it (and it is not sticky)",
            m.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Creates `dir` and its missing parents with mode 0700 (those that exist stay as they are),
/// then checks `dir` itself is private ([`check_private_dir`]).
pub fn make_private_dirs(dir: &Path) -> io::Result<()> {
    if std::fs::symlink_metadata(dir).is_err() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| {
                with(
                    &e,
                    format!("cannot create directory {}: {e}", dir.display()),
                )
            })?;
    }
    check_private_dir(dir)
}

/// A refusal of nrun's own (a directory or file another user could use), as an I/O error whose
/// message says what and what to do.
fn denied(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, message)
}

/// `e`'s kind, with a message that says what nrun was doing.
fn with(e: &io::Error, message: String) -> io::Error {
    io::Error::new(e.kind(), message)
}

/// Why a file was not read ([`read_bounded`]).
#[derive(Debug)]
pub enum ReadError {
    Missing,
    Io(std::io::Error),
    /// What it is instead of a regular file.
    NotRegular(&'static str),
    TooBig(u64),
    /// Refused by [`read_own`]: whose it is or who may write it.
    NotOwn(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Missing => write!(f, "no such file"),
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::NotRegular(what) => write!(f, "is {what}"),
            ReadError::TooBig(max) => write!(f, "is larger than {}", size_text(*max)),
            ReadError::NotOwn(why) => write!(f, "{why}"),
        }
    }
}

fn size_text(b: u64) -> String {
    match b {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}

fn kind_of(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (a pipe, as <(...) gives: a writer that never ends would hang nrun)"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading without blocking (a FIFO's open would wait for a writer); `flags`
/// are added.
fn open_nonblocking(path: &Path, flags: i32) -> Result<std::fs::File, ReadError> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | flags)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ReadError::Missing,
            _ if e.raw_os_error() == Some(libc::ELOOP) => ReadError::NotRegular("a symbolic link"),
            _ => ReadError::Io(e),
        })
}

/// The bytes of `file`, a regular file (checked on what was opened, not on a name that could
/// change in between) of at most `max` bytes.
fn read_open(file: std::fs::File, max: u64) -> Result<Vec<u8>, ReadError> {
    let meta = file.metadata().map_err(ReadError::Io)?;
    if !meta.is_file() {
        return Err(ReadError::NotRegular(kind_of(&meta)));
    }
    if meta.len() > max {
        return Err(ReadError::TooBig(max));
    }
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(ReadError::Io)?;
    if bytes.len() as u64 > max {
        return Err(ReadError::TooBig(max));
    }
    Ok(bytes)
}

/// The bytes of the regular file `path` (a symlink to one is followed), at most `max`: never
/// a device such as /dev/zero, a FIFO, socket or directory, which could block or never end.
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    read_open(open_nonblocking(path, 0)?, max)
}

/// [`read_checked`] as UTF-8 text; the error says where the first bad byte is.
pub fn read_text(path: &Path, max: u64, writer: Writer) -> Result<String, ReadError> {
    String::from_utf8(read_checked(path, max, writer)?).map_err(|e| {
        ReadError::NotOwn(format!(
            "is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Who may have written a file nrun reads ([`read_checked`]).
#[derive(Clone, Copy, PartialEq)]
pub enum Writer {
    /// Anyone: data whose worst is a wrong value (hostfiles, exclude files).
    Anyone,
    /// This user or root, nobody else (not a file group or others may write): what sets a
    /// job's environment (`.nrun_env`), where another user's file would run code as this one.
    Trusted,
    /// A process of this user only, and never through a symlink: a flight recorder's dump, an
    /// NCCL log, in nrun's own private directory.
    Own,
}

/// The bytes of `path` (see [`read_bounded`]), refused unless `writer` may have written it;
/// everything is judged on the open file.
pub(crate) fn read_checked(path: &Path, max: u64, writer: Writer) -> Result<Vec<u8>, ReadError> {
    let flags = match writer {
        Writer::Own => libc::O_NOFOLLOW,
        _ => 0,
    };
    let file = open_nonblocking(path, flags)?;
    let meta = file.metadata().map_err(ReadError::Io)?;
    let owners: &[u32] = match writer {
        Writer::Anyone => return read_open(file, max),
        Writer::Trusted => &[euid(), 0],
        Writer::Own => &[euid()],
    };
    if !owners.contains(&meta.uid()) {
        return Err(ReadError::NotOwn(format!(
            "belongs to uid {}, not to this user ({}); was it planted by another user?",
            meta.uid(),
            euid()
        )));
    }
    if meta.is_file() && meta.mode() & 0o022 != 0 {
        return Err(ReadError::NotOwn(format!(
            "its mode is {:04o}: other users may write it (chmod go-w)",
            meta.mode() & 0o7777
        )));
    }
    read_open(file, max)
}

/// [`read_checked`] for a file of this user's own processes ([`Writer::Own`]).
pub fn read_own(path: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    read_checked(path, max, Writer::Own)
}

/// Prefix of scratch directories' names; the pid of the nrun that made it follows.
const SCRATCH_PREFIX: &str = "nrun-";

/// This process's scratch directory, once made (and until removed).
static SCRATCH: Mutex<Option<PathBuf>> = Mutex::new(None);

/// This process's scratch directory, made on first use (see the module's doc); after
/// [`remove_scratch`], a new one (never the old name again).
pub fn scratch() -> io::Result<PathBuf> {
    let mut s = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = &*s {
        return Ok(d.clone());
    }
    let prefix = format!("{SCRATCH_PREFIX}{}-", std::process::id());
    let d = make_private_dir(&std::env::temp_dir(), &prefix)?;
    *s = Some(d.clone());
    Ok(d)
}

/// Removes this process's scratch directory, if it made one.
pub fn remove_scratch() {
    let mut s = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = s.take() {
        // std's remove_dir_all follows no symlink, at the top or below.
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The pid in a scratch directory's name, if `name` is exactly one ([`scratch`]'s form).
fn scratch_pid(name: &str) -> Option<u32> {
    let (pid, random) = name.strip_prefix(SCRATCH_PREFIX)?.split_once('-')?;
    let ok = random.len() == RANDOM_CHARS
        && random.bytes().all(|b| b.is_ascii_hexdigit())
        && !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit());
    ok.then(|| pid.parse().ok()).flatten()
}

/// Removes the scratch directories of nruns that are gone (killed with their keeper): only a
/// directory of exactly [`scratch`]'s name and mode (0700, not a symlink) that this user owns,
/// whose process no longer runs.
pub fn sweep_scratch() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(scratch_pid) else {
            continue;
        };
        // DirEntry::metadata does not follow a symlink.
        let ours = e.metadata().is_ok_and(|m| {
            m.file_type().is_dir() && m.uid() == euid() && m.mode() & 0o7777 == 0o700
        });
        if ours && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_dirs_are_fresh_0700_and_checked() {
        let top = tempfile::tempdir().unwrap();
        let a = make_private_dir(top.path(), "x-").unwrap();
        let b = make_private_dir(top.path(), "x-").unwrap();
        assert_ne!(a, b);
        let m = std::fs::metadata(&a).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o700);
        // Open to others, a symlink, a file: refused, named.
        let open = top.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_private_dir(&open).unwrap_err().to_string();
        assert!(
            e.contains(&open.display().to_string()) && e.contains("0777"),
            "{e}"
        );
        let link = top.path().join("link");
        std::os::unix::fs::symlink(&a, &link).unwrap();
        assert!(
            check_private_dir(&link)
                .unwrap_err()
                .to_string()
                .contains("symbolic link")
        );
        let f = a.join("f");
        let mut w = crate::outputs::create_private(&f).unwrap();
        std::io::Write::write_all(&mut w, b"hi").unwrap();
        assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o777, 0o600);
        // Never an existing file, never through a symlink.
        assert!(
            crate::outputs::create_private(&f)
                .unwrap_err()
                .to_string()
                .contains("exists already")
        );
        let l2 = a.join("l2");
        std::os::unix::fs::symlink("/nonexistent-target", &l2).unwrap();
        assert!(crate::outputs::create_private(&l2).is_err());
        assert!(!Path::new("/nonexistent-target").exists());
    }

    #[test]
    fn reads_are_bounded_and_own_files_checked() {
        let top = tempfile::tempdir().unwrap();
        assert!(matches!(
            read_bounded(Path::new("/dev/zero"), 10),
            Err(ReadError::NotRegular("a device"))
        ));
        let fifo = top.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a plain syscall on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_bounded(&fifo, 10).unwrap_err().to_string();
        assert!(e.starts_with("is a FIFO"), "{e}");
        let f = top.path().join("f");
        std::fs::write(&f, b"0123456789").unwrap();
        assert_eq!(read_bounded(&f, 10).unwrap(), b"0123456789");
        assert!(matches!(read_bounded(&f, 9), Err(ReadError::TooBig(9))));
        assert!(matches!(
            read_bounded(&top.path().join("no"), 9),
            Err(ReadError::Missing)
        ));
        // A worker's file: not through a symlink, not writable by others.
        assert_eq!(read_own(&f, 10).unwrap(), b"0123456789");
        let l = top.path().join("l");
        std::os::unix::fs::symlink(&f, &l).unwrap();
        assert!(
            read_own(&l, 10)
                .unwrap_err()
                .to_string()
                .contains("symbolic link")
        );
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = read_own(&f, 10).unwrap_err().to_string();
        assert!(e.contains("0666"), "{e}");
    }

    #[test]
    fn only_scratch_names_are_swept() {
        assert_eq!(scratch_pid("nrun-123-0123456789"), Some(123));
        assert_eq!(scratch_pid("nrun-123-abcdef0123"), Some(123));
        for n in [
            "nrun-123",
            "nrun-123-012345678",
            "nrun-123-0123456789x",
            "nrun--0123456789",
            "nrun-logs-x_01234567",
            "nrun-12a-0123456789",
        ] {
            assert_eq!(scratch_pid(n), None, "{n}");
        }
        // scratch()'s form (made here in a directory of the test's own: the process's scratch
        // is left to the integration tests, which see it made and removed).
        let top = tempfile::tempdir().unwrap();
        let prefix = format!("{SCRATCH_PREFIX}{}-", std::process::id());
        let d = make_private_dir(top.path(), &prefix).unwrap();
        assert_eq!(
            scratch_pid(d.file_name().unwrap().to_str().unwrap()),
            Some(std::process::id())
        );
    }
}
