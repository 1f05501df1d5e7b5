"""sfstore's SfstoreOffloadingSpec in vLLM's offloading on a GPU: vLLM builds the spec and its CPU offloading worker
over CUDA KV pages; blocks go GPU -> vLLM's CPU tier -> sfstore's shared tier, and a second engine (its own, empty
CPU tier) finds them there, promotes them and loads them into zeroed GPU blocks, bit for bit.

Needs vLLM with vLLM 0.33's offloading API (vLLM's CPU platform cannot run this worker: tests/vllm covers the rest
on the CPU); skipped, saying what is missing, elsewhere."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import MiB, gpu_marks

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU tests need a CUDA build of torch")
pytestmark = [*gpu_marks(torch), pytest.mark.vllm]

LAYERS, BLOCK, HEADS, DIM, GPU_BLOCKS = 4, 16, 8, 128, 64
COUNT = 8  # blocks offloaded and loaded back


def _vllm_offload_modules() -> dict[str, Any]:
    """vLLM's offloading classes this test drives (vLLM 0.33's API), or a skip saying what is missing."""
    spec = importlib.util.find_spec("vllm")
    # A namespace package (no origin) is not vLLM: pytest puts tests/ on sys.path, where tests/vllm is one.
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed here: pip install vllm (a CUDA build; tools/vllm-env.sh makes a CPU one, "
                    "where vLLM's CPU offloading worker does not run)")
    names = {
        "config": "vllm.config", "base": "vllm.v1.kv_offload.base", "cpu_common": "vllm.v1.kv_offload.cpu.common",
        "factory": "vllm.v1.kv_offload.factory", "planning": "vllm.v1.core.kv_cache_planning",
        "interface": "vllm.v1.kv_cache_interface", "parallel": "vllm.distributed.parallel_state",
        "offload_config": "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config",
        "sfstore": "sfstore.kvcache.vllm_offload",
    }
    mods: dict[str, Any] = {}
    for key, name in names.items():
        try:
            mods[key] = importlib.import_module(name)
        except Exception as exc:  # ImportError, or vLLM failing to load its CUDA extensions
            import vllm

            pytest.skip(f"vLLM {getattr(vllm, '__version__', '?')} has no usable {name} ({type(exc).__name__}: "
                        f"{exc}); this test follows vLLM 0.33's offloading API")
    for key, attr in (("base", "CanonicalKVCaches"), ("base", "GPULoadStoreSpec"), ("base", "make_offload_key"),
                      ("offload_config", "build_offloading_config")):
        if not hasattr(mods[key], attr):
            import vllm

            pytest.skip(f"vLLM {getattr(vllm, '__version__', '?')} has no {names[key]}.{attr}: this test follows "
                        "vLLM 0.33's offloading API")
    return mods


def _offload_spec(m: dict[str, Any], model_dir: Path, shared_dir: Path, engine_id: str) -> tuple[Any, Any, int]:
    """vLLM's config, the spec its OffloadingSpecFactory makes from ``spec_name: SfstoreOffloadingSpec`` and the
    bytes of one block of one layer."""
    extra = {"spec_name": "SfstoreOffloadingSpec", "spec_module_path": "sfstore.kvcache.vllm_offload",
             "cpu_bytes_to_use": 64 * MiB, "shared_dir": str(shared_dir), "model_id": "gpu-test-offload"}
    c = m["config"]
    cfg = c.VllmConfig(
        model_config=c.ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                                   max_model_len=512),
        cache_config=c.CacheConfig(block_size=BLOCK),
        kv_transfer_config=c.KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                              engine_id=engine_id, kv_connector_extra_config=extra),
    )
    # What the engine core resolves before planning (the worker here takes each layer as int8 pages, whatever the
    # attention backend's layout).
    cfg.cache_config.kv_cache_layout = "LBHNC"
    attn = m["interface"].FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
    specs = {f"model.layers.{i}.self_attn.attn": attn for i in range(LAYERS)}
    kcc = m["planning"].get_kv_cache_configs(
        cfg, [specs], [GPU_BLOCKS * attn.page_size_bytes * LAYERS],
        m["planning"].get_global_kv_cache_groups(cfg, [specs]))[0]
    spec = m["factory"].OffloadingSpecFactory.create_spec(m["offload_config"].build_offloading_config(cfg, kcc))
    assert type(spec).__name__ == "SfstoreOffloadingSpec", f"vLLM made a {type(spec).__name__}"
    return cfg, spec, int(attn.page_size_bytes)


def _canonical(m: dict[str, Any], caches: list[Any], page: int) -> Any:
    """The caches as vLLM's OffloadingConnector hands them to its worker: one int8 (blocks, page) tensor per layer,
    all layers in one KV cache group."""
    b = m["base"]
    return b.CanonicalKVCaches(tensors=[b.CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in caches],
                               group_data_refs=[[b.CanonicalKVCacheRef(i, page) for i in range(len(caches))]])


def _offload_engine(m: dict[str, Any], spec: Any, caches: list[Any], page: int,
                    owned: list[Any]) -> tuple[Any, Any, Any]:
    """One engine's side: ``spec``'s worker over ``caches`` and its manager (both added to ``owned``, to be shut
    down) and the manager's sfstore tier: ``(worker, manager, tier)``."""
    worker = spec.get_worker(_canonical(m, caches, page))
    owned.append(worker)
    manager = spec.get_manager()
    owned.append(manager)
    return worker, manager, manager.secondary_tiers[0]


def _offload_settle(manager: Any, tier: Any, m: dict[str, Any], deadline_s: float = 60.0) -> None:
    """End scheduler steps until the sfstore tier's jobs are done and the tiering manager took their results."""
    end = time.monotonic() + deadline_s
    ctx = getattr(m["base"], "ScheduleEndContext", None)
    while True:
        tier.drain_jobs()
        with manager.lock:
            if ctx is not None:
                manager.on_schedule_end(ctx(new_req_ids=(), preempted_req_ids=()))
            busy = manager.has_pending_work()
        if not busy:
            return
        if time.monotonic() > end:
            pytest.fail("vLLM's tiering manager kept pending work (cascade or promotion never finished)")
        time.sleep(0.01)


def _offload_wait(worker: Any, job_id: int, what: str, deadline_s: float = 60.0) -> None:
    """Wait for one job of vLLM's CPU offloading worker; a failure when it failed or never finished."""
    worker.wait({job_id})
    end = time.monotonic() + deadline_s
    while True:
        done = {r.job_id: r for r in worker.get_finished()}
        if job_id in done:
            assert done[job_id].success, f"vLLM's offloading worker reported the {what} job failed"
            return
        if time.monotonic() > end:
            pytest.fail(f"vLLM's offloading worker never finished the {what} job")
        time.sleep(0.005)


def _model_dir(base: Path) -> Path:
    """A Llama config of LAYERS layers of HEADS x DIM KV heads (no weights: nothing runs the model)."""
    model_dir = base / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
        "intermediate_size": 2048, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": DIM,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }))
    return model_dir


def test_vllm_offloading_spec_round_trip_through_sfstore(tmp_path: Path, cuda: torch.device) -> None:
    """GPU blocks stored by one engine's worker reach sfstore's shared tier through vLLM's CPU tier; a second engine
    finds them there (a hit after the promotion), loads them into zeroed GPU blocks, and they equal the first
    engine's bit for bit."""
    m = _vllm_offload_modules()
    ps = m["parallel"]
    model_dir = _model_dir(tmp_path)
    shared = tmp_path / "shared"
    tag = f"{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    owned: list[Any] = []  # managers and workers to shut down
    src_ids, dst_ids = list(range(3, 3 + COUNT)), [GPU_BLOCKS - 1 - i for i in range(COUNT)]
    keys = [m["base"].make_offload_key(bytes([i + 1]) * 32, 0) for i in range(COUNT)]
    started_dist = False
    try:
        cfg_a, spec_a, page = _offload_spec(m, model_dir, shared, f"sfstore-gpu-test-a-{tag}")
        with m["config"].set_current_vllm_config(cfg_a):
            if not ps.model_parallel_is_initialized():
                with contextlib.closing(socket.socket()) as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{port}")
                ps.ensure_model_parallel_initialized(1, 1)
                started_dist = True
            gen = torch.Generator(device="cuda").manual_seed(16)
            caches_a = [torch.randint(-128, 128, (GPU_BLOCKS, page), dtype=torch.int8, device="cuda", generator=gen)
                        for _ in range(LAYERS)]
            worker_a, manager_a, tier_a = _offload_engine(m, spec_a, caches_a, page, owned)
            with manager_a.lock:
                ctx = m["base"].ReqContext(req_id="r1")
                manager_a.on_new_request(ctx)
                out = manager_a.prepare_store(keys, ctx)
            assert list(out.keys_to_store) == keys, (
                f"vLLM's manager stores {len(out.keys_to_store)} of the {COUNT} blocks")
            worker_a.submit_store(1, m["base"].GPULoadStoreSpec(src_ids, [COUNT], [0]), out.store_spec)
            _offload_wait(worker_a, 1, "GPU->CPU store")
            with manager_a.lock:
                manager_a.complete_store(keys, ctx)  # cascades to the secondary tier: sfstore
                manager_a.on_request_finished(ctx)
            _offload_settle(manager_a, tier_a, m)
            missing = [i for i, k in enumerate(keys) if not tier_a.store.contains(tier_a.key(k))]
            assert not missing, f"blocks {missing} did not reach sfstore's shared tier"

            _cfg_b, spec_b, _page = _offload_spec(m, model_dir, shared, f"sfstore-gpu-test-b-{tag}")
            caches_b = [torch.zeros((GPU_BLOCKS, page), dtype=torch.int8, device="cuda") for _ in range(LAYERS)]
            worker_b, manager_b, tier_b = _offload_engine(m, spec_b, caches_b, page, owned)
            with manager_b.lock:
                ctx = m["base"].ReqContext(req_id="r2")
                manager_b.on_new_request(ctx)
                first = [str(manager_b.lookup(k, ctx)) for k in keys]
            _offload_settle(manager_b, tier_b, m)
            with manager_b.lock:
                again = [str(manager_b.lookup(k, ctx)) for k in keys]
                assert all(r.endswith("HIT") for r in again), (
                    f"after the promotion from sfstore vLLM's lookups say {again} (first {first})")
                load_spec = manager_b.prepare_load(keys, ctx)
            worker_b.submit_load(2, load_spec, m["base"].GPULoadStoreSpec(dst_ids, [COUNT], [0]))
            _offload_wait(worker_b, 2, "CPU->GPU load")
            with manager_b.lock:
                manager_b.complete_load(keys, ctx)
                manager_b.on_request_finished(ctx)
            torch.cuda.synchronize()
            bad = [(layer, i) for layer in range(LAYERS) for i in range(COUNT)
                   if not torch.equal(caches_b[layer][dst_ids[i]], caches_a[layer][src_ids[i]])]
            assert not bad, f"{len(bad)} (layer, block) pages differ, first {bad[0]}"
            assert tier_b.store.stats()["hits_shared"] >= COUNT, tier_b.store.stats()
    finally:
        for obj in reversed(owned):
            with contextlib.suppress(Exception):
                obj.shutdown()
        if started_dist:
            with contextlib.suppress(Exception):
                ps.destroy_model_parallel()
            with contextlib.suppress(Exception):
                ps.destroy_distributed_environment()
