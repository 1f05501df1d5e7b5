"""sfstore.checkpoint with CUDA tensors: a nested state dict of several dtypes, a strided tensor, a 0-d tensor and
plain Python values saved, then loaded onto the GPU bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sfstore import checkpoint

from .conftest import MiB, gpu_marks

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU tests need a CUDA build of torch")
pytestmark = gpu_marks(torch)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _compare_tree(a: Any, b: Any, device: str, where: str = "") -> str | None:
    """The first difference between the saved state dict ``a`` and the loaded ``b`` (``None``: identical, every
    tensor of ``b`` on ``device``)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return f"{where}: a {type(b).__name__}, not a tensor"
        if b.device.type != device:
            return f"{where}: on {b.device}, not {device}"
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return f"{where}: {b.dtype}{tuple(b.shape)}, saved {a.dtype}{tuple(a.shape)}"
        return None if torch.equal(_bits(a), _bits(b).to(a.device)) else f"{where}: bytes differ"
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{where}: keys {sorted(map(str, b)) if isinstance(b, dict) else type(b).__name__}"
        for k in a:
            diff = _compare_tree(a[k], b[k], device, f"{where}/{k}")
            if diff:
                return diff
        return None
    return None if a == b and type(a) is type(b) else f"{where}: {b!r}, saved {a!r}"


def _state(device: str, per: int = 1 * MiB) -> dict[str, Any]:
    """A training state on ``device``: big tensors of about ``per`` bytes each (float32, a strided bfloat16
    transpose, float16, int64 beyond 32 bits), a bool mask, a 0-d step, and plain Python values."""
    g = torch.Generator(device=device).manual_seed(0)
    side = max(1, int((per // 4) ** 0.5))
    model = {
        "w": torch.randn(side, side, generator=g, device=device),
        "w_t": torch.randn(side, side + 3, generator=g, device=device).to(torch.bfloat16).t(),
        "emb": torch.randn(per // 2, generator=g, device=device).to(torch.float16),
        "ids": torch.randint(-(2**40), 2**40, (per // 8,), generator=g, device=device),
        "mask": torch.rand(4097, generator=g, device=device) > 0.5,
    }
    assert not model["w_t"].is_contiguous()
    return {"model": model, "optim": {"step": torch.tensor(7, device=device), "lr": 3e-4, "betas": (0.9, 0.999)},
            "epoch": 3}


def test_checkpoint_of_cuda_tensors_loads_onto_the_gpu_bit_exact(tmp_path: Path, cuda: torch.device) -> None:
    """save() of CUDA tensors, in several shards, then load(device="cuda"): the same tree, every tensor on the GPU
    with the saved dtype, shape and bytes, the plain values equal and of the same type."""
    state = _state("cuda")
    url = tmp_path / "ckpt" / "step-7"
    checkpoint.save(state, url, max_shard_bytes=1 * MiB, metadata={"step": 7})
    back = checkpoint.load(url, device="cuda")
    torch.cuda.synchronize()
    diff = _compare_tree(state, back, "cuda")
    assert diff is None, f"the loaded checkpoint differs: {diff}"
