"""``sf://`` on a filesystem that enforces O_DIRECT alignment (ext4 on a loop device with 4096-byte sectors).

Odd sizes, offsets and ranges must still come back exact: the engine moves aligned parts directly and
misaligned heads and tails through bounce buffers. Needs root for the loop device (skipped with the reason).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from sfstore.fs import SFFileSystem

pytestmark = pytest.mark.root


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def dfs(dio_dir: Path) -> SFFileSystem:
    fs = SFFileSystem(root=str(dio_dir / "root"), skip_instance_cache=True)
    assert fs.file_path.direct, fs.file_path.describe()["fallbacks"]
    return fs


def test_unaligned_reads_and_writes_are_exact(dfs: SFFileSystem, tmp_path: Path) -> None:
    data = _data(3 * 4096 * 7 + 123, 1)
    dfs.pipe_file("odd.bin", data)
    assert dfs.cat_file("odd.bin") == data
    assert dfs.cat_file("odd.bin", 4095, 8193) == data[4095:8193]
    starts = [0, 1, 4096, 5000, 20000, len(data) - 10]
    ends = [1, 4097, 4200, 12000, 20001, len(data)]
    assert dfs.cat_ranges(["odd.bin"] * 6, starts, ends) == [data[s:e] for s, e in zip(starts, ends, strict=True)]
    arr = np.zeros(10000, np.uint8)
    assert dfs.read_into("odd.bin", arr[3:], offset=777, length=9000) == 9000
    assert arr[3:9003].tobytes() == data[777:9777]
    with dfs.open("odd.bin", "rb", block_size=8192) as f:
        f.seek(3)
        assert b"".join(iter(lambda: f.read(1001), b"")) == data[3:]
    with dfs.open("w.bin", "wb") as f:
        for k in range(0, len(data), 5555):
            f.write(data[k: k + 5555])
    with dfs.open("w.bin", "ab") as f:
        f.write(b"tail")
    assert dfs.cat_file("w.bin") == data + b"tail"
    many = {f"small/{i}": _data(100 + 511 * i, i) for i in range(12)}
    dfs.pipe(many)
    assert dfs.cat(sorted(many)) == many
    local = tmp_path / "in.bin"
    local.write_bytes(data)
    dfs.put_file(str(local), "put.bin")
    dfs.cp_file("put.bin", "cp.bin")
    out = io.BytesIO()
    dfs.get_file("cp.bin", out)
    assert out.getvalue() == data
    assert dfs.counters.snapshot()["bytes_direct"] > 0
