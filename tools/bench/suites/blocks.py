"""Suite ``blocks``: sfstore's ``BlockStore`` (put/get of fixed-size values) against fio's random writes and reads
at the same block size and queue depth, on the same image file (or block device) and the same disk area, in one run.

``python -m tools.bench blocks [--size 1g | --device /dev/X] [--repeat N] [--quick] [--json PATH]``

One image file, ``<dir>/blocks-<size>.img`` (default ``<sfstore data_dir>/bench/blocks-1g.img``; 512 MiB with
``--quick``; preallocated once and reused), or with ``--device`` a block device, which the suite **formats and
overwrites** (a mounted or otherwise claimed device is refused). The store is always formatted with
``size_classes=(4096, 262144)`` (each class gets half of the data area); a case uses the class of its block size.
A case's working set is ``N`` random 16-byte keys: ``--fill`` (default 0.75) of the class's slots, or ``--keys``.
On a device the slot count is taken as if the device were ``--size`` bytes, so a large device does not make
the cases long.

Cases (``<bs>`` = 256k or 4k), each ``--warmup`` (default 1, discarded) + ``--repeat`` pairs in ABBA order
(sfstore, fio, fio, sfstore, ...: the host caches the virtual disk, so going second can find data warm there;
and every run, of either side, reads or writes in a random order of its own, seeded by ``--seed`` and the run's
index, so that no run repeats the order of the run before it, which a host cache that keeps part of the region
rewards: with one order per side, fio, which follows its own run more often in ABBA, reads far faster),
each side on a cold cache (fsync + ``POSIX_FADV_DONTNEED`` of the image first; both sides use O_DIRECT anyway):

* ``put-<bs>``: **sfstore** formats a fresh store (untimed: ``BlockStore(path, size_classes=(4096, 262144),
  format=True)``, then one batch of warm-up keys put, deleted and flushed so the store's registered staging
  buffers exist before the clock), then, timed: ``put_many`` of the N keys in batches of ``--batch`` (default 64;
  the values are ``--batch`` distinct random buffers of the block size, reused batch after batch) and one
  ``flush()`` (``fdatasync``: durable, like fio's ``--end_fsync=1``). Afterwards, untimed, the store's counters
  must show N puts and a sample of keys is read back and compared. **fio**: ``--rw=randwrite --bs=<bs>
  --iodepth=<qd> --direct=1 --ioengine=io_uring --end_fsync=1 --io_size=N*bs`` over the region the store's
  slots occupy (``--offset`` = the class's offset, ``--size`` = N slot strides): N distinct random blocks of it.
* ``get-<bs>``: the store holds the N keys (put again, untimed, when a fio write ran over them since). **sfstore**,
  timed: ``get_into`` of all N keys in a seeded random order of the run's own, in batches of ``--batch``, into
  ``--batch`` preallocated destinations of the block size reused batch after batch (``--buffers``:
  ``RegisteredBufferPool`` buffers by default, or ``numpy.empty`` arrays). Afterwards, untimed, every key must
  have been a hit and the last batch's destinations must hold the values put. **fio**: ``--rw=randread``, the same
  block size, queue depth, byte count and region.

Queue depth (``--qd``, default = ``--batch``): fio's ``--iodepth``, and the queue depth of the I/O engine the
store's block path is given (``get_engine(--engine, queue_depth=QD)``; thread engines also get QD threads). fio keeps
QD requests in flight from start to end. A store call returns once its whole batch is done, so one synchronous
caller lets the queue drain at the end of every batch (about half as deep on average). The store side therefore
keeps ``--outstanding`` batches in flight (default 2, through ``put_many_async`` / ``get_into_async``, which the
store runs on a pool of 2 threads, with one set of destinations per batch in flight): the engine then holds QD
requests in flight like fio, never more. ``get-4k-sync`` shows the same 4 KiB gets one synchronous ``get_into`` at
a time (``--outstanding 1`` does that for every case); its ratio is reported, not a goal.

What differs between the sides, by design (so the ratios are sfstore's real cost): a put writes the value (straight
from the caller's buffer where it is at least 64 KiB and a multiple of the LBA, else through a registered staging
buffer with the header in front) and then its slot header (``max(LBA, 512)`` bytes: key, length, generation,
xxh3-64 of the value), computing the value's xxh3-64 on the way; a get reads the value straight into the
destination and the engine checks its xxh3-64 against the index where the read completes (a mismatch is a miss,
never data). fio moves the bytes and checks nothing. A fresh store hands out slots in order, so the N puts land
in consecutive slots (fio's writes are random over the same region). Throughput and IOPS count value bytes
(N x bs on both sides); the table shows GiB/s for 256k and IOPS for 4k.

Measured per run: bytes, operations, wall time, CPU of the whole process (``getrusage``: every engine thread;
fio: its job's usr + sys CPU), sfstore's per-batch latency (p50/p99 of the ``put_many``/``get_into`` calls) and
the ``flush()`` time of puts. Goals (the issue's acceptance), printed as ``PASS``/``MISS`` lines and kept in the
JSON (``acceptance``): 256k get >= 0.85x fio, 256k put >= 0.85x fio, 4k get IOPS >= 0.7x fio (median of the
pairwise ratios).

Where the store's time goes on small batches: its own Python per key (keys, views, index and LRU, requests)
runs before the first I/O and after the last, and the queue drains meanwhile; 2 batches in flight hide it
(compare ``get-4k`` with ``get-4k-sync``). The docs' performance page (docs/performance.md) has the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import stat
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tools.bench import pairs
from tools.bench.common import (
    BUILD_HINT,
    GIB,
    MIB,
    BenchSetupError,
    RatioGoal,
    Table,
    bench_dir,
    check_space,
    drop_and_check,
    drop_cache,
    evaluate_ratio_goals,
    format_size,
    import_for_bench,
    io_engine,
    machine_info,
    utc_now,
    warn,
)
from tools.bench.fio import PEAK_RSS_NOTE, FioJob, find_fio, fio_command, fio_version, run_fio
from tools.bench.measure import (
    CpuMeter,
    PeakRss,
    RunResult,
    batch_latency,
    median_extras,
    side_summary,
    summarize_pairs,
)
from tools.bench.options import add_fio, add_warmup, parse_size, positive_int
from tools.bench.pairs import run_pairs, warn_if_few_pairs, warn_short_runs
from tools.bench.pairs import select_cases as select_from
from tools.bench.registry import Suite, register

__all__ = ["BLOCK_SIZES", "SIZE_CLASSES", "GOALS", "QUICK_CASES", "Case", "Goal", "all_cases", "select_cases",
           "working_set", "evaluate_goals", "run"]

#: The classes every run formats the store with (the issue's two value sizes).
SIZE_CLASSES = (4096, 262144)
BLOCK_SIZES = (262144, 4096)
OPS = ("put", "get")
KEY_BYTES = 16
#: Keys read back and compared after every put run.
_PUT_SAMPLES = 8
_DEFAULT_SIZE = 1 << 30
_QUICK_SIZE = 512 << 20


@dataclass(frozen=True)
class Case(pairs.Case):
    """One pair of sides: ``op`` (``put`` or ``get``) of ``block_size``-byte values; ``sync``: the store side
    makes one synchronous call at a time whatever ``--outstanding`` says."""

    op: str
    block_size: int
    sync: bool = False

    @property
    def name(self) -> str:
        """``<op>-<block size>[-sync]``, e.g. ``get-256k``, ``get-4k-sync``."""
        return f"{self.op}-{format_size(self.block_size)}" + ("-sync" if self.sync else "")

    @property
    def fio_rw(self) -> str:
        """fio's ``--rw`` for this case."""
        return "randwrite" if self.writes else "randread"


Goal = RatioGoal


GOALS = (
    Goal("256k get >= 0.85x fio", "get-256k", 0.85),
    Goal("256k put >= 0.85x fio", "put-256k", 0.85),
    Goal("4k get IOPS >= 0.7x fio", "get-4k", 0.7),
)
#: ``--quick``: the cases the goals quote, and the one-batch-at-a-time 4k get beside its goal case.
QUICK_CASES = (*(g.case for g in GOALS), "get-4k-sync")
#: Batches a store side keeps in flight by default: as deep a queue as fio's (see the module docs).
DEFAULT_OUTSTANDING = 2


def all_cases() -> list[Case]:
    """Every case in run order: per block size (256k, then 4k), put before get, then 4k get one synchronous
    batch at a time.

    Returns
    -------
    list of Case
        Five cases.
    """
    return [*(Case(op, bs) for bs in BLOCK_SIZES for op in OPS), Case("get", 4096, sync=True)]


def select_cases(patterns: Sequence[str] | None = None, quick: bool = False) -> list[Case]:
    """The cases to run, in :func:`all_cases` order: :func:`~tools.bench.pairs.select_cases` with ``patterns``
    (shell globs) and, with ``quick``, only :data:`QUICK_CASES`; raises ``BenchSetupError`` when none is left."""
    return select_from("blocks", all_cases(), patterns, QUICK_CASES, quick)


def working_set(slot_count: int, stride: int, size: int, fill: float, keys: int | None) -> int:
    """Keys per case.

    Parameters
    ----------
    slot_count : int
        Slots of the class on the formatted store.
    stride : int
        Bytes per slot.
    size : int
        ``--size``: the image size (on a device, the size the slot count is computed as if for).
    fill : float
        Fraction of the slots to use.
    keys : int or None
        ``--keys``: an explicit count (at most the slot count).

    Returns
    -------
    int
        ``keys``, else ``fill`` x the slots of the class on a ``size``-byte store (at least 1).

    Raises
    ------
    BenchSetupError
        When ``keys`` exceeds the class's slots.
    """
    if keys is not None:
        if keys > slot_count:
            raise BenchSetupError(f"--keys {keys}: the class has {slot_count} slots; use a bigger --size")
        return keys
    slots = min(slot_count, (size // len(SIZE_CLASSES)) // stride)
    return max(1, int(fill * slots))


# -- arguments -------------------------------------------------------------------------------------------------


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the blocks suite's options to ``parser`` (the common ones are there already)."""
    parser.epilog = ("cases: " + ", ".join(c.name for c in all_cases()) + ". --quick runs " + ", ".join(QUICK_CASES)
                     + " (the goals) on a 512m image. --dir defaults to <data_dir>/bench.")
    g = parser.add_argument_group("blocks suite")
    g.add_argument("--size", type=parse_size, default=None, metavar="SIZE",
                   help="size of the image file (default 1g, 512m with --quick); with --device, the size the "
                        "working set is computed for")
    g.add_argument("--device", metavar="DEV",
                   help="run on this block device instead of an image file (ITS DATA IS OVERWRITTEN; a mounted "
                        "device is refused)")
    g.add_argument("--fill", type=_fraction, default=0.75, metavar="F",
                   help="fraction of a class's slots the working set fills (default 0.75)")
    g.add_argument("--keys", type=positive_int, default=None, metavar="N", help="keys per case (overrides --fill)")
    g.add_argument("--batch", type=positive_int, default=64, metavar="N",
                   help="keys per put_many / get_into call (default 64)")
    g.add_argument("--qd", type=positive_int, default=None, metavar="N",
                   help="queue depth of fio and of the store's I/O engine (default: --batch)")
    g.add_argument("--outstanding", type=positive_int, default=DEFAULT_OUTSTANDING, metavar="N",
                   help=f"batches in flight (default {DEFAULT_OUTSTANDING}: put_many_async / get_into_async with N "
                        "batches in flight, the store runs them on 2 threads, so the engine's queue stays as full as "
                        "fio's; 1: put_many / get_into, one batch at a time). -sync cases always use 1")
    g.add_argument("--buffers", choices=("registered", "numpy"), default="registered",
                   help="put sources and get destinations: RegisteredBufferPool buffers (default) or numpy arrays")
    add_warmup(g)
    add_fio(g)


# -- helpers ---------------------------------------------------------------------------------------------------


class _Buffers:
    """``count`` buffers of ``size`` bytes: registered (one pool) or numpy arrays."""

    def __init__(self, kind: str, size: int, count: int, np: Any) -> None:
        self.kind = kind
        self._pool: Any = None
        self.items: list[Any] = []
        if kind == "registered":
            buffers = import_for_bench("sfstore.buffers", BUILD_HINT)
            try:
                self._pool = buffers.RegisteredBufferPool(buffer_size=size, max_buffers=count)
                self.items = [self._pool.acquire() for _ in range(count)]
            except Exception as exc:
                self.close()
                raise BenchSetupError(f"RegisteredBufferPool cannot give {count} buffers of {size} bytes: "
                                      f"{exc} (try --buffers numpy)") from exc
        else:
            self.items = [np.empty(size, dtype=np.uint8) for _ in range(count)]

    def fill(self, rng: random.Random) -> None:
        """Fill every buffer with its own random bytes."""
        for buf in self.items:
            with memoryview(buf) as mv, mv.cast("B") as raw:
                raw[:] = rng.randbytes(raw.nbytes)

    def zero(self) -> None:
        """Zero every buffer (so bytes left by an earlier run cannot pass a check)."""
        for buf in self.items:
            with memoryview(buf) as mv, mv.cast("B") as raw:
                raw[:] = bytes(raw.nbytes)

    def close(self) -> None:
        """Release the buffers (and the pool)."""
        if self._pool is not None:
            for buf in self.items:
                buf.release()
            self._pool.close()
            self._pool = None
        self.items = []


def _same(buf: Any, want: Any) -> bool:
    with memoryview(buf) as a, a.cast("B") as x, memoryview(want) as b, b.cast("B") as y:
        return bool(x == y)


# -- the bench -------------------------------------------------------------------------------------------------


class _Bench:
    """The block path, the current store and the per-block-size working sets; runs each side once."""

    def __init__(self, args: argparse.Namespace, target: str, image_size: int | None, size: int, np: Any) -> None:
        self.args = args
        self.target = target
        self.size = size
        self.np = np
        self.batch = int(args.batch)
        self.outstanding = int(args.outstanding)
        self.qd = int(args.qd or args.batch)
        bp_mod = import_for_bench("sfstore.paths.block", BUILD_HINT)
        self.blocks = import_for_bench("sfstore.blocks", BUILD_HINT)
        self.errors = import_for_bench("sfstore.errors", BUILD_HINT)
        self.engine = io_engine(args.engine, self.qd)
        try:
            self.bp = bp_mod.BlockPath(target, size=image_size, engine=self.engine)
        except self.errors.SfstoreError as exc:
            raise BenchSetupError(f"cannot open {target} as a block path: {exc}") from None
        if not self.bp.direct:
            self.bp.close()
            raise BenchSetupError(f"{target}: O_DIRECT is refused there; the comparison with fio --direct=1 needs it")
        self.store: Any = None
        self.holds: int | None = None  # block size whose N keys the current store holds intact
        self.sets: dict[int, _WorkingSet] = {}
        try:
            self.store = self._format()
            self.layout = self.store.layout
        except BaseException:
            self.close()
            raise

    def _format(self) -> Any:
        if self.store is not None:
            self.store.close()
            self.store = None
        self.holds = None
        try:
            return self.blocks.BlockStore(self.bp, size_classes=SIZE_CLASSES, format=True)
        except self.errors.SfstoreError as exc:
            raise BenchSetupError(f"cannot format a block store on {self.target}: {exc}") from None

    def working_set(self, bs: int) -> _WorkingSet:
        """The keys, values and batches of ``bs``-byte values (made once)."""
        ws = self.sets.get(bs)
        if ws is None:
            cls = SIZE_CLASSES.index(bs)
            region = self.layout.classes[cls]
            n = working_set(region.count, region.stride, self.size, self.args.fill, self.args.keys)
            ws = _WorkingSet(bs, cls, region.offset, region.stride, n, self.batch, self.outstanding, self.args,
                            self.np)
            self.sets[bs] = ws
        return ws

    def fresh_store(self, ws: _WorkingSet) -> Any:
        """A freshly formatted store whose staging buffers for ``ws``'s class exist (untimed)."""
        store = self._format()
        self.store = store
        warm = [(b"warm-%d" % i, v) for i, v in enumerate(ws.values.items[:self.batch])]
        store.put_many(warm)
        # delete in reverse order, so after the flush the freed slots are handed out again from slot 0 up
        for key, _ in reversed(warm):
            store.delete(key)
        store.flush()
        return store

    def fill(self, ws: _WorkingSet) -> None:
        """Make the store hold ``ws``'s keys (untimed) unless it already does."""
        if self.holds == ws.bs:
            return
        store = self.fresh_store(ws)
        for items in ws.put_batches:
            store.put_many(items)
        store.flush()
        self.holds = ws.bs

    def fio_job(self, case: Case, ws: _WorkingSet, run: int = 0) -> FioJob:
        """fio's job for ``case``: the region of the store's N slots, N blocks of ``bs``, in a random order of
        run ``run``'s own (``--randseed`` = ``--seed`` + run)."""
        return FioJob(name=case.name, filename=self.target, size=ws.n * ws.stride, io_size=ws.n * ws.bs,
                      rw=case.fio_rw, bs=ws.bs, iodepth=self.qd, seed=self.args.seed + run, offset=ws.offset)

    def drop(self) -> None:
        """Fsync and drop the image's (or device's) page cache."""
        drop_cache(self.target)

    def run_put(self, ws: _WorkingSet, outstanding: int) -> RunResult:
        """One timed put run on a fresh store (puts + ``flush``), checked afterwards."""
        store = self.fresh_store(ws)
        self.drop()
        before = store.stats()
        lat: list[float] = []
        clock = time.perf_counter
        meter = CpuMeter()
        meter.start()
        t0 = clock()
        if outstanding == 1:
            for items in ws.put_batches:
                tb = clock()
                store.put_many(items)
                lat.append(clock() - tb)
        else:
            pending: deque[tuple[Any, float]] = deque()
            for items in ws.put_batches:
                if len(pending) >= outstanding:
                    fut, tb = pending.popleft()
                    fut.get()
                    lat.append(clock() - tb)
                pending.append((store.put_many_async(items), clock()))
            while pending:
                fut, tb = pending.popleft()
                fut.get()
                lat.append(clock() - tb)
        tf = clock()
        store.flush()
        t1 = clock()
        cpu = meter.stop()
        after = store.stats()
        puts = int(after["puts"]) - int(before["puts"])
        put_bytes = int(after["bytes_put"]) - int(before["bytes_put"])
        if puts != ws.n or put_bytes != ws.n * ws.bs:
            raise BenchSetupError(f"put-{format_size(ws.bs)}: the store counted {puts} puts of {put_bytes} bytes, "
                                  f"expected {ws.n} of {ws.n * ws.bs}")
        self.holds = ws.bs
        ws.check_sample(store)
        extra = {**batch_latency(lat), "flush_s": t1 - tf, "puts_s": tf - t0}
        return RunResult(bytes=put_bytes, ops=puts, seconds=t1 - t0, cpu_s=cpu, extra=extra)

    def run_get(self, ws: _WorkingSet, outstanding: int) -> RunResult:
        """One timed get run of every key in random order, checked afterwards."""
        self.fill(ws)
        store = self.store
        ws.dests.zero()
        self.drop()
        before = store.stats()
        views = ws.dest_sets  # one list of destinations per batch in flight
        lat: list[float] = []
        results: list[list[int | None]] = []
        clock = time.perf_counter
        meter = CpuMeter()
        meter.start()
        t0 = clock()
        if outstanding == 1:
            bufs = views[0]
            for keys in ws.get_batches:
                tb = clock()
                results.append(store.get_into(keys, bufs[:len(keys)]))
                lat.append(clock() - tb)
        else:
            pending: deque[tuple[Any, float]] = deque()
            for i, keys in enumerate(ws.get_batches):
                if len(pending) >= outstanding:
                    fut, tb = pending.popleft()
                    results.append(fut.get())
                    lat.append(clock() - tb)
                pending.append((store.get_into_async(keys, views[i % outstanding][:len(keys)]), clock()))
            while pending:
                fut, tb = pending.popleft()
                results.append(fut.get())
                lat.append(clock() - tb)
        t1 = clock()
        cpu = meter.stop()
        after = store.stats()
        got = [n for batch in results for n in batch]
        misses = sum(1 for n in got if n is None)
        moved = sum(n for n in got if n is not None)
        hits = int(after["hits"]) - int(before["hits"])
        if misses or hits != ws.n or moved != ws.n * ws.bs:
            raise BenchSetupError(f"get-{format_size(ws.bs)}: {misses} misses, {hits} hits, {moved} bytes; "
                                  f"expected {ws.n} hits of {ws.n * ws.bs} bytes (corrupt_dropped: "
                                  f"{int(after['corrupt_dropped']) - int(before['corrupt_dropped'])})")
        last = len(ws.get_batches) - 1
        for key, buf in zip(ws.get_batches[last], views[last % outstanding], strict=False):
            if not _same(buf, ws.value_of(key)):
                raise BenchSetupError(f"get-{format_size(ws.bs)}: key {key.hex()} came back with other bytes")
        return RunResult(bytes=moved, ops=ws.n, seconds=t1 - t0, cpu_s=cpu, extra=batch_latency(lat))

    def close(self) -> None:
        """Close the store, the working sets' buffers and the block path."""
        try:
            if self.store is not None:
                self.store.close()
        finally:
            self.store = None
            for ws in self.sets.values():
                ws.close()
            self.sets = {}
            self.bp.close()


class _WorkingSet:
    """N random keys of one block size, their values (``batch`` distinct buffers, reused), the put batches, the
    get batches (a seeded random order) and the get destinations."""

    def __init__(self, bs: int, cls: int, offset: int, stride: int, n: int, batch: int, outstanding: int,
                 args: argparse.Namespace, np: Any) -> None:
        self.bs, self.cls, self.offset, self.stride, self.n = bs, cls, offset, stride, n
        rng = random.Random(f"{args.seed}-{bs}")
        keys: list[bytes] = []
        seen: set[bytes] = set()
        while len(keys) < n:
            k = rng.randbytes(KEY_BYTES)
            if k not in seen:
                seen.add(k)
                keys.append(k)
        self.keys = keys
        self.values = _Buffers(args.buffers, bs, batch, np)
        self.dests: Any = None
        self.dest_sets: list[list[Any]] = []
        try:
            self.values.fill(rng)
            vals = self.values.items
            self.put_batches = [[(k, vals[j]) for j, k in enumerate(keys[i:i + batch])] for i in range(0, n, batch)]
            self._slot = {k: i % batch for i, k in enumerate(keys)}
            self._seed, self._batch = f"{args.seed}-{bs}", batch
            self.get_batches: list[list[bytes]] = []
            self.order_gets(0)
            self.samples = rng.sample(keys, min(_PUT_SAMPLES, n))
            per = min(batch, n)
            self.dests = _Buffers(args.buffers, bs, per * outstanding, np)
            self.dest_sets = [self.dests.items[i * per:(i + 1) * per] for i in range(outstanding)]
        except BaseException:
            self.close()
            raise

    def order_gets(self, run: int) -> None:
        """A random get order of its own for run ``run`` (seeded): no run repeats the order of the one before it,
        whose reads the host's cache of the virtual disk may still hold in that order."""
        order = self.keys[:]
        random.Random(f"{self._seed}-get-{run}").shuffle(order)
        self.get_batches = [order[i:i + self._batch] for i in range(0, self.n, self._batch)]

    def value_of(self, key: bytes) -> Any:
        """The buffer put as ``key``'s value."""
        return self.values.items[self._slot[key]]

    def check_sample(self, store: Any) -> None:
        """Read back a sample of keys (untimed) and compare them with the values put."""
        got = store.get_many(self.samples)
        for key, value in zip(self.samples, got, strict=True):
            if value is None or not _same(value, self.value_of(key)):
                raise BenchSetupError(f"put-{format_size(self.bs)}: key {key.hex()} does not read back as put")

    def close(self) -> None:
        """Release the buffers."""
        self.values.close()
        if self.dests is not None:
            self.dests.close()


# -- the suite -------------------------------------------------------------------------------------------------


def _target(args: argparse.Namespace, size: int) -> tuple[str, int | None, str, Any]:
    """``(path, image size or None, directory for machine facts, mount)``; creates nothing but the directory."""
    if args.device:
        dev = args.device
        try:
            mode = os.stat(dev).st_mode
        except OSError as exc:
            raise BenchSetupError(f"--device {dev}: {exc.strerror}") from None
        if not stat.S_ISBLK(mode):
            raise BenchSetupError(f"--device {dev}: not a block device (give an image directory with --dir instead)")
        return dev, None, "", None
    directory, mount = bench_dir(args.dir)
    path = os.path.join(directory, f"blocks-{format_size(size)}.img")
    if not os.path.exists(path):
        check_space(directory, size + 64 * MIB, f"the blocks bench needs a {size / GIB:.2f} GiB image")
        print(f"preparing {path}: a preallocated {format_size(size)} image (once; later runs reuse it)", flush=True)
    return path, size, directory, mount


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the blocks suite with ``args`` (the common and blocks options) and return its JSON document: the common
    shape plus ``store`` and ``acceptance``.

    Raises :class:`~tools.bench.common.BenchSetupError` when something it needs is missing (fio, sfstore, numpy
    for ``--buffers numpy``, O_DIRECT, space), the directory is in memory, or the store lost or changed data.
    """
    cases = select_cases(args.cases, args.quick)
    size = int(args.size if args.size is not None else (_QUICK_SIZE if args.quick else _DEFAULT_SIZE))
    if size < 16 * MIB or size % 4096:
        raise BenchSetupError(f"--size {size}: must be a multiple of 4k and at least 16m (two size classes of "
                              "256k slots after 1 MiB of metadata)")
    fio = find_fio(args.fio)
    np = (import_for_bench("numpy", "--buffers numpy needs numpy (pip install -e '.[bench]')")
          if args.buffers == "numpy" else None)
    target, image_size, directory, mount = _target(args, size)
    warn_if_few_pairs(args.repeat)
    bench = _Bench(args, target, image_size, size, np)
    try:
        return _run(args, bench, cases, fio, directory, mount)
    finally:
        bench.close()


def _run(args: argparse.Namespace, bench: _Bench, cases: list[Case], fio: str, directory: str,
         mount: Any) -> dict[str, Any]:
    bp = bench.bp
    machine = machine_info(directory or None)
    try:
        path_facts = dict(bp.describe())
    except Exception as exc:  # facts for the JSON only
        path_facts = {"error": f"{type(exc).__name__}: {exc}"}
    path_facts.pop("counters", None)
    machine.update({"fio": fio_version(fio), "block_path": path_facts})
    lay = bench.layout
    store_doc = {"size_classes": list(SIZE_CLASSES), "lba": lay.lba, "header_bytes": lay.header_bytes,
                 "capacity": lay.capacity,
                 "classes": [{"size": c.size, "offset": c.offset, "stride": c.stride, "slots": c.count}
                             for c in lay.classes]}
    where = (f"{bench.target} (block device)" if args.device else
             f"{bench.target} ({format_size(bench.size)}, {mount.fstype + ' on ' + mount.source if mount else '?'})")
    print(f"blocks suite: {where}, LBA {lay.lba}, engine {bench.engine.name} QD {bench.qd}, batches of "
          f"{bench.batch} ({bench.outstanding} in flight; -sync cases 1), {args.buffers} buffers, {machine['fio']}, "
          f"{args.warmup} "
          f"warm-up + {args.repeat} pair(s) per case, cold cache before every run", flush=True)
    table = Table("fio")
    print(table.header(), flush=True)
    results: list[dict[str, Any]] = []
    for case in cases:
        result = _run_case(bench, fio, case)
        results.append(result)
        print(table.row(result), flush=True)
    _print_details(results)
    warn_short_runs(results, " (fio times whole ms); use a bigger --size")
    acceptance = evaluate_goals(results, size=bench.size, batch=bench.batch, qd=bench.qd,
                                outstanding=bench.outstanding)
    for line in acceptance:
        print(line["line"], flush=True)
    return {"bench": "blocks", "machine": machine, "date": utc_now(), "store": store_doc, "cases": results,
            "acceptance": acceptance}


def _run_case(bench: _Bench, fio: str, case: Case) -> dict[str, Any]:
    args = bench.args
    ws = bench.working_set(case.block_size)
    job = bench.fio_job(case, ws)
    outstanding = 1 if case.sync else bench.outstanding
    rss = PeakRss()
    rss.start()
    resident = drop_and_check(case.name, [bench.target], probe=() if args.device else None)
    if args.device:
        resident = None  # fincore reads files, not devices

    def run_ours(run: int) -> RunResult:
        ws.order_gets(run)
        try:
            return bench.run_put(ws, outstanding) if case.writes else bench.run_get(ws, outstanding)
        except bench.errors.SfstoreError as exc:  # name the case instead of a traceback
            raise BenchSetupError(f"{case.name}: the block store failed: {type(exc).__name__}: {exc}") from exc

    def run_theirs(run: int) -> RunResult:
        bench.drop()
        result = run_fio(fio, bench.fio_job(case, ws, run))
        if case.writes:
            bench.holds = None  # fio wrote over the store's slots
        return result

    ours_side, theirs_side = run_pairs(run_ours, run_theirs, repeat=args.repeat, warmup=args.warmup)
    ours, theirs = ours_side.runs, theirs_side.runs
    growth = rss.growth()
    slot_io = bench.layout.header_bytes + -(-ws.bs // bench.layout.lba) * bench.layout.lba
    params = {
        "op": case.op, "block_size": ws.bs, "size_class": SIZE_CLASSES[ws.cls], "keys": ws.n, "key_bytes": KEY_BYTES,
        "batch": bench.batch, "outstanding_batches": outstanding, "queue_depth": bench.qd,
        "engine": bench.engine.name, "buffers": args.buffers,
        "io_bytes": ws.n * ws.bs, "sfstore_io_bytes_per_op": slot_io, "fio_io_bytes_per_op": ws.bs,
        "region_offset": ws.offset, "region_bytes": ws.n * ws.stride, "slot_stride": ws.stride,
        "target": bench.target, "image_size": None if args.device else bench.size, "device": bool(args.device),
        "fill": None if args.keys else args.fill, "durable": case.writes,
        "fsync_in_timed_region": case.writes, "cold": "fsync + posix_fadvise(DONTNEED) before every run (O_DIRECT)",
        "resident_after_drop_bytes": resident, "repeat": args.repeat, "warmup_pairs": args.warmup,
        "seed": args.seed, "peak_rss_method": rss.method,
        "sfstore_call": (("BlockStore.put_many(batch)" if outstanding == 1 else
                          f"BlockStore.put_many_async(batch), {outstanding} in flight") + " x N/batch + flush()"
                         if case.writes else
                         ("BlockStore.get_into(keys, buffers)" if outstanding == 1 else
                          f"BlockStore.get_into_async(keys, buffers), {outstanding} in flight") + " x N/batch"),
    }
    ours_doc = side_summary(ours, growth)
    ours_doc["warmup_runs"] = [r.as_dict() for r in ours_side.warmup]
    ours_doc.update(median_extras(ours, ("batch_p50_ms", "batch_p99_ms", "flush_s")))
    ref_doc = side_summary(theirs, None)
    ref_doc["warmup_runs"] = [r.as_dict() for r in theirs_side.warmup]
    ref_doc["peak_rss_note"] = PEAK_RSS_NOTE
    ref_doc["command"] = " ".join(fio_command(fio, job)) + "  (--randseed = --seed + the run's index)"
    same = all(a.bytes == b.bytes == ws.n * ws.bs for a, b in zip(ours, theirs, strict=True))
    if not same:
        warn(f"{case.name}: sfstore and fio moved different byte counts: the ratio is not comparable")
    return {"name": case.name, "params": params, "sfstore": ours_doc, "reference_tool": "fio", "reference": ref_doc,
            **summarize_pairs(ours, theirs), "same_bytes": same}


def _print_details(results: Sequence[dict[str, Any]]) -> None:
    if not results:
        return
    print("\nper case: MiB/s and IOPS (medians), sfstore's per-batch latency (p50 / p99 of put_many / get_into) and "
          "flush time of puts", flush=True)
    width = max(len(c["name"]) for c in results) + 2
    for c in results:
        ours, ref = c["sfstore"], c["reference"]
        flush = f", flush {1e3 * ours['flush_s']:.1f} ms" if "flush_s" in ours else ""
        print(f"{c['name']:<{width}}sfstore {ours['bytes_per_s'] / MIB:8.1f} MiB/s {ours['iops']:9.0f} IOPS   "
              f"fio {ref['bytes_per_s'] / MIB:8.1f} MiB/s {ref['iops']:9.0f} IOPS   batch "
              f"{ours.get('batch_p50_ms', 0.0):.2f} / {ours.get('batch_p99_ms', 0.0):.2f} ms{flush}", flush=True)
    print(flush=True)


def evaluate_goals(results: Sequence[dict[str, Any]], size: int = _DEFAULT_SIZE, batch: int = 64, qd: int = 64,
                   outstanding: int = DEFAULT_OUTSTANDING) -> list[dict[str, Any]]:
    """The issue's goals read from the cases: ``PASS`` or ``MISS`` per goal (``not run`` when its case was not).

    Parameters
    ----------
    results : sequence of dict
        Case documents of this run.
    size, batch, qd, outstanding : int
        The run's image size, batch, queue depth and batches in flight; a line says at what it ran unless that
        is the issue's shape (1 GiB image, batches of 64 at QD 64, kept in flight as deep as fio's queue: 2).

    Returns
    -------
    list of dict
        ``{"goal", "case", "target", "ratio", "ratio_min", "ratio_max", "status", "met", "line"}`` per goal;
        ``status`` is ``met``, ``missed`` or ``not run``.
    """
    note = ""
    if (size, batch, qd, outstanding) != (_DEFAULT_SIZE, 64, 64, DEFAULT_OUTSTANDING):
        note = (f" [at {format_size(size)}, batch {batch}, QD {qd}, {outstanding} batch(es) in flight; the issue's "
                f"shape is 1g, 64, 64, {DEFAULT_OUTSTANDING}]")
    return evaluate_ratio_goals(GOALS, results, note)


register(Suite(name="blocks", help="BlockStore put/get (256k and 4k values) vs fio randwrite/randread on the same "
                                   "image or device", add_arguments=add_arguments, run=run))
