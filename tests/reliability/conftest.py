"""Knobs and helpers of the reliability suite (hostile input, races, resource exhaustion, special files).

Every test here runs in CI in a bounded time. The long ("flag") run scales them up through two variables:

``SFSTORE_RELIABILITY_SECONDS``
    Seconds of racing per operation in the symlink-swap tests (default 1.0; the flag run uses 30).
``SFSTORE_RELIABILITY_SCALE``
    Multiplier of trial and fuzz iteration counts (default 1; the flag run uses 10 or more). Counts named in
    the acceptance list (e.g. 2,000 manifest bit flips, 100 pipe writes) are the floor at scale 1.

``tools/reliability.sh`` runs the suite with the flag-run values. Child processes under resource limits:
``reliability_helpers.run_child``.
"""

from __future__ import annotations

import os

import pytest


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    try:
        return float(text) if text else default
    except ValueError:
        raise pytest.UsageError(f"{name}={text!r} is not a number") from None


@pytest.fixture(scope="session")
def race_seconds() -> float:
    """Seconds of symlink swapping per operation (``SFSTORE_RELIABILITY_SECONDS``, default 1)."""
    return _env_float("SFSTORE_RELIABILITY_SECONDS", 1.0)


@pytest.fixture(scope="session")
def scale() -> int:
    """Multiplier of trial counts (``SFSTORE_RELIABILITY_SCALE``, default 1)."""
    return max(1, int(_env_float("SFSTORE_RELIABILITY_SCALE", 1)))
