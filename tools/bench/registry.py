"""The suites of ``python -m tools.bench``: each module of :mod:`tools.bench.suites` registers itself here.

A new suite is one file, ``tools/bench/suites/<name>.py``, that ends with::

    register(Suite(name="files", help="...", add_arguments=add_arguments, run=run))

``run(args)`` prints its table as cases finish and returns the suite's JSON document
(``{"bench": name, "machine": ..., "date": ..., "cases": [...]}``, see ``BENCHMARKING.md``).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Suite", "register", "all_suites", "unavailable_suites", "load_suites"]


@dataclass(frozen=True)
class Suite:
    """One benchmark suite.

    Attributes
    ----------
    name : str
        What follows ``python -m tools.bench`` (``engine``).
    help : str
        One line for ``--help``.
    add_arguments : callable
        ``add_arguments(parser)`` adds the suite's own options (the common ones are already there).
    run : callable
        ``run(args) -> dict`` runs the suite, prints its table and returns its JSON document.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict[str, Any]]


_SUITES: dict[str, Suite] = {}
_UNAVAILABLE: dict[str, str] = {}
_loaded = False


def register(suite: Suite) -> Suite:
    """Add ``suite`` to the registry and return it (a suite module calls this when it is imported).

    Raises :class:`ValueError` when another suite already has that name, or the name is reserved (``all``).
    """
    if suite.name == "all":
        raise ValueError("'all' is reserved for running every suite")
    if suite.name in _SUITES and _SUITES[suite.name] is not suite:
        raise ValueError(f"two suites named {suite.name!r}")
    _SUITES[suite.name] = suite
    return suite


def load_suites() -> None:
    """Import every module of :mod:`tools.bench.suites` once, so each registers itself.

    A module that fails to import (a missing optional dependency) is remembered with the reason instead of
    breaking the others; see :func:`unavailable_suites`.
    """
    global _loaded
    if _loaded:
        return
    package = importlib.import_module("tools.bench.suites")

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        try:
            importlib.import_module(f"{package.__name__}.{info.name}")
        except ImportError as exc:
            _UNAVAILABLE[info.name] = f"{type(exc).__name__}: {exc}"
    _loaded = True


def all_suites() -> dict[str, Suite]:
    """Every registered suite by name, in name order (loading them first).

    Returns
    -------
    dict
        Name to :class:`Suite`.
    """
    load_suites()
    return dict(sorted(_SUITES.items()))


def unavailable_suites() -> dict[str, str]:
    """Suite modules that could not be imported, with the reason.

    Returns
    -------
    dict
        Module name to the import error.
    """
    load_suites()
    return dict(_UNAVAILABLE)
