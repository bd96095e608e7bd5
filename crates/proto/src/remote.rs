//! Ways to start `nrun __agent` on other nodes: the system `ssh` (so ~/.ssh/config, agents,
//! known_hosts, ProxyJump all work as the user has them), or Slurm's `srun` inside an
//! allocation. Building the command lines is pure and unit-tested; starting them is
//! `session::link` (`child` for ssh, `srun` for the step).

use std::ffi::OsString;

/// ssh options nrun always sets: fail instead of prompting (a host-key or password prompt would
/// hang a launch), give up on a dead host quickly, and keep the connection alive so a dropped
/// network is noticed.
pub(crate) const SSH_BASE_OPTS: [&str; 8] = [
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=10",
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
];

/// `ssh [base] [user opts] -- HOST 'exec REMOTE_NRUN __agent'`.
///
/// No `-t`: without a tty, stdin is a plain pipe whose end the agent notices (a tty would merge
/// stdout and stderr and mangle output). The remote command gets its own shell line so `~` in
/// the path expands there.
pub fn ssh_command(host: &str, user_opts: &[String], remote_nrun: &str) -> Vec<OsString> {
    ssh_nrun(host, user_opts, remote_nrun, "__agent")
}

/// `ssh [base] [user opts] -- HOST 'exec REMOTE_NRUN __reap KEEPER AGENT TOKEN'`: ends a lost
/// node's agent that cannot end itself, with its workers (see `node::keeper::reap_main`).
pub fn ssh_reap_command(
    host: &str,
    user_opts: &[String],
    remote_nrun: &str,
    kept: &nrun_node::keeper::Kept,
    limit: std::time::Duration,
) -> Vec<OsString> {
    let sub = format!(
        "__reap {} {} {}",
        kept.keeper,
        kept.agent,
        shell_quote(&kept.token)
    );
    let mut v = ssh_nrun(host, user_opts, remote_nrun, &sub);
    // First given, first taken by ssh: before the base options' longer connect timeout.
    v.splice(
        1..1,
        [
            "-o".into(),
            format!("ConnectTimeout={}", limit.as_secs().max(1)).into(),
        ],
    );
    v
}

fn ssh_nrun(host: &str, user_opts: &[String], remote_nrun: &str, sub: &str) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec!["ssh".into()];
    v.extend(SSH_BASE_OPTS.iter().map(OsString::from));
    v.extend(user_opts.iter().map(OsString::from));
    v.push(host.into());
    v.push(format!("exec {} {sub}", shell_quote(remote_nrun)).into());
    v
}

/// One `srun` step starting every node's agent at once (as Open MPI's PRRTE starts its daemons):
/// one task per node, the same instructions to all on stdin (each agent finds its node by name),
/// the whole of each node's allocation (CPUs and GPUs) for the step, and the step killed if one
/// agent fails.
pub fn srun_step_command(nodes: &[String], remote_nrun: &str) -> Vec<OsString> {
    vec![
        "srun".into(),
        format!("--nodes={}", nodes.len()).into(),
        format!("--ntasks={}", nodes.len()).into(),
        "--ntasks-per-node=1".into(),
        format!("--nodelist={}", nodes.join(",")).into(),
        // Workers inherit the agent's CPUs and GPUs: the step takes the nodes' whole share.
        "--whole".into(),
        "--input=all".into(),
        // One agent ending must not end the others: nrun decides what a lost node means (a
        // spare takes its place), whatever the cluster's default.
        "--kill-on-bad-exit=0".into(),
        // Line-buffered (srun's default), not --unbuffered: unbuffered, srun passes each
        // node's output on in the pieces slurmstepd happened to read, and two nodes' pieces
        // mix mid-line (lines lost to the reader, and the marks that end a step's output cut).
        "--mpi=none".into(),
        remote_nrun.into(),
        "__agent".into(),
    ]
}

/// Splits `--ssh-opts "-F file -p 2222 -i key"` like a POSIX shell would (quotes, backslashes).
pub fn split_opts(s: &str) -> nrun_base::error::Result<Vec<String>> {
    shlex::split(s).ok_or_else(|| {
        nrun_base::error::Error::usage(format!(
            "--ssh-opts {s:?}: unbalanced quote (or a trailing backslash); quote as in a shell"
        ))
    })
}

/// Quotes for a POSIX shell, keeping a leading `~/` expandable.
pub(crate) fn shell_quote(s: &str) -> String {
    if let Some(rest) = s.strip_prefix("~/") {
        return format!("~/{}", shell_quote(rest));
    }
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+=:,@".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reap's connect timeout comes before the base options' (ssh takes the first one),
    /// and its token is quoted for the remote shell.
    #[test]
    fn a_reap_command_names_the_agent_and_bounds_its_connect() {
        let kept = nrun_node::keeper::Kept {
            keeper: 41,
            agent: 42,
            token: "41.123".into(),
        };
        let argv = ssh_reap_command(
            "h2",
            &["-F".into(), "cfg".into()],
            "/opt/nrun",
            &kept,
            std::time::Duration::from_secs(3),
        );
        let argv: Vec<String> = argv.iter().map(|a| a.to_string_lossy().into()).collect();
        assert_eq!(argv[..3], ["ssh", "-o", "ConnectTimeout=3"]);
        assert!(argv.contains(&"ConnectTimeout=10".to_string()));
        assert_eq!(argv[argv.len() - 2], "h2");
        assert_eq!(argv[argv.len() - 1], "exec /opt/nrun __reap 41 42 41.123");
    }

    #[test]
    fn ssh_and_srun_commands() {
        let c = ssh_command("gpu1", &["-F".into(), "/tmp/cfg".into()], "~/bin/nrun");
        let s: Vec<String> = c.iter().map(|x| x.to_string_lossy().into_owned()).collect();
        assert_eq!(s[0], "ssh");
        assert!(
            s.contains(&"BatchMode=yes".to_string())
                && s.contains(&"ConnectTimeout=10".to_string())
        );
        assert_eq!(
            &s[s.len() - 4..],
            ["-F", "/tmp/cfg", "gpu1", "exec ~/bin/nrun __agent"]
        );
        assert!(!s.iter().any(|a| a == "-t" || a == "-tt"));
        let c = srun_step_command(&["n01".into(), "n02".into()], "/opt/nrun");
        let s: Vec<String> = c.iter().map(|x| x.to_string_lossy().into_owned()).collect();
        assert_eq!(
            s,
            [
                "srun",
                "--nodes=2",
                "--ntasks=2",
                "--ntasks-per-node=1",
                "--nodelist=n01,n02",
                "--whole",
                "--input=all",
                "--kill-on-bad-exit=0",
                "--mpi=none",
                "/opt/nrun",
                "__agent"
            ]
        );
    }

    #[test]
    fn opts_split_like_a_shell() {
        assert_eq!(
            split_opts("-F file -p 2222 -i key").unwrap(),
            ["-F", "file", "-p", "2222", "-i", "key"]
        );
        assert_eq!(
            split_opts(r#"-o "ProxyJump bastion" -i 'my key'"#).unwrap(),
            ["-o", "ProxyJump bastion", "-i", "my key"]
        );
        assert_eq!(split_opts(r"a\ b ''").unwrap(), ["a b", ""]);
        assert!(split_opts("-o 'x").is_err());
        assert!(split_opts(r#"-o "x"#).is_err());
        // Inside double quotes a backslash escapes only what a shell's does.
        assert_eq!(split_opts(r#""a\"b" "c\d""#).unwrap(), [r#"a"b"#, r"c\d"]);
        assert_eq!(split_opts("  ").unwrap(), Vec::<String>::new());
        // As in a shell, a word that starts with '#' starts a comment.
        assert_eq!(split_opts("-p 22 # the port").unwrap(), ["-p", "22"]);
        assert_eq!(split_opts("-o X=#1").unwrap(), ["-o", "X=#1"]);
        assert_eq!(shell_quote("/usr/bin/nrun"), "/usr/bin/nrun");
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
    }
}
