"""The two-node scenario's coordination: each node runs the same tests, each its own role's half, and they meet
at named points through a torch ``TCPStore`` on node A (which also serves as gloo's rendezvous for the DCP test).

A node whose half of a test fails says so (``abort/<test>/<role>``): the other node's waits in that test then
fail at once, naming it, instead of running into their timeout; the next test starts afresh. Each test's
duration goes to the console as a stage marker (``SFSTORE-STAGE-END two-node/<test> <rc> <seconds> <note>``),
which tools/testbed/testbed.py shows in its summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

ROLES = ("prefill", "decode")  # rank 0 (node A, also the storage server) and rank 1 (node B)


def console(line: str) -> None:
    """Write a line to the guest's console (pytest captures stdout; the testbed reads the console)."""
    try:
        with open("/dev/console", "w") as f:
            f.write("\n" + line + "\n")
    except OSError:
        print(line, flush=True)


class Peer:
    """This node's end of the coordination with the other node.

    Parameters
    ----------
    role : str
        ``"prefill"`` (node A: hosts the store) or ``"decode"`` (node B).
    coordinator : str
        ``host:port`` of the store on node A.
    """

    def __init__(self, role: str, coordinator: str) -> None:
        from torch.distributed import TCPStore

        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.role = role
        self.other = ROLES[1 - ROLES.index(role)]
        self.rank = ROLES.index(role)
        host, port = coordinator.rsplit(":", 1)
        # node B may come up first (or long after): the client retries its connect, node A waits for it
        self.store = TCPStore(host, int(port), world_size=2, is_master=self.rank == 0,
                              timeout=timedelta(seconds=600), wait_for_workers=True)
        self.test = ""
        self.notes: list[str] = []

    def tell(self, name: str, value: Any = "ok") -> None:
        """Publish ``value`` (JSON) under ``name`` for the other node."""
        self.store.set(f"{self.test}/{name}/{self.role}", json.dumps(value))

    def hear(self, name: str, timeout: float = 300.0) -> Any:
        """Wait for the other node's ``name`` and return its value; fail when it failed or did not say it."""
        key = f"{self.test}/{name}/{self.other}"
        abort = f"abort/{self.test}/{self.other}"
        end = time.monotonic() + timeout
        while True:
            if self.store.check([key]):
                return json.loads(self.store.get(key))
            if self.store.check([abort]):
                pytest.fail(f"the {self.other} node failed this test: {self.store.get(abort).decode()}")
            if time.monotonic() > end:
                pytest.fail(f"the {self.other} node did not say {name!r} within {timeout:.0f} s")
            time.sleep(0.05)

    def meet(self, name: str, timeout: float = 300.0, value: Any = "ok") -> Any:
        """Tell ``name`` and wait for the other node's; return its value."""
        self.tell(name, value)
        return self.hear(name, timeout)

    def note(self, text: str) -> None:
        """Add a figure to this test's stage note in the testbed's summary."""
        self.notes.append(text)

    @contextlib.contextmanager
    def step(self, test: str, start_timeout: float = 300.0) -> Iterator[None]:
        """Run this node's half of ``test``: meet the other node at its start, time it, report a failure to the
        other node, and put the duration (and :meth:`note` figures) on the console as a stage."""
        self.test, self.notes = test, []
        self.meet("start", start_timeout)
        t0 = time.monotonic()
        rc = 1
        try:
            yield
            rc = 0
        except BaseException as exc:
            self.store.set(f"abort/{test}/{self.role}", f"{type(exc).__name__}: {exc}"[:2000])
            raise
        finally:
            note = "; ".join(self.notes)
            seconds = time.monotonic() - t0
            console(f"SFSTORE-STAGE-END two-node/{test} {rc} {seconds:.1f}" + (f" {note}" if note else ""))


def node_from_env() -> tuple[str, str] | None:
    """``(role, coordinator)`` of this guest in the two-node scenario, or ``None`` outside it."""
    role = os.environ.get("SFSTORE_TEST_NODE")
    coordinator = os.environ.get("SFSTORE_TEST_COORDINATOR")
    return (role, coordinator) if role and coordinator else None
