#!/usr/bin/env bash
# The reliability suite's long ("flag") run: tests/reliability with 30 s of symlink swapping per operation and
# ten times the trials and fuzz iterations of CI's run (which uses 1 s and scale 1). About 30-40 minutes here.
#
#   tools/reliability.sh [pytest args]     e.g. -k symlink, or -x
#
# SFSTORE_RELIABILITY_SECONDS / SFSTORE_RELIABILITY_SCALE set beforehand win over these values.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh
VENV=${SFSTORE_VENV:-$(pwd)/.venv}
tools/dev.sh setup test
export SFSTORE_RELIABILITY_SECONDS=${SFSTORE_RELIABILITY_SECONDS:-30}
export SFSTORE_RELIABILITY_SCALE=${SFSTORE_RELIABILITY_SCALE:-10}
say "reliability suite: ${SFSTORE_RELIABILITY_SECONDS} s of racing per operation, trials x${SFSTORE_RELIABILITY_SCALE}"
exec "$VENV/bin/python" -m pytest -v -p no:cacheprovider tests/reliability "$@"
