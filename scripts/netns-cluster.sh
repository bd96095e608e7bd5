#!/usr/bin/env bash
# A small cluster of "hosts" on this one Linux machine, for multi-node tests: each host is a
# network namespace with its own eth0, address and sshd; all hosts hang off one bridge in the
# root namespace, which also holds an address on it (the launch host in tests).
#
#   scripts/netns-cluster.sh up K [NAME]     build K hosts (2..32) of cluster NAME (default nrt);
#                                            tears down an existing NAME first; prints the
#                                            ssh_config path as its last line (stdout)
#   scripts/netns-cluster.sh down [NAME]     remove everything of that cluster (idempotent)
#   scripts/netns-cluster.sh status [NAME]   list hosts, addresses, sshd pids
#
# Needs root, iproute2 (ip netns, bridge, veth) and openssh (sshd, ssh, ssh-keygen).
#
# Address scheme: N = (cksum of NAME) % 200 + 20, subnet 10.213.N.0/24, bridge ${NAME}-br in the
# root namespace = 10.213.N.1, host i (namespace ${NAME}-h$i, interface eth0, root-side veth
# ${NAME}-v$i) = 10.213.N.(10+i). No default route, no forwarding, no NAT: traffic stays inside
# the subnet. IPv6 is off on eth0, the veths and the bridge (lo keeps ::1).
#
# Each host's sshd runs in its own UTS namespace too, so `hostname` there prints the host's
# alias (${NAME}-h$i) and hostname-keyed code (NCCL's host hash, ...) sees distinct hosts. The
# filesystem, users and processes' view of /proc are shared with the machine on purpose.
#
# State: ${NRUN_CLUSTER_DIR:-/tmp/nrun-cluster}/NAME/
#   id_ed25519, id_ed25519.pub   client key (the only key in authorized_keys)
#   authorized_keys
#   ssh_config                   a Host ${NAME}-h$i block per host (and one for 10.213.N.*)
#   hosts                        one alias a line
#   cluster.env                  NRUN_CLUSTER_{NAME,HOSTS,NET,SUBNET,LAUNCH_ADDR,SSH_CONFIG}=...
#   ${NAME}-h$i/                 sshd_config, ssh_host_ed25519_key(.pub), sshd.pid, sshd.log
#   created, .nrun-netns-cluster what up created (for down), ownership marker
#
# The script does not use iptables; tests may run `ip netns exec ${NAME}-h2 iptables ...`.
# Env: NRUN_CLUSTER_DIR (state root), NRUN_CLUSTER_KEEP=1 (leave a failed `up` in place).
set -euo pipefail

prog=netns-cluster.sh
MARK_PREFIX=nrun-netns-cluster
SSHD=${SSHD:-/usr/sbin/sshd}

usage() {
  cat >&2 <<EOF
usage: $prog up K [NAME]     build K hosts (2..32), cluster NAME (default nrt)
       $prog down [NAME]     remove everything of cluster NAME
       $prog status [NAME]   list hosts, addresses, sshd pids
NAME: 1..11 characters of [A-Za-z0-9_-], starting with a letter or digit.
EOF
  exit 2
}

die() { echo "$prog: $*" >&2; exit 1; }
note() { echo "$prog: $*" >&2; }

# ---------------------------------------------------------------- arguments and names

set_name() {
  NAME=${1:-nrt}
  # ${NAME}-v32 must fit in IFNAMSIZ-1 = 15 characters.
  [[ $NAME =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,10}$ ]] || {
    echo "$prog: bad cluster name '$NAME'" >&2
    usage
  }
  BASE=${NRUN_CLUSTER_DIR:-/tmp/nrun-cluster}
  [[ $BASE == /* ]] || BASE="$PWD/$BASE"
  while [[ $BASE == */ && $BASE != / ]]; do BASE=${BASE%/}; done
  STATE="$BASE/$NAME"
  local sum
  sum=$(printf '%s' "$NAME" | cksum | cut -d' ' -f1)
  NET=$((sum % 200 + 20))
  PREFIX="10.213.$NET"
  BRIDGE="$NAME-br"
  MARK="$MARK_PREFIX:$NAME"
}

ns_of() { echo "$NAME-h$1"; }
veth_of() { echo "$NAME-v$1"; }
addr_of() { echo "$PREFIX.$((10 + $1))"; }

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (network namespaces, bridge, sshd)"
}

need_tools() {
  local t
  for t in ip ssh ssh-keygen cksum unshare; do
    command -v "$t" >/dev/null 2>&1 || die "missing tool: $t"
  done
  [ -x "$SSHD" ] || die "missing $SSHD (install openssh-server)"
}

# Serialise up/down of all clusters on this machine (they are quick). Locks the script file
# itself so nothing is left behind.
take_lock() {
  command -v flock >/dev/null 2>&1 || return 0
  exec 9<"${BASH_SOURCE[0]}"
  flock -w 120 9 || die "could not lock ${BASH_SOURCE[0]} within 120 s (another up/down running?)"
}

# ---------------------------------------------------------------- ownership checks

link_is_ours() { # link name in the root namespace
  [ -e "/sys/class/net/$1" ] && [ "$(cat "/sys/class/net/$1/ifalias" 2>/dev/null)" = "$MARK" ]
}

netns_exists() { [ -e "/run/netns/$1" ]; }

netns_is_ours() { # namespace name: its eth0 carries our alias
  local out
  netns_exists "$1" && out=$(ip -n "$1" link show dev eth0 2>/dev/null) && grep -qxF "    alias $MARK" <<<"$out"
}

in_manifest() { # kind name
  [ -f "$STATE/created" ] && grep -qxF "$1 $2" "$STATE/created"
}

record() { echo "$1 $2" >>"$STATE/created"; }

# Namespaces / links of this cluster that exist now and that we created.
our_netns() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns =~ ^${NAME}-h[0-9]+$ ]] || continue
    if in_manifest netns "$ns" || netns_is_ours "$ns"; then echo "$ns"; fi
  done
}

our_veths() {
  local l
  for l in /sys/class/net/*; do
    l=${l##*/}
    [[ $l =~ ^${NAME}-v[0-9]+$ ]] || continue
    if in_manifest link "$l" || link_is_ours "$l"; then echo "$l"; fi
  done
}

# ---------------------------------------------------------------- down

# Alive and not a zombie (PID 1 in a container may be slow to reap).
pid_alive() {
  kill -0 "$1" 2>/dev/null || return 1
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

# Processes to end: sshds named in our pid files (if their command line still names the state
# dir), any sshd whose command line names it, and every process living in our namespaces
# (ssh sessions and whatever tests started on the hosts).
victims() {
  local f pid line
  for f in "$STATE"/*/sshd.pid; do
    [ -f "$f" ] || continue
    pid=$(tr -dc 0-9 <"$f")
    [ -n "$pid" ] || continue
    line=$(tr "\0" " " 2>/dev/null <"/proc/$pid/cmdline" || true)
    case "$line" in *"$STATE/"*) echo "$pid" ;; esac
  done
  if command -v pgrep >/dev/null 2>&1; then
    pgrep -a sshd 2>/dev/null | while read -r pid line; do
      case "$line" in *"$STATE/"*) echo "$pid" ;; esac
    done || true
  fi
  local ns
  for ns in "$@"; do
    ip netns pids "$ns" 2>/dev/null || true
  done
}

kill_all() { # namespaces...
  local pids p i
  pids=$(victims "$@" | sort -un | grep -vx "$$" || true)
  [ -n "$pids" ] || return 0
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  for i in $(seq 1 40); do # up to 2 s
    local left=
    for p in $pids; do pid_alive "$p" && left="$left $p"; done
    pids=$left
    [ -n "$pids" ] || return 0
    sleep 0.05
  done
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  sleep 0.1
}

do_down() {
  local quiet=${1:-} nss veths ns l failed=0
  nss=$(our_netns)
  veths=$(our_veths)
  # shellcheck disable=SC2086
  kill_all $nss
  for l in $veths; do # deleting one end of a veth deletes both
    ip link del dev "$l" 2>/dev/null || { [ -e "/sys/class/net/$l" ] && { note "could not delete veth $l"; failed=1; }; }
  done
  for ns in $nss; do
    ip netns del "$ns" 2>/dev/null || { netns_exists "$ns" && { note "could not delete namespace $ns"; failed=1; }; }
  done
  if [ -e "/sys/class/net/$BRIDGE" ]; then
    if in_manifest link "$BRIDGE" || link_is_ours "$BRIDGE"; then
      ip link del dev "$BRIDGE" 2>/dev/null || { note "could not delete bridge $BRIDGE"; failed=1; }
    else
      [ -n "$quiet" ] || note "leaving $BRIDGE alone: not made by this script (no '$MARK' alias)"
    fi
  fi
  if [ -d "$STATE" ]; then
    if [ -f "$STATE/.$MARK_PREFIX" ]; then
      [ "$failed" = 1 ] || rm -rf -- "$STATE"
    else
      [ -n "$quiet" ] || note "leaving $STATE alone: not made by this script (no .$MARK_PREFIX file)"
    fi
  fi
  rmdir -- "$BASE" 2>/dev/null || true
  [ "$failed" = 0 ] || die "down $NAME: some parts are left (see above)"
  [ -n "$quiet" ] || note "cluster $NAME is down"
}

# ---------------------------------------------------------------- up

disable_ipv6_root() { # link in root namespace
  local f="/proc/sys/net/ipv6/conf/$1/disable_ipv6"
  if [ -w "$f" ]; then echo 1 >"$f" 2>/dev/null || true; fi
}

write_sshd_config() { # i
  local i=$1 h
  h="$STATE/$(ns_of "$i")"
  cat >"$h/sshd_config" <<EOF
# sshd of host $(ns_of "$i") in netns cluster $NAME; written by nrun scripts/$prog
ListenAddress $(addr_of "$i"):22
AddressFamily inet
HostKey $h/ssh_host_ed25519_key
PidFile $h/sshd.pid
AuthorizedKeysFile $STATE/authorized_keys
UsePAM no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
StrictModes no
UseDNS no
# No AcceptEnv line: the client's environment is not passed on.
PermitUserEnvironment no
X11Forwarding no
PrintMotd no
PrintLastLog no
# Launchers open many sessions at once.
MaxStartups 256
MaxSessions 256
LogLevel INFO
Subsystem sftp internal-sftp
EOF
}

write_ssh_config() { # k
  local k=$1 i f="$STATE/ssh_config"
  {
    echo "# netns cluster $NAME ($k hosts, $PREFIX.0/24); written by nrun scripts/$prog"
    for i in $(seq 1 "$k"); do
      printf '\nHost %s\n  HostName %s\n' "$(ns_of "$i")" "$(addr_of "$i")"
      ssh_options
    done
    printf '\n# The same hosts by address.\nHost %s.*\n' "$PREFIX"
    ssh_options
  } >"$f"
}

ssh_options() {
  cat <<EOF
  User root
  Port 22
  IdentityFile $STATE/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
  ConnectTimeout 5
EOF
}

start_sshd() { # i
  local i=$1 ns h
  ns=$(ns_of "$i")
  h="$STATE/$ns"
  # unshare --uts: a hostname of its own; 9<&-: do not hand our lock to the daemon.
  # shellcheck disable=SC2016
  ip netns exec "$ns" unshare --uts sh -c 'echo "$1" >/proc/sys/kernel/hostname && shift && exec "$@"' \
    sh "$ns" "$SSHD" -f "$h/sshd_config" -E "$h/sshd.log" 9<&- ||
    { show_log "$i"; return 1; }
}

show_log() { # i
  local f
  f="$STATE/$(ns_of "$1")/sshd.log"
  [ -s "$f" ] && { echo "--- $f:" >&2; tail -n 20 "$f" >&2; }
  return 0
}

# Wait for host i's sshd: pid file, then `ssh host true`, within ~10 s.
wait_host() { # i
  local i=$1 ns pidf deadline pid
  ns=$(ns_of "$i")
  pidf="$STATE/$ns/sshd.pid"
  deadline=$((SECONDS + 10))
  while :; do
    if ssh -F "$STATE/ssh_config" "$ns" true </dev/null >/dev/null 2>"$STATE/$ns/ssh.err"; then
      rm -f "$STATE/$ns/ssh.err"
      break
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      note "host $ns ($(addr_of "$i")): 'ssh -F $STATE/ssh_config $ns true' failed for 10 s: $(tr '\n' ' ' <"$STATE/$ns/ssh.err")"
      show_log "$i"
      return 1
    fi
    sleep 0.1
  done
  pid=$(tr -dc 0-9 2>/dev/null <"$pidf" || true)
  if [ -z "$pid" ] || ! pid_alive "$pid"; then
    note "host $ns answers ssh but $pidf names no live sshd"
    return 1
  fi
}

do_up() { # k
  local k=$1 i ns veth addr t0=${EPOCHREALTIME/,/.}
  do_down quiet

  # Another cluster whose name hashes to the same N, or anything else on 10.213.N.0/24?
  local clash
  clash=$( (ip -4 -o route show root "$PREFIX.0/24"; ip -4 -o addr show to "$PREFIX.0/24") 2>/dev/null || true)
  [ -z "$clash" ] || die "subnet $PREFIX.0/24 of cluster $NAME is already routed ($clash); another cluster whose name maps to the same N? pick another NAME"

  # Names of ours that something else holds.
  [ ! -e "/sys/class/net/$BRIDGE" ] || die "a link named $BRIDGE exists and was not made by this script; remove it or pick another NAME"
  for i in $(seq 1 "$k"); do
    ! netns_exists "$(ns_of "$i")" || die "a network namespace named $(ns_of "$i") exists and was not made by this script; remove it or pick another NAME"
    [ ! -e "/sys/class/net/$(veth_of "$i")" ] || die "a link named $(veth_of "$i") exists and was not made by this script; remove it or pick another NAME"
  done
  [ ! -e "$STATE" ] || die "$STATE exists and was not made by this script (no .$MARK_PREFIX file); remove it or set NRUN_CLUSTER_DIR"

  mkdir -p -- "$STATE"
  chmod 700 "$STATE"
  printf '%s\n' "$NAME" >"$STATE/.$MARK_PREFIX"
  : >"$STATE/created"

  ssh-keygen -q -t ed25519 -N '' -C "$NAME-client" -f "$STATE/id_ed25519" >/dev/null ||
    die "ssh-keygen of the client key failed"
  cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
  : >"$STATE/hosts"
  for i in $(seq 1 "$k"); do
    ns=$(ns_of "$i")
    mkdir -p "$STATE/$ns"
    ssh-keygen -q -t ed25519 -N '' -C "$ns" -f "$STATE/$ns/ssh_host_ed25519_key" >/dev/null ||
      die "ssh-keygen of the host key of $ns failed"
    write_sshd_config "$i"
    echo "$ns" >>"$STATE/hosts"
  done
  write_ssh_config "$k"
  cat >"$STATE/cluster.env" <<EOF
NRUN_CLUSTER_NAME=$NAME
NRUN_CLUSTER_HOSTS=$k
NRUN_CLUSTER_NET=$NET
NRUN_CLUSTER_SUBNET=$PREFIX.0/24
NRUN_CLUSTER_LAUNCH_ADDR=$PREFIX.1
NRUN_CLUSTER_SSH_CONFIG=$STATE/ssh_config
EOF

  [ -d /run/sshd ] || mkdir -m 755 /run/sshd || die "cannot create /run/sshd (sshd's privilege separation dir)"

  # Bridge in the root namespace.
  ip link add name "$BRIDGE" type bridge forward_delay 0 || die "cannot create bridge $BRIDGE"
  record link "$BRIDGE"
  ip link set dev "$BRIDGE" alias "$MARK" || die "cannot set alias of $BRIDGE"
  disable_ipv6_root "$BRIDGE"
  ip addr add "$PREFIX.1/24" dev "$BRIDGE" || die "cannot add $PREFIX.1/24 to $BRIDGE"
  ip link set dev "$BRIDGE" up || die "cannot bring $BRIDGE up"

  # Hosts.
  for i in $(seq 1 "$k"); do
    ns=$(ns_of "$i")
    veth=$(veth_of "$i")
    addr=$(addr_of "$i")
    ip netns add "$ns" || die "cannot create network namespace $ns"
    record netns "$ns"
    ip link add name "$veth" type veth peer name eth0 netns "$ns" ||
      die "cannot create veth $veth <-> $ns:eth0"
    record link "$veth"
    ip link set dev "$veth" alias "$MARK" master "$BRIDGE" || die "cannot attach $veth to $BRIDGE"
    disable_ipv6_root "$veth"
    ip link set dev "$veth" up || die "cannot bring $veth up"
    ip -n "$ns" link set dev eth0 alias "$MARK" || die "cannot set alias of eth0 in $ns"
    # shellcheck disable=SC2016
    ip netns exec "$ns" sh -c 'f=/proc/sys/net/ipv6/conf/eth0/disable_ipv6; [ ! -w $f ] || echo 1 >$f' 2>/dev/null || true
    ip -n "$ns" addr add "$addr/24" dev eth0 || die "cannot add $addr/24 to eth0 in $ns"
    ip -n "$ns" link set dev lo up || die "cannot bring lo up in $ns"
    ip -n "$ns" link set dev eth0 up || die "cannot bring eth0 up in $ns"
  done

  for i in $(seq 1 "$k"); do
    start_sshd "$i" || die "sshd of $(ns_of "$i") did not start ($SSHD -f $STATE/$(ns_of "$i")/sshd_config)"
  done

  local pids=() bad=0
  for i in $(seq 1 "$k"); do
    wait_host "$i" &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || bad=$((bad + 1))
  done
  [ "$bad" = 0 ] || die "$bad of $k hosts do not answer ssh"

  local t1=${EPOCHREALTIME/,/.}
  note "cluster $NAME up: $k hosts on $PREFIX.0/24 (launch host $PREFIX.1) in $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s"
  echo "$STATE/ssh_config"
}

# ---------------------------------------------------------------- status

do_status() {
  local ns i addr pid state any=0 bad=0
  echo "cluster $NAME: subnet $PREFIX.0/24, bridge $BRIDGE ($PREFIX.1$( [ -e "/sys/class/net/$BRIDGE" ] || echo ', missing')), state $STATE$( [ -d "$STATE" ] || echo ' (missing)')"
  printf '%-16s %-15s %-8s %s\n' HOST ADDRESS SSHD STATE
  local hosts
  if [ -f "$STATE/hosts" ]; then
    hosts=$(cat "$STATE/hosts")
  else
    hosts=$(our_netns | sort -V)
  fi
  for ns in $hosts; do
    any=1
    i=${ns##*-h}
    addr=$(addr_of "$i")
    pid=$(tr -dc 0-9 2>/dev/null <"$STATE/$ns/sshd.pid" || true)
    if ! netns_exists "$ns"; then
      state="no namespace"
      bad=1
    elif [ -z "$pid" ] || ! pid_alive "$pid"; then
      state="sshd not running"
      bad=1
    elif [[ $(ip -n "$ns" -4 -o addr show dev eth0 2>/dev/null || true) != *" $addr/24 "* ]]; then
      state="eth0 lacks $addr"
      bad=1
    else
      state=ok
    fi
    printf '%-16s %-15s %-8s %s\n' "$ns" "$addr" "${pid:--}" "$state"
  done
  [ "$any" = 1 ] || { echo "(no hosts: cluster $NAME is not up)"; return 1; }
  [ -f "$STATE/ssh_config" ] && echo "ssh_config: $STATE/ssh_config"
  return "$bad"
}

# ---------------------------------------------------------------- main

on_up_exit() {
  local rc=$?
  trap - EXIT
  if [ "$rc" != 0 ]; then
    note "up $NAME failed; tearing down (NRUN_CLUSTER_KEEP=1 keeps it)"
    do_down quiet || true
  fi
  exit "$rc"
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in
  up)
    if [ $# -lt 1 ] || [ $# -gt 2 ]; then usage; fi
    if ! [[ $1 =~ ^[0-9]{1,2}$ ]] || [ "$((10#$1))" -lt 2 ] || [ "$((10#$1))" -gt 32 ]; then
      echo "$prog: K must be a number from 2 to 32, got '$1'" >&2
      usage
    fi
    K=$((10#$1))
    set_name "${2:-}"
    need_root
    need_tools
    take_lock
    if [ "${NRUN_CLUSTER_KEEP:-0}" != 1 ]; then
      # A failed or interrupted up leaves nothing behind.
      trap on_up_exit EXIT
      trap 'exit 130' INT
      trap 'exit 143' TERM
    fi
    do_up "$K"
    ;;
  down)
    [ $# -le 1 ] || usage
    set_name "${1:-}"
    need_root
    take_lock
    do_down
    ;;
  status)
    [ $# -le 1 ] || usage
    set_name "${1:-}"
    do_status
    ;;
  -h | --help | help) usage ;;
  *)
    echo "$prog: unknown command '$cmd'" >&2
    usage
    ;;
esac
