"""Saving checkpoints: plan shards, copy and checksum tensor bytes once, write through the file path, commit.

Synchronous :func:`save` streams each shard through a ring of ``checkpoint_buffers`` registered buffers of
``checkpoint_buffer_size`` bytes: while one buffer is filled (tensor bytes copied in 2 MiB steps, each step
hashed while it is still in cache, into the tensor's and the shard's xxh3-64), the others are being written
with O_DIRECT (:meth:`FilePath.submit <sfstore.paths.file.FilePath.submit>`, which splits each into ``chunk_size``
requests in parallel). Its extra memory is the ring (192 MiB by default, less
for small shards), whatever the shard size; a shard whose tensor is bigger than ``max_shard_bytes`` is no
problem. Finished shards are fsynced on a helper thread while the next ones are written.

:func:`save_async` copies every tensor into one registered buffer per shard, laid out as the shard file, with a
few threads (``checkpoint_copy_threads``; torch's ``copy_`` releases the GIL), and returns; a background thread
checksums and writes those buffers and commits. Extra memory: the state dict's tensor bytes.

With ``checkpoint_reuse_buffers`` (the default) both keep their buffers for the next save of their kind
(allocating, faulting in and pinning hundreds of MiB costs more than filling them): between saves the process
holds the ring, and a copy of the last ``save_async``'s tensor bytes.

Both write into a staging directory, fsync every shard, then the manifest, then the staging directory, and
publish it (see :mod:`sfstore.checkpoint.location`). A flat state dict's shards take Hugging Face's names, and when
there are several its ``model.safetensors.index.json`` is written before the manifest
(:mod:`sfstore.checkpoint.hf`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from sfstore import defaults, errors, forks
from sfstore._optional import require
from sfstore.arguments import check_timeout
from sfstore.checkpoint import hf, location
from sfstore.checkpoint import safetensors_format as stf
from sfstore.checkpoint.catalog import CheckpointInfo, info_for
from sfstore.checkpoint.host_buffers import HostBuffer, check_written, round_size, write_small
from sfstore.checkpoint.location import DATA_CLASS
from sfstore.checkpoint.manifest import MANIFEST_NAME, Manifest, ShardRecord, TensorRecord
from sfstore.checkpoint.structure import Leaf, check_metadata, flatten, format_path
from sfstore.checksums import xxh3_64_hex
from sfstore.futures import Future as SfFuture
from sfstore.paths.base import PathFuture, Range
from sfstore.paths.file import FilePath

if TYPE_CHECKING:
    import torch

__all__ = ["save", "save_async", "SaveFuture"]

HASH_STEP = 2 << 20
"""Bytes copied and hashed per step (small enough to stay in cache between the copy and the hash)."""
COPY_TASK = 16 << 20
"""Bytes per task of the parallel copy of :func:`save_async`."""
SHARD_METADATA = {"format": "pt"}


# -- planning -------------------------------------------------------------------------------------------------


@dataclass
class _Item:
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    tensor: Any  # torch.Tensor, detached
    itemsize: int
    nbytes: int
    st_dtype: str
    st_shape: list[int]
    offset: int = 0  # in the shard file
    xxh3: str = ""


@dataclass
class _Shard:
    file: str
    items: list[_Item]
    header: bytes = b""
    size: int = 0
    xxh3: str = ""


@dataclass
class _Plan:
    structure: Any
    items: list[_Item]
    shards: list[_Shard]
    metadata: dict[str, Any]
    hf: bool = False
    """Hugging Face names and index (:func:`~sfstore.checkpoint.hf.hf_layout`)."""

    @property
    def largest_shard(self) -> int:
        return max((s.size for s in self.shards), default=0)


def _item(leaf: Leaf) -> _Item:
    import torch

    t = leaf.value.detach()
    where = format_path(leaf.path)
    if t.layout != torch.strided:
        raise errors.InvalidRequestError(f"cannot save the {t.layout} tensor at {where}: only dense tensors")
    if t.is_quantized:
        raise errors.InvalidRequestError(f"cannot save the quantized tensor at {where}: dequantize it first")
    if t.device.type == "meta":
        raise errors.InvalidRequestError(f"cannot save the meta tensor at {where}: it has no data")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    itemsize = t.element_size()
    shape = tuple(int(s) for s in t.shape)
    nbytes = t.numel() * itemsize
    st_dtype, st_shape = stf.stored_form(leaf.dtype, shape, itemsize)
    if stf.entry_nbytes(st_dtype, st_shape) != nbytes:  # pragma: no cover - a dtype this table misjudges
        raise errors.InvalidRequestError(f"cannot save the {t.dtype} tensor at {where}: unknown storage size")
    return _Item(leaf.name, leaf.kind, leaf.dtype, shape, t, itemsize, nbytes, st_dtype, st_shape)


def plan(state_dict: Any, max_shard_bytes: int | None, metadata: Mapping[str, Any] | None) -> _Plan:
    """Flatten ``state_dict`` and group its tensors into shards of at most ``max_shard_bytes`` data bytes."""
    require("torch", "torch", "sfstore.checkpoint.save")
    limit = int(
        defaults.SETTINGS["checkpoint_shard_bytes"].parse(max_shard_bytes, "save(max_shard_bytes=...)")
        if max_shard_bytes is not None
        else defaults.get("checkpoint_shard_bytes")
    )
    meta = check_metadata(metadata)
    structure, leaves = flatten(state_dict)
    try:  # refuse what the manifest cannot hold now, not after every byte was written
        json.dumps({"metadata": meta, "structure": structure}, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise errors.InvalidRequestError(f"the state dict or metadata cannot be stored as JSON: {exc}") from None
    items = [_item(leaf) for leaf in leaves]
    groups: list[list[_Item]] = []
    current: list[_Item] = []
    size = 0
    for it in items:
        if current and size + it.nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append(it)
        size += it.nbytes
    if current:
        groups.append(current)
    hf_names = hf.hf_layout(state_dict, leaves)
    names = hf.shard_names(len(groups)) if hf_names else [f"shard-{i:05d}.safetensors" for i in range(len(groups))]
    shards = []
    for name, group in zip(names, groups, strict=True):
        # Largest alignment first: with the data on a page boundary, every tensor is aligned to its element.
        ordered = sorted(group, key=lambda it: -it.itemsize)
        header, offsets = stf.build_header(
            [(it.name, it.st_dtype, it.st_shape, it.nbytes) for it in ordered], SHARD_METADATA
        )
        for it, (begin, _end) in zip(ordered, offsets, strict=True):
            it.offset = len(header) + begin
        data = offsets[-1][1] if offsets else 0
        shards.append(_Shard(name, ordered, header, len(header) + data))
    return _Plan(structure, items, shards, meta, hf_names)


def _as_plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as the integer dtype of its element size (same bytes, same strides), so that
    copies work for every dtype (torch has no copy kernels for e.g. ``uint4`` or ``bits16``)."""
    import torch

    plain = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    return t if plain is None or t.dtype == plain else t.view(plain)


def _flat_bytes(item: _Item) -> torch.Tensor:
    """The item's bytes as a flat ``uint8`` tensor (on its device); a contiguous copy if it is strided."""
    import torch

    t = item.tensor
    try:
        if not t.is_contiguous():
            t = _as_plain(t).contiguous()
        flat: torch.Tensor = t.reshape(-1).view(torch.uint8)
    except (RuntimeError, NotImplementedError) as exc:
        raise errors.InvalidRequestError(
            f"cannot read the bytes of the {t.dtype} tensor {item.name!r}: {exc}"
        ) from None
    return flat


# -- filling shard bytes --------------------------------------------------------------------------------------


class _Cursor:
    """Walks one shard file's bytes in order (header, then tensors), copying and/or hashing them."""

    def __init__(self, shard: _Shard, copy: bool) -> None:
        self.shard, self.copy = shard, copy
        self.seg = 0  # 0: header, i > 0: shard.items[i - 1]
        self.off = 0
        self.shard_hash = xxhash.xxh3_64()
        self.item_hash: xxhash.xxh3_64 | None = None
        self.src: Any = None

    def _seg_len(self) -> int:
        return len(self.shard.header) if self.seg == 0 else self.shard.items[self.seg - 1].nbytes

    def _advance(self) -> None:
        while self.seg <= len(self.shard.items) and self.off >= self._seg_len():
            if self.seg > 0:
                item = self.shard.items[self.seg - 1]
                item.xxh3 = (self.item_hash or xxhash.xxh3_64()).hexdigest()
                self.item_hash, self.src = None, None
            self.seg += 1
            self.off = 0

    def run(self, dst: torch.Tensor, mv: memoryview, start: int, n: int) -> None:
        """Handle the next ``n`` bytes of the shard, which go (or are) at ``start`` of the buffer."""
        pos = 0
        self._advance()
        while pos < n:
            if self.seg > len(self.shard.items):
                raise AssertionError("cursor ran past the end of the shard")
            take = min(n - pos, self._seg_len() - self.off)
            at = start + pos
            if self.seg == 0:
                head = self.shard.header[self.off : self.off + take]
                mv[at : at + take] = head
                self.shard_hash.update(head)
            else:
                if self.item_hash is None:
                    self.item_hash = xxhash.xxh3_64()
                    if self.copy:
                        self.src = _flat_bytes(self.shard.items[self.seg - 1])
                for sub in range(0, take, HASH_STEP):
                    k = min(HASH_STEP, take - sub)
                    if self.copy:
                        a = self.off + sub
                        dst[at + sub : at + sub + k].copy_(self.src[a : a + k])
                    piece = mv[at + sub : at + sub + k]
                    self.item_hash.update(piece)
                    self.shard_hash.update(piece)
                    piece.release()
            pos += take
            self.off += take
            self._advance()

    def close(self) -> None:
        self._advance()
        if self.seg <= len(self.shard.items):
            raise AssertionError("cursor closed before the end of the shard")
        self.shard.xxh3 = self.shard_hash.hexdigest()


# -- the save job ---------------------------------------------------------------------------------------------


@dataclass
class _OpenShard:
    shard: _Shard
    fd: int
    path: str
    outstanding: int = 0
    submitted: bool = False
    closed: bool = False


@dataclass
class _Job:
    loc: location.Location
    plan: _Plan
    overwrite: bool
    staging: str = ""  # the staging directory's name in the parent (full name: staging_full)
    parent_fd: int = -1  # the parent directory, opened beneath the root: staging, publish, removal act in it
    staging_fd: int = -1  # the staging directory: shards and the manifest are created in it
    fds: dict[int, _OpenShard] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def fp(self) -> FilePath:
        return self.loc.fp

    @property
    def staging_full(self) -> str:
        return os.path.join(self.loc.parent, self.staging)

    def start(self) -> None:
        self.parent_fd = self.loc.open_parent()
        try:
            location.cleanup(self.parent_fd, fp=self.fp, full=self.loc.parent)
            if not self.overwrite and location.exists_at(self.parent_fd, self.loc.name):
                raise location.exists_error(self.loc)
            self.staging = location.staging_name(self.loc)
            try:
                os.mkdir(self.staging, 0o755, dir_fd=self.parent_fd)
                self.staging_fd = os.open(
                    self.staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.parent_fd
                )
            except OSError as exc:
                raise errors.os_error(exc.errno or 5, "cannot create the checkpoint", self.loc.path) from None
        except BaseException:
            self.abort()
            raise

    def open_shard(self, shard: _Shard) -> _OpenShard:
        path = os.path.join(self.loc.path, shard.file)  # messages name the file as it will be, not the staging name
        fd = self.fp.create_at(self.staging_fd, shard.file, path, size=shard.size)
        sh = _OpenShard(shard, fd, path)
        with self.lock:
            self.fds[fd] = sh
        return sh

    def fsync_close(self, sh: _OpenShard) -> None:
        try:
            os.fsync(sh.fd)
        except OSError as exc:
            raise errors.os_error(exc.errno or 5, "cannot fsync", sh.path) from None
        finally:
            with self.lock:
                if not sh.closed:
                    sh.closed = True
                    self.fds.pop(sh.fd, None)
                    os.close(sh.fd)
        self.fp.file_done(data_class=DATA_CLASS)

    def commit(self) -> CheckpointInfo:
        plan = self.plan
        manifest = Manifest(
            created_ns=time.time_ns(),
            metadata=plan.metadata,
            structure=plan.structure,
            tensors={
                it.name: TensorRecord(it.name, sh.file, it.kind, it.dtype, it.shape, it.nbytes, it.xxh3)
                for sh in plan.shards
                for it in sh.items
            },
            shards=[ShardRecord(sh.file, sh.size, sh.xxh3, xxh3_64_hex(sh.header))
                    for sh in plan.shards],
        )
        # Tensors in the order the state dict holds them (shards order them by alignment).
        manifest.tensors = {it.name: manifest.tensors[it.name] for it in plan.items}
        data = manifest.to_json()
        if plan.hf and len(plan.shards) > 1:
            # save_pretrained writes no index for one shard: from_pretrained looks for model.safetensors first.
            index = hf.index_json({it.name: sh.file for sh in plan.shards for it in sh.items},
                                  sum(it.nbytes for it in plan.items))
            write_small(self.fp, os.path.join(self.loc.path, hf.INDEX_NAME), index, dirfd=self.staging_fd)
        write_small(self.fp, os.path.join(self.loc.path, MANIFEST_NAME), data, dirfd=self.staging_fd)
        try:
            os.fsync(self.staging_fd)
        except OSError as exc:
            raise errors.os_error(exc.errno or 5, "cannot write the checkpoint", self.loc.path) from None
        location.publish(self.staging, self.loc, overwrite=self.overwrite, dirfd=self.parent_fd)
        self.staging = ""
        return info_for(self.loc.url, self.loc.path, self.loc.name, manifest)

    def abort(self) -> None:
        with self.lock:
            open_shards = list(self.fds.values())
            self.fds.clear()
        for sh in open_shards:
            if not sh.closed:
                sh.closed = True
                os.close(sh.fd)
        if self.staging_fd >= 0:
            os.close(self.staging_fd)
            self.staging_fd = -1
        if self.staging and self.parent_fd >= 0:
            location.rmtree_at(self.fp, self.parent_fd, self.staging, self.staging_full)
            self.staging = ""
        if self.parent_fd >= 0:
            os.close(self.parent_fd)
            self.parent_fd = -1


def _locate(url: str | os.PathLike[str] | CheckpointInfo) -> location.Location:
    if isinstance(url, CheckpointInfo):
        url = url.url
    return location.locate(url, create=True)


class _Ring:
    """``count`` registered buffers of ``size`` bytes, reused in turn; each remembers its pending write."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, count
        self.buffers: list[HostBuffer] = []
        self.slots: list[tuple[torch.Tensor, memoryview]] = []
        self.pending: deque[tuple[int, PathFuture, int, _OpenShard]] = deque()
        self.next = 0

    def take(self) -> tuple[int, torch.Tensor, memoryview, Any]:
        i = self.next
        self.next = (i + 1) % self.count
        if i == len(self.slots):
            hb = ring_buffers.take(self.size)
            self.buffers.append(hb)
            self.slots.append((hb.tensor(), memoryview(hb.buf).cast("B")))
        t, mv = self.slots[i]
        return i, t, mv, self.buffers[i].buf

    def close(self, ok: bool) -> None:
        for slot in self.slots:
            slot[1].release()
        self.slots = []
        ring_buffers.give_back(self.buffers, ok=ok and not self.pending)
        self.buffers = []


def _write_sync(job: _Job) -> None:
    fp = job.fp
    plan = job.plan
    # Whole pages per piece, so that every piece but a shard's last starts and ends on an O_DIRECT boundary.
    size = min(int(defaults.get("checkpoint_buffer_size")) // 4096 * 4096, plan.largest_shard)
    count = int(defaults.get("checkpoint_buffers"))
    ring = _Ring(max(size, 1), count)
    syncer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sfstore-ckpt-fsync")
    syncs: list[Future[None]] = []
    ok = False

    def complete(entry: tuple[int, PathFuture, int, _OpenShard]) -> None:
        _slot, fut, n, sh = entry
        check_written(fut.get()[0], n, sh.path, fp)
        sh.outstanding -= 1
        if sh.submitted and sh.outstanding == 0:
            syncs.append(syncer.submit(job.fsync_close, sh))

    try:
        for shard in plan.shards:
            sh = job.open_shard(shard)
            cursor = _Cursor(shard, copy=True)
            for off in range(0, shard.size, ring.size):
                n = min(ring.size, shard.size - off)
                slot, t, mv, buf = ring.take()
                while any(p[0] == slot for p in ring.pending):
                    complete(ring.pending.popleft())
                cursor.run(t, mv, 0, n)
                fut = fp.submit([Range.write(off, n, buf, 0, sh.fd)], data_class=DATA_CLASS)
                sh.outstanding += 1
                ring.pending.append((slot, fut, n, sh))
            cursor.close()
            sh.submitted = True
            if sh.outstanding == 0:
                syncs.append(syncer.submit(job.fsync_close, sh))
        while ring.pending:
            complete(ring.pending.popleft())
        for f in syncs:
            f.result()
        ok = True
    except BaseException:
        for _slot, fut, _n, _sh in ring.pending:
            fut.wait()
        ring.pending.clear()
        raise
    finally:
        syncer.shutdown(wait=True)
        ring.close(ok)


def save(
    state_dict: Any,
    url: str | os.PathLike[str] | CheckpointInfo,
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Save ``state_dict`` as a checkpoint at ``url``, atomically; see :func:`sfstore.checkpoint.save`."""
    loc = _locate(url)
    job = _Job(loc, plan(state_dict, max_shard_bytes, metadata), overwrite)
    job.start()
    try:
        _write_sync(job)
        return job.commit()
    finally:
        job.abort()


# -- asynchronous saves ---------------------------------------------------------------------------------------


class SaveFuture(SfFuture[CheckpointInfo]):
    """The pending result of :func:`save_async` (an :class:`sfstore.futures.Future`): :meth:`get` returns the
    :class:`CheckpointInfo` or raises."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._done = threading.Event()
        self._result: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _set(self, result: CheckpointInfo | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: until done); return whether it finished."""
        return self._done.wait(check_timeout(timeout, "wait"))

    def get(self, timeout: float | None = None) -> CheckpointInfo:
        """The committed checkpoint's :class:`CheckpointInfo`; raises the save's error.

        Raises :class:`~sfstore.errors.IOTimeoutError` when not finished within ``timeout`` seconds (the save
        goes on).
        """
        if not self._done.wait(check_timeout(timeout, "get")):
            raise errors.IOTimeoutError(f"checkpoint save to {self.url} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"<SaveFuture {self.url} {state}>"


def _copy_tasks(shard: _Shard, dst: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) copies that fill ``dst`` with the shard's tensor bytes."""
    tasks: list[tuple[torch.Tensor, torch.Tensor]] = []
    for it in shard.items:
        if it.nbytes == 0:
            continue
        region = dst[it.offset : it.offset + it.nbytes]
        t = it.tensor
        if not t.is_contiguous():
            src_plain = _as_plain(t)
            try:
                typed = region.view(src_plain.dtype).view(t.shape)
            except RuntimeError:
                typed = None
            if typed is not None:
                tasks.append((typed, src_plain))
                continue
        src = _flat_bytes(it)
        if src.device.type != "cpu":
            tasks.append((region, src))
            continue
        for a in range(0, it.nbytes, COPY_TASK):
            b = min(it.nbytes, a + COPY_TASK)
            tasks.append((region[a:b], src[a:b]))
    return tasks


def _copy(task: tuple[torch.Tensor, torch.Tensor]) -> None:
    task[0].copy_(task[1])


class _IdleBuffers:
    """Host buffers kept between saves (``checkpoint_reuse_buffers``): allocating and pinning them again costs
    more than filling them. Holds the buffers of the most recent save of its kind only."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[HostBuffer] = []
        forks.after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        # The parent's buffers are not the child's to hand out.
        self.lock = threading.Lock()
        self.idle = []

    def take(self, nbytes: int) -> HostBuffer:
        """An idle buffer of the same rounded size as ``nbytes`` if there is one, else a new one."""
        want = round_size(nbytes)
        with self.lock:
            for i, hb in enumerate(self.idle):
                if hb.capacity == want:
                    del self.idle[i]
                    hb.nbytes = nbytes
                    return hb
        return HostBuffer(nbytes)

    def give_back(self, buffers: list[HostBuffer], ok: bool) -> None:
        """Keep ``buffers`` for the next save (freeing older idle ones), or free them (``ok=False`` or
        reuse turned off)."""
        keep = ok and bool(defaults.get("checkpoint_reuse_buffers"))
        with self.lock:
            old, self.idle = self.idle, []
            if keep:
                self.idle = list(buffers)
        for hb in old + ([] if keep else buffers):
            hb.release()

    def idle_bytes(self) -> int:
        """Bytes of the buffers kept for the next save."""
        with self.lock:
            return sum(hb.capacity for hb in self.idle)

    def free(self) -> int:
        """Free the kept buffers now; returns their bytes."""
        with self.lock:
            old, self.idle = self.idle, []
        for hb in old:
            hb.release()
        return sum(hb.capacity for hb in old)


# Registered host buffers kept between saves (``checkpoint_reuse_buffers``): ``save``'s ring and ``save_async``'s
# copy of the tensor bytes; sfstore.checkpoint.buffer_stats / free_buffers report and free them.
ring_buffers = _IdleBuffers()
async_buffers = _IdleBuffers()


def _stage(plan: _Plan) -> list[HostBuffer]:
    """Copy every tensor into per-shard registered buffers laid out as the shard files (parallel copies)."""
    buffers: list[HostBuffer] = []
    try:
        tasks: list[tuple[torch.Tensor, torch.Tensor]] = []
        views = []
        for shard in plan.shards:
            hb = async_buffers.take(shard.size)
            buffers.append(hb)
            t = hb.tensor()
            views.append(t)
            tasks.extend(_copy_tasks(shard, t))
        threads = min(int(defaults.get("checkpoint_copy_threads")), len(tasks))
        total = sum(it.nbytes for it in plan.items)
        if threads <= 1 or total < (8 << 20):
            for task in tasks:
                _copy(task)
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sfstore-ckpt-copy") as pool:
                for _ in pool.map(_copy, tasks):
                    pass
        del tasks, views
    except BaseException:
        for hb in buffers:
            hb.release()
        raise
    for it in plan.items:
        it.tensor = None  # the job must not keep the caller's tensors alive
    return buffers


def _write_staged(job: _Job, buffers: list[HostBuffer]) -> None:
    fp = job.fp
    pending: deque[tuple[PathFuture, _OpenShard, int]] = deque()

    def complete() -> None:
        fut, sh, _i = pending.popleft()
        check_written(fut.get()[0], sh.shard.size, sh.path, fp)
        job.fsync_close(sh)

    try:
        for i, (shard, hb) in enumerate(zip(job.plan.shards, buffers, strict=True)):
            t = hb.tensor()
            mv = memoryview(hb.buf).cast("B")
            try:
                cursor = _Cursor(shard, copy=False)
                cursor.run(t, mv, 0, shard.size)
                cursor.close()
            finally:
                mv.release()
                del t
            sh = job.open_shard(shard)
            fut = fp.submit([Range.write(0, shard.size, hb.buf, 0, sh.fd)], data_class=DATA_CLASS)
            pending.append((fut, sh, i))
            while pending and pending[0][0].done():
                complete()
        while pending:
            complete()
    except BaseException:
        for fut, _sh, _i in pending:
            fut.wait()
        raise


def prepare_async(state_dict: Any, max_shard_bytes: int | None = None) -> int:
    """Allocate (and pin) the buffers a :func:`save_async` of ``state_dict`` copies into, and keep them for it;
    see :func:`sfstore.checkpoint.prepare_async`."""
    if not defaults.get("checkpoint_reuse_buffers"):
        return 0
    the_plan = plan(state_dict, max_shard_bytes, None)
    buffers: list[HostBuffer] = []
    try:
        for shard in the_plan.shards:
            buffers.append(async_buffers.take(shard.size))
    except BaseException:
        for hb in buffers:
            hb.release()
        raise
    async_buffers.give_back(buffers, ok=True)
    return sum(hb.capacity for hb in buffers)


def save_async(
    state_dict: Any,
    url: str | os.PathLike[str] | CheckpointInfo,
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> SaveFuture:
    """Copy ``state_dict`` to host buffers, return, and save in the background; see
    :func:`sfstore.checkpoint.save_async`."""
    loc = _locate(url)
    the_plan = plan(state_dict, max_shard_bytes, metadata)
    job = _Job(loc, the_plan, overwrite)
    job.start()
    try:
        buffers = _stage(the_plan)
    except BaseException:
        job.abort()
        raise
    future = SaveFuture(loc.url)

    def run() -> None:
        try:
            _write_staged(job, buffers)
            result = job.commit()
        except BaseException as exc:
            async_buffers.give_back(buffers, ok=False)
            job.abort()
            future._set(None, exc)
        else:
            async_buffers.give_back(buffers, ok=True)
            job.abort()
            future._set(result, None)

    thread = threading.Thread(target=run, name=f"sfstore-ckpt-save {loc.name}", daemon=False)
    future.thread = thread
    thread.start()
    return future
