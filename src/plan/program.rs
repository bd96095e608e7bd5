//! What runs: the target resolved to a program and its arguments (a Python script or module
//! under the chosen interpreter, or a program with `--no-python`), and the interpreter lookup.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nrun_base::error::{Error, Result};
use nrun_cli::TargetArgs;
use nrun_node::find_program;

use super::Env;

/// The interpreter a Python job would use: --python, else $PYTHON_EXEC, else python3.
fn python_name(python: Option<&Path>, env: Env<'_>) -> String {
    match (python, env("PYTHON_EXEC")) {
        (Some(p), _) => p.display().to_string(),
        (None, Some(p)) if !p.is_empty() => p,
        _ => "python3".to_string(),
    }
}

/// The interpreter a Python job would use, if it can be found (for locating torch's NCCL).
pub(super) fn find_python(python: Option<&Path>, env: Env<'_>) -> Option<PathBuf> {
    find_program(&python_name(python, env), env("PATH").as_deref())
}

pub(super) fn resolve_command(
    target: &TargetArgs,
    command: &[String],
    env: Env<'_>,
) -> Result<(OsString, Vec<OsString>)> {
    let TargetArgs {
        python,
        module,
        no_python,
        // TARGET runs as a script either way; accepted for torchrun's command lines.
        run_path: _,
    } = target;
    let target = &command[0];
    let rest = command[1..].iter().map(OsString::from);
    let path = env("PATH");
    if *no_python {
        if *module {
            return Err(Error::usage(
                "-m and --no-python exclude each other: a module needs Python",
            ));
        }
        if target.contains('/') {
            if let Some(why) = unusable(Path::new(target), true) {
                let next = match why {
                    Unusable::NotExecutable(_) => {
                        "; chmod +x it, or drop --no-python if it is a Python script"
                    }
                    Unusable::Directory => "; name the program inside it",
                    _ => "",
                };
                return Err(Error::usage(format!(
                    "program {target} {why} (cwd {}){next}",
                    cwd_display()
                )));
            }
        } else if find_program(target, path.as_deref()).is_none() {
            return Err(Error::usage(match on_path(target, path.as_deref()) {
                Some((p, why)) => format!(
                    "program {target}: the first {target} on PATH, {}, {why}; fix it or give \
                     the program's path",
                    p.display()
                ),
                None => format!(
                    "program {target} not found on PATH; give its path (./{target}) or check PATH"
                ),
            }));
        }
        return Ok((target.into(), rest.collect()));
    }

    let python = python_name(python.as_deref(), env);
    let Some(python_path) = find_program(&python, path.as_deref()) else {
        let why = match python.contains('/') {
            true => unusable(Path::new(&python), true).map(|w| w.to_string()),
            false => on_path(&python, path.as_deref())
                .map(|(p, why)| format!("on PATH is {}, which {why}", p.display())),
        };
        return Err(Error::usage(format!(
            "python interpreter {python} {}; pass --python PATH or set PYTHON_EXEC \
             (or use --no-python to run a program directly)",
            why.unwrap_or_else(|| "not found on PATH".into())
        )));
    };
    let mut args: Vec<OsString> = vec!["-u".into()];
    if *module {
        args.push("-m".into());
    } else if let Some(why) = unusable(Path::new(target), false) {
        let on_path = !target.ends_with(".py") && find_program(target, path.as_deref()).is_some();
        let hint = match why {
            Unusable::Missing if on_path => {
                format!("; {target} is a program on PATH: add --no-python to run it directly")
            }
            Unusable::Directory => "; name the script inside it, or use -m for a package".into(),
            _ => String::new(),
        };
        return Err(Error::usage(format!(
            "script {target} {why} (cwd {}){hint}",
            cwd_display()
        )));
    }
    args.push(target.into());
    args.extend(rest);
    Ok((python_path.into_os_string(), args))
}

/// Why a path cannot serve as a program to run or a script to read, in words.
#[derive(Debug)]
enum Unusable {
    Missing,
    /// A directory of its path cannot be searched.
    Unreachable,
    Directory,
    NotAFile,
    /// Its mode.
    NotExecutable(u32),
    /// Its mode.
    Unreadable(u32),
    Other(std::io::Error),
}

impl std::fmt::Display for Unusable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unusable::Missing => write!(f, "not found"),
            Unusable::Unreachable => write!(
                f,
                "cannot be reached: permission denied on a directory of its path"
            ),
            Unusable::Directory => write!(f, "is a directory"),
            Unusable::NotAFile => write!(f, "is not a regular file"),
            Unusable::NotExecutable(m) => write!(f, "is not executable (mode {m:o})"),
            Unusable::Unreadable(m) => write!(f, "cannot be read: permission denied (mode {m:o})"),
            Unusable::Other(e) => write!(f, "cannot be read: {e}"),
        }
    }
}

/// Why `p` cannot be run (`exec`) or read as a script by this user; None when it can.
fn unusable(p: &Path, exec: bool) -> Option<Unusable> {
    use nix::unistd::{AccessFlags, access};
    use std::io::ErrorKind;
    let meta = match p.metadata() {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Some(Unusable::Missing),
        Err(e) if e.kind() == ErrorKind::PermissionDenied => return Some(Unusable::Unreachable),
        Err(e) => return Some(Unusable::Other(e)),
    };
    let mode = meta.permissions().mode() & 0o7777;
    if meta.is_dir() {
        Some(Unusable::Directory)
    } else if !meta.is_file() {
        Some(Unusable::NotAFile)
    } else if exec && (mode & 0o111 == 0 || access(p, AccessFlags::X_OK).is_err()) {
        Some(Unusable::NotExecutable(mode))
    } else if !exec && access(p, AccessFlags::R_OK).is_err() {
        Some(Unusable::Unreadable(mode))
    } else {
        None
    }
}

/// The first entry named `name` on `path` and why it cannot run, where one exists but none runs
/// (a PATH lookup passes over those; saying "not found" would hide them).
fn on_path(name: &str, path: Option<&str>) -> Option<(PathBuf, Unusable)> {
    path?
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find_map(|p| match unusable(&p, true) {
            // Only what is there: a directory of PATH this user cannot search hides nothing
            // it can tell.
            Some(why @ (Unusable::Directory | Unusable::NotAFile | Unusable::NotExecutable(_))) => {
                Some((p, why))
            }
            _ => None,
        })
}

fn cwd_display() -> String {
    std::env::current_dir().map_or_else(|_| "unknown".into(), |p| p.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::super::tests::plan;

    #[test]
    fn bad_targets_are_usage_errors() {
        let e = plan(&["/definitely/missing.py"]).unwrap_err();
        assert_eq!(e.code, nrun_base::error::exit::USAGE);
        assert!(e.message.contains("not found"), "{}", e.message);
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain.sh");
        std::fs::write(&plain, "echo\n").unwrap();
        let e = plan(&["--no-python", plain.to_str().unwrap()]).unwrap_err();
        assert!(e.message.contains("not executable"), "{}", e.message);
        let e = plan(&["--no-python", "no-such-program-xyz"]).unwrap_err();
        assert!(e.message.contains("not found on PATH"), "{}", e.message);
        let e = plan(&["--python", "/no/python", "x.py"]).unwrap_err();
        assert!(
            e.message
                .contains("python interpreter /no/python not found"),
            "{}",
            e.message
        );
        let e = plan(&["true"]).unwrap_err();
        assert!(e.message.contains("--no-python"), "{}", e.message);
    }

    /// A path that is there but cannot serve says what it is, not "not found".
    #[test]
    fn a_target_or_python_that_is_there_says_why_it_cannot_serve() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let plain = dir.path().join("python");
        std::fs::write(&plain, "").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        let plain = plain.to_str().unwrap();
        let script = dir.path().join("x.py");
        std::fs::write(&script, "").unwrap();
        let script = script.to_str().unwrap();
        for (args, want) in [
            (vec![d], format!("script {d} is a directory (cwd ")),
            (
                vec!["--no-python", d],
                format!("program {d} is a directory"),
            ),
            (
                vec!["--python", d, script],
                format!("python interpreter {d} is a directory"),
            ),
            (
                vec!["--python", plain, script],
                format!("python interpreter {plain} is not executable (mode 644)"),
            ),
            (
                vec!["--no-python", plain],
                format!("program {plain} is not executable (mode 644)"),
            ),
        ] {
            let e = plan(&args).unwrap_err();
            assert_eq!(e.code, nrun_base::error::exit::USAGE, "{args:?}");
            assert!(e.message.contains(&want), "{args:?}: {}", e.message);
        }
    }

    /// A name looked up on PATH whose first match is there but does not run is named with
    /// its path.
    #[test]
    fn a_name_on_path_that_cannot_run_is_named() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("nrun-test-tool");
        std::fs::write(&p, "").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let path = dir.path().to_str().unwrap().to_string();
        let env = |k: &str| (k == "PATH").then(|| path.clone());
        let unusable = super::on_path("nrun-test-tool", env("PATH").as_deref()).unwrap();
        assert_eq!(unusable.0, p);
        assert_eq!(unusable.1.to_string(), "is not executable (mode 600)");
        assert!(super::on_path("nrun-no-such-tool", env("PATH").as_deref()).is_none());
    }
}
