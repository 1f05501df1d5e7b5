#!/usr/bin/env bash
# The environment of sfstore's vLLM adapter tests: vLLM 0.33.0 importable on a CPU machine.
#
#   tools/vllm-env.sh                               create or update .venv-vllm (or $VLLM_VENV), check it imports
#   .venv-vllm/bin/python -m pytest tests/vllm      the adapter's tests (marker `vllm`; they skip in .venv)
#
# vLLM is not a dependency of sfstore. Its wheel declares the CUDA stack (torch 2.14 with CUDA, flashinfer,
# cutlass, ...) and a serving stack, none of which the connector interface needs, so everything is installed with
# --no-deps and the dependencies are listed below, pinned: those that importing vLLM's config, KV connector
# factory and base class, scheduler, request, attention layers (CPU backend), KV cache planning and worker utilities
# needs on a CPU (found by importing, seeing what failed and adding it), plus pytest. What is not here:
# * vllm._C (the CUDA wheel has no CPU kernels): attention cannot run, so the tests use a stand-in kernel;
# * triton, flashinfer, the CUDA libraries, torchvision/torchaudio, the OpenAI server's remaining dependencies.
# torch is the CPU build of 2.13.0, always pinned (here and through a constraints file): an unpinned torch makes pip
# download gigabytes of CUDA wheels. vLLM 0.33.0 asks for torch 2.14.0; what the tests use works with 2.13.0, and
# `pip check` says so (expected).
# sfstore comes from this checkout through a .pth file, so the native helper built in the tree (sfstore/_native*.so,
# by tools/dev.sh in .venv) is the one used: both venvs must be the same Python (the main venv's interpreter).
# Re-running is cheap: pip skips what is there. About 2.1 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh

VLLM=vllm==0.33.0
TORCH=torch==2.13.0
# Everything vLLM's connector machinery imports on a CPU, and pytest; versions within vLLM 0.33.0's own bounds
# (transformers<5.21, fastapi<0.137, llguidance<1.8, xgrammar==0.2.8 with apache-tvm-ffi==0.1.11).
DEPS=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
  anyio==4.16.0 apache-tvm-ffi==0.1.11 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1
  charset-normalizer==3.5.3 cloudpickle==3.1.3 einops==0.8.2 fastapi==0.136.3 frozenlist==1.8.0 h11==0.16.0
  httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 llguidance==1.7.6 msgspec==0.23.0
  multidict==7.2.1 numpy==2.4.6 openai==3.57.0 openai-harmony==0.0.8 packaging==26.4
  partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2
  py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 PyYAML==6.0.4 pyzmq==27.3.0
  regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3
  tqdm==4.70.1 transformers==5.20.2 truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5
  typing_extensions==4.16.0 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1
  xxhash==4.1.0
  pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 Pygments==2.21.0
)

side_venv "${VLLM_VENV:-.venv-vllm}"  # sets ROOT and VENV
pinned_pip "$VENV" "$TORCH"

say "$TORCH (CPU) with its own dependencies"
retry "${PIP[@]}" "$TORCH"

say "$VLLM (--no-deps) and the ${#DEPS[@]} packages its connector machinery imports (--no-deps)"
retry "${PIP[@]}" --no-deps "$VLLM" "${DEPS[@]}"

link_checkout "$VENV" "$ROOT"

say "checking"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'EOF' 2>&1 | grep -v -e '^WARNING' -e 'Triton' -e 'vllm._C'
import sys

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.kv_offload.base import OffloadingManager  # noqa: F401

import sfstore
from sfstore.kvcache.vllm import SfstoreConnector  # noqa: F401

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, vllm {vllm.__version__}, "
      f"sfstore from {sfstore.__path__[0]}")
EOF
say "done: $VENV/bin/python -m pytest tests/vllm"
