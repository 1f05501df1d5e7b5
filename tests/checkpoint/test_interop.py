"""Interop with the safetensors package, both ways, for every dtype."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import xxhash
from ckpt_helpers import ALL_DTYPES, SAFETENSORS_DTYPES, random_tensor, same

from sfstore import checkpoint
from sfstore.checkpoint import MANIFEST_NAME
from sfstore.checkpoint import safetensors_format as stf
from sfstore.checkpoint.manifest import Manifest, ShardRecord, TensorRecord


def _shapes(dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
    shapes = {"m": (5, 4), "v": (9,), "empty": (0, 3)}
    if dtype != torch.float4_e2m1fn_x2:  # safetensors cannot write a 0-d F4 (half a byte)
        shapes["scalar"] = ()
    return shapes


def test_load_file_reads_every_shard_bit_exactly_for_every_dtype(tmp_path: Path) -> None:
    """One checkpoint holding every dtype, many shards: safetensors.torch.load_file reads each shard, and
    its tensors are byte-for-byte what was saved (complex128/complex32 as their [..., 2] float pairs, torch's
    bit-container dtypes as raw bytes)."""
    flat = {
        f"{str(d).split('.')[-1]}.{name}": random_tensor(d, shape, seed=i)
        for i, d in enumerate(ALL_DTYPES)
        for name, shape in _shapes(d).items()
    }
    state = {"nested": flat}
    info = checkpoint.save(state, tmp_path / "ck", max_shard_bytes=200)
    assert info.num_shards > 5
    seen: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(tmp_path / "ck")):
        if f.endswith(".safetensors"):
            loaded = st.load_file(str(tmp_path / "ck" / f))
            assert not set(loaded) & set(seen)
            seen.update(loaded)
    assert set(seen) == {f"nested/{k}" for k in flat}
    for name, original in flat.items():
        got = seen[f"nested/{name}"]
        if original.dtype in SAFETENSORS_DTYPES:
            assert got.dtype == original.dtype and got.shape == original.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), original.reshape(-1).view(torch.uint8)), name
    assert same(checkpoint.load(tmp_path / "ck"), state)


@pytest.mark.parametrize("dtype", SAFETENSORS_DTYPES, ids=str)
def test_safetensors_native_dtypes_have_their_safetensors_name(tmp_path: Path, dtype: torch.dtype) -> None:
    t = random_tensor(dtype, (4, 2))
    st.save_file({"x": t}, str(tmp_path / "ref.safetensors"))
    checkpoint.save({"x": t}, tmp_path / "ck")
    ref = json.loads((tmp_path / "ref.safetensors").read_bytes()[8:].split(b"}}")[0] + b"}}")
    ours = stf.parse_header((tmp_path / "ck" / "model.safetensors").read_bytes(), os.path.getsize(
        tmp_path / "ck" / "model.safetensors"), shard="s")  # a flat dict of tensors: Hugging Face's name
    assert ours.entries["x"].dtype == ref["x"]["dtype"] and list(ours.entries["x"].shape) == ref["x"]["shape"]


def test_load_reads_a_plain_safetensors_file(tmp_path: Path) -> None:
    tensors = {f"{str(d).split('.')[-1]}": random_tensor(d, (6, 4), seed=i) for i, d in enumerate(SAFETENSORS_DTYPES)}
    tensors["empty"] = torch.empty(0, 5)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    path = tmp_path / "model.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    out = checkpoint.load(path)
    assert set(out) == set(tensors)
    for k, v in tensors.items():
        assert same(out[k], v), k
    assert same(checkpoint.load(f"file://{path}"), out)


def test_load_reads_shards_written_by_safetensors_with_a_manifest(tmp_path: Path) -> None:
    """A checkpoint directory whose shards safetensors.torch.save_file wrote (its own layout: 8-byte header
    padding, its tensor order) plus a manifest made for them: sfstore loads and verifies it."""
    groups = [
        {"a": torch.randn(10, 3), "b": torch.arange(7, dtype=torch.int16), "c": torch.ones(3, dtype=torch.bfloat16)},
        {"d": torch.randn(5, dtype=torch.complex64), "e": torch.zeros(0), "f": torch.tensor(True)},
    ]
    ck = tmp_path / "ck"
    ck.mkdir()
    tensors: dict[str, TensorRecord] = {}
    shards = []
    for i, group in enumerate(groups):
        name = f"part-{i}.safetensors"
        st.save_file(group, str(ck / name))
        data = (ck / name).read_bytes()
        header = stf.parse_header(data, len(data), shard=name)
        assert header.data_start % 4096 != 0  # not sfstore's layout
        for key, t in group.items():
            e = header.entries[key]
            raw = data[header.data_start + e.begin : header.data_start + e.end]
            tensors[key] = TensorRecord(key, name, "torch", str(t.dtype).split(".")[-1], tuple(t.shape), len(raw),
                                        xxhash.xxh3_64(raw).hexdigest())
        shards.append(ShardRecord(name, len(data), xxhash.xxh3_64(data).hexdigest()))
    structure = {"dict": [[k, {"tensor": k}] for g in groups for k in g]}
    manifest = Manifest(created_ns=1, metadata={"step": 5}, structure=structure, tensors=tensors, shards=shards)
    (ck / MANIFEST_NAME).write_bytes(manifest.to_json())
    out = checkpoint.load(ck)
    assert same(out, {k: v for g in groups for k, v in g.items()})
    info = checkpoint.latest(tmp_path)
    assert info is not None and info.step == 5


def test_safetensors_loads_header_we_pad_to_a_page() -> None:
    header, offsets = stf.build_header([("a", "F32", [3], 12), ("b", "U8", [5], 5)], {"format": "pt"})
    assert len(header) % 4096 == 0 and offsets == [(0, 12), (12, 17)]
    data = header + bytes(range(17))
    loaded = st.load(data)
    assert loaded["b"].tolist() == [12, 13, 14, 15, 16]
    (n,) = struct.unpack("<Q", header[:8])
    assert n == len(header) - 8
