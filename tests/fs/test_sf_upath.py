"""``UPath("sf://...")`` is sfstore's :class:`~sfstore.integrations.upath.SFPath` (universal_pathlib's entry
point), with no warning, and ``replace`` / ``rename`` as ``os.replace`` / ``os.rename``."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest
from upath import UPath

from sfstore import errors
from sfstore.integrations.upath import SFPath


@pytest.fixture(autouse=True)
def _warnings_are_errors() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_no_warning_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """The first UPath("sf://...") of a process that never imported sfstore: the entry point finds SFPath."""
    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "from upath import UPath\n"
        "p = UPath('sf://fresh/a.txt')\n"
        "assert type(p).__name__ == 'SFPath', type(p)\n"
        "p.write_text('hi'); assert p.read_text() == 'hi'\n"
        "assert [c.name for c in UPath('sf://fresh').iterdir()] == ['a.txt']\n"
    )
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert (tmp_path / "env-root" / "fresh" / "a.txt").read_text() == "hi"


def test_read_write_iterdir_glob(tmp_path: Path) -> None:
    base = UPath("sf://up")
    assert isinstance(base, SFPath) and str(base) == "sf://up"
    (base / "a.txt").write_text("alpha")
    (base / "sub").mkdir()
    (base / "sub" / "b.bin").write_bytes(b"beta")
    assert (tmp_path / "env-root" / "up" / "a.txt").read_text() == "alpha"
    assert UPath("sf://up/a.txt").read_text() == "alpha" and UPath("sf:///up/a.txt").read_text() == "alpha"
    assert sorted(p.name for p in base.iterdir()) == ["a.txt", "sub"]
    assert [str(p) for p in base.glob("**/*.bin")] == ["sf://up/sub/b.bin"]
    assert [p.name for p in base.glob("*.txt")] == ["a.txt"]
    assert sorted(str(p) for p in UPath("sf://").iterdir()) == ["sf://up"]
    p = base / "sub" / "b.bin"
    assert p.is_file() and p.parent.is_dir() and p.stat().st_size == 4
    assert pickle.loads(pickle.dumps(p)).read_bytes() == b"beta"  # DataLoader workers get paths pickled
    with pytest.raises(errors.PathEscapeError):
        UPath("sf://up/../../x").read_bytes()


def test_replace_overwrites_atomically() -> None:
    old = UPath("sf://r/old.txt")
    old.write_text("old")
    new = UPath("sf://r/new.txt")
    new.write_text("new")
    moved = new.replace(old)
    assert moved == old and old.read_text() == "new" and not new.exists()
    # A string target without the protocol is root-relative, as every sf:// name; so is a pure path.
    assert str(old.replace("r/third.txt")) == "sf://r/third.txt"
    assert UPath("sf://r/third.txt").replace(PurePosixPath("/r/fourth.txt")).read_text() == "new"
    assert [p.name for p in UPath("sf://r").iterdir()] == ["fourth.txt"]


def test_replace_refusals_are_typed() -> None:
    UPath("sf://r/dir/x").write_text("x")
    UPath("sf://r/full/y").write_text("y")
    UPath("sf://r/f.txt").write_text("f")
    with pytest.raises(errors.IsADirectoryPathError):
        UPath("sf://r/f.txt").replace("sf://r/dir")  # a file onto a directory: never moved into it
    with pytest.raises(OSError, match="Directory not empty"):
        UPath("sf://r/dir").replace("sf://r/full")
    with pytest.raises(errors.PathNotFoundError):
        UPath("sf://r/missing").replace("sf://r/z")
    with pytest.raises(ValueError, match="expected protocol 'sf'"):
        UPath("sf://r/f.txt").replace("memory://z")
    with pytest.raises(ValueError, match="another sf:// filesystem"):
        UPath("sf://r/f.txt").replace(UPath("sf://r/g.txt", root="/elsewhere"))
    assert UPath("sf://r/f.txt").read_text() == "f"


def test_rename_is_os_rename() -> None:
    a = UPath("sf://n/a.txt")
    a.write_text("a")
    UPath("sf://n/b.txt").write_text("b")
    b = a.rename("sf://n/b.txt")  # an existing file is replaced, as os.rename does on POSIX
    assert b.read_text() == "a" and not a.exists()
    d = UPath("sf://n/d")
    d.mkdir()
    moved = UPath("sf://n/dir2")
    assert d.rename(moved) == moved and moved.is_dir() and not d.exists()
    with pytest.raises(errors.IsADirectoryPathError):
        b.rename(moved)  # not moved into the directory (the generic UPath.rename would)


def test_other_roots_through_storage_options(tmp_path: Path) -> None:
    other = tmp_path / "other-root"
    other.mkdir()
    p = UPath("sf://x/y.txt", root=str(other))
    p.write_text("z")
    assert (other / "x" / "y.txt").read_text() == "z"
    assert p.replace("x/w.txt").read_text() == "z" and (other / "x" / "w.txt").is_file()
