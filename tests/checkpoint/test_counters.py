"""Every byte a checkpoint moves goes through its file path's data seam: split there into ``chunk_size``
requests and counted there, under the ``checkpoint`` data class, for saves, loads and DCP storage alike."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from ckpt_helpers import same

from sfstore import checkpoint, defaults
from sfstore.checkpoint import MANIFEST_NAME, location
from sfstore.paths.file import FilePath

MIB = 1 << 20
CHUNK = MIB

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"big": torch.randn(3 * MIB // 4 + 5, generator=g), "small": torch.arange(100)}


def _path_of(url: Path, *, saving: bool) -> FilePath:
    """The file path a save (or a load) of ``url`` moves its bytes through."""
    return location.locate(url, create=saving).fp


def _class(fp: FilePath) -> dict[str, int]:
    return fp.counters.for_class("checkpoint").snapshot()


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_save_and_a_load_are_counted_once_under_the_checkpoint_class(tmp_path: Path, how: str) -> None:
    sd = _state()
    url = tmp_path / "ck"
    defaults.set(file_chunk_size=CHUNK)  # the paths the checkpoint uses are made with this chunk size
    if how == "save":
        checkpoint.save(sd, url)
    else:
        checkpoint.save_async(sd, url).get()
    fp = _path_of(url, saving=True)
    assert fp.chunk_size == CHUNK
    shards = sorted(url.glob("*.safetensors"))
    shard_bytes = sum(p.stat().st_size for p in shards)
    manifest = (url / MANIFEST_NAME).stat().st_size
    saved = _class(fp)
    assert saved["bytes_written"] == shard_bytes + manifest
    assert saved["files"] == len(shards)
    assert saved["errors"] == 0 and saved["bytes_read"] == 0
    # The path split each shard into chunk-size requests (the face hands it whole ranges).
    assert saved["requests"] >= sum(math.ceil(p.stat().st_size / CHUNK) for p in shards) + 1
    assert fp.counters.snapshot()["bytes_written"] == saved["bytes_written"]  # nothing outside the class

    got = checkpoint.load(url)
    assert same(got, sd)
    fp = _path_of(url, saving=False)
    assert fp.chunk_size == CHUNK
    loaded = _class(fp)
    assert loaded["bytes_read"] == shard_bytes + manifest
    assert loaded["files"] == len(shards) + 1  # the shards and the manifest
    assert loaded["bytes_written"] == 0 and loaded["errors"] == 0
    assert loaded["requests"] >= sum(math.ceil(p.stat().st_size / CHUNK) for p in shards) + 1


def test_load_into_is_counted_under_the_checkpoint_class(tmp_path: Path) -> None:
    sd = _state()
    url = tmp_path / "ck"
    checkpoint.save(sd, url)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(url, into=dest)
    assert same(dest, sd)
    got = _class(_path_of(url, saving=False))
    tensor_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    # The manifest, the header (read on its own) and every tensor's bytes straight into its target.
    assert got["bytes_read"] >= tensor_bytes + (url / MANIFEST_NAME).stat().st_size
    assert got["files"] == 2  # one shard, the manifest
    assert got["errors"] == 0


def test_dcp_items_are_one_range_each_split_by_the_path(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from sfstore.checkpoint.dcp import StorageReader, StorageWriter

    sd = _state()
    writer = StorageWriter(str(tmp_path / "ck"), chunk_size=CHUNK)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    fp = writer._path().fp
    wrote = _class(fp)
    item_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    assert wrote["bytes_written"] == item_bytes
    assert wrote["files"] == 1 and wrote["errors"] == 0
    assert wrote["requests"] >= math.ceil(sd["big"].numel() * 4 / CHUNK) + 1

    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = StorageReader(str(tmp_path / "ck"), chunk_size=CHUNK)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert same(dest, sd)
    read = _class(reader._path().fp)
    metadata = (tmp_path / "ck" / "sfstore-dcp-metadata.json").stat().st_size
    assert read["bytes_read"] == item_bytes + metadata
    assert read["files"] == 2  # the data file and the metadata
    assert read["requests"] >= math.ceil(sd["big"].numel() * 4 / CHUNK) + 1


def test_absolute_checkpoints_and_dcp_are_counted_where_the_router_describes(tmp_path: Path) -> None:
    """A checkpoint at an absolute directory and a DCP save move through the router's paths (its registry of
    locations), so ``sfstore.open().describe()`` shows what they wrote; two saves to one place share one path."""
    import sfstore

    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from sfstore.checkpoint.dcp import StorageWriter

    sd = _state()
    checkpoint.save(sd, tmp_path / "ck")
    first = _path_of(tmp_path / "ck", saving=True)
    checkpoint.save(sd, tmp_path / "ck2")
    assert _path_of(tmp_path / "ck2", saving=True) is first  # one path for the parent directory
    dcp.save(sd, storage_writer=StorageWriter(str(tmp_path / "dcp")))
    where = sfstore.open().describe()["locations"]
    shards = sum(p.stat().st_size for d in ("ck", "ck2") for p in (tmp_path / d).iterdir())
    assert where[str(tmp_path)]["counters"]["bytes_written"] >= shards
    tensor_bytes = sum(t.numel() * t.element_size() for t in sd.values())  # (its data file aligns items: holes)
    assert where[str(tmp_path / "dcp")]["counters"]["bytes_written"] >= tensor_bytes > 0
