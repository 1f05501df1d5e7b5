"""Processes for the shared-tier tests (started with ``spawn``): writers, readers that verify every byte, and an
evictor that is killed between its rename and its unlink."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from sfstore.kvcache import KVCacheStore, KVGeometry

GEOM = KVGeometry(num_layers=4, block_tokens=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")  # 32 KiB blocks
FILE_BYTES = 4096 + GEOM.block_bytes  # a block's file: header and block


def block(i: int) -> np.ndarray:
    """Block ``i``'s bytes: every reader can tell them from any other block's."""
    return np.random.default_rng(i).integers(0, 256, GEOM.block_bytes, dtype=np.uint8)


def key(kv: KVCacheStore, i: int) -> bytes:
    return kv.keys_for(range(i * 16, (i + 1) * 16))[0]


def open_store(shared: str, budget: int, namespace: str = "") -> KVCacheStore:
    """A store on the shared directory alone, without a deadline: these processes test the budget and the
    readers' verification under concurrency, and on a loaded machine (six processes on two cores) a missed
    deadline would quarantine the tier and drop every write (deadlines: test_kvcache_deadlines.py)."""
    return KVCacheStore(GEOM, model_id="budget-test", pinned_bytes=0, shared_dir=shared, shared_bytes=budget,
                        cache_namespace=namespace, io_timeout_ms=0)


def writer(shared: str, budget: int, first: int, count: int, namespace: str, out: Any) -> None:
    """Put blocks ``first .. first + count - 1``, then close (which settles the budget)."""
    kv = open_store(shared, budget, namespace)
    for i in range(first, first + count):
        kv.put([key(kv, i)], [block(i)])
    stats = kv.stats()
    kv.close()
    out.put(("writer", first, stats["evictions_shared"], stats["puts_dropped"]))


def endless_writer(shared: str, budget: int, first: int) -> None:
    """Put blocks from ``first`` on until killed."""
    kv = open_store(shared, budget)
    i = first
    while True:
        kv.put([key(kv, i)], [block(i)])
        i += 1


def reader(shared: str, span: int, seconds: float, seed: int, out: Any) -> None:
    """Get random blocks of ``0 .. span - 1`` for ``seconds``; every hit must be exactly its block."""
    kv = open_store(shared, 0)
    rng = random.Random(seed)
    hits = misses = wrong = 0
    dest = np.zeros(GEOM.block_bytes, dtype=np.uint8)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i = rng.randrange(span)
        dest[:] = 7
        got = kv.get_into([key(kv, i)], [dest])
        if got == ["shared"]:
            hits += 1
            wrong += not np.array_equal(dest, block(i))
        else:
            misses += 1
            wrong += not bool((dest == 7).all())  # a miss leaves the destination as it was
    dropped = kv.stats()["corrupt_dropped"]
    kv.close()
    out.put(("reader", hits, misses, wrong, dropped))


def killed_evictor(shared: str, budget: int, first: int, count: int) -> None:
    """Put blocks until this process evicts one, and die by SIGKILL between the rename and the unlink."""
    real_unlink = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if ".evicting-" in os.fspath(path):
            os.kill(os.getpid(), signal.SIGKILL)
        real_unlink(path, *args, **kwargs)

    os.unlink = unlink  # type: ignore[assignment]
    kv = open_store(shared, budget)
    for i in range(first, first + count):
        kv.put([key(kv, i)], [block(i)])
    os._exit(3)  # never evicted: the test fails on the exit code


def key_in_name(name: str) -> bytes:
    """The key a block file's name holds, or a chunk file's of one block (these tests' prompts are one block)."""
    return bytes.fromhex(name.split(".")[0])


def files_in(root: Path) -> list[Path]:
    """The block and chunk files of the default namespace's root (what any lookup can find)."""
    return [f for sub in root.iterdir() if sub.is_dir() and len(sub.name) == 2
            for f in sub.iterdir() if f.name.endswith((".kvb", ".kvc")) and not f.name.startswith(".")]


def leftovers(root: Path) -> list[Path]:
    return [f for sub in root.iterdir() if sub.is_dir() and len(sub.name) == 2 for f in sub.iterdir()
            if f.name.startswith(".")]
