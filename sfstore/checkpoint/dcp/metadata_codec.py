"""DCP's ``Metadata`` as JSON, never pickle: :func:`encode_metadata` and :func:`decode_metadata`, which validates
every field against a closed set of types (a file that does not parse is a
:class:`~sfstore.errors.CorruptCheckpointError`), and :class:`ItemLocation`, where each saved item lives.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from sfstore import errors
from sfstore.checkpoint import safetensors_format as stf

__all__ = [
    "ItemLocation",
    "FORMAT_VERSION",
    "DCP_VERSION",
    "MAX_METADATA_BYTES",
    "MAX_PLAIN_DEPTH",
    "encode_metadata",
    "decode_metadata",
]

FORMAT_VERSION = 1
"""Version of the JSON layout written by :func:`encode_metadata`."""
DCP_VERSION = "1.0.0"
"""The DCP metadata version these files correspond to (``Metadata.version``)."""
MAX_METADATA_BYTES = 512 << 20
"""A metadata file larger than this is refused as corrupt (a bound on what a hostile file can make us parse)."""
_FORMAT = "sfstore-dcp"


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


_T = TypeVar("_T")


def _torch_attr(name: Any, what: str, kind: type[_T], kind_name: str) -> _T:
    """The ``torch`` attribute ``name`` (``float32``, ``strided``), refused unless it is a ``kind``."""
    text = _str(name, what)
    assert text is not None
    found = getattr(torch, text, None) if text.isidentifier() else None
    if not isinstance(found, kind):
        raise _bad(f"{what}: unknown torch {kind_name} {text!r}")
    return found


_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format, "channels_last_3d": torch.channels_last_3d}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}


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
        dtype=_torch_attr(d.get("dtype"), f"{what}.dtype", torch.dtype, "dtype"),
        layout=_torch_attr(d.get("layout"), f"{what}.layout", torch.layout, "layout"),
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

