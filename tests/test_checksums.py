"""sfstore.checksums: the one xxh3-64 of every layer agrees with python-xxhash, as int and as manifest hex."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from sfstore.checksums import xxh3_64, xxh3_64_hex, xxh3_64_many
from sfstore.errors import InvalidRequestError


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


def test_many_agrees_with_one_by_one() -> None:
    rng = np.random.default_rng(7)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 4096, 64 << 10, (1 << 20) + 3)]
    bufs.append(memoryview(bytearray(b"abc")))
    assert xxh3_64_many(bufs) == [xxhash.xxh3_64_intdigest(bytes(b)) for b in bufs]
    assert xxh3_64_many([]) == []


def test_many_refuses_what_is_not_a_contiguous_buffer() -> None:
    native = pytest.importorskip("sfstore._native")
    if not native.xxh3_available():
        pytest.skip("this build of the native helper has no xxh3")
    with pytest.raises(InvalidRequestError, match="source 1 is not a contiguous buffer"):
        native.xxh3_64_many([b"ok", np.zeros(8)[::2]])
    with pytest.raises(InvalidRequestError, match="sources must be a sequence"):
        native.xxh3_64_many(5)
