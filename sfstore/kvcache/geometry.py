"""The KV-cache geometry of a model, and the chained prefix keys of its token blocks."""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sfstore import errors

__all__ = ["KVGeometry", "DTYPE_SIZES", "DTYPE_ALIASES", "KEY_BYTES", "chained_keys", "dtype_name"]

# dtype name -> bytes per element (the names torch uses)
DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
DTYPE_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
    "i8": "int8", "u8": "uint8",
}
"""Other spellings of the :data:`DTYPE_SIZES` names (lower case): vLLM's ``--kv-cache-dtype fp8`` is e4m3."""


def dtype_name(dtype: Any) -> str:
    """The canonical name (a key of :data:`DTYPE_SIZES`) of ``dtype``: a name or alias (``"bf16"``,
    ``"bfloat16"``, ``"torch.bfloat16"``, ``"half"``, ``"fp8"``, any case), a ``torch.dtype`` or a numpy dtype (or
    type, ``np.float16``). Anything else is an :class:`~sfstore.errors.InvalidRequestError` listing the accepted
    names."""
    text: str | None = None
    if isinstance(dtype, str):
        text = dtype
    elif type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
        text = str(dtype)  # "torch.bfloat16"
    else:
        try:
            import numpy as np

            text = np.dtype(dtype).name if isinstance(dtype, (np.dtype, type)) else None
        except (ImportError, TypeError):
            text = None
    if text is not None:
        key = text.strip().lower()
        key = key[len("torch."):] if key.startswith("torch.") else key
        key = DTYPE_ALIASES.get(key, key)
        if key in DTYPE_SIZES:
            return key
    accepted = ", ".join([*DTYPE_SIZES, *DTYPE_ALIASES])
    raise errors.InvalidRequestError(
        f"KVGeometry.dtype {dtype!r} is not a KV-cache dtype sfstore stores; accepted: {accepted}, the torch "
        "dtypes of these names (torch.bfloat16, ...) and numpy dtypes (np.float16, ...)"
    )
KEY_BYTES = 32
MAX_BLOCK_BYTES = 1 << 30  # one block is one registered slot: far above any model's (MiBs), far below a host


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one model's KV cache: what one block of ``block_tokens`` tokens holds.

    A block is stored as ``[layer][kv][token][head][dim]`` (C order): ``num_layers`` layer slices of
    ``layer_shape`` each. ``kv`` is 2 (K and V) for most models, 1 for latent attention (MLA).

    ``dtype`` takes a name (``"bfloat16"``, ``"bf16"``, ``"fp16"``, ``"half"``, ``"float32"``, ``"fp8"``: see
    :data:`DTYPE_ALIASES`), a ``torch.dtype`` (``torch.bfloat16``) or a numpy dtype; it is kept as the canonical
    name (``geom.dtype == "bfloat16"``), so every spelling makes the same geometry and the same keys.
    """

    num_layers: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"  # any spelling dtype_name() takes; stored as the canonical name
    kv: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_tokens", "num_kv_heads", "head_dim", "kv"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise errors.InvalidRequestError(f"KVGeometry.{name} must be a positive int, not {v!r}")
        if self.kv not in (1, 2):
            raise errors.InvalidRequestError(f"KVGeometry.kv must be 1 (MLA) or 2 (K and V), not {self.kv}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))  # frozen: set once, here
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise errors.InvalidRequestError(
                f"KVGeometry: a block of {self.block_shape} {self.dtype} is {self.block_bytes} bytes; at most "
                f"{MAX_BLOCK_BYTES} (1 GiB) fit a pinned slot"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's slice of a block: ``(kv, block_tokens, num_kv_heads, head_dim)``."""
        return (self.kv, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, *self.layer_shape)

    @property
    def layer_elements(self) -> int:
        return self.kv * self.block_tokens * self.num_kv_heads * self.head_dim

    @property
    def block_elements(self) -> int:
        """Elements of one block (``num_layers * layer_elements``)."""
        return self.num_layers * self.layer_elements

    @property
    def layer_bytes(self) -> int:
        return self.layer_elements * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def fingerprint(self) -> bytes:
        """16 bytes naming this geometry (stored with every block, checked on every read)."""
        text = f"{self.num_layers}/{self.kv}/{self.block_tokens}/{self.num_kv_heads}/{self.head_dim}/{self.dtype}"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _token_bytes(tokens: Any) -> bytes:
    if hasattr(tokens, "tolist"):  # numpy arrays, torch tensors
        tokens = tokens.tolist()
    try:
        return array.array("q", tokens).tobytes()
    except (TypeError, OverflowError) as exc:
        raise errors.InvalidRequestError(f"token ids must be a sequence of ints: {exc}") from None


def chained_keys(
    tokens: Sequence[int] | Any, block_tokens: int, namespace: bytes, extra: Iterable[Any] = ()
) -> list[bytes]:
    """One key per *full* block of ``block_tokens`` tokens; a block's key depends on every token before it.

    ``key[0] = H(H(namespace, extra) + tokens[0:B])``, ``key[i] = H(key[i-1] + tokens[iB:(i+1)B])`` with H the
    32-byte BLAKE2b, as vLLM and LMCache chain their prefix hashes. ``namespace`` names the model and geometry;
    ``extra`` (adapter ids, multimodal hashes, ...) is folded into the first block, so it changes every key.
    """
    raw = _token_bytes(tokens)
    per = block_tokens * 8
    try:
        folded = repr(tuple(extra)).encode()
    except (TypeError, UnicodeEncodeError) as exc:
        raise errors.InvalidRequestError(f"extra must be an iterable of printable values: {exc}") from None
    seed = hashlib.blake2b(namespace + b"\0" + folded, digest_size=KEY_BYTES).digest()
    keys = []
    prev = seed
    for i in range(len(raw) // per):
        prev = hashlib.blake2b(prev + raw[i * per:(i + 1) * per], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys
