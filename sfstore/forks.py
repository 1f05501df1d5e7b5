"""Fork safety: state that belongs to one process is reset in a forked child, before the child runs anything else.

A forked child (a ``DataLoader`` worker, a ``multiprocessing`` ``fork`` process) starts with a copy of the
parent's memory but only the thread that forked: locks another thread held stay held forever, thread pools have
no threads, pooled buffers and descriptors are the parent's to hand out. Every sfstore object with such state
registers a callback with :func:`after_fork`, and the child runs each one right after ``os.fork()`` returns
there, so the object needs no process check on the calls it serves.

This is done at fork time rather than by comparing ``os.getpid()`` with a remembered pid at each use because a
lock must be replaced before anything waits on it, and a pid check has to take the lock to reset the state it
guards. It covers forks made through :func:`os.fork` (which ``multiprocessing``, ``subprocess`` and PyTorch use);
a child that C code forks without it and goes on running Python is not covered (none of sfstore's users do).

This module imports nothing of sfstore's, so every layer may use it.
"""

from __future__ import annotations

import itertools
import os
import types
import weakref
from collections.abc import Callable

__all__ = ["after_fork"]

# Registration order is kept (a dict's): callbacks run in the order they were registered. Bound methods are
# held weakly, so registering an object does not keep it alive; its entry leaves when it dies.
_callbacks: dict[int, Callable[[], Callable[[], None] | None]] = {}
_keys = itertools.count()


def after_fork(callback: Callable[[], None]) -> None:
    """Run ``callback()`` in every child this process forks from now on, right after the fork.

    A bound method is held weakly: once its object is gone it is not called (nor kept). Anything else is held
    for the life of the process. An exception a callback raises does not stop the others; the first one is
    raised after them all (Python reports it as unraisable: the child goes on).
    """
    key = next(_keys)
    if isinstance(callback, types.MethodType):
        func = callback.__func__

        def drop(_ref: object) -> None:
            # runs when the object dies, which can be during the interpreter's shutdown, after this module's
            # globals are gone: then there is nothing left to remove from
            try:
                _callbacks.pop(key, None)
            except (AttributeError, NameError, TypeError):
                pass

        # a plain weak reference to the object (not a WeakMethod, whose own callback fails at shutdown)
        obj = weakref.ref(callback.__self__, drop)

        def bound() -> Callable[[], None] | None:
            target = obj()
            return None if target is None else types.MethodType(func, target)

        _callbacks[key] = bound
    else:
        _callbacks[key] = lambda: callback


def _in_child() -> None:
    first: BaseException | None = None
    for ref in list(_callbacks.values()):
        callback = ref()
        if callback is None:
            continue
        try:
            callback()
        except BaseException as exc:  # the others must still run; the first is raised below
            if first is None:
                first = exc
    if first is not None:
        raise first


os.register_at_fork(after_in_child=_in_child)
