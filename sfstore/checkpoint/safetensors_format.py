"""A strict reader and writer of the safetensors layout, and the dtype table between it and torch.

The layout (https://github.com/huggingface/safetensors): 8 bytes little-endian ``N``, ``N`` bytes of UTF-8 JSON
(padded with spaces), then the data. The JSON object maps each tensor name to
``{"dtype": "BF16", "shape": [2, 3], "data_offsets": [begin, end]}`` (offsets relative to the start of the
data) and may hold ``"__metadata__": {str: str}``. Tensors cover the data exactly, without gaps or overlaps.

:func:`parse_header` checks every rule the ``safetensors`` package checks (and a few more), and reports each
violation as :class:`~sfstore.errors.CorruptCheckpointError` naming the shard and, where known, the tensor:
never ``IndexError``, ``MemoryError`` or a read past the end of the bytes it was given. The header length is
checked against :data:`MAX_HEADER_BYTES` and the file size *before* anything is allocated for it.

:func:`build_header` writes the header sfstore's shards use: the same layout, with the JSON padded so that the
data starts on a :data:`DATA_ALIGNMENT` boundary, and tensors ordered by alignment (largest first), so each
tensor's bytes are aligned to its element size inside a page-aligned buffer and can be viewed in place.

Dtypes: :data:`DTYPES` lists every dtype safetensors 0.8 knows, with its bit width and the torch dtype it
reads as (``None`` for the 6-bit float formats, which torch lacks). :func:`stored_form` says how a torch
dtype is stored: directly where safetensors has the dtype (``float4_e2m1fn_x2`` as ``F4`` with the last
dimension doubled, as ``safetensors.torch`` writes it); ``complex128`` and ``complex32`` (which safetensors
cannot hold) as their real and imaginary parts, ``F64``/``F16`` with a trailing dimension of 2; torch's
bit-container and shell dtypes (``bits8``, ``uint4``, ...) as raw ``U8`` bytes. The manifest records the
real dtype, so sfstore reads all of them back exactly, and ``safetensors.torch.load_file`` reads every
shard (complex128 as its ``[..., 2]`` float64 pairs).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from sfstore.errors import CorruptCheckpointError, InvalidRequestError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_HEADER_BYTES",
    "DATA_ALIGNMENT",
    "DType",
    "DTYPES",
    "Entry",
    "Header",
    "header_length",
    "parse_header",
    "build_header",
    "stored_form",
    "torch_dtype",
    "torch_dtype_name",
    "st_to_torch",
    "entry_nbytes",
    "MAX_DIM",
    "shape_problem",
    "json_depth_within",
]

MAX_HEADER_BYTES = 100 << 20
"""Largest header (JSON) length accepted, in bytes (the ``safetensors`` package allows 100 MB)."""

DATA_ALIGNMENT = 4096
"""sfstore's shards pad the header so that the data starts at a multiple of this (a page)."""

MAX_DIM = (1 << 63) - 1
"""Largest dimension, and largest product of a shape's dimensions (zeros counted as one), accepted: what torch's
int64 sizes, element counts and strides hold."""

MAX_HEADER_DEPTH = 4
"""Deepest JSON nesting a safetensors header may have (it has 3: the object, an entry, its shape)."""

_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_METADATA = "__metadata__"


@dataclass(frozen=True)
class DType:
    """One safetensors dtype: its name in headers, its width in bits and the torch dtype it reads as."""

    name: str
    bits: int
    torch_name: str | None


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 8, "bool"),
        DType("U8", 8, "uint8"),
        DType("I8", 8, "int8"),
        DType("F8_E5M2", 8, "float8_e5m2"),
        DType("F8_E4M3", 8, "float8_e4m3fn"),
        DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
        DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
        DType("F8_E8M0", 8, "float8_e8m0fnu"),
        DType("F4", 4, "float4_e2m1fn_x2"),
        DType("F6_E2M3", 6, None),
        DType("F6_E3M2", 6, None),
        DType("I16", 16, "int16"),
        DType("U16", 16, "uint16"),
        DType("F16", 16, "float16"),
        DType("BF16", 16, "bfloat16"),
        DType("I32", 32, "int32"),
        DType("U32", 32, "uint32"),
        DType("F32", 32, "float32"),
        DType("C64", 64, "complex64"),
        DType("F64", 64, "float64"),
        DType("I64", 64, "int64"),
        DType("U64", 64, "uint64"),
    )
}
"""Every dtype of the safetensors format (0.8), by header name."""

_BY_TORCH = {d.torch_name: d.name for d in DTYPES.values() if d.torch_name is not None}
# torch dtypes safetensors has no name for, stored as (safetensors dtype, trailing dimension).
_AS_PAIRS = {"complex128": "F64", "complex32": "F16"}


@dataclass(frozen=True)
class Entry:
    """One tensor of a header: name, safetensors dtype, shape, and ``[begin, end)`` relative to the data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated header: entries in data order, the user metadata, and where the data starts."""

    entries: dict[str, Entry]
    metadata: dict[str, str] | None
    header_len: int
    data_start: int
    file_size: int


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def shape_problem(shape: object) -> str | None:
    """Why ``shape`` is not a shape torch can hold, or ``None``: it must be a list of integers in
    ``[0, MAX_DIM]`` whose product (zeros counted as one, as torch's strides count them) is at most
    :data:`MAX_DIM`."""
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        return f"shape {_short(shape)} is not a list of non-negative integers"
    product = 1
    for s in shape:
        if s > MAX_DIM:
            return f"shape {_short(shape)} has a dimension of {s}, more than the {MAX_DIM} torch holds"
        product *= max(s, 1)
        if product > MAX_DIM:
            return f"shape {_short(shape)} has more than {MAX_DIM} elements (or strides past that)"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


_JSON_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_JSON_PAIRS = re.compile(rb"\[\]|\{\}")


def json_depth_within(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects at most ``limit`` deep (checked without recursion,
    so that ``json.loads`` is never handed a document deep enough to exhaust the stack). Text that is not JSON
    may pass: ``json.loads`` then reports it."""
    brackets = _JSON_STRINGS.sub(b"", raw).translate(None, _JSON_NOT_BRACKETS)
    for done in range(limit):
        if not brackets:
            return True
        shorter = _JSON_PAIRS.sub(b"", brackets)
        if len(shorter) == len(brackets):
            # Unbalanced (not JSON): the deepest point is at most what is left plus the levels removed.
            return len(brackets) + done <= limit
        brackets = shorter
    return not brackets


def entry_nbytes(dtype: str, shape: Sequence[int]) -> int | None:
    """Bytes a tensor of ``dtype`` and ``shape`` takes, or ``None`` when it is not a whole number of bytes."""
    bits = _numel(shape) * DTYPES[dtype].bits
    return None if bits % 8 else bits // 8


def header_length(prefix: Any, file_size: int, *, shard: str, limit: int = MAX_HEADER_BYTES) -> int:
    """The header length ``N`` in the first 8 bytes of ``prefix``, checked against ``limit`` and the file size.

    Raises :class:`~sfstore.errors.CorruptCheckpointError` when the file is shorter than 8 bytes, or ``N``
    exceeds ``limit`` or what the file holds after the 8 length bytes.
    """
    if file_size < 8:
        raise CorruptCheckpointError(
            f"shard {shard}: {file_size} bytes is too short for a safetensors header", shard=shard
        )
    with memoryview(prefix) as mv:
        if mv.nbytes < 8:
            raise CorruptCheckpointError(f"shard {shard}: fewer than 8 header bytes were read", shard=shard)
        (n,) = struct.unpack_from("<Q", mv.cast("B"), 0)
    if n > limit:
        raise CorruptCheckpointError(
            f"shard {shard}: safetensors header length {n} exceeds the limit of {limit} bytes", shard=shard
        )
    if n > file_size - 8:
        raise CorruptCheckpointError(
            f"shard {shard}: safetensors header length {n} exceeds the {file_size - 8} bytes after the length "
            f"field (truncated file, or a header that lies about its size)",
            shard=shard,
        )
    if n < 2:
        raise CorruptCheckpointError(f"shard {shard}: safetensors header length {n} is too short", shard=shard)
    return int(n)


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` object hook: a JSON object that repeats a key is an error, not "last one wins"."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"non-standard JSON constant {name}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(data: Any, file_size: int, *, shard: str, limit: int = MAX_HEADER_BYTES) -> Header:
    """Validate the safetensors header at the start of ``data`` (a file of ``file_size`` bytes).

    Parameters
    ----------
    data : bytes-like
        At least the first ``8 + N`` bytes of the file (the whole file is fine: nothing is copied but the
        header).
    file_size : int
        Size of the whole file; the entries must cover ``file_size - 8 - N`` data bytes exactly.
    shard : str
        The file's name, for error messages.
    limit : int
        Largest header length accepted.

    Returns
    -------
    Header
        Entries in data order (by offset).

    Raises
    ------
    sfstore.errors.CorruptCheckpointError
        Any violation: length, UTF-8, JSON (incl. duplicate keys), entry fields, unknown dtype, a byte size
        that does not match dtype and shape, offsets out of bounds, overlapping, leaving gaps or not
        covering the data exactly.
    """
    n = header_length(data, file_size, shard=shard, limit=limit)
    with memoryview(data) as mv:
        flat = mv.cast("B")
        if flat.nbytes < 8 + n:
            raise CorruptCheckpointError(f"shard {shard}: only {flat.nbytes} of {8 + n} header bytes", shard=shard)
        raw = bytes(flat[8 : 8 + n])
        flat.release()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"shard {shard}: safetensors header is not UTF-8 ({exc})", shard=shard) from None
    if not text.startswith("{"):
        raise CorruptCheckpointError(f"shard {shard}: safetensors header does not start with '{{'", shard=shard)
    if not json_depth_within(raw, MAX_HEADER_DEPTH):
        raise CorruptCheckpointError(
            f"shard {shard}: safetensors header nests deeper than {MAX_HEADER_DEPTH} levels", shard=shard
        )
    try:
        obj = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"shard {shard}: safetensors header is not valid JSON ({exc})", shard=shard
        ) from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"shard {shard}: safetensors header is not a JSON object", shard=shard)
    metadata = obj.pop(_METADATA, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CorruptCheckpointError(f"shard {shard}: __metadata__ must map strings to strings", shard=shard)
    entries: list[Entry] = []
    for name, info in obj.items():
        entries.append(_parse_entry(name, info, shard))
    entries.sort(key=lambda e: (e.begin, e.end))
    data_len = file_size - 8 - n
    pos = 0
    for e in entries:
        if e.begin != pos:
            what = "overlaps the previous tensor" if e.begin < pos else f"leaves a gap of {e.begin - pos} bytes"
            raise CorruptCheckpointError(
                f"shard {shard}: tensor {e.name!r} at data offset {e.begin} {what} (expected offset {pos})",
                shard=shard,
                tensor=e.name,
            )
        if e.end > data_len:
            raise CorruptCheckpointError(
                f"shard {shard}: tensor {e.name!r} ends at data offset {e.end}, past the {data_len} data bytes "
                f"of the file (truncated, or offsets out of bounds)",
                shard=shard,
                tensor=e.name,
            )
        pos = e.end
    if pos != data_len:
        raise CorruptCheckpointError(
            f"shard {shard}: tensors cover {pos} bytes but the file holds {data_len} data bytes", shard=shard
        )
    return Header({e.name: e for e in entries}, metadata, n, 8 + n, file_size)


def _parse_entry(name: str, info: Any, shard: str) -> Entry:
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"shard {shard}: tensor {name!r}: {why}", shard=shard, tensor=name)

    if not isinstance(info, dict):
        raise bad("entry is not a JSON object")
    if set(info) != _ENTRY_KEYS:
        raise bad(f"entry keys are {sorted(info)}, expected {sorted(_ENTRY_KEYS)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r}")
    problem = shape_problem(shape)
    if problem is not None:
        raise bad(problem)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise bad(f"data_offsets {offsets!r} is not a pair of non-negative integers")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets {offsets!r} end before they begin")
    want = entry_nbytes(dtype, shape)
    if want is None:
        raise bad(f"{dtype} tensor of shape {shape} is not a whole number of bytes")
    if want != end - begin:
        raise bad(f"{dtype} tensor of shape {shape} takes {want} bytes but its offsets span {end - begin}")
    return Entry(name, dtype, tuple(shape), begin, end)


def build_header(
    entries: Sequence[tuple[str, str, Sequence[int], int]],
    metadata: dict[str, str] | None = None,
    *,
    align: int = DATA_ALIGNMENT,
) -> tuple[bytes, list[tuple[int, int]]]:
    """The header bytes (length field, JSON, padding) for tensors laid out in the given order.

    Parameters
    ----------
    entries : sequence of (name, safetensors dtype, shape, nbytes)
        In data order; each tensor's bytes follow the previous one's.
    metadata : dict of str to str, optional
        ``__metadata__``.
    align : int
        Pad the JSON with spaces so that the data starts at a multiple of ``align`` (8 at least).

    Returns
    -------
    tuple
        ``(header, offsets)``: ``len(header)`` is where the data starts; ``offsets[i]`` is ``(begin, end)``
        of entry ``i`` relative to it.
    """
    obj: dict[str, Any] = {}
    if metadata:
        obj[_METADATA] = dict(metadata)
    offsets: list[tuple[int, int]] = []
    pos = 0
    for name, dtype, shape, nbytes in entries:
        if name == _METADATA or name in obj:
            raise InvalidRequestError(f"tensor name {name!r} is reserved or repeated")
        obj[name] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [pos, pos + nbytes]}
        offsets.append((pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    step = max(8, align)
    total = -(-(8 + len(text)) // step) * step
    n = total - 8
    return struct.pack("<Q", n) + text + b" " * (n - len(text)), offsets


# -- torch ----------------------------------------------------------------------------------------------------


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``); :class:`~sfstore.errors.InvalidRequestError` if none."""
    import torch

    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise InvalidRequestError(f"torch {torch.__version__} has no dtype {name!r}")
    return d


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).rsplit(".", 1)[-1]


def stored_form(dtype_name: str, shape: Sequence[int], itemsize: int) -> tuple[str, list[int]]:
    """How a torch tensor of ``dtype_name``/``shape`` is stored: ``(safetensors dtype, safetensors shape)``.

    The bytes are the tensor's bytes in every case; only the header's description differs (see the module
    docs). ``itemsize`` is the torch element size in bytes.
    """
    dims = [int(s) for s in shape]
    if dtype_name == "float4_e2m1fn_x2":
        # safetensors counts 4-bit elements: two per byte, the last dimension doubled; a 0-d tensor
        # (one byte) has no such form and is stored as a raw byte.
        return ("F4", [*dims[:-1], dims[-1] * 2]) if dims else ("U8", [])
    st = _BY_TORCH.get(dtype_name)
    if st is not None:
        return st, dims
    if dtype_name in _AS_PAIRS:
        return _AS_PAIRS[dtype_name], [*dims, 2]
    return "U8", dims if itemsize == 1 else [*dims, itemsize]


def st_to_torch(entry: Entry) -> tuple[str, tuple[int, ...]]:
    """The torch dtype name and shape a plain safetensors entry reads as (what ``safetensors.torch`` gives)."""
    name = DTYPES[entry.dtype].torch_name
    if name is None:
        raise InvalidRequestError(
            f"tensor {entry.name!r} has dtype {entry.dtype}, which torch has no dtype for; it cannot be loaded"
        )
    if entry.dtype == "F4":
        if not entry.shape or entry.shape[-1] % 2:
            raise CorruptCheckpointError(
                f"F4 tensor {entry.name!r} of shape {list(entry.shape)}: the last dimension must be even",
                tensor=entry.name,
            )
        return name, (*entry.shape[:-1], entry.shape[-1] // 2)
    return name, entry.shape
