"""``sfstore.kvcache.lmcache`` inside LMCache 0.5.6's real cache engine (CPU): configured as LMCache documents,
built by its own plugin loader, storing and retrieving real tensors. Only the GPU connector is a stand-in (see
``engine.py``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lmcache.v1.cache_engine",
                    reason="LMCache is not installed here (tools/kvbench-env.sh makes .venv-kvbench)")
import torch
from kvcache.stalls import simulated_stall  # tests/kvcache (pytest puts tests/ on sys.path)

from sfstore import errors
from sfstore.kvcache.lmcache import SfstoreBackend

from .engine import CHUNK, CHUNK_BYTES, MODEL, PLUGIN, empty, lmcache_engine, prompt, settings

ENGINE = Path(__file__).with_name("engine.py")


def _in_new_process(op: str, shared: Path, seed: int, chunks: int, *more: str) -> dict[str, object]:
    run = subprocess.run([sys.executable, str(ENGINE), op, str(shared), str(seed), str(chunks), *more],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def _files(shared: Path) -> list[Path]:
    return sorted(p for p in shared.rglob("*.kvb") if p.is_file())


def test_lmcache_loads_the_plugin_from_its_config_and_a_new_process_retrieves_bit_exact(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    stored = _in_new_process("store", shared, seed=1, chunks=4)
    assert stored["stats"] == {"chunks_put": 4}
    assert len(_files(shared)) == 4  # a chunk is a file (no index kept in memory: LMCache's local_disk loses it)
    got = _in_new_process("retrieve", shared, seed=1, chunks=4)
    assert got["retrieved"] == 4 * CHUNK and got["exact"] is True
    assert got["stats"] == {"chunks_got": 4, "chunks_missed": 0, "gets_no_memory": 0}


def test_the_configuration_the_docs_show_stores_and_a_new_process_retrieves(tmp_path: Path) -> None:
    """docs/engines.md's YAML as it is (LMCache's CPU tier on): the new process's CPU tier is empty, so its hits
    are sfstore's."""
    shared = tmp_path / "shared"
    assert _in_new_process("store", shared, 9, 3, "docs")["stats"] == {"chunks_put": 3}
    got = _in_new_process("retrieve", shared, 9, 3, "docs")
    assert got["retrieved"] == 3 * CHUNK and got["exact"] is True
    assert got["stats"] == {"chunks_got": 3, "chunks_missed": 0, "gets_no_memory": 0}


def test_the_plugin_is_lmcaches_backend_and_its_lookup_store_and_retrieve_go_through_sfstore(tmp_path: Path) -> None:
    with lmcache_engine(settings(str(tmp_path / "shared"))) as e:
        assert isinstance(e.plugin, SfstoreBackend)  # built by LMCache's storage_plugin_launcher
        tokens, kv = prompt(2, chunks=3)
        assert e.lookup(tokens) == 0
        e.store(tokens, kv)
        e.plugin.wait_for_puts(30)
        assert e.lookup(tokens) == 3 * CHUNK
        longer = torch.cat([tokens, prompt(3, chunks=1)[0]])  # a longer prompt hits its stored prefix
        assert e.lookup(longer) == 3 * CHUNK
        got = empty(4)
        assert e.retrieve(longer, got) == 3 * CHUNK
        assert all(torch.equal(a, b) for a, b in zip(kv, got[:3], strict=True)) and not got[3].any()
        stats = e.plugin.stats()
        assert stats["plugin"]["chunks_got"] == 3 and stats["store"]["hits_shared"] == 3


def test_a_damaged_chunk_is_a_miss_that_lmcache_recomputes_and_stores_again(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    with lmcache_engine(settings(str(shared))) as e:
        tokens, kv = prompt(4, chunks=3)
        e.store(tokens, kv)
        e.plugin.wait_for_puts(30)
        files = _files(shared)
        assert len(files) == 3
    # which file holds chunk 1 is not known from outside: damage each in turn, in a fresh engine each time
    for victim in files:
        raw = bytearray(victim.read_bytes())
        raw[-100] ^= 0x5A
        victim.write_bytes(bytes(raw))
        with lmcache_engine(settings(str(shared))) as e:
            got = empty(3)
            n = e.retrieve(tokens, got)
            assert n < 3 * CHUNK and n % CHUNK == 0  # the chunks before the damaged one, never its bytes
            assert all(torch.equal(kv[i], got[i]) for i in range(n // CHUNK))
            assert e.plugin.stats()["store"]["corrupt_dropped"] == 1 and not victim.exists()
            e.store(tokens, kv)  # what an engine does after recomputing the missed chunks
            e.plugin.wait_for_puts(30)
            again = empty(3)
            assert e.retrieve(tokens, again) == 3 * CHUNK
            assert all(torch.equal(a, b) for a, b in zip(kv, again, strict=True))


def test_a_stalled_shared_tier_misses_within_its_deadline(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    with lmcache_engine(settings(str(shared), **{"sfstore.io_timeout_ms": 300})) as e:
        tokens, kv = prompt(5, chunks=2)
        e.store(tokens, kv)
        e.plugin.wait_for_puts(30)
        tier = e.plugin.store.shared
        allocator = e.plugin.local_cpu_backend.memory_allocator.pin_allocator
        idle = allocator.total_allocated_size
        with simulated_stall(tier, "_open_blocks", tmp_path):  # (a batch opens its files in one native call)
            t0 = time.monotonic()
            got = empty(2)
            n = e.retrieve(tokens, got)
            took = time.monotonic() - t0
            # the abandoned read may still write the memory objects it was reading into: LMCache gets them
            # back only when it returns
            assert e.plugin.stats()["plugin"]["objects_lent"] == 2
            assert allocator.total_allocated_size == idle + 2 * CHUNK_BYTES
        assert n == 0 and not any(g.any() for g in got), e.plugin.stats()
        assert took < 3.0, f"a stalled tier held LMCache's retrieve for {took:.1f} s (deadline 0.3 s)"
        assert e.plugin.stats()["store"]["deadline_misses"] >= 1
        deadline = time.monotonic() + 10
        while allocator.total_allocated_size != idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert allocator.total_allocated_size == idle  # the stall ended: every memory object came back


def test_tags_keep_tenants_apart(tmp_path: Path) -> None:
    with lmcache_engine(settings(str(tmp_path / "shared"))) as e:
        tokens, kv = prompt(6, chunks=2)
        e.store(tokens, kv, request_configs={"lmcache.tag.tenant": "a"})
        e.plugin.wait_for_puts(30)
        assert e.retrieve(tokens, empty(2), request_configs={"lmcache.tag.tenant": "b"}) == 0
        assert e.retrieve(tokens, empty(2)) == 0
        got = empty(2)
        assert e.retrieve(tokens, got, request_configs={"lmcache.tag.tenant": "a"}) == 2 * CHUNK
        assert all(torch.equal(a, b) for a, b in zip(kv, got, strict=True))


def test_a_model_of_another_name_shares_nothing(tmp_path: Path) -> None:
    shared = str(tmp_path / "shared")
    tokens, kv = prompt(7, chunks=1)
    with lmcache_engine(settings(shared)) as e:
        e.store(tokens, kv)
        e.plugin.wait_for_puts(30)
    with lmcache_engine(settings(shared), model=MODEL + "-other") as e:
        assert e.retrieve(tokens, empty(1)) == 0


def test_remove_honours_pins_unless_forced(tmp_path: Path) -> None:
    with lmcache_engine(settings(str(tmp_path / "shared"))) as e:
        tokens, kv = prompt(8, chunks=1)
        e.store(tokens, kv)
        e.plugin.wait_for_puts(30)
        key = next(iter(e.engine.token_database.process_tokens(tokens=tokens)))[2]
        assert e.plugin.contains(key, pin=True)
        assert e.plugin.remove(key, force=False) is False and e.plugin.contains(key)
        assert e.plugin.unpin(key) and e.plugin.remove(key, force=False) is True
        assert not e.plugin.contains(key) and e.retrieve(tokens, empty(1)) == 0


def test_unfull_chunks_are_refused_at_start_and_lmcache_says_so(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    config = settings(str(tmp_path / "shared"))
    config["save_unfull_chunk"] = True
    with caplog.at_level(logging.ERROR), lmcache_engine(config) as e:
        assert e.plugin is None  # LMCache logs a plugin's failure and runs without it
    assert any("save_unfull_chunk" in r.getMessage() for r in caplog.records)


def test_bad_options_are_typed_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from .engine import HEAD_DIM, HEADS, LAYERS

    meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK)
    cfg = LMCacheEngineConfig.from_defaults(**settings(str(tmp_path), **{"sfstore.io_timeout_ms": -5}))
    with pytest.raises(errors.ConfigError, match="io_timeout_ms"):
        SfstoreBackend(dst_device="cpu", config=cfg, metadata=meta, local_cpu_backend=object())
    cfg = LMCacheEngineConfig.from_defaults(**settings(str(tmp_path), **{"sfstore.shared_dri": "/x"}))
    with caplog.at_level(logging.WARNING):
        SfstoreBackend(dst_device="cpu", config=cfg, metadata=meta, local_cpu_backend=object()).close()
    assert any("sfstore.shared_dri" in r.getMessage() for r in caplog.records)
    b = SfstoreBackend(dst_device="cpu", config=LMCacheEngineConfig.from_defaults(**settings(str(tmp_path))),
                       metadata=meta, local_cpu_backend=object())
    try:
        assert b.geometry.block_bytes == CHUNK_BYTES and PLUGIN == "sfstore"
    finally:
        b.close()
