"""Helpers of the checkpoint tests: dtype lists, random tensors of any dtype, bit-exact comparison.

A module of its own, not ``conftest``: ``from conftest import ...`` finds whichever test folder's conftest was
imported first when one pytest run collects several folders.
"""

from __future__ import annotations

import torch

from sfstore.testing.checkpoint_crash import states_equal

# Every torch dtype a checkpoint holds. safetensors has a name for all of these but complex128/complex32
# (stored as [..., 2] float64/float16 pairs) and torch's bit-container/shell dtypes (stored as raw U8).
SAFETENSORS_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
]
EXTRA_DTYPES = [torch.complex128, torch.complex32, torch.bits8, torch.bits16, torch.uint4, torch.int4]
ALL_DTYPES = SAFETENSORS_DTYPES + EXTRA_DTYPES


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` with random bytes (any bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same(a: object, b: object) -> bool:
    return states_equal(a, b)
