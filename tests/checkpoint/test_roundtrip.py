"""Round trips: nested state dicts, every dtype, numpy, views of the read buffers, into=, async, list/latest."""

from __future__ import annotations

import collections
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import ALL_DTYPES, random_tensor, same

from sfstore import checkpoint, defaults, errors
from sfstore.checkpoint import MANIFEST_NAME


def nested_state() -> dict[str, object]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "ints": [0, -1, 2**70, -(2**63)],
        "floats": (1.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-310, 0.1),
        "strings": ["", "päth/with~slash", "\ud800 lone surrogate", "null\x00byte"],
        "flags": {True: False, None: None},
        "tuple_vs_list": ([1, 2], (1, 2), [], ()),
        "keys": {0: "int", "0": "str", 1.5: "float", (1, "a"): "tuple", b"k": "bytes"},
        "bytes": b"\x00\xff raw",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "deep": {"a": {"b": {"c": [{"d": torch.arange(5)}]}}},
    }


def test_nested_state_dict_round_trips_exactly(tmp_path: Path) -> None:
    state = nested_state()
    info = checkpoint.save(state, tmp_path / "ck", metadata={"step": 42, "note": "x"})
    assert info.step == 42 and info.metadata == {"step": 42, "note": "x"} and info.num_shards == 1
    out = checkpoint.load(tmp_path / "ck")
    assert same(out, state)
    assert type(out["model"]) is collections.OrderedDict
    assert type(out["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert isinstance(out["ints"][2], int) and isinstance(out["floats"][0], float)
    assert math.copysign(1.0, out["floats"][1]) == -1.0 and math.isnan(out["floats"][2])
    assert list(out["keys"]) == [0, "0", 1.5, (1, "a"), b"k"]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    state = {
        "t": random_tensor(dtype, (7, 6), seed=1),
        "zero_d": random_tensor(dtype, (), seed=2),
        "empty": random_tensor(dtype, (3, 0), seed=3),
        "strided": random_tensor(dtype, (6, 8), seed=4)[:, ::2],
    }
    checkpoint.save(state, tmp_path / "ck")
    out = checkpoint.load(tmp_path / "ck")
    assert same(out, state)
    assert out["t"].dtype == dtype and out["zero_d"].shape == () and out["empty"].shape == (3, 0)


def test_numpy_arrays_and_scalars_come_back_as_numpy(tmp_path: Path) -> None:
    state = {
        "f32": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4),
        "c128": (np.arange(4) + 1j * np.arange(4)).astype(np.complex128),
        "bool": np.array([True, False]),
        "u64": np.array([2**64 - 1], dtype=np.uint64),
        "big_endian": np.arange(5, dtype=">i4"),
        "strided": np.arange(20, dtype=np.int16)[::3],
        "zero_d": np.array(3.5),
        "read_only": np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),
        "scalar": np.float64(2.25),
        "int_scalar": np.int8(-3),
    }
    checkpoint.save(state, tmp_path / "ck")
    out = checkpoint.load(tmp_path / "ck")
    for key in ("f32", "c128", "bool", "u64", "strided", "zero_d", "read_only"):
        assert isinstance(out[key], np.ndarray) and out[key].dtype == state[key].dtype, key
        assert np.array_equal(out[key], state[key]), key
    assert out["big_endian"].dtype == np.int32 and np.array_equal(out["big_endian"], state["big_endian"])
    assert type(out["scalar"]) is np.float64 and out["scalar"] == 2.25
    assert type(out["int_scalar"]) is np.int8 and out["int_scalar"] == -3


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_unsupported_values_name_their_key(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidRequestError, match="a/1"):
        checkpoint.save({"a": [1, object()]}, tmp_path / "x")
    with pytest.raises(errors.InvalidRequestError, match="numpy array of dtype"):
        checkpoint.save({"a": np.array(["s"])}, tmp_path / "x")
    with pytest.raises(errors.InvalidRequestError, match="quantized"):
        checkpoint.save({"q": torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)}, tmp_path / "x")
    with pytest.raises(errors.InvalidRequestError, match="sparse"):
        checkpoint.save({"s": torch.eye(3).to_sparse()}, tmp_path / "x")
    cyclic: dict[str, object] = {}
    cyclic["me"] = cyclic
    with pytest.raises(errors.InvalidRequestError, match="cycle"):
        checkpoint.save(cyclic, tmp_path / "x")
    with pytest.raises(errors.InvalidRequestError, match="plain JSON"):
        checkpoint.save({}, tmp_path / "x", metadata={"loss": float("nan")})
    assert not (tmp_path / "x").exists() and not [p for p in os.listdir(tmp_path) if ".sfstore-" in p]


def test_shards_split_at_max_shard_bytes_and_big_tensors_get_their_own(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(6)}  # 4 KiB each
    state["big"] = torch.arange(5000, dtype=torch.float64)  # 40 KB, over the limit
    info = checkpoint.save(state, tmp_path / "ck", max_shard_bytes=10_000)
    manifest = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())
    per_shard = collections.Counter(t["shard"] for t in manifest["tensors"].values())
    assert info.num_shards == len(per_shard) == 4 and sorted(per_shard.values()) == [1, 2, 2, 2]
    assert manifest["tensors"]["big"]["shard"] not in {manifest["tensors"][f"t{i}"]["shard"] for i in range(6)}
    assert same(checkpoint.load(tmp_path / "ck"), state)


def test_same_tensor_twice_is_stored_once_and_loads_as_one(tmp_path: Path) -> None:
    w = torch.randn(4, 4)
    info = checkpoint.save({"enc": w, "dec": w, "other": w.clone()}, tmp_path / "ck")
    assert info.num_tensors == 2
    out = checkpoint.load(tmp_path / "ck")
    assert out["enc"] is out["dec"] and torch.equal(out["enc"], w) and out["other"] is not out["enc"]


def test_loaded_tensors_are_views_of_the_shard_buffer(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(1000 + i) for i in range(5)}
    state["b"] = torch.ones(7, dtype=torch.bfloat16)
    checkpoint.save(state, tmp_path / "ck")
    out = checkpoint.load(tmp_path / "ck")
    storages = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(storages) == 1  # one shard, one buffer: every tensor is a view into it
    t0 = out["t0"]
    base, size = t0.untyped_storage().data_ptr(), t0.untyped_storage().nbytes()
    assert base % 4096 == 0  # the registered buffer is page-aligned
    shard_size = (tmp_path / "ck" / "model.safetensors").stat().st_size
    assert shard_size <= size < shard_size + (2 << 20)
    for t in out.values():
        assert base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + size
        assert t.data_ptr() % t.element_size() == 0
    out["t1"][0] = 123.0  # writable, and only that tensor's bytes change
    assert torch.equal(out["t2"], state["t2"])


def test_peak_memory_of_a_load_is_about_the_tensor_bytes(tmp_path: Path) -> None:
    nbytes = 64 << 20
    checkpoint.save({"a": torch.ones(nbytes // 8, dtype=torch.float32), "b": torch.ones(nbytes // 8)}, tmp_path / "ck")
    script = textwrap.dedent(
        f"""
        import torch, sfstore.checkpoint as ck
        from sfstore import buffers
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        ck.load({str(tmp_path / "ck")!r})  # warm up imports and the engine (frees everything again)
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
        base = status("VmRSS")
        state = ck.load({str(tmp_path / "ck")!r})
        print(status("VmHWM") - base)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    growth = int(done.stdout.split()[-1])
    assert growth <= 1.15 * nbytes, f"peak RSS grew {growth / nbytes:.3f}x the tensor bytes"


def test_load_into_fills_existing_tensors_in_place(tmp_path: Path) -> None:
    src = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
    checkpoint.save(src.state_dict(), tmp_path / "ck", max_shard_bytes=64)
    dst = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
    ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    out = checkpoint.load(tmp_path / "ck", into=dst)
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k]) and v.data_ptr() == ptrs[k], k
        assert out[k].data_ptr() == ptrs[k]


def test_load_into_a_nested_state_dict_with_strided_numpy_and_scalars(tmp_path: Path) -> None:
    state = {"w": torch.randn(6, 4), "n": np.arange(6.0), "s": np.float32(1.5), "k": [torch.tensor(3)], "lr": 0.5}
    checkpoint.save(state, tmp_path / "ck")
    strided = torch.zeros(4, 6).t()  # a non-contiguous destination goes through a bounce buffer
    into = {"w": strided, "n": np.zeros(6), "s": np.float32(0), "k": [torch.tensor(0)], "lr": 0.0}
    out = checkpoint.load(tmp_path / "ck", into=into)
    assert torch.equal(strided, state["w"]) and out["w"] is strided
    assert np.array_equal(into["n"], state["n"]) and out["n"] is into["n"]
    assert out["k"][0] is into["k"][0] and int(into["k"][0]) == 3
    assert out["s"] == np.float32(1.5) and out["lr"] == 0.5


def test_load_into_refuses_mismatches_naming_the_key(tmp_path: Path) -> None:
    checkpoint.save({"a": {"w": torch.zeros(2, 3)}, "b": torch.zeros(2)}, tmp_path / "ck")
    with pytest.raises(errors.InvalidRequestError, match=r"a/w is float32\[3, 2\]"):
        checkpoint.load(tmp_path / "ck", into={"a": {"w": torch.zeros(3, 2)}, "b": torch.zeros(2)})
    with pytest.raises(errors.InvalidRequestError, match="a/w is float64"):
        checkpoint.load(tmp_path / "ck", into={"a": {"w": torch.zeros(2, 3, dtype=torch.float64)}, "b": torch.zeros(2)})
    with pytest.raises(errors.InvalidRequestError, match="nothing at b"):
        checkpoint.load(tmp_path / "ck", into={"a": {"w": torch.zeros(2, 3)}})
    with pytest.raises(errors.InvalidRequestError, match="no tensors for c"):
        checkpoint.load(tmp_path / "ck", into={"a": {"w": torch.zeros(2, 3)}, "b": torch.zeros(2), "c": torch.ones(1)})


def test_save_async_copies_before_it_returns(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 300), "n": np.arange(10), "step": 1}
    expected = {"w": state["w"].clone(), "n": state["n"].copy(), "step": 1}
    fut = checkpoint.save_async(state, tmp_path / "ck", metadata={"step": 1}, max_shard_bytes=100_000)
    state["w"].mul_(-1)  # training goes on at once
    state["n"][:] = 0
    state["step"] = 2
    info = fut.get(timeout=60)
    assert fut.done() and fut.wait(0) and info.step == 1
    assert same(checkpoint.load(tmp_path / "ck"), expected)


def test_save_async_reports_errors_through_the_future(tmp_path: Path) -> None:
    checkpoint.save({"a": torch.ones(1)}, tmp_path / "ck")
    with pytest.raises(errors.PathExistsError):
        checkpoint.save_async({"a": torch.zeros(1)}, tmp_path / "ck")  # refused before anything is copied
    fut = checkpoint.save_async({"a": torch.zeros(1)}, tmp_path / "ck", overwrite=True)
    assert torch.equal(checkpoint.load(fut.get(60))["a"], torch.zeros(1))


def test_save_async_large_enough_to_use_the_copy_threads(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(1 << 20) for i in range(3)} | {"s": torch.randn(64, 64).t()}  # 12 MiB
    expected = {k: v.clone() for k, v in state.items()}
    fut = checkpoint.save_async(state, tmp_path / "ck", max_shard_bytes=5 << 20)
    for v in state.values():
        v.zero_()
    fut.get(60)
    assert same(checkpoint.load(tmp_path / "ck"), expected)


def test_overwrite_replaces_atomically_and_refuses_non_checkpoints(tmp_path: Path) -> None:
    checkpoint.save({"v": torch.tensor(1)}, tmp_path / "ck")
    with pytest.raises(errors.PathExistsError):
        checkpoint.save({"v": torch.tensor(2)}, tmp_path / "ck")
    checkpoint.save({"v": torch.tensor(2)}, tmp_path / "ck", overwrite=True)
    assert int(checkpoint.load(tmp_path / "ck")["v"]) == 2
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "data.txt").write_text("keep me")
    with pytest.raises(errors.PathExistsError, match="not an sfstore checkpoint"):
        checkpoint.save({"v": torch.tensor(3)}, tmp_path / "precious", overwrite=True)
    assert (tmp_path / "precious" / "data.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["ck", "precious"]  # no staging or old directories left


def test_sf_urls_name_what_fsspec_names_bare_names_the_checkpoint_root(ckroot: Path) -> None:
    import fsspec

    root = ckroot.parent  # the sf:// root; the checkpoint root is <root>/checkpoints
    checkpoint.save({"x": torch.ones(2)}, "sf://ns/run1/step-1", metadata={"step": 1})
    checkpoint.save({"x": torch.ones(3)}, "sf://ns/run1/step-2", metadata={"step": 2})
    assert (root / "ns" / "run1" / "step-1" / MANIFEST_NAME).is_file() and not (ckroot / "ns").exists()
    fs = fsspec.filesystem("sf")
    assert fs.exists("sf://ns/run1/step-1") and fs.isfile(f"sf://ns/run1/step-1/{MANIFEST_NAME}")
    listed = checkpoint.list("sf://ns/run1")
    assert [i.name for i in listed] == ["step-1", "step-2"] and [i.step for i in listed] == [1, 2]
    assert listed[0].url == "sf://ns/run1/step-1"  # in the form the prefix was given
    last = checkpoint.latest("sf:///ns/run1")  # a leading '/' is the sf:// root, as fsspec has it
    assert last is not None and last.step == 2 and checkpoint.load(last)["x"].shape == (3,)
    assert checkpoint.load("sf://ns/run1/step-1")["x"].shape == (2,)
    # Bare names: under the checkpoint root, as before; listed by bare names.
    checkpoint.save({"x": torch.ones(4)}, "run1/step-3", metadata={"step": 3})
    assert (ckroot / "run1" / "step-3" / MANIFEST_NAME).is_file()
    assert [i.url for i in checkpoint.list("run1")] == ["run1/step-3"]
    assert checkpoint.load(checkpoint.latest("run1"))["x"].shape == (4,)  # type: ignore[arg-type]
    assert checkpoint.load("sf://checkpoints/run1/step-3")["x"].shape == (4,)  # the same directory
    assert [i.name for i in checkpoint.list()] == []  # run1 itself is not a checkpoint
    with pytest.raises(errors.PathEscapeError):
        checkpoint.save({}, "sf://../outside")
    with pytest.raises(errors.PathEscapeError):
        checkpoint.save({}, "../outside")
    with pytest.raises(errors.InvalidRequestError):
        checkpoint.save({}, "sf://ns/.hidden")
    with pytest.raises(errors.InvalidRequestError, match="names no directory"):
        checkpoint.save({}, "sf://")
    with pytest.raises(errors.InvalidRequestError, match="sf://name"):
        checkpoint.save({}, "s3://bucket/x")


def test_list_and_latest(tmp_path: Path) -> None:
    assert checkpoint.list(tmp_path / "nothing-here") == [] and checkpoint.latest(tmp_path) is None
    for step in (3, 1, 2):
        checkpoint.save({"s": torch.tensor(step)}, tmp_path / f"ck-{step}", metadata={"step": step})
    (tmp_path / "not-a-checkpoint").mkdir()
    (tmp_path / "file.txt").write_text("x")
    names = [i.name for i in checkpoint.list(f"file://{tmp_path}")]
    assert names == ["ck-3", "ck-1", "ck-2"]  # commit order, not name or step order
    last = checkpoint.latest(tmp_path)
    assert last is not None and last.name == "ck-2" and last.created > 0
    assert int(checkpoint.load(last)["s"]) == 2


def test_missing_checkpoint_or_manifest_is_path_not_found(tmp_path: Path) -> None:
    with pytest.raises(errors.PathNotFoundError):
        checkpoint.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.PathNotFoundError, match=r"not a checkpoint: neither sfstore-manifest\.json"):
        checkpoint.load(tmp_path / "empty")
    with pytest.raises(errors.PathNotFoundError):
        checkpoint.load("/nonexistent-root-dir/x/y")


def test_empty_state_dict(tmp_path: Path) -> None:
    info = checkpoint.save({}, tmp_path / "ck")
    assert info.num_shards == 0 and checkpoint.load(tmp_path / "ck") == {}
    checkpoint.save(torch.arange(3), tmp_path / "bare")  # a tensor as the whole state
    assert torch.equal(checkpoint.load(tmp_path / "bare"), torch.arange(3))


def test_o_direct_with_4k_sectors(dio_dir: Path) -> None:
    """On a 4096-byte-sector filesystem O_DIRECT refuses misalignment: every size and tail must still work."""
    state = {"odd": torch.arange(4097, dtype=torch.uint8), "w": torch.randn(3000), "e": torch.empty(0)}
    checkpoint.save(state, dio_dir / "ck", max_shard_bytes=5000)
    assert same(checkpoint.load(dio_dir / "ck"), state)
    into = {"odd": torch.zeros(4097, dtype=torch.uint8), "w": torch.zeros(3000), "e": torch.empty(0)}
    checkpoint.load(dio_dir / "ck", into=into)
    assert same(into, state)
    checkpoint.save_async(state, dio_dir / "ck", overwrite=True).get(60)
    assert same(checkpoint.load(dio_dir / "ck"), state)


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    state = nested_state()
    checkpoint.save(state, tmp_path / "ck")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickling during a checkpoint load")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    assert same(checkpoint.load(tmp_path / "ck"), state)
    source = Path(checkpoint.__file__).parent
    for f in source.glob("*.py"):
        if f.name.startswith("dcp"):
            continue  # torch.distributed.checkpoint glue, checked by its own tests
        code = f.read_text()
        assert not re.search(r"import\s+(pickle|cPickle|dill|marshal|shelve)|\bpickle\.|torch\.load\(", code), f.name


def test_save_buffers_are_reused_or_freed(tmp_path: Path) -> None:
    import sys

    save_mod = sys.modules["sfstore.checkpoint.save"]
    state = {"w": torch.randn(1000), "v": torch.arange(300)}
    checkpoint.save_async(state, tmp_path / "a").get(60)
    kept = list(save_mod.async_buffers.idle)
    assert kept
    state["w"].add_(1)
    checkpoint.save_async(state, tmp_path / "b").get(60)
    assert [id(b) for b in save_mod.async_buffers.idle] == [id(b) for b in kept]  # same buffers, refilled
    assert same(checkpoint.load(tmp_path / "b"), state)
    checkpoint.save(state, tmp_path / "c")
    assert save_mod.ring_buffers.idle
    with defaults.set(checkpoint_reuse_buffers=False):
        checkpoint.save_async(state, tmp_path / "d").get(60)
        checkpoint.save(state, tmp_path / "e")
    assert save_mod.async_buffers.idle == [] and save_mod.ring_buffers.idle == []
    assert same(checkpoint.load(tmp_path / "e"), state)


def test_prepare_async_allocates_the_buffers_the_next_save_async_fills(tmp_path: Path) -> None:
    import sys

    save_mod = sys.modules["sfstore.checkpoint.save"]
    checkpoint.free_buffers()
    state = {"w": torch.randn(300_000), "opt": {"m": torch.randn(1000)}, "step": 7}
    kept = checkpoint.prepare_async(state, max_shard_bytes=1 << 20)
    buffers = list(save_mod.async_buffers.idle)
    assert len(buffers) == 2 and kept == sum(b.capacity for b in buffers)  # a shard of its own for "w"
    assert checkpoint.buffer_stats()["save_async_idle_bytes"] == kept
    assert not (tmp_path / "a").exists()
    checkpoint.save_async(state, tmp_path / "a", max_shard_bytes=1 << 20).get(60)
    # The save copied into the prepared buffers (kept again after it): none was allocated anew.
    assert sorted(map(id, save_mod.async_buffers.idle)) == sorted(map(id, buffers))
    assert same(checkpoint.load(tmp_path / "a"), state)
    with defaults.set(checkpoint_reuse_buffers=False):
        assert checkpoint.prepare_async(state) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensors_round_trip(tmp_path: Path) -> None:
    state = {
        "w": torch.randn(1000, 100, device="cuda"),
        "strided": torch.randn(64, 48, device="cuda").t(),
        "bf16": torch.randn(333, device="cuda").to(torch.bfloat16),
        "cpu": torch.arange(10),
    }
    host = {k: v.cpu().clone() for k, v in state.items()}  # (.cpu() of a CPU tensor is the tensor itself)
    checkpoint.save(state, tmp_path / "ck", max_shard_bytes=100_000)
    assert same(checkpoint.load(tmp_path / "ck"), host)
    on_gpu = checkpoint.load(tmp_path / "ck", device="cuda")
    assert all(v.is_cuda for v in on_gpu.values())
    assert same({k: v.cpu() for k, v in on_gpu.items()}, host)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    into["strided"] = torch.zeros(64, 48, device="cuda").t()  # the saved tensor's shape (48, 64), not contiguous
    checkpoint.load(tmp_path / "ck", into=into)
    assert same({k: v.cpu() for k, v in into.items()}, host)
    fut = checkpoint.save_async(state, tmp_path / "async", max_shard_bytes=100_000)
    for v in state.values():
        v.zero_()
    fut.get(60)
    assert same(checkpoint.load(tmp_path / "async"), host)
