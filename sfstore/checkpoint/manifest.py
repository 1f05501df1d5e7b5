"""The checkpoint manifest, ``sfstore-manifest.json``: what is in a checkpoint and how to check it.

Schema (format version 2)::

    {
      "format": "sfstore-checkpoint",
      "version": 2,
      "created_ns": 1712345678123456789,          # time.time_ns() when the manifest was written
      "metadata": {"step": 1000},                 # the caller's metadata: plain JSON, string keys
      "structure": <node>,                        # the state dict's nesting (below)
      "tensors": {                                # per tensor, by name (= its key in its shard)
        "optimizer/state/0/exp_avg": {
          "shard": "shard-00000.safetensors", "kind": "torch", "dtype": "bfloat16",
          "shape": [4096, 4096], "nbytes": 33554432, "xxh3_64": "9f0c3c1bd1c5e2a7"
        }
      },
      "shards": [{"file": "shard-00000.safetensors", "size": 1073745920, "xxh3_64": "...",
                  "header_xxh3_64": "..."}]
    }

A shard's ``xxh3_64`` covers the whole file, ``header_xxh3_64`` its safetensors header (the 8-byte length, the
JSON and its padding: everything before the first tensor byte). The tensors' sums and the header's cover every
byte of a shard once, so a load checks those and reads each byte once; the whole-file sum is for tools that
check a shard file on its own. Version 1 (no ``header_xxh3_64``) is still read: its loads check the whole-file
sum as well.

``structure`` nodes: JSON ``null``, ``true``/``false``, integers, strings and arrays (lists) stand for
themselves; every other node is an object with exactly one tag: ``{"float": "nan"}`` (``repr`` of the float, so
``1.0`` stays a float and nan/inf/-0.0 round-trip), ``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}``
(keys are nodes too, so ``int`` keys stay ints), ``{"odict": [...]}`` (``OrderedDict``), ``{"size": [...]}``
(``torch.Size``), ``{"bytes": "<base64>"}``, ``{"dtype": "bfloat16"}`` (a ``torch.dtype`` value),
``{"tensor": name}`` (a torch tensor or numpy array, by ``kind``) and ``{"npscalar": name}`` (a numpy scalar,
stored as a 0-d array).

Tensor names are key paths joined with ``/``, each key escaped (``~`` -> ``~0``, ``/`` -> ``~1``); a name that
would repeat gets a ``~2``, ``~3``, ... suffix. Shard file names must be plain names inside the checkpoint
directory: ``/``, ``..``, ``.``, NUL or an empty name is a :class:`~sfstore.errors.CorruptCheckpointError`
(path escape) before anything is read. Every malformed field is a ``CorruptCheckpointError`` too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sfstore.checkpoint.safetensors_format import no_duplicate_keys
from sfstore.errors import CorruptCheckpointError, InvalidRequestError

__all__ = [
    "MANIFEST_NAME",
    "FORMAT",
    "VERSION",
    "READABLE_VERSIONS",
    "MAX_MANIFEST_BYTES",
    "NUMPY_DTYPES",
    "TensorRecord",
    "ShardRecord",
    "Manifest",
    "check_plain_name",
    "encode_key",
]

MANIFEST_NAME = "sfstore-manifest.json"
FORMAT = "sfstore-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Format versions this sfstore reads (it writes :data:`VERSION`)."""
MAX_MANIFEST_BYTES = 1 << 30
"""Largest manifest read, in bytes."""

NUMPY_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
"""numpy dtypes a checkpoint holds (by name; each is also a torch dtype of the same name and bytes)."""

KINDS = ("torch", "numpy")
_TAGS = frozenset(("float", "tuple", "dict", "odict", "size", "bytes", "dtype", "tensor", "npscalar"))
_HEX = frozenset("0123456789abcdef")


def _bad(message: str, tensor: str | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{MANIFEST_NAME}: {message}", shard=None, tensor=tensor)


def check_plain_name(name: Any, what: str) -> str:
    """``name`` if it is a plain file name inside the checkpoint directory, else ``CorruptCheckpointError``."""
    if not isinstance(name, str) or not name:
        raise _bad(f"{what} {name!r} is not a file name")
    if "/" in name or "\x00" in name or name in (".", "..") or name.startswith("/"):
        raise _bad(f"{what} {name!r} escapes the checkpoint directory (only plain file names are allowed)")
    return name


def encode_key(key: Any) -> str:
    """One component of a tensor name: ``str`` keys escaped (``~`` -> ``~0``, ``/`` -> ``~1``), others as text."""
    text = key if isinstance(key, str) else repr(key) if not isinstance(key, int) else str(key)
    return text.replace("~", "~0").replace("/", "~1")


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a checkpoint (see the module docs)."""

    name: str
    shard: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    xxh3_64: str

    def to_json(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "xxh3_64": self.xxh3_64,
        }


@dataclass(frozen=True)
class ShardRecord:
    """One shard file: its plain name, size in bytes, xxh3-64 of the whole file and of its header (hex;
    ``header_xxh3_64`` is ``None`` in version 1 manifests)."""

    file: str
    size: int
    xxh3_64: str
    header_xxh3_64: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "size": self.size, "xxh3_64": self.xxh3_64}
        if self.header_xxh3_64 is not None:
            out["header_xxh3_64"] = self.header_xxh3_64
        return out


@dataclass
class Manifest:
    """A checkpoint's manifest (see the module docs)."""

    created_ns: int
    metadata: dict[str, Any]
    structure: Any
    tensors: dict[str, TensorRecord]
    shards: list[ShardRecord]
    _by_shard: dict[str, list[TensorRecord]] = field(default_factory=dict, repr=False)

    @property
    def version(self) -> int:
        """The format version this manifest is written as: :data:`VERSION`, or 1 where a shard lacks its header
        sum (read from version 1, or built without them)."""
        return VERSION if all(sh.header_xxh3_64 is not None for sh in self.shards) else 1

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data in the checkpoint."""
        return sum(t.nbytes for t in self.tensors.values())

    def by_shard(self) -> dict[str, list[TensorRecord]]:
        """Tensor records per shard file (every shard listed, possibly empty)."""
        if not self._by_shard:
            out: dict[str, list[TensorRecord]] = {s.file: [] for s in self.shards}
            for t in self.tensors.values():
                out[t.shard].append(t)
            self._by_shard = out
        return self._by_shard

    def to_json(self) -> bytes:
        """The manifest as UTF-8 JSON (ASCII-escaped, so any string survives)."""
        obj = {
            "format": FORMAT,
            "version": self.version,
            "created_ns": self.created_ns,
            "metadata": self.metadata,
            "structure": self.structure,
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
            "shards": [s.to_json() for s in self.shards],
        }
        try:
            return json.dumps(obj, ensure_ascii=True, allow_nan=False, indent=1).encode("ascii")
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"checkpoint metadata must be plain JSON (no nan/inf): {exc}") from None

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and validate a manifest; every problem is a :class:`~sfstore.errors.CorruptCheckpointError`."""
        try:
            obj = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise _bad(f"not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise _bad("not a JSON object")
        if obj.get("format") != FORMAT:
            raise _bad(f"format is {obj.get('format')!r}, not {FORMAT!r}")
        version = obj.get("version")
        if not _is_int(version) or version not in READABLE_VERSIONS:
            raise _bad(f"format version {version!r} is not supported (this sfstore reads versions "
                       f"{', '.join(map(str, READABLE_VERSIONS))})")
        expected = {"format", "version", "created_ns", "metadata", "structure", "tensors", "shards"}
        if set(obj) != expected:
            raise _bad(f"keys are {sorted(obj)}, expected {sorted(expected)}")
        created = obj["created_ns"]
        if not _is_int(created) or created < 0:
            raise _bad(f"created_ns {created!r} is not a non-negative integer")
        metadata = obj["metadata"]
        if not isinstance(metadata, dict):
            raise _bad("metadata is not a JSON object")
        shards_raw = obj["shards"]
        if not isinstance(shards_raw, list):
            raise _bad("shards is not a list")
        shards: list[ShardRecord] = []
        seen: set[str] = set()
        shard_keys = {"file", "size", "xxh3_64"} | ({"header_xxh3_64"} if version >= 2 else set())
        for s in shards_raw:
            if not isinstance(s, dict) or set(s) != shard_keys:
                raise _bad(f"shard entry {s!r} must have exactly {', '.join(sorted(shard_keys))}")
            name = check_plain_name(s["file"], "shard file")
            if name == MANIFEST_NAME or name in seen:
                raise _bad(f"shard file {name!r} is listed twice or names the manifest")
            seen.add(name)
            if not _is_int(s["size"]) or s["size"] < 0:
                raise _bad(f"shard {name!r}: size {s['size']!r} is not a non-negative integer")
            head = _check_hash(s["header_xxh3_64"], f"shard {name!r} header") if version >= 2 else None
            shards.append(ShardRecord(name, s["size"], _check_hash(s["xxh3_64"], f"shard {name!r}"), head))
        tensors_raw = obj["tensors"]
        if not isinstance(tensors_raw, dict):
            raise _bad("tensors is not a JSON object")
        tensors = {name: _tensor_record(name, rec, seen) for name, rec in tensors_raw.items()}
        man = cls(created, metadata, obj["structure"], tensors, shards)
        for _ in _walk(man.structure, tensors, 0):
            pass
        return man


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_hash(value: Any, where: str) -> str:
    if not (isinstance(value, str) and len(value) == 16 and set(value) <= _HEX):
        raise _bad(f"{where}: xxh3_64 {value!r} is not 16 lowercase hex digits")
    return value


def _tensor_record(name: str, rec: Any, shards: set[str]) -> TensorRecord:
    if not name:
        raise _bad("a tensor has an empty name")
    keys = {"shard", "kind", "dtype", "shape", "nbytes", "xxh3_64"}
    if not isinstance(rec, dict) or set(rec) != keys:
        raise _bad(f"tensor {name!r}: entry must have exactly {sorted(keys)}", tensor=name)
    shard = rec["shard"]
    if shard not in shards:
        check_plain_name(shard, f"tensor {name!r}: shard")
        raise _bad(f"tensor {name!r}: shard {shard!r} is not among the listed shards", tensor=name)
    kind, dtype, shape, nbytes = rec["kind"], rec["dtype"], rec["shape"], rec["nbytes"]
    if kind not in KINDS:
        raise _bad(f"tensor {name!r}: kind {kind!r} is not one of {KINDS}", tensor=name)
    if not isinstance(dtype, str) or not dtype.isidentifier():
        raise _bad(f"tensor {name!r}: dtype {dtype!r} is not a dtype name", tensor=name)
    if kind == "numpy" and dtype not in NUMPY_DTYPES:
        raise _bad(f"tensor {name!r}: numpy dtype {dtype!r} is not one a checkpoint holds", tensor=name)
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise _bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers", tensor=name)
    if not _is_int(nbytes) or nbytes < 0:
        raise _bad(f"tensor {name!r}: nbytes {nbytes!r} is not a non-negative integer", tensor=name)
    return TensorRecord(name, shard, kind, dtype, tuple(shape), nbytes, _check_hash(rec["xxh3_64"], f"tensor {name!r}"))


# -- structure ------------------------------------------------------------------------------------------------


def _walk(node: Any, tensors: Mapping[str, TensorRecord], depth: int) -> Iterator[str]:
    """Validate a structure node; yield the tensor names it refers to."""
    if depth > 10_000:
        raise _bad("structure is nested too deeply")
    if node is None or isinstance(node, (bool, int, str)):
        return
    if isinstance(node, list):
        for item in node:
            yield from _walk(item, tensors, depth + 1)
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise _bad(f"structure node {_short(node)} is not a tagged value")
    ((tag, value),) = node.items()
    if tag not in _TAGS:
        raise _bad(f"structure node has the unknown tag {tag!r}")
    if tag in ("tensor", "npscalar"):
        if not isinstance(value, str) or value not in tensors:
            raise _bad(f"structure refers to tensor {value!r}, which the manifest does not list")
        yield value
    elif tag in ("float", "bytes", "dtype"):
        if not isinstance(value, str):
            raise _bad(f"structure {tag} node {_short(value)} is not a string")
    elif tag in ("tuple", "size"):
        if not isinstance(value, list):
            raise _bad(f"structure {tag} node is not a list")
        yield from _walk(value, tensors, depth + 1)
    else:  # dict, odict
        if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
            raise _bad(f"structure {tag} node is not a list of [key, value] pairs")
        for k, v in value:
            yield from _walk(k, tensors, depth + 1)
            yield from _walk(v, tensors, depth + 1)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
