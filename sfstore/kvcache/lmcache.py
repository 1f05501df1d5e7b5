"""sfstore's KV tiers as an LMCache storage plugin: LMCache's chunks stored, verified and shared through them.

LMCache (0.5.x) loads a storage backend named in its configuration; this module is one::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    storage_plugins: [sfstore]
    extra_config:
      storage_plugin.sfstore.module_path: sfstore.kvcache.lmcache
      storage_plugin.sfstore.class_name: SfstoreBackend
      sfstore.shared_dir: /mnt/nfs-rdma/ai/kvcache/shared

Every other ``sfstore.<option>`` key of ``extra_config`` is an option of the store
(:mod:`~sfstore.kvcache.engine_options`: ``sfstore_config``, ``shared_dir``, ``fsync_shared``, ``pinned_bytes``,
``shared_bytes``, ``cache_namespace``, ``io_timeout_ms``, ``quarantine_ms``) or ``model_id`` (default: LMCache's
model name). LMCache's own CPU tier (``local_cpu``) is the memory tier above this one, so the store has no pinned
tier unless ``sfstore.pinned_bytes`` asks for one; and as LMCache's chunk is already the storage unit, each is
a file of its own (``chunk_tokens`` 0).

One LMCache chunk (``chunk_size`` tokens of every layer) is one block of the store, so a chunk is one file of the
shared tier (a storage unit sized for a cluster filesystem), read straight into the memory object LMCache
allocated and verified there. Its key is LMCache's key (model, world size, rank, chunk hash, dtype and the
request's ``lmcache.tag.*`` configs, so tenants tagged apart never share a block) hashed with the store's
geometry. Unlike LMCache's ``local_disk``, nothing is held in an index in memory: a new process finds what an
earlier one stored, a damaged file is a miss (LMCache recomputes the chunk and stores it again), and a stalled
shared tier misses within the store's deadline.

Only whole chunks are stored: LMCache's ``save_unfull_chunk`` (off by default) is refused at start-up, as its own
fixed-size backends refuse it; a chunk of another size that reaches a put anyway is skipped and counted
(``chunks_skipped_size`` in :meth:`SfstoreBackend.stats`). ``pin``/``unpin`` keep a key from this process's
removals (LMCache's eviction); the shared tier's budget, which other processes enforce too, may still evict a
pinned chunk, whose get is then a miss that LMCache recomputes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from sfstore._optional import require

require("lmcache.v1.storage_backend.abstract_backend", "lmcache", "sfstore's LMCache storage plugin "
        "(sfstore.kvcache.lmcache)")

from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface  # noqa: E402

from sfstore import errors  # noqa: E402
from sfstore.kvcache.engine_options import STORE_KEYS, open_store  # noqa: E402
from sfstore.kvcache.geometry import KVGeometry  # noqa: E402
from sfstore.kvcache.store import KVCacheStore  # noqa: E402

__all__ = ["SfstoreBackend", "OPTION_PREFIX"]

log = logging.getLogger(__name__)

#: ``extra_config`` keys that start with this are the plugin's (``sfstore.shared_dir``, ...).
OPTION_PREFIX = "sfstore."
_WHERE = "LMCache extra_config"
_KEYS = frozenset({"model_id", *STORE_KEYS})
_PUT_WORKERS = 2  # batches written at once (each one batch of the store: its files in parallel)


def _options(config: Any) -> dict[str, Any]:
    """The plugin's options from LMCache's ``extra_config`` (``sfstore.<name>`` keys); unknown names warned of."""
    extra = dict(getattr(config, "extra_config", None) or {})
    out = {k[len(OPTION_PREFIX):]: v for k, v in extra.items() if isinstance(k, str) and k.startswith(OPTION_PREFIX)}
    for name in sorted(set(out) - _KEYS):
        log.warning("sfstore's LMCache plugin: extra_config key %r is not one it reads; ignored (it reads %s)",
                    OPTION_PREFIX + name, ", ".join(OPTION_PREFIX + k for k in sorted(_KEYS)))
    return {k: v for k, v in out.items() if k in _KEYS}


def _geometry(metadata: Any, chunk_size: int) -> KVGeometry:
    """One LMCache chunk of ``chunk_size`` tokens as a block: LMCache's ``kv_shape`` is (layers, 2 or 1 (MLA),
    chunk, KV heads, head size)."""
    layers, kv, _tokens, heads, head_dim = (int(x) for x in metadata.kv_shape)
    return KVGeometry(num_layers=layers, block_tokens=chunk_size, num_kv_heads=heads, head_dim=head_dim,
                      dtype=metadata.kv_dtype, kv=kv)


class SfstoreBackend(StoragePluginInterface):  # type: ignore[misc]
    """LMCache's storage backend over a :class:`~sfstore.kvcache.store.KVCacheStore` (see the module).

    LMCache builds it (``storage_plugins``); its arguments are LMCache's. Memory objects for gets come from
    LMCache's CPU backend (its allocator), as for its own disk backend.
    """

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if config is None or metadata is None:
            raise errors.ConfigError("sfstore's LMCache plugin needs LMCache's config and metadata (LMCache passes "
                                     "them when it loads a storage plugin)")
        if getattr(config, "save_unfull_chunk", False):
            raise errors.ConfigError(
                "sfstore's LMCache plugin stores whole chunks only: set save_unfull_chunk: false (LMCache's "
                "default; enable_blending turns it on)")
        if local_cpu_backend is None:
            raise errors.ConfigError("sfstore's LMCache plugin allocates through LMCache's CPU backend: LMCache "
                                     "gave none (a scheduler-role engine stores nothing)")
        opts = _options(config)
        self.chunk_size = int(config.chunk_size)
        self.geometry = _geometry(metadata, self.chunk_size)
        self.store: KVCacheStore = open_store(
            self.geometry, model_id=str(opts.pop("model_id", metadata.model_name)), extra=opts, where=_WHERE,
            **{k: 0 for k in ("pinned_bytes", "chunk_tokens") if k not in opts})
        self._fmt = MemoryFormat.KV_MLA_FMT if getattr(metadata, "use_mla", False) else MemoryFormat.KV_2LTD
        self._shapes = metadata.get_shapes(self.chunk_size)
        self._dtypes = metadata.get_dtypes()
        self._lock = threading.Lock()
        self._pins: Counter[Any] = Counter()
        self._in_flight: Counter[Any] = Counter()
        self._counts: Counter[str] = Counter()
        self._puts: list[Future[None]] = []
        self._writer = ThreadPoolExecutor(max_workers=_PUT_WORKERS, thread_name_prefix="sfstore-lmcache-put")
        self._reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sfstore-lmcache-get")
        self._closed = False

    def __str__(self) -> str:
        return "SfstoreBackend"

    # -- keys -------------------------------------------------------------------------------------------------
    def _key(self, key: Any) -> bytes:
        """The store's key of LMCache's ``key``: its text (model, world size, rank, chunk hash, dtype, tags)
        hashed with the store's namespace (model id and geometry)."""
        h = hashlib.blake2b(digest_size=32)
        h.update(self.store.namespace)
        h.update(b"\0lmcache\0")
        h.update(key.to_string().encode())
        return h.digest()

    def contains(self, key: Any, pin: bool = False) -> bool:
        found = self.store.contains(self._key(key))
        if found and pin:
            self.pin(key)
        return found

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        """How many of ``keys``, from the first, are stored (one batch of the store)."""
        if not keys:
            return 0
        found = self.store.contains_many([self._key(k) for k in keys])
        n = found.index(False) if False in found else len(found)
        if pin:
            for k in keys[:n]:
                self.pin(k)
        return n

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return await asyncio.wrap_future(self._reader.submit(self.batched_contains, keys, pin))

    def exists_in_put_tasks(self, key: Any) -> bool:
        with self._lock:
            return self._in_flight[key] > 0

    # -- puts -------------------------------------------------------------------------------------------------
    def batched_submit_put_task(self, keys: Sequence[Any], objs: list[Any], transfer_spec: Any = None,
                                on_complete_callback: Callable[[Any], None] | None = None) -> list[Future[None]]:
        """Write the chunks in the background, straight from LMCache's memory objects (each held by a reference
        until written); ``on_complete_callback(key)`` once a chunk is stored."""
        take: list[tuple[Any, Any]] = []
        for key, obj in zip(keys, objs, strict=True):
            if obj.get_size() != self.geometry.block_bytes:
                self._count(chunks_skipped_size=1)
                log.warning("sfstore's LMCache plugin: a chunk of %d bytes is not stored (a whole chunk is %d)",
                            obj.get_size(), self.geometry.block_bytes)
                continue
            with self._lock:
                if self._in_flight[key]:
                    continue
                self._in_flight[key] += 1
            obj.ref_count_up()
            take.append((key, obj))
        if not take:
            return []
        fut = self._writer.submit(self._put, take, on_complete_callback)
        with self._lock:
            self._puts = [f for f in self._puts if not f.done()] + [fut]
        return [fut]

    def _put(self, take: list[tuple[Any, Any]], on_complete: Callable[[Any], None] | None) -> None:
        try:
            self.store.put([self._key(k) for k, _o in take], [o.byte_array for _k, o in take])
            self._count(chunks_put=len(take))
        except errors.SfstoreError as exc:
            self._count(put_errors=1)
            log.warning("sfstore's LMCache plugin: a put of %d chunks failed: %s", len(take), exc)
            return
        finally:
            for key, obj in take:
                obj.ref_count_down()
                with self._lock:
                    self._in_flight[key] -= 1
                    if not self._in_flight[key]:
                        del self._in_flight[key]
        if on_complete is not None:
            for key, _obj in take:
                try:
                    on_complete(key)
                except Exception as exc:  # LMCache's contract: a callback's failure is logged, not raised
                    log.warning("on_complete_callback failed for %s: %s", key, exc)

    async def async_batched_submit_put_task(self, keys: Sequence[Any], objs: list[Any], transfer_spec: Any = None,
                                            on_complete_callback: Callable[[Any], None] | None = None) -> None:
        for fut in self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback):
            await asyncio.wrap_future(fut)

    # -- gets -------------------------------------------------------------------------------------------------
    def _allocate(self, count: int) -> list[Any]:
        objs = []
        try:
            for _ in range(count):
                obj = self.local_cpu_backend.allocate(self._shapes, self._dtypes, self._fmt)
                if obj is None:
                    break
                objs.append(obj)
        except BaseException:
            for obj in objs:
                obj.ref_count_down()
            raise
        return objs

    def batched_get_blocking(self, keys: list[Any]) -> list[Any]:
        """Each chunk read straight into a memory object of LMCache's CPU backend and verified there (one batch
        of the store); ``None`` for a miss (absent, damaged, past the deadline) or where LMCache's allocator had
        no memory left. A batch that misses its deadline keeps its memory objects from LMCache's allocator until
        its abandoned read returns (``objects_lent`` in :meth:`stats`): the read may still write them."""
        if not keys:
            return []
        objs = self._allocate(len(keys))
        got: list[Any] = [None] * len(keys)
        if not objs:
            self._count(gets_no_memory=len(keys))
            return got
        lent: set[int] = set()  # memory objects a read past its deadline still holds: it releases them

        def lend(at: list[int]) -> Callable[[], None]:
            lent.update(at)
            held = [objs[i] for i in at]
            self._count(objects_lent=len(held))

            def give_back() -> None:
                for obj in held:
                    obj.ref_count_down()
            return give_back

        try:
            tiers = self.store.get_into([self._key(k) for k in keys[:len(objs)]], [o.byte_array for o in objs],
                                        keep_on_miss=False, lend=lend)
        except BaseException:
            for i, obj in enumerate(objs):
                if i not in lent:
                    obj.ref_count_down()
            raise
        for i, (obj, tier) in enumerate(zip(objs, tiers, strict=True)):
            if tier is not None:
                got[i] = obj
            elif i not in lent:
                obj.ref_count_down()
        hits = sum(g is not None for g in got)
        self._count(chunks_got=hits, chunks_missed=len(keys) - hits, gets_no_memory=len(keys) - len(objs))
        return got

    def get_blocking(self, key: Any) -> Any:
        return self.batched_get_blocking([key])[0]

    def get_non_blocking(self, key: Any, location: str | None = None) -> Future[Any]:
        return self._reader.submit(self.get_blocking, key)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any], transfer_spec: Any = None) -> list[Any]:
        """The leading run of ``keys`` that could be read (a prefetch's chunks; the others released)."""
        got = await asyncio.wrap_future(self._reader.submit(self.batched_get_blocking, keys))
        out: list[Any] = []
        for obj in got:
            if obj is None:
                break
            out.append(obj)
        for obj in got[len(out):]:
            if obj is not None:
                obj.ref_count_down()
        for key in keys:
            self.unpin(key)
        return out

    # -- pins and removal -------------------------------------------------------------------------------------
    def pin(self, key: Any) -> bool:
        with self._lock:
            self._pins[key] += 1
        return True

    def unpin(self, key: Any) -> bool:
        with self._lock:
            if not self._pins[key]:
                self._pins.pop(key, None)
                return False
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
        return True

    def remove(self, key: Any, force: bool = True) -> bool:
        """Remove the chunk from every tier of the store, unless it is pinned and ``force`` is False."""
        with self._lock:
            if self._pins[key] and not force:
                return False
            self._pins.pop(key, None)
        return self.store.evict([self._key(key)]) > 0

    def touch_cache(self) -> None:
        """Nothing to do: the shared tier's eviction follows each file's last read, which reads record."""

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    # -- state ------------------------------------------------------------------------------------------------
    def _count(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def stats(self) -> dict[str, Any]:
        """The plugin's counts (chunks put, got, missed, skipped for their size) and the store's
        :meth:`~sfstore.kvcache.store.KVCacheStore.stats`."""
        with self._lock:
            own = dict(self._counts)
        return {"plugin": own, "store": self.store.stats()}

    def wait_for_puts(self, timeout: float | None = None) -> None:
        """Wait until every chunk handed to a put so far is stored (or its put failed and was counted)."""
        with self._lock:
            pending, self._puts = self._puts, []
        _done, not_done = wait(pending, timeout)
        if not_done:
            with self._lock:
                self._puts = list(not_done) + self._puts
            raise errors.IOTimeoutError(f"sfstore's LMCache plugin: {len(not_done)} puts still running after "
                                        f"{timeout} s")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self.store.close()

