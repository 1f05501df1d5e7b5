"""LMCache's local disk backend as a reference of the kvcache suite (``get-block-vs-lmcache`` /
``put-block-vs-lmcache``): LMCache 0.5.6's ``LMCacheEngine`` with only that backend, one chunk per block, fed the
same blocks through a CPU connector. The same engine with only sfstore's storage plugin
(:mod:`sfstore.kvcache.lmcache`) in its place is the sfstore side of ``get-plugin-vs-lmcache`` /
``put-plugin-vs-lmcache``.

Needs ``lmcache`` (``tools/kvbench-env.sh``); its stock vLLM connectors need CUDA, so the suite brings its own.
"""

from __future__ import annotations

import importlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tools.bench.common import GIB, drop_cache, fsync_path, warn
from tools.bench.measure import CpuMeter, RunResult
from tools.bench.pairs import SideFailed
from tools.bench.suites.kvcache.workload import ENV_HINT, MODEL_ID, Bench, block_latency, timed_batches

__all__ = ["probe", "cpu_connector", "LMCachePeer", "plugin_side"]

#: threads fsyncing LMCache's files at the end of a put run (its own disk writers are 4 threads)
_FSYNC_THREADS = 8


def probe() -> str | None:
    """Why LMCache's local disk backend cannot be used here, or None when it can.

    Returns
    -------
    str or None
        ``not installed: ...`` (with how to get it) or the error; None when its engine, config and connector
        interface import and its CPU device ops loaded.
    """
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    try:
        lmcache = importlib.import_module("lmcache")
        for name in ("lmcache.v1.config", "lmcache.v1.metadata", "lmcache.v1.cache_engine",
                     "lmcache.v1.gpu_connector"):
            importlib.import_module(name)
    except ImportError as exc:
        return f"not installed ({exc}); {ENV_HINT}"
    except Exception as exc:
        return f"cannot import lmcache: {type(exc).__name__}: {exc}"
    if getattr(lmcache, "device_ops", None) is None:
        return "lmcache has no device ops (its CPU ops need numba: pip install numba)"
    return None



def cpu_connector(base: Any, torch: Any, block_tokens: int) -> Any:
    """A CPU subclass of LMCache's ``GPUConnectorInterface``: chunk ``start // block_tokens`` of a call is
    ``kwargs["blocks"][i]`` (a ``uint8`` tensor of the block's bytes); ``from_gpu`` copies it into LMCache's
    memory object, ``to_gpu`` copies the memory object into it. LMCache's own vLLM connectors need CUDA."""

    class CpuBlockConnector(base):  # type: ignore[misc]
        def __init__(self, kv_shape: tuple[int, int, int, int]) -> None:
            self.kv_shape = kv_shape  # (2, layers, tokens, hidden): LMCache's KV_2LTD
            self.kvcaches = None

        def get_shape(self, num_tokens: int) -> Any:
            two, layers, _, hidden = self.kv_shape
            return torch.Size([two, layers, num_tokens, hidden])

        @staticmethod
        def _flat(memory_obj: Any) -> Any:
            return memory_obj.tensor.view(-1).view(torch.uint8)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            self._flat(memory_obj).copy_(kwargs["blocks"][start // block_tokens])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kwargs["blocks"][start // block_tokens].copy_(self._flat(memory_obj))

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                           **kwargs: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e, **kwargs)

    return CpuBlockConnector


class LMCachePeer:
    """LMCache's engine with only its local disk backend, through a CPU connector; with ``plugin``, with only
    sfstore's storage plugin instead (its shared tier in the same directory, each file fsynced before it is
    published: the durability the local disk side reaches by fsyncing every file at the end of a put run)."""

    #: the storage plugin's name in LMCache's config
    PLUGIN = "sfstore"

    def __init__(self, bench: Bench, plugin: bool = False) -> None:
        self.b = bench
        self.plugin = plugin
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
        self.torch = torch = importlib.import_module("torch")
        lmcache = importlib.import_module("lmcache")
        self.version = str(getattr(lmcache, "__version__", "unknown"))
        if not self.version.startswith("0.5.6"):
            warn(f"LMCache {self.version}: the suite was written against 0.5.6")
        config = importlib.import_module("lmcache.v1.config")
        metadata = importlib.import_module("lmcache.v1.metadata")
        engine_mod = importlib.import_module("lmcache.v1.cache_engine")
        connector_mod = importlib.import_module("lmcache.v1.gpu_connector")
        g = bench.geom
        self.path = os.path.join(bench.dir, "kvcache-lmcache-sfstore" if plugin else "kvcache-lmcache")
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        self.instance = f"sfstore-bench-{'plugin-' if plugin else ''}{os.getpid()}"
        self.builder = engine_mod.LMCacheEngineBuilder
        cpu_gib = 4 * bench.batch * bench.block / GIB  # the engine's CPU memory: 4 batches of chunks
        self.settings: dict[str, Any] = {"chunk_size": g.block_tokens, "local_cpu": False,
                                         "max_local_cpu_size": cpu_gib, "save_unfull_chunk": False}
        if plugin:  # as docs/kvcache.md configures it
            self.settings.update({"storage_plugins": [self.PLUGIN], "extra_config": {
                f"storage_plugin.{self.PLUGIN}.module_path": "sfstore.kvcache.lmcache",
                f"storage_plugin.{self.PLUGIN}.class_name": "SfstoreBackend",
                "sfstore.shared_dir": self.path, "sfstore.fsync_shared": True, "force_store_wait": True}})
        else:
            self.settings.update({"local_disk": self.path, "max_local_disk_size": 1024.0, "extra_config": {
                "force_store_wait": True, "use_odirect": bool(bench.args.lmcache_odirect)}})
        try:
            cfg = config.LMCacheEngineConfig.from_defaults(**self.settings)
            meta = metadata.LMCacheMetadata(
                model_name=MODEL_ID, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                kv_dtype=torch.bfloat16, kv_shape=(g.num_layers, g.kv, g.block_tokens, g.num_kv_heads, g.head_dim),
                chunk_size=g.block_tokens)
            conn_cls = cpu_connector(connector_mod.GPUConnectorInterface, torch, g.block_tokens)
            conn = conn_cls((g.kv, g.num_layers, g.block_tokens, g.num_kv_heads * g.head_dim))
            self.engine = self.builder.get_or_create(self.instance, cfg, meta, conn, lambda t, r: None,
                                                     lambda o, r: o)
            self.engine.post_init()
            backends = self.engine.storage_manager.storage_backends
            self.disk = backends[self.PLUGIN if plugin else "LocalDiskBackend"]
        except Exception as exc:
            self.close()
            raise SideFailed(f"LMCache's engine failed to start: {type(exc).__name__}: {exc}") from exc
        self.fsyncer = ThreadPoolExecutor(max_workers=_FSYNC_THREADS, thread_name_prefix="bench-fsync")
        self.tokens = [torch.tensor(t, dtype=torch.long) for t in bench.tokens]
        self.srcs = [torch.from_numpy(v.view(bench.np.uint8)) for v in bench.values.items]
        self.dsts = [torch.from_numpy(d.view(bench.np.uint8)) for d in bench.dests.items]
        self.holds = False

    def _files(self) -> list[str]:
        if self.plugin:  # the shared tier's block files, fanned out into subdirectories
            return [os.path.join(d, f) for d, _s, fs in os.walk(self.path) for f in fs if f.endswith(".kvb")]
        return [os.path.join(self.path, f) for f in os.listdir(self.path) if f.endswith(".pt")]

    def _clear(self) -> None:
        for t in self.tokens:
            self.engine.clear(t)
        for f in self._files():  # anything left behind
            os.unlink(f)
        self.holds = False

    def _store(self, i: int) -> None:
        self.engine.store(self.tokens[i], blocks=self.srcs[:len(self.b.tokens[i]) // self.b.geom.block_tokens])

    def _wait_on_disk(self) -> None:
        if self.plugin:
            self.disk.wait_for_puts(300)
            return
        deadline = time.monotonic() + 300
        while len(self.disk.dict) < self.b.n or self.disk.disk_worker.put_tasks:
            if time.monotonic() > deadline:
                raise SideFailed(f"LMCache had {len(self.disk.dict)} of {self.b.n} blocks on disk after 300 s")
            time.sleep(0.0002)

    def put(self) -> RunResult:
        b = self.b
        self._clear()
        fsync_path(self.path, directory=True)
        _, lat, cpu0, t0, tf = timed_batches(self._store, range(len(self.tokens)))
        meter = CpuMeter()
        meter.start()
        self._wait_on_disk()
        tw = time.perf_counter()
        files = self._files()
        if not self.plugin:  # the plugin fsynced each file before publishing it
            list(self.fsyncer.map(fsync_path, files))  # in parallel: concurrent fsyncs share journal commits
            fsync_path(self.path, directory=True)
        t1 = time.perf_counter()
        cpu = cpu0 + meter.stop()
        sizes = {os.stat(f).st_size for f in files}
        # the plugin's files carry a header before the chunk's bytes
        if len(files) != b.n or (sizes != {b.block} if not self.plugin else min(sizes, default=0) < b.block):
            raise SideFailed(f"{self.name} wrote {len(files)} files of {sorted(sizes)} bytes, expected {b.n} of "
                             f"{b.block}")
        self.holds = True
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu,
                         extra={**block_latency(lat), "store_calls_s": tf - t0, "wait_disk_s": tw - tf,
                                "fsync_s": t1 - tw})

    def get(self) -> RunResult:
        b = self.b
        if not self.holds:
            self._clear()
            for i in range(len(self.tokens)):
                self._store(i)
            self._wait_on_disk()
            self.holds = True
        b.zero_dests()
        for f in self._files():
            drop_cache(f)
        bt = b.geom.block_tokens

        def retrieve(i: int) -> int:
            mask = self.engine.retrieve(self.tokens[i], blocks=self.dsts[:len(b.tokens[i]) // bt])
            return int(mask.sum())

        got, lat, cpu, t0, t1 = timed_batches(retrieve, b.get_order)
        want = [len(b.tokens[i]) for i in b.get_order]
        if got != want:
            raise SideFailed(f"{self.name} retrieved {sum(got)} of {sum(want)} tokens")
        b.check_dests(f"get {self.name}", b.get_order[-1], b.value_of)
        return RunResult(bytes=b.n * b.block, ops=b.n, seconds=t1 - t0, cpu_s=cpu, extra=block_latency(lat))

    @property
    def name(self) -> str:
        return "LMCache with sfstore's plugin" if self.plugin else "LMCache local disk"

    def close(self) -> None:
        try:
            if hasattr(self, "fsyncer"):
                self.fsyncer.shutdown(wait=True)
            self.builder.destroy(self.instance)
        finally:
            shutil.rmtree(self.path, ignore_errors=True)


    def call(self, writes: bool) -> str:
        """What a put (``writes``) or get run calls, for the case's ``params``."""
        call = f"LMCacheEngine.{'store' if writes else 'retrieve'}(tokens of a batch) x N/batch, "
        if self.plugin:
            return (call + f"storage_plugins [sfstore] (sfstore.kvcache.lmcache, shared_dir {self.path}, "
                    "fsync_shared)" + (", then wait for its puts (each file fsynced before published)" if writes
                                       else ""))
        return (call + f"local disk {self.path} (use_odirect={self.b.args.lmcache_odirect})"
                + (", then wait for its disk writes + fsync of every file and the directory" if writes else ""))

    def describe(self) -> dict[str, Any]:
        """Version, settings and torch's version, for the JSON's ``machine.references``."""
        return {"version": self.version, "settings": self.settings,
                "torch": str(getattr(self.torch, "__version__", None))}


def plugin_side(bench: Bench) -> LMCachePeer:
    """The sfstore side of the ``plugin`` tier: LMCache's engine with only sfstore's storage plugin."""
    return LMCachePeer(bench, plugin=True)
