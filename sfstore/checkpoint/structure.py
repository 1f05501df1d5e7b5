"""A state dict's nesting as JSON, and back: no pickle, exact round trips (see :mod:`.manifest` for the tags).

:func:`flatten` turns a nested state dict into a JSON-able structure and the list of its tensor leaves (torch
tensors, numpy arrays and numpy scalars), each with a unique name and its key path. :func:`unflatten` rebuilds
the nesting from the structure, asking a callback for each tensor.
"""

from __future__ import annotations

import base64
import collections
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sfstore.checkpoint import safetensors_format as stf
from sfstore.checkpoint.manifest import MAX_DEPTH, NUMPY_DTYPES, encode_key
from sfstore.errors import CorruptCheckpointError, InvalidRequestError

__all__ = ["Leaf", "flatten", "unflatten", "tensor_paths", "format_path", "check_metadata"]

KeyPath = tuple[Any, ...]

_SUPPORTED = (
    "torch tensors, numpy arrays and scalars, None, bool, int, float, str, bytes, torch.dtype, torch.Size, "
    "and lists, tuples, dicts (keys: None, bool, int, float, str, bytes or tuples of them) of these"
)


@dataclass
class Leaf:
    """One tensor of a state dict: its name, key path, kind (``"torch"``/``"numpy"``) and the value.

    ``value`` is a torch tensor (numpy arrays are wrapped with ``torch.from_numpy``, no copy); ``dtype`` is
    the real dtype's name (torch's or numpy's; the same for every numpy dtype a checkpoint holds).
    """

    name: str
    path: KeyPath
    kind: str
    value: Any
    dtype: str


def format_path(path: KeyPath) -> str:
    """A key path as text (``"optimizer/state/0/exp_avg"``)."""
    return "/".join(encode_key(k) for k in path) or "(root)"


def flatten(state: Any) -> tuple[Any, list[Leaf]]:
    """The JSON structure of ``state`` and its tensor leaves (in traversal order).

    The same tensor object reached twice is stored once (both places load as one tensor). Raises
    :class:`~sfstore.errors.InvalidRequestError` naming the key path for anything that cannot be stored
    without pickling, for reference cycles, and for containers nested deeper than
    :data:`~sfstore.checkpoint.manifest.MAX_DEPTH` (the recursion is bounded by that depth).
    """
    import torch

    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        np = None  # type: ignore[assignment]

    leaves: list[Leaf] = []
    used: set[str] = {"__metadata__"}
    by_id: dict[int, str] = {}
    keep: list[Any] = []  # keeps ids stable while flattening
    active: set[int] = set()

    def unique(path: KeyPath) -> str:
        base = format_path(path)
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}~{n}"
        used.add(name)
        return name

    def leaf(value: Any, path: KeyPath, kind: str, dtype: str, original: Any) -> str:
        known = by_id.get(id(original))
        if known is not None:
            return known
        name = unique(path)
        by_id[id(original)] = name
        keep.append(original)
        leaves.append(Leaf(name, path, kind, value, dtype))
        return name

    def array(x: Any, path: KeyPath) -> tuple[Any, str]:
        if not x.dtype.isnative:
            x = x.astype(x.dtype.newbyteorder("="))
        if x.dtype.name not in NUMPY_DTYPES:
            raise InvalidRequestError(
                f"cannot save a numpy array of dtype {x.dtype} at {format_path(path)}: "
                f"supported numpy dtypes are {', '.join(NUMPY_DTYPES)}"
            )
        if not x.flags.c_contiguous:
            x = x.copy(order="C")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only arrays: we never write through this view
            return torch.from_numpy(x), x.dtype.name

    def too_deep(path: KeyPath) -> InvalidRequestError:
        return InvalidRequestError(
            f"the state dict nests containers deeper than {MAX_DEPTH} levels at {format_path(path)} "
            f"(a checkpoint holds at most {MAX_DEPTH})"
        )

    def enc(x: Any, path: KeyPath, depth: int, key: bool = False) -> Any:
        t = type(x)
        if x is None or t is bool or t is int or t is str:
            return x
        if t is float:
            return {"float": repr(x)}
        if t is bytes:
            return {"bytes": base64.b64encode(x).decode("ascii")}
        if isinstance(x, torch.dtype):
            return {"dtype": stf.torch_dtype_name(x)}
        if t is tuple:
            if depth >= MAX_DEPTH:
                raise too_deep(path)
            return {"tuple": [enc(v, (*path, i), depth + 1, key) for i, v in enumerate(x)]}
        if key:
            raise InvalidRequestError(
                f"cannot save a dict key of type {t.__qualname__} at {format_path(path)}: keys may be None, "
                f"bool, int, float, str, bytes, torch.dtype or tuples of these"
            )
        if isinstance(x, torch.Tensor):
            return {"tensor": leaf(x, path, "torch", stf.torch_dtype_name(x.dtype), x)}
        if np is not None and t is np.ndarray:
            value, dtype = array(x, path)
            return {"tensor": leaf(value, path, "numpy", dtype, x)}
        if np is not None and isinstance(x, np.generic):
            value, dtype = array(np.asarray(x), path)
            return {"npscalar": leaf(value, path, "numpy", dtype, value)}
        if isinstance(x, torch.Size):
            return {"size": [int(v) for v in x]}  # a leaf: a list of ints, nothing nests inside
        if t is list or isinstance(x, Mapping):
            if id(x) in active:
                raise InvalidRequestError(f"the state dict contains itself at {format_path(path)} (a cycle)")
            if depth >= MAX_DEPTH:
                raise too_deep(path)
            active.add(id(x))
            try:
                if t is list:
                    return [enc(v, (*path, i), depth + 1) for i, v in enumerate(x)]
                pairs = [[enc(k, (*path, k), depth + 1, key=True), enc(v, (*path, k), depth + 1)]
                         for k, v in x.items()]
            finally:
                active.discard(id(x))
            return {"odict" if isinstance(x, collections.OrderedDict) else "dict": pairs}
        raise InvalidRequestError(f"cannot save a {t.__qualname__} at {format_path(path)}: supported are {_SUPPORTED}")

    try:
        tree = enc(state, (), 0)
    except RecursionError:
        raise InvalidRequestError("the state dict is nested too deeply to save") from None
    finally:
        # A recursive closure is a reference cycle (function -> cell -> function): without this it keeps the
        # caller's tensors alive until a gc pass.
        enc = None  # type: ignore[assignment]
    return tree, leaves


def check_metadata(metadata: Any) -> dict[str, Any]:
    """``metadata`` as the plain JSON object a manifest stores, checked without recursion.

    Raises :class:`~sfstore.errors.InvalidRequestError` naming the key path for what would not come back as it
    was given: keys that are not ``str`` (JSON would turn them into strings), tuples (they would come back as
    lists), nan/inf, values of other types, and containers nested deeper than
    :data:`~sfstore.checkpoint.manifest.MAX_DEPTH`.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidRequestError(f"metadata must be a mapping, not {type(metadata).__name__}")
    out = dict(metadata)
    stack: list[tuple[Any, KeyPath, int]] = [(out, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        where = f"metadata at {format_path(path)}"
        if value is None or isinstance(value, (bool, int, str)):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidRequestError(f"{where}: {value!r}; checkpoint metadata must be plain JSON (no nan/inf)")
            continue
        if depth >= MAX_DEPTH:
            raise InvalidRequestError(f"{where}: containers nest deeper than {MAX_DEPTH} levels")
        if type(value) is list:
            stack.extend((v, (*path, i), depth + 1) for i, v in enumerate(value))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise InvalidRequestError(
                        f"{where}: the key {k!r} is a {type(k).__name__}; checkpoint metadata is plain JSON, its "
                        "keys are str (the state dict itself keeps other keys)"
                    )
                stack.append((v, (*path, k), depth + 1))
        else:
            raise InvalidRequestError(
                f"{where}: a {type(value).__name__}; checkpoint metadata is plain JSON (None, bool, int, float, "
                "str, lists and str-keyed dicts; the state dict itself keeps tuples and other values)"
            )
    return out


def _bad(message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"sfstore-manifest.json: {message}")


def _leaf_value(tag: str, value: str) -> Any:
    if tag == "float":
        try:
            out = float(value)
        except ValueError:
            raise _bad(f"float node {value!r} is not a float") from None
        if math.isnan(out) and value.lstrip("-+") != "nan":
            raise _bad(f"float node {value!r} is not a float")
        return out
    if tag == "bytes":
        try:
            return base64.b64decode(value.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise _bad("bytes node is not base64") from None
    try:
        return stf.torch_dtype(value)
    except InvalidRequestError as exc:
        raise _bad(str(exc)) from None


def unflatten(structure: Any, tensor: Callable[[str, str, KeyPath], Any]) -> Any:
    """Rebuild the state dict from a (validated) structure.

    ``tensor(tag, name, path)`` returns the value of each ``{"tensor": name}`` / ``{"npscalar": name}`` node
    (``tag`` is ``"tensor"`` or ``"npscalar"``). Malformed nodes raise
    :class:`~sfstore.errors.CorruptCheckpointError`.
    """

    def dec(node: Any, path: KeyPath) -> Any:
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, list):
            return [dec(v, (*path, i)) for i, v in enumerate(node)]
        if not isinstance(node, dict) or len(node) != 1:
            raise _bad("a structure node is not a tagged value")
        ((tag, value),) = node.items()
        if tag in ("tensor", "npscalar"):
            return tensor(tag, value, path)
        if tag in ("float", "bytes", "dtype"):
            return _leaf_value(tag, value)
        if tag == "tuple":
            return tuple(dec(v, (*path, i)) for i, v in enumerate(value))
        if tag == "size":
            import torch

            if not isinstance(value, list) or stf.shape_problem(value) is not None:
                raise _bad("a torch.Size node holds something other than sizes")
            return torch.Size(value)
        if tag in ("dict", "odict"):
            out: dict[Any, Any] = collections.OrderedDict() if tag == "odict" else {}
            for k, v in value:
                kk = dec(k, path)
                try:
                    hash(kk)
                except TypeError:
                    raise _bad(f"a dict key at {format_path(path)} is not hashable") from None
                out[kk] = dec(v, (*path, kk))
            return out
        raise _bad(f"unknown structure tag {tag!r}")

    try:
        return dec(structure, ())
    except RecursionError:
        raise _bad("structure is nested too deeply") from None
    finally:
        # As in flatten: break the recursive closure's cycle, which would keep the loaded tensors (and the shard
        # buffers under them) alive until a gc pass.
        dec = None  # type: ignore[assignment]


def tensor_paths(structure: Any) -> list[tuple[KeyPath, str, str]]:
    """``(key path, tag, name)`` of every tensor node of a structure, in order."""
    out: list[tuple[KeyPath, str, str]] = []

    def record(tag: str, name: str, path: KeyPath) -> None:
        out.append((path, tag, name))

    unflatten(structure, record)
    return out
