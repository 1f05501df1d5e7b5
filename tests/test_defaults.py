"""sfstore.defaults: precedence, parsing, set() as a context manager, and the printed table (docs/configuration.md
holds it: tests/docs/test_docs_pages.py keeps the two equal)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sfstore import defaults, errors


@pytest.fixture(autouse=True)
def _clean() -> None:
    defaults.reset()
    yield
    defaults.reset()


def test_every_setting_has_an_sfstore_variable_and_docs() -> None:
    for name, s in defaults.SETTINGS.items():
        assert s.env == "SFSTORE_" + name.upper()
        assert s.doc.strip()
        defaults.get(name)  # every default parses


def test_precedence_set_over_env_over_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert defaults.get("queue_depth") == 32 and defaults.source("queue_depth") == "default"
    monkeypatch.setenv("SFSTORE_QUEUE_DEPTH", "8")
    assert defaults.get("queue_depth") == 8 and defaults.source("queue_depth") == "SFSTORE_QUEUE_DEPTH"
    with defaults.set(queue_depth=64):
        assert defaults.get("queue_depth") == 64 and defaults.source("queue_depth") == "set"
        with defaults.set(queue_depth=128):
            assert defaults.get("queue_depth") == 128
        assert defaults.get("queue_depth") == 64
    assert defaults.get("queue_depth") == 8


def test_set_takes_effect_without_a_with_block() -> None:
    handle = defaults.set(engine="python")
    assert defaults.get("engine") == "python"
    handle.restore()
    assert defaults.get("engine") == "auto"


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("buffer_size", "64k", 64 << 10),
        ("buffer_size", "2MiB", 2 << 20),
        ("buffer_size", "4096", 4096),
        ("bounce", "off", False),
        ("bounce", "YES", True),
        ("engine", " Uring ", "uring"),
    ],
)
def test_env_values_are_parsed(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, expected: object) -> None:
    monkeypatch.setenv(defaults.SETTINGS[name].env, raw)
    assert defaults.get(name) == expected


@pytest.mark.parametrize(
    ("name", "raw"),
    [("queue_depth", "0"), ("queue_depth", "many"), ("buffer_size", "1q"), ("bounce", "maybe"), ("engine", "spdk")],
)
def test_bad_env_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, raw: str) -> None:
    env = defaults.SETTINGS[name].env
    monkeypatch.setenv(env, raw)
    with pytest.raises(errors.ConfigError) as info:
        defaults.get(name)
    assert isinstance(info.value, ValueError)
    assert env in str(info.value) and repr(raw) in str(info.value)


def test_bad_set_changes_nothing() -> None:
    with pytest.raises(errors.ConfigError):
        defaults.set(queue_depth=4, bounce="perhaps")
    assert defaults.get("queue_depth") == 32  # the valid half was not applied either
    with pytest.raises(errors.ConfigError, match="unknown setting"):
        defaults.set(queue_dept=4)
    with pytest.raises(errors.ConfigError):
        defaults.set(queue_depth=True)


def test_data_dir_is_absolute(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SFSTORE_DATA_DIR", "~/x/../y")
    assert Path(defaults.get("data_dir")).is_absolute()
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path))
    assert defaults.get("data_dir") == str(tmp_path)


def test_module_prints_the_table() -> None:
    out = subprocess.run([sys.executable, "-m", "sfstore.defaults"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == defaults.table().strip()
