"""The FilePath conformance suite: what every mount (local, NFS over TCP, NFS over RDMA) must do.

Subclass :class:`FilePathTests` and provide ``fp_root`` (an empty directory on the mount under test). The
suite covers confinement to the root (symlinks inside followed, absolute ones too; the component walk that
stands in for ``openat2``), special files refused without waiting, parallel reads into caller buffers (numpy,
registered, torch), end of file, typed errors, async and ranged reads, pipelined many-file reads, atomic and
streaming writes, stale temporaries and describe/counters.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore import errors
from sfstore.buffers import RegisteredBufferPool
from sfstore.paths.base import Range
from sfstore.paths.file import FilePath

__all__ = ["FilePathTests"]

MiB = 1 << 20


def data(n: int, seed: int = 0) -> bytes:
    """``n`` reproducible pseudo-random bytes."""
    return random.Random(seed).randbytes(n)


class FilePathTests:
    """Conformance tests for :class:`~sfstore.paths.file.FilePath` on one mount."""

    @pytest.fixture
    def fp_root(self, tmp_path: Path) -> Path:
        """An empty directory on the mount under test (override in subclasses)."""
        return tmp_path / "root"

    @pytest.fixture
    def fp(self, fp_root: Path) -> FilePath:
        return FilePath(fp_root, chunk_size=256 << 10, parallelism=8)

    @pytest.fixture
    def outside(self, fp_root: Path) -> Path:
        """A directory next to the root (outside it)."""
        out = Path(str(fp_root) + "-outside")
        out.mkdir(parents=True, exist_ok=True)
        return out

    # -- confinement -----------------------------------------------------------------------------------------


    def test_paths_cannot_leave_the_root(self, fp: FilePath, outside: Path) -> None:
        (outside / "secret").write_bytes(b"x")
        for bad in ("../secret", "a/../../secret", str(outside / "secret"), "/etc/passwd"):
            with pytest.raises(errors.PathEscapeError) as info:
                fp.resolve(bad)
            assert isinstance(info.value, PermissionError)
        with pytest.raises(errors.PathEscapeError):
            fp.read("../secret")
        with pytest.raises(errors.PathEscapeError):
            fp.write("../evil", b"x")
        assert not (outside / "evil").exists()


    def test_symlinks_out_of_the_root_are_refused_and_inside_allowed(self, fp: FilePath, outside: Path) -> None:
        (outside / "outside.txt").write_bytes(b"out")
        os.symlink(outside / "outside.txt", os.path.join(fp.root, "link-out"))
        os.symlink(outside, os.path.join(fp.root, "dir-out"))
        fp.write("inside.txt", b"in")
        os.symlink("inside.txt", os.path.join(fp.root, "link-in"))
        with pytest.raises(errors.PathEscapeError):
            fp.read("link-out")
        with pytest.raises(errors.PathEscapeError):
            fp.write("dir-out/new.txt", b"x")
        assert not (outside / "new.txt").exists()
        assert fp.read("link-in") == b"in"
        assert fp.resolve(os.path.join(fp.root, "inside.txt")) == os.path.join(fp.root, "inside.txt")
        assert fp.resolve("") == fp.root and fp.resolve("a/./b/..") == os.path.join(fp.root, "a")


    # -- reads ---------------------------------------------------------------------------------------------------


    def test_read_into_numpy_registered_and_bytearray(self, fp: FilePath) -> None:
        payload = data(3 * MiB + 12345)
        fp.write("big.bin", payload)
        arr = np.zeros(len(payload), dtype=np.uint8)
        assert fp.read_into("big.bin", arr) == len(payload)
        assert arr.tobytes() == payload
        with RegisteredBufferPool(4 * MiB) as pool:
            buf = pool.acquire()
            n = fp.read_into("big.bin", buf)
            assert n == len(payload) and bytes(buf[0:n]) == payload
            buf.release()
        ba = bytearray(1000)
        assert fp.read_into("big.bin", ba, offset=MiB + 7) == 1000
        assert ba == payload[MiB + 7 : MiB + 1007]


    def test_read_into_torch_tensor_in_place(self, fp: FilePath) -> None:
        torch = pytest.importorskip("torch")
        t = torch.arange(1 << 18, dtype=torch.float32)
        fp.write("t.bin", t.numpy().tobytes())
        out = torch.empty_like(t)
        ptr = out.data_ptr()
        assert fp.read_into("t.bin", out) == t.numel() * 4
        assert out.data_ptr() == ptr and torch.equal(out, t)


    def test_reads_stop_at_end_of_file(self, fp: FilePath) -> None:
        fp.write("small.bin", b"0123456789")
        buf = bytearray(100)
        assert fp.read_into("small.bin", buf) == 10 and buf[:10] == b"0123456789"
        assert fp.read_into("small.bin", buf, offset=8) == 2
        assert fp.read_into("small.bin", buf, offset=50) == 0
        assert fp.read("small.bin", 3, 4) == b"3456"
        assert fp.read("small.bin", 7) == b"789"
        assert fp.read("small.bin", 20) == b""


    def test_read_errors_are_typed(self, fp: FilePath) -> None:
        with pytest.raises(errors.PathNotFoundError) as info:
            fp.read("nope.bin")
        assert isinstance(info.value, FileNotFoundError) and "nope.bin" in str(info.value)
        fp.write("x.bin", b"abc")
        with pytest.raises(errors.BufferTooSmallError):
            fp.read_into("x.bin", bytearray(2), length=3)
        with pytest.raises(errors.InvalidRequestError):
            fp.read_into("x.bin", bytearray(2), offset=-1)
        with pytest.raises(errors.ReadOnlyBufferError):
            fp.read_into("x.bin", b"zzz")
        assert fp.counters.snapshot()["errors"] >= 1


    def test_read_into_async_overlaps(self, fp: FilePath) -> None:
        fp.write("a.bin", data(MiB, 1))
        fp.write("b.bin", data(MiB, 2))
        a, b = bytearray(MiB), bytearray(MiB)
        fa, fb = fp.read_into_async("a.bin", a), fp.read_into_async("b.bin", b)
        assert fb.get() == MiB and fa.get() == MiB and fa.done()
        assert bytes(a) == data(MiB, 1) and bytes(b) == data(MiB, 2)


    def test_read_ranges_into_one_batch(self, fp: FilePath) -> None:
        payload = data(2 * MiB, 3)
        fp.write("r.bin", payload)
        out = bytearray(3000)
        ranges = [(0, 1000, out, 0), (MiB, 1000, out, 1000), (2 * MiB - 500, 1000, out, 2000)]
        got = fp.read_ranges_into("r.bin", ranges)
        assert got == [1000, 1000, 500]
        assert out[:1000] == payload[:1000] and out[1000:2000] == payload[MiB : MiB + 1000]
        assert out[2000:2500] == payload[-500:]


    many_files = 300  # files of the read_many test (a slow emulated mount may take fewer)

    def test_read_many_keeps_order_and_contents(self, fp: FilePath) -> None:
        names = [f"d/{i:04d}.bin" for i in range(self.many_files)]
        want = {n: data(random.Random(i).randrange(0, 70_000), i) for i, n in enumerate(names)}
        for n, d in want.items():
            fp.write(n, d)
        got = fp.read_many(names, window=64)
        assert got == [want[n] for n in names]
        assert all(type(g) is bytes for g in got)
        c = fp.counters.snapshot()
        assert c["files"] >= 2 * self.many_files and c["bytes_read"] >= sum(len(d) for d in want.values())


    def test_read_many_errors_raise_or_return(self, fp: FilePath) -> None:
        fp.write("ok.bin", b"ok")
        with pytest.raises(errors.PathNotFoundError):
            fp.read_many(["ok.bin", "missing.bin"])
        got = fp.read_many(["ok.bin", "missing.bin", "../escape", "ok.bin"], on_error="return")
        assert got[0] == b"ok" and got[3] == b"ok"
        assert isinstance(got[1], errors.PathNotFoundError) and isinstance(got[2], errors.PathEscapeError)
        with pytest.raises(errors.InvalidRequestError):
            fp.read_many(["ok.bin"], on_error="ignore")


    # -- writes --------------------------------------------------------------------------------------------------


    def test_write_is_atomic_and_leaves_no_temporaries(self, fp: FilePath) -> None:
        fp.write("f.bin", b"old")
        with pytest.raises(RuntimeError):
            with fp.open_writer("f.bin") as w:
                w.write(b"new content that never lands")
                raise RuntimeError("crash in the middle")
        assert fp.read("f.bin") == b"old"
        assert [n for n in os.listdir(fp.root) if fp.is_temporary(n)] == []
        assert fp.write("f.bin", b"new", fsync=True) == 3
        assert fp.read("f.bin") == b"new"
        with pytest.raises(errors.PathExistsError):
            fp.write("f.bin", b"x", overwrite=False)
        assert fp.read("f.bin") == b"new"
        fp.write("deep/er/g.bin", b"g", overwrite=False)
        assert fp.read("deep/er/g.bin") == b"g"


    def test_writer_streams_mixed_sizes(self, fp: FilePath) -> None:
        pieces = [data(n, n) for n in (10, 300_000, 1, 1 << 20, 4096, 777)]
        with fp.open_writer("s.bin", fsync=True) as w:
            for p in pieces:
                assert w.write(p) == len(p)
            # not visible under its name before close
            assert not os.path.exists(os.path.join(fp.root, "s.bin"))
        assert fp.read("s.bin") == b"".join(pieces)
        assert fp.size("s.bin") == sum(map(len, pieces))


    def test_writev_sends_page_multiples_as_one_batch_and_streams_the_rest(
            self, fp: FilePath, monkeypatch: pytest.MonkeyPatch) -> None:
        batches: list[int] = []
        real = fp.submit

        def noted(ranges: Any, **kw: Any) -> Any:
            batches.append(len(ranges))
            return real(ranges, **kw)

        monkeypatch.setattr(fp, "submit", noted)
        head, body = data(4096, 1), data(1 << 20, 2)
        with fp.open_writer("v.bin", fsync=True) as w:
            assert w.writev([head, body]) == 4096 + (1 << 20)
            assert batches == [2]  # a header and its body: one batch, one wait
            assert w.writev([b"odd", data(4096, 3)]) == 3 + 4096  # not page multiples: as write() of each
        assert fp.read("v.bin") == head + body + b"odd" + data(4096, 3)
        monkeypatch.undo()
        with fp.open_writer("v.bin") as w:
            assert w.writev([]) == 0
        assert fp.read("v.bin") == b""


    def test_write_accepts_numpy_and_tensors(self, fp: FilePath) -> None:
        torch = pytest.importorskip("torch")
        t = torch.randn(1000, dtype=torch.float32).to(torch.bfloat16)
        fp.write("t.bin", t)
        back = torch.empty_like(t)
        fp.read_into("t.bin", back)
        assert torch.equal(back, t)
        a = np.arange(100, dtype=np.int64)
        fp.write("a.bin", a)
        assert np.array_equal(np.frombuffer(fp.read("a.bin"), dtype=np.int64), a)


    def test_write_below_a_file_is_a_typed_error(self, fp: FilePath) -> None:
        fp.write("plain", b"x")
        with pytest.raises(errors.NotADirectoryPathError):
            fp.write("plain/child.bin", b"y")

    def test_open_beneath_refuses_escapes(self, fp: FilePath, outside: Path) -> None:
        (outside / "o.txt").write_bytes(b"o")
        os.symlink(outside / "o.txt", os.path.join(fp.root, "abs-link"))
        os.symlink("../" + os.path.basename(outside) + "/o.txt", os.path.join(fp.root, "rel-link"))
        for bad in ("../x", "abs-link", "rel-link", str(outside / "o.txt")):
            before = fp.counters.snapshot()["errors"]
            with pytest.raises(errors.PathEscapeError):
                fd, _ = fp.open_beneath(bad, os.O_RDONLY)
                os.close(fd)
            assert fp.counters.snapshot()["errors"] == before + 1, bad  # by its name or by a link: one each
        fp.write("in.txt", b"in")
        fd, full = fp.open_beneath(os.path.join(fp.root, "in.txt"), os.O_RDONLY)
        assert os.read(fd, 10) == b"in" and full == os.path.join(fp.root, "in.txt")
        os.close(fd)
        with pytest.raises(errors.PathNotFoundError):
            fp.open_beneath("missing", os.O_RDONLY)

    def test_absolute_symlinks_inside_the_root_are_followed(self, fp: FilePath) -> None:
        # openat2's RESOLVE_BENEATH refuses every absolute symlink; these stay inside, so they must still work
        fp.write("real/f.bin", b"real")
        os.symlink(os.path.join(fp.root, "real"), os.path.join(fp.root, "abs-dir"))
        os.symlink(os.path.join(fp.root, "real", "f.bin"), os.path.join(fp.root, "abs-file"))
        assert fp.read("abs-dir/f.bin") == b"real" and fp.read("abs-file") == b"real"
        assert fp.size("abs-file") == 4 and fp.read_many(["abs-dir/f.bin", "abs-file"]) == [b"real", b"real"]
        fp.write("abs-dir/new.bin", b"new")
        assert open(os.path.join(fp.root, "real", "new.bin"), "rb").read() == b"new"
        fp.write("abs-file", b"replaced")  # the target is published; the link stays
        assert os.path.islink(os.path.join(fp.root, "abs-file")) and fp.read("real/f.bin") == b"replaced"

    def test_the_component_walk_confines_like_openat2(self, fp: FilePath, outside: Path) -> None:
        """Where the kernel has no openat2, names are walked one component at a time: same answers."""
        (outside / "o.txt").write_bytes(b"o")
        os.symlink(outside, os.path.join(fp.root, "out"))
        os.symlink("../" + os.path.basename(outside), os.path.join(fp.root, "rel-out"))
        fp.write("d/in.bin", b"in")
        os.makedirs(os.path.join(fp.root, "d", "sub"))
        os.symlink("../in.bin", os.path.join(fp.root, "d", "sub", "up"))  # ".." inside a target, physical
        fp.beneath._openat2 = None
        for bad in ("out/o.txt", "rel-out/o.txt", "../x"):
            with pytest.raises(errors.PathEscapeError):
                fp.read(bad)
            with pytest.raises(errors.PathEscapeError):
                fp.write(bad, b"x")
        assert fp.read("d/sub/up") == b"in" and fp.read_many(["d/in.bin"]) == [b"in"]
        fp.write("e/f/g.bin", b"g")
        assert fp.read("e/f/g.bin") == b"g" and not (outside / "x").exists()

    def test_open_file_stays_on_its_file(self, fp: FilePath) -> None:
        fp.write("a.bin", data(MiB, 5))
        with fp.open_file("a.bin") as f:
            os.rename(os.path.join(fp.root, "a.bin"), os.path.join(fp.root, "b.bin"))
            fp.write("a.bin", b"another file now")
            assert f.size == MiB and f.read(0, 8) == data(MiB, 5)[:8]
            buf = bytearray(MiB)
            assert f.read_into(buf) == MiB and bytes(buf) == data(MiB, 5)

    def test_special_files_are_refused_without_waiting(self, fp: FilePath) -> None:
        os.mkfifo(os.path.join(fp.root, "fifo"))
        os.makedirs(os.path.join(fp.root, "dir"))
        calls = {
            "read": lambda n: fp.read(n),
            "read_into": lambda n: fp.read_into(n, bytearray(8)),
            "read_many": lambda n: fp.read_many([n]),
            "read_ranges_into": lambda n: fp.read_ranges_into(n, [(0, 4, bytearray(4), 0)]),
            "open_file": lambda n: fp.open_file(n),
        }
        for what, call in calls.items():
            for name, cls in (("fifo", errors.NotARegularFileError), ("dir", errors.IsADirectoryPathError)):
                box: dict[str, BaseException] = {}

                def run(call: Any = call, name: str = name, box: dict[str, BaseException] = box) -> None:
                    try:
                        call(name)
                    except BaseException as exc:
                        box["error"] = exc

                t = threading.Thread(target=run, daemon=True)
                t.start()
                t.join(10)
                if t.is_alive():  # let the stuck reader go before failing
                    os.close(os.open(os.path.join(fp.root, "fifo"), os.O_WRONLY | os.O_NONBLOCK))
                    pytest.fail(f"{what}({name!r}) waited on a FIFO")
                assert isinstance(box.get("error"), cls), (what, name, box.get("error"))
        assert fp.size("fifo") == 0  # metadata opens nothing

    def test_each_refused_writer_counts_one_error(self, fp: FilePath) -> None:
        """Every way ``open_writer`` refuses (an escape, a parent that is a file, a directory in the way, an
        existing file with ``overwrite=False``) is one error in the counters, not one per layer it passed."""
        fp.write("plain", b"x")
        os.makedirs(os.path.join(fp.root, "adir"))
        cases: list[tuple[str, dict[str, bool], type[Exception]]] = [
            ("../escape.bin", {}, errors.PathEscapeError),
            ("plain/child.bin", {}, errors.NotADirectoryPathError),
            ("adir", {}, errors.IsADirectoryPathError),
            ("plain", {"overwrite": False}, FileExistsError),
        ]
        for path, kw, kind in cases:
            before = fp.counters.snapshot()["errors"]
            with pytest.raises(kind):
                fp.open_writer(path, **kw)
            assert fp.counters.snapshot()["errors"] == before + 1, path
        assert fp.read("plain") == b"x" and not [n for n in os.listdir(fp.root) if n.startswith(".")]

    def test_write_over_a_directory_is_refused(self, fp: FilePath) -> None:
        os.makedirs(os.path.join(fp.root, "dir"))
        with pytest.raises(errors.IsADirectoryPathError):
            fp.write("dir", b"x")


    def test_stale_temporaries_are_cleaned(self, fp: FilePath) -> None:
        from sfstore import temp_names

        host = temp_names.host()
        dead = os.path.join(fp.root, f".x.bin.sfstore-tmp-{host}-999999999-abcdef")
        mine = os.path.join(fp.root, f".y.bin.sfstore-tmp-{host}-{os.getppid()}-abcdef")  # alive: kept
        for p in (dead, mine):
            with open(p, "wb") as f:
                f.write(b"partial")
        assert fp.clean_stale_temporaries() == 1
        assert not os.path.exists(dead) and os.path.exists(mine)

    # -- the namespace -----------------------------------------------------------------------------------------

    def test_namespace_methods_act_beneath_the_root(self, fp: FilePath, outside: Path) -> None:
        fp.mkdir("a/b", parents=True)
        fp.mkdir("a/b", parents=True, exist_ok=True)
        fp.write("a/b/x.bin", b"xyz")
        assert fp.listdir("a") == ["b"] and [n for n, _ in fp.scandir("a/b")] == ["x.bin"]
        assert fp.os_stat("a/b/x.bin").st_size == 3
        fp.rename("a/b/x.bin", "a/y.bin")
        fp.utime("a/y.bin", (1_000_000, 2_000_000))
        assert sorted(fp.listdir("a")) == ["b", "y.bin"] and fp.os_stat("a/y.bin").st_mtime == 2_000_000
        fp.rmdir("a/b")
        fp.unlink("a/y.bin")
        assert fp.listdir("a") == []
        fp.write("t/u/v.bin", b"1")
        fp.rmtree("t")
        assert not os.path.exists(os.path.join(fp.root, "t"))
        # an OSError naming the host path (callers add their context), and escapes refused before anything is done
        with pytest.raises(FileNotFoundError) as info:
            fp.unlink("missing.bin")
        assert info.value.filename == os.path.join(fp.root, "missing.bin")
        os.symlink(outside, os.path.join(fp.root, "out"))
        for call in (lambda: fp.listdir("out"), lambda: fp.mkdir("out/new"), lambda: fp.unlink("../x"),
                     lambda: fp.rename("a", "out/a"), lambda: fp.os_stat("out")):
            with pytest.raises(errors.PathEscapeError):
                call()
        assert os.listdir(outside) == [] and fp.os_stat("out", follow=False)  # the link itself may be looked at

    def test_create_at_makes_a_new_file_or_nothing(self, fp: FilePath, outside: Path) -> None:
        fp.mkdir("d")
        dirfd = fp.open_dir("d")
        try:
            fd = fp.create_at(dirfd, "new.bin", fp.full("d/new.bin"), size=3 * MiB)
            try:
                assert os.fstat(fd).st_size == 3 * MiB
                fp.submit([Range.write(0, len(b"abc"), bytearray(b"abc"), 0, fd)]).get()
            finally:
                os.close(fd)
            assert fp.read("d/new.bin", 0, 3) == b"abc"
            with pytest.raises(errors.PathExistsError):  # never an existing file
                fp.create_at(dirfd, "new.bin", fp.full("d/new.bin"))
            os.symlink(outside / "target", os.path.join(fp.root, "d", "link"))
            with pytest.raises(errors.PathExistsError):  # nor through a link: nothing made outside
                fp.create_at(dirfd, "link", fp.full("d/link"))
            assert not (outside / "target").exists()
            with pytest.raises(errors.SfstoreError):  # a size no file can have: nothing is left behind
                fp.create_at(dirfd, "huge.bin", fp.full("d/huge.bin"), size=1 << 62)
            assert sorted(fp.listdir("d")) == ["link", "new.bin"]
        finally:
            os.close(dirfd)

    # -- describe and counters ---------------------------------------------------------------------------------

    def test_describe_reports_transport_and_counters(self, fp: FilePath) -> None:
        d = fp.describe()
        assert d["kind"] == "file" and d["root"] == fp.root and d["transport"] in ("rdma", "tcp", "local")
        assert d["chunk_size"] == 256 << 10 and d["parallelism"] == 8
        if d["transport"] != "rdma":
            assert d["fallbacks"], "a path that is not NFS over RDMA must say why"
        fp.write("c.bin", b"abc")
        fp.read("c.bin")
        c = fp.describe()["counters"]
        assert c["bytes_written"] == 3 and c["bytes_read"] == 3 and c["files"] >= 2
