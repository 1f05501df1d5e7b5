"""vLLM adapter: :class:`SfstoreConnector`, a ``KVConnectorBase_V1`` over :class:`~sfstore.kvcache.KVCacheStore`.

Load it into vLLM (tested against vLLM 0.33.0's classes, and generating in vLLM 0.32.0's CPU engine) with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "SfstoreConnector",
        "kv_connector_module_path": "sfstore.kvcache.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_dir": "/mnt/nfs/kv", "pinned_bytes": 4294967296}}'

What it does, per engine step:

* scheduler side: :meth:`~SfstoreConnector.get_num_new_matched_tokens` asks the store how many leading prompt
  tokens it holds (full blocks only, and never the whole prompt: vLLM must compute at least one token);
  :meth:`~SfstoreConnector.update_state_after_alloc` records the vLLM block ids those tokens go into, and
  :meth:`~SfstoreConnector.build_connector_meta` sends the worker, per request, the keys and block ids to load
  and those of the prompt blocks this step completes, to save (blocks the store already has are not saved again).
* worker side: :meth:`~SfstoreConnector.start_load_kv` holds each request's blocks to load in the pinned tier and
  starts reading those it lacks from the lower tiers (``store.hold_async``, in ``prefetch_chunks`` parts at once;
  none can be evicted before its last layer is copied), unless the scheduler of the same process did already
  (below); each :meth:`~SfstoreConnector.wait_for_layer_load` copies one layer of every block into vLLM's paged
  cache just before that layer's attention runs, once that layer is in: chunk files are read a layer at a time,
  so a cold hit's first layers are copied while its later ones are still being read
  (:mod:`~sfstore.kvcache.vllm_loads`). A copy is one native call per request out of the pinned slots into a
  staging tensor in the store's layout (``HeldBlocks.copy_layer_into``) and one scatter into the pages through
  their view as the store's layers (:func:`pages_as_layers`). At the step's last layer the loads are settled:
  the blocks that missed are known before that layer is saved. Then
  :meth:`~SfstoreConnector.save_kv_layer` copies one layer of each block to save out of it right after
  (``store.put_layer``; the store commits a block once all its layers are in and writes it to its lower tiers in
  the background). Loads are synchronous for the scheduler (``load_kv_async`` False) and saves are copied out
  before the step ends, so no request holds its blocks after it finishes. A block that cannot be loaded (evicted
  between the lookup and the load, or failing verification in a lower tier, which removes it there) is reported
  through ``get_block_ids_with_load_errors`` and logged; vLLM recomputes it, and the connector saves it again.
  That needs vLLM's ``kv_load_failure_policy`` to be ``"recompute"``: vLLM's own default, ``"fail"``, ends the
  request with ``finish_reason="error"`` instead, so the connector sets ``"recompute"`` unless told otherwise
  (``kv_load_failure_policy`` below). A damaged block fails at most the loads already planned when it was found.

A GPU cache (or any cache when ``stage_copies`` is set) moves each layer through a pinned host staging buffer,
and the copies overlap the forward pass instead of stopping the engine's thread once per layer:

* loads: ``wait_for_layer_load`` of layer ``i`` finds layer ``i``'s copy already issued (by the call for layer
  ``i - 1``, where the layer had been read by then), issues layer ``i + 1``'s where it is read already
  (``load_ahead`` layers) and makes the current stream wait for layer ``i``'s event: the kernels enqueued after
  the call wait for the copy, the CPU does not. Issuing a layer means the store copies each block's slice from its
  pinned slot into a staging buffer on the engine's thread (``HeldBlocks.copy_layer_into``),
  then one copy to the device and one scatter into the pages are enqueued on the connector's load stream, which
  first waits for what the engine had enqueued when ``start_load_kv`` ran (vLLM zeroing the new blocks, an
  earlier step's kernels), not for the forward pass enqueued after it. Layer 0's copy is issued at the first
  ``wait_for_layer_load``, not in ``start_load_kv``: the reads from the lower tiers then run while the engine
  enqueues the work before the first attention, instead of holding the engine's thread before it.
* saves: ``save_kv_layer`` enqueues, on the connector's save stream after the work enqueued so far (so after the
  layer's attention wrote its pages), a gather of the pages and one copy into a pinned staging buffer, and hands
  the copy's event to one save thread, which waits for it and calls ``store.put_layer``; the call returns at once.
  ``wait_for_save`` waits until that thread has put every layer handed over in the step, so the step still ends
  with its blocks committed or dropped as partial, and with the pages no longer read.
* staging buffers come from two small pools (``staging_buffers`` each, which bounds their pinned memory); a
  buffer is handed out again only once the copy that used it completed, checked without waiting: the CPU waits
  only when the device falls that many layers behind (loads) or the save thread does (saves).

On a CPU cache the streams and events are ``None``: the same steps run with synchronous copies (loads copy a layer
of every held block straight into its strided pages with one native call, ``HeldBlocks.copy_layer_into`` with
``rows_at``; saves gather a layer's pages with one ``index_select``; ``stage_copies`` True takes a GPU cache's path
through a staging tensor, and False, or pages that cannot be viewed as one tensor, copy block by block).

``kv_connector_extra_config`` keys (all optional):

``sfstore_config``
    A config file for :func:`sfstore.open`; the store then uses the tiers the router gives
    (:meth:`KVCacheStore.from_router`). Without it the store has the pinned tier plus ``shared_dir`` if set.
``shared_dir``
    Directory of the shared tier (NFS over RDMA on a cluster): blocks written there are seen by every process
    and node that uses the same directory and model.
``model_id``
    Names the model in every key. Default: for a local model directory, its name and a digest of its
    ``config.json`` and weight files (their names, sizes, first and last MiB), so any spelling of its path finds
    the same blocks; for a hub model, its id and revision. Two servers share blocks only if their ``model_id``
    and KV geometry match.
``kv_load_failure_policy``
    ``"recompute"`` (default) or ``"fail"``: set as vLLM's ``kv_load_failure_policy`` (a warning at start-up
    says what ``"fail"`` means).
``fsync_shared``
    fsync each shared block file before publishing it (default False): durable across a node's crash, slower.
``pinned_bytes``
    Budget of the pinned host tier, bytes or a size such as ``"4GiB"`` (default: the ``kvcache_pinned_bytes``
    setting).
``pinned_preallocate``
    Allocate the whole pinned tier when vLLM registers its caches (default True: registered memory for
    ``pinned_bytes`` is taken and locked at start, in a time that grows with it, so that no step's loads or
    saves pay for allocating it; without it, slots are allocated as blocks first arrive, on the engine's time).
``shared_bytes``
    Budget of the shared tier's cache namespace, kept by every process and node that writes it (its least
    recently read blocks are evicted beyond it; 0: unbounded). Default: the ``kvcache_shared_bytes`` setting.
``cache_namespace``
    The shared tier's cache namespace: its blocks live in ``ns/<name>/`` of ``shared_dir`` and never read or
    evict another namespace's (``""``: the directory itself). Default: the ``kvcache_namespace`` setting.
``io_timeout_ms``
    Deadline of each operation of the block-store and shared tiers, in milliseconds (0: none): past it a load
    is a miss (vLLM recomputes the block), a save is dropped, and the tier is quarantined. Default: the
    ``kvcache_io_timeout_ms`` setting.
``quarantine_ms``
    First back-off of a tier that missed its deadline (answered at once, without I/O, then probed; doubling with
    each miss in a row). Default: the ``kvcache_quarantine_ms`` setting.
``load_or_recompute``
    Report a hit from a lower tier only where loading it is expected to be faster than recomputing it, from each
    tier's load rate (the store's own loads) and the engine's prefill rate (its own steps that computed prompt
    blocks); blocks in the pinned tier are always loaded. The figures and decisions are in ``stats()`` and in
    vLLM's connector metrics (``blocks_declined``). Default: the ``kvcache_load_or_recompute`` setting (on).
``chunk_tokens``
    Tokens per file of the shared tier (a multiple of vLLM's block size; 0: a file per block). Default: the
    ``kvcache_chunk_tokens`` setting (256).
``kv_layout``
    How a vLLM block maps to the store's ``[kv][token][head][dim]`` layer slice: ``"auto"`` (default: ``"cpu"``
    on vLLM's CPU platform, ``"split"`` elsewhere), ``"split"`` (each cell of the ``[B, H, N, C]`` page is K then V,
    as FlashAttention, Triton and FlashInfer read it), ``"cpu"`` (each head's page is all K rows then all V rows,
    as vLLM's CPU backend reads it) or ``"opaque"`` (the page as it is, ``kv`` = 1: exact for any backend, but not
    readable by another engine as K and V). Latent attention (MLA), quantized, packed and K/V-asymmetric caches
    always use ``"opaque"``.
``save_decode_tokens``
    Also save blocks of generated tokens (default: only prompt blocks).
``wait_for_lower_tiers``
    End each step only once the step's saved blocks reached every lower tier (default False: they are written in
    the background; blocks in the pinned tier are already loadable by this process).

Any other key is ignored, with a warning (one that names an sfstore setting says which key sets it here).

Scheduler and worker connectors of one process (vLLM's single-process executor) share one store, so a block the
worker saved is found by the scheduler's lookup at once, and the scheduler holds a request's blocks and starts
their reads as soon as it has allocated the blocks to load (``update_state_after_alloc``): the reads from the lower
tiers overlap the rest of the scheduler's step and the model runner's preparation
(``blocks_prefetched_by_scheduler`` in vLLM's metrics counts them). The worker's pinned tier allocates one step's
worth of slots when the caches are registered, so the first hits do not pay for allocating registered memory.
Across processes (tensor parallelism, a separate engine core; vLLM's CPU platform always runs the worker in its own
process unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler sees only what reached a tier they share:
``shared_dir``, or the block store of an sfstore config. Without one, the scheduler never finds a block (the pinned
tier is the worker's memory). With one, the blocks a step saved reach it in the background: a request scheduled
right after can find only part of them, unless ``wait_for_lower_tiers`` is set (each step then ends once its saves
are written). With tensor parallelism each rank stores its own heads under its own keys and the scheduler looks up
rank 0's. Pipeline parallelism and hybrid (HMA) models are not supported.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from sfstore._optional import require

# E402 below: the imports come after these checks, so that a missing package is named with the extra to install
require("torch", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)")
require("vllm", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)

from sfstore import errors  # noqa: E402
from sfstore.kvcache import vllm_staging as staging  # noqa: E402
from sfstore.kvcache.engine_options import STORE_KEYS, STORE_OPTIONS, flag, open_store, store_options  # noqa: E402
from sfstore.kvcache.held import HeldBlocks  # noqa: E402
from sfstore.kvcache.store import KVCacheStore  # noqa: E402
from sfstore.kvcache.vllm_layout import KVLayout, block_layer_view, layout_for, pages_as_layers  # noqa: E402
from sfstore.kvcache.vllm_loads import HeldLoad, StepLoads  # noqa: E402
from sfstore.kvcache.vllm_metrics import (  # noqa: E402
    OWN_STATS,
    STORE_STATS,
    BlockRemoved,
    BlockStored,
    KVEvents,
    SfstoreConnectorStats,
)
from sfstore.kvcache.vllm_scheduler import BlockTransfer, SchedulerSide, SfstoreConnectorMetadata  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["SfstoreConnector", "SfstoreConnectorMetadata", "BlockTransfer", "layout_for", "block_layer_view",
           "pages_as_layers"]

log = logging.getLogger(__name__)

# -- metadata: scheduler -> worker -----------------------------------------------------------------------------------
# -- one store per process and configuration -------------------------------------------------------------------------
_stores: dict[tuple[Any, ...], list[Any]] = {}  # key -> [store, users, its _LoadsAhead]
_stores_lock = threading.Lock()


_WHERE = "kv_connector_extra_config"
_EXTRA_CONFIG_KEYS = frozenset({
    "model_id", "kv_load_failure_policy", "kv_layout", "save_decode_tokens", "wait_for_lower_tiers",
    "pinned_preallocate", "load_or_recompute", *STORE_KEYS,
})


def _flag(extra: dict[str, Any], name: str, default: bool) -> bool:
    return flag(extra, name, default, _WHERE)


def _warn_unknown_keys(extra: dict[str, Any]) -> None:
    by_setting = {setting: name for name, setting in STORE_OPTIONS.items()}
    for k in sorted(set(extra) - _EXTRA_CONFIG_KEYS, key=str):
        hint = f" (the {k} setting is {by_setting[k]!r} here)" if k in by_setting else ""
        log.warning("SfstoreConnector: kv_connector_extra_config key %r is not one it reads; ignored%s", k, hint)


def _acquire_store(layout: KVLayout, model_id: str, extra: dict[str, Any]) -> tuple[KVCacheStore, tuple[Any, ...]]:
    cfg = extra.get("sfstore_config")
    shared = extra.get("shared_dir")
    key = (layout.geometry, model_id, str(cfg) if cfg is not None else None,
           str(shared) if shared is not None else None, _flag(extra, "fsync_shared", False),
           tuple(sorted(store_options(extra, _WHERE).items())))
    with _stores_lock:
        entry = _stores.get(key)
        if entry is None:
            store = open_store(layout.geometry, model_id=model_id, extra=extra, where=_WHERE)
            entry = _stores[key] = [store, 0, _LoadsAhead()]
        entry[1] += 1
        return entry[0], key


def _release_store(key: tuple[Any, ...]) -> None:
    with _stores_lock:
        entry = _stores.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _stores[key]
    entry[0].close()


class _LoadsAhead:
    """The prefetches a scheduler started for the worker in its own process, by request.

    Where the scheduler and a worker share a process (vLLM's in-process engine, a single-GPU server: they share the
    store too), the scheduler starts a request's prefetch as soon as it has allocated the blocks to load
    (:meth:`SfstoreConnector.update_state_after_alloc`), and the worker's :meth:`SfstoreConnector.start_load_kv`
    takes it instead of starting its own: the reads from the lower tiers then overlap the rest of the scheduler's
    step and the model runner's preparation, which come before ``start_load_kv``. In a worker process of its own
    nothing is started for it (``workers`` is 0 where the scheduler runs).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_req: dict[str, tuple[list[bytes], HeldBlocks | None]] = {}
        self.workers = 0  # workers of this process that registered their caches with this store

    def put(self, req_id: str, keys: list[bytes], held: HeldBlocks | None) -> None:
        with self._lock:
            old = self._by_req.pop(req_id, None)
            if held is not None:
                self._by_req[req_id] = (keys, held)
        if old is not None and old[1] is not None:
            old[1].release()

    @property
    def blocks(self) -> int:
        """Blocks held ahead now, for every request."""
        with self._lock:
            return sum(len(keys) for keys, _held in self._by_req.values())

    def take(self, req_id: str, keys: list[bytes]) -> HeldBlocks | None:
        """The blocks held for ``req_id`` if they are exactly ``keys`` (else ``None``, and they are released: the
        caller holds its own); taken once."""
        with self._lock:
            entry = self._by_req.pop(req_id, None)
        if entry is None or entry[1] is None:
            return None
        if entry[0] != keys:
            entry[1].release()
            return None
        return entry[1]

    def drop(self, req_id: str) -> None:
        """Release what was held for ``req_id`` (the request finished or was aborted before a worker took it)."""
        self.put(req_id, [], None)

    def add_worker(self, n: int) -> None:
        with self._lock:
            self.workers += n


def _loads_ahead(key: tuple[Any, ...]) -> _LoadsAhead:
    with _stores_lock:
        return _stores[key][2]  # type: ignore[no-any-return]


# -- what names the model in the keys, and the load failure policy -----------------------------------------------------
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_FINGERPRINT_BYTES = 1 << 20


def _file_fingerprint(path: str, h: Any) -> None:
    """Name, size and the first and last MiB of a weight file: cheap for a large model, and different for two
    checkpoints of one architecture (their weights differ from the first tensor on)."""
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}\0{size}\0".encode())
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
        if size > 2 * _FINGERPRINT_BYTES:
            f.seek(size - _FINGERPRINT_BYTES)
            h.update(f.read(_FINGERPRINT_BYTES))


def model_identity(model_config: Any) -> str:
    """What names a vLLM model in the store's keys: for a local model directory, its name and a digest of its
    ``config.json`` and weight files (so ``./m``, ``/abs/m`` and a symlink to it share blocks, and two
    checkpoints in directories of the same name do not); for a hub model, its id and revision."""
    model = str(getattr(model_config, "model", None) or "vllm")
    revision = getattr(model_config, "revision", None)
    if os.path.isdir(model):
        h = hashlib.sha256()
        names = sorted(os.listdir(model))
        for name in names:
            if name == "config.json" or name.endswith(_WEIGHT_SUFFIXES):
                path = os.path.join(model, name)
                if os.path.isfile(path):
                    if name == "config.json":
                        with open(path, "rb") as f:
                            h.update(b"config.json\0" + f.read())
                    else:
                        _file_fingerprint(path, h)
        base = os.path.basename(os.path.normpath(os.path.realpath(model)))
        return f"{base}#{h.hexdigest()[:32]}"
    return f"{model}@{revision}" if revision else model


LOAD_FAILURE_POLICIES = ("recompute", "fail")


def _set_load_failure_policy(kv_transfer_config: Any, extra: dict[str, Any], role: KVConnectorRole) -> str:
    """Set vLLM's ``kv_load_failure_policy`` to the connector's (``recompute`` unless ``kv_connector_extra_config``
    says ``"kv_load_failure_policy": "fail"``): a block sfstore cannot load is a cache miss, and vLLM's own default
    (``fail``) would end its request with an error. vLLM's scheduler reads the policy after it creates its connector,
    so setting it here takes effect."""
    policy = str(extra.get("kv_load_failure_policy", "recompute"))
    if policy not in LOAD_FAILURE_POLICIES:
        raise errors.ConfigError(
            f"kv_connector_extra_config kv_load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}, "
            f"not {policy!r}"
        )
    current = getattr(kv_transfer_config, "kv_load_failure_policy", None)
    if current is not None and current != policy:
        kv_transfer_config.kv_load_failure_policy = policy
        if role == KVConnectorRole.SCHEDULER:
            log.info("SfstoreConnector: vLLM's kv_load_failure_policy set to %r (was %r): a block that cannot be "
                     "loaded is recomputed%s", policy, current,
                     "" if policy == "recompute" else "; its request fails")
    if policy == "fail" and role == KVConnectorRole.SCHEDULER:
        log.warning("SfstoreConnector: kv_load_failure_policy is 'fail': a KV block that fails verification or "
                    "disappears between lookup and load fails its request (finish_reason 'error'); "
                    "'recompute' (the connector's default) recomputes it instead")
    return policy


# -- the connector ---------------------------------------------------------------------------------------------------
class SfstoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM KV connector (v1 API) that loads and saves KV-cache blocks through a :class:`KVCacheStore`.

    Attributes
    ----------
    stage_copies : bool or None
        Copy through host staging buffers (the path of a GPU cache). ``None``: where the cache is not on the CPU
        (a CPU cache whose pages can be viewed as one tensor loads a layer with one copy straight into them).
    load_ahead : int
        How many layers past the one it waits for :meth:`wait_for_layer_load` issues the copies of.
    prefetch_chunks, blocks_per_prefetch : int
        A step's loads are prefetched in up to ``prefetch_chunks`` parts of at least ``blocks_per_prefetch``
        blocks, run at once.
    staging_buffers : int
        Most staging buffers per direction, read when the pools are first used.
    load_log : list of (str, int)
        This step's staged loads in order: ``("issue", layer)`` when a layer's copy was issued,
        ``("wait", layer)`` when the current stream was made to wait for it.

    Notes
    -----
    The staged copies are asynchronous on the device (see the module's description), so the engine must keep to
    what vLLM's model runner does:

    * call a step's worker hooks from one thread, in order: :meth:`start_load_kv`, then for each layer
      :meth:`wait_for_layer_load` before anything reads the layer's loaded pages and :meth:`save_kv_layer` after
      its attention, then :meth:`wait_for_save` before the saved blocks' pages are written again or freed;
    * read a loaded layer only through work enqueued on the stream that was current at its
      :meth:`wait_for_layer_load`, after that call: another stream, or the CPU, must synchronize with it first;
    * call :meth:`unregister_kv_caches` before the caches' memory goes away (sleep): it waits for the copies
      still in flight.
    """

    load_ahead = 1  # staged loads: how many layers' copies wait_for_layer_load issues past the one it waits for
    # Prefetches of one step's loads run at once (on the store's two background threads: more parts than two only
    # queue), each of at least blocks_per_prefetch blocks.
    prefetch_chunks = 2
    blocks_per_prefetch = 4
    staging_buffers = 8  # staged copies: most staging buffers per direction (bounds the pinned memory they take)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        _warn_unknown_keys(extra)
        parallel = vllm_config.parallel_config
        if getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise errors.NotSupportedOnHostError("SfstoreConnector does not support pipeline parallelism yet")
        self.layout = layout_for(kv_cache_config, str(extra.get("kv_layout", "auto")))
        self.block_tokens = self.layout.geometry.block_tokens
        block_size = vllm_config.cache_config.block_size
        if block_size is not None and block_size != self.block_tokens:
            raise errors.ConfigError(
                f"vLLM's block_size ({block_size}) differs from the KV cache spec's ({self.block_tokens})"
            )
        model_id = extra.get("model_id")
        if model_id is None:
            model_id = model_identity(vllm_config.model_config)
        self.load_failure_policy = _set_load_failure_policy(self._kv_transfer_config, extra, role)
        tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.model_id = str(model_id) if tp == 1 else f"{model_id}#tp{self._tp_rank(role)}/{tp}"
        self.save_decode_tokens = _flag(extra, "save_decode_tokens", False)
        self.wait_for_lower_tiers = _flag(extra, "wait_for_lower_tiers", False)
        self.pinned_preallocate = _flag(extra, "pinned_preallocate", True)
        self.store, key = _acquire_store(self.layout, self.model_id, extra)
        if extra.get("load_or_recompute") is not None:
            self.store.load_or_recompute.enabled = _flag(extra, "load_or_recompute", True)
        self._store_key: tuple[Any, ...] | None = key
        self._ahead = _loads_ahead(key)
        self._counted_worker = False
        sched = vllm_config.scheduler_config
        # the most blocks one step loads: what the pinned tier allocates up front (register_kv_caches)
        self._step_blocks = (int(getattr(sched, "max_num_batched_tokens", 0) or 0) // self.block_tokens
                             + int(getattr(sched, "max_num_seqs", 0) or 0))
        self._scheduler = SchedulerSide(self.store, self.block_tokens, self.save_decode_tokens, self._ahead,
                                        self._hold)
        # worker side
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
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        self._events: list[Any] = []  # worker: KV events since the last get_kv_connector_kv_cache_events
        self._announced: set[bytes] = set()  # worker: blocks a BlockStored said are in the pinned tier, still there
        self._worker_events: Any = None  # scheduler: the workers' events since the last take_events
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

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, never lost work

    @staticmethod
    def _tp_rank(role: KVConnectorRole) -> int:
        if role == KVConnectorRole.SCHEDULER:
            return 0  # the scheduler looks up rank 0's blocks
        from vllm.distributed import parallel_state

        return int(parallel_state.get_tensor_model_parallel_rank())

    # ============================== scheduler side ==============================
    # vLLM's scheduler hooks, answered by the scheduler side (sfstore.kvcache.vllm_scheduler)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        got = self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)
        if got is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)  # type: ignore[no-any-return]
        return got

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SfstoreConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    # ============================== worker side ==============================
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

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's sleep mode: yes. The connector holds vLLM's cache tensors, whose memory sleep unmaps and
        wake-up maps again at the same addresses; the store's tiers are host memory and files, untouched."""
        return True

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
        meta = self._get_connector_metadata()
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
                held = self._hold(t.keys)
            parts.append(HeldLoad(t.req_id, t.keys, list(t.block_ids), held))
        self._step_loads = StepLoads(self.store, parts)

    def _dropped(self) -> int:
        c = self.store.counters.snapshot()
        return int(c.get("corrupt_dropped", 0)) + int(c.get("unreadable", 0))

    def _hold(self, keys: list[bytes]) -> HeldBlocks | None:
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
                         self._hold([k for _r, k, _b in part]))])
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
        if layer is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, SfstoreConnectorMetadata)
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
        if late and self.has_connector_metadata():
            meta = self._get_connector_metadata()
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

    # ============================== KV events and stats (vLLM's newer hooks) ==============================
    def _record_saves(self) -> None:
        """KV events of this step's saved blocks (those now in the pinned tier): one ``BlockStored`` per tier the
        store writes them to (``sfstore/pinned``, ``sfstore/block``, ``sfstore/shared``; the lower tiers receive
        them in the background unless ``wait_for_lower_tiers``)."""
        if not self.has_connector_metadata() or BlockStored is None:
            return
        meta = self._get_connector_metadata()
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

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler side: collect the workers' KV events (those every worker reported, as vLLM's own connectors
        aggregate them across tensor-parallel ranks)."""
        events = getattr(connector_output, "kv_cache_events", None)
        if events is None or KVEvents is None or not isinstance(events, KVEvents):
            return
        if self._worker_events is None:
            self._worker_events = events
        else:
            self._worker_events.add_events(events.get_all_events())
            self._worker_events.increment_workers(events.get_number_of_workers())

    def take_events(self) -> Any:
        """Scheduler side: the KV events collected since the last call (vLLM publishes them each step)."""
        if self._worker_events is None:
            return ()
        batch, self._worker_events = self._worker_events, None
        batch.aggregate()
        events = batch.get_all_events()
        batch.clear_events()
        return events

    def get_kv_connector_stats(self) -> Any:
        """Worker side: what the connector did since the last call (vLLM's metrics: hits per tier, misses, load
        failures, blocks saved, bytes loaded and saved, blocks dropped as corrupt)."""
        if SfstoreConnectorStats is None or self._is_scheduler:
            return None  # the workers report (in one process both roles share the store: it would count twice)
        now = self.store.counters.snapshot()
        data = {name: int(now.get(src, 0)) - int(self._stats_base.get(src, 0)) for name, src in STORE_STATS}
        self._stats_base = now
        data.update(self._stats)
        self._stats = dict.fromkeys(OWN_STATS, 0)
        stats = SfstoreConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """The stats object of this connector, from its dict (how vLLM rebuilds stats sent between processes)."""
        if SfstoreConnectorStats is None:
            return None
        return SfstoreConnectorStats(data=dict(data or {}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._release_held()
        if self._counted_worker:
            self._counted_worker = False
            self._ahead.add_worker(-1)
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()
        for pool in self._pools.values():
            pool.synchronize()
        key, self._store_key = self._store_key, None
        if key is not None:
            _release_store(key)
