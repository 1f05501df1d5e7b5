"""Commit marks for Hugging Face ``Trainer`` checkpoints: :class:`SfstoreTrainerCallback` and
:func:`last_committed_checkpoint`.

>>> from transformers import Trainer, TrainingArguments
>>> from sfstore.fs import local_path
>>> from sfstore.checkpoint.hf_trainer import SfstoreTrainerCallback, last_committed_checkpoint
>>> out = local_path("sf://runs/exp1")
>>> trainer = Trainer(model=model, args=TrainingArguments(output_dir=out, save_total_limit=2),
...                   train_dataset=data, callbacks=[SfstoreTrainerCallback()])   # doctest: +SKIP
>>> trainer.train(resume_from_checkpoint=last_committed_checkpoint(out))       # doctest: +SKIP

The ``Trainer`` writes ``checkpoint-N`` in place (no staging name, no rename, no ``fsync``), and its own
``resume_from_checkpoint=True`` (``transformers.trainer_utils.get_last_checkpoint``) takes the highest-numbered
folder whether its save finished or not: a run killed while saving resumes from a half-written checkpoint, or
fails to. The callback marks the checkpoints whose save finished: once the ``Trainer`` has written
``checkpoint-N`` it makes every file and directory of it durable (``fsync``) and then publishes a commit record,
:data:`COMMIT_NAME`, holding each file's size and xxh3-64. :func:`last_committed_checkpoint` is the newest
checkpoint with a record whose files match it, the one to resume from.

:func:`commit_checkpoint` and :func:`last_committed_checkpoint` need neither transformers nor torch (a resume
script can pick its checkpoint before importing them); :class:`SfstoreTrainerCallback` needs transformers and
torch (``pip install 'sfstore[hf]'``) and is imported from :mod:`sfstore.checkpoint.hf_trainer_callback` when
first asked for.

What sfstore reads: the commit record (JSON) and the checkpoint's bytes, to check them. It does not unpickle
anything: ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth`` and ``training_args.bin`` are the ``Trainer``'s
own ``torch.save`` files, which it (not sfstore) loads on resume.

Rotation (``save_total_limit``): the ``Trainer`` removes old checkpoints at the end of its save, before the
callback commits the new one, and always keeps the newest. With ``save_total_limit=1`` that removes the last
committed checkpoint while the new one is not yet committed, so a kill then leaves nothing to resume from; the
callback warns about it at the start of training. Keep ``save_total_limit >= 2`` (or none).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import xxhash

from sfstore import defaults, errors, records, temp_names
from sfstore.paths.file import fsync_dir

if TYPE_CHECKING:
    from sfstore.checkpoint.hf_trainer_callback import SfstoreTrainerCallback

__all__ = ["COMMIT_NAME", "SfstoreTrainerCallback", "commit_checkpoint", "last_committed_checkpoint"]

COMMIT_NAME = "sfstore-commit.json"
"""The commit record's file name, inside ``checkpoint-N``."""

_FORMAT = "sfstore.hf_trainer.commit"
_VERSION = 1
_COMMIT_KIND = "commit"  # the record's temporary name: temp_names.temp_name(COMMIT_NAME, "commit")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils' own pattern
_HEX16 = re.compile(r"^[0-9a-f]{16}$")

log = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    # The callback subclasses transformers' TrainerCallback, so it is imported (with transformers) only when
    # asked for: commit_checkpoint and last_committed_checkpoint work without transformers.
    if name == "SfstoreTrainerCallback":
        from sfstore.checkpoint.hf_trainer_callback import SfstoreTrainerCallback

        return SfstoreTrainerCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _os_error(exc: OSError, context: str, path: str) -> errors.SfstoreOSError:
    return errors.os_error(exc.errno or errno.EIO, context, path)


def _hash_file(path: str, buf: bytearray, *, sync: bool) -> tuple[int, str]:
    """Size and xxh3-64 (16 hex digits) of the regular file ``path``, read in pieces of ``buf``; ``sync``:
    ``fsync`` it too. Streaming xxh3-64 with seed 0 is the same function as :data:`sfstore.checksums.xxh3_64`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        h = xxhash.xxh3_64()
        view = memoryview(buf)
        size = 0
        while n := os.readv(fd, [view]):
            h.update(view[:n])
            size += n
        if sync:
            os.fsync(fd)
        return size, h.hexdigest()
    finally:
        os.close(fd)


def _temporary(name: str) -> bool:
    """Whether ``name`` is the commit record's temporary name."""
    tn = temp_names.parse(name)
    return tn is not None and tn.final == COMMIT_NAME and tn.kind == _COMMIT_KIND


def _ours(name: str) -> bool:
    return name == COMMIT_NAME or _temporary(name)


def _writer_gone(path: str, name: str) -> bool:
    """Whether the commit record's temporary ``name`` in ``path`` was left by a writer that is gone."""
    tn = temp_names.parse(name)
    return tn is not None and tn.final == COMMIT_NAME and tn.kind == _COMMIT_KIND and temp_names.is_leftover(
        tn, os.path.join(path, name))


def _remove_leftovers(path: str) -> None:
    """Remove the commit record's temporary files in ``path`` whose writers are gone (killed mid-commit):
    they are left out of the record, so nothing else would ever remove them."""
    with os.scandir(path) as it:
        names = [e.name for e in it if _temporary(e.name)]
    for name in names:
        try:
            if _writer_gone(path, name):
                os.unlink(os.path.join(path, name))
        except OSError:
            pass  # removed by another cleanup, or not removable: a leftover is left out of the record anyway


def _walk(top: str) -> Iterator[tuple[str, list[str]]]:
    """Each directory under ``top`` (``top`` included) with its file names (relative to ``top``,
    ``/``-separated), the commit record and its temporary names left out at the top. A symlink is an ``ELOOP``
    error: what it points to is not part of the folder, and could change without the folder changing."""
    for here, dirs, files in os.walk(top, onerror=_raise):
        for name in dirs + files:
            if os.path.islink(os.path.join(here, name)):
                raise OSError(errno.ELOOP, "a symbolic link in the checkpoint (only files and directories are "
                              "recorded)", os.path.join(here, name))
        dirs.sort()
        rel = os.path.relpath(here, top)
        if rel == ".":
            yield here, sorted(f for f in files if not _ours(f))
        else:
            yield here, sorted(f"{rel.replace(os.sep, '/')}/{f}" for f in files)


def _raise(exc: OSError) -> None:
    raise exc


def commit_checkpoint(directory: str | os.PathLike[str]) -> str:
    """Make the checkpoint ``directory`` durable and publish its commit record; return the record's path.

    Every file under ``directory`` is read (its size and xxh3-64 recorded) and ``fsync``-ed, then every
    directory, ``directory``'s own entry in its parent included (a symlink among them is refused); then the
    record is written under a temporary name, ``fsync``-ed, renamed to :data:`COMMIT_NAME` and the directory
    ``fsync``-ed again. A crash at any moment leaves either no record or a complete one over durable files.
    :class:`SfstoreTrainerCallback` calls this after each ``Trainer`` save; call it yourself after writing a
    checkpoint by other means (one ``checkpoint-N`` folder, all its writers finished).

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory, ``checkpoint-N`` (an ``sf://`` url names its host path, as
        :func:`sfstore.fs.local_path`).

    Returns
    -------
    str
        The commit record's host path.

    Raises
    ------
    sfstore.errors.InvalidRequestError
        ``directory`` is not a path, or its name is not ``checkpoint-N``.
    sfstore.errors.PathNotFoundError, sfstore.errors.NotADirectoryPathError
        It does not exist, or is not a directory.
    sfstore.errors.SfstoreOSError
        Reading, syncing or writing failed (the ``errno``'s class: ``NoSpaceError``, ``AccessDeniedError``,
        ...); no record is published then.
    """
    path = _host_path(directory, "commit_checkpoint: directory")
    m = _CHECKPOINT.match(os.path.basename(path))
    if m is None:
        raise errors.InvalidRequestError(
            f"commit_checkpoint: {path!r} is not a Trainer checkpoint folder (named checkpoint-<step>)")
    _require_dir(path, "commit_checkpoint")
    buf = bytearray(defaults.get("checkpoint_buffer_size"))
    files: dict[str, dict[str, Any]] = {}
    try:
        _remove_leftovers(path)
        for here, names in _walk(path):
            for rel in names:
                size, digest = _hash_file(os.path.join(path, rel), buf, sync=True)
                files[rel] = {"size": size, "xxh3_64": digest}
            fsync_dir(here)
        fsync_dir(os.path.dirname(path))  # the checkpoint-N entry itself (the Trainer made it, unsynced)
    except OSError as exc:
        raise _os_error(exc, "commit_checkpoint: cannot read and sync the checkpoint",
                        exc.filename or path) from None
    record = {"format": _FORMAT, "version": _VERSION, "checkpoint": os.path.basename(path),
              "step": int(m.group(1)), "checksum": "xxh3-64", "files": files}
    body = json.dumps(record, indent=1, sort_keys=True).encode() + b"\n"
    final = os.path.join(path, COMMIT_NAME)
    try:
        dirfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            records.write_atomically(dirfd, COMMIT_NAME, body, kind=_COMMIT_KIND, fsync=True)
        finally:
            os.close(dirfd)
    except OSError as exc:
        raise _os_error(exc, "commit_checkpoint: cannot publish the commit record", final) from None
    return final


def _host_path(path: object, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise errors.InvalidRequestError(f"{what} must be a path or sf:// url, not {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise errors.InvalidRequestError(f"{what} must be a text path, not {type(text).__name__}")
    if text.startswith("sf://"):
        from sfstore.fs import local_path  # only for sf:// urls: host paths need no fsspec

        return local_path(text)
    if "://" in text:
        raise errors.InvalidRequestError(f"{what} must be a host path or an sf:// url, not {text!r}")
    return os.path.abspath(text)


def _require_dir(path: str, what: str) -> None:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _os_error(exc, f"{what}: cannot open the directory", path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise errors.os_error(errno.ENOTDIR, f"{what}: not a directory", path)


def _problem(directory: str, step: int, buf: bytearray | None) -> str | None:
    """Why the checkpoint ``directory`` (of ``step``) is not committed, or ``None`` when it is; its files are
    hashed (into ``buf``) unless ``buf`` is ``None``, then only their sizes are compared."""
    record_path = os.path.join(directory, COMMIT_NAME)
    try:
        with open(record_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return "no commit record (its save did not finish)"
    except OSError as exc:
        return f"cannot read its commit record: {exc.strerror or exc}"
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return "its commit record is not valid JSON"
    if not isinstance(record, dict) or record.get("format") != _FORMAT or record.get("version") != _VERSION:
        return "its commit record is not a version-1 sfstore commit record"
    files = record.get("files")
    if record.get("step") != step or not isinstance(files, dict) or not files:
        return "its commit record names another step or no files"
    for rel, entry in sorted(files.items()):
        parts = rel.split("/") if isinstance(rel, str) else [""]
        if any(p in ("", ".", "..") for p in parts) or (len(parts) == 1 and _ours(rel)):
            return f"its commit record names an invalid file {rel!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) \
                or not isinstance(entry.get("xxh3_64"), str) or not _HEX16.match(entry["xxh3_64"]):
            return f"its commit record's entry for {rel} is malformed"
        full = os.path.join(directory, *parts)
        try:
            if buf is None:
                st = os.stat(full, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    return f"{rel} is not a regular file"
                size, digest = st.st_size, entry["xxh3_64"]
            else:
                size, digest = _hash_file(full, buf, sync=False)
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as exc:
            return f"cannot read {rel}: {exc.strerror or exc}"
        if size != entry["size"]:
            return f"{rel} has {size} bytes, its commit record {entry['size']}"
        if digest != entry["xxh3_64"]:
            return f"{rel}'s xxh3-64 is {digest}, its commit record {entry['xxh3_64']}"
    return None


def last_committed_checkpoint(output_dir: str | os.PathLike[str], *, verify: bool = True) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` whose save was committed: what to resume from.

    Checkpoints are tried from the highest step down; one without a commit record (its save was cut short, or
    it was not written with :class:`SfstoreTrainerCallback`), with a damaged record, or whose files do not
    match its record is skipped, and the reason logged (``logging`` warning, logger
    ``sfstore.checkpoint.hf_trainer``). Files in the folder that the record does not name are not checked.

    Parameters
    ----------
    output_dir : str or os.PathLike
        The ``Trainer``'s ``output_dir``: a host path, or an ``sf://`` url (its host path, as
        :func:`sfstore.fs.local_path` gives).
    verify : bool, default True
        Read every file the record names and compare its xxh3-64 as well as its size. ``False`` compares
        sizes only (a ``stat`` per file): it catches missing and truncated files, not changed bytes.

    Returns
    -------
    str or None
        The host path of the checkpoint folder (``<output_dir>/checkpoint-N``), to pass as
        ``trainer.train(resume_from_checkpoint=...)``; ``None`` when none is committed or ``output_dir``
        does not exist yet (``resume_from_checkpoint=None`` starts from scratch).

    Raises
    ------
    sfstore.errors.InvalidRequestError
        ``output_dir`` is not a path or ``sf://`` url, or ``verify`` is not a bool.
    sfstore.errors.NotADirectoryPathError
        ``output_dir`` is not a directory.
    sfstore.errors.SfstoreOSError
        ``output_dir`` cannot be listed (``AccessDeniedError``, ...).
    """
    if not isinstance(verify, bool):
        raise errors.InvalidRequestError(f"last_committed_checkpoint: verify must be a bool, not {verify!r}")
    root = _host_path(output_dir, "last_committed_checkpoint: output_dir")
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        log.info("sfstore: %s does not exist yet: no checkpoint to resume from", root)
        return None
    except OSError as exc:
        raise _os_error(exc, "last_committed_checkpoint: cannot list the output directory", root) from None
    steps = sorted(((int(m.group(1)), n) for n in names if (m := _CHECKPOINT.match(n))), reverse=True)
    buf = bytearray(defaults.get("checkpoint_buffer_size")) if verify and steps else None
    for step, name in steps:
        directory = os.path.join(root, name)
        if not os.path.isdir(directory):
            continue
        why = _problem(directory, step, buf)
        if why is None:
            return directory
        log.warning("sfstore: skipping %s: %s", directory, why)
    return None
