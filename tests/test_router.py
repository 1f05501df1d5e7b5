"""sfstore.open(): config file, SFSTORE_* variables and defaults; routing per data class; typed config errors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import sfstore
from sfstore import defaults, errors
from sfstore.blocks import BlockStore
from sfstore.paths.file import FilePath
from sfstore.router import find_config


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("SFSTORE_CONFIG", "SFSTORE_ROOT", "SFSTORE_DATA_DIR", "SFSTORE_QUEUE_DEPTH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    defaults.reset()
    yield
    defaults.reset()


def test_defaults_route_to_the_data_dir(tmp_path: Path) -> None:
    r = sfstore.open()
    assert r.config_file is None and r.root == str(tmp_path / "data")
    ds = r.path("dataset")
    assert isinstance(ds, FilePath) and ds.root == os.path.realpath(tmp_path / "data")
    assert r.file_path("checkpoint").root == os.path.realpath(tmp_path / "data" / "checkpoints")
    assert r.path("dataset") is ds  # made once
    d = r.describe()
    assert d["classes"]["dataset"]["transport"] == "local"
    assert any("embedded default" in w for w in d["classes"]["dataset"]["why"])
    hot = d["classes"]["hot"]
    assert hot["available"] and hot["path"] == "block" and hot["transport"] == "local"
    assert hot["root"] == str(tmp_path / "data" / "hot" / "blocks.img")
    assert any("image file" in f for f in hot["fallbacks"])
    kv = d["classes"]["kvcache"]
    assert kv["available"] and kv["path"] == "device" and kv["root"] == str(tmp_path / "data" / "kvcache")
    assert any("device path staged" in f for f in kv["fallbacks"])  # no GPU here: reported, not silent
    assert kv["gpu_route"]["route"] == "staged" and "no CUDA driver" in kv["gpu_route"]["why"]
    text = r.format()
    assert "dataset" in text and "fallback: local" in text and "GPU route: staged (" in text


def test_config_file_and_env_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for d in ("shared", "ckpt", "env-root"):
        (tmp_path / d).mkdir()  # configured roots must exist
    cfg = tmp_path / "sfstore.toml"
    cfg.write_text(
        f'root = "{tmp_path / "shared"}"\n'
        "[settings]\nqueue_depth = 48\n"
        f'[classes.checkpoint]\npath = "file"\nroot = "{tmp_path / "ckpt"}"\n'
        '[classes.hot]\npath = "file"\n'
    )
    r = sfstore.open()  # ./sfstore.toml is found
    assert r.config_file == str(cfg)
    assert r.file_path("dataset").root == os.path.realpath(tmp_path / "shared")
    assert r.file_path("checkpoint").root == os.path.realpath(tmp_path / "ckpt")
    assert defaults.get("queue_depth") == 48
    hot = r.describe()["classes"]["hot"]
    assert hot["available"] and hot["path"] == "file"
    defaults.reset()
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "env-root"))
    monkeypatch.setenv("SFSTORE_QUEUE_DEPTH", "16")
    r2 = sfstore.open(str(cfg))
    assert r2.root == str(tmp_path / "env-root")  # the variable wins over the file
    assert defaults.get("queue_depth") == 16


def test_config_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert find_config() is None
    user = tmp_path / "xdg" / "sfstore" / "sfstore.toml"
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert find_config() == str(user)
    (tmp_path / "sfstore.toml").write_text("")
    assert find_config() == str(tmp_path / "sfstore.toml")
    monkeypatch.setenv("SFSTORE_CONFIG", "/elsewhere.toml")
    assert find_config() == "/elsewhere.toml"
    assert find_config("given.toml") == "given.toml"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("root = 5\n", "'root' must be a directory path"),
        ("rooot = '/x'\n", "unknown key 'rooot' (did you mean root?)"),
        ("[classes.videos]\npath = 'file'\n", "unknown data class [classes.videos]"),
        ("[classes.dataset]\npath = 'block'\n", "path = 'block'; expected one of file"),
        ("[classes.dataset]\nroot = '/x'\nmount = 'y'\n", "unknown key 'mount' in [classes.dataset]"),
        ("[settings]\nqueue_depth = 'deep'\n", "queue_depth"),
        ("[settings]\nspeed = 'max'\n", "unknown setting 'speed'"),
        ("root = \n", "not valid TOML"),
    ],
)
def test_bad_config_names_file_key_and_expectation(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(errors.ConfigError) as info:
        sfstore.open(cfg)
    assert str(cfg) in str(info.value) and needle in str(info.value), str(info.value)
    assert defaults.get("queue_depth") == 32  # nothing half-applied


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="does not exist"):
        sfstore.open(tmp_path / "nope.toml")


def test_counters_per_class(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()  # a configured root must exist
    r = sfstore.open({"root": str(tmp_path / "m")})
    fp = r.file_path("dataset")
    fp.write("x.bin", b"hello")
    assert fp.read("x.bin") == b"hello"
    c = r.counters()["dataset"]
    assert c["bytes_read"] == 5 and c["bytes_written"] == 5 and c["files"] >= 2


def test_hot_blocks_go_to_a_configured_block_target(tmp_path: Path) -> None:
    image = tmp_path / "scratch" / "hot.img"
    r = sfstore.open({"classes": {"hot": {"path": "block",
                                          "target": {"kind": "image", "path": str(image), "size": "8M"}}}})
    store = BlockStore.from_router(r, size_classes=(4096, 65536))
    try:
        store.put("k", b"v" * 5000)
        assert store.get("k") == b"v" * 5000
        assert BlockStore.from_router(r) is store
        assert image.stat().st_size == 8 << 20
        hot = r.describe()["classes"]["hot"]
        assert hot["root"] == str(image) and any("[classes.hot]" in w for w in hot["why"])
        assert r.counters()["hot"]["bytes_written"] >= 5000
        with pytest.raises(errors.ConfigError, match="not the block path"):
            BlockStore.from_router(r, "dataset")
    finally:
        r.close()


def test_block_target_config_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="for path = 'block' only"):
        sfstore.open({"classes": {"dataset": {"path": "file", "target": {"kind": "image"}}}})
    with pytest.raises(errors.ConfigError, match="'kind' must be one of"):  # a static mistake: at open()
        sfstore.open({"classes": {"hot": {"target": {"kind": "disk"}}}})
    r = sfstore.open({"classes": {"hot": {"target": {"kind": "device", "device": str(tmp_path)}}}})
    with pytest.raises(errors.ConfigError, match="not a block device"):
        r.path("hot")


@pytest.mark.skipif(os.path.exists("/dev/nvme-fabrics"), reason="this host has NVMe over Fabrics")
def test_nvmeof_target_on_a_host_without_fabrics_falls_back_to_the_image_and_says_why(tmp_path: Path) -> None:
    from sfstore.paths.block import BlockPath

    target = {"kind": "nvmeof", "transport": "rdma", "traddr": "10.0.0.1", "trsvcid": "4420",
              "subsysnqn": "nqn.2026-01.io.x:hot"}
    with pytest.raises(errors.NotSupportedOnHostError, match="not supported on this host"):
        BlockPath(target)  # the path itself refuses
    r = sfstore.open({"classes": {"hot": {"target": target}}})
    try:
        p = r.path("hot")
        assert p.transport == "local" and p.device == str(tmp_path / "data" / "hot" / "blocks.img")
        hot = r.describe()["classes"]["hot"]
        assert any("configured block target unavailable" in f and "not supported on this host" in f
                   for f in hot["fallbacks"])
    finally:
        r.close()


def test_open_returns_one_router_for_a_config_with_settings(tmp_path: Path) -> None:
    # Router() applies [settings] to the process, which changes the key the next open() computes: it must still
    # find the same router (two would hold two block stores on one image and split the counters).
    (tmp_path / "sfstore.toml").write_text("[settings]\nqueue_depth = 40\nfile_chunk_size = 4194304\n")
    first = sfstore.open()
    assert sfstore.open() is first and sfstore.open() is first
    assert defaults.get("queue_depth") == 40
    hot = BlockStore.from_router(first)  # one block store per router: a second router would refuse the image
    assert BlockStore.from_router(sfstore.open()) is hot
    first.close()


# -- the SFSTORE_* variables, checked at open() -------------------------------------------------------------------


@pytest.mark.parametrize(("var", "value", "needle"), [("SFSTORE_QUEUE_DEPTH", "abc", "1 to 16384"),
                                                      ("SFSTORE_ENGINE", "iouring", "did you mean uring?"),
                                                      ("SFSTORE_KVCACHE_SHARED_BYTES", "2q", "2TiB")])
def test_a_bad_variable_fails_open_checkpoints_and_read_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str, needle: str
) -> None:
    """Not only get_engine(): the first thing a job does with sfstore raises, naming the variable."""
    import fsspec
    import numpy as np
    import torch

    from sfstore import checkpoint

    root = tmp_path / "root"
    root.mkdir()
    (root / "x.bin").write_bytes(b"x" * 4096)
    checkpoint.save({"w": torch.ones(4)}, str(tmp_path / "ck-good"))  # made while the variables are good
    monkeypatch.setenv("SFSTORE_ROOT", str(root))
    monkeypatch.setenv(var, value)
    calls = {
        "open": lambda: sfstore.open(),
        "checkpoint.save": lambda: checkpoint.save({"w": torch.ones(4)}, str(tmp_path / "ck")),
        "checkpoint.load": lambda: checkpoint.load(str(tmp_path / "ck-good")),
        "read_into": lambda: fsspec.filesystem("sf", skip_instance_cache=True).read_into(
            "x.bin", np.zeros(4096, np.uint8)),
    }
    for what, call in calls.items():
        with pytest.raises(errors.ConfigError) as info:
            call()
            pytest.fail(f"{what} ran with {var}={value!r}")
        assert var in str(info.value) and repr(value) in str(info.value) and needle in str(info.value), what
    assert not (tmp_path / "ck").exists()


def test_an_unknown_variable_is_warned_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    monkeypatch.setenv("SFSTORE_QUEUEDEPTH", "8")
    with pytest.warns(errors.ConfigWarning, match="SFSTORE_QUEUEDEPTH.*did you mean SFSTORE_QUEUE_DEPTH"):
        sfstore.open()
    assert issubclass(errors.ConfigWarning, errors.SfstoreWarning) and issubclass(errors.SfstoreWarning, UserWarning)
    monkeypatch.setenv("SFSTORE_ROOT", "")  # another configuration: a new router, the same variable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sfstore.open({})
    assert defaults.get("queue_depth") == 32  # and it is not taken for the setting


# -- roots -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["file", "env", "class", "mapping"])
def test_a_configured_root_that_does_not_exist_is_an_error_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    missing = tmp_path / "mnt" / "nfs-typo"
    cfg = tmp_path / "sfstore.toml"
    if how == "file":
        cfg.write_text(f'root = "{missing}"\n')
        origin = f"root in config file {cfg}"
    elif how == "env":
        monkeypatch.setenv("SFSTORE_ROOT", str(missing))
        origin = "SFSTORE_ROOT"
    elif how == "class":
        cfg.write_text(f'[classes.dataset]\nroot = "{missing}"\n')
        origin = f"[classes.dataset] root in config file {cfg}"
    else:
        origin = "root in config mapping"
    r = sfstore.open({"root": str(missing)}) if how == "mapping" else sfstore.open()
    with pytest.raises(errors.ConfigError) as info:
        r.path("dataset")
    text = str(info.value)
    assert str(missing) in text and "does not exist" in text and f"set by {origin}" in text, text
    assert not missing.exists() and not missing.parent.exists()  # nothing was made on the local disk
    assert "does not exist" in r.format()  # the table says so instead of raising


def test_only_the_embedded_default_data_dir_and_subdirs_are_created(tmp_path: Path) -> None:
    r = sfstore.open()
    assert r.file_path("checkpoint").root == str(tmp_path / "data" / "checkpoints")  # the default: made
    (tmp_path / "mnt").mkdir()
    r = sfstore.open({"root": str(tmp_path / "mnt"), "classes": {"checkpoint": {"subdir": "a/ckpt"}}})
    assert r.file_path("checkpoint").root == str(tmp_path / "mnt" / "a" / "ckpt")  # beneath a root that exists


@pytest.mark.parametrize("where", ["root", "classes"])
def test_a_root_with_a_nul_byte_is_a_config_error(tmp_path: Path, where: str) -> None:
    cfg = tmp_path / "sfstore.toml"
    key = "root" if where == "root" else "[classes.checkpoint]\nroot"
    cfg.write_text(f'{key} = "{tmp_path}/a\\u0000b"\n')
    with pytest.raises(errors.ConfigError, match="NUL byte") as info:
        sfstore.open(cfg)
    assert str(cfg) in str(info.value)


# -- a read-only root ------------------------------------------------------------------------------------------


@pytest.fixture
def ro_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A read-only tmpfs holding ``data/a.txt`` and the checkpoint ``checkpoints/step-1``, as SFSTORE_ROOT."""
    import torch

    from sfstore import checkpoint
    from tests.conftest import tmpfs_mount

    mnt = tmp_path / "ro"
    with tmpfs_mount(mnt) as read_only:
        (mnt / "data").mkdir()
        (mnt / "data" / "a.txt").write_text("hello")
        checkpoint.save({"w": torch.arange(4.0)}, str(mnt / "checkpoints" / "step-1"))
        read_only()
        monkeypatch.setenv("SFSTORE_ROOT", str(mnt))
        yield mnt


def test_a_read_only_root_serves_reads(ro_root: Path) -> None:
    import fsspec
    import torch

    from sfstore import checkpoint
    from sfstore.fs import SFFileSystem

    SFFileSystem.clear_instance_cache()
    r = sfstore.open()
    fs = fsspec.filesystem("sf")
    assert fs.cat("data/a.txt") == b"hello"
    assert fs.ls("data", detail=False) == ["data/a.txt"]
    assert torch.equal(checkpoint.load("step-1")["w"], torch.arange(4.0))
    text = r.format()  # describing does not try to write
    assert "read-only: it is on a read-only file system" in text and "[classes.checkpoint] root" in text
    d = r.describe()["classes"]
    assert d["kvcache"]["severity"] == "warning" and "cannot be created" in d["kvcache"]["error"]
    assert d["dataset"]["writable"] is False


def test_a_class_that_must_write_to_a_read_only_root_names_the_setting(ro_root: Path, tmp_path: Path) -> None:
    import torch

    from sfstore import checkpoint
    from sfstore.kvcache import KVCacheStore, KVGeometry

    with pytest.raises(errors.ReadOnlyRootError) as info:
        checkpoint.save({"w": torch.ones(2)}, "step-2")
    text = str(info.value)
    assert "read-only file system" in text and "[classes.checkpoint] root" in text and "SFSTORE_ROOT" in text
    assert isinstance(info.value, PermissionError) and isinstance(info.value, errors.ConfigError)
    geom = KVGeometry(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    with pytest.raises(errors.ReadOnlyRootError, match=r"\[classes\.kvcache\] root") as info:
        KVCacheStore.from_router(geom)
    assert "SFSTORE_ROOT" in str(info.value)
    # The setting it names does point the class elsewhere.
    (tmp_path / "ckpt").mkdir()
    cfg = tmp_path / "sfstore.toml"
    cfg.write_text(f'[classes.checkpoint]\nroot = "{tmp_path / "ckpt"}"\n')
    checkpoint.save({"w": torch.ones(2)}, "step-2")
    assert (tmp_path / "ckpt" / "step-2").is_dir()


def test_locations_are_one_path_each_made_again_for_a_new_directory_and_bounded(tmp_path: Path) -> None:
    """Absolute locations (checkpoint and DCP directories) get one path each; a directory removed and made again
    at the same name gets a new one (the old one's descriptor names the removed directory); a run that saves to a
    new directory every few steps does not keep a path (and its descriptor) for each."""
    import shutil

    from sfstore import router as router_mod

    r = sfstore.open()
    a = r.location(tmp_path / "a", create=True)
    assert r.location(str(tmp_path / "a"), create=True) is a
    shutil.rmtree(tmp_path / "a")
    (tmp_path / "a").mkdir()
    again = r.location(tmp_path / "a", create=True)
    assert again is not a
    again.write("x.bin", b"abc")
    assert (tmp_path / "a" / "x.bin").read_bytes() == b"abc"  # written where the name now points
    for i in range(router_mod._LOCATIONS_KEPT + 10):
        r.location(tmp_path / f"step-{i}", create=True)
    assert len(r.describe()["locations"]) <= router_mod._LOCATIONS_KEPT
    assert str(tmp_path / f"step-{router_mod._LOCATIONS_KEPT + 9}") in r.describe()["locations"]


def test_a_configs_settings_are_a_layer_under_code_and_variables_while_its_router_is_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = tmp_path / "sfstore.toml"
    cfg.write_text("[settings]\nqueue_depth = 48\nfile_parallelism = 3\n")
    r = sfstore.open(cfg)
    assert defaults.get("queue_depth") == 48 and defaults.source("queue_depth") == f"[settings] in config file {cfg}"
    assert sfstore.open(cfg) is r  # the file's settings do not change what the next open() looks for
    with defaults.set(queue_depth=8):  # code wins over the file
        assert defaults.get("queue_depth") == 8 and defaults.source("queue_depth") == "set"
    assert defaults.get("queue_depth") == 48
    monkeypatch.setenv("SFSTORE_FILE_PARALLELISM", "5")  # so does a variable
    assert defaults.get("file_parallelism") == 5 and defaults.source("file_parallelism") == "SFSTORE_FILE_PARALLELISM"
    r.close()  # the router's settings go with it
    assert defaults.get("queue_depth") == 32 and defaults.source("queue_depth") == "default"


def test_the_config_opened_last_holds_the_layer_and_closing_an_older_router_leaves_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("[settings]\nqueue_depth = 40\n")
    b.write_text("[settings]\nqueue_depth = 24\n")
    ra = sfstore.open(a)
    rb = sfstore.open(b)
    assert defaults.get("queue_depth") == 24
    ra.close()  # not the holder: b's settings stay
    assert defaults.get("queue_depth") == 24
    rb.close()
    assert defaults.get("queue_depth") == 32
