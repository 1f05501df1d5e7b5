"""Suite ``engine``: sfstore's I/O engine against fio on one file, same shapes, same bytes, in one run.

Cases are ``<op>-<block size>-qd<depth>`` for op in ``read``, ``write``, ``randread``, ``randwrite``, block size
in 4k, 64k, 1m, 16m and queue depth in 1, 8, 32. For each case, ``--repeat`` interleaved pairs run in ABBA
order (sfstore, fio, fio, sfstore, ...: the host caches the virtual disk, so going second can find data warm
there), each side on a cold file (fsync + ``POSIX_FADV_DONTNEED`` before it):

* **sfstore**: ``get_engine(--engine, queue_depth=QD)`` (thread-based engines also get ``threads=QD`` so that
  QD requests can really be in flight), the file opened with ``open_fd(path, flags, direct=True)``, QD buffers
  of one block each from ``RegisteredBufferPool`` (page-aligned ``mmap`` buffers where the pool is missing), and
  the whole run prepared before the clock starts as batches of ``--batch`` requests (default 8 x QD, at least 64)
  of which ``--outstanding`` (default 2) are always submitted, so the engine never drains while Python collects
  a finished batch. Writes end with ``fsync`` inside the timed region. CPU is ``getrusage(RUSAGE_SELF)`` over
  the timed region: the submitting thread and every engine thread.
* **fio**: ``--ioengine=io_uring --direct=1 --iodepth=QD --bs=BS``, the same file and the same byte count
  (``--io_size``), ``--end_fsync=1`` for writes. CPU is fio's job ``usr_cpu + sys_cpu`` over its runtime.

Both sides move the same bytes: sequential cases the first N blocks of the file, random cases N distinct blocks
drawn from the whole file, each at most once, in random order (fio's random map; sfstore's side uses a seeded
permutation). N is the whole file, or fewer for small blocks at low depth (``--ops``) so a full run stays short.
"""

from __future__ import annotations

import argparse
import importlib
import mmap
import os
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tools.bench import pairs
from tools.bench.common import (
    BenchSetupError,
    RatioGoal,
    Table,
    bench_dir,
    drop_and_check,
    drop_cache,
    evaluate_ratio_goals,
    format_size,
    io_engine,
    machine_info,
    random_file,
    utc_now,
    warn,
)
from tools.bench.fio import PEAK_RSS_NOTE, FioJob, find_fio, fio_command, fio_version, run_fio
from tools.bench.measure import CpuMeter, PeakRss, RunResult, side_summary, summarize_pairs
from tools.bench.options import add_fio, nonneg_int, parse_size
from tools.bench.pairs import run_pairs, warn_if_few_pairs, warn_short_runs
from tools.bench.pairs import select_cases as select_from
from tools.bench.registry import Suite, register

__all__ = ["OPS", "BLOCK_SIZES", "QUEUE_DEPTHS", "QUICK_CASES", "Case", "all_cases", "select_cases",
           "plan_offsets", "prepare_file", "run"]

OPS = ("read", "write", "randread", "randwrite")
BLOCK_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
QUEUE_DEPTHS = (1, 8, 32)
#: The foundation issue's goals (throughput, IOPS for 4k) vs fio.
GOALS = (
    RatioGoal("1 MiB reads at QD32 >= 0.9x fio", "read-1m-qd32", 0.9),
    RatioGoal("1 MiB writes at QD32 >= 0.9x fio", "write-1m-qd32", 0.9),
    RatioGoal("4 KiB random reads at QD32 >= 0.8x fio's IOPS", "randread-4k-qd32", 0.8),
)
#: ``--quick``: the shapes the foundation issue's acceptance quotes.
QUICK_CASES = tuple(g.case for g in GOALS)
#: O_DIRECT needs offsets and lengths in whole sectors; every block size here is a multiple of this.
_MIN_ALIGN = 4096


@dataclass(frozen=True)
class Case(pairs.Case):
    """One I/O shape.

    Attributes
    ----------
    op : str
        ``read``, ``write``, ``randread`` or ``randwrite`` (fio's ``--rw`` names).
    block_size : int
        Bytes per request.
    queue_depth : int
        Requests in flight.
    """

    op: str
    block_size: int
    queue_depth: int

    @property
    def name(self) -> str:
        """``<op>-<block size>-qd<depth>``, e.g. ``randread-4k-qd32``."""
        return f"{self.op}-{format_size(self.block_size)}-qd{self.queue_depth}"

    @property
    def random(self) -> bool:
        """Whether offsets are random."""
        return self.op.startswith("rand")


def all_cases() -> list[Case]:
    """Every case, ordered by op, then block size, then queue depth.

    Returns
    -------
    list of Case
        48 cases.
    """
    return [Case(op, bs, qd) for op in OPS for bs in BLOCK_SIZES for qd in QUEUE_DEPTHS]


def select_cases(patterns: Sequence[str] | None = None, quick: bool = False) -> list[Case]:
    """The cases to run, in :func:`all_cases` order: :func:`~tools.bench.pairs.select_cases` with ``patterns``
    (shell globs) and, with ``quick``, only :data:`QUICK_CASES`; raises ``BenchSetupError`` when none is left."""
    return select_from("engine", all_cases(), patterns, QUICK_CASES, quick)


def default_ops(case: Case) -> int:
    """Requests per run of ``case`` unless ``--ops`` says otherwise: 4096 x its queue depth, at least 8192 (the
    file bounds it too), so large blocks always cover the whole file while 4 KiB random reads at QD1 stop at 32 MiB
    instead of crawling through 1 GiB."""
    return max(8192, 4096 * case.queue_depth)


def plan_offsets(case: Case, file_size: int, ops: int, seed: int) -> list[int]:
    """File offsets of a run's requests, in submission order.

    Parameters
    ----------
    case : Case
        The case.
    file_size : int
        Size of the file.
    ops : int
        Number of requests (at most ``file_size // block_size``).
    seed : int
        Seed of the permutation of random cases.

    Returns
    -------
    list of int
        Sequential cases: the first ``ops`` blocks in order. Random cases: ``ops`` distinct blocks of the whole
        file in random order, as fio's random map picks them.
    """
    blocks = file_size // case.block_size
    ops = min(ops, blocks)
    if case.random:
        picks = random.Random(seed).sample(range(blocks), ops)
        return [b * case.block_size for b in picks]
    return [b * case.block_size for b in range(ops)]


def prepare_file(directory: str, size: int) -> tuple[str, bool]:
    """``<directory>/engine-<size>.dat`` with ``size`` bytes of random data (:func:`~tools.bench.common.random_file`):
    ``(path, whether an existing file was reused)``."""
    path = os.path.join(directory, f"engine-{format_size(size)}.dat")
    return path, random_file(path, size, "engine")


def _threads_arg(text: str) -> int | str:
    if text == "qd":
        return "qd"
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 'qd' or at least 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine suite's options to ``parser`` (the common ones are there already)."""
    parser.epilog = ("cases are <op>-<block size>-qd<depth>: op read, write, randread, randwrite; block size 4k, 64k, "
                     "1m, 16m; depth 1, 8, 32 (48 in all). --quick runs " + ", ".join(QUICK_CASES) + ".")
    g = parser.add_argument_group("engine suite")
    g.add_argument("--size", type=parse_size, default=1 << 30, metavar="SIZE",
                   help="size of the test file (default 1g; a multiple of 4k)")
    g.add_argument("--ops", type=nonneg_int, default=None, metavar="N",
                   help="requests per run at most (default 4096 x QD, at least 8192; 0 = the whole file)")
    g.add_argument("--batch", type=nonneg_int, default=None, metavar="N",
                   help="requests per engine submit (default 8 x QD, at least 64; 0 = the whole run in one batch)")
    g.add_argument("--outstanding", type=int, default=2, metavar="N",
                   help="batches kept submitted at once (default 2)")
    g.add_argument("--threads", type=_threads_arg, default="qd", metavar="qd|N",
                   help="worker threads of thread-based engines (default 'qd': the case's queue depth)")
    add_fio(g)


def _import(name: str, needs: str | None = None) -> Any:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise BenchSetupError(f"{name} cannot be imported ({exc}); build sfstore first (pip install -e .)") from None
    if needs is not None and not hasattr(module, needs):
        raise BenchSetupError(f"{name} has no {needs} (an incomplete checkout or build?)")
    return module


class _Buffers:
    """``count`` buffers of ``size`` bytes, filled with ``fill``: from the registered pool, else ``mmap``."""

    said: ClassVar[set[str]] = set()  # warnings already printed (once per process each)

    def __init__(self, size: int, count: int, fill: bytes) -> None:
        self.kind = "RegisteredBufferPool"
        self._pool: Any = None
        self.items: list[Any] = []
        pool_cls = getattr(_import("sfstore.buffers"), "RegisteredBufferPool", None)
        if pool_cls is None:
            self._say("sfstore.buffers.RegisteredBufferPool is missing: using page-aligned mmap buffers")
        else:
            try:
                self._pool = pool_cls(buffer_size=size, max_buffers=count)
                self.items = [self._pool.acquire() for _ in range(count)]
            except Exception as exc:  # a broken pool must not stop the comparison; say so and fall back
                self._say(f"RegisteredBufferPool failed ({exc}); using page-aligned mmap buffers")
                self.close()
        if not self.items:
            self.kind = "mmap"
            self.items = [mmap.mmap(-1, size) for _ in range(count)]
        for buf in self.items:
            with memoryview(buf) as mv, mv.cast("B") as raw:
                raw[:size] = fill

    @classmethod
    def _say(cls, message: str) -> None:
        if message not in cls.said:
            cls.said.add(message)
            warn(message)

    def close(self) -> None:
        """Release every buffer (and the pool)."""
        for buf in self.items:
            if isinstance(buf, mmap.mmap):
                buf.close()
            else:
                buf.release()
        self.items = []
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class _SfstoreSide:
    """sfstore's side of one case: engine, O_DIRECT fd, buffers and the prepared batches."""

    def __init__(self, engine_mod: Any, args: argparse.Namespace, case: Case, path: str, offsets: list[int]) -> None:
        self.case = case
        qd = case.queue_depth
        self.engine = io_engine(args.engine, qd, None if args.threads == "qd" else int(args.threads))
        flags = os.O_RDWR if case.writes else os.O_RDONLY
        self.buffers: _Buffers | None = None
        self.batches: list[list[Any]] = []
        try:
            fd, direct = engine_mod.open_fd(path, flags, direct=True)
        except OSError as exc:
            raise BenchSetupError(f"cannot open {path} with O_DIRECT: {exc}") from None
        self.fd: int | None = int(fd)
        try:
            if not direct:
                raise BenchSetupError(f"open_fd({path}, direct=True) returned a buffered descriptor")
            self.buffers = _Buffers(case.block_size, qd, random.Random(args.seed).randbytes(case.block_size))
            op = "write" if case.writes else "read"
            request = engine_mod.Request
            bufs = self.buffers.items
            reqs = [request(op, fd, off, case.block_size, bufs[i % qd]) for i, off in enumerate(offsets)]
            per_batch = args.batch if args.batch is not None else max(64, 8 * qd)
            per_batch = per_batch or len(reqs) or 1
            self.batch_requests = per_batch
            self.batches = [reqs[i:i + per_batch] for i in range(0, len(reqs), per_batch)]
            self.outstanding = max(1, args.outstanding)
        except BaseException:
            self.close()
            raise

    def run_once(self) -> RunResult:
        """One timed run of the prepared batches (plus ``fsync`` for writes).

        Returns
        -------
        RunResult
            Bytes counted from the engine's results; ``extra`` holds the engine's stats over the run.
        """
        engine, bs = self.engine, self.case.block_size
        pending: deque[tuple[Any, int]] = deque()
        moved = ops = 0
        before = dict(engine.stats())
        meter = CpuMeter()
        meter.start()
        t0 = time.perf_counter()
        for batch in self.batches:
            if len(pending) >= self.outstanding:
                done, count = pending.popleft()
                moved += sum(done.get())
                ops += count
            pending.append((engine.submit(batch), len(batch)))
        while pending:
            done, count = pending.popleft()
            moved += sum(done.get())
            ops += count
        if self.case.writes and self.fd is not None:
            os.fsync(self.fd)
        seconds = time.perf_counter() - t0
        cpu = meter.stop()
        after = dict(engine.stats())
        expected = sum(len(b) for b in self.batches) * bs
        if moved != expected:
            raise BenchSetupError(f"{self.case.name}: sfstore moved {moved} bytes, expected {expected} (short I/O)")
        stats = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in after}
        return RunResult(bytes=moved, ops=ops, seconds=seconds, cpu_s=cpu, extra={"engine_stats": stats})

    def close(self) -> None:
        """Drop the requests, release the buffers and close the descriptor (the engine stays cached)."""
        self.batches = []
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _describe_engines(engine_mod: Any) -> Any:
    try:
        return engine_mod.describe_engines()
    except Exception as exc:  # facts for the JSON only
        return {"error": f"{type(exc).__name__}: {exc}"}


def _alignment(engine_mod: Any, path: str) -> tuple[int, int] | None:
    try:
        mem, off = engine_mod.direct_io_alignment(path)
        return int(mem), int(off)
    except Exception:  # facts for the JSON only
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the engine suite with ``args`` (the common and engine options) and return its JSON document.

    Raises :class:`~tools.bench.common.BenchSetupError` when something it needs is missing (fio, the engine,
    O_DIRECT, space) or the directory is in memory.
    """
    cases = select_cases(args.cases, args.quick)
    size = int(args.size)
    if size < _MIN_ALIGN or size % _MIN_ALIGN:
        raise BenchSetupError(f"--size {size}: must be a positive multiple of 4k (O_DIRECT works in whole sectors)")
    directory, mount = bench_dir(args.dir)
    fio = find_fio(args.fio)
    engine_mod = _import("sfstore.engine", "get_engine")
    path, reused = prepare_file(directory, size)
    alignment = _alignment(engine_mod, path)
    warn_if_few_pairs(args.repeat)

    machine = machine_info(directory)
    machine.update({"fio": fio_version(fio), "engines": _describe_engines(engine_mod),
                    "direct_io_alignment": list(alignment) if alignment else None})
    fs = f"{mount.fstype} on {mount.source}" if mount else "unknown filesystem"
    print(f"engine suite: {path} ({format_size(size)}, {fs}{', reused' if reused else ''}), "
          f"{machine['fio']}, {args.repeat} pair(s) per case, cold cache before every run", flush=True)
    table = Table("fio")
    print(table.header(), flush=True)

    results: list[dict[str, Any]] = []
    unequal: list[str] = []
    for case in cases:
        if case.block_size > size or (alignment and case.block_size % alignment[1]):
            warn(f"{case.name}: skipped (file of {format_size(size)} or O_DIRECT alignment {alignment} "
                 "does not fit this block size)")
            continue
        result = _run_case(engine_mod, fio, args, case, path, size)
        results.append(result)
        print(table.row(result), flush=True)
        if not result["same_bytes"]:
            unequal.append(case.name)
    warn_short_runs(results, " (fio times whole ms); use a bigger --size")
    if unequal:
        warn(f"sfstore and fio moved different byte counts in {', '.join(unequal)}: those ratios are not comparable")
    acceptance = evaluate_ratio_goals(GOALS, results)
    for goal in acceptance:
        if goal["status"] != "not run":
            print(goal["line"])
    return {"bench": "engine", "machine": machine, "date": utc_now(), "cases": results, "acceptance": acceptance}


def _run_case(engine_mod: Any, fio: str, args: argparse.Namespace, case: Case, path: str, size: int) -> dict[str, Any]:
    blocks = size // case.block_size
    ops = min(blocks, default_ops(case) if args.ops is None else (args.ops or blocks))
    offsets = plan_offsets(case, size, ops, args.seed)
    job = FioJob(name=case.name, filename=path, size=size, io_size=ops * case.block_size, rw=case.op,
                 bs=case.block_size, iodepth=case.queue_depth, seed=args.seed)
    rss = PeakRss()
    rss.start()
    side = _SfstoreSide(engine_mod, args, case, path, offsets)
    try:
        resident = drop_and_check(case.name, [path])

        def run_ours(pair: int) -> RunResult:
            drop_cache(path)
            try:
                return side.run_once()
            except OSError as exc:  # typed sfstore I/O errors are OSErrors; name the case instead of a traceback
                raise BenchSetupError(f"{case.name}: sfstore's engine failed: {exc}") from exc

        def run_theirs(pair: int) -> RunResult:
            drop_cache(path)
            return run_fio(fio, job)

        ours_side, theirs_side = run_pairs(run_ours, run_theirs, repeat=args.repeat)
        ours, theirs = ours_side.runs, theirs_side.runs
        our_rss = rss.growth()
        params = {
            "op": case.op, "block_size": case.block_size, "queue_depth": case.queue_depth, "file_size": size,
            "io_bytes": ops * case.block_size, "ops": ops, "direct": True, "file": path,
            "cold": "fsync + posix_fadvise(DONTNEED) before every run", "resident_after_drop_bytes": resident,
            "fsync_in_timed_region": case.writes, "repeat": args.repeat, "seed": args.seed,
            "engine": side.engine.name, "engine_queue_depth": getattr(side.engine, "queue_depth", None),
            "threads": args.threads if isinstance(args.threads, int)
            else (None if side.engine.name == "uring" else case.queue_depth),
            "batch_requests": side.batch_requests, "outstanding_batches": side.outstanding,
            "buffers": side.buffers.kind if side.buffers else None, "buffer_count": case.queue_depth,
            "peak_rss_method": rss.method,
        }
    finally:
        side.close()
    ours_doc = side_summary(ours, our_rss)
    stats = [r.extra.get("engine_stats", {}) for r in ours]
    ours_doc["bytes_direct"] = sum(int(s.get("bytes_direct", 0)) for s in stats)
    ours_doc["bytes_bounced"] = sum(int(s.get("bytes_bounced", 0)) for s in stats)
    moved = sum(r.bytes for r in ours)
    ours_doc["direct_fraction"] = ours_doc["bytes_direct"] / moved if moved else None
    if ours_doc["bytes_bounced"]:
        warn(f"{case.name}: the engine bounced {ours_doc['bytes_bounced']} bytes of aligned O_DIRECT requests")
    elif stats and "bytes_direct" in stats[0] and ours_doc["bytes_direct"] < moved:
        warn(f"{case.name}: the engine counted {ours_doc['bytes_direct']} of {moved} bytes as direct")
    ref_doc = side_summary(theirs, None)
    ref_doc["peak_rss_note"] = PEAK_RSS_NOTE
    ref_doc["command"] = " ".join(fio_command(fio, job))
    same = all(a.bytes == b.bytes for a, b in zip(ours, theirs, strict=True))
    return {"name": case.name, "params": params, "sfstore": ours_doc, "reference_tool": "fio",
            "reference": ref_doc, **summarize_pairs(ours, theirs), "same_bytes": same}


register(Suite(name="engine", help="sfstore's I/O engine vs fio (io_uring, O_DIRECT) on one file",
               add_arguments=add_arguments, run=run))
