"""The kvcache suite's workload and its sfstore sides: the geometry, the token batches and their keys, the source
and destination blocks every side shares (:class:`HostBlocks`), the pinned tier (:class:`PinnedSide`) and the
NVMe tier (:class:`BlockTier`), and what a third-party reference on the same workload provides (:class:`Peer`;
NIXL and LMCache are in :mod:`.nixl` and :mod:`.lmcache`).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tools.bench.common import (
    BUILD_HINT,
    MIB,
    BenchSetupError,
    drop_cache,
    format_size,
    import_for_bench,
    io_engine,
    random_file,
    warn,
)
from tools.bench.fio import FioJob, find_fio, run_fio
from tools.bench.measure import CpuMeter, RunResult, batch_latency
from tools.bench.pairs import SideFailed

__all__ = ["MODEL_ID", "ENV_HINT", "Peer", "PeerKind", "HostBlocks", "Bench", "PinnedSide", "BlockTier",
           "block_latency", "timed_batches"]

MODEL_ID = "sfstore-bench"
#: How to get the third-party references (NIXL, LMCache): their own environment.
ENV_HINT = "create .venv-kvbench with tools/kvbench-env.sh and run the suite with .venv-kvbench/bin/python"


class Peer(Protocol):
    """A third-party reference side on the NVMe tier's workload: the same blocks, batches and order as the store."""

    def put(self) -> RunResult:
        """One cold, timed, durable put run of every batch."""

    def get(self) -> RunResult:
        """One cold, timed get run of every batch, checked afterwards."""

    def call(self, writes: bool) -> str:
        """What a put (``writes``) or get run calls, for the case's ``params``."""

    def describe(self) -> dict[str, Any]:
        """The reference's version and settings, for the JSON's ``machine.references``."""

    def close(self) -> None:
        """Release everything it holds."""


#: A reference's ``(probe, make)``: ``probe()`` says why it cannot run here (None: it can), ``make(bench)``
#: starts it (raising :class:`~tools.bench.pairs.SideFailed` when it fails to).
PeerKind = tuple[Callable[[], "str | None"], Callable[["Bench"], Peer]]

def block_latency(batch_s: Sequence[float]) -> dict[str, Any]:
    """Per-batch latency of one run (a block's latency is its batch's: it is delivered when the call returns)."""
    out = batch_latency(batch_s)
    return {**out, "block_p50_ms": out["batch_p50_ms"], "block_p99_ms": out["batch_p99_ms"]}


_HUGE = 2 << 20


class HostBlocks:
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


def _run_fio(exe: str, job: FioJob) -> RunResult:
    """Run ``job`` once (:func:`tools.bench.fio.run_fio`); its completion latency percentiles are also the
    per-block latency (``block_p50_ms``/``block_p99_ms``) the table shows."""
    result = run_fio(exe, job)
    extra = result.extra
    extra["block_p50_ms"], extra["block_p99_ms"] = extra["clat_p50_ms"], extra["clat_p99_ms"]
    return result


class Bench:
    """The geometry, the working set (tokens, keys, batches), the shared source and destination blocks, and the
    sides, each made on first use (the references from ``peer_kinds``: name to :data:`PeerKind`)."""

    def __init__(self, args: argparse.Namespace, size: int, directory: str, peer_kinds: dict[str, PeerKind]) -> None:
        self.args = args
        self.dir = directory
        self.np: Any = import_for_bench("numpy", "the kvcache bench needs numpy (pip install -e '.[bench]')")
        self.kvmod: Any = import_for_bench("sfstore.kvcache", BUILD_HINT)
        self.errors: Any = import_for_bench("sfstore.errors", BUILD_HINT)
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
        self.values = HostBlocks(self.np, self.batch, self.block)
        self.dests = HostBlocks(self.np, self.batch, self.block)
        self.values.raw[:] = self.np.frombuffer(rng.randbytes(self.batch * self.block), dtype=self.np.uint8)
        self.keys: list[list[bytes]] | None = None
        self.pinned_side: PinnedSide | None = None
        self.block_side: BlockTier | None = None
        self.peer_kinds = peer_kinds
        self.peers: dict[str, Peer] = {}  # the references started, by name
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

    def pinned(self) -> PinnedSide:
        """The pinned tier's side (made on first use)."""
        if self.pinned_side is None:
            self.pinned_side = PinnedSide(self)
        return self.pinned_side

    def block_tier(self) -> BlockTier:
        """The NVMe tier's side (made on first use)."""
        if self.block_side is None:
            self.block_side = BlockTier(self)
        return self.block_side

    def reference_status(self, ref: str) -> str | None:
        """Why reference ``ref`` cannot run (probing or starting it on first use), or None."""
        if ref in self.unavailable:
            return self.unavailable[ref]
        why: str | None = None
        if ref == "fio":
            if self.fio is None:
                self.fio = find_fio(self.args.fio)  # fio is the main reference: missing is an error
        elif ref in self.peer_kinds and ref not in self.peers:
            probe, make = self.peer_kinds[ref]
            why = probe()
            if why is None:
                try:
                    self.peers[ref] = make(self)
                except SideFailed as exc:
                    why = str(exc)
        if why is not None:
            self.unavailable[ref] = why
        return why

    def close(self) -> None:
        """Close every side (the references first: they work on the NVMe tier's image) and release the blocks."""
        sides: list[Peer | BlockTier | PinnedSide | None] = [*reversed(self.peers.values()), self.block_side,
                                                             self.pinned_side]
        for side in sides:
            if side is not None:
                try:
                    side.close()
                except Exception as exc:  # closing must not hide the run's result
                    warn(f"closing {type(side).__name__}: {type(exc).__name__}: {exc}")
        self.peers = {}
        self.block_side = None
        self.pinned_side = None
        self.values.close()
        self.dests.close()


def timed_batches(run_batch: Callable[[int], Any], order: Sequence[int]) -> tuple[list[Any], list[float], float,
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


class PinnedSide:
    """The pinned tier alone (``KVCacheStore(block_store=None)``), and the memcpy reference's N blocks."""

    def __init__(self, bench: Bench) -> None:
        self.b = bench
        slot = 4096 + -(-bench.block // 4096) * 4096
        self.kv = bench.kvmod.KVCacheStore(bench.geom, model_id=MODEL_ID, pinned_bytes=(bench.n + bench.batch) * slot,
                                           block_store=None, shared_dir=None)
        self.keys = bench.keys_of(self.kv)
        self.flat = [k for ks in self.keys for k in ks]
        self.srcs = HostBlocks(bench.np, bench.n, bench.block)  # the reference's copy of the N blocks
        for i in range(bench.n):
            bench.np.copyto(self.srcs.items[i], bench.value_of(i))
        self.holds = False

    def put(self) -> RunResult:
        b = self.b
        self.kv.evict(self.flat, tiers=("pinned",))
        before = self.kv.stats()
        vals = b.values.items
        _, lat, cpu, t0, t1 = timed_batches(lambda i: self.kv.put(self.keys[i], vals[:len(self.keys[i])]),
                                             range(len(self.keys)))
        after = self.kv.stats()
        puts = int(after["puts"]) - int(before["puts"])
        if puts != b.n or after["resident"]["pinned"] != b.n:
            raise BenchSetupError(f"put-pinned: {puts} puts, {after['resident']['pinned']} resident; expected {b.n}")
        self.holds = True
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**block_latency(lat), **_store_latency(after, "put")})

    def get(self) -> RunResult:
        b = self.b
        if not self.holds:
            for keys in self.keys:
                self.kv.put(keys, b.values.items[:len(keys)])
            self.holds = True
        b.zero_dests()
        dests = b.dests.items
        tiers, lat, cpu, t0, t1 = timed_batches(lambda i: self.kv.get_into(self.keys[i], dests[:len(self.keys[i])]),
                                                 b.get_order)
        wrong = sum(1 for ts in tiers for t in ts if t != "pinned")
        if wrong:
            raise BenchSetupError(f"get-pinned: {wrong} blocks did not come from the pinned tier")
        b.check_dests("get-pinned", b.get_order[-1], b.value_of)
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**block_latency(lat), **_store_latency(self.kv.stats(), "get")})

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
        _, lat, cpu, t0, t1 = timed_batches(put_batch if op == "put" else get_batch,
                                             range(len(counts)) if op == "put" else b.get_order)
        if op == "get":
            b.check_dests("get-pinned memcpy", b.get_order[-1], lambda i: srcs[i])
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu, extra=block_latency(lat))

    def close(self) -> None:
        self.kv.close()
        self.srcs.close()


def _store_latency(stats: dict[str, Any], op: str) -> dict[str, Any]:
    p50, p99 = stats.get(f"{op}_p50_s"), stats.get(f"{op}_p99_s")
    return {"store_p50_ms": None if p50 is None else 1e3 * p50, "store_p99_ms": None if p99 is None else 1e3 * p99}


class BlockTier:
    """The NVMe tier: a ``BlockStore`` on the image under ``KVCacheStore(pinned_bytes=0)``."""

    def __init__(self, bench: Bench) -> None:
        self.b = bench
        blocks = import_for_bench("sfstore.blocks", BUILD_HINT)
        bp_mod = import_for_bench("sfstore.paths.block", BUILD_HINT)
        self.engine = io_engine(bench.args.engine, bench.qd)
        stride_guess = bench.block + 4096
        self.image_size = -(-(bench.n * stride_guess + 16 * MIB) // MIB) * MIB
        self.image = os.path.join(bench.dir, f"kvcache-{bench.label}.img")
        random_file(self.image, self.image_size, "kvcache")
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
            self.kv = bench.kvmod.KVCacheStore(bench.geom, model_id=MODEL_ID, pinned_bytes=0, block_store=self.bs,
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
                         extra={**block_latency(lat), **_store_latency(after, "put"), "flush_s": t1 - tf,
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
        tiers, lat, cpu, t0, t1 = timed_batches(
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
                         extra={**block_latency(lat), **_store_latency(after, "get")})

    def fio_job(self, name: str, writes: bool) -> FioJob:
        """fio's job ``name`` (the case's), writing or reading: the region of the store's N slots, N blocks."""
        b = self.b
        return FioJob(name=name, filename=self.image, size=b.n * self.region.stride, io_size=b.n * b.block,
                      rw="randwrite" if writes else "randread", bs=b.block, iodepth=b.qd, seed=b.args.seed,
                      offset=self.region.offset)

    def run_fio(self, fio: str, name: str, writes: bool) -> RunResult:
        """One cold run of fio's job (:meth:`fio_job`)."""
        drop_cache(self.image)
        result = _run_fio(fio, self.fio_job(name, writes))
        if writes:
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
