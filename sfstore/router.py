"""The router: one ``sfstore.open()`` that maps each data class to its direct path, and says why.

Data classes: ``dataset`` and ``checkpoint`` (file path: NFS over RDMA on a cluster), ``hot`` (block path:
NVMe over RDMA) and ``kvcache`` (device path: GPU-direct storage). Where a path's hardware is absent, the path
takes the best that exists and :meth:`Router.describe` says so (``fallbacks``).

Configuration, first found wins for each value: the ``config`` argument, ``SFSTORE_*`` variables, the config
file, the defaults. The config file is ``config`` when it is a path, else ``$SFSTORE_CONFIG``, else
``./sfstore.toml``, else ``$XDG_CONFIG_HOME/sfstore/sfstore.toml`` (``~/.config/...``)::

    root = "/mnt/nfs-rdma/ai"         # file-path root for every file-backed class (SFSTORE_ROOT)

    [settings]                         # any sfstore.defaults setting by name, for this process
    queue_depth = 64                   # (a SFSTORE_* variable that is set still wins)

    [classes.dataset]
    path = "file"                      # datasets and checkpoints are files (NFS over RDMA on a cluster)
    root = "/mnt/nfs-rdma/datasets"    # optional: overrides `root` for this class

    [classes.checkpoint]
    path = "file"
    subdir = "checkpoints"             # optional: a directory under `root`

    [classes.hot]
    path = "block"                     # NVMe over RDMA: a namespace connected through libnvme
    target = { kind = "nvmeof", transport = "rdma", traddr = "10.0.0.5", trsvcid = "4420",
               subsysnqn = "nqn.2024-01.io.example:hot" }
    # or target = { kind = "device", device = "/dev/nvme1n1" }
    # or target = { kind = "image", path = "/scratch/hot.img", size = "64G" }

Without any configuration the root is the embedded default data directory (``SFSTORE_DATA_DIR``): datasets
live at the root itself (what ``sf://`` shows), checkpoints under ``<root>/checkpoints``, hot blocks in the
image file ``<data_dir>/hot/blocks.img`` (``block_image_size``; local even when ``root`` is a mount).
"""

from __future__ import annotations

import builtins
import os
import stat
import sys
import threading
from collections.abc import Mapping
from typing import Any

from sfstore import defaults, errors
from sfstore.paths.base import StoragePath
from sfstore.paths.file import FilePath

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["Router", "open", "DATA_CLASSES", "find_config"]

DATA_CLASSES = ("dataset", "checkpoint", "hot", "kvcache")

# Where each class goes, and which paths it may use, until configured otherwise.
_DEFAULT_PATH = {"dataset": "file", "checkpoint": "file", "hot": "block", "kvcache": "device"}
_ALLOWED = {"dataset": ("file",), "checkpoint": ("file",), "hot": ("block", "file"), "kvcache": ("device", "file")}
_DEFAULT_SUBDIR = {"dataset": "", "checkpoint": "checkpoints", "hot": "hot", "kvcache": "kvcache"}
_TOP_KEYS = {"root", "data_dir", "settings", "classes"}
_CLASS_KEYS = {"path", "root", "subdir", "target"}
IMAGE_NAME = os.path.join("hot", "blocks.img")  # the block path's embedded default, under data_dir


def find_config(config: str | os.PathLike[str] | None = None) -> str | None:
    """The config file that applies: ``config``, ``$SFSTORE_CONFIG``, ``./sfstore.toml`` or the user's."""
    if config is not None:
        return os.fspath(config)
    env = os.environ.get("SFSTORE_CONFIG")
    if env:
        return env
    if os.path.isfile("sfstore.toml"):
        return os.path.abspath("sfstore.toml")
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    user = os.path.join(base, "sfstore", "sfstore.toml")
    return user if os.path.isfile(user) else None


_MAX_CONFIG_BYTES = 1 << 20  # a config file is a few lines; more is not one


def _load(path: str) -> dict[str, Any]:
    """Parse the config file at ``path``; anything but a readable regular TOML file of UTF-8 text is a
    :class:`~sfstore.errors.ConfigError` naming the file (a FIFO or device is refused without blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise errors.ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise errors.ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise errors.ConfigError(f"config file {path} is not a regular file")
        if st.st_size > _MAX_CONFIG_BYTES:
            raise errors.ConfigError(
                f"config file {path} is {st.st_size} bytes; a config file is at most {_MAX_CONFIG_BYTES} bytes"
            )
        with builtins.open(fd, "rb", closefd=False) as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise errors.ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > _MAX_CONFIG_BYTES:
        raise errors.ConfigError(f"config file {path} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): not a TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise errors.ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise errors.ConfigError(f"config file {path} nests tables or arrays too deeply") from None


def _subdir(source: str, key: str, value: str) -> str:
    """A class's ``subdir``: a relative path that stays beneath ``root`` (no ``..``, not absolute)."""
    parts = value.replace("\\", "/").split("/")
    if os.path.isabs(value) or ".." in parts or "\x00" in value:
        raise errors.ConfigError(
            f"{source}: {key} = {value!r} must be a relative directory beneath root (no '..', not absolute); "
            "use [classes.<name>] root = ... for a directory elsewhere"
        )
    return os.path.normpath(value) if value else ""


def _setting_origin(name: str) -> str:
    where = defaults.source(name)
    return {"set": f"defaults.set or a config file's [settings] {name}", "default": "its default"}.get(where, where)


def _ensure_directory(path: str, what: str) -> None:
    """Make ``path`` a directory (or find it one), or raise a :class:`~sfstore.errors.ConfigError` saying whose
    setting it is: a data directory of ``/dev/null`` or ``/proc/x`` is a configuration mistake, not an I/O error."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise errors.ConfigError(f"{what}: {path} exists and is not a directory") from None
    except OSError as exc:
        raise errors.ConfigError(f"{what}: cannot create the directory {path}: {exc.strerror or exc}") from None
    if not os.path.isdir(path):
        raise errors.ConfigError(f"{what}: {path} is not a directory")


def _expect(source: str, key: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise errors.ConfigError(f"{source}: key {key!r} must be {what}, not {value!r}")
    return value


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
        if isinstance(config, Mapping):
            self.config_file: str | None = None
            raw: dict[str, Any] = dict(config)
            source = "config mapping"
        else:
            self.config_file = find_config(config)
            raw = _load(self.config_file) if self.config_file else {}
            source = f"config file {self.config_file}"
        self._source = source
        unknown = set(raw) - _TOP_KEYS
        if unknown:
            raise errors.ConfigError(
                f"{source}: unknown key(s) {', '.join(sorted(unknown))}; expected {', '.join(sorted(_TOP_KEYS))}"
            )
        self._apply_settings(raw.get("settings", {}))
        if "data_dir" in raw and not os.environ.get("SFSTORE_DATA_DIR"):
            _expect(source, "data_dir", raw["data_dir"], str, "a directory path")
            defaults.set(data_dir=raw["data_dir"])
        env_root = os.environ.get("SFSTORE_ROOT")
        if env_root:
            self.root, self._root_from = os.path.abspath(os.path.expanduser(env_root)), "SFSTORE_ROOT"
        elif "root" in raw:
            root = _expect(source, "root", raw["root"], str, "a directory path")
            self.root, self._root_from = os.path.abspath(os.path.expanduser(root)), f"'root' in {source}"
        else:
            self.root = defaults.get("data_dir")
            self._root_from = f"the embedded default data directory (data_dir, from {_setting_origin('data_dir')})"
        classes = _expect(source, "classes", raw.get("classes", {}), dict, "a table of data classes")
        self._classes: dict[str, dict[str, Any]] = {}
        for name, table in classes.items():
            if name not in DATA_CLASSES:
                raise errors.ConfigError(
                    f"{source}: unknown data class [classes.{name}]; expected one of {', '.join(DATA_CLASSES)}"
                )
            table = _expect(source, f"classes.{name}", table, dict, "a table")
            bad = set(table) - _CLASS_KEYS
            if bad:
                raise errors.ConfigError(
                    f"{source}: unknown key(s) {', '.join(sorted(bad))} in [classes.{name}]; "
                    f"expected {', '.join(sorted(_CLASS_KEYS))}"
                )
            path = table.get("path", _DEFAULT_PATH[name])
            if path not in _ALLOWED[name]:
                raise errors.ConfigError(
                    f"{source}: [classes.{name}] path = {path!r}; expected one of {', '.join(_ALLOWED[name])}"
                )
            for key in ("root", "subdir"):
                if key in table:
                    _expect(source, f"classes.{name}.{key}", table[key], str, "a directory path")
            if "subdir" in table:
                table = {**table, "subdir": _subdir(source, f"[classes.{name}] subdir", table["subdir"])}
            if "target" in table:
                if path != "block":
                    raise errors.ConfigError(f"{source}: [classes.{name}] 'target' is for path = 'block' only")
                _expect(source, f"classes.{name}.target", table["target"], dict, "a table (kind = ...)")
            self._classes[name] = table
        self._paths: dict[str, StoragePath] = {}
        self._attached: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.closed = False

    def _apply_settings(self, settings: Any) -> None:
        settings = _expect(self._source, "settings", settings, dict, "a table of sfstore settings")
        chosen: dict[str, Any] = {}
        for name, value in settings.items():
            if name not in defaults.SETTINGS:
                raise errors.ConfigError(
                    f"{self._source}: unknown setting {name!r} in [settings]; known: {', '.join(defaults.SETTINGS)}"
                )
            setting = defaults.SETTINGS[name]
            parsed = setting.parse(value, f"{self._source}: [settings] {name}")
            if not os.environ.get(setting.env):
                chosen[name] = parsed
        if chosen:
            defaults.set(**chosen)

    def _plan(self, data_class: str) -> tuple[str, str, list[str]]:
        """(path kind, root or block image, reasons) for a data class."""
        if data_class not in DATA_CLASSES:
            raise errors.ConfigError(f"unknown data class {data_class!r}; expected one of {', '.join(DATA_CLASSES)}")
        table = self._classes.get(data_class, {})
        wanted = table.get("path", _DEFAULT_PATH[data_class])
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
            sub = table.get("subdir", _DEFAULT_SUBDIR[data_class])
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
                _ensure_directory(root, f"the root of data class {data_class!r} ({reasons[0]})")
            elif "target" not in table:
                _ensure_directory(
                    os.path.dirname(root),
                    f"the block image's directory of data class {data_class!r} (under data_dir, from "
                    f"{_setting_origin('data_dir')})",
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

    def attach(self, key: str, make: Any) -> Any:
        """The object the faces keep under ``key`` for this router, made by ``make()`` on first use.

        Faces built on a path (a block store holding its device exclusively, ...) keep one instance per router
        here; :meth:`close` closes them. The router itself never imports a face.
        """
        with self._lock:
            got = self._attached.get(key)
            if got is not None and not got.closed:
                return got
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
        for st in stores:
            st.close()
        for p in paths:
            p.close()

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
            p = self.path(name)
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
            if d.get("root_route"):  # the device path: how GPU memory reaches files under its root, and why
                out["classes"][name]["gpu_route"] = d["root_route"]
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
            io = "not open" if c["direct_io"] is None else "O_DIRECT" if c["direct_io"] else "page cache"
            where = c["root"] if isinstance(c["root"], str) else ", ".join(f"{k}={v}" for k, v in c["root"].items())
            lines.append(f"{name:<11} {c['path']:<6} {c['transport']:<6} {io:<10} {where}")
            if c.get("gpu_route"):
                lines.append(f"{'':<11} GPU route: {c['gpu_route']['route']} ({c['gpu_route']['why']})")
            for f in c["fallbacks"]:
                lines.append(f"{'':<11} fallback: {f}")
        return "\n".join(lines)


_routers: dict[tuple[Any, ...], Router] = {}
_routers_lock = threading.Lock()


def _cache_key(config: str | os.PathLike[str] | None) -> tuple[Any, ...]:
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
    # A config file's [settings] (and data_dir) are applied to the process's settings by Router(): the key the
    # next call computes includes them, so the router is found under that key too (else every first call after
    # the file appears, or changes, would make a second router: two block stores on one image, split counters).
    after = _cache_key(config)
    with _routers_lock:
        got = _routers.get(key)
        if got is not None and not got.closed:
            return got
        _routers[key] = made
        _routers[after] = made
    return made
