"""The probe on a machine with a CUDA GPU: it reports the GPUs torch sees, and a GPU-direct storage status that
agrees with the device path's mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfstore.paths.device import device_mode
from sfstore.probe import probe

from .conftest import gpu_marks

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU tests need a CUDA build of torch")
pytestmark = gpu_marks(torch)


def test_probe_reports_the_gpus_and_gds(tmp_path: Path) -> None:
    """gpus: status ok with every device torch sees (named, with memory); gds: a status, ok only where the device
    path's mode is gds, and compat mode exactly where kvikio imports without cuFile and nvidia-fs."""
    report = probe(data_dir=str(tmp_path / "data"))
    gpus = report["gpus"]
    assert gpus["status"] == "ok", f"the probe reports no GPU though torch sees {torch.cuda.device_count()}: {gpus}"
    assert gpus["count"] >= 1 and gpus["count"] == torch.cuda.device_count() == len(gpus["devices"]), gpus
    assert all(d["name"] and d["memory_bytes"] > 0 for d in gpus["devices"]), gpus
    assert torch.cuda.get_device_name(0) in {d["name"] for d in gpus["devices"]}, gpus

    gds = report["gds"]
    assert gds["status"] in ("ok", "compat", "absent"), gds
    mode, why = device_mode()
    if mode == "gds":
        assert gds["status"] == "ok", (why, gds)
    if gds["status"] == "compat":
        assert gds["kvikio"]["importable"] and mode == "compat", (mode, why, gds)
    if not gds["kvikio"]["importable"]:
        assert mode == "staged", (mode, why, gds)
