"""FIFOs, sockets and directories where a checkpoint has files: typed errors, never a hang.

A FIFO named ``sfstore-manifest.json`` blocked ``open()`` forever, and with it ``checkpoint.load`` of that
directory and ``list``/``latest`` of its parent. Guarded here with real FIFOs (and sockets and directories) in
place of the manifest, a shard and, for ``torch.distributed.checkpoint`` storage, the metadata file and a data
file: ``load`` raises :class:`~sfstore.errors.CorruptCheckpointError`, ``list``/``latest`` leave that entry out
(as they leave out every checkpoint whose manifest does not read) and still list the others. Each operation runs
in a thread joined with a timeout, so a regression fails instead of hanging the suite; a thread left blocked
in ``open()`` is released by opening the FIFO's other end.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from reliability_helpers import run_bounded

from sfstore import checkpoint, errors
from sfstore.checkpoint import MANIFEST_NAME

SHARD = "shard-00000.safetensors"
TIMEOUT = 10.0


def bounded(fn: Callable[[], Any], fifos: list[Path]) -> Any:
    """``fn()``'s result or exception; a test failure if it does not return within ``TIMEOUT`` seconds."""
    return run_bounded(fn, TIMEOUT, fifos)


def make_special(path: Path, kind: str) -> Iterator[None]:
    """Replace ``path`` by a FIFO, a listening Unix socket or a directory (a generator: the socket lives until
    it is closed)."""
    if path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        yield
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        cwd = os.getcwd()
        try:
            os.chdir(path.parent)  # a short name: Unix socket paths are limited to 108 bytes
            s.bind(path.name)
        finally:
            os.chdir(cwd)
        s.listen(1)
        try:
            yield
        finally:
            s.close()
    else:
        path.mkdir()
        yield


def save_two(parent: Path) -> None:
    checkpoint.save({"w": torch.arange(64, dtype=torch.float32), "step": 1}, parent / "a", metadata={"step": 1})
    checkpoint.save({"w": torch.arange(64, dtype=torch.float32), "step": 2}, parent / "b", metadata={"step": 2})


@pytest.mark.parametrize("kind", ["fifo", "socket", "dir"])
def test_a_special_file_as_the_manifest_is_refused_and_left_out_of_listings(tmp_path: Path, kind: str) -> None:
    save_two(tmp_path)
    manifest = tmp_path / "b" / MANIFEST_NAME
    special = make_special(manifest, kind)
    next(special)
    fifos = [manifest] if kind == "fifo" else []
    try:
        with pytest.raises(errors.CorruptCheckpointError, match="not a regular file") as info:
            bounded(lambda: checkpoint.load(tmp_path / "b"), fifos)
        assert MANIFEST_NAME in str(info.value)
        listed = bounded(lambda: checkpoint.list(tmp_path), fifos)
        assert [i.name for i in listed] == ["a"]
        newest = bounded(lambda: checkpoint.latest(tmp_path), fifos)
        assert newest is not None and newest.name == "a" and newest.step == 1
        assert bounded(lambda: checkpoint.load(newest), fifos)["step"] == 1
    finally:
        special.close()


@pytest.mark.parametrize("kind", ["fifo", "socket", "dir"])
@pytest.mark.parametrize("into", [False, True])
def test_a_special_file_as_a_shard_is_a_corrupt_checkpoint(tmp_path: Path, kind: str, into: bool) -> None:
    save_two(tmp_path)
    shard = tmp_path / "b" / SHARD
    special = make_special(shard, kind)
    next(special)
    target = {"w": torch.zeros(64), "step": 0} if into else None
    try:
        with pytest.raises(errors.CorruptCheckpointError, match="not a regular file") as info:
            bounded(lambda: checkpoint.load(tmp_path / "b", into=target), [shard] if kind == "fifo" else [])
        assert info.value.shard == SHARD
        assert [i.name for i in checkpoint.list(tmp_path)] == ["a", "b"]  # list reads manifests only
    finally:
        special.close()


def test_a_fifo_as_the_checkpoint_or_a_safetensors_file_is_refused(tmp_path: Path) -> None:
    for name in ("ck", "model.safetensors"):
        fifo = tmp_path / name
        os.mkfifo(fifo)
        with pytest.raises(errors.SfstoreError):
            bounded(lambda fifo=fifo: checkpoint.load(fifo), [fifo])  # type: ignore[misc]
        assert bounded(lambda: checkpoint.list(tmp_path), [fifo]) == []


@pytest.mark.parametrize("which", ["metadata", "data"])
def test_dcp_storage_with_a_fifo_for_its_metadata_or_a_data_file(tmp_path: Path, which: str) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.api import CheckpointException

    from sfstore.checkpoint.dcp import DATA_SUFFIX, METADATA_NAME, StorageReader, StorageWriter

    ck = tmp_path / "dcp"
    dcp.save({"x": torch.arange(1000, dtype=torch.float32)}, storage_writer=StorageWriter(str(ck)))
    if which == "metadata":
        victim = ck / METADATA_NAME
    else:
        (victim,) = (p for p in ck.iterdir() if p.name.endswith(DATA_SUFFIX))
    victim.unlink()
    os.mkfifo(victim)
    dest = {"x": torch.zeros(1000)}

    def load() -> None:
        dcp.load(dest, storage_reader=StorageReader(str(ck)))

    with pytest.raises((CheckpointException, errors.SfstoreError)) as info:  # type: ignore[arg-type]
        bounded(load, [victim])
    err: BaseException = info.value
    if isinstance(err, CheckpointException):  # it holds each rank's failure
        failures = getattr(err, "failures", {}) or {}
        inner = [e[0] if isinstance(e, tuple) else e for e in failures.values()]
        err = inner[0] if inner else err
    assert "is a FIFO, not a regular file" in str(err), repr(err)
    if which == "metadata":
        # DCP folds a failed metadata read into its own message; the reader itself raises the typed error.
        with pytest.raises(errors.CorruptCheckpointError, match="is a FIFO, not a regular file"):
            bounded(lambda: StorageReader(str(ck)).read_metadata(), [victim])
    else:
        assert isinstance(err, errors.CorruptCheckpointError), repr(err)
        assert err.shard == victim.name
