//! What every worker gets besides torchrun's variables: the launch host's forwarded variables,
//! the KEY=VALUE lines of `.nrun_env` (home, then cwd) and `-x`; the interface variables of a
//! node; and the warnings about variables that do not do what people think.

use std::path::PathBuf;

use nrun_base::error::{Error, Result};

/// NCCL_PORT_RANGE is a common guess that NCCL ignores: said once, wherever it is seen.
pub(crate) const PORT_RANGE_WARNING: &str = "NCCL_PORT_RANGE is not an NCCL variable and does nothing: to \
    confine NCCL's ports narrow the kernel's ephemeral range (sysctl \
    net.ipv4.ip_local_port_range=\"50000 51000\"); NCCL_COMM_ID pins only the bootstrap port";

/// The warning for these variables, if they hold NCCL_PORT_RANGE.
pub(crate) fn port_range_warning(vars: &[(String, String)]) -> Option<&'static str> {
    vars.iter()
        .any(|(k, _)| k == "NCCL_PORT_RANGE")
        .then_some(PORT_RANGE_WARNING)
}

/// Largest `.nrun_env` read: KEY=VALUE lines for a job's environment.
const MAX_ENV_FILE_BYTES: u64 = 1 << 20;

/// What every worker on every node gets: forwarded variables, then `.nrun_env` (home, then the
/// cwd's, which wins), then `-x VAR` / `-x VAR=VALUE`. Later sources win.
pub(crate) fn job_env(
    exports: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<(String, String)>> {
    let mut vars: Vec<(String, String)> = std::env::vars().filter(|(k, _)| forwarded(k)).collect();
    let put = |vars: &mut Vec<(String, String)>, k: String, v: String| {
        vars.retain(|(x, _)| *x != k);
        vars.push((k, v));
    };
    let home = env("HOME").map(PathBuf::from);
    for dir in [home, std::env::current_dir().ok()].into_iter().flatten() {
        let p = dir.join(".nrun_env");
        let text = match nrun_base::files::read_text(
            &p,
            MAX_ENV_FILE_BYTES,
            nrun_base::files::Writer::Trusted,
        ) {
            Ok(t) => t,
            Err(nrun_base::files::ReadError::Missing) => continue,
            Err(e) => {
                return Err(Error::usage(format!(
                    "{}: {e}; .nrun_env must be a regular file of KEY=VALUE lines (at most \
                         {} MiB) of this user's, that only this user may write: fix or remove it",
                    p.display(),
                    MAX_ENV_FILE_BYTES >> 20
                )));
            }
        };
        for (k, v) in parse_env_file(&text, &p.display().to_string())? {
            put(&mut vars, k, v);
        }
    }
    for x in exports {
        if x.is_empty() {
            return Err(Error::usage(
                "-x needs a variable: -x VAR (its value here) or -x VAR=VALUE",
            ));
        }
        let (k, v) = match x.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => match env(x) {
                Some(v) => (x.clone(), v),
                None => {
                    return Err(Error::usage(format!(
                        "-x {x}: {x} is not set here; give a value with -x {x}=VALUE"
                    )));
                }
            },
        };
        if !is_var_name(&k) {
            return Err(Error::usage(format!(
                "-x {x}: {k:?} is not a variable name"
            )));
        }
        put(&mut vars, k, v);
    }
    Ok(vars)
}

fn is_var_name(k: &str) -> bool {
    !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// NCCL_SOCKET_IFNAME (exact name) and GLOO_SOCKET_IFNAME for a node's workers, unless the user
/// set them (then they were checked on every node). Left to themselves, gloo and NCCL pick by
/// hostname lookup and often end up on loopback or the wrong network.
pub(crate) fn interface_env(user: &[(String, String)], ifname: &str) -> Vec<(String, String)> {
    let set = |k: &str| user.iter().any(|(x, _)| x == k);
    let mut env = Vec::new();
    if !set("NCCL_SOCKET_IFNAME") {
        env.push(("NCCL_SOCKET_IFNAME".into(), format!("={ifname}")));
    }
    if !set("GLOO_SOCKET_IFNAME") {
        env.push(("GLOO_SOCKET_IFNAME".into(), ifname.to_string()));
    }
    env
}

/// Environment forwarded to every node: NCCL_*, TORCH_*, CUDA_* except CUDA_VISIBLE_DEVICES,
/// PYTHON*, OMP_*, UCX_*. Never SSH_*, DISPLAY, terminal or shell-internal variables.
pub(crate) fn forwarded(name: &str) -> bool {
    let prefixed = [
        "NCCL_",
        "TORCH_",
        "CUDA_",
        "PYTHON",
        "OMP_",
        "UCX_",
        "GLOO_",
        "NRUN_ENV_",
    ]
    .iter()
    .any(|p| name.starts_with(p));
    prefixed && name != "CUDA_VISIBLE_DEVICES"
}

/// KEY=VALUE lines of a `.nrun_env` file (blank lines and `#` comments skipped; `export ` is
/// allowed before KEY).
pub(crate) fn parse_env_file(text: &str, origin: &str) -> Result<Vec<(String, String)>> {
    let mut v = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").unwrap_or(line);
        let Some((k, val)) = line.split_once('=') else {
            return Err(Error::usage(format!(
                "{origin} line {}: expected KEY=VALUE, got {raw:?}",
                i + 1
            )));
        };
        let k = k.trim();
        if !is_var_name(k) {
            return Err(Error::usage(format!(
                "{origin} line {}: {k:?} is not a variable name",
                i + 1
            )));
        }
        let val = val.trim();
        let val = val
            .strip_prefix('"')
            .and_then(|x| x.strip_suffix('"'))
            .or_else(|| val.strip_prefix('\'').and_then(|x| x.strip_suffix('\'')))
            .unwrap_or(val);
        v.push((k.to_string(), val.to_string()));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_variables() {
        for v in [
            "NCCL_DEBUG",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "CUDA_LAUNCH_BLOCKING",
            "PYTHONPATH",
            "OMP_NUM_THREADS",
            "UCX_TLS",
        ] {
            assert!(forwarded(v), "{v}");
        }
        for v in [
            "CUDA_VISIBLE_DEVICES",
            "SSH_AUTH_SOCK",
            "DISPLAY",
            "TERM",
            "PWD",
            "SHLVL",
            "HOME",
        ] {
            assert!(!forwarded(v), "{v}");
        }
    }

    #[test]
    fn env_files() {
        let v = parse_env_file("# c\n\nA=1\nexport B=\"two words\"\nC='x'\n", ".nrun_env").unwrap();
        assert_eq!(
            v,
            [
                ("A".into(), "1".into()),
                ("B".into(), "two words".into()),
                ("C".into(), "x".into())
            ]
        );
        assert!(
            parse_env_file("novalue\n", ".nrun_env")
                .unwrap_err()
                .message
                .contains("line 1")
        );
    }

    #[test]
    fn exports_win_and_bad_names_are_refused() {
        let env = |k: &str| (k == "HERE").then(|| "v".to_string());
        let v = job_env(&["A=1".into(), "HERE".into(), "A=2".into()], &env).unwrap();
        assert!(v.contains(&("A".into(), "2".into())) && v.contains(&("HERE".into(), "v".into())));
        assert!(!v.contains(&("A".into(), "1".into())));
        let e = job_env(&["NOPE_NOT_SET".into()], &env).unwrap_err();
        assert!(e.message.contains("is not set here"), "{}", e.message);
        assert!(job_env(&["A-B=1".into()], &env).is_err());
        let w = port_range_warning(&[("NCCL_PORT_RANGE".into(), "1-2".into())]);
        assert!(w.is_some_and(|w| w.contains("ip_local_port_range")));
    }
}
