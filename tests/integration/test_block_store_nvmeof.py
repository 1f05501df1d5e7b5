"""The BlockStore conformance suite on a real NVMe-oF namespace over soft-RoCE, connected through libnvme.

The module's fixture connects with :func:`sfstore.nvme.connect` and disconnects at the end; every test of
:class:`~sfstore.testing.block_store.BlockStoreTests` then runs on the namespace's block device, exactly as on
an image file and a loop device outside the VM.
"""

from __future__ import annotations

from typing import Any

import pytest

from sfstore.blocks import BlockStore
from sfstore.paths.block import BlockPath
from sfstore.testing.block_store import CLASSES, STORE_BYTES, BlockStoreTests


class TestBlockStoreOnNvmeofNamespace(BlockStoreTests):
    @pytest.fixture
    def block_target(self, nvmeof_namespace: Any) -> Any:
        return nvmeof_namespace.device


def test_block_path_from_an_nvmeof_target_is_rdma(nvmeof_namespace: Any, nvmeof_target: Any) -> None:
    """A config-style target connects idempotently (the fixture already did) and reports transport rdma."""
    t = nvmeof_target
    target = {"kind": "nvmeof", "transport": t.transport, "traddr": t.traddr, "trsvcid": t.trsvcid,
              "subsysnqn": t.subsysnqn}
    path = BlockPath(target)
    try:
        assert path.device == nvmeof_namespace.device
        assert path.transport == "rdma" and path.is_block_device and path.direct
        assert path.lba_size == nvmeof_namespace.lba_size and path.capacity == nvmeof_namespace.capacity
        d = path.describe()
        assert d["target"]["kind"] == "nvmeof" and d["target"]["controller"] == path.controller.name
        assert not any("image file" in f for f in d["fallbacks"])
        with BlockStore(path, size_classes=CLASSES, capacity=STORE_BYTES, format=True) as store:
            store.put_many({f"k{i}": bytes([i]) * 70_000 for i in range(16)}, durable=True)
            assert store.get("k7") == bytes([7]) * 70_000
            assert store.stats()["transport"] == "rdma"
        assert path.counters.snapshot()["bytes_direct"] >= 16 * 70_000
    finally:
        path.close()


def test_sigkill_trials_on_the_nvmeof_namespace(nvmeof_namespace: Any, tmp_path: Any) -> None:
    """The block store's crash test (a child putting, overwriting, deleting and flushing, SIGKILLed at random) on
    the real namespace: every flushed put survives bit-exactly, nothing torn or older comes back."""
    from sfstore.testing.block_crash import run_trials

    report = run_trials(tmp_path, 8, seed=3, target=nvmeof_namespace.device)
    assert report.failures == [], report.failures
    assert report.trials == 8 and report.flushes >= 8
