//! What every layer of nrun shares, and nothing of any layer above: errors for people and the
//! exit codes ([`error`]), this host's names and interfaces ([`net`]), private scratch and
//! bounded reads ([`files`]), the one opener of the files nrun writes ([`outputs`]), randomness, nrun's version, and the two switches on what the
//! process prints.

pub mod error;
pub mod files;
pub mod net;
pub mod outputs;

/// nrun's version, with the git revision it was built from: `nrun --version`, and what each
/// node reports so that the launch host can refuse a different nrun.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("NRUN_GIT_REV"), ")");

/// The git revision nrun was built from (build.rs), "unknown" outside a checkout.
pub const GIT_REV: &str = env!("NRUN_GIT_REV");

/// Writes `text` to stdout. A reader that stopped early (`nrun completions zsh | head -c1`,
/// `nrun doctor | head`) is a quiet end, not a panic: `print!` would panic on the broken
/// pipe (Rust ignores SIGPIPE). Returns false when stdout was closed or failed.
pub fn stdout(text: impl AsRef<[u8]>) -> bool {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_ref())
        .and_then(|()| out.flush())
        .is_ok()
}

static SILENT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// An agent forked from nrun's spawner inherits nrun's log subscriber, where an exec'd agent
/// has none: it says nothing through it, as an exec'd one does not.
pub fn silence_logging() {
    SILENT.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`silence_logging`] was called: the log writer's switch.
pub fn logging_silenced() -> bool {
    SILENT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Lowercase hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Fills `b` from the OS. No randomness is an error, never a predictable value.
///
/// Through the getrandom crate, not libc's getrandom(3): that function is glibc 2.25's, and the
/// wheel's binary must link against glibc 2.17 (the crate looks the function up at run time and
/// falls back to the syscall or /dev/urandom).
pub fn random_bytes(b: &mut [u8]) -> std::io::Result<()> {
    getrandom::fill(b).map_err(|e| match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::other(e.to_string()),
    })
}

/// 128 random bits from the OS, hex: a run's secret, or a challenge.
pub fn random_hex() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    random_bytes(&mut b)?;
    Ok(hex(&b))
}

/// "13 m 32 s", "3 h 12 m", "41 s", "4.2 s", "0.05 s".
pub fn duration_text(s: f64) -> String {
    let whole = s.round() as u64;
    match s {
        s if s < 0.995 => format!("{s:.2} s"),
        s if s < 9.95 => format!("{s:.1} s"),
        _ if whole < 60 => format!("{whole} s"),
        _ if whole < 3600 => format!("{} m {} s", whole / 60, whole % 60),
        _ => format!("{} h {} m", whole / 3600, (whole % 3600) / 60),
    }
}

/// Names said in one line: all of them up to `shown`, else the first `shown - 1` and "and K
/// more" (never "and 1 more": that name fits in its place).
pub fn few<S: AsRef<str>>(names: &[S], shown: usize) -> String {
    let all = |n: &[S]| n.iter().map(AsRef::as_ref).collect::<Vec<_>>().join(", ");
    match names.len() {
        n if n <= shown.max(1) => all(names),
        n => {
            let first = shown.max(2) - 1;
            format!("{} and {} more", all(&names[..first]), n - first)
        }
    }
}

/// The first worker output line since the launch host's journal armed it: the journal's sign
/// that a worker group moved from starting to running. Written by whichever puts the workers'
/// lines on this host's console (an in-process node's writer, an agent's relay); one atomic
/// load per line once set.
pub mod activity {
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Milliseconds since the Unix epoch of the first line after [`arm`]; 0: none yet.
    static FIRST: AtomicU64 = AtomicU64::new(0);
    /// Whether lines are looked for at all (not in an agent, nor before a group starts).
    static ARMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Looks for the next first line (a worker group starts).
    pub fn arm() {
        FIRST.store(0, Ordering::Relaxed);
        ARMED.store(true, Ordering::Relaxed);
    }

    /// Whether a line is looked for now (armed, none seen yet): the relay asks before it looks
    /// at whose a line is.
    pub fn wanted() -> bool {
        ARMED.load(Ordering::Relaxed) && FIRST.load(Ordering::Relaxed) == 0
    }

    /// A worker's line reached the console.
    pub fn line() {
        if wanted() {
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_millis().max(1) as u64);
            let _ = FIRST.compare_exchange(0, ms, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// When the first line since [`arm`] came, in ms since the Unix epoch.
    pub fn first_line_ms() -> Option<u64> {
        Some(FIRST.load(Ordering::Relaxed)).filter(|&t| t != 0)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn durations_read_as_a_person_says_them() {
        use super::duration_text;
        assert_eq!(duration_text(41.2), "41 s");
        assert_eq!(duration_text(0.046), "0.05 s");
        assert_eq!(duration_text(812.4), "13 m 32 s");
        assert_eq!(duration_text(3.0 * 3600.0 + 12.0 * 60.0 + 5.0), "3 h 12 m");
    }
}
