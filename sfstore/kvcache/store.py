"""``KVCacheStore``: offload KV-cache blocks to pinned memory, the hot block store and a shared directory.

Keys are chained prefix hashes of token blocks (:meth:`KVCacheStore.keys_for`). A put copies each block once
into a pinned slot (the only copy the caller waits for with :meth:`~KVCacheStore.put_async`) and writes it
through to the lower tiers: the block store (NVMe over RDMA on a cluster) and the shared directory (NFS over
RDMA: other processes and nodes, e.g. prefill and decode servers, read what one wrote). A get takes each block
from the highest tier that has it and promotes it to the tiers above.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sfstore import defaults, errors
from sfstore.arguments import as_batch, check_timeout
from sfstore.blocks import BlockStore
from sfstore.buffers import as_buffer, copy_from_host, copy_to_host, is_device_buffer
from sfstore.counters import Counters
from sfstore.futures import DoneFuture, ExecutorFuture
from sfstore.futures import Future as SfFuture
from sfstore.kvcache.block_tier import BlockKVTier
from sfstore.kvcache.chains import KeyChains
from sfstore.kvcache.deadline import TierGuard
from sfstore.kvcache.geometry import KEY_BYTES, KVGeometry, chained_keys
from sfstore.kvcache.held import HeldBlocks, LayerLoad
from sfstore.kvcache.load_or_recompute import LoadOrRecompute
from sfstore.kvcache.shared_budget import check_namespace
from sfstore.kvcache.tier import KVBatch, KVTier, ReadStatus, TierName
from sfstore.kvcache.tiers import Lease, PinnedTier, SharedTier, Slot, release_all
from sfstore.paths.file import FilePath

if TYPE_CHECKING:
    from sfstore.paths.device import DevicePath
    from sfstore.router import Router

__all__ = ["KVCacheStore", "TIERS"]

TIERS: tuple[TierName, ...] = ("pinned", "block", "shared")
_COUNTERS = (
    "puts", "gets", "misses", "hits_pinned", "hits_block", "hits_shared", "promotions", "evictions",
    "bytes_put", "bytes_got", "bytes_device_staged", "corrupt_dropped", "unreadable", "lower_tier_errors",
    "puts_dropped", "loads_declined", "layers_copied_early",
)
_LATENCY_SAMPLES = 4096


# what numpy/cupy arrays may carry a geometry's dtype in: its own, or the unsigned int of its size where numpy
# has no such dtype (bfloat16, float8; ml_dtypes' arrays name theirs); uint8 bytes of a whole block always
_ARRAY_DTYPES = {
    "bfloat16": ("bfloat16", "uint16"),
    "float8_e4m3fn": ("float8_e4m3fn", "uint8"),
    "float8_e5m2": ("float8_e5m2", "uint8"),
}



def _bytes_or_setting(value: object, name: str, setting: str, zero: str) -> int:
    """A byte budget argument: ``value`` (an int >= 0), or the setting's when ``None``."""
    if value is None:
        return int(defaults.get(setting))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise errors.InvalidRequestError(f"KVCacheStore: {name} must be an int >= 0 ({zero}), not {value!r}")


def _percentile(samples: Sequence[float], q: float) -> float | None:
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


class KVCacheStore:
    """A tiered store of KV-cache blocks for one model geometry.

    Parameters
    ----------
    geometry : KVGeometry
        The model's KV geometry: every block is ``geometry.block_bytes`` laid out ``[layer][kv][token][head][dim]``.
    model_id : str
        Names the model (and anything else that changes the KV values: weights revision, dtype policy); part
        of every key, so two models never share blocks.
    pinned_bytes : int, optional
        Budget of the pinned host tier (default: the ``kvcache_pinned_bytes`` setting).
    block_store : BlockStore or None
        The hot tier: a :class:`~sfstore.blocks.BlockStore` whose largest class holds a block, or ``None``.
        :meth:`from_router` takes the router's.
    shared_dir : str or os.PathLike, optional
        The shared tier's directory (``None``: no shared tier).
    fsync_shared : bool
        fsync each shared file before publishing it (durable across a node crash, slower).
    shared_on : FilePath, optional
        Makes ``shared_dir`` a directory under this file path (the router's ``kvcache`` path, so its counters
        include the shared tier's bytes).
    shared_bytes : int, optional
        Budget of the shared tier's namespace (default: the ``kvcache_shared_bytes`` setting; 0: unbounded),
        kept by every process and node that writes the directory: least recently read blocks are evicted
        beyond it (see :mod:`sfstore.kvcache.shared_budget`).
    cache_namespace : str, optional
        The shared tier's namespace (default: the ``kvcache_namespace`` setting; ``""``: the default one): its
        blocks live in their own subdirectory and never read or evict another namespace's.
    io_timeout_ms : int, optional
        Deadline of every block-store and shared-tier operation (default: the ``kvcache_io_timeout_ms``
        setting; 0: none). Past it a get is a miss and a put is dropped (``deadline_misses``, ``puts_dropped``),
        and the tier is quarantined: answered at once without I/O for a back-off (``quarantine_ms``, default
        the ``kvcache_quarantine_ms`` setting, doubling while it keeps missing, at most 64 times that), then
        probed. The caller never waits longer than the deadline: the I/O runs on the tier's own worker
        threads, and one stuck in a stalled mount is abandoned (see :mod:`sfstore.kvcache.deadline`).
        ``stats()["quarantine"]`` and :meth:`describe` report each tier's state.

    Notes
    -----
    Blocks are accepted as CPU or CUDA torch tensors, numpy or cupy arrays, or anything with the buffer
    protocol, of exactly ``block_bytes`` (tensors and arrays must also have the geometry's dtype and element
    count). Safe to use from several threads.

    GPU blocks: with a pinned tier they are copied into its slots (``bytes_device_staged``) and the lower tiers
    are written from there. Without one (``pinned_bytes=0``) they move through the device path
    (:class:`~sfstore.paths.device.DevicePath`): to and from the shared tier's files on the device path's
    route for them (``gds``: cuFile, HBM to storage with no host copy, the block's kvsum64 computed on the GPU;
    ``compat``: kvikio through its host buffers; ``staged``: sfstore's pinned buffers). The block store's
    slots hold xxh3-64 checksums of host bytes, so GPU blocks are staged through host memory for that tier
    (cuFile would refuse a raw NVMe or NVMe-oF namespace anyway). :meth:`describe` says which route each tier
    takes and why; ``stats()["device"]`` counts ``bytes_gpu_direct`` and ``bytes_staged`` per tier.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        *,
        model_id: str = "",
        pinned_bytes: int | None = None,
        block_store: BlockStore | str | None = None,
        shared_dir: str | os.PathLike[str] | None = None,
        fsync_shared: bool = False,
        shared_on: FilePath | None = None,
        device: DevicePath | None = None,
        shared_bytes: int | None = None,
        cache_namespace: str | None = None,
        io_timeout_ms: int | None = None,
        quarantine_ms: int | None = None,
        chunk_tokens: int | None = None,
    ) -> None:
        if not isinstance(geometry, KVGeometry):
            raise errors.InvalidRequestError(
                f"KVCacheStore: geometry must be a KVGeometry, not {type(geometry).__name__}"
            )
        if not isinstance(model_id, str):
            raise errors.InvalidRequestError(f"KVCacheStore: model_id must be a str, not {type(model_id).__name__}")
        budget = _bytes_or_setting(pinned_bytes, "pinned_bytes", "kvcache_pinned_bytes", "0: no pinned tier")
        try:
            namespace = model_id.encode() + b"\0" + geometry.fingerprint()
        except UnicodeEncodeError as exc:
            raise errors.InvalidRequestError(f"KVCacheStore: model_id must be valid unicode: {exc}") from None
        shared_budget = _bytes_or_setting(shared_bytes, "shared_bytes", "kvcache_shared_bytes", "0: unbounded")
        cache_ns = check_namespace(defaults.get("kvcache_namespace") if cache_namespace is None else cache_namespace)
        timeout_ms = int(defaults.get("kvcache_io_timeout_ms") if io_timeout_ms is None else
                         defaults.SETTINGS["kvcache_io_timeout_ms"].parse(io_timeout_ms, "KVCacheStore(io_timeout_ms)"))
        backoff_ms = int(defaults.get("kvcache_quarantine_ms") if quarantine_ms is None else
                         defaults.SETTINGS["kvcache_quarantine_ms"].parse(quarantine_ms, "KVCacheStore(quarantine_ms)"))
        chunk = int(defaults.get("kvcache_chunk_tokens") if chunk_tokens is None else
                    defaults.SETTINGS["kvcache_chunk_tokens"].parse(chunk_tokens, "KVCacheStore(chunk_tokens)"))
        if chunk % geometry.block_tokens:
            raise errors.ConfigError(
                f"kvcache_chunk_tokens={chunk} is not a multiple of the geometry's block_tokens "
                f"({geometry.block_tokens}): a chunk file holds whole blocks (e.g. "
                f"{max(1, chunk // geometry.block_tokens) * geometry.block_tokens}; 0: a file per block)"
            )
        if isinstance(block_store, str) or not (block_store is None or isinstance(block_store, BlockStore)):
            raise errors.ConfigError(f"block_store must be a BlockStore or None, not {block_store!r}")
        self.geometry = geometry
        self.model_id = model_id
        self.pinned = PinnedTier(geometry, budget)
        if block_store is not None and block_store.max_value_bytes < geometry.block_bytes:
            raise errors.ConfigError(
                f"the block store's largest size class ({block_store.max_value_bytes} bytes) cannot hold a KV block "
                f"of {geometry.block_bytes} bytes; open it with size_classes including {geometry.block_bytes}"
            )
        self.block: BlockStore | None = block_store
        self.cache_namespace = cache_ns
        self.chunk_tokens = chunk
        # the rates an engine's connector weighs a hit by: each tier's, measured by _load; the prefill's, by it
        self.load_or_recompute = LoadOrRecompute(enabled=bool(defaults.get("kvcache_load_or_recompute")))
        # the chains keys_for made: the shared tier finds the chunk file of a block from its key through them
        self.chains = KeyChains()
        self.shared = (SharedTier(geometry, shared_dir, fsync=fsync_shared, on=shared_on, namespace=cache_ns,
                                  budget_bytes=shared_budget, timeout_s=timeout_ms / 1000,
                                  quarantine_s=backoff_ms / 1000, chunk_blocks=chunk // geometry.block_tokens,
                                  chains=self.chains)
                       if shared_dir is not None else None)
        # the block store's calls run under a deadline of their own (its I/O may stall on a fabric too)
        self.block_tier = (BlockKVTier(block_store, geometry, timeout_s=timeout_ms / 1000,
                                       quarantine_s=backoff_ms / 1000) if block_store is not None else None)
        self.namespace = namespace
        self.counters = Counters(_COUNTERS)
        self._lat: dict[str, deque[float]] = {op: deque(maxlen=_LATENCY_SAMPLES) for op in ("put", "get")}
        self._lock = threading.Lock()
        self._partial: dict[bytes, tuple[Lease, set[int]]] = {}
        self._writes: list[Future[None]] = []
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sfstore-kvcache")
        self._preparing = False  # a prepare_pinned job is running
        self._closed = False
        if device is not None and getattr(device, "kind", None) != "device":
            raise errors.ConfigError(f"KVCacheStore: device must be a DevicePath or None, not {device!r}")
        self._device = device
        self._owns_device = False

    @classmethod
    def from_router(
        cls, geometry: KVGeometry, router: Router | None = None, *, model_id: str = "", **kwargs: Any
    ) -> KVCacheStore:
        """A store over the tiers ``sfstore.open()`` (or ``router``) routes to: the ``hot`` class's block store
        (when its largest size class holds a block; a new image-file store gets one class of the block's size)
        and a ``shared`` directory under the ``kvcache`` class's root. ``kwargs`` go to the constructor."""
        from sfstore.paths.block import BlockPath
        from sfstore.paths.device import DevicePath

        if router is None:
            import sfstore

            router = sfstore.open()
        block: BlockStore | None = None
        if isinstance(router.path("hot"), BlockPath):
            try:
                block = BlockStore.from_router(router, "hot", size_classes=(geometry.block_bytes,))
            except errors.ConfigError:  # an existing store formatted with other classes: use it as it is
                block = BlockStore.from_router(router, "hot")
            if block.max_value_bytes < geometry.block_bytes:
                block = None  # an existing store with smaller classes: the tier is skipped (stats() shows it)
        kv_path = router.require_writable("kvcache")  # a read-only root: say which setting to change, up front
        if isinstance(kv_path, DevicePath):  # the shared files live under the device path's own file path
            fp = kv_path.fp
            kwargs.setdefault("device", kv_path)
        elif isinstance(kv_path, FilePath):
            fp = kv_path
        else:
            raise errors.ConfigError(f"the kvcache class is served by the {kv_path.kind} path: it needs files")
        return cls(geometry, model_id=model_id, block_store=block, shared_dir="shared", shared_on=fp, **kwargs)

    # -- keys -------------------------------------------------------------------------------------------------
    def keys_for(self, token_ids: Sequence[int] | Any, extra: Iterable[object] = ()) -> list[bytes]:
        """One chained key per full block of ``token_ids`` (see :func:`~sfstore.kvcache.geometry.chained_keys`).

        The store notes the chain, so that the shared tier stores and finds these blocks in chunk files
        (``kvcache_chunk_tokens``); blocks of keys made elsewhere are stored a file per block."""
        keys = chained_keys(token_ids, self.geometry.block_tokens, self.namespace, extra)
        self.chains.add(keys)
        return keys

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        out = []
        for k in as_batch(keys, "keys"):
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise errors.InvalidKeyError(
                    f"a KV block key is {KEY_BYTES} bytes (from keys_for), not {type(k).__name__} "
                    f"of length {len(k) if hasattr(k, '__len__') else '?'}"
                )
            out.append(bytes(k))
        return out

    def contains(self, key: bytes) -> bool:
        """Whether any tier has the block."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`contains` of each key: each tier is asked, highest first, about the keys the tiers above lack,
        in one operation per tier (the shared tier's under one deadline: past it, or while it is quarantined,
        those answer ``False``)."""
        self._check_open()
        ks = self._check_keys(keys)
        out = [False] * len(ks)
        for tier in (self.pinned, *self.lower):
            need = [i for i, found in enumerate(out) if not found]
            if not need:
                break
            for i, found in zip(need, tier.present([ks[i] for i in need]), strict=True):
                out[i] = found
        return out

    def lookup(self, token_ids: Sequence[int] | Any, extra: Iterable[object] = ()) -> int:
        """How many leading tokens of ``token_ids`` have their KV blocks in some tier (a multiple of
        ``block_tokens``): the prefix an engine can load instead of computing."""
        self._check_open()
        return self.leading_stored(self.keys_for(token_ids, extra)) * self.geometry.block_tokens

    def leading_stored(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, have their blocks in some tier (:meth:`lookup` of keys an engine
        made already with :meth:`keys_for`)."""
        self._check_open()
        keys = self._check_keys(keys)
        # Tiers that answer from memory are asked of every key still needed; a tier that does I/O only of the
        # leading ones, in one operation (one deadline, one handoff to its workers), stopping at its first miss.
        need = list(range(len(keys)))
        for tier in (self.pinned, *self.lower):
            if not need:
                break
            if tier.in_memory:
                need = [i for i, found in zip(need, tier.present([keys[i] for i in need]), strict=True) if not found]
            else:
                need = need[tier.leading_present([keys[i] for i in need]):]
        return need[0] if need else len(keys)

    # -- blocks in and out --------------------------------------------------------------------------------------
    def _source(self, block: Any, what: str, writable: bool = False) -> tuple[Any, bool]:
        """``(object to copy from or to, is on a GPU)`` after checking ``block`` against the geometry.

        A block is a torch tensor of the geometry's dtype, of ``block_shape`` (any strides) or flat; a numpy or
        cupy array of the geometry's dtype (``uint16`` carries bfloat16 bits and ``uint8`` float8 bits, which
        numpy lacks) of ``block_shape`` or flat, or ``uint8`` of ``block_bytes``; or any other contiguous
        buffer of exactly ``block_bytes``. ``writable``: a destination (read-only memory is refused).
        """
        g = self.geometry
        mod = type(block).__module__ or ""
        if mod.startswith("torch") and hasattr(block, "device") and hasattr(block, "dtype"):
            dtype = str(block.dtype).replace("torch.", "")
            shape = tuple(block.shape)
            if block.device.type not in ("cpu", "cuda"):
                raise errors.InvalidRequestError(
                    f"{what}: a tensor on the {block.device.type} device; blocks are CPU or CUDA tensors"
                )
            if str(getattr(block, "layout", "torch.strided")) != "torch.strided":
                raise errors.InvalidRequestError(
                    f"{what}: a {block.layout} tensor; blocks are dense (strided) tensors of {g.block_shape} {g.dtype}"
                )
            if dtype != g.dtype:
                raise errors.InvalidRequestError(
                    f"{what}: dtype {dtype} {shape}, but the geometry's dtype is {g.dtype} {g.block_shape}"
                )
            if shape != g.block_shape and shape != (g.block_elements,):
                raise self._shape_error(what, shape, dtype, block.numel() * block.element_size())
            return block, block.device.type == "cuda"
        if hasattr(block, "dtype") and hasattr(block, "shape") and (
                mod.startswith(("numpy", "cupy")) or hasattr(block, "__cuda_array_interface__")
                or self._is_device(block)):
            dtype = str(block.dtype)
            shape = tuple(block.shape)
            carriers = _ARRAY_DTYPES.get(g.dtype, (g.dtype,))
            if dtype not in carriers and dtype != "uint8":
                raise errors.InvalidRequestError(
                    f"{what}: array dtype {dtype}, but the geometry's dtype is {g.dtype} (arrays: "
                    f"{' or '.join(dict.fromkeys((*carriers, 'uint8')))} bytes)"
                )
            nbytes = int(block.nbytes)
            flat = (g.block_bytes // int(block.dtype.itemsize),)
            if nbytes != g.block_bytes or (shape != flat and (block.dtype.itemsize != g.itemsize
                                                              or shape != g.block_shape)):
                raise self._shape_error(what, shape, dtype, nbytes)
            flags = getattr(block, "flags", None)
            if flags is not None and not flags.c_contiguous:
                raise errors.InvalidRequestError(f"{what}: the array is not contiguous (copy it, or pass a tensor)")
            if writable and flags is not None and not getattr(flags, "writeable", True):  # cupy's flags lack it
                raise errors.ReadOnlyBufferError(f"{what}: the destination array is read-only")
            return block, self._is_device(block)
        if is_device_buffer(block):
            raise errors.InvalidRequestError(
                f"{what}: a GPU {type(block).__name__} is not a block (pass a CUDA torch tensor or a cupy array)"
            )
        try:
            mv = memoryview(as_buffer(block))
        except TypeError:
            raise errors.InvalidRequestError(
                f"{what}: a {type(block).__name__} is not a block (a tensor, an array or a buffer of "
                f"{g.block_bytes} bytes)"
            ) from None
        if not mv.c_contiguous:
            raise errors.InvalidRequestError(f"{what}: the buffer is not contiguous")
        if mv.nbytes != g.block_bytes:
            raise errors.InvalidRequestError(
                f"{what}: {mv.nbytes} bytes, but a block of {g.block_shape} {g.dtype} is {g.block_bytes} bytes"
            )
        if writable and mv.readonly:
            raise errors.ReadOnlyBufferError(f"{what}: the destination buffer is read-only")
        return block, False

    def _shape_error(self, what: str, shape: tuple[int, ...], dtype: str, nbytes: int) -> errors.InvalidRequestError:
        g = self.geometry
        return errors.InvalidRequestError(
            f"{what}: shape {shape} {dtype} ({nbytes} bytes), but a block is {g.block_shape} {g.dtype} "
            f"({g.block_bytes} bytes), or flat ({g.block_elements},)"
        )

    def _copy_in(self, slot: Slot, block: Any, device: bool, offset: int = 0, nbytes: int | None = None) -> None:
        n = self.geometry.block_bytes if nbytes is None else nbytes
        dst = slot.data(self.geometry.block_bytes)[offset:offset + n]
        if device or (type(block).__module__ or "").startswith("torch"):
            copy_to_host(block, 0, dst)
            if device:
                self.counters.add(bytes_device_staged=n)
            return
        dst[:] = memoryview(as_buffer(block)).cast("B")

    def _copy_out_batch(self, pairs: list[tuple[Slot, Any]], offset: int, nbytes: int) -> bool:
        """Copy ``[offset, offset + nbytes)`` of each slot into its destination in one call when every destination
        is a CPU torch tensor (an engine's per-layer load: one call instead of one per block, the copies done
        without the interpreter between them); ``False`` (nothing copied) otherwise."""
        if len(pairs) < 2 or not all((type(d).__module__ or "").startswith("torch") for _s, d in pairs):
            return False
        import torch

        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is None or any(d.device.type != "cpu" or d.nbytes != nbytes for _s, d in pairs):
            return False
        dsts, srcs = [], []
        for slot, d in pairs:
            flat = slot.tensor
            if flat is None:
                flat = slot.tensor = torch.frombuffer(slot.buffer, dtype=torch.uint8, count=self.geometry.block_bytes)
            src = flat[offset:offset + nbytes]
            if d.is_contiguous():
                dsts.append(d.view(-1).view(torch.uint8))
                srcs.append(src)
            else:
                dsts.append(d)
                srcs.append(src.view(d.dtype).view(d.shape))
        with torch.no_grad():  # a destination that requires grad is still just memory to fill
            foreach(dsts, srcs)
        return True

    def _copy_out(self, slot: Slot, block: Any, offset: int = 0, nbytes: int | None = None) -> None:
        n = self.geometry.block_bytes if nbytes is None else nbytes
        src = slot.data(self.geometry.block_bytes)[offset:offset + n]
        device = self._is_device(block)
        if device or (type(block).__module__ or "").startswith("torch"):
            copy_from_host(block, 0, src)
            if device:
                self.counters.add(bytes_device_staged=n)
            return
        mv = memoryview(as_buffer(block))
        if mv.readonly:
            raise errors.ReadOnlyBufferError("get_into: a destination block is read-only")
        mv.cast("B")[:] = src

    # -- put --------------------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> None:
        """Store ``blocks`` under ``keys`` in every tier (pinned, then written through to the lower ones).

        Without a pinned tier (``pinned_bytes=0``), host blocks go to the lower tiers straight from the caller's
        memory (no copy: aligned blocks move with O_DIRECT).
        """
        ks, sources = self._put_args(keys, blocks)
        if self._uses_device(sources):
            self._put_device(ks, [b for b, _ in sources])
            return
        views = self._direct_views(sources)
        if views is None:
            self._stage(ks, sources).get()
            return
        with self._lower_tier_put(len(ks)):
            self._write_through(ks, KVBatch("host", views))

    def _write_through(self, keys: list[bytes], srcs: KVBatch) -> None:
        """Write the blocks to every lower tier, highest first (the checksum one tier computed is passed to the
        next); count the dropped writes in ``puts_dropped``."""
        for tier in self.lower:
            extra: list[Lease] = []
            ks, batch = keys, srcs
            if tier is self.shared and srcs.kind == "slots":
                ks, batch, extra = self._with_chunk_heads(keys, srcs)
            try:
                self.counters.add(puts_dropped=tier.write(ks, batch).count("dropped"))
            finally:
                release_all(extra)

    def _with_chunk_heads(self, keys: list[bytes], srcs: KVBatch) -> tuple[list[bytes], KVBatch, list[Lease]]:
        """A batch of slots for the shared tier's chunk files, completed with the earlier blocks of each chunk it
        starts inside of, leased from the pinned tier where it holds them (a prompt saved over several steps: a
        step's blocks begin inside a chunk whose first blocks an earlier step saved). Returns the keys, the batch
        and the leases taken (the caller's to release)."""
        if self.shared is None or self.shared.chunks is None:
            return keys, srcs, []
        per = self.shared.chunks.per_chunk
        have = set(keys)
        more_keys: list[bytes] = []
        more: list[Lease] = []
        try:
            for k in keys:
                at = self.chains.locate(k)
                if at is None:
                    continue
                chain, pos = at
                for q in range(pos - pos % per, pos):
                    if chain[q] in have:
                        continue
                    lease = self.pinned.lease(chain[q])
                    if lease is None:
                        break  # the chunk cannot be completed: the shared tier stores its blocks as block files
                    have.add(chain[q])
                    more_keys.append(chain[q])
                    more.append(lease)
        except BaseException:
            release_all(more)
            raise
        if not more:
            return keys, srcs, []
        batch = KVBatch("slots", list(srcs.items) + more, checksums=list(srcs.checksums) + [None] * len(more))
        return keys + more_keys, batch, more

    @contextlib.contextmanager
    def _lower_tier_put(self, count: int) -> Iterator[None]:
        """A put of ``count`` blocks straight to the lower tiers: counted (an error as ``lower_tier_errors``) and
        timed as the put latency."""
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            self.counters.add(lower_tier_errors=1)
            raise
        self.counters.add(puts=count, bytes_put=self.geometry.block_bytes * count)
        self._lat["put"].append(time.perf_counter() - t0)

    def _put_args(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> tuple[list[bytes], list[tuple[Any, bool]]]:
        """The checked keys and ``(block, on a GPU)`` of a put."""
        self._check_open()
        ks = self._check_keys(keys)
        bs = as_batch(blocks, "put: blocks")
        if len(ks) != len(bs):
            raise errors.InvalidRequestError(f"put: {len(ks)} keys but {len(bs)} blocks")
        return ks, [self._source(b, f"put: block {i}") for i, b in enumerate(bs)]

    def _direct_views(self, sources: list[tuple[Any, bool]]) -> list[memoryview] | None:
        """Byte views of the (checked) blocks when they can move without the pinned tier: there is none, and every
        block is contiguous host memory; else ``None`` (the staged path)."""
        if self.pinned.capacity > 0 or (self.block is None and self.shared is None):
            return None
        views = []
        for src, device in sources:
            if device:
                return None
            try:
                mv = memoryview(as_buffer(src))
            except TypeError:
                return None
            if not mv.c_contiguous:
                return None
            views.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
        return views

    def put_async(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> ExecutorFuture[None]:
        """Copy ``blocks`` into pinned slots, return, and write them to the lower tiers in the background.

        The caller may reuse the blocks' memory as soon as this returns; ``.get()`` on the result waits until
        every lower tier has them (and raises the first error). GPU blocks without a pinned tier are the
        exception: they move HBM to storage in the background, so their memory must stay as it is until
        ``.get()`` (or :meth:`wait_for_puts`) returns.
        """
        ks, sources = self._put_args(keys, blocks)
        if self._uses_device(sources):
            fut = self._executor.submit(self._put_device, ks, [b for b, _ in sources])
            with self._lock:
                self._writes = [w for w in self._writes if not w.done()] + [fut]
            return ExecutorFuture(fut, "put_async")
        return self._stage(ks, sources)

    def _stage(self, ks: list[bytes], sources: list[tuple[Any, bool]]) -> ExecutorFuture[None]:
        """Copy the (checked) blocks into pinned slots and commit them (lower tiers written in the background)."""
        t0 = time.perf_counter()
        leased: list[tuple[bytes, Lease]] = []
        try:
            for k, (src, device) in zip(ks, sources, strict=True):
                lease = self.pinned.take()
                leased.append((k, lease))
                self._copy_in(lease.slot, src, device)
        except BaseException:
            release_all(lease for _k, lease in leased)
            raise
        return self._commit(leased, t0)

    def _commit(self, leased: list[tuple[bytes, Lease]], t0: float) -> ExecutorFuture[None]:
        n = self.geometry.block_bytes
        for k, lease in leased:
            self.pinned.insert(k, lease, 0)  # take()'s lease stays out: the lower-tier writes read the slot
        self.counters.add(puts=len(leased), bytes_put=n * len(leased))
        fut = self._executor.submit(self._write_lower, leased, t0)
        with self._lock:
            self._writes = [w for w in self._writes if not w.done()] + [fut]
        return ExecutorFuture(fut)

    def _write_lower(self, leased: list[tuple[bytes, Lease]], t0: float) -> None:
        """Write the leased slots' blocks to the lower tiers, then release the leases."""
        try:
            self._write_through([k for k, _ in leased], KVBatch("slots", [lease for _k, lease in leased]))
        except BaseException:
            self.counters.add(lower_tier_errors=1)
            raise
        finally:
            release_all(lease for _k, lease in leased)
            self._lat["put"].append(time.perf_counter() - t0)

    def wait_for_puts(self, timeout: float | None = None) -> None:
        """Wait until every block put so far reached its lower tiers; raise the first error.

        Raises :class:`~sfstore.errors.IOTimeoutError` when they had not after ``timeout`` seconds (the writes
        go on; a later call waits for them again).
        """
        timeout = check_timeout(timeout, "wait_for_puts")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending, self._writes = self._writes, []
        try:
            for i, f in enumerate(pending):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    f.result(left)
                except TimeoutError:
                    if f.done():
                        raise
                    with self._lock:
                        self._writes = pending[i:] + self._writes
                    pending = []
                    raise errors.IOTimeoutError(
                        f"wait_for_puts: the lower-tier writes had not finished after {timeout} s"
                    ) from None
        finally:
            if pending:  # an error: the writes not waited for yet stay pending for the next call or close()
                with self._lock:
                    self._writes = [w for w in pending if not w.done()] + self._writes

    # -- per layer --------------------------------------------------------------------------------------------
    def put_layer(self, keys: Sequence[bytes], layer: int, tensors: Sequence[Any]) -> None:
        """Store layer ``layer`` of each block (tensors of ``geometry.layer_shape``, CPU or CUDA, any strides).

        A block is committed (pinned, then written to the lower tiers in the background) once all its layers
        are in; :meth:`wait_for_puts` waits for those writes.
        """
        g = self.geometry
        ks = self._layer_args("put_layer", keys, layer, tensors)
        done: list[tuple[bytes, Lease]] = []
        for k, t in zip(ks, list(tensors), strict=True):
            with self._lock:
                lease, layers = self._partial.get(k) or (None, set())
                if lease is None:
                    lease = self.pinned.take()
                    self._partial[k] = (lease, layers)
            self._copy_in(lease.slot, t, is_device_buffer(t), layer * g.layer_bytes, g.layer_bytes)
            with self._lock:
                layers.add(layer)
                if len(layers) == g.num_layers:
                    del self._partial[k]
                    done.append((k, lease))
        if done:
            self._commit(done, time.perf_counter())

    def discard_partial(self, keys: Sequence[bytes] | None = None) -> int:
        """Drop blocks whose layers :meth:`put_layer` received only in part (all of them when ``keys`` is None):
        for an engine whose step ended before every layer was saved. Returns how many were dropped."""
        with self._lock:
            chosen = list(self._partial) if keys is None else [k for k in self._check_keys(keys) if k in self._partial]
            dropped = [self._partial.pop(k)[0] for k in chosen]
        release_all(dropped)
        return len(dropped)

    def _layer_args(self, op: str, keys: Sequence[bytes], layer: int, tensors: Sequence[Any]) -> list[bytes]:
        """The checked keys of a per-layer call, after checking the layer and every tensor (torch, the geometry's
        dtype, a layer's element count)."""
        self._check_open()
        g = self.geometry
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < g.num_layers:
            raise errors.InvalidRequestError(f"{op}: layer {layer!r} is not an int in [0, {g.num_layers})")
        ks = self._check_keys(keys)
        tensors = as_batch(tensors, f"{op}: tensors")
        if len(ks) != len(tensors):
            raise errors.InvalidRequestError(f"{op}: {len(ks)} keys but {len(tensors)} tensors")
        for i, t in enumerate(tensors):
            if not (type(t).__module__ or "").startswith("torch") or not hasattr(t, "device"):
                raise errors.InvalidRequestError(
                    f"{op}: tensor {i}: per-layer transfers take torch tensors, not {type(t).__name__}"
                )
            dtype = str(t.dtype).replace("torch.", "")
            if (dtype != g.dtype or t.numel() != g.layer_elements or t.device.type not in ("cpu", "cuda")
                    or str(getattr(t, "layout", "torch.strided")) != "torch.strided"):
                raise errors.InvalidRequestError(
                    f"{op}: tensor {i}: {tuple(t.shape)} {dtype} on {t.device.type}, but a layer of a block is "
                    f"{g.layer_shape} {g.dtype} (CPU or CUDA)"
                )
        return ks

    def get_layer_into(self, keys: Sequence[bytes], layer: int, tensors: Sequence[Any]) -> list[TierName | None]:
        """Copy layer ``layer`` of each block into ``tensors`` (``geometry.layer_shape``, any strides, CPU or
        CUDA); blocks not in the pinned tier are fetched first (call :meth:`prefetch` early to overlap)."""
        g = self.geometry
        ks = self._layer_args("get_layer_into", keys, layer, tensors)
        leases, tiers = self._fetch(ks, count=False)
        self._deliver(leases, list(tensors), layer * g.layer_bytes, g.layer_bytes)
        return tiers

    def _deliver(self, leases: list[Lease | None], dests: Sequence[Any], offset: int, nbytes: int) -> None:
        """Copy ``[offset, offset + nbytes)`` of each fetched block into its destination; release every lease."""
        try:
            pairs = [(lease.slot, d) for lease, d in zip(leases, dests, strict=True) if lease is not None]
            if not self._copy_out_batch(pairs, offset, nbytes):
                for slot, d in pairs:
                    self._copy_out(slot, d, offset, nbytes)
        finally:
            release_all(leases)

    # -- get --------------------------------------------------------------------------------------------------
    def get_into(
        self, keys: Sequence[bytes], blocks: Sequence[Any], *, keep_on_miss: bool = True,
        on_layer: Callable[[list[int], int], None] | None = None,
        lend: Callable[[list[int]], Callable[[], None]] | None = None,
    ) -> list[TierName | None]:
        """Copy each block into ``blocks`` (caller-owned, ``block_bytes`` each, CPU or CUDA); return for each key
        the tier it came from (``"pinned"``, ``"block"``, ``"shared"``) or ``None`` for a miss.

        A miss leaves its destination exactly as it was: a block reaches the caller's memory only once verified.
        A block that fails verification in a lower tier (counted in ``corrupt_dropped``) or cannot be read there
        (a directory, FIFO or symlink out of the shared directory at its name: ``unreadable``) is a miss for
        that key alone; the other keys of the batch are unaffected.

        Without a pinned tier, keeping that promise costs one host copy per block from the block store (it is
        read into a staging buffer, verified, then copied). ``keep_on_miss=False`` reads it straight into the
        destination instead (no copy; verified there): for callers that recompute a missed block anyway, whose
        destination may then hold the bytes that failed. Hits are verified either way.

        ``lend(indices)`` (host ``blocks`` with ``keep_on_miss=False``, no pinned tier): lets tiers whose reads run
        under a deadline (the shared tier on a mount that can stall) read straight into ``blocks`` as well, where
        they would otherwise read into scratch buffers and copy. The price: a read abandoned at its deadline may
        still write its blocks after this returns (their keys are misses). Before returning, the store calls
        ``lend(indices)`` with the indices of such blocks, and calls the function that returns, once, on another
        thread, when no read can write them any more; until then the caller must neither reuse nor free them.

        ``on_layer(indices, layer)``: for GPU ``blocks`` on the device path (no pinned tier), blocks from a tier
        that reads layer by layer (the shared tier's chunk files) arrive one layer at a time, each layer's
        slice verified on its own; it is called, on a worker thread, once layers ``0..layer`` of the blocks at
        ``indices`` are in ``blocks`` while later layers are still being read (an engine's forward pass can
        start on them). A block's status still comes with the return: a later layer can fail it. Other
        destinations and tiers deliver whole blocks and never call it.
        """
        self._check_open()
        ks = self._check_keys(keys)
        bs = as_batch(blocks, "get_into: blocks")
        if len(ks) != len(bs):
            raise errors.InvalidRequestError(f"get_into: {len(ks)} keys but {len(bs)} blocks")
        if lend is not None and keep_on_miss:
            raise errors.InvalidRequestError("get_into: lend is for keep_on_miss=False (a lent block may hold a "
                                             "late read's bytes)")
        dests = [self._source(b, f"get_into: block {i}", writable=True) for i, b in enumerate(bs)]
        t0 = time.perf_counter()
        if self._uses_device(dests):
            tiers = self._get_device(ks, [d for d, _ in dests], bool(keep_on_miss), on_layer)
            self._lat["get"].append(time.perf_counter() - t0)
            return tiers
        views = self._direct_views(dests)
        if views is not None and all(not v.readonly for v in views):
            tiers = self._get_direct(ks, views, bool(keep_on_miss), lend)
            self._lat["get"].append(time.perf_counter() - t0)
            return tiers
        leases, tiers = self._fetch(ks, count=True)
        self._deliver(leases, bs, 0, self.geometry.block_bytes)
        self.counters.add(bytes_got=self.geometry.block_bytes * sum(1 for lease in leases if lease is not None))
        self._lat["get"].append(time.perf_counter() - t0)
        return tiers

    def _get_direct(self, keys: list[bytes], views: list[memoryview], keep: bool,
                    lend: Callable[[list[int]], Callable[[], None]] | None = None) -> list[TierName | None]:
        """get_into without a pinned tier: from the lower tiers into the caller's host buffers.

        With ``keep`` each block lands in the caller's buffer only once verified (through staging or scratch
        buffers: one host copy per block), which keeps a missed key's buffer as it was.
        """
        batch = KVBatch("host", list(views), keep=keep, lend=lend)
        tiers = self._load(keys, lambda idx: batch.pick(idx))
        self._count_gets(tiers)
        return tiers

    def _count_gets(self, tiers: list[TierName | None]) -> None:
        n = self.geometry.block_bytes
        self.count_loads(tiers)
        self.counters.add(bytes_got=n * (len(tiers) - tiers.count(None)))

    def _load(self, keys: list[bytes], dests_for: Callable[[list[int]], KVBatch],
              finish: Callable[[list[int], KVBatch, list[ReadStatus] | None], None] | None = None
              ) -> list[TierName | None]:
        """The lower tiers as one loop: each is asked, highest first, for the blocks the tiers above did not
        answer (a tier that answers from memory only of those it has); the first that has a block answers, and
        its hits are promoted to the lower tiers above it. ``dests_for(indices)`` gives the destinations of a
        tier's read; ``finish(indices, dests, statuses)`` runs after each read (statuses ``None``: it raised).
        Returns the tier each block came from (``None``: a miss); counts what failed verification or could not
        be read."""
        tiers: list[TierName | None] = [None] * len(keys)
        corrupt = unreadable = 0
        for depth, tier in enumerate(self.lower):
            need = [i for i, t in enumerate(tiers) if t is None]
            if need and tier.in_memory:
                need = [i for i, found in zip(need, tier.present([keys[i] for i in need]), strict=True) if found]
            if not need:
                continue
            dests = dests_for(need)
            t0 = time.perf_counter()
            try:
                answers = tier.read_into([keys[i] for i in need], dests)
            except BaseException:
                if finish is not None:
                    finish(need, dests, None)
                raise
            hits = [j for j, a in enumerate(answers) if a == "hit"]
            self.load_or_recompute.note_load(tier.name, len(hits) * self.geometry.block_bytes,
                                             time.perf_counter() - t0)
            for j in hits:
                tiers[need[j]] = tier.name
            corrupt += answers.count("corrupt")
            unreadable += answers.count("unreadable")
            try:
                if hits and depth > 0:
                    self._promote(depth, [keys[need[j]] for j in hits], dests.pick(hits))
            finally:
                if finish is not None:
                    finish(need, dests, answers)
        self.counters.add(corrupt_dropped=corrupt, unreadable=unreadable)
        return tiers

    def _promote(self, depth: int, keys: list[bytes], srcs: KVBatch) -> None:
        """Write blocks a lower tier (``self.lower[depth]``) just answered to the lower tiers above it, so the
        next get finds them there. From leased slots in the background (on leases of its own: the slots keep
        their blocks until the write has read them, whenever the caller releases its leases); from the caller's
        memory now. A promotion that fails is counted (``lower_tier_errors``), never the get's error."""
        if srcs.kind == "slots":
            background = [lease.another() for lease in srcs.items]
            try:
                self._executor.submit(self._promote_now, depth, keys,
                                      KVBatch("slots", background, checksums=list(srcs.checksums)), True)
            except BaseException:
                release_all(background)
                raise
            return
        self._promote_now(depth, keys, srcs, False)

    def _promote_now(self, depth: int, keys: list[bytes], srcs: KVBatch, release: bool) -> None:
        try:
            for tier in self.lower[:depth]:
                answers = tier.write(keys, srcs)
                self.counters.add(promotions=answers.count("written"))
        except Exception:
            self.counters.add(lower_tier_errors=1)
        finally:
            if release:
                release_all(srcs.items)

    # -- load or recompute, for engines ---------------------------------------------------------------------------
    def lower_tier_bytes(self, keys: Sequence[bytes]) -> dict[str, int]:
        """The bytes of ``keys``' blocks a load would read from each lower tier (no I/O: a block the pinned tier
        lacks is counted in the block store's when its index holds it, else in the shared tier's)."""
        out: dict[str, int] = {}
        n = self.geometry.block_bytes
        for k in keys:
            if k in self.pinned:
                continue
            tier = "block" if self.block is not None and self.block.contains(k) else "shared"
            out[tier] = out.get(tier, 0) + n
        return out

    # -- the pinned tier, for engines ----------------------------------------------------------------------------
    @property
    def pinned_capacity(self) -> int:
        """Blocks the pinned tier holds within its budget (0: no pinned tier)."""
        return self.pinned.capacity

    @property
    def pinned_bytes_per_block(self) -> int:
        """Registered memory one pinned block takes (its slot and its header)."""
        return self.pinned.bytes_per_slot

    def pinned_count(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys`` the pinned tier holds now (no I/O)."""
        return sum(self.pinned.present(list(keys)))

    def in_pinned(self, key: bytes) -> bool:
        """Whether the pinned tier holds ``key`` now (no I/O)."""
        return key in self.pinned

    def track_pinned_removals(self) -> None:
        """From now on, note each block that leaves the pinned tier (evicted or removed), for
        :meth:`take_pinned_removals` (an engine's KV events)."""
        self.pinned.track_removals()

    def take_pinned_removals(self) -> list[bytes]:
        """The keys that left the pinned tier since the last call (none unless :meth:`track_pinned_removals`)."""
        return self.pinned.take_removed()

    def allocate_pinned(self, blocks: int | None = None) -> int:
        """Allocate the pinned tier's whole budget now: every slot it can hold, registered (locked in memory where
        the limits allow) and ready, so that later puts, gets and prefetches do not pay for allocating registered
        memory (``mmap``, page faults and ``mlock`` of each new slot) on the way: once the tier is full, a new
        block takes the least recently used one's slot. The way a server that wants steady latency commits its
        budget at start. Returns the slots allocated by this call (0 when they all exist).

        Takes time and memory in proportion to ``pinned_bytes``, at once; without this call slots are allocated as
        blocks first arrive (and :meth:`prepare_pinned` keeps some ready). ``blocks``: allocate only until that
        many slots exist (within the capacity).
        """
        self._check_open()
        return self.pinned.reserve(self.pinned.capacity if blocks is None else blocks)

    def prepare_pinned(self, idle: int) -> bool:
        """Allocate pinned slots in the background until ``idle`` hold no block (within the pinned tier's
        capacity), so that the blocks that come next (an engine's next loads) fill them without paying for
        allocating registered memory on the way. Returns at once: whether a job was started (not when one is
        still running, nothing is missing, or the store is closed)."""
        with self._lock:
            if self._closed or self._preparing or self.pinned.ready(idle):
                return False
            self._preparing = True

        def run() -> None:
            try:
                self.pinned.top_up(idle)
            finally:
                with self._lock:
                    self._preparing = False

        try:
            self._executor.submit(run)
        except RuntimeError:  # the executor shut down meanwhile (close)
            with self._lock:
                self._preparing = False
            return False
        return True

    def hold(self, keys: Sequence[bytes], *, count: bool = False) -> HeldBlocks:
        """The blocks of ``keys``, pinned in the pinned tier for the caller until it releases them (fetched from
        the lower tiers first where needed: call :meth:`prefetch` early to overlap): for callers that copy them out
        piece by piece, such as an engine's per-layer loads
        (:meth:`HeldBlocks.copy_layer_into <sfstore.kvcache.held.HeldBlocks.copy_layer_into>`).

        ``count``: count the blocks in ``gets`` / ``hits_*`` / ``misses`` (leave it off after a counted
        :meth:`prefetch` of the same blocks).
        """
        self._check_open()
        ks = self._check_keys(keys)
        leases, tiers = self._fetch(ks, count=bool(count))
        return HeldBlocks(self.geometry, leases, tiers)

    def hold_async(self, keys: Sequence[bytes], *, parts: int = 1, count: bool = False) -> HeldBlocks:
        """:meth:`hold` without waiting: the blocks of ``keys``, each in a pinned slot held for the caller, those
        the pinned tier lacks being read from the lower tiers in the background (in ``parts`` batches at once).

        Every key is a row (``rows`` is every index), and a row's slot holds its block once its read ended as a
        hit. A tier that reads layer by layer (:attr:`KVTier.supports_layer_reads`: the shared tier's chunk
        files) announces each layer as soon as it is in and verified, so the caller can copy layer ``i`` out
        (:meth:`HeldBlocks.copy_layer_into <sfstore.kvcache.held.HeldBlocks.copy_layer_into>` waits for it) while
        later layers are still being read: an engine's per-layer loads overlap the read. Once
        :attr:`HeldBlocks.load` is done, :attr:`HeldBlocks.tiers` gives each block's tier (``None``: a miss: its
        slot holds no block, and an earlier layer of it may have been copied out before a later one failed:
        such a caller recomputes it). Hits join the pinned tier, and are promoted to the lower tiers above theirs,
        as :meth:`get_into` does.

        ``count``: count the blocks in ``gets`` / ``hits_*`` / ``misses`` once the reads end (else the caller
        does, with :meth:`count_loads`).
        """
        self._check_open()
        ks = self._check_keys(keys)
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise errors.InvalidRequestError(f"hold_async: parts must be an int >= 1, not {parts!r}")
        leases: list[Lease | None] = [self.pinned.lease(k) for k in ks]
        tiers: list[TierName | None] = ["pinned" if lease is not None else None for lease in leases]
        missing = [i for i, lease in enumerate(leases) if lease is None]
        try:
            for i in missing:
                leases[i] = self.pinned.take()
        except BaseException:
            release_all(leases)
            raise
        load = LayerLoad(self.geometry.num_layers, tiers, missing, self.counters)
        held = HeldBlocks(self.geometry, leases, tiers, load)
        per = -(-len(missing) // parts) if missing else 1
        for start in range(0, len(missing), per):
            rows = missing[start:start + per]
            own = [lease.another() for lease in (leases[i] for i in rows) if lease is not None]
            try:
                self._executor.submit(self._read_held, [ks[i] for i in rows], rows, own, load, bool(count))
            except BaseException:  # (the executor shut down: close) a miss each
                release_all(own)
                load.finish(rows, [None] * len(rows))
        if count:  # the blocks held from the pinned tier now; the reads count theirs as they end
            self.count_loads(["pinned"] * (len(ks) - len(missing)))
        return held

    def _read_held(self, keys: list[bytes], rows: list[int], slots: list[Lease], load: LayerLoad,
                   count: bool) -> None:
        """:meth:`hold_async`'s background read of ``keys`` into the held ``slots`` (leases of its own, released
        here), announcing their layers to ``load`` as tiers read them; every row ends as a hit or a miss."""
        batch = KVBatch("slots", slots, on_layer=lambda at, layer: load.layer_in([rows[j] for j in at], layer))

        def finish(indices: list[int], dests: KVBatch, answers: list[ReadStatus] | None) -> None:
            for j, i in enumerate(indices):
                if answers is not None and answers[j] == "hit":
                    self.pinned.insert(keys[i], slots[i], dests.checksums[j] or 0)

        tiers: list[TierName | None] = [None] * len(keys)
        try:
            tiers = self._load(keys, batch.pick, finish)
        except Exception:  # a miss each: the caller recomputes them
            self.counters.add(lower_tier_errors=1)
        finally:
            release_all(slots)
            load.finish(rows, tiers)
            if count:
                self.count_loads(tiers)

    def prefetch(self, keys: Sequence[bytes], *, count: bool = False) -> SfFuture[list[TierName | None]]:
        """Bring the blocks into the pinned tier in the background; ``.get()`` gives the tier of each.

        ``count``: count the blocks in ``gets`` / ``hits_*`` / ``misses``, for callers whose reads that follow
        (:meth:`get_layer_into`) are of these blocks (an engine's per-layer loads), so each is counted once.

        Where every block is in the pinned tier already, the future is done on return and no background work is
        started: a pool thread woken for nothing would compete with the caller for the interpreter lock.
        """
        self._check_open()  # (an empty batch is a valid no-op, as in every call)
        ks = self._check_keys(keys)
        if all(k in self.pinned for k in ks):
            tiers: list[TierName | None] = ["pinned"] * len(ks)
            if count:
                self.count_loads(tiers)
            return DoneFuture(tiers)

        def run() -> list[TierName | None]:
            leases, tiers = self._fetch(ks, count=bool(count))
            release_all(leases)
            return tiers

        return ExecutorFuture(self._executor.submit(run))

    def _fetch(self, keys: list[bytes], count: bool) -> tuple[list[Lease | None], list[TierName | None]]:
        """Leases (the caller's to release) on pinned slots holding each block, read from the lower tiers into
        fresh slots (made resident) where the pinned tier lacks them."""
        leases: list[Lease | None] = [self.pinned.lease(k) for k in keys]
        resident: list[TierName | None] = ["pinned" if lease is not None else None for lease in leases]

        def fresh(indices: list[int]) -> KVBatch:
            return KVBatch("slots", [self.pinned.take() for _ in indices])

        def finish(indices: list[int], dests: KVBatch, answers: list[ReadStatus] | None) -> None:
            for j, (i, lease) in enumerate(zip(indices, dests.items, strict=True)):
                if answers is not None and answers[j] == "hit":
                    self.pinned.insert(keys[i], lease, dests.checksums[j] or 0)
                    leases[i] = lease
                else:
                    lease.release()

        missing = [i for i, lease in enumerate(leases) if lease is None]
        try:
            lower = self._load([keys[i] for i in missing], lambda idx: fresh(idx),
                               lambda idx, dests, answers: finish([missing[j] for j in idx], dests, answers))
        except BaseException:
            release_all(leases)
            raise
        tiers = list(resident)
        for i, t in zip(missing, lower, strict=True):
            tiers[i] = t
        if count:
            self.count_loads(tiers)
        return leases, tiers

    def count_loads(self, tiers: Sequence[TierName | None]) -> None:
        """Count blocks a caller loaded from an uncounted :meth:`prefetch` (``count=False``), once it used them:
        ``gets``, ``misses`` (``None``) and ``hits_*`` by the tier each came from, as the prefetch answered. For a
        prefetch started ahead that may never be used (an engine's scheduler reading ahead for a request that can
        still be aborted): only the blocks used are counted."""
        ts = list(tiers)
        self.counters.add(
            gets=len(ts), misses=sum(1 for t in ts if t is None),
            hits_pinned=ts.count("pinned"), hits_block=ts.count("block"), hits_shared=ts.count("shared"),
        )

    # -- GPU blocks through the device path -------------------------------------------------------------------------
    def _is_device(self, block: Any) -> bool:
        if self._device is not None:
            return bool(self._device.runtime.is_device(block))
        return is_device_buffer(block)

    def _device_path(self) -> DevicePath:
        """The device path GPU blocks move through (made on first use when none was given)."""
        with self._lock:
            if self._device is None:
                from sfstore.paths.device import DevicePath

                self._device = DevicePath()
                self._owns_device = True
            return self._device

    def register_device_buffers(self, buffers: Iterable[Any]) -> int:
        """Register long-lived GPU buffers (an engine's KV-cache tensors) with cuFile once, so the device path's
        transfers into and out of them need no registration each; returns how many were registered (0 outside
        ``gds``, where there is nothing to register). They are deregistered when the device path closes."""
        self._check_open()
        dp = self._device_path()
        return sum(1 for b in as_batch(buffers, "register_device_buffers: buffers") if dp.register(b))

    def _uses_device(self, sources: list[tuple[Any, bool]]) -> bool:
        """Whether a batch moves through the device path: no pinned tier, a lower tier, and only GPU blocks."""
        return (self.pinned.capacity == 0 and (self.block is not None or self.shared is not None)
                and bool(sources) and all(device for _, device in sources))

    def _put_device(self, ks: list[bytes], blocks: list[Any]) -> None:
        """A put of GPU blocks without a pinned tier: each lower tier on the device path's route for it (the
        shared tier HBM to storage, GPU-direct with cuFile; the block store through host staging buffers where
        cuFile does not take its target)."""
        dp = self._device_path()
        with self._lower_tier_put(len(ks)):
            self._write_through(ks, KVBatch("device", list(blocks), device=dp))

    def _get_device(self, ks: list[bytes], dests: list[Any], keep: bool,
                    on_layer: Callable[[list[int], int], None] | None = None) -> list[TierName | None]:
        """get_into GPU buffers without a pinned tier: each lower tier on the device path's route for it
        (verified on the GPU, or in host memory and then copied up); per-layer ranges from chunk files."""
        batch = KVBatch("device", list(dests), device=self._device_path(), keep=keep, on_layer=on_layer)
        tiers = self._load(ks, lambda idx: batch.pick(idx))
        self._count_gets(tiers)
        return tiers

    def describe(self) -> dict[str, Any]:
        """How GPU blocks move to and from each tier, and why (the device path's routes), and the device path.

        With a pinned tier, GPU blocks are copied into its slots (``"pinned slots"``). Without one, each lower
        tier names its route: ``gds`` / ``compat`` / ``staged`` for the shared tier (decided from its
        directory's filesystem), ``staged`` for the block store (with what cuFile would make of its target).
        """
        out: dict[str, Any] = {"tiers": self.stats()["tiers"], "pinned_capacity_blocks": self.pinned.capacity,
                               "quarantine": {tier: g.describe() for tier, g in self._guards().items()}}
        gpu: dict[str, Any] = {}
        if self.pinned.capacity > 0:
            why = ("a pinned tier is on: GPU blocks are copied into its slots and the lower tiers are written from "
                   "there (kvcache_pinned_bytes=0 sends them through the device path)")
            for t in out["tiers"]:
                gpu[t] = {"route": "pinned slots", "why": why}
            out["gpu_blocks"] = gpu
            out["device"] = self._device.describe() if self._device is not None else None
            return out
        dp = self._device_path()
        if self.shared is not None:
            gpu["shared"] = self.shared.describe_route(dp)
        if self.block_tier is not None:
            gpu["block"] = self.block_tier.describe_route(dp)
        out["gpu_blocks"] = gpu
        out["device"] = dp.describe()
        return out

    # -- housekeeping ---------------------------------------------------------------------------------------------
    def evict(self, keys: Sequence[bytes], tiers: Iterable[str] = TIERS) -> int:
        """Remove the blocks from ``tiers``; return how many (block, tier) copies were removed."""
        self._check_open()
        ks = self._check_keys(keys)
        chosen = set(as_batch(tiers, "evict: tiers"))
        bad = chosen - set(TIERS)
        if bad:
            raise errors.InvalidRequestError(f"evict: unknown tier(s) {sorted(bad)}; tiers are {TIERS}")
        removed = sum(tier.remove(ks) for tier in (self.pinned, *self.lower) if tier.name in chosen)
        self.counters.add(evictions=removed)
        return removed

    def stats(self) -> dict[str, Any]:
        """Hits per tier, misses, bytes, blocks resident per tier, and put/get latency percentiles (seconds).

        Counting the shared tier's blocks lists its directory (under the tier's deadline): call this for
        monitoring, not on a step's path; :attr:`tiers` and :attr:`counters` cost no I/O.
        """
        c = self.counters.snapshot()
        out: dict[str, Any] = dict(c)
        out["resident"] = {
            "pinned": len(self.pinned),
            "block": len(self.block) if self.block is not None else None,
            "shared": self.shared.count() if self.shared is not None else None,
        }
        out["pinned_capacity_blocks"] = self.pinned.capacity
        # the shared tier's budget: blocks this process evicted to keep it, and the bytes its namespace holds
        # as this process last estimated them (no I/O here; None before its first write or scan)
        out["evictions_shared"] = self.shared.budget.evictions if self.shared is not None else 0
        out["shared_bytes_held"] = self.shared.budget.held() if self.shared is not None else None
        out["shared_budget_bytes"] = self.shared.budget.budget if self.shared is not None else None
        out["shared_budget_errors"] = self.shared.budget.errors if self.shared is not None else 0
        out["cache_namespace"] = self.cache_namespace
        # files the shared tier opened to read blocks (chunk files and block files): a hit of n tokens opens
        # about n / chunk_tokens of them
        shared = self.shared.counters.snapshot() if self.shared is not None else {}
        out["shared_opens"] = shared.get("opens", 0)
        # GPU reads whose checksums failed on bytes that pass in host memory: files kept, read as misses (a
        # defect between storage and GPU, not damage: sfstore/device_verdict.py)
        out["device_verify_disagreed"] = shared.get("device_verify_disagreed", 0)
        out["chunk_tokens"] = self.chunk_tokens
        # the connector's load-or-recompute figures: each tier's load rate, the engine's prefill rate, decisions
        out["load_or_recompute"] = self.load_or_recompute.describe()
        # deadlines: operations past theirs (gets were misses, puts dropped), and each tier's quarantine
        guards = self._guards()
        out["deadline_misses"] = sum(g.counters.snapshot()["deadline_misses"] for g in guards.values())
        out["quarantine"] = {tier: g.describe() for tier, g in guards.items()}
        # bytes the lower tiers moved with O_DIRECT straight to/from memory vs through bounce buffers or the page
        # cache (their paths' counters: shared with other users of the same paths)
        direct = bounced = 0
        for path in ([self.block.path] if self.block is not None else []) + \
                ([self.shared.fp] if self.shared is not None else []):
            c = path.counters.snapshot()
            direct += c.get("bytes_direct", 0)
            bounced += c.get("bytes_bounced", 0)
        out["bytes_direct"], out["bytes_bounced"] = direct, bounced
        if self._device is not None:
            by_class = self._device.counters.by_class()
            out["device"] = {tier: {k: by_class.get(f"kvcache.{tier}", {}).get(k, 0)
                                    for k in ("bytes_gpu_direct", "bytes_staged")}
                             for tier in ("shared", "block")}
        for op, samples in self._lat.items():
            data = list(samples)
            out[f"{op}_p50_s"] = _percentile(data, 0.5)
            out[f"{op}_p99_s"] = _percentile(data, 0.99)
        out["tiers"] = self.tiers
        return out

    @property
    def lower(self) -> list[KVTier]:
        """The tiers below the pinned one, highest first: a get asks them in this order, a put writes them all."""
        return [t for t in (self.block_tier, self.shared) if t is not None]

    @property
    def tiers(self) -> list[str]:
        """The tiers this store has, highest first (``pinned``, then ``block`` and ``shared`` where configured);
        no I/O, unlike :meth:`stats`, which lists the shared directory."""
        return [t for t, on in zip(TIERS, (True, self.block is not None, self.shared is not None), strict=True)
                if on]

    def _guards(self) -> dict[str, TierGuard]:
        return {t.name: t.guard for t in self.lower if t.guard is not None}

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InvalidRequestError("the KV-cache store is closed")

    def close(self) -> None:
        """Wait for the background writes, then release the pinned tier (and the block store it opened)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_for_puts()
        finally:
            self._executor.shutdown(wait=True)
            with self._lock:
                partial, self._partial = list(self._partial.values()), {}
            release_all(lease for lease, _layers in partial)
            for tier in (*self.lower, self.pinned):
                tier.close()
            if self._owns_device and self._device is not None:
                self._device.close()

    def __enter__(self) -> KVCacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
