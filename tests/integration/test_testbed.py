"""Self-checks of the testbed harness: the endpoints carry data over RDMA before sfstore is asked to."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .endpoints import NvmeofTarget, env, find_controller


def test_rdma_device_is_active() -> None:
    dev = env("SFSTORE_TEST_RDMA_DEVICE")
    state = Path(f"/sys/class/infiniband/{dev}/ports/1/state").read_text()
    assert "ACTIVE" in state


def test_nfs_mount_moves_data_over_rdma(nfs_mount: Path, nfs_export: Path) -> None:
    mountstats = Path("/proc/self/mountstats").read_text()
    block = mountstats.split(f"mounted on {nfs_mount} with fstype")[1].split("device ")[0]
    assert "xprt:\trdma" in block or "xprt: rdma" in block, block
    data = os.urandom(1 << 20)
    (nfs_mount / "testbed-selfcheck.bin").write_bytes(data)
    os.sync()
    assert (nfs_export / "testbed-selfcheck.bin").read_bytes() == data  # landed on the server side
    (nfs_mount / "testbed-selfcheck.bin").unlink()


def test_nvmeof_target_is_not_connected_by_the_setup(nvmeof_target: NvmeofTarget) -> None:
    # the tests connect themselves (libnvme through BlockPath, or nvme-cli in a fixture)
    assert find_controller(nvmeof_target.subsysnqn) is None


def test_nvmeof_target_answers_discovery(nvmeof_target: NvmeofTarget) -> None:
    t = nvmeof_target
    out = subprocess.run(["nvme", "discover", "-t", t.transport, "-a", t.traddr, "-s", t.trsvcid],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert t.subsysnqn in out and "rdma" in out
