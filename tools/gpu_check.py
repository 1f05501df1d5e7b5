"""GPU checks and device-path timings for a machine with a CUDA GPU (the device tool's H200), run once per task.

    python tools/gpu_check.py [--blocks 512] [--block-mib 2] [--budget 270] [--dir DIR] [--json OUT] [--skip-bench]

Checks what CPU-only CI cannot, each printing PASS/FAIL/SKIP with the reason; a failing check never stops the
others, and the exit status is 1 when any check failed (0 when all passed or were skipped: on a machine without
a GPU every GPU check is a SKIP saying why, and what to install where a package is missing).

Functional checks (kept from the first version):
  probe              the probe reports the GPUs (and GDS where present);
  cuda_registration  registered buffers are CUDA-registered (cuMemHostRegister) and copy to the GPU;
  read_into_cuda     FilePath.read_into a CUDA tensor (pinned bounce path) is bit-exact;
  checkpoint_cuda    sfstore.checkpoint.save of a state dict of CUDA tensors, load(device="cuda"): bit-exact.

Routes: ``--blocks`` blocks of ``--block-mib`` MiB (default 512 x 2 MiB = 1 GiB per route) are put (written,
then fsynced) and got back (read into preallocated GPU arrays) through every route available here, checked
bit-exact, and timed; between put and get the file is dropped from the page cache (posix_fadvise DONTNEED after
fsync) so the get reads storage, not memory. Slab and baseline files are preallocated before the clock starts.
  fio_odirect              fio's sequential O_DIRECT write (end_fsync=1), then read, of the same bytes (``--blocks``
                           blocks of bs = the block size, io_uring, else libaio, iodepth 32) in the same scratch
                           directory: the storage's limit, which every row is compared with (put/fio, get/fio);
                           SKIP without fio (apt-get install fio), or (cuda) without a GPU for the routes;
  <lib>_baseline           t.cpu() (cupy: .get()) + os.pwrite per block + fsync; np.fromfile + .cuda() (cupy:
                           .set()) per block: what code without sfstore does, the reference for every ratio;
  <lib>_devicepath_gds     DevicePath(mode="gds"): kvikio/cuFile GPU-direct (the arrays registered with cuFile);
  <lib>_devicepath_compat  DevicePath(mode="compat"): kvikio compat mode (its own host bounce buffers);
  <lib>_devicepath_host    DevicePath(mode="staged"): sfstore's pinned staging buffers and I/O engine;
  kvcache_torch            KVCacheStore (bfloat16 blocks of the given size) over a BlockStore image file: put
                           (pinned tier + write-through, waited for and flushed), get after evicting the pinned
                           tier (from the block tier: storage), get again (from the pinned tier);
  kvcache_torch_device     KVCacheStore with the pinned tier off: CUDA blocks to the shared tier's files and back
                           through the device path (route gds, compat or staged, as describe() reports), the
                           counters checked to add up (bytes_gpu_direct + bytes_staged): the "pinned off" row;
  kvcache_torch_device_pinned  the same with the pinned tier on (room for every block) above the shared tier:
                           put (copied into pinned slots, written through, waited for), get after evicting the
                           pinned tier (from the shared tier): the "pinned on" row; describe()'s routes reported;
  per_layer_overlap        32-layer blocks (bytes as --block-mib) in the pinned tier; (a) every layer loaded alone
                           (prefetch, get_layer_into per layer on a load stream), (b) a stand-in compute alone (a
                           spin kernel per layer, calibrated to a layer's load time, on a compute stream), (c) both
                           as an engine interleaves them (layer i + 1 loads while layer i computes, the compute
                           stream waiting on layer i's event): exposed load = t(c) - t(b), hidden = 1 - exposed /
                           t(a), the goal hidden >= 70% (on CUDA only; --device cpu runs it without streams,
                           time.sleep standing in for the compute, and reports the numbers without a goal);
  vllm_offload_spec        vLLM builds sfstore's SfstoreOffloadingSpec (OffloadingSpecFactory) and its CPU offloading
                           worker over 4 layers of CUDA KV pages; 8 blocks go GPU -> vLLM's CPU tier -> sfstore's
                           shared tier (the tiering manager's cascade), then a second engine (its own, empty CPU tier)
                           finds them there, promotes them and loads them into zeroed GPU blocks: bit-exact (vLLM's
                           CPU platform cannot run this worker); SKIP where vLLM is not installed or lacks vLLM 0.33's
                           offloading API, or without a GPU;
with <lib> torch (CUDA tensors) and cupy (arrays). Each route reports put and get GiB/s, the ratio to its
library's baseline and to fio, and whether the bytes came back bit-exact; a table is printed and ``--json``
writes it all.

Benches (subprocesses, run from the checkout's root on ``--blocks x --block-mib`` bytes, stopped at the budget;
``--skip-bench`` SKIPs them): their goal lines and ratios (a missed goal is reported, not a FAIL)
  bench_checkpoint_save_async  python -m tools.bench checkpoint --cases 'save_async*';
  bench_kvcache_nixl       python -m tools.bench kvcache --cases '*nixl*', with .venv-kvbench's python where there
                           is one (NIXL lives there); SKIP with the bench's reason where NIXL cannot run.

Time: a global budget (``--budget``, default 270 s) is checked before each route; the routes left when it runs out
are SKIPped, saying so. A watchdog stops the script ``--grace`` seconds after the budget (a hung transfer is a
FAIL, the JSON is still written), so it fits a 5-minute slot on the device machine. The bench subprocesses get what
is left of the budget (less 2 s) as their timeout; past it they are killed, a FAIL.

``--device cpu`` runs the same routes with CPU torch tensors (no GPU needed): it exercises this script (routes,
timing, verification, table, JSON) where no GPU is; its numbers say nothing about GPUs.

JSON (``--json OUT``): ``checks`` (every check in order: ``check``, ``status``, ``detail``, ``seconds``, ``metrics``
where measured, ``trace`` on a failure), ``table`` (one row per measured route: ``put_gib_s``, ``get_gib_s``,
``put_vs_baseline``, ``get_vs_baseline``, ``put_vs_fio``, ``get_vs_fio`` (None where fio did not run),
``bit_exact`` (None: not verified, fio's row), ``cold_get``, seconds and bytes), ``summary`` (counts),
``environment`` (torch/cupy/kvikio versions, GPU, device_mode(), engine, scratch filesystem), ``stopped``.
per_layer_overlap's ``metrics`` hold ``t_load_s``, ``t_compute_s``, ``t_interleaved_s``, ``exposed_load_s``,
``hidden_fraction`` and ``goal_met``; the benches' ``goals``, ``acceptance`` and ``cases`` (ratios).

Needs sfstore importable (installed, or this checkout: the script then adds it to ``sys.path``) with its native
helper built (``tools/dev.sh setup``; else the registered-buffer checks SKIP saying so), torch with CUDA, and for
the kvikio and cupy routes ``pip install 'sfstore[gpu]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
KV_LAYER_BYTES = 2 * 16 * 8 * 128 * 2  # one layer of a KV block: K and V x 16 tokens x 8 heads x 128 dims, bf16
PIP = {
    "torch": "pip install torch (a CUDA build: see https://pytorch.org/get-started/locally/)",
    "cupy": "pip install cupy-cuda12x (or pip install 'sfstore[gpu]')",
    "kvikio": "pip install kvikio-cu12 (or pip install 'sfstore[gpu]')",
    "numpy": "pip install numpy",
}
SLAB = "blocks.slab"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIO_QD = 32  # fio's queue depth: the depth at which a disk's sequential O_DIRECT limit is reached
OVERLAP_LAYERS = 32
HIDDEN_GOAL = 0.70  # issue #15: an engine's per-layer loads hide >= 70% of their time behind its compute

Result = dict[str, Any]


class Skip(Exception):
    """The check cannot run here; the message says why (and what to install)."""


@dataclass
class Outcome:
    """What a check found: ``ok`` False makes it a FAIL (the metrics are kept)."""

    detail: str
    ok: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)


# -- helpers ---------------------------------------------------------------------------------------------------


def _gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / GiB / seconds if seconds > 0 else float("inf")


def _ratio(x: float | None, base: float | None) -> float | None:
    return round(x / base, 2) if x is not None and base else None


def _drop_cache(path: str) -> bool:
    """fsync ``path`` and drop its pages from the page cache, as the benches do (so the next read comes from
    storage); False where that failed."""
    try:
        _tools_bench("common").drop_cache(path)
        return True
    except (OSError, AttributeError):
        return False


def _drop_tree(root: str) -> bool:
    ok = True
    for d, _dirs, files in os.walk(root):
        for f in files:
            if not os.path.islink(os.path.join(d, f)):  # (a shared tier's chunk links hold no data)
                ok = _drop_cache(os.path.join(d, f)) and ok
    return ok


def _preallocate(path: str, size: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        done += n


def _mount_of(path: str) -> dict[str, str]:
    """The mount under ``path`` (mount point, filesystem type, source; ``?`` where the mount table cannot say)."""
    mount = _tools_bench("common").mount_of(path)
    if mount is None:
        return {"mountpoint": "", "fstype": "?", "source": "?"}
    return {"mountpoint": mount.mountpoint, "fstype": mount.fstype, "source": mount.source}


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _no_gpu_reason() -> str:
    if not _driver_present():
        return "no CUDA GPU here (no NVIDIA driver: libcuda.so.1 cannot be loaded)"
    return "no usable CUDA GPU (the NVIDIA driver loads, but no device is visible)"


def _kvikio() -> Any:
    """kvikio, or Skip with the pip command."""
    try:
        return importlib.import_module("kvikio")
    except Exception as exc:  # ImportError, or kvikio failing to load its libraries
        raise Skip(f"kvikio is not usable ({type(exc).__name__}: {exc}): {PIP['kvikio']}") from None


def _kvikio_setting(kvikio: Any, name: str) -> Any:
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
def _kvikio_compat_on(kvikio: Any) -> Iterator[None]:
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
        raise Skip("this kvikio cannot switch to compat mode at run time (no kvikio.defaults.set)")


# -- array libraries -------------------------------------------------------------------------------------------


class Lib:
    """One array library on one device: allocate, slice into blocks, compare, move to and from the host."""

    name = "?"
    device = "cuda"

    def alloc(self, nbytes: int, random: bool = False) -> Any:
        raise NotImplementedError

    def blocks(self, arr: Any, count: int, size: int) -> list[Any]:
        return [arr[i * size:(i + 1) * size] for i in range(count)]

    def zero(self, arr: Any) -> None:
        raise NotImplementedError

    def equal(self, a: Any, b: Any) -> bool:
        raise NotImplementedError

    def to_host(self, blk: Any) -> Any:
        raise NotImplementedError

    def from_host(self, host: Any, dst: Any) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass

    def first_mismatch(self, a: Any, b: Any, count: int, size: int) -> int | None:
        """``None`` when ``a`` and ``b`` are equal, else the first block that differs."""
        if self.equal(a, b):
            return None
        for i in range(count):
            if not self.equal(a[i * size:(i + 1) * size], b[i * size:(i + 1) * size]):
                return i
        return -1


def _numpy() -> Any:
    """numpy (every library's host side), or Skip saying how to install it."""
    try:
        import numpy
    except ImportError:
        raise Skip(f"numpy is not installed: {PIP['numpy']}") from None
    return numpy


class TorchLib(Lib):
    name = "torch"

    def __init__(self, device: str) -> None:
        _numpy()
        try:
            import torch
        except ImportError as exc:
            raise Skip(f"torch is not installed ({exc}): {PIP['torch']}") from None
        self.torch = torch
        self.device = device
        if device == "cuda":
            if getattr(torch.version, "cuda", None) is None:
                if _driver_present():
                    raise Skip(f"torch {torch.__version__} is a CPU-only build though an NVIDIA driver is here: "
                               f"{PIP['torch']}")
                raise Skip(f"{_no_gpu_reason()}; torch {torch.__version__} is a CPU-only build")
            if not torch.cuda.is_available():
                raise Skip(f"{_no_gpu_reason()}: torch.cuda.is_available() is False (torch {torch.__version__}, "
                           f"CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")

    def alloc(self, nbytes: int, random: bool = False) -> Any:
        t = self.torch
        if random:
            return t.randint(0, 256, (nbytes,), dtype=t.uint8, device=self.device)
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

    def __init__(self, device: str) -> None:
        if device != "cuda":
            raise Skip("cupy arrays live on a GPU (--device cpu runs CPU torch tensors only)")
        np = _numpy()
        try:
            import cupy
        except Exception as exc:
            raise Skip(f"cupy is not usable ({type(exc).__name__}: {exc}): {PIP['cupy']}") from None
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as exc:
            raise Skip(f"{_no_gpu_reason()}: cupy finds no device ({type(exc).__name__}: {exc})") from None
        if count < 1:
            raise Skip(f"{_no_gpu_reason()}: cupy finds no device")
        self.cupy = cupy
        self.np = np

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


# -- the run -----------------------------------------------------------------------------------------------------


class Run:
    """Settings, the scratch directory, the budget, the source data of each library and the baselines."""

    def __init__(self, args: argparse.Namespace, scratch: str) -> None:
        self.args = args
        self.device: str = args.device
        self.nblocks: int = args.blocks
        self.block_bytes: int = int(args.block_mib * MiB)
        self.total = self.nblocks * self.block_bytes
        self.scratch = scratch
        self.budget: float = args.budget
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.budget
        self.durations: list[float] = []
        self.baselines: dict[str, tuple[float, float]] = {}
        self._libs: dict[str, Lib | str] = {}
        self._src: dict[str, Any] = {}

    def lib(self, name: str) -> Lib:
        got = self._libs.get(name)
        if got is None:
            try:
                got = TorchLib(self.device) if name == "torch" else CupyLib(self.device)
            except Skip as exc:
                got = str(exc)
            self._libs[name] = got
        if isinstance(got, str):
            raise Skip(got)
        return got

    def torch_lib(self) -> TorchLib:
        lib = self.lib("torch")
        assert isinstance(lib, TorchLib)
        return lib

    def cuda_torch(self) -> Any:
        """torch with a CUDA device, or Skip."""
        if self.device != "cuda":
            raise Skip("a CUDA check (--device cpu)")
        return self.torch_lib().torch

    def src(self, lib: Lib) -> Any:
        """The random source bytes of ``lib`` (made once, ``total`` bytes)."""
        if lib.name not in self._src:
            self._src[lib.name] = lib.alloc(self.total, random=True)
            lib.sync()
        return self._src[lib.name]

    def workdir(self, name: str) -> str:
        path = os.path.join(self.scratch, name)
        os.makedirs(path, exist_ok=True)
        return path

    def check_budget(self, heavy: bool) -> None:
        left = self.deadline - time.monotonic()
        est = statistics.median(self.durations) if heavy and self.durations else 0.0
        if left <= (max(1.0, est) if heavy else 0.0):
            took = f"; a route took ~{est:.0f} s" if est else ""
            raise Skip(f"not run: the time budget ({self.budget:.0f} s) is spent ({max(left, 0):.0f} s left{took}); "
                       "raise --budget or lower --blocks")

    def row(self, lib: str, route: str, put_s: float | None, get_s: float | None, exact: bool | None,
            cold: bool | None, nbytes: int | None = None) -> dict[str, Any]:
        """One table row; ratios against ``lib``'s baseline (none for ``nbytes`` other than the route size), and
        against fio's (filled in by :meth:`Report.finish`, once every row is in). ``exact`` None: not verified."""
        n = self.total if nbytes is None else nbytes
        # ratios from the unrounded rates: at a few MiB/s, rounding to 3 decimals first moves them by 1% or more
        put = _gib_s(n, put_s) if put_s is not None else None
        get = _gib_s(n, get_s) if get_s is not None else None
        base = self.baselines.get(lib) if nbytes is None else None
        return {
            "route": route, "lib": lib, "bytes": n, "put_s": put_s, "get_s": get_s,
            "put_gib_s": None if put is None else round(put, 3), "get_gib_s": None if get is None else round(get, 3),
            "put_vs_baseline": _ratio(put, base[0] if base else None),
            "get_vs_baseline": _ratio(get, base[1] if base else None),
            "put_vs_fio": None, "get_vs_fio": None, "bit_exact": exact, "cold_get": cold,
        }


def _describe_rows(rows: list[dict[str, Any]]) -> str:
    parts = []
    for r in rows:
        bits = []
        for op in ("put", "get"):
            v = r[f"{op}_gib_s"]
            if v is not None:
                x = r[f"{op}_vs_baseline"]
                bits.append(f"{op} {v:.2f} GiB/s" + (f" (x{x:.2f})" if x is not None else ""))
        parts.append(f"{r['route']}: " + ", ".join(bits) + (", NOT bit-exact" if r["bit_exact"] is False else ""))
    return "; ".join(parts)


def _exactness(run: Run, lib: Lib, src: Any, dst: Any) -> tuple[bool, str]:
    bad = lib.first_mismatch(src, dst, run.nblocks, run.block_bytes)
    if bad is None:
        return True, ""
    return False, f"bytes differ (first in block {bad})"


# -- functional checks -------------------------------------------------------------------------------------------


def _check_probe(run: Run) -> Outcome:
    if run.device != "cuda":
        raise Skip("a GPU check (--device cpu)")
    from sfstore.probe import probe

    report = probe()
    gpus = report["gpus"]
    if gpus.get("status") != "ok":
        if not _driver_present():
            raise Skip(f"{_no_gpu_reason()}; probe: {gpus.get('reason', gpus.get('status'))}")
        return Outcome(f"the NVIDIA driver loads but the probe reports no GPU: {gpus}", ok=False)
    return Outcome(f"{gpus.get('count', '?')} GPU(s); gds: {report['gds'].get('status')}",
                   metrics={"gpus": gpus, "gds": report["gds"]})


def _check_cuda_registration(run: Run) -> Outcome:
    torch = run.cuda_torch()
    from torch.utils.dlpack import from_dlpack

    from sfstore.buffers import RegisteredBufferPool, memory_capabilities

    caps = memory_capabilities()
    if not caps["cuda_register"]["ok"]:
        return Outcome(f"cuda registration unavailable: {caps['cuda_register']['reason']}", ok=False)
    with RegisteredBufferPool(8 << 20, cuda_register="on") as pool:
        buf = pool.acquire()
        assert buf.cuda_registered
        host = from_dlpack(buf)
        host.fill_(7)
        dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(dev.sum().item()) == 7 * (8 << 20)
        del host, dev
        buf.release()
    return Outcome("cuMemHostRegister ok; host->device copy from a registered buffer verified")


def _check_read_into_cuda(run: Run) -> Outcome:
    torch = run.cuda_torch()
    from sfstore.paths.file import FilePath

    fp = FilePath(run.workdir("read_into_cuda"))
    payload = os.urandom(20 << 20)
    fp.write("x.bin", payload)
    out = torch.empty(len(payload), dtype=torch.uint8, device="cuda")
    n = fp.read_into("x.bin", out)
    assert n == len(payload), f"read {n} of {len(payload)} bytes"
    ok = bytes(out.cpu().numpy()) == payload
    return Outcome("FilePath.read_into(cuda tensor) through pinned bounce buffers: "
                   + ("bit-exact" if ok else "NOT bit-exact"), ok=ok)


def _bits(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _compare_tree(a: Any, b: Any, device: str, where: str = "") -> str | None:
    """The first difference between the saved state dict ``a`` and the loaded ``b`` (``None``: identical)."""
    import torch

    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return f"{where}: a {type(b).__name__}, not a tensor"
        if b.device.type != device:
            return f"{where}: on {b.device}, not {device}"
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return f"{where}: {b.dtype}{tuple(b.shape)}, saved {a.dtype}{tuple(a.shape)}"
        return None if torch.equal(_bits(a), _bits(b).to(a.device)) else f"{where}: bytes differ"
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{where}: keys {sorted(map(str, b)) if isinstance(b, dict) else type(b).__name__}"
        for k in a:
            diff = _compare_tree(a[k], b[k], device, f"{where}/{k}")
            if diff:
                return diff
        return None
    return None if a == b and type(a) is type(b) else f"{where}: {b!r}, saved {a!r}"


def _check_checkpoint(run: Run) -> Outcome:
    lib = run.torch_lib()
    torch = lib.torch
    from sfstore import checkpoint

    dev = run.device
    per = max(4096, min(run.total // 4, 256 * MiB) // 4)  # bytes per big tensor: ~total/4 in all, at most 256 MiB
    g = torch.Generator(device=dev).manual_seed(0)
    side = max(1, int((per // 4) ** 0.5))
    model: dict[str, Any] = {
        "w": torch.randn(side, side, generator=g, device=dev),  # float32
        "w_t": torch.randn(side, side, generator=g, device=dev).to(torch.bfloat16).t(),  # strided
        "emb": torch.randn(per // 2, generator=g, device=dev).to(torch.float16),
        "ids": torch.randint(-(2**40), 2**40, (max(1, per // 8),), generator=g, device=dev),  # int64
        "mask": torch.rand(4097, generator=g, device=dev) > 0.5,
    }
    state = {"model": model, "optim": {"step": torch.tensor(7, device=dev), "lr": 3e-4, "betas": (0.9, 0.999)},
             "epoch": 3}
    nbytes = sum(int(t.numel() * t.element_size()) for t in model.values()) + 8
    lib.sync()
    url = os.path.join(run.workdir("checkpoint"), "step-7")
    t0 = time.perf_counter()
    checkpoint.save(state, url, metadata={"step": 7})
    save_s = time.perf_counter() - t0
    cold = _drop_tree(url)
    t0 = time.perf_counter()
    back = checkpoint.load(url, device=dev)
    lib.sync()
    load_s = time.perf_counter() - t0
    diff = _compare_tree(state, back, "cuda" if dev == "cuda" else "cpu")
    row = run.row("torch", f"checkpoint save/load(device={dev!r})", save_s, load_s, diff is None, cold, nbytes)
    detail = (f"save {row['put_gib_s']:.2f} GiB/s, load {row['get_gib_s']:.2f} GiB/s of {nbytes / MiB:.0f} MiB: "
              + ("bit-exact, every tensor on " + dev if diff is None else f"MISMATCH {diff}"))
    return Outcome(detail, ok=diff is None, metrics={"table": [row]}, rows=[row])


# -- routes ---------------------------------------------------------------------------------------------------------


def _route_baseline(run: Run, libname: str) -> Outcome:
    import numpy as np

    lib = run.lib(libname)
    src = run.src(lib)
    dst = lib.alloc(run.total)
    B = run.block_bytes
    path = os.path.join(run.workdir(f"{libname}_baseline"), "baseline.bin")
    _preallocate(path, run.total)
    try:
        srcb, dstb = lib.blocks(src, run.nblocks, B), lib.blocks(dst, run.nblocks, B)
        lib.sync()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY)
        try:
            for i, blk in enumerate(srcb):
                host = lib.to_host(blk)  # t.cpu() / a.get()
                _pwrite_all(fd, memoryview(host).cast("B"), i * B)
            os.fsync(fd)
        finally:
            os.close(fd)
        put_s = time.perf_counter() - t0
        cold = _drop_cache(path)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            for i, blk in enumerate(dstb):
                host = np.fromfile(f, dtype=np.uint8, count=B)
                if host.size != B:
                    raise OSError(f"short read: {host.size} of {B} bytes in block {i}")
                lib.from_host(host, blk)  # torch.from_numpy(h).cuda() / a.set(h)
        lib.sync()
        get_s = time.perf_counter() - t0
        exact, why = _exactness(run, lib, src, dst)
    finally:
        del dst
        os.unlink(path)
        lib.release()
    if exact:
        run.baselines[libname] = (_gib_s(run.total, put_s), _gib_s(run.total, get_s))
    row = run.row(libname, f"{libname} baseline", put_s, get_s, exact, cold)
    return Outcome(_describe_rows([row]) + (f"; {why}" if why else ""), ok=exact, metrics={"table": [row]},
                   rows=[row])


def _route_devicepath(run: Run, libname: str, mode: str) -> Outcome:
    from sfstore.paths.device import DevicePath, device_mode

    lib = run.lib(libname)
    notes: list[str] = []
    forced_compat: Any = contextlib.nullcontext()
    if mode in ("gds", "compat"):
        if run.device != "cuda":
            raise Skip(f"DevicePath mode {mode!r} moves GPU memory (--device cpu)")
        kvikio = _kvikio()
        found, why = device_mode()
        if mode == "gds" and found != "gds":
            raise Skip(f"no GPU-direct storage here: device_mode() is {found!r}: {why}")
        if mode == "compat" and found not in ("gds", "compat"):
            raise Skip(f"kvikio is not usable here: device_mode() is {found!r}: {why}")
        if mode == "compat" and found == "gds":
            forced_compat = _kvikio_compat_on(kvikio)  # else kvikio would use cuFile: the gds route
            notes.append("kvikio compat mode forced on")
        notes.append(f"kvikio {getattr(kvikio, '__version__', '?')}, "
                     f"{_kvikio_setting(kvikio, 'num_threads')} thread(s)")
    src = run.src(lib)
    dst = lib.alloc(run.total)
    B = run.block_bytes
    root = run.workdir(f"{libname}_devicepath_{mode}")
    with forced_compat:
        dp = DevicePath(root, mode=mode)
        try:
            path = dp.slab(SLAB, run.total)
            if mode == "gds":
                try:
                    dp.register(src)
                    dp.register(dst)
                    notes.append("arrays registered with cuFile")
                except Exception as exc:
                    notes.append(f"cuFile registration failed ({type(exc).__name__}: {exc}); unregistered")
            srcb, dstb = lib.blocks(src, run.nblocks, B), lib.blocks(dst, run.nblocks, B)
            fsync_path = _tools_bench("common").fsync_path
            lib.sync()
            t0 = time.perf_counter()
            futs = [dp.write_async(SLAB, blk, i * B) for i, blk in enumerate(srcb)]
            short = [i for i, fut in enumerate(futs) if fut.get() != B]
            dp.flush()
            fsync_path(path)
            put_s = time.perf_counter() - t0
            if short:
                raise AssertionError(f"short writes in blocks {short[:5]}")
            cold = _drop_cache(path)
            t0 = time.perf_counter()
            futs = [dp.read_into_async(SLAB, blk, i * B) for i, blk in enumerate(dstb)]
            short = [i for i, fut in enumerate(futs) if fut.get() != B]
            lib.sync()
            get_s = time.perf_counter() - t0
            if short:
                raise AssertionError(f"short reads in blocks {short[:5]}")
            exact, why = _exactness(run, lib, src, dst)
            desc = dp.describe()
        finally:
            dp.close()
            shutil.rmtree(root, ignore_errors=True)
            del dst
            lib.release()
    if desc["mode"] != mode:
        notes.append(f"DevicePath ran in mode {desc['mode']!r}")
    counters = desc.get("counters", {})
    notes.append(f"bytes GPU-direct {counters.get('bytes_gpu_direct', 0) / MiB:.0f} MiB, "
                 f"staged {counters.get('bytes_staged', 0) / MiB:.0f} MiB, "
                 f"host direct {counters.get('bytes_direct', 0) / MiB:.0f} MiB, "
                 f"bounced {counters.get('bytes_bounced', 0) / MiB:.0f} MiB")
    row = run.row(libname, f"{libname} DevicePath {mode}", put_s, get_s, exact, cold)
    metrics = {"table": [row], "mode": desc["mode"], "why": desc.get("why"), "counters": counters, "notes": notes}
    return Outcome(_describe_rows([row]) + f" [{'; '.join(notes)}]" + (f"; {why}" if why else ""), ok=exact,
                   metrics=metrics, rows=[row])


def _kv_geometry(B: int) -> Any:
    """The KV geometry of the kv routes: bfloat16 blocks of ``B`` bytes, 16 tokens x 8 heads x 128 dims per layer
    (as many 64 KiB layers as fit: 32 at 2 MiB), or Skip when ``B`` is not a whole number of layers."""
    from sfstore.kvcache import KVGeometry

    if B % KV_LAYER_BYTES:
        raise Skip(f"a KV block is a whole number of {KV_LAYER_BYTES // 1024} KiB layers; --block-mib gives {B} bytes")
    geom = KVGeometry(num_layers=B // KV_LAYER_BYTES, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert geom.block_bytes == B
    return geom


class _KvRoute:
    """What every KV route stands on: bfloat16 blocks (``srcb``, ``dstb``) over the source and a destination array,
    a work directory, the route's ``KVCacheStore`` (:meth:`use`) and what it found wrong (``problems``). Made by
    :func:`_kv_route`, which closes what was registered in ``closing`` (last first) and releases the arrays."""

    def __init__(self, run: Run, lib: TorchLib, geom: Any, root: str, src: Any, dst: Any,
                 closing: contextlib.ExitStack) -> None:
        torch = lib.torch
        self.run, self.lib, self.geom, self.root, self.src, self.dst = run, lib, geom, root, src, dst
        self.closing = closing
        self.srcb = list(src.view(torch.bfloat16).view(run.nblocks, *geom.block_shape).unbind(0))
        self.dstb = list(dst.view(torch.bfloat16).view(run.nblocks, *geom.block_shape).unbind(0))
        self.kv: Any = None
        self.keys: list[bytes] = []
        self.problems: list[str] = []

    def use(self, kv: Any) -> Any:
        """Make ``kv`` the route's store (closed on the way out) and take the keys of its ``nblocks`` blocks."""
        self.closing.callback(kv.close)
        self.kv = kv
        self.keys = kv.keys_for(list(range(self.run.nblocks * self.geom.block_tokens)))
        return kv

    def warm_up(self, *tiers: str) -> None:
        """Put and evict other keys' blocks once, so the pinned pool's slots are allocated and registered before any
        clock, as in a serving engine."""
        warm = self.kv.keys_for(list(range(self.run.nblocks * self.geom.block_tokens)), extra=("warm-up",))
        self.kv.put(warm, self.srcb)
        self.kv.wait_for_puts()
        self.kv.evict(warm, tiers=tiers)

    def timed_get(self, tier: str, what: str, label: str = "") -> tuple[float, bool]:
        """Every block got back into the destination, timed: ``(seconds, bit-exact)``; a block from another tier
        than ``tier``, or other bytes (``label`` in front), is a problem."""
        t0 = time.perf_counter()
        tiers = self.kv.get_into(self.keys, self.dstb)
        self.lib.sync()
        seconds = time.perf_counter() - t0
        if set(tiers) != {tier}:
            self.problems.append(f"{what} came from tiers {sorted(map(str, set(tiers)))}, not the {tier} tier")
        exact, why = _exactness(self.run, self.lib, self.src, self.dst)
        if why:
            self.problems.append(label + why)
        return seconds, exact

    def detail(self, rows: list[dict[str, Any]], note: str = "") -> str:
        """The route's line: its rows, ``note`` and the problems found."""
        return (_describe_rows(rows) + (f" [{note}]" if note else "")
                + (f"; {'; '.join(self.problems)}" if self.problems else ""))


@contextlib.contextmanager
def _kv_route(run: Run, name: str) -> Iterator[_KvRoute]:
    """A :class:`_KvRoute` in the work directory ``name``; everything it holds is released on the way out."""
    lib = run.torch_lib()
    geom = _kv_geometry(run.block_bytes)
    src = run.src(lib)
    dst = lib.alloc(run.total)
    root = run.workdir(name)
    route: _KvRoute | None = None
    try:
        with contextlib.ExitStack() as closing:
            route = _KvRoute(run, lib, geom, root, src, dst, closing)
            yield route
    finally:
        if route is not None:
            route.srcb = route.dstb = []
            route.dst = None
        shutil.rmtree(root, ignore_errors=True)
        del dst
        lib.release()


def _route_kvcache(run: Run) -> Outcome:
    from sfstore.blocks import BlockStore
    from sfstore.kvcache import KVCacheStore

    B, N = run.block_bytes, run.nblocks
    rows: list[dict[str, Any]] = []
    with _kv_route(run, "kvcache") as r:
        image = os.path.join(r.root, "blocks.img")
        store = BlockStore({"kind": "image", "path": image, "size": N * (B + 8192) + 64 * MiB}, size_classes=(B,),
                           format=True)
        r.closing.callback(store.close)
        kv = r.use(KVCacheStore(r.geom, model_id="gpu-check", pinned_bytes=(N + 8) * (B + 8192), block_store=store))
        assert len(r.keys) == N
        r.warm_up("pinned", "block")
        store.flush()
        r.lib.sync()
        t0 = time.perf_counter()
        kv.put(r.keys, r.srcb)
        kv.wait_for_puts()
        store.flush()
        put_s = time.perf_counter() - t0
        evicted = kv.evict(r.keys, tiers=("pinned",))
        if evicted != N:
            r.problems.append(f"evicted {evicted} of {N} blocks from the pinned tier")
        cold = _drop_cache(image)
        get_block_s, exact_block = r.timed_get("block", "get after eviction", "block tier: ")
        rows.append(run.row("torch", "KVCacheStore put + get (block tier)", put_s, get_block_s, exact_block, cold))
        r.lib.zero(r.dst)
        r.lib.sync()
        get_pinned_s, exact_pinned = r.timed_get("pinned", "second get", "pinned tier: ")
        rows.append(run.row("torch", "KVCacheStore get (pinned tier)", None, get_pinned_s, exact_pinned, None))
        stats = kv.stats()
    keep = ("puts", "gets", "hits_pinned", "hits_block", "bytes_device_staged", "lower_tier_errors", "put_p50_s",
            "get_p50_s")
    metrics = {"table": rows, "geometry": str(r.geom), "stats": {k: stats.get(k) for k in keep}}
    return Outcome(r.detail(rows), ok=not r.problems, metrics=metrics, rows=rows)


def _shared_store(r: _KvRoute, pinned_bytes: int, device_path: bool) -> tuple[Any, Any]:
    """The shared-tier routes' store, fsynced as the baseline (the cold get then reads storage), and its device
    path (None without one): ``(kv, dp)``."""
    from sfstore.kvcache import KVCacheStore
    from sfstore.paths.device import DevicePath

    dp = DevicePath() if device_path else None
    if dp is not None:
        r.closing.callback(dp.close)
    kv = r.use(KVCacheStore(r.geom, model_id="gpu-check", pinned_bytes=pinned_bytes,
                            shared_dir=os.path.join(r.root, "shared"), fsync_shared=True, device=dp))
    return kv, dp


def _route_kvcache_device(run: Run) -> Outcome:
    """KVCacheStore with the pinned tier off: CUDA blocks to the shared tier's files and back on the device path's
    route (gds: HBM to storage with no host copy; compat; staged), with the counters saying which bytes went direct."""
    if run.device != "cuda":
        raise Skip("the device path carries GPU blocks; --device cpu has none (its host path is kvcache_torch's)")
    N, B = run.nblocks, run.block_bytes
    with _kv_route(run, "kvcache_device") as r:
        kv, dp = _shared_store(r, pinned_bytes=0, device_path=True)
        registered = sum(dp.register(t) for t in (r.src, r.dst))
        r.lib.sync()
        t0 = time.perf_counter()
        kv.put(r.keys, r.srcb)
        put_s = time.perf_counter() - t0
        cold = _drop_tree(os.path.join(r.root, "shared"))
        get_s, exact = r.timed_get("shared", "get")
        desc = kv.describe()
        stats = kv.stats()
        layers: list[int] = []  # chunk files come up a layer at a time, each verified on the GPU
        again = kv.get_into(r.keys, r.dstb, on_layer=lambda _idx, layer: layers.append(layer))
        if again.count("shared") != len(r.keys) or sorted(set(layers)) != list(range(r.geom.num_layers)):
            r.problems.append(f"a get by layer answered {set(again)} and announced layers {sorted(set(layers))}")
    route = desc["gpu_blocks"].get("shared", {})
    dev = stats.get("device", {}).get("shared", {})
    moved = 2 * N * B
    if dev.get("bytes_gpu_direct", 0) + dev.get("bytes_staged", 0) != moved:
        r.problems.append(f"device counters {dev} do not add up to the {moved} bytes moved")
    if route.get("route") == "gds" and dev.get("bytes_staged", 0):
        r.problems.append(f"route gds but {dev['bytes_staged']} bytes were staged")
    row = run.row("torch", f"KVCacheStore pinned off, shared tier ({route.get('route')})", put_s, get_s, exact, cold)
    metrics = {"table": [row], "route": route, "device_counters": dev, "registered_buffers": registered,
               "device": desc.get("device", {}).get("mode")}
    detail = r.detail([row], f"route {route.get('route')}: {route.get('why')}; {dev}")
    return Outcome(detail, ok=not r.problems and exact, metrics=metrics, rows=[row])


def _route_kvcache_device_pinned(run: Run) -> Outcome:
    """KVCacheStore with the pinned tier on above the shared tier: blocks copied into pinned slots and written
    through to the shared tier's files; the get, after the pinned tier is evicted, reads them back from there (the
    "pinned on" row next to kvcache_torch_device's "pinned off")."""
    cuda = run.device == "cuda"
    B, N = run.block_bytes, run.nblocks
    with _kv_route(run, "kvcache_device_pinned") as r:
        # the device path given, as an engine would: describe() then says what it would route
        kv, _ = _shared_store(r, pinned_bytes=(N + 8) * (B + 8192), device_path=cuda)
        r.warm_up("pinned", "shared")
        before = kv.stats()
        r.lib.sync()
        t0 = time.perf_counter()
        kv.put(r.keys, r.srcb)
        kv.wait_for_puts()
        put_s = time.perf_counter() - t0
        evicted = kv.evict(r.keys, tiers=("pinned",))
        if evicted != N:
            r.problems.append(f"evicted {evicted} of {N} blocks from the pinned tier")
        cold = _drop_tree(os.path.join(r.root, "shared"))
        get_s, exact = r.timed_get("shared", "get after eviction")
        desc = kv.describe()
        stats = kv.stats()
    staged = stats["bytes_device_staged"] - before["bytes_device_staged"]
    if staged != (2 * N * B if cuda else 0):  # each block copied into its slot on the put, out of it on the get
        r.problems.append(f"bytes_device_staged grew by {staged}, not {2 * N * B if cuda else 0}")
    if stats["lower_tier_errors"]:
        r.problems.append(f"{stats['lower_tier_errors']} lower-tier error(s)")
    gpu = desc["gpu_blocks"]
    routes = ", ".join(f"{t}: {v.get('route')}" for t, v in gpu.items())
    row = run.row("torch", "KVCacheStore pinned on, shared tier", put_s, get_s, exact, cold)
    metrics = {"table": [row], "gpu_blocks": gpu, "device_counters": stats.get("device"),
               "bytes_device_staged": staged, "hits_shared": stats["hits_shared"] - before["hits_shared"],
               "device": (desc.get("device") or {}).get("mode"),
               "blocks": "cuda" if cuda else "cpu (--device cpu: host blocks, nothing staged)"}
    detail = r.detail([row], f"GPU blocks: {routes}; staged {staged / MiB:.0f} MiB")
    return Outcome(detail, ok=not r.problems and exact, metrics=metrics, rows=[row])


def _overlap_geometry(B: int) -> Any:
    """A 32-layer KV geometry of blocks of ``B`` bytes: 16 tokens, bfloat16, heads x head_dim = ``B / 2048``
    (head_dim 128 where that divides it: 8 heads at 2 MiB)."""
    from sfstore.kvcache import KVGeometry

    per_layer_token = OVERLAP_LAYERS * 2 * 16 * 2  # layers x (K, V) x tokens x bf16 bytes
    if B % per_layer_token:
        raise Skip(f"a {OVERLAP_LAYERS}-layer block of 16 tokens is a multiple of {per_layer_token} bytes; "
                   f"--block-mib gives {B}")
    per = B // per_layer_token
    dim = math.gcd(per, 128)
    geom = KVGeometry(num_layers=OVERLAP_LAYERS, block_tokens=16, num_kv_heads=per // dim, head_dim=dim,
                      dtype="bfloat16")
    assert geom.block_bytes == B
    return geom


def _stand_in_compute(torch: Any, stream: Any, seconds: float) -> tuple[Callable[[], None], str]:
    """A callable that keeps the compute stream busy for about ``seconds`` (one layer's compute), and what it is.

    On CUDA a spin kernel (``torch.cuda._sleep``) calibrated against CUDA events, or where this torch lacks it
    repeated matmuls; without a stream (``--device cpu``) ``time.sleep``: nothing runs beside it there.
    """
    if stream is None:
        return partial(time.sleep, seconds), f"time.sleep({seconds * 1e3:.2f} ms) per layer (no streams)"
    sleep = getattr(torch.cuda, "_sleep", None)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        if sleep is not None:
            probe = 20_000_000
            sleep(1000)  # the kernel's first launch loads it: outside the calibration
            start.record()
            sleep(probe)
            end.record()
            end.synchronize()
            per_s = probe / (start.elapsed_time(end) / 1e3)
            cycles = max(1, int(seconds * per_s))
            return partial(_on_stream, torch, stream, partial(sleep, cycles)), \
                f"torch.cuda._sleep({cycles}) per layer ({per_s / 1e9:.2f} G cycles/s)"
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        torch.matmul(a, a)
        start.record()
        for _ in range(10):
            torch.matmul(a, a)
        end.record()
        end.synchronize()
        one = start.elapsed_time(end) / 1e3 / 10
    reps = max(1, round(seconds / one))

    def matmuls() -> None:
        for _ in range(reps):
            torch.matmul(a, a)

    return partial(_on_stream, torch, stream, matmuls), f"{reps} bf16 2048x2048 matmuls per layer"


def _on_stream(torch: Any, stream: Any, fn: Callable[[], None]) -> None:
    """``fn()`` with ``stream`` current: its kernels are queued there."""
    with torch.cuda.stream(stream):
        fn()


def _check_per_layer_overlap(run: Run) -> Outcome:
    """An engine's per-layer loads behind its compute: 32-layer blocks in the pinned tier, each layer loaded with
    get_layer_into on a load stream while the layer before it computes; how much of the load time stays hidden."""
    lib = run.torch_lib()
    torch = lib.torch
    from sfstore.kvcache import KVCacheStore

    cuda = run.device == "cuda"
    B, N = run.block_bytes, run.nblocks
    geom = _overlap_geometry(B)
    L = geom.num_layers
    src = run.src(lib)
    dst = lib.alloc(run.total)
    srcb = list(src.view(torch.bfloat16).view(N, *geom.block_shape).unbind(0))
    per_block = dst.view(torch.bfloat16).view(N, *geom.block_shape)
    layer_dst = [[per_block[n, layer] for n in range(N)] for layer in range(L)]
    kv = KVCacheStore(geom, model_id="gpu-check-overlap", pinned_bytes=(N + 8) * (B + 8192))
    load_stream = torch.cuda.Stream() if cuda else None
    compute_stream = torch.cuda.Stream() if cuda else None
    problems: list[str] = []
    misses = 0

    def load(layer: int) -> Any:
        """Layer ``layer`` of every block into its destination, issued on the load stream; its event (CUDA)."""
        nonlocal misses
        ctx = torch.cuda.stream(load_stream) if load_stream is not None else contextlib.nullcontext()
        with ctx:
            tiers = kv.get_layer_into(keys, layer, layer_dst[layer])
            misses += sum(1 for t in tiers if t != "pinned")
            if load_stream is None:
                return None
            ev = torch.cuda.Event()
            ev.record(load_stream)
            return ev

    try:
        keys = kv.keys_for(list(range(N * geom.block_tokens)))
        kv.put(keys, srcb)
        kv.wait_for_puts()
        lib.sync()
        # (a) the loads alone
        t0 = time.perf_counter()
        kv.prefetch(keys, count=True).get()
        for layer in range(L):
            load(layer)
        lib.sync()
        t_load = time.perf_counter() - t0
        exact_a, why = _exactness(run, lib, src, dst)
        if why:
            problems.append(f"loads alone: {why}")
        busy, what = _stand_in_compute(torch, compute_stream, t_load / L)
        # (b) the stand-in compute alone
        lib.sync()
        t0 = time.perf_counter()
        for _layer in range(L):
            busy()
        lib.sync()
        t_compute = time.perf_counter() - t0
        # (c) both, as an engine interleaves them: layer i + 1 loads while layer i computes
        lib.zero(dst)
        lib.sync()
        t0 = time.perf_counter()
        kv.prefetch(keys, count=True).get()
        events = [load(0)]
        for layer in range(L):
            if compute_stream is not None:
                compute_stream.wait_event(events[layer])  # layer i's compute reads layer i's KV
            busy()
            if layer + 1 < L:
                events.append(load(layer + 1))
        lib.sync()
        t_both = time.perf_counter() - t0
        exact_c, why = _exactness(run, lib, src, dst)
        if why:
            problems.append(f"interleaved: {why}")
        stats = kv.stats()
    finally:
        try:
            kv.close()
        finally:
            layer_dst.clear()  # (the views, as dst: freed before the cache is emptied)
            del dst, srcb, per_block
            lib.release()
    if misses:
        problems.append(f"{misses} layer load(s) did not come from the pinned tier")
    exposed = t_both - t_compute
    hidden = 1.0 - exposed / t_load if t_load > 0 else 0.0
    exact = exact_a and exact_c
    met = hidden >= HIDDEN_GOAL if cuda else None
    row = run.row("torch", f"KVCacheStore get_layer_into x{L} (pinned tier)", None, t_load, exact, None)
    metrics = {"table": [row], "geometry": str(geom), "layers": L, "blocks": N, "compute": what,
               # to the nanosecond: hidden_fraction divides by t_load_s, which on --device cpu is a few hundred us
               "t_load_s": round(t_load, 9), "t_compute_s": round(t_compute, 9), "t_interleaved_s": round(t_both, 9),
               "exposed_load_s": round(exposed, 9), "hidden_fraction": round(hidden, 4),
               "goal": f"hidden >= {HIDDEN_GOAL:.0%}" if cuda else None, "goal_met": met, "streams": cuda,
               "gets": stats["gets"], "hits_pinned": stats["hits_pinned"]}
    goal = (f"goal hidden >= {HIDDEN_GOAL:.0%}: {'met' if met else 'MISSED'}" if cuda
            else "--device cpu: no streams, nothing overlaps; no goal")
    detail = (f"{L} layers x {N} blocks: loads alone {t_load * 1e3:.1f} ms, compute alone {t_compute * 1e3:.1f} ms "
              f"({what}), interleaved {t_both * 1e3:.1f} ms: exposed load {exposed * 1e3:.1f} ms, hidden "
              f"{hidden:.0%} ({goal})" + ("" if exact else ", NOT bit-exact")
              + (f"; {'; '.join(problems)}" if problems else ""))
    return Outcome(detail, ok=exact and not problems and met is not False, metrics=metrics, rows=[row])


# -- fio and the benches ---------------------------------------------------------------------------------------


OFFLOAD_LAYERS, OFFLOAD_BLOCK, OFFLOAD_HEADS, OFFLOAD_DIM, OFFLOAD_GPU_BLOCKS = 4, 16, 8, 128, 64


def _vllm_offload_modules() -> dict[str, Any]:
    """vLLM's offloading classes this check drives (vLLM 0.33's API), or Skip saying what is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed here: pip install vllm (a CUDA build; tools/vllm-env.sh makes a CPU one, "
                   "where vLLM's CPU offloading worker does not run)")
    names = {
        "config": "vllm.config", "base": "vllm.v1.kv_offload.base", "cpu_common": "vllm.v1.kv_offload.cpu.common",
        "factory": "vllm.v1.kv_offload.factory", "planning": "vllm.v1.core.kv_cache_planning",
        "interface": "vllm.v1.kv_cache_interface", "parallel": "vllm.distributed.parallel_state",
        "offload_config": "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config",
        "sfstore": "sfstore.kvcache.vllm_offload",
    }
    mods: dict[str, Any] = {}
    for key, name in names.items():
        try:
            mods[key] = importlib.import_module(name)
        except Exception as exc:  # ImportError, or vLLM failing to load its CUDA extensions
            import vllm

            raise Skip(f"vLLM {getattr(vllm, '__version__', '?')} has no usable {name} ({type(exc).__name__}: "
                       f"{exc}); this check follows vLLM 0.33's offloading API") from None
    for key, attr in (("base", "CanonicalKVCaches"), ("base", "GPULoadStoreSpec"), ("base", "make_offload_key"),
                      ("offload_config", "build_offloading_config")):
        if not hasattr(mods[key], attr):
            import vllm

            raise Skip(f"vLLM {getattr(vllm, '__version__', '?')} has no {names[key]}.{attr}: this check follows "
                       "vLLM 0.33's offloading API")
    return mods


def _offload_spec(m: dict[str, Any], torch: Any, model_dir: str, shared_dir: str,
                  engine_id: str) -> tuple[Any, Any, int]:
    """vLLM's config, the spec its OffloadingSpecFactory makes from ``spec_name: SfstoreOffloadingSpec`` and the
    bytes of one block of one layer."""
    extra = {"spec_name": "SfstoreOffloadingSpec", "spec_module_path": "sfstore.kvcache.vllm_offload",
             "cpu_bytes_to_use": 64 * MiB, "shared_dir": shared_dir, "model_id": "gpu-check-offload"}
    c = m["config"]
    cfg = c.VllmConfig(
        model_config=c.ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
        cache_config=c.CacheConfig(block_size=OFFLOAD_BLOCK),
        kv_transfer_config=c.KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                              engine_id=engine_id, kv_connector_extra_config=extra),
    )
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves before planning (the worker here
    # takes each layer as int8 pages, whatever the attention backend's layout)
    attn = m["interface"].FullAttentionSpec(block_size=OFFLOAD_BLOCK, num_kv_heads=OFFLOAD_HEADS,
                                            head_size=OFFLOAD_DIM, dtype=torch.bfloat16)
    specs = {f"model.layers.{i}.self_attn.attn": attn for i in range(OFFLOAD_LAYERS)}
    kcc = m["planning"].get_kv_cache_configs(
        cfg, [specs], [OFFLOAD_GPU_BLOCKS * attn.page_size_bytes * OFFLOAD_LAYERS],
        m["planning"].get_global_kv_cache_groups(cfg, [specs]))[0]
    spec = m["factory"].OffloadingSpecFactory.create_spec(m["offload_config"].build_offloading_config(cfg, kcc))
    if type(spec).__name__ != "SfstoreOffloadingSpec":
        raise AssertionError(f"vLLM made a {type(spec).__name__}, not sfstore's SfstoreOffloadingSpec")
    return cfg, spec, int(attn.page_size_bytes)


def _canonical(m: dict[str, Any], caches: list[Any], page: int) -> Any:
    """The caches as vLLM's OffloadingConnector hands them to its worker: one int8 (blocks, page) tensor per layer,
    all layers in one KV cache group."""
    b = m["base"]
    return b.CanonicalKVCaches(tensors=[b.CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in caches],
                               group_data_refs=[[b.CanonicalKVCacheRef(i, page) for i in range(len(caches))]])


def _offload_engine(m: dict[str, Any], spec: Any, caches: list[Any], page: int,
                    owned: list[Any]) -> tuple[Any, Any, Any]:
    """One engine's side of the offloading check: ``spec``'s worker over ``caches`` and its manager (both added to
    ``owned``, to be shut down) and the manager's sfstore tier: ``(worker, manager, tier)``."""
    worker = spec.get_worker(_canonical(m, caches, page))
    owned.append(worker)
    manager = spec.get_manager()
    owned.append(manager)
    return worker, manager, manager.secondary_tiers[0]


def _offload_settle(manager: Any, tier: Any, m: dict[str, Any], deadline_s: float = 60.0) -> None:
    """End scheduler steps until the sfstore tier's jobs are done and the tiering manager took their results."""
    end = time.monotonic() + deadline_s
    ctx = getattr(m["base"], "ScheduleEndContext", None)
    while True:
        tier.drain_jobs()
        with manager.lock:
            if ctx is not None:
                manager.on_schedule_end(ctx(new_req_ids=(), preempted_req_ids=()))
            busy = manager.has_pending_work()
        if not busy:
            return
        if time.monotonic() > end:
            raise TimeoutError("vLLM's tiering manager kept pending work (cascade or promotion never finished)")
        time.sleep(0.01)


def _offload_wait(worker: Any, job_id: int, what: str, deadline_s: float = 60.0) -> None:
    """Wait for one job of vLLM's CPU offloading worker; AssertionError when it failed."""
    worker.wait({job_id})
    end = time.monotonic() + deadline_s
    while True:
        done = {r.job_id: r for r in worker.get_finished()}
        if job_id in done:
            if not done[job_id].success:
                raise AssertionError(f"vLLM's offloading worker reported the {what} job failed")
            return
        if time.monotonic() > end:
            raise TimeoutError(f"vLLM's offloading worker never finished the {what} job")
        time.sleep(0.005)


def _check_vllm_offload(run: Run) -> Outcome:
    """SfstoreOffloadingSpec on a GPU: vLLM builds the spec (OffloadingSpecFactory), its CPU offloading worker moves
    GPU blocks to the CPU tier, the tiering manager cascades them to sfstore's shared tier; a second engine (its
    own, empty CPU tier) finds them there, promotes them and its worker loads them into zeroed GPU blocks, which
    must equal the first engine's bit for bit."""
    torch = run.cuda_torch()
    m = _vllm_offload_modules()
    ps = m["parallel"]
    base = run.workdir("vllm_offload")
    model_dir = os.path.join(base, "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
                   "intermediate_size": 2048, "num_attention_heads": OFFLOAD_HEADS,
                   "num_key_value_heads": OFFLOAD_HEADS, "head_dim": OFFLOAD_DIM,
                   "num_hidden_layers": OFFLOAD_LAYERS, "vocab_size": 1000, "max_position_embeddings": 512,
                   "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}, f)
    shared = os.path.join(base, "shared")
    tag = f"{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    owned: list[Any] = []  # managers and workers to shut down
    count = 8
    src_ids, dst_ids = list(range(3, 3 + count)), [OFFLOAD_GPU_BLOCKS - 1 - i for i in range(count)]
    keys = [m["base"].make_offload_key(bytes([i + 1]) * 32, 0) for i in range(count)]
    started_dist = False
    try:
        cfg_a, spec_a, attn_page = _offload_spec(m, torch, model_dir, shared, f"sfstore-gpu-check-a-{tag}")
        with m["config"].set_current_vllm_config(cfg_a):
            if not ps.model_parallel_is_initialized():
                with contextlib.closing(socket.socket()) as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{port}")
                ps.ensure_model_parallel_initialized(1, 1)
                started_dist = True
            gen = torch.Generator(device="cuda").manual_seed(16)
            caches_a = [torch.randint(-128, 128, (OFFLOAD_GPU_BLOCKS, attn_page), dtype=torch.int8, device="cuda",
                                      generator=gen) for _ in range(OFFLOAD_LAYERS)]
            worker_a, manager_a, tier_a = _offload_engine(m, spec_a, caches_a, attn_page, owned)
            t0 = time.monotonic()
            with manager_a.lock:
                ctx = m["base"].ReqContext(req_id="r1")
                manager_a.on_new_request(ctx)
                out = manager_a.prepare_store(keys, ctx)
            if list(out.keys_to_store) != keys:
                raise AssertionError(f"vLLM's manager stores {len(out.keys_to_store)} of the {count} blocks")
            worker_a.submit_store(1, m["base"].GPULoadStoreSpec(src_ids, [count], [0]), out.store_spec)
            _offload_wait(worker_a, 1, "GPU->CPU store")
            with manager_a.lock:
                manager_a.complete_store(keys, ctx)  # cascades to the secondary tier: sfstore
                manager_a.on_request_finished(ctx)
            _offload_settle(manager_a, tier_a, m)
            t_store = time.monotonic() - t0
            missing = [i for i, k in enumerate(keys) if not tier_a.store.contains(tier_a.key(k))]
            if missing:
                raise AssertionError(f"blocks {missing} did not reach sfstore's shared tier")

            _cfg_b, spec_b, _page = _offload_spec(m, torch, model_dir, shared, f"sfstore-gpu-check-b-{tag}")
            caches_b = [torch.zeros((OFFLOAD_GPU_BLOCKS, attn_page), dtype=torch.int8, device="cuda")
                        for _ in range(OFFLOAD_LAYERS)]
            worker_b, manager_b, tier_b = _offload_engine(m, spec_b, caches_b, attn_page, owned)
            t0 = time.monotonic()
            with manager_b.lock:
                ctx = m["base"].ReqContext(req_id="r2")
                manager_b.on_new_request(ctx)
                first = [str(manager_b.lookup(k, ctx)) for k in keys]
            _offload_settle(manager_b, tier_b, m)
            with manager_b.lock:
                again = [str(manager_b.lookup(k, ctx)) for k in keys]
                if not all(r.endswith("HIT") for r in again):
                    raise AssertionError(f"after the promotion from sfstore vLLM's lookups say {again} "
                                         f"(first {first})")
                load_spec = manager_b.prepare_load(keys, ctx)
            worker_b.submit_load(2, load_spec, m["base"].GPULoadStoreSpec(dst_ids, [count], [0]))
            _offload_wait(worker_b, 2, "CPU->GPU load")
            with manager_b.lock:
                manager_b.complete_load(keys, ctx)
                manager_b.on_request_finished(ctx)
            torch.cuda.synchronize()
            t_load = time.monotonic() - t0
            bad = [(layer, i) for layer in range(OFFLOAD_LAYERS) for i in range(count)
                   if not torch.equal(caches_b[layer][dst_ids[i]], caches_a[layer][src_ids[i]])]
            stats = tier_b.store.stats()
            nbytes = count * OFFLOAD_LAYERS * attn_page
            metrics = {"blocks": count, "layers": OFFLOAD_LAYERS, "bytes": nbytes, "store_s": round(t_store, 4),
                       "load_s": round(t_load, 4), "first_lookups": first,
                       "hits_shared": stats.get("hits_shared"), "resident": stats.get("resident"),
                       "spec": type(spec_a).__name__, "tier": type(tier_a).__name__}
            ok = not bad
            detail = (f"{count} GPU blocks x {OFFLOAD_LAYERS} layers ({nbytes / MiB:.1f} MiB): GPU -> vLLM's CPU tier "
                      f"-> sfstore's shared tier ({t_store * 1e3:.0f} ms), then in a second engine sfstore -> CPU "
                      f"tier -> zeroed GPU blocks ({t_load * 1e3:.0f} ms): "
                      + ("bit-exact" if ok else f"NOT bit-exact ({len(bad)} block layers differ, first {bad[0]})"))
            return Outcome(detail, ok=ok, metrics=metrics)
    finally:
        for obj in reversed(owned):
            with contextlib.suppress(Exception):
                obj.shutdown()
        if started_dist:
            with contextlib.suppress(Exception):
                ps.destroy_model_parallel()
            with contextlib.suppress(Exception):
                ps.destroy_distributed_environment()


def _tools_bench(module: str) -> Any:
    """``tools.bench.<module>`` from this checkout (its root put on ``sys.path`` when it is not there)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    return importlib.import_module(f"tools.bench.{module}")


def _run_process(cmd: list[str], timeout: float, **kwargs: Any) -> tuple[int | None, str, str]:
    """``(exit status, stdout, stderr)`` of ``cmd`` run in its own session; status None when it ran past
    ``timeout`` seconds (then its whole process group is killed: a bench's own fio goes with it)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as p:
        try:
            out, err = p.communicate(timeout=max(1.0, timeout))
            return p.returncode, out, err
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            return None, out or "", err or ""


def _tail(text: str, lines: int = 6) -> str:
    """The last ``lines`` non-blank lines of ``text`` on one line."""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


class _FioFailed(Exception):
    """fio exited with an error (or wrote no readable JSON): with io_uring, the check tries libaio."""


def _run_fio_job(run: Run, cmd: list[str], ddir: str) -> dict[str, Any]:
    """fio's numbers for one job (``ddir``: write or read) from its JSON output; _FioFailed when it fails."""
    rc, out, err = _run_process(cmd, run.deadline - time.monotonic())
    if rc is None:  # not a refused engine: no retry with another
        raise TimeoutError(f"fio {ddir} ran past the time budget, stopped ({_tail(err)})")
    try:
        job = json.loads(out[out.index("{"):])["jobs"][0]
    except (ValueError, KeyError, IndexError):
        job = None
    if rc != 0 or job is None or job.get("error"):
        raise _FioFailed(f"exit {rc}, error {job.get('error') if job else '?'}: {_tail(err or out)}")
    d = job[ddir]
    pct = d.get("clat_ns", {}).get("percentile", {})
    p50, p99 = pct.get("50.000000"), pct.get("99.000000")
    return {"seconds": max(float(d["runtime"]), 0.5) / 1e3,  # fio's runtime, whole ms (a write's fsync included)
            "bytes": int(d["io_bytes"]), "runtime_ms": float(d["runtime"]),
            "clat_p50_ms": None if p50 is None else round(float(p50) / 1e6, 3),
            "clat_p99_ms": None if p99 is None else round(float(p99) / 1e6, 3)}


def _check_fio(run: Run) -> Outcome:
    """fio's sequential O_DIRECT write, then read, of the routes' bytes in blocks of their size, on the scratch
    directory the routes use: the storage's limit for that shape, which every row's put/get is compared with."""
    exe = shutil.which("fio")
    if exe is None:
        raise Skip("fio is not on PATH: apt-get install fio (the O_DIRECT reference every route is compared with)")
    if run.device == "cuda":
        try:
            run.torch_lib()
        except Skip as exc:
            raise Skip(f"fio is the reference of the GPU routes, and none can run here: {exc}") from None
    fio = _tools_bench("fio")
    B, total = run.block_bytes, run.total
    root = run.workdir("fio")
    path = os.path.join(root, "fio.bin")
    notes: list[str] = []
    got: dict[str, dict[str, Any]] = {}
    engine = "io_uring"
    cold: bool | None = None
    try:
        _preallocate(path, total)  # as the routes' files: allocated before the clock starts
        try:
            os.close(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        except OSError as exc:
            raise Skip(f"the scratch filesystem ({_mount_of(root)['fstype']}) refuses O_DIRECT ({exc}): "
                       "use --dir on a disk filesystem") from None
        for op, ddir in (("put", "write"), ("get", "read")):
            job = fio.FioJob(name=f"gpu-check-{ddir}", filename=path, size=total, io_size=total, rw=ddir, bs=B,
                             iodepth=FIO_QD)
            while True:
                cmd = [a if not a.startswith("--ioengine=") else f"--ioengine={engine}"
                       for a in fio.fio_command(exe, job)]
                try:
                    got[op] = _run_fio_job(run, cmd, ddir)
                    break
                except _FioFailed as exc:
                    if engine != "io_uring":
                        raise
                    notes.append(f"io_uring failed ({exc}): libaio")  # e.g. io_uring refused in a container
                    engine = "libaio"
            got[op]["command"] = shlex.join(cmd)
            if op == "put":
                cold = _drop_cache(path)
        version = fio.fio_version(exe)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    problems = [f"fio {op} moved {g['bytes']} of {total} bytes" for op, g in got.items() if g["bytes"] != total]
    row = run.row("fio", f"fio O_DIRECT {engine}, QD {FIO_QD}", got["put"]["seconds"], got["get"]["seconds"], None,
                  cold)
    metrics = {"table": [row], "fio": version, "engine": engine, "bs": B, "iodepth": FIO_QD, "write": got["put"],
               "read": got["get"], "notes": notes}
    detail = (_describe_rows([row]) + f" [{version}, bs {B // 1024} KiB, direct=1, end_fsync=1"
              + (f"; {'; '.join(notes)}" if notes else "") + "]" + (f"; {'; '.join(problems)}" if problems else ""))
    return Outcome(detail, ok=not problems, metrics=metrics, rows=[row])


BENCHES = {  # check's argument -> (suite, its --cases glob)
    "checkpoint": ("checkpoint", "save_async*"),
    "kvcache": ("kvcache", "*nixl*"),
}


def _bench_python(suite: str) -> tuple[str, str]:
    """The interpreter for ``suite`` and a note on it: NIXL lives in .venv-kvbench (tools/kvbench-env.sh)."""
    if suite == "kvcache":
        kvb = os.path.join(REPO, ".venv-kvbench", "bin", "python")
        if os.access(kvb, os.X_OK):
            return kvb, ".venv-kvbench"
        return sys.executable, "no .venv-kvbench here"
    return sys.executable, ""


def summarize_bench(suite: str, doc: dict[str, Any]) -> Outcome:
    """The outcome of a bench run from its JSON: its goal lines (those of the cases that ran) and each case's
    ratio; Skip when every NIXL goal is n/a (NIXL cannot run here: the bench's reason). A missed goal is reported
    in the detail, not a FAIL; a goal the bench could not measure is one."""
    cases = [{k: c.get(k) for k in ("name", "ratio", "ratio_min", "ratio_max", "blocking_fraction") if k in c}
             for c in doc.get("cases", [])]
    goals = [g for g in doc.get("acceptance", []) if "not run" not in str(g.get("line", ""))
             and g.get("status") != "not run"]
    if suite == "kvcache":
        goals = [g for g in goals if "nixl" in str(g.get("case", ""))]
        if goals and all(g.get("status") == "n/a" for g in goals):
            raise Skip(f"NIXL cannot run here: {goals[0].get('reason', 'n/a')}")
    lines = [str(g["line"]).removeprefix("goal: ") for g in goals]
    unmeasured = [g for g in goals if g.get("met") is None]
    ratios = ", ".join(f"{c['name']} {c['ratio']:.2f}x" for c in cases if isinstance(c.get("ratio"), (int, float)))
    detail = "; ".join(lines) or "no goal line"
    if ratios:
        detail += f" [{ratios}]"
    metrics = {"goals": lines, "acceptance": goals, "cases": cases}
    return Outcome(detail, ok=bool(goals) and not unmeasured, metrics=metrics)


def _check_bench(run: Run, which: str) -> Outcome:
    """``python -m tools.bench <suite> --cases <glob>`` on ``--blocks x --block-mib`` bytes in the scratch
    directory, within what is left of the budget; its goal lines and ratios."""
    suite, cases = BENCHES[which]
    if run.args.skip_bench:
        raise Skip(f"not run: --skip-bench (python -m tools.bench {suite} --cases '{cases}' runs it)")
    python, note = _bench_python(suite)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if suite == "kvcache":  # the bench would run its sfstore sides only to say n/a: ask it first, cheaply
        rc, out, _err = _run_process([python, "-c", "from tools.bench.suites.kvcache import probe_nixl\n"
                                      "print(probe_nixl() or '')"], min(60.0, run.deadline - time.monotonic()),
                                     cwd=REPO, env=env)
        if rc == 0 and out.strip():
            raise Skip(f"NIXL cannot run here: {out.strip().splitlines()[-1]}" + (f" ({note})" if note else ""))
    left = run.deadline - time.monotonic() - 2.0
    if left < 10:
        raise Skip(f"not run: {max(left, 0):.0f} s of the budget left; raise --budget")
    size = max(run.total, 2 * MiB)  # the checkpoint bench takes 1 MiB at least, the kvcache bench one 2 MiB block
    work = run.workdir(f"bench_{suite}")
    out_json = os.path.join(work, f"{suite}.json")
    cmd = [python, "-m", "tools.bench", suite, "--cases", cases, "--size", str(size), "--dir", work,
           "--json", out_json]
    t0 = time.monotonic()
    try:
        rc, out, err = _run_process(cmd, left, cwd=REPO, env=env)
        doc: dict[str, Any] | None = None
        if rc == 0:
            with open(out_json) as f:
                doc = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    took = time.monotonic() - t0
    base = {"command": shlex.join(cmd), "python": python, "seconds": round(took, 2)}
    if rc is None:
        return Outcome(f"did not finish in the {left:.0f} s left of the budget: stopped ({_tail(out + err, 3)})",
                       ok=False, metrics={**base, "output_tail": _tail(out + err, 12)})
    if rc == 2:  # BenchSetupError: the bench cannot run here, and says why
        raise Skip(f"the bench cannot run here: {_tail(err or out, 2)}")
    if doc is None:
        return Outcome(f"exit {rc}: {_tail(err or out, 4)}", ok=False, metrics={**base, "output_tail": _tail(err, 12)})
    outcome = summarize_bench(suite, doc)
    outcome.metrics.update(base)
    outcome.detail += f" ({took:.0f} s" + (f", {note}" if note else "") + ")"
    return outcome


Check = tuple[str, bool, Callable[[Run], Outcome]]


def _lib_routes(libname: str) -> list[Check]:
    """The routes of one library: its baseline, then the device path in gds, compat and staged mode (``host``)."""
    modes = (("gds", "gds"), ("compat", "compat"), ("host", "staged"))
    return [(f"{libname}_baseline", True, partial(_route_baseline, libname=libname)),
            *((f"{libname}_devicepath_{name}", True, partial(_route_devicepath, libname=libname, mode=mode))
              for name, mode in modes)]


# name, heavy (moves the route's data: the budget estimate applies), function
CHECKS: list[Check] = [
    ("probe", False, _check_probe),
    ("cuda_registration", False, _check_cuda_registration),
    ("read_into_cuda", False, _check_read_into_cuda),
    ("fio_odirect", True, _check_fio),
    *_lib_routes("torch"),
    ("kvcache_torch", True, _route_kvcache),
    ("kvcache_torch_device", True, _route_kvcache_device),
    ("kvcache_torch_device_pinned", True, _route_kvcache_device_pinned),
    ("per_layer_overlap", True, _check_per_layer_overlap),
    ("vllm_offload_spec", True, _check_vllm_offload),
    ("checkpoint_cuda", True, _check_checkpoint),
    *_lib_routes("cupy"),
    ("bench_checkpoint_save_async", True, partial(_check_bench, which="checkpoint")),
    ("bench_kvcache_nixl", True, partial(_check_bench, which="kvcache")),
]


# -- environment, table, JSON -----------------------------------------------------------------------------------


def _environment(run: Run) -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "device": run.device,
                           "scratch": run.scratch, "scratch_mount": _mount_of(run.scratch)}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("engine", lambda: repr(importlib.import_module("sfstore.engine").get_engine())),
        ("native_helper", lambda: list(importlib.import_module("sfstore.buffers").native_available())),
        ("device_mode", lambda: list(importlib.import_module("sfstore.paths.device").device_mode())),
        ("torch", lambda: _torch_env()),
        ("cupy", lambda: getattr(importlib.import_module("cupy"), "__version__", "?")),
        ("kvikio", lambda: _kvikio_env()),
    ]
    for key, fn in steps:
        try:
            env[key] = fn()
        except Exception as exc:
            env[key] = f"unavailable ({type(exc).__name__}: {exc})"
    return env


def _torch_env() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
    if out["cuda_available"]:
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def _kvikio_env() -> dict[str, Any]:
    kvikio = importlib.import_module("kvikio")
    return {"version": getattr(kvikio, "__version__", "?"), "compat_mode": _kvikio_setting(kvikio, "compat_mode"),
            "num_threads": _kvikio_setting(kvikio, "num_threads")}


def _fmt(v: float | None, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{suffix}"


def add_fio_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill every row's ``put_vs_fio`` / ``get_vs_fio`` from the fio row (None for all when fio did not run)."""
    fio = next((r for r in rows if r.get("lib") == "fio"), None)
    for r in rows:
        for op in ("put", "get"):
            r[f"{op}_vs_fio"] = _ratio(r[f"{op}_gib_s"], fio[f"{op}_gib_s"] if fio else None)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'route':<46} {'put GiB/s':>10} {'get GiB/s':>10} {'put/base':>9} {'get/base':>9} {'put/fio':>8} "
            f"{'get/fio':>8}  bit-exact")
    lines = [head, "-" * len(head)]
    for r in rows:
        exact = {True: "yes", False: "NO", None: "n/a"}[r["bit_exact"]]
        lines.append(f"{r['route']:<46} {_fmt(r['put_gib_s']):>10} {_fmt(r['get_gib_s']):>10} "
                     f"{_fmt(r['put_vs_baseline'], 'x'):>9} {_fmt(r['get_vs_baseline'], 'x'):>9} "
                     f"{_fmt(r.get('put_vs_fio'), 'x'):>8} {_fmt(r.get('get_vs_fio'), 'x'):>8}  {exact}")
    return "\n".join(lines)


class Report:
    """The results so far; written by the main thread, or by the watchdog when the budget is overrun."""

    def __init__(self, run: Run, env: dict[str, Any]) -> None:
        self.run = run
        self.env = env
        self.results: list[Result] = []
        self.rows: list[dict[str, Any]] = []
        self.current: str | None = None
        self.lock = threading.Lock()
        self.finished = False

    def add(self, result: Result, rows: list[dict[str, Any]]) -> None:
        with self.lock:
            self.results.append(result)
            self.rows.extend(rows)
        r = result
        print(f"{r['status']:<5} {r['check']}: {r['detail']}", flush=True)

    def finish(self, json_path: str | None, stopped: str | None = None) -> int:
        """Print the table and the summary, write the JSON; the exit status."""
        run = self.run
        counts = {s: sum(1 for r in self.results if r["status"] == s) for s in ("PASS", "FAIL", "SKIP")}
        elapsed = time.monotonic() - run.t0
        print()
        with self.lock:
            add_fio_ratios(self.rows)
        if self.rows:
            size = f"{run.total / GiB:.2f} GiB" if run.total >= GiB else f"{run.total / MiB:g} MiB"
            print(f"{run.nblocks} blocks x {run.block_bytes / MiB:g} MiB per route ({size}); "
                  f"get after fsync + page-cache drop; ratios against the same library's baseline (base) and fio's "
                  f"O_DIRECT write/read of the same bytes (fio)")
            print(format_table(self.rows))
        else:
            print("no route was measured")
        print(f"\ngpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {elapsed:.0f} s "
              f"(budget {run.budget:.0f} s)" + (f"; {stopped}" if stopped else ""), flush=True)
        if run.device == "cuda" and counts["PASS"] == 0 and counts["FAIL"] == 0:
            print("note: nothing ran: every check was skipped (see the reasons above)", flush=True)
        if json_path:
            doc = {
                "tool": "tools/gpu_check.py",
                "args": {k: v for k, v in vars(run.args).items()},
                "blocks": run.nblocks, "block_bytes": run.block_bytes, "bytes_per_route": run.total,
                "budget_s": run.budget, "elapsed_s": round(elapsed, 2), "stopped": stopped,
                "environment": self.env, "summary": counts, "checks": self.results, "table": self.rows,
            }
            with open(json_path, "w") as f:
                json.dump(doc, f, indent=2, default=str)
            print(f"JSON: {json_path}", flush=True)
        return 1 if counts["FAIL"] else 0


def _watchdog(report: Report, json_path: str | None, remaining: list[str], scratch: str, owned: bool) -> None:
    """Past budget + grace: the running check FAILs, the rest SKIP, the JSON is written, the process exits 1."""
    with report.lock:
        if report.finished:
            return
        report.finished = True
        current = report.current
    grace = report.run.args.grace
    if current is not None:
        report.add({"check": current, "status": "FAIL",
                    "detail": f"still running {report.run.budget:g} s + {grace:g} s after the start: stopped "
                              "(hung or far too slow)"}, [])
    for name in remaining:
        if name != current and not any(r["check"] == name for r in report.results):
            report.add({"check": name, "status": "SKIP", "detail": "not run: the script was stopped at the budget"},
                       [])
    try:
        report.finish(json_path, stopped="stopped by the watchdog")
    finally:
        if owned:
            shutil.rmtree(scratch, ignore_errors=True)
        os._exit(1)


def _optional_module(exc: ImportError) -> str | None:
    name = (exc.name or "").split(".")[0]
    return None if name in ("", "sfstore") else name


def run_checks(run: Run, report: Report) -> None:
    from sfstore.errors import EngineUnavailableError

    for name, heavy, fn in CHECKS:
        with report.lock:
            if report.finished:
                return
            report.current = name
        t0 = time.monotonic()
        rows: list[dict[str, Any]] = []
        result: Result
        try:
            run.check_budget(heavy)
            out = fn(run)
            rows = out.rows
            result = {"check": name, "status": "PASS" if out.ok else "FAIL", "detail": out.detail}
            if out.metrics:
                result["metrics"] = out.metrics
        except Skip as exc:
            result = {"check": name, "status": "SKIP", "detail": str(exc)}
        except ImportError as exc:
            mod = _optional_module(exc)
            if mod is not None:
                result = {"check": name, "status": "SKIP",
                          "detail": f"missing module {mod} ({exc}): {PIP.get(mod, f'pip install {mod}')}"}
            else:
                result = {"check": name, "status": "FAIL", "detail": repr(exc), "trace": traceback.format_exc()}
        except Exception as exc:
            if isinstance(exc, EngineUnavailableError) and "_native" in str(exc):
                result = {"check": name, "status": "SKIP", "detail": f"sfstore's native helper is not loaded here "
                          f"({exc}): build it with tools/dev.sh setup (or carry sfstore/_native*.so with the checkout)"}
            else:
                result = {"check": name, "status": "FAIL", "detail": f"{type(exc).__name__}: {exc}",
                          "trace": traceback.format_exc()}
        seconds = time.monotonic() - t0
        result["seconds"] = round(seconds, 2)
        if heavy and result["status"] != "SKIP":
            run.durations.append(seconds)
        with report.lock:
            if report.finished:  # the watchdog took over while this check ran
                return
            report.current = None
        report.add(result, rows)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or "GPU checks"
    parser = argparse.ArgumentParser(description=doc.splitlines()[0],
                                     epilog="Exit status: 1 when any check FAILED, else 0 (SKIPs included).")
    parser.add_argument("--blocks", type=int, default=512, help="blocks per route (default 512)")
    parser.add_argument("--block-mib", type=float, default=2.0,
                        help="MiB per block (default 2; a multiple of 4 KiB, of 64 KiB for the KV cache)")
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds for all checks (default 270); routes left when it runs out are SKIPped")
    parser.add_argument("--grace", type=float, default=25.0,
                        help="seconds past the budget before the watchdog stops a hung check (default 25)")
    parser.add_argument("--dir", metavar="DIR",
                        help="scratch directory (a temporary directory is made in it and removed; default: in "
                             "sfstore's data directory, so on a disk filesystem)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run the routes with CPU torch tensors (tests this script without a GPU)")
    parser.add_argument("--skip-bench", action="store_true",
                        help="SKIP the bench_* checks (python -m tools.bench subprocesses: tens of seconds each)")
    parser.add_argument("--kvikio-threads", type=int, metavar="N",
                        help="set kvikio's thread pool size (default: kvikio's own, KVIKIO_NTHREADS)")
    args = parser.parse_args(argv)
    if args.blocks < 1:
        parser.error("--blocks must be at least 1")
    block_bytes = args.block_mib * MiB
    if block_bytes <= 0 or block_bytes != int(block_bytes) or int(block_bytes) % 4096:
        parser.error("--block-mib must give a positive multiple of 4096 bytes")
    if args.budget <= 0 or args.grace < 0:
        parser.error("--budget must be positive and --grace not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if importlib.util.find_spec("sfstore") is None:  # run from a checkout without sfstore installed
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.kvikio_threads:
        try:
            kv = importlib.import_module("kvikio")
            if callable(getattr(kv.defaults, "set", None)):
                kv.defaults.set("num_threads", args.kvikio_threads)
            else:
                kv.defaults.num_threads_reset(args.kvikio_threads)
        except Exception as exc:
            print(f"note: --kvikio-threads not applied ({type(exc).__name__}: {exc})", flush=True)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        base = args.dir
    else:
        from sfstore import defaults

        base = str(defaults.get("data_dir"))
        os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="gpu-check-", dir=base)
    run = Run(args, scratch)
    env = _environment(run)
    print(f"gpu_check: {args.blocks} x {args.block_mib:g} MiB per route, budget {args.budget:.0f} s, device "
          f"{args.device}, scratch {scratch} ({env['scratch_mount'].get('fstype')})", flush=True)
    report = Report(run, env)
    timer = threading.Timer(max(0.0, run.deadline + args.grace - time.monotonic()), _watchdog,
                            (report, args.json, [n for n, _h, _f in CHECKS], scratch, True))
    timer.daemon = True
    timer.start()
    try:
        run_checks(run, report)
    finally:
        timer.cancel()
        with report.lock:
            taken = report.finished
            report.finished = True
        if not taken:
            # The timer thread holds the report (and through it the checks' tensors) until it ends: joined here,
            # its last references go now, on its own thread, not while the interpreter finalizes. There, a torch
            # tensor freed on that thread gives the GIL up and asks for it back, CPython ends the thread with
            # pthread_exit, and the forced unwind through torch's noexcept frames aborts the process
            # ("terminate called without an active exception").
            timer.join()
            shutil.rmtree(scratch, ignore_errors=True)
    if taken:  # the watchdog is writing the report and will exit
        time.sleep(3600)
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
