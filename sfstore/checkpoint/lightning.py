"""PyTorch Lightning's ``CheckpointIO`` through sfstore: :class:`SfstoreCheckpointIO`.

>>> import lightning.pytorch as pl
>>> from lightning.pytorch.callbacks import ModelCheckpoint
>>> from sfstore.checkpoint.lightning import SfstoreCheckpointIO
>>> trainer = pl.Trainer(plugins=[SfstoreCheckpointIO()],
...                      callbacks=[ModelCheckpoint(dirpath="sf://runs/exp1", save_top_k=1)])  # doctest: +SKIP
>>> trainer.fit(model)                                                   # doctest: +SKIP
>>> trainer.fit(model, ckpt_path="sf://runs/exp1/epoch=1-step=8.ckpt")   # resumes        # doctest: +SKIP

Every checkpoint Lightning saves (the module's ``state_dict``, optimizer and scheduler states, loops, callback
states such as ``ModelCheckpoint``'s, ``hyper_parameters``) goes through :func:`sfstore.checkpoint.save`: a
directory named as Lightning names the file (``epoch=1-step=8.ckpt``) holding safetensors shards and sfstore's
manifest, published atomically, checksummed, never pickled. Loads check the checksums and never unpickle.

Saving in the background: ``SfstoreCheckpointIO(async_save=True)`` saves with
:func:`sfstore.checkpoint.save_async` (training goes on once the tensors are copied into host buffers; a save of
a name, its removal and its load wait for the save before it). Lightning's own wrapper works too,
``Trainer(plugins=[AsyncCheckpointIO(SfstoreCheckpointIO())])`` (``lightning.pytorch.plugins.io``: it clones
the tensors and saves in a thread), with its own limit: ``ModelCheckpoint`` removes a checkpoint without waiting
for that thread, so one it drops while its save still runs is written afterwards and stays.

Paths: ``sf://a/b`` is ``<root>/a/b``, what the ``sf://`` filesystem names (Lightning's own file checks on
``ModelCheckpoint(dirpath="sf://...")`` and ``default_root_dir="sf://..."`` go through it and find the same
directories); any other path is a host path, relative ones from the working directory, as Lightning has them.

``LightningModule.load_from_checkpoint`` reads with ``torch.load`` and does not ask the plugin; load through it
instead: ``ckpt = SfstoreCheckpointIO().load_checkpoint(path)``, ``model = Model(**ckpt["hyper_parameters"])``,
``model.load_state_dict(ckpt["state_dict"])``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from sfstore import errors
from sfstore._optional import require
from sfstore.checkpoint import load as _load
from sfstore.checkpoint import location
from sfstore.checkpoint import save as _save
from sfstore.checkpoint import save_async as _save_async
from sfstore.checkpoint.save import SaveFuture
from sfstore.checkpoint.structure import flatten

require("lightning", "lightning", "sfstore.checkpoint.lightning")

from lightning.fabric.utilities.types import _PATH  # noqa: E402  (after the check that says which extra installs it)
from lightning.pytorch.plugins.io import CheckpointIO  # noqa: E402

__all__ = ["SfstoreCheckpointIO"]

_SAVE_OPTIONS = ("max_shard_bytes", "metadata")

# What to do about a value sfstore cannot store, by the top-level key of Lightning's checkpoint dict it is under.
_HINTS = {
    "hyper_parameters": "a hyper-parameter that is not plain data: leave it out of the checkpoint with "
    "self.save_hyperparameters(ignore=[...]) and pass it again when building the module",
    "datamodule_hyper_parameters": "a datamodule hyper-parameter that is not plain data: leave it out with "
    "self.save_hyperparameters(ignore=[...]) in the datamodule",
    "callbacks": "a callback's state_dict() holds something that is not plain data: return tensors, numbers, "
    "strings, bytes, lists, tuples and dicts of these",
}


def _url(path: _PATH | os.PathLike[str]) -> str:
    """The :mod:`sfstore.checkpoint` url of a path Lightning gives: ``sf://`` urls as they are, a host path
    otherwise (made absolute from the working directory: a bare name would mean the checkpoint root)."""
    text = os.fspath(path)
    if text.startswith(("sf://", "file://")):
        return text
    if "://" in text:
        raise errors.InvalidRequestError(
            f"SfstoreCheckpointIO saves to sf:// urls and host paths, not {text!r} (use Lightning's own "
            "TorchCheckpointIO there)"
        )
    return os.path.abspath(text)


def _unstorable(checkpoint: Mapping[str, Any], path: str,
                exc: errors.InvalidRequestError) -> errors.InvalidRequestError:
    """``exc`` (a value ``save`` refused, named by its key path) with the Lightning part it is in and what to do;
    ``exc`` itself where no part of the dict is refused (the metadata was, or the url)."""
    for key, value in checkpoint.items():
        try:
            flatten({key: value})
        except errors.InvalidRequestError:
            hint = _HINTS.get(str(key), "Lightning's checkpoint holds a value sfstore does not pickle")
            return errors.InvalidRequestError(f"cannot save the Lightning checkpoint {path}: {exc} ({hint})")
    return exc


class SfstoreCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` saving and loading through :mod:`sfstore.checkpoint` (see the module docs).

    Parameters
    ----------
    async_save : bool, optional
        Save with :func:`sfstore.checkpoint.save_async` (default False): ``save_checkpoint`` returns once the
        tensors are copied into host buffers (those are kept for the next save). One save runs at a time: the
        next ``save_checkpoint`` waits for the one before, and so do ``remove_checkpoint`` and
        ``load_checkpoint`` of its path; ``teardown`` (the end of ``fit``) waits for it. A background save's
        error is raised by the next call, or by ``teardown``.
    max_shard_bytes : int, optional
        Passed to :func:`sfstore.checkpoint.save` (default: its own, 1 GiB).
    verify : bool, optional
        Check every tensor's and shard's checksum on load (default True).

    Notes
    -----
    A save replaces an existing checkpoint of the same name atomically (Lightning saves ``last.ckpt`` again and
    again); something at that name that is not an sfstore checkpoint directory (an earlier ``torch.save`` file)
    is never replaced: :class:`~sfstore.errors.PathExistsError`. The checkpoint's manifest metadata carries
    Lightning's ``global_step`` as ``step`` and its ``epoch``, so :func:`sfstore.checkpoint.list` and ``latest``
    show them.
    """

    def __init__(self, *, async_save: bool = False, max_shard_bytes: int | None = None, verify: bool = True) -> None:
        self.async_save = async_save
        self.max_shard_bytes = max_shard_bytes
        self.verify = verify
        self._lock = threading.Lock()
        self._inflight: tuple[str, SaveFuture] | None = None  # the background save (async_save), by url

    def _finish(self, url: str | None = None) -> None:
        """Wait for the background save (only if it saves ``url``, when given); raise its error."""
        with self._lock:
            inflight = self._inflight
            if inflight is None or (url is not None and inflight[0] != url):
                return
            self._inflight = None
        inflight[1].get()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Save Lightning's ``checkpoint`` dict at ``path`` with :func:`sfstore.checkpoint.save`.

        Parameters
        ----------
        checkpoint : dict
            What the trainer gathered (``state_dict``, ``optimizer_states``, ``loops``, ``callbacks``,
            ``hyper_parameters``, ...).
        path : str or os.PathLike
            ``sf://...`` or a host path.
        storage_options : mapping, optional
            ``max_shard_bytes`` and ``metadata`` (plain JSON, merged over ``step``/``epoch``) for this save,
            from ``trainer.save_checkpoint(path, storage_options=...)``.

        Raises
        ------
        sfstore.errors.InvalidRequestError
            A value that cannot be stored without pickling (a hyper-parameter that is a module or a function, a
            callback state holding an object): the message names its key path and what to do. Nothing is
            written then. Unknown ``storage_options`` too.
        sfstore.errors.PathExistsError
            Something that is not an sfstore checkpoint is at ``path``.
        """
        options: dict[str, Any] = {}
        if storage_options is not None:
            if not isinstance(storage_options, Mapping) or any(k not in _SAVE_OPTIONS for k in storage_options):
                raise errors.InvalidRequestError(
                    f"SfstoreCheckpointIO takes storage_options with the keys {', '.join(_SAVE_OPTIONS)}, not "
                    f"{storage_options!r}"
                )
            options = dict(storage_options)
        metadata: dict[str, Any] = {}
        for ours, theirs in (("step", "global_step"), ("epoch", "epoch")):
            value = checkpoint.get(theirs)
            if isinstance(value, int) and not isinstance(value, bool):
                metadata[ours] = value
        metadata.update(options.get("metadata") or {})
        url = _url(path)
        shard = options.get("max_shard_bytes", self.max_shard_bytes)
        self._finish()  # one save at a time, in order; a failed background save is raised here
        try:
            if self.async_save:
                future = _save_async(checkpoint, url, overwrite=True, metadata=metadata, max_shard_bytes=shard)
                with self._lock:
                    self._inflight = (url, future)
            else:
                _save(checkpoint, url, overwrite=True, metadata=metadata, max_shard_bytes=shard)
        except errors.InvalidRequestError as exc:
            found = _unstorable(checkpoint, url, exc)
            if found is exc:
                raise
            raise found from None

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (checksums verified; nothing unpickled).

        Parameters
        ----------
        path : str or os.PathLike
            ``sf://...`` or a host path.
        map_location : str or torch.device, optional
            The device the tensors load on (default: the CPU, as views of the buffers the shards were read
            into; Lightning moves them where the module and optimizer are).
        weights_only : bool, optional
            Accepted for Lightning; nothing is ever unpickled here, whatever it says.

        Returns
        -------
        dict
            The checkpoint dict as saved.

        Raises
        ------
        sfstore.errors.PathNotFoundError
            Nothing at ``path`` (a ``FileNotFoundError``, as Lightning expects).
        sfstore.errors.InvalidRequestError
            ``map_location`` a function or a mapping (sfstore loads onto one device).
        sfstore.errors.CorruptCheckpointError
            A checksum mismatch or a malformed checkpoint.
        """
        import torch

        if map_location is None:
            device: str | torch.device = "cpu"
        elif isinstance(map_location, (str, torch.device)):
            device = map_location
        else:
            raise errors.InvalidRequestError(
                f"SfstoreCheckpointIO loads onto one device: map_location must be a str or torch.device, not "
                f"{type(map_location).__name__}"
            )
        url = _url(path)
        self._finish(url)
        state = _load(url, device=device, verify=self.verify)
        if not isinstance(state, dict):
            raise errors.InvalidRequestError(f"{os.fspath(path)} holds a {type(state).__name__}, not a Lightning "
                                             "checkpoint dict")
        return state

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the checkpoint at ``path`` (what ``ModelCheckpoint(save_top_k=...)`` drops).

        An sfstore checkpoint directory is renamed away first (readers never see it half removed); a plain file
        (a ``torch.save`` checkpoint from before) or a symlink is unlinked; nothing there is no error, as for
        Lightning's own ``TorchCheckpointIO``.

        Raises
        ------
        sfstore.errors.InvalidRequestError
            A directory there that is not an sfstore checkpoint (left as it is).
        """
        url = _url(path)
        self._finish(url)
        try:
            location.remove(location.locate(url, create=False))
        except errors.PathNotFoundError:
            return

    def teardown(self) -> None:
        """Wait for a background save (``async_save``); raise its error."""
        self._finish()
