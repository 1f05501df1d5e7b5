"""Suite ``vllm``: time to first token of a real vLLM engine with sfstore's connector, against no connector, against
vLLM's own filesystem connector (``ExampleConnector``) and against the physical bound of a hit, in one run.

Runs vLLM 0.32.0's CPU build from ``.venv-vllm-engine`` (``tools/vllm-engine-env.sh``; ``--engine-python``) on
random Llamas built in the bench directory (``--models``, default both, one after the other; float32):

* ``tiny``: 4 layers, hidden 256, 2 KV heads of 64: 128 KiB of KV per 32-token block (a sfstore file of 132 KiB);
* ``wide``: 4 layers, hidden 256, 8 KV heads of 128 (``head_dim`` set in the config): 1 MiB per block, the size of
  a real model's blocks, with a forward pass still cheap on a CPU.

``--repeat`` distinct prompts per length (``--lengths``, default 512, 1536 and 4096 tokens). For each model, each
side has its own engine process (``tools/bench/vllm_ttft.py``), all started first and kept alive, then interleaved:
every side times prompt ``i`` before any times prompt ``i + 1``, so a change of load on the machine falls on every
side alike. TTFT is the wall time of ``LLM.generate(max_tokens=1)`` for one prompt (after a warm-up prompt at
start-up). Sides:

* ``none``: no connector (vLLM's prefix cache is off everywhere, so every hit is the connector's);
* ``sfstore-pinned``: the same prompt again in the process that just saved it (hits from the pinned tier);
* ``sfstore-shared-cold``: another process on the same ``shared_dir`` (prompts it has never seen), the files
  evicted from the page cache first (fsync, ``posix_fadvise(DONTNEED)``);
* ``example-cold``: vLLM's ``ExampleConnector`` (safetensors files per request in a directory) in another process
  than the one that saved the prompt, its files evicted the same way;
* ``example-warm``: the same prompt again in the ``ExampleConnector`` process that just saved it (its files in the
  page cache): the peer's hit in that case, beside ``sfstore-pinned``;
* ``sfstore-miss``: the process that saved the blocks, timing the first pass (a miss that saves every block), for
  what saving costs;
* ``floor``: that process once more with the connector's loads cut out (vLLM still skips the hit tokens, nothing is
  copied, the output is meaningless): vLLM's own time for a hit;
* ``fio``: fio's cold read of the files ``sfstore-shared-cold`` reads: those the prompt's save added to the shared
  tier (``shared_dir``'s files that are not hidden), headers included, less the last block's file where the hit
  does not load it (:func:`hit_files`), right after ``sfstore-shared-cold``: each file fsynced and dropped from the
  page cache, then read whole with O_DIRECT, io_uring, queue depth 32 (``tools.bench.fio.read_files_cold``): the
  disk's time for those bytes;
* ``bound``: the physical bound of the hit, per prompt the larger of ``floor`` and ``fio``: the least TTFT a
  connector could reach, with free loads and files read at the disk's speed.

Both connectors load the same tokens (every full block but the last token's) and the same KV bytes: sfstore as
files in its shared tier (verified with their checksums on the way in), ``ExampleConnector`` as one safetensors
file per layer and prompt (not verified); ``params`` records each side's files, bytes, and the bytes still in the
page cache after the eviction (``fincore``).

The document has ``ttft`` (per model and prompt length, each side's TTFT: median, min-max, samples, cached tokens)
and, in the common shape, one case per pair (``sfstore``: our side, ``reference``: the other; ``ratio``: the other's
TTFT over ours, the median of the per-prompt ratios, so > 1 means sfstore is faster), with the goals
(:data:`tools.bench.vllm_cases.GOALS`) in ``acceptance``. Issue 27, at 1536 and 4096 tokens: wide model,
``sfstore-shared-cold`` within 1.3x of the bound and >= 2.5x faster than ``example-cold``; tiny model,
``sfstore-shared-cold`` >= 1.3x faster than ``example-cold`` and ``sfstore-pinned`` at least as fast as
``example-warm``. Issue 16, tiny model at 1536 tokens: ``sfstore-shared-cold`` <= 0.5x ``none``'s TTFT,
``sfstore-pinned`` <= 0.2x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from tools.bench.common import (
    BenchSetupError,
    check_bench_dir,
    default_bench_dir,
    drop_cache,
    machine_info,
    render_ttft_table,
    resident_bytes,
    utc_now,
)
from tools.bench.fio import find_fio, fio_version, read_files_cold
from tools.bench.options import add_fio
from tools.bench.registry import Suite, register
from tools.bench.vllm_cases import (
    BLOCK_TOKENS,
    MODELS,
    BenchModel,
    bound_line,
    pair_cases,
    parse_models,
    physical_bound,
)
from tools.bench.vllm_ttft import PREFIX

ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).resolve().parents[1] / "vllm_ttft.py"
SIDES = ("none", "sfstore-pinned", "sfstore-shared-cold", "example-cold", "example-warm", "sfstore-miss", "floor",
         "fio")
HIT_SIDES = ("sfstore-pinned", "sfstore-shared-cold", "example-cold", "example-warm")
FIO_IODEPTH = 32
EAGER = [False]  # --eager, for every engine process of the run
MODEL_SCRIPT = """
import json, sys, torch, transformers
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**json.loads(sys.argv[2]))
transformers.LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the vllm suite's options.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The suite's parser (common options already added).
    """
    g = parser.add_argument_group("vllm suite")
    g.add_argument("--engine-python", metavar="PATH", default=str(ROOT / ".venv-vllm-engine" / "bin" / "python"),
                   help="Python of the engine venv (default .venv-vllm-engine/bin/python; tools/vllm-engine-env.sh)")
    g.add_argument("--eager", action="store_true",
                   help="vLLM's enforce_eager (no torch.compile: shorter start-up, slower forward passes)")
    g.add_argument("--lengths", default="512,1536,4096", metavar="N,N",
                   help="prompt lengths in tokens (default 512,1536,4096; --quick: 1536)")
    g.add_argument("--models", type=parse_models, default=list(MODELS.values()), metavar="NAME,NAME",
                   help=f"models, one after the other (default {','.join(MODELS)}): tiny (128 KiB per 32-token "
                        "block), wide (1 MiB per block)")
    add_fio(g)


class _Engine:
    """One side's engine process (``vllm_ttft.py``), kept alive for the whole run and asked one prompt at a time."""

    def __init__(self, python: str, work: Path, name: str, spec: dict[str, Any]) -> None:
        self.name = name
        self.error: str | None = None
        self.info: dict[str, Any] = {}  # what the process said when ready (where its vllm and sfstore come from)
        spec_file = work / f"{name}.spec.json"
        spec_file.write_text(json.dumps({**spec, "eager": EAGER[0]}))
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false")
        self._log = open(work / f"{name}.log", "w")  # closed in close()
        self._proc = subprocess.Popen([python, str(CHILD), str(spec_file)], cwd=work, env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        kind, body = self._read()
        if kind == "ready":
            self.info = body
        else:
            self.error = str(body.get("error") or f"engine process {name} did not start")
            self.close()

    def _read(self) -> tuple[str, dict[str, Any]]:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(PREFIX):
                kind, _, body = line[len(PREFIX):].partition(" ")
                return kind, json.loads(body)
            self._log.write(line)
        code = self._proc.wait()
        self._log.flush()
        tail = Path(self._log.name).read_text()[-400:]
        return "error", {"error": f"engine process {self.name} exited {code}: {tail}"}

    def ask(self, prompt: list[int], repeat: int = 1, wait_puts: bool = False, floor: bool = False) -> dict[str, Any]:
        """Time ``prompt`` (``repeat`` passes): ``{"ttft_s": [...], "cached": [...]}`` or ``{"error": ...}``."""
        if self.error is not None:
            return {"error": self.error}
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"prompt": prompt, "repeat": repeat, "wait_puts": wait_puts,
                                               "floor": floor}) + "\n")
            self._proc.stdin.flush()
        except OSError as exc:
            self.error = f"engine process {self.name}: {exc}"
            return {"error": self.error}
        kind, body = self._read()
        if kind != "reply":
            if self._proc.poll() is not None:
                self.error = str(body.get("error"))
            return {"error": str(body.get("error"))}
        return body

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self._proc.stdin.close()
            try:
                self._proc.wait(120)  # the engine's shutdown drains sfstore's background writes
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


def _evict(directory: Path, check: bool = False) -> dict[str, Any]:
    """Evict every file under ``directory`` from the page cache; its files, bytes and (``check``) what stayed
    resident (``fincore``; None where it cannot tell)."""
    files = [p for p in directory.rglob("*") if p.is_file()] if directory.is_dir() else []
    kept = []
    for path in files:
        try:
            drop_cache(path)
            kept.append((path, path.stat().st_size))
        except FileNotFoundError:  # a temporary file renamed into place, or a block file evicted, meanwhile
            continue
    out: dict[str, Any] = {"files": len(kept), "bytes": sum(size for _, size in kept)}
    if check:
        resident = [resident_bytes(p) for p, _ in kept]
        out["resident_bytes_after_evict"] = None if None in resident else sum(r or 0 for r in resident)
    return out


def _summary(samples: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "samples_s": samples}


def _data_files(directory: Path) -> set[Path]:
    """The files under ``directory`` that are not hidden (no part of the path below it starts with a dot) nor links: a
    shared tier's KV files, without its records (``.sfkv/``), files on their way out (``.evicting-*``) and chunk
    links."""
    if not directory.is_dir():
        return set()
    return {p for p in directory.rglob("*")  # (a chunk's link names a file, it holds no bytes of its own)
            if p.is_file() and not p.is_symlink()
            and not any(part.startswith(".") for part in p.relative_to(directory).parts)}


def hit_files(saved: list[Path], blocks: int) -> list[Path]:
    """The files of ``saved`` (a prompt's files in the shared tier) that a full hit of ``blocks`` blocks reads.

    A prompt of a multiple of 32 tokens is saved whole, but a hit of it loads one block less (vLLM computes the
    last token), so where the tier holds one file per block and more files than the hit's blocks, the files written
    last are left out (the blocks' files all have one size: the same bytes whichever are left out). Where it holds
    fewer (several blocks per file), every file.

    Parameters
    ----------
    saved : list of Path
        The prompt's files.
    blocks : int
        The blocks a full hit of the prompt loads: ``(tokens - 1) // 32``.

    Returns
    -------
    list of Path
        The files, in the order they were written (modification time).
    """
    ordered = sorted(saved, key=lambda f: (f.stat().st_mtime_ns, str(f)))
    if 0 < blocks < len(ordered) and len({f.stat().st_size for f in ordered}) == 1:
        return ordered[:blocks]
    return ordered


def _run_model(python: str, work: Path, model: BenchModel, lengths: list[int], repeat: int, seed: int,
               fio: str | None, fio_error: str | None, files: dict[str, Any],
               engines_info: dict[str, Any]) -> list[dict[str, Any]]:
    """Build ``model`` in ``work``, run every side on its prompts; its ``ttft`` entries, one per length."""
    work.mkdir(parents=True)
    path = work / f"{model.name}-llama"
    made = subprocess.run([python, "-c", MODEL_SCRIPT, str(path), json.dumps(model.config())],
                          capture_output=True, text=True, timeout=600)
    if made.returncode:
        raise BenchSetupError(f"building the {model.name} model failed: {made.stderr[-400:]}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(model.vocab) for _ in range(n)] for n in lengths for _ in range(repeat)]
    shared, example = work / "shared", work / "example"
    m, kv = str(path), model.kv_cache_bytes()
    ours, theirs = {"shared_dir": str(shared)}, {"shared_storage_path": str(example)}
    specs: dict[str, dict[str, Any]] = {
        "none": {"model": m, "connector": "none", "kv_cache_bytes": kv},
        "sfstore-save": {"model": m, "connector": "sfstore", "extra": ours, "kv_cache_bytes": kv},
        "sfstore-cold": {"model": m, "connector": "sfstore", "extra": ours, "kv_cache_bytes": kv},
        "example-save": {"model": m, "connector": "example", "extra": theirs, "kv_cache_bytes": kv},
        "example-cold": {"model": m, "connector": "example", "extra": theirs, "kv_cache_bytes": kv},
    }
    engines: dict[str, _Engine] = {}
    results: dict[str, dict[int, dict[str, Any]]] = {s: {} for s in SIDES}  # side -> prompt index -> its pass
    errors: dict[str, str] = {}
    if fio is None:
        errors["fio"] = fio_error or "no fio"

    def note(side: str, got: dict[str, Any], i: int, index: int = 0) -> None:
        if got.get("error"):
            errors.setdefault(side, str(got["error"]))
            return
        results[side][i] = {"ttft_s": got["ttft_s"][index], "cached": got["cached"][index]}

    try:
        for name, spec in specs.items():  # one after the other: each start compiles the model
            engines[name] = _Engine(python, work, name, spec)
            if engines[name].info:
                engines_info.setdefault(model.name, engines[name].info)
        # Interleaved: every side times prompt i before any side times prompt i + 1 (BENCHMARKING.md, rule 4)
        order = [li * repeat + r for r in range(repeat) for li in range(len(lengths))]
        cold_misses = 0  # the cold process's deadline misses so far
        for i in order:
            p = prompts[i]
            last = i == order[-1]
            note("none", engines["none"].ask(p), i)
            before = _data_files(shared)
            saved = engines["sfstore-save"].ask(p, repeat=2, wait_puts=True, floor=True)
            added = sorted(_data_files(shared) - before)  # this prompt's files in the shared tier
            note("sfstore-miss", saved, i, 0)
            note("sfstore-pinned", saved, i, 1)
            if "floor_s" in saved:
                note("floor", {"ttft_s": [saved["floor_s"]], "cached": [saved["cached"][1]]}, i)
            files[f"{model.name} sfstore-shared"] = _evict(shared, check=last)
            # wait_puts: a block this process had to recompute (a load that failed) is saved again in the
            # background; that write is not left to overlap fio and the sides after
            cold = engines["sfstore-cold"].ask(p, wait_puts=True)
            note("sfstore-shared-cold", cold, i)
            if i in results["sfstore-shared-cold"] and isinstance(cold.get("deadline_misses"), int):
                results["sfstore-shared-cold"][i]["deadline_misses"] = cold["deadline_misses"] - cold_misses
                cold_misses = cold["deadline_misses"]
            if fio is not None:
                hit = hit_files(added, (len(p) - 1) // BLOCK_TOKENS)
                if not hit:
                    errors.setdefault("fio", "the save added no files to the shared tier")
                else:
                    try:
                        read = read_files_cold(fio, [str(f) for f in hit], f"{model.name}-{len(p)}", FIO_IODEPTH)
                    except BenchSetupError as exc:
                        errors.setdefault("fio", str(exc))
                    else:
                        results["fio"][i] = {"ttft_s": read.seconds, "bytes": read.bytes, "files": len(hit),
                                             "files_saved": len(added), "unread_bytes": read.extra["unread_bytes"]}
            note("example-warm", engines["example-save"].ask(p, repeat=2), i, 1)
            files[f"{model.name} example"] = _evict(example, check=last)
            note("example-cold", engines["example-cold"].ask(p), i)
    finally:
        for engine in engines.values():
            engine.close()
    ttft = []
    for li, n in enumerate(lengths):
        idx = range(li * repeat, (li + 1) * repeat)
        entry: dict[str, Any] = {"name": f"{model.name}-ttft-{n}",
                                 "params": {"model": model.name, "prompt_tokens": n,
                                            "block_bytes": model.block_bytes()}, "sides": {}}
        for side in SIDES:
            got = [results[side].get(i) for i in idx]
            if side in errors or any(g is None for g in got):
                entry["sides"][side] = {"error": errors.get(side) or "no samples"}
                continue
            passes = [g for g in got if g is not None]
            summary = _summary([g["ttft_s"] for g in passes])
            if side == "fio":
                summary.update({k: [g[k] for g in passes] for k in ("bytes", "files", "files_saved", "unread_bytes")})
            else:
                summary["cached_tokens"] = [g["cached"] for g in passes]
                full = (n - 1) // BLOCK_TOKENS * BLOCK_TOKENS  # every full block but the last token's
                if side in HIT_SIDES and any(c < full for c in summary["cached_tokens"]):
                    print(f"warning: {side} did not hit all of some {model.name} {n}-token prompts (cached tokens "
                          f"{summary['cached_tokens']}, a full hit {full}): its TTFT is not a full hit's", flush=True)
            if all("deadline_misses" in g for g in passes):
                summary["deadline_misses"] = [g["deadline_misses"] for g in passes]
                if any(summary["deadline_misses"]):
                    print(f"warning: {side}: sfstore operations past their deadline on {model.name} {n}-token "
                          f"prompts: {summary['deadline_misses']}", flush=True)
            entry["sides"][side] = summary
        entry["sides"]["bound"] = physical_bound(entry["sides"]["floor"], entry["sides"]["fio"])
        ttft.append(entry)
    return ttft


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suite; print one line per case; return its JSON document."""
    python = args.engine_python
    if not os.access(python, os.X_OK):
        raise BenchSetupError(f"no engine venv at {python}: tools/vllm-engine-env.sh makes .venv-vllm-engine")
    EAGER[0] = bool(args.eager)
    models: list[BenchModel] = list(args.models)
    fio: str | None = None
    fio_error: str | None = None
    try:
        fio = find_fio(getattr(args, "fio", None))
    except BenchSetupError as exc:  # the bound is then n/a; every TTFT is still measured
        fio_error = str(exc)
        print(f"warning: {exc}: no physical bound", flush=True)
    base = Path(args.dir or default_bench_dir())
    check_bench_dir(base)
    work = base / "vllm"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    lengths = [1536] if args.quick else [int(x) for x in str(args.lengths).split(",") if x]
    ttft: list[dict[str, Any]] = []
    files: dict[str, Any] = {}
    engines_info: dict[str, Any] = {}
    for model in models:
        ttft += _run_model(python, work / model.name, model, lengths, args.repeat, args.seed, fio, fio_error, files,
                           engines_info)
    cases, acceptance = pair_cases(ttft)
    print(render_ttft_table(ttft), flush=True)
    for entry in ttft:
        print(bound_line(entry), flush=True)
    for item in acceptance:
        print(item["line"], flush=True)
    return {"bench": "vllm", "machine": machine_info(base), "date": utc_now(), "ttft": ttft, "cases": cases,
            "acceptance": acceptance,
            "params": {"eager": bool(args.eager), "repeat": args.repeat, "lengths": lengths, "files": files,
                       "models": {m.name: {"config": m.config(), "block_bytes": m.block_bytes(),
                                           "kv_cache_bytes": m.kv_cache_bytes()} for m in models},
                       "engine": engines_info,
                       "fio": {"exe": fio, "version": fio_version(fio) if fio else None, "iodepth": FIO_IODEPTH,
                               "error": fio_error}}}


register(Suite(name="vllm", help="time to first token in a real vLLM engine (CPU): sfstore's tiers vs no connector "
                                 "vs vLLM's ExampleConnector vs the physical bound (tiny and wide-KV models)",
               add_arguments=add_arguments, run=run))
