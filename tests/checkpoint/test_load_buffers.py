"""Loads keep their shard buffers for the next load (``checkpoint_reuse_buffers``), never while a tensor of them
is alive, no more than the most recent load took, and give them back on ``free_buffers()``."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import same

from sfstore import checkpoint, defaults
from sfstore.buffers import native_available
from sfstore.checkpoint import host_buffers

pytestmark = pytest.mark.skipif(not native_available()[0], reason="kept buffers are native registered buffers")

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh_buffers() -> None:
    checkpoint.free_buffers()


def _allocated() -> int:
    """Buffers the load pools hold (idle and in use)."""
    return sum(int(p.stats()["allocated"]) for p in host_buffers.load_buffers._pools.values())


def _state(seed: int, mib: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(mib * MIB // 4, generator=g), "small": torch.randint(0, 99, (1000,), generator=g)}


def test_a_second_load_reuses_the_first_loads_buffers(tmp_path: Path) -> None:
    a, b = _state(1), _state(2)
    checkpoint.save(a, tmp_path / "a")
    checkpoint.save(b, tmp_path / "b")
    got = checkpoint.load(tmp_path / "a")
    assert same(got, a)
    held = checkpoint.buffer_stats()
    assert held["load_in_use_bytes"] >= 3 * MIB and held["load_idle_bytes"] == 0
    allocated = _allocated()
    gc.disable()  # the buffer must come back when the last reference goes, not at some later gc pass
    try:
        del got
        idle = checkpoint.buffer_stats()
    finally:
        gc.enable()
    assert idle["load_idle_bytes"] == held["load_in_use_bytes"] and idle["load_in_use_bytes"] == 0
    got = checkpoint.load(tmp_path / "b")  # same shard size: the same buffer, refilled with b's bytes
    assert same(got, b)
    assert _allocated() == allocated
    assert checkpoint.buffer_stats()["load_idle_bytes"] == 0


def test_a_buffer_with_a_live_tensor_is_never_handed_out_again(tmp_path: Path) -> None:
    a, b = _state(1), _state(2)
    checkpoint.save(a, tmp_path / "a")
    checkpoint.save(b, tmp_path / "b")
    first = checkpoint.load(tmp_path / "a")
    keep = first["big"]  # one view keeps its whole shard buffer in use
    del first
    second = checkpoint.load(tmp_path / "b")
    assert torch.equal(keep, a["big"]) and same(second, b)
    # Both loads took one buffer of the size: only one of the two stays idle once everything is gone.
    size = host_buffers.round_size(os.path.getsize(next((tmp_path / "a").glob("*.safetensors"))))
    del keep, second
    stats = host_buffers.load_buffers._pools[size].stats()
    assert (stats["in_use"], stats["free"]) == (0, 1)


def test_sizes_the_latest_load_did_not_take_are_freed(tmp_path: Path) -> None:
    checkpoint.save(_state(1, mib=3), tmp_path / "small")
    checkpoint.save(_state(2, mib=9), tmp_path / "large")
    del checkpoint.load(tmp_path / "small")["big"]
    gc.collect()
    small_idle = checkpoint.buffer_stats()["load_idle_bytes"]
    assert small_idle >= 3 * MIB
    got = checkpoint.load(tmp_path / "large")
    assert len(host_buffers.load_buffers._pools) == 1  # the small size's pool (and its idle buffer) is gone
    del got
    assert checkpoint.buffer_stats()["load_idle_bytes"] >= 9 * MIB


def test_reuse_off_keeps_nothing(tmp_path: Path) -> None:
    a = _state(1)
    checkpoint.save(a, tmp_path / "a")
    with defaults.set(checkpoint_reuse_buffers=False):
        assert same(checkpoint.load(tmp_path / "a"), a)
        assert checkpoint.buffer_stats()["load_idle_bytes"] == 0
        assert host_buffers.load_buffers._pools == {}


def test_free_buffers_gives_everything_back(tmp_path: Path) -> None:
    a = _state(1)
    checkpoint.save(a, tmp_path / "a")
    checkpoint.save_async(a, tmp_path / "b").get(60)
    got = checkpoint.load(tmp_path / "a")
    before = checkpoint.buffer_stats()
    assert before["save_idle_bytes"] > 0 and before["save_async_idle_bytes"] > 0
    freed = checkpoint.free_buffers()
    assert freed == before["idle_bytes"]
    after = checkpoint.buffer_stats()
    assert after["idle_bytes"] == 0
    assert same(got, a)  # a freed pool leaves the buffers still out alone: they are freed when their tensors die
    del got
    assert checkpoint.buffer_stats()["idle_bytes"] == 0
    assert same(checkpoint.load(tmp_path / "a"), a)


def test_load_into_and_bare_files_use_kept_buffers_too(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    a = _state(1)
    checkpoint.save(a, tmp_path / "a")
    save_file(a, str(tmp_path / "bare.safetensors"))
    strided = torch.zeros(2 * 3 * MIB // 4)[::2]  # not contiguous: read through a bounce buffer
    small = torch.zeros(1000, dtype=torch.int64)  # contiguous: read in place
    checkpoint.load(tmp_path / "a", into={"big": strided, "small": small})
    assert torch.equal(strided, a["big"]) and torch.equal(small, a["small"])
    assert checkpoint.buffer_stats()["load_idle_bytes"] >= 3 * MIB  # the bounce buffer, kept
    bare = checkpoint.load(tmp_path / "bare.safetensors")
    assert bare.keys() == a.keys() and all(torch.equal(bare[k], a[k]) for k in a)
    del bare
    assert checkpoint.buffer_stats()["load_idle_bytes"] > 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_take_the_parents_buffers(tmp_path: Path) -> None:
    a, b = _state(1), _state(2)
    checkpoint.save(a, tmp_path / "a")
    checkpoint.save(b, tmp_path / "b")
    del checkpoint.load(tmp_path / "a")["big"]
    gc.collect()
    assert checkpoint.buffer_stats()["load_idle_bytes"] > 0
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not exist here
            fresh = checkpoint.buffer_stats()["load_idle_bytes"] == 0
            code = 0 if fresh and same(checkpoint.load(tmp_path / "b"), b) else 3
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert checkpoint.buffer_stats()["load_idle_bytes"] > 0  # the parent's are still there
