"""``sfstore.kvcache.sglang`` built by SGLang 0.5.23's own backend factory from a ``dynamic`` config, moving pages
of SGLang's real host KV pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` in CPU memory) with the
zero-copy interface, keyed by SGLang's own page hashes.

What of SGLang does not run here: its scheduler and cache controller (they need a GPU KV pool and CUDA kernels to
move pages between the device and the host pool). The tests call the backend as the cache controller does
(``create_backend`` then ``register_mem_pool_host``; ``batch_exists``, ``batch_get_v1``, ``batch_set_v1`` with
the host pool's token indices, a page's worth each, and the hashes ``get_storage_hash_str`` gives a request).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed here (tools/sglang-env.sh makes .venv-sglang)")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

from sfstore import errors
from sfstore.kvcache.sglang import SfstoreHiCacheStorage

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 64, 16
DEVICE_TOKENS = 8 * PAGE


def host_pool(layout: str = "page_first") -> Any:
    """SGLang's MHA host pool in CPU memory (its device pool stood in by CPU tensors of the same shape)."""
    k = tuple(torch.zeros(DEVICE_TOKENS + PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS + PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS - 1)


def mla_host_pool() -> Any:
    """SGLang's MLA host pool in CPU memory (one part a page: the latent KV and its rope part)."""
    rank, rope = 32, 16
    bufs = tuple(torch.zeros(DEVICE_TOKENS + PAGE, 1, rank + rope, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
                         kv_lora_rank=rank, qk_rope_head_dim=rope, kv_cache_dim=rank + rope, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS - 1,
                                target_layer_num=LAYERS)


def storage_config(shared: Path, *, tp_rank: int = 0, tp_size: int = 1, model: str = "tiny-llama",
                   mla: bool = False, **extra: Any) -> HiCacheStorageConfig:
    """The storage config SGLang makes from ``--hicache-storage-backend-extra-config`` (docs/kvcache.md's)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "sfstore", "module_path": "sfstore.kvcache.sglang",
                      "class_name": "SfstoreHiCacheStorage", "interface_v1": 1, "shared_dir": str(shared), **extra})


def backend(shared: Path, pool: Any, **kw: Any) -> Any:
    """The backend as SGLang's cache controller attaches it: the factory, then the host pool registered."""
    made = StorageBackendFactory.create_backend("dynamic", storage_config(shared, **kw), pool)
    made.register_mem_pool_host(pool)
    return made


def page_keys(tokens: list[int], salt: str | None = None) -> list[str]:
    """SGLang's storage hashes of a request's pages (a new chain, seeded by its cache_salt)."""
    return list(get_storage_hash_str(RadixKey(tokens, cache_salt=salt), None, page_size=PAGE))


def fill(pool: Any, pages: int, seed: int) -> torch.Tensor:
    """Host indices of ``pages`` new pages of ``pool``, filled with random KV."""
    idx = pool.alloc(pages * PAGE)
    g = torch.Generator().manual_seed(seed)
    for p in range(pages):
        page = pool.get_data_page(int(idx[p * PAGE]), flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
    return idx


def pages(pool: Any, idx: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [pool.get_data_page(int(idx[p * PAGE])).clone() for p in range(n)]


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n * PAGE,), generator=g).tolist()


def test_the_factory_builds_it_and_real_host_pages_make_a_round_trip(tmp_path: Path) -> None:
    pool = host_pool()
    be = backend(tmp_path / "shared", pool)
    try:
        assert type(be) is SfstoreHiCacheStorage  # built by SGLang's factory (issubclass of HiCacheStorage checked)
        keys = page_keys(tokens(1, 4))
        src = fill(pool, 4, seed=1)
        want = pages(pool, src, 4)
        assert be.batch_exists(keys) == 0
        assert be.batch_set_v1(keys, src) == [True] * 4
        assert be.batch_exists(keys) == 4
        dst = pool.alloc(4 * PAGE)  # other pages of the pool, zeroed
        for p in range(4):
            pool.get_data_page(int(dst[p * PAGE]), flat=False).zero_()
        assert be.batch_get_v1(keys, dst) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(pages(pool, dst, 4), want, strict=True))
        assert be.get_stats()["hits_shared"] == 8  # two parts (K, V) a page
    finally:
        be.close()


def test_a_new_process_reads_the_pages_bit_exact(tmp_path: Path) -> None:
    pool = host_pool()
    be = backend(tmp_path / "shared", pool)
    keys = page_keys(tokens(2, 3))
    src = fill(pool, 3, seed=2)
    try:
        assert be.batch_set_v1(keys, src) == [True] * 3
    finally:
        be.close()
    want = [p.view(torch.int16).tolist() for p in pages(pool, src, 3)]
    code = f"""
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from tests.sglang_backend.test_sglang_backend import backend, host_pool, pages, PAGE
from pathlib import Path
pool = host_pool()
be = backend(Path({str(tmp_path / "shared")!r}), pool)
dst = pool.alloc(3 * PAGE)
ok = be.batch_get_v1({keys!r}, dst)
print(json.dumps({{"ok": ok, "pages": [p.view(__import__("torch").int16).tolist() for p in pages(pool, dst, 3)]}}))
be.close()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ok"] == [True] * 3 and got["pages"] == want


def test_batch_exists_answers_the_leading_run_and_a_damaged_page_misses(tmp_path: Path) -> None:
    pool = host_pool()
    shared = tmp_path / "shared"
    be = backend(shared, pool)
    try:
        keys = page_keys(tokens(3, 4))
        src = fill(pool, 4, seed=3)
        assert be.batch_set_v1([keys[0], keys[1], keys[3]], torch.cat([src[:2 * PAGE], src[3 * PAGE:]])) == [True] * 3
        assert be.batch_exists(keys) == 2  # page 2 was never stored: the run stops there, page 3 does not count
        assert be.batch_exists(keys[3:]) == 1
        # a flipped byte in page 1's V part: that page misses, the others still hit
        store = be.store
        victim = shared / store.shared.file_name(be._keys(keys[1])[1])
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0xFF
        victim.write_bytes(bytes(raw))
        dst = pool.alloc(2 * PAGE)
        assert be.batch_get_v1(keys[:2], dst) == [True, False]
        assert torch.equal(pages(pool, dst, 1)[0], pages(pool, src, 1)[0])
        assert be.get_stats()["corrupt_dropped"] >= 1
        assert be.batch_exists(keys) == 1  # the damaged file is dropped: SGLang recomputes the page, writes it again
        assert be.batch_set_v1(keys[1:2], src[PAGE:2 * PAGE]) == [True]
        assert be.batch_exists(keys) == 2
    finally:
        be.close()


def test_tenants_with_another_cache_salt_hit_nothing(tmp_path: Path) -> None:
    pool = host_pool()
    be = backend(tmp_path / "shared", pool)
    try:
        prompt = tokens(4, 3)
        src = fill(pool, 3, seed=4)
        alice, bob, nobody = page_keys(prompt, "alice"), page_keys(prompt, "bob"), page_keys(prompt)
        assert len({*alice, *bob, *nobody}) == 9  # SGLang seeds each tenant's chain with its salt
        assert be.batch_set_v1(alice, src) == [True] * 3
        assert be.batch_exists(alice) == 3
        assert be.batch_exists(bob) == 0 and be.batch_exists(nobody) == 0
        assert be.batch_get_v1(bob, pool.alloc(3 * PAGE)) == [False] * 3
    finally:
        be.close()


def test_tensor_parallel_ranks_and_models_are_kept_apart(tmp_path: Path) -> None:
    pool = host_pool()
    shared = tmp_path / "shared"
    keys = page_keys(tokens(5, 2))
    src = fill(pool, 2, seed=5)
    rank0 = backend(shared, pool, tp_rank=0, tp_size=2)
    rank1 = backend(shared, pool, tp_rank=1, tp_size=2)
    other = backend(shared, pool, tp_rank=0, tp_size=2, model="another-model")
    try:
        assert rank0.batch_set_v1(keys, src) == [True] * 2
        assert rank0.batch_exists(keys) == 2
        assert rank1.batch_exists(keys) == 0  # an MHA rank holds its own heads: never another rank's page
        assert other.batch_exists(keys) == 0
    finally:
        for be in (rank0, rank1, other):
            be.close()


def test_mla_pages_are_one_copy_for_every_rank_written_by_sglangs_storage_writer(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    pool0, pool1 = mla_host_pool(), mla_host_pool()
    rank0 = backend(shared, pool0, tp_rank=0, tp_size=2, mla=True)
    rank1 = backend(shared, pool1, tp_rank=1, tp_size=2, mla=True)
    try:
        assert rank0.parts == 1 and rank0.writer and not rank1.writer
        keys = page_keys(tokens(7, 2))
        src1 = fill(pool1, 2, seed=8)
        assert rank1.batch_set_v1(keys, src1) == [True, True]  # not the writer: it stores nothing
        assert rank0.batch_exists(keys) == 0
        src0 = fill(pool0, 2, seed=7)
        assert rank0.batch_set_v1(keys, src0) == [True, True]
        assert rank1.batch_exists(keys) == 2  # replicated KV: rank 1 reads rank 0's copy
        dst = pool1.alloc(2 * PAGE)
        assert rank1.batch_get_v1(keys, dst) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(pages(pool1, dst, 2), pages(pool0, src0, 2), strict=True))
    finally:
        rank0.close()
        rank1.close()


def test_the_generic_interface_stores_the_same_parts(tmp_path: Path) -> None:
    pool = host_pool()
    be = backend(tmp_path / "shared", pool)
    try:
        keys = page_keys(tokens(6, 2))
        src = fill(pool, 2, seed=6)
        flat = [pool.get_data_page(int(src[p * PAGE])) for p in range(2)]
        assert be.batch_set(keys, flat) is True
        dst = pool.alloc(2 * PAGE)
        assert be.batch_get_v1(keys, dst) == [True, True]  # what the generic call stored, the zero-copy one reads
        assert all(torch.equal(a, b) for a, b in zip(pages(pool, dst, 2), flat, strict=True))
        out = [pool.get_dummy_flat_data_page() for _ in range(2)]
        got = be.batch_get(keys, out)
        assert all(g is o for g, o in zip(got, out, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(out, flat, strict=True))
        assert be.exists(keys[0]) and not be.exists("0" * 64)
    finally:
        be.close()


def test_the_extra_config_the_docs_show_builds_it(tmp_path: Path) -> None:
    from tools import docblocks

    docs = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
    shown = [b for b in docblocks.extract(str(docs)) if b.language == "json"]
    assert len(shown) == 1, "docs/engines.md should show one SGLang extra config"
    extra = json.loads(shown[0].code)
    assert extra["shared_dir"].startswith("/mnt/")  # a cluster's mount: replaced here
    extra["shared_dir"] = str(tmp_path / "shared")
    config = storage_config(tmp_path / "unused")
    config.extra_config = extra
    pool = host_pool()
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    made.register_mem_pool_host(pool)
    try:
        assert type(made) is SfstoreHiCacheStorage and made.zero_copy
        keys = page_keys(tokens(9, 1))
        assert made.batch_set_v1(keys, fill(pool, 1, seed=9)) == [True]
        assert any((tmp_path / "shared").rglob("*.kvb"))
    finally:
        made.close()


def test_a_layer_first_pool_is_refused_for_zero_copy_with_the_flag_to_use(tmp_path: Path) -> None:
    pool = host_pool("layer_first")
    with pytest.raises(errors.ConfigError, match="--hicache-mem-layout page_first"):
        backend(tmp_path / "shared", pool)


def test_unknown_extra_config_keys_are_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = host_pool()
    with caplog.at_level("WARNING", logger="sfstore.kvcache.sglang"):
        be = backend(tmp_path / "shared", pool, shared_dri="/typo")
    be.close()
    assert "'shared_dri' is not one it reads" in caplog.text
