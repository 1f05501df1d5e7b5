"""The ``transformers.TrainerCallback`` that commits each checkpoint a Hugging Face ``Trainer`` saves:
:class:`SfstoreTrainerCallback`. Needs transformers and torch (``pip install 'sfstore[hf]'``).

It is also :data:`sfstore.checkpoint.hf_trainer.SfstoreTrainerCallback`; the commit records it writes and
:func:`~sfstore.checkpoint.hf_trainer.last_committed_checkpoint`, which finds them, are in
:mod:`sfstore.checkpoint.hf_trainer`, which needs neither.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from sfstore import errors
from sfstore._optional import require
from sfstore.checkpoint.hf_trainer import COMMIT_NAME, commit_checkpoint
from sfstore.paths.file import fsync_dir

require("torch", "hf", "sfstore.checkpoint.hf_trainer's SfstoreTrainerCallback")
require("transformers", "hf", "sfstore.checkpoint.hf_trainer's SfstoreTrainerCallback")

# E402: after the checks, so that a missing package is named with the extra that installs it
import torch  # noqa: E402
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

__all__ = ["SfstoreTrainerCallback"]

# The commit records' own logger: one logger for everything about them, whichever module writes the message.
log = logging.getLogger("sfstore.checkpoint.hf_trainer")


def _uncommit(directory: str) -> None:
    """Remove ``directory``'s commit record (if any), durably, before the ``Trainer`` writes over its files."""
    record = os.path.join(directory, COMMIT_NAME)
    try:
        os.unlink(record)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO,
                              "cannot remove the commit record of a checkpoint about to be written over",
                              record) from None
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, "cannot sync the checkpoint directory", directory) from None
    log.info("sfstore: %s is about to be saved again; its commit record is removed until the save is done",
             directory)


def _barrier() -> None:
    """Wait for every rank (each writes its own files of a checkpoint, e.g. ``rng_state_<rank>.pth``)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


class SfstoreTrainerCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that commits each checkpoint the ``Trainer`` saves.

    ``on_save`` runs once the ``Trainer`` has written ``checkpoint-N`` (model, optimizer, scheduler, RNG and
    trainer state) and rotated old checkpoints away; it then calls :func:`commit_checkpoint` on it, so
    :func:`last_committed_checkpoint` finds it. Before a save that writes over an existing ``checkpoint-N`` (a
    run resumed from an earlier step goes through the same steps again), its old record is removed first, so a
    save cut short there is never taken for the old, committed one.

    Only the process that writes the ``Trainer``'s own files (``args.should_save``: world rank 0, or each
    node's first process with ``save_on_each_node``) writes records. In a distributed run
    (``torch.distributed`` initialized) the ranks meet at a ``torch.distributed.barrier`` before the commit, as
    each writes files of its own into the checkpoint, and after an old record's removal, before any rank writes.

    Notes
    -----
    Commit costs one read of the checkpoint's bytes (just written, so mostly from the page cache) and the
    ``fsync`` the ``Trainer`` never does. ``sfstore`` does not read the ``Trainer``'s pickled files
    (``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``training_args.bin``) other than as bytes to
    checksum.

    With ``save_strategy="best"`` the ``Trainer`` decides to save only after evaluating, so a record of the step
    being evaluated is removed at each evaluation (a save may follow) and rewritten when it does.
    """

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if args.should_save and args.save_total_limit == 1:
            log.warning(
                "sfstore: save_total_limit=1 removes the last committed checkpoint before the new one is "
                "committed: a run killed in between has no checkpoint to resume from (use 2 or more)")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if control.should_save:
            self._before_save(args, state)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if control.should_save:
            self._before_save(args, state)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if args.save_strategy == "best":
            self._before_save(args, state)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        _barrier()
        if not args.should_save:
            return
        directory = self._directory(args, state)
        if not os.path.isdir(directory):
            # A hyper-parameter search saves under output_dir/run-<trial>/: not a layout this marks.
            log.warning("sfstore: %s was not written where expected; no commit record for it", directory)
            return
        commit_checkpoint(directory)
        log.info("sfstore: committed %s", directory)

    def _before_save(self, args: TrainingArguments, state: TrainerState) -> None:
        if args.should_save:
            directory = self._directory(args, state)
            if os.path.isdir(directory):
                _uncommit(directory)
        # No rank starts writing its own files over the folder while the record may still be there.
        _barrier()

    @staticmethod
    def _directory(args: TrainingArguments, state: TrainerState) -> str:
        # TrainingArguments sets output_dir ("trainer_output" when not given); the Trainer saves beneath it.
        return os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
