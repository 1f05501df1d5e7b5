"""Suite ``kvcache``: ``KVCacheStore`` put/get of KV blocks per tier against fio, NIXL's POSIX backend, LMCache's
local disk backend and a plain memory copy, in one run.

``python -m tools.bench kvcache [--size 1g] [--repeat N] [--quick] [--json PATH]``

Blocks are those of a ``KVGeometry(num_layers=32, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")``
(2 MiB each; ``--layers``/``--block-tokens``/``--kv-heads``/``--head-dim`` change it), moved in batches of
``--batch`` (default 64): one batch is one request's ``batch x block_tokens`` tokens, whose keys are
``KVCacheStore.keys_for(tokens)``. The working set is ``--size`` bytes of blocks (default 1g, 256m with
``--quick``): N blocks, ``N / batch`` batches of seeded random token ids. Every side puts the same ``batch``
source blocks (distinct random bytes, reused batch after batch) and gets into the same ``batch`` destinations
(both page-aligned anonymous memory, numpy views), batch after batch, gets in a seeded random batch order
per pair.

Cases, each ``--warmup`` (default 1, discarded) + ``--repeat`` pairs in ABBA order (sfstore, reference,
reference, sfstore, ...):

* ``put-pinned-vs-memcpy`` / ``get-pinned-vs-memcpy`` -- the pinned tier (``KVCacheStore(pinned_bytes=enough for
  N blocks, block_store=None)``): ``put(keys, blocks)`` (a copy into a pinned slot plus its xxh3-64) and
  ``get_into(keys, dests)`` of blocks resident there (every one must come back from ``"pinned"``), against
  ``numpy.copyto`` of the same bytes between the same buffers and N page-aligned 2 MiB blocks (the memory
  limit, ``BENCHMARKING.md`` rule 5).
* ``put-block-vs-<ref>`` / ``get-block-vs-<ref>`` -- the NVMe tier: a ``BlockStore`` on an image file
  (``<dir>/kvcache-<size>.img``, prepared with random bytes once and reused, formatted with one size class of the
  block size), under ``KVCacheStore(pinned_bytes=0)``, so nothing stays pinned: a put writes each block straight
  from the caller's memory (O_DIRECT), computes its xxh3-64 meanwhile and then writes its slot header (``put()``
  per batch waits for it), and the run ends with ``BlockStore.flush()`` (``fdatasync``) inside the timed region;
  before each put run every key is evicted from the store and the freed slots recycled (untimed). A get reads
  every block from the block store straight into its destination, its checksum checked by the engine (each must
  come back from ``"block"``), on a cold cache (fsync + ``POSIX_FADV_DONTNEED``; O_DIRECT
  anyway). The references, each on a cold cache too:

  - ``fio``: ``--rw=randwrite|randread --bs=<block> --iodepth=<qd> --direct=1 --ioengine=io_uring`` (writes with
    ``--end_fsync=1``), N blocks of the image region the store's slots occupy (``--offset`` = the class's
    offset, ``--size`` = N slot strides). Its per-block latency is fio's completion latency per I/O. Note the
    placement: the store puts a batch into adjacent free slots, so its I/O is 64 neighbouring 2 MiB requests
    per batch, while fio's are random over the region; on a disk (or a host cache) that favours neighbours, a
    get above 1x fio says more about that than about the device's random-read limit.
  - ``nixl``: NIXL (``nixl_agent``) with its ``POSIX`` backend on io_uring (``use_uring``; its default queue when
    that is refused), DRAM registered as ``[(addr, len, 0, "")]`` and the image as fd-mode ``FILE_SEG`` (opened
    O_DIRECT), on the store's own slots: the descriptors are the value areas of the N keys' slots
    (``BlockStore.locate``, untimed), so NIXL moves the same bytes at the same places in the same batches and
    order as the store (a NIXL put rewrites each slot's value with the same bytes, so the store stays intact).
    Per batch one ``make_prepped_xfer`` of ``batch`` descriptors (WRITE or READ), posted and polled until done;
    writes end with ``fsync`` inside the timed region. Needs ``nixl`` and ``nixl-cu12``
    (``tools/kvbench-env.sh``); runs without a GPU.
  - ``lmcache``: LMCache 0.5.6's ``LMCacheEngine`` with only its local disk backend (``local_cpu=False``,
    ``local_disk=<dir>/kvcache-lmcache/``, ``chunk_size=block_tokens``, so one chunk is one block) and a small CPU
    subclass of its ``GPUConnectorInterface`` that copies each chunk between the caller's blocks and LMCache's
    memory objects (its stock vLLM connectors need CUDA). Per batch one ``store(tokens, ...)`` /
    ``retrieve(tokens, ...)`` of the batch's tokens; its disk writes are asynchronous, so a put run waits until
    every block is on disk and fsyncs every file (8 threads) and the directory inside the timed region; before
    each put run the previous files are removed (untimed). ``--lmcache-odirect`` turns on its ``use_odirect``.

The sources and destinations (and the memcpy reference's N blocks) are private anonymous memory, 2 MiB-aligned
and advised for transparent huge pages (``buffers`` in the JSON says how much got them): an O_DIRECT request into
scattered 4 KiB pages needs a segment per page, and where the device takes fewer (virtio-blk: 254) a 2 MiB request
is split, which on the VMs here cuts 2 MiB transfers to a third; the references get the best buffers there are.
fio uses its own (``malloc``) buffers.

When a reference cannot run here (NIXL or LMCache not installed, or failing), its cases say why ("not
installed: ...") and the goal line is ``n/a`` with the reason; the other cases still run.

Measured per run: bytes, operations (blocks), wall time, CPU of the whole process (fio: its job's usr + sys),
per-batch latency p50/p99 of every batched call (sfstore's ``put``/``get_into``, NIXL's transfer, LMCache's
``store``/``retrieve``; a block is delivered when its batch returns, so its latency is its batch's), fio's
per-I/O completion latency p50/p99, and the store's own put/get percentiles (``KVCacheStore.stats()``). Goals
(the issue's acceptance), printed as ``PASS``/``MISS``/``n/a`` lines and kept in the JSON (``acceptance``):
NVMe-tier get and put >= 0.85x fio, >= 1x NIXL POSIX and >= 1.5x LMCache local disk; pinned-tier get >= 0.8x
memcpy (median of the pairwise throughput ratios).
"""

from __future__ import annotations

import argparse
import importlib
import mmap
import os
import random
import shutil
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tools.bench.common import (
    GIB,
    BenchSetupError,
    CpuMeter,
    PeakRss,
    RatioGoal,
    RunResult,
    Table,
    batch_latency,
    check_bench_dir,
    default_bench_dir,
    drop_cache,
    evaluate_ratio_goals,
    format_size,
    import_for_bench,
    machine_info,
    nonneg_int,
    parse_size,
    positive_int,
    resident_bytes,
    side_summary,
    summarize_pairs,
    utc_now,
    warn,
)
from tools.bench.fio import FioJob, find_fio, fio_command, fio_version, run_fio
from tools.bench.pairs import select_cases as select_from
from tools.bench.registry import Suite, register

__all__ = ["TIERS", "REFERENCES", "GOALS", "QUICK_CASES", "Case", "Goal", "all_cases", "select_cases",
           "evaluate_goals", "probe_nixl", "probe_lmcache", "run"]

MIB = 1 << 20
TIERS = ("pinned", "block")
#: reference -> its name in the JSON (``reference_tool``)
REFERENCES = {"memcpy": "numpy.copyto", "fio": "fio", "nixl": "NIXL POSIX", "lmcache": "LMCache local disk"}
_DEFAULT_SIZE = 1 << 30
_QUICK_SIZE = 256 << 20
_MODEL_ID = "sfstore-bench"
_SLOW_RUN_S = 0.1
#: threads fsyncing LMCache's files at the end of a put run (its own disk writers are 4 threads)
_FSYNC_THREADS = 8
_ENV_HINT = "create .venv-kvbench with tools/kvbench-env.sh and run the suite with .venv-kvbench/bin/python"


@dataclass(frozen=True)
class Case:
    """One pair of sides: ``op`` (``put``/``get``) of blocks in ``tier`` against ``reference``."""

    op: str
    tier: str
    reference: str

    @property
    def name(self) -> str:
        """``<op>-<tier>-vs-<reference>``, e.g. ``get-block-vs-fio``."""
        return f"{self.op}-{self.tier}-vs-{self.reference}"

    @property
    def writes(self) -> bool:
        """Whether the case writes."""
        return self.op == "put"


Goal = RatioGoal


GOALS = (
    Goal("NVMe-tier get >= 0.85x fio", "get-block-vs-fio", 0.85),
    Goal("NVMe-tier put >= 0.85x fio", "put-block-vs-fio", 0.85),
    Goal("NVMe-tier get >= 1x NIXL POSIX", "get-block-vs-nixl", 1.0),
    Goal("NVMe-tier put >= 1x NIXL POSIX", "put-block-vs-nixl", 1.0),
    Goal("NVMe-tier get >= 1.5x LMCache local disk", "get-block-vs-lmcache", 1.5),
    Goal("NVMe-tier put >= 1.5x LMCache local disk", "put-block-vs-lmcache", 1.5),
    Goal("pinned-tier get >= 0.8x memcpy (numpy.copyto)", "get-pinned-vs-memcpy", 0.8),
)
#: ``--quick``: the cases the goals quote (on a smaller working set).
QUICK_CASES = tuple(g.case for g in GOALS)


def all_cases() -> list[Case]:
    """Every case in run order: the pinned tier, then the NVMe tier per reference; put before get.

    Returns
    -------
    list of Case
        Eight cases.
    """
    cases = [Case(op, "pinned", "memcpy") for op in ("put", "get")]
    for ref in ("fio", "nixl", "lmcache"):
        cases += [Case(op, "block", ref) for op in ("put", "get")]
    return cases


def select_cases(patterns: Sequence[str] | None = None, quick: bool = False) -> list[Case]:
    """The cases to run, in :func:`all_cases` order: :func:`~tools.bench.pairs.select_cases` with ``patterns``
    (shell globs) and, with ``quick``, only :data:`QUICK_CASES`; raises ``BenchSetupError`` when none is left."""
    return select_from("kvcache", all_cases(), patterns, QUICK_CASES, quick)


# -- the optional references -----------------------------------------------------------------------------------


def probe_nixl() -> str | None:
    """Why NIXL's POSIX backend cannot be used here, or None when it can.

    Returns
    -------
    str or None
        ``not installed: ...`` (with how to get it) or the error; None when ``nixl._api`` imports and has
        the POSIX plugin.
    """
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        api = importlib.import_module("nixl._api")
    except ImportError as exc:
        return f"not installed ({exc}); {_ENV_HINT}"
    except Exception as exc:  # a broken install: say what it raised
        return f"cannot import nixl: {type(exc).__name__}: {exc}"
    try:
        agent = api.nixl_agent(f"sfstore-probe-{os.getpid()}", api.nixl_agent_config(backends=[]))
        plugins = list(agent.get_plugin_list())
    except Exception as exc:
        return f"NIXL cannot start an agent: {type(exc).__name__}: {exc}"
    if "POSIX" not in plugins:
        return f"NIXL has no POSIX plugin (it has {', '.join(plugins) or 'none'})"
    return None


def probe_lmcache() -> str | None:
    """Why LMCache's local disk backend cannot be used here, or None when it can.

    Returns
    -------
    str or None
        ``not installed: ...`` (with how to get it) or the error; None when its engine, config and connector
        interface import and its CPU device ops loaded.
    """
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    try:
        lmcache = importlib.import_module("lmcache")
        for name in ("lmcache.v1.config", "lmcache.v1.metadata", "lmcache.v1.cache_engine",
                     "lmcache.v1.gpu_connector"):
            importlib.import_module(name)
    except ImportError as exc:
        return f"not installed ({exc}); {_ENV_HINT}"
    except Exception as exc:
        return f"cannot import lmcache: {type(exc).__name__}: {exc}"
    if getattr(lmcache, "device_ops", None) is None:
        return "lmcache has no device ops (its CPU ops need numba: pip install numba)"
    return None


# -- arguments -------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the kvcache suite's options.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The suite's parser (common options already added).
    """
    parser.epilog = ("cases: " + ", ".join(c.name for c in all_cases()) + ". --quick runs the goal cases ("
                     + ", ".join(QUICK_CASES) + ") on 256m of blocks. NIXL and LMCache run where they are "
                     "installed: " + _ENV_HINT + ".")
    g = parser.add_argument_group("kvcache suite")
    g.add_argument("--size", type=parse_size, default=None, metavar="SIZE",
                   help="bytes of blocks in the working set (default 1g, 256m with --quick)")
    g.add_argument("--batch", type=positive_int, default=64, metavar="N", help="blocks per call (default 64)")
    g.add_argument("--qd", type=positive_int, default=None, metavar="N",
                   help="queue depth of fio and of the block store's I/O engine (default: --batch)")
    g.add_argument("--outstanding", type=positive_int, default=1, metavar="N",
                   help="sfstore put batches in flight (default 1: put() per batch; N > 1: put_async with N in "
                        "flight); gets are always get_into() per batch")
    g.add_argument("--layers", type=positive_int, default=32, metavar="N", help="KVGeometry.num_layers (default 32)")
    g.add_argument("--block-tokens", type=positive_int, default=16, metavar="N",
                   help="KVGeometry.block_tokens (default 16)")
    g.add_argument("--kv-heads", type=positive_int, default=8, metavar="N", help="KVGeometry.num_kv_heads (default 8)")
    g.add_argument("--head-dim", type=positive_int, default=128, metavar="N", help="KVGeometry.head_dim (default 128)")
    g.add_argument("--lmcache-odirect", action="store_true",
                   help="LMCache's local disk backend with use_odirect (default: its default, buffered files)")
    g.add_argument("--warmup", type=nonneg_int, default=1, metavar="N",
                   help="pairs run first and discarded per case (default 1)")
    g.add_argument("--fio", metavar="PATH", help="fio executable (default: fio on PATH)")


# -- helpers ---------------------------------------------------------------------------------------------------


def _latency(batch_s: Sequence[float]) -> dict[str, Any]:
    """Per-batch latency of one run (a block's latency is its batch's: it is delivered when the call returns)."""
    out = batch_latency(batch_s)
    return {**out, "block_p50_ms": out["batch_p50_ms"], "block_p99_ms": out["batch_p99_ms"]}


_HUGE = 2 << 20


class _Blocks:
    """``count`` blocks of ``size`` bytes in one private anonymous mapping, 2 MiB-aligned and advised for
    transparent huge pages (best effort), as numpy ``uint16`` views (the geometry's element size, so
    ``KVCacheStore`` takes them as blocks). The same buffers serve every side. Huge pages matter here: an
    O_DIRECT request into scattered 4 KiB pages needs one segment per page, and a 2 MiB one is split where the
    device takes fewer (virtio-blk: 254), which on the VMs here cuts 2 MiB reads to a third."""

    def __init__(self, np: Any, count: int, size: int) -> None:
        self.size = size
        total = max(1, count * size)
        self.map = mmap.mmap(-1, total + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(self.map, dtype=np.uint8)
        skew = (-int(whole.ctypes.data)) % _HUGE
        try:
            self.map.madvise(mmap.MADV_HUGEPAGE, skew, total)
            self.advised = True
        except (AttributeError, OSError, ValueError):  # no THP here: plain pages
            self.advised = False
        self.raw: Any = whole[skew:skew + total]
        self.raw[:] = 0  # fault every page in now, while advised
        self.items: list[Any] = [self.raw[i * size:(i + 1) * size].view(np.uint16) for i in range(count)]
        self.bytes = total

    @property
    def address(self) -> int:
        """Address of the first block."""
        return int(self.raw.ctypes.data)

    def huge_bytes(self) -> int | None:
        """Bytes of the blocks backed by transparent huge pages (``/proc/self/smaps``), or None when unknown."""
        lo, hi = self.address, self.address + self.bytes
        found = 0
        inside = False
        try:
            with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
                for line in f:
                    head = line.split(maxsplit=1)[0] if line.strip() else ""
                    if "-" in head and not head.endswith(":"):
                        a, b = (int(x, 16) for x in head.split("-"))
                        inside = a < hi and b > lo
                    elif inside and head == "AnonHugePages:":
                        found += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            return None
        return min(found, self.bytes)

    def describe(self) -> dict[str, Any]:
        """What backs the blocks, for the JSON."""
        return {"bytes": self.bytes, "mapping": "private anonymous, 2 MiB-aligned",
                "madvise_hugepage": self.advised, "thp_bytes": self.huge_bytes()}

    def close(self) -> None:
        """Drop the views and unmap (only when nothing else still holds a view)."""
        self.items = []
        self.raw = None
        try:
            self.map.close()
        except BufferError:
            pass  # a library still holds a view: the mapping goes with the last one


def _prepare_file(path: str, size: int) -> None:
    """Create ``path`` with ``size`` bytes of random data (written, so no unwritten extent reads as zeros for
    free and no first write pays for allocation), or reuse it when it has that size."""
    try:
        if os.stat(path).st_size == size:
            return
    except FileNotFoundError:
        pass
    directory = os.path.dirname(path)
    st = os.statvfs(directory)
    if st.f_bavail * st.f_frsize < size + 64 * MIB:
        raise BenchSetupError(f"{directory} has {st.f_bavail * st.f_frsize / GIB:.2f} GiB free; the kvcache bench "
                              f"needs {size / GIB:.2f} GiB more for {os.path.basename(path)} (use --size or --dir)")
    print(f"preparing {path}: {format_size(size)} of random data (once; later runs reuse it)", flush=True)
    tmp = f"{path}.partial"
    chunk = os.urandom(min(size, 16 * MIB))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < size:
            n = min(len(chunk), size - done)
            os.pwrite(fd, chunk[:n] if n < len(chunk) else chunk, done)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _run_fio(exe: str, job: FioJob) -> RunResult:
    """Run ``job`` once (:func:`tools.bench.fio.run_fio`); its completion latency percentiles are also the
    per-block latency (``block_p50_ms``/``block_p99_ms``) the table shows."""
    result = run_fio(exe, job)
    extra = result.extra
    extra["block_p50_ms"], extra["block_p99_ms"] = extra["clat_p50_ms"], extra["clat_p99_ms"]
    return result


class _SideFailed(Exception):
    """A reference side failed at run time (the case reports it; the suite goes on)."""


# -- the bench -------------------------------------------------------------------------------------------------


class _Bench:
    """The geometry, the working set (tokens, keys, batches), the shared source and destination blocks, and the
    sides, each made on first use."""

    def __init__(self, args: argparse.Namespace, size: int, directory: str) -> None:
        self.args = args
        self.dir = directory
        self.np: Any = import_for_bench("numpy", "the kvcache bench needs numpy (pip install -e '.[bench]')")
        self.kvmod: Any = import_for_bench("sfstore.kvcache", "build sfstore first (pip install -e .)")
        self.errors: Any = import_for_bench("sfstore.errors", "build sfstore first (pip install -e .)")
        self.geom = self.kvmod.KVGeometry(num_layers=args.layers, block_tokens=args.block_tokens,
                                          num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype="bfloat16")
        self.block = int(self.geom.block_bytes)
        if self.block % 4096:
            raise BenchSetupError(f"a block of this geometry is {self.block} bytes; O_DIRECT on both sides needs a "
                                  "multiple of 4096")
        self.n = size // self.block
        if self.n < 1:
            raise BenchSetupError(f"--size {size}: smaller than one block ({self.block} bytes)")
        self.size = self.n * self.block
        self.label = format_size(self.size)
        self.batch = int(args.batch)
        self.qd = int(args.qd or args.batch)
        self.outstanding = int(args.outstanding)
        rng = random.Random(f"{args.seed}-kvcache")
        bt = self.geom.block_tokens
        counts = [min(self.batch, self.n - i) for i in range(0, self.n, self.batch)]
        self.tokens: list[list[int]] = [[rng.randrange(1, 32000) for _ in range(c * bt)] for c in counts]
        self.firsts = [sum(counts[:b]) for b in range(len(counts))]  # index of each batch's first block
        self.get_order: list[int] = []
        self.reorder(0)
        self.values = _Blocks(self.np, self.batch, self.block)
        self.dests = _Blocks(self.np, self.batch, self.block)
        self.values.raw[:] = self.np.frombuffer(rng.randbytes(self.batch * self.block), dtype=self.np.uint8)
        self.keys: list[list[bytes]] | None = None
        self._pinned: _Pinned | None = None
        self._block: _BlockTier | None = None
        self._nixl: _Nixl | None = None
        self._lmcache: _LMCache | None = None
        self.unavailable: dict[str, str] = {}
        self.fio: str | None = None

    def reorder(self, pair: int) -> None:
        """The batch order of pair ``pair``'s gets: its own seeded shuffle, the same for both sides of the pair
        (one order for every run would let the host's cache of the disk favour whichever side follows itself)."""
        order = list(range(len(self.tokens)))
        random.Random(f"{self.args.seed}-get-{pair}").shuffle(order)
        self.get_order = order

    def keys_of(self, kv: Any) -> list[list[bytes]]:
        """The key batches (``kv.keys_for`` of each batch's tokens; every store here has the same model and
        geometry, so the same keys)."""
        if self.keys is None:
            self.keys = [kv.keys_for(t) for t in self.tokens]
            if any(len(k) * self.geom.block_tokens != len(t) for k, t in zip(self.keys, self.tokens, strict=True)):
                raise BenchSetupError("keys_for did not give one key per block of tokens")
        return self.keys

    def value_of(self, block: int) -> Any:
        """The source block that block ``block`` of the working set was put from."""
        return self.values.items[(block - self.firsts[block // self.batch]) % self.batch]

    def check_dests(self, what: str, batch: int, expected: Callable[[int], Any]) -> None:
        """Compare the destinations of batch ``batch`` with ``expected(block index)``."""
        np = self.np
        first = self.firsts[batch]
        count = len(self.tokens[batch]) // self.geom.block_tokens
        for j in range(count):
            if not np.array_equal(self.dests.items[j], expected(first + j)):
                raise BenchSetupError(f"{what}: block {first + j} came back with other bytes")

    def zero_dests(self) -> None:
        """Zero the destinations (so bytes left by an earlier run cannot pass a check)."""
        self.dests.raw[:] = 0

    # sides, made on first use
    def pinned(self) -> _Pinned:
        if self._pinned is None:
            self._pinned = _Pinned(self)
        return self._pinned

    def block_tier(self) -> _BlockTier:
        if self._block is None:
            self._block = _BlockTier(self)
        return self._block

    def reference_status(self, ref: str) -> str | None:
        """Why reference ``ref`` cannot run (probing or starting it on first use), or None."""
        if ref in self.unavailable:
            return self.unavailable[ref]
        why: str | None = None
        if ref == "fio":
            if self.fio is None:
                self.fio = find_fio(self.args.fio)  # fio is the main reference: missing is an error
        elif ref == "nixl" and self._nixl is None:
            why = probe_nixl()
            if why is None:
                try:
                    self._nixl = _Nixl(self)
                except _SideFailed as exc:
                    why = str(exc)
        elif ref == "lmcache" and self._lmcache is None:
            why = probe_lmcache()
            if why is None:
                try:
                    self._lmcache = _LMCache(self)
                except _SideFailed as exc:
                    why = str(exc)
        if why is not None:
            self.unavailable[ref] = why
        return why

    def nixl(self) -> _Nixl:
        assert self._nixl is not None
        return self._nixl

    def lmcache(self) -> _LMCache:
        assert self._lmcache is not None
        return self._lmcache

    def close(self) -> None:
        """Close every side and release the blocks."""
        for side in (self._lmcache, self._nixl, self._block, self._pinned):
            if side is not None:
                try:
                    side.close()
                except Exception as exc:  # closing must not hide the run's result
                    warn(f"closing {type(side).__name__}: {type(exc).__name__}: {exc}")
        self._lmcache = self._nixl = None
        self._block = None
        self._pinned = None
        self.values.close()
        self.dests.close()


def _timed_batches(run_batch: Callable[[int], Any], order: Sequence[int]) -> tuple[list[Any], list[float], float,
                                                                                  float, float]:
    """Run ``run_batch(b)`` for each batch of ``order``; return the results, per-batch latencies, CPU seconds,
    the start and the end (``perf_counter``)."""
    clock = time.perf_counter
    results: list[Any] = []
    lat: list[float] = []
    meter = CpuMeter()
    meter.start()
    t0 = clock()
    for b in order:
        tb = clock()
        results.append(run_batch(b))
        lat.append(clock() - tb)
    t1 = clock()
    return results, lat, meter.stop(), t0, t1


class _Pinned:
    """The pinned tier alone (``KVCacheStore(block_store=None)``), and the memcpy reference's N blocks."""

    def __init__(self, bench: _Bench) -> None:
        self.b = bench
        slot = 4096 + -(-bench.block // 4096) * 4096
        self.kv = bench.kvmod.KVCacheStore(bench.geom, model_id=_MODEL_ID, pinned_bytes=(bench.n + bench.batch) * slot,
                                           block_store=None, shared_dir=None)
        self.keys = bench.keys_of(self.kv)
        self.flat = [k for ks in self.keys for k in ks]
        self.srcs = _Blocks(bench.np, bench.n, bench.block)  # the reference's copy of the N blocks
        for i in range(bench.n):
            bench.np.copyto(self.srcs.items[i], bench.value_of(i))
        self.holds = False

    def put(self) -> RunResult:
        b = self.b
        self.kv.evict(self.flat, tiers=("pinned",))
        before = self.kv.stats()
        vals = b.values.items
        _, lat, cpu, t0, t1 = _timed_batches(lambda i: self.kv.put(self.keys[i], vals[:len(self.keys[i])]),
                                             range(len(self.keys)))
        after = self.kv.stats()
        puts = int(after["puts"]) - int(before["puts"])
        if puts != b.n or after["resident"]["pinned"] != b.n:
            raise BenchSetupError(f"put-pinned: {puts} puts, {after['resident']['pinned']} resident; expected {b.n}")
        self.holds = True
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**_latency(lat), **_store_latency(after, "put")})

    def get(self) -> RunResult:
        b = self.b
        if not self.holds:
            for keys in self.keys:
                self.kv.put(keys, b.values.items[:len(keys)])
            self.holds = True
        b.zero_dests()
        dests = b.dests.items
        tiers, lat, cpu, t0, t1 = _timed_batches(lambda i: self.kv.get_into(self.keys[i], dests[:len(self.keys[i])]),
                                                 b.get_order)
        wrong = sum(1 for ts in tiers for t in ts if t != "pinned")
        if wrong:
            raise BenchSetupError(f"get-pinned: {wrong} blocks did not come from the pinned tier")
        b.check_dests("get-pinned", b.get_order[-1], b.value_of)
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**_latency(lat), **_store_latency(self.kv.stats(), "get")})

    def memcpy(self, op: str) -> RunResult:
        b = self.b
        np = b.np
        srcs, vals, dests = self.srcs.items, b.values.items, b.dests.items
        counts = [len(k) for k in self.keys]

        def put_batch(i: int) -> None:
            first = b.firsts[i]
            for j in range(counts[i]):
                np.copyto(srcs[first + j], vals[j])

        def get_batch(i: int) -> None:
            first = b.firsts[i]
            for j in range(counts[i]):
                np.copyto(dests[j], srcs[first + j])

        if op == "get":
            b.zero_dests()
        _, lat, cpu, t0, t1 = _timed_batches(put_batch if op == "put" else get_batch,
                                             range(len(counts)) if op == "put" else b.get_order)
        if op == "get":
            b.check_dests("get-pinned memcpy", b.get_order[-1], lambda i: srcs[i])
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu, extra=_latency(lat))

    def close(self) -> None:
        self.kv.close()
        self.srcs.close()


def _store_latency(stats: dict[str, Any], op: str) -> dict[str, Any]:
    p50, p99 = stats.get(f"{op}_p50_s"), stats.get(f"{op}_p99_s")
    return {"store_p50_ms": None if p50 is None else 1e3 * p50, "store_p99_ms": None if p99 is None else 1e3 * p99}


class _BlockTier:
    """The NVMe tier: a ``BlockStore`` on the image under ``KVCacheStore(pinned_bytes=0)``."""

    def __init__(self, bench: _Bench) -> None:
        self.b = bench
        blocks = import_for_bench("sfstore.blocks", "build sfstore first (pip install -e .)")
        bp_mod = import_for_bench("sfstore.paths.block", "build sfstore first (pip install -e .)")
        self.engine = self._engine()
        stride_guess = bench.block + 4096
        self.image_size = -(-(bench.n * stride_guess + 16 * MIB) // MIB) * MIB
        self.image = os.path.join(bench.dir, f"kvcache-{bench.label}.img")
        _prepare_file(self.image, self.image_size)
        errors = bench.errors
        try:
            self.bp = bp_mod.BlockPath(self.image, size=self.image_size, engine=self.engine)
        except errors.SfstoreError as exc:
            raise BenchSetupError(f"cannot open {self.image} as a block path: {exc}") from None
        self.bs: Any = None
        self.kv: Any = None
        try:
            if not self.bp.direct:
                raise BenchSetupError(f"{self.image}: O_DIRECT is refused there; the comparison with fio --direct=1 "
                                      "needs it")
            try:
                self.bs = blocks.BlockStore(self.bp, size_classes=(bench.block,), format=True)
            except errors.SfstoreError as exc:
                raise BenchSetupError(f"cannot format a block store on {self.image}: {exc}") from None
            self.layout = self.bs.layout
            self.region = self.layout.classes[0]
            if self.region.count < bench.n:
                raise BenchSetupError(f"the store on {self.image} has {self.region.count} slots for {bench.n} blocks")
            self.kv = bench.kvmod.KVCacheStore(bench.geom, model_id=_MODEL_ID, pinned_bytes=0, block_store=self.bs,
                                               shared_dir=None)
            self.keys = bench.keys_of(self.kv)
            self.flat = [k for ks in self.keys for k in ks]
            # warm up (untimed): the pinned slots and the store's staging buffers exist before any clock
            warm = self.kv.keys_for([0] * (bench.batch * bench.geom.block_tokens), extra=("warm-up",))
            self.kv.put(warm, bench.values.items[:len(warm)])
            self.kv.get_into(warm, bench.dests.items[:len(warm)])
            self.kv.evict(warm)
            self.bs.flush()
        except BaseException:
            self.close()
            raise
        self.holds = False  # whether the store holds the N blocks intact

    def _engine(self) -> Any:
        engine_mod = import_for_bench("sfstore.engine", "build sfstore first (pip install -e .)")
        try:
            engine = engine_mod.get_engine(self.b.args.engine, queue_depth=self.b.qd)
            if engine.name != "uring":  # a thread pool keeps at most `threads` requests in flight
                engine = engine_mod.get_engine(engine.name, queue_depth=self.b.qd, threads=self.b.qd)
        except self.b.errors.EngineUnavailableError as exc:
            raise BenchSetupError(f"engine {self.b.args.engine or 'default'} is unavailable here: {exc}") from None
        return engine

    def _empty(self) -> None:
        """Evict every key from every tier and recycle the slots (untimed)."""
        self.kv.evict(self.flat, tiers=("pinned", "block"))
        self.bs.flush()
        self.holds = False

    def fill(self) -> None:
        """Make the store hold the N blocks (untimed) unless it does."""
        if self.holds:
            return
        self._empty()
        for keys in self.keys:
            self.kv.put(keys, self.b.values.items[:len(keys)])
        self.bs.flush()
        self.holds = True

    def put(self) -> RunResult:
        b = self.b
        self._empty()
        drop_cache(self.image)
        before, bs_before = self.kv.stats(), self.bs.stats()
        vals = b.values.items
        clock = time.perf_counter
        lat: list[float] = []
        meter = CpuMeter()
        meter.start()
        t0 = clock()
        if self.outstanding_one:
            for keys in self.keys:
                tb = clock()
                self.kv.put(keys, vals[:len(keys)])
                lat.append(clock() - tb)
        else:
            pending: deque[tuple[Any, float]] = deque()
            for keys in self.keys:
                if len(pending) >= b.outstanding:
                    fut, tb = pending.popleft()
                    fut.get()
                    lat.append(clock() - tb)
                pending.append((self.kv.put_async(keys, vals[:len(keys)]), clock()))
            while pending:
                fut, tb = pending.popleft()
                fut.get()
                lat.append(clock() - tb)
        tf = clock()
        self.bs.flush()
        t1 = clock()
        cpu = meter.stop()
        after, bs_after = self.kv.stats(), self.bs.stats()
        puts = int(bs_after["puts"]) - int(bs_before["puts"])
        put_bytes = int(bs_after["bytes_put"]) - int(bs_before["bytes_put"])
        if puts != b.n or put_bytes != b.n * b.block or int(after["puts"]) - int(before["puts"]) != b.n:
            raise BenchSetupError(f"put-block: the block store counted {puts} puts of {put_bytes} bytes, expected "
                                  f"{b.n} of {b.n * b.block}")
        if after["resident"]["pinned"]:
            raise BenchSetupError(f"put-block: {after['resident']['pinned']} blocks stayed pinned (budget 0)")
        self.holds = True
        sample = [self.keys[0][0], self.keys[-1][-1]]
        got = self.bs.get_many(sample)
        want = [b.value_of(0), b.value_of(b.n - 1)]
        if any(g is None or g != w.tobytes() for g, w in zip(got, want, strict=True)):
            raise BenchSetupError("put-block: a block does not read back from the block store as put")
        return RunResult(bytes=put_bytes, ops=puts, seconds=t1 - t0, cpu_s=cpu,
                         extra={**_latency(lat), **_store_latency(after, "put"), "flush_s": t1 - tf,
                                "puts_s": tf - t0})

    @property
    def outstanding_one(self) -> bool:
        return self.b.outstanding == 1

    def get(self) -> RunResult:
        b = self.b
        self.fill()
        self.kv.evict(self.flat, tiers=("pinned",))
        b.zero_dests()
        drop_cache(self.image)
        before = self.kv.stats()
        dests = b.dests.items
        # keep_on_miss=False: how an inference engine reads (a miss is recomputed into the same block), straight
        # into the destination and verified there, as fio reads into its buffer; the default stages each block
        # so that a miss leaves the destination as it was, at the cost of one host copy per block.
        tiers, lat, cpu, t0, t1 = _timed_batches(
            lambda i: self.kv.get_into(self.keys[i], dests[:len(self.keys[i])], keep_on_miss=False), b.get_order
        )
        after = self.kv.stats()
        wrong = sum(1 for ts in tiers for t in ts if t != "block")
        if wrong:
            raise BenchSetupError(f"get-block: {wrong} of {b.n} blocks did not come from the block tier (hits: "
                                  f"{int(after['hits_block']) - int(before['hits_block'])} block, corrupt_dropped "
                                  f"{int(after['corrupt_dropped']) - int(before['corrupt_dropped'])})")
        b.check_dests("get-block", b.get_order[-1], b.value_of)
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**_latency(lat), **_store_latency(after, "get")})

    def fio_job(self, case: Case) -> FioJob:
        """fio's job for ``case``: the region of the store's N slots, N blocks."""
        b = self.b
        return FioJob(name=case.name, filename=self.image, size=b.n * self.region.stride, io_size=b.n * b.block,
                      rw="randwrite" if case.writes else "randread", bs=b.block, iodepth=b.qd, seed=b.args.seed,
                      offset=self.region.offset)

    def run_fio(self, fio: str, case: Case) -> RunResult:
        drop_cache(self.image)
        result = _run_fio(fio, self.fio_job(case))
        if case.writes:
            self.holds = False  # fio wrote over the store's slots
        return result

    def close(self) -> None:
        try:
            if self.kv is not None:
                self.kv.close()
            if self.bs is not None:
                self.bs.close()
        finally:
            self.kv = self.bs = None
            self.bp.close()


class _Nixl:
    """NIXL's POSIX backend on the block store's own slots: an agent, the source and destination blocks registered
    as DRAM, the image registered as FILE (fd mode, O_DIRECT), and per batch the value areas of the batch's keys'
    slots (``BlockStore.locate``), so NIXL moves the same bytes at the same places in the same order as the
    store. A NIXL put writes each block's bytes over the same bytes, so the store stays intact."""

    def __init__(self, bench: _Bench) -> None:
        self.b = bench
        self.tier = tier = bench.block_tier()
        self.api = importlib.import_module("nixl._api")
        self.fd = -1
        self.agent: Any = None
        self.regs: list[Any] = []
        self.local: dict[str, Any] = {}
        self.remote: Any = None
        self.offsets: list[int] = []
        try:
            self.agent = self.api.nixl_agent(f"sfstore-bench-{os.getpid()}", self.api.nixl_agent_config(backends=[]))
            try:
                self.agent.create_backend("POSIX", {"use_uring": "true"})
                self.queue = "io_uring (use_uring=true)"
            except Exception as exc:
                warn(f"NIXL POSIX backend refused use_uring ({type(exc).__name__}: {exc}); using its default queue")
                self.agent.create_backend("POSIX")
                self.queue = "its default (use_uring refused)"
            self.params = dict(self.agent.get_backend_params("POSIX"))
            self.fd = os.open(tier.image, os.O_RDWR | os.O_DIRECT)
            blk, batch = bench.block, bench.batch
            for region in (bench.values, bench.dests):
                self.regs.append(self.agent.register_memory([(region.address, batch * blk, 0, "")], "DRAM"))
            self.regs.append(self.agent.register_memory([(0, tier.image_size, self.fd, "")], "FILE"))
            for op, region in (("WRITE", bench.values), ("READ", bench.dests)):
                self.local[op] = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", [(region.address + j * blk, blk, 0) for j in range(batch)], "DRAM")
        except Exception as exc:
            self.close()
            raise _SideFailed(f"NIXL POSIX backend failed to start: {type(exc).__name__}: {exc}") from exc

    def _locate(self) -> None:
        """Make the store hold the N blocks (untimed) and prep the FILE descriptors of their value areas (again
        only when the slots moved)."""
        tier = self.tier
        tier.fill()
        hdr = tier.layout.header_bytes
        offsets = []
        for key in tier.flat:
            where = tier.bs.locate(key)
            if where is None:
                raise BenchSetupError("NIXL side: a block the store was filled with has no slot")
            offsets.append(int(where[0]) + hdr)
        if offsets == self.offsets and self.remote is not None:
            return
        if self.remote is not None:
            self.agent.release_dlist_handle(self.remote)
            self.remote = None
        self.remote = self.agent.prep_xfer_dlist(self.agent.name, [(o, self.b.block, self.fd) for o in offsets],
                                                 "FILE")
        self.offsets = offsets

    def _transfer(self, op: str, batch: int) -> None:
        b, agent = self.b, self.agent
        first, count = b.firsts[batch], len(b.tokens[batch]) // b.geom.block_tokens
        handle = agent.make_prepped_xfer(op, self.local[op], list(range(count)), self.remote,
                                         list(range(first, first + count)))
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise _SideFailed(f"NIXL {op} of {count} blocks ended in state {state}")
        finally:
            agent.release_xfer_handle(handle)

    def put(self) -> RunResult:
        b = self.b
        self._locate()
        drop_cache(self.tier.image)
        _, lat, cpu0, t0, tf = _timed_batches(lambda i: self._transfer("WRITE", i), range(len(b.tokens)))
        meter = CpuMeter()
        meter.start()
        os.fsync(self.fd)
        t1 = time.perf_counter()
        cpu = cpu0 + meter.stop()
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**_latency(lat), "fsync_s": t1 - tf})

    def get(self) -> RunResult:
        b = self.b
        self._locate()
        b.zero_dests()
        drop_cache(self.tier.image)
        _, lat, cpu, t0, t1 = _timed_batches(lambda i: self._transfer("READ", i), b.get_order)
        b.check_dests("get-block NIXL", b.get_order[-1], b.value_of)
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu, extra=_latency(lat))

    def close(self) -> None:
        agent = self.agent
        if agent is not None:
            for h in [*self.local.values(), self.remote]:
                if h is None:
                    continue
                try:
                    agent.release_dlist_handle(h)
                except Exception:
                    pass
            for r in self.regs:
                try:
                    agent.deregister_memory(r)
                except Exception:
                    pass
        self.local, self.remote, self.regs, self.agent = {}, None, [], None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _cpu_connector(base: Any, torch: Any, block_tokens: int) -> Any:
    """A CPU subclass of LMCache's ``GPUConnectorInterface``: chunk ``start // block_tokens`` of a call is
    ``kwargs["blocks"][i]`` (a ``uint8`` tensor of the block's bytes); ``from_gpu`` copies it into LMCache's
    memory object, ``to_gpu`` copies the memory object into it. LMCache's own vLLM connectors need CUDA."""

    class CpuBlockConnector(base):  # type: ignore[misc]
        def __init__(self, kv_shape: tuple[int, int, int, int]) -> None:
            self.kv_shape = kv_shape  # (2, layers, tokens, hidden): LMCache's KV_2LTD
            self.kvcaches = None

        def get_shape(self, num_tokens: int) -> Any:
            two, layers, _, hidden = self.kv_shape
            return torch.Size([two, layers, num_tokens, hidden])

        @staticmethod
        def _flat(memory_obj: Any) -> Any:
            return memory_obj.tensor.view(-1).view(torch.uint8)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            self._flat(memory_obj).copy_(kwargs["blocks"][start // block_tokens])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kwargs["blocks"][start // block_tokens].copy_(self._flat(memory_obj))

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                           **kwargs: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e, **kwargs)

    return CpuBlockConnector


class _LMCache:
    """LMCache's engine with only its local disk backend, through a CPU connector."""

    def __init__(self, bench: _Bench) -> None:
        self.b = bench
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
        self.torch = torch = importlib.import_module("torch")
        lmcache = importlib.import_module("lmcache")
        self.version = str(getattr(lmcache, "__version__", "unknown"))
        if not self.version.startswith("0.5.6"):
            warn(f"LMCache {self.version}: the suite was written against 0.5.6")
        config = importlib.import_module("lmcache.v1.config")
        metadata = importlib.import_module("lmcache.v1.metadata")
        engine_mod = importlib.import_module("lmcache.v1.cache_engine")
        connector_mod = importlib.import_module("lmcache.v1.gpu_connector")
        g = bench.geom
        self.path = os.path.join(bench.dir, "kvcache-lmcache")
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        self.instance = f"sfstore-bench-{os.getpid()}"
        self.builder = engine_mod.LMCacheEngineBuilder
        cpu_gib = 4 * bench.batch * bench.block / GIB  # the engine's CPU memory: 4 batches of chunks
        self.settings = {"chunk_size": g.block_tokens, "local_cpu": False, "max_local_cpu_size": cpu_gib,
                         "local_disk": self.path, "max_local_disk_size": 1024.0, "save_unfull_chunk": False,
                         "extra_config": {"force_store_wait": True, "use_odirect": bool(bench.args.lmcache_odirect)}}
        try:
            cfg = config.LMCacheEngineConfig.from_defaults(**self.settings)
            meta = metadata.LMCacheMetadata(
                model_name=_MODEL_ID, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                kv_dtype=torch.bfloat16, kv_shape=(g.num_layers, g.kv, g.block_tokens, g.num_kv_heads, g.head_dim),
                chunk_size=g.block_tokens)
            conn_cls = _cpu_connector(connector_mod.GPUConnectorInterface, torch, g.block_tokens)
            conn = conn_cls((g.kv, g.num_layers, g.block_tokens, g.num_kv_heads * g.head_dim))
            self.engine = self.builder.get_or_create(self.instance, cfg, meta, conn, lambda t, r: None,
                                                     lambda o, r: o)
            self.engine.post_init()
            self.disk = self.engine.storage_manager.storage_backends["LocalDiskBackend"]
        except Exception as exc:
            self.close()
            raise _SideFailed(f"LMCache's engine failed to start: {type(exc).__name__}: {exc}") from exc
        self.fsyncer = ThreadPoolExecutor(max_workers=_FSYNC_THREADS, thread_name_prefix="bench-fsync")
        self.tokens = [torch.tensor(t, dtype=torch.long) for t in bench.tokens]
        self.srcs = [torch.from_numpy(v.view(bench.np.uint8)) for v in bench.values.items]
        self.dsts = [torch.from_numpy(d.view(bench.np.uint8)) for d in bench.dests.items]
        self.holds = False

    def _files(self) -> list[str]:
        return [os.path.join(self.path, f) for f in os.listdir(self.path) if f.endswith(".pt")]

    def _clear(self) -> None:
        for t in self.tokens:
            self.engine.clear(t)
        for f in self._files():  # anything left behind
            os.unlink(f)
        self.holds = False

    def _store(self, i: int) -> None:
        self.engine.store(self.tokens[i], blocks=self.srcs[:len(self.b.tokens[i]) // self.b.geom.block_tokens])

    def _wait_on_disk(self) -> None:
        deadline = time.monotonic() + 300
        while len(self.disk.dict) < self.b.n or self.disk.disk_worker.put_tasks:
            if time.monotonic() > deadline:
                raise _SideFailed(f"LMCache had {len(self.disk.dict)} of {self.b.n} blocks on disk after 300 s")
            time.sleep(0.0002)

    def put(self) -> RunResult:
        b = self.b
        self._clear()
        _fsync_dir(self.path)
        _, lat, cpu0, t0, tf = _timed_batches(self._store, range(len(self.tokens)))
        meter = CpuMeter()
        meter.start()
        self._wait_on_disk()
        tw = time.perf_counter()
        files = self._files()
        list(self.fsyncer.map(_fsync_file, files))  # in parallel: concurrent fsyncs share journal commits
        _fsync_dir(self.path)
        t1 = time.perf_counter()
        cpu = cpu0 + meter.stop()
        sizes = {os.stat(f).st_size for f in files}
        if len(files) != b.n or sizes != {b.block}:
            raise _SideFailed(f"LMCache wrote {len(files)} files of {sorted(sizes)} bytes, expected {b.n} of {b.block}")
        self.holds = True
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**_latency(lat), "store_calls_s": tf - t0, "wait_disk_s": tw - tf,
                                "fsync_s": t1 - tw})

    def get(self) -> RunResult:
        b = self.b
        if not self.holds:
            self._clear()
            for i in range(len(self.tokens)):
                self._store(i)
            self._wait_on_disk()
            self.holds = True
        b.zero_dests()
        for f in self._files():
            drop_cache(f)
        bt = b.geom.block_tokens

        def retrieve(i: int) -> int:
            mask = self.engine.retrieve(self.tokens[i], blocks=self.dsts[:len(b.tokens[i]) // bt])
            return int(mask.sum())

        got, lat, cpu, t0, t1 = _timed_batches(retrieve, b.get_order)
        want = [len(b.tokens[i]) for i in b.get_order]
        if got != want:
            raise _SideFailed(f"LMCache retrieved {sum(got)} of {sum(want)} tokens")
        b.check_dests("get-block LMCache", b.get_order[-1], b.value_of)
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu, extra=_latency(lat))

    def close(self) -> None:
        try:
            if hasattr(self, "fsyncer"):
                self.fsyncer.shutdown(wait=True)
            self.builder.destroy(self.instance)
        finally:
            shutil.rmtree(self.path, ignore_errors=True)


# -- the suite -------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the kvcache suite.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed common and kvcache options.

    Returns
    -------
    dict
        The suite's JSON document (the common shape plus ``geometry``, ``references`` and ``acceptance``).

    Raises
    ------
    BenchSetupError
        When something it needs is missing (fio, sfstore, numpy, O_DIRECT, space), the directory is in memory, or
        a store lost or changed data.
    """
    cases = select_cases(args.cases, args.quick)
    size = int(args.size if args.size is not None else (_QUICK_SIZE if args.quick else _DEFAULT_SIZE))
    directory = args.dir or default_bench_dir()
    mount = check_bench_dir(directory)
    if args.repeat < 3:
        warn(f"--repeat {args.repeat}: BENCHMARKING.md asks for at least 3 pairs; do not quote these figures")
    if any(c.reference == "fio" for c in cases):
        find_fio(args.fio)
    bench = _Bench(args, size, directory)
    try:
        return _run(args, bench, cases, mount)
    finally:
        bench.close()


def _run(args: argparse.Namespace, bench: _Bench, cases: list[Case], mount: Any) -> dict[str, Any]:
    machine = machine_info(bench.dir)
    g = bench.geom
    print(f"kvcache suite: {bench.n} blocks of {format_size(bench.block)} ({bench.label}; {g.num_layers} layers x "
          f"{g.block_tokens} tokens x {g.num_kv_heads} heads x {g.head_dim} bf16), batches of {bench.batch}, QD "
          f"{bench.qd}, {bench.dir} ({mount.fstype + ' on ' + mount.source if mount else '?'}), {args.warmup} "
          f"warm-up + {args.repeat} pair(s) per case, ABBA", flush=True)
    table = Table("reference", use_iops=lambda case: False, name_width=max(len(c.name) for c in cases))
    print(table.header(), flush=True)
    results: list[dict[str, Any]] = []
    for case in cases:
        result = _run_case(bench, case)
        results.append(result)
        print(table.row(result), flush=True)
    _print_details(results)
    short = [c["name"] for c in results if c["params"]["reference"] == "fio" and c["sfstore"].get("runs")
             and any(r["seconds"] < _SLOW_RUN_S for r in c["sfstore"]["runs"] + c["reference"]["runs"])]
    if short:
        warn(f"runs under {_SLOW_RUN_S}s in {', '.join(short)}: noisy (fio times whole ms); use a bigger --size")
    acceptance = evaluate_goals(results, size=bench.size, batch=bench.batch, qd=bench.qd,
                                outstanding=bench.outstanding)
    for line in acceptance:
        print(line["line"], flush=True)
    refs: dict[str, Any] = {"fio": fio_version(bench.fio) if bench.fio else None}
    if bench._nixl is not None:
        refs["nixl"] = {"backend": "POSIX", "queue": bench._nixl.queue, "params": bench._nixl.params,
                        "file": bench._nixl.tier.image, "version": _dist_version("nixl")}
    if bench._lmcache is not None:
        refs["lmcache"] = {"version": bench._lmcache.version, "settings": bench._lmcache.settings,
                           "torch": str(getattr(bench._lmcache.torch, "__version__", None))}
    refs["unavailable"] = dict(bench.unavailable)
    machine["references"] = refs
    if bench._block is not None:
        machine["block_engine"] = bench._block.engine.name
        # what backs the NVMe tier's pinned slots (the block store moves 2 MiB values straight into and out of
        # them): a diagnostic read from the store's pool, None where its internals differ
        pool = getattr(getattr(bench._block.kv, "pinned", None), "_pool", None)
        try:
            machine["block_tier_pinned_pool"] = dict(pool.stats()) if pool is not None else None
        except Exception:
            machine["block_tier_pinned_pool"] = None
    geometry = {"num_layers": g.num_layers, "block_tokens": g.block_tokens, "num_kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim, "dtype": g.dtype, "block_bytes": bench.block}
    buffers = {"sources": bench.values.describe(), "destinations": bench.dests.describe()}
    if bench._pinned is not None:
        buffers["memcpy_blocks"] = bench._pinned.srcs.describe()
    return {"bench": "kvcache", "machine": machine, "date": utc_now(), "geometry": geometry, "blocks": bench.n,
            "buffers": buffers,
            "cases": results, "acceptance": acceptance}


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _sides(bench: _Bench, case: Case) -> tuple[Callable[[], RunResult], Callable[[], RunResult]]:
    """``(sfstore side, reference side)`` of ``case``, each returning one run."""
    if case.tier == "pinned":
        p = bench.pinned()
        return (p.put if case.writes else p.get), (lambda: p.memcpy(case.op))
    tier = bench.block_tier()
    ours = tier.put if case.writes else tier.get
    if case.reference == "fio":
        fio = bench.fio
        assert fio is not None
        return ours, (lambda: tier.run_fio(fio, case))
    if case.reference == "nixl":
        nx = bench.nixl()
        return ours, (nx.put if case.writes else nx.get)
    lm = bench.lmcache()
    return ours, (lm.put if case.writes else lm.get)


def _not_run(case: Case, why: str) -> dict[str, Any]:
    return {"name": case.name, "params": {"op": case.op, "tier": case.tier, "reference": case.reference},
            "sfstore": {"status": "not run: its reference cannot run here"},
            "reference_tool": REFERENCES[case.reference],
            "reference": {"status": why}, "ratio": None, "ratio_min": None, "ratio_max": None, "ratios": [],
            "ratio_of_medians": None, "same_bytes": None}


def _run_case(bench: _Bench, case: Case) -> dict[str, Any]:
    args = bench.args
    why = bench.reference_status(case.reference)
    if why is not None:
        warn(f"{case.name}: {REFERENCES[case.reference]} cannot run here: {why}")
        return _not_run(case, why)
    run_ours, run_theirs = _sides(bench, case)
    ours: list[RunResult] = []
    theirs: list[RunResult] = []
    ref_status = "ok"
    growth = {"ours": 0, "theirs": 0}  # peak RSS growth of each side: the most over its runs
    rss = PeakRss()
    resident = None
    if case.tier == "block":
        drop_cache(bench.block_tier().image)
        resident = resident_bytes(bench.block_tier().image)
        if resident:
            warn(f"{case.name}: {resident} bytes of the image stay in the page cache after fsync + DONTNEED")

    def ours_once() -> None:
        try:
            rss.start()
            ours.append(run_ours())
            growth["ours"] = max(growth["ours"], rss.growth())
        except bench.errors.SfstoreError as exc:  # name the case instead of a traceback
            raise BenchSetupError(f"{case.name}: the KV-cache store failed: {type(exc).__name__}: {exc}") from exc

    def theirs_once() -> None:
        nonlocal ref_status
        if ref_status != "ok":
            return
        try:
            rss.start()
            theirs.append(run_theirs())
            growth["theirs"] = max(growth["theirs"], rss.growth())
        except BenchSetupError:
            raise
        except Exception as exc:  # a failing reference is a result, not a reason to lose the run
            ref_status = f"failed: {type(exc).__name__}: {exc}"
            warn(f"{case.name}: {REFERENCES[case.reference]} failed: {type(exc).__name__}: {exc}")

    # ABBA order: the host caches the virtual disk, so going second can find the data warm there.
    for i in range(args.warmup + args.repeat):
        if i == args.warmup:  # growth counts from the measured runs on: warm-up runs allocate what later reuse
            growth.update(ours=0, theirs=0)
        bench.reorder(i)
        first, second = (ours_once, theirs_once) if i % 2 == 0 else (theirs_once, ours_once)
        first()
        second()
    warm_ours, ours = ours[:args.warmup], ours[args.warmup:]
    warm_theirs, theirs = theirs[:args.warmup], theirs[args.warmup:]
    b = bench
    params: dict[str, Any] = {
        "op": case.op, "tier": case.tier, "reference": case.reference, "block_size": b.block, "blocks": b.n,
        "io_bytes": b.n * b.block, "batch": b.batch, "queue_depth": b.qd, "outstanding_batches": b.outstanding,
        "model_id": _MODEL_ID, "repeat": args.repeat, "warmup_pairs": args.warmup, "seed": args.seed,
        "peak_rss_method": rss.method, "durable": case.writes and case.tier == "block",
        "fsync_in_timed_region": case.writes and case.tier == "block",
        "get_order": "batches in a seeded random order per pair (seed-get-<pair>), the same for both sides of a pair",
    }
    if case.tier == "block":
        tier = b.block_tier()
        params.update({
            "image": tier.image, "image_size": tier.image_size, "engine": tier.engine.name,
            "region_offset": tier.region.offset, "slot_stride": tier.region.stride,
            "sfstore_io_bytes_per_op": tier.layout.header_bytes + -(-b.block // tier.layout.lba) * tier.layout.lba,
            "cold": "fsync + posix_fadvise(DONTNEED) before every run (O_DIRECT)",
            "resident_after_drop_bytes": resident,
            "sfstore_call": ("KVCacheStore(pinned_bytes=0, block_store=BlockStore).put(keys, blocks) x N/batch"
                             if b.outstanding == 1 else
                             f"KVCacheStore.put_async(keys, blocks), {b.outstanding} in flight")
            + " + BlockStore.flush()" if case.writes
            else "KVCacheStore.get_into(keys, blocks, keep_on_miss=False) x N/batch (pinned evicted first)",
        })
        if case.reference == "fio":
            params["reference_call"] = " ".join(fio_command(b.fio or "fio", tier.fio_job(case)))
        elif case.reference == "nixl":
            nx = b.nixl()
            op = "WRITE" if case.writes else "READ"
            params["reference_call"] = (f"nixl_agent POSIX ({nx.queue}): make_prepped_xfer({op}, {b.batch} DRAM "
                                        f"blocks, the value areas of the batch's {b.batch} slots in {nx.tier.image})"
                                        " + transfer + poll per batch" + (" + fsync" if case.writes else ""))
        else:
            lm = b.lmcache()
            params["reference_call"] = (f"LMCacheEngine.{'store' if case.writes else 'retrieve'}(tokens of a batch) "
                                        f"x N/batch, local disk {lm.path} (use_odirect={b.args.lmcache_odirect})"
                                        + (", then wait for its disk writes + fsync of every file and the directory"
                                           if case.writes else ""))
    else:
        params.update({
            "sfstore_call": "KVCacheStore(block_store=None)." + ("put(keys, blocks)" if case.writes else
                                                                  "get_into(keys, blocks)") + " x N/batch",
            "reference_call": "numpy.copyto(dst, src) per block, between the same buffers and N page-aligned blocks",
        })
    ours_doc = side_summary(ours, growth["ours"])
    ours_doc["warmup_runs"] = [r.as_dict() for r in warm_ours]
    for doc, runs in ((ours_doc, ours),):
        _median_extras(doc, runs)
    if ref_status == "ok" and theirs:
        ref_doc = side_summary(theirs, None if case.reference == "fio" else growth["theirs"])
        _median_extras(ref_doc, theirs)
    else:
        ref_doc = {"status": ref_status, "runs": [r.as_dict() for r in theirs]}
    ref_doc["warmup_runs"] = [r.as_dict() for r in warm_theirs]
    if case.reference == "fio":
        ref_doc["peak_rss_note"] = "not measured: wait4's ru_maxrss of a child includes the parent's resident memory"
    n = min(len(ours), len(theirs)) if ref_status == "ok" else 0
    stats = summarize_pairs(ours[:n], theirs[:n]) if n else {"ratio": None, "ratio_min": None, "ratio_max": None,
                                                            "ratios": [], "ratio_of_medians": None}
    same = all(a.bytes == t.bytes == b.n * b.block for a, t in zip(ours, theirs, strict=False)) if n else None
    if same is False:
        warn(f"{case.name}: the sides moved different byte counts: the ratio is not comparable")
    return {"name": case.name, "params": params, "sfstore": ours_doc, "reference_tool": REFERENCES[case.reference],
            "reference": ref_doc, **stats, "same_bytes": same}


_EXTRAS = ("batch_p50_ms", "batch_p99_ms", "block_p50_ms", "block_p99_ms", "store_p50_ms", "store_p99_ms",
           "clat_p50_ms", "clat_p99_ms", "flush_s", "fsync_s", "wait_disk_s")


def _median_extras(doc: dict[str, Any], runs: Sequence[RunResult]) -> None:
    for key in _EXTRAS:
        values = [float(r.extra[key]) for r in runs if r.extra.get(key) is not None]
        if values:
            doc[key] = statistics.median(values)


def _print_details(results: Sequence[dict[str, Any]]) -> None:
    ran = [c for c in results if c["sfstore"].get("runs")]
    if not ran:
        return
    print("\nper case: MiB/s (medians) and per-block latency p50 / p99 in ms (a batched call delivers its blocks "
          "when it returns: a block's latency is its batch's; fio: completion latency per I/O)", flush=True)
    width = max(len(c["name"]) for c in ran) + 2

    def lat(side: dict[str, Any]) -> str:
        p50, p99 = side.get("block_p50_ms"), side.get("block_p99_ms")
        return "n/a" if p50 is None or p99 is None else f"{p50:.2f} / {p99:.2f}"

    for c in ran:
        ours, ref = c["sfstore"], c["reference"]
        theirs = (f"{ref['bytes_per_s'] / MIB:8.1f} MiB/s, block {lat(ref)}" if "bytes_per_s" in ref
                  else ref.get("status", "n/a"))
        extra = f", flush {1e3 * ours['flush_s']:.1f} ms" if "flush_s" in ours else ""
        print(f"{c['name']:<{width}}sfstore {ours['bytes_per_s'] / MIB:8.1f} MiB/s, block {lat(ours)}{extra}   "
              f"{c['reference_tool']} {theirs}", flush=True)
    print(flush=True)


def evaluate_goals(results: Sequence[dict[str, Any]], size: int = _DEFAULT_SIZE, batch: int = 64, qd: int = 64,
                   outstanding: int = 1) -> list[dict[str, Any]]:
    """The issue's goals read from the cases: ``PASS``, ``MISS``, ``n/a`` (the reference cannot run here, with
    why) or ``not run`` (the case was not selected).

    Parameters
    ----------
    results : sequence of dict
        Case documents of this run.
    size, batch, qd, outstanding : int
        The run's working-set bytes, batch, queue depth and sfstore put batches in flight; a line says at what
        it ran unless that is the issue's shape (1 GiB of blocks, batches of 64 at QD 64, one at a time).

    Returns
    -------
    list of dict
        ``{"goal", "case", "target", "ratio", "ratio_min", "ratio_max", "status", "met", "line"}`` per goal;
        ``status`` is ``met``, ``missed``, ``n/a`` or ``not run``.
    """
    note = ""
    if (size, batch, qd, outstanding) != (_DEFAULT_SIZE, 64, 64, 1):
        note = (f" [at {format_size(size)}, batch {batch}, QD {qd}, {outstanding} put batch(es) in flight; the "
                "issue's shape is 1g, 64, 64, 1]")
    return evaluate_ratio_goals(GOALS, results, note)


register(Suite(name="kvcache", help="KVCacheStore put/get of 2 MiB KV blocks per tier vs fio, NIXL POSIX, LMCache "
                                    "local disk and memcpy", add_arguments=add_arguments, run=run))
