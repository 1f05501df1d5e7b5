"""The kill step the crash tests share: let a child make progress, then SIGKILL it at a random moment."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

__all__ = ["kill_after_progress"]


def kill_after_progress(
    proc: Any, count: Callable[[], int], before: int, rng: random.Random, max_delay: float, timeout: float,
    poll: float = 0.002,
) -> bool:
    """Wait until ``count()`` exceeds ``before`` (the started ``multiprocessing`` child ``proc`` acknowledged work in
    this trial), sleep a random ``[0, max_delay)`` seconds, SIGKILL the child and reap it; return ``True``.

    Returns ``False`` (the child killed and reaped) when it died or made no progress within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while count() <= before:
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            proc.join()
            return False
        time.sleep(poll)
    time.sleep(rng.uniform(0.0, max_delay))
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    return True
