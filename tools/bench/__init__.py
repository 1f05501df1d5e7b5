"""sfstore benchmarks: ``python -m tools.bench SUITE [--json PATH] [options]`` from the project root.

Every suite runs sfstore and a reference tool on the same data with the same parameters in one run, by the rules
of ``BENCHMARKING.md`` (same durability and residency, cold cache, interleaved pairs, CPU and RSS reported), prints
a table and writes the common JSON shape::

    {"bench": "engine", "machine": {...}, "date": "...",
     "cases": [{"name": "read-1m-qd32", "params": {...},
                "sfstore": {"bytes_per_s": ..., "iops": ..., "cpu_s_per_gib": ...},
                "reference_tool": "fio", "reference": {...same keys...}, "ratio": ...}]}

Suites live in :mod:`tools.bench.suites` (one module each, registering itself); ``all`` runs every one.
``python -m tools.bench --help`` lists them.
"""

from tools.bench.registry import Suite, all_suites, register

__all__ = ["Suite", "all_suites", "register"]
