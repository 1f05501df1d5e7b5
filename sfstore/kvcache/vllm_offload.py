"""vLLM offloading adapter: sfstore's tiers as a secondary tier of vLLM's CPU offloading (tested with vLLM 0.33.0).

vLLM's ``OffloadingConnector`` moves KV blocks between the GPU and a CPU primary tier itself (its own worker,
async, chunked); its ``TieringOffloadingSpec`` cascades chunks from that CPU tier to secondary tiers and promotes
them back on a hit. This module offers:

* :class:`SfstoreTier`, a ``SecondaryTierManager`` keeping chunks in a :class:`~sfstore.kvcache.KVCacheStore`'s
  lower tiers (the block store on NVMe over RDMA, the shared directory on NFS over RDMA);
* :class:`SfstoreOffloadingSpec`, an ``OffloadingSpec`` (a ``TieringOffloadingSpec`` with :class:`SfstoreTier` as
  its secondary tier unless ``secondary_tiers`` is given).

Either way::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "SfstoreOffloadingSpec",
        "spec_module_path": "sfstore.kvcache.vllm_offload", "cpu_bytes_to_use": 8589934592,
        "shared_dir": "/mnt/nfs/kv"}}'

or, with vLLM's own spec: ``"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "SfstoreTier",
"module_path": "sfstore.kvcache.vllm_offload", "shared_dir": "/mnt/nfs/kv"}]``.

Tier parameters (in the tier's dict, or at the top of ``kv_connector_extra_config`` for
:class:`SfstoreOffloadingSpec`): the store's options, as every engine's config names them
(:mod:`~sfstore.kvcache.engine_options`: ``sfstore_config`` (a config file for :func:`sfstore.open`: the router's
block store and shared directory), ``shared_dir``, ``fsync_shared``, ``shared_bytes``, ``cache_namespace``,
``io_timeout_ms``, ...), ``model_id`` (default: vLLM's model name) and ``io_threads`` (default 2). vLLM's CPU tier
is the memory tier above, so the store has no pinned tier unless ``pinned_bytes`` asks for one.

A chunk is stored as it lies in vLLM's CPU tier (one opaque block of the store: ``kv`` = 1, ``uint8``), under a
key derived from vLLM's offload key (its chained block hash and group) and the model. vLLM seeds its block hashes
at random in each process unless ``PYTHONHASHSEED`` is set: servers that share chunks must set it alike. Unlike
:mod:`sfstore.kvcache.vllm` (whose blocks other engines can read as K and V), the chunks here are vLLM's bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

from sfstore import errors
from sfstore._optional import require
from sfstore.kvcache.engine_options import STORE_KEYS, open_store
from sfstore.kvcache.geometry import KEY_BYTES, KVGeometry
from sfstore.kvcache.store import KVCacheStore

require("vllm", "vllm", "sfstore's vLLM offloading tier (sfstore.kvcache.vllm_offload)")

# E402: after the check, so that a missing vLLM is named with the extra that installs it
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, RequestOffloadingContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["SfstoreOffloadingSpec", "SfstoreTier", "TIER_KEYS"]

#: the tier's parameters: the store's options every engine's config carries (:mod:`~sfstore.kvcache.engine_options`),
#: ``model_id`` and ``io_threads``
TIER_KEYS = tuple(sorted({"model_id", "io_threads", *STORE_KEYS}))


class SfstoreTier(SecondaryTierManager):  # type: ignore[misc]
    """Chunks of vLLM's CPU tier in sfstore's block store and shared directory.

    All calls come from vLLM's scheduler under its tiering manager's lock and return at once: the copies run on
    ``io_threads`` threads and their results are collected by :meth:`get_finished_jobs`.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        model_id: str | None = None,
        io_threads: int = 2,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        options.pop("locality", None)
        unknown = set(options) - STORE_KEYS
        if unknown:
            raise errors.ConfigError(
                f"SfstoreTier: unknown parameters {sorted(unknown)}; known: {', '.join(TIER_KEYS)}"
            )
        if options.get("sfstore_config") is None and options.get("shared_dir") is None:
            raise errors.ConfigError("SfstoreTier needs shared_dir or sfstore_config (a tier to keep chunks in)")
        self._flat = primary_kv_view.cast("B")
        self._chunk = self.block_size_bytes
        if model_id is None:
            model = getattr(getattr(offloading_spec, "config", None), "model", None)
            model_id = getattr(model, "name", None) or "vllm"
        # One opaque "block" per chunk; the pinned tier only stages puts (vLLM's CPU tier is the cache above).
        geometry = KVGeometry(num_layers=1, block_tokens=1, num_kv_heads=1, head_dim=self._chunk, dtype="uint8", kv=1)
        # chunks are opaque here (no chain of blocks to group): a file each, unless chunk_tokens asks otherwise
        self.store: KVCacheStore = open_store(
            geometry, model_id=str(model_id), extra=options, where="SfstoreTier",
            **{k: 0 for k in ("pinned_bytes", "chunk_tokens") if k not in options})
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(io_threads)), thread_name_prefix="sfstore-vllm-tier")
        self._lock = threading.Lock()
        self._done: list[JobResult] = []
        self._running: set[Future[None]] = set()

    # -- keys and chunk memory --------------------------------------------------------------------------------
    def key(self, offload_key: bytes) -> bytes:
        """The store key of one of vLLM's offload keys (block hash + group), within this model and chunk size."""
        return hashlib.blake2b(self.store.namespace + b"\0" + bytes(offload_key), digest_size=KEY_BYTES).digest()

    def _chunk_view(self, chunk_id: int) -> memoryview:
        start = int(chunk_id) * self._chunk
        return self._flat[start:start + self._chunk]

    def _submit(self, job: TransferJob, work: Any) -> None:
        def run() -> None:
            try:
                result = work()
            except Exception:
                result = JobResult(job_id=job.job_id, success=False)
            with self._lock:
                self._done.append(result)

        fut = self._pool.submit(run)
        with self._lock:
            self._running.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: Future[None]) -> None:
        with self._lock:
            self._running.discard(fut)

    # -- SecondaryTierManager ---------------------------------------------------------------------------------
    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.store.contains(self.key(key)) else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise errors.InvalidRequestError(f"store job: {len(keys)} keys but {len(chunk_ids)} chunks")

        def work() -> JobResult:
            todo = [(self.key(k), c) for k, c in zip(keys, chunk_ids, strict=True)]
            todo = [(k, c) for k, c in todo if not self.store.contains(k)]
            if todo:
                self.store.put([k for k, _ in todo], [self._chunk_view(c) for _, c in todo])
            return JobResult(job_id=job_metadata.job_id, success=True, transfer_bytes=len(todo) * self._chunk)

        self._submit(job_metadata, work)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise errors.InvalidRequestError(f"load job: {len(keys)} keys but {len(chunk_ids)} chunks")

        def work() -> JobResult:
            # A key that misses is recomputed by vLLM into the same chunk, so its bytes need not survive the miss:
            # block-store hits land straight in the chunk instead of through a staging copy.
            tiers = self.store.get_into([self.key(k) for k in keys], [self._chunk_view(c) for c in chunk_ids],
                                        keep_on_miss=False)
            ok = [k for k, t in zip(keys, tiers, strict=True) if t is not None]
            if len(ok) == len(keys):
                return JobResult(job_id=job_metadata.job_id, success=True, transfer_bytes=len(ok) * self._chunk)
            return JobResult(job_id=job_metadata.job_id, success=False, successful_keys=ok,
                             transfer_bytes=len(ok) * self._chunk)

        self._submit(job_metadata, work)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._running or self._done)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[Any], req_context: ReqContext) -> None:
        return

    def drain_jobs(self) -> None:
        while True:
            with self._lock:
                running = list(self._running)
            if not running:
                return
            for f in running:
                f.result()

    def shutdown(self) -> None:
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self.store.close()


class SfstoreOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's tiering spec (CPU primary tier) with :class:`SfstoreTier` as the secondary tier.

    ``kv_connector_extra_config`` is vLLM's (``cpu_bytes_to_use``, ``block_size``, ``eviction_policy``, ...) plus
    the tier's keys (:data:`TIER_KEYS`: ``shared_dir``, ``sfstore_config``, ``model_id``, ...); a
    ``secondary_tiers`` list, if given, is used as it is.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        extra = dict(config.extra_config)
        if "secondary_tiers" not in extra:
            tier = {"type": SfstoreTier.__name__, "module_path": __name__}
            tier.update({k: extra[k] for k in TIER_KEYS if k in extra})
            extra["secondary_tiers"] = [tier]
            config = dataclasses.replace(config, extra_config=extra)
        super().__init__(config)
