"""Crash-safety trials: a child process saving checkpoints in a loop is SIGKILLed at random moments.

Each trial starts a child (forked from a ``multiprocessing`` forkserver that has torch and sfstore imported,
so a child starts in milliseconds) that saves :func:`expected_state` for steps ``n, n+1, ...`` into one
directory -- most steps over one name (``overwrite=True``, the replace path), every third step under a new
name -- and writes each step to an acknowledgement file *after* ``save`` returned. Once the child has
acknowledged a save in this trial, it is killed after a random delay. Then:

* :func:`sfstore.checkpoint.latest` must find a checkpoint whose step is the last acknowledged one or the one
  after it (committed but not yet acknowledged), and it must load (checksums verified) bit-exactly equal to
  what that step saved;
* the replaced name must load and match its own step;
* every visible (non-hidden) entry of the directory must be a committed checkpoint.

``python -m sfstore.testing.checkpoint_crash DIR [TRIALS]`` runs them and prints the report (the bench's
reliability mode runs 300).
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from dataclasses import dataclass
from typing import Any

from sfstore.testing.crash_trials import TrialReport, forkserver, main
from sfstore.testing.sigkill import kill_after_progress

__all__ = ["expected_state", "states_equal", "run_trials", "CrashReport"]

ROLLING = "rolling"
SHARD_BYTES = 96 << 10


def expected_state(step: int) -> dict[str, Any]:
    """The state dict the child saves at ``step`` (deterministic, ~400 KiB, several dtypes and shards)."""
    import torch

    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(256, 256, generator=g),
            "b": torch.randn(1024, generator=g).to(torch.bfloat16),
            "emb": torch.randint(-(2**40), 2**40, (64, 64), generator=g),
            "mask": torch.rand(333, generator=g) > 0.5,
        },
        "optimizer": {"state": {0: {"step": step, "lr": 0.1 / (step + 1)}}, "betas": (0.9, 0.999)},
        "step": step,
    }


def _bytes(t: Any) -> Any:
    import torch

    t = t.detach().cpu()
    plain = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if plain is not None:
        t = t.view(plain)  # copies of every dtype (torch has no copy kernel for e.g. uint4)
    return t.contiguous().reshape(-1).view(torch.uint8)


def states_equal(a: Any, b: Any) -> bool:
    """Whether two state dicts are equal: same nesting and types, tensors, arrays and floats bit for bit."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            return False
        return bool(torch.equal(_bytes(a), _bytes(b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, (np.ndarray, np.generic)):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _read_ack(path: str) -> int:
    try:
        with open(path) as f:
            return int(json.load(f)["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def _child(root: str, ack: str, start: int, exchange: bool) -> None:
    """The saving loop (runs in the child until killed)."""
    from sfstore.checkpoint import location, save

    location.USE_RENAMEAT2 = exchange
    step = start
    while True:
        name = ROLLING if step % 3 else f"step-{step:06d}"
        # overwrite=True everywhere: a new name is published with RENAME_NOREPLACE, an existing one replaced
        # (a step committed but not acknowledged before the last kill is saved again under the same name).
        save(expected_state(step), os.path.join(root, name), overwrite=True, max_shard_bytes=SHARD_BYTES,
             metadata={"step": step})
        tmp = f"{ack}.tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step}, f)
        os.replace(tmp, ack)
        step += 1


@dataclass
class CrashReport(TrialReport):
    """What :func:`run_trials` saw."""

    exchange: bool = True
    last_step: int = 0
    committed_unacknowledged: int = 0  # kills after the commit but before the acknowledgement
    killed_mid_save: int = 0  # kills that left a staging/old directory behind


def _check(root: str, acked: int, report: CrashReport, trial: int) -> None:
    from sfstore import checkpoint

    info = checkpoint.latest(root)
    if info is None or info.step is None:
        report.failures.append(f"trial {trial}: latest() found nothing after step {acked} was acknowledged")
        return
    if not acked <= info.step <= acked + 1:
        report.failures.append(f"trial {trial}: latest() is step {info.step}, acknowledged {acked}")
    if info.step == acked + 1:
        report.committed_unacknowledged += 1
    if not states_equal(checkpoint.load(info), expected_state(info.step)):
        report.failures.append(f"trial {trial}: latest() (step {info.step}) does not match what it saved")
    visible = sorted(e for e in os.listdir(root) if not e.startswith("."))
    listed = sorted(i.name for i in checkpoint.list(root))
    if visible != listed:
        report.failures.append(f"trial {trial}: visible entries {visible} but committed checkpoints {listed}")
    if ROLLING in listed:
        rolling = next(i for i in checkpoint.list(root) if i.name == ROLLING)
        assert rolling.step is not None
        if not states_equal(checkpoint.load(rolling), expected_state(rolling.step)):
            report.failures.append(f"trial {trial}: {ROLLING} (step {rolling.step}) does not match what it saved")
    if any(".sfstore-" in e for e in os.listdir(root)):
        report.killed_mid_save += 1


def run_trials(
    root: str | os.PathLike[str],
    trials: int = 30,
    *,
    seed: int = 0,
    max_delay: float = 0.15,
    exchange: bool = True,
    start_timeout: float = 60.0,
) -> CrashReport:
    """Run ``trials`` kill trials in the directory ``root`` (created); see the module docs.

    ``exchange=False`` makes the child publish without renameat2 flags (the two-step replace NFS gets).
    Failures are collected in :attr:`CrashReport.failures`, not raised.
    """
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    ack = os.path.join(root, ".ack.json")  # hidden, like everything in root that is not a checkpoint
    rng = random.Random(seed)
    ctx = forkserver("torch", "sfstore.checkpoint", __name__)
    report = CrashReport(exchange=exchange)
    began = time.monotonic()
    for trial in range(trials):
        before = _read_ack(ack)
        proc = ctx.Process(target=_child, args=(root, ack, before + 1, exchange), daemon=True)
        proc.start()
        report.trials = trial + 1
        if not kill_after_progress(proc, lambda: _read_ack(ack), before, rng, max_delay, start_timeout, 0.001):
            report.failures.append(f"trial {trial}: the child made no save (exit code {proc.exitcode})")
            break
        acked = _read_ack(ack)
        _check(root, acked, report, trial)
        report.last_step = acked
    report.seconds = time.monotonic() - began
    return report


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    main(run_trials, "sfstore.testing.checkpoint_crash")
