"""The options an inference engine's configuration hands sfstore's KV store, read one way for every engine.

vLLM's ``kv_connector_extra_config``, LMCache's ``extra_config`` (under ``sfstore.``) and SGLang's
``--hicache-storage-backend-extra-config`` all carry the same store options; each integration names where its
options came from (``where``), so an error says which of the engine's settings to change.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from sfstore import defaults, errors
from sfstore.kvcache.geometry import KVGeometry
from sfstore.kvcache.shared_budget import check_namespace
from sfstore.kvcache.store import KVCacheStore

__all__ = ["STORE_OPTIONS", "STORE_KEYS", "flag", "store_options", "open_store"]

#: Option keys passed to :class:`KVCacheStore` as its arguments of the same name, each parsed as the sfstore
#: setting it overrides for this store.
STORE_OPTIONS = {
    "pinned_bytes": "kvcache_pinned_bytes",
    "shared_bytes": "kvcache_shared_bytes",
    "cache_namespace": "kvcache_namespace",
    "io_timeout_ms": "kvcache_io_timeout_ms",
    "quarantine_ms": "kvcache_quarantine_ms",
    "chunk_tokens": "kvcache_chunk_tokens",
}
#: Every key :func:`open_store` reads: the store's options, and where its tiers are.
STORE_KEYS = frozenset({"sfstore_config", "shared_dir", "fsync_shared", *STORE_OPTIONS})


def flag(extra: Mapping[str, Any], name: str, default: bool, where: str) -> bool:
    """The boolean option ``name``: a bool, or one of the texts a setting takes (``"false"`` is False);
    :class:`~sfstore.errors.ConfigError` for anything else."""
    raw = extra.get(name)
    if raw is None:
        return default
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        with contextlib.suppress(ValueError):
            return defaults.parse_bool(raw)
    raise errors.ConfigError(f"{where} {name}: expected true or false, not {raw!r}")


def store_options(extra: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The store's arguments the options set (:data:`STORE_OPTIONS`), parsed as the settings they override;
    :class:`~sfstore.errors.ConfigError` names a bad one."""
    out: dict[str, Any] = {}
    for name, setting in STORE_OPTIONS.items():
        if extra.get(name) is not None:
            out[name] = defaults.SETTINGS[setting].parse(extra[name], f"{where} {name}")
    if "cache_namespace" in out:
        check_namespace(out["cache_namespace"])
    return out


def open_store(geometry: KVGeometry, *, model_id: str, extra: Mapping[str, Any], where: str,
               **kwargs: Any) -> KVCacheStore:
    """A :class:`KVCacheStore` the options describe: with ``sfstore_config``, the tiers :func:`sfstore.open` of
    that config routes to (:meth:`KVCacheStore.from_router`); else the pinned tier and ``shared_dir`` if set
    (``fsync_shared``: each shared file fsynced before it is published). ``kwargs`` go to the store and
    override the options."""
    cfg = extra.get("sfstore_config")
    shared = extra.get("shared_dir")
    args: dict[str, Any] = {"model_id": model_id, **store_options(extra, where), **kwargs}
    if cfg is not None:
        import sfstore

        return KVCacheStore.from_router(geometry, sfstore.open(os.fspath(cfg)), **args)
    return KVCacheStore(geometry, shared_dir=shared, fsync_shared=flag(extra, "fsync_shared", False, where), **args)
