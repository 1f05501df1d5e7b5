"""LMCache 0.5.6's real cache engine on the CPU with sfstore's storage plugin, configured as LMCache documents
(``storage_plugins`` and ``extra_config``'s ``storage_plugin.<name>.module_path``/``.class_name``).

What is not LMCache's: the GPU connector. LMCache's own connectors copy between a vLLM KV cache on a GPU and its
memory objects, and need CUDA; the bench's CPU connector (``tools.bench.suites.kvcache.lmcache``) stands in for
one: chunk ``i`` of a call is the ``uint8`` tensor ``blocks[i]``. Run as a script, it stores or retrieves one
prompt in a process of its own (``python tests/lmcache_plugin/engine.py store|retrieve DIR SEED CHUNKS [docs]``;
``docs``: with the configuration docs/engines.md shows).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

from tools.bench.suites.kvcache.lmcache import cpu_connector

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 64, 16
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 2  # bf16
PLUGIN = "sfstore"
MODEL = "tiny-llama-test"


@dataclass
class Engine:
    engine: Any
    instance: str

    @property
    def plugin(self) -> Any:
        return self.engine.storage_manager.storage_backends.get(PLUGIN)

    def store(self, tokens: torch.Tensor, blocks: list[torch.Tensor], **kw: Any) -> None:
        self.engine.store(tokens, blocks=blocks, **kw)

    def retrieve(self, tokens: torch.Tensor, blocks: list[torch.Tensor], **kw: Any) -> int:
        """Tokens retrieved, from the first (LMCache's mask)."""
        return int(self.engine.retrieve(tokens, blocks=blocks, **kw).sum())

    def lookup(self, tokens: torch.Tensor) -> int:
        return int(self.engine.lookup(tokens))


def docs_settings(shared_dir: str) -> dict[str, Any]:
    """The configuration docs/engines.md shows (its YAML block, as LMCache reads it), with this test's shared
    directory, chunk size and a small CPU tier."""
    import yaml

    from tools import docblocks

    docs = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
    blocks = [b for b in docblocks.extract(str(docs)) if b.language == "yaml"]
    assert len(blocks) == 1, "docs/engines.md should show one LMCache configuration"
    config = dict(yaml.safe_load(blocks[0].code))
    assert config["extra_config"]["sfstore.shared_dir"].startswith("/mnt/")  # a cluster's mount: replaced here
    config["extra_config"] = {**config["extra_config"], "sfstore.shared_dir": shared_dir}
    return {**config, "chunk_size": CHUNK, "max_local_cpu_size": 0.05}


def settings(shared_dir: str, **extra: Any) -> dict[str, Any]:
    """LMCache's configuration with sfstore's plugin (docs/engines.md's, without LMCache's CPU tier, so every hit
    is sfstore's), and ``extra`` as more ``extra_config`` keys (``sfstore.io_timeout_ms``, ...)."""
    return {
        "chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.05, "save_unfull_chunk": False,
        "storage_plugins": [PLUGIN],
        "extra_config": {
            f"storage_plugin.{PLUGIN}.module_path": "sfstore.kvcache.lmcache",
            f"storage_plugin.{PLUGIN}.class_name": "SfstoreBackend",
            "sfstore.shared_dir": shared_dir,
            "force_store_wait": True,
            **extra,
        },
    }


@contextlib.contextmanager
def lmcache_engine(config: dict[str, Any], model: str = MODEL) -> Iterator[Engine]:
    cfg = LMCacheEngineConfig.from_defaults(**config)
    meta = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK)
    conn = cpu_connector(GPUConnectorInterface, torch, CHUNK)((2, LAYERS, CHUNK, HEADS * HEAD_DIM))
    instance = f"sfstore-test-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(instance, cfg, meta, conn, lambda t, r: None, lambda o, r: o)
    try:
        engine.post_init()
        yield Engine(engine, instance)
    finally:
        LMCacheEngineBuilder.destroy(instance)


def prompt(seed: int, chunks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A prompt of ``chunks`` whole chunks and its KV (one ``uint8`` tensor per chunk), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (chunks * CHUNK,), generator=g, dtype=torch.long)
    kv = [torch.randint(0, 256, (CHUNK_BYTES,), generator=g, dtype=torch.uint8) for _ in range(chunks)]
    return tokens, kv


def empty(chunks: int) -> list[torch.Tensor]:
    return [torch.zeros(CHUNK_BYTES, dtype=torch.uint8) for _ in range(chunks)]


def main(argv: list[str]) -> int:
    op, shared, seed, chunks = argv[0], argv[1], int(argv[2]), int(argv[3])
    config = docs_settings(shared) if argv[4:] == ["docs"] else settings(shared)
    tokens, kv = prompt(seed, chunks)
    with lmcache_engine(config) as e:
        if op == "store":
            e.store(tokens, kv)
            e.plugin.wait_for_puts(60)
            out: dict[str, Any] = {"stats": e.plugin.stats()["plugin"]}
        else:
            got = empty(chunks)
            n = e.retrieve(tokens, got)
            out = {"retrieved": n, "exact": all(torch.equal(a, b) for a, b in zip(kv, got, strict=True)),
                   "stats": e.plugin.stats()["plugin"]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
