"""``torch.distributed.checkpoint`` storage through sfstore: :class:`StorageWriter` and :class:`StorageReader`.

>>> import torch.distributed.checkpoint as dcp
>>> from sfstore.checkpoint.dcp import StorageReader, StorageWriter
>>> dcp.save(state_dict, storage_writer=StorageWriter("sf://run1/step-1000"))  # doctest: +SKIP
>>> dcp.load(state_dict, storage_reader=StorageReader("sf://run1/step-1000"))  # doctest: +SKIP

Where checkpoints live: ``"sf://a/b"`` is ``<root>/a/b``, the directory ``fsspec.filesystem("sf")`` calls
``sf://a/b`` (the ``sf://`` root: ``sfstore.open().file_path("dataset")``); a bare name ``"a/b"`` is ``a/b`` under
the checkpoint class root (``sfstore.open().file_path("checkpoint")``, ``<root>/checkpoints`` by default); an
absolute path (``/x/y/name`` or ``file:///x/y/name``) is that directory. Every file of a relative checkpoint is
named below its root and resolved beneath it at each use (:class:`~sfstore.paths.beneath.Beneath`), so ``..``
cannot climb out and a directory on the way swapped for a symlink to elsewhere is refused, never followed.

A second save to one checkpoint id replaces the first (``overwrite=True`` by default, as DCP's own
``FileSystemWriter``), atomically: the new data files get new names and the metadata is replaced in one rename,
so a load finds the old checkpoint or the new one. ``StorageWriter(url, overwrite=False)`` refuses instead.

DCP without this storage: ``dcp.save(state, checkpoint_id="sf://x")`` with no ``storage_writer`` is DCP's own
``FsspecWriter`` (DCP picks it for any url with a protocol fsspec knows); it writes DCP's own format -- a pickled
``.metadata`` and ``__<rank>_<n>.distcp`` files -- through the ``sf://`` filesystem into the same directory,
``<root>/x``, and ``dcp.load(state, checkpoint_id="sf://x")`` reads that back (unpickling ``.metadata``). The
two formats are separate: :class:`StorageReader` refuses a directory saved last in DCP's own format, naming the
reader that reads it, and :class:`StorageWriter` removes DCP's own files once its checkpoint replaced them.

Torch's format, for tools that want one ``torch.save`` file: :func:`to_torch_save` converts a checkpoint of this
storage (what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does for DCP's own format, which
it reads with ``FileSystemReader`` and cannot read from here); for DCP's own format under ``sf://``,
``dcp_to_torch_save(sfstore.fs.local_path("sf://x"), out)`` (its host directory). In the other direction,
``dcp.save(torch.load(path, weights_only=True), storage_writer=StorageWriter(url))``.

Layout of a checkpoint directory:

* one data file per rank, ``__<rank>_<token>.sfdcp``: the raw bytes of every item the rank's plan holds (tensor
  bytes in C order, exactly the chunk DCP asked to save; non-tensor items as the ``torch.save`` bytes DCP made),
  each item starting at a 4096-byte boundary. Tensor bytes go straight from the tensors' memory (a CPU,
  contiguous tensor is not copied; others are copied to host once) as one range per item through the file
  path, which splits it into parallel ``chunk_size`` requests on an ``O_DIRECT`` descriptor where the
  filesystem allows it (misaligned memory is bounced, a partial last block written through the page cache),
  then fsynced. ``<token>`` is new for every save, so an overwrite never touches the files the previous
  checkpoint still uses.
* ``sfstore-dcp-metadata.json``: DCP's ``Metadata`` (tensor properties, shapes and chunks, planner data, storage
  meta) and where each item lives (file, offset, length, ``xxh3_64`` of its bytes), as **JSON**, written last by
  the coordinator, atomically (temporary name, fsync, rename, directory fsync): the checkpoint exists once it
  does. Data files no longer referenced (a previous checkpoint's, a crashed save's) are removed afterwards.
  Without rank coordination (``dcp.save(..., use_collectives=False)``) each rank writes
  ``__<rank>.sfstore-dcp-metadata.json`` instead.

Security: nothing is ever unpickled from storage. DCP's own ``FileSystemWriter`` pickles its ``Metadata``;
here it is JSON with a closed set of types (decoding validates every field and raises
:class:`~sfstore.errors.CorruptCheckpointError`). Non-tensor state (what DCP serializes with ``torch.save`` into
``BytesIO`` items) is read back with ``torch.load(weights_only=True)`` only -- anything that loader refuses
(arbitrary classes, code) is a :class:`~sfstore.errors.CorruptCheckpointError` -- and the object it returns is
handed to the planner re-serialized, so even DCP's default planner (which calls ``torch.load(weights_only=False)``
in ``load_bytes``) never sees bytes that came from storage.

Integrity: every item's ``xxh3_64`` is recorded at save time. The reader verifies it (``verify=True``) for each
item it reads whole; a part of an item read while resharding is not verified (the checksum covers the whole
item). A mismatch, a truncated or missing data file, or metadata that does not parse raises
:class:`~sfstore.errors.CorruptCheckpointError` naming the file and the item.

Performance and memory: the writer keeps a window of about ``max(64 MiB, chunk_size x parallelism)`` of requests
in flight (at most two such windows of host copies, for GPU or non-contiguous tensors). The reader reads each
requested byte range straight into the planner's target tensor when that tensor is a contiguous CPU tensor of the
stored dtype and the range is contiguous in the file (the usual case, also when loading shards into a full-size
tensor along dimension 0); otherwise it reads the enclosing byte span into a temporary tensor and copies the
requested box out of it (temporaries are bounded by ``temp_budget`` per batch, one item may exceed it). Ranges of
one file are read as one batch (:meth:`~sfstore.paths.file.FilePath.submit`). Every byte is counted on the file
path under the ``checkpoint`` data class.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import os
import re
import secrets
import stat
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from sfstore import errors
from sfstore.buffers import as_buffer
from sfstore.checkpoint import _fs
from sfstore.checkpoint import safetensors_format as stf
from sfstore.checkpoint._fs import DATA_CLASS
from sfstore.checkpoint._host import check_written
from sfstore.paths.base import PathFuture, Range
from sfstore.paths.beneath import Location
from sfstore.paths.file import AtomicWriter, FilePath, OpenFile, enable_direct

__all__ = [
    "StorageWriter",
    "StorageReader",
    "ItemLocation",
    "METADATA_NAME",
    "DATA_SUFFIX",
    "FORMAT_VERSION",
    "encode_metadata",
    "decode_metadata",
    "resolve_checkpoint_dir",
    "to_torch_save",
    "TORCH_METADATA_NAME",
]

METADATA_NAME = "sfstore-dcp-metadata.json"
"""The metadata file of a checkpoint saved with rank coordination."""
DATA_SUFFIX = ".sfdcp"
"""Suffix of the per-rank data files."""
FORMAT_VERSION = 1
"""Version of the JSON layout written by :func:`encode_metadata`."""
DCP_VERSION = "1.0.0"
"""The DCP metadata version these files correspond to (``Metadata.version``)."""
ITEM_ALIGN = 4096
"""Every item starts at a multiple of this in its data file (whole O_DIRECT blocks, no block shared by two items)."""
MAX_METADATA_BYTES = 512 << 20
"""A metadata file larger than this is refused as corrupt (a bound on what a hostile file can make us parse)."""
_FORMAT = "sfstore-dcp"
_DATA_NAME = re.compile(r"^__(\d+)_([0-9a-f]+)\.sfdcp$")
_RANK_METADATA = re.compile(r"^__(\d+)\." + re.escape(METADATA_NAME) + "$")
TORCH_METADATA_NAME = ".metadata"
"""The (pickled) metadata file of DCP's own format (``FileSystemWriter``, ``FsspecWriter``)."""
_TORCH_DATA_NAME = re.compile(r"^__(\d+)_\d+\.distcp$")
_TORCH_RANK_METADATA = re.compile(r"^__(\d+)\.metadata(\.tmp)?$")
_MIN_WINDOW = 64 << 20


# ---------------------------------------------------------------------------------------------------------------
# Where checkpoints live


def _url_text(url: str | os.PathLike[str]) -> str:
    text = os.fspath(url)
    if not isinstance(text, str):
        raise errors.InvalidRequestError(f"a checkpoint url must be text, not {type(text).__name__}")
    if "\x00" in text:
        raise errors.PathEscapeError(f"checkpoint url {text!r} contains a NUL byte")
    return text


def _split_url(url: str | os.PathLike[str]) -> tuple[str, str]:
    """``("abs", "/x/y/name")``, ``("sf", "a/b")`` (below the ``sf://`` root) or ``("class", "a/b")`` (below the
    checkpoint class root), as :func:`sfstore.checkpoint._fs.split_url` has them; no I/O."""
    text = _url_text(url)
    kind, where = _fs.split_url(text)
    if kind != _fs.ABSOLUTE and where in ("", ".", ".."):
        raise errors.InvalidRequestError(f"checkpoint url {text!r} names no checkpoint directory")
    return kind, where


def _root(kind: str) -> FilePath:
    """The file path a relative checkpoint url of ``kind`` names a directory below."""
    import sfstore

    return sfstore.open().file_path("dataset" if kind == _fs.SF else "checkpoint")


def resolve_checkpoint_dir(url: str | os.PathLike[str]) -> str:
    """The absolute checkpoint directory that ``url`` names (not created): a name, true when computed, for
    messages and checks; the writer and reader never act on it (they resolve beneath the root at each use).

    Parameters
    ----------
    url : str or os.PathLike
        ``"sf://a/b"`` (``<root>/a/b``, below the ``sf://`` root), ``"a/b"`` (below the checkpoint class root),
        or an absolute path / ``file://`` url.

    Returns
    -------
    str
        The directory.

    Raises
    ------
    sfstore.errors.PathEscapeError
        A relative name that climbs out of its root (or names the root itself), or a NUL byte.
    sfstore.errors.InvalidRequestError
        Another url scheme, or an empty name.
    """
    kind, where = _split_url(url)
    if kind == _fs.ABSOLUTE:
        return where
    root = _root(kind)
    full = root.resolve(where)
    if full == root.root:
        raise errors.PathEscapeError(f"checkpoint url {url!r} resolves to the root {root.root} itself")
    return full


def _plain_name(name: Any, what: str) -> str:
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name in (".", "..")
        or name.startswith(".")
    ):
        raise errors.CorruptCheckpointError(f"metadata: {what} {name!r} is not a plain file name in the checkpoint "
                                            "directory (path escape refused)", shard=str(name))
    return name


# ---------------------------------------------------------------------------------------------------------------
# Metadata as JSON (never pickle)


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item lives: ``DCP``'s per-item ``storage_data`` for this storage.

    Attributes
    ----------
    file : str
        Data file name inside the checkpoint directory.
    offset : int
        Byte offset of the item in the file.
    length : int
        Bytes of the item.
    xxh3_64 : int
        ``xxhash.xxh3_64`` of the item's bytes.
    """

    file: str
    offset: int
    length: int
    xxh3_64: int


@dataclass(frozen=True)
class _FilePrefix:
    """Per-rank ``SavePlan.storage_data``: the data file name prefix assigned by the coordinator."""

    prefix: str


def _bad(message: str) -> errors.CorruptCheckpointError:
    return errors.CorruptCheckpointError(f"metadata: {message}")


def _int(value: Any, what: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
        maximum is not None and value > maximum
    ):
        raise _bad(f"{what} must be an integer >= {minimum}, not {value!r}")
    return value


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise _bad(f"{what} must be a list of integers, not {type(value).__name__}")
    return [_int(v, what, maximum=stf.MAX_DIM) for v in value]


def _shape(value: Any, what: str) -> list[int]:
    """A list of sizes torch can hold (see :func:`~sfstore.checkpoint.safetensors_format.shape_problem`)."""
    sizes = _ints(value, what)
    problem = stf.shape_problem(sizes)
    if problem is not None:
        raise _bad(f"{what}: {problem}")
    return sizes


def _str(value: Any, what: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _bad(f"{what} must be a string, not {type(value).__name__}")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(f"{what} must be an object, not {type(value).__name__}")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any, what: str) -> torch.dtype:
    text = _str(name, what)
    assert text is not None
    found = getattr(torch, text, None) if text.isidentifier() else None
    if not isinstance(found, torch.dtype):
        raise _bad(f"{what}: unknown torch dtype {text!r}")
    return found


_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format, "channels_last_3d": torch.channels_last_3d}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}


def _layout(name: Any, what: str) -> torch.layout:
    text = _str(name, what)
    assert text is not None
    found = getattr(torch, text, None) if text.isidentifier() else None
    if not isinstance(found, torch.layout):
        raise _bad(f"{what}: unknown torch layout {text!r}")
    return found


MAX_PLAIN_DEPTH = 64
"""Deepest nesting of containers in ``planner_data`` stored (and read back)."""


def _encode_plain(value: Any, where: str, depth: int = 0) -> Any:
    """Tagged JSON for plain data: every container is tagged, so tuples stay tuples and dict keys keep types."""
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_PLAIN_DEPTH:
        raise errors.InvalidRequestError(f"{where}: containers nest deeper than {MAX_PLAIN_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, list):
        return {"l": [_encode_plain(v, where, depth + 1) for v in value]}
    if isinstance(value, tuple):
        return {"t": [_encode_plain(v, where, depth + 1) for v in value]}
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise errors.InvalidRequestError(
                    f"{where}: a dict key of type {type(k).__name__}; sfstore's DCP storage keeps metadata as JSON "
                    "(never pickle) and supports str and int keys"
                )
            items.append([k, _encode_plain(v, where, depth + 1)])
        return {"d": items}
    raise errors.InvalidRequestError(
        f"{where}: a {type(value).__name__}; sfstore's DCP storage keeps metadata as JSON (never pickle) and "
        "supports None, bool, int, float, str, list, tuple and dict"
    )


def _decode_plain(value: Any, where: str, depth: int = 0) -> Any:
    if depth > MAX_PLAIN_DEPTH:
        raise _bad(f"{where} is nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise _bad(f"{where}: unexpected {type(value).__name__} in tagged data")
    ((tag, body),) = value.items()
    if tag == "f" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag in ("l", "t") and isinstance(body, list):
        items = [_decode_plain(v, where, depth + 1) for v in body]
        return items if tag == "l" else tuple(items)
    if tag == "d" and isinstance(body, list):
        out: dict[Any, Any] = {}
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(
                pair[0], (str, int)
            ):
                raise _bad(f"{where}: malformed dict entry {pair!r}")
            out[pair[0]] = _decode_plain(pair[1], where, depth + 1)
        return out
    raise _bad(f"{where}: unknown tag {tag!r}")


def _encode_index(index: MetadataIndex) -> dict[str, Any]:
    return {"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset), "index": index.index}


def _decode_index(raw: Any, what: str) -> MetadataIndex:
    d = _dict(raw, what)
    fqn = _str(d.get("fqn"), f"{what}.fqn")
    assert fqn is not None
    offset = d.get("offset")
    hint = d.get("index")
    return MetadataIndex(
        fqn,
        None if offset is None else _ints(offset, f"{what}.offset"),
        None if hint is None else _int(hint, f"{what}.index"),
    )


def encode_metadata(metadata: Metadata) -> bytes:
    """DCP's ``Metadata`` (with :class:`ItemLocation` storage data) as UTF-8 JSON.

    Parameters
    ----------
    metadata : torch.distributed.checkpoint.metadata.Metadata
        What the coordinator's ``finish`` receives, with ``storage_data`` filled in.

    Returns
    -------
    bytes
        The document (see :func:`decode_metadata`).

    Raises
    ------
    sfstore.errors.InvalidRequestError
        ``planner_data`` holds something other than plain data (a custom planner's objects cannot be stored
        without pickle).
    """
    entries: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
            continue
        props = md.properties
        if props.memory_format not in _MEMORY_FORMAT_NAMES:
            raise errors.InvalidRequestError(f"{fqn}: memory format {props.memory_format} cannot be stored")
        entries[fqn] = {
            "type": "tensor",
            "dtype": _dtype_name(props.dtype),
            "layout": str(props.layout).removeprefix("torch."),
            "requires_grad": bool(props.requires_grad),
            "memory_format": _MEMORY_FORMAT_NAMES[props.memory_format],
            "pin_memory": bool(props.pin_memory),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    storage: list[dict[str, Any]] = []
    for index, loc in (metadata.storage_data or {}).items():
        if not isinstance(loc, ItemLocation):
            raise errors.InvalidRequestError(f"storage data of {index.fqn} is {type(loc).__name__}, not ItemLocation")
        storage.append({**_encode_index(index), "file": loc.file, "file_offset": loc.offset, "length": loc.length,
                        "xxh3_64": f"{loc.xxh3_64:016x}"})
    meta = metadata.storage_meta
    doc = {
        "format": _FORMAT,
        "format_version": FORMAT_VERSION,
        "dcp_version": metadata.version,
        "state_dict_metadata": entries,
        "planner_data": _encode_plain(metadata.planner_data, "Metadata.planner_data"),
        "storage_data": storage,
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
            "save_id": meta.save_id,
            "load_id": meta.load_id,
            "modules": list(meta.modules),
        },
    }
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _decode_tensor_md(fqn: str, d: dict[str, Any]) -> TensorStorageMetadata:
    what = f"state_dict_metadata[{fqn!r}]"
    fmt = _str(d.get("memory_format"), f"{what}.memory_format")
    if fmt not in _MEMORY_FORMATS:
        raise _bad(f"{what}: unknown memory format {fmt!r}")
    for key in ("requires_grad", "pin_memory"):
        if not isinstance(d.get(key), bool):
            raise _bad(f"{what}.{key} must be a boolean")
    props = TensorProperties(
        dtype=_dtype(d.get("dtype"), f"{what}.dtype"),
        layout=_layout(d.get("layout"), f"{what}.layout"),
        requires_grad=d["requires_grad"],
        memory_format=_MEMORY_FORMATS[fmt],
        pin_memory=d["pin_memory"],
    )
    size = _shape(d.get("size"), f"{what}.size")
    chunks_raw = d.get("chunks")
    if not isinstance(chunks_raw, list):
        raise _bad(f"{what}.chunks must be a list")
    chunks = []
    for i, c in enumerate(chunks_raw):
        cd = _dict(c, f"{what}.chunks[{i}]")
        offsets = _ints(cd.get("offsets"), f"{what}.chunks[{i}].offsets")
        sizes = _shape(cd.get("sizes"), f"{what}.chunks[{i}].sizes")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
            o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)
        ):
            raise _bad(f"{what}.chunks[{i}] (offsets {offsets}, sizes {sizes}) does not fit a tensor of size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def decode_metadata(data: bytes) -> Metadata:
    """Parse and validate what :func:`encode_metadata` wrote.

    Parameters
    ----------
    data : bytes
        The metadata file's content.

    Returns
    -------
    torch.distributed.checkpoint.metadata.Metadata
        With ``storage_data`` a ``{MetadataIndex: ItemLocation}`` dictionary.

    Raises
    ------
    sfstore.errors.CorruptCheckpointError
        Not UTF-8 JSON, another format or version, or any field of the wrong type or out of range (an unknown
        dtype, a chunk outside its tensor, a file name that is not a plain name in the checkpoint directory).
    """
    if not stf.json_depth_within(data, 3 * MAX_PLAIN_DEPTH + 16):
        raise _bad("the document nests too deeply")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad(f"not valid UTF-8 JSON ({exc})") from None
    doc = _dict(doc, "the document")
    if doc.get("format") != _FORMAT:
        raise _bad(f"format is {doc.get('format')!r}, not {_FORMAT!r} (not an sfstore DCP checkpoint)")
    if doc.get("format_version") != FORMAT_VERSION:
        raise _bad(f"format_version {doc.get('format_version')!r} is not supported (this sfstore reads "
                   f"{FORMAT_VERSION})")
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, raw in _dict(doc.get("state_dict_metadata"), "state_dict_metadata").items():
        d = _dict(raw, f"state_dict_metadata[{fqn!r}]")
        kind = d.get("type")
        if kind == "bytes":
            state[fqn] = BytesStorageMetadata()
        elif kind == "tensor":
            state[fqn] = _decode_tensor_md(fqn, d)
        else:
            raise _bad(f"state_dict_metadata[{fqn!r}].type is {kind!r}")
    storage: dict[MetadataIndex, ItemLocation] = {}
    raw_storage = doc.get("storage_data")
    if not isinstance(raw_storage, list):
        raise _bad("storage_data must be a list")
    for i, raw in enumerate(raw_storage):
        what = f"storage_data[{i}]"
        d = _dict(raw, what)
        index = _decode_index(d, what)
        if index.fqn not in state:
            raise _bad(f"{what} refers to {index.fqn!r}, which state_dict_metadata does not list")
        checksum = _str(d.get("xxh3_64"), f"{what}.xxh3_64")
        assert checksum is not None
        if not re.fullmatch(r"[0-9a-f]{16}", checksum):
            raise _bad(f"{what}.xxh3_64 {checksum!r} is not 16 hex digits")
        storage[index] = ItemLocation(
            file=_plain_name(d.get("file"), f"{what}.file"),
            offset=_int(d.get("file_offset"), f"{what}.file_offset", maximum=1 << 62),
            length=_int(d.get("length"), f"{what}.length", maximum=1 << 62),
            xxh3_64=int(checksum, 16),
        )
    meta_raw = doc.get("storage_meta")
    meta = None
    if meta_raw is not None:
        m = _dict(meta_raw, "storage_meta")
        modules = m.get("modules", [])
        if not isinstance(modules, list) or not all(isinstance(x, str) for x in modules):
            raise _bad("storage_meta.modules must be a list of strings")
        meta = StorageMeta(
            checkpoint_id=_str(m.get("checkpoint_id"), "storage_meta.checkpoint_id", optional=True),
            save_id=_str(m.get("save_id"), "storage_meta.save_id", optional=True),
            load_id=_str(m.get("load_id"), "storage_meta.load_id", optional=True),
            modules=list(modules),
        )
    return Metadata(
        state_dict_metadata=state,
        planner_data=_decode_plain(doc.get("planner_data"), "planner_data"),
        storage_data=storage,
        storage_meta=meta,
        version=_str(doc.get("dcp_version"), "dcp_version", optional=True),
    )


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


def _metadata_name(rank: int | None) -> str:
    return METADATA_NAME if rank is None else f"__{rank}.{METADATA_NAME}"


class _CkDir:
    """A DCP checkpoint directory: the file path whose root it is under and its name below that root
    (``prefix``, ``""`` when it is the root itself).

    A reader names each file below the root, resolved beneath it at each use; a writer works in
    :meth:`dirfd`, the directory opened beneath the root once, so every file of one save lands in the same
    directory whatever is swapped meanwhile. Either way a directory on the way swapped for a symlink to
    elsewhere is refused, never followed out of the root.
    """

    def __init__(self, fp: FilePath, prefix: str) -> None:
        self.fp, self.prefix = fp, prefix
        self._fd = -1
        self._pid = 0

    def name(self, file: str) -> str:
        return f"{self.prefix}/{file}" if self.prefix else file

    def full(self, file: str = "") -> str:
        return self.fp.full(self.name(file) if file else self.prefix)

    def dirfd(self) -> int:
        """The directory's ``O_PATH`` descriptor, opened beneath the root on first use (again after a fork)."""
        if self._fd < 0 or self._pid != os.getpid():
            try:
                self._fd = self.fp.beneath.open(self.prefix or ".", _O_PATH | os.O_DIRECTORY)
            except errors.SfstoreError:
                raise
            except OSError as exc:
                raise errors.os_error(exc.errno or errno.EIO, "cannot open the checkpoint directory",
                                      self.full()) from None
            self._pid = os.getpid()
        return self._fd

    def open_readable(self) -> int:
        """A readable descriptor of the directory (for listing and fsync); the caller closes it."""
        try:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dirfd())
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, "cannot open the checkpoint directory", self.full()) from None

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = -1

    def __del__(self) -> None:
        self.close()


_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)


def _stat_in(ck: _CkDir, name: str, *, by_name: bool = False) -> os.stat_result | None:
    """``lstat`` of ``name`` in the checkpoint directory, None when it is missing: in the writer's
    :meth:`_CkDir.dirfd`, or (``by_name``, as a reader names its files) resolved beneath the root now."""
    try:
        if by_name:
            return ck.fp.beneath.stat(ck.name(name), follow=False)
        return os.stat(name, dir_fd=ck.dirfd(), follow_symlinks=False)
    except FileNotFoundError:
        return None
    except errors.SfstoreError:
        raise
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, "stat", ck.full(name)) from None


def _open_dir(url: str, *, create: bool, direct: str | None, chunk_size: int | None,
              parallelism: int | None) -> _CkDir:
    kind, where = _split_url(url)
    options: dict[str, Any] = {"direct": direct, "chunk_size": chunk_size, "parallelism": parallelism}
    if kind == _fs.ABSOLUTE:
        if not create and not os.path.isdir(where):
            raise errors.os_error(errno.ENOENT, f"no checkpoint at {url!r} (directory missing)", where)
        return _CkDir(FilePath(where, create=create, **options), "")
    root = _root(kind)
    parts = root.beneath.parts(where)  # '..' above the root refused; symlinks are met beneath it, at each use
    if not parts:
        raise errors.PathEscapeError(f"checkpoint url {url!r} resolves to the root {root.root} itself")
    prefix = "/".join(parts)
    fp = FilePath(root.root, create=False, **options)
    try:
        if create:
            fp.beneath.mkdir(prefix, parents=True, exist_ok=True)
        elif not stat.S_ISDIR(fp.stat(prefix).st_mode):
            raise errors.os_error(errno.ENOTDIR, f"no checkpoint at {url!r} (not a directory)", fp.full(prefix))
    except errors.PathNotFoundError:
        raise errors.os_error(errno.ENOENT, f"no checkpoint at {url!r} (directory missing)", fp.full(prefix)) from None
    except errors.SfstoreError:
        raise
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, f"cannot create checkpoint {url!r}", fp.full(prefix)) from None
    return _CkDir(fp, prefix)


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


def _hash(view: Any) -> int:
    return int(xxhash.xxh3_64_intdigest(view))


# ---------------------------------------------------------------------------------------------------------------
# Writer


class StorageWriter(_DcpStorageWriter):
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
    Each rank writes one data file (see the module documentation for the layout); the coordinator commits the
    checkpoint by writing the JSON metadata atomically in ``finish``. Concurrent saves into one directory are not
    supported (each one's clean-up removes the other's files).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        direct: str | None = None,
        chunk_size: int | None = None,
        parallelism: int | None = None,
    ) -> None:
        super().__init__()
        self.url = _url_text(url)
        _split_url(self.url)
        self.overwrite = overwrite
        self._fp_options: dict[str, Any] = {"direct": direct, "chunk_size": chunk_size, "parallelism": parallelism}
        self._fp: _CkDir | None = None
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True

    # -- DCP interface -----------------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (a new ``save_id``), into ``checkpoint_id`` when given.

        Parameters
        ----------
        checkpoint_id : str or os.PathLike or None
            A checkpoint url (see the class); None keeps the current one.
        """
        if checkpoint_id:
            text = _url_text(checkpoint_id)
            _split_url(text)
            if text != self.url:
                self.url, self._fp = text, None
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
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else None
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    def _path(self) -> _CkDir:
        if self._fp is None:
            self._fp = _open_dir(self.url, create=True, **self._fp_options)
        return self._fp

    def _metadata_exists(self, ck: _CkDir) -> bool:
        names = [METADATA_NAME] if self.use_collectives else [_metadata_name(0), METADATA_NAME]
        names.append(TORCH_METADATA_NAME)  # DCP's own format: a checkpoint at this id all the same
        return any(_stat_in(ck, n) is not None for n in names)

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
        meta = _metadata_name(own)
        with AtomicWriter(ck.fp, Location(ck.dirfd(), meta, ck.full(meta), owned=False), fsync=True,
                          overwrite=True) as w:  # published atomically in the directory of the data files
            w.write(doc)
        referenced = {loc.file for loc in metadata.storage_data.values() if isinstance(loc, ItemLocation)}
        _remove_unreferenced(ck, referenced, own)

    def storage_meta(self) -> StorageMeta | None:
        """``StorageMeta(checkpoint_id=url, save_id=...)`` for the planner and the metadata."""
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint url this writer saves to."""
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a url this storage understands (``sf://``, ``file://``, a path or name).

        Parameters
        ----------
        checkpoint_id : str or os.PathLike
            The id.

        Returns
        -------
        bool
            True for those forms; False for other schemes (``s3://``...) or malformed ids. No I/O.
        """
        try:
            _split_url(checkpoint_id)
        except (errors.SfstoreError, TypeError):
            return False
        return True


def _stale(name: str, referenced: set[str], rank: int | None) -> int:
    """Whether the new checkpoint (``rank``: one rank's, saved without coordination) leaves ``name`` unused: 0
    when it does not, 1 for metadata (removed first: no reader finds metadata naming removed files), 2 for data."""
    if name in referenced:
        return 0
    if rank is None and (name in (TORCH_METADATA_NAME, TORCH_METADATA_NAME + ".tmp") or _RANK_METADATA.match(name)):
        return 1
    m = _TORCH_RANK_METADATA.match(name)
    if m is not None:
        return 1 if rank is None or int(m.group(1)) == rank else 0
    m = _DATA_NAME.match(name) or _TORCH_DATA_NAME.match(name)
    if m is not None:
        return 2 if rank is None or int(m.group(1)) == rank else 0
    return 0


def _remove_unreferenced(ck: _CkDir, referenced: set[str], rank: int | None) -> None:
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

    def __init__(self, ck: _CkDir, name: str) -> None:
        self.ck = ck
        self.fp = ck.fp
        self.name = name
        self.path = ck.full(name)
        self.window = max(_MIN_WINDOW, self.fp.chunk_size * self.fp.parallelism)

    def _create(self) -> tuple[int, Any]:
        """Create the data file in the checkpoint directory's descriptor (opened beneath the root once);
        returns the file's descriptor and its location there (the file is removed through it on failure)."""
        loc = Location(self.ck.dirfd(), self.name, self.path, owned=False)
        try:
            fd = os.open(loc.name or ".", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=loc.dirfd)
        except OSError as exc:
            raise errors.os_error(exc.errno or errno.EIO, "cannot create", self.path) from None
        try:
            if self.fp.direct:
                enable_direct(fd, self.path, required=True)
        except BaseException:
            os.close(fd)
            os.unlink(loc.name or "", dir_fd=loc.dirfd)
            raise
        return fd, loc

    def write(self, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        if not items:
            return []
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
        ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
        fd, where = self._create()
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
                os.unlink(where.name or "", dir_fd=where.dirfd)
            except OSError:
                pass
            raise
        os.close(fd)
        self.fp.counters.add_for(DATA_CLASS, files=1)
        return results

    def _submit(self, batch: list[Range], keep: list[Any], inflight: deque[tuple[PathFuture | None, list[Any]]],
                results: list[WriteResult]) -> None:
        """Submit ``batch`` (at most two batches in flight), then checksum its items while the path writes."""
        while len(inflight) >= 2:
            self._wait(inflight)
        inflight.append((self.fp.submit(batch, data_class=DATA_CLASS) if batch else None, keep))
        for item, _owner, view, offset, length in keep:
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=ItemLocation(self.name, offset, length, _hash(view))))

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


class StorageReader(_DcpStorageReader):
    """``torch.distributed.checkpoint`` storage reader through sfstore's file path.

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint directory (as for :class:`StorageWriter`); ``dcp.load(..., checkpoint_id=...)`` replaces it.
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
    given to the planner re-serialized (see the module documentation).
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
        super().__init__()
        self.url = _url_text(url)
        _split_url(self.url)
        self.verify = verify
        self.temp_budget = int(temp_budget)
        self._fp_options: dict[str, Any] = {"direct": direct, "chunk_size": chunk_size, "parallelism": parallelism}
        self._fp: _CkDir | None = None
        self.storage_data: dict[MetadataIndex, ItemLocation] = {}
        self._state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self.load_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True

    def _path(self) -> _CkDir:
        if self._fp is None:
            self._fp = _open_dir(self.url, create=False, **self._fp_options)
        return self._fp

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
        if checkpoint_id:
            text = _url_text(checkpoint_id)
            _split_url(text)
            if text != self.url:
                self.url, self._fp = text, None
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
        name = _metadata_name(None if rank is None else int(rank))
        theirs = TORCH_METADATA_NAME if rank is None else f"__{int(rank)}{TORCH_METADATA_NAME}"
        torch_format = _stat_in(ck, theirs, by_name=True)
        ours = _stat_in(ck, name, by_name=True)
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
            raw = _fs.read_regular(ck.fp, ck.name(name), limit=MAX_METADATA_BYTES, what=f"metadata of {self.url!r}:")
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
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else None
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Return ``plan`` unchanged (nothing storage-specific to plan).

        Parameters
        ----------
        plan : LoadPlan
            The planner's local plan.

        Returns
        -------
        LoadPlan
            The same plan.
        """
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Return ``plans`` unchanged.

        Parameters
        ----------
        plans : list of LoadPlan
            One per rank.

        Returns
        -------
        list of LoadPlan
            The same plans.
        """
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

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint url this reader loads from."""
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a url this storage understands (see ``StorageWriter``).

        Parameters
        ----------
        checkpoint_id : str or os.PathLike
            The id.

        Returns
        -------
        bool
            True for ``sf://``, ``file://``, paths and names.
        """
        return StorageWriter.validate_checkpoint_id(checkpoint_id)

    # -- reading -----------------------------------------------------------------------------------------------

    def _read_file(self, ck: _CkDir, name: str, entries: list[tuple[ReadItem, ItemLocation]],
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
            _fs.check_regular(ck.fp.stat(ck.name(name)), full, what, shard=name)  # says what it is instead
            raise errors.CorruptCheckpointError(f"{what} {full} is not a regular file", shard=name) from None
        with of:
            self._read_open_file(ck.fp, of, name, entries, planner)
        ck.fp.counters.add_for(DATA_CLASS, files=1)

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
        if _hash(view) != job.loc.xxh3_64:
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


# ---------------------------------------------------------------------------------------------------------------
# Torch's format


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
    text = _url_text(path)
    if text.startswith("sf://"):
        kind, where = _fs.split_url(text)
        return _root(kind), where
    if "://" in text and not text.startswith("file://"):
        raise errors.InvalidRequestError(f"torch.save target {text!r}: an sf:// url or a host path")
    if text.startswith("file://"):
        _, text = _fs.split_url(text)
    full = os.path.abspath(text)  # as torch.save has it: relative to the working directory
    parent, name = os.path.split(full)
    return _fs._file_path(parent, True), name


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
        The checkpoint (the forms of :class:`StorageWriter`).
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
