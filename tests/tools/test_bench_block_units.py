"""``tools.bench.block_units``: both sides read real values back from a real block store (small sizes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.block_units import main, measure


def test_both_sides_read_the_same_bytes_and_give_a_ratio(tmp_path: Path) -> None:
    out = measure(str(tmp_path), 64 << 10, 256 << 10, 1 << 20, pairs=2)
    assert out["bytes"] == 1 << 20 and set(out["median_s"]) == {"blocks", "chunks"}
    assert out["chunks_faster"] > 0 and not list(tmp_path.iterdir())  # the image file is removed


def test_sizes_that_do_not_divide_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        measure(str(tmp_path), 64 << 10, 100 << 10, 1 << 20, pairs=1)


def test_main_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dir", str(tmp_path), "--block", "64k", "--chunk", "256k", "--bytes", "1m", "--pairs", "2"]) == 0
    assert "as fast" in capsys.readouterr().out
