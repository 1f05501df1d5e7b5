"""The checkpoint manifest, ``sfstore-manifest.json``: what is in a checkpoint and how to check it.

Schema (format version 3)::

    {
      "format": "sfstore-checkpoint",
      "version": 3,
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
                  "header_xxh3_64": "..."}],
      "manifest_xxh3_64": "..."                   # the manifest's own sum: always the last member
    }

A shard's ``xxh3_64`` covers the whole file, ``header_xxh3_64`` its safetensors header (the 8-byte length, the
JSON and its padding: everything before the first tensor byte). The tensors' sums and the header's cover every
byte of a shard once, so a load checks those and reads each byte once; the whole-file sum is for tools that
check a shard file on its own. A shard entry without ``header_xxh3_64`` (version 1; allowed in version 3 for
manifests made for shards written by other tools) has its whole-file sum checked on load instead.

``manifest_xxh3_64`` (version 3) covers everything else in the manifest, byte for byte: the non-tensor values
and nesting of the state dict, the metadata, the shard list and every sum. It is the object's last member,
written after the others (which ``json.dumps(..., indent=1)`` wrote) as exactly these 43 bytes: a comma, a
newline, a space, ``"manifest_xxh3_64": "<16 lowercase hex digits>"``, a newline and ``}``. The sum is the
xxh3-64 of the file with those 43 bytes replaced by a newline and ``}`` (the manifest as it was before its sum
was added). It is checked on the raw bytes before anything is parsed; a mismatch, a version 3 manifest without
it, or a sum member that is not the last is a :class:`~sfstore.errors.CorruptCheckpointError`. Versions 1 and 2
(no manifest sum) still load, and are listed, without a warning: their tensor bytes and shard headers keep
their sums; what they lack is this protection of the non-tensor values and metadata. The next ``save`` writes
version 3.

Nesting: a state dict (and the metadata) may nest containers (lists, tuples, dicts) at most :data:`MAX_DEPTH`
deep; a manifest whose JSON nests deeper than :data:`MAX_JSON_DEPTH` is refused before it is parsed, and the
structure is validated without recursion.

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

from sfstore.checkpoint.safetensors_format import json_depth_within, no_duplicate_keys, shape_problem
from sfstore.checksums import xxh3_64_hex
from sfstore.errors import CorruptCheckpointError, InvalidRequestError

__all__ = [
    "MANIFEST_NAME",
    "FORMAT",
    "VERSION",
    "READABLE_VERSIONS",
    "MAX_MANIFEST_BYTES",
    "MAX_DEPTH",
    "MAX_JSON_DEPTH",
    "SUM_KEY",
    "NUMPY_DTYPES",
    "TensorRecord",
    "ShardRecord",
    "Manifest",
    "check_plain_name",
    "encode_key",
]

MANIFEST_NAME = "sfstore-manifest.json"
FORMAT = "sfstore-checkpoint"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""Format versions this sfstore reads (it writes :data:`VERSION`)."""
MAX_MANIFEST_BYTES = 1 << 30
"""Largest manifest read, in bytes."""
SUM_KEY = "manifest_xxh3_64"
"""The member holding the manifest's own xxh3-64 (version 3 on)."""
MAX_DEPTH = 64
"""Deepest nesting of containers (lists, tuples, dicts; a dict's key counts as one level inside it) in a state
dict or in metadata that a checkpoint holds."""
MAX_JSON_DEPTH = 3 * MAX_DEPTH + 8
"""Deepest JSON nesting of a manifest read (a dict level of the structure is 3 JSON levels, plus a few for the
manifest's own objects)."""

_SUM_HEAD = b',\n "' + SUM_KEY.encode("ascii") + b'": "'
_SUM_TAIL = b'"\n}'
_SEAL_BYTES = len(_SUM_HEAD) + 16 + len(_SUM_TAIL)

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
_HEX_BYTES = frozenset(b"0123456789abcdef")


def _bad(message: str, tensor: str | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{MANIFEST_NAME}: {message}", shard=None, tensor=tensor)


def check_plain_name(name: object, what: str) -> str:
    """``name`` if it is a plain file name inside the checkpoint directory, else ``CorruptCheckpointError``."""
    if not isinstance(name, str) or not name:
        raise _bad(f"{what} {name!r} is not a file name")
    if "/" in name or "\x00" in name or name in (".", "..") or name.startswith("/"):
        raise _bad(f"{what} {name!r} escapes the checkpoint directory (only plain file names are allowed)")
    return name


def encode_key(key: object) -> str:
    """One component of a tensor name: ``str`` keys escaped (``~`` -> ``~0``, ``/`` -> ``~1``), others as text.

    Lone surrogates (text that is not UTF-8) are written as ``\\udc80`` escapes: safetensors headers are UTF-8.
    """
    text = key if isinstance(key, str) else repr(key) if not isinstance(key, int) else str(key)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
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
    read_version: int = VERSION
    """The format version it was read as (:meth:`to_json` always writes :data:`VERSION`)."""
    _by_shard: dict[str, list[TensorRecord]] = field(default_factory=dict, repr=False)

    @property
    def version(self) -> int:
        """The format version :meth:`to_json` writes: :data:`VERSION`."""
        return VERSION

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
        """The manifest as UTF-8 JSON (ASCII-escaped, so any string survives), sealed with its own sum (see the
        module docs)."""
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
            body = json.dumps(obj, ensure_ascii=True, allow_nan=False, indent=1).encode("ascii")
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"checkpoint metadata must be plain JSON (no nan/inf): {exc}") from None
        return seal(body)

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and validate a manifest; every problem is a :class:`~sfstore.errors.CorruptCheckpointError`.

        The manifest's own sum (version 3) is checked on ``raw`` before anything in it is parsed.
        """
        raw = bytes(raw)
        sealed = unseal(raw)
        if not json_depth_within(raw, MAX_JSON_DEPTH):
            raise _bad(f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
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
        if version >= 3:
            if sealed is None or obj.get(SUM_KEY) != sealed:
                raise _bad(f"a version {version} manifest must end with its {SUM_KEY} member, as sfstore writes it")
            expected.add(SUM_KEY)
        elif sealed is not None:
            raise _bad(f"a version {version} manifest has no {SUM_KEY}")
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
            # Version 3 allows shards without a header sum (other writers' shards); 2 requires it, 1 has none.
            optional = version >= 3 and isinstance(s, dict) and "header_xxh3_64" not in s
            keys = shard_keys - {"header_xxh3_64"} if optional else shard_keys
            if not isinstance(s, dict) or set(s) != keys:
                raise _bad(f"shard entry {_short(s)} must have exactly {', '.join(sorted(keys))}")
            name = check_plain_name(s["file"], "shard file")
            if name == MANIFEST_NAME or name in seen:
                raise _bad(f"shard file {name!r} is listed twice or names the manifest")
            seen.add(name)
            if not _is_int(s["size"]) or s["size"] < 0:
                raise _bad(f"shard {name!r}: size {s['size']!r} is not a non-negative integer")
            head = _check_hash(s["header_xxh3_64"], f"shard {name!r} header") if "header_xxh3_64" in s else None
            shards.append(ShardRecord(name, s["size"], _check_hash(s["xxh3_64"], f"shard {name!r}"), head))
        tensors_raw = obj["tensors"]
        if not isinstance(tensors_raw, dict):
            raise _bad("tensors is not a JSON object")
        tensors = {name: _tensor_record(name, rec, seen) for name, rec in tensors_raw.items()}
        man = cls(created, metadata, obj["structure"], tensors, shards, read_version=version)
        for _ in _walk(man.structure, tensors):
            pass
        return man


def seal(body: bytes) -> bytes:
    """``body`` (a JSON object's text ending in a newline and ``}``) with its :data:`SUM_KEY` member appended."""
    if not body.endswith(b"\n}"):
        raise InvalidRequestError("a manifest body must end with a newline and '}' (json.dumps with indent)")
    return body[:-2] + _SUM_HEAD + xxh3_64_hex(body).encode("ascii") + _SUM_TAIL


def unseal(raw: bytes) -> str | None:
    """The sum a sealed manifest ends with, checked against its other bytes; ``None`` when ``raw`` does not end
    in a sum member (versions 1 and 2). A sum that does not match is a ``CorruptCheckpointError``."""
    if len(raw) < _SEAL_BYTES + 2:
        return None
    tail = raw[-_SEAL_BYTES:]
    digest = tail[len(_SUM_HEAD) : len(_SUM_HEAD) + 16]
    if not (tail.startswith(_SUM_HEAD) and tail.endswith(_SUM_TAIL) and set(digest) <= _HEX_BYTES):
        return None
    want = digest.decode("ascii")
    got = xxh3_64_hex(raw[:-_SEAL_BYTES] + b"\n}")
    if got != want:
        raise _bad(f"checksum mismatch: the manifest's bytes have xxh3-64 {got}, its {SUM_KEY} says {want} "
                   f"(the manifest is corrupt; nothing in it is used)")
    return want


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_hash(value: object, where: str) -> str:
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
    if not isinstance(shard, str) or shard not in shards:
        check_plain_name(shard, f"tensor {name!r}: shard")
        raise _bad(f"tensor {name!r}: shard {shard!r} is not among the listed shards", tensor=name)
    kind, dtype, shape, nbytes = rec["kind"], rec["dtype"], rec["shape"], rec["nbytes"]
    if kind not in KINDS:
        raise _bad(f"tensor {name!r}: kind {kind!r} is not one of {KINDS}", tensor=name)
    if not isinstance(dtype, str) or not dtype.isidentifier():
        raise _bad(f"tensor {name!r}: dtype {dtype!r} is not a dtype name", tensor=name)
    if kind == "numpy" and dtype not in NUMPY_DTYPES:
        raise _bad(f"tensor {name!r}: numpy dtype {dtype!r} is not one a checkpoint holds", tensor=name)
    problem = shape_problem(shape)
    if problem is not None:
        raise _bad(f"tensor {name!r}: {problem}", tensor=name)
    if not _is_int(nbytes) or nbytes < 0:
        raise _bad(f"tensor {name!r}: nbytes {nbytes!r} is not a non-negative integer", tensor=name)
    return TensorRecord(name, shard, kind, dtype, tuple(shape), nbytes, _check_hash(rec["xxh3_64"], f"tensor {name!r}"))


# -- structure ------------------------------------------------------------------------------------------------


def _walk(root: Any, tensors: Mapping[str, TensorRecord]) -> Iterator[str]:
    """Validate a structure (without recursion: a hostile manifest cannot exhaust the stack); yield the tensor
    names it refers to, in order. Containers nest at most :data:`MAX_DEPTH` deep."""
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if node is None or isinstance(node, (bool, int, str)):
            continue
        if isinstance(node, list):
            children: list[Any] = node
        else:
            if not isinstance(node, dict) or len(node) != 1:
                raise _bad(f"structure node {_short(node)} is not a tagged value")
            ((tag, value),) = node.items()
            if tag not in _TAGS:
                raise _bad(f"structure node has the unknown tag {_short(tag)}")
            if tag in ("tensor", "npscalar"):
                if not isinstance(value, str) or value not in tensors:
                    raise _bad(f"structure refers to tensor {_short(value)}, which the manifest does not list")
                yield value
                continue
            if tag in ("float", "bytes", "dtype"):
                if not isinstance(value, str):
                    raise _bad(f"structure {tag} node {_short(value)} is not a string")
                continue
            if tag == "size":
                if not isinstance(value, list) or shape_problem(value) is not None:
                    raise _bad(f"structure size node {_short(value)} is not a torch.Size")
                continue
            if tag == "tuple":
                if not isinstance(value, list):
                    raise _bad(f"structure {tag} node is not a list")
                children = value
            else:  # dict, odict
                if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
                    raise _bad(f"structure {tag} node is not a list of [key, value] pairs")
                children = [x for pair in value for x in pair]
        if depth >= MAX_DEPTH:
            raise _bad(f"structure nests containers deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in reversed(children))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
