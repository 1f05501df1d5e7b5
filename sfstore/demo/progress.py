"""What the demo prints, and a ticker that says a step is still going once the demo has been quiet a while.

Every line goes through :func:`say`, which notes when it last printed. :func:`still_going` runs a step with a
daemon thread beside it that, whenever nothing was said for ``every`` seconds, prints
``  ... still <step> (N s)`` (``N``: whole seconds since the step began). A step that prints its own progress often
enough never sees a ticker line; one that is quiet (a large file written, a slow machine) still shows it is
alive, so someone watching ``sfstore demo`` or a CI log waiting on it never sees it silent for long.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["TICK_SECONDS", "say", "quiet_for", "still_going"]

TICK_SECONDS = 10.0
"""Seconds without output after which a running step says it is still going (and again each time after)."""

_lock = threading.Lock()  # one line at a time: print writes the text and its end separately
_last_said = time.monotonic()


def _emit(text: str, end: str) -> None:  # under _lock
    global _last_said
    print(text, end=end, flush=True)
    _last_said = time.monotonic()


def say(text: str = "", end: str = "\n") -> None:
    """Print ``text`` (flushed at once) and note the time, which :func:`still_going` measures quiet from."""
    with _lock:
        _emit(text, end)


def quiet_for() -> float:
    """Seconds since :func:`say` last printed."""
    return time.monotonic() - _last_said


@contextlib.contextmanager
def still_going(step: str, *, every: float = TICK_SECONDS, show: bool = True) -> Iterator[None]:
    """Run the ``with`` block as the step ``step``: each time nothing was said for ``every`` seconds while it
    runs (counted from the step's start at the earliest), print ``  ... still <step> (N s)``.

    Parameters
    ----------
    step : str
        What the step is doing, as it reads after "still" ("training", "writing the dataset").
    every : float
        Seconds of quiet before a ticker line (default :data:`TICK_SECONDS`); must be positive.
    show : bool
        ``False``: no ticker (a run that prints nothing).

    Notes
    -----
    The ticker is a daemon thread, stopped and joined when the block ends (however it ends), so no ticker
    line comes after it. It needs the interpreter's lock to print: a step inside one long call that holds it
    delays the line until that call returns.
    """
    if every <= 0:
        raise ValueError(f"still_going(every={every!r}): the interval must be positive")
    if not show:
        yield
        return
    start = time.monotonic()
    stop = threading.Event()

    def tick() -> None:
        while True:
            wait = every - (time.monotonic() - max(_last_said, start))  # quiet counts from the step's start
            if wait > 0:
                if stop.wait(wait):
                    return
                continue
            with _lock:  # decided and printed under the lock: nothing said between, nothing after the block
                if stop.is_set():
                    return
                if time.monotonic() - max(_last_said, start) >= every:
                    _emit(f"  ... still {step} ({int(time.monotonic() - start)} s)", "\n")

    thread = threading.Thread(target=tick, name=f"sfstore-demo-ticker ({step})", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
