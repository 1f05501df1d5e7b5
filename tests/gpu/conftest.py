"""What the GPU tests share: why a machine has no usable GPU, pip hints, the KV geometry and CUDA blocks.

Every module here is marked ``gpu`` and skips, saying why, without torch or without a CUDA device. Nothing here
imports torch at import time: a machine without it collects the modules and skips them.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from sfstore.kvcache import KVGeometry

MiB = 1 << 20
KV_LAYER_BYTES = 2 * 16 * 8 * 128 * 2  # one layer of a KV block: K and V x 16 tokens x 8 heads x 128 dims, bf16


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def no_cuda_reason() -> str:
    """Why torch sees no CUDA device here (the skip reason of every GPU test)."""
    import torch

    if getattr(torch.version, "cuda", None) is None:
        build = f"torch {torch.__version__} is a CPU-only build"
        if _driver_present():
            return f"{build} though an NVIDIA driver is here: install a CUDA build of torch"
        return f"no CUDA GPU here (no NVIDIA driver: libcuda.so.1 cannot be loaded); {build}"
    where = "the NVIDIA driver loads, but no device is visible" if _driver_present() else "no NVIDIA driver"
    return (f"no usable CUDA GPU ({where}): torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")


def gpu_marks(torch: Any) -> list[pytest.MarkDecorator]:
    """A GPU module's ``pytestmark``: marked ``gpu``, skipped with the reason where torch sees no CUDA device."""
    available = bool(torch.cuda.is_available())
    return [pytest.mark.gpu, pytest.mark.skipif(not available, reason="" if available else no_cuda_reason())]


def pip_hint(package: str) -> str:
    """How to install ``package`` ("cupy" or "kvikio") for the CUDA major version this torch was built for."""
    import torch

    major = str(getattr(torch.version, "cuda", None) or "12").split(".")[0]
    wheel = {"cupy": f"cupy-cuda{major}x", "kvikio": f"kvikio-cu{major}"}[package]
    return f"pip install {wheel} (the wheel of this torch's CUDA {major}; pip install 'sfstore[gpu]' for CUDA 12)"


def import_or_skip(package: str) -> Any:
    """``package`` ("cupy" or "kvikio") imported, or the test skipped with the reason and the pip command."""
    import importlib

    try:
        return importlib.import_module(package)
    except Exception as exc:  # ImportError, or the package failing to load its CUDA libraries
        pytest.skip(f"{package} is not usable ({type(exc).__name__}: {exc}): {pip_hint(package)}")


def kv_geometry(num_layers: int) -> KVGeometry:
    """bfloat16 KV blocks of 16 tokens x 8 heads x 128 dims per layer (64 KiB a layer), ``num_layers`` layers."""
    geom = KVGeometry(num_layers=num_layers, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert geom.layer_bytes == KV_LAYER_BYTES
    return geom


@dataclass
class CudaBlocks:
    """``count`` KV blocks in CUDA memory: random bytes (``src``) and a zeroed destination (``dst``), each one
    uint8 tensor, with bfloat16 block views (``srcb``, ``dstb``) of the geometry's block shape over them.

    Bytes are compared as uint8, never as bfloat16: random bits hold NaNs, which compare unequal to themselves.
    """

    geom: KVGeometry
    count: int
    src: Any
    dst: Any
    srcb: list[Any]
    dstb: list[Any]

    def zero_dst(self) -> None:
        self.dst.zero_()

    def mismatched(self) -> list[int]:
        """The blocks whose bytes differ between ``src`` and ``dst`` (empty: bit-exact)."""
        import torch

        torch.cuda.synchronize()
        if torch.equal(self.src, self.dst):
            return []
        n = self.geom.block_bytes
        return [i for i in range(self.count)
                if not torch.equal(self.src[i * n:(i + 1) * n], self.dst[i * n:(i + 1) * n])]


def cuda_blocks(geom: KVGeometry, count: int, seed: int = 0) -> CudaBlocks:
    """:class:`CudaBlocks` of ``geom``: ``count`` blocks of random bytes and as many zeroed ones."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = count * geom.block_bytes
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.zeros(total, dtype=torch.uint8, device="cuda")

    def views(t: Any) -> list[Any]:
        return list(t.view(torch.bfloat16).view(count, *geom.block_shape).unbind(0))

    return CudaBlocks(geom, count, src, dst, views(src), views(dst))


@pytest.fixture
def cuda() -> Iterator[Any]:
    """The CUDA device; after the test every queued kernel has run and torch's cached GPU memory is freed."""
    import torch

    yield torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
