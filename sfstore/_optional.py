"""Optional packages: import one, or raise :class:`~sfstore.errors.MissingDependencyError` with the extra that
installs it.

sfstore's core needs only the standard library and ``xxhash``; each integration needs its own packages, which
the extras in ``pyproject.toml`` install (``pip install 'sfstore[hf]'``). A face imports them through
:func:`require`, so a user without them is told what to install instead of meeting a bare
``ModuleNotFoundError`` from deep inside sfstore.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from sfstore import errors

__all__ = ["require"]


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` for ``purpose``; raise a typed error naming the extra to install when it cannot be.

    Parameters
    ----------
    module : str
        The module to import (``"transformers"``, ``"torch.distributed.checkpoint"``).
    extra : str
        The extra of sfstore that installs it (``"hf"``): the message says ``pip install 'sfstore[hf]'``.
    purpose : str
        What needs it, in the user's words (``"sfstore.checkpoint.hf"``): the message starts with it.

    Returns
    -------
    types.ModuleType
        The module.

    Raises
    ------
    sfstore.errors.MissingDependencyError
        ``module`` (or a package it imports) is not installed, or fails to import; the original error is its
        ``__cause__``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        missing = exc.name or package
        if missing.split(".")[0] == package:
            what = f"{purpose} needs {package}"
        else:  # the package is there, but something it imports is not
            what = f"{purpose} needs {package}, which cannot be imported ({type(exc).__name__}: {exc})"
        raise errors.MissingDependencyError(
            f"{what}: pip install 'sfstore[{extra}]'", name=package, extra=extra) from exc
