"""NVMe over Fabrics: find, discover, connect and disconnect NVMe-oF controllers (the block path's transport).

What is connected is read from sysfs (``/sys/class/nvme``, ``/sys/block``), which works on every host (a host
without NVMe gets an empty list). Discovering and connecting go through libnvme's Python binding
(``from libnvme import nvme``): Debian's ``python3-nvme`` (libnvme 1.3 on bookworm), or PyPI's ``libnvme``
(sfstore's ``nvme`` extra; see :func:`libnvme_status` for what its wheel needs). Disconnecting uses libnvme
where it imports and the controller's ``delete_controller`` sysfs attribute elsewhere.

>>> from sfstore import nvme
>>> target = nvme.NvmeofTarget("rdma", "10.0.0.1", subsysnqn="nqn.2024-01.io.example:ssd")  # doctest: +SKIP
>>> ctrl = nvme.connect(target)          # idempotent: a second call returns the same controller  # doctest: +SKIP
>>> ctrl.namespaces[0].device            # doctest: +SKIP
'/dev/nvme0n1'
>>> nvme.disconnect(target)              # doctest: +SKIP
True

Connecting needs the ``nvme-fabrics`` kernel module (``/dev/nvme-fabrics``) and the transport's module
(``nvme-rdma``, ``nvme-tcp`` or ``nvme-loop``; the kernel loads it on the first connection), and root (write
access to ``/dev/nvme-fabrics``). Every check runs before any libnvme call: a host without NVMe over Fabrics
gets :class:`~sfstore.errors.NotSupportedOnHostError`, a refused connection :class:`~sfstore.errors.NvmeError`
(an ``OSError`` with ``errno``).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import importlib
import importlib.util
import os
import re
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from types import ModuleType
from typing import Any, TypeVar

from sfstore.errors import ConfigError, NotSupportedOnHostError, NvmeError

__all__ = [
    "parse_address",
    "read_sysfs",
    "NvmeofTarget",
    "Namespace",
    "Controller",
    "DISCOVERY_NQN",
    "TRANSPORTS",
    "fabrics_supported",
    "libnvme_status",
    "list_controllers",
    "find_controller",
    "discover",
    "connect",
    "disconnect",
]

SYS_CLASS_NVME = "/sys/class/nvme"
SYS_BLOCK = "/sys/block"
DEV_NVME_FABRICS = "/dev/nvme-fabrics"
#: The well-known NQN of a discovery subsystem (NVMe over Fabrics specification).
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
#: Fabrics transports sfstore connects over.
TRANSPORTS = ("rdma", "tcp", "loop")
DEFAULT_TRSVCID = "4420"
_KERNEL_MODULES = {"rdma": "nvme-rdma", "tcp": "nvme-tcp", "loop": "nvme-loop"}
_NQN_MAX = 223  # NVMF_NQN_SIZE - 1
_GONE_STATES = ("deleting", "deleting (no IO)", "dead")

_CTRL_RE = re.compile(r"nvme(\d+)$")
_NS_RE = re.compile(r"nvme(\d+)(?:c\d+)?n(\d+)$")  # nvme0n1, or the multipath path device nvme0c1n1
_BAD_CHARS = re.compile(r"[\s,=]")  # would break (or inject into) the kernel's option string


# --------------------------------------------------------------------------------------------------------
# the target


def _check_text(name: str, value: Any, problems: list[str], *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        problems.append(f"{name!r} must be a string, not {type(value).__name__}")
    elif _BAD_CHARS.search(value):
        problems.append(f"{name!r} must not hold spaces, ',' or '=' (got {value!r})")


def _check_nqn(name: str, value: Any, problems: list[str]) -> None:
    if isinstance(value, str) and value and (not value.startswith("nqn.") or len(value) > _NQN_MAX):
        problems.append(f"{name!r} must be an NQN: 'nqn.' and at most {_NQN_MAX} characters (got {value!r})")


def _check_int(name: str, value: Any, minimum: int, problems: list[str]) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        problems.append(f"{name!r} must be an integer, not {type(value).__name__}")
    elif value < minimum:
        problems.append(f"{name!r} must be at least {minimum} (got {value})")


@dataclass(frozen=True)
class NvmeofTarget:
    """An NVMe-over-Fabrics subsystem to connect to: transport, address, port and NQN.

    Validated when made (:class:`~sfstore.errors.ConfigError` naming every bad field): ``transport`` is
    ``"rdma"``, ``"tcp"`` or ``"loop"``; ``traddr`` may be empty only for ``loop``; ``trsvcid`` becomes
    ``"4420"`` for rdma/tcp when empty; NQNs start with ``nqn.``; no field may hold spaces, commas or ``=``
    (they would break the kernel's option string). ``subsysnqn`` may be empty for :func:`discover` only.

    Parameters
    ----------
    transport : str
        ``"rdma"`` (NVMe over RDMA: RoCE, InfiniBand, iWARP), ``"tcp"`` or ``"loop"`` (a local nvmet target).
    traddr : str
        The target's address (an IPv4/IPv6 address for rdma and tcp).
    trsvcid : str
        The target's port (default ``"4420"``; discovery controllers often listen on 8009 with tcp).
    subsysnqn : str
        The subsystem's NQN.
    hostnqn, hostid : str, optional
        This host's NQN and id (default: ``/etc/nvme/hostnqn`` and ``/etc/nvme/hostid``, as nvme-cli).
    host_traddr, host_iface : str, optional
        The local address or interface to connect from.
    nr_io_queues : int, optional
        I/O queues to ask for (default: the kernel's, one per CPU).
    ctrl_loss_tmo : int, optional
        Seconds the kernel keeps reconnecting after losing the controller (-1: forever; default 600).
    """

    transport: str
    traddr: str = ""
    trsvcid: str = ""
    subsysnqn: str = ""
    hostnqn: str | None = None
    hostid: str | None = None
    host_traddr: str | None = None
    host_iface: str | None = None
    nr_io_queues: int | None = None
    ctrl_loss_tmo: int | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        if isinstance(self.transport, str):
            object.__setattr__(self, "transport", self.transport.strip().lower())
        if self.transport not in TRANSPORTS:
            problems.append(f"'transport' must be one of {', '.join(TRANSPORTS)} (got {self.transport!r})")
        for name in ("traddr", "trsvcid", "subsysnqn"):
            _check_text(name, getattr(self, name), problems)
        for name in ("hostnqn", "hostid", "host_traddr", "host_iface"):
            _check_text(name, getattr(self, name), problems, optional=True)
        _check_nqn("subsysnqn", self.subsysnqn, problems)
        _check_nqn("hostnqn", self.hostnqn, problems)
        if isinstance(self.hostid, str):
            try:
                uuid.UUID(self.hostid)
            except ValueError:
                problems.append(f"'hostid' must be a UUID (got {self.hostid!r})")
        _check_int("nr_io_queues", self.nr_io_queues, 1, problems)
        _check_int("ctrl_loss_tmo", self.ctrl_loss_tmo, -1, problems)
        if self.transport in ("rdma", "tcp"):
            if self.traddr == "":
                problems.append(f"'traddr' is required for transport {self.transport!r}")
            if self.trsvcid == "":
                object.__setattr__(self, "trsvcid", DEFAULT_TRSVCID)
            elif isinstance(self.trsvcid, str) and not (self.trsvcid.isdigit() and 0 < int(self.trsvcid) < 65536):
                problems.append(f"'trsvcid' must be a port number 1-65535 (got {self.trsvcid!r})")
        if problems:
            raise ConfigError("NVMe-oF target: " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], source: str = "config") -> NvmeofTarget:
        """Make a target from a mapping (a config table, JSON), naming ``source`` in every error.

        Keys are the field names. ``trsvcid`` may be an integer; ``nr_io_queues`` and ``ctrl_loss_tmo`` may be
        strings of digits (as from environment variables). Unknown keys and bad values raise
        :class:`~sfstore.errors.ConfigError`.
        """
        if not isinstance(m, Mapping):
            raise ConfigError(f"{source}: an NVMe-oF target must be a mapping, not {type(m).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in m if k not in names)
        if unknown:
            raise ConfigError(f"{source}: unknown NVMe-oF target key(s) {', '.join(map(repr, unknown))}; "
                              f"expected: {', '.join(names)}")
        if "transport" not in m:
            raise ConfigError(f"{source}: an NVMe-oF target needs 'transport' ({', '.join(TRANSPORTS)})")
        values = dict(m)
        port = values.get("trsvcid")
        if isinstance(port, int) and not isinstance(port, bool):
            values["trsvcid"] = str(port)
        for name in ("nr_io_queues", "ctrl_loss_tmo"):
            raw = values.get(name)
            if isinstance(raw, str) and re.fullmatch(r"\s*-?\d+\s*", raw):
                values[name] = int(raw)
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def __str__(self) -> str:
        where = "" if self.transport == "loop" else f" {self.traddr}:{self.trsvcid}"
        return f"{self.transport}{where} {self.subsysnqn or DISCOVERY_NQN}"


# --------------------------------------------------------------------------------------------------------
# what is connected: sysfs


@dataclass(frozen=True)
class Namespace:
    """An NVMe namespace's block device: ``/dev/nvme0n1``, its NSID, logical block size and capacity."""

    device: str
    name: str
    nsid: int
    lba_size: int
    capacity: int


@dataclass(frozen=True)
class Controller:
    """An NVMe controller in ``/sys/class/nvme``: its transport, address, subsystem, state and namespaces.

    ``state`` is the kernel's (``live``, ``connecting``, ``resetting``, ``deleting``, ...); ``namespaces``
    are those whose block device exists, by NSID. With native multipath the block device is the subsystem's
    head (``nvme0n1``), not the controller's path device (``nvme0c1n1``).
    """

    name: str
    transport: str
    traddr: str
    trsvcid: str
    subsysnqn: str
    state: str
    namespaces: tuple[Namespace, ...]

    def to_dict(self) -> dict[str, Any]:
        """The controller as a JSON-able dict (namespaces as a list of dicts)."""
        d = asdict(self)
        d["namespaces"] = [asdict(ns) for ns in self.namespaces]
        return d


def read_sysfs(path: str) -> str | None:
    """The stripped text of a (sysfs) file, or ``None`` when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = read_sysfs(path)
    return int(text) if text is not None and text.isdigit() else None


def parse_address(text: str | None) -> dict[str, str]:
    """``traddr=10.0.0.1,trsvcid=4420,src_addr=...`` as a dict; a PCI address as ``{"traddr": ...}``."""
    if not text:
        return {}
    if "=" not in text:
        return {"traddr": text}
    return {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in text.split(",")) if k.strip()}


def _namespace(name: str, sys_block: str) -> Namespace | None:
    base = os.path.join(sys_block, name)
    sectors = _read_int(os.path.join(base, "size"))
    lba_size = _read_int(os.path.join(base, "queue", "logical_block_size"))
    if sectors is None or lba_size is None:
        return None  # not (yet) a block device
    nsid = _read_int(os.path.join(base, "nsid")) or int(name.rsplit("n", 1)[1])
    return Namespace(device=f"/dev/{name}", name=name, nsid=nsid, lba_size=lba_size, capacity=sectors * 512)


def _controller(ctrl_dir: str, sys_block: str) -> Controller | None:
    name = os.path.basename(ctrl_dir)
    state = read_sysfs(os.path.join(ctrl_dir, "state"))
    if state is None:
        return None  # removed while we looked
    address = parse_address(read_sysfs(os.path.join(ctrl_dir, "address")))
    try:
        entries = sorted(os.listdir(ctrl_dir))
    except OSError:
        entries = []
    namespaces: dict[str, Namespace] = {}
    for entry in entries:
        m = _NS_RE.match(entry)
        if m is None:
            continue
        block = f"nvme{m[1]}n{m[2]}"
        if block not in namespaces:
            ns = _namespace(block, sys_block)
            if ns is not None:
                namespaces[block] = ns
    return Controller(
        name=name,
        transport=read_sysfs(os.path.join(ctrl_dir, "transport")) or "",
        traddr=address.get("traddr", ""),
        trsvcid=address.get("trsvcid", ""),
        subsysnqn=read_sysfs(os.path.join(ctrl_dir, "subsysnqn")) or "",
        state=state,
        namespaces=tuple(sorted(namespaces.values(), key=lambda n: (n.nsid, n.name))),
    )


def list_controllers(*, sys_class: str = SYS_CLASS_NVME, sys_block: str = SYS_BLOCK) -> list[Controller]:
    """Every NVMe controller of this host (fabrics and PCIe), from sysfs, in instance order.

    Cheap (a few small sysfs reads per controller), needs no privileges and works on any host: an empty list
    where there is no NVMe. ``sys_class`` and ``sys_block`` point elsewhere for tests.
    """
    found: list[tuple[int, Controller]] = []
    for ctrl_dir in glob.glob(os.path.join(sys_class, "nvme*")):
        m = _CTRL_RE.match(os.path.basename(ctrl_dir))
        if m is None:
            continue
        ctrl = _controller(ctrl_dir, sys_block)
        if ctrl is not None:
            found.append((int(m[1]), ctrl))
    return [c for _, c in sorted(found, key=lambda p: p[0])]


def _matches(ctrl: Controller, target: NvmeofTarget, sys_class: str = SYS_CLASS_NVME) -> bool:
    if ctrl.subsysnqn != target.subsysnqn or ctrl.transport != target.transport:
        return False
    if target.transport != "loop" and (ctrl.traddr != target.traddr or ctrl.trsvcid != target.trsvcid):
        return False
    if target.hostnqn is not None:
        return read_sysfs(os.path.join(sys_class, ctrl.name, "hostnqn")) == target.hostnqn
    return True


def _matching(target: NvmeofTarget) -> list[Controller]:
    """Controllers of ``target`` that are not being deleted (live, connecting, resetting, new)."""
    return [c for c in list_controllers() if c.state not in _GONE_STATES and _matches(c, target)]


def find_controller(target: NvmeofTarget) -> Controller | None:
    """The live controller connected to ``target`` (same subsystem NQN, transport, address and port), if any.

    From sysfs only; a controller that is still connecting or resetting is not returned.
    """
    for ctrl in list_controllers():
        if ctrl.state == "live" and _matches(ctrl, target):
            return ctrl
    return None


# --------------------------------------------------------------------------------------------------------
# host support and libnvme


def fabrics_supported(dev: str = DEV_NVME_FABRICS) -> tuple[bool, str]:
    """Whether this kernel can make NVMe-oF connections: does ``/dev/nvme-fabrics`` exist? And why (not).

    Returns
    -------
    (bool, str)
        ``(True, reason)`` where the ``nvme-fabrics`` module is loaded; ``(False, reason)`` saying what to load.
    """
    if os.path.exists(dev):
        writable = os.access(dev, os.R_OK | os.W_OK)
        return True, f"{dev} exists (nvme-fabrics is loaded)" + ("" if writable else "; connecting needs root")
    return False, f"{dev} is missing (modprobe nvme-fabrics nvme-rdma, or nvme-tcp)"


_lock = threading.Lock()
_call_lock = threading.Lock()
_loaded: tuple[ModuleType | None, str] | None = None
_INSTALL = ("install Debian's python3-nvme (apt-get install python3-nvme; `from libnvme import nvme`), or "
            "sfstore's `nvme` extra (pip install 'sfstore[nvme]': builds libnvme from source, needs swig, meson "
            "and a C compiler)")


def _bundled_library() -> str | None:
    """The libnvme shared library a PyPI wheel of libnvme ships beside its package, if any."""
    try:
        spec = importlib.util.find_spec("libnvme")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for pkg_dir in spec.submodule_search_locations:
        site = os.path.dirname(os.path.abspath(pkg_dir))
        libs = sorted(glob.glob(os.path.join(site, ".libnvme.mesonpy.libs", "libnvme.so.1*")) +
                      glob.glob(os.path.join(site, "libnvme.libs", "libnvme*.so*")))
        if libs:
            return libs[-1]
    return None


def _describe(mod: ModuleType) -> str:
    pkg = sys.modules.get("libnvme")
    version = getattr(pkg, "__version__", None) or "(version unknown)"
    return f"libnvme {version} ({os.path.dirname(getattr(mod, '__file__', None) or '?')})"


def _import_libnvme() -> tuple[ModuleType | None, str]:
    try:
        mod = importlib.import_module("libnvme.nvme")
        return mod, _describe(mod)
    except Exception as exc:  # ImportError, or a broken install failing otherwise
        first = exc
    text = str(first)
    if isinstance(first, ModuleNotFoundError) and first.name == "libnvme":
        return None, f"libnvme is not importable (no module named 'libnvme'): {_INSTALL}"
    if isinstance(first, ModuleNotFoundError) and first.name == "libnvme.nvme":
        return None, ("the libnvme package here has no Python binding (libnvme.nvme): it was built without swig; "
                      "apt-get install swig and reinstall it (pip install --force-reinstall --no-cache-dir "
                      "libnvme), or " + _INSTALL.split(", or ")[0])
    bundled = _bundled_library()
    if bundled is None or ("libnvme.so" not in text and "LIBNVME_" not in text):
        return None, f"libnvme cannot be imported ({type(first).__name__}: {text}): {_INSTALL}"
    # A PyPI wheel ships libnvme.so.1.x.y but not the libnvme.so.1 link its extension needs: the loader finds
    # nothing, or an older system libnvme1 (version `LIBNVME_1.x' not found). Loading the bundled library
    # first, globally, makes its soname (libnvme.so.1) resolve to it.
    try:
        ctypes.CDLL(bundled, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return None, f"libnvme cannot be imported ({text}) and its bundled {bundled} does not load ({exc})"
    for name in ("libnvme.nvme", "libnvme._nvme"):
        sys.modules.pop(name, None)
    try:
        mod = importlib.import_module("libnvme.nvme")
    except Exception as exc:
        return None, f"libnvme cannot be imported ({text}), not even after loading {bundled} first ({exc})"
    return mod, f"{_describe(mod)}; its bundled {os.path.basename(bundled)} loaded first (the import alone " \
                f"failed: {text})"


def _libnvme() -> tuple[ModuleType | None, str]:
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _import_libnvme()
        return _loaded


def libnvme_status() -> tuple[bool, str]:
    """Whether libnvme's Python binding imports here, with its version and place, or why not.

    Imports it (once per process). Where a PyPI wheel of libnvme fails to load its bundled library (the wheel
    lacks the ``libnvme.so.1`` link, so an older system libnvme is found, or none), the bundled library is
    loaded first and the import retried; the text says so.
    """
    mod, text = _libnvme()
    return mod is not None, text


def _require_fabrics(target: NvmeofTarget, what: str) -> None:
    if not isinstance(target, NvmeofTarget):
        raise ConfigError(f"{what}: expected an NvmeofTarget, not {type(target).__name__}")
    if not os.path.exists(DEV_NVME_FABRICS):
        raise NotSupportedOnHostError(
            f"NVMe over Fabrics is not supported on this host: {DEV_NVME_FABRICS} is missing "
            f"(modprobe nvme-fabrics {_KERNEL_MODULES[target.transport]})")
    if not os.access(DEV_NVME_FABRICS, os.R_OK | os.W_OK):
        raise NvmeError(errno.EACCES, f"cannot {what} {target}: {DEV_NVME_FABRICS} needs root (or read-write "
                        "access to it)", target)


def _require_libnvme() -> ModuleType:
    mod, text = _libnvme()
    if mod is None:
        raise NotSupportedOnHostError(f"NVMe over Fabrics needs libnvme's Python binding: {text}")
    return mod


# libnvme reports connect failures as text (nvme_errno_to_string, or the errno's own text): back to an errno.
_LIBNVME_ERRNOS = {
    "failed to resolve host": errno.EHOSTUNREACH,
    "unrecognized address family": errno.EAFNOSUPPORT,
    "failed to get transport address": errno.EINVAL,
    "no transport specified": errno.EINVAL,
    "no transport address specified": errno.EINVAL,
    "failed to open nvme-fabrics device": errno.ENOENT,
    "invalid transport type": errno.EINVAL,
    "already connected": errno.EALREADY,
    "existing controller connection": errno.EALREADY,
    "invalid arguments/configuration": errno.EINVAL,
    "hostnqn already in use": errno.EADDRINUSE,
    "invalid interface": errno.ENODEV,
    "not supported": errno.EOPNOTSUPP,
    "connection refused": errno.ECONNREFUSED,
    "no controller connection": errno.ENOTCONN,
}


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    text = str(exc).strip().lower()
    if text in _LIBNVME_ERRNOS:
        return _LIBNVME_ERRNOS[text]
    for code in range(1, 134):
        if os.strerror(code).lower() == text:
            return code
    return errno.EIO


def _why(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if text in ("Connect failed", "failed to write to nvme-fabrics device"):
        return f"{text}: the kernel refused the connection (target down, or a wrong address, port or NQN?)"
    return text


def _wait(name: str, deadline: float) -> Controller | None:
    """Poll sysfs until controller ``name`` is live with namespace block devices under /dev; None at the deadline."""
    while True:
        ctrl = next((c for c in list_controllers() if c.name == name), None)
        if ctrl is not None and ctrl.state == "live" and ctrl.namespaces and all(
                os.path.exists(ns.device) for ns in ctrl.namespaces):
            return ctrl
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _libnvme_args(target: NvmeofTarget, subsysnqn: str) -> tuple[dict[str, str], dict[str, str]]:
    """Keyword arguments of ``nvme.ctrl`` and ``nvme.host`` for ``target`` (unset ones left out)."""
    ctrl_args: dict[str, str] = {"subsysnqn": subsysnqn, "transport": target.transport}
    for key in ("traddr", "trsvcid", "host_traddr", "host_iface"):
        value = getattr(target, key)
        if value:
            ctrl_args[key] = value
    host_args = {k: v for k, v in (("hostnqn", target.hostnqn), ("hostid", target.hostid)) if v}
    return ctrl_args, host_args


_T = TypeVar("_T")


def _with_libnvme_ctrl(nvme: ModuleType, target: NvmeofTarget, subsysnqn: str,
                       use: Callable[[Any, Any], _T]) -> _T:
    """``use(host, ctrl)`` with a libnvme host and controller for ``target`` (with ``subsysnqn``).

    Every libnvme object lives in this call and is deleted child first (controller, host, root): the root frees
    the whole tree, so a controller freed after it would be freed twice. That is why an exception from ``use``
    has its frames cleared before the root goes, with those of the exceptions it was raised during (a libnvme
    error): they would otherwise hold the controller past it.
    """
    ctrl_args, host_args = _libnvme_args(target, subsysnqn)
    root = nvme.root()
    try:
        host = nvme.host(root, **host_args)
        try:
            ctrl = nvme.ctrl(root, **ctrl_args)
            try:
                return use(host, ctrl)
            except BaseException as exc:
                behind: BaseException | None = exc
                while behind is not None:
                    traceback.clear_frames(behind.__traceback__)
                    behind = behind.__context__
                raise
            finally:
                del ctrl
        finally:
            del host
    finally:
        del root


def _libnvme_connect(nvme: ModuleType, target: NvmeofTarget, subsysnqn: str, cfg: dict[str, Any]) -> str:
    """Connect ``target`` (with ``subsysnqn``) through libnvme; return the new controller's name."""

    def connect(host: Any, ctrl: Any) -> str:
        ctrl.connect(host, cfg)
        return str(ctrl.name)

    return _with_libnvme_ctrl(nvme, target, subsysnqn, connect)


def _libnvme_discover(nvme: ModuleType, target: NvmeofTarget, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Connect a discovery controller to ``target``'s address, read the discovery log, disconnect."""

    def discover(host: Any, ctrl: Any) -> list[dict[str, Any]]:
        try:
            ctrl.connect(host, cfg)
        except Exception as exc:
            raise NvmeError(_errno_of(exc), f"cannot reach the discovery controller of {target}: "
                            f"{_why(exc)}", target) from None
        try:
            log = ctrl.discover()
        except Exception as exc:
            raise NvmeError(_errno_of(exc), f"reading the discovery log of {target} failed: {_why(exc)}",
                            target) from None
        finally:
            try:
                ctrl.disconnect()
            except Exception:  # gone already; nothing to undo
                pass
        return [dict(entry) for entry in (log or [])]

    return _with_libnvme_ctrl(nvme, target, DISCOVERY_NQN, discover)


def _each(first: Any) -> Any:
    """Iterate a libnvme list: 1.3's ``hosts()``/``subsystems()``/``controllers()`` return the first element (or
    None, which does not iterate), later versions a generator."""
    return () if first is None else first


def _libnvme_disconnect(nvme: ModuleType, names: set[str]) -> set[str]:
    """Disconnect the controllers called ``names`` through libnvme; return the names it found.

    The tree's hosts, subsystems and controllers belong to the root (their proxies free nothing); only the root
    is deleted.
    """
    found: set[str] = set()
    root = nvme.root()
    try:
        for host in _each(root.hosts()):
            for subsystem in _each(host.subsystems()):
                for ctrl in _each(subsystem.controllers()):
                    if ctrl.name in names:
                        found.add(str(ctrl.name))
                        try:
                            ctrl.disconnect()
                        except Exception:  # 1.16 raises when it is gone already; sysfs is checked afterwards
                            pass
    finally:
        del root
    return found


def _bounded(fn: Any, seconds: float, what: str, target: object) -> Any:
    """Run the libnvme call ``fn`` on a worker thread; wait at most ``seconds`` for it.

    libnvme releases the GIL while the kernel connects, and a connection to an address that does not answer
    can take long (TCP's SYN retries). On timeout the call goes on in the background (its libnvme objects are
    freed when it ends); one libnvme call runs at a time.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        with _call_lock:
            try:
                box["result"] = fn()
            except BaseException as exc:
                box["error"] = exc

    worker = threading.Thread(target=work, name="sfstore-libnvme", daemon=True)
    worker.start()
    worker.join(max(0.0, seconds))
    if worker.is_alive():
        raise NvmeError(errno.ETIMEDOUT, f"{what} {target}: no answer within {seconds:g} s (the kernel may "
                        "still be trying)", target)
    if "error" in box:
        raise box["error"]
    return box.get("result")


# --------------------------------------------------------------------------------------------------------
# discover, connect, disconnect


def discover(target: NvmeofTarget, *, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The discovery log page of ``target``'s address: which subsystems it offers, on which ports.

    Connects a discovery controller (NQN :data:`DISCOVERY_NQN`) to ``target.traddr``/``trsvcid`` through
    libnvme, reads the log and disconnects it (``target.subsysnqn`` is not used). Needs root.

    Parameters
    ----------
    target : NvmeofTarget
        Where to ask (transport, traddr, trsvcid; hostnqn/hostid if the target checks them).
    timeout : float
        Seconds to wait for the answer.

    Returns
    -------
    list of dict
        One per log entry: ``subsysnqn``, ``transport``, ``traddr``, ``trsvcid``, ``subtype`` (``"nvme"`` for
        an I/O subsystem, ``"discovery"``/``"referral"``), ``adrfam``, ``portid``, ``treq``.

    Raises
    ------
    NotSupportedOnHostError
        No nvme-fabrics in this kernel, or libnvme's binding is not importable.
    NvmeError
        The discovery controller could not be connected or its log read (``errno`` says why; ``ETIMEDOUT``
        after ``timeout``).
    """
    _require_fabrics(target, "discover")
    nvme = _require_libnvme()
    raw_entries = _bounded(lambda: _libnvme_discover(nvme, target, {}), timeout, "discovering", target)
    entries = []
    for raw in raw_entries:
        entry = {k: v.strip().strip("\x00") if isinstance(v, str) else v for k, v in raw.items()}
        entries.append({
            "subsysnqn": entry.get("subnqn", entry.get("subsysnqn", "")),
            "transport": entry.get("trtype", entry.get("transport", "")),
            "traddr": entry.get("traddr", ""),
            "trsvcid": entry.get("trsvcid", ""),
            "subtype": entry.get("subtype", ""),
            "adrfam": entry.get("adrfam"),
            "portid": entry.get("portid"),
            "treq": entry.get("treq"),
        })
    return entries


def connect(target: NvmeofTarget, *, timeout: float = 30.0) -> Controller:
    """Connect to an NVMe-oF subsystem, or find the controller already connected to it; wait until it is usable.

    Idempotent: a controller of ``target`` that is live (or still connecting) is waited for and returned, not
    connected twice. Otherwise libnvme connects one (``nvme.ctrl(...).connect(host, cfg)``), and this waits
    until it is live and its namespace block devices exist under ``/dev``. Needs root.

    Parameters
    ----------
    target : NvmeofTarget
        The subsystem (``subsysnqn`` must be set).
    timeout : float
        Seconds for the whole call: the connection and the wait for a live controller with namespaces.

    Returns
    -------
    Controller
        Live, with at least one namespace whose block device exists.

    Raises
    ------
    NotSupportedOnHostError
        No nvme-fabrics in this kernel, or libnvme's binding is not importable.
    NvmeError
        The kernel refused the connection (``errno``: ``ECONNREFUSED``, ``EINVAL``, ``EIO``, ...), or it was not
        live with a namespace within ``timeout`` (``ETIMEDOUT``; a controller this call connected is then
        disconnected again, one still connecting in the kernel is found by the next call).
    """
    if isinstance(target, NvmeofTarget) and not target.subsysnqn:
        raise ConfigError("connect: the NVMe-oF target needs 'subsysnqn' (`sfstore nvme discover` lists them)")
    _require_fabrics(target, "connect to")
    deadline = time.monotonic() + max(0.0, timeout)
    existing = _matching(target)
    if not existing:
        nvme = _require_libnvme()
        cfg: dict[str, Any] = {}
        if target.nr_io_queues is not None:
            cfg["nr_io_queues"] = target.nr_io_queues
        if target.ctrl_loss_tmo is not None:
            cfg["ctrl_loss_tmo"] = target.ctrl_loss_tmo
        try:
            name = _bounded(lambda: _libnvme_connect(nvme, target, target.subsysnqn, cfg),
                            deadline - time.monotonic(), "connecting to", target)
        except NvmeError:
            raise
        except Exception as exc:
            err = _errno_of(exc)
            existing = _matching(target) if err == errno.EALREADY else []  # connected meanwhile elsewhere
            if not existing:
                raise NvmeError(err, f"cannot connect to {target}: {_why(exc)}", target) from None
        else:
            ready = _wait(name, deadline) if name and name != "None" else None
            if ready is None:
                now = {c.name: c.state for c in list_controllers()}
                if name in now:
                    _disconnect_names({name})
                raise NvmeError(errno.ETIMEDOUT, f"{target}: controller {name} was not live with a namespace block "
                                f"device after {timeout:g} s (state: {now.get(name, 'gone')})"
                                + ("; disconnected it again" if name in now else ""), target)
            return ready
    ready = _wait(existing[0].name, deadline)
    if ready is None:
        raise NvmeError(errno.ETIMEDOUT, f"{target}: controller {existing[0].name} is connected but not live with "
                        f"a namespace block device after {timeout:g} s", target)
    return ready


def _sysfs_disconnect(name: str) -> None:
    try:
        with open(os.path.join(SYS_CLASS_NVME, name, "delete_controller"), "w") as f:
            f.write("1")
    except FileNotFoundError:
        pass  # gone already
    except OSError as exc:
        raise NvmeError(exc.errno or errno.EIO, f"cannot disconnect {name}: {exc.strerror or exc}", name) from None


def _disconnect_names(names: set[str], timeout: float = 30.0) -> None:
    """Disconnect controllers ``names`` (libnvme where it imports, else sysfs); wait until they are gone."""
    nvme, _ = _libnvme()
    if nvme is not None:
        _bounded(lambda: _libnvme_disconnect(nvme, names), timeout, "disconnecting", ", ".join(sorted(names)))
    deadline = time.monotonic() + timeout
    fallback_at = time.monotonic() + (0.0 if nvme is None else 2.0)
    fell_back = False
    while True:
        present = {c.name for c in list_controllers()} & names
        if not present:
            return
        now = time.monotonic()
        if not fell_back and now >= fallback_at:  # no libnvme, or its disconnect did not take
            for name in sorted(present):
                _sysfs_disconnect(name)
            fell_back = True
            continue
        if now >= deadline:
            raise NvmeError(errno.ETIMEDOUT, f"{', '.join(sorted(present))} still present {timeout:g} s after "
                            "disconnecting", ", ".join(sorted(present)))
        time.sleep(0.05)

def disconnect(target_or_name: NvmeofTarget | str) -> bool:
    """Disconnect the controller(s) of a target, or the controller named ``"nvme0"``; wait until they are gone.

    Through libnvme where it imports (the controller is found in libnvme's tree and ``disconnect()``-ed),
    else through the controller's ``delete_controller`` sysfs attribute. Needs root.

    Returns
    -------
    bool
        True if a controller was disconnected, False if none was connected (nothing to do).

    Raises
    ------
    NvmeError
        The kernel refused (``EACCES`` without root) or the controller did not go away within 30 s.
    """
    if isinstance(target_or_name, NvmeofTarget):
        names = {c.name for c in _matching(target_or_name)}
    elif isinstance(target_or_name, str):
        name = os.path.basename(target_or_name.strip())
        if _CTRL_RE.fullmatch(name) is None:
            raise ConfigError(f"disconnect: {target_or_name!r} is not an NVMe controller name (nvme0, nvme1, ...)")
        names = {c.name for c in list_controllers() if c.name == name and c.state not in _GONE_STATES}
    else:
        raise ConfigError(f"disconnect: expected an NvmeofTarget or a controller name, not "
                          f"{type(target_or_name).__name__}")
    if not names:
        return False
    _disconnect_names(names)
    return True
