"""What checkpoints there are: :class:`CheckpointInfo`, reading manifests, ``list`` and ``latest``."""

from __future__ import annotations

import builtins
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

from sfstore import errors
from sfstore.checkpoint import location
from sfstore.checkpoint.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from sfstore.paths.file import FilePath

__all__ = ["CheckpointInfo", "info_for", "read_manifest", "list_checkpoints", "latest", "step_in_name"]

# A training step in a checkpoint's name, as the trainers name them: step-200, step_200, step=200 (Lightning's
# epoch=1-step=200.ckpt), global_step200 (DeepSpeed), checkpoint-200 (Hugging Face Trainer), ckpt-200 and
# iter_0000200 (Megatron). A "step" word wins over the others; the keyword must start the name or follow a
# non-letter, and the number must end it or be followed by a non-digit.
_STEP_WORD = re.compile(r"(?<![a-z])(?:global[-_]?)?step[-_=]?(\d+)(?!\d)", re.IGNORECASE)
_OTHER_WORDS = re.compile(r"(?<![a-z])(?:checkpoint|ckpt|iteration|iter)[-_=]?(\d+)(?!\d)", re.IGNORECASE)


def step_in_name(name: str) -> int | None:
    """The training step a checkpoint's name carries, or ``None``.

    ``step-200``, ``step_200``, ``step200``, ``epoch=1-step=200`` (Lightning), ``global_step200`` (DeepSpeed),
    ``checkpoint-200`` (Hugging Face ``Trainer``), ``ckpt-200``, ``iter_0000200`` (Megatron) all carry 200;
    ``weights``, ``best``, ``epoch=3`` and ``model-v2`` carry none.
    """
    found = _STEP_WORD.search(name) or _OTHER_WORDS.search(name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    Attributes
    ----------
    url : str
        What :func:`sfstore.checkpoint.load` takes (``load(info)`` works too).
    path : str
        The checkpoint directory (absolute).
    name : str
        The directory's name.
    created_ns : int
        When it was committed (``time.time_ns()``, from the manifest); ``created`` is the same in seconds.
    step : int or None
        The training step: ``metadata["step"]`` when that is an integer, else the step the name carries
        (``step-200``, ``epoch=1-step=200``, ``global_step200``, ``checkpoint-200``: see :func:`step_in_name`),
        else ``None`` (``weights``, ``best``).
    metadata : dict
        The ``metadata`` given to ``save``.
    num_tensors, tensor_bytes, num_shards : int
        Tensors, their bytes, and shard files.
    """

    url: str
    path: str
    name: str
    created_ns: int
    step: int | None
    metadata: dict[str, Any] = field(hash=False)
    num_tensors: int = 0
    tensor_bytes: int = 0
    num_shards: int = 0

    @property
    def created(self) -> float:
        """Commit time in seconds since the epoch."""
        return self.created_ns / 1e9

    def __fspath__(self) -> str:
        return self.path


def info_for(url: str, path: str, name: str, manifest: Manifest) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of a checkpoint whose manifest is ``manifest``."""
    step = manifest.metadata.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        step = step_in_name(name)
    return CheckpointInfo(
        url=url,
        path=path,
        name=name,
        created_ns=manifest.created_ns,
        step=step,
        metadata=manifest.metadata,
        num_tensors=len(manifest.tensors),
        tensor_bytes=manifest.tensor_bytes,
        num_shards=len(manifest.shards),
    )


def read_manifest(fp: FilePath, directory: str) -> Manifest:
    """Read and validate the manifest of the checkpoint directory ``directory`` (absolute, inside ``fp``).

    Raises :class:`~sfstore.errors.PathNotFoundError` when there is no such directory or it holds no manifest
    (not a checkpoint), :class:`~sfstore.errors.CorruptCheckpointError` when the manifest is invalid, fails its
    own sum, or is not a regular file (a FIFO there is refused without blocking).
    """
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        raw = location.read_regular(fp, path, limit=MAX_MANIFEST_BYTES, what="manifest")
    except errors.PathNotFoundError:
        try:
            is_dir = stat.S_ISDIR(fp.stat(directory).st_mode)
        except errors.SfstoreError:
            is_dir = False
        if not is_dir:
            raise errors.os_error(2, "no checkpoint directory", directory) from None
        raise errors.os_error(2, f"not an sfstore checkpoint: {MANIFEST_NAME} is missing", path) from None
    return Manifest.from_json(raw)


def list_checkpoints(prefix: str | os.PathLike[str] = "") -> builtins.list[CheckpointInfo]:
    """The committed checkpoints directly inside ``prefix``, oldest first; see :func:`sfstore.checkpoint.list`."""
    try:
        kind, fp, directory = location.locate_dir(prefix)
    except errors.PathNotFoundError:
        return []
    try:
        dirfd = location.open_dir(fp, fp.relative(directory), directory)  # beneath the root: a swapped name fails
    except (errors.PathNotFoundError, errors.NotADirectoryPathError):
        return []
    try:
        location.cleanup(dirfd, remove=False, fp=fp, full=directory)  # finish interrupted replaces
        with os.scandir(dirfd) as it:
            names = sorted(e.name for e in it)
    finally:
        os.close(dirfd)
    out: builtins.list[CheckpointInfo] = []
    for name in names:
        if name.startswith("."):
            continue
        path = os.path.join(directory, name)
        try:
            # Names are read beneath the root again: a directory swapped meanwhile is refused, not followed out.
            manifest = read_manifest(fp, path)
        except (errors.SfstoreError, OSError):
            continue  # not a checkpoint (or one being removed): not listed
        out.append(info_for(location.url_of(kind, fp, path), path, name, manifest))
    out.sort(key=lambda i: (i.created_ns, i.name))
    return out


def latest(prefix: str | os.PathLike[str] = "") -> CheckpointInfo | None:
    """The checkpoint to resume from inside ``prefix``, or ``None``; see :func:`sfstore.checkpoint.latest`."""
    found = list_checkpoints(prefix)
    stepped = [info for info in found if info.step is not None]
    pool = stepped or found
    return pool[-1] if pool else None
