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
from dataclasses import dataclass
from typing import Any

from tools.bench.common import BenchSetupError
from tools.bench.measure import RunResult

__all__ = ["FioJob", "find_fio", "fio_version", "fio_command", "run_fio", "PEAK_RSS_NOTE"]

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
    filename = job.filename.replace(":", "\\:")  # fio separates several files with ':'
    cmd = [
        exe, f"--name={job.name}", f"--filename={filename}", f"--size={job.size}", f"--io_size={job.io_size}",
        f"--rw={job.rw}", f"--bs={job.bs}", f"--iodepth={job.iodepth}", "--ioengine=io_uring", "--direct=1",
        "--numjobs=1", "--randrepeat=1", f"--randseed={job.seed}", "--norandommap=0", "--invalidate=1",
        "--allow_file_create=0", "--fallocate=none", "--output-format=json",
    ]
    if job.offset:
        cmd.insert(3, f"--offset={job.offset}")
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
