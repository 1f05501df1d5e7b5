"""Run a check in a real ``os.fork()`` child and bring back what it returns: how the fork-safety tests see a
child's state (``sfstore.forks``)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

CHILD_ALARM_S = 30  # a child stuck on a lock the parent held at the fork is killed: the test fails, never hangs


def in_forked_child(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """What ``check()`` returns (JSON-able) in a forked child, through a pipe, or ``{"error": ...}`` with what it
    raised there. Fork while holding the locks under test to see that the child does not wait for them."""
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        signal.alarm(CHILD_ALARM_S)
        try:
            try:
                out = check()
            except BaseException as exc:
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(wfd, json.dumps(out).encode())
            code = 0
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(wfd)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child deadlocked (killed by its alarm) or failed"
    result: dict[str, Any] = json.loads(data)
    return result
