"""Registered buffers: page-aligned, pinned host memory that storage, RDMA and GPUs can all reach.

(Work in progress: the pool lands with the native helper.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["as_buffer"]


def as_buffer(obj: Any) -> Any:
    """Return an object exporting the buffer protocol over the same bytes as ``obj`` (no copy).

    Buffer-protocol objects are returned as they are. CPU torch tensors (any dtype, contiguous) and other CPU
    DLPack producers are viewed as bytes through numpy. Anything else raises ``TypeError``.
    """
    try:
        memoryview(obj).release()
        return obj
    except TypeError:
        pass
    mod = type(obj).__module__ or ""
    if mod.startswith("torch"):
        t = obj.detach()
        if t.device.type != "cpu":
            raise TypeError(f"a {t.device.type} tensor has no host buffer; use a GPU path or copy it to the CPU")
        if not t.is_contiguous():
            raise TypeError("a non-contiguous tensor cannot be used as an I/O buffer")
        import torch

        return t.reshape(-1).view(torch.uint8).numpy()
    if hasattr(obj, "__dlpack__"):
        import numpy as np

        return np.from_dlpack(obj)
    raise TypeError(f"{type(obj).__name__} exports neither the buffer protocol nor DLPack")
