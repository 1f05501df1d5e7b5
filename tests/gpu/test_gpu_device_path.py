"""The device path on a GPU: CUDA tensors and cupy arrays to a slab file and back in each mode this machine has
(gds: cuFile; compat: kvikio through its host buffers; staged: sfstore's pinned buffers), bit-exact, with the
counters accounting for every byte and describe() naming the mode asked for; ranges of one array at offsets into
it (as the KV cache's chunk files are read layer by layer) land where they are asked to."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sfstore.paths.base import Range
from sfstore.paths.device import DevicePath, device_mode

from .conftest import MiB, gpu_marks, import_or_skip

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU tests need a CUDA build of torch")
pytestmark = gpu_marks(torch)

BLOCK = 1 * MiB
BLOCKS = 12
SLAB = "blocks.slab"


@dataclass
class Lib:
    """One array library's GPU side: random and zeroed byte arrays, a zeroing and a comparison."""

    alloc: Callable[[int, bool], Any]
    zero: Callable[[Any], None]
    equal: Callable[[Any, Any], bool]


def _torch_lib() -> Lib:
    gen = torch.Generator(device="cuda").manual_seed(3)

    def alloc(nbytes: int, random: bool) -> Any:
        if random:
            return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
        return torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

    return Lib(alloc, lambda a: a.zero_(), lambda a, b: bool(torch.equal(a, b)))


def _cupy_lib() -> Lib:
    cupy = import_or_skip("cupy")
    import numpy as np  # (cupy's host side: there wherever cupy is)

    rng = np.random.default_rng(3)

    def alloc(nbytes: int, random: bool) -> Any:
        if random:
            return cupy.asarray(np.frombuffer(rng.bytes(nbytes), dtype=np.uint8))
        return cupy.zeros(nbytes, dtype=cupy.uint8)

    return Lib(alloc, lambda a: a.fill(0), lambda a, b: bool(cupy.array_equal(a, b)))


def _kvikio_compat_on(kvikio: Any) -> contextlib.AbstractContextManager[None]:
    """kvikio in compat mode (POSIX I/O through its host bounce buffers) for CuFiles opened inside: without it a
    machine with cuFile would take the gds route where compat was asked for."""
    d = kvikio.defaults
    enum = getattr(kvikio, "CompatMode", None)
    value: Any = enum.ON if enum is not None else True
    if callable(getattr(d, "set", None)):  # kvikio >= 25.04
        return d.set("compat_mode", value)
    if callable(getattr(d, "set_compat_mode", None)):  # older: a context manager
        return d.set_compat_mode(value)
    pytest.skip("this kvikio cannot switch to compat mode at run time (no kvikio.defaults.set)")


@contextlib.contextmanager
def _mode_available(mode: str) -> Iterator[None]:
    """Skip, with device_mode()'s reason, a mode this machine lacks; inside, kvikio forced to compat mode where
    compat is asked for on a machine with gds."""
    found, why = device_mode()
    if mode in ("gds", "compat"):
        kvikio = import_or_skip("kvikio")
        if mode == "gds" and found != "gds":
            pytest.skip(f"no GPU-direct storage here: device_mode() is {found!r}: {why}")
        if mode == "compat" and found not in ("gds", "compat"):
            pytest.skip(f"kvikio's compat mode is not usable here: device_mode() is {found!r}: {why}")
        if mode == "compat" and found == "gds":
            with _kvikio_compat_on(kvikio):
                yield
            return
    yield


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("mode", ["gds", "compat", "staged"])
def test_device_path_round_trip(tmp_path: Path, cuda: torch.device, mode: str, lib: str) -> None:
    """Blocks written at their offsets of a slab with write_async, read back into zeroed arrays: bit-exact; the
    bytes moved are all in bytes_gpu_direct + bytes_staged, and describe() reports the mode asked for."""
    arrays = _torch_lib() if lib == "torch" else _cupy_lib()
    total = BLOCKS * BLOCK
    with _mode_available(mode):
        src = arrays.alloc(total, True)
        dst = arrays.alloc(total, False)
        dp = DevicePath(tmp_path / "slabs", mode=mode)
        try:
            dp.slab(SLAB, total)
            if mode == "gds":  # cuFile's fast path for buffers used again and again (a no-op in other modes)
                dp.register(src)
                dp.register(dst)
            futs = [dp.write_async(SLAB, src[i * BLOCK:(i + 1) * BLOCK], i * BLOCK) for i in range(BLOCKS)]
            assert [f.get() for f in futs] == [BLOCK] * BLOCKS
            dp.flush()
            futs = [dp.read_into_async(SLAB, dst[i * BLOCK:(i + 1) * BLOCK], i * BLOCK) for i in range(BLOCKS)]
            assert [f.get() for f in futs] == [BLOCK] * BLOCKS
            torch.cuda.synchronize()
            bad = [i for i in range(BLOCKS)
                   if not arrays.equal(src[i * BLOCK:(i + 1) * BLOCK], dst[i * BLOCK:(i + 1) * BLOCK])]
            assert not bad, f"blocks {bad} came back different"
            arrays.zero(dst)
            assert dp.read_into(SLAB, dst, 0) == total  # the whole slab in one read
            assert arrays.equal(src, dst)
            desc = dp.describe()
        finally:
            dp.close()
    assert desc["mode"] == mode, desc
    counters = desc["counters"]
    moved = counters["bytes_gpu_direct"] + counters["bytes_staged"]
    assert moved == 3 * total, f"{moved} bytes counted as GPU-direct or staged, {3 * total} moved: {counters}"
    assert counters["bytes_written"] == total and counters["bytes_read"] == 2 * total, counters
    if mode != "gds":
        assert counters["bytes_gpu_direct"] == 0, counters


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("mode", ["gds", "compat", "staged"])
def test_device_path_ranges_at_buffer_offsets(tmp_path: Path, cuda: torch.device, mode: str, lib: str) -> None:
    """One batch of ranges writes the blocks of an array, each from its offset in the array, to a slab in reverse
    order; the slab then holds them reversed (read whole, at offset 0), and a batch of ranges reading each block
    into its offset of a zeroed array gives the array back."""
    arrays = _torch_lib() if lib == "torch" else _cupy_lib()
    total = BLOCKS * BLOCK
    with _mode_available(mode):
        src = arrays.alloc(total, True)
        dst = arrays.alloc(total, False)
        whole = arrays.alloc(total, False)
        dp = DevicePath(tmp_path / "slabs", mode=mode)
        fd = os.open(dp.slab(SLAB, total), os.O_RDWR)
        try:
            at = [(i * BLOCK, (BLOCKS - 1 - i) * BLOCK) for i in range(BLOCKS)]  # (slab offset, array offset)
            assert dp.submit([Range.write(f, BLOCK, src, b, fd) for f, b in at]).get() == [BLOCK] * BLOCKS
            os.fsync(fd)
            assert dp.read_into(SLAB, whole, 0) == total
            bad = [i for i, (f, b) in enumerate(at) if not arrays.equal(whole[f:f + BLOCK], src[b:b + BLOCK])]
            assert not bad, f"writes from buffer offsets: slab blocks {bad} do not hold the array's blocks asked for"
            assert dp.submit([Range.read(f, BLOCK, dst, b, fd) for f, b in at]).get() == [BLOCK] * BLOCKS
            torch.cuda.synchronize()
            bad = [i for i, (_f, b) in enumerate(at) if not arrays.equal(dst[b:b + BLOCK], src[b:b + BLOCK])]
            assert not bad, f"reads into buffer offsets: array blocks at {bad} differ"
        finally:
            os.close(fd)
            dp.close()
