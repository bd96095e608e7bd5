//! Set-up that several test binaries share: the flags of a c10d node, of a hang the watch
//! stops, of a short net preflight, and the ledger's phase names.

/// The phases of a job's ledger (`ledger.phases` in the report), in the journal's order.
pub(crate) const LEDGER_PHASES: [&str; 11] = [
    "launch",
    "join",
    "checks",
    "preflight",
    "starting",
    "running",
    "detecting",
    "stopping",
    "restarting",
    "waiting",
    "ending",
];

/// The flags of one node of a 2-node c10d rendezvous `id` at `endpoint` that waits up to
/// `join_timeout` seconds for the other (the target follows).
pub(crate) fn c10d_args<'a>(endpoint: &'a str, id: &'a str, join_timeout: &'a str) -> Vec<&'a str> {
    vec![
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        id,
        "--join-timeout",
        join_timeout,
    ]
}

/// A static launch's node `rank` of 2 meeting at 127.0.0.1:`port` (torchrun's
/// --node-rank/--master-addr form), waiting up to `join_timeout` seconds.
pub(crate) fn static_args<'a>(rank: &'a str, port: &'a str, join_timeout: &'a str) -> Vec<&'a str> {
    vec![
        "--nnodes",
        "2",
        "--node-rank",
        rank,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--join-timeout",
        join_timeout,
    ]
}

/// tests/python/hang.py: a gloo job whose ranks hang, stall, disagree or fail as
/// NRUN_HANG_CASE says.
pub(crate) fn hang_script() -> String {
    super::py_script("hang.py")
}

/// The flags of a 2-rank job under python `py` whose hang the watch stops after 4 s (other
/// flags, then the script, follow).
pub(crate) fn stopped_hang_args(py: &str) -> Vec<&str> {
    vec![
        "--nproc",
        "2",
        "--python",
        py,
        "--hang-timeout",
        "4",
        "--on-hang",
        "stop",
    ]
}

/// A net preflight alone on 3 local ranks, a short sweep (8 B to 1 MiB, x4: nine sizes).
pub(crate) fn net_preflight_args() -> Vec<&'static str> {
    vec![
        "--preflight-only",
        "--preflight",
        "net",
        "--nproc",
        "3",
        "--preflight-sizes",
        "8:1M:4",
    ]
}
