"""What the ``sfstore`` command's groups share."""

from __future__ import annotations

from typing import Any

from sfstore.errors import SfstoreError

__all__ = ["Subparsers", "human", "message"]

Subparsers = Any  # argparse's _SubParsersAction is private


def human(n: float) -> str:
    """``n`` bytes for a person: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


def message(exc: SfstoreError) -> str:
    """What went wrong, for a person: an OS error as ``cannot open sf://x: No such file or directory`` (what was
    asked, the path as given, the reason), without Python's ``[Errno 2]`` prefix."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        what, sep, why = str(exc.strerror).rpartition(": ")
        return f"{what} {exc.filename}: {why}" if sep else f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, OSError) and exc.strerror:
        return str(exc.strerror)
    return str(exc)
