"""`sfstore probe --json` inside the testbed sees the real endpoints: rxe0 through pyverbs, the NFS mount with
proto=rdma, and the NVMe-oF controller (connected here with nvme-cli by the ``nvme_cli_controller`` fixture)
with transport rdma."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .endpoints import NvmeofTarget, env


def _sfstore_probe(*args: str) -> dict[str, Any]:
    exe = shutil.which("sfstore")  # the console script of the installed wheel
    cmd = [exe] if exe else [sys.executable, "-m", "sfstore.cli"]
    result = subprocess.run([*cmd, "probe", "--json", *args], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


@pytest.fixture(scope="module")
def report(nvme_cli_controller: dict[str, Any]) -> dict[str, Any]:
    return _sfstore_probe()


def test_probe_sees_the_rdma_device_through_pyverbs(report: dict[str, Any]) -> None:
    rdma = report["rdma"]
    assert rdma["status"] == "ok" and rdma["source"] == "pyverbs", rdma
    devices = {d["name"]: d for d in rdma["devices"]}
    name = env("SFSTORE_TEST_RDMA_DEVICE")
    assert name in devices, f"{name} not in {sorted(devices)}"
    dev = devices[name]
    assert dev["node_guid"] and dev["node_guid"] != "0000:0000:0000:0000"
    (port,) = dev["ports"]
    assert (port["port"], port["state"], port["link_layer"]) == (1, "ACTIVE", "Ethernet")
    assert port["netdev"] == env("SFSTORE_TEST_RDMA_NETDEV") == dev["parent"]
    assert port["active_mtu"] in (256, 512, 1024, 2048, 4096)


def test_probe_sees_the_nfs_mount_over_rdma(report: dict[str, Any]) -> None:
    nfs = report["nfs"]
    assert nfs["status"] == "ok" and nfs["rdma_mounts"] >= 1
    mounts = {m["mountpoint"]: m for m in nfs["mounts"]}
    m = mounts[env("SFSTORE_TEST_NFS_MOUNT")]
    assert m["proto"] == "rdma" and m["port"] == 20049 and m["vers"] == "4.2" and m["fstype"] == "nfs4"
    assert m["source"] == env("SFSTORE_TEST_NFS_SERVER")
    assert m["rsize"] and m["wsize"] and m["nconnect"] == 1


def test_probe_sees_the_nvmeof_controller_over_rdma(report: dict[str, Any], nvmeof_target: NvmeofTarget,
                                                    nvme_cli_controller: dict[str, Any]) -> None:
    nvme = report["nvmeof"]
    assert nvme["status"] == "ok" and nvme["fabrics_available"] is True
    ctrls = [c for c in nvme["controllers"] if c["subsysnqn"] == nvmeof_target.subsysnqn]
    assert len(ctrls) == 1, nvme["controllers"]
    c = ctrls[0]
    assert c["name"] == nvme_cli_controller["name"]
    assert (c["transport"], c["traddr"], c["trsvcid"], c["state"]) == (
        "rdma", nvmeof_target.traddr, nvmeof_target.trsvcid, "live")
    (ns,) = c["namespaces"]
    assert ns["device"] in nvme_cli_controller["devices"] and Path(ns["device"]).is_block_device()
    size = os.environ.get("SFSTORE_TEST_NVMEOF_SIZE_BYTES")
    assert ns["size_bytes"] and ns["logical_block_size"] in (512, 4096)
    if size:
        assert ns["size_bytes"] == int(size)


def test_probe_data_dir_on_the_nfs_rdma_mount(nfs_mount: Path) -> None:
    data = _sfstore_probe("--data-dir", str(nfs_mount / "sfstore-probe"))["data_dir"]
    assert data["status"] == "ok" and data["created"] is True
    assert data["mount"]["fstype"] == "nfs4" and data["mount"]["transport"] == "rdma"
    assert data["mount"]["mountpoint"] == str(nfs_mount)
    assert data["o_direct"]["ok"] is True, data["o_direct"]


def test_probe_reports_no_gpu_in_the_guest() -> None:
    report = _sfstore_probe()
    assert report["gpus"]["status"] == "absent" and report["gpus"]["reason"]
    assert report["gds"]["status"] == "absent"
