"""sfstore.probe and `sfstore probe`: every section reported, absent hardware as absent, never an exception."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import sfstore
from sfstore import probe as probe_mod
from sfstore import quarantine_records
from sfstore.mounts import mount_for, parse_mountinfo
from sfstore.probe import (
    SECTIONS,
    format_table,
    probe,
    probe_data_dir,
    probe_engine,
    probe_gds,
    probe_gpus,
    probe_memory,
    probe_nfs,
    probe_nvmeof,
    probe_rdma,
)

REPO = Path(__file__).resolve().parents[1]
STATUSES = {"ok", "absent", "unavailable", "compat", "error"}
SAMPLE = "\n".join([
    "23 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw",
    "412 23 0:52 / /mnt/nfs rw,relatime shared:211 - nfs4 10.0.2.15:/export rw,vers=4.2,rsize=262144,"
    "wsize=262144,hard,proto=rdma,port=20049,addr=10.0.2.15",
    "500 23 0:60 / /data rw,noatime - nfs 192.168.1.10:/vol rw,vers=3,rsize=1048576,wsize=1048576,nconnect=8,"
    "proto=tcp,addr=192.168.1.10",
])


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _no_rdma_here() -> bool:
    return not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband")


def _no_nvme_here() -> bool:
    controllers = os.listdir("/sys/class/nvme") if os.path.isdir("/sys/class/nvme") else []
    return not controllers and not os.path.exists("/dev/nvme-fabrics")


def test_probe_reports_every_section_as_json(tmp_path: Path) -> None:
    report = probe(data_dir=str(tmp_path / "data"))
    assert list(report) == list(SECTIONS)
    for name, section in report.items():
        assert section["status"] in STATUSES, name
        if section["status"] != "ok":
            assert section.get("reason"), f"{name} is {section['status']} without a reason"
    assert json.loads(json.dumps(report)) == report
    assert report["system"]["sfstore"] == sfstore.__version__


def test_data_dir_is_created_and_described(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    section = probe_data_dir(str(target))
    assert section["status"] == "ok" and section["created"] is True and target.is_dir()
    assert section["path"] == str(target) and section["writable"] is True
    assert section["mount"]["fstype"] == mount_for(target).fstype
    assert isinstance(section["o_direct"]["ok"], bool) and section["o_direct"]["reason"]
    assert not list(target.iterdir()), "the O_DIRECT check left its file behind"
    alignment = section["alignment"]
    if alignment["memory"] is not None:
        assert alignment["memory"] > 0 and alignment["offset"] > 0
    assert probe_data_dir(str(target))["created"] is False


def test_data_dir_follows_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path / "from-env"))
    assert probe_data_dir()["path"] == str(tmp_path / "from-env")
    assert (tmp_path / "from-env").is_dir()


def test_data_dir_that_cannot_be_created_is_an_error_section(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    section = probe_data_dir(str(blocker / "sub"))
    assert section["status"] == "error" and "cannot create" in section["reason"]


def test_nfs_section_from_sample_mounts() -> None:
    section = probe_nfs(parse_mountinfo(SAMPLE))
    assert section["status"] == "ok" and section["rdma_mounts"] == 1
    rdma, tcp = section["mounts"]
    assert (rdma["mountpoint"], rdma["source"], rdma["vers"], rdma["proto"], rdma["port"]) == (
        "/mnt/nfs", "10.0.2.15:/export", "4.2", "rdma", 20049)
    assert (rdma["rsize"], rdma["wsize"], rdma["nconnect"]) == (262144, 262144, 1)
    assert (tcp["proto"], tcp["vers"], tcp["nconnect"], tcp["rsize"]) == ("tcp", "3", 8, 1 << 20)


def test_nfs_section_absent_without_nfs_mounts() -> None:
    section = probe_nfs(parse_mountinfo(SAMPLE.splitlines()[0]))
    assert section == {"status": "absent", "reason": "no NFS mounts in /proc/self/mountinfo", "mounts": []}


def test_rdma_from_sysfs(tmp_path: Path) -> None:
    dev = tmp_path / "rxe0"
    _write(dev / "node_guid", "5054:00ff:fe12:3456")
    _write(dev / "node_type", "1: CA")
    _write(dev / "parent", "eth0")
    _write(dev / "ports" / "1" / "state", "4: ACTIVE")
    _write(dev / "ports" / "1" / "link_layer", "Ethernet")
    _write(dev / "ports" / "1" / "gid_attrs" / "ndevs" / "0", "eth0")
    section = probe_rdma(sys_class=str(tmp_path), use_pyverbs=False)
    assert section["status"] == "ok" and section["source"] == "sysfs"
    (device,) = section["devices"]
    assert device["name"] == "rxe0" and device["node_guid"] == "5054:00ff:fe12:3456"
    assert device["ports"] == [{"port": 1, "state": "ACTIVE", "link_layer": "Ethernet", "active_mtu": None,
                                "netdev": "eth0"}]


def test_rdma_absent(tmp_path: Path) -> None:
    section = probe_rdma(sys_class=str(tmp_path / "none"), use_pyverbs=False)
    assert section["status"] == "absent" and section["source"] == "none" and section["devices"] == []
    assert section["reason"]


@pytest.mark.skipif(not _no_rdma_here(), reason="this host has RDMA devices")
def test_rdma_absent_on_this_host() -> None:
    section = probe_rdma()
    assert section["status"] == "absent" and section["devices"] == []
    assert isinstance(section["pyverbs"]["available"], bool) and section["pyverbs"]["reason"]


def test_nvmeof_from_sysfs(tmp_path: Path) -> None:
    cls, block = tmp_path / "class", tmp_path / "block"
    ctrl = cls / "nvme0"
    _write(ctrl / "transport", "rdma")
    _write(ctrl / "address", "traddr=10.0.2.15,trsvcid=4420,src_addr=10.0.2.15")
    _write(ctrl / "subsysnqn", "nqn.2024-01.io.sfstore:testbed")
    _write(ctrl / "state", "live")
    _write(ctrl / "model", "Linux")
    (ctrl / "nvme0c0n1").mkdir()  # native multipath: the path device; the block device is nvme0n1
    _write(block / "nvme0n1" / "size", "524288")
    _write(block / "nvme0n1" / "queue" / "logical_block_size", "512")
    section = probe_nvmeof(sys_class=str(cls), fabrics_dev=str(tmp_path / "nvme-fabrics"), sys_block=str(block))
    assert section["status"] == "ok" and section["fabrics_available"] is False
    (c,) = section["controllers"]
    assert (c["name"], c["transport"], c["traddr"], c["trsvcid"], c["subsysnqn"], c["state"]) == (
        "nvme0", "rdma", "10.0.2.15", "4420", "nqn.2024-01.io.sfstore:testbed", "live")
    assert c["namespaces"] == [{"name": "nvme0n1", "device": "/dev/nvme0n1", "size_bytes": 256 << 20,
                                "logical_block_size": 512}]


def test_nvmeof_fabrics_without_controllers(tmp_path: Path) -> None:
    (tmp_path / "nvme-fabrics").write_text("")
    section = probe_nvmeof(sys_class=str(tmp_path / "none"), fabrics_dev=str(tmp_path / "nvme-fabrics"))
    assert section["status"] == "ok" and section["fabrics_available"] is True and section["controllers"] == []
    assert "nvme-fabrics" in section["fabrics_reason"]
    assert isinstance(section["libnvme"]["available"], bool) and section["libnvme"]["reason"]


def test_nvmeof_absent(tmp_path: Path) -> None:
    section = probe_nvmeof(sys_class=str(tmp_path / "none"), fabrics_dev=str(tmp_path / "no-fabrics"))
    assert section["status"] == "absent" and section["controllers"] == [] and section["reason"]


def test_gds_and_gpus_report_what_is_missing() -> None:
    gds, gpus = probe_gds(), probe_gpus()
    assert gds["status"] in ("ok", "compat", "absent")
    assert set(gds) >= {"cufile", "nvidia_fs", "kvikio"}
    assert gpus["status"] in ("ok", "absent", "error") and isinstance(gpus["count"], int)
    if gpus["status"] == "ok":
        assert gpus["count"] == len(gpus["devices"]) > 0
    else:
        assert gpus["reason"] and gpus["devices"] == []


def test_gpus_absent_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_mod, "_load", lambda names: (None, "libcuda.so.1: not found"))
    assert probe_gpus() == {"status": "absent", "reason": "no CUDA driver: libcuda.so.1: not found", "count": 0,
                            "devices": []}


def test_missing_engine_and_buffers_modules_degrade(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "sfstore.engine", None)  # makes `import sfstore.engine` fail
    monkeypatch.setitem(sys.modules, "sfstore.buffers", None)
    engine = probe_engine()
    assert engine["status"] == "unavailable" and "sfstore.engine" in engine["reason"]
    memory = probe_memory()
    assert memory["status"] == "unavailable" and "memlock_soft" in memory
    data = probe_data_dir(str(tmp_path))
    assert data["status"] == "ok" and data["alignment"]["memory"] is None and data["alignment"]["reason"]


def test_a_failing_section_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom() -> dict[str, Any]:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(probe_mod, "probe_gds", boom)
    report = probe(data_dir=str(tmp_path))
    assert report["gds"] == {"status": "error", "reason": "RuntimeError: driver exploded"}
    assert report["system"]["status"] == "ok" and report["data_dir"]["status"] == "ok"


def test_table_lists_every_section_with_aligned_columns() -> None:
    report = {
        "system": {"status": "ok", "kernel": "6.1", "python": "3.11"},
        "nfs": probe_nfs(parse_mountinfo(SAMPLE)),
        "gpus": {"status": "absent", "reason": "no CUDA driver", "count": 0, "devices": []},
    }
    lines = format_table(report).splitlines()
    assert lines[0] == "system  ok"
    assert lines[1:3] == ["    kernel  6.1", "    python  3.11"]
    assert lines[3] == "nfs     ok"
    header, rdma, tcp = lines[4:7]
    assert header.split() == ["MOUNTPOINT", "SERVER:EXPORT", "VERS", "PROTO", "RSIZE", "WSIZE", "NCONNECT", "PORT"]
    assert rdma.split() == ["/mnt/nfs", "10.0.2.15:/export", "4.2", "rdma", "262144", "262144", "1", "20049"]
    assert tcp.split()[3] == "tcp"
    assert header.index("PROTO") == rdma.index("rdma") == tcp.index("tcp")
    assert lines[7] == "gpus    absent  (no CUDA driver)"


# ---- the command


def _cli(*args: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SFSTORE_DATA_DIR=str(data_dir), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "sfstore.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120, check=False)


def test_cli_probe_json(tmp_path: Path) -> None:
    result = _cli("probe", "--json", data_dir=tmp_path / "d")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {*SECTIONS, "routing"}
    assert all(report[s]["status"] in STATUSES for s in SECTIONS)
    assert report["data_dir"]["path"] == str(tmp_path / "d") and (tmp_path / "d").is_dir()
    if _no_rdma_here():
        assert report["rdma"]["status"] == "absent"
    if _no_nvme_here():
        assert report["nvmeof"]["status"] == "absent"
    if report["nfs"]["mounts"] == []:
        assert report["nfs"]["status"] == "absent"


def test_cli_probe_table(tmp_path: Path) -> None:
    result = _cli("probe", data_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    starts = [line.split()[0] for line in result.stdout.splitlines() if line and not line.startswith(" ")]
    assert starts == [*SECTIONS, "routing"]


def test_cli_probe_data_dir_option(tmp_path: Path) -> None:
    result = _cli("probe", "--json", "--data-dir", str(tmp_path / "opt"), data_dir=tmp_path / "env")
    assert json.loads(result.stdout)["data_dir"]["path"] == str(tmp_path / "opt")


def test_cli_probe_checks_the_data_dir_a_config_file_sets(tmp_path: Path) -> None:
    config = tmp_path / "sfstore.toml"
    config.write_text(f'data_dir = "{tmp_path / "from-config"}"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("SFSTORE_DATA_DIR", "SFSTORE_ROOT", "SFSTORE_CONFIG")}
    result = subprocess.run([sys.executable, "-m", "sfstore.cli", "probe", "--json", "--config", str(config)],
                            capture_output=True, text=True, env=dict(env, PYTHONPATH=str(REPO)), cwd=REPO,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["data_dir"]["path"] == str(tmp_path / "from-config")
    assert report["routing"].get("status") != "error", report["routing"]


def test_cli_version_and_usage(tmp_path: Path) -> None:
    result = _cli("--version", data_dir=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"sfstore {sfstore.__version__}"
    result = _cli(data_dir=tmp_path)
    assert result.returncode == 2 and "probe" in result.stderr
    result = _cli("frobnicate", data_dir=tmp_path)
    assert result.returncode == 2


def test_cli_main_in_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from sfstore.cli import main

    assert main(["probe", "--json", "--data-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["data_dir"]["path"] == str(tmp_path)


def test_probe_command_shows_routing_per_data_class(tmp_path: Path) -> None:
    import json as _json
    import subprocess as _sp
    import sys as _sys

    (tmp_path / "root").mkdir()  # a configured root must exist
    env = {**os.environ, "SFSTORE_DATA_DIR": str(tmp_path), "SFSTORE_ROOT": str(tmp_path / "root")}
    out = _sp.run([_sys.executable, "-m", "sfstore.cli", "probe", "--json"], capture_output=True, text=True,
                  env=env, timeout=60, check=True)
    routing = _json.loads(out.stdout)["routing"]
    assert routing["root"] == str(tmp_path / "root")
    assert routing["classes"]["dataset"]["transport"] == "local"
    assert routing["classes"]["dataset"]["fallbacks"]
    hot = routing["classes"]["hot"]
    assert hot["available"] and hot["path"] == "block" and hot["opened"] is False  # probing creates nothing
    assert routing["classes"]["kvcache"]["path"] == "device"
    text = _sp.run([_sys.executable, "-m", "sfstore.cli", "probe"], capture_output=True, text=True, env=env,
                   timeout=60, check=True).stdout
    assert "routing" in text and "dataset     file   local" in text


# ---- KV tiers quarantined by processes on this host


def test_kvcache_section_lists_the_quarantines_in_force_and_removes_the_others(tmp_path: Path) -> None:
    where = quarantine_records.quarantine_dir(str(tmp_path))
    assert where == str(tmp_path / ".kvcache-state" / "quarantine")
    assert probe_mod.probe_kvcache(str(tmp_path)) == {"status": "ok", "state_dir": where, "quarantined": []}
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    now = time.time()
    me = quarantine_records.host_name()
    base = {"host": me, "pid": os.getpid(), "tier": "shared", "target": "/mnt/kv", "namespace": "",
            "since": now - 3, "until": now + 60, "reason": "a read missed its deadline of 500 ms", "abandoned": 1,
            "deadline_ms": 500, "written": now}
    records = {
        "live": base,
        "elsewhere": {**base, "host": "node-b", "pid": 1, "namespace": "llama", "since": now - 1},
        "ended": {**base, "until": now - 1},
        "dead": {**base, "pid": int(dead.stdout)},  # its process is gone: its quarantine with it
    }
    for name, rec in records.items():
        quarantine_records.write_quarantine_record(where, name, rec)
    (Path(where) / "torn.json").write_bytes(b'{"v": 1, "host": ')
    (Path(where) / "fresh-torn.json").write_bytes(b'{"v": 1, "host": ')  # a writer may still be writing it
    (Path(where) / ".x.json.tmp-1-ab").write_bytes(b"{")
    for name in ("torn.json", ".x.json.tmp-1-ab"):
        os.utime(Path(where) / name, (now - 120, now - 120))
    report = probe(data_dir=str(tmp_path))["kvcache"]
    assert report["status"] == "ok"
    assert [(r["name"], r["host"], r["namespace"]) for r in report["quarantined"]] == [
        ("live", me, ""), ("elsewhere", "node-b", "llama")]  # oldest first
    assert sorted(os.listdir(where)) == ["elsewhere.json", "fresh-torn.json", "live.json"]
    text = format_table({"kvcache": report})
    lines = text.splitlines()
    assert lines[:2] == ["kvcache  ok", "    quarantined  2 tier(s)"]
    assert lines[2].split() == ["HOST", "PID", "TIER", "TARGET", "SINCE", "LEFT", "STUCK", "REASON"]
    assert lines[4].split()[:4] == ["node-b", "1", "shared", "(llama)"] and "missed its deadline" in lines[3]
    quarantine_records.remove_quarantine_record(where, "live")
    quarantine_records.remove_quarantine_record(where, "live")  # gone already: nothing
    assert [r["name"] for r in quarantine_records.read_quarantine_records(where)] == ["elsewhere"]


def test_a_quarantine_record_round_trips_and_foreign_ones_are_refused() -> None:
    rec = {"host": "h", "pid": 7, "tier": "block", "target": "/dev/nvme1n1", "namespace": "", "since": 1.5,
           "until": 2.5, "reason": "r", "abandoned": 0, "deadline_ms": 500, "written": 1.5}
    assert quarantine_records.parse_quarantine(quarantine_records.encode_quarantine(rec)) == rec
    for bad in (b"", b"[]", b'{"v": 2}', b'{"v": 1, "host": "h"}', b"\xff", b'{"v": 1, "pid": "x"}'):
        assert quarantine_records.parse_quarantine(bad) is None, bad
    assert not quarantine_records.quarantine_in_force(rec)  # ended long ago


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_record_writers_temporaries_are_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    """A quarantine record's temporary left by a killed writer (named by ``temp_name``) is removed by the next
    cleaning read at once (not a minute later); a live writer's (this process's), another host's recent one and
    a name sfstore does not write (a bare pid) are kept."""
    from sfstore import temp_names

    where = tmp_path / "q"
    where.mkdir()
    dead = _dead_pid()
    gone = [f".a.json.sfstore-tmp-{temp_names.host()}-{dead}-0123456789ab"]
    kept = [temp_names.temp_name("c.json", "tmp"), f".b.json.tmp-{dead}-ab12",
            f".e.json.sfstore-tmp-another_host-{dead}-0123456789ab"]
    for name in gone + kept:
        (where / name).write_bytes(b"{")
    assert quarantine_records.read_quarantine_records(str(where)) == []
    assert sorted(os.listdir(where)) == sorted(gone + kept)  # a read that does not clean removes nothing
    assert quarantine_records.read_quarantine_records(str(where), clean=True) == []
    assert sorted(os.listdir(where)) == sorted(kept)
    quarantine_records.write_quarantine_record(str(where), "r", {
        "host": "h", "pid": 1, "tier": "shared", "target": "", "namespace": "", "since": 0.0, "until": 1e12,
        "reason": "", "abandoned": 0, "deadline_ms": 1, "written": 0.0})
    assert sorted(os.listdir(where)) == sorted([*kept, "r.json"])  # its own temporary is renamed away


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="the O_DIRECT check runs only where O_DIRECT exists")
def test_the_o_direct_checks_leftovers_of_a_killed_probe_are_removed(tmp_path: Path) -> None:
    """The O_DIRECT check's file left by a killed probe is removed by the next probe of the directory; a live
    probe's, another file's and names sfstore does not write are kept."""
    from sfstore import temp_names

    dead = _dead_pid()
    gone = [f".o_direct.sfstore-probe-{temp_names.host()}-{dead}-0123456789ab"]
    kept = [temp_names.temp_name("o_direct", "probe"), f".sfstore-probe-{dead}", ".sfstore-probe-x",
            f".other.sfstore-probe-{temp_names.host()}-{dead}-0123456789ab"]
    for name in gone + kept:
        (tmp_path / name).write_bytes(b"")
    section = probe_data_dir(str(tmp_path))
    assert section["status"] == "ok"
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


# ---- a bad configuration: named at the top and the end, exit 1


def _probe_cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SFSTORE_")}
    base.update({"SFSTORE_DATA_DIR": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "xdg"), **env})
    base["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "sfstore.cli", "probe", *args], capture_output=True, text=True,
                          env=base, cwd=tmp_path, timeout=120, check=False)


def _assert_named_first_and_last(out: str, needle: str) -> None:
    lines = out.splitlines()
    assert lines[0].startswith("configuration  error"), out[:2000]
    assert needle in lines[1], out[:2000]
    tail = "\n".join(lines[-3:])
    assert needle in tail and "configuration  error" in "\n".join(lines[-4:]), out[-2000:]


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("bad-value", "[settings]\nqueue_depth = 'deep'\n", "[settings] queue_depth: invalid value 'deep'"),
        ("misspelt-key", "[settings]\nqueue_dept = 4\n", "did you mean queue_depth?"),
        ("invalid-toml", "[classes.hot]\ntarget = { kind = 'image',\n path = '/x' }\n", "line 2: not valid TOML"),
        ("missing", None, "does not exist"),
        ("directory", "", "is a directory"),
        ("missing-root", "root = '@TMP@/no-such-mount'\n", "does not exist"),
    ],
)
def test_cli_probe_exits_1_on_a_bad_config_file(tmp_path: Path, name: str, content: str | None,
                                               needle: str) -> None:
    cfg = tmp_path / f"{name}.toml"
    if name == "directory":
        cfg.mkdir()
    elif content is not None:
        cfg.write_text(content.replace("@TMP@", str(tmp_path)))
    result = _probe_cli(tmp_path, "--config", str(cfg))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    _assert_named_first_and_last(result.stdout, needle)
    assert str(cfg) in result.stdout.splitlines()[1]
    assert "configuration has 1 error(s)" in result.stderr
    assert not (tmp_path / "no-such-mount").exists()  # (the unfixed probe made it)
    as_json = _probe_cli(tmp_path, "--json", "--config", str(cfg))
    assert as_json.returncode == 1
    conf = json.loads(as_json.stdout)["routing"]["configuration"]
    assert conf["status"] == "error" and any(needle in p["message"] or needle in f"line {p['line']}: "
                                             + p["message"] for p in conf["problems"]), conf


@pytest.mark.parametrize(("var", "value", "section"), [("SFSTORE_QUEUE_DEPTH", "abc", "engine"),
                                                       ("SFSTORE_ENGINE", "iouring", "engine"),
                                                       ("SFSTORE_BUFFER_SIZE", "2q", None)])
def test_cli_probe_exits_1_on_a_bad_variable(tmp_path: Path, var: str, value: str, section: str | None) -> None:
    result = _probe_cli(tmp_path, **{var: value})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    _assert_named_first_and_last(result.stdout, f"environment variable {var}: invalid value {value!r}")
    if section:  # not "engine  ok" beside a setting the engine cannot be made with
        line = next(x for x in result.stdout.splitlines() if x.startswith(section + " "))
        assert line.split()[1] == "error" and var in line, line


def test_cli_probe_names_an_unknown_variable_and_exits_1(tmp_path: Path) -> None:
    result = _probe_cli(tmp_path, SFSTORE_QUEUEDEPTH="8")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("configuration  error") and "did you mean SFSTORE_QUEUE_DEPTH?" in lines[1]
    assert "did you mean SFSTORE_QUEUE_DEPTH?" in lines[-1]
    assert "ConfigWarning" not in result.stderr  # printed once, in the report


def test_cli_probe_read_only_data_dir_is_an_error_not_ok(tmp_path: Path) -> None:
    from tests.conftest import tmpfs_mount

    with tmpfs_mount(tmp_path / "ro") as read_only:
        read_only()
        result = _probe_cli(tmp_path, SFSTORE_DATA_DIR=str(tmp_path / "ro"))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("data_dir "))
    assert line.split()[1] == "error" and "read-only file system" in line and "SFSTORE_DATA_DIR" in line, line
    assert "writable          no" in result.stdout
    assert result.stdout.splitlines()[0].startswith("configuration  error")
