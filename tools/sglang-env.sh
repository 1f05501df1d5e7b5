#!/usr/bin/env bash
# The environment of sfstore's SGLang HiCache backend tests: SGLang 0.5.23's storage and host-pool modules importable
# on a CPU machine.
#
#   tools/sglang-env.sh                                 create or update .venv-sglang (or $SGLANG_VENV), check it imports
#   .venv-sglang/bin/python -m pytest tests/sglang_backend   the backend's tests (they skip in .venv)
#
# SGLang is not a dependency of sfstore. Its wheel declares the CUDA serving stack (flashinfer, sglang-kernel, deep-ep,
# ...), none of which its HiCache storage interface needs, so everything is installed with --no-deps and the
# dependencies are listed below, pinned: those that importing SGLang's backend factory, HiCache storage interface,
# host KV pools and page hashing needs on a CPU (found by importing, seeing what failed and adding it), plus pytest.
#
# torch: SGLang 0.5.23 pins torch 2.14.1, and its host-pool modules import torchvision (through sglang.srt.configs'
# multimodal models). PyPI's torchvision fails to import beside the CPU build of torch 2.13.0 ("operator
# torchvision::nms does not exist"), so this venv takes SGLang's own pair, torch 2.14.1 and torchvision 0.29.1: a CUDA
# build (about 5.5 GB of the venv's 6 GB), which runs on the CPU. Pinned like every torch here: pip takes it from the
# machine's wheel cache where it lies (these machines), and never reaches for a newer one.
# sfstore comes from this checkout through a .pth file, so the native helper built in the tree (sfstore/_native*.so,
# by tools/dev.sh in .venv) is the one used: both venvs must be the same Python (the main venv's interpreter).
# Re-running is cheap: pip skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh

SGLANG=sglang==0.5.23
TORCH=(torch==2.14.1 torchvision==0.29.1)
DEPS=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0
  apache-tvm-ffi==0.1.11 asttokens==3.0.2 attrs==26.1.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  click==8.5.1 compressed-tensors==0.20.1 dill==0.4.1 executing==2.3.0 frozenlist==1.8.0 gguf==0.19.0 h11==0.16.0
  hf-xet==1.8.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 ipython==9.18.1
  ipython_pygments_lexers==1.1.1 jedi==0.20.1 kernels==0.19.1 loguru==0.7.3 markdown-it-py==4.3.0
  matplotlib-inline==0.2.2 mdurl==0.1.2 msgspec==0.23.0 multidict==7.2.1 numpy==2.4.6 orjson==3.13.0
  packaging==26.4 parso==0.8.7 pexpect==4.9.0 pillow==13.0.0 prompt_toolkit==3.0.53 propcache==0.5.4 psutil==7.2.2
  ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0
  PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0
  sentencepiece==0.2.3 shellingham==1.5.4 stack-data==0.6.3 starlette==1.10.0 tokenizers==0.23.3 tomlkit==0.15.3
  tqdm==4.70.1 traitlets==5.16.1 transformers==5.25.0 truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5
  typing_extensions==4.16.0 urllib3==2.8.0 wcwidth==0.9.4 xxhash==4.1.0 yarl==1.25.1
  pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0
)

side_venv "${SGLANG_VENV:-.venv-sglang}"  # sets ROOT and VENV
check_disk "$(dirname "$VENV")" 8 "the SGLang venv (about 6 GB)"
pinned_pip "$VENV" "${TORCH[@]}"

say "${TORCH[*]} with their own dependencies (SGLang 0.5.23's torch; see the top of this script for why not the CPU build)"
retry "${PIP[@]}" "${TORCH[@]}"

say "$SGLANG (--no-deps) and the ${#DEPS[@]} packages its storage and host-pool modules import (--no-deps)"
say "(pip then lists SGLang's other declared dependencies as missing: expected, they are not needed here)"
retry "${PIP[@]}" --no-deps "$SGLANG" "${DEPS[@]}"

link_checkout "$VENV" "$ROOT"

say "checking"
"$VENV/bin/python" -W ignore - <<'PYEOF'
import sys

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401

import sfstore
from sfstore.kvcache.sglang import SfstoreHiCacheStorage  # noqa: F401

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda available: {torch.cuda.is_available()}), "
      f"sfstore from {sfstore.__path__[0]}")
PYEOF
say "done: $VENV/bin/python -m pytest tests/sglang_backend"
