"""webdataset on ``sf://``: the ``sf`` gopen handler sfstore registers, and ``pipe:`` through ``sfstore cat``."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
import webdataset as wds
from torch.utils.data import DataLoader

from sfstore import errors
from sfstore.fs import SFFileSystem
from sfstore.integrations import webdataset_gopen

SHARDS = "sf://shards/train-{000000..000003}.tar"


def _tar(shard: int, samples: int = 3) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(samples):
            for ext, data in (("txt", f"shard{shard}-sample{i}".encode()), ("cls", str(shard * 10 + i).encode())):
                info = tarfile.TarInfo(f"{shard:06d}-{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def shards() -> list[tuple[str, bytes]]:
    """Four shards of three samples under the default sf:// root (the one webdataset's handler opens)."""
    fs = SFFileSystem()
    expected = []
    for shard in range(4):
        fs.pipe_file(f"sf://shards/train-{shard:06d}.tar", _tar(shard))
        expected += [(f"{shard:06d}-{i:04d}", f"shard{shard}-sample{i}".encode()) for i in range(3)]
    return expected


def _samples(dataset: Any) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["txt"]) for s in dataset]


def test_handler_is_registered() -> None:
    assert sys.modules["webdataset.gopen"].gopen_schemes["sf"] is webdataset_gopen.gopen_sf


def test_webdataset_iterates_sf_shards(shards: list[tuple[str, bytes]]) -> None:
    assert _samples(wds.WebDataset(SHARDS, shardshuffle=False)) == shards
    decoded = [s["cls"] for s in wds.WebDataset(SHARDS, shardshuffle=False).decode()]
    assert decoded == [s * 10 + i for s in range(4) for i in range(3)]


def test_webdataset_through_pipe_and_sfstore_cat(shards: list[tuple[str, bytes]]) -> None:
    url = f"pipe:{sys.executable} -m sfstore.cli cat sf://shards/train-{{000000..000003}}.tar"
    assert _samples(wds.WebDataset(url, shardshuffle=False)) == shards


def test_dataloader_workers_split_sf_shards(shards: list[tuple[str, bytes]]) -> None:
    dataset = wds.WebDataset(SHARDS, shardshuffle=False, workersplitter=wds.split_by_worker).to_tuple("__key__", "txt")
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert sorted((k, t) for k, t in loader) == shards


def test_shard_writer_publishes_sf_shards(sf_root: Path) -> None:
    fs = SFFileSystem()
    with wds.ShardWriter("sf://out/part-%06d.tar", maxcount=2, verbose=0) as sink:
        for i in range(5):
            sink.write({"__key__": f"k{i:03d}", "txt": f"value {i}"})
    assert fs.ls("out", detail=False) == [f"out/part-{n:06d}.tar" for n in range(3)]  # no temporary names left
    back = [(s["__key__"], s["txt"]) for s in wds.WebDataset("sf://out/part-{000000..000002}.tar", shardshuffle=False)]
    assert back == [(f"k{i:03d}", f"value {i}".encode()) for i in range(5)]


def test_missing_shard_is_a_typed_error(shards: list[tuple[str, bytes]]) -> None:
    with pytest.raises(errors.PathNotFoundError, match=r"train-000009\.tar"):
        list(wds.WebDataset("sf://shards/train-000009.tar", shardshuffle=False))
    with pytest.raises(errors.InvalidRequestError):
        webdataset_gopen.gopen_sf("sf://shards/train-000000.tar", "ab")


def test_a_handler_of_the_users_stays() -> None:
    def mine(url: str, mode: str = "rb", bufsize: int = 8192) -> Any:
        raise AssertionError("not called")

    schemes: dict[str, Any] = {"sf": mine}
    webdataset_gopen.register(schemes)
    assert schemes["sf"] is mine


@pytest.mark.parametrize("first", ["sfstore", "webdataset"])
def test_registered_whichever_is_imported_first(first: str, shards: list[tuple[str, bytes]]) -> None:
    """In a fresh interpreter: importing sfstore.fs before webdataset (through the import hook) or after it."""
    imports = ["import sfstore.fs", "import webdataset"]
    if first == "webdataset":
        imports.reverse()
    code = "\n".join([
        "import sys",
        *imports,
        "from sfstore.integrations.webdataset_gopen import _RegisterAfterImport, gopen_sf",
        "assert sys.modules['webdataset.gopen'].gopen_schemes['sf'] is gopen_sf",
        "assert not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path)",
        f"print(sum(1 for _ in webdataset.WebDataset({SHARDS!r}, shardshuffle=False)))",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(shards))


def test_sfstore_is_not_importing_webdataset() -> None:
    code = "import sys, sfstore.fs; assert 'webdataset' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_tensor_batches_from_sf_shards(shards: list[tuple[str, bytes]]) -> None:
    dataset = wds.WebDataset(SHARDS, shardshuffle=False).decode().to_tuple("cls").map_tuple(torch.tensor)
    batch = torch.stack([c for (c,) in dataset])
    assert batch.tolist() == [s * 10 + i for s in range(4) for i in range(3)]
