#!/usr/bin/env bash
# The environment of the kvcache bench's reference sides: NIXL (POSIX backend) and LMCache (local disk backend).
#
#   tools/kvbench-env.sh            create or update .venv-kvbench (or $KVBENCH_VENV) and check that it imports
#   .venv-kvbench/bin/python -m tools.bench kvcache [options]
#   .venv-kvbench/bin/python -m pytest -q -p no:cacheprovider tests/lmcache_plugin   (sfstore's LMCache plugin)
#
# Neither library is a dependency of sfstore, and both pull in far more than a CPU-only run needs (CUDA wheels,
# cupy, telemetry, cloud SDKs), so everything here is installed with --no-deps and the few dependencies that the
# code paths the bench uses import are listed by hand:
# * torch==2.13.0, the CPU build (always pinned: an unpinned torch pulls gigabytes of CUDA wheels);
# * nixl + nixl-cu12 (the Python API and the agent with its plugins, POSIX among them) and numpy;
# * lmcache==0.5.6, whose local disk backend runs on the CPU through its CPU device ops;
# * sfstore from this checkout: a .pth file puts the repository on sys.path, so the native helper built in the
#   tree (sfstore/_native*.so, by tools/dev.sh in .venv) is the one used; both venvs must be the same Python.
# Re-running is cheap: pip skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh

side_venv "${KVBENCH_VENV:-.venv-kvbench}"  # sets ROOT and VENV
# tools/constraints-dev.txt: the versions development uses, torch 2.13.0 (CPU) among them, for every install here
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check -c "$ROOT/tools/constraints-dev.txt")

say "torch 2.13.0 (CPU), numpy, sfstore's dependencies"
# Pinned (here and by the constraints), so pip never reaches for a newer CUDA build.
retry "${PIP[@]}" "torch==2.13.0"
# numpy <= 2.2.6: what lmcache 0.5.6 declares; xxhash: sfstore's one dependency
retry "${PIP[@]}" "numpy>=1.26,<=2.2.6" "xxhash>=3"
# the bench's other references and its report's charts, so `python -m tools.bench all --report` runs here in full
retry "${PIP[@]}" "numpy>=1.26,<=2.2.6" fsspec "safetensors>=0.6" matplotlib

say "nixl 1.5.1 (--no-deps: its CUDA 13 variant and other extras are not needed for the POSIX backend)"
retry "${PIP[@]}" --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"

say "lmcache 0.5.6 (--no-deps) and the dependencies its local disk backend imports"
say "(pip then lists lmcache's other declared dependencies as missing: expected, they are not needed here)"
retry "${PIP[@]}" --no-deps "lmcache==0.5.6"
# What importing its engine, config, connector interface and disk backend needs on a CPU (numba: its CPU device
# ops); the version bounds are lmcache 0.5.6's own. Left out: cupy, cuda-python, cufile, nixl-cu13, the cloud,
# telemetry and server packages.
retry "${PIP[@]}" pyyaml numba msgspec sortedcontainers psutil py-cpuinfo "prometheus_client>=0.18,<=0.24.1" \
  requests aiohttp aiofile cachetools cryptography "pyzmq>=25" "transformers>=5.4" "numpy>=1.26,<=2.2.6"

say "pytest (the LMCache plugin's tests run here: tests/lmcache_plugin)"
retry "${PIP[@]}" "pytest>=8"

link_checkout "$VENV" "$ROOT"

say "checking"
"$VENV/bin/python" - <<'EOF'
import importlib
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
import sfstore._native  # noqa: F401  (built in the tree by tools/dev.sh)

from tools.bench.suites import kvcache

for name, probe in (("nixl", kvcache.probe_nixl), ("lmcache", kvcache.probe_lmcache)):
    why = probe()
    print(f"{name}: {'ok' if why is None else why}")
EOF
say "done: $VENV/bin/python -m tools.bench kvcache"
