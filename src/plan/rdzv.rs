//! The rendezvous: where the store lives ([`resolve_store`]), torchrun's c10d
//! ([`resolve_c10d`]), one nrun per node of a Slurm step ([`slurm_every_node`]), the run id,
//! `--rdzv-conf`, and the address flags.

use std::time::Duration;

use nrun_base::error::{Error, Result};
use nrun_cli::{NodesArgs, RendezvousArgs};

use super::parse::{MAX_SECS, parse_nnodes, positive_secs};
use super::{C10d, Env, StorePlan};

/// The job's rendezvous as its flags and the environment decide it: how many nodes, this
/// node's rank, the run's id, and c10d (asked for, or a Slurm step of one nrun per node).
pub(super) struct JobRdzv {
    pub(super) nnodes: usize,
    pub(super) min_nodes: usize,
    pub(super) node_rank: usize,
    pub(super) run_id: String,
    pub(super) c10d: Option<C10d>,
    pub(super) last_call: Duration,
    pub(super) rdzv_join_timeout: Option<Duration>,
}

/// The job's nodes and rendezvous from `--nnodes`, `--node-rank`, `--rdzv-*`, the address
/// flags and, under `srun` on every node, Slurm's variables.
pub(super) fn job_rdzv(rdzv: &RendezvousArgs, uses_hosts: bool, env: Env<'_>) -> Result<JobRdzv> {
    // Elastic MIN:MAX: up to MAX nodes, going on with MIN or more.
    let nnodes_text = rdzv.nnodes.as_deref().unwrap_or("1");
    let (mut min_nodes, mut nnodes) = parse_nnodes(nnodes_text)?;
    let (rdzv_join_timeout, last_call) = parse_rdzv_conf(rdzv.rdzv_conf.as_deref())?;
    if let Some(a) = &rdzv.master_addr {
        check_host("--master-addr", a)?;
    }
    if let Some(a) = &rdzv.local_addr {
        check_host("--local-addr", a)?;
    }
    let mut run_id = run_id(rdzv, nnodes, uses_hosts)?;
    let node_rank = rdzv.node_rank.unwrap_or(0);
    if min_nodes < nnodes && rdzv.node_rank.is_some() {
        return Err(Error::usage(format!(
            "--nnodes {nnodes_text}: an elastic range needs nodes that join (a host list, or \
             c10d without --node-rank); a static --node-rank launch has a fixed number of nodes"
        )));
    }
    if node_rank >= nnodes {
        return Err(Error::usage(format!(
            "--node-rank {node_rank} is out of range for --nnodes {nnodes} (ranks are 0..{})",
            nnodes - 1
        )));
    }
    let mut c10d = resolve_c10d(rdzv, nnodes, uses_hosts, &run_id, env)?;
    // Under `srun` on every node, Slurm says how many nodes there are and which this is;
    // a --nnodes given must say the same (`--standalone`: each node a job of its own).
    if c10d.is_none()
        && !uses_hosts
        && rdzv.node_rank.is_none()
        && !rdzv.standalone
        && let Some((n, c)) = slurm_every_node(env)?
    {
        if rdzv.nnodes.is_some() && (min_nodes, nnodes) != (n, n) {
            return Err(Error::usage(format!(
                "--nnodes {nnodes_text} but this srun step runs nrun on {n} nodes \
                     (SLURM_STEP_NUM_NODES), each node one of the job; drop --nnodes, or give \
                     srun --nodes {nnodes_text}"
            )));
        }
        (nnodes, min_nodes) = (n, n);
        if rdzv.rdzv_id.is_none() {
            run_id = c.id.clone();
        }
        c10d = Some(c);
    }
    if min_nodes < nnodes && !uses_hosts && c10d.is_none() {
        return Err(Error::usage(format!(
            "--nnodes {nnodes_text}: an elastic range needs nodes that join: a host list (-H, \
             --hostfile), or the same command on every node with --rdzv-backend c10d \
             --rdzv-endpoint HOST:PORT"
        )));
    }
    Ok(JobRdzv {
        nnodes,
        min_nodes,
        node_rank,
        run_id,
        c10d,
        last_call,
        rdzv_join_timeout,
    })
}

/// Flags that would otherwise silently override one another, refused with both named and what
/// to do: `--standalone` against the flags that put the store elsewhere or ask for other
/// nodes; `--master-addr`/`--master-port` against an `--rdzv-endpoint` that says otherwise; a
/// host list (nrun starts every node and hosts the store here) against the flags of a launch
/// where every node runs its own nrun.
pub(super) fn check_conflicts(rdzv: &RendezvousArgs, nodes: &NodesArgs) -> Result<()> {
    let list = match (&nodes.hosts, &nodes.hostfile) {
        (Some(_), _) => Some("-H"),
        (None, Some(_)) => Some("--hostfile"),
        (None, None) => None,
    };
    if rdzv.standalone {
        let store_elsewhere = [
            (rdzv.rdzv_endpoint.is_some(), "--rdzv-endpoint"),
            (rdzv.master_addr.is_some(), "--master-addr"),
        ];
        if let Some((_, flag)) = store_elsewhere.iter().find(|(given, _)| *given) {
            return Err(Error::usage(format!(
                "--standalone and {flag} exclude each other: --standalone runs this node alone \
                 with its store on a free local port, {flag} says the store is elsewhere; drop \
                 {flag} for a single-node job, or drop --standalone to use it (every node \
                 running the same command)"
            )));
        }
        let others = [
            (rdzv.node_rank.is_some(), "--node-rank"),
            (list.is_some(), list.unwrap_or("-H")),
        ];
        if let Some((_, flag)) = others.iter().find(|(given, _)| *given) {
            return Err(Error::usage(format!(
                "--standalone and {flag} exclude each other: --standalone runs this node alone, \
                 {flag} asks for several nodes; drop one of them"
            )));
        }
    }
    if let Some(ep) = &rdzv.rdzv_endpoint {
        let (host, port) = split_host_port(ep)?;
        if let Some(addr) = rdzv.master_addr.as_ref().filter(|a| **a != host) {
            return Err(Error::usage(format!(
                "--master-addr {addr} and --rdzv-endpoint {ep} name different hosts for the \
                 store; give one of them (--rdzv-endpoint HOST:PORT, or --master-addr with \
                 --master-port)"
            )));
        }
        if let (Some(p), Some(mp)) = (port, rdzv.master_port.filter(|mp| Some(*mp) != port)) {
            return Err(Error::usage(format!(
                "--master-port {mp} and --rdzv-endpoint {ep} name different ports ({p}) for the \
                 store; give the port once"
            )));
        }
    }
    if let Some(list) = list {
        let c10d = rdzv.rdzv_backend.as_deref() == Some("c10d");
        let every_node = [
            (rdzv.rdzv_endpoint.is_some(), "--rdzv-endpoint"),
            (rdzv.master_addr.is_some(), "--master-addr"),
            (c10d, "--rdzv-backend c10d"),
        ];
        if let Some((_, flag)) = every_node.iter().find(|(given, _)| *given) {
            return Err(Error::usage(format!(
                "{list} and {flag} exclude each other: with a host list nrun starts every node \
                 itself and hosts the store on this host; {flag} is for the same command run on \
                 every node. Drop one of them (--local-addr sets the address the nodes use to \
                 reach this host)"
            )));
        }
    }
    Ok(())
}

/// The run id names log directories and goes into store keys and the workers' environment:
/// one path component of a plain charset.
fn run_id(rdzv: &RendezvousArgs, nnodes: usize, uses_hosts: bool) -> Result<String> {
    Ok(match &rdzv.rdzv_id {
        Some(id) if !is_run_id(id) => {
            return Err(Error::usage(format!(
                "--rdzv-id {id:?}: a run id names a log directory; use 1 to {MAX_RUN_ID} \
                 letters, digits, '.', '-' or '_' (no '/', spaces, newlines or other control \
                 characters; not '.' or '..')"
            )));
        }
        Some(id) => id.clone(),
        // A static launch's nodes each run their own nrun: only a given id is shared.
        None if nnodes > 1 && !uses_hosts => "none".to_string(),
        None => uuid4()?,
    })
}

/// Longest `--rdzv-id`.
const MAX_RUN_ID: usize = 128;

/// Whether `id` is a run id `--rdzv-id` accepts: `[A-Za-z0-9._-]{1,128}`, not `.` or `..`.
fn is_run_id(id: &str) -> bool {
    (1..=MAX_RUN_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        && id != "."
        && id != ".."
}

/// An address flag's value (`--master-addr`, `--local-addr`): a host name (letters, digits,
/// '-', '.', '_') or an IP address (IPv6 bare, as workers get it in MASTER_ADDR, with an
/// optional zone). The port has its own flag.
pub(super) fn check_host(flag: &str, s: &str) -> Result<()> {
    let v6 = s
        .split_once('%')
        .map_or(s, |(a, _)| a)
        .parse::<std::net::Ipv6Addr>()
        .is_ok();
    let name = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    if v6 || name {
        return Ok(());
    }
    let hint = if s.contains(['[', ']']) {
        "; write an IPv6 address without brackets"
    } else if s.contains(':') {
        "; give the port with --master-port"
    } else {
        ""
    };
    Err(Error::usage(format!(
        "{flag} {s:?}: expected a host name (letters, digits, '-', '.', '_') or an IP address{hint}"
    )))
}

/// `--rdzv-endpoint HOST[:PORT]`: `[v6]:port`, `[v6]`, a bare IPv6 address, `host:port` or
/// `host`. Anything else (unbalanced brackets, text after `]`, an empty host, a port outside
/// 0-65535, a character no host name or address has) is refused, naming what is accepted.
fn split_host_port(s: &str) -> Result<(String, Option<u16>)> {
    split_endpoint("--rdzv-endpoint", s)
}

/// [`split_host_port`] for `flag`'s value, named in its errors.
fn split_endpoint(flag: &str, s: &str) -> Result<(String, Option<u16>)> {
    let bad = |why: String| {
        Error::usage(format!(
            "{flag} {s:?}: {why}; expected HOST, HOST:PORT, [IPV6] or [IPV6]:PORT \
             (port 0-65535)"
        ))
    };
    let port_of = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| bad(format!("{p:?} is not a port")))
    };
    let is_v6 = |a: &str| {
        // A zone (`fe80::1%eth0`) is allowed after the address.
        let addr = a.split_once('%').map_or(a, |(a, _)| a);
        addr.parse::<std::net::Ipv6Addr>().is_ok()
    };
    if let Some(rest) = s.strip_prefix('[') {
        let Some((h, after)) = rest.split_once(']') else {
            return Err(bad("'[' has no closing ']'".into()));
        };
        if !is_v6(h) {
            return Err(bad(format!("{h:?} in brackets is not an IPv6 address")));
        }
        let port = match after {
            "" => None,
            p => match p.strip_prefix(':') {
                Some(p) => Some(port_of(p)?),
                None => return Err(bad(format!("{after:?} after ']'"))),
            },
        };
        return Ok((h.to_string(), port));
    }
    if s.contains(['[', ']']) {
        return Err(bad("unbalanced brackets".into()));
    }
    let (host, port) = match s.matches(':').count() {
        0 => (s, None),
        1 => {
            let (h, p) = s.split_once(':').unwrap_or((s, ""));
            (h, Some(port_of(p)?))
        }
        _ if is_v6(s) => return Ok((s.to_string(), None)),
        _ => {
            return Err(bad(
                "several ':' but not an IPv6 address (an IPv6 address with a port is written \
                 [ADDR]:PORT)"
                    .into(),
            ));
        }
    };
    if host.is_empty() {
        return Err(bad("no host".into()));
    }
    if !host
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(bad(format!(
            "{host:?} is not a host name or address (letters, digits, '-', '.', '_')"
        )));
    }
    Ok((host.to_string(), port))
}

pub(super) fn resolve_store(
    rdzv: &RendezvousArgs,
    nnodes: usize,
    uses_hosts: bool,
) -> Result<StorePlan> {
    let RendezvousArgs {
        nnodes: _,
        node_rank,
        master_addr,
        master_port,
        standalone,
        rdzv_endpoint,
        // nrun always hosts its own store; accepted for torchrun's command lines.
        rdzv_backend: _,
        // Read with the nodes (join_timeout).
        rdzv_conf: _,
        rdzv_id: _,
        store_max_bytes: _,
        local_addr,
    } = rdzv;
    let (mut addr, mut port) = (master_addr.clone(), *master_port);
    if let Some(ep) = rdzv_endpoint {
        let (h, p) = split_host_port(ep)?;
        addr = addr.or(Some(h));
        port = port.or(p);
    }
    // With a host list nrun starts every node itself and hosts the one store here.
    if uses_hosts {
        return Ok(StorePlan::Host {
            port: port.unwrap_or(0),
            advertise: String::new(),
        });
    }
    if *standalone && nnodes > 1 {
        return Err(Error::usage(
            "--standalone is a single-node mode; drop it or use --nnodes 1",
        ));
    }
    if nnodes == 1 {
        let advertise = local_addr
            .clone()
            .or(addr.filter(|a| !matches!(a.as_str(), "localhost" | "127.0.0.1" | "::1" | "")))
            .unwrap_or_else(|| "127.0.0.1".into());
        return Ok(StorePlan::Host {
            port: port.unwrap_or(0),
            advertise,
        });
    }
    // Static multi-node as torchrun: every node runs nrun with the same --master-addr/-port.
    let Some(addr) = addr else {
        return Err(Error::usage(format!(
            "--nnodes {nnodes} needs --master-addr (or --rdzv-endpoint): the address of node rank 0, \
             which hosts the store"
        )));
    };
    let port = port.unwrap_or(29500);
    // c10d: the node that binds the endpoint's port hosts the store (decided at start).
    if node_rank.unwrap_or(0) == 0 {
        Ok(StorePlan::Host {
            port,
            advertise: local_addr.clone().unwrap_or(addr),
        })
    } else {
        Ok(StorePlan::Remote { addr, port })
    }
}

/// torchrun's c10d rendezvous, when asked for (`--rdzv-backend c10d`), or implied (an endpoint
/// and several nodes without `--node-rank`, where a static launch would make every node rank 0).
fn resolve_c10d(
    rdzv: &RendezvousArgs,
    nnodes: usize,
    uses_hosts: bool,
    run_id: &str,
    env: Env<'_>,
) -> Result<Option<C10d>> {
    let backend = rdzv.rdzv_backend.as_deref().unwrap_or("static");
    if !matches!(backend, "static" | "c10d") {
        return Err(Error::usage(format!(
            "--rdzv-backend {backend:?}: nrun serves static and c10d rendezvous itself (etcd is \
             not needed); use c10d"
        )));
    }
    let endpoint = rdzv
        .rdzv_endpoint
        .as_deref()
        .or(rdzv.master_addr.as_deref());
    let wanted = backend == "c10d" || (endpoint.is_some() && rdzv.node_rank.is_none());
    if nnodes < 2 || uses_hosts || !wanted {
        return Ok(None);
    }
    if rdzv.node_rank.is_some() {
        return Err(Error::usage(
            "--rdzv-backend c10d assigns node ranks in join order: drop --node-rank (or use the \
             static backend, where every node gives its own)",
        ));
    }
    let Some(ep) = endpoint else {
        return Err(Error::usage(
            "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]: the host whose nrun hosts the \
             store (the same on every node)",
        ));
    };
    let flag = match rdzv.rdzv_endpoint {
        Some(_) => "--rdzv-endpoint",
        None => "--master-addr",
    };
    let (host, port) = split_endpoint(flag, ep)?;
    let port = port.or(rdzv.master_port).unwrap_or(29400);
    if port == 0 {
        return Err(Error::usage(
            "--rdzv-endpoint: every node must know the port; give one (e.g. HOST:29400)",
        ));
    }
    let secret = env("NRUN_RDZV_SECRET")
        .filter(|s| !s.is_empty())
        .map(|s| nrun_store::auth::derive(s.as_bytes(), run_id));
    Ok(Some(C10d {
        host,
        port,
        id: run_id.to_string(),
        secret,
        node: None,
        took_over: None,
    }))
}

/// `srun --ntasks-per-node=1 nrun ...` (torchrun's `srun torchrun` form): one nrun per node of
/// a step of several nodes. Node SLURM_NODEID 0 hosts the store on a port derived from the job
/// and step ids; the others join it as their node index. None: not inside such a step.
fn slurm_every_node(env: Env<'_>) -> Result<Option<(usize, C10d)>> {
    let (Some(step), Some(nodes)) = (env("SLURM_STEP_ID"), env("SLURM_STEP_NUM_NODES")) else {
        return Ok(None);
    };
    let nodes: usize = nodes.trim().parse().unwrap_or(1);
    if nodes < 2 {
        return Ok(None);
    }
    let tasks: usize = env("SLURM_STEP_NUM_TASKS")
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(nodes);
    if tasks != nodes {
        return Err(Error::usage(format!(
            "this srun step runs {tasks} tasks on {nodes} nodes: nrun starts the workers itself, \
             one nrun per node (srun --ntasks-per-node=1 nrun --nproc N ...)"
        )));
    }
    let node: usize = env("SLURM_NODEID")
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| Error::usage("SLURM_NODEID is not set in this srun step"))?;
    let list = env("SLURM_STEP_NODELIST")
        .or_else(|| env("SLURM_JOB_NODELIST"))
        .ok_or_else(|| Error::usage("SLURM_STEP_NODELIST is not set in this srun step"))?;
    let first = crate::hosts::expand_slurm_hostlist(&list)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::usage(format!("SLURM_STEP_NODELIST {list:?} names no node")))?;
    let job: u64 = env("SLURM_JOB_ID")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let step: u64 = step.trim().parse().unwrap_or(0);
    // Steps of one job, and jobs sharing a node, get different ports.
    let port = 20000 + ((job * 64 + step) % 20000) as u16;
    let id = format!("slurm-{job}.{step}");
    let secret = env("NRUN_RDZV_SECRET")
        .filter(|s| !s.is_empty())
        .map(|s| nrun_store::auth::derive(s.as_bytes(), &id));
    Ok(Some((
        nodes,
        C10d {
            host: first,
            port,
            id,
            secret,
            node: Some(node),
            took_over: None,
        },
    )))
}

/// A random (version 4) UUID, as torchrun's standalone run ids. The bytes come from
/// [`nrun_base::random_bytes`]: no randomness is an error here, where `Uuid::new_v4` panics.
fn uuid4() -> Result<String> {
    let mut b = [0u8; 16];
    nrun_base::random_bytes(&mut b)
        .map_err(|e| Error::internal(format!("cannot read random bytes: {e}")))?;
    Ok(uuid::Builder::from_random_bytes(b)
        .into_uuid()
        .hyphenated()
        .to_string())
}

/// torchrun's default wait for more nodes once MIN have joined.
pub(super) const LAST_CALL: Duration = Duration::from_secs(30);

/// torchrun's boolean spellings (`RendezvousParameters.get_as_bool`), any case.
fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "t" | "yes" | "y" => Some(true),
        "0" | "false" | "f" | "no" | "n" => Some(false),
        _ => None,
    }
}

/// Unknown `--rdzv-conf` keys named in the one warning line, at most.
const UNKNOWN_KEYS_SHOWN: usize = 8;

/// `--rdzv-conf k=v,...` (torchrun's keys): the join timeout, if given, and the last call.
/// Every key nrun knows has its value checked (durations finite and in range, booleans as
/// torch spells them, counts whole numbers), even those with no effect here; unknown keys are
/// warned about once, in one line.
fn parse_rdzv_conf(s: Option<&str>) -> Result<(Option<Duration>, Duration)> {
    let (mut join, mut last) = (None, LAST_CALL);
    let mut unknown: Vec<&str> = Vec::new();
    for kv in s
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|k| !k.is_empty())
    {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(Error::usage(format!(
                "--rdzv-conf {kv:?}: expected KEY=VALUE, e.g. join_timeout=600"
            )));
        };
        let (k, v) = (k.trim(), v.trim());
        let secs = || -> Result<Duration> {
            v.parse::<f64>()
                .ok()
                .and_then(|n| positive_secs(k, n, true).ok())
                .ok_or_else(|| {
                    Error::usage(format!(
                        "--rdzv-conf {k}={v}: expected a number of seconds, from 0 to \
                         {MAX_SECS:.0}"
                    ))
                })
        };
        match k {
            "join_timeout" => join = Some(secs()?),
            "last_call_timeout" => last = secs()?,
            "timeout" | "close_timeout" | "read_timeout" | "keep_alive_interval" => {
                secs()?;
            }
            "is_host" | "use_libuv" => {
                if parse_bool(v).is_none() {
                    return Err(Error::usage(format!(
                        "--rdzv-conf {k}={v}: expected a boolean: true, false, 1, 0, yes, no \
                         (also t, f, y, n)"
                    )));
                }
            }
            "keep_alive_max_attempt" => {
                if v.parse::<u32>().is_err() {
                    return Err(Error::usage(format!(
                        "--rdzv-conf {k}={v}: expected a whole number from 0 to {}",
                        u32::MAX
                    )));
                }
            }
            "store_type" => {
                if v.is_empty() {
                    return Err(Error::usage(format!(
                        "--rdzv-conf {k}=: expected a store type, e.g. tcp"
                    )));
                }
            }
            other => {
                if !unknown.contains(&other) {
                    unknown.push(other);
                }
            }
        }
    }
    if join.is_some_and(|j| j.is_zero()) {
        return Err(Error::usage("--rdzv-conf join_timeout must be more than 0"));
    }
    if !unknown.is_empty() {
        tracing::warn!("{}", unknown_keys_line(&unknown));
    }
    Ok((join, last))
}

/// The one line about unknown `--rdzv-conf` keys: the first few named, the rest counted.
fn unknown_keys_line(unknown: &[&str]) -> String {
    let shown: Vec<String> = unknown
        .iter()
        .take(UNKNOWN_KEYS_SHOWN)
        .map(|k| format!("{k:?}"))
        .collect();
    let more = match unknown.len().saturating_sub(UNKNOWN_KEYS_SHOWN) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    let (noun, verb) = match unknown.len() {
        1 => ("key", "has"),
        _ => ("keys", "have"),
    };
    format!(
        "--rdzv-conf: {} unknown {noun} ({}{more}) {verb} no meaning for nrun and {} ignored; \
         nrun knows join_timeout, last_call_timeout, timeout, close_timeout, read_timeout, \
         keep_alive_interval, keep_alive_max_attempt, is_host, use_libuv, store_type",
        unknown.len(),
        shown.join(", "),
        if unknown.len() == 1 { "is" } else { "are" },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A standalone run id is a random version-4 UUID in torchrun's form (lowercase, hyphens,
    /// the version and RFC 4122 variant nibbles), a new one each time.
    #[test]
    fn standalone_run_ids_are_uuid4() {
        let (a, b) = (uuid4().unwrap(), uuid4().unwrap());
        assert_ne!(a, b);
        for id in [&a, &b] {
            let parts: Vec<&str> = id.split('-').collect();
            assert_eq!(
                parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
                [8, 4, 4, 4, 12],
                "{id}"
            );
            assert!(
                id.bytes()
                    .all(|c| c == b'-' || c.is_ascii_digit() || (b'a'..=b'f').contains(&c)),
                "{id}"
            );
            assert!(parts[2].starts_with('4'), "{id}");
            assert!(parts[3].starts_with(['8', '9', 'a', 'b']), "{id}");
        }
    }

    #[test]
    fn addresses_checked() {
        for good in [
            "gpu1",
            "10.0.0.1",
            "fe80::1",
            "fe80::1%eth0",
            "node-1.example_x",
        ] {
            check_host("--master-addr", good).unwrap();
        }
        for bad in ["", "[::1]", "[::1", "h:29500", "a b", "h/x", "é"] {
            let e = check_host("--master-addr", bad).unwrap_err();
            assert_eq!(e.code, nrun_base::error::exit::USAGE, "{bad:?}");
            assert!(e.message.contains("expected a host name"), "{}", e.message);
        }
    }

    #[test]
    fn endpoints_malformed_are_refused() {
        for bad in [
            "[::1",
            "[::1]x",
            "[::1]:",
            "[::1]:70000",
            "[nope]:1",
            "::1]",
            "a]",
            "host:",
            ":80",
            "a:b:c:d",
            "h st:1",
            "h/x",
            "",
            "[]:1",
        ] {
            let e = split_endpoint("--rdzv-endpoint", bad).unwrap_err();
            assert_eq!(e.code, nrun_base::error::exit::USAGE, "{bad:?}");
            assert!(
                e.message.contains("expected HOST, HOST:PORT"),
                "{}",
                e.message
            );
        }
        assert_eq!(
            split_endpoint("--rdzv-endpoint", "[fe80::1%eth0]:7").unwrap(),
            ("fe80::1%eth0".into(), Some(7))
        );
        assert_eq!(
            split_endpoint("--rdzv-endpoint", "[::1]").unwrap(),
            ("::1".into(), None)
        );
        assert_eq!(
            split_endpoint("--rdzv-endpoint", "node-1.example_x:0").unwrap(),
            ("node-1.example_x".into(), Some(0))
        );
    }

    #[test]
    fn rdzv_conf_values_checked() {
        for bad in [
            "timeout=1e400",
            "timeout=nan",
            "read_timeout=-1",
            "close_timeout=x",
            "last_call_timeout=inf",
            "keep_alive_interval=1e9",
            "is_host=maybe",
            "use_libuv=2",
            "keep_alive_max_attempt=-1",
            "store_type=",
        ] {
            let e = parse_rdzv_conf(Some(bad)).unwrap_err();
            assert_eq!(e.code, nrun_base::error::exit::USAGE, "{bad:?}");
        }
        for good in [
            "is_host=true",
            "is_host=0",
            "is_host=YES",
            "use_libuv=no",
            "timeout=0",
        ] {
            parse_rdzv_conf(Some(good)).unwrap();
        }
        let (join, last) = parse_rdzv_conf(Some("join_timeout=5, last_call_timeout=1.5")).unwrap();
        assert_eq!(join, Some(Duration::from_secs(5)));
        assert_eq!(last, Duration::from_millis(1500));
    }

    #[test]
    fn unknown_rdzv_conf_keys_are_one_line() {
        let keys: Vec<String> = (0..5000).map(|i| format!("k{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let line = unknown_keys_line(&refs);
        assert!(!line.contains('\n'));
        assert!(line.contains("5000 unknown keys"), "{line}");
        assert!(line.contains("and 4992 more"), "{line}");
        assert!(line.len() < 400, "{line}");
        assert!(unknown_keys_line(&["x"]).contains("1 unknown key (\"x\") has"));
    }

    #[test]
    fn booleans_as_torch_spells_them() {
        for t in ["1", "true", "TRUE", "t", "yes", "Y"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["0", "false", "F", "no", "n"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        for x in ["maybe", "", "2", "on"] {
            assert_eq!(parse_bool(x), None, "{x}");
        }
    }

    #[test]
    fn endpoints() {
        assert_eq!(split_host_port("h:5").unwrap(), ("h".into(), Some(5)));
        assert_eq!(split_host_port("[::1]:5").unwrap(), ("::1".into(), Some(5)));
        assert_eq!(
            split_host_port("fe80::1").unwrap(),
            ("fe80::1".into(), None)
        );
        assert!(split_host_port("h:x").is_err());
    }
}
