"""``torch.distributed.checkpoint`` storage through sfstore: :class:`StorageWriter` and :class:`StorageReader`.

>>> import torch.distributed.checkpoint as dcp
>>> from sfstore.checkpoint.dcp import StorageReader, StorageWriter
>>> dcp.save(state_dict, storage_writer=StorageWriter("sf://run1/step-1000"))  # doctest: +SKIP
>>> dcp.load(state_dict, storage_reader=StorageReader("sf://run1/step-1000"))  # doctest: +SKIP

Where checkpoints live: ``"sf://a/b"`` is ``<root>/a/b``, the directory ``fsspec.filesystem("sf")`` calls
``sf://a/b`` (the ``sf://`` root: ``sfstore.open().file_path("dataset")``); a bare name ``"a/b"`` is ``a/b`` under
the checkpoint class root (``sfstore.open().file_path("checkpoint")``, ``<root>/checkpoints`` by default); an
absolute path (``/x/y/name`` or ``file:///x/y/name``) is that directory. Every file of a relative checkpoint is
named below its root and resolved beneath it at each use (:class:`~sfstore.paths.beneath.Beneath`), so ``..``
cannot climb out and a directory on the way swapped for a symlink to elsewhere is refused, never followed.

A second save to one checkpoint id replaces the first (``overwrite=True`` by default, as DCP's own
``FileSystemWriter``), atomically: the new data files get new names and the metadata is replaced in one rename,
so a load finds the old checkpoint or the new one. ``StorageWriter(url, overwrite=False)`` refuses instead.

DCP without this storage: ``dcp.save(state, checkpoint_id="sf://x")`` with no ``storage_writer`` is DCP's own
``FsspecWriter`` (DCP picks it for any url with a protocol fsspec knows); it writes DCP's own format -- a pickled
``.metadata`` and ``__<rank>_<n>.distcp`` files -- through the ``sf://`` filesystem into the same directory,
``<root>/x``, and ``dcp.load(state, checkpoint_id="sf://x")`` reads that back (unpickling ``.metadata``). The
two formats are separate: :class:`StorageReader` refuses a directory saved last in DCP's own format, naming the
reader that reads it, and :class:`StorageWriter` removes DCP's own files once its checkpoint replaced them.

Torch's format, for tools that want one ``torch.save`` file: :func:`to_torch_save` converts a checkpoint of this
storage (what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does for DCP's own format, which
it reads with ``FileSystemReader`` and cannot read from here); for DCP's own format under ``sf://``,
``dcp_to_torch_save(sfstore.fs.local_path("sf://x"), out)`` (its host directory). In the other direction,
``dcp.save(torch.load(path, weights_only=True), storage_writer=StorageWriter(url))``.

Layout of a checkpoint directory:

* one data file per rank, ``__<rank>_<token>.sfdcp``: the raw bytes of every item the rank's plan holds (tensor
  bytes in C order, exactly the chunk DCP asked to save; non-tensor items as the ``torch.save`` bytes DCP made),
  each item starting at a 4096-byte boundary. Tensor bytes go straight from the tensors' memory (a CPU,
  contiguous tensor is not copied; others are copied to host once) as one range per item through the file
  path, which splits it into parallel ``chunk_size`` requests on an ``O_DIRECT`` descriptor where the
  filesystem allows it (misaligned memory is bounced, a partial last block written through the page cache),
  then fsynced. ``<token>`` is new for every save, so an overwrite never touches the files the previous
  checkpoint still uses.
* ``sfstore-dcp-metadata.json``: DCP's ``Metadata`` (tensor properties, shapes and chunks, planner data, storage
  meta) and where each item lives (file, offset, length, ``xxh3_64`` of its bytes), as **JSON**, written last by
  the coordinator, atomically (temporary name, fsync, rename, directory fsync): the checkpoint exists once it
  does. Data files no longer referenced (a previous checkpoint's, a crashed save's) are removed afterwards.
  Without rank coordination (``dcp.save(..., use_collectives=False)``) each rank writes
  ``__<rank>.sfstore-dcp-metadata.json`` instead.

Security: nothing is ever unpickled from storage. DCP's own ``FileSystemWriter`` pickles its ``Metadata``;
here it is JSON with a closed set of types (decoding validates every field and raises
:class:`~sfstore.errors.CorruptCheckpointError`). Non-tensor state (what DCP serializes with ``torch.save`` into
``BytesIO`` items) is read back with ``torch.load(weights_only=True)`` only -- anything that loader refuses
(arbitrary classes, code) is a :class:`~sfstore.errors.CorruptCheckpointError` -- and the object it returns is
handed to the planner re-serialized, so even DCP's default planner (which calls ``torch.load(weights_only=False)``
in ``load_bytes``) never sees bytes that came from storage.

Integrity: every item's ``xxh3_64`` is recorded at save time. The reader verifies it (``verify=True``) for each
item it reads whole; a part of an item read while resharding is not verified (the checksum covers the whole
item). A mismatch, a truncated or missing data file, or metadata that does not parse raises
:class:`~sfstore.errors.CorruptCheckpointError` naming the file and the item.

Performance and memory: the writer keeps a window of about ``max(64 MiB, chunk_size x parallelism)`` of requests
in flight (at most two such windows of host copies, for GPU or non-contiguous tensors). The reader reads each
requested byte range straight into the planner's target tensor when that tensor is a contiguous CPU tensor of the
stored dtype and the range is contiguous in the file (the usual case, also when loading shards into a full-size
tensor along dimension 0); otherwise it reads the enclosing byte span into a temporary tensor and copies the
requested box out of it (temporaries are bounded by ``temp_budget`` per batch, one item may exceed it). Ranges of
one file are read as one batch (:meth:`~sfstore.paths.file.FilePath.submit`). Every byte is counted on the file
path under the ``checkpoint`` data class.

The modules: :mod:`~sfstore.checkpoint.dcp.directory` (where a checkpoint lives, its files' names),
:mod:`~sfstore.checkpoint.dcp.metadata_codec` (the JSON metadata), :mod:`~sfstore.checkpoint.dcp.writer`,
:mod:`~sfstore.checkpoint.dcp.reader` and :mod:`~sfstore.checkpoint.dcp.convert` (torch's format).
"""

from __future__ import annotations

from sfstore._optional import require

require("torch.distributed.checkpoint", "torch", "sfstore.checkpoint.dcp (torch.distributed.checkpoint)")

# E402: these come after the check, so that a missing torch is named with the extra that installs it
from sfstore.checkpoint.dcp.convert import to_torch_save  # noqa: E402
from sfstore.checkpoint.dcp.directory import (  # noqa: E402
    DATA_SUFFIX,
    METADATA_NAME,
    TORCH_METADATA_NAME,
    resolve_checkpoint_dir,
)
from sfstore.checkpoint.dcp.metadata_codec import DCP_VERSION as DCP_VERSION  # noqa: E402
from sfstore.checkpoint.dcp.metadata_codec import (  # noqa: E402
    FORMAT_VERSION,
    ItemLocation,
    decode_metadata,
    encode_metadata,
)
from sfstore.checkpoint.dcp.metadata_codec import MAX_METADATA_BYTES as MAX_METADATA_BYTES  # noqa: E402
from sfstore.checkpoint.dcp.metadata_codec import MAX_PLAIN_DEPTH as MAX_PLAIN_DEPTH  # noqa: E402
from sfstore.checkpoint.dcp.reader import StorageReader  # noqa: E402
from sfstore.checkpoint.dcp.writer import ITEM_ALIGN as ITEM_ALIGN  # noqa: E402
from sfstore.checkpoint.dcp.writer import StorageWriter  # noqa: E402

__all__ = [
    "StorageWriter",
    "StorageReader",
    "ItemLocation",
    "METADATA_NAME",
    "DATA_SUFFIX",
    "FORMAT_VERSION",
    "encode_metadata",
    "decode_metadata",
    "resolve_checkpoint_dir",
    "to_torch_save",
    "TORCH_METADATA_NAME",
]
