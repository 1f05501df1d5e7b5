"""The router: one ``sfstore.open()`` that maps each data class to its direct path, and says why.

Data classes: ``dataset`` and ``checkpoint`` (file path: NFS over RDMA on a cluster), ``hot`` (block path:
NVMe over RDMA) and ``kvcache`` (device path: GPU-direct storage). Where a path's hardware is absent, the path
takes the best that exists and :meth:`Router.describe` says so (``fallbacks``).

Configuration, first found wins for each value: the ``config`` argument, ``SFSTORE_*`` variables, the config
file, the defaults. The config file is ``config`` when it is a path, else ``$SFSTORE_CONFIG``, else
``./sfstore.toml``, else ``$XDG_CONFIG_HOME/sfstore/sfstore.toml`` (``~/.config/...``)::

    root = "/mnt/nfs-rdma/ai"         # file-path root for every file-backed class (SFSTORE_ROOT)

    [settings]                         # any sfstore.defaults setting by name, while this router is open
    queue_depth = 64                   # (a SFSTORE_* variable that is set, or defaults.set in code, still wins)

    [classes.dataset]
    path = "file"                      # datasets and checkpoints are files (NFS over RDMA on a cluster)
    root = "/mnt/nfs-rdma/datasets"    # optional: overrides `root` for this class

    [classes.checkpoint]
    path = "file"
    subdir = "checkpoints"             # optional: a directory under `root`

    [classes.hot]
    path = "block"                     # NVMe over RDMA: a namespace connected through libnvme

    [classes.hot.target]               # (an inline table { ... } must stay on one line in TOML)
    kind = "nvmeof"
    transport = "rdma"
    traddr = "10.0.0.5"
    trsvcid = "4420"
    subsysnqn = "nqn.2024-01.io.example:hot"
    # or target = { kind = "device", device = "/dev/nvme1n1" }
    # or target = { kind = "image", path = "/scratch/hot.img", size = "64G" }

A configured root (``root``, ``SFSTORE_ROOT``, ``[classes.<name>] root``) must exist: a mistyped mount point is
a :class:`~sfstore.errors.ConfigError` naming the setting, never a directory made on the local disk. A class's
``subdir`` (and the default ``checkpoints``, ``kvcache``) is created beneath it. A read-only root serves reads;
a face that must write there raises :class:`~sfstore.errors.ReadOnlyRootError` naming the setting to change.
``sfstore config check`` lists every problem of a configuration at once (:mod:`sfstore.config_check`).

Without any configuration the root is the embedded default data directory (``SFSTORE_DATA_DIR``): datasets
live at the root itself (what ``sf://`` shows), checkpoints under ``<root>/checkpoints``, hot blocks in the
image file ``<data_dir>/hot/blocks.img`` (``block_image_size``; local even when ``root`` is a mount).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, cast

from sfstore import defaults, errors
from sfstore.config_check import (
    DATA_CLASSES,
    DEFAULT_PATH,
    DEFAULT_SUBDIR,
    check_document,
    check_root,
    find_config,
    load_config_file,
    why_not_writable,
)
from sfstore.environment import problems_text, validate_environment
from sfstore.paths.base import StoragePath
from sfstore.paths.file import FilePath

__all__ = ["Router", "open", "DATA_CLASSES", "find_config"]

IMAGE_NAME = os.path.join("hot", "blocks.img")  # the block path's embedded default, under data_dir
_WRITE_REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)


class _Attached(Protocol):
    """What a face keeps in a router (:meth:`Router.attach`): closed with the router."""

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


_A = TypeVar("_A", bound=_Attached)
# a cached router's configuration: config file, its mtime, the SFSTORE_* variables, defaults.set's, the cwd
_RouterKey = tuple[str | None, int | None, tuple[tuple[str, str], ...], tuple[tuple[str, str], ...], str]


def _setting_origin(name: str) -> str:
    where = defaults.source(name)
    return {"set": "defaults.set", "default": "its default"}.get(where, where)


def _ensure_directory(path: str, what: str, elsewhere: str) -> None:
    """Make ``path`` a directory (or find it one), or raise a :class:`~sfstore.errors.ConfigError` saying whose
    setting it is: a data directory of ``/dev/null`` or ``/proc/x`` is a configuration mistake, not an I/O error.
    ``elsewhere`` says which setting points it somewhere writable (a read-only mount refuses the directory)."""
    if "\x00" in path:
        raise errors.ConfigError(f"{what}: {path!r} contains a NUL byte: not a path")
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise errors.ConfigError(f"{what}: {path} exists and is not a directory") from None
    except OSError as exc:
        if exc.errno in _WRITE_REFUSED:
            raise errors.ReadOnlyRootError(
                f"{what}: {path} does not exist and cannot be created ({exc.strerror or exc}); {elsewhere}"
            ) from None
        raise errors.ConfigError(f"{what}: cannot create the directory {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a path the OS cannot take
        raise errors.ConfigError(f"{what}: {path!r} is not a usable path ({exc})") from None
    if not os.path.isdir(path):
        raise errors.ConfigError(f"{what}: {path} is not a directory")


class Router:
    """Maps data classes to paths. Made by :func:`open`; see the module docs for the configuration.

    Attributes
    ----------
    config_file : str or None
        The config file read, if any.
    root : str
        The file-path root (``SFSTORE_ROOT``, else the config's ``root``, else the data directory).
    """

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> None:
        # The SFSTORE_* variables first: a bad one (SFSTORE_QUEUE_DEPTH=abc) fails here, at open(), not at the
        # first I/O that reads it; an unknown one (a misspelt name) is warned about once.
        validate_environment()
        if isinstance(config, Mapping):
            self.config_file: str | None = None
            raw: dict[str, Any] = dict(config)
            source = "config mapping"
        else:
            self.config_file = find_config(config)
            raw = load_config_file(self.config_file) if self.config_file else {}
            source = f"config file {self.config_file}"
        self._source = source
        problems = [p for p in check_document(raw, source) if p.severity == "error"]
        if problems:
            raise errors.ConfigError(problems_text(problems))
        self._apply_settings(raw.get("settings", {}), raw.get("data_dir"))
        env_root = os.environ.get("SFSTORE_ROOT")
        # The root as configured (it must exist), and who configured it; None: the embedded default (created).
        self._root_origin: str | None
        if env_root:
            self.root, self._root_from = os.path.abspath(os.path.expanduser(env_root)), "SFSTORE_ROOT"
            self._root_origin = "SFSTORE_ROOT"
        elif "root" in raw:
            self.root = os.path.abspath(os.path.expanduser(raw["root"]))
            self._root_from = f"'root' in {source}"
            self._root_origin = f"root in {source}"
        else:
            self.root = defaults.get("data_dir")
            self._root_from = f"the embedded default data directory (data_dir, from {_setting_origin('data_dir')})"
            self._root_origin = None
        self._classes: dict[str, dict[str, Any]] = {}
        for name, table in raw.get("classes", {}).items():
            table = dict(table)
            if table.get("subdir"):
                table["subdir"] = os.path.normpath(table["subdir"])
            self._classes[name] = table
        self._paths: dict[str, StoragePath] = {}
        self._locations: OrderedDict[tuple[str, bool, tuple[tuple[str, object], ...]], FilePath] = OrderedDict()
        self._attached: dict[str, _Attached] = {}
        self._lock = threading.Lock()
        self.closed = False

    def _apply_settings(self, settings: Mapping[str, Any], data_dir: Any) -> None:
        """The config's ``[settings]`` (and ``data_dir``) as the process's configuration layer while this router
        is open: below ``SFSTORE_*`` variables and ``defaults.set`` in code, taken away when it closes."""
        chosen: dict[str, Any] = {}
        for name, value in settings.items():
            chosen[name] = defaults.SETTINGS[name].parse(value, f"{self._source}: [settings] {name}")
        if data_dir is not None:
            chosen["data_dir"] = defaults.SETTINGS["data_dir"].parse(data_dir, f"{self._source}: data_dir")
        self._settings = chosen
        self.hold_settings()

    def hold_settings(self) -> None:
        """Make this router's config settings the process's configuration layer (again)."""
        if self._settings:
            defaults.apply_config(self._settings, self._source, self)

    def _elsewhere(self, data_class: str) -> str:
        """Which setting points ``data_class`` at another directory, in words."""
        table = self._classes.get(data_class, {})
        where = "the config file" if self.config_file else "a config file (SFSTORE_CONFIG, ./sfstore.toml)"
        own = f"set [classes.{data_class}] root = \"/a/writable/dir\" in {where}"
        if "root" in table:
            return own.replace("set ", "change ", 1)
        if self._root_origin is not None:
            return f"{own}, or change {self._root_origin}"
        return f"{own}, or set SFSTORE_ROOT (or SFSTORE_DATA_DIR) to a writable directory"

    def _prepare_root(self, data_class: str, root: str, reasons: list[str]) -> None:
        """Check the configured root ``root`` descends from (it must exist: a mistyped mount point is an error,
        not a directory made on the local disk) and make the class's own directory beneath it."""
        table = self._classes.get(data_class, {})
        what = f"the root of data class {data_class!r} ({reasons[0]})"
        if "root" in table:
            why = check_root(table["root"], f"[classes.{data_class}] root in {self._source}")
            if why:
                raise errors.ConfigError(f"data class {data_class!r}: {why}")
        elif self._root_origin is not None:
            why = check_root(self.root, self._root_origin)
            if why:
                raise errors.ConfigError(f"data class {data_class!r}: {why}")
        _ensure_directory(root, what, self._elsewhere(data_class))

    def require_writable(self, data_class: str) -> StoragePath:
        """The path serving ``data_class``, for a face that must write there (checkpoint saves, the KV cache).

        Raises
        ------
        ReadOnlyRootError
            The class's root is on a read-only mount or not writable by this user; the message names the setting
            that points the class elsewhere. (Reading from such a root works: use :meth:`path`.)
        """
        p = self.path(data_class)
        kind, root, _ = self._plan(data_class)
        directory = root if kind != "block" else None
        if kind == "block" and "target" not in self._classes.get(data_class, {}):
            directory = os.path.dirname(root)
        if directory is not None:
            why = why_not_writable(directory)
            if why:
                raise errors.ReadOnlyRootError(
                    f"data class {data_class!r} must write to {directory}, but {why}; {self._elsewhere(data_class)}"
                )
        return p

    def _plan(self, data_class: str) -> tuple[str, str, list[str]]:
        """(path kind, root or block image, reasons) for a data class."""
        if data_class not in DATA_CLASSES:
            raise errors.ConfigError(f"unknown data class {data_class!r}; expected one of {', '.join(DATA_CLASSES)}")
        table = self._classes.get(data_class, {})
        wanted = table.get("path", DEFAULT_PATH[data_class])
        reasons: list[str] = []
        kind = wanted
        if wanted == "block":
            if "target" in table:
                t = table["target"]
                return kind, f"{t.get('kind', '?')} target", [f"target from [classes.{data_class}] in {self._source}"]
            image = os.path.join(defaults.get("data_dir"), IMAGE_NAME)
            return kind, image, ["no block target configured: the embedded default image file in data_dir"]
        if "root" in table:
            root = os.path.abspath(os.path.expanduser(table["root"]))
            reasons.append(f"root from [classes.{data_class}] in {self._source}")
        else:
            sub = table.get("subdir", DEFAULT_SUBDIR[data_class])
            root = os.path.join(self.root, sub) if sub else self.root
            reasons.append(f"root from {self._root_from}")
        return kind, root, reasons

    def path(self, data_class: str) -> StoragePath:
        """The path serving ``data_class`` (made once per router)."""
        with self._lock:
            got = self._paths.get(data_class)
            if got is not None:
                return got
            kind, root, reasons = self._plan(data_class)
            made: StoragePath
            table = self._classes.get(data_class, {})
            if kind != "block":
                self._prepare_root(data_class, root, reasons)
            elif "target" not in table:
                _ensure_directory(
                    os.path.dirname(root),
                    f"the block image's directory of data class {data_class!r} (under data_dir, from "
                    f"{_setting_origin('data_dir')})",
                    f"set SFSTORE_DATA_DIR (data_dir) to a writable directory, or configure [classes.{data_class}] "
                    "target (or path = \"file\")",
                )
            if kind == "block":
                from sfstore.paths.block import BlockPath

                if "target" not in table:
                    made = BlockPath(root)
                else:
                    try:
                        made = BlockPath(table["target"])
                    except errors.NotSupportedOnHostError as exc:
                        # The configured target needs what this host lacks (nvme-fabrics, libnvme): the best
                        # path that exists is the embedded image file, and the path says why it took it.
                        made = BlockPath(os.path.join(defaults.get("data_dir"), IMAGE_NAME))
                        made.fallbacks.append(f"configured block target unavailable ({exc}); using the image file")
            elif kind == "device":
                from sfstore.paths.device import DevicePath

                made = DevicePath(root)
            else:
                made = FilePath(root)
            self._paths[data_class] = made
            return made

    def attach(self, key: str, make: Callable[[], _A]) -> _A:
        """The object the faces keep under ``key`` for this router, made by ``make()`` on first use.

        Faces built on a path (a block store holding its device exclusively, ...) keep one instance per router
        here; :meth:`close` closes them. The router itself never imports a face.
        """
        with self._lock:
            got = self._attached.get(key)
            if got is not None and not got.closed:
                return cast(_A, got)  # what ``make`` of the same key made
        made = make()
        with self._lock:
            self._attached[key] = made
        return made

    def close(self) -> None:
        """Close what the faces attached (block stores, ...) and the paths this router made."""
        with self._lock:
            self.closed = True
            stores, self._attached = list(self._attached.values()), {}
            paths, self._paths = list(self._paths.values()), {}
            paths += list(self._locations.values())
            self._locations = OrderedDict()
        for st in stores:
            st.close()
        for p in paths:
            p.close()
        defaults.drop_config(self)

    def location(self, root: str | os.PathLike[str], *, create: bool = False, **options: Any) -> FilePath:
        """The :class:`FilePath` rooted at the host directory ``root`` (``create``: made if missing) with these
        :class:`FilePath` ``options`` (``direct``, ``chunk_size``, ``parallelism``): one per directory and options
        in this router, made again when its root was removed. What faces reach by an absolute location (a
        checkpoint at ``/abs/dir``, a DCP directory) moves through these, and :meth:`describe` shows their
        counters beside the data classes'."""
        key = (os.path.abspath(os.fspath(root)), bool(create), tuple(sorted(options.items())))
        with self._lock:
            fp = self._locations.get(key)
        if fp is not None and _same_directory(fp):
            with self._lock:
                if key in self._locations:
                    self._locations.move_to_end(key)
            return fp
        made = FilePath(root, create=create, **options)
        with self._lock:
            fp = self._locations.get(key)
            if fp is None or not _same_directory(fp):
                fp = self._locations[key] = made
            self._locations.move_to_end(key)
            # A training run saves to a new directory every few steps: the least recently used beyond the bound
            # leave the registry (each holds its root's descriptor, closed once nothing uses the path).
            while len(self._locations) > _LOCATIONS_KEPT:
                self._locations.popitem(last=False)
        return fp

    def file_path(self, data_class: str = "dataset") -> FilePath:
        """The :class:`FilePath` serving ``data_class`` (``dataset`` by default)."""
        p = self.path(data_class)
        if not isinstance(p, FilePath):
            raise errors.ConfigError(f"data class {data_class!r} is served by the {p.kind} path, not the file path")
        return p

    def describe(self) -> dict[str, Any]:
        """Per data class: the path, its transport, why it was chosen and any fallback taken, its counters."""
        out: dict[str, Any] = {"config_file": self.config_file, "root": self.root, "classes": {}}
        for name in DATA_CLASSES:
            kind, root, reasons = self._plan(name)
            with self._lock:
                made = name in self._paths
            if kind == "block" and not made:
                # Not opened yet: describing must not create an image file or connect to a target.
                target = self._classes.get(name, {}).get("target")
                t = (target or {}).get("transport", "local")
                out["classes"][name] = {
                    "path": "block", "available": True, "root": root if target is None else target,
                    "transport": t if t in ("rdma", "tcp") else "local", "direct_io": None, "why": reasons,
                    "fallbacks": ["block target is an image file (no NVMe namespace configured)"] if target is None
                    else [], "counters": {}, "opened": False,
                }
                continue
            try:
                p = self.path(name)
            except errors.ConfigError as exc:
                # A missing configured root, or a read-only one where the class's directory must be made: the
                # others are still described, and the table says what is wrong with this one.
                out["classes"][name] = {
                    "path": kind, "available": False, "root": root, "transport": None, "direct_io": None,
                    "why": reasons, "fallbacks": [], "counters": {},
                    "error": str(exc), "severity": "warning" if isinstance(exc, errors.ReadOnlyRootError) else "error",
                }
                continue
            d = p.describe()
            out["classes"][name] = {
                "path": d["kind"],
                "available": True,
                "root": d.get("root") or d.get("device"),
                "transport": d["transport"],
                "direct_io": d.get("direct_io"),
                "why": reasons,
                "fallbacks": d["fallbacks"],
                "counters": d["counters"],
            }
            if kind != "block" and isinstance(root, str):
                why = why_not_writable(root)
                out["classes"][name]["writable"] = why is None
                if why and name in ("checkpoint", "kvcache"):
                    out["classes"][name]["read_only"] = (f"{why}: reads work, writes fail; "
                                                         f"{self._elsewhere(name)}")
            if d.get("root_route"):  # the device path: how GPU memory reaches files under its root, and why
                out["classes"][name]["gpu_route"] = d["root_route"]
        with self._lock:
            located = list(self._locations.values())
        # absolute locations faces reached (a checkpoint at /abs/dir, a DCP directory): what moved there
        out["locations"] = {}
        for fp in located:
            d = fp.describe()
            got = out["locations"].setdefault(fp.root, {"transport": d["transport"], "counters": {}})
            for k, v in d["counters"].items():
                got["counters"][k] = got["counters"].get(k, 0) + v
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """Counters of every path made so far, by data class."""
        with self._lock:
            return {name: p.counters.snapshot() for name, p in self._paths.items()}

    def format(self) -> str:
        """:meth:`describe` as a readable table."""
        d = self.describe()
        lines = [f"config: {d['config_file'] or '(none: defaults and SFSTORE_* variables)'}", f"root:   {d['root']}"]
        for name, c in d["classes"].items():
            if c.get("error"):
                lines.append(f"{name:<11} {c['path']:<6} {c['severity']}: {c['error']}")
                continue
            io = "not open" if c["direct_io"] is None else "O_DIRECT" if c["direct_io"] else "page cache"
            where = c["root"] if isinstance(c["root"], str) else ", ".join(f"{k}={v}" for k, v in c["root"].items())
            lines.append(f"{name:<11} {c['path']:<6} {c['transport']:<6} {io:<10} {where}")
            if c.get("gpu_route"):
                lines.append(f"{'':<11} GPU route: {c['gpu_route']['route']} ({c['gpu_route']['why']})")
            for f in c["fallbacks"]:
                lines.append(f"{'':<11} fallback: {f}")
            if c.get("read_only"):
                lines.append(f"{'':<11} read-only: {c['read_only']}")
        return "\n".join(lines)


_LOCATIONS_KEPT = 64  # absolute locations a router keeps paths (and their counters) for


def _same_directory(fp: FilePath) -> bool:
    """Whether ``fp``'s root still names the directory its descriptor holds (one removed and made again at the
    same name is another directory: a path on the old one would write where nobody looks)."""
    try:
        st = os.stat(fp.root)
        held = os.fstat(fp.root_fd())
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


_routers: dict[_RouterKey, Router] = {}
_routers_lock = threading.Lock()


def _cache_key(config: str | os.PathLike[str] | None) -> _RouterKey:
    path = find_config(config)
    try:
        stamp = os.stat(path).st_mtime_ns if path else None
    except OSError:
        stamp = None
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("SFSTORE_") or k == "XDG_DATA_HOME"))
    return (path, stamp, env, defaults.overrides_key(), os.getcwd())


def open(config: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> Router:
    """Open sfstore: read the configuration and return the :class:`Router` for this process.

    With the same configuration (file, ``SFSTORE_*`` variables, settings) every call returns the same router,
    so the faces (``sf://``, checkpoints, block and KV-cache stores) share its paths and their counters show
    everything this process moved per data class. A mapping makes a new router each time.
    """
    if isinstance(config, Mapping):
        return Router(config)
    key = _cache_key(config)
    with _routers_lock:
        got = _routers.get(key)
        if got is not None and not got.closed:
            return got
    made = Router(config)
    with _routers_lock:
        got = _routers.get(key)
        if got is not None and not got.closed:
            made.close()  # another thread made one first: it is the one, with its settings
            got.hold_settings()
            return got
        _routers[key] = made
    return made
