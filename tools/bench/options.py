"""Options and ``argparse`` types the suites share: sizes (``64k``, ``1g``), counts, and the ``--warmup`` and
``--fio`` options of every suite that has warm-up pairs or fio as a reference.
"""

from __future__ import annotations

import argparse
from typing import Any, Protocol

from sfstore import defaults

__all__ = ["parse_size", "positive_int", "nonneg_int", "add_warmup", "add_fio"]


def parse_size(text: str) -> int:
    """Parse a byte count such as ``4096``, ``64k``, ``16m``, ``1g`` or ``2GiB``: the sizes of
    :func:`sfstore.defaults.parse_size` (``k``/``KiB`` 1024-based, ``KB`` 1000-based).

    Parameters
    ----------
    text : str
        The size.

    Returns
    -------
    int
        The number of bytes.

    Raises
    ------
    ValueError
        When ``text`` is not a size.
    """
    try:
        return defaults.parse_size(text)
    except ValueError as exc:
        raise ValueError(f"not a size: {text!r}: {exc}") from None


def positive_int(text: str) -> int:
    """An ``argparse`` type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def nonneg_int(text: str) -> int:
    """An ``argparse`` type: an int of 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


class _Options(Protocol):
    """A parser or an argument group: what takes options."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        """Add an option."""


def add_warmup(group: _Options, why: str = "") -> None:
    """Add ``--warmup N`` (default 1): pairs run first, each side cold as usual, and left out of the figures;
    ``why`` (a suite's reason for them) ends its help."""
    group.add_argument("--warmup", type=nonneg_int, default=1, metavar="N",
                       help="pairs run first and discarded per case, each side cold as usual (default 1)"
                            + (f": {why}" if why else ""))


def add_fio(group: _Options) -> None:
    """Add ``--fio PATH``: the fio executable of the reference side (default: fio on PATH)."""
    group.add_argument("--fio", metavar="PATH", help="fio executable (default: fio on PATH)")
