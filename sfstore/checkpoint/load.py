"""Loading checkpoints: read shards whole into registered buffers, check them, hand back views.

Each shard is read as one range through :meth:`FilePath.submit <sfstore.paths.file.FilePath.submit>` (O_DIRECT,
split by the path into ``chunk_size`` requests in parallel, a few shards ahead; counted under the ``checkpoint``
data class) into a page-aligned registered buffer of the shard's size; its safetensors header is validated and
matched against the manifest; with ``verify`` every tensor's and the header's xxh3-64 is checked in one pass;
and the tensors returned are views of that buffer (``torch.from_dlpack`` sliced and viewed as the dtype), so
the memory is the shard's and nothing is copied. The buffer lives as long as any of its tensors, then goes
back to :data:`~sfstore.checkpoint.host_buffers.load_buffers` for the next load (``checkpoint_reuse_buffers``).

``into=``: each shard's header is read and checked, then every tensor's bytes are read straight into the
existing tensor's memory (one batch of ranges per shard); tensors that are not CPU-contiguous (GPU
tensors, strided views) go through a registered bounce buffer. ``device="cuda..."``: each shard's views are
copied to the GPU from the pinned buffer, and the buffer is dropped before the next shards are read.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from sfstore import errors
from sfstore._optional import require
from sfstore.buffers import as_buffer
from sfstore.checkpoint import hf, location
from sfstore.checkpoint import safetensors_format as stf
from sfstore.checkpoint.catalog import CheckpointInfo, read_manifest
from sfstore.checkpoint.host_buffers import HostBuffer, load_buffers
from sfstore.checkpoint.location import DATA_CLASS
from sfstore.checkpoint.manifest import MANIFEST_NAME, Manifest, ShardRecord, TensorRecord
from sfstore.checkpoint.structure import KeyPath, format_path, tensor_paths, unflatten
from sfstore.checksums import xxh3_64_hex
from sfstore.paths.base import PathFuture, Range
from sfstore.paths.file import FilePath, OpenFile

if TYPE_CHECKING:
    import torch

__all__ = ["load"]

HASH_STEP = 8 << 20
READ_AHEAD = 4
"""Shards read ahead of the one being checked."""


def _corrupt(message: str, shard: str | None = None, tensor: str | None = None) -> errors.CorruptCheckpointError:
    return errors.CorruptCheckpointError(message, shard=shard, tensor=tensor)


def _itemsize(rec: TensorRecord) -> int:
    try:
        return int(stf.torch_dtype(rec.dtype).itemsize)
    except errors.InvalidRequestError as exc:
        raise _corrupt(f"tensor {rec.name!r}: {exc}", rec.shard, rec.name) from None


def _check_header(header: stf.Header, shard: ShardRecord, records: list[TensorRecord], exact: bool = True) -> None:
    """The header describes exactly the manifest's tensors of this shard, as the manifest says (``exact=False``,
    another tool's files: it holds at least those, as their header said when the manifest was made of it)."""
    names = {r.name for r in records}
    missing = sorted(names - set(header.entries))
    extra = sorted(set(header.entries) - names) if exact else []
    if missing or extra:
        raise _corrupt(
            f"shard {shard.file} does not match the manifest: tensors missing from the shard {missing[:5]}, "
            f"not in the manifest {extra[:5]}",
            shard.file,
            (missing or extra)[0],
        )
    for rec in records:
        entry = header.entries[rec.name]
        want = stf.stored_form(rec.dtype, rec.shape, _itemsize(rec))
        if (entry.dtype, list(entry.shape)) != (want[0], want[1]) or entry.nbytes != rec.nbytes:
            raise _corrupt(
                f"shard {shard.file}: tensor {rec.name!r} is {entry.dtype}{list(entry.shape)} ({entry.nbytes} bytes) "
                f"but the manifest says {rec.dtype}{list(rec.shape)} ({rec.nbytes} bytes)",
                shard.file,
                rec.name,
            )


def _header_mismatch(shard: ShardRecord) -> errors.CorruptCheckpointError:
    return _corrupt(f"checksum mismatch in shard {shard.file} (its header bytes differ)", shard.file)


def _verify(view: Any, header: stf.Header, shard: ShardRecord, records: dict[str, TensorRecord]) -> None:
    """Check every tensor's xxh3-64 and the header's over ``view`` (the shard's bytes): the header (validated to
    be followed by tensors that cover the rest of the file exactly) and the tensors are every byte of the shard,
    each read once. A version 1 manifest has no header sum: the whole shard's is checked instead (a second pass).
    One C call per tensor: no Python loop over the bytes."""
    with memoryview(view) as raw, raw.cast("B") as mv:
        for entry in header.entries.values():
            with mv[header.data_start + entry.begin : header.data_start + entry.end] as piece:
                ok = xxh3_64_hex(piece) == records[entry.name].xxh3_64
            if not ok:
                raise _corrupt(f"checksum mismatch in tensor {entry.name!r} of shard {shard.file}", shard.file,
                               entry.name)
        if shard.header_xxh3_64 is not None:
            with mv[: header.data_start] as head:
                ok = xxh3_64_hex(head) == shard.header_xxh3_64
        else:
            with mv[: shard.size] as whole:  # the buffer may be longer than the shard
                ok = xxh3_64_hex(whole) == shard.xxh3_64
        if not ok:
            raise _header_mismatch(shard)


def _view(base: torch.Tensor, offset: int, nbytes: int, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``base[offset:offset + nbytes]`` as a tensor of ``dtype_name``/``shape`` (a copy only if misaligned)."""
    dtype = stf.torch_dtype(dtype_name)
    piece = base[offset : offset + nbytes]
    if offset % dtype.itemsize:
        piece = piece.clone()  # a foreign file with a misaligned tensor: torch cannot view it in place
    return piece.view(dtype).reshape(shape)


def _open_shard(loc_dir: str, fp: FilePath, shard: ShardRecord, follow: bool = False) -> OpenFile:
    """The shard file, opened once beneath the root (every read of it goes to that descriptor), checked to be
    a regular file of the recorded size. A symlink in its place is refused: shards are files of the directory.
    ``follow``: another tool's files, whose links are followed where they stay beneath the root (the Hugging
    Face hub's cache links a snapshot's files to its blobs)."""
    path = os.path.join(loc_dir, shard.file)
    try:
        of = fp.open_file(path, follow=follow)  # refuses a symlink (ELOOP) and checks the kind on the descriptor
    except errors.PathNotFoundError:
        raise _corrupt(f"shard {shard.file} is missing", shard.file) from None
    except (errors.NotARegularFileError, errors.IsADirectoryPathError) as exc:
        raise _corrupt(f"shard {shard.file} is not a regular file ({exc})", shard.file) from None
    except errors.SfstoreOSError as exc:
        if exc.errno == errno.ELOOP:
            raise _corrupt(f"shard {shard.file} links out of the checkpoint directory (a symlink)",
                           shard.file) from None
        raise
    size = of.size
    if size != shard.size:
        of.close()
        what = "truncated" if size < shard.size else "longer than recorded"
        raise _corrupt(f"shard {shard.file} is {what}: {size} bytes, the manifest says {shard.size} (or it changed "
                       f"while being loaded)", shard.file)
    return of


class _ShardReader:
    """Reads shards whole into registered buffers, ``READ_AHEAD`` at a time, in order."""

    def __init__(self, fp: FilePath, directory: str, shards: list[ShardRecord], ahead: int, follow: bool) -> None:
        self.fp, self.directory, self.shards, self.ahead = fp, directory, shards, max(1, ahead)
        self.follow = follow
        self.queue: deque[tuple[ShardRecord, OpenFile, HostBuffer, PathFuture]] = deque()
        self.next = 0

    def _fill(self) -> None:
        while self.next < len(self.shards) and len(self.queue) < self.ahead:
            shard = self.shards[self.next]
            self.next += 1
            of = _open_shard(self.directory, self.fp, shard, self.follow)
            try:
                hb = load_buffers.take(shard.size)
                fut = self.fp.submit([Range.read(0, shard.size, hb.buf, 0, of)], data_class=DATA_CLASS)
            except BaseException:
                of.close()
                raise
            self.queue.append((shard, of, hb, fut))

    def __iter__(self) -> _ShardReader:
        return self

    def __next__(self) -> tuple[ShardRecord, HostBuffer]:
        self._fill()
        if not self.queue:
            raise StopIteration
        shard, of, hb, fut = self.queue.popleft()
        try:
            got = fut.get()[0]
        finally:
            of.close()
        self.fp.file_done(data_class=DATA_CLASS)
        self._fill()
        if got != shard.size:
            raise _corrupt(f"shard {shard.file} is truncated: read {got} of {shard.size} bytes", shard.file)
        return shard, hb

    def close(self) -> None:
        for _shard, of, _hb, fut in self.queue:
            try:
                fut.wait()
            finally:
                of.close()
        self.queue.clear()


def _to_device(value: Any, device: torch.device) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    return value  # numpy arrays stay on the host


def _load_checkpoint(
    fp: FilePath, directory: str, manifest: Manifest, device: torch.device, verify: bool, foreign: bool = False
) -> dict[str, Any]:
    """Every tensor of the checkpoint, by name (views of the shard buffers on the CPU). ``foreign``: a manifest
    made of another tool's files (:mod:`~sfstore.checkpoint.hf`): no sums, links followed beneath the root,
    tensors the manifest does not name left out."""
    import torch

    by_shard = manifest.by_shard()
    out: dict[str, Any] = {}
    on_cpu = device.type == "cpu"
    reader = _ShardReader(fp, directory, manifest.shards, READ_AHEAD if on_cpu else 2, follow=foreign)
    try:
        for shard, hb in reader:
            records = by_shard[shard.file]
            with memoryview(hb.buf) as raw:
                header = stf.parse_header(raw, shard.size, shard=shard.file)
            _check_header(header, shard, records, exact=not foreign)
            if verify and not foreign:
                _verify(hb.buf, header, shard, {r.name: r for r in records})
            base = hb.tensor()
            for rec in records:
                entry = header.entries[rec.name]
                t = _view(base, header.data_start + entry.begin, rec.nbytes, rec.dtype, rec.shape)
                out[rec.name] = t.numpy() if rec.kind == "numpy" else t if on_cpu else _to_device(t, device)
            del base
            if not on_cpu and device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        reader.close()
    return out


def _navigate(root: Any, path: KeyPath) -> Any:
    node = root
    for key in path:
        if isinstance(node, Mapping):
            if key not in node:
                raise KeyError(key)
            node = node[key]
        elif isinstance(node, (list, tuple)) and isinstance(key, int):
            node = node[key]
        else:
            raise KeyError(key)
    return node


def _leaf_paths(root: Any) -> set[KeyPath]:
    """Key paths of the tensors and arrays inside ``root``."""
    import torch

    try:
        import numpy as np

        arrays: tuple[type, ...] = (torch.Tensor, np.ndarray)
    except ImportError:  # pragma: no cover
        arrays = (torch.Tensor,)
    out: set[KeyPath] = set()
    stack: list[tuple[Any, KeyPath]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, arrays):
            out.add(path)
        elif isinstance(node, Mapping):
            stack.extend((v, (*path, k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, (*path, i)) for i, v in enumerate(node))
    return out


def _same_memory(a: Any, b: Any) -> bool:
    import torch

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


def _targets(manifest: Manifest, into: Any, unfilled: str = "refuse") -> dict[KeyPath, Any]:
    """For ``into=``: the existing tensor at each tensor node's key path, checked against the manifest.

    ``unfilled``: what of destinations the checkpoint has no tensor for: ``"refuse"`` (an error naming them),
    ``"tied"`` (allowed where they are the memory of a filled one: tied weights, which ``save_pretrained``
    stores once) or ``"keep"`` (left as they are: a file holds part of a model)."""
    import numpy as np
    import torch

    root = into.state_dict() if isinstance(into, torch.nn.Module) else into
    found: dict[KeyPath, Any] = {}
    for path, tag, name in tensor_paths(manifest.structure):
        if tag == "npscalar":
            continue  # numpy scalars are immutable: they are loaded, not filled in
        rec = manifest.tensors[name]
        where = format_path(path)
        try:
            target = _navigate(root, path)
        except (KeyError, IndexError, TypeError):
            raise errors.InvalidRequestError(
                f"load(into=...): nothing at {where} to load tensor {name!r} into"
            ) from None
        if rec.kind == "torch":
            if not isinstance(target, torch.Tensor):
                raise errors.InvalidRequestError(
                    f"load(into=...): {where} is a {type(target).__name__}, not a torch tensor"
                )
            got_dtype, got_shape = stf.torch_dtype_name(target.dtype), tuple(target.shape)
        else:
            if not isinstance(target, np.ndarray) or not target.flags.writeable:
                raise errors.InvalidRequestError(f"load(into=...): {where} is not a writable numpy array")
            got_dtype, got_shape = target.dtype.name if target.dtype.isnative else "", tuple(target.shape)
        if (got_dtype, got_shape) != (rec.dtype, rec.shape):
            raise errors.InvalidRequestError(
                f"load(into=...): {where} is {got_dtype}{list(got_shape)}, the checkpoint holds "
                f"{rec.dtype}{list(rec.shape)}"
            )
        found[path] = target
    extra = _leaf_paths(root) - set(found) if unfilled != "keep" else set()
    if extra and unfilled == "tied":
        filled = list(found.values())
        extra = {p for p in extra if not any(_same_memory(_navigate(root, p), t) for t in filled)}
    if extra:
        names = sorted(format_path(p) for p in extra)
        raise errors.InvalidRequestError(
            f"load(into=...): the checkpoint has no tensors for {', '.join(names[:8])}"
            + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        )
    return found


def _byte_view(target: Any) -> Any:
    """A writable buffer over a CPU-contiguous tensor's/array's bytes, or ``None`` (GPU or strided)."""
    import numpy as np
    import torch

    if isinstance(target, np.ndarray):
        return target.reshape(-1).view(np.uint8) if target.flags.c_contiguous else None
    if target.device.type != "cpu" or not target.is_contiguous():
        return None
    return target.detach().reshape(-1).view(torch.uint8).numpy()


def _read(fp: FilePath, of: OpenFile, length: int) -> bytes:
    """The first ``length`` bytes of ``of`` (fewer at the end of the file)."""
    data = bytearray(length)
    got = fp.submit([Range.read(0, length, data, 0, of)], data_class=DATA_CLASS).get()[0]
    return bytes(memoryview(data)[:got])


def _read_header(fp: FilePath, of: OpenFile, shard: ShardRecord) -> tuple[stf.Header, bytes]:
    first = _read(fp, of, min(shard.size, 64 << 10))
    n = stf.header_length(first, shard.size, shard=shard.file)
    raw = first if len(first) >= 8 + n else _read(fp, of, 8 + n)
    if len(raw) < 8 + n:
        raise _corrupt(f"shard {shard.file} is truncated inside its header", shard.file)
    return stf.parse_header(raw, shard.size, shard=shard.file), raw[: 8 + n]


def _load_into(fp: FilePath, directory: str, manifest: Manifest, into: Any, verify: bool, foreign: bool = False,
               unfilled: str = "refuse") -> dict[str, Any]:
    """Fill ``into``'s tensors in place; returns the filled target per tensor name (first path wins), and a
    fresh copy of each tensor with no target (numpy scalars). ``foreign``, ``unfilled``: as for
    :func:`_load_checkpoint` and :func:`_targets`."""
    targets = _targets(manifest, into, unfilled)
    by_name: dict[str, list[Any]] = {}
    for key, _tag, name in tensor_paths(manifest.structure):
        if key in targets:
            by_name.setdefault(name, []).append(targets[key])
    by_shard = manifest.by_shard()
    fresh: dict[str, Any] = {}
    for shard in manifest.shards:
        records = by_shard[shard.file]
        of = _open_shard(directory, fp, shard, foreign)  # closed after its ranges are read (or dropped, on errors)
        header, head_bytes = _read_header(fp, of, shard)
        _check_header(header, shard, records, exact=not foreign)
        ordered = sorted(records, key=lambda r: header.entries[r.name].begin)
        direct: dict[str, Any] = {}
        bounce_at: dict[str, int] = {}
        bounce_size = 0
        for rec in ordered:
            dests = by_name.get(rec.name)
            view = _byte_view(dests[0]) if dests else None
            if view is not None:
                direct[rec.name] = view
            else:
                bounce_at[rec.name] = bounce_size
                bounce_size += rec.nbytes
        hb = load_buffers.take(bounce_size) if bounce_size else None
        ranges = []
        for rec in ordered:
            offset = header.data_start + header.entries[rec.name].begin
            if rec.name in direct:
                ranges.append(Range.read(offset, rec.nbytes, as_buffer(direct[rec.name]), 0, of))
            else:
                assert hb is not None
                ranges.append(Range.read(offset, rec.nbytes, hb.buf, bounce_at[rec.name], of))
        try:
            got = fp.submit(ranges, data_class=DATA_CLASS).get() if ranges else []
        finally:
            of.close()
        fp.file_done(data_class=DATA_CLASS)
        for rec, n in zip(ordered, got, strict=True):
            if n != rec.nbytes:
                raise _corrupt(
                    f"shard {shard.file} is truncated: read {n} of {rec.nbytes} bytes of tensor {rec.name!r}",
                    shard.file,
                    rec.name,
                )
        bounce = hb.tensor() if hb is not None else None
        if verify and not foreign:
            # As _verify: the header's sum and the tensors' cover the shard (version 1: the whole shard's sum,
            # streamed over the same pieces).
            whole = xxhash.xxh3_64(head_bytes) if shard.header_xxh3_64 is None else None
            with memoryview(hb.buf if hb is not None else b"") as bmv:
                bad: str | None = None
                for rec in ordered:
                    if rec.name in direct:
                        piece = memoryview(direct[rec.name])
                    else:
                        piece = bmv[bounce_at[rec.name] : bounce_at[rec.name] + rec.nbytes]
                    if whole is not None:
                        whole.update(piece)
                    if bad is None and xxh3_64_hex(piece) != rec.xxh3_64:
                        bad = rec.name
                    piece.release()
            if bad is not None:
                raise _corrupt(f"checksum mismatch in tensor {bad!r} of shard {shard.file}", shard.file, bad)
            if whole is not None:
                ok = whole.hexdigest() == shard.xxh3_64
            else:
                ok = xxh3_64_hex(head_bytes) == shard.header_xxh3_64
            if not ok:
                raise _header_mismatch(shard)
        for rec in ordered:
            dests = by_name.get(rec.name, [])
            if rec.name in bounce_at:
                assert bounce is not None
                src = _view(bounce, bounce_at[rec.name], rec.nbytes, rec.dtype, rec.shape)
                if dests:
                    _copy_into(dests[0], src)
                else:  # no place to fill in: a copy that outlives the bounce buffer
                    fresh[rec.name] = src.numpy().copy() if rec.kind == "numpy" else src.clone()
            for extra in dests[1:]:
                _copy_into(extra, dests[0])
        del bounce
        if hb is not None:
            hb.release()
    out: dict[str, Any] = {name: dests[0] for name, dests in by_name.items()}
    out.update(fresh)
    return out


def _copy_into(dst: Any, src: Any) -> None:
    import numpy as np
    import torch

    if isinstance(dst, np.ndarray):
        np.copyto(dst, src.numpy() if isinstance(src, torch.Tensor) else src)
    else:
        with torch.no_grad():
            dst.copy_(src if isinstance(src, torch.Tensor) else torch.from_numpy(src))


def load(
    url: str | os.PathLike[str] | CheckpointInfo,
    *,
    device: str | torch.device = "cpu",
    into: Any = None,
    verify: bool = True,
) -> Any:
    """Load a checkpoint (or a plain ``.safetensors`` file); see :func:`sfstore.checkpoint.load`."""
    require("torch", "torch", "sfstore.checkpoint.load")
    import torch

    if url is None:
        raise errors.PathNotFoundError(
            errno.ENOENT,
            "there is no committed checkpoint to load: the url is None, as checkpoint.latest() returns when "
            "nothing has been saved there yet (a first run); guard the resume: "
            "`if (info := checkpoint.latest(prefix)) is not None: state = checkpoint.load(info)`",
        )
    dev = torch.device(device)
    target = url.url if isinstance(url, CheckpointInfo) else url
    loc = location.locate(target, create=False)
    loc = hf.hub_snapshot(loc) or loc  # a hub cache snapshot resolves beneath its repository folder
    path = loc.path
    fp = loc.fp
    try:
        pfd = loc.open_parent()
    except errors.PathNotFoundError:
        raise errors.os_error(errno.ENOENT, "no checkpoint directory", path) from None
    try:
        if not location.exists_at(pfd, loc.name):
            # an interrupted replace: bring the previous checkpoint back
            location.cleanup(pfd, remove=False, fp=fp, full=loc.parent)
    finally:
        os.close(pfd)
    try:
        kind = fp.stat(path).st_mode
    except errors.PathNotFoundError:
        kind = 0
    foreign = stat.S_ISREG(kind)
    unfilled = "keep"  # a plain file may be one shard of a model: fill what it holds
    directory = os.path.dirname(path) if foreign else path
    if foreign:
        manifest = hf.file_manifest(fp, path)
    else:
        try:
            manifest = read_manifest(fp, path)
        except errors.PathNotFoundError:
            if not stat.S_ISDIR(kind):
                raise
            found = hf.directory_manifest(fp, path)
            if found is None:
                raise errors.os_error(
                    errno.ENOENT,
                    f"not a checkpoint: neither {MANIFEST_NAME} (sfstore) nor {hf.WEIGHTS_NAME} or {hf.INDEX_NAME} "
                    f"(Hugging Face) is in the directory{hf.pickled_weights(fp, path)}",
                    path,
                ) from None
            manifest, foreign, unfilled = found, True, "tied"
    if into is not None and dev.type != "cpu":
        raise errors.InvalidRequestError("load(into=...) fills the given tensors where they are; omit device=")
    with load_buffers.session():
        if into is not None:
            tensors = _load_into(fp, directory, manifest, into, verify, foreign, unfilled if foreign else "refuse")
        else:
            tensors = _load_checkpoint(fp, directory, manifest, dev, verify, foreign)

    def resolve(tag: str, name: str, key: KeyPath) -> Any:
        value = tensors[name]
        return value[()] if tag == "npscalar" else value

    return unflatten(manifest.structure, resolve)
