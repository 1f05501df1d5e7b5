"""``SfstoreConnector``'s staged copies as a pipeline: loads issued a layer ahead, saves handed to a worker thread.

The connector is vLLM's own (built by ``KVConnectorFactory`` from a ``VllmConfig``, its paged caches allocated by
vLLM's ``allocate_kv_cache``) over a real :class:`~sfstore.kvcache.KVCacheStore`; the tests drive its worker hooks
in the order vLLM's model runner calls them (``start_load_kv``, per layer ``wait_for_layer_load`` then
``save_kv_layer``, ``wait_for_save``) on a model of many layers. ``stage_copies=True`` on a CPU cache runs the path
a GPU cache takes with synchronous copies (the streams and events are ``None``), so the bookkeeping is checked
here: the next layer's copy is issued (and, on the CPU, already in the pages) before its wait, staging buffers are
reused, saves return before ``put_layer`` ran and ``wait_for_save`` waits for them. Tests marked ``gpu`` run the
same on a CUDA cache, with the real streams and events.

Runs in ``.venv-vllm`` (``tools/vllm-env.sh``); elsewhere every test skips.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import contextlib
import json
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here (tools/vllm-env.sh makes .venv-vllm)")
torch = pytest.importorskip("torch")

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from sfstore.kvcache import vllm as sfvllm  # noqa: E402
from sfstore.kvcache import vllm_staging as staging  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 16
LAYERS = 12
KV_HEADS, HEAD_DIM = 2, 16
DTYPE = torch.bfloat16
NUM_BLOCKS = 32
CONNECTOR = {"kv_connector": "SfstoreConnector", "kv_connector_module_path": "sfstore.kvcache.vllm"}
LAYOUTS = [("LBHNC", "auto"), ("LBNHC", "split"), ("BLNHC", "opaque")]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sfstore-vllm-pipeline-") as d:
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4 * HEAD_DIM,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        }
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        yield Path(d)


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv_cache_config(cfg: VllmConfig) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=DTYPE)
    specs = {name: spec for name in layer_names()}
    groups = get_global_kv_cache_groups(cfg, [specs])
    return get_kv_cache_configs(cfg, [specs], [NUM_BLOCKS * spec.page_size_bytes * LAYERS], groups)[0]


@contextlib.contextmanager
def worker(model_dir: Path, *, layout: str = "LBHNC", kv_layout: str = "auto", device: str = "cpu",
           pinned_bytes: int = 4 << 20, shared_dir: Path | None = None,
           options: dict[str, Any] | None = None) -> Iterator[tuple[Any, dict[str, torch.Tensor]]]:
    """vLLM's worker-side connector with ``stage_copies`` on, and its registered paged caches; ``options``: more
    ``kv_connector_extra_config`` keys."""
    extra: dict[str, Any] = {"pinned_bytes": pinned_bytes, "kv_layout": kv_layout,
                             "model_id": f"pipeline-{uuid.uuid4().hex}", **(options or {})}
    if shared_dir is not None:
        extra["shared_dir"] = str(shared_dir)
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(kv_role="kv_both", kv_connector_extra_config=extra, **CONNECTOR),
    )
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    cfg.cache_config.kv_cache_layout = layout
    kcc = kv_cache_config(cfg)
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        conn.stage_copies = True  # on a CPU cache: the path a GPU cache takes, with synchronous copies
        caches = allocate_kv_cache(kcc, torch.device(device), KVCacheLayout[layout])
        conn.register_kv_caches(caches)
        yield conn, caches
    finally:
        conn.shutdown()


def random_blocks(conn: Any, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = conn.layout.geometry.block_shape
    return [(torch.randn(shape, generator=g) * 4).to(DTYPE) for _ in range(count)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().view(torch.int16)


def page_holds(conn: Any, cache: torch.Tensor, block_id: int, layer_data: torch.Tensor) -> bool:
    """Block ``block_id`` of one layer's cache holds ``layer_data`` (the store's ``(kv, token, head, dim)``)."""
    return torch.equal(bits(sfvllm.block_layer_view(cache, block_id, conn.layout)), bits(layer_data))


def step_meta(loads: list[sfvllm.BlockTransfer] = (), saves: list[sfvllm.BlockTransfer] = ()) -> Any:
    return sfvllm.SfstoreConnectorMetadata(loads=list(loads), saves=list(saves))


def save_transfer(req_id: str, keys: list[bytes], block_ids: list[int]) -> sfvllm.BlockTransfer:
    return sfvllm.BlockTransfer(req_id, keys, block_ids, token_ids=[[i] * BLOCK for i in range(len(keys))],
                                parents=[None, *keys[:-1]])


def fill_pages(conn: Any, caches: dict[str, torch.Tensor], block_ids: list[int], blocks: list[torch.Tensor]) -> None:
    """Write the blocks' layers into the paged caches, as the attention kernel would have."""
    for li, name in enumerate(layer_names()):
        for b, block in zip(block_ids, blocks, strict=True):
            sfvllm.block_layer_view(caches[name], b, conn.layout).copy_(block[li].to(caches[name].device))


class GatedPutLayer:
    """``store.put_layer`` that waits for ``gate`` first: holds the connector's save worker (the real put runs
    once the gate opens)."""

    def __init__(self, store: Any) -> None:
        self.real = store.put_layer
        self.gate = threading.Event()
        self.entered = 0
        self.ran: list[int] = []

    def __call__(self, keys: Any, layer: int, tensors: Any) -> None:
        self.entered += 1
        assert self.gate.wait(30), "the test never opened the gate"
        self.real(keys, layer, tensors)
        self.ran.append(layer)


def watch_pool_handouts(conn: Any, kind: str, device: torch.device) -> list[str]:
    """Record every buffer the pool hands out whose last copy had not completed (the list must stay empty)."""
    pool = conn.worker_side._pool(kind, device)
    last_event: dict[int, Any] = {}
    bad: list[str] = []
    acquire, release = pool.acquire, pool.release

    def checked_acquire(nbytes: int) -> torch.Tensor:
        buf = acquire(nbytes)
        event = last_event.get(buf.data_ptr())
        if event is not None and not event.query():
            bad.append(f"buffer {buf.data_ptr():#x} handed out before its copy completed")
        return buf

    def recorded_release(buf: torch.Tensor, event: Any = None) -> None:
        last_event[buf.data_ptr()] = event
        release(buf, event)

    pool.acquire, pool.release = checked_acquire, recorded_release
    return bad


# -- loads ----------------------------------------------------------------------------------------------------------
def run_load_step(conn: Any, caches: dict[str, torch.Tensor], keys: list[bytes], block_ids: list[int],
                  blocks: list[torch.Tensor], *, before_wait: Any = None) -> None:
    conn.bind_connector_metadata(step_meta(loads=[sfvllm.BlockTransfer("r1", keys[:2], block_ids[:2]),
                                                  sfvllm.BlockTransfer("r2", keys[2:], block_ids[2:])]))
    conn.start_load_kv(None)
    for li, name in enumerate(layer_names()):
        if before_wait is not None:
            before_wait(li, name)
        conn.wait_for_layer_load(name)
    conn.wait_for_save()
    conn.clear_connector_metadata()


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
def test_staged_loads_are_bit_exact_and_issued_a_layer_ahead(model_dir: Path, layout: str, kv_layout: str) -> None:
    with worker(model_dir, layout=layout, kv_layout=kv_layout) as (conn, caches):
        store = conn.store
        keys = store.keys_for(list(range(5 * BLOCK)), ())
        blocks = random_blocks(conn, 5, seed=1)
        store.put(keys, blocks)
        block_ids = [7, 3, 20, 11, 15]  # scattered, not in order: the scatter places each page
        bad = watch_pool_handouts(conn, "load", torch.device("cpu"))
        landed_early: list[int] = []

        def before_wait(li: int, name: str) -> None:
            if li == 0:
                assert conn.load_log == []  # nothing issued before the first wait: the prefetch runs meanwhile
                return
            assert ("issue", li) in conn.load_log and ("wait", li) not in conn.load_log
            # CPU copies are synchronous: the pages already hold the layer before its wait
            if all(page_holds(conn, caches[name], b, blk[li]) for b, blk in zip(block_ids, blocks, strict=True)):
                landed_early.append(li)

        run_load_step(conn, caches, keys, block_ids, blocks, before_wait=before_wait)
        expected = [("issue", 0), ("issue", 1), ("wait", 0)]
        for li in range(1, LAYERS):
            expected += ([("issue", li + 1)] if li + 1 < LAYERS else []) + [("wait", li)]
        assert conn.load_log == expected
        assert landed_early == list(range(1, LAYERS))
        for li, name in enumerate(layer_names()):
            for b, blk in zip(block_ids, blocks, strict=True):
                assert page_holds(conn, caches[name], b, blk[li]), (name, b)
        assert conn.get_block_ids_with_load_errors() == set()
        assert conn.worker_side._pools["load"].allocated == 1  # one staging buffer, reused by every layer
        assert bad == []


def test_a_block_evicted_midway_still_lands_in_every_layer(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step holds its loaded blocks in the pinned tier: a block evicted after some layers were issued still
    lands in every layer (nothing is reported for vLLM to recompute), and its slot goes back to the tier only once
    the step is done with it."""
    with worker(model_dir) as (conn, caches):
        store = conn.store
        keys = store.keys_for(list(range(100, 100 + 4 * BLOCK)), ())
        blocks = random_blocks(conn, 4, seed=2)
        store.put(keys, blocks)
        block_ids = [2, 9, 5, 30]
        free_during: list[int] = []
        # the idle slots counted below are the step's alone: no top-up for the next step in the background
        monkeypatch.setattr(store, "prepare_pinned", lambda idle: False)

        def before_wait(li: int, name: str) -> None:
            if li == 5:
                store.evict(keys[1:2])  # layers 0..5 are issued; 6.. still find block 1, held by the step
                free_during.append(store.pinned.idle)

        free_before = store.pinned.idle
        run_load_step(conn, caches, keys, block_ids, blocks, before_wait=before_wait)
        assert conn.get_block_ids_with_load_errors() == set()
        for li, name in enumerate(layer_names()):
            for b, blk in zip(block_ids, blocks, strict=True):
                assert page_holds(conn, caches[name], b, blk[li]), (name, b)
        assert keys[1] not in store.pinned
        assert free_during == [free_before]  # still held while the step ran
        assert store.pinned.idle == free_before + 1  # back to the tier at the step's end


@pytest.mark.parametrize("staged", [True, False, None])
@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
def test_a_block_gone_before_the_reads_is_a_load_error_and_the_others_land(model_dir: Path, tmp_path: Path,
                                                                            staged: bool | None, layout: str,
                                                                            kv_layout: str) -> None:
    """A block missing when the step prefetches its blocks is reported; the others, read from the shared tier's
    files by several prefetches at once, each land in their own page, staged or straight into a CPU cache; each
    read is counted once, by the tier it came from."""
    # a chunk of one block: evicting block 2 from the shared tier evicts it alone (a chunk goes as a whole)
    with worker(model_dir, layout=layout, kv_layout=kv_layout, shared_dir=tmp_path / "shared",
                options={"chunk_tokens": BLOCK}) as (conn, caches):
        conn.stage_copies = staged
        conn.worker_side.prefetch_chunks, conn.worker_side.blocks_per_prefetch = 3, 1  # three prefetches at once
        store = conn.store
        keys = store.keys_for(list(range(300, 300 + 6 * BLOCK)), ())
        blocks = random_blocks(conn, 6, seed=5)
        store.put(keys, blocks)
        store.wait_for_puts()
        store.evict(keys[2:3])  # from every tier: a miss
        store.evict(keys[3:], tiers=("pinned",))  # read from the shared tier's files
        before = store.counters.snapshot()
        block_ids = [4, 17, 8, 26, 1, 13]
        run_load_step(conn, caches, keys, block_ids, blocks)
        assert conn.get_block_ids_with_load_errors() == {8}
        for li, name in enumerate(layer_names()):
            for j, (b, blk) in enumerate(zip(block_ids, blocks, strict=True)):
                if j != 2:  # block 2 is not loaded: vLLM recomputes it
                    assert page_holds(conn, caches[name], b, blk[li]), (name, b)
        now = store.counters.snapshot()
        got = {k: now.get(k, 0) - before.get(k, 0) for k in ("gets", "hits_pinned", "hits_shared", "misses")}
        assert got == {"gets": 6, "hits_pinned": 2, "hits_shared": 3, "misses": 1}


def test_staged_loads_larger_than_half_the_pinned_tier_load_every_layer_at_start(model_dir: Path) -> None:
    block_bytes = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    with worker(model_dir, pinned_bytes=12 * block_bytes) as (conn, caches):
        store = conn.store
        count = store.pinned.capacity // 2 + 2
        assert count <= store.pinned.capacity and count < NUM_BLOCKS
        keys = store.keys_for(list(range(count * BLOCK)), ())
        blocks = random_blocks(conn, count, seed=3)
        store.put(keys, blocks)
        block_ids = list(range(1, count + 1))
        conn.bind_connector_metadata(step_meta(loads=[sfvllm.BlockTransfer("r1", keys, block_ids)]))
        conn.start_load_kv(None)
        for li, name in enumerate(layer_names()):
            for b, blk in zip(block_ids, blocks, strict=True):  # in the pages before the first wait
                assert page_holds(conn, caches[name], b, blk[li]), (name, b)
            conn.wait_for_layer_load(name)  # nothing left to copy
        assert conn.load_log == []
        conn.wait_for_save()
        conn.clear_connector_metadata()
        assert conn.get_block_ids_with_load_errors() == set()


# -- saves ----------------------------------------------------------------------------------------------------------
def stored_block(store: Any, key: bytes) -> torch.Tensor:
    out = torch.empty(store.geometry.block_shape, dtype=DTYPE)
    assert store.get_into([key], [out]) != [None]
    return out


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
def test_staged_saves_return_before_put_layer_and_wait_for_save_waits(model_dir: Path, layout: str,
                                                                      kv_layout: str) -> None:
    with worker(model_dir, layout=layout, kv_layout=kv_layout) as (conn, caches):
        conn.staging_buffers = 2 * LAYERS  # every layer's buffer is out while the worker is held
        store = conn.store
        keys = store.keys_for(list(range(200, 200 + 3 * BLOCK)), ())
        block_ids = [4, 17, 8]
        blocks = random_blocks(conn, 3, seed=4)
        fill_pages(conn, caches, block_ids, blocks)
        gated = GatedPutLayer(store)
        store.put_layer = gated
        conn.bind_connector_metadata(step_meta(saves=[save_transfer("r1", keys, block_ids)]))
        conn.start_load_kv(None)
        for name in layer_names():
            conn.save_kv_layer(name, caches[name], None)
        # every layer was handed over and none is in the store: the step went on while the worker was held
        assert gated.ran == [] and gated.entered <= 1
        assert conn.worker_side._saver.handed == LAYERS and conn.worker_side._saver.done == 0
        assert not any(store.contains(k) for k in keys)
        for name in layer_names():  # the engine may go on writing other pages: the copies were taken already
            caches[name].zero_()
        ended = threading.Event()
        waiter = threading.Thread(target=lambda: (conn.wait_for_save(), ended.set()))
        waiter.start()
        assert not ended.wait(0.3)  # wait_for_save waits for the held saves
        gated.gate.set()
        waiter.join(30)
        assert ended.is_set()
        assert gated.ran == list(range(LAYERS))  # in the order handed over
        for key, blk in zip(keys, blocks, strict=True):
            assert torch.equal(bits(stored_block(store, key)), bits(blk))
        events = conn.get_kv_connector_kv_cache_events()
        stored = [e for e in events.get_all_events() if type(e).__name__ == "BlockStored"]
        assert {e.block_hashes[0] for e in stored} == set(keys)  # wait_for_save saw them committed
        conn.clear_connector_metadata()
        assert store.discard_partial() == 0


def test_staged_save_pool_bounds_the_buffers_in_flight(model_dir: Path) -> None:
    """With the worker held, the third layer's save waits for a buffer (two at most) instead of pinning more."""
    with worker(model_dir) as (conn, caches):
        conn.staging_buffers = 2
        store = conn.store
        keys = store.keys_for(list(range(300, 300 + 2 * BLOCK)), ())
        block_ids = [1, 6]
        blocks = random_blocks(conn, 2, seed=5)
        fill_pages(conn, caches, block_ids, blocks)
        gated = GatedPutLayer(store)
        store.put_layer = gated
        conn.bind_connector_metadata(step_meta(saves=[save_transfer("r1", keys, block_ids)]))
        progress: list[int] = []

        def engine_thread() -> None:
            for li, name in enumerate(layer_names()):
                conn.save_kv_layer(name, caches[name], None)
                progress.append(li)
            conn.wait_for_save()

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join(0.3)
        assert t.is_alive() and progress == [0, 1]  # layer 2 waits for a buffer to come back
        gated.gate.set()
        t.join(30)
        assert not t.is_alive() and progress == list(range(LAYERS))
        assert conn.worker_side._pools["save"].allocated == 2
        for key, blk in zip(keys, blocks, strict=True):
            assert torch.equal(bits(stored_block(store, key)), bits(blk))
        conn.clear_connector_metadata()


@pytest.mark.parametrize("staged", [True, False, None])
def test_saves_of_a_step_ended_early_are_discarded(model_dir: Path, staged: bool | None) -> None:
    """Staged (put_layer per layer, partial blocks dropped) or gathered into the step's save buffer (a CPU cache:
    nothing put unless every layer arrived)."""
    with worker(model_dir) as (conn, caches):
        conn.stage_copies = staged
        store = conn.store
        keys = store.keys_for(list(range(400, 400 + 2 * BLOCK)), ())
        block_ids = [3, 12]
        fill_pages(conn, caches, block_ids, random_blocks(conn, 2, seed=6))
        conn.bind_connector_metadata(step_meta(saves=[save_transfer("r1", keys, block_ids)]))
        for name in layer_names()[: LAYERS // 2]:
            conn.save_kv_layer(name, caches[name], None)
        conn.wait_for_save()  # waits for the worker, then drops the partial blocks
        conn.clear_connector_metadata()
        assert not any(store.contains(k) for k in keys)
        assert store.discard_partial() == 0
        assert conn.get_kv_connector_kv_cache_events() is None


@pytest.mark.parametrize("staged", [True, False, None])
def test_saves_stop_for_a_request_whose_load_failed(model_dir: Path, staged: bool | None) -> None:
    """A block of r1 could not be loaded: r1's blocks computed this step attended to it and are not saved; r2's
    are."""
    with worker(model_dir) as (conn, caches):
        conn.stage_copies = staged
        store = conn.store
        missing = store.keys_for(list(range(500, 500 + BLOCK)), ())  # never stored
        keys1 = store.keys_for(list(range(600, 600 + 2 * BLOCK)), ())
        keys2 = store.keys_for(list(range(700, 700 + 2 * BLOCK)), ())
        fill_pages(conn, caches, [10, 11, 20, 21], random_blocks(conn, 4, seed=7))
        conn.bind_connector_metadata(step_meta(
            loads=[sfvllm.BlockTransfer("r1", missing, [9])],
            saves=[save_transfer("r1", keys1, [10, 11]), save_transfer("r2", keys2, [20, 21])],
        ))
        conn.start_load_kv(None)
        for name in layer_names():
            conn.wait_for_layer_load(name)
            conn.save_kv_layer(name, caches[name], None)
        conn.wait_for_save()
        conn.clear_connector_metadata()
        assert conn.get_block_ids_with_load_errors() == {9}
        assert not any(store.contains(k) for k in keys1)
        assert all(store.contains(k) for k in keys2)


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
def test_cpu_saves_are_bit_exact_with_their_events(model_dir: Path, layout: str, kv_layout: str) -> None:
    """A CPU cache, unstaged: each layer of each block goes straight from its page to the store (put_layer); at
    the end of the step the blocks are stored bit-exact, each with its KV event."""
    with worker(model_dir, layout=layout, kv_layout=kv_layout) as (conn, caches):
        conn.stage_copies = False
        store = conn.store
        keys = store.keys_for(list(range(900, 900 + 3 * BLOCK)), ())
        block_ids = [14, 2, 27]
        blocks = random_blocks(conn, 3, seed=8)
        fill_pages(conn, caches, block_ids, blocks)
        conn.bind_connector_metadata(step_meta(saves=[save_transfer("r1", keys[:1], block_ids[:1]),
                                                      save_transfer("r2", keys[1:], block_ids[1:])]))
        puts = store.counters.snapshot().get("puts", 0)
        for name in layer_names():
            conn.save_kv_layer(name, caches[name], None)
        conn.wait_for_save()
        conn.clear_connector_metadata()
        assert store.counters.snapshot().get("puts", 0) - puts == 3
        for k, blk in zip(keys, blocks, strict=True):
            assert torch.equal(bits(stored_block(store, k)), bits(blk)), k.hex()
        events = conn.get_kv_connector_kv_cache_events()
        assert events is not None and len(events.get_all_events()) == 3


def test_unregister_kv_caches_drains_the_saves_in_flight(model_dir: Path) -> None:
    with worker(model_dir) as (conn, caches):
        store = conn.store
        keys = store.keys_for(list(range(800, 800 + BLOCK)), ())
        fill_pages(conn, caches, [5], random_blocks(conn, 1, seed=8))
        gated = GatedPutLayer(store)
        store.put_layer = gated
        conn.bind_connector_metadata(step_meta(saves=[save_transfer("r1", keys, [5])]))
        for name in layer_names()[:3]:
            conn.save_kv_layer(name, caches[name], None)
        t = threading.Thread(target=conn.unregister_kv_caches)
        t.start()
        t.join(0.3)
        assert t.is_alive()  # the caches are still read by the saves handed over
        gated.gate.set()
        t.join(30)
        assert not t.is_alive() and gated.ran == [0, 1, 2]
        conn.restore_kv_caches()
        conn.wait_for_save()
        conn.clear_connector_metadata()


# -- the staging pool -----------------------------------------------------------------------------------------------
class CopyInFlight:
    """Stands for a ``torch.cuda.Event`` of a copy still running: ``query()`` is False until it completes."""

    def __init__(self) -> None:
        self.completed = False
        self.waited = False

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self.waited = True
        self.completed = True


def test_staging_pool_hands_out_a_buffer_only_once_its_copy_completed() -> None:
    pool = staging.StagingPool(pin=False, limit=2)
    a = pool.acquire(100)
    first = CopyInFlight()
    pool.release(a, first)
    b = pool.acquire(100)
    assert b.data_ptr() != a.data_ptr()  # a's copy is still running: a new buffer
    second = CopyInFlight()
    pool.release(b, second)
    assert {t.data_ptr() for t in pool.in_flight()} == {a.data_ptr(), b.data_ptr()}
    second.completed = True  # done on the device: reused without a wait
    c = pool.acquire(100)
    assert c.data_ptr() == b.data_ptr() and not second.waited
    pool.release(c)
    c = pool.acquire(100)  # the free one, not a (still running)
    assert c.data_ptr() == b.data_ptr() and not first.waited
    d = pool.acquire(100)  # at the limit, nothing free: waits for the oldest copy
    assert d.data_ptr() == a.data_ptr() and first.waited
    assert pool.allocated == 2
    pool.release(c)
    pool.release(d)
    big = pool.acquire(4 << 20)  # both too small, at the limit: one is dropped for one that fits
    assert big.numel() >= 4 << 20 and pool.allocated == 3
    pool.release(big)


# -- on a GPU -------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
def test_gpu_staged_loads_overlap_through_events_and_are_bit_exact(model_dir: Path) -> None:
    with worker(model_dir, layout="LBNHC", kv_layout="split", device="cuda") as (conn, caches):
        store = conn.store
        keys = store.keys_for(list(range(5 * BLOCK)), ())
        blocks = random_blocks(conn, 5, seed=9)
        store.put(keys, blocks)
        block_ids = [7, 3, 20, 11, 15]
        bad = watch_pool_handouts(conn, "load", torch.device("cuda"))
        issued_events: list[Any] = []

        def before_wait(li: int, name: str) -> None:
            if li:
                assert ("issue", li) in conn.load_log
                issued_events.append(conn.worker_side._issued[li])

        run_load_step(conn, caches, keys, block_ids, blocks, before_wait=before_wait)
        assert all(isinstance(e, torch.cuda.Event) for e in issued_events)
        torch.cuda.current_stream().synchronize()
        for li, name in enumerate(layer_names()):
            for b, blk in zip(block_ids, blocks, strict=True):
                assert page_holds(conn, caches[name], b, blk[li]), (name, b)
        assert conn.get_block_ids_with_load_errors() == set()
        assert all(buf.is_pinned() for buf in conn.worker_side._pools["load"]._free)
        assert bad == []


@pytest.mark.gpu
@gpu
def test_gpu_staged_saves_hand_over_and_are_bit_exact(model_dir: Path) -> None:
    with worker(model_dir, layout="LBNHC", kv_layout="split", device="cuda") as (conn, caches):
        conn.staging_buffers = 2 * LAYERS
        store = conn.store
        keys = store.keys_for(list(range(200, 200 + 3 * BLOCK)), ())
        block_ids = [4, 17, 8]
        blocks = random_blocks(conn, 3, seed=10)
        fill_pages(conn, caches, block_ids, blocks)
        gated = GatedPutLayer(store)
        store.put_layer = gated
        conn.bind_connector_metadata(step_meta(saves=[save_transfer("r1", keys, block_ids)]))
        for name in layer_names():
            conn.save_kv_layer(name, caches[name], None)
        assert gated.ran == [] and conn.worker_side._saver.handed == LAYERS
        gated.gate.set()
        conn.wait_for_save()
        conn.clear_connector_metadata()
        assert gated.ran == list(range(LAYERS))
        for key, blk in zip(keys, blocks, strict=True):
            assert torch.equal(bits(stored_block(store, key)), bits(blk))
        assert all(buf.is_pinned() for buf in conn.worker_side._pools["save"]._free)


def test_the_pinned_tier_is_allocated_when_vllm_registers_its_caches(model_dir: Path) -> None:
    """By default the whole pinned tier is allocated at start, so no step pays for allocating registered memory;
    with ``pinned_preallocate`` false (here as text, as a JSON config may give it) only one step's slots are."""
    with worker(model_dir) as (conn, _caches):
        assert conn.pinned_preallocate and conn.store.pinned.full
        assert conn.store.pinned.idle == conn.store.pinned.capacity
    with worker(model_dir, options={"pinned_preallocate": "false"}) as (conn, _caches):
        assert not conn.pinned_preallocate and not conn.store.pinned.full
        assert conn.store.pinned.idle == conn.worker_side._ready_slots < conn.store.pinned.capacity


def test_a_saved_block_that_leaves_the_pinned_tier_is_a_block_removed_event(model_dir: Path) -> None:
    """Routers learn from KV events what each sfstore tier holds: a block saved (``BlockStored``, medium
    ``sfstore/pinned``) and later evicted from the pinned tier (its least recently used blocks leave it once it is
    full) is a ``BlockRemoved`` with that medium, once, and only for blocks it announced."""
    block_bytes = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    with worker(model_dir, pinned_bytes=3 * (block_bytes + 4096)) as (conn, caches):
        conn.stage_copies = False
        store = conn.store
        assert store.pinned.capacity == 3
        keys = store.keys_for(list(range(1200, 1200 + 5 * BLOCK)), ())
        blocks = random_blocks(conn, 5, seed=12)

        def save_step(ks: list[bytes], ids: list[int], bs: list[torch.Tensor]) -> list[Any]:
            fill_pages(conn, caches, ids, bs)
            conn.bind_connector_metadata(step_meta(saves=[save_transfer("r", ks, ids)]))
            for name in layer_names():
                conn.save_kv_layer(name, caches[name], None)
            conn.wait_for_save()
            conn.clear_connector_metadata()
            events = conn.get_kv_connector_kv_cache_events()
            return [] if events is None else events.get_all_events()

        first = save_step(keys[:3], [3, 4, 5], blocks[:3])
        assert {e.block_hashes[0] for e in first if type(e).__name__ == "BlockStored"} == set(keys[:3])
        assert not [e for e in first if type(e).__name__ == "BlockRemoved"]
        store.evict([keys[2]])  # removed by hand: it leaves the pinned tier too
        later = save_step(keys[3:], [6, 7], blocks[3:])  # two more blocks into a full tier: one more leaves
        removed = [e for e in later if type(e).__name__ == "BlockRemoved"]
        assert len(removed) == 1 and removed[0].medium == "sfstore/pinned"
        assert removed[0].block_hashes == [keys[2], keys[0]]  # in the order they left: the oldest first
        assert set(store.pinned.entries) == {keys[1], keys[3], keys[4]}
        store.evict(keys)  # one announced block left (keys[1]) and the two just saved
        events = conn.get_kv_connector_kv_cache_events()
        again = [e for e in events.get_all_events() if type(e).__name__ == "BlockRemoved"]
        assert [sorted(e.block_hashes) for e in again] == [sorted([keys[1], keys[3], keys[4]])]
        assert conn.get_kv_connector_kv_cache_events() is None  # each removal is reported once
