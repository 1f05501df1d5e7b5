"""Run fio as the reference side of a pair and turn its JSON into a :class:`~tools.bench.measure.RunResult`.

fio is the device limit for one I/O shape (``BENCHMARKING.md`` rule 5): O_DIRECT, io_uring, one job, the same
file, block size, queue depth and byte count as sfstore's side, writes fsynced inside the timed region
(``--end_fsync=1``; fio's runtime includes that fsync).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tools.bench.common import BenchSetupError, drop_cache
from tools.bench.measure import RunResult

__all__ = ["FioJob", "find_fio", "fio_version", "fio_command", "run_fio", "PEAK_RSS_NOTE", "request_size",
           "whole_file_jobs", "read_files_cold"]

INSTALL_HINT = "install it with `apt-get install fio` (Debian/Ubuntu) or `dnf install fio`"
#: A fio side's ``peak_rss_note`` in the JSON: why its peak RSS is not reported.
PEAK_RSS_NOTE = "not measured: wait4's ru_maxrss of a child includes the parent's resident memory"


@dataclass(frozen=True)
class FioJob:
    """One fio job: the parameters that must match sfstore's side.

    Attributes
    ----------
    name : str
        Job name (the case name).
    filename : str
        The file (or block device); it must exist and hold ``offset + size`` bytes (fio is told not to create it).
    size : int
        Bytes of the region, from ``offset``, that offsets are drawn from (the whole file when ``offset`` is 0
        and ``size`` is the file's size).
    io_size : int
        Bytes to move (sequential jobs move the first ``io_size`` bytes; random ones ``io_size / bs`` distinct
        blocks of the region, each at most once).
    rw : str
        ``read``, ``write``, ``randread`` or ``randwrite``.
    bs : int
        Block size in bytes.
    iodepth : int
        Queue depth.
    seed : int
        ``--randseed``.
    offset : int
        Start of the region (``--offset``; 0 = the start of the file).
    more_files : tuple of str
        Further files the job moves bytes of, beside ``filename`` (fio splits ``size`` evenly between them all:
        give files of one size, ``size`` their total).
    directory : str
        The directory relative file names are in (``--directory``; "" = fio's working directory).
    """

    name: str
    filename: str
    size: int
    io_size: int
    rw: str
    bs: int
    iodepth: int
    seed: int = 1234
    offset: int = 0
    more_files: tuple[str, ...] = ()
    directory: str = ""

    @property
    def writes(self) -> bool:
        """Whether the job writes."""
        return "write" in self.rw


def find_fio(explicit: str | None = None) -> str:
    """Locate the fio executable.

    Parameters
    ----------
    explicit : str or None
        A path given by the user; else ``fio`` on ``PATH``.

    Returns
    -------
    str
        The executable's path.

    Raises
    ------
    BenchSetupError
        When fio is missing; the message says how to install it (the bench installs nothing itself).
    """
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise BenchSetupError(f"--fio {explicit}: not an executable file")
    exe = shutil.which("fio")
    if exe is None:
        raise BenchSetupError(f"fio is missing: it is the reference every engine case is compared with; {INSTALL_HINT}")
    return exe


def fio_version(exe: str) -> str:
    """``fio --version`` (e.g. ``fio-3.33``), or ``unknown``.

    Parameters
    ----------
    exe : str
        The fio executable.

    Returns
    -------
    str
        The version string.
    """
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.strip() or "unknown"


def fio_command(exe: str, job: FioJob) -> list[str]:
    """The command line that runs ``job`` with the fio executable ``exe``, ready for :func:`subprocess.run`."""
    filename = ":".join(f.replace(":", "\\:") for f in (job.filename, *job.more_files))  # fio's separator
    cmd = [
        exe, f"--name={job.name}", f"--filename={filename}", f"--size={job.size}", f"--io_size={job.io_size}",
        f"--rw={job.rw}", f"--bs={job.bs}", f"--iodepth={job.iodepth}", "--ioengine=io_uring", "--direct=1",
        "--numjobs=1", "--randrepeat=1", f"--randseed={job.seed}", "--norandommap=0", "--invalidate=1",
        "--allow_file_create=0", "--fallocate=none", "--output-format=json",
    ]
    if job.offset:
        cmd.insert(3, f"--offset={job.offset}")
    if job.directory:
        cmd.insert(2, "--directory=" + job.directory.replace(":", "\\:"))
    if job.writes:
        cmd.append("--end_fsync=1")
    return cmd


def _parse_json(text: str) -> dict[str, Any]:
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in fio's output")
    doc: dict[str, Any] = json.loads(text[start:])
    return doc


def run_fio(exe: str, job: FioJob) -> RunResult:
    """Run ``job`` once and measure it.

    Parameters
    ----------
    exe : str
        The fio executable.
    job : FioJob
        The job.

    Returns
    -------
    RunResult
        ``bytes`` and ``ops`` as fio reports them, ``seconds`` from fio's runtime (millisecond resolution,
        fsync included for writes), ``cpu_s`` from fio's job ``usr_cpu``/``sys_cpu`` over its runtime; ``extra``
        holds the CPU of the whole fio process (``wait4``: start-up and JSON output included) and fio's per-I/O
        completion latency percentiles ``clat_p50_ms``/``clat_p99_ms`` (``None`` where fio gives none). Its peak
        RSS is not reported: ``ru_maxrss`` of a spawned child includes the parent's resident memory at the time of
        spawn.

    Raises
    ------
    BenchSetupError
        When fio fails (the tail of its stderr is in the message).
    """
    cmd = fio_command(exe, job)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        stderr = err.read().decode("utf-8", "replace")
    if proc.returncode != 0:
        tail = "\n".join((stderr or stdout).strip().splitlines()[-8:])
        raise BenchSetupError(f"fio failed (exit {proc.returncode}) on {job.name}: {tail}\ncommand: {' '.join(cmd)}")
    try:
        jobdoc = _parse_json(stdout)["jobs"][0]
    except (ValueError, KeyError, IndexError) as exc:
        raise BenchSetupError(f"cannot read fio's JSON output for {job.name}: {exc}") from None
    if jobdoc.get("error"):
        raise BenchSetupError(f"fio reported error {jobdoc['error']} on {job.name}: {stderr.strip()[-500:]}")
    ddir = jobdoc["write" if job.writes else "read"]
    runtime_ms = float(ddir["runtime"])
    job_runtime_ms = float(jobdoc.get("job_runtime", runtime_ms))
    cpu_s = (float(jobdoc["usr_cpu"]) + float(jobdoc["sys_cpu"])) / 100.0 * job_runtime_ms / 1000.0
    pct = ddir.get("clat_ns", {}).get("percentile", {})
    p50, p99 = pct.get("50.000000"), pct.get("99.000000")
    return RunResult(
        bytes=int(ddir["io_bytes"]),
        ops=int(ddir["total_ios"]),
        seconds=max(runtime_ms, 0.5) / 1000.0,  # fio rounds to whole ms; a sub-ms run reads as 0
        cpu_s=cpu_s,
        extra={
            "fio_runtime_ms": runtime_ms,
            "fio_bw_bytes": ddir.get("bw_bytes"),
            "fio_iops": ddir.get("iops"),
            "short_ios": ddir.get("short_ios", 0),
            "process_cpu_s": usage.ru_utime + usage.ru_stime,
            "clat_p50_ms": None if p50 is None else float(p50) / 1e6,
            "clat_p99_ms": None if p99 is None else float(p99) / 1e6,
        },
    )


#: The largest request of a whole-file read: a bigger file is read in equal requests of at most this size
MAX_REQUEST = 16 << 20
_PAGE = 4096


def request_size(size: int, cap: int = MAX_REQUEST) -> int:
    """The O_DIRECT request size that reads a file of ``size`` bytes whole: the file in one request when it is at
    most ``cap``, else the largest multiple of 4 KiB that divides it and is at most ``cap``.

    Parameters
    ----------
    size : int
        The file's size. Only its first ``size - size % 4096`` bytes can be read with O_DIRECT.
    cap : int
        The largest request (a multiple of 4 KiB).

    Returns
    -------
    int
        The request size; 0 for a file under 4 KiB (O_DIRECT reads none of it).
    """
    aligned = size - size % _PAGE
    if aligned <= cap:
        return aligned
    pages = aligned // _PAGE
    k = -(-aligned // cap)
    while pages % k:  # ends at k == pages at the latest (4 KiB requests)
        k += 1
    return aligned // k


#: The longest value fio takes for an option (its parser refuses longer ones): a job's list of file names
FIO_MAX_VALUE = 4096


def whole_file_jobs(name: str, files: Sequence[tuple[str, int]], iodepth: int = 32,
                    directory: str = "") -> list[FioJob]:
    """fio jobs that read each of ``files`` whole, sequentially, with O_DIRECT: one job per file size (fio splits
    a job's bytes evenly between its files), in increasing size, each file's requests as in :func:`request_size`
    (a file's last bytes beyond a multiple of 4 KiB are left: O_DIRECT cannot read them). Files of one size whose
    names do not fit in one fio option (:data:`FIO_MAX_VALUE`) are split between several jobs.

    Parameters
    ----------
    name : str
        The jobs' name (each gets ``-<size>`` appended, and ``-<n>`` after the first of one size).
    files : sequence of (str, int)
        Each file's name (relative to ``directory`` when it is given) and size.
    iodepth : int
        Queue depth of every job.
    directory : str
        Every job's ``--directory``.

    Returns
    -------
    list of FioJob
        The jobs; files under 4 KiB have none (O_DIRECT reads none of them).

    Raises
    ------
    ValueError
        When one file's name alone is too long for fio.
    """
    by_size: dict[int, list[str]] = {}
    for path, size in files:
        by_size.setdefault(size - size % _PAGE, []).append(path)  # what O_DIRECT can read of it
    jobs = []
    for size in sorted(by_size):
        bs = request_size(size)
        if bs == 0:
            continue
        batches: list[list[str]] = []
        length = FIO_MAX_VALUE
        for path in by_size[size]:
            more = len(path.replace(":", "\\:")) + 1  # the name and fio's separator
            if more > FIO_MAX_VALUE:
                raise ValueError(f"a file name of {more - 1} characters is too long for fio: {path[:80]}...")
            if length + more > FIO_MAX_VALUE:
                batches.append([])
                length = 0
            batches[-1].append(path)
            length += more
        for n, batch in enumerate(batches):
            total = size * len(batch)
            jobs.append(FioJob(f"{name}-{size}" + (f"-{n}" if n else ""), batch[0], total, total, "read", bs,
                               iodepth, more_files=tuple(batch[1:]), directory=directory))
    return jobs


def read_files_cold(exe: str, paths: Sequence[str], name: str, iodepth: int = 32) -> RunResult:
    """Read ``paths`` whole with fio, cold: each file fsynced and dropped from the page cache first, then read with
    O_DIRECT and io_uring at queue depth ``iodepth`` (:func:`whole_file_jobs`, one fio run per file size, one
    after the other). fio opens them through symbolic links with short names in a temporary directory, so that
    a job names hundreds of files within fio's limit on an option's length.

    Parameters
    ----------
    exe : str
        The fio executable.
    paths : sequence of str
        The files.
    name : str
        fio's job name.
    iodepth : int
        Queue depth.

    Returns
    -------
    RunResult
        The runs added up: ``bytes``, ``ops``, ``seconds`` (fio's runtimes, each at least 0.5 ms: fio counts whole
        milliseconds), ``cpu_s``; ``extra``: ``files``, ``file_bytes`` (their sizes added up), ``unread_bytes``
        (the 4 KiB-unaligned tails O_DIRECT cannot read, files under 4 KiB included) and ``runs`` (each run's
        files, request size, bytes and seconds).

    Raises
    ------
    BenchSetupError
        When fio fails, or ``paths`` is empty.
    """
    if not paths:
        raise BenchSetupError(f"{name}: no files to read")
    sizes = [os.stat(p).st_size for p in paths]
    for p in paths:
        drop_cache(p)
    total = RunResult(bytes=0, ops=0, seconds=0.0, cpu_s=0.0)
    runs = []
    with tempfile.TemporaryDirectory(prefix="sfstore-bench-fio-") as links:
        for i, p in enumerate(paths):
            os.symlink(os.path.abspath(p), os.path.join(links, str(i)))
        for job in whole_file_jobs(name, [(str(i), s) for i, s in enumerate(sizes)], iodepth, directory=links):
            res = run_fio(exe, job)
            total.bytes += res.bytes
            total.ops += res.ops
            total.seconds += res.seconds
            total.cpu_s += res.cpu_s
            runs.append({"files": 1 + len(job.more_files), "bs": job.bs, "bytes": res.bytes,
                         "seconds": res.seconds})
    file_bytes = sum(sizes)
    total.extra = {"files": len(paths), "file_bytes": file_bytes, "unread_bytes": file_bytes - total.bytes,
                   "runs": runs}
    return total
