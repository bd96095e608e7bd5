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
        let p = Path::new(target);
        if target.contains('/') {
            let meta = p.metadata().map_err(|_| {
                Error::usage(format!(
                    "program {target} not found (cwd {})",
                    cwd_display()
                ))
            })?;
            if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
                return Err(Error::usage(format!(
                    "program {target} is not executable; chmod +x it, or drop --no-python if it is \
                     a Python script"
                )));
            }
        } else if find_program(target, path.as_deref()).is_none() {
            return Err(Error::usage(format!(
                "program {target} not found on PATH; give its path (./{target}) or check PATH"
            )));
        }
        return Ok((target.into(), rest.collect()));
    }

    let python = python_name(python.as_deref(), env);
    let Some(python_path) = find_program(&python, path.as_deref()) else {
        return Err(Error::usage(format!(
            "python interpreter {python} not found{}; pass --python PATH or set PYTHON_EXEC \
             (or use --no-python to run a program directly)",
            if python.contains('/') { "" } else { " on PATH" }
        )));
    };
    let mut args: Vec<OsString> = vec!["-u".into()];
    if *module {
        args.push("-m".into());
    } else if !Path::new(target).is_file() {
        let hint = if !target.ends_with(".py") && find_program(target, path.as_deref()).is_some() {
            format!("; {target} is a program on PATH: add --no-python to run it directly")
        } else {
            String::new()
        };
        return Err(Error::usage(format!(
            "script {target} not found (cwd {}){hint}",
            cwd_display()
        )));
    }
    args.push(target.into());
    args.extend(rest);
    Ok((python_path.into_os_string(), args))
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
}
