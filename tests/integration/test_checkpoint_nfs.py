"""Checkpoints over the testbed's NFS mount with ``proto=rdma``: save, load bit-exactly, overwrite, latest, and a
few SIGKILL trials (NFS has no renameat2 exchange: the two-step replace and its recovery run for real)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from .endpoints import env

torch = pytest.importorskip("torch")

from sfstore import checkpoint  # noqa: E402  (after the torch check: checkpoints need torch)
from sfstore.paths.file import FilePath  # noqa: E402
from sfstore.testing.checkpoint_crash import run_trials  # noqa: E402


@pytest.fixture
def base() -> Path:
    root = Path(env("SFSTORE_TEST_NFS_MOUNT")) / f"ckpt-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    assert FilePath(root).transport == "rdma"
    return root


def state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(512, 257, generator=g).to(torch.bfloat16), "b": torch.arange(step + 3)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(300, generator=g)}}, "lr": 1e-3 * step},
        "np": np.arange(step * 10, dtype=np.int32),
        "step": step,
    }


def equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b


def test_save_load_overwrite_latest_over_nfs_rdma(base: Path) -> None:
    for step in (1, 2):
        checkpoint.save(state(step), str(base / f"step-{step}"), metadata={"step": step})
    assert equal(checkpoint.load(str(base / "step-2")), state(2))
    checkpoint.save(state(3), str(base / "step-2"), overwrite=True, metadata={"step": 3})
    latest = checkpoint.latest(str(base))
    assert latest is not None and latest.step == 3
    assert equal(checkpoint.load(latest), state(3))
    assert [i.name for i in checkpoint.list(str(base))] == ["step-1", "step-2"]


def test_sigkill_during_saves_over_nfs_rdma(base: Path) -> None:
    report = run_trials(base / "crash", 4, exchange=False, start_timeout=300.0)
    assert not report.failures, report.as_dict()
