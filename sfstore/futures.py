"""The one future type: what every ``*_async`` call, path and engine returns.

A :class:`Future` has three calls (and :meth:`~Future.result`, ``concurrent.futures``' name for ``get``) and
one contract:

* :meth:`~Future.done` says whether the work has finished (successfully or not) and never blocks;
* :meth:`~Future.wait` waits at most ``timeout`` seconds and says whether it finished; it never raises the
  work's error (that is :meth:`~Future.get`'s to raise);
* :meth:`~Future.get` waits at most ``timeout`` seconds and returns the result, raises the work's typed error,
  or raises :class:`~sfstore.errors.IOTimeoutError` when the time ran out (the work goes on; call again).

A timeout is ``None`` (or ``inf``: no end) or seconds ``>= 0``; NaN, a negative number or a non-number is an
:class:`~sfstore.errors.InvalidRequestError` (:func:`sfstore.arguments.check_timeout`; the engine's own batches
also take a negative timeout as ``0``).

Implementations here: :class:`ExecutorFuture` (work on a thread pool), :class:`DoneFuture` (already finished),
:class:`MappedFuture` (another future's result, transformed once). The I/O engine's batches
(:class:`sfstore.engine.IOFuture`) and the paths' submissions (:class:`sfstore.paths.base.PathFuture`) are
subclasses too.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future as _ConcurrentFuture
from typing import Generic, TypeVar, cast

from sfstore import errors
from sfstore.arguments import check_timeout

__all__ = ["Future", "ExecutorFuture", "DoneFuture", "MappedFuture", "remaining"]

T = TypeVar("T")
U = TypeVar("U")


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a :func:`time.monotonic` value; ``None``: no end), never negative."""
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())


def deadline_after(timeout: float | None) -> float | None:
    """The :func:`time.monotonic` deadline ``timeout`` seconds from now (``None``: no end)."""
    return None if timeout is None else time.monotonic() + timeout


class Future(ABC, Generic[T]):
    """The pending result of some work: :meth:`done`, :meth:`wait`, :meth:`get` (see the module)."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the work has finished, successfully or not (never blocks)."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the work has finished or ``timeout`` seconds passed; return whether it finished.

        Never raises the work's error."""

    @abstractmethod
    def get(self, timeout: float | None = None) -> T:
        """The result; raises the work's error, or :class:`~sfstore.errors.IOTimeoutError` after ``timeout``
        seconds (the work goes on)."""

    def result(self, timeout: float | None = None) -> T:
        """:meth:`get` by the name :class:`concurrent.futures.Future` gives it (``asyncio.wrap_future`` and
        code written for executors call it). On a timeout it raises :class:`~sfstore.errors.IOTimeoutError`,
        a ``TimeoutError`` as ``concurrent.futures.TimeoutError`` is."""
        return self.get(timeout)

    def _timed_out(self, timeout: float | None, what: str = "the operation") -> errors.IOTimeoutError:
        return errors.IOTimeoutError(f"{what} had not finished after {timeout} s (it goes on; wait again)")


class ExecutorFuture(Future[T]):
    """Work running on a thread pool (a :class:`concurrent.futures.Future` underneath).

    Parameters
    ----------
    future : concurrent.futures.Future
        The pool's future.
    what : str, optional
        Names the work in a timeout's message.
    """

    def __init__(self, future: _ConcurrentFuture[T], what: str = "the operation") -> None:
        self._future = future
        self._what = what

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        timeout = check_timeout(timeout, "wait")
        try:
            self._future.exception(timeout)
        except TimeoutError:
            return False
        except BaseException:  # a cancelled future: finished, and get() says why
            return True
        return True

    def get(self, timeout: float | None = None) -> T:
        timeout = check_timeout(timeout, "get")
        try:
            return self._future.result(timeout)
        except TimeoutError:
            if self._future.done():  # the work itself raised TimeoutError
                raise
            raise self._timed_out(timeout, self._what) from None


class DoneFuture(Future[T]):
    """Work that finished before its future was made: a result, or the error to raise."""

    def __init__(self, result: T | None = None, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        check_timeout(timeout, "wait")
        return True

    def get(self, timeout: float | None = None) -> T:
        check_timeout(timeout, "get")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # T is the caller's; None only where T allows it


class MappedFuture(Future[U], Generic[T, U]):
    """Another future's result passed once through ``then`` (counting, closing a descriptor, summing).

    ``then`` runs on the first :meth:`get` that finds the inner work finished, exactly once; its result (or
    error) is what every :meth:`get` returns (raises) from then on. ``on_done``, optional, runs once when the
    inner work finished, whatever the outcome (to release what the work held), before ``then``.
    """

    def __init__(
        self, inner: Future[T], then: Callable[[T], U], *, on_done: Callable[[], None] | None = None
    ) -> None:
        self._inner = inner
        self._then = then
        self._on_done = on_done
        self._lock = threading.Lock()
        self._finished = False
        self._result: U | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._finished or self._inner.done()

    def wait(self, timeout: float | None = None) -> bool:
        return self._finished or self._inner.wait(timeout)

    def get(self, timeout: float | None = None) -> U:
        with self._lock:
            if not self._finished:
                try:
                    value = self._inner.get(timeout)
                except errors.IOTimeoutError as exc:
                    if not self._inner.done():
                        raise
                    self._settle(None, exc)  # the work itself timed out: that is its outcome
                except BaseException as exc:
                    self._settle(None, exc)
                else:
                    self._settle(value, None)
            if self._error is not None:
                raise self._error
            return cast(U, self._result)  # set by ``then`` when there is no error

    def _settle(self, value: T | None, error: BaseException | None) -> None:
        self._finished = True
        try:
            if self._on_done is not None:
                self._on_done()
        except BaseException as exc:  # releasing failed: that is the error, unless the work failed first
            error = error or exc
        if error is None:
            try:
                self._result = self._then(cast(T, value))  # the work's result when it raised nothing
            except BaseException as exc:
                error = exc
        self._error = error

