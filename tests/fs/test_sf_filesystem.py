"""``sf://`` beyond fsspec's abstract suite: registration, the path layout, root confinement, batched and ranged
reads, reads into caller buffers, atomic writes, the namespace operations and the engine readahead of open files."""

from __future__ import annotations

import gc
import io
import os
import pickle
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from sfstore import defaults, errors
from sfstore.buffers import RegisteredBufferPool
from sfstore.fs import SFFile, SFFileSystem


def write(path: Path, data: bytes) -> Path:
    """Write ``data`` to the host path ``path`` (parents made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` deterministic bytes that differ with ``seed``."""
    return bytes((i * 131 + seed * 17 + (i >> 8)) & 0xFF for i in range(n))


# -- registration and configuration ---------------------------------------------------------------------------


def test_protocol_is_registered_by_the_entry_point() -> None:
    assert fsspec.get_filesystem_class("sf") is SFFileSystem
    assert "sf" in fsspec.available_protocols()


def test_default_root_is_sfstore_root(tmp_path: Path) -> None:
    fs = fsspec.filesystem("sf")
    assert fs.root == os.path.realpath(tmp_path / "env-root")
    with fsspec.open("sf://x/y.bin", "wb") as f:
        f.write(b"abc")
    assert (tmp_path / "env-root" / "x" / "y.bin").read_bytes() == b"abc"
    with fsspec.open("sf://x/y.bin", "rb") as f:
        assert f.read() == b"abc"
    fs2, path = fsspec.core.url_to_fs("sf://x/y.bin")
    assert fs2 is fs and path == "x/y.bin"


def test_root_from_config_file_then_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SFSTORE_ROOT")
    cfg = tmp_path / "sfstore.toml"
    cfg.write_text(f'root = "{tmp_path / "cfg-root"}"\n')
    (tmp_path / "cfg-root").mkdir()  # a configured root must exist
    assert SFFileSystem(config=str(cfg)).root == os.path.realpath(tmp_path / "cfg-root")
    cfg.unlink()
    assert SFFileSystem().root == os.path.realpath(tmp_path / "data-dir")


def test_instances_are_cached_per_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = SFFileSystem()
    assert SFFileSystem() is a
    (tmp_path / "other-root").mkdir()
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "other-root"))
    b = SFFileSystem()
    assert b is not a and b.root == os.path.realpath(tmp_path / "other-root")


def test_pickles_by_arguments(sffs: SFFileSystem) -> None:
    sffs.pipe_file("p.bin", b"pickled")
    again = pickle.loads(pickle.dumps(sffs))
    assert again.root == sffs.root and again.cat_file("p.bin") == b"pickled"
    with sffs.open("p.bin", "rb") as f:
        f.read(2)
        g = pickle.loads(pickle.dumps(f))
    assert g.read() == b"ckled"


# -- path layout ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling", ["sf://a/b.bin", "sf:///a/b.bin", "/a/b.bin", "a/b.bin", "a/./c/../b.bin", "//a//b.bin/"]
)
def test_every_spelling_names_the_same_file(sffs: SFFileSystem, sf_root: Path, spelling: str) -> None:
    write(sf_root / "a" / "b.bin", b"same")
    assert sffs._strip_protocol(spelling) == "a/b.bin" and sffs.name_of(spelling) == "a/b.bin"
    assert sffs.cat_file(spelling) == b"same"
    assert sffs.info(spelling)["name"] == "a/b.bin"


def test_names_and_urls(sffs: SFFileSystem, sf_root: Path) -> None:
    write(sf_root / "d" / "f", b"1")
    assert sffs.ls("sf://", detail=False) == ["d"]
    assert sffs.ls("d", detail=False) == ["d/f"]
    assert sffs.find("") == ["d/f"]
    assert sffs.unstrip_protocol("d/f") == "sf://d/f"
    assert sffs._strip_protocol("sf://") == "" and sffs._strip_protocol("/") == ""
    assert sffs._parent("d/f") == "d" and sffs._parent("d") == ""
    assert sffs.info("/")["type"] == "directory" and sffs.info("sf://")["name"] == ""


def test_put_fd_takes_a_regular_file_or_a_pipe_and_commits_atomically(sffs: SFFileSystem, tmp_path: Path) -> None:
    data = payload(3 << 20, seed=7)
    src = write(tmp_path / "src.bin", data)
    fd = os.open(src, os.O_RDONLY)
    try:
        assert sffs.put_fd(fd, "sf://put/regular.bin") == len(data)
    finally:
        os.close(fd)
    assert sffs.cat_file("put/regular.bin") == data
    r, w = os.pipe()
    try:
        os.write(w, data[:60_000])  # below the pipe's capacity: written before the reader starts
        os.close(w)
        w = -1
        assert sffs.put_fd(r, "put/piped.bin", name="<pipe>") == 60_000
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert sffs.cat_file("put/piped.bin") == data[:60_000]
    fd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(FileExistsError):
            sffs.put_fd(fd, "put/piped.bin", mode="create")  # refused: the file that is there stays whole
    finally:
        os.close(fd)
    assert sffs.cat_file("put/piped.bin") == data[:60_000]
    with pytest.raises(errors.SfstoreError, match="fd 987654"):
        sffs.put_fd(987654, "put/never.bin")
    assert not sffs.exists("put/never.bin")


# -- confinement --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["sf://../x", "../x", "/../x", "a/../../x", "sf:///a/../../etc/passwd", "a/\x00"])
def test_paths_climbing_out_are_refused(sffs: SFFileSystem, path: str) -> None:
    for call in (
        lambda: sffs.cat_file(path),
        lambda: sffs.pipe_file(path, b"x"),
        lambda: sffs.open(path, "rb"),
        lambda: sffs.open(path, "wb"),
        lambda: sffs.exists(path),
        lambda: sffs.info(path),
        lambda: sffs.ls(path),
        lambda: sffs.rm(path),
        lambda: sffs.read_into(path, bytearray(4)),
    ):
        with pytest.raises(errors.PathEscapeError):
            call()
    with pytest.raises(PermissionError):
        fsspec.open(path if path.startswith("sf:") else "sf://" + path, "rb").open()


def test_absolute_paths_name_inside_the_root(sffs: SFFileSystem, tmp_path: Path) -> None:
    outside = write(tmp_path / "outside" / "secret.txt", b"host file")
    with pytest.raises(FileNotFoundError):  # <root>/<tmp>/outside/secret.txt, which does not exist
        sffs.cat_file(str(outside))
    sffs.pipe_file(str(outside), b"inside")
    assert outside.read_bytes() == b"host file"
    assert (Path(sffs.root) / str(outside).lstrip("/")).read_bytes() == b"inside"


def test_symlinks_out_of_the_root_are_refused(sffs: SFFileSystem, sf_root: Path, tmp_path: Path) -> None:
    secret = write(tmp_path / "outside" / "secret.txt", b"host file")
    (sf_root / "link.txt").symlink_to(secret)
    (sf_root / "linkdir").symlink_to(secret.parent, target_is_directory=True)
    for call in (
        lambda: sffs.cat_file("link.txt"),
        lambda: sffs.cat(["link.txt"]),
        lambda: sffs.cat_ranges(["link.txt"], [0], [4], on_error="raise"),
        lambda: sffs.open("link.txt", "rb"),
        lambda: sffs.read_into("link.txt", bytearray(9)),
        lambda: sffs.pipe_file("link.txt", b"overwrite"),
        lambda: sffs.info("link.txt"),
        lambda: sffs.exists("link.txt"),
        lambda: sffs.ls("linkdir"),
        lambda: sffs.cat_file("linkdir/secret.txt"),
        lambda: sffs.pipe_file("linkdir/new.txt", b"x"),
        lambda: sffs.get_file("link.txt", str(tmp_path / "got")),
    ):
        with pytest.raises(errors.PathEscapeError):
            call()
    assert secret.read_bytes() == b"host file" and not (secret.parent / "new.txt").exists()
    listed = {d["name"]: d for d in sffs.ls("/")}
    assert listed["link.txt"]["type"] == "other" and listed["link.txt"]["islink"]
    sffs.rm(["link.txt", "linkdir"], recursive=True)  # removes the links, not what they point at
    assert not (sf_root / "link.txt").is_symlink() and secret.read_bytes() == b"host file"


def test_symlinks_inside_the_root_are_followed_for_content(sffs: SFFileSystem, sf_root: Path) -> None:
    write(sf_root / "real" / "f.bin", b"real data")
    (sf_root / "alias").symlink_to(sf_root / "real", target_is_directory=True)
    assert sffs.cat_file("alias/f.bin") == b"real data"
    assert sffs.ls("alias", detail=False) == ["alias/f.bin"]
    assert sffs.info("alias")["islink"] and sffs.isdir("alias")
    sffs.rm("alias", recursive=True)
    assert (sf_root / "real" / "f.bin").read_bytes() == b"real data" and not (sf_root / "alias").exists()


# -- metadata ---------------------------------------------------------------------------------------------------


def test_info_times_and_keys(sffs: SFFileSystem) -> None:
    sffs.pipe_file("m/f.bin", b"12345")
    info = sffs.info("m/f.bin")
    assert info["type"] == "file" and info["size"] == 5 and not info["islink"]
    assert sffs.size("m/f.bin") == 5 and sffs.sizes(["m/f.bin"]) == [5]
    assert sffs.isfile("m/f.bin") and not sffs.isdir("m/f.bin") and sffs.isdir("m") and not sffs.exists("nope")
    assert sffs.modified("m/f.bin").tzinfo is not None and sffs.created("m/f.bin").year >= 2020
    key, chk = sffs.ukey("m/f.bin"), sffs.checksum("m/f.bin")
    assert sffs.ukey("m/f.bin") == key
    sffs.pipe_file("m/f.bin", b"123456")
    assert sffs.ukey("m/f.bin") != key and sffs.checksum("m/f.bin") != chk
    with pytest.raises(FileNotFoundError):
        sffs.info("m/nope")


def test_ls_hides_writers_in_progress(sffs: SFFileSystem, sf_root: Path) -> None:
    sffs.pipe_file("w/old.bin", b"old")
    f = sffs.open("w/new.bin", "wb")
    f.write(b"partial")
    assert any(".sfstore-tmp-" in p.name for p in (sf_root / "w").iterdir())
    assert sffs.ls("w", detail=False) == ["w/old.bin"]
    f.close()
    assert sffs.ls("w", detail=False) == ["w/new.bin", "w/old.bin"]


# -- reads ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "end"), [(None, None), (3, None), (None, 7), (2, 9), (-4, None), (1, -1), (8, 3), (50, 60)]
)
def test_cat_file_slices(sffs: SFFileSystem, start: int | None, end: int | None) -> None:
    data = payload(40)
    sffs.pipe_file("s.bin", data)
    assert sffs.cat_file("s.bin", start, end) == data[start:end]


def test_cat_file_errors_are_typed(sffs: SFFileSystem) -> None:
    sffs.mkdir("dir")
    with pytest.raises(IsADirectoryError):
        sffs.cat_file("dir")
    with pytest.raises(errors.PathNotFoundError):
        sffs.cat_file("missing")


def test_cat_of_many_small_files_is_one_pipelined_batch(sffs: SFFileSystem) -> None:
    files = {f"small/{i:03d}.bin": payload(100 + i, seed=i) for i in range(60)}
    sffs.pipe(files)
    sffs.counters.reset()
    got = sffs.cat(list(files))
    assert got == files
    c = sffs.counters.snapshot()
    assert c["files"] == 60 and c["requests"] == 60 and c["bytes_read"] == sum(map(len, files.values()))
    assert sffs.cat("small/*.bin") == files
    sffs.mkdir("small/sub")
    sffs.pipe_file("small/sub/x", b"x")
    assert sffs.cat("small", recursive=True) == {**files, "small/sub/x": b"x"}  # the directory is skipped
    assert sffs.cat("small/000.bin") == files["small/000.bin"]


def test_cat_on_error(sffs: SFFileSystem) -> None:
    sffs.pipe({"e/a": b"a", "e/b": b"b"})
    names = ["e/a", "e/missing", "e/b"]
    with pytest.raises(FileNotFoundError):
        sffs.cat(names)
    assert sffs.cat(names, on_error="omit") == {"e/a": b"a", "e/b": b"b"}
    got = sffs.cat(names, on_error="return")
    assert isinstance(got, dict) and isinstance(got["e/missing"], errors.PathNotFoundError) and got["e/b"] == b"b"
    sffs.mkdir("e/dir")
    with pytest.raises(IsADirectoryError):
        sffs.cat(["e/a", "e/dir"])
    for nothing in (lambda: sffs.cat("e/nothing-*"), lambda: sffs.expand_path("e/gone", recursive=True)):
        with pytest.raises(errors.PathNotFoundError):  # fsspec's expansion raises a bare FileNotFoundError
            nothing()


def test_cat_ranges_coalesces_adjacent_ranges(sffs: SFFileSystem) -> None:
    data = payload(64 * 1024)
    sffs.pipe_file("r.bin", data)
    starts = [i * 1024 for i in range(16)] + [60000]
    ends = [s + 1024 for s in starts[:-1]] + [60100]
    sffs.counters.reset()
    got = sffs.cat_ranges(["r.bin"] * len(starts), starts, ends, max_gap=0)
    assert got == [data[s:e] for s, e in zip(starts, ends, strict=True)]
    requests = sffs.counters.snapshot()["requests"]
    assert requests == 2 < len(starts)  # 16 adjacent ranges in one request, the far one in another


def test_cat_ranges_gaps_bounds_and_many_files(sffs: SFFileSystem) -> None:
    a, b = payload(5000, 1), payload(3000, 2)
    sffs.pipe({"ra": a, "rb": b})
    paths = ["ra", "rb", "ra", "rb", "ra", "ra"]
    starts: list[int | None] = [0, 100, 10, None, -50, 4990]
    ends: list[int | None] = [20, 200, 4000, 10, None, 6000]
    sffs.counters.reset()
    got = sffs.cat_ranges(paths, starts, ends)
    assert got == [(a if p == "ra" else b)[s:e] for p, s, e in zip(paths, starts, ends, strict=True)]
    assert sffs.counters.snapshot()["requests"] == 2  # within the default 64 KiB gap: one read per file
    sffs.counters.reset()
    assert sffs.cat_ranges(["ra", "ra"], [0, 4000], [10, 4010], max_gap=100) == [a[:10], a[4000:4010]]
    assert sffs.counters.snapshot()["requests"] == 2
    assert sffs.cat_ranges(["ra"], 0, 0) == [b""]
    out = sffs.cat_ranges(["ra", "missing"], [0, 0], [3, 3])
    assert out[0] == a[:3] and isinstance(out[1], FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        sffs.cat_ranges(["missing"], [0], [3], on_error="raise")


def test_read_into_caller_buffers(sffs: SFFileSystem) -> None:
    data = payload(20000)
    sffs.pipe_file("b.bin", data)
    arr = np.zeros(20000, np.uint8)
    assert sffs.read_into("b.bin", arr) == 20000 and arr.tobytes() == data
    part = np.zeros(100, np.uint8)
    assert sffs.read_into("sf://b.bin", part, offset=500, length=60) == 60
    assert part[:60].tobytes() == data[500:560] and not part[60:].any()
    t = torch.zeros(20000, dtype=torch.uint8)
    assert sffs.read_into("b.bin", t) == 20000 and bytes(t.numpy()) == data
    with RegisteredBufferPool(1 << 16) as pool:
        buf = pool.acquire()
        try:
            assert sffs.read_into("b.bin", buf, length=20000) == 20000
            assert bytes(memoryview(buf)[:20000]) == data
        finally:
            buf.release()
    with pytest.raises(errors.BufferTooSmallError):
        sffs.read_into("b.bin", bytearray(10), length=20)


def test_cat_ranges_into_buffers(sffs: SFFileSystem) -> None:
    a, b = payload(9000, 3), payload(4000, 4)
    sffs.pipe({"ia": a, "ib": b})
    out = np.zeros((3, 1000), np.uint8)
    got = sffs.cat_ranges_into(["ia", "ib", "ia"], [0, 3500, 8500], [1000, 4000, 9000], [out[0], out[1], out[2]])
    assert got == [1000, 500, 500]
    assert out[0].tobytes() == a[:1000] and out[1, :500].tobytes() == b[3500:] and out[2, :500].tobytes() == a[8500:]
    with pytest.raises(errors.InvalidRequestError):
        sffs.cat_ranges_into(["ia"], [5], [1], [bytearray(10)])


# -- open() -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_type", ["sfreadahead", "readahead", "none", "bytes"])
def test_open_reads_through_any_cache(sffs: SFFileSystem, cache_type: str) -> None:
    data = payload(50000)
    sffs.pipe_file("o.bin", data)
    with sffs.open("o.bin", "rb", block_size=4096, cache_type=cache_type) as f:
        assert isinstance(f, SFFile) and f.size == 50000
        pieces = []
        while chunk := f.read(1000):
            pieces.append(chunk)
        assert b"".join(pieces) == data
        f.seek(-10, 2)
        assert f.read() == data[-10:] and f.tell() == 50000
        f.seek(123)
        assert f.read(7) == data[123:130]


def test_engine_readahead_keeps_the_next_block_in_flight(sffs: SFFileSystem) -> None:
    data = payload(64 * 1024)
    sffs.pipe_file("ra.bin", data)
    with sffs.open("ra.bin", "rb", block_size=8192) as f:
        cache = f.cache
        assert cache.name == "sfreadahead"
        assert f.read(100) == data[:100] and cache._ahead is not None  # sequential from 0: next block started
        out = b"".join(iter(lambda: f.read(3000), b""))
        assert data[100:] == out
        assert cache.miss_count <= 64 * 1024 // 8192 + 1 and cache.hit_count > 0
        f.seek(40000)  # random access: no readahead started
        cache._ahead = None
        f.seek(100)
        assert f.read(10) == data[100:110]
    assert f.closed and f.cache is None


def test_readinto_large_goes_straight_to_the_buffer(sffs: SFFileSystem) -> None:
    data = payload(40000)
    sffs.pipe_file("ri.bin", data)
    with sffs.open("ri.bin", "rb", block_size=4096) as f:
        f.seek(1000)
        arr = np.zeros(30000, np.uint8)
        assert f.readinto(arr) == 30000 and arr.tobytes() == data[1000:31000]
        small = bytearray(10)
        assert f.readinto(small) == 10 and bytes(small) == data[31000:31010]
        assert f.readline() == data[31010:].split(b"\n")[0] + (b"\n" if b"\n" in data[31010:] else b"")


def test_text_mode(sffs: SFFileSystem) -> None:
    with sffs.open("t.txt", "w") as f:
        f.write("line one\nline two\n")
    with sffs.open("t.txt", "r") as f:
        assert f.readlines() == ["line one\n", "line two\n"]


def test_write_is_published_atomically_on_close(sffs: SFFileSystem, sf_root: Path) -> None:
    sffs.pipe_file("aw.bin", b"old content")
    f = sffs.open("aw.bin", "wb")
    for i in range(10):
        f.write(payload(1000, i))
    assert sffs.cat_file("aw.bin") == b"old content"  # readers still see the old version
    f.close()
    assert sffs.cat_file("aw.bin") == b"".join(payload(1000, i) for i in range(10))
    assert [p.name for p in sf_root.iterdir()] == ["aw.bin"]


def test_failed_write_is_discarded(sffs: SFFileSystem, sf_root: Path) -> None:
    sffs.pipe_file("fw.bin", b"keep me")
    with pytest.raises(RuntimeError), sffs.open("fw.bin", "wb") as f:
        f.write(b"half of it")
        raise RuntimeError("writer failed")
    assert sffs.cat_file("fw.bin") == b"keep me"
    g = sffs.open("fw.bin", "wb")
    g.write(b"never closed")
    del g
    gc.collect()
    assert sffs.cat_file("fw.bin") == b"keep me"
    assert [p.name for p in sf_root.iterdir()] == ["fw.bin"]


def test_exclusive_append_and_unsupported_modes(sffs: SFFileSystem) -> None:
    with sffs.open("x.bin", "xb") as f:
        f.write(b"first")
    with pytest.raises(FileExistsError):
        sffs.open("x.bin", "xb")
    with sffs.open("x.bin", "ab") as f:
        assert f.tell() == 5
        f.write(b"+more")
    assert sffs.cat_file("x.bin") == b"first+more"
    with sffs.open("fresh.bin", "ab") as f:
        f.write(b"new")
    assert sffs.cat_file("fresh.bin") == b"new"
    with pytest.raises(RuntimeError), sffs.open("x.bin", "ab") as f:
        f.write(b"lost")
        raise RuntimeError
    assert sffs.cat_file("x.bin") == b"first+more"
    with pytest.raises(NotImplementedError):
        sffs.open("x.bin", "r+b")
    sffs.mkdir("adir")
    with pytest.raises(IsADirectoryError):
        sffs.open("adir", "wb")
    with pytest.raises(IsADirectoryError):
        sffs.open("adir", "rb")


def test_transaction_publishes_at_the_end(sffs: SFFileSystem) -> None:
    with sffs.transaction:
        with sffs.open("tx/a.bin", "wb") as f:
            f.write(b"A")
        assert not sffs.exists("tx/a.bin")
    assert sffs.cat_file("tx/a.bin") == b"A"


# -- copies and the namespace -------------------------------------------------------------------------------------


def test_put_get_cp_stream_in_blocks(tmp_path: Path, sf_root: Path) -> None:
    with defaults.set(file_chunk_size=4096):
        fs = SFFileSystem(root=str(sf_root), skip_instance_cache=True)
    assert fs.blocksize == 16384
    data = payload(100_000)
    local = write(tmp_path / "local" / "in.bin", data)

    class Count:
        def __init__(self) -> None:
            self.n = 0

        def set_size(self, size: int) -> None:
            self.size = size

        def relative_update(self, inc: int = 1) -> None:
            self.n += inc

    cb = Count()
    chunks = -(-len(data) // 4096)
    fs.counters.reset()
    fs.put_file(str(local), "p/in.bin", callback=cb)
    assert (sf_root / "p" / "in.bin").read_bytes() == data and cb.n == cb.size == len(data)
    # the local side goes through the file path too: split into its chunks and counted there
    c = fs.counters.snapshot()
    assert c["bytes_read"] == c["bytes_written"] == len(data) and c["files"] == 1 and c["errors"] == 0
    assert c["requests"] >= 2 * chunks
    fs.cp_file("p/in.bin", "p/copy.bin")
    assert fs.cat_file("p/copy.bin") == data
    fs.counters.reset()
    fs.get_file("p/copy.bin", str(tmp_path / "out" / "back.bin"))
    assert (tmp_path / "out" / "back.bin").read_bytes() == data
    c = fs.counters.snapshot()
    assert c["bytes_read"] == c["bytes_written"] == len(data) and c["errors"] == 0 and c["requests"] >= 2 * chunks
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["back.bin"]
    sink = io.BytesIO()
    fs.get_file("p/copy.bin", sink)
    assert sink.getvalue() == data
    with pytest.raises(FileExistsError):
        fs.put_file(str(local), "p/in.bin", mode="create")
    fs.put(str(tmp_path / "local"), "tree", recursive=True)
    assert fs.find("tree") == ["tree/in.bin"]
    with pytest.raises(FileNotFoundError):
        fs.cp_file("p/missing", "p/x")


def test_mv_renames_within_the_root(sffs: SFFileSystem, sf_root: Path) -> None:
    sffs.pipe_file("mv/a.bin", b"A")
    ino = (sf_root / "mv" / "a.bin").stat().st_ino
    sffs.mv("mv/a.bin", "mv/b.bin")
    assert not sffs.exists("mv/a.bin") and (sf_root / "mv" / "b.bin").stat().st_ino == ino
    sffs.mkdir("into")
    sffs.mv("mv/b.bin", "into")
    assert sffs.cat_file("into/b.bin") == b"A"
    sffs.mv("into/b.bin", "newdir/")
    assert sffs.find("newdir") == ["newdir/b.bin"]
    sffs.mv("newdir/b.bin", "into")
    sffs.mv("into", "moved", recursive=True)
    assert sffs.find("moved") == ["moved/b.bin"]
    sffs.pipe({"g/1.txt": b"1", "g/2.txt": b"2"})
    sffs.mv("g/*.txt", "h/")
    assert sffs.find("h") == ["h/1.txt", "h/2.txt"] and sffs.find("g") == []
    with pytest.raises(FileNotFoundError):
        sffs.mv("nope", "x")
    with pytest.raises(errors.InvalidRequestError):
        sffs.mv("/", "x")


def test_rm_mkdir_rmdir_touch(sffs: SFFileSystem, sf_root: Path) -> None:
    sffs.pipe({"t/a/1": b"1", "t/a/b/2": b"2", "t/c": b"c"})
    with pytest.raises(IsADirectoryError):
        sffs.rm("t/a")
    with pytest.raises(OSError):
        sffs.rmdir("t/a")
    sffs.rm("t/a", recursive=True, maxdepth=1)
    assert sffs.find("t") == ["t/a/b/2", "t/c"]
    sffs.rm("t/a", recursive=True)
    sffs.rm_file("t/c")
    assert sffs.ls("t") == []
    sffs.rmdir("t")
    with pytest.raises(FileNotFoundError):
        sffs.rm("t")
    with pytest.raises(errors.InvalidRequestError):
        sffs.rm("/", recursive=True)
    sffs.mkdir("m/n/o")
    with pytest.raises(FileExistsError):
        sffs.mkdir("m/n")
    with pytest.raises(FileNotFoundError):
        sffs.mkdir("p/q", create_parents=False)
    sffs.makedirs("m/n", exist_ok=True)
    with pytest.raises(FileExistsError):
        sffs.makedirs("m/n")
    sffs.touch("m/f")
    assert sffs.cat_file("m/f") == b""
    sffs.pipe_file("m/f", b"data")
    os.utime(sf_root / "m" / "f", (1_000_000, 1_000_000))
    sffs.touch("m/f", truncate=False)
    assert sffs.cat_file("m/f") == b"data" and sffs.info("m/f")["mtime"] > 1_000_000
