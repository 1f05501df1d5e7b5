"""Fixtures for the ``sf://`` tests: every filesystem lives under a fresh temporary root.

``SFSTORE_ROOT``, ``SFSTORE_DATA_DIR`` and ``SFSTORE_CONFIG`` point into the test's temporary directory (and
``XDG_CONFIG_HOME`` too, so no user config file is read), so nothing here touches the real data directory.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sfstore.fs import SFFileSystem


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    (tmp_path / "env-root").mkdir()  # a configured root must exist (only the embedded default is created)
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "env-root"))
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path / "data-dir"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.delenv("SFSTORE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    SFFileSystem.clear_instance_cache()


@pytest.fixture
def sf_root(tmp_path: Path) -> Path:
    """A fresh root; on ``$SFSTORE_TEST_FS_BASE`` when set (the testbed runs these tests on its NFS-RDMA mount)."""
    base = os.environ.get("SFSTORE_TEST_FS_BASE")
    root = Path(base) / f"sf-root-{uuid.uuid4().hex[:12]}" if base else tmp_path / "sf-root"
    root.mkdir(parents=True)
    return root


@pytest.fixture
def sffs(sf_root: Path) -> SFFileSystem:
    return SFFileSystem(root=str(sf_root), skip_instance_cache=True)

