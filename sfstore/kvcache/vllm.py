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
from sfstore.kvcache.engine_options import STORE_KEYS, STORE_OPTIONS, flag, open_store, store_options  # noqa: E402
from sfstore.kvcache.held import HeldBlocks  # noqa: E402
from sfstore.kvcache.store import KVCacheStore  # noqa: E402
from sfstore.kvcache.vllm_layout import KVLayout, block_layer_view, layout_for, pages_as_layers  # noqa: E402
from sfstore.kvcache.vllm_metrics import (  # noqa: E402
    KVEvents,
    SfstoreConnectorStats,
)
from sfstore.kvcache.vllm_scheduler import BlockTransfer, SchedulerSide, SfstoreConnectorMetadata  # noqa: E402
from sfstore.kvcache.vllm_worker import WorkerSide  # noqa: E402

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

    vLLM makes one per role: the scheduler's hooks go to :attr:`scheduler_side`
    (:class:`~sfstore.kvcache.vllm_scheduler.SchedulerSide`), the workers' to :attr:`worker_side`
    (:class:`~sfstore.kvcache.vllm_worker.WorkerSide`); each holds its role's state.

    Attributes
    ----------
    scheduler_side, worker_side
        The two sides (see above).
    stage_copies : bool or None
        Copy through host staging buffers (the path of a GPU cache). ``None``: where the cache is not on the CPU
        (a CPU cache whose pages can be viewed as one tensor loads a layer with one copy straight into them).
    load_ahead : int
        How many layers past the one it waits for :meth:`wait_for_layer_load` issues the copies of.
    staging_buffers : int
        Most staging buffers per direction, read when the pools are first used.
    load_log : list of (str, int)
        This step's staged loads in order: ``("issue", layer)`` when a layer's copy was issued,
        ``("wait", layer)`` when the current stream was made to wait for it.

    The worker side's ``prefetch_chunks`` and ``blocks_per_prefetch``: a step's loads are prefetched in up to
    ``prefetch_chunks`` parts of at least ``blocks_per_prefetch`` blocks, run at once.

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
        sched = vllm_config.scheduler_config
        # the most blocks one step loads: what the pinned tier allocates up front (register_kv_caches)
        step_blocks = (int(getattr(sched, "max_num_batched_tokens", 0) or 0) // self.block_tokens
                       + int(getattr(sched, "max_num_seqs", 0) or 0))
        # vLLM calls one role's hooks on a connector; each side holds that role's state
        self.worker_side = WorkerSide(self.store, self.layout, self._ahead, step_blocks,
                                      pinned_preallocate=self.pinned_preallocate,
                                      wait_for_lower_tiers=self.wait_for_lower_tiers, metadata=self._bound_metadata)
        self.scheduler_side = SchedulerSide(self.store, self.block_tokens, self.save_decode_tokens, self._ahead,
                                            self.worker_side.hold)
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        self._worker_events: Any = None  # scheduler: the workers' events since the last take_events

    def _bound_metadata(self) -> SfstoreConnectorMetadata | None:
        """The step's metadata vLLM bound to this connector, ``None`` outside a step."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, SfstoreConnectorMetadata)
        return meta

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
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        got = self.scheduler_side.get_external_cache_hit_sources(request, num_external_tokens)
        if got is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)  # type: ignore[no-any-return]
        return got

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SfstoreConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    # ============================== worker side ==============================
    # vLLM's worker hooks, answered by the worker side (sfstore.kvcache.vllm_worker)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's sleep mode: yes. The connector holds vLLM's cache tensors, whose memory sleep unmaps and
        wake-up maps again at the same addresses; the store's tiers are host memory and files, untouched."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep: wait for the copies still in flight, then forget the caches (idempotent)."""
        self.worker_side.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After wake-up: the caches registered before sleep again (idempotent)."""
        self.worker_side.restore_kv_caches()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker_side.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.worker_side.get_kv_connector_kv_cache_events()

    def get_kv_connector_stats(self) -> Any:
        """Worker side: what the connector did since the last call (vLLM's metrics)."""
        if self._is_scheduler:
            return None  # the workers report (in one process both roles share the store: it would count twice)
        return self.worker_side.get_kv_connector_stats()

    # the worker side's knobs, set on the connector (tests, engines that tune them)
    @property
    def stage_copies(self) -> bool | None:
        return self.worker_side.stage_copies

    @stage_copies.setter
    def stage_copies(self, value: bool | None) -> None:
        self.worker_side.stage_copies = value

    @property
    def staging_buffers(self) -> int:
        return self.worker_side.staging_buffers

    @staging_buffers.setter
    def staging_buffers(self, value: int) -> None:
        self.worker_side.staging_buffers = value

    @property
    def load_ahead(self) -> int:
        return self.worker_side.load_ahead

    @load_ahead.setter
    def load_ahead(self, value: int) -> None:
        self.worker_side.load_ahead = value

    @property
    def load_log(self) -> list[tuple[str, int]]:
        return self.worker_side.load_log

    # ============================== KV events and stats (vLLM's newer hooks) ==============================
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

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """The stats object of this connector, from its dict (how vLLM rebuilds stats sent between processes)."""
        if SfstoreConnectorStats is None:
            return None
        return SfstoreConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        self.worker_side.shutdown()
        key, self._store_key = self._store_key, None
        if key is not None:
            _release_store(key)
