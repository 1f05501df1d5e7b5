"""Suite ``gpu``: GPU memory to storage and back through sfstore's device path and KV cache, against what code
without sfstore does, in one run.

``python -m tools.bench gpu [--blocks 512] [--block-size 2m] [--device cuda|cpu] [--repeat N] [--json PATH]``

Every case moves ``--blocks`` blocks of ``--block-size`` (default 512 x 2 MiB = 1 GiB) of random bytes between
GPU memory (torch CUDA tensors or cupy arrays) and a file in ``--dir``: a put is durable (fsync inside the timed
region), a get reads storage (page cache dropped first) into zeroed GPU memory and must come back bit-exact (a
wrong answer stops the suite: it has no speed). ``--warmup`` pairs (default 1, kept apart), then ``--repeat``
pairs in ABBA order, sfstore's side against the reference:

* the reference, ``baseline``: block by block, ``t.cpu()`` (cupy ``.get()``) + ``os.pwrite``, one ``fsync``;
  ``np.fromfile`` + ``.cuda()`` (cupy ``.set()``): what code without sfstore does;
* ``put-/get-<lib>-<mode>``, lib ``torch`` or ``cupy``, mode ``gds`` (kvikio/cuFile GPU-direct, the arrays
  registered), ``compat`` (kvikio's compat mode, forced where gds is there) or ``staged`` (sfstore's pinned
  staging buffers and I/O engine): ``DevicePath(mode=...)``, every block's transfer submitted at once into a
  preallocated slab;
* ``put-/get-kv-block``: ``KVCacheStore`` with its pinned tier over a ``BlockStore`` image (bfloat16 KV blocks of
  16 tokens x 8 heads x 128 dims per layer, as many layers as fit): a put is copied into pinned slots, written
  through, waited for and flushed; a get after evicting the pinned tier reads the block tier;
* ``put-/get-kv-shared``: the pinned tier off: CUDA blocks to the shared tier's chunk files (fsynced) and back on
  the device path's route (``describe()``'s, in the case's params);
* ``put-/get-kv-shared-pinned``: the same with the pinned tier on: blocks copied through pinned slots;
* ``layers-overlap``: per-layer loads from the pinned tier behind a stand-in compute (one calibrated kernel per
  layer) against the same loads and compute one after the other; goal: the overlap hides >= 70% of the load time
  (CUDA only). See :mod:`tools.bench.suites.gpu.overlap`.

A case whose side cannot run here (no GPU-direct storage, no kvikio, no cupy) is skipped, saying why (the JSON's
``skipped``). ``--device cpu`` runs what CPU torch tensors can (``staged``, ``kv-block``, ``kv-shared-pinned``,
``layers-overlap`` without streams): it exercises the suite where no GPU is; its numbers say nothing about GPUs.
``tools/gpu_check.py`` runs this suite on a GPU machine, beside the tests marked ``gpu``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tools.bench import pairs
from tools.bench.common import BenchSetupError, Table, bench_dir, check_space, format_size, machine_info, utc_now, warn
from tools.bench.measure import RunResult, side_summary, summarize_pairs
from tools.bench.options import nonneg_int, parse_size, positive_int
from tools.bench.pairs import run_pairs, warn_if_few_pairs
from tools.bench.pairs import select_cases as select_from
from tools.bench.registry import Suite, register
from tools.bench.suites.gpu.arrays import Lib, make_lib
from tools.bench.suites.gpu.overlap import HIDDEN_GOAL, Overlap, hidden_fraction
from tools.bench.suites.gpu.sides import BaselineSide, Blocks, DevicePathSide, KvBlockSide, KvSharedSide, Side

__all__ = ["Case", "ROUTES", "all_cases", "select_cases", "run", "QUICK_CASES"]

#: route -> (library, what builds sfstore's side)
ROUTES: dict[str, tuple[str, Callable[[Blocks, str], Side] | None]] = {
    "torch-staged": ("torch", lambda b, d: DevicePathSide(b, d, "staged")),
    "torch-compat": ("torch", lambda b, d: DevicePathSide(b, d, "compat")),
    "torch-gds": ("torch", lambda b, d: DevicePathSide(b, d, "gds")),
    "kv-block": ("torch", KvBlockSide),
    "kv-shared": ("torch", lambda b, d: KvSharedSide(b, d, pinned=False)),
    "kv-shared-pinned": ("torch", lambda b, d: KvSharedSide(b, d, pinned=True)),
    "cupy-staged": ("cupy", lambda b, d: DevicePathSide(b, d, "staged")),
    "cupy-compat": ("cupy", lambda b, d: DevicePathSide(b, d, "compat")),
    "cupy-gds": ("cupy", lambda b, d: DevicePathSide(b, d, "gds")),
    "layers": ("torch", None),  # the overlap case: its own two sides
}
QUICK_CASES = ("put-torch-staged", "get-torch-staged", "put-kv-shared", "get-kv-shared", "layers-overlap")


@dataclass(frozen=True)
class Case(pairs.Case):
    """``op`` (``put``, ``get`` or ``overlap``) of one route."""

    op: str
    route: str

    @property
    def name(self) -> str:
        return f"{self.route}-overlap" if self.op == "overlap" else f"{self.op}-{self.route}"


def all_cases() -> list[Case]:
    """Every case: put then get of each route, then ``layers-overlap``."""
    return [Case(op, r) for r in ROUTES if r != "layers" for op in ("put", "get")] + [Case("overlap", "layers")]


def select_cases(patterns: Sequence[str] | None = None, quick: bool = False) -> list[Case]:
    """The cases to run (``--cases`` globs, ``--quick``), in :func:`all_cases` order."""
    return select_from("gpu", all_cases(), patterns, QUICK_CASES, quick)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gpu suite's options."""
    parser.epilog = ("cases: " + ", ".join(c.name for c in all_cases()) + ". --quick runs "
                     + ", ".join(QUICK_CASES) + ".")
    g = parser.add_argument_group("gpu suite")
    g.add_argument("--blocks", type=positive_int, default=512, metavar="N", help="blocks per run (default 512)")
    g.add_argument("--block-size", type=parse_size, default=2 << 20, metavar="SIZE",
                   help="bytes per block (default 2m; a multiple of 64k for the KV cases, of 64k x 32 for "
                        "layers-overlap)")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: CPU torch tensors (exercises the suite without a GPU; its numbers say nothing of GPUs)")
    g.add_argument("--warmup", type=nonneg_int, default=1, metavar="N",
                   help="warm-up pairs per case, left out of the figures (default 1)")


class _Libs:
    """Each library's blocks and baseline side, made when a route first needs them (or why they cannot be)."""

    def __init__(self, args: argparse.Namespace, directory: str) -> None:
        self.args, self.directory = args, directory
        self._made: dict[str, tuple[Blocks, BaselineSide] | str] = {}

    def get(self, name: str) -> tuple[Blocks, BaselineSide]:
        got = self._made.get(name)
        if got is None:
            try:
                lib: Lib = make_lib(name, self.args.device)
                blocks = Blocks(lib, self.args.blocks, self.args.block_size)
                got = (blocks, BaselineSide(blocks, os.path.join(self.directory, f"{name}-baseline")))
            except BenchSetupError as exc:
                got = str(exc)
            self._made[name] = got
        if isinstance(got, str):
            raise BenchSetupError(got)
        return got

    def close(self) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        for name, got in self._made.items():
            if not isinstance(got, str):
                got[1].close()
                facts[name] = got[1].facts
                got[0].release()
        return facts


def _pair_doc(case: Case, ours: list[RunResult], theirs: list[RunResult], params: dict[str, Any]) -> dict[str, Any]:
    return {"name": case.name, "params": params, "sfstore": side_summary(ours), "reference_tool": "baseline",
            "reference": side_summary(theirs), **summarize_pairs(ours, theirs)}


def _run_route(route: str, cases: list[Case], libs: _Libs, args: argparse.Namespace, directory: str,
               out: list[dict[str, Any]], skipped: list[dict[str, str]], table: Table) -> None:
    libname, make = ROUTES[route]
    try:
        blocks, baseline = libs.get(libname)
        side: Side | Overlap = Overlap(blocks) if make is None else make(blocks, os.path.join(directory, route))
    except BenchSetupError as exc:
        for case in cases:
            skipped.append({"case": case.name, "reason": str(exc)})
            warn(f"{case.name}: skipped: {exc}")
        return
    params = {"lib": libname, "device": args.device, "blocks": args.blocks, "block_size": args.block_size,
              "bytes": args.blocks * args.block_size, "repeat": args.repeat, "warmup": args.warmup,
              "put": "fsync inside the timed region", "get": "page cache dropped first; checked bit-exact"}
    docs: list[dict[str, Any]] = []
    try:
        for case in cases:
            if isinstance(side, Overlap):
                ours_s, theirs_s = run_pairs(lambda _p: side.overlapped(), lambda _p: side.sequential(),
                                             repeat=args.repeat, warmup=args.warmup)
                doc = _pair_doc(case, ours_s.runs, theirs_s.runs, dict(params, compute=side.compute,
                                                                       geometry=str(side.geom)))
                doc["reference_tool"] = "loads, then compute"
                doc.update(_hidden(ours_s.runs, theirs_s.runs, side.cuda))
            else:
                ours_s, theirs_s = run_pairs(_op(side, case.op), _op(baseline, case.op), repeat=args.repeat,
                                             warmup=args.warmup)
                doc = _pair_doc(case, ours_s.runs, theirs_s.runs, params)
            docs.append(doc)
            out.append(doc)
            print(table.row(doc), flush=True)
    finally:
        side.close()
    facts = side.facts if isinstance(side, Side) else {"misses": side.misses}
    for doc in docs:
        doc["params"] = dict(doc["params"], side=facts)


def _op(side: Side, op: str) -> Callable[[int], RunResult]:
    """A pair's run of ``side``: its put or its get."""
    fn = side.put if op == "put" else side.get
    return lambda _pair: fn()


def _hidden(overlapped: list[RunResult], sequential: list[RunResult], cuda: bool) -> dict[str, Any]:
    """The overlap case's share of load time hidden (from the medians) and its goal."""
    t_both = statistics.median(r.seconds for r in overlapped)
    t_load = statistics.median(r.extra["t_load_s"] for r in sequential)
    t_compute = statistics.median(r.extra["t_compute_s"] for r in sequential)
    hidden = hidden_fraction(t_both, t_load, t_compute)
    return {"t_load_s": t_load, "t_compute_s": t_compute, "t_overlapped_s": t_both, "hidden_fraction": hidden,
            "goal_met": (hidden >= HIDDEN_GOAL) if cuda else None}


def _acceptance(results: list[dict[str, Any]], cuda: bool) -> list[dict[str, Any]]:
    what = f"per-layer loads hide >= {HIDDEN_GOAL:.0%} of their time behind the compute"
    case = next((c for c in results if c["name"] == "layers-overlap"), None)
    entry: dict[str, Any] = {"goal": what, "case": "layers-overlap", "target": HIDDEN_GOAL}
    if case is None:
        entry.update(status="not run", met=None, line=f"goal: {what}: not run (not selected: --cases / --quick)")
    elif not cuda:
        entry.update(status="n/a", met=None, reason="--device cpu: no streams, nothing overlaps",
                     line=f"goal: {what}: n/a (--device cpu: no streams, nothing overlaps)")
    else:
        h = case["hidden_fraction"]
        met = h >= HIDDEN_GOAL
        entry.update(status="met" if met else "missed", met=met, hidden_fraction=h,
                     line=f"goal: {what}: {'PASS' if met else 'MISS'}, {h:.0%} hidden (loads "
                          f"{case['t_load_s'] * 1e3:.1f} ms, compute {case['t_compute_s'] * 1e3:.1f} ms, "
                          f"overlapped {case['t_overlapped_s'] * 1e3:.1f} ms)")
    return [entry]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the gpu suite; its JSON document (``cases``, ``skipped``, ``acceptance``)."""
    cases = select_cases(args.cases, args.quick)
    if args.block_size % 4096:
        raise BenchSetupError(f"--block-size {args.block_size}: a multiple of 4k (O_DIRECT works in whole sectors)")
    directory, mount = bench_dir(args.dir, "gpu")
    libs_used = {ROUTES[c.route][0] for c in cases}
    check_space(directory, 4 * args.blocks * args.block_size * len(libs_used), "the gpu suite's files",
                "use --blocks, --block-size or --dir")
    warn_if_few_pairs(args.repeat)
    machine = machine_info(directory)
    machine["gpu_environment"] = environment()
    fs = f"{mount.fstype} on {mount.source}" if mount else "unknown filesystem"
    print(f"gpu suite: {args.blocks} x {format_size(args.block_size)} per run on {args.device}, {directory} ({fs}), "
          f"{args.warmup} warm-up + {args.repeat} pair(s) per case", flush=True)
    table = Table("baseline", use_iops=lambda _c: False, name_width=24)
    print(table.header(), flush=True)
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    libs = _Libs(args, directory)
    try:
        for route in ROUTES:
            chosen = [c for c in cases if c.route == route]
            if chosen:
                _run_route(route, chosen, libs, args, directory, results, skipped, table)
    finally:
        machine["baselines"] = libs.close()
    acceptance = _acceptance(results, args.device == "cuda")
    for goal in acceptance:
        if goal["status"] != "not run":
            print(goal["line"], flush=True)
    if not results:
        raise BenchSetupError("no case could run here: " + "; ".join(f"{s['case']}: {s['reason']}" for s in skipped))
    return {"bench": "gpu", "machine": machine, "date": utc_now(), "cases": results, "skipped": skipped,
            "acceptance": acceptance}


def environment() -> dict[str, Any]:
    """torch, cupy and kvikio versions, the GPU, the device path's mode and the I/O engine (facts for the JSON)."""
    import importlib

    from tools.bench.suites.gpu.arrays import kvikio_setting

    def torch_env() -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                               "cuda_available": torch.cuda.is_available()}
        if out["cuda_available"]:
            out["gpu"] = torch.cuda.get_device_name(0)
        return out

    def kvikio_env() -> dict[str, Any]:
        kvikio = importlib.import_module("kvikio")
        return {"version": getattr(kvikio, "__version__", "?"), "compat_mode": kvikio_setting(kvikio, "compat_mode"),
                "num_threads": kvikio_setting(kvikio, "num_threads")}

    env: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("engine", lambda: repr(importlib.import_module("sfstore.engine").get_engine())),
        ("native_helper", lambda: list(importlib.import_module("sfstore.buffers").native_available())),
        ("device_mode", lambda: list(importlib.import_module("sfstore.paths.device").device_mode())),
        ("torch", torch_env),
        ("cupy", lambda: getattr(importlib.import_module("cupy"), "__version__", "?")),
        ("kvikio", kvikio_env),
    ]
    for key, fn in steps:
        try:
            env[key] = fn()
        except Exception as exc:  # facts for the JSON only
            env[key] = f"unavailable ({type(exc).__name__}: {exc})"
    return env


register(Suite(name="gpu", help="GPU memory to storage and back: sfstore's device path and KV cache vs t.cpu() + "
                                "pwrite / np.fromfile + .cuda()", add_arguments=add_arguments, run=run))
