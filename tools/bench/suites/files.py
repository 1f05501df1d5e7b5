"""Suite ``files``: the file path and the ``sf://`` filesystem against fio, ``open().readinto`` and fsspec's local
filesystem, on the same data, cold, in one run.

The data set lives under ``--dir`` (default ``<sfstore data_dir>/bench/files``) and is made once, then reused
while it matches: one file of ``--size`` bytes (default 1 GiB, ``big-<size>.dat``) and ``--small-count`` files of
``--small-size`` bytes (default 10,000 of 64 KiB, ``small-<count>x<size>/``), all random data.

Cases (``<size>`` is ``--size`` spelt like ``1g``; ``<count>x<small>`` like ``10000x64k``), one pair of sides
each; every side runs on a cold cache (fsync + ``POSIX_FADV_DONTNEED`` on every file it reads, each small file
one by one) and the sides alternate in ABBA order (sfstore, reference, reference, sfstore ...) ``--repeat`` times,
after the warm-up pairs:

* ``read_into-<size>-vs-fio``: ``FilePath.read_into`` of the whole file into a ``RegisteredBufferPool`` buffer
  of the file's size (page-aligned, allocated and touched before the timed region) against fio reading the
  same file sequentially with O_DIRECT and io_uring, block size = FilePath's ``chunk_size``, queue depth = its
  ``parallelism`` (the device limit of that shape).
* ``read_into-numpy-<size>-vs-fio``: the same into a ``numpy.empty`` array (which malloc places 16 bytes past a
  page boundary: O_DIRECT cannot land in it, so the engine bounces every byte).
* ``read_into-<size>-vs-readinto`` / ``read_into-numpy-<size>-vs-readinto``: against plain
  ``open(path, "rb").readinto(destination)`` (buffered, page cache dropped first) into the same destination.
* ``cat_file-<size>-vs-fsspec-local``: ``fsspec.filesystem("sf", root=DIR).cat_file`` against
  ``fsspec.filesystem("file").cat_file``; both return one ``bytes`` object holding the whole file.
* ``read_into-<size>-vs-fsspec-local`` / ``read_into-numpy-<size>-vs-fsspec-local``: ``read_into`` against
  ``LocalFileSystem.cat_file`` (the issue's acceptance ratio, >= 1.5x).
* ``cat-<count>x<small>-vs-fsspec-local``: ``fsspec.filesystem("sf").cat(list)`` against
  ``fsspec.filesystem("file").cat(list)``; both return every file's ``bytes`` (acceptance: >= 2x).
* ``read_many-<count>x<small>-vs-fsspec-local``: ``FilePath.read_many(list)`` (what ``sf.cat`` builds on)
  against the same reference.

The ``sf`` cases need :mod:`sfstore.fs`; without it they are skipped and the JSON says why (``skipped``).

``--warmup`` pairs (default 1) run first and are discarded: on a VM the first touch of fresh guest memory and
the host's cache of the virtual disk make a case's first run an outlier (several times slower than the runs
after it, with ``fincore`` showing 0 pages resident before each).

Measured per run: bytes, requests (files for the small-files cases: ``iops`` is files/s), wall time, CPU of the
whole process (``getrusage``: every engine thread) and the peak RSS growth over the run (the kernel's
high-water mark reset first). ``peak_rss_beyond_data_bytes`` is that growth minus the data the side holds
afterwards: a destination allocated and resident before the run counts nothing (so for ``read_into`` it is what
the read adds beyond its destination: the issue allows 64 MiB), returned ``bytes`` count their size. After
every run, outside the timed region, sampled blocks of the result are compared with the file (the destination's
sample blocks are zeroed before each run), so a side that skipped work cannot pass. Peak RSS is the maximum
over every run, warm-up included, so a first use that allocates (the engine's bounce buffers) counts. fio's peak
RSS is not reported: ``wait4`` gives a child spawned from this process this process's own resident set at the
spawn (the destination), not fio's.

fio runs as :mod:`tools.bench.fio` runs it (no ``--fixedbufs``): 8 MiB O_DIRECT reads into its 4 KiB-page
buffers are slower than with ``--fixedbufs=1``, and sfstore's huge-page registered destination is faster still,
so ``read_into`` beating "the device limit" is about buffers.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tools.bench.common import (
    BUILD_HINT,
    GIB,
    MIB,
    BenchSetupError,
    Table,
    bench_dir,
    check_space,
    drop_and_check,
    drop_cache,
    format_size,
    fsync_path,
    import_for_bench,
    machine_info,
    random_file,
    utc_now,
    warn,
)
from tools.bench.fio import FioJob, find_fio, fio_command, fio_version, run_fio
from tools.bench.measure import Meters, RunResult, side_summary, summarize_pairs
from tools.bench.options import add_fio, add_warmup, parse_size
from tools.bench.pairs import run_pairs, warn_if_few_pairs, warn_short_runs
from tools.bench.pairs import select_cases as select_from
from tools.bench.registry import Suite, register

__all__ = ["Case", "Dataset", "GOALS", "all_cases", "select_cases", "prepare_dataset", "run"]

#: The memory acceptance: ``read_into`` may add at most this much to peak RSS beyond its destination.
RSS_LIMIT = 64 * MIB
_SAMPLE_BLOCK = 4096
_SAMPLES = 8
_SMALL_SAMPLES = 16


@dataclass(frozen=True)
class Goal:
    """One acceptance goal of the issue: a case whose median pairwise ratio must reach ``ratio``."""

    what: str
    case_prefix: str
    ratio: float


#: The bench goals of the issue (the memory goal is checked separately, per ``read_into`` case).
GOALS = (
    Goal("1 GiB cold read_into >= 0.9x fio", "read_into-{size}-vs-fio", 0.9),
    Goal("1 GiB cold read_into >= 1.5x LocalFileSystem.cat_file", "read_into-{size}-vs-fsspec-local", 1.5),
    Goal("10,000 small files: sf.cat(list) >= 2x LocalFileSystem.cat(list)", "cat-{small}-vs-fsspec-local", 2.0),
)


@dataclass(frozen=True)
class Case:
    """One pair of sides.

    Attributes
    ----------
    name : str
        Case name, e.g. ``read_into-1g-vs-fio``.
    shape : str
        ``one-file`` (the large file) or ``small-files``.
    sf_call : str
        sfstore's side: ``read_into``, ``cat_file`` (fsspec ``sf``), ``cat`` (fsspec ``sf``) or ``read_many``.
    destination : str or None
        ``read_into``'s destination: ``registered`` (``RegisteredBufferPool``) or ``numpy``.
    reference_tool : str
        ``fio``, ``open.readinto`` or ``fsspec.local``.
    needs_fs : bool
        Whether sfstore's side goes through :mod:`sfstore.fs`.
    """

    name: str
    shape: str
    sf_call: str
    destination: str | None
    reference_tool: str
    needs_fs: bool = False


_REF_SUFFIX = {"fio": "fio", "open.readinto": "readinto", "fsspec.local": "fsspec-local"}


def _case(shape: str, sf_call: str, dest: str | None, ref: str, size_label: str) -> Case:
    middle = "numpy-" if dest == "numpy" else ""
    return Case(name=f"{sf_call}-{middle}{size_label}-vs-{_REF_SUFFIX[ref]}", shape=shape, sf_call=sf_call,
                destination=dest, reference_tool=ref, needs_fs=sf_call in ("cat_file", "cat"))


def small_label(count: int, small_size: int) -> str:
    """``<count>x<size>``, e.g. ``10000x64k``.

    Parameters
    ----------
    count : int
        Number of small files.
    small_size : int
        Bytes per file.

    Returns
    -------
    str
        The label used in case and directory names.
    """
    return f"{count}x{format_size(small_size)}"


def all_cases(size: int, small_count: int, small_size: int) -> list[Case]:
    """Every case of the suite for these data sizes, in run order.

    Parameters
    ----------
    size : int
        Size of the large file.
    small_count, small_size : int
        Number and size of the small files.

    Returns
    -------
    list of Case
        Nine cases: six ``read_into`` (two destinations x three references), ``cat_file``, ``cat`` and
        ``read_many``.
    """
    big, small = format_size(size), small_label(small_count, small_size)
    cases = [_case("one-file", "read_into", dest, ref, big) for dest in ("registered", "numpy")
             for ref in ("fio", "open.readinto", "fsspec.local")]
    cases.append(_case("one-file", "cat_file", None, "fsspec.local", big))
    cases.append(_case("small-files", "cat", None, "fsspec.local", small))
    cases.append(_case("small-files", "read_many", None, "fsspec.local", small))
    return cases


def quick_names(size: int, small_count: int, small_size: int) -> list[str]:
    """``--quick``: the cases the issue's acceptance quotes.

    Parameters
    ----------
    size, small_count, small_size : int
        Data sizes.

    Returns
    -------
    list of str
        Case names.
    """
    big, small = format_size(size), small_label(small_count, small_size)
    return [g.case_prefix.format(size=big, small=small) for g in GOALS]


def select_cases(cases: Sequence[Case], patterns: Sequence[str] | None = None, quick: bool = False,
                 quick_set: Sequence[str] = ()) -> list[Case]:
    """The cases to run.

    Parameters
    ----------
    cases : sequence of Case
        Every case (:func:`all_cases`).
    patterns : sequence of str or None
        Shell globs (items may hold several, comma-separated); a case runs when its name matches one.
    quick : bool
        Keep only the names in ``quick_set``.
    quick_set : sequence of str
        The ``--quick`` names.

    Returns
    -------
    list of Case
        The selection, in run order.

    Raises
    ------
    BenchSetupError
        When nothing matches.
    """
    return select_from("files", cases, patterns, quick_set, quick)


# -- the data set --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """The files the suite reads.

    Attributes
    ----------
    directory : str
        The benchmark directory (also the root of ``FilePath`` and of the ``sf`` filesystem).
    big_name : str
        The large file, relative to ``directory``.
    size : int
        Its size.
    small_names : list of str
        The small files, relative to ``directory``, in order.
    small_size : int
        Bytes per small file.
    reused : dict
        ``{"big": bool, "small": bool}``: whether each part was already there.
    """

    directory: str
    big_name: str
    size: int
    small_names: list[str]
    small_size: int
    reused: dict[str, bool] = field(default_factory=dict)

    @property
    def big_path(self) -> str:
        """Absolute path of the large file."""
        return os.path.join(self.directory, self.big_name)

    @property
    def small_paths(self) -> list[str]:
        """Absolute paths of the small files."""
        return [os.path.join(self.directory, n) for n in self.small_names]


def _prepare_big(directory: str, size: int) -> tuple[str, bool]:
    name = f"big-{format_size(size)}.dat"
    return name, random_file(os.path.join(directory, name), size, "files")


def _small_names(count: int, small_size: int) -> tuple[str, list[str]]:
    sub = f"small-{small_label(count, small_size)}"
    width = max(5, len(str(count - 1)))
    return sub, [f"{sub}/f{i:0{width}d}.bin" for i in range(count)]


def _prepare_small(directory: str, count: int, small_size: int) -> tuple[list[str], bool]:
    sub, names = _small_names(count, small_size)
    final = os.path.join(directory, sub)
    manifest = final + ".json"
    want = {"count": count, "size": small_size, "complete": True}
    try:
        with open(manifest, encoding="utf-8") as f:
            have = json.load(f)
        if have == want and all(os.stat(os.path.join(directory, n)).st_size == small_size for n in names):
            return names, True
    except (OSError, ValueError):
        pass
    print(f"preparing {final}/: {count} files of {format_size(small_size)} of random data (once; later runs "
          "reuse them)", flush=True)
    for stale in (final, final + ".partial"):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.unlink(manifest)
    except FileNotFoundError:
        pass
    partial = final + ".partial"
    os.makedirs(partial)
    for name in names:
        fd = os.open(os.path.join(partial, os.path.basename(name)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, os.urandom(small_size))
        finally:
            os.close(fd)
    os.sync()  # one flush for every file (cheaper than 10,000 fsyncs); each is fsynced again before each run
    os.rename(partial, final)
    with open(manifest, "w", encoding="utf-8") as f:
        json.dump(want, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory, directory=True)
    return names, False


def prepare_dataset(directory: str, size: int, small_count: int, small_size: int, *, big: bool = True,
                    small: bool = True) -> Dataset:
    """Create the data set under ``directory``, or reuse the parts that are already there and match.

    Parameters
    ----------
    directory : str
        An existing benchmark directory.
    size : int
        Size of the large file.
    small_count, small_size : int
        Number and size of the small files.
    big, small : bool
        Which parts are needed (only those are made).

    Returns
    -------
    Dataset
        The data set.

    Raises
    ------
    BenchSetupError
        When the filesystem lacks the space.
    """
    need = (size if big else 0) + (small_count * max(small_size, 4096) if small else 0)
    have = 0
    if big and os.path.exists(os.path.join(directory, f"big-{format_size(size)}.dat")):
        have += size
    if need - have > 0:
        check_space(directory, need - have + 64 * MIB, f"the files bench needs {need / GIB:.2f} GiB of data",
                    "use --size, --small-count or --dir")
    reused: dict[str, bool] = {}
    big_name = f"big-{format_size(size)}.dat"
    if big:
        big_name, reused["big"] = _prepare_big(directory, size)
    names: list[str] = []
    if small:
        names, reused["small"] = _prepare_small(directory, small_count, small_size)
    return Dataset(directory, big_name, size, names, small_size, reused)


# -- sides ---------------------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    """What one side's timed call did: bytes, requests, extra facts, the result it holds, and how much of the
    process's memory that result newly occupies (0 for a destination that was resident before the run)."""

    bytes: int
    ops: int
    held: Any = None
    held_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _timed(fn: Callable[[], _Outcome], check: Callable[[_Outcome], None]) -> RunResult:
    """Run ``fn`` once, timed, with CPU and peak RSS; then ``check`` its result outside the timed region."""
    meters = Meters()
    out = fn()
    meters.stop()
    growth = meters.rss_growth
    try:
        check(out)
    finally:
        out.held = None  # free the result before the next run
    # RSS can grow less than the result's size when it reuses memory the process already held: never below 0
    extra = {**out.extra, "peak_rss_growth_bytes": growth,
             "peak_rss_beyond_data_bytes": max(0, growth - out.held_bytes),
             "peak_rss_method": meters.rss_method}
    return RunResult(bytes=out.bytes, ops=out.ops, seconds=meters.seconds, cpu_s=meters.cpu_s, extra=extra)


class _Samples:
    """Sampled 4 KiB blocks of the large file (first, last and random ones), read once before the runs, to
    check every side's result outside the timed region."""

    def __init__(self, path: str, size: int, seed: int) -> None:
        block = min(_SAMPLE_BLOCK, size)
        last = max(0, (size - block) // block)
        picks = {0, last, *random.Random(seed).sample(range(last + 1), min(_SAMPLES, last + 1))}
        self.offsets = sorted(p * block for p in picks)
        self.block = block
        fd = os.open(path, os.O_RDONLY)
        try:
            self.expected = [os.pread(fd, block, off) for off in self.offsets]
        finally:
            os.close(fd)

    def clear(self, view: memoryview) -> None:
        """Zero the sample blocks of a destination, so data left by an earlier run cannot pass the check."""
        for off in self.offsets:
            view[off:off + self.block] = bytes(self.block)

    def check(self, data: Any, what: str) -> None:
        """Raise :class:`BenchSetupError` unless ``data`` (bytes-like) holds the file's sampled blocks."""
        with memoryview(data) as raw, raw.cast("B") as view:
            for off, want in zip(self.offsets, self.expected, strict=True):
                if view[off:off + self.block] != want:
                    raise BenchSetupError(f"{what}: the bytes at offset {off} differ from the file's")


class _SmallSamples:
    """Whole contents (as SHA-256) of a sample of the small files, to check every side's results."""

    def __init__(self, paths: Sequence[str], seed: int) -> None:
        picks = sorted(random.Random(seed).sample(range(len(paths)), min(_SMALL_SAMPLES, len(paths))))
        self.indices = picks
        self.digests: list[bytes] = []
        for i in picks:
            with open(paths[i], "rb") as f:
                self.digests.append(hashlib.sha256(f.read()).digest())

    def check(self, results: Sequence[Any], what: str) -> None:
        """Raise :class:`BenchSetupError` unless the sampled files' results (in path order) are their bytes."""
        for i, want in zip(self.indices, self.digests, strict=True):
            item = results[i]
            if isinstance(item, BaseException):
                raise BenchSetupError(f"{what}: file {i} failed: {item}")
            if hashlib.sha256(item).digest() != want:
                raise BenchSetupError(f"{what}: file {i}'s bytes differ from the file's")


class _Destination:
    """A destination of the large file's size, allocated and touched (resident) before any timed region."""

    def __init__(self, kind: str, size: int, np: Any) -> None:
        self.kind = kind
        self._pool: Any = None
        self.buffer: Any = None
        before = _rss_now()
        if kind == "registered":
            from sfstore.buffers import RegisteredBufferPool

            try:
                self._pool = RegisteredBufferPool(buffer_size=size, max_buffers=1)
                self.buffer = self._pool.acquire()
            except Exception as exc:
                self.close()
                raise BenchSetupError(f"RegisteredBufferPool cannot give a {format_size(size)} buffer: {exc}") from exc
            self.describe = "RegisteredBufferPool buffer (page-aligned mmap)"
            self.facts: dict[str, Any] = {
                "locked": bool(getattr(self.buffer, "locked", False)),
                "huge_pages": bool(getattr(self.buffer, "huge_pages", False)),
            }
        else:
            self.buffer = np.empty(size, dtype=np.uint8)
            self.describe = "numpy.empty(size, uint8)"
            self.facts = {}
        self.view = memoryview(self.buffer).cast("B")
        np.frombuffer(self.view, dtype=np.uint8).fill(0)  # fault every page in now, outside the timed region
        address = np.frombuffer(self.view, dtype=np.uint8).ctypes.data
        self.facts.update({"bytes": size, "address_mod_4096": int(address) % 4096,
                           "resident_growth_bytes": max(0, _rss_now() - before)})

    def close(self) -> None:
        """Release the destination (and its pool)."""
        if getattr(self, "view", None) is not None:
            self.view.release()
        if self.buffer is not None and self.kind == "registered":
            self.buffer.release()
        self.buffer = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _rss_now() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = ("requests", "files", "bytes_direct", "bytes_bounced", "errors")
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in keys}


# -- the suite -----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the files suite's options to ``parser`` (the common ones are there already)."""
    parser.epilog = ("cases: read_into[-numpy]-SIZE-vs-{fio,readinto,fsspec-local}, cat_file-SIZE-vs-fsspec-local, "
                     "{cat,read_many}-COUNTxSMALL-vs-fsspec-local. --quick runs the three the issue's acceptance "
                     "quotes. --dir defaults to <data_dir>/bench/files.")
    g = parser.add_argument_group("files suite")
    g.add_argument("--size", type=parse_size, default=1 << 30, metavar="SIZE",
                   help="size of the large file (default 1g; a multiple of 4k)")
    g.add_argument("--small-count", type=int, default=10000, metavar="N", help="number of small files (default 10000)")
    g.add_argument("--small-size", type=parse_size, default=64 << 10, metavar="SIZE",
                   help="size of each small file (default 64k)")
    add_warmup(g, "on a VM the first touch of fresh guest memory and the host's cache make a case's first run an "
                  "outlier")
    add_fio(g)


def _sf_filesystem(directory: str) -> tuple[Any, str | None, str | None]:
    """``fsspec.filesystem("sf", root=directory)``, how it was found, or why it cannot be had."""
    if importlib.util.find_spec("sfstore.fs") is None:
        return None, None, "sfstore/fs.py (SFFileSystem) is not in this checkout yet"
    fsspec = importlib.import_module("fsspec")
    try:
        return fsspec.filesystem("sf", root=directory, skip_instance_cache=True), "fsspec entry point", None
    except ValueError:
        pass  # protocol not known: the entry point is not installed in this environment
    except Exception as exc:
        return None, None, f"fsspec.filesystem('sf') failed: {type(exc).__name__}: {exc}"
    try:
        module = importlib.import_module("sfstore.fs")
        fsspec.register_implementation("sf", module.SFFileSystem, clobber=True)
        fs = fsspec.filesystem("sf", root=directory, skip_instance_cache=True)
    except Exception as exc:
        return None, None, f"sfstore.fs cannot be used: {type(exc).__name__}: {exc}"
    return fs, "registered by the bench (the fsspec.specs entry point is not installed: pip install -e .)", None


class _Runner:
    """Everything a case needs: data, FilePath, the filesystems, fio, numpy; makes the sides of a case."""

    def __init__(self, args: argparse.Namespace, data: Dataset, fio: str | None) -> None:
        self.args = args
        self.data = data
        self.fio = fio
        self.np = import_for_bench("numpy", "the files bench needs numpy (pip install -e '.[bench]')")
        self.fsspec = import_for_bench("fsspec", "the files bench compares with fsspec's local filesystem "
                                                 "(pip install fsspec)")
        file_mod = import_for_bench("sfstore.paths.file", BUILD_HINT)
        self.fp = file_mod.FilePath(data.directory)  # the engine comes from the setting (--engine overrides it)
        try:
            self.engine_name = str(self.fp.engine.name)
        except Exception as exc:  # EngineUnavailableError, or a broken build
            raise BenchSetupError(f"sfstore's I/O engine is unavailable here: {exc}") from None
        self.local = self.fsspec.filesystem("file")
        self.sf, self.sf_how, self.sf_missing = _sf_filesystem(data.directory)
        self.samples = _Samples(data.big_path, data.size, args.seed) if "big" in data.reused else None
        self.small_samples = _SmallSamples(data.small_paths, args.seed) if data.small_names else None

    # each side returns a zero-argument callable doing one cold, timed, checked run

    def drop_big(self) -> None:
        drop_cache(self.data.big_path)

    def drop_small(self) -> None:
        for path in self.data.small_paths:
            drop_cache(path)

    def _into(self, dest: _Destination, fn: Callable[[], _Outcome], what: str) -> Callable[[], RunResult]:
        """A run of ``fn``, which reads the large file into ``dest``: the sampled blocks zeroed first, checked after."""
        samples = self.samples
        assert samples is not None

        def once() -> RunResult:
            samples.clear(dest.view)
            return _timed(fn, lambda out: samples.check(dest.view[:out.bytes], what))

        return once

    def sf_read_into(self, dest: _Destination) -> Callable[[], RunResult]:
        fp, name = self.fp, self.data.big_name

        def fn() -> _Outcome:
            before = fp.counters.snapshot()
            n = fp.read_into(name, dest.buffer)
            delta = _counter_delta(before, fp.counters.snapshot())
            return _Outcome(n, delta["requests"], extra={"counters": delta})

        return self._into(dest, fn, "FilePath.read_into")

    def readinto(self, dest: _Destination) -> Callable[[], RunResult]:
        path, size = self.data.big_path, self.data.size

        def fn() -> _Outcome:
            got = calls = 0
            with open(path, "rb") as f, memoryview(dest.buffer) as raw, raw.cast("B") as view:
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
                    calls += 1
            return _Outcome(got, calls)

        return self._into(dest, fn, "open().readinto")

    def cat_file(self, fs: Any, path: str, what: str, counters: Any = None) -> Callable[[], RunResult]:
        samples = self.samples
        assert samples is not None

        def fn() -> _Outcome:
            before = counters.snapshot() if counters is not None else {}
            data = fs.cat_file(path)
            extra: dict[str, Any] = {"result_type": type(data).__name__}
            if counters is not None:
                extra["counters"] = _counter_delta(before, counters.snapshot())
            return _Outcome(len(data), 1, held=data, held_bytes=len(data), extra=extra)

        def check(out: _Outcome) -> None:
            if not isinstance(out.held, bytes):
                warn(f"{what} returned {type(out.held).__name__}, not bytes")
            samples.check(out.held, what)

        return lambda: _timed(fn, check)

    def cat_many(self, call: Callable[[], Any], what: str, to_list: Callable[[Any], list[Any]],
                 counters: Any = None) -> Callable[[], RunResult]:
        samples = self.small_samples
        assert samples is not None
        count = len(self.data.small_names)

        def fn() -> _Outcome:
            before = counters.snapshot() if counters is not None else {}
            got = to_list(call())
            total = sum(len(b) for b in got if not isinstance(b, BaseException))
            extra: dict[str, Any] = {}
            if counters is not None:
                extra["counters"] = _counter_delta(before, counters.snapshot())
            return _Outcome(total, len(got), held=got, held_bytes=total, extra=extra)

        def check(out: _Outcome) -> None:
            if out.ops != count:
                raise BenchSetupError(f"{what} returned {out.ops} results for {count} files")
            samples.check(out.held, what)

        return lambda: _timed(fn, check)

    def fio_side(self) -> tuple[Callable[[], RunResult], FioJob]:
        assert self.fio is not None
        fio = self.fio
        bs = min(self.fp.chunk_size, self.data.size)
        job = FioJob(name=f"read-{format_size(bs)}-qd{self.fp.parallelism}", filename=self.data.big_path,
                     size=self.data.size, io_size=self.data.size, rw="read", bs=bs, iodepth=self.fp.parallelism,
                     seed=self.args.seed)
        return (lambda: run_fio(fio, job)), job


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the files suite with ``args`` (the common and files options; ``--engine`` sets sfstore's ``engine``
    setting for the run: FilePath and ``sf``) and return its JSON document: ``skipped`` lists the cases that could
    not run here, with the reason, and ``acceptance`` the issue's goals, each met or missed by how much.

    Raises :class:`~tools.bench.common.BenchSetupError` when something it needs is missing (numpy, fsspec, sfstore,
    space) or the directory is in memory.
    """
    if not args.engine:
        return _run(args)
    defaults = import_for_bench("sfstore.defaults", BUILD_HINT)
    with defaults.set(engine=args.engine):
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    size, count, small_size = int(args.size), int(args.small_count), int(args.small_size)
    if size < 4096 or size % 4096:
        raise BenchSetupError(f"--size {size}: must be a positive multiple of 4k (fio reads it with O_DIRECT)")
    if count < 1 or small_size < 1:
        raise BenchSetupError("--small-count and --small-size must be at least 1")
    cases = select_cases(all_cases(size, count, small_size), args.cases, args.quick,
                         quick_names(size, count, small_size))
    directory, mount = bench_dir(args.dir, "files")
    skipped: list[dict[str, str]] = []
    fio: str | None = None
    if any(c.reference_tool == "fio" for c in cases):
        try:
            fio = find_fio(args.fio)
        except BenchSetupError as exc:
            for c in [c for c in cases if c.reference_tool == "fio"]:
                skipped.append({"name": c.name, "reason": str(exc)})
            cases = [c for c in cases if c.reference_tool != "fio"]
    data = prepare_dataset(directory, size, count, small_size, big=any(c.shape == "one-file" for c in cases),
                           small=any(c.shape == "small-files" for c in cases))
    runner = _Runner(args, data, fio)
    if runner.sf is None:
        for c in [c for c in cases if c.needs_fs]:
            skipped.append({"name": c.name, "reason": str(runner.sf_missing)})
        cases = [c for c in cases if not c.needs_fs]
    warn_if_few_pairs(args.repeat)

    fp = runner.fp
    machine = machine_info(directory)
    machine.update({"fio": fio_version(fio) if fio else None, "file_path": _describe(fp),
                    "fsspec": getattr(runner.fsspec, "__version__", None), "numpy": runner.np.__version__,
                    "sf_filesystem": runner.sf_how or f"unavailable: {runner.sf_missing}"})
    fs = f"{mount.fstype} on {mount.source}" if mount else "unknown filesystem"
    print(f"files suite: {directory} ({fs}; {format_size(size)} file, {count} x {format_size(small_size)} files"
          f"{', reused' if data.reused and all(data.reused.values()) else ''}), FilePath chunk "
          f"{format_size(fp.chunk_size)} x {fp.parallelism} in flight, direct={fp.direct}, engine "
          f"{runner.engine_name}, {args.repeat} pair(s) per case, cold cache before every run", flush=True)
    for item in skipped:
        warn(f"{item['name']}: skipped: {item['reason']}")
    if runner.sf is not None and runner.sf_how != "fsspec entry point":
        warn(f"fsspec protocol 'sf': {runner.sf_how}")
    table = Table("reference", use_iops=lambda case: False, name_width=max((len(c.name) for c in cases), default=20))
    print(table.header(), flush=True)

    results: list[dict[str, Any]] = []
    dests: dict[str, _Destination] = {}
    try:
        for case in cases:
            if case.destination and case.destination not in dests:
                for other in list(dests):  # one destination of the file's size at a time
                    dests.pop(other).close()
                dests[case.destination] = _Destination(case.destination, size, runner.np)
            result = _run_case(runner, case, dests.get(case.destination or ""))
            results.append(result)
            print(table.row(result), flush=True)
    finally:
        for d in dests.values():
            d.close()

    _print_memory(results)
    warn_short_runs(results, "; use a bigger --size / --small-count")
    unequal = [c["name"] for c in results if not c["same_bytes"]]
    if unequal:
        warn(f"the two sides moved different byte counts in {', '.join(unequal)}: those ratios are not comparable")
    acceptance = _acceptance(results, skipped, size, count, small_size)
    for line in acceptance:
        print(line["line"], flush=True)
    return {"bench": "files", "machine": machine, "date": utc_now(), "cases": results, "skipped": skipped,
            "acceptance": acceptance}


def _describe(fp: Any) -> dict[str, Any]:
    try:
        d = dict(fp.describe())
    except Exception as exc:  # facts for the JSON only
        return {"error": f"{type(exc).__name__}: {exc}"}
    d.pop("counters", None)
    return d


def _ref_label(case: Case) -> str:
    return {"fio": "fio --rw=read --direct=1 --ioengine=io_uring", "open.readinto": "open(path, 'rb').readinto",
            "fsspec.local": "fsspec.filesystem('file')." + ("cat(list)" if case.shape == "small-files"
                                                            else "cat_file(path)")}[case.reference_tool]


def _sf_label(case: Case) -> str:
    return {"read_into": "FilePath.read_into(path, destination)",
            "cat_file": "fsspec.filesystem('sf', root=DIR).cat_file(path)",
            "cat": "fsspec.filesystem('sf', root=DIR).cat(list)",
            "read_many": "FilePath.read_many(list)"}[case.sf_call]


def _run_case(runner: _Runner, case: Case, dest: _Destination | None) -> dict[str, Any]:
    data, fp, args = runner.data, runner.fp, runner.args
    big = case.shape == "one-file"
    job: FioJob | None = None
    ours_fn: Callable[[], RunResult]
    ref_fn: Callable[[], RunResult]
    if case.sf_call == "read_into":
        assert dest is not None
        ours_fn = runner.sf_read_into(dest)
    elif case.sf_call == "cat_file":
        ours_fn = runner.cat_file(runner.sf, data.big_name, "sf cat_file", runner.sf.file_path.counters)
    elif case.sf_call == "cat":
        sf, names = runner.sf, data.small_names
        keys = [sf._strip_protocol(n) for n in names]  # cat's dict is keyed by the normalized names
        ours_fn = runner.cat_many(lambda: sf.cat(names), "sf cat(list)", lambda d: [d[k] for k in keys],
                                  sf.file_path.counters)
    else:
        names = data.small_names
        ours_fn = runner.cat_many(lambda: fp.read_many(names), "FilePath.read_many", list, fp.counters)
    if case.reference_tool == "fio":
        ref_fn, job = runner.fio_side()
    elif case.reference_tool == "open.readinto":
        assert dest is not None
        ref_fn = runner.readinto(dest)
    elif big:
        ref_fn = runner.cat_file(runner.local, data.big_path, "LocalFileSystem.cat_file")
    else:
        local, paths = runner.local, data.small_paths
        local_keys = [local._strip_protocol(p) for p in paths]
        ref_fn = runner.cat_many(lambda: local.cat(paths), "LocalFileSystem.cat(list)",
                                 lambda d: [d[k] for k in local_keys])
    drop = runner.drop_big if big else runner.drop_small
    resident = drop_and_check(case.name, [data.big_path] if big else data.small_paths,
                              probe=None if big else data.small_paths[:16])
    def run_ours(pair: int) -> RunResult:
        drop()
        try:
            return ours_fn()
        except OSError as exc:
            raise BenchSetupError(f"{case.name}: sfstore failed: {exc}") from exc

    def run_theirs(pair: int) -> RunResult:
        drop()
        return ref_fn()

    # warm-up runs are not in the figures, but their peak RSS still counts (a first use that allocates)
    ours_side, theirs_side = run_pairs(run_ours, run_theirs, repeat=args.repeat, warmup=args.warmup)
    ours, theirs, warm_ours, warm_theirs = ours_side.runs, theirs_side.runs, ours_side.warmup, theirs_side.warmup

    total = data.size if big else len(data.small_names) * data.small_size
    params: dict[str, Any] = {
        "shape": case.shape, "sfstore_call": _sf_label(case), "reference_call": _ref_label(case),
        "cold": "fsync + posix_fadvise(DONTNEED) on every file read, before every run",
        "resident_after_drop_bytes": resident, "resident_probe": "the file" if big else "the first 16 files",
        "io_bytes": total, "repeat": args.repeat, "warmup_pairs": max(0, args.warmup), "seed": args.seed,
        "engine": runner.engine_name,
        "chunk_size": fp.chunk_size, "parallelism": fp.parallelism, "direct": fp.direct,
        "transport": fp.transport, "peak_rss_method": ours[0].extra.get("peak_rss_method") if ours else None,
    }
    if big:
        params.update({"file": data.big_path, "file_size": data.size, "block_size": fp.chunk_size,
                       "queue_depth": fp.parallelism})
    else:
        params.update({"directory": os.path.join(data.directory, os.path.dirname(data.small_names[0])),
                       "files": len(data.small_names), "file_size": data.small_size, "block_size": data.small_size})
    if dest is not None:
        params["destination"] = dest.kind
        params["destination_detail"] = {"what": dest.describe, **dest.facts}
    if case.needs_fs:
        params["sf_filesystem"] = runner.sf_how
        params["sf_engine"] = str(runner.sf.file_path.engine.name) if hasattr(runner.sf, "file_path") else None

    ours_doc = _side_doc(ours, warm_ours)
    counters = [r.extra.get("counters", {}) for r in ours]
    if counters and counters[0]:
        ours_doc["bytes_direct"] = sum(int(c.get("bytes_direct", 0)) for c in counters)
        ours_doc["bytes_bounced"] = sum(int(c.get("bytes_bounced", 0)) for c in counters)
        moved = sum(r.bytes for r in ours)
        ours_doc["direct_fraction"] = ours_doc["bytes_direct"] / moved if moved else None
    if job is not None and runner.fio is not None:
        ref_doc = side_summary(theirs, None)
        ref_doc["peak_rss_note"] = (
            "not measured: wait4's ru_maxrss of a child spawned from this process includes this process's resident "
            "set at the spawn (Linux keeps the pre-exec high-water mark; /bin/true spawned from a process holding "
            "1 GiB reports ~1 GiB), here the resident destination; runs[].process_peak_rss_bytes keeps the raw value")
        ref_doc["peak_rss_beyond_data_bytes"] = None
        ref_doc["command"] = " ".join(fio_command(runner.fio, job))
    else:
        ref_doc = _side_doc(theirs, warm_theirs)
    same = all(a.bytes == b.bytes == total for a, b in zip(ours, theirs, strict=True))
    doc: dict[str, Any] = {"name": case.name, "params": params, "sfstore": ours_doc,
                           "reference_tool": case.reference_tool, "reference": ref_doc,
                           **summarize_pairs(ours, theirs), "same_bytes": same, "verified": True}
    if case.shape == "small-files":
        doc["files_per_s"] = {"sfstore": ours_doc["iops"], "reference": ref_doc["iops"]}
    if case.sf_call == "read_into":
        beyond = ours_doc["peak_rss_beyond_data_bytes"]
        doc["memory_goal"] = {"limit_bytes": RSS_LIMIT, "beyond_destination_bytes": beyond,
                              "met": beyond is not None and beyond <= RSS_LIMIT}
        if beyond is not None and beyond > RSS_LIMIT:
            warn(f"{case.name}: read_into added {beyond / MIB:.1f} MiB to peak RSS beyond its destination "
                 f"(limit {RSS_LIMIT // MIB} MiB)")
    return doc


def _side_doc(runs: Sequence[RunResult], warmup: Sequence[RunResult] = ()) -> dict[str, Any]:
    """:func:`side_summary` of the measured runs, with peak RSS over the warm-up runs too (a first use that
    allocates, e.g. the engine's bounce buffers, counts), and the warm-up runs themselves."""
    every = [*warmup, *runs]
    growth = max((int(r.extra.get("peak_rss_growth_bytes", 0)) for r in every), default=None)
    doc = side_summary(runs, growth)
    doc["peak_rss_beyond_data_bytes"] = max((int(r.extra.get("peak_rss_beyond_data_bytes", 0)) for r in every),
                                            default=None)
    doc["peak_rss_over"] = "warm-up and measured runs" if warmup else "measured runs"
    doc["warmup_runs"] = [r.as_dict() for r in warmup]
    return doc


def _mib(n: Any) -> str:
    return "n/a" if n is None else f"{int(n) / MIB:8.1f}"


def _print_memory(results: Sequence[dict[str, Any]]) -> None:
    if not results:
        return
    print("\npeak RSS growth per run (max over every run, warm-up included), MiB: growth / beyond the data "
          "held (a destination resident before the run counts 0, returned bytes count their size); sfstore's "
          "bytes through O_DIRECT straight into the result vs through bounce buffers", flush=True)
    width = max(len(c["name"]) for c in results) + 2
    print(f"{'case':<{width}}{'sfstore':>20}  {'reference':>20}  {'sfstore direct':>16}", flush=True)
    for c in results:
        cells = []
        for side in (c["sfstore"], c["reference"]):
            cells.append(f"{_mib(side.get('peak_rss_growth_bytes'))} /{_mib(side.get('peak_rss_beyond_data_bytes'))}")
        fraction = c["sfstore"].get("direct_fraction")
        direct = "n/a" if fraction is None else f"{fraction:.0%}"
        flag = ""
        goal = c.get("memory_goal")
        if goal is not None and not goal["met"]:
            flag = f"  > {RSS_LIMIT // MIB} MiB beyond the destination"
        print(f"{c['name']:<{width}}{cells[0]:>20}  {cells[1]:>20}  {direct:>16}{flag}", flush=True)
    print(flush=True)


def _acceptance(results: Sequence[dict[str, Any]], skipped: Sequence[dict[str, str]], size: int, count: int,
                small_size: int) -> list[dict[str, Any]]:
    big, small = format_size(size), small_label(count, small_size)
    at_scale = size == 1 << 30 and count == 10000 and small_size == 64 << 10
    scale_note = "" if at_scale else f" [at {big} / {small}, not the issue's 1g / 10000x64k]"
    by_name = {c["name"]: c for c in results}
    skipped_by = {s["name"]: s["reason"] for s in skipped}
    out: list[dict[str, Any]] = []
    for goal in GOALS:
        name = goal.case_prefix.format(size=big, small=small)
        entry: dict[str, Any] = {"goal": goal.what, "case": name, "target": goal.ratio}
        case = by_name.get(name)
        if case is None and goal.case_prefix.startswith("cat-"):
            stand_in = f"read_many-{small}-vs-fsspec-local"
            if stand_in in by_name:
                entry["stand_in"] = stand_in
                entry["stand_in_reason"] = skipped_by.get(name, "not selected")
                case = by_name[stand_in]
        if case is None:
            why = skipped_by.get(name, "not selected (--cases / --quick)")
            entry.update({"status": "not run", "line": f"acceptance: {goal.what}: not run ({why})"})
            out.append(entry)
            continue
        r, lo, hi = case.get("ratio"), case.get("ratio_min"), case.get("ratio_max")
        entry.update({"ratio": r, "ratio_min": lo, "ratio_max": hi})
        via = f" (via {case['name']}: {entry['stand_in_reason']})" if "stand_in" in entry else ""
        if r is None:
            entry.update({"status": "not run", "line": f"acceptance: {goal.what}: no ratio{via}"})
        elif r >= goal.ratio:
            spread = "" if lo is None or lo >= goal.ratio else f"; the lowest pair ({lo:.2f}x) is below it"
            entry["status"] = "met"
            entry["line"] = f"acceptance: {goal.what}: met, {r:.2f}x (min-max {lo:.2f}-{hi:.2f}){spread}{via}"
        else:
            short = (goal.ratio - r) / goal.ratio
            spread = "" if hi is None or hi < goal.ratio else f"; the best pair ({hi:.2f}x) reaches it"
            entry.update({"status": "missed", "missed_by": short})
            entry["line"] = (f"acceptance: {goal.what}: MISSED, {r:.2f}x (min-max {lo:.2f}-{hi:.2f}) is "
                             f"{short:.0%} short of {goal.ratio}x{spread}{via}")
        entry["line"] += scale_note
        out.append(entry)
    for dest in ("registered", "numpy"):
        mem = [c for c in results if c.get("memory_goal") and c["params"].get("destination") == dest]
        if not mem:
            continue
        worst = max(mem, key=lambda c: int(c["memory_goal"]["beyond_destination_bytes"]))
        beyond = int(worst["memory_goal"]["beyond_destination_bytes"])
        met = beyond <= RSS_LIMIT
        what = f"memory: read_into ({dest} destination) adds <= {RSS_LIMIT // MIB} MiB beyond the destination"
        if met:
            line = f"acceptance: {what}: met, at most {beyond / MIB:.1f} MiB (worst in {worst['name']})"
        else:
            line = (f"acceptance: {what}: MISSED, {beyond / MIB:.1f} MiB is {(beyond - RSS_LIMIT) / MIB:.1f} MiB "
                    f"over (in {worst['name']})")
        out.append({"goal": what, "case": worst["name"], "target_bytes": RSS_LIMIT, "beyond_bytes": beyond,
                    "status": "met" if met else "missed", "line": line + scale_note})
    return out


register(Suite(name="files", help="FilePath / sf:// vs fio, open().readinto and fsspec's local filesystem "
                                  "(one large file, many small files)", add_arguments=add_arguments, run=run))
