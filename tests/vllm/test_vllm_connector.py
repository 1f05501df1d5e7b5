"""``sfstore.kvcache.vllm.SfstoreConnector`` against vLLM's real classes (vLLM 0.33.0 on the CPU).

Runs in its own environment: ``tools/vllm-env.sh`` makes ``.venv-vllm``, then
``.venv-vllm/bin/python -m pytest tests/vllm``. Elsewhere (the main venv has no vLLM) every test skips.

What is real here: ``VllmConfig``/``KVTransferConfig`` naming the connector by ``kv_connector_module_path``,
``KVConnectorFactory`` building both roles, vLLM's ``Scheduler`` (prefix cache, block allocation, chunked
prefill) calling the scheduler side, ``Request`` objects, ``Attention`` layers with the CPU backend, KV cache
configs and paged caches planned and allocated by vLLM's own functions, the worker connector made by
``ensure_kv_transfer_initialized``, the forward context, vLLM's per-step connector protocol
(``KVConnectorModelRunnerMixin``) and the ``maybe_transfer_kv_layer`` hook around ``unified_attention_with_output``.
What is not: the attention kernel (vLLM's CPU kernels are in ``vllm._C``, which the CUDA wheel lacks on a CPU
machine) — a stand-in writes each token's K and V into the paged cache, as the kernel does, from a deterministic
function of (layer, position, token); tests that use it say so in their names.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import contextlib
import json
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# tests/vllm itself would import as a namespace package named vllm where vLLM is absent: ask for a real module
pytest.importorskip("vllm.config", reason="vLLM is not installed here (tools/vllm-env.sh makes .venv-vllm)")
torch = pytest.importorskip("torch")

from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.layers.attention.attention import unified_attention_with_output  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache  # noqa: E402

from sfstore.kvcache import vllm as sfvllm  # noqa: E402
from sfstore.kvcache.vllm_loads import HeldLoad, StepLoads  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 16
LAYERS = 3
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
DTYPE = torch.bfloat16
MAX_LEN = 256
CONNECTOR = {"kv_connector": "SfstoreConnector", "kv_connector_module_path": "sfstore.kvcache.vllm"}


# -- a tiny model config that vLLM reads without a hub ---------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sfstore-vllm-model-") as d:
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD_DIM,
            "intermediate_size": 128, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        }
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        yield Path(d)


def make_config(model_dir: Path, extra: dict[str, Any], *, layout: str = "LBHNC", num_blocks: int = 64,
                batched_tokens: int = 2048, prefix_caching: bool = True) -> VllmConfig:
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=MAX_LEN),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=batched_tokens, max_model_len=MAX_LEN,
                                         max_num_seqs=8, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_role="kv_both", kv_connector_extra_config=extra, **CONNECTOR),
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    cfg.cache_config.kv_cache_layout = layout
    return cfg


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv_cache_config(cfg: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """Planned by vLLM from the layers' specs, as the engine core does."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=DTYPE)
    specs = {name: spec for name in layer_names()}
    groups = get_global_kv_cache_groups(cfg, [specs])
    return get_kv_cache_configs(cfg, [specs], [num_blocks * spec.page_size_bytes * LAYERS], groups)[0]


init_none_hash(__import__("vllm.utils.hashing", fromlist=["sha256"]).sha256)


def make_request(req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
    from vllm.utils.hashing import sha256

    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


# -- the stand-in attention kernel: K and V of a token are a function of (layer, position, token) ---------------------
def token_kv(layer: int, positions: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic [T, KV_HEADS, HEAD_DIM] keys and values, distinct per layer, position and token."""
    base = (layer * 1_000_003 + positions * 7919 + tokens * 31).to(torch.float64)
    grid = torch.arange(2 * KV_HEADS * HEAD_DIM, dtype=torch.float64)
    vals = torch.sin(base[:, None] * 0.001 + grid[None, :] * 0.37) * 8
    k, v = vals.to(DTYPE).view(-1, 2, KV_HEADS, HEAD_DIM).unbind(1)
    return k.contiguous(), v.contiguous()


def write_kv_like_the_kernel(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             slots: torch.Tensor, layout: str) -> None:
    """Write K and V at ``slots`` the way vLLM's backends read the page: the CPU backend views each head's page
    as all K rows then all V rows; FlashAttention-style backends split each cell into K then V."""
    blocks, offs = slots // BLOCK, slots % BLOCK
    nb, h, n, _c = kv_cache.shape
    if layout == "cpu":
        key_cache, value_cache = kv_cache.view(nb, h, 2 * n, -1).chunk(2, dim=2)  # as CPUAttentionBackendImpl
        key_cache[blocks, :, offs] = key
        value_cache[blocks, :, offs] = value
    else:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)  # as FlashAttentionImpl
        key_cache[blocks, offs] = key
        value_cache[blocks, offs] = value


@dataclass
class Engine:
    """One vLLM server's pieces: scheduler (with its connector), layers, paged KV cache, worker connector."""

    cfg: VllmConfig
    scheduler: Scheduler
    kv_caches: dict[str, torch.Tensor]
    layers: dict[str, Attention]
    worker: Any
    mode: str
    step_log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def step(self) -> Any:
        """One engine step: schedule, run the attention layers under vLLM's connector protocol, update."""
        so = self.scheduler.schedule()
        req_ids, tokens, positions, slots = [], [], [], []
        query_start, seq_lens, tables = [0], [], []
        for new in so.scheduled_new_reqs:
            self._rows[new.req_id] = (list(new.prompt_token_ids or ()), list(new.block_ids[0]))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            toks, blocks = self._rows[rid]
            ids = cached.new_block_ids[i]
            if ids is not None:
                blocks = list(ids[0]) if rid in cached.resumed_req_ids else blocks + list(ids[0])
            self._rows[rid] = (toks, blocks)
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, n in so.num_scheduled_tokens.items():
            toks, blocks = self._rows[rid]
            start = computed[rid]
            pos = torch.arange(start, start + n)
            req_ids.append(rid)
            positions.append(pos)
            tokens.append(torch.tensor(self.requests[rid].all_token_ids[start:start + n]))
            slots.append(torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK)
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            tables.append(blocks)
        pos_t, tok_t, slot_t = torch.cat(positions), torch.cat(tokens), torch.cat(slots)
        width = max(len(t) for t in tables)
        md = CPUAttentionMetadata(
            num_actual_tokens=len(slot_t), max_query_len=max(so.num_scheduled_tokens.values()),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32), max_seq_len=max(seq_lens),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            slot_mapping=slot_t, scheduler_metadata=None,
        )
        attn_md = {name: md for name in self.layers}
        with set_forward_context(attn_md, self.cfg, slot_mapping={name: slot_t for name in self.layers}):
            with KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_out:
                for li, name in enumerate(self.layers):
                    k, v = token_kv(li, pos_t, tok_t)
                    q = torch.zeros(len(slot_t), HEADS, HEAD_DIM, dtype=DTYPE)
                    out = torch.empty(len(slot_t), HEADS * HEAD_DIM, dtype=DTYPE)
                    self._pending_kv[name] = (k, v, slot_t)
                    unified_attention_with_output(q, k, v, out, name)
        # a token is sampled only where the step reached the end of the request's tokens (not mid-prefill)
        sampled = [[(seq_lens[i] * 17) % 1000] if seq_lens[i] >= self.requests[r].num_tokens else []
                   for i, r in enumerate(req_ids)]
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled, kv_connector_output=kv_out)
        stats = self.scheduler.connector_prefix_cache_stats
        self.step_log.append({"scheduled": dict(so.num_scheduled_tokens), "meta": so.kv_connector_metadata,
                              "computed": computed, "load_errors": set(kv_out.invalid_block_ids or ()),
                              "hits_by_source": dict(stats.hits_by_source) if stats is not None else None,
                              "kv_stats": kv_out.kv_connector_stats})
        self.scheduler.update_from_output(so, output)
        return so

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)

    def run(self, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def blocks_of(self, req_id: str) -> list[int]:
        return self._rows[req_id][1]

    def __post_init__(self) -> None:
        self._rows: dict[str, tuple[list[int], list[int]]] = {}
        self._pending_kv: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.requests: dict[str, Request] = {}
        engine = self

        def stand_in_kernel(layer: Attention, query: Any, key: Any, value: Any, kv_cache: torch.Tensor,
                            attn_metadata: Any, output: torch.Tensor, **kw: Any) -> torch.Tensor:
            write_kv_like_the_kernel(kv_cache, key, value, attn_metadata.slot_mapping, engine.mode)
            return output.zero_()

        for layer in self.layers.values():
            layer.impl.forward = stand_in_kernel


@contextlib.contextmanager
def engine(model_dir: Path, extra: dict[str, Any], *, layout: str = "LBHNC", num_blocks: int = 64,
           batched_tokens: int = 2048, prefix_caching: bool = True,
           stage_copies: bool | None = None) -> Iterator[Engine]:
    """A vLLM server's scheduler and worker in this process (as vLLM's single-process executor runs them)."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    cfg = make_config(model_dir, extra, layout=layout, num_blocks=num_blocks, batched_tokens=batched_tokens,
                      prefix_caching=prefix_caching)
    kcc = kv_cache_config(cfg, num_blocks)
    init_file = Path(tempfile.gettempdir()) / f"sfstore-vllm-dist-{uuid.uuid4().hex}"
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"file://{init_file}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        try:
            layers = {name: Attention(num_heads=HEADS, head_size=HEAD_DIM, scale=HEAD_DIM ** -0.5,
                                      num_kv_heads=KV_HEADS, cache_config=cfg.cache_config, prefix=name)
                      for name in layer_names()}
            kv_caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout])
            bind_kv_cache(kv_caches, cfg.compilation_config.static_forward_context, [])
            kv_transfer_state.ensure_kv_transfer_initialized(cfg, kcc)
            worker = kv_transfer_state.get_kv_transfer_group()
            worker.stage_copies = stage_copies  # True: the path a GPU cache takes (gather, one host copy, scatter)
            worker.register_kv_caches(kv_caches)
            sched = Scheduler(cfg, kcc, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=True)
            mode = sfvllm.layout_for(kcc, extra.get("kv_layout", "auto")).mode
            yield Engine(cfg, sched, kv_caches, layers, worker, mode)
        finally:
            kv_transfer_state.ensure_kv_transfer_shutdown()
            with contextlib.suppress(NameError):
                sched.shutdown()
            destroy_model_parallel()
            destroy_distributed_environment()
            init_file.unlink(missing_ok=True)


def expected_kv(layer: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return token_kv(layer, torch.arange(len(tokens)), torch.tensor(tokens))


def assert_blocks_hold(eng: Engine, block_ids: list[int], tokens: list[int]) -> None:
    """The paged cache's blocks hold exactly the K/V the stand-in kernel computes for ``tokens``."""
    for li, name in enumerate(layer_names()):
        cache = eng.kv_caches[name]
        key, value = expected_kv(li, tokens)
        for bi, b in enumerate(block_ids):
            view = sfvllm.block_layer_view(cache, b, eng.connector.layout)
            rows = slice(bi * BLOCK, (bi + 1) * BLOCK)
            if eng.mode == "opaque":
                continue  # bytes compared by the callers
            assert torch.equal(view[0].view(torch.int16), key[rows].view(torch.int16)), (name, b)
            assert torch.equal(view[1].view(torch.int16), value[rows].view(torch.int16)), (name, b)


def saved_then_scheduled(eng: Engine, name: str, prompt: list[int]) -> Any:
    """Request ``<name>1`` of ``prompt`` run to its end (its full blocks saved), then ``<name>2`` of the same prompt
    scheduled: the scheduler's output, which plans a load of every full block but the last token's."""
    eng.add(make_request(f"{name}1", prompt))
    eng.run()
    eng.add(make_request(f"{name}2", prompt))
    so = eng.scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    return so


def loads_by_hand(eng: Engine, so: Any) -> set[int]:
    """The worker's load hooks for a step the test scheduled (no attention runs): bind the metadata, start the
    loads, wait for every layer, end the step; the block ids reported as load errors."""
    worker = eng.worker
    worker.bind_connector_metadata(so.kv_connector_metadata)
    worker.start_load_kv(None)
    for name in layer_names():
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return set(worker.get_block_ids_with_load_errors())


# -- tests ----------------------------------------------------------------------------------------------------------
def test_factory_builds_both_roles_from_module_path(model_dir: Path) -> None:
    cfg = make_config(model_dir, {"pinned_bytes": 1 << 20})
    kcc = kv_cache_config(cfg, 32)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        assert type(sched).__name__ == type(worker).__name__ == "SfstoreConnector"
        assert sched.role == KVConnectorRole.SCHEDULER and worker.role == KVConnectorRole.WORKER
        g = sched.layout.geometry
        assert (g.num_layers, g.block_tokens, g.num_kv_heads, g.head_dim, g.dtype, g.kv) == (
            LAYERS, BLOCK, KV_HEADS, HEAD_DIM, "bfloat16", 2)
        assert sched.layout.mode == "cpu"  # vLLM's CPU platform
        assert sched.store is worker.store  # one process, one store: the scheduler sees what the worker saved
        # the model directory's name and a digest of its config and weights, not its path as typed
        assert sched.model_id.startswith(f"{model_dir.name}#") and str(model_dir) not in sched.model_id
    finally:
        sched.shutdown()
        worker.shutdown()


def test_block_views_match_vllm_backends_reading_of_the_page(model_dir: Path) -> None:
    """The store's (kv, token, head, dim) view of a page is K and V as vLLM's backends read them."""
    for layout, mode in (("LBHNC", "cpu"), ("LBNHC", "split"), ("BLNHC", "split"), ("LBNHC", "opaque")):
        cfg = make_config(model_dir, {}, layout=layout)
        kcc = kv_cache_config(cfg, 32)
        caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout])
        lay = sfvllm.layout_for(kcc, mode)
        cache = caches[layer_names()[1]]
        slots = torch.arange(3 * BLOCK, 4 * BLOCK)
        k, v = token_kv(1, slots, slots + 5)
        write_kv_like_the_kernel(cache, k, v, slots, "cpu" if mode == "cpu" else "split")
        view = sfvllm.block_layer_view(cache, 3, lay)
        assert tuple(view.shape) == lay.geometry.layer_shape
        whole = sfvllm.pages_as_layers(cache, lay)  # every page at once, as the batched copies see them
        assert tuple(whole.shape) == (cache.shape[0], *lay.geometry.layer_shape)
        assert torch.equal(whole[3], view) and whole[3].data_ptr() == view.data_ptr()
        assert whole[3].stride() == view.stride()
        if mode == "opaque":
            assert torch.equal(view[0].permute(1, 0, 2), cache[3])
        else:
            assert torch.equal(view[0], k) and torch.equal(view[1], v), (layout, mode)


def test_scheduler_lookup_rounds_to_blocks_and_keeps_one_token(model_dir: Path) -> None:
    with engine(model_dir, {"pinned_bytes": 4 << 20}) as eng:
        conn = eng.connector
        tokens = list(range(100, 196))  # 96 tokens: 6 full blocks
        keys = conn.store.keys_for(tokens, ())
        blocks = [torch.zeros(conn.layout.geometry.block_bytes // 2, dtype=DTYPE) for _ in keys]
        conn.store.put(keys, blocks)
        req = make_request("q", tokens)
        assert conn.get_num_new_matched_tokens(req, 0) == (80, False)  # not the last block: 1 token to compute
        assert conn.get_num_new_matched_tokens(req, 32) == (48, False)
        longer = make_request("q2", [*tokens, 7, 8, 9])
        assert conn.get_num_new_matched_tokens(longer, 0) == (96, False)
        other = make_request("q3", [1, *tokens[1:]])
        assert conn.get_num_new_matched_tokens(other, 0) == (0, False)
        salted = Request("q4", [*tokens, 7], SamplingParams(max_tokens=1), None, cache_salt="tenant-b")
        assert conn.get_num_new_matched_tokens(salted, 0) == (0, False)  # the salt is part of every key


@pytest.mark.parametrize("layout,kv_layout,staged", [
    ("LBHNC", "auto", None), ("LBNHC", "split", None), ("BLNHC", "opaque", None), ("LBHNC", "auto", True),
    ("LBNHC", "split", True), ("BLNHC", "opaque", True),
])
def test_save_then_load_in_another_server_with_stand_in_attention_kernel(
    model_dir: Path, tmp_path: Path, layout: str, kv_layout: str, staged: bool | None
) -> None:
    """Server A computes a prompt and saves its blocks; server B (new paged cache, other block ids) gets the
    prefix from the store, bit-exact, and computes only the rest."""
    extra = {"pinned_bytes": 4 << 20, "shared_dir": str(tmp_path / "shared"), "kv_layout": kv_layout,
             "model_id": f"tiny-{layout}-{kv_layout}-{staged}"}
    prompt = [(i * 37 + 11) % 1000 for i in range(100)]  # 6 full blocks and 4 tokens
    with engine(model_dir, extra, layout=layout, stage_copies=staged) as a:
        a.add(make_request("a1", prompt))
        first = a.step()
        assert first.scheduled_new_reqs[0].num_computed_tokens == 0  # nothing in the store yet
        meta = a.step_log[0]["meta"]
        assert isinstance(meta, sfvllm.SfstoreConnectorMetadata)
        assert meta.loads == [] and len(meta.saves) == 1
        assert meta.saves[0].block_ids == a.blocks_of("a1")[:6]
        a.run()
        a_blocks = a.blocks_of("a1")[:6]
        a_pages = {name: a.kv_caches[name][a_blocks].clone() for name in layer_names()}
        assert_blocks_hold(a, a_blocks, prompt[:96])
        keys = a.connector.store.keys_for(prompt, ())
        assert all(a.connector.store.contains(k) for k in keys)
        a.connector.store.wait_for_puts()

    with engine(model_dir, extra, layout=layout, num_blocks=48, stage_copies=staged) as b:
        store = b.connector.store
        b.add(make_request("filler", [5] * 40))  # takes the first block ids: B's blocks differ from A's
        b.step()
        assert store is not a.connector.store  # a new server: a new pinned tier, the shared tier is common
        pinned_before = store.stats()["resident"]["pinned"]
        b.add(make_request("b1", [*prompt, 1, 2, 3]))
        so = b.step()
        assert store.stats()["resident"]["pinned"] == pinned_before + 6  # promoted from the shared tier
        new = next(r for r in so.scheduled_new_reqs if r.req_id == "b1")
        assert new.num_computed_tokens == 96  # 6 blocks from the store
        assert so.num_scheduled_tokens["b1"] == 7  # only the rest is computed
        meta = b.step_log[-1]["meta"]
        b_blocks = b.blocks_of("b1")[:6]
        assert [t.block_ids for t in meta.loads] == [b_blocks]
        assert b_blocks != a_blocks
        assert b.step_log[-1]["load_errors"] == set()
        assert b.step_log[-1]["hits_by_source"] == {CacheHitSource.DISK: 96}  # from the shared tier
        # scheduler and worker share this process: the scheduler started the reads, the worker took them
        assert b.step_log[-1]["kv_stats"].data["blocks_prefetched_by_scheduler"] == 6
        assert b.step_log[-1]["kv_stats"].data["hits_shared"] == 6  # each block read and counted once
        for name in layer_names():
            assert torch.equal(b.kv_caches[name][b_blocks].view(torch.int16), a_pages[name].view(torch.int16)), name
        assert_blocks_hold(b, b_blocks, prompt[:96])
        b.run()


def test_a_saving_step_never_lists_the_shared_directory_with_stand_in_attention_kernel(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV events of a step's saves name the store's tiers without KVCacheStore.stats(), whose count of the
    shared tier lists its whole directory (seconds on a large NFS directory, and under the tier's deadline).
    A spy on SharedTier.count (it calls through) tells whether any step listed it."""
    from sfstore.kvcache.tiers import SharedTier

    listings: list[int] = []
    real_count = SharedTier.count

    def counting(self: SharedTier) -> int | None:
        listings.append(1)
        return real_count(self)

    monkeypatch.setattr(SharedTier, "count", counting)
    extra = {"pinned_bytes": 4 << 20, "shared_dir": str(tmp_path / "shared"), "model_id": "tiny-no-listing"}
    prompt = [(i * 29 + 5) % 1000 for i in range(100)]  # 6 full blocks
    with engine(model_dir, extra) as eng:
        eng.add(make_request("s1", prompt))
        eng.run()
        assert listings == []
        store = eng.connector.store
        store.wait_for_puts()
        assert all(store.contains(k) for k in store.keys_for(prompt[:96], ()))
        assert store.stats()["resident"]["shared"] == 6 and listings == [1]  # stats() itself does list


def test_a_full_hit_plans_no_save_and_asks_the_shared_tier_once_with_stand_in_attention_kernel(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new server gets every block of a stored prompt but the last, which vLLM recomputes for its last token:
    that block is in the shared tier already, so the step saves nothing, and the scheduler learnt it in the
    lookup's one call to the shared tier (not in a second one while building the step's metadata). A spy on
    TierGuard.run (it calls through) records what each call to the shared tier was for."""
    from sfstore.kvcache.deadline import TierGuard

    asked: list[str] = []
    real_run = TierGuard.run

    def spying(self: TierGuard, fn: Any, *args: Any, **kw: Any) -> Any:
        asked.append(str(kw.get("what")))
        return real_run(self, fn, *args, **kw)

    extra = {"pinned_bytes": 4 << 20, "shared_dir": str(tmp_path / "shared"), "model_id": "tiny-full-hit"}
    prompt = [(i * 31 + 7) % 1000 for i in range(96)]  # 6 full blocks, the last token in the last one
    with engine(model_dir, extra) as a:
        a.add(make_request("a1", prompt))
        a.run()
        a.connector.store.wait_for_puts()
    with engine(model_dir, extra) as b:
        b.add(make_request("b1", prompt))
        monkeypatch.setattr(TierGuard, "run", spying)
        so = b.step()
        monkeypatch.setattr(TierGuard, "run", real_run)
        new = so.scheduled_new_reqs[0]
        assert new.num_computed_tokens == 80 and so.num_scheduled_tokens["b1"] == 16
        meta = b.step_log[-1]["meta"]
        assert [len(t.keys) for t in meta.loads] == [5] and meta.saves == []
        assert asked.count("a lookup") == 1  # the scheduler's lookup; the rest are the 5 blocks' reads
        assert all(w == "a lookup" or w.startswith("a read of") for w in asked), asked
        b.run()


def test_chunked_prefill_saves_each_block_once_with_stand_in_attention_kernel(model_dir: Path) -> None:
    prompt = [(i * 13 + 3) % 1000 for i in range(150)]  # 9 full blocks
    extra = {"pinned_bytes": 4 << 20, "model_id": "tiny-chunked"}
    with engine(model_dir, extra, batched_tokens=40) as eng:
        eng.add(make_request("c1", prompt))
        eng.run()
        saved = [b for entry in eng.step_log for t in entry["meta"].saves for b in t.block_ids]
        assert len(eng.step_log) >= 4  # 150 tokens in chunks of 40
        assert saved == eng.blocks_of("c1")[:9]  # each full prompt block once, in order, as it completed
        store = eng.connector.store
        assert all(store.contains(k) for k in store.keys_for(prompt, ()))
        assert eng.connector.get_num_new_matched_tokens(make_request("c2", prompt), 0) == (144, False)


def test_sleep_mode_unregisters_and_restores_the_caches_with_stand_in_attention_kernel(model_dir: Path) -> None:
    """vLLM 0.33's sleep mode: the connector says it supports it, holds no cache while vLLM sleeps (a stray load
    is refused, not copied into unmapped memory) and loads into the same caches after wake-up."""
    prompt = [(i * 7 + 5) % 1000 for i in range(70)]  # 4 full blocks
    extra = {"pinned_bytes": 4 << 20, "model_id": "tiny-sleep"}
    with engine(model_dir, extra, prefix_caching=False) as eng:
        assert type(eng.worker).supports_sleep_mode(eng.cfg.kv_transfer_config) is True
        eng.add(make_request("s1", prompt))
        eng.run()
        eng.worker.unregister_kv_caches()
        eng.worker.unregister_kv_caches()  # idempotent
        name = layer_names()[0]
        key = eng.connector.store.keys_for(prompt, ())[:1]
        store = eng.connector.store
        eng.worker.worker_side._loads = [sfvllm.BlockTransfer("x", key, [0])]
        eng.worker.worker_side._step_loads = StepLoads(store, [HeldLoad("x", key, [0], store.hold_async(key))])
        with pytest.raises(sfvllm.errors.InvalidRequestError, match="no registered KV cache"):
            eng.worker.wait_for_layer_load(name)
        eng.worker.worker_side._release_held()
        eng.worker.worker_side._loads = []
        eng.worker.restore_kv_caches()
        eng.worker.restore_kv_caches()  # idempotent
        eng.add(make_request("s2", [*prompt, 9]))
        so = eng.step()
        assert next(r for r in so.scheduled_new_reqs if r.req_id == "s2").num_computed_tokens == 64
        assert eng.step_log[-1]["load_errors"] == set()
        assert_blocks_hold(eng, eng.blocks_of("s2")[:4], prompt[:64])
        eng.run()


def test_block_missing_at_load_time_is_reported_with_stand_in_attention_kernel(model_dir: Path) -> None:
    prompt = [(i * 7 + 1) % 1000 for i in range(70)]  # 4 full blocks
    extra = {"pinned_bytes": 4 << 20, "model_id": "tiny-miss"}
    with engine(model_dir, extra, prefix_caching=False) as eng:
        so = saved_then_scheduled(eng, "m", prompt)  # plans a load of 4 blocks
        store = eng.connector.store
        keys = store.keys_for(prompt, ())
        assert eng.scheduler.connector_prefix_cache_stats.hits_by_source == {CacheHitSource.HOST: 64}  # pinned
        # The scheduler of this process holds the blocks it plans to load (its read ahead): a block evicted now
        # is still loaded. A worker in a process of its own holds them only at start_load_kv: what is gone by
        # then is a load error, which the connector reports for vLLM to recompute.
        conn = eng.connector
        conn._ahead.drop("m2")  # as a worker in another process: nothing held ahead
        store.evict(keys[2:3])  # gone between the lookup and the load
        assert loads_by_hand(eng, so) == {so.scheduled_new_reqs[0].block_ids[0][2]}
        assert eng.worker.get_block_ids_with_load_errors() == set()
        assert store.pinned.leased == 0


@pytest.mark.parametrize("stage_copies", [None, True])
def test_a_cold_chunk_hit_loads_layer_0_while_later_layers_are_read_with_stand_in_attention_kernel(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage_copies: bool | None) -> None:
    """A cold shared-tier hit from chunk files: ``wait_for_layer_load`` of the first layer returns with that layer
    in vLLM's pages while the read of the later layers is held at a gate (so: still going on); the later layers
    follow once it opens. Both ways a CPU cache loads (one copy into its pages; through a staging buffer)."""
    from tests.kvcache.layer_gate import LayerGate

    extra = {"pinned_bytes": 4 << 20, "shared_dir": str(tmp_path / "shared"), "model_id": "tiny-layerwise",
             "chunk_tokens": 32, "io_timeout_ms": 0}
    prompt = [(i * 11 + 3) % 1000 for i in range(70)]  # 4 full blocks: two chunk files
    with engine(model_dir, extra, prefix_caching=False, stage_copies=stage_copies) as eng:
        eng.add(make_request("c1", prompt))
        eng.run()
        store = eng.connector.store
        store.wait_for_puts()
        store.evict(store.keys_for(prompt, ()), tiers=("pinned",))  # a cold hit: from the files
        gate = LayerGate(monkeypatch)
        eng.add(make_request("c2", prompt))
        so = eng.scheduler.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == 64
        block_ids = so.scheduled_new_reqs[0].block_ids[0][:4]
        worker = eng.worker
        worker.bind_connector_metadata(so.kv_connector_metadata)
        worker.start_load_kv(None)
        names = layer_names()
        worker.wait_for_layer_load(names[0])
        try:
            assert gate.held_back.wait(30), "no read reached its second layer"
            loads = worker.worker_side._step_loads
            assert loads is not None and not any(p.held.load.done() for p in loads.loading)  # still reading
            key, value = expected_kv(0, prompt[:64])
            for bi, b in enumerate(block_ids):  # layer 0 is in the pages already
                view = sfvllm.block_layer_view(eng.kv_caches[names[0]], b, eng.connector.layout)
                rows = slice(bi * BLOCK, (bi + 1) * BLOCK)
                assert torch.equal(view[0].view(torch.int16), key[rows].view(torch.int16))
                assert torch.equal(view[1].view(torch.int16), value[rows].view(torch.int16))
        finally:
            gate.open()
        for name in names[1:]:
            worker.wait_for_layer_load(name)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == set()
        assert_blocks_hold(eng, block_ids, prompt[:64])
        assert store.stats()["hits_shared"] >= 4 and store.pinned.leased == 0


def test_a_chunk_failing_in_a_later_layer_is_recomputed_and_its_requests_step_saves_nothing_with_stand_in_attention_kernel(  # noqa: E501
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0 of a damaged chunk reaches the pages before its damaged layer is read: the chunk's blocks are
    reported as load errors (vLLM recomputes them), and the blocks the request computes in that step, over the
    missing ones, are not stored; once recomputed, the prompt's blocks are stored and load right."""
    from sfstore.kvcache.shared_chunks import chunk_header_bytes
    from tests.kvcache.layer_gate import LayerGate

    extra = {"pinned_bytes": 4 << 20, "shared_dir": str(tmp_path / "shared"), "model_id": "tiny-late-damage",
             "chunk_tokens": 32, "io_timeout_ms": 0}
    prompt = [(i * 13 + 5) % 1000 for i in range(100)]  # 6 full blocks
    with engine(model_dir, extra, prefix_caching=False) as eng:
        eng.add(make_request("d1", prompt[:70]))  # saves blocks 0-3: two chunk files
        eng.run()
        store = eng.connector.store
        store.wait_for_puts()
        keys = store.keys_for(prompt, ())
        store.evict(keys, tiers=("pinned",))
        geom = eng.connector.layout.geometry
        second = tmp_path / "shared" / keys[3].hex()[:2] / f"{keys[3].hex()}.2.2.kvc"  # blocks 2 and 3
        raw = bytearray(second.read_bytes())
        raw[chunk_header_bytes(geom, 2) + (geom.num_layers - 1) * 2 * geom.layer_bytes + 7] ^= 0xFF  # last layer
        second.write_bytes(bytes(raw))
        # the reads' later layers wait at a gate until layer 0 has been copied into the pages
        gate = LayerGate(monkeypatch)

        def open_once_copied() -> None:
            deadline = time.monotonic() + 20
            while store.counters.snapshot()["layers_copied_early"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            gate.open()

        opener = threading.Thread(target=open_once_copied, daemon=True)
        opener.start()
        eng.add(make_request("d2", prompt))
        try:
            so = eng.step()  # loads blocks 0-3, computes 4-5 over them
        finally:
            gate.open()
            opener.join(30)
        blocks = so.scheduled_new_reqs[0].block_ids[0]
        assert eng.step_log[-1]["load_errors"] == {blocks[2], blocks[3]}
        assert store.stats()["layers_copied_early"] >= 1  # layer 0 went to the pages before the damage was read
        assert not any(store.contains(k) for k in keys[2:6])  # nothing stored over the missing blocks
        eng.run()  # vLLM recomputes blocks 2-3 and the rest, and they are saved
        store.wait_for_puts()
        assert all(store.contains(k) for k in keys[:6])
        assert_blocks_hold(eng, blocks[:6], prompt[:96])


def test_blocks_the_scheduler_holds_ahead_are_loaded_even_if_evicted_meanwhile(model_dir: Path) -> None:
    prompt = [(i * 7 + 1) % 1000 for i in range(70)]  # 4 full blocks
    extra = {"pinned_bytes": 4 << 20, "model_id": "tiny-held-ahead"}
    with engine(model_dir, extra, prefix_caching=False) as eng:
        so = saved_then_scheduled(eng, "h", prompt)  # plans a load of 4 blocks, and holds them
        store = eng.connector.store
        keys = store.keys_for(prompt, ())
        store.evict(keys[:4])  # gone from the pinned tier, not from the scheduler's hold
        assert loads_by_hand(eng, so) == set()
        assert_blocks_hold(eng, so.scheduled_new_reqs[0].block_ids[0][:4], prompt[:64])
        assert store.pinned.leased == 0


def test_bad_kv_layout_is_a_config_error(model_dir: Path) -> None:
    from sfstore import errors

    cfg = make_config(model_dir, {"kv_layout": "diagonal"})
    with pytest.raises(errors.ConfigError, match="kv_layout"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg, 32))


def test_store_settings_in_the_extra_config_reach_the_store(model_dir: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    extra = {"pinned_bytes": "4MiB", "shared_dir": str(shared), "shared_bytes": "64MiB", "cache_namespace": "team-a",
             "io_timeout_ms": 30000, "quarantine_ms": "7", "model_id": "tiny-namespaced", "chunk_tokens": 64}
    prompt = [(i * 29 + 5) % 1000 for i in range(100)]  # 6 full blocks and 4 tokens
    with engine(model_dir, extra) as a:
        store = a.connector.store
        assert store.shared is not None and store.pinned.capacity > 0
        assert (store.cache_namespace, store.shared.budget.budget) == ("team-a", 64 << 20)
        assert (store.shared.guard.timeout_s, store.shared.guard.quarantine_s) == (30.0, 0.007)
        assert store.pinned.capacity == (4 << 20) // (store.pinned.slot_bytes + 4096)
        a.add(make_request("a1", prompt))
        a.run()
        store.wait_for_puts()
        assert store.chunk_tokens == 64  # 6 full blocks of 16: chunks of 4 and 2 blocks
        assert sorted(int(f.name.split(".")[2]) for f in shared.glob("ns/team-a/*/*.kvc")) == [2, 4]
        assert not list(shared.glob("??/*.kv?"))
    found = {}
    for ns in ("team-b", "team-a"):  # another namespace of the same directory sees none of team-a's blocks
        with engine(model_dir, {**extra, "cache_namespace": ns}) as b:
            b.add(make_request("b1", [*prompt, 1, 2, 3]))
            so = b.step()
            found[ns] = so.scheduled_new_reqs[0].num_computed_tokens
            b.run()
    assert found == {"team-b": 0, "team-a": 96}


def test_bad_store_settings_are_config_errors_and_unknown_keys_warn(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from sfstore import errors

    for bad, match in (({"cache_namespace": "../up"}, "cache_namespace"), ({"io_timeout_ms": "soon"}, "io_timeout_ms"),
                       ({"shared_bytes": -1}, "shared_bytes"), ({"quarantine_ms": 0}, "quarantine_ms"),
                       ({"save_decode_tokens": "sometimes"}, "save_decode_tokens"),
                       ({"pinned_preallocate": 1}, "pinned_preallocate"), ({"fsync_shared": "yes please"}, "fsync")):
        cfg = make_config(model_dir, bad)
        with pytest.raises(errors.ConfigError, match=match):
            KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg, 32))
    cfg = make_config(model_dir, {"pinned_bytes": 1 << 20, "kvcache_namespace": "x", "pinned_byte": 5})
    with caplog.at_level("WARNING", logger="sfstore.kvcache.vllm"):
        sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg, 32))
    try:
        assert sched.store.cache_namespace == ""  # an ignored key sets nothing
        text = caplog.text
        assert "'kvcache_namespace'" in text and "'cache_namespace' here" in text and "'pinned_byte'" in text
    finally:
        sched.shutdown()


def test_loads_ahead_are_taken_once_and_only_for_the_same_blocks(tmp_path: Path) -> None:
    """What the scheduler held ahead is taken once, for the same blocks only; whatever is not taken (other
    blocks, replaced, dropped) gives its pinned slots back."""
    from sfstore.kvcache import KVCacheStore, KVGeometry

    geom = KVGeometry(num_layers=2, block_tokens=16, num_kv_heads=1, head_dim=64, dtype="float16")
    with KVCacheStore(geom, model_id="ahead", pinned_bytes=16 * geom.block_bytes) as store:
        keys = store.keys_for(list(range(64)))
        store.put(keys, [bytes(geom.block_bytes)] * 4)
        ahead = sfvllm._LoadsAhead()
        ahead.put("r1", keys[:2], store.hold_async(keys[:2]))
        assert ahead.take("r1", keys[:1]) is None  # other blocks: the worker reads its own
        assert ahead.take("r1", keys[:2]) is None  # taken (refused) once
        held = store.hold_async(keys[2:])
        ahead.put("r2", keys[2:], held)
        assert ahead.blocks == 2
        assert ahead.take("r2", keys[2:]) is held
        held.release()
        ahead.put("r3", keys[:1], store.hold_async(keys[:1]))
        ahead.put("r3", keys[:1], store.hold_async(keys[:1]))  # replaced: the first is released
        ahead.drop("r3")
        assert ahead.take("r3", keys[:1]) is None
        assert store.pinned.leased == 0


class _StandInBlocks:
    """vLLM's KVCacheBlocks as update_state_after_alloc reads it (``get_block_ids``), for a scheduler call made
    by hand."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def get_block_ids(self) -> list[list[int]]:
        return [self._ids]


def test_a_read_ahead_the_worker_never_takes_is_not_counted(model_dir: Path, tmp_path: Path) -> None:
    """The scheduler starts a request's reads as soon as it allocated its blocks; the request can end before the
    worker takes them (an abort). The store's gets / hits count a block when the worker uses it, not when it
    was read ahead."""
    extra = {"pinned_bytes": 4 << 20, "shared_dir": str(tmp_path / "shared"), "model_id": "tiny-ahead-count"}
    prompt = [(i * 43 + 1) % 1000 for i in range(100)]  # 6 full blocks
    with engine(model_dir, extra) as eng:
        conn, store = eng.connector, eng.connector.store
        keys = store.keys_for(prompt[:96], ())
        store.put(keys, [torch.zeros(conn.layout.geometry.block_bytes // 2, dtype=DTYPE) for _ in keys])
        store.wait_for_puts()
        store.evict(keys, tiers=("pinned",))  # read from the shared tier's files
        req = make_request("gone", prompt)
        n, _ = conn.get_num_new_matched_tokens(req, 0)
        assert n == 96
        before = store.counters.snapshot()
        conn.update_state_after_alloc(req, _StandInBlocks(list(range(1, 8))), n)
        started = conn._ahead.take("gone", keys)  # what the worker would have taken
        assert started is not None
        assert started.tiers == ["shared"] * 6  # read ahead, into the pinned tier
        started.release()
        conn.request_finished(req, [])
        now = store.counters.snapshot()
        assert {k: now[k] - before[k] for k in ("gets", "hits_shared", "hits_pinned", "misses")} == {
            "gets": 0, "hits_shared": 0, "hits_pinned": 0, "misses": 0}
        # a request the worker does load is counted once, by the tier the read ahead found each block in
        eng.add(make_request("kept", [*prompt[:96], 5, 6, 7]))
        eng.step()
        now = store.counters.snapshot()
        assert now["gets"] - before["gets"] == 6 and now["hits_pinned"] - before["hits_pinned"] == 6
        eng.run()
