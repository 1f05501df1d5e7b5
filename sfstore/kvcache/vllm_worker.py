"""The worker side of sfstore's vLLM connector (:class:`~sfstore.kvcache.vllm.SfstoreConnector` delegates to it
in each of vLLM's worker processes): it registers the paged KV caches, loads a step's blocks into them layer by
layer (held in the pinned tier, copied out as each layer is read; staged through host buffers and a load stream
for a GPU cache), saves the step's completed blocks layer by layer (a save stream and a save thread for a GPU
cache), and reports KV events, stats and load errors. A step's loads are one :class:`StepLoads`, made at
:meth:`WorkerSide.start_load_kv` and released when the step's copies are done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sfstore._optional import require

# E402 below: the imports come after these checks, so that a missing package is named with the extra to install
require("torch", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)")
require("vllm", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)")

import torch  # noqa: E402

from sfstore import errors  # noqa: E402
from sfstore.kvcache import vllm_staging as staging  # noqa: E402
from sfstore.kvcache.held import HeldBlocks  # noqa: E402
from sfstore.kvcache.store import KVCacheStore  # noqa: E402
from sfstore.kvcache.vllm_layout import KVLayout, block_layer_view, pages_as_layers  # noqa: E402
from sfstore.kvcache.vllm_loads import HeldLoad, StepLoads  # noqa: E402
from sfstore.kvcache.vllm_metrics import (  # noqa: E402
    OWN_STATS,
    STORE_STATS,
    BlockRemoved,
    BlockStored,
    KVEvents,
    SfstoreConnectorStats,
)
from sfstore.kvcache.vllm_scheduler import BlockTransfer, LoadsAhead, SfstoreConnectorMetadata  # noqa: E402

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

__all__ = ["WorkerSide"]

log = logging.getLogger("sfstore.kvcache.vllm")


class WorkerSide:
    """vLLM's worker-side hooks of the connector over ``store`` (see the module).

    Parameters
    ----------
    store : KVCacheStore
    layout : KVLayout
        vLLM's paged cache layout and the store's geometry.
    ahead : LoadsAhead
        Loads the scheduler of this process started for this worker.
    step_blocks : int
        The most blocks one step loads (slots kept ready).
    pinned_preallocate, wait_for_lower_tiers : bool
        The connector's options of those names.
    metadata : callable
        The step's :class:`SfstoreConnectorMetadata` vLLM bound to the connector (``None`` outside a step).

    Attributes
    ----------
    stage_copies, load_ahead, prefetch_chunks, blocks_per_prefetch, staging_buffers, load_log
        As :class:`~sfstore.kvcache.vllm.SfstoreConnector` describes them (it forwards them here).
    """

    load_ahead = 1  # staged loads: how many layers' copies wait_for_layer_load issues past the one it waits for
    # Prefetches of one step's loads run at once (on the store's two background threads: more parts than two only
    # queue), each of at least blocks_per_prefetch blocks.
    prefetch_chunks = 2
    blocks_per_prefetch = 4
    staging_buffers = 8  # staged copies: most staging buffers per direction (bounds the pinned memory they take)

    def __init__(self, store: KVCacheStore, layout: KVLayout, ahead: LoadsAhead, step_blocks: int, *,
                 pinned_preallocate: bool, wait_for_lower_tiers: bool,
                 metadata: Callable[[], SfstoreConnectorMetadata | None]) -> None:
        self.store, self.layout, self._ahead, self._step_blocks = store, layout, ahead, step_blocks
        self.block_tokens = layout.geometry.block_tokens
        self.pinned_preallocate, self.wait_for_lower_tiers = pinned_preallocate, wait_for_lower_tiers
        self._metadata = metadata
        self._counted_worker = False
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layers_viewable: dict[int, bool] = {}  # id of a CPU cache -> pages_as_layers views it
        self._asleep: dict[str, torch.Tensor] = {}  # the caches while vLLM sleeps (unregister_kv_caches)
        self._layer_index = self.layout.layer_index
        self._loads: list[BlockTransfer] = []
        self._step_loads: StepLoads | None = None  # this step's loads, held until the step's copies are done
        self._last_layer = -1  # register_kv_caches
        self._load_errors: set[int] = set()
        self._saved_keys: set[bytes] = set()
        self._dropped_before = 0
        self._first_save_at: tuple[float, int, int] | None = None  # this step's first save: time, layer, tokens
        self._events: list[Any] = []  # KV events since the last get_kv_connector_kv_cache_events
        self._announced: set[bytes] = set()  # blocks a BlockStored said are in the pinned tier, still there
        self._stats = dict.fromkeys(OWN_STATS, 0)
        self._stats_base: dict[str, int] = self.store.counters.snapshot()
        self._load_req: dict[int, str] = {}  # block id -> request, of this step's loads
        self._failed_reqs: set[str] = set()  # requests with a block not loaded this step
        # None: stage through the host when the cache is not on the CPU; True/False force it (tests)
        self.stage_copies: bool | None = None
        # staged copies: per-device streams, the staging pools, the save thread, this step's issued loads
        self._streams: dict[tuple[str, str], Any] = {}
        self._pools: dict[str, staging.StagingPool] = {}
        self._saver: staging.SaveWorker | None = None
        self._issued: dict[int, Any] = {}  # store layer -> event of its load copy (None: done, or on the CPU)
        self._load_ordered: set[str] = set()  # devices whose load stream waits for the step's earlier work
        self._step_start: dict[str, Any] = {}  # device -> event on the compute stream at start_load_kv
        self._dst_index: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # this step's destination ids
        self.load_log: list[tuple[str, int]] = []  # this step: ("issue", layer) and ("wait", layer), in order

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        unknown = [name for name in kv_caches if name not in self._layer_index]
        if unknown:
            log.warning("SfstoreConnector: layers %s are not in the KV cache config; they are not offloaded", unknown)
        self._layers_viewable = {}
        for name, cache in kv_caches.items():
            if name in self._layer_index:
                block_layer_view(cache, 0, self.layout)  # checks the page shape (and, for "cpu", contiguity)
                try:
                    pages_as_layers(cache, self.layout)
                    self._layers_viewable[id(cache)] = True
                except RuntimeError:  # pages not contiguous with each other: loaded block by block
                    self._layers_viewable[id(cache)] = False
        self._kv_caches = dict(kv_caches)
        # the last store layer with a registered cache (the engine runs the layers in this order): its
        # wait_for_layer_load settles a step's loads
        self._last_layer = max((self._layer_index[n] for n in kv_caches if n in self._layer_index), default=-1)
        self.store.track_pinned_removals()  # each block leaving the pinned tier is a BlockRemoved for routers
        if not self._counted_worker:
            self._counted_worker = True
            self._ahead.add_worker(1)
        # Slots allocated now, not on the engine's time: a slot allocated after a step (or during one) costs mmap,
        # page faults and mlock beside vLLM's own work, in that request's time to first token
        if self.pinned_preallocate:
            t0 = time.monotonic()
            made = self.store.allocate_pinned()
            if made:
                log.info("SfstoreConnector: pinned tier allocated: %d slots, %.0f MiB, in %.2f s", made,
                         made * self.store.pinned_bytes_per_block / (1 << 20), time.monotonic() - t0)
        else:  # the first loads' slots (and one step's kept ready after each step: wait_for_save)
            self.store.allocate_pinned(self._ready_slots)

    def unregister_kv_caches(self) -> None:
        """Before sleep: wait for the copies still in flight (a load's host-device copy, a save's device-host copy
        and its ``put_layer``), then forget the caches, so nothing copies into unmapped memory. Idempotent."""
        self._drain()
        if self._kv_caches:
            self._asleep, self._kv_caches = self._kv_caches, {}

    def restore_kv_caches(self) -> None:
        """After wake-up: the caches registered before sleep again. Idempotent."""
        if self._asleep:
            self._kv_caches, self._asleep = self._asleep, {}

    @property
    def _ready_slots(self) -> int:
        """Idle pinned slots kept ready for the next step's loads (one step's worth, at most half the tier)."""
        return min(self._step_blocks, self.store.pinned_capacity // 2)

    def _layer_of(self, layer_name: str) -> int | None:
        return self._layer_index.get(layer_name)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        assert isinstance(meta, SfstoreConnectorMetadata)
        # No reset of the step's saved keys here: vLLM calls this after the forward pass (and so after
        # save_kv_layer) on a step without loads; wait_for_save, which ends every step, resets them.
        self._release_held()
        self._loads = [t for t in meta.loads if t.keys]
        self._load_req = {b: t.req_id for t in self._loads for b in t.block_ids}
        self._failed_reqs = set()
        self._issued, self._load_ordered, self._dst_index = {}, set(), {}
        self.load_log = []
        if not self._loads:
            return
        # The loads go after what the engine enqueued so far (a previous step's kernels, vLLM zeroing the
        # new blocks), not after the forward pass's work enqueued before the first wait_for_layer_load.
        devices = {str(c.device): c.device for c in self._kv_caches.values() if self._load_staged(c)}
        self._step_start = {key: staging.record(staging.current_stream(dev)) for key, dev in devices.items()}
        self._dropped_before = self._dropped()
        if sum(len(t.keys) for t in self._loads) > self.store.pinned_capacity // 2:
            for t in self._loads:
                self._ahead.drop(t.req_id)
            self._load_all_layers_now()
            return
        # Each request's reads started (by the scheduler of this process where it could, else now); the layers
        # are copied out as they arrive, from the first wait_for_layer_load on.
        parts: list[HeldLoad] = []
        for t in self._loads:
            held = self._ahead.take(t.req_id, t.keys)
            if held is not None:
                self._stats["blocks_prefetched_by_scheduler"] += len(t.keys)
            else:
                held = self.hold(t.keys)
            parts.append(HeldLoad(t.req_id, t.keys, list(t.block_ids), held))
        self._step_loads = StepLoads(self.store, parts)

    def _dropped(self) -> int:
        c = self.store.counters.snapshot()
        return int(c.get("corrupt_dropped", 0)) + int(c.get("unreadable", 0))

    def hold(self, keys: list[bytes]) -> HeldBlocks | None:
        """``store.hold_async`` of ``keys`` in up to ``prefetch_chunks`` parts (at least ``blocks_per_prefetch``
        blocks each), read at once by the store's background threads; uncounted (:meth:`_settle_loads` counts
        them). ``None``: the hold failed (logged; every block of it becomes a load error)."""
        parts = min(max(1, self.prefetch_chunks), -(-len(keys) // max(1, self.blocks_per_prefetch)))
        try:
            return self.store.hold_async(keys, parts=parts)
        except Exception:  # recomputed instead (get_block_ids_with_load_errors)
            log.exception("SfstoreConnector: holding %d blocks to load failed", len(keys))
            return None

    def _load_all_layers_now(self) -> None:
        """The step's loads do not fit in the pinned tier beside each other: loading them layer by layer would
        fetch every block again for every layer. Load them chunk by chunk instead, every layer of a chunk while it
        is held, before the forward pass (the loads are synchronous for the scheduler either way)."""
        flat = [(t.req_id, k, b) for t in self._loads for k, b in zip(t.keys, t.block_ids, strict=True)]
        chunk = max(1, self.store.pinned_capacity // 2)
        devices: dict[str, torch.device] = {}
        for i in range(0, len(flat), chunk):
            part = flat[i:i + chunk]
            loads = self._step_loads = StepLoads(self.store, [
                HeldLoad(part[0][0], [k for _r, k, _b in part], [b for _r, _k, b in part],
                         self.hold([k for _r, k, _b in part]))])
            try:
                for name in self.layout.layer_names:
                    cache = self._kv_caches.get(name)
                    layer = self._layer_of(name)
                    if cache is None or layer is None:
                        continue
                    try:
                        if self._load_staged(cache):
                            self._issue_load(cache, layer, loads)
                            devices[str(cache.device)] = cache.device
                        else:
                            self._load_layer(cache, layer, loads)
                    except Exception:  # recomputed instead (get_block_ids_with_load_errors)
                        log.exception("SfstoreConnector: loading layer %s of %d blocks failed", name, len(part))
                        self._fail_all(loads)
                self._settle_loads()
            finally:
                self._release_held()  # every layer of the chunk copied out of its slots
        for device in devices.values():  # the forward pass runs after every copy (on the device, no CPU wait)
            staging.wait_stream(staging.current_stream(device), self._stream("load", device))
        self._loads = []  # done: wait_for_layer_load has nothing left to copy

    def _load_failed(self, block_id: int) -> None:
        """Report a block not loaded; its request's saves stop for this step: the blocks it computes now attend
        to the missing one and are recomputed (and saved) in a later step, once vLLM recomputes it."""
        self._load_errors.add(block_id)
        req = self._load_req.get(block_id)
        if req is not None:
            self._failed_reqs.add(req)

    def _fail_all(self, loads: StepLoads) -> None:
        for b in loads.block_ids:
            self._load_failed(b)

    def _settle_loads(self) -> set[str]:
        """Wait for the step's reads still going on, count them, report the blocks that missed (vLLM recomputes
        them; their requests save nothing more this step). Idempotent; the requests that failed now."""
        loads = self._step_loads
        if loads is None:
            return set()
        failed_keys: list[bytes] = []
        failed_reqs: set[str] = set()
        total = 0
        for part, missed in loads.settle():
            total += len(part.keys)
            for i in missed:
                self._load_failed(part.block_ids[i])
                failed_keys.append(part.keys[i])
                failed_reqs.add(self._load_req.get(part.block_ids[i], part.req_id))
        self._record_failed_loads(failed_keys)
        if failed_keys:
            bad = self._dropped() - self._dropped_before
            # A block that failed verification was removed from its tier: the lookups that follow miss it and
            # the recomputed block is saved again, so it fails at most the loads already planned.
            log.warning(
                "SfstoreConnector: %d of %d blocks to load are recomputed: %d failed verification or could not be "
                "read in a lower tier (removed there, saved again once recomputed), %d were gone since the lookup",
                len(failed_keys), total, min(bad, len(failed_keys)), max(0, len(failed_keys) - bad),
            )
        return failed_reqs

    def _release_held(self) -> None:
        loads, self._step_loads = self._step_loads, None
        if loads is not None:
            loads.release()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: its loaded blocks are in the paged cache for the work the
        engine enqueues next. The call waits for this layer of the step's blocks only (read from chunk files,
        the later layers are still being read). A staged (GPU) cache's copy of this layer was issued one call
        earlier where it had been read by then (or now); this call issues the next layers' copies of those read
        already and makes the current stream wait for this layer's on the device: the CPU does not wait for any
        copy. At the step's last layer the loads are settled: the blocks that missed are known before that layer
        is saved."""
        loads = self._step_loads
        if not self._loads or loads is None:
            return
        layer = self._layer_of(layer_name)
        if layer is None:
            return
        cache = self._kv_caches.get(layer_name)
        if cache is None:
            raise errors.InvalidRequestError(f"layer {layer_name} has no registered KV cache (register_kv_caches)")
        if not self._load_staged(cache):
            try:
                self._load_layer(cache, layer, loads)
            except Exception:  # recomputed instead (get_block_ids_with_load_errors)
                log.exception("SfstoreConnector: loading layer %s of %d blocks failed", layer_name, len(loads))
                self._fail_all(loads)
        else:
            event = self._ensure_issued(layer, cache, loads)
            for ahead in self._layers_after(layer):
                if not loads.layer_in(ahead):  # still being read: issued by its own call, not waited for here
                    break
                self._ensure_issued(ahead, self._kv_caches[self.layout.layer_names[ahead]], loads)
            self.load_log.append(("wait", layer))
            staging.wait_event(staging.current_stream(cache.device), event)
        if layer == self._last_layer:
            self._settle_loads()

    def _layers_after(self, layer: int) -> list[int]:
        """The next ``load_ahead`` store layers with a registered cache (the engine runs them in this order)."""
        out: list[int] = []
        for j in range(layer + 1, len(self.layout.layer_names)):
            if len(out) >= self.load_ahead:
                break
            cache = self._kv_caches.get(self.layout.layer_names[j])
            if cache is not None and self._load_staged(cache):
                out.append(j)
        return out

    def _ensure_issued(self, layer: int, cache: torch.Tensor, loads: StepLoads) -> Any:
        """The event of layer ``layer``'s load copy, issuing it first if this step has not (once per layer)."""
        if layer in self._issued:
            return self._issued[layer]
        try:
            event = self._issue_load(cache, layer, loads)
        except Exception:  # recomputed instead (get_block_ids_with_load_errors)
            log.exception("SfstoreConnector: loading layer %s of %d blocks failed",
                          self.layout.layer_names[layer], len(loads))
            self._fail_all(loads)
            event = None
        self._issued[layer] = event
        self.load_log.append(("issue", layer))
        return event

    def _load_layer(self, cache: torch.Tensor, layer: int, loads: StepLoads) -> None:
        """A CPU cache, unstaged: the store copies each block's layer straight into its page, once the blocks'
        reads have ended (the copies go block by block from the pinned tier, which holds whole blocks)."""
        loads.wait()
        for part in loads.loading:
            tiers = part.held.tiers if part.held is not None else []
            hit = [i for i, t in enumerate(tiers) if t is not None]
            if not hit:
                continue
            got = self.store.get_layer_into([part.keys[i] for i in hit], layer,
                                            [block_layer_view(cache, part.block_ids[i], self.layout) for i in hit])
            for i, t in zip(hit, got, strict=True):
                if t is None:  # (held: not expected)
                    self._load_failed(part.block_ids[i])

    def _pool(self, kind: str, device: torch.device) -> staging.StagingPool:
        pool = self._pools.get(kind)
        if pool is None:
            pool = self._pools[kind] = staging.StagingPool(device.type == "cuda", self.staging_buffers)
        return pool

    def _stream(self, kind: str, device: torch.device) -> Any:
        """The connector's ``"load"`` or ``"save"`` stream on ``device`` (``None`` on the CPU)."""
        key = (kind, str(device))
        if key not in self._streams:
            self._streams[key] = staging.new_stream(device)
        return self._streams[key]

    def _pages(self, buf: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` pages of ``dtype`` (``[count, H, N, C]``, contiguous) at the start of a staging buffer."""
        shape = (count, *self.layout.page_shape)
        nbytes = count * self._page_bytes(dtype)
        return buf[:nbytes].view(dtype).view(shape)

    def _layers(self, buf: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` blocks' layers of ``dtype`` (``[count, kv, tokens, heads, dim]``, contiguous) at the start of a
        staging buffer."""
        nbytes = count * self._page_bytes(dtype)
        return buf[:nbytes].view(dtype).view((count, *self.layout.geometry.layer_shape))

    def _page_bytes(self, dtype: torch.dtype) -> int:
        h, n, c = self.layout.page_shape
        return h * n * c * dtype.itemsize

    def _index(self, ids: list[int], device: torch.device, stream: Any) -> torch.Tensor:
        """``ids`` as a long tensor on ``device``, made once per step and stream (each layer reuses it)."""
        key = (f"{device}:{id(stream)}", tuple(ids))
        idx = self._dst_index.get(key)
        if idx is None:
            idx = torch.tensor(ids, dtype=torch.long)
            if device.type != "cpu":
                idx = idx.pin_memory().to(device, non_blocking=True)  # on ``stream``: the caller's context
            self._dst_index[key] = idx
        return idx

    def _issue_load(self, cache: torch.Tensor, layer: int, loads: StepLoads) -> Any:
        """Issue one layer's load of every block the step holds (each copy waits for that layer of its request's
        blocks to be read). A CPU cache (``stage_copies`` auto) takes it with one native copy per request
        straight into its strided pages. Otherwise: copies into a staging buffer (on this thread), then one
        host-to-device copy and one scatter into the pages, enqueued on the load stream. Returns the event after
        the scatter (``None`` on the CPU, where every copy is done on return)."""
        n = len(loads)
        if not n:
            return None
        if cache.device.type == "cpu" and self.stage_copies is None:  # one native copy into the pages, no staging
            loads.copy_layer_into_pages(layer, pages_as_layers(cache, self.layout))
            return None
        page_bytes = self._page_bytes(cache.dtype)
        pool = self._pool("load", cache.device)
        buf = pool.acquire(n * page_bytes)
        stream = self._stream("load", cache.device)
        event = None
        try:
            # the store's layout, rows in the step's order: contiguous on both sides
            loads.copy_layer_into(layer, buf[:n * page_bytes], page_bytes)
            src = self._layers(buf, n, cache.dtype)
            device = str(cache.device)
            if device not in self._load_ordered:  # once per step: after the work before start_load_kv
                start = self._step_start.get(device)
                if start is not None:
                    staging.wait_event(stream, start)
                else:
                    staging.wait_stream(stream, staging.current_stream(cache.device))
                self._load_ordered.add(device)
            with staging.on(stream):
                dst = self._index(loads.block_ids, cache.device, stream)
                # one copy into the pages through their view as the store's layers (the device permutes)
                pages_as_layers(cache, self.layout).index_copy_(0, dst, src.to(cache.device, non_blocking=True))
            event = staging.record(stream)
        except BaseException:
            if stream is not None:
                stream.synchronize()  # a copy enqueued before the error may still read the buffer
            raise
        finally:
            pool.release(buf, event)  # reused once the host-to-device copy that reads it completed
        return event

    def _staged(self, cache: torch.Tensor) -> bool:
        """Whether a layer's saves go through one host staging tensor (a GPU cache: one device-host copy per layer
        and step instead of one per block) or straight from the pages (a CPU cache)."""
        return cache.device.type != "cpu" if self.stage_copies is None else self.stage_copies

    def _load_staged(self, cache: torch.Tensor) -> bool:
        """Whether a layer's loads are one batched copy per layer and step (:meth:`_issue_load`: for a GPU cache
        through a host staging tensor and its one host-device copy, for a CPU cache straight into its pages) or
        block by block straight into the pages (``stage_copies`` off, or a CPU cache whose pages
        :func:`pages_as_layers` cannot view as one)."""
        if self.stage_copies is not None:
            return self.stage_copies
        return cache.device.type != "cpu" or self._layers_viewable.get(id(cache), False)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """After layer ``layer_name``'s attention: save its slice of the step's completed blocks. A staged (GPU)
        cache's pages are gathered and copied to a pinned buffer on the save stream, after the work enqueued so
        far; the save worker calls ``store.put_layer`` once that copy completed, and this call returns at once."""
        layer = self._layer_of(layer_name)
        meta = self._metadata()
        if layer is None or meta is None:
            return
        saves = [t for t in meta.saves if t.keys and t.req_id not in self._failed_reqs]
        if not saves:
            return
        if self._first_save_at is None:
            self._first_save_at = (time.perf_counter(), layer, meta.computed_tokens)
        try:
            self._save_layer(kv_layer, layer, saves)
        except Exception:  # a cache: a failed save is a later miss, not a failed step
            log.exception("SfstoreConnector: saving layer %s failed", layer_name)

    def _save_layer(self, kv_layer: torch.Tensor, layer: int, saves: list[BlockTransfer]) -> None:
        if not self._staged(kv_layer):
            viewable = self._layers_viewable.get(id(kv_layer), False)
            for save in saves:
                if viewable:  # one gather of the layer's pages, in the store's layout (contiguous)
                    idx = torch.tensor(save.block_ids, dtype=torch.long)
                    blocks = list(pages_as_layers(kv_layer, self.layout).index_select(0, idx).unbind(0))
                else:
                    blocks = [block_layer_view(kv_layer, b, self.layout) for b in save.block_ids]
                self.store.put_layer(save.keys, layer, blocks)
                self._saved_keys.update(save.keys)
            return
        block_ids = [b for t in saves for b in t.block_ids]
        keys = [k for t in saves for k in t.keys]
        device = kv_layer.device
        pool = self._pool("save", device)
        buf = pool.acquire(len(block_ids) * self._page_bytes(kv_layer.dtype))
        stream = self._stream("save", device)
        try:
            pages = self._pages(buf, len(block_ids), kv_layer.dtype)
            staging.wait_stream(stream, staging.current_stream(device))  # after this layer's attention wrote the pages
            with staging.on(stream):
                idx = self._index(block_ids, device, stream)
                if stream is None:
                    torch.index_select(kv_layer, 0, idx, out=pages)
                else:
                    pages.copy_(kv_layer.index_select(0, idx), non_blocking=True)
            event = staging.record(stream)
            if self._saver is None:
                self._saver = staging.SaveWorker("sfstore-vllm-save")
            self._saver.submit(lambda: self._put_staged(event, pool, buf, pages, keys, layer))
        except BaseException:
            if stream is not None:
                stream.synchronize()  # nothing may still write the buffer once it is back in the pool
            pool.release(buf)
            raise
        self._saved_keys.update(keys)  # handed over: wait_for_save discards them if still partial at the end

    def _put_staged(self, event: Any, pool: staging.StagingPool, buf: torch.Tensor, pages: torch.Tensor,
                    keys: list[bytes], layer: int) -> None:
        """On the save worker: once the device-to-host copy completed, the store copies each block's slice out of
        the staging buffer, which then goes back to the pool."""
        try:
            staging.host_wait(event)
            self.store.put_layer(keys, layer, [block_layer_view(pages, i, self.layout) for i in range(len(keys))])
        except Exception:  # a cache: a failed save is a later miss (wait_for_save drops the partial blocks)
            log.exception("SfstoreConnector: saving layer %d of %d blocks failed", layer, len(keys))
        finally:
            pool.release(buf)

    def _drain(self) -> None:
        """Wait for every copy the connector issued: the saves handed over, the loads still in flight."""
        if self._saver is not None:
            self._saver.wait()
        for pool in self._pools.values():
            pool.synchronize()

    def wait_for_save(self) -> None:
        """End of the step: wait until the save worker passed every layer handed over this step to
        ``store.put_layer`` (so the blocks are committed or partial, and vLLM may reuse the pages), then drop the
        partial ones, record the step's KV events and reset the step's state. The step's loads were settled at
        its last layer (the device ordered their copies before the attention that reads them); where the engine
        did not wait for that layer they are settled here, and a request found to have missed a block then loses
        the blocks it saved this step, computed over the missing one."""
        if self._saver is not None:
            self._saver.wait()
        late = self._settle_loads()
        meta = self._metadata() if late else None
        if meta is not None:
            bad = [k for t in meta.saves if t.req_id in late for k in t.keys if k in self._saved_keys]
            if bad:
                self.store.evict(bad)
                self._saved_keys.difference_update(bad)
        self._note_prefill()
        if self._saved_keys:
            # Every layer of this step has been through save_kv_layer: a block still partial was abandoned
            # (the step ended early); it must not linger in the pinned tier.
            self.store.discard_partial(list(self._saved_keys))
        if self._saved_keys and self.wait_for_lower_tiers:
            self.store.wait_for_puts()
        if self._saved_keys:
            self._record_saves()
        stepped = bool(self._saved_keys or self._load_req)
        self._saved_keys = set()
        self._release_held()
        if stepped:  # the blocks this step loaded or saved took slots: the next step's are allocated meanwhile
            self.store.prepare_pinned(self._ready_slots)
        self._loads = []
        self._load_req = {}
        self._failed_reqs = set()
        self._issued, self._load_ordered, self._dst_index, self._step_start = {}, set(), {}, {}
        for pool in self._pools.values():
            pool.reclaim()

    def _note_prefill(self) -> None:
        """A step that computed prompt blocks (it saved them) without loading any: the engine's prefill rate, from
        the time between its first layer's save and the step's end, scaled to every layer."""
        first, self._first_save_at = self._first_save_at, None
        if first is None or self._load_req:
            return
        t0, layer, tokens = first
        layers = max(1, self.layout.geometry.num_layers)
        seen = layers - layer - 1  # layers computed after the first save was taken
        if seen > 0 and tokens > 0:
            self.store.load_or_recompute.note_prefill(tokens, (time.perf_counter() - t0) * layers / seen)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    # -- KV events and stats (vLLM's newer hooks) --------------------------------------------------------------
    def _record_saves(self) -> None:
        """KV events of this step's saved blocks (those now in the pinned tier): one ``BlockStored`` per tier the
        store writes them to (``sfstore/pinned``, ``sfstore/block``, ``sfstore/shared``; the lower tiers receive
        them in the background unless ``wait_for_lower_tiers``)."""
        meta = self._metadata()
        if meta is None or BlockStored is None:
            return
        tiers = self.store.tiers  # not stats(): it lists the shared directory, and this runs every step
        for t in meta.saves:
            if t.req_id in self._failed_reqs or t.token_ids is None or t.parents is None:
                continue
            for key, toks, parent in zip(t.keys, t.token_ids, t.parents, strict=True):
                if key not in self._saved_keys or not self.store.in_pinned(key):  # not committed this step
                    continue
                self._stats["blocks_saved"] += 1
                if "pinned" in tiers:
                    self._announced.add(key)
                for tier in tiers:
                    self._events.append(BlockStored(
                        block_hashes=[key], parent_block_hash=parent, token_ids=toks,
                        block_size=self.block_tokens, lora_id=None, medium=f"sfstore/{tier}", lora_name=None,
                    ))

    def _record_failed_loads(self, keys: list[bytes]) -> None:
        self._stats["load_failures"] += len(keys)
        if BlockRemoved is not None and keys:
            # gone from the tier it was found in (dropped if it failed verification); which tier is not known
            self._events.append(BlockRemoved(block_hashes=list(keys), medium=None))

    def get_kv_connector_kv_cache_events(self) -> Any:
        """Worker side: the blocks stored and removed since the last call, for vLLM's KV event publisher (routers
        such as Dynamo or llm-d see what sfstore holds); ``medium`` names the sfstore tier. A block saved here
        that leaves the pinned tier is a ``BlockRemoved`` with medium ``sfstore/pinned``; a block that failed to
        load, one with medium ``None``."""
        gone = [k for k in self.store.take_pinned_removals() if k in self._announced]
        if gone and BlockRemoved is not None:
            # evicted from the pinned tier (its least recently used blocks leave it), or removed: a lower tier may
            # still hold them, as its own BlockStored said
            self._announced.difference_update(gone)
            self._events.append(BlockRemoved(block_hashes=gone, medium="sfstore/pinned"))
        if not self._events or KVEvents is None:
            return None
        events, self._events = self._events, []
        out = KVEvents(num_workers=1)
        out.add_events(events)
        return out

    def get_kv_connector_stats(self) -> Any:
        """What the connector did since the last call (vLLM's metrics: hits per tier, misses, load failures, blocks
        saved, bytes loaded and saved, blocks dropped as corrupt)."""
        if SfstoreConnectorStats is None:
            return None
        now = self.store.counters.snapshot()
        data = {name: int(now.get(src, 0)) - int(self._stats_base.get(src, 0)) for name, src in STORE_STATS}
        self._stats_base = now
        data.update(self._stats)
        self._stats = dict.fromkeys(OWN_STATS, 0)
        stats = SfstoreConnectorStats(data=data)
        return None if stats.is_empty() else stats

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        """Release what the worker side holds: the step's held blocks, its place among the workers, the save
        thread, the staging pools' copies."""
        self._release_held()
        if self._counted_worker:
            self._counted_worker = False
            self._ahead.add_worker(-1)
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()
        for pool in self._pools.values():
            pool.synchronize()
