"""sfstore: the shortest data path between storage and compute memory for AI jobs on RDMA clusters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sfstore.version import VERSION as __version__

if TYPE_CHECKING:
    from sfstore.router import Router

__all__ = ["__version__", "open"]


def open(config: Any = None) -> Router:
    """Read the configuration and return the :class:`~sfstore.router.Router` (see :mod:`sfstore.router`): the
    same one for the same configuration, so every face shares its paths and counters."""
    from sfstore import router

    return router.open(config)
