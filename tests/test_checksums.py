"""sfstore.checksums: the one xxh3-64 of every layer agrees with python-xxhash, as int and as manifest hex."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from sfstore.checksums import xxh3_64, xxh3_64_hex


@pytest.mark.parametrize("n", [0, 1, 17, 4096, 64 << 10, (1 << 20) + 3])
def test_agrees_with_python_xxhash(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert xxh3_64(data) == xxhash.xxh3_64_intdigest(data.tobytes())
    assert xxh3_64_hex(memoryview(data)) == xxhash.xxh3_64_hexdigest(data.tobytes())


def test_hex_keeps_leading_zeros() -> None:
    # find an input whose sum starts with a zero nibble: the hex form must still be 16 digits
    i = next(i for i in range(10_000) if xxhash.xxh3_64_intdigest(str(i).encode()) < 1 << 60)
    got = xxh3_64_hex(str(i).encode())
    assert len(got) == 16 and got.startswith("0") and got == xxhash.xxh3_64_hexdigest(str(i).encode())
