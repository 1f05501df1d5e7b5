"""``sfstore.kvcache.vllm_offload``: sfstore as a secondary tier of vLLM's tiering offload (vLLM 0.33.0, CPU).

Real here: the ``OffloadingConfig`` built by vLLM from a ``VllmConfig`` and a planned ``KVCacheConfig``, the spec made
by vLLM's ``OffloadingSpecFactory`` from ``spec_name``/``spec_module_path``, its ``TieringOffloadingManager`` with
the CPU primary tier in shared memory, cascades and promotions. What is not: vLLM's GPU<->CPU worker (it needs a
GPU), so the test writes chunk bytes into the CPU tier where the worker would, at the chunk ids the manager gives.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here (tools/vllm-env.sh makes .venv-vllm)")
import numpy as np
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from sfstore.kvcache import vllm_offload

pytestmark = pytest.mark.vllm

BLOCK, LAYERS, KV_HEADS, HEAD_DIM = 16, 2, 2, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }))
    return d


def make_manager(model_dir: Path, extra: dict[str, Any]) -> Any:
    """A tiering offload manager as vLLM's OffloadingConnector makes it on the scheduler side."""
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            engine_id=f"sfstore-test-{uuid.uuid4().hex[:8]}",
                                            kv_connector_extra_config=extra),
    )
    cfg.cache_config.kv_cache_layout = "LBHNC"
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(LAYERS)}
    kcc = get_kv_cache_configs(cfg, [specs], [32 * spec.page_size_bytes * LAYERS],
                               get_global_kv_cache_groups(cfg, [specs]))[0]
    offload_spec = OffloadingSpecFactory.create_spec(build_offloading_config(cfg, kcc))
    assert type(offload_spec).__name__ == "SfstoreOffloadingSpec"
    return offload_spec.get_manager()


@pytest.fixture
def extra(tmp_path: Path) -> dict[str, Any]:
    return {"spec_name": "SfstoreOffloadingSpec", "spec_module_path": "sfstore.kvcache.vllm_offload",
            "cpu_bytes_to_use": 1 << 20, "shared_dir": str(tmp_path / "shared"), "model_id": "tiny"}


@pytest.fixture
def managers(model_dir: Path, extra: dict[str, Any]) -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for m in made:
        m.shutdown()


def settle(manager: Any, tier: vllm_offload.SfstoreTier, deadline_s: float = 10.0) -> None:
    """End scheduler steps until the tier's jobs are done and the manager took their results."""
    end = time.monotonic() + deadline_s
    while True:
        tier.drain_jobs()
        with manager.lock:
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            busy = manager.has_pending_work()
        if not busy:
            return
        assert time.monotonic() < end, "the tiering manager kept pending work"
        time.sleep(0.01)


def test_chunks_cascade_to_sfstore_and_promote_back_in_another_server(
    model_dir: Path, extra: dict[str, Any], managers: list[Any]
) -> None:
    a = make_manager(model_dir, extra)
    managers.append(a)
    tier = a.secondary_tiers[0]
    assert isinstance(tier, vllm_offload.SfstoreTier)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 4)]
    view = np.asarray(a.primary_tier.get_kv_memoryview())
    rng = np.random.default_rng(7)
    with a.lock:
        ctx = ReqContext(req_id="r1")
        a.on_new_request(ctx)
        out = a.prepare_store(keys, ctx)
        assert list(out.keys_to_store) == keys
        chunk_ids = [int(c) for c in out.store_spec.chunk_ids]
        payload = rng.integers(-128, 127, size=(len(keys), view.shape[1]), dtype=np.int8)
        view[chunk_ids] = payload  # where vLLM's GPU->CPU worker writes the blocks
        a.complete_store(keys, ctx)  # cascades to the secondary tier (sfstore)
        a.on_request_finished(ctx)
    settle(a, tier)
    assert all(tier.store.contains(tier.key(k)) for k in keys)
    assert tier.store.stats()["resident"]["shared"] == len(keys)

    b = make_manager(model_dir, extra)  # another server: an empty CPU tier, the same shared directory
    managers.append(b)
    btier = b.secondary_tiers[0]
    with b.lock:
        ctx = ReqContext(req_id="r2")
        b.on_new_request(ctx)
        first = [b.lookup(k, ctx) for k in keys]
    assert first == [LookupResult.HIT_PENDING] * len(keys)  # found in sfstore, promotion queued
    settle(b, btier)
    with b.lock:
        assert [b.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * len(keys)
        spec = b.prepare_load(keys, ctx)
        got = np.asarray(b.primary_tier.get_kv_memoryview())[[int(c) for c in spec.chunk_ids]]
        b.complete_load(keys, ctx)
        b.on_request_finished(ctx)
    assert np.array_equal(got, payload)  # bit-exact through sfstore's shared tier
    with b.lock:
        miss = b.lookup(make_offload_key(b"\x09" * 32, 0), ReqContext(req_id="r3"))
    assert miss == LookupResult.MISS


def test_tier_refuses_unknown_parameters(model_dir: Path, extra: dict[str, Any]) -> None:
    from sfstore import errors

    extra = {**extra, "secondary_tiers": [{"type": "SfstoreTier", "module_path": "sfstore.kvcache.vllm_offload",
                                           "shared_dir": extra["shared_dir"], "colour": "blue"}]}
    with pytest.raises(errors.ConfigError, match="colour"):
        make_manager(model_dir, extra)


def test_tier_takes_the_store_options_every_engine_config_carries(
    model_dir: Path, extra: dict[str, Any], managers: list[Any]
) -> None:
    """The options read one way for every engine (``engine_options``): a bad value is named, a good one used."""
    from sfstore import errors

    tier = {"type": "SfstoreTier", "module_path": "sfstore.kvcache.vllm_offload", "shared_dir": extra["shared_dir"]}
    bad = {**extra, "secondary_tiers": [{**tier, "io_timeout_ms": "soon"}]}
    with pytest.raises(errors.ConfigError, match="io_timeout_ms"):
        make_manager(model_dir, bad)
    good = {**extra, "secondary_tiers": [{**tier, "cache_namespace": "team-a", "fsync_shared": True}]}
    m = make_manager(model_dir, good)
    managers.append(m)
    store = m.secondary_tiers[0].store
    assert store.stats()["cache_namespace"] == "team-a" and store.shared.fsync is True
