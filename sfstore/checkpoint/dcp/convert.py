"""Torch's format: :func:`to_torch_save` converts a checkpoint of this storage into one ``torch.save`` file."""

from __future__ import annotations

import os
from typing import IO, Any, cast

import torch

from sfstore import errors
from sfstore.checkpoint import location
from sfstore.checkpoint.dcp.reader import StorageReader
from sfstore.paths.file import AtomicWriter, FilePath

__all__ = ["to_torch_save"]


class _Sink:
    """The file object ``torch.save`` writes to: an :class:`~sfstore.paths.file.AtomicWriter`."""

    def __init__(self, writer: AtomicWriter) -> None:
        self._writer = writer

    def write(self, data: Any) -> int:
        return self._writer.write(data)

    def flush(self) -> None:
        """Nothing to do: the writer publishes on close."""


def _torch_save_target(path: str | os.PathLike[str]) -> tuple[FilePath, str]:
    """The file path and root-relative name a :func:`to_torch_save` output goes to."""
    text = location.url_text(path)
    if "://" in text and not text.startswith(("sf://", "file://")):
        raise errors.InvalidRequestError(f"torch.save target {text!r}: an sf:// url or a host path")
    kind, where = location.split_url(text)
    if kind == location.SF:
        return location.root_for(kind), where
    # A host path, relative ones from the working directory as torch.save has them.
    parent, name = os.path.split(os.path.abspath(where))
    return location.file_path(parent, True), name


def to_torch_save(url: str | os.PathLike[str], torch_save_path: str | os.PathLike[str], *,
                  verify: bool = True) -> str:
    """Convert the DCP checkpoint of this storage at ``url`` into one ``torch.save`` file.

    The whole state dict (every rank's shards put together, nesting restored) is read through
    :class:`StorageReader` -- the way ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` reads DCP's
    own format, with DCP's ``_EmptyStateDictLoadPlanner`` -- and written with ``torch.save``, published
    atomically (a temporary name, fsync, rename): ``torch.load(path, weights_only=True)`` reads it.

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint (the forms of :class:`~sfstore.checkpoint.dcp.StorageWriter`).
    torch_save_path : str or os.PathLike
        The file to write: an ``sf://`` url, or a host path (relative ones from the working directory, as
        ``torch.save`` has them). An existing file there is replaced.
    verify : bool, optional
        Check every item's ``xxh3_64`` as it is read (default True).

    Returns
    -------
    str
        The host path written.

    Raises
    ------
    sfstore.errors.PathNotFoundError
        No checkpoint of this storage at ``url`` (one saved in DCP's own format there: the message says so;
        convert it with ``dcp_to_torch_save(sfstore.fs.local_path(url), ...)``).
    sfstore.errors.CorruptCheckpointError
        As :meth:`StorageReader.read_metadata` and reads raise it.

    Notes
    -----
    Memory: the whole state dict in host memory, once (run it on one rank, as torch's converter says), plus
    what ``torch.save`` buffers.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    fp, name = _torch_save_target(torch_save_path)
    reader = StorageReader(url, verify=verify)
    try:
        # Read here first: DCP turns a metadata read that fails into an untyped AssertionError.
        reader.read_metadata()
    except errors.PathNotFoundError as exc:
        try:
            reader.read_metadata(rank=0)  # saved without rank coordination, as DCP's loader falls back to
        except errors.SfstoreError:
            raise exc from None
    state: dict[str, Any] = {}
    try:
        planner = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:
        # DCP wraps what each rank raised; one process ran here: its typed error is what the caller gets.
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, errors.SfstoreError):
                raise inner from None
        raise
    with fp.open_writer(name, fsync=True) as writer:
        torch.save(state, cast("IO[bytes]", _Sink(writer)))
    return fp.full(name)
