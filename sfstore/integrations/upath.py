"""universal_pathlib's ``UPath`` class for ``sf://``: ``UPath("sf://train/0001.tar")`` is an :class:`SFPath`.

universal_pathlib finds it through the entry point ``universal_pathlib.implementations`` (``sf =
"sfstore.integrations.upath:SFPath"`` in sfstore's package metadata), so no import of sfstore comes first and no
"not explicitly implemented" warning is given. Everything ``UPath`` does goes through
:class:`~sfstore.fs.SFFileSystem`; this class adds what the generic one refuses or does differently from
``pathlib``: :meth:`SFPath.replace`, and :meth:`SFPath.rename` with ``os.rename``'s meaning.

>>> from upath import UPath
>>> p = UPath("sf://runs/a.txt")                       # doctest: +SKIP
>>> p.write_text("x"); p.replace("sf://runs/b.txt")    # doctest: +SKIP
SFPath('runs/b.txt', protocol='sf')
"""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import Any

from sfstore._optional import require

require("fsspec", "data", "UPath for sf:// (sfstore.integrations.upath)")
require("upath", "data", "UPath for sf:// (sfstore.integrations.upath)")

from fsspec.core import split_protocol  # noqa: E402  (after the checks that say which extra installs them)
from fsspec.registry import get_filesystem_class  # noqa: E402
from upath import UPath  # noqa: E402
from upath.types import UNSET_DEFAULT, WritablePathLike  # noqa: E402

__all__ = ["SFPath"]

# universal_pathlib parses URLs with the "flavour" of the fsspec class already in fsspec's registry of imported
# classes, and for a protocol whose class is not there yet it warns ("Could not find default for known
# protocol") and caches a generic flavour that does not fold ``..`` or refuse escapes as sf:// does. This module
# is loaded (through the entry point) before UPath parses its first sf:// URL, so putting the class there now
# (importing sfstore.fs) gives every SFPath sf's own parsing.
get_filesystem_class("sf")


class SFPath(UPath):
    """A ``UPath`` on ``sf://`` (see :class:`~sfstore.fs.SFFileSystem` for what names mean).

    As everywhere in ``sf://``, a name without the protocol is root-relative: ``p.rename("b.txt")`` names
    ``sf://b.txt``, and ``"/b.txt"`` names the same file. ``root=`` (and any other
    :class:`~sfstore.fs.SFFileSystem` argument) passes through as a storage option:
    ``UPath("sf://x", root="/data")``.
    """

    __slots__ = ()

    def _sf_target(self, target: WritablePathLike) -> SFPath:
        """``target`` as a path on this same filesystem (a string without the protocol is root-relative)."""
        if isinstance(target, UPath):
            if not isinstance(target, SFPath):
                raise ValueError(f"expected protocol {self.protocol!r}, got: {target.protocol!r}")
            if dict(target.storage_options) != dict(self.storage_options):
                raise ValueError(f"{target} is on another sf:// filesystem (other storage options) than {self}")
            return target
        if isinstance(target, str):
            text = target
        elif isinstance(target, PurePath):
            text = target.as_posix()
        elif isinstance(target, os.PathLike):
            text = os.fspath(target)
        else:
            text = target.__vfspath__()
        protocol, _ = split_protocol(text)
        if protocol not in (None, self.protocol):
            raise ValueError(f"expected protocol {self.protocol!r}, got: {protocol!r}")
        return self.with_segments(text if protocol else f"{self.protocol}://{text.lstrip('/')}")

    def replace(self, target: WritablePathLike) -> SFPath:
        """Rename to ``target``, replacing an existing file there atomically (``os.replace``; see
        :meth:`SFFileSystem.replace <sfstore.fs.SFFileSystem.replace>`); return the new path."""
        new = self._sf_target(target)
        self.fs.replace(self.path, new.path)
        return new

    def rename(
        self,
        target: WritablePathLike,
        *,
        recursive: bool = UNSET_DEFAULT,
        maxdepth: int | None = UNSET_DEFAULT,
        **kwargs: Any,
    ) -> SFPath:
        """Rename to ``target`` as ``os.rename`` does on POSIX (an existing file there is replaced); return the
        new path.

        The generic ``UPath.rename`` moves *into* an existing directory (``fs.mv``) and treats a bare name as
        relative to a current directory ``sf://`` does not have; this is ``pathlib``'s rename. Its deprecated
        ``recursive`` / ``maxdepth`` arguments still reach the generic one.
        """
        if recursive is not UNSET_DEFAULT or maxdepth is not UNSET_DEFAULT or kwargs:
            moved: SFPath = super().rename(self._sf_target(target), recursive=recursive, maxdepth=maxdepth, **kwargs)
            return moved
        return self.replace(target)
