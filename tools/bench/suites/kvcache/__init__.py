"""Suite ``kvcache``: ``KVCacheStore`` put/get of KV blocks per tier against fio, NIXL's POSIX backend, LMCache's
local disk backend and a plain memory copy, in one run.

``python -m tools.bench kvcache [--size 1g] [--repeat N] [--quick] [--json PATH]``

Blocks are those of a ``KVGeometry(num_layers=32, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")``
(2 MiB each; ``--layers``/``--block-tokens``/``--kv-heads``/``--head-dim`` change it), moved in batches of
``--batch`` (default 64): one batch is one request's ``batch x block_tokens`` tokens, whose keys are
``KVCacheStore.keys_for(tokens)``. The working set is ``--size`` bytes of blocks (default 1g, 256m with
``--quick``): N blocks, ``N / batch`` batches of seeded random token ids. Every side puts the same ``batch``
source blocks (distinct random bytes, reused batch after batch) and gets into the same ``batch`` destinations
(both page-aligned anonymous memory, numpy views), batch after batch, gets in a seeded random batch order
per pair.

Cases, each ``--warmup`` (default 1, discarded) + ``--repeat`` pairs in ABBA order (sfstore, reference,
reference, sfstore, ...):

* ``put-pinned-vs-memcpy`` / ``get-pinned-vs-memcpy`` -- the pinned tier (``KVCacheStore(pinned_bytes=enough for
  N blocks, block_store=None)``): ``put(keys, blocks)`` (a copy into a pinned slot plus its xxh3-64) and
  ``get_into(keys, dests)`` of blocks resident there (every one must come back from ``"pinned"``), against
  ``numpy.copyto`` of the same bytes between the same buffers and N page-aligned 2 MiB blocks (the memory
  limit, ``BENCHMARKING.md`` rule 5).
* ``put-block-vs-<ref>`` / ``get-block-vs-<ref>`` -- the NVMe tier: a ``BlockStore`` on an image file
  (``<dir>/kvcache-<size>.img``, prepared with random bytes once and reused, formatted with one size class of the
  block size), under ``KVCacheStore(pinned_bytes=0)``, so nothing stays pinned: a put writes each block straight
  from the caller's memory (O_DIRECT), computes its xxh3-64 meanwhile and then writes its slot header (``put()``
  per batch waits for it), and the run ends with ``BlockStore.flush()`` (``fdatasync``) inside the timed region;
  before each put run every key is evicted from the store and the freed slots recycled (untimed). A get reads
  every block from the block store straight into its destination, its checksum checked by the engine (each must
  come back from ``"block"``), on a cold cache (fsync + ``POSIX_FADV_DONTNEED``; O_DIRECT
  anyway). The references, each on a cold cache too:

  - ``fio``: ``--rw=randwrite|randread --bs=<block> --iodepth=<qd> --direct=1 --ioengine=io_uring`` (writes with
    ``--end_fsync=1``), N blocks of the image region the store's slots occupy (``--offset`` = the class's
    offset, ``--size`` = N slot strides). Its per-block latency is fio's completion latency per I/O. Note the
    placement: the store puts a batch into adjacent free slots, so its I/O is 64 neighbouring 2 MiB requests
    per batch, while fio's are random over the region; on a disk (or a host cache) that favours neighbours, a
    get above 1x fio says more about that than about the device's random-read limit.
  - ``nixl``: NIXL (``nixl_agent``) with its ``POSIX`` backend on io_uring (``use_uring``; its default queue when
    that is refused), DRAM registered as ``[(addr, len, 0, "")]`` and the image as fd-mode ``FILE_SEG`` (opened
    O_DIRECT), on the store's own slots: the descriptors are the value areas of the N keys' slots
    (``BlockStore.locate``, untimed), so NIXL moves the same bytes at the same places in the same batches and
    order as the store (a NIXL put rewrites each slot's value with the same bytes, so the store stays intact).
    Per batch one ``make_prepped_xfer`` of ``batch`` descriptors (WRITE or READ), posted and polled until done;
    writes end with ``fsync`` inside the timed region. Needs ``nixl`` and ``nixl-cu12``
    (``tools/kvbench-env.sh``); runs without a GPU.
  - ``lmcache``: LMCache 0.5.6's ``LMCacheEngine`` with only its local disk backend (``local_cpu=False``,
    ``local_disk=<dir>/kvcache-lmcache/``, ``chunk_size=block_tokens``, so one chunk is one block) and a small CPU
    subclass of its ``GPUConnectorInterface`` that copies each chunk between the caller's blocks and LMCache's
    memory objects (its stock vLLM connectors need CUDA). Per batch one ``store(tokens, ...)`` /
    ``retrieve(tokens, ...)`` of the batch's tokens; its disk writes are asynchronous, so a put run waits until
    every block is on disk and fsyncs every file (8 threads) and the directory inside the timed region; before
    each put run the previous files are removed (untimed). ``--lmcache-odirect`` turns on its ``use_odirect``.

* ``put-plugin-vs-lmcache`` / ``get-plugin-vs-lmcache`` -- the same LMCache engine, chunks and CPU connector on
  both sides, with only sfstore's storage plugin (``storage_plugins: [sfstore]``, :mod:`sfstore.kvcache.lmcache`,
  its shared tier in ``<dir>/kvcache-lmcache-sfstore/`` with ``fsync_shared``) against only LMCache's local disk
  backend as above: ``store``/``retrieve`` per batch; a put run waits for the plugin's puts (each file fsynced
  before it is published), a get run starts with every file dropped from the page cache. What the engine does on
  both sides (hashing tokens, allocating its memory objects, the connector's copies) is in both ratios.

The sources and destinations (and the memcpy reference's N blocks) are private anonymous memory, 2 MiB-aligned
and advised for transparent huge pages (``buffers`` in the JSON says how much got them): an O_DIRECT request into
scattered 4 KiB pages needs a segment per page, and where the device takes fewer (virtio-blk: 254) a 2 MiB request
is split, which on the VMs here cuts 2 MiB transfers to a third; the references get the best buffers there are.
fio uses its own (``malloc``) buffers.

When a reference cannot run here (NIXL or LMCache not installed, or failing), its cases say why ("not
installed: ...") and the goal line is ``n/a`` with the reason; the other cases still run.

Measured per run: bytes, operations (blocks), wall time, CPU of the whole process (fio: its job's usr + sys),
per-batch latency p50/p99 of every batched call (sfstore's ``put``/``get_into``, NIXL's transfer, LMCache's
``store``/``retrieve``; a block is delivered when its batch returns, so its latency is its batch's), fio's
per-I/O completion latency p50/p99, and the store's own put/get percentiles (``KVCacheStore.stats()``). Goals
(the issue's acceptance), printed as ``PASS``/``MISS``/``n/a`` lines and kept in the JSON (``acceptance``):
NVMe-tier get and put >= 0.85x fio, >= 1x NIXL POSIX and >= 1.5x LMCache local disk; pinned-tier get >= 0.8x
memcpy; LMCache's engine with sfstore's plugin >= 1.5x with its local disk, store and retrieve (median of the
pairwise throughput ratios).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tools.bench import pairs
from tools.bench.common import (
    MIB,
    BenchSetupError,
    RatioGoal,
    Table,
    bench_dir,
    drop_and_check,
    evaluate_ratio_goals,
    format_size,
    machine_info,
    utc_now,
    warn,
)
from tools.bench.fio import PEAK_RSS_NOTE, find_fio, fio_command, fio_version
from tools.bench.measure import PeakRss, RunResult, median_extras, side_summary, summarize_pairs
from tools.bench.options import add_fio, add_warmup, parse_size, positive_int
from tools.bench.pairs import SideFailed, run_pairs, warn_if_few_pairs, warn_short_runs
from tools.bench.pairs import select_cases as select_from
from tools.bench.registry import Suite, register
from tools.bench.suites.kvcache import lmcache, nixl
from tools.bench.suites.kvcache.lmcache import probe as probe_lmcache
from tools.bench.suites.kvcache.nixl import probe as probe_nixl
from tools.bench.suites.kvcache.workload import ENV_HINT, MODEL_ID, Bench, PeerKind

__all__ = ["TIERS", "REFERENCES", "PEERS", "GOALS", "QUICK_CASES", "Case", "Goal", "all_cases", "select_cases",
           "evaluate_goals", "probe_nixl", "probe_lmcache", "run"]

TIERS = ("pinned", "block", "plugin")
#: the sfstore side of the ``plugin`` tier: LMCache's engine with sfstore's storage plugin, made as a peer is
PLUGIN_SIDE = "lmcache-plugin"
#: reference -> its name in the JSON (``reference_tool``)
REFERENCES = {"memcpy": "numpy.copyto", "fio": "fio", "nixl": "NIXL POSIX", "lmcache": "LMCache local disk"}
#: The third-party references, each in a module of its own: name -> ``(probe, make)``.
PEERS: dict[str, PeerKind] = {"nixl": (nixl.probe, nixl.NixlPeer), "lmcache": (lmcache.probe, lmcache.LMCachePeer),
                              PLUGIN_SIDE: (lmcache.probe, lmcache.plugin_side)}
_DEFAULT_SIZE = 1 << 30
_QUICK_SIZE = 256 << 20


@dataclass(frozen=True)
class Case(pairs.Case):
    """One pair of sides: ``op`` (``put``/``get``) of blocks in ``tier`` against ``reference``."""

    op: str
    tier: str
    reference: str

    @property
    def name(self) -> str:
        """``<op>-<tier>-vs-<reference>``, e.g. ``get-block-vs-fio``."""
        return f"{self.op}-{self.tier}-vs-{self.reference}"



Goal = RatioGoal


GOALS = (
    Goal("NVMe-tier get >= 0.85x fio", "get-block-vs-fio", 0.85),
    Goal("NVMe-tier put >= 0.85x fio", "put-block-vs-fio", 0.85),
    Goal("NVMe-tier get >= 1x NIXL POSIX", "get-block-vs-nixl", 1.0),
    Goal("NVMe-tier put >= 1x NIXL POSIX", "put-block-vs-nixl", 1.0),
    Goal("NVMe-tier get >= 1.5x LMCache local disk", "get-block-vs-lmcache", 1.5),
    Goal("NVMe-tier put >= 1.5x LMCache local disk", "put-block-vs-lmcache", 1.5),
    Goal("pinned-tier get >= 0.8x memcpy (numpy.copyto)", "get-pinned-vs-memcpy", 0.8),
    Goal("LMCache with sfstore's plugin: retrieve >= 1.5x with its local disk", "get-plugin-vs-lmcache", 1.5),
    Goal("LMCache with sfstore's plugin: store >= 1.5x with its local disk", "put-plugin-vs-lmcache", 1.5),
)
#: ``--quick``: the cases the goals quote (on a smaller working set).
QUICK_CASES = tuple(g.case for g in GOALS)


def all_cases() -> list[Case]:
    """Every case in run order: the pinned tier, then the NVMe tier per reference, then LMCache's engine with
    sfstore's plugin against the same engine with its local disk; put before get.

    Returns
    -------
    list of Case
        Ten cases.
    """
    cases = [Case(op, "pinned", "memcpy") for op in ("put", "get")]
    for ref in ("fio", "nixl", "lmcache"):
        cases += [Case(op, "block", ref) for op in ("put", "get")]
    cases += [Case(op, "plugin", "lmcache") for op in ("put", "get")]
    return cases


def select_cases(patterns: Sequence[str] | None = None, quick: bool = False) -> list[Case]:
    """The cases to run, in :func:`all_cases` order: :func:`~tools.bench.pairs.select_cases` with ``patterns``
    (shell globs) and, with ``quick``, only :data:`QUICK_CASES`; raises ``BenchSetupError`` when none is left."""
    return select_from("kvcache", all_cases(), patterns, QUICK_CASES, quick)




# -- arguments -------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the kvcache suite's options to ``parser`` (the common ones are there already)."""
    parser.epilog = ("cases: " + ", ".join(c.name for c in all_cases()) + ". --quick runs the goal cases ("
                     + ", ".join(QUICK_CASES) + ") on 256m of blocks. NIXL and LMCache run where they are "
                     "installed: " + ENV_HINT + ".")
    g = parser.add_argument_group("kvcache suite")
    g.add_argument("--size", type=parse_size, default=None, metavar="SIZE",
                   help="bytes of blocks in the working set (default 1g, 256m with --quick)")
    g.add_argument("--batch", type=positive_int, default=64, metavar="N", help="blocks per call (default 64)")
    g.add_argument("--qd", type=positive_int, default=None, metavar="N",
                   help="queue depth of fio and of the block store's I/O engine (default: --batch)")
    g.add_argument("--outstanding", type=positive_int, default=1, metavar="N",
                   help="sfstore put batches in flight (default 1: put() per batch; N > 1: put_async with N in "
                        "flight); gets are always get_into() per batch")
    g.add_argument("--layers", type=positive_int, default=32, metavar="N", help="KVGeometry.num_layers (default 32)")
    g.add_argument("--block-tokens", type=positive_int, default=16, metavar="N",
                   help="KVGeometry.block_tokens (default 16)")
    g.add_argument("--kv-heads", type=positive_int, default=8, metavar="N", help="KVGeometry.num_kv_heads (default 8)")
    g.add_argument("--head-dim", type=positive_int, default=128, metavar="N", help="KVGeometry.head_dim (default 128)")
    g.add_argument("--lmcache-odirect", action="store_true",
                   help="LMCache's local disk backend with use_odirect (default: its default, buffered files)")
    add_warmup(g)
    add_fio(g)


# -- the suite -------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the kvcache suite with ``args`` (the common and kvcache options) and return its JSON document: the
    common shape plus ``geometry``, ``references`` and ``acceptance``.

    Raises :class:`~tools.bench.common.BenchSetupError` when something it needs is missing (fio, sfstore, numpy,
    O_DIRECT, space), the directory is in memory, or a store lost or changed data.
    """
    cases = select_cases(args.cases, args.quick)
    size = int(args.size if args.size is not None else (_QUICK_SIZE if args.quick else _DEFAULT_SIZE))
    directory, mount = bench_dir(args.dir)
    warn_if_few_pairs(args.repeat)
    if any(c.reference == "fio" for c in cases):
        find_fio(args.fio)
    bench = Bench(args, size, directory, PEERS)
    try:
        return _run(args, bench, cases, mount)
    finally:
        bench.close()


def _run(args: argparse.Namespace, bench: Bench, cases: list[Case], mount: Any) -> dict[str, Any]:
    machine = machine_info(bench.dir)
    g = bench.geom
    print(f"kvcache suite: {bench.n} blocks of {format_size(bench.block)} ({bench.label}; {g.num_layers} layers x "
          f"{g.block_tokens} tokens x {g.num_kv_heads} heads x {g.head_dim} bf16), batches of {bench.batch}, QD "
          f"{bench.qd}, {bench.dir} ({mount.fstype + ' on ' + mount.source if mount else '?'}), {args.warmup} "
          f"warm-up + {args.repeat} pair(s) per case, ABBA", flush=True)
    table = Table("reference", use_iops=lambda case: False, name_width=max(len(c.name) for c in cases))
    print(table.header(), flush=True)
    results: list[dict[str, Any]] = []
    for case in cases:
        result = _run_case(bench, case)
        results.append(result)
        print(table.row(result), flush=True)
    _print_details(results)
    warn_short_runs([c for c in results if c["params"]["reference"] == "fio" and c["sfstore"].get("runs")],
                    " (fio times whole ms); use a bigger --size")
    acceptance = evaluate_goals(results, size=bench.size, batch=bench.batch, qd=bench.qd,
                                outstanding=bench.outstanding)
    for line in acceptance:
        print(line["line"], flush=True)
    refs: dict[str, Any] = {"fio": fio_version(bench.fio) if bench.fio else None}
    refs.update({name: peer.describe() for name, peer in bench.peers.items()})
    refs["unavailable"] = dict(bench.unavailable)
    machine["references"] = refs
    if bench.block_side is not None:
        machine["block_engine"] = bench.block_side.engine.name
        # what backs the NVMe tier's pinned slots (the block store moves 2 MiB values straight into and out of
        # them): a diagnostic read from the store's pool, None where its internals differ
        pool = getattr(getattr(bench.block_side.kv, "pinned", None), "_pool", None)
        try:
            machine["block_tier_pinned_pool"] = dict(pool.stats()) if pool is not None else None
        except Exception:
            machine["block_tier_pinned_pool"] = None
    geometry = {"num_layers": g.num_layers, "block_tokens": g.block_tokens, "num_kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim, "dtype": g.dtype, "block_bytes": bench.block}
    buffers = {"sources": bench.values.describe(), "destinations": bench.dests.describe()}
    if bench.pinned_side is not None:
        buffers["memcpy_blocks"] = bench.pinned_side.srcs.describe()
    return {"bench": "kvcache", "machine": machine, "date": utc_now(), "geometry": geometry, "blocks": bench.n,
            "buffers": buffers,
            "cases": results, "acceptance": acceptance}


def _sides(bench: Bench, case: Case) -> tuple[Callable[[], RunResult], Callable[[], RunResult]]:
    """``(sfstore side, reference side)`` of ``case``, each returning one run."""
    if case.tier == "pinned":
        p = bench.pinned()
        return (p.put if case.writes else p.get), (lambda: p.memcpy(case.op))
    if case.tier == "plugin":
        side, peer = bench.peers[PLUGIN_SIDE], bench.peers[case.reference]
        return (side.put, peer.put) if case.writes else (side.get, peer.get)
    tier = bench.block_tier()
    ours = tier.put if case.writes else tier.get
    if case.reference == "fio":
        fio = bench.fio
        assert fio is not None
        return ours, (lambda: tier.run_fio(fio, case.name, case.writes))
    peer = bench.peers[case.reference]
    return ours, (peer.put if case.writes else peer.get)


def _not_run(case: Case, why: str) -> dict[str, Any]:
    return {"name": case.name, "params": {"op": case.op, "tier": case.tier, "reference": case.reference},
            "sfstore": {"status": "not run: its reference cannot run here"},
            "reference_tool": REFERENCES[case.reference],
            "reference": {"status": why}, "ratio": None, "ratio_min": None, "ratio_max": None, "ratios": [],
            "ratio_of_medians": None, "same_bytes": None}


def _run_case(bench: Bench, case: Case) -> dict[str, Any]:
    args = bench.args
    why = bench.reference_status(case.reference)
    if why is None and case.tier == "plugin":
        why = bench.reference_status(PLUGIN_SIDE)
    if why is not None:
        warn(f"{case.name}: {REFERENCES[case.reference]} cannot run here: {why}")
        return _not_run(case, why)
    ours_once, theirs_once = _sides(bench, case)
    growth = {"ours": 0, "theirs": 0}  # peak RSS growth of each side: the most over its runs
    rss = PeakRss()
    resident = None
    if case.tier == "block":
        resident = drop_and_check(case.name, [bench.block_tier().image])

    def run_ours(pair: int) -> RunResult:
        try:
            rss.start()
            result = ours_once()
        except bench.errors.SfstoreError as exc:  # name the case instead of a traceback
            raise BenchSetupError(f"{case.name}: the KV-cache store failed: {type(exc).__name__}: {exc}") from exc
        growth["ours"] = max(growth["ours"], rss.growth())
        return result

    def run_theirs(pair: int) -> RunResult:
        try:
            rss.start()
            result = theirs_once()
        except BenchSetupError:
            raise
        except Exception as exc:  # a failing reference is a result, not a reason to lose the run
            warn(f"{case.name}: {REFERENCES[case.reference]} failed: {type(exc).__name__}: {exc}")
            raise SideFailed(f"failed: {type(exc).__name__}: {exc}") from exc
        growth["theirs"] = max(growth["theirs"], rss.growth())
        return result

    def before_pair(pair: int) -> None:
        if pair == args.warmup:  # growth counts from the measured runs on: warm-up runs allocate what later reuse
            growth.update(ours=0, theirs=0)
        bench.reorder(pair)

    ours_side, theirs_side = run_pairs(run_ours, run_theirs, repeat=args.repeat, warmup=args.warmup,
                                       before_pair=before_pair)
    ours, theirs, ref_status = ours_side.runs, theirs_side.runs, theirs_side.status
    warm_ours, warm_theirs = ours_side.warmup, theirs_side.warmup
    b = bench
    params: dict[str, Any] = {
        "op": case.op, "tier": case.tier, "reference": case.reference, "block_size": b.block, "blocks": b.n,
        "io_bytes": b.n * b.block, "batch": b.batch, "queue_depth": b.qd, "outstanding_batches": b.outstanding,
        "model_id": MODEL_ID, "repeat": args.repeat, "warmup_pairs": args.warmup, "seed": args.seed,
        "peak_rss_method": rss.method, "durable": case.writes and case.tier != "pinned",
        "fsync_in_timed_region": case.writes and case.tier != "pinned",
        "get_order": "batches in a seeded random order per pair (seed-get-<pair>), the same for both sides of a pair",
    }
    if case.tier == "block":
        tier = b.block_tier()
        params.update({
            "image": tier.image, "image_size": tier.image_size, "engine": tier.engine.name,
            "region_offset": tier.region.offset, "slot_stride": tier.region.stride,
            "sfstore_io_bytes_per_op": tier.layout.header_bytes + -(-b.block // tier.layout.lba) * tier.layout.lba,
            "cold": "fsync + posix_fadvise(DONTNEED) before every run (O_DIRECT)",
            "resident_after_drop_bytes": resident,
            "sfstore_call": ("KVCacheStore(pinned_bytes=0, block_store=BlockStore).put(keys, blocks) x N/batch"
                             if b.outstanding == 1 else
                             f"KVCacheStore.put_async(keys, blocks), {b.outstanding} in flight")
            + " + BlockStore.flush()" if case.writes
            else "KVCacheStore.get_into(keys, blocks, keep_on_miss=False) x N/batch (pinned evicted first)",
        })
        if case.reference == "fio":
            params["reference_call"] = " ".join(fio_command(b.fio or "fio", tier.fio_job(case.name, case.writes)))
        else:
            params["reference_call"] = b.peers[case.reference].call(case.writes)
    elif case.tier == "plugin":
        params.update({
            "directory": b.dir, "cold": "posix_fadvise(DONTNEED) on every file before every get run",
            "sfstore_call": b.peers[PLUGIN_SIDE].call(case.writes),
            "reference_call": b.peers[case.reference].call(case.writes),
        })
    else:
        params.update({
            "sfstore_call": "KVCacheStore(block_store=None)." + ("put(keys, blocks)" if case.writes else
                                                                  "get_into(keys, blocks)") + " x N/batch",
            "reference_call": "numpy.copyto(dst, src) per block, between the same buffers and N page-aligned blocks",
        })
    ours_doc = side_summary(ours, growth["ours"])
    ours_doc["warmup_runs"] = [r.as_dict() for r in warm_ours]
    ours_doc.update(median_extras(ours, _EXTRAS))
    if ref_status == "ok" and theirs:
        ref_doc = side_summary(theirs, None if case.reference == "fio" else growth["theirs"])
        ref_doc.update(median_extras(theirs, _EXTRAS))
    else:
        ref_doc = {"status": ref_status, "runs": [r.as_dict() for r in theirs]}
    ref_doc["warmup_runs"] = [r.as_dict() for r in warm_theirs]
    if case.reference == "fio":
        ref_doc["peak_rss_note"] = PEAK_RSS_NOTE
    n = min(len(ours), len(theirs)) if ref_status == "ok" else 0
    stats = summarize_pairs(ours[:n], theirs[:n])
    same = all(a.bytes == t.bytes == b.n * b.block for a, t in zip(ours, theirs, strict=False)) if n else None
    if same is False:
        warn(f"{case.name}: the sides moved different byte counts: the ratio is not comparable")
    return {"name": case.name, "params": params, "sfstore": ours_doc, "reference_tool": REFERENCES[case.reference],
            "reference": ref_doc, **stats, "same_bytes": same}


_EXTRAS = ("batch_p50_ms", "batch_p99_ms", "block_p50_ms", "block_p99_ms", "store_p50_ms", "store_p99_ms",
           "clat_p50_ms", "clat_p99_ms", "flush_s", "fsync_s", "wait_disk_s")


def _print_details(results: Sequence[dict[str, Any]]) -> None:
    ran = [c for c in results if c["sfstore"].get("runs")]
    if not ran:
        return
    print("\nper case: MiB/s (medians) and per-block latency p50 / p99 in ms (a batched call delivers its blocks "
          "when it returns: a block's latency is its batch's; fio: completion latency per I/O)", flush=True)
    width = max(len(c["name"]) for c in ran) + 2

    def lat(side: dict[str, Any]) -> str:
        p50, p99 = side.get("block_p50_ms"), side.get("block_p99_ms")
        return "n/a" if p50 is None or p99 is None else f"{p50:.2f} / {p99:.2f}"

    for c in ran:
        ours, ref = c["sfstore"], c["reference"]
        theirs = (f"{ref['bytes_per_s'] / MIB:8.1f} MiB/s, block {lat(ref)}" if "bytes_per_s" in ref
                  else ref.get("status", "n/a"))
        extra = f", flush {1e3 * ours['flush_s']:.1f} ms" if "flush_s" in ours else ""
        print(f"{c['name']:<{width}}sfstore {ours['bytes_per_s'] / MIB:8.1f} MiB/s, block {lat(ours)}{extra}   "
              f"{c['reference_tool']} {theirs}", flush=True)
    print(flush=True)


def evaluate_goals(results: Sequence[dict[str, Any]], size: int = _DEFAULT_SIZE, batch: int = 64, qd: int = 64,
                   outstanding: int = 1) -> list[dict[str, Any]]:
    """The issue's goals read from the cases: ``PASS``, ``MISS``, ``n/a`` (the reference cannot run here, with
    why) or ``not run`` (the case was not selected).

    Parameters
    ----------
    results : sequence of dict
        Case documents of this run.
    size, batch, qd, outstanding : int
        The run's working-set bytes, batch, queue depth and sfstore put batches in flight; a line says at what
        it ran unless that is the issue's shape (1 GiB of blocks, batches of 64 at QD 64, one at a time).

    Returns
    -------
    list of dict
        ``{"goal", "case", "target", "ratio", "ratio_min", "ratio_max", "status", "met", "line"}`` per goal;
        ``status`` is ``met``, ``missed``, ``n/a`` or ``not run``.
    """
    note = ""
    if (size, batch, qd, outstanding) != (_DEFAULT_SIZE, 64, 64, 1):
        note = (f" [at {format_size(size)}, batch {batch}, QD {qd}, {outstanding} put batch(es) in flight; the "
                "issue's shape is 1g, 64, 64, 1]")
    return evaluate_ratio_goals(GOALS, results, note)


register(Suite(name="kvcache", help="KVCacheStore put/get of 2 MiB KV blocks per tier vs fio, NIXL POSIX, LMCache "
                                    "local disk and memcpy; LMCache's engine with sfstore's plugin vs its local "
                                    "disk", add_arguments=add_arguments, run=run))
