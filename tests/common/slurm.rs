//! A real Slurm of namespace hosts (scripts/slurm-cluster.sh) for the tests that run nrun
//! inside an allocation.

use std::process::{Command, Stdio};

use super::*;

/// A Slurm cluster of namespace hosts, taken down on drop.
pub(crate) struct Slurm {
    pub name: String,
    pub conf: String,
    pub cluster: Cluster,
}

impl Slurm {
    /// `NRUN_TEST_CLUSTER_PREFIX` goes before `name`, as for [`Cluster::up`]: several worktrees
    /// testing at once on one machine build clusters of their own.
    pub(crate) fn up(name: &str, k: usize) -> Option<Slurm> {
        let prefixed = format!(
            "{}{name}",
            std::env::var("NRUN_TEST_CLUSTER_PREFIX").unwrap_or_default()
        );
        let name = prefixed.as_str();
        // The script installs Slurm and munge itself (as root); the hosts need an sshd.
        if !need_root(&format!("Slurm cluster {name} (scripts/slurm-cluster.sh)"))
            || !need_tool("ip", "iproute2")
            || !need_tool("sshd", "openssh-server")
        {
            return None;
        }
        let script = format!("{}/scripts/slurm-cluster.sh", env!("CARGO_MANIFEST_DIR"));
        let out = Command::new("bash")
            .args([&script, "up", &k.to_string(), name])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "slurm-cluster.sh up {k} {name}: {}",
            text(&out.stderr)
        );
        let env =
            std::fs::read_to_string(text(&out.stdout).lines().last().unwrap().trim()).unwrap();
        let conf = env
            .trim()
            .strip_prefix("export SLURM_CONF=")
            .unwrap()
            .to_string();
        Some(Slurm {
            name: name.into(),
            conf,
            cluster: Cluster {
                name: name.into(),
                config: String::new(),
            },
        })
    }

    /// A Slurm client command (salloc, sbatch, srun, scancel, squeue) for this cluster, with
    /// the scene's tag for every process it starts.
    pub(crate) fn cmd(&self, s: &Scene, prog: &str) -> Command {
        let mut c = Command::new(prog);
        c.env("SLURM_CONF", &self.conf)
            .env("NRUN_TEST_TAG", &s.tag)
            .env("MARK", s.mark())
            .env_remove("NRUN_LOG")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let script = format!("{}/scripts/slurm-cluster.sh", env!("CARGO_MANIFEST_DIR"));
        let _ = Command::new("bash")
            .args([&script, "down", &self.name])
            .output();
        // The netns cluster is gone with it: nothing left for Cluster's own drop to do.
        self.cluster.name = format!("{}-gone", self.name);
    }
}
