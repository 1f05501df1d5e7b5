# Shell functions shared by tools/dev.sh and the side environments (tools/vllm-env.sh, tools/kvbench-env.sh).
# Source it; it sets nothing else.

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

progress() {  # progress WHAT CMD...: run CMD, saying every 15 s that WHAT is still going, then how long it took
  local what=$1 start=$SECONDS pid rc
  shift
  "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15; do
      kill -0 "$pid" 2>/dev/null || break 2
      sleep 1
    done
    say "  ... still $what ($((SECONDS - start)) s)"
  done
  if wait "$pid"; then rc=0; else rc=$?; fi
  [ $rc -eq 0 ] && say "$what: done in $((SECONDS - start)) s"
  return $rc
}

check_disk() {  # check_disk DIR GIB WHAT: say how much DIR has free; warn, naming WHAT, when it is under GIB
  local dir=$1 need=$2 what=$3 free
  free=$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }')
  [ -n "$free" ] || return 0
  if awk -v f="$free" -v n="$need" 'BEGIN { exit !(f < n) }'; then
    say "WARNING: $dir has only $free GiB free; $what needs about $need GiB (tests that write images will fail with ENOSPC)"
  else
    say "$dir: $free GiB free ($what needs about $need GiB)"
  fi
}

retry() {  # retry a download-dependent command: registries are far away and sometimes flaky
  local n=1
  until "$@"; do
    if [ $n -ge 4 ]; then say "failed after $n tries: $*"; return 1; fi
    say "retrying in $((n * 5)) s ($n/3): $*"; sleep $((n * 5)); n=$((n + 1))
  done
}

side_venv() {  # side_venv VENV: ROOT (the checkout: the working directory) and VENV (absolute) are set, and VENV
  # is created (if missing) with the interpreter of the main venv ($SFSTORE_VENV, else .venv), so the in-tree native
  # helper (built for its ABI) imports there too
  ROOT=$(pwd)
  VENV=$(cd "$ROOT" && realpath -m "$1")
  local main=${SFSTORE_VENV:-$ROOT/.venv} py
  if [ -x "$main/bin/python" ]; then
    py=${PYTHON:-$("$main/bin/python" -c 'import sys; print(sys._base_executable)')}
  else
    py=${PYTHON:-python3}
    say "no $main: run tools/dev.sh setup first, so that sfstore's native helper is built in the tree"
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $py"
    "$py" -m venv "$VENV"
  fi
}

pinned_pip() {  # pinned_pip VENV PIN...: PIP (an array) becomes VENV's quiet pip install with the PINs as constraints
  CONSTRAINTS=$(mktemp)
  trap 'rm -f "$CONSTRAINTS"' EXIT
  local venv=$1
  shift
  printf '%s\n' "$@" > "$CONSTRAINTS"
  PIP=("$venv/bin/pip" install -q --disable-pip-version-check -c "$CONSTRAINTS")
}

link_checkout() {  # link_checkout VENV ROOT: sfstore from the checkout ROOT through a .pth file
  local site
  say "sfstore from $2 (a .pth file: the native helper built in the tree is used)"
  site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$2" > "$site/sfstore-checkout.pth"
}
