"""The device path's routes: what cuFile accepts, which route each mode and target takes, and what the counters say.

The route choice is pure logic over real target facts (the mount table, the descriptor's kind). The transfers use
``EmulatedDeviceRuntime`` (host memory standing in for a GPU: no GPU exists on this machine), so every line but
kvikio's and CUDA's last call runs; the tests say so in their names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore import errors
from sfstore.paths import device as device_mod
from sfstore.paths.base import Range
from sfstore.paths.device import DevicePath, TargetFacts, choose_route, cufile_accepts
from sfstore.testing.device_runtime import EmulatedDeviceRuntime, gpu_array

MiB = 1 << 20


@pytest.mark.parametrize(
    ("facts", "accepted", "words"),
    [
        (TargetFacts("block", "/dev/nvme1n1", source="/dev/nvme1n1"), False, "block device"),
        (TargetFacts("file", "f", "nfs4", "srv:/kv", "rdma"), True, "NFS over RDMA"),
        (TargetFacts("file", "f", "nfs4", "srv:/kv", "tcp"), False, "needs NFS over RDMA"),
        (TargetFacts("file", "f", "ext4", "/dev/nvme0n1p1", data_mode="ordered"), True, "NVMe"),
        (TargetFacts("file", "f", "xfs", "/dev/nvme2n1"), True, "xfs on /dev/nvme2n1"),
        (TargetFacts("file", "f", "ext4", "/dev/nvme0n1p1", data_mode="journal"), False, "data=ordered"),
        (TargetFacts("file", "f", "ext4", "/dev/vda1", data_mode="ordered"), False, "NVMe or NVMe-oF"),
        (TargetFacts("file", "f", "tmpfs", "tmpfs"), False, "not a filesystem cuFile supports"),
        (TargetFacts("file", "f", "lustre", "mgs@o2ib:/fs"), True, "GDS-enabled"),
    ],
)
def test_what_cufile_accepts(facts: TargetFacts, accepted: bool, words: str) -> None:
    ok, why = cufile_accepts(facts)
    assert ok is accepted and words in why


def test_the_route_of_each_mode() -> None:
    nvme = TargetFacts("file", "f", "ext4", "/dev/nvme0n1p1", data_mode="ordered")
    raw = TargetFacts("block", "/dev/nvme1n1", source="/dev/nvme1n1")
    assert choose_route("gds", "cuFile here", nvme)[0] == "gds"
    route, why = choose_route("gds", "cuFile here", raw)
    assert route == "compat" and "block device" in why and "compat mode" in why
    assert choose_route("compat", "no nvidia-fs", nvme) == ("compat", "no nvidia-fs")
    assert choose_route("staged", "no kvikio", nvme) == ("staged", "no kvikio")


def test_target_facts_of_a_real_file_come_from_the_mount_table(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"\0" * 4096)
    fd = os.open(f, os.O_RDONLY)
    try:
        facts = TargetFacts.of_fd(fd, str(f))
    finally:
        os.close(fd)
    assert facts.kind == "file" and facts.fstype  # this machine's filesystem, whatever it is
    assert facts.transport in ("local", "rdma", "tcp")


def _round_trip(dp: DevicePath, tmp_path: Path, n: int = 3 * MiB) -> tuple[int, dict[str, int]]:
    data = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    src = gpu_array(n, fill=data)
    dst = gpu_array(n)
    fd = os.open(tmp_path / "blocks.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert dp.submit([Range.write(4096, n, src, 0, fd)]).get() == [n]
        assert dp.submit([Range.read(4096, n, dst, 0, fd)]).get() == [n]
    finally:
        os.close(fd)
    assert np.array_equal(np.asarray(dst), data)
    return n, dp.counters.snapshot()


def test_emulated_gpu_on_this_machines_disk_takes_compat_and_counts_staged(tmp_path: Path) -> None:
    rt = EmulatedDeviceRuntime("gds")
    dp = DevicePath(tmp_path, runtime=rt)
    try:
        fd = os.open(tmp_path / "t.bin", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            route, why = dp.route_for(fd, "t.bin")
            facts = TargetFacts.of_fd(fd, "t.bin")
        finally:
            os.close(fd)
        if cufile_accepts(facts)[0]:
            pytest.skip(f"this machine's filesystem ({facts.fstype} on {facts.source}) is one cuFile accepts")
        assert route == "compat" and "compat mode" in why
        n, c = _round_trip(dp, tmp_path)
        assert c["bytes_staged"] == 2 * n and c["bytes_gpu_direct"] == 0
        assert c["bytes_written"] == c["bytes_read"] == n
        assert {r["route"] for r in dp.describe()["routes"]} == {"compat"}
    finally:
        dp.close()


def test_emulated_gpu_on_a_target_cufile_accepts_goes_gpu_direct(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # No filesystem here is one cuFile takes: the facts say "accepted" so the gds route's counting is tested.
    monkeypatch.setattr(device_mod, "cufile_accepts", lambda t: (True, "accepted (test: an NVMe ext4 stand-in)"))
    rt = EmulatedDeviceRuntime("gds")
    dp = DevicePath(tmp_path, runtime=rt)
    try:
        n, c = _round_trip(dp, tmp_path)
        assert c["bytes_gpu_direct"] == 2 * n and c["bytes_staged"] == 0
        assert rt.copies_to_host == rt.copies_from_host == 0  # no host staging copy on this route
        assert ("pwrite", n) in rt.calls and ("pread", n) in rt.calls
        assert dp.describe()["gpu_direct"] is True
    finally:
        dp.close()


def test_emulated_gpu_where_kvikio_picks_compat_for_a_file_is_counted_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_mod, "cufile_accepts", lambda t: (True, "accepted (test)"))
    dp = DevicePath(tmp_path, runtime=EmulatedDeviceRuntime("gds", compat_files=True))
    try:
        n, c = _round_trip(dp, tmp_path)
        assert c["bytes_staged"] == 2 * n and c["bytes_gpu_direct"] == 0
        assert any("kvikio chose its compat mode" in r["why"] for r in dp.describe()["routes"])
    finally:
        dp.close()


def test_emulated_gpu_without_kvikio_is_staged_through_pinned_buffers(tmp_path: Path) -> None:
    rt = EmulatedDeviceRuntime("staged")
    dp = DevicePath(tmp_path, runtime=rt)
    try:
        n, c = _round_trip(dp, tmp_path, n=9 * MiB)  # more than one 8 MiB staging buffer
        assert c["bytes_staged"] == 2 * n and c["bytes_gpu_direct"] == 0
        assert rt.copies_to_host == 2 and rt.copies_from_host == 2 and not rt.calls
        assert c["bytes_direct"] + c["bytes_bounced"] in (0, 2 * n)  # the engine's O_DIRECT, where the fs has it
        assert "device path staged" in " ".join(dp.describe()["fallbacks"])
    finally:
        dp.close()


def test_emulated_gpu_modes_cannot_be_asked_above_what_is_there(tmp_path: Path) -> None:
    with pytest.raises(errors.NotSupportedOnHostError):
        DevicePath(tmp_path, mode="gds", runtime=EmulatedDeviceRuntime("compat"))
    dp = DevicePath(tmp_path, mode="staged", runtime=EmulatedDeviceRuntime("gds"))
    assert dp.mode == "staged" and "asked for" in dp.why
    dp.close()


def test_emulated_gpu_errors_are_typed_and_nothing_is_half_done_silently(tmp_path: Path) -> None:
    dp = DevicePath(tmp_path, runtime=EmulatedDeviceRuntime("staged"))
    try:
        small = tmp_path / "small.bin"
        small.write_bytes(b"x" * 4096)
        fd = os.open(small, os.O_RDWR)
        try:
            with pytest.raises(errors.BufferTooSmallError):
                dp.submit([Range.read(0, 8192, gpu_array(4096), 0, fd)])
            with pytest.raises(errors.InvalidRequestError, match="host reads only"):
                dp.submit([Range.read(0, 4096, gpu_array(4096), 0, fd)], checksums=[1])
            assert dp.submit([Range.read(0, 8192, gpu_array(8192), 0, fd)]).get() == [4096]  # end of file
        finally:
            os.close(fd)
        with pytest.raises(errors.SfstoreOSError, match="short read"):
            dp.read_into("small.bin", gpu_array(8192))
        f = dp.write_async("slab.bin", gpu_array(4096, fill=7))
        assert f.wait(5) and f.get(5) == 4096
    finally:
        dp.close()


def test_the_file_path_refuses_gpu_buffers_the_device_path_takes(tmp_path: Path) -> None:
    from sfstore.paths.file import FilePath

    class SaysItIsCuda:  # any object with __cuda_array_interface__ is GPU memory to sfstore
        @property
        def __cuda_array_interface__(self) -> dict[str, object]:
            return {"shape": (4096,), "typestr": "|u1", "data": (0, False), "version": 3}

    fp = FilePath(tmp_path)
    assert fp.supports_device_buffers is False and DevicePath(tmp_path).supports_device_buffers is True
    fd = os.open(tmp_path / "a.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(errors.InvalidRequestError, match="device path"):
            fp.submit([Range.write(0, 4096, SaysItIsCuda(), 0, fd)])
        assert fp.counters.snapshot()["requests"] == 0  # nothing was issued
    finally:
        os.close(fd)


def test_emulated_gpu_describe_names_the_route_of_its_root(tmp_path: Path) -> None:
    dp = DevicePath(tmp_path, runtime=EmulatedDeviceRuntime("gds"))
    try:
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            accepted, why = cufile_accepts(TargetFacts.of_fd(fd, str(tmp_path)))
        finally:
            os.close(fd)
        root = dp.describe()["root_route"]
        assert root["route"] == ("gds" if accepted else "compat") and why in root["why"]
    finally:
        dp.close()


class _KvikioCuFileStandIn:
    """kvikio.CuFile's Python signature (``pread(buf, size=None, file_offset=0, task_size=None)``: no offset into
    the buffer), over host memory: kvikio itself needs a GPU."""

    def __init__(self, path: str, flags: str = "r") -> None:
        self.fd = os.open(path, os.O_RDWR)

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0, task_size: int | None = None) -> Any:
        view = buf.numpy() if hasattr(buf, "numpy") else buf
        n = os.preadv(self.fd, [memoryview(view).cast("B")[:size]], file_offset)
        return _Done(n)

    def pwrite(self, buf: Any, size: int | None = None, file_offset: int = 0, task_size: int | None = None) -> Any:
        view = buf.numpy() if hasattr(buf, "numpy") else buf
        return _Done(os.pwrite(self.fd, memoryview(view).cast("B")[:size], file_offset))

    def close(self) -> None:
        os.close(self.fd)


class _Done:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n

    def done(self) -> bool:
        return True


def test_kvikio_ranges_at_buffer_offsets_move_those_bytes_kvikio_stand_in(tmp_path: Path) -> None:
    # kvikio's pread/pwrite have no buffer offset (their 4th argument is task_size): a range at an offset of a
    # GPU array must reach kvikio as a view of those bytes, or every layer of a chunk lands at offset 0
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from sfstore.paths.device_runtime import _KvikioFile

    f = tmp_path / "f.bin"
    f.write_bytes(bytes(range(256)) * 64)
    fd = os.open(f, os.O_RDWR)
    try:
        kf = _KvikioFile(SimpleNamespace(CuFile=_KvikioCuFileStandIn), fd, str(f))
        buf = torch.zeros(8192, dtype=torch.uint8)
        assert kf.pread(buf, 1000, 300, 4096).get() == 1000
        assert bytes(buf[4096:5096].numpy()) == (bytes(range(256)) * 64)[300:1300]
        assert not buf[:4096].any() and not buf[5096:].any()
        src = torch.arange(8192, dtype=torch.int64).view(torch.uint8)[:8192]
        assert kf.pwrite(src, 512, 0, 1024).get() == 512
        kf.close()
        assert f.read_bytes()[:512] == bytes(src[1024:1536].numpy())
    finally:
        os.close(fd)
