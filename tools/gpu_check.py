"""What a machine with a CUDA GPU can check that CPU-only CI cannot: the one script to run there (the device tool's
H200), a thin driver of the two places the work lives.

    python tools/gpu_check.py [--blocks 512] [--block-size 2m] [--repeat 3] [--budget 420] [--json OUT]
                              [--device cuda|cpu] [--skip-bench] [--tests PATH ...]

Steps, each printed as PASS/FAIL/SKIP with the reason, each a subprocess bounded by what is left of ``--budget``
(one past it is stopped, a FAIL, and the steps after it SKIP, saying so):

  tests                        ``pytest -m gpu`` over tests/gpu/ and every other test file holding tests marked
                               ``gpu`` (or the ``--tests`` given): functional checks, each a test; without a GPU
                               every one SKIPs, saying why; a failed test is a FAIL of the step;
  bench_gpu                    ``python -m tools.bench gpu``: GPU memory to storage and back through the device path
                               (gds/compat/staged, torch and cupy) and the KV cache's tiers, each against
                               ``t.cpu()`` + pwrite / ``np.fromfile`` + ``.cuda()``, and per-layer loads behind a
                               stand-in compute (goal: >= 70% of the load time hidden); ratios and goal lines;
  bench_checkpoint_save_async  ``python -m tools.bench checkpoint --cases 'save_async*'``;
  bench_kvcache_nixl           ``python -m tools.bench kvcache --cases '*nixl*'`` with .venv-kvbench's python where
                               there is one (NIXL lives there); SKIP with the bench's reason where NIXL cannot run.

A missed bench goal is reported, not a FAIL; a goal a bench could not measure is one (an n/a with its reason is
not). Exit status: 1 when any step FAILED, else 0 (SKIPs included). ``--device cpu`` runs the gpu suite with CPU
torch tensors (the routes that take them): it exercises this script and the suite where no GPU is.

``--json OUT`` writes ``steps`` (``step``, ``status``, ``detail``, ``seconds``, ``metrics``), ``tests`` (each test:
``test``, ``status``, ``message``), ``bench_gpu`` (the suite's JSON document), ``summary`` and ``environment``.
tools/gpu-machine.sh sets a bare GPU machine up (carried wheels, the native build) and runs this.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHES = {  # step -> (suite, its --cases glob)
    "checkpoint": ("checkpoint", "save_async*"),
    "kvcache": ("kvcache", "*nixl*"),
}


class Skip(Exception):
    """The step cannot run here; the message says why."""


@dataclass
class Outcome:
    """What a step found: ``ok`` False makes it a FAIL (the metrics are kept)."""

    detail: str
    ok: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class Run:
    args: argparse.Namespace
    scratch: str
    deadline: float
    python: str = sys.executable
    results: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        return env


def _tail(text: str, lines: int = 6) -> str:
    """The last ``lines`` non-blank lines of ``text`` on one line."""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


def run_process(cmd: list[str], timeout: float, echo: bool = False, **kwargs: Any) -> tuple[int | None, str]:
    """``(exit status, output)`` of ``cmd`` (stdout and stderr together, echoed as it comes with ``echo``), run in
    its own session; status None when it ran past ``timeout`` seconds: then its whole process group is killed (a
    bench's own fio, a test's children go with it)."""
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                          **kwargs) as p:
        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                lines.append(line)
                if echo:
                    print("  | " + line.rstrip("\n"), flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            p.wait(timeout=max(1.0, timeout))
            rc: int | None = p.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
        reader.join(10)
    return rc, "".join(lines)


# -- the tests ---------------------------------------------------------------------------------------------------


def gpu_test_files(root: str = REPO) -> list[str]:
    """tests/gpu/ and every other test file that marks a test ``gpu``, relative to ``root``."""
    files = ["tests/gpu"] if os.path.isdir(os.path.join(root, "tests", "gpu")) else []
    for d, _dirs, names in os.walk(os.path.join(root, "tests")):
        rel = os.path.relpath(d, root)
        if rel == os.path.join("tests", "gpu") or rel.startswith(os.path.join("tests", "gpu") + os.sep):
            continue
        for n in sorted(names):
            if n.startswith("test_") and n.endswith(".py"):
                with open(os.path.join(d, n), encoding="utf-8") as f:
                    if "mark.gpu" in f.read():
                        files.append(os.path.join(rel, n))
    return sorted(files)


def read_junit(path: str) -> list[dict[str, str]]:
    """Each test of a pytest junit XML report: ``test``, ``status`` (PASS/FAIL/SKIP) and ``message``."""
    out: list[dict[str, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        status, message = "PASS", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, message = "FAIL", (child.get("message") or child.text or child.tag).strip()
                break
            if child.tag == "skipped":
                status, message = "SKIP", (child.get("message") or "").strip()
        out.append({"test": name, "status": status, "message": message[:2000]})
    return out


def step_tests(run: Run) -> Outcome:
    """``pytest -m gpu`` over the gpu test files (or ``--tests``): a FAIL when any test failed or errored."""
    files = run.args.tests or gpu_test_files()
    if not files:
        raise Skip("no test file holds tests marked gpu")
    xml = os.path.join(run.scratch, "pytest-gpu.xml")
    # the project's configuration (its markers) also for test files given from elsewhere
    cmd = [run.python, "-m", "pytest", "-c", os.path.join(REPO, "pyproject.toml"), "--rootdir", REPO, "-m", "gpu",
           "-p", "no:cacheprovider", "-q", "-rs", "-o", "addopts=--strict-markers", f"--junitxml={xml}",
           "--basetemp", os.path.join(run.scratch, "pytest"), *files]
    rc, out = run_process(cmd, run.left(), echo=True, cwd=REPO, env=run.env())
    if rc is None:
        return Outcome(f"pytest ran past the time budget: stopped ({_tail(out, 3)})", ok=False,
                       metrics={"command": shlex.join(cmd), "output_tail": _tail(out, 20)})
    if rc == 5:
        return Outcome(f"pytest collected no test marked gpu in {' '.join(files)}", ok=False)
    tests = read_junit(xml) if os.path.exists(xml) else []
    run.results["tests"] = tests
    counts = {s: sum(1 for t in tests if t["status"] == s) for s in ("PASS", "FAIL", "SKIP")}
    failed = [t["test"] for t in tests if t["status"] == "FAIL"]
    metrics = {"command": shlex.join(cmd), "counts": counts, "exit": rc}
    if rc not in (0, 1) or (rc == 1 and not failed):
        return Outcome(f"pytest exit {rc}: {_tail(out, 4)}", ok=False, metrics=metrics)
    detail = f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
    if failed:
        return Outcome(f"{detail}: {', '.join(failed[:6])}{' ...' if len(failed) > 6 else ''}", ok=False,
                       metrics=metrics)
    if not counts["PASS"]:
        reasons = sorted({t["message"] for t in tests if t["status"] == "SKIP"})
        raise Skip(f"{detail}: {'; '.join(reasons[:3])}")
    return Outcome(detail, metrics=metrics)


# -- the benches -------------------------------------------------------------------------------------------------


def summarize_bench(suite: str, doc: dict[str, Any]) -> Outcome:
    """The outcome of a bench run from its JSON: its goal lines (those of the cases that ran), each case's ratio
    and (gpu) the cases skipped and why; Skip when every NIXL goal is n/a (NIXL cannot run here: the bench's
    reason). A missed goal is reported, not a FAIL; a goal the bench could not measure is one, unless it is n/a
    with its reason (the gpu suite's goal on --device cpu)."""
    cases = [{k: c.get(k) for k in ("name", "ratio", "ratio_min", "ratio_max", "blocking_fraction",
                                    "hidden_fraction") if k in c}
             for c in doc.get("cases", [])]
    goals = [g for g in doc.get("acceptance", []) if "not run" not in str(g.get("line", ""))
             and g.get("status") != "not run"]
    if suite == "kvcache":
        goals = [g for g in goals if "nixl" in str(g.get("case", ""))]
        if goals and all(g.get("status") == "n/a" for g in goals):
            raise Skip(f"NIXL cannot run here: {goals[0].get('reason', 'n/a')}")
    lines = [str(g["line"]).removeprefix("goal: ") for g in goals]
    unmeasured = [g for g in goals if g.get("met") is None and g.get("status") != "n/a"]
    ratios = ", ".join(f"{c['name']} {c['ratio']:.2f}x" for c in cases if isinstance(c.get("ratio"), (int, float)))
    detail = "; ".join(lines) or ("no goal among the cases run" if suite == "gpu" else "no goal line")
    if ratios:
        detail += f" [{ratios}]"
    skipped = doc.get("skipped") or []
    if skipped:
        detail += f"; {len(skipped)} case(s) skipped: " + "; ".join(f"{s['case']} ({s['reason']})"
                                                                     for s in skipped[:3])
    metrics = {"goals": lines, "acceptance": goals, "cases": cases, "skipped": skipped}
    # the checkpoint and kvcache steps run for their goals; the gpu suite's one goal is one case's
    return Outcome(detail, ok=(bool(goals) or suite == "gpu") and not unmeasured, metrics=metrics)


def _bench_python(suite: str) -> tuple[str, str]:
    """The interpreter for ``suite`` and a note on it: NIXL lives in .venv-kvbench (tools/kvbench-env.sh)."""
    if suite == "kvcache":
        kvb = os.path.join(REPO, ".venv-kvbench", "bin", "python")
        if os.access(kvb, os.X_OK):
            return kvb, ".venv-kvbench"
        return sys.executable, "no .venv-kvbench here"
    return sys.executable, ""


def _bench(run: Run, suite: str, options: list[str], python: str, note: str = "",
           echo: bool = False) -> tuple[Outcome, dict[str, Any] | None]:
    """``python -m tools.bench <suite> <options>`` in a directory of the scratch, within what is left of the
    budget: its outcome and JSON document."""
    left = run.left() - 2.0
    if left < 10:
        raise Skip(f"not run: {max(left, 0):.0f} s of the budget left; raise --budget")
    work = os.path.join(run.scratch, f"bench_{suite}")
    os.makedirs(work, exist_ok=True)
    out_json = os.path.join(work, f"{suite}.json")
    cmd = [python, "-m", "tools.bench", suite, *options, "--dir", work, "--json", out_json]
    t0 = time.monotonic()
    try:
        rc, out = run_process(cmd, left, echo=echo, cwd=REPO, env=run.env())
        doc: dict[str, Any] | None = None
        if rc == 0:
            with open(out_json) as f:
                doc = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    took = time.monotonic() - t0
    base = {"command": shlex.join(cmd), "python": python, "seconds": round(took, 2)}
    if rc is None:
        return Outcome(f"did not finish in the {left:.0f} s left of the budget: stopped ({_tail(out, 3)})",
                       ok=False, metrics={**base, "output_tail": _tail(out, 12)}), None
    if rc == 2:  # BenchSetupError: the bench cannot run here, and says why
        raise Skip(f"the bench cannot run here: {_tail(out, 2)}")
    if doc is None:
        return Outcome(f"exit {rc}: {_tail(out, 4)}", ok=False, metrics={**base, "output_tail": _tail(out, 20)}), None
    outcome = summarize_bench(suite, doc)
    outcome.metrics.update(base)
    outcome.detail += f" ({took:.0f} s" + (f", {note}" if note else "") + ")"
    return outcome, doc


def step_bench_gpu(run: Run) -> Outcome:
    """The gpu suite on ``--blocks x --block-size``."""
    a = run.args
    options = ["--blocks", str(a.blocks), "--block-size", str(a.block_size), "--device", a.device, "--repeat",
               str(a.repeat), "--warmup", str(a.warmup)]
    for glob in a.gpu_cases or []:
        options += ["--cases", glob]
    outcome, doc = _bench(run, "gpu", options, sys.executable, echo=True)
    if doc is not None:
        run.results["bench_gpu"] = doc
    return outcome


def step_bench(run: Run, which: str) -> Outcome:
    """``python -m tools.bench <suite> --cases <glob>`` on ``--blocks x --block-size`` bytes."""
    suite, cases = BENCHES[which]
    if run.args.skip_bench:
        raise Skip(f"not run: --skip-bench (python -m tools.bench {suite} --cases '{cases}' runs it)")
    python, note = _bench_python(suite)
    if suite == "kvcache":  # the bench would run its sfstore sides only to say n/a: ask it first, cheaply
        rc, out = run_process([python, "-c", "from tools.bench.suites.kvcache import probe_nixl\n"
                               "print(probe_nixl() or '')"], min(60.0, run.left()), cwd=REPO, env=run.env())
        if rc == 0 and out.strip():
            raise Skip(f"NIXL cannot run here: {out.strip().splitlines()[-1]}" + (f" ({note})" if note else ""))
    size = max(run.args.blocks * run.args.block_size, 2 * MiB)  # the kvcache bench takes one 2 MiB block at least
    outcome, _doc = _bench(run, suite, ["--cases", cases, "--size", str(size)], python, note)
    return outcome


STEPS: list[tuple[str, Callable[[Run], Outcome]]] = [
    ("tests", step_tests),
    ("bench_gpu", step_bench_gpu),
    ("bench_checkpoint_save_async", lambda run: step_bench(run, "checkpoint")),
    ("bench_kvcache_nixl", lambda run: step_bench(run, "kvcache")),
]


def run_steps(run: Run) -> list[dict[str, Any]]:
    """Every step in order: PASS, FAIL or SKIP each, printed as it ends."""
    out: list[dict[str, Any]] = []
    for name, fn in STEPS:
        t0 = time.monotonic()
        print(f"==> {name}", flush=True)
        result: dict[str, Any]
        try:
            if run.left() <= 1.0:
                raise Skip(f"not run: the time budget ({run.args.budget:g} s) is spent; raise --budget")
            got = fn(run)
            result = {"step": name, "status": "PASS" if got.ok else "FAIL", "detail": got.detail,
                      "metrics": got.metrics}
        except Skip as exc:
            result = {"step": name, "status": "SKIP", "detail": str(exc)}
        except Exception as exc:  # a defect of this script: the other steps still run
            result = {"step": name, "status": "FAIL", "detail": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - t0, 2)
        out.append(result)
        print(f"{result['status']:<5} {name}: {result['detail']}", flush=True)
    return out


def _environment() -> dict[str, Any]:
    try:
        sys.path.insert(0, REPO)
        from tools.bench.suites.gpu import environment

        return environment()
    except Exception as exc:  # facts for the JSON only
        return {"error": f"{type(exc).__name__}: {exc}"}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tools.bench.options import parse_size

    doc = __doc__ or "GPU checks"
    parser = argparse.ArgumentParser(description=doc.splitlines()[0],
                                     epilog="Exit status: 1 when any step FAILED, else 0 (SKIPs included).")
    parser.add_argument("--blocks", type=int, default=512, help="blocks per bench run (default 512)")
    parser.add_argument("--block-size", type=parse_size, default=2 * MiB, metavar="SIZE",
                        help="bytes per block (default 2m; a multiple of 4k, of 64k for the KV cases)")
    parser.add_argument("--repeat", type=int, default=3, help="pairs per gpu bench case (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up pairs per gpu bench case (default 1)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for every step (default 420); a step past it is stopped, the rest SKIP")
    parser.add_argument("--dir", metavar="DIR",
                        help="scratch directory (a temporary directory is made in it and removed; default: in "
                             "sfstore's data directory, so on a disk filesystem)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the gpu suite with CPU torch tensors (tests this script without a GPU)")
    parser.add_argument("--skip-bench", action="store_true",
                        help="SKIP the checkpoint and kvcache bench steps (the gpu suite still runs)")
    parser.add_argument("--tests", action="append", metavar="PATH",
                        help="test files or directories for the tests step (default: tests/gpu and every file "
                             "holding tests marked gpu)")
    parser.add_argument("--gpu-cases", action="append", metavar="GLOB", help="the gpu suite's --cases")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.repeat < 1 or args.warmup < 0:
        parser.error("--blocks and --repeat must be at least 1, --warmup not negative")
    if args.block_size <= 0 or args.block_size % 4096:
        parser.error("--block-size must be a positive multiple of 4096 bytes")
    if args.budget <= 0:
        parser.error("--budget must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        base = args.dir
    else:
        from sfstore import defaults

        base = str(defaults.get("data_dir"))
        os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="gpu-check-", dir=base)
    t0 = time.monotonic()
    run = Run(args, scratch, t0 + args.budget)
    env = _environment()
    print(f"gpu_check: {args.blocks} x {args.block_size / MiB:g} MiB per bench run, budget {args.budget:g} s, device "
          f"{args.device}, scratch {scratch}; torch {env.get('torch')}, device path {env.get('device_mode')}",
          flush=True)
    try:
        steps = run_steps(run)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    counts = {s: sum(1 for r in steps if r["status"] == s) for s in ("PASS", "FAIL", "SKIP")}
    elapsed = time.monotonic() - t0
    print(f"\ngpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {elapsed:.0f} s "
          f"(budget {args.budget:g} s)", flush=True)
    failed = [t for t in run.results.get("tests", []) if t["status"] == "FAIL"]
    for t in failed:
        print(f"FAILED {t['test']}: {_tail(t['message'], 3)}", flush=True)
    if args.json:
        doc = {"tool": "tools/gpu_check.py", "args": vars(args), "environment": env, "budget_s": args.budget,
               "elapsed_s": round(elapsed, 2), "summary": counts, "steps": steps,
               "tests": run.results.get("tests", []), "bench_gpu": run.results.get("bench_gpu")}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)
        print(f"JSON: {args.json}", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
