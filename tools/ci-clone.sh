#!/usr/bin/env bash
# Run CI (.ci/run) as CI does: on a clean clone of HEAD, with ../shared beside it, CI=true.
# The clone (~9 GiB with its venvs and the testbed's images) is removed afterwards, passed or failed, so repeated
# runs do not fill the disk that the next CI run shares. Its log stays: tools/ci-clone.sh [LOG]
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh
log=${1:-$PWD/.ci-clone.log}
work=$(mktemp -d "${TMPDIR:-/tmp}/sfstore-ci.XXXXXX")
trap 'rm -rf "$work"' EXIT
check_disk "$work" 15 "a clean-clone CI run"
git clone -q . "$work/p"
[ -d ../shared ] && ln -s "$(cd ../shared && pwd)" "$work/shared"
say "CI on $(git rev-parse --short HEAD) in $work/p; log: $log"
start=$SECONDS
if (cd "$work/p" && CI=true bash .ci/run) >"$log" 2>&1; then rc=0; else rc=$?; fi
say "CI: exit $rc after $((SECONDS - start)) s (tail of $log below)"
tail -n 25 "$log" >&2
# what CI left in the work tree: build artefacts must be ignored, nothing tracked may change
dirty=$(git -C "$work/p" status --porcelain)
if [ -n "$dirty" ]; then
  say "git status is not clean after CI:"
  printf '%s\n' "$dirty" >&2
  [ $rc -eq 0 ] && rc=1
else
  say "git status is clean after CI"
fi
exit $rc
