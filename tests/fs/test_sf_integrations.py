"""``sf://`` under the libraries that use fsspec: pandas/pyarrow parquet, torch DataLoader workers, UPath."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from upath import UPath

from sfstore.fs import SFFileSystem


def test_pandas_parquet_round_trip(tmp_path: Path) -> None:
    df = pd.DataFrame(
        {"id": range(1000), "label": [f"item-{i % 7}" for i in range(1000)], "x": [i / 3 for i in range(1000)]}
    )
    df.to_parquet("sf://tables/items.parquet", row_group_size=100)
    assert (tmp_path / "env-root" / "tables" / "items.parquet").is_file()
    back = pd.read_parquet("sf://tables/items.parquet")
    pd.testing.assert_frame_equal(back, df)
    cols = pd.read_parquet("sf://tables/items.parquet", columns=["x"])
    assert list(cols.columns) == ["x"] and cols["x"].iloc[-1] == pytest.approx(999 / 3)


def test_pyarrow_dataset_through_the_filesystem(sffs: SFFileSystem) -> None:
    for part in range(3):
        table = pa.table({"part": [part] * 50, "v": list(range(part * 50, part * 50 + 50))})
        pq.write_table(table, f"ds/part-{part}.parquet", filesystem=sffs)
    assert sffs.ls("ds", detail=False) == [f"ds/part-{p}.parquet" for p in range(3)]
    whole = pq.read_table("ds", filesystem=sffs)
    assert whole.num_rows == 150 and sorted(whole.column("v").to_pylist()) == list(range(150))
    meta = pq.ParquetFile(sffs.open("ds/part-1.parquet")).metadata
    assert meta.num_rows == 50


class _Files(Dataset[torch.Tensor]):
    """Reads ``n`` files through an ``sf://`` filesystem made in the parent (inherited by forked workers)."""

    def __init__(self, n: int) -> None:
        self.fs = fsspec.filesystem("sf")
        self.n = n
        engine = self.fs.file_path.engine
        self.parent_engine = (id(engine), engine.name)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        whole = self.fs.cat_file(f"sf://train/{i:02d}.bin")
        with fsspec.open(f"sf://train/{i:02d}.bin", "rb") as f:  # a filesystem made in the worker too
            assert f.read() == whole
        buf = torch.zeros(len(whole), dtype=torch.uint8)
        assert self.fs.read_into(f"train/{i:02d}.bin", buf) == len(whole)
        assert bytes(buf.numpy()) == whole
        engine = self.fs.file_path.engine
        assert not engine.closed
        if self.parent_engine[1] != "python":  # native engines' threads do not survive fork: the child made its own
            assert id(engine) != self.parent_engine[0]
        return torch.tensor([os.getpid(), i, len(whole), whole[0]])


def test_dataloader_fork_workers_read_through_sf() -> None:
    fs = fsspec.filesystem("sf")
    for i in range(12):
        fs.pipe_file(f"train/{i:02d}.bin", bytes([i]) * (500 + i))
    fs.cat_file("train/00.bin")  # the parent's engine is running before the fork
    loader = DataLoader(_Files(12), batch_size=3, num_workers=2, multiprocessing_context="fork")
    rows: list[Any] = torch.cat(list(loader)).tolist()
    assert sorted(r[1] for r in rows) == list(range(12))
    assert all(r[2] == 500 + r[1] and r[3] == r[1] for r in rows)
    workers = {r[0] for r in rows}
    assert len(workers) == 2 and os.getpid() not in workers
    assert fs.cat_file("train/11.bin") == bytes([11]) * 511  # the parent still works afterwards


def test_upath_read_write(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        # universal_pathlib warns that it has no dedicated UPath class for "sf" and uses its generic one.
        warnings.filterwarnings("ignore", message="UPath 'sf' filesystem not explicitly implemented")
        base = UPath("sf://up")
        (base / "a.txt").write_text("alpha")
        (base / "sub" / "b.bin").write_bytes(b"beta")
        assert (tmp_path / "env-root" / "up" / "a.txt").read_text() == "alpha"
        assert UPath("sf://up/a.txt").read_text() == "alpha"
        assert sorted(p.name for p in base.iterdir()) == ["a.txt", "sub"]
        assert [p.name for p in base.glob("**/*.bin")] == ["b.bin"]
        p = UPath("sf://up/sub/b.bin")
        assert p.exists() and p.is_file() and p.parent.is_dir() and p.stat().st_size == 4
        assert str(p) == "sf://up/sub/b.bin" and UPath(str(p)).read_bytes() == b"beta"
        p.unlink()
        assert not p.exists()
        with pytest.raises(PermissionError):
            UPath("sf://up/../../x").read_bytes()
