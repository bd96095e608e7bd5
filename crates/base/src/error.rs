//! Errors meant for people, and nrun's exit codes.
//!
//! An [`Error`] carries the exit code it ends nrun with and a message that says what failed,
//! where, and what to check next. Bad input exits [`exit::USAGE`]; a failed worker's own code
//! passes through, so scripts that check `$?` see what they would have seen without nrun.

use std::fmt;

/// Named exit codes. Codes a worker produced pass through unchanged; a death by signal N is
/// 128+N, the shell's convention.
pub mod exit {
    /// Every worker exited 0.
    pub const SUCCESS: u8 = 0;
    /// nrun itself failed in a way that is not the user's input (a bug or the system refusing).
    pub const INTERNAL: u8 = 1;
    /// Bad usage or input: unknown option, bad value, missing script or program, port taken.
    pub const USAGE: u8 = 2;

    /// The preflight could not run: no usable libnccl, libcuda or GPU, or the store unreachable.
    pub const PREFLIGHT_SETUP: u8 = 90;
    /// NCCL communicator init failed on some rank.
    pub const PREFLIGHT_INIT: u8 = 91;
    /// Some rank did not finish in time (stuck in init, or never reached the store).
    pub const PREFLIGHT_TIMEOUT: u8 = 92;
    /// All-reduce results were wrong.
    pub const PREFLIGHT_WRONG: u8 = 93;
    /// Bus bandwidth under --min-busbw.
    pub const PREFLIGHT_SLOW: u8 = 94;

    /// A multi-node run could not start: a node did not join (ssh, nrun missing, cwd missing),
    /// the nodes cannot reach each other, or their software differs.
    pub const CLUSTER: u8 = 95;
    /// `nrun bisect` found nodes or links that are not good.
    pub const BISECT_FOUND: u8 = 96;
    /// The watch found a hang and stopped the job (`--on-hang stop`).
    pub const HANG: u8 = 97;
    /// Too few healthy nodes: nodes were left out (did not join, failed the checks, were lost
    /// or listed in --exclude-file) and no spares remained. A requeue script can tell it from
    /// a failure of the program itself.
    pub const NO_NODES: u8 = 98;

    /// nrun's own helper process (`nrun __agent`, `nrun __preflight`) could not do its part;
    /// the reason is on its stderr.
    pub const HELPER: u8 = 3;

    /// Exit code for death by signal `sig`.
    pub fn signal(sig: i32) -> u8 {
        (128 + sig).clamp(0, 255) as u8
    }
}

#[derive(Debug)]
pub struct Error {
    pub code: u8,
    /// Empty when what went wrong was already said where it happened (or is the job's own exit
    /// code): then nothing more is printed.
    pub message: String,
}

impl Error {
    /// Bad usage or input (exit 2). The message names the input and the next thing to try.
    pub fn usage(message: impl Into<String>) -> Error {
        Error {
            code: exit::USAGE,
            message: message.into(),
        }
    }

    /// Nodes that could not join or lost each other (exit 95).
    pub fn cluster(message: impl Into<String>) -> Error {
        Error {
            code: exit::CLUSTER,
            message: message.into(),
        }
    }

    /// Too few healthy nodes for the job (exit 98).
    pub fn no_nodes(message: impl Into<String>) -> Error {
        Error {
            code: exit::NO_NODES,
            message: message.into(),
        }
    }

    /// An end whose cause was already printed, or a worker's own exit code passed through: only
    /// the code remains to give.
    pub fn exit(code: u8) -> Error {
        Error {
            code,
            message: String::new(),
        }
    }

    /// Stopped by signal `sig` (exit 128+sig); the interruption was already reported.
    pub fn interrupted(sig: i32) -> Error {
        Error::exit(exit::signal(sig))
    }

    /// nrun's helper process could not do its part (exit 3); the message goes to its stderr.
    pub fn helper(message: impl Into<String>) -> Error {
        Error {
            code: exit::HELPER,
            message: message.into(),
        }
    }

    /// Whether there is something left to tell the user (see [`Error::exit`]).
    pub fn has_message(&self) -> bool {
        !self.message.is_empty()
    }

    /// A failure of nrun or the system (exit 1).
    pub fn internal(message: impl Into<String>) -> Error {
        Error {
            code: exit::INTERNAL,
            message: message.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;
