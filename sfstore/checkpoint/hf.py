"""Hugging Face layouts: the directories ``save_pretrained`` writes and ``from_pretrained`` reads.

A Hugging Face model directory holds its weights as ``model.safetensors`` (one file) or as shards named
``model-00001-of-00003.safetensors`` ... with ``model.safetensors.index.json``, whose ``weight_map`` says which
shard holds each tensor (and whose ``metadata.total_size`` is their bytes). Every shard is a plain safetensors
file carrying ``{"format": "pt"}`` as its metadata.

Both ways:

- :func:`sfstore.checkpoint.save` of a flat state dict (``str`` keys, torch tensors, as ``model.state_dict()``
  gives) names its shards this way and writes the index beside ``sfstore-manifest.json`` (see
  :func:`hf_layout`), so ``from_pretrained`` reads the directory once a ``config.json`` is there; sfstore's
  load still goes by the manifest and checks its sums.
- :func:`sfstore.checkpoint.load` of a directory without a manifest reads it as a Hugging Face directory
  (:func:`directory_manifest`): the same shard reads as a checkpoint's, with a manifest made from the index
  and the shards' headers (there are no sums to check). A plain ``.safetensors`` file gets one too
  (:func:`file_manifest`).

Every name the index gives is a plain file name inside the directory (anything else is a
:class:`~sfstore.errors.CorruptCheckpointError`), opened beneath the file path's root: symlinks are followed
only where they stay beneath that root.

The hub's cache (``~/.cache/huggingface/hub``) keeps each repository as ``models--<org>--<name>/`` holding
``blobs/<hash>`` (the files' bytes), ``refs/<branch>`` (a commit) and ``snapshots/<commit>/``, whose files are
relative symlinks into ``../../blobs``. The root of a host path is the directory's parent, ``snapshots``, which
those links leave; so for a directory ``<repo>/snapshots/<rev>`` (or a folder inside it) whose ``<repo>`` holds
a ``blobs`` directory, the root is ``<repo>`` (:func:`hub_snapshot`): links into its blobs resolve, and a link
that leads anywhere outside ``<repo>`` is still a :class:`~sfstore.errors.PathEscapeError`.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from sfstore import errors
from sfstore.checkpoint import location
from sfstore.checkpoint import safetensors_format as stf
from sfstore.checkpoint.location import DATA_CLASS
from sfstore.checkpoint.manifest import MANIFEST_NAME, Manifest, ShardRecord, TensorRecord
from sfstore.checkpoint.structure import Leaf
from sfstore.paths.base import Range
from sfstore.paths.file import FilePath, OpenFile

__all__ = [
    "WEIGHTS_NAME",
    "INDEX_NAME",
    "MAX_INDEX_BYTES",
    "shard_names",
    "hf_layout",
    "index_json",
    "read_index",
    "directory_manifest",
    "file_manifest",
    "not_a_safetensors_file",
    "foreign_format",
    "pickled_weights",
    "SNAPSHOTS_NAME",
    "BLOBS_NAME",
    "hub_snapshot",
]

WEIGHTS_NAME = "model.safetensors"
"""The one weights file of an unsharded Hugging Face model directory."""
INDEX_NAME = "model.safetensors.index.json"
"""The index of a sharded Hugging Face model directory."""
SNAPSHOTS_NAME = "snapshots"
"""The folder of a hub cache repository that holds one directory per revision."""
BLOBS_NAME = "blobs"
"""The folder of a hub cache repository that holds the files' bytes, which the snapshots link to."""
MAX_INDEX_BYTES = 256 << 20
"""Largest index read, in bytes (a model of 100k tensors has an index of a few MiB)."""
HEADER_PREFIX = 64 << 10
"""Bytes read from the start of each shard in the first pass over headers; larger headers take a second read."""
_MAX_INDEX_DEPTH = 16


def shard_names(count: int) -> list[str]:
    """The Hugging Face names of ``count`` shard files: ``model.safetensors`` for one, else
    ``model-00001-of-000NN.safetensors`` ... (numbered from 1, as ``save_pretrained`` does)."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def hf_layout(state_dict: Any, leaves: Sequence[Leaf]) -> bool:
    """Whether a save of ``state_dict`` (flattened into ``leaves``) takes the Hugging Face layout.

    It does when ``state_dict`` is a non-empty mapping whose keys are ``str`` and whose values are torch
    tensors, each stored under its own key (no escaping: a key holding ``/`` or ``~`` would be renamed in the
    shard, and ``from_pretrained`` would not find it). The same tensor under two keys (tied weights) is stored
    once, under the first, as ``save_pretrained`` stores it. Anything else (nesting, non-tensor values, numpy
    arrays) is no model's weights, and keeps sfstore's own shard names.
    """
    import torch

    if not isinstance(state_dict, Mapping) or not state_dict:
        return False
    for key, value in state_dict.items():
        if type(key) is not str or not isinstance(value, torch.Tensor):
            return False
    return all(leaf.kind == "torch" and leaf.path == (leaf.name,) for leaf in leaves)


def index_json(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """The bytes of ``model.safetensors.index.json`` as ``save_pretrained`` writes it (names sorted)."""
    obj = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _bad_index(path: str, why: str) -> errors.CorruptCheckpointError:
    return errors.CorruptCheckpointError(f"{INDEX_NAME} {path}: {why}")


def _plain(name: object, path: str, tensor: str) -> str:
    if not isinstance(name, str) or not name:
        raise _bad_index(path, f"tensor {tensor!r} maps to {name!r}, not a file name")
    if "/" in name or "\x00" in name or name in (".", ".."):
        raise _bad_index(path, f"tensor {tensor!r} maps to {name!r}, which escapes the directory (only plain "
                               f"file names are allowed)")
    return name


def read_index(fp: FilePath, path: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name to shard file) of the index at ``path`` (absolute, inside ``fp``).

    Read beneath the root through the file path (a FIFO or device in its place is refused without blocking).
    Raises :class:`~sfstore.errors.CorruptCheckpointError` for anything but a JSON object whose
    ``weight_map`` maps names to plain file names; ``metadata`` is not checked (writers disagree on what
    ``total_size`` counts).
    """
    raw = location.read_regular(fp, path, limit=MAX_INDEX_BYTES, what="index")
    if not stf.json_depth_within(raw, _MAX_INDEX_DEPTH):
        raise _bad_index(path, f"JSON nests deeper than {_MAX_INDEX_DEPTH} levels")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=stf.no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad_index(path, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _bad_index(path, "not a JSON object")
    weight_map = obj.get("weight_map")
    if not isinstance(weight_map, dict):
        raise _bad_index(path, "has no weight_map object")
    return {str(name): _plain(file, path, name) for name, file in weight_map.items()}


def not_a_safetensors_file(path: str) -> errors.InvalidRequestError:
    """The error for a JSON file (an index, a manifest) given where a safetensors file or a directory goes."""
    name = os.path.basename(path)
    parent = os.path.dirname(path) or "."
    if name == MANIFEST_NAME:
        what = "an sfstore checkpoint's manifest"
    elif name.endswith(".index.json"):
        what = "a Hugging Face index of shards"
    else:
        what = "a JSON file"
    return errors.InvalidRequestError(
        f"{path} is {what}, not a safetensors file: pass its directory ({parent}) to load the whole checkpoint, "
        f"or one .safetensors shard file (with into=... to fill the tensors it holds)"
    )


_CONVERT = (
    "sfstore never unpickles (a pickle runs code when it is loaded). Convert it once, where you trust the file: "
    "load it with `torch.load` and `weights_only=True`, then `sfstore.checkpoint.save(state, url)` (or "
    "`safetensors.torch.save_file(state, 'model.safetensors')`)"
)


def foreign_format(prefix: bytes, path: str) -> errors.UnsupportedFormatError | None:
    """The error for a file that is not safetensors but a format sfstore never reads (a ``torch.save`` zip, a
    legacy ``torch.save`` or any pickle of protocol 2 to 5, a NumPy ``.npy``/``.npz``), judged from its first
    bytes; ``None`` otherwise. Nothing is unpickled: only the magic bytes are looked at.

    A safetensors file has its JSON header at byte 8 (``{``), so one whose first byte happens to be ``0x80``
    (a header length of 128 + 256k bytes) still loads as safetensors.
    """
    if len(prefix) > 8 and prefix[8:9] == b"{":
        return None
    if prefix[:4] == b"PK\x03\x04":
        name_len = int.from_bytes(prefix[26:28], "little") if len(prefix) >= 30 else 0
        first = prefix[30:30 + name_len].decode("utf-8", "replace")
        if first.endswith(".pkl"):
            return errors.UnsupportedFormatError(
                f"{path} is a torch.save file (a zip archive holding the pickle {first}), not safetensors. {_CONVERT}"
            )
        if first.endswith(".npy"):
            return errors.UnsupportedFormatError(
                f"{path} is a NumPy .npz archive, not safetensors: load it with numpy.load(path, allow_pickle=False) "
                "and save the arrays with sfstore.checkpoint.save"
            )
        return errors.UnsupportedFormatError(f"{path} is a zip archive, not a safetensors file")
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return errors.UnsupportedFormatError(
            f"{path} is a pickle (protocol {prefix[1]}; a legacy torch.save file or pytorch_model.bin), not "
            f"safetensors. {_CONVERT}"
        )
    if prefix[:6] == b"\x93NUMPY":
        return errors.UnsupportedFormatError(
            f"{path} is a NumPy .npy file, not safetensors: load it with numpy.load(path, allow_pickle=False) and "
            "save the array with sfstore.checkpoint.save"
        )
    return None


def _looks_like_json(prefix: bytes) -> bool:
    # A safetensors file starts with a little-endian length whose high bytes are zero: never '{"'.
    return prefix[:2] in (b'{"', b"{\n", b"{ ", b"{}")


def _headers(fp: FilePath, files: list[tuple[str, OpenFile, int]], bare: bool) -> list[stf.Header]:
    """The validated header of each open file: the first bytes of every file in one batch, then a second batch
    for the files whose header is longer."""
    prefixes = [bytearray(min(size, HEADER_PREFIX)) for _name, _of, size in files]
    ranges = [Range.read(0, len(buf), buf, 0, of) for buf, (_n, of, _s) in zip(prefixes, files, strict=True)]
    got = fp.submit(ranges, data_class=DATA_CLASS).get() if ranges else []
    heads: list[bytes] = []
    longer: list[int] = []
    for i, ((name, _of, size), buf, n) in enumerate(zip(files, prefixes, got, strict=True)):
        head = bytes(memoryview(buf)[:n])
        unsupported = foreign_format(head, files[i][1].path)
        if unsupported is not None:
            raise unsupported
        try:
            length = stf.header_length(head, size, shard=name)
        except errors.CorruptCheckpointError:
            if bare and _looks_like_json(head):
                raise not_a_safetensors_file(files[i][1].path) from None
            raise
        heads.append(head)
        if 8 + length > len(head):
            longer.append(i)
    if longer:
        extra = {i: bytearray(8 + stf.header_length(heads[i], files[i][2], shard=files[i][0])) for i in longer}
        more = fp.submit([Range.read(0, len(extra[i]), extra[i], 0, files[i][1]) for i in longer],
                         data_class=DATA_CLASS).get()
        for i, n in zip(longer, more, strict=True):
            heads[i] = bytes(memoryview(extra[i])[:n])
    return [stf.parse_header(head, size, shard=name) for head, (name, _of, size) in zip(heads, files, strict=True)]


def _record(entry: stf.Entry, file: str) -> TensorRecord:
    try:
        dtype, shape = stf.st_to_torch(entry)
    except errors.CorruptCheckpointError as exc:
        raise errors.CorruptCheckpointError(f"{file}: {exc}", shard=file, tensor=entry.name) from None
    stf.torch_dtype(dtype)  # a dtype this torch lacks is refused here, naming it
    return TensorRecord(entry.name, file, "torch", dtype, shape, entry.nbytes, "")


def _manifest(fp: FilePath, directory: str, wanted: Mapping[str, Sequence[str] | None], bare: bool) -> Manifest:
    """A manifest for safetensors files written by another tool: ``wanted`` maps each file of ``directory``
    to the tensors to load from it (``None``: all, in data order). Shard sizes and tensor records come from
    the files' headers, read now; the tensor sums are empty (nothing to check)."""
    opened: list[tuple[str, OpenFile, int]] = []
    try:
        for file in wanted:
            try:
                of = fp.open_file(os.path.join(directory, file))
            except errors.PathNotFoundError:
                if bare:
                    raise
                raise errors.CorruptCheckpointError(f"shard {file} (listed in {INDEX_NAME}) is missing",
                                                    shard=file) from None
            except (errors.NotARegularFileError, errors.IsADirectoryPathError) as exc:
                if bare:
                    raise
                raise errors.CorruptCheckpointError(f"shard {file} is not a regular file ({exc})",
                                                    shard=file) from None
            opened.append((file, of, of.size))
        headers = _headers(fp, opened, bare)
    finally:
        for _file, of, _size in opened:
            of.close()
    tensors: dict[str, TensorRecord] = {}
    shards: list[ShardRecord] = []
    for (file, _of, size), header in zip(opened, headers, strict=True):
        names = wanted[file]
        for name in header.entries if names is None else names:
            entry = header.entries.get(name)
            if entry is None:
                raise errors.CorruptCheckpointError(
                    f"{INDEX_NAME} maps tensor {name!r} to {file}, which does not hold it", shard=file, tensor=name
                )
            tensors[name] = _record(entry, file)
        shards.append(ShardRecord(file, size, "", None))
    structure = {"dict": [[name, {"tensor": name}] for name in tensors]}
    return Manifest(created_ns=0, metadata={}, structure=structure, tensors=tensors, shards=shards)


def file_manifest(fp: FilePath, path: str) -> Manifest:
    """The manifest of the plain safetensors file ``path`` (absolute, inside ``fp``): every tensor of it,
    in data order, by its name."""
    if path.endswith(".json"):
        raise not_a_safetensors_file(path)
    return _manifest(fp, os.path.dirname(path), {os.path.basename(path): None}, bare=True)


def _is_file(fp: FilePath, path: str) -> bool:
    try:
        return stat.S_ISREG(fp.stat(path).st_mode)
    except errors.PathEscapeError:
        raise  # a weights file that links out of the root is refused as such, not taken for a missing one
    except errors.SfstoreError:
        return False


def hub_snapshot(loc: location.Location) -> location.Location | None:
    """Where to load the Hugging Face hub cache snapshot ``loc`` from: the same directory beneath its
    repository folder, or ``None`` when ``loc`` is no such snapshot.

    ``loc`` is one when it was given as a host path (an ``sf://`` url or a name keeps its root, which is
    never widened) naming ``<repo>/snapshots/<rev>`` or a folder inside it, symlinks in its parent resolved,
    and ``<repo>/blobs`` is a directory (not a link), looked at beneath ``<repo>``. The location returned
    resolves every name beneath ``<repo>``: the snapshot's links into ``../../blobs`` are followed, a link out
    of ``<repo>`` is a :class:`~sfstore.errors.PathEscapeError`. The nearest ``snapshots`` above ``loc`` whose
    parent has blobs is the one taken (the narrowest root).
    """
    kind, _text = location.split_url(loc.url)
    if kind != location.ABSOLUTE or loc.rel:
        return None
    parts = [p for p in loc.parent.split("/") if p]  # loc.parent is its root: symlinks resolved
    for i in range(len(parts) - 1, 0, -1):  # parts[i] is "snapshots" with <rev> below it, <repo> above
        if parts[i] != SNAPSHOTS_NAME:
            continue
        repo = "/" + "/".join(parts[:i])
        try:
            fp = location.file_path(repo, False)
            if not stat.S_ISDIR(fp.stat(BLOBS_NAME, follow=False).st_mode):
                continue
        except errors.SfstoreError:
            continue
        rel = "/".join(parts[i:])
        return location.Location(fp, os.path.join(fp.root, rel), loc.name, loc.url, rel)
    return None


PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "training_args.bin", "optimizer.pt")
"""Pickled files a Hugging Face (or Trainer) directory may hold instead of safetensors weights."""


def pickled_weights(fp: FilePath, directory: str) -> str:
    """A note for the error of a model directory without safetensors weights that holds pickles instead
    (``pytorch_model.bin``, a Trainer's ``optimizer.pt``): what they are and how to convert them; ``""`` when it
    holds none of :data:`PICKLED_WEIGHTS`."""
    found = [name for name in PICKLED_WEIGHTS if _is_file(fp, os.path.join(directory, name))]
    if not found:
        return ""
    return (
        f"; it holds only pickles ({', '.join(found)}), which sfstore never reads. {_CONVERT}; transformers: "
        "`AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`"
    )


def directory_manifest(fp: FilePath, directory: str) -> Manifest | None:
    """The manifest of the Hugging Face model directory ``directory``, or ``None`` when it holds neither
    ``model.safetensors`` nor ``model.safetensors.index.json`` (``model.safetensors`` first, as
    ``from_pretrained`` looks). Tensors come in the index's order, shards are read in name order."""
    if _is_file(fp, os.path.join(directory, WEIGHTS_NAME)):
        return _manifest(fp, directory, {WEIGHTS_NAME: None}, bare=False)
    index = os.path.join(directory, INDEX_NAME)
    try:
        weight_map = read_index(fp, index)
    except errors.PathNotFoundError:
        return None
    by_file: dict[str, list[str]] = {file: [] for file in sorted(set(weight_map.values()))}
    for name, file in weight_map.items():
        by_file[file].append(name)
    manifest = _manifest(fp, directory, by_file, bare=False)
    manifest.tensors = {name: manifest.tensors[name] for name in weight_map}
    manifest.structure = {"dict": [[name, {"tensor": name}] for name in weight_map]}
    return manifest
