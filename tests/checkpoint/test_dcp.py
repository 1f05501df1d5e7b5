"""``sfstore.checkpoint.dcp``: torch.distributed.checkpoint storage through sfstore.

A 2-rank save (gloo on the CPU, DTensors sharded by rows and by columns, replicated tensors, per-rank tensors,
non-tensor state) loaded by one process into full-size tensors (resharding), bit-exactly; single-process round
trips; and bad input: a flipped byte, a truncated or missing data file, broken metadata, a pickle payload in a
non-tensor item -- each a clear :class:`~sfstore.errors.CorruptCheckpointError`, never a crash or an unpickling.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import xxhash  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from sfstore import errors  # noqa: E402
from sfstore.checkpoint.dcp import (  # noqa: E402
    METADATA_NAME,
    StorageReader,
    StorageWriter,
    decode_metadata,
    encode_metadata,
    resolve_checkpoint_dir,
)

ROWS, COLS = 64, 48  # divisible by 2: even shards on 2 ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _full(name: str, dtype: Any = None) -> Any:
    """The deterministic full-size tensor ``name`` (the same in every process)."""
    seed = sum(name.encode()) * 7919
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(ROWS, COLS, generator=g)
    return t.to(dtype) if dtype is not None else t


def _bits(t: Any) -> Any:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _assert_bit_exact(got: Any, want: Any, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(_bits(got), _bits(want)), f"{name}: bytes differ"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(300, 200, generator=g).to(torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "half": torch.randn(5, 7, generator=g).to(torch.float16),
        "transposed": torch.randn(40, 30, generator=g).t(),  # not contiguous
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "optim": {"state": {0: {"exp_avg": torch.randn(9, generator=g), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "name": "adam", "nan": float("nan")}]},
        "step": 1000,
        "tag": "run-1",
    }


def _zeros_like_state(sd: dict[str, Any]) -> dict[str, Any]:
    def blank(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros(v.shape, dtype=v.dtype)
        if isinstance(v, dict):
            return {k: blank(x) for k, x in v.items()}
        if isinstance(v, list):
            return [blank(x) for x in v]
        return None

    return {k: blank(v) for k, v in sd.items()}


def _compare(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        _assert_bit_exact(got, want, path)
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _compare(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _compare(a, b, f"{path}/{i}")
    elif isinstance(want, float) and want != want:
        assert isinstance(got, float) and got != got, path
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


def _failure(exc: BaseException) -> BaseException:
    """The error behind a DCP ``CheckpointException`` (DCP wraps each rank's exception)."""
    if isinstance(exc, CheckpointException):
        ((inner, _tb),) = exc.failures.values()
        return inner
    return exc


def _load_error(sd: dict[str, Any], ckpt: Path | str) -> BaseException:
    with pytest.raises((CheckpointException, errors.SfstoreError)) as info:  # type: ignore[arg-type]
        dcp.load(sd, storage_reader=StorageReader(str(ckpt)))
    return _failure(info.value)


def _data_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.name.endswith(".sfdcp"))


# -- single process --------------------------------------------------------------------------------------------


def test_round_trip_single_process(tmp_path: Path) -> None:
    sd = _state()
    ckpt = tmp_path / "ck"
    dcp.save(sd, storage_writer=StorageWriter(str(ckpt)))
    names = sorted(p.name for p in ckpt.iterdir())
    assert METADATA_NAME in names and ".metadata" not in names
    assert len(_data_files(ckpt)) == 1
    doc = json.loads((ckpt / METADATA_NAME).read_bytes())  # plain JSON, no pickle anywhere
    assert doc["format"] == "sfstore-dcp" and "w" in doc["state_dict_metadata"]
    dest = _zeros_like_state(sd)
    dcp.load(dest, storage_reader=StorageReader(str(ckpt)))
    want = dict(sd)
    want["transposed"] = sd["transposed"].contiguous()
    _compare(dest, want)


def test_every_dtype_dcp_plans(tmp_path: Path) -> None:
    """Every dtype DCP's own planner can size (its ``_element_size`` refuses bits8/bits16/int4/uint4)."""
    names = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "bfloat16",
             "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
             "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"]
    dtypes = [getattr(torch, n) for n in names if hasattr(torch, n)]
    g = torch.Generator().manual_seed(3)
    raw = {str(dt): torch.randint(0, 256, (3, 5 * dt.itemsize), dtype=torch.uint8, generator=g) for dt in dtypes}
    sd = {str(dt): raw[str(dt)].view(dt) for dt in dtypes}
    dcp.save(sd, storage_writer=StorageWriter(str(tmp_path / "ck")))
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(dest, storage_reader=StorageReader(str(tmp_path / "ck")))
    for k, v in dest.items():
        assert v.dtype == sd[k].dtype and torch.equal(v.view(torch.uint8), raw[k]), k


@pytest.mark.root
def test_round_trip_on_4k_sector_filesystem(dio_dir: Path) -> None:
    """O_DIRECT with 4096-byte sectors: misaligned tensor memory and odd sizes go through the engine's bounce and
    buffered paths; the data files are read back bit-exactly."""
    sd = _state()
    sd["odd"] = torch.randn(12345, generator=torch.Generator().manual_seed(5))[1:]  # odd size, misaligned start
    ckpt = dio_dir / "ck"
    writer = StorageWriter(str(ckpt), direct="on")
    dcp.save(sd, storage_writer=writer)
    dest = _zeros_like_state(sd)
    dcp.load(dest, storage_reader=StorageReader(str(ckpt), direct="on"))
    want = dict(sd)
    want["transposed"] = sd["transposed"].contiguous()
    _compare(dest, want)


def test_checkpoint_id_and_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    (tmp_path / "root").mkdir(exist_ok=True)  # a configured root must exist
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "root"))
    root = os.path.realpath(tmp_path / "root")
    assert resolve_checkpoint_dir("sf://run/step-1") == root + "/run/step-1"  # what fsspec's sf:// names
    assert resolve_checkpoint_dir("run/step-1") == root + "/checkpoints/run/step-1"  # bare: the checkpoint root
    assert resolve_checkpoint_dir("file:///x/y/z") == "/x/y/z"
    with pytest.raises(errors.PathEscapeError):
        resolve_checkpoint_dir("sf://../../etc")
    with pytest.raises(errors.InvalidRequestError):
        resolve_checkpoint_dir("sf://")
    assert StorageWriter.validate_checkpoint_id("sf://a") and StorageReader.validate_checkpoint_id("/a/b")
    assert not StorageWriter.validate_checkpoint_id("s3://bucket/x")
    sd = {"x": torch.arange(1000, dtype=torch.float32)}
    dcp.save(sd, checkpoint_id="sf://run/step-1", storage_writer=StorageWriter("sf://placeholder"))
    dest = {"x": torch.zeros(1000)}
    dcp.load(dest, checkpoint_id="sf://run/step-1", storage_reader=StorageReader("sf://placeholder"))
    _assert_bit_exact(dest["x"], sd["x"], "x")
    assert (tmp_path / "root" / "run" / "step-1" / METADATA_NAME).is_file()
    assert fsspec.filesystem("sf").isfile(f"sf://run/step-1/{METADATA_NAME}")
    dcp.save(sd, storage_writer=StorageWriter("run/step-1"))  # a bare name: <root>/checkpoints/run/step-1
    assert (tmp_path / "root" / "checkpoints" / "run" / "step-1" / METADATA_NAME).is_file()


def test_overwrite(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    dcp.save({"x": torch.ones(100)}, storage_writer=StorageWriter(str(ckpt)))
    first = _data_files(ckpt)
    with pytest.raises((CheckpointException, errors.PathExistsError)) as info:  # type: ignore[arg-type]
        dcp.save({"x": torch.full((100,), 2.0)}, storage_writer=StorageWriter(str(ckpt), overwrite=False))
    assert isinstance(_failure(info.value), errors.PathExistsError)
    assert _data_files(ckpt) == first
    # The default replaces it, as DCP's own FileSystemWriter does: new data files, the old ones removed after
    # the commit.
    dcp.save({"x": torch.full((100,), 2.0)}, storage_writer=StorageWriter(str(ckpt)))
    second = _data_files(ckpt)
    assert len(second) == 1 and second != first
    dest = {"x": torch.zeros(100)}
    dcp.load(dest, storage_reader=StorageReader(str(ckpt)))
    assert torch.equal(dest["x"], torch.full((100,), 2.0))
    dcp.save({"x": torch.full((100,), 3.0)}, checkpoint_id=str(ckpt), storage_writer=StorageWriter("sf://unused"))
    dcp.load(dest, storage_reader=StorageReader(str(ckpt)))
    assert torch.equal(dest["x"], torch.full((100,), 3.0)) and len(_data_files(ckpt)) == 1


def test_overwrite_keeps_the_old_checkpoint_until_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A replacing save that fails before its metadata is written leaves the previous checkpoint loadable."""
    from sfstore.checkpoint.dcp import writer as dcp_writer

    ckpt = tmp_path / "ck"
    dcp.save({"x": torch.ones(100)}, storage_writer=StorageWriter(str(ckpt)))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise errors.NoSpaceError(28, "no space left (injected)")

    monkeypatch.setattr(dcp_writer, "encode_metadata", broken)
    with pytest.raises((CheckpointException, errors.NoSpaceError)):  # type: ignore[arg-type]
        dcp.save({"x": torch.full((100,), 2.0)}, storage_writer=StorageWriter(str(ckpt)))
    monkeypatch.undo()
    dest = {"x": torch.zeros(100)}
    dcp.load(dest, storage_reader=StorageReader(str(ckpt)))
    assert torch.equal(dest["x"], torch.ones(100))


def test_dcp_own_writer_on_sf_urls_and_the_two_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dcp.save(checkpoint_id="sf://x")`` without sfstore's writer is DCP's FsspecWriter: DCP's own format in
    ``<root>/x``. sfstore's reader says so instead of loading something else; sfstore's writer replaces it."""
    import time

    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint._storage_utils import _storage_setup

    from sfstore.checkpoint.dcp import TORCH_METADATA_NAME

    (tmp_path / "root").mkdir(exist_ok=True)  # a configured root must exist
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "root"))
    where = tmp_path / "root" / "x"
    assert isinstance(_storage_setup(None, "sf://x"), FsspecWriter)  # what DCP picks for an sf:// id
    one, two = {"w": torch.full((8,), 1.0)}, {"w": torch.full((8,), 2.0)}
    dcp.save(one, checkpoint_id="sf://x", no_dist=True)
    assert (where / TORCH_METADATA_NAME).is_file() and any(p.suffix == ".distcp" for p in where.iterdir())
    dest = {"w": torch.zeros(8)}
    dcp.load(dest, checkpoint_id="sf://x", no_dist=True)  # DCP's own reader, through the sf:// filesystem
    assert torch.equal(dest["w"], one["w"])
    with pytest.raises(errors.PathNotFoundError, match="DCP's own format"):
        StorageReader("sf://x").read_metadata()
    assert "DCP's own format" in str(_load_error({"w": torch.zeros(8)}, "sf://x"))  # DCP rewraps it
    # sfstore's writer replaces it (default overwrite) and removes DCP's files once it has committed.
    time.sleep(0.02)
    dcp.save(two, storage_writer=StorageWriter("sf://x"), no_dist=True)
    assert sorted(p.suffix for p in where.iterdir()) == [".json", ".sfdcp"]
    dcp.load(dest, storage_reader=StorageReader("sf://x"), no_dist=True)
    assert torch.equal(dest["w"], two["w"])
    # DCP's own writer over it again: sfstore's reader refuses what is now the older checkpoint there.
    time.sleep(0.02)
    dcp.save(one, checkpoint_id="sf://x", no_dist=True)
    with pytest.raises(errors.PathNotFoundError, match=r"dcp.load\(state_dict, checkpoint_id=url\)"):
        StorageReader("sf://x").read_metadata()
    with pytest.raises((CheckpointException, errors.PathExistsError)) as info:  # type: ignore[arg-type]
        dcp.save(two, storage_writer=StorageWriter("sf://x", overwrite=False), no_dist=True)
    assert isinstance(_failure(info.value), errors.PathExistsError)


def test_to_torch_save_matches_torchs_converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from sfstore.checkpoint.dcp import to_torch_save
    from sfstore.fs import local_path

    (tmp_path / "root").mkdir(exist_ok=True)  # a configured root must exist
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "root"))
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 9, "tags": ["a", ("b", 1)]}
    dcp.save(sd, storage_writer=StorageWriter("sf://conv/ours"), no_dist=True)
    dcp.save(sd, checkpoint_id="sf://conv/theirs", no_dist=True)  # DCP's own format, DCP's own converter
    dcp_to_torch_save(local_path("sf://conv/theirs"), tmp_path / "theirs.pt")
    written = to_torch_save("sf://conv/ours", "sf://conv/ours.pt")
    assert written == os.path.realpath(tmp_path / "root" / "conv" / "ours.pt")
    monkeypatch.chdir(tmp_path)
    assert to_torch_save("sf://conv/ours", "local.pt") == str(tmp_path / "local.pt")
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    for path in (written, tmp_path / "local.pt"):
        ours = torch.load(path, weights_only=True)
        assert _same(ours, theirs)
    assert torch.equal(theirs["model"]["weight"], model.weight.detach())
    with pytest.raises(errors.PathNotFoundError, match="DCP's own format"):
        to_torch_save("sf://conv/theirs", tmp_path / "x.pt")
    with pytest.raises(errors.PathNotFoundError):
        to_torch_save("sf://conv/missing", tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)


def test_without_rank_coordination(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    sd = {"x": torch.arange(64, dtype=torch.float32), "n": 3}
    dcp.save(sd, storage_writer=StorageWriter(str(ckpt)), use_collectives=False)
    assert (ckpt / f"__0.{METADATA_NAME}").is_file() and not (ckpt / METADATA_NAME).exists()
    dest = {"x": torch.zeros(64), "n": 0}
    dcp.load(dest, storage_reader=StorageReader(str(ckpt)))  # falls back to rank 0's own metadata
    _assert_bit_exact(dest["x"], sd["x"], "x")
    assert dest["n"] == 3
    from sfstore.checkpoint.dcp import to_torch_save

    back = torch.load(to_torch_save(ckpt, tmp_path / "ck.pt"), weights_only=True)
    _assert_bit_exact(back["x"], sd["x"], "x")
    assert back["n"] == 3


def test_metadata_json_round_trip(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    dcp.save(_state(), storage_writer=StorageWriter(str(ckpt)))
    raw = (ckpt / METADATA_NAME).read_bytes()
    md = decode_metadata(raw)
    assert decode_metadata(encode_metadata(md)) == md
    # tuples stay tuples, list indices stay ints
    assert md.planner_data["optim.param_groups.0.betas"] == ("optim", "param_groups", 0, "betas")


# -- two ranks save, one process loads (resharding) ------------------------------------------------------------


def _rank_main(rank: int, world: int, init_file: str, ckpt: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd = {
            "rows": distribute_tensor(_full("rows", torch.bfloat16), mesh, [Shard(0)]),
            "cols": distribute_tensor(_full("cols"), mesh, [Shard(1)]),
            "replicated": _full("replicated"),
            f"only_rank{rank}": torch.full((5, 3), float(rank + 1)),
            "step": 42,
        }
        dcp.save(sd, storage_writer=StorageWriter(ckpt))
    finally:
        dist.destroy_process_group()


def test_two_ranks_save_one_process_loads_resharded(tmp_path: Path) -> None:
    import torch.multiprocessing as tmp

    ckpt = tmp_path / "ck"
    tmp.spawn(_rank_main, args=(2, str(tmp_path / "rendezvous"), str(ckpt)), nprocs=2, join=True)
    assert len(_data_files(ckpt)) == 2  # one data file per rank
    dest = {
        "rows": torch.zeros(ROWS, COLS, dtype=torch.bfloat16),
        "cols": torch.zeros(ROWS, COLS),
        "replicated": torch.zeros(ROWS, COLS),
        "only_rank0": torch.zeros(5, 3),
        "only_rank1": torch.zeros(5, 3),
        "step": 0,
    }
    dcp.load(dest, storage_reader=StorageReader(str(ckpt)))  # no process group: one process
    _assert_bit_exact(dest["rows"], _full("rows", torch.bfloat16), "rows")
    _assert_bit_exact(dest["cols"], _full("cols"), "cols")
    _assert_bit_exact(dest["replicated"], _full("replicated"), "replicated")
    assert torch.equal(dest["only_rank0"], torch.full((5, 3), 1.0))
    assert torch.equal(dest["only_rank1"], torch.full((5, 3), 2.0))
    assert dest["step"] == 42
    md = decode_metadata((ckpt / METADATA_NAME).read_bytes())
    assert len(md.state_dict_metadata["cols"].chunks) == 2  # type: ignore[union-attr]


def _load_rank_main(rank: int, world: int, init_file: str, ckpt: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        zeros = torch.zeros(ROWS, COLS)
        sd = {"rows": distribute_tensor(zeros.to(torch.bfloat16), mesh, [Shard(0)]),
              "cols": distribute_tensor(zeros, mesh, [Shard(1)]), "step": 0}
        dcp.load(sd, storage_reader=StorageReader(ckpt))
        for name, dtype, dim in (("rows", torch.bfloat16, 0), ("cols", None, 1)):
            want = _full(name, dtype).chunk(world, dim=dim)[rank]
            _assert_bit_exact(sd[name].to_local(), want, name)
        assert sd["step"] == 7
    finally:
        dist.destroy_process_group()


def test_one_process_saves_two_ranks_load_shards(tmp_path: Path) -> None:
    import torch.multiprocessing as tmp

    ckpt = tmp_path / "ck"
    sd = {"rows": _full("rows", torch.bfloat16), "cols": _full("cols"), "step": 7}
    dcp.save(sd, storage_writer=StorageWriter(str(ckpt)))
    # Each rank reads part of each stored item: rows straight into its shard, columns through a temporary.
    tmp.spawn(_load_rank_main, args=(2, str(tmp_path / "rendezvous"), str(ckpt)), nprocs=2, join=True)


# -- bad input -------------------------------------------------------------------------------------------------


def _saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    sd = {"big": torch.randn(256, 256), "small": torch.arange(10), "step": 5}
    ckpt = tmp_path / "ck"
    dcp.save(sd, storage_writer=StorageWriter(str(ckpt)))
    return ckpt, sd


def _blank() -> dict[str, Any]:
    return {"big": torch.zeros(256, 256), "small": torch.zeros(10, dtype=torch.int64), "step": 0}


def _location(ckpt: Path, fqn: str) -> dict[str, Any]:
    doc = json.loads((ckpt / METADATA_NAME).read_bytes())
    entry: dict[str, Any] = next(e for e in doc["storage_data"] if e["fqn"] == fqn)
    return entry


def test_flipped_byte_is_named(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    loc = _location(ckpt, "big")
    path = ckpt / loc["file"]
    with open(path, "r+b") as f:
        f.seek(loc["file_offset"] + 1234)
        b = f.read(1)
        f.seek(loc["file_offset"] + 1234)
        f.write(bytes([b[0] ^ 0x40]))
    err = _load_error(_blank(), ckpt)
    assert isinstance(err, errors.CorruptCheckpointError), err
    assert err.tensor == "big" and err.shard == loc["file"] and "checksum" in str(err)
    dest = _blank()  # verify=False reads it anyway (the caller asked for it)
    dcp.load(dest, storage_reader=StorageReader(str(ckpt), verify=False))


def test_truncated_data_file(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    (data,) = _data_files(ckpt)
    os.truncate(data, data.stat().st_size // 2)
    err = _load_error(_blank(), ckpt)
    assert isinstance(err, errors.CorruptCheckpointError) and "truncated" in str(err), err
    assert err.shard == data.name


def test_missing_data_file(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    for p in _data_files(ckpt):
        p.unlink()
    err = _load_error(_blank(), ckpt)
    assert isinstance(err, errors.CorruptCheckpointError) and "missing" in str(err), err


@pytest.mark.parametrize(
    "content",
    [b"", b"\x80\x04garbage", b"{not json", b"[]", json.dumps({"format": "other"}).encode(),
     pickle.dumps({"format": "sfstore-dcp"})],
)
def test_broken_metadata(tmp_path: Path, content: bytes) -> None:
    ckpt, _ = _saved(tmp_path)
    (ckpt / METADATA_NAME).write_bytes(content)
    err = _load_error(_blank(), ckpt)
    msg = str(err)
    assert isinstance(err, (errors.CorruptCheckpointError, AssertionError)), err
    assert "metadata" in msg


def test_metadata_path_escape_and_lies(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    doc = json.loads((ckpt / METADATA_NAME).read_bytes())
    doc["storage_data"][0]["file"] = "../../etc/passwd"
    (ckpt / METADATA_NAME).write_text(json.dumps(doc))
    err = _load_error(_blank(), ckpt)
    assert "path escape" in str(err) or "plain file name" in str(err), err
    doc["storage_data"][0]["file"] = _data_files(ckpt)[0].name
    doc["storage_data"][0]["length"] = 3  # lies about the size of a tensor
    (ckpt / METADATA_NAME).write_text(json.dumps(doc))
    err = _load_error(_blank(), ckpt)
    assert isinstance(err, errors.CorruptCheckpointError), err


def test_missing_checkpoint(tmp_path: Path) -> None:
    err = _load_error(_blank(), tmp_path / "nothing-here")
    assert "no checkpoint" in str(err) or "no sfstore DCP checkpoint" in str(err) or "missing" in str(err), err


class _Payload:
    """Unpickling this would create a marker file: it must never happen."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_pickle_payload_in_non_tensor_item_is_refused(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    marker = tmp_path / "pwned"
    payload = io.BytesIO()
    torch.save({"evil": _Payload(str(marker))}, payload)
    data = payload.getvalue()
    evil = ckpt / "__7_0123456789abcdef.sfdcp"
    evil.write_bytes(data)
    doc = json.loads((ckpt / METADATA_NAME).read_bytes())
    entry = next(e for e in doc["storage_data"] if e["fqn"] == "step")
    entry.update(file=evil.name, file_offset=0, length=len(data), xxh3_64=f"{xxhash.xxh3_64_intdigest(data):016x}")
    (ckpt / METADATA_NAME).write_text(json.dumps(doc))
    err = _load_error(_blank(), ckpt)
    assert isinstance(err, errors.CorruptCheckpointError) and "weights_only" in str(err), err
    assert not marker.exists()
