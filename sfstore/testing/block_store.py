"""The BlockStore conformance suite: what a block store must do on every block target.

Subclass :class:`BlockStoreTests` and provide the ``block_target`` fixture: something
:class:`~sfstore.paths.block.BlockPath` opens (an image file, a block device such as a loop device with
4096-byte sectors, an NVMe-oF namespace). Each test formats the target (using its first ``STORE_BYTES``) and
covers round trips into every buffer kind, size classes, overwrites and deletes, persistence across a clean
close and across a kill, torn slots, eviction with the spill hook, exclusive open, threads, async calls and
bad input.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sfstore import errors
from sfstore.blocks import BlockStore
from sfstore.buffers import RegisteredBufferPool
from sfstore.paths.block import BlockPath

__all__ = ["BlockStoreTests", "STORE_BYTES", "CLASSES"]

KiB = 1 << 10
MiB = 1 << 20
STORE_BYTES = 48 * MiB
CLASSES = (4 * KiB, 64 * KiB, 1 * MiB)


def value(key: Any, n: int, version: int = 0) -> bytes:
    """``n`` reproducible bytes for ``key`` and ``version``."""
    return random.Random(f"{key!r}/{version}").randbytes(n)


class BlockStoreTests:
    """Conformance tests for :class:`~sfstore.blocks.BlockStore` on one kind of block target."""

    @pytest.fixture
    def block_target(self, tmp_path: Any) -> Any:
        """What the store lives on (override in subclasses): by default an image file."""
        return {"kind": "image", "path": str(tmp_path / "blocks.img"), "size": STORE_BYTES}

    @pytest.fixture
    def open_store(self, block_target: Any) -> Iterator[Any]:
        """A factory of stores on the target; every store it made is closed afterwards."""
        made: list[BlockStore] = []

        def make(**kw: Any) -> BlockStore:
            kw.setdefault("size_classes", CLASSES)
            kw.setdefault("capacity", STORE_BYTES)
            s = BlockStore(block_target, **kw)
            made.append(s)
            return s

        yield make
        for s in made:
            if not s._closed:
                s.close()

    @pytest.fixture
    def store(self, open_store: Any) -> BlockStore:
        made: BlockStore = open_store(format=True)
        return made

    # -- round trips -----------------------------------------------------------------------------------------------
    def test_put_get_round_trip_across_size_classes(self, store: BlockStore) -> None:
        sizes = [0, 1, 511, 512, 4095, 4096, 4097, 65536, 65537, 300_000, MiB]
        items = {f"key-{n}": value(n, n) for n in sizes}
        store.put_many(items)
        assert len(store) == len(sizes)
        got = store.get_many(list(items))
        for (k, v), g in zip(items.items(), got, strict=True):
            assert g == v, k
        used = [c["used"] for c in store.stats()["classes"]]
        assert used == [6, 2, 3]  # each value in the smallest class that holds it

    def test_str_and_bytes_keys_are_the_same_key(self, store: BlockStore) -> None:
        store.put("naïve", b"one")
        assert store.get("naïve".encode()) == b"one"
        assert store.contains(b"na\xc3\xafve") and "naïve" in store

    def test_get_into_every_buffer_kind(self, store: BlockStore) -> None:
        torch = pytest.importorskip("torch")
        data = value("k", 200_000)
        store.put_many({b"k": data, b"small": b"abc"})
        arr = np.zeros(300_000, dtype=np.uint8)
        ten = torch.zeros(50_000, dtype=torch.float32)  # 200,000 bytes exactly
        with RegisteredBufferPool(256 * KiB) as pool:
            reg = pool.acquire()
            try:
                got = store.get_into([b"k", b"k", b"k", b"small", b"missing"],
                                     [arr, ten, reg, bytearray(3), bytearray(10)])
                assert got == [200_000, 200_000, 200_000, 3, None]
                assert arr[:200_000].tobytes() == data and not arr[200_000:].any()
                assert ten.numpy().tobytes() == data
                assert bytes(memoryview(reg)[:200_000]) == data
            finally:
                reg.release()

    def test_values_from_numpy_torch_and_registered_buffers(self, store: BlockStore) -> None:
        torch = pytest.importorskip("torch")
        a = np.arange(1000, dtype=np.float64)
        t = torch.arange(500, dtype=torch.bfloat16)
        store.put_many([("np", a), ("torch", t)])
        assert store.get("np") == a.tobytes()
        assert store.get("torch") == t.view(torch.int16).numpy().tobytes()

    def test_overwrite_delete_contains_keys(self, store: BlockStore) -> None:
        store.put("a", b"1" * 5000)
        store.put("a", b"2" * 70_000)  # moves to a larger class
        store.put("b", b"b")
        assert store.get("a") == b"2" * 70_000
        assert sorted(store.keys()) == [b"a", b"b"]
        assert store.delete("a") is True and store.delete("a") is False
        assert store.get("a") is None and "a" not in store and len(store) == 1
        assert store.locate("b") is not None and store.locate("a") is None

    def test_missing_keys(self, store: BlockStore) -> None:
        assert store.get("nothing") is None
        assert store.get_many(["x", "y"]) == [None, None]
        s = store.stats()
        assert s["misses"] == 3 and s["hits"] == 0

    # -- persistence -----------------------------------------------------------------------------------------------
    def test_reopen_after_clean_close_uses_the_snapshot(self, open_store: Any) -> None:
        s = open_store(format=True)
        items = {f"k{i}": value(i, 1000 * i) for i in range(40)}
        s.put_many(items)
        s.put("k3", b"overwritten")
        s.delete("k4")
        s.close()
        s2 = open_store()
        assert s2.recovered == "snapshot"
        assert s2.get("k3") == b"overwritten" and s2.get("k4") is None
        assert all(s2.get(k) == v for k, v in items.items() if k not in ("k3", "k4"))
        assert len(s2) == 39

    def test_reopen_after_a_killed_process_rebuilds_from_headers(self, open_store: Any, block_target: Any) -> None:
        s = open_store(format=True)
        s.put("old", b"o" * 3000)
        s.close()
        target = block_target if isinstance(block_target, (str, dict)) else str(block_target)
        code = (
            "import os, sys, ast\n"
            "from sfstore.blocks import BlockStore\n"
            "s = BlockStore(ast.literal_eval(sys.argv[1]), size_classes=ast.literal_eval(sys.argv[2]))\n"
            "s.put_many({b'k%d' % i: bytes([i]) * (i * 997) for i in range(30)})\n"
            "s.put('old', b'new', durable=True)\n"
            "os.kill(os.getpid(), 9)\n"
        )
        r = subprocess.run([sys.executable, "-c", code, repr(target), repr(CLASSES)], capture_output=True,
                           text=True, timeout=120, check=False)
        assert r.returncode == -9, r.stderr
        s2 = open_store()
        assert s2.recovered == "scan"
        assert s2.get("old") == b"new"
        assert all(s2.get(b"k%d" % i) == bytes([i]) * (i * 997) for i in range(30))

    def test_torn_slot_is_dropped_never_returned(self, store: BlockStore) -> None:
        store.put_many({"good": value("g", 9000), "torn": value("t", 9000)}, durable=True)
        loc = store.locate("torn")
        assert loc is not None
        offset, length = loc
        with RegisteredBufferPool(64 * KiB) as pool:
            buf = pool.acquire()
            try:
                store.path.read_into(offset, buf, length)
                view = memoryview(buf)
                at = store.layout.header_bytes + 4500  # in the middle of the value
                view[at:at + 1] = bytes([view[at] ^ 0x01])  # one flipped bit
                del view
                store.path.write(offset, buf, length)
            finally:
                buf.release()
        assert store.get("torn") is None
        assert store.get("good") == value("g", 9000)
        assert "torn" not in store and store.stats()["corrupt_dropped"] == 1

    def test_torn_large_value_read_into_the_callers_buffer_is_a_miss(self, store: BlockStore) -> None:
        big = value("big", 128 * KiB)  # large values move straight between storage and the caller's memory
        store.put("big", big, durable=True)
        dest = np.zeros(256 * KiB, np.uint8)
        assert store.get_into(["big"], [dest]) == [128 * KiB] and dest[: 128 * KiB].tobytes() == big
        loc = store.locate("big")
        assert loc is not None
        with RegisteredBufferPool(4096) as pool:
            buf = pool.acquire()
            try:
                at = loc[0] + store.layout.header_bytes + 64 * KiB  # a sector in the middle of the value
                store.path.read_into(at, buf, 4096)
                memoryview(buf)[0:1] = bytes([memoryview(buf)[0] ^ 0x80])
                store.path.write(at, buf, 4096)
            finally:
                buf.release()
        assert store.get_into(["big"], [dest]) == [None]
        assert "big" not in store and store.stats()["corrupt_dropped"] == 1

    def test_keep_on_miss_leaves_a_torn_values_buffer_as_it_was(self, store: BlockStore) -> None:
        big = value("big", 128 * KiB)
        small = value("small", 3000)
        store.put_many({"big": big, "small": small, "ok": value("ok", 128 * KiB)}, durable=True)
        for key, length in (("big", 128 * KiB), ("small", 3000)):
            loc = store.locate(key)
            assert loc is not None
            with RegisteredBufferPool(4096) as pool:
                buf = pool.acquire()
                try:
                    at = loc[0] + store.layout.header_bytes + (length // 2 // 4096) * 4096
                    store.path.read_into(at, buf, 4096)
                    memoryview(buf)[100:101] = bytes([memoryview(buf)[100] ^ 0x01])
                    store.path.write(at, buf, 4096)
                finally:
                    buf.release()
        dests = [np.full(256 * KiB, 0x5A, np.uint8), np.full(4096, 0x5A, np.uint8), np.zeros(128 * KiB, np.uint8)]
        assert store.get_into(["big", "small", "ok"], dests, keep_on_miss=True) == [None, None, 128 * KiB]
        assert (dests[0] == 0x5A).all() and (dests[1] == 0x5A).all()
        assert dests[2].tobytes() == value("ok", 128 * KiB)
        assert store.stats()["corrupt_dropped"] == 2 and "big" not in store and "small" not in store

    def test_foreign_data_is_never_formatted_over(self, block_target: Any, open_store: Any) -> None:
        path = BlockPath(block_target)
        try:
            with RegisteredBufferPool(4096) as pool:
                buf = pool.acquire()
                memoryview(buf)[:] = b"not a store".ljust(4096, b"\x01")
                path.write(0, buf)
                path.flush()
                buf.release()
        finally:
            path.close()
        with pytest.raises(errors.CorruptStoreError, match="format=True"):
            open_store()
        open_store(format=True).close()
        with pytest.raises(errors.ConfigError, match="size classes"):
            open_store(size_classes=(4096,))

    # -- capacity and eviction -------------------------------------------------------------------------------------
    def test_full_class_evicts_least_recently_used_and_calls_the_hook(self, open_store: Any) -> None:
        spilled: dict[bytes, bytes] = {}
        s = open_store(format=True, on_evict=lambda k, v: spilled.__setitem__(k, v))
        slots = s.stats()["classes"][2]["slots"]
        big = MiB
        for i in range(slots):
            s.put(f"b{i}", value(i, big))
        assert s.stats()["evictions"] == 0
        s.get("b0")  # b0 becomes the most recently used: b1 goes first
        s.put_many({"x1": value("x1", big), "x2": value("x2", big)})
        assert s.stats()["evictions"] == 2
        assert set(spilled) == {b"b1", b"b2"}
        assert spilled[b"b1"] == value(1, big) and spilled[b"b2"] == value(2, big)
        assert s.get("b0") == value(0, big) and s.get("b1") is None
        assert s.get("x2") == value("x2", big)

    def test_small_values_use_free_larger_slots_before_evicting(self, open_store: Any) -> None:
        s = open_store(format=True)
        n = s.stats()["classes"][0]["slots"]
        s.put_many({f"s{i}": b"x" * 100 for i in range(n + 5)})
        st = s.stats()
        assert st["evictions"] == 0 and st["classes"][0]["used"] == n and st["classes"][1]["used"] == 5

    # -- concurrency and exclusivity -------------------------------------------------------------------------------
    def test_threads_share_one_store(self, store: BlockStore) -> None:
        failures: list[str] = []
        evicted: list[str] = []

        def worker(t: int) -> None:
            rng = random.Random(t)
            for r in range(20):
                batch = {f"t{t}-{rng.randrange(30)}": value((t, r), rng.choice((100, 5000, 70_000))) for _ in range(8)}
                batch["shared"] = value(("shared", t, r), 3000)
                store.put_many(batch)
                got = store.get_many(list(batch))
                for (k, v), g in zip(batch.items(), got, strict=True):
                    if g is None:  # evicted by another thread's put (the 1 MiB class has few slots): allowed
                        evicted.append(k)
                    elif k != "shared" and g != v:
                        failures.append(f"thread {t} round {r}: {k} came back with other bytes")
                shared = store.get("shared")
                if shared is None or len(shared) != 3000:
                    failures.append(f"thread {t}: shared value torn or missing")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert failures == []
        st = store.stats()
        assert st["corrupt_dropped"] == 0
        assert not evicted or st["evictions"] > 0  # a miss only where something was really evicted

    def test_second_open_is_refused(self, store: BlockStore, block_target: Any) -> None:
        with pytest.raises(errors.StoreInUseError) as info:
            BlockStore(block_target)
        assert isinstance(info.value, OSError)
        code = "import sys, ast\nfrom sfstore.blocks import BlockStore\nBlockStore(ast.literal_eval(sys.argv[1]))\n"
        target = block_target if isinstance(block_target, (str, dict)) else str(block_target)
        r = subprocess.run([sys.executable, "-c", code, repr(target)], capture_output=True, text=True, timeout=120,
                           check=False)
        assert r.returncode != 0 and "StoreInUseError" in r.stderr

    # -- async and durability --------------------------------------------------------------------------------------
    def test_async_put_and_get(self, store: BlockStore) -> None:
        items = {f"a{i}": value(i, 20_000) for i in range(32)}
        fut = store.put_many_async(items, durable=True)
        assert fut.get(timeout=60) is None and fut.done()
        bufs = [np.zeros(20_000, np.uint8) for _ in items]
        g = store.get_into_async(list(items), bufs)
        assert g.get(timeout=60) == [20_000] * 32
        assert all(b.tobytes() == v for b, v in zip(bufs, items.values(), strict=True))

    def test_flush_recycles_overwritten_slots(self, open_store: Any) -> None:
        s = open_store(format=True)
        n = s.stats()["classes"][2]["slots"]
        for r in range(3):  # three full rounds of overwrites of every key: needs the freed slots back
            s.put_many({f"k{i}": value((i, r), MiB) for i in range(n // 2)})
        assert s.stats()["evictions"] == 0
        assert all(s.get(f"k{i}") == value((i, 2), MiB) for i in range(n // 2))

    # -- bad input -------------------------------------------------------------------------------------------------
    def test_bad_input_is_typed_and_changes_nothing(self, store: BlockStore) -> None:
        store.put("k", b"v" * 1000)
        with pytest.raises(errors.ValueTooLargeError):
            store.put("big", bytes(MiB + 1))
        with pytest.raises(errors.InvalidKeyError):
            store.put("", b"x")
        with pytest.raises(errors.InvalidKeyError):
            store.put(b"x" * (store.max_key_bytes + 1), b"x")
        with pytest.raises(errors.InvalidKeyError):
            store.put(42, b"x")  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidKeyError):
            store.get("")
        with pytest.raises(errors.BufferTooSmallError):
            store.get_into(["k"], [bytearray(999)])
        with pytest.raises(errors.InvalidRequestError):
            store.get_into(["k"], [])
        with pytest.raises(errors.ReadOnlyBufferError):
            store.get_into(["k"], [b"x" * 1000])
        with pytest.raises(errors.InvalidRequestError):
            store.get_into(["k"], [np.zeros((100, 100), np.uint8)[:, ::2]])
        with pytest.raises(errors.InvalidRequestError):
            store.put("k", object())
        assert isinstance(errors.ValueTooLargeError("x"), ValueError)
        assert store.get("k") == b"v" * 1000 and len(store) == 1
        assert store.stats()["puts"] == 1

    def test_closed_store_refuses_work(self, store: BlockStore) -> None:
        store.close()
        with pytest.raises(errors.InvalidRequestError, match="closed"):
            store.put("k", b"v")
        with pytest.raises(errors.InvalidRequestError, match="closed"):
            store.get("k")

    def test_describe_reports_transport_and_layout(self, store: BlockStore) -> None:
        d = store.describe()
        assert d["kind"] == "block" and d["transport"] in ("rdma", "tcp", "local")
        assert d["lba_size"] in (512, 4096) and d["capacity"] >= STORE_BYTES
        assert [c["size"] for c in d["store"]["classes"]] == list(CLASSES)
        store.put("k", b"x" * 10_000)
        store.get("k")
        c = store.path.counters.snapshot()
        assert c["bytes_written"] >= 10_000 and c["bytes_read"] >= 10_000
