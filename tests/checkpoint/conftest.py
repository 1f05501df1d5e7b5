"""Fixtures of the checkpoint tests (helpers: ``ckpt_helpers``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfstore import defaults


@pytest.fixture(autouse=True)
def _clean_settings() -> None:
    defaults.reset()
    yield
    defaults.reset()


@pytest.fixture
def ckroot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The checkpoint root for bare names, ``<root>/checkpoints`` (``SFSTORE_ROOT=<root>``, what ``sf://``
    names)."""
    (tmp_path / "root").mkdir(exist_ok=True)  # a configured root must exist
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("SFSTORE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "root" / "checkpoints"
