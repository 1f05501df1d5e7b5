"""sfstore's KV tiers as an SGLang HiCache storage backend (L3): pages of SGLang's host pool stored, verified and
shared through them.

SGLang (0.5.x) builds a third-party backend from its launch flags; this module is one::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "sfstore",
            "module_path": "sfstore.kvcache.sglang", "class_name": "SfstoreHiCacheStorage", "interface_v1": 1,
            "shared_dir": "/mnt/nfs-rdma/ai/kvcache/shared"}'

The other keys of the extra config are options of the store (:mod:`~sfstore.kvcache.engine_options`:
``sfstore_config``, ``shared_dir``, ``fsync_shared``, ``pinned_bytes``, ``shared_bytes``, ``cache_namespace``,
``io_timeout_ms``, ``quarantine_ms``) or ``model_id`` (default: SGLang's model name); unknown keys are warned of.
SGLang's host pool is the memory tier above this one, so the store has no pinned tier unless ``pinned_bytes`` asks
for one, and a page is a storage unit of its own (``chunk_tokens`` 0): SGLang's ``--page-size`` sizes it.

With ``interface_v1`` (SGLang's zero-copy interface), a batch of pages is read straight into the host pool's
memory and written straight from it, each page's K and V halves (one part for MLA) a block of the store, verified
on every read. A page hits only when all its parts do; :meth:`SfstoreHiCacheStorage.batch_exists` answers the
leading run of hits, as SGLang asks. Without it, SGLang's generic calls (``batch_get``/``batch_set`` of flat page
tensors) store the same parts.

Keys: SGLang's page hash (a chain over the page's tokens, seeded by the request's ``extra_key`` and ``cache_salt``
since SGLang 0.5.23: tenants with different salts never compute the same hash) hashed with the store's namespace
(model id, ``cache_namespace``), the host pool's layout and geometry, and the rank's shard: tensor-parallel
rank and size (MHA: each rank holds its own heads; MLA: replicated, one copy for all ranks, written by SGLang's
storage writer only), pipeline and context-parallel ranks, decode-context-parallel shard. SGLang passes no salt
to a backend's calls: the salt reaches the store only inside the hash.

Layouts: ``page_first``, ``page_first_direct`` and ``page_head`` (two contiguous parts per page); MLA pools (one).
SGLang's default ``layer_first`` puts each page in two parts per layer, so the zero-copy interface refuses it with
:class:`~sfstore.errors.ConfigError` (``--hicache-mem-layout page_first``); SGLang's zero-copy backends ask the
same.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from sfstore._optional import require

require("sglang.srt.mem_cache.hicache_storage", "sglang", "sfstore's SGLang HiCache backend (sfstore.kvcache.sglang)")

import torch  # noqa: E402  (SGLang's own dependency)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402

from sfstore import errors  # noqa: E402
from sfstore.kvcache.engine_options import STORE_KEYS, open_store  # noqa: E402
from sfstore.kvcache.geometry import KVGeometry, dtype_name  # noqa: E402
from sfstore.kvcache.store import KVCacheStore  # noqa: E402

__all__ = ["SfstoreHiCacheStorage", "SGLANG_KEYS"]

log = logging.getLogger(__name__)

#: SGLang's own keys of the extra config (read by its factory and cache controller, not by the store)
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_KEYS = frozenset({"model_id", *STORE_KEYS})
_WHERE = "SGLang's --hicache-storage-backend-extra-config"
#: layouts whose pages are at most two contiguous parts (K, V) in the host pool
_ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct", "page_head")


def _options(config: HiCacheStorageConfig) -> dict[str, Any]:
    extra = dict(config.extra_config or {})
    for name in sorted(set(extra) - _KEYS - SGLANG_KEYS):
        log.warning("sfstore's SGLang backend: extra config key %r is not one it reads; ignored (it reads %s)",
                    name, ", ".join(sorted(_KEYS)))
    return {k: v for k, v in extra.items() if k in _KEYS}


def _shard(config: HiCacheStorageConfig) -> str:
    """What of the model this rank holds: its tensor-parallel shard (MHA; MLA is replicated), pipeline stage,
    context-parallel and decode-context-parallel shards."""
    parts = [] if config.is_mla_model else [f"tp{config.tp_rank}/{config.tp_size}"]
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    if config.dcp_size > 1:
        parts.append(f"dcp{config.dcp_rank}/{config.dcp_size}/tp{config.tp_size}/page{config.logical_page_size}")
    return ",".join(parts) or "all"


class SfstoreHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's HiCache L3 over a :class:`~sfstore.kvcache.store.KVCacheStore` (see the module).

    SGLang's backend factory builds it (``dynamic``) with its storage config; the store opens when SGLang
    registers its host pool (the pool gives the page's size and layout).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config = storage_config
        self.options = _options(storage_config)
        self.zero_copy = bool(int((storage_config.extra_config or {}).get("interface_v1", 0) or 0))
        self.shard = _shard(storage_config)
        self.writer = bool(storage_config.is_storage_writer)
        self.store: KVCacheStore | None = None
        self.parts = 0  # blocks per page
        self._prefix = b""
        self._bytes: Any = None  # the host pool's memory as bytes (numpy uint8)
        self._base = 0

    # -- the host pool --------------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for the host pool's pages: their size, layout and parts decide the geometry."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        layout = str(getattr(pool, "layout", "?"))
        page = int(pool.page_size)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page))
        self.parts = len(ptrs)
        if self.zero_copy and (self.parts > 2 or layout not in _ZERO_COPY_LAYOUTS):
            raise errors.ConfigError(
                f"sfstore's SGLang backend moves whole pages in place: the host pool's layout {layout!r} puts a page "
                f"in {self.parts} parts; launch with --hicache-mem-layout page_first (or page_first_direct, "
                "page_head)")
        if len(set(sizes)) != 1:
            raise errors.ConfigError(f"sfstore's SGLang backend: a page's parts differ in size ({sorted(set(sizes))})")
        part = int(sizes[0])
        dtype = pool.dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        layers = int(pool.layer_num)
        heads = int(getattr(pool, "head_num", 1) or 1)
        width = part // (layers * page * heads * itemsize) if part % (layers * page * heads * itemsize) == 0 else 0
        if not width:  # a pool of another shape: the part as one head of its bytes
            heads, width = 1, part // (layers * page * itemsize)
        geometry = KVGeometry(num_layers=layers, block_tokens=page, num_kv_heads=heads, head_dim=width,
                              dtype=dtype_name(dtype), kv=1)
        if geometry.block_bytes != part:
            raise errors.ConfigError(f"sfstore's SGLang backend: a page part of {part} bytes is not a whole number "
                                     f"of {layers} layers x {page} tokens of {dtype}")
        opts = dict(self.options)
        model = str(opts.pop("model_id", None) or self.config.model_name or "sglang")
        store = open_store(geometry, model_id=model, extra=opts, where=_WHERE,
                           **{k: 0 for k in ("pinned_bytes", "chunk_tokens") if k not in opts})
        buf = pool.kv_buffer
        self._bytes = buf.view(-1).view(torch.uint8).numpy() if buf.device.type == "cpu" else None
        self._base = int(buf.data_ptr())
        self._prefix = store.namespace + f"\0sglang\0{layout}\0{self.shard}\0".encode()
        if self.store is not None:
            self.store.close()
        self.store = store

    def _need(self) -> KVCacheStore:
        if self.store is None:
            raise errors.ConfigError("sfstore's SGLang backend has no host pool yet (SGLang registers it when it "
                                     "attaches the backend)")
        return self.store

    # -- keys -----------------------------------------------------------------------------------------------------
    def _keys(self, key: str) -> list[bytes]:
        """The store's keys of page ``key``'s parts."""
        out = []
        for part in range(self.parts):
            h = hashlib.blake2b(digest_size=32)
            h.update(self._prefix)
            h.update(f"{key}\0{part}".encode())
            out.append(h.digest())
        return out

    def _all_keys(self, keys: Sequence[str]) -> list[bytes]:
        return [k for key in keys for k in self._keys(key)]

    def _views(self, host_indices: torch.Tensor, pages: int) -> list[memoryview]:
        """The parts of ``pages`` pages of the host pool at ``host_indices`` (token indices, a page's worth each),
        as views of its memory (in place: nothing is copied)."""
        if self._bytes is None:
            raise errors.InvalidRequestError("sfstore's SGLang backend reads and writes a host pool in CPU memory")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices[:pages * self.mem_pool_host.page_size])
        if len(ptrs) != pages * self.parts:
            raise errors.InvalidRequestError(f"{pages} pages have {len(ptrs)} parts in the host pool, expected "
                                             f"{pages * self.parts}")
        views = []
        end = len(self._bytes)
        for ptr, size in zip(ptrs, sizes, strict=True):
            off = int(ptr) - self._base
            if off < 0 or off + int(size) > end:
                raise errors.InvalidRequestError(f"a page part at offset {off} ({size} bytes) is outside the host "
                                                 f"pool ({end} bytes)")
            views.append(memoryview(self._bytes[off:off + int(size)]))
        return views

    def _pages_whole(self, per_part: Sequence[bool], pages: int) -> list[bool]:
        """Per page, whether every one of its parts is (``per_part``: the store's answer per part, in order)."""
        return [all(per_part[i * self.parts:(i + 1) * self.parts]) for i in range(pages)]

    # -- the zero-copy interface (interface_v1) -------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (every part of each page)."""
        if not keys:
            return 0
        whole = self._pages_whole(self._need().contains_many(self._all_keys(keys)), len(keys))
        return whole.index(False) if False in whole else len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read the pages into the host pool at ``host_indices``, each verified there; ``False`` for a page not
        (completely) stored, damaged, or past the store's deadline."""
        if not keys:
            return []
        got = self._need().get_into(self._all_keys(keys), self._views(host_indices, len(keys)), keep_on_miss=False)
        return self._pages_whole([t is not None for t in got], len(keys))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Write the pages at ``host_indices`` straight from the host pool; ``True`` for each page stored (an MLA
        rank that is not SGLang's storage writer stores nothing and answers ``True``: the writer stores the same
        bytes)."""
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)
        store = self._need()
        all_keys = self._all_keys(keys)
        try:
            store.put(all_keys, self._views(host_indices, len(keys)))
        except errors.SfstoreError as exc:
            log.warning("sfstore's SGLang backend: a write of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return self._pages_whole(store.contains_many(all_keys), len(keys))

    # -- the generic interface (flat page tensors) ----------------------------------------------------------------
    def _page_views(self, value: torch.Tensor) -> list[memoryview]:
        """The parts of a flat page tensor, as views of its memory (a read lands in the tensor itself)."""
        if value.device.type != "cpu" or not value.is_contiguous():
            raise errors.InvalidRequestError("sfstore's SGLang backend takes pages as contiguous CPU tensors")
        flat: Any = value.view(-1).view(torch.uint8).numpy()
        part = len(flat) // self.parts
        if part * self.parts != len(flat) or part != self._need().geometry.block_bytes:
            raise errors.InvalidRequestError(f"a page of {len(flat)} bytes is not {self.parts} parts of "
                                             f"{self._need().geometry.block_bytes}")
        return [memoryview(flat[i * part:(i + 1) * part]) for i in range(self.parts)]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Read each page into its flat tensor in ``target_locations``; the tensor, or ``None`` for a miss."""
        if not keys:
            return []
        if target_locations is None or any(t is None for t in target_locations):
            raise errors.InvalidRequestError("sfstore's SGLang backend reads into the page tensors SGLang passes")
        views = [v for t in target_locations for v in self._page_views(t)]
        got = self._need().get_into(self._all_keys(keys), views, keep_on_miss=False)
        whole = self._pages_whole([g is not None for g in got], len(keys))
        return [t if ok else None for t, ok in zip(target_locations, whole, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each flat page tensor of ``values``; True when every page is stored."""
        if not keys:
            return True
        if not self.writer:
            return True
        store = self._need()
        all_keys = self._all_keys(keys)
        try:
            store.put(all_keys, [v for t in values for v in self._page_views(t)])
        except errors.SfstoreError as exc:
            log.warning("sfstore's SGLang backend: a write of %d pages failed: %s", len(keys), exc)
            return False
        return all(store.contains_many(all_keys))

    # -- state ----------------------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Nothing: the shared tier is shared with other processes and nodes (its budget evicts); ``sfstore kv``
        removes a namespace."""

    def get_stats(self) -> dict[str, Any] | None:
        return None if self.store is None else self.store.stats()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
