"""A seeded fuzz loop over the public arguments of :class:`~sfstore.blocks.BlockStore` and
:class:`~sfstore.kvcache.KVCacheStore`: 0 crashes, 0 hangs, every error an ``SfstoreError``, nothing stored lost
or corrupted.

Guards issue #14 (the fuzz part of "Deliver", and defect 8 for these two stores). Each iteration picks an
operation (put, get, get_into, async variants, delete, evict, flush, per-layer transfers, close and reopen) and
arguments drawn from good and hostile ones: keys empty, huge, of the wrong type or length, str with lone
surrogates; values of 0 bytes, a size class +- 1, over the largest class; batches empty, of mismatched lengths,
not sequences; buffers too small, read-only, non-contiguous, of the wrong dtype or shape; timeouts negative,
NaN, infinite. A model of what each successful put stored is checked against every get: a hit returns exactly
what was put, and a miss of a key that was put is allowed only after the key was evicted (the block store's
``on_evict`` hook says which) or evicted from the tiers that would keep it.

A hang is a failure: the loop runs in a worker thread that must make progress every ``STALL`` seconds. The seed
is printed with every failure; ``SFSTORE_FUZZ_SEED`` replays one. Iterations: ``ITERATIONS x scale``
(``SFSTORE_RELIABILITY_SCALE``); ``KV_ITERATIONS x scale`` for the KV cache.
"""

# ruff: noqa: B023  (every lambda here is called at once, inside typed(), with the loop's current values)
from __future__ import annotations

import math
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sfstore import errors
from sfstore.blocks import BlockStore
from sfstore.kvcache import KVCacheStore, KVGeometry

torch = pytest.importorskip("torch")

ITERATIONS = 1500  # block store operations at scale 1 (about 5 s here)
KV_ITERATIONS = 4000  # KV cache operations at scale 1 (about 2 s here: 1 KiB blocks)
STALL = 30.0  # seconds without progress that count as a hang
CLASSES = (512, 4096, 65536)
TIMEOUTS = [None, 0, 0.001, 5, 30.0, -1, -0.5, math.nan, math.inf, -math.inf, "1", True]


class Hang(Exception):
    pass


def run_fuzz(name: str, body: Callable[[random.Random, list[str]], None], seed: int) -> None:
    """Run ``body(rng, trail)`` in a worker thread; fail (with the seed and the last operations) on a hang, an
    untyped error or a broken model."""
    trail: list[str] = []
    box: dict[str, BaseException] = {}

    def work() -> None:
        try:
            body(random.Random(seed), trail)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=work, daemon=True, name=f"fuzz-{name}")
    t.start()
    last = -1
    while t.is_alive():
        t.join(STALL)
        if t.is_alive() and len(trail) == last:
            pytest.fail(f"{name} fuzz (seed {seed}) hung in: {trail[-1] if trail else '?'}")
        last = len(trail)
    if "error" in box:
        exc = box["error"]
        recent = "\n  ".join(trail[-8:])
        raise AssertionError(f"{name} fuzz (seed {seed}) failed: {type(exc).__name__}: {exc}\n"
                             f"last operations:\n  {recent}") from exc


def typed(op: str, fn: Callable[[], Any], trail: list[str]) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, error)`` for an :class:`SfstoreError`; anything else fails."""
    trail.append(op)
    try:
        return True, fn()
    except errors.SfstoreError as exc:
        return False, exc
    except Exception as exc:
        raise AssertionError(f"{op}: untyped {type(exc).__name__}: {exc}") from exc


def seed_of() -> int:
    text = os.environ.get("SFSTORE_FUZZ_SEED", "")
    return int(text) if text else random.SystemRandom().randrange(1 << 32)


# -- the block store --------------------------------------------------------------------------------------------
def value_for(key: bytes, n: int, version: int) -> bytes:
    return random.Random(f"{key!r}/{n}/{version}").randbytes(n)


def fuzz_block_store(rng: random.Random, trail: list[str], image: str, iterations: int) -> dict[str, int]:
    evicted: set[bytes] = set()
    model: dict[bytes, bytes] = {}  # what a get must return
    maybe: dict[bytes, set[bytes]] = {}  # keys a failed put may or may not have changed: possible values
    tally = {"ops": 0, "errors": 0, "hits": 0, "misses": 0, "reopens": 0}

    def hook(k: bytes, v: bytes) -> None:
        if k in model and model[k] != v:
            raise AssertionError(f"on_evict got a wrong value for {k!r}")
        evicted.add(k)

    def open_store() -> BlockStore:
        return BlockStore({"kind": "image", "path": image, "size": 4 << 20}, size_classes=CLASSES, on_evict=hook)

    store = open_store()
    good_keys = [f"k{i}".encode() for i in range(40)] + ["naïve", "ключ"]  # type: ignore[list-item]
    max_key = store.max_key_bytes

    def norm(k: Any) -> bytes:
        return k.encode() if isinstance(k, str) else bytes(k)

    def a_key() -> Any:
        r = rng.random()
        if r < 0.85:
            return rng.choice(good_keys)
        return rng.choice([b"", "", b"x" * (max_key + 1), b"y" * max_key, "\udcff-lone-surrogate", 42, None, 1.5,
                           ["k1"], bytearray(b"k2"), memoryview(b"k3"), "x" * 10_000])

    def a_size() -> int:
        c = rng.choice(CLASSES)
        return max(0, rng.choice([0, 1, c - 1, c, c + 1, rng.randrange(1, CLASSES[-1] + 1), CLASSES[-1] + 1,
                                  8 << 20]))

    def a_value(k: Any, n: int, version: int) -> Any:
        data = value_for(norm(k) if isinstance(k, (bytes, str, bytearray, memoryview)) and not (
            isinstance(k, str) and "\udcff" in k) else b"?", n, version)
        form = rng.random()
        if form < 0.5:
            return data
        if form < 0.65:
            return bytearray(data)
        if form < 0.8:
            return np.frombuffer(data, np.uint8).copy()
        if form < 0.9:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)
        return rng.choice([None, "a str value", object(), np.zeros(n * 2, np.uint8)[::2], 12])

    def expect(k: bytes, got: bytes | None, where: str) -> None:
        if got is None:
            tally["misses"] += 1
            if k in model and k not in evicted and k not in maybe:
                raise AssertionError(f"{where}: {k!r} was put ({len(model[k])} bytes), never evicted, and is gone")
            return
        tally["hits"] += 1
        if k in maybe:
            if got not in maybe[k] and got != model.get(k):
                raise AssertionError(f"{where}: {k!r} returned bytes no put stored")
            return
        if model.get(k) != got:
            raise AssertionError(f"{where}: {k!r} returned {len(got)} bytes that are not what was put")

    def record_put(pairs: list[tuple[Any, Any]], ok: bool) -> None:
        for k, v in pairs:
            kb = norm(k)
            data = bytes(memoryview(v).cast("B")) if not isinstance(v, torch.Tensor) else bytes(v.numpy())
            if ok:
                model[kb] = data
                evicted.discard(kb)
                maybe.pop(kb, None)
            else:
                maybe.setdefault(kb, set()).add(data)
                if kb in model:
                    maybe[kb].add(model[kb])

    try:
        for it in range(iterations):
            tally["ops"] += 1
            op = rng.choice(["put", "put", "put_many", "get", "get_many", "get_into", "get_into", "delete",
                             "flush", "async", "contains", "reopen", "batch_args"])
            if op in ("put", "put_many"):
                n_items = 1 if op == "put" else rng.choice([0, 1, 2, 5, 17])
                pairs = []
                for _ in range(n_items):
                    k = a_key()
                    pairs.append((k, a_value(k, a_size(), it)))
                valid = all(
                    isinstance(k, (bytes, str, bytearray, memoryview)) and 0 < len(norm_safe(k)) <= max_key
                    and isinstance(v, (bytes, bytearray, np.ndarray, torch.Tensor)) and (
                        not isinstance(v, np.ndarray) or v.flags.c_contiguous)
                    and _nbytes(v) <= CLASSES[-1]
                    for k, v in pairs
                )
                durable = rng.random() < 0.1
                ok, res = typed(f"{it} put_many {[(_short(k), _nbytes(v)) for k, v in pairs]}",
                                lambda p=pairs, d=durable: store.put_many(p, durable=d), trail)
                if ok != valid:
                    if ok:
                        shown = [(_short(k), type(v).__name__) for k, v in pairs]
                        raise AssertionError(f"put_many accepted invalid items {shown}")
                    if not isinstance(res, errors.NoSpaceError):
                        raise AssertionError(f"put_many refused valid items: {res!r}")
                if ok or isinstance(res, errors.NoSpaceError):
                    # dict semantics: the last value of a repeated key wins
                    last: dict[bytes, Any] = {}
                    for k, v in pairs:
                        last[norm(k)] = (k, v)
                    record_put(list(last.values()), ok)
                tally["errors"] += not ok
            elif op in ("get", "get_many"):
                ks = [a_key() for _ in range(1 if op == "get" else rng.choice([0, 1, 3, 8]))]
                ok, res = typed(f"{it} {op} {[_short(k) for k in ks]}",
                                (lambda: [store.get(ks[0])]) if op == "get" else (lambda: store.get_many(ks)), trail)
                if ok:
                    for k, got in zip(ks, res, strict=True):
                        expect(norm(k), got, op)
                tally["errors"] += not ok
            elif op == "get_into":
                ks = [a_key() for _ in range(rng.choice([0, 1, 2, 6]))]
                bufs: list[Any] = []
                for _k in ks:
                    n = rng.choice([0, 100, 512, 4096, 65536, 70000])
                    kind = rng.random()
                    if kind < 0.5:
                        bufs.append(bytearray(b"\xa5" * n))
                    elif kind < 0.75:
                        bufs.append(np.full(n, 0xA5, np.uint8))
                    elif kind < 0.85:
                        bufs.append(torch.full((n,), 0xA5, dtype=torch.uint8))
                    else:
                        bufs.append(rng.choice([bytes(n), np.zeros((n, 2), np.uint8)[:, 0], None, "s"]))
                if rng.random() < 0.05:
                    bufs = bufs[:-1] if bufs else [bytearray(10)]
                keep = rng.random() < 0.5
                ok, res = typed(f"{it} get_into {[_short(k) for k in ks]} keep={keep}",
                                lambda: store.get_into(ks, bufs, keep_on_miss=keep), trail)
                if ok:
                    for k, b, n in zip(ks, bufs, res, strict=True):
                        mv = memoryview(b.numpy() if isinstance(b, torch.Tensor) else b).cast("B")
                        if n is None:
                            expect(norm(k), None, "get_into")
                            if keep and any(x != 0xA5 for x in bytes(mv[:64])):
                                raise AssertionError("get_into(keep_on_miss=True) wrote a missed key's buffer")
                        else:
                            expect(norm(k), bytes(mv[:n]), "get_into")
                tally["errors"] += not ok
            elif op == "delete":
                k = a_key()
                ok, res = typed(f"{it} delete {_short(k)}", lambda: store.delete(k), trail)
                if ok:
                    kb = norm(k)
                    model.pop(kb, None)
                    maybe.pop(kb, None)
                    evicted.discard(kb)
                tally["errors"] += not ok
            elif op == "flush":
                typed(f"{it} flush", store.flush, trail)
            elif op == "contains":
                k = a_key()
                ok, res = typed(f"{it} contains {_short(k)}", lambda: store.contains(k), trail)
                if ok and not res:
                    expect(norm(k), None, "contains")
                tally["errors"] += not ok
            elif op == "async":
                k = rng.choice(good_keys)
                v = value_for(norm(k), rng.choice([10, 4096, 60000]), it)
                ok, fut = typed(f"{it} put_many_async {_short(k)}", lambda: store.put_many_async([(k, v)]), trail)
                if ok:
                    timeout = rng.choice(TIMEOUTS)
                    got_ok, res = typed(f"{it} future.get({timeout!r})", lambda: fut.get(timeout), trail)
                    if not got_ok and not isinstance(res, (errors.InvalidRequestError, errors.IOTimeoutError)):
                        raise AssertionError(f"put_many_async failed: {res!r}")
                    done, res = typed(f"{it} future.get(30)", lambda: fut.get(30), trail)
                    if not done:
                        raise AssertionError(f"put_many_async of a valid item failed: {res!r}")
                    record_put([(k, v)], True)
                    dest = bytearray(len(v))
                    ok2, fut2 = typed(f"{it} get_into_async {_short(k)}",
                                      lambda: store.get_into_async([k], [dest]), trail)
                    if ok2:
                        typed(f"{it} future.wait({timeout!r})", lambda: fut2.wait(timeout), trail)
                        got = fut2.get(30)
                        expect(norm(k), bytes(dest) if got[0] is not None else None, "get_into_async")
            elif op == "reopen":
                lock_timeout = rng.choice([0, 0.01, -1, math.nan, math.inf, "x"])
                ok, res = typed(f"{it} second open lock_timeout={lock_timeout!r}",
                                lambda: BlockStore({"kind": "image", "path": image, "size": 4 << 20},
                                                   lock_timeout=lock_timeout), trail)
                if ok:
                    res.close()
                    raise AssertionError("a second BlockStore opened a store that is in use")
                typed(f"{it} close", store.close, trail)
                ok, res = typed(f"{it} put on a closed store", lambda: store.put(b"k1", b"x"), trail)
                assert not ok and "closed" in str(res)
                store = open_store()
                tally["reopens"] += 1
            elif op == "batch_args":
                bad = rng.choice([42, None, "keys", b"keys", {"k1": b"v"}.items(), [("k1",)], [("k1", b"v", 3)],
                                  (x for x in [("k5", b"v5")])])
                ok, res = typed(f"{it} put_many({type(bad).__name__})", lambda: store.put_many(bad), trail)
                if ok:
                    record_put([(k, v) for k, v in ([("k1", b"v")] if isinstance(bad, type({}.items()))
                                                    else [("k5", b"v5")])], True)
                ok, res = typed(f"{it} get_many({type(bad).__name__})", lambda: store.get_many(bad), trail)
        # every key the model holds and nothing evicted is there, with its bytes
        for k, v in model.items():
            got = store.get(k)
            expect(k, got, "final check")
            if k not in evicted and k not in maybe:
                assert got == v
    finally:
        if not store._closed:
            store.close()
    return tally


def norm_safe(k: Any) -> bytes:
    try:
        return k.encode() if isinstance(k, str) else bytes(k)
    except UnicodeEncodeError:
        return b""


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    try:
        return memoryview(v).nbytes
    except TypeError:
        return 0


def _short(k: Any) -> str:
    text = repr(k)
    return text if len(text) < 40 else text[:37] + "..."


def test_fuzz_block_store(tmp_path: Path, scale: int) -> None:
    seed = seed_of()
    tally: dict[str, int] = {}

    def body(rng: random.Random, trail: list[str]) -> None:
        tally.update(fuzz_block_store(rng, trail, str(tmp_path / "fuzz.img"), ITERATIONS * scale))

    start = time.monotonic()
    run_fuzz("block store", body, seed)
    print(f"block store fuzz: seed {seed}, {tally} in {time.monotonic() - start:.1f} s")
    assert tally["ops"] == ITERATIONS * scale and tally["hits"] > 0 and tally["errors"] > 0


# -- the KV cache -----------------------------------------------------------------------------------------------
GEOM = KVGeometry(num_layers=2, block_tokens=4, num_kv_heads=2, head_dim=32, dtype="bfloat16")  # 1 KiB blocks


def kv_block(key: bytes) -> Any:
    """The one block a key ever holds (keys are content addresses)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randn(GEOM.block_shape, generator=g).to(torch.bfloat16)


def kv_raw(t: Any) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


def snap(d: Any) -> bytes:
    """The bytes of a destination (``b""`` for one that is no contiguous host buffer)."""
    if isinstance(d, torch.Tensor):
        return kv_raw(d) if d.device.type == "cpu" and d.is_contiguous() else b""
    if isinstance(d, np.ndarray):
        return d.tobytes() if d.flags.c_contiguous else b""
    if isinstance(d, (bytes, bytearray)):
        return bytes(d)
    return b""


def fuzz_kv(rng: random.Random, trail: list[str], root: Path, iterations: int) -> dict[str, int]:
    tally = {"ops": 0, "errors": 0, "hits": 0, "misses": 0, "reopens": 0}
    block = BlockStore({"kind": "image", "path": str(root / "hot.img"), "size": 4 << 20},
                       size_classes=(GEOM.block_bytes,))
    shared = root / "shared"

    def open_kv() -> KVCacheStore:
        pinned = rng.choice([0, 4 * (4096 + 4096), 64 * 8192])
        return KVCacheStore(GEOM, model_id="fuzz", pinned_bytes=pinned, block_store=block,
                            shared_dir=shared if rng.random() < 0.8 else None)

    kv = open_kv()
    keys = kv.keys_for(range(GEOM.block_tokens * 48))
    at = {k: i for i, k in enumerate(keys)}  # each key's position in the prompt
    stored: set[bytes] = set()  # put, and kept by the shared tier (no budget: never evicted by itself)
    put_once: set[bytes] = set()  # put at some point (a miss is allowed once evicted from the keeping tiers)

    def a_key() -> Any:
        if rng.random() < 0.9:
            return rng.choice(keys)
        return rng.choice([b"", b"x" * 31, b"x" * 33, "k" * 32, None, 7, bytearray(keys[0]), b"\0" * 32])

    def a_block(k: Any, dest: bool) -> Any:
        good = kv_block(k if isinstance(k, (bytes, bytearray)) and len(k) == 32 else b"\0" * 32)
        if dest:
            good = torch.full(GEOM.block_shape, 2.5, dtype=torch.bfloat16)
        r = rng.random()
        if r < 0.45:
            return good
        if r < 0.55:
            return np.frombuffer(kv_raw(good), np.uint16).copy()
        if r < 0.65:
            return bytearray(kv_raw(good))
        if r < 0.7:
            return good.reshape(-1)
        return rng.choice([
            np.frombuffer(kv_raw(good), np.int16).copy(), good.to(torch.float16), good.reshape(2, -1),
            torch.zeros(GEOM.block_elements + 1, dtype=torch.bfloat16), kv_raw(good), None, "block",
            np.zeros(GEOM.block_elements * 2, np.uint16)[::2], torch.zeros(GEOM.block_shape, device="meta"),
            bytearray(GEOM.block_bytes - 1), [1, 2, 3],
        ])

    def good_block(b: Any) -> bool:
        if isinstance(b, torch.Tensor):
            return (b.dtype == torch.bfloat16 and b.device.type == "cpu"
                    and tuple(b.shape) in (GEOM.block_shape, (GEOM.block_elements,)))
        if isinstance(b, np.ndarray):
            return b.dtype == np.uint16 and b.shape == (GEOM.block_elements,) and b.flags.c_contiguous
        return isinstance(b, (bytes, bytearray)) and len(b) == GEOM.block_bytes

    def check_get(k: bytes, tier: str | None, dest: Any, before: bytes | None, where: str) -> None:
        now = snap(dest)
        if tier is None:
            tally["misses"] += 1
            if k in stored and kv.shared is not None:
                raise AssertionError(f"{where}: a block put and kept by the shared tier missed")
            if before is not None and now != before:
                raise AssertionError(f"{where}: a missed key's destination was changed")
            return
        tally["hits"] += 1
        if now != kv_raw(kv_block(k)):
            raise AssertionError(f"{where}: the block came back changed (tier {tier})")

    try:
        for it in range(iterations):
            tally["ops"] += 1
            op = rng.choice(["put", "put", "put_async", "get", "get", "get_layer", "put_layer", "evict", "lookup",
                             "contains", "prefetch", "wait", "reopen", "discard"])
            if op in ("put", "put_async"):
                n = rng.choice([0, 1, 2, 3, 8])
                ks = [a_key() for _ in range(n)]
                bs = [a_block(k, False) for k in ks]
                if rng.random() < 0.05:
                    bs = bs[:-1]
                valid = len(ks) == len(bs) and all(
                    isinstance(k, (bytes, bytearray)) and len(k) == 32 for k in ks) and all(map(good_block, bs))
                ok, res = typed(f"{it} {op} {len(ks)} keys",
                                (lambda: kv.put(ks, bs)) if op == "put" else (lambda: kv.put_async(ks, bs)), trail)
                if ok and op == "put_async":
                    timeout = rng.choice(TIMEOUTS)
                    typed(f"{it} put_async.get({timeout!r})", lambda: res.get(timeout), trail)
                    ok, res = typed(f"{it} put_async.get(30)", lambda: res.get(30), trail)
                if ok != valid:
                    raise AssertionError(f"{op}: {'accepted invalid' if ok else f'refused valid ({res!r})'} "
                                         f"arguments {[type(b).__name__ for b in bs]}")
                if ok:
                    for k in ks:
                        k = bytes(k)
                        # content addressing: these keys' blocks differ from kv_block(k) only for the all-zero key
                        if k in {bytes(x) for x in keys}:
                            put_once.add(k)
                            if kv.shared is not None:
                                stored.add(k)
                tally["errors"] += not ok
            elif op in ("get", "prefetch"):
                ks = [a_key() for _ in range(rng.choice([0, 1, 2, 4, 9]))]
                dests = [a_block(k, True) for k in ks]
                before = [snap(d) for d in dests]
                if op == "prefetch":
                    ok, fut = typed(f"{it} prefetch {len(ks)}", lambda: kv.prefetch(ks), trail)
                    if ok:
                        timeout = rng.choice(TIMEOUTS)
                        typed(f"{it} prefetch.get({timeout!r})", lambda: fut.get(timeout), trail)
                        ok, _ = typed(f"{it} prefetch.get(30)", lambda: fut.get(30), trail)
                        assert ok
                    continue
                keep = rng.random() < 0.8
                ok, res = typed(f"{it} get_into {len(ks)} keep_on_miss={keep}",
                                lambda: kv.get_into(ks, dests, keep_on_miss=keep), trail)
                if ok:
                    for k, tier, d, b in zip(ks, res, dests, before, strict=True):
                        check_get(bytes(k), tier, d, b if keep else None, "get_into")
                tally["errors"] += not ok
            elif op == "put_layer":
                ks = [rng.choice(keys) for _ in range(rng.choice([1, 2]))]
                layer = rng.choice([0, 1, 1, 2, -1, 0.5, "0"])
                ts: list[Any] = [kv_block(k)[layer] if isinstance(layer, int) and 0 <= layer < 2
                                 else torch.zeros(GEOM.layer_shape, dtype=torch.bfloat16) for k in ks]
                if rng.random() < 0.2:
                    ts = [t.to(torch.float32) for t in ts]
                ok, res = typed(f"{it} put_layer {layer!r}", lambda: kv.put_layer(ks, layer, ts), trail)
                tally["errors"] += not ok
                # a block is stored once both layers came in: whole blocks are not tracked through put_layer
                # (a partial one may be completed by a later call); its hits are still checked bit for bit
            elif op == "get_layer":
                ks = [rng.choice(keys) for _ in range(rng.choice([1, 3]))]
                layer = rng.choice([0, 1, 5])
                ts = [torch.zeros(GEOM.layer_shape, dtype=torch.bfloat16) for _ in ks]
                ok, res = typed(f"{it} get_layer_into {layer}", lambda: kv.get_layer_into(ks, layer, ts), trail)
                if ok:
                    for k, tier, t in zip(ks, res, ts, strict=True):
                        if tier is not None:
                            tally["hits"] += 1
                            assert torch.equal(t, kv_block(k)[layer]), "get_layer_into returned changed bytes"
                tally["errors"] += not ok
            elif op == "evict":
                ks = [a_key() for _ in range(rng.choice([0, 1, 3]))]
                tiers = rng.choice([("pinned",), ("block",), ("shared",), ("pinned", "block"), ("disk",), "pinned",
                                    ("pinned", "block", "shared"), 5])
                ok, res = typed(f"{it} evict {tiers!r}", lambda: kv.evict(ks, tiers=tiers), trail)
                if ok and isinstance(tiers, tuple) and "shared" in tiers:
                    for k in ks:
                        stored.discard(bytes(k))
                        chunks = kv.shared.chunks if kv.shared is not None else None
                        if chunks is not None and bytes(k) in at:
                            # evicting a block removes the chunk files that hold it: its chunk's other blocks go
                            # with it (docs/kvcache.md), so they are no longer promised
                            first = at[bytes(k)] - at[bytes(k)] % chunks.per_chunk
                            stored.difference_update(keys[first:first + chunks.per_chunk])
                tally["errors"] += not ok
            elif op == "lookup":
                tokens = rng.choice([list(range(GEOM.block_tokens * 5)), [], "abc", [1.5] * 8, [2**70] * 4,
                                     np.arange(16), None])
                ok, res = typed(f"{it} lookup {type(tokens).__name__}", lambda: kv.lookup(tokens), trail)
                tally["errors"] += not ok
            elif op == "contains":
                k = a_key()
                ok, res = typed(f"{it} contains {_short(k)}", lambda: kv.contains(k), trail)
                if ok and not res and bytes(k) in stored and kv.shared is not None:
                    raise AssertionError("contains: a stored block is not there")
                tally["errors"] += not ok
            elif op == "wait":
                timeout = rng.choice(TIMEOUTS)
                ok, res = typed(f"{it} wait_for_puts({timeout!r})", lambda: kv.wait_for_puts(timeout), trail)
                if not ok and not isinstance(res, (errors.InvalidRequestError, errors.IOTimeoutError)):
                    raise AssertionError(f"wait_for_puts failed: {res!r}")
            elif op == "discard":
                typed(f"{it} discard_partial", lambda: kv.discard_partial(), trail)
            elif op == "reopen":
                typed(f"{it} close", kv.close, trail)
                ok, res = typed(f"{it} get on a closed store", lambda: kv.get_into(keys[:1], [bytearray(1024)]),
                                trail)
                assert not ok and "closed" in str(res)
                kv = open_kv()
                if kv.shared is None:
                    pass  # the blocks stay on disk; the next store with a shared tier finds them again
                # an engine makes each prompt's keys with the store it asks (keys_for): how the store finds the
                # chunk files a block is in (docs/kvcache.md); the keys are the same
                assert kv.keys_for(range(GEOM.block_tokens * 48)) == keys
                tally["reopens"] += 1
        typed("final wait_for_puts", lambda: kv.wait_for_puts(30), trail)
        if kv.shared is not None:
            for k in sorted(stored):
                dest = torch.zeros(GEOM.block_shape, dtype=torch.bfloat16)
                tier = kv.get_into([k], [dest])[0]
                check_get(k, tier, dest, kv_raw(dest), "final check")
    finally:
        kv.close()
        block.close()
    return tally


def test_fuzz_kv_cache(tmp_path: Path, scale: int) -> None:
    seed = seed_of()
    tally: dict[str, int] = {}

    def body(rng: random.Random, trail: list[str]) -> None:
        tally.update(fuzz_kv(rng, trail, tmp_path, KV_ITERATIONS * scale))

    start = time.monotonic()
    run_fuzz("KV cache", body, seed)
    print(f"KV cache fuzz: seed {seed}, {tally} in {time.monotonic() - start:.1f} s")
    assert tally["ops"] == KV_ITERATIONS * scale and tally["hits"] > 0 and tally["errors"] > 0


# -- threads ---------------------------------------------------------------------------------------------------
def test_threads_interleaving_on_one_kv_cache_lose_and_corrupt_nothing(tmp_path: Path, race_seconds: float) -> None:
    """Four threads put, get (both modes), prefetch and evict the pinned and block tiers of one store, whose
    pinned tier and block store are far smaller than the key set (constant eviction); the shared tier keeps
    every block, so a key once put never misses and every hit is bit-exact."""
    seed = seed_of()
    block = BlockStore({"kind": "image", "path": str(tmp_path / "hot.img"), "size": 3 << 20},
                       size_classes=(GEOM.block_bytes,))
    kv = KVCacheStore(GEOM, model_id="threads", pinned_bytes=8 * 8192, block_store=block,
                      shared_dir=tmp_path / "shared")
    keys = kv.keys_for(range(GEOM.block_tokens * 256))
    put_done: set[bytes] = set()
    lock = threading.Lock()
    failures: list[str] = []
    counts = {"ops": 0, "hits": 0}
    stop = time.monotonic() + max(1.0, race_seconds)

    def worker(n: int) -> None:
        rng = random.Random(seed + n)
        try:
            while time.monotonic() < stop and not failures:
                ks = rng.sample(keys, rng.choice([1, 4, 16]))
                op = rng.random()
                if op < 0.35:
                    kv.put(ks, [kv_block(k) for k in ks])
                    with lock:
                        put_done.update(ks)
                elif op < 0.8:
                    with lock:
                        known = {k for k in ks if k in put_done}
                    dests = [torch.full(GEOM.block_shape, 7.0, dtype=torch.bfloat16) for _ in ks]
                    tiers = kv.get_into(ks, dests, keep_on_miss=rng.random() < 0.7)
                    for k, t, d in zip(ks, tiers, dests, strict=True):
                        if t is None and k in known:
                            failures.append(f"a block put earlier missed (seed {seed})")
                        if t is not None and not torch.equal(d, kv_block(k)):
                            failures.append(f"a block came back changed from {t} (seed {seed})")
                        counts["hits"] += t is not None
                elif op < 0.9:
                    kv.prefetch(ks).get(30)
                else:
                    kv.evict(ks, tiers=rng.choice([("pinned",), ("block",), ("pinned", "block")]))
                counts["ops"] += 1
        except BaseException as exc:
            failures.append(f"thread {n}: {type(exc).__name__}: {exc} (seed {seed})")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, race_seconds) + STALL)
            assert not t.is_alive(), f"a thread hung (seed {seed})"
        kv.wait_for_puts(30)
    finally:
        kv.close()
        block.close()
    print(f"KV threads: seed {seed}, {counts}")
    assert not failures, failures[:5]
    assert counts["hits"] > 0
