"""Bit flips in ``sfstore-manifest.json``: every flip is refused with a typed error, none changes a value silently.

The manifest carries the state dict's non-tensor values (optimizer hyper-parameters, names, steps), its
nesting, the caller's metadata, the shard list and every tensor's sum. Its own ``manifest_xxh3_64`` covers all
of that, so one flipped bit anywhere in the file is a :class:`~sfstore.errors.CorruptCheckpointError` for
``load`` and a checkpoint ``list``/``latest`` leave out, never a renamed key or a changed number. Trials:
2,000 x ``SFSTORE_RELIABILITY_SCALE`` (seeded), each one bit of a realistic training checkpoint's manifest.
"""

from __future__ import annotations

import collections
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from sfstore import checkpoint, errors
from sfstore.checkpoint import MANIFEST_NAME
from sfstore.testing.checkpoint_crash import states_equal

TRIALS = 2000
METADATA = {"step": 1234, "epoch": 3, "run": "exp-7", "tags": ["bf16", "fsdp"], "loss": 2.345, "ok": True}


def training_state() -> dict[str, Any]:
    """A small model and AdamW optimizer/scheduler state, with the non-tensor values such a state holds."""
    g = torch.Generator().manual_seed(0)
    model = collections.OrderedDict(
        (name, torch.randn(shape, generator=g).to(dtype))
        for name, shape, dtype in [
            ("embed.weight", (16, 8), torch.bfloat16),
            ("layers.0.attn.qkv.weight", (24, 8), torch.bfloat16),
            ("layers.0.norm.weight", (8,), torch.float32),
            ("lm_head.bias", (16,), torch.float32),
        ]
    )
    state = {
        i: {"step": torch.tensor(1234.0), "exp_avg": torch.zeros_like(p, dtype=torch.float32),
            "exp_avg_sq": torch.full(p.shape, 1e-4)}
        for i, p in enumerate(model.values())
    }
    groups = [
        {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "foreach": None,
         "maximize": False, "capturable": False, "differentiable": False, "fused": None, "params": [0, 1, 2, 3]},
    ]
    return {
        "model": model,
        "optimizer": {"name": "adamw", "state": state, "param_groups": groups},
        "scheduler": {"last_epoch": 1234, "base_lrs": [3e-4], "_last_lr": [2.9e-4], "warmup": (100, "linear")},
        "rng": {"seed": 42, "state": bytes(range(32)), "cuda": None},
        "dtype": torch.bfloat16,
        "shape": torch.Size([16, 8]),
        "step": 1234,
        "nested": {"a": [1, [2, [3, {"b": -0.0}]]], (1, "k"): "tuple key", 7: float("inf")},
    }


def _listed(parent: Path) -> list[checkpoint.CheckpointInfo]:
    return checkpoint.list(parent)


def test_one_bit_flip_in_the_manifest_never_changes_a_value_silently(tmp_path: Path, scale: int) -> None:
    state = training_state()
    good_dir = tmp_path / "good"
    info = checkpoint.save(state, good_dir / "ck", metadata=METADATA)
    original = checkpoint.load(info)
    assert states_equal(original, state)
    good = (good_dir / "ck" / MANIFEST_NAME).read_bytes()

    trial_parent = tmp_path / "trial"
    ck = trial_parent / "ck"
    shutil.copytree(good_dir / "ck", ck)
    rng = random.Random(20240611)
    outcomes: collections.Counter[str] = collections.Counter()
    silent: list[str] = []
    untyped: list[str] = []
    for trial in range(TRIALS * scale):
        bit = rng.randrange(len(good) * 8)
        raw = bytearray(good)
        raw[bit // 8] ^= 1 << (bit % 8)
        (ck / MANIFEST_NAME).write_bytes(bytes(raw))
        where = f"trial {trial}: bit {bit % 8} of byte {bit // 8} ({good[bit // 8:bit // 8 + 1]!r})"
        try:
            got = checkpoint.load(ck)
        except errors.SfstoreError:
            outcomes["refused"] += 1
        except Exception as exc:
            untyped.append(f"{where}: {type(exc).__name__}: {exc}")
        else:
            if states_equal(got, original):
                outcomes["exact"] += 1
            else:
                silent.append(f"{where}: load returned a different state")
            del got
        try:
            listed = _listed(trial_parent)
        except Exception as exc:
            untyped.append(f"{where}: list raised {type(exc).__name__}: {exc}")
            continue
        if listed:
            (li,) = listed
            if (li.metadata, li.step, li.created_ns, li.num_tensors, li.tensor_bytes, li.num_shards) != (
                METADATA, 1234, info.created_ns, info.num_tensors, info.tensor_bytes, info.num_shards
            ):
                silent.append(f"{where}: list() reported {li}")
    total = TRIALS * scale
    changed = len({s.split(":")[0] for s in silent})
    print(f"manifest bit flips: {total} trials; load: {outcomes['refused']} refused (typed), {outcomes['exact']} "
          f"returned the original; {changed} trials with a silent change in load or list ({len(silent)} results), "
          f"{len(untyped)} untyped errors")
    assert not untyped, untyped[:5]
    assert not silent, f"{changed} of {total} flips changed a value silently: {silent[:5]}"
    assert outcomes["refused"] + outcomes["exact"] == total
