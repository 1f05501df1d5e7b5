"""One temporary-name scheme: names round-trip, and cleanups remove dead writers' leftovers while keeping live
writers' work."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from sfstore import checkpoint, temp_names
from sfstore.paths.file import FilePath
from sfstore.temp_names import TempName, parse, temp_name


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("final", ["x.bin", "a-b.c-d", "weights.sfstore-tmp-1-ab", "ü"])
@pytest.mark.parametrize("kind", ["tmp", "staging", "old", "part", "image"])
def test_a_name_round_trips(final: str, kind: str) -> None:
    name = temp_name(final, kind)
    assert name.startswith(f".{final}.sfstore-{kind}-")
    assert parse(name) == TempName(final, kind, temp_names.host(), os.getpid())
    assert parse(os.path.join("/some/dir", name)) == parse(name)
    assert temp_name(final, kind) != name  # two writers of one process never share one


def test_an_odd_host_name_still_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(temp_names.socket, "gethostname", lambda: "node-7.cluster.example")
    assert temp_names.host() == "node_7_cluster_example"
    tn = parse(temp_name("f", "tmp"))
    assert tn is not None and tn.host == "node_7_cluster_example" and tn.pid == os.getpid()


def test_another_hosts_name_is_read() -> None:
    assert parse(".ck.sfstore-staging-otherhost-1-cc") == TempName("ck", "staging", "otherhost", 1)


@pytest.mark.parametrize("name", [
    "x.bin", ".x.bin", ".x.sfstore-tmp-", ".x.sfstore-tmp-12", ".x.sfstore-tmp-ab-cd", ".x.sfstore-TMP-h-1-ab",
    ".x.sfstore-tmp-h-1-xyz", "x.sfstore-tmp-h-1-ab", ".x.tmp-12-ab",
    # what sfstore 0.1's first builds wrote, without a host: a name sfstore does not write is not its temporary
    ".x.bin.sfstore-tmp-123-abcdef", ".sfstore-tmp-probe-77-ab12",
])
def test_other_names_are_not_temporary(name: str) -> None:
    assert parse(name) is None


def test_a_kind_is_lower_case_letters() -> None:
    for kind in ("", "Tmp", "a-b", "a.b"):
        with pytest.raises(ValueError):
            temp_name("x", kind)


def test_file_path_cleanup_removes_dead_writers_leftovers(tmp_path: Path) -> None:
    fp = FilePath(tmp_path)
    host, dead, live = temp_names.host(), dead_pid(), os.getppid()
    gone = [
        f".b.bin.sfstore-tmp-{host}-{dead}-ef",
        ".c.bin.sfstore-tmp-otherhost-1-ab",  # another host's, untouched for long
    ]
    kept = [
        f".e.bin.sfstore-tmp-{host}-{live}-ab",
        f".f.bin.sfstore-tmp-{host}-{os.getpid()}-ab",  # ours
        ".g.bin.sfstore-tmp-otherhost-1-ab",  # another host's, recent
        f".h.bin.sfstore-staging-{host}-{dead}-ab",  # not a file path's kind
        "plain.bin",
    ]
    for name in gone + kept:
        (tmp_path / name).write_bytes(b"x")
    long_ago = time.time() - temp_names.FOREIGN_STALE_SECONDS - 60
    os.utime(tmp_path / gone[1], (long_ago, long_ago))
    assert fp.clean_stale_temporaries() == len(gone)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert [n for n in kept if fp.is_temporary(n)] == kept[:3]


def test_file_path_writes_under_the_scheme(tmp_path: Path) -> None:
    fp = FilePath(tmp_path)
    with fp.open_writer("w.bin") as w:
        w.write(b"abc")
        (name,) = [n for n in os.listdir(tmp_path) if n != "w.bin"]
        assert parse(name) == TempName("w.bin", "tmp", temp_names.host(), os.getpid())
        assert fp.clean_stale_temporaries() == 0  # a live writer's: kept
    assert os.listdir(tmp_path) == ["w.bin"]


def test_checkpoint_cleanup_keeps_a_live_saver_and_removes_a_dead_one(tmp_path: Path) -> None:
    host = temp_names.host()
    live = tmp_path / temp_name("a", "staging")
    dead = tmp_path / f".a.sfstore-staging-{host}-{dead_pid()}-bb"
    old = tmp_path / f".gone.sfstore-old-{host}-{dead_pid()}-cc"  # a two-step replace killed midway
    for d in (live, dead, old):
        d.mkdir()
    checkpoint.save({"x": torch.zeros(1)}, tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["b", "gone", live.name])
