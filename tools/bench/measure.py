"""What one timed run measures and how a side's runs and a case's pairs are summarized (``BENCHMARKING.md``
rules 4 and 6): :class:`RunResult`, the meters (:class:`CpuMeter`, :class:`PeakRss`, both with the wall time in
:class:`Meters`), the medians of a side (:func:`side_summary`) and the pairwise ratios (:func:`summarize_pairs`).
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tools.bench.common import GIB

__all__ = ["RunResult", "CpuMeter", "PeakRss", "Meters", "side_summary", "median_extras", "summarize_pairs",
           "percentile", "batch_latency"]


@dataclass
class RunResult:
    """One timed run of one side of a pair.

    Attributes
    ----------
    bytes : int
        Bytes moved inside the timed region.
    ops : int
        Requests (I/O operations) completed.
    seconds : float
        Length of the timed region.
    cpu_s : float
        CPU seconds (user + system) spent by the side inside the timed region.
    extra : dict
        Anything else worth keeping per run (JSON-serializable).
    """

    bytes: int
    ops: int
    seconds: float
    cpu_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_per_s(self) -> float:
        """Throughput in bytes per second."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def iops(self) -> float:
        """Operations per second."""
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_s_per_gib(self) -> float:
        """CPU seconds per GiB moved."""
        return self.cpu_s / (self.bytes / GIB) if self.bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The run as a JSON-ready dictionary."""
        return {"bytes": self.bytes, "ops": self.ops, "seconds": self.seconds, "cpu_s": self.cpu_s,
                "bytes_per_s": self.bytes_per_s, "iops": self.iops, "cpu_s_per_gib": self.cpu_s_per_gib,
                **self.extra}


class CpuMeter:
    """CPU seconds (user + system) of this whole process, every thread included, between start and stop.

    The benchmark process does nothing else while a side runs, so this counts the thread that submits and
    every engine thread (native or Python) that does the work.
    """

    def __init__(self) -> None:
        self._start = 0.0
        self.seconds = 0.0

    @staticmethod
    def _now() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def start(self) -> None:
        """Begin measuring."""
        self._start = self._now()

    def stop(self) -> float:
        """Stop measuring.

        Returns
        -------
        float
            CPU seconds since :meth:`start`.
        """
        self.seconds = self._now() - self._start
        return self.seconds


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakRss:
    """Peak resident-set growth of this process over a region.

    Resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) at :meth:`start`, so the growth of
    each region is seen even when an earlier region peaked higher; falls back to ``ru_maxrss`` (growth of the
    lifetime peak only) where that file cannot be written.
    """

    def __init__(self) -> None:
        self._base = 0
        self._resettable = False
        self.method = "none"

    def start(self) -> None:
        """Record the resident set now and reset the peak."""
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self._resettable = True
        except OSError:
            self._resettable = False
        rss = _status_kib("VmRSS") if self._resettable else None
        if rss is not None:
            self._base = rss * 1024
            self.method = "VmHWM after clear_refs"
        else:
            self._resettable = False
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self.method = "ru_maxrss"

    def growth(self) -> int:
        """Bytes the resident set peaked above its size at :meth:`start` (never negative).

        Returns
        -------
        int
            Peak growth in bytes.
        """
        if self._resettable:
            hwm = _status_kib("VmHWM")
            if hwm is not None:
                return max(0, hwm * 1024 - self._base)
        return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._base)


class Meters:
    """The meters of one timed region, started together when made: peak RSS growth (:class:`PeakRss`), CPU of the
    whole process (:class:`CpuMeter`) and wall time; :meth:`stop` reads them into ``seconds``, ``cpu_s`` and
    ``rss_growth``."""

    def __init__(self) -> None:
        self._rss = PeakRss()
        self._cpu = CpuMeter()
        self._rss.start()
        self._cpu.start()
        self._t0 = time.perf_counter()
        self.seconds = 0.0
        self.cpu_s = 0.0
        self.rss_growth = 0

    @property
    def rss_method(self) -> str:
        """How the peak RSS is measured (:attr:`PeakRss.method`)."""
        return self._rss.method

    def elapsed(self) -> float:
        """Wall seconds since the start (the meters go on)."""
        return time.perf_counter() - self._t0

    def stop(self) -> Meters:
        """Stop: wall time first, then CPU, then the peak RSS growth.

        Returns
        -------
        Meters
            Itself.
        """
        self.seconds = self.elapsed()
        self.cpu_s = self._cpu.stop()
        self.rss_growth = self._rss.growth()
        return self


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def side_summary(runs: Sequence[RunResult], peak_rss_growth_bytes: int | None = None) -> dict[str, Any]:
    """Summarize the repeated runs of one side: medians, spread, bytes per run and every run.

    Parameters
    ----------
    runs : sequence of RunResult
        The runs of this side, in order.
    peak_rss_growth_bytes : int or None
        Peak RSS growth measured for this side over the case.

    Returns
    -------
    dict
        ``bytes_per_s``, ``iops`` and ``cpu_s_per_gib`` (medians) plus ``bytes_per_s_min``/``_max``,
        ``bytes`` (per run), ``seconds`` (median), ``peak_rss_growth_bytes`` and ``runs``.
    """
    bps = [r.bytes_per_s for r in runs]
    moved = sorted({r.bytes for r in runs})
    return {
        "bytes_per_s": _median(bps),
        "iops": _median([r.iops for r in runs]),
        "cpu_s_per_gib": _median([r.cpu_s_per_gib for r in runs]),
        "bytes_per_s_min": min(bps) if bps else 0.0,
        "bytes_per_s_max": max(bps) if bps else 0.0,
        "bytes": moved[0] if len(moved) == 1 else moved,
        "seconds": _median([r.seconds for r in runs]),
        "peak_rss_growth_bytes": peak_rss_growth_bytes,
        "runs": [r.as_dict() for r in runs],
    }


def median_extras(runs: Sequence[RunResult], keys: Iterable[str]) -> dict[str, float]:
    """The median over ``runs`` of each of ``keys`` of their ``extra`` (a side's per-run latencies, flush times).

    Parameters
    ----------
    runs : sequence of RunResult
        One side's runs.
    keys : iterable of str
        Keys of :attr:`RunResult.extra`.

    Returns
    -------
    dict
        Key to median, for the keys some run has (not None).
    """
    out: dict[str, float] = {}
    for key in keys:
        values = [float(r.extra[key]) for r in runs if r.extra.get(key) is not None]
        if values:
            out[key] = float(statistics.median(values))
    return out


def summarize_pairs(ours: Sequence[RunResult], reference: Sequence[RunResult]) -> dict[str, Any]:
    """The ratio statistics of interleaved pairs: median of the pairwise ratios ours/reference, min and max.

    Parameters
    ----------
    ours, reference : sequence of RunResult
        Runs of each side; pair *i* is ``(ours[i], reference[i])``.

    Returns
    -------
    dict
        ``ratio`` (median of pairwise throughput ratios), ``ratio_min``, ``ratio_max``, ``ratios`` (each pair)
        and ``ratio_of_medians``.
    """
    ratios = [a.bytes_per_s / b.bytes_per_s for a, b in zip(ours, reference, strict=True) if b.bytes_per_s > 0]
    med_ref = _median([r.bytes_per_s for r in reference])
    return {
        "ratio": _median(ratios) if ratios else None,
        "ratio_min": min(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "ratios": ratios,
        "ratio_of_medians": _median([r.bytes_per_s for r in ours]) / med_ref if med_ref > 0 else None,
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank, ``None`` for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def batch_latency(batch_s: Sequence[float]) -> dict[str, Any]:
    """Per-batch latency of one run: ``batches``, ``batch_p50_ms``, ``batch_p99_ms``, ``batch_mean_ms``."""
    return {"batches": len(batch_s), "batch_p50_ms": 1e3 * (percentile(batch_s, 0.5) or 0.0),
            "batch_p99_ms": 1e3 * (percentile(batch_s, 0.99) or 0.0),
            "batch_mean_ms": 1e3 * statistics.fmean(batch_s) if batch_s else 0.0}
