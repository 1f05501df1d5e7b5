"""The FilePath conformance suite over the testbed's NFS mount with ``proto=rdma``."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from sfstore.paths.file import FilePath
from sfstore.testing.file_path import FilePathTests

from .endpoints import env


class TestNfsRdmaFilePath(FilePathTests):
    many_files = 100  # each file is a create + rename + fsync round trip over the emulated NFS-RDMA mount

    @pytest.fixture
    def fp_root(self) -> Path:
        return Path(env("SFSTORE_TEST_NFS_MOUNT")) / f"fp-{uuid.uuid4().hex[:8]}" / "root"

    def test_mount_is_nfs_over_rdma(self, fp: FilePath) -> None:
        assert fp.transport == "rdma", fp.describe()
        assert fp.mount.fstype.startswith("nfs") and fp.mount.rsize
        assert not any("NFS over TCP" in f or "no NFS over RDMA" in f for f in fp.describe()["fallbacks"])

    def test_data_reaches_the_server_side(self, fp: FilePath) -> None:
        payload = os.urandom(3 << 20)
        fp.write("server.bin", payload, fsync=True)
        rel = os.path.relpath(fp.resolve("server.bin"), env("SFSTORE_TEST_NFS_MOUNT"))
        with open(os.path.join(env("SFSTORE_TEST_NFS_EXPORT"), rel), "rb") as f:
            assert f.read() == payload
