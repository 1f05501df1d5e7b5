"""``sfstore.fs.local_path``: the host path an ``sf://`` url names, for tools that take plain paths.

What it gives is where ``sf://`` and ``sfstore.checkpoint`` find what a tool wrote there: ``transformers``'
``save_pretrained`` into ``local_path("sf://...")`` is read back by ``checkpoint.load("sf://...")`` and listed by
the ``sf://`` filesystem; escapes (``..``, symlinks out of the root) and other schemes are typed errors.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
import torch

from sfstore import checkpoint, errors
from sfstore.fs import local_path


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("SFSTORE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "root").mkdir(exist_ok=True)
    return Path(os.path.realpath(tmp_path / "root"))


def test_names_what_sf_names(root: Path) -> None:
    for url in ("sf://runs/exp1", "sf:///runs/exp1", "runs/exp1", "/runs/exp1", "sf://runs/./x/../exp1"):
        assert local_path(url) == str(root / "runs" / "exp1"), url
    assert local_path("sf://") == str(root)
    assert local_path(Path("runs/exp1")) == str(root / "runs" / "exp1")
    other = root.parent / "elsewhere"
    other.mkdir()
    assert local_path("sf://a", root=str(other)) == str(other / "a")
    # A tool writes plain files there; sf:// and checkpoint.save see one tree.
    os.makedirs(local_path("sf://runs/exp1"))
    torch.save({"x": torch.arange(3)}, os.path.join(local_path("sf://runs/exp1"), "extra.pt"))
    checkpoint.save({"w": torch.ones(2)}, "sf://runs/exp1/ck")
    fs = fsspec.filesystem("sf")
    assert sorted(os.path.basename(p) for p in fs.ls("sf://runs/exp1", detail=False)) == ["ck", "extra.pt"]
    assert os.path.isdir(os.path.join(local_path("sf://runs/exp1"), "ck"))


def test_escapes_and_other_schemes_are_refused(root: Path) -> None:
    with pytest.raises(errors.PathEscapeError):
        local_path("sf://../outside")
    with pytest.raises(errors.PathEscapeError):
        local_path("sf://a/../../outside")
    outside = root.parent / "outside"
    outside.mkdir()
    os.symlink(outside, root / "link")
    with pytest.raises(errors.PathEscapeError):
        local_path("sf://link/x")
    os.symlink(root / "real", root / "inside-link")
    (root / "real").mkdir()
    assert local_path("sf://inside-link/x") == str(root / "real" / "x")  # symlinks resolved, inside
    with pytest.raises(errors.InvalidRequestError, match="sf://"):
        local_path("s3://bucket/x")
    with pytest.raises(errors.PathEscapeError):
        local_path("sf://a\x00b")


def test_save_pretrained_into_local_path_is_loaded_over_sf(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(local_path("sf://models/tiny"))  # the recipe for tools that take plain paths
    weights = checkpoint.load("sf://models/tiny")
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    assert set(weights) == set(want) and all(torch.equal(weights[k], want[k]) for k in want)
    assert fsspec.filesystem("sf").isfile("sf://models/tiny/config.json")
