"""Checks of caller arguments that several faces share: batches and timeouts.

Each raises :class:`~sfstore.errors.InvalidRequestError` naming the argument, so a batch given as one ``str`` or
a ``NaN`` timeout is refused the same way by the block store and the KV cache.
"""

from __future__ import annotations

from typing import Any

from sfstore import errors

__all__ = ["as_batch", "check_timeout"]


def as_batch(items: Any, what: str) -> list[Any]:
    """A batch argument as a list; a str or bytes-like (which iteration would take apart) or a non-iterable is
    an :class:`~sfstore.errors.InvalidRequestError` naming ``what``."""
    if isinstance(items, (str, bytes, bytearray, memoryview)):
        raise errors.InvalidRequestError(f"{what} must be a sequence (a list), not one {type(items).__name__}")
    try:
        return list(items)
    except TypeError:
        raise errors.InvalidRequestError(f"{what} must be a sequence, not {type(items).__name__}") from None


def check_timeout(timeout: float | None, what: str, *, finite: bool = False) -> float | None:
    """A timeout is ``None`` (no limit) or seconds >= 0 (``finite``: and not infinite); NaN never. Returns it
    with infinity as ``None`` (``threading`` waits take no infinite number)."""
    ok = timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout >= 0
                             and (not finite or timeout != float("inf")))
    if not ok or (finite and timeout is None):
        raise errors.InvalidRequestError(
            f"{what}: timeout must be {'' if finite else 'None or '}seconds >= 0"
            f"{' (finite)' if finite else ''}, not {timeout!r}"
        )
    return None if timeout == float("inf") else timeout
