#!/usr/bin/env bash
# Installs what the tests need and runs all of them: formatting, lints, the pip wheel's checks
# (scripts/wheel-check.sh), unit and integration tests (real torch clients from a cached venv,
# real processes and signals).
#   scripts/test.sh            everything (what CI and README's quick start run): ~17 min on a
#                              fresh clone with 2 CPUs (CI: 1,010 s), ~23 with two CPU hogs
#                              beside it (1,368 s on 2026-12-05)
#   scripts/test.sh -- FILTER  passes FILTER on to cargo test
#   scripts/test.sh --fast     the floor, for a change: ~20 s warm: formatting, unused
#                              dependencies, functions over 120 lines, every crate's unit tests
#                              (the fault model's table included), the store's codec and socket
#                              tests; no namespaces, torch, Slurm, wheel or clippy
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fast" ]; then
  shift
  cargo fmt --all --check
  python3 scripts/unused-deps.py
  python3 scripts/module-cycles.py
  python3 scripts/fn-lengths.py --self-test
  python3 scripts/fn-lengths.py
  # Python-reading unit tests skip without NRUN_TEST_PYTHON (no venv is made here).
  exec cargo test --workspace --lib --test store --test codec_props --test codec_scan_props "$@"
fi

need_apt=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v setsid >/dev/null 2>&1 || need_apt+=(util-linux)
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || need_apt+=(iptables)
# The wheel's checks: objdump reads its GLIBC versions, debootstrap makes the old Debian.
command -v objdump >/dev/null 2>&1 || need_apt+=(binutils)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need_apt+=(debootstrap)
# The incident report's page is loaded in a real browser; the metrics are checked by promtool.
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || need_apt+=(chromium)
[ -x /usr/bin/promtool ] || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing ${need_apt[*]}" >&2
    # prometheus' package would start its server: services are kept from starting.
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${need_apt[@]}") >/dev/null
    rm -f /usr/sbin/policy-rc.d
  else
    echo "test.sh: missing ${need_apt[*]} (not root: install them yourself)" >&2
  fi
fi

# A real Slurm for tests/slurm.rs (scripts/slurm-cluster.sh runs its own daemons): the
# packages only, their services kept from starting.
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing slurm-wlm munge" >&2
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends slurm-wlm munge) >/dev/null || echo "test.sh: slurm-wlm not installed; its tests will fail" >&2
    rm -f /usr/sbin/policy-rc.d
  fi
fi

venv=$(scripts/venv.sh)
export NRUN_TEST_PYTHON="$venv/bin/python"
# A test whose set-up cannot be made (a tool above missing, not root, no torch) fails here,
# naming what is missing, instead of skipping (tests/common/skip.rs).
export NRUN_TEST_REQUIRE_TOOLS=1

cargo fmt --all --check
python3 scripts/unused-deps.py
python3 scripts/module-cycles.py
python3 scripts/fn-lengths.py --self-test
python3 scripts/fn-lengths.py
cargo clippy --workspace --all-targets --quiet -- -D warnings
if [ "${1:-}" = "--" ]; then shift; fi
# The pip wheel (issue 24): built, installed into a fresh venv, run in an older Debian. A few
# minutes (a fat-LTO build), so a run narrowed to a FILTER leaves it out, and says so.
if [ $# -eq 0 ]; then
  scripts/wheel-check.sh
else
  echo "test.sh: a FILTER was given: the wheel checks (scripts/wheel-check.sh) are not run" >&2
fi
# A hung test must fail the run, not stall it: 30 minutes is far above the suite's 11-20.
timeout --kill-after=30 1800 cargo test --workspace --all-targets --no-fail-fast "$@"
