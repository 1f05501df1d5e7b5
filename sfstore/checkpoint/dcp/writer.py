"""The DCP storage writer: :class:`StorageWriter` writes each rank's items into one data file and commits the
checkpoint with its JSON metadata (see :mod:`sfstore.checkpoint.dcp` for the layout).
"""

from __future__ import annotations

import dataclasses
import errno
import io
import math
import os
import secrets
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from sfstore import errors
from sfstore.buffers import as_buffer
from sfstore.checkpoint.dcp.directory import (
    DATA_NAME,
    DATA_SUFFIX,
    METADATA_NAME,
    RANK_METADATA,
    TORCH_DATA_NAME,
    TORCH_METADATA_NAME,
    TORCH_RANK_METADATA,
    CheckpointDir,
    CheckpointStorage,
    metadata_name,
    stat_in,
)
from sfstore.checkpoint.dcp.metadata_codec import DCP_VERSION, ItemLocation, encode_metadata
from sfstore.checkpoint.host_buffers import check_written
from sfstore.checkpoint.location import DATA_CLASS
from sfstore.checksums import xxh3_64
from sfstore.paths.base import PathFuture, Range

__all__ = ["StorageWriter", "ITEM_ALIGN"]

ITEM_ALIGN = 4096
"""Every item starts at a multiple of this in its data file (whole O_DIRECT blocks, no block shared by two items)."""
_MIN_WINDOW = 64 << 20


@dataclass(frozen=True)
class _FilePrefix:
    """Per-rank ``SavePlan.storage_data``: the data file name prefix assigned by the coordinator."""

    prefix: str


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


def _host_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A CPU contiguous version of ``tensor`` (the tensor itself when it is one) and a byte view of it."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return t, as_buffer(t) if t.numel() else memoryview(b"")


def _chunk_bytes(item: WriteItem) -> int | None:
    """Bytes of the chunk a tensor write item saves (``WriteItem.tensor_storage_size`` is the whole tensor's)."""
    td = item.tensor_data
    if td is None:
        return None
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


class StorageWriter(CheckpointStorage, _DcpStorageWriter):
    """``torch.distributed.checkpoint`` storage writer through sfstore's file path.

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint directory: ``"sf://a/b"`` (``<root>/a/b``, the directory ``fsspec.filesystem("sf")`` calls
        ``sf://a/b``), ``"a/b"`` under the checkpoint class root, or an absolute path (or ``file://`` url).
        ``dcp.save(..., checkpoint_id=...)`` replaces it.
    overwrite : bool, optional
        Replace a checkpoint already in that directory (default True, as DCP's own ``FileSystemWriter`` does;
        False: :class:`~sfstore.errors.PathExistsError`). Atomic: the old checkpoint stays loadable until the new
        metadata is in place; its data files are removed after. A checkpoint in DCP's own format there
        (``.metadata``, ``*.distcp``: what ``dcp.save(checkpoint_id=...)`` without this writer leaves) is
        replaced the same way: its files are removed once the new checkpoint is committed.
    direct, chunk_size, parallelism : optional
        Passed to :class:`~sfstore.paths.file.FilePath` (O_DIRECT mode, bytes per request, requests in flight).

    Notes
    -----
    Each rank writes one data file (see :mod:`sfstore.checkpoint.dcp` for the layout); the coordinator commits the
    checkpoint by writing the JSON metadata atomically in ``finish``. Concurrent saves into one directory are not
    supported (each one's clean-up removes the other's files).
    """

    creates = True

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        direct: str | None = None,
        chunk_size: int | None = None,
        parallelism: int | None = None,
    ) -> None:
        super().__init__(url, direct=direct, chunk_size=chunk_size, parallelism=parallelism)
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False

    # -- DCP interface -----------------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (a new ``save_id``), into ``checkpoint_id`` when given.

        Parameters
        ----------
        checkpoint_id : str or os.PathLike or None
            A checkpoint url (see the class); None keeps the current one.
        """
        self._switch_to(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record this instance's role (and, from torch, ``rank`` and ``use_collectives``).

        Parameters
        ----------
        is_coordinator : bool
            Whether this rank writes the metadata.
        *args, **kwargs
            ``rank`` and ``use_collectives`` keyword arguments, as DCP passes them.
        """
        self.is_coordinator = is_coordinator
        self._set_up_rank(kwargs)

    def _metadata_exists(self, ck: CheckpointDir) -> bool:
        names = [METADATA_NAME] if self.use_collectives else [metadata_name(0), METADATA_NAME]
        names.append(TORCH_METADATA_NAME)  # DCP's own format: a checkpoint at this id all the same
        return any(stat_in(ck, n) is not None for n in names)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Create the directory and refuse an existing checkpoint unless ``overwrite``.

        Parameters
        ----------
        plan : SavePlan
            The planner's local plan.

        Returns
        -------
        SavePlan
            The same plan; without rank coordination it carries this rank's data file prefix.

        Raises
        ------
        sfstore.errors.PathExistsError
            A checkpoint is already there and ``overwrite`` is False.
        """
        ck = self._path()
        if not self.overwrite and self._metadata_exists(ck):
            raise errors.os_error(
                errno.EEXIST, f"a checkpoint already exists at {self.url!r} (overwrite=False was given)",
                ck.full(),
            )
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_FilePrefix(f"__{self.rank}_{secrets.token_hex(8)}"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give each rank's plan its data file prefix ``__<rank>_<token>`` (a new token for every save).

        Parameters
        ----------
        plans : list of SavePlan
            One per rank.

        Returns
        -------
        list of SavePlan
            The plans, with ``storage_data`` set where it was not.
        """
        token = secrets.token_hex(8)
        return [
            dataclasses.replace(plan, storage_data=_FilePrefix(f"__{i}_{token}")) if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into its data file through the file path, then fsync it.

        Parameters
        ----------
        plan : SavePlan
            The final local plan (its ``storage_data`` is the file prefix).
        planner : SavePlanner
            Resolves each item to its tensor or ``BytesIO``.

        Returns
        -------
        torch.futures.Future
            Already completed, with one ``WriteResult`` per item (``storage_data``: :class:`ItemLocation`).
        """
        prefix = plan.storage_data
        if not isinstance(prefix, _FilePrefix):
            raise errors.InvalidRequestError(
                f"the save plan carries {type(prefix).__name__} storage data; it was not prepared by this writer"
            )
        results = _RankFileWriter(self._path(), f"{prefix.prefix}{DATA_SUFFIX}").write(plan.items, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: write the JSON metadata atomically, then remove data files nothing refers to any more.

        Parameters
        ----------
        metadata : Metadata
            The global metadata from the planner.
        results : list of list of WriteResult
            Every rank's write results.
        """
        ck = self._path()
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for ranks in results for wr in ranks}
        metadata.storage_meta = self.storage_meta()
        doc = encode_metadata(metadata)
        own = None if self.use_collectives or self.rank is None else self.rank
        dfd = ck.open_readable()
        try:  # the data files' directory entries are durable before the metadata names them
            os.fsync(dfd)
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, "cannot fsync", ck.full()) from None
        finally:
            os.close(dfd)
        meta = metadata_name(own)
        with ck.fp.writer_at(ck.dirfd(), meta, ck.full(meta), fsync=True,
                             overwrite=True) as w:  # published atomically in the directory of the data files
            w.write(doc)
        referenced = {loc.file for loc in metadata.storage_data.values() if isinstance(loc, ItemLocation)}
        _remove_unreferenced(ck, referenced, own)

    def storage_meta(self) -> StorageMeta | None:
        """``StorageMeta(checkpoint_id=url, save_id=...)`` for the planner and the metadata."""
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)


def _stale(name: str, referenced: set[str], rank: int | None) -> int:
    """Whether the new checkpoint (``rank``: one rank's, saved without coordination) leaves ``name`` unused: 0
    when it does not, 1 for metadata (removed first: no reader finds metadata naming removed files), 2 for data."""
    if name in referenced:
        return 0
    if rank is None and (name in (TORCH_METADATA_NAME, TORCH_METADATA_NAME + ".tmp") or RANK_METADATA.match(name)):
        return 1
    m = TORCH_RANK_METADATA.match(name)
    if m is not None:
        return 1 if rank is None or int(m.group(1)) == rank else 0
    m = DATA_NAME.match(name) or TORCH_DATA_NAME.match(name)
    if m is not None:
        return 2 if rank is None or int(m.group(1)) == rank else 0
    return 0


def _remove_unreferenced(ck: CheckpointDir, referenced: set[str], rank: int | None) -> None:
    """Remove data files (and, for a coordinated save, per-rank metadata) the new checkpoint does not use, and
    the files of a checkpoint in DCP's own format it replaced (``.metadata``, ``__<rank>_<n>.distcp``).

    The directory is opened beneath the root once; its names are listed and removed relative to that
    descriptor."""
    try:
        dirfd = ck.open_readable()
    except OSError:
        return
    try:
        try:
            names = os.listdir(dirfd)
        except OSError:
            return
        order = sorted((kind, name) for name in names if (kind := _stale(name, referenced, rank)))
        for _, name in order:
            try:
                os.unlink(name, dir_fd=dirfd)
            except OSError:
                pass  # clean-up is best effort: the next save tries again
    finally:
        os.close(dirfd)
    try:
        ck.fp.clean_stale_temporaries(ck.prefix)
    except OSError:
        pass


class _RankFileWriter:
    """Writes one rank's items into one data file, a window of requests in flight, and fsyncs it."""

    def __init__(self, ck: CheckpointDir, name: str) -> None:
        self.ck = ck
        self.fp = ck.fp
        self.name = name
        self.path = ck.full(name)
        self.window = max(_MIN_WINDOW, self.fp.chunk_size * self.fp.parallelism)

    def write(self, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        if not items:
            return []
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
        ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
        dirfd = self.ck.dirfd()  # the file is made, and removed on failure, in the directory held
        fd = self.fp.create_at(dirfd, self.name, self.path)
        results: list[WriteResult] = []
        inflight: deque[tuple[PathFuture | None, list[Any]]] = deque()
        batch: list[Range] = []
        keep: list[Any] = []
        pending = 0
        pos = 0
        try:
            for item in ordered:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(data, io.BytesIO):
                        raise errors.InvalidRequestError(f"{item.index.fqn}: the planner gave "
                                                         f"{type(data).__name__} for a bytes item")
                    owner: Any = data
                    view: Any = data.getbuffer()
                else:
                    if not isinstance(data, torch.Tensor):
                        raise errors.InvalidRequestError(f"{item.index.fqn}: the planner gave "
                                                         f"{type(data).__name__} for a tensor item")
                    owner, view = _host_bytes(data)
                    expected = _chunk_bytes(item)
                    if expected is not None and expected != memoryview(view).nbytes:
                        raise errors.InvalidRequestError(
                            f"{item.index.fqn}: the planner's tensor has {memoryview(view).nbytes} bytes, the plan "
                            f"says {expected}"
                        )
                length = memoryview(view).nbytes
                offset = _align_up(pos, ITEM_ALIGN)
                if length:  # one range per item: the path splits it into its chunk-size requests
                    batch.append(Range.write(offset, length, view, 0, fd))
                keep.append((item, owner, view, offset, length))
                pending += length
                pos = offset + length
                if pending >= self.window:
                    self._submit(batch, keep, inflight, results)
                    batch, keep, pending = [], [], 0
            if batch or keep:
                self._submit(batch, keep, inflight, results)
            while inflight:
                self._wait(inflight)
            os.fsync(fd)
        except BaseException:
            for fut, _ in inflight:
                if fut is not None:
                    fut.wait()
            os.close(fd)
            try:
                os.unlink(self.name, dir_fd=dirfd)
            except OSError:
                pass
            raise
        os.close(fd)
        self.fp.file_done(data_class=DATA_CLASS)
        return results

    def _submit(self, batch: list[Range], keep: list[Any], inflight: deque[tuple[PathFuture | None, list[Any]]],
                results: list[WriteResult]) -> None:
        """Submit ``batch`` (at most two batches in flight), then checksum its items while the path writes."""
        while len(inflight) >= 2:
            self._wait(inflight)
        inflight.append((self.fp.submit(batch, data_class=DATA_CLASS) if batch else None, keep))
        for item, _owner, view, offset, length in keep:
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=ItemLocation(self.name, offset, length, xxh3_64(view))))

    def _wait(self, inflight: deque[tuple[PathFuture | None, list[Any]]]) -> None:
        """Wait for the oldest batch; an item written short is an error."""
        fut, keep = inflight.popleft()
        written = iter(fut.get() if fut is not None else [])
        for _item, owner, view, _offset, length in keep:
            if length:  # the items with bytes have one range each, in order
                check_written(next(written), length, self.path, self.fp)
            if isinstance(view, memoryview) and isinstance(owner, io.BytesIO):
                view.release()


# ---------------------------------------------------------------------------------------------------------------
# Reader
