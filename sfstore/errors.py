"""Typed errors of sfstore.

Every error sfstore raises is a :class:`SfstoreError`. Each subclass also mixes in the builtin exception
that fits, so callers that already catch ``FileNotFoundError``, ``PermissionError``, ``ValueError`` or
``OSError`` keep working. Errors that come from the operating system carry ``errno`` and, where one is
known, the ``filename`` (path) in their message.
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "SfstoreError",
    "ConfigError",
    "ReadOnlyRootError",
    "SfstoreWarning",
    "ConfigWarning",
    "InvalidRequestError",
    "BufferTooSmallError",
    "ReadOnlyBufferError",
    "AlignmentError",
    "BufferInUseError",
    "PoolExhaustedError",
    "OutOfResourcesError",
    "EngineUnavailableError",
    "SfstoreOSError",
    "BadFileDescriptorError",
    "NoSpaceError",
    "IOEngineError",
    "ChecksumMismatchError",
    "PathNotFoundError",
    "PathExistsError",
    "AccessDeniedError",
    "IsADirectoryPathError",
    "NotADirectoryPathError",
    "NotARegularFileError",
    "PathEscapeError",
    "IOTimeoutError",
    "RegistrationError",
    "CorruptCheckpointError",
    "UnsupportedFormatError",
    "NotSupportedOnHostError",
    "NvmeError",
    "StoreInUseError",
    "ValueTooLargeError",
    "InvalidKeyError",
    "CorruptStoreError",
    "MissingDependencyError",
    "native_error",
    "os_error",
]


class SfstoreError(Exception):
    """Base class of every error sfstore raises."""


class ConfigError(SfstoreError, ValueError):
    """A setting (environment variable, config file key or ``defaults.set`` argument) is invalid."""


class ReadOnlyRootError(ConfigError, PermissionError):
    """A data class that must write (checkpoint saves, the KV cache, the block image) has a root it cannot
    write: a read-only mount, or no permission. Reads from it still work; the message names the setting that
    points the class elsewhere (``[classes.<name>] root``, ``root``, ``SFSTORE_ROOT``, ``SFSTORE_DATA_DIR``)."""


class SfstoreWarning(UserWarning):
    """Base class of every warning sfstore gives."""


class ConfigWarning(SfstoreWarning):
    """The configuration holds something sfstore ignores: an ``SFSTORE_*`` variable it does not know
    (misspelt?). Given once per name and process."""


class InvalidRequestError(SfstoreError, ValueError):
    """An I/O request is malformed (negative offset or length, bad operation); raised before any I/O."""


class BufferTooSmallError(InvalidRequestError):
    """The buffer cannot hold ``length`` bytes at ``buffer_offset``; raised before any I/O."""


class ReadOnlyBufferError(SfstoreError, TypeError):
    """A read was asked to land in a read-only buffer (e.g. ``bytes``); raised before any I/O.

    Mixes in ``TypeError`` as ``io.RawIOBase.readinto(bytes)`` does.
    """


class AlignmentError(InvalidRequestError):
    """A request on an ``O_DIRECT`` file descriptor is misaligned and bounce buffers are disabled."""


class BufferInUseError(SfstoreError, BufferError):
    """A registered buffer was released while views of it (numpy, torch, slices) are still alive."""


class PoolExhaustedError(SfstoreError, MemoryError):
    """A buffer pool reached its ``max_buffers`` limit and no buffer was returned in time."""


class EngineUnavailableError(SfstoreError, RuntimeError):
    """The I/O engine asked for (``SFSTORE_ENGINE``) cannot run here; the message says why."""


class SfstoreOSError(SfstoreError, OSError):
    """An operating-system error, with ``errno``, ``strerror`` and ``filename`` set as in ``OSError``."""


class OutOfResourcesError(SfstoreOSError, MemoryError):
    """Memory or threads ran out (``errno`` ENOMEM or EAGAIN): a buffer, a bounce buffer or a thread an operation
    needs could not be had. Raised instead of aborting; the object that raised it says whether it is still usable
    (an engine that cannot go on raises :class:`EngineUnavailableError` from then on)."""


class BadFileDescriptorError(SfstoreOSError):
    """A request names a closed file descriptor, or one not opened for the operation (EBADF)."""


class NoSpaceError(SfstoreOSError):
    """The device or filesystem is full (ENOSPC, EDQUOT)."""


class IOEngineError(SfstoreOSError):
    """A request failed in the I/O engine; the message names the request, file offset and path."""


class ChecksumMismatchError(IOEngineError):
    """A read's bytes do not have the checksum the caller gave with it (EBADMSG); the buffer holds them."""


class PathNotFoundError(SfstoreOSError, FileNotFoundError):
    """A path (or key) does not exist."""


class PathExistsError(SfstoreOSError, FileExistsError):
    """A path that must not exist yet does (EEXIST)."""


class AccessDeniedError(SfstoreOSError, PermissionError):
    """The operating system refused access (EACCES, EPERM)."""


class IsADirectoryPathError(SfstoreOSError, IsADirectoryError):
    """A file operation named a directory (EISDIR)."""


class NotADirectoryPathError(SfstoreOSError, NotADirectoryError):
    """A directory operation named something that is not one (ENOTDIR)."""


class NotARegularFileError(SfstoreOSError):
    """A read named something that is not a regular file: a FIFO, socket or device (errno ``EINVAL``).

    It is refused after an ``O_NONBLOCK`` open and ``fstat``, so a FIFO without a writer cannot hang the caller.
    """


class PathEscapeError(SfstoreError, PermissionError):
    """A path or key would leave its root (``..``, an absolute path elsewhere, or a symlink out)."""


class IOTimeoutError(SfstoreError, TimeoutError):
    """Waiting for an I/O future timed out (the I/O itself goes on)."""


class CorruptCheckpointError(SfstoreError, ValueError):
    """A checkpoint's bytes do not match its manifest (checksum, size, header); the message names the shard
    and, where known, the tensor. Nothing from it is returned."""

    def __init__(self, message: str, *, shard: str | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.shard = shard
        self.tensor = tensor


class UnsupportedFormatError(SfstoreError, ValueError):
    """A file is in a format sfstore does not read: a pickle (``torch.save``, ``pytorch_model.bin``) is never
    unpickled. The message names the format found and how to convert the file. Nothing from it is returned."""


class RegistrationError(SfstoreOSError):
    """Registering memory with CUDA or an RDMA protection domain failed."""


class NotSupportedOnHostError(SfstoreError, NotImplementedError):
    """The feature needs hardware or kernel support this host lacks (the message names what)."""


class NvmeError(SfstoreOSError):
    """Connecting, discovering or disconnecting an NVMe-over-Fabrics controller failed.

    ``errno`` is the kernel's (or libnvme's) error where it is known (``ECONNREFUSED``, ``EALREADY``,
    ``ETIMEDOUT``, ...), else ``EIO``; ``target`` is the :class:`sfstore.nvme.NvmeofTarget` (or controller
    name) the operation was for.
    """

    def __init__(self, err: int, message: str, target: object = None) -> None:
        super().__init__(err, message)
        self.target = target


class StoreInUseError(SfstoreOSError):
    """The store (a block device or image file) is open in another process or object: opened exclusively."""


class ValueTooLargeError(InvalidRequestError):
    """A value is larger than the store's largest size class; raised before anything is written."""


class InvalidKeyError(InvalidRequestError):
    """A key is empty, too long, or neither ``bytes`` nor ``str``; raised before any I/O."""


class CorruptStoreError(SfstoreError, ValueError):
    """A store's on-disk metadata (superblock, state, index snapshot) is damaged, or the device holds data
    that is not a store (it is never formatted over without being asked)."""


class MissingDependencyError(SfstoreError, ImportError):
    """An optional package that a part of sfstore needs is not installed (or fails to import).

    The message names the part, the package and the extra that installs it
    (``pip install 'sfstore[hf]'``); ``name`` is the package's module name, as for ``ImportError``, and
    ``extra`` the extra's name.
    """

    def __init__(self, message: str, *, name: str, extra: str) -> None:
        super().__init__(message, name=name)
        self.extra = extra


_OS_CLASSES: dict[int, type[SfstoreOSError]] = {
    _errno.EBADF: BadFileDescriptorError,
    _errno.ENOSPC: NoSpaceError,
    _errno.EDQUOT: NoSpaceError,
    _errno.ENOENT: PathNotFoundError,
    _errno.EEXIST: PathExistsError,
    _errno.EACCES: AccessDeniedError,
    _errno.EPERM: AccessDeniedError,
    _errno.EISDIR: IsADirectoryPathError,
    _errno.ENOTDIR: NotADirectoryPathError,
}

_ENGINE_CLASSES: dict[int, type[SfstoreOSError]] = {
    _errno.EBADMSG: ChecksumMismatchError,
    _errno.EBADF: BadFileDescriptorError,
    _errno.ENOMEM: OutOfResourcesError,
    _errno.ENOSPC: NoSpaceError,
    _errno.EDQUOT: NoSpaceError,
}

_NATIVE_KINDS: dict[str, type[SfstoreError]] = {
    "invalid": InvalidRequestError,
    "too_small": BufferTooSmallError,
    "read_only": ReadOnlyBufferError,
    "alignment": AlignmentError,
    "in_use": BufferInUseError,
    "exhausted": PoolExhaustedError,
    "registration": RegistrationError,
    "resources": OutOfResourcesError,
    "unavailable": EngineUnavailableError,
}


def os_error(
    err: int, context: str, path: str | None = None, cls: type[SfstoreOSError] | None = None
) -> SfstoreOSError:
    """Build the typed ``OSError`` subclass for ``err`` with ``context`` and ``path`` in the message.

    With ``cls`` None the class follows the errno (``ENOENT`` -> :class:`PathNotFoundError`, ``EACCES`` ->
    :class:`AccessDeniedError`, ...). With ``cls=IOEngineError`` (a failed I/O request) only the errnos a
    caller acts on differently keep their own class: ``ENOSPC``/``EDQUOT`` and ``EBADF``.
    """
    if cls is IOEngineError:
        cls = _ENGINE_CLASSES.get(err, IOEngineError)
    elif cls is None:
        cls = _OS_CLASSES.get(err, SfstoreOSError)
    msg = f"{context}: {os.strerror(err)}"
    if path is not None:
        return cls(err, msg, path)
    return cls(err, msg)


def native_error(kind: str, err: int, message: str, path: str | None = None) -> SfstoreError:
    """Map an error reported by ``sfstore._native`` (or the pure-Python engine) to its typed class.

    ``kind`` is ``"os"`` for an operating-system error (``err`` is the errno) or one of the request
    kinds (``"invalid"``, ``"too_small"``, ``"read_only"``, ``"alignment"``, ``"in_use"``,
    ``"exhausted"``, ``"registration"``, ``"resources"``: memory or threads ran out, ``"unavailable"``: the
    engine is closed or stopped).
    """
    if kind == "os":
        return os_error(err, message, path, IOEngineError)
    cls = _NATIVE_KINDS.get(kind, SfstoreError)
    if issubclass(cls, OSError):
        return os_error(err or _errno.EIO, message, path, cls)  # type: ignore[arg-type]
    return cls(message if path is None else f"{message} [{path}]")
