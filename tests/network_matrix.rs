//! The network diagnosis matrix: every row of docs/network-matrix.md's table (between the
//! `network-matrix` markers), run for real. Rows: a network fault (made with tc, iptables, ip or
//! a mount in a namespace host's namespaces) x what nrun runs (the launch's checks, the net
//! preflight, bisect's net probe) x the expected exit code, words, the nodes bisect names and a
//! time bound. The cluster's rows share one cluster of 8 namespace hosts with sshd, each row's
//! fault undone after it (also when it fails); every row is run and the failures are listed
//! together. The expected columns are the docs': a change of verdict changes both.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

#[derive(Debug, Clone)]
struct Row {
    fault: String,
    /// None: a static launch on this machine alone.
    nodes: Option<usize>,
    runs: String,
    exit: i32,
    says: Vec<String>,
    /// Bisect's nodes not good: (host placeholder, verdict).
    named: Vec<(String, String)>,
    within: Duration,
}

/// The matrix's rows (docs/network-matrix.md).
fn rows() -> Vec<Row> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/network-matrix.md"
    ))
    .expect("docs/network-matrix.md");
    let table = doc
        .split("<!-- network-matrix begin -->")
        .nth(1)
        .and_then(|t| t.split("<!-- network-matrix end -->").next())
        .expect("docs/network-matrix.md has the network-matrix markers");
    let mut out = Vec::new();
    for line in table.lines().filter(|l| l.starts_with('|')).skip(2) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 7, "a network-matrix row has 7 cells: {line}");
        out.push(Row {
            fault: cells[0].replace('`', ""),
            nodes: match cells[1] {
                "static" => None,
                n => Some(n.parse().unwrap_or_else(|_| panic!("nodes in {line}"))),
            },
            runs: cells[2].into(),
            exit: cells[3]
                .parse()
                .unwrap_or_else(|_| panic!("exit in {line}")),
            says: cells[4]
                .split('"')
                .skip(1)
                .step_by(2)
                .map(String::from)
                .collect(),
            named: match cells[5] {
                "-" => Vec::new(),
                n => n
                    .split(',')
                    .map(|x| {
                        let (h, v) = x.trim().split_once(' ').expect("named: HOST VERDICT");
                        (h.to_string(), v.to_string())
                    })
                    .collect(),
            },
            within: Duration::from_secs(
                cells[6]
                    .parse()
                    .unwrap_or_else(|_| panic!("within in {line}")),
            ),
        });
    }
    assert!(
        !out.is_empty(),
        "docs/network-matrix.md's matrix has no row"
    );
    out
}

/// The faults this test knows how to make, by the words their rows begin with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    MissingIfname,
    StorePort,
    PortRange,
    Mtu,
    ShapedNode,
    SlowPair,
    Lossy,
    AsymmetricRoute,
    SharedHostname,
    ExtraInterface,
    LoopbackName,
    NoResolution,
    StaticNode0,
    OtherProgram,
}

const FAULTS: [(&str, Fault); 14] = [
    (
        "NCCL_SOCKET_IFNAME names a missing interface",
        Fault::MissingIfname,
    ),
    ("the store's port firewalled", Fault::StorePort),
    ("ports 1024-65535 firewalled", Fault::PortRange),
    ("one node's MTU different", Fault::Mtu),
    ("one node's link shaped", Fault::ShapedNode),
    ("one pair slow", Fault::SlowPair),
    ("a lossy link", Fault::Lossy),
    ("an asymmetric route", Fault::AsymmetricRoute),
    ("nodes sharing one hostname", Fault::SharedHostname),
    ("a launch host with extra interfaces", Fault::ExtraInterface),
    (
        "one node's hostname resolves to 127.0.1.1",
        Fault::LoopbackName,
    ),
    ("name resolution failing on one node", Fault::NoResolution),
    ("a static node 0 missing", Fault::StaticNode0),
    (
        "another program on the rendezvous port",
        Fault::OtherProgram,
    ),
];

fn fault_of(row: &Row) -> Fault {
    FAULTS
        .iter()
        .find(|(words, _)| row.fault.starts_with(words))
        .map(|(_, f)| *f)
        .unwrap_or_else(|| panic!("no fault of this test begins the row {:?}", row.fault))
}

/// What a row's fault did to the cluster, undone when dropped (a failing row too).
struct Applied<'a> {
    c: &'a Cluster,
    /// (host, command) run to undo, in reverse order.
    undo: Vec<(usize, String)>,
    /// Commands run on the launch host to undo.
    undo_here: Vec<String>,
}

impl Applied<'_> {
    fn on(&mut self, i: usize, cmd: &str, undo: &str) {
        self.c.exec(i, cmd);
        self.undo.push((i, undo.to_string()));
    }

    /// Runs `cmd` in the mount namespace of host i's sshd, which every ssh session there
    /// inherits (the files are the machine's own elsewhere).
    fn mount_on(&mut self, i: usize, cmd: &str, undo: &str) {
        let pid = sshd_pid(self.c, i);
        let st = Command::new("nsenter")
            .args(["-t", &pid, "-m", "sh", "-c", cmd])
            .status()
            .unwrap();
        assert!(st.success(), "in {}'s mounts: {cmd}", self.c.host(i));
        self.undo_here
            .push(format!("nsenter -t {pid} -m sh -c '{undo}'"));
    }
}

impl Drop for Applied<'_> {
    fn drop(&mut self) {
        for (i, cmd) in self.undo.drain(..).rev() {
            let _ = self.c.try_exec(i, cmd.as_str());
        }
        for cmd in self.undo_here.drain(..).rev() {
            let _ = Command::new("sh").args(["-c", &cmd]).status();
        }
    }
}

fn sshd_pid(c: &Cluster, i: usize) -> String {
    std::fs::read_to_string(format!("{}/{}/sshd.pid", c.dir(), c.host(i)))
        .unwrap()
        .trim()
        .to_string()
}

const SHAPE: &str = "tc qdisc replace dev eth0 root tbf rate 100mbit burst 64kbit latency 400ms";
const UNSHAPE: &str = "tc qdisc del dev eth0 root";

/// Shapes what host `i` sends to `to` (its address) alone: htb, one class for that address
/// (htb's note on the quantum of a 10 Gbit/s class is not wanted in the test's output).
fn shape_pair(a: &mut Applied<'_>, i: usize, to: &str) {
    a.on(
        i,
        &format!(
            "{{ tc qdisc add dev eth0 root handle 1: htb default 10 && tc class add dev eth0 \
             parent 1: classid 1:10 htb rate 10gbit && tc class add dev eth0 parent 1: classid \
             1:20 htb rate 100mbit && tc filter add dev eth0 parent 1: protocol ip prio 1 u32 \
             match ip dst {to}/32 flowid 1:20; }} 2>/dev/null"
        ),
        UNSHAPE,
    );
}

/// The row's words with the cluster's names in.
fn fill(s: &str, c: Option<&Cluster>) -> String {
    let Some(c) = c else { return s.to_string() };
    let mut s = s.replace("{launch}", &c.launch_addr());
    for i in 1..=8 {
        s = s.replace(&format!("{{h{i}}}"), &c.host(i));
    }
    s
}

/// A worker that says what it was given: its interface variables and MASTER_ADDR.
const SAY_ENV: &str = "echo ifname=$NCCL_SOCKET_IFNAME,$GLOO_SOCKET_IFNAME master=$MASTER_ADDR";

/// Runs one cluster row; Err: what was wrong.
fn run_row(c: &Cluster, row: &Row) -> Result<(), String> {
    let k = row.nodes.unwrap_or(1);
    let fault = fault_of(row);
    let s = Scene::new();
    let mut a = Applied {
        c,
        undo: Vec::new(),
        undo_here: Vec::new(),
    };
    let mut env: Vec<(&str, String)> = Vec::new();
    let mut extra: Vec<String> = Vec::new();
    let mut worker = vec![SAY_ENV.to_string()];
    let port = free_port().to_string();
    let launch = c.launch_addr();
    let mut mid_run: Option<Box<dyn FnOnce()>> = None;
    match fault {
        Fault::MissingIfname => env.push(("NCCL_SOCKET_IFNAME", "nosuch0".into())),
        Fault::StorePort => {
            a.on(
                2,
                &format!("iptables -A OUTPUT -p tcp -d {launch} --dport {port} -j DROP"),
                "iptables -F OUTPUT",
            );
            extra.extend(["--master-port".into(), port.clone()]);
        }
        Fault::PortRange => a.on(
            3,
            "iptables -A INPUT -p tcp --dport 22 -j ACCEPT && iptables -A INPUT -p tcp -m state \
             --state NEW --dport 1024:65535 -j DROP",
            "iptables -F INPUT",
        ),
        Fault::Mtu => a.on(2, "ip link set eth0 mtu 1400", "ip link set eth0 mtu 1500"),
        Fault::ShapedNode => a.on(3, SHAPE, UNSHAPE),
        Fault::SlowPair => {
            shape_pair(&mut a, 1, &c.addr(2));
            shape_pair(&mut a, 2, &c.addr(1));
        }
        // Between nodes only: the launch host's own traffic (ssh, the store) is spared.
        Fault::Lossy => a.on(
            2,
            &format!(
                "iptables -A INPUT -s {launch} -j ACCEPT && iptables -A INPUT -s {launch}/24 -m \
                 statistic --mode random --probability 0.05 -j DROP"
            ),
            "iptables -F INPUT",
        ),
        Fault::AsymmetricRoute => {
            let other = format!("10.213.{}.99", c.net());
            a.on(
                2,
                &format!(
                    "ip addr add {other}/24 dev eth0 && iptables -t nat -A POSTROUTING -d \
                     {launch} -p tcp --dport {port} -j SNAT --to-source {other}"
                ),
                &format!("iptables -t nat -F; ip addr del {other}/24 dev eth0"),
            );
            extra.extend(["--master-port".into(), port.clone()]);
        }
        Fault::SharedHostname => {
            for i in 1..=k {
                c.set_hostname(i, "twin");
                a.undo_here.push(format!(
                    "nsenter -t {} -u hostname {}",
                    sshd_pid(c, i),
                    c.host(i)
                ));
            }
            a.on(3, SHAPE, UNSHAPE);
        }
        Fault::ExtraInterface => {
            let name = format!("{}-x", c.name);
            let addr = format!("10.214.{}.1", c.net());
            let add = format!(
                "ip link add {name} type bridge && ip link add {name}a type veth peer name \
                 {name}b && ip link set {name}a master {name} && ip link set {name}a up && ip \
                 link set {name}b up && ip addr add {addr}/24 dev {name} && ip link set {name} up"
            );
            let del = format!("ip link del {name}a; ip link del {name}");
            c.exec_here(&add);
            a.undo_here.push(del.clone());
            // Every node routes to every address of the launch host, so a race could take any.
            for i in 1..=k {
                a.on(
                    i,
                    &format!("ip route add default via {launch}"),
                    "ip route del default",
                );
            }
            let started = s.dir.path().join("started");
            let go = s.dir.path().join("go");
            std::fs::create_dir_all(&started).unwrap();
            worker = vec![format!(
                "{SAY_ENV}; touch {}/$RANK; while [ ! -e {} ]; do sleep 0.05; done",
                started.display(),
                go.display()
            )];
            mid_run = Some(Box::new(move || {
                wait_until("every worker started", || {
                    std::fs::read_dir(&started).is_ok_and(|d| d.count() == k)
                });
                // The other interface goes while the job runs.
                let _ = Command::new("sh").args(["-c", &del]).status();
                std::fs::write(&go, "").unwrap();
            }));
        }
        Fault::LoopbackName => {
            let hosts = s.dir.path().join("hosts-loopback");
            std::fs::write(
                &hosts,
                format!("127.0.0.1 localhost\n127.0.1.1 {}\n", c.host(2)),
            )
            .unwrap();
            a.mount_on(
                2,
                &format!("mount --bind {} /etc/hosts", hosts.display()),
                "umount /etc/hosts",
            );
        }
        Fault::NoResolution => {
            let (hosts, resolv) = (s.dir.path().join("hosts"), s.dir.path().join("resolv"));
            std::fs::write(&hosts, "").unwrap();
            std::fs::write(
                &resolv,
                "nameserver 192.0.2.1\noptions timeout:1 attempts:1\n",
            )
            .unwrap();
            a.mount_on(
                2,
                &format!(
                    "mount --bind {} /etc/hosts && mount --bind {} /etc/resolv.conf",
                    hosts.display(),
                    resolv.display()
                ),
                "umount /etc/resolv.conf; umount /etc/hosts",
            );
        }
        Fault::StaticNode0 | Fault::OtherProgram => unreachable!("a static row"),
    }
    let hosts = c.hosts(k);
    let opts = c.ssh_opts();
    let good = s.dir.path().join("good");
    let mut args: Vec<String> = match row.runs.as_str() {
        "bisect net" => vec![
            "bisect".into(),
            "--probe".into(),
            "net".into(),
            "--write-hostfile".into(),
            good.display().to_string(),
            "--preflight-timeout".into(),
            "10".into(),
            "--timeout".into(),
            "60".into(),
        ],
        _ => Vec::new(),
    };
    args.extend(
        [
            "-H",
            &hosts,
            "--ssh-opts",
            &opts,
            "--no-python-probe",
            "--nproc",
            "1",
        ]
        .map(String::from),
    );
    args.extend(extra);
    match row.runs.as_str() {
        "launch" => {
            args.extend(["--no-python".into(), "sh".into(), "-c".into()]);
            args.extend(worker);
        }
        "preflight net" => {
            args.extend(["--preflight-only", "--preflight", "net"].map(String::from))
        }
        "bisect net" => {}
        r => panic!("a row runs launch, preflight net or bisect net, not {r}"),
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let envs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let w = Watched::new(s.spawn(&argv, &envs));
    if let Some(f) = mid_run {
        f();
    }
    let (out, took) = w.finish();
    drop(a);
    let r = judge(
        row,
        Some(c),
        &out,
        took,
        &std::fs::read_to_string(&good).unwrap_or_default(),
    );
    s.assert_no_survivors();
    r
}

/// The row's columns against what nrun did.
fn judge(
    row: &Row,
    c: Option<&Cluster>,
    out: &std::process::Output,
    took: Duration,
    good: &str,
) -> Result<(), String> {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    let all = format!("{stdout}\n{stderr}");
    let mut wrong = Vec::new();
    if out.status.code() != Some(row.exit) {
        wrong.push(format!("exit {:?}, not {}", out.status.code(), row.exit));
    }
    for say in &row.says {
        let say = fill(say, c);
        if !all.contains(&say) {
            wrong.push(format!("does not say {say:?}"));
        }
    }
    if took > row.within {
        wrong.push(format!(
            "took {:.1} s, over its bound of {} s",
            took.as_secs_f64(),
            row.within.as_secs()
        ));
    }
    if row.runs == "bisect net" {
        let k = row.nodes.unwrap_or(0);
        let c = c.expect("bisect rows run on the cluster");
        let verdicts: Vec<(String, String)> = stdout
            .lines()
            .skip_while(|l| !l.starts_with("node "))
            .skip(1)
            .take_while(|l| !l.contains(" rounds ("))
            .map(|l| {
                let mut w = l.split_whitespace();
                (
                    w.next().unwrap_or("").to_string(),
                    w.next().unwrap_or("").to_string(),
                )
            })
            .collect();
        if verdicts.len() != k {
            wrong.push(format!("{} verdicts for {k} nodes", verdicts.len()));
        }
        for (h, v) in &verdicts {
            let want = row
                .named
                .iter()
                .find(|(n, _)| fill(n, Some(c)) == *h)
                .map_or("good", |(_, v)| v.as_str());
            if v != want {
                wrong.push(format!("{h} is {v}, not {want}"));
            }
            let kept = good.lines().any(|l| l.trim() == h);
            if kept != (want == "good") {
                wrong.push(format!(
                    "{h} {} --write-hostfile",
                    if kept { "kept in" } else { "left out of" }
                ));
            }
        }
        if all.contains("too few") {
            wrong.push("said \"too few\"".into());
        }
    }
    match wrong.is_empty() {
        true => Ok(()),
        false => Err(format!(
            "{}\n---- stdout\n{stdout}\n---- stderr\n{stderr}",
            wrong.join("; ")
        )),
    }
}

/// Each row of the table begins with a fault this test makes, and every fault it makes has a
/// row: the table and the test stay equal.
#[test]
fn the_table_and_the_test_name_the_same_faults() {
    let rows = rows();
    for r in &rows {
        fault_of(r);
    }
    for (words, f) in FAULTS {
        assert!(
            rows.iter().any(|r| fault_of(r) == f),
            "no row of docs/network-matrix.md for {words:?}"
        );
    }
}

/// Every row on namespace hosts: one cluster of 8, each row's fault made and undone.
#[test]
fn the_cluster_rows() {
    let rows: Vec<Row> = rows().into_iter().filter(|r| r.nodes.is_some()).collect();
    let Some(c) = Cluster::up("nm", 8) else {
        return;
    };
    let mut failed = Vec::new();
    for row in &rows {
        let label = format!(
            "{} | {} | {} nodes",
            row.fault,
            row.runs,
            row.nodes.unwrap_or(0)
        );
        eprintln!("network matrix: {label}");
        if let Err(e) = run_row(&c, row) {
            failed.push(format!("{label}: {e}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} rows wrong:\n{}",
        failed.len(),
        rows.len(),
        failed.join("\n\n")
    );
    c.assert_nothing_left(8);
}

/// The static rows, on this machine alone.
#[test]
fn the_static_rows() {
    let mut failed = Vec::new();
    let rows: Vec<Row> = rows().into_iter().filter(|r| r.nodes.is_none()).collect();
    for row in &rows {
        let s = Scene::new();
        let port = free_port().to_string();
        // Something else on the port: a listener that answers with a line of its own.
        let _other = match fault_of(row) {
            Fault::OtherProgram => {
                let l = std::net::TcpListener::bind(("127.0.0.1", port.parse::<u16>().unwrap()))
                    .unwrap();
                Some(std::thread::spawn(move || {
                    use std::io::Write;
                    for c in l.incoming().flatten().take(64) {
                        let mut c = c;
                        let _ = c.write_all(b"SSH-2.0-OpenSSH_9.2\r\n");
                    }
                }))
            }
            _ => None,
        };
        let args: Vec<&str> = match fault_of(row) {
            // A node of the static form meeting at node 0's store: none there, or the other
            // program listening where it should be.
            Fault::StaticNode0 | Fault::OtherProgram => {
                let mut a = setup::static_args("1", &port, "10");
                a.extend(["--nproc", "1", "--no-python", "true"]);
                a
            }
            f => panic!("{f:?} is not a static row's fault"),
        };
        let w = Watched::new(s.spawn(&args, &[]));
        let (out, took) = w.finish();
        if let Err(e) = judge(row, None, &out, took, "") {
            failed.push(format!("{}: {e}", row.fault));
        }
        s.assert_no_survivors();
    }
    assert!(
        failed.is_empty(),
        "{} of {} rows wrong:\n{}",
        failed.len(),
        rows.len(),
        failed.join("\n\n")
    );
}
