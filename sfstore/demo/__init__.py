"""``sfstore demo``: what sfstore does for a training and an inference job, on the embedded default, in a minute.

Steps (each prints its progress and what it verified):

1. the probe's table and the routing of each data class (path, transport, fallbacks and why);
2. a round trip through the file path (O_DIRECT from registered buffers, fsynced, read back cold, and a
   misaligned read that the engine bounces);
3. **training**: a sharded dataset written to ``sf://``, streamed through ``torch.utils.data.DataLoader``
   (2 workers) by a trainer process that checkpoints with ``save_async`` every 10 steps; the trainer is killed
   with SIGKILL in the middle of a save, and training resumes here from ``checkpoint.latest()``;
4. **inference**: requests sharing a prompt prefix through ``KVCacheStore``: the first misses and offloads,
   the next ones hit in pinned memory, then in the block store, then (another process) in the shared tier;
5. hot blocks put into and got from the block store, and the store reopened;
6. a per-path summary: for each data class, the path, transport, fallbacks, bytes moved direct vs bounced, and
   the throughput each step saw.

A step that has printed nothing for ten seconds says it is still going (:mod:`sfstore.demo.progress`).

With ``--config`` the same runs on a real cluster's paths (NFS over RDMA, NVMe-oF, GDS).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sfstore import defaults
from sfstore.demo.progress import TICK_SECONDS, say, still_going

if TYPE_CHECKING:
    from sfstore.router import Router

__all__ = ["run_demo", "run_steps"]

MiB = 1 << 20


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _progress(prefix: str) -> Callable[[str], None]:
    return lambda s: say(f"  .. {s}")


def _no_direct_why(r: dict[str, Any]) -> str:
    """Why the round trip ran without O_DIRECT, in the path's own words."""
    for f in r["fallbacks"]:
        if "O_DIRECT" in f:
            return str(f)
    return "the filesystem refuses it"


def run_steps(
    router: Router, *, size: int = 64 * MiB, shards: int = 32, every: int = 10, show: bool = True,
    tick: float = TICK_SECONDS,
) -> dict[str, Any]:
    """Run every step on ``router``'s paths; return the summary (what :func:`run_demo` prints at the end).

    ``tick``: seconds of quiet after which a running step says it is still going
    (:func:`~sfstore.demo.progress.still_going`)."""
    from sfstore.demo.inference import kv_cache_reuse
    from sfstore.demo.storage import file_round_trip, hot_blocks

    out = say if show else (lambda text="", end="\n": None)
    prog = _progress("") if show else (lambda s: None)
    summary: dict[str, Any] = {"steps": {}, "ok": True}
    t_all = time.perf_counter()

    out(f"[1/5] file path: {size // MiB} MiB written from registered buffers (O_DIRECT where the filesystem "
        "allows it), fsynced, read back cold, and one misaligned read")
    with still_going("writing and reading the file path", every=tick, show=show):
        r = file_round_trip(router, size=size)
    c = r["counters"]
    out(f"  {r['engine']} engine, O_DIRECT {'on' if r['o_direct'] else 'off (' + _no_direct_why(r) + ')'}: write "
        f"{r['write_gib_s']:.2f} GiB/s, read {r['read_gib_s']:.2f} GiB/s; {c['requests']} requests (chunks of "
        f"{r['chunk_size'] / MiB:g} MiB, {r['parallelism']} in flight); {c['bytes_direct'] / MiB:.1f} MiB direct, "
        f"{c['bytes_bounced']} B bounced; verified {'yes' if r['verified'] else 'NO'}")
    summary["steps"]["round_trip"] = {k: r[k] for k in ("engine", "o_direct", "write_gib_s", "read_gib_s",
                                                        "counters", "verified")}
    summary["ok"] &= r["verified"]

    # The training step needs torch, numpy and fsspec (the dataset is streamed over sf://): the demo extra.
    missing = [name for name in ("torch", "numpy", "fsspec") if not _importable(name)]
    if not missing:
        from sfstore.demo.training import make_dataset, training_job

        out(f"[2/5] training: {shards} shards to sf://demo/dataset, streamed by a DataLoader (2 workers); "
            f"save_async every {every} steps; the trainer is SIGKILLed mid-save; resume from latest()")
        with still_going("writing the dataset", every=tick, show=show):
            ds = make_dataset(shards=shards)
        out(f"  dataset: {ds['samples']} samples, {ds['bytes'] / MiB:.1f} MiB in {ds['shards']} shards: written "
            f"{ds['bytes'] / MiB / ds['write_s']:.0f} MiB/s (published atomically), read back cold with one cat() "
            f"{ds['bytes'] / MiB / ds['read_s']:.0f} MiB/s; verified {'yes' if ds['verified'] else 'NO'}")
        with still_going("training", every=tick, show=show):
            tr = training_job(ds["names"], every=every, progress=prog)
        out(f"  the trainer consumed {tr['stream_mib_s']:.1f} MiB/s of samples (its tiny model on the CPU sets that "
            f"pace, not storage: the dataset read back cold at {ds['bytes'] / MiB / ds['read_s']:.0f} MiB/s); "
            f"save_async blocked it <= {1000 * (tr['save_async_blocked_s'] or 0):.1f} ms per checkpoint")
        out(f"  committed before the crash: steps {', '.join(map(str, tr['committed']))}; killed while saving step "
            f"{tr['killed_during']}; latest() = step {tr['recovered_step']} "
            f"({'the last committed: recovered' if tr['recovered_last_committed'] else 'NOT the last committed'})")
        out(f"  resumed: loss {tr['loss_start']:.3f} -> {tr['loss_end']:.3f}, accuracy {100 * tr['accuracy']:.0f}%; "
            f"{tr['final']} saved ({tr['checkpoint_bytes'] / MiB:.1f} MiB, {tr['save_s'] * 1000:.0f} ms), "
            f"load {tr['load_s'] * 1000:.0f} ms (checksums verified)")
        summary["steps"]["training"] = {**tr, "dataset_write_mib_s": ds["bytes"] / MiB / ds["write_s"],
                                        "dataset_read_mib_s": ds["bytes"] / MiB / ds["read_s"]}
        summary["ok"] &= bool(tr["recovered_last_committed"]) and ds["verified"]
    else:
        out(f"[2/5] training: skipped ({' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
            "pip install 'sfstore[demo]')")

    out("[3/5] inference: requests sharing a 256-token prompt prefix, KV blocks of 16 tokens (128 KiB)")
    with still_going("serving the requests", every=tick, show=show):
        k = kv_cache_reuse(router)
    for st in k["steps"]:
        where = ", ".join(st["tiers"]) or "-"
        out(f"  {st['request']:<34} {st['hit_tokens']:>3} of {st['prompt_tokens']} tokens found (from: {where})")
    ks = k["stats"]
    out(f"  hits: pinned {ks['hits_pinned']}, block {ks['hits_block']}, shared {ks['hits_shared']}; verified "
        f"{'yes' if k['verified'] else 'NO'}")
    summary["steps"]["kvcache"] = {"steps": k["steps"], "hits_pinned": ks["hits_pinned"],
                                   "hits_block": ks["hits_block"], "hits_shared": ks["hits_shared"],
                                   "get_p50_s": ks["get_p50_s"], "put_p50_s": ks["put_p50_s"],
                                   "other_store_bytes_read": k["other_store_bytes_read"],
                                   "verified": k["verified"]}
    summary["ok"] &= k["verified"]

    out("[4/5] hot blocks: 256 blocks of 64 KiB put in batches of 64, flushed, got back, store reopened")
    with still_going("putting and getting hot blocks", every=tick, show=show):
        h = hot_blocks(router)
    out(f"  put {h['put_mib_s']:.0f} MiB/s (incl. flush), get {h['get_mib_s']:.0f} MiB/s (checksums verified); "
        f"index recovered from the {h['recovered']}; verified {'yes' if h['verified'] else 'NO'}")
    summary["steps"]["hot"] = {k2: h[k2] for k2 in ("put_mib_s", "get_mib_s", "recovered", "verified")}
    summary["ok"] &= h["verified"]

    out("[5/5] summary per data class (bytes each class's path moved in this run; pinned-memory hits move none)")
    with still_going("summing up", every=tick, show=show):
        summary["classes"] = _class_summary(router, summary["steps"])
    for line in _format_summary(summary["classes"]):
        out("  " + line)
    summary["seconds"] = time.perf_counter() - t_all
    return summary


def _class_summary(router: Router, steps: dict[str, Any]) -> dict[str, Any]:
    d = router.describe()
    rates = {
        "dataset": ("cold read", steps.get("training", {}).get("dataset_read_mib_s")),
        "checkpoint": ("checkpoint save", (steps.get("training", {}).get("checkpoint_bytes", 0) / MiB /
                                          steps["training"]["save_s"]) if steps.get("training") else None),
        "hot": ("get", steps.get("hot", {}).get("get_mib_s")),
        "kvcache": ("get p50", steps.get("kvcache", {}).get("get_p50_s")),
    }
    out: dict[str, Any] = {}
    for name, c in d["classes"].items():
        counters = dict(c.get("counters") or {})
        if name == "kvcache":  # the demo's second store (another process) read through a file path of its own
            counters["bytes_read"] = counters.get("bytes_read", 0) + steps.get("kvcache", {}).get(
                "other_store_bytes_read", 0)
        what, rate = rates.get(name, ("", None))
        out[name] = {
            "path": c["path"], "available": c["available"], "transport": c.get("transport"),
            "where": c.get("root"), "why": c.get("why", []), "fallbacks": c.get("fallbacks", []),
            "bytes_read": counters.get("bytes_read", 0), "bytes_written": counters.get("bytes_written", 0),
            "bytes_direct": counters.get("bytes_direct", 0), "bytes_bounced": counters.get("bytes_bounced", 0),
            "rate_what": what, "rate": rate,
        }
    return out


def _format_summary(classes: dict[str, Any]) -> list[str]:
    lines = [f"{'class':<11} {'path':<7} {'transport':<9} {'read MiB':>9} {'written':>8} {'direct':>8} "
             f"{'bounced':>8}  throughput"]
    for name, c in classes.items():
        rate = c["rate"]
        if rate is None:
            shown = "-"
        elif c["rate_what"].endswith("p50"):
            shown = f"{c['rate_what']} {rate * 1000:.2f} ms per batch"
        else:
            shown = f"{c['rate_what']} {rate:.0f} MiB/s"
        moved = (f"{c['bytes_read'] / MiB:>9.1f} {c['bytes_written'] / MiB:>8.1f} {c['bytes_direct'] / MiB:>8.1f} "
                 f"{c['bytes_bounced'] / MiB:>8.1f}")
        lines.append(f"{name:<11} {c['path']:<7} {c['transport'] or '-':<9} {moved}  {shown}")
        for f in c["fallbacks"]:
            lines.append(f"{'':<11} fallback: {f}")
    return lines


def _probe_summary(report: dict[str, Any]) -> str:
    """One line per probe section: what is there, what is absent and why (``sfstore probe`` has every detail)."""
    lines = ["what this machine has (sfstore probe prints the full table):"]
    for name, section in report.items():
        if not isinstance(section, dict) or "status" not in section:
            continue
        reason = section.get("reason")
        status = section["status"]
        text = f"  {name:<9} {status}" + (f": {reason}" if reason and status != "ok" else "")
        lines.append(text if len(text) <= 118 else text[:115] + "...")
    return "\n".join(lines)


def _du(path: str) -> int:
    """Bytes the files under ``path`` take on disk (allocated blocks: a preallocated image counts whole)."""
    total = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                continue
    return total


def run_demo(
    data_dir: str | None = None, size: int = 64 * MiB, show_probe: bool = True, config: str | None = None,
    json_out: str | None = None, shards: int = 32, tick: float = TICK_SECONDS,
) -> int:
    """Print the probe, the routing and every step, then the per-path summary; return 0 when all verified.

    ``data_dir`` (default: the ``data_dir`` setting) is the embedded default data directory for the run;
    ``config`` a config file (a real cluster's paths); ``json_out`` a file for the summary as JSON; ``tick``
    the seconds of quiet after which a running step says it is still going.
    """
    import sfstore
    from sfstore.probe import probe

    if config is not None:
        os.environ["SFSTORE_CONFIG"] = os.path.abspath(config)  # every face's sfstore.open() sees it
    with defaults.set(**({"data_dir": os.path.abspath(data_dir)} if data_dir else {})):
        if data_dir:
            os.environ["SFSTORE_DATA_DIR"] = os.path.abspath(data_dir)  # for the trainer and loader processes
        with still_going("opening the paths", every=tick):
            router = sfstore.open()
        if show_probe:
            with still_going("probing this machine", every=tick):
                report = probe(data_dir=data_dir)
            say(_probe_summary(report))
        say("routing")
        for line in router.format().splitlines():
            say("    " + line)
        say()
        try:
            summary = run_steps(router, size=size, shards=shards, tick=tick)
        finally:
            router.close()
    say()
    where = os.path.abspath(data_dir) if data_dir else str(defaults.get("data_dir"))
    say(f"demo {'verified' if summary['ok'] else 'FAILED'} in {summary['seconds']:.1f} s; its data is in {where} "
         f"({_du(where) / MiB:.0f} MiB, kept for the next run; remove it with: rm -rf {where})")
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo())
