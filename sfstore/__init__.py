"""sfstore: the shortest data path between storage and compute memory for AI jobs on RDMA clusters."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
