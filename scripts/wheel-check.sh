#!/usr/bin/env bash
# The wheel's tests (issue 24), run by scripts/test.sh:
#   1. scripts/wheel.sh builds the wheel and checks its tags, highest GLIBC version and size;
#   2. the wheel installed into a fresh venv: nothing but nrun installed, `nrun` on PATH is the
#      wheel's binary, `nrun --version` and `python -m nrun --version` say the wheel's version,
#      `nrun --nproc 2 --no-python true` exits 0 and `python -m nrun` passes a worker's exit code on;
#   3. the same binary in a chroot of an older Debian (glibc older than this machine's): nrun
#      doctor, a --no-python job, and a --ship job from this machine whose agent (the shipped
#      binary) runs the workers there (ssh replaced by a chroot; the copy and the start are nrun's).
# Step 3 needs root (chroot, mount namespaces) and debootstrap (installed if missing). The chroot is made
# once and cached as a tarball in ~/.cache/nrun (NRUN_CHROOT_CACHE overrides the folder);
# NRUN_CHROOT_SUITE picks the release (default bullseye: the oldest the Debian mirror serves
# here; buster and older live on the archive) and NRUN_DEBIAN_MIRROR the mirror (default:
# debootstrap's own).
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
  echo "wheel-check.sh: FAILED: $*" >&2
  exit 1
}
say() { echo "wheel-check.sh: $*" >&2; }

work=$(mktemp -d /tmp/nrun-wheel-check.XXXXXX)
trap 'rm -rf --one-file-system "$work"' EXIT

wheel=$(scripts/wheel.sh)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)

# 2. A fresh venv, the wheel alone (--no-index: a dependency would fail the install here).
venv=$work/venv
python3 -m venv "$venv" || die "cannot create a venv at $venv (python3 -m venv)"
"$venv/bin/pip" install --quiet --no-index "$wheel" || die "pip install $wheel into $venv failed (output above)"
extra=$("$venv/bin/pip" list --format=freeze | grep -v -E '^(pip|setuptools|wheel)==' | grep -vx "nrun==$version" || true)
[ -z "$extra" ] || die "installing the wheel brought more than nrun==$version: $extra"
nrun=$(PATH="$venv/bin:$PATH" command -v nrun || true)
[ "$nrun" = "$venv/bin/nrun" ] || die "nrun on the venv's PATH is '$nrun', not $venv/bin/nrun (does the wheel install its binary as a script?)"
[ "$(head -c4 "$nrun" | od -An -c | tr -d ' ')" = '177ELF' ] || die "$nrun is not the ELF binary itself (a wrapper script?)"
for how in "$nrun" "$venv/bin/python -m nrun"; do
  out=$($how --version) || die "'$how --version' failed"
  case "$out" in "nrun $version "*) ;; *) die "'$how --version' says '$out', want 'nrun $version (...)'" ;; esac
done
PATH="$venv/bin:$PATH" nrun --nproc 2 --no-python true || die "installed 'nrun --nproc 2 --no-python true' exited $?"
set +e
"$venv/bin/python" -m nrun --nproc 2 --no-python sh -c 'exit 3' 2>/dev/null
rc=$?
set -e
[ "$rc" = 3 ] || die "'python -m nrun' with a worker exiting 3 exited $rc, want 3 (does __main__ exec nrun?)"
say "installed wheel: nrun on PATH, --version, python -m nrun, a --no-python job: ok"

# 3. An older Debian, made once with debootstrap and cached as a tarball; unpacked fresh each run
#    so nothing a run leaves there (a shipped binary) is seen by the next.
[ "$(id -u)" = 0 ] || die "the old-Debian run needs root (debootstrap, chroot, mount namespaces); run this as root, as CI does"
suite=${NRUN_CHROOT_SUITE:-bullseye}
cache=${NRUN_CHROOT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nrun}
tarball=$cache/debian-$suite-minbase.tar.gz
if [ ! -f "$tarball" ]; then
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap) >/dev/null ||
      die "cannot install debootstrap with apt-get (run apt-get install debootstrap to see why)"
  fi
  say "making a Debian $suite chroot with debootstrap (once; cached as $tarball)"
  mkdir -p "$cache"
  # shellcheck disable=SC2086 # an unset mirror is no argument: debootstrap's default
  debootstrap --variant=minbase "$suite" "$work/make" ${NRUN_DEBIAN_MIRROR:-} >"$work/debootstrap.log" 2>&1 || {
    tail -20 "$work/debootstrap.log" >&2
    die "debootstrap $suite failed (log above): is $suite still on the mirror? NRUN_CHROOT_SUITE picks another release, NRUN_DEBIAN_MIRROR another mirror"
  }
  # The downloaded packages, docs and translations: half the size, none of it needed to run nrun.
  rm -rf "$work/make/var/cache/apt/archives/"*.deb "$work/make/usr/share/doc" "$work/make/usr/share/locale"
  tar -C "$work/make" -czf "$tarball.tmp.$$" . && mv -f "$tarball.tmp.$$" "$tarball" ||
    die "cannot write $tarball (disk full? $cache writable?)"
  rm -rf --one-file-system "$work/make"
fi
root=$work/root
mkdir -p "$root"
tar -C "$root" -xzf "$tarball" || die "cannot unpack $tarball (corrupt? delete it to make it again)"

# Runs a shell command in the chroot as a node would: its own mount namespace (so /proc, /dev and
# /sys are unmounted when it ends, whatever happens), a login-like environment.
cat >"$work/in-chroot" <<'SH'
#!/bin/sh
root=$1 cmd=$2
exec unshare --mount --propagation private -- sh -c '
  mount -t proc proc "$1/proc" && mount --rbind /dev "$1/dev" && mount -t sysfs sysfs "$1/sys" &&
  exec chroot "$1" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin /bin/sh -c "$2"' sh "$root" "$cmd"
SH
# ssh HOST CMD for --ship: CMD runs in the chroot, as sshd would run it on an old node.
mkdir -p "$work/ssh"
cat >"$work/ssh/ssh" <<SH
#!/bin/sh
for cmd; do :; done
exec "$work/in-chroot" "$root" "\$cmd"
SH
chmod +x "$work/in-chroot" "$work/ssh/ssh"
in_chroot() { "$work/in-chroot" "$root" "$1"; }

old=$(in_chroot 'getconf GNU_LIBC_VERSION' | awk '{print $2}') || die "cannot run a command in the $suite chroot at $root"
here=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
[ "$(printf '%s\n%s\n' "$old" "$here" | sort -V | head -1)" = "$old" ] && [ "$old" != "$here" ] ||
  die "the $suite chroot's glibc $old is not older than this machine's $here: the test would prove nothing (NRUN_CHROOT_SUITE: an older release)"
say "Debian $suite chroot: glibc $old (this machine: $here)"

cp "$nrun" "$root/usr/local/bin/nrun"
# No python in the chroot: doctor would rightly call the node not ready for a Python job.
in_chroot 'nrun --version && nrun doctor --no-python-probe' >"$work/doctor.out" 2>&1 || {
  cat "$work/doctor.out" >&2
  die "nrun doctor in the $suite chroot (glibc $old) failed (output above)"
}
in_chroot 'nrun --nproc 2 --no-python true' || die "'nrun --nproc 2 --no-python true' in the $suite chroot exited $?"

# --ship from this machine (started in /, a directory the node has too): the running binary (the
# venv's) is copied into the chroot and its agent starts the workers there.
want=$(cat "$root/etc/debian_version")
out=$(cd / && PATH="$work/ssh:$venv/bin:$PATH" timeout 120 nrun -H oldnode --ship --nproc 2 \
  --no-python sh -c 'echo "debian $(cat /etc/debian_version)"') || die "'nrun -H oldnode --ship' into the $suite chroot exited $?"
for r in 0 1; do
  grep -qx "\[rank$r\]: debian $want" <<<"$out" || die "rank $r of the --ship job did not run in the chroot (debian $want); its output: $out"
done
shipped=$(ls "$root"/root/.cache/nrun/nrun-"$version"-* 2>/dev/null | head -1 || true)
[ -n "$shipped" ] && cmp -s "$shipped" "$nrun" || die "--ship did not put the running binary ($nrun) in the chroot's ~/.cache/nrun (found: ${shipped:-nothing})"
say "Debian $suite chroot: nrun doctor, a --no-python job, --ship with its agent: ok"
