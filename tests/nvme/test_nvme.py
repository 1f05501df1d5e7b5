"""sfstore.nvme on any host: target validation, controllers from sysfs, typed errors where the kernel has no
NVMe over Fabrics, and the `sfstore nvme` command. Real connections are tested in the testbed
(tests/integration/test_nvme_libnvme.py)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sfstore import errors, nvme
from sfstore.nvme import NvmeofTarget

REPO = Path(__file__).resolve().parents[2]
NO_FABRICS = not os.path.exists("/dev/nvme-fabrics")
needs_no_fabrics = pytest.mark.skipif(not NO_FABRICS, reason="this kernel has nvme-fabrics (/dev/nvme-fabrics)")
NQN = "nqn.2024-01.io.sfstore:testbed"


# ---- NvmeofTarget


def test_from_mapping_fills_defaults() -> None:
    t = NvmeofTarget.from_mapping({"transport": "RDMA", "traddr": "10.0.0.1", "subsysnqn": NQN})
    assert (t.transport, t.traddr, t.trsvcid, t.subsysnqn) == ("rdma", "10.0.0.1", "4420", NQN)
    assert t.hostnqn is None and t.nr_io_queues is None
    assert str(t) == f"rdma 10.0.0.1:4420 {NQN}"
    assert t == NvmeofTarget("rdma", "10.0.0.1", "4420", NQN)


def test_from_mapping_converts_ports_and_numbers() -> None:
    t = NvmeofTarget.from_mapping({"transport": "tcp", "traddr": "fd00::1", "trsvcid": 8009, "subsysnqn": NQN,
                                   "nr_io_queues": "4", "ctrl_loss_tmo": "-1",
                                   "hostid": "5a6f39c5-7fbe-4fc8-bf0e-412752518b12",
                                   "hostnqn": "nqn.2014-08.org.nvmexpress:uuid:5a6f39c5"})
    assert (t.trsvcid, t.nr_io_queues, t.ctrl_loss_tmo) == ("8009", 4, -1)


def test_loop_needs_no_address() -> None:
    t = NvmeofTarget.from_mapping({"transport": "loop", "subsysnqn": NQN})
    assert (t.traddr, t.trsvcid) == ("", "") and str(t) == f"loop {NQN}"


@pytest.mark.parametrize(("mapping", "words"), [
    ({"transport": "rdma", "traddr": "10.0.0.1", "subsysnqm": NQN}, ["'subsysnqm'", "expected", "subsysnqn"]),
    ({"traddr": "10.0.0.1"}, ["needs 'transport'"]),
    ({"transport": "fc", "traddr": "x"}, ["'transport'", "rdma, tcp, loop", "'fc'"]),
    ({"transport": "rdma"}, ["'traddr' is required"]),
    ({"transport": "tcp", "traddr": "10.0.0.1", "trsvcid": "http"}, ["'trsvcid'", "1-65535"]),
    ({"transport": "tcp", "traddr": "10.0.0.1", "trsvcid": 70000}, ["'trsvcid'", "70000"]),
    ({"transport": "rdma", "traddr": "10.0.0.1", "subsysnqn": "testbed"}, ["'subsysnqn'", "NQN"]),
    ({"transport": "rdma", "traddr": "10.0.0.1,nr_io_queues=1"}, ["'traddr'", "','"]),
    ({"transport": "rdma", "traddr": "10.0.0.1", "hostid": "not-a-uuid"}, ["'hostid'", "UUID"]),
    ({"transport": "rdma", "traddr": "10.0.0.1", "nr_io_queues": 0}, ["'nr_io_queues'", "at least 1"]),
    ({"transport": "rdma", "traddr": "10.0.0.1", "nr_io_queues": True}, ["'nr_io_queues'", "integer"]),
    ({"transport": "rdma", "traddr": 10}, ["'traddr'", "string"]),
])
def test_from_mapping_rejects_bad_targets(mapping: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(errors.ConfigError) as info:
        NvmeofTarget.from_mapping(mapping, "sfstore.toml [block]")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith("sfstore.toml [block]: ")
    for word in words:
        assert word in message, message


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(errors.ConfigError) as info:
        NvmeofTarget("rdma", "", "0", "x")
    assert all(w in str(info.value) for w in ("'traddr'", "'trsvcid'", "'subsysnqn'"))


def test_from_mapping_needs_a_mapping() -> None:
    with pytest.raises(errors.ConfigError, match="must be a mapping"):
        NvmeofTarget.from_mapping(["rdma"], "here")  # type: ignore[arg-type]


def test_targets_are_frozen_and_hashable() -> None:
    t = NvmeofTarget("rdma", "10.0.0.1", subsysnqn=NQN)
    with pytest.raises(AttributeError):
        t.traddr = "10.0.0.2"  # type: ignore[misc]
    assert {t: 1}[NvmeofTarget("rdma", "10.0.0.1", "4420", NQN)] == 1


# ---- controllers from sysfs


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_list_controllers_on_this_host() -> None:
    ctrls = nvme.list_controllers()
    assert isinstance(ctrls, list)
    for c in ctrls:
        assert isinstance(c, nvme.Controller) and c.name.startswith("nvme") and c.state
        assert all(isinstance(n, nvme.Namespace) and n.capacity >= 0 and n.lba_size > 0 for n in c.namespaces)
    json.dumps([c.to_dict() for c in ctrls])
    if not os.path.isdir("/sys/class/nvme"):
        assert ctrls == []


def test_list_controllers_from_a_sysfs_tree(tmp_path: Path) -> None:
    cls, block = tmp_path / "class", tmp_path / "block"
    rdma = cls / "nvme1"
    _write(rdma / "transport", "rdma")
    _write(rdma / "address", "traddr=10.0.2.15,trsvcid=4420,src_addr=10.0.2.15")
    _write(rdma / "subsysnqn", NQN)
    _write(rdma / "state", "live")
    for ns in ("nvme0c1n2", "nvme0c1n1"):  # native multipath: path devices; the block devices are nvme0nN
        (rdma / ns).mkdir()
    _write(block / "nvme0n1" / "size", "524288")
    _write(block / "nvme0n1" / "queue" / "logical_block_size", "512")
    _write(block / "nvme0n1" / "nsid", "1")
    _write(block / "nvme0n2" / "size", "8")
    _write(block / "nvme0n2" / "queue" / "logical_block_size", "4096")
    pcie = cls / "nvme0"
    _write(pcie / "transport", "pcie")
    _write(pcie / "address", "0000:01:00.0")
    _write(pcie / "subsysnqn", "nqn.2014.08.org.nvmexpress:1b4b")
    _write(pcie / "state", "live")
    (pcie / "nvme2n1").mkdir()  # no block device (yet): not listed
    (cls / "nvme-subsys0").mkdir()  # not a controller
    c0, c1 = nvme.list_controllers(sys_class=str(cls), sys_block=str(block))
    assert (c0.name, c0.transport, c0.traddr, c0.trsvcid, c0.namespaces) == ("nvme0", "pcie", "0000:01:00.0", "",
                                                                              ())
    assert (c1.name, c1.transport, c1.traddr, c1.trsvcid, c1.subsysnqn, c1.state) == (
        "nvme1", "rdma", "10.0.2.15", "4420", NQN, "live")
    assert c1.namespaces == (nvme.Namespace("/dev/nvme0n1", "nvme0n1", 1, 512, 256 << 20),
                             nvme.Namespace("/dev/nvme0n2", "nvme0n2", 2, 4096, 4096))
    d = c1.to_dict()
    assert d["namespaces"][0] == {"device": "/dev/nvme0n1", "name": "nvme0n1", "nsid": 1, "lba_size": 512,
                                  "capacity": 256 << 20}
    assert json.loads(json.dumps(d)) == d


def test_list_controllers_without_sysfs(tmp_path: Path) -> None:
    assert nvme.list_controllers(sys_class=str(tmp_path / "none"), sys_block=str(tmp_path)) == []


# ---- this host: no nvme-fabrics, so nothing connects (before libnvme is touched)


def test_fabrics_supported_says_why(tmp_path: Path) -> None:
    ok, why = nvme.fabrics_supported()
    assert ok is not NO_FABRICS and "/dev/nvme-fabrics" in why
    ok, why = nvme.fabrics_supported(str(tmp_path / "nvme-fabrics"))
    assert ok is False and "modprobe nvme-fabrics" in why
    (tmp_path / "nvme-fabrics").write_text("")
    assert nvme.fabrics_supported(str(tmp_path / "nvme-fabrics"))[0] is True


def test_libnvme_status_is_a_verdict_with_a_reason() -> None:
    ok, why = nvme.libnvme_status()
    assert isinstance(ok, bool) and why
    assert why.startswith("libnvme ") if ok else ("python3-nvme" in why or "swig" in why or "import" in why)


@needs_no_fabrics
@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_connect_and_discover_are_not_supported_here(transport: str) -> None:
    target = NvmeofTarget(transport, "10.0.0.1", subsysnqn=NQN)
    for call in (nvme.connect, nvme.discover):
        with pytest.raises(errors.NotSupportedOnHostError) as info:
            call(target)  # type: ignore[operator]
        assert isinstance(info.value, NotImplementedError)
        message = str(info.value)
        assert "not supported on this host" in message and "/dev/nvme-fabrics is missing" in message
        assert f"nvme-{transport}" in message


def test_connect_needs_a_subsystem_nqn() -> None:
    with pytest.raises(errors.ConfigError, match="subsysnqn"):
        nvme.connect(NvmeofTarget("rdma", "10.0.0.1"))


def test_disconnect_with_nothing_connected_is_false() -> None:
    target = NvmeofTarget("rdma", "192.0.2.1", subsysnqn="nqn.2024-01.io.sfstore:nothing-here")
    assert nvme.disconnect(target) is False
    unused = next(f"nvme{i}" for i in range(1000, 2000) if not os.path.exists(f"/sys/class/nvme/nvme{i}"))
    assert nvme.disconnect(unused) is False
    with pytest.raises(errors.ConfigError):
        nvme.disconnect("/dev/sda")


def test_nvme_error_is_an_os_error_with_the_target() -> None:
    target = NvmeofTarget("rdma", "10.0.0.1", subsysnqn=NQN)
    exc = errors.NvmeError(errno.ECONNREFUSED, f"cannot connect to {target}: connection refused", target)
    assert isinstance(exc, errors.SfstoreOSError) and isinstance(exc, OSError)
    assert exc.errno == errno.ECONNREFUSED and exc.target == target and str(target) in str(exc)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is errors.NvmeError and again.errno == errno.ECONNREFUSED


# ---- the command


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "sfstore.cli", "nvme", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120, check=False)


@needs_no_fabrics
def test_cli_connect_says_not_supported_in_one_line() -> None:
    result = _cli("connect", "-t", "rdma", "-a", "10.0.0.1", "-n", "nqn.x")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("sfstore nvme: error: ") and "not supported on this host" in result.stderr
    result = _cli("discover", "-a", "10.0.0.1", "--json")
    assert result.returncode == 1 and "not supported on this host" in result.stderr


def test_cli_bad_target_and_usage() -> None:
    result = _cli("connect", "-a", "10.0.0.1", "-s", "99999", "-n", "nqn.x")
    assert result.returncode == 1 and "'trsvcid'" in result.stderr and "Traceback" not in result.stderr
    result = _cli("connect", "-a", "10.0.0.1")  # no -n: a usage error
    assert result.returncode == 2 and "--nqn" in result.stderr
    result = _cli()
    assert result.returncode == 2 and "ACTION" in result.stderr


def test_cli_list() -> None:
    result = _cli("list", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert isinstance(listed, list) and all({"name", "transport", "namespaces"} <= set(c) for c in listed)
    table = _cli("list")
    assert table.returncode == 0
    if not listed:
        assert table.stdout.strip() == "no NVMe controllers"
    else:
        assert all(c["name"] in table.stdout for c in listed)


def test_cli_disconnect_with_nothing_connected() -> None:
    result = _cli("disconnect", "-n", "nqn.2024-01.io.sfstore:nothing-here")
    assert result.returncode == 0 and "nothing to disconnect" in result.stdout
    result = _cli("disconnect")
    assert result.returncode == 1 and "-n NQN" in result.stderr
