"""The two sides of the ``gpu`` suite's cases: each puts ``nblocks`` blocks of GPU memory durably (fsync inside
the timed region) and gets them back cold (page cache dropped before) into zeroed GPU memory, bit-exact.

* :class:`BaselineSide` (the reference): what code without sfstore does, block by block: ``t.cpu()`` (cupy
  ``.get()``) + ``os.pwrite`` + one ``fsync``; ``np.fromfile`` + ``.cuda()`` (cupy ``.set()``).
* :class:`DevicePathSide`: ``DevicePath(mode=gds|compat|staged)``: every block's write (read) submitted at once
  into (from) a preallocated slab.
* :class:`KvBlockSide`: ``KVCacheStore`` with its pinned tier over a ``BlockStore`` image: a put is copied into
  pinned slots and written through (waited for, flushed); a get, after the pinned tier is evicted, reads the
  block tier.
* :class:`KvSharedSide`: ``KVCacheStore``'s shared tier (chunk files, fsynced): with the pinned tier off the
  blocks move on the device path's route (``describe()`` says which); with it on they are copied through pinned
  slots; a get after evicting the pinned tier reads the files.

A get that is not bit-exact, or a block from another tier than the side's, raises :class:`WrongResult`: the
case stops there (a wrong answer has no speed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Any

from tools.bench.common import BenchSetupError, drop_cache, fsync_path
from tools.bench.measure import CpuMeter, RunResult
from tools.bench.suites.gpu.arrays import Lib, kvikio_compat_on, kvikio_module, kvikio_setting

__all__ = ["Blocks", "Side", "BaselineSide", "DevicePathSide", "KvBlockSide", "KvSharedSide", "WrongResult",
           "kv_geometry", "KV_LAYER_BYTES"]

MiB = 1 << 20
#: One layer of a KV block: K and V x 16 tokens x 8 heads x 128 dims, bfloat16.
KV_LAYER_BYTES = 2 * 16 * 8 * 128 * 2


class WrongResult(AssertionError):
    """A side got back other bytes than it put, or from another tier than it reads."""


class Blocks:
    """The source (random) and destination arrays of one library, ``nblocks`` blocks of ``block_bytes`` each."""

    def __init__(self, lib: Lib, nblocks: int, block_bytes: int) -> None:
        self.lib, self.nblocks, self.block_bytes = lib, nblocks, block_bytes
        self.total = nblocks * block_bytes
        self.src = lib.alloc(self.total, random=True)
        self.dst = lib.alloc(self.total)
        lib.sync()

    def src_blocks(self) -> list[Any]:
        return self.lib.blocks(self.src, self.nblocks, self.block_bytes)

    def dst_blocks(self) -> list[Any]:
        return self.lib.blocks(self.dst, self.nblocks, self.block_bytes)

    def clear(self) -> None:
        """Zero the destination (untimed, before a get)."""
        self.lib.zero(self.dst)
        self.lib.sync()

    def check(self, who: str) -> None:
        """Raise :class:`WrongResult` unless the destination holds the source's bytes."""
        bad = self.lib.first_mismatch(self.src, self.dst, self.nblocks, self.block_bytes)
        if bad is not None:
            raise WrongResult(f"{who}: the bytes got back differ from those put (first in block {bad})")

    def release(self) -> None:
        self.src = self.dst = None
        self.lib.release()


def _timed(blocks: Blocks, fn: Any) -> RunResult:
    """``fn()`` timed after the library's queue is drained, up to its end on the device too."""
    blocks.lib.sync()
    meter = CpuMeter()
    meter.start()
    t0 = time.perf_counter()
    fn()
    blocks.lib.sync()
    seconds = time.perf_counter() - t0
    return RunResult(bytes=blocks.total, ops=blocks.nblocks, seconds=seconds, cpu_s=meter.stop())


def _preallocate(path: str, size: int) -> None:
    """The baseline's file, allocated before any clock as DevicePath.slab allocates the device path's."""
    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError:  # a filesystem without fallocate: a sparse file
            f.truncate(size)


def _drop_tree(root: str) -> None:
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):  # (a shared tier's chunk links hold no data)
                drop_cache(p)


class Side:
    """One side of a case: a durable ``put()`` and a cold, checked ``get()`` of every block, each a timed run."""

    label = "?"

    def __init__(self, blocks: Blocks, root: str) -> None:
        self.blocks, self.root = blocks, root
        os.makedirs(root, exist_ok=True)
        self.facts: dict[str, Any] = {}
        self.put_done = False

    def put(self) -> RunResult:
        result = self._put()
        self.put_done = True
        return result

    def get(self) -> RunResult:
        if not self.put_done:  # a get-only selection: its blocks are put first, untimed
            self.put()
        self.blocks.clear()
        result = self._get()
        self.blocks.check(self.label)
        return result

    def _put(self) -> RunResult:
        raise NotImplementedError

    def _get(self) -> RunResult:
        raise NotImplementedError

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class BaselineSide(Side):
    """The reference: block by block through host memory with plain Python and the array library."""

    def __init__(self, blocks: Blocks, root: str) -> None:
        super().__init__(blocks, root)
        lib = blocks.lib
        self.label = f"{lib.name} baseline"
        self.path = os.path.join(root, "baseline.bin")
        _preallocate(self.path, blocks.total)
        self.facts = {"put": f"{'t.cpu()' if lib.name == 'torch' else 'a.get()'} + os.pwrite per block + fsync",
                      "get": f"np.fromfile + {'.cuda()' if lib.name == 'torch' else 'a.set()'} per block"}

    def _put(self) -> RunResult:
        b, B = self.blocks, self.blocks.block_bytes

        def run() -> None:
            fd = os.open(self.path, os.O_WRONLY)
            try:
                for i, blk in enumerate(b.src_blocks()):
                    view = memoryview(b.lib.to_host(blk)).cast("B")
                    done = 0
                    while done < B:
                        done += os.pwrite(fd, view[done:], i * B + done)
                os.fsync(fd)
            finally:
                os.close(fd)

        return _timed(b, run)

    def _get(self) -> RunResult:
        import numpy as np

        b, B = self.blocks, self.blocks.block_bytes
        drop_cache(self.path)

        def run() -> None:
            with open(self.path, "rb", buffering=0) as f:
                for i, blk in enumerate(b.dst_blocks()):
                    host = np.fromfile(f, dtype=np.uint8, count=B)
                    if host.size != B:
                        raise WrongResult(f"{self.label}: short read, {host.size} of {B} bytes in block {i}")
                    b.lib.from_host(host, blk)

        return _timed(b, run)


class DevicePathSide(Side):
    """``DevicePath(mode)``: a slab, every block's transfer submitted at once, then waited for."""

    SLAB = "blocks.slab"

    def __init__(self, blocks: Blocks, root: str, mode: str) -> None:
        super().__init__(blocks, root)
        from sfstore.paths.device import DevicePath, device_mode

        self.label = f"{blocks.lib.name} DevicePath {mode}"
        self._stack = contextlib.ExitStack()
        notes: list[str] = []
        if mode in ("gds", "compat"):
            if blocks.lib.device != "cuda":
                raise BenchSetupError(f"DevicePath mode {mode!r} moves GPU memory (--device cpu has none)")
            kvikio = kvikio_module()
            found, why = device_mode()
            if mode == "gds" and found != "gds":
                raise BenchSetupError(f"no GPU-direct storage here: device_mode() is {found!r}: {why}")
            if mode == "compat" and found not in ("gds", "compat"):
                raise BenchSetupError(f"kvikio is not usable here: device_mode() is {found!r}: {why}")
            if mode == "compat" and found == "gds":
                self._stack.enter_context(kvikio_compat_on(kvikio))  # else kvikio would take the gds route
                notes.append("kvikio compat mode forced on")
            notes.append(f"kvikio {getattr(kvikio, '__version__', '?')}, "
                         f"{kvikio_setting(kvikio, 'num_threads')} thread(s)")
        self.dp = self._stack.enter_context(DevicePath(root, mode=mode))
        self.slab = self.dp.slab(self.SLAB, blocks.total)
        if mode == "gds":
            try:
                self.dp.register(blocks.src)
                self.dp.register(blocks.dst)
                notes.append("arrays registered with cuFile")
            except Exception as exc:
                notes.append(f"cuFile registration failed ({type(exc).__name__}: {exc}); unregistered")
        self.facts = {"mode": mode, "notes": notes}

    def _put(self) -> RunResult:
        b, B = self.blocks, self.blocks.block_bytes

        def run() -> None:
            futs = [self.dp.write_async(self.SLAB, blk, i * B) for i, blk in enumerate(b.src_blocks())]
            short = [i for i, fut in enumerate(futs) if fut.get() != B]
            self.dp.flush()
            fsync_path(self.slab)
            if short:
                raise WrongResult(f"{self.label}: short writes in blocks {short[:5]}")

        return _timed(b, run)

    def _get(self) -> RunResult:
        b, B = self.blocks, self.blocks.block_bytes
        drop_cache(self.slab)

        def run() -> None:
            futs = [self.dp.read_into_async(self.SLAB, blk, i * B) for i, blk in enumerate(b.dst_blocks())]
            short = [i for i, fut in enumerate(futs) if fut.get() != B]
            if short:
                raise WrongResult(f"{self.label}: short reads in blocks {short[:5]}")

        return _timed(b, run)

    def close(self) -> None:
        desc = self.dp.describe()
        self.facts.update({"ran_in_mode": desc["mode"], "why": desc.get("why"), "counters": desc.get("counters")})
        self._stack.close()
        super().close()


def kv_geometry(block_bytes: int) -> Any:
    """bfloat16 KV blocks of ``block_bytes``: 16 tokens x 8 heads x 128 dims per layer, as many layers as fit (32
    at 2 MiB); BenchSetupError when that is not a whole number of layers."""
    from sfstore.kvcache import KVGeometry

    if block_bytes % KV_LAYER_BYTES:
        raise BenchSetupError(f"a KV block is a whole number of {KV_LAYER_BYTES // 1024} KiB layers; "
                              f"--block-size gives {block_bytes} bytes")
    return KVGeometry(num_layers=block_bytes // KV_LAYER_BYTES, block_tokens=16, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16")


class _KvSide(Side):
    """What the KV sides share: the blocks as bfloat16 KV blocks, a store, new keys for each put (the last put's
    evicted first, untimed), and a get that must answer from one tier."""

    tier = "?"

    def __init__(self, blocks: Blocks, root: str) -> None:
        super().__init__(blocks, root)
        torch = blocks.lib.torch  # type: ignore[attr-defined]
        self.geom = kv_geometry(blocks.block_bytes)
        shape = (blocks.nblocks, *self.geom.block_shape)
        self.srcb = list(blocks.src.view(torch.bfloat16).view(shape).unbind(0))
        self.dstb = list(blocks.dst.view(torch.bfloat16).view(shape).unbind(0))
        self.kv: Any = None
        self.keys: list[bytes] = []
        self.runs = 0

    def _new_keys(self) -> list[bytes]:
        if self.keys:
            self.kv.evict(self.keys)
        self.runs += 1
        tokens = list(range(self.blocks.nblocks * self.geom.block_tokens))
        self.keys = self.kv.keys_for(tokens, extra=(f"run-{self.runs}",))
        return self.keys

    def _checked_get(self) -> Any:
        tiers = self.kv.get_into(self.keys, self.dstb)
        if set(tiers) != {self.tier}:
            stats = self.kv.stats()
            raise WrongResult(f"{self.label}: blocks came from tiers {sorted(map(str, set(tiers)))}, not the "
                              f"{self.tier} tier (puts dropped {stats.get('puts_dropped')}, quarantine "
                              f"{stats.get('quarantine')})")
        return tiers

    def close(self) -> None:
        if self.kv is not None:
            stats = self.kv.stats()
            self.facts["stats"] = {k: stats.get(k) for k in (
                "puts", "gets", "hits_pinned", "hits_block", "hits_shared", "puts_dropped", "lower_tier_errors",
                "bytes_device_staged", "shared_opens", "device")}
            self.kv.close()
        self.srcb = self.dstb = []
        super().close()


class KvBlockSide(_KvSide):
    """``KVCacheStore`` pinned tier over a ``BlockStore`` image; gets from the block tier."""

    tier = "block"

    def __init__(self, blocks: Blocks, root: str) -> None:
        super().__init__(blocks, root)
        from sfstore.blocks import BlockStore
        from sfstore.kvcache import KVCacheStore

        self.label = "KVCacheStore block tier"
        B, N = blocks.block_bytes, blocks.nblocks
        self.image = os.path.join(root, "blocks.img")
        # room for two runs' blocks: a put's new keys are written before the last run's are evicted
        self.store = BlockStore({"kind": "image", "path": self.image, "size": 2 * N * (B + 8192) + 64 * MiB},
                                size_classes=(B,), format=True)
        self.kv = KVCacheStore(self.geom, model_id="bench-gpu", pinned_bytes=(N + 8) * (B + 8192),
                               block_store=self.store)
        self.facts = {"geometry": str(self.geom), "put": "pinned slots, written through, waited for, flushed",
                      "get": "pinned tier evicted, page cache dropped: from the block tier"}

    def _put(self) -> RunResult:
        keys = self._new_keys()

        def run() -> None:
            self.kv.put(keys, self.srcb)
            self.kv.wait_for_puts()
            self.store.flush()

        return _timed(self.blocks, run)

    def _get(self) -> RunResult:
        self.kv.evict(self.keys, tiers=("pinned",))
        drop_cache(self.image)
        return _timed(self.blocks, self._checked_get)

    def close(self) -> None:
        super().close()
        self.store.close()


class KvSharedSide(_KvSide):
    """``KVCacheStore``'s shared tier, fsynced; pinned tier off (the device path's route) or on."""

    tier = "shared"

    def __init__(self, blocks: Blocks, root: str, pinned: bool) -> None:
        super().__init__(blocks, root)
        from sfstore.kvcache import KVCacheStore
        from sfstore.paths.device import DevicePath

        B, N = blocks.block_bytes, blocks.nblocks
        cuda = blocks.lib.device == "cuda"
        if not pinned and not cuda:
            raise BenchSetupError("the device path carries GPU blocks; --device cpu has none")
        self.pinned = pinned
        self.label = f"KVCacheStore shared tier, pinned {'on' if pinned else 'off'}"
        self.shared = os.path.join(root, "shared")
        self.dp = DevicePath() if cuda else None
        self.kv = KVCacheStore(self.geom, model_id="bench-gpu", pinned_bytes=(N + 8) * (B + 8192) if pinned else 0,
                               shared_dir=self.shared, fsync_shared=True, device=self.dp)
        if self.dp is not None and not pinned:
            self.facts["registered"] = sum(self.dp.register(t) for t in (blocks.src, blocks.dst))
        desc = self.kv.describe()
        self.facts.update({"geometry": str(self.geom), "gpu_blocks": desc.get("gpu_blocks"),
                           "chunk_tokens": self.kv.chunk_tokens})

    def _put(self) -> RunResult:
        keys = self._new_keys()

        def run() -> None:
            self.kv.put(keys, self.srcb)
            self.kv.wait_for_puts()

        return _timed(self.blocks, run)

    def _get(self) -> RunResult:
        if self.pinned:
            self.kv.evict(self.keys, tiers=("pinned",))
        _drop_tree(self.shared)
        return _timed(self.blocks, self._checked_get)

    def close(self) -> None:
        super().close()
        if self.dp is not None:
            self.dp.close()
