"""webdataset's ``gopen`` handler for ``sf://``: ``webdataset.WebDataset("sf://shards/train-{000000..000099}.tar")``.

webdataset opens every shard URL through ``webdataset.gopen.gopen``, which dispatches on the URL's scheme in the
dict ``webdataset.gopen.gopen_schemes`` and raises ``ValueError("...: no gopen handler defined")`` for a scheme
it lacks. :func:`install` (run when :mod:`sfstore.fs` is imported) puts :func:`gopen_sf` there under ``"sf"``:
at once where ``webdataset.gopen`` is already imported, else right after it is, through a one-shot import hook,
because importing webdataset imports torch (more than a second) and sfstore must not pay that for users who do
not use it. A handler the user put under ``"sf"`` first is left alone.

Shards are read through :class:`~sfstore.fs.SFFile` (engine readahead while tarfile consumes a block) and
written (``webdataset.ShardWriter("sf://...")``, mode ``"wb"``) atomically: a shard appears under its name
complete, on close. Without importing sfstore, ``"pipe:sfstore cat sf://shards/train-000000.tar"`` reads the
same bytes through the CLI.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import MutableMapping, Sequence
from typing import IO, Any

from sfstore import errors

__all__ = ["SCHEME", "gopen_sf", "install", "register"]

SCHEME = "sf"
_MODULE = "webdataset.gopen"


def gopen_sf(url: str, mode: str = "rb", bufsize: int = 8192) -> IO[bytes]:
    """Open the ``sf://`` URL ``url`` for webdataset: ``"rb"`` reads, ``"wb"`` writes (published on close).

    The signature is webdataset's handler signature. ``bufsize`` is ignored: reads go in the filesystem's
    readahead blocks (up to 32 MiB), not in webdataset's pipe-sized buffers. The root is the default one of
    ``fsspec.open("sf://...")`` (``SFSTORE_ROOT``, the config file's, ``SFSTORE_DATA_DIR``). A missing shard
    raises :class:`~sfstore.errors.PathNotFoundError`, a path out of the root
    :class:`~sfstore.errors.PathEscapeError`.
    """
    if mode not in ("rb", "wb"):
        raise errors.InvalidRequestError(f"sf:// shards open in mode 'rb' or 'wb', not {mode!r}: {url}")
    from sfstore.fs import SFFileSystem

    f: IO[bytes] = SFFileSystem().open(url, mode)
    return f


def register(schemes: MutableMapping[str, Any] | None = None) -> None:
    """Add :func:`gopen_sf` to webdataset's scheme table (``webdataset.gopen.gopen_schemes`` by default)
    unless ``"sf"`` already has a handler."""
    if schemes is None:
        schemes = importlib.import_module(_MODULE).gopen_schemes
    schemes.setdefault(SCHEME, gopen_sf)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds no module itself: when ``webdataset.gopen`` is about to load, it takes the spec the other finders
    give and makes its loader call :func:`register` right after the module body ran, then leaves
    ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_body = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run_body(module)
            _remove_hook()
            register(module.gopen_schemes)

        # The loader object is this module's own (one per spec), so wrapping its method touches nothing else.
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]


def install() -> None:
    """Register the ``sf`` handler now if ``webdataset.gopen`` is imported, else when it is (idempotent)."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        register(module.gopen_schemes)
        return
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
