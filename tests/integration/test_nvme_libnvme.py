"""sfstore.nvme over real NVMe over RDMA in the testbed: discover, connect (idempotent), list, disconnect through
libnvme (Debian's python3-nvme in the guest), and the `sfstore nvme` command."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sfstore import nvme
from sfstore.errors import NvmeError

from .endpoints import NvmeofTarget, env


def _sfstore(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("sfstore")  # the console script of the installed wheel
    cmd = [exe] if exe else [sys.executable, "-m", "sfstore.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=180, check=False)


def _of(nqn: str) -> list[nvme.Controller]:
    return [c for c in nvme.list_controllers() if c.subsysnqn == nqn and not c.state.startswith("deleting")]


@pytest.fixture(scope="module")
def target(nvmeof_target: NvmeofTarget) -> nvme.NvmeofTarget:
    t = nvmeof_target
    return nvme.NvmeofTarget(t.transport, t.traddr, t.trsvcid, t.subsysnqn)


@pytest.fixture(scope="module")
def connected(target: nvme.NvmeofTarget) -> Iterator[nvme.Controller]:
    """The controller sfstore.nvme.connect makes for this module (disconnected at the end whatever happens)."""
    assert _of(target.subsysnqn) == [], "the testbed target is already connected"
    try:
        yield nvme.connect(target, timeout=60)
    finally:
        nvme.disconnect(target)


def test_libnvme_and_fabrics_are_there() -> None:
    ok, why = nvme.libnvme_status()
    assert ok, why
    assert why.startswith("libnvme ")
    assert nvme.fabrics_supported()[0]


def test_discover_lists_the_subsystem(target: nvme.NvmeofTarget) -> None:
    entries = nvme.discover(target, timeout=60)
    mine = [e for e in entries if e["subsysnqn"] == target.subsysnqn]
    assert len(mine) == 1, entries
    e = mine[0]
    assert (e["transport"], e["traddr"], e["trsvcid"], e["subtype"]) == (
        "rdma", target.traddr, target.trsvcid, "nvme")
    assert _of(nvme.DISCOVERY_NQN) == [], "the discovery controller was left connected"
    assert _of(target.subsysnqn) == [], "discover connected the I/O subsystem"


def test_connect_gives_a_live_rdma_controller_with_the_namespace(
        target: nvme.NvmeofTarget, connected: nvme.Controller) -> None:
    c = connected
    assert (c.transport, c.traddr, c.trsvcid, c.subsysnqn, c.state) == (
        "rdma", target.traddr, target.trsvcid, target.subsysnqn, "live")
    (ns,) = c.namespaces
    assert Path(ns.device).is_block_device() and ns.device == f"/dev/{ns.name}"
    assert ns.nsid == 1 and ns.lba_size in (512, 4096)
    assert ns.capacity == int(env("SFSTORE_TEST_NVMEOF_SIZE_BYTES"))
    assert nvme.find_controller(target) == c


def test_connect_again_is_idempotent(target: nvme.NvmeofTarget, connected: nvme.Controller) -> None:
    again = nvme.connect(target, timeout=60)
    assert again.name == connected.name
    assert [c.name for c in _of(target.subsysnqn)] == [connected.name]
    result = _sfstore("nvme", "connect", "-t", target.transport, "-a", target.traddr, "-s", target.trsvcid,
                      "-n", target.subsysnqn, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["name"] == connected.name
    assert len(_of(target.subsysnqn)) == 1


def test_cli_list_json_shows_it(target: nvme.NvmeofTarget, connected: nvme.Controller) -> None:
    result = _sfstore("nvme", "list", "--json")
    assert result.returncode == 0, result.stderr
    listed = {c["name"]: c for c in json.loads(result.stdout)}
    assert listed[connected.name] == connected.to_dict()
    table = _sfstore("nvme", "list")
    assert table.returncode == 0 and connected.name in table.stdout and target.subsysnqn in table.stdout


def test_a_refused_connection_is_a_typed_error(target: nvme.NvmeofTarget) -> None:
    wrong = nvme.NvmeofTarget(target.transport, target.traddr, str(int(target.trsvcid) + 1), target.subsysnqn)
    with pytest.raises(NvmeError) as info:
        nvme.connect(wrong, timeout=60)
    assert info.value.errno and info.value.errno != errno.ETIMEDOUT, info.value
    assert info.value.target == wrong and str(wrong) in str(info.value)
    assert nvme.find_controller(wrong) is None


def test_disconnect(target: nvme.NvmeofTarget, connected: nvme.Controller) -> None:
    assert nvme.disconnect(target) is True
    deadline = time.monotonic() + 30
    while any(c.name == connected.name for c in nvme.list_controllers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/sys/class/nvme/{connected.name}")
    assert _of(target.subsysnqn) == [] and nvme.find_controller(target) is None
    assert nvme.disconnect(target) is False
    assert nvme.disconnect(connected.name) is False


def test_nvmeof_namespace_fixture(nvmeof_namespace: nvme.Namespace, target: nvme.NvmeofTarget) -> None:
    assert Path(nvmeof_namespace.device).is_block_device()
    assert nvmeof_namespace.capacity == int(env("SFSTORE_TEST_NVMEOF_SIZE_BYTES"))
    result = _sfstore("nvme", "disconnect", "-n", target.subsysnqn)  # the fixture's teardown then finds nothing
    assert result.returncode == 0 and "disconnected" in result.stdout, result.stderr
    assert _of(target.subsysnqn) == []
