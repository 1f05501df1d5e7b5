"""Helpers every benchmark suite shares: the rules of ``BENCHMARKING.md`` turned into code.

Cold cache (:func:`drop_cache`), the filesystem check (:func:`check_bench_dir`), the benchmark's data files
(:func:`random_file`), machine facts for the JSON (:func:`machine_info`), the text table (:class:`Table`) and the
goals on ratios (:func:`evaluate_ratio_goals`). What a run measures and how runs are summarized is
:mod:`tools.bench.measure`.
"""

from __future__ import annotations

import fnmatch
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from sfstore.mounts import MountInfo

__all__ = [
    "MIB",
    "GIB",
    "BenchSetupError",
    "format_size",
    "drop_cache",
    "random_file",
    "check_space",
    "resident_bytes",
    "mount_of",
    "check_bench_dir",
    "default_bench_dir",
    "bench_dir",
    "drop_and_check",
    "machine_info",
    "utc_now",
    "match_any",
    "Table",
    "ttft_cell",
    "render_ttft_table",
    "warn",
    "RatioGoal",
    "evaluate_ratio_goals",
    "fsync_path",
    "io_engine",
    "import_for_bench",
    "BUILD_HINT",
]

MIB = 1 << 20
GIB = 1 << 30

#: Filesystems that keep data in RAM and accept any O_DIRECT alignment: a benchmark there measures memcpy.
_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "proc", "sysfs", "devpts", "shm"})


class BenchSetupError(Exception):
    """The benchmark cannot run here (missing tool, refused directory, engine unavailable); the message says why."""


def warn(message: str, stream: TextIO | None = None) -> None:
    """Print ``message`` as a warning on stderr (or ``stream``).

    Parameters
    ----------
    message : str
        The text, without the ``warning:`` prefix.
    stream : TextIO or None
        Where to print; ``sys.stderr`` when None.
    """
    print(f"warning: {message}", file=stream or sys.stderr, flush=True)


def format_size(n: int) -> str:
    """Format a byte count the way case names spell block sizes: ``4k``, ``64k``, ``1m``, ``16m``, ``1g``.

    Parameters
    ----------
    n : int
        Bytes.

    Returns
    -------
    str
        The shortest exact spelling in binary units (plain digits when none divides ``n``).
    """
    for suffix, unit in (("t", 1 << 40), ("g", 1 << 30), ("m", 1 << 20), ("k", 1 << 10)):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def drop_cache(path: str | os.PathLike[str]) -> None:
    """Make ``path`` cold: fsync it, then ``posix_fadvise(POSIX_FADV_DONTNEED)`` over the whole file.

    Parameters
    ----------
    path : str or os.PathLike
        The file.

    Notes
    -----
    No root is needed. The host may still cache a virtual disk, which is why only ratios from one run count.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_path(path: str | os.PathLike[str], directory: bool = False) -> None:
    """``fsync`` the file (or, with ``directory``, the directory) at ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        What to make durable.
    directory : bool
        Whether ``path`` is a directory (its entries are made durable).
    """
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_space(directory: str, need: int, what: str, fix: str = "use --size or --dir") -> None:
    """Refuse a run whose files would not fit: :class:`BenchSetupError` unless ``directory``'s filesystem has
    ``need`` bytes free; the message says ``what`` needs them and how to ``fix`` it."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise BenchSetupError(f"{directory} has {free / GIB:.2f} GiB free; {what} ({fix})")


def random_file(path: str, size: int, suite: str) -> bool:
    """Make ``path`` hold ``size`` bytes of random data, or reuse it when it has that size already.

    The data is written (so no unwritten extent reads as zeros for free and no first write pays for allocation),
    through a ``.partial`` file renamed into place, and fsynced with its directory.

    Parameters
    ----------
    path : str
        The file.
    size : int
        Bytes.
    suite : str
        The suite that needs it (for the message when space is short).

    Returns
    -------
    bool
        Whether an existing file of that size was reused.

    Raises
    ------
    BenchSetupError
        When the filesystem lacks the space.
    """
    try:
        if os.stat(path).st_size == size:
            return True
    except FileNotFoundError:
        pass
    directory = os.path.dirname(os.path.abspath(path))
    check_space(directory, size + 64 * MIB,
                f"the {suite} bench needs {size / GIB:.2f} GiB for {os.path.basename(path)}")
    print(f"preparing {path}: {format_size(size)} of random data (once; later runs reuse it)", flush=True)
    tmp = f"{path}.partial"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < size:
            n = min(16 * MIB, size - done)
            os.pwrite(fd, os.urandom(n), done)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_path(directory, directory=True)
    return False


def resident_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes of ``path`` in the page cache according to ``fincore`` (util-linux); None when it cannot tell.

    Parameters
    ----------
    path : str or os.PathLike
        The file.

    Returns
    -------
    int or None
        Resident bytes, or None when ``fincore`` is missing or fails.
    """
    exe = shutil.which("fincore")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--bytes", "--noheadings", "--output", "RES", os.fspath(path)],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def mount_of(path: str | os.PathLike[str]) -> MountInfo | None:
    """The mount that serves ``path`` (:func:`sfstore.mounts.mount_for`), or None when the mount table cannot say.

    Parameters
    ----------
    path : str or os.PathLike
        A file or directory (one that does not exist yet is judged by its nearest existing parent).

    Returns
    -------
    sfstore.mounts.MountInfo or None
        The mount (``mountpoint``, ``fstype``, ``source`` ...).
    """
    mounts = import_for_bench("sfstore.mounts", BUILD_HINT)
    errors = import_for_bench("sfstore.errors", BUILD_HINT)
    try:
        found: MountInfo = mounts.mount_for(path)
    except errors.NotSupportedOnHostError:
        return None
    return found


def check_bench_dir(directory: str | os.PathLike[str]) -> MountInfo | None:
    """Create ``directory`` if needed and refuse it when it lives in memory (tmpfs, ``/dev/shm``, ramfs).

    Parameters
    ----------
    directory : str or os.PathLike
        Where benchmark files go.

    Returns
    -------
    sfstore.mounts.MountInfo or None
        The mount it lives on (None when that cannot be read).

    Raises
    ------
    BenchSetupError
        For a memory filesystem: it accepts any O_DIRECT alignment and never touches a device, so a
        comparison there measures memcpy, not storage.
    """
    real = os.path.realpath(directory)
    if real == "/dev/shm" or real.startswith("/dev/shm/"):
        raise BenchSetupError(f"{directory} is in /dev/shm (tmpfs): O_DIRECT there is memcpy, not storage; "
                              "give --dir a directory on a disk filesystem")
    try:
        os.makedirs(real, exist_ok=True)
    except OSError as exc:
        raise BenchSetupError(f"cannot create benchmark directory {directory}: {exc.strerror}") from None
    mount = mount_of(real)
    if mount is not None and mount.fstype in _MEMORY_FILESYSTEMS:
        raise BenchSetupError(f"{directory} is on {mount.fstype} (mounted at {mount.mountpoint}): memory "
                              "filesystems do not do O_DIRECT the way disks do; give --dir a directory on a disk "
                              "filesystem")
    return mount


def bench_dir(given: str | None, *under: str) -> tuple[str, MountInfo | None]:
    """The benchmark directory of a suite: ``given`` (``--dir``), else :func:`default_bench_dir` joined with
    ``under``; created and checked by :func:`check_bench_dir`.

    Parameters
    ----------
    given : str or None
        ``--dir``.
    *under : str
        Sub-directories of the default one (e.g. ``files``).

    Returns
    -------
    tuple
        ``(directory, mount)``.
    """
    directory = given or os.path.join(default_bench_dir(), *under)
    return directory, check_bench_dir(directory)


def drop_and_check(label: str, paths: Iterable[str | os.PathLike[str]],
                   probe: Iterable[str | os.PathLike[str]] | None = None) -> int | None:
    """Make every file of ``paths`` cold (:func:`drop_cache`) and say what the page cache still holds of ``probe``
    (default: the same files), warning under ``label`` when it holds something.

    Parameters
    ----------
    label : str
        The case, for the warning.
    paths : iterable of str or os.PathLike
        The files a run reads or writes.
    probe : iterable of str or os.PathLike, optional
        The files to ask ``fincore`` about (a sample, where there are many).

    Returns
    -------
    int or None
        Resident bytes of ``probe`` (:func:`resident_bytes`), None when it cannot tell.
    """
    files = list(paths)
    for path in files:
        drop_cache(path)
    counts = [resident_bytes(p) for p in (files if probe is None else probe)]
    resident = None if any(n is None for n in counts) else sum(int(n or 0) for n in counts)
    if resident:
        warn(f"{label}: {resident} bytes stay in the page cache after fsync + DONTNEED (fincore)")
    return resident


def default_bench_dir() -> str:
    """``<sfstore data_dir>/bench`` (``SFSTORE_DATA_DIR`` or the embedded default).

    Returns
    -------
    str
        The directory (not created here).
    """
    from sfstore import defaults

    return os.path.join(str(defaults.get("data_dir")), "bench")


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _block_device_facts(source: str) -> dict[str, Any]:
    if not source.startswith("/dev/"):
        return {}
    name = os.path.basename(os.path.realpath(source))
    sysdir = f"/sys/class/block/{name}"
    if not os.path.exists(sysdir):
        return {}
    queue = f"{sysdir}/queue"
    if not os.path.exists(queue):  # a partition: the queue belongs to the parent disk
        queue = os.path.join(os.path.dirname(os.path.realpath(sysdir)), "queue")
    facts: dict[str, Any] = {"device": name}
    for key in ("logical_block_size", "physical_block_size", "rotational", "scheduler", "nr_requests"):
        text = _read_text(f"{queue}/{key}")
        if text is not None:
            facts[key] = text.strip()
    return facts


def machine_info(bench_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Facts about this machine for the JSON: host, kernel, CPUs, memory, Python, sfstore commit, filesystem.

    Parameters
    ----------
    bench_dir : str or os.PathLike or None
        The benchmark directory, whose filesystem and block device are described.

    Returns
    -------
    dict
        JSON-ready facts; anything that cannot be read is left out or None.
    """
    cpu_model = None
    for line in (_read_text("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            cpu_model = line.split(":", 1)[1].strip()
            break
    mem_total = None
    for line in (_read_text("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            mem_total = int(line.split()[1]) * 1024
    os_name = None
    for line in (_read_text("/etc/os-release") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            os_name = line.split("=", 1)[1].strip().strip('"')
    try:
        usable_cpus: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable_cpus = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "os": os_name,
        "arch": platform.machine(),
        "cpu_model": cpu_model,
        "cpus": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "load_avg": list(os.getloadavg()),
        "mem_total_bytes": mem_total,
        "python": platform.python_version(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
    }
    try:
        import sfstore

        info["sfstore_version"] = getattr(sfstore, "__version__", None)
    except ImportError:
        info["sfstore_version"] = None
    if bench_dir is not None:
        mount = mount_of(bench_dir)
        info["bench_dir"] = os.path.realpath(bench_dir)
        if mount is not None:
            info["filesystem"] = {"type": mount.fstype, "source": mount.source, "mount_point": mount.mountpoint,
                                  **_block_device_facts(mount.source)}
    return info


def utc_now() -> str:
    """The current UTC time in ISO 8601, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def match_any(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` matches any of the shell-style glob ``patterns``.

    Parameters
    ----------
    name : str
        A case name.
    patterns : iterable of str
        Globs such as ``read-*-qd32``.

    Returns
    -------
    bool
        True on a match.
    """
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _gib_s(bps: float) -> str:
    return f"{bps / GIB:.3f} GiB/s"


def _iops(iops: float) -> str:
    return f"{iops / 1000:.1f}k IOPS" if iops >= 1000 else f"{iops:.0f} IOPS"


def _ratio(case: dict[str, Any]) -> str:
    r, lo, hi = case.get("ratio"), case.get("ratio_min"), case.get("ratio_max")
    if r is None:
        return "n/a"
    if lo is None or hi is None:
        return f"{r:.2f}"
    return f"{r:.2f} ({lo:.2f}-{hi:.2f})"


def ttft_cell(side: Any, spread: bool = True) -> str:
    """A side of the ``vllm`` suite as text: its median time to first token in ms, with ``spread`` the min-max in
    brackets; ``n/a`` for a side that did not run (its error, shortened, in brackets).

    Parameters
    ----------
    side : dict
        ``median_s``, ``min_s``, ``max_s``; or ``error``.
    spread : bool
        Add the min-max.

    Returns
    -------
    str
        E.g. ``22.1 ms (20.3-25.0)``.
    """
    if not isinstance(side, dict) or "median_s" not in side:
        why = str(side.get("error", "")) if isinstance(side, dict) else ""
        return f"n/a ({why[:40]})" if why else "n/a"
    text = f"{float(side['median_s']) * 1e3:.1f} ms"
    if spread and "min_s" in side and "max_s" in side:
        text += f" ({float(side['min_s']) * 1e3:.1f}-{float(side['max_s']) * 1e3:.1f})"
    return text


def render_ttft_table(ttft: Iterable[dict[str, Any]]) -> str:
    """The ``vllm`` suite's table: one row per prompt length, one column per side (TTFT median, min-max).

    Parameters
    ----------
    ttft : iterable of dict
        The document's ``ttft`` entries (``name``, ``sides``: side name -> summary).

    Returns
    -------
    str
        The table.
    """
    entries = list(ttft)
    sides: list[str] = []
    for entry in entries:
        sides += [s for s in entry.get("sides", {}) if s not in sides]
    rows = [["TTFT (ms)", *sides]]
    rows += [[str(e.get("name", "?")), *(ttft_cell(e.get("sides", {}).get(s)) for s in sides)] for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _cpu(side: dict[str, Any]) -> str:
    value = side.get("cpu_s_per_gib")
    return "n/a" if value is None else f"{value:.3f}"


class Table:
    """The text table every suite prints: case, sfstore, reference, ratio (min-max), CPU s/GiB of each side.

    Rows can be printed one by one as cases finish (:meth:`header`, :meth:`row`) or all at once
    (:meth:`render`).

    Parameters
    ----------
    reference_tool : str
        Name of the reference column (``fio``, ``torch.save`` ...).
    use_iops : callable or None
        ``use_iops(case) -> bool``: show IOPS instead of GiB/s for that case (default: block size under 64 KiB).
    name_width : int
        Width of the case column (default 20; suites with longer case names pass more).
    """

    def __init__(self, reference_tool: str, use_iops: Callable[[dict[str, Any]], bool] | None = None,
                 name_width: int = 20) -> None:
        self.reference_tool = reference_tool
        self.use_iops = use_iops or (lambda case: int(case.get("params", {}).get("block_size", 1 << 30)) < 65536)
        self._widths = (max(20, name_width), 16, 16, 20, 12, 12)

    def _line(self, cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, self._widths, strict=True)).rstrip()

    def header(self) -> str:
        """The two header lines."""
        top = self._line(["case", "sfstore", self.reference_tool, "ratio (min-max)", "CPU s/GiB", ""])
        sub = self._line(["", "", "", "", "sfstore", self.reference_tool])
        return top + "\n" + sub

    def row(self, case: dict[str, Any]) -> str:
        """One case as a line.

        Parameters
        ----------
        case : dict
            A case in the common JSON shape.

        Returns
        -------
        str
            The formatted line.
        """
        ours, ref = case["sfstore"], case["reference"]
        fmt: Callable[[dict[str, Any]], str]
        if self.use_iops(case):
            fmt = lambda s: _iops(float(s["iops"]))  # noqa: E731
        else:
            fmt = lambda s: _gib_s(float(s["bytes_per_s"]))  # noqa: E731
        if "median_s" in ours or "median_s" in ref:  # a time (the vllm suite's TTFT), not a throughput
            cells = [ttft_cell(s, spread=False) for s in (ours, ref)]
        else:
            cells = [fmt(s) if "bytes_per_s" in s else "n/a" for s in (ours, ref)]  # n/a: a side that did not run
        return self._line([case["name"], *cells, _ratio(case), _cpu(ours), _cpu(ref)])

    def render(self, cases: Iterable[dict[str, Any]]) -> str:
        """The header and every case.

        Parameters
        ----------
        cases : iterable of dict
            Cases in the common JSON shape.

        Returns
        -------
        str
            The table.
        """
        return "\n".join([self.header(), *(self.row(c) for c in cases)])


@dataclass(frozen=True)
class RatioGoal:
    """One acceptance goal: case ``case`` must reach ``ratio`` x its reference (median pairwise ratio)."""

    what: str
    case: str
    ratio: float


def evaluate_ratio_goals(
    goals: Sequence[RatioGoal], results: Sequence[dict[str, Any]], note: str = ""
) -> list[dict[str, Any]]:
    """Read ``goals`` from the case documents: ``PASS``, ``MISS``, ``n/a`` (the case ran but has no ratio: its
    reference could not run here, with why) or ``not run`` (the case was not selected).

    Parameters
    ----------
    goals : sequence of RatioGoal
        The suite's goals.
    results : sequence of dict
        Case documents of this run (``name``, ``ratio``, ``ratio_min``, ``ratio_max``, ``reference``).
    note : str
        Appended to PASS/MISS lines (e.g. the shape the run used when it is not the issue's).

    Returns
    -------
    list of dict
        ``{"goal", "case", "target", "status", "met", "line", ...}`` per goal, with ``ratio``, ``ratio_min``,
        ``ratio_max`` and (missed) ``missed_by`` or (n/a) ``reason``; ``status`` is ``met``, ``missed``, ``n/a``
        or ``not run``.
    """
    by_name = {c["name"]: c for c in results}
    out: list[dict[str, Any]] = []
    for goal in goals:
        entry: dict[str, Any] = {"goal": goal.what, "case": goal.case, "target": goal.ratio}
        case = by_name.get(goal.case)
        if case is None:
            entry.update({"status": "not run", "met": None,
                          "line": f"goal: {goal.what}: not run (not selected: --cases / --quick)"})
            out.append(entry)
            continue
        r = case.get("ratio")
        if r is None:
            ref = case.get("reference")
            why = (ref.get("status") if isinstance(ref, dict) else None) or "no ratio"
            entry.update({"status": "n/a", "met": None, "reason": why, "line": f"goal: {goal.what}: n/a ({why})"})
            out.append(entry)
            continue
        lo, hi = case.get("ratio_min"), case.get("ratio_max")
        entry.update({"ratio": r, "ratio_min": lo, "ratio_max": hi})
        spread = f"{r:.2f}x" + (f" (min-max {lo:.2f}-{hi:.2f})" if lo is not None and hi is not None else "")
        if r >= goal.ratio:
            low = "" if lo is None or lo >= goal.ratio else f"; the lowest pair ({lo:.2f}x) is below it"
            entry.update({"status": "met", "met": True, "line": f"goal: {goal.what}: PASS, {spread}{low}{note}"})
        else:
            short = (goal.ratio - r) / goal.ratio
            best = "" if hi is None or hi < goal.ratio else f"; the best pair ({hi:.2f}x) reaches it"
            entry.update({"status": "missed", "met": False, "missed_by": short,
                          "line": f"goal: {goal.what}: MISS, {spread} is {short:.0%} short of {goal.ratio}x"
                                  f"{best}{note}"})
        out.append(entry)
    return out


def import_for_bench(name: str, why: str) -> Any:
    """``importlib.import_module(name)``, or :class:`BenchSetupError` saying ``why`` it is needed."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise BenchSetupError(f"{name} cannot be imported ({exc}): {why}") from None


#: Why an sfstore module is needed, for :func:`import_for_bench`.
BUILD_HINT = "build sfstore first (pip install -e .)"


def io_engine(name: str | None, queue_depth: int, threads: int | None = None) -> Any:
    """sfstore's I/O engine for a bench side: ``get_engine(name, queue_depth=queue_depth)``, and a thread-based
    engine again with ``threads`` workers (default: the queue depth, since a pool keeps at most one request in
    flight per thread).

    Parameters
    ----------
    name : str or None
        ``--engine`` (None: the ``engine`` setting).
    queue_depth : int
        Requests the engine keeps in flight.
    threads : int or None
        Worker threads of a thread-based engine; an int is passed to any engine.

    Returns
    -------
    Engine
        The engine.

    Raises
    ------
    BenchSetupError
        When sfstore is not built or the engine is unavailable here.
    """
    engine_mod = import_for_bench("sfstore.engine", BUILD_HINT)
    errors = import_for_bench("sfstore.errors", BUILD_HINT)
    try:
        engine = engine_mod.get_engine(name, queue_depth=queue_depth)
        if threads is not None or engine.name != "uring":
            engine = engine_mod.get_engine(engine.name, queue_depth=queue_depth, threads=threads or queue_depth)
    except errors.EngineUnavailableError as exc:
        raise BenchSetupError(f"engine {name or 'default'} is unavailable here: {exc}") from None
    return engine
