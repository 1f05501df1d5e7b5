"""What this host offers sfstore: I/O engine, memory, data directory, RDMA, NFS, NVMe-oF, GDS, GPUs, and the KV
tiers that processes here have quarantined.

:func:`probe` returns a JSON-able dict with one section per subject. Every section has a ``status``:

``"ok"``
    present and usable;
``"absent"``
    the hardware, driver or software is not there (``reason`` says what was looked for);
``"unavailable"``
    the sfstore part that reports it is not built or importable here (``reason`` says why);
``"compat"``
    (``gds`` only) kvikio works, but without the GPU-direct driver: it moves data through host memory;
``"error"``
    probing failed unexpectedly (``reason`` holds the error); the other sections are still reported.

Nothing here raises for missing hardware: a laptop, a CI container and a GPU node all get a full report.
``sfstore probe`` prints it as a table, ``sfstore probe --json`` as JSON.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import importlib
import json
import os
import platform
import resource
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sfstore import defaults, nvme, temp_names
from sfstore.errors import ConfigError
from sfstore.mounts import MountInfo, mount_for, read_mountinfo
from sfstore.nvme import read_sysfs
from sfstore.quarantine_records import quarantine_dir, quarantine_rows, read_quarantine_records
from sfstore.text_tables import cell, grid
from sfstore.version import VERSION

__all__ = [
    "SECTIONS",
    "probe",
    "probe_system",
    "probe_engine",
    "probe_memory",
    "probe_data_dir",
    "probe_rdma",
    "probe_nfs",
    "probe_nvmeof",
    "probe_gds",
    "probe_gpus",
    "probe_kvcache",
    "format_table",
]

SECTIONS = ("system", "engine", "memory", "data_dir", "rdma", "nfs", "nvmeof", "gds", "gpus", "kvcache")

SYS_INFINIBAND = "/sys/class/infiniband"
SYS_NVME = "/sys/class/nvme"
DEV_NVME_FABRICS = "/dev/nvme-fabrics"
PROC_NVIDIA_FS = "/proc/driver/nvidia-fs"

# enum ibv_port_state
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
# IBV_LINK_LAYER_*
LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
# enum ibv_mtu
MTUS = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def _absent(reason: str, **extra: Any) -> dict[str, Any]:
    return {"status": "absent", "reason": reason, **extra}


def _error(exc: BaseException) -> dict[str, Any]:
    return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _guid(value: int) -> str:
    """Format a 64-bit GUID as verbs tools do: ``0011:2233:4455:6677``."""
    raw = f"{value:016x}"
    return ":".join(raw[i:i + 4] for i in range(0, 16, 4))


# --------------------------------------------------------------------------------------------------------
# system, engine, memory


def probe_system() -> dict[str, Any]:
    """Kernel, machine, Python and sfstore versions."""
    return {
        "status": "ok",
        "sfstore": VERSION,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "hostname": platform.node(),
    }


_ENGINE_SETTINGS = ("engine", "queue_depth", "io_threads", "uring_spin_us", "direct_io", "bounce",
                    "bounce_buffer_size")


def probe_engine() -> dict[str, Any]:
    """The I/O engines that can run here and the one the ``engine`` setting selects."""
    try:
        engine = importlib.import_module("sfstore.engine")
    except ImportError as exc:
        return {"status": "unavailable", "reason": f"sfstore.engine cannot be imported: {exc}"}
    describe: Callable[[], dict[str, Any]] | None = getattr(engine, "describe_engines", None)
    if describe is None:
        return {"status": "unavailable", "reason": "sfstore.engine has no describe_engines()"}
    for name in _ENGINE_SETTINGS:  # an engine cannot be made with a setting that does not parse
        try:
            defaults.get(name)
        except ConfigError as exc:
            return {"status": "error", "reason": str(exc)}
    info = dict(describe())
    selected = info.get("selected")
    status = "ok" if selected else "unavailable"
    result: dict[str, Any] = {"status": status}
    if not selected:
        result["reason"] = str(info.get("why", "no engine can run here"))
    result.update(info)
    return result


def probe_memory() -> dict[str, Any]:
    """What registered buffers can get here: mlock, huge pages, CUDA host registration.

    From ``sfstore.buffers.memory_capabilities()``; where that is not importable, only ``RLIMIT_MEMLOCK``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limits = {
        "memlock_soft": None if soft == resource.RLIM_INFINITY else soft,
        "memlock_hard": None if hard == resource.RLIM_INFINITY else hard,
    }
    try:
        buffers = importlib.import_module("sfstore.buffers")
    except ImportError as exc:
        return {"status": "unavailable", "reason": f"sfstore.buffers cannot be imported: {exc}", **limits}
    capabilities: Callable[[], dict[str, Any]] | None = getattr(buffers, "memory_capabilities", None)
    if capabilities is None:
        return {"status": "unavailable", "reason": "sfstore.buffers has no memory_capabilities() yet", **limits}
    return {"status": "ok", **capabilities()}


# --------------------------------------------------------------------------------------------------------
# data directory


# The O_DIRECT check's file: temp_names.temp_name(_PROBE_FINAL, _PROBE_KIND), removed at once
_PROBE_FINAL, _PROBE_KIND = "o_direct", "probe"


def _remove_probe_leftovers(directory: str) -> None:
    """Remove the O_DIRECT check's files in ``directory`` that a killed check left (its process is gone)."""
    try:
        with os.scandir(directory) as it:
            names = [e.name for e in it if e.name.startswith(".")]
    except OSError:
        return  # the check itself says what is wrong with the directory
    for name in names:
        tn = temp_names.parse(name)
        path = os.path.join(directory, name)
        try:
            if tn is not None and tn.final == _PROBE_FINAL and tn.kind == _PROBE_KIND and \
                    temp_names.is_leftover(tn, path):
                os.unlink(path)
        except OSError:
            pass  # removed by another probe, or not ours to remove


def _o_direct_check(directory: str) -> dict[str, Any]:
    """Try creating a file with ``O_DIRECT`` in ``directory``."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return {"ok": False, "reason": "this platform has no O_DIRECT"}
    _remove_probe_leftovers(directory)
    name = os.path.join(directory, temp_names.temp_name(_PROBE_FINAL, _PROBE_KIND))
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | o_direct | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        reason = ("the filesystem refuses O_DIRECT" if exc.errno == errno.EINVAL
                  else f"cannot create a file there: {exc.strerror}")
        return {"ok": False, "reason": reason}
    os.close(fd)
    os.unlink(name)
    return {"ok": True, "reason": "O_DIRECT opens succeed"}


def _alignment(directory: str) -> dict[str, Any]:
    try:
        engine = importlib.import_module("sfstore.engine")
        memory, offset = engine.direct_io_alignment(directory)
    except ImportError as exc:
        return {"memory": None, "offset": None, "reason": f"sfstore.engine cannot be imported: {exc}"}
    except AttributeError:
        return {"memory": None, "offset": None, "reason": "sfstore.engine has no direct_io_alignment()"}
    return {"memory": int(memory), "offset": int(offset)}


def _read_only_fs(directory: str) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def probe_data_dir(path: str | None = None) -> dict[str, Any]:
    """The embedded data directory: where it is (created if missing), its filesystem and O_DIRECT support.

    Parameters
    ----------
    path : str, optional
        The directory; default the ``data_dir`` setting (``SFSTORE_DATA_DIR``).
    """
    directory = os.path.abspath(os.path.expanduser(path)) if path else str(defaults.get("data_dir"))
    result: dict[str, Any] = {"status": "ok", "path": directory, "created": False}
    if not os.path.isdir(directory):
        try:
            os.makedirs(directory, exist_ok=True)
            result["created"] = True
        except OSError as exc:
            return {"status": "error", "path": directory, "reason": f"cannot create it: {exc.strerror or exc}"}
    result["writable"] = os.access(directory, os.W_OK)
    if not result["writable"]:
        # sfstore writes here (the block image, KV quarantine records, checkpoints by default): not "ok".
        why = "on a read-only file system" if _read_only_fs(directory) else "not writable by this user"
        result["status"] = "error"
        result["reason"] = (f"{directory} is {why}; set SFSTORE_DATA_DIR (or data_dir in the config file) to a "
                            "writable directory")
    try:
        mount = mount_for(directory)
        result["mount"] = {"mountpoint": mount.mountpoint, "fstype": mount.fstype, "source": mount.source,
                           "transport": mount.transport}
    except Exception as exc:  # the mount table is optional information
        result["mount"] = {"mountpoint": None, "fstype": None, "source": None, "transport": None,
                           "reason": str(exc)}
    result["o_direct"] = _o_direct_check(directory)
    result["alignment"] = _alignment(directory)
    return result


# --------------------------------------------------------------------------------------------------------
# RDMA


def _sysfs_rdma_devices(sys_class: str) -> list[dict[str, Any]]:
    devices = []
    for dev_dir in sorted(glob.glob(os.path.join(sys_class, "*"))):
        name = os.path.basename(dev_dir)
        ports = []
        for port_dir in sorted(glob.glob(os.path.join(dev_dir, "ports", "*")), key=lambda p: int(
                os.path.basename(p)) if os.path.basename(p).isdigit() else 0):
            state = read_sysfs(os.path.join(port_dir, "state")) or ""  # "4: ACTIVE"
            ports.append({
                "port": int(os.path.basename(port_dir)) if os.path.basename(port_dir).isdigit() else None,
                "state": state.split(":", 1)[-1].strip() or None,
                "link_layer": read_sysfs(os.path.join(port_dir, "link_layer")),
                "active_mtu": None,
                "netdev": read_sysfs(os.path.join(port_dir, "gid_attrs", "ndevs", "0")),
            })
        devices.append({
            "name": name,
            "node_guid": read_sysfs(os.path.join(dev_dir, "node_guid")),
            "node_type": read_sysfs(os.path.join(dev_dir, "node_type")),
            "parent": read_sysfs(os.path.join(dev_dir, "parent")),
            "ports": ports,
        })
    return devices


def _pyverbs_devices(sys_class: str) -> list[dict[str, Any]]:
    device_mod = importlib.import_module("pyverbs.device")
    devices = []
    for dev in device_mod.get_device_list():
        name = _text(dev.name)
        entry: dict[str, Any] = {"name": name, "node_guid": _guid(int(dev.guid)), "node_type": None,
                                 "parent": read_sysfs(os.path.join(sys_class, name, "parent")), "ports": []}
        ctx = device_mod.Context(name=name)
        try:
            attr = ctx.query_device()
            entry["node_type"] = read_sysfs(os.path.join(sys_class, name, "node_type"))
            for port in range(1, int(attr.phys_port_cnt) + 1):
                pattr = ctx.query_port(port)
                entry["ports"].append({
                    "port": port,
                    "state": PORT_STATES.get(int(pattr.state), str(pattr.state)),
                    "link_layer": LINK_LAYERS.get(int(pattr.link_layer), str(pattr.link_layer)),
                    "active_mtu": MTUS.get(int(pattr.active_mtu)),
                    "netdev": read_sysfs(os.path.join(sys_class, name, "ports", str(port), "gid_attrs", "ndevs", "0")),
                })
        finally:
            ctx.close()
        devices.append(entry)
    return devices


def probe_rdma(sys_class: str = SYS_INFINIBAND, use_pyverbs: bool = True) -> dict[str, Any]:
    """RDMA devices and their ports, through pyverbs where it imports, else from sysfs.

    ``source`` says which: ``"pyverbs"``, ``"sysfs"`` or ``"none"``; ``pyverbs`` says whether it imported.
    """
    pyverbs: dict[str, Any] = {"available": False, "reason": "not tried"}
    if use_pyverbs:
        try:
            importlib.import_module("pyverbs.device")
            pyverbs = {"available": True, "reason": "pyverbs imports"}
        except Exception as exc:  # ImportError, or a broken rdma-core install
            pyverbs = {"available": False,
                       "reason": f"pyverbs cannot be imported ({exc}); it ships with rdma-core (python3-pyverbs)"}
    if pyverbs["available"]:
        try:
            devices = _pyverbs_devices(sys_class)
            if devices:
                return {"status": "ok", "source": "pyverbs", "pyverbs": pyverbs, "devices": devices}
        except Exception as exc:
            pyverbs = {"available": True, "reason": f"pyverbs failed to list devices: {type(exc).__name__}: {exc}"}
    devices = _sysfs_rdma_devices(sys_class)
    if devices:
        return {"status": "ok", "source": "sysfs", "pyverbs": pyverbs, "devices": devices}
    return _absent(f"no RDMA devices (pyverbs lists none and {sys_class} is empty or missing)", source="none",
                   pyverbs=pyverbs, devices=[])


# --------------------------------------------------------------------------------------------------------
# NFS


def probe_nfs(mounts: Sequence[MountInfo] | None = None) -> dict[str, Any]:
    """Every NFS mount: mountpoint, server:export, vers, proto (``rdma`` is the direct path), sizes, port."""
    try:
        table = read_mountinfo() if mounts is None else list(mounts)
    except Exception as exc:
        return _absent(f"no mount table: {exc}", mounts=[])
    nfs = [m.nfs_facts() for m in table if m.is_nfs]
    if not nfs:
        return _absent("no NFS mounts in /proc/self/mountinfo", mounts=[])
    rdma = sum(1 for m in nfs if m["proto"] and str(m["proto"]).startswith("rdma"))
    return {"status": "ok", "rdma_mounts": rdma, "mounts": nfs}


# --------------------------------------------------------------------------------------------------------
# NVMe over fabrics


def probe_nvmeof(sys_class: str = SYS_NVME, fabrics_dev: str = DEV_NVME_FABRICS,
                 sys_block: str = "/sys/block") -> dict[str, Any]:
    """NVMe controllers (fabrics or local) with transport, address, subsystem NQN, state and namespaces.

    ``fabrics_available`` is whether ``/dev/nvme-fabrics`` exists (the ``nvme-fabrics`` module is loaded, so
    new NVMe-oF connections can be made), ``fabrics_reason`` says so or what to load; ``libnvme`` is whether
    libnvme's Python binding (what ``sfstore nvme connect`` and the block path connect with) imports, with
    its version or why not (:func:`sfstore.nvme.libnvme_status`). Sysfs reads and an import: nothing connects.
    """
    controllers = []
    for ctrl_dir in sorted(glob.glob(os.path.join(sys_class, "nvme*"))):
        name = os.path.basename(ctrl_dir)
        namespaces = []
        for ns_dir in sorted(glob.glob(os.path.join(ctrl_dir, "nvme*n*"))):
            ns = os.path.basename(ns_dir)
            # with native multipath the controller holds the path device nvme0c0n1; the block device is nvme0n1
            head = ns.split("c", 1)[0] + "n" + ns.rsplit("n", 1)[1] if "c" in ns[4:] else ns
            size = read_sysfs(os.path.join(sys_block, head, "size"))
            lbs = read_sysfs(os.path.join(sys_block, head, "queue", "logical_block_size"))
            namespaces.append({
                "name": head,
                "device": f"/dev/{head}",
                "size_bytes": int(size) * 512 if size and size.isdigit() else None,
                "logical_block_size": int(lbs) if lbs and lbs.isdigit() else None,
            })
        address = read_sysfs(os.path.join(ctrl_dir, "address"))
        controllers.append({
            "name": name,
            "transport": read_sysfs(os.path.join(ctrl_dir, "transport")),
            "address": address,
            **{k: v for k, v in nvme.parse_address(address).items() if k in ("traddr", "trsvcid", "host_traddr")},
            "subsysnqn": read_sysfs(os.path.join(ctrl_dir, "subsysnqn")),
            "state": read_sysfs(os.path.join(ctrl_dir, "state")),
            "model": read_sysfs(os.path.join(ctrl_dir, "model")),
            "namespaces": namespaces,
        })
    fabrics, fabrics_reason = nvme.fabrics_supported(fabrics_dev)
    libnvme_ok, libnvme_reason = nvme.libnvme_status()
    result: dict[str, Any] = {"fabrics_available": fabrics, "fabrics_reason": fabrics_reason,
                              "libnvme": {"available": libnvme_ok, "reason": libnvme_reason},
                              "controllers": controllers}
    if controllers or fabrics:
        return {"status": "ok", **result}
    return _absent(f"no NVMe controllers in {sys_class} and no {fabrics_dev} (nvme-fabrics module not loaded)",
                   **result)


# --------------------------------------------------------------------------------------------------------
# GPU-direct storage and GPUs


def _load(names: Sequence[str]) -> tuple[ctypes.CDLL | None, str]:
    """Load the first shared library of ``names`` that loads; return it and what happened."""
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name), name
        except OSError as exc:
            errors.append(str(exc))
    return None, "; ".join(errors)


def probe_gds() -> dict[str, Any]:
    """GPU-direct storage: libcufile, the nvidia-fs driver, and kvikio (with its compatibility mode)."""
    found = ctypes.util.find_library("cufile")
    lib, how = _load(["libcufile.so.0", *([found] if found else [])])
    cufile = {"loadable": lib is not None, "library": how if lib is not None else found, "reason":
              "loaded" if lib is not None else f"libcufile cannot be loaded ({how})"}
    nvidia_fs = os.path.exists(PROC_NVIDIA_FS)
    kvikio: dict[str, Any] = {"importable": False, "version": None, "compat_mode": None}
    try:
        mod = importlib.import_module("kvikio")
        kvikio["importable"] = True
        kvikio["version"] = getattr(mod, "__version__", None)
        try:
            kdefaults = importlib.import_module("kvikio.defaults")
            mode = kdefaults.compat_mode()
            kvikio["compat_mode"] = getattr(mode, "name", str(mode))
        except Exception as exc:
            kvikio["compat_mode_reason"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # ImportError, or kvikio failing to find CUDA
        kvikio["reason"] = f"kvikio cannot be imported ({type(exc).__name__}: {exc})"
    result: dict[str, Any] = {"cufile": cufile, "nvidia_fs": nvidia_fs, "kvikio": kvikio}
    if cufile["loadable"] and nvidia_fs:
        return {"status": "ok", **result}
    if kvikio["importable"]:
        missing = "libcufile" if not cufile["loadable"] else "the nvidia-fs driver"
        return {"status": "compat", "reason": f"kvikio imports but {missing} is missing: data moves through host "
                "memory", **result}
    return _absent("no GPU-direct storage: " + ("libcufile missing" if not cufile["loadable"] else
                   f"{PROC_NVIDIA_FS} missing") + ", kvikio not importable", **result)


def probe_gpus() -> dict[str, Any]:
    """CUDA GPUs through the driver API (``libcuda.so.1``): count, names, memory, compute capability."""
    lib, how = _load(["libcuda.so.1", "libcuda.so"])
    if lib is None:
        return _absent(f"no CUDA driver: {how}", count=0, devices=[])

    def check(rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: CUDA error {rc} ({_text(msg.value or b'unknown')})")

    try:
        rc = lib.cuInit(0)
        if rc != 0:
            msg = ctypes.c_char_p()
            lib.cuGetErrorString(rc, ctypes.byref(msg))
            return _absent(f"the CUDA driver is installed but cuInit failed: error {rc} "
                           f"({_text(msg.value or b'unknown')})", count=0, devices=[])
        version = ctypes.c_int()
        check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        count = ctypes.c_int()
        check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        devices = []
        for index in range(count.value):
            dev = ctypes.c_int()
            check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
            name = ctypes.create_string_buffer(256)
            check(lib.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
            total = ctypes.c_size_t()
            check(lib.cuDeviceTotalMem_v2(ctypes.byref(total), dev), "cuDeviceTotalMem")
            major, minor = ctypes.c_int(), ctypes.c_int()
            check(lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev), "cuDeviceGetAttribute")
            check(lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev), "cuDeviceGetAttribute")
            devices.append({"index": index, "name": _text(name.value), "memory_bytes": total.value,
                            "compute_capability": f"{major.value}.{minor.value}"})
    except (AttributeError, RuntimeError) as exc:
        return {"status": "error", "reason": str(exc), "count": 0, "devices": []}
    driver = f"{version.value // 1000}.{version.value % 1000 // 10}"
    if not devices:
        return _absent("the CUDA driver sees no GPU", driver_version=driver, count=0, devices=[])
    return {"status": "ok", "driver_version": driver, "count": len(devices), "devices": devices}


def probe_kvcache(data_dir: str | None = None) -> dict[str, Any]:
    """KV tiers that processes on this host have quarantined now (their I/O missed its deadline): from the
    records they leave in the data directory (``data_dir``, default the setting); ended ones are removed.

    ``quarantined`` lists each: host, pid, tier, target (the tier's directory or device), namespace, since and
    until (wall clock), reason, abandoned (worker threads stuck in the tier's I/O)."""
    where = quarantine_dir(data_dir)
    recs = read_quarantine_records(where, clean=True)
    return {"status": "ok", "state_dir": where, "quarantined": recs}


# --------------------------------------------------------------------------------------------------------


def probe(data_dir: str | None = None) -> dict[str, Any]:
    """Report everything sfstore can use on this host, one section per subject (see the module doc).

    Parameters
    ----------
    data_dir : str, optional
        Data directory to check; default the ``data_dir`` setting. It is created if missing.

    Returns
    -------
    dict
        JSON-able: ``{"system": {...}, "engine": {...}, "memory": {...}, "data_dir": {...}, "rdma": {...},
        "nfs": {...}, "nvmeof": {...}, "gds": {...}, "gpus": {...}, "kvcache": {...}}``, each with ``status``
        (and ``reason`` when not ``"ok"``). Never raises for missing hardware; a section whose probing fails has status
        ``"error"``.
    """
    probes: dict[str, Callable[[], dict[str, Any]]] = {
        "system": probe_system,
        "engine": probe_engine,
        "memory": probe_memory,
        "data_dir": lambda: probe_data_dir(data_dir),
        "rdma": probe_rdma,
        "nfs": probe_nfs,
        "nvmeof": probe_nvmeof,
        "gds": probe_gds,
        "gpus": probe_gpus,
        "kvcache": lambda: probe_kvcache(data_dir),
    }
    report: dict[str, Any] = {}
    for name, fn in probes.items():
        try:
            report[name] = fn()
        except Exception as exc:
            report[name] = _error(exc)
    return report


# --------------------------------------------------------------------------------------------------------
# the table that `sfstore probe` prints


def _pairs(items: Sequence[tuple[str, Any]], indent: str = "    ") -> list[str]:
    if not items:
        return []
    width = max(len(k) for k, _ in items)
    return [f"{indent}{k.ljust(width)}  {cell(v)}" for k, v in items]


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value and not all(isinstance(v, dict) for v in value.values()):
        items: list[tuple[str, Any]] = []
        for k, v in value.items():
            items += _flatten(f"{prefix}.{k}" if prefix else str(k), v)
        return items
    if isinstance(value, dict):  # a dict of dicts (engines): one line per entry
        return [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in value.items()]
    return [(prefix, value)]


def _section_rows(name: str, section: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if name == "rdma":
        rows = [[d["name"], d.get("node_guid"), p.get("port"), p.get("state"), p.get("link_layer"),
                 p.get("active_mtu"), p.get("netdev")]
                for d in section.get("devices", []) for p in (d.get("ports") or [{}])]
        lines += _pairs([("source", section.get("source")), ("pyverbs", section.get("pyverbs", {}).get("reason"))])
        if rows:
            lines += grid(["DEVICE", "NODE GUID", "PORT", "STATE", "LINK", "MTU", "NETDEV"], rows)
        return lines
    if name == "nfs":
        rows = [[m["mountpoint"], m["source"], m["vers"], m["proto"], m["rsize"], m["wsize"], m["nconnect"],
                 m["port"]] for m in section.get("mounts", [])]
        if rows:
            lines += grid(["MOUNTPOINT", "SERVER:EXPORT", "VERS", "PROTO", "RSIZE", "WSIZE", "NCONNECT", "PORT"],
                           rows)
        return lines
    if name == "nvmeof":
        libnvme = section.get("libnvme") or {}
        lines += _pairs([("fabrics", ("available: " if section.get("fabrics_available") else "not loaded: ")
                          + str(section.get("fabrics_reason") or DEV_NVME_FABRICS)),
                         ("libnvme", ("" if libnvme.get("available") else "not available: ")
                          + str(libnvme.get("reason") or "-"))])
        rows = [[c["name"], c["transport"], c["address"], c["subsysnqn"], c["state"],
                 [n["device"] for n in c.get("namespaces", [])]] for c in section.get("controllers", [])]
        if rows:
            lines += grid(["CONTROLLER", "TRANSPORT", "ADDRESS", "SUBSYSNQN", "STATE", "NAMESPACES"], rows)
        return lines
    if name == "gpus":
        lines += _pairs([("driver", section.get("driver_version"))]) if section.get("driver_version") else []
        rows = [[d["index"], d["name"], f"{d['memory_bytes'] / 2**30:.1f} GiB", d["compute_capability"]]
                for d in section.get("devices", [])]
        if rows:
            lines += grid(["GPU", "NAME", "MEMORY", "CC"], rows)
        return lines
    if name == "kvcache":
        recs = section.get("quarantined", [])
        lines += _pairs([("quarantined", f"{len(recs)} tier(s)" if recs else "none")])
        if recs:
            lines += grid(["HOST", "PID", "TIER", "TARGET", "SINCE", "LEFT", "STUCK", "REASON"],
                           quarantine_rows(recs))
        return lines
    items = [kv for k, v in section.items() if k not in ("status", "reason") for kv in _flatten(k, v)]
    return _pairs(items)


def format_table(report: dict[str, Any]) -> str:
    """Render a :func:`probe` report as aligned text: one block per section, lists as columns."""
    width = max(len(name) for name in report) if report else 0
    lines = []
    for name, section in report.items():
        status = section.get("status", "?")
        reason = section.get("reason")
        lines.append(f"{name.ljust(width)}  {status}" + (f"  ({reason})" if reason else ""))
        lines += _section_rows(name, section)
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    import json

    json.dump(probe(), sys.stdout, indent=2)
    print()
