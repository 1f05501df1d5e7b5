"""The DCP storage reader: :class:`StorageReader` reads the items of a plan straight into the planner's tensors
where it can, verifying each item read whole (see :mod:`sfstore.checkpoint.dcp`).
"""

from __future__ import annotations

import errno
import io
import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.futures import Future

from sfstore import errors
from sfstore.buffers import as_buffer
from sfstore.checkpoint import location
from sfstore.checkpoint.dcp.directory import (
    CheckpointDir,
    CheckpointStorage,
    metadata_name,
    stat_in,
    torch_metadata_name,
)
from sfstore.checkpoint.dcp.metadata_codec import MAX_METADATA_BYTES, ItemLocation, decode_metadata
from sfstore.checkpoint.location import DATA_CLASS
from sfstore.checksums import xxh3_64
from sfstore.paths.base import Range
from sfstore.paths.file import FilePath, OpenFile

__all__ = ["StorageReader"]


@dataclass
class _Job:
    """One read item of one batch: where its bytes land and what happens after."""

    item: ReadItem
    loc: ItemLocation
    file_offset: int
    length: int
    buffer: Any  # what the read fills (a tensor, a temporary tensor or a bytearray)
    target: torch.Tensor | None = None  # the planner's tensor (None for bytes items)
    box: torch.Tensor | None = None  # the view of the temporary that holds the requested box
    whole: bool = False  # the read covers the whole stored item (its checksum can be verified)
    temp_bytes: int = 0


class StorageReader(CheckpointStorage, _DcpStorageReader):
    """``torch.distributed.checkpoint`` storage reader through sfstore's file path.

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint directory (as for :class:`~sfstore.checkpoint.dcp.StorageWriter`);
        ``dcp.load(..., checkpoint_id=...)`` replaces it.
    verify : bool, optional
        Check the ``xxh3_64`` of every item read whole (default True).
    direct, chunk_size, parallelism : optional
        Passed to :class:`~sfstore.paths.file.FilePath`.
    temp_budget : int, optional
        Bytes of temporary tensors per read batch, for ranges that cannot land in the target directly
        (default 256 MiB).

    Notes
    -----
    Never unpickles: metadata is JSON; non-tensor items are loaded with ``torch.load(weights_only=True)`` and
    given to the planner re-serialized (see :mod:`sfstore.checkpoint.dcp`).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        verify: bool = True,
        direct: str | None = None,
        chunk_size: int | None = None,
        parallelism: int | None = None,
        temp_budget: int = 256 << 20,
    ) -> None:
        super().__init__(url, direct=direct, chunk_size=chunk_size, parallelism=parallelism)
        self.verify = verify
        self.temp_budget = int(temp_budget)
        self.storage_data: dict[MetadataIndex, ItemLocation] = {}
        self._state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self.load_id = str(uuid.uuid4())

    # -- DCP interface -----------------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load (a new ``load_id``), from ``checkpoint_id`` when given.

        Parameters
        ----------
        checkpoint_id : str or os.PathLike or None
            A checkpoint url; None keeps the current one.
        """
        self.storage_data = {}
        self._state = {}
        self._switch_to(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read and validate the JSON metadata (``rank=N``: the per-rank metadata of an uncoordinated save).

        Parameters
        ----------
        *args, **kwargs
            ``rank`` as DCP passes it when the global metadata is missing.

        Returns
        -------
        Metadata
            With ``storage_meta.load_id`` set to this load's id.

        Raises
        ------
        sfstore.errors.PathNotFoundError
            No checkpoint there, or the one there was saved last in DCP's own format (``.metadata``: the
            message says how to load it).
        sfstore.errors.CorruptCheckpointError
            The metadata is oversized, not JSON, or fails validation.
        """
        rank = kwargs.get("rank")
        ck = self._path()
        own = None if rank is None else int(rank)
        name, theirs = metadata_name(own), torch_metadata_name(own)
        torch_format = stat_in(ck, theirs, by_name=True)
        ours = stat_in(ck, name, by_name=True)
        if torch_format is not None and (ours is None or torch_format.st_mtime_ns >= ours.st_mtime_ns):
            # The id was last saved in DCP's own format (dcp.save(checkpoint_id=...) without this storage's
            # writer): what ours says there, if anything, is older than what DCP's reader would give. A tie (one
            # clock tick) is refused too: failing beats loading what may be the older of the two.
            raise errors.PathNotFoundError(
                errno.ENOENT,
                f"the checkpoint at {self.url!r} was last saved in DCP's own format ({theirs}, pickled; what "
                "dcp.save(checkpoint_id=...) without sfstore's StorageWriter writes), not sfstore's: load it with "
                "dcp.load(state_dict, checkpoint_id=url) and no storage_reader (DCP's own reader unpickles it)",
                ck.full(),
            )
        try:
            # Opened without blocking and checked to be a regular file: a FIFO there is refused, not waited on.
            raw = location.read_regular(ck.fp, ck.name(name), limit=MAX_METADATA_BYTES,
                                        what=f"metadata of {self.url!r}:")
        except errors.PathNotFoundError:
            raise errors.os_error(errno.ENOENT, f"no sfstore DCP checkpoint at {self.url!r} ({name} is missing)",
                                  ck.full(name)) from None
        metadata = decode_metadata(raw)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Take the item locations and tensor layouts from ``metadata``.

        Parameters
        ----------
        metadata : Metadata
            From :meth:`read_metadata`.
        is_coordinator : bool
            Unused (every rank reads its own items).
        *args, **kwargs
            ``rank`` and ``use_collectives``, as DCP passes them.
        """
        storage = metadata.storage_data
        if not isinstance(storage, dict) or not all(isinstance(v, ItemLocation) for v in storage.values()):
            raise errors.CorruptCheckpointError("metadata has no sfstore storage data (not an sfstore DCP checkpoint)")
        self.storage_data = storage
        self._state = dict(metadata.state_dict_metadata)
        self._set_up_rank(kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Return the planner's local ``plan`` unchanged: a load has nothing storage-specific to plan."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Return ``plans`` (one per rank) unchanged: every rank reads its own items."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the planner's targets: one batch per file (and temp budget).

        Parameters
        ----------
        plan : LoadPlan
            The final local plan.
        planner : LoadPlanner
            Gives the target tensors and takes the non-tensor values.

        Returns
        -------
        torch.futures.Future
            Already completed.

        Raises
        ------
        sfstore.errors.CorruptCheckpointError
            A missing or truncated data file, a checksum mismatch, a stored item whose size does not match its
            tensor, or a non-tensor item ``torch.load(weights_only=True)`` refuses.
        """
        ck = self._path()
        per_file: dict[str, list[tuple[ReadItem, ItemLocation]]] = {}
        for item in plan.items:
            loc = self.storage_data.get(item.storage_index)
            if loc is None:
                raise errors.CorruptCheckpointError(
                    f"metadata has no location for {item.storage_index.fqn!r} at offset "
                    f"{list(item.storage_index.offset or [])}", tensor=item.storage_index.fqn)
            per_file.setdefault(loc.file, []).append((item, loc))
        for name, entries in per_file.items():
            self._read_file(ck, name, entries, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- reading -----------------------------------------------------------------------------------------------

    def _read_file(self, ck: CheckpointDir, name: str, entries: list[tuple[ReadItem, ItemLocation]],
                   planner: LoadPlanner) -> None:
        # Opened once beneath the root (a FIFO refused without waiting): every range is read from that file.
        full = ck.full(name)
        try:
            of = ck.fp.open_file(ck.name(name))
        except errors.PathNotFoundError:
            raise errors.CorruptCheckpointError(
                f"data file {name} of checkpoint {self.url!r} is missing", shard=name,
                tensor=entries[0][0].storage_index.fqn) from None
        except (errors.NotARegularFileError, errors.IsADirectoryPathError):
            what = f"data file of checkpoint {self.url!r}:"
            location.check_regular(ck.fp.stat(ck.name(name)), full, what, shard=name)  # says what it is instead
            raise errors.CorruptCheckpointError(f"{what} {full} is not a regular file", shard=name) from None
        with of:
            self._read_open_file(ck.fp, of, name, entries, planner)
        ck.fp.file_done(data_class=DATA_CLASS)

    def _read_open_file(self, fp: FilePath, of: OpenFile, name: str, entries: list[tuple[ReadItem, ItemLocation]],
                        planner: LoadPlanner) -> None:
        size = of.size
        for item, loc in entries:
            if loc.offset + loc.length > size:
                raise errors.CorruptCheckpointError(
                    f"data file {name} of checkpoint {self.url!r} is truncated: it has {size} bytes, item "
                    f"{item.storage_index.fqn!r} needs bytes {loc.offset}..{loc.offset + loc.length}",
                    shard=name, tensor=item.storage_index.fqn)
        batch: list[_Job] = []
        temp = 0
        for item, loc in entries:
            job = self._plan(item, loc, planner)
            if batch and temp + job.temp_bytes > self.temp_budget:
                self._run(fp, of, name, batch, planner)
                batch, temp = [], 0
            batch.append(job)
            temp += job.temp_bytes
        if batch:
            self._run(fp, of, name, batch, planner)

    def _plan(self, item: ReadItem, loc: ItemLocation, planner: LoadPlanner) -> _Job:
        fqn = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            return _Job(item, loc, loc.offset, loc.length, bytearray(loc.length), whole=True, temp_bytes=loc.length)
        md = self._state.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise errors.CorruptCheckpointError(f"metadata lists no tensor {fqn!r}", shard=loc.file, tensor=fqn)
        chunk = _find_chunk(md, item.storage_index)
        if chunk is None:
            raise errors.CorruptCheckpointError(
                f"metadata of {fqn!r} has no chunk at offset {list(item.storage_index.offset or [])}",
                shard=loc.file, tensor=fqn)
        dtype = md.properties.dtype
        itemsize = dtype.itemsize
        sizes = list(chunk.sizes)
        if math.prod(sizes) * itemsize != loc.length:
            raise errors.CorruptCheckpointError(
                f"item {fqn!r} in {loc.file} has {loc.length} bytes; a {dtype} chunk of shape {sizes} has "
                f"{math.prod(sizes) * itemsize}", shard=loc.file, tensor=fqn)
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        if len(offsets) != len(sizes) or len(lengths) != len(sizes) or any(
            o + n > s for o, n, s in zip(offsets, lengths, sizes, strict=True)
        ):
            raise errors.CorruptCheckpointError(
                f"read of {fqn!r} (offsets {offsets}, lengths {lengths}) is outside its stored chunk {sizes}",
                shard=loc.file, tensor=fqn)
        target = planner.resolve_tensor(item).detach()
        if list(target.shape) != lengths:
            raise errors.InvalidRequestError(
                f"{fqn}: the planner's target has shape {list(target.shape)}, the read needs {lengths}")
        count = math.prod(lengths)
        strides = _c_strides(sizes)
        start = sum(o * st for o, st in zip(offsets, strides, strict=True))
        whole = lengths == sizes
        if count == 0:
            return _Job(item, loc, loc.offset, 0, None, target=target, whole=False)
        direct_ok = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        if _box_is_contiguous(sizes, offsets, lengths) and direct_ok:
            return _Job(item, loc, loc.offset + start * itemsize, count * itemsize, target, target=target,
                        whole=whole)
        end = sum((o + n - 1) * st for o, n, st in zip(offsets, lengths, strides, strict=True)) + 1
        tmp = torch.empty(end - start, dtype=dtype)
        box = tmp.as_strided(lengths, strides, 0) if lengths else tmp.reshape(())
        return _Job(item, loc, loc.offset + start * itemsize, (end - start) * itemsize, tmp, target=target,
                    box=box, whole=whole, temp_bytes=(end - start) * itemsize)

    def _run(self, fp: FilePath, of: OpenFile, name: str, batch: list[_Job], planner: LoadPlanner) -> None:
        ranges = [Range.read(j.file_offset, j.length, as_buffer(j.buffer), 0, of) for j in batch if j.length]
        got = fp.submit(ranges, data_class=DATA_CLASS).get() if ranges else []
        sized = iter(got)
        for job in batch:
            fqn = job.item.storage_index.fqn
            if job.length and next(sized) != job.length:
                raise errors.CorruptCheckpointError(
                    f"data file {name} of checkpoint {self.url!r} ended early while reading {fqn!r}",
                    shard=name, tensor=fqn)
            if job.target is None:  # a bytes item
                self._load_bytes(name, job, planner)
                continue
            if self.verify and job.whole and job.length:
                self._check(name, job, job.buffer)
            if job.box is not None:
                job.target.copy_(job.box)
            planner.commit_tensor(job.item, job.target)

    def _check(self, name: str, job: _Job, buffer: Any) -> None:
        view = as_buffer(buffer) if isinstance(buffer, torch.Tensor) else buffer
        if xxh3_64(view) != job.loc.xxh3_64:
            fqn = job.item.storage_index.fqn
            raise errors.CorruptCheckpointError(
                f"checksum mismatch in data file {name} of checkpoint {self.url!r}: item {fqn!r} "
                f"(bytes {job.loc.offset}..{job.loc.offset + job.loc.length}) is corrupt", shard=name, tensor=fqn)

    def _load_bytes(self, name: str, job: _Job, planner: LoadPlanner) -> None:
        fqn = job.item.storage_index.fqn
        if self.verify:
            self._check(name, job, job.buffer)
        try:
            value = torch.load(io.BytesIO(job.buffer), weights_only=True)
        except Exception as exc:
            raise errors.CorruptCheckpointError(
                f"non-tensor item {fqn!r} in data file {name} of checkpoint {self.url!r} cannot be loaded with "
                f"torch.load(weights_only=True) (refused, never unpickled unsafely): {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}", shard=name, tensor=fqn) from None
        clean = io.BytesIO()
        torch.save(value, clean)
        clean.seek(0)
        planner.load_bytes(job.item, clean)


def _find_chunk(md: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata | None:
    if index.offset is None:
        return md.chunks[0] if len(md.chunks) == 1 else None
    hint = index.index
    if hint is not None and 0 <= hint < len(md.chunks) and md.chunks[hint].offsets == index.offset:
        return md.chunks[hint]
    return next((c for c in md.chunks if c.offsets == index.offset), None)


def _c_strides(sizes: Sequence[int]) -> list[int]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides


def _box_is_contiguous(sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether the box ``offsets``/``lengths`` of a C-order array of ``sizes`` is one contiguous run."""
    dims = len(sizes)
    k = next((d for d in range(dims) if lengths[d] != 1), dims)
    return all(offsets[d] == 0 and lengths[d] == sizes[d] for d in range(k + 1, dims))
