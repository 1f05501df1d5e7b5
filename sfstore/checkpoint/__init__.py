"""Checkpoints: parallel, atomic, checksummed, pickle-free saves and loads of nested state dicts.

>>> from sfstore import checkpoint
>>> info = checkpoint.save({"model": model.state_dict(), "step": 100}, "run1/step-100",
...                        metadata={"step": 100})                       # doctest: +SKIP
>>> if (last := checkpoint.latest("run1")) is not None:                    # doctest: +SKIP
...     state = checkpoint.load(last)                                        # resume; None on a first run

A checkpoint is a directory: shard files in the safetensors format (``safetensors.torch.load_file`` reads each
one) and a JSON manifest, ``sfstore-manifest.json`` (which tensor lives in which shard, dtype, shape, xxh3-64
checksums per tensor, per shard and per shard header, the state dict's nesting and non-tensor values, the
caller's metadata), which carries an xxh3-64 of its own over all of that (``manifest_xxh3_64``, format version
3), checked before anything in it is used. Nothing is pickled, nothing is unpickled.

Hugging Face, both ways (:mod:`sfstore.checkpoint.hf`): a flat state dict (``str`` keys, torch tensors:
``model.state_dict()``) is saved with Hugging Face's shard names (``model.safetensors``, or
``model-00001-of-00003.safetensors`` ... with ``model.safetensors.index.json``), so that
``transformers``' ``from_pretrained`` reads the directory once its ``config.json`` is there; other state dicts
keep ``shard-00000.safetensors`` ... . ``load`` reads a directory ``save_pretrained`` wrote (no manifest: the
index and the shards' headers say what is in it), and any ``.safetensors`` file, ``into=`` a model too.

Urls: ``"sf://a/b"`` is ``<root>/a/b``, the directory ``fsspec.filesystem("sf")`` (and ``sfstore ls``) calls
``sf://a/b`` (the ``sf://`` root, ``sfstore.open().file_path("dataset")``); a bare name ``"a/b"`` is the
directory ``a/b`` under the checkpoint root (``sfstore.open().file_path("checkpoint")``: ``<root>/checkpoints``
unless configured); ``"/x/y/name"`` or ``"file:///x/y/name"`` is that directory. ``list``/``latest`` take a
directory holding checkpoints, in the same forms (``""``: the checkpoint root), and name what they find in the
form they were given (``list("sf://runs")`` -> ``sf://runs/a``, ``list("runs")`` -> ``runs/a``).

Speed and memory: shards are written and read through the file path (:meth:`FilePath.submit
<sfstore.paths.file.FilePath.submit>`, counted under the ``checkpoint`` data class) with O_DIRECT from
page-aligned registered buffers, many requests in flight (the path's ``chunk_size``/``parallelism``, from the mount).
``save`` streams through ``checkpoint_buffers`` x ``checkpoint_buffer_size`` bytes of buffers (192 MiB by
default) whatever the shard size; ``save_async`` holds a copy of the state dict's tensor bytes; both keep these
registered buffers for their next save (``checkpoint_reuse_buffers``, on by default: pinning memory again costs
more than filling it). ``load`` returns views of buffers the size of the shards (about 1x the tensor bytes, no
second copy); once all of a buffer's tensors are gone it is kept for the next load in the same way (as many of
each size as the most recent load took). :func:`buffer_stats` shows what is kept, :func:`free_buffers` gives
it back to the system.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sfstore.checkpoint import hf, safetensors_format
from sfstore.checkpoint.catalog import CheckpointInfo
from sfstore.checkpoint.catalog import latest as _latest
from sfstore.checkpoint.catalog import list_checkpoints as _list
from sfstore.checkpoint.host_buffers import load_buffers as _load_buffers
from sfstore.checkpoint.load import load as _load
from sfstore.checkpoint.manifest import MANIFEST_NAME
from sfstore.checkpoint.save import SaveFuture, async_buffers, ring_buffers
from sfstore.checkpoint.save import prepare_async as _prepare_async
from sfstore.checkpoint.save import save as _save
from sfstore.checkpoint.save import save_async as _save_async

if TYPE_CHECKING:
    import torch

Url = str | os.PathLike[str] | CheckpointInfo

__all__ = [
    "save",
    "save_async",
    "prepare_async",
    "load",
    "list",
    "latest",
    "buffer_stats",
    "free_buffers",
    "CheckpointInfo",
    "SaveFuture",
    "MANIFEST_NAME",
    "safetensors_format",
    "hf",
]


def save(
    state_dict: Any,
    url: Url,
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Save ``state_dict`` as a checkpoint at ``url``, atomically.

    Parameters
    ----------
    state_dict : object
        Nested dicts (any keys that are None, bool, int, float, str, bytes or tuples of these), lists and
        tuples of torch tensors (any dtype, any device, contiguous or not), numpy arrays and scalars,
        None, bool, int, float, str, bytes, ``torch.dtype`` and ``torch.Size``. Everything round-trips
        exactly (tuples stay tuples, ints stay ints, nan/inf/-0.0 stay as they are, ``OrderedDict`` stays
        one). The same tensor object reached twice is stored once and loads as one tensor; distinct tensors
        sharing memory are stored separately. Containers nest at most 64 deep
        (:data:`~sfstore.checkpoint.manifest.MAX_DEPTH`; a dict's tuple key is one level inside its dict).
    url : str, os.PathLike or CheckpointInfo
        The checkpoint directory (see the module docs). A flat state dict (``str`` keys, torch tensors) gets
        Hugging Face's file names and index beside the manifest (:func:`~sfstore.checkpoint.hf.hf_layout`).
    max_shard_bytes : int, optional
        Most tensor bytes per shard (default: the ``checkpoint_shard_bytes`` setting, 1 GiB). A larger tensor
        gets a shard of its own.
    overwrite : bool
        Replace an existing checkpoint at ``url`` (atomically: readers see the old one or the new one).
        ``False`` raises :class:`~sfstore.errors.PathExistsError` when it exists. A directory that is not an
        sfstore checkpoint is never replaced.
    metadata : mapping, optional
        Plain JSON stored in the manifest: None, bool, int, float (no nan/inf), str, lists and dicts with str
        keys, nested at most 64 deep; anything JSON would not give back as given (int keys, tuples) is refused.
        ``metadata["step"]`` (an int) shows up as :attr:`CheckpointInfo.step`.

    Returns
    -------
    CheckpointInfo
        The committed checkpoint.

    Notes
    -----
    Crash safety: everything is written into ``.<name>.sfstore-staging-<host>-<pid>-<rand>`` next to the
    checkpoint; every shard, then the manifest, then the staging directory are fsynced; the directory is
    renamed into place (``renameat2`` NOREPLACE, or EXCHANGE when overwriting; a two-step fallback where the
    filesystem refuses renameat2 flags, e.g. NFS) and the parent fsynced. A crash at any moment leaves the
    previous checkpoint loadable and nothing half-written under the final name; the next save in the same
    directory removes what dead savers left.

    Memory and speed: the shards stream through ``checkpoint_buffers`` x ``checkpoint_buffer_size`` bytes
    (192 MiB) of registered buffers, kept for the next save (``checkpoint_reuse_buffers``). GPU tensors are
    copied to the host through them; strided tensors are made contiguous one at a time (a temporary of that
    tensor's size). Tensor bytes are copied once and checksummed while still in cache; shard files are sized
    first and written with O_DIRECT in parallel chunks while the next buffer is filled.

    Raises
    ------
    sfstore.errors.InvalidRequestError
        Something in ``state_dict`` cannot be saved without pickling or nests too deeply (the message names
        its key path), a quantized, sparse or meta tensor, or metadata that is not plain JSON. Raised before
        anything is written (by :func:`save_async` too, not through its future).
    sfstore.errors.PathExistsError
        ``overwrite=False`` and the checkpoint exists.
    sfstore.errors.SfstoreOSError
        I/O errors (:class:`~sfstore.errors.NoSpaceError`, ...); nothing is published then.
    """
    return _save(state_dict, url, max_shard_bytes=max_shard_bytes, overwrite=overwrite, metadata=metadata)


def save_async(
    state_dict: Any,
    url: Url,
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> SaveFuture:
    """Copy ``state_dict``'s tensors to host buffers, return at once, and save in the background.

    Same arguments as :func:`save`. When it returns, every tensor's bytes have been copied (training may
    change the tensors right away); non-tensor values are captured as well. The copy runs on
    ``checkpoint_copy_threads`` threads into registered (pinned) buffers laid out as the shard files; a
    background thread then checksums and writes them and commits exactly as :func:`save` does.

    Returns
    -------
    SaveFuture
        ``get(timeout=None)`` returns the :class:`CheckpointInfo` or raises the save's error;
        ``done()``; ``wait(timeout=None)``.

    Notes
    -----
    Memory: a copy of the state dict's tensor bytes (rounded up per shard to 2 MiB). With
    ``checkpoint_reuse_buffers`` (default) it is kept after the save for the next ``save_async`` (which then
    only copies: no allocation, no page faults, no pinning), else freed when the save ends. The background
    thread is not a daemon: the interpreter waits for it at exit. Saves run concurrently if started so; each
    commits atomically on its own.
    """
    return _save_async(state_dict, url, max_shard_bytes=max_shard_bytes, overwrite=overwrite, metadata=metadata)


def prepare_async(state_dict: Any, *, max_shard_bytes: int | None = None) -> int:
    """Allocate and pin ahead the host buffers :func:`save_async` copies ``state_dict`` into.

    The first ``save_async`` of a process allocates a copy of the tensor bytes (``mmap``, faulting in, ``mlock``,
    CUDA registration) while the caller waits: on a VM whose host takes freed memory back this took seconds per
    GiB. Call this once at start-up (with the state dict, or one of the same tensor sizes, and the same
    ``max_shard_bytes``) and that first ``save_async`` only copies. Nothing is saved.

    Returns
    -------
    int
        Bytes of buffers now kept for the next ``save_async`` (:func:`buffer_stats`: ``save_async_idle_bytes``);
        0 with ``checkpoint_reuse_buffers`` off, as nothing would be kept.
    """
    return _prepare_async(state_dict, max_shard_bytes)


def load(url: Url, *, device: str | torch.device = "cpu", into: Any = None, verify: bool = True) -> Any:
    """Load the checkpoint at ``url`` (or a Hugging Face model directory, or a plain ``.safetensors`` file).

    Parameters
    ----------
    url : str, os.PathLike or CheckpointInfo
        A checkpoint directory (see the module docs), a :class:`CheckpointInfo` (from :func:`latest`), a
        directory ``save_pretrained`` wrote (no manifest: ``model.safetensors``, else
        ``model.safetensors.index.json`` and the shards it lists; ``{name: tensor}`` in the index's order), or
        the path of a ``.safetensors`` file (any writer's; ``{name: tensor}`` as ``safetensors.torch.load_file``
        gives). The last two have no checksums to check; their files are read as a checkpoint's shards are
        (links followed only where they stay beneath the root). A Hugging Face hub cache snapshot
        ``<repo>/snapshots/<rev>`` given as a host path resolves beneath ``<repo>``: its links into
        ``<repo>/blobs`` are followed.
    device : str or torch.device
        ``"cpu"``: tensors are views of the buffers the shards were read into (no copy). ``"cuda..."``:
        each shard is copied to the GPU from its pinned buffer, which is then dropped. numpy arrays always
        come back as numpy arrays on the host.
    into : state dict or torch.nn.Module, optional
        Fill these tensors in place instead of allocating: each tensor's bytes are read straight into the
        existing tensor (at the same key path; a module's ``state_dict()``). Every checkpoint tensor needs a
        destination of the same dtype and shape and every destination a checkpoint tensor, else
        :class:`~sfstore.errors.InvalidRequestError` naming the key. The returned structure holds these
        tensors (and the checkpoint's non-tensor values; ``into``'s own are not changed). On an error the
        destinations' contents are unspecified. A ``.safetensors`` file fills the tensors it holds (by name;
        every one needs a destination) and leaves the others as they are: it may be one shard of a model. A
        Hugging Face directory must fill every destination but the tied ones (the memory of a filled one, as
        ``save_pretrained`` stores tied weights once).
    verify : bool
        Check the xxh3-64 of every tensor and shard (one pass over the bytes, as they are read).

    Returns
    -------
    object
        The state dict as saved.

    Raises
    ------
    sfstore.errors.PathNotFoundError
        No such directory, or neither a manifest nor Hugging Face's files in it (not a checkpoint); ``url`` is
        ``None`` (what :func:`latest` returns where nothing was saved yet: guard a resume with
        ``if (info := latest(prefix)) is not None``).
    sfstore.errors.UnsupportedFormatError
        ``url`` is a pickle (a ``torch.save`` file, legacy or zip; any pickle of protocol 2 to 5) or a NumPy
        ``.npy``/``.npz`` file: never unpickled; the message says how to convert it. (A directory whose weights
        are only ``pytorch_model.bin`` is the ``PathNotFoundError`` above, whose message says the same.)
    sfstore.errors.PathEscapeError
        A link leading outside the root (for a hub snapshot, outside its repository folder).
    sfstore.errors.InvalidRequestError
        ``url`` is a JSON file (``model.safetensors.index.json``, the manifest): the message says to pass its
        directory; ``into=`` destinations that do not match (naming the key).
    sfstore.errors.CorruptCheckpointError
        A checksum mismatch (naming the shard and tensor), a manifest whose bytes fail its own checksum, a
        missing or truncated shard, a manifest that does not match its shards or is malformed or nested too
        deeply, a safetensors header that is oversized, lies about sizes, has a shape torch cannot hold or
        offsets out of bounds or overlapping, a manifest path that escapes the checkpoint directory, a FIFO,
        socket, device or directory where the manifest or a shard should be (refused without blocking); a
        Hugging Face index that is not JSON, names a shard outside the directory or a missing one, or a tensor
        its shard does not hold.
        Nothing is read out of bounds and nothing is unpickled, whatever the files hold.
    """
    return _load(url, device=device, into=into, verify=verify)


def list(prefix: str | os.PathLike[str] = "") -> builtins.list[CheckpointInfo]:
    """The committed checkpoints directly inside the directory ``prefix``, oldest commit first.

    ``prefix`` takes the url forms of :func:`save` (``""``: the checkpoint root). Directories without a valid
    manifest (staging directories, a manifest that fails its checksum or is not a regular file, anything else)
    are not listed. An interrupted replace (the two-step
    fallback) is finished by bringing the previous checkpoint back. A missing ``prefix`` lists nothing.

    Returns
    -------
    list of CheckpointInfo
    """
    return _list(prefix)


def latest(prefix: str | os.PathLike[str] = "") -> CheckpointInfo | None:
    """The checkpoint in ``prefix`` to resume training from, or ``None`` when there is none yet.

    The rule: of the committed checkpoints that carry a training step (:attr:`CheckpointInfo.step`:
    ``metadata["step"]``, else a step in the name such as ``step-200``, ``step_200``, ``epoch=1-step=200``
    (Lightning), ``global_step200``, ``checkpoint-200``), the most recently committed one. A checkpoint that
    carries no step (``weights``, ``best``, an export of the model alone) is never preferred to one that does,
    whenever it was saved; only where no checkpoint in ``prefix`` carries a step is the most recently committed
    of all returned. Commit time (not the highest step) decides among stepped ones, so a run restarted from an
    earlier step, or rerun over the same names, resumes from what it saved last.

    On a first run there is nothing to resume from: guard the load (``load(None)`` raises
    :class:`~sfstore.errors.PathNotFoundError`).

    >>> if (info := checkpoint.latest("run1")) is not None:   # doctest: +SKIP
    ...     state = checkpoint.load(info)

    Returns
    -------
    CheckpointInfo or None
    """
    return _latest(prefix)


def buffer_stats() -> dict[str, int]:
    """Bytes of registered host buffers this process keeps for its next checkpoint saves and loads
    (``checkpoint_reuse_buffers``).

    Returns
    -------
    dict
        ``save_idle_bytes`` (``save``'s ring), ``save_async_idle_bytes`` (``save_async``'s copy of the tensor
        bytes), ``load_idle_bytes`` (loads' shard buffers whose tensors are all gone), ``load_in_use_bytes``
        (shard buffers still holding loaded tensors) and ``idle_bytes``, the sum of the three idle kinds: memory
        that is resident (and locked where ``mlock`` allows) but holds nothing the caller uses.
    """
    load = _load_buffers.stats()
    out = {
        "save_idle_bytes": ring_buffers.idle_bytes(),
        "save_async_idle_bytes": async_buffers.idle_bytes(),
        "load_idle_bytes": load["idle_bytes"],
        "load_in_use_bytes": load["in_use_bytes"],
    }
    out["idle_bytes"] = out["save_idle_bytes"] + out["save_async_idle_bytes"] + out["load_idle_bytes"]
    return out


def free_buffers() -> int:
    """Give every idle kept buffer (:func:`buffer_stats`) back to the system now; returns the bytes freed.

    Buffers still holding loaded tensors are freed when those tensors die. The next save or load allocates (and
    pins) afresh, as its first one did.
    """
    return ring_buffers.free() + async_buffers.free() + _load_buffers.free()
