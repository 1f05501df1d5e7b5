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


# -- sizes: one parser for every size setting, [settings] and --budget ------------------------------------------

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096), ("4096B", 4096), ("64k", 64 * KiB), ("64K", 64 * KiB), ("64KiB", 64 * KiB),
        ("64ki", 64 * KiB), ("1m", MiB), ("2MiB", 2 * MiB), ("512MB", 512_000_000), ("512mb", 512_000_000),
        ("1g", GiB), ("1GB", 10**9), ("1gib", GiB), ("2t", 2 * TiB), ("2TiB", 2 * TiB), ("2TB", 2 * 10**12),
        ("1.5g", 3 * GiB // 2), ("0.5k", 512), (".5m", MiB // 2), (" 8 MiB ", 8 * MiB), ("1.0", 1),
    ],
)
def test_size_forms(text: str, expected: int) -> None:
    assert defaults.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "-4k", "lots", "1.5", "0.3k", "1e9", "2x", "1ib", "k", "nan", "inf",
                                  "1..5k", "4 k b", "1_000", "٣k", "9" * 80])
def test_size_garbage_is_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError) as info:
        defaults.parse_size(text)
    assert "64k, 512MB, 1.5g or 2TiB" in str(info.value) and "1000-based" in str(info.value)


def test_kvcache_shared_bytes_takes_2t_from_every_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SFSTORE_KVCACHE_SHARED_BYTES", "2t")
    assert defaults.get("kvcache_shared_bytes") == 2 * TiB
    monkeypatch.delenv("SFSTORE_KVCACHE_SHARED_BYTES")
    with defaults.set(kvcache_shared_bytes="1.5TB", block_size_classes="64k,1MB,2MiB"):
        assert defaults.get("kvcache_shared_bytes") == 1_500_000_000_000
        assert defaults.get("block_size_classes") == (64 * KiB, 1_000_000, 2 * MiB)
    from sfstore.router import Router

    cfg = tmp_path / "sfstore.toml"
    cfg.write_text('[settings]\nkvcache_shared_bytes = "2t"\nkvcache_pinned_bytes = "512MB"\n')
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    Router(cfg)
    assert defaults.get("kvcache_shared_bytes") == 2 * TiB and defaults.get("kvcache_pinned_bytes") == 512_000_000


@pytest.mark.parametrize(("source", "raw"), [("env", "2048t"), ("env", "-1"), ("env", "1.5"), ("file", "2048t"),
                                             ("file", "-5"), ("file", "lots")])
def test_a_bad_size_names_the_setting_its_source_and_the_forms(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str, raw: str
) -> None:
    from sfstore.router import Router

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path / "data"))
    if source == "env":
        monkeypatch.setenv("SFSTORE_KVCACHE_SHARED_BYTES", raw)
        with pytest.raises(errors.ConfigError) as info:
            defaults.get("kvcache_shared_bytes")
        where = "environment variable SFSTORE_KVCACHE_SHARED_BYTES"
    else:
        cfg = tmp_path / "sfstore.toml"
        value = raw if raw.lstrip("-").isdigit() else f'"{raw}"'
        cfg.write_text(f"[settings]\nkvcache_shared_bytes = {value}\n")
        with pytest.raises(errors.ConfigError) as info:
            Router(cfg)
        where = f"config file {cfg}: [settings] kvcache_shared_bytes"
    text = str(info.value)
    assert where in text and "kvcache_shared_bytes" in text, text
    if raw == "2048t":
        assert "expected 0 to 1024 TiB, not 2048 TiB" in text
    elif raw == "-5":
        assert "expected 0 to 1024 TiB, not -5" in text
    else:
        assert "512MB" in text and "1000-based" in text  # the accepted forms


def test_bench_sizes_are_the_same_sizes() -> None:
    from tools.bench.options import parse_size

    assert parse_size("1GB") == 10**9 and parse_size("1g") == GiB and parse_size("2t") == 2 * TiB
    with pytest.raises(ValueError, match="not a size"):
        parse_size("-1k")


def test_kv_du_budget_takes_2t(tmp_path: Path) -> None:
    import json
    import os

    shared = tmp_path / "shared"
    shared.mkdir()
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "SFSTORE_DATA_DIR": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
           "PYTHONPATH": os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("SFSTORE_CONFIG", None)
    for budget, expected in (("2t", 2 * TiB), ("1.5g", 3 * GiB // 2), ("512MB", 512_000_000)):
        out = subprocess.run([sys.executable, "-m", "sfstore.cli", "kv", "du", str(shared), "--budget", budget,
                              "--json"], capture_output=True, text=True, env=env, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        assert [r["budget"] for r in json.loads(out.stdout)] == [expected]
    out = subprocess.run([sys.executable, "-m", "sfstore.cli", "kv", "du", str(shared), "--budget", "2q"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 1 and "--budget" in out.stderr and "2TiB" in out.stderr
