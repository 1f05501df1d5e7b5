"""Suite ``checkpoint``: sfstore's checkpoint save/load against torch.save, safetensors, DCP and fio, in one run.

``python -m tools.bench checkpoint [--size 2g] [--repeat N] [--max-shard SIZE] [--json PATH]``

The state dict is LLM-like and all bf16 (``--size`` of tensor bytes, about): token embedding and LM head (the few
huge tensors), per layer q/k/v/o projections with q/k/v biases, gate/up/down MLP projections and two norms (many
medium and small ones), a final norm; random bits from a seeded generator. It is built once per run and stays
resident; its tensors' ``xxh3_64`` are the expected result of every load.

Cases (``<size>`` spelt like ``2g``), each ``--repeat`` interleaved pairs (sfstore side, reference side, ...):

* ``save-<size>-vs-torch.save`` / ``-vs-safetensors`` / ``-vs-dcp`` / ``-vs-fio``: ``sfstore.checkpoint.save``
  against ``torch.save`` into one file, ``safetensors.torch.save_file``, DCP's ``FileSystemWriter``
  (``sync_files=True``, its defaults otherwise: one thread, one file) and fio's sequential O_DIRECT io_uring
  write of a file of about the same size (block size = sfstore's ``FilePath.chunk_size``, queue depth = its
  ``parallelism``, ``--end_fsync=1``).
* ``save_async-blocking-<size>``: ``sfstore.checkpoint.save_async`` (its time until it returns: what the caller
  is blocked for) against a synchronous ``save``; each run also records when ``.get()`` completed.
* ``dcp-save-<size>-vs-dcp``: DCP with sfstore's ``StorageWriter`` against DCP with ``FileSystemWriter``.
* ``load-<size>-vs-torch.load`` / ``-vs-safetensors`` / ``-vs-dcp`` / ``-vs-fio``: ``sfstore.checkpoint.load``
  against ``torch.load(weights_only=True)``, ``safetensors.torch.load_file``, DCP's ``FileSystemReader`` into a
  freshly allocated state dict, and fio's sequential read of the same file fio wrote.
* ``dcp-load-<size>-vs-dcp``: DCP with sfstore's ``StorageReader`` against ``FileSystemReader``.

Rules (``BENCHMARKING.md``): every writer fsyncs inside its timed region (``torch.save`` and safetensors: an
explicit ``fsync`` of the file; DCP: ``sync_files=True``; sfstore fsyncs itself); every loader's result is made
resident inside its timed region by the same touch for every side -- ``xxh3_64`` over every tensor's bytes (which
is also checked against the state dict, so a side that skipped work fails); before every load every file of that
checkpoint is fsynced and dropped from the page cache (``POSIX_FADV_DONTNEED``), before every save the previous
output is deleted and ``sync()`` runs (both outside the timed region). Throughput is the state dict's tensor bytes
over the timed region (fio: its own bytes). CPU is ``getrusage`` of the whole process over the run (for
``save_async``: until ``.get()`` completes); peak RSS growth is the kernel's high-water mark over the run (reset
first) above the resident set before it, with torch imported and the state dict resident.

When ``sfstore.checkpoint`` (``save``/``save_async``/``load``) is not there yet, its sides say "not built yet" and
the references still run. Acceptance lines (issue 5) are printed after the table and kept in the JSON
(``acceptance``): save >= 2x torch.save and >= 1.3x safetensors, load >= 2x torch.load and >= 1.2x safetensors,
both >= 0.8x fio, ``save_async`` blocking <= 15% of a sync save, load peak RSS growth <= 1.15x the tensor bytes,
sync save peak RSS growth <= 2 x max_shard_bytes + 64 MiB.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tools.bench import pairs
from tools.bench.common import (
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
    machine_info,
    utc_now,
    warn,
)
from tools.bench.fio import PEAK_RSS_NOTE, FioJob, find_fio, fio_command, fio_version, run_fio
from tools.bench.measure import Meters, RunResult, side_summary, summarize_pairs
from tools.bench.options import add_fio, add_warmup, parse_size
from tools.bench.pairs import SideFailed, run_pairs, warn_if_few_pairs
from tools.bench.pairs import select_cases as select_from
from tools.bench.registry import Suite, register
from tools.bench.suites.engine import prepare_file

__all__ = ["CaseSpec", "all_cases", "select_cases", "llm_layout", "evaluate_goals", "run", "QUICK_CASES"]

NOT_BUILT = "not built yet"
#: Default ``max_shard_bytes`` of ``sfstore.checkpoint.save`` when the settings do not say (design: 1 GiB).
DEFAULT_SHARD_BYTES = 1 << 30


@dataclass(frozen=True)
class CaseSpec(pairs.Case):
    """One pair of sides.

    Attributes
    ----------
    stem : str
        Case name with ``{size}`` for the size label.
    op : str
        ``save`` or ``load``.
    ours : str
        sfstore side: ``save``, ``save_async``, ``load``, ``dcp-save``, ``dcp-load``.
    reference : str
        Reference side: ``torch.save``, ``torch.load``, ``safetensors``, ``dcp``, ``fio``, ``sfstore.save``.
    """

    stem: str
    op: str
    ours: str
    reference: str

    def name(self, label: str) -> str:
        """The case name for the size label ``label`` (``2g``)."""
        return self.stem.format(size=label)


_CASES = (
    CaseSpec("save-{size}-vs-torch.save", "save", "save", "torch.save"),
    CaseSpec("save-{size}-vs-safetensors", "save", "save", "safetensors"),
    CaseSpec("save-{size}-vs-dcp", "save", "save", "dcp"),
    CaseSpec("save-{size}-vs-fio", "save", "save", "fio"),
    CaseSpec("save_async-blocking-{size}", "save", "save_async", "sfstore.save"),
    CaseSpec("dcp-save-{size}-vs-dcp", "save", "dcp-save", "dcp"),
    CaseSpec("load-{size}-vs-torch.load", "load", "load", "torch.load"),
    CaseSpec("load-{size}-vs-safetensors", "load", "load", "safetensors"),
    CaseSpec("load-{size}-vs-dcp", "load", "load", "dcp"),
    CaseSpec("load-{size}-vs-fio", "load", "load", "fio"),
    CaseSpec("dcp-load-{size}-vs-dcp", "load", "dcp-load", "dcp"),
)
#: ``--quick``: every ratio of the acceptance list (the DCP cases are left out).
QUICK_CASES = ("save-{size}-vs-torch.save", "save-{size}-vs-safetensors", "save-{size}-vs-fio",
               "save_async-blocking-{size}", "load-{size}-vs-torch.load", "load-{size}-vs-safetensors",
               "load-{size}-vs-fio")


def all_cases() -> list[CaseSpec]:
    """Every case, saves first (loads reuse what the saves wrote).

    Returns
    -------
    list of CaseSpec
        The cases in run order.
    """
    return list(_CASES)


def select_cases(label: str, patterns: Sequence[str] | None = None, quick: bool = False) -> list[CaseSpec]:
    """The cases to run.

    Parameters
    ----------
    label : str
        Size label used in the names (``2g``).
    patterns : sequence of str or None
        Shell globs (comma-separated items allowed); a case runs when its name matches one.
    quick : bool
        Keep only :data:`QUICK_CASES`.

    Returns
    -------
    list of CaseSpec
        The selection in run order.

    Raises
    ------
    BenchSetupError
        When nothing matches.
    """
    return select_from("checkpoint", all_cases(), patterns, QUICK_CASES, quick, name=lambda c: c.name(label),
                       quick_key=lambda c: c.stem)


# ---------------------------------------------------------------------------------------------------------------
# The state dict


def llm_layout(size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of an LLM-like bf16 state dict of about ``size`` tensor bytes.

    Hidden size ``d`` (a power of two) is chosen so that the embedding is about 1/16 of ``size``; vocabulary
    ``16 d``, MLP width ``2.6875 d`` (rounded to 64); as many layers as fit.

    Parameters
    ----------
    size : int
        Target tensor bytes (at least 1 MiB).

    Returns
    -------
    list of (str, tuple of int)
        ``(name, shape)`` in state-dict order.
    """
    d = max(64, 2 ** round(math.log2(math.sqrt(size / 512))))
    vocab = 16 * d
    mlp = max(64, round(2.6875 * d / 64) * 64)
    layer = 4 * d * d + 3 * d + 3 * d * mlp + 2 * d
    layers = max(1, (size // 2 - 2 * vocab * d - d) // layer)
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (d, d)),
            (p + "self_attn.q_proj.bias", (d,)),
            (p + "self_attn.k_proj.weight", (d, d)),
            (p + "self_attn.k_proj.bias", (d,)),
            (p + "self_attn.v_proj.weight", (d, d)),
            (p + "self_attn.v_proj.bias", (d,)),
            (p + "self_attn.o_proj.weight", (d, d)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (mlp, d)),
            (p + "mlp.up_proj.weight", (mlp, d)),
            (p + "mlp.down_proj.weight", (d, mlp)),
        ]
    out += [("model.norm.weight", (d,)), ("lm_head.weight", (vocab, d))]
    return out


def _build_state_dict(size: int, seed: int) -> tuple[dict[str, Any], dict[str, int], int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {}
    digests: dict[str, int] = {}
    total = 0
    for name, shape in llm_layout(size):
        t = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
        sd[name] = t
        digests[name] = _digest(t)
        total += t.numel() * t.element_size()
    return sd, digests, total


def _digest(t: Any) -> int:
    import xxhash

    from sfstore.buffers import as_buffer

    return int(xxhash.xxh3_64_intdigest(as_buffer(t))) if t.numel() else 0


def _touch(result: Any, digests: dict[str, int], side: str) -> None:
    """The residency rule: ``xxh3_64`` of every tensor's bytes; a mismatch means the side did not load the data."""
    flat = result if isinstance(result, dict) else {}
    if set(flat) != set(digests):
        missing = sorted(set(digests) - set(flat))[:3]
        raise BenchSetupError(f"{side}: the loaded state dict lacks {missing} (or has other keys)")
    for name, want in digests.items():
        if _digest(flat[name]) != want:
            raise BenchSetupError(f"{side}: {name} came back with different bytes")


# ---------------------------------------------------------------------------------------------------------------
# Sides


class _NotBuilt(SideFailed):
    """The side needs something that is not there yet (message: what); the case reports it as the side's status."""


@dataclass
class _Context:
    args: argparse.Namespace
    work: str
    sd: dict[str, Any]
    digests: dict[str, int]
    tensor_bytes: int
    chunk_size: int
    parallelism: int
    fio: str | None
    fio_file: str | None
    fio_size: int
    max_shard: int | None
    core: Any  # sfstore.checkpoint, or None
    core_reason: str
    dcp_mod: Any  # sfstore.checkpoint.dcp, or None
    dcp_reason: str

    def out(self, tool: str) -> str:
        names = {"save": "sfstore-ckpt", "torch": "torch-state.pt", "safetensors": "model.safetensors",
                 "dcp": "dcp-ckpt", "sfdcp": "sfstore-dcp-ckpt"}
        return os.path.join(self.work, names[tool])


def _files_of(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for base, _dirs, files in os.walk(path):
        out += [os.path.join(base, f) for f in files]
    return out


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    parent = os.path.dirname(path)
    name = os.path.basename(path)
    for entry in os.listdir(parent):  # staging leftovers of sfstore saves
        if entry.startswith(f".{name}.sfstore-"):
            _remove(os.path.join(parent, entry))


_libc: Any = None


def _settle() -> None:
    """Collect garbage and hand free heap pages back to the kernel (``malloc_trim``), so that memory a side
    reuses from an earlier run counts as growth again instead of hiding in the allocator's free lists."""
    global _libc
    gc.collect()
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None)
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _kept(ctx: _Context, kind: str) -> int:
    """Bytes of host buffers sfstore kept idle from earlier runs for a run of ``kind`` (``save``, ``save_async``,
    ``load``; ``sfstore.checkpoint.buffer_stats``): resident before the run starts, so its peak RSS growth would
    not show them, though the run uses them. Each sfstore side adds them to its growth."""
    stats = getattr(ctx.core, "buffer_stats", None)
    return int(stats()[f"{kind}_idle_bytes"]) if stats is not None else 0


def _timed(ctx: _Context, body: Callable[[], Any], after: Callable[[Any], None] | None = None,
           kept: str | None = None) -> RunResult:
    """Run ``body`` as the timed region (then ``after`` on its result, inside it); CPU and peak RSS around it.
    ``kept``: the kind of sfstore's kept buffers (:func:`_kept`) the run reuses, counted in its growth."""
    _settle()
    reused = _kept(ctx, kept) if kept else 0
    meters = Meters()
    result = body()
    if after is not None:
        after(result)
    meters.stop()
    del result
    _settle()
    extra: dict[str, Any] = {"peak_rss_growth_bytes": meters.rss_growth + reused, "peak_rss_method": meters.rss_method}
    if kept:
        extra["reused_buffer_bytes"] = reused
    return RunResult(bytes=ctx.tensor_bytes, ops=1, seconds=meters.seconds, cpu_s=meters.cpu_s, extra=extra)


def _prepare_save(path: str) -> None:
    _remove(path)
    os.sync()


def _prepare_load(ctx: _Context, tool: str) -> None:
    path = ctx.out(tool)
    if not os.path.exists(path):
        raise BenchSetupError(f"{path} is missing: the {tool} save before this load failed")
    for f in _files_of(path):
        drop_cache(f)


def _core_kwargs(ctx: _Context) -> dict[str, Any]:
    return {} if ctx.max_shard is None else {"max_shard_bytes": ctx.max_shard}


def _need_core(ctx: _Context) -> Any:
    if ctx.core is None:
        raise _NotBuilt(f"{NOT_BUILT}: {ctx.core_reason}")
    return ctx.core


def _need_dcp(ctx: _Context) -> Any:
    if ctx.dcp_mod is None:
        raise _NotBuilt(f"{NOT_BUILT}: {ctx.dcp_reason}")
    return ctx.dcp_mod


def side_save(ctx: _Context) -> RunResult:
    core = _need_core(ctx)
    path = ctx.out("save")
    _prepare_save(path)
    return _timed(ctx, lambda: core.save(ctx.sd, path, **_core_kwargs(ctx)), kept="save")


def side_save_async(ctx: _Context) -> RunResult:
    core = _need_core(ctx)
    path = ctx.out("save")
    _prepare_save(path)
    _settle()
    reused = _kept(ctx, "save_async")
    meters = Meters()
    fut = core.save_async(ctx.sd, path, **_core_kwargs(ctx))
    blocking = meters.elapsed()
    fut.get()
    meters.stop()
    return RunResult(bytes=ctx.tensor_bytes, ops=1, seconds=blocking, cpu_s=meters.cpu_s,
                     extra={"blocking_seconds": blocking, "completed_seconds": meters.seconds,
                            "cpu_note": "CPU until .get() completed",
                            "peak_rss_growth_bytes": meters.rss_growth + reused, "reused_buffer_bytes": reused,
                            "peak_rss_method": meters.rss_method})


def side_load(ctx: _Context) -> RunResult:
    core = _need_core(ctx)
    _prepare_load(ctx, "save")
    return _timed(ctx, lambda: core.load(ctx.out("save")), lambda r: _touch(r, ctx.digests, "sfstore.load"),
                  kept="load")


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _empty_like(ctx: _Context) -> dict[str, Any]:
    import torch

    return {k: torch.empty_like(v) for k, v in ctx.sd.items()}


def _dcp_save(ctx: _Context, path: str, writer: Any) -> RunResult:
    _prepare_save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _timed(ctx, lambda: _dcp().save(ctx.sd, storage_writer=writer, no_dist=True))


def _dcp_load(ctx: _Context, tool: str, make_reader: Callable[[str], Any], label: str) -> RunResult:
    _prepare_load(ctx, tool)

    def body() -> dict[str, Any]:
        dest = _empty_like(ctx)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _dcp().load(dest, storage_reader=make_reader(ctx.out(tool)), no_dist=True)
        return dest

    return _timed(ctx, body, lambda r: _touch(r, ctx.digests, label))


def side_sfdcp_save(ctx: _Context) -> RunResult:
    mod = _need_dcp(ctx)
    path = ctx.out("sfdcp")
    return _dcp_save(ctx, path, mod.StorageWriter(path, overwrite=True))


def side_sfdcp_load(ctx: _Context) -> RunResult:
    mod = _need_dcp(ctx)
    return _dcp_load(ctx, "sfdcp", lambda p: mod.StorageReader(p), "sfstore dcp StorageReader")


def ref_dcp_save(ctx: _Context) -> RunResult:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    path = ctx.out("dcp")
    return _dcp_save(ctx, path, FileSystemWriter(path, sync_files=True, overwrite=True))


def ref_dcp_load(ctx: _Context) -> RunResult:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return _dcp_load(ctx, "dcp", lambda p: FileSystemReader(p), "DCP FileSystemReader")


def ref_torch_save(ctx: _Context) -> RunResult:
    import torch

    path = ctx.out("torch")
    _prepare_save(path)

    def body() -> None:
        with open(path, "wb") as f:
            torch.save(ctx.sd, f)
            f.flush()
            os.fsync(f.fileno())

    return _timed(ctx, body)


def ref_torch_load(ctx: _Context) -> RunResult:
    import torch

    _prepare_load(ctx, "torch")
    return _timed(ctx, lambda: torch.load(ctx.out("torch"), weights_only=True, map_location="cpu"),
                  lambda r: _touch(r, ctx.digests, "torch.load"))


def ref_safetensors_save(ctx: _Context) -> RunResult:
    from safetensors.torch import save_file

    path = ctx.out("safetensors")
    _prepare_save(path)

    def body() -> None:
        save_file(ctx.sd, path)
        fsync_path(path)

    return _timed(ctx, body)


def ref_safetensors_load(ctx: _Context) -> RunResult:
    from safetensors.torch import load_file

    _prepare_load(ctx, "safetensors")
    return _timed(ctx, lambda: load_file(ctx.out("safetensors")),
                  lambda r: _touch(r, ctx.digests, "safetensors.load_file"))


def _fio_job(ctx: _Context, rw: str) -> FioJob:
    assert ctx.fio_file is not None
    return FioJob(name=f"checkpoint-{rw}", filename=ctx.fio_file, size=ctx.fio_size, io_size=ctx.fio_size, rw=rw,
                  bs=ctx.chunk_size, iodepth=ctx.parallelism, seed=ctx.args.seed)


def ref_fio(ctx: _Context, rw: str) -> RunResult:
    if ctx.fio is None or ctx.fio_file is None:
        raise BenchSetupError("fio is needed for the -vs-fio cases")
    drop_cache(ctx.fio_file)
    if rw == "write":
        os.sync()
    return run_fio(ctx.fio, _fio_job(ctx, rw))


_OURS: dict[str, Callable[[_Context], RunResult]] = {
    "save": side_save, "save_async": side_save_async, "load": side_load,
    "dcp-save": side_sfdcp_save, "dcp-load": side_sfdcp_load,
}
_OURS_LABEL = {"save": "sfstore.checkpoint.save", "save_async": "sfstore.checkpoint.save_async",
               "load": "sfstore.checkpoint.load", "dcp-save": "DCP + sfstore StorageWriter",
               "dcp-load": "DCP + sfstore StorageReader"}


def _reference(spec: CaseSpec) -> tuple[str, Callable[[_Context], RunResult]]:
    if spec.reference == "fio":
        rw = "write" if spec.op == "save" else "read"
        return f"fio ({rw}, O_DIRECT, io_uring)", lambda c: ref_fio(c, rw)
    if spec.reference == "sfstore.save":
        return "sfstore.checkpoint.save", side_save
    table: dict[tuple[str, str], tuple[str, Callable[[_Context], RunResult]]] = {
        ("save", "torch.save"): ("torch.save", ref_torch_save),
        ("load", "torch.load"): ("torch.load(weights_only=True)", ref_torch_load),
        ("save", "safetensors"): ("safetensors.torch.save_file", ref_safetensors_save),
        ("load", "safetensors"): ("safetensors.torch.load_file", ref_safetensors_load),
        ("save", "dcp"): ("DCP FileSystemWriter", ref_dcp_save),
        ("load", "dcp"): ("DCP FileSystemReader", ref_dcp_load),
    }
    return table[(spec.op, spec.reference)]


_SAVE_OF = {"load": "save", "dcp-load": "sfdcp", "torch.load": "torch", "safetensors": "safetensors",
            "dcp": "dcp"}


def _ensure_saved(ctx: _Context, spec: CaseSpec, saved: set[str]) -> None:
    """Loads read what the save cases wrote; when those did not run, write it now (untimed)."""
    if spec.op != "load":
        return
    wanted = [("ours", spec.ours), ("ref", spec.reference)]
    writers: dict[str, Callable[[_Context], RunResult]] = {
        "save": side_save, "sfdcp": side_sfdcp_save, "torch": ref_torch_save, "safetensors": ref_safetensors_save,
        "dcp": ref_dcp_save,
    }
    for _, kind in wanted:
        tool = _SAVE_OF.get(kind)
        if tool is None or tool in saved:
            continue
        try:
            writers[tool](ctx)
            saved.add(tool)
        except _NotBuilt:
            pass


# ---------------------------------------------------------------------------------------------------------------
# Running


def _not_built_side(reason: str) -> dict[str, Any]:
    return {"status": reason, "bytes_per_s": 0.0, "iops": 0.0, "cpu_s_per_gib": None, "bytes_per_s_min": 0.0,
            "bytes_per_s_max": 0.0, "bytes": 0, "seconds": None, "peak_rss_growth_bytes": None, "runs": []}


def _summary(runs: list[RunResult]) -> dict[str, Any]:
    peaks = [int(r.extra["peak_rss_growth_bytes"]) for r in runs if r.extra.get("peak_rss_growth_bytes") is not None]
    doc = side_summary(runs, max(peaks) if peaks else None)
    doc["status"] = "ok"
    return doc


def _run_case(ctx: _Context, spec: CaseSpec, label: str, saved: set[str]) -> dict[str, Any]:
    _ensure_saved(ctx, spec, saved)
    ours_fn = _OURS[spec.ours]
    ref_label, ref_fn = _reference(spec)
    resident: int | None = None
    if spec.op == "load":
        tool = _SAVE_OF.get(spec.ours)
        if tool and os.path.exists(ctx.out(tool)):
            resident = drop_and_check(spec.name(label), _files_of(ctx.out(tool)))
    warmup = max(0, int(getattr(ctx.args, "warmup", 0)))

    def run_ours(pair: int) -> RunResult:
        try:
            result = ours_fn(ctx)
        except (SideFailed, BenchSetupError):
            raise
        except Exception as exc:  # a failing sfstore side is a result, not a reason to lose the whole run
            warn(f"{spec.name(label)}: sfstore side failed: {type(exc).__name__}: {exc}")
            raise SideFailed(f"failed: {type(exc).__name__}: {exc}") from exc
        if spec.op == "save" and spec.ours in ("save", "save_async"):
            saved.add("save")
        elif spec.ours == "dcp-save":
            saved.add("sfdcp")
        return result

    def run_theirs(pair: int) -> RunResult:
        result = ref_fn(ctx)
        tool = {"torch.save": "torch", "safetensors": "safetensors", "dcp": "dcp"}.get(spec.reference)
        if spec.op == "save" and tool:
            saved.add(tool)
        if spec.reference == "sfstore.save":
            saved.add("save")
        return result

    # Warm-up pairs are left out of the ratios (kept in the JSON and printed as notes): on a VM the first touch
    # of fresh guest memory costs seconds per GiB, and sfstore keeps its buffers for the next save or load, so
    # the first run of a process is not what the ones after it are.
    ours_side, theirs_side = run_pairs(run_ours, run_theirs, repeat=ctx.args.repeat, warmup=warmup)
    our_status, ref_status = ours_side.status, theirs_side.status
    warm_ours, warm_theirs = ours_side.warmup, theirs_side.warmup
    # a side that stopped before any measured pair still shows what its warm-up runs did
    ours, theirs = ours_side.runs or warm_ours, theirs_side.runs or warm_theirs
    params = {
        "warmup_pairs": warmup,
        "op": spec.op, "sfstore_side": _OURS_LABEL[spec.ours], "tensor_bytes": ctx.tensor_bytes,
        "tensors": len(ctx.sd), "dtype": "bfloat16", "layout": "LLM-like (tools.bench.suites.checkpoint.llm_layout)",
        "max_shard_bytes": ctx.max_shard, "block_size": ctx.chunk_size, "chunk_size": ctx.chunk_size,
        "parallelism": ctx.parallelism, "repeat": ctx.args.repeat, "seed": ctx.args.seed,
        "fsync_in_timed_region": spec.op == "save",
        "touch": "xxh3_64 of every tensor's bytes inside the timed region (checked)" if spec.op == "load" else None,
        "cold": "previous output deleted + sync() before every save; fsync + posix_fadvise(DONTNEED) on every file "
                "before every load",
        "resident_after_drop_bytes": resident,
    }
    if spec.reference == "fio":
        params["fio_command"] = " ".join(fio_command(ctx.fio or "fio", _fio_job(ctx, "write" if spec.op == "save"
                                                                                 else "read")))
        params["fio_bytes"] = ctx.fio_size
    ours_doc = _summary(ours) if our_status == "ok" and ours else _not_built_side(our_status)
    if our_status != "ok" and ours:
        ours_doc = {**_summary(ours), "status": our_status}
    ref_doc = _summary(theirs) if ref_status == "ok" and theirs else _not_built_side(ref_status)
    if spec.reference == "fio":
        ref_doc["peak_rss_note"] = PEAK_RSS_NOTE
    n = min(len(ours), len(theirs))
    stats = summarize_pairs(ours[:n], theirs[:n])
    case = {"name": spec.name(label), "params": params, "sfstore": ours_doc, "reference_tool": ref_label,
            "reference": ref_doc, **stats}
    if warm_ours or warm_theirs:
        case["warmup"] = {"sfstore_bytes_per_s": [r.bytes / r.seconds for r in warm_ours if r.seconds > 0],
                          "reference_bytes_per_s": [r.bytes / r.seconds for r in warm_theirs if r.seconds > 0]}
    if spec.ours == "save_async":
        fractions = [a.seconds / b.seconds for a, b in zip(ours[:n], theirs[:n], strict=True) if b.seconds > 0]
        case["blocking_fraction"] = _median(fractions)
        case["blocking_fractions"] = fractions
        case["completed_seconds"] = _median([float(r.extra["completed_seconds"]) for r in ours])
    return case


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


# ---------------------------------------------------------------------------------------------------------------
# Acceptance


def _goal(goal: str, value: float | None, target: float, higher_is_better: bool, unit: str,
          why_missing: str = "not measured") -> dict[str, Any]:
    if value is None:
        return {"goal": goal, "value": None, "target": target, "met": None, "line": f"{goal}: {why_missing}"}
    met = value >= target if higher_is_better else value <= target
    fmt: Callable[[float], str]
    if unit == "x":
        fmt = lambda v: f"{v:.2f}x"  # noqa: E731
    elif unit == "%":
        fmt = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    else:
        fmt = lambda v: f"{v / MIB:.0f} MiB"  # noqa: E731
    if met:
        line = f"{goal}: met ({fmt(value)})"
    else:
        gap = target - value if higher_is_better else value - target
        line = f"{goal}: missed by {fmt(gap)} ({fmt(value)})"
    return {"goal": goal, "value": value, "target": target, "met": met, "line": line}


def evaluate_goals(cases: Sequence[dict[str, Any]], label: str, tensor_bytes: int,
                   max_shard: int) -> list[dict[str, Any]]:
    """The issue's acceptance goals read from the cases (None where a case did not run or a side is missing).

    Parameters
    ----------
    cases : sequence of dict
        Case documents of this run.
    label : str
        Size label in the case names.
    tensor_bytes : int
        Tensor bytes of the state dict.
    max_shard : int
        ``max_shard_bytes`` the saves used.

    Returns
    -------
    list of dict
        ``{"goal", "value", "target", "met", "line"}`` per goal.
    """
    by_name = {c["name"]: c for c in cases}

    def ratio(stem: str) -> tuple[float | None, str]:
        case = by_name.get(stem.format(size=label))
        if case is None:
            return None, "not run (case not selected)"
        if case["sfstore"].get("status") != "ok":
            return None, f"not measured ({case['sfstore'].get('status')})"
        return case.get("ratio"), "not measured"

    goals = []
    for stem, goal, target in (
        ("save-{size}-vs-torch.save", "save >= 2x torch.save", 2.0),
        ("save-{size}-vs-safetensors", "save >= 1.3x safetensors", 1.3),
        ("load-{size}-vs-torch.load", "load >= 2x torch.load", 2.0),
        ("load-{size}-vs-safetensors", "load >= 1.2x safetensors", 1.2),
        ("save-{size}-vs-fio", "save >= 0.8x fio write", 0.8),
        ("load-{size}-vs-fio", "load >= 0.8x fio read", 0.8),
    ):
        value, why = ratio(stem)
        goals.append(_goal(goal, value, target, True, "x", why))
    case = by_name.get(f"save_async-blocking-{label}")
    frac = case.get("blocking_fraction") if case else None
    why = "not run (case not selected)" if case is None else f"not measured ({case['sfstore'].get('status')})"
    goals.append(_goal("save_async blocks <= 15% of a sync save", frac, 0.15, False, "%", why))

    def peaks(side: str, names: Sequence[str]) -> tuple[float | None, str]:
        values = [int(by_name[n]["sfstore"]["peak_rss_growth_bytes"]) for n in names if n in by_name
                  and by_name[n]["sfstore"].get("status") == "ok" and by_name[n]["params"]["sfstore_side"] == side
                  and by_name[n]["sfstore"].get("peak_rss_growth_bytes") is not None]
        return (float(max(values)), "") if values else (None, f"not measured ({side} did not run)")

    load_names = [c["name"] for c in cases if c["params"]["sfstore_side"] == _OURS_LABEL["load"]]
    value, why = peaks(_OURS_LABEL["load"], load_names)
    goals.append(_goal(f"load peak RSS growth <= 1.15x tensor bytes ({1.15 * tensor_bytes / MIB:.0f} MiB)",
                       value, 1.15 * tensor_bytes, False, "MiB", why))
    save_names = [c["name"] for c in cases if c["params"]["sfstore_side"] == _OURS_LABEL["save"]]
    save_names += [c["name"] for c in cases if c["name"] == f"save_async-blocking-{label}"]
    values = []
    for n in save_names:
        c = by_name[n]
        sides = []
        if c["params"]["sfstore_side"] == _OURS_LABEL["save"]:
            sides.append(c["sfstore"])
        if c["name"].startswith("save_async"):
            sides.append(c["reference"])  # the synchronous save it is compared with
        values += [int(s["peak_rss_growth_bytes"]) for s in sides
                   if s.get("status") == "ok" and s.get("peak_rss_growth_bytes") is not None]
    limit = 2 * max_shard + 64 * MIB
    goals.append(_goal(f"sync save peak RSS growth <= 2 x max_shard_bytes + 64 MiB ({limit / MIB:.0f} MiB)",
                       float(max(values)) if values else None, limit, False, "MiB",
                       "not measured (sfstore.checkpoint.save did not run)"))
    return goals


def warmup_notes(cases: Sequence[dict[str, Any]]) -> list[str]:
    """One line per case with warm-up pairs: each side's first run(s) in the process, which the ratios leave out
    (fresh memory for both sides; for sfstore also the buffers it keeps for later runs being allocated)."""
    lines = []
    for c in cases:
        warm = c.get("warmup")
        if not warm or not warm["sfstore_bytes_per_s"] or not warm["reference_bytes_per_s"]:
            continue
        ours, theirs = warm["sfstore_bytes_per_s"], warm["reference_bytes_per_s"]
        ratio = ours[0] / theirs[0] if theirs[0] else float("nan")
        lines.append(f"{c['name']}: warm-up pair (first in the process, not in the ratio): sfstore "
                     f"{ours[0] / GIB:.3f} GiB/s, {c['reference_tool']} {theirs[0] / GIB:.3f} GiB/s ({ratio:.2f}x)")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Table


class _CheckpointTable(Table):
    """The common table with a wider case column, the reference named per row and peak RSS growth per side."""

    def __init__(self) -> None:
        super().__init__("reference", name_width=28)

    @property
    def _width(self) -> int:
        return sum(self._widths) + 2 * (len(self._widths) - 1)

    def header(self) -> str:
        """The two header lines."""
        top = self._line(["case", "sfstore", "reference", "ratio (min-max)", "CPU s/GiB", ""])
        sub = self._line(["", "", "", "", "sfstore", "reference"])
        return f"{top.ljust(self._width)}  peak RSS growth MiB\n{sub.ljust(self._width)}  sfstore / reference"

    def row(self, case: dict[str, Any]) -> str:
        """One case as a line (with the reference tool's full name at the end).

        Parameters
        ----------
        case : dict
            A case document.

        Returns
        -------
        str
            The line.
        """
        ours, ref = case["sfstore"], case["reference"]

        def speed(side: dict[str, Any]) -> str:
            status = side.get("status", "ok")
            if status != "ok":
                return NOT_BUILT if status.startswith(NOT_BUILT) else "failed"
            return f"{float(side['bytes_per_s']) / GIB:.3f} GiB/s"

        def cpu(side: dict[str, Any]) -> str:
            v = side.get("cpu_s_per_gib")
            return "n/a" if v is None or side.get("status", "ok") != "ok" else f"{v:.3f}"

        def rss(side: dict[str, Any]) -> str:
            v = side.get("peak_rss_growth_bytes")
            return "n/a" if v is None else f"{int(v) / MIB:.0f}"

        r, lo, hi = case.get("ratio"), case.get("ratio_min"), case.get("ratio_max")
        ratio = "n/a" if r is None else (f"{r:.2f} ({lo:.2f}-{hi:.2f})" if lo is not None and hi is not None
                                         else f"{r:.2f}")
        line = self._line([case["name"], speed(ours), speed(ref), ratio, cpu(ours), cpu(ref)])
        return f"{line.ljust(self._width)}  {rss(ours)} / {rss(ref)}   [{case['reference_tool']}]"


# ---------------------------------------------------------------------------------------------------------------
# Entry points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the checkpoint suite's options to ``parser`` (the common ones are there already)."""
    parser.epilog = ("cases: " + ", ".join(c.name("<size>") for c in all_cases()) + ". --quick runs "
                     + ", ".join(s.format(size="<size>") for s in QUICK_CASES) + ".")
    g = parser.add_argument_group("checkpoint suite")
    g.add_argument("--size", type=parse_size, default=2 << 30, metavar="SIZE",
                   help="tensor bytes of the state dict, about (default 2g)")
    g.add_argument("--max-shard", type=parse_size, default=None, metavar="SIZE",
                   help="max_shard_bytes for sfstore.checkpoint.save (default: its own default)")
    g.add_argument("--keep", action="store_true", help="keep the checkpoints written (default: remove them at the end)")
    g.add_argument("--reliability", type=int, default=0, metavar="N",
                   help="after the cases, N SIGKILL trials of a saving process (the issue asks for 300)")
    add_warmup(g, "fresh guest memory is slow to touch")
    add_fio(g)


def _import_core() -> tuple[Any, str]:
    try:
        mod = importlib.import_module("sfstore.checkpoint")
    except ImportError as exc:
        return None, f"sfstore.checkpoint cannot be imported ({exc})"
    missing = [n for n in ("save", "save_async", "load") if not hasattr(mod, n)]
    if missing:
        return None, f"sfstore.checkpoint has no {', '.join(missing)}"
    return mod, ""


def _import_dcp() -> tuple[Any, str]:
    try:
        return importlib.import_module("sfstore.checkpoint.dcp"), ""
    except ImportError as exc:
        return None, f"sfstore.checkpoint.dcp cannot be imported ({exc})"


def _default_shard_bytes() -> int:
    try:
        from sfstore import defaults

        return int(defaults.get("checkpoint_shard_bytes"))
    except Exception:  # the setting may not exist yet
        return DEFAULT_SHARD_BYTES


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the checkpoint suite with ``args`` (the common and checkpoint options) and return its JSON document:
    the common shape plus ``state_dict`` and ``acceptance``.

    Raises :class:`~tools.bench.common.BenchSetupError` when something it needs is missing (torch, safetensors,
    fio for the fio cases, space) or the directory is in memory.
    """
    size = int(args.size)
    if size < MIB:
        raise BenchSetupError(f"--size {size}: at least 1m")
    label = format_size(size) if size % MIB == 0 else str(size)
    specs = select_cases(label, args.cases, args.quick)
    try:
        import safetensors
        import torch
        import xxhash  # noqa: F401
    except ImportError as exc:
        raise BenchSetupError(f"the checkpoint suite needs torch, safetensors and xxhash: {exc}") from None
    directory, mount = bench_dir(args.dir)
    work = os.path.join(directory, f"checkpoint-{label}")
    os.makedirs(work, exist_ok=True)
    need_fio = any(s.reference == "fio" for s in specs)
    fio = find_fio(args.fio) if need_fio else None
    need = 7 * size + 256 * MIB
    check_space(directory, need, f"the checkpoint bench needs about {need / GIB:.2f} GiB")
    warn_if_few_pairs(args.repeat)

    from sfstore.paths.file import FilePath

    fp = FilePath(work)
    core, core_reason = _import_core()
    dcp_mod, dcp_reason = _import_dcp()
    if core is None:
        warn(f"sfstore side: {NOT_BUILT} ({core_reason}); running the references only")
    print(f"building the state dict ({label}, bf16, seed {args.seed}) ...", flush=True)
    sd, digests, tensor_bytes = _build_state_dict(size, args.seed)
    fio_size = -(-tensor_bytes // fp.chunk_size) * fp.chunk_size
    fio_file = prepare_file(work, fio_size)[0] if need_fio else None
    max_shard = args.max_shard
    ctx = _Context(args=args, work=work, sd=sd, digests=digests, tensor_bytes=tensor_bytes,
                   chunk_size=fp.chunk_size, parallelism=fp.parallelism, fio=fio, fio_file=fio_file,
                   fio_size=fio_size, max_shard=max_shard, core=core, core_reason=core_reason, dcp_mod=dcp_mod,
                   dcp_reason=dcp_reason)
    shapes = [tuple(v.shape) for v in sd.values()]
    big = sorted((v.numel() * v.element_size() for v in sd.values()), reverse=True)
    state_info = {"tensor_bytes": tensor_bytes, "tensors": len(sd), "dtype": "bfloat16",
                  "largest_bytes": big[:3], "smallest_bytes": big[-1], "hidden": shapes[0][1] if shapes else None,
                  "layers": sum(1 for k in sd if k.endswith("q_proj.weight"))}
    machine = machine_info(directory)
    machine.update({"fio": fio_version(fio) if fio else None, "torch": torch.__version__,
                    "safetensors": getattr(safetensors, "__version__", None),
                    "file_path": {"chunk_size": fp.chunk_size, "parallelism": fp.parallelism, "direct_io": fp.direct,
                                  "transport": fp.transport}})
    fs = f"{mount.fstype} on {mount.source}" if mount else "unknown filesystem"
    print(f"checkpoint suite: {tensor_bytes / GIB:.3f} GiB in {len(sd)} bf16 tensors, {work} ({fs}), chunk "
          f"{format_size(fp.chunk_size)} x {fp.parallelism} in flight, {args.repeat} pair(s) per case, cold cache",
          flush=True)
    table = _CheckpointTable()
    print(table.header(), flush=True)
    results: list[dict[str, Any]] = []
    saved: set[str] = set()
    try:
        for spec in specs:
            case = _run_case(ctx, spec, label, saved)
            results.append(case)
            print(table.row(case), flush=True)
    finally:
        if not args.keep:
            for tool in ("save", "torch", "safetensors", "dcp", "sfdcp"):
                try:
                    _remove(ctx.out(tool))
                except OSError:
                    pass
    shard = max_shard if max_shard is not None else _default_shard_bytes()
    goals = evaluate_goals(results, label, tensor_bytes, shard)
    print()
    for g in goals:
        print(f"goal: {g['line']}", flush=True)
    for line in warmup_notes(results):
        print(f"note: {line}", flush=True)
    doc: dict[str, Any] = {"bench": "checkpoint", "machine": machine, "date": utc_now(), "state_dict": state_info,
                           "max_shard_bytes": shard, "cases": results, "acceptance": goals}
    if args.reliability:
        doc["reliability"] = _reliability(ctx.work, args.reliability)
    return doc


def _reliability(base: str, trials: int) -> dict[str, Any]:
    """Reliability mode: ``trials`` SIGKILLs of a process saving in a loop (``sfstore.testing.checkpoint_crash``);
    after each, ``latest()`` must load bit-exactly and be a fully committed checkpoint."""
    from sfstore.testing.checkpoint_crash import run_trials

    where = os.path.join(base, "reliability")
    print(f"reliability: {trials} SIGKILL trials of a saving process in {where} ...", flush=True)
    try:
        report = run_trials(where, trials).as_dict()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    verdict = "no failures" if not report["failures"] else f"{len(report['failures'])} FAILURES"
    print(f"reliability: {report['trials']} trials, {report['killed_mid_save']} killed mid-save, "
          f"{report['committed_unacknowledged']} after commit before acknowledgement: {verdict} "
          f"({report['seconds']:.0f} s)", flush=True)
    return report


register(Suite(name="checkpoint",
               help="sfstore.checkpoint save/load vs torch.save, safetensors, DCP and fio (cold, fsynced, resident)",
               add_arguments=add_arguments, run=run))
