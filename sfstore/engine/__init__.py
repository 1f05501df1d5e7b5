"""I/O engines: batches of reads and writes with many requests in flight.

>>> from sfstore.engine import Request, get_engine
>>> engine = get_engine()                      # the ``engine`` setting: auto -> uring, else threads, else python
>>> engine.run([Request.read(fd, 0, 4096, buf)])  # doctest: +SKIP
[4096]

Engines: ``uring`` (io_uring) and ``threads`` (native thread pool) come from the native helper
(``sfstore._native``); ``python`` (``os.preadv``/``os.pwritev`` on a thread pool) always works. Every engine
checks the whole batch before any I/O, loops on short reads, treats EOF as a short count, and handles
``O_DIRECT`` descriptors (bounce buffers for misaligned requests unless the ``bounce`` setting is off).
"""

from __future__ import annotations

import errno
import fcntl
import importlib
import os
import threading
from types import ModuleType
from typing import Any

from sfstore import defaults, errors, forks
from sfstore.engine.base import IOEngine, IOFuture, Request, direct_io_alignment

__all__ = [
    "Request",
    "IOFuture",
    "IOEngine",
    "get_engine",
    "describe_engines",
    "direct_io_alignment",
    "open_fd",
    "ENGINE_ORDER",
]

ENGINE_ORDER: tuple[str, ...] = ("uring", "threads", "python")
"""The engines, in the order ``auto`` tries them."""

_NATIVE_BACKENDS = ("uring", "threads")

_cache: dict[tuple[str, int, int, int, int], IOEngine] = {}
_cache_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # Engines own threads that do not exist in the child; it gets fresh ones on first use.
    global _cache_lock
    _cache_lock = threading.Lock()
    _cache.clear()


forks.after_fork(_after_fork_in_child)


def _native_module() -> ModuleType:
    return importlib.import_module("sfstore.engine.native")


def _python_status() -> tuple[bool, str]:
    if not (hasattr(os, "preadv") and hasattr(os, "pwritev")):
        return (False, "os.preadv/os.pwritev are missing on this platform")
    return (True, "pure Python: os.preadv/os.pwritev on a thread pool (always available)")


def _status() -> dict[str, tuple[bool, str]]:
    """``{engine: (available, reason)}`` for every engine, in :data:`ENGINE_ORDER`."""
    status: dict[str, tuple[bool, str]] = {}
    try:
        native = _native_module()
    except ImportError as exc:
        reason = f"native helper not built: {exc}"
        status.update({name: (False, reason) for name in _NATIVE_BACKENDS})
    else:
        try:
            raw: dict[str, Any] = dict(native.native_status())
        except Exception as exc:  # a broken helper must not take the Python engine down with it
            reason = f"native helper failed to report its status: {exc!r}"
            status.update({name: (False, reason) for name in _NATIVE_BACKENDS})
        else:
            for name in _NATIVE_BACKENDS:
                available, why = raw.get(name, (False, "not reported by the native helper"))
                status[name] = (bool(available), str(why))
    status["python"] = _python_status()
    return {name: status[name] for name in ENGINE_ORDER}


def _create(name: str, queue_depth: int, threads: int) -> IOEngine:
    if name == "python":
        from sfstore.engine.python import PythonEngine

        return PythonEngine(queue_depth, threads)
    engine = _native_module().NativeEngine(name, queue_depth, threads)
    if not isinstance(engine, IOEngine):
        raise errors.EngineUnavailableError(f"the native helper returned {type(engine).__name__}, not an IOEngine")
    return engine


def _resolve(choice: str, queue_depth: int, threads: int, origin: str) -> IOEngine:
    status = _status()
    if choice == "auto":
        skipped: list[str] = []
        for name in ENGINE_ORDER:
            available, why = status[name]
            if not available:
                skipped.append(f"{name}: {why}")
                continue
            try:
                return _create(name, queue_depth, threads)
            except (errors.ConfigError, errors.OutOfResourcesError):
                # A bad setting is the caller's to fix, and memory or threads that ran out will not be there
                # for the next engine either: neither is a reason to pick another engine.
                raise
            except (errors.SfstoreError, OSError, RuntimeError, ImportError) as exc:
                skipped.append(f"{name}: {exc}")
        raise errors.EngineUnavailableError("no I/O engine can run here (" + "; ".join(skipped) + ")")
    available, why = status[choice]
    if not available:
        raise errors.EngineUnavailableError(f"the {choice} I/O engine ({origin}) cannot run here: {why}")
    try:
        return _create(choice, queue_depth, threads)
    except (errors.EngineUnavailableError, errors.ConfigError, errors.OutOfResourcesError):
        raise  # typed already; OutOfResourcesError keeps its errno (ENOMEM, EAGAIN)
    except (OSError, RuntimeError, ImportError) as exc:
        raise errors.EngineUnavailableError(f"the {choice} I/O engine ({origin}) failed to start: {exc}") from exc


def get_engine(name: str | None = None, *, queue_depth: int | None = None, threads: int | None = None) -> IOEngine:
    """The I/O engine ``name``, shared per process and per arguments.

    Parameters
    ----------
    name : str, optional
        ``"uring"``, ``"threads"``, ``"python"`` or ``"auto"`` (the first of those that works here);
        default: the ``engine`` setting (``SFSTORE_ENGINE``).
    queue_depth : int, optional
        Requests in flight at most; default: the ``queue_depth`` setting.
    threads : int, optional
        Worker threads (``threads`` and ``python`` engines); default: the ``io_threads`` setting.

    Returns
    -------
    IOEngine
        The same object for the same resolved arguments until it is closed; a forked child gets fresh engines.

    Raises
    ------
    sfstore.errors.EngineUnavailableError
        The engine asked for cannot run here (the message says why), or none can (``auto``).
    sfstore.errors.ConfigError
        An unknown engine name, or a queue depth or thread count outside the settings' ranges.
    sfstore.errors.OutOfResourcesError
        Memory or threads ran out starting the engine (``errno`` ENOMEM or EAGAIN); nothing was started.
    """
    if name is not None:
        choice = str(defaults.SETTINGS["engine"].parse(name, "get_engine(name=...)"))
        origin = f"get_engine({choice!r})"
    else:
        choice = str(defaults.get("engine"))
        origin = f"engine={choice} from {defaults.source('engine')}"
    qd = int(
        defaults.SETTINGS["queue_depth"].parse(queue_depth, "get_engine(queue_depth=...)")
        if queue_depth is not None
        else defaults.get("queue_depth")
    )
    th = int(
        defaults.SETTINGS["io_threads"].parse(threads, "get_engine(threads=...)")
        if threads is not None
        else defaults.get("io_threads")
    )
    # The settings an engine is built with are part of its identity: a changed (or bad) value gets a new engine
    # (or its ConfigError), never the cached one built with the old value.
    spin, bounce = int(defaults.get("uring_spin_us")), int(defaults.get("bounce_buffer_size"))
    key = (choice, qd, th, spin, bounce)
    with _cache_lock:
        engine = _cache.get(key)
        if engine is not None and not engine.closed:
            return engine
        if choice == "auto":
            engine = None
        if engine is None or engine.closed:
            engine = _resolve(choice, qd, th, origin)
        _cache[key] = engine
        concrete = (engine.name, qd, th, spin, bounce)
        known = _cache.get(concrete)
        if known is None or known.closed:
            _cache[concrete] = engine
        return engine


def describe_engines() -> dict[str, Any]:
    """Which engines can run here and which one the ``engine`` setting selects.

    Returns
    -------
    dict
        ``{"setting": "auto", "source": "default", "selected": "python" | None, "why": "...",
        "engines": {"uring": {"available": bool, "reason": str}, "threads": {...}, "python": {...}}}``.
        ``selected`` is ``None`` when the setting names an engine that cannot run (``get_engine()`` then raises).
        ``checksums`` says where read checksums (``submit(..., checksums=...)``) are checked: on the native
        engine's service thread (``"engine"``), or on the caller's thread after the batch where the helper was
        built without ``xxhash.h`` or is missing (``"caller"``; the Python engine checks them in its workers);
        ``checksums_why`` says why, naming the package that was missing when the helper was built.
    """
    setting = str(defaults.get("engine"))
    source = defaults.source("engine")
    status = _status()
    engines = {name: {"available": ok, "reason": why} for name, (ok, why) in status.items()}
    selected: str | None
    if setting == "auto":
        selected = next((name for name in ENGINE_ORDER if status[name][0]), None)
        skipped = [f"{name} is unavailable ({status[name][1]})" for name in ENGINE_ORDER if not status[name][0]]
        if selected is None:
            why = "engine=auto: no engine can run here: " + "; ".join(skipped)
        else:
            first = "" if not skipped else "; ".join(skipped) + "; "
            why = f"engine=auto ({source}): {first}{selected} is the first engine that works here"
    else:
        ok, reason = status[setting]
        selected = setting if ok else None
        why = f"engine={setting} ({source})" + ("" if ok else f", which cannot run here: {reason}")
    checksums, checksums_why = "caller", "no engine can run here"
    if selected in ("uring", "threads"):
        from sfstore.engine.native import checksums_where

        checksums = checksums_where()
        checksums_why = (
            "xxh3 in the native engine" if checksums == "engine" else
            "the native helper was built without xxhash.h (Debian/Ubuntu: libxxhash-dev, Fedora/RHEL: xxhash-devel; "
            "install it and reinstall sfstore): the caller's thread checks read checksums after each batch")
    elif selected == "python":
        checksums, checksums_why = "engine", "the Python engine's workers check them"
    return {"setting": setting, "source": source, "selected": selected, "why": why, "engines": engines,
            "checksums": checksums, "checksums_why": checksums_why}


_DIRECT_MODES = {True: "on", False: "off", "on": "on", "off": "off", "auto": "auto"}


def open_fd(
    path: str | os.PathLike[str], flags: int, mode: int = 0o644, direct: str | bool | None = None
) -> tuple[int, bool]:
    """``os.open`` with ``O_DIRECT`` where asked for and allowed; return ``(fd, is_direct)``.

    Parameters
    ----------
    path : str or os.PathLike
        The file.
    flags : int
        ``os.open`` flags (``O_CLOEXEC`` is added). ``O_DIRECT`` in ``flags`` counts as ``direct="on"`` unless
        ``direct`` is given.
    mode : int
        Permissions of a created file.
    direct : {"auto", "on", "off"} or bool, optional
        ``True``/``"on"``: use ``O_DIRECT`` and fail where the filesystem refuses it; ``"auto"``: use it where
        the filesystem allows it, else buffered; ``False``/``"off"``: buffered. ``None``: the ``direct_io``
        setting (``SFSTORE_DIRECT_IO``).

    Raises
    ------
    sfstore.errors.SfstoreOSError
        The open failed (:class:`~sfstore.errors.PathNotFoundError` for a missing file), or ``direct="on"``
        and the filesystem refuses ``O_DIRECT`` (errno ``EINVAL``).
    sfstore.errors.InvalidRequestError
        ``direct`` is not one of the values above.
    """
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct is None:
        wanted = "on" if flags & o_direct else str(defaults.get("direct_io"))
    else:
        key: str | bool = direct.strip().lower() if isinstance(direct, str) else direct
        if key not in _DIRECT_MODES:
            raise errors.InvalidRequestError(
                f"open_fd: direct must be 'auto', 'on', 'off', True or False, not {direct!r}"
            )
        wanted = _DIRECT_MODES[key]
    name = os.fspath(path)
    try:
        fd = os.open(name, (flags & ~o_direct) | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, f"cannot open {name!r}", name) from None
    if wanted == "off" or not o_direct:
        if wanted == "on":
            os.close(fd)
            raise errors.os_error(errno.EINVAL, f"cannot open {name!r} with O_DIRECT: not supported here", name)
        return fd, False
    try:
        current = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, current | o_direct)
    except OSError as exc:
        if wanted == "on":
            os.close(fd)
            raise errors.os_error(
                exc.errno or errno.EINVAL,
                f"cannot open {name!r} with O_DIRECT (direct_io=on): the filesystem refuses it",
                name,
            ) from None
        return fd, False
    return fd, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & o_direct)
