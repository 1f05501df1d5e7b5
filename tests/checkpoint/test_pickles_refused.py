"""A pickle given to ``checkpoint.load`` is named for what it is (never unpickled), not called a corrupt checkpoint."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from sfstore import checkpoint, errors


class _Boom:
    """Unpickling this would run code: a load that unpickled would raise RuntimeError, not the typed error."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_explode, ("unpickled!",))


def _explode(msg: str) -> None:
    raise RuntimeError(msg)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_torch_save_file_is_an_unsupported_format_with_a_way_to_convert(tmp_path: Path, legacy: bool) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3), "trap": _Boom()}, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(errors.UnsupportedFormatError) as got:
        checkpoint.load(path)
    assert isinstance(got.value, ValueError) and not isinstance(got.value, errors.CorruptCheckpointError)
    text = str(got.value)
    assert ("torch.save file" if not legacy else "pickle") in text
    assert "never unpickles" in text and "weights_only=True" in text and "checkpoint.save" in text
    assert "header length" not in text
    with pytest.raises(errors.UnsupportedFormatError):  # into= takes the same way in
        checkpoint.load(path, into={"w": torch.zeros(3)})


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_plain_pickles_are_refused(tmp_path: Path, protocol: int) -> None:
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps({"trap": _Boom()}, protocol=protocol))
    with pytest.raises(errors.UnsupportedFormatError, match=f"pickle \\(protocol {protocol}"):
        checkpoint.load(path)


def test_numpy_files_are_named(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(4))
    np.savez(tmp_path / "b.npz", x=np.arange(4))
    with pytest.raises(errors.UnsupportedFormatError, match=r"NumPy \.npy"):
        checkpoint.load(tmp_path / "a.npy")
    with pytest.raises(errors.UnsupportedFormatError, match=r"NumPy \.npz"):
        checkpoint.load(tmp_path / "b.npz")


def test_directory_with_only_pytorch_model_bin_says_so(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    torch.save({"w": torch.ones(2)}, model / "pytorch_model.bin")
    (model / "config.json").write_text("{}")
    with pytest.raises(errors.PathNotFoundError) as got:  # no weights sfstore reads: not a checkpoint, and why
        checkpoint.load(model)
    assert "only pickles (pytorch_model.bin)" in str(got.value) and "weights_only=True" in str(got.value)


def test_safetensors_whose_first_byte_is_the_pickle_opcode_still_loads(tmp_path: Path) -> None:
    # A header of 0x0280 = 640 bytes starts the file with b"\x80\x02", as a protocol 2 pickle starts.
    from safetensors.torch import load_file

    data = torch.arange(4, dtype=torch.float32)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    header += b" " * (640 - len(header))
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", 640) + header + data.numpy().tobytes())
    assert path.read_bytes()[:2] == b"\x80\x02"
    assert torch.equal(load_file(path)["x"], data)  # a valid safetensors file
    assert torch.equal(checkpoint.load(path)["x"], data)


def test_corrupt_safetensors_is_still_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(errors.CorruptCheckpointError, match="header length"):
        checkpoint.load(path)
