"""The configuration file's schema, and a check of a whole configuration that lists every problem.

``sfstore config check [FILE]`` prints what :func:`check` returns; :class:`~sfstore.router.Router` raises on the
errors :func:`check_document` finds; a docs test validates TOML examples with :func:`check_toml`. Each problem
is a :class:`~sfstore.environment.ConfigProblem` that names its source (the file and key, or the variable).

The file (see :mod:`sfstore.router` for what each key does)::

    root = "/mnt/nfs-rdma/ai"         # optional: the file-path root (SFSTORE_ROOT wins); must exist
    data_dir = "/var/lib/sfstore"     # optional: the embedded default data directory (created)
    [settings]                         # any sfstore.defaults setting by name
    [classes.<dataset|checkpoint|hot|kvcache>]
    path = "file"                      # dataset, checkpoint: file; hot: block or file; kvcache: device or file
    root = "/elsewhere"                # optional: this class's root (must exist)
    subdir = "name"                    # optional: a directory under `root` (created)
    target = { kind = "image", path = "/scratch/hot.img", size = "64G" }   # path = "block" only
"""

from __future__ import annotations

import builtins
import os
import re
import stat
import sys
from collections.abc import Mapping
from typing import Any

from sfstore import defaults
from sfstore.environment import ConfigProblem, Severity, check_environment, did_you_mean
from sfstore.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ConfigProblem",
    "DATA_CLASSES",
    "find_config",
    "load_config_file",
    "check",
    "check_file",
    "check_toml",
    "check_document",
    "check_root",
    "why_not_writable",
    "report",
]

DATA_CLASSES = ("dataset", "checkpoint", "hot", "kvcache")

# Where each class goes, and which paths it may use, until configured otherwise.
DEFAULT_PATH = {"dataset": "file", "checkpoint": "file", "hot": "block", "kvcache": "device"}
ALLOWED_PATHS = {"dataset": ("file",), "checkpoint": ("file",), "hot": ("block", "file"),
                 "kvcache": ("device", "file")}
DEFAULT_SUBDIR = {"dataset": "", "checkpoint": "checkpoints", "hot": "hot", "kvcache": "kvcache"}
TOP_KEYS = ("root", "data_dir", "settings", "classes")
CLASS_KEYS = ("path", "root", "subdir", "target")
TARGET_KINDS = ("image", "device", "nvmeof")
_TARGET_KEYS = {"image": ("kind", "path", "size"), "device": ("kind", "device")}

_MAX_CONFIG_BYTES = 1 << 20  # a config file is a few lines; more is not one


def find_config(config: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None) -> str | None:
    """The config file that applies: ``config``, ``$SFSTORE_CONFIG``, ``./sfstore.toml`` or the user's
    (``$XDG_CONFIG_HOME/sfstore/sfstore.toml``, ``~/.config/...``); variables from ``environ`` (``os.environ``)."""
    env = os.environ if environ is None else environ
    if config is not None:
        return os.fspath(config)
    given = env.get("SFSTORE_CONFIG")
    if given:
        return given
    if os.path.isfile("sfstore.toml"):
        return os.path.abspath("sfstore.toml")
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    user = os.path.join(base, "sfstore", "sfstore.toml")
    return user if os.path.isfile(user) else None


# -- reading the file ----------------------------------------------------------------------------------------


class _Unreadable(Exception):
    """Why a config file cannot be read (the reason, without the file's name)."""


def _read_bytes(path: str) -> bytes:
    """The file's bytes; anything but a readable regular file of at most 1 MiB is :class:`_Unreadable` (a FIFO or
    device is refused without blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise _Unreadable("does not exist") from None
    except IsADirectoryError:
        raise _Unreadable("is a directory, not a TOML file") from None
    except OSError as exc:
        raise _Unreadable(f"cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _Unreadable("is a directory, not a TOML file")
        if not stat.S_ISREG(st.st_mode):
            raise _Unreadable("is not a regular file")
        if st.st_size > _MAX_CONFIG_BYTES:
            raise _Unreadable(f"is {st.st_size} bytes; a config file is at most {_MAX_CONFIG_BYTES} bytes")
        with builtins.open(fd, "rb", closefd=False) as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise _Unreadable(f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > _MAX_CONFIG_BYTES:
        raise _Unreadable(f"is larger than {_MAX_CONFIG_BYTES} bytes; a config file is at most that")
    return data


_AT_LINE = re.compile(r"\(at line (\d+), column (\d+)\)")


def _unclosed_inline_table(text: str, upto: int) -> tuple[int, str] | None:
    """(line, table name) of an inline table ``{`` still open at the end of a line up to ``upto`` (the TOML
    error's line): one continued over several lines, which TOML 1.0 refuses. None when there is none. Strings
    and comments are skipped; multi-line strings are not expected in a config file."""
    depth, opened_at, opened_key, section = 0, 0, "", ""
    for number, line in enumerate(text.splitlines()[:upto], start=1):
        stripped = line.strip()
        if depth == 0 and stripped.startswith("[") and not stripped.startswith("[["):
            section = stripped.strip("[]").strip()
        i, quote = 0, ""
        while i < len(line):
            c = line[i]
            if quote:
                if c == "\\" and quote == '"':
                    i += 1
                elif c == quote:
                    quote = ""
            elif c in "\"'":
                quote = c
            elif c == "#":
                break
            elif c == "{":
                if depth == 0:
                    opened_at = number
                    opened_key = line[:i].split("=")[0].strip()
                depth += 1
            elif c == "}":
                depth = max(0, depth - 1)
            i += 1
        if depth:
            name = ".".join(p for p in (section, opened_key) if p)
            return opened_at, name
    return None


def _toml_problem(text: str, source: str, exc: tomllib.TOMLDecodeError) -> ConfigProblem:
    message = str(exc)
    m = _AT_LINE.search(message)
    line = int(m.group(1)) if m else None
    reason = _AT_LINE.sub("", message).strip()
    msg = f"not valid TOML: {reason}" + (f" (column {m.group(2)})" if m else "")
    if line is not None:
        open_table = _unclosed_inline_table(text, line)
        if open_table is not None:
            start, name = open_table
            msg += (
                f"; the inline table {{ ... }} opened on line {start} continues onto the next line, which TOML 1.0 "
                f"does not allow: write it on one line, or as a table of its own ([{name or 'table'}] with one "
                "key = value per line)"
            )
    return ConfigProblem("error", source, "", msg, line)


def _parse(text: str, source: str) -> tuple[dict[str, Any] | None, list[ConfigProblem]]:
    try:
        return tomllib.loads(text), []
    except tomllib.TOMLDecodeError as exc:
        return None, [_toml_problem(text, source, exc)]
    except RecursionError:
        return None, [ConfigProblem("error", source, "", "nests tables or arrays too deeply")]


def read_config_file(path: str) -> tuple[dict[str, Any] | None, list[ConfigProblem]]:
    """The file's TOML document, or None and the problem (missing, a directory, not TOML, ...)."""
    source = f"config file {path}"
    try:
        data = _read_bytes(path)
    except _Unreadable as exc:
        return None, [ConfigProblem("error", source, "", str(exc))]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, [ConfigProblem("error", source, "", f"not UTF-8 text (byte {exc.start}): not a TOML file")]
    return _parse(text, source)


def load_config_file(path: str) -> dict[str, Any]:
    """The file's TOML document; :class:`~sfstore.errors.ConfigError` naming the file when it cannot be read
    or parsed (its line, and a hint for the common mistakes)."""
    raw, problems = read_config_file(path)
    if raw is None:
        p = problems[0]
        raise ConfigError(f"{p.source}" + (f", line {p.line}" if p.line else "") + f": {p.message}")
    return raw


# -- checking the document ------------------------------------------------------------------------------------


def check_root(value: str, origin: str) -> str | None:
    """Why ``value`` (a configured root, set by ``origin``) cannot serve as a root: it does not exist, is not a
    directory, or holds a NUL byte; None when it is an existing directory."""
    if "\x00" in value:
        return f"root {value!r} (set by {origin}) contains a NUL byte: not a path"
    path = os.path.abspath(os.path.expanduser(value))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (f"root {path} (set by {origin}) does not exist; only the embedded default data directory is "
                "created: create or mount the directory, or fix the setting")
    except OSError as exc:
        return f"root {path} (set by {origin}) cannot be used: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"root {path} (set by {origin}) is not a directory"
    return None


def why_not_writable(path: str) -> str | None:
    """Why this process cannot write in the existing directory ``path`` (a read-only mount, no permission), or
    None (also when ``path`` cannot be looked at: that is reported where it is used)."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "it is on a read-only file system"
    except OSError:
        return None
    if not os.access(path, os.W_OK):
        return "this user may not write there"
    return None


class _Collector:
    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[ConfigProblem] = []

    def add(self, key: str, message: str, severity: Severity = "error") -> None:
        self.problems.append(ConfigProblem(severity, self.source, key, message))


def _unknown(c: _Collector, key: str, name: str, where: str, allowed: tuple[str, ...] | list[str]) -> None:
    c.add(key, f"unknown key {name!r} {where}{did_you_mean(name, allowed)}; expected one of {', '.join(allowed)}")


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _check_path_value(c: _Collector, key: str, label: str, value: Any, *, must_exist: bool, check_paths: bool,
                      origin: str) -> None:
    if not _is_text(value) or not value:
        c.add(key, f"key {label!r} must be a directory path (text), not {value!r}")
        return
    if "\x00" in value:
        c.add(key, f"{label} = {value!r} contains a NUL byte: not a path")
        return
    if must_exist and check_paths:
        why = check_root(value, origin)
        if why:
            c.add(key, why)


def _check_target(c: _Collector, name: str, target: Any, check_paths: bool) -> None:
    key = f"classes.{name}.target"
    label = f"[classes.{name}] target"
    if not isinstance(target, Mapping):
        c.add(key, f"{label} must be a table (kind = ...), not {target!r}")
        return
    kind = target.get("kind")
    if kind not in TARGET_KINDS:
        c.add(key, f"{label}: 'kind' must be one of {', '.join(TARGET_KINDS)}, not {kind!r}"
                   + (did_you_mean(kind, TARGET_KINDS) if isinstance(kind, str) else ""))
        return
    if kind == "nvmeof":
        from sfstore import nvme

        try:
            nvme.NvmeofTarget.from_mapping({k: v for k, v in target.items() if k != "kind"}, label)
        except ConfigError as exc:
            c.add(key, str(exc))
        return
    allowed = _TARGET_KEYS[kind]
    for k in target:
        if k not in allowed:
            _unknown(c, f"{key}.{k}", str(k), f"in {label} (kind {kind!r})", allowed)
    if kind == "device":
        dev = target.get("device")
        if not _is_text(dev) or not dev:
            c.add(key, f"{label}: kind 'device' needs 'device' (a block device path)")
        elif check_paths:
            try:
                mode = os.stat(dev).st_mode
            except OSError as exc:
                c.add(key, f"{label}: device {dev} cannot be used: {exc.strerror or exc}")
            else:
                if not stat.S_ISBLK(mode):
                    c.add(key, f"{label}: {dev} is not a block device (use kind 'image' for a file)")
    else:
        path = target.get("path")
        if not _is_text(path) or not path or "\x00" in path:
            c.add(key, f"{label}: kind 'image' needs 'path' (the image file)")
        if "size" in target:
            reason = defaults.SETTINGS["block_image_size"].explain(target["size"])
            if reason:
                c.add(f"{key}.size", f"{label} size: {reason}")


def _check_class(c: _Collector, name: str, table: Any, check_paths: bool) -> None:
    where = f"[classes.{name}]"
    if not isinstance(table, Mapping):
        c.add(f"classes.{name}", f"{where} must be a table, not {table!r}")
        return
    for k in table:
        if k not in CLASS_KEYS:
            _unknown(c, f"classes.{name}.{k}", str(k), f"in {where}", CLASS_KEYS)
    path = table.get("path", DEFAULT_PATH[name])
    if path not in ALLOWED_PATHS[name]:
        c.add(f"classes.{name}.path", f"{where} path = {path!r}; expected one of {', '.join(ALLOWED_PATHS[name])}")
    if "root" in table:
        _check_path_value(c, f"classes.{name}.root", f"{where} root", table["root"], must_exist=True,
                          check_paths=check_paths, origin=f"{where} root in {c.source}")
    if "subdir" in table:
        value = table["subdir"]
        if not _is_text(value):
            c.add(f"classes.{name}.subdir", f"{where} subdir must be a directory path (text), not {value!r}")
        else:
            parts = value.replace("\\", "/").split("/")
            if os.path.isabs(value) or ".." in parts or "\x00" in value:
                c.add(f"classes.{name}.subdir",
                      f"{where} subdir = {value!r} must be a relative directory beneath root (no '..', not "
                      f"absolute); use {where} root = ... for a directory elsewhere")
    if "target" in table:
        if path != "block":
            c.add(f"classes.{name}.target", f"{where} 'target' is for path = 'block' only")
        else:
            _check_target(c, name, table["target"], check_paths)


def check_document(raw: Mapping[str, Any], source: str, *, check_paths: bool = False) -> list[ConfigProblem]:
    """Every problem with a parsed config document ``raw`` (``source`` names it in each problem).

    ``check_paths`` also checks that every configured ``root`` exists and is a directory, and that a target
    ``device`` is a block device (the router checks these when a class is first used).
    """
    c = _Collector(source)
    for k in raw:
        if k not in TOP_KEYS:
            hint = did_you_mean(str(k), TOP_KEYS)
            if not hint and str(k) in defaults.SETTINGS:
                hint = f" (settings go in the [settings] table: [settings] {k} = ...)"
            if not hint and str(k) in DATA_CLASSES:
                hint = f" (a data class is a table: [classes.{k}])"
            c.add(str(k), f"unknown key {str(k)!r}{hint}; expected one of {', '.join(TOP_KEYS)}")
    if "root" in raw:
        _check_path_value(c, "root", "root", raw["root"], must_exist=True, check_paths=check_paths,
                          origin=f"root in {source}")
    if "data_dir" in raw:
        _check_path_value(c, "data_dir", "data_dir", raw["data_dir"], must_exist=False, check_paths=False,
                          origin=f"data_dir in {source}")
    settings = raw.get("settings", {})
    if not isinstance(settings, Mapping):
        c.add("settings", f"[settings] must be a table of sfstore settings, not {settings!r}")
    else:
        for name, value in settings.items():
            if name not in defaults.SETTINGS:
                c.add(f"settings.{name}", f"unknown setting {name!r} in [settings]"
                      f"{did_you_mean(str(name), defaults.SETTINGS)}; `python -m sfstore.defaults` lists them")
                continue
            reason = defaults.SETTINGS[name].explain(value)
            if reason:
                c.add(f"settings.{name}", f"[settings] {name}: {reason}")
    classes = raw.get("classes", {})
    if not isinstance(classes, Mapping):
        c.add("classes", f"'classes' must be a table of data classes ([classes.<name>]), not {classes!r}")
    else:
        for name, table in classes.items():
            if name not in DATA_CLASSES:
                c.add(f"classes.{name}", f"unknown data class [classes.{name}]{did_you_mean(str(name), DATA_CLASSES)}"
                      f"; expected one of {', '.join(DATA_CLASSES)}")
                continue
            _check_class(c, name, table, check_paths)
    return c.problems


def check_toml(text: str, source: str = "TOML", *, check_paths: bool = False) -> list[ConfigProblem]:
    """Every problem with config file text ``text`` (a docs example): its syntax, keys and values. Roots are
    not required to exist unless ``check_paths``."""
    raw, problems = _parse(text, source)
    return problems if raw is None else check_document(raw, source, check_paths=check_paths)


def check_file(path: str | os.PathLike[str], *, check_paths: bool = True) -> list[ConfigProblem]:
    """Every problem with the config file at ``path``: it is missing, a directory, not TOML, or has unknown
    keys or bad values; with ``check_paths``, a configured root that does not exist."""
    name = os.fspath(path)
    raw, problems = read_config_file(name)
    return problems if raw is None else check_document(raw, f"config file {name}", check_paths=check_paths)


def check(config: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None,
          check_paths: bool = True, unknown_variables: Severity = "warning") -> tuple[str | None, list[ConfigProblem]]:
    """The config file that applies (``config``, else as :func:`find_config` finds it) and every problem with
    it and with the ``SFSTORE_*`` variables of ``environ`` (default ``os.environ``); an ``SFSTORE_*`` name
    sfstore does not read is a problem of severity ``unknown_variables``."""
    env = os.environ if environ is None else environ
    path = find_config(config, env)
    problems: list[ConfigProblem] = []
    if path is not None:
        problems += check_file(path, check_paths=check_paths)
    problems += check_environment(env, unknown=unknown_variables)
    root = env.get("SFSTORE_ROOT")
    if root and check_paths:
        why = check_root(root, "SFSTORE_ROOT")
        if why:
            problems.append(ConfigProblem("error", "environment variable SFSTORE_ROOT", "SFSTORE_ROOT", why))
    if check_paths and not any(p.severity == "error" for p in problems):
        problems += _data_dir_problems(path, env)
    return path, problems


def _data_dir_problems(path: str | None, env: Mapping[str, str]) -> list[ConfigProblem]:
    """The data directory in force must be writable where it exists (sfstore keeps the block image and the KV
    tiers' records there); one that does not exist yet is made when first used."""
    setting = defaults.SETTINGS["data_dir"]
    source = "the default data directory (data_dir)"
    value = setting.default_value()
    if env.get(setting.env):
        source, value = f"environment variable {setting.env}", env[setting.env]
    elif path is not None:
        raw = read_config_file(path)[0] or {}
        if isinstance(raw.get("data_dir"), str):
            source, value = f"config file {path}", raw["data_dir"]
    directory = os.path.abspath(os.path.expanduser(value))
    if not os.path.isdir(directory):
        return []
    why = why_not_writable(directory)
    if why is None:
        return []
    return [ConfigProblem("error", source, "data_dir",
                          f"data_dir {directory}: {why}; set SFSTORE_DATA_DIR (or data_dir in the config file) to a "
                          "writable directory")]


def report(path: str | None, problems: list[ConfigProblem]) -> str:
    """What ``sfstore config check`` prints: each problem on its line, then a summary line."""
    lines = [str(p) for p in problems]
    n_err = sum(p.severity == "error" for p in problems)
    n_warn = len(problems) - n_err
    what = f"config file {path}" if path else "no config file (defaults and SFSTORE_* variables)"
    if n_err:
        lines.append(f"configuration has {n_err} error(s)" + (f" and {n_warn} warning(s)" if n_warn else "")
                     + f": {what}")
    else:
        lines.append(f"configuration OK: {what}" + (f" ({n_warn} warning(s))" if n_warn else ""))
    return "\n".join(lines)
