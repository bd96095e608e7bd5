#!/usr/bin/env bash
# Builds the pip-installable wheel, dist/nrun-<version>-py3-none-manylinux_2_17_x86_64...whl: the
# binary (cargo profile `dist`) linked through zig against glibc 2.17's symbols, so it runs on any
# x86_64 Linux with glibc 2.17 or newer (CentOS 7 and later), plus `python -m nrun`. Checks what it
# built: the wheel's tags, the binary's highest GLIBC symbol version and its size. Prints the
# wheel's path (stdout, last line).
#
# Tools (maturin, and zig from PyPI's ziglang) go into a venv cached at ~/.cache/nrun/wheel-tools
# (NRUN_WHEEL_TOOLS overrides); the Rust toolchain is the one on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: a wheel built twice from one commit comes out the same.
reqs=(maturin==1.16.0 ziglang==0.17.1)
max_glibc=2.17
max_bytes=10000000
target=x86_64-unknown-linux-gnu

die() {
  echo "wheel.sh: $*" >&2
  exit 1
}

tools=${NRUN_WHEEL_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/nrun/wheel-tools}
if [ "$(cat "$tools/.reqs" 2>/dev/null)" != "${reqs[*]}" ]; then
  echo "wheel.sh: installing ${reqs[*]} into $tools (once)" >&2
  rm -rf "$tools"
  python3 -m venv "$tools" >&2 || die "cannot create a venv at $tools (python3 -m venv; on Debian: apt-get install python3-venv)"
  "$tools/bin/pip" install --quiet "${reqs[@]}" >&2 ||
    die "cannot install ${reqs[*]} from PyPI into $tools (network? run $tools/bin/pip install ${reqs[*]} to see why)"
  echo "${reqs[*]}" >"$tools/.reqs"
fi
command -v objdump >/dev/null || die "objdump is missing, needed to read the binary's GLIBC versions (apt-get install binutils)"
if command -v rustup >/dev/null; then
  rustup target list --installed | grep -qx "$target" || rustup target add "$target" >&2
fi

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
[ -n "$version" ] || die "no version = \"...\" line in Cargo.toml"
rm -f dist/nrun-"$version"-*.whl
# maturin finds zig as `python -m ziglang` of the python first on PATH: the tools venv's.
PATH="$tools/bin:$PATH" maturin build --zig --target "$target" --compatibility manylinux_2_17 \
  --out dist >&2 || die "maturin build failed (output above); the dist profile is in Cargo.toml"
wheels=(dist/nrun-"$version"-*.whl)
[ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || die "expected one dist/nrun-$version-*.whl after the build, found: ${wheels[*]}"
wheel=${wheels[0]}

# The wheel's own metadata, not only its name: what pip reads.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m zipfile -e "$wheel" "$work" || die "cannot unpack $wheel"
tags=$(sed -n 's/^Tag: //p' "$work/nrun-$version.dist-info/WHEEL" | sort | tr '\n' ' ')
# manylinux2014 is PEP 599's name for manylinux_2_17, which maturin adds so that pip older than
# 20.3 (no PEP 600) on old nodes still installs the wheel.
want="py3-none-manylinux2014_x86_64 py3-none-manylinux_2_17_x86_64 "
[ "$tags" = "$want" ] || die "$wheel is tagged '$tags', want '$want' (check pyproject.toml and --compatibility)"
bin=$work/nrun-$version.data/scripts/nrun
[ -f "$bin" ] || die "$wheel has no nrun-$version.data/scripts/nrun"
highest=$(objdump -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
[ -n "$highest" ] || die "found no GLIBC symbol versions in $bin (objdump -T): not a glibc binary?"
if [ "$(printf '%s\n%s\n' "$highest" "$max_glibc" | sort -V | tail -1)" != "$max_glibc" ]; then
  die "$bin needs GLIBC_$highest, above $max_glibc; its symbols of that version: $(objdump -T "$bin" | grep "GLIBC_$highest" | awk '{print $NF}' | tr '\n' ' ')(call them through a crate that looks them up at run time, as store::auth does getrandom)"
fi
bytes=$(stat -c %s "$bin")
[ "$bytes" -le "$max_bytes" ] || die "$bin is $bytes bytes, above $max_bytes (is the dist profile's strip/lto still set in Cargo.toml?)"
echo "wheel.sh: $wheel: tags ${tags% }, binary $bytes bytes, highest GLIBC_$highest" >&2
echo "$wheel"
