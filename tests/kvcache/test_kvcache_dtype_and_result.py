"""KVGeometry takes the dtype spellings users write; put_async's future answers concurrent.futures' result()."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
import torch

from sfstore import errors
from sfstore.futures import DoneFuture, ExecutorFuture, Future
from sfstore.kvcache import KVCacheStore, KVGeometry

SHAPE = {"num_layers": 2, "block_tokens": 16, "num_kv_heads": 2, "head_dim": 64}


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        (torch.bfloat16, "bfloat16"), ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("bfloat16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"), (torch.float16, "float16"), ("fp16", "float16"), ("half", "float16"),
        ("float16", "float16"), (np.float16, "float16"), (np.dtype("float16"), "float16"),
        (torch.float32, "float32"), ("fp32", "float32"), ("float32", "float32"), (np.float32, "float32"),
        ("fp8", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e4m3fn"), (torch.float8_e4m3fn, "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"), (torch.float8_e5m2, "float8_e5m2"), (torch.uint8, "uint8"),
        (np.int8, "int8"),
    ],
)
def test_dtype_spellings_are_normalised(given: object, canonical: str) -> None:
    geom = KVGeometry(**SHAPE, dtype=given)  # type: ignore[arg-type]
    assert geom.dtype == canonical
    assert geom == KVGeometry(**SHAPE, dtype=canonical)  # the same geometry: same fingerprint, same keys
    assert geom.fingerprint() == KVGeometry(**SHAPE, dtype=canonical).fingerprint()


@pytest.mark.parametrize("bad", ["bf15", "float64", torch.float64, np.float64, 3, None, "", torch.complex64])
def test_a_bad_dtype_is_a_typed_error_listing_the_accepted_ones(bad: object) -> None:
    with pytest.raises(errors.InvalidRequestError) as got:
        KVGeometry(**SHAPE, dtype=bad)  # type: ignore[arg-type]
    text = str(got.value)
    assert "bfloat16" in text and "bf16" in text and "fp8" in text and "torch.bfloat16" in text


def test_a_store_of_a_torch_dtype_geometry_round_trips(tmp_path: object) -> None:
    geom = KVGeometry(**SHAPE, dtype=torch.bfloat16)  # type: ignore[arg-type]
    kv = KVCacheStore(geom, model_id="m", pinned_bytes=4 * (geom.block_bytes + 4096))
    try:
        keys = kv.keys_for(list(range(32)))
        blocks = [torch.randn(geom.block_shape).to(torch.bfloat16) for _ in keys]
        fut = kv.put_async(keys, blocks)
        assert isinstance(fut, Future) and fut.result(timeout=30) is None  # concurrent.futures' name for get
        out = [torch.empty(geom.block_shape, dtype=torch.bfloat16) for _ in keys]
        kv.get_into(keys, out)
        assert all(torch.equal(a, b) for a, b in zip(out, blocks, strict=True))
    finally:
        kv.close()


def test_result_is_get_with_its_timeout_and_errors() -> None:
    assert DoneFuture(7).result() == 7
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        slow = ExecutorFuture(pool.submit(time.sleep, 0.5))
        with pytest.raises(errors.IOTimeoutError) as got:
            slow.result(timeout=0.01)
        assert isinstance(got.value, TimeoutError)  # what code written for concurrent.futures catches
        assert slow.result(timeout=10) is None

        def fail() -> None:
            raise errors.InvalidRequestError("boom")

        with pytest.raises(errors.InvalidRequestError, match="boom"):
            ExecutorFuture(pool.submit(fail)).result()
    finally:
        pool.shutdown()
