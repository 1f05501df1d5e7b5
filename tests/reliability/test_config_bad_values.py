"""The configuration table of bad values: every setting, config file and data directory a clumsy user can get
wrong is a :class:`~sfstore.errors.ConfigError` that names the setting (or file, or key) and what was expected —
never an error from inside nanobind, a silent change of engine, a hang on a special file, or checkpoints placed
outside ``root``."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import run_child

import sfstore
from sfstore import defaults, errors
from sfstore.engine import get_engine
from sfstore.router import Router

TOO_BIG = (1 << 32, (1 << 63) + 1, 10**30)

# Per setting: values that must be refused from every source (environment, defaults.set, [settings]).
BAD: dict[str, list[Any]] = {
    "queue_depth": [0, -1, 100_000, *TOO_BIG, "1e3", 2.5],
    "uring_spin_us": [-1, 10**7, *TOO_BIG],
    "io_threads": [0, -3, 5000, *TOO_BIG],
    "bounce_buffer_size": [0, 100, 1 << 31, *TOO_BIG],
    "buffer_size": [0, -4096, 1 << 40, "8 MiBs"],
    "file_chunk_size": [1, 4095, 5000, 2 << 30, -1, *TOO_BIG],
    "file_parallelism": [-1, 100_000, *TOO_BIG],
    "file_small_parallelism": [0, 10**6],
    "checkpoint_shard_bytes": [0, 1 << 41],
    "checkpoint_buffer_size": [1, 1 << 33],
    "checkpoint_buffers": [1, 10**4],
    "checkpoint_copy_threads": [0, 10**4],
    "block_image_size": [1000, 1 << 51],
    "block_size_classes": ["", "100", "4k,2g", [512, 0]],
    "kvcache_pinned_bytes": [-1, 1 << 43],
    "block_max_key_bytes": [0, 1 << 20],
    "engine": ["spdk", ""],
    "direct_io": ["sometimes"],
    "bounce": ["maybe", 2],
    "data_dir": ["", "a\x00b"],
}


@pytest.fixture(autouse=True)
def _clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in defaults.SETTINGS:
        monkeypatch.delenv(defaults.SETTINGS[name].env, raising=False)
    monkeypatch.delenv("SFSTORE_CONFIG", raising=False)
    monkeypatch.delenv("SFSTORE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    defaults.reset()
    yield
    defaults.reset()


def _cases() -> list[tuple[str, Any]]:
    return [(name, value) for name, values in BAD.items() for value in values]


def test_every_numeric_setting_has_an_upper_bound() -> None:
    for s in defaults.SETTINGS.values():
        if s.kind in ("int", "size", "sizes"):
            assert s.maximum is not None, f"{s.name} accepts any huge number"
            assert s.minimum is not None, f"{s.name} accepts any negative number"


@pytest.mark.parametrize(("name", "value"), _cases())
def test_bad_value_from_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: Any
) -> None:
    if not isinstance(value, (str, int)) or isinstance(value, bool) or (isinstance(value, str) and "\x00" in value):
        pytest.skip("the environment holds only text without NUL bytes")
    env = defaults.SETTINGS[name].env
    monkeypatch.setenv(env, str(value))
    if str(value) == "":
        assert defaults.get(name) == defaults.SETTINGS[name].default_value()  # empty means unset
        return
    with pytest.raises(errors.ConfigError) as info:
        defaults.get(name)
    assert env in str(info.value) and "expected" in str(info.value)


@pytest.mark.parametrize(("name", "value"), _cases())
def test_bad_value_through_set_changes_nothing(name: str, value: Any) -> None:
    before = defaults.get(name)
    with pytest.raises(errors.ConfigError) as info:
        defaults.set(**{name: value})
    assert name in str(info.value)
    assert defaults.get(name) == before


@pytest.mark.parametrize(("name", "value"), [c for c in _cases() if not isinstance(c[1], float)])
def test_bad_value_in_a_config_file_names_the_file_and_key(tmp_path: Path, name: str, value: Any) -> None:
    cfg = tmp_path / "bad.toml"
    if isinstance(value, list):
        literal = "[" + ", ".join(str(v) for v in value) + "]"
    elif isinstance(value, str):
        literal = '"' + value.replace("\x00", "\\u0000") + '"'
    else:
        literal = str(value)
    cfg.write_text(f"[settings]\n{name} = {literal}\n")
    with pytest.raises(errors.ConfigError) as info:
        Router(cfg)
    assert str(cfg) in str(info.value) and name in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"queue_depth": 1 << 32}, "queue_depth"),
        ({"queue_depth": 100_000}, "queue_depth"),
        ({"threads": 1 << 40}, "io_threads"),
        ({"threads": -1}, "io_threads"),
        ({"queue_depth": "deep"}, "queue_depth"),
    ],
)
def test_get_engine_refuses_out_of_range_arguments(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(errors.ConfigError, match=needle):
        get_engine(**kwargs)


@pytest.mark.parametrize(
    ("env", "value", "needle"),
    [
        ("SFSTORE_QUEUE_DEPTH", "100000", "queue_depth"),
        ("SFSTORE_QUEUE_DEPTH", str(1 << 33), "queue_depth"),
        ("SFSTORE_IO_THREADS", str(1 << 33), "io_threads"),
        ("SFSTORE_URING_SPIN_US", str(1 << 33), "uring_spin_us"),
    ],
)
def test_the_engine_setting_is_never_silently_replaced(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, needle: str
) -> None:
    get_engine()  # an engine built with the good values is cached: it must not be handed out for the bad ones
    monkeypatch.setenv(env, value)
    with pytest.raises(errors.ConfigError, match=needle):
        get_engine()


def test_a_changed_engine_setting_gets_an_engine_built_with_it() -> None:
    first = get_engine()
    with defaults.set(bounce_buffer_size=4 << 20):
        assert get_engine() is not first
    assert get_engine() is first


# -- config files ------------------------------------------------------------------------------------------------


def _open_with_timeout(config: str | os.PathLike[str], seconds: float = 10.0) -> BaseException | None:
    """``Router(config)`` on a thread: what it raised, or a failure if it is still running after ``seconds``."""
    got: list[BaseException | None] = []

    def run() -> None:
        try:
            Router(config)
            got.append(None)
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"Router({config!r}) still running after {seconds} s (blocked on a special file?)")
    return got[0]


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/null", "/dev/urandom", "/proc/self/mem", "fifo", "dir"])
def test_a_special_file_as_config_is_refused_without_blocking(tmp_path: Path, special: str) -> None:
    if special == "fifo":
        special = str(tmp_path / "sfstore.toml")
        os.mkfifo(special)
    elif special == "dir":
        special = str(tmp_path / "confdir")
        os.mkdir(special)
    # In a child with a bounded address space: reading /dev/zero "until the end" must fail there, not here.
    got = run_child(
        f"""
        from sfstore import errors
        from sfstore.router import Router
        try:
            Router({special!r})
        except errors.ConfigError as exc:
            print("CONFIG-ERROR", exc)
        """,
        address_space=2 << 30,
        timeout=30,
    )
    assert got.signal is None and got.returncode == 0, got.stderr[-2000:]
    assert "CONFIG-ERROR" in got.stdout and special in got.stdout, got.stdout + got.stderr[-2000:]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (bytes(range(256)) * 4, "not UTF-8"),
        (b"\xff\xfe" + "root = 'x'".encode("utf-16-le"), "not UTF-8"),
        (b"root = 'a'\n\x00\x01", "not valid TOML"),
        (b"x = " + b"[" * 5000 + b"]" * 5000, "config file"),
        (b"# " + b"a" * (2 << 20), "at most"),
    ],
)
def test_a_binary_or_huge_config_file_is_a_config_error(tmp_path: Path, content: bytes, needle: str) -> None:
    cfg = tmp_path / "sfstore.toml"
    cfg.write_bytes(content)
    exc = _open_with_timeout(cfg)
    assert isinstance(exc, errors.ConfigError), repr(exc)
    assert needle in str(exc)


@pytest.mark.parametrize("subdir", ["../../x", "..", "a/../../b", "/abs/elsewhere", "a/..\\..\\b"])
def test_a_class_subdir_cannot_leave_root(tmp_path: Path, subdir: str) -> None:
    cfg = tmp_path / "sfstore.toml"
    cfg.write_text(f"root = {str(tmp_path / 'root')!r}\n[classes.checkpoint]\nsubdir = {subdir!r}\n")
    with pytest.raises(errors.ConfigError, match="beneath root"):
        Router(cfg)
    assert not (tmp_path / "x").exists() and not (tmp_path / "b").exists()


def test_a_subdir_beneath_root_still_works(tmp_path: Path) -> None:
    cfg = tmp_path / "sfstore.toml"
    cfg.write_text(f"root = {str(tmp_path / 'root')!r}\n[classes.checkpoint]\nsubdir = 'a/./ckpt/'\n")
    (tmp_path / "root").mkdir()  # a configured root must exist; the subdir beneath it is made
    fp = Router(cfg).file_path("checkpoint")
    assert fp.root == str(tmp_path / "root" / "a" / "ckpt")


# -- the data directory ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data_dir", ["/dev/null", "/proc/x", "/proc/self/status", "file"])
def test_a_data_dir_that_cannot_be_a_directory_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: str
) -> None:
    if data_dir == "file":
        data_dir = str(tmp_path / "a-file")
        Path(data_dir).write_bytes(b"x")
    monkeypatch.setenv("SFSTORE_DATA_DIR", data_dir)
    for data_class in ("dataset", "checkpoint", "hot", "kvcache"):
        with pytest.raises(errors.ConfigError) as info:
            sfstore.open().path(data_class)
        assert data_dir in str(info.value) and "SFSTORE_DATA_DIR" in str(info.value)
    assert Path("/dev/null").is_char_device()  # and it was not replaced


def test_describe_reports_a_bad_data_dir_instead_of_raising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SFSTORE_DATA_DIR", "/dev/null")
    from sfstore.probe import probe

    report = probe()
    assert report["data_dir"] is not None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"chunk_size": 1}, "chunk_size"),
        ({"chunk_size": -5}, "chunk_size"),
        ({"chunk_size": 5000}, "chunk_size"),
        ({"chunk_size": 1 << 40}, "chunk_size"),
        ({"parallelism": 10**9}, "parallelism"),
        ({"parallelism": -1}, "parallelism"),
    ],
)
def test_file_path_arguments_obey_the_settings_ranges(tmp_path: Path, kwargs: dict[str, Any], needle: str) -> None:
    from sfstore.paths.file import FilePath

    with pytest.raises(errors.ConfigError, match=needle):
        FilePath(tmp_path / "root", **kwargs)
