"""Every tunable of sfstore, in one table.

Each setting has a name (``queue_depth``), an environment variable (``SFSTORE_QUEUE_DEPTH``) and a default.
The value in force is, first found: a value given to :func:`set`, the environment variable, the default.
Environment variables are read when :func:`get` is called, so a process may change them at run time.

>>> from sfstore import defaults
>>> defaults.get("queue_depth")
32
>>> with defaults.set(queue_depth=64):
...     defaults.get("queue_depth")
64

``python -m sfstore.defaults`` prints the table as markdown (docs/configuration.md's settings table is that output).
"""

from __future__ import annotations

import decimal
import difflib
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sfstore.errors import ConfigError

__all__ = ["Setting", "SETTINGS", "SIZE_FORMS", "get", "set", "reset", "table", "as_dict", "parse_bool", "parse_size"]


def parse_bool(text: str) -> bool:
    """A boolean setting's text: 1/0, true/false, yes/no or on/off (any case, spaces around); ``ValueError`` else."""
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_RE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[kmgt]?)(?P<i>i?)(?P<b>b?)", re.I)

SIZE_FORMS = ("a byte count such as 4096, 64k, 512MB, 1.5g or 2TiB (k, m, g, t and KiB, MiB, GiB, TiB are "
              "1024-based; KB, MB, GB, TB are 1000-based; the B is optional; any case)")
"""The size forms every size setting, config file and ``--budget`` option accepts, in words."""


def parse_size(text: str) -> int:
    """A size's bytes: ``4096``, ``64k``, ``512MB``, ``1.5g``, ``2TiB`` (see :data:`SIZE_FORMS`).

    ``k``, ``m``, ``g``, ``t`` and ``KiB`` ... ``TiB`` (``Ki`` ... ``Ti``) are binary (1024-based); ``KB`` ... ``TB``
    are decimal (1000-based); a trailing ``B`` is optional and case does not matter. A fraction is allowed where
    the result is a whole number of bytes (``1.5g``, ``0.5k``; not ``1.5`` or ``0.3k``).

    Raises
    ------
    ValueError
        For anything else (negative, empty, unknown unit, a fraction of a byte), with the accepted forms.
    """
    if not isinstance(text, str):
        raise TypeError(f"expected a size, not {type(text).__name__}")
    t = text.strip()
    if t.startswith("-"):
        raise ValueError(f"a size cannot be negative; expected {SIZE_FORMS}")
    m = _SIZE_RE.fullmatch(t) if len(t) <= 64 else None
    if m is None:
        raise ValueError(f"expected {SIZE_FORMS}")
    unit, binary, byte = m["unit"].lower(), m["i"] != "", m["b"] != ""
    if binary and not unit:
        raise ValueError(f"expected {SIZE_FORMS}")
    # 'k' and 'KiB' are 1024-based; only 'KB' (a unit letter, then B, no i) is 1000-based.
    scale = _DECIMAL[unit] if unit and byte and not binary else _BINARY[unit]
    value = decimal.Decimal(m["num"]) * scale
    if value != value.to_integral_value():
        raise ValueError(f"{text.strip()!r} is not a whole number of bytes; expected {SIZE_FORMS}")
    return int(value)


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "sfstore")


def _default_namespace() -> str:
    return ""  # a callable default: the table says "(see meaning)" rather than an empty code span


@dataclass(frozen=True)
class Setting:
    """One tunable: its name, type, default, allowed values and documentation."""

    name: str
    kind: str  # "int" | "size" | "sizes" | "bool" | "choice" | "path" | "str"
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    zero_means_auto: bool = False  # 0 is allowed (and means "decide from the hardware") below ``minimum``
    multiple: int | None = None  # values must be multiples of this (O_DIRECT alignment)
    pattern: str | None = None  # a "str" setting's non-empty values match this; ``pattern_text`` says it in words
    pattern_text: str = ""

    @property
    def env(self) -> str:
        return "SFSTORE_" + self.name.upper()

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default

    def parse(self, raw: object, source: str) -> Any:
        """Convert ``raw`` (a string from the environment or a Python value) to this setting's type.

        Raises :class:`~sfstore.errors.ConfigError` naming ``source`` (the variable, the file and key), the
        setting and the values it accepts.
        """
        try:
            value = self._convert(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: {self._invalid(raw, exc)}") from None
        return value

    def explain(self, raw: object) -> str | None:
        """Why ``raw`` is not a value of this setting, in words; ``None`` when it is one."""
        try:
            self._convert(raw)
        except (ValueError, TypeError) as exc:
            return self._invalid(raw, exc)
        return None

    def _invalid(self, raw: object, exc: Exception) -> str:
        return f"invalid value {raw!r} for {self.name} ({self.env}): {exc}"

    def _convert(self, raw: Any) -> Any:
        if self.kind == "bool":
            return raw if isinstance(raw, bool) else parse_bool(str(raw))
        if self.kind in ("int", "size"):
            expected = f"a size, {SIZE_FORMS}" if self.kind == "size" else "an integer"
            if isinstance(raw, bool):
                raise TypeError(f"expected {expected}")
            if not isinstance(raw, (int, str)):
                raise TypeError(f"expected {expected}, not {type(raw).__name__}")
            if isinstance(raw, int):
                value = raw
            elif self.kind == "size":
                value = parse_size(raw)
            else:
                try:
                    value = int(raw.strip())
                except ValueError:
                    raise ValueError(f"expected an integer, {self.range_text()}") from None
            self._check_range(value)
            return value
        if self.kind == "sizes":
            if isinstance(raw, str):
                items: list[Any] = raw.split(",")
            else:
                try:
                    items = list(raw)
                except TypeError:
                    raise TypeError(f"expected comma-separated sizes or a list of sizes, not {type(raw).__name__}"
                                    ) from None
            sizes = tuple(sorted({x if isinstance(x, int) and not isinstance(x, bool) else parse_size(str(x))
                                  for x in items}))
            if not sizes:
                raise ValueError("expected one or more sizes")
            for size in sizes:
                self._check_range(size)
            return sizes
        if self.kind == "choice":
            text = str(raw).strip().lower()
            if text not in self.choices:
                close = difflib.get_close_matches(text, self.choices, n=1, cutoff=0.6)
                raise ValueError("expected one of " + ", ".join(self.choices)
                                 + (f" (did you mean {close[0]}?)" if close else ""))
            return text
        if self.kind == "path":
            if not isinstance(raw, (str, os.PathLike)) or not str(raw):
                raise TypeError("expected a non-empty path")
            text = os.fspath(raw)
            if not isinstance(text, str) or "\x00" in text:
                raise ValueError("expected a path without NUL bytes")
            return os.path.abspath(os.path.expanduser(text))
        text = str(raw)
        if self.pattern and text and not re.fullmatch(self.pattern, text):
            raise ValueError(f"expected {self.pattern_text}")
        return text

    def _check_range(self, value: int) -> None:
        if value == 0 and self.zero_means_auto:
            return
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            given = _size_text(value) if self.kind in ("size", "sizes") and value >= 0 else str(value)
            raise ValueError(f"expected {self.range_text()}, not {given}")
        if self.multiple and value % self.multiple:
            raise ValueError(f"expected a multiple of {_size_text(self.multiple)}")

    def allowed_text(self) -> str:
        """The values this setting accepts, in words (the table's "Allowed" column)."""
        if self.kind == "bool":
            return "on/off"
        if self.kind == "choice":
            return ", ".join(f"`{c}`" for c in self.choices)
        if self.kind == "path":
            return "a directory"
        if self.kind == "sizes":
            return "sizes, each " + self.range_text()
        return self.range_text() if self.kind in ("int", "size") else "text"

    def range_text(self) -> str:
        """The values allowed, in words (``"1 to 16384"``, ``"0 (auto) or 64 KiB to 1 GiB"``)."""
        fmt = _size_text if self.kind in ("size", "sizes") else str
        if self.minimum is None and self.maximum is None:
            text = "any integer"
        elif self.maximum is None:
            text = f"at least {fmt(self.minimum)}"
        elif self.minimum is None:
            text = f"at most {fmt(self.maximum)}"
        else:
            text = f"{fmt(self.minimum)} to {fmt(self.maximum)}"
        if self.multiple:
            text += f", a multiple of {_size_text(self.multiple)}"
        return f"0 (auto) or {text}" if self.zero_means_auto else text


def _size_text(n: int | None) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n is not None and n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)


_SETTINGS_LIST = [
    Setting("data_dir", "path", _default_data_dir,
            "Embedded default data directory: where every path stores data when no cluster is configured "
            "(default `$XDG_DATA_HOME/sfstore`, else `~/.local/share/sfstore`)."),
    Setting("engine", "choice", "auto",
            "I/O engine: `uring` (io_uring), `threads` (native thread pool), `python` (pure Python), "
            "or `auto` (the first of these that works here).",
            choices=("auto", "uring", "threads", "python")),
    Setting("queue_depth", "int", 32, "Requests the engine keeps in flight at once (io_uring ring size).",
            minimum=1, maximum=16384),
    Setting("uring_spin_us", "int", 0,
            "Microseconds the io_uring engine polls for completions before it sleeps (0: never poll). Polling "
            "costs CPU while I/O is in flight but saves a wake-up per completion.", minimum=0, maximum=100_000),
    Setting("io_threads", "int", 8, "Worker threads of the `threads` and `python` engines.", minimum=1, maximum=1024),
    Setting("direct_io", "choice", "auto",
            "Open files with O_DIRECT: `auto` (where the filesystem allows it), `on` (fail where it does not) "
            "or `off`.", choices=("auto", "on", "off")),
    Setting("bounce", "bool", True,
            "Let the engine move misaligned heads, tails and buffers of O_DIRECT requests through bounce "
            "buffers; when off, such a request raises `AlignmentError`."),
    Setting("bounce_buffer_size", "size", 2 << 20,
            "Size of each engine bounce buffer; misaligned buffers move in pieces of this size (multiples of 2 MiB "
            "get huge pages).", minimum=4096, maximum=1 << 30),
    Setting("buffer_size", "size", 8 << 20, "Default size of a registered buffer in a pool.", minimum=4096,
            maximum=16 << 30),
    Setting("file_chunk_size", "size", 0,
            "Bytes per request when the file path moves a large file; 0: from the mount (a few NFS `rsize`, "
            "8 MiB on a local filesystem).", minimum=4096, maximum=1 << 30, multiple=4096,
            zero_means_auto=True),
    Setting("file_parallelism", "int", 0,
            "Requests the file path keeps in flight; 0: from the mount (16, or 16 per NFS `nconnect`, at most "
            "64).", minimum=1, maximum=1024, zero_means_auto=True),
    Setting("file_small_parallelism", "int", 64,
            "Files the file path reads at once when it reads many small files (through the page cache, on the "
            "native thread pool when `engine` is `auto`).", minimum=1, maximum=1024),
    Setting("huge_pages", "choice", "auto",
            "Back pool buffers of 2 MiB multiples with huge pages: `auto` (hugetlbfs pages if reserved, "
            "else transparent huge pages), `on` (fail without hugetlbfs pages) or `off`.",
            choices=("auto", "on", "off")),
    Setting("mlock", "choice", "auto",
            "Lock pool buffers in RAM: `auto` (try; the probe reports when RLIMIT_MEMLOCK refuses), `on` "
            "(fail when refused) or `off`.", choices=("auto", "on", "off")),
    Setting("cuda_register", "choice", "auto",
            "Register pool buffers with CUDA (`cuMemHostRegister`): `auto` (where a driver is present, a "
            "reported no-op elsewhere), `on` (fail without a driver) or `off`.", choices=("auto", "on", "off")),
    Setting("checkpoint_shard_bytes", "size", 1 << 30,
            "Most tensor bytes per checkpoint shard file (`sfstore.checkpoint.save(max_shard_bytes=...)`); a "
            "tensor larger than this gets a shard of its own.", minimum=1, maximum=1 << 40),
    Setting("checkpoint_buffer_size", "size", 32 << 20,
            "Size of each registered buffer a synchronous checkpoint save streams shards through (fill one "
            "while the others are written).", minimum=4096, maximum=4 << 30),
    Setting("checkpoint_buffers", "int", 6,
            "Registered buffers a synchronous checkpoint save cycles through: its extra memory is "
            "`checkpoint_buffers` x `checkpoint_buffer_size` (less for small shards).", minimum=2,
            maximum=256),
    Setting("checkpoint_copy_threads", "int", 4,
            "Threads `sfstore.checkpoint.save_async` copies tensors into its host buffers with, before it "
            "returns.", minimum=1, maximum=256),
    Setting("checkpoint_reuse_buffers", "bool", True,
            "Keep checkpoints' registered host buffers for the next save or load, so it does not allocate, fault "
            "in and pin them again: `save`'s ring and `save_async`'s copy of the tensor bytes (held between "
            "saves), and `load`'s shard buffers once their tensors are gone (as many of each size as the most "
            "recent load took); `sfstore.checkpoint.free_buffers()` gives them back. Off: free them when each "
            "save ends or each loaded buffer's tensors are gone."),
    Setting("block_image_size", "size", 256 << 20,
            "Size of the block path's image file when no NVMe namespace or block device is configured (the "
            "embedded default, `<data_dir>/hot/blocks.img`), preallocated when it is created.", minimum=1 << 20,
            maximum=1 << 50),
    Setting("block_size_classes", "sizes", (64 << 10, 256 << 10, 2 << 20),
            "Value size classes of a `BlockStore` (comma-separated sizes): a value goes to the smallest class "
            "that holds it; each class gets an equal share of the device's bytes.", minimum=512,
            maximum=1 << 30),
    Setting("kvcache_pinned_bytes", "size", 512 << 20,
            "Budget of a `KVCacheStore`'s pinned host tier (registered memory; least recently used blocks leave "
            "it first; 0: no pinned tier).", minimum=0, maximum=4 << 40),
    Setting("kvcache_shared_bytes", "size", 0,
            "Budget of a `KVCacheStore`'s shared tier, per cache namespace: every process and node that writes the "
            "directory evicts its least recently read blocks beyond it (records in the directory, no server; "
            "`sfstore kv gc` enforces it at once); 0: unbounded.", minimum=0, maximum=1 << 50),
    Setting("kvcache_namespace", "str", _default_namespace,
            "Cache namespace of a `KVCacheStore`'s shared tier (`cache_namespace`): its blocks live in "
            "`ns/<name>/` of the shared directory, and never read or evict another namespace's; empty: the "
            "default namespace (the directory itself; the default). 1 to 64 letters, digits, `.`, `_`, `-`.",
            pattern=r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
            pattern_text="1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"),
    Setting("kvcache_chunk_tokens", "int", 256,
            "Tokens per file of a `KVCacheStore`'s shared tier: consecutive blocks of one prompt are stored as "
            "one chunk file of this many tokens (a multiple of the geometry's `block_tokens`), laid out "
            "layer-major, so a hit of n tokens opens about n / this files (on NFS each open and close is a round "
            "trip to the server). 0: one file per block.", minimum=0, maximum=1 << 20),
    Setting("kvcache_load_or_recompute", "bool", True,
            "Whether a `KVCacheStore`'s engine connector reports a hit from a lower tier only where loading it is "
            "expected to be faster than recomputing it: each tier's load rate and the engine's prefill rate are "
            "measured from the store's own loads and the engine's own misses (off: every hit is loaded)."),
    Setting("kvcache_io_timeout_ms", "int", 500,
            "Deadline of every operation of a `KVCacheStore`'s block-store and shared tiers, in milliseconds (0: "
            "none: a stalled mount then holds the caller until it returns). Past it a get is a miss and a put is "
            "dropped (counted), the tier is quarantined, and the caller goes on: I/O runs on the tier's own "
            "threads, and one stuck in a stalled mount is abandoned. One deadline covers a batch (up to 64 "
            "shared-tier or 16 block-store blocks): raise it where a batch's bytes take longer than a tenth of it "
            "to read (slow links, large blocks).", minimum=0, maximum=3_600_000),
    Setting("kvcache_quarantine_ms", "int", 1000,
            "First back-off of a KV tier that missed a deadline, in milliseconds: it is answered at once, without "
            "I/O, for this long, then probed; each miss in a row doubles it, to at most 64 times this.",
            minimum=1, maximum=3_600_000),
    Setting("block_max_key_bytes", "int", 256,
            "Longest key a `BlockStore` accepts (bytes, or a str's UTF-8 bytes); keys live in slot headers.",
            minimum=1, maximum=65536),
]

SETTINGS: Mapping[str, Setting] = {s.name: s for s in _SETTINGS_LIST}

_overrides: dict[str, Any] = {}
_lock = threading.Lock()


def overrides_key() -> tuple[tuple[str, str], ...]:
    """The settings changed with :func:`set` in this process, as a hashable value (to cache on)."""
    with _lock:
        return tuple(sorted((k, repr(v)) for k, v in _overrides.items()))


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise ConfigError(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}") from None


# The settings of the configuration file an open router was made from (its [settings] and data_dir), a layer
# below the environment: a variable, or defaults.set in code, still wins over the file. One layer: the router
# opened last; closing it takes its layer away.
_config_layer: dict[str, Any] = {}
_config_source = ""
_config_owner: object | None = None


def get(name: str) -> Any:
    """Return the value in force for ``name``: an override (:func:`set`), else ``SFSTORE_<NAME>``, else the open
    configuration file's ``[settings]``, else the default."""
    setting = _setting(name)
    with _lock:
        if name in _overrides:
            return _overrides[name]
        layered = _config_layer.get(name, _MISSING)
    raw = os.environ.get(setting.env)
    if raw is not None and raw != "":
        return setting.parse(raw, f"environment variable {setting.env}")
    if layered is not _MISSING:
        return layered
    return setting.default_value()


def source(name: str) -> str:
    """Say where the value in force for ``name`` comes from: ``"set"``, the variable's name, ``"[settings] in
    <config>"`` or ``"default"``."""
    setting = _setting(name)
    with _lock:
        if name in _overrides:
            return "set"
        layered = name in _config_layer
        where = _config_source
    if os.environ.get(setting.env):
        return setting.env
    return f"[settings] in {where}" if layered else "default"


def apply_config(values: Mapping[str, Any], where: str, owner: object) -> None:
    """Make ``values`` (parsed settings) the configuration layer, from ``where``, held by ``owner`` (the router):
    it replaces the layer of any configuration opened before."""
    global _config_layer, _config_source, _config_owner
    with _lock:
        _config_layer, _config_source, _config_owner = dict(values), where, owner


def drop_config(owner: object) -> None:
    """Take ``owner``'s configuration layer away (its router closed); a layer another router holds stays."""
    global _config_layer, _config_source, _config_owner
    with _lock:
        if _config_owner is owner:
            _config_layer, _config_source, _config_owner = {}, "", None


class _Restore:
    """Returned by :func:`set`; restores the previous values when used as a context manager."""

    def __init__(self, previous: dict[str, object]) -> None:
        self._previous = previous

    def __enter__(self) -> _Restore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        with _lock:
            for name, value in self._previous.items():
                if value is _MISSING:
                    _overrides.pop(name, None)
                else:
                    _overrides[name] = value


_MISSING = object()


def set(**values: object) -> _Restore:
    """Override settings for this process; takes effect at once.

    Returns an object that, used as a context manager, restores the previous values on exit.
    Invalid names or values raise :class:`~sfstore.errors.ConfigError` and change nothing.
    """
    parsed = {name: _setting(name).parse(value, "defaults.set") for name, value in values.items()}
    with _lock:
        previous = {name: _overrides.get(name, _MISSING) for name in parsed}
        _overrides.update(parsed)
    return _Restore(previous)


def reset() -> None:
    """Drop every override made with :func:`set`, and the open configuration's layer."""
    global _config_layer, _config_source, _config_owner
    with _lock:
        _overrides.clear()
        _config_layer, _config_source, _config_owner = {}, "", None


def as_dict() -> dict[str, Any]:
    """Every setting's value in force."""
    return {name: get(name) for name in SETTINGS}


def table(markdown: bool = True) -> str:
    """The documented table of settings (markdown by default)."""
    rows = ["| Variable | Setting | Default | Allowed | Meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        default = "(see meaning)" if callable(s.default) else f"`{s.default}`"
        rows.append(f"| `{s.env}` | `{s.name}` | {default} | {s.allowed_text()} | {s.doc} |")
    return "\n".join(rows)



if __name__ == "__main__":
    print(table())
