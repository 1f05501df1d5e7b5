"""fsspec's own abstract test suite (``fsspec.tests.abstract``) against ``sf://``.

Wired as fsspec wires it for its local filesystem (``fsspec/implementations/tests/local/``): the fixtures
``fs`` (a filesystem over a fresh root) and ``fs_path`` (a directory inside that root, in ``sf``'s own name
form ``/abstract``); everything else comes from :class:`fsspec.tests.abstract.AbstractFixtures`. Every class the
installed fsspec ships runs. ``fsspec.tests.abstract.mv`` has no class (its two tests are hard-wired to the
local filesystem), so :class:`TestSFMove` runs the same two tests against ``sf``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fsspec.tests.abstract import AbstractFixtures
from fsspec.tests.abstract.copy import AbstractCopyTests
from fsspec.tests.abstract.get import AbstractGetTests
from fsspec.tests.abstract.open import AbstractOpenTests
from fsspec.tests.abstract.pipe import AbstractPipeTests
from fsspec.tests.abstract.put import AbstractPutTests

from sfstore.fs import SFFileSystem


class SFFixtures(AbstractFixtures):  # type: ignore[misc]
    @pytest.fixture
    def fs(self, sf_root: Path) -> SFFileSystem:
        return SFFileSystem(root=str(sf_root), skip_instance_cache=True)

    @pytest.fixture
    def fs_path(self) -> str:
        return "abstract"

    @pytest.fixture
    def fs_join(self) -> Callable[..., str]:
        return posixpath.join


class TestSFCopy(AbstractCopyTests, SFFixtures):  # type: ignore[misc]
    pass


class TestSFGet(AbstractGetTests, SFFixtures):  # type: ignore[misc]
    pass


class TestSFPut(AbstractPutTests, SFFixtures):  # type: ignore[misc]
    pass


class TestSFPipe(AbstractPipeTests, SFFixtures):  # type: ignore[misc]
    pass


class TestSFOpen(AbstractOpenTests, SFFixtures):  # type: ignore[misc]
    pass


class TestSFMove(SFFixtures):
    """``fsspec.tests.abstract.mv``'s tests, on ``sf`` instead of the local filesystem."""

    def test_move_raises_error_with_tmpdir(self, fs: SFFileSystem, fs_path: str) -> None:
        source = posixpath.join(fs_path, "source_file.txt")
        fs.pipe_file(source, b"content")
        destination = posixpath.join(fs_path, "non_existent_directory/destination_file.txt")
        with pytest.raises(FileNotFoundError):
            fs.mv(source, destination)
        assert fs.cat_file(source) == b"content"

    @pytest.mark.parametrize("recursive", [True, False])
    def test_move_raises_error_with_tmpdir_permission(
        self, recursive: bool, fs: SFFileSystem, fs_path: str, sf_root: Path
    ) -> None:
        source = posixpath.join(fs_path, "source_file.txt")
        fs.pipe_file(source, b"content")
        protected = posixpath.join(fs_path, "protected_directory")
        fs.mkdir(protected)
        host = sf_root / "abstract" / "protected_directory"
        with _read_only_directory(host):
            with pytest.raises(PermissionError):
                fs.mv(source, posixpath.join(protected, "destination_file.txt"), recursive=recursive)
            assert not fs.exists(posixpath.join(protected, "destination_file.txt"))
        assert fs.cat_file(source) == b"content"


@contextlib.contextmanager
def _read_only_directory(path: Path) -> Iterator[None]:
    """Make ``path`` refuse new entries: mode 0555, or as root (whom modes do not stop) the immutable flag."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, 0o755)
        return
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("runs as root (modes do not stop root) and chattr, to make the directory immutable, is missing")
    done = subprocess.run([chattr, "+i", str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"runs as root (modes do not stop root) and chattr +i is refused here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], capture_output=True, check=False)
