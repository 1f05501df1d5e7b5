"""pyarrow datasets on ``sf://``: hive-partitioned parquet written and discovered with every spelling of a path.

pyarrow wraps an fsspec filesystem in its ``FSSpecHandler``, which hands the caller's path to ``find``
unchanged and requires every name found to start with it; :meth:`SFFileSystem.find` names what it finds in the
spelling it was given, so ``"sf://pa/hive"``, ``"/pa/hive"`` and ``"pa/hive"`` all work.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from sfstore.fs import SFFileSystem

SPELLINGS = ["sf://pa/hive", "pa/hive", "/pa/hive", "sf:///pa/hive", "sf://pa/hive/"]


def _table() -> pa.Table:
    return pa.table({"year": [2020, 2020, 2021, 2022], "city": ["a", "b", "a", "c"], "v": [1, 2, 3, 4]})


def _rows(table: pa.Table) -> list[tuple[int, str, int]]:
    d = table.to_pydict()
    return sorted(zip((int(y) for y in d["year"]), d["city"], d["v"], strict=True))


@pytest.mark.parametrize("written", ["sf://pa/hive", "pa/hive", "/pa/hive"])
@pytest.mark.parametrize("read", SPELLINGS)
def test_hive_round_trip_with_every_spelling(sffs: SFFileSystem, sf_root: Path, written: str, read: str) -> None:
    ds.write_dataset(_table(), written, filesystem=sffs, format="parquet",
                     partitioning=["year", "city"], partitioning_flavor="hive")
    assert (sf_root / "pa" / "hive" / "year=2020" / "city=b").is_dir()
    dataset = ds.dataset(read, filesystem=sffs, partitioning="hive", format="parquet")
    assert _rows(dataset.to_table()) == _rows(_table())
    assert len(dataset.files) == 4 and all(f.startswith(read.rstrip("/") + "/year=") for f in dataset.files)
    only = dataset.to_table(filter=ds.field("year") == 2020)
    assert sorted(only.column("v").to_pylist()) == [1, 2]
    assert _rows(pq.read_table(read, filesystem=sffs, partitioning="hive")) == _rows(_table())


def test_write_to_dataset_and_parquet_dataset(sffs: SFFileSystem) -> None:
    pq.write_to_dataset(_table(), "sf://pa/w2d", filesystem=sffs, partition_cols=["year"])
    assert sorted(sffs.ls("pa/w2d", detail=False)) == ["pa/w2d/year=2020", "pa/w2d/year=2021", "pa/w2d/year=2022"]
    for path in ("sf://pa/w2d", "pa/w2d"):
        back = pq.ParquetDataset(path, filesystem=sffs).read()
        assert sorted(back.column("v").to_pylist()) == [1, 2, 3, 4]
        assert sorted(set(back.column("year").to_pylist())) == [2020, 2021, 2022]


def test_the_root_itself_as_a_dataset(sffs: SFFileSystem) -> None:
    pq.write_table(_table(), "sf://t.parquet", filesystem=sffs)
    for path in ("sf://", "/", ""):
        assert ds.dataset(path, filesystem=sffs, format="parquet").to_table().num_rows == 4


def test_pandas_hive_parquet_through_urls() -> None:
    """pandas resolves ``sf://`` itself (fsspec's url_to_fs, the default root): no filesystem argument."""
    df = pd.DataFrame({"year": [2020, 2021, 2021], "v": [1.5, 2.5, 3.5]})
    df.to_parquet("sf://tables/hive", partition_cols=["year"])
    back = pd.read_parquet("sf://tables/hive")
    assert sorted(back["v"]) == [1.5, 2.5, 3.5]
    assert sorted(int(y) for y in back["year"]) == [2020, 2021, 2021]
    one = pd.read_parquet("sf://tables/hive", filters=[("year", "=", 2021)])
    assert sorted(one["v"]) == [2.5, 3.5]


def test_pyarrow_resolves_fsspec_plus_sf_urls_without_a_filesystem() -> None:
    pq.write_table(_table(), "fsspec+sf://tables/plain.parquet")
    assert pq.read_table("fsspec+sf://tables/plain.parquet").num_rows == 4
    assert ds.dataset("fsspec+sf://tables", format="parquet").to_table().num_rows == 4


def test_find_spells_names_as_it_was_given(sffs: SFFileSystem) -> None:
    sffs.pipe_file("d/sub/x", b"1")
    sffs.pipe_file("top", b"2")
    assert sffs.find("d") == ["d/sub/x"]
    assert sffs.find("sf://d") == ["sf://d/sub/x"]
    assert sffs.find("/d/") == ["/d/sub/x"]
    assert sffs.find("sf://d/./sub", withdirs=True) == ["sf://d/./sub", "sf://d/./sub/x"]
    assert sffs.find("sf://") == ["sf://d/sub/x", "sf://top"] and sffs.find("") == ["d/sub/x", "top"]
    found = sffs.find("sf://d", withdirs=True, detail=True)
    assert {k: v["name"] for k, v in found.items()} == {"sf://d": "sf://d", "sf://d/sub": "sf://d/sub",
                                                         "sf://d/sub/x": "sf://d/sub/x"}
    assert found["sf://d/sub/x"]["size"] == 1 and found["sf://d/sub"]["type"] == "directory"
    assert sffs.find("sf://top") == ["sf://top"]
    # fsspec's own methods strip the protocol first: root-relative names, as ls, glob and info give.
    assert sffs.glob("sf://d/**") == ["d", "d/sub", "d/sub/x"] and sffs.ls("sf://d", detail=False) == ["d/sub"]
    assert sffs.expand_path("sf://d", recursive=True) == ["d", "d/sub", "d/sub/x"]
    assert sffs.du("sf://d") == 1
