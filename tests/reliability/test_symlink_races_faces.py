"""Symlink races against the faces above the file path: checkpoints, DCP, the KV cache's shared tier, the demo.

Guards issue #14, defect 2, for the faces that build on :class:`~sfstore.paths.file.FilePath`:
:func:`sfstore.checkpoint.save` / ``save_async`` / ``load`` / ``load(into=)`` / ``list`` / ``latest``, the
``torch.distributed.checkpoint`` StorageWriter and StorageReader (single process, bare names under the
checkpoint root), :class:`~sfstore.kvcache.KVCacheStore` ``put`` / ``get_into`` / ``contains`` / ``evict`` on a
shared directory under a file path, :class:`~sfstore.paths.device.DevicePath` in host mode, and the demo's cold
cache drop of its dataset files. The swapper of ``test_symlink_races.py`` (``reliability_helpers``) exchanges
``<root>/top/d`` between a real directory and a symlink to a directory outside the root; every call names a
path through ``top/d``. The outside directory holds a decoy of everything inside (a checkpoint, a DCP checkpoint
and KV blocks under the same names, other values), so a read that escapes returns outside values and a write,
move or removal that escapes changes the outside tree. Every other call runs with ``openat2`` switched off (the
component walk). Per operation: 0 effects outside the root, nothing but :class:`~sfstore.errors.SfstoreError`
raised, and at least one success in each mode (refusing everything does not pass).

Each operation races for ``race_seconds`` (``SFSTORE_RELIABILITY_SECONDS``: 1 s in CI, 30 s in the flag run).
Run with ``-s`` for the per-operation figures (calls, escapes, refusals, swaps). A last test guards the
root descriptor of each FilePath those faces make per call: closed when it is dropped.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_helpers import Miss, RaceRoot, Tally, check_race, race, tree_signature

from sfstore import defaults
from sfstore.paths import beneath as beneath_mod
from sfstore.paths.file import FilePath

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from sfstore import checkpoint  # noqa: E402
from sfstore.checkpoint import dcp as sf_dcp  # noqa: E402
from sfstore.kvcache import KVCacheStore, KVGeometry  # noqa: E402

INSIDE, OUTSIDE = 1.0, 7.0  # the value of every tensor inside the root, and of every decoy outside it
GEOM = KVGeometry(num_layers=1, block_tokens=16, num_kv_heads=1, head_dim=64, dtype="bfloat16")  # 4 KiB blocks
KEY = bytes(range(32))  # a block inside and (other values) outside
KEY_OUT = bytes(range(1, 33))  # a block only outside
KEY_NEW = bytes(range(2, 34))  # a block nowhere (put writes it)


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64, 16), value), "b": torch.full((16,), value), "step": 3}


def block(value: float) -> Any:
    return torch.full(GEOM.block_shape, value, dtype=torch.bfloat16)


def _is_outside_value(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() > 0 and bool((t.float() == OUTSIDE).any())


def _fill(where: Path, value: float) -> None:
    """A checkpoint ``ck``, a DCP checkpoint ``dcp``, a KV shared directory ``kv`` and a dataset file in ``where``."""
    label = "inside" if value == INSIDE else "outside"
    checkpoint.save(state(value), str(where / "ck"), metadata={"where": label})
    dcp.save({"w": torch.full((64, 16), value)}, storage_writer=sf_dcp.StorageWriter(str(where / "dcp")),
             no_dist=True)
    kv = KVCacheStore(GEOM, pinned_bytes=0, shared_dir=str(where / "kv"))
    keys = [KEY] if value == INSIDE else [KEY, KEY_OUT]
    kv.put(keys, [block(value) for _ in keys])
    kv.close()
    (where / "ds").mkdir()
    (where / "ds" / "shard-00000.npy").write_bytes(b"INSIDE" if value == INSIDE else b"OUTSIDE")
    (where / "slab.bin").write_bytes(bytes([int(value)]) * 4096)


@dataclass
class Scene(RaceRoot):
    """A checkpoint root whose ``top/d`` is being swapped for a symlink to ``outside``."""

    inside_template: Path
    outside_template: Path
    fp: FilePath

    def build_top(self) -> None:
        """(Re)build ``top`` atomically: ``d`` (a copy of the inside template) and the links ``d-abs``, ``d-rel``."""
        new = self.new_top()
        new.mkdir()
        shutil.copytree(self.inside_template, new / "d", symlinks=True)
        self.replace_top(new)

    def restore_outside(self) -> None:
        shutil.rmtree(self.outside, ignore_errors=True)
        shutil.copytree(self.outside_template, self.outside, symlinks=True)
        self.baseline = tree_signature(self.outside)

    def outside_changed(self) -> bool:
        """Whether anything outside changed; if so, put it back (so the next change is seen too)."""
        if tree_signature(self.outside) == self.baseline:
            return False
        self.restore_outside()
        return True


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("templates")
    inside, outside = base / "inside", base / "outside"
    inside.mkdir()
    outside.mkdir()
    _fill(inside, INSIDE)
    _fill(outside, OUTSIDE)
    return inside, outside


@pytest.fixture
def scene(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, templates: tuple[Path, Path]) -> Iterator[Scene]:
    (tmp_path / "sfroot").mkdir(exist_ok=True)  # a configured root must exist
    monkeypatch.setenv("SFSTORE_ROOT", str(tmp_path / "sfroot"))
    monkeypatch.delenv("SFSTORE_CONFIG", raising=False)
    defaults.reset()
    import sfstore

    fp = sfstore.open().file_path("checkpoint")
    root = Path(fp.root)
    s = Scene(root, tmp_path / "outside", templates[0], templates[1], fp)
    s.restore_outside()
    s.build_top()
    yield s
    defaults.reset()


# -- the operations ---------------------------------------------------------------------------------------------


def _load(s: Scene) -> Any:
    return checkpoint.load("top/d/ck")


def _load_into(s: Scene) -> Any:
    into = state(0.0)
    checkpoint.load("top/d/ck", into=into)
    return into


def _save(s: Scene) -> Any:
    return checkpoint.save(state(INSIDE), "top/d/new", metadata={"where": "inside"})


def _save_over(s: Scene) -> Any:
    return checkpoint.save(state(INSIDE), "top/d/ck", overwrite=True, metadata={"where": "inside"})


def _save_async(s: Scene) -> Any:
    return checkpoint.save_async(state(INSIDE), "top/d/ck", overwrite=True, metadata={"where": "inside"}).get()


def _infos(found: Any) -> list[str]:
    items = found if isinstance(found, list) else [found] if found is not None else []
    return [str(i.metadata.get("where")) for i in items]


def _list(s: Scene) -> Any:
    return _infos(checkpoint.list("top/d"))


def _latest(s: Scene) -> Any:
    found = checkpoint.latest("top/d")
    if found is None:
        raise Miss
    return _infos(found)


def _dcp(call: Callable[[], Any], reader: Any = None) -> Any:
    """``call()`` (a DCP save or load), with the error the storage raised instead of torch's wrapping of it.

    torch raises a :class:`CheckpointException` (a ``BaseException``) carrying each rank's exception; a load
    whose metadata reads failed raises ``AssertionError("metadata is None; ...")`` with their messages, so the
    reader's metadata is read again here for the typed error (if it now succeeds, a swap came between: a miss).
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call()
    except CheckpointException as exc:
        inner = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        first = inner[0] if inner else exc
        if isinstance(first, AssertionError) and str(first).startswith("metadata is None") and reader is not None:
            reader.read_metadata()
            raise Miss from None
        if isinstance(first, BaseException):
            raise first from None
        raise


def _dcp_save(s: Scene) -> Any:
    writer = sf_dcp.StorageWriter("top/d/dcp", overwrite=True)
    _dcp(lambda: dcp.save({"w": torch.full((64, 16), INSIDE)}, storage_writer=writer, no_dist=True))


def _dcp_save_new(s: Scene) -> Any:
    writer = sf_dcp.StorageWriter("top/d/dcp2")
    _dcp(lambda: dcp.save({"w": torch.full((64, 16), INSIDE)}, storage_writer=writer, no_dist=True))


def _dcp_load(s: Scene) -> Any:
    sd = {"w": torch.zeros(64, 16)}
    reader = sf_dcp.StorageReader("top/d/dcp")
    _dcp(lambda: dcp.load(sd, storage_reader=reader, no_dist=True), reader)
    return sd


def _kv(s: Scene) -> KVCacheStore:
    # A new store per call: it opens (and, with openat2 off, resolves) its directory while the swap runs.
    return KVCacheStore(GEOM, pinned_bytes=0, shared_dir="top/d/kv", shared_on=s.fp)


def _kv_get(s: Scene) -> Any:
    with _kv(s) as kv:
        dst = [block(0.0), block(0.0)]
        got = kv.get_into([KEY, KEY_OUT], dst)
        if got[1] is not None:
            return [dst[1]]  # the block that is only outside: any hit is an escape
        if got[0] is None:
            raise Miss
        return dst


def _kv_contains(s: Scene) -> Any:
    with _kv(s) as kv:
        if kv.contains(KEY_OUT):
            return [torch.full((1,), OUTSIDE)]
        if not kv.contains(KEY):
            raise Miss
        return []


def _kv_put(s: Scene) -> Any:
    with _kv(s) as kv:
        kv.put([KEY_NEW], [block(INSIDE)])


def _kv_evict(s: Scene) -> Any:
    with _kv(s) as kv:
        if kv.evict([KEY], tiers=("shared",)) == 0:
            raise Miss


def _kv_evict_outside_only(s: Scene) -> Any:
    with _kv(s) as kv:
        kv.evict([KEY_OUT], tiers=("shared",))
        if not kv.contains(KEY):
            raise Miss


def _device_path(s: Scene) -> Any:
    from sfstore.paths.device import DevicePath

    return DevicePath(s.root, mode="staged")


def _device_read(s: Scene) -> Any:
    dp = _device_path(s)
    buf = np.zeros(4096, dtype=np.uint8)
    try:
        dp.read_into("top/d/slab.bin", buf)
    finally:
        dp.close()
    return [torch.from_numpy(buf.astype(np.float32))]


def _device_write(s: Scene) -> Any:
    dp = _device_path(s)
    try:
        dp.write("top/d/slab.bin", np.full(4096, int(INSIDE), dtype=np.uint8))
        dp.slab("top/d/new-slab.bin", 8192)
    finally:
        dp.close()


def _demo_drop(s: Scene) -> Any:
    from sfstore.demo import training

    names = ["top/d/ds/shard-00000.npy"]
    if not hasattr(training, "drop_cached"):  # before the fix: the loop make_dataset ran, by name
        for name in names:
            fd = os.open(s.fp.resolve(name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return None
    training.drop_cached(s.fp, names)


# name -> (operation, whether it changes the inside tree: rebuilt after each call)
OPERATIONS: dict[str, tuple[Callable[[Scene], Any], bool]] = {
    "checkpoint.save": (_save, True),
    "checkpoint.save(overwrite)": (_save_over, True),
    "checkpoint.save_async": (_save_async, True),
    "checkpoint.load": (_load, False),
    "checkpoint.load(into=)": (_load_into, False),
    "checkpoint.list": (_list, False),
    "checkpoint.latest": (_latest, False),
    "dcp.StorageWriter(overwrite)": (_dcp_save, True),
    "dcp.StorageWriter(new)": (_dcp_save_new, True),
    "dcp.StorageReader": (_dcp_load, False),
    "kvcache.get_into": (_kv_get, False),
    "kvcache.contains": (_kv_contains, False),
    "kvcache.put": (_kv_put, True),
    "kvcache.evict": (_kv_evict, True),
    "kvcache.evict(outside only)": (_kv_evict_outside_only, True),
    "DevicePath.read_into(host)": (_device_read, False),
    "DevicePath.write+slab(host)": (_device_write, True),
    "demo.drop_cached": (_demo_drop, False),
}


def _leaks(value: Any) -> bool:
    """Whether what an operation returned shows outside data (a tensor of the outside value, an outside label)."""
    if isinstance(value, torch.Tensor):
        return _is_outside_value(value)
    if isinstance(value, str):
        return value == "outside"
    if isinstance(value, dict):
        return any(_leaks(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_leaks(v) for v in value)
    return False


def _set_walk(scene: Scene, walked: bool, saved: dict[str, Any]) -> None:
    """Switch ``openat2`` off (``walked``) or back on, for every resolution a face makes."""
    beneath_mod._native_openat2 = (lambda: None) if walked else saved["native"]  # type: ignore[assignment]
    scene.fp.beneath._openat2 = None if walked else saved["fp"]
    beneath_mod._open_at = None if walked else saved["kv"]  # a KV tier's opens beneath its directory


def _race(scene: Scene, op: Callable[[Scene], Any], mutates: bool, seconds: float) -> Tally:
    saved = {"native": beneath_mod._native_openat2, "fp": scene.fp.beneath._openat2,
             "kv": beneath_mod._open_at}
    return race(scene, op, mutates, seconds, set_walk=lambda walked: _set_walk(scene, walked, saved), leaks=_leaks)


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_no_face_escapes_the_root_while_a_directory_is_swapped_for_a_symlink(
    scene: Scene, race_seconds: float, name: str
) -> None:
    op, mutates = OPERATIONS[name]
    tally = _race(scene, op, mutates, race_seconds)
    check_race(name, tally, race_seconds, scene)


def test_the_faces_work_without_a_race(scene: Scene) -> None:
    """Each operation, with ``d`` the real directory and nothing racing, succeeds and sees the inside data."""
    for name, (op, mutates) in OPERATIONS.items():
        value = op(scene)
        assert not _leaks(value), name
        if mutates:
            scene.build_top()
    assert tree_signature(scene.outside) == scene.baseline


def test_faces_that_make_a_file_path_per_call_leave_no_descriptor_open(scene: Scene) -> None:
    """Each DCP writer and reader (and each DevicePath) makes a FilePath; dropping it closes its root's
    descriptor, so a loop of saves and loads does not run out of descriptors (EMFILE after ~20,000 here)."""
    import gc

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    _dcp_save(scene)
    _dcp_load(scene)
    gc.collect()
    before = open_fds()
    for _ in range(50):
        _dcp_save(scene)
        assert not _leaks(_dcp_load(scene))
        _device_read(scene)
    gc.collect()
    assert open_fds() - before <= 5, f"{open_fds() - before} descriptors left open by 150 calls"
