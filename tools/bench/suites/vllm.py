"""Suite ``vllm``: time to first token of a real vLLM engine with sfstore's connector, against no connector and
against vLLM's own filesystem connector (``ExampleConnector``), in one run.

Runs vLLM 0.32.0's CPU build from ``.venv-vllm-engine`` (``tools/vllm-engine-env.sh``; ``--engine-python``) on a
tiny random Llama (4 layers, hidden 256, 2 KV heads, float32) built in the bench directory, ``--repeat`` distinct
prompts per length (``--lengths``, default 512, 1536 and 4096 tokens). Each side has its own engine process
(``tools/bench/vllm_ttft.py``), all started first and kept alive, then interleaved: every side times prompt ``i``
before any times prompt ``i + 1``, so a change of load on the machine falls on every side alike. TTFT is the wall
time of ``LLM.generate(max_tokens=1)`` for one prompt (after a warm-up prompt at start-up). Sides:

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
  copied, the output is meaningless): vLLM's own time for a hit, the least any connector could reach. Each goal
  against another side also reports ``bound``, that side's TTFT over the floor's: the ratio a connector with free
  loads would get.

Both connectors load the same tokens (every full block but the last token's) and the same KV bytes: sfstore as one
file per block (a 4 KiB header, then the block, verified with its xxh3-64 on the way in), ``ExampleConnector`` as
one safetensors file per layer and prompt (not verified); ``params`` records each side's files, bytes, and the
bytes still in the page cache after the eviction (``fincore``).

The document has ``ttft`` (per prompt length, each side's TTFT: median, min-max, samples, cached tokens) and, in
the common shape, one case per pair (``sfstore``: our side, ``reference``: the other; ``ratio``: the other's TTFT
over ours, the median of the per-prompt ratios, so > 1 means sfstore is faster) with the goals (issue 16, on a
1536-token prompt) in ``acceptance``: ``sfstore-shared-cold`` <= 0.5 x ``none``'s TTFT (ratio >= 2),
``sfstore-pinned`` <= 0.2 x (ratio >= 5), and hits >= 1.5 x faster than the peer's in the same case:
``sfstore-shared-cold`` than ``example-cold``, ``sfstore-pinned`` than ``example-warm``.
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
from tools.bench.registry import Suite, register
from tools.bench.vllm_ttft import PREFIX

ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).resolve().parents[1] / "vllm_ttft.py"
#: (our side, the other, the goal on our TTFT / theirs at GOAL_TOKENS, or None)
PAIRS = (("sfstore-shared-cold", "none", 0.5), ("sfstore-pinned", "none", 0.2),
         ("sfstore-shared-cold", "example-cold", 1 / 1.5), ("sfstore-pinned", "example-warm", 1 / 1.5),
         ("sfstore-miss", "none", None))
GOAL_TOKENS = 1536
SIDES = ("none", "sfstore-pinned", "sfstore-shared-cold", "example-cold", "example-warm", "sfstore-miss", "floor")
HIT_SIDES = ("sfstore-pinned", "sfstore-shared-cold", "example-cold", "example-warm")
REFERENCE_TOOLS = {"none": "vLLM, no connector", "example-cold": "vLLM ExampleConnector",
                   "example-warm": "vLLM ExampleConnector"}
EAGER = [False]  # --eager, for every engine process of the run
MODEL_SCRIPT = """
import sys, torch, transformers
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, initializer_range=0.1)
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


class _Engine:
    """One side's engine process (``vllm_ttft.py``), kept alive for the whole run and asked one prompt at a time."""

    def __init__(self, python: str, work: Path, name: str, spec: dict[str, Any]) -> None:
        self.name = name
        self.error: str | None = None
        spec_file = work / f"{name}.spec.json"
        spec_file.write_text(json.dumps({**spec, "eager": EAGER[0]}))
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false")
        self._log = open(work / f"{name}.log", "w")  # closed in close()
        self._proc = subprocess.Popen([python, str(CHILD), str(spec_file)], cwd=work, env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        kind, body = self._read()
        if kind != "ready":
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
    for path in files:
        drop_cache(path)
    out: dict[str, Any] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    if check:
        resident = [resident_bytes(p) for p in files]
        out["resident_bytes_after_evict"] = None if None in resident else sum(r or 0 for r in resident)
    return out


def _summary(samples: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "samples_s": samples}


def _short(side: str) -> str:
    return side.removeprefix("sfstore-").removesuffix("-cold") if side != "sfstore-shared-cold" else "shared-cold"


def pair_cases(ttft: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The common-shape cases (one per pair of sides and prompt length) and the goals, from the ``ttft`` entries.

    Parameters
    ----------
    ttft : list of dict
        Per prompt length: ``name``, ``params`` (``prompt_tokens``) and ``sides`` (side name -> its summary, with
        ``samples_s`` in prompt order, or ``error``).

    Returns
    -------
    tuple
        ``(cases, acceptance)``. A case's ``ratio`` is the other side's TTFT over ours, the median of the per-prompt
        ratios (``ratio_min``, ``ratio_max``); ``ttft_ratio`` is ours over theirs, medians. ``acceptance`` holds one
        entry per goal (``goal``, ``case``, ``target`` on ``ratio``, ``status``, ``met``, ``line``).
    """
    cases: list[dict[str, Any]] = []
    acceptance: list[dict[str, Any]] = []
    for entry in ttft:
        n = int(entry["params"]["prompt_tokens"])
        for ours, other, limit in PAIRS:
            a, b = entry["sides"].get(ours), entry["sides"].get(other)
            if a is None or b is None:
                continue
            name = f"ttft-{n}-{_short(ours)}-vs-{_short(other)}"
            case: dict[str, Any] = {"name": name, "params": {"prompt_tokens": n, "side": ours, "versus": other},
                                    "sfstore": a, "reference_tool": REFERENCE_TOOLS.get(other, other), "reference": b,
                                    "ratio": None, "ratio_min": None, "ratio_max": None}
            if "median_s" in a and "median_s" in b:
                per = [y / x for x, y in zip(a["samples_s"], b["samples_s"], strict=False) if x > 0]
                case.update(ratio=statistics.median(per), ratio_min=min(per), ratio_max=max(per),
                            ttft_ratio=a["median_s"] / b["median_s"])
            cases.append(case)
            if limit is None or n != GOAL_TOKENS:
                continue
            target = 1 / limit
            goal = (f"{n}-token TTFT, {ours} <= {limit:.2g}x {other}" if other == "none" else
                    f"{n}-token TTFT, {ours} >= {target:.2g}x faster than {other}")
            item: dict[str, Any] = {"goal": goal, "case": name, "target": target}
            if case["ratio"] is None:
                why = a.get("error") or b.get("error") or "no samples"
                item.update(status="n/a", met=None, reason=why, line=f"goal: {goal}: n/a ({why})")
            else:
                r = float(case["ratio"])
                met = r >= target
                line = f"goal: {goal}: {'PASS' if met else 'MISS'}, TTFT {1 / r:.2f}x ({r:.2f}x faster)"
                floor = entry["sides"].get("floor") or {}
                if floor.get("median_s"):
                    item["bound"] = float(b["median_s"]) / float(floor["median_s"])
                    line += f"; a connector with free loads: {item['bound']:.2f}x"
                pinned = entry["sides"].get("sfstore-pinned") or {}
                if ours == "sfstore-shared-cold" and other != "none" and pinned.get("median_s"):
                    # sfstore's pinned hit is the same hit with nothing read from disk: no cold read can beat it
                    item["bound_no_disk"] = float(b["median_s"]) / float(pinned["median_s"])
                    line += f"; a cold read costing no more than a pinned hit: {item['bound_no_disk']:.2f}x"
                item.update(ratio=r, status="met" if met else "missed", met=met, line=line)
                if not met:
                    item["missed_by"] = target - r
            acceptance.append(item)
    return cases, acceptance


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suite; print one line per case; return its JSON document."""
    python = args.engine_python
    if not os.access(python, os.X_OK):
        raise BenchSetupError(f"no engine venv at {python}: tools/vllm-engine-env.sh makes .venv-vllm-engine")
    EAGER[0] = bool(args.eager)
    base = Path(args.dir or default_bench_dir())
    check_bench_dir(base)
    work = base / "vllm"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = work / "tiny-llama"
    made = subprocess.run([python, "-c", MODEL_SCRIPT, str(model)], capture_output=True, text=True, timeout=600)
    if made.returncode:
        raise BenchSetupError(f"building the tiny model failed: {made.stderr[-400:]}")
    lengths = [1536] if args.quick else [int(x) for x in str(args.lengths).split(",") if x]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8192) for _ in range(n)] for n in lengths for _ in range(args.repeat)]
    shared, example = work / "shared", work / "example"
    m = str(model)
    ours, theirs = {"shared_dir": str(shared)}, {"shared_storage_path": str(example)}
    specs: dict[str, dict[str, Any]] = {
        "none": {"model": m, "connector": "none"},
        "sfstore-save": {"model": m, "connector": "sfstore", "extra": ours},
        "sfstore-cold": {"model": m, "connector": "sfstore", "extra": ours},
        "example-save": {"model": m, "connector": "example", "extra": theirs},
        "example-cold": {"model": m, "connector": "example", "extra": theirs},
    }
    engines: dict[str, _Engine] = {}
    results: dict[str, dict[str, list[Any]]] = {s: {"ttft_s": [], "cached": []} for s in SIDES}
    errors: dict[str, str] = {}
    files: dict[str, Any] = {}

    def note(side: str, got: dict[str, Any], index: int = 0) -> None:
        if got.get("error"):
            errors.setdefault(side, str(got["error"]))
            return
        results[side]["ttft_s"].append(got["ttft_s"][index])
        results[side]["cached"].append(got["cached"][index])

    try:
        for name, spec in specs.items():  # one after the other: each start compiles the model
            engines[name] = _Engine(python, work, name, spec)
        # Interleaved: every side times prompt i before any side times prompt i + 1 (BENCHMARKING.md, rule 4)
        order = [li * args.repeat + r for r in range(args.repeat) for li in range(len(lengths))]
        for i in order:
            p = prompts[i]
            note("none", engines["none"].ask(p))
            saved = engines["sfstore-save"].ask(p, repeat=2, wait_puts=True, floor=True)
            note("sfstore-miss", saved, 0)
            note("sfstore-pinned", saved, 1)
            if "floor_s" in saved:
                note("floor", {"ttft_s": [saved["floor_s"]], "cached": [saved["cached"][1]]})
            files["sfstore-shared"] = _evict(shared, check=i == order[-1])
            note("sfstore-shared-cold", engines["sfstore-cold"].ask(p))
            note("example-warm", engines["example-save"].ask(p, repeat=2), 1)
            files["example"] = _evict(example, check=i == order[-1])
            note("example-cold", engines["example-cold"].ask(p))
    finally:
        for engine in engines.values():
            engine.close()
    sides: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        back = sorted(range(len(results[side]["ttft_s"])), key=lambda j: order[j])  # back in prompt order
        sides[side] = {"ttft_s": [results[side]["ttft_s"][j] for j in back],
                       "cached": [results[side]["cached"][j] for j in back], "error": errors.get(side)}
    ttft = []
    for li, n in enumerate(lengths):
        rows = slice(li * args.repeat, (li + 1) * args.repeat)
        entry: dict[str, Any] = {"name": f"ttft-{n}", "params": {"prompt_tokens": n}, "sides": {}}
        for side, res in sides.items():
            if res.get("error") or len(res.get("ttft_s") or []) != len(prompts):
                entry["sides"][side] = {"error": res.get("error") or "no samples"}
                continue
            entry["sides"][side] = {**_summary(res["ttft_s"][rows]), "cached_tokens": res["cached"][rows]}
            if side in HIT_SIDES and not all(res["cached"][rows]):
                print(f"warning: {side} missed on some {n}-token prompts (cached tokens {res['cached'][rows]}): "
                      "its TTFT is not a hit's", flush=True)
        ttft.append(entry)
    cases, acceptance = pair_cases(ttft)
    print(render_ttft_table(ttft), flush=True)
    for item in acceptance:
        print(item["line"], flush=True)
    return {"bench": "vllm", "machine": machine_info(base), "date": utc_now(), "ttft": ttft, "cases": cases,
            "acceptance": acceptance,
            "params": {"eager": bool(args.eager), "repeat": args.repeat, "lengths": lengths, "files": files}}


register(Suite(name="vllm", help="time to first token in a real vLLM engine (CPU): sfstore's tiers vs no connector "
                                 "vs vLLM's ExampleConnector", add_arguments=add_arguments, run=run))
