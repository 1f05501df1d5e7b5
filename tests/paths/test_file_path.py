"""FilePath on the local filesystem: the conformance suite, mount facts, and O_DIRECT on 4096-byte sectors."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfstore import defaults
from sfstore.buffers import RegisteredBufferPool
from sfstore.mounts import parse_mountinfo_line
from sfstore.paths.file import FilePath, MountFacts
from sfstore.testing.file_path import FilePathTests, data

MiB = 1 << 20


class TestLocalFilePath(FilePathTests):
    """The suite on the test machine's own filesystem (``tmp_path``)."""

    def test_local_mount_is_reported_as_a_fallback(self, fp: FilePath) -> None:
        assert fp.transport == "local" and any("no NFS over RDMA" in f for f in fp.describe()["fallbacks"])


@pytest.mark.root
class TestLoopExt4FilePath(FilePathTests):
    """The suite on an ext4 loop filesystem with 4096-byte sectors (O_DIRECT alignment 4096)."""

    @pytest.fixture
    def fp_root(self, dio_dir: Path) -> Path:
        return dio_dir / "root"


@pytest.mark.parametrize(
    ("line", "transport", "chunk", "parallel"),
    [
        (
            "40 25 0:50 / /mnt/ds rw,relatime shared:1 - nfs4 10.0.0.1:/ds "
            "rw,vers=4.2,rsize=1048576,wsize=1048576,proto=rdma,port=20049,nconnect=2",
            "rdma",
            4 * MiB,
            32,
        ),
        (
            "41 25 0:51 / /mnt/tcp rw - nfs 10.0.0.2:/x rw,vers=3,rsize=65536,wsize=65536,proto=tcp",
            "tcp",
            MiB,
            16,
        ),
        ("42 25 259:1 / /data rw,noatime - xfs /dev/nvme0n1p1 rw", "local", 8 * MiB, 16),
    ],
)
def test_mount_facts_choose_chunking(line: str, transport: str, chunk: int, parallel: int) -> None:
    facts = MountFacts.from_mount(parse_mountinfo_line(line))
    assert facts.transport == transport
    assert facts.default_chunk_size() == chunk and facts.default_parallelism() == parallel


def test_direct_off_is_reported(tmp_path: Path) -> None:
    with defaults.set(direct_io="off"):
        fp = FilePath(tmp_path)
    assert not fp.supports_direct_io and any("direct_io=off" in f for f in fp.fallbacks)
    fp.write("x", b"abc")
    assert fp.read("x") == b"abc"
    c = fp.counters.snapshot()
    assert c["bytes_direct"] == 0 and c["bytes_bounced"] == 0


@pytest.mark.root
def test_aligned_reads_go_direct_misaligned_bounce_on_4k_sectors(dio_dir: Path) -> None:
    fp = FilePath(dio_dir, chunk_size=MiB, parallelism=8)
    assert fp.supports_direct_io
    payload = data(4 * MiB, 9)
    fp.write("d.bin", payload)
    with RegisteredBufferPool(4 * MiB) as pool:
        buf = pool.acquire()
        before = fp.counters.snapshot()
        assert fp.read_into("d.bin", buf) == 4 * MiB and bytes(buf) == payload
        after = fp.counters.snapshot()
        assert after["bytes_direct"] - before["bytes_direct"] == 4 * MiB
        assert after["bytes_bounced"] == before["bytes_bounced"]
        buf.release()
    before = fp.counters.snapshot()
    out = bytearray(5000)
    assert fp.read_into("d.bin", out, offset=100) == 5000 and bytes(out) == payload[100:5100]
    assert fp.counters.snapshot()["bytes_bounced"] > before["bytes_bounced"]
