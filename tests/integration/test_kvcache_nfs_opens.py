"""What one cold KV hit costs the NFS-over-RDMA mount: the files it opens, a file per block before chunk files and
a file per chunk with them (``kvcache_chunk_tokens``), counted by the store and by the NFS client itself
(``/proc/self/mountstats``: the OPEN and LOOKUP calls sent to the server)."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import numpy as np
import pytest

from sfstore.kvcache import KVCacheStore, KVGeometry

GEOM = KVGeometry(num_layers=4, block_tokens=16, num_kv_heads=2, head_dim=64, dtype="float16")  # 16 KiB blocks
TOKENS = 1024  # 64 blocks
CHUNK = 256


def nfs_ops(mount: Path) -> dict[str, int]:
    """The NFS client's count of each operation sent for ``mount`` (per-op statistics of its mountstats)."""
    text = Path("/proc/self/mountstats").read_text()
    block = text.split(f"mounted on {mount} with fstype")[1].split("\ndevice ")[0]
    ops = {}
    for line in block.split("per-op statistics")[1].splitlines():
        name, _, rest = line.strip().partition(":")
        if rest.strip() and name.isupper():
            ops[name] = int(rest.split()[0])
    return ops


def cold_hit(root: Path, mount: Path, chunk_tokens: int) -> tuple[int, dict[str, int]]:
    """Save a prompt with one store, then load it with another (nothing in memory, the client's caches
    dropped): the files the loading store opened, and the NFS operations the load sent."""
    prompt = [(t * 7919) % 32000 for t in range(TOKENS)]
    blocks = [np.random.default_rng(i).integers(0, 256, GEOM.block_bytes, dtype=np.uint8)
              for i in range(TOKENS // GEOM.block_tokens)]
    with KVCacheStore(GEOM, model_id="opens", pinned_bytes=0, shared_dir=root, chunk_tokens=chunk_tokens,
                      io_timeout_ms=0) as writer:
        writer.put(writer.keys_for(prompt), blocks)
    Path("/proc/sys/vm/drop_caches").write_text("3")  # the client's cached names and attributes go too
    with KVCacheStore(GEOM, model_id="opens", pinned_bytes=0, shared_dir=root, chunk_tokens=chunk_tokens,
                      io_timeout_ms=0) as reader:
        keys = reader.keys_for(prompt)
        dests = [np.zeros(GEOM.block_bytes, np.uint8) for _ in keys]
        before = nfs_ops(mount)
        assert reader.get_into(keys, dests) == ["shared"] * len(keys)
        after = nfs_ops(mount)
        assert all(np.array_equal(d, b) for d, b in zip(dests, blocks, strict=True))
        opened = int(reader.stats()["shared_opens"])
    return opened, {op: after.get(op, 0) - before.get(op, 0) for op in ("OPEN", "LOOKUP", "GETATTR", "READ")}


def test_a_cold_hit_opens_a_file_per_chunk_on_nfs_over_rdma(nfs_mount: Path) -> None:
    base = nfs_mount / f"kv-opens-{uuid.uuid4().hex[:8]}"
    per_block, ops_block = cold_hit(base / "blocks", nfs_mount, 0)
    per_chunk, ops_chunk = cold_hit(base / "chunks", nfs_mount, CHUNK)
    n_blocks = TOKENS // GEOM.block_tokens
    print(f"one cold hit of {TOKENS} tokens on NFS over RDMA: a file per block opened {per_block} files, NFS ops "
          f"{ops_block}; chunks of {CHUNK} tokens opened {per_chunk}, NFS ops {ops_chunk}")
    assert per_block == n_blocks
    assert per_chunk <= math.ceil(TOKENS / CHUNK) + 1
    assert ops_chunk["OPEN"] <= math.ceil(TOKENS / CHUNK) + 1
    assert ops_chunk["OPEN"] + ops_chunk["LOOKUP"] < ops_block["OPEN"] + ops_block["LOOKUP"]


def test_a_cold_hit_is_held_layer_by_layer_on_nfs_over_rdma(nfs_mount: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hold_async`` over the mount: layer 0 of every block is in (and copied out) while the later layers are
    still being read (held at a gate), every layer comes back exact, and the hit still opens a file per chunk."""
    from tests.kvcache.layer_gate import LayerGate

    root = nfs_mount / f"kv-layers-{uuid.uuid4().hex[:8]}"
    prompt = [(t * 7919 + 3) % 32000 for t in range(TOKENS)]
    blocks = [np.random.default_rng(100 + i).integers(0, 256, GEOM.block_bytes, dtype=np.uint8)
              for i in range(TOKENS // GEOM.block_tokens)]
    kw = {"model_id": "layers", "shared_dir": root, "chunk_tokens": CHUNK, "io_timeout_ms": 0}
    with KVCacheStore(GEOM, pinned_bytes=0, **kw) as writer:  # type: ignore[arg-type]
        writer.put(writer.keys_for(prompt), blocks)
    Path("/proc/sys/vm/drop_caches").write_text("3")
    lb = GEOM.layer_bytes
    with KVCacheStore(GEOM, pinned_bytes=2 * len(blocks) * GEOM.block_bytes, **kw) as reader:  # type: ignore[arg-type]
        gate = LayerGate(monkeypatch)
        held = reader.hold_async(reader.keys_for(prompt), parts=2)
        try:
            assert held.wait_layer(0, timeout=120) and gate.held_back.wait(120)
            assert held.load is not None and not held.load.done()
            out = np.zeros((len(blocks), lb), np.uint8)
            held.copy_layer_into(0, out)
            assert all(np.array_equal(out[r], b[:lb]) for r, b in enumerate(blocks))
        finally:
            gate.open()
        assert held.tiers == ["shared"] * len(blocks)
        for layer in range(GEOM.num_layers):
            held.copy_layer_into(layer, out)
            assert all(np.array_equal(out[r], b[layer * lb:(layer + 1) * lb]) for r, b in enumerate(blocks))
        held.release()
        s = reader.stats()
        assert s["shared_opens"] <= math.ceil(TOKENS / CHUNK) + 1 and s["layers_copied_early"] >= 1
