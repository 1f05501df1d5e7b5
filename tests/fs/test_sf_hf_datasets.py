"""Hugging Face ``datasets`` on ``sf://``: ``data_files`` URLs work; ``data_dir`` is taken as a local path.

``load_dataset("parquet", data_dir=...)`` builds its base path with ``Path(data_dir).expanduser().resolve()``
(``datasets.load.PackagedDatasetModuleFactory.get_module``; ``LocalDatasetModuleFactory`` does the same with
``Path(path, data_dir)``) before fsspec is asked anything, so any URL there — ``sf://``, ``s3://``, ``gs://`` —
becomes a local directory named ``sf:`` under the working directory; no filesystem can change that (upstream:
huggingface/datasets#5281, "data_dir doesn't work on s3, only data_files"). ``data_files`` patterns go through
fsspec's ``url_to_fs`` and glob instead: the spelling that works is ``data_files="sf://dir/*.parquet"`` (or
``"sf://dir/**"``, what ``data_dir`` would have meant). Where a ``data_dir`` is wanted (a builder config that
sets one), ``sfstore.fs.local_path("sf://dir")`` is the host path of the same directory.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pandas as pd
import pytest
from datasets.data_files import EmptyDatasetError


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    # load_dataset sends a download-count HEAD request to the Hub (3 s timeout, errors ignored): none here.
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", False)


def _write_splits() -> None:
    for split, start in (("train", 0), ("test", 100)):
        for part in range(2):
            df = pd.DataFrame({"id": range(start + part * 5, start + part * 5 + 5), "split": split})
            df.to_parquet(f"sf://hf/data/{split}-{part:05d}.parquet")


def test_data_files_urls(tmp_path: Path) -> None:
    _write_splits()
    cache = str(tmp_path / "hf-cache")
    whole = datasets.load_dataset("parquet", data_files="sf://hf/data/*.parquet", cache_dir=cache)
    assert sorted(whole["train"]["id"]) == [*range(10), *range(100, 110)]
    splits = datasets.load_dataset(
        "parquet",
        data_files={"train": "sf://hf/data/train-*.parquet", "test": "sf://hf/data/test-*.parquet"},
        cache_dir=cache,
    )
    assert sorted(splits["train"]["id"]) == list(range(10)) and sorted(splits["test"]["id"]) == list(range(100, 110))
    # "**": every file below, as data_dir would have taken them.
    below = datasets.load_dataset("parquet", data_files="sf://hf/**", cache_dir=cache)
    assert len(below["train"]) == 20


def test_streaming_reads_through_sf(tmp_path: Path) -> None:
    _write_splits()
    stream = datasets.load_dataset("parquet", data_files="sf://hf/data/train-*.parquet", split="train",
                                   streaming=True, cache_dir=str(tmp_path / "hf-cache"))
    assert sorted(row["id"] for row in stream) == list(range(10))


def test_data_dir_url_is_a_local_path_in_datasets(tmp_path: Path) -> None:
    """datasets, not sfstore: ``data_dir`` never reaches fsspec. Should datasets start resolving it as a URL,
    this test fails and README's advice can change."""
    _write_splits()
    with pytest.raises(EmptyDatasetError) as err:
        datasets.load_dataset("parquet", data_dir="sf://hf/data", cache_dir=str(tmp_path / "hf-cache"))
    assert f"{tmp_path}/sf:/hf/data" in str(err.value)  # the working directory is tmp_path (conftest)
    assert not (tmp_path / "sf:").exists()


def test_data_dir_as_the_host_path_of_an_sf_url(tmp_path: Path) -> None:
    """pyarrow writes the dataset through sf://; data_dir takes the host path local_path gives for it."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sfstore.fs import local_path

    fs = fsspec.filesystem("sf")
    for split, start in (("train", 0), ("test", 100)):
        table = pa.table({"id": list(range(start, start + 7)), "split": [split] * 7})
        pq.write_table(table, f"sf://hf/arrow/{split}-00000.parquet", filesystem=fs)
    cache = str(tmp_path / "hf-cache")
    got = datasets.load_dataset("parquet", data_dir=local_path("sf://hf/arrow"), cache_dir=cache)
    assert sorted(got["train"]["id"]) == list(range(7)) and sorted(got["test"]["id"]) == list(range(100, 107))
    same = datasets.load_dataset("parquet", data_files="sf://hf/arrow/**", cache_dir=cache)  # the URL spelling
    assert sorted(same["train"]["id"]) == [*range(7), *range(100, 107)]
