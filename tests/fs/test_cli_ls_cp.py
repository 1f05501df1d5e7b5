"""``sfstore ls`` and ``sfstore cp``: staging a dataset into ``sf://`` and back, through the real command."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfstore.cli.files import Progress


def sfstore(*args: str, root: Path) -> subprocess.CompletedProcess[str]:
    root.mkdir(parents=True, exist_ok=True)  # a configured root (SFSTORE_ROOT) must exist
    env = {**os.environ, "SFSTORE_ROOT": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "sfstore.cli", *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def tree(top: Path) -> dict[str, bytes | None]:
    """Relative path -> content (``None`` for a directory) of everything below ``top``."""
    out: dict[str, bytes | None] = {}
    for p in sorted(top.rglob("*")):
        out[str(p.relative_to(top))] = None if p.is_dir() else p.read_bytes()
    return out


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    src = tmp_path / "dataset"
    for i in range(20):
        (src / "shards" / f"{i // 10}").mkdir(parents=True, exist_ok=True)
        (src / "shards" / f"{i // 10}" / f"{i:03d}.bin").write_bytes(bytes([i]) * (100 + 37 * i))
    (src / "big.bin").write_bytes(os.urandom(1_500_000))  # above the batched small-file size
    (src / "empty-dir").mkdir()
    (src / "empty.txt").write_bytes(b"")
    return src


def test_cp_recursive_round_trip_and_ls(tmp_path: Path, dataset: Path) -> None:
    root = tmp_path / "cli-root"
    up = sfstore("cp", "-r", str(dataset), "sf://staged", root=root)
    assert up.returncode == 0, up.stderr
    assert up.stdout == "" and "copied 22 files" in up.stderr  # not a terminal: one final line, no \r
    assert "\r" not in up.stderr
    assert tree(root / "staged") == tree(dataset)

    ls = sfstore("ls", root=root)
    assert ls.returncode == 0 and ls.stdout.splitlines() == ["sf://staged/"]
    ls_r = sfstore("ls", "-R", "sf://staged", root=root)
    lines = ls_r.stdout.splitlines()
    assert "sf://staged/empty-dir/" in lines and "sf://staged/shards/1/019.bin" in lines and len(lines) == 26
    ls_l = sfstore("ls", "-l", "staged/shards/0", root=root)
    first = ls_l.stdout.splitlines()[0].split()
    assert first[0] == "-" and first[1] == "100" and first[-1] == "sf://staged/shards/0/000.bin"

    down = sfstore("cp", "-r", "sf://staged", str(tmp_path / "back"), root=root)
    assert down.returncode == 0, down.stderr
    assert tree(tmp_path / "back") == tree(dataset)
    again = sfstore("cp", "-r", "sf://staged", str(tmp_path / "back"), root=root)  # into the existing directory
    assert again.returncode == 0 and tree(tmp_path / "back" / "staged") == tree(dataset)


def test_cp_single_files(tmp_path: Path, dataset: Path) -> None:
    root = tmp_path / "cli-root"
    assert sfstore("cp", str(dataset / "big.bin"), "sf://one/", root=root).returncode == 0
    assert (root / "one" / "big.bin").read_bytes() == (dataset / "big.bin").read_bytes()
    assert sfstore("cp", "sf://one/big.bin", "sf://two.bin", root=root).returncode == 0
    assert sfstore("cp", "sf://two.bin", str(tmp_path / "local.bin"), root=root).returncode == 0
    assert (tmp_path / "local.bin").read_bytes() == (dataset / "big.bin").read_bytes()
    assert sfstore("ls", "-l", "sf://two.bin", root=root).stdout.split()[1] == "1500000"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cp", "{tmp}/missing", "sf://x"], "No such file or directory"),
        (["cp", "sf://missing", "{tmp}/x"], "No such file or directory"),
        (["cp", "{tmp}/dataset", "sf://x"], "is a directory (not copied; use -r)"),
        (["cp", "{tmp}/dataset/big.bin", "sf://../outside.bin"], "climbs above the sf:// root"),
        (["cp", "{tmp}/a", "{tmp}/b"], "must be an sf:// URL"),
        (["ls", "sf://nope"], "No such file or directory"),
    ],
)
def test_errors_exit_1_without_traceback(tmp_path: Path, dataset: Path, args: list[str], message: str) -> None:
    done = sfstore(*(a.replace("{tmp}", str(tmp_path)) for a in args), root=tmp_path / "cli-root")
    assert done.returncode == 1
    assert done.stderr.startswith(f"sfstore {args[0]}: error: ") and message in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "outside.bin").exists()


def test_cp_refuses_symlinks_out_of_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cli-root"
    root.mkdir()
    (tmp_path / "secret").write_bytes(b"host")
    (root / "leak").symlink_to(tmp_path / "secret")
    done = sfstore("cp", "sf://leak", str(tmp_path / "got"), root=root)
    assert done.returncode == 1 and "outside the root" in done.stderr and not (tmp_path / "got").exists()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_in_place_on_a_terminal() -> None:
    tty = _Tty()
    bar = Progress(4096, 2, stream=tty)
    bar.relative_update(2048)
    bar.file_done()
    bar.relative_update(2048)
    bar.file_done()
    bar.finish()
    text = tty.getvalue()
    assert text.startswith("\r[") and text.endswith("\n") and text.count("\n") == 1
    assert "100.0%" in text and "4.0 KiB / 4.0 KiB" in text and "2/2 files" in text
    log = io.StringIO()
    quiet = Progress(10, 1, stream=log)
    quiet.relative_update(10)
    quiet.file_done()
    quiet.finish()
    assert log.getvalue().startswith("copied 1 file, 10 B in ") and "\r" not in log.getvalue()
