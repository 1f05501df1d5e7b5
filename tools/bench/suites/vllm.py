"""Suite ``vllm``: time to first token of a real vLLM engine with sfstore's connector, against no connector and
against vLLM's own filesystem connector (``ExampleConnector``), in one run.

Runs vLLM 0.32.0's CPU build from ``.venv-vllm-engine`` (``tools/vllm-engine-env.sh``; ``--engine-python``) on a
tiny random Llama (4 layers, hidden 256, 2 KV heads, float32) built in the bench directory, each side in its own
engine process (``tools/bench/vllm_ttft.py``), ``--repeat`` distinct prompts per length (``--lengths``, default
512, 1536 and 4096 tokens). TTFT is the wall time of ``LLM.generate(max_tokens=1)`` for one prompt after a
warm-up prompt. Sides:

* ``none``: no connector (vLLM's prefix cache is off everywhere, so every hit is the connector's);
* ``sfstore-pinned``: the same prompt again in the process that saved it (hits from the pinned tier);
* ``sfstore-shared-cold``: a new process on the same ``shared_dir``, its files evicted from the page cache first
  (fsync, ``posix_fadvise(DONTNEED)``);
* ``example-cold``: vLLM's ``ExampleConnector`` (safetensors files per request in a directory), a new process
  after the saving one, its files evicted the same way.

Goals (issue 16): on a 1536-token prompt, ``sfstore-shared-cold`` <= 0.5 x ``none``, ``sfstore-pinned`` <= 0.2 x
``none``, ``example-cold`` >= 1.5 x ``sfstore-shared-cold``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from tools.bench.common import BenchSetupError, check_bench_dir, default_bench_dir, drop_cache, machine_info, utc_now
from tools.bench.registry import Suite, register

ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).resolve().parents[1] / "vllm_ttft.py"
GOALS = (("sfstore-shared-cold", "none", 0.5), ("sfstore-pinned", "none", 0.2), ("sfstore-shared-cold", "example-cold",
                                                                                 1 / 1.5))
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


def _child(python: str, work: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_file, out_file = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_file.write_text(json.dumps({**spec, "eager": EAGER[0]}))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([python, str(CHILD), str(spec_file), str(out_file)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=1800)
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if not out_file.exists():
        return {"error": f"engine process exited {proc.returncode}: {proc.stderr[-400:]}"}
    out: dict[str, Any] = json.loads(out_file.read_text())
    return out


def _evict(directory: Path) -> int:
    n = 0
    for path in directory.rglob("*"):
        if path.is_file():
            drop_cache(path)
            n += 1
    return n


def _summary(samples: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "samples_s": samples}


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
    sides: dict[str, dict[str, Any]] = {}
    sides["none"] = _child(python, work, "none", {"model": str(model), "connector": "none", "prompts": prompts})
    saved = _child(python, work, "sfstore-save", {"model": str(model), "connector": "sfstore", "repeat_same": True,
                                                  "extra": {"shared_dir": str(shared)}, "prompts": prompts})
    sides["sfstore-pinned"] = {"ttft_s": saved.get("again_s"), "cached": saved.get("cached_again"),
                               "error": saved.get("error")}
    _evict(shared)
    sides["sfstore-shared-cold"] = _child(python, work, "sfstore-cold", {
        "model": str(model), "connector": "sfstore", "extra": {"shared_dir": str(shared)}, "prompts": prompts})
    esaved = _child(python, work, "example-save", {"model": str(model), "connector": "example",
                                                   "extra": {"shared_storage_path": str(example)}, "prompts": prompts})
    if esaved.get("error"):
        sides["example-cold"] = {"error": esaved["error"]}
    else:
        _evict(example)
        sides["example-cold"] = _child(python, work, "example-cold", {
            "model": str(model), "connector": "example", "extra": {"shared_storage_path": str(example)},
            "prompts": prompts})
    cases = []
    for li, n in enumerate(lengths):
        rows = slice(li * args.repeat, (li + 1) * args.repeat)
        case: dict[str, Any] = {"name": f"ttft-{n}", "params": {"prompt_tokens": n}, "sides": {}}
        for side, res in sides.items():
            if res.get("error") or not res.get("ttft_s"):
                case["sides"][side] = {"error": res.get("error") or "no samples"}
                continue
            case["sides"][side] = {**_summary(res["ttft_s"][rows]), "cached_tokens": res["cached"][rows]}
        for a, b, limit in GOALS:
            sa, sb = case["sides"].get(a, {}), case["sides"].get(b, {})
            if "median_s" in sa and "median_s" in sb:
                ratio = sa["median_s"] / sb["median_s"]
                case.setdefault("ratios", {})[f"{a}/{b}"] = {"ratio": ratio, "goal_max": limit, "met": ratio <= limit}
        line = ", ".join(f"{s} {v['median_s'] * 1e3:.1f} ms ({v['min_s'] * 1e3:.1f}-{v['max_s'] * 1e3:.1f})"
                         if "median_s" in v else f"{s}: {v['error']}" for s, v in case["sides"].items())
        print(f"ttft-{n}: {line}", flush=True)
        for name, r in case.get("ratios", {}).items():
            print(f"  {name} = {r['ratio']:.2f} (goal <= {r['goal_max']:.2f}: {'met' if r['met'] else 'NOT met'})",
                  flush=True)
        cases.append(case)
    return {"bench": "vllm", "machine": machine_info(base), "date": utc_now(), "cases": cases,
            "params": {"eager": bool(args.eager), "repeat": args.repeat, "lengths": lengths}}


register(Suite(name="vllm", help="time to first token in a real vLLM engine (CPU): sfstore's tiers vs no connector "
                                 "vs vLLM's ExampleConnector", add_arguments=add_arguments, run=run))
