"""Fixtures shared by every test: real loop-device filesystems for root-only tests.

``loop_filesystem`` makes an ext4 filesystem on a loop device (``losetup --direct-io=on -b 4096``), so that
O_DIRECT sees 4096-byte sectors: unlike tmpfs and /dev/shm, it refuses misaligned direct I/O. Tests using it
are marked ``root`` and skip with the reason where the machine refuses a step (not root, no loop devices, no
mkfs.ext4, mount refused).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The reusable suites in sfstore.testing get pytest's assertion messages too.
pytest.register_assert_rewrite("sfstore.testing")


@dataclass(frozen=True)
class LoopFS:
    """A mounted loop-device filesystem: ``path`` (mount point), ``device`` (/dev/loopN), ``image``."""

    path: Path
    device: str
    image: Path
    sector: int

    def fresh_dir(self) -> Path:
        """A new empty directory on the filesystem."""
        d = self.path / f"t-{uuid.uuid4().hex[:12]}"
        d.mkdir()
        return d


def _step(cmd: list[str], what: str) -> str:
    try:
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip(f"{what}: {cmd[0]} is not installed")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"{what} refused ({' '.join(cmd)}): {(exc.stderr or exc.stdout or '').strip()}")
    except subprocess.TimeoutExpired:
        pytest.skip(f"{what} timed out ({' '.join(cmd)})")
    return done.stdout.strip()


@contextlib.contextmanager
def loop_filesystem(workdir: Path, size: int, *, sector: int = 4096, direct_io: bool = True) -> Iterator[LoopFS]:
    """Make, mount and finally remove an ext4 filesystem of ``size`` bytes on a loop device.

    Skips the calling test (with the reason) when not root or when any step is refused.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root: makes a loop device and mounts a filesystem")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    workdir.mkdir(parents=True, exist_ok=True)
    image = workdir / "fs.img"
    mnt = workdir / "mnt"
    mnt.mkdir(exist_ok=True)
    with open(image, "wb") as fh:
        fh.truncate(size)
    device = ""
    mounted = False
    try:
        device = _step(
            ["losetup", f"--direct-io={'on' if direct_io else 'off'}", "-b", str(sector), "-f", "--show", str(image)],
            "losetup",
        )
        _step(["mkfs.ext4", "-q", "-F", "-b", "4096", device], "mkfs.ext4")
        _step(["mount", device, str(mnt)], "mount")
        mounted = True
        yield LoopFS(mnt, device, image, sector)
    finally:
        if mounted:
            subprocess.run(["fsfreeze", "-u", str(mnt)], capture_output=True, check=False)
            if subprocess.run(["umount", str(mnt)], capture_output=True, check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
        if device:
            subprocess.run(["losetup", "-d", device], capture_output=True, check=False)
        image.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def loop_block_device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A raw 64 MiB loop device (no filesystem) with 4096-byte logical sectors, e.g. ``/dev/loop3``."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes a loop device")
    if shutil.which("losetup") is None:
        pytest.skip("needs losetup")
    image = tmp_path_factory.mktemp("loop-block") / "device.img"
    with open(image, "wb") as fh:
        fh.truncate(64 << 20)
    device = _step(["losetup", "--direct-io=on", "-b", "4096", "-f", "--show", str(image)], "losetup")
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True, check=False)
        image.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def dio_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopFS]:
    """A 48 MiB ext4 on a loop device with 4096-byte logical sectors (O_DIRECT needs 4096 alignment there)."""
    with loop_filesystem(tmp_path_factory.mktemp("dio-fs"), 48 << 20, sector=4096) as fs:
        yield fs


@pytest.fixture
def dio_dir(dio_fs: LoopFS) -> Iterator[Path]:
    """A fresh directory on :func:`dio_fs`, removed after the test."""
    d = dio_fs.fresh_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[LoopFS]:
    """A fresh 4 MiB ext4 (4096-byte sectors) for running out of space or freezing."""
    with loop_filesystem(tmp_path / "tiny-fs", 4 << 20, sector=4096) as fs:
        yield fs


@contextlib.contextmanager
def tmpfs_mount(mountpoint: Path, size: int = 16 << 20) -> Iterator[Callable[[], None]]:
    """Mount a fresh tmpfs of ``size`` bytes at ``mountpoint``; yield a function that remounts it read-only
    (``mount -o remount,ro``: refused to root too, unlike a chmod). Unmounted at the end.

    Skips the calling test (with the reason) when not root or when mounting is refused.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a tmpfs and remounts it read-only (chmod does not stop root)")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("needs mount and umount")
    mountpoint.mkdir(parents=True, exist_ok=True)
    _step(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)], "mount -t tmpfs")

    def read_only() -> None:
        _step(["mount", "-o", "remount,ro", str(mountpoint)], "mount -o remount,ro")

    try:
        yield read_only
    finally:
        if subprocess.run(["umount", str(mountpoint)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)
