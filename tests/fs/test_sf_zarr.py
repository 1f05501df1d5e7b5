"""zarr (v3) arrays on sf:// through fsspec: written, read back, resized, listed — against the real zarr package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path))
    return tmp_path


def test_zarr_array_round_trips_on_sf(root: Path) -> None:
    data = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    z = zarr.open_array("sf://arrays/a.zarr", mode="w", shape=data.shape, chunks=(16, 16), dtype="float32")
    z[:] = data
    back = zarr.open_array("sf://arrays/a.zarr", mode="r")
    assert back.shape == data.shape and np.array_equal(back[:], data)
    assert np.array_equal(back[10:20, 5:9], data[10:20, 5:9])  # a few chunks, not all
    # the chunks are files under the sf:// root, published atomically (no temporary names left)
    files = [p for p in (root / "arrays" / "a.zarr").rglob("*") if p.is_file()]
    assert len(files) >= 1 + 4 * 3 and not any(".sfstore-tmp-" in p.name for p in files)


def test_zarr_group_with_attributes_and_resize(root: Path) -> None:
    g = zarr.open_group("sf://groups/g.zarr", mode="w")
    g.attrs["model"] = "tiny"
    a = g.create_array("x", shape=(8,), chunks=(4,), dtype="int64")
    a[:] = np.arange(8)
    a.resize((12,))
    a[8:] = np.arange(8, 12)
    again = zarr.open_group("sf://groups/g.zarr", mode="r")
    assert again.attrs["model"] == "tiny" and np.array_equal(again["x"][:], np.arange(12))
    assert sorted(again.array_keys()) == ["x"]
