#!/usr/bin/env bash
# sfstore's set-up-and-run script: README's two commands call it.
#
#   tools/dev.sh demo [sfstore demo args]   set up (venv, native build) and run the demo on the embedded default
#   tools/dev.sh test [pytest args]         set up (incl. test extras) and run ruff, mypy and pytest
#   tools/dev.sh setup [demo|test]          only set up
#
# Every install step is here: Debian packages (installed only if missing), the virtual environment (.venv,
# or $SFSTORE_VENV), the build and the package. Re-running is cheap: nothing is reinstalled that is there.
# Every pip install goes through tools/constraints-dev.txt (-c): the versions development and CI use, torch
# 2.13.0 (CPU) above all. sfstore's extras pin nothing (users install into environments with their own torch).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${SFSTORE_VENV:-$ROOT/.venv}
CONSTRAINTS=$ROOT/tools/constraints-dev.txt
PY=${PYTHON:-python3}

. tools/lib.sh

apt_ensure() {  # install the Debian packages that are missing
  local missing=()
  for pkg in "$@"; do dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  if ! command -v apt-get >/dev/null; then
    say "missing system packages: ${missing[*]} (no apt-get here: install them with your package manager)"
    return 1
  fi
  say "installing Debian packages: ${missing[*]}"
  retry "${sudo[@]}" apt-get update -qq
  retry "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

setup() {  # setup [demo|test]
  local extras=""
  [ "${1:-}" = demo ] && extras="[demo]"
  # liburing-dev: the io_uring backend of the native engine (without it the build still works, threads only);
  # libxxhash-dev: checksums of reads checked on the engine's thread (without it, on the caller's)
  local pkgs=(liburing-dev libxxhash-dev)
  if [ "${1:-}" = test ]; then
    extras="[test]"
    # e2fsprogs: tests build 4096-byte-sector ext4 filesystems on loop devices; fio: the benchmark's reference
    pkgs+=(e2fsprogs fio)
  fi
  apt_ensure "${pkgs[@]}"
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating the virtual environment $VENV"
    "$PY" -m venv "$VENV"
  fi
  say "building and installing sfstore$extras (the first time about 2-4 minutes: downloads, then the native build)"
  local pip=("$VENV/bin/pip" install -q --disable-pip-version-check -c "$CONSTRAINTS")
  progress "installing the build tools" retry "${pip[@]}" "scikit-build-core>=0.10" "nanobind>=2.4"
  # --no-build-isolation: build with the venv's scikit-build-core/nanobind (no second download per run)
  progress "installing sfstore$extras and its dependencies (versions: tools/constraints-dev.txt)" \
    retry "${pip[@]}" --no-build-isolation -e ".$extras"
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup)
    setup "${1:-}"
    ;;
  demo)
    setup demo
    exec "$VENV/bin/sfstore" demo "$@"
    ;;
  test)
    setup test
    say "ruff"
    "$VENV/bin/ruff" check sfstore tests tools
    say "mypy"
    "$VENV/bin/mypy"
    # pytest's temporary directories: the block images, checkpoints and demo data the tests write (~3.5 GiB)
    check_disk "${TMPDIR:-/tmp}" 4 "pytest"
    say "pytest (about 4-6 minutes on 2 cores; a dot per test)"
    start=$SECONDS
    if "$VENV/bin/python" -m pytest "$@"; then rc=0; else rc=$?; fi
    say "pytest: finished in $((SECONDS - start)) s"
    exit $rc
    ;;
  *)
    sed -n '2,8p' "$0" >&2
    exit 2
    ;;
esac
