"""Integration tests: they run only inside the testbed guest (``tools/testbed/run``), over real RDMA.

The guest's ``guest-init`` brings the endpoints up and hands them over in environment variables:

=================================  ===========================================================================
``SFSTORE_TESTBED``                ``1`` inside the guest; without it every test here is skipped
``SFSTORE_TEST_IP``                the guest NIC's address (every endpoint listens on it)
``SFSTORE_TEST_RDMA_DEVICE``       soft-RoCE device (``rxe0``) and ``SFSTORE_TEST_RDMA_NETDEV`` its NIC
``SFSTORE_TEST_NFS_MOUNT``         NFS mount made with ``proto=rdma`` (``/mnt/nfs``); ``SFSTORE_TEST_NFS_EXPORT``
                                   is the exported directory on the (same) server, ``SFSTORE_TEST_NFS_SERVER``
                                   the ``server:/export`` source
``SFSTORE_TEST_NVMEOF_*``          ``TRANSPORT`` (rdma), ``TRADDR``, ``TRSVCID``, ``SUBSYSNQN`` of an NVMe-oF
                                   target with one loop-backed namespace (``BACKING`` is the loop device,
                                   ``SIZE_BYTES`` its size);
                                   it is NOT connected: tests connect (fixture ``nvme_cli_controller`` with
                                   nvme-cli, ``nvmeof_namespace`` with sfstore.nvme through libnvme)
``SFSTORE_TESTBED_SETUP_FAILED``   setup stages that failed (empty when all came up)
``SFSTORE_TEST_NODE``              two-node scenario only: ``prefill`` (node A, also the NFS and NVMe-oF
                                   server) or ``decode`` (node B, whose ``NFS_MOUNT`` is node A's export and
                                   whose ``NVMEOF_*`` name its own subsystem on node A's target);
                                   ``SFSTORE_TEST_PEER_IP`` the other node's address,
                                   ``SFSTORE_TEST_COORDINATOR`` node A's ``host:port`` for the tests' TCPStore,
                                   ``SFSTORE_TEST_NVMEOF_TARGET_BACKING`` (node A) a file of ``nqn loop image``
                                   lines, one per subsystem (``tests/integration/test_two_nodes.py``)
=================================  ===========================================================================
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .endpoints import NvmeofTarget, env, find_controller

IN_TESTBED = os.environ.get("SFSTORE_TESTBED") == "1"
SKIP_REASON = "integration tests run only inside the testbed VM (tools/testbed/run sets SFSTORE_TESTBED=1)"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/integration; skip them all outside the testbed."""
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)
            if not IN_TESTBED:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def nvmeof_target() -> NvmeofTarget:
    """The testbed's NVMe-oF target (not connected)."""
    return NvmeofTarget(env("SFSTORE_TEST_NVMEOF_TRANSPORT"), env("SFSTORE_TEST_NVMEOF_TRADDR"),
                        env("SFSTORE_TEST_NVMEOF_TRSVCID"), env("SFSTORE_TEST_NVMEOF_SUBSYSNQN"))


@pytest.fixture(scope="module")
def nvme_cli_controller(nvmeof_target: NvmeofTarget) -> Iterator[dict[str, Any]]:
    """Connect to the testbed target with nvme-cli for the module; disconnect afterwards.

    For tests that need a connected controller but do not test the connection itself (the probe). BlockPath's
    tests connect through libnvme instead.
    """
    t = nvmeof_target
    cmd = ["nvme", "connect", "-t", t.transport, "-a", t.traddr, "-s", t.trsvcid, "-n", t.subsysnqn]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
    try:
        deadline = time.monotonic() + 30
        found = find_controller(t.subsysnqn)
        while (found is None or not found["devices"] or not all(map(os.path.exists, found["devices"]))) \
                and time.monotonic() < deadline:
            time.sleep(0.25)
            found = find_controller(t.subsysnqn)
        if found is None or not found["devices"]:
            pytest.fail(f"nvme connect succeeded but no live controller with a namespace for {t.subsysnqn} appeared")
        yield found
    finally:
        subprocess.run(["nvme", "disconnect", "-n", t.subsysnqn], capture_output=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def nvmeof_namespace(nvmeof_target: NvmeofTarget) -> Iterator[Any]:
    """Connect to the testbed target with :func:`sfstore.nvme.connect` (libnvme) for the module; yield its first
    :class:`sfstore.nvme.Namespace` (the block device is there); disconnect afterwards."""
    from sfstore import nvme

    t = nvmeof_target
    target = nvme.NvmeofTarget(t.transport, t.traddr, t.trsvcid, t.subsysnqn)
    try:
        ctrl = nvme.connect(target, timeout=60)
        if not ctrl.namespaces:
            pytest.fail(f"sfstore.nvme.connect returned {ctrl.name} without a namespace")
        yield ctrl.namespaces[0]
    finally:
        nvme.disconnect(target)


@pytest.fixture(scope="session")
def rdma_device() -> str:
    """Name of the testbed's soft-RoCE device."""
    return env("SFSTORE_TEST_RDMA_DEVICE")


@pytest.fixture
def rdma_verbs(rdma_device: str) -> Iterator[tuple[Any, Any]]:
    """``(Context, PD)`` of pyverbs on the testbed's RDMA device (closed after the test)."""
    from pyverbs.device import Context
    from pyverbs.pd import PD

    ctx = Context(name=rdma_device)
    pd = PD(ctx)
    try:
        yield ctx, pd
    finally:
        pd.close()
        ctx.close()


@pytest.fixture(scope="session")
def nfs_mount() -> Path:
    """The NFS-over-RDMA mount point."""
    return Path(env("SFSTORE_TEST_NFS_MOUNT"))


@pytest.fixture(scope="session")
def nfs_export() -> Path:
    """The exported directory behind the NFS mount (the server is this same guest)."""
    return Path(env("SFSTORE_TEST_NFS_EXPORT"))
