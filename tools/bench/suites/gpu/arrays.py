"""The array libraries of the ``gpu`` suite: torch (CUDA tensors, or CPU ones with ``--device cpu``) and cupy, each
able to allocate, compare and move blocks to and from host memory the way code without sfstore does; and kvikio's
settings, read and changed through whichever API the installed kvikio has."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
from collections.abc import Iterator
from typing import Any

from tools.bench.common import BenchSetupError

__all__ = ["Lib", "TorchLib", "CupyLib", "make_lib", "no_gpu_reason", "kvikio_module", "kvikio_setting",
           "kvikio_compat_on", "PIP"]

PIP = {
    "torch": "pip install torch (a CUDA build: see https://pytorch.org/get-started/locally/)",
    "cupy": "pip install cupy-cuda12x (or pip install 'sfstore[gpu]')",
    "kvikio": "pip install kvikio-cu12 (or pip install 'sfstore[gpu]')",
}


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def no_gpu_reason() -> str:
    """Why no GPU is usable here, in a few words."""
    if not _driver_present():
        return "no CUDA GPU here (no NVIDIA driver: libcuda.so.1 cannot be loaded)"
    return "no usable CUDA GPU (the NVIDIA driver loads, but no device is visible)"


class Lib:
    """One array library on one device: allocate, compare, move to and from the host, wait."""

    name = "?"
    device = "cuda"

    def alloc(self, nbytes: int, random: bool = False) -> Any:
        raise NotImplementedError

    def blocks(self, arr: Any, count: int, size: int) -> list[Any]:
        """``count`` views of ``size`` bytes each over ``arr``."""
        return [arr[i * size:(i + 1) * size] for i in range(count)]

    def zero(self, arr: Any) -> None:
        raise NotImplementedError

    def equal(self, a: Any, b: Any) -> bool:
        raise NotImplementedError

    def to_host(self, blk: Any) -> Any:
        """A host (numpy) copy of ``blk``: ``t.cpu()`` / ``a.get()``."""
        raise NotImplementedError

    def from_host(self, host: Any, dst: Any) -> None:
        """Copy host ``host`` into ``dst``: ``torch.from_numpy(h).cuda()`` / ``a.set(h)``."""
        raise NotImplementedError

    def sync(self) -> None:
        pass

    def release(self) -> None:
        """Give cached device memory back (between cases)."""

    def first_mismatch(self, a: Any, b: Any, count: int, size: int) -> int | None:
        """``None`` when ``a`` and ``b`` are equal, else the first block that differs (-1: none found by block)."""
        if self.equal(a, b):
            return None
        for i in range(count):
            if not self.equal(a[i * size:(i + 1) * size], b[i * size:(i + 1) * size]):
                return i
        return -1


class TorchLib(Lib):
    name = "torch"

    def __init__(self, device: str) -> None:
        try:
            import torch
        except ImportError as exc:
            raise BenchSetupError(f"torch is not installed ({exc}): {PIP['torch']}") from None
        self.torch = torch
        self.device = device
        if device == "cuda":
            if getattr(torch.version, "cuda", None) is None:
                raise BenchSetupError(f"{no_gpu_reason()}; torch {torch.__version__} is a CPU-only build: "
                                      f"{PIP['torch']} (or --device cpu)")
            if not torch.cuda.is_available():
                raise BenchSetupError(
                    f"{no_gpu_reason()}: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA "
                    f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})"
                    "; --device cpu runs the host routes")

    def alloc(self, nbytes: int, random: bool = False) -> Any:
        t = self.torch
        if random:
            g = t.Generator(device=self.device).manual_seed(1)
            return t.randint(0, 256, (nbytes,), dtype=t.uint8, device=self.device, generator=g)
        return t.zeros(nbytes, dtype=t.uint8, device=self.device)

    def zero(self, arr: Any) -> None:
        arr.zero_()

    def equal(self, a: Any, b: Any) -> bool:
        return bool(self.torch.equal(a, b))

    def to_host(self, blk: Any) -> Any:
        return blk.cpu().numpy()

    def from_host(self, host: Any, dst: Any) -> None:
        src = self.torch.from_numpy(host)
        dst.copy_(src.cuda() if self.device == "cuda" else src)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def release(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


class CupyLib(Lib):
    name = "cupy"

    def __init__(self) -> None:
        try:
            import cupy
            import numpy
        except Exception as exc:
            raise BenchSetupError(f"cupy is not usable ({type(exc).__name__}: {exc}): {PIP['cupy']}") from None
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as exc:
            raise BenchSetupError(f"{no_gpu_reason()}: cupy finds no device ({type(exc).__name__}: {exc})") from None
        if count < 1:
            raise BenchSetupError(f"{no_gpu_reason()}: cupy finds no device")
        self.cupy = cupy
        self.np = numpy

    def alloc(self, nbytes: int, random: bool = False) -> Any:
        if random:
            host = self.np.frombuffer(self.np.random.default_rng(1).bytes(nbytes), dtype=self.np.uint8)
            return self.cupy.asarray(host)
        return self.cupy.zeros(nbytes, dtype=self.cupy.uint8)

    def zero(self, arr: Any) -> None:
        arr.fill(0)

    def equal(self, a: Any, b: Any) -> bool:
        return bool(self.cupy.array_equal(a, b))

    def to_host(self, blk: Any) -> Any:
        return blk.get()

    def from_host(self, host: Any, dst: Any) -> None:
        dst.set(host)

    def sync(self) -> None:
        self.cupy.cuda.runtime.deviceSynchronize()

    def release(self) -> None:
        self.cupy.get_default_memory_pool().free_all_blocks()


def make_lib(name: str, device: str) -> Lib:
    """The library ``name`` (``torch`` or ``cupy``) on ``device``; BenchSetupError where it cannot run."""
    if name == "torch":
        return TorchLib(device)
    if device != "cuda":
        raise BenchSetupError("cupy arrays live on a GPU (--device cpu runs CPU torch tensors only)")
    return CupyLib()


def kvikio_module() -> Any:
    """kvikio, or BenchSetupError with the pip command."""
    try:
        return importlib.import_module("kvikio")
    except Exception as exc:  # ImportError, or kvikio failing to load its libraries
        raise BenchSetupError(f"kvikio is not usable ({type(exc).__name__}: {exc}): {PIP['kvikio']}") from None


def kvikio_setting(kvikio: Any, name: str) -> Any:
    """A kvikio setting (``compat_mode``, ``num_threads``) through whichever API this kvikio has."""
    d = kvikio.defaults
    getters = {"num_threads": ("get_num_threads", "num_threads")}.get(name, (name,))
    try:
        if callable(getattr(d, "get", None)):  # kvikio >= 25.04
            value = d.get(name)
        else:
            value = next(getattr(d, g) for g in getters if callable(getattr(d, g, None)))()
        return getattr(value, "name", value)
    except Exception as exc:
        return f"? ({type(exc).__name__}: {exc})"


@contextlib.contextmanager
def kvikio_compat_on(kvikio: Any) -> Iterator[None]:
    """kvikio in compat mode (POSIX I/O through its host bounce buffers) for CuFiles opened inside."""
    d = kvikio.defaults
    enum = getattr(kvikio, "CompatMode", None)
    value: Any = enum.ON if enum is not None else True
    if callable(getattr(d, "set", None)):  # kvikio >= 25.04
        with d.set("compat_mode", value):
            yield
    elif callable(getattr(d, "set_compat_mode", None)):  # older: a context manager
        with d.set_compat_mode(value):
            yield
    else:
        raise BenchSetupError("this kvikio cannot switch to compat mode at run time (no kvikio.defaults.set)")
