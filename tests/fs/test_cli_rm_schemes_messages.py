"""``sfstore rm``; other URL schemes refused (CLI and ``fs``); error messages in the user's terms.

Messages name what was asked (the path as an ``sf://`` URL or the local path given) and what went wrong: no
internal operation names (``info:``, ``makedirs:``), no ``[Errno N]``, no temporary names
(``.x.sfstore-part-...``), and ``cp`` prints no "copied 0 files" summary before its error.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from sfstore import errors
from sfstore.cli import build_parser, main
from sfstore.cli.files import Progress
from sfstore.fs import SFFileSystem

OP_NAMES = r"(?:info|makedirs|mkdir|stat|open|ls|rm|rmdir|touch|mv)"
INTERNAL = re.compile(rf"\[Errno|error: {OP_NAMES}:|\] {OP_NAMES}:|sfstore-part|sfstore-staging")


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    top = tmp_path / "cli-root"
    (top / "d" / "sub").mkdir(parents=True)
    (top / "d" / "a.bin").write_bytes(b"alpha")
    (top / "d" / "sub" / "b.bin").write_bytes(b"beta")
    (top / "f.txt").write_bytes(b"f")
    monkeypatch.setenv("SFSTORE_ROOT", str(top))
    SFFileSystem.clear_instance_cache()
    return top


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# -- rm -----------------------------------------------------------------------------------------------------


def test_rm_files_and_directories(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "rm", "sf://f.txt")[0] == 0 and not (root / "f.txt").exists()
    code, _, err = run(capsys, "rm", "sf://d")
    assert code == 1 and "sf://d is a directory (not removed; use -r)" in err and (root / "d" / "a.bin").exists()
    assert run(capsys, "rm", "-r", "d/sub")[0] == 0 and not (root / "d" / "sub").exists()  # a root-relative path
    assert run(capsys, "rm", "-r", "sf://d") == (0, "", "") and not (root / "d").exists()
    assert sorted(os.listdir(root)) == []  # the root itself stays


def test_rm_goes_on_after_a_failure_and_force_ignores_missing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "rm", "sf://missing.bin", "sf://f.txt")
    assert code == 1 and not (root / "f.txt").exists()  # the second path is removed all the same
    assert err == "sfstore rm: error: cannot remove sf://missing.bin: No such file or directory\n"
    assert run(capsys, "rm", "-f", "sf://missing.bin") == (0, "", "")
    assert run(capsys, "rm", "sf://d/*.bin")[0] == 0 and not (root / "d" / "a.bin").exists()  # a quoted glob
    assert (root / "d" / "sub" / "b.bin").exists()


@pytest.mark.parametrize("path", ["sf://", "/", "sf:///", "sf://d/.."])
def test_rm_refuses_the_root(root: Path, capsys: pytest.CaptureFixture[str], path: str) -> None:
    code, _, err = run(capsys, "rm", "-r", path)
    assert code == 1 and "refusing to remove the sf:// root" in err and (root / "d" / "a.bin").exists()


def test_rm_refuses_escapes_and_symlinks_are_removed_not_followed(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_bytes(b"k")
    (root / "link").symlink_to(tmp_path / "outside")
    code, _, err = run(capsys, "rm", "-r", "sf://../outside")
    assert code == 1 and "climbs above" in err
    assert run(capsys, "rm", "-r", "sf://link")[0] == 0
    assert not (root / "link").is_symlink() and (tmp_path / "outside" / "keep").exists()


# -- other schemes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", [["cat"], ["ls"], ["rm"], ["rm", "-r"]])
@pytest.mark.parametrize("url", ["s3://bucket/x", "file:///etc/passwd", "https://example.com/x", "gs://b/k"])
def test_cli_refuses_other_schemes(root: Path, capsys: pytest.CaptureFixture[str], cmd: list[str], url: str) -> None:
    (root / "s3:" / "bucket").mkdir(parents=True)
    (root / "s3:" / "bucket" / "x").write_bytes(b"not what s3://bucket/x means")
    code, out, err = run(capsys, *cmd, url)
    assert code == 1 and out == ""
    assert f"{url}: {url.split(':')[0]}:// URLs are not supported here" in err
    assert (root / "s3:" / "bucket" / "x").exists()


def test_cp_refuses_other_schemes_on_either_side(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "local.bin").write_bytes(b"x")
    for args in (["s3://b/x", "sf://x"], [str(tmp_path / "local.bin"), "s3://b/x"], ["sf://f.txt", "file:///tmp/y"]):
        code, _, err = run(capsys, "cp", *args)
        assert code == 1 and "URLs are not supported here; this command takes sf:// URLs and local paths" in err
        assert "copied" not in err


def test_fs_refuses_other_schemes_and_keeps_its_own_spellings(root: Path) -> None:
    fs = SFFileSystem(root=str(root), skip_instance_cache=True)
    for url in ("s3://bucket/x", "file:///etc/passwd", "http://h/x", "S3://bucket/x"):
        with pytest.raises(errors.InvalidRequestError, match="URLs are not sf:// paths"):
            fs.cat(url)
        with pytest.raises(errors.InvalidRequestError):
            fs.info(url)
        with pytest.raises(errors.InvalidRequestError):
            fs.pipe_file(url, b"x")
    assert not (root / "s3:").exists() and not (root / "file:").exists()
    for spelling in ("sf://d/a.bin", "sf:///d/a.bin", "/d/a.bin", "d/a.bin", "d/../d/a.bin"):
        assert fs.cat(spelling) == b"alpha"
    import fsspec

    assert fsspec.filesystem("sf", root=str(root), skip_instance_cache=True).cat("sf://d/a.bin") == b"alpha"
    with fsspec.open("sf://d/a.bin", "rb", root=str(root)) as f:
        assert f.read() == b"alpha"


# -- messages -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["cat", "sf://d/missing.bin"],
         "sfstore cat: error: cannot access sf://d/missing.bin: No such file or directory\n"),
        (["ls", "nope"], "sfstore ls: error: cannot access sf://nope: No such file or directory\n"),
        (["cp", "sf://missing", "{tmp}/o"],
         "sfstore cp: error: cannot access sf://missing: No such file or directory\n"),
        (["cp", "{tmp}/missing", "sf://x"],
         "sfstore cp: error: cannot read {tmp}/missing: No such file or directory\n"),
        (["cp", "{tmp}/src.bin", "sf://f.txt/b"],
         "sfstore cp: error: cannot create the parent directory sf://f.txt: Not a directory\n"),
        (["cp", "-r", "{tmp}/tree", "sf://f.txt/"],
         "sfstore cp: error: cannot create the directory sf://f.txt/tree: Not a directory\n"),
        (["cp", "sf://d/a.bin", "{tmp}/no/such/dir/x"], None),
    ],
)
def test_errors_say_what_was_asked_and_what_went_wrong(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str | None) -> None:
    (tmp_path / "src.bin").write_bytes(b"s")
    (tmp_path / "tree" / "x").mkdir(parents=True)
    (tmp_path / "no").write_bytes(b"a file where a directory is wanted")
    code, out, err = run(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert code == 1 and out == ""
    assert not INTERNAL.search(err), err
    assert "copied" not in err  # no "copied 0 files, 0 B" summary before the error
    if expected is not None:
        assert err == expected.replace("{tmp}", str(tmp_path))
    else:
        assert err.startswith(f"sfstore cp: error: cannot write {tmp_path}/no/such/dir/x: ")


def test_local_destination_errors_name_the_file_not_its_temporary(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # /proc refuses new files even to root: the temporary file cannot be made, and the error names the target.
    (root / "big.bin").write_bytes(os.urandom(3 << 20))  # above cp's batched small-file size: get_file's path
    for src in ("sf://d/a.bin", "sf://big.bin"):
        code, _, err = run(capsys, "cp", src, "/proc/sfstore-test-target")
        assert code == 1 and not INTERNAL.search(err), err
        assert err.startswith("sfstore cp: error: cannot write /proc/sfstore-test-target: "), err


def test_fs_errors_name_sf_urls_not_host_paths(root: Path) -> None:
    fs = SFFileSystem(root=str(root), skip_instance_cache=True)
    cases = [
        (lambda: fs.cat("sf://d/missing"), errors.PathNotFoundError, "sf://d/missing"),
        (lambda: fs.cat_file("d/missing"), errors.PathNotFoundError, "sf://d/missing"),
        (lambda: fs.open("d/missing", "rb"), errors.PathNotFoundError, "sf://d/missing"),
        (lambda: fs.info("/d/missing"), errors.PathNotFoundError, "sf://d/missing"),
        (lambda: fs.pipe_file("f.txt/x", b"1"), errors.NotADirectoryPathError, "sf://f.txt"),
        (lambda: fs.makedirs("f.txt/x"), errors.NotADirectoryPathError, "sf://f.txt/x"),
        (lambda: fs.mkdir("d"), errors.PathExistsError, "sf://d"),
        (lambda: fs.rm("d"), errors.IsADirectoryPathError, "sf://d"),
        (lambda: fs.pipe_file("d", b"1"), errors.IsADirectoryPathError, "sf://d"),
    ]
    for call, cls, url in cases:
        with pytest.raises(cls) as got:
            call()
        assert got.value.filename == url, (url, got.value)
        text = str(got.value)
        assert str(root) not in text and not re.search(rf"\] {OP_NAMES}:", text), text
    got_many = fs.cat(["d/a.bin", "d/missing"], on_error="return")
    assert isinstance(got_many, dict) and got_many["d/a.bin"] == b"alpha"
    missing = got_many["d/missing"]
    assert isinstance(missing, errors.PathNotFoundError) and missing.filename == "sf://d/missing"
    with pytest.raises(errors.IsADirectoryPathError, match="without recursive=True"):
        fs.rm("d")


def test_progress_writes_no_summary_after_a_failure() -> None:
    stream = io.StringIO()
    p = Progress(10, 1, stream=stream)
    p.finish(ok=False)
    assert stream.getvalue() == ""
    p.finish()
    assert stream.getvalue().startswith("copied 0 files, 0 B")


def test_nvme_subcommands_have_descriptions() -> None:
    parser = build_parser()
    nvme = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "nvme")[1]  # type: ignore[union-attr]
    actions = nvme._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(actions) == {"list", "discover", "connect", "disconnect"}
    for name, sub in actions.items():
        assert sub.description and len(sub.description) > 40, name
        assert " ".join(sub.description.split()) in " ".join(sub.format_help().split())  # shown by --help
