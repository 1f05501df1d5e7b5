"""FilePath on real filesystems: confinement to the root, parallel reads into caller buffers, batched small
files, atomic writes, mount facts and counters (direct vs bounced on a 4096-byte-sector loop filesystem)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from sfstore import defaults, errors
from sfstore.buffers import RegisteredBufferPool
from sfstore.mounts import parse_mountinfo_line
from sfstore.paths.file import FilePath, MountFacts

MiB = 1 << 20


def data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def fp(tmp_path: Path) -> FilePath:
    return FilePath(tmp_path / "root", chunk_size=256 << 10, parallelism=8)


# -- confinement -----------------------------------------------------------------------------------------


def test_paths_cannot_leave_the_root(fp: FilePath, tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"x")
    for bad in ("../secret", "a/../../secret", str(tmp_path / "secret"), "/etc/passwd"):
        with pytest.raises(errors.PathEscapeError) as info:
            fp.resolve(bad)
        assert isinstance(info.value, PermissionError)
    with pytest.raises(errors.PathEscapeError):
        fp.read("../secret")
    with pytest.raises(errors.PathEscapeError):
        fp.write("../evil", b"x")
    assert not (tmp_path / "evil").exists()


def test_symlinks_out_of_the_root_are_refused_and_inside_allowed(fp: FilePath, tmp_path: Path) -> None:
    (tmp_path / "outside.txt").write_bytes(b"out")
    os.symlink(tmp_path / "outside.txt", os.path.join(fp.root, "link-out"))
    os.symlink(tmp_path, os.path.join(fp.root, "dir-out"))
    fp.write("inside.txt", b"in")
    os.symlink("inside.txt", os.path.join(fp.root, "link-in"))
    with pytest.raises(errors.PathEscapeError):
        fp.read("link-out")
    with pytest.raises(errors.PathEscapeError):
        fp.write("dir-out/new.txt", b"x")
    assert not (tmp_path / "new.txt").exists()
    assert fp.read("link-in") == b"in"
    assert fp.resolve(os.path.join(fp.root, "inside.txt")) == os.path.join(fp.root, "inside.txt")
    assert fp.resolve("") == fp.root and fp.resolve("a/./b/..") == os.path.join(fp.root, "a")


# -- reads ---------------------------------------------------------------------------------------------------


def test_read_into_numpy_registered_and_bytearray(fp: FilePath) -> None:
    payload = data(3 * MiB + 12345)
    fp.write("big.bin", payload)
    arr = np.zeros(len(payload), dtype=np.uint8)
    assert fp.read_into("big.bin", arr) == len(payload)
    assert arr.tobytes() == payload
    with RegisteredBufferPool(4 * MiB) as pool:
        buf = pool.acquire()
        n = fp.read_into("big.bin", buf)
        assert n == len(payload) and bytes(buf[0:n]) == payload
        buf.release()
    ba = bytearray(1000)
    assert fp.read_into("big.bin", ba, offset=MiB + 7) == 1000
    assert ba == payload[MiB + 7 : MiB + 1007]


def test_read_into_torch_tensor_in_place(fp: FilePath) -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(1 << 18, dtype=torch.float32)
    fp.write("t.bin", t.numpy().tobytes())
    out = torch.empty_like(t)
    ptr = out.data_ptr()
    assert fp.read_into("t.bin", out) == t.numel() * 4
    assert out.data_ptr() == ptr and torch.equal(out, t)


def test_reads_stop_at_end_of_file(fp: FilePath) -> None:
    fp.write("small.bin", b"0123456789")
    buf = bytearray(100)
    assert fp.read_into("small.bin", buf) == 10 and buf[:10] == b"0123456789"
    assert fp.read_into("small.bin", buf, offset=8) == 2
    assert fp.read_into("small.bin", buf, offset=50) == 0
    assert fp.read("small.bin", 3, 4) == b"3456"
    assert fp.read("small.bin", 7) == b"789"
    assert fp.read("small.bin", 20) == b""


def test_read_errors_are_typed(fp: FilePath) -> None:
    with pytest.raises(errors.PathNotFoundError) as info:
        fp.read("nope.bin")
    assert isinstance(info.value, FileNotFoundError) and "nope.bin" in str(info.value)
    fp.write("x.bin", b"abc")
    with pytest.raises(errors.BufferTooSmallError):
        fp.read_into("x.bin", bytearray(2), length=3)
    with pytest.raises(errors.InvalidRequestError):
        fp.read_into("x.bin", bytearray(2), offset=-1)
    with pytest.raises(errors.ReadOnlyBufferError):
        fp.read_into("x.bin", b"zzz")
    assert fp.counters.snapshot()["errors"] >= 1


def test_read_into_async_overlaps(fp: FilePath) -> None:
    fp.write("a.bin", data(MiB, 1))
    fp.write("b.bin", data(MiB, 2))
    a, b = bytearray(MiB), bytearray(MiB)
    fa, fb = fp.read_into_async("a.bin", a), fp.read_into_async("b.bin", b)
    assert fb.get() == MiB and fa.get() == MiB and fa.done()
    assert bytes(a) == data(MiB, 1) and bytes(b) == data(MiB, 2)


def test_read_ranges_into_one_batch(fp: FilePath) -> None:
    payload = data(2 * MiB, 3)
    fp.write("r.bin", payload)
    out = bytearray(3000)
    got = fp.read_ranges_into("r.bin", [(0, 1000, out, 0), (MiB, 1000, out, 1000), (2 * MiB - 500, 1000, out, 2000)])
    assert got == [1000, 1000, 500]
    assert out[:1000] == payload[:1000] and out[1000:2000] == payload[MiB : MiB + 1000]
    assert out[2000:2500] == payload[-500:]


def test_read_many_keeps_order_and_contents(fp: FilePath) -> None:
    names = [f"d/{i:04d}.bin" for i in range(300)]
    want = {n: data(random.Random(i).randrange(0, 70_000), i) for i, n in enumerate(names)}
    for n, d in want.items():
        fp.write(n, d)
    got = fp.read_many(names, window=64)
    assert got == [want[n] for n in names]
    assert all(type(g) is bytes for g in got)
    c = fp.counters.snapshot()
    assert c["files"] >= 600 and c["bytes_read"] >= sum(len(d) for d in want.values())


def test_read_many_errors_raise_or_return(fp: FilePath) -> None:
    fp.write("ok.bin", b"ok")
    with pytest.raises(errors.PathNotFoundError):
        fp.read_many(["ok.bin", "missing.bin"])
    got = fp.read_many(["ok.bin", "missing.bin", "../escape", "ok.bin"], on_error="return")
    assert got[0] == b"ok" and got[3] == b"ok"
    assert isinstance(got[1], errors.PathNotFoundError) and isinstance(got[2], errors.PathEscapeError)
    with pytest.raises(errors.InvalidRequestError):
        fp.read_many(["ok.bin"], on_error="ignore")


# -- writes --------------------------------------------------------------------------------------------------


def test_write_is_atomic_and_leaves_no_temporaries(fp: FilePath) -> None:
    fp.write("f.bin", b"old")
    with pytest.raises(RuntimeError):
        with fp.open_writer("f.bin") as w:
            w.write(b"new content that never lands")
            raise RuntimeError("crash in the middle")
    assert fp.read("f.bin") == b"old"
    assert [n for n in os.listdir(fp.root) if fp.is_temporary(n)] == []
    assert fp.write("f.bin", b"new", fsync=True) == 3
    assert fp.read("f.bin") == b"new"
    with pytest.raises(errors.PathExistsError):
        fp.write("f.bin", b"x", overwrite=False)
    assert fp.read("f.bin") == b"new"
    fp.write("deep/er/g.bin", b"g", overwrite=False)
    assert fp.read("deep/er/g.bin") == b"g"


def test_writer_streams_mixed_sizes(fp: FilePath) -> None:
    pieces = [data(n, n) for n in (10, 300_000, 1, 1 << 20, 4096, 777)]
    with fp.open_writer("s.bin", fsync=True) as w:
        for p in pieces:
            assert w.write(p) == len(p)
        # not visible under its name before close
        assert not os.path.exists(os.path.join(fp.root, "s.bin"))
    assert fp.read("s.bin") == b"".join(pieces)
    assert fp.size("s.bin") == sum(map(len, pieces))


def test_write_accepts_numpy_and_tensors(fp: FilePath) -> None:
    torch = pytest.importorskip("torch")
    t = torch.randn(1000, dtype=torch.float32).to(torch.bfloat16)
    fp.write("t.bin", t)
    back = torch.empty_like(t)
    fp.read_into("t.bin", back)
    assert torch.equal(back, t)
    a = np.arange(100, dtype=np.int64)
    fp.write("a.bin", a)
    assert np.array_equal(np.frombuffer(fp.read("a.bin"), dtype=np.int64), a)


def test_write_over_a_directory_is_refused(fp: FilePath) -> None:
    os.makedirs(os.path.join(fp.root, "dir"))
    with pytest.raises(errors.IsADirectoryPathError):
        fp.write("dir", b"x")


def test_stale_temporaries_are_cleaned(fp: FilePath) -> None:
    dead = os.path.join(fp.root, ".x.bin.sfstore-tmp-999999999-abcdef")
    mine = os.path.join(fp.root, f".y.bin.sfstore-tmp-{os.getppid()}-abcdef")  # alive: kept
    for p in (dead, mine):
        with open(p, "wb") as f:
            f.write(b"partial")
    assert fp.clean_stale_temporaries() == 1
    assert not os.path.exists(dead) and os.path.exists(mine)


# -- mount facts, O_DIRECT, counters -----------------------------------------------------------------------


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


def test_describe_reports_transport_and_fallbacks(fp: FilePath) -> None:
    d = fp.describe()
    assert d["kind"] == "file" and d["transport"] == "local" and d["root"] == fp.root
    assert any("no NFS over RDMA" in f for f in d["fallbacks"])
    assert d["chunk_size"] == 256 << 10 and d["parallelism"] == 8


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
